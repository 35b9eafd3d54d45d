"""Alert policies (mia_stream/analyzers/_alerts.py) and alert actions' configs (_actions.py), without an engine.

The policy's vectorized update is checked against a plain per-request loop written from the documented rules,
on random score sequences split into random batches (so batching never changes an alert), and every bad config
is a one-line AnalyzerConfigError naming the key.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from mia_stream.analyzers._alerts import AlertAction, AlertPolicy, risk_column
from mia_stream.errors import AnalyzerConfigError


def reference_alerts(seq, threshold, mode, window, min_hits, cooldown):
    """The documented rules, one row at a time: k of the last n scored rows hot ("tokens"), or the mean of the
    last n (a full window) at or above the threshold ("mean"); one alert per request, or one per cooldown rows."""
    scored, out, last = [], [], None
    for r in seq:
        if math.isnan(r):
            out.append(False)
            continue
        scored.append(r)
        win = scored[-window:]
        if mode == "tokens":
            fires = sum(x >= threshold for x in win) >= min_hits
        else:
            fires = len(scored) >= window and sum(win) / window >= threshold
        i = len(scored) - 1
        allowed = last is None or (cooldown is not None and i - last >= cooldown)
        out.append(fires and allowed)
        if fires and allowed:
            last = i
    return out


def _run_batched(policy, seqs, rng):
    """Feed every request's sequence through ``policy.update`` in random chunks: several requests per call,
    1-3 rows of each, the requests' rows interleaved at random (each request's own rows in order)."""
    cursors = {rid: 0 for rid in seqs}
    got = {rid: [] for rid in seqs}
    while any(cursors[r] < len(seqs[r]) for r in seqs):
        ids = [r for r in seqs if cursors[r] < len(seqs[r]) and rng.random() < 0.8]
        if not ids:
            continue
        takes = []
        for rid in ids:
            n = int(rng.integers(1, 4))
            takes.append(seqs[rid][cursors[rid]:cursors[rid] + n])
            cursors[rid] += len(takes[-1])
        rr = np.concatenate([np.full(len(t), i) for i, t in enumerate(takes)])
        rng.shuffle(rr)  # which request each row slot belongs to, interleaved
        risk = np.empty(len(rr))
        for i, t in enumerate(takes):
            risk[rr == i] = t  # the request's rows, in its order
        alerts = policy.update(ids, rr, risk)
        for i, rid in enumerate(ids):
            got[rid] += alerts[rr == i].tolist()
    return got


@pytest.mark.parametrize("mode,window,min_hits,cooldown", [
    ("tokens", 1, 1, None), ("tokens", 4, 2, None), ("tokens", 5, 3, 0), ("tokens", 3, 3, 4),
    ("mean", 4, 1, None), ("mean", 2, 1, 3), ("mean", 1, 1, 0)])
def test_vectorized_policy_equals_the_per_row_rules_whatever_the_batching(mode, window, min_hits, cooldown):
    rng = np.random.default_rng(window * 31 + min_hits)
    threshold = 0.625
    seqs = {}
    for r in range(7):
        n = int(rng.integers(0, 40))
        x = rng.integers(0, 9, n) / 8.0  # multiples of 1/8: window sums are exact in any order
        x[rng.random(n) < 0.1] = np.nan  # rows an analyzer did not score
        seqs[f"req-{r}"] = x.tolist()
    raw = {"threshold": threshold, "mode": mode, "window": window, "cooldown": cooldown}
    if mode == "tokens":
        raw["min_hits"] = min_hits
    for trial in range(3):
        policy = AlertPolicy.from_config(raw)
        got = _run_batched(policy, seqs, np.random.default_rng(trial))
        for rid, seq in seqs.items():
            want = reference_alerts(seq, threshold, mode, window, min_hits, cooldown)
            assert got[rid] == want, (rid, seq)
    assert any(any(reference_alerts(s, threshold, mode, window, min_hits, cooldown)) for s in seqs.values())


def test_debounce_needs_k_of_the_last_n_and_fires_once_per_request():
    policy = AlertPolicy.from_config({"threshold": 0.5, "window": 3, "min_hits": 2})
    # one hot token alone does not alert; two within three do; afterwards: silent (one alert per request)
    seq = [0.9, 0.1, 0.1, 0.9, 0.2, 0.8, 0.9, 0.9]
    alerts = [bool(policy.update(["a"], [0], [x])[0]) for x in seq]
    assert alerts == [False, False, False, False, False, True, False, False]
    assert policy.state("a")["alerted"]
    policy.release("a")
    assert policy.state("a") is None
    assert policy.update(["a"], [0, 0], [0.9, 0.9]).tolist() == [False, True]  # a fresh request under that id


def test_a_requests_alerts_do_not_depend_on_other_requests_in_the_call():
    policy = AlertPolicy.from_config({"threshold": 0.5, "window": 2, "min_hits": 2})
    out = policy.update(["a", "b"], [0, 1, 0, 1], [0.9, 0.1, 0.9, 0.9])
    assert out.tolist() == [False, False, True, False]
    assert policy.update(["b"], [0], [0.9]).tolist() == [True]


def test_describe_says_the_rule():
    p = AlertPolicy.from_config({"value": "risk", "threshold": 0.7, "window": 4, "min_hits": 2, "action": "abort"})
    assert p.describe() == "alert when 2 of the last 4 tokens with risk >= 0.7, once per request; then abort the request"
    assert AlertPolicy.from_config(None) is None


def test_risk_column_takes_one_score_per_row():
    assert risk_column({"risk": np.asarray([0.1, 0.2], np.float32)}, "risk").dtype == np.float64
    assert risk_column({"risk": np.ones((3, 1))}, "risk").shape == (3,)
    assert risk_column({}, "risk") is None
    with pytest.raises(AnalyzerConfigError, match=r"value 'norm' has \(2,\) entries per row"):
        risk_column({"norm": np.ones((3, 2))}, "norm", "watcher")


@pytest.mark.parametrize("raw,message", [
    ("0.5", r"alert must be an object"),
    ({"treshold": 0.5}, r"unknown key\(s\) \['treshold'\]"),
    ({"threshold": "high"}, r"alert.threshold must be a finite number, got 'high'"),
    ({"threshold": float("nan")}, r"alert.threshold must be a finite number"),
    ({"threshold": True}, r"alert.threshold must be a finite number, got True"),
    ({"window": 0}, r"alert.window must be an integer in 1..4096, got 0"),
    ({"window": 2.5}, r"alert.window must be an integer in 1..4096, got 2.5"),
    ({"window": 2, "min_hits": 3}, r"alert.min_hits \(3\) cannot exceed alert.window \(2\)"),
    ({"mode": "max"}, r"alert.mode must be one of \['tokens', 'mean'\], got 'max'"),
    ({"mode": "mean", "window": 3, "min_hits": 2}, r"alert.min_hits applies to mode 'tokens'"),
    ({"cooldown": -1}, r"alert.cooldown must be an integer >= 0, got -1"),
    ({"value": ""}, r"alert.value must be the name of a result column"),
    ({"action": "stop"}, r"alert.action must be null, \"abort\" or"),
    ({"action": {"steer": []}}, r"alert.action.steer must be a non-empty list of steering ops"),
    ({"action": {"steer": [{"layer": 3, "op": "add", "vector": [1.0]}], "command": "clear"}},
     r"alert.action.command must be one of \['add', 'replace'\], got 'clear'"),
    ({"action": {"steer": [{"layer": 3, "op": "add", "vector": [1.0]}], "when": 1}},
     r"alert.action has unknown key\(s\) \['when'\]"),
    ({"action": {"steer": [{"layer": 3, "op": "multiply", "vector": [1.0, 2.0]}]}},
     r"alert.action.steer\[0\]\['op'\]: must be one of \['add', 'cap', 'ablate'\], got 'multiply'"),
    ({"action": {"steer": [{"layer": -1, "op": "add", "vector": [1.0, 2.0]}]}},
     r"alert.action.steer\[0\]\['layer'\]: must be a layer index"),
    ({"action": {"steer": [{"layer": 3, "op": "add", "vector": [1.0, float("nan")]}]}},
     r"alert.action.steer\[0\]\['vector'\]: contains NaN or inf"),
    ({"action": {"steer": [{"layer": 3, "op": "add", "vector": {"name": "no-such-vector-xyz"}}]}},
     r"alert.action.steer\[0\]: no registered vector named 'no-such-vector-xyz'"),
    ({"action": {"steer": [{"layer": 3, "op": "add", "vector": [1.0], "gain": 2}]}},
     r"alert.action.steer\[0\].*unknown key"),
])
def test_bad_policy_configs_are_one_line_errors_naming_the_key(raw, message, tmp_path, monkeypatch):
    monkeypatch.setenv("MIA_STREAM_VECTORS", str(tmp_path))  # an empty vector store
    with pytest.raises(AnalyzerConfigError, match=message) as err:
        AlertPolicy.from_config(raw, "token_probe config")
    text = str(err.value)
    assert text.startswith("token_probe config: ") and "\n" not in text
    assert isinstance(err.value, ValueError)


def test_actions_become_steering_commands(tmp_path, monkeypatch):
    monkeypatch.setenv("MIA_STREAM_VECTORS", str(tmp_path))
    from mia_stream.spec.vectors import register_vector

    register_vector("truth", np.ones(8, np.float32))
    abort = AlertAction.parse("abort")
    cmd = abort.command_for("r1")
    assert (cmd.action, cmd.request_id, cmd.ops) == ("abort", "r1", [])
    steer = AlertAction.parse({"steer": [{"layer": 5, "op": "add", "vector": {"name": "truth"}, "scale": 4.0}],
                               "command": "replace"})
    cmd2 = steer.command_for("r2")
    assert cmd2.action == "replace" and cmd2.ops == [{"layer": 5, "op": "add", "vector": {"name": "truth"},
                                                      "scale": 4.0}]
    assert cmd2.command_id != steer.command_for("r2").command_id  # a fresh id per command
    assert steer.describe() == "steer it (replace 1 op(s) at layer(s) [5])"


def test_a_detectors_policy_defaults_to_its_own_threshold_and_checks_the_value_name():
    p = AlertPolicy.for_analyzer(None, "token_probe config", threshold=0.7, values=("risk", "window_risk"))
    assert (p.value, p.threshold, p.window, p.min_hits, p.cooldown, p.action) == ("risk", 0.7, 1, 1, 0, None)
    out = p.judge(["a", "b"], [0, 1, 0, 1], {"risk": np.asarray([0.69, 0.71, 0.9, 0.8], np.float32),
                                             "window_risk": np.zeros(4, np.float32)})
    assert out.tolist() == [False, True, True, True]  # every row at or above the threshold is flagged
    q = AlertPolicy.for_analyzer({"value": "window_risk", "window": 2, "min_hits": 2}, "token_probe config",
                                 threshold=0.7, values=("risk", "window_risk"))
    assert (q.value, q.threshold) == ("window_risk", 0.7)
    with pytest.raises(AnalyzerConfigError, match=r"^token_probe config: alert.value must be one of the per-token "
                                                  r"values \['risk', 'window_risk'\], got 'p_hallucination'$"):
        AlertPolicy.for_analyzer({"value": "p_hallucination"}, "token_probe config", threshold=0.5,
                                 values=("risk", "window_risk"))


def test_the_detectors_take_their_alerts_from_the_shared_policy(tmp_path):
    """token_probe (issue 15's detectors share _risk.RiskDetector) with a debounced alert config: its published
    alert flags are the policy's rules applied to its published risks."""
    from mia_stream.analyzers import create
    from mia_stream.analyzers._probe import sigmoid
    from test_hallucination_detectors import _hs_batch, _probe_file, _run, _start

    rng = np.random.default_rng(3)
    probe, path = _probe_file(tmp_path, "token_probe", rng=rng)
    cap = {"hidden_states": {"layers": [0, 1], "positions": "all"}}
    hs = rng.standard_normal((2, 40, 8)).astype(np.float32) * 3
    batches = [_hs_batch(0, ["a"], [np.arange(2)], hs[:, :2])]
    batches += [_hs_batch(s, ["a"], [np.asarray([s + 1])], hs[:, s + 1:s + 2]) for s in range(1, 39)]
    risk_ref = sigmoid(probe.logits(hs[1, 2:40]))
    threshold = float(np.quantile(risk_ref, 0.6))
    for alert, want in [(None, [bool(r >= threshold) for r in risk_ref.astype(np.float32)]),
                        ({"window": 3, "min_hits": 2, "cooldown": None}, None)]:
        analyzer = create("token_probe", {"probe": str(path), "threshold": threshold, "alert": alert})
        rows = [a for a in _run(analyzer, [_start("a", 2, cap)], batches, ["a"])["a"] if a.step >= 0]
        risk = np.concatenate([a.values["risk"] for a in rows])
        got = [x for a in rows for x in a.alerts]
        if want is None:
            want = reference_alerts(risk.astype(np.float64).tolist(), threshold, "tokens", 3, 2, None)
            assert sum(want) == 1
        assert got == want and sum(got) >= 1
    with pytest.raises(AnalyzerConfigError, match=r"^token_probe config: alert.window must be an integer"):
        create("token_probe", {"probe": str(path), "alert": {"window": 0}})
