"""The live bus end to end with real processes and real ipc sockets: routing, late join, slow and dying peers."""

from __future__ import annotations

import json
import time

import pytest

from bus_helpers import (account, assert_exact, events_until, kill, processes, publish_stream, run_dir, spawn,
                         start_broker, stats, wait_for)
from mia_stream.consumers import open_stream
from mia_stream.bus.publisher import FramePublisher


@pytest.fixture
def broker_dir():
    with run_dir() as d:
        yield d


def _wait_consumers(address: str, n: int) -> None:
    wait_for(lambda: len(stats(address)["consumers"]) >= n, timeout=15)


def test_many_producers_many_consumers_with_globs(broker_dir, tmp_path):
    with processes() as procs:
        procs.append(start_broker(broker_dir))
        outs = {name: tmp_path / f"{name}.json" for name in ("all", "alpha", "beta1")}
        procs.append(spawn("consume", "--address", broker_dir, "--patterns", "*", "--ends", "4",
                           "--out", str(outs["all"])))
        procs.append(spawn("consume", "--address", broker_dir, "--patterns", "alpha-*", "--ends", "2",
                           "--out", str(outs["alpha"])))
        procs.append(spawn("consume", "--address", broker_dir, "--patterns", "beta-1", "--ends", "1",
                           "--out", str(outs["beta1"])))
        _wait_consumers(broker_dir, 3)
        producers = [spawn("produce", "--address", broker_dir, "--requests", "alpha-0,beta-0", "--frames", "150",
                           "--tokens", "--producer-id", "p0"),
                     spawn("produce", "--address", broker_dir, "--requests", "alpha-1,beta-1", "--frames", "150",
                           "--tokens", "--producer-id", "p1")]
        procs.extend(producers)
        for p in procs[1:]:
            assert p.wait(60) == 0, p.stderr.read()
        got = {name: json.loads(path.read_text()) for name, path in outs.items()}
        for rec in got.values():
            rec.pop("_client")
        st = stats(broker_dir)
    assert sorted(got["all"]) == ["alpha-0", "alpha-1", "beta-0", "beta-1"]
    assert sorted(got["alpha"]) == ["alpha-0", "alpha-1"]
    assert sorted(got["beta1"]) == ["beta-1"]
    for rec in (*got["all"].values(), *got["alpha"].values(), *got["beta1"].values()):
        assert_exact(rec)
        assert rec["gap_seqs"] == []  # below saturation nothing is lost
        assert rec["steps"] == list(range(150)), (rec["finish_reason"], rec["last_seq"], st["totals"])
    assert st["totals"].get("dropped_for_consumers", 0) == 0
    assert {"p0", "p1"} <= {name.split("/")[0] for name in st["producers"]}


def test_late_join_from_start_and_eviction_gap_is_exact(broker_dir):
    nbytes = 64 << 10
    with processes() as procs:
        # room for ~10 frames of 64 KiB per stream: the oldest ones are evicted
        procs.append(start_broker(broker_dir, "--late-join-bytes", str(10 * nbytes + 4096)))
        pub = FramePublisher(broker_dir, producer_id="late")
        try:
            publish_stream(pub, "small", 5, 1024, end=False)
            publish_stream(pub, "big", 40, nbytes, end=False)
            assert pub.flush(5)
            wait_for(lambda: stats(broker_dir)["streams"].get(f"big|late|{pub.epoch}", {}).get("next_seq") == 41)
            with open_stream(broker_dir, patterns=("small", "big"), from_start=True, timeout=10) as events:
                time.sleep(0.2)
                for rid, n in (("small", 5), ("big", 40)):
                    from mia_stream.schemas import StreamEnd

                    pub.publish(StreamEnd(rid, pub.producer_id, pub.epoch, pub.next_seq(rid)))
                got = account(events_until(events, 2, 10))
        finally:
            pub.close()
    small, big = got["small"], got["big"]
    assert_exact(small)
    assert small["gap_seqs"] == [] and small["steps"] == list(range(5))
    assert_exact(big)
    assert big["gap_reasons"] == ["evicted_from_late_join_buffer"]
    assert big["gap_seqs"] == list(range(1, len(big["gap_seqs"]) + 1))  # exactly the oldest frames
    assert 25 <= len(big["gap_seqs"]) <= 32
    assert big["steps"] == list(range(len(big["gap_seqs"]), 40))


def test_live_join_mid_stream_names_what_it_did_not_ask_for(broker_dir):
    from mia_stream.schemas import StreamEnd

    with processes() as procs:
        procs.append(start_broker(broker_dir))
        pub = FramePublisher(broker_dir, producer_id="mid")
        try:
            publish_stream(pub, "r", 10, 256, end=False)
            wait_for(lambda: stats(broker_dir)["streams"].get(f"r|mid|{pub.epoch}", {}).get("next_seq") == 11)
            with open_stream(broker_dir, patterns=("r",), timeout=10) as events:
                time.sleep(0.2)
                pub.publish(StreamEnd("r", pub.producer_id, pub.epoch, pub.next_seq("r")))
                rec = account(events_until(events, 1, 10))["r"]
        finally:
            pub.close()
    assert_exact(rec)
    assert rec["gap_reasons"] == ["joined_late"] and rec["gap_seqs"] == list(range(1, 11))


def test_slow_consumer_loses_exactly_what_is_reported_and_others_lose_nothing(broker_dir, tmp_path):
    frames, nbytes = 300, 16 << 10
    with processes() as procs:
        # a 256 KiB queue per consumer, and a slow consumer with a small credit window
        procs.append(start_broker(broker_dir, "--consumer-queue-bytes", str(256 << 10)))
        fast_out, slow_out = tmp_path / "fast.json", tmp_path / "slow.json"
        procs.append(spawn("consume", "--address", broker_dir, "--ends", "1", "--out", str(fast_out)))
        procs.append(spawn("consume", "--address", broker_dir, "--ends", "1", "--sleep", "0.01", "--timeout", "40",
                           "--window", str(128 << 10), "--out", str(slow_out)))
        _wait_consumers(broker_dir, 2)
        prod = spawn("produce", "--address", broker_dir, "--requests", "flood", "--frames", str(frames),
                     "--nbytes", str(nbytes), "--rate", "1500")
        procs.append(prod)
        for p in procs[1:]:
            assert p.wait(60) == 0, p.stderr.read()
        st = stats(broker_dir)
    fast, slow = json.loads(fast_out.read_text())["flood"], json.loads(slow_out.read_text())["flood"]

    assert_exact(fast)
    assert fast["gap_seqs"] == [], (fast["gap_reasons"], st["consumers"])
    assert_exact(slow)
    assert slow["gap_seqs"], "the slow consumer should have lost frames"
    assert set(slow["gap_reasons"]) == {"consumer_queue_full"}
    dropped = st["totals"]["dropped_for_consumers"]  # the slow one's entry may be gone: it has left
    assert dropped == len(slow["gap_seqs"]), (slow["gap_reasons"], st["consumers"])


def test_publisher_never_blocks_without_broker_and_counts_drops_exactly(broker_dir):
    from mia_stream.schemas import StreamEnd, StreamStart, Tensor, TensorFrame

    pub = FramePublisher(broker_dir, producer_id="lonely", queue_bytes=1 << 20)  # nothing listens there
    try:
        rid = "nobody"
        arr = payload_arr = __import__("numpy").zeros((1, 1, 256), "float32")  # 1 KiB frames
        t0 = time.perf_counter()
        accepted = [pub.publish(StreamStart(rid, pub.producer_id, pub.epoch, pub.next_seq(rid)))]
        for step in range(10_000):
            accepted.append(pub.publish(TensorFrame(rid, pub.producer_id, pub.epoch, pub.next_seq(rid), step,
                                                    tensors=[Tensor.from_array("hs", payload_arr)])))
        elapsed = time.perf_counter() - t0
        drops = pub.drops_for(rid)
        # the caller's own drops (the engine's: frames its host ring had no room for) plus the publisher's
        end = StreamEnd(rid, pub.producer_id, pub.epoch, pub.next_seq(rid), frames_dropped=3,
                        drops={"host_ring_full": 3})
        pub.publish(end)
    finally:
        pub.close(timeout=0)
    assert elapsed < 5.0, f"publish blocked: 10k messages took {elapsed:.1f} s"
    n_dropped = accepted.count(False)
    assert n_dropped > 8000  # a 1 MiB budget holds fewer than 1000 of them
    assert drops == {"queue_full": n_dropped}
    assert end.frames_dropped == n_dropped + 3 and end.drops == {"queue_full": n_dropped, "host_ring_full": 3}
    st = pub.stats()
    assert st["dropped_queue_full"] == n_dropped
    # close(timeout=0) with no broker: what was still queued is dropped too, and counted as such
    assert st["dropped"] == n_dropped + st["dropped_publisher_closed"]
    # + the StreamEnd and the GapNotices: one before the end, and one more per heartbeat that found room in the
    # control reserve to announce the drops so far (timing: the count of notices varies, their sum does not)
    assert st["gap_notices"] >= 1
    assert st["dropped_publisher_closed"] == len(accepted) - n_dropped + st["gap_notices"] + 1
    del arr


def test_queued_frames_and_drop_notices_arrive_when_the_broker_comes(broker_dir):
    """What the publisher held while no broker ran is delivered later; what it dropped is named exactly."""
    pub = FramePublisher(broker_dir, producer_id="early", queue_bytes=64 << 10)
    with processes() as procs:
        try:
            publish_stream(pub, "early", 200, 1024, end=False)  # ~64 fit, the rest is dropped
            dropped = pub.drops_for("early")["queue_full"]
            procs.append(start_broker(broker_dir))
            with open_stream(broker_dir, patterns=("early",), from_start=True, timeout=10) as events:
                time.sleep(0.3)
                from mia_stream.schemas import StreamEnd

                pub.publish(StreamEnd("early", pub.producer_id, pub.epoch, pub.next_seq("early")))
                rec = account(events_until(events, 1, 10))["early"]
        finally:
            pub.close()
    assert_exact(rec)
    assert len(rec["gap_seqs"]) == dropped and set(rec["gap_reasons"]) == {"queue_full"}


def test_producer_dying_mid_stream_ends_its_streams_as_producer_lost(broker_dir, tmp_path):
    out = tmp_path / "c.json"
    with processes() as procs:
        procs.append(start_broker(broker_dir, "--producer-timeout", "1.0"))
        procs.append(spawn("consume", "--address", broker_dir, "--ends", "1", "--out", str(out)))
        _wait_consumers(broker_dir, 1)
        prod = spawn("produce", "--address", broker_dir, "--requests", "doomed", "--frames", "20", "--no-end",
                     "--hang")
        procs.append(prod)
        wait_for(lambda: any(s["next_seq"] == 21 for s in stats(broker_dir)["streams"].values()))
        kill(prod)
        assert procs[1].wait(30) == 0
        st = stats(broker_dir)
    rec = json.loads(out.read_text())["doomed"]
    assert rec["finish_reason"] == "producer_lost"
    assert_exact(rec)
    assert st["totals"]["producers_lost"] == 1


def test_consumer_dying_does_not_disturb_the_others(broker_dir, tmp_path):
    out = tmp_path / "ok.json"
    with processes() as procs:
        procs.append(start_broker(broker_dir))
        victim = spawn("consume", "--address", broker_dir, "--ends", "1", "--sleep", "0.05",
                       "--out", str(tmp_path / "v.json"))
        procs.append(victim)
        procs.append(spawn("consume", "--address", broker_dir, "--ends", "1", "--out", str(out)))
        _wait_consumers(broker_dir, 2)
        prod = spawn("produce", "--address", broker_dir, "--requests", "steady", "--frames", "200", "--rate", "200",
                     "--nbytes", "8192")
        procs.append(prod)
        time.sleep(0.5)
        kill(victim)
        assert prod.wait(30) == 0
        assert procs[2].wait(30) == 0
        st = wait_for(lambda: (lambda s: s if s["totals"].get("consumers_lost", 0) >= 1 else None)(
            stats(broker_dir)), timeout=15)
    rec = json.loads(out.read_text())["steady"]
    assert_exact(rec)
    assert rec["gap_seqs"] == []
    assert st["totals"].get("internal_errors", 0) == 0
