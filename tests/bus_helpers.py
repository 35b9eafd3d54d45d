"""Helpers for the bus tests: real broker/producer/consumer processes on short ipc run dirs.

Run as a script it is the producer or consumer process of a test:
    python tests/bus_helpers.py produce --address DIR --requests a,b --frames 100 --nbytes 4096
    python tests/bus_helpers.py consume --address DIR --patterns 'a*' --ends 2 --out result.json
"""

from __future__ import annotations

import argparse
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
PY = sys.executable


@contextmanager
def run_dir():
    """A short private dir for ipc sockets (pytest's tmp_path can exceed the 107-byte unix socket limit)."""
    d = tempfile.mkdtemp(prefix="mia-", dir="/tmp")
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("MIA_STREAM_BROKER", None)
    return env


def start_broker(address: str, *args: str, timeout: float = 20.0) -> subprocess.Popen:
    """``mia-stream broker`` as a process; returns once it printed its ready line."""
    proc = subprocess.Popen([PY, "-m", "mia_stream.broker", "--address", address, *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=_env(), text=True)
    try:
        wait_line(proc, "ready", timeout, "broker")
    except RuntimeError:
        kill(proc)
        raise
    return proc


def wait_line(proc: subprocess.Popen, word: str, timeout: float = 30.0, what: str = "process") -> None:
    """Until ``proc`` prints a stdout line holding ``word``; RuntimeError (with its stderr) if it exits first or
    ``timeout`` s pass."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        r, _, _ = select.select([proc.stdout], [], [], 0.1)
        if r and word in proc.stdout.readline():
            return
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}: {proc.stderr.read()}")
    raise RuntimeError(f"{what}: no {word!r} line within {timeout} s")


def kill(proc: subprocess.Popen | None, sig: int = signal.SIGKILL) -> None:
    if proc is not None and proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def free_base_port() -> int:
    """A port p with p, p+1 and p+2 free on loopback (a tcp broker's producers, consumers and stats endpoints)."""
    import socket

    for _ in range(50):
        socks = []
        try:
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
            socks.append(s)
            for i in (1, 2):
                t = socket.socket()
                t.bind(("127.0.0.1", base + i))
                socks.append(t)
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free port triple")


@contextmanager
def processes():
    """Collects Popen objects; stops every one still alive on exit (SIGTERM: a broker then removes the
    shared-memory rings producers handed it, which a SIGKILL would leave in /dev/shm for a later sweep)."""
    procs: list[subprocess.Popen] = []
    try:
        yield procs
    finally:
        for p in procs:
            kill(p, signal.SIGTERM)


def spawn(*args: str) -> subprocess.Popen:
    return subprocess.Popen([PY, str(Path(__file__).resolve()), *args], env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def stats(address: str, timeout: float = 2.0) -> dict:
    from mia_stream.broker import fetch_stats

    return fetch_stats(address, timeout=timeout)


def wait_for(predicate, timeout: float = 10.0, interval: float = 0.05):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"condition not met within {timeout} s (last value {last!r})")


# ---------------------------------------------------------------------------------------------- messages

def payload(seq: int, nbytes: int) -> np.ndarray:
    """A frame's tensor: [1 layer, 1 token, n] float32 filled with its seq, so content is checkable."""
    n = max(1, nbytes // 4)
    return np.full((1, 1, n), float(seq), dtype=np.float32)


def publish_stream(pub, rid: str, frames: int, nbytes: int, rate: float = 0.0, end: bool = True,
                   tp_rank: int = 0, tp_size: int = 1, tokens: bool = False) -> None:
    from mia_stream.schemas import StreamEnd, StreamStart, Tensor, TensorFrame, TokenFrame

    pub.publish(StreamStart(rid, pub.producer_id, pub.epoch, pub.next_seq(rid), tp_rank=tp_rank, tp_size=tp_size,
                            prompt_token_ids=[1, 2, 3], time_ns=time.time_ns()))
    t0 = time.monotonic()
    for step in range(frames):
        seq = pub.next_seq(rid)
        pub.publish(TensorFrame(rid, pub.producer_id, pub.epoch, seq, step, positions=[step], token_ids=[step],
                                tensors=[Tensor.from_array("hs", payload(seq, nbytes), layers=(0,))],
                                time_ns=time.time_ns()))
        if tokens:
            pub.publish(TokenFrame(rid, pub.producer_id, pub.epoch, pub.next_seq(rid), step, token_ids=[step]))
        if rate:
            delay = t0 + (step + 1) / rate - time.monotonic()
            if delay > 0:
                time.sleep(delay)
    if end:
        pub.publish(StreamEnd(rid, pub.producer_id, pub.epoch, pub.next_seq(rid), num_generated_tokens=frames))


def account(events) -> dict:
    """Per request: delivered seqs, gap seqs, steps, end; consumed from an iterator of SDK events."""
    out: dict[str, dict] = {}
    for ev in events:
        rec = out.setdefault(ev.stream.request_id, {"seqs": [], "gap_seqs": [], "gap_reasons": [], "steps": [],
                                                    "ended": False, "finish_reason": None, "bad_content": 0})
        if ev.kind == "start":
            rec["seqs"].append(ev.stream.start.seq)
        elif ev.kind == "frame":
            f = ev.frame.rank_frames[0]
            rec["seqs"].append(f.seq)
            rec["steps"].append(ev.frame.step)
            hs = ev.frame.tensors.get("hs")
            if hs is not None and not np.all(hs == float(f.seq)):
                rec["bad_content"] += 1
        elif ev.kind == "tokens":
            rec["seqs"].append(ev.tokens.seq)
        elif ev.kind == "gap":
            rec["gap_reasons"].append(ev.gap.reason)
            for a, b in ev.gap.missing:
                rec["gap_seqs"].extend(range(a, b + 1))
        elif ev.kind == "end":
            rec["seqs"].append(ev.end.seq)
            rec["ended"] = True
            rec["finish_reason"] = ev.end.finish_reason
            rec["last_seq"] = ev.end.seq
    return out


def events_until(events, ends: int, timeout: float):
    """Yield events until ``ends`` streams ended or ``timeout`` passed."""
    deadline = time.monotonic() + timeout
    seen = 0
    for ev in events:
        yield ev
        if ev.kind == "end":
            seen += 1
            if seen >= ends:
                return
        if time.monotonic() > deadline:
            return


def assert_exact(rec: dict) -> None:
    """Every seq of an ended stream was delivered or named in a gap, exactly once."""
    assert rec["ended"], rec
    delivered, gaps = rec["seqs"], rec["gap_seqs"]
    assert len(set(delivered)) == len(delivered), "a seq was delivered twice"
    assert len(set(gaps)) == len(gaps), "a seq was reported missing twice"
    assert not set(delivered) & set(gaps), "a delivered seq was also reported missing"
    assert sorted(delivered + gaps) == list(range(rec["last_seq"] + 1)), "some seq neither delivered nor reported"
    assert rec["bad_content"] == 0


# ---------------------------------------------------------------------------------------------- CLI

def _produce(args) -> int:
    from mia_stream.bus.publisher import FramePublisher

    pub = FramePublisher(args.address, producer_id=args.producer_id, queue_bytes=args.queue_bytes)
    time.sleep(args.delay)
    for rid in args.requests.split(","):
        publish_stream(pub, rid, args.frames, args.nbytes, rate=args.rate, end=not args.no_end,
                       tokens=args.tokens)
    print(json.dumps({"epoch": pub.epoch, "stats": pub.stats(),
                      "drops": {r: pub.drops_for(r) for r in args.requests.split(",")}}), flush=True)
    if args.hang:
        while True:  # a producer that goes silent: the test kills it with SIGKILL
            time.sleep(1)
    pub.close(timeout=10)
    return 0


def _consume(args) -> int:
    from mia_stream.consumers import open_stream

    stream = open_stream(args.address, patterns=tuple(args.patterns), from_start=args.from_start,
                         timeout=args.timeout, consumer_id=args.consumer_id, window_bytes=args.window)
    print("subscribed", flush=True)

    def slow(events):
        for ev in events:
            if args.sleep and ev.kind == "frame":
                time.sleep(args.sleep)
            yield ev

    rec = account(events_until(slow(stream), args.ends, args.timeout))
    rec["_client"] = dict(stream.client.counters) if stream.client is not None else {}
    stream.close()
    Path(args.out).write_text(json.dumps(rec))
    return 0


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("produce")
    p.add_argument("--address", required=True)
    p.add_argument("--requests", required=True)
    p.add_argument("--producer-id", default=None)
    p.add_argument("--frames", type=int, default=100)
    p.add_argument("--nbytes", type=int, default=4096)
    p.add_argument("--rate", type=float, default=0.0)
    p.add_argument("--delay", type=float, default=0.3)
    p.add_argument("--queue-bytes", type=int, default=256 << 20)
    p.add_argument("--tokens", action="store_true")
    p.add_argument("--no-end", action="store_true")
    p.add_argument("--hang", action="store_true")
    c = sub.add_parser("consume")
    c.add_argument("--address", required=True)
    c.add_argument("--patterns", nargs="+", default=["*"])
    c.add_argument("--ends", type=int, default=1)
    c.add_argument("--timeout", type=float, default=20.0)
    c.add_argument("--from-start", action="store_true")
    c.add_argument("--sleep", type=float, default=0.0)
    c.add_argument("--consumer-id", default=None)
    c.add_argument("--window", type=int, default=64 << 20, help="credit window in bytes")
    c.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    return _produce(args) if args.cmd == "produce" else _consume(args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))


# ---------------------------------------------------------------------------------------------- raw peers

class RawProducer:
    """A producer that is a bare DEALER on the producers endpoint: it sends encoded frames as given, so a test
    does not depend on what ``FramePublisher`` does with a kind (e.g. columnar messages, forged references)."""

    def __init__(self, address: str, identity: str):
        import zmq

        from mia_stream.bus import transport

        self.identity = identity
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDHWM, 0)
        self.sock.setsockopt(zmq.IDENTITY, identity.encode())
        self.sock.connect(transport.endpoints_for(address).producers)
        self.received: list = []

    def send(self, msg, ring=None) -> list:
        from mia_stream.schemas import encode

        frames = msg if isinstance(msg, list) else encode(msg, shm=ring)
        self.sock.send_multipart(frames, copy=False)
        return frames

    def hello(self, ring=None, timeout: float = 10.0) -> None:
        """A heartbeat (with ``ring``'s ownership proof) until the broker answers one."""
        from mia_stream.schemas import Heartbeat

        stats = {"shm_ring_proof": ring.ownership_proof()} if ring is not None else {}  # spec section 9
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.send(Heartbeat(self.identity, "producer", 1, 0, stats))
            if self.poll(0.1, lambda m: m.KIND == "heartbeat"):
                return
        raise AssertionError("the broker never answered")

    def poll(self, timeout: float, until=None) -> list:
        """Decoded messages from the broker for ``timeout`` s (or until one satisfies ``until``)."""
        from mia_stream.schemas import decode

        got, deadline = [], time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.sock.poll(max(1, int((deadline - time.monotonic()) * 1000))):
                break
            msg = decode(self.sock.recv_multipart())
            got.append(msg)
            self.received.append(msg)
            if until is not None and until(msg):
                break
        return got

    def close(self) -> None:
        self.sock.close(0)


class RawConsumer:
    """A consumer that is a bare DEALER: it subscribes with the given options and decodes what it gets (batches
    unpacked, ring payloads read with its own ``ShmRingReader``), keeping the raw frames too."""

    def __init__(self, address: str, name: str, patterns, *, shm: bool = False, window: int = 0,
                 from_start: bool = False, batch: bool = True, schema: tuple[int, int] | None = None):
        """``schema``: the version its subscribe says it speaks (e.g. ``(2, 0)``: it does not know gap_batch)."""
        import msgpack
        import zmq

        from mia_stream.bus import transport
        from mia_stream.schemas import Subscribe, encode
        from mia_stream.bus.shm_ring import ShmRingReader

        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVHWM, 0)
        self.sock.setsockopt(zmq.IDENTITY, name.encode())
        self.sock.connect(transport.endpoints_for(address).consumers)
        self.reader = ShmRingReader()
        subscribe = encode(Subscribe(list(patterns), from_start=from_start, consumer_id=name, window_bytes=window,
                                     batch=batch, shm=shm))
        if schema is not None:
            header = msgpack.unpackb(subscribe[1], raw=False)
            header["v"] = list(schema)
            subscribe[1] = msgpack.packb(header, use_bin_type=True)
        self.sock.send_multipart(subscribe)
        self.messages: list = []  # (frames, decoded), heartbeats left out
        self.batches = 0

    def credit(self, nbytes: int) -> None:
        from mia_stream.schemas import Credit, encode

        self.sock.send_multipart(encode(Credit(nbytes)))

    def read(self, timeout: float, until=None, credit: bool = False) -> list:
        """Receive for ``timeout`` s, or until ``until(messages so far)`` holds; the new (frames, message)s.
        ``credit``: after each zmq message, credit more than can be in flight (the window never stalls)."""
        from mia_stream.schemas import Heartbeat, decode, split_batch

        start, deadline = len(self.messages), time.monotonic() + timeout
        while time.monotonic() < deadline and not (until is not None and until(self.messages)):
            if not self.sock.poll(50):
                continue
            frames = self.sock.recv_multipart(copy=False)
            if credit:
                self.credit(1 << 40)
            parts = split_batch(frames)
            if parts is None:
                parts = [frames]
            else:
                self.batches += 1
            for m in parts:
                msg = decode(m, shm=self.reader)
                if not isinstance(msg, Heartbeat):
                    self.messages.append(([bytes(f.buffer) if hasattr(f, "buffer") else bytes(f) for f in m], msg))
        return self.messages[start:]

    def close(self) -> None:
        self.sock.close(0)
        self.reader.close()
