"""One real vLLM engine with the plugin, started with steering and Q/K capture switched off, in vLLM's default
topology (frontend, EngineCore process, worker process; the plugin adds a drain sidecar) and default scheduler
budget. tests/test_engine_limits.py runs it in a subprocess, with the settings in its environment:

    python tests/limits_engine_run.py --model DIR --out out.json --prefix P [--burst 64] [--grace 30]

1. a request with ``steer``, one capturing ``qk`` and one quantizing (MIA_STREAM_QUANTIZE left at its default,
   off): each must be refused at admission (ValueError), then a plain request shows the engine still serves;
2. a burst of ``--burst`` prompts (~70 tokens each) capturing the hidden states of one layer at all positions,
   submitted at once: the first prefill step carries ``max_num_batched_tokens`` rows;
3. ``engine_core.shutdown(timeout=--grace)`` while a thread records when each engine process exits.

``out.json``: what was refused and why, the burst's token ids, the engine's budget, the processes, the
/dev/shm rings each had while running, and the exit times (seconds after shutdown() was called).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import threading
import time

WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa "
         "quebec romeo sierra tango uniform victor whiskey xray yankee zulu").split()
CAPTURE_LAYER = 15


def burst_prompt(i: int) -> str:
    words = [WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(60)]
    return f"Request {i}: repeat after me. " + " ".join(words)


def _processes(llm) -> dict[str, int]:
    import psutil

    core = psutil.Process(llm.llm_engine.engine_core.resources.engine_manager.processes[0].pid)
    pids = {"frontend": os.getpid(), "engine_core": core.pid}
    for i, worker in enumerate(core.children()):
        pids[f"worker{i}"] = worker.pid
        for side in worker.children():
            if "mia_stream.producer._sidecar" in " ".join(side.cmdline()):
                pids[f"sidecar{i}"] = side.pid
    return pids


def _rings(pids: dict[str, int]) -> dict[str, list[str]]:
    return {name: sorted(os.path.basename(p) for p in glob.glob(f"/dev/shm/mia-stream-ring-{pid}-*"))
            for name, pid in pids.items()}


def _watch_exits(pids: dict[str, int], t0: float, exited: dict) -> threading.Thread:
    import psutil

    def gone(pid: int) -> bool:
        try:
            return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True

    def run():
        deadline = t0 + 60
        while len(exited) < len(pids) and time.monotonic() < deadline:
            for name, pid in pids.items():
                if name not in exited and gone(pid):
                    exited[name] = time.monotonic() - t0
            time.sleep(0.005)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--prefix", required=True)
    ap.add_argument("--burst", type=int, default=64)
    ap.add_argument("--grace", type=float, default=30.0)
    args = ap.parse_args(argv)
    from vllm import LLM, SamplingParams

    llm = LLM(args.model, dtype="float32", enforce_eager=True, max_model_len=512, seed=0)
    out: dict = {"max_num_batched_tokens": llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens,
                 "refused": {}}
    plain = SamplingParams(max_tokens=8, temperature=0.0)
    refused_specs = {
        "steer": {"steer": [{"layer": 3, "op": "add", "vector": [0.5] * 576}], "id": f"{args.prefix}-steer"},
        "qk": {"capture": {"qk": {"layers": [3], "heads": "all", "positions": "all"}}, "id": f"{args.prefix}-qk"},
        # MIA_STREAM_QUANTIZE defaults to 0: no workspace reserved, so quantized capture is refused
        "quantize": {"capture": {"hidden_states": {"layers": [3]}, "quantize": "int8"}, "id": f"{args.prefix}-quantize"},
    }
    for name, spec in refused_specs.items():
        try:
            llm.generate(["The capital of France is"],
                         SamplingParams(max_tokens=8, temperature=0.0, extra_args={"mia_stream": spec}), use_tqdm=False)
            out["refused"][name] = None
        except ValueError as e:  # the spec errors are ValueErrors; the served build subclasses them for a 400
            out["refused"][name] = f"{type(e).__name__}: {e}"
            out.setdefault("refused_kinds", {})[name] = [c.__name__ for c in type(e).__mro__]
        out.setdefault("served_after_refusal", []).append(
            llm.generate(["The capital of France is"], plain, use_tqdm=False)[0].outputs[0].text)
    spec = {"capture": {"hidden_states": {"layers": [CAPTURE_LAYER], "positions": "all"}}}
    params = [SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True,
                             extra_args={"mia_stream": dict(spec, id=f"{args.prefix}-burst-{i}")})
              for i in range(args.burst)]
    results = llm.generate([burst_prompt(i) for i in range(args.burst)], params, use_tqdm=False)
    out["burst"] = {f"{args.prefix}-burst-{i}": {"prompt_token_ids": list(r.prompt_token_ids),
                                                 "token_ids": list(r.outputs[0].token_ids)}
                    for i, r in enumerate(results)}
    pids = _processes(llm)
    out["pids"], out["rings_while_running"] = pids, _rings(pids)
    exited: dict = {}
    t0 = time.monotonic()
    thread = _watch_exits({k: v for k, v in pids.items() if k != "frontend"}, t0, exited)
    llm.llm_engine.engine_core.shutdown(timeout=args.grace)
    out["shutdown_returned_s"] = time.monotonic() - t0
    thread.join(65)
    out["exited_s"] = exited
    with open(args.out, "w") as f:
        json.dump(out, f)
    print("limits engine run done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
