"""How much the producer's drain slows an engine that waits on a GPU: an emulated engine loop (CPU only).

    .venv/bin/python scripts/bench_drain.py [--requests 256] [--steps 150] [--forward-ms 10] [--host-ms 1.5]
        [--drains batch,per-request,thread] [--old-repo DIR]

The H200 run showed capture collapsing 8B decode throughput (HS 1 layer at 0.22-0.37 of plain vLLM) while
only ~0.1 GB/s was drained: the cost is host-side Python, not the link. This reproduces the engine side of
that on the CPU with the real ``ProducerRuntime``, a real ``FramePublisher``, a real broker process and a
real consumer process. Each emulated step does what vLLM's engine thread does around a decode step:
``begin_step`` (routing), ``--host-ms`` of pure-Python work holding the GIL (vLLM's scheduler, input prep,
sampling bookkeeping), a ``--forward-ms`` wait with the GIL released (the GPU forward; the thread blocks in
a CUDA sync), then ``end_step`` (queues the aperture copy for the drain thread). Every request decodes one
token per step, so each step makes one TensorFrame per capturing request (Llama-3-8B geometry, bf16).

Rows (same process, interleaved rounds): no capture; then each capture/steering configuration with each drain
of ``--drains``: ``batch`` (a sidecar process publishing one StepBatch and one TokenBatch per step, the
default), ``per-request`` (the same sidecar with ``MIA_STREAM_STEP_BATCHES=0``: a TensorFrame per request part
and a TokenFrame per request per step), ``thread`` (the batch drain in a thread of the engine process, as when
embedding with a publisher object) and, with ``--old-repo DIR``, ``old`` (a sidecar running DIR's
mia_stream: the drain of another checkout, e.g. the commit before step batches, fed the same items). Every
streamed request also gets a sampled token per step (``on_sampled``), as in the engine. Printed: emulated
steps/s, the ratio to no capture, request frames published, frames dropped (host ring / queue full, counted,
never waited for), the drain's request frames/s, and the drain's CPU time per engine step (the sidecar
process's user + system time from /proc; for ``thread``, the forwarder thread's) over the row, until the
drain has handled every step.
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
from mia_stream.bus.publisher import FramePublisher  # noqa: E402
from mia_stream.spec import ModelGeometry, parse_spec  # noqa: E402

GEO = ModelGeometry(32, 4096, 32, 8, 128)  # Llama-3-8B: layers, hidden, heads, kv heads, head_dim
_STEER = [{"layer": 16, "op": "add", "vector": [0.01] * 4096, "scale": 1.0}]
ROWS = {"no capture": None,
        "HS 1 layer": {"capture": {"hidden_states": {"layers": [16], "positions": "all"}}},
        "HS all layers": {"capture": {"hidden_states": {"layers": "all", "positions": "all"}}},
        "steer 1 layer": {"steer": _STEER}}
DRAINS = ("batch", "per-request", "thread")

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


def _cpu_s(pid: int, tid: int | None = None) -> float:
    """User + system CPU seconds of a process (or one of its threads) so far, from /proc."""
    path = f"/proc/{pid}/task/{tid}/stat" if tid is not None else f"/proc/{pid}/stat"
    with open(path) as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _drain_cpu(rt: ProducerRuntime) -> float:
    if rt._sidecar is not None:
        return _cpu_s(rt._sidecar.proc.pid)
    return _cpu_s(os.getpid(), rt._forwarder.native_id)


def _run(rt: ProducerRuntime, name: str, spec_raw, args, round_no: int) -> dict:
    n = args.requests
    ids = [f"{name.replace(' ', '_')}-{round_no}-{i}" for i in range(n)]
    if spec_raw is not None:
        spec = parse_spec(spec_raw, GEO)
        for i in ids:
            rt.add_request(i, i, spec, list(range(args.prompt_len)))
    frames0, drops0 = rt.stats["frames"], rt.stats["dropped_frames"]
    sampled = [[7]] * n
    rt.wait_drained(60)  # the starts
    cpu0 = _drain_cpu(rt)
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
    rt.wait_drained(120)  # every step handled (the ends are not counted in the drain's CPU)
    drain_s = time.perf_counter() - t0
    cpu = _drain_cpu(rt) - cpu0
    for i in ids if spec_raw is not None else ():
        rt.finish_request(i, "length")
    rt.wait_drained(120)  # let the drain finish this row before the next one starts
    frames, drops = rt.stats["frames"] - frames0, rt.stats["dropped_frames"] - drops0
    return {"steps_s": args.steps / dt, "frames": frames, "dropped": drops,
            "drain_fps": frames / drain_s if frames else 0.0, "cpu_ms_step": cpu * 1000 / args.steps}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--forward-ms", type=float, default=10.0, help="GIL-free wait per step (the GPU forward)")
    ap.add_argument("--host-ms", type=float, default=1.5, help="GIL-holding Python work per step")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--rows", default=",".join(ROWS), help="comma-separated rows to run ('no capture' always runs)")
    ap.add_argument("--drains", default=",".join(DRAINS), help=f"comma-separated drains of {DRAINS} (and old)")
    ap.add_argument("--old-repo", default=None, help="a checkout whose drain sidecar runs as the 'old' drain")
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
        os.environ["MIA_STREAM_BROKER"] = run_dir  # the sidecars' publishers connect here
        cfg = dict(aperture_rows=2048, capture_qk=False, steering=True, host_ring_bytes=256 << 20)
        common = dict(geo=GEO, model_name="emulated-8b", tokenizer="t", dtype=torch.bfloat16,
                      device=torch.device("cpu"), max_tokens=8192, tp_rank=0, tp_size=1, dp_rank=0)
        drains = [d for d in args.drains.split(",") if d]
        if args.old_repo:
            drains.append("old")
        runtimes = {}
        for d in drains:
            if d == "thread":
                runtimes[d] = ProducerRuntime(**common, publisher=pub, cfg=RuntimeConfig(**cfg))
                continue
            # the sidecar inherits this environment at its start
            env_before = dict(os.environ)
            os.environ["MIA_STREAM_STEP_BATCHES"] = "0" if d == "per-request" else "1"
            if d == "old":
                os.environ["PYTHONPATH"] = str(Path(args.old_repo).resolve())
            try:
                runtimes[d] = ProducerRuntime(**common, producer_id=f"bench-drain-{d}", cfg=RuntimeConfig(**cfg))
            finally:
                os.environ.clear()
                os.environ.update(env_before)
            os.sched_setaffinity(runtimes[d]._sidecar.proc.pid, bus_cpus)
        base_drain = next(d for d in drains if d != "thread") if any(d != "thread" for d in drains) else drains[0]
        rows = [(n, s, d) for n, s in ROWS.items() for d in (drains if s is not None else (base_drain,))
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
    base = max(r["steps_s"] for r in results[("no capture", base_drain)])
    print(f"{args.requests} decoding requests, Llama-3-8B geometry bf16, emulated step = {args.host_ms} ms Python "
          f"+ {args.forward_ms} ms GIL-free wait; best of {args.rounds} interleaved rounds; "
          f"load average before: {load_before:.1f}")
    print(f"{'row':<16} {'drain':<12} {'steps/s':>8} {'ratio':>6} {'frames':>8} {'dropped':>8} {'drain frames/s':>15} "
          f"{'drain CPU ms/step':>18}  rounds (steps/s; drain CPU ms/step)")
    for (name, d), runs in results.items():
        best = max(runs, key=lambda r: r["steps_s"])
        cpu = min(r["cpu_ms_step"] for r in runs)
        print(f"{name:<16} {d if name != 'no capture' else '-':<12} {best['steps_s']:8.1f} {best['steps_s'] / base:6.3f} "
              f"{best['frames']:8d} {best['dropped']:8d} {best['drain_fps']:15.0f} {cpu:18.2f}  "
              f"{[round(r['steps_s'], 1) for r in runs]}; {[round(r['cpu_ms_step'], 2) for r in runs]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
