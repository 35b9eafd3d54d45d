"""TP merge: two rank publishers (separate processes' worth of sockets) send sharded q/k; the SDK merges them."""

from __future__ import annotations

import time

import numpy as np
import pytest

from bus_helpers import processes, run_dir, start_broker, stats, wait_for
from mia_stream.consumers import StreamAssembler, open_stream
from mia_stream.errors import IncompleteShardError
from mia_stream.bus.publisher import FramePublisher
from mia_stream.schemas import Shard, StreamEnd, StreamStart, Tensor, TensorFrame, TokenFrame, decode, encode

L, T, HEADS, KV, D, H = 2, 3, 4, 2, 8, 16


def _full(step: int):
    rng = np.random.default_rng(step)
    return (rng.standard_normal((L, T, HEADS, D)).astype(np.float32),
            rng.standard_normal((L, T, KV, D)).astype(np.float32),
            rng.standard_normal((L, T, H)).astype(np.float32))


def _publish_rank(pub, rank: int, steps, skip=()):
    rid = "tp-req"
    pub.publish(StreamStart(rid, pub.producer_id, pub.epoch, pub.next_seq(rid), tp_rank=rank, tp_size=2))
    for step in steps:
        q, k, hs = _full(step)
        if step in skip:
            pub.next_seq(rid)  # this rank's frame for the step is lost (its seq is skipped)
            continue
        qs, ks = slice(rank * HEADS // 2, (rank + 1) * HEADS // 2), slice(rank * KV // 2, (rank + 1) * KV // 2)
        tensors = [Tensor.from_array("q", np.ascontiguousarray(q[:, :, qs]), layers=(0, 1),
                                     shard=Shard(rank, 2, 2, qs.start, qs.stop, HEADS)),
                   Tensor.from_array("k", np.ascontiguousarray(k[:, :, ks]), layers=(0, 1),
                                     shard=Shard(rank, 2, 2, ks.start, ks.stop, KV))]
        if rank == 0:
            tensors.insert(0, Tensor.from_array("hs", hs, layers=(0, 1)))
        pub.publish(TensorFrame(rid, pub.producer_id, pub.epoch, pub.next_seq(rid), step, positions=[0, 1, 2],
                                tensors=tensors))
        if rank == 0:
            pub.publish(TokenFrame(rid, pub.producer_id, pub.epoch, pub.next_seq(rid), step, token_ids=[step]))
    pub.publish(StreamEnd(rid, pub.producer_id, pub.epoch, pub.next_seq(rid)))


@pytest.mark.parametrize("lose_step", [None, 2])
def test_tp2_shards_merge_to_the_full_tensor_and_a_missing_rank_is_never_partial(lose_step):
    steps = range(5)
    with run_dir() as d, processes() as procs:
        procs.append(start_broker(d))
        ranks = [FramePublisher(d, producer_id=f"rank{r}") for r in range(2)]
        try:
            with open_stream(d, patterns=("tp-*",), timeout=10) as events:
                # Subscribe has no ack: wait until the broker has it, or it may come after both streams ended
                # (a live subscriber then gets nothing of them)
                wait_for(lambda: any("tp-*" in c.get("patterns", ()) for c in stats(d)["consumers"].values()))
                _publish_rank(ranks[1], 1, steps, skip={lose_step})  # rank 1 first: order must not matter
                _publish_rank(ranks[0], 0, steps)
                got = []
                for ev in events:
                    got.append(ev)
                    if ev.kind == "end":
                        break
        finally:
            for p in ranks:
                p.close()
    _check_merged(got, steps, lose_step)


def _check_merged(got, steps, lose_step):
    kinds = [e.kind for e in got]
    assert kinds[0] == "start" and kinds[-1] == "end"
    frames = [e.frame for e in got if e.kind == "frame"]
    incomplete = [e for e in got if e.kind == "gap" and e.gap.reason == "incomplete_shards"]
    expected_steps = [s for s in steps if s != lose_step]
    assert [f.step for f in frames] == expected_steps
    for f in frames:
        q, k, hs = _full(f.step)
        np.testing.assert_array_equal(f.tensors["q"], q)
        np.testing.assert_array_equal(f.tensors["k"], k)
        np.testing.assert_array_equal(f.tensors["hs"], hs)
        assert f.raw_tensors["q"].shard is None and f.layers["q"] == (0, 1)
    stream = got[0].stream
    assert stream.tp_size == 2 and sorted(stream.starts) == [0, 1]
    assert stream.generated_token_ids == list(steps)
    if lose_step is None:
        assert not incomplete
    else:
        assert len(incomplete) == 1
        err = incomplete[0].error
        assert isinstance(err, IncompleteShardError) and err.step == lose_step and err.missing_ranks == [1]
        # rank 1's own stream also reports the lost seq
        assert any(e.kind == "gap" and e.gap.origin == "consumer" and e.gap.reason == "seq_jump" for e in got)


def test_shards_that_do_not_tile_are_refused():
    from mia_stream.consumers import merge_shards

    def frame(rank, start, stop):
        arr = np.zeros((1, 1, stop - start, 2), np.float32)
        return TensorFrame("r", f"p{rank}", 1, 1, 0, tensors=[
            Tensor.from_array("q", arr, shard=Shard(rank, 2, 2, start, stop, 4))])

    with pytest.raises(IncompleteShardError):
        merge_shards({0: frame(0, 0, 2), 1: frame(1, 1, 4)}, 2)  # overlap
    with pytest.raises(IncompleteShardError):
        merge_shards({0: frame(0, 0, 2)}, 2)  # a rank missing
    merged = merge_shards({0: frame(0, 0, 2), 1: frame(1, 2, 4)}, 2)
    assert merged.tensors["q"].shape == (1, 1, 4, 2)


class _Capture:
    """A stand-in for a rank's FramePublisher that keeps what it publishes (encoded and decoded, as on the wire)."""

    def __init__(self, producer_id: str):
        self.producer_id, self.epoch, self.messages, self._seq = producer_id, 7, [], 0

    def next_seq(self, request_id: str) -> int:
        self._seq += 1
        return self._seq - 1

    def publish(self, msg) -> None:
        self.messages.append(decode(encode(msg)))


def _rank_messages(lose_step):
    caps = [_Capture(f"rank{r}") for r in range(2)]
    for r in (0, 1):
        _publish_rank(caps[r], r, range(5), skip={lose_step} if r == 1 else ())
    return [c.messages for c in caps]


@pytest.mark.parametrize("lose_step", [None, 2])
def test_a_rank_whose_whole_stream_arrives_after_rank0_ended_is_still_merged(lose_step):
    """The ranks are separate producers: nothing orders rank 1's stream against rank 0's. Rank 0's whole stream,
    StreamEnd included, then rank 1's: the request must not end before rank 1 did."""
    r0, r1 = _rank_messages(lose_step)
    asm = StreamAssembler()
    got = []
    for m in r0:
        got += asm.feed(m)
    assert [e.kind for e in got if e.kind in ("end", "gap")] == [] and asm.holding  # waiting for rank 1
    for m in r1:
        got += asm.feed(m)
    deadline = time.monotonic() + 5
    while asm.holding and time.monotonic() < deadline:  # rank 1's reorder timeout after its lost seq
        time.sleep(0.05)
        got += asm.flush()
    _check_merged(got, range(5), lose_step)
    assert not asm.holding


@pytest.mark.parametrize("how", ["live", "replay"])
def test_a_rank_that_never_starts_is_waited_for_then_reported_missing(how):
    r0, _ = _rank_messages(None)
    asm = StreamAssembler(rank_wait_s=2.0)
    got = []
    for m in r0:
        got += asm.feed(m, 100.0)
    assert not [e for e in got if e.kind in ("frame", "end")] and asm.holding
    if how == "live":
        assert asm.flush(101.9) == []  # still within rank_wait_s
        got += asm.flush(102.0)
    else:
        got += asm.finish()  # a recording ended: nothing more will come
    assert got[-1].kind == "end" and not asm.holding
    assert not [e for e in got if e.kind == "frame"]  # never merged partially
    incomplete = [e for e in got if e.kind == "gap" and e.gap.reason == "incomplete_shards"]
    assert [e.error.step for e in incomplete] == list(range(5))
    assert all(e.error.missing_ranks == [1] for e in incomplete)
    assert asm.counters["ranks_never_started"] == 1
