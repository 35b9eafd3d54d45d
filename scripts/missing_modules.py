"""Which modules an import needs that this host lacks (for staging an offline GPU host): imports ``--module``
repeatedly, each time standing in an empty module for the one that was missing, and prints every missing name.

    python3 scripts/missing_modules.py --module vllm.entrypoints.openai.api_server
"""

from __future__ import annotations

import argparse
import importlib
import sys
import types


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--module", action="append", required=True)
    ap.add_argument("--tries", type=int, default=60)
    args = ap.parse_args()
    missing: list[str] = []
    for _ in range(args.tries):
        for name in [m for m in list(sys.modules) if m.startswith(tuple(args.module))]:
            sys.modules.pop(name, None)
        try:
            for m in args.module:
                importlib.import_module(m)
            break
        except ModuleNotFoundError as e:
            if e.name is None or e.name in missing:
                print(f"stuck at {e!r}")
                break
            missing.append(e.name)
            stub = types.ModuleType(e.name)
            stub.__path__ = []  # a package, so submodule imports fail as missing too and get listed
            stub.__getattr__ = lambda attr: type(attr, (), {})  # any name imported from it exists
            sys.modules[e.name] = stub
        except Exception as e:  # noqa: BLE001 -- a stand-in lacked something: report it and stop
            print(f"stopped at {type(e).__name__}: {e}")
            break
    print("MISSING " + " ".join(missing))
    return 0


if __name__ == "__main__":
    sys.exit(main())
