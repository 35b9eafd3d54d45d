"""``mia-stream demo``: bad input is a one-line error; the real demo answers on a real vLLM engine."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest


def _demo(*args: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mia_stream.cli", "demo", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"})


@pytest.mark.parametrize("model", ["/no/such/model-dir", "./no-such-model"])
def test_a_missing_model_path_is_a_one_line_error_with_exit_code_2(model: str) -> None:
    result = _demo("--model", model, timeout=60)
    assert result.returncode == 2
    assert result.stderr.strip() == f"mia-stream demo: model path {model!r} does not exist"
    assert "Traceback" not in result.stderr


def test_a_bad_number_is_a_usage_error() -> None:
    result = _demo("--max-tokens", "0", timeout=60)
    assert result.returncode == 2
    assert "--max-tokens: 0 must be positive" in result.stderr


@pytest.mark.slow
def test_the_demo_answers_three_prompts_on_a_real_engine() -> None:
    result = _demo("--enforce-eager", "--max-tokens", "16", timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert "> What is the capital of France?\nThe capital of France is Paris." in out
    assert out.count("tokens/s]") == 3
    assert "summary: engine start" in out
    # the risk printer process printed every generated token with the risk the detector process published ...
    live = [line for line in out.splitlines() if line.startswith("[live] demo-")]
    scored = [line for line in live if re.search(r"\| risk 0\.\d{3}$", line)]
    assert len(scored) >= 3 * 5 and sum("| end:" in line for line in live) == 3
    for i in range(3):  # every answer's tokens but its last (no step computes a row for it) got a score
        assert sum(line.startswith(f"[live] demo-{i} |") and re.search(r"\| risk +- *$", line) is not None
                   for line in live) == 1
    # ... the detector replayed on the recording gave exactly the same scores ...
    assert re.search(r"replayed scores identical to live: yes \(\d+ results, p_hallucination per token\)", out)
    # ... and the terminal monitor drew the recording (printed once: not a terminal here)
    assert "risk = science_hallucination.p_hallucination" in out
    assert all(f"demo-{i}  length  16 tokens  risk 0." in out or f"demo-{i}  stop  " in out for i in range(3))
