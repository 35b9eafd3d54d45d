"""From decoded messages to consumer events: per-stream ordering and gaps, TP shard merge.

Ordering. Each stream (request_id, producer_id, epoch) is delivered in seq order. A message ahead of the
next expected seq waits in a bounded reorder window (``reorder_window`` messages, ``reorder_timeout_s``)
unless GapNotices already explain the hole; when the window overflows or times out, the unexplained seqs
become a ``GapNotice(origin="consumer", reason="seq_jump")`` event. GapNotices from the producer or the broker
are delivered once, trimmed to the seqs not yet delivered or reported, so no seq is ever counted twice.

TP merge. A request served with ``tp_size > 1`` has one stream per rank. For each engine ``step`` the
assembler waits for every rank's TensorFrame, checks each sharded tensor's ``[start, stop)`` tile the
``total`` exactly in rank order, concatenates along ``shard.dim`` and delivers one StepFrame. Unsharded
tensors (hidden states: replicated, published by rank 0 only) are taken as they are. A step some rank will
never deliver (that rank went past the step, ended, or more than ``merge_window`` steps are waiting) is never
merged partially: it becomes a "gap" event whose ``gap.reason`` is ``"incomplete_shards"`` and whose
``error`` is an ``IncompleteShardError`` naming the step and the missing ranks.

Producer contract this relies on: every rank publishes one TensorFrame per captured step (an empty
``tensors`` list if it has nothing for that step); TokenFrames and the request's StreamEnd that counts come
from rank 0 (other ranks' TokenFrames are ignored).

End of a TP request. The ranks are separate producers: nothing orders one rank's stream against another's,
so a whole rank's stream may arrive after rank 0's StreamEnd. The "end" event therefore waits for the
StreamEnd of every rank ``0 .. tp_size-1``, not only of the ranks seen so far. A rank that has started is
waited for as long as it takes (the broker ends the stream of a producer it lost); a rank whose StreamStart
has not come when every started rank has ended is waited for ``rank_wait_s`` (from a live source: ``flush``
decides it; from a recording: ``finish``), then the request ends without it and each of its steps is
"incomplete_shards" naming that rank.

Columnar messages (schema 2.0). A ``StepBatch`` / ``TokenBatch`` names many requests, each with the one seq it
uses in that request's stream, so each request's share is sequenced, gap-checked and TP-merged exactly like a
per-request ``TensorFrame`` / ``TokenFrame`` of that seq (a request with segments in parts 0 and 1 gets two
"frame" events from its one seq). A request's ``StepFrame`` is built lazily: its tensors are zero-copy views
into the batch, made when first read. An ``AnalysisBatch`` gives each request an "analysis" event; its
streams (request, analyzer producer, epoch) have no start or end, start at the first seq seen and are
delivered after the request's end too. A ``GapBatch`` (2.1) is each of its requests' GapNotice: its part of
each request gives the "gap" event that request's GapNotice would give, in both modes (batch mode merges them,
below).

Batch mode (``StreamAssembler(batches=True)``, what ``Consumer.on_batch`` and ``open_batches`` use): a
columnar message is not expanded; it becomes one "batch" event. Each request's seq is still checked (one dict
lookup and compare per request): starts, ends and gaps stay per request. A batch is never held back for one
request: an unexplained hole before a request's seq is reported at once (``seq_jump``, origin consumer), and a
request whose seq was already delivered or reported (a duplicate, e.g. after re-subscribing) is cut out of
the delivered batch. Per-request ``TensorFrame`` / ``TokenFrame`` messages (older producers, 1.x recordings)
arrive as one-request batches. TP > 1: each rank's batch is delivered as it came (per-rank batches: hidden
states whole from rank 0, Q/K shards carrying ``Tensor.shard``); use the per-request events for merged
heads.

Announced gaps in batch mode. A consumer that falls behind is sent a GapBatch for most messages (one seq of every
request each); one "gap" event per request per lost message cost it more than delivering. So the seqs that
GapNotices and GapBatches announce lost join their stream's pending gap (one reason and origin), delivered as one
"gap" event naming them all before that stream's next start, end, per-request message or consumer-found hole;
by ``flush`` once it waited ``reorder_timeout_s``; by ``finish``; when a loss of another reason comes; or when
it names ``GAP_RANGES_KEPT`` ranges. "batch" events do not wait for it: a batch may carry a request's seq that
follows seqs of a gap delivered after it. Every lost seq is still named once, in its request's "gap" event.
"""

from __future__ import annotations

import collections
import functools
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mia_stream.consumers._batch_ops import frame_batch, subset_batch, tokens_batch
from mia_stream.errors import IncompleteShardError
from mia_stream.schemas import seqranges
from mia_stream.schemas import (Analysis, AnalysisBatch, GapBatch, GapNotice, Message, RowGroup, StepBatch,
                                StreamEnd, StreamStart, Tensor, TensorFrame, TokenBatch, TokenFrame)

EVENT_KINDS = ("start", "frame", "tokens", "gap", "end", "analysis", "batch")
_RECENT_STREAMS = 10_000  # ended requests remembered for the analysis results that follow their end
_ANALYSIS_STREAMS = 100_000  # analysis streams (they never end) whose seqs are remembered, least recent dropped
# seq ranges a RequestStream keeps in its gap notices (its counts stay exact), and the most a batch-mode "gap"
# event names (so a stream's first one is always kept whole)
GAP_RANGES_KEPT = 16


@dataclass
class StepFrame:
    """One engine step of one request, TP shards merged. ``tensors`` are numpy (bf16 widened to float32);
    ``raw_tensors`` are the ``schemas.Tensor`` objects (exact wire dtype, zero-copy where unmerged).

    From a ``StepBatch`` the frame is a view of the request's segment: ``positions``, ``token_ids``,
    ``raw_tensors``, ``layers`` and ``rank_frames`` are made on first use (zero-copy slices of the batch).
    A view keeps the whole step's buffers alive: copy (``np.array(frame.tensors["hs"])``) what you keep."""

    request_id: str
    step: int
    positions: list
    token_ids: list
    steering_version: int
    raw_tensors: dict[str, Tensor]
    layers: dict[str, tuple]
    time_ns: int = 0
    rank_frames: list = field(default_factory=list, repr=False)  # the TensorFrames merged, by rank
    part: int = 0  # 0: hidden states (and Q/K at the same positions), 1: Q/K at positions of their own

    @functools.cached_property
    def tensors(self) -> dict[str, np.ndarray]:
        """name -> array: hs ``[L,T,H]``, q ``[L,T,heads,D]``, k ``[L,T,kv_heads,D]`` (computed on first use)."""
        return {name: t.numpy() for name, t in self.raw_tensors.items()}

    def __getattr__(self, name: str) -> Any:
        # Only reached for an attribute not yet set: the lazy fields of a frame cut from a StepBatch segment.
        seg = self.__dict__.get("_segment")
        if seg is None or name not in _LAZY_FIELDS:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        seg.fill(self, name)
        return self.__dict__[name]


_LAZY_FIELDS = frozenset(("positions", "token_ids", "raw_tensors", "layers", "rank_frames"))


class _GroupView:
    """A row group of a StepBatch, prepared once for all its segments: row offsets, the raw arrays."""

    __slots__ = ("group", "offsets", "raws")

    def __init__(self, group: RowGroup):
        self.group = group
        self.offsets = group.offsets.tolist()
        self.raws = [(t, t.raw()) for t in group.tensors]

    def tensors(self, j: int) -> list[Tensor]:
        """Segment ``j``'s rows of every tensor: zero-copy views."""
        a, b = self.offsets[j], self.offsets[j + 1]
        out = []
        for t, raw in self.raws:
            view = raw[:, a:b]
            scale = t.scale
            if scale is not None and scale.ndim >= 2 and scale.shape[1] == t.shape[1]:
                scale = scale[:, a:b]
            out.append(Tensor(t.name, t.dtype, view.shape, view, t.layers, t.shard, scale, t.meta))
        return out


class _Segment:
    """One part of one request in a StepBatch: what fills a lazy StepFrame (or builds its TensorFrame)."""

    __slots__ = ("batch", "view", "i", "j", "version")

    def __init__(self, batch: StepBatch, view: _GroupView, i: int, j: int, version: int):
        self.batch, self.view, self.i, self.j, self.version = batch, view, i, j, version

    def step_frame(self, request_id: str) -> StepFrame:
        b = self.batch
        sf = object.__new__(StepFrame)  # the lazy fields are filled by fill() when first read
        d = sf.__dict__
        d["request_id"], d["step"], d["time_ns"], d["part"] = request_id, b.step, b.time_ns, self.view.group.part
        d["steering_version"] = self.version
        d["_segment"] = self
        return sf

    def fill(self, sf: StepFrame, name: str) -> None:
        d = sf.__dict__
        if name == "rank_frames":
            d["rank_frames"] = [self.tensor_frame()]
            return
        g, j = self.view.group, self.j
        a, e = self.view.offsets[j], self.view.offsets[j + 1]
        tensors = self.view.tensors(j)
        d["positions"], d["token_ids"] = g.positions[a:e].tolist(), g.token_ids[a:e].tolist()
        d["raw_tensors"] = {t.name: t for t in tensors}
        d["layers"] = {t.name: tuple(t.layers) for t in tensors}

    def tensor_frame(self) -> TensorFrame:
        b, v, j = self.batch, self.view, self.j
        a, e = v.offsets[j], v.offsets[j + 1]
        g = v.group
        return TensorFrame(b.request_ids[self.i], b.producer_id, b.epoch, int(b.seqs[self.i]), b.step,
                           g.positions[a:e].tolist(), g.token_ids[a:e].tolist(), v.tensors(j), self.version,
                           b.time_ns, g.part)


class _Share:
    """What one request holds in a StepBatch (its segments, one per part: maybe none) under its one seq."""

    __slots__ = ("seq", "step", "segments")

    def __init__(self, seq: int, step: int, segments: list):
        self.seq, self.step, self.segments = seq, step, segments


class _Mark:
    """A batch's place in a request's seq order (batch mode): what the sequencer released before it goes
    before the batch event, what it released after it goes after."""

    __slots__ = ("seq",)

    def __init__(self, seq: int):
        self.seq = seq


class _PendingGap:
    """Batch mode: a stream's announced losses of one reason not delivered yet, one "gap" event for many lost
    messages. ``bounds``: first, last, first, last... of its seq ranges, flat (no list per range)."""

    __slots__ = ("bounds", "reason", "origin", "time_ns", "since", "analysis")

    def __init__(self, reason: str, origin: str, time_ns: int, since: float, analysis: bool):
        self.bounds: list[int] = []
        self.reason, self.origin, self.time_ns = reason, origin, time_ns
        self.since, self.analysis = since, analysis  # since: the caller's clock; analysis: an analyzer's stream

    def add(self, first: int, last: int) -> None:
        bounds = self.bounds
        if bounds and bounds[-1] + 1 == first:
            bounds[-1] = last
        else:
            bounds.append(first)
            bounds.append(last)


@dataclass
class RequestStream:
    """Everything known about one request's stream(s); the same object in every event of the request.

    ``gaps``: GapNotices of the request's "gap" events, the first ones, naming at most ``GAP_RANGES_KEPT`` seq
    ranges in all (the first is always kept). ``gap_events`` and ``gap_seqs`` count every "gap" event of the
    request and the seqs they named, kept or not."""

    request_id: str
    start: StreamStart | None = None  # TP rank 0's StreamStart
    starts: dict[int, StreamStart] = field(default_factory=dict)
    tp_size: int = 1
    generated_token_ids: list = field(default_factory=list)
    gaps: list = field(default_factory=list)
    ended: bool = False
    end: StreamEnd | None = None
    ends: dict[int, StreamEnd] = field(default_factory=dict)
    frames: int = 0
    gap_events: int = 0
    gap_seqs: int = 0
    _gap_ranges_kept: int = field(default=0, init=False, repr=False, compare=False)

    @property
    def prompt_token_ids(self) -> list:
        return list(self.start.prompt_token_ids) if self.start is not None else []

    def _add_gap(self, gap: GapNotice, seqs: int) -> None:
        # Bounded: the assembler remembers 10,000 ended streams, and under sustained overload each one kept a
        # notice per gap event (millions of objects: full collections of 1.2 s in bench_load.py's saturated `*`).
        self.gap_events += 1
        self.gap_seqs += seqs
        ranges = len(gap.missing)
        if not self.gaps or self._gap_ranges_kept + ranges <= GAP_RANGES_KEPT:
            self.gaps.append(gap)
            self._gap_ranges_kept += ranges


@dataclass(slots=True)
class Event:
    kind: str  # one of EVENT_KINDS
    stream: RequestStream | None  # None for a "batch" event (it names many requests)
    frame: StepFrame | None = None
    tokens: TokenFrame | None = None
    gap: GapNotice | None = None
    end: StreamEnd | None = None
    error: Exception | None = None  # IncompleteShardError for reason "incomplete_shards"
    analysis: Analysis | None = None  # an "analysis" event: one request's rows of an AnalysisBatch
    batch: StepBatch | TokenBatch | AnalysisBatch | None = None  # a "batch" event (batch mode)

    @property
    def start(self) -> StreamStart | None:
        return self.stream.start


# ---------------------------------------------------------------------------------------------- gaps

def _notice(key: tuple, news: list[list[int]], source: GapNotice | GapBatch) -> GapNotice:
    """The GapNotice of a gap event: ``source`` itself when it is one naming exactly ``news``."""
    if type(source) is GapNotice and news == source.missing:
        return source
    return GapNotice(key[0], key[1], key[2], news, source.reason, source.origin, source.time_ns)


class _Sequencer:
    """Seq order and gap accounting of one stream."""

    __slots__ = ("key", "expected", "known", "held", "held_since", "window", "duplicates")

    def __init__(self, key: tuple, window: int):
        self.key = key
        self.expected = 0
        self.known: list[list[int]] = []  # announced missing seqs >= expected
        self.held: dict[int, Message] = {}
        self.held_since = 0.0
        self.window = window
        self.duplicates = 0

    def gap(self, missing: list) -> list[list[int]] | None:
        """Record an announced gap (``missing``: its seq ranges); the ranges that are news (not delivered, not
        already announced), or None."""
        if not self.known and not self.held:  # the common case: what seqranges.lenient and subtract would give
            fast = self._gap_fast(missing)
            if fast is not None:
                if fast:
                    self.known = [list(r) for r in fast]
                    self._skip_known()  # a gap at ``expected``: the next message takes the in-order path
                return fast or None
        new: list[list[int]] = []
        for a, b in seqranges.lenient(missing):
            a = max(a, self.expected)
            if a <= b:
                new.extend(seqranges.subtract(self.known, a, b))
        for s in self.held:  # a seq that did arrive is not missing, whatever the notice says
            new = [part for a, b in new for part in ([[a, b]] if not a <= s <= b else
                                                       [x for x in ([a, s - 1], [s + 1, b]) if x[0] <= x[1]])]
        if not new:
            return None
        self.known = seqranges.union(self.known, new)
        return new

    def _gap_fast(self, missing: list) -> list[list[int]] | None:
        """``missing`` past ``expected``, when its ranges are valid, ascending and apart (not touching); None
        otherwise (the general path). At saturation a consumer gets a gap for most requests of most steps: the
        general path's sorting and merging was ~35% of its samples (bench_load.py, py-spy)."""
        if type(missing) is not list:
            return None
        out: list[list[int]] = []
        last = -2
        expected = self.expected
        for r in missing:
            if (type(r) is not list and type(r) is not tuple) or len(r) != 2:
                return None
            a, b = r
            if type(a) is not int or type(b) is not int or not 0 <= a <= b or a <= last + 1:
                return None
            last = b
            if a < expected:
                a = expected
            if a <= b:
                out.append([a, b])
        return out

    def gap_range(self, first: int, last: int) -> int:
        """``gap([[first, last]])`` of a valid range when nothing is held or announced (the caller checked): the
        first seq of it that is news (news up to ``last``), or -1 when none is."""
        expected = self.expected
        if first < expected:
            first = expected
        if first > last:
            return -1
        if first == expected:
            self.expected = last + 1  # explained up to there: the next message takes the in-order path
        else:
            self.known = [[first, last]]
        return first

    def push(self, msg: Message, now: float) -> list:
        """Messages (and synthesized GapNotices) ready in order after ``msg`` arrived."""
        seq = msg.seq
        if seq == self.expected and not self.held and not self.known:  # in order: the common case
            self.expected = seq + 1
            return [msg]
        if seq < self.expected or seq in self.held:
            self.duplicates += 1
            return []
        self.held[seq] = msg
        if len(self.held) == 1:
            self.held_since = now
        return self._release(len(self.held) > self.window, now)

    def flush(self, now: float, timeout: float) -> list:
        if self.held and now - self.held_since >= timeout:
            return self._release(True, now)
        return []

    def _release(self, force: bool, now: float) -> list:
        """Held messages that can go now, in seq order (``force``: all of them, unexplained holes reported);
        ``now`` (the caller's clock) restarts the wait of whatever stays held."""
        out: list = []
        while self.held:
            self._skip_known()
            msg = self.held.pop(self.expected, None)
            if msg is not None:
                out.append(msg)
                self.expected += 1
                continue
            first = min(self.held)
            if not force and seqranges.subtract(self.known, self.expected, first - 1):
                break
            unexplained = seqranges.subtract(self.known, self.expected, first - 1)
            if unexplained:
                rid, pid, epoch = self.key
                out.append(GapNotice(rid, pid, epoch, unexplained, "seq_jump", "consumer", time.time_ns()))
            self.known = [r for r in self.known if r[0] >= first]
            self.expected = first
        self._skip_known()
        self.held_since = now if self.held else 0.0  # the caller's clock (injected in tests), not the real one
        return out

    def _skip_known(self) -> None:
        while self.known and self.known[0][0] <= self.expected:
            self.expected = max(self.expected, self.known[0][1] + 1)
            self.known.pop(0)


# ---------------------------------------------------------------------------------------------- TP merge

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
        try:
            scale = np.concatenate([t.scale for t in shards], axis=dim)
        except (TypeError, ValueError):
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


# ---------------------------------------------------------------------------------------------- assembler

class _Rank:
    __slots__ = ("stream", "rank", "started")

    def __init__(self, stream: RequestStream, rank: int, started: bool = False):
        self.stream, self.rank, self.started = stream, rank, started  # started: by its StreamStart


class StreamAssembler:
    """Feed decoded messages (live or replayed) in arrival order; get consumer events back.

    ``batches``: batch mode (module docstring): a columnar message becomes one "batch" event instead of
    per-request "frame" / "tokens" / "analysis" events; starts, ends and gaps stay per request."""

    def __init__(self, *, reorder_window: int = 16, reorder_timeout_s: float = 0.2, merge_window: int = 64,
                 rank_wait_s: float = 10.0, batches: bool = False):
        self.reorder_window = reorder_window
        self.reorder_timeout_s = reorder_timeout_s
        self.merge_window = merge_window
        self.rank_wait_s = rank_wait_s
        self.batches = batches
        self._seq: dict[tuple, _Sequencer] = {}
        # request streams whose sequencer holds messages behind a hole: ``holding`` and ``flush`` look at these
        # alone (scanning every sequencer on every message took 30% of a consumer's time at 256 requests/step)
        self._held: set[tuple] = set()
        self._ranks: dict[tuple, _Rank] = {}
        self._requests: dict[str, RequestStream] = {}
        self._mergers: dict[str, _Merger] = {}
        self._early: dict[str, list] = {}  # events of a request whose rank-0 start has not come yet
        # TP requests whose started ranks all ended, waiting for a rank that has not started: rid -> (stream, since)
        self._waiting: dict[str, tuple[RequestStream, float]] = {}
        self._now = time.monotonic()
        self._done: collections.OrderedDict[tuple, None] = collections.OrderedDict()
        # analysis streams (request, analyzer producer, epoch): no start or end, so kept least-recently-used
        self._analysis: collections.OrderedDict[tuple, _Sequencer] = collections.OrderedDict()
        self._analysis_held: set[tuple] = set()  # those of them holding results behind a hole
        # ended requests (and requests known only from analysis results): what analysis events refer to
        self._recent: collections.OrderedDict[str, RequestStream] = collections.OrderedDict()
        # batch mode: streams' announced losses waiting to be one "gap" event each, oldest first
        self._pending: collections.OrderedDict[tuple, _PendingGap] = collections.OrderedDict()
        self.counters: collections.Counter[str] = collections.Counter()

    @property
    def holding(self) -> bool:
        """Something waits for time to pass (call ``flush`` periodically while this is true)."""
        return bool(self._waiting) or bool(self._held) or bool(self._analysis_held) or bool(self._pending)

    def feed(self, msg: Message, now: float | None = None) -> list[Event]:
        now = self._now = time.monotonic() if now is None else now
        kind = type(msg)
        if kind is StepBatch:
            return self._batch(msg, now) if self.batches else self._expand_steps(msg, now)
        if kind is TokenBatch:
            return self._batch(msg, now) if self.batches else self._expand_tokens(msg, now)
        if kind is AnalysisBatch:
            return self._batch(msg, now) if self.batches else self._expand_analysis(msg, now)
        if kind is GapBatch:
            return self._gap_batch(msg, now)
        if not isinstance(msg, (StreamStart, TensorFrame, TokenFrame, StreamEnd, GapNotice)):
            return []
        key = (msg.request_id, msg.producer_id, msg.epoch)
        if kind is GapNotice:
            return self._announced_gap(key, msg.missing, msg, now)
        sq = self._open_sequencer(key)
        return self._handle(key, sq.push(msg, now)) if sq is not None else []

    def _announced_gap(self, key: tuple, missing: list, source: GapNotice | GapBatch, now: float) -> list[Event]:
        """A gap announced for stream ``key`` by a GapNotice or by its part of a GapBatch (``source``): what is
        news becomes a "gap" event; the messages it explains are released."""
        asq = self._analysis.get(key)
        if asq is not None:  # a gap in an analyzer's results for this request
            news = asq.gap(missing)
            ready = asq._release(False, now) if asq.held else []
            return (self._announce(key, news, source, now, True) if news else []) + self._handle_analysis(key, ready)
        sq = self._open_sequencer(key)
        if sq is None:
            return []
        news = sq.gap(missing)
        ready = sq._release(False, now) if sq.held else []
        return (self._announce(key, news, source, now, False) if news else []) + self._handle(key, ready)

    def _announce(self, key: tuple, news: list, source: GapNotice | GapBatch, now: float,
                  analysis: bool) -> list[Event]:
        """The "gap" event of the seqs an announced gap named that are news: at once, or in batch mode pending
        (module docstring)."""
        if self.batches:
            return self._defer_gap(key, news, source.reason, source.origin, source.time_ns, now, analysis)
        gap = _notice(key, news, source)
        seqs = gap.count
        return self._on_analysis_gap(key, gap, seqs) if analysis else self._on_gap(key, gap, seqs)

    def _defer_gap(self, key: tuple, news: list, reason: str, origin: str, time_ns: int, now: float,
                   analysis: bool) -> list[Event]:
        """Batch mode: ``news`` joins stream ``key``'s pending gap; the events of what could not wait."""
        p = self._pending.get(key)
        out: list[Event] = []
        if p is not None and (p.reason != reason or p.origin != origin):
            out, p = self._pending_gap(key), None
        for first, last in news:
            if p is None:
                p = self._pending[key] = _PendingGap(reason, origin, time_ns, now, analysis)
            p.add(first, last)
            if len(p.bounds) >= 2 * GAP_RANGES_KEPT:
                out += self._pending_gap(key)
                p = None
        return out

    def _pending_gap(self, key: tuple) -> list[Event]:
        """The "gap" event of stream ``key``'s pending gap (batch mode), which is then no longer pending."""
        p = self._pending.pop(key)
        b = p.bounds
        gap = GapNotice(key[0], key[1], key[2], [[b[i], b[i + 1]] for i in range(0, len(b), 2)], p.reason,
                        p.origin, p.time_ns)
        seqs = sum(b[1::2]) - sum(b[::2]) + len(b) // 2
        return self._on_analysis_gap(key, gap, seqs) if p.analysis else self._on_gap(key, gap, seqs)

    def _gap_batch(self, b: GapBatch, now: float) -> list[Event]:
        """Each request's part of a GapBatch, as its GapNotice (nothing for old news). A consumer behind its
        producer is sent a GapBatch for most messages: the general path, per request, cost more than delivering
        a step (54% of the saturated `*` consumer's samples in bench_load.py). The common part (one valid range,
        its stream open with nothing held or announced) costs one sequencer update, and then in batch mode one
        range added to the stream's pending gap, else one notice and one event."""
        ids, firsts, lasts, counts = b.request_ids, b.firsts, b.lasts, b.counts
        pid, epoch = b.producer_id, b.epoch
        if not (len(counts) == len(firsts) == len(lasts) == len(ids) and (counts == 1).all()
                and (firsts >= 0).all() and (firsts <= lasts).all()):
            out: list[Event] = []
            for rid, missing in zip(ids, b.ranges()):
                out += self._announced_gap((rid, pid, epoch), missing, b, now)
            return out
        reason, origin, time_ns = b.reason, b.origin, b.time_ns
        seqd, ranks, analysis = self._seq, self._ranks, self._analysis
        batches, pending = self.batches, self._pending
        room = 2 * GAP_RANGES_KEPT - 2  # a pending gap shorter than this takes one more range without an event
        out = []
        lost = 0
        for rid, first, last in zip(ids, firsts.tolist(), lasts.tolist()):
            key = (rid, pid, epoch)
            asq = analysis.get(key) if analysis else None
            sq = asq or seqd.get(key)
            if sq is None or sq.held or sq.known:
                out += self._announced_gap(key, [[first, last]], b, now)
                continue
            first = sq.gap_range(first, last)
            if first < 0:
                continue
            if batches:
                p = pending.get(key)
                if p is not None and p.reason == reason and p.origin == origin and len(p.bounds) < room:
                    p.add(first, last)
                else:
                    out += self._defer_gap(key, [[first, last]], reason, origin, time_ns, now, asq is not None)
                continue
            gap = GapNotice(rid, pid, epoch, [[first, last]], reason, origin, time_ns)
            seqs = last - first + 1
            if asq is not None:
                out += self._on_analysis_gap(key, gap, seqs)
                continue
            lost += seqs  # what _on_gap does, without its calls: counted once for the batch
            rs = (ranks.get(key) or self._rank_of(key)).stream
            rs._add_gap(gap, seqs)
            ev = Event("gap", rs, None, None, gap)
            if rs.start is None and rs.starts:
                out += self._emit(rs, [ev])
            else:
                out.append(ev)
        self.counters["gap_seqs"] += lost
        return out

    def flush(self, now: float | None = None) -> list[Event]:
        """Release messages held too long behind an unexplained seq hole, and end TP requests that waited
        ``rank_wait_s`` for a rank that never started (call when idle)."""
        now = self._now = time.monotonic() if now is None else now
        out = []
        pending = self._pending
        while pending:
            key, p = next(iter(pending.items()))
            if now - p.since < self.reorder_timeout_s:
                break
            out += self._pending_gap(key)
        for key in list(self._held):
            sq = self._seq.get(key)
            if sq is not None:
                out += self._handle(key, sq.flush(now, self.reorder_timeout_s))
        for key in list(self._analysis_held):
            out += self._handle_analysis(key, self._analysis[key].flush(now, self.reorder_timeout_s))
        for rs, since in list(self._waiting.values()):
            if now - since >= self.rank_wait_s:
                out += self._try_end(rs, give_up=True)
        return out

    def finish(self) -> list[Event]:
        """The source ended: release everything held; undecidable TP steps become incomplete."""
        out = []
        for key in list(self._pending):
            out += self._pending_gap(key)
        for key, sq in list(self._seq.items()):
            if sq.held:
                out += self._handle(key, sq._release(True, self._now))
        for key in list(self._analysis_held):
            out += self._handle_analysis(key, self._analysis[key]._release(True, self._now))
        for rs, _since in list(self._waiting.values()):  # nothing more will come: not from unstarted ranks
            out += self._try_end(rs, give_up=True)
        for rid, merger in list(self._mergers.items()):
            rs = self._requests.get(rid)
            if rs is not None:
                out += self._merge_events(rs, merger.resolve(everything=True))
        return out

    # ---------------------------------------------------------------------------------------- columnar

    def _push(self, key: tuple, item: Any, now: float) -> list[Event]:
        """One request's share of a columnar message, through its stream's sequencer (the uncommon path)."""
        sq = self._open_sequencer(key)
        return self._handle(key, sq.push(item, now)) if sq is not None else []

    def _open_sequencer(self, key: tuple) -> _Sequencer | None:
        """The sequencer of request stream ``key`` (made on its first message), or None once it ended (its
        late messages are counted as ``after_end``)."""
        if key in self._done:
            self.counters["after_end"] += 1
            return None
        sq = self._seq.get(key)
        if sq is None:
            sq = self._seq[key] = _Sequencer(key, self.reorder_window)
        return sq

    def _expand_steps(self, b: StepBatch, now: float) -> list[Event]:
        """Per-request "frame" events from a StepBatch: each request's share is sequenced like a TensorFrame
        of its seq; frames are lazy views. The in-order case costs a dict lookup and a compare per request."""
        ids, seqs, versions = b.request_ids, b.seqs.tolist(), b.steering_versions.tolist()
        shares: list = [None] * len(ids)
        for g in b.groups:
            view = _GroupView(g)
            for j, i in enumerate(g.requests.tolist()):
                seg = _Segment(b, view, i, j, versions[i])
                if shares[i] is None:
                    shares[i] = [seg]
                else:  # the request's frame of the other part: parts in order
                    shares[i].append(seg)
                    shares[i].sort(key=lambda sg: sg.view.group.part)
        out: list[Event] = []
        pid, epoch, seqd = b.producer_id, b.epoch, self._seq
        for i, rid in enumerate(ids):
            key = (rid, pid, epoch)
            seq = seqs[i]
            sq = seqd.get(key)  # present: the stream has not ended (ended keys leave _seq)
            if sq is not None and seq == sq.expected and not sq.held and not sq.known:
                sq.expected = seq + 1
                if shares[i] or self._mergers:
                    out += self._on_share(key, b.step, shares[i] or ())
            else:
                out += self._push(key, _Share(seq, b.step, shares[i] or []), now)
        return out

    def _on_share(self, key: tuple, step: int, segments: Any) -> list[Event]:
        merger = self._mergers.get(key[0]) if self._mergers else None
        if not segments and merger is None:
            return []  # named without rows: its seq is used for nothing
        r = self._ranks.get(key) or self._rank_of(key)
        rs = r.stream
        if merger is not None:  # TP: each rank's share joins its other ranks' shares of the step
            return self._merge_events(rs, merger.add_share(r.rank, step, [seg.tensor_frame() for seg in segments]))
        rs.frames += len(segments)
        rid = rs.request_id
        if rs.start is not None and len(segments) == 1:  # the common case, without _emit's checks
            return [Event("frame", rs, frame=segments[0].step_frame(rid))]
        return self._emit(rs, [Event("frame", rs, frame=seg.step_frame(rid)) for seg in segments])

    def _expand_tokens(self, b: TokenBatch, now: float) -> list[Event]:
        out: list[Event] = []
        seqd = self._seq
        for f in b.frames():
            key = (f.request_id, f.producer_id, f.epoch)
            sq = seqd.get(key)
            if sq is not None and f.seq == sq.expected and not sq.held and not sq.known:
                sq.expected = f.seq + 1
                out += self._on_tokens(key, f)
            else:
                out += self._push(key, f, now)
        return out

    def _analysis_seq(self, key: tuple, first_seq: int) -> _Sequencer:
        """The sequencer of an analysis stream: it starts at the first seq seen (no start message)."""
        sq = self._analysis.get(key)
        if sq is not None:
            self._analysis.move_to_end(key)
            return sq
        r = self._ranks.get(key)
        # a gap notice that came first was taken for a request stream's; a stream that started is one (an
        # analyzer publishing under its engine's producer id breaks the spec: its results get a stream apart)
        sq = self._seq.pop(key, None) if r is None or not r.started else None
        if sq is not None:
            self._held.discard(key)
            self._ranks.pop(key, None)
            if not sq.held and sq.expected == 0 and sq.known:
                sq.expected = min(sq.known[0][0], first_seq)
        else:
            if r is not None and r.started:
                self.counters["analysis_under_a_request_stream_key"] += 1
            sq = _Sequencer(key, self.reorder_window)
            sq.expected = first_seq
        self._analysis[key] = sq
        if len(self._analysis) > _ANALYSIS_STREAMS:
            self._analysis_held.discard(self._analysis.popitem(last=False)[0])
        return sq

    def _expand_analysis(self, b: AnalysisBatch, now: float) -> list[Event]:
        out: list[Event] = []
        for a in b.results():
            key = (a.request_id, a.producer_id, a.epoch)
            sq = self._analysis_seq(key, a.seq)
            out += self._handle_analysis(key, sq.push(a, now))
        return out

    def _handle_analysis(self, key: tuple, msgs: list) -> list[Event]:
        """Events of what an analysis stream's sequencer released (called after each of its operations)."""
        sq = self._analysis.get(key)
        if sq is not None and sq.held:
            self._analysis_held.add(key)
        else:
            self._analysis_held.discard(key)
        out: list[Event] = self._pending_gap(key) if msgs and key in self._pending else []
        for m in msgs:
            if isinstance(m, GapNotice):
                out += self._on_analysis_gap(key, m, m.count)
            else:
                out.append(Event("analysis", self._stream_for(key[0]), analysis=m))
        return out

    def _on_analysis_gap(self, key: tuple, gap: GapNotice, seqs: int) -> list[Event]:
        rs = self._stream_for(key[0])
        rs._add_gap(gap, seqs)
        self.counters["gap_seqs"] += seqs
        return [Event("gap", rs, gap=gap)]

    def _stream_for(self, rid: str) -> RequestStream:
        """The request's stream (live, or recently ended) for an analysis event; a bare one if unknown."""
        rs = self._requests.get(rid) or self._recent.get(rid)
        if rs is None:
            rs = RequestStream(rid)
            self._remember(rs)
        return rs

    def _remember(self, rs: RequestStream) -> None:
        self._recent[rs.request_id] = rs
        self._recent.move_to_end(rs.request_id)
        if len(self._recent) > _RECENT_STREAMS:
            self._recent.popitem(last=False)

    def _batch(self, b: Any, now: float) -> list[Event]:
        """Batch mode: one "batch" event for a columnar message, with each request's seq checked. Events a
        request's stream owes before the batch (gaps, held messages) come first, those after it (a held
        StreamEnd) after it; requests already delivered or ended are cut out of the batch."""
        ids, seqs = b.request_ids, b.seqs.tolist()
        pid, epoch = b.producer_id, b.epoch
        analysis = type(b) is AnalysisBatch
        seqd, ranks = self._seq, self._ranks
        toks = off = None
        if type(b) is TokenBatch:
            toks, off = b.token_ids.tolist(), b.offsets.tolist()
        before: list[Event] = []
        after: list[Event] = []
        drop: list[int] = []
        for i, rid in enumerate(ids):
            key = (rid, pid, epoch)
            seq = seqs[i]
            sq = self._analysis_seq(key, seq) if analysis else seqd.get(key)
            if sq is None or seq != sq.expected or sq.held or sq.known:
                if not self._batch_slow(key, sq, seq, now, before, after, analysis):
                    drop.append(i)
                    continue
            else:
                sq.expected = seq + 1
            if toks is not None:
                r = ranks.get(key)
                if r is not None and r.rank == 0:
                    r.stream.generated_token_ids.extend(toks[off[i]:off[i + 1]])
        if drop:
            b = subset_batch(b, sorted(set(range(len(ids))) - set(drop)))
        batch_event = [Event("batch", None, batch=b)] if b.request_ids else []
        return before + batch_event + after

    def _batch_slow(self, key: tuple, sq: _Sequencer | None, seq: int, now: float, before: list, after: list,
                    analysis: bool) -> bool:
        """A request of a batch that is not simply next in its stream: whether its share stays in the batch."""
        if sq is None:
            if key in self._done:
                self.counters["after_end"] += 1
                return False
            sq = self._seq[key] = _Sequencer(key, self.reorder_window)
            if seq == 0:
                sq.expected = 1
                return True
        if seq < sq.expected or seq in sq.held:
            sq.duplicates += 1
            self.counters["batch_duplicates"] += 1
            return False
        mark = _Mark(seq)
        sq.held[seq] = mark
        released = sq._release(True, now)  # a batch is not held back for one request: report holes now
        k = next(n for n, m in enumerate(released) if m is mark)
        handle = self._handle_analysis if analysis else self._handle
        before += handle(key, released[:k])
        after += handle(key, released[k + 1:])
        return True

    # ---------------------------------------------------------------------------------------- internals

    def _handle(self, key: tuple, msgs: list) -> list[Event]:
        """Events of what a request stream's sequencer released (called after each of its operations)."""
        sq = self._seq.get(key)
        if sq is not None and sq.held:
            self._held.add(key)
        else:
            self._held.discard(key)
        out: list[Event] = self._pending_gap(key) if msgs and key in self._pending else []
        for m in msgs:
            if isinstance(m, _Share):
                out += self._on_share(key, m.step, m.segments)
            elif isinstance(m, GapNotice):
                out += self._on_gap(key, m, m.count)
            elif isinstance(m, StreamStart):
                out += self._on_start(key, m)
            elif isinstance(m, TensorFrame):
                out += self._on_frame(key, m)
            elif isinstance(m, TokenFrame):
                out += self._on_tokens(key, m)
            elif isinstance(m, StreamEnd):
                out += self._on_end(key, m)
        return out

    def _rank_of(self, key: tuple) -> _Rank:
        r = self._ranks.get(key)
        if r is None:  # no StreamStart seen (joined without it): treat as a TP-1 stream of its own
            self.counters["messages_without_start"] += 1
            rs = self._requests.get(key[0]) or RequestStream(key[0])
            self._requests.setdefault(key[0], rs)
            r = self._ranks[key] = _Rank(rs, 0)
        return r

    def _emit(self, rs: RequestStream, events: list[Event]) -> list[Event]:
        if rs.start is None and rs.starts:  # a rank > 0 spoke first: hold until rank 0's start
            self._early.setdefault(rs.request_id, []).extend(events)
            return []
        return events

    def _on_start(self, key: tuple, m: StreamStart) -> list[Event]:
        rid = m.request_id
        rs = self._requests.get(rid)
        if rs is None or (rs.ended and m.tp_rank == 0):
            rs = self._requests[rid] = RequestStream(rid, tp_size=max(1, m.tp_size))
        rank = m.tp_rank if 0 <= m.tp_rank < max(1, m.tp_size) else 0
        self._ranks[key] = _Rank(rs, rank, started=True)
        rs.starts[rank] = m
        rs.tp_size = max(rs.tp_size, m.tp_size, 1)
        if rs.tp_size > 1 and rid not in self._mergers and not self.batches:
            self._mergers[rid] = _Merger(rs.tp_size, self.merge_window)
        if rank != 0:
            return []
        rs.start = m
        return [Event("start", rs)] + self._early.pop(rid, [])

    def _on_gap(self, key: tuple, gap: GapNotice, seqs: int) -> list[Event]:
        """The "gap" event of ``gap`` (naming ``seqs`` seqs) in request stream ``key``."""
        rs = self._rank_of(key).stream
        rs._add_gap(gap, seqs)
        self.counters["gap_seqs"] += seqs
        return self._emit(rs, [Event("gap", rs, gap=gap)])

    def _on_frame(self, key: tuple, m: TensorFrame) -> list[Event]:
        r = self._rank_of(key)
        rs = r.stream
        if self.batches:  # a per-request frame (older producer, 1.x recording): a one-request batch
            return self._emit(rs, [Event("batch", None, batch=frame_batch(m))])
        merger = self._mergers.get(rs.request_id)
        if merger is None:
            rs.frames += 1
            sf = StepFrame(m.request_id, m.step, list(m.positions), list(m.token_ids), m.steering_version,
                           {t.name: t for t in m.tensors}, {t.name: tuple(t.layers) for t in m.tensors}, m.time_ns,
                           [m], m.part)
            return self._emit(rs, [Event("frame", rs, frame=sf)])
        return self._merge_events(rs, merger.add(r.rank, m))

    def _merge_events(self, rs: RequestStream, results: list) -> list[Event]:
        out = []
        for step, res, missing in results:
            if isinstance(res, StepFrame):
                rs.frames += 1
                out.append(Event("frame", rs, frame=res))
            else:
                s0 = rs.start
                gap = GapNotice(rs.request_id, s0.producer_id if s0 else "", s0.epoch if s0 else 0, [],
                                "incomplete_shards", "consumer", time.time_ns())
                res.step, res.missing_ranks = step, missing
                rs._add_gap(gap, 0)
                self.counters["incomplete_steps"] += 1
                out.append(Event("gap", rs, gap=gap, error=res))
        return self._emit(rs, out)

    def _on_tokens(self, key: tuple, m: TokenFrame) -> list[Event]:
        r = self._rank_of(key)
        if r.rank != 0:
            self.counters["tokens_from_other_ranks"] += 1
            return []
        r.stream.generated_token_ids.extend(m.token_ids)
        if self.batches:  # a per-request TokenFrame: a one-request batch
            return self._emit(r.stream, [Event("batch", None, batch=tokens_batch(m))])
        return self._emit(r.stream, [Event("tokens", r.stream, tokens=m)])

    def _on_end(self, key: tuple, m: StreamEnd) -> list[Event]:
        r = self._rank_of(key)
        rs = r.stream
        rs.ends[r.rank] = m
        self._forget(key)
        out: list[Event] = []
        merger = self._mergers.get(rs.request_id)
        if merger is not None:
            out += self._merge_events(rs, merger.rank_ended(r.rank))
        return out + self._try_end(rs)

    def _try_end(self, rs: RequestStream, give_up: bool = False) -> list[Event]:
        """The request's "end" event once rank 0 and every rank of ``tp_size`` ended; ``give_up``: stop
        waiting for ranks that never started (they were waited for ``rank_wait_s``, or the source ended)."""
        rid = rs.request_id
        if rs.ended or 0 not in rs.ends or any(rank not in rs.ends for rank in rs.starts):
            if self._waiting.get(rid, (None,))[0] is rs:
                del self._waiting[rid]  # a started rank's StreamEnd (or the broker's) will come and call again
            return []
        unstarted = [rank for rank in range(rs.tp_size) if rank not in rs.starts]
        if unstarted and not give_up:  # its stream may still be on its way (another producer, another socket)
            if rid not in self._waiting:
                self._waiting[rid] = (rs, self._now)
            return []
        if self._waiting.get(rid, (None,))[0] is rs:
            del self._waiting[rid]
        if unstarted:
            self.counters["ranks_never_started"] += len(unstarted)
        out: list[Event] = []
        merger = self._mergers.get(rid)
        if merger is not None:
            out += self._merge_events(rs, merger.resolve(everything=True))
            self._mergers.pop(rid, None)
        rs.ended, rs.end = True, rs.ends[0]
        if self._requests.get(rid) is rs:
            del self._requests[rid]
        self._remember(rs)  # analysis results may still come for it
        return out + self._emit(rs, [Event("end", rs, end=rs.end)])

    def _forget(self, key: tuple) -> None:
        # the ended stream's rank entry goes too: it held the RequestStream (start, tokens, gaps) of every request
        # that ever ended, so a long-running consumer grew without bound and its full collections with it
        # (1.4-2.5 s each in bench_load.py's saturated `*` consumer); _done still refuses its late messages
        self._seq.pop(key, None)
        self._ranks.pop(key, None)
        self._held.discard(key)
        self._done[key] = None
        if len(self._done) > 100_000:
            self._done.popitem(last=False)
