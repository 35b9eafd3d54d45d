"""Shared by the benchmark and evaluation scripts: a broker process and process teardown (they run brokers,
consumers, analyzers), and the plugin's entry point where mia_stream runs from a checkout (the GPU host)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Iterable


def start_broker(address: str, env: dict, *args: str) -> subprocess.Popen:
    """A ``mia_stream.broker`` process at ``address`` (stdout piped; ``args``: more flags), returned once it says
    it is ready; stopped, and an error raised, when it does not."""
    proc = subprocess.Popen([sys.executable, "-m", "mia_stream.broker", "--address", address, *args],
                            stdout=subprocess.PIPE, text=True, env=env)
    if "ready" not in proc.stdout.readline():
        stop_processes([proc])
        raise RuntimeError(f"the broker at {address} did not start (exit code {proc.returncode})")
    return proc


def stop_processes(procs: Iterable[subprocess.Popen], timeout: float = 10.0) -> None:
    """SIGTERM each process still running (in the given order), then SIGKILL what has not exited in ``timeout``."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(timeout)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)


def ensure_plugin_entry_point(work: Path) -> None:
    """vLLM loads the plugin through the ``vllm.general_plugins`` entry point; where mia_stream runs from a
    checkout on PYTHONPATH (the GPU host) there is none, and the engine would run without the plugin: expose one
    in a dist-info dir that the engine's processes find on their PYTHONPATH."""
    import importlib.metadata as md

    if any(ep.value.startswith("mia_stream") for ep in md.entry_points(group="vllm.general_plugins")):
        return
    d = work / "entry-point" / "mia_stream_checkout-0.dist-info"
    d.mkdir(parents=True, exist_ok=True)
    (d / "METADATA").write_text("Metadata-Version: 2.1\nName: mia-stream-checkout\nVersion: 0\n")
    (d / "entry_points.txt").write_text("[vllm.general_plugins]\nmia_stream = mia_stream.producer.plugin:register\n")
    os.environ["PYTHONPATH"] = f"{d.parent}:{os.environ.get('PYTHONPATH', '')}"
    sys.path.insert(0, str(d.parent))


def random_probe_file(path: Path, hidden_size: int, num_layers: int, layer: int, seed: int = 0,
                      analyzer: str = "token_probe", threshold: float = 0.5, scale: float = 1e-3) -> Path:
    """A ``mia_stream.probe/1`` token probe of random direction for a model shape (benchmarks on models with
    dummy weights, for which no trained probe exists): small weights keep the risks away from 0 and 1."""
    import json

    import numpy as np

    rng = np.random.default_rng(seed)
    w = rng.standard_normal(hidden_size) * scale / np.sqrt(hidden_size)
    path.write_text(json.dumps({
        "format": "mia_stream.probe/1", "analyzer": analyzer, "model": "random", "hidden_size": hidden_size,
        "num_layers": num_layers, "layer": layer, "position": "generated", "mean": [0.0] * hidden_size,
        "scale": [1.0] * hidden_size, "weights": w.tolist(), "bias": 0.0, "threshold": threshold,
        "positive": "random direction (benchmark)"}))
    return path
