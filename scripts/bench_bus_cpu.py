"""CPU time per delivered frame of each bus process and of each of its threads (utime + stime from /proc).

    .venv/bin/python scripts/bench_bus_cpu.py [--size 16K] [--rate 12000] [--n 36000] [--repo DIR] [-- BROKER ARGS]

Starts `mia-stream broker`, then the consumer and the producer of ``bench_bus.py`` (paced at ``--rate``
frames/s; 0 = saturated), samples every thread of the three processes every 50 ms while they run, and
prints CPU microseconds per frame the consumer received. Throughput ratios move with the machine's load;
CPU per frame is steadier, and it shows which stage a change made cheaper. ``--repo`` runs another
checkout (e.g. a ``git worktree`` of an older commit) with its own ``scripts/bench_bus.py`` roles; copy this
checkout's ``bench_bus.py`` into it to compare the code with the same producer pacing. Linux only.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _thread_cpu(pid: int) -> dict[str, float]:
    """``{"<tid>:<name>": cpu seconds}`` of every live thread of ``pid``."""
    out = {}
    for task in glob.glob(f"/proc/{pid}/task/*"):
        try:
            with open(f"{task}/stat") as f:
                stat = f.read()
            with open(f"{task}/comm") as f:
                name = f.read().strip()
        except OSError:  # the thread ended between the listing and the read
            continue
        fields = stat.rsplit(")", 1)[1].split()
        out[f"{task.rsplit('/', 1)[1]}:{name}"] = (int(fields[11]) + int(fields[12])) / _TICK
    return out


def _size(text: str) -> int:
    text = text.strip().upper().rstrip("B").replace("I", "")
    scale = {"K": 1 << 10, "M": 1 << 20}.get(text[-1:], 1)
    return int(float(text.rstrip("KM")) * scale)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="16K", help="bytes per frame (one tensor), e.g. 1K, 16K, 1M")
    ap.add_argument("--rate", type=float, default=12000, help="frames/s the producer is paced at (0: saturated)")
    ap.add_argument("--n", type=int, default=36000, help="frames to send")
    ap.add_argument("--repo", default=str(REPO), help="the checkout whose mia_stream runs (default: this one)")
    ap.add_argument("broker_args", nargs="*", help="extra `mia-stream broker` arguments (after --)")
    a = ap.parse_args(argv)
    size, repo = _size(a.size), os.path.abspath(a.repo)
    bench = os.path.join(repo, "scripts", "bench_bus.py")  # its roles put their own checkout first on sys.path
    env = dict(os.environ, PYTHONPATH=repo)
    run_dir = tempfile.mkdtemp(prefix="mia-bench-cpu-", dir="/tmp")
    broker = subprocess.Popen([sys.executable, "-m", "mia_stream.broker", "--address", run_dir, *a.broker_args],
                              stdout=subprocess.PIPE, text=True, env=env)
    procs = [broker]
    try:
        if "ready" not in broker.stdout.readline():
            raise RuntimeError("broker did not start")
        consumer = subprocess.Popen([sys.executable, bench, "bus-consume", "--address", run_dir, "--n", str(a.n),
                                     "--size", str(size)], stdout=subprocess.PIPE, text=True, env=env)
        procs.append(consumer)
        if "ready" not in consumer.stdout.readline():
            raise RuntimeError("consumer did not start")
        time.sleep(0.5)  # subscribed
        producer = subprocess.Popen([sys.executable, bench, "bus-produce", "--address", run_dir, "--n", str(a.n),
                                     "--size", str(size), "--rate", str(a.rate)], stdout=subprocess.PIPE, text=True,
                                    env=env)
        procs.append(producer)
        roles = {"producer": producer.pid, "broker": broker.pid, "consumer": consumer.pid}
        start = {role: _thread_cpu(pid) for role, pid in roles.items()}
        seen = {role: dict(start[role]) for role in roles}  # a thread that ends keeps its last reading
        while consumer.poll() is None:
            for role, pid in roles.items():
                seen[role].update(_thread_cpu(pid))
            time.sleep(0.05)
        result = json.loads(consumer.stdout.read().strip().splitlines()[-1])
        producer.wait(30)
        got = max(result["received"], 1)
        print(f"{a.size} frames, {a.n} sent at {a.rate:g} f/s ({repo}): received {result['received']}, lost "
              f"{result['lost']}, {result['fps']:.0f} f/s, {result['gbps']:.3f} GB/s")
        for role in roles:
            per_thread = {k: v - start[role].get(k, 0.0) for k, v in seen[role].items()}
            total = sum(per_thread.values())
            detail = ", ".join(f"{k.split(':', 1)[1]} {1e6 * v / got:.1f}" for k, v in sorted(per_thread.items())
                               if v >= 1.0 / _TICK)
            print(f"  {role:9s} {1e6 * total / got:7.1f} us/frame  ({detail})")
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
                p.wait(10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
