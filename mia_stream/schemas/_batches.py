"""Columnar messages (schema 2.0): one message carries many requests, one engine step at a time.

At 256 running requests a per-request message per step was ~45,000 messages/s, each built, encoded, routed,
decoded and assembled by Python in three processes: consumers fell seconds behind (docs/benchmarks.md). These
kinds carry a whole step instead (the shape of vLLM's ``KVEventBatch``):

- ``StepBatch``: the captured tensors of every streamed request of one step (per producer = per TP rank);
- ``TokenBatch``: what every streamed request sampled at one step;
- ``AnalysisBatch``: an analyzer's results for many requests (one analyzer step);
- ``GapBatch`` (2.1): the seqs many requests lost, as many GapNotices would name them (no seq of its own).

Each names its requests in ``request_ids`` and gives each the ``seq`` it holds in that request's stream, so
per-request ordering, gaps and late join work exactly as for per-request messages; the broker hands a consumer
that matches only some requests a rewritten message naming only those (docs/wire-format.md, section 10).

Numeric columns are numpy int64 arrays (on the wire: little-endian int64 ``bin``). Rows of a ``RowGroup`` are
consecutive per segment, so one request's rows of a tensor ``[L, N, ...]`` are the slice ``[:, a:b]``: a
zero-copy view, which is how ``frames()`` gives the per-request ``TensorFrame`` of the SDK's per-request events.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from mia_stream.schemas._messages import GapNotice, Message, TensorFrame, TokenFrame
from mia_stream.schemas._tensors import WIRE_DTYPES, Tensor

_I64 = np.dtype("<i8")


def int_column(values: Any, name: str = "column") -> np.ndarray:
    """``values`` as a 1-D int64 array (no copy when it already is one)."""
    arr = np.asarray(values, dtype=_I64)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {arr.shape}")
    return arr


def _offsets(counts: np.ndarray) -> np.ndarray:
    out = np.zeros(len(counts) + 1, dtype=_I64)
    np.cumsum(counts, out=out[1:])
    return out


@dataclass
class RowGroup:
    """Segments of a step that share their tensors' layout: segment ``i`` is request ``requests[i]`` (an index
    into the batch's ``request_ids``) with ``rows[i]`` consecutive rows of every tensor (dim 1).

    ``positions`` / ``token_ids`` give each row's token position and input token id; tensors are
    ``hs [L, N, hidden]``, ``q [L, N, heads, head_dim]``, ``k [L, N, kv_heads, head_dim]`` (``N = rows.sum()``),
    dim 0 stacking the layers named by each tensor. ``part`` as ``TensorFrame.part``: 0 hidden states (and
    Q/K when they cover the same positions), 1 Q/K at positions of their own.
    """

    requests: np.ndarray
    rows: np.ndarray
    positions: np.ndarray
    tensors: list = field(default_factory=list)  # list[Tensor]
    token_ids: np.ndarray | None = None  # None: unknown (-1 on the wire)
    part: int = 0

    def __post_init__(self) -> None:
        self.requests = int_column(self.requests, "requests")
        self.rows = int_column(self.rows, "rows")
        self.positions = int_column(self.positions, "positions")
        if self.token_ids is None:
            self.token_ids = np.full(len(self.positions), -1, dtype=_I64)
        else:
            self.token_ids = int_column(self.token_ids, "token_ids")

    @property
    def num_rows(self) -> int:
        return int(len(self.positions))

    @property
    def offsets(self) -> np.ndarray:
        """Row offsets: segment ``i`` holds rows ``[offsets[i], offsets[i+1])``."""
        return _offsets(self.rows)

    @property
    def row_requests(self) -> np.ndarray:
        """For each row, the index (into the batch's ``request_ids``) of the request it belongs to."""
        return np.repeat(self.requests, self.rows)

    def tensor(self, name: str) -> Tensor:
        for t in self.tensors:
            if t.name == name:
                return t
        raise KeyError(f"group has no tensor {name!r}; it has {[t.name for t in self.tensors]}")

    def has(self, name: str) -> bool:
        return any(t.name == name for t in self.tensors)


def _slice_tensor(t: Tensor, a: int, b: int) -> Tensor:
    """Rows ``[a, b)`` (dim 1) of ``t``, as a zero-copy numpy view."""
    view = t.raw()[:, a:b]
    scale = t.scale
    if scale is not None and scale.ndim >= 2 and scale.shape[1] == t.shape[1]:
        scale = scale[:, a:b]
    return Tensor(t.name, t.dtype, tuple(int(x) for x in view.shape), view, t.layers, t.shard, scale, t.meta)


@dataclass
class StepBatch(Message):
    """The captured tensors of every streamed request of one engine step, from one producer (one TP rank)."""

    KIND: ClassVar[str] = "step_batch"
    producer_id: str
    epoch: int
    step: int
    request_ids: list  # list[str], R
    seqs: Any  # int64 [R]: each request's seq in its stream
    groups: list = field(default_factory=list)  # list[RowGroup]
    steering_versions: Any = None  # int64 [R] (None: all 0)
    time_ns: int = 0

    def __post_init__(self) -> None:
        self.seqs = int_column(self.seqs, "seqs")
        if self.steering_versions is None:
            self.steering_versions = np.zeros(len(self.request_ids), dtype=_I64)
        else:
            self.steering_versions = int_column(self.steering_versions, "steering_versions")

    def topic(self) -> bytes:
        return b""  # routed by the request_ids column, not by topic

    # ------------------------------------------------------------------ vectorized access
    def _only_group(self, name: str | None = None) -> RowGroup:
        groups = [g for g in self.groups if name is None or g.has(name)]
        if len(groups) != 1:
            what = f"with tensor {name!r}" if name else ""
            raise KeyError(f"step {self.step} has {len(groups)} row groups {what}(requests with different layer "
                           "sets, Q/K heads or positions): iterate batch.groups instead")
        return groups[0]

    def tensor(self, name: str) -> np.ndarray:
        """The step's ``name`` tensor over all its requests, ``[L, N, ...]`` (bf16 widened to float32), when
        one row group has it (requests captured alike); otherwise iterate ``groups``."""
        return self._only_group(name).tensor(name).numpy()

    @property
    def positions(self) -> np.ndarray:
        """Token position of each row (of the only row group; see ``tensor``)."""
        return self._only_group().positions

    @property
    def row_request_ids(self) -> list:
        """Request id of each row (of the only row group)."""
        g = self._only_group()
        ids = self.request_ids
        return [ids[i] for i in g.row_requests]

    def index(self, request_id: str) -> int:
        try:
            return self.request_ids.index(request_id)
        except ValueError:
            raise KeyError(f"request {request_id!r} is not in step {self.step}'s batch") from None

    def segment(self, request_id: str) -> list[TensorFrame]:
        """``request_id``'s frames of this step (one per part), zero-copy views into the batch."""
        i = self.index(request_id)
        return self._frames(only=i)

    def frames(self) -> list[TensorFrame]:
        """Every request's frames of this step (per request: part 0, then part 1), zero-copy views."""
        return self._frames()

    def _frames(self, only: int | None = None) -> list[TensorFrame]:
        found: list[tuple[int, int, TensorFrame]] = []
        ids, seqs, versions = self.request_ids, self.seqs.tolist(), self.steering_versions.tolist()
        for g in self.groups:
            off = g.offsets.tolist()
            positions, token_ids = g.positions, g.token_ids
            for j, i in enumerate(g.requests.tolist()):
                if only is not None and i != only:
                    continue
                a, b = off[j], off[j + 1]
                found.append((i, g.part, TensorFrame(
                    ids[i], self.producer_id, self.epoch, seqs[i], self.step, positions[a:b].tolist(),
                    token_ids[a:b].tolist(), [_slice_tensor(t, a, b) for t in g.tensors], versions[i],
                    self.time_ns, g.part)))
        found.sort(key=lambda x: (x[0], x[1]))
        return [f for _, _, f in found]


@dataclass
class TokenBatch(Message):
    """What every streamed request sampled at one engine step: request ``i`` got
    ``token_ids[offsets[i]:offsets[i+1]]`` (``counts[i]`` tokens), at positions ``first_positions[i]`` on."""

    KIND: ClassVar[str] = "token_batch"
    producer_id: str
    epoch: int
    step: int
    request_ids: list
    seqs: Any
    counts: Any = None  # int64 [R] (None: one each)
    token_ids: Any = None  # int64 [sum(counts)]
    first_positions: Any = None  # int64 [R]
    finish_reasons: list | None = None  # [R] str | None (None: none finished)
    time_ns: int = 0

    def __post_init__(self) -> None:
        n = len(self.request_ids)
        self.seqs = int_column(self.seqs, "seqs")
        self.counts = np.ones(n, dtype=_I64) if self.counts is None else int_column(self.counts, "counts")
        self.token_ids = (np.zeros(0, dtype=_I64) if self.token_ids is None
                          else int_column(self.token_ids, "token_ids"))
        self.first_positions = (np.zeros(n, dtype=_I64) if self.first_positions is None
                                else int_column(self.first_positions, "first_positions"))
        if self.finish_reasons is None:
            self.finish_reasons = [None] * n

    def topic(self) -> bytes:
        return b""

    @property
    def offsets(self) -> np.ndarray:
        return _offsets(self.counts)

    def frames(self) -> list[TokenFrame]:
        """One ``TokenFrame`` per request (what a per-request producer would have sent)."""
        off = self.offsets.tolist()
        toks = self.token_ids.tolist()
        firsts = self.first_positions.tolist()
        seqs = self.seqs.tolist()
        return [TokenFrame(rid, self.producer_id, self.epoch, seqs[i], self.step, toks[off[i]:off[i + 1]],
                           list(range(firsts[i], firsts[i] + off[i + 1] - off[i])), self.finish_reasons[i],
                           self.time_ns)
                for i, rid in enumerate(self.request_ids)]


@dataclass
class Analysis:
    """One request's rows of an ``AnalysisBatch`` (what per-request consumers get as an "analysis" event)."""

    request_id: str
    analyzer: str
    analyzer_version: str
    producer_id: str
    epoch: int
    seq: int
    step: int
    positions: list  # token position of each row (-1: not about one position)
    values: dict  # name -> np.ndarray [rows, ...]
    labels: dict  # name -> list[str | None] (rows)
    alerts: list  # bool per row
    time_ns: int = 0
    source_time_ns: int = 0

    @property
    def alert(self) -> bool:
        return any(self.alerts)

    def value(self, name: str) -> np.ndarray:
        try:
            return self.values[name]
        except KeyError:
            raise KeyError(f"analysis {self.analyzer!r} has no value {name!r}; it has {sorted(self.values)}") from None


@dataclass
class AnalysisBatch(Message):
    """An analyzer's results for many requests: request ``i`` owns rows ``[offsets[i], offsets[i+1])`` of every
    column; each row is about one token position (``positions``, -1: the request or step as a whole).

    ``values``: name -> array with first dim = rows (float or int wire dtypes: scalars, small arrays);
    ``labels``: name -> list of str | None per row; ``alerts``: per row, whether it is an alert.
    ``source_time_ns``: the ``time_ns`` of the newest frame the results were computed from (latency).
    """

    KIND: ClassVar[str] = "analysis"
    producer_id: str
    epoch: int
    analyzer: str
    request_ids: list
    seqs: Any
    rows: Any = None  # int64 [R] (None: one row each)
    positions: Any = None  # int64 [sum(rows)] (None: all -1)
    values: dict = field(default_factory=dict)
    labels: dict = field(default_factory=dict)
    alerts: Any = None  # int64 0/1 [sum(rows)] (None: no alerts)
    step: int = -1
    analyzer_version: str = ""
    time_ns: int = 0
    source_time_ns: int = 0

    def __post_init__(self) -> None:
        n = len(self.request_ids)
        self.seqs = int_column(self.seqs, "seqs")
        self.rows = np.ones(n, dtype=_I64) if self.rows is None else int_column(self.rows, "rows")
        total = int(self.rows.sum()) if len(self.rows) else 0
        self.positions = (np.full(total, -1, dtype=_I64) if self.positions is None
                          else int_column(self.positions, "positions"))
        self.alerts = (np.zeros(total, dtype=_I64) if self.alerts is None
                       else int_column(np.asarray(self.alerts).astype(_I64), "alerts"))
        self.values = {str(k): np.asarray(v) for k, v in self.values.items()}
        for name, v in self.values.items():
            if v.ndim == 0 or str(v.dtype) not in _VALUE_DTYPES:
                raise ValueError(f"analysis value {name!r} must be an array of one row per result row in one of "
                                 f"{sorted(_VALUE_DTYPES)}, got {v.dtype} {v.shape}")

    def topic(self) -> bytes:
        return b""

    @property
    def offsets(self) -> np.ndarray:
        return _offsets(self.rows)

    def results(self) -> list[Analysis]:
        """One ``Analysis`` per request (zero-copy views of the value columns)."""
        off = self.offsets.tolist()
        pos = self.positions.tolist()
        alerts = self.alerts.tolist()
        seqs = self.seqs.tolist()
        out = []
        for i, rid in enumerate(self.request_ids):
            a, b = off[i], off[i + 1]
            out.append(Analysis(rid, self.analyzer, self.analyzer_version, self.producer_id, self.epoch, seqs[i],
                                self.step, pos[a:b], {k: v[a:b] for k, v in self.values.items()},
                                {k: v[a:b] for k, v in self.labels.items()}, [bool(x) for x in alerts[a:b]],
                                self.time_ns, self.source_time_ns))
        return out


@dataclass
class GapBatch(Message):
    """(2.1) What many GapNotices of one producer's streams would say, in one message: request ``i`` lost the
    inclusive seq ranges ``[firsts[k], lasts[k]]`` for ``k`` in ``[offsets[i], offsets[i+1])`` (``counts[i]``
    ranges). It has no seq of its own, like a GapNotice.

    A broker that drops a step batch for a slow consumer loses one seq of each of its ~256 requests: one
    GapBatch announces them all instead of 256 GapNotices, each encoded, sent, decoded and assembled alone."""

    KIND: ClassVar[str] = "gap_batch"
    producer_id: str
    epoch: int
    request_ids: list  # list[str], R
    counts: Any  # int64 [R]: ranges per request
    firsts: Any  # int64 [sum(counts)]: first missing seq of each range
    lasts: Any  # int64 [sum(counts)]: last missing seq of each range (inclusive)
    reason: str = ""
    origin: str = ""  # "producer" | "broker" | "consumer"
    time_ns: int = 0

    def __post_init__(self) -> None:
        self.counts = int_column(self.counts, "counts")
        self.firsts = int_column(self.firsts, "firsts")
        self.lasts = int_column(self.lasts, "lasts")

    @classmethod
    def of(cls, producer_id: str, epoch: int, missing: list, reason: str = "", origin: str = "",
           time_ns: int = 0) -> "GapBatch":
        """From ``missing``: ``(request_id, [[first, last], ...])`` per request."""
        ids, counts, firsts, lasts = [], [], [], []
        for rid, ranges in missing:
            ids.append(rid)
            counts.append(len(ranges))
            for a, b in ranges:
                firsts.append(a)
                lasts.append(b)
        return cls(producer_id, epoch, ids, counts, firsts, lasts, reason, origin, time_ns)

    def topic(self) -> bytes:
        return b""  # names many requests, like the columnar kinds

    @property
    def offsets(self) -> np.ndarray:
        return _offsets(self.counts)

    @property
    def count(self) -> int:
        """Seqs named in all (as ``GapNotice.count`` summed over its requests)."""
        return int((self.lasts - self.firsts).sum()) + len(self.lasts)

    def ranges(self) -> list[list[list[int]]]:
        """Each request's missing ranges, ``[[first, last], ...]``, in request order."""
        off = self.offsets.tolist()
        pairs = [[a, b] for a, b in zip(self.firsts.tolist(), self.lasts.tolist())]
        return [pairs[off[i]:off[i + 1]] for i in range(len(self.request_ids))]

    def notices(self) -> list[GapNotice]:
        """The equivalent GapNotices, one per request, in request order."""
        return [GapNotice(rid, self.producer_id, self.epoch, missing, self.reason, self.origin, self.time_ns)
                for rid, missing in zip(self.request_ids, self.ranges())]


# numpy dtypes an analysis value may have (their wire names are WIRE_DTYPES' names)
_VALUE_DTYPES = {"float32", "float64", "float16", "int8", "uint8", "int32", "int64", "bool"}
VALUE_WIRE_DTYPES = {**{k: v for k, v in WIRE_DTYPES.items() if k in _VALUE_DTYPES},
                     "float64": (np.dtype("<f8"), 8), "bool": (np.dtype("u1"), 1)}

BATCH_MESSAGE_TYPES = (StepBatch, TokenBatch, AnalysisBatch)  # columnar: one seq of each request they name
