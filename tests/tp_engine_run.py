"""Run one real vLLM engine (with the mia_stream plugin, on the CPU or CUDA) through a plan of generate() phases.

Used by tests/test_tp.py and scripts/tp_check.py in a subprocess each: vLLM loads its plugins once
per process, and two engines in one process would fight over the two cores and the memory.

    python tests/tp_engine_run.py --model DIR --broker RUN_DIR --tp 2 --plan plan.json --out out.json

``plan.json``: ``[{"name": ..., "requests": [{"prompt": str, "max_tokens": int, "ignore_eos": bool,
"spec": {... "id": stream id}}], "hold": {...}}]`` ("hold" optional: see ``_hold_steps``). After each phase
``out.json`` is rewritten with
``{"phases": {name: {stream id: {"prompt_token_ids": [...], "token_ids": [...], "finish_reason": str}}},
"done": [phase names]}``, so a phase that kills the engine still leaves the earlier ones.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path


PROMPTS = ["The capital of France is", "Once upon a time there was a",
           "Summarise: " + " ".join(f"item {i} is blue." for i in range(20))]
CAPTURE = {"hidden_states": {"layers": "all", "positions": "all"},
           "qk": {"layers": "all", "heads": "all", "positions": "all"}}
STEER_LAYER = 1


def steer_vector(seed: int, hidden: int = 256, norm: float = 1.0) -> list:
    import numpy as np

    v = np.random.default_rng(seed).standard_normal(hidden).astype(np.float32)
    return (v * (norm / np.linalg.norm(v))).tolist()


def standard_plan(prefix: str, *, live_tokens: int = 0, kill_tokens: int = 0, live_hold: dict | None = None,
                  kill_hold: dict | None = None) -> list:
    """Phase "batch": the prompts captured, plus one statically steered request; then optional phases
    "live" (one long request for a live steering command) and "kill" (one long request whose rank dies).
    ``live_hold`` / ``kill_hold``: those phases' "hold" (``_hold_steps``), so that the request cannot finish
    before a consumer that lags behind the engine did its part (sent the command, killed the rank)."""
    reqs = [{"prompt": p, "max_tokens": 12, "spec": {"capture": CAPTURE, "id": f"{prefix}-cap-{i}"}}
            for i, p in enumerate(PROMPTS)]
    reqs.append({"prompt": PROMPTS[1], "max_tokens": 12, "spec": {
        "capture": CAPTURE, "id": f"{prefix}-steered",
        "steer": [{"layer": STEER_LAYER, "op": "add", "vector": steer_vector(1, norm=2.0)}]}})
    # hidden states only (rank 1 has nothing to publish), and q/k at other positions than hs (two frames a step)
    reqs.append({"prompt": PROMPTS[2], "max_tokens": 6, "spec": {
        "capture": {"hidden_states": CAPTURE["hidden_states"]}, "id": f"{prefix}-hs-only"}})
    reqs.append({"prompt": PROMPTS[0], "max_tokens": 6, "spec": {
        "capture": {"hidden_states": {"layers": [0, 3], "positions": "all"},
                    "qk": {"layers": [2], "heads": [1, 2, 5, 6], "positions": "last_prompt"}}, "id": f"{prefix}-mixed"}})
    plan = [{"name": "batch", "requests": reqs}]
    if live_tokens:
        plan.append({"name": "live", "requests": [{"prompt": PROMPTS[0], "max_tokens": live_tokens, "ignore_eos": True,
                                                   "spec": {"capture": CAPTURE, "id": f"{prefix}-live"}}]})
        if live_hold:
            plan[-1]["hold"] = live_hold
    if kill_tokens:
        plan.append({"name": "kill", "requests": [{"prompt": PROMPTS[0], "max_tokens": kill_tokens, "ignore_eos": True,
                                                   "spec": {"capture": CAPTURE, "id": f"{prefix}-kill"}}]})
        if kill_hold:
            plan[-1]["hold"] = kill_hold
    return plan


def _steering_received() -> int:
    """Live steering commands this engine core's control channel received so far (each is applied and acked
    at the engine's next step)."""
    from mia_stream.producer import _vllm_adapter

    controls = [c for c in map(_vllm_adapter.REGISTRY.control_of, _vllm_adapter.REGISTRY.schedulers) if c is not None]
    if not controls:
        raise RuntimeError("hold: no mia_stream engine control in this process (plugin internals changed?)")
    return sum(c.publisher.counters["steering_commands"] for c in controls)


def _hold_steps(llm, after_steps: int, release_file: str | None = None, steering: bool = False,
                timeout_s: float = 60.0):
    """A phase's "hold": after ``after_steps`` engine steps, step no further until what the test needed the
    running request for happened, or ``timeout_s`` passed: ``release_file`` exists (e.g. the test killed a
    rank, then created it) and/or (``steering``) a live steering command reached the engine core.
    Only the engine stops: the workers' publishers keep sending what the steps so far captured, and their
    heartbeats. Returns the function that undoes it."""
    engine = llm.llm_engine
    step, steps = engine.step, [0]
    commands_before = _steering_received() if steering else 0

    def released() -> bool:
        return ((release_file is None or os.path.exists(release_file))
                and (not steering or _steering_received() > commands_before))

    def held_step():
        if steps[0] == after_steps:
            print(f"hold: {after_steps} steps done, waiting for "
                  f"{' and '.join(filter(None, [release_file, 'a steering command' if steering else '']))}", flush=True)
            deadline = time.monotonic() + timeout_s
            while not released() and time.monotonic() < deadline:
                time.sleep(0.02)
            print("hold: " + ("released" if released() else f"timed out after {timeout_s:g} s"), flush=True)
        steps[0] += 1
        return step()

    engine.step = held_step  # generate() steps the engine through llm.llm_engine.step()
    return lambda: engine.__dict__.pop("step", None)


def engine_env(broker: str, tp: int, device: str = "cpu") -> dict:
    """The environment of an engine subprocess: the plugin on; on the CPU a small KV cache and one OMP core
    per rank; on CUDA the sampler that the staged vLLM of ../shared/device has (no flashinfer)."""
    env = dict(os.environ, MIA_STREAM_BROKER=broker, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false", VLLM_ENABLE_V1_MULTIPROCESSING="0")
    if device == "cuda":
        env["VLLM_USE_FLASHINFER_SAMPLER"] = "0"
        for name in ("VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND"):
            env.pop(name, None)
        return env
    env["VLLM_CPU_KVCACHE_SPACE"] = "1"
    if tp == 2:
        env["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"  # measured: TP=2 on this 2-core machine needs one core each
    else:
        env.pop("VLLM_CPU_OMP_THREADS_BIND", None)  # "auto", as the session engine runs
    return env


def run_and_collect(model: str, broker: str, tp: int, plan: list, workdir: Path, on_event=None,
                    timeout: float = 200.0, device: str = "cpu", dtype: str = "float32",
                    graphs: bool = False) -> tuple[dict, dict, str]:
    """Start the engine subprocess on ``plan`` while collecting every planned stream from the broker.

    ``device`` "cpu" (vLLM CPU) or "cuda" (``graphs``: torch.compile + CUDA graphs instead of eager).

    ``on_event(event, client)`` sees each consumer event as it arrives (e.g. to send a steering command).
    Returns (the subprocess's out.json, {stream id: [events]}, its log); the subprocess is always killed.
    """
    from mia_stream.consumers import open_stream

    workdir.mkdir(parents=True, exist_ok=True)
    plan_path, out_path, log_path = workdir / "plan.json", workdir / "out.json", workdir / "engine.log"
    plan_path.write_text(json.dumps(plan))
    wanted = {r["spec"]["id"] for ph in plan for r in ph["requests"] if r.get("spec")}
    events: dict = defaultdict(list)
    ended = lambda: all(any(e.kind == "end" for e in events.get(r, ())) for r in wanted)  # noqa: E731
    with open_stream(broker, patterns=sorted(wanted), timeout=None) as stream, open(log_path, "w") as log:
        time.sleep(0.2)  # the subscription reaches the broker before the engine publishes
        proc = subprocess.Popen([sys.executable, __file__, "--model", model, "--broker", broker, "--tp", str(tp),
                                 "--plan", str(plan_path), "--out", str(out_path), "--device", device, "--dtype", dtype]
                                + (["--graphs"] if graphs else []),
                                env=engine_env(broker, tp, device), stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        deadline, exited_at = time.monotonic() + timeout, None
        try:
            source = stream._source
            while time.monotonic() < deadline and not ended():
                for ev in source.events(timeout=0.5):
                    events[ev.stream.request_id].append(ev)
                    if on_event is not None:
                        on_event(ev, stream.client)
                    if ended():
                        break
                if proc.poll() is not None:
                    exited_at = exited_at or time.monotonic()
                    if time.monotonic() - exited_at > 15:  # the broker ends a lost producer's streams in 5 s
                        break
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
                proc.wait(10)
    out = json.loads(out_path.read_text()) if out_path.exists() else {"phases": {}, "done": []}
    return out, dict(events), log_path.read_text()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", required=True)
    ap.add_argument("--broker", required=True)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--plan", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--max-model-len", type=int, default=512)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--graphs", action="store_true", help="CUDA: torch.compile and CUDA graphs (default eager)")
    args = ap.parse_args(argv)
    os.environ["MIA_STREAM_BROKER"] = args.broker
    from vllm import LLM, SamplingParams

    plan = json.loads(open(args.plan).read())
    t0 = time.monotonic()
    # enforce_eager on the CPU: its torch.compile warm-up costs about a minute per engine; capture in eager mode
    # goes through the same custom ops (test_producer covers compiled mode at TP=1).
    # TP=2: one worker process per rank ("mp"); TP=1: the worker in this process ("uni"). The engine core
    # runs in this process too (VLLM_ENABLE_V1_MULTIPROCESSING=0): every vLLM process costs a ~20 s import here.
    gpu = {"gpu_memory_utilization": 0.3} if args.device == "cuda" else {}
    llm = LLM(args.model, dtype=args.dtype, tensor_parallel_size=args.tp, enforce_eager=not args.graphs,
              max_model_len=args.max_model_len, distributed_executor_backend="mp" if args.tp > 1 else "uni",
              seed=0, **gpu)
    result = {"phases": {}, "done": [], "start_s": time.monotonic() - t0}
    for phase in plan:
        reqs = phase["requests"]
        params = [SamplingParams(max_tokens=r["max_tokens"], temperature=0.0, ignore_eos=r.get("ignore_eos", False),
                                 extra_args={"mia_stream": r["spec"]} if r.get("spec") else None) for r in reqs]
        unhold = _hold_steps(llm, **phase["hold"]) if phase.get("hold") else None
        try:
            outs = llm.generate([r["prompt"] for r in reqs], params, use_tqdm=False)
        finally:
            if unhold is not None:
                unhold()
        # generate() returns before the step that tells the workers which requests finished (the engine
        # core's own busy loop runs it when it is a process of its own): run it, so the StreamEnds go out now.
        llm.llm_engine.step()
        result["phases"][phase["name"]] = {
            (r.get("spec") or {}).get("id", f"plain-{i}"): {
                "prompt_token_ids": list(o.prompt_token_ids), "token_ids": list(o.outputs[0].token_ids),
                "finish_reason": o.outputs[0].finish_reason}
            for i, (r, o) in enumerate(zip(reqs, outs))}
        result["done"].append(phase["name"])
        tmp = args.out + ".tmp"
        with open(tmp, "w") as f:
            json.dump(result, f)
        os.replace(tmp, args.out)
        print(f"phase {phase['name']} done", flush=True)
    llm.llm_engine.engine_core.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
