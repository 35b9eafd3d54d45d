"""Options of every bus socket the library opens (broker, publisher, consumer SDK), read back from the real sockets."""

from __future__ import annotations

import zmq

from bus_helpers import run_dir, wait_for
from mia_stream.broker import run_broker_in_thread
from mia_stream.consumers import BrokerClient
from mia_stream.bus.publisher import FramePublisher


def test_no_zmtp_heartbeats_on_any_bus_socket_and_tcp_keepalive_on(monkeypatch):
    # libzmq 4.3.x aborts the process ("Assertion failed: !_io_error (stream_engine_base.cpp:310)", libzmq
    # issues 3937/4364) when a ZMTP heartbeat timer fires on a connection that already had an I/O error; it
    # killed a vLLM engine under back-pressure on the H200. Liveness is the application heartbeats' job.
    opened: list[zmq.Socket] = []
    real_socket = zmq.Context.socket

    def recording_socket(self, socket_type, *args, **kwargs):
        sock = real_socket(self, socket_type, *args, **kwargs)
        opened.append(sock)
        return sock

    monkeypatch.setattr(zmq.Context, "socket", recording_socket)
    with run_dir() as d, run_broker_in_thread(address=d):
        pub = FramePublisher(d, producer_id="opts")
        client = BrokerClient(d, consumer_id="opts")
        try:
            # broker: producers + consumers ROUTERs; publisher DEALER; client DEALER
            wait_for(lambda: len([s for s in opened if s.type in (zmq.ROUTER, zmq.DEALER)]) >= 4, timeout=5)
            bus = [s for s in opened if s.type in (zmq.ROUTER, zmq.DEALER)]
            assert len(bus) >= 4
            for s in bus:
                assert s.getsockopt(zmq.HEARTBEAT_IVL) == 0
                assert s.getsockopt(zmq.TCP_KEEPALIVE) == 1 and s.getsockopt(zmq.TCP_KEEPALIVE_IDLE) > 0
                assert s.getsockopt(zmq.LINGER) == 0
        finally:
            client.close()
            pub.close()


_TAIL_PRODUCER = """
import sys, time
sys.path.insert(0, sys.argv[2])
from bus_helpers import publish_stream
from mia_stream.bus.publisher import FramePublisher
pub = FramePublisher(sys.argv[1], producer_id="tail")
deadline = time.monotonic() + 20
while not pub.broker_batches and time.monotonic() < deadline:  # handshaken, and the broker's heartbeat is in
    time.sleep(0.01)
print("connected" if pub.broker_batches else "no broker heartbeat", flush=True)
sys.stdin.readline()  # the test has frozen the broker
publish_stream(pub, "tail-0", frames=60, nbytes=512)
pub.close(2.0)  # everything is in the kernel's socket buffer now; the process exits
print("closed", flush=True)
"""


def _stream_past_a_frozen_broker(script: str, pattern: str, *broker_args: str) -> tuple[str, str, list]:
    """Run ``script`` as a producer process that connects, waits for "go", streams and exits while the
    broker is stopped (SIGSTOP), then resume the broker. Returns the producer's last stdout line, its
    stderr and the events a consumer got up to the stream's end (or 15 s without any)."""
    import signal
    import subprocess
    import sys
    from pathlib import Path

    from bus_helpers import processes, start_broker, stats
    from mia_stream.consumers import open_stream

    tests_dir = str(Path(__file__).resolve().parent)
    with run_dir() as d, processes() as procs:
        broker = start_broker(d, *broker_args)
        procs.append(broker)
        with open_stream(d, patterns=(pattern,), timeout=15) as events:
            wait_for(lambda: any(c.get("patterns") for c in stats(d)["consumers"].values()), timeout=10)
            prod = subprocess.Popen([sys.executable, "-c", script, d, tests_dir], stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            procs.append(prod)
            assert prod.stdout.readline().strip() == "connected"
            broker.send_signal(signal.SIGSTOP)  # the broker reads nothing while the producer sends and exits
            try:
                prod.stdin.write("go\n")
                prod.stdin.flush()
                last_line = prod.stdout.readline().strip()
                assert prod.wait(10) == 0
            finally:
                broker.send_signal(signal.SIGCONT)
            got = []
            for ev in events:
                got.append(ev)
                if ev.kind == "end":
                    break
    return last_line, prod.stderr.read(), got


def test_a_producer_that_exits_right_after_its_stream_loses_nothing():
    # The producer's last messages and its StreamEnd can still be unread in the broker's zmq pipe when the
    # broker learns that the producer disconnected: with LINGER 0 libzmq then discards them (silently).
    last_line, _, got = _stream_past_a_frozen_broker(_TAIL_PRODUCER, "tail-*")
    assert last_line == "closed"
    kinds = [e.kind for e in got]
    assert kinds[0] == "start" and kinds[-1] == "end", kinds[-3:]
    assert [e.frame.step for e in got if e.kind == "frame"] == list(range(60))
    assert not [e for e in got if e.kind == "gap"]


_FLOOD_PRODUCER = """
import sys, time
sys.path.insert(0, sys.argv[2])
from bus_helpers import payload
from mia_stream.bus.publisher import FramePublisher
from mia_stream.schemas import StreamEnd, StreamStart, Tensor, TensorFrame
pub = FramePublisher(sys.argv[1], producer_id="flood", shm_bytes=0)  # every byte through the socket
deadline = time.monotonic() + 20
while not pub.broker_batches and time.monotonic() < deadline:
    time.sleep(0.01)
rid = "flood-0"

def frame(step, nbytes):
    seq = pub.next_seq(rid)
    return TensorFrame(rid, pub.producer_id, pub.epoch, seq, step, positions=[step], token_ids=[step],
                       tensors=[Tensor.from_array("hs", payload(seq, nbytes), layers=(0,))])

pub.publish(StreamStart(rid, pub.producer_id, pub.epoch, pub.next_seq(rid), prompt_token_ids=[1, 2, 3]))
for step in range(4):
    pub.publish(frame(step, 512))
pub.flush(5)
time.sleep(0.5)  # the broker has these
print("connected", flush=True)
sys.stdin.readline()  # the test has frozen the broker
for step in range(4, 64):  # 15 MiB: far more than the kernel's socket buffer holds for a reader that is stopped
    pub.publish(frame(step, 256 << 10))
pub.publish(StreamEnd(rid, pub.producer_id, pub.epoch, pub.next_seq(rid), num_generated_tokens=64))
pub.close(0.5)
print(pub.counters["close_linger_expired"], flush=True)
"""


def test_a_producer_that_exits_before_a_frozen_broker_read_its_stream_is_reported_not_silent():
    # What zmq still held when close()'s linger ran out is gone with the process: the publisher says so (a
    # counter and a warning), and the broker ends the stream as producer_lost after what it did receive.
    expired, stderr, got = _stream_past_a_frozen_broker(_FLOOD_PRODUCER, "flood-*", "--producer-timeout", "2")
    assert expired == "1"
    assert "did not take all sent messages" in stderr
    steps = [e.frame.step for e in got if e.kind == "frame"]
    assert got[0].kind == "start" and got[-1].kind == "end", [e.kind for e in got[-3:]]
    assert got[-1].end.finish_reason == "producer_lost"
    assert len(steps) < 64 and steps == list(range(len(steps)))  # what arrived is a prefix, in order
