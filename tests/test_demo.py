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


@pytest.fixture(scope="module")
def demo_run() -> subprocess.CompletedProcess:
    return _demo("--enforce-eager", "--max-tokens", "16", timeout=900)


@pytest.mark.slow
def test_the_demo_answers_its_prompts_on_a_real_engine(demo_run) -> None:
    from mia_stream.demo.run import DEMO_PROMPTS

    n = len(DEMO_PROMPTS)
    result = demo_run
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert "> What is the capital of France?\nThe capital of France is Paris." in out
    assert out.count("tokens/s]") == n
    assert "summary: engine start" in out
    # the risk printer process printed every generated token with the risk the detector process published ...
    live = [line for line in out.splitlines() if line.startswith("[live] demo-")]
    scored = [line for line in live if re.search(r"\| risk 0\.\d{3}( ALERT)?$", line)]
    assert len(scored) >= n * 5 and sum("| end:" in line for line in live) == n
    for i in range(n):  # every answer's tokens but its last (no step computes a row for it) got a score
        assert sum(line.startswith(f"[live] demo-{i} |") and re.search(r"\| risk +- *$", line) is not None
                   for line in live) == 1
    # ... the detector replayed on the recording gave exactly the same scores ...
    assert re.search(r"replayed scores identical to live: yes \(\d+ results, risk per token\)", out)
    # ... and the terminal monitor drew the recording (printed once: not a terminal here)
    assert "risk = token_probe.risk" in out
    assert all(f"demo-{i}  length  16 tokens  risk 0." in out or f"demo-{i}  stop  " in out for i in range(n))


# the demo prompts' references and checkers (hallucination_data.check_answer labels the demo's own answers)
CHECKS = {"What is the capital of France?": {"answer": "Paris", "kind": "capital", "relation": "capital"},
          "What is the chemical symbol of gold?": {"answer": "Au", "kind": "symbol", "relation": "element_symbol"},
          "What is the atomic number of oxygen?": {"answer": "8", "kind": "first_number", "relation": "atomic_number"},
          "What is the atomic number of selenium?": {"answer": "34", "kind": "first_number",
                                                     "relation": "atomic_number"}}


@pytest.mark.slow
def test_on_the_demos_own_output_a_right_answer_raises_no_alert_and_a_wrong_claim_does(demo_run) -> None:
    """Issue 27: the demo's detector flagged 77 of 90 tokens, every function word of a right answer included.
    The demo's answers are labelled here by the labeller. With the shipped probe's calibrated threshold a right
    answer raises no alert; a wrong answer's alerts, if any, are on its claim's tokens, and its claim's tokens
    carry its highest risk, above every token of the right answers; and a wrong claim raises an alert. (The
    detector's recall at 10 % false alerts is about half, docs/hallucination.md: selenium's "29" is flagged,
    oxygen's "16" is not, its risk 0.98 against the threshold 0.991.)"""
    from mia_stream.demo.run import DEMO_PROMPTS
    from mia_stream.lab import hallucination_data as hd

    assert demo_run.returncode == 0, demo_run.stderr[-3000:]
    out = demo_run.stdout
    answers = {}
    for i, prompt in enumerate(DEMO_PROMPTS):
        text = out.split(f"> {prompt}\n", 1)[1].split("\n", 1)[0]
        item = dict(CHECKS[prompt], question=prompt, answers=[CHECKS[prompt]["answer"]])
        span = hd.answer_span(item, text)
        claim = text[span[0]:span[1]] if span else ""
        rows = [re.match(r"\[live\] demo-%d \| +(.+?) \| risk +(\S+)( ALERT)?$" % i, line) for line in out.splitlines()]
        rows = [(eval(m.group(1)), float(m.group(2)), m.group(3) is not None)  # noqa: S307 (the token's repr)
                for m in rows if m and m.group(2) != "-"]
        answers[prompt] = (text, hd.check_answer(item, text), claim, rows)
    right = [a for a in answers.values() if a[1]]
    wrong = [a for a in answers.values() if not a[1]]
    assert right and wrong, answers  # the demo shows both (the embedded model answers oxygen's number wrong)
    for text, _, _, rows in right:
        assert not [t for t, _, alert in rows if alert], (text, rows)
    top_right = max(r for _, _, _, rows in right for _, r, _ in rows)
    for text, _, claim, rows in wrong:
        assert all(t.strip() and t.strip() in claim for t, _, alert in rows if alert), (text, claim, rows)
        in_claim = [r for t, r, _ in rows if t.strip() and t.strip() in claim]
        others = [r for t, r, _ in rows if not (t.strip() and t.strip() in claim)]
        assert in_claim and max(in_claim) > max(others) and max(in_claim) > top_right, (text, claim, rows)
    assert any(alert for _, _, _, rows in wrong for _, _, alert in rows), wrong  # a wrong claim is flagged
