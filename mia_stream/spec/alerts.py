"""Alert policies: when a stream of per-token risk scores becomes an alert, debounced, vectorized over requests.

A detector analyzer scores rows (one per token); the policy turns each request's sequence of scores into alert
flags (the ``alerts`` column of its ``analysis`` messages, docs/wire-format.md 3.15) and may name an action to take
on the first alert (abort the request, or steer it; ``_actions``). The same policy object also judges the rows of
any other analyzer's stream (``_actions.AlertWatcher``), so it works with every analysis stream that carries a
per-row score.

Config (the ``alert`` object of a detector's config, or of ``AlertWatcher``), every key optional::

    {"value": "risk",        # the result column holding the per-row risk (the analyzer's score name)
     "threshold": 0.5,       # a row is "hot" when its risk >= threshold
     "mode": "tokens",       # "tokens": alert when >= min_hits of the request's last `window` scored rows are hot
                             # "mean":   alert when the mean risk of its last `window` scored rows >= threshold
                             #           (a span's risk; only once `window` rows were scored)
     "window": 1, "min_hits": 1,   # debounce: k of the last n rows ("tokens" mode); 1 of 1 = every hot row
     "cooldown": null,       # null: one alert per request; 0: every qualifying row; N: at most one per N rows
     "action": null}         # null | "abort" | {"steer": [ops], "command": "add"|"replace"}

The action (``AlertAction``, parsed and checked here with the rest of the config; ``_actions`` takes it)::

    "abort"                                             abort the request (it ends with finish_reason "abort")
    {"steer": [op, ...], "command": "add"}             add steering ops (steering-spec op format: layer, op,
                                                        vector as a list or {"name": N}, scale, ...);
                                                        "command": "replace" replaces the request's ops instead

Rows whose risk is NaN (not scored) neither count nor alert. Scores are compared as float64: judge the values as
published (``judge``: float32 columns), so an analyzer and a downstream ``AlertWatcher`` agree to the bit. A request's alerts depend only on its own rows, in
stream order, so live and replayed streams give identical alerts whatever else shares their steps.

In a detector (``defaults`` gets ``"alert": None``; its ``on_end`` releases the request)::

    self.alert_policy = AlertPolicy.for_analyzer(config["alert"], f"{self.name} config",
                                                 threshold=self.threshold, values=("risk", "window_risk"))
    alerts = self.alert_policy.judge(batch.request_ids, row_requests, values)   # bool per row
    self.alert_policy.release(request_id)                                        # at the request's end

``mia_stream.analyzers.run_analyzer`` (``mia-stream analyze``) takes the action of ``analyzer.alert_policy``
on live streams (``_actions.AlertActor``).
"""

from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from mia_stream.errors import AnalyzerConfigError, SteeringSpecError
from mia_stream.schemas import AnalysisBatch, SteeringCommand
from mia_stream.spec.request_table import RequestTable

MODES = ("tokens", "mean")
# the analyzer name of an action's outcome record (``action_outcome``): the analyzers' actor and the engine's
# in-engine detectors publish the same record
ACTION_ANALYZER = "alert_action"
DEFAULTS: dict[str, Any] = {"value": "risk", "threshold": 0.5, "mode": "tokens", "window": 1, "min_hits": 1,
                            "cooldown": None, "action": None}
# a window longer than this is a span, not a debounce: the state per request is window floats
MAX_WINDOW = 4096


def _number(raw: dict, key: str, where: str) -> float:
    v = raw[key]
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise AnalyzerConfigError(f"{where}: alert.{key} must be a finite number, got {v!r}")
    return float(v)


def _count(raw: dict, key: str, where: str, low: int, high: int | None = None) -> int:
    v = raw[key]
    if isinstance(v, bool) or not isinstance(v, int) or v < low or (high is not None and v > high):
        bound = f"an integer >= {low}" if high is None else f"an integer in {low}..{high}"
        raise AnalyzerConfigError(f"{where}: alert.{key} must be {bound}, got {v!r}")
    return v


_STEER_COMMANDS = ("add", "replace")
# the config-time check of steering ops cannot know the model: any layer index passes here and the engine
# checks it against the model when the command arrives (an error ack, recorded and reported)
_ANY_LAYERS = 1 << 20


@dataclass(frozen=True)
class AlertAction:
    """What to do on a request's first alert: ``kind`` "abort" or "steer" (``command`` add|replace, ``ops``)."""

    kind: str
    command: str = "abort"
    ops: tuple = ()

    @classmethod
    def parse(cls, raw: Any, where: str = "alert config") -> "AlertAction | None":
        """The action an ``alert.action`` config value describes (None: only flag alerts). Steering ops are
        checked as the engine checks them (keys, op names, numbers, a named vector that exists), except the
        layer range and the hidden size, which only the stream's model fixes."""
        if raw is None:
            return None
        if raw == "abort" or raw == {"abort": True}:
            return cls("abort")
        if not isinstance(raw, dict) or "steer" not in raw:
            raise AnalyzerConfigError(f"{where}: alert.action must be null, \"abort\" or {{\"steer\": [ops], "
                                      f"\"command\": \"add\"|\"replace\"}}, got {raw!r}")
        unknown = sorted(set(raw) - {"steer", "command"})
        if unknown:
            raise AnalyzerConfigError(f"{where}: alert.action has unknown key(s) {unknown}; allowed: "
                                      "['command', 'steer']")
        command = raw.get("command", "add")
        if command not in _STEER_COMMANDS:
            raise AnalyzerConfigError(f"{where}: alert.action.command must be one of {list(_STEER_COMMANDS)}, "
                                      f"got {command!r}")
        ops = raw["steer"]
        if not isinstance(ops, list) or not ops:
            raise AnalyzerConfigError(f"{where}: alert.action.steer must be a non-empty list of steering ops, "
                                      f"got {ops!r}")
        for i, op in enumerate(ops):
            _check_op(op, f"{where}: alert.action.steer[{i}]")
        return cls("steer", command, tuple(ops))

    def describe(self) -> str:
        if self.kind == "abort":
            return "abort the request"
        layers = sorted({op.get("layer") for op in self.ops})
        return f"steer it ({self.command} {len(self.ops)} op(s) at layer(s) {layers})"

    def command_for(self, request_id: str) -> SteeringCommand:
        ops = [] if self.kind == "abort" else [dict(op) for op in self.ops]
        return SteeringCommand(uuid.uuid4().hex, request_id, self.command, ops)


def _check_op(op: Any, where: str) -> None:
    from mia_stream.spec import ModelGeometry, parse_steer_ops

    if not isinstance(op, dict):
        raise AnalyzerConfigError(f"{where} must be a steering op object, got {op!r}")
    vec = op.get("vector")
    try:
        if isinstance(vec, dict) and set(vec) == {"name"} and isinstance(vec["name"], str):
            from mia_stream.spec.vectors import load_vector

            size = len(load_vector(vec["name"]))
        else:
            size = len(vec) if isinstance(vec, (list, tuple, np.ndarray)) else 1
        parse_steer_ops([op], ModelGeometry(_ANY_LAYERS, max(size, 1), 1, 1, 1))
    except KeyError:
        raise AnalyzerConfigError(f"{where}: no registered vector named {vec['name']!r} (register it with "
                                  "`mia-stream vectors add NAME FILE`)") from None
    except SteeringSpecError as e:
        # the spec parser names the path inside extra_args; keep only what it says about the op
        msg = str(e).split("['steer'][0]", 1)[-1]
        raise AnalyzerConfigError(f"{where}{msg}") from None


@dataclass
class AlertPolicy:
    """Debounced threshold alerts on a per-row risk (see the module docstring for the config)."""

    value: str = "risk"
    threshold: float = 0.5
    mode: str = "tokens"
    window: int = 1
    min_hits: int = 1
    cooldown: int | None = None
    action: AlertAction | None = None
    _table: RequestTable = field(init=False, repr=False)

    def __post_init__(self) -> None:
        # per request: the last `window` risks (a ring), its next slot, rows scored, hot rows in the window,
        # the number of the row (1-based) that last alerted (0: none yet); new rows start zeroed
        self._table = RequestTable(ring=((self.window,), np.float64), head=((), np.int64), seen=((), np.int64),
                                   hits=((), np.int64), alerted=((), np.int64))

    @classmethod
    def for_analyzer(cls, raw: Any, where: str, *, threshold: float, values: Sequence[str] = ()) -> "AlertPolicy":
        """The policy of a detector: its ``alert`` config (None: flag every row whose ``values[0]`` (else "risk")
        reaches ``threshold``, the detector's own threshold, also the default when ``raw`` names none). A
        detector flags every qualifying row unless the config sets a ``cooldown`` (default 0 here, not null):
        the flags mark the rows; an action is taken on a request's first one. ``values``: the per-row score
        columns the detector publishes; ``alert.value`` must name one of them."""
        default_value = values[0] if values else "risk"
        raw = {} if raw is None else raw
        if isinstance(raw, dict):
            raw = {"value": default_value, "threshold": threshold, "cooldown": 0, **raw}
        policy = cls.from_config(raw, where)
        if values and policy.value not in values:
            raise AnalyzerConfigError(f"{where}: alert.value must be one of the per-token values {list(values)}, "
                                      f"got {policy.value!r}")
        return policy

    @classmethod
    def from_config(cls, raw: Any, where: str = "alert config") -> "AlertPolicy | None":
        """The policy an ``alert`` config object describes (None for a missing/null one). Raises
        ``AnalyzerConfigError`` naming ``where`` and the bad key: unknown keys, wrong types, ``min_hits >
        window``, a malformed action."""
        if raw is None:
            return None
        if not isinstance(raw, dict):
            raise AnalyzerConfigError(f"{where}: alert must be an object of {sorted(DEFAULTS)}, got {raw!r}")
        unknown = sorted(set(raw) - set(DEFAULTS))
        if unknown:
            raise AnalyzerConfigError(f"{where}: alert has unknown key(s) {unknown}; allowed: {sorted(DEFAULTS)}")
        cfg = {**DEFAULTS, **raw}
        if not isinstance(cfg["value"], str) or not cfg["value"]:
            raise AnalyzerConfigError(f"{where}: alert.value must be the name of a result column, got "
                                      f"{cfg['value']!r}")
        if cfg["mode"] not in MODES:
            raise AnalyzerConfigError(f"{where}: alert.mode must be one of {list(MODES)}, got {cfg['mode']!r}")
        threshold = _number(cfg, "threshold", where)
        window = _count(cfg, "window", where, 1, MAX_WINDOW)
        min_hits = _count(cfg, "min_hits", where, 1)
        if min_hits > window:
            raise AnalyzerConfigError(f"{where}: alert.min_hits ({min_hits}) cannot exceed alert.window ({window}): "
                                      "the alert could never fire")
        if cfg["mode"] == "mean" and "min_hits" in raw:
            raise AnalyzerConfigError(f"{where}: alert.min_hits applies to mode 'tokens'; mode 'mean' alerts on "
                                      "the window's mean risk")
        cooldown = None if cfg["cooldown"] is None else _count(cfg, "cooldown", where, 0)
        action = AlertAction.parse(cfg["action"], where)
        return cls(cfg["value"], threshold, cfg["mode"], window, min_hits, cooldown, action)

    def describe(self) -> str:
        """One line for logs and the terminal monitor."""
        if self.mode == "mean":
            rule = f"mean {self.value} of the last {self.window} tokens >= {self.threshold:g}"
        elif self.window == 1:
            rule = f"{self.value} >= {self.threshold:g}"
        else:
            rule = f"{self.min_hits} of the last {self.window} tokens with {self.value} >= {self.threshold:g}"
        repeat = ("once per request" if self.cooldown is None else "every such token" if self.cooldown == 0
                  else f"at most every {self.cooldown} tokens")
        act = f"; then {self.action.describe()}" if self.action is not None else ""
        return f"alert when {rule}, {repeat}{act}"

    # ------------------------------------------------------------------------------------------ judging rows

    def update(self, request_ids: Sequence[str], row_requests: Any, risk: Any) -> np.ndarray:
        """Alert flags (bool per row) for rows of many requests: ``row_requests[i]`` is row i's index into
        ``request_ids``, ``risk[i]`` its score. Each request's rows are taken in the order given, after the rows
        of earlier calls. Vectorized over requests: one pass per row a single request has in this call."""
        rr = np.asarray(row_requests, np.int64).reshape(-1)
        r = np.asarray(risk, np.float64).reshape(-1)
        if len(r) != len(rr):
            raise ValueError(f"risk has {len(r)} rows, row_requests {len(rr)}")
        alerts = np.zeros(len(r), bool)
        scored = np.flatnonzero(~np.isnan(r))
        if not len(scored):
            return alerts
        rr_s = rr[scored]
        used = np.unique(rr_s)
        slot_of = np.zeros(len(request_ids), np.int64)
        slot_of[used] = self._table.slots([request_ids[i] for i in used.tolist()])
        # rank of each scored row among its request's rows (stable: the order given)
        order = np.argsort(rr_s, kind="stable")
        sorted_rr = rr_s[order]
        starts = np.flatnonzero(np.r_[True, sorted_rr[1:] != sorted_rr[:-1]])
        counts = np.diff(np.r_[starts, len(sorted_rr)])
        rank = np.arange(len(sorted_rr)) - np.repeat(starts, counts)
        for j in range(int(counts.max())):
            sel = order[rank == j]  # at most one row of each request
            rows = scored[sel]
            alerts[rows] = self._step(slot_of[rr_s[sel]], r[rows])
        return alerts

    def slots_of(self, request_ids: Sequence[str]) -> np.ndarray:
        """The table rows of ``request_ids`` (allocated for new ones): for ``update_slots``."""
        return self._table.slots(request_ids)

    def update_slots(self, slots: np.ndarray, risk: Any) -> np.ndarray:
        """``update`` for one row each of distinct requests whose rows ``slots_of`` gave (a steady decode step:
        the engine caches the slots while the same requests are scored)."""
        return self._step(slots, np.asarray(risk, np.float64))

    def judge(self, request_ids: Sequence[str], row_requests: Any, values: dict) -> np.ndarray:
        """``update`` on the policy's score column of ``values`` (name -> one entry per row)."""
        risk = risk_column(values, self.value)
        if risk is None:
            raise AnalyzerConfigError(f"alert.value {self.value!r} is not among the results {sorted(values)}")
        return self.update(request_ids, row_requests, risk)

    def _step(self, slots: np.ndarray, risk: np.ndarray) -> np.ndarray:
        """One new scored row for each of ``slots`` (distinct requests): update their windows, return alerts."""
        t, w = self._table, self.window
        ring, head, seen, hits, alerted = t["ring"], t["head"], t["seen"], t["hits"], t["alerted"]
        h = head[slots]
        full = seen[slots] >= w
        leaving = ring[slots, h]  # the risk that drops out of a full window
        hot = risk >= self.threshold
        hits[slots] += hot.astype(np.int64) - (full & (leaving >= self.threshold)).astype(np.int64)
        ring[slots, h] = risk
        head[slots] = (h + 1) % w
        seen[slots] += 1
        if self.mode == "tokens":
            fires = hits[slots] >= self.min_hits
        else:  # the window's mean, summed afresh (no running sum to drift): w floats per request
            fires = (seen[slots] >= w) & (ring[slots].sum(axis=1) / w >= self.threshold)
        n, last = seen[slots], alerted[slots]
        allowed = last == 0 if self.cooldown is None else (last == 0) | (n - last >= self.cooldown)
        alert = fires & allowed
        alerted[slots] = np.where(alert, n, last)
        return alert

    def release(self, request_id: str) -> None:
        """Forget a request (at its end)."""
        self._table.release(request_id)

    def state(self, request_id: str) -> dict | None:
        """A request's window (for tests and debugging): risks oldest first, rows scored, hot rows in it."""
        s = self._table.slot(request_id)
        if s is None:
            return None
        t, w = self._table, self.window
        n = min(int(t["seen"][s]), w)
        h = int(t["head"][s])
        ring = np.roll(t["ring"][s], -h)[w - n:]
        return {"window": ring.tolist(), "seen": int(t["seen"][s]), "hits": int(t["hits"][s]),
                "alerted": int(t["alerted"][s]) > 0}


def risk_column(values: dict, name: str, where: str = "") -> np.ndarray | None:
    """The per-row risk column ``name`` of an analysis result's values as float64 [N] (None when absent).
    A column with more than one value per row is an ``AnalyzerConfigError``: a policy judges one score."""
    v = values.get(name)
    if v is None:
        return None
    a = np.asarray(v)
    if a.ndim != 1:
        if a.ndim == 2 and a.shape[1] == 1:
            a = a[:, 0]
        else:
            raise AnalyzerConfigError(f"{where or 'alert'}: value {name!r} has {a.shape[1:]} entries per row; an "
                                      "alert policy needs one score per row")
    return a.astype(np.float64)


def action_outcome(producer_id: str, epoch: int, request_id: str, seq: int, *, alert_position: int, alert_step: int,
                   applied_step: int, steering_version: int, action: str, source: str, error: str | None,
                   source_time_ns: int, time_ns: int | None = None) -> AnalysisBatch:
    """The ``alert_action`` analysis message for one action taken on an alert: one row at the alerting position,
    values ``alert_step``, ``applied_step`` (-1: refused), ``steering_version``; labels ``action``, ``source``
    (the analyzer that alerted), ``error``."""
    return AnalysisBatch(
        producer_id, epoch, ACTION_ANALYZER, [request_id], [seq], [1], [alert_position],
        {"alert_step": np.asarray([alert_step], np.int64), "applied_step": np.asarray([applied_step], np.int64),
         "steering_version": np.asarray([steering_version], np.int64)},
        {"action": [action], "source": [source], "error": [error]}, [1],
        step=applied_step, analyzer_version="1", time_ns=time_ns or time.time_ns(), source_time_ns=source_time_ns)
