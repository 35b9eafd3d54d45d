"""CPU the broker's routing core spends per engine step: columnar messages against per-request messages.

Drives ``mia_stream.broker._routing.Router`` (no sockets, so this measures routing alone: header validation,
demux, late-join buffering, selections, queueing and dequeueing for two consumers) with what a producer sends
per engine step for R running requests: either one ``step_batch`` + one ``token_batch`` (schema 2.0), or one
``tensors`` + one ``tokens`` message per request (the per-request path). Two consumers: ``*`` and a pattern
matching about 10% of the requests. Tensors: one layer of ``--hidden`` bf16 per request per step, inline or in
a shared-memory ring (``--ring``: the router then sees headers only, as on one host).

    python scripts/bench_routing.py --requests 256 --steps 200 [--ring]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mia_stream.bus.transport import BrokerEndpoints  # noqa: E402
from mia_stream.broker._routing import BrokerConfig, Router  # noqa: E402
from mia_stream.schemas import (Heartbeat, RowGroup, StepBatch, StreamStart, Subscribe, Tensor, TensorFrame,
                                TokenBatch, TokenFrame, encode)
from mia_stream.bus.shm_ring import ShmRingReader, ShmRingWriter
from mia_stream.bus.shm_ring import SHM_RING_PROOF_KEY  # noqa: E402


def _step_messages(columnar: bool, ids: list[str], step: int, bf16: np.ndarray, ring) -> list[list]:
    """What a producer sends for one engine step (encoded now: ring payloads written as the step is routed)."""
    requests, hidden = len(ids), bf16.shape[2]
    if columnar:
        hs = Tensor("hs", "bfloat16", (1, requests, hidden), bf16, (5,))
        group = RowGroup(np.arange(requests), np.ones(requests, np.int64), np.full(requests, step), [hs])
        return [encode(StepBatch("p", 1, step, ids, [2 * step - 1] * requests, [group]), shm=ring),
                encode(TokenBatch("p", 1, step, ids, [2 * step] * requests, token_ids=np.arange(requests)))]
    out = []
    for i, rid in enumerate(ids):
        t = Tensor("hs", "bfloat16", (1, 1, hidden), bf16[:, i:i + 1], (5,))
        out.append(encode(TensorFrame(rid, "p", 1, 2 * step - 1, step, [step], [0], [t]), shm=ring))
    for i, rid in enumerate(ids):
        out.append(encode(TokenFrame(rid, "p", 1, 2 * step, step, [i], [step])))
    return out


def run(columnar: bool, requests: int, steps: int, hidden: int, use_ring: bool) -> dict:
    directory = tempfile.mkdtemp(prefix="bench-routing-", dir="/dev/shm" if use_ring else None)
    ring = ShmRingWriter(size=256 << 20, min_bytes=1024, directory=directory) if use_ring else None
    shm = ShmRingReader(directory=directory, writable=True) if use_ring else None
    eps = BrokerEndpoints("ipc:///x/p", "ipc:///x/c", "ipc:///x/s")
    router = Router(BrokerConfig(eps, late_join_linger_s=1e9), instance=1, accept_shm=use_ring, shm=shm)
    try:
        now = 1.0
        if ring is not None:
            shm.lag(ring.name, 0)  # mapped before the clock starts (MAP_POPULATE: a one-time cost per ring)
            router.producer_message(b"p/1", encode(Heartbeat("p", "producer", 1, 0,
                                                             {SHM_RING_PROOF_KEY: ring.ownership_proof()})), now)
        tenth = [f"req-{i:04d}" for i in range(0, requests, 10)]  # every 10th request
        for ident, patterns in ((b"all", ["*"]), (b"tenth", tenth)):
            router.consumer_message(ident, encode(Subscribe(patterns, consumer_id=ident.decode(), batch=True,
                                                            shm=use_ring)), now)
        for i in range(requests):
            router.producer_message(b"p/1", encode(StreamStart(f"req-{i:04d}", "p", 1, 0)), now)
        ids = [f"req-{i:04d}" for i in range(requests)]
        bf16 = np.random.default_rng(0).integers(0, 1 << 16, (1, requests, hidden), dtype=np.uint16)
        sent = {b"all": 0, b"tenth": 0}

        def drain():
            for ident in list(router.ready):
                while (out := router.pending_send(ident)) is not None:
                    router.sent(ident, len(out[0]), out[1])
                    sent[ident] += len(out[0])
        drain()
        router.take_outbox()
        cpu = wall = 0.0
        count = 0
        for step in range(1, steps + 1):
            messages = _step_messages(columnar, ids, step, bf16, ring)  # not timed: the producer's work
            count += len(messages)
            t0, c0 = time.perf_counter(), time.process_time()
            for frames in messages:
                router.producer_message(b"p/1", frames, now)
                if len(router.ready) > 1 or router.outbox:
                    drain()
                    router.outbox.clear()
            drain()
            cpu += time.process_time() - c0
            wall += time.perf_counter() - t0
        totals = router.stats(now)["totals"]
        assert not totals.get("internal_errors") and not totals.get("malformed"), totals
        return {"cpu_per_step_us": cpu / steps * 1e6, "wall_per_step_us": wall / steps * 1e6,
                "cpu_per_request_step_us": cpu / steps / requests * 1e6, "messages_per_step": count / steps,
                "delivered_all": sent[b"all"], "delivered_tenth": sent[b"tenth"]}
    finally:
        router.close()
        if ring is not None:
            ring.close()
        os.rmdir(directory) if not os.listdir(directory) else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--ring", action="store_true", help="tensors in a shared-memory ring (headers only)")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    print(f"R={args.requests} requests, {args.steps} steps, hs 1 layer x {args.hidden} bf16, "
          f"{'ring' if args.ring else 'inline'}; consumers '*' and ~10%; best of {args.repeat}")
    results = {}
    for columnar in (True, False):
        best = min((run(columnar, args.requests, args.steps, args.hidden, args.ring) for _ in range(args.repeat)),
                   key=lambda r: r["cpu_per_step_us"])
        name = "columnar (step_batch + token_batch)" if columnar else "per request (tensors + tokens)"
        results[columnar] = best
        print(f"  {name:<38} {best['messages_per_step']:>6.0f} msgs/step  CPU {best['cpu_per_step_us']:>9.0f} us/step"
              f"  = {best['cpu_per_request_step_us']:6.2f} us/request-step  (delivered: * {best['delivered_all']},"
              f" 10% {best['delivered_tenth']})")
    ratio = results[False]["cpu_per_step_us"] / results[True]["cpu_per_step_us"]
    print(f"  ratio per-request / columnar: {ratio:.1f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
