"""``mia-stream bridge``: one engine's local broker onto NATS JetStream, and steering back from NATS.

    mia-stream bridge --broker /tmp/mia-run --nats nats://hub:4222 --engine gpu07 [--kinds tokens analysis]

It subscribes to the broker as a consumer (every request, from what the broker still buffers), and publishes
each message of the chosen kinds, its wire bytes unchanged (``_wire.pack``), to the subjects of ``_wire``;
a payload over the server's max payload goes as chunks. Starts, ends and gaps always cross; a tensor or token
message of a kind not chosen crosses as a gap naming its seqs (``reason="not_bridged"``), so a consumer's seq
accounting stays exact. Analysis streams of a kind not chosen do not cross at all (they have no start to open).

Losses on the hop are named, never silent: every publish waits for JetStream's ack; one not acked within
``ack_timeout_s`` is published again under the same ``Nats-Msg-Id`` (the server drops a copy it already stored),
and a message still refused after ``retries`` tries (stream full, message too large, no server) is replaced by a
gap naming its request(s) and seq(s) with ``reason="bridge_refused: ..."``, ``origin="bridge"``. Gaps the broker
announced (a slow bridge) cross as they are.

Steering: commands published (NATS request/reply) to ``PREFIX-steer.ENGINE`` are sent to the broker and the
producer's ack is the reply. Who may send them is the NATS server's subject permissions (docs/nats.md): a
consumer identity without publish permission on ``PREFIX-steer.>`` gets ``not_authorised``.

Rule: ``Bridge`` owns its two broker clients (each used from its own one-thread executor: the reader and the
steering relay), its NATS connection, the publishes in flight (``_pending``, ``_acks``), those waiting to be
tried again (``_retry``), what it read while they wait (``_backlog``) and ``counters``.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import logging
import random
import signal
import socket
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Sequence

from mia_stream import metrics
from mia_stream.bridge import _wire
from mia_stream.bus.client import BrokerClient
from mia_stream.errors import BridgeError, BrokerTimeoutError, MiaStreamError, WireError
from mia_stream.schemas import (COLUMNAR_KINDS, GapBatch, GapNotice, SteeringAck, SteeringCommand, decode, encode)

log = logging.getLogger("mia_stream.bridge")

DEFAULT_MAX_AGE_S = 3600.0
DEFAULT_MAX_BYTES = 1 << 30  # reserved in the server's store when the stream is made
READ_BURST = 512
BACKLOG_BYTES = 256 << 20  # what a bridge holds while the stream cannot take messages (a failover)


def _nbytes(frames: list) -> int:
    return sum(len(f) for f in frames)


def default_engine_name() -> str:
    name = "".join(c if c.isalnum() or c in "_-" else "-" for c in socket.gethostname())
    return name or "engine"


def split_servers(url: str) -> list[str]:
    return [u.strip() for u in url.split(",") if u.strip()]


async def ensure_stream(js: Any, name: str, prefix: str, *, replicas: int = 1, max_age_s: float = DEFAULT_MAX_AGE_S,
                        max_bytes: int = DEFAULT_MAX_BYTES, max_msg_size: int | None = None) -> Any:
    """The JetStream stream ``name`` storing ``PREFIX.>``: made when missing (file storage, limits retention,
    oldest discarded past ``max_bytes`` / ``max_age_s``, a 2 min duplicate window for retried publishes)."""
    from nats.js import api
    from nats.js.errors import NotFoundError

    try:
        return await js.stream_info(name)
    except NotFoundError:
        pass
    cfg = api.StreamConfig(name=name, subjects=_wire.stream_subjects(prefix), retention=api.RetentionPolicy.LIMITS,
                           storage=api.StorageType.FILE, discard=api.DiscardPolicy.OLD, max_age=max_age_s,
                           max_bytes=max_bytes, num_replicas=replicas, duplicate_window=120.0,
                           max_msg_size=max_msg_size)
    return await js.add_stream(cfg)


def _transient(error: str) -> bool:
    """An error that a later try may not meet: no stream leader yet, no responders, a connection lost."""
    e = error.lower()
    return any(w in e for w in ("503", "no responders", "no ack within", "leader", "unavailable", "connection",
                                "cancelled", "timeout", "err_code 10008"))


class _Item:
    """One publish in flight: what to send again, and what to name lost if it never lands."""

    __slots__ = ("subject", "payload", "headers", "msg", "tries", "deadline", "future", "sent_ns", "gap", "first",
                 "retry_at", "token")

    def __init__(self, subject: str, payload: Any, headers: dict, msg: Any, gap: bool):
        self.subject, self.payload, self.headers, self.msg, self.gap = subject, payload, headers, msg, gap
        self.tries, self.deadline, self.future, self.sent_ns = 0, 0.0, None, 0
        self.first, self.retry_at, self.token = time.monotonic(), 0.0, ""


class Bridge:
    """One engine's broker onto a NATS JetStream stream (see the module doc)."""

    def __init__(self, broker: str | None, nats_url: str, *, engine: str | None = None,
                 kinds: Sequence[str] = _wire.DEFAULT_KINDS, prefix: str = _wire.DEFAULT_PREFIX,
                 stream: str = _wire.DEFAULT_STREAM, replicas: int = 1, max_age_s: float = DEFAULT_MAX_AGE_S,
                 max_bytes: int = DEFAULT_MAX_BYTES, max_msg_size: int | None = None, ack_timeout_s: float = 5.0,
                 retries: int = 3, give_up_s: float = 30.0, chunk_bytes: int | None = None, patterns: Sequence[str] = ("*",),
                 keys: Any = None, consumer_id: str | None = None):
        self.broker, self.servers = broker, split_servers(nats_url)
        if not self.servers:
            raise BridgeError("--nats: no server URL")
        self.engine = _wire.check_token(engine or default_engine_name(), "--engine")
        self.prefix = _wire.check_token(prefix, "--prefix")
        self.stream = _wire.check_token(stream, "--stream")
        self.kinds = _wire.wire_kinds(kinds)
        self.replicas, self.max_age_s, self.max_bytes, self.max_msg_size = replicas, max_age_s, max_bytes, max_msg_size
        self.ack_timeout_s, self.retries, self.chunk_bytes = ack_timeout_s, max(1, retries), chunk_bytes
        self.give_up_s = give_up_s
        self._retry: collections.deque[_Item] = collections.deque()  # transient failures, resent in order
        self._backlog: collections.deque = collections.deque()  # read from the broker while _retry blocks
        self._backlog_bytes = 0
        self.patterns, self.keys = tuple(patterns), keys
        self.consumer_id = consumer_id or f"bridge/{self.engine}"
        self.counters: collections.Counter[str] = collections.Counter()
        self.ack_seconds: collections.deque[float] = collections.deque(maxlen=100_000)  # publish -> JetStream ack
        self.instance = f"{random.getrandbits(48):012x}"
        self._n = 0
        self._pending: collections.deque[_Item] = collections.deque()
        self._acks: dict[str, tuple] = {}  # reply token -> (future, sent ns) of a publish waiting for its ack
        self._token = 0
        self._inbox = ""
        self._stop: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="bridge-reader")
        self._steerer = ThreadPoolExecutor(1, thread_name_prefix="bridge-steer")
        self._client: BrokerClient | None = None
        self._steer_client: BrokerClient | None = None
        self.nc: Any = None
        self.js: Any = None
        self.on_ready = None  # called once subscribed and connected (tests, the CLI's ready line)
        if metrics.enabled():
            metrics.watch("bridge", Bridge._metric_snapshot, {"engine": self.engine}, owner=self,
                          gauges=("pending_publishes", "ack_p50_s", "ack_p99_s"))

    def _metric_snapshot(self) -> dict:
        out = dict(self.counters)
        out["pending_publishes"] = len(self._pending)
        acks = sorted(list(self.ack_seconds)[-10_000:])
        if acks:
            out["ack_p50_s"] = acks[len(acks) // 2]
            out["ack_p99_s"] = acks[min(len(acks) - 1, int(len(acks) * 0.99))]
        return out

    # ------------------------------------------------------------------------------------------ run

    def run(self, duration_s: float | None = None) -> dict:
        """Bridge until SIGINT/SIGTERM (or ``duration_s``); then wait for the acks in flight. Its counters."""
        return asyncio.run(self.main(duration_s))

    async def main(self, duration_s: float | None = None) -> dict:
        import nats

        loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        self._loop = loop
        self._settle_lock = asyncio.Lock()
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                loop.add_signal_handler(sig, self._stop.set)
            except (ValueError, RuntimeError):  # not the main thread
                pass
        self._client = await loop.run_in_executor(self._reader, self._open_client, True)
        self._steer_client = await loop.run_in_executor(self._steerer, self._open_client, False)
        try:  # nats-py retries a first connect for ever when reconnects are unbounded: bound it here
            self.nc = await asyncio.wait_for(
                nats.connect(servers=self.servers, name=self.consumer_id, max_reconnect_attempts=-1,
                             reconnect_time_wait=0.2, connect_timeout=5, error_cb=self._on_error,
                             disconnected_cb=self._on_disconnect, reconnected_cb=self._on_reconnect,
                             pending_size=256 << 20), 20.0)
        except asyncio.TimeoutError as e:
            raise BridgeError(f"no NATS server answered at {', '.join(self.servers)} within 20 s") from e
        self.js = self.nc.jetstream()
        self._inbox = self.nc.new_inbox()
        await self.nc.subscribe(self._inbox + ".*", cb=self._on_ack)
        for attempt in range(100):  # a cluster still forming has no peers to place replicas on: wait for them
            try:
                await ensure_stream(self.js, self.stream, self.prefix, replicas=self.replicas,
                                    max_age_s=self.max_age_s, max_bytes=self.max_bytes, max_msg_size=self.max_msg_size)
                break
            except Exception as e:
                if attempt == 99 or not any(w in str(e) for w in ("10005", "10008", "timeout", "503")):
                    raise
                await asyncio.sleep(0.2)
        limit = self.nc.max_payload - _wire.HEADER_ROOM
        self.chunk_bytes = min(self.chunk_bytes or limit, limit)
        await self.nc.subscribe(_wire.steer_subject(self.prefix, self.engine), cb=self._on_steer)
        await self.nc.flush()
        reaper = asyncio.create_task(self._reap())
        if self.on_ready is not None:
            self.on_ready(self)
        t_end = None if duration_s is None else time.monotonic() + duration_s
        try:
            backlog = self._backlog
            while not self._stop.is_set() and (t_end is None or time.monotonic() < t_end):
                if self._retry:
                    # head-of-line: nothing newer goes out before what the stream refused for now (no leader
                    # during an election); what the broker sends meanwhile waits here, up to BACKLOG_BYTES, so a
                    # failover of a few seconds costs the broker's queue nothing
                    if self._backlog_bytes < BACKLOG_BYTES:
                        for frames, msg in await loop.run_in_executor(self._reader, self._read_burst):
                            backlog.append((frames, msg))
                            self._backlog_bytes += _nbytes(frames)
                    else:
                        await asyncio.sleep(0.02)
                    continue
                if backlog:
                    for _ in range(min(len(backlog), READ_BURST)):
                        frames, msg = backlog.popleft()
                        self._backlog_bytes -= _nbytes(frames)
                        await self._forward(frames, msg)
                        if self._retry:
                            break
                    continue
                got = await loop.run_in_executor(self._reader, self._read_burst)
                for frames, msg in got:
                    await self._forward(frames, msg)
        finally:
            await self._drain(10.0)
            reaper.cancel()
            await self.nc.drain()
            await loop.run_in_executor(self._reader, self._client.close)
            await loop.run_in_executor(self._steerer, self._steer_client.close)
            self._reader.shutdown()
            self._steerer.shutdown()
        return dict(self.counters)

    def stop(self) -> None:
        """Stop ``run`` from another thread."""
        if self._stop is not None and self._loop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)

    def _open_client(self, subscribe: bool) -> BrokerClient:
        c = BrokerClient(self.broker, consumer_id=self.consumer_id + ("" if subscribe else "/steer"), keys=self.keys,
                         shm=False)  # the broker inlines ring-held tensors: they cross to another host
        if subscribe:
            c.subscribe(self.patterns, from_start=True)
        return c

    def _read_burst(self) -> list:
        client = self._client
        got = client.recv(0.05)
        if got is None:
            return []
        out = [got]
        while len(out) < READ_BURST:
            nxt = client.recv(0)
            if nxt is None:
                break
            out.append(nxt)
        return out

    # ------------------------------------------------------------------------------------------ forwarding

    async def _forward(self, frames: list, msg: Any) -> None:
        kind = msg.KIND
        if kind in ("heartbeat", "steer_ack", "error", "subscribe", "unsubscribe", "credit", "steer"):
            self.counters[f"skipped_{kind}"] += 1
            return
        self.counters["received"] += 1
        if kind not in self.kinds:
            if kind in ("analysis", "analysis_batch"):
                self.counters["not_bridged_analysis"] += 1
                return
            msg = self._gap_for(msg, "not_bridged")
            self.counters["not_bridged"] += 1
            frames, kind = encode(msg), msg.KIND
        if kind in COLUMNAR_KINDS or kind == GapBatch.KIND:
            subject = _wire.batch_subject(self.prefix, self.engine, kind)
        else:
            subject = _wire.request_subject(self.prefix, self.engine, msg.request_id, kind)
        await self._publish(subject, _wire.pack(frames), msg, gap=kind in ("gap", "gap_batch"))

    def _gap_for(self, msg: Any, reason: str) -> GapNotice | GapBatch | None:
        """The gap naming what ``msg`` carried (None for a gap, which has no seq of its own)."""
        now = time.time_ns()
        if msg.KIND in COLUMNAR_KINDS:
            seqs = msg.seqs.tolist()
            return GapBatch.of(msg.producer_id, msg.epoch, [(r, [[s, s]]) for r, s in zip(msg.request_ids, seqs)],
                               reason, "bridge", now)
        if msg.KIND in ("gap", "gap_batch"):
            return None
        return GapNotice(msg.request_id, msg.producer_id, msg.epoch, [[msg.seq, msg.seq]], reason, "bridge", now)

    async def _publish(self, subject: str, payload: bytes, msg: Any, gap: bool = False) -> None:
        self._n += 1
        base = f"{self.engine}-{self.instance}-{self._n}"
        parts = _wire.chunks(payload, self.chunk_bytes) if len(payload) > self.chunk_bytes else [payload]
        if len(parts) > 1:
            self.counters["chunked_messages"] += 1
        for i, part in enumerate(parts):
            headers = {_wire.MSG_ID_HEADER: f"{base}-{i}" if len(parts) > 1 else base}
            if len(parts) > 1:
                headers[_wire.CHUNK_HEADER] = f"{base} {i} {len(parts)}"
            item = _Item(subject, part, headers, msg, gap)
            await self._send(item)
            if len(self._pending) > 2000 and not self._settle_lock.locked():
                await self._settle(wait=True)
        self.counters["published"] += 1
        self.counters["published_bytes"] += len(payload)

    async def _send(self, item: _Item) -> None:
        """Publish with a reply subject of our own: JetStream answers each with its ack or its error (our own
        reply table, as nats-py 2.16's publish_async never completes the future of an error answer)."""
        from nats.errors import Error as NatsError

        item.tries += 1
        item.sent_ns = time.monotonic_ns()
        item.deadline = time.monotonic() + self.ack_timeout_s
        loop = asyncio.get_running_loop()
        item.future = loop.create_future()
        self._token += 1
        token = item.token = str(self._token)
        self._acks[token] = (item.future, item.sent_ns)
        try:
            await self.nc.publish(item.subject, bytes(item.payload), reply=f"{self._inbox}.{token}",
                                  headers=dict(item.headers))
        except (NatsError, asyncio.TimeoutError, OSError) as e:
            self._acks.pop(token, None)
            item.future.set_exception(e)
        self.counters["publishes"] += 1
        self._pending.append(item)

    async def _on_ack(self, m: Any) -> None:
        got = self._acks.pop(m.subject.rsplit(".", 1)[-1], None)
        if got is None:
            return  # an ack after its timeout (the publish was retried under the same message id)
        fut, sent = got
        if fut.done():
            return
        status = (m.headers or {}).get("Status") if m.headers else None
        if status == "503":
            fut.set_exception(BridgeError("no JetStream stream took the message (503 no responders)"))
            return
        try:
            resp = json.loads(m.data)
        except ValueError:
            fut.set_exception(BridgeError(f"unreadable JetStream answer {bytes(m.data[:80])!r}"))
            return
        if "error" in resp:
            err = resp["error"]
            fut.set_exception(BridgeError(f"{err.get('description', err)} (err_code {err.get('err_code')})"))
            return
        self.ack_seconds.append((time.monotonic_ns() - sent) / 1e9)
        fut.set_result(resp)

    async def _settle(self, wait: bool = False) -> None:
        """Retire the publishes that are acked, in order; retry or name as lost those that failed or timed out.
        ``wait``: first wait for the oldest one (back-pressure once too many are in flight)."""
        async with self._settle_lock:
            await self._settle_locked(wait)

    async def _settle_locked(self, wait: bool) -> None:
        pending = self._pending
        while pending:
            item = pending[0]
            fut = item.future
            if not fut.done():
                left = item.deadline - time.monotonic()
                if left > 0:
                    if not wait:
                        return
                    wait = False
                    await asyncio.wait([fut], timeout=left)
                    continue
                fut.cancel()
                error = f"no ack within {self.ack_timeout_s:g} s"
            elif fut.cancelled():
                error = "cancelled"
            else:
                exc = fut.exception()
                error = None if exc is None else (str(exc) or type(exc).__name__)
            pending.popleft()
            self._acks.pop(item.token, None)  # an ack that never came (or came): its entry goes with the try
            if error is None:
                self.counters["acked"] += 1
                continue
            self.counters["publish_errors"] += 1
            if self.counters["publish_errors"] <= 5:
                log.warning("mia_stream bridge: publish to %s failed (try %d): %s", item.subject, item.tries, error)
            if _transient(error) and time.monotonic() - item.first < self.give_up_s:
                # no stream leader for now (an election after a node went), a reconnect: wait, keep order
                self.counters["retries"] += 1
                item.retry_at = time.monotonic() + min(1.0, 0.05 * 2 ** min(item.tries, 5))
                self._retry.append(item)
            elif item.tries < self.retries and "err_code 10054" not in error:  # 10054: too large, final
                self.counters["retries"] += 1
                await self._send(item)
            else:
                await self._lost(item, error)  # its gap goes through _publish, settled on a later pass

    async def _lost(self, item: _Item, error: str) -> None:
        self.counters["refused"] += 1
        log.warning("mia_stream bridge: a %s message to %s was refused: %s", item.msg.KIND, item.subject, error)
        if item.gap:
            self.counters["unannounced_loss"] += 1  # a gap message itself: the consumer's seq check names it
            return
        gap = self._gap_for(item.msg, f"bridge_refused: {error}"[:200])
        if gap is None:
            return
        self.counters["gaps_published"] += 1
        kind = gap.KIND
        subject = (_wire.batch_subject(self.prefix, self.engine, kind) if kind == "gap_batch"
                   else _wire.request_subject(self.prefix, self.engine, gap.request_id, kind))
        await self._publish(subject, _wire.pack(encode(gap)), gap, gap=True)

    async def _reap(self) -> None:
        while True:
            await asyncio.sleep(0.02 if self._retry else 0.1)
            try:
                while self._retry and self._retry[0].retry_at <= time.monotonic():
                    await self._send(self._retry.popleft())
                await self._settle()
            except Exception:  # never let the reaper die: it is what names losses
                log.exception("mia_stream bridge: settling publishes failed")

    async def _drain(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while self._backlog and time.monotonic() < deadline:  # read during a failover, not yet published
            if self._retry:
                await asyncio.sleep(0.02)
                continue
            frames, msg = self._backlog.popleft()
            self._backlog_bytes -= _nbytes(frames)
            await self._forward(frames, msg)
        self.counters["unpublished_at_exit"] += len(self._backlog)
        while (self._pending or self._retry) and time.monotonic() < deadline:
            await self._settle(wait=True)
            if self._retry and not self._pending:
                await asyncio.sleep(0.05)
        self.counters["unsettled_at_exit"] += len(self._pending)

    # ------------------------------------------------------------------------------------------ steering

    async def _on_steer(self, m: Any) -> None:
        loop = asyncio.get_running_loop()
        try:
            cmd = decode(_wire.unpack(m.data))
            if not isinstance(cmd, SteeringCommand):
                raise WireError(f"expected a steer message, got {cmd.KIND!r}")
        except (WireError, MiaStreamError) as e:
            self.counters["steer_malformed"] += 1
            await m.respond(_wire.pack(encode(SteeringAck("", "", False, error=f"malformed: {e}"))))
            return
        self.counters["steer_commands"] += 1
        try:
            ack = await loop.run_in_executor(self._steerer, self._steer_client.send_steering, cmd, 10.0)
        except BrokerTimeoutError as e:
            ack = SteeringAck(cmd.command_id, cmd.request_id, False, error=f"timeout: {e}")
        if not ack.ok:
            self.counters["steer_refused"] += 1
        await m.respond(_wire.pack(encode(ack)))

    # ------------------------------------------------------------------------------------------ callbacks

    async def _on_error(self, e: Exception) -> None:
        self.counters["nats_errors"] += 1
        n = self.counters["nats_errors"]
        if n <= 10 or n % 100 == 0:  # a server down is one error per reconnect attempt
            log.warning("mia_stream bridge: nats (error %d): %s", n, e)

    async def _on_disconnect(self) -> None:
        self.counters["nats_disconnects"] += 1

    async def _on_reconnect(self) -> None:
        """The acks of publishes in flight may have gone with the old server: try them again now (same message
        ids: what the stream already stored is dropped as a duplicate) instead of after their ack timeout."""
        self.counters["nats_reconnects"] += 1
        for item in self._pending:
            if item.future is not None and not item.future.done():
                item.future.set_exception(BridgeError("connection lost before the ack"))


def main(argv: list[str] | None = None) -> int:
    """``mia-stream bridge``: publish a local broker's streams to NATS JetStream; steering back."""
    ap = argparse.ArgumentParser(prog="mia-stream bridge", description=main.__doc__)
    ap.add_argument("--broker", help="the local broker's address (default $MIA_STREAM_BROKER or the run dir)")
    ap.add_argument("--nats", required=True, help="nats://host:4222 (comma-separate a cluster's nodes)")
    ap.add_argument("--engine", help="this engine's name in subjects (default: the host name)")
    ap.add_argument("--kinds", nargs="+", default=list(_wire.DEFAULT_KINDS), choices=sorted(_wire.KIND_GROUPS),
                    help="what crosses besides starts, ends and gaps (default: tokens analysis)")
    ap.add_argument("--patterns", nargs="+", default=["*"], help="request-id globs to bridge (default: all)")
    ap.add_argument("--prefix", default=_wire.DEFAULT_PREFIX, help="subject prefix (default mia)")
    ap.add_argument("--stream", default=_wire.DEFAULT_STREAM, help="JetStream stream (made when missing)")
    ap.add_argument("--replicas", type=int, default=1, help="the stream's replicas when this bridge makes it")
    ap.add_argument("--max-age", type=float, default=DEFAULT_MAX_AGE_S, help="retention in seconds (new stream)")
    ap.add_argument("--max-bytes", type=int, default=DEFAULT_MAX_BYTES, help="retention in bytes (new stream)")
    ap.add_argument("--keys", help="CURVE key dir for a tcp broker")
    ap.add_argument("--metrics-port", type=int, help="serve Prometheus metrics on this port (0: the setting)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    try:
        if args.metrics_port is not None:
            metrics.serve(args.metrics_port or None)
        bridge = Bridge(args.broker, args.nats, engine=args.engine, kinds=args.kinds, prefix=args.prefix,
                        stream=args.stream, replicas=args.replicas, max_age_s=args.max_age,
                        max_bytes=args.max_bytes, keys=args.keys, patterns=args.patterns)
        bridge.on_ready = lambda b: print(f"mia-stream bridge ready: engine {b.engine} -> {b.servers[0]} "
                                          f"stream {b.stream}", flush=True)
        counters = bridge.run()
    except (MiaStreamError, OSError) as e:
        print(f"mia-stream bridge: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # nats-py's errors (no server, a stream that cannot be made): one line, not a trace
        if type(e).__module__.startswith("nats"):
            print(f"mia-stream bridge: NATS: {type(e).__name__}: {e}", file=sys.stderr)
            return 2
        raise
    print(f"mia-stream bridge: {dict(counters)}", file=sys.stderr)
    return 0
