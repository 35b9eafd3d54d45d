"""Acting on alerts: abort a live request, or steer it, through the broker's live-steering path.

What to do is the policy's ``AlertAction`` (parsed with the alert config, in ``_alerts``); this module does it.
It imports ``_alerts``, never the other way round.

``AlertActor`` is a sink for ``AnalysisBatch`` messages (an analyzer runner's sink, or fed by ``AlertWatcher``
from the bus): on a request's first alert row it sends the action's ``SteeringCommand`` through the broker and
records the ``SteeringAck`` (``applied_step``: the first engine step computed with it). It never blocks its
caller: commands go out from a worker thread with its own broker connection, so the analyzer keeps scoring
other requests while an ack is on its way. Each outcome is published back onto the bus as an ``analysis``
message of analyzer ``alert_action`` (one row at the alerting position: values ``alert_step``,
``applied_step`` (-1 when refused), ``steering_version``; labels ``action``, ``error``), so monitors and
recordings show what was done.

``AlertWatcher`` is a consumer that applies an ``AlertPolicy`` to the rows of any analyzer's stream (a
per-row score column), for analyzers that flag no alerts themselves or with a policy of the watcher's own, and
acts through an ``AlertActor``.

Trust (docs/security.md, issue 24): an ``analysis`` message names its publisher (``producer_id``; an analyzer
runner's is ``analyzer/<name>/<host>:<pid>``), and on tcp with roles the broker accepts it only from an analyzer
key whose name is that id or its prefix ``NAME/``. Both classes act only on analyses from trusted publishers
(``AnalysisTrust``: ``MIA_STREAM_TRUSTED_ANALYZERS``, default ``analyzer/``); any other analysis (a producer's
forged alert, say) is ignored, counted (``untrusted_analyses_ignored`` / ``untrusted_alerts_ignored``) and
logged once per publisher.
"""

from __future__ import annotations

import collections
import logging
import os
import queue
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import numpy as np

from mia_stream.analyzers._alerts import AlertAction, risk_column
from mia_stream.spec.alerts import ACTION_ANALYZER, action_outcome
from mia_stream.errors import MiaStreamError
from mia_stream.schemas import AnalysisBatch, SteeringAck, SteeringCommand

log = logging.getLogger("mia_stream.analyzers.actions")

_MAX_NAMED_PUBLISHERS = 1024  # untrusted publishers counted by name; past it, as one "<others>"


def trusted_prefixes(text: str | None = None) -> tuple[str, ...]:
    """The entries of ``MIA_STREAM_TRUSTED_ANALYZERS`` (or of ``text``): comma-separated, blanks dropped."""
    if text is None:
        from mia_stream import settings

        text = settings.get_text("MIA_STREAM_TRUSTED_ANALYZERS") or ""
    return tuple(p.strip() for p in text.split(",") if p.strip())


class AnalysisTrust:
    """Whether an analysis message's alerts may be acted on: its ``producer_id`` matches an entry of
    ``prefixes`` (default: ``MIA_STREAM_TRUSTED_ANALYZERS``, itself ``analyzer/`` by default) or is one of
    ``own`` (the ids of this process's own publishers).

    An entry ending in ``/`` is a prefix (``analyzer/`` trusts every analyzer runner's id); any other entry is
    an analyzer key's name as the broker's roles check it, matching the id ``NAME`` and the ids ``NAME/...``;
    ``*`` trusts every publisher (on a bus where anyone may publish analyses, e.g. ipc, that trusts them all).
    Untrusted publishers are counted in ``ignored`` (by producer id) and logged once each."""

    def __init__(self, prefixes: Iterable[str] | None = None, *, own: Iterable[str] = ()):
        self.prefixes = trusted_prefixes() if prefixes is None else tuple(prefixes)
        self.any = "*" in self.prefixes
        self._starts = tuple(p if p.endswith("/") else p + "/" for p in self.prefixes if p != "*")
        self._exact = frozenset(p for p in self.prefixes if not p.endswith("/")) | frozenset(own)
        self.ignored: collections.Counter[str] = collections.Counter()

    def __call__(self, batch: Any) -> bool:
        producer_id = getattr(batch, "producer_id", None)
        if self.any or (isinstance(producer_id, str)
                        and (producer_id in self._exact or producer_id.startswith(self._starts))):
            return True
        name = producer_id if isinstance(producer_id, str) else repr(producer_id)
        if name not in self.ignored and len(self.ignored) >= _MAX_NAMED_PUBLISHERS:
            name = "<others>"
        if name not in self.ignored:
            log.warning("ignoring the alerts of analyzer %r published by %r: not a trusted analyzer "
                        "(MIA_STREAM_TRUSTED_ANALYZERS: %s)", getattr(batch, "analyzer", "?"), name[:200],
                        ",".join(self.prefixes) or "none")
        self.ignored[name] += 1
        return False


@dataclass
class ActionRecord:
    """One action taken: the alert that triggered it and the engine's answer."""

    request_id: str
    analyzer: str
    alert_step: int  # the engine step whose results raised the alert (AnalysisBatch.step)
    alert_position: int  # the token position of the first alert row
    risk: float | None  # its score, when the actor knows the score column
    source_time_ns: int  # time_ns of the frames the alert was computed from
    alert_time_ns: int  # when the analyzer published the alert
    seen_ns: int  # when the actor took it
    command: SteeringCommand
    ack: SteeringAck | None = None
    acked_ns: int = 0
    error: str | None = None

    @property
    def applied_step(self) -> int | None:
        return self.ack.applied_step if self.ack is not None and self.ack.ok else None

    @property
    def ok(self) -> bool:
        return self.ack is not None and self.ack.ok

    def summary(self) -> str:
        what = "abort" if self.command.action == "abort" else f"steer ({self.command.action})"
        head = f"{self.request_id}: {self.analyzer} alert at step {self.alert_step} (position {self.alert_position}"
        head += f", risk {self.risk:.3f})" if self.risk is not None else ")"
        if self.ok:
            return f"{head}; {what} applied at step {self.applied_step} ({(self.acked_ns - self.seen_ns) / 1e6:.1f} ms)"
        return f"{head}; {what} failed: {self.error}"


class AlertActor:
    """Sends an ``AlertAction`` for each request's first alert in the ``AnalysisBatch`` messages it is given.

    ``address``: the broker the requests' engine publishes to. ``value``: the score column whose value at the
    alert row is recorded (optional). ``publish``: publish each outcome as an ``alert_action`` analysis message.
    ``on_record(record)`` is called from the worker thread after each ack (or failure). ``records`` holds every
    action by request id (read it under ``lock``, or after ``close``). ``trust``: whose analyses it acts on
    (default ``AnalysisTrust()``: ``MIA_STREAM_TRUSTED_ANALYZERS``); others are counted as
    ``untrusted_alerts_ignored``."""

    def __init__(self, address: Any, action: AlertAction, *, keys: Any = None, value: str | None = None,
                 publish: bool = True, timeout: float = 10.0,
                 on_record: Callable[[ActionRecord], Any] | None = None, trust: AnalysisTrust | None = None):
        if action is None:
            raise ValueError("AlertActor needs an action")
        self.address, self.action, self.keys, self.value = address, action, keys, value
        self.trust = trust if trust is not None else AnalysisTrust()
        self.timeout = timeout
        self.on_record = on_record
        self.records: dict[str, ActionRecord] = {}
        self.counters: collections.Counter[str] = collections.Counter()
        self.lock = threading.Lock()
        self.done = threading.Condition(self.lock)
        self._queue: queue.Queue[ActionRecord | None] = queue.Queue()
        self._publish = publish
        self._ready = threading.Event()
        self._start_error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="mia-alert-actor", daemon=True)
        self._thread.start()
        self._ready.wait(10.0)
        if self._start_error is not None:
            raise self._start_error

    # ------------------------------------------------------------------------------------------ the sink

    def __call__(self, batch: Any) -> None:
        """The sink: act on the alert rows of an ``AnalysisBatch`` (other messages are ignored)."""
        if getattr(batch, "KIND", "") != "analysis" or batch.analyzer == ACTION_ANALYZER:
            return
        alerts = batch.alerts
        if len(alerts) and alerts.any():
            self.act_on(batch, alerts.astype(bool), batch.values.get(self.value) if self.value else None)

    def act_on(self, batch: AnalysisBatch, alerts: np.ndarray, score: Any = None) -> None:
        """Act on the rows of ``batch`` where ``alerts`` (bool per row) is set: each request once; nothing
        when ``batch`` comes from an untrusted publisher (counted, logged)."""
        if not self.trust(batch):
            with self.lock:
                self.counters["untrusted_alerts_ignored"] += 1
            return
        now = time.time_ns()
        owner = np.repeat(np.arange(len(batch.request_ids)), batch.rows)
        for row in np.flatnonzero(alerts).tolist():
            rid = batch.request_ids[int(owner[row])]
            with self.lock:
                if rid in self.records:  # one action per request
                    continue
                risk = float(score[row]) if score is not None and np.ndim(score[row]) == 0 else None
                rec = ActionRecord(rid, batch.analyzer, int(batch.step), int(batch.positions[row]), risk,
                                   int(batch.source_time_ns), int(batch.time_ns), now,
                                   self.action.command_for(rid))
                self.records[rid] = rec
                self.counters["alerts_acted_on"] += 1
            self._queue.put(rec)

    def wait(self, request_ids: Iterable[str], timeout: float = 30.0) -> bool:
        """Wait until each of ``request_ids`` has an action that was answered (acked or failed)."""
        want = set(request_ids)
        deadline = time.monotonic() + timeout
        with self.done:
            while True:
                pending = [r for r in want if r not in self.records or
                           (self.records[r].ack is None and self.records[r].error is None)]
                left = deadline - time.monotonic()
                if not pending or left <= 0:
                    return not pending
                self.done.wait(left)

    def close(self, timeout: float = 15.0) -> None:
        """Finish the queued commands (each up to the ack timeout), then close the connection."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(timeout)

    # ------------------------------------------------------------------------------------------ worker

    def _run(self) -> None:
        from mia_stream.consumers import BrokerClient

        try:
            client = BrokerClient(self.address, consumer_id=f"actor:{os.getpid()}", keys=self.keys)
            publisher = None
            if self._publish:
                from mia_stream.bus.publisher import FramePublisher

                publisher = FramePublisher(self.address, producer_id=f"actor/{socket.gethostname()}:{os.getpid()}",
                                           keys=self.keys)
        except BaseException as e:  # noqa: BLE001 (handed to the constructor)
            self._start_error = e
            self._ready.set()
            return
        self._ready.set()
        seqs: dict[str, int] = {}
        try:
            while True:
                rec = self._queue.get()
                if rec is None:
                    return
                try:
                    ack = client.send_steering(rec.command, self.timeout)
                except MiaStreamError as e:  # no ack in time, a transport failure
                    ack, error = None, str(e)
                else:
                    error = None if ack.ok else (ack.error or "refused")
                with self.done:
                    rec.ack, rec.error, rec.acked_ns = ack, error, time.time_ns()
                    self.counters["applied" if error is None else "failed"] += 1
                    self.done.notify_all()
                if error is None:
                    log.info("%s", rec.summary())
                else:
                    log.warning("%s", rec.summary())
                if publisher is not None:
                    seq = seqs.get(rec.request_id, 0)
                    seqs[rec.request_id] = seq + 1
                    if not publisher.publish(outcome_batch(rec, publisher.producer_id, publisher.epoch, seq)):
                        self.counters["outcomes_dropped"] += 1
                if self.on_record is not None:
                    self.on_record(rec)
        finally:
            client.close()
            if publisher is not None:
                publisher.flush(5.0)
                publisher.close()


def outcome_batch(rec: ActionRecord, producer_id: str, epoch: int, seq: int) -> AnalysisBatch:
    """The ``alert_action`` analysis message for one action: one row at the alerting position."""
    ack = rec.ack
    applied = ack.applied_step if ack is not None and ack.ok and ack.applied_step is not None else -1
    return action_outcome(producer_id, epoch, rec.request_id, seq, alert_position=rec.alert_position,
                          alert_step=rec.alert_step, applied_step=applied,
                          steering_version=ack.steering_version if ack is not None else 0,
                          action=rec.command.action, source=rec.analyzer, error=rec.error,
                          source_time_ns=rec.source_time_ns, time_ns=rec.acked_ns)


class AlertWatcher:
    """Judges the rows of one analyzer's stream with an ``AlertPolicy`` and acts through an ``AlertActor``.

    For analyzers that flag no alerts themselves, or to act on a policy of one's own: ``policy.value`` names
    the score column (one float per row; NaN rows are not scored). ``policy`` None: act on the analyzer's own
    ``alerts`` column. Feed it SDK batch events (``feed``) or run it on a broker (``run``).

    Only analyses from trusted publishers are judged (``trust``; default: the actor's, else
    ``AnalysisTrust()``: ``MIA_STREAM_TRUSTED_ANALYZERS``): any other one is ignored before the policy sees it
    (so it cannot move a request's debounce state either), counted as ``untrusted_analyses_ignored`` and
    logged once per publisher."""

    def __init__(self, analyzer: str, policy: Any, actor: AlertActor | None, *,
                 trust: AnalysisTrust | None = None):
        self.analyzer, self.policy, self.actor = analyzer, policy, actor
        self.trust = trust if trust is not None else (actor.trust if actor is not None else AnalysisTrust())
        self.alerts: list[tuple[str, int, int, float]] = []  # (request, step, position, risk) of each alert row
        self.counters: collections.Counter[str] = collections.Counter()

    def feed(self, ev: Any) -> None:
        if ev.kind == "end" and self.policy is not None:
            self.policy.release(ev.stream.request_id)
        if ev.kind != "batch" or getattr(ev.batch, "KIND", "") != "analysis" or ev.batch.analyzer != self.analyzer:
            return
        batch = ev.batch
        self.counters["analysis_messages"] += 1
        if not self.trust(batch):
            self.counters["untrusted_analyses_ignored"] += 1
            return
        if self.policy is None:
            alerts, score = batch.alerts.astype(bool), None
        else:
            score = risk_column(batch.values, self.policy.value, f"analyzer {self.analyzer!r}")
            if score is None:
                self.counters["messages_without_score"] += 1
                return
            owner = np.repeat(np.arange(len(batch.request_ids)), batch.rows)
            alerts = self.policy.update(batch.request_ids, owner, score)
        if alerts.any():
            owner = np.repeat(np.arange(len(batch.request_ids)), batch.rows)
            for row in np.flatnonzero(alerts).tolist():
                self.alerts.append((batch.request_ids[int(owner[row])], int(batch.step), int(batch.positions[row]),
                                    float(score[row]) if score is not None else float("nan")))
            if self.actor is not None:  # checks again with its own trust (the last word, if it differs)
                self.actor.act_on(batch, alerts, score)

    def run(self, source: Any, patterns=("*",), *, keys: Any = None, max_streams: int | None = None,
            idle_timeout: float | None = None) -> None:
        """Watch ``source`` (a broker) until ``max_streams`` requests ended or ``idle_timeout`` s passed."""
        from mia_stream.consumers import open_batches

        ended = 0
        with open_batches(source, patterns, from_start=True, timeout=idle_timeout, keys=keys,
                          consumer_id=f"alert-watcher:{self.analyzer}:{os.getpid()}") as events:
            for ev in events:
                self.feed(ev)
                if ev.kind == "end":
                    ended += 1
                    if max_streams is not None and ended >= max_streams:
                        return
