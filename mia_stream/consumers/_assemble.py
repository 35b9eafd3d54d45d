"""From decoded messages to consumer events: the ``StreamAssembler``.

The assembler is split by concern; each part's module says what state it owns:
  ``_events``      the event classes and ``RequestStream`` (the per-request record every event shares)
  ``_sequencer``   one stream's seq order and gap accounting (reorder window, announced and found holes)
  ``_frames``      ``StepFrame`` and the lazy zero-copy views of a request's share of a ``StepBatch``
  ``_tp_merge``    TP > 1: one StepFrame per step from every rank's shards, never a partial merge
  ``_batch_mode``  ``batches=True``: one "batch" event per columnar message, announced gaps merged per request
  this module      the streams: which sequencer and which request a message belongs to, starts and ends
                   (TP: every rank's), expanding columnar messages, analysis streams, GapBatches, flush/finish.

Rule (this module): ``StreamAssembler`` owns the stream tables: ``_seq`` (request stream key -> its sequencer;
a key leaves it at the stream's end, into ``_done``), ``_held`` (keys whose sequencer holds messages),
``_ranks`` (key -> the request and TP rank it feeds), ``_requests`` (live requests), ``_mergers``, ``_early``
(events of a request before rank 0's start), ``_waiting`` (TP requests waiting for an unstarted rank),
``_analysis`` / ``_analysis_held`` (analysis streams, LRU), ``_recent`` (ended requests, LRU) and ``counters``.
A stream key is (request_id, producer_id, epoch).

End of a TP request. The ranks are separate producers: nothing orders one rank's stream against another's, so a
whole rank's stream may arrive after rank 0's StreamEnd. The "end" event therefore waits for the StreamEnd of
every rank ``0 .. tp_size-1``, not only of the ranks seen so far. A rank that has started is waited for as long
as it takes (the broker ends the stream of a producer it lost); a rank whose StreamStart has not come when every
started rank has ended is waited for ``rank_wait_s`` (from a live source: ``flush`` decides it; from a
recording: ``finish``), then the request ends without it and each of its steps is "incomplete_shards" naming
that rank.

Columnar messages (schema 2.0). A ``StepBatch`` / ``TokenBatch`` names many requests, each with the one seq it
uses in that request's stream, so each request's share is sequenced, gap-checked and TP-merged exactly like a
per-request ``TensorFrame`` / ``TokenFrame`` of that seq (``_frames``: lazy views). An ``AnalysisBatch`` gives
each request an "analysis" event; its streams (request, analyzer producer, epoch) have no start or end, start
at the first seq seen and are delivered after the request's end too. A ``GapBatch`` (2.1) is each of its
requests' GapNotice: its part of each request gives the "gap" event that request's GapNotice would give, in
both modes (batch mode merges them).
"""

from __future__ import annotations

import collections
import time
from typing import Any

from mia_stream.consumers._batch_mode import _BatchMode, _PendingGap
from mia_stream.consumers._batch_ops import frame_batch, tokens_batch
from mia_stream.consumers._events import (EVENT_CLASSES, EVENT_KINDS, GAP_RANGES_KEPT, AnalysisEvent, BatchEvent,
                                          EndEvent, Event, FrameEvent, GapEvent, RequestStream, StartEvent,
                                          TokensEvent)
from mia_stream.consumers._frames import StepFrame, _GroupView, _Segment, _Share
from mia_stream.consumers._sequencer import _notice, _Sequencer
from mia_stream.consumers._tp_merge import _Merger, merge_shards
from mia_stream.schemas import (AnalysisBatch, GapBatch, GapNotice, Message, StepBatch, StreamEnd, StreamStart,
                                TensorFrame, TokenBatch, TokenFrame)

__all__ = ["EVENT_CLASSES", "EVENT_KINDS", "GAP_RANGES_KEPT", "AnalysisEvent", "BatchEvent", "EndEvent", "Event",
           "FrameEvent", "GapEvent", "RequestStream", "StartEvent", "StepFrame", "StreamAssembler", "TokensEvent",
           "merge_shards"]

_RECENT_STREAMS = 10_000  # ended requests remembered for the analysis results that follow their end
_ANALYSIS_STREAMS = 100_000  # analysis streams (they never end) whose seqs are remembered, least recent dropped


class _Rank:
    __slots__ = ("stream", "rank", "started")

    def __init__(self, stream: RequestStream, rank: int, started: bool = False):
        self.stream, self.rank, self.started = stream, rank, started  # started: by its StreamStart


class StreamAssembler(_BatchMode):
    """Feed decoded messages (live or replayed) in arrival order; get consumer events back.

    ``batches``: batch mode (``_batch_mode``): a columnar message becomes one "batch" event instead of
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
        # batch mode (``_BatchMode`` owns it): announced losses waiting to be one "gap" event each, oldest first
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
        (``_batch_mode``)."""
        if self.batches:
            return self._defer_gap(key, news, source.reason, source.origin, source.time_ns, now, analysis)
        gap = _notice(key, news, source)
        seqs = gap.count
        return self._on_analysis_gap(key, gap, seqs) if analysis else self._on_gap(key, gap, seqs)

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
            ev = GapEvent(rs, gap)
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
            return [FrameEvent(rs, segments[0].step_frame(rid))]
        return self._emit(rs, [FrameEvent(rs, seg.step_frame(rid)) for seg in segments])

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
                out.append(AnalysisEvent(self._stream_for(key[0]), m))
        return out

    def _on_analysis_gap(self, key: tuple, gap: GapNotice, seqs: int) -> list[Event]:
        rs = self._stream_for(key[0])
        rs._add_gap(gap, seqs)
        self.counters["gap_seqs"] += seqs
        return [GapEvent(rs, gap)]

    def note_gap(self, key: tuple, gap: GapNotice) -> RequestStream:
        """Record a loss the source found after the assembler delivered the seqs (a zero-copy view overwritten:
        ``_ring_views``) in its request's stream; that stream, for the "gap" event."""
        r = self._ranks.get(key)
        rs = r.stream if r is not None else self._stream_for(key[0])
        seqs = gap.count
        rs._add_gap(gap, seqs)
        self.counters["gap_seqs"] += seqs
        self.counters[f"gap_{gap.reason}"] += seqs
        return rs

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
        return [StartEvent(rs)] + self._early.pop(rid, [])

    def _on_gap(self, key: tuple, gap: GapNotice, seqs: int) -> list[Event]:
        """The "gap" event of ``gap`` (naming ``seqs`` seqs) in request stream ``key``."""
        rs = self._rank_of(key).stream
        rs._add_gap(gap, seqs)
        self.counters["gap_seqs"] += seqs
        return self._emit(rs, [GapEvent(rs, gap)])

    def _on_frame(self, key: tuple, m: TensorFrame) -> list[Event]:
        r = self._rank_of(key)
        rs = r.stream
        if self.batches:  # a per-request frame (older producer, 1.x recording): a one-request batch
            return self._emit(rs, [BatchEvent(frame_batch(m))])
        merger = self._mergers.get(rs.request_id)
        if merger is None:
            rs.frames += 1
            sf = StepFrame(m.request_id, m.step, list(m.positions), list(m.token_ids), m.steering_version,
                           {t.name: t for t in m.tensors}, {t.name: tuple(t.layers) for t in m.tensors}, m.time_ns,
                           [m], m.part)
            return self._emit(rs, [FrameEvent(rs, sf)])
        return self._merge_events(rs, merger.add(r.rank, m))

    def _merge_events(self, rs: RequestStream, results: list) -> list[Event]:
        out = []
        for step, res, missing in results:
            if isinstance(res, StepFrame):
                rs.frames += 1
                out.append(FrameEvent(rs, res))
            else:
                s0 = rs.start
                gap = GapNotice(rs.request_id, s0.producer_id if s0 else "", s0.epoch if s0 else 0, [],
                                "incomplete_shards", "consumer", time.time_ns())
                res.step, res.missing_ranks = step, missing
                rs._add_gap(gap, 0)
                self.counters["incomplete_steps"] += 1
                out.append(GapEvent(rs, gap, res))
        return self._emit(rs, out)

    def _on_tokens(self, key: tuple, m: TokenFrame) -> list[Event]:
        r = self._rank_of(key)
        if r.rank != 0:
            self.counters["tokens_from_other_ranks"] += 1
            return []
        r.stream.generated_token_ids.extend(m.token_ids)
        if self.batches:  # a per-request TokenFrame: a one-request batch
            return self._emit(r.stream, [BatchEvent(tokens_batch(m))])
        return self._emit(r.stream, [TokensEvent(r.stream, m)])

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
        return out + self._emit(rs, [EndEvent(rs, rs.end)])

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
