"""Property-based fuzzing of what peers control (issue 24): the codec's ``decode`` / ``decode_header`` and the
router's ``producer_message`` / ``consumer_message`` get valid messages with mutated headers (values replaced by
huge, negative, NaN, bytes, deep or long ones; keys dropped or added; header bytes flipped). Each input must end
in a wire error or a result, never another exception (the router counts one as ``internal_errors``), within a
time and memory budget per input.

Deterministic for CI: ``derandomize=True`` and a fixed ``max_examples`` (about 20 s in all on a loaded 2-core
machine).
"""

from __future__ import annotations

import json
import math
import time
import tracemalloc

import msgpack
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mia_stream.broker._routing import BrokerConfig, Router
from mia_stream.bus.transport import BrokerEndpoints
from mia_stream.errors import WireError
from mia_stream.schemas import (AnalysisBatch, Credit, GapBatch, GapNotice, Heartbeat, RowGroup, StepBatch,
                                SteeringCommand, StreamEnd, StreamStart, Subscribe, Tensor, TensorFrame, TokenBatch,
                                TokenFrame, decode, decode_header, encode)

EPS = BrokerEndpoints("ipc:///nonexistent/producers.sock", "ipc:///nonexistent/consumers.sock",
                      "ipc:///nonexistent/stats.sock")
TIME_PER_INPUT_S = 1.0  # generous: a loaded 2-core machine; the attacks this guards against took 5-46 s
MEMORY_PER_INPUT = 64 << 20  # Python allocations at peak while one input is handled

_HS = Tensor.from_array("hs", np.arange(8, dtype=np.float32).reshape(1, 2, 4), layers=(3,))
PRODUCER_SEEDS = [
    StreamStart("r1", "p", 1, 0, prompt_token_ids=[1, 2], tags={"a": "b"}),
    TensorFrame("r1", "p", 1, 1, 0, positions=[0, 1], token_ids=[5, 6], tensors=[_HS]),
    TokenFrame("r1", "p", 1, 2, 0, token_ids=[7]),
    GapNotice("r1", "p", 1, [[3, 4]], "queue_full", "producer"),
    StreamEnd("r1", "p", 1, 5, finish_reason="length"),
    Heartbeat("p", "producer", 1, 0, {"x": 1}),
    StepBatch("p", 1, 3, ["r1", "r2"], [6, 1],
              [RowGroup(np.array([0, 1]), np.array([1, 1]), np.array([4, 0]),
                        [Tensor.from_array("hs", np.zeros((1, 2, 4), np.float32), layers=(0,))])]),
    TokenBatch("p", 1, 3, ["r1", "r2"], [7, 2], token_ids=[9, 9]),
    AnalysisBatch("analyzer/x", 1, "risk", ["r1"], [0], alerts=[1], values={"score": np.array([0.5])},
                  labels={"why": ["x"]}),
    GapBatch.of("p", 1, [("r1", [[8, 8]]), ("r2", [[2, 3]])], "queue_full", "producer"),
]
CONSUMER_SEEDS = [Subscribe(["r*"], window_bytes=1 << 20), Credit(4096), SteeringCommand("c1", "r1", "abort")]

# values an attacker may put anywhere in a header
_scalars = st.one_of(
    st.integers(min_value=-(1 << 63), max_value=(1 << 64) - 1), st.sampled_from([0, -1, 1 << 40, (1 << 64) - 1]),
    st.floats(allow_nan=True, allow_infinity=True), st.booleans(), st.none(), st.text(max_size=20),
    st.binary(max_size=64))
_values = st.recursive(_scalars, lambda inner: st.one_of(st.lists(inner, max_size=6),
                                                         st.dictionaries(st.one_of(st.text(max_size=8), st.integers()),
                                                                         inner, max_size=4)), max_leaves=20)
_big = st.one_of(
    st.builds(lambda n, d: [d] * n, st.integers(0, 5000), st.sampled_from([0, 1, (1 << 64) - 1, 1 << 40, -3])),
    st.builds(lambda n: "x" * n, st.integers(0, 100_000)),
    st.builds(lambda depth: _nested(depth), st.integers(0, 500)),
    st.builds(lambda n: list(range(n)), st.integers(0, 20_000)))


def _nested(depth: int):
    out: list = []
    cur = out
    for _ in range(depth):
        nxt: list = []
        cur.append(nxt)
        cur = nxt
    return out


def _paths(value, prefix=()):
    """Every (path) into a header's maps and arrays, the header itself first."""
    yield prefix
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(value, list) and len(value) <= 16:
        for i, v in enumerate(value):
            yield from _paths(v, prefix + (i,))


def _set(root, path, value):
    cur = root
    for k in path[:-1]:
        cur = cur[k]
    cur[path[-1]] = value


@st.composite
def mutated(draw, seeds):
    msg = draw(st.sampled_from(seeds))
    frames = [bytes(f) if not isinstance(f, bytes) else f for f in encode(msg)]
    header = msgpack.unpackb(frames[1], raw=False, strict_map_key=False)
    for _ in range(draw(st.integers(1, 4))):
        paths = [p for p in _paths(header) if p]
        op = draw(st.sampled_from(["replace", "big", "drop", "add", "bytes"]))
        if op in ("replace", "big") and paths:
            path = draw(st.sampled_from(paths))
            _set(header, path, draw(_values if op == "replace" else _big))
        elif op == "drop" and paths:
            path = draw(st.sampled_from(paths))
            parent = header
            for k in path[:-1]:
                parent = parent[k]
            if isinstance(parent, dict):
                parent.pop(path[-1], None)
        elif op == "add":
            header[draw(st.text(max_size=8))] = draw(_values)
    try:
        packed = msgpack.packb(header, use_bin_type=True)
    except (TypeError, ValueError, OverflowError):
        packed = frames[1]
    if draw(st.booleans()) and packed:  # and a few bytes flipped
        data = bytearray(packed)
        for i in draw(st.lists(st.integers(0, len(data) - 1), max_size=4)):
            data[i] ^= draw(st.integers(1, 255))
        packed = bytes(data)
    buffers = frames[2:]
    if draw(st.booleans()) and buffers:
        buffers = [b[:draw(st.integers(0, len(b)))] for b in buffers]
    return [frames[0], packed, *buffers]


def _bounded(fn, *args):
    """Run ``fn``; its time and peak Python memory must stay within the per-input budget."""
    tracemalloc.start()
    t0 = time.perf_counter()
    try:
        return fn(*args)
    finally:
        elapsed = time.perf_counter() - t0
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        assert elapsed < TIME_PER_INPUT_S, f"{elapsed:.2f} s for one input"
        assert peak < MEMORY_PER_INPUT, f"{peak >> 20} MiB for one input"


def _decodes(frames):
    for fn in (decode_header, decode):
        try:
            fn(frames, max_message_bytes=1 << 24)
        except WireError:
            pass


_FUZZ = settings(max_examples=1000, derandomize=True, deadline=None, database=None,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@_FUZZ
@given(mutated(PRODUCER_SEEDS + CONSUMER_SEEDS))
def test_decode_and_decode_header_raise_only_wire_errors_within_budget(frames):
    _bounded(_decodes, frames)


def _router() -> Router:
    router = Router(BrokerConfig(EPS, max_message_bytes=1 << 24), instance=7, wall_ns=lambda: 1, now=1000.0)
    for seed in CONSUMER_SEEDS[:1] + [Subscribe(["*"], consumer_id="all")]:
        router.consumer_message(b"c/1", encode(seed), 1000.0)
    for seed in PRODUCER_SEEDS[:3]:
        router.producer_message(b"p/1", encode(seed), 1000.0)
    return router


@_FUZZ
@given(mutated(PRODUCER_SEEDS), st.sampled_from([b"p/1", b"other/1"]))
def test_router_producer_message_never_fails_internally(frames, identity):
    router = _router()
    _bounded(router.producer_message, identity, frames, 1000.1)
    router.tick(1000.2)
    assert router.counters.internal_errors == 0
    json.dumps(router.stats(1000.3), allow_nan=False)  # the monitor's JSON stats reply still builds
    assert math.isfinite(len(router.take_outbox()))


@_FUZZ
@given(mutated(CONSUMER_SEEDS))
def test_router_consumer_message_never_fails_internally(frames):
    router = _router()
    _bounded(router.consumer_message, b"c/1", frames, 1000.1)
    router.tick(1000.2)
    assert router.counters.internal_errors == 0
