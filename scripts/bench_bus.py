"""Bus benchmark: raw pyzmq PUSH/PULL over ipc vs FramePublisher -> broker -> consumer SDK, side by side.

    .venv/bin/python scripts/bench_bus.py [--quick] [--unbatched] [--no-shm] [--lossless] [--sizes 16K,1M]
                                          [--no-paced] [--repeat N]

Every leg is its own process (sender, broker, receiver). For each frame size it prints GB/s, frames/s,
p50/p99 latency from send to the consumer callback, frames lost and the seqs the consumer was told were
lost (gaps: a saturated broker drops for a slow consumer, never silently, so lost == gaps), and the
bus/raw ratios; then a run paced at ~70% of the bus rate measured (the lossless one where the saturated run
lost frames), which must lose nothing (a paced producer publishes what fell due each millisecond, as an
engine publishes a step's frames together).
``--repeat N`` runs each size N times (raw, then the bus rows) and prints each row's median over the rounds.
``--unbatched`` adds, in the same run, the bus through a second broker started with ``--no-batch`` (every
message its own zmq message on both hops, as before batches); ``--no-shm`` adds the bus through a broker
started with ``--no-shm`` (every tensor byte through the broker's sockets, as before shared-memory payloads:
with a ring, tensors of 16 KiB and more go producer -> /dev/shm ring -> consumer and the broker moves only
headers). Latency uses CLOCK_MONOTONIC, which is shared
by every process of the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
PY = sys.executable
# A paced producer publishes what fell due every millisecond, as an engine publishes a step's frames together
# (with a sleep per frame, 16 KiB frames went one per zmq message and the lossless rate was about half)
PACE_TICK_S = 0.001
SIZES = [(1 << 10, "1 KiB", 40_000), (16 << 10, "16 KiB", 20_000), (1 << 20, "1 MiB", 1_500), (8 << 20, "8 MiB", 200)]


# ---------------------------------------------------------------------------------------------- roles

def _summary(latencies_ns: list[int], received: int, t_first: int, t_last: int, size: int, sent: int) -> dict:
    lat = np.array(latencies_ns, dtype=np.float64) / 1e3 if latencies_ns else np.zeros(1)
    span = max(t_last - t_first, 1) / 1e9
    n = max(received - 1, 1)  # throughput over the intervals between the first and the last frame
    return {"received": received, "lost": sent - received, "gbps": n * size / span / 1e9, "fps": n / span,
            "p50_us": float(np.percentile(lat, 50)), "p99_us": float(np.percentile(lat, 99))}


def role_raw_recv(a) -> None:
    import zmq

    ctx = zmq.Context()
    s = ctx.socket(zmq.PULL)
    s.setsockopt(zmq.RCVHWM, 1000)
    s.bind(a.endpoint)
    print("ready", flush=True)
    lat, t_first, t_last, got = [], 0, 0, 0
    while got < a.n:
        if not s.poll(10_000):
            break
        parts = s.recv_multipart(copy=False)
        now = time.monotonic_ns()
        (t_sent,) = struct.unpack("q", parts[0].bytes)
        lat.append(now - t_sent)
        t_first = t_first or now
        t_last = now
        got += 1
    print(json.dumps(_summary(lat, got, t_first, t_last, a.size, a.n)), flush=True)


def role_raw_send(a) -> None:
    import zmq

    ctx = zmq.Context()
    s = ctx.socket(zmq.PUSH)
    s.setsockopt(zmq.SNDHWM, 1000)
    s.connect(a.endpoint)
    buf = np.ones(a.size, dtype=np.uint8)
    time.sleep(0.3)
    for _ in range(a.n):
        s.send_multipart([struct.pack("q", time.monotonic_ns()), buf], copy=False)
    s.close(linger=30_000)
    ctx.term()


def role_bus_consume(a) -> None:
    from mia_stream.consumers import Consumer, run_consumer

    class Meter(Consumer):
        patterns = ("bench-*",)

        def __init__(self):
            self.lat, self.t_first, self.t_last, self.got, self.gaps = [], 0, 0, 0, 0

        def on_frame(self, stream, frame):
            now = time.monotonic_ns()
            self.lat.append(now - frame.time_ns)
            self.t_first = self.t_first or now
            self.t_last = now
            self.got += 1

        def on_gap(self, stream, gap):
            self.gaps += gap.count

    m = Meter()
    print("ready", flush=True)
    run_consumer(m, a.address, max_streams=1, idle_timeout=15)
    out = _summary(m.lat, m.got, m.t_first, m.t_last, a.size, a.n)
    out["gaps_reported"] = m.gaps
    print(json.dumps(out), flush=True)


def role_bus_produce(a) -> None:
    from mia_stream.bus.publisher import FramePublisher
    from mia_stream.schemas import StreamEnd, StreamStart, Tensor, TensorFrame

    pub = FramePublisher(a.address, producer_id="bench")
    time.sleep(0.3)
    rid = "bench-1"
    tensor = Tensor.from_array("hs", np.ones((1, 1, a.size), dtype=np.uint8))
    pub.publish(StreamStart(rid, pub.producer_id, pub.epoch, pub.next_seq(rid)))
    high = pub.queue_bytes // 2
    ring_high = pub.shm_ahead_bytes // 2 if pub.shm_ring is not None and pub.broker_shm_received else 0
    t0 = time.monotonic()
    for step in range(a.n):
        if a.rate:
            delay = t0 + step / a.rate - time.monotonic()
            if delay > 0:  # ahead of the schedule: sleep at least a tick, then send what fell due together
                time.sleep(max(delay, PACE_TICK_S))
        else:
            # saturation run: a producer that yields instead of dropping (half the queue, or half the ring
            # bytes it may run ahead of the broker, is still backlog; shorter naps only burn the shared CPU)
            while pub._queued > high or (ring_high and pub._ring_ahead(pub.shm_ring) > ring_high):
                time.sleep(0.002)
        pub.publish(TensorFrame(rid, pub.producer_id, pub.epoch, pub.next_seq(rid), step, tensors=[tensor],
                                time_ns=time.monotonic_ns()))
    pub.publish(StreamEnd(rid, pub.producer_id, pub.epoch, pub.next_seq(rid)))
    pub.close(timeout=30)
    print(json.dumps({"dropped_by_publisher": pub.stats().get("dropped", 0)}), flush=True)


# ---------------------------------------------------------------------------------------------- runs

def _spawn(*args: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.Popen([PY, __file__, *args], stdout=subprocess.PIPE, text=True, env=env)


def _variant_row(title: str, res: dict, raw: dict) -> None:
    """One more bus row under a size's main row, its ratio against that size's raw run."""
    print(f"{'':>7} | {title:>37} | {res['gbps']:8.3f} {res['fps']:9.0f} {res['p50_us']:7.0f}u "
          f"{res['p99_us']:7.0f}u {res['lost']:5d} {res['gaps_reported']:5d} | {res['gbps'] / raw['gbps']:5.2f}",
          flush=True)


def _lossless_row(run_dir: str, size: int, n: int, saturated: dict, raw: dict, title: str) -> dict:
    rate, res = run_lossless(run_dir, size, n, max(saturated["fps"], raw["fps"]))
    if not rate:  # no rate tried lost nothing: print zeros, not the last lossy run's rate
        res = dict(res, gbps=0.0, fps=0)
    _variant_row(title, res, raw)  # what the consumer measured (a producer may not reach its target)
    return res


def _wait_ready(p: subprocess.Popen) -> None:
    line = p.stdout.readline()
    if "ready" not in line:
        raise RuntimeError(f"child did not start: {line!r}")


def _result(p: subprocess.Popen, timeout: float = 120) -> dict:
    out, _ = p.communicate(timeout=timeout)
    return json.loads(out.strip().splitlines()[-1])


def run_raw(run_dir: str, size: int, n: int) -> dict:
    ep = f"ipc://{run_dir}/raw.sock"
    recv = _spawn("raw-recv", "--endpoint", ep, "--n", str(n), "--size", str(size))
    _wait_ready(recv)
    send = _spawn("raw-send", "--endpoint", ep, "--n", str(n), "--size", str(size))
    res = _result(recv)
    send.wait(60)
    return res


def run_bus(run_dir: str, size: int, n: int, rate: float = 0.0) -> dict:
    cons = _spawn("bus-consume", "--address", run_dir, "--n", str(n), "--size", str(size))
    _wait_ready(cons)
    time.sleep(0.5)  # let it subscribe
    prod = _spawn("bus-produce", "--address", run_dir, "--n", str(n), "--size", str(size), "--rate", str(rate))
    res = _result(cons)
    res.update(_result(prod))
    return res


def run_lossless(run_dir: str, size: int, n: int, start_fps: float) -> tuple[float, dict]:
    """The highest rate, stepping down from ``start_fps``, at which the bus delivered every frame.

    A saturated run with shared memory measures a producer that outruns its consumer (the engine never
    waits: the broker drops what the consumer cannot take, and says so), not what the bus sustains; raw
    PUSH/PULL instead blocks its sender. This is the bus's number to hold against raw's throughput."""
    rate = start_fps
    for _ in range(8):
        res = run_bus(run_dir, size, max(100, min(2 * n, int(rate * 2.0))), rate=rate)
        if res["lost"] == 0 and res["dropped_by_publisher"] == 0:
            return rate, res
        rate *= 0.85
    return 0.0, res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="fewer frames per size")
    ap.add_argument("--unbatched", action="store_true",
                    help="also run the bus through a --no-batch broker (batching off on both hops)")
    ap.add_argument("--lossless", action="store_true",
                    help="for every bus row, also the highest paced rate (from raw's down, x0.8) that loses nothing "
                         "(always done for a row that lost frames)")
    ap.add_argument("--no-shm", action="store_true",
                    help="also run the bus through a --no-shm broker (every tensor byte through the broker)")
    ap.add_argument("--sizes", help="comma-separated subset of the frame sizes to run, e.g. 16K,1M (default: all)")
    ap.add_argument("--no-paced", action="store_true", help="skip the runs paced at ~70%% of saturation")
    ap.add_argument("--repeat", type=int, default=1,
                    help="rounds per size (raw, then the bus rows), with a summary of each row's median")
    args = ap.parse_args(argv)
    sizes = SIZES
    if args.sizes:
        wanted = {w.strip().upper().replace("KIB", "K").replace("MIB", "M") for w in args.sizes.split(",")}
        sizes = [s for s in SIZES if s[1].upper().replace(" KIB", "K").replace(" MIB", "M") in wanted]
        if len(sizes) != len(wanted):
            ap.error(f"--sizes: choose from {', '.join(s[1] for s in SIZES)} (as 1K, 16K, 1M, 8M)")
    run_dir = tempfile.mkdtemp(prefix="mia-bench-", dir="/tmp")
    unbatched_dir = os.path.join(run_dir, "unbatched")
    no_shm_dir = os.path.join(run_dir, "no-shm")
    env = dict(os.environ, PYTHONPATH=str(REPO))
    variants = ([(run_dir, [])] + ([(unbatched_dir, ["--no-batch"])] if args.unbatched else [])
                + ([(no_shm_dir, ["--no-shm"])] if args.no_shm else []))
    brokers = [subprocess.Popen([PY, "-m", "mia_stream.broker", "--address", d, *extra], stdout=subprocess.PIPE,
                                text=True, env=env)
               for d, extra in variants]
    rows = []
    t_start = time.monotonic()
    try:
        if not all("ready" in b.stdout.readline() for b in brokers):
            raise RuntimeError("broker did not start")
        print(f"bus benchmark, {time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} CPUs, load average "
              f"{os.getloadavg()[0]:.1f}, ipc, one frame = one TensorFrame with one tensor of the size shown")
        head = (f"{'size':>7} | {'raw GB/s':>8} {'raw f/s':>9} {'raw p50':>8} {'raw p99':>8} | {'bus GB/s':>8} "
                f"{'bus f/s':>9} {'bus p50':>8} {'bus p99':>8} {'lost':>5} {'gaps':>5} | {'ratio':>5}")
        print(head)
        print("-" * len(head))
        medians: dict[str, dict[str, list[float]]] = {}  # size -> row -> GB/s of each round
        for size, label, n in sizes:
            n = max(50, n // 4) if args.quick else n
            got = medians.setdefault(label, {})
            for _ in range(args.repeat):
                raw = run_raw(run_dir, size, n)
                bus = run_bus(run_dir, size, n)
                ratio = bus["gbps"] / raw["gbps"]
                print(f"{label:>7} | {raw['gbps']:8.3f} {raw['fps']:9.0f} {raw['p50_us']:7.0f}u {raw['p99_us']:7.0f}u | "
                      f"{bus['gbps']:8.3f} {bus['fps']:9.0f} {bus['p50_us']:7.0f}u {bus['p99_us']:7.0f}u "
                      f"{bus['lost']:5d} {bus['gaps_reported']:5d} | {ratio:5.2f}", flush=True)
                got.setdefault("raw", []).append(raw["gbps"])
                got.setdefault("bus saturated", []).append(bus["gbps"])
                sustained = bus  # the paced run below goes at 70% of the rate the bus held without loss
                if bus["lost"] or args.lossless:
                    lossless = _lossless_row(run_dir, size, n, bus, raw, "lossless (paced, stepped down):")
                    got.setdefault("bus lossless", []).append(lossless["gbps"])
                    if bus["lost"]:  # a consumer that skips frames it lost is not a rate it sustains
                        sustained = lossless
                rows.append((label, size, raw, sustained, ratio))
                if args.unbatched:
                    unbatched = run_bus(unbatched_dir, size, n)
                    _variant_row("unbatched (--no-batch broker):", unbatched, raw)
                    got.setdefault("unbatched", []).append(unbatched["gbps"])
                if args.no_shm:
                    plain = run_bus(no_shm_dir, size, n)
                    _variant_row("no shared memory (--no-shm broker):", plain, raw)
                    got.setdefault("--no-shm saturated", []).append(plain["gbps"])
                    if plain["lost"] or args.lossless:
                        got.setdefault("--no-shm lossless", []).append(
                            _lossless_row(no_shm_dir, size, n, plain, raw, "--no-shm lossless (paced):")["gbps"])
        if args.repeat > 1:  # raw alone moves up to 2x between runs: medians of interleaved rounds are steadier
            print(f"\nmedians of {args.repeat} interleaved rounds, GB/s (ratio: that median / raw's median):")
            for label, got in medians.items():
                raw_median = statistics.median(got["raw"])
                cells = [f"{name} {statistics.median(v):.3f} ({statistics.median(v) / raw_median:.2f})"
                         for name, v in got.items() if name != "raw" and len(v) == args.repeat]
                print(f"{label:>7} | raw {raw_median:.3f} | " + " | ".join(cells), flush=True)
        # the last round of each size sets its paced rate
        paced_rows = [] if args.no_paced else list({r[0]: r for r in rows if r[1] in (16 << 10, 1 << 20)}.values())
        if paced_rows:
            print()
            print("paced at ~70% of the bus rate measured above (the lossless one where the saturated run lost "
                  "frames; must lose nothing):")
        for label, size, _raw, bus, _ in paced_rows:
            rate = 0.7 * bus["fps"]
            n = int(min(rate * 2.0, 20_000))
            paced = run_bus(run_dir, size, n, rate=rate)
            print(f"{label:>7} at {rate:8.0f} f/s ({rate * size / 1e9:.3f} GB/s): received {paced['received']}/{n}, "
                  f"lost {paced['lost']}, gaps reported {paced['gaps_reported']}, publisher drops "
                  f"{paced['dropped_by_publisher']}, p50 {paced['p50_us']:.0f} us, p99 {paced['p99_us']:.0f} us",
                  flush=True)
        print(f"\ntotal {time.monotonic() - t_start:.0f} s, load average {os.getloadavg()[0]:.1f} at the end")
    finally:
        for b in brokers:
            b.terminate()
            b.wait(10)
        shutil.rmtree(run_dir, ignore_errors=True)
    if args.sizes:  # a partial run (for quick comparisons) skips the recorder's benchmark
        return 0
    try:
        sys.path.insert(0, str(REPO / "scripts"))
        import bench_record  # written by the recorder helper; optional
    except ImportError:
        bench_record = None
    if bench_record is not None and hasattr(bench_record, "main"):
        print("\n--- scripts/bench_record.py ---", flush=True)
        sys.argv = [str(REPO / "scripts" / "bench_record.py")]  # its own defaults, not our flags
        bench_record.main()
    return 0


if __name__ == "__main__":
    import faulthandler
    import signal

    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 PID` dumps a stuck child's stacks
    if len(sys.argv) > 1 and sys.argv[1] in ("raw-recv", "raw-send", "bus-consume", "bus-produce"):
        ap = argparse.ArgumentParser()
        ap.add_argument("role")
        ap.add_argument("--endpoint")
        ap.add_argument("--address")
        ap.add_argument("--n", type=int)
        ap.add_argument("--size", type=int)
        ap.add_argument("--rate", type=float, default=0.0)
        a = ap.parse_args()
        {"raw-recv": role_raw_recv, "raw-send": role_raw_send, "bus-consume": role_bus_consume,
         "bus-produce": role_bus_produce}[a.role](a)
        sys.exit(0)
    sys.exit(main())
