"""The broker's routing core, without I/O: what each message means for every peer, given the message and the time.

``Router`` holds every routing rule of the broker (docs/bus.md) and no socket. Its shell (``_broker.Broker``)
hands it what the sockets received (``producer_message``, ``consumer_message``) and the time (``tick``), and
sends what it asks for: the direct messages it appends to ``outbox`` (heartbeats, errors, steering commands),
and each consumer's queue within its credit window (``pending_send`` -> send -> ``sent``, or ``blocked`` when zmq
pushes back). Failed sends come back as ``consumer_unreachable`` / ``producer_unreachable``. The only call out
is ``flush``: when a consumer's queue is about to overflow, the shell may hand it to zmq before anything is
dropped. tests/test_routing.py drives it with injected time and no sockets.

Streams are keyed ``(request_id, producer_id, epoch)``. A columnar message (``step_batch``, ``token_batch``,
``analysis``: docs/wire-format.md section 10) names many requests, each holding one seq of its own stream: it is
kept once, each request's late-join buffer references it (counting that request's share of its bytes), and a
consumer gets it as received when it matches every request (no copy), else as a selection naming the requests
it matches (``select_requests``: a rewritten header, ring references untouched), compacted to just its rows'
bytes inline for a consumer that does not read rings or when the selection would send buffer frames of which
only some rows are wanted. Loss is per request: every seq a consumer loses is named to it, before that
request's next message. Where the gaps of several requests are announced at one point (the drops pending when the
next message is queued, stale ring messages, a columnar message whose ring bytes are gone) a consumer of schema
2.1 or later gets one GapBatch per producer and epoch; an older one a GapNotice per request. So do the GapNotices a
producer sends in a row (one per request for each step it dropped): those one input brings (a producer's batch,
a late join's replay) go to such a consumer as one GapBatch per producer, epoch, reason and origin, queued before
anything else is queued for it. A producer's own GapBatch (a publisher's dropped step batch, schema 2.1: the
broker's heartbeats say it takes them) is each request's GapNotice, kept once like a columnar message: buffered
by reference in each of its streams, sent whole or as a selection, as a GapNotice per request to an older consumer.

The rules are split by concern, one module each, each naming the state it owns at its top: ``_peers``
(producers, ring proofs, heartbeats, error replies), ``_streams`` (the stream table and late-join buffers),
``_late_join`` (subscriptions and replay), ``_delivery`` (consumers, their queues, drops and gap runs),
``_steering`` (pending commands), ``_upkeep`` (``tick``); ``_shared.Context`` is what they all share (the
time, the counters, the outbox). This module owns only the dispatch of each input to them, and the stats.

Rule: ``Router`` owns ``now`` (set on each input, into its ``Context``) and the producers' message and byte
totals (``messages_in``, ``bytes_in``), and no other state.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Callable

from mia_stream.broker._config import CONSUMERS, PRODUCERS, BrokerConfig  # (tests and scripts import them here)
from mia_stream.broker._delivery import Delivery
from mia_stream.broker._entry import _STREAM_KINDS
from mia_stream.broker._late_join import LateJoin
from mia_stream.broker._peers import Peers, _Producer
from mia_stream.broker._shared import Context, _frames_nbytes
from mia_stream.broker._steering import Steering, _user_id
from mia_stream.broker._streams import Streams
from mia_stream.broker._upkeep import Upkeep
from mia_stream.errors import MalformedFrameError
from mia_stream.spec.alerts import ACTION_ANALYZER
from mia_stream.schemas import COLUMNAR_KINDS, SteeringCommand, Subscribe, Unsubscribe, shm_extent, split_batch
from mia_stream.schemas import SHM_RING_KEY, Credit, seqranges

if TYPE_CHECKING:
    from mia_stream.bus.shm_ring import ShmRingReader
    from mia_stream.bus.transport import ServerKeys

ENGINE_ANALYZER_PREFIX = "engine:"  # in-engine detectors' analysis (producer/_detect_engine.py)
_GAP_BATCH_MINOR = 1  # a consumer whose subscribe is of schema 2.1 or later decodes gap_batch (spec 3.16)


class Router:
    """Every routing rule of the broker, driven by calls that carry the time; see the module docstring.

    ``instance``: this broker's random instance id (heartbeats); ``accept_shm``: producers may reference rings
    (an ipc producers endpoint); ``shm``: the reader of producers' rings (``None`` without rings); ``steer_ids``:
    CURVE keys allowed to steer (``None``: no CURVE); ``flush(identity) -> still there``: the shell hands a
    consumer's queue to zmq before the router drops for it; ``wall_ns``: the clock stamped into headers;
    ``roles``: CURVE keys with roles (docs/security.md): what each producer connection may send depends on its
    key's role (None: no roles, any connected producer may send any producer kind).
    """

    def __init__(self, config: BrokerConfig, *, instance: int, accept_shm: bool = False,
                 shm: ShmRingReader | None = None, steer_ids: set[str] | None = None,
                 flush: Callable[[bytes], bool] | None = None, wall_ns: Callable[[], int] = time.time_ns,
                 now: float = 0.0, roles: ServerKeys | None = None):
        self.config = config
        self.instance = instance
        self.accept_shm = accept_shm and shm is not None
        self._shm = shm
        self.started = now
        self.ctx = ctx = Context(config, instance, self.accept_shm, now, wall_ns)
        self.counters = ctx.counters
        # (PRODUCERS | CONSUMERS, identity, frames, steering command id or None): messages the shell sends
        # directly; the same list as ``ctx.outbox`` (a plain attribute: the shell looks at it after each message)
        self.outbox = ctx.outbox
        self.messages_in = self.bytes_in = 0  # producers' messages (folded into the totals by ``stats``)
        self.delivery = Delivery(ctx, shm, flush)
        self.ready = self.delivery.ready  # consumers with queued messages (the shell drains them)
        # The shell's calls per message sent go straight to Delivery (one Python frame less each):
        # pending_send(identity) -> (messages, bytes) or None, then sent(identity, count, bytes)
        self.pending_send = self.delivery.pending_send
        self.sent = self.delivery.sent
        self.peers = Peers(ctx, shm, self.delivery, self._handle_producer)
        self.streams = Streams(ctx, self.peers, self.delivery)
        self.late_join = LateJoin(ctx, self.streams, self.delivery, self.peers)
        self.steering = Steering(ctx, self.streams, self.peers, self.delivery, steer_ids)
        self.upkeep = Upkeep(ctx, self.peers, self.streams, self.delivery, self.steering)
        self.roles = roles
        if roles is not None:
            self._producer_ids, self._analyzer_ids = roles.ids("producers"), roles.ids("analyzers")
            self._key_names = {k.decode("ascii"): n for k, n in (roles.names or {}).items()}
            self.steering.producer_ids = self._producer_ids

    @property
    def now(self) -> float:
        return self.ctx.now

    # ------------------------------------------------------------------------------------------ inputs

    def producer_message(self, identity: bytes, body: list, now: float) -> None:
        """One zmq message from a producer: a single message, or a batch whose messages are each handled
        exactly as if they had come alone."""
        ctx = self.ctx
        ctx.now = now
        try:
            p = self.peers.producers.get(identity)
            if p is None:
                p = self.peers.producer(identity)
            p.last_seen = now
            if self.roles is not None:  # the connection's CURVE key (its identity is bound to the connection)
                p.user = _user_id(body[0])
            if self.config.batch:
                try:
                    messages = split_batch(body)
                except MalformedFrameError as e:  # its frames cannot be told apart: the whole batch is dropped
                    ctx.counters.malformed_batches += 1
                    self.peers.report_bad(PRODUCERS, identity, e)
                    return
                if messages is not None:
                    p.batches += 1
                    k = ctx.counters
                    k.batches_in += 1
                    k.batched_messages_in += len(messages)
                    for m in messages:
                        ctx.safely(self._producer_body, p, m)
                    return
            self._producer_body(p, body)
        except Exception:  # last line of defence: bad input must never stop the broker
            ctx.internal_error()
        finally:
            if self.delivery.gap_runs:
                ctx.safely(self.delivery.flush_gap_runs)

    def consumer_message(self, identity: bytes, body: list, now: float) -> None:
        """One zmq message from a consumer."""
        ctx = self.ctx
        ctx.now = now
        try:
            self._consumer_body(identity, body)
        except Exception:
            ctx.internal_error()
        finally:
            if self.delivery.gap_runs:
                ctx.safely(self.delivery.flush_gap_runs)

    def tick(self, now: float) -> None:
        """Housekeeping (the shell calls it every 50 ms): heartbeats, timeouts, lingering streams, rings."""
        ctx = self.ctx
        ctx.now = now
        try:
            self.upkeep.tick(now)
        except Exception:
            ctx.internal_error()
        finally:
            if self.delivery.gap_runs:
                ctx.safely(self.delivery.flush_gap_runs)

    # ------------------------------------------------------------------------------------------ consumer flow

    def blocked(self, identity: bytes) -> None:
        """zmq refused a send to ``identity`` (its pipe is full): try again soon."""
        self.delivery.blocked(identity)

    def any_blocked(self) -> bool:
        return self.delivery.any_blocked()

    def consumer_unreachable(self, identity: bytes) -> None:
        """A send to ``identity`` found its socket gone (EHOSTUNREACH): a dead or closed consumer."""
        c = self.delivery.consumers.get(identity)
        if c is not None:
            self.delivery.forget(c, False, self.streams.by_key.values())

    def producer_unreachable(self, identity: bytes, command_id: str | None) -> None:
        """A steering command (``command_id``) could not be sent to producer ``identity``."""
        self.steering.producer_unreachable(identity, command_id)

    def take_outbox(self) -> list[tuple[str, bytes, list, str | None]]:
        out = self.ctx.outbox
        self.ctx.outbox = self.outbox = []
        return out

    def close(self) -> None:
        """Remove the rings producers handed over (no consumer of this broker can still need them)."""
        self.peers.remove_closing_rings(None)
        if self._shm is not None:
            self._shm.close()

    @property
    def buffered_bytes(self) -> int:
        return self.streams.buffered_total

    # ------------------------------------------------------------------------------------------ dispatch

    def _producer_body(self, p: _Producer, body: list) -> None:
        nbytes = _frames_nbytes(body)
        p.messages += 1
        p.bytes += nbytes
        self.messages_in += 1
        self.bytes_in += nbytes
        if p.held is not None:  # waiting for this producer's proof of a ring: its order is kept
            header = self.peers.header_or_report(body, PRODUCERS, p.identity)
            if header is None:
                return
            if header["kind"] == "heartbeat":  # it may carry the proof: releases what is held
                self.peers.on_producer_heartbeat(p, header, nbytes)
                return
            self.peers.hold_more(p, body, nbytes)
            return
        self._handle_producer(p, body, nbytes)

    def _handle_producer(self, p: _Producer, body: list, nbytes: int) -> None:
        header = self.peers.header_or_report(body, PRODUCERS, p.identity)
        if header is None:
            return
        kind = header["kind"]
        if self.roles is not None and not self._role_allows(p, kind, header):
            return
        ring = None
        if SHM_RING_KEY in header:
            extent = shm_extent(header)
            if extent is not None:
                ring = self.peers.admit_ring(p, extent, body, nbytes)
                if ring is None:  # refused, or held for the producer's proof
                    return
                nbytes += extent[2]  # what the ring holds counts against budgets and windows like inline bytes
        if kind in COLUMNAR_KINDS:
            self.streams.on_columnar(p, header, body, nbytes, ring)
        elif kind in _STREAM_KINDS:
            self.streams.on_stream_message(p, header, body, nbytes, ring)
        elif kind == "gap":
            self.streams.on_producer_gap(p, header, body, nbytes)
        elif kind == "gap_batch":
            self.streams.on_producer_gap_batch(p, header, body, nbytes)
        elif kind == "heartbeat":
            self.peers.on_producer_heartbeat(p, header, nbytes)
        elif kind == "steer_ack":
            self.steering.on_ack(p, body)
        else:
            self.counters.unexpected_kind += 1
            self.peers.error_to(PRODUCERS, p.identity, "unexpected_kind", f"producers may not send {kind!r} messages")

    def _role_allows(self, p: _Producer, kind: str, header: dict) -> bool:
        """With CURVE roles: ``analysis`` only from an analyzer key, under a producer id that is the key's name
        or starts with "NAME/" (so consumers can tell which analyzer key published it), or from a producer key for
        its in-engine detectors (analyzer "engine:<name>", and their ``alert_action`` outcomes); stream kinds and steering
        acks only from a producer key; gaps from either. Else refused (``refused_role``, ErrorNotice
        ``not_authorised``)."""
        user = p.user
        if kind == "heartbeat":
            return True
        if kind == "analysis":
            name = self._key_names.get(user, "")
            pid = header["producer_id"]
            if user in self._analyzer_ids and (pid == name or pid.startswith(name + "/")):
                return True
            # an engine publishes its in-engine detectors' scores and what it did on their alerts (issue 25)
            if user in self._producer_ids and (str(header.get("analyzer", "")).startswith(ENGINE_ANALYZER_PREFIX)
                                               or header.get("analyzer") == ACTION_ANALYZER):
                return True
            why = (f"analysis messages need an analyzer key (roles/analyzers/) and a producer_id that is its name "
                   f"or starts with {name + '/'!r}" if user in self._analyzer_ids else
                   "analysis messages need an analyzer key (roles/analyzers/)")
        elif kind in ("gap", "gap_batch"):
            if user in self._producer_ids or user in self._analyzer_ids:
                return True
            why = "gaps need a producer or analyzer key"
        else:
            if user in self._producer_ids:
                return True
            why = f"{kind!r} messages need a producer key (roles/producers/)"
        self.counters.refused_role += 1
        self.peers.error_to(PRODUCERS, p.identity, "not_authorised", f"refused: {why}")
        return False

    def _consumer_body(self, identity: bytes, body: list) -> None:
        peers = self.peers
        c = self.delivery.consumers.get(identity)
        if c is not None:
            c.last_seen = self.ctx.now
        header = peers.header_or_report(body, CONSUMERS, identity)
        if header is None:
            return
        kind = header["kind"]
        if kind == "heartbeat":
            peers.heartbeat_to(CONSUMERS, identity, known=c is not None)
            return
        if kind == "credit":
            if c is not None:
                msg = peers.decode_small(body, identity)
                if isinstance(msg, Credit):
                    self.delivery.credit(c, msg.nbytes)
            return
        if kind not in ("subscribe", "unsubscribe", "steer"):
            self.counters.unexpected_kind += 1
            peers.error_to(CONSUMERS, identity, "unexpected_kind", f"consumers may not send {kind!r} messages")
            return
        msg = peers.decode_small(body, identity)
        if msg is None:
            return
        if isinstance(msg, Subscribe):
            self.late_join.subscribe(identity, msg, header["v"][1] >= _GAP_BATCH_MINOR)
        elif isinstance(msg, Unsubscribe):
            if c is not None:
                self.late_join.unsubscribe(c, msg)
        elif isinstance(msg, SteeringCommand):
            self.steering.on_command(self.delivery.consumer(identity), msg, body)

    # ------------------------------------------------------------------------------------------ stats

    def stats(self, now: float) -> dict:
        """Counters: ``totals``, ``producers``, ``consumers``, ``streams`` (the broker adds its own section)."""
        totals = self.counters.as_dict()
        if self.messages_in:
            totals["messages_in"] = totals.get("messages_in", 0) + self.messages_in
            totals["bytes_in"] = totals.get("bytes_in", 0) + self.bytes_in
        return {
            "totals": totals,
            "producers": {p.name: {"frames_per_s": p.rate[0], "bytes_per_s": p.rate[1], "messages": p.messages,
                                   "bytes": p.bytes, "open_streams": len(p.streams),
                                   "gaps_reported": p.gaps_reported, "batches": p.batches, "reported": p.reported,
                                   "rings": self.peers.rings_of(p), "last_seen_s": now - p.last_seen}
                          for p in self.peers.producers.values()},
            "consumers": {c.name: {"patterns": c.patterns, "queue_messages": len(c.queue),
                                   "queue_bytes": c.queue_bytes, "in_flight_bytes": c.in_flight,
                                   "window_bytes": c.window, "delivered": c.delivered,
                                   "delivered_bytes": c.delivered_bytes, "dropped": c.dropped,
                                   "gaps_notified": c.gaps_sent, "batch": c.batch, "batches": c.batches,
                                   "shm": c.shm,
                                   "pending_gaps": sum(seqranges.count(rs) for rs in c.drops.values()),
                                   "last_seen_s": now - c.last_seen}
                          for c in self.delivery.consumers.values()},
            "streams": {f"{s.key[0]}|{s.key[1]}|{s.key[2]}": {
                "request_id": s.key[0], "producer_id": s.key[1], "epoch": s.key[2], "messages": s.messages,
                "bytes": s.bytes, "next_seq": s.next_seq, "started": s.started, "ended": s.ended,
                "analysis": s.analysis, "buffered_bytes": s.buffered, "evicted": [list(r) for r in s.evicted],
                "subscribers": len(s.subscribers)} for s in self.streams.by_key.values()},
        }
