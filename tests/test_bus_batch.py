"""Batches (docs/wire-format.md section 8) over real sockets: both hops use them, peers that do not advertise
them get single messages, seq order and gap accounting are unchanged, and the credit window still holds."""

from __future__ import annotations

import json
import signal
import subprocess
import time

import msgpack
import numpy as np
import pytest
import zmq

from bus_helpers import (PY, REPO, account, assert_exact, events_until, processes, publish_stream, run_dir, spawn,
                         start_broker, stats, wait_for)
from mia_stream.bus import transport
from mia_stream.consumers import BrokerClient, open_stream
from mia_stream.bus.publisher import FramePublisher
from mia_stream.schemas import (Heartbeat, SteeringAck, SteeringCommand, StreamEnd, StreamStart, Tensor, TensorFrame,
                                TokenFrame, decode, encode, encode_batch, split_batch)


@pytest.fixture
def broker_dir():
    with run_dir() as d:
        yield d


def _raw_consumer(address: str, name: str, batch: bool) -> zmq.Socket:
    """A DEALER subscribed to everything; ``batch=False`` sends a Subscribe without ``batch`` (as a 1.1 SDK did;
    schema 2.0 keeps the field optional)."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.IDENTITY, name.encode())
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.connect(transport.endpoints_for(address).consumers)
    header = {"v": [2, 0], "kind": "subscribe", "patterns": ["*"], "from_start": False, "consumer_id": name,
              "window_bytes": 0}
    if batch:
        header.update(batch=True)
    sock.send_multipart([b"", msgpack.packb(header)])
    return sock


def _drain_raw(sock: zmq.Socket, ends: int, timeout: float = 20.0) -> tuple[int, dict[str, list]]:
    """(batches received, per request the decoded messages in arrival order) until ``ends`` StreamEnds."""
    batches, streams, deadline = 0, {}, time.monotonic() + timeout
    while ends and time.monotonic() < deadline:
        if not sock.poll(200):
            continue
        frames = sock.recv_multipart()
        messages = split_batch(frames)
        if messages is None:
            messages = [frames]
        else:
            batches += 1
        for m in messages:
            msg = decode(m)
            if isinstance(msg, Heartbeat):
                continue
            streams.setdefault(msg.request_id, []).append(msg)
            ends -= msg.KIND == "end"
    return batches, streams


def _assert_in_order_and_complete(messages: list, last_seq: int) -> None:
    assert [m.seq for m in messages] == list(range(last_seq + 1))


def test_both_hops_batch_and_peers_without_batches_get_single_messages(broker_dir):
    """A new publisher and an old producer (single messages); an old consumer (Subscribe without ``batch``),
    a new raw consumer and the SDK: every consumer gets every message in seq order; only the new ones get
    batches."""
    frames = 3000
    with processes() as procs:
        procs.append(start_broker(broker_dir))
        old = _raw_consumer(broker_dir, "old-consumer", batch=False)
        new = _raw_consumer(broker_dir, "new-consumer", batch=True)
        sdk = open_stream(broker_dir, patterns=("*",), timeout=20, consumer_id="sdk")
        wait_for(lambda: len(stats(broker_dir)["consumers"]) == 3)
        pub = FramePublisher(broker_dir, producer_id="new-producer")
        old_producer = zmq.Context.instance().socket(zmq.DEALER)
        old_producer.setsockopt(zmq.LINGER, 0)
        old_producer.connect(transport.endpoints_for(broker_dir).producers)
        try:
            wait_for(lambda: pub.broker_batches)  # the broker's first heartbeat says it takes batches
            publish_stream(pub, "from-new", frames, 1024, tokens=True)
            old_producer.send_multipart(encode(StreamStart("from-old", "old-producer", 5)))
            for seq in range(1, 200):
                old_producer.send_multipart(encode(TensorFrame("from-old", "old-producer", 5, seq, seq, tensors=[
                    Tensor.from_array("hs", np.full((1, 1, 64), float(seq), np.float32), layers=(0,))])))
            old_producer.send_multipart(encode(StreamEnd("from-old", "old-producer", 5, 200)))
            sdk_got = account(events_until(sdk, 2, 30))
            old_batches, old_got = _drain_raw(old, 2)
            new_batches, new_got = _drain_raw(new, 2)
            st = stats(broker_dir)
        finally:
            pub.close()
            sdk.close()
            for s in (old, new, old_producer):
                s.close(0)
    last_new = 2 * frames + 1
    for got in (old_got, new_got):
        _assert_in_order_and_complete(got["from-new"], last_new)
        _assert_in_order_and_complete(got["from-old"], 200)
    for rec in sdk_got.values():
        assert_exact(rec)
        assert rec["gap_seqs"] == [] and rec["steps"] == sorted(rec["steps"])
    assert old_batches == 0 and new_batches > 0
    assert sdk.client.counters["batches"] > 0
    totals, consumers = st["totals"], st["consumers"]
    assert totals["batches_in"] > 0 and totals["batches_out"] > 0
    assert consumers["old-consumer"]["batch"] is False and consumers["old-consumer"]["batches"] == 0
    assert consumers["new-consumer"]["batches"] == new_batches
    assert st["producers"][f"new-producer/{pub.epoch:x}"]["batches"] > 0
    assert pub.stats()["batches_sent"] > 0
    assert not any(k.startswith(("malformed", "internal")) for k in totals), totals


def test_a_broker_without_batches_gets_single_messages(broker_dir):
    """``--no-batch`` behaves as a 1.1 broker: the publisher never sends it a batch, nothing is refused."""
    with processes() as procs:
        procs.append(start_broker(broker_dir, "--no-batch"))
        pub = FramePublisher(broker_dir, producer_id="to-old-broker")
        try:
            wait_for(lambda: pub.broker_instance is not None)
            with open_stream(broker_dir, patterns=("*",), timeout=20) as events:
                time.sleep(0.3)
                publish_stream(pub, "plain", 2000, 1024, tokens=True)
                rec = account(events_until(events, 1, 30))["plain"]
                client_batches = events.client.counters["batches"]
            st = stats(broker_dir)
        finally:
            pub.close()
    assert_exact(rec)
    assert rec["gap_seqs"] == []
    assert not pub.broker_batches and pub.stats().get("batches_sent", 0) == 0
    assert client_batches == 0
    assert st["broker"]["batch"] is False
    assert not any(k.startswith(("batch", "malformed", "internal")) for k in st["totals"]), st["totals"]


def _publish_burst_then_paced(pub, rid: str, frames: int, nbytes: int) -> None:
    """Half the frames as fast as possible (the publisher's small queue overflows: producer drops), the other
    half at 2500 frames/s (all reach the broker, faster than the slow consumer reads: broker drops). Without
    the paced half, how many frames get past the publisher depends on scheduling, and so would the test."""
    from bus_helpers import payload

    pub.publish(StreamStart(rid, pub.producer_id, pub.epoch, pub.next_seq(rid), prompt_token_ids=[1, 2, 3]))
    t0 = None
    for step in range(frames):
        if step >= frames // 2:
            t0 = t0 or time.monotonic()
            delay = t0 + (step - frames // 2) / 2500 - time.monotonic()
            if delay > 0:
                time.sleep(delay)
        seq = pub.next_seq(rid)
        pub.publish(TensorFrame(rid, pub.producer_id, pub.epoch, seq, step, positions=[step], token_ids=[step],
                                tensors=[Tensor.from_array("hs", payload(seq, nbytes), layers=(0,))]))
        pub.publish(TokenFrame(rid, pub.producer_id, pub.epoch, pub.next_seq(rid), step, token_ids=[step]))
    pub.publish(StreamEnd(rid, pub.producer_id, pub.epoch, pub.next_seq(rid), num_generated_tokens=frames))


def test_gap_accounting_through_batches_is_exact(broker_dir, tmp_path):
    """Publisher drops (its GapNotices travel in batches) and broker drops for a slow consumer: every seq is
    delivered or named once, and the gaps add up to exactly what the publisher and the broker dropped."""
    frames, nbytes = 3000, 4096
    with processes() as procs:
        procs.append(start_broker(broker_dir, "--consumer-queue-bytes", str(256 << 10)))
        outs = [tmp_path / "fast.json", tmp_path / "slow.json"]
        procs.append(spawn("consume", "--address", broker_dir, "--ends", "1", "--timeout", "60",
                           "--out", str(outs[0])))
        procs.append(spawn("consume", "--address", broker_dir, "--ends", "1", "--timeout", "60", "--sleep", "0.002",
                           "--window", str(128 << 10), "--out", str(outs[1])))
        wait_for(lambda: len(stats(broker_dir)["consumers"]) == 2, timeout=15)
        pub = FramePublisher(broker_dir, producer_id="lossy", queue_bytes=256 << 10)
        try:
            wait_for(lambda: pub.broker_batches)
            _publish_burst_then_paced(pub, "lossy", frames, nbytes)
            for p in procs[1:]:
                assert p.wait(90) == 0, p.stderr.read()
            st = stats(broker_dir)
        finally:
            pub.close()
    producer_drops = pub.stats()["dropped"]
    got = [json.loads(o.read_text())["lossy"] for o in outs]
    for rec in got:
        assert_exact(rec)
        assert rec["steps"] == sorted(rec["steps"])
        assert set(rec["gap_reasons"]) <= {"queue_full", "consumer_queue_full"}
    assert producer_drops > 0, "the publisher should have dropped (its queue holds ~60 frames)"
    assert "queue_full" in got[1]["gap_reasons"]
    assert "consumer_queue_full" in got[1]["gap_reasons"], "the slow consumer should have lost frames"
    dropped_by_broker = st["totals"].get("dropped_for_consumers", 0)
    assert sum(len(rec["gap_seqs"]) for rec in got) == 2 * producer_drops + dropped_by_broker
    assert st["totals"]["batches_in"] > 0 and st["totals"]["batches_out"] > 0
    assert pub.stats()["batches_sent"] > 0


def test_batches_respect_the_credit_window(broker_dir, tmp_path):
    window, nbytes = 64 << 10, 4096
    out = tmp_path / "c.json"
    with processes() as procs:
        procs.append(start_broker(broker_dir))
        consumer = spawn("consume", "--address", broker_dir, "--ends", "1", "--timeout", "60", "--sleep", "0.001",
                         "--window", str(window), "--consumer-id", "windowed", "--out", str(out))
        procs.append(consumer)
        wait_for(lambda: len(stats(broker_dir)["consumers"]) == 1, timeout=15)
        pub = FramePublisher(broker_dir, producer_id="windowed")
        try:
            wait_for(lambda: pub.broker_batches)
            publish_stream(pub, "windowed", 1000, nbytes)
            in_flight, batches = [], 0
            while consumer.poll() is None:
                c = stats(broker_dir)["consumers"].get("windowed")
                if c:  # (it is forgotten once it has left)
                    in_flight.append(c["in_flight_bytes"])
                    batches = c["batches"]
                time.sleep(0.01)
            assert consumer.returncode == 0, consumer.stderr.read()
        finally:
            pub.close()
    rec = json.loads(out.read_text())["windowed"]
    assert_exact(rec)
    assert rec["gap_seqs"] == []
    message_bytes = nbytes + 512  # one frame: its tensor plus topic and header
    assert max(in_flight) <= window + message_bytes, max(in_flight)  # a message goes only while below the window
    assert max(in_flight) > window // 2
    assert batches > 0


def test_malformed_batches_are_counted_and_the_good_messages_in_a_batch_still_count(broker_dir):
    with processes() as procs:
        procs.append(start_broker(broker_dir))
        prod = zmq.Context.instance().socket(zmq.DEALER)
        prod.setsockopt(zmq.LINGER, 0)
        prod.connect(transport.endpoints_for(broker_dir).producers)
        try:
            with open_stream(broker_dir, patterns=("mixed",), timeout=10) as events:
                time.sleep(0.3)
                start = encode(StreamStart("mixed", "raw", 3))
                frame = encode(TensorFrame("mixed", "raw", 3, 1, 0, tensors=[
                    Tensor.from_array("hs", np.full((1, 1, 4), 1.0, np.float32), layers=(0,))]))
                end = encode(StreamEnd("mixed", "raw", 3, 2))
                bad_counts = encode_batch([start, frame])
                bad_counts[1] = msgpack.packb({"v": [2, 0], "kind": "batch", "frames": [2, 2]})
                prod.send_multipart(bad_counts)  # a batch whose frames cannot be told apart: dropped whole
                prod.send_multipart(encode_batch([start, [b"mixed\0", b"\xc1 not msgpack"], frame, end]))
                rec = account(events_until(events, 1, 10))["mixed"]
                codes = []
                while prod.poll(1000) and len(codes) < 2:
                    msg = decode(prod.recv_multipart())
                    if not isinstance(msg, Heartbeat):
                        codes.append(msg.code)
            totals = stats(broker_dir)["totals"]
        finally:
            prod.close(0)
    assert_exact(rec)
    assert rec["gap_seqs"] == [] and rec["steps"] == [0]
    assert codes == ["malformed", "malformed"]
    assert totals["malformed_batches"] == 1 and totals["malformed"] == 2 and totals["batches_in"] == 1
    assert totals.get("internal_errors", 0) == 0


def test_steering_ack_inside_a_batch_and_the_rest_of_the_batch_stay_in_order():
    """The client waits for an ack that arrives behind other messages in one batch: it returns the ack, and
    recv() then yields the messages before and after it in their order."""
    with run_dir() as d:
        eps = transport.endpoints_for(d)
        router = zmq.Context.instance().socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        router.bind(eps.consumers)
        client = BrokerClient(d, consumer_id="steerer")
        try:
            client._send(SteeringCommand("warm-up", "r", "clear"))  # lets the router learn the client's identity
            ident = router.recv_multipart()[0]
            frames = [encode(TensorFrame("r", "p", 1, seq, seq)) for seq in (1, 2)]
            ack = encode(SteeringAck("cmd-1", "r", True, applied_step=3))
            router.send_multipart([ident, *encode_batch([frames[0], ack, frames[1]])])
            got_ack = client.send_steering(SteeringCommand("cmd-1", "r", "clear"), timeout=5)
            rest = [client.recv(2)[1] for _ in range(2)]
        finally:
            client.close()
            router.close(0)
    assert got_ack.ok and got_ack.applied_step == 3
    assert [m.seq for m in rest] == [1, 2]
    assert client.counters["batches"] == 1


def test_recorder_writes_one_mcap_message_per_batched_message(broker_dir, tmp_path):
    from mia_stream.consumers.recording import iter_recording

    rec_dir = tmp_path / "rec"
    with processes() as procs:
        procs.append(start_broker(broker_dir))
        recorder = subprocess.Popen([PY, "-m", "mia_stream.cli", "record", str(rec_dir), "--broker", broker_dir],
                                    stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=REPO)
        procs.append(recorder)
        wait_for(lambda: "recorder" in stats(broker_dir)["consumers"], timeout=15)
        pub = FramePublisher(broker_dir, producer_id="recorded")
        try:
            wait_for(lambda: pub.broker_batches)
            publish_stream(pub, "recorded", 2000, 512)
            wait_for(lambda: stats(broker_dir)["consumers"]["recorder"]["delivered"] >= 2002, timeout=30)
            batches = stats(broker_dir)["consumers"]["recorder"]["batches"]
            time.sleep(0.5)
            recorder.send_signal(signal.SIGINT)
            assert recorder.wait(20) == 0, recorder.stderr.read()
        finally:
            pub.close()
    messages = [msg for _, msg in iter_recording(rec_dir, ("recorded",))]
    assert batches > 0
    assert [m.seq for m in messages] == list(range(2002))
    assert [m.KIND for m in messages] == ["start"] + ["tensors"] * 2000 + ["end"]
