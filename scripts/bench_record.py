"""Recorder and replay throughput, measured side by side in one run (output: docs/benchmarks.md).

    .venv/bin/python scripts/bench_record.py [--mib 128] [--dir /tmp]

1. Recorder write rate (MB/s, msgs/s) vs a raw file write of exactly the same bytes, at 16 KiB and 1 MiB
   TensorFrames (bf16 hidden states); both end with flush + fsync so the page cache does not flatter either.
2. Replay read rate at full speed (``iter_recording``: MCAP read + frame split + decode) vs a raw read.
3. One request's messages through the MCAP index (``Recording.messages``) vs a full scan of the recording.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from mia_stream.consumers.recorder import Recorder
from mia_stream.consumers.recording import Recording, iter_recording, pack_frames
from mia_stream.schemas import Tensor, TensorFrame, encode


def _messages(msg_bytes: int, total_bytes: int, requests: int) -> list[list]:
    hidden = 1024
    tokens = max(1, msg_bytes // (2 * hidden))
    bits = np.random.default_rng(0).integers(0, 2**16, size=(1, tokens, hidden), dtype=np.uint16)
    tensor = Tensor(name="hs", dtype="bfloat16", shape=bits.shape, data=memoryview(bits).cast("B"), layers=(0,))
    n = max(requests, total_bytes // msg_bytes)
    return [encode(TensorFrame(f"req-{i % requests}", "bench", 1, i // requests + 1, i // requests,
                               positions=list(range(tokens)), tensors=[tensor])) for i in range(n)]


def _fsync_dir_file(path: Path) -> None:
    for p in (path.glob("*.mcap") if path.is_dir() else [path]):
        fd = os.open(p, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)


def bench_write(tmp: Path, msg_bytes: int, total: int) -> tuple[float, float, int]:
    msgs = _messages(msg_bytes, total, requests=16)
    nbytes = sum(len(pack_frames(m)) for m in msgs)
    raw = tmp / f"raw-{msg_bytes}.bin"
    t0 = time.perf_counter()
    with open(raw, "wb") as f:
        for m in msgs:
            f.write(pack_frames(m))
        f.flush()
        os.fsync(f.fileno())
    t_raw = time.perf_counter() - t0
    rec_dir = tmp / f"rec-{msg_bytes}"
    t0 = time.perf_counter()
    with Recorder(rec_dir) as rec:
        for m in msgs:
            rec.write(m)
    _fsync_dir_file(rec_dir)
    t_rec = time.perf_counter() - t0
    raw.unlink()
    print(f"write {msg_bytes >> 10:>5} KiB x {len(msgs):>5}: raw {nbytes / t_raw / 1e6:7.0f} MB/s "
          f"{len(msgs) / t_raw:8.0f} msg/s | recorder {nbytes / t_rec / 1e6:7.0f} MB/s {len(msgs) / t_rec:8.0f} msg/s"
          f" | recorder/raw {t_raw / t_rec:.2f}")
    return t_raw, t_rec, nbytes


def bench_read(rec_dir: Path, nbytes: int, msg_bytes: int) -> None:
    t0 = time.perf_counter()
    for p in sorted(rec_dir.glob("*.mcap")):
        with open(p, "rb") as f:
            while f.read(16 << 20):
                pass
    t_raw = time.perf_counter() - t0
    t0 = time.perf_counter()
    n = sum(1 for _ in iter_recording(rec_dir))
    t_rep = time.perf_counter() - t0
    print(f"read  {msg_bytes >> 10:>5} KiB x {n:>5}: raw {nbytes / t_raw / 1e6:7.0f} MB/s "
          f"| replay (iter_recording) {nbytes / t_rep / 1e6:7.0f} MB/s {n / t_rep:8.0f} msg/s | replay/raw {t_raw / t_rep:.2f}")


def bench_index(tmp: Path, total: int) -> None:
    requests = 256
    msgs = _messages(16 << 10, total, requests=requests)
    rec_dir = tmp / "rec-index"
    with Recorder(rec_dir, chunk_bytes=1 << 20) as rec:
        for r in range(requests):  # each request's messages together, as when requests finish one by one
            for m in msgs[r::requests]:
                rec.write(m)
    recording = Recording(rec_dir)
    rid = f"req-{requests // 2}"
    t0 = time.perf_counter()
    indexed = recording.messages(rid)
    t_index = time.perf_counter() - t0
    t0 = time.perf_counter()
    scanned = [m for _, m in iter_recording(rec_dir) if m.request_id == rid]
    t_scan = time.perf_counter() - t0
    assert len(indexed) == len(scanned) == len(msgs[requests // 2::requests])
    print(f"one request of {requests} ({len(indexed)} msgs, {len(msgs)} in file): indexed {t_index * 1e3:.1f} ms "
          f"| full scan {t_scan * 1e3:.1f} ms | scan/indexed {t_scan / t_index:.0f}x")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=128, help="bytes written per message size (MiB)")
    ap.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    args = ap.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="bench_record-", dir=args.dir))
    try:
        total = args.mib << 20
        for size in (16 << 10, 1 << 20):
            _, _, nbytes = bench_write(tmp, size, total)
            bench_read(tmp / f"rec-{size}", nbytes, size)
            shutil.rmtree(tmp / f"rec-{size}")
        bench_index(tmp, total)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
