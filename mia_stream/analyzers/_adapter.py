"""Per-request SDK events -> the columnar calls an analyzer takes (``StepBatch`` / ``TokenBatch``).

Until the consumer SDK delivers whole step batches (``Consumer.on_batch`` / ``open_batches``), the runner reads
per-request events (``open_stream``) and this adapter regroups them: consecutive frames of one step of one
producer become one ``StepBatch`` (requests captured alike share a row group, their tensors concatenated along
the token dim), consecutive token frames of one step one ``TokenBatch``. It is the only place that knows the
per-request API: switching to batch events replaces it, nothing else.

Order is kept per request: a start, gap or end of a request whose frame or tokens are pending flushes the
pending batch first. A batch never waits for time: the runner calls ``flush`` when its source is idle.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from mia_stream.schemas import RowGroup, StepBatch, Tensor, TokenBatch


def _signature(part: int, tensors: dict) -> tuple:
    """Requests with equal signatures share a row group (same tensors, layers, dtypes and row shapes)."""
    return (part,) + tuple((n, t.dtype, tuple(t.layers), tuple(t.shape[2:]), repr(sorted(t.meta.items())))
                           for n, t in sorted(tensors.items()))


def _concat(name: str, parts: list[Tensor]) -> Tensor:
    t0 = parts[0]
    raw = parts[0].raw() if len(parts) == 1 else np.concatenate([t.raw() for t in parts], axis=1)
    scale = t0.scale
    if scale is not None and scale.ndim >= 2 and scale.shape[1] == t0.shape[1] and len(parts) > 1:
        scale = np.concatenate([t.scale for t in parts], axis=1)
    return Tensor(name, t0.dtype, tuple(int(x) for x in raw.shape), raw, t0.layers, None, scale, t0.meta)


class EventAdapter:
    """Feed SDK events; get ``on_start(stream)``, ``on_batch(StepBatch)``, ``on_tokens(TokenBatch)``,
    ``on_gap(stream, gap)``, ``on_end(stream, end)`` calls on ``target``, in per-request order."""

    def __init__(self, target: Any):
        self.target = target
        self._kind: str | None = None  # "frames" | "tokens" | None (nothing pending)
        self._key: tuple | None = None  # (producer_id, epoch, step)
        self._items: list = []
        self._members: set = set()  # request ids (tokens) or (request id, part) (frames) pending
        self._rids: set = set()

    def feed(self, ev: Any) -> None:
        kind = ev.kind
        if kind == "frame":
            self._frame(ev.stream, ev.frame)
        elif kind == "tokens":
            self._tokens(ev.stream, ev.tokens)
        else:
            rid = ev.stream.request_id if ev.stream is not None else None
            if rid in self._rids:
                self.flush()
            if kind == "start":
                self.target.on_start(ev.stream)
            elif kind == "gap":
                self.target.on_gap(ev.stream, ev.gap)
            elif kind == "end":
                self.target.on_end(ev.stream, ev.end)

    def flush(self) -> None:
        kind, items = self._kind, self._items
        if kind is None:
            return
        self._kind, self._key, self._items, self._members, self._rids = None, None, [], set(), set()
        if kind == "frames":
            self.target.on_batch(self._step_batch(items))
        else:
            self.target.on_tokens(self._token_batch(items))

    # ---------------------------------------------------------------------------------------------- internals

    def _pend(self, kind: str, key: tuple, member: Any, rid: str, item: Any) -> None:
        if self._kind != kind or self._key != key or member in self._members:
            self.flush()
            self._kind, self._key = kind, key
        self._items.append(item)
        self._members.add(member)
        self._rids.add(rid)

    def _frame(self, stream: Any, frame: Any) -> None:
        tf = frame.rank_frames[0] if frame.rank_frames else None
        producer, epoch, seq = (tf.producer_id, tf.epoch, tf.seq) if tf is not None else ("", 0, 0)
        part = getattr(frame, "part", tf.part if tf is not None else 0)
        rid = frame.request_id
        self._pend("frames", (producer, epoch, frame.step), (rid, part), rid, (rid, seq, part, frame))

    def _tokens(self, stream: Any, tokens: Any) -> None:
        rid = tokens.request_id
        self._pend("tokens", (tokens.producer_id, tokens.epoch, tokens.step), rid, rid, tokens)

    def _step_batch(self, items: list) -> StepBatch:
        producer, epoch, step = self._pending_key(items)
        ids: list[str] = []
        index: dict[str, int] = {}
        seqs, versions = [], []
        groups: dict[tuple, list] = {}
        time_ns = 0
        for rid, seq, part, frame in items:
            i = index.get(rid)
            if i is None:
                i = index[rid] = len(ids)
                ids.append(rid)
                seqs.append(seq)
                versions.append(frame.steering_version)
            time_ns = max(time_ns, frame.time_ns)
            tensors = frame.raw_tensors
            groups.setdefault(_signature(part, tensors), []).append((i, part, frame))
        row_groups = []
        for members in groups.values():
            frames = [f for _, _, f in members]
            names = sorted(frames[0].raw_tensors)
            row_groups.append(RowGroup(
                requests=[i for i, _, _ in members], rows=[len(f.positions) for f in frames],
                positions=[p for f in frames for p in f.positions],
                token_ids=[t for f in frames for t in f.token_ids],
                tensors=[_concat(n, [f.raw_tensors[n] for f in frames]) for n in names], part=members[0][1]))
        return StepBatch(producer, epoch, step, ids, seqs, row_groups, versions, time_ns)

    def _pending_key(self, items: list) -> tuple:
        rid, seq, part, frame = items[0]
        tf = frame.rank_frames[0] if frame.rank_frames else None
        return (tf.producer_id if tf else "", tf.epoch if tf else 0, frame.step)

    @staticmethod
    def _token_batch(items: list) -> TokenBatch:
        t0 = items[0]
        return TokenBatch(t0.producer_id, t0.epoch, t0.step, [t.request_id for t in items], [t.seq for t in items],
                          [len(t.token_ids) for t in items], [x for t in items for x in t.token_ids],
                          [t.positions[0] if t.positions else 0 for t in items],
                          [t.finish_reason for t in items], max(t.time_ns for t in items))
