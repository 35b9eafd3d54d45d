"""A consumer's cost per step, zero-copy ring reads against copies (issue 29), in the user's topology.

    .venv/bin/python scripts/bench_zero_copy.py [--n 16] [--tokens 48] [--prompt-len 64] [--rounds 3]
        [--min-run-s 3] [--layers all] [--pyspy /path/to/py-spy]

One vLLM engine with the plugin (its engine core, worker and drain sidecar are processes of their own; the host
ring is a /dev/shm ring whose rows go by reference, ``MIA_STREAM_HOST_RING_SHM``), a ``mia-stream broker``
process, and per round one consumer process (``open_batches``; each step batch's hidden states touched:
one value per row read, what a light vectorized analyzer costs), zero-copy (``zero_copy=True``: read-only
views of the ring) and copy (``zero_copy=False``: each tensor copied out of the ring, the former path) in
A-B-A order (``--rounds`` consumers: zc, copy, zc, ...). A round generates ``--n`` requests capturing hidden
states of ``--layers`` at every position, again until it has run ``--min-run-s``.

Per round, from the consumer, from its ``--skip``-th step batch on (past the prompt steps and its first mapping
of the ring, one-offs): step batches read, its CPU milliseconds per step batch (``time.process_time`` until the
last one, so waiting costs little), ring bytes copied and viewed per step batch, the latency from a batch's
``time_ns`` (its rows reached the host) to the consumer, p50 / p99, and gaps. ``--pyspy``: the consumer of
each round is sampled too (share of its samples in ``ShmRingReader.read``/``gather``/``view``). Prints one
JSON line per round and a summary (median and range per mode).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))
from _procs import start_broker, stop_processes  # noqa: E402


def consume(a: argparse.Namespace) -> int:
    import numpy as np

    from mia_stream.consumers import open_batches

    zero_copy = a.zero_copy == "1"
    lat, steps, gaps, rows = [], 0, 0, 0
    cpu0 = wall0 = cpu1 = wall1 = None
    first: dict = {}
    with open_batches(a.address, timeout=None, zero_copy=zero_copy, consumer_id=f"bench-{a.zero_copy}") as events:
        print("ready", flush=True)
        cpu_ready = time.process_time()
        src = events._source
        client = src.client
        copied0 = viewed0 = 0
        for ev in src.events(timeout=a.idle):
            if ev.kind == "batch" and ev.batch.KIND == "step_batch":
                now = time.time_ns()
                if steps == a.skip:  # from here: past the prompt steps and the ring's first mapping (one-offs)
                    cpu0, wall0 = time.process_time(), time.monotonic()
                    first = {"first_cpu_ms": round((cpu0 - cpu_ready) * 1e3, 1),
                             "first_copied_mib": round(client.ring_bytes["copied"] / 2**20, 1),
                             "first_viewed_mib": round(client.ring_bytes["viewed"] / 2**20, 1)}
                    copied0, viewed0 = client.ring_bytes["copied"], client.ring_bytes["viewed"]
                    steps, rows, lat = 0, 0, []
                    a.skip = -1
                total = 0.0
                for g in ev.batch.groups:
                    if g.has("hs"):
                        t = g.tensor("hs").raw()
                        total += float(t[..., :1].sum())  # one value per row: the analyzer's touch
                        rows += t.shape[1]
                steps += 1
                lat.append((now - ev.batch.time_ns) / 1e6)
                cpu1, wall1 = time.process_time(), time.monotonic()
            elif ev.kind == "gap":
                gaps += 1
        rb = client.ring_bytes
        counters = dict(client.counters)
    out = {"zero_copy": zero_copy, "steps": steps, "rows": rows, "gaps": gaps,
           "cpu_ms_per_step": round((cpu1 - cpu0) * 1e3 / max(1, steps), 3) if cpu0 is not None else None,
           "wall_s": round(wall1 - wall0, 2) if wall0 is not None else None,
           "copied_mib_per_step": round((rb["copied"] - copied0) / 2**20 / max(1, steps), 3),
           "viewed_mib_per_step": round((rb["viewed"] - viewed0) / 2**20 / max(1, steps), 3),
           "latency_ms_p50": round(float(np.percentile(lat, 50)), 2) if lat else None,
           "latency_ms_p99": round(float(np.percentile(lat, 99)), 2) if lat else None,
           "overruns": {k: v for k, v in counters.items() if k.startswith("shm_")}, **first}
    print(json.dumps(out), flush=True)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("role", nargs="?", default="run", choices=("run", "consume"))
    ap.add_argument("--address")
    ap.add_argument("--zero-copy", default="1")
    ap.add_argument("--idle", type=float, default=4.0, help="a consumer ends after this long without events")
    ap.add_argument("--skip", type=int, default=4, help="step batches a consumer reads before it measures")
    ap.add_argument("--n", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--layers", default="all", help='"all" or a comma list')
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--min-run-s", type=float, default=3.0)
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--pyspy", default="")
    a = ap.parse_args()
    if a.role == "consume":
        return consume(a)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p))
    run_dir = tempfile.mkdtemp(prefix="mia-zc-", dir="/tmp")
    procs: list[subprocess.Popen] = []
    results = []
    try:
        procs.append(start_broker(run_dir, env))
        os.environ["MIA_STREAM_BROKER"] = run_dir
        from vllm import LLM, SamplingParams

        from mia_stream.model import default_model_dir

        llm = LLM(str(default_model_dir()), dtype="float32", max_model_len=a.max_len, seed=0, enable_prefix_caching=False)
        layers = "all" if a.layers == "all" else [int(x) for x in a.layers.split(",")]
        prompt = list(range(100, 100 + a.prompt_len))
        for r in range(a.rounds):
            zc = "1" if r % 2 == 0 else "0"
            cons = subprocess.Popen([sys.executable, __file__, "consume", "--address", run_dir, "--zero-copy", zc,
                                     "--idle", str(a.idle)], stdout=subprocess.PIPE, text=True, env=env)
            procs.append(cons)
            assert "ready" in cons.stdout.readline()
            time.sleep(1.0)  # its subscription reaches the broker
            spy = None
            if a.pyspy:
                raw = Path(run_dir) / f"consumer-{r}.txt"
                spy = subprocess.Popen([a.pyspy, "record", "--format", "raw", "-o", str(raw), "--pid", str(cons.pid),
                                        "-d", str(int(a.min_run_s)), "-r", "200"], stdout=subprocess.DEVNULL,
                                       stderr=subprocess.DEVNULL)
            t0, k = time.monotonic(), 0
            while time.monotonic() - t0 < a.min_run_s:
                params = [SamplingParams(max_tokens=a.tokens, min_tokens=a.tokens, temperature=0, extra_args={
                    "mia_stream": {"capture": {"hidden_states": {"layers": layers, "positions": "all"}},
                                   "id": f"zc{r}-{k}-{i}"}}) for i in range(a.n)]
                llm.generate([{"prompt_token_ids": [p + i for p in prompt]} for i in range(a.n)], params,
                             use_tqdm=False)
                k += 1
            engine_s = time.monotonic() - t0
            line = cons.communicate(timeout=300)[0].strip().splitlines()[-1]
            row = json.loads(line)
            row.update({"round": r, "engine_s": round(engine_s, 2), "batches_of_requests": k})
            if spy is not None:
                spy.wait(60)
                samples = [ln.rpartition(" ") for ln in raw.read_text().splitlines()] if raw.exists() else []
                total = sum(int(c) for _, _, c in samples) or 1
                ring = sum(int(c) for s, _, c in samples if "mia_stream/bus/shm_ring.py" in s)
                row["ring_sample_share"] = round(ring / total, 3)
            results.append(row)
            print(json.dumps(row), flush=True)
        llm.llm_engine.engine_core.shutdown()
    finally:
        stop_processes(procs)
    summary = {}
    for mode in (True, False):
        rows = [r for r in results if r["zero_copy"] is mode and r["steps"]]
        if rows:
            summary["zero_copy" if mode else "copy"] = {
                key: {"median": statistics.median(r[key] for r in rows), "min": min(r[key] for r in rows),
                      "max": max(r[key] for r in rows)}
                for key in ("cpu_ms_per_step", "copied_mib_per_step", "viewed_mib_per_step", "latency_ms_p50",
                            "latency_ms_p99", "steps", "first_cpu_ms", "first_copied_mib")}
    print(json.dumps({"summary": summary}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
