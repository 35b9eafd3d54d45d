"""In-engine detectors (issue 25) on the session's real vLLM engine (CPU, float32, torch.compile on).

A request names detectors in its spec (``detect``); the engine scores them in the forward pass (the
``mia_stream::project`` op at the probe's layer), judges the alert policy in the engine core at the step boundary,
acts before the next step, and publishes the scores as ``analysis`` batches (``engine:<name>``) with
``alert_action`` outcomes. References here are independent of the code under test: the probe file's own formula
``sigmoid(((h - mean) / scale) . w + b)`` evaluated in float64 from the JSON on the captured rows, the
``token_probe`` analyzer run on a recording of the same stream, and vLLM's own outputs (finish reason, tokens).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import pytest

from producer_helpers import collecting
from test_monitor import browser  # noqa: F401  (the monitor tests' headless Chromium fixture)

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
PROBE = REPO / "mia_stream" / "analyzers" / "probes" / "token-probe-smollm2-135m.json"
PROMPTS = ["The capital of France is", "The atomic number of oxygen is", "Once upon a time, there was a"]


def _params(spec, max_tokens=16):
    from vllm import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, extra_args={"mia_stream": spec})


def _probe_formula(h: np.ndarray) -> np.ndarray:
    """The probe file's definition, from its JSON, in float64 (written here, not with the project's loader)."""
    d = json.loads(PROBE.read_text())
    z = (h.astype(np.float64) - np.asarray(d["mean"])) / np.asarray(d["scale"])
    return 1.0 / (1.0 + np.exp(-(z @ np.asarray(d["weights"]) + d["bias"])))


def _analysis(col, rid, analyzer, final=None):
    """The analysis rows of one analyzer for one request: all, the per-step rows (``final=False``) or its final
    (step -1) rows (``final=True``)."""
    return [e.analysis for e in col.events[rid] if e.kind == "analysis" and e.analysis.analyzer == analyzer
            and (final is None or (e.analysis.step == -1) == final)]


def _scores(col, rid, name="engine:token_probe"):
    an = _analysis(col, rid, name, final=False)
    if not an:
        return np.zeros(0, np.int64), np.zeros(0)
    return (np.concatenate([a.positions for a in an]).astype(np.int64),
            np.concatenate([np.asarray(a.values["risk"], np.float64) for a in an]))


def _wait_for(col, rid, pred, timeout=20.0):
    deadline = time.monotonic() + timeout
    while not pred() and time.monotonic() < deadline:
        for ev in col._stream._source.events(timeout=0.2):
            col.events[ev.stream.request_id].append(ev)


def test_every_generated_token_is_scored_as_the_probe_file_defines(engine, broker_address, tmp_path):
    """Parity: the engine's score of every generated row equals the probe formula on the captured row (<= 1e-5
    in float32), and equals what `mia-stream analyze token_probe` publishes from a recording of the same stream;
    the recording replays the engine's scores identically."""
    rids = [f"det-par-{i}-{uuid.uuid4().hex[:6]}" for i in range(len(PROMPTS))]
    rec_dir = tmp_path / "rec"
    recorder = subprocess.Popen([sys.executable, "-m", "mia_stream.cli", "record", str(rec_dir), "--broker",
                                 broker_address, "--patterns", "det-par-*"])
    deadline = time.monotonic() + 60
    while not rec_dir.exists() and time.monotonic() < deadline:  # it subscribes, then makes its directory
        time.sleep(0.1)
    time.sleep(1.0)
    layer = json.loads(PROBE.read_text())["layer"]
    specs = [{"id": r, "capture": {"hidden_states": {"layers": [layer], "positions": "generated"}},
              "detect": [{"probe": PROBE.name}]} for r in rids]
    try:
        with collecting(broker_address, rids) as col:
            outs = engine.generate(PROMPTS, [_params(s) for s in specs], use_tqdm=False)
            col.wait_ended(rids)
            _wait_for(col, rids[-1], lambda: all(len(_scores(col, r)[0]) == 15 for r in rids))
    finally:
        time.sleep(1.0)
        recorder.send_signal(signal.SIGTERM)
        recorder.wait(30)
    for rid, out in zip(rids, outs):
        positions, token_ids, hs = col.stacked(rid, "hs")
        pos, risk = _scores(col, rid)
        plen = len(out.prompt_token_ids)
        # every generated token but the last (never fed back) is scored once, in order
        assert pos.tolist() == list(range(plen, plen + len(out.outputs[0].token_ids) - 1)) == positions
        np.testing.assert_allclose(risk, _probe_formula(hs[0]), rtol=0, atol=1e-5)
    # the analyzer on the recording, and the engine's scores in it
    proc = subprocess.run([sys.executable, "-m", "mia_stream.cli", "analyze", "token_probe", "--source",
                           str(rec_dir), "--print"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    analyzer: dict = {}
    for line in proc.stdout.splitlines():
        d = json.loads(line)
        if d["analyzer"] == "token_probe" and "risk" in d["values"]:
            for p, r in zip(d["positions"], d["values"]["risk"]):
                analyzer[(d["request_id"], p)] = r
    assert analyzer, proc.stdout[:2000]
    from mia_stream.consumers import open_stream

    replayed = {}
    with open_stream(str(rec_dir), patterns=["det-par-*"]) as events:
        for ev in events:
            if ev.kind == "analysis" and ev.analysis.analyzer == "engine:token_probe" and ev.analysis.step >= 0:
                for p, r in zip(ev.analysis.positions, ev.analysis.values["risk"]):
                    replayed[(ev.stream.request_id, int(p))] = float(r)
    for rid in rids:
        pos, risk = _scores(col, rid)
        for p, r in zip(pos.tolist(), risk.tolist()):
            assert replayed[(rid, p)] == r  # replay equals live, to the bit
            assert abs(analyzer[(rid, p)] - r) <= 1e-5


def _alert_first_token(action):
    """A detector whose alert fires on the first scored row (threshold 0: every risk is >= 0)."""
    return [{"probe": PROBE.name, "alert": {"threshold": 0.0}, "action": action}]


def test_an_alert_aborts_the_request_before_its_next_step(engine, broker_address):
    """The first generated row (position = prompt length) alerts; the request ends in that step's update: its
    output is the prefill's token and the one sampled with the alerting row, nothing is computed after it."""
    rid = f"det-abort-{uuid.uuid4().hex[:6]}"
    with collecting(broker_address, [rid]) as col:
        out = engine.generate([PROMPTS[0]], [_params({"id": rid, "detect": _alert_first_token("abort")}, 24)],
                              use_tqdm=False)[0]
        col.wait_ended([rid])
        _wait_for(col, rid, lambda: _analysis(col, rid, "alert_action"))
    plen = len(out.prompt_token_ids)
    assert out.outputs[0].finish_reason == "abort"
    assert len(out.outputs[0].token_ids) == 2  # at most one token computed without the action after the alert
    pos, risk = _scores(col, rid)
    assert pos.tolist() == [plen]
    (act,) = _analysis(col, rid, "alert_action")
    assert act.labels["action"] == ["abort"] and act.labels["source"] == ["engine:token_probe"]
    assert list(act.positions) == [plen]
    assert int(act.values["applied_step"][0]) == int(act.values["alert_step"][0]) + 1
    (end,) = [e.end for e in col.events[rid] if e.kind == "end"]
    assert end.finish_reason == "abort"
    # the detector's final result, sent when the engine freed the request, after its score rows: their max
    _wait_for(col, rid, lambda: _analysis(col, rid, "engine:token_probe", final=True))
    (final,) = _analysis(col, rid, "engine:token_probe", final=True)
    assert final.values["max_risk"][0] == np.float32(risk.max()) and final.values["alert_rows"].tolist() == [1]
    arrived = [e.analysis.step for e in col.events[rid] if e.kind == "analysis" and
               e.analysis.analyzer == "engine:token_probe"]
    assert arrived[-1] == -1  # one publisher, in order: nothing of the detector's comes after its final


def test_an_alert_steers_the_request_from_the_next_step(engine, broker_address):
    """A steering action (add scale * v at layer 12) is applied from the step after the alert: the captured
    rows before it equal an unsteered run's, the first row after it differs by exactly scale * v at that layer,
    and the frames from the applied step on carry the new steering version."""
    layer, scale = 12, 3.0
    rng = np.random.default_rng(7)
    v = rng.standard_normal(576).astype(np.float32)
    ref_id, rid = (f"det-steer-{k}-{uuid.uuid4().hex[:6]}" for k in ("ref", "act"))
    cap = {"hidden_states": {"layers": [layer], "positions": "generated"}}
    action = {"steer": [{"layer": layer, "op": "add", "vector": v.tolist(), "scale": scale}], "command": "add"}
    with collecting(broker_address, [ref_id, rid]) as col:
        engine.generate([PROMPTS[2]], [_params({"id": ref_id, "capture": cap})], use_tqdm=False)
        engine.generate([PROMPTS[2]], [_params({"id": rid, "capture": cap, "detect": _alert_first_token(action)})],
                        use_tqdm=False)
        col.wait_ended([ref_id, rid])
        _wait_for(col, rid, lambda: _analysis(col, rid, "alert_action"))
    (act,) = _analysis(col, rid, "alert_action")
    alert_step, applied = int(act.values["alert_step"][0]), int(act.values["applied_step"][0])
    assert applied == alert_step + 1 and act.labels["error"] == [None]
    assert int(act.values["steering_version"][0]) == 1
    ref = {p: h for f in col.frames(ref_id) for p, h in zip(f.positions, f.tensors["hs"][0])}
    frames = col.frames(rid)
    before = [f for f in frames if f.step < applied]
    after = [f for f in frames if f.step >= applied]
    assert before and after
    assert all(f.steering_version == 0 for f in before) and all(f.steering_version == 1 for f in after)
    for f in before:
        for p, h in zip(f.positions, f.tensors["hs"][0]):
            np.testing.assert_allclose(h, ref[p], atol=1e-4)
    first = after[0]
    np.testing.assert_allclose(first.tensors["hs"][0][0] - ref[first.positions[0]], scale * v, atol=1e-3)


@pytest.mark.parametrize("detect, field", [
    ([{"probe": "no-such-probe"}], "['detect'][0]['probe']"),
    ([{"probe": "lookback-ratio-smollm2-135m.json"}], "['detect'][0]['probe']"),
    ([{"probe": PROBE.name, "alert": {"window": 0}}], "['detect'][0]"),
    ([{"probe": PROBE.name, "action": "explode"}], "['detect'][0]"),
    ([{"probe": PROBE.name, "action": {"steer": [{"layer": 99, "op": "add", "vector": [0.0] * 576}]}}],
     "['detect'][0]['action']"),
    ([{"probe": PROBE.name}, {"probe": PROBE.name}], "['detect'][1]['name']"),
    ({"probe": PROBE.name}, "['detect']"),
])
def test_bad_detectors_are_refused_at_admission_naming_the_field(engine, detect, field):
    with pytest.raises(ValueError) as err:
        engine.generate([PROMPTS[0]], [_params({"detect": detect}, 2)], use_tqdm=False)
    assert f"extra_args['mia_stream']{field}" in str(err.value)


def test_a_probe_for_another_model_is_refused_naming_its_size(engine, tmp_path):
    d = json.loads(PROBE.read_text())
    d.update(hidden_size=8, mean=[0.0] * 8, scale=[1.0] * 8, weights=[0.1] * 8)
    bad = tmp_path / "small.json"
    bad.write_text(json.dumps(d))
    with pytest.raises(ValueError, match=r"hidden size 8 .* this model has 576"):
        engine.generate([PROMPTS[0]], [_params({"detect": [{"probe": str(bad)}]}, 2)], use_tqdm=False)


def test_a_registered_probe_is_named_by_its_name(engine, broker_address):
    """`mia-stream probes add` checks and stores a probe (in the session's MIA_STREAM_PROBES, which the engine's
    processes inherited); a request names it; a malformed file is refused at registration."""
    proc = subprocess.run([sys.executable, "-m", "mia_stream.cli", "probes", "add", "my-risk", str(PROBE)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    bad = subprocess.run([sys.executable, "-m", "mia_stream.cli", "probes", "add", "broken", __file__],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "not valid JSON" in bad.stderr
    rid = f"det-reg-{uuid.uuid4().hex[:6]}"
    with collecting(broker_address, [rid]) as col:
        engine.generate([PROMPTS[1]], [_params({"id": rid, "detect": [{"probe": "my-risk", "name": "mine"}]}, 6)],
                        use_tqdm=False)
        col.wait_ended([rid])
        _wait_for(col, rid, lambda: len(_scores(col, rid, "engine:mine")[0]) == 5)
    pos, risk = _scores(col, rid, "engine:mine")
    assert len(pos) == 5 and np.all((risk > 0) & (risk < 1))


def test_the_monitor_page_shows_in_engine_scores_without_any_capture(engine, broker_address, browser):
    """A request with a detector and no capture at all: the monitor page (a real headless Chromium) colours its
    generated tokens by ``engine:token_probe.risk``, the values the engine published, and marks its alerts."""
    import threading

    from test_monitor import monitor, r4, wait_for_consumer, wait_page

    rid = f"det-mon-{uuid.uuid4().hex[:6]}"
    with monitor(broker_address) as (url, _proc):
        page = browser.new_page(viewport={"width": 1280, "height": 720})
        page.goto(url + f"#request={rid}")
        wait_page(page, lambda d: d["client"] is not None, 30, "a connected event stream")
        wait_for_consumer(broker_address, "monitor-")
        spec = {"id": rid, "detect": [{"probe": PROBE.name, "alert": {"threshold": 0.5}}]}
        with collecting(broker_address, [rid]) as col:
            gen = threading.Thread(target=lambda: engine.generate(
                ["Q: What is the capital of Australia?\nA:"], [_params(spec, 20)], use_tqdm=False))
            gen.start()
            gen.join(300)
            col.wait_ended([rid])
            _wait_for(col, rid, lambda: len(_scores(col, rid)[0]) == 19)
        pos, risk = _scores(col, rid)
        assert not col.frames(rid)  # nothing captured: the scores are all that crossed the bus
        alerts = np.concatenate([a.alerts for a in _analysis(col, rid, "engine:token_probe", final=False)]).astype(bool)
        data = wait_page(page, lambda d: sum(s[2] is not None for s in d["spans"]) >= len(pos), 30,
                         "every in-engine score")
        assert data["scoreKey"] == "engine:token_probe.risk"
        by_pos = {s[0]: s for s in data["spans"]}
        for p, r, a in zip(pos.tolist(), risk.tolist(), alerts.tolist()):
            assert by_pos[p][2] == pytest.approx(r4(r), rel=1e-3)
            assert by_pos[p][5] == a
        page.close()


def test_a_probe_reading_logit_features_scores_with_the_tokens_own_statistics(engine, broker_address, hf_model,
                                                                               tmp_path):
    """A probe with ``logit_features`` (the sampled token's log-probability and its distribution's entropy beside
    the residual): every generated row's risk equals the formula with the residual captured from the same request
    and the two statistics computed here from Hugging Face's logits for the same tokens (float32, both sides)."""
    import torch

    d = json.loads(PROBE.read_text())
    lf = {"names": ["logprob", "entropy"], "mean": [-1.5, 2.0], "scale": [1.2, 0.8], "weights": [-0.9, 0.6]}
    d["logit_features"] = lf
    probe = tmp_path / "probe-with-logits.json"
    probe.write_text(json.dumps(d))
    rid = f"det-lf-{uuid.uuid4().hex[:6]}"
    spec = {"id": rid, "capture": {"hidden_states": {"layers": [d["layer"]], "positions": "generated"}},
            "detect": [{"probe": str(probe)}]}
    with collecting(broker_address, [rid]) as col:
        out = engine.generate([PROMPTS[1]], [_params(spec, 12)], use_tqdm=False)[0]
        col.wait_ended([rid])
        _wait_for(col, rid, lambda: len(_scores(col, rid, "engine:token_probe")[0]) == 11)
    pos, risk = _scores(col, rid, "engine:token_probe")
    positions, _, hs = col.stacked(rid, "hs")
    assert pos.tolist() == positions
    ids = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)
    with torch.no_grad():
        logits = hf_model(torch.tensor([ids])).logits[0].double()
    lp = torch.log_softmax(logits, dim=-1)
    z = (hs[0].astype(np.float64) - np.asarray(d["mean"])) / np.asarray(d["scale"])
    want = []
    for row, p in zip(z, pos.tolist()):
        feats = np.array([float(lp[p - 1, ids[p]]), float(-(lp[p - 1].exp() * lp[p - 1]).sum())])
        logit = row @ np.asarray(d["weights"]) + d["bias"] + ((feats - lf["mean"]) / lf["scale"]) @ lf["weights"]
        want.append(1.0 / (1.0 + np.exp(-logit)))
    np.testing.assert_allclose(risk, want, rtol=0, atol=2e-4)
    # the features matter: without them the risks differ
    plain = 1.0 / (1.0 + np.exp(-(z @ np.asarray(d["weights"]) + d["bias"])))
    assert np.abs(risk - plain).max() > 1e-2


def test_logit_features_need_generated_positions(engine, tmp_path):
    d = json.loads(PROBE.read_text())
    d["logit_features"] = {"names": ["entropy"], "mean": [0.0], "scale": [1.0], "weights": [1.0]}
    probe = tmp_path / "lf.json"
    probe.write_text(json.dumps(d))
    with pytest.raises(ValueError, match=r"\['detect'\]\[0\]\['positions'\].*generated tokens only"):
        engine.generate([PROMPTS[0]], [_params({"detect": [{"probe": str(probe), "positions": "all"}]}, 2)],
                        use_tqdm=False)


def test_the_shipped_free_detector_alerts_when_a_tokens_own_neg_logprob_reaches_its_threshold(engine,
                                                                                                broker_address,
                                                                                                hf_model):
    """``neg-logprob-smollm2-135m.json`` (issue 27: the free per-token baseline as an in-engine detector, no
    residual weights): every generated row's risk is ``sigmoid(-(log p - mean) / scale * w + b)`` of the token's
    own log-probability from Hugging Face's raw logits, and the alert is exactly ``-log p >= -b`` (the file's
    calibrated -log p threshold). Sampled at temperature 1.5 so that some tokens are improbable."""
    import torch
    from vllm import SamplingParams

    d = json.loads((PROBE.parent / "neg-logprob-smollm2-135m.json").read_text())
    assert not any(d["weights"]) and d["logit_features"]["names"] == ["logprob"] and d["threshold"] == 0.5
    lf = d["logit_features"]
    rid = f"det-nlp-{uuid.uuid4().hex[:6]}"
    params = SamplingParams(max_tokens=16, temperature=1.5, seed=3, ignore_eos=True, extra_args={"mia_stream": {
        "id": rid, "detect": [{"probe": "neg-logprob-smollm2-135m.json"}]}})
    with collecting(broker_address, [rid]) as col:
        out = engine.generate([PROMPTS[2]], [params], use_tqdm=False)[0]
        col.wait_ended([rid])
        _wait_for(col, rid, lambda: len(_scores(col, rid, "engine:neg_logprob")[0]) == 15)
    an = _analysis(col, rid, "engine:neg_logprob", final=False)
    pos, risk = _scores(col, rid, "engine:neg_logprob")
    alerts = np.concatenate([np.asarray(a.alerts, bool) for a in an])
    ids = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)
    assert pos.tolist() == list(range(len(out.prompt_token_ids), len(ids) - 1))
    with torch.no_grad():
        lp = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].double(), dim=-1)
    neg = np.array([-float(lp[p - 1, ids[p]]) for p in pos.tolist()])
    logit = (-neg - lf["mean"][0]) / lf["scale"][0] * lf["weights"][0] + d["bias"]
    np.testing.assert_allclose(risk, 1.0 / (1.0 + np.exp(-logit)), rtol=0, atol=2e-4)
    clear = np.abs(neg + d["bias"]) > 1e-3  # not within rounding of the threshold
    assert clear.sum() >= 10 and (alerts[clear] == (neg[clear] >= -d["bias"])).all(), (neg, alerts)
    assert alerts.any() and not alerts.all(), neg  # both sides of the threshold are exercised
