"""Streams: what producers send, kept per stream ``(request_id, producer_id, epoch)`` in its late-join buffer
and handed to delivery for the stream's subscribers; the buffers' bounds (eviction); a stream's end and its
forgetting.

Rule: ``Streams`` owns the stream table (``by_key``, ``by_request``, ``closed``, the arrival ``order``) and the
late-join buffers' accounting (``buffered_total``, ``evictable``, each stream's parts and ``buffered`` and
``evicted``). A stream is added by ``_new_stream`` and removed only by ``drop``; its parts, seqs and end change
only here. A stream's ``subscribers`` are set here when it starts and changed by ``_late_join`` (subscribe,
unsubscribe) and ``Delivery.forget`` (a consumer gone). Other parts read the table.

A columnar message's request whose stream has not started (its start was re-announced after a broker restart
and is still on its way) is held in that stream like any per-request message: its part is replayed, as a
selection naming that request, when the start comes. Analysis streams have no start and no end: they are
delivered from their first message, buffered for late join, and forgotten once their request's own streams are
forgotten and they have been quiet as long as an ended stream lingers.
"""

from __future__ import annotations

import collections
from typing import TYPE_CHECKING

import numpy as np

from mia_stream.broker._config import PRODUCERS
from mia_stream.broker._entry import _EVICT_FIRST, _I64, _PART_KIND, _Entry, _gap_batch_ranges, _shares
from mia_stream.broker._late_join import replay
from mia_stream.broker._shared import Context, _frames_nbytes
from mia_stream.schemas import StreamEnd, columnar_requests, encode
from mia_stream.schemas import seqranges

if TYPE_CHECKING:
    from mia_stream.broker._delivery import Delivery
    from mia_stream.broker._peers import Peers, _Producer

_CLOSED_MEMORY = 100_000


class _Stream:
    __slots__ = ("key", "request_id", "producer", "start", "started", "analysis", "ended", "end_time", "next_seq",
                 "data", "ctl", "buffered", "evicted", "subscribers", "messages", "bytes", "created", "last_time",
                 "control_id", "gaps", "merged_gaps", "merged_reason", "prompt_len")

    def __init__(self, key: tuple, producer: bytes, now: float, analysis: bool = False):
        self.key, self.request_id, self.producer = key, key[0], producer
        self.control_id = ""  # StreamStart.control_id: the producer that takes this request's steering
        self.start: tuple | None = None  # its start's part
        self.analysis = analysis  # an analyzer's stream: no start, no end (wire-format 10.5)
        self.started = analysis  # delivered to subscribers (else held until its start comes)
        self.ended = False
        self.end_time = 0.0
        self.next_seq = 0
        self.data: collections.deque[tuple] = collections.deque()  # tensor (and analysis) parts: evicted first
        self.ctl: collections.deque[tuple] = collections.deque()  # tokens, gaps, end
        self.buffered = 0
        self.evicted: list[list[int]] = []
        self.subscribers: set[bytes] = set()
        self.messages = self.bytes = 0
        self.created = self.last_time = now
        self.gaps = 0  # producer gap parts buffered (at most max_gaps_per_stream; the rest is merged)
        self.merged_gaps: list[list[int]] = []  # producer gaps past that: their ranges, announced before its end
        self.merged_reason = ""
        self.prompt_len = -1  # StreamStart's prompt length (a consumer's positions relative to it); -1 unknown


class Streams:
    def __init__(self, ctx: Context, peers: Peers, delivery: Delivery):
        self.ctx = ctx
        self.peers = peers
        self.delivery = delivery
        delivery.prompt_len_of = self.prompt_len_of
        self.by_key: dict[tuple, _Stream] = {}
        self.by_request: dict[str, set[tuple]] = {}
        self.closed: collections.OrderedDict[tuple, None] = collections.OrderedDict()
        self.order = 0
        self.buffered_total = 0
        # every buffered tensor/analysis part in arrival order, (stream, part): the late-join total evicts the
        # oldest from here in O(1). Scanning the streams for the oldest instead cost the broker so much per
        # message once the total was reached that consumers fell behind (10 s at 2 MiB per step: 35-55% lost)
        self.evictable: collections.deque[tuple] = collections.deque()
        # bytes of parts evicted or forgotten otherwise that ``evictable`` may still reference: past a bound it is
        # pruned, so that evicted frames are really freed (12 x 100 MB frames once stayed referenced here)
        self.unreferenced_bytes = 0

    # ------------------------------------------------------------------------------------------ the table

    def _next_order(self) -> int:
        self.order += 1
        return self.order

    def _new_stream(self, key: tuple, p: _Producer, analysis: bool = False) -> _Stream | None:
        """A new stream owned by producer connection ``p``, or None (refused: ``p`` holds its limit of open
        streams)."""
        limit = self.ctx.config.max_streams_per_producer
        if (p.analysis_streams if analysis else len(p.streams)) >= limit:
            self.ctx.counters.refused_too_many_streams += 1
            self.peers.error_to(PRODUCERS, p.identity, "too_many_streams",
                                f"this producer holds {limit} open streams, the broker's limit "
                                "(--max-streams-per-producer): a new stream is refused", key[0])
            return None
        s = self.by_key[key] = _Stream(key, p.identity, self.ctx.now, analysis)
        keys = self.by_request.get(key[0])
        if keys is None:
            keys = self.by_request[key[0]] = set()
        keys.add(key)
        if analysis:
            s.subscribers = {c.identity for c in self.delivery.consumers.values() if c.matches(s.request_id)}
            p.analysis_streams += 1
        else:
            p.streams.add(key)
        return s

    def refuse_not_owner(self, p: _Producer, s: _Stream) -> None:
        """A message for stream ``s`` from a connection other than the one that started it: refused."""
        self.ctx.counters.refused_not_stream_owner += 1
        self.peers.error_to(PRODUCERS, p.identity, "not_stream_owner",
                            f"stream {s.key[0]!r} of producer {s.key[1]!r} epoch {s.key[2]} belongs to another "
                            "connection: only the connection that started a stream may send for it", s.key[0])

    def refuse_too_many_requests(self, p: _Producer, kind: str, n: int) -> bool:
        """Whether a message naming ``n`` requests is over the limit (then refused and reported)."""
        limit = self.ctx.config.max_requests_per_message
        if n <= limit:
            return False
        self.ctx.counters.refused_too_many_requests += 1
        self.peers.error_to(PRODUCERS, p.identity, "too_many_requests",
                            f"a {kind} message naming {n} requests is refused: the broker's limit is {limit} "
                            "(--max-requests-per-message)")
        return True

    def _end_stream(self, s: _Stream) -> None:
        s.ended = True
        s.end_time = self.ctx.now
        p = self.peers.producers.get(s.producer)
        if p is not None:
            p.streams.discard(s.key)

    def drop(self, key: tuple) -> None:
        """Forget a stream (it ended and lingered, or its start never came): its buffer is freed."""
        s = self.by_key.pop(key)
        self.buffered_total -= s.buffered
        for part in s.data:
            self.unreferenced_bytes += part[5]
        if s.analysis:
            p = self.peers.producers.get(s.producer)
            if p is not None and p.analysis_streams:
                p.analysis_streams -= 1
        keys = self.by_request.get(key[0])
        if keys is not None:
            keys.discard(key)
            if not keys:
                del self.by_request[key[0]]
        self.closed[key] = None
        if len(self.closed) > _CLOSED_MEMORY:
            self.closed.popitem(last=False)
        self.delivery.forget_stream(key)

    def drop_orphan(self, key: tuple) -> None:
        """Forget a stream whose start never came (not even re-announced): nobody could interpret its frames."""
        s = self.by_key[key]
        self.ctx.counters.orphan_messages += len(s.data) + len(s.ctl)
        self.drop(key)

    def prompt_len_of(self, key: tuple) -> int:
        """A stream's prompt length from its start (-1: unknown, no start seen)."""
        s = self.by_key.get(key)
        return -1 if s is None or s.start is None else s.prompt_len

    def request_streams_live(self, request_id: str) -> bool:
        """Whether the broker still keeps a (start/end) stream of ``request_id``."""
        return any(not self.by_key[k].analysis for k in self.by_request.get(request_id, ()))

    def _deliver(self, s: _Stream, part: tuple) -> None:
        consumers, deliver = self.delivery.consumers, self.delivery.deliver_part
        for ident in list(s.subscribers):
            c = consumers.get(ident)
            if c is not None:
                deliver(c, part)

    # ------------------------------------------------------------------------------------------ producers' messages

    def on_stream_message(self, p: _Producer, h: dict, body: list, nbytes: int, ring: tuple | None) -> None:
        kind = h["kind"]
        key = (h["request_id"], h["producer_id"], h["epoch"])
        seq = h.get("seq", 0)
        s = self.by_key.get(key)
        if s is None:
            if key in self.closed:
                self.ctx.counters.after_end += 1
                return
            s = self._new_stream(key, p)
            if s is None:
                return
            if kind != "start":  # frames of a stream whose start it has not seen: ask it to re-announce
                self.peers.heartbeat_to(PRODUCERS, p.identity, known=False)
        elif s.producer is not p.identity and s.producer != p.identity:
            self.refuse_not_owner(p, s)
            return
        elif s.ended:
            self.ctx.counters.after_end += 1
            return
        elif s.analysis:
            self.ctx.counters.unexpected_kind += 1
            return
        s.messages += 1
        s.bytes += nbytes
        s.last_time = self.ctx.now
        entry = _Entry(kind, self._next_order(), body, nbytes, ring)
        entry.key, entry.seq = key, seq
        part = (entry.order, seq, kind, entry, -1, nbytes)
        if kind == "start":
            if s.start is not None:
                self.ctx.counters.duplicate_starts += 1  # a re-announce to a broker that already knew it
                return
            s.start = part
            s.started = True
            s.control_id = h.get("control_id") or ""
            s.prompt_len = len(h.get("prompt_token_ids") or ())
            s.next_seq = max(s.next_seq, 1)
            s.subscribers = {c.identity for c in self.delivery.consumers.values() if c.matches(s.request_id)}
            for ident in list(s.subscribers):
                c = self.delivery.consumers.get(ident)
                if c is not None:
                    replay(self.delivery, c, [s])  # the start plus anything held before it came
            if any(pt[2] == "end" for pt in s.ctl):
                self._end_stream(s)
            return
        if seq >= s.next_seq:
            s.next_seq = seq + 1
        self._buffer(s, part)
        if not s.started:  # held until the (re-announced) start arrives; see _late_join.replay
            return
        consumers = self.delivery.consumers  # (_deliver, inline: this is the per-message path)
        for ident in list(s.subscribers):
            c = consumers.get(ident)
            if c is not None:
                self.delivery.deliver_part(c, part)
        if kind == "end":
            self._end_stream(s)

    def on_columnar(self, p: _Producer, h: dict, body: list, nbytes: int, ring: tuple | None) -> None:
        """A message naming many requests: each request's part goes to its stream (buffered there, held while
        the stream has not started); the consumers subscribed to some of the live ones get it whole or as a
        selection."""
        kind = h["kind"]
        ids, seqs = columnar_requests(h)
        if len(ids) > self.ctx.config.max_requests_per_message and self.refuse_too_many_requests(p, kind, len(ids)):
            return
        pid, epoch = h["producer_id"], h["epoch"]
        ident = p.identity
        entry = _Entry(kind, self._next_order(), body, nbytes, ring)
        entry.header, entry.ids, entry.seqs = h, ids, seqs
        part_kind = _PART_KIND[kind]
        analysis = kind == "analysis"
        evict_first = part_kind in _EVICT_FIRST
        shares = _shares(h, nbytes, len(ids))
        get, order, now, limit = self.by_key.get, entry.order, self.ctx.now, self.ctx.config.late_join_bytes
        live: list[tuple[int, _Stream]] = []
        added = 0
        ask = False
        # The per-request loop is the router's cost per request of a step: kept to attribute updates and one
        # append (measured: scripts/bench_routing.py)
        for i, rid in enumerate(ids):
            s = get((rid, pid, epoch))
            if s is None or s.ended or s.analysis is not analysis or (s.producer is not ident and s.producer != ident):
                s = self._columnar_stream(p, (rid, pid, epoch), s, analysis)
                if s is None:
                    continue
                ask |= not s.started
            seq, share = seqs[i], shares[i]
            s.messages += 1
            s.bytes += share
            s.last_time = now
            if seq >= s.next_seq:
                s.next_seq = seq + 1
            part = (order, seq, part_kind, entry, i, share)
            if evict_first:
                s.data.append(part)
                self.evictable.append((s, part))
            else:
                s.ctl.append(part)
            added = self._charge(s, share, added, limit)
            if s.started:
                live.append((i, s))
        self.buffered_total += added
        if self.buffered_total > self.ctx.config.late_join_total_bytes:
            self._evict_to_total()
        if ask:  # parts of new streams whose start it has not seen: ask it to re-announce (held meanwhile)
            self.peers.heartbeat_to(PRODUCERS, p.identity, known=False)
        if not live:
            return
        self.delivery.fan_out(entry, live)

    def _columnar_stream(self, p: _Producer, key: tuple, s: _Stream | None, analysis: bool) -> _Stream | None:
        """The stream a columnar message's part goes to when it is not simply a live one: a new stream (held
        until its start comes; an analysis stream starts at once), or None for one that ended (or is of the
        other family: an analysis part for a request stream, or the reverse)."""
        if s is None:
            if key in self.closed:
                self.ctx.counters.after_end += 1
                return None
            return self._new_stream(key, p, analysis)
        if s.producer != p.identity:
            self.refuse_not_owner(p, s)
        elif s.ended:
            self.ctx.counters.after_end += 1
        else:
            self.ctx.counters.unexpected_kind += 1
        return None

    def on_producer_gap(self, p: _Producer, h: dict, body: list, nbytes: int) -> None:
        key = (h["request_id"], h["producer_id"], h["epoch"])
        # decode_header checked every range ([first, last] ints, 0 <= first <= last); checking each again here was
        # ~10% of the broker's samples at saturation, a producer gap per request per dropped step (py-spy)
        p.gaps_reported += seqranges.count(h.get("missing", ()))
        s = self.by_key.get(key)
        if s is None or s.ended:
            self.ctx.counters.gap_for_unknown_stream += 1
            return
        if s.producer != p.identity:
            self.refuse_not_owner(p, s)
            return
        entry = _Entry("gap", self._next_order(), body, nbytes, None)
        entry.key, entry.header = key, h
        part = (entry.order, -1, "gap", entry, -1, nbytes)
        s.last_time = self.ctx.now
        if s.gaps >= self.ctx.config.max_gaps_per_stream:  # delivered live, kept merged (item 9 of issue 24)
            self._merge_gap(s, h.get("missing", ()), h.get("reason", ""))
        else:
            s.gaps += 1
            self._buffer(s, part)
        if s.started:
            self._deliver(s, part)

    def on_producer_gap_batch(self, p: _Producer, h: dict, body: list, nbytes: int) -> None:
        """A producer's GapBatch (a dropped step batch: one for all the requests it named) is each request's
        GapNotice: kept once, each live stream's late-join buffer references its part (an index, as for a
        columnar message), and each subscribed consumer gets it whole or as a selection of its requests (a
        consumer of schema 2.0: a GapNotice per request)."""
        ids = h["request_ids"]
        if len(ids) > self.ctx.config.max_requests_per_message and self.refuse_too_many_requests(p, "gap_batch",
                                                                                                  len(ids)):
            return
        pid, epoch = h["producer_id"], h["epoch"]
        firsts, lasts = np.frombuffer(h["firsts"], _I64), np.frombuffer(h["lasts"], _I64)
        p.gaps_reported += int((lasts - firsts).sum()) + len(lasts)  # decode_header checked the ranges
        entry = _Entry("gap_batch", self._next_order(), body, nbytes, None)
        entry.header, entry.ids = h, ids
        share = nbytes // len(ids) if ids else 0
        get, order, now, limit = self.by_key.get, entry.order, self.ctx.now, self.ctx.config.late_join_bytes
        live: list[tuple[int, _Stream]] = []
        unknown = added = 0
        max_gaps, ranges = self.ctx.config.max_gaps_per_stream, None
        for i, rid in enumerate(ids):
            s = get((rid, pid, epoch))
            if s is None or s.ended:  # as a GapNotice of a stream it does not know
                unknown += 1
                continue
            if s.producer != p.identity:
                self.refuse_not_owner(p, s)
                continue
            s.last_time = now
            if s.gaps >= max_gaps:  # delivered live, kept merged
                if ranges is None:
                    ranges = _gap_batch_ranges(h)
                self._merge_gap(s, ranges[i], h.get("reason", ""))
            else:
                s.gaps += 1
                s.ctl.append((order, -1, "gap", entry, i, share))  # gaps are never evicted
                added = self._charge(s, share, added, limit)
            if s.started:
                live.append((i, s))
        self.buffered_total += added
        if self.buffered_total > self.ctx.config.late_join_total_bytes:
            self._evict_to_total()
        k = self.ctx.counters
        if unknown:
            k.gap_for_unknown_stream += unknown
        k.producer_gap_batches += 1
        self.delivery.fan_out(entry, live)

    def end_for_lost_producer(self, p: _Producer) -> None:
        """A producer is lost: each of its open streams ends (``producer_lost``), or is forgotten if it never
        started."""
        cfg = self.ctx.config
        for key in list(p.streams):
            s = self.by_key.get(key)
            if s is None or s.ended:
                continue
            if not s.started:  # frames whose start never came: nobody could interpret them
                self.drop_orphan(key)
                continue
            rid, pid, epoch = key
            end = StreamEnd(rid, pid, epoch, s.next_seq, finish_reason="producer_lost",
                            error=f"the broker heard nothing from producer {p.name!r} for "
                                  f"{cfg.producer_timeout_s:g} s", time_ns=self.ctx.wall_ns())
            frames = encode(end)
            n = _frames_nbytes(frames)
            entry = _Entry("end", self._next_order(), frames, n, None)
            entry.key, entry.seq = key, s.next_seq
            part = (entry.order, s.next_seq, "end", entry, -1, n)
            s.next_seq += 1
            self._buffer(s, part)
            self._deliver(s, part)
            self._end_stream(s)
        p.streams.clear()

    # ------------------------------------------------------------------------------------------ gap floods

    def _merge_gap(self, s: _Stream, missing, reason: str) -> None:
        """A producer gap past ``max_gaps_per_stream`` buffered gaps (it was delivered live): its ranges join the
        stream's merged gaps, which a late joiner gets as one GapNotice after the start. At most 64 x that many
        ranges are kept; past them, their hull (only a flood of disjoint gaps gets there)."""
        self.ctx.counters.producer_gaps_merged += 1
        merged = seqranges.union(s.merged_gaps, missing)
        if len(merged) > 64 * self.ctx.config.max_gaps_per_stream:
            merged = [[merged[0][0], merged[-1][1]]]
        s.merged_gaps = merged
        s.merged_reason = s.merged_reason or reason

    # ------------------------------------------------------------------------------------------ late-join buffers

    def _buffer(self, s: _Stream, part: tuple) -> None:
        if part[2] in _EVICT_FIRST:
            s.data.append(part)
            self.evictable.append((s, part))
        else:
            s.ctl.append(part)
        share = part[5]
        s.buffered += share
        self.buffered_total += share
        cfg = self.ctx.config
        if s.buffered > cfg.late_join_bytes:
            while s.buffered > cfg.late_join_bytes and self.evict_one(s):
                pass
        if self.buffered_total > cfg.late_join_total_bytes:
            self._evict_to_total()

    def _charge(self, s: _Stream, share: int, added: int, limit: int) -> int:
        """Count a buffered share against its stream, evicting the stream's oldest parts past ``limit``; returns
        ``added`` (bytes not yet in ``buffered_total``) plus the share, or 0 once the total was updated."""
        s.buffered += share
        added += share
        if s.buffered > limit:
            self.buffered_total += added
            added = 0
            while s.buffered > limit and self.evict_one(s):
                pass
        return added

    def _evict_to_total(self) -> None:
        """Evict the oldest buffered tensor (and analysis) parts of all streams until the buffers together are
        within their total; only then token parts, oldest streams first."""
        total, fifo, streams = self.ctx.config.late_join_total_bytes, self.evictable, self.by_key
        while self.buffered_total > total and fifo:
            s, part = fifo.popleft()
            if s.data and s.data[0] is part and streams.get(s.key) is s:  # else evicted or dropped already
                self.evict_one(s)
                self.unreferenced_bytes -= part[5]  # (it left ``evictable`` just now)
        if self.buffered_total > total:
            for other in streams.values():
                while self.buffered_total > total and self.evict_one(other):
                    pass
                if self.buffered_total <= total:
                    break

    def prune_evictable(self) -> None:
        """Housekeeping: forget the eviction queue's entries of parts evicted or dropped otherwise (they are
        skipped when they reach its front, but a long-lived stream's part there would keep them all)."""
        streams = self.by_key
        if (self.unreferenced_bytes <= self.ctx.config.late_join_total_bytes // 8
                and len(self.evictable) <= max(4096, 2 * sum(len(s.data) for s in streams.values()))):
            return
        self.unreferenced_bytes = 0
        live = {id(pt) for s in streams.values() for pt in s.data}
        self.evictable = collections.deque((s, pt) for s, pt in self.evictable
                                           if id(pt) in live and streams.get(s.key) is s)

    def evict_one(self, s: _Stream) -> bool:
        """Evict the oldest tensor (or analysis) part, then the oldest token part; starts, ends and gaps stay."""
        if s.data:
            part = s.data.popleft()
            self.unreferenced_bytes += part[5]  # (``evictable`` may still hold it: see prune_evictable)
        else:
            i = next((i for i, pt in enumerate(s.ctl) if pt[2] == "tokens"), None)
            if i is None:
                return False
            part = s.ctl[i]
            del s.ctl[i]
        s.buffered -= part[5]
        self.buffered_total -= part[5]
        self.ctx.counters.evicted += 1
        seqranges.add_seq(s.evicted, part[1])
        return True
