"""A producer that never waits, as an engine, outrunning its consumer through the shared-memory ring.

    .venv/bin/python scripts/bench_outrun.py [--size 256K] [--seconds 3] [--rounds 2] [--broker process,thread]

The producer publishes one stream of TensorFrames of ``--size`` as fast as it can for ``--seconds`` (no
yielding: the engine never waits on the bus), into its default 256 MiB ring; one consumer (the SDK, with its
default window) receives everything and touches each frame's bytes. Rows, interleaved per round: the
producer's source bound on (``FramePublisher`` default: a quarter of the ring past what the broker has
received) and off (``shm_ahead_bytes=0``, the behaviour before the bound), each with the broker as its own
process (``mia-stream broker``, the production topology) and/or as a thread of the consumer's process (as
``scripts/gpu_check.py`` runs it, sharing the consumer's GIL).

Printed per row: frames published per s, what the consumer received (frames, MB/s over the run), and every
lost frame by where it was lost, from the gaps the consumer was told of (nothing is lost silently):
``source`` = dropped by the producer before it wrote the ring (shm_ahead_of_broker, queue_full), ``stale`` =
dropped by the broker as more than half a ring behind (shm_overrun from the broker), ``overwritten`` = read
too late by the consumer (shm_overrun from the consumer).
"""

from __future__ import annotations

import argparse
import collections
import json
import multiprocessing as mp
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from _procs import start_broker  # noqa: E402  (scripts/_procs.py, beside this file)


def _parse_size(text: str) -> int:
    text = text.strip().upper().replace("IB", "")
    mult = {"K": 1 << 10, "M": 1 << 20}.get(text[-1:], 1)
    return int(float(text.rstrip("KM")) * mult)


def _consume(address: str, in_thread: bool, ready, out) -> None:
    from contextlib import nullcontext

    from mia_stream.broker import run_broker_in_thread
    from mia_stream.consumers import BrokerClient
    from mia_stream.schemas import GapBatch, GapNotice, StreamEnd, TensorFrame

    with (run_broker_in_thread(address=address) if in_thread else nullcontext()):
        client = BrokerClient(address, consumer_id="outrun")
        client.subscribe(("outrun-*",))
        ready.set()
        got = nbytes = 0
        lost: collections.Counter[str] = collections.Counter()
        t_first = t_last = 0.0
        while True:
            item = client.recv(timeout=10.0)
            if item is None:
                break
            msg = item[1]
            if isinstance(msg, TensorFrame):
                t_last = time.monotonic()
                t_first = t_first or t_last
                got += 1
                data = msg.tensors[0].data
                nbytes += len(data)
                np.frombuffer(data, np.uint8)[::4096].sum()  # touch it, as an analyzer would
            elif isinstance(msg, (GapNotice, GapBatch)):  # a GapBatch: the gaps of several streams (2.1)
                where = ("source" if msg.origin == "producer" else
                         "stale" if msg.origin == "broker" and msg.reason == "shm_overrun" else
                         "overwritten" if msg.origin == "consumer" and msg.reason == "shm_overrun" else
                         f"{msg.origin}:{msg.reason}")
                lost[where] += msg.count
            elif isinstance(msg, StreamEnd):
                break
        client.close()
    out.put({"received": got, "mb_s": nbytes / max(t_last - t_first, 1e-9) / 1e6, "lost": dict(lost)})


def _produce(address: str, size: int, seconds: float, bounded: bool, out, switch_s: float | None = None) -> None:
    if switch_s:
        sys.setswitchinterval(switch_s)
    from mia_stream.bus.publisher import FramePublisher
    from mia_stream.schemas import StreamEnd, StreamStart, Tensor, TensorFrame

    pub = FramePublisher(address, producer_id="outrun", shm_ahead_bytes=None if bounded else 0)
    deadline = time.monotonic() + 10
    while not pub.broker_shm and time.monotonic() < deadline:
        time.sleep(0.01)
    rid = "outrun-1"
    data = np.arange(size, dtype=np.uint8)
    pub.publish(StreamStart(rid, pub.producer_id, pub.epoch, pub.next_seq(rid)))
    n = 0
    t0 = time.monotonic()
    while time.monotonic() - t0 < seconds:
        pub.publish(TensorFrame(rid, pub.producer_id, pub.epoch, pub.next_seq(rid), n,
                                tensors=[Tensor.from_array("hs", data)], time_ns=time.time_ns()))
        n += 1
    elapsed = time.monotonic() - t0
    pub.publish(StreamEnd(rid, pub.producer_id, pub.epoch, pub.next_seq(rid)))
    stats = pub.stats()
    pub.close(5)
    out.put({"published": n, "published_f_s": n / elapsed, "ring": pub.shm_ring is not None,
             "source_drops": {k[len("dropped_"):]: v for k, v in stats.items() if k.startswith("dropped_")}})


def _run(size: int, seconds: float, bounded: bool, broker: str, switch_s: float | None = None) -> dict:
    address = tempfile.mkdtemp(prefix="mia-outrun-", dir="/tmp")
    proc = None
    if broker == "process":
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p))
        proc = start_broker(address, env)
    ctx = mp.get_context("spawn")
    q, ready = ctx.Queue(), ctx.Event()
    consumer = ctx.Process(target=_consume, args=(address, broker == "thread", ready, q))
    consumer.start()
    try:
        if not ready.wait(30):
            raise RuntimeError("consumer did not start")
        time.sleep(0.3)
        producer = ctx.Process(target=_produce, args=(address, size, seconds, bounded, q, switch_s))
        producer.start()
        results = [q.get(timeout=seconds + 60) for _ in range(2)]
        producer.join(30)
        consumer.join(30)
    finally:
        for p in (consumer,):
            if p.is_alive():
                p.kill()
        if proc is not None:
            proc.terminate()
            proc.wait(10)
    res = {k: v for r in results for k, v in r.items()}
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="256K", help="bytes per frame (256K: one token of all 32 layers at 4096 bf16)")
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--broker", default="process,thread", help="process, thread or both (comma-separated)")
    ap.add_argument("--switch-interval-ms", type=float, default=None,
                    help="sys.setswitchinterval in the producer process (CPython's default is 5 ms: a publishing "
                         "thread that never waits holds the GIL that long against the publisher's sender thread)")
    args = ap.parse_args(argv)
    size = _parse_size(args.size)
    brokers = [b.strip() for b in args.broker.split(",") if b.strip()]
    print(f"outrun benchmark, {time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} CPUs, load average "
          f"{os.getloadavg()[0]:.1f}; {size} B frames for {args.seconds} s per row, default 256 MiB ring")
    head = (f"{'round':>5} {'broker':>7} {'bound':>5} | {'pub f/s':>8} {'published':>9} | {'received':>8} {'MB/s':>7} "
            f"{'share':>6} | lost: source / stale / overwritten / other")
    print(head)
    print("-" * len(head))
    for rnd in range(args.rounds):
        for broker in brokers:
            for bounded in (True, False):
                r = _run(size, args.seconds, bounded, broker,
                         args.switch_interval_ms / 1000 if args.switch_interval_ms else None)
                lost = dict(r["lost"])
                other = {k: v for k, v in lost.items() if k not in ("source", "stale", "overwritten")}
                print(f"{rnd + 1:>5} {broker:>7} {'on' if bounded else 'off':>5} | {r['published_f_s']:8.0f} "
                      f"{r['published']:9d} | {r['received']:8d} {r['mb_s']:7.0f} "
                      f"{r['received'] / max(r['published'], 1):6.1%} | {lost.get('source', 0)} / "
                      f"{lost.get('stale', 0)} / {lost.get('overwritten', 0)} / {json.dumps(other) if other else 0}"
                      f"   (publisher drops {r['source_drops']})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
