"""Steering routing: consumer -> broker -> the request's producer -> ack back to the sender."""

from __future__ import annotations

import uuid

import pytest

from bus_helpers import processes, run_dir, start_broker, stats, wait_for
from mia_stream.consumers import BrokerClient, Consumer
from mia_stream.errors import SteeringCommandError
from mia_stream.bus.publisher import FramePublisher
from mia_stream.schemas import SteeringAck, SteeringCommand, StreamStart


class _Engine:
    """Stands in for the producer's engine loop: applies each command and acks it."""

    def __init__(self, address, producer_id="engine", refuse=False):
        self.received: list[SteeringCommand] = []
        self.refuse = refuse
        self.pub = FramePublisher(address, producer_id=producer_id, on_steering=self._on_steering)

    def _on_steering(self, cmd):
        self.received.append(cmd)
        self.pub.ack(SteeringAck(cmd.command_id, cmd.request_id, not self.refuse, applied_step=7,
                                 steering_version=len(self.received),
                                 error="bad layer" if self.refuse else None))

    def start_request(self, rid):
        self.pub.publish(StreamStart(rid, self.pub.producer_id, self.pub.epoch, self.pub.next_seq(rid)))


@pytest.fixture
def broker_dir():
    with run_dir() as d, processes() as procs:
        procs.append(start_broker(d))
        yield d


def test_command_reaches_the_owning_producer_and_the_ack_comes_back(broker_dir):
    owner, other = _Engine(broker_dir, "owner"), _Engine(broker_dir, "other")
    try:
        owner.start_request("req-a")
        other.start_request("req-b")
        wait_for(lambda: len(stats(broker_dir)["streams"]) == 2)

        class Steerer(Consumer):
            patterns = ()

        c = Steerer()
        with BrokerClient(broker_dir, consumer_id="steerer") as client:
            client.subscribe([])
            c._client = client
            ack = c.steer("req-a", "add", ops=[{"layer": 3, "vector": "happy", "scale": 2.0}])
        assert ack.ok and ack.applied_step == 7 and ack.request_id == "req-a"
        assert [cmd.request_id for cmd in owner.received] == ["req-a"] and other.received == []
        assert owner.received[0].ops == [{"layer": 3, "vector": "happy", "scale": 2.0}]
        assert owner.received[0].sender  # the broker stamps who sent it
    finally:
        owner.pub.close()
        other.pub.close()


def test_unknown_request_and_producer_refusal_are_errors(broker_dir):
    engine = _Engine(broker_dir, "refuser", refuse=True)
    try:
        engine.start_request("req-x")
        wait_for(lambda: len(stats(broker_dir)["streams"]) == 1)
        with BrokerClient(broker_dir) as client:
            client.subscribe([])
            ack = client.send_steering(SteeringCommand(uuid.uuid4().hex, "no-such-request", "clear"), timeout=5)
            assert not ack.ok and ack.error.startswith("unknown_request")
            c = Consumer()
            c._client = client
            with pytest.raises(SteeringCommandError, match="bad layer"):
                c.steer("req-x", "clear")
    finally:
        engine.pub.close()
    assert stats(broker_dir)["totals"]["steering_refused"] == 1


def test_steering_disabled_broker_refuses():
    with run_dir() as d, processes() as procs:
        procs.append(start_broker(d, "--no-steering"))
        engine = _Engine(d)
        try:
            engine.start_request("r")
            wait_for(lambda: len(stats(d)["streams"]) == 1)
            with BrokerClient(d) as client:
                ack = client.send_steering(SteeringCommand("c1", "r", "clear"), timeout=5)
        finally:
            engine.pub.close()
    assert not ack.ok and ack.error.startswith("steering_disabled") and engine.received == []


def test_command_goes_to_the_control_peer_named_by_the_start(broker_dir):
    worker, control = _Engine(broker_dir, "worker"), _Engine(broker_dir, "scheduler")
    try:
        control.pub.publish(__import__("mia_stream.schemas", fromlist=["Heartbeat"]).Heartbeat(
            "scheduler", "producer", control.pub.epoch))  # the control peer makes itself known
        worker.pub.publish(StreamStart("req-c", "worker", worker.pub.epoch, worker.pub.next_seq("req-c"),
                                       control_id="scheduler"))
        wait_for(lambda: len(stats(broker_dir)["streams"]) == 1 and len(stats(broker_dir)["producers"]) == 2)
        with BrokerClient(broker_dir) as client:
            ack = client.send_steering(SteeringCommand("c-1", "req-c", "clear"), timeout=5)
        assert ack.ok and [c.command_id for c in control.received] == ["c-1"] and worker.received == []
    finally:
        worker.pub.close()
        control.pub.close()
