"""Engine overhead of capture and steering in the topology users run, plain vLLM side by side.

    .venv/bin/python scripts/bench_engine.py --out /tmp/be                        # CPU, the embedded model
    python3 scripts/bench_engine.py --model /tmp/models/llama8b-shape --dummy --n 256 --tokens 128 \\
        --prompt-len 64 --out $OUT                                                # the H200 (8B shape)

Two engines run in one driver process, both with vLLM's default multiprocess engine core and vLLM's default
scheduler settings (no ``max_num_seqs`` override; on CUDA each engine gets ``--gpu-mem``): ``plain`` (the plugin
inactive: no ``MIA_STREAM_BROKER`` in its environment) and ``plugin``. The broker (``mia-stream broker``) and
the consumers, each subscribed to ``*``, run as their own processes. Each row runs ``--pairs`` pairs in A-B-A-B
order (plugin, plain, plugin, plain): a pair draws fresh random prompts and runs them on the plugin engine, then
the same prompts on the plain engine, so no run gets prefix-cache hits the other does not. A run lasts at least
``--min-run-s`` (3 s): it repeats batches of fresh prompts, as many as the plain engine needed for that long in
a calibration batch of the row's kind (issue 26: ratios from runs under ~3 s, or from a fixed engine order, moved
by 5%). The ``shared_prefix`` row gives all prompts one shared system prompt (``--shared-prefix`` tokens) that
both engines cache.

Per row: generated tokens/s of each engine (median over the pairs) and the median of the pairs' ratios with
their spread (min-max over the pairs), the decode step time of the plain engine, and
from the consumer: request-steps delivered, seqs lost (gaps + producer drops), and the latency from a frame's
``time_ns`` (its step's rows reached the host) to the consumer callback, p50 and p99, also in decode steps:
over all frames, over decode frames (a request's first frame carries its whole prompt), and in steady decode
(from each request's 8th frame on, past the round's prompt burst); the consumer's garbage-collector pauses in
the row; each engine's prefix-cache hits (``num_cached_tokens`` of its outputs). ``--profile`` rows are sampled
with py-spy in every process of the topology: the plugin's engine core, the frontend, the broker, the consumers.
``--consumer-api`` picks the consumers: ``events`` (``open_stream``: one event per request per step, what a
script does), ``batches`` (``open_batches``: one event per step, what a vectorized analyzer does), or both
(``events,batches``, the default: two consumer processes at once).
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
from _procs import ensure_plugin_entry_point, random_probe_file, start_broker  # noqa: E402  (scripts/_procs.py, beside this file)


# ---------------------------------------------------------------------------------------------- rows

def rows(L: int, H: int, rng: np.random.Generator) -> dict:
    """name -> (spec or None or "distinct", kind): kind "decode" (default prompts), "prefill" (long prompts),
    "shared" (a shared system prompt)."""
    vec = rng.standard_normal(H).astype(np.float32)
    vec /= np.linalg.norm(vec)
    inline, array = vec.tolist(), vec.copy()  # what a user passes: a float list, a numpy array
    # Shared vectors are registered once and named, as EasySteer's benchmark loads them from files; the
    # inline row shows what 32 float lists per request cost at admission (scripts/bench_spec_admission.py).
    from mia_stream.spec.vectors import register_vector

    register_vector("bench-engine", vec)
    vec = {"name": "bench-engine"}
    mid = L // 2
    hs1 = {"capture": {"hidden_states": {"layers": [mid], "positions": "all"}}}
    # one in-engine detector on every request (issue 25): a random probe of the model's shape at the middle layer,
    # every generated token scored, alerts flagged (threshold 0.5: about half the rows), no action
    probe = random_probe_file(Path(tempfile.mkdtemp(prefix="bench-probe-")) / "probe.json", H, L, mid)
    detect1 = {"detect": [{"probe": str(probe), "positions": "generated"}]}
    return {
        "idle": (None, "decode"),
        "hs_1layer_all": (hs1, "decode"),
        "hs_all_last_prompt": ({"capture": {"hidden_states": {"layers": "all", "positions": "last_prompt"}}}, "decode"),
        "hs_all_all": ({"capture": {"hidden_states": {"layers": "all", "positions": "all"}}}, "decode"),
        "hs_all_all_int8": ({"capture": {"hidden_states": {"layers": "all", "positions": "all"}, "quantize": "int8"}},
                            "decode"),  # issue 29: quantized on the device, per-row scales
        "hs_all_all_fp8": ({"capture": {"hidden_states": {"layers": "all", "positions": "all"},
                                        "quantize": "fp8_e4m3"}}, "decode"),
        "qk_all_int8": ({"capture": {"qk": {"layers": "all", "heads": "all", "positions": "all"}, "quantize": "int8"}},
                        "decode"),
        "qk_1layer": ({"capture": {"qk": {"layers": [mid], "heads": "all", "positions": "all"}}}, "decode"),
        "steer_1layer": ({"steer": [{"layer": mid, "op": "add", "vector": vec, "scale": 0.5}]}, "decode"),
        "steer_all_layers": ({"steer": [{"layer": i, "op": "add", "vector": vec, "scale": 0.1} for i in range(L)]},
                             "decode"),
        "steer_all_layers_inline": ({"steer": [{"layer": i, "op": "add", "vector": inline, "scale": 0.1}
                                               for i in range(L)]}, "decode"),
        "steer_all_layers_numpy": ({"steer": [{"layer": i, "op": "add", "vector": array, "scale": 0.1}
                                              for i in range(L)]}, "decode"),
        "steer_256_vectors": ("distinct", "decode"),
        "detect_1": (detect1, "decode"),
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
    import logging

    logging.basicConfig(level=logging.WARNING, format="[consumer] %(message)s")  # losses it is told of, to the log
    from mia_stream.consumers import open_stream

    import gc

    per: dict[str, dict] = {}
    out = open(out_path, "a", buffering=1)
    gc_log = open(_gc_path(out_path), "a", buffering=1)
    gc_start = [0]

    def on_gc(phase, info):  # every collection's pause, for the rows' latency tails
        if phase == "start":
            gc_start[0] = time.time_ns()
        else:
            gc_log.write(json.dumps({"t": gc_start[0], "ms": round((time.time_ns() - gc_start[0]) / 1e6, 3),
                                     "gen": info["generation"]}) + "\n")

    gc.callbacks.append(on_gc)

    def rec(rid):
        return per.setdefault(rid, {"frames": 0, "gap_seqs": 0, "gap_reasons": {}, "lat": []})

    def gap(rid, g):
        r = rec(rid)
        r["gap_seqs"] += g.count
        r["gap_reasons"][g.reason] = r["gap_reasons"].get(g.reason, 0) + g.count

    def done(rid, end):
        r = per.pop(rid, None) or rec(rid)
        lat = r["lat"]
        # producer drops are counted in the end's frames_dropped and announced by gaps naming their seqs
        out.write(json.dumps({"id": rid, "frames": r["frames"], "gap_seqs": r["gap_seqs"],
                              "gap_reasons": r["gap_reasons"],
                              "dropped": end.frames_dropped, "drops": end.drops, "reason": end.finish_reason,
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
                elif ev.kind == "batch" and ev.batch.KIND == "analysis" and ev.batch.analyzer.startswith("engine:") \
                        and ev.batch.step >= 0:  # step -1: a detector's final result at the request's end
                    # an in-engine detector's scores: from the step's scores on the host to here
                    ms = (now - ev.batch.source_time_ns) / 1e6
                    for rid in ev.batch.request_ids:
                        r = rec(rid)
                        r["frames"] += 1
                        r["lat"].append(ms)
                elif ev.kind == "gap":
                    gap(ev.gap.request_id, ev.gap)
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
                gap(ev.stream.request_id, ev.gap)
            elif ev.kind == "end":
                done(ev.stream.request_id, ev.end)


def _gc_path(ends_path: str) -> str:
    """The consumer's GC pause log beside its ends file."""
    return ends_path.removesuffix("-ends.jsonl") + "-gc.jsonl"


def _latency(prefix: str, ms: list, step_ms: float, with_max: bool = False) -> dict:
    """p50 and p99 of ``ms`` (also in decode steps), keys prefixed; {} when there are none."""
    if not ms:
        return {}
    p50, p99 = np.percentile(ms, [50, 99])
    out = {f"{prefix}_p50_ms": round(float(p50), 2), f"{prefix}_p99_ms": round(float(p99), 2),
           f"{prefix}_p99_steps": round(float(p99) / step_ms, 2)}
    if with_max:
        out[f"{prefix}_max_ms"] = round(float(max(ms)), 2)
    return out


def _read_gc(path: str, since_ns: int) -> list[dict]:
    try:
        with open(path) as f:
            return [d for d in map(json.loads, f) if d["t"] >= since_ns]
    except FileNotFoundError:
        return []


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

    _unset_broker()
    if plugin:
        os.environ["MIA_STREAM_BROKER"] = address
    kw = dict(model=a.model, dtype=a.dtype, max_model_len=a.max_len, enforce_eager=a.eager, seed=0,
              enable_prefix_caching=True)  # vLLM's default scheduler limits: no max_num_seqs override
    if a.gpu_mem:
        kw["gpu_memory_utilization"] = a.gpu_mem
    if a.dummy:
        kw["load_format"] = "dummy"
    try:
        return LLM(**kw)
    finally:
        _unset_broker()


def _unset_broker() -> None:
    if "MIA_STREAM_BROKER" in os.environ:  # the next engine's processes must not inherit it
        del os.environ["MIA_STREAM_BROKER"]


def _children() -> dict[int, bytes]:
    """This process's child processes: pid -> cmdline."""
    me, out = os.getpid(), {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            if ppid == me:
                with open(f"/proc/{d}/cmdline", "rb") as f:
                    out[int(d)] = f.read()
        except (OSError, ValueError, IndexError):
            continue
    return out


def _plugin_engine_core(before: dict[int, bytes]) -> int | None:
    """The pid of the plugin engine's core process (it runs the scheduler and, with TP 1, the worker; py-spy
    follows its subprocesses too): a child that appeared while the plugin engine started. Its title says
    ``EngineCore`` where setproctitle is installed (vLLM 0.32 here); the H100/H200 staging has no setproctitle,
    so there it is the new child that is not multiprocessing's resource tracker (the title test alone found
    nothing on 2026-12-05)."""
    new = {pid: cmd for pid, cmd in _children().items() if pid not in before}
    titled = [pid for pid, cmd in new.items() if b"EngineCore" in cmd]
    if titled:
        return titled[0]
    rest = sorted(pid for pid, cmd in new.items() if b"resource_tracker" not in cmd)
    return rest[-1] if rest else None


def start_pyspy(pyspy: str, pid: int, seconds: float, raw: str, children: bool = True) -> subprocess.Popen:
    """Sample ``pid`` (and its threads; ``children``: its child processes too) for ``seconds`` without stopping
    it; collapsed stacks into ``raw``."""
    return subprocess.Popen([pyspy, "record", "--pid", str(pid), "--duration", str(max(1, round(seconds))),
                             "--rate", "200", "--nonblocking", *(["--subprocesses"] if children else []),
                             "--format", "raw", "--output", raw],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def summarize_pyspy(raw: str, title: str, top: int = 25) -> str:
    """Where the sampled time went: the functions with most samples on the stack (inclusive) and on top of it
    (self), as shares of all samples."""
    incl: dict[str, int] = {}
    self_: dict[str, int] = {}
    total = 0
    try:
        lines = open(raw).read().splitlines()
    except OSError as e:
        return f"== {title}: no samples ({e})\n"
    for line in lines:
        stack, _, n = line.rpartition(" ")
        if not n.isdigit():
            continue
        n = int(n)
        frames = [f.split(" (")[0] + (" (" + f.split(" (")[1].split(":")[0].rsplit("/", 1)[-1] + ")"
                                      if " (" in f else "") for f in stack.split(";")]
        total += n
        for f in set(frames):
            incl[f] = incl.get(f, 0) + n
        if frames:
            self_[frames[-1]] = self_.get(frames[-1], 0) + n
    out = [f"== {title}: {total} samples"]
    for name, d in (("inclusive", incl), ("self", self_)):
        out.append(f"  -- {name}")
        for f, n in sorted(d.items(), key=lambda kv: -kv[1])[:top]:
            out.append(f"  {100 * n / max(total, 1):5.1f}%  {f}")
    return "\n".join(out) + "\n"


def run_batch(llm, prompts: list, params) -> tuple[int, float, int]:
    """Generated tokens, seconds, prompt tokens served from the prefix cache."""
    return run_batches(llm, [prompts], [params])


def run_batches(llm, prompt_sets: list, param_sets: list) -> tuple[int, float, int]:
    """One run: the batches back to back. Generated tokens, seconds (the batches' own), cached prompt tokens."""
    from vllm import SamplingParams

    gen = cached = 0
    dt = 0.0
    for prompts, params in zip(prompt_sets, param_sets):
        t0 = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        dt += time.perf_counter() - t0
        gen += sum(len(o.outputs[0].token_ids) for o in outs)
        cached += sum(o.num_cached_tokens or 0 for o in outs)
    # the worker learns of finished requests at the next step: one more tiny request ends the last streams
    llm.generate([{"prompt_token_ids": prompt_sets[0][0][:4]}], SamplingParams(max_tokens=1), use_tqdm=False)
    return gen, dt, cached


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
    ap.add_argument("--pairs", type=int, default=2, help="plugin-plain pairs per row, in A-B-A-B order")
    ap.add_argument("--min-run-s", type=float, default=3.0,
                    help="each run repeats batches of fresh prompts to last at least this long")
    ap.add_argument("--eager", action="store_true")
    ap.add_argument("--gpu-mem", type=float, default=None, help="gpu_memory_utilization of EACH engine")
    ap.add_argument("--consumer-api", default="events,batches", help="comma list of: events, batches")
    ap.add_argument("--pyspy", default="", help="a py-spy binary: profile the plugin engine core in --profile rows")
    ap.add_argument("--profile", default="", help="comma list of rows to profile (last round; the row is then marked)")
    ap.add_argument("--pyspy-s", type=float, default=3.0, help="seconds each profile samples")
    ap.add_argument("--end-wait", type=float, default=30.0, help="seconds to wait for a row's streams to end")
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
    if not cuda:  # host memory here is tight; on CUDA the default aperture holds every row of a step: a
        # 4,096-row cap there dropped ~130 prompt frames a round from prompt steps of up to 16,384 tokens
        os.environ.setdefault("MIA_STREAM_APERTURE_ROWS", str(max(4096, need)))
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    ensure_plugin_entry_point(Path(tempfile.mkdtemp(prefix="mia-be-ep-")))
    cfg = json.load(open(Path(a.model) / "config.json"))
    L, H, vocab = cfg["num_hidden_layers"], cfg["hidden_size"], cfg["vocab_size"]
    rng = np.random.default_rng(int(time.time()))
    os.environ.setdefault("MIA_STREAM_VECTORS", tempfile.mkdtemp(prefix="mia-be-vec-"))
    table = rows(L, H, np.random.default_rng(0))
    names = list(table) if a.rows == "all" else a.rows.split(",")
    if any("quantize" in table[n][0].get("capture", {}) for n in names if n in table):
        # the workspace quantized rows are written into, reserved inside vLLM's budget (off by default)
        os.environ.setdefault("MIA_STREAM_QUANTIZE", "1")
    run_dir = tempfile.mkdtemp(prefix="mia-be-", dir="/tmp")
    env = dict(os.environ, PYTHONPATH=f"{REPO}:{os.environ.get('PYTHONPATH', '')}")
    broker = start_broker(run_dir, env)
    apis = a.consumer_api.split(",")
    ends_paths = {api: str(out / f"consumer-{api}-ends.jsonl") for api in apis}
    consumers: dict[str, subprocess.Popen] = {}
    results: dict = {"args": vars(a), "cuda": cuda, "rows": {}}
    try:
        for api in apis:
            consumers[api] = subprocess.Popen([sys.executable, __file__, "--consumer", run_dir, ends_paths[api], api],
                                              stdout=subprocess.PIPE, text=True, env=env)
            if "ready" not in consumers[api].stdout.readline():
                raise RuntimeError(f"{api} consumer did not start")
        t0 = time.perf_counter()
        before = _children()
        plugin = make_llm(a, True, run_dir)
        core_pid = _plugin_engine_core(before) if a.pyspy else None
        results["profiled_pid"] = core_pid
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
        reps_of: dict[str, int] = {}

        def reps_for(kind: str) -> int:
            """Batches per run: enough for the plain engine to run ``--min-run-s`` (one timed batch of the kind)."""
            if kind not in reps_of:
                _, dt, _ = run_batch(plain, prompts_for(kind), SamplingParams(**base))
                reps_of[kind] = max(1, int(np.ceil(a.min_run_s / max(dt, 1e-3))))
            return reps_of[kind]

        def params_for(spec, tag: str, n: int):
            if spec is None:
                return SamplingParams(**base)
            if spec == "distinct":
                out = []
                for i in range(n):
                    v = rng.standard_normal(H).astype(np.float32)
                    out.append(SamplingParams(**base, extra_args={"mia_stream": {
                        "steer": [{"layer": L // 2, "op": "add", "vector": (v / np.linalg.norm(v)).tolist(),
                                   "scale": 0.5}], "id": f"{tag}-{i}"}}))
                return out
            return [SamplingParams(**base, extra_args={"mia_stream": dict(spec, id=f"{tag}-{i}")}) for i in range(n)]

        for rnd in range(a.rounds):
            for name in names:
                spec, kind = table[name]
                reps = reps_for(kind)
                if kind == "shared":  # both engines cache the shared prefix first (a real server has it warm)
                    for llm in (plugin, plain):
                        run_batch(llm, prompts_for(kind)[:1], SamplingParams(**base))
                ids: set = set()
                pairs = []
                row_t0_ns = time.time_ns()
                for pair in range(a.pairs):
                    prompt_sets = [prompts_for(kind) for _ in range(reps)]
                    tags = [f"r{rnd}-{name}-p{pair}-b{b}" for b in range(reps)]
                    param_sets = [params_for(spec, tag, len(ps)) for tag, ps in zip(tags, prompt_sets)]
                    if spec is not None:
                        ids |= {f"{tag}-{i}" for tag, ps in zip(tags, prompt_sets) for i in range(len(ps))}
                    runs = {}
                    for which, llm in (("plugin", plugin), ("plain", plain)):  # A-B, pair after pair: A-B-A-B
                        spies = []
                        last = rnd == a.rounds - 1 and pair == a.pairs - 1
                        if which == "plugin" and core_pid and name in a.profile.split(",") and last:
                            # the engine core, this process (vLLM's frontend, which admits the requests), the
                            # broker and each consumer: every process between a step and a consumer's callback
                            procs = [("plugin engine core", core_pid, True),
                                     ("frontend (driver process)", os.getpid(), False), ("broker", broker.pid, False)]
                            procs += [(f"{api} consumer", c.pid, False) for api, c in consumers.items()]
                            for title, pid, children in procs:
                                raw = str(out / f"pyspy-{name}-{pid}.raw")
                                spies.append((title, raw, start_pyspy(a.pyspy, pid, a.pyspy_s, raw, children)))
                            time.sleep(0.3)  # attached before the batch starts
                        plain_sets = [SamplingParams(**base)] * reps
                        gen, dt, cached = run_batches(llm, prompt_sets, param_sets if which == "plugin" else plain_sets)
                        runs[which] = {"tokens": gen, "s": round(dt, 3), "tok_s": round(gen / dt, 1),
                                       "cached_prompt_tokens": cached,
                                       "prompt_tokens": sum(len(p) for ps in prompt_sets for p in ps)}
                        for title, raw, spy in spies:
                            spy.wait(a.pyspy_s + 30)
                            with open(out / "pyspy.txt", "a") as f:
                                f.write(summarize_pyspy(raw, f"{name}: {title}, {a.pyspy_s:g} s from the "
                                                             f"batch's start ({dt:.2f} s run)"))
                            os.replace(raw, raw.removesuffix(".raw") + ".stacks")  # for a flame graph
                            runs["profiled"] = True
                    runs["ratio"] = round(runs["plugin"]["tok_s"] / runs["plain"]["tok_s"], 3)
                    pairs.append(runs)
                ratios = [p["ratio"] for p in pairs]
                row = {"pairs": pairs, "batches_per_run": reps, "ratio": round(float(np.median(ratios)), 3),
                       "ratio_min": min(ratios), "ratio_max": max(ratios),
                       "shortest_run_s": min(min(p["plugin"]["s"], p["plain"]["s"]) for p in pairs)}
                for which in ("plugin", "plain"):
                    row[which] = {"tok_s": round(float(np.median([p[which]["tok_s"] for p in pairs])), 1),
                                  "tokens": sum(p[which]["tokens"] for p in pairs),
                                  "s": round(sum(p[which]["s"] for p in pairs), 3),
                                  "cached_prompt_tokens": sum(p[which]["cached_prompt_tokens"] for p in pairs)}
                if any(p.get("profiled") for p in pairs):
                    row["profiled"] = True
                prompts = prompt_sets[0]
                steps = row["plain"]["tokens"] / max(len(prompts) * reps * a.pairs, 1)
                step_ms = 1e3 * row["plain"]["s"] / (reps * a.pairs) / max(steps, 1)
                row.update(plain_step_ms=round(step_ms, 2), streams=len(ids))
                for api, consumer in consumers.items():
                    if consumer.poll() is not None:
                        raise RuntimeError(f"the {api} consumer exited ({consumer.returncode}); see its stderr above")
                    deadline = time.monotonic() + a.end_wait
                    ends = _read_ends(ends_paths[api], ids)
                    while len(ends) < len(ids) and time.monotonic() < deadline:
                        time.sleep(0.2)
                        ends = _read_ends(ends_paths[api], ids)
                    c = {"ended": len(ends), "frames": sum(e["frames"] for e in ends),
                         "gap_seqs": sum(e["gap_seqs"] for e in ends), "dropped": sum(e["dropped"] for e in ends)}
                    # the producer's drops (its ends' counts), and every loss the consumer was told of, wherever
                    # it happened (the gaps it saw)
                    for key, into in (("drops", "drop_reasons"), ("gap_reasons", "gap_reasons")):
                        reasons: dict[str, int] = {}
                        for e in ends:
                            for why, k in (e.get(key) or {}).items():
                                reasons[why] = reasons.get(why, 0) + k
                        if reasons:
                            c[into] = reasons
                    # all frames; decode frames (a request's first frame carries its whole prompt, with the
                    # batch's other prompts: the burst of the round's first steps); steady decode (past the burst)
                    c.update(_latency("lat", [x for e in ends for x in e["lat"]], step_ms))
                    c.update(_latency("decode", [x for e in ends for x in e["lat"][1:]], step_ms))
                    c.update(_latency("steady", [x for e in ends for x in e["lat"][8:]], step_ms, with_max=True))
                    pauses = _read_gc(_gc_path(ends_paths[api]), row_t0_ns)
                    c.update(gc_collections=len(pauses), gc_full=sum(p["gen"] == 2 for p in pauses),
                             gc_max_ms=max((p["ms"] for p in pauses), default=0.0))
                    row[api] = c
                results["rows"].setdefault(name, []).append(row)
                print(f"[bench_engine] round {rnd} {name}: {json.dumps(row)}", flush=True)
                (out / "results.json").write_text(json.dumps(results, indent=1))
    finally:
        for p in (*consumers.values(), broker):
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
    print_table(results)
    return 0


def print_table(results: dict) -> None:
    apis = results["args"]["consumer_api"].split(",")
    head = (f"{'row':28s} {'ratio':>6s} {'min-max':>11s} {'plugin tok/s':>12s} {'plain tok/s':>11s} {'run s':>5s} "
            f"{'step ms':>8s} {'cached plugin/plain':>19s}")
    for api in apis:
        head += (f" | {api + ': frames':>15s} {'gaps':>5s} {'drop':>5s} {'p50 ms':>7s} {'p99 ms':>7s}"
                 f" {'dec p99':>7s} {'dec st':>6s} {'stdy p99':>8s} {'stdy st':>7s} {'gc max':>6s}")
    print("\n" + head)
    print("(ratio: median of the pairs' plugin/plain tok/s; min-max: over the pairs; tok/s: medians; run s: the "
          "shortest run)")
    nan = float("nan")
    for name, runs in results["rows"].items():
        for r in runs:
            cached = f"{r['plugin'].get('cached_prompt_tokens', 0)}/{r['plain'].get('cached_prompt_tokens', 0)}"
            spread = f"{r.get('ratio_min', r['ratio']):.3f}-{r.get('ratio_max', r['ratio']):.3f}"
            line = (f"{name:28s} {r['ratio']:6.3f} {spread:>11s} {r['plugin']['tok_s']:12.1f} "
                    f"{r['plain']['tok_s']:11.1f} {r.get('shortest_run_s', 0.0):5.1f} {r['plain_step_ms']:8.2f} "
                    f"{cached:>19s}")
            for api in apis:
                c = r.get(api, {})
                line += (f" | {c.get('frames', 0):15d} {c.get('gap_seqs', 0):5d} {c.get('dropped', 0):5d} "
                         f"{c.get('lat_p50_ms', nan):7.2f} {c.get('lat_p99_ms', nan):7.2f} "
                         f"{c.get('decode_p99_ms', nan):7.2f} {c.get('decode_p99_steps', nan):6.2f} "
                         f"{c.get('steady_p99_ms', nan):8.2f} {c.get('steady_p99_steps', nan):7.2f} "
                         f"{c.get('gc_max_ms', nan):6.1f}")
            print(line)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--consumer":
        consumer_main(*sys.argv[2:5])
        sys.exit(0)
    mp.set_start_method("spawn", force=True)
    sys.exit(main())
