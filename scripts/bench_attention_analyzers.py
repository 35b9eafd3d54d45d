#!/usr/bin/env python
"""What the attention analyzers (attention_tracker, core_reranker, attnlink) cost in one analyzer process.

    python scripts/bench_attention_analyzers.py                    # 8B geometry, 256 prompts of 512 tokens
    python scripts/bench_attention_analyzers.py --prompt 2048 --requests 64

These analyzers read Q/K at prompt positions only: a request costs them during its prefill (its Q/K rows are
gathered step by step, then its attention rows are rebuilt and scored once its last prompt row arrives);
decode steps carry no Q/K for them and cost nothing. The workload is therefore a prefill: ``--requests``
prompts of ``--prompt`` tokens, chunked into steps of ``--step-tokens`` tokens (vLLM's max_num_batched_tokens),
each step one ``StepBatch`` with the captured layers' Q and K (bfloat16, fresh random values every step) of
every head the config names, encoded as the wire carries them. Each step is timed through what
``run_analyzer`` does: decode -> the SDK's assembler (batch mode) -> ``AnalyzerRunner.feed`` -> the result
encoded for publishing. The analyzers run side by side in one process, interleaved step by step. Sockets and
the broker are not in these numbers.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mia_stream.analyzers import AnalyzerRunner, create  # noqa: E402
from mia_stream.consumers import StreamAssembler  # noqa: E402
from mia_stream.schemas import RowGroup, StepBatch, StreamStart, Tensor, decode, encode  # noqa: E402


def _bf16(x: np.ndarray) -> np.ndarray:
    b = x.astype(np.float32).view(np.uint32)
    return ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).astype(np.uint16)


def _configs(num_layers: int, num_heads: int) -> dict:
    mid = num_layers // 2
    return {
        # Attention Tracker: a handful of important heads over a few layers (the paper keeps ~1-5% of heads)
        "attention_tracker": {"heads": [[mid - 4, 1], [mid - 2, 3], [mid, 5], [mid, 9], [mid + 2, 2],
                                        [mid + 3, 7], [mid + 4, 11], [mid + 6, 0], [mid + 6, 4], [mid + 8, 6]],
                              "threshold": 0.5},
        # CoRe heads: 8 heads in the middle layers
        "core_reranker (8 CoRe heads)": {"heads": [[mid - 3, 2], [mid - 2, 8], [mid - 1, 5], [mid, 0],
                                                   [mid, 12], [mid + 1, 3], [mid + 2, 7], [mid + 3, 1]],
                                         "calibrate": False},
        # ICR: every head of every layer
        "core_reranker (ICR, all heads)": {"heads": "all", "calibrate": False},
        "attnlink": {"layer": mid, "head": 4},
    }


def _tags(prompt: int) -> dict:
    docs = [[60 + i * (prompt - 160) // 10, 60 + (i + 1) * (prompt - 160) // 10 - 2] for i in range(10)]
    cols = [[60 + i * (prompt - 160) // 20, 60 + (i + 1) * (prompt - 160) // 20 - 1] for i in range(20)]
    return {"spans": {"instruction": [[4, 50]], "data": [[56, prompt - 10]], "doc": docs,
                      "query": [[prompt - 90, prompt]], "column": cols}}


def _step_batches(rng, ids, prompt, step_tokens, layers, q_heads, kv_heads, head_dim):
    """The prefill of every request, ``step_tokens`` rows per step (a request's chunks in order)."""
    todo = [(i, p) for i in range(len(ids)) for p in range(prompt)]
    step = 0
    for s0 in range(0, len(todo), step_tokens):
        rows = todo[s0:s0 + step_tokens]
        reqs, counts = np.unique([r for r, _ in rows], return_counts=True)
        n = len(rows)
        q = _bf16(rng.standard_normal((len(layers), n, len(q_heads), head_dim)).astype(np.float32))
        k = _bf16(rng.standard_normal((len(layers), n, len(kv_heads), head_dim)).astype(np.float32))
        g = RowGroup(np.arange(len(reqs)), counts, np.array([p for _, p in rows]),
                     [Tensor("q", "bfloat16", q.shape, memoryview(q).cast("B"), tuple(layers),
                             meta={"heads": list(q_heads)}),
                      Tensor("k", "bfloat16", k.shape, memoryview(k).cast("B"), tuple(layers),
                             meta={"heads": list(kv_heads)})],
                     np.full(n, 11), part=1)
        yield StepBatch("bench", 1, step, [ids[i] for i in reqs], np.full(len(reqs), 1 + step), [g],
                        time_ns=time.time_ns())
        step += 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--prompt", type=int, default=512, help="prompt tokens per request")
    ap.add_argument("--step-tokens", type=int, default=2048, help="prompt rows per engine step")
    ap.add_argument("--num-layers", type=int, default=32)
    ap.add_argument("--num-heads", type=int, default=32)
    ap.add_argument("--num-kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--analyzers", nargs="+", default=None, help="labels of the configs to run (default all)")
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    configs = _configs(args.num_layers, args.num_heads)
    labels = args.analyzers or list(configs)
    group = args.num_heads // args.num_kv_heads
    paths = {}
    for label in labels:
        an = create(label.split(" ")[0], configs[label])
        spec = an.capture_spec()["qk"]
        layers = list(range(args.num_layers)) if spec["layers"] == "all" else spec["layers"]
        q_heads = list(range(args.num_heads)) if spec["heads"] == "all" else spec["heads"]
        kv_heads = sorted({h // group for h in q_heads})
        cap = {"qk": {"layers": layers, "heads": q_heads, "positions": "prompt"}}
        runner = AnalyzerRunner(an, [lambda b: encode(b)])
        asm = StreamAssembler(batches=True)
        ids = [f"{label[:8]}-{i}" for i in range(args.requests)]
        for rid in ids:
            st = StreamStart(rid, "bench", 1, 0, capture=cap, num_layers=args.num_layers, num_heads=args.num_heads,
                             num_kv_heads=args.num_kv_heads, head_dim=args.head_dim,
                             prompt_token_ids=list(range(args.prompt)), tags=_tags(args.prompt))
            for ev in asm.feed(st):
                runner.feed(ev)
        steps = _step_batches(rng, ids, args.prompt, args.step_tokens, layers, q_heads, kv_heads, args.head_dim)
        paths[label] = {"asm": asm, "runner": runner, "steps": steps, "times": [], "bytes": 0,
                        "layers": len(layers), "heads": len(q_heads)}
    live = dict(paths)
    while live:  # interleaved: one step of each analyzer in turn
        for label in list(live):
            p = live[label]
            batch = next(p["steps"], None)
            if batch is None:
                del live[label]
                continue
            wire = encode(batch)
            p["bytes"] += sum(len(f) for f in wire)
            t0 = time.perf_counter()
            for ev in p["asm"].feed(decode(wire)):
                p["runner"].feed(ev)
            p["times"].append(time.perf_counter() - t0)
    print(f"# {args.requests} prompts x {args.prompt} tokens, {args.step_tokens} rows per step; model "
          f"{args.num_layers} layers x {args.num_heads} heads ({args.num_kv_heads} KV) x {args.head_dim}, bf16 Q/K")
    print(f"{'analyzer':<32} {'captured':>14} {'MB/step':>8} {'ms/step med':>12} {'p90':>7} {'max':>7} "
          f"{'ms/request':>11} {'prompt tok/s':>13}")
    for label, p in paths.items():
        ts, c = p["times"], p["runner"].counters
        assert c["analysis_rows"] == args.requests and not c["rejected"], (label, dict(c))
        total = sum(ts)
        print(f"{label:<32} {p['layers']:>3} L x {p['heads']:>2} H {p['bytes'] / len(ts) / 1e6:>8.1f} "
              f"{statistics.median(ts) * 1e3:>12.2f} {np.percentile(ts, 90) * 1e3:>7.2f} {max(ts) * 1e3:>7.2f} "
              f"{total / args.requests * 1e3:>11.2f} {args.requests * args.prompt / total:>13.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
