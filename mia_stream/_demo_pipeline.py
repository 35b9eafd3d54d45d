"""The demo's streaming half: broker, live consumer and recorder as separate processes, then replay.

``NormPrinter`` is the demo's consumer: it prints each request's generated text token by token with the
L2 norm of the last captured layer's hidden state at that token, and writes the same lines to a file so the
live run and the replay can be compared byte for byte.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from mia_stream import settings
from mia_stream.consumers import Consumer

DEMO_SPEC = {"capture": {"hidden_states": {"layers": [15, 29], "positions": "all"}}}
_OUT_ENV = "MIA_STREAM_DEMO_OUT"


class NormPrinter(Consumer):
    """Prints ``[tag] request | token | ‖h_29‖`` as the stream arrives; one line per generated token."""

    patterns = ("demo-*",)

    def __init__(self):
        self._tokenizers: dict = {}
        self._norms: dict[str, dict[int, float]] = {}
        out = settings.get_path(_OUT_ENV)
        self._out = open(out, "w") if out else None
        self._tag = settings.get_text("MIA_STREAM_DEMO_TAG")

    def _tok(self, name: str):
        if name not in self._tokenizers:
            from transformers import AutoTokenizer

            self._tokenizers[name] = AutoTokenizer.from_pretrained(name)
        return self._tokenizers[name]

    def on_frame(self, stream, frame) -> None:
        hs = frame.tensors["hs"]  # [layers, tokens, hidden]; last captured layer = 29
        norms = np.linalg.norm(hs[-1].astype(np.float64), axis=-1)
        self._norms.setdefault(stream.request_id, {}).update(zip(frame.positions, norms.tolist()))

    def on_tokens(self, stream, tokens) -> None:
        tok = self._tok(stream.start.tokenizer)
        norms = self._norms.get(stream.request_id, {})
        for token_id, pos in zip(tokens.token_ids, tokens.positions):
            # The token at `pos` was chosen from the row computed at pos - 1.
            norm = norms.get(pos - 1, float("nan"))
            self._emit(f"{stream.request_id} | {tok.decode([token_id])!r:>14} | |h29|={norm:8.3f}")

    def on_end(self, stream, end) -> None:
        self._emit(f"{stream.request_id} | end: {end.finish_reason}, {end.num_generated_tokens} tokens, "
                   f"{end.frames_dropped} frames dropped")

    def _emit(self, line: str) -> None:
        print(f"[{self._tag}] {line}", flush=True)
        if self._out is not None:
            self._out.write(line + "\n")
            self._out.flush()


@dataclass
class StreamingProcesses:
    """The broker, live consumer and recorder processes of one demo run."""

    run_dir: Path
    recording: Path
    live_out: Path
    procs: dict = field(default_factory=dict)

    def start(self, num_streams: int) -> None:
        py = [sys.executable, "-m", "mia_stream.cli"]
        self.procs["broker"] = subprocess.Popen(py + ["broker", "--address", str(self.run_dir)])
        _wait_for(self.run_dir / "consumers.sock")
        env = dict(os.environ, **{_OUT_ENV: str(self.live_out), "MIA_STREAM_DEMO_TAG": "live"})
        self.procs["consumer"] = subprocess.Popen(
            py + ["consume", f"{__name__}:NormPrinter", "--source", str(self.run_dir),
                  "--max-streams", str(num_streams)], env=env)
        self.procs["recorder"] = subprocess.Popen(
            py + ["record", str(self.recording), "--broker", str(self.run_dir), "--patterns", "demo-*"])
        time.sleep(1.0)  # let both subscribe before the engine publishes

    def finish(self, timeout: float = 60.0) -> None:
        """Wait for the live consumer to see every stream end, then stop the recorder and the broker."""
        self.procs["consumer"].wait(timeout)
        time.sleep(0.5)
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


def replay_through_consumer(recording: Path, out: Path) -> int:
    """Run the same consumer class on the recording (a separate process); its lines go to ``out``."""
    env = dict(os.environ, **{_OUT_ENV: str(out), "MIA_STREAM_DEMO_TAG": "replay"})
    return subprocess.call([sys.executable, "-m", "mia_stream.cli", "consume", f"{__name__}:NormPrinter",
                            "--source", str(recording)], env=env)


def _wait_for(path: Path, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear in {timeout}s")
        time.sleep(0.05)
