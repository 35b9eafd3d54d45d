"""Bad input never takes the broker down: fuzzed garbage and mutated frames over real sockets,
wrong schema versions and oversized messages are counted and reported, and a good stream still flows."""

from __future__ import annotations

import time

import msgpack
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bus_helpers import account, assert_exact, events_until, processes, publish_stream, run_dir, start_broker, stats
from mia_stream import _transport
from mia_stream.consumers import open_stream
from mia_stream.producer.publisher import FramePublisher
from mia_stream.schemas import (AnalysisBatch, ErrorNotice, RowGroup, StepBatch, StreamStart, Tensor, TensorFrame,
                                TokenBatch, decode, encode, encode_batch)
import numpy as np


@pytest.fixture(scope="module")
def broker_dir():
    with run_dir() as d, processes() as procs:
        procs.append(start_broker(d, "--max-message-bytes", str(1 << 20)))
        yield d


def _dealer(endpoint: str) -> zmq.Socket:
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.SNDHWM, 100_000)
    s.connect(endpoint)
    return s


def _valid_frames(seq: int) -> list[bytes]:
    """A valid message to mutate: a tensor frame, or (schema 2.0) a step batch, token batch or analysis naming
    three requests (the broker routes those per request, with selections)."""
    arr = np.arange(64, dtype=np.float32).reshape(1, 1, 64)
    ids = ["fuzz-req", f"fuzz-{seq % 7}", "other"]
    kind = seq % 4
    if kind == 0:
        msg = TensorFrame("fuzz-req", "fuzzer", 7, seq, seq, tensors=[Tensor.from_array("hs", arr)])
    elif kind == 1:
        hs = np.arange(3 * 2 * 16, dtype=np.float32).reshape(1, 6, 16)
        msg = StepBatch("fuzzer", 7, seq, ids, [seq] * 3, groups=[
            RowGroup([0, 1, 2], [1, 2, 3], np.arange(6), [Tensor.from_array("hs", hs, layers=(1,))])])
    elif kind == 2:
        msg = TokenBatch("fuzzer", 7, seq, ids, [seq] * 3, counts=[1, 0, 2], token_ids=[5, 6, 7])
    else:
        msg = AnalysisBatch("fuzz-analyzer", 7, "probe", ids, [seq] * 3, rows=[1, 1, 2],
                            values={"score": np.arange(4, dtype=np.float32)}, labels={"tag": ["a", None, "b", "c"]})
    return [bytes(memoryview(f)) for f in encode(msg)]


def _mutate(frames: list[bytes], data) -> list[bytes]:
    frames = list(frames)
    i = data.draw(st.integers(0, len(frames) - 1))
    op = data.draw(st.sampled_from(["flip", "truncate", "drop", "extra", "header"]))
    if op == "flip" and frames[i]:
        b = bytearray(frames[i])
        j = data.draw(st.integers(0, len(b) - 1))
        b[j] ^= data.draw(st.integers(1, 255))
        frames[i] = bytes(b)
    elif op == "truncate":
        frames[i] = frames[i][: data.draw(st.integers(0, max(0, len(frames[i]) - 1)))]
    elif op == "drop":
        del frames[i]
    elif op == "extra":
        frames.append(data.draw(st.binary(max_size=64)))
    else:
        header = msgpack.unpackb(frames[1])
        key = data.draw(st.sampled_from(sorted(header)))
        header[key] = data.draw(st.one_of(st.none(), st.integers(-(2**63), 2**63 - 1), st.text(max_size=8), st.lists(st.integers(0, 2**32)),
                                          st.binary(max_size=8), st.booleans()))
        frames[1] = msgpack.packb(header)
    return frames


_garbage = st.lists(st.binary(max_size=200), min_size=0, max_size=5)


_SOCKETS: dict[str, tuple] = {}


def _fuzz_sockets(address: str) -> tuple:
    if address not in _SOCKETS:
        eps = _transport.endpoints_for(address)
        _SOCKETS.clear()
        _SOCKETS[address] = (_dealer(eps.producers), _dealer(eps.consumers))
    return _SOCKETS[address]


@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_fuzzed_frames_never_take_the_broker_down(broker_dir, data):
    prod, cons = _fuzz_sockets(broker_dir)
    for _ in range(data.draw(st.integers(1, 5))):
        if data.draw(st.booleans()):
            frames = data.draw(_garbage)
        else:
            frames = _mutate(_valid_frames(data.draw(st.integers(0, 1000))), data)
        target = prod if data.draw(st.booleans()) else cons
        if frames:
            target.send_multipart(frames)


def _serve_an_honest_stream(broker_dir, rid: str, frames: int, nbytes: int, timeout: float) -> None:
    """A valid stream published after the fuzzing arrives whole and exact."""
    pub = FramePublisher(broker_dir, producer_id=f"{rid}-producer")
    try:
        with open_stream(broker_dir, patterns=(rid,), timeout=10) as events:
            time.sleep(0.3)
            publish_stream(pub, rid, frames, nbytes, tokens=True)
            rec = account(events_until(events, 1, timeout))[rid]
    finally:
        pub.close()
    assert_exact(rec)
    assert rec["gap_seqs"] == [] and rec["steps"] == list(range(frames))


def test_after_fuzzing_the_broker_still_serves_a_valid_stream(broker_dir):
    test_fuzzed_frames_never_take_the_broker_down(broker_dir)  # run the fuzzer first (also standalone)
    _serve_an_honest_stream(broker_dir, "honest-1", frames=50, nbytes=4096, timeout=10)
    totals = stats(broker_dir)["totals"]
    assert totals["malformed"] > 0
    assert totals.get("internal_errors", 0) == 0


def _mutated_batch(data) -> list[bytes]:
    """A batch of valid messages with one mutation: in its own header, or in one carried message."""
    messages = [_valid_frames(data.draw(st.integers(0, 1000))) for _ in range(data.draw(st.integers(1, 4)))]
    if data.draw(st.booleans()):
        i = data.draw(st.integers(0, len(messages) - 1))
        messages[i] = _mutate(messages[i], data)
    frames = [bytes(memoryview(f)) for f in encode_batch(messages)]
    if data.draw(st.booleans()):
        header = msgpack.unpackb(frames[1])
        header[data.draw(st.sampled_from(sorted(header)))] = data.draw(st.one_of(
            st.none(), st.integers(-3, 2**32), st.text(max_size=8), st.binary(max_size=8), st.booleans(),
            st.lists(st.one_of(st.integers(-2, 8), st.booleans(), st.none()), max_size=6)))
        frames[1] = msgpack.packb(header)
    return frames


@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_fuzzed_batches_never_take_the_broker_down(broker_dir, data):
    prod, cons = _fuzz_sockets(broker_dir)
    (prod if data.draw(st.booleans()) else cons).send_multipart(_mutated_batch(data))


def test_after_fuzzing_batches_the_broker_counts_them_and_still_serves(broker_dir):
    test_fuzzed_batches_never_take_the_broker_down(broker_dir)
    before = stats(broker_dir)["totals"]
    _serve_an_honest_stream(broker_dir, "honest-b-1", frames=2000, nbytes=256, timeout=20)
    totals = stats(broker_dir)["totals"]
    assert before["malformed_batches"] > 0 and before["batches_in"] > 0
    assert totals["batches_in"] > before["batches_in"] and totals["batches_out"] > before.get("batches_out", 0)
    assert totals.get("internal_errors", 0) == 0


def test_wrong_schema_version_and_oversized_are_counted_and_reported(broker_dir):
    eps = _transport.endpoints_for(broker_dir)
    before = stats(broker_dir)["totals"]
    prod = _dealer(eps.producers)
    try:
        frames = [bytes(memoryview(f)) for f in encode(StreamStart("v9", "old", 1))]
        header = msgpack.unpackb(frames[1])
        header["v"] = [9, 0]
        prod.send_multipart([frames[0], msgpack.packb(header)])
        # three frames under zmq's per-frame limit but 1.5 MiB together: over the broker's 1 MiB limit
        big = _valid_frames(1)
        prod.send_multipart([big[0], big[1], b"\0" * (1 << 19), b"\0" * (1 << 19), b"\0" * (1 << 19)])
        replies = []
        while prod.poll(2000) and len(replies) < 2:
            msg = decode(prod.recv_multipart())
            if isinstance(msg, ErrorNotice):
                replies.append(msg.code)
    finally:
        prod.close()
    after = stats(broker_dir)["totals"]
    assert sorted(replies) == ["oversized", "schema_version"]
    assert after["schema_version"] == before.get("schema_version", 0) + 1
    assert after["oversized"] == before.get("oversized", 0) + 1
