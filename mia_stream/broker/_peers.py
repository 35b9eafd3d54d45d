"""Peers: the producer registry, producers' proofs of ring ownership (and what waits for them), handed-over
rings, heartbeats, and the checks and error replies of what peers send.

Rule: ``Peers`` owns the producer registry (``producers``: identity -> ``_Producer``), ring ownership
(``ring_owners``, ``closing_rings``, the rings' upkeep timers) and the error-reply budget (``errors``). A
producer is added by ``producer()`` and removed by ``forget_producer()``; ring ownership and a producer's held
messages, proofs and refused rings change only here. ``_streams`` keeps each producer's open streams
(``_Producer.streams``) and the seqs it reported lost (``gaps_reported``); the router's dispatch its messages,
bytes, batches and ``last_seen``; ``_upkeep`` its rates. The only module of the router that reads rings'
shared-memory keys and removes rings (``bus.shm_ring``).
"""

from __future__ import annotations

import collections
import math
import weakref
from typing import TYPE_CHECKING, Any, Callable

from mia_stream.broker._config import CONSUMERS, PRODUCERS
from mia_stream.broker._shared import Context
from mia_stream.errors import MalformedFrameError, OversizedMessageError, SchemaVersionError, WireError
from mia_stream.schemas import ErrorNotice, Heartbeat, decode, decode_header, encode
from mia_stream.bus.session import SHM_RING_CLOSED_KEY, SHM_RING_PROOF_KEY, Capabilities
from mia_stream.bus.shm_ring import ShmRingReader, remove_ring, sweep_stale_rings

if TYPE_CHECKING:
    from mia_stream.broker._delivery import Delivery

# A ring reference from a producer that has not proven it owns the ring waits (with every later message of that
# producer, in order) for the producer's next heartbeat, at most this long: a publisher proves it in each
# heartbeat (every 0.5 s), and after a broker restart its first frames can come before its first heartbeat
_PROOF_WAIT_S = 2.0
_PROOF_HOLD_BYTES = 64 << 20  # ... and at most this much of that producer's traffic is held meanwhile
_ERRORS_PER_PEER_PER_S = 20  # error replies per peer (either side, known or not): garbage cannot amplify
_RING_SWEEP_S = 30.0
_STATS_DEPTH = 8  # a peer's stats nested deeper are cut there (the JSON stats reply must never recurse far)


def json_safe(value: Any, replaced: list[int], depth: int = 0) -> Any:
    """A peer's free-form ``stats`` as JSON can carry them: bytes, NaN/inf, non-str keys, other msgpack types and
    maps or arrays nested past ``_STATS_DEPTH`` are replaced by short strs (``replaced[0]`` counts them). Linear in
    the value's size, which the caller bounded (``max_stats_bytes``)."""
    t = type(value)
    if t is str or t is int or t is bool or value is None:
        return value
    if t is float:
        if math.isfinite(value):
            return value
        replaced[0] += 1
        return repr(value)
    if t is dict or t is list:
        if depth >= _STATS_DEPTH:
            replaced[0] += 1
            return "<nested too deep>"
        if t is list:
            return [json_safe(v, replaced, depth + 1) for v in value]
        out = {}
        for k, v in value.items():
            if type(k) is not str:
                replaced[0] += 1
                k = k.hex() if type(k) is bytes else repr(k)
            out[k] = json_safe(v, replaced, depth + 1)
        return out
    replaced[0] += 1
    if t is bytes:
        return f"<{len(value)} bytes>"
    return f"<{t.__name__}>"


class _Producer:
    __slots__ = ("identity", "name", "last_seen", "streams", "messages", "bytes", "reported", "gaps_reported",
                 "rate", "snap", "batches", "proofs", "disowned", "held", "held_bytes", "held_until", "releasing",
                 "analysis_streams", "user", "created")

    def __init__(self, identity: bytes, now: float):
        self.identity = identity
        self.name = identity.decode("utf-8", "replace")
        self.last_seen = now
        self.streams: set[tuple] = set()  # its open (start/end) streams
        self.analysis_streams = 0  # the analysis streams it started that the broker keeps
        self.user = ""  # its CURVE key (z85), where the broker has roles
        self.created = now
        self.messages = self.bytes = self.gaps_reported = self.batches = 0
        self.reported: dict = {}
        self.rate = (0.0, 0.0)
        self.snap = (now, 0, 0)
        self.proofs: dict[str, str] = {}  # ring -> the secret it proved that ring with
        self.disowned: set[str] = set()  # rings it referenced without the proof: their references are refused
        self.held: collections.deque | None = None  # its messages waiting for a ring proof, in order
        self.held_bytes = 0
        self.held_until = 0.0
        self.releasing = False


class Peers:
    """``shm``: the reader of producers' rings (None without rings); ``delivery``: errors to a known consumer go
    in its queue, in order with what it is sent; ``route(producer, frames, nbytes)``: the router's handling
    of one producer message, for what waited for a proof."""

    def __init__(self, ctx: Context, shm: ShmRingReader | None, delivery: Delivery,
                 route: Callable[[_Producer, list, int], None]):
        self.ctx = ctx
        self.shm = shm
        self.delivery = delivery
        self._route = weakref.WeakMethod(route)  # (the router holds this: no reference cycle to keep it alive)
        self.producers: dict[bytes, _Producer] = {}
        self.ring_owners: dict[str, bytes] = {}  # ring -> the producer that proved it owns it
        self.closing_rings: dict[str, float] = {}  # rings handed over by their closed producers -> removal time
        self.errors: dict[tuple[str, bytes], int] = {}  # error replies per peer in the current second
        self.errors_since = ctx.now
        self.last_ring_sweep = self.last_ring_prune = -1e18

    # ------------------------------------------------------------------------------------------ registry

    def producer(self, identity: bytes) -> _Producer:
        p = self.producers.get(identity)
        if p is None:
            p = self.producers[identity] = _Producer(identity, self.ctx.now)
            self.heartbeat_to(PRODUCERS, identity, known=True)  # lets a restarted peer re-announce now
        return p

    def forget_producer(self, p: _Producer) -> None:
        """A producer is lost: what it held is routed (its unproven ring references refused) and it is
        forgotten, with the rings it owned but did not hand over."""
        if p.held is not None:
            self.release_held(p)
        self.producers.pop(p.identity, None)
        for name in [n for n, owner in self.ring_owners.items() if owner == p.identity]:
            if name not in self.closing_rings:
                del self.ring_owners[name]

    def rings_of(self, p: _Producer) -> list[str]:
        return sorted(n for n, o in self.ring_owners.items() if o == p.identity)

    # ------------------------------------------------------------------------------------------ heartbeats

    def heartbeat(self, known: bool, ring_taken: str | None = None) -> list:
        ctx = self.ctx
        caps = Capabilities.of_broker(known, ctx.config.batch, ctx.accept_shm, ring_taken=ring_taken)
        return encode(Heartbeat("broker", "broker", ctx.instance, ctx.wall_ns(), caps.to_stats()))

    def heartbeat_to(self, role: str, identity: bytes, known: bool) -> None:
        self.ctx.outbox.append((role, identity, self.heartbeat(known), None))

    def on_producer_heartbeat(self, p: _Producer, header: dict, nbytes: int = 0) -> None:
        stats = header.get("stats")
        if isinstance(stats, dict):
            proof = stats.get(SHM_RING_PROOF_KEY)
            if proof is not None:
                self._check_proof(p, proof)
                stats = {k: v for k, v in stats.items() if k != SHM_RING_PROOF_KEY}  # never shown in stats
            self._keep_reported(p, stats, nbytes)
        if p.held is not None:
            self.release_held(p)
        if isinstance(stats, dict) and SHM_RING_CLOSED_KEY in stats:
            name = stats[SHM_RING_CLOSED_KEY]
            if self._take_ring(p, name):
                self.ctx.outbox.append((PRODUCERS, p.identity, self.heartbeat(True, ring_taken=name),
                                        None))
                return
        self.heartbeat_to(PRODUCERS, p.identity, known=True)

    def _keep_reported(self, p: _Producer, stats: dict, nbytes: int) -> None:
        """What a producer's heartbeat reports, kept for the stats: at most ``max_stats_bytes`` of it (the
        heartbeat's bytes), made JSON-safe here, once, so that no stats reply can fail over it."""
        limit = self.ctx.config.max_stats_bytes
        if nbytes > limit:
            self.ctx.counters.refused_stats_too_large += 1
            p.reported = {"refused": f"stats of {nbytes} bytes exceed the broker's limit of {limit}"}
            self.error_to(PRODUCERS, p.identity, "stats_too_large",
                          f"heartbeat stats of {nbytes} bytes exceed the broker's limit of {limit} bytes "
                          "(--max-stats-bytes): they are not kept")
            return
        replaced = [0]
        p.reported = json_safe(stats, replaced)
        if replaced[0]:
            self.ctx.counters.stats_values_replaced += replaced[0]

    # ------------------------------------------------------------------------------------------ ring ownership

    def admit_ring(self, p: _Producer, extent: tuple, body: list, nbytes: int) -> tuple | None:
        """``(ring, oldest position, end)`` of a message's ring reference (``extent``: its ``shm_extent``) when this
        producer proved it owns that ring; else None: the message is refused, or held for the proof."""
        if not self.ctx.accept_shm:  # a peer on another host cannot have a ring here: a forged reference
            self.report_bad(PRODUCERS, p.identity, MalformedFrameError(
                "shared-memory tensor references are accepted only from producers on the broker's host "
                "(an ipc producers endpoint)"))
            return None
        name = extent[0]
        if self.ring_owners.get(name) != p.identity:
            if name in p.disowned or p.releasing:
                p.disowned.add(name)
                self._refuse_ring(p, name)
            else:
                self._hold(p, body, nbytes)
            return None
        self.ctx.counters.shm_bytes_in += extent[2]
        self.shm.note_received(name, extent[3])
        return name, extent[1], extent[3]

    def hold_more(self, p: _Producer, body: list, nbytes: int) -> None:
        """A message of a producer whose earlier ring reference waits for its proof: it waits too, in order."""
        p.held.append((body, nbytes))
        p.held_bytes += nbytes
        if p.held_bytes > _PROOF_HOLD_BYTES:
            self.release_held(p)

    def _check_proof(self, p: _Producer, proof: Any) -> None:
        """A heartbeat's ``shm_ring_proof``: the secret whose digest is in the ring's header (spec section 9)."""
        name = proof.get("ring") if isinstance(proof, dict) else None
        secret = proof.get("secret") if isinstance(proof, dict) else None
        if type(name) is str and p.proofs.get(name) == secret and self.ring_owners.get(name) == p.identity:
            return  # proven before
        if self.shm is not None and type(name) is str and self.shm.verify_owner(name, secret):
            self.ring_owners[name] = p.identity
            p.proofs[name] = secret
            p.disowned.discard(name)
            self.ctx.counters.shm_rings_proven += 1
            return
        self.ctx.counters.shm_ring_proof_refused += 1
        self.error_to(PRODUCERS, p.identity, "shm_ring_not_owned",
                      f"the ownership proof of shared-memory ring {name!r} does not match the ring's header")

    def _hold(self, p: _Producer, body: list, nbytes: int) -> None:
        """A reference to a ring this producer has not proven it owns: it and the producer's later messages wait
        for its next heartbeat (its proof), at most ``_PROOF_WAIT_S``."""
        p.held = collections.deque([(body, nbytes)])
        p.held_bytes = nbytes
        p.held_until = self.ctx.now + _PROOF_WAIT_S
        self.ctx.counters.held_for_ring_proof += 1

    def release_held(self, p: _Producer) -> None:
        """Route what waited for a proof, in order; a reference to a ring still not proven is refused."""
        held, p.held, p.held_bytes = p.held, None, 0
        p.releasing = True
        route = self._route()
        try:
            for body, nbytes in held:
                self.ctx.safely(route, p, body, nbytes)
        finally:
            p.releasing = False

    def _refuse_ring(self, p: _Producer, name: str) -> None:
        self.ctx.counters.shm_ring_not_owned += 1
        self.error_to(PRODUCERS, p.identity, "shm_ring_not_owned",
                      f"shared-memory ring {name!r} was not proven to belong to this producer (its heartbeats must "
                      "carry the ring's ownership proof, spec section 9): the message is refused")

    def _take_ring(self, p: _Producer, name: Any) -> bool:
        """A closing producer offers its ring: taken, it is removed after the grace, so that consumers that are
        still behind can open it for the last frames after the producer exits. Whether it was taken."""
        if type(name) is not str or self.ring_owners.get(name) != p.identity:  # only the ring it proved it owns
            self.ctx.counters.shm_ring_handover_refused += 1
            return False
        self.closing_rings[name] = self.ctx.now + self.ctx.config.ring_grace_s
        self.ctx.counters.shm_rings_handed_over += 1
        return True

    def ring_upkeep(self, now: float) -> None:
        """Housekeeping of rings: stale mappings pruned, handed-over rings removed after their grace, rings of
        producers that died without closing swept."""
        if self.shm is None:
            return
        if now - self.last_ring_prune >= 1.0:
            self.last_ring_prune = now
            self.shm.prune()  # mappings of rings whose producer is gone would keep their memory alive
        if self.closing_rings:
            self.remove_closing_rings(now)
        if now - self.last_ring_sweep >= _RING_SWEEP_S:  # rings of producers that died without closing
            self.last_ring_sweep = now
            self.ctx.counters.shm_rings_swept += sweep_stale_rings(self.shm.directory)

    def remove_closing_rings(self, now: float | None) -> None:
        """Remove the handed-over rings whose grace has passed (all of them when ``now`` is None)."""
        for name, due in list(self.closing_rings.items()):
            if now is None or now >= due:
                del self.closing_rings[name]
                self.ring_owners.pop(name, None)
                if self.shm is not None and remove_ring(name, self.shm.directory):
                    self.ctx.counters.shm_rings_removed += 1

    # ------------------------------------------------------------------------------------------ checks, errors

    def header_or_report(self, body: list, role: str, identity: bytes) -> dict | None:
        try:
            return decode_header(body, max_message_bytes=self.ctx.config.max_message_bytes)
        except WireError as e:
            self.report_bad(role, identity, e)
        return None

    def decode_small(self, body: list, identity: bytes):
        """A consumer's message decoded whole (they are small), or None (reported)."""
        try:
            return decode(body, max_message_bytes=16 << 20)
        except WireError as e:
            k = self.ctx.counters
            k.malformed += 1
            k.malformed_from_consumers += 1
            self.error_to(CONSUMERS, identity, "malformed", str(e))
            return None

    def report_bad(self, role: str, identity: bytes, e: WireError) -> None:
        k, producer = self.ctx.counters, role == PRODUCERS
        if isinstance(e, OversizedMessageError):
            code = "oversized"
            k.oversized += 1
            if producer:
                k.oversized_from_producers += 1
            else:
                k.oversized_from_consumers += 1
        elif isinstance(e, SchemaVersionError):
            code = "schema_version"
            k.schema_version += 1
            if producer:
                k.schema_version_from_producers += 1
            else:
                k.schema_version_from_consumers += 1
        else:
            code = "malformed"
            k.malformed += 1
            if producer:
                k.malformed_from_producers += 1
            else:
                k.malformed_from_consumers += 1
        self.error_to(role, identity, code, str(e))

    def error_to(self, role: str, identity: bytes, code: str, message: str, request_id: str | None = None) -> None:
        """An ErrorNotice to a peer, at most ``_ERRORS_PER_PEER_PER_S`` per second per peer (docs/bus.md)."""
        key = (role, identity)
        n = self.errors.get(key, 0)
        k = self.ctx.counters
        if n >= _ERRORS_PER_PEER_PER_S:
            k.error_notices_suppressed += 1
            return
        self.errors[key] = n + 1
        k.error_notices += 1
        if len(message) > 1000:  # (a refused header's values can be large: the notice names, it does not echo)
            message = message[:1000] + "..."
        frames = encode(ErrorNotice(code, message, request_id, self.ctx.wall_ns()))
        c = self.delivery.consumers.get(identity) if role == CONSUMERS else None
        if c is not None:
            self.delivery.enqueue_control(c, frames)  # in order with what it is sent
        else:
            self.ctx.outbox.append((role, identity, frames, None))

    def new_error_second(self, now: float) -> None:
        """Housekeeping: a new second of error replies."""
        if now - self.errors_since >= 1.0:
            self.errors_since = now
            self.errors.clear()
