"""Host-side cost of the producer runtime per engine step (CPU only; no vLLM, no GPU).

    python scripts/bench_begin_step.py [--repeat 5]

256 requests of 64 prompt tokens (Llama-3-8B geometry) with one spec each: none, HS 1 layer, steering 1 layer,
steering all 32 layers (an inline array; a registered vector by name), 256 distinct vectors at one layer. Per
spec: ``add_request`` for all 256 (the worker's admission, its parse included: the spec arrives in the frontend's
normalized form, through msgpack as vLLM's IPC hands it over), the two 8192-token prefill steps, the first
decode step (the full routing path) and steady decode steps (the cached path). ``begin_step`` runs on the engine thread before every forward, so
its time adds to every step (an 8B decode step of 256 requests is ~13.5 ms on an H200).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import msgpack
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


class _NullPublisher:
    producer_id, epoch = "bench", 1

    def next_seq(self, stream_id):
        return 0

    def publish(self, message):
        pass


def measure(raw, repeat: int) -> dict:
    import torch

    from mia_stream.producer._runtime import ProducerRuntime, RuntimeConfig, StepBatch
    from mia_stream.spec import ModelGeometry, parse_spec

    geo = ModelGeometry(32, 4096, 32, 8, 128)
    ids = [f"r{i}" for i in range(256)]
    # the frontend's normalized form, through msgpack as vLLM's IPC hands it over (fresh objects per request);
    # a callable spec gives each request its own (256 distinct vectors)
    wires = None if raw is None else [
        msgpack.unpackb(msgpack.packb(parse_spec(raw(i) if callable(raw) else raw, geo).to_wire())) for i in range(256)]
    runs: dict[str, list] = {"add_256": [], "prefill_step": [], "first_decode": [], "decode": []}
    for _ in range(repeat):
        rt = ProducerRuntime(geo=geo, model_name="m", tokenizer="t", dtype=torch.bfloat16, device=torch.device("cpu"),
                             max_tokens=8192, tp_rank=0, tp_size=1, dp_rank=0, publisher=_NullPublisher(),
                             cfg=RuntimeConfig(aperture_rows=8192, capture_qk=False))
        t = time.perf_counter()
        if wires is not None:
            for i, wire in zip(ids, wires):
                rt.add_request(i, i, parse_spec(wire, geo), list(range(64)))
        runs["add_256"].append(time.perf_counter() - t)
        for half in range(2):
            batch = StepBatch(step=half, req_ids=ids[half * 128:(half + 1) * 128], query_start=np.arange(129) * 64,
                              num_computed=np.zeros(128, np.int64), num_tokens=8192,
                              token_ids=np.zeros(8192, np.int64))
            t = time.perf_counter()
            rt.begin_step(batch)
            runs["prefill_step"].append(time.perf_counter() - t)
            rt._step_segments = None
        for step in range(10):
            batch = StepBatch(step=2 + step, req_ids=ids, query_start=np.arange(257),
                              num_computed=np.full(256, 64 + step), num_tokens=256, token_ids=np.zeros(256, np.int64))
            t = time.perf_counter()
            rt.begin_step(batch)
            runs["first_decode" if step == 0 else "decode"].append(time.perf_counter() - t)
            rt._step_segments = None
        rt.close()
    return {k: round(float(np.median(v)) * 1e3, 3) for k, v in runs.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5)
    a = ap.parse_args(argv)
    v = np.ones(4096, np.float32)
    os.environ["MIA_STREAM_VECTORS"] = tempfile.mkdtemp(prefix="mia-vec-")
    from mia_stream.spec.vectors import register_vector

    register_vector("bench", v)
    distinct = np.random.default_rng(0).standard_normal((256, 4096)).astype(np.float32)
    specs = {
        "none": None,
        "hs_1layer": {"capture": {"hidden_states": {"layers": [16], "positions": "all"}}},
        "steer_1layer": {"steer": [{"layer": 16, "op": "add", "vector": v, "scale": 0.5}]},
        "steer_all_layers": {"steer": [{"layer": i, "op": "add", "vector": v, "scale": 0.1} for i in range(32)]},
        "steer_all_named": {"steer": [{"layer": i, "op": "add", "vector": {"name": "bench"}, "scale": 0.1}
                                      for i in range(32)]},
        "steer_256_distinct": lambda i: {"steer": [{"layer": 16, "op": "add", "vector": distinct[i].tolist(),
                                                    "scale": 0.5}]},
    }
    print(f"ms, median of {a.repeat} (load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores)")
    print(f"{'spec':18s} {'add 256':>9s} {'prefill step':>13s} {'1st decode':>11s} {'decode':>8s}")
    for name, raw in specs.items():
        r = measure(raw, a.repeat)
        print(f"{name:18s} {r['add_256']:9.2f} {r['prefill_step']:13.2f} {r['first_decode']:11.2f} {r['decode']:8.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
