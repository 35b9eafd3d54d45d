"""``NatsClient``: the consumer SDK's source for ``nats://`` URLs, with the interface of ``bus.client.BrokerClient``
(``subscribe``, ``recv``, ``send_steering``, ``counters``, ``close``), so ``open_stream("nats://hub:4222")``,
``open_batches``, ``Consumer`` and the monitor give the same events as from a local broker.

    nats://[user:password@]host:4222[,nats://host2:4222...]   every engine of the stream
    nats://host:4222?stream=MIA&prefix=mia&engine=gpu07       a query names the stream, prefix and engines
    options: stream="MIA", prefix="mia", engines=["gpu07"]    (or keyword arguments of open_stream)

Reading: an ephemeral JetStream pull consumer over the engines' subjects, in stream order; it remembers the last
stream sequence it got and, when its server goes (a cluster node killed, a reconnect), makes a new consumer from
the next one: nothing is skipped or read twice. Request globs are applied here: a per-request message by its
subject (no decode), a columnar one narrowed to the matching requests (``schemas.select_requests``).

Late join: ``from_start=True`` reads what the stream retains from its first message. ``from_start=False`` reads
the starts and ends the stream holds, opens every live request with its start and then reads from the stream's
end; a live request's first message after its start is preceded by ``GapNotice(reason="joined_late")`` naming the
seqs in between, as the local broker does.

Each start is tagged with the engine it came from (``StreamStart.tags["engine"]``, unless the request set one);
``engine_of(request_id)`` says where its steering goes. Request ids are assumed unique across engines.

Rule: ``NatsClient`` owns its loop thread, NATS connection and pull task (which own nothing else), the queue
between them, the chunk reassembler, the late-join table (``_late``) and ``counters``.
"""

from __future__ import annotations

import asyncio
import collections
import fnmatch
import logging
import os
import queue
import time
import uuid
from typing import Any, Sequence
from urllib.parse import parse_qsl, unquote, urlsplit

from mia_stream import metrics
from mia_stream.bridge import _wire
from mia_stream.bridge._loop import LoopThread
from mia_stream.errors import BrokerTimeoutError, BridgeError, SteeringCommandError, WireError
from mia_stream.schemas import (DEFAULT_MAX_MESSAGE_BYTES, ErrorNotice, GapNotice, Message, SteeringAck,
                                SteeringCommand, decode, decode_header, encode, select_requests)

log = logging.getLogger("mia_stream.consumers")

FETCH_BATCH = 256
FETCH_BYTES = 32 << 20  # what one fetch asks for at most (nats-py drops deliveries past 256 MiB pending)
QUEUE_LIMIT = 64  # fetched batches waiting for recv: past it the pull task waits (JetStream keeps the rest)


def is_nats_url(source: Any) -> bool:
    return isinstance(source, str) and source.startswith(("nats://", "tls://"))


def parse_url(url: str) -> tuple[list[str], str | None, str | None, dict]:
    """``(servers, user, password, options)``: nats-py takes credentials apart from the URLs; ``options`` from
    a query (``?stream=MIA&prefix=mia&engine=gpu07&engine=gpu08``) on any of them."""
    servers, user, password, options = [], None, None, {}
    for part in url.split(","):
        part = part.strip()
        if not part:
            continue
        u = urlsplit(part if "://" in part else "nats://" + part)
        if u.username:
            user, password = unquote(u.username), unquote(u.password or "")
        for k, v in parse_qsl(u.query):
            if k not in ("stream", "prefix", "engine"):
                raise BridgeError(f"{url!r}: unknown option {k!r} (stream, prefix, engine)")
            if k == "engine":
                options.setdefault("engine", []).append(v)
            else:
                options[k] = v
        servers.append(f"{u.scheme}://{u.hostname}:{u.port or 4222}")
    if not servers:
        raise BridgeError(f"no NATS server in {url!r}")
    return servers, user, password, options


class NatsClient:
    """The streams of a NATS JetStream stream, as a ``BrokerClient`` gives a broker's (see the module doc)."""

    zero_copy = False  # its tensors arrive inside NATS messages, owned: no shared-memory ring to lease

    def __init__(self, url: str, *, consumer_id: str | None = None, stream: str | None = None,
                 prefix: str | None = None, engines: Sequence[str] | None = None,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, connect_timeout: float = 10.0, **_ignored: Any):
        import nats

        servers, user, password, options = parse_url(url)
        stream = stream or options.get("stream") or _wire.DEFAULT_STREAM
        prefix = prefix or options.get("prefix") or _wire.DEFAULT_PREFIX
        engines = engines or options.get("engine")
        self.url = url
        self.consumer_id = consumer_id or f"consumer-{os.getpid()}"
        self.stream, self.prefix = _wire.check_token(stream, "stream"), _wire.check_token(prefix, "prefix")
        self.engines = [_wire.check_token(e, "engine") for e in engines] if engines else None
        self.max_message_bytes = max_message_bytes
        self.counters: collections.Counter[str] = collections.Counter()
        self.errors: collections.deque[ErrorNotice] = collections.deque(maxlen=100)
        self.engine_by_request: dict[str, str] = {}
        self.last_stream_seq = 0
        self.pending = 0  # messages JetStream still holds for this consumer (its lag), as of the last fetch
        self._patterns: list[str] = []
        self._q: queue.Queue = queue.Queue(QUEUE_LIMIT)
        self._ready: collections.deque = collections.deque()
        self._chunks = _wire.Reassembler()
        self._late: dict[tuple, int] = {}  # live stream key -> its start's seq, until its first message after
        self._denied: list[str] = []
        self._task = None
        self._closing = False
        self._lt = LoopThread("mia-nats-consumer")
        self._reconnected = False
        opts = dict(servers=servers, name=self.consumer_id, max_reconnect_attempts=-1, reconnect_time_wait=0.2,
                    connect_timeout=connect_timeout, error_cb=self._on_error, allow_reconnect=True,
                    reconnected_cb=self._on_reconnect)
        if user is not None:
            opts.update(user=user, password=password)
        try:
            self.nc = self._lt.run(nats.connect(**opts), timeout=connect_timeout + 5)
        except Exception as e:
            self._lt.stop()
            raise BridgeError(f"cannot connect to NATS at {url}: {e}") from e
        self.js = self.nc.jetstream()
        if metrics.enabled():
            metrics.watch("nats_consumer", NatsClient._metric_snapshot, {"consumer": self.consumer_id}, owner=self,
                          gauges=("lag_messages", "last_stream_seq", "fetched_batches_waiting"))

    def _metric_snapshot(self) -> dict:
        # lag: what JetStream holds for this consumer past its last fetch, and fetches not yet read by recv
        return {**self.counters, "lag_messages": self.pending, "fetched_batches_waiting": self._q.qsize(),
                "last_stream_seq": self.last_stream_seq}

    # ------------------------------------------------------------------------------------------ API

    def subscribe(self, patterns=("*",), from_start: bool = False) -> None:
        self._patterns = sorted(set(self._patterns) | {str(p) for p in patterns})
        if self._task is None:
            start = self._lt.run(self._begin(from_start), timeout=60)
            self._task = self._lt.submit(self._pull(start))

    def unsubscribe(self, patterns) -> None:
        self._patterns = [p for p in self._patterns if p not in set(patterns)]

    def recv(self, timeout: float | None = None) -> tuple[list, Message] | None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if self._ready:
                return self._ready.popleft()
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return None
            try:
                batch = self._q.get(timeout=left)
            except queue.Empty:
                return None
            if isinstance(batch, BaseException):
                raise BridgeError(f"reading NATS stream {self.stream}: {batch}") from batch
            for subject, headers, data, late_start in batch:
                self._accept(subject, headers, data, late_start)

    def engine_of(self, request_id: str) -> str | None:
        return self.engine_by_request.get(request_id)

    def send_steering(self, cmd: SteeringCommand, timeout: float = 10.0) -> SteeringAck:
        """Send ``cmd`` to the engine that streams its request, over NATS request/reply; the producer's ack.
        ``ok=False`` with ``not_authorised: ...`` when the NATS server refuses this identity the steer subject."""
        from nats.errors import NoRespondersError, TimeoutError as NatsTimeout

        engine = self.engine_by_request.get(cmd.request_id)
        if engine is None:
            raise SteeringCommandError(f"request {cmd.request_id!r}: no engine known for it (no start seen yet)")
        if not cmd.command_id:
            cmd.command_id = uuid.uuid4().hex
        cmd.time_ns = cmd.time_ns or time.time_ns()
        subject = _wire.steer_subject(self.prefix, engine)
        n_denied = len(self._denied)
        try:
            reply = self._lt.run(self.nc.request(subject, _wire.pack(encode(cmd)), timeout=timeout), timeout + 5)
        except (NatsTimeout, NoRespondersError, asyncio.TimeoutError) as e:
            time.sleep(0.05)  # a permissions violation arrives as an async error, after the publish
            denied = [d for d in self._denied[n_denied:] if subject in d or "steer" in d]
            if denied:
                return SteeringAck(cmd.command_id, cmd.request_id, False,
                                   error=f"not_authorised: the NATS server refused {subject}: {denied[0]}")
            raise BrokerTimeoutError(f"no ack for steering command {cmd.command_id} via {subject} "
                                     f"within {timeout:g} s ({type(e).__name__})") from e
        ack = decode(_wire.unpack(reply.data), max_message_bytes=self.max_message_bytes)
        if not isinstance(ack, SteeringAck):
            raise WireError(f"steering reply of kind {ack.KIND!r}")
        return ack

    def close(self) -> None:
        self._closing = True
        if self._task is not None:  # the pull task ends (and unsubscribes) before the connection closes
            self._task.cancel()
            try:
                self._task.result(timeout=5)
            except BaseException:  # CancelledError, or what made it stop
                pass
        try:
            self._lt.run(self.nc.close(), timeout=5)
        except Exception:
            pass
        self._lt.stop()

    def __enter__(self) -> "NatsClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------------------------------ reading

    def _filters(self, part: str = "*") -> list[str]:
        return _wire.engine_filters(self.prefix, self.engines, part)

    async def _begin(self, from_start: bool) -> int:
        """The stream sequence to read from; for a late join, queue the live requests' starts first."""
        from nats.js.errors import NotFoundError

        try:
            info = await self.js.stream_info(self.stream)
        except NotFoundError as e:
            raise BridgeError(f"NATS has no stream {self.stream!r} (no bridge has made it yet)") from e
        if from_start:
            return max(1, info.state.first_seq)
        last = info.state.last_seq
        if last == 0:
            return 1
        starts: dict[tuple, tuple] = {}
        ended: set = set()
        for subject, headers, data in await self._read_range(self._filters("s") + self._filters("e"), last):
            payload = data
            if headers and _wire.CHUNK_HEADER in headers:
                payload = self._chunks.add(subject, headers[_wire.CHUNK_HEADER], data)
                if payload is None:
                    continue
            try:
                msg = decode(_wire.unpack(payload), max_message_bytes=self.max_message_bytes)
            except WireError:
                self.counters["malformed"] += 1
                continue
            key = (msg.request_id, msg.producer_id, msg.epoch)
            if msg.KIND == "start":
                starts[key] = (subject, None, payload)
            elif msg.KIND == "end":
                ended.add(key)
        live = [v for k, v in starts.items() if k not in ended]
        self.counters["late_join_live"] += len(live)
        if live:
            await asyncio.get_running_loop().run_in_executor(None, self._q.put, [(*v, True) for v in live])
        return last + 1

    async def _read_range(self, filters: list[str], last: int) -> list:
        """Every message of ``filters`` with stream sequence <= ``last``."""
        from nats.errors import TimeoutError as NatsTimeout
        from nats.js import api

        cfg = api.ConsumerConfig(deliver_policy=api.DeliverPolicy.ALL, ack_policy=api.AckPolicy.NONE,
                                 filter_subjects=filters, inactive_threshold=30.0, mem_storage=True, num_replicas=1)
        sub = await self.js.pull_subscribe(filters[0], stream=self.stream, config=cfg)
        out = []
        try:
            while True:
                try:
                    msgs = await sub.fetch(FETCH_BATCH, timeout=1.0)
                except (NatsTimeout, asyncio.TimeoutError):
                    break
                done = False
                for m in msgs:
                    if m.metadata.sequence.stream > last:
                        done = True
                        break
                    out.append((m.subject, m.headers, m.data))
                if done or (msgs and msgs[-1].metadata.num_pending == 0):
                    break
        finally:
            await sub.unsubscribe()
        return out

    async def _pull(self, start: int) -> None:
        """Read from stream sequence ``start`` on, for ever; a new consumer from where it stopped after an error."""
        from nats.errors import TimeoutError as NatsTimeout
        from nats.js import api

        loop = asyncio.get_running_loop()
        next_seq = start
        while not self._closing:
            sub = None
            try:
                cfg = api.ConsumerConfig(deliver_policy=api.DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=next_seq,
                                         ack_policy=api.AckPolicy.NONE, filter_subjects=self._filters(),
                                         inactive_threshold=30.0, mem_storage=True, num_replicas=1)
                sub = await asyncio.wait_for(
                    self.js.pull_subscribe(cfg.filter_subjects[0], stream=self.stream, config=cfg), 10.0)
                self.counters["consumers_made"] += 1
                idle = 0
                consumer_seq = 0  # the last delivery of this consumer: each is numbered, so a drop shows
                avg = 1024.0  # bytes per message, so one fetch stays under FETCH_BYTES
                while not self._closing:
                    batch_n = max(1, min(FETCH_BATCH, int(FETCH_BYTES // avg)))
                    try:
                        msgs = await sub.fetch(batch_n, timeout=1.0)
                    except (NatsTimeout, asyncio.TimeoutError):  # nats-py raises either when nothing came
                        if self._reconnected:  # its server may be gone, and our consumer with it: make a new one
                            self._reconnected = False
                            raise BridgeError("reconnected to NATS")
                        idle += 1
                        if idle % 5 == 0:  # quiet, or its consumer died with a server: this raises if gone
                            await asyncio.wait_for(sub.consumer_info(), 10.0)
                        continue
                    idle = 0
                    batch = []
                    dropped = False
                    for m in msgs:
                        meta = m.metadata
                        if meta.sequence.consumer != consumer_seq + 1 and consumer_seq:
                            # the client dropped deliveries (a slow consumer past its pending limit): read them
                            # again from the stream with a new consumer, from the first one not taken
                            dropped = True
                            break
                        consumer_seq = meta.sequence.consumer
                        avg = 0.9 * avg + 0.1 * len(m.data)
                        seq = meta.sequence.stream
                        if seq < next_seq:
                            self.counters["stream_duplicates"] += 1
                            continue
                        if seq > next_seq:
                            # sequences of other subjects, or ones the stream's limits removed: not ours to know
                            self.counters["stream_seq_skipped"] += seq - next_seq
                        next_seq = seq + 1
                        batch.append((m.subject, m.headers, m.data, False))
                    if msgs:
                        self.pending = msgs[-1].metadata.num_pending
                        self.last_stream_seq = next_seq - 1
                    if batch:
                        await loop.run_in_executor(None, self._q.put, batch)
                    if dropped:
                        self.counters["client_drops_reread"] += 1
                        raise BridgeError("deliveries dropped by the client: reading them again")
            except asyncio.CancelledError:
                raise
            except Exception as e:  # a server gone, a consumer lost: start over from next_seq
                if self._closing:
                    return
                self.counters["consumer_restarts"] += 1
                (log.info if isinstance(e, (asyncio.TimeoutError, NatsTimeout)) else log.warning)("mia_stream consumer: NATS read from seq %d failed (%s: %s); reading again", next_seq,
                            type(e).__name__, e)
                await asyncio.sleep(0.2)
            finally:
                if sub is not None:
                    try:
                        await asyncio.wait_for(sub.unsubscribe(), 2.0)
                    except Exception:
                        pass

    # ------------------------------------------------------------------------------------------ decoding

    def _accept(self, subject: str, headers: dict | None, data: bytes, late_start: bool = False) -> None:
        self.counters["nats_messages"] += 1
        try:
            engine, part, name = _wire.parse_subject(subject)
            if part != "b" and not self._matches(_wire.request_from_token(name)):
                self.counters["filtered"] += 1
                return
            if headers and _wire.CHUNK_HEADER in headers:
                data = self._chunks.add(subject, headers[_wire.CHUNK_HEADER], data)
                if data is None:
                    return
                self.counters["chunked_messages"] += 1
            frames = _wire.unpack(data)
            if part == "b":
                frames = self._narrow(frames)
                if frames is None:
                    return
            msg = decode(frames, max_message_bytes=self.max_message_bytes)
        except (WireError, ValueError, UnicodeDecodeError) as e:
            self.counters["malformed"] += 1
            log.warning("mia_stream consumer: skipped an undecodable NATS message on %s: %s", subject, e)
            return
        self.counters["messages"] += 1
        kind = msg.KIND
        if kind == "start":
            self.engine_by_request[msg.request_id] = engine
            if "engine" not in msg.tags:
                msg.tags["engine"] = engine
            if late_start:
                self._late[(msg.request_id, msg.producer_id, msg.epoch)] = msg.seq
        elif self._late and kind in ("tensors", "tokens", "end"):
            self._joined_late(msg.request_id, msg.producer_id, msg.epoch, msg.seq)
        elif self._late and kind in ("step_batch", "token_batch"):
            for rid, seq in zip(msg.request_ids, msg.seqs.tolist()):
                self._joined_late(rid, msg.producer_id, msg.epoch, seq)
        self._ready.append((frames, msg))

    def _joined_late(self, rid: str, pid: str, epoch: int, seq: int) -> None:
        start_seq = self._late.pop((rid, pid, epoch), None)
        if start_seq is not None and seq > start_seq + 1:
            gap = GapNotice(rid, pid, epoch, [[start_seq + 1, seq - 1]], "joined_late", "consumer", time.time_ns())
            self._ready.append((encode(gap), gap))

    def _matches(self, request_id: str) -> bool:
        pats = self._patterns
        return "*" in pats or any(fnmatch.fnmatchcase(request_id, p) for p in pats)

    def _narrow(self, frames: list) -> list | None:
        """A columnar message narrowed to the requests the globs match (None: none of them)."""
        if "*" in self._patterns:
            return frames
        header = decode_header(frames, max_message_bytes=self.max_message_bytes)
        ids = header.get("request_ids") or []
        keep = [i for i, rid in enumerate(ids) if self._matches(rid)]
        if not keep:
            self.counters["filtered"] += 1
            return None
        if len(keep) == len(ids):
            return frames
        return select_requests(frames, header, keep)[0]

    async def _on_reconnect(self) -> None:
        self._reconnected = True
        self.counters["nats_reconnects"] += 1

    async def _on_error(self, e: Exception) -> None:
        text = str(e)
        if "permissions violation" in text.lower():
            self._denied.append(text)
        self.counters["nats_errors"] += 1
