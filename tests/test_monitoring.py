"""Live monitoring and acting on the real engine: a per-token risk analyzer process with an alert policy that
aborts or steers the request through the broker, the recorder process, replay, and the terminal monitor.

Real components: the session vLLM engine (CPU) and broker, the analyzer and the recorder as processes of their
own, the terminal view in a pseudo-terminal. The analyzer (tests/monitoring_helpers.py: ``projection_risk``)
scores each generated token by its layer-L residual on a unit direction, ``risk = sigmoid((h.u - c) / w)``, and
judges the risks with the shared ``AlertPolicy``. As in tests/test_closed_loop.py, the direction and centre come
from an unsteered reference run of the same greedy request, so that the live stream crosses mid-generation, at a
known token.

Checked: the alert is raised at that token's row; the action is acked at a step after the alert's and at most K
steps later; frames carry the new steering version exactly from the acked step on (steer), the request ends with
finish reason "abort" with nothing computed after the acked step (abort); the published scores equal those of
the same analyzer replayed on the recording, and those recomputed here from the captured frames, and (before
any action) from Hugging Face transformers on the same tokens; the terminal monitor shows the request's text,
its alert and the action on the recording.

K: frame (drain) -> broker -> analyzer -> broker -> actor -> broker -> engine, taken at the next schedule(); the
closed-loop test measured +1 step for one hop less; K = 4 leaves slack for this shared 2-core machine.
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

from bus_helpers import PY, _env, kill, stats, wait_for
from monitoring_helpers import PtyScreen, monitor_argv
from producer_helpers import collecting, hf_trace

pytestmark = pytest.mark.slow

LAYER = 12
K = 4
N_TOKENS = 32
PROMPT = "Once upon a time, in a small village by the sea, there lived"
HELPERS = Path(__file__).resolve().parent / "monitoring_helpers.py"


def _params(spec, max_tokens=N_TOKENS):
    from vllm import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, extra_args={"mia_stream": spec})


def _spec(rid):
    return {"capture": {"hidden_states": {"layers": [LAYER], "positions": "generated"}}, "id": rid}


@pytest.fixture(scope="module")
def reference(engine, broker_address):
    """(unit direction, centre, width, crossing index c) from an unsteered run: the direction is the layer-L
    residual of a mid-generation token c, the centre lies between the best earlier score and c's own."""
    rid = f"mon-ref-{uuid.uuid4().hex[:6]}"
    with collecting(broker_address, [rid]) as col:
        engine.generate([PROMPT], _params(_spec(rid)), use_tqdm=False)
        col.wait_ended([rid])
    hs = np.concatenate([f.tensors["hs"][0] for f in col.frames(rid)])  # [generated rows, hidden]
    for c in range(6, len(hs) - 12):
        unit = hs[c] / np.linalg.norm(hs[c])
        scores = hs[:c + 1] @ unit
        if scores[c] > 1.02 * scores[:c].max():
            center = float((scores[:c].max() + scores[c]) / 2)
            return unit.astype(np.float32), center, float((scores[c] - scores[:c].max()) / 8), c
    pytest.fail("no generated row whose own direction separates it from the rows before it")


class Run:
    """One monitored request: the analyzer process acting on alerts, the recorder process, a collector."""

    def __init__(self, engine, broker, reference, tmp: Path, action):
        unit, center, width, _ = reference
        self.rid = f"mon-{'abort' if action == 'abort' else 'steer'}-{uuid.uuid4().hex[:6]}"
        self.tmp, self.broker = tmp, broker
        self.config = {"layer": LAYER, "direction": unit.tolist(), "center": center, "width": width,
                       "alert": {"threshold": 0.5, "action": action}}
        (tmp / "config.json").write_text(json.dumps(self.config))
        self.rec = tmp / "rec"
        recorder = subprocess.Popen([PY, "-m", "mia_stream.cli", "record", str(self.rec), "--broker", broker,
                                     "--patterns", self.rid], env=_env(), stderr=subprocess.PIPE, text=True)
        analyzer = subprocess.Popen([PY, str(HELPERS), "analyze", "--source", broker, "--publish", broker,
                                     "--patterns", self.rid, "--config", str(tmp / "config.json"),
                                     "--max-streams", "1", "--out", str(tmp / "live.jsonl"),
                                     "--actions", str(tmp / "actions.json")],
                                    env=_env(), stderr=subprocess.PIPE, text=True)
        try:
            wait_for(lambda: sum(self.rid in c["patterns"] for c in stats(broker)["consumers"].values()) >= 2, 60)
            with collecting(broker, [self.rid]) as col:
                self.out = engine.generate([PROMPT], _params(_spec(self.rid)), use_tqdm=False)[0]
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
                    risk = {p for e in got if e.analysis.analyzer == "projection_risk" for p in e.analysis.positions}
                    return any(e.analysis.analyzer == "alert_action" for e in got) and printed <= risk

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

    def analysis(self, analyzer):
        return [e.analysis for e in self.col.kinds(self.rid, "analysis") if e.analysis.analyzer == analyzer]

    def scored_rows(self):
        """(step, position, projection, |h|, steering_version) of every captured row, from the frames."""
        d = np.asarray(self.config["direction"], np.float64)
        unit = (d / np.linalg.norm(d)).astype(np.float32)  # as the analyzer normalizes its direction
        out = []
        for f in self.frames:
            for pos, h in zip(f.positions, f.tensors["hs"][0]):
                out.append((f.step, pos, float((h * unit).sum(dtype=np.float64)), float(np.linalg.norm(h)),
                            f.steering_version))
        return out


@pytest.fixture(scope="module")
def abort_run(engine, broker_address, reference, tmp_path_factory):
    return Run(engine, broker_address, reference, tmp_path_factory.mktemp("abort"), "abort")


@pytest.fixture(scope="module")
def steer_run(engine, broker_address, reference, tmp_path_factory):
    unit = reference[0]
    return Run(engine, broker_address, reference, tmp_path_factory.mktemp("steer"),
               {"steer": [{"layer": LAYER, "op": "ablate", "vector": unit.tolist()}]})


def _check_alert(run, reference):
    """The policy alerted on the crossing token's row, and the action was acked 1..K steps later."""
    _, center, _, c = reference
    assert len(run.actions) == 1, (run.actions, run.analyzer_stderr)
    act = run.actions[0]
    assert act["ok"] and act["error"] is None, act
    rows = run.scored_rows()
    first = next(r for r in rows if r[2] >= center)
    assert (act["alert_step"], act["alert_position"]) == (first[0], first[1]) == (first[0], run.prompt_len + c)
    assert act["risk"] > 0.9
    applied = act["applied_step"]
    assert act["alert_step"] < applied <= act["alert_step"] + K, act
    # the detector's own stream flags exactly that row; the actor's outcome names the acked step
    flagged = [(a.step, p) for a in run.analysis("projection_risk") for p, al in zip(a.positions, a.alerts) if al]
    assert flagged == [(first[0], first[1])]
    outcome, = run.analysis("alert_action")
    assert outcome.positions == [first[1]] and outcome.alerts == [True]
    assert int(outcome.values["applied_step"][0]) == applied == outcome.step
    assert int(outcome.values["alert_step"][0]) == act["alert_step"]
    assert outcome.labels["source"] == ["projection_risk"] and outcome.labels["error"] == [None]
    print(f"\n{run.rid}: alert at step {act['alert_step']} (position {act['alert_position']}, risk "
          f"{act['risk']:.3f}), applied at step {applied} (+{applied - act['alert_step']}); frame -> actor "
          f"{act['alert_latency_ms']:.1f} ms, actor -> ack {act['reaction_ms']:.1f} ms")
    return applied, rows


def test_an_alert_aborts_the_request_at_the_acked_step(abort_run, reference):
    run = abort_run
    applied, rows = _check_alert(run, reference)
    assert run.actions[0]["steering_version"] >= 0
    assert run.out.outputs[0].finish_reason == "abort"
    end = run.col.kinds(run.rid, "end")[0].end
    assert end.finish_reason == "abort"
    assert max(r[0] for r in rows) <= applied  # nothing computed for it after the abort step
    # row p (computed at step s) chose token p+1: one more token per step until the abort step
    at_alert = run.actions[0]["alert_position"] - run.prompt_len + 1
    n = len(run.out.outputs[0].token_ids)
    assert at_alert < n <= at_alert + K and n < N_TOKENS and end.num_generated_tokens == n


def test_an_alert_steers_the_request_from_the_acked_step(steer_run, reference):
    run = steer_run
    applied, rows = _check_alert(run, reference)
    assert run.actions[0]["steering_version"] == 1
    before = [r for r in rows if r[0] < applied]
    after = [r for r in rows if r[0] >= applied]
    assert before and len(after) >= 4
    assert {r[4] for r in before} == {0} and {r[4] for r in after} == {1}
    for step, pos, proj, norm, _ in after:  # ablated along u from the acked step on: risk back to ~0
        assert abs(proj) < 1e-3 * norm, (step, pos, proj, norm)
    risk = {p: float(r) for a in run.analysis("projection_risk") for p, r in zip(a.positions, a.value("risk"))}
    assert all(risk[r[1]] < 0.01 for r in after)
    assert run.out.outputs[0].finish_reason == "length" and len(run.out.outputs[0].token_ids) == N_TOKENS


@pytest.mark.parametrize("which", ["abort", "steer"])
def test_live_scores_equal_the_replayed_and_recomputed_scores(which, abort_run, steer_run, tmp_path):
    run = abort_run if which == "abort" else steer_run
    # the same analyzer on the recording, as a process (its action is not taken on a recording)
    out = subprocess.run([PY, str(HELPERS), "analyze", "--source", str(run.rec), "--config",
                          str(run.tmp / "config.json"), "--out", str(tmp_path / "replay.jsonl"),
                          "--actions", str(tmp_path / "actions.json")], env=_env(), capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    assert "is not taken on a recording" in out.stderr
    assert json.loads((tmp_path / "actions.json").read_text()) == []
    replay = [json.loads(x) for x in (tmp_path / "replay.jsonl").read_text().splitlines()]
    assert replay == run.live and len(replay) >= 8  # every row, value and alert, to the bit (JSON of float32)
    # what the broker delivered to another consumer is the same
    delivered = {p: (float(r), al) for a in run.analysis("projection_risk")
                 for p, r, al in zip(a.positions, a.value("risk"), a.alerts)}
    printed = {p: (r, al) for line in run.live for p, r, al in zip(line["positions"], line["values"]["risk"],
                                                                     line["alerts"])}
    assert delivered == printed
    # recomputed here from the captured frames
    _, center, width, _ = reference_of(run)
    rows = run.scored_rows()
    want = {pos: float(np.float32(1 / (1 + np.exp(-(proj - center) / width)))) for _, pos, proj, _, _ in rows}
    assert {p: v[0] for p, v in delivered.items()} == want


def reference_of(run):
    c = run.config
    return np.asarray(c["direction"], np.float32), c["center"], c["width"], None


def test_scores_before_the_action_match_hugging_face(abort_run, hf_model):
    run = abort_run
    applied = run.actions[0]["applied_step"]
    full = list(run.out.prompt_token_ids) + list(run.out.outputs[0].token_ids)
    ref_hs, _, _, _ = hf_trace(hf_model, full[:-1])
    unit = np.asarray(run.config["direction"], np.float64)
    for step, pos, proj, norm, _ in run.scored_rows():
        if step >= applied:
            continue
        h = ref_hs[LAYER][pos].astype(np.float64)
        assert abs(proj - h @ unit) <= 1e-3 * np.linalg.norm(h), (pos, proj, h @ unit)


def test_the_terminal_monitor_shows_the_recording(abort_run, tmp_path, model_dir):
    run = abort_run
    screen = PtyScreen(monitor_argv(run.rec, "--lines", "6"), cols=160, rows=40,
                       stderr_path=tmp_path / "monitor.err")
    try:
        assert screen.drain(120) == 0, (tmp_path / "monitor.err").read_text()
        text = screen.text
        act = run.actions[0]
        assert f"{run.rid}  abort  {len(run.out.outputs[0].token_ids)} tokens" in text, text
        assert f"ALERT at position {act['alert_position']} (projection_risk)" in text, text
        assert (f"-> abort on projection_risk alert at step {act['alert_step']}: applied at step "
                f"{act['applied_step']}") in text, text
        assert "risk = projection_risk.risk" in text
        # the generated text is on screen (the last words of it at least), the alert token marked
        shown = text.replace("!", "")
        words = [w for w in run.out.outputs[0].text.split()[-6:] if len(w) > 2]
        assert words and sum(w in shown for w in words) >= len(words) - 1, (words, text)
        assert "!" in text
    finally:
        screen.close()
