"""Helpers for the monitoring tests: a terminal in a pseudo-terminal read through a VT100 emulator (pyte), a
scripted request stream with per-token risk (real broker, real publishers), and a shipped analyzer run
as a process that reports what its actor did.

``PtyScreen`` runs a command in a real pty of a fixed size and keeps what a terminal would show (text and each
cell's colours), so a test reads the terminal monitor as a person would, without tmux.
"""

from __future__ import annotations

import fcntl
import os
import select
import signal
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]


class PtyScreen:
    """A process on a pseudo-terminal of ``cols`` x ``rows``, its output rendered by pyte."""

    def __init__(self, argv, cols: int = 120, rows: int = 40, env: dict | None = None, stderr_path=None):
        import pyte

        master, slave = os.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))
        env = dict(os.environ if env is None else env)
        env.update(TERM="xterm-256color", COLORTERM="truecolor", COLUMNS=str(cols), LINES=str(rows))
        env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
        self._err = open(stderr_path, "wb") if stderr_path else subprocess.DEVNULL
        self.proc = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=self._err, env=env,
                                     start_new_session=True, close_fds=True)
        os.close(slave)
        self.master = master
        self.screen = pyte.Screen(cols, rows)
        self.stream = pyte.ByteStream(self.screen)
        self.raw = bytearray()

    def pump(self, timeout: float = 0.1) -> bool:
        """Read what the process wrote (up to ``timeout`` s); False once the pty is closed."""
        r, _, _ = select.select([self.master], [], [], timeout)
        if not r:
            return True
        try:
            data = os.read(self.master, 65536)
        except OSError:  # EIO: the process closed the terminal
            return False
        if not data:
            return False
        self.raw += data
        self.stream.feed(data)
        return True

    def wait_for(self, predicate, timeout: float = 60.0) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate(self):
                return True
            if not self.pump(0.1) and predicate(self):
                return True
        return predicate(self)

    def drain(self, timeout: float = 30.0) -> int | None:
        """Read until the process exits (or ``timeout``); its exit code."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            alive = self.pump(0.1)
            if self.proc.poll() is not None and not alive:
                break
        while self.pump(0.05):  # whatever is left in the pty
            if time.monotonic() > deadline:
                break
        return self.proc.poll()

    @property
    def text(self) -> str:
        return "\n".join(self.screen.display)

    def find(self, s: str) -> tuple[int, int] | None:
        for row, line in enumerate(self.screen.display):
            col = line.find(s)
            if col >= 0:
                return row, col
        return None

    def bg(self, row: int, col: int) -> str:
        return self.screen.buffer[row][col].bg

    def cell(self, row: int, col: int):
        return self.screen.buffer[row][col]

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(5)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
        os.close(self.master)
        if self._err is not subprocess.DEVNULL:
            self._err.close()


def monitor_argv(source: str, *extra: str) -> list:
    return [sys.executable, "-m", "mia_stream.cli", "monitor", "--terminal", "--source", str(source), *extra]


def hex_rgb(color: str) -> tuple[int, int, int]:
    """pyte's colour of a cell ("ff8800") as (r, g, b)."""
    return int(color[0:2], 16), int(color[2:4], 16), int(color[4:6], 16)


def scripted_request(address: str, rid: str, tokenizer_dir: str, text: str, risks, alert_index: int,
                     action_applied_step: int | None, finish: str = "stop", delay: float = 0.0):
    """Publish one request's stream as an engine and a detector would: StreamStart naming the tokenizer, one
    TokenFrame per generated token, the detector's AnalysisBatch per step (``risk`` per token, the alert at
    token ``alert_index``), an ``alert_action`` outcome when ``action_applied_step`` is set, then StreamEnd.
    Returns (token ids, their positions)."""
    from tokenizers import Tokenizer

    from mia_stream.analyzers._actions import ACTION_ANALYZER
    from mia_stream.bus.publisher import FramePublisher
    from mia_stream.schemas import AnalysisBatch, StreamEnd, StreamStart, TokenFrame

    tok = Tokenizer.from_file(str(Path(tokenizer_dir) / "tokenizer.json"))
    ids = tok.encode(text, add_special_tokens=False).ids
    assert len(ids) == len(risks), (len(ids), len(risks))
    prompt = [1, 2, 3, 4]
    engine = FramePublisher(address, producer_id="engine-test/0")
    detector = FramePublisher(address, producer_id="analyzer/test_probe/0")
    actor = FramePublisher(address, producer_id="actor/test/0")
    try:
        engine.publish(StreamStart(rid, engine.producer_id, engine.epoch, engine.next_seq(rid), tokenizer=tokenizer_dir,
                                   model=tokenizer_dir, prompt_token_ids=prompt, time_ns=time.time_ns()))
        positions = []
        for i, tid in enumerate(ids):
            pos = len(prompt) + i
            positions.append(pos)
            now = time.time_ns()
            engine.publish(TokenFrame(rid, engine.producer_id, engine.epoch, engine.next_seq(rid), i, [tid], [pos],
                                      time_ns=now))
            detector.publish(AnalysisBatch(detector.producer_id, detector.epoch, "test_probe", [rid],
                                           [detector.next_seq(rid)], [1], [pos],
                                           {"risk": np.asarray([risks[i]], np.float32)}, {}, [int(i == alert_index)],
                                           step=i, time_ns=time.time_ns(), source_time_ns=now))
            if delay:
                time.sleep(delay)
        if action_applied_step is not None:
            actor.publish(AnalysisBatch(actor.producer_id, actor.epoch, ACTION_ANALYZER, [rid], [actor.next_seq(rid)],
                                        [1], [positions[alert_index]],
                                        {"alert_step": np.asarray([alert_index], np.int64),
                                         "applied_step": np.asarray([action_applied_step], np.int64),
                                         "steering_version": np.asarray([1], np.int64)},
                                        {"action": ["abort"], "source": ["test_probe"], "error": [None]}, [1],
                                        step=action_applied_step, time_ns=time.time_ns()))
        engine.publish(StreamEnd(rid, engine.producer_id, engine.epoch, engine.next_seq(rid), finish_reason=finish,
                                 num_prompt_tokens=len(prompt), num_generated_tokens=len(ids)))
        for p in (engine, detector, actor):
            p.flush(5.0)
    finally:
        for p in (engine, detector, actor):
            p.close()
    return ids, positions


# ------------------------------------------------------------------------------------------ an analyzer process

def _analyze(argv) -> int:
    """``python tests/monitoring_helpers.py analyze NAME``: a shipped analyzer (``token_probe``) as a process,
    through the same runner as ``mia-stream analyze``; results as JSON lines in --out, and what its actor did
    (alert step, applied step, error: what ``mia-stream analyze`` only logs) as JSON in --actions."""
    import argparse
    import json

    from mia_stream.analyzers import create, jsonl_printer, run_analyzer

    ap = argparse.ArgumentParser()
    ap.add_argument("analyzer")
    ap.add_argument("--source", required=True)
    ap.add_argument("--publish")
    ap.add_argument("--patterns", nargs="+", default=["*"])
    ap.add_argument("--config", required=True, help="a JSON file")
    ap.add_argument("--max-streams", type=int)
    ap.add_argument("--out", required=True)
    ap.add_argument("--actions")
    args = ap.parse_args(argv)
    analyzer = create(args.analyzer, json.loads(Path(args.config).read_text()))
    with open(args.out, "w") as fh:
        runner = run_analyzer(analyzer, args.source, patterns=args.patterns, sinks=[jsonl_printer(fh)],
                              publish=args.publish, max_streams=args.max_streams, idle_timeout=300,
                              consumer_id=f"test-analyzer-{os.getpid()}")
    if args.actions:
        recs = [] if runner.actor is None else [
            {"request_id": r.request_id, "analyzer": r.analyzer, "alert_step": r.alert_step,
             "alert_position": r.alert_position, "risk": r.risk, "ok": r.ok, "applied_step": r.applied_step,
             "steering_version": r.ack.steering_version if r.ack else None, "error": r.error,
             "reaction_ms": (r.acked_ns - r.seen_ns) / 1e6, "alert_latency_ms": (r.seen_ns - r.source_time_ns) / 1e6}
            for r in runner.actor.records.values()]
        Path(args.actions).write_text(json.dumps(recs))
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["analyze"]:
        sys.exit(_analyze(sys.argv[2:]))
    sys.exit(f"usage: {sys.argv[0]} analyze ...")
