"""TP=2 vs TP=1: the same prompts through two real engines, merged tensors compared.

    .venv/bin/python scripts/tp_check.py [--tp 1 2] [--verbose]                   # vLLM CPU, float32, eager
    python3 scripts/tp_check.py --device cuda [--dtype bfloat16] [--eager]        # two GPUs, CUDA graphs

Prints, per stream and tensor, max |TP2 - TP1| / max |TP1| (per layer, worst layer), and whether the
greedy tokens match. Runs the engines one after the other in subprocesses (tests/tp_engine_run.py) against a
broker in this process; the model is tests/tp_model.py's tiny random Llama (8 heads, 4 KV heads).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from tp_engine_run import run_and_collect, standard_plan  # noqa: E402
from tp_model import tiny_model_dir  # noqa: E402


def stacked(events, name):
    frames = [e.frame for e in events if e.kind == "frame" and name in e.frame.raw_tensors]
    return [p for f in frames for p in f.positions], np.concatenate([f.tensors[name] for f in frames], axis=1)


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    axes = tuple(range(1, a.ndim))
    return float((np.abs(a - b).max(axis=axes) / np.abs(b).max(axis=axes)).max())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--verbose", action="store_true")
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--dtype", default=None, help="default: float32 on the CPU, bfloat16 on CUDA")
    ap.add_argument("--eager", action="store_true", help="CUDA: enforce_eager instead of CUDA graphs")
    args = ap.parse_args()
    dtype = args.dtype or ("float32" if args.device == "cpu" else "bfloat16")
    from mia_stream.broker import run_broker_in_thread

    model = str(tiny_model_dir())
    run_dir = tempfile.mkdtemp(prefix="mia-tp-", dir="/tmp")
    work = Path(tempfile.mkdtemp(prefix="mia-tp-work-"))
    results = {}
    try:
        with run_broker_in_thread(address=run_dir):
            for tp in args.tp:
                t0 = time.monotonic()
                out, events, log = run_and_collect(model, run_dir, tp, standard_plan(f"tp{tp}"),
                                                   work / f"tp{tp}", device=args.device, dtype=dtype,
                                                   graphs=args.device == "cuda" and not args.eager)
                print(f"TP={tp}: {time.monotonic() - t0:.1f} s (engine start {out.get('start_s', float('nan')):.1f} s), "
                      f"phases done {out['done']}", flush=True)
                if "batch" not in out["done"]:
                    print(log[-4000:])
                    return 1
                results[tp] = (out, events)
                for sid, evs in sorted(events.items()) if args.verbose else ():
                    rs = evs[0].stream
                    print(" ", sid, [e.kind for e in evs].count("frame"), "frames",
                          [e.gap.reason for e in evs if e.kind == "gap"][:3],
                          {r: (x.finish_reason, x.frames_sent) for r, x in rs.ends.items()})
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
    if sorted(results) != [1, 2]:
        return 0
    (o1, e1), (o2, e2) = results[1], results[2]

    print(f"{'stream':<14} {'tokens':>7} {'hs':>10} {'q':>10} {'k':>10} {'frames':>7} {'gaps':>5}")
    for sid1, r1 in o1["phases"]["batch"].items():
        sid2 = sid1.replace("tp1", "tp2", 1)
        r2 = o2["phases"]["batch"][sid2]
        row = [sid1.removeprefix("tp1-"), "same" if r1["token_ids"] == r2["token_ids"] else "DIFFER"]
        for name in ("hs", "q", "k"):
            if not any(e.kind == "frame" and name in e.frame.raw_tensors for e in e1[sid1]):
                row.append("-")
                continue
            try:
                p1, a = stacked(e1[sid1], name)
                p2, b = stacked(e2[sid2], name)
                row.append(f"{rel(b, a):.2e}" if p1 == p2 and a.shape == b.shape else "MISMATCH")
            except ValueError:
                row.append("MISSING")
        nframes = [sum(e.kind == "frame" for e in ev) for ev in (e1[sid1], e2[sid2])]
        ngaps = [sum(e.kind == "gap" for e in ev) for ev in (e1[sid1], e2[sid2])]
        print(f"{row[0]:<14} {row[1]:>7} {row[2]:>10} {row[3]:>10} {row[4]:>10} "
              f"{nframes[0]:>3}/{nframes[1]:<3} {ngaps[0]}/{ngaps[1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
