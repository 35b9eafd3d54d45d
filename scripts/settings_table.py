"""Write docs/settings.md's table of ``MIA_STREAM_*`` settings from ``mia_stream.settings.SETTINGS``.

    python scripts/settings_table.py            # rewrite the table in docs/settings.md
    python scripts/settings_table.py --check    # exit 1 if docs/settings.md's table is not what SETTINGS says

The table sits between the two marker lines below; everything else in the file is left alone.
tests/test_settings.py runs the check.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from mia_stream.settings import markdown_table  # noqa: E402

BEGIN = "<!-- settings table: generated from mia_stream/settings.py by scripts/settings_table.py; do not edit -->"
END = "<!-- end of settings table -->"


def render(readme: str) -> str:
    """``readme`` with the text between the markers replaced by the table."""
    head, sep, rest = readme.partition(BEGIN + "\n")
    if not sep or END not in rest:
        raise SystemExit(f"no settings table markers ({BEGIN!r} ... {END!r})")
    return head + BEGIN + "\n" + markdown_table() + END + rest.split(END, 1)[1]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("readme", nargs="?", default=str(REPO / "docs" / "settings.md"))
    ap.add_argument("--check", action="store_true", help="only check that the table is current")
    args = ap.parse_args(argv)
    path = Path(args.readme)
    text = path.read_text()
    new = render(text)
    if args.check:
        if new != text:
            print(f"{path}: the settings table is out of date; run scripts/settings_table.py", file=sys.stderr)
            return 1
        return 0
    if new != text:
        path.write_text(new)
        print(f"{path}: settings table rewritten")
    return 0


if __name__ == "__main__":
    sys.exit(main())
