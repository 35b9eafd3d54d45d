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

A columnar message's request whose stream has not started (its start was re-announced after a broker restart
and is still on its way) is held in that stream like any per-request message: its part is replayed, as a
selection naming that request, when the start comes. Analysis streams have no start and no end: they are
delivered from their first message, buffered for late join, and forgotten once their request's own streams are
forgotten and they have been quiet as long as an ended stream lingers.
"""

from __future__ import annotations

import collections
import fnmatch
import heapq
import logging
import operator
import time
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from mia_stream.bus import transport
from mia_stream.bus.transport import BrokerEndpoints, ServerKeys
from mia_stream.errors import MalformedFrameError, OversizedMessageError, SchemaVersionError, WireError
from mia_stream.schemas import (COLUMNAR_KINDS, DEFAULT_MAX_MESSAGE_BYTES, ErrorNotice, GapBatch, GapNotice,
                                Heartbeat, SteeringAck, SteeringCommand, StreamEnd, Subscribe, Unsubscribe,
                                columnar_requests, compact, decode, decode_header, encode, has_partial_inline_rows,
                                inline_shm, select_requests, shm_extent, shm_loss_reason, split_batch)
from mia_stream.bus.shm_ring import sweep_stale_rings
from mia_stream.schemas._codec import SHM_RING_KEY
from mia_stream.schemas._messages import Credit
from mia_stream.bus.shm_ring import (SHM_RECEIVED_KEY, SHM_RING_CLOSED_KEY, SHM_RING_PROOF_KEY, SHM_RING_TAKEN_KEY,
                                     ShmRingReader, remove_ring)

log = logging.getLogger("mia_stream.broker")

PRODUCERS, CONSUMERS = "producers", "consumers"  # where an ``outbox`` message goes

DEFAULT_CONSUMER_QUEUE_BYTES = 256 << 20  # per consumer, beyond what its credit window has in flight
DEFAULT_LATE_JOIN_BYTES = 64 << 20  # per stream
DEFAULT_LATE_JOIN_TOTAL_BYTES = 1 << 30  # all streams together
DEFAULT_LATE_JOIN_LINGER_S = 10.0  # how long an ended stream stays joinable from its start
# silent this long: its open streams end (an engine can stall for seconds, e.g. compiling)
DEFAULT_PRODUCER_TIMEOUT_S = 30.0
DEFAULT_CONSUMER_TIMEOUT_S = 60.0  # no message from a consumer for this long: it is forgotten
DEFAULT_STEER_TIMEOUT_S = 30.0
DEFAULT_RING_GRACE_S = 10.0  # a ring its closed producer handed over stays this long for consumers still reading it

_RING_SWEEP_S = 30.0
# ring sizes: a queued frame further behind its ring's writer is dropped, not sent. Half a ring, not more:
# a consumer that cannot keep up is always sent the oldest frame still allowed, and it must stay readable
# while it waits in flight behind the others (at 3/4, on the H200 they were overwritten before being read)
_SHM_STALE_LAG = 0.5
# A ring reference from a producer that has not proven it owns the ring waits (with every later message of that
# producer, in order) for the producer's next heartbeat, at most this long: a publisher proves it in each
# heartbeat (every 0.5 s), and after a broker restart its first frames can come before its first heartbeat
_PROOF_WAIT_S = 2.0
_PROOF_HOLD_BYTES = 64 << 20  # ... and at most this much of that producer's traffic is held meanwhile
_ERRORS_PER_PEER_PER_S = 20  # error replies per peer (either side, known or not): garbage cannot amplify
_CLOSED_MEMORY = 100_000
_STREAM_KINDS = frozenset(("start", "tensors", "tokens", "end"))
# A columnar message's part of one request is kept and dropped as the per-request kind it replaces: tensors are
# evicted and dropped first; tokens (and analysis rows) only beyond a reserve; start, end and gaps never.
_PART_KIND = {"step_batch": "tensors", "token_batch": "tokens", "analysis": "analysis"}
_DROPPABLE = frozenset(("tensors", "tokens", "analysis"))
_EVICT_FIRST = frozenset(("tensors", "analysis"))
_I64 = np.dtype("<i8")
_order_of = operator.itemgetter(0)
_GAP_BATCH_MINOR = 1  # a consumer whose subscribe is of schema 2.1 or later decodes gap_batch (spec 3.16)


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
    heartbeat_s: float = transport.HEARTBEAT_S
    steering: bool = True
    batch: bool = True  # accept and send batches (off: behaves as a 1.1 broker, for comparisons and fallback)
    shm: bool = True  # tell producers to put large tensors in shared memory (off: every byte through the broker)
    ring_grace_s: float = DEFAULT_RING_GRACE_S

    @property
    def token_reserve_bytes(self) -> int:
        return max(1 << 20, self.consumer_queue_bytes // 8)


# A part: one stream's share of a message, as kept in its late-join buffer and replayed from it:
# (arrival order, seq, kind, entry, index into a columnar entry's requests or -1, bytes accounted to the stream)


class _Entry:
    """One message as received: its frames are shared by the late-join buffers and every consumer's queue."""

    __slots__ = ("kind", "order", "frames", "nbytes", "ring", "key", "seq", "header", "ids", "seqs", "inline",
                 "notices")

    def __init__(self, kind: str, order: int, frames: list, nbytes: int, ring: tuple | None):
        self.kind, self.order, self.frames, self.nbytes = kind, order, frames, nbytes
        self.ring = ring  # (ring, oldest position) when tensor bytes are in the producer's ring (nbytes counts them)
        self.key: tuple | None = None  # a per-request message: its stream ...
        self.seq = -1  # ... and seq (-1: none, a gap notice)
        self.header: dict | None = None  # a columnar message (or a producer's gap): its header; request ids, seqs
        self.ids: list | None = None
        self.seqs: list | None = None
        self.inline: tuple | None = None  # (frames, nbytes) with ring bytes inline (or (None, reason)), on first need
        self.notices: dict[int, list] | None = None  # a producer's gap batch: request index -> its GapNotice's frames

    def requests(self, idx: list[int] | None):
        """(stream key, seq) of each request the message (``idx``: the selection of a columnar one) names."""
        if self.ids is None:
            return [(self.key, self.seq)]
        h = self.header
        pid, epoch, ids, seqs = h["producer_id"], h["epoch"], self.ids, self.seqs
        return [((ids[i], pid, epoch), seqs[i]) for i in (range(len(ids)) if idx is None else idx)]


class _Stream:
    __slots__ = ("key", "request_id", "producer", "start", "started", "analysis", "ended", "end_time", "next_seq",
                 "data", "ctl", "buffered", "evicted", "subscribers", "messages", "bytes", "created", "last_time",
                 "control_id")

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


class _Consumer:
    __slots__ = ("identity", "name", "patterns", "match_cache", "queue", "queue_bytes", "window", "in_flight",
                 "drops", "delivered", "delivered_bytes", "dropped", "gaps_sent", "last_seen", "blocked", "batch",
                 "batches", "shm", "gap_batch", "gap_run")

    def __init__(self, identity: bytes, now: float):
        self.identity = identity
        self.name = identity.decode("utf-8", "replace")
        self.patterns: list[str] = []
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
        # producers' gaps for it not yet queued (see Router._add_to_gap_run):
        # (producer id, epoch, reason, origin) -> request id -> [gap entries]
        self.gap_run: dict | None = None
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
                 "rate", "snap", "batches", "proofs", "disowned", "held", "held_bytes", "held_until", "releasing")

    def __init__(self, identity: bytes, now: float):
        self.identity = identity
        self.name = identity.decode("utf-8", "replace")
        self.last_seen = now
        self.streams: set[tuple] = set()  # its open (start/end) streams
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
        if len(ranges) > 1 and ranges[-2][0] > seq:  # out of order (tokens evicted after later tensors)
            ranges.sort()
            merged: list[list[int]] = []
            for a, b in ranges:
                if merged and a <= merged[-1][1] + 1:
                    merged[-1][1] = max(merged[-1][1], b)
                else:
                    merged.append([a, b])
            ranges[:] = merged


def _frames_nbytes(frames: list) -> int:
    n = 0
    for f in frames:
        n += len(f)
    return n


def _shares(h: dict, nbytes: int, r: int) -> list[int]:
    """Each request's share of a columnar message's bytes (late-join accounting): by its rows where the message
    has rows, else equal."""
    if not r:
        return []
    rows = None
    if h["kind"] == "step_batch":
        rows = np.zeros(r, dtype=_I64)
        for g in h.get("groups", ()):
            rows[np.frombuffer(g["requests"], _I64)] += np.frombuffer(g["rows"], _I64)  # a request once per group
    elif h["kind"] == "analysis" and "rows" in h:
        rows = np.frombuffer(h["rows"], _I64)
    if rows is not None:
        total = int(rows.sum())
        if total:
            return (rows * nbytes // total).tolist()
    return [nbytes // r] * r


def _gap_batch_ranges(h: dict) -> list[list[list[int]]]:
    """Each request's missing ranges in a validated gap batch header, in request order."""
    counts = np.frombuffer(h["counts"], _I64).tolist()
    firsts, lasts = np.frombuffer(h["firsts"], _I64).tolist(), np.frombuffer(h["lasts"], _I64).tolist()
    out, k = [], 0
    for n in counts:
        out.append([[firsts[j], lasts[j]] for j in range(k, k + n)])
        k += n
    return out


def _user_id(frame: Any) -> str:
    """The ZAP User-Id of a CURVE peer (its z85 public key); "" on ipc without CURVE (and for plain bytes)."""
    try:
        return frame.get("User-Id") or ""
    except Exception:  # zmq.ZMQError, AttributeError (bytes), TypeError
        return ""


class Router:
    """Every routing rule of the broker, driven by calls that carry the time; see the module docstring.

    ``instance``: this broker's random instance id (heartbeats); ``accept_shm``: producers may reference rings
    (an ipc producers endpoint); ``shm``: the reader of producers' rings (``None`` without rings); ``steer_ids``:
    CURVE keys allowed to steer (``None``: no CURVE); ``flush(identity) -> still there``: the shell hands a
    consumer's queue to zmq before the router drops for it; ``wall_ns``: the clock stamped into headers.
    """

    def __init__(self, config: BrokerConfig, *, instance: int, accept_shm: bool = False,
                 shm: ShmRingReader | None = None, steer_ids: set[str] | None = None,
                 flush: Callable[[bytes], bool] | None = None, wall_ns: Callable[[], int] = time.time_ns,
                 now: float = 0.0):
        self.config = config
        self.instance = instance
        self.accept_shm = accept_shm and shm is not None
        self._shm = shm
        self._steer_ids = steer_ids
        self._flush = flush
        self._wall_ns = wall_ns
        self.now = now
        self.started = now
        self.outbox: list[tuple[str, bytes, list, str | None]] = []  # (PRODUCERS | CONSUMERS, identity, frames,
        # steering command id or None): messages the shell sends directly
        self.ready: set[bytes] = set()  # consumers with queued messages
        self.counters: collections.Counter[str] = collections.Counter()
        self.messages_in = self.bytes_in = 0  # producers' messages (folded into the totals by ``stats``)
        self._order = 0
        self._streams: dict[tuple, _Stream] = {}
        self._by_request: dict[str, set[tuple]] = {}
        self._closed: collections.OrderedDict[tuple, None] = collections.OrderedDict()
        self._consumers: dict[bytes, _Consumer] = {}
        self._producers: dict[bytes, _Producer] = {}
        self._pending: dict[str, _PendingCommand] = {}
        self._buffered_total = 0
        # every buffered tensor/analysis part in arrival order, (stream, part): the late-join total evicts the
        # oldest from here in O(1). Scanning the streams for the oldest instead cost the broker so much per
        # message once the total was reached that consumers fell behind (10 s at 2 MiB per step: 35-55% lost)
        self._evictable: collections.deque[tuple] = collections.deque()
        self._ring_owners: dict[str, bytes] = {}  # ring -> the producer that proved it owns it
        self._closing_rings: dict[str, float] = {}  # rings handed over by their closed producers -> removal time
        self._errors: dict[tuple[str, bytes], int] = {}  # error replies per peer in the current second
        self._errors_since = now
        self._last_heartbeat = self._last_ring_sweep = self._last_ring_prune = -1e18
        self._gap_runs: set[bytes] = set()  # consumers with a gap run to queue before this input returns

    # ------------------------------------------------------------------------------------------ inputs

    def producer_message(self, identity: bytes, body: list, now: float) -> None:
        """One zmq message from a producer: a single message, or a batch whose messages are each handled
        exactly as if they had come alone."""
        self.now = now
        try:
            p = self._producers.get(identity)
            if p is None:
                p = self._producers[identity] = _Producer(identity, now)
                self._heartbeat_to(PRODUCERS, identity, known=True)  # lets a restarted peer re-announce now
            p.last_seen = now
            if self.config.batch:
                try:
                    messages = split_batch(body)
                except MalformedFrameError as e:  # its frames cannot be told apart: the whole batch is dropped
                    self.counters["malformed_batches"] += 1
                    self._report_bad(PRODUCERS, identity, "producer", e)
                    return
                if messages is not None:
                    p.batches += 1
                    self.counters["batches_in"] += 1
                    self.counters["batched_messages_in"] += len(messages)
                    for m in messages:
                        self._safely(self._producer_body, p, m)
                    return
            self._producer_body(p, body)
        except Exception:  # last line of defence: bad input must never stop the broker
            self._internal_error()
        finally:
            if self._gap_runs:
                self._safely(self._flush_gap_runs)

    def consumer_message(self, identity: bytes, body: list, now: float) -> None:
        """One zmq message from a consumer."""
        self.now = now
        try:
            self._consumer_body(identity, body)
        except Exception:
            self._internal_error()
        finally:
            if self._gap_runs:
                self._safely(self._flush_gap_runs)

    def tick(self, now: float) -> None:
        """Housekeeping (the shell calls it every 50 ms): heartbeats, timeouts, lingering streams, rings."""
        self.now = now
        try:
            self._housekeeping(now)
        except Exception:
            self._internal_error()
        finally:
            if self._gap_runs:
                self._safely(self._flush_gap_runs)

    # ------------------------------------------------------------------------------------------ consumer flow

    def pending_send(self, identity: bytes) -> tuple[list[list], int] | None:
        """The messages to hand to consumer ``identity``'s socket now, as one zmq message (several make a
        batch), and their bytes; None when its queue is empty or its credit window is full. A message may go
        while less than the window is in flight (a batch's earlier messages count as in flight)."""
        c = self._consumers.get(identity)
        if c is None or not c.queue:
            self.ready.discard(identity)
            return None
        c.blocked = False
        if c.shm:
            self._drop_stale_head(c)
        q, window = c.queue, c.window
        if window and c.in_flight >= window:
            return None
        count, nbytes = transport.batch_span(q, transport.BATCH_MESSAGES if c.batch else 1,
                                              window - c.in_flight if window else None)
        return [q[i][0] for i in range(count)], nbytes

    def sent(self, identity: bytes, count: int, nbytes: int) -> None:
        """The first ``count`` messages of ``pending_send`` went (``nbytes`` in all)."""
        c = self._consumers.get(identity)
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
            self.counters["batches_out"] += 1
            self.counters["batched_messages_out"] += count
        if not q:
            self.ready.discard(identity)

    def blocked(self, identity: bytes) -> None:
        """zmq refused a send to ``identity`` (its pipe is full): try again soon."""
        c = self._consumers.get(identity)
        if c is not None:
            c.blocked = True

    def any_blocked(self) -> bool:
        return any(c.blocked for c in map(self._consumers.get, self.ready) if c is not None)

    def consumer_unreachable(self, identity: bytes) -> None:
        """A send to ``identity`` found its socket gone (EHOSTUNREACH): a dead or closed consumer."""
        c = self._consumers.get(identity)
        if c is not None:
            self._forget_consumer(c, "consumers_lost")

    def producer_unreachable(self, identity: bytes, command_id: str | None) -> None:
        """A steering command (``command_id``) could not be sent to producer ``identity``."""
        pending = self._pending.get(command_id) if command_id else None
        if pending is None or identity not in pending.expected:
            return
        pending.expected.discard(identity)
        if pending.expected:
            return
        if pending.acks:
            self._finish_command(command_id, pending)
            return
        self._pending.pop(command_id, None)
        c = self._consumers.get(pending.consumer)
        if c is not None:
            self._refuse_command(c, command_id, pending.request_id,
                                 "producer_unreachable: the producer of this request is not connected")

    def take_outbox(self) -> list[tuple[str, bytes, list, str | None]]:
        out, self.outbox = self.outbox, []
        return out

    def close(self) -> None:
        """Remove the rings producers handed over (no consumer of this broker can still need them)."""
        self._remove_closing_rings(None)
        if self._shm is not None:
            self._shm.close()

    @property
    def buffered_bytes(self) -> int:
        return self._buffered_total

    # ------------------------------------------------------------------------------------------ producers

    def _safely(self, handler, *args) -> None:
        try:
            handler(*args)
        except Exception:
            self._internal_error()

    def _internal_error(self) -> None:
        self.counters["internal_errors"] += 1
        log.exception("broker: error while handling a message (counted as internal_errors)")

    def _producer_body(self, p: _Producer, body: list) -> None:
        nbytes = _frames_nbytes(body)
        p.messages += 1
        p.bytes += nbytes
        self.messages_in += 1
        self.bytes_in += nbytes
        if p.held is not None:  # waiting for this producer's proof of a ring: its order is kept
            header = self._header_or_report(body, PRODUCERS, p.identity, "producer")
            if header is None:
                return
            if header["kind"] == "heartbeat":  # it may carry the proof: releases what is held
                self._on_producer_heartbeat(p, header)
                return
            p.held.append((body, nbytes))
            p.held_bytes += nbytes
            if p.held_bytes > _PROOF_HOLD_BYTES:
                self._release_held(p)
            return
        self._handle_producer(p, body, nbytes)

    def _handle_producer(self, p: _Producer, body: list, nbytes: int) -> None:
        header = self._header_or_report(body, PRODUCERS, p.identity, "producer")
        if header is None:
            return
        kind = header["kind"]
        ring = None
        if SHM_RING_KEY in header:
            extent = shm_extent(header)
            if extent is not None:
                if not self.accept_shm:  # a peer on another host cannot have a ring here: a forged reference
                    self._report_bad(PRODUCERS, p.identity, "producer", MalformedFrameError(
                        "shared-memory tensor references are accepted only from producers on the broker's host "
                        "(an ipc producers endpoint)"))
                    return
                name = extent[0]
                if self._ring_owners.get(name) != p.identity:
                    if name in p.disowned or p.releasing:
                        p.disowned.add(name)
                        self._refuse_ring(p, name)
                    else:
                        self._hold(p, body, nbytes)
                    return
                nbytes += extent[2]  # what the ring holds counts against budgets and windows like inline bytes
                self.counters["shm_bytes_in"] += extent[2]
                self._shm.note_received(name, extent[3])
                ring = (name, extent[1])
        if kind in COLUMNAR_KINDS:
            self._on_columnar(p, header, body, nbytes, ring)
        elif kind in _STREAM_KINDS:
            self._on_stream_message(p, header, body, nbytes, ring)
        elif kind == "gap":
            self._on_producer_gap(p, header, body, nbytes)
        elif kind == "gap_batch":
            self._on_producer_gap_batch(p, header, body, nbytes)
        elif kind == "heartbeat":
            self._on_producer_heartbeat(p, header)
        elif kind == "steer_ack":
            self._on_steering_ack(p, body)
        else:
            self.counters["unexpected_kind"] += 1
            self._error_to(PRODUCERS, p.identity, "unexpected_kind", f"producers may not send {kind!r} messages")

    def _on_producer_heartbeat(self, p: _Producer, header: dict) -> None:
        stats = header.get("stats")
        if isinstance(stats, dict):
            proof = stats.get(SHM_RING_PROOF_KEY)
            if proof is not None:
                self._check_proof(p, proof)
                stats = {k: v for k, v in stats.items() if k != SHM_RING_PROOF_KEY}  # never shown in stats
            p.reported = stats
        if p.held is not None:
            self._release_held(p)
        if isinstance(stats, dict) and SHM_RING_CLOSED_KEY in stats:
            name = stats[SHM_RING_CLOSED_KEY]
            if self._take_ring(p, name):
                self.outbox.append((PRODUCERS, p.identity, self._heartbeat(True, {SHM_RING_TAKEN_KEY: name}), None))
                return
        self._heartbeat_to(PRODUCERS, p.identity, known=True)

    # ------------------------------------------------------------------------------------------ ring ownership

    def _check_proof(self, p: _Producer, proof: Any) -> None:
        """A heartbeat's ``shm_ring_proof``: the secret whose digest is in the ring's header (spec section 9)."""
        name = proof.get("ring") if isinstance(proof, dict) else None
        secret = proof.get("secret") if isinstance(proof, dict) else None
        if type(name) is str and p.proofs.get(name) == secret and self._ring_owners.get(name) == p.identity:
            return  # proven before
        if self._shm is not None and type(name) is str and self._shm.verify_owner(name, secret):
            self._ring_owners[name] = p.identity
            p.proofs[name] = secret
            p.disowned.discard(name)
            self.counters["shm_rings_proven"] += 1
            return
        self.counters["shm_ring_proof_refused"] += 1
        self._error_to(PRODUCERS, p.identity, "shm_ring_not_owned",
                       f"the ownership proof of shared-memory ring {name!r} does not match the ring's header")

    def _hold(self, p: _Producer, body: list, nbytes: int) -> None:
        """A reference to a ring this producer has not proven it owns: it and the producer's later messages wait
        for its next heartbeat (its proof), at most ``_PROOF_WAIT_S``."""
        p.held = collections.deque([(body, nbytes)])
        p.held_bytes = nbytes
        p.held_until = self.now + _PROOF_WAIT_S
        self.counters["held_for_ring_proof"] += 1

    def _release_held(self, p: _Producer) -> None:
        """Route what waited for a proof, in order; a reference to a ring still not proven is refused."""
        held, p.held, p.held_bytes = p.held, None, 0
        p.releasing = True
        try:
            for body, nbytes in held:
                self._safely(self._handle_producer, p, body, nbytes)
        finally:
            p.releasing = False

    def _refuse_ring(self, p: _Producer, name: str) -> None:
        self.counters["shm_ring_not_owned"] += 1
        self._error_to(PRODUCERS, p.identity, "shm_ring_not_owned",
                       f"shared-memory ring {name!r} was not proven to belong to this producer (its heartbeats must "
                       "carry the ring's ownership proof, spec section 9): the message is refused")

    def _take_ring(self, p: _Producer, name: Any) -> bool:
        """A closing producer offers its ring: taken, it is removed after the grace, so that consumers that are
        still behind can open it for the last frames after the producer exits. Whether it was taken."""
        if type(name) is not str or self._ring_owners.get(name) != p.identity:  # only the ring it proved it owns
            self.counters["shm_ring_handover_refused"] += 1
            return False
        self._closing_rings[name] = self.now + self.config.ring_grace_s
        self.counters["shm_rings_handed_over"] += 1
        return True

    def _remove_closing_rings(self, now: float | None) -> None:
        """Remove the handed-over rings whose grace has passed (all of them when ``now`` is None)."""
        for name, due in list(self._closing_rings.items()):
            if now is None or now >= due:
                del self._closing_rings[name]
                self._ring_owners.pop(name, None)
                if self._shm is not None and remove_ring(name, self._shm.directory):
                    self.counters["shm_rings_removed"] += 1

    # ------------------------------------------------------------------------------------------ errors, heartbeats

    def _header_or_report(self, body: list, role: str, identity: bytes, who: str) -> dict | None:
        try:
            return decode_header(body, max_message_bytes=self.config.max_message_bytes)
        except WireError as e:
            self._report_bad(role, identity, who, e)
        return None

    def _report_bad(self, role: str, identity: bytes, who: str, e: WireError) -> None:
        code = ("oversized" if isinstance(e, OversizedMessageError)
                else "schema_version" if isinstance(e, SchemaVersionError) else "malformed")
        self.counters[code] += 1
        self.counters[f"{code}_from_{who}s"] += 1
        self._error_to(role, identity, code, str(e))

    def _error_to(self, role: str, identity: bytes, code: str, message: str, request_id: str | None = None) -> None:
        """An ErrorNotice to a peer, at most ``_ERRORS_PER_PEER_PER_S`` per second per peer (docs/bus.md)."""
        key = (role, identity)
        n = self._errors.get(key, 0)
        if n >= _ERRORS_PER_PEER_PER_S:
            self.counters["error_notices_suppressed"] += 1
            return
        self._errors[key] = n + 1
        self.counters["error_notices"] += 1
        frames = encode(ErrorNotice(code, message, request_id, self._wall_ns()))
        c = self._consumers.get(identity) if role == CONSUMERS else None
        if c is not None:
            self._enqueue_control(c, frames)  # in order with what it is sent
        else:
            self.outbox.append((role, identity, frames, None))

    def _heartbeat(self, known: bool, extra: dict | None = None) -> list:
        return encode(Heartbeat("broker", "broker", self.instance, self._wall_ns(),
                                {"known": known, "batch": self.config.batch, "shm": self.accept_shm,
                                 SHM_RECEIVED_KEY: self.accept_shm, "gap_batch": True, **(extra or {})}))

    def _heartbeat_to(self, role: str, identity: bytes, known: bool) -> None:
        self.outbox.append((role, identity, self._heartbeat(known), None))

    # ------------------------------------------------------------------------------------------ streams

    def _next_order(self) -> int:
        self._order += 1
        return self._order

    def _new_stream(self, key: tuple, p: _Producer, analysis: bool = False) -> _Stream:
        s = self._streams[key] = _Stream(key, p.identity, self.now, analysis)
        keys = self._by_request.get(key[0])
        if keys is None:
            keys = self._by_request[key[0]] = set()
        keys.add(key)
        if analysis:
            s.subscribers = {c.identity for c in self._consumers.values() if c.matches(s.request_id)}
        else:
            p.streams.add(key)
        return s

    def _on_stream_message(self, p: _Producer, h: dict, body: list, nbytes: int, ring: tuple | None) -> None:
        kind = h["kind"]
        key = (h["request_id"], h["producer_id"], h["epoch"])
        seq = h.get("seq", 0)
        s = self._streams.get(key)
        if s is None:
            if key in self._closed:
                self.counters["after_end"] += 1
                return
            s = self._new_stream(key, p)
            if kind != "start":  # frames of a stream whose start it has not seen: ask it to re-announce
                self._heartbeat_to(PRODUCERS, p.identity, known=False)
        elif s.ended or s.analysis:
            self.counters["after_end" if s.ended else "unexpected_kind"] += 1
            return
        s.messages += 1
        s.bytes += nbytes
        s.last_time = self.now
        entry = _Entry(kind, self._next_order(), body, nbytes, ring)
        entry.key, entry.seq = key, seq
        part = (entry.order, seq, kind, entry, -1, nbytes)
        if kind == "start":
            if s.start is not None:
                self.counters["duplicate_starts"] += 1  # a re-announce to a broker that already knew it
                return
            s.start = part
            s.started = True
            s.control_id = h.get("control_id") or ""
            s.next_seq = max(s.next_seq, 1)
            s.subscribers = {c.identity for c in self._consumers.values() if c.matches(s.request_id)}
            for ident in list(s.subscribers):
                c = self._consumers.get(ident)
                if c is not None:
                    self._replay(c, [s])  # the start plus anything held before it came
            if any(pt[2] == "end" for pt in s.ctl):
                self._end_stream(s)
            return
        if seq >= s.next_seq:
            s.next_seq = seq + 1
        self._buffer(s, part)
        if not s.started:  # held until the (re-announced) start arrives; see _replay
            return
        for ident in list(s.subscribers):
            c = self._consumers.get(ident)
            if c is not None:
                self._deliver_part(c, part)
        if kind == "end":
            self._end_stream(s)

    def _on_columnar(self, p: _Producer, h: dict, body: list, nbytes: int, ring: tuple | None) -> None:
        """A message naming many requests: each request's part goes to its stream (buffered there, held while
        the stream has not started); the consumers subscribed to some of the live ones get it whole or as a
        selection."""
        kind = h["kind"]
        ids, seqs = columnar_requests(h)
        pid, epoch = h["producer_id"], h["epoch"]
        entry = _Entry(kind, self._next_order(), body, nbytes, ring)
        entry.header, entry.ids, entry.seqs = h, ids, seqs
        part_kind = _PART_KIND[kind]
        analysis = kind == "analysis"
        evict_first = part_kind in _EVICT_FIRST
        shares = _shares(h, nbytes, len(ids))
        get, order, now, limit = self._streams.get, entry.order, self.now, self.config.late_join_bytes
        live: list[tuple[int, _Stream]] = []
        added = 0
        ask = False
        # The per-request loop is the router's cost per request of a step: kept to attribute updates and one
        # append (measured: scripts/bench_routing.py)
        for i, rid in enumerate(ids):
            s = get((rid, pid, epoch))
            if s is None or s.ended or s.analysis is not analysis:
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
                self._evictable.append((s, part))
            else:
                s.ctl.append(part)
            added = self._charge(s, share, added, limit)
            if s.started:
                live.append((i, s))
        self._buffered_total += added
        if self._buffered_total > self.config.late_join_total_bytes:
            self._evict_to_total()
        if ask:  # parts of new streams whose start it has not seen: ask it to re-announce (held meanwhile)
            self._heartbeat_to(PRODUCERS, p.identity, known=False)
        if not live:
            return
        self._fan_out(entry, live)

    def _charge(self, s: _Stream, share: int, added: int, limit: int) -> int:
        """Count a buffered share against its stream, evicting the stream's oldest parts past ``limit``; returns
        ``added`` (bytes not yet in ``_buffered_total``) plus the share, or 0 once the total was updated."""
        s.buffered += share
        added += share
        if s.buffered > limit:
            self._buffered_total += added
            added = 0
            while s.buffered > limit and self._evict_one(s):
                pass
        return added

    def _fan_out(self, entry: _Entry, live: list) -> None:
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
            c = self._consumers.get(ident)
            if c is not None:
                self._deliver_columnar(c, entry, idx, views)

    def _columnar_stream(self, p: _Producer, key: tuple, s: _Stream | None, analysis: bool) -> _Stream | None:
        """The stream a columnar message's part goes to when it is not simply a live one: a new stream (held
        until its start comes; an analysis stream starts at once), or None for one that ended (or is of the
        other family: an analysis part for a request stream, or the reverse)."""
        if s is None:
            if key in self._closed:
                self.counters["after_end"] += 1
                return None
            return self._new_stream(key, p, analysis)
        self.counters["after_end" if s.ended else "unexpected_kind"] += 1
        return None

    def _end_stream(self, s: _Stream) -> None:
        s.ended = True
        s.end_time = self.now
        p = self._producers.get(s.producer)
        if p is not None:
            p.streams.discard(s.key)

    def _on_producer_gap(self, p: _Producer, h: dict, body: list, nbytes: int) -> None:
        key = (h["request_id"], h["producer_id"], h["epoch"])
        # decode_header checked every range ([first, last] ints, 0 <= first <= last); checking each again here was
        # ~10% of the broker's samples at saturation, a producer gap per request per dropped step (py-spy)
        p.gaps_reported += sum(b - a + 1 for a, b in h.get("missing", ()))
        s = self._streams.get(key)
        if s is None or s.ended:
            self.counters["gap_for_unknown_stream"] += 1
            return
        entry = _Entry("gap", self._next_order(), body, nbytes, None)
        entry.key, entry.header = key, h
        part = (entry.order, -1, "gap", entry, -1, nbytes)
        s.last_time = self.now
        self._buffer(s, part)
        if s.started:
            for ident in list(s.subscribers):
                c = self._consumers.get(ident)
                if c is not None:
                    self._deliver_part(c, part)

    def _on_producer_gap_batch(self, p: _Producer, h: dict, body: list, nbytes: int) -> None:
        """A producer's GapBatch (a dropped step batch: one for all the requests it named) is each request's
        GapNotice: kept once, each live stream's late-join buffer references its part (an index, as for a
        columnar message), and each subscribed consumer gets it whole or as a selection of its requests (a
        consumer of schema 2.0: a GapNotice per request)."""
        ids = h["request_ids"]
        pid, epoch = h["producer_id"], h["epoch"]
        firsts, lasts = np.frombuffer(h["firsts"], _I64), np.frombuffer(h["lasts"], _I64)
        p.gaps_reported += int((lasts - firsts).sum()) + len(lasts)  # decode_header checked the ranges
        entry = _Entry("gap_batch", self._next_order(), body, nbytes, None)
        entry.header, entry.ids = h, ids
        share = nbytes // len(ids) if ids else 0
        get, order, now, limit = self._streams.get, entry.order, self.now, self.config.late_join_bytes
        live: list[tuple[int, _Stream]] = []
        unknown = added = 0
        for i, rid in enumerate(ids):
            s = get((rid, pid, epoch))
            if s is None or s.ended:  # as a GapNotice of a stream it does not know
                unknown += 1
                continue
            s.last_time = now
            s.ctl.append((order, -1, "gap", entry, i, share))  # gaps are never evicted
            added = self._charge(s, share, added, limit)
            if s.started:
                live.append((i, s))
        self._buffered_total += added
        if self._buffered_total > self.config.late_join_total_bytes:
            self._evict_to_total()
        if unknown:
            self.counters["gap_for_unknown_stream"] += unknown
        self.counters["producer_gap_batches"] += 1
        self._fan_out(entry, live)

    # ------------------------------------------------------------------------------------------ late join

    def _buffer(self, s: _Stream, part: tuple) -> None:
        if part[2] in _EVICT_FIRST:
            s.data.append(part)
            self._evictable.append((s, part))
        else:
            s.ctl.append(part)
        share = part[5]
        s.buffered += share
        self._buffered_total += share
        cfg = self.config
        if s.buffered > cfg.late_join_bytes:
            while s.buffered > cfg.late_join_bytes and self._evict_one(s):
                pass
        if self._buffered_total > cfg.late_join_total_bytes:
            self._evict_to_total()

    def _evict_to_total(self) -> None:
        """Evict the oldest buffered tensor (and analysis) parts of all streams until the buffers together are
        within their total; only then token parts, oldest streams first."""
        total, fifo, streams = self.config.late_join_total_bytes, self._evictable, self._streams
        while self._buffered_total > total and fifo:
            s, part = fifo.popleft()
            if s.data and s.data[0] is part and streams.get(s.key) is s:  # else evicted or dropped already
                self._evict_one(s)
        if self._buffered_total > total:
            for other in streams.values():
                while self._buffered_total > total and self._evict_one(other):
                    pass
                if self._buffered_total <= total:
                    break

    def _prune_evictable(self) -> None:
        """Forget the eviction queue's entries of parts evicted or dropped otherwise (housekeeping: they are
        skipped when they reach its front, but a long-lived stream's part there would keep them all)."""
        streams = self._streams
        live = {id(pt) for s in streams.values() for pt in s.data}
        self._evictable = collections.deque((s, pt) for s, pt in self._evictable
                                            if id(pt) in live and streams.get(s.key) is s)

    def _evict_one(self, s: _Stream) -> bool:
        """Evict the oldest tensor (or analysis) part, then the oldest token part; starts, ends and gaps stay."""
        if s.data:
            part = s.data.popleft()
        else:
            i = next((i for i, pt in enumerate(s.ctl) if pt[2] == "tokens"), None)
            if i is None:
                return False
            part = s.ctl[i]
            del s.ctl[i]
        s.buffered -= part[5]
        self._buffered_total -= part[5]
        self.counters["evicted"] += 1
        _add_seq(s.evicted, part[1])
        return True

    def _replay(self, c: _Consumer, streams: list[_Stream]) -> None:
        """Give ``c`` these streams from their start: each start, what was evicted (as a gap), then the buffered
        parts in arrival order. Parts of one columnar message go as one selection naming these streams' requests
        in it (for one stream: that request alone)."""
        for s in streams:
            if s.start is not None:
                self._deliver_part(c, s.start)
            if s.evicted:
                self._enqueue_gap(c, s.key, [list(r) for r in s.evicted], "evicted_from_late_join_buffer")
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
                self._deliver_columnar(c, entry, sorted(idx), None)
                entry = None
            if i >= 0:
                entry, idx = part[3], [i]
            else:
                self._deliver_part(c, part)
        if entry is not None:
            self._deliver_columnar(c, entry, sorted(idx), None)

    # ------------------------------------------------------------------------------------------ delivery

    def _deliver_part(self, c: _Consumer, part: tuple) -> None:
        """A per-request message (start, tensors, tokens, end, gap) to ``c``."""
        entry = part[3]
        if entry.kind == "gap" and c.gap_batch:
            self._add_to_gap_run(c, entry)
            return
        frames, n, ring = self._view(entry, None, c.shm, None)
        if frames is None:  # the ring no longer holds its bytes: n is why
            self._enqueue_gap(c, entry.key, [[entry.seq, entry.seq]], n)
            return
        self._enqueue(c, frames, n, entry, None, ring, part[2])

    def _deliver_columnar(self, c: _Consumer, entry: _Entry, idx: list[int], views: dict | None) -> None:
        """A columnar message (or a producer's gap batch) to ``c``, naming the requests ``idx`` (ascending
        indices)."""
        if entry.kind == "gap_batch":
            self._deliver_gap_batch(c, entry, idx, views)
            return
        frames, n, ring = self._view(entry, idx, c.shm, views)
        if frames is None:
            for gap in self._gap_messages(c, [(key, [[seq, seq]]) for key, seq in entry.requests(idx)], n):
                self._enqueue_control(c, gap)
            return
        self._enqueue(c, frames, n, entry, idx, ring, _PART_KIND[entry.kind])

    def _deliver_gap_batch(self, c: _Consumer, entry: _Entry, idx: list[int], views: dict | None) -> None:
        """A producer's gap batch to ``c``: as received, or a selection of requests ``idx``, when it decodes gap
        batches; else one GapNotice per request (each encoded once per message, shared by such consumers)."""
        if c.gap_batch:
            frames, n, _ = self._view(entry, idx, False, views)
            self._enqueue(c, frames, n, entry, idx, None, "gap")
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
            self._enqueue(c, frames, _frames_nbytes(frames), None, None, None, "gap")

    def _view(self, entry: _Entry, idx: list[int] | None, reads_rings: bool, views: dict | None) -> tuple:
        """``(frames, bytes, (ring, oldest position) or None)`` of what a consumer gets of ``entry``: the frames
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
        self.counters["selections"] += 1
        extent = shm_extent(h) if entry.ring is not None else None
        if (extent is not None and not reads_rings) or has_partial_inline_rows(h):
            frames, n = self._inlined(entry, frames)
            view = (frames, n, None)
        else:
            n = _frames_nbytes(frames)
            view = (frames, n + extent[2], (extent[0], extent[1])) if extent is not None else (frames, n, None)
        if views is not None:
            views[key] = view
        return view

    def _inlined(self, entry: _Entry, frames: list) -> tuple:
        """``(frames, bytes)`` of ``frames`` with ring-held bytes inline (a columnar message: compacted to just its
        rows), or ``(None, reason)`` when the ring cannot give them."""
        try:
            out = inline_shm(frames, self._shm) if entry.ids is None else compact(frames, self._shm)
        except WireError as e:
            reason = shm_loss_reason(e)
            self.counters[reason] += 1
            if self.counters[reason] <= 10:
                log.warning("broker: could not inline a %s message from its producer's ring: %s", entry.kind, e)
            return None, reason
        self.counters["shm_inlined" if entry.ring is not None else "compacted"] += 1
        return out, _frames_nbytes(out)

    def _enqueue(self, c: _Consumer, frames: list, n: int, entry: _Entry | None, idx: list[int] | None,
                 ring: tuple | None, kind: str) -> None:
        """Queue a stream message for ``c``: past its budget, tensors (then tokens beyond a reserve) are dropped
        and recorded per stream; before the next message queued, gaps name every stream's drops."""
        if c.gap_run is not None:
            self._queue_gap_run(c)
        if c.queue_bytes and kind in _DROPPABLE:
            cfg = self.config
            limit = cfg.consumer_queue_bytes
            if kind != "tensors":
                limit += cfg.token_reserve_bytes
            if c.queue_bytes + n > limit:
                if self._flush is not None and not self._flush(c.identity):
                    return  # it is gone
                if c.queue_bytes and c.queue_bytes + n > limit:
                    requests = entry.requests(idx)
                    for key, seq in requests:
                        _add_seq(c.drops.setdefault(key, []), seq)
                    c.dropped += len(requests)
                    self.counters["dropped_for_consumers"] += len(requests)
                    return
        if c.drops:
            # All of them, not only this message's requests': then each request's gap still precedes its next
            # message, and the drops of a step batch (~256 requests) go as one GapBatch, not 256 GapNotices
            drops, c.drops = c.drops, {}
            for gap in self._gap_messages(c, list(drops.items()), "consumer_queue_full"):
                self._enqueue_control(c, gap)
        c.queue.append((frames, n, entry, idx, ring))
        c.queue_bytes += n
        self.ready.add(c.identity)

    def _enqueue_gap(self, c: _Consumer, key: tuple, missing: list, reason: str) -> None:
        rid, pid, epoch = key
        frames = encode(GapNotice(rid, pid, epoch, missing, reason, "broker", self._wall_ns()))
        c.gaps_sent += sum(b - a + 1 for a, b in missing)
        self._enqueue_control(c, frames)

    def _gap_messages(self, c: _Consumer, gaps: list[tuple[tuple, list]], reason: str) -> list[list]:
        """The messages that announce ``gaps`` (stream key, missing seq ranges) to ``c``, counted in its
        ``gaps_sent``: one GapBatch per (producer, epoch) naming several streams when ``c`` decodes them, else
        one GapNotice per stream."""
        now_ns = self._wall_ns()
        by_producer: dict[tuple, list] = {}
        for (rid, pid, epoch), missing in gaps:
            c.gaps_sent += sum(b - a + 1 for a, b in missing)
            by_producer.setdefault((pid, epoch), []).append((rid, missing))
        out = []
        for (pid, epoch), named in by_producer.items():
            if c.gap_batch and len(named) > 1:
                out.append(encode(GapBatch.of(pid, epoch, named, reason, "broker", now_ns)))
                self.counters["gap_batches"] += 1
            else:
                out.extend(encode(GapNotice(rid, pid, epoch, missing, reason, "broker", now_ns))
                           for rid, missing in named)
        return out

    def _enqueue_control(self, c: _Consumer, frames: list) -> None:
        if c.gap_run is not None:
            self._queue_gap_run(c)
        n = _frames_nbytes(frames)
        c.queue.append((frames, n, None, None, None))
        c.queue_bytes += n
        self.ready.add(c.identity)

    def _add_to_gap_run(self, c: _Consumer, entry: _Entry) -> None:
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
            self._gap_runs.add(c.identity)
        named = c.gap_run.setdefault((pid, epoch, h.get("reason", ""), h.get("origin", "")), {})
        got = named.get(rid)
        if got is None:
            named[rid] = [entry]
        else:
            got.append(entry)

    def _queue_gap_run(self, c: _Consumer) -> None:
        """Queue ``c``'s gap run: a GapNotice as received for a stream alone in its group, else a GapBatch."""
        run, c.gap_run = c.gap_run, None
        self._gap_runs.discard(c.identity)
        for (pid, epoch, reason, origin), named in run.items():
            if len(named) == 1:
                for entry in next(iter(named.values())):
                    self._enqueue(c, entry.frames, entry.nbytes, entry, None, None, "gap")
                continue
            missing = [(rid, [r for e in entries for r in e.header.get("missing", ())])
                       for rid, entries in named.items()]
            time_ns = min(e.header.get("time_ns", 0) for entries in named.values() for e in entries)
            frames = encode(GapBatch.of(pid, epoch, missing, reason, origin, time_ns))
            self.counters["gap_batches"] += 1
            self.counters["producer_gaps_batched"] += sum(len(entries) for entries in named.values())
            self._enqueue(c, frames, _frames_nbytes(frames), None, None, None, "gap")

    def _flush_gap_runs(self) -> None:
        """Queue every consumer's gap run (an input is done)."""
        for ident in list(self._gap_runs):
            c = self._consumers.get(ident)
            if c is not None and c.gap_run is not None:
                self._queue_gap_run(c)
        self._gap_runs.clear()

    def _drop_stale_head(self, c: _Consumer) -> None:
        """Drop the ring-held messages at the head of ``c``'s queue whose bytes the producer is about to
        overwrite (more than half a ring behind its writer), with their gaps put in their place.

        A consumer that falls behind then gets the newest frames the ring still holds, and its loss is the
        fraction it cannot keep up with; without this it would receive only frames already overwritten."""
        q, lag = c.queue, self._shm.lag
        dropped: dict[tuple, list[list[int]]] = {}
        count = 0
        while q:
            frames, n, entry, idx, ring = q[0]
            if ring is None or lag(ring[0], ring[1]) <= _SHM_STALE_LAG:
                break
            q.popleft()
            c.queue_bytes -= n
            for key, seq in entry.requests(idx):
                _add_seq(dropped.setdefault(key, []), seq)
                count += 1
        if not dropped:
            return
        for frames in reversed(self._gap_messages(c, list(dropped.items()), "shm_overrun")):
            n = _frames_nbytes(frames)
            q.appendleft((frames, n, None, None, None))
            c.queue_bytes += n
        c.dropped += count
        self.counters["dropped_for_consumers"] += count
        self.counters["shm_stale_dropped"] += count

    def _forget_consumer(self, c: _Consumer, counter: str) -> None:
        self.counters[counter] += 1
        self.counters["discarded_for_gone_consumers"] += len(c.queue)
        self._consumers.pop(c.identity, None)
        self.ready.discard(c.identity)
        c.gap_run = None
        self._gap_runs.discard(c.identity)
        for s in self._streams.values():
            s.subscribers.discard(c.identity)
        c.queue.clear()

    # ------------------------------------------------------------------------------------------ consumers

    def _consumer_body(self, identity: bytes, body: list) -> None:
        c = self._consumers.get(identity)
        if c is not None:
            c.last_seen = self.now
        header = self._header_or_report(body, CONSUMERS, identity, "consumer")
        if header is None:
            return
        kind = header["kind"]
        if kind == "heartbeat":
            self._heartbeat_to(CONSUMERS, identity, known=c is not None)
            return
        if kind == "credit":
            if c is not None:
                msg = self._decode_small(body, identity)
                if isinstance(msg, Credit):
                    c.in_flight = max(0, c.in_flight - msg.nbytes)
                    if c.queue:
                        self.ready.add(identity)
            return
        if kind not in ("subscribe", "unsubscribe", "steer"):
            self.counters["unexpected_kind"] += 1
            self._error_to(CONSUMERS, identity, "unexpected_kind", f"consumers may not send {kind!r} messages")
            return
        msg = self._decode_small(body, identity)
        if msg is None:
            return
        if isinstance(msg, Subscribe):
            self._on_subscribe(identity, c, msg, header["v"][1] >= _GAP_BATCH_MINOR)
        elif isinstance(msg, Unsubscribe):
            if c is not None:
                self._on_unsubscribe(c, msg)
        elif isinstance(msg, SteeringCommand):
            if c is None:
                c = self._consumers[identity] = _Consumer(identity, self.now)
            self._on_steering_command(c, msg, body)

    def _decode_small(self, body: list, identity: bytes):
        try:
            return decode(body, max_message_bytes=16 << 20)
        except WireError as e:
            self.counters["malformed"] += 1
            self.counters["malformed_from_consumers"] += 1
            self._error_to(CONSUMERS, identity, "malformed", str(e))
            return None

    def _on_subscribe(self, identity: bytes, c: _Consumer | None, msg: Subscribe, gap_batch: bool = False) -> None:
        if c is None:
            c = self._consumers[identity] = _Consumer(identity, self.now)
        if msg.consumer_id:
            c.name = msg.consumer_id
        c.gap_batch = gap_batch
        c.window = max(0, msg.window_bytes)
        c.batch = self.config.batch and msg.batch is True
        c.shm = self.accept_shm and msg.shm is True
        c.patterns = sorted(set(c.patterns) | set(msg.patterns))
        c.match_cache.clear()
        replay = []
        for s in self._streams.values():
            if not s.started or identity in s.subscribers or not c.matches(s.request_id):
                continue
            if msg.from_start:
                s.subscribers.add(identity)
                replay.append(s)
            elif not s.ended:
                s.subscribers.add(identity)
                if s.start is not None:  # (an analysis stream has none: it is delivered from its next message)
                    self._deliver_part(c, s.start)
                    if s.next_seq > 1:
                        self._enqueue_gap(c, s.key, [[1, s.next_seq - 1]], "joined_late")
        if replay:
            self._replay(c, replay)

    def _on_unsubscribe(self, c: _Consumer, msg: Unsubscribe) -> None:
        drop = set(msg.patterns)
        c.patterns = [p for p in c.patterns if p not in drop]
        c.match_cache.clear()
        for s in self._streams.values():
            if c.identity in s.subscribers and not c.matches(s.request_id):
                s.subscribers.discard(c.identity)
        # drops of requests it no longer wants are not announced (all pending drops go at its next message)
        c.drops = {key: ranges for key, ranges in c.drops.items() if c.matches(key[0])}

    # ------------------------------------------------------------------------------------------ steering

    def _refuse_command(self, c: _Consumer, command_id: str, request_id: str, error: str) -> None:
        self.counters["steering_refused"] += 1
        ack = SteeringAck(command_id, request_id, False, error=error, time_ns=self._wall_ns())
        self._enqueue_control(c, encode(ack))

    def _on_steering_command(self, c: _Consumer, cmd: SteeringCommand, body: list) -> None:
        self.counters["steering_commands"] += 1
        user = _user_id(body[1])
        refuse = lambda error: self._refuse_command(c, cmd.command_id, cmd.request_id, error)  # noqa: E731
        if not self.config.steering:
            return refuse("steering_disabled: this broker was started with steering off")
        if self._steer_ids is not None and user not in self._steer_ids:
            return refuse(f"not_authorised: key {user!r} is not in the broker's steer/ key dir")
        if cmd.command_id in self._pending:
            return refuse(f"duplicate_command: command id {cmd.command_id!r} is still pending")
        live = [s for s in map(self._streams.get, self._by_request.get(cmd.request_id, ()))
                if s is not None and s.started and not s.ended and not s.analysis]
        targets = {s.producer for s in live if not s.control_id}
        controls = {s.control_id for s in live if s.control_id}
        # A stream may name another producer (its engine's control peer) as the one that applies steering.
        targets |= {ident for ident, prod in self._producers.items() if prod.name.split("/")[0] in controls}
        if controls and not targets:
            return refuse("producer_unreachable: the engine that owns this request is not connected")
        if not targets:
            return refuse(f"unknown_request: no live stream of request {cmd.request_id!r}")
        cmd.sender = user or c.name
        frames = encode(cmd)
        self._pending[cmd.command_id] = _PendingCommand(c.identity, cmd.request_id, set(targets),
                                                        self.now + self.config.steer_timeout_s)
        for ident in sorted(targets):
            self.outbox.append((PRODUCERS, ident, frames, cmd.command_id))

    def _on_steering_ack(self, p: _Producer, body: list) -> None:
        try:
            ack = decode(body, max_message_bytes=16 << 20)
        except WireError as e:
            self.counters["malformed"] += 1
            return self._error_to(PRODUCERS, p.identity, "malformed", str(e))
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
                             producer_id=",".join(sorted({a.producer_id for a in acks})), time_ns=self._wall_ns())
        self._enqueue_control(c, encode(merged))

    # ------------------------------------------------------------------------------------------ upkeep

    def _housekeeping(self, now: float) -> None:
        cfg = self.config
        if len(self._evictable) > max(4096, 2 * sum(len(s.data) for s in self._streams.values())):
            self._prune_evictable()
        if self._shm is not None:
            if now - self._last_ring_prune >= 1.0:
                self._last_ring_prune = now
                self._shm.prune()  # mappings of rings whose producer is gone would keep their memory alive
            if self._closing_rings:
                self._remove_closing_rings(now)
            if now - self._last_ring_sweep >= _RING_SWEEP_S:  # rings of producers that died without closing
                self._last_ring_sweep = now
                self.counters["shm_rings_swept"] += sweep_stale_rings(self._shm.directory)
        if now - self._errors_since >= 1.0:
            self._errors_since = now
            self._errors.clear()
        if now - self._last_heartbeat >= cfg.heartbeat_s:
            self._last_heartbeat = now
            for ident in self._producers:
                self._heartbeat_to(PRODUCERS, ident, known=True)
            hb = self._heartbeat(known=True)
            for ident in self._consumers:
                self.outbox.append((CONSUMERS, ident, hb, None))
            for p in self._producers.values():
                t0, m0, b0 = p.snap
                dt = max(now - t0, 1e-9)
                p.rate = ((p.messages - m0) / dt, (p.bytes - b0) / dt)
                p.snap = (now, p.messages, p.bytes)
        for p in [p for p in self._producers.values() if p.held is not None and now >= p.held_until]:
            self._release_held(p)  # no heartbeat came with a proof: its ring references are refused
        for p in [p for p in self._producers.values() if now - p.last_seen > cfg.producer_timeout_s]:
            self._producer_lost(p, now)
        for c in [c for c in self._consumers.values() if now - c.last_seen > cfg.consumer_timeout_s]:
            self._forget_consumer(c, "consumers_timed_out")
        linger = cfg.late_join_linger_s
        for key in [k for k, s in self._streams.items() if s.ended and now - s.end_time > linger]:
            self._drop_stream(key)
        for key in [k for k, s in self._streams.items()
                    if not s.started and now - s.created > cfg.producer_timeout_s]:
            s = self._streams[key]  # frames whose start never came (not even re-announced): uninterpretable
            self.counters["orphan_messages"] += len(s.data) + len(s.ctl)
            self._drop_stream(key)
        for key in [k for k, s in self._streams.items()
                    if s.analysis and now - s.last_time > linger and not self._request_streams_live(k[0])]:
            self._drop_stream(key)  # forgotten with its request
        for cid in [k for k, pc in self._pending.items() if now > pc.deadline]:
            self._finish_command(cid, self._pending[cid], timed_out=True)

    def _request_streams_live(self, request_id: str) -> bool:
        """Whether the broker still keeps a (start/end) stream of ``request_id``."""
        return any(not self._streams[k].analysis for k in self._by_request.get(request_id, ()))

    def _producer_lost(self, p: _Producer, now: float) -> None:
        self.counters["producers_lost"] += 1
        (log.warning if p.streams else log.debug)(
            "producer %s lost: nothing heard for %.1f s; ending its %d open stream(s)", p.name,
            now - p.last_seen, len(p.streams))
        if p.held is not None:
            self._release_held(p)
        self._producers.pop(p.identity, None)
        for name in [n for n, owner in self._ring_owners.items() if owner == p.identity]:
            if name not in self._closing_rings:
                del self._ring_owners[name]
        for key in list(p.streams):
            s = self._streams.get(key)
            if s is None or s.ended:
                continue
            if not s.started:  # frames whose start never came: nobody could interpret them
                self.counters["orphan_messages"] += len(s.data) + len(s.ctl)
                self._drop_stream(key)
                continue
            rid, pid, epoch = key
            end = StreamEnd(rid, pid, epoch, s.next_seq, finish_reason="producer_lost",
                            error=f"the broker heard nothing from producer {p.name!r} for "
                                  f"{self.config.producer_timeout_s:g} s", time_ns=self._wall_ns())
            frames = encode(end)
            n = _frames_nbytes(frames)
            entry = _Entry("end", self._next_order(), frames, n, None)
            entry.key, entry.seq = key, s.next_seq
            part = (entry.order, s.next_seq, "end", entry, -1, n)
            s.next_seq += 1
            self._buffer(s, part)
            for ident in list(s.subscribers):
                c = self._consumers.get(ident)
                if c is not None:
                    self._deliver_part(c, part)
            self._end_stream(s)
        p.streams.clear()

    def _drop_stream(self, key: tuple) -> None:
        s = self._streams.pop(key)
        self._buffered_total -= s.buffered
        keys = self._by_request.get(key[0])
        if keys is not None:
            keys.discard(key)
            if not keys:
                del self._by_request[key[0]]
        self._closed[key] = None
        if len(self._closed) > _CLOSED_MEMORY:
            self._closed.popitem(last=False)
        for c in self._consumers.values():
            c.drops.pop(key, None)

    # ------------------------------------------------------------------------------------------ stats

    def stats(self, now: float) -> dict:
        """Counters: ``totals``, ``producers``, ``consumers``, ``streams`` (the broker adds its own section)."""
        totals = dict(self.counters)
        if self.messages_in:
            totals["messages_in"] = totals.get("messages_in", 0) + self.messages_in
            totals["bytes_in"] = totals.get("bytes_in", 0) + self.bytes_in
        return {
            "totals": totals,
            "producers": {p.name: {"frames_per_s": p.rate[0], "bytes_per_s": p.rate[1], "messages": p.messages,
                                   "bytes": p.bytes, "open_streams": len(p.streams),
                                   "gaps_reported": p.gaps_reported, "batches": p.batches, "reported": p.reported,
                                   "rings": sorted(n for n, o in self._ring_owners.items() if o == p.identity),
                                   "last_seen_s": now - p.last_seen}
                          for p in self._producers.values()},
            "consumers": {c.name: {"patterns": c.patterns, "queue_messages": len(c.queue),
                                   "queue_bytes": c.queue_bytes, "in_flight_bytes": c.in_flight,
                                   "window_bytes": c.window, "delivered": c.delivered,
                                   "delivered_bytes": c.delivered_bytes, "dropped": c.dropped,
                                   "gaps_notified": c.gaps_sent, "batch": c.batch, "batches": c.batches,
                                   "shm": c.shm,
                                   "pending_gaps": sum(b - a + 1 for rs in c.drops.values() for a, b in rs),
                                   "last_seen_s": now - c.last_seen}
                          for c in self._consumers.values()},
            "streams": {f"{s.key[0]}|{s.key[1]}|{s.key[2]}": {
                "request_id": s.key[0], "producer_id": s.key[1], "epoch": s.key[2], "messages": s.messages,
                "bytes": s.bytes, "next_seq": s.next_seq, "started": s.started, "ended": s.ended,
                "analysis": s.analysis, "buffered_bytes": s.buffered, "evicted": [list(r) for r in s.evicted],
                "subscribers": len(s.subscribers)} for s in self._streams.values()},
        }
