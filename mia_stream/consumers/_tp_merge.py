"""TP merge: one StepFrame per engine step from every rank's shards of it.

A request served with ``tp_size > 1`` has one stream per rank. For each engine ``step`` the assembler waits for
every rank's TensorFrame, checks each sharded tensor's ``[start, stop)`` tile the ``total`` exactly in rank
order, concatenates along ``shard.dim`` and delivers one StepFrame. Unsharded tensors (hidden states:
replicated, published by rank 0 only) are taken as they are. A step some rank will never deliver (that rank
went past the step, ended, or more than ``merge_window`` steps are waiting) is never merged partially: it
becomes a "gap" event whose ``gap.reason`` is ``"incomplete_shards"`` and whose ``error`` is an
``IncompleteShardError`` naming the step and the missing ranks.

Producer contract this relies on: every rank publishes one TensorFrame per captured step (an empty ``tensors``
list if it has nothing for that step); TokenFrames and the request's StreamEnd that counts come from rank 0.

Rule: a ``_Merger`` (one per TP request, made by the assembler at its start) owns that request's pending
shards by (step, part), the last step each rank reached, the ranks that ended and the steps decided.
"""

from __future__ import annotations

import numpy as np

from mia_stream.consumers._frames import StepFrame
from mia_stream.errors import IncompleteShardError
from mia_stream.schemas import Tensor, TensorFrame


def merge_shards(frames_by_rank: dict[int, TensorFrame], tp_size: int) -> StepFrame:
    """One StepFrame from every rank's TensorFrame of a step; raises IncompleteShardError, never merges partly."""
    f0 = frames_by_rank.get(0)
    missing = [r for r in range(tp_size) if r not in frames_by_rank]
    if missing or f0 is None:
        step = next(iter(frames_by_rank.values())).step if frames_by_rank else -1
        raise IncompleteShardError(f"step {step}: no frame from rank(s) {missing}")
    if not f0.tensors:  # rank 0 had nothing of this part: positions come from a rank that had
        f0 = next((frames_by_rank[r] for r in range(tp_size) if frames_by_rank[r].tensors), f0)
    names: list[str] = []
    for r in range(tp_size):
        for t in frames_by_rank[r].tensors:
            if t.name not in names:
                names.append(t.name)
    raw: dict[str, Tensor] = {}
    for name in names:
        parts = [(r, t) for r in range(tp_size) for t in frames_by_rank[r].tensors if t.name == name]
        sharded = [p for p in parts if p[1].shard is not None]
        if not sharded:
            raw[name] = parts[0][1]  # replicated (hidden states come from rank 0 only)
            continue
        raw[name] = _concat(name, f0.step, [t for _, t in sharded], tp_size)
    return StepFrame(f0.request_id, f0.step, list(f0.positions), list(f0.token_ids), f0.steering_version, raw,
                     {n: tuple(t.layers) for n, t in raw.items()}, f0.time_ns,
                     [frames_by_rank[r] for r in range(tp_size)], f0.part)


def _concat(name: str, step: int, shards: list[Tensor], tp_size: int) -> Tensor:
    shards = sorted(shards, key=lambda t: t.shard.tp_rank)
    ranks = [t.shard.tp_rank for t in shards]
    if ranks != list(range(tp_size)):
        raise IncompleteShardError(f"step {step}: tensor {name!r} has shards from ranks {ranks}, "
                                   f"needs {list(range(tp_size))}")
    first = shards[0]
    dim, total = first.shard.dim, first.shard.total
    pos = 0
    for t in shards:
        sh = t.shard
        if (sh.dim != dim or sh.total != total or sh.tp_size != tp_size or sh.start != pos
                or t.dtype != first.dtype or len(t.shape) != len(first.shape) or not 0 <= dim < len(t.shape)
                or t.shape[dim] != sh.stop - sh.start
                or any(a != b for i, (a, b) in enumerate(zip(t.shape, first.shape)) if i != dim)):
            raise IncompleteShardError(f"step {step}: tensor {name!r} shards do not tile [0, {total}) along "
                                       f"dim {dim} (rank {sh.tp_rank}: [{sh.start}, {sh.stop}), shape {t.shape})")
        pos = sh.stop
    if pos != total:
        raise IncompleteShardError(f"step {step}: tensor {name!r} shards cover [0, {pos}) of {total}")
    data = np.concatenate([t.raw() for t in shards], axis=dim)
    scale = None
    if first.scale is not None:
        try:  # a scale that is 1 along the shard dim (per row, e.g. quantized Q/K) holds for each rank's part
            scale = np.concatenate([t.scale if t.scale.shape[dim] != 1 else np.broadcast_to(
                t.scale, (*t.scale.shape[:dim], t.shape[dim], *t.scale.shape[dim + 1:])) for t in shards], axis=dim)
        except (TypeError, ValueError, IndexError):
            scale = first.scale  # per-tensor scales: identical on every rank
    meta = dict(first.meta)
    if all(isinstance(t.meta.get("heads"), list) for t in shards):  # each rank names its own heads
        meta["heads"] = [h for t in shards for h in t.meta["heads"]]
    return Tensor(name, first.dtype, tuple(data.shape), memoryview(np.ascontiguousarray(data)).cast("B"),
                  first.layers, None, scale, meta)


class _Merger:
    __slots__ = ("tp_size", "window", "pending", "last_step", "ended", "done_up_to", "late", "named")

    def __init__(self, tp_size: int, window: int):
        self.tp_size, self.window = tp_size, window
        self.pending: dict[int, dict[int, TensorFrame]] = {}
        self.last_step: dict[int, int] = {}
        self.ended: set[int] = set()
        self.done_up_to = (-1, 0)  # (step, part) keys, compared in order
        self.late = 0
        # steps at which a rank's StepBatch named the request: a part it sent no segment of is empty there
        # (a rank > 0 has no hidden states), not missing
        self.named: dict[int, set[int]] = {}

    def add_share(self, rank: int, step: int, frames: list) -> list:
        """Rank ``rank``'s StepBatch of ``step`` named the request: its frames of that step (maybe none)."""
        for f in frames:
            self.add(rank, f, resolve=False)
        if step >= self.done_up_to[0]:
            self.named.setdefault(rank, set()).add(step)
        return self.resolve()

    def add(self, rank: int, frame: TensorFrame, resolve: bool = True) -> list:
        key = (frame.step, frame.part)  # a step may have two frames (hidden states, Q/K) per rank
        if key <= self.done_up_to:
            self.late += 1  # its step was already delivered or declared incomplete
            return []
        self.pending.setdefault(key, {})[rank] = frame
        self.last_step[rank] = max(self.last_step.get(rank, (-1, 0)), key)
        return self.resolve() if resolve else []

    def rank_ended(self, rank: int) -> list:
        self.ended.add(rank)
        return self.resolve()

    def resolve(self, everything: bool = False) -> list:
        """(step, StepFrame | IncompleteShardError) in step order, for every step that can be decided."""
        out = []
        for key in sorted(self.pending):
            step = key[0]
            have = self.pending[key]
            missing = [r for r in range(self.tp_size) if r not in have and step not in self.named.get(r, ())]
            if missing and not everything and len(self.pending) <= self.window and not all(
                    r in self.ended or self.last_step.get(r, (-1, 0)) > key for r in missing):
                break
            del self.pending[key]
            self.done_up_to = max(self.done_up_to, key)
            if missing:
                out.append((step, IncompleteShardError(f"step {step}: no frame from rank(s) {missing}"), missing))
                continue
            if len(have) < self.tp_size:  # ranks that named the step without this part: nothing of theirs
                f = next(iter(have.values()))
                have = {r: have.get(r) or TensorFrame(f.request_id, "", 0, -1, step, part=key[1])
                        for r in range(self.tp_size)}
            try:
                out.append((step, merge_shards(have, self.tp_size), []))
            except IncompleteShardError as e:
                out.append((step, e, []))
        if self.named:
            floor = self.done_up_to[0]
            for steps in self.named.values():
                for old in [x for x in steps if x < floor]:
                    steps.discard(old)
        return out
