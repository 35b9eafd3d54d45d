"""Capture overhead on a real vLLM engine, side by side in one run: plain vLLM vs the plugin idle vs capture.

    .venv/bin/python scripts/bench_capture.py [--model DIR] [--prompts 16] [--tokens 32] [--eager]

Each engine runs in its own process (vLLM loads plugins once per process): one with MIA_STREAM_BROKER unset
(plain vLLM: the plugin returns at once) and one with a broker and a draining consumer, where every row
differs only by the per-request capture spec. Prints tokens/s, the ratio to plain, captured bytes/s and
frames dropped.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

ROWS = {
    "plugin idle": None,
    "HS 1 layer, all positions": {"capture": {"hidden_states": {"layers": [15], "positions": "all"}}},
    "HS all layers, last_prompt": {"capture": {"hidden_states": {"layers": "all", "positions": "last_prompt"}}},
    "HS all layers, all positions": {"capture": {"hidden_states": {"layers": "all", "positions": "all"}}},
    "Q/K 1 layer, all positions": {"capture": {"qk": {"layers": [15], "heads": "all", "positions": "all"}}},
}


def _prompts(n):
    return [f"Write a short story number {i} about a robot who learns to paint." for i in range(n)]


def _run_engine(args, rows: dict) -> dict:
    from vllm import LLM, SamplingParams

    llm = LLM(args.model, dtype="float32", enforce_eager=args.eager, max_model_len=1024, seed=0)
    prompts = _prompts(args.prompts)
    warm = SamplingParams(max_tokens=4, temperature=0.0)
    llm.generate(prompts[:2], warm, use_tqdm=False)
    out = {}
    for name, spec in rows.items():
        params = [SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True,
                                 extra_args={"mia_stream": dict(spec, id=f"bench-{name[:6]}-{i}")} if spec else None)
                  for i in range(len(prompts))]
        t = time.perf_counter()
        res = llm.generate(prompts, params, use_tqdm=False)
        dt = time.perf_counter() - t
        out[name] = {"tok_s": sum(len(r.outputs[0].token_ids) for r in res) / dt, "seconds": dt}
    return out


def _child(args) -> None:
    rows = {"plain vLLM": None} if args.child == "plain" else ROWS
    if args.child == "plugin":
        from mia_stream.broker import run_broker_in_thread
        from mia_stream.consumers import open_stream

        run_dir = tempfile.mkdtemp(prefix="mia-bench-", dir="/tmp")
        os.environ["MIA_STREAM_BROKER"] = run_dir
        stats = {"bytes": 0, "frames": 0, "gaps": 0, "dropped": 0}
        with run_broker_in_thread(address=run_dir):
            stream = open_stream(run_dir, patterns=["bench-*"])

            def drain():
                for ev in stream:
                    if ev.kind == "frame":
                        stats["frames"] += 1
                        stats["bytes"] += sum(t.nbytes for t in ev.frame.raw_tensors.values())
                    elif ev.kind == "gap":
                        stats["gaps"] += 1
                    elif ev.kind == "end":
                        stats["dropped"] += ev.end.frames_dropped

            threading.Thread(target=drain, daemon=True).start()
            result = {}
            for name, spec in rows.items():
                before = dict(stats)
                result.update(_run_engine_once(args, name, spec))
                time.sleep(1.0)
                result[name].update({k: stats[k] - before[k] for k in stats})
    else:
        result = _run_engine(args, rows)
    print("RESULT " + json.dumps(result), flush=True)


_LLM = None


def _run_engine_once(args, name, spec):
    global _LLM
    if _LLM is None:
        from vllm import LLM, SamplingParams

        _LLM = LLM(args.model, dtype="float32", enforce_eager=args.eager, max_model_len=1024, seed=0)
        _LLM.generate(_prompts(2), SamplingParams(max_tokens=4), use_tqdm=False)
    from vllm import SamplingParams

    prompts = _prompts(args.prompts)
    params = [SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True,
                             extra_args={"mia_stream": dict(spec, id=f"bench-{abs(hash(name)) % 9999}-{i}")}
                             if spec else None) for i in range(len(prompts))]
    t = time.perf_counter()
    res = _LLM.generate(prompts, params, use_tqdm=False)
    dt = time.perf_counter() - t
    return {name: {"tok_s": sum(len(r.outputs[0].token_ids) for r in res) / dt, "seconds": dt}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--eager", action="store_true")
    ap.add_argument("--rounds", type=int, default=2, help="plain and plugin engines alternate; best round counts")
    ap.add_argument("--child", choices=("plain", "plugin"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.model is None:
        from mia_stream.model import default_model_dir

        args.model = str(default_model_dir())
    if args.child:
        _child(args)
        return 0
    results: dict = {}
    rounds: dict = {}
    for _ in range(args.rounds):  # alternate, so machine noise hits both sides alike
        for child in ("plain", "plugin"):
            env = {k: v for k, v in os.environ.items() if k != "MIA_STREAM_BROKER"}
            env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
            cmd = [sys.executable, __file__, "--child", child, "--model", args.model, "--prompts",
                   str(args.prompts), "--tokens", str(args.tokens)] + (["--eager"] if args.eager else [])
            out = subprocess.run(cmd, env=env, capture_output=True, text=True)
            line = [l for l in out.stdout.splitlines() if l.startswith("RESULT ")]
            if not line:
                print(out.stderr[-3000:], file=sys.stderr)
                return 1
            for name, r in json.loads(line[0][7:]).items():
                rounds.setdefault(name, []).append(round(r["tok_s"], 1))
                if name not in results or r["tok_s"] > results[name]["tok_s"]:
                    results[name] = r
    base = results["plain vLLM"]["tok_s"]
    print(f"model {args.model}, {args.prompts} prompts x {args.tokens} generated tokens, float32, "
          f"{'eager' if args.eager else 'torch.compile'}, CPU")
    print(f"best of {args.rounds} alternating rounds (per-round tok/s in the last column)")
    print(f"{'row':<32} {'tok/s':>8} {'ratio':>6} {'MB/s captured':>14} {'frames':>7} {'dropped':>8} {'gaps':>5}  rounds")
    for name, r in results.items():
        mbs = r.get("bytes", 0) / r["seconds"] / 1e6
        print(f"{name:<32} {r['tok_s']:8.1f} {r['tok_s'] / base:6.3f} {mbs:14.1f} {r.get('frames', 0):7d} "
              f"{r.get('dropped', 0):8d} {r.get('gaps', 0):5d}  {rounds[name]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
