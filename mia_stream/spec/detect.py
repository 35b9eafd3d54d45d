"""The ``detect`` part of a request spec: detectors the engine runs on the request's own rows, in the forward pass.

    "detect": [{"probe": NAME | FILE | SHIPPED_FILE_NAME,      # a registered, shipped or file probe
                "name": "risk",                                 # optional; published as analyzer "engine:<name>"
                "positions": "generated",                       # optional; default: the probe's own
                "alert": {"threshold": 0.7, "mode": "tokens", "window": 3, "min_hits": 2, "cooldown": null},
                "action": null | "abort" | {"steer": [ops], "command": "add" | "replace"}}]

A probe may also read the token's own sampling statistics (``logit_features``: the log-probability the model
gave the token and the entropy of that distribution, raw logits, computed where vLLM samples it) beside the
residual; such a detector scores generated positions. ``alert`` is the policy object the detector analyzers take (``spec.alerts.AlertPolicy``; default: the probe's
threshold, every hot row flagged); ``action`` is taken on the request's first alert, in the engine, before its next
step is scheduled. A probe is a ``mia_stream.probe/1`` linear probe on one layer's residual (``spec.probes``):
hidden size and layer count must be the model's; probes over other features (attention, a final norm, a pooled
answer) run as analyzers instead, and are refused here naming why. Pure: no torch, no vLLM.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from mia_stream.errors import AnalyzerConfigError, DetectSpecError, SpecError
from mia_stream.spec.alerts import AlertAction, AlertPolicy
from mia_stream.spec.probes import LinearProbe, resolve_probe

DETECT_POSITIONS = ("generated", "last_prompt", "all", "prompt")
MAX_DETECTORS = 16  # a hard cap; the engine's own limit is MIA_STREAM_DETECTORS_PER_REQUEST (admission)
_KEYS = {"probe", "name", "positions", "alert", "action"}
_PATH = "extra_args['mia_stream']['detect']"


@dataclass(frozen=True)
class DetectorSpec:
    """One checked detector of a request (``probe`` loaded; ``alert`` the normalized policy config)."""

    name: str  # the analyzer name it publishes under is "engine:" + name
    digest: str  # the probe file's content digest: the engine scores with exactly this file
    ref: str  # the probe as the request named it (for messages)
    positions: str
    alert: dict = field(default_factory=dict)
    action_raw: Any = None
    probe: LinearProbe | None = field(default=None, compare=False, repr=False)

    @property
    def analyzer(self) -> str:
        return "engine:" + self.name

    @property
    def layer(self) -> int:
        return self.probe.layer

    def policy(self) -> AlertPolicy:
        """A fresh alert policy of this detector (one per engine; it keeps each request's window)."""
        return AlertPolicy.from_config({**self.alert, "action": self.action_raw}, f"{_PATH} {self.name!r}")

    def action(self) -> AlertAction | None:
        return AlertAction.parse(self.action_raw, f"{_PATH} {self.name!r}")

    def to_wire(self) -> dict:
        return {"probe": {"digest": self.digest, "ref": self.ref}, "name": self.name, "positions": self.positions,
                "alert": dict(self.alert), "action": self.action_raw}


def _fail(path: str, msg: str):
    raise DetectSpecError(f"{_PATH}{path}: {msg}")


def parse_detect(raw: Any, geo: Any) -> tuple[DetectorSpec, ...]:
    """Check a spec's ``detect`` list against the model (``geo``: ``spec.ModelGeometry``); ``DetectSpecError``
    naming the entry and field."""
    if not isinstance(raw, (list, tuple)):
        _fail("", f"must be a list of detectors, got {type(raw).__name__}")
    if len(raw) > MAX_DETECTORS:
        _fail("", f"{len(raw)} detectors; at most {MAX_DETECTORS}")
    out, names = [], set()
    for i, d in enumerate(raw):
        det = _parse_one(d, geo, f"[{i}]")
        if det.name in names:
            _fail(f"[{i}]['name']", f"two detectors are named {det.name!r}; give each its own 'name'")
        names.add(det.name)
        out.append(det)
    return tuple(out)


def _parse_one(d: Any, geo: Any, path: str) -> DetectorSpec:
    if not isinstance(d, dict):
        _fail(path, f"must be an object with keys {sorted(_KEYS)}, got {type(d).__name__}")
    unknown = set(d) - _KEYS
    if unknown:
        _fail(path, f"unknown key(s) {sorted(unknown)}; allowed: {sorted(_KEYS)}")
    if "probe" not in d:
        _fail(path, "missing 'probe' (a registered probe's name, a shipped probe file or a path)")
    ref = d["probe"]
    try:
        probe, digest = resolve_probe(ref)
    except KeyError as e:
        _fail(f"{path}['probe']", f"no such probe: {e.args[0]} (register one with `mia-stream probes add NAME FILE`)")
    except AnalyzerConfigError as e:
        _fail(f"{path}['probe']", str(e))
    ref_text = ref.get("ref", digest) if isinstance(ref, dict) else ref
    where = f"{path}['probe'] ({probe.path})"
    if probe.num_features:
        _fail(where, f"reads {probe.num_features} {probe.analyzer} features, not one layer's residual; run it as an "
                     f"analyzer (`mia-stream analyze {probe.analyzer}`)")
    if probe.final_norm:
        _fail(where, "applies the model's final norm first; in-engine detectors read the raw residual: run it as an "
                     f"analyzer (`mia-stream analyze {probe.analyzer}`)")
    if probe.pool != "last":
        _fail(where, f"scores a {probe.pool!r}-pooled answer, not a row; run it as an analyzer")
    if probe.hidden_size != geo.hidden_size:
        _fail(where, f"is for hidden size {probe.hidden_size} ({probe.model or 'its model'}); this model has "
                     f"{geo.hidden_size}")
    if probe.num_layers and probe.num_layers != geo.num_layers:
        _fail(where, f"is for a {probe.num_layers}-layer model ({probe.model or 'its model'}); this model has "
                     f"{geo.num_layers}")
    if not 0 <= probe.layer < geo.num_layers:
        _fail(where, f"reads layer {probe.layer}; the model has layers 0..{geo.num_layers - 1}")
    name = d.get("name", probe.analyzer or "probe")
    if not isinstance(name, str) or not name or len(name) > 64 or not name.replace("_", "").replace("-", "").isalnum():
        _fail(f"{path}['name']", f"must be 1-64 letters, digits, '_' or '-', got {name!r}")
    positions = d.get("positions", probe.position)
    if positions not in DETECT_POSITIONS:
        _fail(f"{path}['positions']", f"must be one of {list(DETECT_POSITIONS)}, got {positions!r}")
    if probe.logit_features and positions != "generated":
        _fail(f"{path}['positions']", f"the probe reads logit features ({', '.join(probe.logit_features['names'])}), "
                                      "which exist for generated tokens only: use 'generated'")
    alert = d.get("alert") or {}
    if not isinstance(alert, dict):
        _fail(f"{path}['alert']", f"must be an alert policy object, got {alert!r}")
    if "action" in alert:
        _fail(f"{path}['alert']['action']", "put the action beside 'alert' (detect[i]['action'])")
    if "value" in alert and alert["value"] != "risk":
        _fail(f"{path}['alert']['value']", f"an in-engine detector publishes one score, 'risk'; got {alert['value']!r}")
    alert = {"value": "risk", "threshold": probe.threshold, "cooldown": 0, **alert}
    action = d.get("action")
    try:
        policy = AlertPolicy.from_config({**alert, "action": action}, f"{_PATH}{path}")
    except (AnalyzerConfigError, SpecError) as e:
        raise DetectSpecError(str(e)) from None
    if policy.action is not None and policy.action.kind == "steer":
        from mia_stream.spec import parse_steer_ops

        try:
            parse_steer_ops(list(policy.action.ops), geo)
        except SpecError as e:
            raise DetectSpecError(f"{_PATH}{path}['action']: {str(e).split(']: ', 1)[-1]}") from None
    json.dumps(alert)  # plain data only (it travels in the normalized spec)
    return DetectorSpec(name=name, digest=digest, ref=str(ref_text), positions=positions, alert=alert,
                        action_raw=action, probe=probe)
