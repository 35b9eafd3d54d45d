"""Delivery: each consumer's queue within its budget and credit window, its drops and their gaps, and the runs
of producers' gaps merged into GapBatches.

Rule: ``Delivery`` owns the consumer registry (``consumers``: identity -> ``_Consumer``), ``ready`` (consumers
with queued messages) and ``gap_runs`` (consumers with a gap run to queue before the input returns). A
consumer is added only by ``consumer()`` and removed only by ``forget()``; its queue, in-flight bytes, drops
and gap run change only here. Other parts read the registry and queue through this class; they change only a
consumer's subscription (``_late_join``: its patterns and options (name, window, batch, shm, gap_batch), and on
an unsubscribe the drops of the requests it no longer wants) and ``last_seen`` (``_routing``, on each message).
"""

from __future__ import annotations

import collections
import fnmatch
import re

import numpy as np
from typing import TYPE_CHECKING, Callable, Iterable

from mia_stream.bus import transport
from mia_stream.broker._entry import _DROPPABLE, _PART_KIND, _Entry, _gap_batch_ranges
from mia_stream.broker._shared import Context, _frames_nbytes, log
from mia_stream.errors import WireError
from mia_stream.schemas import (GapBatch, GapNotice, ViewSelection, compact, encode, has_partial_inline_rows,
                                inline_shm, select_requests, select_view, shm_extent, shm_loss_reason)
from mia_stream.schemas import seqranges

if TYPE_CHECKING:
    from mia_stream.bus.shm_ring import ShmRingReader

# ring sizes: a queued frame further behind its ring's writer is dropped, not sent. Half a ring, not more:
# a consumer that cannot keep up is always sent the oldest frame still allowed, and it must stay readable
# while it waits in flight behind the others (at 3/4, on the H200 they were overwritten before being read)
_SHM_STALE_LAG = 0.5


class _Consumer:
    __slots__ = ("identity", "name", "patterns", "match_cache", "queue", "queue_bytes", "window", "in_flight",
                 "drops", "delivered", "delivered_bytes", "dropped", "gaps_sent", "last_seen", "blocked", "batch",
                 "batches", "shm", "gap_batch", "gap_run", "pattern", "select")

    def __init__(self, identity: bytes, now: float):
        self.identity = identity
        self.name = identity.decode("utf-8", "replace")
        self.patterns: list[str] = []
        self.pattern = None  # all its patterns as one compiled regex's match (set_patterns)
        self.match_cache: dict[str, bool] = {}
        # (frames, bytes, entry or None, selected request indices or None, (ring, oldest position) or None)
        self.queue: collections.deque[tuple] = collections.deque()
        self.queue_bytes = 0
        self.window = 0
        self.in_flight = 0
        self.drops: dict[tuple, list[list[int]]] = {}  # stream key -> seq ranges dropped, not yet notified
        self.delivered = self.delivered_bytes = self.dropped = self.gaps_sent = 0
        self.last_seen = now
        self.blocked = False
        self.batch = False  # it said (Subscribe.batch) that it unpacks batches
        self.shm = False  # it said (Subscribe.shm) that it reads producers' shared-memory rings itself
        self.gap_batch = False  # its subscribe was of schema 2.1+: it decodes gap_batch
        self.select: ViewSelection | None = None  # (Subscribe.select) the layers/positions/tensors it wants
        # producers' gaps for it not yet queued (see Delivery.add_to_gap_run):
        # (producer id, epoch, reason, origin) -> request id -> [gap entries]
        self.gap_run: dict | None = None
        self.batches = 0

    def set_patterns(self, patterns: list[str]) -> None:
        """Its patterns (``_late_join``): one compiled regex of them all, so a new request id is matched in one
        pass (100k patterns matched one by one cost ~4 s per new request id; the broker bounds their number)."""
        self.patterns = patterns
        self.match_cache.clear()
        self.pattern = (re.compile("|".join(fnmatch.translate(p) for p in patterns)).match if patterns
                        else None)

    def matches(self, request_id: str) -> bool:
        hit = self.match_cache.get(request_id)
        if hit is None:
            hit = self.pattern is not None and self.pattern(request_id) is not None
            if len(self.match_cache) > 100_000:
                self.match_cache.clear()
            self.match_cache[request_id] = hit
        return hit


class Delivery:
    """``shm``: the reader of producers' rings (None without rings); ``flush(identity) -> still there``: the
    shell hands a consumer's queue to zmq before anything is dropped for it."""

    def __init__(self, ctx: Context, shm: ShmRingReader | None, flush: Callable[[bytes], bool] | None):
        self.ctx = ctx
        self.shm = shm
        self.flush = flush
        self.consumers: dict[bytes, _Consumer] = {}
        self.ready: set[bytes] = set()
        self.gap_runs: set[bytes] = set()
        self.prompt_len_of: Callable[[tuple], int] = lambda key: -1  # set by Streams (it owns the stream table)

    # ------------------------------------------------------------------------------------------ registry

    def consumer(self, identity: bytes) -> _Consumer:
        c = self.consumers.get(identity)
        if c is None:
            c = self.consumers[identity] = _Consumer(identity, self.ctx.now)
        return c

    def forget(self, c: _Consumer, timed_out: bool, streams: Iterable) -> None:
        """Forget a consumer that is gone (or timed out), with what was queued for it and its subscriptions in
        ``streams``."""
        k = self.ctx.counters
        if timed_out:
            k.consumers_timed_out += 1
        else:
            k.consumers_lost += 1
        k.discarded_for_gone_consumers += len(c.queue)
        self.consumers.pop(c.identity, None)
        self.ready.discard(c.identity)
        c.gap_run = None
        self.gap_runs.discard(c.identity)
        for s in streams:
            s.subscribers.discard(c.identity)
        c.queue.clear()

    def forget_stream(self, key: tuple) -> None:
        """A stream is forgotten: its drops not yet announced never will be."""
        for c in self.consumers.values():
            c.drops.pop(key, None)

    # ------------------------------------------------------------------------------------------ the shell's side

    def pending_send(self, identity: bytes) -> tuple[list[list], int] | None:
        """The messages to hand to consumer ``identity``'s socket now, as one zmq message (several make a
        batch), and their bytes; None when its queue is empty or its credit window is full. A message may go
        while less than the window is in flight (a batch's earlier messages count as in flight)."""
        c = self.consumers.get(identity)
        if c is None or not c.queue:
            self.ready.discard(identity)
            return None
        c.blocked = False
        if c.shm:
            self.drop_stale_head(c)
        q, window = c.queue, c.window
        if window and c.in_flight >= window:
            return None
        count, nbytes = transport.batch_span(q, transport.BATCH_MESSAGES if c.batch else 1,
                                              window - c.in_flight if window else None)
        return [q[i][0] for i in range(count)], nbytes

    def sent(self, identity: bytes, count: int, nbytes: int) -> None:
        """The first ``count`` messages of ``pending_send`` went (``nbytes`` in all)."""
        c = self.consumers.get(identity)
        if c is None:
            return
        q = c.queue
        for _ in range(count):
            q.popleft()
        c.queue_bytes -= nbytes
        c.in_flight += nbytes
        c.delivered += count
        c.delivered_bytes += nbytes
        if count > 1:
            c.batches += 1
            k = self.ctx.counters
            k.batches_out += 1
            k.batched_messages_out += count
        if not q:
            self.ready.discard(identity)

    def blocked(self, identity: bytes) -> None:
        c = self.consumers.get(identity)
        if c is not None:
            c.blocked = True

    def any_blocked(self) -> bool:
        consumers = self.consumers
        return any(c.blocked for c in map(consumers.get, self.ready) if c is not None)

    def credit(self, c: _Consumer, nbytes: int) -> None:
        c.in_flight = max(0, c.in_flight - nbytes)
        if c.queue:
            self.ready.add(c.identity)

    # ------------------------------------------------------------------------------------------ what a consumer gets

    def deliver_part(self, c: _Consumer, part: tuple) -> None:
        """A per-request message (start, tensors, tokens, end, gap) to ``c``."""
        entry = part[3]
        if entry.kind == "gap" and c.gap_batch:
            self.add_to_gap_run(c, entry)
            return
        frames, n, ring = self.view(entry, None, c.shm, None)
        if frames is None:  # the ring no longer holds its bytes: n is why
            self.enqueue_gap(c, entry.key, [[entry.seq, entry.seq]], n)
            return
        self.enqueue(c, frames, n, entry, None, ring, part[2])

    def fan_out(self, entry: _Entry, live: list) -> None:
        """Deliver a multi-request message: each consumer gets the requests (``(index, stream)`` in ``live``)
        it subscribed to."""
        per: dict[bytes, list[int]] = {}  # consumer -> the indices of the requests it gets
        for i, s in live:
            for ident in s.subscribers:
                got = per.get(ident)
                if got is None:
                    per[ident] = [i]
                else:
                    got.append(i)
        views: dict = {}  # selections made once per message, shared by consumers that match alike
        for ident, idx in per.items():
            c = self.consumers.get(ident)
            if c is not None:
                self.deliver_columnar(c, entry, idx, views)

    def deliver_columnar(self, c: _Consumer, entry: _Entry, idx: list[int], views: dict | None) -> None:
        """A columnar message (or a producer's gap batch) to ``c``, naming the requests ``idx`` (ascending
        indices)."""
        if entry.kind == "gap_batch":
            self._deliver_gap_batch(c, entry, idx, views)
            return
        if c.select is not None and entry.kind == "step_batch":
            frames, n, ring = self.view_selected(entry, idx, c.shm, c.select, views)
        else:
            frames, n, ring = self.view(entry, idx, c.shm, views)
        if frames is None:
            for gap in self.gap_messages(c, [(key, [[seq, seq]]) for key, seq in entry.requests(idx)], n):
                self.enqueue_control(c, gap)
            return
        self.enqueue(c, frames, n, entry, idx, ring, _PART_KIND[entry.kind])

    def _deliver_gap_batch(self, c: _Consumer, entry: _Entry, idx: list[int], views: dict | None) -> None:
        """A producer's gap batch to ``c``: as received, or a selection of requests ``idx``, when it decodes gap
        batches; else one GapNotice per request (each encoded once per message, shared by such consumers)."""
        if c.gap_batch:
            frames, n, _ = self.view(entry, idx, False, views)
            self.enqueue(c, frames, n, entry, idx, None, "gap")
            return
        if entry.notices is None:
            entry.notices = {}
        notices, h = entry.notices, entry.header
        ranges = None
        for i in idx:
            frames = notices.get(i)
            if frames is None:
                if ranges is None:
                    ranges = _gap_batch_ranges(h)
                frames = notices[i] = encode(GapNotice(entry.ids[i], h["producer_id"], h["epoch"], ranges[i],
                                                       h.get("reason", ""), h.get("origin", ""),
                                                       h.get("time_ns", 0)))
            self.enqueue(c, frames, _frames_nbytes(frames), None, None, None, "gap")

    def view(self, entry: _Entry, idx: list[int] | None, reads_rings: bool, views: dict | None) -> tuple:
        """``(frames, bytes, (ring, oldest position, end) or None)`` of what a consumer gets of ``entry``: the frames
        as received when it gets all of it and can read its ring; else a selection of requests ``idx`` and/or
        the bytes inline. ``(None, reason, None)`` when the ring no longer holds the bytes."""
        if idx is None or len(idx) == len(entry.ids):
            if entry.ring is None or reads_rings:
                return entry.frames, entry.nbytes, entry.ring
            if entry.inline is None:
                inline = self._inlined(entry, entry.frames)
                if inline[0] is None:
                    return None, inline[1], None
                entry.inline = inline
            return entry.inline[0], entry.inline[1], None
        key = (tuple(idx), reads_rings)
        if views is not None:
            hit = views.get(key)
            if hit is not None:
                return hit
        frames, h = select_requests(entry.frames, entry.header, idx)
        self.ctx.counters.selections += 1
        return self._view_of(entry, frames, h, reads_rings, views, key)

    def view_selected(self, entry: _Entry, idx: list[int] | None, reads_rings: bool, sel: ViewSelection,
                      views: dict | None) -> tuple:
        """``view`` for a consumer that selects layers, positions or tensors (``Subscribe.select``): the step batch
        (or its selection of requests ``idx``) narrowed by ``select_view``, a rewritten header and the wanted
        entries' frames; bytes inline only where ``view`` would put them inline."""
        whole = idx is None or len(idx) == len(entry.ids)
        key = ("select", None if whole else tuple(idx), reads_rings, sel.key())
        if views is not None:
            hit = views.get(key)
            if hit is not None:
                return hit
        if whole:
            frames, h = entry.frames, entry.header
        else:
            frames, h = select_requests(entry.frames, entry.header, idx)
        prompt_lens = None
        if sel.needs_prompt_lengths:
            if entry.prompt_lens is None:
                entry.prompt_lens = np.array([self.prompt_len_of(k) for k, _ in entry.requests(None)], dtype=np.int64)
            prompt_lens = entry.prompt_lens if whole else entry.prompt_lens[np.asarray(idx, dtype=np.intp)]
        frames, h = select_view(frames, h, sel, prompt_lens)
        self.ctx.counters.view_selections += 1
        return self._view_of(entry, frames, h, reads_rings, views, key)

    def _view_of(self, entry: _Entry, frames: list, h: dict, reads_rings: bool, views: dict | None, key) -> tuple:
        """``(frames, bytes, ring extent)`` of a rewritten message: its ring bytes inline where the consumer reads no
        rings or the header keeps only some of a group's rows, else by reference; kept in ``views`` under ``key``."""
        extent = shm_extent(h) if entry.ring is not None else None
        if (extent is not None and not reads_rings) or has_partial_inline_rows(h):
            frames, n = self._inlined(entry, frames)
            view = (frames, n, None)
        else:
            n = _frames_nbytes(frames)
            view = (frames, n + extent[2], (extent[0], extent[1], extent[3])) if extent is not None else (frames, n, None)
        if views is not None:
            views[key] = view
        return view

    def _inlined(self, entry: _Entry, frames: list) -> tuple:
        """``(frames, bytes)`` of ``frames`` with ring-held bytes inline (a columnar message: compacted to just its
        rows), or ``(None, reason)`` when the ring cannot give them."""
        k = self.ctx.counters
        try:
            out = inline_shm(frames, self.shm) if entry.ids is None else compact(frames, self.shm)
        except WireError as e:
            reason = shm_loss_reason(e)
            if reason == "shm_overrun":
                k.shm_overrun += 1
                times = k.shm_overrun
            else:
                k.shm_unavailable += 1
                times = k.shm_unavailable
            if times <= 10:
                log.warning("broker: could not inline a %s message from its producer's ring: %s", entry.kind, e)
            return None, reason
        if entry.ring is not None:
            k.shm_inlined += 1
        else:
            k.compacted += 1
        return out, _frames_nbytes(out)

    # ------------------------------------------------------------------------------------------ queueing

    def enqueue(self, c: _Consumer, frames: list, n: int, entry: _Entry | None, idx: list[int] | None,
                ring: tuple | None, kind: str) -> None:
        """Queue a stream message for ``c``: past its budget, tensors (then tokens beyond a reserve) are dropped
        and recorded per stream; before the next message queued, gaps name every stream's drops."""
        if c.gap_run is not None:
            self._queue_gap_run(c)
        if c.queue_bytes and kind in _DROPPABLE:
            cfg = self.ctx.config
            limit = cfg.consumer_queue_bytes
            if kind != "tensors":
                limit += cfg.token_reserve_bytes
            if c.queue_bytes + n > limit:
                if self.flush is not None and not self.flush(c.identity):
                    return  # it is gone
                if c.queue_bytes and c.queue_bytes + n > limit:
                    requests = entry.requests(idx)
                    for key, seq in requests:
                        seqranges.add_seq(c.drops.setdefault(key, []), seq)
                    c.dropped += len(requests)
                    self.ctx.counters.dropped_for_consumers += len(requests)
                    return
        if c.drops:
            # All of them, not only this message's requests': then each request's gap still precedes its next
            # message, and the drops of a step batch (~256 requests) go as one GapBatch, not 256 GapNotices
            drops, c.drops = c.drops, {}
            for gap in self.gap_messages(c, list(drops.items()), "consumer_queue_full"):
                self.enqueue_control(c, gap)
        c.queue.append((frames, n, entry, idx, ring))
        c.queue_bytes += n
        self.ready.add(c.identity)

    def enqueue_gap(self, c: _Consumer, key: tuple, missing: list, reason: str, origin: str = "broker") -> None:
        rid, pid, epoch = key
        frames = encode(GapNotice(rid, pid, epoch, missing, reason, origin, self.ctx.wall_ns()))
        c.gaps_sent += seqranges.count(missing)
        self.enqueue_control(c, frames)

    def gap_messages(self, c: _Consumer, gaps: list[tuple[tuple, list]], reason: str) -> list[list]:
        """The messages that announce ``gaps`` (stream key, missing seq ranges) to ``c``, counted in its
        ``gaps_sent``: one GapBatch per (producer, epoch) naming several streams when ``c`` decodes them, else
        one GapNotice per stream."""
        now_ns = self.ctx.wall_ns()
        by_producer: dict[tuple, list] = {}
        for (rid, pid, epoch), missing in gaps:
            c.gaps_sent += seqranges.count(missing)
            by_producer.setdefault((pid, epoch), []).append((rid, missing))
        out = []
        for (pid, epoch), named in by_producer.items():
            if c.gap_batch and len(named) > 1:
                out.append(encode(GapBatch.of(pid, epoch, named, reason, "broker", now_ns)))
                self.ctx.counters.gap_batches += 1
            else:
                out.extend(encode(GapNotice(rid, pid, epoch, missing, reason, "broker", now_ns))
                           for rid, missing in named)
        return out

    def enqueue_control(self, c: _Consumer, frames: list) -> None:
        if c.gap_run is not None:
            self._queue_gap_run(c)
        n = _frames_nbytes(frames)
        c.queue.append((frames, n, None, None, None))
        c.queue_bytes += n
        self.ready.add(c.identity)

    # ------------------------------------------------------------------------------------------ gap runs

    def add_to_gap_run(self, c: _Consumer, entry: _Entry) -> None:
        """A producer's GapNotice for ``c`` (which decodes gap batches) joins its run: it is queued, with the
        other producers' gaps this input brings for ``c``, as one GapBatch per (producer, epoch, reason, origin)
        before anything else is queued for ``c`` (so before its stream's next message), at the latest when this
        input returns. A publisher announces its drops as a GapNotice per request in a row: at saturation each
        step it dropped was ~256 of them, which the broker sent and the consumer decoded and assembled one by one
        (scripts/bench_load.py: ~40% of a consumer's samples, py-spy)."""
        h = entry.header
        rid, pid, epoch = entry.key
        if c.gap_run is None:
            c.gap_run = {}
            self.gap_runs.add(c.identity)
        named = c.gap_run.setdefault((pid, epoch, h.get("reason", ""), h.get("origin", "")), {})
        got = named.get(rid)
        if got is None:
            named[rid] = [entry]
        else:
            got.append(entry)

    def _queue_gap_run(self, c: _Consumer) -> None:
        """Queue ``c``'s gap run: a GapNotice as received for a stream alone in its group, else a GapBatch."""
        run, c.gap_run = c.gap_run, None
        self.gap_runs.discard(c.identity)
        k = self.ctx.counters
        for (pid, epoch, reason, origin), named in run.items():
            if len(named) == 1:
                for entry in next(iter(named.values())):
                    self.enqueue(c, entry.frames, entry.nbytes, entry, None, None, "gap")
                continue
            missing = [(rid, [r for e in entries for r in e.header.get("missing", ())])
                       for rid, entries in named.items()]
            time_ns = min(e.header.get("time_ns", 0) for entries in named.values() for e in entries)
            frames = encode(GapBatch.of(pid, epoch, missing, reason, origin, time_ns))
            k.gap_batches += 1
            k.producer_gaps_batched += sum(len(entries) for entries in named.values())
            self.enqueue(c, frames, _frames_nbytes(frames), None, None, None, "gap")

    def flush_gap_runs(self) -> None:
        """Queue every consumer's gap run (an input is done)."""
        for ident in list(self.gap_runs):
            c = self.consumers.get(ident)
            if c is not None and c.gap_run is not None:
                self._queue_gap_run(c)
        self.gap_runs.clear()

    def drop_stale_head(self, c: _Consumer) -> None:
        """Drop the ring-held messages at the head of ``c``'s queue whose bytes the producer is about to
        overwrite (its writer has used up more than half of the room the message left it: for a small message,
        more than half a ring past it), with their gaps put in their place.

        A consumer that falls behind then gets the newest frames the ring still holds, and its loss is the
        fraction it cannot keep up with; without this it would receive only frames already overwritten. (The
        room is measured from the message's end: from its start, a message over half the ring, an all-layer
        prompt step, was "stale" the moment it was written, and every consumer lost every such step.)"""
        q, lag = c.queue, self.shm.lag
        dropped: dict[tuple, list[list[int]]] = {}
        count = 0
        while q:
            frames, n, entry, idx, ring = q[0]
            if ring is None:
                break
            past_end = lag(ring[0], ring[2])  # ring sizes the writer is past the message's end
            if past_end <= _SHM_STALE_LAG * (1.0 - (lag(ring[0], ring[1]) - past_end)):
                break
            q.popleft()
            c.queue_bytes -= n
            for key, seq in entry.requests(idx):
                seqranges.add_seq(dropped.setdefault(key, []), seq)
                count += 1
        if not dropped:
            return
        for frames in reversed(self.gap_messages(c, list(dropped.items()), "shm_overrun")):
            n = _frames_nbytes(frames)
            q.appendleft((frames, n, None, None, None))
            c.queue_bytes += n
        c.dropped += count
        k = self.ctx.counters
        k.dropped_for_consumers += count
        k.shm_stale_dropped += count
