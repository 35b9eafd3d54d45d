"""Live monitoring and acting on the real engine with the shipped detector: the ``token_probe`` analyzer process
(its shipped probe file, ``probes/token-probe-smollm2-135m.json``, and that file's calibrated threshold) scores
every generated token, alerts, and aborts or steers the request through the broker; the recorder process,
replay, and the terminal monitor show it.

Real components: the session vLLM engine (CPU) and broker, the analyzer and the recorder as processes of their
own, the terminal view in a pseudo-terminal. Two questions of the probe's held-out entities (its split never
trained on them), asked as the probe's data asked them (chat template, "Answer in a few words."), greedy: the
embedded model answers Germany's capital right and Yttrium's atomic number wrong; the labeller
(``hallucination_data.check_answer`` / ``answer_span``) says which and where the claim is.

Checked, as a user sees it: the right answer raises no alert; the wrong answer's alerts fall on its claim's
tokens and on none of its function words. The expected risks are recomputed here, independently of the
analyzer, from the probe file's formula ``sigmoid(((h - mean) / scale) . w + b)`` written out in this file, on
Hugging Face transformers' residual of the probe's layer (and on the captured rows). The action: the alert is
raised at the first row whose recomputed risk reaches the file's threshold; the abort/steer is acked 1..K steps
after it; the request ends "abort" with nothing computed after the acked step (abort); frames carry the new
steering version from the acked step, where the probe's direction is ablated, so that the risk falls to the
file's bias term ``sigmoid(b - (mean / scale) . w)`` (steer). The published scores equal those of the same
analyzer replayed on the recording; the terminal monitor shows the text, the alert and the action.

K: frame (drain) -> broker -> analyzer -> broker -> actor -> broker -> engine, taken at the next schedule(); the
closed-loop test measured +1 step for one hop less; K = 4 leaves slack for this shared 2-core machine.
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
import uuid
from pathlib import Path

import numpy as np
import pytest

from bus_helpers import PY, _env, kill, stats, wait_for
from monitoring_helpers import PtyScreen, monitor_argv
from producer_helpers import collecting, hf_trace

pytestmark = pytest.mark.slow

K = 4
N_TOKENS = 24
PROBES = Path(__file__).resolve().parents[1] / "mia_stream" / "analyzers" / "probes"
PROBE_FILE = PROBES / "token-probe-smollm2-135m.json"  # the analyzer's default and the in-engine detectors' probe
HELPERS = Path(__file__).resolve().parent / "monitoring_helpers.py"
# the probe's held-out entities (hallucination_data.entity_split: "test"); the model's answers: right / wrong
RIGHT = {"question": "What is the capital of Germany?", "answer": "Berlin", "answers": ["Berlin"], "kind": "capital",
         "relation": "capital", "group": "country:DE"}
WRONG = {"question": "What is the atomic number of Yttrium?", "answer": "39", "answers": ["39"],
         "kind": "first_number", "relation": "atomic_number", "group": "element:Y"}


def _probe():
    raw = json.loads(PROBE_FILE.read_text())
    return {k: np.asarray(raw[k], np.float64) for k in ("mean", "scale", "weights")} | {
        "bias": float(raw["bias"]), "threshold": float(raw["threshold"]), "layer": int(raw["layer"])}


PROBE = _probe()
LAYER = PROBE["layer"]


def probe_logit(h) -> np.ndarray:
    """The probe file's formula, written out here: ((h - mean) / scale) . w + b, per row."""
    h = np.atleast_2d(np.asarray(h, np.float64))
    return ((h - PROBE["mean"]) / PROBE["scale"]) @ PROBE["weights"] + PROBE["bias"]


def probe_risk(h) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-probe_logit(h)))


def _prompt_ids(model_dir, item):
    from transformers import AutoTokenizer

    from mia_stream.lab import hallucination_data as hd

    tok = AutoTokenizer.from_pretrained(model_dir)
    text = tok.apply_chat_template(hd.chat_messages(item), add_generation_prompt=True, tokenize=False)
    return tok(text, add_special_tokens=False)["input_ids"], tok


def _params(spec, ignore_eos):
    from vllm import SamplingParams

    return SamplingParams(max_tokens=N_TOKENS, temperature=0.0, ignore_eos=ignore_eos,
                          extra_args={"mia_stream": spec})


def _spec(rid):
    return {"capture": {"hidden_states": {"layers": [LAYER], "positions": "generated"}}, "id": rid}


class Run:
    """One monitored request: the ``token_probe`` analyzer process (alerts; acting on the first one when
    ``action`` is set), the recorder process, a collector."""

    def __init__(self, engine, broker, model_dir, tmp: Path, item: dict, action, ignore_eos: bool):
        from mia_stream.lab import hallucination_data as hd

        self.item, self.action = item, action
        kind = "plain" if action is None else "abort" if action == "abort" else "steer"
        self.rid = f"mon-{kind}-{uuid.uuid4().hex[:6]}"
        self.tmp, self.broker = tmp, broker
        self.config = {"probe": PROBE_FILE.name} | ({} if action is None else {"alert": {"action": action}})
        (tmp / "config.json").write_text(json.dumps(self.config))
        self.rec = tmp / "rec"
        prompt, tok = _prompt_ids(model_dir, item)
        recorder = subprocess.Popen([PY, "-m", "mia_stream.cli", "record", str(self.rec), "--broker", broker,
                                     "--patterns", self.rid], env=_env(), stderr=subprocess.PIPE, text=True)
        analyzer = subprocess.Popen([PY, str(HELPERS), "analyze", "token_probe", "--source", broker, "--publish",
                                     broker, "--patterns", self.rid, "--config", str(tmp / "config.json"),
                                     "--max-streams", "1", "--out", str(tmp / "live.jsonl"),
                                     "--actions", str(tmp / "actions.json")],
                                    env=_env(), stderr=subprocess.PIPE, text=True)
        try:
            wait_for(lambda: sum(self.rid in c["patterns"] for c in stats(broker)["consumers"].values()) >= 2, 60)
            with collecting(broker, [self.rid]) as col:
                self.out = engine.generate([{"prompt_token_ids": prompt}], _params(_spec(self.rid), ignore_eos),
                                           use_tqdm=False)[0]
                col.wait_ended([self.rid])
                assert analyzer.wait(60) == 0, analyzer.stderr.read()
                self.analyzer_stderr = analyzer.stderr.read()
                # The action's outcome and the analyzer's last rows may come after the request's end: the analyzer
                # has exited, so everything it published is on its way; read until the outcome and a row for every
                # position it printed have come (each analyzer's results are a stream of their own).
                printed = {p for line in (tmp / "live.jsonl").read_text().splitlines()
                           for p in json.loads(line)["positions"]}

                def complete() -> bool:
                    got = col.kinds(self.rid, "analysis")
                    risk = {p for e in got if e.analysis.analyzer == "token_probe" for p in e.analysis.positions}
                    acted = action is None or any(e.analysis.analyzer == "alert_action" for e in got)
                    return acted and printed <= risk

                deadline = time.monotonic() + 10
                while not complete() and time.monotonic() < deadline:
                    for ev in col._stream._source.events(timeout=0.2):
                        col.events[ev.stream.request_id].append(ev)
            self.col = col
            time.sleep(0.5)
            recorder.send_signal(signal.SIGINT)
            assert recorder.wait(30) == 0, recorder.stderr.read()
        finally:
            kill(analyzer)
            kill(recorder)
        self.actions = json.loads((tmp / "actions.json").read_text())
        self.live = [json.loads(x) for x in (tmp / "live.jsonl").read_text().splitlines()]
        self.prompt_len = len(self.out.prompt_token_ids)
        self.frames = self.col.frames(self.rid)
        # what the labeller says of the answer, and which generated tokens are its claim
        c = self.out.outputs[0]
        self.text = c.text
        self.correct = hd.check_answer(item, c.text)
        span = hd.answer_span(item, c.text)
        self.claim = set(hd.span_token_indices(hd.token_char_ranges(tok, list(c.token_ids)), span))

    def analysis(self, analyzer):
        return [e.analysis for e in self.col.kinds(self.rid, "analysis") if e.analysis.analyzer == analyzer]

    def published(self):
        """{position: (risk, alert)} of the token rows the broker delivered from the analyzer."""
        return {p: (float(r), bool(al)) for a in self.analysis("token_probe") if a.step >= 0
                for p, r, al in zip(a.positions, a.value("risk"), a.alerts)}

    def answer_row(self):
        """The end-of-request row (position -1): answer_risk and its alert."""
        rows = [(float(a.value("answer_risk")[0]), bool(a.alerts[0])) for a in self.analysis("token_probe")
                if a.step < 0]
        assert len(rows) == 1, rows
        return rows[0]

    def scored_rows(self):
        """(step, position, recomputed risk, h . u, |h|, steering_version) of every captured row, from the frames;
        u the unit vector of the probe's direction w / scale."""
        d = PROBE["weights"] / PROBE["scale"]
        unit = d / np.linalg.norm(d)
        out = []
        for f in self.frames:
            for pos, h in zip(f.positions, f.tensors["hs"][0]):
                out.append((f.step, pos, float(probe_risk(h)[0]), float(np.asarray(h, np.float64) @ unit),
                            float(np.linalg.norm(h)), f.steering_version))
        return out


@pytest.fixture(scope="module")
def right_run(engine, broker_address, model_dir, tmp_path_factory):
    return Run(engine, broker_address, model_dir, tmp_path_factory.mktemp("right"), RIGHT, None, False)


@pytest.fixture(scope="module")
def wrong_run(engine, broker_address, model_dir, tmp_path_factory):
    return Run(engine, broker_address, model_dir, tmp_path_factory.mktemp("wrong"), WRONG, None, False)


@pytest.fixture(scope="module")
def abort_run(engine, broker_address, model_dir, tmp_path_factory):
    return Run(engine, broker_address, model_dir, tmp_path_factory.mktemp("abort"), WRONG, "abort", True)


@pytest.fixture(scope="module")
def steer_run(engine, broker_address, model_dir, tmp_path_factory):
    d = PROBE["weights"] / PROBE["scale"]
    ablate = {"layer": LAYER, "op": "ablate", "vector": (d / np.linalg.norm(d)).tolist()}
    return Run(engine, broker_address, model_dir, tmp_path_factory.mktemp("steer"), WRONG, {"steer": [ablate]}, True)


def _hf_risks(run, hf_model, before_step=None):
    """{position: risk} from Hugging Face transformers' residual of the probe's layer on the same tokens."""
    full = list(run.out.prompt_token_ids) + list(run.out.outputs[0].token_ids)
    ref_hs, _, _, _ = hf_trace(hf_model, full[:-1])
    risks = probe_risk(ref_hs[LAYER][:len(full) - 1].astype(np.float64))
    return {pos: float(risks[pos]) for step, pos, *_ in run.scored_rows()
            if before_step is None or step < before_step}


def test_the_shipped_probe_raises_no_alert_on_a_right_answer_and_alerts_on_the_wrong_claim(right_run, wrong_run,
                                                                                          hf_model):
    thr = PROBE["threshold"]
    assert right_run.correct and not wrong_run.correct, (right_run.text, wrong_run.text)
    assert wrong_run.claim, wrong_run.text
    for run in (right_run, wrong_run):
        got = run.published()
        want = _hf_risks(run, hf_model)
        # every generated token but the last (no step computes its row) has a published score
        assert sorted(got) == sorted(want) == list(range(run.prompt_len, run.prompt_len +
                                                          len(run.out.outputs[0].token_ids) - 1))
        for pos, (risk, alert) in got.items():
            assert abs(risk - want[pos]) < 5e-3, (run.text, pos, risk, want[pos])
            if abs(want[pos] - thr) > 5e-3:  # the alert is the file's threshold on the risk
                assert alert == (want[pos] >= thr), (run.text, pos, risk, want[pos], thr)
        alerted = {p - run.prompt_len for p, (_, al) in got.items() if al}
        answer_risk, answer_alert = run.answer_row()
        assert abs(answer_risk - max(r for r, _ in got.values())) < 1e-6
        if run is right_run:  # what the user sees: nothing flagged on a right answer
            assert not alerted and not answer_alert, (run.text, got)
        else:  # the wrong claim flagged, and no function word
            assert alerted and alerted <= run.claim, (run.text, run.claim, got)
            assert answer_alert
            print(f"\nright {right_run.text!r}: max risk {max(r for r, _ in right_run.published().values()):.3f}; "
                  f"wrong {run.text!r}: alerts on tokens {sorted(alerted)} (claim {sorted(run.claim)}), "
                  f"threshold {thr:.3f}")


def _check_alert(run):
    """The policy alerted on the first row whose recomputed risk reaches the file's threshold, a token of the wrong
    claim, and the action was acked 1..K steps later."""
    thr = PROBE["threshold"]
    assert len(run.actions) == 1, (run.actions, run.analyzer_stderr)
    act = run.actions[0]
    assert act["ok"] and act["error"] is None, act
    rows = run.scored_rows()
    first = next(r for r in rows if r[2] >= thr)
    assert (act["alert_step"], act["alert_position"]) == (first[0], first[1])
    assert first[1] - run.prompt_len in run.claim, (run.text, run.claim, first)
    assert abs(act["risk"] - first[2]) < 1e-4
    applied = act["applied_step"]
    assert act["alert_step"] < applied <= act["alert_step"] + K, act
    # the detector's own stream flags that row first; the actor's outcome names the acked step
    flagged = sorted((a.step, p) for a in run.analysis("token_probe") for p, al in zip(a.positions, a.alerts)
                     if al and a.step >= 0)
    assert flagged[0] == (first[0], first[1])
    outcome, = run.analysis("alert_action")
    assert outcome.positions == [first[1]] and outcome.alerts == [True]
    assert int(outcome.values["applied_step"][0]) == applied == outcome.step
    assert int(outcome.values["alert_step"][0]) == act["alert_step"]
    assert outcome.labels["source"] == ["token_probe"] and outcome.labels["error"] == [None]
    print(f"\n{run.rid}: alert at step {act['alert_step']} (position {act['alert_position']}, risk "
          f"{act['risk']:.3f}), applied at step {applied} (+{applied - act['alert_step']}); frame -> actor "
          f"{act['alert_latency_ms']:.1f} ms, actor -> ack {act['reaction_ms']:.1f} ms")
    return applied, rows


def test_an_alert_aborts_the_request_at_the_acked_step(abort_run):
    run = abort_run
    applied, rows = _check_alert(run)
    assert run.actions[0]["steering_version"] >= 0
    assert run.out.outputs[0].finish_reason == "abort"
    end = run.col.kinds(run.rid, "end")[0].end
    assert end.finish_reason == "abort"
    assert max(r[0] for r in rows) <= applied  # nothing computed for it after the abort step
    # row p (computed at step s) chose token p+1: one more token per step until the abort step
    at_alert = run.actions[0]["alert_position"] - run.prompt_len + 1
    n = len(run.out.outputs[0].token_ids)
    assert at_alert < n <= at_alert + K and n < N_TOKENS and end.num_generated_tokens == n


def test_an_alert_steers_the_request_from_the_acked_step(steer_run):
    run = steer_run
    applied, rows = _check_alert(run)
    assert run.actions[0]["steering_version"] == 1
    before = [r for r in rows if r[0] < applied]
    after = [r for r in rows if r[0] >= applied]
    assert before and len(after) >= 4
    assert {r[5] for r in before} == {0} and {r[5] for r in after} == {1}
    # the probe's direction ablated from the acked step on: the risk is the file's bias term alone
    v = PROBE["weights"] / PROBE["scale"]
    c = PROBE["bias"] - (PROBE["mean"] / PROBE["scale"]) @ PROBE["weights"]
    floor = 1 / (1 + np.exp(-c))
    risk = {p: r for p, (r, _) in run.published().items()}
    for step, pos, _, proj, norm, _ in after:
        assert abs(proj) < 1e-3 * norm, (step, pos, proj, norm)
        assert abs(risk[pos] - floor) <= abs(proj) * np.linalg.norm(v) * 0.25 + 1e-4, (pos, risk[pos], floor)
        assert risk[pos] < PROBE["threshold"]
    assert run.out.outputs[0].finish_reason == "length" and len(run.out.outputs[0].token_ids) == N_TOKENS


@pytest.mark.parametrize("which", ["abort", "steer"])
def test_live_scores_equal_the_replayed_and_recomputed_scores(which, abort_run, steer_run, tmp_path):
    run = abort_run if which == "abort" else steer_run
    # the same analyzer on the recording, as a process (its action is not taken on a recording)
    out = subprocess.run([PY, str(HELPERS), "analyze", "token_probe", "--source", str(run.rec), "--config",
                          str(run.tmp / "config.json"), "--out", str(tmp_path / "replay.jsonl"),
                          "--actions", str(tmp_path / "actions.json")], env=_env(), capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    assert "is not taken on a recording" in out.stderr
    assert json.loads((tmp_path / "actions.json").read_text()) == []
    replay = [json.loads(x) for x in (tmp_path / "replay.jsonl").read_text().splitlines()]
    assert replay == run.live and len(replay) >= 8  # every row, value and alert, to the bit (JSON of float32)
    # what the broker delivered to another consumer is the same
    delivered = run.published()
    printed = {p: (r, al) for line in run.live if "risk" in line["values"]  # token rows (not the end row)
               for p, r, al in zip(line["positions"], line["values"]["risk"], line["alerts"])}
    assert delivered == {p: (r, bool(al)) for p, (r, al) in printed.items()}
    # recomputed here from the captured frames with the file's formula
    for _, pos, want, *_ in run.scored_rows():
        assert abs(delivered[pos][0] - want) < 1e-5, (pos, delivered[pos][0], want)


def test_scores_before_the_action_match_hugging_face(abort_run, hf_model):
    run = abort_run
    want = _hf_risks(run, hf_model, before_step=run.actions[0]["applied_step"])
    got = run.published()
    assert len(want) >= 8
    for pos, r in want.items():
        assert abs(got[pos][0] - r) < 5e-3, (pos, got[pos][0], r)


def test_the_terminal_monitor_shows_the_recording(abort_run, tmp_path, model_dir):
    run = abort_run
    screen = PtyScreen(monitor_argv(run.rec, "--lines", "6"), cols=160, rows=40,
                       stderr_path=tmp_path / "monitor.err")
    try:
        assert screen.drain(120) == 0, (tmp_path / "monitor.err").read_text()
        text = screen.text
        act = run.actions[0]
        assert f"{run.rid}  abort  {len(run.out.outputs[0].token_ids)} tokens" in text, text
        assert f"ALERT at position {act['alert_position']} (token_probe)" in text, text
        assert (f"-> abort on token_probe alert at step {act['alert_step']}: applied at step "
                f"{act['applied_step']}") in text, text
        assert "risk = token_probe.risk" in text
        # the generated text is on screen (the last words of it at least), the alert token marked
        shown = text.replace("!", "")
        words = [w for w in run.out.outputs[0].text.split()[-6:] if len(w) > 2]
        assert words and sum(w in shown for w in words) >= len(words) - 1, (words, text)
        assert "!" in text
    finally:
        screen.close()
