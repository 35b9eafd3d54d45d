"""Upkeep (``Router.tick``, every 50 ms): heartbeats and producers' rates, timeouts of peers and of what waits
for a ring proof, lingering and orphan streams, quiet analysis streams, expired steering commands, rings.

Rule: ``Upkeep`` owns only its heartbeat timer (``last_heartbeat``) and each producer's ``rate``/``snap``.
Everything else it changes through the part that owns it (rings: ``Peers.ring_upkeep``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mia_stream.broker._config import CONSUMERS, PRODUCERS
from mia_stream.broker._shared import Context, log

if TYPE_CHECKING:
    from mia_stream.broker._delivery import Delivery
    from mia_stream.broker._peers import Peers, _Producer
    from mia_stream.broker._steering import Steering
    from mia_stream.broker._streams import Streams


class Upkeep:
    def __init__(self, ctx: Context, peers: Peers, streams: Streams, delivery: Delivery, steering: Steering):
        self.ctx = ctx
        self.peers = peers
        self.streams = streams
        self.delivery = delivery
        self.steering = steering
        self.last_heartbeat = -1e18

    def tick(self, now: float) -> None:
        ctx, cfg, peers, streams = self.ctx, self.ctx.config, self.peers, self.streams
        streams.prune_evictable()
        peers.ring_upkeep(now)
        peers.new_error_second(now)
        if now - self.last_heartbeat >= cfg.heartbeat_s:
            self.last_heartbeat = now
            for ident in peers.producers:
                peers.heartbeat_to(PRODUCERS, ident, known=True)
            hb = peers.heartbeat(known=True)
            for ident in self.delivery.consumers:
                ctx.outbox.append((CONSUMERS, ident, hb, None))
            for p in peers.producers.values():
                t0, m0, b0 = p.snap
                dt = max(now - t0, 1e-9)
                p.rate = ((p.messages - m0) / dt, (p.bytes - b0) / dt)
                p.snap = (now, p.messages, p.bytes)
        for p in [p for p in peers.producers.values() if p.held is not None and now >= p.held_until]:
            peers.release_held(p)  # no heartbeat came with a proof: its ring references are refused
        for p in [p for p in peers.producers.values() if now - p.last_seen > cfg.producer_timeout_s]:
            self._producer_lost(p, now)
        for c in [c for c in self.delivery.consumers.values() if now - c.last_seen > cfg.consumer_timeout_s]:
            self.delivery.forget(c, True, streams.by_key.values())
        by_key, linger = streams.by_key, cfg.late_join_linger_s
        for key in [k for k, s in by_key.items() if s.ended and now - s.end_time > linger]:
            streams.drop(key)
        for key in [k for k, s in by_key.items() if not s.started and now - s.created > cfg.producer_timeout_s]:
            streams.drop_orphan(key)  # frames whose start never came (not even re-announced): uninterpretable
        for key in [k for k, s in by_key.items()
                    if s.analysis and now - s.last_time > linger and not streams.request_streams_live(k[0])]:
            streams.drop(key)  # forgotten with its request
        self.steering.expire(now)

    def _producer_lost(self, p: _Producer, now: float) -> None:
        self.ctx.counters.producers_lost += 1
        (log.warning if p.streams else log.debug)(
            "producer %s lost: nothing heard for %.1f s; ending its %d open stream(s)", p.name,
            now - p.last_seen, len(p.streams))
        self.peers.forget_producer(p)
        self.streams.end_for_lost_producer(p)
