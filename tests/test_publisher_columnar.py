"""The publisher with columnar messages (StepBatch, TokenBatch: one message naming many requests), over a real
ZeroMQ socket to a stub broker that decodes what arrives (tests/stub_broker.py).

A dropped step batch is a drop of one seq for EVERY request it names: each request's gap names that seq before
its next message (one GapBatch for all of them to a broker that takes gap batches, else a GapNotice each), and
its StreamEnd counts it (frames_sent + frames_dropped = the seqs the stream used). Token batches use the control
reserve, as token frames did. The shared-memory source bound applies to step batches. The drain's ring views are
copied once, never left referenced.
"""

from __future__ import annotations

import shutil
import tempfile
import time

import numpy as np
import pytest
import torch

from mia_stream.bus.publisher import FramePublisher
from mia_stream.spec import ModelGeometry
from mia_stream.schemas import GapBatch, GapNotice, RowGroup, StepBatch, StreamEnd, StreamStart, Tensor, TokenBatch
from mia_stream.bus.shm_ring import shm_available
from stub_broker import StubBroker
from test_drain import Engine, check_rows, ended, per_request, runtimes, seqs_exact


@pytest.fixture
def run_dir():
    d = tempfile.mkdtemp(prefix="mia-pubc-", dir="/tmp")
    yield d
    shutil.rmtree(d, ignore_errors=True)


RIDS = ["r0", "r1", "r2"]


def _start(pub, rids=RIDS):
    for rid in rids:
        pub.publish(StreamStart(rid, pub.producer_id, pub.epoch, pub.next_seq(rid)))


def _step_batch(pub, step: int, rids=RIDS, row_floats: int = 1024) -> StepBatch:
    n = len(rids)
    hs = np.full((1, n, row_floats), float(step), np.float32)
    group = RowGroup(np.arange(n), np.ones(n), np.full(n, step), [Tensor.from_array("hs", hs, layers=(0,))])
    return StepBatch(pub.producer_id, pub.epoch, step, list(rids), pub.next_seqs(rids), [group], time_ns=time.time_ns())


def _token_batch(pub, step: int, rids=RIDS) -> TokenBatch:
    return TokenBatch(pub.producer_id, pub.epoch, step, list(rids), pub.next_seqs(rids),
                      token_ids=np.full(len(rids), step), first_positions=np.full(len(rids), step))


def _end(pub, rid: str, dropped_by_caller: int = 0) -> None:
    seq = pub.next_seq(rid)
    pub.publish(StreamEnd(rid, pub.producer_id, pub.epoch, seq, frames_sent=seq + 1 - dropped_by_caller,
                          frames_dropped=dropped_by_caller))


def _gap_notices(msgs: list) -> list:
    """The distinct gap notices of a request (``per_request`` lists a notice once per seq it names)."""
    return list({id(g): g for _, k, g, _ in msgs if k == "gap"}.values())


def _as_notices(msgs: list) -> list:
    """The messages with each GapBatch replaced by its GapNotices (in its place)."""
    return [n for m in msgs for n in (m.notices() if isinstance(m, GapBatch) else [m])]


def _gaps_before_next_message(msgs: list) -> None:
    """Each gap notice arrives before every message of its request with a later seq."""
    for i, (seq, kind, _, k) in enumerate(msgs):
        if kind == "gap":
            later = [kk for s, kd, _, kk in msgs if s > seq and kd != "gap"]
            assert all(kk > k for kk in later), (seq, k, later)


def test_a_full_queue_drops_step_batches_per_request_and_keeps_token_batches(run_dir):
    """No broker at first: the queue fills; every dropped step batch is one gap seq of each request it named,
    announced before the request's next message; token batches go into the control reserve."""
    pub = FramePublisher(run_dir, producer_id="pubc-full", queue_bytes=64 << 10)
    broker = None
    try:
        _start(pub)
        results = []
        for step in range(40):  # 12 KiB each: the 64 KiB queue takes 5
            results.append(pub.publish(_step_batch(pub, step)))
            assert pub.publish(_token_batch(pub, step)), "token batches use the control reserve"
        dropped = results.count(False)
        assert dropped >= 30
        for rid in RIDS:
            assert pub.drops_for(rid) == {"queue_full": dropped}
            _end(pub, rid)
        broker = StubBroker(run_dir)
        msgs = broker.wait_for(lambda got: ended(got) == 3, timeout=20)
    finally:
        pub.close()
        if broker is not None:
            broker.close()
    assert not broker.malformed
    streams = per_request(msgs)
    for rid in RIDS:
        m = streams[rid]
        seqs_exact(m)
        _gaps_before_next_message(m)
        gaps = _gap_notices(m)
        assert {(g.reason, g.origin) for g in gaps} == {("queue_full", "producer")}
        assert sum(b - a + 1 for g in gaps for a, b in g.missing) == dropped
        end = m[-1][2]
        assert end.frames_dropped == dropped and end.drops == {"queue_full": dropped}
        assert end.frames_sent == len([1 for _, k, _, _ in m if k != "gap"])  # what arrived, the end included
        assert [t.step for _, k, t, _ in m if k == "tokens"] == list(range(40))


@pytest.mark.parametrize("gap_batch", [False, True], ids=["broker-2.0", "broker-2.1"])
def test_an_oversized_step_batch_is_a_gap_of_every_request_it_names(run_dir, gap_batch):
    """Consecutive dropped step batches are one range per request, announced before the requests' next message:
    to a broker that takes gap batches as one GapBatch naming every request, else as a GapNotice each."""
    broker = StubBroker(run_dir, gap_batch=gap_batch)
    pub = FramePublisher(run_dir, producer_id="pubc-big", max_message_bytes=64 << 10)
    try:
        deadline = time.monotonic() + 10
        while pub.broker_instance is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert pub.broker_gap_batch is gap_batch
        _start(pub)
        assert pub.publish(_step_batch(pub, 0, row_floats=256))
        for step in (1, 2, 3):
            assert not pub.publish(_step_batch(pub, step, row_floats=8192))  # 96 KiB > 64 KiB
        assert pub.publish(_step_batch(pub, 4, row_floats=256))
        for rid in RIDS:
            _end(pub, rid)
        msgs = broker.wait_for(lambda got: ended(got) == 3)
    finally:
        pub.close()
        broker.close()
    assert not broker.malformed
    gap_messages = [m for m in msgs if isinstance(m, (GapNotice, GapBatch))]
    if gap_batch:
        (batch,) = gap_messages
        assert isinstance(batch, GapBatch) and batch.request_ids == RIDS and batch.origin == "producer"
        assert pub.stats()["gap_batches"] == 1 and pub.stats()["gap_batch_streams"] == len(RIDS)
    else:
        assert [g.request_id for g in gap_messages] == RIDS and pub.stats()["gap_notices"] == len(RIDS)
    streams = per_request(_as_notices(msgs))
    for rid in RIDS:
        seqs_exact(streams[rid])
        _gaps_before_next_message(streams[rid])
        gaps = _gap_notices(streams[rid])
        assert [(g.reason, g.missing) for g in gaps] == [("oversized", [[2, 4]])]
        assert [f.step for _, k, f, _ in streams[rid] if k == "frame"] == [0, 4]
        assert pub.drops_for(rid) == {"oversized": 3}


def test_a_closed_publisher_counts_a_step_batch_for_every_request(run_dir):
    pub = FramePublisher(run_dir, producer_id="pubc-closed")
    _start(pub)
    pub.close(0)
    assert not pub.publish(_step_batch(pub, 0))
    assert all(pub.drops_for(rid) == {"publisher_closed": 1} for rid in RIDS)


@pytest.mark.skipif(not shm_available(), reason="needs a writable /dev/shm")
def test_the_ring_source_bound_drops_step_batches_and_names_each_request(run_dir):
    """A broker that stops receiving (here: paused) leaves the ring's ``received`` behind: step batches past the
    bound are dropped at the source (shm_ahead_of_broker), one gap seq per request named; token batches pass."""
    broker = StubBroker(run_dir, shm=True)
    pub = FramePublisher(run_dir, producer_id="pubc-ahead", shm_bytes=4 << 20, shm_ahead_bytes=256 << 10)
    try:
        deadline = time.monotonic() + 10
        while not pub.broker_shm_received and time.monotonic() < deadline:
            time.sleep(0.02)
        assert pub.broker_shm_received
        _start(pub)
        broker.pause()
        results = [pub.publish(_step_batch(pub, step, row_floats=8192)) for step in range(12)]  # 96 KiB each
        assert results[:3] == [True] * 3 and results.count(False) >= 6
        assert pub.publish(_token_batch(pub, 12))
        dropped = results.count(False)
        broker.resume()
        for rid in RIDS:
            _end(pub, rid)
        msgs = broker.wait_for(lambda got: ended(got) == 3)
    finally:
        pub.close()
        broker.close()
    assert not broker.malformed
    streams = per_request(msgs)
    for rid in RIDS:
        seqs_exact(streams[rid])
        _gaps_before_next_message(streams[rid])
        gaps = _gap_notices(streams[rid])
        assert {g.reason for g in gaps} == {"shm_ahead_of_broker"}
        assert sum(b - a + 1 for g in gaps for a, b in g.missing) == dropped
        for _, k, f, _ in streams[rid]:
            if k == "frame":  # what was sent arrived readable
                assert np.all(f.tensors[0].numpy() == f.step)


@pytest.mark.parametrize("shm", [False, True], ids=["inline", "shm-ring"])
def test_ring_views_are_copied_once_and_never_left_referenced(run_dir, shm, monkeypatch):
    """A decode step of requests captured alike is published as a view of the host ring (no copy in the
    drain). The host ring is reused as soon as the step is published, while the stub broker does not read:
    what arrives later must still be each step's own rows (a message still referencing the ring would carry
    a later step's). The host ring here is a memfd, whose rows the publisher copies (its references into a
    /dev/shm host ring: tests/test_shm_zero_copy.py)."""
    if shm and not shm_available():
        pytest.skip("needs a writable /dev/shm")
    monkeypatch.setenv("MIA_STREAM_HOST_RING_SHM", "0")
    geo = ModelGeometry(num_layers=2, hidden_size=4096 if shm else 8, num_heads=2, num_kv_heads=2, head_dim=4)
    broker = StubBroker(run_dir, shm=shm)
    pub = FramePublisher(run_dir, producer_id="pubc-views", shm_bytes=(64 << 20) if shm else 0)
    views = []
    publish = pub.publish

    def spy(msg, **kw):
        if isinstance(msg, StepBatch):
            views.append(all(np.shares_memory(t.data, ring.data) for g in msg.groups for t in g.tensors))
        return publish(msg, **kw)

    pub.publish = spy
    try:
        if shm:
            deadline = time.monotonic() + 10
            while not pub.broker_shm and time.monotonic() < deadline:
                time.sleep(0.02)
            assert pub.broker_shm
        n = 4
        # a ring of a few steps' chunks: it wraps many times over the run
        rt, = runtimes([pub], cfg={"capture_qk": False, "host_ring_bytes": 6 * n * geo.hidden_size * 4},
                       geo=geo)
        ring = rt._ring
        engine = Engine([rt], geo=geo)
        spec = {"capture": {"hidden_states": {"layers": [1], "positions": "all"}}}
        for i in range(n):
            engine.add(f"v{i}", spec, 1)
        broker.pause()
        steps = 40
        for k in range(steps):
            engine.step([(f"v{i}", k, 1) for i in range(n)], sample=False)
            assert rt.wait_drained(10)
        broker.resume()
        for i in range(n):
            rt.finish_request(f"v{i}", "length", steps + 1)
        assert rt.wait_drained(10)
        msgs = broker.wait_for(lambda got: ended(got) == n, timeout=20)
        drops = rt.stats["dropped_frames"]
        rt.close()
    finally:
        pub.close()
        broker.close()
    assert drops == 0 and not broker.malformed
    assert views and all(views[1:])  # every decode step went out as a view of the host ring
    streams = per_request(msgs)
    for i in range(n):
        m = streams[f"s-v{i}"]
        seqs_exact(m)
        frames = [f for _, k, f, _ in m if k == "frame"]
        assert [f.positions for f in frames] == [[k] for k in range(steps)]
        for f in frames:
            check_rows(f, engine.index[f"v{i}"], geo=geo)
