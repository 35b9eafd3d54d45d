"""``mia-stream monitor --terminal``: the terminal view read from a real pseudo-terminal through a VT100 emulator
(pyte), live from a real broker process and from a recording made by the real recorder process.

The stream is scripted (an engine's tokens, a detector's per-token risk with one alert, an action outcome), so
the test knows which token must show which colour; tests/test_monitoring.py runs the view on a real engine.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

from bus_helpers import PY, _env, kill, run_dir, start_broker
from monitoring_helpers import PtyScreen, hex_rgb, monitor_argv, scripted_request

pyte = pytest.importorskip("pyte", reason="pyte (the dev extra) renders the pseudo-terminal")

TEXT = " The capital of Australia is Sydney."
RID = "terminal-req-1"


@pytest.fixture(scope="module")
def model_dir() -> str:
    from mia_stream.model import default_model_dir

    return str(default_model_dir())


def _risks(model_dir):
    from pathlib import Path

    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
    enc = tok.encode(TEXT, add_special_tokens=False)
    pieces = [tok.decode([i]) for i in enc.ids]
    alert = next(i for i, p in enumerate(pieces) if "Sy" in p)
    risks = [0.05] * len(pieces)
    risks[alert] = 0.9
    risks[-1] = 0.3
    return risks, alert


def _check_view(screen: PtyScreen, alert_position: int, numbers: bool = False) -> None:
    text = screen.text
    assert RID in text and " abort " in text + " ", text
    if numbers:
        assert "The(0.05) capital(0.05) of(0.05) Australia(0.05) is(0.05) !Sydney(0.90).(0.30)" in text, text
    else:
        assert "The capital of Australia is !Sydney." in text, text
    assert "risk 0.30 (max 0.90)" in text, text
    assert f"ALERT at position {alert_position} (test_probe)" in text, text
    assert "-> abort on test_probe alert at step" in text and "applied at step" in text, text
    assert "risk = test_probe.risk" in text and "1 alert(s), 1 action(s)" in text, text
    # colours: a low-risk token green, the alert token red, marked "!" and underlined
    r, c = screen.find("capital")
    red, green, _ = hex_rgb(screen.bg(r, c))
    assert green > 150 and red < 60, screen.bg(r, c)
    r, c = screen.find("!Sy")
    c_s = c + 1
    red, green, _ = hex_rgb(screen.bg(r, c_s))
    assert red > 200 and green < 60, screen.bg(r, c_s)
    assert screen.cell(r, c_s).underscore


def test_the_terminal_view_shows_tokens_coloured_by_risk_live(model_dir, tmp_path):
    risks, alert = _risks(model_dir)
    with run_dir() as d:
        broker = start_broker(d)
        screen = PtyScreen(monitor_argv(d), stderr_path=tmp_path / "monitor.err")
        try:
            assert screen.wait_for(lambda s: "mia-stream monitor:" in s.text, 30), (tmp_path / "monitor.err").read_text()
            time.sleep(0.5)  # its subscription reaches the broker
            _, positions = scripted_request(d, RID, model_dir, TEXT, risks, alert, action_applied_step=alert + 2,
                                            finish="abort", delay=0.03)
            # the whole text, not just the action line: a redraw can show the action before the last tokens'
            # text (seen once in three runs on the loaded machine: "The capital of" with the action drawn)
            assert screen.wait_for(lambda s: "applied at step" in s.text and " abort" in s.text
                                   and "The capital of Australia is !Sydney." in s.text, 30), screen.text
            _check_view(screen, positions[alert])
            assert screen.proc.poll() is None  # live: it keeps watching
        finally:
            screen.close()
            kill(broker, signal.SIGTERM)


def test_the_terminal_view_of_a_recording(model_dir, tmp_path):
    risks, alert = _risks(model_dir)
    rec = tmp_path / "rec"
    with run_dir() as d:
        broker = start_broker(d)
        recorder = subprocess.Popen([PY, "-m", "mia_stream.cli", "record", str(rec), "--broker", d], env=_env(),
                                    stderr=subprocess.PIPE, text=True)
        try:
            time.sleep(1.5)  # the recorder subscribes
            _, positions = scripted_request(d, RID, model_dir, TEXT, risks, alert, action_applied_step=alert + 2,
                                            finish="abort")
            time.sleep(1.0)
            recorder.send_signal(signal.SIGINT)
            assert recorder.wait(20) == 0, recorder.stderr.read()
        finally:
            kill(recorder)
            kill(broker, signal.SIGTERM)
    screen = PtyScreen(monitor_argv(rec, "--numbers"), stderr_path=tmp_path / "monitor.err")
    try:
        assert screen.drain(60) == 0, (tmp_path / "monitor.err").read_text()
        _check_view(screen, positions[alert], numbers=True)
    finally:
        screen.close()


def test_the_recording_view_printed_to_a_file_is_the_final_view(model_dir, tmp_path):
    """Not a terminal: one final view, no cursor movement (e.g. ``... > view.txt``)."""
    risks, alert = _risks(model_dir)
    rec = tmp_path / "rec"
    with run_dir() as d:
        broker = start_broker(d)
        recorder = subprocess.Popen([PY, "-m", "mia_stream.cli", "record", str(rec), "--broker", d], env=_env())
        try:
            time.sleep(1.5)
            scripted_request(d, RID, model_dir, TEXT, risks, alert, action_applied_step=None, finish="stop")
            time.sleep(1.0)
            recorder.send_signal(signal.SIGINT)
            assert recorder.wait(20) == 0
        finally:
            kill(recorder)
            kill(broker, signal.SIGTERM)
    out = subprocess.run(monitor_argv(rec), capture_output=True, text=True, env=_env(), timeout=120)
    assert out.returncode == 0, out.stderr
    assert "\x1b[" not in out.stdout  # no colours or cursor moves for a file
    assert out.stdout.count(RID) == 1 and "The capital of Australia is !Sydney." in out.stdout, out.stdout
    assert f"{RID}  stop  {len(risks)} tokens  risk 0.30 (max 0.90)" in out.stdout, out.stdout


@pytest.mark.parametrize("args,message", [
    (["--source", "/no/such/recording"], "'/no/such/recording' is neither a broker run dir nor a recording (no such path)"),
    (["--source", "/tmp", "--score", "risk"], "--score must be ANALYZER.VALUE, got 'risk'"),
    (["--source", "/tmp", "--lines", "0"], "--lines must be >= 1 and --speed >= 0"),
])
def test_bad_arguments_are_one_line_errors(args, message):
    out = subprocess.run([sys.executable, "-m", "mia_stream.cli", "monitor", "--terminal", *args],
                         capture_output=True, text=True, env=_env(), timeout=60)
    assert out.returncode == 2
    assert out.stderr.strip() == f"mia-stream monitor --terminal: {message}", out.stderr
