"""NATS benchmark (issue 30): what crosses hosts, through a JetStream cluster, against the local bus.

    .venv/bin/python scripts/bench_nats.py [--nodes 3] [--producers 4] [--requests 256] [--rate 100]
                                           [--seconds 20] [--tensor-mb 4] [--tensor-seconds 10] [--skip-tensors]
                                           [--skip-monitoring] [--out FILE]

Part 1, monitoring traffic. ``--producers`` engines, each a producer process, its own broker and its own bridge
(``--kinds tokens analysis``), publish through a ``--nodes`` JetStream cluster (R=nodes) on loopback: each
starts ``--requests`` streams, then every step (``--rate`` steps/s, for ``--seconds``) one TokenBatch naming
every request and one AnalysisBatch (a score per request, from an analyzer publisher), then ends them. One
consumer (this process) reads every engine from NATS (``open_batches("nats://...")``) while a second reads
producer 0's broker directly. Printed: request-steps/s delivered through NATS (token rows), whether it was
lossless (every request-step delivered, no gap event), and the latency from the step's publish (``time_ns``) to
the consumer, p50/p99, through NATS and through the local bus, and their difference (the added latency); and the
hop alone, from the bridges' metrics: their JetStream ack latency (publish to stored on R=nodes), p50/p99 over
the last 10,000 acks, and how long after the last step every bridge had every message acked; and the read side
alone: the same consumer replaying the retained stream from its start once the producers are done (its rate
includes connecting and the first fetches).

Part 2, tensors. One producer publishes hidden-state frames of ``--tensor-mb`` MB as fast as it can for
``--tensor-seconds``; GB/s read by a consumer on its broker, then through the bridge (``--kinds tensors``, chunked
under the server's max payload) and one NATS node.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))
PY = sys.executable

from _procs import stop_processes  # noqa: E402


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("MIA_STREAM_BROKER", None)
    return env


def _wait_line(proc: subprocess.Popen, word: str, timeout: float = 60.0) -> None:
    import select

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        r, _, _ = select.select([proc.stdout], [], [], 0.1)
        if r and word in proc.stdout.readline():
            return
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[:4]} exited: {proc.stderr.read()[-2000:]}")
    raise RuntimeError(f"no {word!r} from {proc.args[:4]}")


def _start(args: list, word: str, env: dict | None = None) -> subprocess.Popen:
    p = subprocess.Popen([PY, *args], env={**_env(), **(env or {})}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    _wait_line(p, word)
    return p


# ---------------------------------------------------------------------------------------------- producer

def produce(args) -> int:
    """One engine's traffic: starts, then per step a TokenBatch and an AnalysisBatch, then ends."""
    from mia_stream.bus.publisher import FramePublisher
    from mia_stream.schemas import AnalysisBatch, StreamEnd, StreamStart, TokenBatch

    engine = FramePublisher(args.address, producer_id=f"engine{args.index}", queue_bytes=1 << 30)
    scorer = FramePublisher(args.address, producer_id=f"analyzer/score{args.index}", queue_bytes=1 << 30)
    time.sleep(0.5)
    rids = [f"e{args.index}-r{i}" for i in range(args.requests)]
    for rid in rids:
        engine.publish(StreamStart(rid, engine.producer_id, engine.epoch, engine.next_seq(rid), time_ns=time.time_ns()))
    print("started", flush=True)
    rng = np.random.default_rng(args.index)
    t0 = time.monotonic()
    for step in range(args.steps):
        due = t0 + step / args.rate
        delay = due - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        now = time.time_ns()
        engine.publish(TokenBatch(engine.producer_id, engine.epoch, step, rids, engine.next_seqs(rids),
                                  token_ids=rng.integers(0, 49152, len(rids)), first_positions=np.full(len(rids), step),
                                  time_ns=now))
        scorer.publish(AnalysisBatch(scorer.producer_id, scorer.epoch, "score", rids, scorer.next_seqs(rids),
                                     positions=np.full(len(rids), step),
                                     values={"risk": rng.random(len(rids)).astype(np.float32)}, step=step,
                                     time_ns=time.time_ns(), source_time_ns=now))
    for rid in rids:
        engine.publish(StreamEnd(rid, engine.producer_id, engine.epoch, engine.next_seq(rid),
                                 num_generated_tokens=args.steps))
    lag = time.monotonic() - (t0 + args.steps / args.rate)
    engine.close(timeout=30)
    scorer.close(timeout=30)
    print(json.dumps({"behind_s": lag, "engine": engine.stats(), "scorer": scorer.stats()}), flush=True)
    return 0


def produce_tensors(args) -> int:
    from mia_stream.bus.publisher import FramePublisher
    from mia_stream.schemas import StreamEnd, StreamStart, Tensor, TensorFrame

    pub = FramePublisher(args.address, producer_id="tensors", queue_bytes=1 << 30)
    time.sleep(0.5)
    rid = "t0"
    hs = np.ones((1, 1, args.nbytes // 4), dtype=np.float32)
    pub.publish(StreamStart(rid, pub.producer_id, pub.epoch, pub.next_seq(rid)))
    print("started", flush=True)
    t_end = time.monotonic() + args.seconds
    step = 0
    while time.monotonic() < t_end:
        pub.publish(TensorFrame(rid, pub.producer_id, pub.epoch, pub.next_seq(rid), step, positions=[step],
                                tensors=[Tensor.from_array("hs", hs, layers=(0,))], time_ns=time.time_ns()))
        step += 1
        pub.flush(10)
    pub.publish(StreamEnd(rid, pub.producer_id, pub.epoch, pub.next_seq(rid)))
    pub.close(timeout=30)
    print(json.dumps({"frames": step}), flush=True)
    return 0


# ---------------------------------------------------------------------------------------------- measuring

class Reader(threading.Thread):
    """Reads batch events from ``source``; counts token rows and analysis rows; latencies of token batches."""

    def __init__(self, source: str, ends: int, timeout: float, from_start: bool = False):
        super().__init__(daemon=True)
        self.source, self.ends, self.timeout, self.from_start = source, ends, timeout, from_start
        self.token_rows = self.score_rows = self.gaps = self.ended = 0
        self.lat: list[float] = []
        self.first = self.last = None
        self.ready = threading.Event()

    def run(self) -> None:
        from mia_stream.consumers import open_batches

        with open_batches(self.source, timeout=self.timeout, from_start=self.from_start) as s:
            self.ready.set()
            for ev in s:
                if ev.kind == "batch":
                    b = ev.batch
                    now = time.time_ns()
                    if b.KIND == "token_batch":
                        self.token_rows += len(b.request_ids)
                        self.lat.append((now - b.time_ns) / 1e6)
                        self.first = self.first or time.monotonic()
                        self.last = time.monotonic()
                    elif b.KIND == "analysis":
                        self.score_rows += len(b.request_ids)
                elif ev.kind == "gap":
                    self.gaps += 1
                elif ev.kind == "end":
                    self.ended += 1
                    if self.ended >= self.ends:
                        return


def _pct(xs, q) -> float:
    return float(np.percentile(xs, q)) if xs else float("nan")


def _bridge_metrics(base: int) -> dict:
    """Each bridge's metrics page (the range from ``base``): JetStream ack latency and counts per engine."""
    from mia_stream.metrics.top import scrape

    out = {}
    for port in range(base, base + 64):
        page = scrape(f"127.0.0.1:{port}")
        if not page:
            continue
        for (name, labels), v in page.items():
            if name.startswith("mia_stream_bridge_"):
                out.setdefault(dict(labels).get("engine"), {})[name[len("mia_stream_bridge_"):]] = v
    return out


def part1(args, cluster, work: Path) -> dict:
    from mia_stream.bridge.server import free_ports

    procs = []
    metrics_base = free_ports(1)[0]
    try:
        addrs = []
        for i in range(args.producers):
            d = str(work / f"b{i}")
            os.makedirs(d)
            addrs.append(d)
            procs.append(_start(["-m", "mia_stream.broker", "--address", d], "ready"))
            procs.append(_start(["-m", "mia_stream.cli", "bridge", "--broker", d, "--nats", cluster.urls,
                                 "--engine", f"e{i}", "--replicas", str(args.nodes), "--max-bytes",
                                 str(2 << 30)], "ready", env={"MIA_STREAM_METRICS_PORT": str(metrics_base)}))
        url = f"{cluster.urls}"
        nats_reader = Reader(url, args.producers * args.requests, args.seconds + 60)
        local_reader = Reader(addrs[0], args.requests, args.seconds + 60)
        nats_reader.start()
        local_reader.start()
        nats_reader.ready.wait(60)
        local_reader.ready.wait(60)
        steps = int(args.seconds * args.rate)
        prods = [_start([__file__, "produce", "--address", a, "--index", str(i), "--requests", str(args.requests),
                         "--steps", str(steps), "--rate", str(args.rate)], "started") for i, a in enumerate(addrs)]
        procs += prods
        outs = [json.loads(p.stdout.readline() or "{}") for p in prods]
        t_sent = time.monotonic()
        # the hop alone: every message acked by the stream (R=nodes) within how long of the last step's publish
        bridges = {}
        while time.monotonic() - t_sent < 60:
            bridges = _bridge_metrics(metrics_base)
            if bridges and all(b.get("pending_publishes", 1) == 0 for b in bridges.values()):
                break
            time.sleep(0.2)
        hop_drained_s = time.monotonic() - t_sent
        nats_reader.join(args.seconds + 120)
        local_reader.join(30)
        # the read side alone: the same consumer replaying the whole retained stream, nothing else running
        replay = Reader(url, args.producers * args.requests, 120, from_start=True)
        t_replay = time.monotonic()
        replay.start()
        replay.join(180)
        replay_s = time.monotonic() - t_replay
        want = args.producers * args.requests * steps
        span = (nats_reader.last or 0) - (nats_reader.first or 0)
        res = {"producers": args.producers, "requests": args.requests, "rate": args.rate, "steps": steps,
               "nodes": args.nodes, "request_steps_sent": want, "request_steps_via_nats": nats_reader.token_rows,
               "score_rows_via_nats": nats_reader.score_rows, "gap_events_via_nats": nats_reader.gaps,
               "lossless": nats_reader.token_rows == want and nats_reader.score_rows == want and not nats_reader.gaps,
               "request_steps_per_s": nats_reader.token_rows / span if span > 0 else float("nan"),
               "nats_latency_ms_p50": _pct(nats_reader.lat, 50), "nats_latency_ms_p99": _pct(nats_reader.lat, 99),
               "local_latency_ms_p50": _pct(local_reader.lat, 50), "local_latency_ms_p99": _pct(local_reader.lat, 99),
               "producers_behind_s": [o.get("behind_s") for o in outs],
               "bridges_acked_after_last_step_s": hop_drained_s,
               "replay_request_steps": replay.token_rows,
               "replay_request_steps_per_s": replay.token_rows / replay_s,
               "bridge_ack_ms_p99": [1e3 * b.get("ack_p99_seconds", float("nan")) for b in bridges.values()],
               "bridge_ack_ms_p50": [1e3 * b.get("ack_p50_seconds", float("nan")) for b in bridges.values()],
               "bridge_refused": sum(b.get("refused_total", 0) for b in bridges.values()),
               "bridge_published": sum(b.get("published_total", 0) for b in bridges.values())}
        res["added_latency_ms_p99"] = res["nats_latency_ms_p99"] - res["local_latency_ms_p99"]
        return res
    finally:
        stop_processes(procs)


def _tensor_rate(source: str, address: str, args) -> dict:
    r = {"bytes": 0, "first": None, "last": None}
    ready = threading.Event()

    def read():
        from mia_stream.consumers import open_stream

        with open_stream(source, timeout=args.tensor_seconds + 60) as s:
            ready.set()
            for ev in s:
                if ev.kind == "frame":
                    r["bytes"] += ev.frame.tensors["hs"].nbytes
                    r["first"] = r["first"] or time.monotonic()
                    r["last"] = time.monotonic()
                elif ev.kind == "end":
                    return

    t = threading.Thread(target=read, daemon=True)
    t.start()
    ready.wait(60)
    p = _start([__file__, "produce-tensors", "--address", address, "--nbytes", str(int(args.tensor_mb * 1e6)),
                "--seconds", str(args.tensor_seconds)], "started")
    try:
        p.wait(args.tensor_seconds + 120)
        t.join(args.tensor_seconds + 120)
    finally:
        stop_processes([p])
    span = (r["last"] or 0) - (r["first"] or 0)
    return {"gb_per_s": r["bytes"] / span / 1e9 if span > 0 else float("nan"), "bytes": r["bytes"]}


def part2(args, work: Path) -> dict:
    from mia_stream.bridge.server import NatsCluster

    d = str(work / "tensors")
    os.makedirs(d)
    procs = [_start(["-m", "mia_stream.broker", "--address", d], "ready")]
    try:
        local = _tensor_rate(d, d, args)
        with NatsCluster(1) as c:
            procs.append(_start(["-m", "mia_stream.cli", "bridge", "--broker", d, "--nats", c.urls, "--engine", "t",
                                 "--kinds", "tensors", "--stream", "TENSORS", "--prefix", "tens", "--max-bytes",
                                 str(4 << 30)], "ready"))
            via = _tensor_rate(f"{c.urls}?stream=TENSORS&prefix=tens", d, args)
        return {"tensor_mb": args.tensor_mb, "local_bus": local, "via_nats": via}
    finally:
        stop_processes(procs)


def main(argv: list[str]) -> int:
    if argv and argv[0] in ("produce", "produce-tensors"):
        ap = argparse.ArgumentParser()
        ap.add_argument("--address", required=True)
        ap.add_argument("--index", type=int, default=0)
        ap.add_argument("--requests", type=int, default=256)
        ap.add_argument("--steps", type=int, default=1000)
        ap.add_argument("--rate", type=float, default=100.0)
        ap.add_argument("--nbytes", type=int, default=4_000_000)
        ap.add_argument("--seconds", type=float, default=10.0)
        a = ap.parse_args(argv[1:])
        return produce(a) if argv[0] == "produce" else produce_tensors(a)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=3)
    ap.add_argument("--producers", type=int, default=4)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--rate", type=float, default=100.0)
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--tensor-mb", type=float, default=4.0)
    ap.add_argument("--tensor-seconds", type=float, default=10.0)
    ap.add_argument("--skip-tensors", action="store_true")
    ap.add_argument("--skip-monitoring", action="store_true")
    ap.add_argument("--out", help="also write the results as JSON here")
    args = ap.parse_args(argv)
    from mia_stream.bridge.server import NatsCluster

    work = Path(tempfile.mkdtemp(prefix="mia-bn-", dir="/tmp"))
    results = {"cpus": os.cpu_count()}
    try:
        if not args.skip_monitoring:
            with NatsCluster(args.nodes) as cluster:
                results["monitoring"] = part1(args, cluster, work)
            print(json.dumps(results["monitoring"], indent=1), flush=True)
        if not args.skip_tensors:
            results["tensors"] = part2(args, work)
            print(json.dumps(results["tensors"], indent=1), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
