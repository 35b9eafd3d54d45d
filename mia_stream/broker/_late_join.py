"""Late join: what a consumer gets of the streams it subscribes to, and replaying a stream from its start out of
its late-join buffer (``Subscribe(from_start=True)``, or a start that came after the stream's first parts).

Rule: owns no state (``replay`` is a plain function: ``_streams`` calls it too). It changes only
subscriptions: each matching stream's ``subscribers`` and the subscribing consumer's patterns and options
(``Subscribe``/``Unsubscribe``, and its pending drops of requests it no longer wants). What it sends goes
through ``Delivery``; the buffers it replays are ``_streams``'.
"""

from __future__ import annotations

import heapq
from typing import TYPE_CHECKING

from mia_stream.broker._config import CONSUMERS
from mia_stream.broker._entry import _order_of
from mia_stream.broker._shared import Context
from mia_stream.errors import MalformedFrameError
from mia_stream.schemas import Subscribe, Unsubscribe, parse_selection

if TYPE_CHECKING:
    from mia_stream.broker._delivery import Delivery, _Consumer
    from mia_stream.broker._peers import Peers
    from mia_stream.broker._streams import Streams, _Stream


class LateJoin:
    def __init__(self, ctx: Context, streams: Streams, delivery: Delivery, peers: Peers):
        self.ctx = ctx
        self.streams = streams
        self.delivery = delivery
        self.peers = peers

    def subscribe(self, identity: bytes, msg: Subscribe, gap_batch: bool) -> None:
        ctx = self.ctx
        c = self.delivery.consumers.get(identity)
        patterns = sorted(set(c.patterns if c is not None else ()) | set(msg.patterns))
        limit = ctx.config.max_patterns
        if len(patterns) > limit:  # each new request id is matched against every pattern of every consumer
            ctx.counters.refused_too_many_patterns += 1
            self.peers.error_to(CONSUMERS, identity, "too_many_patterns",
                                f"a subscription of {len(patterns)} patterns is refused: the broker's limit is "
                                f"{limit} per consumer (--max-patterns)")
            return
        try:
            select = parse_selection(msg.select)
        except MalformedFrameError as e:
            ctx.counters.malformed_from_consumers += 1
            self.peers.error_to(CONSUMERS, identity, "bad_select", str(e))
            return
        c = self.delivery.consumer(identity)
        c.select = select
        if msg.consumer_id:
            c.name = msg.consumer_id
        c.gap_batch = gap_batch
        c.window = max(0, msg.window_bytes)
        c.batch = ctx.config.batch and msg.batch is True
        c.shm = ctx.accept_shm and msg.shm is True
        c.set_patterns(patterns)
        from_start = []
        for s in self.streams.by_key.values():
            if not s.started or identity in s.subscribers or not c.matches(s.request_id):
                continue
            if msg.from_start:
                s.subscribers.add(identity)
                from_start.append(s)
            elif not s.ended:
                s.subscribers.add(identity)
                if s.start is not None:  # (an analysis stream has none: it is delivered from its next message)
                    self.delivery.deliver_part(c, s.start)
                    if s.next_seq > 1:
                        self.delivery.enqueue_gap(c, s.key, [[1, s.next_seq - 1]], "joined_late")
        if from_start:
            replay(self.delivery, c, from_start)

    def unsubscribe(self, c: _Consumer, msg: Unsubscribe) -> None:
        drop = set(msg.patterns)
        c.set_patterns([p for p in c.patterns if p not in drop])
        for s in self.streams.by_key.values():
            if c.identity in s.subscribers and not c.matches(s.request_id):
                s.subscribers.discard(c.identity)
        # drops of requests it no longer wants are not announced (all pending drops go at its next message)
        c.drops = {key: ranges for key, ranges in c.drops.items() if c.matches(key[0])}


def replay(d: Delivery, c: _Consumer, streams: list[_Stream]) -> None:
    """Give ``c`` these streams from their start (through ``d``): each start, what was evicted (as a gap), then the
    buffered parts in arrival order. Parts of one columnar message go as one selection naming these streams'
    requests in it (for one stream: that request alone)."""
    for s in streams:
        if s.start is not None:
            d.deliver_part(c, s.start)
        if s.evicted:
            d.enqueue_gap(c, s.key, [list(r) for r in s.evicted], "evicted_from_late_join_buffer")
        if s.merged_gaps:  # the producer's gaps past the stream's limit of buffered ones (_streams._merge_gap)
            d.enqueue_gap(c, s.key, [list(r) for r in s.merged_gaps], s.merged_reason, "producer")
    queues = [q for s in streams for q in (s.data, s.ctl) if q]
    if not queues:
        return
    parts = queues[0] if len(queues) == 1 else heapq.merge(*queues, key=_order_of)
    entry, idx = None, []
    for part in parts:
        i = part[4]
        if i >= 0 and part[3] is entry:
            idx.append(i)
            continue
        if entry is not None:
            d.deliver_columnar(c, entry, sorted(idx), None)
            entry = None
        if i >= 0:
            entry, idx = part[3], [i]
        else:
            d.deliver_part(c, part)
    if entry is not None:
        d.deliver_columnar(c, entry, sorted(idx), None)
