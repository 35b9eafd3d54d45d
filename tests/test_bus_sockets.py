"""Options of every bus socket the library opens (broker, publisher, consumer SDK), read back from the real sockets."""

from __future__ import annotations

import zmq

from bus_helpers import run_dir, wait_for
from mia_stream.broker import run_broker_in_thread
from mia_stream.consumers import BrokerClient
from mia_stream.producer.publisher import FramePublisher


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
