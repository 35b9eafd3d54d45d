"""Steering: a consumer's SteeringCommand to the producers that apply it for its request, their acks merged
back into one SteeringAck for the consumer.

Rule: ``Steering`` owns the pending commands (``pending``: command id -> ``_PendingCommand``); only it adds,
completes or expires them. It reads the stream table (which producers own a request) and the producer
registry, and sends through the outbox and ``Delivery``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from mia_stream.broker._config import PRODUCERS
from mia_stream.broker._shared import Context
from mia_stream.errors import WireError
from mia_stream.schemas import SteeringAck, SteeringCommand, decode, encode

if TYPE_CHECKING:
    from mia_stream.broker._delivery import Delivery, _Consumer
    from mia_stream.broker._peers import Peers, _Producer
    from mia_stream.broker._streams import Streams


class _PendingCommand:
    __slots__ = ("consumer", "request_id", "expected", "acks", "deadline")

    def __init__(self, consumer: bytes, request_id: str, expected: set, deadline: float):
        self.consumer, self.request_id, self.expected, self.deadline = consumer, request_id, expected, deadline
        self.acks: list[tuple[list, SteeringAck]] = []


def _user_id(frame: Any) -> str:
    """The ZAP User-Id of a CURVE peer (its z85 public key); "" on ipc without CURVE (and for plain bytes)."""
    try:
        return frame.get("User-Id") or ""
    except Exception:  # zmq.ZMQError, AttributeError (bytes), TypeError
        return ""


class Steering:
    """``steer_ids``: CURVE keys allowed to steer (None: no CURVE)."""

    def __init__(self, ctx: Context, streams: Streams, peers: Peers, delivery: Delivery,
                 steer_ids: set[str] | None):
        self.ctx = ctx
        self.streams = streams
        self.peers = peers
        self.delivery = delivery
        self.steer_ids = steer_ids
        self.pending: dict[str, _PendingCommand] = {}
        # an engine's control id -> the one producer connection that takes its steering: the first connected
        # (its identity "CONTROL_ID/..."; with CURVE roles, a producer key's), kept while it stays connected.
        # A later connection naming itself after the same control id gets nothing (refused_control_claim).
        self.control_owner: dict[str, bytes] = {}
        self.producer_ids: set[str] | None = None  # with CURVE roles: the producer keys (set by the router)

    def _control_peers(self, controls: set[str]) -> set[bytes]:
        producers, out = self.peers.producers, set()
        for cid in controls:
            owner = self.control_owner.get(cid)
            if owner is None or owner not in producers:
                ids = self.producer_ids
                claims = [p for p in producers.values()
                          if p.name.split("/")[0] == cid and (ids is None or p.user in ids)]
                if not claims:
                    self.control_owner.pop(cid, None)
                    continue
                claims.sort(key=lambda p: p.created)
                owner = self.control_owner[cid] = claims[0].identity
                for other in claims[1:]:
                    self.ctx.counters.refused_control_claim += 1
                    self.peers.error_to(PRODUCERS, other.identity, "not_authorised",
                                        f"control id {cid!r} belongs to an earlier connection: this one gets no "
                                        "steering commands")
            out.add(owner)
        return out

    def _refuse(self, c: _Consumer, command_id: str, request_id: str, error: str) -> None:
        self.ctx.counters.steering_refused += 1
        ack = SteeringAck(command_id, request_id, False, error=error, time_ns=self.ctx.wall_ns())
        self.delivery.enqueue_control(c, encode(ack))

    def on_command(self, c: _Consumer, cmd: SteeringCommand, body: list) -> None:
        ctx = self.ctx
        ctx.counters.steering_commands += 1
        user = _user_id(body[1])
        refuse = lambda error: self._refuse(c, cmd.command_id, cmd.request_id, error)  # noqa: E731
        if not ctx.config.steering:
            return refuse("steering_disabled: this broker was started with steering off")
        if self.steer_ids is not None and user not in self.steer_ids:
            return refuse(f"not_authorised: key {user!r} is not in the broker's steer/ key dir")
        if cmd.command_id in self.pending:
            return refuse(f"duplicate_command: command id {cmd.command_id!r} is still pending")
        live = [s for s in map(self.streams.by_key.get, self.streams.by_request.get(cmd.request_id, ()))
                if s is not None and s.started and not s.ended and not s.analysis]
        targets = {s.producer for s in live if not s.control_id}
        controls = {s.control_id for s in live if s.control_id}
        # A stream may name another producer (its engine's control peer) as the one that applies steering.
        if controls:
            targets |= self._control_peers(controls)
        if controls and not targets:
            return refuse("producer_unreachable: the engine that owns this request is not connected")
        if not targets:
            return refuse(f"unknown_request: no live stream of request {cmd.request_id!r}")
        cmd.sender = user or c.name
        frames = encode(cmd)
        self.pending[cmd.command_id] = _PendingCommand(c.identity, cmd.request_id, set(targets),
                                                       ctx.now + ctx.config.steer_timeout_s)
        for ident in sorted(targets):
            ctx.outbox.append((PRODUCERS, ident, frames, cmd.command_id))

    def on_ack(self, p: _Producer, body: list) -> None:
        try:
            ack = decode(body, max_message_bytes=16 << 20)
        except WireError as e:
            self.ctx.counters.malformed += 1
            return self.peers.error_to(PRODUCERS, p.identity, "malformed", str(e))
        pending = self.pending.get(ack.command_id)
        if pending is None or p.identity not in pending.expected:
            self.ctx.counters.unmatched_acks += 1
            return
        pending.expected.discard(p.identity)
        pending.acks.append((body, ack))
        if not pending.expected:
            self._finish(ack.command_id, pending)

    def producer_unreachable(self, identity: bytes, command_id: str | None) -> None:
        """A steering command (``command_id``) could not be sent to producer ``identity``."""
        pending = self.pending.get(command_id) if command_id else None
        if pending is None or identity not in pending.expected:
            return
        pending.expected.discard(identity)
        if pending.expected:
            return
        if pending.acks:
            self._finish(command_id, pending)
            return
        self.pending.pop(command_id, None)
        c = self.delivery.consumers.get(pending.consumer)
        if c is not None:
            self._refuse(c, command_id, pending.request_id,
                         "producer_unreachable: the producer of this request is not connected")

    def expire(self, now: float) -> None:
        """Housekeeping: commands not acknowledged by their deadline are answered (timeout)."""
        for cid in [k for k, pc in self.pending.items() if now > pc.deadline]:
            self._finish(cid, self.pending[cid], timed_out=True)

    def _finish(self, command_id: str, pending: _PendingCommand, timed_out: bool = False) -> None:
        self.pending.pop(command_id, None)
        c = self.delivery.consumers.get(pending.consumer)
        if c is None:
            return
        if len(pending.acks) == 1 and not timed_out:
            self.delivery.enqueue_control(c, pending.acks[0][0])
            return
        acks = [a for _, a in pending.acks]  # one per TP rank: ok only if every rank applied it
        errors = [f"rank {a.tp_rank}: {a.error}" for a in acks if not a.ok]
        if timed_out:
            errors.append(f"timeout: {len(pending.expected)} producer(s) did not acknowledge in time")
        steps = [a.applied_step for a in acks if a.applied_step is not None]
        merged = SteeringAck(command_id, pending.request_id, not errors,
                             applied_step=max(steps) if steps else None,
                             steering_version=max((a.steering_version for a in acks), default=0),
                             error="; ".join(errors) or None,
                             producer_id=",".join(sorted({a.producer_id for a in acks})), time_ns=self.ctx.wall_ns())
        self.delivery.enqueue_control(c, encode(merged))
