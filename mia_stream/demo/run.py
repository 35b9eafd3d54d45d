"""``mia-stream demo``: the end-to-end walk-through on a real vLLM engine and the embedded model.

Start a broker, a hallucination detector (an analyzer process), a consumer process that prints each generated
token with its risk as the detector publishes it, and the recorder process; start a real ``vllm.LLM``
(CPU-friendly settings) with the mia_stream plugin; answer four chat prompts while capturing what the detector
needs; then replay the MCAP recording through the same detector in a new process, compare its scores with the
live ones, and draw the recording with the terminal monitor. Every step is a small function run inside one
``contextlib.ExitStack``, so each process is torn down even when a step fails. ``--no-streaming`` runs plain
vLLM only.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from mia_stream.errors import ModelError

__all__ = ["DEMO_PROMPTS", "Answer", "DemoConfig", "main", "run_demo"]

# Two right answers and two wrong ones (the embedded model says 16 for oxygen and 29 for selenium). At the
# shipped probe's calibrated threshold the detector catches about half of wrong answers (docs/hallucination.md):
# selenium's "29" raises an alert on its claim, oxygen's "16" does not. Selenium was picked for that after 24
# questions about held-out entities ran through the demo (docs/hallucination.md); the probe never trained on either.
DEMO_PROMPTS: tuple[str, ...] = (
    "What is the capital of France?",
    "What is the chemical symbol of gold?",
    "What is the atomic number of oxygen?",
    "What is the atomic number of selenium?",
)

# CPU-friendly engine defaults; setdefault so the caller's environment wins.
_ENGINE_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB of KV cache; vLLM's CPU default would take far more
    "HF_HUB_OFFLINE": "1",  # never download at run time
    "TRANSFORMERS_OFFLINE": "1",
}


@dataclass(frozen=True)
class DemoConfig:
    """Everything the demo needs, from the command line."""

    model: str
    prompts: tuple[str, ...] = DEMO_PROMPTS
    max_model_len: int = 2048
    max_tokens: int = 48
    enforce_eager: bool = False
    dtype: str | None = None  # None: float32 on the CPU, the model's own dtype on a GPU
    seed: int = 0
    verbose: bool = False
    streaming: bool = True  # broker + detector + printer + recorder processes, capture on, then replay


@dataclass(frozen=True)
class Answer:
    """One prompt's greedy answer and how long it took."""

    prompt: str
    text: str
    num_tokens: int
    seconds: float

    @property
    def tokens_per_s(self) -> float:
        return self.num_tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass
class DemoResult:
    engine_start_s: float = 0.0
    answers: list[Answer] = field(default_factory=list)
    replay_identical: bool | None = None  # None when streaming is off


def main(argv: Sequence[str] | None = None) -> int:
    """Parse arguments, run the demo, return the exit code (2 for bad input such as a missing --model)."""
    args = _parser().parse_args(argv)
    from mia_stream.model import resolve_model  # noqa: PLC0415 (keeps `--help` instant)

    try:
        model = resolve_model(args.model)
    except ModelError as exc:
        print(f"mia-stream demo: {exc}", file=sys.stderr)
        return 2
    config = DemoConfig(model=model, max_model_len=args.max_model_len, max_tokens=args.max_tokens,
                        enforce_eager=args.enforce_eager, dtype=args.dtype, verbose=args.verbose,
                        streaming=args.streaming)
    result = run_demo(config)
    return 0 if result.replay_identical in (None, True) else 1


def run_demo(config: DemoConfig) -> DemoResult:
    """Run every phase of the demo in order; each phase is one small function."""
    import tempfile
    from pathlib import Path

    from mia_stream.demo import pipeline

    result = DemoResult()
    with contextlib.ExitStack() as stack:
        _prepare_environment(config)
        streaming = None
        if config.streaming:
            run_dir = Path(tempfile.mkdtemp(prefix="mia-demo-", dir="/tmp"))  # short: unix socket paths
            streaming = pipeline.StreamingProcesses(run_dir)
            stack.callback(streaming.kill)
            streaming.start(num_streams=len(config.prompts))
            os.environ["MIA_STREAM_BROKER"] = str(run_dir)
            print(f"streaming: broker, detector ({pipeline.DEMO_ANALYZER}), risk printer and recorder running "
                  f"under {run_dir}", flush=True)
        engine = _EngineHandle(*start_engine(config))
        stack.callback(engine.release)
        result.engine_start_s = engine.start_s
        print(f"engine: {config.model} ready in {result.engine_start_s:.1f} s (dtype={_engine_dtype(config)}, "
              f"enforce_eager={config.enforce_eager}, max_model_len={config.max_model_len})", flush=True)
        capture = None
        if streaming is not None:
            streaming.wait_ready()
            capture = pipeline.demo_capture()
        for i, prompt in enumerate(config.prompts):
            spec = dict(capture, id=f"demo-{i}") if capture is not None else None
            answer = answer_prompt(engine.llm, prompt, config, spec)
            result.answers.append(answer)
            print_answer(answer)
        if streaming is not None:
            streaming.finish()
            print(f"\nreplaying {streaming.recording} through the same detector:", flush=True)
            pipeline.replay_through_detector(streaming.recording, streaming.replay_scores)
            live, replayed = streaming.live_scores.read_text(), streaming.replay_scores.read_text()
            result.replay_identical = bool(live) and live == replayed
            print(f"replayed scores identical to live: {'yes' if result.replay_identical else 'NO'} "
                  f"({len(live.splitlines())} results, {pipeline.DEMO_SCORE} per token)", flush=True)
            print(f"\nmia-stream monitor --terminal --source {streaming.recording}:", flush=True)
            pipeline.show_recording(streaming.recording)
    print_summary(result)
    return result


def _prepare_environment(config: DemoConfig) -> None:
    for key, value in _ENGINE_ENV.items():
        os.environ.setdefault(key, value)
    if not config.verbose:
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


def start_engine(config: DemoConfig) -> tuple[Any, float]:
    """A real ``vllm.LLM`` on ``config.model``; returns it and its start-up time in seconds."""
    started = time.monotonic()
    import vllm  # noqa: PLC0415 (heavy; only the demo itself needs it)

    llm = vllm.LLM(model=config.model, max_model_len=config.max_model_len, enforce_eager=config.enforce_eager,
                   dtype=_engine_dtype(config), seed=config.seed)
    return llm, time.monotonic() - started


def _engine_dtype(config: DemoConfig) -> str:
    if config.dtype is not None:
        return config.dtype
    import torch  # noqa: PLC0415

    # On vLLM CPU 0.32, bf16 under torch.compile derailed the embedded model's greedy answer to the first
    # prompt (float32 and eager bf16 answered "Paris"); float32 is also what the tests compare against HF.
    return "auto" if torch.cuda.is_available() else "float32"


def answer_prompt(llm: Any, prompt: str, config: DemoConfig, spec: dict | None = None) -> Answer:
    """Greedy chat answer to one user prompt; ``spec`` asks mia_stream to capture it."""
    import vllm  # noqa: PLC0415

    params = vllm.SamplingParams(temperature=0.0, max_tokens=config.max_tokens,
                                 extra_args={"mia_stream": spec} if spec else None)
    started = time.monotonic()
    (output,) = llm.chat([{"role": "user", "content": prompt}], params, use_tqdm=False)
    seconds = time.monotonic() - started
    completion = output.outputs[0]
    return Answer(prompt=prompt, text=completion.text.strip(), num_tokens=len(completion.token_ids), seconds=seconds)


def print_answer(answer: Answer) -> None:
    print(f"\n> {answer.prompt}\n{answer.text}\n  [{answer.num_tokens} tokens in {answer.seconds:.2f} s, "
          f"{answer.tokens_per_s:.1f} tokens/s]", flush=True)


def print_summary(result: DemoResult) -> None:
    tokens = sum(a.num_tokens for a in result.answers)
    seconds = sum(a.seconds for a in result.answers)
    rate = tokens / seconds if seconds > 0 else 0.0
    print(f"\nsummary: engine start {result.engine_start_s:.1f} s; generation {seconds:.2f} s for {tokens} tokens "
          f"({rate:.1f} tokens/s)", flush=True)


@dataclass
class _EngineHandle:
    """Owns the only reference to the ``vllm.LLM``, so releasing it really shuts the engine down."""

    llm: Any
    start_s: float

    def release(self) -> None:
        # vLLM stops its engine-core process when the LLM object is collected.
        self.llm = None
        gc.collect()


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mia-stream demo",
        description="Run a real vLLM engine on the embedded model (or --model) and answer four chat prompts.")
    parser.add_argument("--model", default=None,
                        help="a local Hugging Face model directory (default: $MIA_STREAM_MODEL, else the "
                             "embedded SmolLM2-135M-Instruct, built once by `mia-stream model`)")
    parser.add_argument("--max-model-len", type=_positive_int, default=2048, help="context length (default 2048)")
    parser.add_argument("--max-tokens", type=_positive_int, default=48, help="tokens per answer (default 48)")
    parser.add_argument("--enforce-eager", action="store_true",
                        help="skip torch.compile: faster start, slower steps")
    parser.add_argument("--dtype", default=None, choices=("auto", "bfloat16", "float16", "float32"),
                        help="model dtype in vLLM (default: float32 on the CPU, the model's own on a GPU)")
    parser.add_argument("--verbose", action="store_true", help="show vLLM's INFO logs")
    parser.add_argument("--no-streaming", dest="streaming", action="store_false",
                        help="plain vLLM only: no broker, capture, consumer, recorder or replay")
    return parser


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{value} must be positive")
    return value
