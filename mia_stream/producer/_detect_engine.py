"""In-engine detectors, the engine core's side: alert policies judged at the step boundary, actions applied before
the next step is scheduled, scores published as analysis messages.

Owns (one ``EngineDetectors`` per engine-core control): each streamed request's detectors (parsed from its
normalized spec), one ``AlertPolicy`` per detector configuration (each keeps every request's window), which
(request, detector) pairs have acted, and the cache of the last step's row grouping. ``on_scores`` runs inside
the scheduler's ``update_from_output`` for the step whose forward computed the scores, before vLLM appends the
step's tokens:

- every scored row goes out in one ``AnalysisBatch`` per detector name and step (analyzer ``engine:<name>``,
  value ``risk`` per scored position, ``alerts`` flagged by the detector's policy, ``source_time_ns`` when the
  scores reached the host), published through the control channel's publisher: 4 bytes per scored token;
- on a request's first alert of a detector with an action: ``abort`` marks the request, and vLLM's ``check_stop``
  ends it in this same update (the token sampled in the alerting step is its last); a steering action is queued
  for the control's next ``take`` (the next ``schedule``: without async scheduling, the step after the alert).
  Each outcome is an ``alert_action`` analysis row (values ``alert_step``, ``applied_step``,
  ``steering_version``; labels ``action``, ``source``, ``error``), the record the analyzers' actor publishes.
- when vLLM frees the request (``forget``), each detector's final result: one row at step -1 (values
  ``max_risk``, NaN when nothing was scored, and ``alert_rows``), the analyzers' convention for "this request's
  results are complete". It goes out on the same publisher after every score row of the request, so a client
  that waits for it (``StreamClient(detect=...)``) has them all, whenever the drain's StreamEnd arrives.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mia_stream.schemas import AnalysisBatch
from mia_stream.spec.alerts import action_outcome

logger = logging.getLogger("mia_stream.producer")


@dataclass
class _Req:
    stream_id: str
    detectors: tuple  # spec.detect.DetectorSpec by column
    policy_keys: list  # the key of each detector's policy in EngineDetectors._policies
    stat_slots: np.ndarray  # each column's row in EngineDetectors' running max risk / alert count
    acted: set = field(default_factory=set)  # columns whose action was taken


class EngineDetectors:
    def __init__(self, control: Any):
        self.control = control
        self._requests: dict[str, _Req] = {}
        self._policies: dict[str, Any] = {}  # policy config key -> AlertPolicy (request keys "eid\0col")
        self._group_cache: tuple | None = None
        # per (request, detector): the running max risk and alert rows of its final result; rows reused
        self._max_risk = np.full(64, -np.inf, np.float32)
        self._alert_rows = np.zeros(64, np.int64)
        self._free_slots = list(range(63, -1, -1))
        self.counters = {"scored_rows": 0, "alerts": 0, "actions": 0, "analysis_dropped": 0, "bad_specs": 0}

    def add_request(self, engine_id: str, stream_id: str, detect_wire: Any) -> None:
        from mia_stream.errors import SpecError
        from mia_stream.spec.detect import parse_detect

        try:
            dets = parse_detect(detect_wire, self.control.geo)
        except SpecError as e:  # the frontend checked it; an engine with other probes must not crash on it
            self.counters["bad_specs"] += 1
            logger.error("mia_stream: request %s: its detectors cannot run here: %s", stream_id, e)
            return
        keys = []
        for det in dets:
            key = json.dumps([det.alert, det.action_raw], sort_keys=True)
            if key not in self._policies:
                self._policies[key] = det.policy()
            keys.append(key)
        self._requests[engine_id] = _Req(stream_id, dets, keys, self._take_slots(len(dets)))
        self._group_cache = None

    def _take_slots(self, n: int) -> np.ndarray:
        while len(self._free_slots) < n:
            old = len(self._max_risk)
            self._max_risk = np.concatenate([self._max_risk, np.full(old, -np.inf, np.float32)])
            self._alert_rows = np.concatenate([self._alert_rows, np.zeros(old, np.int64)])
            self._free_slots[:0] = range(2 * old - 1, old - 1, -1)
        slots = np.asarray([self._free_slots.pop() for _ in range(n)], np.int64)
        self._max_risk[slots], self._alert_rows[slots] = -np.inf, 0
        return slots

    def forget(self, engine_id: str) -> None:
        r = self._requests.pop(engine_id, None)
        if r is not None:
            for col, key in enumerate(r.policy_keys):
                self._policies[key].release(f"{engine_id}\0{col}")
            self._group_cache = None
            try:
                self._publish_finals(r)
            finally:
                self._free_slots.extend(r.stat_slots.tolist())

    def _publish_finals(self, r: _Req) -> None:
        publisher = self.control.publisher
        for col, det in enumerate(r.detectors):
            slot = int(r.stat_slots[col])
            top, n_alerts = float(self._max_risk[slot]), int(self._alert_rows[slot])
            batch = AnalysisBatch(
                publisher.producer_id, publisher.epoch, "engine:" + det.name, [r.stream_id],
                publisher.next_seqs([r.stream_id]), None, np.asarray([-1], np.int64),
                {"max_risk": np.asarray([top if top > -np.inf else np.nan], np.float32),
                 "alert_rows": np.asarray([n_alerts], np.int64)}, {}, np.asarray([int(n_alerts > 0)], np.int64),
                step=-1, analyzer_version="1", time_ns=time.time_ns())
            if not publisher.publish(batch):
                self.counters["analysis_dropped"] += 1

    def _groups(self, eids: list, cols: np.ndarray) -> list:
        """The rows of one step grouped by detector name: [(name, row indices, [(eid, _Req, col)] per row, stream
        ids, [(policy, row indices within the group, policy slots or None)])]. Cached while the same requests are
        scored in the same order (steady decode), so a step costs no per-row Python."""
        c = self._group_cache
        if c is not None and c[0] == eids and np.array_equal(c[1], cols):
            return c[2]
        by_name: dict[str, list] = {}
        reqs = self._requests
        for i, (eid, col) in enumerate(zip(eids, cols.tolist())):
            r = reqs.get(eid)
            if r is None or col >= len(r.detectors):
                continue
            by_name.setdefault(r.detectors[col].name, []).append((i, eid, r, col))
        groups = []
        for name, rows in by_name.items():
            by_key: dict[str, list] = {}
            for j, (_, eid, r, col) in enumerate(rows):
                by_key.setdefault(r.policy_keys[col], []).append(j)
            judges = []
            for key, js in by_key.items():
                policy = self._policies[key]
                rids = [f"{rows[j][1]}\0{rows[j][3]}" for j in js]
                # one row per request (decode): the policy's table rows, looked up once for the cached steps
                slots = policy.slots_of(rids) if len(set(rids)) == len(rids) else None
                judges.append((policy, np.asarray(js, np.int64), rids, slots))
            groups.append((name, np.asarray([x[0] for x in rows], np.int64), [(x[1], x[2], x[3]) for x in rows],
                           [x[2].stream_id for x in rows], judges,
                           np.asarray([x[2].stat_slots[x[3]] for x in rows], np.int64)))
        self._group_cache = (list(eids), cols.copy(), groups)
        return groups

    def on_scores(self, scores: list) -> None:
        for sc in scores:
            try:
                self._on_step(sc)
            except Exception:  # a detector must never take the engine down
                logger.exception("mia_stream: in-engine detectors failed at step %d", sc.step)

    def _on_step(self, sc: Any) -> None:
        publisher = self.control.publisher
        for name, idx, rows, stream_ids, judges, stat_slots in self._groups(sc.eids, sc.cols):
            risk32 = sc.risk[idx].astype(np.float32)
            judged = risk32.astype(np.float64)  # judge the values as published (the analyzers' rule)
            alerts = np.zeros(len(idx), bool)
            for policy, ja, rids, slots in judges:
                if slots is not None:
                    alerts[ja] = policy.update_slots(slots, judged[ja])
                else:
                    alerts[ja] = policy.update(rids, np.arange(len(ja)), judged[ja])
            positions = sc.positions[idx]
            self.counters["scored_rows"] += len(idx)
            np.maximum.at(self._max_risk, stat_slots, risk32)
            np.add.at(self._alert_rows, stat_slots, alerts)
            batch = AnalysisBatch(
                publisher.producer_id, publisher.epoch, "engine:" + name, stream_ids, publisher.next_seqs(stream_ids),
                None, positions, {"risk": risk32}, {}, alerts.astype(np.int64), step=sc.step, analyzer_version="1",
                time_ns=time.time_ns(), source_time_ns=sc.time_ns)
            if not publisher.publish(batch):
                self.counters["analysis_dropped"] += 1  # the publisher names the lost seqs in gaps
            if alerts.any():
                self.counters["alerts"] += int(alerts.sum())
                for j in np.flatnonzero(alerts).tolist():
                    eid, r, col = rows[j]
                    if col not in r.acted and r.detectors[col].action_raw is not None:
                        r.acted.add(col)
                        self._act(eid, r, col, sc.step, int(positions[j]), sc.time_ns)

    def _act(self, eid: str, r: _Req, col: int, step: int, position: int, source_ns: int) -> None:
        det = r.detectors[col]
        action = det.action()
        self.counters["actions"] += 1
        source = "engine:" + det.name
        if action.kind == "abort":
            self.control.aborts.add(eid)  # vLLM's check_stop ends it in this step's update
            self._publish_outcome(r.stream_id, step, position, step + 1, 0, "abort", source, None, source_ns)
            return

        def done(ack) -> None:
            applied = ack.applied_step if ack.ok and ack.applied_step is not None else -1
            self._publish_outcome(r.stream_id, step, position, applied, ack.steering_version, action.command, source,
                                  ack.error, source_ns)

        self.control.queue_action(action.command_for(r.stream_id), done)

    def _publish_outcome(self, stream_id: str, alert_step: int, position: int, applied_step: int, version: int,
                         action: str, source: str, error: str | None, source_ns: int) -> None:
        publisher = self.control.publisher
        batch = action_outcome(publisher.producer_id, publisher.epoch, stream_id, publisher.next_seqs([stream_id])[0],
                               alert_position=position, alert_step=alert_step, applied_step=applied_step,
                               steering_version=version, action=action, source=source, error=error,
                               source_time_ns=source_ns)
        if not publisher.publish(batch):
            self.counters["analysis_dropped"] += 1
