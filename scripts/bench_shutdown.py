"""How a vLLM engine shuts down, plain vs with the mia_stream plugin, side by side in one run.

    .venv/bin/python scripts/bench_shutdown.py [--rounds 3] [--timeout SECONDS] [--json OUT]

Each round starts two engines in turn, each in its own process and in vLLM's default topology (frontend,
EngineCore process, one worker process; the plugin adds a drain sidecar per worker): plain vLLM
(MIA_STREAM_BROKER unset) and the plugin engine publishing to a broker in this process. Each serves 4 requests
(the plugin's capture hidden states at all positions), then calls ``engine_core.shutdown(timeout)`` (vLLM's
grace before it force-kills EngineCore; default vLLM's own, 5 s) while a thread records when each of the
engine's processes exits. Per engine: seconds from shutdown() to the worker's exit, to EngineCore's exit, to
shutdown()'s return and to the sidecar's exit; whether vLLM force-killed a process ("force killing" in its log);
and the /dev/shm/mia-stream-ring-* files of the engine's processes left once the broker's ring grace (1 s here)
has passed.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RING_GRACE_S = 1.0


def _watch(pids: dict[str, int], exited: dict[str, float], t0: list) -> threading.Thread:
    import psutil

    def gone(pid: int) -> bool:
        try:
            return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True

    def run():
        while len(exited) < len(pids):
            for name, pid in pids.items():
                if name not in exited and gone(pid):
                    exited[name] = time.monotonic() - t0[0] if t0 else -1.0
            time.sleep(0.005)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def _child(args) -> None:
    import psutil
    from vllm import LLM, SamplingParams

    from mia_stream.model import default_model_dir

    plugin = args.child == "plugin"
    llm = LLM(str(default_model_dir()), dtype="float32", enforce_eager=True, max_model_len=512, seed=0)
    spec = {"capture": {"hidden_states": {"layers": "all", "positions": "all"}}}
    params = [SamplingParams(max_tokens=16, temperature=0.0,
                             extra_args={"mia_stream": dict(spec, id=f"shutdown-{os.getpid()}-{i}")} if plugin else None)
              for i in range(4)]
    llm.generate(["The capital of France is"] * 4, params, use_tqdm=False)
    core = psutil.Process(llm.llm_engine.engine_core.resources.engine_manager.processes[0].pid)
    pids = {"frontend": os.getpid(), "engine_core": core.pid}
    for i, worker in enumerate(core.children()):
        pids[f"worker{i}"] = worker.pid
        for j, side in enumerate(worker.children()):
            if "mia_stream.producer._sidecar" in " ".join(side.cmdline()):
                pids[f"sidecar{i}"] = side.pid
    t0: list = []
    exited: dict[str, float] = {}
    watched = {k: v for k, v in pids.items() if k != "frontend"}
    thread = _watch(watched, exited, t0)
    t0.append(time.monotonic())
    llm.llm_engine.engine_core.shutdown(timeout=args.timeout)
    returned = time.monotonic() - t0[0]
    thread.join(30)
    print("RESULT " + json.dumps({"pids": pids, "exited_s": exited, "shutdown_returned_s": returned}), flush=True)


def _run(mode: str, broker: str, timeout: float | None, log_dir: Path) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p))
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # vLLM's default: EngineCore in a process of its own
    if mode == "plugin":
        env["MIA_STREAM_BROKER"] = broker
    else:
        env.pop("MIA_STREAM_BROKER", None)
    cmd = [sys.executable, __file__, "--child", mode] + (["--timeout", str(timeout)] if timeout is not None else [])
    log = log_dir / f"{mode}-{time.time_ns()}.log"
    with open(log, "w") as f:
        proc = subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=600)
    text = log.read_text()
    line = next((ln for ln in text.splitlines() if ln.startswith("RESULT ")), None)
    if line is None:
        raise RuntimeError(f"{mode} engine failed (exit {proc.returncode}); log: {log}")
    result = json.loads(line[len("RESULT "):])
    time.sleep(RING_GRACE_S + 1.0)  # a ring handed over to the broker is its to remove after the grace
    rings = [os.path.basename(p) for pid in result["pids"].values()
             for p in glob.glob(f"/dev/shm/mia-stream-ring-{pid}-*")]
    result.update(mode=mode, exit_code=proc.returncode, force_killed="force killing" in text, rings_left=rings,
                  log=str(log))
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=None, help="vLLM's shutdown grace (default: vLLM's, 5 s)")
    ap.add_argument("--json", help="write every result here")
    ap.add_argument("--child", choices=("plain", "plugin"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        _child(args)
        return 0
    from mia_stream.broker import run_broker_in_thread

    run_dir = tempfile.mkdtemp(prefix="mia-shut-", dir="/tmp")
    log_dir = Path(tempfile.mkdtemp(prefix="mia-shut-logs-"))
    results = []
    with run_broker_in_thread(address=run_dir, ring_grace_s=RING_GRACE_S):
        for r in range(args.rounds):
            for mode in ("plain", "plugin"):
                res = _run(mode, run_dir, args.timeout, log_dir)
                results.append(res)
                ex = res["exited_s"]
                print(f"round {r} {mode:6}: worker exit {ex.get('worker0', float('nan')):5.2f} s, EngineCore exit "
                      f"{ex.get('engine_core', float('nan')):5.2f} s, shutdown() returned "
                      f"{res['shutdown_returned_s']:5.2f} s, sidecar exit {ex.get('sidecar0', float('nan')):5.2f} s, "
                      f"force-killed: {'yes' if res['force_killed'] else 'no'}, rings left: {res['rings_left'] or 'none'}",
                      flush=True)
    for mode in ("plain", "plugin"):
        rs = [r for r in results if r["mode"] == mode]
        worker = sorted(r["exited_s"].get("worker0", float("nan")) for r in rs)
        core = sorted(r["exited_s"].get("engine_core", float("nan")) for r in rs)
        print(f"{mode:6}: worker exit {min(worker):.2f}-{max(worker):.2f} s, EngineCore exit "
              f"{min(core):.2f}-{max(core):.2f} s, force-killed {sum(r['force_killed'] for r in rs)}/{len(rs)}, "
              f"rounds with rings left {sum(bool(r['rings_left']) for r in rs)}/{len(rs)}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
