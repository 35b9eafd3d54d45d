"""The consumer SDK: one API for live streams (from a broker) and recordings (replay).

    for event in open_stream(source, patterns=("*",)):
        if event.kind == "frame":
            hs = event.frame.tensors["hs"]          # [layers, tokens, hidden], float32 for bf16

or subclass ``Consumer`` and hand it to ``run_consumer``. ``source`` is a broker address (a run dir with
the broker's sockets, ``ipc://...``, ``tcp://...``; None = ``$MIA_STREAM_BROKER`` or the default run dir) or
the path of a recording (a file, or a directory without broker sockets), or ``nats://host:4222`` (the streams
bridges publish to NATS JetStream: ``mia_stream.bridge``, docs/nats.md). Events (``_events``: one class per
kind, each with its ``kind`` string): "start", "frame", "tokens", "analysis", "gap", "end" (see ``_assemble``
for ordering, gap and TP-merge rules).

Vectorized consumers take whole steps instead (no per-request event is built for tensors and tokens):

    for event in open_batches(source, patterns=("*",)):
        if event.kind == "batch" and event.batch.KIND == "step_batch":
            hs = event.batch.tensor("hs")           # [layers, rows of every request, hidden]

or override ``Consumer.on_batch``; "start", "gap" and "end" stay per request.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import time
import uuid
import logging
from pathlib import Path
from typing import Any, Iterator

from mia_stream.consumers._assemble import StreamAssembler
from mia_stream.consumers._events import (EVENT_CLASSES, EVENT_KINDS, AnalysisEvent, BatchEvent, EndEvent, Event,
                                          FrameEvent, GapEvent, RequestStream, StartEvent, TokensEvent)
from mia_stream.consumers._frames import StepFrame
from mia_stream.consumers._tp_merge import merge_shards
from mia_stream.consumers._batch_ops import subset_batch
from mia_stream.consumers._ring_views import OVERRUN_BEFORE_HANDOUT, OVERRUN_IN_USE, intact, leases_of, overrun_gaps
from mia_stream.bus.client import BrokerClient
from mia_stream.bridge import REORDER_OPTIONS, NatsClient, is_nats_url
from mia_stream.errors import MiaStreamError, SteeringCommandError, StreamError
from mia_stream.schemas import SteeringAck, SteeringCommand

__all__ = ["AnalysisEvent", "BatchEvent", "BrokerClient", "Consumer", "EVENT_CLASSES", "EVENT_KINDS", "EndEvent",
           "Event", "EventStream", "FrameEvent", "GapEvent", "RequestStream", "StartEvent", "StepFrame",
           "StreamAssembler", "TokensEvent", "consume_main", "dispatch", "merge_shards", "open_batches", "open_stream",
           "run_consumer", "subset_batch", "wants_batches"]

logger = logging.getLogger("mia_stream.consumers")
_IDLE_TICK_S = 0.05


def _is_recording(source: Any) -> bool:
    if source is None:
        return False
    s = str(source)
    if "://" in s:
        return False
    p = Path(s)
    if p.is_file():
        return True
    if p.suffix == ".mcap" and not p.exists():  # a recording's name, not a run dir: waiting for it would be forever
        raise StreamError(f"no recording at {s}: no such file")
    if p.is_dir():
        return not any((p / f"{r}.sock").exists() for r in ("consumers", "producers"))
    return False


class _Source:
    """Events from a live broker or a recording; ``client`` is the BrokerClient when live."""

    def __init__(self, source: Any, patterns=("*",), from_start: bool = False, *, consumer_id: str | None = None,
                 keys: Any = None, window_bytes: int | None = None, shm: bool | None = None, batches: bool = False,
                 select: dict | None = None, zero_copy: bool | None = None, **nats_options: Any):
        self.source, self.patterns, self.from_start = source, tuple(patterns), from_start
        self.assembler = StreamAssembler(batches=batches, **(REORDER_OPTIONS if is_nats_url(source) else {}))
        self.client: BrokerClient | NatsClient | None = None
        if is_nats_url(source):  # stream, prefix, engines: NatsClient's options
            if select:
                raise StreamError("select= narrows a local broker's step batches; a nats:// source carries them whole")
            self.client = NatsClient(source, consumer_id=consumer_id, **nats_options)
            self.client.subscribe(self.patterns, from_start)
        elif not _is_recording(source):
            if source is not None and "://" not in str(source) and not Path(str(source)).exists():
                logger.warning("no broker at %s yet: waiting for one to start there (a recording must be an "
                               "existing .mcap file or directory)", source)
            self.client = BrokerClient(source, consumer_id=consumer_id, keys=keys, window_bytes=window_bytes,
                                       shm=shm, select=select, zero_copy=zero_copy)
            self.client.subscribe(self.patterns, from_start)
        elif select:
            raise StreamError("select= narrows a live broker's step batches; a recording is read whole")

    def events(self, timeout: float | None = None) -> Iterator[Event]:
        """Yield events; live: stop after ``timeout`` s without any (None = never); replay: at its end."""
        if self.client is None:
            from mia_stream.consumers.recording import iter_recording

            for _frames, msg in iter_recording(self.source, patterns=self.patterns):
                yield from self.assembler.feed(msg)
            yield from self.assembler.finish()
            return
        asm, client = self.assembler, self.client
        last = time.monotonic()
        while True:
            tick = _IDLE_TICK_S if asm.holding else 0.5
            if timeout is not None:
                tick = min(tick, max(0.0, last + timeout - time.monotonic()))
            got = client.recv(tick)
            now = time.monotonic()
            events = asm.feed(got[1], now) if got is not None else []
            if asm.holding:
                events += asm.flush(now)
            if events:
                last = now
                if client.zero_copy:
                    yield from self._checked(events)
                else:
                    yield from events
            elif timeout is not None and now - last >= timeout:
                return

    def _checked(self, events: list) -> Iterator[Event]:
        """``events``, each of whose tensors view a ring checked when handed out and when released (the consumer
        asks for the next event: its callback returned); an overwrite is a counted gap (``_ring_views``)."""
        counters = self.client.counters
        for ev in events:
            leases = leases_of(ev)
            if not leases:
                yield ev
                continue
            if not intact(leases):  # overwritten while the assembler held it: never handed out
                gaps = overrun_gaps(ev, OVERRUN_BEFORE_HANDOUT, self.assembler)
                if not counters[OVERRUN_BEFORE_HANDOUT]:
                    worst = max(leases, key=lambda lease: lease.lag())
                    logger.warning("mia_stream: ring %s was overwritten (the writer %.2f ring sizes past it) before "
                                   "this consumer was handed a %s event of %d gap(s); more are counted "
                                   "(%s)", worst.name, worst.lag(), ev.kind, len(gaps), OVERRUN_BEFORE_HANDOUT)
                counters[OVERRUN_BEFORE_HANDOUT] += 1
                counters["ring_loss_gaps"] += len(gaps)
                yield from gaps
                continue
            yield ev
            if not intact(leases):  # overwritten while the consumer used it
                gaps = overrun_gaps(ev, OVERRUN_IN_USE, self.assembler)
                counters[OVERRUN_IN_USE] += 1
                counters["ring_loss_gaps"] += len(gaps)
                yield from gaps

    def close(self) -> None:
        if self.client is not None:
            self.client.close()


class EventStream:
    """What ``open_stream`` returns: an iterator of events, already connected and subscribed."""

    def __init__(self, source: _Source, timeout: float | None):
        self._source = source
        self._events = source.events(timeout)

    @property
    def client(self) -> BrokerClient | None:
        """The live BrokerClient (None for a recording), e.g. for ``client.send_steering``."""
        return self._source.client

    def __iter__(self) -> "EventStream":
        return self

    def __next__(self) -> Event:
        try:
            return next(self._events)
        except StopIteration:
            self.close()
            raise

    def close(self) -> None:
        self._events.close()
        self._source.close()

    def __enter__(self) -> "EventStream":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open_stream(source: Any = None, patterns=("*",), from_start: bool = False,
                timeout: float | None = None, **options: Any) -> EventStream:
    """Iterate the events of every stream matching ``patterns`` from ``source`` (live or a recording).

    Live sources are subscribed when this returns (not at the first ``next``). ``from_start``: live
    only, replay each matching live request from its start (what the broker still buffers; evicted frames
    arrive as a gap). ``timeout``: live only, stop after that long without events (None = never).
    ``options``: ``consumer_id``, ``keys`` (CURVE), ``window_bytes``, ``zero_copy``. Close it (or use ``with``)
    when done.

    Zero copy (a live broker on this host; ``zero_copy=False`` or ``MIA_STREAM_SHM_ZERO_COPY=0`` turns it off):
    an event's tensors may be read-only views of the producer's shared-memory ring, valid until the event is
    released (the next ``next()``, or the callback's return under ``run_consumer``). An overwrite found then is a
    "gap" event of reason ``shm_overrun_in_use`` for the seqs the event carried. Keep an event past its release
    only as ``event.keep()`` (its tensors copied).
    """
    return EventStream(_Source(source, patterns, from_start, **options), timeout)


def open_batches(source: Any = None, patterns=("*",), from_start: bool = False,
                 timeout: float | None = None, **options: Any) -> EventStream:
    """Like ``open_stream``, but tensors, tokens and analysis results come as "batch" events, one per columnar
    message (``event.batch``: a ``StepBatch``, ``TokenBatch`` or ``AnalysisBatch`` naming the matched requests
    of one step; a per-request frame of an older producer comes as a one-request batch). "start", "gap" and
    "end" events stay per request; seqs are checked per request, so every loss is in a "gap" event (losses the
    bus announces are merged per request: one "gap" event names them all, within ``reorder_timeout_s`` and
    before the request's "end", possibly after a batch with a later seq of it). With TP > 1
    each rank's batch comes as it is (Q/K shards carry ``Tensor.shard``; hidden states come whole from rank 0).
    """
    return EventStream(_Source(source, patterns, from_start, batches=True, **options), timeout)


class Consumer:
    """Subclass and override the callbacks you need; run it with ``run_consumer`` or ``mia-stream consume``.

    Override ``on_batch`` for a vectorized consumer: it then gets every columnar message whole (one call per
    step and producer) and ``on_frame``, ``on_tokens`` and ``on_analysis`` are not called; ``on_start``,
    ``on_gap`` and ``on_end`` still are, per request (``on_gap`` then merges the losses the bus announced for the
    request, possibly after a batch holding a later seq of it; see ``open_batches``)."""

    patterns: tuple = ("*",)
    from_start: bool = False
    done: bool = False  # set it in a callback to end ``run_consumer`` after that event
    _client: BrokerClient | None = None

    def on_start(self, stream: RequestStream) -> None: ...

    def on_frame(self, stream: RequestStream, frame: StepFrame) -> None: ...

    def on_tokens(self, stream: RequestStream, tokens) -> None: ...

    def on_analysis(self, stream: RequestStream, analysis) -> None:
        """One request's rows of an analyzer's results (``schemas.Analysis``), in seq order per analyzer;
        they may come after the request's ``on_end``."""

    def on_batch(self, batch) -> None:
        """A whole ``StepBatch`` / ``TokenBatch`` / ``AnalysisBatch`` (only called when overridden)."""

    def on_gap(self, stream: RequestStream, gap) -> None: ...

    def on_end(self, stream: RequestStream, end) -> None: ...

    def steer(self, request_id: str, action: str, ops=(), layers=(), timeout: float = 10.0) -> SteeringAck:
        """Change a live request's steering; the ack once the producer applied it. Raises
        SteeringCommandError when refused (unknown request, not authorised, ...), BrokerTimeoutError."""
        if self._client is None:
            raise SteeringCommandError("steer() needs a live source (a broker), not a recording")
        cmd = SteeringCommand(uuid.uuid4().hex, request_id, action, list(ops), list(layers))
        ack = self._client.send_steering(cmd, timeout)
        if not ack.ok:
            raise SteeringCommandError(f"steering command for {request_id!r} refused: {ack.error}")
        return ack


def run_consumer(consumer: Consumer, source: Any = None, max_streams: int | None = None,
                 idle_timeout: float | None = None, **options: Any) -> int:
    """Drive ``consumer``'s callbacks; return the number of streams ended when the source ends (replay),
    after ``max_streams`` streams ended, after ``idle_timeout`` s without events, or once a callback set
    ``consumer.done`` (a consumer that knows it has seen what it waits for: e.g. results that come after the
    streams' ends)."""
    src = _Source(source, consumer.patterns, consumer.from_start, batches=wants_batches(consumer), **options)
    consumer._client = src.client
    ended = 0
    try:
        for ev in src.events(idle_timeout):
            if dispatch(consumer, ev):
                ended += 1
                if max_streams is not None and ended >= max_streams:
                    break
            if consumer.done:
                break
    finally:
        consumer._client = None
        src.close()
    return ended


def wants_batches(consumer: Any) -> bool:
    """Whether ``consumer`` overrides ``Consumer.on_batch`` (then it is run in batch mode)."""
    return getattr(type(consumer), "on_batch", Consumer.on_batch) is not Consumer.on_batch


# A Consumer's callback for each event class.
_CALLBACKS = {
    BatchEvent: lambda c, ev: c.on_batch(ev.batch),
    FrameEvent: lambda c, ev: c.on_frame(ev.stream, ev.frame),
    TokensEvent: lambda c, ev: c.on_tokens(ev.stream, ev.tokens),
    AnalysisEvent: lambda c, ev: c.on_analysis(ev.stream, ev.analysis),
    GapEvent: lambda c, ev: c.on_gap(ev.stream, ev.gap),
    StartEvent: lambda c, ev: c.on_start(ev.stream),
    EndEvent: lambda c, ev: c.on_end(ev.stream, ev.end),
}


def dispatch(consumer: Any, ev: Event) -> bool:
    """Call ``consumer``'s callback for ``ev``; whether it was a request's end."""
    cls = type(ev)
    _CALLBACKS[cls](consumer, ev)
    return cls is EndEvent


def _load_class(spec: str) -> type:
    module, _, name = spec.partition(":")
    if not module or not name:
        raise MiaStreamError(f"expected MODULE:Class, got {spec!r}")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    obj = importlib.import_module(module)
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


def consume_main(argv: list[str]) -> int:
    """``mia-stream consume MODULE:Class``: run a Consumer subclass against a broker or a recording."""
    ap = argparse.ArgumentParser(prog="mia-stream consume", description=consume_main.__doc__)
    ap.add_argument("consumer", help="MODULE:Class of a mia_stream.consumers.Consumer subclass")
    ap.add_argument("--source", help="broker address or recording path (default $MIA_STREAM_BROKER)")
    ap.add_argument("--patterns", nargs="+", help="request-id globs (default: the class's patterns)")
    ap.add_argument("--from-start", action="store_true", help="replay live requests from their start")
    ap.add_argument("--max-streams", type=int, help="return after this many streams ended")
    ap.add_argument("--idle-timeout", type=float, help="return after this many seconds without events")
    ap.add_argument("--keys", help="CURVE key dir (tcp)")
    args = ap.parse_args(argv)
    try:
        cls = _load_class(args.consumer)
        consumer = cls()
        if args.patterns:
            consumer.patterns = tuple(args.patterns)
        if args.from_start:
            consumer.from_start = True
        n = run_consumer(consumer, args.source, args.max_streams, args.idle_timeout, keys=args.keys)
    except (MiaStreamError, ImportError, AttributeError) as e:
        print(f"mia-stream consume: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    print(f"mia-stream consume: {n} stream(s) ended", file=sys.stderr)
    return 0
