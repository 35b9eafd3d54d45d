"""``FramePublisher``: the producer's only bus object. ``publish()`` never blocks the engine.

Lifecycle: ``FramePublisher(address)`` starts a background sender thread that owns a DEALER socket
(identity ``producer_id/epoch``) connected to the broker's producers endpoint; ``publish(msg)`` encodes the
message in the caller's thread and appends it to a bounded in-process queue (a byte budget); the sender
thread sends it with NOBLOCK, several queued messages as one batch when the broker's heartbeats say it
accepts batches. ``close()`` drains for a moment and stops.

Sequence numbers belong to the caller: stamp each stream message with ``seq=publisher.next_seq(request_id)``
(StreamStart first, so it gets 0) and ``producer_id``/``epoch`` with ``publisher.producer_id``/``epoch``; a
columnar message (``StepBatch``, ``TokenBatch``, ``AnalysisBatch``: one message for many requests) holds one
seq of each request it names (``seqs=publisher.next_seqs(request_ids)``).
A message the queue has no room for is dropped and counted per stream and reason (a columnar message: for
every request it names); before the stream's next message (and at the latest before its StreamEnd) the
publisher announces the dropped seqs exactly (origin "producer"), consecutive ones as one range. The streams
whose gaps are announced at one point (those a message names, or all at a heartbeat) get, per reason, one
``GapBatch`` naming them all when the broker's heartbeats say it takes gap batches (schema 2.1), else one
``GapNotice`` each: a dropped step batch is then one message, not one per request it named (at saturation
those GapNotices were ~35% of the producer's samples and ~30% of the broker's, scripts/bench_load.py).
Counters: ``gap_notices`` and ``gap_batches`` (messages queued), ``gap_batch_streams`` (streams they named).
``drops_for(request_id)`` gives the counts by reason. The stream's StreamEnd carries the caller's count of
the messages it handed to ``publish`` (``frames_sent``, the end included) and of the seqs it dropped itself
(``frames_dropped``, e.g. the engine's, each named by a GapNotice); the publisher moves its own drops from
``frames_sent`` to ``frames_dropped`` (and adds them to ``drops``), so ``frames_sent + frames_dropped`` stays
the number of seqs the stream used.

Tensor frames and step batches are dropped first: they may use ``queue_bytes``; every other message (start,
tokens, token batches, end, gap, ack) may also use a reserve of ``queue_bytes // 16`` (at least 1 MiB) on top.

``publish(msg, borrowed=region)``: the message's tensors may view ``region`` (e.g. the drain's host ring),
which the caller reuses once ``publish`` returns; what of it does not go into the shared-memory ring is
copied here, once, into a buffer of the message's own.

With a shared-memory ring (tensors of 16 KiB and more, to a broker on this host) the sockets no longer push
back on a producer that outruns its broker, and the ring overwrites without waiting. So a tensor frame is
dropped at its source (reason ``shm_ahead_of_broker``) while the ring payloads this publisher has queued run
more than ``shm_ahead_bytes`` (default: a quarter of the ring) past what the broker has received, as the
broker records it in the ring's header (spec section 9): what reaches the broker is then recent enough to be
read before it is overwritten, instead of most of it arriving already lost.

Steering commands from consumers arrive through the broker: pass ``on_steering=callback`` (called in the
sender thread; keep it quick) or call ``poll_steering()``; answer each with ``ack(SteeringAck(...))``.
After a broker restart (a new broker instance in its heartbeats; ``bus.session.BrokerSession`` says so) the
publisher re-sends the StreamStart of every live stream with ``resent=True`` so the new broker knows them.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import random
import socket
import threading
import time
from typing import Any, Callable

import numpy as np
import zmq

from mia_stream import metrics, settings
from mia_stream.bus import transport as _transport
from mia_stream.errors import WireError
from mia_stream.schemas import (COLUMNAR_KINDS, DEFAULT_MAX_MESSAGE_BYTES, ErrorNotice, GapBatch, GapNotice,
                                Heartbeat, Message, SteeringAck, SteeringCommand, StreamEnd, StreamStart,
                                batch_header, decode, encode)
from mia_stream.schemas import seqranges
from mia_stream.bus.session import BrokerSession, Capabilities
from mia_stream.bus.shm_ring import DEFAULT_MIN_BYTES, DEFAULT_RING_BYTES, ShmRingWriter, shm_reachable

log = logging.getLogger("mia_stream.publisher")

DEFAULT_PUBLISHER_QUEUE_BYTES = 256 << 20
SHM_BYTES_ENV = "MIA_STREAM_SHM_BYTES"
SHM_AHEAD_ENV = "MIA_STREAM_SHM_AHEAD_BYTES"  # the source bound (default a quarter of the ring; 0: none)
# zmq messages zmq may hold beyond the byte-bounded queue (IMMEDIATE: none while disconnected). A batch is one
# zmq message of up to _transport.BATCH_BYTES, so this also bounds what batching moves from the queue into zmq
# (64 MiB).
_SNDHWM = 64
_ENDED_MEMORY = 10_000
_HELLO_S = 0.02  # heartbeat interval until the broker has answered once
_RING_HANDOVER_WAIT_S = 2.0  # close() waits this long at most for the broker to take the ring
# The broker's ``received`` has not moved for this long while we are past the bound: what was in flight is
# lost (e.g. a broker that restarted), so the bound starts over from what was queued last
_RING_AHEAD_STALL_S = 3.0
_REANNOUNCE_ENDED_S = 30.0  # ended streams re-announced (start + end) to a broker that restarted
_STREAM_KINDS = frozenset(("start", "tensors", "tokens", "end"))
_COLUMNAR_KINDS = COLUMNAR_KINDS  # one seq of each request they name
_BULK_KINDS = frozenset(("tensors", "step_batch"))  # dropped first; their payloads may go into the ring


def _env_bytes(name: str, default: int) -> int:
    value = settings.get_size(name)
    return default if value is None else value


def _own_borrowed(frames: list, region: Any) -> None:
    """Replace the buffer frames that lie inside ``region`` (memory the caller reuses) by copies."""
    base = np.frombuffer(region, np.uint8) if not isinstance(region, np.ndarray) else region
    lo = base.ctypes.data
    hi = lo + base.nbytes
    for i in range(2, len(frames)):
        f = frames[i]
        if type(f) is bytes or not len(memoryview(f)):
            continue
        addr = np.frombuffer(f, np.uint8).ctypes.data
        if lo <= addr < hi:
            frames[i] = bytes(f)


class _PubStream:
    __slots__ = ("request_id", "next_seq", "start", "ended", "end_sent", "end", "ended_at", "drops", "pending")

    def __init__(self, request_id: str):
        self.request_id = request_id
        self.next_seq = 0
        self.start: StreamStart | None = None
        self.ended = False
        self.end_sent = False  # its StreamEnd was handed to zmq
        self.end: StreamEnd | None = None
        self.ended_at = 0.0
        self.drops: collections.Counter[str] = collections.Counter()
        self.pending: dict[str, list[list[int]]] = {}  # reason -> dropped seq ranges not yet announced


class FramePublisher:
    """Publishes stream messages to the broker from a background thread; see the module docstring."""

    def __init__(self, address: str | None = None, *, producer_id: str | None = None, keys: Any = None,
                 queue_bytes: int = DEFAULT_PUBLISHER_QUEUE_BYTES,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, heartbeat_s: float = _transport.HEARTBEAT_S,
                 on_steering: Callable[[SteeringCommand], None] | None = None, compression: str = "none",
                 checksum: bool = False, shm_bytes: int | None = None, shm_min_bytes: int = DEFAULT_MIN_BYTES,
                 shm_ahead_bytes: int | None = None):
        self.endpoint = _transport.endpoints_for(address).producers
        self._keys = _transport.resolve_client_keys(keys, "producer")
        _transport.require_curve_for_tcp(self.endpoint, self._keys is not None, "connect to")
        self.producer_id = producer_id or f"{socket.gethostname()}:{os.getpid()}"
        self.epoch = random.getrandbits(63)
        self.queue_bytes = int(queue_bytes)
        self.control_reserve = max(1 << 20, self.queue_bytes // 16)
        self.max_message_bytes = max_message_bytes
        self.heartbeat_s = heartbeat_s
        self._on_steering = on_steering
        self._encode_opts = {"compression": compression, "checksum": checksum}
        self.shm_ring = self._open_ring(shm_bytes, shm_min_bytes)
        self._extra_proofs: list[dict] = []  # rings besides shm_ring this publisher references (add_ring_proof)
        self._heartbeats = 0
        self._ring_lock = threading.Lock()
        self._rings_taken: set[str] = set()  # names of the rings the broker said it took (at close)
        self._rings_taken_cond = threading.Condition()
        # ring bytes queued past what the broker has received before tensor frames are dropped (0: no bound)
        ring_size = self.shm_ring.size if self.shm_ring is not None else 0
        if shm_ahead_bytes is None:
            shm_ahead_bytes = _env_bytes(SHM_AHEAD_ENV, ring_size // 4)
        self.shm_ahead_bytes = int(shm_ahead_bytes)
        self._ring_sent_end = 0  # end position of the newest ring payload queued for the broker
        self._ring_baseline = 0  # the bound counts from here when the broker has not received past it
        self._ring_received_seen = 0
        self._ring_received_at = time.monotonic()
        self._lock = threading.Lock()
        self._queue: collections.deque[tuple[list, int, Any]] = collections.deque()  # (frames, nbytes, end-of)
        self._queued = 0
        self._sleeping = False
        self._closed = False
        self._streams: dict[str, _PubStream] = {}
        self._pending: set[str] = set()  # streams with dropped seqs not announced yet
        self._ended: collections.OrderedDict[str, _PubStream] = collections.OrderedDict()
        self._steering: collections.deque[SteeringCommand] = collections.deque(maxlen=10_000)
        self.counters: collections.Counter[str] = collections.Counter()
        if metrics.enabled():  # read at scrape time: stats() under its lock
            metrics.watch("publisher", FramePublisher._metric_snapshot, {"producer": self.producer_id}, owner=self,
                          gauges=("queue_bytes", "queue_messages", "open_streams", "shm_bytes_ahead_of_broker",
                                  "shm_ring_bytes"))
        self.broker = BrokerSession(announce_on_first=True)  # what the broker's heartbeats said (sender thread)
        # its capabilities as this publisher acts on them (attributes: publish() reads them for every message)
        self.broker_batches = False  # the broker's heartbeats say it accepts batches (sender thread only)
        self.broker_shm = False  # ... and that it takes tensors by shared-memory ring position (schema 1.3)
        self.broker_shm_received = False  # ... and that it records in the ring how far it has received
        self.broker_gap_batch = False  # ... and that it takes gap batches from producers (schema 2.1)
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._ctx = zmq.Context()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="mia-stream-publisher", daemon=True)
        self._thread.start()
        self._ready.wait(5)
        if self._error is not None:
            self.close(0)
            raise self._error

    # ------------------------------------------------------------------------------------------ caller side

    def next_seq(self, request_id: str) -> int:
        """The seq to stamp on the next message of ``request_id`` (0 for a new stream)."""
        with self._lock:
            st = self._streams.get(request_id)
            if st is None:
                st = self._streams[request_id] = _PubStream(request_id)
            seq = st.next_seq
            st.next_seq += 1
            return seq

    def next_seqs(self, request_ids) -> list[int]:
        """``next_seq`` of each of ``request_ids`` (the seqs of a columnar message), under one lock."""
        out = []
        with self._lock:
            streams = self._streams
            for rid in request_ids:
                st = streams.get(rid)
                if st is None:
                    st = streams[rid] = _PubStream(rid)
                out.append(st.next_seq)
                st.next_seq += 1
        return out

    copies_borrowed = True  # publish(..., borrowed=) is understood (the drain relies on it)
    takes_host_ring = True  # publish(..., host_ring=) too

    def add_ring_proof(self, proof: dict) -> None:
        """Prove to the broker that this publisher owns another ring (``{"ring": name, "secret": hex}``: the
        producer's host ring, whose references ``publish(..., host_ring=)`` sends); heartbeats take turns
        with this publisher's own ring's proof (the broker holds a reference up to 2 s for its proof)."""
        self._extra_proofs.append(proof)

    def publish(self, msg: Message, *, borrowed: Any = None, host_ring: Any = None) -> bool:
        """Queue ``msg`` for the broker; never blocks. False if it was dropped (counted, and announced).

        ``borrowed``: a buffer (e.g. a numpy array) the message's tensors may view and that the caller reuses
        after this returns; what of it stays inline is copied first (see the module docstring).
        ``host_ring``: a BufferSink over a ring the caller owns and proved (``add_ring_proof``) in which the
        message's large tensors already lie (the producer's host ring, issue 29): they are sent as references
        into it, no copy, when every one of them lies there (``host_ring.missed`` false) and the broker keeps
        the rings' ``received`` field; otherwise the message takes the usual way. ``host_ring.end`` is then
        nonzero exactly when references were queued."""
        kind = msg.KIND
        if kind in _STREAM_KINDS:
            rids, seqs = (msg.request_id,), (msg.seq,)
        elif kind in _COLUMNAR_KINDS:
            rids, seqs = msg.request_ids, msg.seqs.tolist()
        else:
            rids, seqs = (), ()
        if kind == "end":
            with self._lock:
                st = self._streams.get(msg.request_id)
                if st is not None and st.drops:  # the caller's drops (e.g. the engine's) plus the publisher's
                    drops = collections.Counter(msg.drops or {})
                    drops.update(st.drops)
                    mine = sum(st.drops.values())
                    msg.drops = dict(drops)
                    msg.frames_dropped = (msg.frames_dropped or 0) + mine
                    msg.frames_sent = max(0, (msg.frames_sent or 0) - mine)  # they were counted as sent
        ring = self.shm_ring
        ring_end = 0
        ahead = False
        frames = None
        if host_ring is not None:
            host_ring.begin()
            if kind in _BULK_KINDS and self.broker_shm_received:
                frames = encode(msg, **self._encode_opts, shm=host_ring)
                if host_ring.missed or not host_ring.bytes:  # not all in it: the usual way, nothing named
                    frames = None
                    host_ring.begin()
                else:  # the referenced bytes count against the budgets as if they were sent inline
                    n = _transport.frames_nbytes(frames) + host_ring.bytes
        if frames is None:
            if ring is not None and kind in _BULK_KINDS and self.broker_shm:
                ahead = self._ring_too_far_ahead(ring)
                if ahead:  # dropped below, before any byte is copied into the ring
                    n = 0
                else:
                    with self._ring_lock:
                        before = ring.bytes
                        frames = encode(msg, **self._encode_opts, shm=ring)
                        # what the ring holds counts against the budgets as if it were sent inline
                        n = _transport.frames_nbytes(frames) + ring.bytes - before
                        if ring.bytes != before:
                            ring_end = ring.written
            else:
                frames = encode(msg, **self._encode_opts)
                n = _transport.frames_nbytes(frames)
        if borrowed is not None and frames is not None and len(frames) > 2:
            _own_borrowed(frames, borrowed)
        with self._lock:
            self.counters["published"] += 1
            st = self._stream_of(rids[0], seqs[0], kind, msg) if kind in _STREAM_KINDS else None
            reason = None
            if self._closed:
                reason = "publisher_closed"
            elif ahead:
                reason = "shm_ahead_of_broker"
            elif n > self.max_message_bytes:
                reason = "oversized"
            elif self._queued and self._queued + n > (self.queue_bytes if kind in _BULK_KINDS
                                                       else self.queue_bytes + self.control_reserve):
                reason = "queue_full"
            if reason is not None:
                if host_ring is not None:
                    host_ring.begin()  # nothing of it was queued
                return self._drop(rids, seqs, reason)
            # streams that lost seqs before this message say so first (a columnar message names many: the
            # set of streams with unannounced drops is empty in the common case)
            if self._pending and not self._pending.isdisjoint(rids):
                pending = self._pending
                self._announce_gaps([rid for rid in rids if rid in pending])
            self._append(frames, n, end_of=st if kind == "end" else None)
            if host_ring is not None and host_ring.end:
                self.counters["host_ring_refs"] += 1
            if ring_end:
                self._ring_sent_end = ring_end
            if kind == "end" and st is not None:
                st.ended, st.end, st.ended_at = True, msg, time.monotonic()
                self._streams.pop(st.request_id, None)
                self._ended[st.request_id] = st
                if len(self._ended) > _ENDED_MEMORY:
                    self._ended.popitem(last=False)
            return True

    def ack(self, ack: SteeringAck) -> bool:
        """Send a steering acknowledgement back to the consumer that sent the command."""
        if not ack.producer_id:
            ack.producer_id = self.producer_id
        return self.publish(ack)

    def poll_steering(self) -> list[SteeringCommand]:
        """Steering commands received since the last call (when no ``on_steering`` callback is set)."""
        out = []
        while self._steering:
            out.append(self._steering.popleft())
        return out

    def forget(self, request_id: str) -> None:
        """Forget the seq counter of a stream that has no start (an analysis stream) once its request is over:
        a publisher that outlives many requests (an analyzer, an engine's detectors) keeps no state per old one.
        A stream whose drops are not yet announced stays until they are."""
        with self._lock:
            st = self._streams.get(request_id)
            if st is not None and st.start is None and not st.pending:
                del self._streams[request_id]

    def drops_for(self, request_id: str) -> dict[str, int]:
        """Messages of ``request_id`` this publisher dropped, by reason (e.g. ``{"queue_full": 3}``)."""
        with self._lock:
            st = self._streams.get(request_id) or self._ended.get(request_id)
            return dict(st.drops) if st is not None else {}

    def stats(self) -> dict:
        with self._lock:
            out = {"producer_id": self.producer_id, "epoch": self.epoch, "queue_bytes": self._queued,
                   "queue_messages": len(self._queue), "open_streams": sum(1 for s in self._streams.values()
                                                                          if s.start is not None),
                   **{k: v for k, v in self.counters.items()}}
        if self.shm_ring is not None and self.broker_shm_received:
            out["shm_bytes_ahead_of_broker"] = self._ring_ahead(self.shm_ring)
        return out

    def _metric_snapshot(self) -> dict:
        out = self.stats()
        out.pop("epoch", None)
        if self.shm_ring is not None:
            out["shm_ring_bytes"] = self.shm_ring.size
        return out

    def _ring_ahead(self, ring: ShmRingWriter) -> int:
        """Ring bytes queued for the broker beyond what it has received (read without the ring's lock: the
        fields are single aligned u64s, and a stale reading only moves a drop by one frame)."""
        received = ring.received
        if received != self._ring_received_seen:
            self._ring_received_seen, self._ring_received_at = received, time.monotonic()
        return max(0, self._ring_sent_end - max(received, self._ring_baseline))

    def _ring_too_far_ahead(self, ring: ShmRingWriter) -> bool:
        if not self.broker_shm_received or self.shm_ahead_bytes <= 0:
            return False
        if self._ring_ahead(ring) <= self.shm_ahead_bytes:
            return False
        if time.monotonic() - self._ring_received_at >= _RING_AHEAD_STALL_S:
            # the broker has received nothing of ours for a while although we are far ahead: what was in
            # flight is lost (it restarted, say); count from what was queued last
            self._ring_baseline = self._ring_sent_end
            self._ring_received_at = time.monotonic()
            self.counters["shm_ahead_resets"] += 1
            return False
        return True

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait until everything queued has been handed to zmq; False on timeout."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if not self._queued and not self._pending:
                    return True
            self._wake()
            time.sleep(0.002)
        return False

    def close(self, timeout: float = 1.0) -> None:
        """Drain for up to ``timeout`` s, then stop the sender thread and close the socket."""
        if timeout:
            self.flush(timeout)
        handed_over = timeout > 0 and self._hand_over_ring(timeout)
        with self._lock:
            self._closed = True
            self._linger_ms = int(max(0.0, timeout) * 1000)  # what zmq still holds gets this long to go out
        self._wake()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(5)
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass
        t0 = time.monotonic()
        self._ctx.term()  # returns early once zmq wrote all it held; at the linger's end it discards the rest
        linger_s = self._linger_ms / 1000
        linger_expired = bool(linger_s) and time.monotonic() - t0 >= 0.95 * linger_s
        if linger_expired:
            self.counters["close_linger_expired"] += 1
            log.warning("mia_stream publisher %s: the broker did not take all sent messages within %.1f s of close(); "
                        "zmq discarded what it still held (the broker ends those streams as producer_lost)",
                        self.producer_id, linger_s)
        if self.shm_ring is not None:
            with self._ring_lock:  # a ring the broker may not have been told about is removed here
                self.shm_ring.close(unlink=not handed_over or linger_expired)

    def _hand_over_ring(self, timeout: float) -> bool:
        """Offer the ring to the broker in a last heartbeat (spec section 9) and wait for its answer: a ring
        the broker took outlives this process for the broker's grace, so consumers a little behind still
        read the last frames; it is then the broker's to remove. Only a ring that was written to, only to a
        broker that takes rings; without an answer the ring is removed here at close, as before."""
        ring = self.shm_ring
        if ring is None or not ring.buffers or not self.broker_shm:
            return False

        def mark() -> None:
            with self._ring_lock:
                ring.mark_handed_over()

        return self._offer_ring(ring.name, mark, timeout)

    def hand_over_ring(self, name: str, mark_handed_over: Callable[[], None], timeout: float = _RING_HANDOVER_WAIT_S
                       ) -> bool:
        """Offer another ring this publisher proved (``add_ring_proof``; the producer's host ring) to the broker,
        as ``close`` offers its own: taken, it outlives its writers for the broker's grace, so consumers a little
        behind still read the last rows referenced in it, and the broker removes it. Whether it was taken (the
        caller removes the ring itself when not). Call before ``close``."""
        if not self.broker_shm or not any(p.get("ring") == name for p in self._extra_proofs):
            return False
        return self._offer_ring(name, mark_handed_over, timeout)

    def _offer_ring(self, name: str, mark_handed_over: Callable[[], None], timeout: float) -> bool:
        """Stamp the ring handed over, name it in a last heartbeat (``shm_ring_closed``) and wait for the broker's
        ``shm_ring_taken`` of it."""
        mark_handed_over()
        hb = Heartbeat(self.producer_id, "producer", self.epoch, time.time_ns(),
                       {**self.stats(), **Capabilities(ring_closed=name).to_stats()})
        frames = encode(hb)
        with self._lock:
            self._append(frames, _transport.frames_nbytes(frames))
        self._wake()
        with self._rings_taken_cond:
            return self._rings_taken_cond.wait_for(lambda: name in self._rings_taken,
                                                   min(timeout, _RING_HANDOVER_WAIT_S))

    def _open_ring(self, shm_bytes: int | None, min_bytes: int) -> ShmRingWriter | None:
        """The shared-memory ring for large tensor buffers: only to a broker on this host (ipc), where
        /dev/shm is writable; ``shm_bytes`` (default: ``MIA_STREAM_SHM_BYTES`` or 256 MiB) 0 disables it."""
        if shm_bytes is None:
            shm_bytes = _env_bytes(SHM_BYTES_ENV, DEFAULT_RING_BYTES)
        if shm_bytes <= 0 or not shm_reachable(self.endpoint):
            return None
        try:
            return ShmRingWriter(shm_bytes, min_bytes)
        except OSError as e:  # e.g. /dev/shm full: tensors go inline, as they would without a ring
            log.warning("mia_stream publisher: no shared-memory ring (%s); tensors are sent inline", e)
            return None

    def __enter__(self) -> "FramePublisher":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------------------------------ internals (lock held)

    def _stream_of(self, rid: str, seq: int, kind: str, msg: Message) -> _PubStream:
        st = self._streams.get(rid)
        if st is None:
            st = self._streams[rid] = _PubStream(rid)
            st.next_seq = seq + 1
        if kind == "start":
            st.start = msg
            st.ended = False
        return st

    def _drop(self, rids, seqs, reason: str) -> bool:
        """Count a dropped message; each stream it held a seq of announces that seq before its next message."""
        self.counters["dropped"] += 1
        self.counters[f"dropped_{reason}"] += 1
        streams, pending = self._streams, self._pending
        for rid, seq in zip(rids, seqs):
            st = streams.get(rid)
            if st is None:  # a stream whose seqs the caller stamped without next_seq (e.g. a replay)
                st = streams[rid] = _PubStream(rid)
                st.next_seq = seq + 1
            st.drops[reason] += 1
            pending.add(rid)
            seqranges.add_seq(st.pending.setdefault(reason, []), seq)
        return False

    def _announce_gaps(self, rids) -> None:
        """Queue what streams ``rids`` (each with unannounced drops) lost: per (producer, epoch, reason), one
        GapBatch naming all of them to a broker that takes gap batches, else a GapNotice per stream."""
        groups: dict[tuple, list] = {}  # (producer id, epoch, reason) -> [(request id, missing ranges)]
        for rid in rids:
            self._pending.discard(rid)
            st = self._streams.get(rid)
            if st is None:
                continue
            start = st.start
            pid, epoch = (start.producer_id, start.epoch) if start is not None else (self.producer_id, self.epoch)
            for reason, missing in st.pending.items():
                named = groups.get((pid, epoch, reason))
                if named is None:
                    groups[(pid, epoch, reason)] = [(rid, missing)]
                else:
                    named.append((rid, missing))
            st.pending = {}
        now_ns = time.time_ns()
        for (pid, epoch, reason), named in groups.items():
            if len(named) > 1 and self.broker_gap_batch:
                gaps = [GapBatch.of(pid, epoch, named, reason, "producer", now_ns)]
                self.counters["gap_batches"] += 1
                self.counters["gap_batch_streams"] += len(named)
            else:
                gaps = [GapNotice(rid, pid, epoch, missing, reason, "producer", now_ns) for rid, missing in named]
                self.counters["gap_notices"] += len(gaps)
            for gap in gaps:
                frames = encode(gap)
                self._append(frames, _transport.frames_nbytes(frames))

    def _append(self, frames: list, n: int, front: bool = False, end_of: _PubStream | None = None) -> None:
        if front:
            self._queue.appendleft((frames, n, end_of))
        else:
            self._queue.append((frames, n, end_of))
        self._queued += n
        if self._sleeping:
            self._sleeping = False
            self._wake_locked()

    def _wake_locked(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass

    def _wake(self) -> None:
        with self._lock:
            self._wake_locked()

    # ------------------------------------------------------------------------------------------ sender thread

    def _run(self) -> None:
        try:
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.IDENTITY, f"{self.producer_id}/{self.epoch:x}".encode())
            _transport.configure(sock, sndhwm=_SNDHWM, rcvhwm=10_000, immediate=True)
            _transport.connect(sock, self.endpoint, self._keys)
        except BaseException as e:  # surfaced by __init__
            self._error = e
            self._ready.set()
            return
        self._ready.set()
        try:
            self._loop(sock)
        except zmq.ContextTerminated:
            pass
        except Exception:
            log.exception("mia_stream publisher: sender thread failed; publish() will keep dropping")
        finally:
            sock.close(linger=getattr(self, "_linger_ms", 0))

    def _loop(self, sock: zmq.Socket) -> None:
        poller = zmq.Poller()
        poller.register(self._wake_r, zmq.POLLIN)
        poller.register(sock, zmq.POLLIN)
        next_heartbeat = next_hello = 0.0
        blocked = False
        while True:
            blocked = self._send_queued(sock)
            now = time.monotonic()
            # until the broker answers (its heartbeat says what it accepts: batches, shared memory), say hello
            # often: the first heartbeats are lost while the connection is still being made
            hello = self.broker_instance is None and now >= next_hello
            if hello:
                next_hello = now + _HELLO_S
            if now >= next_heartbeat:
                next_heartbeat = now + self.heartbeat_s
                self._send_heartbeat(sock)
                self._announce_idle_gaps()
            elif hello:
                self._send_heartbeat(sock)
            wake_at = next_heartbeat if self.broker_instance is not None else min(next_heartbeat, next_hello)
            with self._lock:
                if self._closed:
                    if self._queue:  # close() gave up waiting: what is left is dropped, and counted
                        self.counters["dropped"] += len(self._queue)
                        self.counters["dropped_publisher_closed"] += len(self._queue)
                        self._queue.clear()
                        self._queued = 0
                    return
                idle = not self._queue
                self._sleeping = idle or blocked
            timeout_ms = max(0, int((wake_at - time.monotonic()) * 1000)) if (idle or blocked) else 0
            poller.modify(sock, zmq.POLLIN | (zmq.POLLOUT if blocked else 0))
            events = dict(poller.poll(timeout_ms))
            with self._lock:
                self._sleeping = False
            if self._wake_r in events:
                try:
                    while os.read(self._wake_r, 4096):
                        pass
                except (BlockingIOError, OSError):
                    pass
            if events.get(sock, 0) & zmq.POLLIN:
                self._receive(sock)

    def _send_queued(self, sock: zmq.Socket) -> bool:
        """Hand queued messages to zmq until it pushes back; True if it did (EAGAIN).

        To a broker that accepts batches, consecutive queued messages go as one batch (up to
        ``_transport.BATCH_MESSAGES`` / ``BATCH_BYTES``): zmq's per-message cost is then paid once for all of them.
        """
        with self._lock:
            queue, self._queue = self._queue, collections.deque()
        sent = count = batches = 0
        blocked = False
        max_group = _transport.BATCH_MESSAGES if self.broker_batches else 1
        while queue:
            group, total = _transport.batch_span(queue, max_group)
            batch = [queue[i][0] for i in range(group)]
            try:
                _transport.send_frame_lists(sock, [b"", batch_header([len(f) for f in batch])] if group > 1 else [],
                                            batch)
            except zmq.Again:
                blocked = True
                break
            for _ in range(group):
                end_of = queue.popleft()[2]
                if end_of is not None:
                    end_of.end_sent = True
            sent += total
            count += group
            if group > 1:
                batches += 1
        self.counters["sent"] += count
        self.counters["sent_bytes"] += sent  # wire bytes (ring-held tensors not counted: they are not sent)
        if batches:
            self.counters["batches_sent"] += batches
        with self._lock:
            self._queued -= sent
            if queue:
                queue.extend(self._queue)
                self._queue = queue
        return blocked

    def _announce_idle_gaps(self) -> None:
        """A heartbeat announces every stream's pending drops (as one batch per reason), when the queue has
        room for them (~64 bytes a stream on the wire); else the next heartbeat tries again."""
        with self._lock:
            pending = self._pending
            if pending and self._queued + 4096 + 64 * len(pending) <= self.queue_bytes + self.control_reserve:
                self._announce_gaps(list(pending))

    def _send_heartbeat(self, sock: zmq.Socket) -> None:
        stats = self.stats()
        # the broker takes a ring's references only from its proven owner: one proof a heartbeat, in turn
        proofs = ([self.shm_ring.ownership_proof()] if self.shm_ring is not None else []) + self._extra_proofs
        if proofs:
            self._heartbeats += 1
            stats.update(Capabilities(ring_proof=proofs[self._heartbeats % len(proofs)]).to_stats())
        hb = Heartbeat(self.producer_id, "producer", self.epoch, time.time_ns(), stats)
        try:
            sock.send_multipart(encode(hb), zmq.NOBLOCK)
        except zmq.Again:
            pass

    def _receive(self, sock: zmq.Socket) -> None:
        for _ in range(1000):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            try:
                msg = decode(frames, max_message_bytes=16 << 20)
            except WireError as e:
                self.counters["malformed_from_broker"] += 1
                log.warning("mia_stream publisher: undecodable message from the broker: %s", e)
                continue
            if isinstance(msg, Heartbeat):
                self._on_broker_heartbeat(msg)
            elif isinstance(msg, SteeringCommand):
                self.counters["steering_commands"] += 1
                if self._on_steering is None:
                    self._steering.append(msg)
                else:
                    try:
                        self._on_steering(msg)
                    except Exception:
                        log.exception("mia_stream publisher: on_steering callback failed")
            elif isinstance(msg, ErrorNotice):
                self.counters[f"broker_error_{msg.code}"] += 1
                if self.counters[f"broker_error_{msg.code}"] <= 10:
                    log.warning("mia_stream publisher: broker refused a message: %s: %s", msg.code, msg.message)
            else:
                self.counters["unexpected_from_broker"] += 1

    @property
    def broker_instance(self) -> int | None:
        """The broker instance last heard (None until a broker has answered)."""
        return self.broker.instance

    def _on_broker_heartbeat(self, hb: Heartbeat) -> None:
        news = self.broker.on_heartbeat(hb)
        caps = self.broker.capabilities
        if caps.ring_taken:
            with self._rings_taken_cond:
                self._rings_taken.add(caps.ring_taken)
                self._rings_taken_cond.notify_all()
        self.broker_batches = caps.batch is True
        self.broker_shm = caps.shm is True
        self.broker_shm_received = self.broker_shm and caps.shm_received is True
        self.broker_gap_batch = caps.gap_batch is True
        if news.first or news.restarted:  # a new broker has received nothing that was on its way to the old one
            self._ring_baseline = self._ring_sent_end
        if not news.reannounce:
            return
        # A broker that may not know our streams (a restart; the first heartbeat of a broker that may have
        # missed the original starts; or one that got frames of a stream it has no start for): re-announce.
        # A broker that knew them ignores the copies (counted as duplicate_starts / after_end).
        if news.restarted:
            self.counters["broker_restarts_seen"] += 1
        self.counters["reannounced"] += 1
        now = time.monotonic()
        with self._lock:
            out: list[Message] = []
            for st in self._streams.values():
                if st.start is not None:
                    out.append(dataclasses.replace(st.start, resent=True))
            for st in self._ended.values():  # recently ended: the new broker may hold its frames unstarted
                if st.start is not None and st.end is not None and now - st.ended_at < _REANNOUNCE_ENDED_S:
                    out.append(dataclasses.replace(st.start, resent=True))
                    if st.end_sent:  # else the end is still queued behind its frames: it will go out in order
                        out.append(st.end)
            for msg in reversed(out):
                frames = encode(msg, **self._encode_opts)
                self._append(frames, _transport.frames_nbytes(frames), front=True)


def make_publisher(producer_id: str, on_command=None, **publisher_options) -> FramePublisher:
    """The bus client of one producer (worker rank or engine-core control), connected to the broker that
    ``MIA_STREAM_BROKER`` names."""
    return FramePublisher(settings.get_address(_transport.ENV_BROKER), producer_id=producer_id,
                          on_steering=on_command, **publisher_options)
