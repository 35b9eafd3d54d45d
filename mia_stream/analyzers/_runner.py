"""Running one analyzer: streams in (live or recorded), ``AnalysisBatch`` messages out.

``AnalyzerRunner`` is the one code path for live and replayed streams: it checks each request's stream against
what the analyzer needs, hands it the step batches of accepted requests, turns the analyzer's ``Results`` into
``AnalysisBatch`` messages (one per analyzer step for many requests, each request's seq counted in its analysis
stream) and passes them to its sinks: ``AnalysisPublisher`` (back onto the bus through the broker's producers
endpoint, with the analyzer's own producer id), a JSON-lines printer, or a list. ``analyze_main`` is
``mia-stream analyze``.
"""

from __future__ import annotations

import argparse
import collections
import json
import logging
import os
import random
import signal
import socket
import sys
import time
from typing import Any, Callable, Iterable, Sequence

import numpy as np

from mia_stream.analyzers._base import Analyzer, Results
from mia_stream.analyzers._registry import analyzer_class, available, create, load_config
from mia_stream.consumers import BatchEvent, EndEvent, GapEvent, StartEvent, _is_recording, subset_batch
from mia_stream.errors import AnalyzerError, AnalyzerInputError, MiaStreamError
from mia_stream.schemas import AnalysisBatch, GapNotice, StepBatch, StreamStart, TokenBatch
from mia_stream.schemas import seqranges

log = logging.getLogger("mia_stream.analyzers")


def _no_input(runner: Any, batch: Any) -> None:  # a batch that is not an analyzer's input (results)
    return None


def select(batch: StepBatch, keep: np.ndarray) -> StepBatch:
    """The requests of ``batch`` where ``keep`` (bool per request) is true; their rows are copied."""
    return subset_batch(batch, np.flatnonzero(keep))


class AnalyzerRunner:
    """Drives ``analyzer`` from stream callbacks (``on_start``, ``on_batch``, ``on_tokens``, ``on_gap``,
    ``on_end``) and sends its results to ``sinks`` (callables taking an ``AnalysisBatch``)."""

    def __init__(self, analyzer: Analyzer, sinks: Iterable[Callable[[AnalysisBatch], Any]] = (), *,
                 producer_id: str | None = None, epoch: int | None = None,
                 on_reject: Callable[[str, str], Any] | None = None):
        self.analyzer = analyzer
        self.sinks = list(sinks)
        self.producer_id = producer_id or f"analyzer/{analyzer.name}/{socket.gethostname()}:{os.getpid()}"
        self.epoch = random.getrandbits(63) if epoch is None else epoch
        self.on_reject = on_reject
        self.counters: collections.Counter[str] = collections.Counter()
        self.rejected: dict[str, str] = {}  # request id -> why (one line)
        self._accepted: set[str] = set()
        self._seqs: dict[str, int] = {}
        self._unstarted_warned: set[str] = set()
        self.actor: Any = None  # the AlertActor run_analyzer adds for an alert policy with an action

    # ------------------------------------------------------------------------------------ stream callbacks

    def on_start(self, stream: Any) -> None:
        start: StreamStart | None = getattr(stream, "start", stream)
        if start is None:
            return
        rid = start.request_id
        self.counters["requests"] += 1
        self.analyzer.prompt_lengths[rid] = len(start.prompt_token_ids)
        try:
            self.analyzer.on_start(start)
        except AnalyzerInputError as e:
            self._reject(rid, str(e))
            return
        self.rejected.pop(rid, None)
        self._accepted.add(rid)

    def on_batch(self, batch: StepBatch) -> None:
        ids = batch.request_ids
        accepted = self._accepted
        if not all(rid in accepted for rid in ids):
            keep = np.fromiter((rid in accepted for rid in ids), bool, len(ids))
            self._note_unstarted([rid for rid, k in zip(ids, keep) if not k])
            if not keep.any():
                return
            batch = select(batch, keep)
        out = Results()
        try:
            self.analyzer.on_batch(batch, out)
        except AnalyzerInputError as e:  # the stream's data lacks something its start did not reveal
            for rid in batch.request_ids:
                self._reject(rid, str(e))
            return
        self.counters["batches"] += 1
        self.counters["request_steps"] += len(batch.request_ids)
        self._emit(out, batch.step, batch.time_ns)

    def on_tokens(self, batch: TokenBatch) -> None:
        keep = [rid in self._accepted for rid in batch.request_ids]
        if not any(keep):
            return
        if not all(keep):
            batch = subset_batch(batch, [i for i, k in enumerate(keep) if k])
        out = Results()
        self.analyzer.on_tokens(batch, out)
        self._emit(out, batch.step, batch.time_ns)

    # feed's handler of each SDK event class, and of each batch kind (analysis results are not its input)
    _BATCH_INPUT = {"step_batch": lambda self, b: self.on_batch(b), "token_batch": lambda self, b: self.on_tokens(b)}
    _FEED = {BatchEvent: lambda self, ev: self._BATCH_INPUT.get(ev.batch.KIND, _no_input)(self, ev.batch),
             StartEvent: lambda self, ev: self.on_start(ev.stream),
             GapEvent: lambda self, ev: self.on_gap(ev.stream, ev.gap),
             EndEvent: lambda self, ev: self.on_end(ev.stream, ev.end)}

    def feed(self, ev: Any) -> bool:
        """One SDK event in batch mode (``open_batches``): step and token batches whole, starts, gaps and ends
        per request; analysis results (other analyzers', or this one's own coming back) are not its input.
        Returns whether it was a request's end."""
        cls = type(ev)
        handle = self._FEED.get(cls)
        if handle is not None:
            handle(self, ev)
        return cls is EndEvent

    def on_gap(self, stream: Any, gap: GapNotice) -> None:
        self.counters["gaps"] += 1
        self.counters["gap_seqs"] += gap.count

    def on_end(self, stream: Any, end: Any) -> None:
        rid = stream.request_id if hasattr(stream, "request_id") else str(stream)
        if rid not in self._accepted:
            self.rejected.pop(rid, None)
            self._unstarted_warned.discard(rid)
            return
        self._accepted.discard(rid)
        out = Results()
        self.analyzer.on_end(rid, end, out)
        self.counters["requests_ended"] += 1
        self._emit(out, -1, getattr(end, "time_ns", 0))
        self._seqs.pop(rid, None)
        self.analyzer.prompt_lengths.pop(rid, None)

    # ------------------------------------------------------------------------------------ internals

    def _reject(self, rid: str, why: str) -> None:
        self.counters["rejected"] += 1
        self._accepted.discard(rid)
        self.rejected[rid] = why
        if self.on_reject is not None:
            self.on_reject(rid, why)
        out = Results()
        out.add_one(rid, labels={"error": why}, alert=False)
        self.analyzer.on_end(rid, None, Results())  # frees whatever state it had; its results are void
        self._emit(out, -1, 0)
        self._seqs.pop(rid, None)
        self.analyzer.prompt_lengths.pop(rid, None)

    def _note_unstarted(self, rids: Sequence[str]) -> None:
        for rid in rids:
            if rid in self.rejected:
                continue
            self.counters["request_steps_without_start"] += 1
            if rid not in self._unstarted_warned:
                self._unstarted_warned.add(rid)
                log.warning("analyzer %s: request %r: data without its stream start (joined late? use "
                            "from_start); skipped", self.analyzer.name, rid)

    def _next_seqs(self, ids: Sequence[str]) -> np.ndarray:
        seqs = self._seqs
        out = np.empty(len(ids), np.int64)
        for i, rid in enumerate(ids):
            s = seqs.get(rid, 0)
            out[i] = s
            seqs[rid] = s + 1
        return out

    def _emit(self, out: Results, step: int, source_time_ns: int) -> None:
        if not out:
            return
        batch = out.to_batch(self.analyzer.name, self.analyzer.version, self.producer_id, self.epoch,
                             self._next_seqs, step, source_time_ns, time.time_ns())
        if batch is None:
            return
        self.counters["analysis_messages"] += 1
        self.counters["analysis_rows"] += int(batch.rows.sum())
        for sink in self.sinks:
            sink(batch)


class AnalysisPublisher:
    """Publishes a runner's ``AnalysisBatch`` messages to a broker's producers endpoint (a ``FramePublisher``
    with the analyzer's own producer id). A message the publisher drops becomes one ``GapNotice`` per request it
    named, sent before that request's next analysis message (or at ``close``)."""

    def __init__(self, address: str | None, producer_id: str, keys: Any = None):
        from mia_stream.bus.publisher import FramePublisher

        self.publisher = FramePublisher(address, producer_id=producer_id, keys=keys)
        self.producer_id, self.epoch = self.publisher.producer_id, self.publisher.epoch
        self.counters: collections.Counter[str] = collections.Counter()
        self._lost: dict[str, list] = {}  # request id -> [[first, last], ...] seqs dropped, not yet announced

    def __call__(self, batch: AnalysisBatch) -> None:
        if self._lost:
            self._announce([rid for rid in batch.request_ids if rid in self._lost])
        if self.publisher.publish(batch):
            self.counters["published"] += 1
            return
        self.counters["dropped"] += 1
        for rid, seq in zip(batch.request_ids, batch.seqs.tolist()):
            seqranges.add_seq(self._lost.setdefault(rid, []), seq)

    def _announce(self, rids: Iterable[str]) -> None:
        for rid in rids:
            missing = self._lost.pop(rid)
            gap = GapNotice(rid, self.producer_id, self.epoch, missing, "analysis_dropped", "producer",
                            time.time_ns())
            if not self.publisher.publish(gap):
                self._lost[rid] = missing

    def close(self) -> None:
        if self._lost:
            self._announce(list(self._lost))
        self.publisher.flush(5.0)
        self.publisher.close()


def jsonl_printer(stream=None) -> Callable[[AnalysisBatch], None]:
    """A sink that prints one JSON line per request result (values as lists)."""
    def _print(batch: AnalysisBatch) -> None:
        out = stream or sys.stdout
        for a in batch.results():
            out.write(json.dumps(result_dict(a)) + "\n")
        out.flush()
    return _print


def result_dict(a: Any) -> dict:
    """One request's analysis result as plain data (what ``--print`` writes)."""
    return {"request_id": a.request_id, "analyzer": a.analyzer, "version": a.analyzer_version, "seq": a.seq,
            "step": a.step, "positions": list(a.positions),
            "values": {k: _plain(v) for k, v in sorted(a.values.items())},
            "labels": {k: list(v) for k, v in sorted(a.labels.items())}, "alerts": list(a.alerts)}


def _plain(v: Any) -> Any:
    """An analysis value as JSON data: nested lists, NaN (a row without that value) as null."""
    arr = np.asarray(v)
    if arr.dtype.kind == "f" and np.isnan(arr).any():
        return np.where(np.isnan(arr), None, arr.astype(object)).tolist()
    return arr.tolist()


def run_analyzer(analyzer: Analyzer, source: Any, *, patterns: Sequence[str] = ("*",), from_start: bool = True,
                 sinks: Iterable[Callable] = (), publish: str | None = None, keys: Any = None,
                 max_streams: int | None = None, idle_timeout: float | None = None,
                 on_reject: Callable[[str, str], Any] | None = None,
                 consumer_id: str | None = None, window_bytes: int | None = None) -> AnalyzerRunner:
    """Run ``analyzer`` over ``source`` (a broker address or a recording) until the recording ends, ``max_streams``
    requests ended or ``idle_timeout`` s passed without events (live). It reads the SDK's batch events
    (``open_batches``): a step's tensors arrive as one ``StepBatch``, or as one-request batches from producers
    and recordings that send per-request messages. ``publish``: a broker address to publish the results to.
    Returns the runner (its ``counters`` and ``rejected``)."""
    from mia_stream.consumers import open_batches

    sinks = list(sinks)
    publisher = None
    producer_id = f"analyzer/{analyzer.name}/{socket.gethostname()}:{os.getpid()}"
    if publish is not None:
        publisher = AnalysisPublisher(publish, producer_id, keys)
        sinks.append(publisher)
    live = not _is_recording(source)
    actor = _alert_actor(analyzer, source, keys, live, producer_id)  # issue 15: the analyzer's alert policy may act
    if actor is not None:
        sinks.append(actor)
    runner = AnalyzerRunner(analyzer, sinks, producer_id=producer_id,
                            epoch=publisher.epoch if publisher else None, on_reject=on_reject)
    runner.actor = actor
    options = {"consumer_id": consumer_id or f"analyzer:{analyzer.name}:{os.getpid()}", "keys": keys,
               "window_bytes": window_bytes} if live else {}
    events = None
    ended = 0
    try:
        events = open_batches(source, patterns, from_start, timeout=idle_timeout if live else None, **options)
        for ev in events:
            if runner.feed(ev):
                ended += 1
                if max_streams is not None and ended >= max_streams:
                    break
        return runner
    finally:
        if events is not None:
            events.close()
        if publisher is not None:
            publisher.close()
            runner.counters.update({f"publisher_{k}": v for k, v in publisher.counters.items()})
        if actor is not None:
            actor.close()
            runner.counters.update({f"actions_{k}": v for k, v in actor.counters.items()})


def _alert_actor(analyzer: Analyzer, source: Any, keys: Any, live: bool, producer_id: str = "") -> Any:
    """An ``AlertActor`` for an analyzer whose alert policy names an action (``alert_policy.action``), on a
    live source; None otherwise (a recording cannot be steered: its alerts are only flagged). It is this
    runner's own sink, so it trusts this runner's ``producer_id`` besides ``MIA_STREAM_TRUSTED_ANALYZERS``."""
    policy = getattr(analyzer, "alert_policy", None)
    action = getattr(policy, "action", None)
    if action is None:
        return None
    if not live:
        log.warning("analyzer %s: its alert action (%s) is not taken on a recording", analyzer.name,
                    action.describe())
        return None
    from mia_stream.analyzers._actions import AlertActor, AnalysisTrust

    return AlertActor(source, action, keys=keys, value=policy.value,
                      trust=AnalysisTrust(own=(producer_id,) if producer_id else ()))


# ------------------------------------------------------------------------------------------------ CLI

class _Terminated(Exception):
    """SIGTERM: leave the event loop (its ``finally`` closes the source and flushes the publisher)."""


def _terminate(*_: Any) -> None:
    raise _Terminated


def _default_broker() -> str:
    from mia_stream import settings
    from mia_stream.bus import transport

    return settings.get_address(transport.ENV_BROKER) or str(transport.default_run_dir())


def _list() -> str:
    lines = []
    for name, target in available().items():
        try:
            cls = analyzer_class(name)
            doc = cls.description or (cls.__doc__ or "").strip().splitlines()[0]
            lines.append(f"{name:<24} v{cls.version:<5} {doc}")
        except AnalyzerError as e:
            lines.append(f"{name:<24} (does not load: {e})")
    return "\n".join(lines)


def analyze_main(argv: list[str] | None = None) -> int:
    """``mia-stream analyze``: run one analyzer on a live broker or a recording."""
    ap = argparse.ArgumentParser(
        prog="mia-stream analyze",
        description="Run an analyzer on the streams of a broker (live) or a recording. Without --publish its "
                    "results print as JSON lines; with --publish they go back onto the bus as 'analysis' messages.")
    ap.add_argument("name", nargs="?", help="analyzer name (see --list)")
    ap.add_argument("--list", action="store_true", help="list the registered analyzers and exit")
    ap.add_argument("--config", help="analyzer config file (JSON or TOML object)")
    ap.add_argument("--print-spec", action="store_true",
                    help="print the capture spec requests must send for this analyzer (JSON) and exit")
    ap.add_argument("--source", help="broker address or recording path (default $MIA_STREAM_BROKER)")
    ap.add_argument("--patterns", nargs="+", default=["*"], help="request-id globs (default: all)")
    ap.add_argument("--publish", nargs="?", const="", default=None, metavar="BROKER",
                    help="publish results to BROKER (default: the source broker)")
    ap.add_argument("--print", dest="print_results", action="store_true",
                    help="print results as JSON lines even when publishing")
    ap.add_argument("--no-from-start", action="store_true",
                    help="live: only requests that start after subscribing (default: replay buffered starts)")
    ap.add_argument("--max-streams", type=int, help="stop after this many requests ended")
    ap.add_argument("--idle-timeout", type=float, help="stop after this many seconds without events")
    ap.add_argument("--window-bytes", type=int,
                    help="live: bytes in flight from the broker (its credit window; the SDK's default when unset). "
                         "An analyzer that falls further behind loses frames at the broker, counted there and "
                         "reported to it as gaps, instead of queueing without bound")
    ap.add_argument("--keys", help="CURVE key dir (tcp)")
    args = ap.parse_args(argv)
    prog = "mia-stream analyze"
    if args.list:
        print(_list())
        return 0
    if not args.name:
        print(f"{prog}: name an analyzer (--list shows them)", file=sys.stderr)
        return 2
    try:
        analyzer = create(args.name, load_config(args.config))
        if args.print_spec:
            print(json.dumps({"capture": analyzer.capture_spec()}))
            return 0
        if getattr(analyzer, "caveat", ""):  # the probe file's own word on its baseline (docs/hallucination.md)
            print(f"{prog} {args.name}: note: {analyzer.caveat}", file=sys.stderr, flush=True)
        publish = None
        if args.publish is not None:
            # a bare --publish without --source: the broker the source defaults to ($MIA_STREAM_BROKER or the
            # default run dir), not None (which published nothing)
            publish = args.publish or args.source or _default_broker()
            if _is_recording(publish):
                raise AnalyzerError("--publish needs a broker address when --source is a recording")
        sinks = [jsonl_printer()] if (publish is None or args.print_results) else []
        signal.signal(signal.SIGTERM, _terminate)
        runner = run_analyzer(analyzer, args.source, patterns=args.patterns, from_start=not args.no_from_start,
                              sinks=sinks, publish=publish, keys=args.keys, max_streams=args.max_streams,
                              idle_timeout=args.idle_timeout,
                              window_bytes=args.window_bytes,
                              on_reject=lambda rid, why: print(f"{prog} {args.name}: {why}", file=sys.stderr,
                                                               flush=True))
    except MiaStreamError as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except _Terminated:
        return 143
    c = runner.counters
    print(f"{prog} {args.name}: {c['requests']} request(s), {c['request_steps']} request-steps, "
          f"{c['analysis_messages']} analysis messages, {c['rejected']} rejected, {c['gap_seqs']} seqs lost in gaps",
          file=sys.stderr)
    if runner.actor is not None:
        for rec in runner.actor.records.values():
            print(f"{prog} {args.name}: {rec.summary()}", file=sys.stderr)
    return 3 if c["rejected"] else 0
