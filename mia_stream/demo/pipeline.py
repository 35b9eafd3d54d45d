"""The demo's streaming half: broker, hallucination detector, risk printer and recorder as separate processes;
then the recording replays through the same detector, and the terminal monitor shows it.

- the detector is an analyzer process (``mia-stream analyze DEMO_ANALYZER --publish --print``): it scores every
  generated token from the captured hidden states and publishes the scores onto the bus as ``analysis``
  messages; its own printout (JSON lines) goes to ``live-scores.jsonl``;
- ``RiskPrinter`` is a consumer process: it prints each generated token with the risk the detector published
  for it, as both arrive through the broker (``[live] demo-0 | ' Paris' | risk 0.031``), and ``ALERT`` after
  the risk where the detector's alert policy flagged the token (the probe file's calibrated threshold);
- the recorder writes everything (the engine's streams and the detector's results) to an MCAP recording.

Afterwards ``mia-stream analyze DEMO_ANALYZER --source RECORDING`` recomputes the scores from the recording,
and the demo compares them with the live ones (equal to the bit: one code path, results independent of what
shares a step), then ``mia-stream monitor --terminal`` draws the recording: tokens coloured by risk.
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from mia_stream import settings
from mia_stream.consumers import Consumer

# The detector and the value it publishes per token: token_probe (issue 15; Obeso et al. 2025) with its shipped
# probe for the embedded model, P(this token is part of a wrong claim), alerting at the probe file's threshold
# (calibrated: at most 10 % of correct held-out answers alert; docs/hallucination.md says why this detector).
DEMO_ANALYZER = "token_probe"
# the probe the evaluation chose (docs/hallucination.md): hidden state + the token's logit features, computed by the
# analyzer from the captured last layer; its threshold is the calibrated one in the file
DEMO_CONFIG = {"probe": "token-probe-logit-smollm2-135m.json"}
DEMO_SCORE = "risk"
_OUT_ENV = "MIA_STREAM_DEMO_OUT"


def demo_capture() -> dict:
    """The capture spec the detector needs (``mia-stream analyze DEMO_ANALYZER --print-spec``)."""
    from mia_stream.analyzers import create

    return {"capture": create(DEMO_ANALYZER, dict(DEMO_CONFIG)).capture_spec()}


def write_demo_config(run_dir: Path) -> Path:
    """The detector's config file (``mia-stream analyze --config``)."""
    import json

    path = run_dir / "detector.json"
    path.write_text(json.dumps(DEMO_CONFIG))
    return path


class RiskPrinter(Consumer):
    """Prints ``[tag] request | token | risk`` for every generated token once its score arrives; the last token
    of an answer (no step computes a row for it) without a score, then the end line, once the request ended and
    every other token got its score (the detector's results are a stream of their own: under load the scores of
    the last steps come after the request's end)."""

    patterns = ("demo-*",)
    from_start = True

    def __init__(self):
        self._tokenizers: dict = {}
        self._tokens: dict[str, dict[int, int]] = {}  # request -> position -> token id, not printed yet
        self._scores: dict[str, dict[int, float]] = {}  # scores that came before their token
        self._alerts: dict[str, set] = {}
        self._ended: dict[str, tuple] = {}  # request -> (stream, end) of an ended request not yet flushed
        out = settings.get_path(_OUT_ENV)
        self._out = open(out, "w") if out else None
        self._tag = settings.get_text("MIA_STREAM_DEMO_TAG")
        self._expected = settings.get_int("MIA_STREAM_DEMO_STREAMS")
        self._printed = 0  # requests whose end line is out

    def _tok(self, name: str):
        if name not in self._tokenizers:
            from tokenizers import Tokenizer

            self._tokenizers[name] = Tokenizer.from_file(str(Path(name) / "tokenizer.json"))
        return self._tokenizers[name]

    def on_tokens(self, stream, tokens) -> None:
        pending = self._tokens.setdefault(stream.request_id, {})
        scores = self._scores.get(stream.request_id, {})
        for token_id, pos in zip(tokens.token_ids, tokens.positions):
            pending[pos] = token_id
            if pos in scores:
                self._print(stream, pos, scores.pop(pos))

    def on_analysis(self, stream, analysis) -> None:
        if analysis.analyzer != DEMO_ANALYZER or DEMO_SCORE not in analysis.values:
            return
        pending = self._tokens.setdefault(stream.request_id, {})
        for pos, risk, alert in zip(analysis.positions, analysis.values[DEMO_SCORE].tolist(), analysis.alerts):
            if alert:
                self._alerts.setdefault(stream.request_id, set()).add(pos)
            if pos < 0:
                continue
            if pos in pending:
                self._print(stream, pos, risk)
            else:
                self._scores.setdefault(stream.request_id, {})[pos] = risk
        if stream.request_id in self._ended:
            self._flush(stream.request_id, final=analysis.step == -1)

    def on_end(self, stream, end) -> None:
        self._ended[stream.request_id] = (stream, end)
        self._flush(stream.request_id, final=False)

    def _flush(self, rid: str, final: bool) -> None:
        """An ended request's last token and end line, once only the last token waits (or the detector's final
        result came: nothing more will be scored)."""
        pending = self._tokens.get(rid, {})
        if len(pending) > 1 and not final:
            return
        stream, end = self._ended.pop(rid)
        for pos in sorted(pending):
            self._print(stream, pos, None)
        self._emit(f"{rid} | end: {end.finish_reason}, {end.num_generated_tokens} tokens, "
                   f"{end.frames_dropped} frames dropped")
        self._printed += 1
        self.done = self._printed >= self._expected

    def _print(self, stream, pos: int, risk: float | None) -> None:
        token_id = self._tokens[stream.request_id].pop(pos)
        text = self._tok(stream.start.tokenizer).decode([token_id])
        shown = "  -  " if risk is None or not math.isfinite(risk) else f"{risk:.3f}"
        alert = " ALERT" if pos in self._alerts.get(stream.request_id, ()) else ""
        self._emit(f"{stream.request_id} | {text!r:>14} | risk {shown}{alert}")

    def _emit(self, line: str) -> None:
        print(f"[{self._tag}] {line}", flush=True)
        if self._out is not None:
            self._out.write(line + "\n")
            self._out.flush()


@dataclass
class StreamingProcesses:
    """The broker, detector, risk printer and recorder processes of one demo run."""

    run_dir: Path
    procs: dict = field(default_factory=dict)

    @property
    def recording(self) -> Path:
        return self.run_dir / "recording"

    @property
    def live_scores(self) -> Path:
        return self.run_dir / "live-scores.jsonl"

    @property
    def replay_scores(self) -> Path:
        return self.run_dir / "replay-scores.jsonl"

    def start(self, num_streams: int) -> None:
        py = [sys.executable, "-m", "mia_stream.cli"]
        self.procs["broker"] = subprocess.Popen(py + ["broker", "--address", str(self.run_dir)],
                                                stdout=subprocess.DEVNULL)
        _wait_for(self.run_dir / "consumers.sock")
        config = write_demo_config(self.run_dir)
        with open(self.live_scores, "w") as out:
            self.procs["detector"] = subprocess.Popen(
                py + ["analyze", DEMO_ANALYZER, "--config", str(config), "--source", str(self.run_dir), "--publish",
                      "--print",
                      "--patterns", "demo-*", "--max-streams", str(num_streams)], stdout=out)
        env = dict(os.environ, **{_OUT_ENV: str(self.run_dir / "live.txt"), "MIA_STREAM_DEMO_TAG": "live",
                                  "MIA_STREAM_DEMO_STREAMS": str(num_streams)})
        self.procs["printer"] = subprocess.Popen(
            # not --max-streams: after the last request's end the printer still waits for its last scores; it
            # stops itself (Consumer.done) once every request is printed
            py + ["consume", f"{__name__}:RiskPrinter", "--source", str(self.run_dir)], env=env)
        self.procs["recorder"] = subprocess.Popen(
            py + ["record", str(self.recording), "--broker", str(self.run_dir), "--patterns", "demo-*"])

    def wait_ready(self) -> None:
        """Until the detector, the printer and the recorder are subscribed (they start while the engine does)."""
        _wait_subscribed(self.run_dir, 3)

    def finish(self, timeout: float = 60.0) -> None:
        """Wait for the detector and the printer to see every stream end, then stop the recorder and broker."""
        self.procs["detector"].wait(timeout)
        self.procs["printer"].wait(timeout)
        time.sleep(0.5)  # the detector's last results reach the recorder
        for name in ("recorder", "broker"):
            p = self.procs[name]
            p.send_signal(signal.SIGINT)
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()

    def kill(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()


def replay_through_detector(recording: Path, out: Path) -> int:
    """The same detector on the recording (a separate process); its JSON lines go to ``out``."""
    with open(out, "w") as fh:
        return subprocess.call([sys.executable, "-m", "mia_stream.cli", "analyze", DEMO_ANALYZER, "--config",
                                str(write_demo_config(recording.parent)), "--source", str(recording), "--patterns",
                                "demo-*"], stdout=fh)


def show_recording(recording: Path) -> int:
    """``mia-stream monitor --terminal`` on the recording: the final view (coloured on a terminal)."""
    return subprocess.call([sys.executable, "-m", "mia_stream.cli", "monitor", "--terminal", "--source",
                            str(recording), "--patterns", "demo-*", "--lines", "4"])


def _wait_subscribed(run_dir: Path, n: int, timeout: float = 60.0) -> None:
    """Until ``n`` consumers of demo-* are subscribed at the broker (they start in parallel: 2-10 s)."""
    from mia_stream.broker import fetch_stats

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            consumers = fetch_stats(str(run_dir), timeout=1.0)["consumers"].values()
        except Exception:  # noqa: BLE001 (the broker's stats socket is not up yet)
            consumers = []
        if sum("demo-*" in c.get("patterns", ()) for c in consumers) >= n:
            return
        time.sleep(0.1)
    raise TimeoutError(f"the demo's {n} consumers did not subscribe within {timeout:.0f} s")


def _wait_for(path: Path, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear in {timeout}s")
        time.sleep(0.05)
