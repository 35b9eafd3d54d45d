"""Does the plugin engine start wherever plain vLLM starts, and stay inside ``gpu_memory_utilization``? (issue 26)

    python3 scripts/gpu_memory_check.py --model /tmp/models/llama8b-shape --out $OUT [--phases default,pair]

Every engine is ``LLM(model, load_format="dummy", max_model_len=2048[, gpu_memory_utilization=U])`` in its own
process (vLLM's multiprocess engine: engine core and worker are that process's children), so nothing but the
default settings differs from what a user runs.

- ``default``: a plain engine, then a plugin engine (``MIA_STREAM_BROKER`` set, a broker in the engine's process,
  a consumer counting the frames of 16 requests capturing one layer), each at vLLM's default utilization, one
  after the other. Reports: started or the error, the KV cache size (blocks and tokens), the GPU memory the
  engine took (``nvidia-smi`` memory.used after start minus before), the plugin's device bytes.
- ``pair``: two plugin engines at 0.45 each, resident side by side: the second starts once the first has (vLLM
  sizes its KV cache from the free memory it sees while profiling, so engines that profile at the same time each
  count the other's allocations: two plain engines started together got 0.4 GiB of KV cache each), then both
  serve at once. Both must start and serve, and together stay within 0.9 of the GPU.

Prints one JSON line per engine and a summary; writes ``memory.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from _procs import ensure_plugin_entry_point  # noqa: E402  (scripts/_procs.py, beside this file)


def _gpu_used_mib() -> tuple[int, int]:
    out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used,memory.total", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, check=True).stdout.split("\n")[0]
    used, total = (int(x) for x in out.split(","))
    return used, total


def _engine(name: str, model: str, plugin: bool, util: float | None, started, go, result_q) -> None:
    """One engine process: start, (wait for ``go``), serve 16 requests, report, exit."""
    rec: dict = {"name": name, "plugin": plugin, "util": util}
    try:
        broker = run_dir = None
        if plugin:  # vLLM's engine processes load the plugin through its entry point (a checkout has none)
            ensure_plugin_entry_point(Path(tempfile.mkdtemp(prefix="mia-mem-ep-")))
            from mia_stream.broker import run_broker_in_thread

            run_dir = tempfile.mkdtemp(prefix="mia-mem-", dir="/tmp")
            broker = run_broker_in_thread(address=run_dir)
            broker.__enter__()
            os.environ["MIA_STREAM_BROKER"] = run_dir
        # the memory report is a function run in the worker (collective_rpc), which vLLM sends pickled only with
        # this set; a benchmark's own engine, on the GPU machine
        os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
        from vllm import LLM, SamplingParams

        kw = {"load_format": "dummy", "max_model_len": 2048}
        if util is not None:
            kw["gpu_memory_utilization"] = util
        t0 = time.monotonic()
        llm = LLM(model, **kw)
        rec["start_s"] = round(time.monotonic() - t0, 1)
        cache = llm.llm_engine.vllm_config.cache_config
        rec["kv_blocks"] = cache.num_gpu_blocks
        rec["kv_tokens"] = (cache.num_gpu_blocks or 0) * cache.block_size
        if plugin:
            try:
                rec["plugin_memory"] = llm.collective_rpc(_plugin_memory)[0]
            except Exception as e:  # the report is informative; the start and the frames are what is checked
                rec["plugin_memory"] = f"{type(e).__name__}: {e}"
        started.put((name, True, None))
        go.wait(600)
        frames = [0]
        consumer_thread = None
        if plugin:
            from mia_stream.consumers import open_stream

            stream = open_stream(run_dir, patterns=[f"{name}-*"], timeout=120)

            def count():
                ends = 0
                for ev in stream:
                    frames[0] += ev.kind == "frame"
                    ends += ev.kind == "end"
                    if ends == 16:
                        return

            consumer_thread = threading.Thread(target=count, daemon=True)
            consumer_thread.start()
            time.sleep(0.5)
        spec = {"capture": {"hidden_states": {"layers": [1], "positions": "all"}}}
        params = [SamplingParams(max_tokens=32, temperature=0, ignore_eos=True,
                                 extra_args={"mia_stream": {**spec, "id": f"{name}-{i}"}} if plugin else None)
                  for i in range(16)]
        outs = llm.generate([f"Request {i}: tell me about the number {i}." for i in range(16)], params,
                            use_tqdm=False)
        rec["generated_tokens"] = sum(len(o.outputs[0].token_ids) for o in outs)
        if consumer_thread is not None:
            consumer_thread.join(60)
            rec["frames"] = frames[0]
        result_q.put(rec)
        llm.llm_engine.engine_core.shutdown()
        if broker is not None:
            broker.__exit__(None, None, None)
    except BaseException as e:  # noqa: BLE001  (the parent reports whatever stopped the engine)
        rec["error"] = f"{type(e).__name__}: {e}"
        rec["trace"] = traceback.format_exc()[-3000:]
        started.put((name, False, rec["error"]))
        result_q.put(rec)


def _plugin_memory(worker) -> dict:
    """The plugin's device memory and what vLLM counted as the model's, in the worker."""
    runner = getattr(worker, "model_runner", None)
    out = {"model_memory_usage": int(getattr(runner, "model_memory_usage", -1))}
    try:
        from mia_stream.producer import _vllm_adapter

        out.update(_vllm_adapter.memory_report(runner))
    except Exception as e:  # an adapter without the report: say so
        out["report_error"] = f"{type(e).__name__}: {e}"
    return out


def _run(engines: list[tuple[str, str, bool, float | None]], together: bool) -> list[dict]:
    ctx = mp.get_context("spawn")
    started, results = ctx.Queue(), ctx.Queue()
    go = ctx.Event()
    used0, total = _gpu_used_mib()
    procs, recs = [], []
    oks = []
    for name, model, plugin, util in engines:
        p = ctx.Process(target=_engine, args=(name, model, plugin, util, started, go, results))
        p.start()
        procs.append(p)
        if together:  # resident side by side, started one after the other (see the docstring)
            oks.append(started.get(timeout=900))
        else:  # one at a time: start, measure, serve, stop
            ok = started.get(timeout=900)
            used1, _ = _gpu_used_mib()
            go.set()
            rec = results.get(timeout=900)
            rec["gpu_used_mib"], rec["gpu_total_mib"] = used1 - used0, total
            p.join(120)
            go.clear()
            recs.append(rec)
            print(json.dumps({k: v for k, v in rec.items() if k != "trace"}), flush=True)
            if not ok[1]:
                print(rec.get("trace", ""), flush=True)
            used0, total = _gpu_used_mib()
    if together:
        used1, _ = _gpu_used_mib()
        go.set()
        for _ in engines:
            rec = results.get(timeout=900)
            recs.append(rec)
            print(json.dumps({k: v for k, v in rec.items() if k != "trace"}), flush=True)
        for p in procs:
            p.join(120)
        recs.append({"name": "pair", "all_started": all(o[1] for o in oks), "gpu_used_mib": used1 - used0,
                     "gpu_total_mib": total, "budget_mib": round(sum(u for *_, u in engines) * total)})
        print(json.dumps(recs[-1]), flush=True)
    return recs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="/tmp/models/llama8b-shape")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/gpu-memory"))
    ap.add_argument("--phases", default="default,pair")
    args = ap.parse_args(argv)
    out: dict = {}
    phases = args.phases.split(",")
    if "default" in phases:
        out["default"] = _run([("plain", args.model, False, None), ("plugin", args.model, True, None)], False)
    if "pair" in phases:
        out["pair"] = _run([("pair-a", args.model, True, 0.45), ("pair-b", args.model, True, 0.45)], True)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "memory.json").write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
