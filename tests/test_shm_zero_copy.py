"""Zero-copy ring reads (issue 29): a consumer on the broker's host reads producers' shared-memory rings in place.

Its tensors are read-only views of the ring's mapping, checked when handed out and when released; an overwrite
while a view is in use is a counted "gap" event, never silently torn data. The reference is today's copy path:
a second consumer of the same live stream of a real vLLM engine with ``zero_copy=False``.
"""

from __future__ import annotations

import mmap
import time
import uuid

import numpy as np
import pytest

from bus_helpers import payload, run_dir, start_broker, kill, wait_for
from mia_stream.bus.publisher import FramePublisher
from mia_stream.bus.shm_ring import shm_available
from mia_stream.consumers import open_batches, open_stream
from mia_stream.schemas import StreamEnd, StreamStart, Tensor, TensorFrame
from mia_stream.schemas._oob import RING_NAME

pytestmark = pytest.mark.skipif(not shm_available(), reason="needs a writable /dev/shm")


def _views_a_mapping(arr: np.ndarray) -> bool:
    """Whether ``arr``'s memory is an mmap's (numpy's base chain ends in a memoryview of the mapping)."""
    obj = arr
    while isinstance(obj, np.ndarray):
        obj = obj.base
    return isinstance(obj, memoryview) and isinstance(obj.obj, mmap.mmap)


class _Collector:
    """A live consumer that records, while each event is in use, its frames' bytes and whether they view a ring."""

    def __init__(self, address: str, patterns, batches: bool = False, **options):
        opener = open_batches if batches else open_stream
        self.stream = opener(address, patterns=patterns, timeout=None, **options)
        self.frames: dict = {}  # (request, step, part) -> (positions, {name: (layers, bytes, dtype, shape)})
        self.views: list[bool] = []  # per ring-sized tensor: viewed the mapping
        self.writeable: list[bool] = []
        self.batch_rows = 0
        self.ended: set = set()
        self.gaps: list = []

    def drain(self, rids, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        src = self.stream._source
        while not self.ended >= set(rids):
            assert time.monotonic() < deadline, f"ended {sorted(self.ended)} of {rids}"
            for ev in src.events(timeout=0.5):
                if ev.kind == "frame":
                    f = ev.frame
                    rec = {}
                    for n, t in f.raw_tensors.items():
                        raw = t.raw()
                        rec[n] = (tuple(t.layers), raw.tobytes(), t.dtype, raw.shape)
                        if t.nbytes >= 16 << 10 or raw.nbytes >= 16 << 10:
                            self.views.append(_views_a_mapping(raw))
                            self.writeable.append(bool(raw.flags.writeable))
                    self.frames[(ev.stream.request_id, f.step, f.part)] = (list(f.positions), rec)
                elif ev.kind == "batch" and ev.batch.KIND == "step_batch":
                    for g in ev.batch.groups:
                        for t in g.tensors:
                            raw = t.raw()
                            if raw.nbytes >= 16 << 10:
                                self.views.append(_views_a_mapping(raw))
                                self.writeable.append(bool(raw.flags.writeable))
                                self.batch_rows += raw.shape[1]
                elif ev.kind == "end":
                    self.ended.add(ev.stream.request_id)
                elif ev.kind == "gap":
                    self.gaps.append(ev)

    @property
    def client(self):
        return self.stream.client

    def close(self):
        self.rings = list(self.client._shm._rings)  # the rings it read from, before they are unmapped
        self.stream.close()


def test_zero_copy_views_give_the_copy_paths_bytes_for_a_real_engine_stream(engine, broker_address):
    """Three consumers of one live capture (hidden states of every layer at every position, Q/K of one layer):
    zero-copy per request, copy per request (today's path) and zero-copy in batch mode. The zero-copy frames are
    byte-identical to the copied ones; their ring-held tensors view the mapping, read-only, and nothing was
    copied out of the ring for them, where the copy path copied every ring byte."""
    from vllm import SamplingParams

    tag = uuid.uuid4().hex[:8]
    patterns = [f"zc-{tag}-*"]
    zc = _Collector(broker_address, patterns, consumer_id=f"zc-{tag}", zero_copy=True)
    cp = _Collector(broker_address, patterns, consumer_id=f"cp-{tag}", zero_copy=False)
    zb = _Collector(broker_address, patterns, batches=True, consumer_id=f"zb-{tag}", zero_copy=True)
    readers = (zc, cp, zb)
    try:
        time.sleep(1.0)  # subscriptions reach the broker before the engine publishes
        prompts = ["The capital of France is", "Write a haiku about the sea:", "Two plus two equals"]
        spec = {"capture": {"hidden_states": {"layers": "all", "positions": "all"},
                            "qk": {"layers": [15], "heads": "all", "positions": "all"}}}
        params = [SamplingParams(max_tokens=8, temperature=0,
                                 extra_args={"mia_stream": {**spec, "id": f"zc-{tag}-{i}"}}) for i in range(3)]
        outs = engine.generate(prompts, params, use_tqdm=False)
        rids = [f"zc-{tag}-{i}" for i in range(3)]
        for r in readers:
            r.drain(rids)
    finally:
        for r in readers:
            r.close()
    assert not any(r.gaps for r in readers)
    assert zc.frames.keys() == cp.frames.keys()
    for rid, out in zip(rids, outs):  # every position the engine computed (the last token's is never computed)
        got = sorted(p for k, (pos, _) in zc.frames.items() if k[0] == rid for p in pos)
        assert got == list(range(len(out.prompt_token_ids) + len(out.outputs[0].token_ids) - 1)), rid
    for key, (positions, tensors) in cp.frames.items():
        assert zc.frames[key][0] == positions, key
        assert zc.frames[key][1] == tensors, key  # layers, bytes, dtype and shape of every tensor
    assert zc.views and all(zc.views) and not any(zc.writeable)
    assert zb.views and all(zb.views) and not any(zb.writeable)
    assert cp.views and not any(cp.views)
    assert zc.client.ring_bytes["copied"] == 0 and zc.client.ring_bytes["viewed"] > 0
    assert zb.client.ring_bytes["copied"] == 0 and zb.client.ring_bytes["viewed"] > 0
    assert cp.client.ring_bytes["viewed"] == 0 and cp.client.ring_bytes["copied"] > 0
    assert zc.client.ring_bytes["viewed"] == cp.client.ring_bytes["copied"]
    # the rows came by reference into the engine worker's host ring, not through the drain sidecar's own ring
    owners = {_cmdline(int(RING_NAME.fullmatch(name).group(1))) for name in zc.rings}
    assert owners and not any("mia_stream.producer._sidecar" in c for c in owners), owners


def _cmdline(pid: int) -> str:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().replace(b"\0", b" ").decode(errors="replace")


def _frame(pub, rid: str, seq: int, nbytes: int) -> TensorFrame:
    return TensorFrame(rid, pub.producer_id, pub.epoch, seq, seq, positions=[seq], token_ids=[seq],
                       tensors=[Tensor.from_array("hs", payload(seq, nbytes), layers=(0,))], time_ns=time.time_ns())


def test_a_view_overwritten_while_in_use_is_a_counted_gap_and_keep_holds_the_bytes():
    """A broker process, a publisher with a 1 MiB ring and no source bound, one zero-copy consumer. While the
    consumer holds request A's frame of seq 1, the publisher writes 2 MiB of another request's frames: the held
    view's bytes change under it (the writer never waits), so releasing the event yields a "gap" event of reason
    ``shm_overrun_in_use`` naming seq 1, counted; ``event.keep()`` taken before still holds seq 1's values.
    A's seq 2, published before the overwrite, is never delivered torn: it is a ``shm_overrun`` gap."""
    nbytes = 256 << 10
    with run_dir() as d:
        address = f"ipc://{d}"
        broker = start_broker(address)
        try:
            pub = FramePublisher(address, producer_id="zc-pub", shm_bytes=1 << 20, shm_ahead_bytes=0)
            stream = open_stream(address, patterns=["a"], timeout=10, zero_copy=True)
            try:
                wait_for(lambda: pub.broker_shm, timeout=10)
                time.sleep(0.5)  # the subscription reaches the broker
                pub.publish(StreamStart("a", pub.producer_id, pub.epoch, pub.next_seq("a"), prompt_token_ids=[1],
                                        time_ns=time.time_ns()))
                for _ in range(2):
                    pub.publish(_frame(pub, "a", pub.next_seq("a"), nbytes))
                assert pub.flush(5)
                events = iter(stream)
                assert next(events).kind == "start"
                held = next(events)
                assert held.kind == "frame" and held.frame.step == 1
                hs = held.frame.tensors["hs"]
                assert _views_a_mapping(hs) and not hs.flags.writeable
                assert (hs == 1.0).all()  # seq 1's values
                kept = held.keep()
                for _ in range(8):  # 2 MiB of request b's frames into the 1 MiB ring
                    pub.publish(_frame(pub, "b", pub.next_seq("b"), nbytes))
                assert pub.flush(5)
                assert not (hs == 1.0).all()  # torn under the consumer: what the check must report
                assert (kept.frame.tensors["hs"] == 1.0).all() and not _views_a_mapping(kept.frame.tensors["hs"])
                pub.publish(StreamEnd("a", pub.producer_id, pub.epoch, pub.next_seq("a"), num_generated_tokens=2))
                assert pub.flush(5)
                rest = []
                for ev in events:
                    rest.append(ev)
                    if ev.kind == "frame":  # anything delivered holds its own seq's values while in use
                        assert (ev.frame.tensors["hs"] == float(ev.frame.step)).all()
                    if ev.kind == "end":
                        break
                gaps = [(ev.gap.reason, ev.gap.missing) for ev in rest if ev.kind == "gap"]
                assert gaps[0] == ("shm_overrun_in_use", [[1, 1]])
                assert ("shm_overrun", [[2, 2]]) in gaps
                assert not [ev for ev in rest if ev.kind == "frame"]
                counters = stream.client.counters
                assert counters["shm_overrun_in_use"] == 1
                assert rest[-1].kind == "end"
                assert held.stream.gap_seqs == 2  # seq 1 (in use) and seq 2
            finally:
                stream.close()
                pub.close()
        finally:
            kill(broker)


def test_the_copy_path_is_unaffected_by_a_later_overwrite():
    """The same sequence with ``zero_copy=False``: the held frame's tensors are the consumer's own copy, so the
    overwrite changes nothing and no in-use gap is reported."""
    nbytes = 256 << 10
    with run_dir() as d:
        address = f"ipc://{d}"
        broker = start_broker(address)
        try:
            pub = FramePublisher(address, producer_id="cp-pub", shm_bytes=1 << 20, shm_ahead_bytes=0)
            stream = open_stream(address, patterns=["a"], timeout=3, zero_copy=False)
            try:
                wait_for(lambda: pub.broker_shm, timeout=10)
                time.sleep(0.5)
                pub.publish(StreamStart("a", pub.producer_id, pub.epoch, pub.next_seq("a"), prompt_token_ids=[1],
                                        time_ns=time.time_ns()))
                pub.publish(_frame(pub, "a", pub.next_seq("a"), nbytes))
                assert pub.flush(5)
                events = iter(stream)
                assert next(events).kind == "start"
                held = next(events)
                hs = held.frame.tensors["hs"]
                assert not _views_a_mapping(hs)
                for _ in range(8):
                    pub.publish(_frame(pub, "b", pub.next_seq("b"), nbytes))
                pub.publish(StreamEnd("a", pub.producer_id, pub.epoch, pub.next_seq("a"), num_generated_tokens=1))
                assert pub.flush(5)
                assert (hs == 1.0).all()
                rest = []
                for ev in events:
                    rest.append(ev)
                    if ev.kind == "end":
                        break
                assert [ev.kind for ev in rest] == ["end"]
                assert stream.client.counters["shm_overrun_in_use"] == 0
            finally:
                stream.close()
                pub.close()
        finally:
            kill(broker)


def test_host_ring_rows_go_by_reference_and_the_engine_drops_rather_than_overwrite_them(tmp_path):
    """The producer's host ring is a /dev/shm ring: decode steps of requests captured alike go to the broker as
    references into it, and the publisher's own ring receives no byte (no copy after the engine's copy). While
    the broker does not read, references are in flight, so the engine may not reuse their chunks: with a ring of
    six steps' chunks it drops later steps at the source (``host_ring_full``: counted, each drop named by a gap)
    and never waits: all 20 steps return while the broker reads nothing (an engine that waited for the broker
    would never return from them). What arrives is every step's own rows, and once the broker reads again the
    engine captures every step again."""
    import tempfile

    from mia_stream.spec import ModelGeometry
    from stub_broker import StubBroker
    from test_drain import Engine, check_rows, ended, per_request, runtimes, seqs_exact

    geo = ModelGeometry(num_layers=2, hidden_size=4096, num_heads=2, num_kv_heads=2, head_dim=4)
    d = tempfile.mkdtemp(prefix="mia-", dir="/tmp")
    broker = StubBroker(d, shm=True)
    pub = FramePublisher(d, producer_id="hostref", shm_bytes=64 << 20)
    n = 4
    try:
        wait_for(lambda: pub.broker_shm_received, timeout=10)
        rt, = runtimes([pub], cfg={"capture_qk": False, "host_ring_bytes": 6 * n * geo.hidden_size * 4}, geo=geo)
        ring = rt._ring
        assert ring.name and (ring.size - 4096) < 2 * 6 * n * geo.hidden_size * 4
        engine = Engine([rt], geo=geo)
        spec = {"capture": {"hidden_states": {"layers": [1], "positions": "all"}}}
        for i in range(n):
            engine.add(f"v{i}", spec, 1)
        k = 0

        def run(steps):
            nonlocal k
            for _ in range(steps):
                engine.step([(f"v{i}", k, 1) for i in range(n)], sample=False)
                assert rt.wait_drained(10)
                k += 1

        run(5)
        wait_for(lambda: len(broker.messages) >= 5 + n, timeout=10)  # received: the ring is free again
        broker.pause()
        time.sleep(0.1)  # a message the broker was handling as it paused lands first
        read_before = len(broker.snapshot())
        run(20)  # six chunks fit; the rest find the ring held by references in flight
        read_while_paused = len(broker.snapshot()) - read_before
        paused_drops = rt.stats["dropped_frames"]
        broker.resume()
        wait_for(lambda: int(ring._received[0]) >= ring._read(5), timeout=10)  # the broker caught up
        run(5)
        for i in range(n):
            rt.finish_request(f"v{i}", "length", k + 1)
        assert rt.wait_drained(10)
        msgs = broker.wait_for(lambda got: ended(got) == n, timeout=20)
        stats = rt.stats
        rt.close()
    finally:
        pub.close()
        broker.close()
    assert not broker.malformed
    # every request lost the steps after the ring filled (six chunks, and what the broker read as it paused) ...
    assert paused_drops % n == 0 and paused_drops >= n * (20 - 10)
    assert stats["dropped_frames"] == paused_drops  # ... and none before the pause or after it
    assert read_while_paused == 0  # the 20 steps returned with the broker reading nothing: no step waited for it
    assert stats["ref_messages"] >= 5 + 6 + 5 and stats["ref_resets"] == 0
    assert pub.counters["host_ring_refs"] == stats["ref_messages"]
    assert pub.shm_ring.bytes == 0  # nothing was copied into the publisher's own ring
    streams = per_request(msgs)
    for i in range(n):
        m = streams[f"s-v{i}"]
        seqs_exact(m)
        gaps = [g for _, kind, g, _ in m if kind == "gap"]
        assert {g.reason for g in gaps} == {"host_ring_full"}
        frames = [f for _, kind, f, _ in m if kind == "frame"]
        positions = [f.positions[0] for f in frames]
        assert positions[:5] == list(range(5)) and positions[-5:] == list(range(k - 5, k))
        assert len(frames) + stats["dropped_frames"] // n == k
        for f in frames:
            check_rows(f, engine.index[f"v{i}"], geo=geo)


def test_only_the_producer_that_proved_its_host_ring_may_reference_it():
    """A producer's host ring (a /dev/shm ring its drain's publisher proves with ``add_ring_proof``) is referenced
    by that publisher and read by a consumer; a second peer (its own process) that references the same host ring,
    with a made-up proof, is refused (``shm_ring_not_owned``) and moves nothing of the ring's ``received``."""
    import json
    import subprocess
    import sys

    from bus_helpers import processes, stats
    from mia_stream.bus.shm_ring import ownership_proof
    from mia_stream.producer._host_ring import HostRing
    from test_bus_refusals import _FORGER, TESTS

    nbytes = 64 << 10
    ring = HostRing.create(1 << 20, shared=True)
    assert ring.name
    with run_dir() as d, processes() as procs:
        procs.append(start_broker(f"ipc://{d}"))
        with open_stream(f"ipc://{d}", patterns=("host-*",), timeout=20, consumer_id="host-reader") as events:
            wait_for(lambda: len(stats(d)["consumers"]) >= 1, timeout=10)
            pub = FramePublisher(f"ipc://{d}", producer_id="host-owner", shm_bytes=1 << 20)
            pub.add_ring_proof(ownership_proof(ring.name, ring.secret))
            try:
                wait_for(lambda: pub.broker_shm_received, timeout=10)
                wait_for(lambda: stats(d)["totals"].get("shm_rings_proven", 0) >= 2, timeout=10)
                pub.publish(StreamStart("host-0", pub.producer_id, pub.epoch, pub.next_seq("host-0")))
                offset, mark = ring.alloc(nbytes)  # what the engine's DMA would fill
                rows = ring.view(offset, nbytes).view(np.float32).reshape(1, 1, -1)
                rows[:] = 7.0
                refs = ring.references(mark)
                assert pub.publish(TensorFrame("host-0", pub.producer_id, pub.epoch, pub.next_seq("host-0"), 0,
                                               positions=[0], tensors=[Tensor.from_array("hs", rows, layers=(0,))]),
                                   host_ring=refs)
                assert refs.end == mark and refs.bytes == nbytes  # by reference: nothing copied
                wait_for(lambda: int(ring._received[0]) == mark, timeout=10)
                got = next(ev for ev in events if ev.kind == "frame")
                assert (got.frame.tensors["hs"] == 7.0).all()
                offset2, mark2 = ring.alloc(nbytes)  # written, not sent: a forger's target
                forger = subprocess.run([sys.executable, "-c", _FORGER, d, TESTS, ring.name,
                                         str(ring.position(offset2, mark2)), str(nbytes)],
                                        capture_output=True, text=True, timeout=60)
                assert forger.returncode == 0, forger.stderr
                replies = json.loads(forger.stdout)
                time.sleep(0.5)
                assert int(ring._received[0]) == mark  # the forged reference moved nothing
                totals = stats(d)["totals"]
            finally:
                pub.close()
    ring.unlink()
    ring.close()
    assert pub.counters["host_ring_refs"] == 1 and pub.shm_ring.bytes == 0
    assert totals["shm_ring_not_owned"] == 1 and totals["shm_ring_proof_refused"] == 1
    assert [r[1] for r in replies if r[0] == "error"] == ["shm_ring_not_owned", "shm_ring_not_owned"]


def test_the_host_ring_outlives_its_producer_for_the_brokers_grace_when_handed_over():
    """At exit the drain sidecar hands the host ring to the broker (as a publisher hands over its own ring): a
    consumer that has not yet read the last rows referenced in it reads them after the producer is gone, and the
    broker removes the file after its grace. A ring this publisher never proved is not offered."""
    import os

    from bus_helpers import processes, stats
    from mia_stream.bus.shm_ring import SHM_DIR, ownership_proof
    from mia_stream.producer._host_ring import HostRing

    nbytes = 64 << 10
    ring = HostRing.create(1 << 20, shared=True)
    path = os.path.join(SHM_DIR, ring.name)
    with run_dir() as d, processes() as procs:
        procs.append(start_broker(f"ipc://{d}", "--ring-grace", "3"))
        with open_stream(f"ipc://{d}", patterns=("late-*",), timeout=20, consumer_id="late-host-reader") as events:
            wait_for(lambda: len(stats(d)["consumers"]) >= 1, timeout=10)
            pub = FramePublisher(f"ipc://{d}", producer_id="host-exits", shm_bytes=1 << 20)
            pub.add_ring_proof(ownership_proof(ring.name, ring.secret))
            wait_for(lambda: pub.broker_shm_received, timeout=10)
            wait_for(lambda: stats(d)["totals"].get("shm_rings_proven", 0) >= 2, timeout=10)
            pub.publish(StreamStart("late-0", pub.producer_id, pub.epoch, pub.next_seq("late-0")))
            offset, mark = ring.alloc(nbytes)
            rows = ring.view(offset, nbytes).view(np.float32).reshape(1, 1, -1)
            rows[:] = np.arange(rows.size, dtype=np.float32)
            refs = ring.references(mark)
            assert pub.publish(TensorFrame("late-0", pub.producer_id, pub.epoch, pub.next_seq("late-0"), 0,
                                           positions=[0], tensors=[Tensor.from_array("hs", rows, layers=(0,))]),
                               host_ring=refs)
            pub.publish(StreamEnd("late-0", pub.producer_id, pub.epoch, pub.next_seq("late-0"), "length",
                                  frames_sent=3))
            assert pub.flush(10)
            assert not pub.hand_over_ring("mia-stream-ring-not-proven", lambda: None)
            taken = pub.hand_over_ring(ring.name, ring.mark_handed_over)
            pub.close()
            ring.close()  # the producer is gone; it did not remove the name: the broker took it
            assert taken and os.path.exists(path)
            got = [ev for ev in events if ev.kind in ("frame", "gap", "end")]  # read only now
            totals = stats(d)["totals"]
            wait_for(lambda: not os.path.exists(path), timeout=15)
    frames = [ev.frame for ev in got if ev.kind == "frame"]
    assert [ev.kind for ev in got] == ["frame", "end"]
    np.testing.assert_array_equal(frames[0].tensors["hs"].reshape(-1), np.arange(nbytes // 4, dtype=np.float32))
    assert totals["shm_rings_handed_over"] == 1
