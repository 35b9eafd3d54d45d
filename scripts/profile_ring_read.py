"""Where a consumer's time goes when it reads ring-held step batches (issue 29: the zero-copy host path).

    .venv/bin/python scripts/profile_ring_read.py --pyspy /path/to/py-spy [--requests 64 --layers 30 --hidden 576]
    .venv/bin/python scripts/profile_ring_read.py --pyspy ... --work raw --select '{"layers": [15]}'

A broker process, a producer process publishing all-layer step batches through its shared-memory ring
(``bench_record_rate.py produce``: ``--requests`` rows of ``--layers`` x ``--hidden`` bf16 per step, at ``--rate``
steps/s) and a consumer process (``open_batches``, each step's hidden states read as numpy and reduced, what a
vectorized analyzer does). py-spy samples the consumer for ``--seconds``; the script prints the share of its
samples in each stage: the copy out of the ring (``ShmRingReader.read`` / ``gather``), the rest of decoding,
the batch assembly, the consumer's own work, waiting for the socket; the top functions by own samples; and
``busy_s``, the consumer's sampled CPU seconds (py-spy leaves idle samples out). ``--select``: the consumer
subscribes with that selection (issue 29), so the broker cuts each step to it.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from _procs import start_broker, stop_processes  # noqa: E402  (scripts/_procs.py, beside this file)

# stage -> substrings of a frame ("function (file:line)") that put a sample in it; the first match wins, innermost
# frame first, so a copy inside decode counts as the copy
STAGES = [("ring copy", ("read (mia_stream/bus/shm_ring.py", "gather (mia_stream/bus/shm_ring.py")),
          ("wait for the socket", ("poll (zmq", "_recv_raw", "recv_multipart")),
          ("consumer work", ("consumer_work",)),
          ("decode", ("mia_stream/schemas/",)),
          ("assemble / SDK", ("mia_stream/consumers/", "mia_stream/bus/client.py"))]


def consume(a: argparse.Namespace) -> None:
    import numpy as np

    from mia_stream.consumers import open_batches

    def consumer_work(batch) -> float:
        total = 0.0
        for g in batch.groups:
            if g.has("hs"):
                t = g.tensor("hs")
                total += float(np.abs(t.numpy()).mean() if a.work == "widen" else t.raw()[..., :1].sum())
        return total

    print("ready", flush=True)
    steps = 0
    with open_batches(a.address, timeout=a.idle, select=json.loads(a.select) if a.select else None) as events:
        for ev in events:
            if ev.kind == "batch" and ev.batch.KIND == "step_batch":
                consumer_work(ev.batch)
                steps += 1
    print(json.dumps({"steps": steps}), flush=True)


def stage_of(stack: list[str]) -> str:
    for frame in reversed(stack):  # innermost first
        for stage, marks in STAGES:
            if any(m in frame for m in marks):
                return stage
    return "other"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("role", nargs="?", default="run", choices=("run", "consume"))
    ap.add_argument("--pyspy", default="py-spy")
    ap.add_argument("--seconds", type=float, default=6.0)
    ap.add_argument("--rate", type=float, default=50.0)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--hidden", type=int, default=576)
    ap.add_argument("--ring-mib", type=int, default=512)
    ap.add_argument("--idle", type=float, default=3.0)
    ap.add_argument("--work", default="widen", choices=("widen", "raw"),
                    help="the consumer's work: widen bf16 to float32 and reduce, or touch the raw bits only")
    ap.add_argument("--select", default="", help='the consumer\'s Subscribe.select as JSON, e.g. {"layers": [15]}')
    ap.add_argument("--address")
    a = ap.parse_args()
    if a.role == "consume":
        consume(a)
        return 0
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p))
    run_dir = tempfile.mkdtemp(prefix="mia-prof-", dir="/tmp")
    out = Path(tempfile.mkdtemp(prefix="mia-prof-out-")) / "consumer.txt"
    procs = []
    try:
        procs.append(start_broker(run_dir, env))
        cons = subprocess.Popen([sys.executable, __file__, "consume", "--address", run_dir, "--idle", str(a.idle),
                                 "--work", a.work, "--select", a.select],
                                stdout=subprocess.PIPE, text=True, env=env)
        procs.append(cons)
        assert "ready" in cons.stdout.readline()
        time.sleep(1.0)
        prod = subprocess.Popen([sys.executable, str(REPO / "scripts" / "bench_record_rate.py"), "produce",
                                 "--address", run_dir, "--seconds", str(a.seconds + 2), "--rate", str(a.rate),
                                 "--requests", str(a.requests), "--layers", str(a.layers), "--hidden", str(a.hidden),
                                 "--ring-mib", str(a.ring_mib)], stdout=subprocess.PIPE, text=True, env=env)
        procs.append(prod)
        assert "ready" in prod.stdout.readline()
        time.sleep(1.0)
        subprocess.run([a.pyspy, "record", "--format", "raw", "-o", str(out), "--pid", str(cons.pid),
                        "-d", str(int(a.seconds)), "-r", "200"], capture_output=True)
        produced = json.loads(prod.communicate(timeout=120)[0].strip().splitlines()[-1])
        consumed = json.loads(cons.communicate(timeout=120)[0].strip().splitlines()[-1])
    finally:
        stop_processes(procs)
    stages: collections.Counter = collections.Counter()
    own: collections.Counter = collections.Counter()
    for line in out.read_text().splitlines():
        stack_text, _, count = line.rpartition(" ")
        stack = stack_text.split(";")
        stages[stage_of(stack)] += int(count)
        own[stack[-1]] += int(count)
    total = sum(stages.values()) or 1
    step_mib = a.requests * a.layers * a.hidden * 2 / 2**20
    print(json.dumps({"step_mib": round(step_mib, 2), "work": a.work, "select": a.select, "busy_s": round(total / 200, 2), "produced": produced, "consumed": consumed,
                      "samples": total, "stage_share": {k: round(v / total, 3) for k, v in stages.most_common()},
                      "top_own": [(f, round(n / total, 3)) for f, n in own.most_common(6)]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
