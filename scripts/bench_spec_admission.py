"""Frontend cost of admitting a steered request, per form of the steering vector.

vLLM admits requests one after another in its frontend process (``InputProcessor.process_inputs``); what
mia_stream does there per request (parse and check the spec, normalize it to float32 bytes, derive the prefix-
cache salt; and vLLM's deep copy of the params holding the normalized spec) delays every later request. On the
H200, 256 requests steering all 32 layers of an 8B model with inline float lists ran at 0.438 of plain vLLM:
the engine waited for admission (~8 ms a request here), not for the kernels. This measures that cost alone, per request, for each way a vector can be given, and for
requests that each bring their own vector (``distinct``: the 256-distinct-vectors row of bench_engine).

    python scripts/bench_spec_admission.py [--layers 32] [--hidden 4096] [--requests 256] [--forms list,named]

The engine side is what the workers parse per request (the engine core keeps the wire form until a command).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import msgpack
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=5, help="rounds; the median per-request time is reported")
    ap.add_argument("--forms", default="list,ndarray,f32 bytes,named", help="comma list of the vector forms")
    ap.add_argument("--layer-counts", default="", help="comma list of steered layer counts (default: 1 and --layers)")
    a = ap.parse_args(argv)
    os.environ["MIA_STREAM_VECTORS"] = tempfile.mkdtemp(prefix="mia-vec-")
    from mia_stream.spec import ModelGeometry, parse_spec
    from mia_stream.spec.vectors import register_vector

    geo = ModelGeometry(a.layers, a.hidden, 32, 8, a.hidden // 32)
    rng = np.random.default_rng(0)
    vec = rng.standard_normal(a.hidden).astype(np.float32)
    vec /= np.linalg.norm(vec)
    register_vector("bench", vec)
    forms = {
        "list": vec.tolist(),
        "ndarray": vec,
        "f32 bytes": {"f32": vec.astype("<f4").tobytes()},
        "named": {"name": "bench"},
        "distinct list": "distinct",  # every request its own vector (its layers share it), as float lists
        "distinct ndarray": "distinct",
    }
    results, sizes = {}, {}
    counts = [int(x) for x in a.layer_counts.split(",")] if a.layer_counts else sorted({1, a.layers})

    def specs_for(form: str, v, layers: int) -> list:
        """The round's specs, one per request: the same spec object for a shared vector (a caller that reuses
        its spec), fresh vectors every round for the distinct forms (what a first sight costs)."""
        def spec(x):
            return {"steer": [{"layer": i, "op": "add", "vector": x, "scale": 0.1} for i in range(layers)]}
        if not isinstance(v, str):
            return [spec(v)] * a.requests
        fresh = rng.standard_normal((a.requests, a.hidden)).astype(np.float32)
        return [spec(x.tolist() if form == "distinct list" else x) for x in fresh]

    for layers in counts:
        for form, v in forms.items():
            if form not in a.forms.split(","):
                continue
            per = []
            for _ in range(a.repeat):
                specs = specs_for(form, v, layers)
                t = time.perf_counter()
                for spec in specs:  # what process_inputs does per request, and vLLM's clone of the params in it
                    parsed = parse_spec(spec, geo)
                    copy.deepcopy(parsed.to_wire())
                    parsed.steering_salt()
                per.append((time.perf_counter() - t) / a.requests * 1e3)
            results[f"{layers} layer(s), {form}"] = round(statistics.median(per), 3)
            # the engine side: the normalized spec arrives through vLLM's IPC (fresh objects, as msgpack decodes
            # them) and is parsed again in the engine core and the workers: every form names its vector by a
            # digest there (inline vectors carry their bytes beside it, once per list), so the parsed list is
            # found without hashing 16 KiB per op
            per = []
            for _ in range(a.repeat):
                wires = [msgpack.unpackb(msgpack.packb(parse_spec(spec, geo).to_wire()))
                         for spec in specs_for(form, v, layers)]
                t = time.perf_counter()
                for wire in wires:
                    parse_spec(wire, geo)
                per.append((time.perf_counter() - t) / a.requests * 1e3)
            results[f"{layers} layer(s), {form}, engine side"] = round(statistics.median(per), 3)
            sizes[f"{layers} layer(s), {form}"] = len(msgpack.packb(parse_spec(specs_for(form, v, layers)[0],
                                                                             geo).to_wire()))
    load = os.getloadavg()[0]
    print(f"per-request admission, ms (median of {a.repeat} rounds of {a.requests}; hidden {a.hidden}; "
          f"load average {load:.1f} on {os.cpu_count()} cores)")
    for k, v in results.items():
        size = f"   wire to the engine {sizes[k] / 1024:7.1f} KiB" if k in sizes else ""
        print(f"  {k:<40} {v:8.3f} ms   ({a.requests} requests: {v * a.requests / 1e3:.2f} s){size}")
    print(json.dumps({"ms_per_request": results, "wire_bytes": sizes, "load": load}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
