"""The peer session (``mia_stream.bus.session``): typed capabilities give exactly the heartbeat stats peers always
wrote (key order included, so heartbeat bytes are unchanged), and one ``BrokerSession`` says when a publisher,
a consumer client or the recorder must announce itself again."""

from __future__ import annotations

import msgpack

from mia_stream.bus import shm_ring
from mia_stream.bus.session import BrokerSession, Capabilities
from mia_stream.schemas import Heartbeat, decode, encode

RING = "mia-stream-ring-1234-0123456789ab"


def _stats_bytes(stats: dict) -> bytes:
    return msgpack.packb(stats, use_bin_type=True)


def test_a_brokers_capabilities_are_the_stats_it_always_sent():
    for known in (True, False):
        for batch in (True, False):
            for shm in (True, False):
                legacy = {"known": known, "batch": batch, "shm": shm, "shm_received": shm, "gap_batch": True}
                caps = Capabilities.of_broker(known, batch, shm)
                assert _stats_bytes(caps.to_stats()) == _stats_bytes(legacy)
                assert Capabilities.from_stats(legacy) == caps
    taken = {"known": True, "batch": True, "shm": True, "shm_received": True, "gap_batch": True,
             "shm_ring_taken": RING}
    assert _stats_bytes(Capabilities.of_broker(True, True, True, ring_taken=RING).to_stats()) == _stats_bytes(taken)


def test_a_producers_ring_keys_follow_its_counters_as_before():
    counters = {"producer_id": "p", "epoch": 1, "published": 3}
    proof = {"ring": RING, "secret": "ab" * 16}
    assert list({**counters, **Capabilities(ring_proof=proof).to_stats()}.items()) == [
        *counters.items(), (shm_ring.SHM_RING_PROOF_KEY, proof)]
    assert {**counters, **Capabilities(ring_closed=RING).to_stats()} == {**counters, shm_ring.SHM_RING_CLOSED_KEY: RING}
    read = Capabilities.from_stats({**counters, "shm_ring_proof": proof})
    assert read.ring_proof == proof and read.known is None and read.batch is None
    # the keys stay importable where the broker imports them
    assert (shm_ring.SHM_RING_CLOSED_KEY, shm_ring.SHM_RING_TAKEN_KEY, shm_ring.SHM_RECEIVED_KEY,
            shm_ring.SHM_RING_PROOF_KEY) == ("shm_ring_closed", "shm_ring_taken", "shm_received", "shm_ring_proof")


def test_capabilities_are_read_leniently_as_before():
    assert Capabilities.from_stats(None) == Capabilities()
    odd = Capabilities.from_stats({"batch": 1, "shm": "yes", "gap_batch": True, "known": 0, "shm_ring_taken": 5})
    assert odd.batch is False and odd.shm is False and odd.gap_batch is True  # a flag is on only when true
    assert odd.known is False and odd.ring_taken is None


def _hb(instance: int, **stats) -> Heartbeat:
    return decode(encode(Heartbeat("broker", "broker", instance, 1, stats)))  # as a peer receives it


def test_the_broker_session_says_when_to_announce_again():
    for on_first in (True, False):
        s = BrokerSession(announce_on_first=on_first)
        assert not s.answered
        news = s.on_heartbeat(_hb(7, known=True, batch=True))
        assert news.first and not news.restarted and news.reannounce is on_first
        assert s.answered and s.instance == 7 and s.capabilities.batch is True
        news = s.on_heartbeat(_hb(7, known=True))
        assert not news.first and not news.restarted and not news.reannounce
        news = s.on_heartbeat(_hb(7, known=False))  # the broker does not know this peer: announce again
        assert not news.restarted and news.reannounce
        news = s.on_heartbeat(_hb(8, known=True))  # a new instance: the broker restarted
        assert news.restarted and news.reannounce
        news = s.on_heartbeat(_hb(8))  # no "known" key: known
        assert not news.reannounce and s.capabilities.known is None
