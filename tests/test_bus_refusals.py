"""What the broker refuses, through a real broker process and real sockets (issue 13, items 8-10): references to
a ring its sender does not own (a second peer on the same host forging them), error floods from peers that
never subscribed, and headers every consumer would refuse."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import msgpack
import numpy as np
import pytest
import zmq

from bus_helpers import (RawConsumer, RawProducer, account, assert_exact, events_until, processes, publish_stream,
                         run_dir, start_broker, stats, wait_for)
from mia_stream.bus import transport
from mia_stream.consumers import open_stream
from mia_stream.bus.publisher import FramePublisher
from mia_stream.schemas import ErrorNotice, StreamEnd, StreamStart, Tensor, TensorFrame, decode, encode
from mia_stream.bus.shm_ring import shm_available

TESTS = str(Path(__file__).resolve().parent)

_FORGER = """
import json, sys
sys.path.insert(0, sys.argv[2])
import msgpack, numpy as np
from bus_helpers import RawProducer
from mia_stream.schemas import Heartbeat, StreamStart, Tensor, TensorFrame, encode
address, ring, pos, nbytes = sys.argv[1], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
forger = RawProducer(address, "forger/1")
forger.hello()
forger.send(StreamStart("forged", "forger", 1, 0))
# a tensors header naming the victim's ring, at a position the victim has written but not yet sent
frames = encode(TensorFrame("forged", "forger", 1, 1, 0, tensors=[
    Tensor.from_array("hs", np.zeros((1, 1, nbytes // 4), np.float32))]))
header = msgpack.unpackb(frames[1])
header["shm_ring"], header["tensors"][0]["shm"] = ring, pos
forger.send([frames[0], msgpack.packb(header)])
# then it offers the victim's ring as its own closing ring, with a made-up ownership proof
forger.send(Heartbeat("forger", "producer", 1, 0, {"shm_ring_closed": ring,
                                                   "shm_ring_proof": {"ring": ring, "secret": "ab" * 16}}))
got = forger.poll(3.0)
print(json.dumps([[m.KIND, getattr(m, "code", None), (m.stats or {}).get("shm_ring_taken")
                   if m.KIND == "heartbeat" else None] for m in got]), flush=True)
forger.close()
"""


@pytest.mark.skipif(not shm_available(), reason="needs a writable /dev/shm")
def test_a_second_peer_cannot_get_a_live_producers_ring_removed_or_move_its_received():
    nbytes = 64 << 10
    with run_dir() as d, processes() as procs:
        procs.append(start_broker(d, "--ring-grace", "0.5"))
        with open_stream(d, patterns=("victim-*",), timeout=20, consumer_id="victim-reader") as events:
            wait_for(lambda: len(stats(d)["consumers"]) >= 1, timeout=10)
            pub = FramePublisher(d, producer_id="victim", shm_bytes=16 << 20)
            try:
                wait_for(lambda: pub.broker_shm, timeout=10)
                ring = pub.shm_ring
                publish_stream(pub, "victim-0", frames=5, nbytes=nbytes, end=False)
                assert pub.flush(10)
                wait_for(lambda: ring.received == ring.written, timeout=10)
                pos = ring.put(np.zeros(nbytes, np.uint8))  # written, not (yet) sent: the broker has not received it
                received = ring.received
                assert pos == received and ring.written == received + nbytes
                forger = subprocess.run([sys.executable, "-c", _FORGER, d, TESTS, ring.name, str(pos), str(nbytes)],
                                        capture_output=True, text=True, timeout=60)
                assert forger.returncode == 0, forger.stderr
                replies = json.loads(forger.stdout)
                time.sleep(1.5)  # three grace periods: a taken ring would be gone by now
                assert os.path.exists(ring.path)
                assert ring.received == received  # the forged reference moved nothing
                totals = stats(d)["totals"]
                # the victim goes on; its consumer loses nothing
                for step in range(5, 10):
                    seq = pub.next_seq("victim-0")
                    from bus_helpers import payload

                    pub.publish(TensorFrame("victim-0", "victim", pub.epoch, seq, step, positions=[step],
                                            tensors=[Tensor.from_array("hs", payload(seq, nbytes), layers=(0,))]))
                pub.publish(StreamEnd("victim-0", "victim", pub.epoch, pub.next_seq("victim-0")))
                rec = account(events_until(events, 1, 20))["victim-0"]
            finally:
                pub.close()
    assert totals["shm_ring_not_owned"] == 1 and totals["shm_ring_proof_refused"] == 1
    assert totals["shm_ring_handover_refused"] == 1
    assert "shm_rings_handed_over" not in totals and "shm_rings_removed" not in totals
    assert [r[1] for r in replies if r[0] == "error"] == ["shm_ring_not_owned", "shm_ring_not_owned"]
    assert not any(r[2] for r in replies if r[0] == "heartbeat")  # never told its offer was taken
    assert_exact(rec)
    assert rec["gap_seqs"] == [] and rec["steps"] == list(range(10))


def test_error_notices_to_a_peer_that_never_subscribed_are_rate_limited():
    with run_dir() as d, processes() as procs:
        procs.append(start_broker(d))
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.connect(transport.endpoints_for(d).consumers)
        try:
            t0 = time.monotonic()
            for i in range(1000):
                sock.send_multipart([b"", b"\xc1 not msgpack %d" % i])
            notices, last = 0, t0
            while sock.poll(1500):
                if isinstance(decode(sock.recv_multipart()), ErrorNotice):
                    notices += 1
                    last = time.monotonic()
            wait_for(lambda: stats(d)["totals"].get("malformed_from_consumers", 0) == 1000, timeout=10)
            totals = stats(d)["totals"]
        finally:
            sock.close(0)
    elapsed = last - t0
    assert 20 <= notices <= 20 * (int(elapsed) + 2), (notices, elapsed)  # 20 per second of the broker's clock
    assert totals["error_notices_suppressed"] == 1000 - notices


_VARIANTS = {
    "float nbytes": lambda e, h: e.__setitem__("nbytes", float(e["nbytes"])),
    "float raw_nbytes": lambda e, h: e.__setitem__("raw_nbytes", float(e["raw_nbytes"])),
    "float shape element": lambda e, h: e.__setitem__("shape", [1, 1, 8.0]),
    "str in shape": lambda e, h: e.__setitem__("shape", [1, "1", 8]),
    "bool in shape": lambda e, h: e.__setitem__("shape", [True, 1, 8]),
    "int name": lambda e, h: e.__setitem__("name", 7),
    "str in layers": lambda e, h: e.__setitem__("layers", ["0"]),
    "str step": lambda e, h: h.__setitem__("step", "3"),
}


def test_headers_every_consumer_would_refuse_are_refused_by_the_broker_and_never_forwarded():
    with run_dir() as d, processes() as procs:
        procs.append(start_broker(d))
        consumer = RawConsumer(d, "strict", ["*"])
        prod = RawProducer(d, "sloppy/1")
        try:
            wait_for(lambda: len(stats(d)["consumers"]) == 1, timeout=10)
            prod.hello()
            prod.send(StreamStart("r", "sloppy", 1, 0))
            for seq, mutate in enumerate(_VARIANTS.values(), start=1):
                frames = encode(TensorFrame("r", "sloppy", 1, seq, 3, tensors=[
                    Tensor.from_array("hs", np.ones((1, 1, 8), np.float32))]))
                header = msgpack.unpackb(frames[1])
                mutate(header["tensors"][0], header)
                prod.send([frames[0], msgpack.packb(header), *frames[2:]])
            ones = Tensor.from_array("hs", np.ones((1, 1, 8), np.float32))
            prod.send(TensorFrame("r", "sloppy", 1, 9, 3, tensors=[ones]))
            prod.send(StreamEnd("r", "sloppy", 1, 10))
            consumer.read(10, lambda ms: any(isinstance(m, StreamEnd) for _, m in ms))
            errors = [m for m in prod.poll(2.0) if isinstance(m, ErrorNotice)]
            totals = stats(d)["totals"]
        finally:
            prod.close()
            consumer.close()
    # what reached the consumer decoded (RawConsumer decodes every message): only the valid ones
    assert [(m.KIND, m.seq) for _, m in consumer.messages] == [("start", 0), ("tensors", 9), ("end", 10)]
    assert totals["malformed"] == 8 and totals["malformed_from_producers"] == 8
    assert [e.code for e in errors] == ["malformed"] * 8
