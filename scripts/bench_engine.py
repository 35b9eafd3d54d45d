"""Engine overhead of capture and steering in the topology users run, plain vLLM side by side.

    .venv/bin/python scripts/bench_engine.py --out /tmp/be                        # CPU, the embedded model
    python3 scripts/bench_engine.py --model /tmp/models/llama8b-shape --dummy --n 256 --tokens 128 \\
        --prompt-len 64 --out $OUT                                                # the H200 (8B shape)

Two engines run in one driver process, both with vLLM's default multiprocess engine core: ``plain`` (the
plugin inactive: no ``MIA_STREAM_BROKER`` in its environment) and ``plugin``. The broker (``mia-stream
broker``) and one consumer subscribed to ``*`` run as their own processes. Each round draws fresh random
prompts and runs every row on the plugin engine and the same prompts on the plain engine, back to back, so
no row gets prefix-cache hits the other does not and clock drift spreads over the rows; the ``shared_prefix``
row gives all prompts one shared system prompt (``--shared-prefix`` tokens) that both engines cache.

Per row: generated tokens/s of each engine and their ratio, the decode step time of the plain engine, and
from the consumer: request-steps delivered, seqs lost (gaps + producer drops), and the latency from a frame's
``time_ns`` (its step's forward was enqueued) to the consumer callback, p50 and p99, also in decode steps.
``--consumer-api batches`` makes the consumer use the vectorized batch API.
Writes ``results.json`` and prints a table. ``--rows`` picks rows; ``--rounds`` repeats them.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


# ---------------------------------------------------------------------------------------------- rows

def rows(L: int, H: int, rng: np.random.Generator) -> dict:
    """name -> (spec or None or "distinct", kind): kind "decode" (default prompts), "prefill" (long prompts),
    "shared" (a shared system prompt)."""
    vec = rng.standard_normal(H).astype(np.float32)
    vec = (vec / np.linalg.norm(vec)).tolist()
    mid = L // 2
    hs1 = {"capture": {"hidden_states": {"layers": [mid], "positions": "all"}}}
    return {
        "idle": (None, "decode"),
        "hs_1layer_all": (hs1, "decode"),
        "hs_all_last_prompt": ({"capture": {"hidden_states": {"layers": "all", "positions": "last_prompt"}}}, "decode"),
        "hs_all_all": ({"capture": {"hidden_states": {"layers": "all", "positions": "all"}}}, "decode"),
        "qk_1layer": ({"capture": {"qk": {"layers": [mid], "heads": "all", "positions": "all"}}}, "decode"),
        "steer_1layer": ({"steer": [{"layer": mid, "op": "add", "vector": vec, "scale": 0.5}]}, "decode"),
        "steer_all_layers": ({"steer": [{"layer": i, "op": "add", "vector": vec, "scale": 0.1} for i in range(L)]},
                             "decode"),
        "steer_256_vectors": ("distinct", "decode"),
        "prefill_hs_1layer": (hs1, "prefill"),
        "prefill_steer_1layer": ({"steer": [{"layer": mid, "op": "add", "vector": vec, "scale": 0.5}]}, "prefill"),
        "prefill_hs_all_last_prompt": ({"capture": {"hidden_states": {"layers": "all", "positions": "last_prompt"}}},
                                       "prefill"),
        "shared_prefix_hs_generated": ({"capture": {"hidden_states": {"layers": [mid], "positions": "generated"}}},
                                       "shared"),
    }


# ---------------------------------------------------------------------------------------------- consumer process

def consumer_main(address: str, out_path: str, api: str) -> None:
    """Subscribed to ``*``: writes one JSON line per ended request (frames, lost seqs, latencies in ms)."""
    from mia_stream.consumers import open_stream

    per: dict[str, dict] = {}
    out = open(out_path, "a", buffering=1)

    def rec(rid):
        return per.setdefault(rid, {"frames": 0, "gap_seqs": 0, "lat": []})

    def done(rid, end):
        r = per.pop(rid, None) or rec(rid)
        lat = r["lat"]
        # producer drops are counted in the end's frames_dropped and announced by gaps naming their seqs
        out.write(json.dumps({"id": rid, "frames": r["frames"], "gap_seqs": r["gap_seqs"],
                              "dropped": end.frames_dropped, "reason": end.finish_reason,
                              "lat": [round(x, 3) for x in lat]}) + "\n")

    print("ready", flush=True)
    if api == "batches":
        from mia_stream.consumers import open_batches

        with open_batches(address, patterns=["*"]) as events:
            for ev in events:
                now = time.time_ns()
                if ev.kind == "batch" and ev.batch.KIND == "step_batch":
                    ms = (now - ev.batch.time_ns) / 1e6
                    for rid in ev.batch.request_ids:
                        r = rec(rid)
                        r["frames"] += 1
                        r["lat"].append(ms)
                elif ev.kind == "gap":
                    rec(ev.gap.request_id)["gap_seqs"] += ev.gap.count
                elif ev.kind == "end":
                    done(ev.end.request_id, ev.end)
        return
    with open_stream(address, patterns=["*"]) as events:
        for ev in events:
            if ev.kind == "frame":
                r = rec(ev.stream.request_id)
                r["frames"] += 1
                r["lat"].append((time.time_ns() - ev.frame.time_ns) / 1e6)
            elif ev.kind == "gap":
                rec(ev.stream.request_id)["gap_seqs"] += ev.gap.count
            elif ev.kind == "end":
                done(ev.stream.request_id, ev.end)


def _read_ends(path: str, ids: set[str]) -> list[dict]:
    got = []
    try:
        with open(path) as f:
            for line in f:
                d = json.loads(line)
                if d["id"] in ids:
                    got.append(d)
    except FileNotFoundError:
        pass
    return got


# ---------------------------------------------------------------------------------------------- engines

def make_llm(a: argparse.Namespace, plugin: bool, address: str):
    """An engine whose core processes see ``MIA_STREAM_BROKER`` only when ``plugin`` (read at their spawn)."""
    from vllm import LLM

    if plugin:
        os.environ["MIA_STREAM_BROKER"] = address
    else:
        os.environ.pop("MIA_STREAM_BROKER", None)
    kw = dict(model=a.model, dtype=a.dtype, max_model_len=a.max_len, enforce_eager=a.eager, seed=0,
              max_num_seqs=max(a.n, 8), enable_prefix_caching=True)
    if a.gpu_mem:
        kw["gpu_memory_utilization"] = a.gpu_mem
    if a.dummy:
        kw["load_format"] = "dummy"
    try:
        return LLM(**kw)
    finally:
        os.environ.pop("MIA_STREAM_BROKER", None)


def run_batch(llm, prompts: list, params) -> tuple[int, float]:
    from vllm import SamplingParams

    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    dt = time.perf_counter() - t0
    # the worker learns of finished requests at the next step: one more tiny request ends the last streams
    llm.generate([{"prompt_token_ids": prompts[0][:4]}], SamplingParams(max_tokens=1), use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in outs), dt


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="model dir (default: the embedded model)")
    ap.add_argument("--dummy", action="store_true", help="load_format=dummy (a config-only model dir)")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on the CPU")
    ap.add_argument("--n", type=int, default=64, help="concurrent requests per row")
    ap.add_argument("--tokens", type=int, default=32, help="generated tokens per request")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--prefill-n", type=int, default=32)
    ap.add_argument("--prefill-len", type=int, default=2048)
    ap.add_argument("--shared-prefix", type=int, default=1024)
    ap.add_argument("--rows", default="idle,hs_1layer_all", help="comma list, or 'all'")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--eager", action="store_true")
    ap.add_argument("--gpu-mem", type=float, default=None, help="gpu_memory_utilization of EACH engine")
    ap.add_argument("--consumer-api", default="events", choices=("events", "batches"))
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    from vllm import SamplingParams

    try:
        import torch

        cuda = torch.cuda.is_available()
    except Exception:  # noqa: BLE001
        cuda = False
    if a.model is None:
        from mia_stream.model import default_model_dir

        a.model = str(default_model_dir())
    a.dtype = a.dtype or ("bfloat16" if cuda else "float32")
    if cuda and a.gpu_mem is None:
        a.gpu_mem = 0.4
    if not cuda:
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    need = max(a.prompt_len, a.prefill_len, a.shared_prefix + a.prompt_len) + a.tokens + 16
    a.max_len = need
    os.environ.setdefault("MIA_STREAM_APERTURE_ROWS", str(max(4096, need)))
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = json.load(open(Path(a.model) / "config.json"))
    L, H, vocab = cfg["num_hidden_layers"], cfg["hidden_size"], cfg["vocab_size"]
    rng = np.random.default_rng(int(time.time()))
    table = rows(L, H, np.random.default_rng(0))
    names = list(table) if a.rows == "all" else a.rows.split(",")
    run_dir = tempfile.mkdtemp(prefix="mia-be-", dir="/tmp")
    env = dict(os.environ, PYTHONPATH=f"{REPO}:{os.environ.get('PYTHONPATH', '')}")
    broker = subprocess.Popen([sys.executable, "-m", "mia_stream.broker", "--address", run_dir],
                              stdout=subprocess.PIPE, text=True, env=env)
    ends_path = str(out / "consumer-ends.jsonl")
    consumer = None
    results: dict = {"args": vars(a), "cuda": cuda, "rows": {}}
    try:
        if "ready" not in broker.stdout.readline():
            raise RuntimeError("broker did not start")
        consumer = subprocess.Popen([sys.executable, __file__, "--consumer", run_dir, ends_path, a.consumer_api],
                                    stdout=subprocess.PIPE, text=True, env=env)
        if "ready" not in consumer.stdout.readline():
            raise RuntimeError("consumer did not start")
        t0 = time.perf_counter()
        plugin = make_llm(a, True, run_dir)
        plain = make_llm(a, False, run_dir)
        results["engine_start_s"] = round(time.perf_counter() - t0, 1)

        def prompts_for(kind: str) -> list:
            if kind == "prefill":
                return [rng.integers(100, vocab, a.prefill_len).tolist() for _ in range(a.prefill_n)]
            if kind == "shared":
                prefix = shared_prefix
                return [prefix + rng.integers(100, vocab, a.prompt_len).tolist() for _ in range(a.n)]
            return [rng.integers(100, vocab, a.prompt_len).tolist() for _ in range(a.n)]

        shared_prefix = rng.integers(100, vocab, a.shared_prefix).tolist()
        base = dict(max_tokens=a.tokens, temperature=1.0, ignore_eos=True)
        warm = prompts_for("decode")
        for llm in (plugin, plain):  # one-time costs (allocations, lazy init, compile of new shapes)
            run_batch(llm, warm, SamplingParams(**base))
        for rnd in range(a.rounds):
            for name in names:
                spec, kind = table[name]
                prompts = prompts_for(kind)
                if kind == "shared":  # both engines cache the shared prefix first (a real server has it warm)
                    for llm in (plugin, plain):
                        run_batch(llm, prompts[:1], SamplingParams(**base))
                tag = f"r{rnd}-{name}"
                if spec is None:
                    params = SamplingParams(**base)
                elif spec == "distinct":
                    params = []
                    for i in range(len(prompts)):
                        v = rng.standard_normal(H).astype(np.float32)
                        params.append(SamplingParams(**base, extra_args={"mia_stream": {
                            "steer": [{"layer": L // 2, "op": "add", "vector": (v / np.linalg.norm(v)).tolist(),
                                       "scale": 0.5}], "id": f"{tag}-{i}"}}))
                else:
                    params = [SamplingParams(**base, extra_args={"mia_stream": dict(spec, id=f"{tag}-{i}")})
                              for i in range(len(prompts))]
                ids = {f"{tag}-{i}" for i in range(len(prompts))} if spec is not None else set()
                order = [("plugin", plugin), ("plain", plain)] if rnd % 2 == 0 else [("plain", plain), ("plugin", plugin)]
                row = {}
                for which, llm in order:
                    gen, dt = run_batch(llm, prompts, params if which == "plugin" else SamplingParams(**base))
                    row[which] = {"tokens": gen, "s": round(dt, 3), "tok_s": round(gen / dt, 1)}
                if consumer.poll() is not None:
                    raise RuntimeError(f"the consumer process exited ({consumer.returncode}); see its stderr above")
                deadline = time.monotonic() + 30
                ends = _read_ends(ends_path, ids)
                while len(ends) < len(ids) and time.monotonic() < deadline:
                    time.sleep(0.2)
                    ends = _read_ends(ends_path, ids)
                lat = np.array([x for e in ends for x in e["lat"]]) if ends else np.zeros(0)
                steps = row["plain"]["tokens"] / max(len(prompts), 1)
                step_ms = 1e3 * row["plain"]["s"] / max(steps, 1)
                row.update(ratio=round(row["plugin"]["tok_s"] / row["plain"]["tok_s"], 3), plain_step_ms=round(step_ms, 2),
                           streams=len(ids), ended=len(ends), frames=sum(e["frames"] for e in ends),
                           gap_seqs=sum(e["gap_seqs"] for e in ends), dropped=sum(e["dropped"] for e in ends))
                if lat.size:
                    row.update(lat_p50_ms=round(float(np.percentile(lat, 50)), 2),
                               lat_p99_ms=round(float(np.percentile(lat, 99)), 2),
                               lat_p99_steps=round(float(np.percentile(lat, 99)) / step_ms, 2))
                results["rows"].setdefault(name, []).append(row)
                print(f"[bench_engine] round {rnd} {name}: {json.dumps(row)}", flush=True)
                (out / "results.json").write_text(json.dumps(results, indent=1))
    finally:
        for p in (consumer, broker):
            if p is not None and p.poll() is None:
                p.terminate()
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
    print_table(results)
    return 0


def print_table(results: dict) -> None:
    print(f"\n{'row':28s} {'ratio':>7s} {'plugin tok/s':>13s} {'plain tok/s':>12s} {'step ms':>8s} {'frames':>8s} "
          f"{'gaps':>6s} {'dropped':>7s} {'p50 ms':>8s} {'p99 ms':>8s} {'p99 steps':>9s}")
    for name, runs in results["rows"].items():
        for r in runs:
            print(f"{name:28s} {r['ratio']:7.3f} {r['plugin']['tok_s']:13.1f} {r['plain']['tok_s']:12.1f} "
                  f"{r['plain_step_ms']:8.2f} {r['frames']:8d} {r['gap_seqs']:6d} {r['dropped']:7d} {r.get('lat_p50_ms', float('nan')):8.2f} "
                  f"{r.get('lat_p99_ms', float('nan')):8.2f} {r.get('lat_p99_steps', float('nan')):9.2f}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--consumer":
        consumer_main(*sys.argv[2:5])
        sys.exit(0)
    mp.set_start_method("spawn", force=True)
    sys.exit(main())
