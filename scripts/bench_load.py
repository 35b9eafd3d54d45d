"""The bus at serving load: a synthetic producer publishing steps of 256 requests, a broker process and two
consumer processes (``*`` and a pattern matching 10% of requests), step batches against per-request messages.

    .venv/bin/python scripts/bench_load.py                       # paced 100 steps/s and saturated, both paths
    .venv/bin/python scripts/bench_load.py --paths batch --rates 0 --seconds 5

The producer has 8B geometry: every decoding request captures one layer of 4096 bf16 per step (8 KiB), and a
request's first step (its prompt step) all 32 layers at ``last_prompt`` (256 KiB). 256 requests run at once;
each lives ``--tokens`` steps and is replaced by a new one, staggered, so every step has ~256/tokens prompt
steps. Per step the producer publishes either one ``step_batch`` + one ``token_batch`` (``batch``), or one
``tensors`` + one ``tokens`` message per request (``per-request``, the 1.x unit). Every row's ``time_ns`` is
the moment its step was published.

Reported per path and rate: request-steps/s delivered to each consumer, consumer latency p50/p99 (step
published -> the consumer has the request's frame in hand), seqs lost (gap notices + holes), and CPU
microseconds per delivered request-step of each process (utime+stime from /proc). Each consumer process uses
``--api``: ``events`` (``open_stream``, one event per request per step) or ``batches`` (``open_batches``,
one event per step: what a vectorized analyzer uses).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from _procs import start_broker, stop_processes  # noqa: E402  (scripts/_procs.py, beside this file)
_TICK = os.sysconf("SC_CLK_TCK")
HIDDEN, LAYERS = 4096, 32


def _cpu_s(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / _TICK


# ---------------------------------------------------------------------------------------------- producer

def produce(a: argparse.Namespace) -> None:
    from mia_stream.bus.publisher import FramePublisher
    from mia_stream.schemas import (RowGroup, StepBatch, StreamEnd, StreamStart, Tensor, TensorFrame, TokenBatch,
                                    TokenFrame)

    rng = np.random.default_rng(0)
    pub = FramePublisher(a.address, producer_id="bench-producer")
    deadline = time.monotonic() + 10
    while pub.broker_instance is None and time.monotonic() < deadline:
        time.sleep(0.01)
    prompt_len, n, life = 64, a.requests, a.tokens
    decode_rows = rng.integers(0, 1 << 16, size=(1, n, HIDDEN), dtype=np.uint16)  # bf16 bits
    prompt_rows = rng.integers(0, 1 << 16, size=(LAYERS, n, HIDDEN), dtype=np.uint16)
    next_id = 0
    live: dict[str, int] = {}  # request id -> steps done (0: its prompt step is next)

    def start(rid: str, done: int) -> None:
        pub.publish(StreamStart(rid, pub.producer_id, pub.epoch, pub.next_seq(rid), num_layers=LAYERS,
                                hidden_size=HIDDEN, dtype="bfloat16", time_ns=time.time_ns(),
                                capture={"hidden_states": {"layers": [0], "positions": "generated"}}))
        live[rid] = done

    for k in range(n):  # staggered: request k is k % life steps into its life (its prompt step already past)
        start(f"req-{next_id:06d}", 1 + k % (life - 1))
        next_id += 1
    pub.flush(10)
    print("ready", flush=True)
    period = 1.0 / a.rate if a.rate else 0.0
    t0 = time.monotonic()
    step = 0
    while time.monotonic() - t0 < a.seconds:
        if period:
            wait = t0 + step * period - time.monotonic()
            if wait > 0:
                time.sleep(wait)
        ids = list(live)
        prompt = [i for i, rid in enumerate(ids) if live[rid] == 0]
        decode = [i for i, rid in enumerate(ids) if live[rid] > 0]
        positions = np.array([prompt_len - 1 + live[rid] for rid in ids], dtype=np.int64)
        now = time.time_ns()
        if a.path == "batch":
            seqs = [pub.next_seq(rid) for rid in ids]
            groups = []
            if decode:
                groups.append(RowGroup(decode, [1] * len(decode), positions[decode],
                                       [Tensor("hs", "bfloat16", (1, len(decode), HIDDEN), decode_rows[:, :len(decode)],
                                               (7,))]))
            if prompt:
                groups.append(RowGroup(prompt, [1] * len(prompt), positions[prompt],
                                       [Tensor("hs", "bfloat16", (LAYERS, len(prompt), HIDDEN),
                                               prompt_rows[:, :len(prompt)], tuple(range(LAYERS)))]))
            pub.publish(StepBatch(pub.producer_id, pub.epoch, step, ids, seqs, groups, time_ns=now))
            tok_seqs = [pub.next_seq(rid) for rid in ids]
            pub.publish(TokenBatch(pub.producer_id, pub.epoch, step, ids, tok_seqs,
                                   token_ids=rng.integers(0, 49152, len(ids)), first_positions=positions + 1,
                                   time_ns=now))
        else:
            for i, rid in enumerate(ids):
                layers = (7,) if live[rid] else tuple(range(LAYERS))
                rows = decode_rows[:, i:i + 1] if live[rid] else prompt_rows[:, i:i + 1]
                pub.publish(TensorFrame(rid, pub.producer_id, pub.epoch, pub.next_seq(rid), step,
                                        [int(positions[i])], [1],
                                        [Tensor("hs", "bfloat16", (len(layers), 1, HIDDEN), rows, layers)],
                                        time_ns=now))
                pub.publish(TokenFrame(rid, pub.producer_id, pub.epoch, pub.next_seq(rid), step, [2],
                                       [int(positions[i]) + 1], time_ns=now))
        step += 1
        for rid in ids:
            live[rid] += 1
            if live[rid] >= life:
                del live[rid]
                pub.publish(StreamEnd(rid, pub.producer_id, pub.epoch, pub.next_seq(rid), "length",
                                      prompt_len, life, time_ns=time.time_ns()))
                start(f"req-{next_id:06d}", 0)
                next_id += 1
    for rid in list(live):
        pub.publish(StreamEnd(rid, pub.producer_id, pub.epoch, pub.next_seq(rid), "abort", time_ns=time.time_ns()))
    pub.flush(30)
    elapsed = time.monotonic() - t0
    print(json.dumps({"steps": step, "seconds": elapsed, "request_steps": step * n, "dropped": pub.counters["dropped"]}),
          flush=True)
    pub.close(5)


# ---------------------------------------------------------------------------------------------- consumer

def consume(a: argparse.Namespace) -> None:
    from mia_stream.consumers import open_stream

    latencies: list[np.ndarray] = []
    got = lost = 0
    first = last = None

    arrivals: list[tuple[float, float]] = []  # (seconds since the first message, ms) per message
    gc_pauses: list[tuple[int, float]] = []  # (generation, ms) of each garbage collection in this process
    gc_started = [0.0]

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            gc_started[0] = time.perf_counter()
        else:
            gc_pauses.append((info["generation"], 1e3 * (time.perf_counter() - gc_started[0])))

    import gc

    gc.callbacks.append(on_gc)

    def note(time_ns: int, count: int) -> None:
        nonlocal got, first, last
        now = time.time_ns()
        latencies.append(np.full(count, now - time_ns, dtype=np.int64))
        arrivals.append((time.monotonic() - (first or time.monotonic()), (now - time_ns) / 1e6))
        got += count
        first = first or time.monotonic()
        last = time.monotonic()

    print("ready", flush=True)
    give_up = time.monotonic() + 120
    seen = 0
    while not seen and time.monotonic() < give_up:  # idle ends a consumer only once its stream has begun
        if a.api == "events":
            with open_stream(a.address, patterns=[a.patterns], timeout=a.idle) as events:
                for ev in events:
                    seen += 1
                    if ev.kind == "frame":
                        note(ev.frame.time_ns, 1)
                    elif ev.kind == "gap":
                        lost += ev.gap.count
        else:
            from mia_stream.consumers import open_batches

            with open_batches(a.address, patterns=[a.patterns], timeout=a.idle) as events:
                for ev in events:
                    seen += 1
                    if ev.kind == "batch" and ev.batch.KIND == "step_batch":
                        note(ev.batch.time_ns, len(ev.batch.request_ids))
                    elif ev.kind == "gap":
                        lost += ev.gap.count
    lat = np.concatenate(latencies) if latencies else np.zeros(1, dtype=np.int64)
    span = (last - first) if first and last and last > first else float("nan")
    # where the slow deliveries were: seconds into the run of the messages over 20 ms (stalls show as clusters)
    slow = sorted({round(t, 1) for t, ms in arrivals if ms > 20})
    print(json.dumps({"request_steps": got, "lost": lost, "p50_ms": float(np.percentile(lat, 50)) / 1e6,
                      "p99_ms": float(np.percentile(lat, 99)) / 1e6, "max_ms": float(lat.max()) / 1e6,
                      "over_20ms": sum(1 for _, ms in arrivals if ms > 20), "messages": len(arrivals),
                      "slow_at_s": slow[:40], "rate": got / span,
                      "gc": {f"gen{g}": {"count": sum(1 for x, _ in gc_pauses if x == g),
                                         "max_ms": round(max((ms for x, ms in gc_pauses if x == g), default=0), 2)}
                             for g in (0, 1, 2)}}), flush=True)


# ---------------------------------------------------------------------------------------------- orchestration

def _spawn(args: list[str], env: dict) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE, text=True, env=env)
    line = p.stdout.readline()
    if "ready" not in line:
        raise RuntimeError(f"{args[:3]} did not start: {line!r}")
    return p


def run_one(path: str, rate: float, a: argparse.Namespace) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p))
    run_dir = tempfile.mkdtemp(prefix="mia-load-", dir="/tmp")
    me = str(Path(__file__).resolve())
    procs: list[subprocess.Popen] = []
    try:
        broker = start_broker(run_dir, env)
        procs.append(broker)
        cons = {}
        for name, pattern in (("all", "*"), ("tenth", "req-*0")):
            cons[name] = _spawn([me, "consume", "--address", run_dir, "--patterns", pattern, "--api", a.api,
                                 "--idle", "3"], env)
            procs.append(cons[name])
        time.sleep(1.0)  # subscribed
        prod = _spawn([me, "produce", "--address", run_dir, "--path", path, "--rate", str(rate),
                       "--seconds", str(a.seconds), "--requests", str(a.requests), "--tokens", str(a.tokens)], env)
        procs.append(prod)
        pids = {"producer": prod.pid, "broker": broker.pid, **{f"consumer {k}": p.pid for k, p in cons.items()}}
        cpu0 = {k: _cpu_s(pid) for k, pid in pids.items()}
        cpu1 = dict(cpu0)
        while prod.poll() is None or any(p.poll() is None for p in cons.values()):
            for k, pid in pids.items():
                v = _cpu_s(pid)
                if v == v:  # a process that exited keeps its last reading
                    cpu1[k] = v
            time.sleep(0.05)
        prod_result = json.loads(prod.stdout.read().strip().splitlines()[-1])
        out = {"path": path, "rate": rate, "producer": prod_result,
               "consumers": {k: json.loads(p.stdout.read().strip().splitlines()[-1]) for k, p in cons.items()},
               "cpu_s": {k: cpu1[k] - cpu0[k] for k in pids}}
        return out
    finally:
        stop_processes(procs)


def report(r: dict) -> str:
    sent = r["producer"]["request_steps"]
    all_got = max(r["consumers"]["all"]["request_steps"], 1)
    lines = [f"{r['path']:>11} @ {('%g steps/s' % r['rate']) if r['rate'] else 'saturated':>13}: produced "
             f"{sent} request-steps in {r['producer']['seconds']:.1f} s ({sent / r['producer']['seconds']:.0f}/s), "
             f"producer dropped {r['producer']['dropped']} messages"]
    for name, c in r["consumers"].items():
        lines.append(f"    consumer {name:5s}: {c['request_steps']:7d} request-steps at {c['rate']:8.0f}/s, lost "
                     f"{c['lost']:6d}, latency p50 {c['p50_ms']:7.2f} ms p99 {c['p99_ms']:7.2f} ms max "
                     f"{c['max_ms']:7.2f} ms; GC pauses max (count) gen0/1/2: "
                     + " / ".join(f"{c['gc'][g]['max_ms']:.1f} ({c['gc'][g]['count']})" for g in ("gen0", "gen1", "gen2")))
    cpu = ", ".join(f"{k} {1e6 * v / all_got:.1f}" for k, v in r["cpu_s"].items())
    lines.append(f"    CPU us per request-step delivered to '*': {cpu}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    if argv and argv[0] in ("produce", "consume"):
        role = argv.pop(0)
        ap.add_argument("--address", required=True)
        ap.add_argument("--path", default="batch")
        ap.add_argument("--rate", type=float, default=100)
        ap.add_argument("--seconds", type=float, default=10)
        ap.add_argument("--requests", type=int, default=256)
        ap.add_argument("--tokens", type=int, default=64)
        ap.add_argument("--patterns", default="*")
        ap.add_argument("--api", default="events")
        ap.add_argument("--idle", type=float, default=3)
        a = ap.parse_args(argv)
        (produce if role == "produce" else consume)(a)
        return 0
    ap.add_argument("--paths", default="per-request,batch", help="comma list of: per-request, batch")
    ap.add_argument("--rates", default="100,0", help="steps/s to pace the producer at; 0 = saturated")
    ap.add_argument("--seconds", type=float, default=10)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=64, help="steps each request lives")
    ap.add_argument("--api", default="events", choices=("events", "batches"), help="consumer API")
    ap.add_argument("--json", help="also write the results to this file")
    a = ap.parse_args(argv)
    results = []
    for rate in [float(x) for x in a.rates.split(",")]:
        for path in a.paths.split(","):
            r = run_one(path, rate, a)
            results.append(r)
            print(report(r), flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
