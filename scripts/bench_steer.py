"""Steering overhead on a real vLLM engine, side by side in one run: unsteered vs 1 layer vs all layers vs
a different vector for every request of the batch.

    .venv/bin/python scripts/bench_steer.py [--prompts 16] [--tokens 32] [--rounds 3] [--compile]

Each engine runs in its own process (vLLM loads plugins once per process): plain vLLM (MIA_STREAM_BROKER
unset, the plugin returns at once) and one engine with the plugin and a broker, where every row differs only
by the per-request ``steer`` spec (greedy, ``ignore_eos``, so every row generates the same number of tokens).
Rows run ``--rounds`` times interleaved; the best round counts (other jobs share this machine). Default
``enforce_eager`` (starts in ~45 s instead of ~80 s); ``--compile`` for torch.compile.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

STEER_LAYER = 15
ROWS = ("unsteered", "1 layer steered", "all layers steered", "distinct vector per request")
EASYSTEER_GPU = {"1 layer steered": 0.89, "all layers steered": 0.76, "distinct vector per request": 0.17}


def _prompts(n):
    return [f"Write a short story number {i} about a robot who learns to paint." for i in range(n)]


def _vector(seed: int, hidden: int, norm: float = 4.0) -> list:
    v = np.random.default_rng(seed).standard_normal(hidden)
    return (v / np.linalg.norm(v) * norm).astype(np.float32).tolist()


def _spec(row: str, i: int, num_layers: int, hidden: int):
    """The row's ``extra_args["mia_stream"]`` for request ``i`` (None: not a streamed request)."""
    if row == "unsteered":
        return None
    if row == "1 layer steered":
        ops = [{"layer": STEER_LAYER, "op": "add", "vector": _vector(0, hidden)}]
    elif row == "all layers steered":
        v = _vector(0, hidden)
        ops = [{"layer": L, "op": "add", "vector": v} for L in range(num_layers)]
    else:  # every request its own vector: as many steering-table slots as requests
        ops = [{"layer": STEER_LAYER, "op": "add", "vector": _vector(1000 + i, hidden)}]
    return {"steer": ops, "id": f"bsteer-{row[:3]}-{i}"}


def _child(args) -> dict:
    from vllm import LLM, SamplingParams

    llm = LLM(args.model, dtype="float32", enforce_eager=not args.compile, max_model_len=1024, seed=0)
    cfg = llm.llm_engine.model_config.hf_config
    num_layers, hidden = cfg.num_hidden_layers, cfg.hidden_size
    prompts = _prompts(args.prompts)
    llm.generate(prompts[:2], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    rows = ("plain vLLM",) if args.child == "plain" else ROWS
    params = {row: [SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True,
                                   extra_args=({"mia_stream": s} if (s := _spec(row, i, num_layers, hidden)) else None))
                    for i in range(len(prompts))] for row in rows}
    out: dict = {row: [] for row in rows}
    for _ in range(args.rounds):
        for row in rows:
            t = time.perf_counter()
            res = llm.generate(prompts, params[row], use_tqdm=False)
            dt = time.perf_counter() - t
            out[row].append(sum(len(r.outputs[0].token_ids) for r in res) / dt)
    llm.llm_engine.engine_core.shutdown()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--compile", action="store_true", help="torch.compile instead of enforce_eager")
    ap.add_argument("--child", choices=("plain", "plugin"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.model is None:
        from mia_stream.model import default_model_dir

        args.model = str(default_model_dir())
    if args.child == "plain":
        print("RESULT " + json.dumps(_child(args)), flush=True)
        return 0
    if args.child == "plugin":
        from mia_stream.broker import run_broker_in_thread

        run_dir = tempfile.mkdtemp(prefix="mia-bst-", dir="/tmp")
        os.environ["MIA_STREAM_BROKER"] = run_dir
        try:
            with run_broker_in_thread(address=run_dir):
                result = _child(args)
        finally:
            shutil.rmtree(run_dir, ignore_errors=True)
        print("RESULT " + json.dumps(result), flush=True)
        return 0
    t0 = time.perf_counter()
    results: dict = {}
    for child in ("plain", "plugin"):
        env = {k: v for k, v in os.environ.items() if k != "MIA_STREAM_BROKER"}
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        cmd = [sys.executable, __file__, "--child", child, "--model", args.model, "--prompts", str(args.prompts),
               "--tokens", str(args.tokens), "--rounds", str(args.rounds)] + (["--compile"] if args.compile else [])
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        if proc.returncode != 0 or not line:
            print(proc.stderr[-3000:], file=sys.stderr)
            return 1
        results.update(json.loads(line[0][7:]))
    best = {row: max(v) for row, v in results.items()}
    plain, unsteered = best["plain vLLM"], best["unsteered"]
    print(f"model {args.model}\n{args.prompts} prompts x {args.tokens} generated tokens, float32, "
          f"{'torch.compile' if args.compile else 'enforce_eager'}, CPU, best of {args.rounds} rounds, "
          f"steered layer {STEER_LAYER} (1-layer rows), {time.perf_counter() - t0:.0f} s in all")
    print(f"{'row':<30} {'tok/s (rounds)':>22} {'/plain':>7} {'/unsteered':>11} {'EasySteer GPU':>14}")
    for row, v in results.items():
        rounds = " ".join(f"{x:.1f}" for x in v)
        anchor = f"{EASYSTEER_GPU[row]:.2f}" if row in EASYSTEER_GPU else "-"
        print(f"{row:<30} {rounds:>22} {best[row] / plain:7.3f} {best[row] / unsteered:11.3f} {anchor:>14}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
