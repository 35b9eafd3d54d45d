"""Columnar messages (schema 2.0, docs/wire-format.md section 10) through a real broker process, real sockets and
real shared-memory rings: whole to a consumer matching every request, a selection to one matching 10%, bit-exact
inline and through a ring; gap batches naming every request of a batch dropped for a slow consumer; late join of
a request in the middle of batches. The producer is a raw DEALER sending encoded frames (the broker must not
depend on the publisher), the consumers raw DEALERs that decode what they get; the last test puts the real
publisher in front (its drops, announced as gap batches, end to end)."""

from __future__ import annotations

import collections
import signal

import numpy as np
import pytest

from bus_helpers import RawConsumer, RawProducer, processes, run_dir, start_broker, stats, wait_for
from mia_stream.schemas import (GapBatch, GapNotice, RowGroup, StepBatch, StreamEnd, StreamStart, Tensor, TokenBatch,
                                decode_header)
from mia_stream.bus.shm_ring import ShmRingWriter, shm_available

HIDDEN = 1024  # floats per row: 4 KiB, ring payloads of one step are 4 KiB x rows


def rows_of(rid: str, step: int, n: int) -> np.ndarray:
    """A request's rows at a step; every value names (request, step, row), so any mix-up shows."""
    base = int(rid.split("-")[1]) * 100_000 + step * 10
    return (base + np.arange(n, dtype=np.float32))[:, None] + np.zeros(HIDDEN, np.float32)


def step_batch(producer: str, step: int, ids: list[str], seq: int, rows: dict[str, int]) -> StepBatch:
    n = [rows[r] for r in ids]
    hs = np.concatenate([rows_of(r, step, rows[r]) for r in ids])[None]
    group = RowGroup(np.arange(len(ids)), n, np.arange(sum(n)), [Tensor.from_array("hs", hs, layers=(7,))])
    return StepBatch(producer, 1, step, ids, [seq] * len(ids), groups=[group])


def token_batch(producer: str, step: int, ids: list[str], seq: int) -> TokenBatch:
    return TokenBatch(producer, 1, step, ids, [seq] * len(ids), token_ids=np.arange(len(ids)) + step)


def check_rows(batch: StepBatch) -> None:
    for rid in batch.request_ids:
        (frame,) = batch.segment(rid)
        np.testing.assert_array_equal(frame.tensor("hs").numpy()[0], rows_of(rid, batch.step, len(frame.positions)))


def per_request(messages) -> dict[str, list]:
    """Per request, in arrival order: (kind, seq) of what it got, or ("gap", reason, seqs)."""
    out = collections.defaultdict(list)
    for _, m in messages:
        if isinstance(m, (StepBatch, TokenBatch)):
            for rid, seq in zip(m.request_ids, m.seqs.tolist()):
                out[rid].append((m.KIND, seq))
        elif isinstance(m, (GapNotice, GapBatch)):
            for g in (m.notices() if isinstance(m, GapBatch) else [m]):
                out[g.request_id].append(("gap", g.reason, [s for a, b in g.missing for s in range(a, b + 1)]))
        elif hasattr(m, "seq"):
            out[m.request_id].append((m.KIND, m.seq))
    return out


def ended(n: int):
    return lambda messages: sum(isinstance(m, StreamEnd) for _, m in messages) >= n


@pytest.mark.parametrize("use_ring", [False, True], ids=["inline", "ring"])
def test_a_step_batch_goes_whole_to_a_consumer_of_all_and_as_its_selection_to_a_consumer_of_ten_percent(use_ring):
    if use_ring and not shm_available():
        pytest.skip("needs a writable /dev/shm")
    ids = [f"req-{i}" for i in range(40)]
    tenth = ids[::10]
    steps = 12
    rows = {rid: 1 + i % 3 for i, rid in enumerate(ids)}  # 2 rows on average: 80 rows, 320 KiB per step
    ring = ShmRingWriter(size=64 << 20, min_bytes=1024) if use_ring else None
    with run_dir() as d, processes() as procs:
        procs.append(start_broker(d))
        consumers = {"all-ring": RawConsumer(d, "all-ring", ["*"], shm=True),
                     "all-inline": RawConsumer(d, "all-inline", ["*"]),
                     "tenth-ring": RawConsumer(d, "tenth-ring", tenth, shm=True),
                     "tenth-inline": RawConsumer(d, "tenth-inline", tenth)}
        prod = RawProducer(d, "columns/1")
        try:
            wait_for(lambda: len(stats(d)["consumers"]) == 4, timeout=15)
            prod.hello(ring)
            for rid in ids:
                prod.send(StreamStart(rid, "columns", 1, 0))
            sent = []
            for step in range(1, steps + 1):
                sent.append(prod.send(step_batch("columns", step, ids, 2 * step - 1, rows), ring=ring))
                prod.send(token_batch("columns", step, ids, 2 * step))
            for rid in ids:
                prod.send(StreamEnd(rid, "columns", 1, 2 * steps + 1))
            for name, c in consumers.items():
                c.read(30, ended(len(ids) if name.startswith("all") else len(tenth)))
            st = stats(d)
        finally:
            prod.close()
            for c in consumers.values():
                c.close()
            if ring is not None:
                ring.close()
    if use_ring:
        assert st["totals"]["shm_bytes_in"] == steps * sum(rows.values()) * HIDDEN * 4
        assert st["totals"]["shm_rings_proven"] == 1
    for name, c in consumers.items():
        want = ids if name.startswith("all") else tenth
        got = per_request(c.messages)
        assert sorted(got) == sorted(want), name
        for rid in want:
            assert [e[1] for e in got[rid]] == list(range(2 * steps + 2)), (name, rid, got[rid])
        batches = [(f, m) for f, m in c.messages if isinstance(m, StepBatch)]
        assert len(batches) == steps
        for (frames, batch), original in zip(batches, sent):
            assert batch.request_ids == want
            check_rows(batch)  # bit-exact, ring or inline, whole or selected
            header = decode_header(frames)
            reads_ring = use_ring and name.endswith("ring")
            assert ("shm_ring" in header) == reads_ring, name
            if name == "all-ring" or (name == "all-inline" and not use_ring):
                assert frames[1] == bytes(original[1])  # the header as the producer sent it: forwarded unchanged
            elif name == "tenth-ring" and use_ring:
                assert "row0" in header["groups"][0]  # a selection: ring references untouched, rows named
            else:
                assert "row0" not in header["groups"][0]  # compacted: just its rows, inline
                assert sum(map(len, frames[2:])) == sum(rows[r] for r in want) * HIDDEN * 4
    assert not any(k.startswith(("malformed", "internal", "dropped")) for k in st["totals"]), st["totals"]


def test_a_slow_consumer_gets_gap_batches_naming_every_request_of_each_batch_dropped_for_it():
    ids = [f"req-{i}" for i in range(8)]
    mine = ids[:4]  # what the subset consumer subscribed to
    steps = 60
    rows = {rid: 2 for rid in ids}  # 16 rows x 4 KiB = 64 KiB per step batch
    with run_dir() as d, processes() as procs:
        procs.append(start_broker(d, "--consumer-queue-bytes", str(256 << 10), "--no-shm"))
        slow = RawConsumer(d, "slow", ["*"], window=128 << 10)  # credits nothing until the end
        # matches half the requests: its selections are half the bytes, and it still falls behind
        slow_subset = RawConsumer(d, "slow-subset", ["req-[0-3]"], window=64 << 10)
        fast = RawConsumer(d, "fast", ["*"])
        prod = RawProducer(d, "lossy/1")
        try:
            wait_for(lambda: len(stats(d)["consumers"]) == 3, timeout=15)
            prod.hello()
            for rid in ids:
                prod.send(StreamStart(rid, "lossy", 1, 0))
            for step in range(1, steps + 1):
                prod.send(step_batch("lossy", step, ids, 2 * step - 1, rows))
                prod.send(token_batch("lossy", step, ids, 2 * step))
                fast.read(0.005)
            for rid in ids:
                prod.send(StreamEnd(rid, "lossy", 1, 2 * steps + 1))
            fast.read(30, ended(len(ids)))
            for name, consumer, n in (("slow", slow, len(ids)), ("slow-subset", slow_subset, len(mine))):
                wait_for(lambda: stats(d)["consumers"][name]["queue_messages"] > 0, timeout=10)
                consumer.read(1)
                consumer.credit(1 << 40)  # now it reads everything that is left
                consumer.read(30, ended(n), credit=True)
            st = stats(d)
        finally:
            prod.close()
            slow.close()
            slow_subset.close()
            fast.close()
    full = list(range(2 * steps + 2))
    for rid, events in per_request(fast.messages).items():
        assert [e[1] for e in events] == full, rid
    got = per_request(slow.messages)
    lost_by_request = {}
    for rid in ids:
        events = got[rid]
        delivered = [e[1] for e in events if e[0] != "gap"]
        lost = [s for e in events if e[0] == "gap" for s in e[2]]
        assert {e[1] for e in events if e[0] == "gap"} == {"consumer_queue_full"}
        assert sorted(delivered + lost) == full and delivered == sorted(delivered)
        assert all(s % 2 == 1 for s in lost)  # step batches were dropped, never token batches
        lost_by_request[rid] = lost
    lost = lost_by_request[ids[0]]
    assert lost, "the slow consumer should have lost batches"
    assert all(v == lost for v in lost_by_request.values())  # a dropped batch: a gap for every request it named
    assert len(set(lost)) == len(lost)  # each lost seq named once
    # ... announced in gap batches, not one GapNotice per request: at most one per step batch dropped
    gap_messages = [m for _, m in slow.messages if isinstance(m, (GapNotice, GapBatch))]
    assert gap_messages and all(isinstance(m, GapBatch) and m.request_ids == ids for m in gap_messages)
    assert len(gap_messages) <= len(lost)
    assert st["consumers"]["slow"]["dropped"] == st["consumers"]["slow"]["gaps_notified"] == len(lost) * len(ids)

    # the subset consumer: gap batches name only the requests it subscribed to, every lost seq exactly once
    got = per_request(slow_subset.messages)
    assert set(got) == set(mine)
    subset_gaps = [m for _, m in slow_subset.messages if isinstance(m, (GapNotice, GapBatch))]
    assert subset_gaps and all(isinstance(m, GapBatch) and m.request_ids == mine for m in subset_gaps)
    subset_lost = 0
    for rid in mine:
        delivered = [e[1] for e in got[rid] if e[0] != "gap"]
        lost = [s for e in got[rid] if e[0] == "gap" for s in e[2]]
        assert lost and sorted(delivered + lost) == full and delivered == sorted(delivered), rid
        subset_lost += len(lost)
    subset = st["consumers"]["slow-subset"]
    assert subset["dropped"] == subset["gaps_notified"] == subset_lost
    assert st["totals"]["dropped_for_consumers"] == len(lost_by_request[ids[0]]) * len(ids) + subset_lost


def test_late_join_of_a_request_in_the_middle_of_batches():
    ids = [f"req-{i}" for i in range(6)]
    rows = {rid: 1 + i for i, rid in enumerate(ids)}
    with run_dir() as d, processes() as procs:
        procs.append(start_broker(d))
        prod = RawProducer(d, "mid/1")
        joiners = []
        try:
            prod.hello()
            for rid in ids:
                prod.send(StreamStart(rid, "mid", 1, 0))
            for step in range(1, 6):
                prod.send(step_batch("mid", step, ids, 2 * step - 1, rows))
                prod.send(token_batch("mid", step, ids, 2 * step))
            wait_for(lambda: stats(d)["streams"].get("req-3|mid|1", {}).get("next_seq") == 11, timeout=10)
            joiners = [RawConsumer(d, "from-start", ["req-3"], from_start=True),
                       RawConsumer(d, "live", ["req-3"])]
            wait_for(lambda: len(stats(d)["consumers"]) == 2, timeout=10)
            for step in range(6, 11):
                prod.send(step_batch("mid", step, ids, 2 * step - 1, rows))
                prod.send(token_batch("mid", step, ids, 2 * step))
            prod.send(StreamEnd("req-3", "mid", 1, 21))
            for c in joiners:
                c.read(20, ended(1))
        finally:
            prod.close()
            for c in joiners:
                c.close()
    from_start, live = (per_request(c.messages)["req-3"] for c in joiners)
    assert [e[1] for e in from_start] == list(range(22))  # start, the buffered batches, then live
    assert [e[0] for e in from_start[1:3]] == ["step_batch", "token_batch"]
    assert live[:2] == [("start", 0), ("gap", "joined_late", list(range(1, 11)))]
    assert [e[1] for e in live[2:]] == list(range(11, 22))
    for c in joiners:
        batches = [m for _, m in c.messages if isinstance(m, (StepBatch, TokenBatch))]
        assert batches and all(m.request_ids == ["req-3"] for m in batches)  # selections naming that request
        for m in batches:
            if isinstance(m, StepBatch):
                check_rows(m)


def test_a_publishers_dropped_step_batches_reach_consumers_as_gap_batches_old_and_late_ones_included():
    """The real FramePublisher outruns a stopped broker (SIGSTOP) with a small queue: each step batch it drops is
    announced as one GapBatch naming every request (not a GapNotice per request), which the broker buffers and
    routes like each request's GapNotice: whole to a consumer of all, a selection to a subset, GapNotices to a
    schema 2.0 consumer, and all of it again to a consumer that joins after the streams ended."""
    from mia_stream.bus.publisher import FramePublisher

    ids = [f"req-{i}" for i in range(8)]
    mine = ids[:3]
    rows = {rid: 1 for rid in ids}  # 8 rows x 4 KiB = 32 KiB per step batch
    steps = 600  # far more than zmq's pipe (64 messages) and the 64 KiB queue hold while the broker is stopped
    with run_dir() as d, processes() as procs:
        broker = start_broker(d)
        procs.append(broker)
        consumers = {"all": RawConsumer(d, "all", ["*"]), "subset": RawConsumer(d, "subset", mine),
                     "old": RawConsumer(d, "old", ["*"], schema=(2, 0))}
        pub = FramePublisher(d, producer_id="dropper", queue_bytes=64 << 10, shm_bytes=0)
        late = None
        try:
            wait_for(lambda: len(stats(d)["consumers"]) == 3 and pub.broker_gap_batch, timeout=15)
            for rid in ids:
                pub.publish(StreamStart(rid, pub.producer_id, pub.epoch, pub.next_seq(rid)))
            accepted = []
            broker.send_signal(signal.SIGSTOP)
            try:
                for step in range(1, steps + 1):
                    batch = step_batch(pub.producer_id, step, ids, 0, rows)
                    batch.epoch, batch.seqs = pub.epoch, np.asarray(pub.next_seqs(ids))
                    accepted.append(pub.publish(batch))
                    tokens = token_batch(pub.producer_id, step, ids, 0)
                    tokens.epoch, tokens.seqs = pub.epoch, np.asarray(pub.next_seqs(ids))
                    assert pub.publish(tokens), "token batches use the control reserve"
            finally:
                broker.send_signal(signal.SIGCONT)
            for rid in ids:
                seq = pub.next_seq(rid)
                pub.publish(StreamEnd(rid, pub.producer_id, pub.epoch, seq, frames_sent=seq + 1))
            assert pub.flush(30)
            for name, c in consumers.items():
                c.read(60, ended(len(mine) if name == "subset" else len(ids)))
            late = RawConsumer(d, "late", ["*"], from_start=True)  # the streams have ended, and still linger
            late.read(30, ended(len(ids)))
            st = stats(d)
            counters = pub.stats()
        finally:
            pub.close()
            for c in [*consumers.values(), late]:
                if c is not None:
                    c.close()
    dropped = accepted.count(False)
    assert dropped > 0 and counters["dropped_queue_full"] == dropped
    full = list(range(2 * steps + 2))
    everyone = per_request(consumers["all"].messages)
    lost = []
    for rid in ids:
        events = everyone[rid]
        delivered = [e[1] for e in events if e[0] != "gap"]
        lost = [s for e in events if e[0] == "gap" for s in e[2]]
        assert {e[1] for e in events if e[0] == "gap"} == {"queue_full"}
        assert sorted(delivered + lost) == full and delivered == sorted(delivered)  # each lost seq named once
        assert len(lost) == dropped and all(s % 2 == 1 for s in lost)  # step batches were dropped, never tokens
        assert events[-1] == ("end", 2 * steps + 1)
    end = next(m for _, m in consumers["all"].messages if isinstance(m, StreamEnd))
    assert end.frames_dropped == dropped and end.drops == {"queue_full": dropped}
    # announced as gap batches naming every request, one per step batch dropped at most (consecutive: merged)
    gaps = [m for _, m in consumers["all"].messages if isinstance(m, (GapNotice, GapBatch))]
    assert gaps and all(isinstance(m, GapBatch) and m.request_ids == ids and m.origin == "producer" for m in gaps)
    assert len(gaps) == counters["gap_batches"] <= dropped and counters.get("gap_notices", 0) == 0
    assert counters["gap_batch_streams"] == len(gaps) * len(ids)
    (producer,) = [p for name, p in st["producers"].items() if name.startswith("dropper/")]
    assert producer["gaps_reported"] == dropped * len(ids)
    assert not any(k.startswith(("malformed", "internal", "unexpected", "gap_for_unknown")) for k in st["totals"])
    # a subset consumer: gap batches naming only its requests
    subset_gaps = [m for _, m in consumers["subset"].messages if isinstance(m, (GapNotice, GapBatch))]
    assert subset_gaps and all(isinstance(m, GapBatch) and m.request_ids == mine for m in subset_gaps)
    assert per_request(consumers["subset"].messages) == {rid: everyone[rid] for rid in mine}
    # a 2.0 consumer: the same, as GapNotices
    old_gaps = [m for _, m in consumers["old"].messages if isinstance(m, (GapNotice, GapBatch))]
    assert len(old_gaps) == len(gaps) * len(ids) and all(isinstance(m, GapNotice) for m in old_gaps)
    assert per_request(consumers["old"].messages) == everyone
    # a late joiner learns every gap from the broker's buffer, in place
    assert per_request(late.messages) == everyone
    assert all(isinstance(m, GapBatch) for _, m in late.messages if isinstance(m, (GapNotice, GapBatch)))
