"""How much the producer's drain slows an engine that waits on a GPU: an emulated engine loop (CPU only).

    .venv/bin/python scripts/bench_drain.py [--requests 256] [--steps 150] [--forward-ms 10] [--host-ms 1.5]

The H200 run showed capture collapsing 8B decode throughput (HS 1 layer at 0.22-0.37 of plain vLLM) while
only ~0.1 GB/s was drained: the cost is host-side Python, not the link. This reproduces the engine side of
that on the CPU with the real ``ProducerRuntime``, a real ``FramePublisher``, a real broker process and a
real consumer process. Each emulated step does what vLLM's engine thread does around a decode step:
``begin_step`` (routing), ``--host-ms`` of pure-Python work holding the GIL (vLLM's scheduler, input prep,
sampling bookkeeping), a ``--forward-ms`` wait with the GIL released (the GPU forward; the thread blocks in
a CUDA sync), then ``end_step`` (queues the aperture copy for the drain thread). Every request decodes one
token per step, so each step makes one TensorFrame per capturing request (Llama-3-8B geometry, bf16).

Rows (same process, interleaved rounds): no capture; then each capture/steering configuration twice, with
the drain in a sidecar process (the default) and in a thread of the engine process (the old design, kept for
embedding with a publisher object). Every streamed request also gets a TokenFrame per step (``on_sampled``),
as in the engine. Printed: emulated steps/s, the ratio to no capture, frames published, frames dropped (host
ring / queue full, counted, never waited for), and the drain's frames/s.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mia_stream.producer._runtime import ProducerRuntime, RuntimeConfig, StepBatch  # noqa: E402
from mia_stream.producer.publisher import FramePublisher  # noqa: E402
from mia_stream.producer.spec import ModelGeometry, parse_spec  # noqa: E402

GEO = ModelGeometry(32, 4096, 32, 8, 128)  # Llama-3-8B: layers, hidden, heads, kv heads, head_dim
_STEER = [{"layer": 16, "op": "add", "vector": [0.01] * 4096, "scale": 1.0}]
ROWS = {"no capture": None,
        "HS 1 layer": {"capture": {"hidden_states": {"layers": [16], "positions": "all"}}},
        "HS all layers": {"capture": {"hidden_states": {"layers": "all", "positions": "all"}}},
        "steer 1 layer": {"steer": _STEER}}
DRAINS = ("sidecar", "thread")

_CONSUMER = """
import sys, time
from mia_stream.consumers import BrokerClient
c = BrokerClient(sys.argv[1], consumer_id="bench-drain")  # the SDK's window: a large one reads stale ring frames
c.subscribe(("*",))
print("ready", flush=True)
n = 0
while True:
    got = c.recv(timeout=1.0)
    if got is not None:
        n += 1
"""


def _python_work(ms: float) -> None:
    """Busy Python bytecode for ``ms`` (holds the GIL, like the scheduler and sampler bookkeeping)."""
    end = time.perf_counter() + ms / 1000
    x = 0
    while time.perf_counter() < end:
        for i in range(50):
            x += i


def _run(rt: ProducerRuntime, name: str, spec_raw, args, round_no: int) -> dict:
    n = args.requests
    ids = [f"{name.replace(' ', '_')}-{round_no}-{i}" for i in range(n)]
    if spec_raw is not None:
        spec = parse_spec(spec_raw, GEO)
        for i in ids:
            rt.add_request(i, i, spec, list(range(args.prompt_len)))
    frames0, drops0 = rt.stats["frames"], rt.stats["dropped_frames"]
    sampled = [[7]] * n
    t0 = time.perf_counter()
    for step in range(args.steps):
        batch = StepBatch(step=step, req_ids=ids, query_start=np.arange(n + 1),
                          num_computed=np.full(n, args.prompt_len + step), num_tokens=n,
                          token_ids=np.zeros(n, np.int64))
        if not rt.idle:
            rt.begin_step(batch)
        _python_work(args.host_ms)
        time.sleep(args.forward_ms / 1000)  # the GPU forward: the engine thread waits with the GIL released
        if not rt.idle:
            rt.end_step()
            rt.on_sampled(step, ids, sampled)
    dt = time.perf_counter() - t0
    for i in ids if spec_raw is not None else ():
        rt.finish_request(i, "length")
    rt.wait_drained(120)  # let the drain finish this row before the next one starts
    drain_s = time.perf_counter() - t0
    frames, drops = rt.stats["frames"] - frames0, rt.stats["dropped_frames"] - drops0
    return {"steps_s": args.steps / dt, "frames": frames, "dropped": drops,
            "drain_fps": frames / drain_s if frames else 0.0}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--forward-ms", type=float, default=10.0, help="GIL-free wait per step (the GPU forward)")
    ap.add_argument("--host-ms", type=float, default=1.5, help="GIL-holding Python work per step")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--rows", default=",".join(ROWS), help="comma-separated rows to run ('no capture' always runs)")
    ap.add_argument("--switch-interval-ms", type=float, default=None,
                    help="sys.setswitchinterval for the engine process (CPython's default is 5 ms)")
    args = ap.parse_args()
    if args.switch_interval_ms is not None:
        sys.setswitchinterval(args.switch_interval_ms / 1000)

    # The GPU host has 16 cores: the broker and the consumer never compete with the engine process for CPU.
    # Here (2 cores) the engine process gets core 0 and the bus processes core 1, so what remains between
    # the engine thread and the producer's threads is the GIL, as on the GPU host.
    cpus = sorted(os.sched_getaffinity(0))
    engine_cpus, bus_cpus = ({cpus[0]}, set(cpus[1:])) if len(cpus) > 1 else (set(cpus), set(cpus))
    os.sched_setaffinity(0, engine_cpus)
    # One intra-op thread: on one core, OpenMP workers spinning after each host copy would steal the engine
    # thread's CPU (the GPU engine's copies are CUDA copies, no OpenMP).
    torch.set_num_threads(1)
    load_before = os.getloadavg()[0]
    run_dir = tempfile.mkdtemp(prefix="mia-drain-", dir="/tmp")
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    broker = subprocess.Popen([sys.executable, "-m", "mia_stream.cli", "broker", "--address", run_dir],
                              env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    os.sched_setaffinity(broker.pid, bus_cpus)
    consumer = None
    try:
        time.sleep(1.5)
        consumer = subprocess.Popen([sys.executable, "-c", _CONSUMER, run_dir], env=env, stdout=subprocess.PIPE,
                                    stderr=subprocess.DEVNULL, text=True)
        os.sched_setaffinity(consumer.pid, bus_cpus)
        consumer.stdout.readline()
        pub = FramePublisher(run_dir, producer_id="bench-drain-thread")
        os.environ["MIA_STREAM_BROKER"] = run_dir  # the sidecar's publisher connects here
        cfg = dict(aperture_rows=2048, capture_qk=False, steering=True, host_ring_bytes=256 << 20)
        common = dict(geo=GEO, model_name="emulated-8b", tokenizer="t", dtype=torch.bfloat16,
                      device=torch.device("cpu"), max_tokens=8192, tp_rank=0, tp_size=1, dp_rank=0)
        runtimes = {"sidecar": ProducerRuntime(**common, producer_id="bench-drain-sidecar", cfg=RuntimeConfig(**cfg)),
                    "thread": ProducerRuntime(**common, publisher=pub, cfg=RuntimeConfig(**cfg))}
        sidecar = runtimes["sidecar"]._sidecar.proc
        os.sched_setaffinity(sidecar.pid, bus_cpus)
        rows = [(n, s, d) for n, s in ROWS.items() for d in (DRAINS if s is not None else ("sidecar",))
                if n == "no capture" or n in args.rows.split(",")]
        results: dict[tuple, list] = {(name, d): [] for name, _, d in rows}
        for rnd in range(args.rounds):
            for name, spec, d in rows:
                results[(name, d)].append(_run(runtimes[d], name, spec, args, rnd))
        for rt in runtimes.values():
            rt.close()
        pub.close()
    finally:
        for p in (consumer, broker):
            if p is not None:
                p.kill()
                p.wait()
    base = max(r["steps_s"] for r in results[("no capture", "sidecar")])
    print(f"{args.requests} decoding requests, Llama-3-8B geometry bf16, emulated step = {args.host_ms} ms Python "
          f"+ {args.forward_ms} ms GIL-free wait; best of {args.rounds} interleaved rounds; "
          f"load average before: {load_before:.1f}")
    print(f"{'row':<16} {'drain':<8} {'steps/s':>8} {'ratio':>6} {'frames':>8} {'dropped':>8} {'drain frames/s':>15}  rounds")
    for (name, d), runs in results.items():
        best = max(runs, key=lambda r: r["steps_s"])
        print(f"{name:<16} {d if name != 'no capture' else '-':<8} {best['steps_s']:8.1f} {best['steps_s'] / base:6.3f} "
              f"{best['frames']:8d} {best['dropped']:8d} {best['drain_fps']:15.0f}  {[round(r['steps_s'], 1) for r in runs]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
