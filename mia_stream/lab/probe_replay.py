"""A probe file through its analyzer over a collect run's recording: what the analyzer publishes for the held-out
requests, scored against the labels (``mia-stream probe eval --analyzers``; the test's check that the
analyzer reproduces what training measured)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from mia_stream.errors import AnalyzerConfigError


def analyzer_results(recording: str | Path, probe_path: str | Path, request_ids: list[str],
                     config: dict | None = None) -> tuple[str, dict, dict]:
    """Run the probe's analyzer over ``request_ids`` of the recording: (analyzer name, per-token ``risk`` by
    request and position, end row values by request)."""
    from mia_stream.analyzers import create, run_analyzer

    try:
        name = json.loads(Path(probe_path).read_text()).get("analyzer")
    except (OSError, ValueError, AttributeError) as e:
        raise AnalyzerConfigError(f"probe file {probe_path}: not a readable probe file ({e})") from None
    analyzer = create(str(name), dict(config or {}, probe=str(probe_path)))
    tokens: dict[str, dict[int, float]] = {}
    ends: dict[str, dict] = {}

    def sink(batch) -> None:
        for a in batch.results():
            if a.step == -1 and "answer_risk" in a.values:
                ends[a.request_id] = {k: float(np.asarray(v)[-1]) for k, v in a.values.items()}
            elif "risk" in a.values:
                d = tokens.setdefault(a.request_id, {})
                for p, r in zip(a.positions, np.asarray(a.values["risk"]).tolist()):
                    d[int(p)] = r

    run_analyzer(analyzer, str(recording), patterns=list(request_ids), sinks=[sink])
    return str(name), tokens, ends


def replay_scores(ds, recording: str | Path, probe_path: str | Path) -> dict:
    """Held-out AUROC of what the analyzer publishes: ``token_auc`` over the answer-span tokens (its per-token
    ``risk``), ``answer_auc`` over the requests (its end row's ``answer_risk``)."""
    from mia_stream.lab.probe_metrics import alert_rates, bootstrap
    from mia_stream.lab.probe_train import _auc

    test = ds.requests("test").tolist()
    rids = [ds.records[r]["request_id"] for r in test]
    name, tokens, ends = analyzer_results(recording, probe_path, rids)
    ty, ts, ay, as_, sets = [], [], [], [], []
    for r, rid in zip(test, rids):
        rec = ds.records[r]
        P = rec["prompt_len"]
        got = tokens.get(rid, {})
        for k in ds.span[r]:
            if P + k in got:
                ty.append(ds.labels[r])
                ts.append(got[P + k])
        if rid in ends:
            ay.append(ds.labels[r])
            as_.append(ends[rid]["answer_risk"])
            sets.append(rec.get("set"))
    ay, as_, sets = np.asarray(ay), np.asarray(as_), np.asarray(sets)
    per_set = {s: _auc(ay[sets == s], as_[sets == s]) for s in sorted(set(sets.tolist()))}
    groups = [ds.records[r]["group"] for r, rid in zip(test, rids) if rid in ends]
    boot = bootstrap(ay, {"answer": as_}, groups)["answer"] if len(ay) else {"ci": [None, None]}
    thr = float(json.loads(Path(probe_path).read_text()).get("threshold", 0.5))
    alerts = alert_rates(ay, as_, thr, groups) if len(ay) else {}
    groups = np.asarray(groups)
    alerts_per_set = {s: alert_rates(ay[sets == s], as_[sets == s], thr, groups[sets == s], n=300)
                      for s in sorted(set(sets.tolist()))}
    auc_ci_per_set = {s: bootstrap(ay[sets == s], {"a": as_[sets == s]}, groups[sets == s], n=300)["a"]["ci"]
                      if per_set[s] is not None else [None, None] for s in per_set}
    return {"analyzer": name, "token_auc": _auc(ty, ts) if ts else None, "answer_auc": _auc(ay, as_),
            "answer_ci": boot["ci"], "threshold": thr, "false_alert_rate": alerts.get("false_alert_rate"),
            "recall": alerts.get("recall"), "requests": len(ay), "tokens": len(ts), "answer_auc_per_set": per_set,
            "answer_ci_per_set": auc_ci_per_set, "alerts_per_set": alerts_per_set,
            "answer_risk": {rid: float(ends[rid]["answer_risk"]) for rid in rids if rid in ends}}


def calibrate_file(ds, recording: str | Path, probe_path: str | Path, rate: float, out: str | Path) -> dict:
    """Replay the probe's analyzer over the calibration split's requests, set the file's threshold to the lowest
    at which at most ``rate`` of their correct answers alert (``answer_risk >= threshold``), write it to ``out``
    with how it was chosen, and return the threshold and its held-out false-alert rate and recall."""
    from mia_stream.lab.probe_metrics import calibrate

    split = ds.calibration_split()
    reqs = ds.requests(split).tolist()
    rids = [ds.records[r]["request_id"] for r in reqs]
    _, _, ends = analyzer_results(recording, probe_path, rids)
    s = np.asarray([ends[rid]["answer_risk"] for rid in rids if rid in ends])
    y = np.asarray([ds.labels[r] for r, rid in zip(reqs, rids) if rid in ends])
    data = json.loads(Path(probe_path).read_text())
    data["threshold"] = calibrate(s[y == 0], rate)
    data.setdefault("training", {})["threshold"] = (
        f"answer_risk >= threshold on at most {rate:.0%} of the correct {split} answers ({int((y == 0).sum())}) "
        f"of {ds.header.get('command') or 'the labels file'}, recalibrated by replaying this file's analyzer")
    Path(out).write_text(json.dumps(data, indent=1) + "\n")
    held = replay_scores(ds, recording, out)
    return {"threshold": data["threshold"], "false_alert_rate": held["false_alert_rate"], "recall": held["recall"],
            "answer_auc": held["answer_auc"], "answer_ci": held["answer_ci"]}
