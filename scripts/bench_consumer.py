"""What a consumer pays per request-step to decode and assemble, side by side in one run (docs/benchmarks.md).

One engine step of 256 decoding requests, 8B geometry (one captured layer of 4096 bf16 per row, one row per
request), arrives as:

- ``per-request``: 256 TensorFrames + 256 TokenFrames (the 1.x path), decoded and assembled into events
  (``+ hs``: and each frame's ``tensors["hs"]`` read);
- ``batch -> events``: one StepBatch + one TokenBatch, expanded into the same per-request events;
- ``batch -> events + hs``: the same, and each frame's ``tensors["hs"]`` read (bf16 widened to float32);
- ``batch mode``: one "batch" event per message (``open_batches`` / ``Consumer.on_batch``), seqs checked per request;
- ``batch mode + norms``: the same, plus a vectorized mean hidden-state norm of every request;
- ``... -> Consumer``: the same events handed to a ``Consumer``'s callbacks (``dispatch``, as ``run_consumer``).

Also: loading one request of a recording through the request index against a scan of the whole recording.

    python scripts/bench_consumer.py [--requests 256] [--steps 100] [--rounds 5] [--no-index]

CPU time of this one process (the consumer's share of the pipeline); fresh random tensors each round.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from mia_stream.consumers import Consumer, StreamAssembler, dispatch
from mia_stream.consumers.recorder import Recorder
from mia_stream.consumers.recording import Recording, iter_recording
from mia_stream.schemas import (RowGroup, StepBatch, StreamEnd, StreamStart, Tensor, TensorFrame, TokenBatch, TokenFrame,
                                decode, encode)

HIDDEN = 4096


def _bf16(rng, shape) -> Tensor:
    bits = rng.integers(0x3c00, 0x4000, size=shape, dtype=np.uint16)  # finite values around 1
    return Tensor("hs", "bfloat16", shape, memoryview(bits).cast("B"), (15,))


def make_steps(rng, ids: list[str], steps: int) -> tuple[list, list]:
    """(per-request frames, batch frames) of ``steps`` decode steps: wire bytes, as a consumer receives them."""
    r = len(ids)
    per_request, batched = [], []
    for s in range(steps):
        hs = _bf16(rng, (1, r, HIDDEN))
        seqs = np.full(r, 2 * s + 1)
        batch = StepBatch("p", 1, s, ids, seqs, [RowGroup(np.arange(r), np.ones(r), np.full(r, 10 + s), [hs],
                                                          np.arange(r))])
        tokens = TokenBatch("p", 1, s, ids, seqs + 1, token_ids=np.arange(r), first_positions=np.full(r, 11 + s))
        batched.append([bytes(f) for f in encode(batch)])
        batched.append([bytes(f) for f in encode(tokens)])
        raw = hs.raw()
        for i, rid in enumerate(ids):
            t = Tensor("hs", "bfloat16", (1, 1, HIDDEN), memoryview(np.ascontiguousarray(raw[:, i:i + 1])).cast("B"),
                       (15,))
            per_request.append([bytes(f) for f in encode(TensorFrame(rid, "p", 1, 2 * s + 1, s, [10 + s], [i], [t]))])
        for i, rid in enumerate(ids):
            per_request.append([bytes(f) for f in encode(TokenFrame(rid, "p", 1, 2 * s + 2, s, [i], [11 + s]))])
    return per_request, batched


def _assembler(ids: list[str], **kw) -> StreamAssembler:
    asm = StreamAssembler(**kw)
    for rid in ids:
        asm.feed(StreamStart(rid, "p", 1))
    return asm


class _Callbacks(Consumer):
    def on_frame(self, stream, frame) -> None: ...

    def on_batch(self, batch) -> None: ...


def run_events(ids, messages, batches=False, read_hs=False, norms=False, consumer=False) -> int:
    asm = _assembler(ids, batches=batches)
    callbacks = _Callbacks()
    n = 0
    for frames in messages:
        for ev in asm.feed(decode(frames)):
            n += 1
            if consumer:
                dispatch(callbacks, ev)
            if read_hs and ev.kind == "frame":
                ev.frame.tensors["hs"]
            if norms and ev.kind == "batch" and ev.batch.KIND == "step_batch":
                for g in ev.batch.groups:
                    hs = g.tensor("hs").numpy()
                    per_row = np.linalg.norm(hs, axis=-1).mean(axis=0)
                    sums = np.bincount(g.row_requests, weights=per_row, minlength=len(ev.batch.request_ids))
                    sums / np.maximum(np.bincount(g.row_requests, minlength=len(ev.batch.request_ids)), 1)
    return n


def bench_assemble(args) -> None:
    ids = [f"req-{i:04d}" for i in range(args.requests)]
    variants = {
        "per-request (1.x frames)": lambda pr, b: run_events(ids, pr),
        "per-request + hs": lambda pr, b: run_events(ids, pr, read_hs=True),
        "batch -> events": lambda pr, b: run_events(ids, b),
        "batch -> events + hs": lambda pr, b: run_events(ids, b, read_hs=True),
        "batch mode": lambda pr, b: run_events(ids, b, batches=True),
        "batch mode + norms": lambda pr, b: run_events(ids, b, batches=True, norms=True),
        "per-request -> Consumer": lambda pr, b: run_events(ids, pr, consumer=True),
        "batch -> events -> Consumer": lambda pr, b: run_events(ids, b, consumer=True),
        "batch mode -> Consumer": lambda pr, b: run_events(ids, b, batches=True, consumer=True),
    }
    times: dict[str, list[float]] = {k: [] for k in variants}
    for rnd in range(args.rounds):
        per_request, batched = make_steps(np.random.default_rng(rnd), ids, args.steps)
        for name, fn in variants.items():
            t0 = time.process_time()
            fn(per_request, batched)
            times[name].append((time.process_time() - t0) / (args.steps * args.requests) * 1e6)
    base = statistics.median(times["per-request (1.x frames)"])
    print(f"decode + assemble, {args.requests} requests x {args.steps} steps, {args.rounds} rounds "
          f"(CPU us per request-step: tensors + tokens)")
    print(f"| path | median | min | max | vs per-request |\n|---|---|---|---|---|")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"| {name} | {med:.2f} | {min(ts):.2f} | {max(ts):.2f} | {base / med:.1f}x |")


def bench_index(args) -> None:
    """A recording of up to ``index_requests`` requests that come and go over ``index_steps`` steps (up to 40
    live at a time, each for 10 to 40 steps, 8 KiB of hidden states per row): one request through the
    request index (``Recording.messages``) vs a scan (``iter_recording`` with the request as pattern)."""
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        rec_dir = Path(tmp) / "rec"
        seq: dict[str, int] = {}
        life: dict[str, int] = {}
        running: list[str] = []
        born = 0
        with Recorder(rec_dir) as rec:
            for step in range(args.index_steps):
                for rid in [r for r in running if seq[r] > 2 * life[r]]:
                    running.remove(rid)
                    rec.write(encode(StreamEnd(rid, "p", 1, seq[rid])))
                for _ in range(2):  # at most two arrivals per step
                    if born < args.index_requests and len(running) < 40:
                        rid = f"r{born:05d}"
                        life[rid] = 10 + (born * 7) % 31  # 10 to 40 steps
                        born += 1
                        seq[rid] = 1
                        running.append(rid)
                        rec.write(encode(StreamStart(rid, "p", 1)))
                if not running:
                    break
                r = len(running)
                s = [seq[x] for x in running]
                for x in running:
                    seq[x] += 2
                hs = _bf16(rng, (1, r, HIDDEN))
                rec.write(encode(StepBatch("p", 1, step, list(running), s,
                                           [RowGroup(np.arange(r), np.ones(r), np.full(r, step), [hs])])))
                rec.write(encode(TokenBatch("p", 1, step, list(running), np.asarray(s) + 1, token_ids=np.arange(r))))
        size = sum(p.stat().st_size for p in rec_dir.iterdir())
        recording = Recording(rec_dir)
        rid = recording.requests()[len(recording.requests()) // 2]
        rows = []
        for _ in range(3):
            t0 = time.perf_counter()
            by_index = recording.messages(rid)
            t1 = time.perf_counter()
            by_scan = [m for _, m in iter_recording(rec_dir, patterns=[rid])]
            t2 = time.perf_counter()
            rows.append((t1 - t0, t2 - t1))
        assert len(by_index) == len(by_scan), (len(by_index), len(by_scan))
        idx, scan = statistics.median(r[0] for r in rows), statistics.median(r[1] for r in rows)
        print(f"\none request of a {size / 1e6:.0f} MB recording ({born} requests, {len(by_index)} messages of it):"
              f" request index {idx * 1e3:.0f} ms, scan {scan * 1e3:.0f} ms ({scan / idx:.0f}x)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--index-requests", type=int, default=1000)
    p.add_argument("--index-steps", type=int, default=1000)
    p.add_argument("--no-index", action="store_true", help="only the decode + assemble table")
    args = p.parse_args()
    bench_assemble(args)
    if not args.no_index:
        bench_index(args)


if __name__ == "__main__":
    main()
