"""``mia-stream serve`` without a model engine: argument passing, refusals, and cleanup when vLLM fails to start
(real processes: the broker child, vLLM's api_server module exiting on an unknown argument)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from mia_stream.served.serve import parse_args

ROOT = Path(__file__).resolve().parents[1]


def _env():
    return dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")


def test_model_then_ours_then_vllm_args(model_dir):
    cfg = parse_args([model_dir, "--record", "/tmp/r", "--port", "9001", "--enforce-eager", "--max-model-len",
                      "512", "--", "--host", "ignored-by-us"])
    assert cfg.model == str(Path(model_dir).resolve()) and cfg.record == "/tmp/r" and cfg.port == 9001
    assert cfg.vllm_args[-5:] == ["--enforce-eager", "--max-model-len", "512", "--host", "ignored-by-us"]
    assert cfg.http_url == "http://127.0.0.1:9001/v1"
    # the embedded model when no MODEL is given; an option value is never taken for the model
    cfg = parse_args(["--dtype", "bfloat16"])
    assert cfg.model == str(Path(model_dir).resolve())
    assert cfg.vllm_args.count("--dtype") == 1 and "bfloat16" in cfg.vllm_args


def test_a_missing_model_path_is_a_one_line_error():
    out = subprocess.run([sys.executable, "-m", "mia_stream.cli", "serve", "/no/such/model"], env=_env(),
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "does not exist" in out.stderr and "Traceback" not in out.stderr


def test_an_address_with_a_running_broker_is_refused(broker_address):
    out = subprocess.run([sys.executable, "-m", "mia_stream.cli", "serve", "--address", broker_address],
                         env=_env(), capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and f"a broker already runs at {broker_address}" in out.stderr


@pytest.mark.slow
def test_vllm_failing_to_start_stops_the_broker():
    run_dir = tempfile.mkdtemp(prefix="mia-serve-fail-", dir="/tmp")
    t0 = time.monotonic()
    try:
        out = subprocess.run([sys.executable, "-m", "mia_stream.cli", "serve", "--address", run_dir,
                              "--no-such-vllm-option"], env=_env(), capture_output=True, text=True, timeout=300)
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    assert out.returncode == 1, out.stderr[-2000:]
    assert "vllm exited with status" in out.stderr and "mia-stream serve: stopped broker, vllm" in out.stderr
    from mia_stream.broker import fetch_stats
    from mia_stream.errors import BrokerTimeoutError

    with pytest.raises(BrokerTimeoutError):  # the broker child is gone with it
        fetch_stats(run_dir, timeout=0.5)
    assert time.monotonic() - t0 < 300
