"""CURVE on tcp: authorised peers get the stream; peers with wrong or no keys get nothing."""

from __future__ import annotations

import time

import pytest
import zmq

from bus_helpers import events_until, free_base_port, processes, publish_stream, start_broker, wait_for
from mia_stream.bus import transport
from mia_stream.consumers import BrokerClient, open_stream
from mia_stream.errors import TransportError
from mia_stream.bus.publisher import FramePublisher
from mia_stream.schemas import SteeringCommand, Subscribe, encode
from mia_stream.bus.shm_ring import ShmRingWriter


def test_tcp_requires_curve():
    with pytest.raises(TransportError, match="CURVE"):
        BrokerClient("tcp://127.0.0.1:5999", keys=None)
    with pytest.raises(TransportError, match="CURVE"):
        FramePublisher("tcp://127.0.0.1:5999", keys=None)


def test_curve_tcp_only_authorised_peers_receive(tmp_path):
    keys = tmp_path / "keys"
    assert transport.keys_main([str(keys), "--clients", "producer,consumer,watcher", "--steer", "consumer"]) == 0
    stranger = tmp_path / "stranger"  # a valid key pair the broker never heard of
    transport.create_keys(stranger, clients=("consumer",), steer=())
    address = f"tcp://127.0.0.1:{free_base_port()}"
    with processes() as procs:
        procs.append(start_broker(address, "--keys", str(keys)))
        pub = FramePublisher(address, producer_id="secure", keys=transport.load_client_keys(keys, "producer"))
        good = open_stream(address, patterns=("*",), timeout=5, keys=transport.load_client_keys(keys, "consumer"))
        # wrong keys: a client pair not in authorized/, even with the right server key
        wrong = transport.load_client_keys(stranger, "consumer")
        wrong = transport.ClientKeys(wrong.public, wrong.secret, transport.load_client_keys(keys).server_public)
        bad = BrokerClient(address, keys=wrong)
        bad.subscribe(["*"])
        # no CURVE at all: a plain zmq socket on the tcp port
        ctx = zmq.Context.instance()
        plain = ctx.socket(zmq.DEALER)
        plain.setsockopt(zmq.LINGER, 0)
        plain.connect(transport.endpoints_for(address).consumers)
        plain.send_multipart(encode(Subscribe(["*"])))
        try:
            time.sleep(0.5)
            publish_stream(pub, "secret", 5, 1024)
            kinds = [ev.kind for ev in events_until(good, 1, 10)]
            assert kinds[0] == "start" and kinds.count("frame") == 5 and kinds[-1] == "end"
            assert bad.recv(timeout=1.0) is None
            assert not plain.poll(500)
            # the watcher key may connect but is not in steer/: its commands are refused
            watcher = BrokerClient(address, keys=transport.load_client_keys(keys, "watcher"))
            ack = watcher.send_steering(SteeringCommand("w1", "secret", "clear"), timeout=5)
            assert not ack.ok and ack.error.startswith("not_authorised")
            watcher.close()
            # a tcp producer is never offered shared memory, and a ring reference it forges is refused
            assert pub.broker_instance is not None and not pub.broker_shm
            pub._on_broker_heartbeat = lambda hb: None  # keeps broker_shm as forged below
            pub.shm_ring, pub.broker_shm = ShmRingWriter(size=1 << 20, min_bytes=1024), True
            publish_stream(pub, "forged", 2, 64 << 10)
            got = list(events_until(good, 1, 10))
            assert [e.kind for e in got if e.stream.request_id == "forged"].count("frame") == 0
            wait_for(lambda: pub.counters["broker_error_malformed"] >= 2, timeout=5)
        finally:
            good.close()
            bad.close()
            plain.close()
            pub.close()
