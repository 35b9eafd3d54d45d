"""The broker's socket loop: receives from producers and consumers and sends what its routing core decides.

One thread, one ``zmq.Poller`` over three sockets (its zmq context has two I/O threads: one moves the
producers' bytes, the other the consumers'). Every routing rule lives in ``_routing.Router``, which sees no
socket; this shell only moves frames: it hands each received message to the router with the time, sends the
router's direct messages (``outbox``), and drains each consumer's queue within its credit window. Messages
are forwarded zero-copy: the received ``zmq.Frame`` objects are re-sent (only header frames are decoded).
"""

from __future__ import annotations

import gc
import json
import logging
import os
import random
import threading
import time
from typing import Any, Iterable

import msgpack
import zmq

from mia_stream import metrics
from mia_stream.bus import transport
from mia_stream.broker._config import CONSUMERS, PRODUCERS, BrokerConfig
from mia_stream.broker._routing import Router
from mia_stream.bus.shm_ring import ShmRingReader
from mia_stream.schemas import batch_header

log = logging.getLogger("mia_stream.broker")

_RECV_BATCH = 256  # stream messages handled per poll wake-up before consumers are flushed
_TICK_S = 0.05  # the router's housekeeping interval
# The late-join buffers keep ~2 tuples per request per message (200k-450k at 256 requests x 100 steps/s), and
# CPython's full collections walk them all: 20 -> 120 ms stalls every ~1.3 s, growing with the buffers, which
# made the consumers' p99 136-157 ms at a lossless 25,600 request-steps/s (scripts/bench_load.py). The router's
# state is acyclic (freed by reference counting), so a broker process moves what it holds out of the collector's
# sight once a second (gc.freeze); collections then walk at most a second of allocations.
GC_FREEZE_S = 1.0

_send_parts, _recv_parts = transport.send_parts, transport.recv_parts
_send_frame_lists = transport.send_frame_lists


class Broker:
    """Routes stream messages from producers to subscribed consumers; see docs/bus.md.

    Lifecycle: ``Broker(config)`` binds the sockets; ``run()`` serves until ``stop()`` (thread-safe);
    ``close()`` releases the sockets. ``run_broker_in_thread`` wraps all three for tests.
    """

    def __init__(self, config: BrokerConfig, *, context: zmq.Context | None = None, gc_freeze_s: float = 0.0):
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
        eps, keys = config.endpoints, config.keys
        if keys is not None:
            self._auth = transport.start_authenticator(self._ctx, keys)
        big = config.max_message_bytes
        try:
            self._prod = self._ctx.socket(zmq.ROUTER)
            if split_io:
                self._prod.setsockopt(zmq.AFFINITY, 1)
            # A batch (up to 1 MiB) is one zmq message: 256 bound what waits in zmq here; beyond that the
            # producers' byte budgets hold the backlog (and count what they drop).
            transport.configure(self._prod, sndhwm=1000, rcvhwm=256, max_message_bytes=big,
                                 router_mandatory=True)
            self._cons = self._ctx.socket(zmq.ROUTER)
            if split_io:
                self._cons.setsockopt(zmq.AFFINITY, 2)
            # SNDHWM: what zmq holds per consumer outside the router's accounting (a batch is one message of at
            # most 1 MiB; credit bounds it by bytes; for a consumer without a window this is the bound)
            transport.configure(self._cons, sndhwm=config.consumer_pipe_messages, rcvhwm=1000,
                                 max_message_bytes=16 << 20,
                                 router_mandatory=True)
            self._stats_sock = self._ctx.socket(zmq.REP)
            transport.configure(self._stats_sock, max_message_bytes=1 << 16)
            transport.bind(self._prod, eps.producers, keys, "producers")
            transport.bind(self._cons, eps.consumers, keys, "consumers")
            transport.bind(self._stats_sock, eps.stats, keys, "stats")
        except Exception:
            self._close_sockets()
            raise
        self._poller = zmq.Poller()
        for s in (self._prod, self._cons, self._stats_sock):
            self._poller.register(s, zmq.POLLIN)
        self._last_tick = 0.0
        self._gc_freeze_s = gc_freeze_s  # 0: leave the collector alone (a broker in a thread of another program)
        self._last_freeze = 0.0
        # Producers' rings: inlined for consumers that cannot read them, lag checks, ``received`` noted in each
        # ring's header (bounds how far its producer writes ahead), ownership proofs. Only on an ipc producers
        # endpoint: a peer on another host cannot have a ring here.
        accept_shm = config.shm and eps.producers.startswith("ipc://")
        self.router = Router(config, instance=self.instance, accept_shm=accept_shm,
                             shm=ShmRingReader(writable=True) if accept_shm else None,
                             steer_ids={k.decode("ascii") for k in keys.steer_public_keys} if keys else None,
                             roles=keys if keys is not None and keys.roles is not None else None,
                             flush=self._flush_one, now=self._started)

        if metrics.enabled():
            metrics.watch("broker", _metric_totals, owner=self, gauges=("late_join_buffer_bytes", "uptime_s"),
                          rows=_metric_rows)

    @property
    def counters(self):
        return self.router.counters

    # ------------------------------------------------------------------------------------------ lifecycle

    def stop(self) -> None:
        self._stop.set()

    def run(self) -> None:
        """Serve until ``stop()``; never raises on peer input (bad input is counted and reported)."""
        poll, router = self._poller.poll, self.router
        while not self._stop.is_set():
            now = time.monotonic()
            if now - self._last_tick >= _TICK_S:
                self._last_tick = now
                router.tick(now)
                self._send_outbox()
                if self._gc_freeze_s and now - self._last_freeze >= self._gc_freeze_s:
                    self._last_freeze = now
                    gc.freeze()
            try:
                events = dict(poll(1 if router.any_blocked() else 50))
            except zmq.ZMQError as e:
                if e.errno == zmq.ETERM:
                    return
                raise
            if self._prod in events:
                self._drain(self._prod, router.producer_message)
            if self._cons in events:
                self._drain(self._cons, router.consumer_message)
            if self._stats_sock in events:
                self._on_stats_request()
            if router.ready:
                self._flush_all()

    def close(self) -> None:
        self.router.close()
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

    # ------------------------------------------------------------------------------------------ sockets

    def _drain(self, sock: zmq.Socket, handler) -> None:
        """Hand up to ``_RECV_BATCH`` received messages to the router (one clock reading for all of them)."""
        router = self.router
        now = time.monotonic()
        first = router.messages_in
        for _ in range(_RECV_BATCH):
            try:
                frames = _recv_parts(sock)
            except zmq.Again:
                return
            handler(frames[0].bytes, frames[1:], now)
            if router.outbox:
                self._send_outbox()
            if router.messages_in - first >= _RECV_BATCH:  # a few producer batches: flush to consumers first
                return

    def _send_outbox(self) -> None:
        router = self.router
        while router.outbox:
            for dest, identity, frames, command_id in router.take_outbox():
                sock = self._prod if dest == PRODUCERS else self._cons
                try:
                    _send_parts(sock, identity, frames)
                except zmq.ZMQError as e:
                    if dest == CONSUMERS:
                        if e.errno == zmq.EHOSTUNREACH:  # its socket is gone: a dead or closed consumer
                            router.consumer_unreachable(identity)
                    elif command_id is not None:
                        router.producer_unreachable(identity, command_id)

    def _flush_all(self) -> None:
        for identity in list(self.router.ready):
            self._flush_one(identity)

    def _flush_one(self, identity: bytes) -> bool:
        """Hand ``identity``'s queue to zmq while its credit and zmq allow; False if it turned out to be gone.
        To a consumer that unpacks batches, consecutive ready messages go as one batch."""
        router, sock = self.router, self._cons
        while True:
            out = router.pending_send(identity)
            if out is None:
                return True
            messages, nbytes = out
            try:
                if len(messages) == 1:
                    _send_parts(sock, identity, messages[0])
                else:
                    _send_frame_lists(sock, [identity, b"", batch_header([len(f) for f in messages])], messages)
            except zmq.Again:
                router.blocked(identity)
                return True
            except zmq.ZMQError as e:
                if e.errno == zmq.EHOSTUNREACH:
                    router.consumer_unreachable(identity)
                    return False
                raise
            router.sent(identity, len(messages), nbytes)

    # ------------------------------------------------------------------------------------------ stats

    def stats(self) -> dict:
        """A snapshot of every counter (the stats endpoint's reply)."""
        now = time.monotonic()
        eps = self.config.endpoints
        out = self.router.stats(now)
        out["broker"] = {"instance": self.instance, "pid": os.getpid(), "uptime_s": now - self._started,
                         "endpoints": {"producers": eps.producers, "consumers": eps.consumers, "stats": eps.stats},
                         "curve": self.config.keys is not None, "steering": self.config.steering,
                         "batch": self.config.batch, "shm": self.router.accept_shm,
                         "late_join_buffer_bytes": self.router.buffered_bytes, "time_ns": time.time_ns()}
        return out

    def _on_stats_request(self) -> None:
        try:
            request = self._stats_sock.recv(zmq.NOBLOCK)
        except zmq.Again:
            return
        try:
            stats = self.stats()
            # peers' stats were made JSON-safe at intake (Peers._keep_reported); NaN would still not be JSON
            reply = (json.dumps(stats, allow_nan=False).encode() if request.strip() == b"json"
                     else msgpack.packb(stats))
        except Exception as e:  # a REP socket must answer, or it never serves the next request
            self.router.counters.stats_reply_failed += 1
            log.exception("broker: could not build the stats reply")
            error = {"error": f"stats reply failed: {type(e).__name__}"}
            reply = json.dumps(error).encode() if request.strip() == b"json" else msgpack.packb(error)
        try:
            self._stats_sock.send(reply, zmq.NOBLOCK)
        except zmq.ZMQError:
            self.router.counters.stats_reply_failed += 1


def _metric_totals(broker: "Broker") -> dict:
    """The router's counters, for mia_stream.metrics (read from the scrape thread: ints only)."""
    router = broker.router
    out = router.counters.as_dict()
    out["messages_in"] = out.get("messages_in", 0) + router.messages_in
    out["bytes_in"] = out.get("bytes_in", 0) + router.bytes_in
    out["late_join_buffer_bytes"] = router.buffered_bytes
    out["uptime_s"] = time.monotonic() - broker._started
    return out


def _metric_rows(broker: "Broker"):
    """Per consumer (its queue is its lag) and per producer, for mia_stream.metrics."""
    router = broker.router
    for c in list(router.delivery.consumers.values()):
        yield ("broker_consumer", {"consumer": c.name},
               {"queue_messages": len(c.queue), "queue_bytes": c.queue_bytes, "in_flight_bytes": c.in_flight,
                "delivered": c.delivered, "delivered_bytes": c.delivered_bytes, "dropped": c.dropped,
                "gaps_notified": c.gaps_sent}, ("queue_messages", "queue_bytes", "in_flight_bytes"))
    for p in list(router.peers.producers.values()):
        yield ("broker_producer", {"producer": p.name},
               {"messages": p.messages, "bytes": p.bytes, "open_streams": len(p.streams)}, ("open_streams",))


class run_broker_in_thread:
    """Run a ``Broker`` in a daemon thread: ``with run_broker_in_thread(config) as broker: ...``."""

    def __init__(self, config: BrokerConfig | None = None, **options: Any):
        if config is None:
            address = options.pop("address", None)
            config = BrokerConfig(transport.endpoints_for(address), **options)
        self.broker = Broker(config)
        self._thread = threading.Thread(target=self.broker.run, name="mia-stream-broker", daemon=True)

    def __enter__(self) -> Broker:
        self._thread.start()
        return self.broker

    def __exit__(self, *exc: Iterable) -> None:
        self.broker.stop()
        self._thread.join(5)
        self.broker.close()
