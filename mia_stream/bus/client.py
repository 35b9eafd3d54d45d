"""``BrokerClient``: the consumer's live transport (a DEALER to the broker's consumers endpoint).

It subscribes, receives decoded messages with a timeout, grants the broker credit (flow control: at most
``window_bytes`` in flight), heartbeats, re-subscribes by itself when the broker restarts (a new broker
instance, or a heartbeat saying it does not know us) and sends steering commands, waiting for their ack.
It subscribes with ``batch=True`` and unpacks the broker's batches: ``recv`` returns one message at a time.
Not thread-safe: use one client per thread.
"""

from __future__ import annotations

import collections
import logging
import os
import random
import time
import uuid
from typing import Any

import zmq

from mia_stream import metrics, settings
from mia_stream.bus import transport as _transport
from mia_stream.errors import BrokerTimeoutError, MalformedFrameError, SharedBufferError, SpecError, WireError
from mia_stream.schemas import (DEFAULT_MAX_MESSAGE_BYTES, Credit, ErrorNotice, GapBatch, GapNotice, Heartbeat,
                                Message, SteeringAck, SteeringCommand, Subscribe, Unsubscribe, decode, decode_header,
                                encode, references_shm, shm_extent, shm_loss_gaps, shm_loss_reason, split_batch,
                                parse_selection)
from mia_stream.bus.session import BrokerSession
from mia_stream.bus.shm_ring import ShmRingReader, shm_reachable

log = logging.getLogger("mia_stream.consumers")

DEFAULT_WINDOW_BYTES = 64 << 20
# A consumer that reads producers' rings: what it has in flight are positions in a ring its producer keeps
# overwriting, so the window bounds how stale a frame is when it is read, not memory (docs/bus.md)
DEFAULT_RING_WINDOW_BYTES = 16 << 20

_NOBLOCK, _zrecv, _recv_parts = _transport.NOBLOCK, _transport.zrecv, _transport.recv_parts
_references_shm = references_shm


def _nbytes(frames: list) -> int:
    n = 0
    for f in frames:
        n += len(f)
    return n


class BrokerClient:
    """A live connection to a broker's consumers endpoint. ``address``: see ``_transport.endpoints_for``."""

    def __init__(self, address: str | None = None, *, consumer_id: str | None = None, keys: Any = None,
                 window_bytes: int | None = None, heartbeat_s: float = _transport.HEARTBEAT_S,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, context: zmq.Context | None = None,
                 shm: bool | None = None, select: dict | None = None, zero_copy: bool | None = None):
        """``zero_copy`` (default: setting ``MIA_STREAM_SHM_ZERO_COPY``, on): tensors read from a producer's
        ring are read-only views of it, not copies; each such message carries a ``RingLease``
        (``ring_lease(msg)``) that says whether the ring still holds its bytes. ``select`` (schema 2.2): the layers, positions and tensors of each step batch this consumer wants
        (``{"layers": [15], "positions": "generated", "tensors": ["hs"]}``; spec 3.9), applied by the broker
        without copying tensor bytes; None = everything."""
        try:
            parse_selection(select)
        except MalformedFrameError as e:
            raise SpecError(f"BrokerClient(select=...): {e}") from None
        self.select = dict(select or {})
        self.endpoint = _transport.endpoints_for(address).consumers
        self.consumer_id = consumer_id or f"consumer-{os.getpid()}"
        self.heartbeat_s = heartbeat_s
        self.max_message_bytes = max_message_bytes
        self.instance = random.getrandbits(63)
        self.broker = BrokerSession(announce_on_first=False)  # what the broker's heartbeats said
        self.counters: collections.Counter[str] = collections.Counter()
        if metrics.enabled():  # its lag is the broker's queue for it (mia_stream_broker_consumer_queue_*)
            metrics.watch("consumer", lambda c: dict(c.counters), {"consumer": self.consumer_id}, owner=self)
        self.errors: collections.deque[ErrorNotice] = collections.deque(maxlen=100)
        self._patterns: list[str] = []
        self._subscribed = False
        self._unacked = 0
        self._stash: collections.deque[tuple[list, Message]] = collections.deque()
        # the rest of the last batch received; not part of the stash, which send_steering swaps out
        self._unbatched: collections.deque[tuple[list, Message]] = collections.deque()
        self._next_heartbeat = 0.0
        if zero_copy is None:
            zero_copy = settings.get_flag("MIA_STREAM_SHM_ZERO_COPY")
        # producers' rings (large tensors skip the broker on one host)
        self._shm = ShmRingReader(zero_copy=bool(zero_copy))
        # None: read producers' rings when on the broker's host (ipc); False: the broker sends every byte
        self._reads_shm = shm_reachable(self.endpoint) if shm is None else bool(shm)
        if window_bytes is None:
            window_bytes = DEFAULT_RING_WINDOW_BYTES if self._reads_shm else DEFAULT_WINDOW_BYTES
        self.window_bytes = max(0, int(window_bytes))
        self._ctx = context or zmq.Context.instance()
        keys = _transport.resolve_client_keys(keys, "consumer")
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.IDENTITY, f"{self.consumer_id}/{self.instance:x}".encode())
        _transport.configure(self._sock, sndhwm=10_000, rcvhwm=100_000, max_message_bytes=max_message_bytes)
        try:
            _transport.connect(self._sock, self.endpoint, keys)
        except Exception:
            self._sock.close(0)
            raise

    # ------------------------------------------------------------------------------------------ API

    def subscribe(self, patterns=("*",), from_start: bool = False) -> None:
        """Receive the streams whose request id matches any glob (fnmatch; ``*`` = all)."""
        patterns = [str(p) for p in patterns]
        self._patterns = sorted(set(self._patterns) | set(patterns))
        self._subscribed = True
        self._send(Subscribe(patterns, from_start, self.consumer_id, self.window_bytes, batch=True,
                             shm=self._reads_shm, select=self.select))

    def unsubscribe(self, patterns) -> None:
        patterns = [str(p) for p in patterns]
        self._patterns = [p for p in self._patterns if p not in patterns]
        self._send(Unsubscribe(patterns))

    def recv(self, timeout: float | None = None) -> tuple[list, Message] | None:
        """The next message (raw frames, decoded) or None after ``timeout`` seconds (None = wait forever).

        The raw frames are as received: tensors that came through a producer's shared-memory ring are
        referenced there, not inline (the decoded message holds a copy of their bytes, or with ``zero_copy``
        read-only views of the ring, valid while ``ring_lease(msg).intact()``; to keep raw frames for later, pass
        them through ``inline_shm`` at once, as the recorder does).

        Broker heartbeats are handled here and not returned; undecodable messages are counted and skipped.
        """
        if self._stash:
            return self._stash.popleft()
        if self._unbatched:
            return self._unbatched.popleft()
        deadline = None if timeout is None else time.monotonic() + timeout
        sock = self._sock
        while True:
            now = time.monotonic()
            if now >= self._next_heartbeat:
                self._heartbeat(now)
            wait = self._next_heartbeat - now
            if deadline is not None:
                wait = min(wait, deadline - now)
            try:
                frames = _recv_parts(sock)
            except zmq.Again:
                if wait <= 0 and deadline is not None and now >= deadline:
                    return None
                if not sock.poll(max(0, int(wait * 1000) + 1)):
                    if deadline is not None and time.monotonic() >= deadline:
                        return None
                continue
            got = self._accept(frames)
            if got is not None:
                return got

    def send_steering(self, cmd: SteeringCommand, timeout: float = 10.0) -> SteeringAck:
        """Send ``cmd`` through the broker to the request's producer; return its ack (ok or not)."""
        if not cmd.command_id:
            cmd.command_id = uuid.uuid4().hex
        cmd.time_ns = cmd.time_ns or time.time_ns()
        self._send(cmd)
        deadline = time.monotonic() + timeout
        held: list = []
        try:
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise BrokerTimeoutError(f"no ack for steering command {cmd.command_id} within {timeout:g} s")
                got = self._recv_raw(left)
                if got is None:
                    continue
                if isinstance(got[1], SteeringAck) and got[1].command_id == cmd.command_id:
                    return got[1]
                held.append(got)
        finally:
            self._stash.extend(held)

    def close(self) -> None:
        self._sock.close(0)
        self._shm.close()

    def __enter__(self) -> "BrokerClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------------------------------ internals

    def _recv_raw(self, timeout: float):
        """Like recv but bypassing the stash (used while waiting for an ack)."""
        stash, self._stash = self._stash, collections.deque()
        try:
            return self.recv(timeout)
        finally:
            stash.extend(self._stash)
            self._stash = stash

    def _accept(self, frames: list):
        """The first message ``frames`` carries (a batch's others are queued in order), or None."""
        try:
            messages = split_batch(frames)
        except WireError as e:
            self.counters["malformed"] += 1
            self._credit(_nbytes(frames[2:]))  # what the broker counted in flight for its messages
            log.warning("mia_stream consumer: skipped an undecodable batch: %s", e)
            return None
        if messages is None:
            messages = [frames]
        else:
            self.counters["batches"] += 1
        first = None
        for m in messages:
            got = self._accept_one(m)
            if got is None:
                continue
            if type(got) is list:  # a lost ring message: the gaps that replace it (maybe none)
                if got and first is None:
                    first, got = got[0], got[1:]
                self._unbatched.extend(got)
            elif first is None:
                first = got
            else:
                self._unbatched.append(got)
        return first

    def _accept_one(self, frames: list):
        """``(frames, message)``, or None (skipped), or a list of them (the gaps of a lost ring message)."""
        weight = None  # what the broker counted against the window for this message, when not its wire bytes
        try:
            if _references_shm(frames):
                # decoded straight from the producer's ring: one header unpack, and each tensor a view (zero_copy) or a copy
                shm = self._shm
                before = shm.bytes_read
                shm.take_lease()  # what a failed decode left
                try:
                    msg = decode(frames, max_message_bytes=self.max_message_bytes, shm=shm)
                except SharedBufferError as e:  # the ring no longer holds them: a gap in their place
                    return self._ring_loss(frames, e)
                except WireError:
                    weight = self._ring_weight(frames)
                    raise
                weight = _nbytes(frames) + shm.bytes_read - before
                lease = shm.take_lease()
                if lease is not None:  # its tensors view the ring: whoever hands them out checks the lease
                    msg._ring_lease = lease
            else:
                msg = decode(frames, max_message_bytes=self.max_message_bytes)
        except WireError as e:
            self.counters["malformed"] += 1
            self._credit(weight if weight is not None else _nbytes(frames))
            log.warning("mia_stream consumer: skipped an undecodable message: %s", e)
            return None
        if isinstance(msg, Heartbeat):
            self._on_heartbeat(msg)
            return None
        self._credit(weight if weight is not None else _nbytes(frames))
        self.counters["messages"] += 1
        if isinstance(msg, ErrorNotice):
            self.errors.append(msg)
            self.counters[f"error_{msg.code}"] += 1
            log.warning("mia_stream consumer: broker says %s: %s", msg.code, msg.message)
        return frames, msg

    def _ring_weight(self, frames: list, header: dict | None = None) -> int:
        """Wire bytes plus the ring bytes the header references: what the broker counted in flight."""
        if header is None:
            try:
                header = decode_header(frames, max_message_bytes=self.max_message_bytes)
            except WireError:
                return _nbytes(frames)
        extent = shm_extent(header)
        return _nbytes(frames) + (extent[2] if extent else 0)

    @property
    def zero_copy(self) -> bool:
        return self._shm.zero_copy

    @property
    def ring_bytes(self) -> dict:
        """Ring bytes this client took: ``copied`` out of rings and handed out as ``viewed`` (zero-copy)."""
        return {"copied": self._shm.bytes_copied, "viewed": self._shm.bytes_viewed}

    def _ring_loss(self, frames: list, error: SharedBufferError) -> list[tuple[list, GapNotice | GapBatch]]:
        """Credit a message whose ring-held bytes are gone (its weight, once); the gaps that take its place, as
        (frames, message): one GapBatch for a columnar message naming several requests, else a GapNotice. Cheap
        on purpose: a consumer far behind its producer meets many of these in a row."""
        header = decode_header(frames, max_message_bytes=self.max_message_bytes)
        gaps = shm_loss_gaps(header, error, "consumer")
        reason = shm_loss_reason(error)
        self.counters[reason] += 1
        # streams told of a loss (a gap batch names several)
        self.counters["ring_loss_gaps"] += sum(len(g.request_ids) if type(g) is GapBatch else 1 for g in gaps)
        self._credit(self._ring_weight(frames, header))
        if self.counters[reason] <= 10:
            log.warning("mia_stream consumer: lost a message's tensors: %s", error)
        return [(encode(g), g) for g in gaps]

    def _credit(self, n: int) -> None:
        if not self.window_bytes:
            return
        self._unacked += n
        if self._unacked * 2 >= self.window_bytes:
            self._send(Credit(self._unacked))
            self._unacked = 0

    def _heartbeat(self, now: float) -> None:
        self._next_heartbeat = now + self.heartbeat_s
        self._shm.prune()  # rings of producers gone for a while
        self._send(Heartbeat(self.consumer_id, "consumer", self.instance, time.time_ns()))

    @property
    def broker_instance(self) -> int | None:
        """The broker instance last heard (None until a broker has answered)."""
        return self.broker.instance

    def _on_heartbeat(self, hb: Heartbeat) -> None:
        news = self.broker.on_heartbeat(hb)
        if news.restarted:
            self.counters["broker_restarts_seen"] += 1
        if news.reannounce:
            # A broker that does not know us: subscribe again, from the start of what it holds, so frames
            # that reached it before we did are not lost (duplicates are dropped by seq).
            self._unacked = 0
            self.counters["resubscribed"] += 1
            self._send(Subscribe(list(self._patterns), True, self.consumer_id, self.window_bytes, batch=True,
                                 shm=self._reads_shm, select=self.select))

    def _send(self, msg: Message) -> None:
        try:
            self._sock.send_multipart(encode(msg), zmq.NOBLOCK)
        except zmq.Again:
            self.counters["send_dropped"] += 1
