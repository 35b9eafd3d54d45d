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
