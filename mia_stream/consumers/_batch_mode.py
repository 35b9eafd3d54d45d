"""Batch mode (``StreamAssembler(batches=True)``: what ``Consumer.on_batch`` and ``open_batches`` use).

A columnar message is not expanded; it becomes one "batch" event. Each request's seq is still checked (one dict
lookup and compare per request): starts, ends and gaps stay per request. A batch is never held back for one
request: an unexplained hole before a request's seq is reported at once (``seq_jump``, origin consumer), and a
request whose seq was already delivered or reported (a duplicate, e.g. after re-subscribing) is cut out of the
delivered batch (``subset_batch``). Per-request ``TensorFrame`` / ``TokenFrame`` messages (older producers, 1.x
recordings) arrive as one-request batches. TP > 1: each rank's batch is delivered as it came (per-rank batches:
hidden states whole from rank 0, Q/K shards carrying ``Tensor.shard``); use the per-request events for merged
heads.

Announced gaps. A consumer that falls behind is sent a GapBatch for most messages (one seq of every request
each); one "gap" event per request per lost message cost it more than delivering. So the seqs that GapNotices
and GapBatches announce lost join their stream's pending gap (one reason and origin), delivered as one "gap"
event naming them all before that stream's next start, end, per-request message or consumer-found hole; by
``flush`` once it waited ``reorder_timeout_s``; by ``finish``; when a loss of another reason comes; or when it
names ``GAP_RANGES_KEPT`` ranges. "batch" events do not wait for it: a batch may carry a request's seq that
follows seqs of a gap delivered after it. Every lost seq is still named once, in its request's "gap" event.

Rule: ``_BatchMode`` is a part of ``StreamAssembler`` (a mixin, split out by concern); it owns ``_pending``
(stream key -> ``_PendingGap``, oldest first) and otherwise works through the assembler's sequencers
(``_seq``, ``_analysis_seq``) and its event makers (``_handle``, ``_handle_analysis``, ``_on_gap``).
"""

from __future__ import annotations

from typing import Any

from mia_stream.consumers._batch_ops import subset_batch
from mia_stream.consumers._events import GAP_RANGES_KEPT, BatchEvent, Event
from mia_stream.consumers._sequencer import _Sequencer
from mia_stream.schemas import AnalysisBatch, GapNotice, TokenBatch
from mia_stream.schemas import seqranges


class _Mark:
    """A batch's place in a request's seq order (batch mode): what the sequencer released before it goes
    before the batch event, what it released after it goes after."""

    __slots__ = ("seq",)

    def __init__(self, seq: int):
        self.seq = seq


class _PendingGap:
    """Batch mode: a stream's announced losses of one reason not delivered yet, one "gap" event for many lost
    messages. ``bounds``: first, last, first, last... of its seq ranges, flat: under overload a range joins it
    per lost message, and a list per range cost more than the delivery (``ranges()``: seqranges' form)."""

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

    def ranges(self) -> list[list[int]]:
        b = self.bounds
        return [[b[i], b[i + 1]] for i in range(0, len(b), 2)]


class _BatchMode:
    """The batch-mode part of ``StreamAssembler`` (module docstring)."""

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
        missing = p.ranges()
        gap = GapNotice(key[0], key[1], key[2], missing, p.reason, p.origin, p.time_ns)
        seqs = seqranges.count(missing)
        return self._on_analysis_gap(key, gap, seqs) if p.analysis else self._on_gap(key, gap, seqs)

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
        batch_event = [BatchEvent(b)] if b.request_ids else []
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
