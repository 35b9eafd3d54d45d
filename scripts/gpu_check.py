"""End-to-end GPU check of the producer on vLLM 0.26 (V2 runner): correctness, then overhead, in one session.

    python3 scripts/gpu_check.py --models /tmp/models --out $OUT [--phases correctness,bench] [--tp 1]
    python3 scripts/gpu_check.py --phases bench --n 32 --prompt-len 2048 --tokens 128   # prefill-heavy rows

``--models`` holds ``smollm2-random`` (random bf16 safetensors) and ``llama8b-shape`` (config only, run with
``load_format=dummy``), as made by ``make-random-models.py``. Every engine runs in its own subprocess
(``--engine MODE``) with ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, so the scheduler, the worker and the plugin
share that process; the plugin is loaded explicitly (``plugin.register()``) where it must be active. Each
plugin engine gets its own bus process: an in-thread broker plus one consumer that receives every message.
Prints a table last; writes ``results.json`` and logs under ``--out``. ``--tp 2`` runs every engine with
tensor_parallel_size=2 (needs 2 GPUs; frames then carry TP shards and the check merges nothing: it checks
rank 0's hidden states and each rank's Q/K shard count).
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
import traceback
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
WORK = ["/tmp/gpu-check-work"]
sys.path.insert(0, str(REPO))
from _procs import ensure_plugin_entry_point  # noqa: E402  (scripts/_procs.py, beside this file)

# ---------------------------------------------------------------------------------------------- bus process


def _bus_main(address: str, conn, ready) -> None:
    """Broker (thread) + one consumer receiving everything; answers the engine's requests over ``conn``."""
    from mia_stream.broker import run_broker_in_thread
    from mia_stream.consumers import BrokerClient

    with run_broker_in_thread(address=address) as broker:
        # the SDK's default window (64 MiB): frames in flight reference the producer's 256 MiB ring, and a
        # window larger than the ring's slack (1 GiB was used before rings) has the consumer read frames the
        # ring has already overwritten (measured on the H200: 66 of 49000 frames delivered at hs_all_all)
        client = BrokerClient(address, consumer_id="gpu-check")
        client.subscribe(("*",))
        ready.set()
        keep = False
        streams: dict[str, dict] = {}
        lat: list[float] = []
        nbytes = 0

        def stream(sid):
            return streams.setdefault(sid, {"frames": [], "tokens": [], "gaps": 0, "gap_reasons": {}, "end": None,
                                            "start": None, "seqs": []})

        while True:
            if conn.poll():
                cmd = conn.recv()
                if cmd[0] == "stop":
                    break
                if cmd[0] == "keep":
                    keep = cmd[1]
                    conn.send(True)
                elif cmd[0] == "collect":
                    _, n_ends, timeout = cmd
                    deadline = time.monotonic() + timeout
                    while sum(1 for s in streams.values() if s["end"] is not None) < n_ends \
                            and time.monotonic() < deadline:
                        got = client.recv(timeout=0.2)
                        if got is not None:
                            nbytes += _bus_take(got[1], streams, stream, lat, keep)
                    try:
                        bstats = broker.stats()
                    except Exception as e:  # noqa: BLE001
                        bstats = {"error": repr(e)}
                    conn.send({"streams": streams, "latency_ms": lat, "bytes": nbytes,
                               "broker": _jsonable(bstats), "client": dict(client.counters)})
                    streams, lat, nbytes = {}, [], 0
                continue
            got = client.recv(timeout=0.05)
            if got is not None:
                nbytes += _bus_take(got[1], streams, stream, lat, keep)
        client.close()


def _bus_take(msg, streams, stream, lat, keep) -> int:
    from mia_stream.schemas import GapNotice, StepBatch, StreamEnd, StreamStart, TensorFrame, TokenBatch, TokenFrame

    if isinstance(msg, (StepBatch, TokenBatch)):  # a step's frames of every request (schema 2.0)
        return sum(_bus_take(m, streams, stream, lat, keep) for m in msg.frames())
    now = time.time_ns()
    if isinstance(msg, TensorFrame):
        s = stream(msg.request_id)
        s["seqs"].append(msg.seq)
        lat.append((now - msg.time_ns) / 1e6)
        n = sum(t.nbytes for t in msg.tensors)
        entry = {"step": msg.step, "positions": list(msg.positions), "token_ids": list(msg.token_ids),
                 "names": [t.name for t in msg.tensors]}
        if keep:
            entry["data"] = {t.name: (np.array(t.numpy(), dtype=np.float32), list(t.layers)) for t in msg.tensors}
        s["frames"].append(entry)
        return n
    if isinstance(msg, TokenFrame):
        s = stream(msg.request_id)
        s["seqs"].append(msg.seq)
        s["tokens"].extend(int(t) for t in msg.token_ids)
    elif isinstance(msg, StreamStart):
        s = stream(msg.request_id)
        s["seqs"].append(msg.seq)
        s["start"] = {"prompt_token_ids": list(msg.prompt_token_ids), "engine_id": msg.engine_request_id}
    elif isinstance(msg, StreamEnd):
        s = stream(msg.request_id)
        s["seqs"].append(msg.seq)
        s["end"] = {"reason": msg.finish_reason, "frames_dropped": msg.frames_dropped, "drops": dict(msg.drops),
                    "generated": msg.num_generated_tokens, "uncaptured": msg.uncaptured_positions}
    elif isinstance(msg, GapNotice):
        s = stream(msg.request_id)  # lost frames (seqs), not notices; by origin and reason
        s["gaps"] += msg.count
        key = f"{msg.origin}:{msg.reason}"
        s["gap_reasons"][key] = s["gap_reasons"].get(key, 0) + msg.count
    return 0


def _jsonable(x):
    try:
        json.dumps(x)
        return x
    except TypeError:
        if isinstance(x, dict):
            return {str(k): _jsonable(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [_jsonable(v) for v in x]
        return repr(x)


class Bus:
    def __init__(self):
        self.dir = tempfile.mkdtemp(prefix="mia-bus-")
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        ready = ctx.Event()
        self.proc = ctx.Process(target=_bus_main, args=(self.dir, child, ready), daemon=True)
        self.proc.start()
        if not ready.wait(60):
            raise RuntimeError("bus process did not start")
        os.environ["MIA_STREAM_BROKER"] = self.dir

    def keep(self, flag: bool) -> None:
        self.conn.send(("keep", flag))
        self.conn.recv()

    def collect(self, n_ends: int, timeout: float = 30.0) -> dict:
        self.conn.send(("collect", n_ends, timeout))
        return self.conn.recv()

    def close(self) -> None:
        try:
            self.conn.send(("stop",))
        except Exception:  # noqa: BLE001
            pass
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()


# ---------------------------------------------------------------------------------------------- engine side


def _worker_probe(self):
    """Runs in the worker (collective_rpc): runtime stats, kernel backends, cudagraph mode, sm arch."""
    import torch

    from mia_stream.kernels import _dispatch

    w = getattr(self, "worker", self)
    mr = w.model_runner
    from mia_stream.producer._vllm_adapter import REGISTRY

    rt = REGISTRY.runtime_of(mr)
    cc = w.vllm_config.compilation_config
    arch = []
    try:
        from mia_stream.kernels import capture, steer

        for k in (capture._scatter_rows_kernel, getattr(steer, "_steer_rows_kernel", None)):
            for cache in (getattr(k, "device_caches", {}) or {}).values():
                for ck in cache[0].values():
                    arch.append(str(getattr(getattr(ck, "metadata", None), "target", "?")))
    except Exception as e:  # noqa: BLE001
        arch.append(repr(e)[:120])
    return {"runner": type(mr).__module__ + "." + type(mr).__name__,
            "cudagraph_mode": str(cc.cudagraph_mode), "compile_mode": str(cc.mode),
            "capability": list(torch.cuda.get_device_capability()),
            "backend_calls": {f"{k[0]}:{k[1]}": v for k, v in _dispatch.backend_calls().items()},
            "triton_targets": sorted(set(arch))[:6],
            "runtime_stats": dict(rt.stats) if rt is not None else None,
            "drain": ("sidecar" if rt._sidecar is not None else "thread") if rt is not None else None,
            "host_ring_pinned": getattr(rt, "ring_pinned", None)}


def _split_cores(bus) -> None:
    """Engine process on the first half of the cores; the bus process and the drain sidecar(s) on the other
    half (tests whether the streaming processes slow the engine thread by sharing its cores)."""
    from mia_stream.producer import _vllm_adapter

    cpus = sorted(os.sched_getaffinity(0))
    half = len(cpus) // 2
    engine, bus_cpus = set(cpus[:half]), set(cpus[half:])
    for tid in os.listdir("/proc/self/task"):  # every thread of this process, not just the calling one
        os.sched_setaffinity(int(tid), engine)
    pids = [bus.proc.pid] + [rt._sidecar.proc.pid for rt in _vllm_adapter.REGISTRY.runtimes if rt._sidecar]
    for pid in pids:
        os.sched_setaffinity(pid, bus_cpus)
    print(f"[bench] split cores: engine {sorted(engine)}, bus + sidecar pids {pids} on {sorted(bus_cpus)}",
          flush=True)


def _start_pyspy(args, tag: str):
    """Sample this engine process's Python stacks (every thread) while one config generates: raw collapsed
    stacks in ``--out/pyspy-TAG.txt`` (``--pyspy`` names the py-spy binary; it travels with the checkout)."""
    if not args.pyspy or not Path(args.pyspy).exists():
        return None
    import ctypes

    # Yama ptrace_scope 1 lets a process trace only its descendants: allow any tracer for this process
    ctypes.CDLL(None).prctl(0x59616D61, ctypes.c_ulong(-1), 0, 0, 0)  # PR_SET_PTRACER, PR_SET_PTRACER_ANY
    out = Path(args.out) / f"pyspy-{tag}.txt"
    spy = subprocess.Popen([args.pyspy, "record", "--pid", str(os.getpid()), "--duration", str(max(1, round(args.pyspy_s))),
                            "--rate", "250", "--format", "raw", "--nonblocking", "--threads", "--idle", "-o", str(out)],
                           stdout=subprocess.DEVNULL, stderr=open(Path(args.out) / f"pyspy-{tag}.err", "w"))
    time.sleep(1.0)  # attach before the generation starts
    return spy


def _make_llm(model: str, *, eager: bool, dummy: bool, tp: int, gpu_mem: float, max_len: int, batched: int):
    from vllm import LLM

    kw = dict(model=model, tokenizer=model, dtype="bfloat16", gpu_memory_utilization=gpu_mem,
              max_model_len=max_len, enforce_eager=eager, seed=0, tensor_parallel_size=tp,
              max_num_batched_tokens=batched, max_num_seqs=256)
    if dummy:
        kw["load_format"] = "dummy"
    return LLM(**kw)


def _prompts(rng, n, lo, hi, vocab=40000):
    return [rng.integers(100, vocab, size=int(rng.integers(lo, hi + 1))).tolist() for _ in range(n)]


def _gen(llm, prompts, params):
    from vllm import SamplingParams

    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    # The worker learns of finished requests only at the next scheduled step (finished_req_ids ride on the
    # next SchedulerOutput), so the last streams' StreamEnd waits for one more step: run a 1-token request.
    llm.generate([{"prompt_token_ids": prompts[0][:4]}], SamplingParams(max_tokens=1), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


_REQ_COUNTER = [0]


def _gen_timed(llm, prompts, params) -> tuple[list, float, float]:
    """Like ``_gen``, but admission (adding every request: spec parsing, params copies) and the engine run
    (steps until the batch is done) are timed apart: the run is what per-step overhead targets are about."""
    from vllm import SamplingParams

    eng = llm.llm_engine
    ids = []
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        _REQ_COUNTER[0] += 1
        rid = f"bench-{_REQ_COUNTER[0]}"
        eng.add_request(rid, {"prompt_token_ids": p}, params[i] if isinstance(params, list) else params)
        ids.append(rid)
    t1 = time.perf_counter()
    done = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out
    t2 = time.perf_counter()
    llm.generate([{"prompt_token_ids": prompts[0][:4]}], SamplingParams(max_tokens=1), use_tqdm=False)  # see _gen
    return [list(done[r].outputs[0].token_ids) for r in ids], t1 - t0, t2 - t1


_HOST_MS: dict = {}


def _time_runtime_methods() -> None:
    """Accumulate the engine-thread time of the runtime's per-step methods (bench only: wraps the class)."""
    from mia_stream.producer._runtime import ProducerRuntime

    for name in ("begin_step", "end_step", "on_sampled", "add_request", "finish_request"):
        orig = getattr(ProducerRuntime, name)

        def timed(self, *a, _orig=orig, _name=name, **k):
            t = time.perf_counter()
            try:
                return _orig(self, *a, **k)
            finally:
                acc = _HOST_MS.setdefault(_name, [0.0, 0])
                acc[0] += (time.perf_counter() - t) * 1e3
                acc[1] += 1
        setattr(ProducerRuntime, name, timed)


def _stack_hs(stream: dict, name: str = "hs"):
    """A stream's frames -> (positions [T], array [L, T, ...], layers)."""
    pos, parts, layers = [], [], None
    for f in stream["frames"]:
        if name in f.get("data", {}):
            arr, layers = f["data"][name]
            pos.extend(f["positions"])
            parts.append(arr)
    if not parts:
        return np.zeros(0, int), None, layers
    return np.asarray(pos), np.concatenate(parts, axis=1), layers


def engine_correctness(args) -> dict:
    """Small model: greedy tokens capture on/off, captured hs/qk, steering, 256 mixed requests."""
    from mia_stream.producer import plugin
    from vllm import SamplingParams

    bus = Bus()
    if args.tp > 1:
        ensure_plugin_entry_point(Path(args.work))
    plugin.register()
    res: dict = {"mode": args.engine}
    model = str(Path(args.models) / "smollm2-random")
    llm = _make_llm(model, eager=args.engine == "small_eager", dummy=False, tp=args.tp, gpu_mem=0.35,
                    max_len=1024, batched=4096)
    cfg = json.load(open(Path(model) / "config.json"))
    L, H = cfg["num_hidden_layers"], cfg["hidden_size"]
    rng = np.random.default_rng(1)
    prompts = _prompts(rng, 8, 12, 40, vocab=cfg["vocab_size"])
    greedy = dict(max_tokens=16, temperature=0.0, ignore_eos=True)
    # 1. no spec
    bus.keep(True)
    t_off = _gen(llm, prompts, SamplingParams(**greedy))
    bus.collect(0, timeout=1)
    # 2. capture hs (all layers, all positions) + qk (two layers)
    spec = {"capture": {"hidden_states": {"layers": "all", "positions": "all"},
                        "qk": {"layers": [0, L // 2], "heads": "all", "positions": "all"}}}
    ps = [SamplingParams(**greedy, extra_args={"mia_stream": dict(spec, id=f"cap{i}")}) for i in range(8)]
    t_on = _gen(llm, prompts, ps)
    cap = bus.collect(8)
    res["tokens_capture_on_eq_off"] = t_on == t_off
    save = {"tokens_off": np.array(t_off), "tokens_on": np.array(t_on)}
    for i in range(8):
        s = cap["streams"].get(f"cap{i}", {"frames": []})
        pos, hs, _ = _stack_hs(s)
        save[f"cap{i}_pos"], save[f"cap{i}_hs"] = pos, hs if hs is not None else np.zeros(0)
        for nm in ("q", "k"):
            p2, a2, _ = _stack_hs(s, nm)
            save[f"cap{i}_{nm}"] = a2 if a2 is not None else np.zeros(0)
        save[f"cap{i}_prompt"] = np.array(prompts[i])
        res.setdefault("cap_frames", []).append(len(s["frames"]))
        res.setdefault("cap_end", []).append(s.get("end"))
    # 3. steering: requests 0-3 steered (add / cap / ablate), 4-7 capture only; all capture hs all layers
    v = rng.standard_normal(H).astype(np.float32)
    v2 = rng.standard_normal(H).astype(np.float32)
    steer = [{"layer": L // 3, "op": "add", "vector": (v / np.linalg.norm(v)).tolist(), "scale": 8.0},
             {"layer": L // 2, "op": "cap", "vector": v2.tolist(), "threshold": 0.0},
             {"layer": 2 * L // 3, "op": "ablate", "vector": v.tolist(), "positions": "generated"}]
    hs_only = {"capture": {"hidden_states": {"layers": "all", "positions": "all"}}}
    ps = []
    for i in range(8):
        sp = dict(hs_only, id=f"st{i}")
        if i < 4:
            sp["steer"] = steer
        ps.append(SamplingParams(**greedy, extra_args={"mia_stream": sp}))
    t_st = _gen(llm, prompts, ps)
    st = bus.collect(8)
    save["tokens_steer"] = np.array(t_st)
    for i in range(8):
        pos, hs, _ = _stack_hs(st["streams"].get(f"st{i}", {"frames": []}))
        save[f"st{i}_pos"], save[f"st{i}_hs"] = pos, hs if hs is not None else np.zeros(0)
    # 4. 256 mixed requests: varied lengths, specs, max_tokens
    bus.keep(False)
    mixed = _prompts(rng, 256, 4, 300, vocab=cfg["vocab_size"])
    specs = [None,
             {"capture": {"hidden_states": {"layers": [1, L - 1], "positions": "all"}}},
             {"capture": {"hidden_states": {"layers": "all", "positions": "last_prompt"}}},
             {"capture": {"hidden_states": {"layers": [3], "positions": "generated"}}},
             {"capture": {"qk": {"layers": [2], "heads": [0, 1], "positions": "prompt"}}},
             {"capture": {"hidden_states": {"layers": [5], "positions": "all"}}, "steer": steer[:1]}]
    ps, want = [], {}
    for i in range(256):
        sp = specs[i % len(specs)]
        mt = int(rng.integers(4, 40))
        extra = None if sp is None else {"mia_stream": dict(sp, id=f"mx{i}")}
        if sp is not None:
            want[f"mx{i}"] = (i, sp, mt)
        ps.append(SamplingParams(max_tokens=mt, temperature=0.8, seed=i, ignore_eos=True, extra_args=extra))
    t0 = time.time()
    t_mx = _gen(llm, mixed, ps)
    mx = bus.collect(len(want), timeout=60)
    res["mixed_s"] = round(time.time() - t0, 2)
    bad = []
    for sid, (i, sp, mt) in want.items():
        s = mx["streams"].get(sid)
        if s is None or s["end"] is None:
            bad.append(f"{sid}: no end")
            continue
        if s["seqs"] != sorted(s["seqs"]) or len(set(s["seqs"])) != len(s["seqs"]):
            bad.append(f"{sid}: seq out of order")
        allpos = [p for f in s["frames"] for p in f["positions"] if "hs" in f["names"] or "q" in f["names"]]
        if allpos != sorted(allpos):
            bad.append(f"{sid}: positions out of order")
        full = mixed[i] + t_mx[i]
        for f in s["frames"]:
            for p, t in zip(f["positions"], f["token_ids"]):
                if p >= len(full) or full[p] != t:
                    bad.append(f"{sid}: token at {p} is {t}, request has {full[p] if p < len(full) else None}")
                    break
        if s["end"]["frames_dropped"] or s["gaps"]:
            bad.append(f"{sid}: dropped {s['end']['frames_dropped']} gaps {s['gaps']}")
        hs_spec = sp.get("capture", {}).get("hidden_states")
        if hs_spec and hs_spec["positions"] == "all":
            got = sorted(set(allpos))
            need = list(range(len(mixed[i]) + mt - 1))
            if got[: len(need)] != need:
                bad.append(f"{sid}: positions {got[:3]}..{got[-3:]} (n={len(got)}) != 0..{len(need) - 1}")
        if s["tokens"] and s["tokens"][: len(t_mx[i])] != t_mx[i]:
            bad.append(f"{sid}: token frames differ from the output")
    res["mixed_streams"] = len(want)
    res["mixed_bad"] = bad[:20]
    res["mixed_bad_count"] = len(bad)
    res["worker"] = llm.collective_rpc(_worker_probe)[0]
    np.savez_compressed(Path(args.work) / f"{args.engine}.npz", **save)
    bus.close()
    return res


def engine_bench(args) -> dict:
    """8B shape, dummy weights: 256 prompts x N generated tokens per configuration, one engine."""
    import torch
    from vllm import SamplingParams

    plugin_on = args.engine == "bench_plugin"
    bus = None
    if plugin_on:
        os.environ.setdefault("MIA_STREAM_APERTURE_ROWS", str(args.batched))
        os.environ.setdefault("MIA_STREAM_HOST_RING_MB", "6144")
        bus = Bus()
        from mia_stream.producer import plugin

        if args.tp > 1:
            ensure_plugin_entry_point(Path(args.work))
        plugin.register()
        _time_runtime_methods()
    model = str(Path(args.models) / "llama8b-shape")
    # room for the prefill-heavy case too (--n 32 --prompt-len 2048): prompt + generated tokens must fit
    max_len = max(2048, args.prompt_len + args.tokens + 16)
    llm = _make_llm(model, eager=False, dummy=True, tp=args.tp, gpu_mem=0.85, max_len=max_len,
                    batched=max(args.batched, max_len))
    if args.split_cores and bus is not None:
        _split_cores(bus)
    cfg = json.load(open(Path(model) / "config.json"))
    L, H = cfg["num_hidden_layers"], cfg["hidden_size"]
    rng = np.random.default_rng(0)
    prompts = _prompts(rng, args.n, args.prompt_len, args.prompt_len, vocab=cfg["vocab_size"])
    base = dict(max_tokens=args.tokens, temperature=1.0, ignore_eos=True)
    # warm-up at full size: the first full batch pays one-time costs (allocations, lazy init) in any engine
    _gen(llm, prompts, SamplingParams(**dict(max_tokens=args.tokens, temperature=1.0, ignore_eos=True)))
    res = {"mode": args.engine, "runs": {}}
    vec = rng.standard_normal(H).astype(np.float32)
    vec = (vec / np.linalg.norm(vec)).tolist()
    configs = {"plain": None} if not plugin_on else {
        "idle": None,
        "hs_1layer_all": {"capture": {"hidden_states": {"layers": [L // 2], "positions": "all"}}},
        "hs_all_last_prompt": {"capture": {"hidden_states": {"layers": "all", "positions": "last_prompt"}}},
        "hs_all_all": {"capture": {"hidden_states": {"layers": "all", "positions": "all"}}},
        "qk_1layer": {"capture": {"qk": {"layers": [L // 2], "heads": "all", "positions": "all"}}},
        "steer_1layer": {"steer": [{"layer": L // 2, "op": "add", "vector": vec, "scale": 0.5}]},
        "steer_all_layers": {"steer": [{"layer": i, "op": "add", "vector": vec, "scale": 0.1} for i in range(L)]},
        "steer_256_vectors": "distinct",
        "capture_and_steer": {"capture": {"hidden_states": {"layers": [L // 2], "positions": "all"}},
                              "steer": [{"layer": L // 2, "op": "add", "vector": vec, "scale": 0.5}]},
        "idle_again": None,
    }
    if args.only:
        configs = {k: v for k, v in configs.items() if k in args.only.split(",") or k in ("plain", "idle")}
    rounds = args.rounds * (2 if not plugin_on else 1)  # round-robin over the configs spreads clock drift
    for rnd in range(rounds):
        for name, spec in configs.items():
            if spec == "distinct":
                ps = []
                for i in range(args.n):
                    vi = rng.standard_normal(H).astype(np.float32)
                    ps.append(SamplingParams(**base, extra_args={"mia_stream": {
                        "steer": [{"layer": L // 2, "op": "add", "vector": (vi / np.linalg.norm(vi)).tolist(),
                                   "scale": 0.5}], "id": f"{name}{rnd}_{i}"}}))
            elif spec is None:
                ps = SamplingParams(**base)
            else:
                ps = [SamplingParams(**base, extra_args={"mia_stream": dict(spec, id=f"{name}{rnd}_{i}")})
                      for i in range(args.n)]
            torch.cuda.synchronize()
            profiled = name in args.profile.split(",") and rnd == rounds - 1  # the last round: earlier ones stay clean
            spy = _start_pyspy(args, name) if profiled else None
            host0 = {k: list(v) for k, v in _HOST_MS.items()}
            t0 = time.perf_counter()
            try:
                toks, admit_s, dt = _gen_timed(llm, prompts, ps)
            except Exception as e:  # noqa: BLE001  (engine API drift: fall back to timing generate())
                print(f"[bench] _gen_timed failed ({e!r}); timing llm.generate instead", flush=True)
                toks, admit_s = _gen(llm, prompts, ps), None
                dt = time.perf_counter() - t0
            if spy is not None:
                spy.wait(60)
            gen = sum(len(t) for t in toks)
            row = {"gen_tokens": gen, "s": round(dt, 3), "tok_s": round(gen / dt, 1),
                   "admit_s": None if admit_s is None else round(admit_s, 3),
                   "host_ms": {k: round(v[0] - host0.get(k, [0, 0])[0], 1) for k, v in _HOST_MS.items()},
                   "host_calls": {k: v[1] - host0.get(k, [0, 0])[1] for k, v in _HOST_MS.items()}}
            if bus is not None:
                got = bus.collect(0 if spec is None else args.n, timeout=15)
                lat = np.asarray(got["latency_ms"]) if got["latency_ms"] else None
                drops = sum((s["end"] or {}).get("frames_dropped", 0) for s in got["streams"].values())
                gaps = sum(s["gaps"] for s in got["streams"].values())
                gap_reasons: dict[str, int] = {}
                for s in got["streams"].values():
                    for key, count in s["gap_reasons"].items():
                        gap_reasons[key] = gap_reasons.get(key, 0) + count
                frames = sum(len(s["frames"]) for s in got["streams"].values())
                ended = sum(1 for s in got["streams"].values() if s["end"] is not None)
                row.update({"bytes": got["bytes"], "bytes_per_s": round(got["bytes"] / dt), "frames": frames,
                            "frames_dropped": drops, "gaps": gaps, "gap_reasons": gap_reasons,
                            # the publisher's drops are in both StreamEnd.frames_dropped and its gaps: once here
                            "lost": drops + gaps - sum(v for k, v in gap_reasons.items() if k.startswith("producer:")),
                            "streams_ended": ended,
                            "lat_p50_ms": round(float(np.percentile(lat, 50)), 2) if lat is not None else None,
                            "lat_p99_ms": round(float(np.percentile(lat, 99)), 2) if lat is not None else None,
                            # the broker's counters since it started (all configs so far), not this row's
                            "broker_drops": {k: v for k, v in (got["broker"].get("totals") or {}).items()
                                             if "drop" in str(k) or "shm_" in str(k)}
                            if isinstance(got["broker"], dict) else None})
            row["profiled"] = profiled
            res["runs"].setdefault(name, []).append(row)
            print(f"[bench] round {rnd} {name} {row}", flush=True)
    # pinned D2H bandwidth on this host (the ceiling for drained bytes/s)
    src = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
    dst = torch.empty(64 << 20, dtype=torch.uint8, pin_memory=True)
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(20):
        dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    res["pinned_d2h_GBps"] = round(20 * (64 << 20) / (time.perf_counter() - t0) / 1e9, 1)
    res["worker"] = llm.collective_rpc(_worker_probe)[0]
    if bus is not None:
        bus.close()
    return res


def engine_hf_reference(args) -> dict:
    """HF transformers forward (float32) on the eager run's prompt+generated tokens: per-layer hidden states."""
    import torch
    from transformers import AutoModelForCausalLM

    model = str(Path(args.models) / "smollm2-random")
    m = AutoModelForCausalLM.from_pretrained(model, torch_dtype=torch.float32).cuda().eval()
    out = {}
    for tag in ("small_graphs", "small_eager"):
        f = Path(args.work) / f"{tag}.npz"
        if not f.exists():
            continue
        d = np.load(f)
        errs = []
        for i in range(8):
            pos, hs = d[f"cap{i}_pos"], d[f"cap{i}_hs"]
            if hs.size == 0:
                errs.append(None)
                continue
            ids = list(d[f"cap{i}_prompt"]) + list(d["tokens_on"][i])
            with torch.no_grad():
                r = m(torch.tensor([ids], device="cuda"), output_hidden_states=True)
            ref = torch.stack(r.hidden_states[1:-1])[:, 0].float().cpu().numpy()  # layers 0..L-2 (pre final norm)
            got = hs[: ref.shape[0]][:, : len(pos)]
            rr = ref[:, pos]
            errs.append(float(np.linalg.norm(got - rr) / np.linalg.norm(rr)))
        out[tag] = errs
    return out


# ---------------------------------------------------------------------------------------------- orchestrator


def _run_engine(mode: str, args, timeout: int) -> dict:
    out = Path(args.out)
    log = out / f"{mode}.log"
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_USE_FLASHINFER_SAMPLER="0",
               VLLM_ALLOW_INSECURE_SERIALIZATION="1", PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false",
               HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1", PYTHONPATH=f"{os.environ.get('PYTHONPATH', '')}:{REPO}")
    env.pop("MIA_STREAM_BROKER", None)
    cmd = [sys.executable, __file__, "--engine", mode, "--models", args.models, "--out", args.out,
           "--tp", str(args.tp), "--work", args.work, "--n", str(args.n), "--tokens", str(args.tokens),
           "--prompt-len", str(args.prompt_len), "--batched", str(args.batched), "--rounds", str(args.rounds),
           "--profile", args.profile, "--pyspy", args.pyspy, "--pyspy-s", str(args.pyspy_s)] + (
               ["--only", args.only] if args.only else []) + (["--split-cores"] if args.split_cores else [])
    t0 = time.time()
    with open(log, "w") as fh:
        try:
            rc = subprocess.run(cmd, env=env, stdout=fh, stderr=subprocess.STDOUT, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    res_file = Path(args.work) / f"{mode}.json"
    res = json.loads(res_file.read_text()) if res_file.exists() else {}
    res["rc"], res["wall_s"] = rc, round(time.time() - t0, 1)
    print(f"== {mode}: rc={rc} in {res['wall_s']} s", flush=True)
    partial = out / "results.json"
    prev = json.loads(partial.read_text()) if partial.exists() else {}
    prev[mode] = res
    partial.write_text(json.dumps(_jsonable(prev), indent=1))  # survives a kill of the whole check
    if rc != 0:
        print("\n".join(log.read_text().splitlines()[-25:]), flush=True)
    return res


def _rel(a, b):
    if a is None or b is None or a.size == 0 or b.size == 0 or a.shape != b.shape:
        return None
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def compare_correctness(out: Path, results: dict) -> dict:
    rows = {}
    g, e = Path(WORK[0]) / "small_graphs.npz", Path(WORK[0]) / "small_eager.npz"
    failed = [m for m in ("small_graphs", "small_eager") if results.get(m, {}).get("rc") != 0]
    if failed:  # a timed-out or failed engine may have left a partial file: compare nothing of it
        return {"error": f"engine(s) {failed} did not finish: rc {[results.get(m, {}).get('rc') for m in failed]}"}
    if not (g.exists() and e.exists()):
        return {"error": "missing npz"}
    g, e = np.load(g), np.load(e)

    def agreed(i, run, tok_key):
        """Compare graphs vs eager only where both saw the same inputs: before their greedy tokens diverge
        (random bf16 weights have near-ties, so a token can flip; everything after it differs legitimately)."""
        pos, a, b = g[f"{run}{i}_pos"], g[f"{run}{i}_{tok_key}"], e[f"{run}{i}_{tok_key}"]
        if a.size == 0 or b.size == 0 or a.shape != b.shape:
            return None
        tg, te = g["tokens_on" if run == "cap" else "tokens_steer"][i], e["tokens_on" if run == "cap" else "tokens_steer"][i]
        d = int(np.argmax(tg != te)) if np.any(tg != te) else len(tg)
        keep = pos < len(g[f"cap{i}_prompt"]) + d
        return _rel(a[:, keep], b[:, keep])

    hs_err = [agreed(i, "cap", "hs") for i in range(8)]
    q_err = [agreed(i, "cap", "q") for i in range(8)]
    k_err = [agreed(i, "cap", "k") for i in range(8)]
    st_err = [agreed(i, "st", "hs") for i in range(8)]
    rows["first_token_graphs_eq_eager"] = bool(np.array_equal(g["tokens_on"][:, 0], e["tokens_on"][:, 0]))
    rows["diverged_requests_graphs_vs_eager"] = int(np.sum(np.any(g["tokens_on"] != e["tokens_on"], axis=1)))
    # unsteered requests 4-7 in the steering batch vs the same requests in the capture-only batch
    untouched = [_rel(g[f"st{i}_hs"], g[f"cap{i}_hs"]) for i in range(4, 8)]
    steered_moved = [_rel(g[f"st{i}_hs"], g[f"cap{i}_hs"]) for i in range(4)]
    rows["graphs_vs_eager_hs_rel"] = hs_err
    rows["graphs_vs_eager_q_rel"] = q_err
    rows["graphs_vs_eager_k_rel"] = k_err
    rows["graphs_vs_eager_steered_hs_rel"] = st_err
    rows["tokens_graphs_eq_eager"] = bool(np.array_equal(g["tokens_on"], e["tokens_on"]))
    rows["steer_tokens_graphs_eq_eager"] = bool(np.array_equal(g["tokens_steer"], e["tokens_steer"]))
    rows["unsteered_rows_rel_vs_capture_only"] = untouched
    rows["unsteered_tokens_unchanged"] = bool(np.array_equal(g["tokens_steer"][4:], g["tokens_on"][4:]))
    rows["steered_rows_rel_vs_capture_only"] = steered_moved
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="/tmp/models")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/gpu-check"))
    ap.add_argument("--work", default="/tmp/gpu-check-work", help="per-engine JSON and captured arrays")
    ap.add_argument("--phases", default="correctness,bench")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--n", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--batched", type=int, default=8192)
    ap.add_argument("--rounds", type=int, default=2, help="bench: passes over the configs (plain: twice that)")
    ap.add_argument("--only", default="", help="bench: comma-separated configs to run")
    ap.add_argument("--profile", default="", help="bench: comma-separated configs to sample with py-spy")
    ap.add_argument("--pyspy", default="", help="path of a py-spy binary for --profile")
    ap.add_argument("--pyspy-s", type=int, default=3, help="seconds each --profile sample lasts")
    ap.add_argument("--skip-plain", action="store_true", help="bench: only the plugin engine (profiling runs)")
    ap.add_argument("--split-cores", action="store_true",
                    help="bench: engine on half the cores, bus process and drain sidecar on the other half")
    ap.add_argument("--engine-timeout", type=int, default=600,
                    help="seconds each correctness engine may take, start and compile included (cold host)")
    ap.add_argument("--engine", help=argparse.SUPPRESS)
    args = ap.parse_args()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    Path(args.work).mkdir(parents=True, exist_ok=True)
    WORK[0] = args.work
    if args.engine:
        fn = {"small_graphs": engine_correctness, "small_eager": engine_correctness, "bench_plain": engine_bench,
              "bench_plugin": engine_bench, "hf_ref": engine_hf_reference}[args.engine]
        try:
            res = fn(args)
        except Exception:
            traceback.print_exc()
            res = {"error": traceback.format_exc()[-2000:]}
        (Path(args.work) / f"{args.engine}.json").write_text(json.dumps(_jsonable(res), indent=1))
        sys.stdout.flush()
        os._exit(0 if "error" not in res else 1)  # skip vLLM's slow atexit teardown
    phases = args.phases.split(",")
    results: dict = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "tp": args.tp}
    if "correctness" in phases:
        # A cold host compiles (torch.compile alone took 70 s on the H200) and captures graphs before the first
        # request: 150 s was too short for the graphs engine there (issue 18). Each limit is --engine-timeout.
        for mode in ("small_graphs", "small_eager"):
            results[mode] = _run_engine(mode, args, args.engine_timeout)
        results["hf_ref"] = _run_engine("hf_ref", args, args.engine_timeout)
        try:
            results["compare"] = compare_correctness(Path(args.out), results)
        except Exception as e:  # noqa: BLE001  (a partial .npz from a killed engine: reported, never a crash)
            results["compare"] = {"error": f"{type(e).__name__}: {e}"}
    if "bench" in phases:
        if not args.skip_plain:
            results["bench_plain"] = _run_engine("bench_plain", args, 200)
        results["bench_plugin"] = _run_engine("bench_plugin", args, 420)
    (Path(args.out) / "results.json").write_text(json.dumps(_jsonable(results), indent=1))
    print_table(results)
    print(json.dumps({k: v for k, v in results.get("compare", {}).items()}), flush=True)
    return 0 if check_ok(results) else 1


def check_ok(results: dict) -> bool:
    c = results.get("compare", {})
    if "correctness" not in results and not c:
        return True
    # Greedy tokens of a random-weights model may flip at near-ties between graphs and eager; the first token
    # (same prompt) must agree, and every captured row before a divergence must match (below).
    if c.get("error"):
        return False
    ok = c.get("first_token_graphs_eq_eager") and c.get("unsteered_tokens_unchanged")
    for mode in ("small_graphs", "small_eager"):
        r = results.get(mode, {})
        ok = ok and r.get("tokens_capture_on_eq_off") and r.get("mixed_bad_count", 1) == 0
    errs = [x for x in c.get("graphs_vs_eager_hs_rel", []) if x is not None]
    ok = ok and bool(errs) and max(errs) < 5e-2
    return bool(ok)


def print_table(results: dict) -> None:
    print("\n==== correctness ====")
    for mode in ("small_graphs", "small_eager"):
        r = results.get(mode, {})
        w = r.get("worker", {})
        print(f"{mode}: rc={r.get('rc')} tokens capture on==off: {r.get('tokens_capture_on_eq_off')}  "
              f"mixed 256: {r.get('mixed_streams')} streams, bad {r.get('mixed_bad_count')} "
              f"{r.get('mixed_bad', [])[:3]}  cudagraph={w.get('cudagraph_mode')} cap={w.get('capability')} "
              f"backends={w.get('backend_calls')} triton={w.get('triton_targets')}")
        if r.get("error"):
            print("  error:", r["error"][-600:])
    for k, v in (results.get("compare") or {}).items():
        print(f"{k}: {v}")  # "error": why nothing was compared (an engine that timed out or failed)
    print("hf reference rel err (vLLM bf16 vs HF fp32, per request):", results.get("hf_ref"))
    if "bench_plugin" in results:
        print("\n==== overhead, 8B shape dummy weights ====")
        plain = [r["tok_s"] for r in results.get("bench_plain", {}).get("runs", {}).get("plain", [])]
        base = float(np.median(plain)) if plain else None
        bw = results["bench_plugin"].get("pinned_d2h_GBps")
        print(f"plain vLLM tok/s: {plain}  pinned D2H {bw} GB/s")
        print("tok/s: engine run only (admission timed apart: 'admit s'); median over unprofiled rounds; "
              "'host ms/step': the runtime's begin_step + end_step + on_sampled on the engine thread")
        print(f"{'config':22} {'tok/s':>9} {'ratio':>6} {'GB/s':>6} {'frames':>7} {'dropped':>7} {'p50ms':>7} "
              f"{'p99ms':>7} {'admit s':>7} {'host ms/step':>12}")
        for name, runs in results["bench_plugin"].get("runs", {}).items():
            clean = [x for x in runs if not x.get("profiled")] or runs
            r = dict(clean[-1], tok_s=float(np.median([x["tok_s"] for x in clean])))
            ratio = r["tok_s"] / base if base else float("nan")
            host, calls = r.get("host_ms") or {}, r.get("host_calls") or {}
            steps = calls.get("begin_step") or 0
            per_step = sum(host.get(k, 0) for k in ("begin_step", "end_step", "on_sampled")) / steps if steps else None
            print(f"{name:22} {r['tok_s']:9.0f} {ratio:6.3f} {r.get('bytes_per_s', 0) / 1e9:6.2f} "
                  f"{r.get('frames', 0):7d} {r.get('lost', r.get('frames_dropped', 0) + r.get('gaps', 0)):7d} "
                  f"{r.get('lat_p50_ms')!s:>7} {r.get('lat_p99_ms')!s:>7} {r.get('admit_s')!s:>7} "
                  f"{'-' if per_step is None else f'{per_step:.3f}':>12}")
            if r.get("gap_reasons"):
                print(f"{'':22} lost, by origin:reason: {r['gap_reasons']}")
        for m in ("bench_plain", "bench_plugin"):
            if m in results and (results[m].get("error") or results[m].get("rc") not in (0, None)):
                print(m, "rc", results[m].get("rc"), (results[m].get("error") or "")[-600:])


if __name__ == "__main__":
    sys.exit(main())
