"""Replay a recording into a consumer (offline analysis) or into a broker (as a producer).

    replay("runs/rec1", into=MyConsumer())                 # same messages, same order as live
    replay("runs/rec1", into="/tmp/mia_stream-0", pace="recorded")   # re-publish at the recorded pace

``pace="full"`` delivers as fast as the consumer takes them; ``"recorded"`` reproduces the gaps between the
recorded receive times (MCAP ``log_time``). Messages are delivered in recorded order, GapNotices included,
so a consumer computes on replay exactly what it computed live.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

from mia_stream.consumers.recording import ReadReport, RecordingError, iter_recording
from mia_stream.errors import MiaStreamError
from mia_stream.schemas import GapBatch, Message

PACES = ("full", "recorded")
_DISPATCH = {"start": "on_start", "tensors": "on_tensors", "tokens": "on_tokens", "end": "on_end", "gap": "on_gap",
             "step_batch": "on_step_batch", "token_batch": "on_token_batch", "analysis": "on_analysis",
             "gap_batch": "on_gap_batch"}


@dataclass
class ReplayStats:
    messages: int = 0
    bytes: int = 0
    seconds: float = 0.0
    dropped: int = 0  # refused by the publisher (broker replay only; announced to consumers as gaps)
    report: ReadReport = field(default_factory=ReadReport)  # what the read skipped: corrupt chunks, cut-short parts
    skip_corrupt: bool = False  # skip damaged chunks (listed in report.corrupt) instead of raising


def iter_replay(path: str | os.PathLike, *, pace: str = "full", patterns: Sequence[str] = ("*",),
                clock: Callable[[], float] = time.monotonic,
                sleep: Callable[[float], None] = time.sleep, skip_corrupt: bool = False,
                report: ReadReport | None = None) -> Iterator[tuple[list[bytes], Message]]:
    """``iter_recording`` at the chosen pace: with ``"recorded"``, message i is released
    ``log_time[i] - log_time[0]`` after the first. A damaged recording raises ``CorruptRecordingError``
    (``skip_corrupt``: its damaged chunks are skipped and described in ``report``)."""
    if pace not in PACES:
        raise ValueError(f"pace must be one of {PACES}, got {pace!r}")
    t0 = first = None
    for frames, msg, log_time in iter_recording(path, patterns, with_log_time=True, skip_corrupt=skip_corrupt,
                                                report=report):
        if pace == "recorded":
            if first is None:
                t0, first = clock(), log_time
            delay = t0 + (log_time - first) / 1e9 - clock()
            if delay > 0:
                sleep(delay)
        yield frames, msg


def _deliver(consumer: Any, msg: Message) -> None:
    """The delivery a consumer sees live: ``on_message(msg)`` if it has one, else ``on_<kind>(msg)``."""
    handler = getattr(consumer, "on_message", None)
    if handler is None:
        handler = getattr(consumer, _DISPATCH.get(msg.KIND, ""), None)
        if handler is None and type(msg) is GapBatch:  # a consumer that knows only GapNotices gets each of them
            for notice in msg.notices():
                _deliver(consumer, notice)
            return
    if handler is not None:
        handler(msg)


def _replay_into_consumer(path, consumer, pace, patterns, stats: ReplayStats) -> None:
    sdk_consumer = _sdk_consumer_class()
    if sdk_consumer is not None and isinstance(consumer, sdk_consumer):
        _replay_into_sdk_consumer(path, consumer, pace, patterns, stats)
        return
    for frames, msg in iter_replay(path, pace=pace, patterns=patterns, skip_corrupt=stats.skip_corrupt,
                                    report=stats.report):
        _deliver(consumer, msg)
        stats.messages += 1
        stats.bytes += sum(len(f) for f in frames)
    close = getattr(consumer, "close", None)
    if callable(close):
        close()


def _sdk_consumer_class() -> type | None:
    try:
        from mia_stream.consumers import Consumer
    except ImportError:
        return None
    return Consumer


def _replay_into_sdk_consumer(path, consumer, pace, patterns, stats: ReplayStats) -> None:
    """An SDK ``Consumer``: the live SDK's assembler (ordering, gaps, TP merge; batch mode for a consumer with
    ``on_batch``) fed from the recording, and run_consumer's dispatch."""
    from mia_stream.consumers import StreamAssembler, dispatch, wants_batches

    assembler = StreamAssembler(batches=wants_batches(consumer))
    for frames, msg in iter_replay(path, pace=pace, patterns=patterns, skip_corrupt=stats.skip_corrupt,
                                    report=stats.report):
        stats.messages += 1
        stats.bytes += sum(len(f) for f in frames)
        for event in assembler.feed(msg):
            dispatch(consumer, event)
    for event in assembler.finish():
        dispatch(consumer, event)


def _replay_into_broker(path, address: str, pace, patterns, stats: ReplayStats, publisher_options: dict) -> None:
    from mia_stream.bus.publisher import FramePublisher

    with FramePublisher(address, producer_id=publisher_options.pop("producer_id", "replay"),
                        **publisher_options) as pub:
        budget = pub.queue_bytes // 2
        for frames, msg in iter_replay(path, pace=pace, patterns=patterns, skip_corrupt=stats.skip_corrupt,
                                    report=stats.report):
            # The publisher never blocks (it drops instead); a replay can afford to wait for room.
            while pub.stats()["queue_bytes"] > budget:
                time.sleep(0.001)
            # a producer announces its streams' gaps per request (spec 11): a recorded gap batch goes as them
            for out in (msg.notices() if type(msg) is GapBatch else (msg,)):
                if not pub.publish(out):
                    stats.dropped += 1
            stats.messages += 1
            stats.bytes += sum(len(f) for f in frames)
        pub.flush(30)


def replay(path: str | os.PathLike, *, into: Any, pace: str = "full", patterns: Sequence[str] = ("*",),
           skip_corrupt: bool = False, **publisher_options: Any) -> ReplayStats:
    """Deliver a recording to ``into``: a Consumer instance, or a broker address (str / path) to publish to.

    A damaged recording raises ``CorruptRecordingError`` (a ``RecordingError``) where the read reaches the
    damage; with ``skip_corrupt`` its damaged chunks are skipped and listed in ``stats.report.corrupt``.
    Parts cut short by a killed recorder are read up to their last complete chunk (``stats.report.truncated``)."""
    if pace not in PACES:
        raise ValueError(f"pace must be one of {PACES}, got {pace!r}")
    stats = ReplayStats(skip_corrupt=skip_corrupt)
    t0 = time.perf_counter()
    if isinstance(into, (str, os.PathLike)):
        _replay_into_broker(path, str(into), pace, patterns, stats, publisher_options)
    else:
        _replay_into_consumer(path, into, pace, patterns, stats)
    stats.seconds = time.perf_counter() - t0
    return stats


def _load_consumer(spec: str) -> Any:
    module, _, name = spec.partition(":")
    if not module or not name:
        raise SystemExit(f"mia-stream replay: --consumer must be MODULE:Class, got {spec!r}")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise SystemExit(f"mia-stream replay: cannot load {spec!r}: {e}") from None
    return cls()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="mia-stream replay", description=(
        "Replay a recording (a .mcap file or a recording directory) into a consumer or a broker."))
    p.add_argument("recording")
    target = p.add_mutually_exclusive_group(required=True)
    target.add_argument("--broker", help="publish the recorded messages to this broker (acts as a producer)")
    target.add_argument("--consumer", metavar="MODULE:Class", help="run this Consumer class on the recording")
    p.add_argument("--pace", choices=PACES, default="full", help="full speed, or the recorded pace")
    p.add_argument("--patterns", nargs="+", default=["*"], metavar="GLOB", help="request-id globs (default: *)")
    p.add_argument("--skip-corrupt", action="store_true",
                   help="replay what is intact, skipping damaged chunks (each named on stderr; the exit status "
                        "is still 1)")
    args = p.parse_args(argv)
    prog = "mia-stream replay"
    logging.getLogger("mia_stream.consumers.recording").setLevel(logging.ERROR)  # its skips are printed below
    into = args.broker if args.broker else _load_consumer(args.consumer)
    try:
        stats = replay(args.recording, into=into, pace=args.pace, patterns=args.patterns,
                       skip_corrupt=args.skip_corrupt)
    except RecordingError as e:  # not a recording, or damaged: one line naming the file and what is wrong
        print(f"{prog}: {e}", file=sys.stderr)
        return 1
    except (MiaStreamError, OSError) as e:  # a message that does not decode, a file that cannot be read
        print(f"{prog}: {args.recording}: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    rate = stats.bytes / stats.seconds / 1e6 if stats.seconds else 0.0
    for line in stats.report.truncated:
        print(f"{prog}: {line}", file=sys.stderr)
    for line in stats.report.corrupt:
        print(f"{prog}: skipped: {line}", file=sys.stderr)
    print(f"{prog}: {stats.messages} messages, {stats.bytes} bytes in {stats.seconds:.2f} s "
          f"({rate:.0f} MB/s), {stats.dropped} dropped, {len(stats.report.corrupt)} damaged record(s) skipped",
          file=sys.stderr)
    return 0 if not (stats.dropped or stats.report.corrupt) else 1
