"""The recorder's sustained write rate on this machine's disk (issue 29: >= 1 GB/s on the GPU host's local disk).

    .venv/bin/python scripts/bench_record_rate.py --dir /local/disk/tmp            # both modes, 8B shape
    .venv/bin/python scripts/bench_record_rate.py --mode write --seconds 5 --compression none lz4
    .venv/bin/python scripts/bench_record_rate.py --mode bus --rate 0 --requests 256 --layers 32

Step batches of the 8B shape by default: ``--requests`` decoding requests, each one row of hidden states of all
``--layers`` layers of ``--hidden`` bf16 per step (256 x 32 x 4096 x 2 B = 64 MiB a step), random bits
(incompressible: lz4 gains nothing there; ``--compressible`` repeats each row's first value instead).

``write``: ``Recorder.write`` in this process, fed pre-encoded step batches for ``--seconds``, then close +
fsync; against ``write(2)`` of the same bytes to one file with fsync (the disk's own rate), before and after
the recorder's run (A-B-A). ``bus``: the real
path: a broker process, a ``mia-stream record`` process and a ``FramePublisher`` (shared-memory ring) publishing
step batches at ``--rate`` steps/s (0: as fast as it can) for ``--seconds``; the recording is then read back:
request-steps recorded vs published, gaps by reason (the recorder is lossless at a rate when none are lost),
MB/s of recorded bytes over the publishing time. With ``--budget`` the recorder stops at it with named gaps.
Prints one JSON line per run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from _procs import start_broker, stop_processes  # noqa: E402  (scripts/_procs.py, beside this file)


def _rows(a: argparse.Namespace, rng) -> np.ndarray:
    if a.compressible:
        first = rng.integers(0, 1 << 16, size=(a.layers, a.requests, 1), dtype=np.uint16)
        return np.ascontiguousarray(np.broadcast_to(first, (a.layers, a.requests, a.hidden)))
    return rng.integers(0, 1 << 16, size=(a.layers, a.requests, a.hidden), dtype=np.uint16)


def _step_batch(a: argparse.Namespace, rows: np.ndarray, step: int, seqs, ids, pid="bench", epoch=1):
    from mia_stream.schemas import RowGroup, StepBatch, Tensor

    n = a.requests
    t = Tensor("hs", "bfloat16", (a.layers, n, a.hidden), rows, tuple(range(a.layers)))
    group = RowGroup(list(range(n)), [1] * n, np.full(n, 64 + step, np.int64), [t])
    return StepBatch(pid, epoch, step, ids, seqs, [group], time_ns=time.time_ns())


def _disk_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.glob("part-*.mcap"))


def bench_write(a: argparse.Namespace, tmp: Path, compression: str) -> dict:
    from mia_stream.consumers.recorder import Recorder
    from mia_stream.consumers.recording import pack_frames
    from mia_stream.schemas import encode

    rng = np.random.default_rng(0)
    ids = [f"req-{i:04d}" for i in range(a.requests)]
    pool = [encode(_step_batch(a, _rows(a, rng), s, list(range(1 + s, 1 + s + a.requests)), ids)) for s in range(4)]
    msg_bytes = len(pack_frames(pool[0]))
    rec_dir = tmp / f"rec-{compression}"

    def raw_write() -> float:
        """``write(2)`` of the same bytes to one file for ``--seconds``, then fsync: the disk's own rate (MB/s)."""
        raw = tmp / "raw.bin"
        t0 = time.perf_counter()
        i = 0
        with open(raw, "wb") as f:
            while time.perf_counter() - t0 < a.seconds:
                f.write(pack_frames(pool[i % len(pool)]))
                i += 1
            f.flush()
            os.fsync(f.fileno())
        dt = time.perf_counter() - t0
        raw.unlink()
        return msg_bytes * i / dt / 1e6

    # A-B-A, each for --seconds and fsynced: the disk's own rate before and after the recorder's run (page cache
    # and writeback state drift: one raw run after the recorder read 423 vs 1133 MB/s, the next 1075 vs 977)
    raw_before = raw_write()
    t0 = time.perf_counter()
    n = 0
    with Recorder(rec_dir, compression=compression, budget_bytes=a.budget) as rec:
        while time.perf_counter() - t0 < a.seconds:
            rec.write(pool[n % len(pool)])
            n += 1
    t_rec = time.perf_counter() - t0  # close() fsyncs the part
    disk = _disk_bytes(rec_dir)
    shutil.rmtree(rec_dir)
    raw = [round(raw_before), round(raw_write())]
    rec_rate = msg_bytes * n / t_rec / 1e6
    return {"mode": "write", "compression": compression, "step_mib": round(msg_bytes / 2**20, 2), "steps": n,
            "seconds": round(t_rec, 2), "recorder_MBps": round(rec_rate),
            "disk_MBps_written": round(disk / t_rec / 1e6), "raw_write_MBps_before_after": raw,
            "recorder_vs_raw": [round(rec_rate / r, 3) for r in raw], "budget_dropped": rec.stats.budget_dropped}


def produce(a: argparse.Namespace) -> None:
    from mia_stream.bus.publisher import FramePublisher
    from mia_stream.schemas import StreamEnd, StreamStart

    rng = np.random.default_rng(0)
    pub = FramePublisher(a.address, producer_id="bench-rec", shm_bytes=a.ring_mib << 20)
    deadline = time.monotonic() + 10
    while pub.broker_instance is None and time.monotonic() < deadline:
        time.sleep(0.01)
    ids = [f"req-{i:04d}" for i in range(a.requests)]
    for rid in ids:
        pub.publish(StreamStart(rid, pub.producer_id, pub.epoch, pub.next_seq(rid), num_layers=a.layers,
                                hidden_size=a.hidden, dtype="bfloat16", prompt_token_ids=list(range(64)),
                                capture={"hidden_states": {"layers": "all", "positions": "generated"}}))
    pub.flush(10)
    rows = [_rows(a, rng) for _ in range(2)]
    print("ready", flush=True)
    period = 1.0 / a.rate if a.rate else 0.0
    t0 = time.monotonic()
    step = 0
    while time.monotonic() - t0 < a.seconds:
        if period:
            wait = t0 + step * period - time.monotonic()
            if wait > 0:
                time.sleep(wait)
        seqs = [pub.next_seq(rid) for rid in ids]
        pub.publish(_step_batch(a, rows[step % 2], step, seqs, ids, pub.producer_id, pub.epoch))
        step += 1
    elapsed = time.monotonic() - t0
    for rid in ids:
        pub.publish(StreamEnd(rid, pub.producer_id, pub.epoch, pub.next_seq(rid), "length", 64, step))
    pub.flush(30)
    print(json.dumps({"steps": step, "seconds": elapsed, "dropped_at_source": pub.counters["dropped"]}), flush=True)
    pub.close(5)


def bench_bus(a: argparse.Namespace, tmp: Path, compression: str) -> dict:
    from mia_stream.consumers import open_batches

    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p))
    run_dir = tempfile.mkdtemp(prefix="mia-rec-", dir="/tmp")
    rec_dir = tmp / f"bus-{compression}"
    procs: list[subprocess.Popen] = []
    try:
        procs.append(start_broker(run_dir, env))
        rec_args = [sys.executable, "-m", "mia_stream.cli", "record", str(rec_dir), "--broker", run_dir,
                    "--compression", compression, "--flush-interval", "0.2"]
        if a.budget:
            rec_args += ["--budget-bytes", str(a.budget)]
        recorder = subprocess.Popen(rec_args, env=env, stderr=subprocess.PIPE, text=True)
        procs.append(recorder)
        time.sleep(1.5)  # subscribed
        me = str(Path(__file__).resolve())
        prod = subprocess.Popen([sys.executable, me, "produce", "--address", run_dir, "--seconds", str(a.seconds),
                                 "--rate", str(a.rate), "--requests", str(a.requests), "--layers", str(a.layers),
                                 "--hidden", str(a.hidden), "--ring-mib", str(a.ring_mib)]
                                + (["--compressible"] if a.compressible else []),
                                stdout=subprocess.PIPE, text=True, env=env)
        procs.append(prod)
        if "ready" not in prod.stdout.readline():
            raise RuntimeError("producer did not start")
        out, _ = prod.communicate(timeout=a.seconds + 120)
        produced = json.loads(out.strip().splitlines()[-1])
        time.sleep(2.0)  # the recorder drains what the broker still queues
        recorder.terminate()
        recorder.wait(60)
        stop_processes(procs)
        recorded, gaps = 0, {}
        with open_batches(str(rec_dir)) as events:
            for ev in events:
                if ev.kind == "batch":
                    recorded += len(ev.batch.request_ids)
                elif ev.kind == "gap":
                    gaps[ev.gap.reason] = gaps.get(ev.gap.reason, 0) + ev.gap.count
        disk = _disk_bytes(rec_dir)
        step_bytes = a.requests * a.layers * a.hidden * 2
        return {"mode": "bus", "compression": compression, "rate": a.rate, "step_mib": round(step_bytes / 2**20, 2),
                "steps_published": produced["steps"], "dropped_at_source": produced["dropped_at_source"],
                "request_steps_published": produced["steps"] * a.requests, "request_steps_recorded": recorded,
                "lost_by_reason": gaps, "seconds": round(produced["seconds"], 2),
                "recorded_tensor_MBps": round(recorded / a.requests * step_bytes / produced["seconds"] / 1e6),
                "disk_MB": round(disk / 1e6)}
    finally:
        stop_processes(procs)
        shutil.rmtree(rec_dir, ignore_errors=True)
        shutil.rmtree(run_dir, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("role", nargs="?", default="bench", choices=("bench", "produce"))
    ap.add_argument("--mode", nargs="+", default=["write", "bus"], choices=("write", "bus"))
    ap.add_argument("--compression", nargs="+", default=["none", "lz4"], choices=("none", "lz4"))
    ap.add_argument("--dir", default=None, help="where to write (the disk under test; default a temp dir)")
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--rate", type=float, default=0.0, help="bus: steps/s (0: as fast as the publisher goes)")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--ring-mib", type=int, default=1024, help="bus: the publisher's shared-memory ring")
    ap.add_argument("--budget", type=int, default=0, help="the recorder's byte budget (0: none)")
    ap.add_argument("--compressible", action="store_true")
    ap.add_argument("--address", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.role == "produce":
        produce(a)
        return 0
    tmp = Path(tempfile.mkdtemp(prefix="mia-rec-rate-", dir=a.dir))
    try:
        for mode in a.mode:
            for compression in a.compression:
                r = (bench_write if mode == "write" else bench_bus)(a, tmp, compression)
                print(json.dumps(r), flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
