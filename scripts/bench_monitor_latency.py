#!/usr/bin/env python
"""Risk-score latency on the live stream: from a token's engine step to its score at a subscriber, against the
decode step time.

    python scripts/bench_monitor_latency.py [--analyzer token_probe] [--requests 8] [--rounds 3] [--eager]

The topology users run, each its own process: a broker (``mia-stream broker``); vLLM's default multiprocess
engine (``vllm.LLM`` here, its engine core a child process) with the mia_stream plugin; the detector
(``mia-stream analyze NAME --publish``, capturing what ``--print-spec`` says); a subscriber process (this script
with ``--subscriber``) that reads the requests' streams through the SDK's batch API like any consumer. Each round
sends ``--requests`` fresh random questions at once (greedy, ``--max-tokens``).

For every ``analysis`` message of the detector with a step (one per engine step, all requests of it) the
subscriber takes, side by side:

- ``score``:  its receive time - ``source_time_ns`` (the ``time_ns`` of the engine step whose rows were scored:
  the step's end on the engine thread) = drain + broker + detector + broker;
- ``publish``: the detector's ``time_ns`` - ``source_time_ns`` (what the subscriber hop adds is the difference);
- ``frames``: for the same steps, the receive time of the ``step_batch`` itself - its ``time_ns`` (the bus alone);
- ``step``:   the interval between consecutive ``step_batch`` ``time_ns`` of the engine (its step time, decode
  steps and the rounds' prefills: the median is the decode step).

Target (issue 15): score p99 within 2 decode steps. Output: one line per round, then the whole run.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from _procs import stop_processes  # noqa: E402  (scripts/_procs.py, beside this file)

COUNTRIES = ["France", "Japan", "Kenya", "Peru", "Norway", "Egypt", "Canada", "Chile", "Vietnam", "Ghana",
             "Poland", "Nepal", "Cuba", "Spain", "Iran", "Mali", "Laos", "Fiji", "Oman", "Chad"]


def random_questions(rng: random.Random, n: int) -> list[str]:
    """Fresh questions each round: arithmetic with random operands and capitals of random countries."""
    out = []
    for _ in range(n):
        if rng.random() < 0.5:
            a, b = rng.randint(10, 999), rng.randint(10, 999)
            out.append(f"What is {a} {rng.choice('+-*')} {b}? Answer with the number.")
        else:
            out.append(f"What is the capital of {rng.choice(COUNTRIES)}? Answer in one sentence.")
    return out


def pct(xs, q) -> float:
    return float(np.percentile(np.asarray(xs, np.float64), q)) if len(xs) else float("nan")


# ------------------------------------------------------------------------------------------ the subscriber

def subscriber(address: str, analyzer: str, patterns: list[str], out: str) -> int:
    """Collect (kind, round-free) latency samples until SIGTERM; write them as JSON."""
    from mia_stream.consumers import open_batches

    samples = {"score": [], "publish": [], "frames": [], "steps": [], "rows": 0, "step_requests": []}
    stop = False

    def _term(*_):
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, _term)
    with open_batches(address, patterns, from_start=False, timeout=0.2,
                      consumer_id=f"latency-subscriber-{os.getpid()}") as events:
        Path(out + ".ready").write_text("1")
        src = events._source  # iterate in ticks so SIGTERM is seen between them
        while not stop:
            for ev in src.events(0.2):
                now = time.time_ns()
                if ev.kind != "batch":
                    continue
                b = ev.batch
                if b.KIND == "step_batch":
                    samples["frames"].append((b.step, now - b.time_ns))
                    samples["step_requests"].append(len(b.request_ids))
                    samples["steps"].append((b.producer_id, b.step, b.time_ns))
                elif b.KIND == "analysis" and b.analyzer == analyzer and b.step >= 0 and b.source_time_ns:
                    samples["score"].append((b.step, now - b.source_time_ns))
                    samples["publish"].append((b.step, b.time_ns - b.source_time_ns))
                    samples["rows"] += int(b.rows.sum())
                if stop:
                    break
    Path(out).write_text(json.dumps(samples))
    return 0


def summarize(samples: dict) -> dict:
    score = [x for _, x in samples["score"]]
    publish = [x for _, x in samples["publish"]]
    scored_steps = {s for s, _ in samples["score"]}
    frames = [x for s, x in samples["frames"] if s in scored_steps]
    by_producer: dict = {}
    for p, s, t in samples["steps"]:
        by_producer.setdefault(p, {})[s] = t
    steps = []
    for ts in by_producer.values():
        order = sorted(ts)
        steps += [ts[b] - ts[a] for a, b in zip(order, order[1:]) if b == a + 1]
    ms = 1e-6
    out = {"messages": len(score), "rows": samples["rows"],
           "requests_per_step": float(np.mean(samples["step_requests"])) if samples["step_requests"] else 0.0}
    for name, xs in (("score", score), ("publish", publish), ("frames", frames), ("step", steps)):
        out[name] = (pct(xs, 50) * ms, pct(xs, 99) * ms, len(xs))
    out["p99_in_steps"] = out["score"][1] / out["step"][0] if out["step"][0] else float("nan")
    return out


def line(tag: str, s: dict) -> str:
    f = lambda k: f"{s[k][0]:6.1f} / {s[k][1]:6.1f}"  # noqa: E731
    return (f"{tag:<7} msgs {s['messages']:4d} rows {s['rows']:5d} ({s['requests_per_step']:.1f} requests/step_batch) | score p50/p99 {f('score')} ms | publish "
            f"{f('publish')} ms | frames {f('frames')} ms | step p50/p99 {f('step')} ms | score p99 = "
            f"{s['p99_in_steps']:.2f} decode steps")


# ------------------------------------------------------------------------------------------ the run

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--analyzer", default="token_probe", help="the detector (mia-stream analyze --list)")
    ap.add_argument("--config", help="its config file")
    ap.add_argument("--requests", type=int, default=8, help="questions per round, sent at once")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--eager", action="store_true", help="enforce_eager (no torch.compile)")
    ap.add_argument("--seed", type=int, default=None, help="prompt seed (default: fresh)")
    ap.add_argument("--subscriber", nargs=3, metavar=("ADDRESS", "ANALYZER", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.subscriber:
        address, analyzer, out = args.subscriber
        return subscriber(address, analyzer, ["lat-*"], out)

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    py = [sys.executable, "-m", "mia_stream.cli"]
    cfg = ["--config", args.config] if args.config else []
    spec = subprocess.run(py + ["analyze", args.analyzer, *cfg, "--print-spec"], capture_output=True, text=True)
    if spec.returncode != 0:
        print(spec.stderr.strip(), file=sys.stderr)
        return 2
    capture = json.loads(spec.stdout)["capture"]
    run_dir = Path(tempfile.mkdtemp(prefix="mia-lat-", dir="/tmp"))
    procs = {}
    try:
        procs["broker"] = subprocess.Popen(py + ["broker", "--address", str(run_dir)], stdout=subprocess.DEVNULL)
        while not (run_dir / "consumers.sock").exists():
            time.sleep(0.05)
        procs["analyzer"] = subprocess.Popen(py + ["analyze", args.analyzer, *cfg, "--source", str(run_dir),
                                                   "--publish", "--patterns", "lat-*"], stderr=subprocess.PIPE,
                                             text=True)
        os.environ["MIA_STREAM_BROKER"] = str(run_dir)
        from mia_stream.model import default_model_dir
        from vllm import LLM, SamplingParams

        t0 = time.monotonic()
        llm = LLM(str(default_model_dir()), dtype="float32", enforce_eager=args.eager, max_model_len=1024, seed=0)
        print(f"engine up in {time.monotonic() - t0:.0f} s ({'eager' if args.eager else 'torch.compile'}); "
              f"detector {args.analyzer}, capture {json.dumps(capture)}", flush=True)
        rng = random.Random(args.seed)
        total = {"score": [], "publish": [], "frames": [], "steps": [], "rows": 0, "step_requests": []}
        for r in range(args.rounds):
            out = str(run_dir / f"round{r}.json")
            sub = subprocess.Popen([sys.executable, __file__, "--subscriber", str(run_dir), args.analyzer, out])
            while not Path(out + ".ready").exists():
                time.sleep(0.05)
            time.sleep(0.3)  # its subscription reaches the broker
            qs = random_questions(rng, args.requests)
            params = [SamplingParams(max_tokens=args.max_tokens, temperature=0.0,
                                     extra_args={"mia_stream": {"capture": capture, "id": f"lat-{r}-{i}"}})
                      for i in range(len(qs))]
            llm.chat([[{"role": "user", "content": q}] for q in qs], params, use_tqdm=False)
            time.sleep(1.0)  # the last scores arrive
            sub.send_signal(signal.SIGTERM)
            sub.wait(30)
            samples = json.loads(Path(out).read_text())
            print(line(f"round {r}", summarize(samples)), flush=True)
            for k in ("score", "publish", "frames", "steps", "step_requests"):
                total[k] += samples[k]
            total["rows"] += samples["rows"]
        print(line("all", summarize(total)), flush=True)
        llm.llm_engine.engine_core.shutdown()
    finally:
        stop_processes(procs.values())
    err = procs["analyzer"].stderr.read() if procs.get("analyzer") else ""
    if err.strip():
        print(err.strip().splitlines()[-1], file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
