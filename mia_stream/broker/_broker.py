"""The broker: routes producers' streams to the consumers subscribed to them (protocol: docs/bus.md).

One thread, one ``zmq.Poller`` over three sockets (its zmq context has two I/O threads: one moves the
producers' bytes, the other the consumers'). Messages are forwarded zero-copy (the received
``zmq.Frame`` objects are re-sent to every subscriber); only the header frame is decoded
(``decode_header``). A producer's batch is unpacked and each of its messages handled as if it came alone;
consumers that said they take batches get their ready messages as batches. Every loss is counted and named
to the consumer that suffered it as a ``GapNotice``.
"""

from __future__ import annotations

import collections
import fnmatch
import heapq
import json
import logging
import os
import random
import threading
import time
from dataclasses import dataclass
from typing import Any, Iterable

import msgpack
import zmq

from mia_stream import _transport
from mia_stream._transport import BrokerEndpoints, ServerKeys
from mia_stream.errors import MalformedFrameError, OversizedMessageError, SchemaVersionError, WireError
from mia_stream.schemas import (DEFAULT_MAX_MESSAGE_BYTES, ErrorNotice, GapNotice, Heartbeat, ShmRingReader,
                                SteeringAck, SteeringCommand, StreamEnd, Subscribe, Unsubscribe, decode, encode,
                                inline_shm, shm_extent, shm_loss_reason, split_batch, sweep_stale_rings)
from mia_stream.schemas._codec import SHM_RING_KEY as _SHM_RING_KEY
from mia_stream.schemas._codec import batch_header, decode_header
from mia_stream.schemas._messages import Credit
from mia_stream.schemas._shm import SHM_RECEIVED_KEY, SHM_RING_CLOSED_KEY, SHM_RING_TAKEN_KEY, remove_ring

log = logging.getLogger("mia_stream.broker")

_RING_SWEEP_S = 30.0
# ring sizes: a queued frame further behind its ring's writer is dropped, not sent. Half a ring, not more:
# a consumer that cannot keep up is always sent the oldest frame still allowed, and it must stay readable
# while it waits in flight behind the others (at 3/4, on the H200 they were overwritten before being read)
_SHM_STALE_LAG = 0.5
DEFAULT_CONSUMER_QUEUE_BYTES = 256 << 20  # per consumer, beyond what its credit window has in flight
DEFAULT_LATE_JOIN_BYTES = 64 << 20  # per stream
DEFAULT_LATE_JOIN_TOTAL_BYTES = 1 << 30  # all streams together
DEFAULT_LATE_JOIN_LINGER_S = 10.0  # how long an ended stream stays joinable from its start
DEFAULT_PRODUCER_TIMEOUT_S = 30.0  # silent this long: its open streams end (an engine can stall for seconds, e.g. compiling)
DEFAULT_CONSUMER_TIMEOUT_S = 60.0  # no message from a consumer for this long: it is forgotten
DEFAULT_STEER_TIMEOUT_S = 30.0
DEFAULT_RING_GRACE_S = 10.0  # a ring its closed producer handed over stays this long for consumers still reading it
_STREAM_KINDS = frozenset(("start", "tensors", "tokens", "end"))
_ERRORS_PER_PEER_PER_S = 20  # error replies are rate-limited so garbage cannot amplify
_RECV_BATCH = 256  # stream messages handled per poll wake-up before consumers are flushed
_CLOSED_MEMORY = 100_000

_NOBLOCK, _SNDMORE = _transport.NOBLOCK, _transport.SNDMORE
_zsend, _zrecv = _transport.zsend, _transport.zrecv
_recv_parts, _send_parts = _transport.recv_parts, _transport.send_parts
_send_frame_lists = _transport.send_frame_lists


@dataclass
class BrokerConfig:
    """Tunables of a broker; every bound is in bytes or seconds."""

    endpoints: BrokerEndpoints
    keys: ServerKeys | None = None
    consumer_queue_bytes: int = DEFAULT_CONSUMER_QUEUE_BYTES
    late_join_bytes: int = DEFAULT_LATE_JOIN_BYTES
    late_join_total_bytes: int = DEFAULT_LATE_JOIN_TOTAL_BYTES
    late_join_linger_s: float = DEFAULT_LATE_JOIN_LINGER_S
    producer_timeout_s: float = DEFAULT_PRODUCER_TIMEOUT_S
    consumer_timeout_s: float = DEFAULT_CONSUMER_TIMEOUT_S
    steer_timeout_s: float = DEFAULT_STEER_TIMEOUT_S
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    heartbeat_s: float = _transport.HEARTBEAT_S
    steering: bool = True
    batch: bool = True  # accept and send batches (off: behaves as a 1.1 broker, for comparisons and fallback)
    shm: bool = True  # tell producers to put large tensors in shared memory (off: every byte through the broker)
    ring_grace_s: float = DEFAULT_RING_GRACE_S

    @property
    def token_reserve_bytes(self) -> int:
        return max(1 << 20, self.consumer_queue_bytes // 8)


class _Entry:
    """One stream message as received: its frames are shared by the late-join buffer and every queue."""

    __slots__ = ("kind", "order", "seq", "frames", "nbytes", "shm", "inline")

    def __init__(self, kind: str, order: int, seq: int, frames: list, nbytes: int, shm: tuple | None = None):
        self.kind, self.order, self.seq, self.frames, self.nbytes = kind, order, seq, frames, nbytes
        # (ring, oldest position, stream key, seq) when tensor bytes are in the producer's shared-memory ring
        # (nbytes counts them)
        self.shm = shm
        self.inline: tuple | None = None  # (frames, nbytes) with those bytes inline, made on first need

    def __lt__(self, other: "_Entry") -> bool:
        return self.order < other.order


class _Stream:
    __slots__ = ("key", "request_id", "producer", "start", "ended", "end_time", "next_seq", "data", "ctl",
                 "buffered", "evicted", "subscribers", "messages", "bytes", "created", "control_id")

    def __init__(self, key: tuple, producer: bytes):
        self.key, self.request_id, self.producer = key, key[0], producer
        self.control_id = ""  # StreamStart.control_id: the producer that takes this request's steering
        self.start: _Entry | None = None
        self.ended = False
        self.end_time = 0.0
        self.next_seq = 0
        self.data: collections.deque[_Entry] = collections.deque()  # tensor frames (evicted first)
        self.ctl: collections.deque[_Entry] = collections.deque()  # tokens, gaps, end
        self.buffered = 0
        self.evicted: list[list[int]] = []
        self.subscribers: set[bytes] = set()
        self.messages = self.bytes = 0
        self.created = time.monotonic()


class _Consumer:
    __slots__ = ("identity", "name", "patterns", "match_cache", "queue", "queue_bytes", "window", "in_flight",
                 "drops", "delivered", "delivered_bytes", "dropped", "gaps_sent", "last_seen", "blocked",
                 "errors_this_s", "batch", "batches", "shm")

    def __init__(self, identity: bytes):
        self.identity = identity
        self.name = identity.decode("utf-8", "replace")
        self.patterns: list[str] = []
        self.match_cache: dict[str, bool] = {}
        self.queue: collections.deque[tuple[list, int]] = collections.deque()
        self.queue_bytes = 0
        self.window = 0
        self.in_flight = 0
        self.drops: dict[tuple, list[list[int]]] = {}  # stream key -> seq ranges dropped, not yet notified
        self.delivered = self.delivered_bytes = self.dropped = self.gaps_sent = 0
        self.last_seen = time.monotonic()
        self.blocked = False
        self.errors_this_s = 0
        self.batch = False  # it said (Subscribe.batch) that it unpacks batches
        self.shm = False  # it said (Subscribe.shm) that it reads producers' shared-memory rings itself
        self.batches = 0

    def matches(self, request_id: str) -> bool:
        hit = self.match_cache.get(request_id)
        if hit is None:
            hit = any(fnmatch.fnmatchcase(request_id, p) for p in self.patterns)
            if len(self.match_cache) > 100_000:
                self.match_cache.clear()
            self.match_cache[request_id] = hit
        return hit


class _Producer:
    __slots__ = ("identity", "name", "last_seen", "streams", "messages", "bytes", "reported", "gaps_reported",
                 "rate", "_snap", "errors_this_s", "batches", "rings")

    def __init__(self, identity: bytes):
        self.identity = identity
        self.name = identity.decode("utf-8", "replace")
        self.last_seen = time.monotonic()
        self.streams: set[tuple] = set()
        self.messages = self.bytes = self.gaps_reported = self.batches = 0
        self.reported: dict = {}
        self.rate = (0.0, 0.0)
        self._snap = (time.monotonic(), 0, 0)
        self.errors_this_s = 0
        self.rings: set[str] = set()  # the shared-memory rings its messages referenced


class _PendingCommand:
    __slots__ = ("consumer", "request_id", "expected", "acks", "deadline")

    def __init__(self, consumer: bytes, request_id: str, expected: set, deadline: float):
        self.consumer, self.request_id, self.expected, self.deadline = consumer, request_id, expected, deadline
        self.acks: list[tuple[list, SteeringAck]] = []


def _add_seq(ranges: list[list[int]], seq: int) -> None:
    if ranges and ranges[-1][1] == seq - 1:
        ranges[-1][1] = seq
    else:
        ranges.append([seq, seq])


class Broker:
    """Routes stream messages from producers to subscribed consumers; see docs/bus.md.

    Lifecycle: ``Broker(config)`` binds the sockets; ``run()`` serves until ``stop()`` (thread-safe);
    ``close()`` releases the sockets. ``run_broker_in_thread`` wraps all three for tests.
    """

    def __init__(self, config: BrokerConfig, *, context: zmq.Context | None = None):
        self.config = config
        self.instance = random.getrandbits(63)
        # Two I/O threads: one serves the producers' socket, the other the consumers' (AFFINITY below), so a
        # large frame's copy in and its copy out run on two cores instead of one after the other (with one I/O
        # thread that thread was the bus's bottleneck from 1 MiB frames up: it did twice a raw peer's copying).
        self._ctx = context or zmq.Context(io_threads=2)
        split_io = self._ctx.get(zmq.IO_THREADS) >= 2
        self._own_ctx = context is None
        self._auth = None
        self._stop = threading.Event()
        self._started = time.monotonic()
        self._order = 0
        eps, keys = config.endpoints, config.keys
        if keys is not None:
            self._auth = _transport.start_authenticator(self._ctx, keys)
        self._steer_ids = {k.decode("ascii") for k in keys.steer_public_keys} if keys else set()
        big = config.max_message_bytes
        try:
            self._prod = self._ctx.socket(zmq.ROUTER)
            if split_io:
                self._prod.setsockopt(zmq.AFFINITY, 1)
            # A batch (up to 1 MiB) is one zmq message: 256 bound what waits in zmq here; beyond that the
            # producers' byte budgets hold the backlog (and count what they drop).
            _transport.configure(self._prod, sndhwm=1000, rcvhwm=256, max_message_bytes=big,
                                 router_mandatory=True)
            self._cons = self._ctx.socket(zmq.ROUTER)
            if split_io:
                self._cons.setsockopt(zmq.AFFINITY, 2)
            _transport.configure(self._cons, sndhwm=4096, rcvhwm=1000, max_message_bytes=16 << 20,
                                 router_mandatory=True)
            self._stats_sock = self._ctx.socket(zmq.REP)
            _transport.configure(self._stats_sock, max_message_bytes=1 << 16)
            _transport.bind(self._prod, eps.producers, keys)
            _transport.bind(self._cons, eps.consumers, keys)
            _transport.bind(self._stats_sock, eps.stats, keys)
        except Exception:
            self._close_sockets()
            raise
        self._poller = zmq.Poller()
        for s in (self._prod, self._cons, self._stats_sock):
            self._poller.register(s, zmq.POLLIN)
        self._streams: dict[tuple, _Stream] = {}
        self._closed: collections.OrderedDict[tuple, None] = collections.OrderedDict()
        self._consumers: dict[bytes, _Consumer] = {}
        self._producers: dict[bytes, _Producer] = {}
        self._pending: dict[str, _PendingCommand] = {}
        self._ready: set[bytes] = set()  # consumers with queued messages
        self._buffered_total = 0
        self.counters: collections.Counter[str] = collections.Counter()
        self._last_heartbeat = 0.0
        self._last_housekeeping = 0.0
        self._last_ring_sweep = self._last_ring_prune = 0.0
        self._now = time.monotonic()  # taken once per batch of received messages
        self._messages_in = self._bytes_in = 0  # folded into counters after each batch
        # producers' rings: inlined for consumers that cannot read them; lag checks; ``received`` noted in
        # each ring's header, which bounds how far its producer writes ahead of this broker
        self._shm = ShmRingReader(writable=True)
        self._closing_rings: dict[str, float] = {}  # rings handed over by their closed producers -> removal time
        self._accept_shm = config.shm and eps.producers.startswith("ipc://")

    # ------------------------------------------------------------------------------------------ lifecycle

    def stop(self) -> None:
        self._stop.set()

    def run(self) -> None:
        """Serve until ``stop()``; never raises on peer input (bad input is counted and reported)."""
        poll = self._poller.poll
        while not self._stop.is_set():
            now = time.monotonic()
            if now - self._last_housekeeping >= 0.05:
                self._housekeeping(now)
            timeout = 1 if any(self._consumers[c].blocked for c in self._ready if c in self._consumers) else 50
            try:
                events = dict(poll(timeout))
            except zmq.ZMQError as e:
                if e.errno == zmq.ETERM:
                    return
                raise
            if self._prod in events:
                self._drain(self._prod, self._on_producer_message)
            if self._cons in events:
                self._drain(self._cons, self._on_consumer_message)
            if self._stats_sock in events:
                self._on_stats_request()
            if self._ready:
                self._flush_all()

    def close(self) -> None:
        self._remove_closing_rings(None)  # no consumer of this broker can still need them
        self._close_sockets()
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
        if self._own_ctx:
            self._ctx.term()

    def _close_sockets(self) -> None:
        for name in ("_prod", "_cons", "_stats_sock"):
            sock = getattr(self, name, None)
            if sock is not None:
                sock.close(0)

    # ------------------------------------------------------------------------------------------ receive

    def _drain(self, sock: zmq.Socket, handler) -> None:
        self._now = time.monotonic()
        try:
            for _ in range(_RECV_BATCH):
                try:
                    frames = _recv_parts(sock)
                except zmq.Again:
                    return
                self._handle_safely(handler, frames)
                if self._messages_in >= _RECV_BATCH:  # a few producer batches: flush to consumers first
                    return
        finally:
            if self._messages_in:
                self.counters["messages_in"] += self._messages_in
                self.counters["bytes_in"] += self._bytes_in
                self._messages_in = self._bytes_in = 0

    def _handle_safely(self, handler, *args) -> None:
        try:
            handler(*args)
        except Exception:  # last line of defence: bad input must never stop the broker
            self.counters["internal_errors"] += 1
            log.exception("broker: error while handling a message (counted as internal_errors)")

    def _on_producer_message(self, frames: list) -> None:
        identity = frames[0].bytes
        body = frames[1:]
        p = self._producers.get(identity)
        if p is None:
            p = self._producers[identity] = _Producer(identity)
            self._heartbeat_to(self._prod, identity, known=True)  # lets a restarted peer re-announce now
        p.last_seen = self._now
        if self.config.batch:
            try:
                messages = split_batch(body)
            except MalformedFrameError as e:  # its frames cannot be told apart: the whole batch is dropped
                self.counters["malformed_batches"] += 1
                self._report_bad(p, self._prod, identity, "producer", e)
                return
            if messages is not None:
                p.batches += 1
                self.counters["batches_in"] += 1
                self.counters["batched_messages_in"] += len(messages)
                for m in messages:  # each exactly as if it had come alone
                    self._handle_safely(self._on_producer_body, p, m)
                return
        self._on_producer_body(p, body)

    def _on_producer_body(self, p: _Producer, body: list) -> None:
        identity = p.identity
        nbytes = 0
        for f in body:
            nbytes += len(f)
        p.messages += 1
        p.bytes += nbytes
        self._messages_in += 1
        self._bytes_in += nbytes
        header = self._header_or_report(body, p, self._prod, identity, "producer")
        if header is None:
            return
        kind = header["kind"]
        extent = shm_extent(header) if _SHM_RING_KEY in header else None
        if extent is not None:  # what the ring holds counts against budgets and windows like inline bytes
            if not self._accept_shm:  # a peer on another host cannot have a ring here: a forged reference
                self._report_bad(p, self._prod, identity, "producer", MalformedFrameError(
                    "shared-memory tensor references are accepted only from producers on the broker's host "
                    "(an ipc producers endpoint)"))
                return
            nbytes += extent[2]
            self.counters["shm_bytes_in"] += extent[2]
            p.rings.add(extent[0])
            self._shm.note_received(extent[0], extent[3])
        if kind in _STREAM_KINDS:
            self._on_stream_message(p, header, body, nbytes, extent)
        elif kind == "gap":
            self._on_producer_gap(p, header, body, nbytes)
        elif kind == "heartbeat":
            stats = header.get("stats")
            if isinstance(stats, dict):
                p.reported = stats
                if SHM_RING_CLOSED_KEY in stats and self._take_ring(p, stats[SHM_RING_CLOSED_KEY]):
                    self._send_direct(self._prod, identity,
                                      self._heartbeat(True, {SHM_RING_TAKEN_KEY: stats[SHM_RING_CLOSED_KEY]}))
                    return
            self._heartbeat_to(self._prod, identity, known=True)
        elif kind == "steer_ack":
            self._on_steering_ack(p, body)
        else:
            self.counters["unexpected_kind"] += 1
            self._error_to_producer(p, "unexpected_kind", f"producers may not send {kind!r} messages")

    def _take_ring(self, p: _Producer, name: Any) -> bool:
        """A closing producer offers its ring: taken, it is removed after the grace, so that consumers still
        behind can open it for the last frames after the producer exits. Whether it was taken."""
        if type(name) is not str or name not in p.rings:  # only a ring its own messages referenced
            self.counters["shm_ring_handover_refused"] += 1
            return False
        self._closing_rings[name] = self._now + self.config.ring_grace_s
        self.counters["shm_rings_handed_over"] += 1
        return True

    def _remove_closing_rings(self, now: float | None) -> None:
        """Remove the handed-over rings whose grace has passed (all of them when ``now`` is None)."""
        for name, due in list(self._closing_rings.items()):
            if now is None or now >= due:
                del self._closing_rings[name]
                if remove_ring(name, self._shm.directory):
                    self.counters["shm_rings_removed"] += 1

    def _header_or_report(self, body: list, peer, sock, identity: bytes, role: str) -> dict | None:
        try:
            return decode_header(body, max_message_bytes=self.config.max_message_bytes)
        except WireError as e:
            self._report_bad(peer, sock, identity, role, e)
        return None

    def _report_bad(self, peer, sock, identity: bytes, role: str, e: WireError) -> None:
        code = ("oversized" if isinstance(e, OversizedMessageError)
                else "schema_version" if isinstance(e, SchemaVersionError) else "malformed")
        self.counters[code] += 1
        self.counters[f"{code}_from_{role}s"] += 1
        self._error_to(peer, sock, identity, code, str(e))

    def _error_to(self, peer, sock, identity: bytes, code: str, message: str, request_id=None) -> None:
        if isinstance(peer, _Consumer):
            if peer.errors_this_s < _ERRORS_PER_PEER_PER_S:
                peer.errors_this_s += 1
                self._enqueue_control(peer, encode(ErrorNotice(code, message, request_id, time.time_ns())))
            return
        if peer is not None and peer.errors_this_s >= _ERRORS_PER_PEER_PER_S:
            return
        if peer is not None:
            peer.errors_this_s += 1
        self._send_direct(sock, identity, encode(ErrorNotice(code, message, request_id, time.time_ns())))

    def _error_to_producer(self, p: _Producer, code: str, message: str) -> None:
        self._error_to(p, self._prod, p.identity, code, message)

    def _send_direct(self, sock: zmq.Socket, identity: bytes, frames: list) -> bool:
        try:
            _send_parts(sock, identity, frames)
            return True
        except zmq.ZMQError:
            return False

    def _heartbeat(self, known: bool, extra: dict | None = None) -> list:
        return encode(Heartbeat("broker", "broker", self.instance, time.time_ns(),
                                {"known": known, "batch": self.config.batch, "shm": self._accept_shm,
                                 SHM_RECEIVED_KEY: self._accept_shm, **(extra or {})}))

    def _heartbeat_to(self, sock: zmq.Socket, identity: bytes, known: bool) -> None:
        self._send_direct(sock, identity, self._heartbeat(known))

    # ------------------------------------------------------------------------------------------ streams

    def _on_stream_message(self, p: _Producer, h: dict, body: list, nbytes: int, extent: tuple | None) -> None:
        kind = h["kind"]
        key = (h["request_id"], h["producer_id"], h["epoch"])
        seq = h.get("seq", 0)
        s = self._streams.get(key)
        if s is None:
            if key in self._closed:
                self.counters["after_end"] += 1
                return
            s = self._streams[key] = _Stream(key, p.identity)
            p.streams.add(key)
        elif s.ended:
            self.counters["after_end"] += 1
            return
        s.messages += 1
        s.bytes += nbytes
        self._order += 1
        entry = _Entry(kind, seq * 2, seq, body, nbytes, (*extent[:2], key, seq) if extent else None)
        if kind == "start":
            if s.start is not None:
                self.counters["duplicate_starts"] += 1  # a re-announce to a broker that already knew it
                return
            s.start = entry
            s.control_id = h.get("control_id") or ""
            s.next_seq = max(s.next_seq, 1)
            s.subscribers = {c.identity for c in self._consumers.values() if c.matches(s.request_id)}
            for ident in list(s.subscribers):
                c = self._consumers.get(ident)
                if c is not None:
                    self._replay(c, s)  # the start plus anything held before it came
            if any(e.kind == "end" for e in s.ctl):
                self._end_stream(s)
            return
        s.next_seq = max(s.next_seq, seq + 1)
        self._buffer(s, entry)
        if s.start is None:  # held until the (re-announced) start arrives; see _replay
            if s.messages == 1:  # ask the producer to re-announce its streams
                self._heartbeat_to(self._prod, p.identity, known=False)
            return
        self._fanout(s, entry)
        if kind == "end":
            self._end_stream(s)

    def _end_stream(self, s: _Stream) -> None:
        s.ended = True
        s.end_time = time.monotonic()
        p = self._producers.get(s.producer)
        if p is not None:
            p.streams.discard(s.key)

    def _on_producer_gap(self, p: _Producer, h: dict, body: list, nbytes: int) -> None:
        key = (h["request_id"], h["producer_id"], h["epoch"])
        missing = h.get("missing")
        if isinstance(missing, list):
            p.gaps_reported += sum(r[1] - r[0] + 1 for r in missing
                                   if isinstance(r, list) and len(r) == 2 and all(isinstance(x, int) for x in r))
        s = self._streams.get(key)
        if s is None or s.ended:
            self.counters["gap_for_unknown_stream"] += 1
            return
        entry = _Entry("gap", s.next_seq * 2 - 1, -1, body, nbytes)
        self._buffer(s, entry)
        if s.start is not None:
            self._fanout(s, entry)

    def _buffer(self, s: _Stream, entry: _Entry) -> None:
        (s.data if entry.kind == "tensors" else s.ctl).append(entry)
        s.buffered += entry.nbytes
        self._buffered_total += entry.nbytes
        while s.buffered > self.config.late_join_bytes and self._evict_one(s):
            pass
        if self._buffered_total > self.config.late_join_total_bytes:
            for other in list(self._streams.values()):
                while self._buffered_total > self.config.late_join_total_bytes and self._evict_one(other):
                    pass
                if self._buffered_total <= self.config.late_join_total_bytes:
                    break

    def _evict_one(self, s: _Stream) -> bool:
        """Evict the oldest tensor frame (then the oldest token frame); starts and ends always stay."""
        if s.data:
            e = s.data.popleft()
        else:
            i = next((i for i, e in enumerate(s.ctl) if e.kind == "tokens"), None)
            if i is None:
                return False
            e = s.ctl[i]
            del s.ctl[i]
        s.buffered -= e.nbytes
        self._buffered_total -= e.nbytes
        self.counters["evicted"] += 1
        ranges = s.evicted
        if ranges and ranges[-1][1] == e.seq - 1:
            ranges[-1][1] = e.seq
        else:
            ranges.append([e.seq, e.seq])
            if len(ranges) > 1 and ranges[-2][0] > e.seq:  # tokens evicted after later tensors: re-sort
                ranges.sort()
                merged: list[list[int]] = []
                for a, b in ranges:
                    if merged and a <= merged[-1][1] + 1:
                        merged[-1][1] = max(merged[-1][1], b)
                    else:
                        merged.append([a, b])
                s.evicted = merged
        return True

    def _replay(self, c: _Consumer, s: _Stream) -> None:
        """Give ``c`` the stream from its start: start, what was evicted (as a gap), then the buffer."""
        self._deliver(c, s, s.start)
        if s.evicted:
            self._enqueue_gap(c, s, [list(r) for r in s.evicted], "evicted_from_late_join_buffer")
        for entry in heapq.merge(s.data, s.ctl):
            self._deliver(c, s, entry)

    # ------------------------------------------------------------------------------------------ delivery

    def _fanout(self, s: _Stream, entry: _Entry) -> None:
        for ident in list(s.subscribers):
            c = self._consumers.get(ident)
            if c is not None:
                self._deliver(c, s, entry)

    def _deliver(self, c: _Consumer, s: _Stream, entry: _Entry) -> None:
        kind, n = entry.kind, entry.nbytes
        frames = entry.frames
        if entry.shm and not c.shm:  # a consumer that cannot read the ring (another host): bytes inline
            inline = entry.inline
            if inline is None:
                inline = self._inline(s, entry)
                if inline[0] is not None:
                    entry.inline = inline
            frames, n = inline
            if frames is None:  # the ring no longer holds them: n is why
                self._enqueue_gap(c, s, [[entry.seq, entry.seq]], n)
                return
        if c.queue_bytes and kind in ("tensors", "tokens"):
            limit = self.config.consumer_queue_bytes
            if kind == "tokens":
                limit += self.config.token_reserve_bytes
            if c.queue_bytes + n > limit:
                if not self._flush_one(c):
                    return  # it is gone
            if c.queue_bytes and c.queue_bytes + n > limit:
                _add_seq(c.drops.setdefault(s.key, []), entry.seq)
                c.dropped += 1
                self.counters["dropped_for_consumers"] += 1
                return
        if c.drops:
            pending = c.drops.pop(s.key, None)
            if pending:
                self._enqueue_gap(c, s, pending, "consumer_queue_full")
        c.queue.append((frames, n, entry.shm if frames is entry.frames else None))
        c.queue_bytes += n
        self._ready.add(c.identity)

    def _drop_stale_head(self, c: _Consumer) -> None:
        """Drop the ring-held frames at the head of ``c``'s queue whose bytes the producer is about to
        overwrite (more than half a ring behind its writer), with one gap per stream put in their place.

        A consumer that falls behind then gets the newest frames the ring still holds, and its loss is the
        fraction it cannot keep up with; without this it would receive only frames already overwritten."""
        q, lag = c.queue, self._shm.lag
        dropped: dict[tuple, list[list[int]]] = {}
        while q:
            ref = q[0][2] if len(q[0]) > 2 else None
            if ref is None or lag(ref[0], ref[1]) <= _SHM_STALE_LAG:
                break
            _, n, _ = q.popleft()
            c.queue_bytes -= n
            _add_seq(dropped.setdefault(ref[2], []), ref[3])
        for key, missing in dropped.items():
            rid, pid, epoch = key
            frames = encode(GapNotice(rid, pid, epoch, missing, "shm_overrun", "broker", time.time_ns()))
            count = sum(b - a + 1 for a, b in missing)
            n = _transport.frames_nbytes(frames)
            q.appendleft((frames, n))
            c.queue_bytes += n
            c.gaps_sent += count
            c.dropped += count
            self.counters["dropped_for_consumers"] += count
            self.counters["shm_stale_dropped"] += count

    def _inline(self, s: _Stream, entry: _Entry) -> tuple:
        """``(frames, nbytes)`` of ``entry`` with its ring-held bytes inline, or ``(None, reason)``."""
        try:
            frames = inline_shm(entry.frames, self._shm)
        except WireError as e:
            reason = shm_loss_reason(e)
            self.counters[reason] += 1
            if self.counters[reason] <= 10:
                log.warning("broker: could not inline %s seq %d from its producer's ring: %s", s.request_id,
                            entry.seq, e)
            return None, reason
        self.counters["shm_inlined"] += 1
        return frames, _transport.frames_nbytes(frames)

    def _enqueue_gap(self, c: _Consumer, s: _Stream, missing: list, reason: str) -> None:
        rid, pid, epoch = s.key
        frames = encode(GapNotice(rid, pid, epoch, missing, reason, "broker", time.time_ns()))
        c.gaps_sent += sum(b - a + 1 for a, b in missing)
        self._enqueue_control(c, frames)

    def _enqueue_control(self, c: _Consumer, frames: list) -> None:
        n = _transport.frames_nbytes(frames)
        c.queue.append((frames, n))
        c.queue_bytes += n
        self._ready.add(c.identity)

    def _flush_all(self) -> None:
        for ident in list(self._ready):
            c = self._consumers.get(ident)
            if c is None:
                self._ready.discard(ident)
            else:
                self._flush_one(c)

    def _flush_one(self, c: _Consumer) -> bool:
        """Hand ``c``'s queue to zmq while its credit and zmq allow; False if ``c`` turned out to be gone.

        A message may go while less than the window is in flight (the batch's earlier messages count as in
        flight); to a consumer that unpacks batches, consecutive ready messages go as one batch.
        """
        sock, ident, q, window = self._cons, c.identity, c.queue, c.window
        c.blocked = False
        while q:
            if c.shm:
                self._drop_stale_head(c)
            in_flight = c.in_flight
            if window and in_flight >= window:
                break
            count, sent = _transport.batch_span(q, _transport.BATCH_MESSAGES if c.batch else 1,
                                                 window - in_flight if window else None)
            try:
                if count == 1:
                    _send_parts(sock, ident, q[0][0])
                else:
                    batch = [q[i][0] for i in range(count)]
                    _send_frame_lists(sock, [ident, b"", batch_header([len(f) for f in batch])], batch)
            except zmq.Again:
                c.blocked = True
                break
            except zmq.ZMQError as e:
                if e.errno == zmq.EHOSTUNREACH:
                    self._forget_consumer(c, "consumers_lost")
                    return False
                raise
            for _ in range(count):
                q.popleft()
            c.queue_bytes -= sent
            c.in_flight += sent
            c.delivered += count
            c.delivered_bytes += sent
            if count > 1:
                c.batches += 1
                self.counters["batches_out"] += 1
                self.counters["batched_messages_out"] += count
        if not q:
            self._ready.discard(ident)
        return True

    def _forget_consumer(self, c: _Consumer, counter: str) -> None:
        self.counters[counter] += 1
        self.counters["discarded_for_gone_consumers"] += len(c.queue)
        self._consumers.pop(c.identity, None)
        self._ready.discard(c.identity)
        for s in self._streams.values():
            s.subscribers.discard(c.identity)
        c.queue.clear()

    # ------------------------------------------------------------------------------------------ consumers

    def _on_consumer_message(self, frames: list) -> None:
        identity = frames[0].bytes
        body = frames[1:]
        c = self._consumers.get(identity)
        if c is not None:
            c.last_seen = self._now
        header = self._header_or_report(body, c, self._cons, identity, "consumer")
        if header is None:
            return
        kind = header["kind"]
        if kind == "heartbeat":
            self._heartbeat_to(self._cons, identity, known=c is not None)
            return
        if kind == "credit":
            if c is not None:
                msg = self._decode_small(body, c, identity)
                if isinstance(msg, Credit):
                    c.in_flight = max(0, c.in_flight - msg.nbytes)
                    if c.queue:
                        self._ready.add(identity)
            return
        msg = self._decode_small(body, c, identity)
        if msg is None:
            return
        if isinstance(msg, Subscribe):
            self._on_subscribe(identity, c, msg)
        elif isinstance(msg, Unsubscribe):
            if c is not None:
                self._on_unsubscribe(c, msg)
        elif isinstance(msg, SteeringCommand):
            if c is None:
                c = self._consumers[identity] = _Consumer(identity)
            self._on_steering_command(c, msg, body)
        else:
            self.counters["unexpected_kind"] += 1
            self._error_to(c, self._cons, identity, "unexpected_kind", f"consumers may not send {kind!r} messages")

    def _decode_small(self, body: list, c, identity: bytes):
        try:
            return decode(body, max_message_bytes=16 << 20)
        except WireError as e:
            self.counters["malformed"] += 1
            self.counters["malformed_from_consumers"] += 1
            self._error_to(c, self._cons, identity, "malformed", str(e))
            return None

    def _on_subscribe(self, identity: bytes, c: _Consumer | None, msg: Subscribe) -> None:
        patterns = msg.patterns
        if not all(isinstance(p, str) for p in patterns) or not isinstance(msg.window_bytes, int):
            self.counters["malformed"] += 1
            self._error_to(c, self._cons, identity, "malformed", "subscribe patterns must be strings")
            return
        if c is None:
            c = self._consumers[identity] = _Consumer(identity)
        if msg.consumer_id:
            c.name = msg.consumer_id
        c.window = max(0, msg.window_bytes)
        c.batch = self.config.batch and msg.batch is True
        c.shm = self._accept_shm and msg.shm is True
        c.patterns = sorted(set(c.patterns) | set(patterns))
        c.match_cache.clear()
        for s in list(self._streams.values()):
            if s.start is None or identity in s.subscribers or not c.matches(s.request_id):
                continue
            if msg.from_start:
                s.subscribers.add(identity)
                self._replay(c, s)
            elif not s.ended:
                s.subscribers.add(identity)
                self._deliver(c, s, s.start)
                if s.next_seq > 1:
                    self._enqueue_gap(c, s, [[1, s.next_seq - 1]], "joined_late")

    def _on_unsubscribe(self, c: _Consumer, msg: Unsubscribe) -> None:
        drop = {p for p in msg.patterns if isinstance(p, str)}
        c.patterns = [p for p in c.patterns if p not in drop]
        c.match_cache.clear()
        for s in self._streams.values():
            if c.identity in s.subscribers and not c.matches(s.request_id):
                s.subscribers.discard(c.identity)

    # ------------------------------------------------------------------------------------------ steering

    def _refuse(self, c: _Consumer, cmd: SteeringCommand, error: str) -> None:
        self.counters["steering_refused"] += 1
        ack = SteeringAck(cmd.command_id, cmd.request_id, False, error=error, time_ns=time.time_ns())
        self._enqueue_control(c, encode(ack))

    def _on_steering_command(self, c: _Consumer, cmd: SteeringCommand, body: list) -> None:
        self.counters["steering_commands"] += 1
        user = _user_id(body[1])
        if not self.config.steering:
            return self._refuse(c, cmd, "steering_disabled: this broker was started with steering off")
        if self.config.keys is not None and user not in self._steer_ids:
            return self._refuse(c, cmd, f"not_authorised: key {user!r} is not in the broker's steer/ key dir")
        if cmd.command_id in self._pending:
            return self._refuse(c, cmd, f"duplicate_command: command id {cmd.command_id!r} is still pending")
        live = [s for s in self._streams.values()
                if s.request_id == cmd.request_id and s.start is not None and not s.ended]
        targets = {s.producer for s in live if not s.control_id}
        controls = {s.control_id for s in live if s.control_id}
        # A stream may name another producer (its engine's control peer) as the one that applies steering.
        targets |= {ident for ident, prod in self._producers.items() if prod.name.split("/")[0] in controls}
        if controls and not targets:
            return self._refuse(c, cmd, "producer_unreachable: the engine that owns this request is not connected")
        if not targets:
            return self._refuse(c, cmd, f"unknown_request: no live stream of request {cmd.request_id!r}")
        cmd.sender = user or c.name
        frames = encode(cmd)
        reached = set()
        for ident in targets:
            if self._send_direct(self._prod, ident, frames):
                reached.add(ident)
        if not reached:
            return self._refuse(c, cmd, "producer_unreachable: the producer of this request is not connected")
        self._pending[cmd.command_id] = _PendingCommand(c.identity, cmd.request_id, reached,
                                                        time.monotonic() + self.config.steer_timeout_s)

    def _on_steering_ack(self, p: _Producer, body: list) -> None:
        try:
            ack = decode(body, max_message_bytes=16 << 20)
        except WireError as e:
            self.counters["malformed"] += 1
            return self._error_to_producer(p, "malformed", str(e))
        pending = self._pending.get(ack.command_id)
        if pending is None or p.identity not in pending.expected:
            self.counters["unmatched_acks"] += 1
            return
        pending.expected.discard(p.identity)
        pending.acks.append((body, ack))
        if not pending.expected:
            self._finish_command(ack.command_id, pending)

    def _finish_command(self, command_id: str, pending: _PendingCommand, timed_out: bool = False) -> None:
        self._pending.pop(command_id, None)
        c = self._consumers.get(pending.consumer)
        if c is None:
            return
        if len(pending.acks) == 1 and not timed_out:
            self._enqueue_control(c, pending.acks[0][0])
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
                             producer_id=",".join(sorted({a.producer_id for a in acks})), time_ns=time.time_ns())
        self._enqueue_control(c, encode(merged))

    # ------------------------------------------------------------------------------------------ upkeep

    def _housekeeping(self, now: float) -> None:
        self._last_housekeeping = now
        cfg = self.config
        if now - self._last_ring_prune >= 1.0:
            self._last_ring_prune = now
            self._shm.prune()  # mappings of rings whose producer is gone would keep their memory alive
        if self._closing_rings:
            self._remove_closing_rings(now)
        if now - self._last_ring_sweep >= _RING_SWEEP_S:  # rings of producers that died without closing
            self._last_ring_sweep = now
            self.counters["shm_rings_swept"] += sweep_stale_rings()
        if now - self._last_heartbeat >= cfg.heartbeat_s:
            self._last_heartbeat = now
            for ident in self._producers:
                self._heartbeat_to(self._prod, ident, known=True)
            hb = self._heartbeat(known=True)
            for c in list(self._consumers.values()):
                try:
                    self._cons.send_multipart([c.identity, *hb], zmq.NOBLOCK)
                except zmq.Again:
                    pass
                except zmq.ZMQError as e:
                    if e.errno == zmq.EHOSTUNREACH:  # its socket is gone: a dead or closed consumer
                        self._forget_consumer(c, "consumers_lost")
            for peer in (*self._producers.values(), *self._consumers.values()):
                peer.errors_this_s = 0
            for p in self._producers.values():
                t0, m0, b0 = p._snap
                dt = max(now - t0, 1e-9)
                p.rate = ((p.messages - m0) / dt, (p.bytes - b0) / dt)
                p._snap = (now, p.messages, p.bytes)
        for p in [p for p in self._producers.values() if now - p.last_seen > cfg.producer_timeout_s]:
            self._producer_lost(p, now)
        for c in [c for c in self._consumers.values() if now - c.last_seen > cfg.consumer_timeout_s]:
            self._forget_consumer(c, "consumers_timed_out")
        for key in [k for k, s in self._streams.items() if s.ended and now - s.end_time > cfg.late_join_linger_s]:
            self._drop_stream(key)
        for key in [k for k, s in self._streams.items() if s.start is None and now - s.created > cfg.producer_timeout_s]:
            s = self._streams[key]  # frames whose start never came (not even re-announced): uninterpretable
            self.counters["orphan_messages"] += len(s.data) + len(s.ctl)
            self._drop_stream(key)
        for cid in [k for k, pc in self._pending.items() if now > pc.deadline]:
            self._finish_command(cid, self._pending[cid], timed_out=True)

    def _producer_lost(self, p: _Producer, now: float) -> None:
        self.counters["producers_lost"] += 1
        (log.warning if p.streams else log.debug)(
            "producer %s lost: nothing heard for %.1f s; ending its %d open stream(s)", p.name,
            now - p.last_seen, len(p.streams))
        self._producers.pop(p.identity, None)
        for key in list(p.streams):
            s = self._streams.get(key)
            if s is None or s.ended:
                continue
            if s.start is None:  # frames whose start never came: nobody could interpret them
                self.counters["orphan_messages"] += len(s.data) + len(s.ctl)
                self._drop_stream(key)
                continue
            rid, pid, epoch = key
            end = StreamEnd(rid, pid, epoch, s.next_seq, finish_reason="producer_lost",
                            error=f"the broker heard nothing from producer {p.name!r} for "
                                  f"{self.config.producer_timeout_s:g} s", time_ns=time.time_ns())
            frames = encode(end)
            entry = _Entry("end", s.next_seq * 2, s.next_seq, frames, _transport.frames_nbytes(frames))
            s.next_seq += 1
            self._buffer(s, entry)
            self._fanout(s, entry)
            self._end_stream(s)
        p.streams.clear()

    def _drop_stream(self, key: tuple) -> None:
        s = self._streams.pop(key)
        freed = sum(e.nbytes for e in s.data) + sum(e.nbytes for e in s.ctl)
        self._buffered_total -= freed
        self._closed[key] = None
        if len(self._closed) > _CLOSED_MEMORY:
            self._closed.popitem(last=False)
        for c in self._consumers.values():
            c.drops.pop(key, None)

    # ------------------------------------------------------------------------------------------ stats

    def stats(self) -> dict:
        """A snapshot of every counter (the stats endpoint's reply)."""
        now = time.monotonic()
        eps = self.config.endpoints
        return {
            "broker": {"instance": self.instance, "pid": os.getpid(), "uptime_s": now - self._started,
                       "endpoints": {"producers": eps.producers, "consumers": eps.consumers, "stats": eps.stats},
                       "curve": self.config.keys is not None, "steering": self.config.steering,
                       "batch": self.config.batch, "shm": self._accept_shm,
                       "late_join_buffer_bytes": self._buffered_total, "time_ns": time.time_ns()},
            "totals": dict(self.counters),
            "producers": {p.name: {"frames_per_s": p.rate[0], "bytes_per_s": p.rate[1], "messages": p.messages,
                                   "bytes": p.bytes, "open_streams": len(p.streams),
                                   "gaps_reported": p.gaps_reported, "batches": p.batches, "reported": p.reported,
                                   "last_seen_s": now - p.last_seen}
                          for p in self._producers.values()},
            "consumers": {c.name: {"patterns": c.patterns, "queue_messages": len(c.queue),
                                   "queue_bytes": c.queue_bytes, "in_flight_bytes": c.in_flight,
                                   "window_bytes": c.window, "delivered": c.delivered,
                                   "delivered_bytes": c.delivered_bytes, "dropped": c.dropped,
                                   "gaps_notified": c.gaps_sent, "batch": c.batch, "batches": c.batches,
                                   "pending_gaps": sum(
                                       b - a + 1 for rs in c.drops.values() for a, b in rs),
                                   "last_seen_s": now - c.last_seen}
                          for c in self._consumers.values()},
            "streams": {f"{s.key[0]}|{s.key[1]}|{s.key[2]}": {
                "request_id": s.key[0], "producer_id": s.key[1], "epoch": s.key[2], "messages": s.messages,
                "bytes": s.bytes, "next_seq": s.next_seq, "started": s.start is not None, "ended": s.ended,
                "buffered_bytes": s.buffered, "evicted": [list(r) for r in s.evicted],
                "subscribers": len(s.subscribers)} for s in self._streams.values()},
        }

    def _on_stats_request(self) -> None:
        try:
            request = self._stats_sock.recv(zmq.NOBLOCK)
        except zmq.Again:
            return
        stats = self.stats()
        reply = json.dumps(stats).encode() if request.strip() == b"json" else msgpack.packb(stats)
        try:
            self._stats_sock.send(reply, zmq.NOBLOCK)
        except zmq.ZMQError:
            self.counters["stats_reply_failed"] += 1


def _user_id(frame: Any) -> str:
    """The ZAP User-Id of a CURVE peer (its z85 public key); "" on ipc without CURVE."""
    try:
        return frame.get("User-Id") or ""
    except (zmq.ZMQError, AttributeError, TypeError):
        return ""


class run_broker_in_thread:
    """Run a ``Broker`` in a daemon thread: ``with run_broker_in_thread(config) as broker: ...``."""

    def __init__(self, config: BrokerConfig | None = None, **options: Any):
        if config is None:
            address = options.pop("address", None)
            config = BrokerConfig(_transport.endpoints_for(address), **options)
        self.broker = Broker(config)
        self._thread = threading.Thread(target=self.broker.run, name="mia-stream-broker", daemon=True)

    def __enter__(self) -> Broker:
        self._thread.start()
        return self.broker

    def __exit__(self, *exc: Iterable) -> None:
        self.broker.stop()
        self._thread.join(5)
        self.broker.close()
