"""The wire spec (docs/wire-format.md) against the code: a spec-only decoder (tests/spec_decoder.py) must read
exactly what ``mia_stream.schemas.encode`` writes, selections and compactions included, and every receiver
(``decode``, the broker's ``decode_header`` and the spec decoder) must refuse the same bad input."""

from __future__ import annotations

import dataclasses
import os
import re
import zlib
from pathlib import Path

import lz4.frame
import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import spec_decoder
from mia_stream.errors import (ChecksumError, MalformedFrameError, OversizedMessageError, SchemaVersionError,
                               SharedBufferError, ShmOverrunError, ShmUnavailableError, WireError)
from mia_stream.schemas import (MESSAGE_TYPES, SCHEMA_VERSION, WIRE_DTYPES, AnalysisBatch, ErrorNotice, GapBatch,
                                GapNotice, Heartbeat, RowGroup, Shard, SteeringAck, SteeringCommand, StepBatch,
                                StreamEnd, StreamStart, Subscribe, Tensor, TensorFrame, TokenBatch, TokenFrame,
                                Unsubscribe, compact, decode, decode_header, encode, encode_batch, select_requests,
                                shm_extent, shm_loss_gaps, split_batch)
from mia_stream.bus.shm_ring import ShmRingReader, ShmRingWriter, sweep_stale_rings

DOC = Path(__file__).resolve().parents[1] / "docs" / "wire-format.md"
_I64 = np.dtype("<i8")

SAMPLES = [
    StreamStart("req-1", "prod-a", 7, engine_request_id="e1", model="m", tokenizer="tok", tp_rank=1, tp_size=2,
                dp_rank=0, num_layers=30, hidden_size=576, num_heads=9, num_kv_heads=3, head_dim=64,
                dtype="bfloat16", capture={"layers": [1, 2], "what": ["hs"]}, steering=[{"layer": 3, "op": "add"}],
                capture_after_steering=False, prompt_token_ids=[1, 2, 3], tags={"user": "x"}, time_ns=123,
                resent=True, control_id="prod-0"),
    TensorFrame("req-1", "prod-a", 7, 3, 11, positions=[5, 6], token_ids=[42, 43], steering_version=2, time_ns=9),
    TokenFrame("req-1", "prod-a", 7, 4, 11, token_ids=[44], positions=[7], finish_reason="length", time_ns=10),
    StreamEnd("req-1", "prod-a", 7, 5, finish_reason="error", num_prompt_tokens=3, num_generated_tokens=2,
              frames_sent=5, frames_dropped=1, bytes_sent=999, drops={"hwm": 1}, uncaptured_positions=[[0, 3]],
              error="boom", time_ns=11),
    GapNotice("req-1", "prod-a", 7, missing=[[2, 2], [4, 9]], reason="hwm", origin="broker", time_ns=12),
    Heartbeat("broker-1", "broker", 2**63 - 1, time_ns=13, stats={"rx": 1}),
    SteeringCommand("cmd-1", "req-1", "add", ops=[{"layer": 1, "vector": "v"}], layers=[1], sender="alice", time_ns=1),
    SteeringAck("cmd-1", "req-1", True, applied_step=12, steering_version=3, error=None, producer_id="p",
                tp_rank=1, time_ns=2),
    Subscribe(["req-*", "x"], from_start=True, consumer_id="c1", window_bytes=1 << 20),
    Unsubscribe(["req-*"]),
    MESSAGE_TYPES["credit"](nbytes=1 << 20),
    ErrorNotice("unknown_request", "no such request", request_id="req-9", time_ns=3),
]


def _step_batch_sample() -> StepBatch:
    rng = np.random.default_rng(5)
    hs = rng.standard_normal((2, 5, 8)).astype(np.float32)
    q = rng.integers(-128, 128, size=(1, 3, 2, 4), dtype=np.int8)
    g0 = RowGroup([0, 2], [2, 3], [0, 1, 7, 8, 9], [Tensor.from_array("hs", hs, layers=[3, 4])],
                  token_ids=[11, 12, 13, 14, 15])
    g1 = RowGroup([2, 1], [1, 2], [9, 4, 5], [Tensor.from_array(
        "q", q, layers=[3], shard=Shard(1, 2, 2, 2, 4, 4), scale=rng.random((1, 3, 1, 1), dtype=np.float32),
        meta={"heads": [2, 3]})], part=1)
    return StepBatch("prod-a", 7, 12, ["r0", "r1", "r2"], [3, 9, 0], [g0, g1], steering_versions=[1, 0, 2],
                     time_ns=14)


COLUMNAR_SAMPLES = [
    _step_batch_sample(),
    TokenBatch("prod-a", 7, 12, ["r0", "r1", "r2"], [4, 10, 1], counts=[1, 0, 2], token_ids=[5, 6, 7],
               first_positions=[3, 10, 20], finish_reasons=[None, None, "length"], time_ns=15),
    AnalysisBatch("ana-1", 3, "attention_tracker", ["r0", "r2"], [0, 5], rows=[2, 1], positions=[-1, 4, 7],
                  values={"score": np.array([0.5, -1.0, 2.0], np.float32),
                          "hit": np.array([True, False, True]), "vec": np.arange(6, dtype=np.int32).reshape(3, 2)},
                  labels={"why": ["a", None, "c"]}, alerts=[0, 1, 0], step=12, analyzer_version="1.0",
                  time_ns=16, source_time_ns=9),
]


def _fields(msg) -> dict:
    return {f.name: getattr(msg, f.name) for f in dataclasses.fields(msg) if f.name != "tensors"}


def _plain(v):
    """Columns (numpy) as lists, for comparing with the spec decoder's fields."""
    if isinstance(v, np.ndarray):
        return v.tolist()
    if isinstance(v, dict):
        return {k: _plain(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    return v


def _reframe(frames, header_update=None, header_delete=(), buffers=None):
    header = msgpack.unpackb(bytes(frames[1]), raw=False)
    header.update(header_update or {})
    for k in header_delete:
        del header[k]
    return [bytes(frames[0]), msgpack.packb(header, use_bin_type=True),
            *([bytes(b) for b in frames[2:]] if buffers is None else buffers)]


def _col(values) -> bytes:
    return np.asarray(values, dtype=_I64).tobytes()


def _outcome(fn, *args, **kw) -> str:
    """What a receiver made of a message: "ok" or the spec's outcome (section 6)."""
    try:
        fn(*args, **kw)
    except spec_decoder.SpecDecodeError as e:
        return e.outcome
    except OversizedMessageError:
        return "oversized"
    except SchemaVersionError:
        return "schema_version"
    except ChecksumError:
        return "checksum"
    except SharedBufferError:
        return "lost"
    except MalformedFrameError:
        return "malformed"
    return "ok"


def _refused_by_all(frames, outcome="malformed", **kw):
    """The broker's validator, the reference decoder and the spec decoder refuse ``frames`` alike."""
    assert _outcome(decode_header, frames) == outcome
    assert _outcome(decode, frames, **kw) == outcome
    assert _outcome(spec_decoder.decode, frames) == outcome


# --- views: what each request gets (section 10.2), from both decoders, comparable ---------------------------


def _tensor_view(name, dtype, shape, raw, layers, shard, scale):
    # a scale is what it broadcasts to (compared as bits: a corrupted one may be NaN)
    full = None if scale is None else np.ascontiguousarray(np.broadcast_to(scale, shape)).tobytes()
    return (name, dtype, tuple(shape), np.ascontiguousarray(raw).tobytes(), list(layers), shard, full)


def _value_view(v: np.ndarray) -> tuple:
    return v.dtype.str, v.shape, np.ascontiguousarray(v).tobytes()  # bits: NaN equals NaN


def _official_views(msg) -> list[dict]:
    if isinstance(msg, StepBatch):
        return [{"request_id": f.request_id, "seq": f.seq, "part": f.part, "step": f.step,
                 "positions": list(f.positions), "token_ids": list(f.token_ids),
                 "steering_version": f.steering_version,
                 "tensors": [_tensor_view(t.name, t.dtype, t.shape, t.raw(), t.layers,
                                          None if t.shard is None else t.shard.to_wire(), t.scale)
                             for t in f.tensors]}
                for f in msg.frames()]
    if isinstance(msg, TokenBatch):
        return [{"request_id": f.request_id, "seq": f.seq, "step": f.step, "token_ids": f.token_ids,
                 "positions": f.positions, "finish_reason": f.finish_reason} for f in msg.frames()]
    return [{"request_id": a.request_id, "seq": a.seq, "step": a.step, "analyzer": a.analyzer,
             "positions": a.positions, "alerts": a.alerts,
             "values": {k: _value_view(v) for k, v in a.values.items()}, "labels": a.labels}
            for a in msg.results()]


def _spec_views(spec) -> list[dict]:
    out = []
    for d in spec.per_request():
        d = dict(d)
        if "tensors" in d:
            d["tensors"] = [_tensor_view(t.name, t.dtype, t.shape, t.raw, t.layers, t.shard, t.scale)
                            for t in d["tensors"]]
        if "values" in d:
            d["values"] = {k: _value_view(v) for k, v in d["values"].items()}
        out.append(d)
    return out


def _agree(frames, shm=None, legacy=False):
    """Both decoders read ``frames`` alike: every field and what every request gets. The views."""
    official = decode(frames, shm=shm, legacy=legacy)
    spec = spec_decoder.decode(frames, legacy=legacy)
    assert spec.kind == official.KIND
    for name, value in _fields(official).items():
        if name == "groups":
            assert len(spec.groups) == len(value)
            for sg, og in zip(spec.groups, value):
                assert (sg.part, sg.requests, sg.rows, sg.positions, sg.token_ids) == (
                    og.part, og.requests.tolist(), og.rows.tolist(), og.positions.tolist(), og.token_ids.tolist())
                assert [_tensor_view(t.name, t.dtype, t.shape, t.raw, t.layers, t.shard, t.scale)
                        for t in sg.tensors] == [
                    _tensor_view(t.name, t.dtype, t.shape, t.raw(), t.layers,
                                 None if t.shard is None else t.shard.to_wire(), t.scale) for t in og.tensors]
        elif name == "values":
            assert {k: _value_view(v) for k, v in spec.values.items()} == {k: _value_view(v) for k, v in value.items()}
        else:
            assert spec.fields[name] == _plain(value), name
    views = _official_views(official)
    assert _spec_views(spec) == views
    return views


# --- the spec is complete ------------------------------------------------------------------------------------


def test_spec_decoder_and_doc_cover_every_kind_and_field():
    """A kind or field added to the schemas without documenting it fails here."""
    doc = DOC.read_text()
    assert set(spec_decoder.KINDS) == set(MESSAGE_TYPES)
    for kind, cls in MESSAGE_TYPES.items():
        names = [f.name for f in dataclasses.fields(cls)]
        assert set(spec_decoder.KINDS[kind]) == set(names), kind
        section = re.search(rf"### 3\.\d+ `{re.escape(kind)}` .*?(?=\n### |\n## )", doc, re.S)
        assert section, f"docs/wire-format.md has no section for kind {kind!r}"
        documented = set(re.findall(r"^\| `(\w+)` \|", section.group(0), re.M))
        assert documented == set(names), (kind, set(names) ^ documented)
    for dtype in WIRE_DTYPES:
        assert f"`{dtype}`" in doc and dtype in spec_decoder.DTYPES
    groups = re.search(r"### 10\.2 Row groups.*?(?=\n### )", doc, re.S).group(0)
    assert set(re.findall(r"^\| `(\w+)` \|", groups, re.M)) == {
        "part", "requests", "rows", "positions", "token_ids", "tensors", "row0", "stored_rows", "row_index"}


def test_transport_section_says_who_sends_every_kind():
    """Section 11's table names every kind, and the version in the title is the code's."""
    doc = DOC.read_text()
    assert doc.startswith("# mia_stream wire format (schema version {}.{})".format(*SCHEMA_VERSION))
    table = re.search(r"\*\*Who sends what\.\*\*.*?\n\n(.*?)\n\n", doc, re.S).group(1)
    named = set(re.findall(r"`(\w+)`", table))
    assert set(MESSAGE_TYPES) <= named, set(MESSAGE_TYPES) - named
    assert "[1, 2]" not in doc and "1.2\"" not in doc  # no stale version in examples


_EXAMPLE = {"str": "s", "int": 1, "int>=0": 1, "bool": True, "array": [], "map": {}, "array of int": [],
            "array of str": [], "column": b"", "map str->int": {}, "array of str|nil": []}


@pytest.mark.parametrize("kind", sorted(MESSAGE_TYPES))
def test_required_fields_and_defaults_match_the_spec(kind):
    """A header holding only the spec's required fields decodes, with the spec's defaults for the rest."""
    spec = spec_decoder.KINDS[kind]
    header = {"v": list(SCHEMA_VERSION), "kind": kind}
    header.update({n: _EXAMPLE[t] for n, (t, req, _) in spec.items() if req})
    frames = [b"", msgpack.packb(header, use_bin_type=True)]
    msg = decode(frames)
    by_spec = spec_decoder.decode(frames)
    for name, (_, required, default) in spec.items():
        if not required and default is not None and name != "groups":
            assert _plain(getattr(msg, name)) == default == by_spec.fields[name], (kind, name)
        if name != "groups":
            assert _plain(getattr(msg, name)) == by_spec.fields[name], (kind, name)
    for name, (_, required, _) in spec.items():
        if required:
            bad = [b"", msgpack.packb({k: v for k, v in header.items() if k != name}, use_bin_type=True)]
            with pytest.raises(MalformedFrameError, match=name):
                decode(bad)
            _refused_by_all(bad)


def test_columnar_defaults_depend_on_the_request_count():
    """Absent columns take the table's defaults for R requests (all 1 counts and rows, all -1 positions...)."""
    base = {"v": list(SCHEMA_VERSION), "producer_id": "p", "epoch": 1, "request_ids": ["a", "b"],
            "seqs": _col([0, 4])}
    cases = [({"kind": "token_batch", "step": 1, "token_ids": _col([7, 8])},
              {"counts": [1, 1], "first_positions": [0, 0], "finish_reasons": [None, None]}),
             ({"kind": "analysis", "analyzer": "x"},
              {"rows": [1, 1], "positions": [-1, -1], "alerts": [0, 0], "step": -1}),
             ({"kind": "step_batch", "step": 1}, {"steering_versions": [0, 0]})]
    for extra, defaults in cases:
        frames = [b"", msgpack.packb({**base, **extra}, use_bin_type=True)]
        by_spec = spec_decoder.decode(frames)
        msg = decode(frames)
        for name, want in defaults.items():
            assert by_spec.fields[name] == _plain(getattr(msg, name)) == want, (extra["kind"], name)
        _agree(frames)
    # a token batch naming requests needs its token ids, even when every count is 0
    _refused_by_all([b"", msgpack.packb({**base, "kind": "token_batch", "step": 1}, use_bin_type=True)])
    zero = {**base, "kind": "token_batch", "step": 1, "counts": _col([0, 0])}
    _refused_by_all([b"", msgpack.packb(zero, use_bin_type=True)])
    _agree([b"", msgpack.packb({**zero, "token_ids": b""}, use_bin_type=True)])
    empty = {**base, "kind": "token_batch", "step": 1, "request_ids": [], "seqs": b""}
    assert _agree([b"", msgpack.packb(empty, use_bin_type=True)]) == []


# --- every kind through both decoders ------------------------------------------------------------------------


@pytest.mark.parametrize("msg", SAMPLES, ids=[m.KIND for m in SAMPLES])
def test_every_kind_reads_the_same_in_the_spec_decoder(msg):
    frames = encode(msg)
    spec = spec_decoder.decode(frames)
    assert spec.kind == msg.KIND and spec.version == tuple(SCHEMA_VERSION)
    assert {k: v for k, v in spec.fields.items() if k != "tensors"} == _fields(msg)
    rid = getattr(msg, "request_id", None)
    expected_topic = b"" if rid is None or msg.KIND in ("subscribe", "unsubscribe") else rid.encode() + b"\0"
    assert spec.topic == expected_topic == bytes(frames[0])
    assert _fields(decode(frames)) == _fields(msg)
    decode_header(frames)


@pytest.mark.parametrize("msg", COLUMNAR_SAMPLES, ids=[m.KIND for m in COLUMNAR_SAMPLES])
def test_every_columnar_kind_reads_the_same_in_the_spec_decoder(msg):
    frames = encode(msg)
    assert bytes(frames[0]) == b""  # routed by request_ids, not by topic
    views = _agree(frames)
    decode_header(frames)
    if isinstance(msg, StepBatch):  # r0: part 0; r1: part 1; r2: parts 0 and 1 sharing its seq
        assert [(v["request_id"], v["part"], v["seq"], v["positions"]) for v in views] == [
            ("r0", 0, 3, [0, 1]), ("r1", 1, 9, [4, 5]), ("r2", 0, 0, [7, 8, 9]), ("r2", 1, 0, [9])]
        assert views[3]["tensors"][0][5] == {"tp_rank": 1, "tp_size": 2, "dim": 2, "start": 2, "stop": 4,
                                             "total": 4}
    elif isinstance(msg, TokenBatch):
        assert [(v["request_id"], v["token_ids"], v["positions"]) for v in views] == [
            ("r0", [5], [3]), ("r1", [], []), ("r2", [6, 7], [20, 21])]
    else:
        assert [(v["request_id"], v["positions"], v["alerts"]) for v in views] == [
            ("r0", [-1, 4], [False, True]), ("r2", [7], [False])]
        assert views[0]["values"]["hit"] == ("|b1", (2,), b"\x01\x00")


def _random_tensor(rng, dtype, shape):
    storage, itemsize = spec_decoder.DTYPES[dtype]
    bits = rng.integers(0, 256, size=int(np.prod(shape)) * itemsize, dtype=np.uint8)
    if dtype in ("float32", "float16"):  # real numbers, no NaN payloads to compare
        return rng.standard_normal(shape).astype(storage)
    return bits.view(storage).reshape(shape)


@pytest.mark.parametrize("dtype", sorted(WIRE_DTYPES))
@pytest.mark.parametrize("compression", ["none", "lz4"])
@pytest.mark.parametrize("checksum", [False, True])
def test_every_dtype_round_trips_bit_exact(dtype, compression, checksum):
    rng = np.random.default_rng(0)
    arr = _random_tensor(rng, dtype, (2, 3, 5))
    t = Tensor(name="hs", dtype=dtype, shape=arr.shape, data=memoryview(arr).cast("B"), layers=(4, 9))
    frames = encode(TensorFrame("r", "p", 0, 1, 1, positions=[0, 1, 2], tensors=[t]),
                    compression=compression, checksum=checksum)
    entry = msgpack.unpackb(bytes(frames[1]), raw=False)["tensors"][0]
    assert entry["compression"] == compression and ("crc32" in entry) == checksum
    if compression == "lz4":
        assert bytes(frames[2])[:4] == b"\x04\x22\x4d\x18"  # LZ4 frame magic, not a raw block
    if checksum:
        assert entry["crc32"] == zlib.crc32(arr.tobytes()) & 0xFFFFFFFF
    spec = spec_decoder.decode(frames).tensors[0]
    official = decode(frames).tensors[0]
    assert spec.raw.tobytes() == arr.tobytes() == official.raw().tobytes()
    assert spec.layers == [4, 9] and official.layers == (4, 9)
    if not dtype.startswith("float8"):  # float8 widening goes through torch; checked separately below
        np.testing.assert_array_equal(spec.values, official.numpy())


def test_bfloat16_is_the_upper_half_of_float32_bit_exact():
    torch = pytest.importorskip("torch")
    x = torch.randn(4, 3, 8).to(torch.bfloat16)
    x[0, 0, :4] = torch.tensor([1.0, -0.0, float("inf"), 3.140625], dtype=torch.bfloat16)
    frames = encode(TensorFrame("r", "p", 0, 1, 1, tensors=[Tensor.from_array("hs", x)]))
    assert bytes(frames[2])[:2] == b"\x80\x3f"  # 1.0 in bf16, little-endian, as in the spec's example
    spec = spec_decoder.decode(frames).tensors[0]
    np.testing.assert_array_equal(spec.raw, x.view(torch.int16).numpy().view(np.uint16))
    np.testing.assert_array_equal(spec.values, x.float().numpy())
    back = decode(frames).tensors[0].torch()
    assert back.dtype == torch.bfloat16 and torch.equal(back.view(torch.int16), x.view(torch.int16))


@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "float8_e5m2"])
def test_float8_bit_formats_match_torch_for_all_256_codes(dtype):
    torch = pytest.importorskip("torch")
    codes = np.arange(256, dtype=np.uint8)
    t = Tensor(name="k", dtype=dtype, shape=(256,), data=memoryview(codes))
    frames = encode(TensorFrame("r", "p", 0, 1, 1, tensors=[t]))
    spec = spec_decoder.decode(frames).tensors[0].values
    official = decode(frames).tensors[0].numpy()
    reference = torch.from_numpy(codes.copy()).view(getattr(torch, dtype)).float().numpy()
    np.testing.assert_array_equal(spec, reference)  # NaN positions compare equal in assert_array_equal
    np.testing.assert_array_equal(official, reference)
    assert spec[np.isfinite(spec)].max() == {"float8_e4m3fn": 448.0, "float8_e5m2": 57344.0}[dtype]


def test_int8_with_float32_scale_and_shards_and_meta():
    rng = np.random.default_rng(1)
    q = rng.integers(-128, 128, size=(2, 3, 4, 8), dtype=np.int8)
    scale = rng.random((2, 3, 1, 1), dtype=np.float32)
    shard = Shard(tp_rank=1, tp_size=2, dim=2, start=4, stop=8, total=8)
    tq = Tensor.from_array("q", q, layers=[0, 1], shard=shard, scale=scale, meta={"note": "x"})
    k = rng.integers(0, 256, size=(2, 3, 1, 8), dtype=np.uint8)
    tk = Tensor(name="k", dtype="float8_e5m2", shape=k.shape, data=memoryview(k).cast("B"),
                scale=np.full((1,), 0.5, np.float32), meta={"compression": "lz4", "checksum": True})
    frames = encode(TensorFrame("r", "p", 0, 1, 1, tensors=[tq, tk]))
    assert len(frames) == 2 + 4  # payload + scale for each tensor
    header = msgpack.unpackb(bytes(frames[1]), raw=False)
    assert header["tensors"][0]["scale"] == {"dtype": "float32", "shape": [2, 3, 1, 1]}
    assert header["tensors"][1]["compression"] == "lz4" and "crc32" in header["tensors"][1]
    assert header["tensors"][0]["meta"] == {"note": "x"} and "meta" not in header["tensors"][1]
    spec = spec_decoder.decode(frames)
    np.testing.assert_array_equal(spec.tensors[0].dequantized(), q.astype(np.float32) * scale)
    assert spec.tensors[0].shard == shard.to_wire()
    official = decode(frames)
    np.testing.assert_array_equal(official.tensors[0].dequantize(), spec.tensors[0].dequantized())
    assert official.tensors[0].shard == shard
    np.testing.assert_array_equal(spec.tensors[1].raw, k)
    np.testing.assert_array_equal(spec.tensors[1].scale, [0.5])


_DTYPES = sorted(WIRE_DTYPES)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.sampled_from(_DTYPES), st.lists(st.integers(0, 5), min_size=0, max_size=4),
                          st.sampled_from(["none", "lz4"]), st.booleans(), st.booleans()), max_size=4),
       st.integers(0, 2**40), st.lists(st.integers(0, 2**31), max_size=6), st.binary(max_size=8))
def test_property_round_trip_agrees_with_spec_decoder(specs, seq, positions, seed):
    rng = np.random.default_rng(list(seed) or [0])
    tensors, arrays = [], []
    for i, (dtype, shape, method, checksum, scaled) in enumerate(specs):
        arr = _random_tensor(rng, dtype, tuple(shape))
        scale = np.asarray(rng.random(1), np.float32) if scaled and shape else None
        tensors.append(Tensor(name=f"t{i}", dtype=dtype, shape=tuple(shape), data=arr.tobytes(),
                              layers=tuple(range(shape[0] if shape else 0)), scale=scale,
                              meta={"compression": method, "checksum": checksum}))
        arrays.append((arr, scale))
    msg = TensorFrame("r\u00e9q", "p", 3, seq, seq // 2, positions=positions, tensors=tensors)
    frames = encode(msg)
    spec, official = spec_decoder.decode(frames), decode(frames)
    assert {k: v for k, v in spec.fields.items() if k != "tensors"} == _fields(official) == _fields(msg)
    for (arr, scale), s, o in zip(arrays, spec.tensors, official.tensors):
        assert s.raw.tobytes() == arr.tobytes() == o.raw().tobytes()
        assert s.shape == o.shape == arr.shape
        if scale is not None:
            np.testing.assert_array_equal(s.scale, scale)
            np.testing.assert_array_equal(o.scale, scale)


# --- columnar messages: random steps, selections, compaction, rings (section 10) -----------------------------


@st.composite
def _tensor_entries(draw, rng, n_rows: int) -> list:
    """0-2 tensors of a row group with ``n_rows`` rows: random dtypes, compression, checksums, per-row or
    shared scales, and TP shards along a dim >= 2 (the rules of 10.2)."""
    out = []
    for k in range(draw(st.integers(0, 2))):
        dtype = draw(st.sampled_from(_DTYPES))
        layers = draw(st.integers(1, 2))
        inner = draw(st.lists(st.integers(0, 3), min_size=1, max_size=2))
        shape = (layers, n_rows, *inner)
        arr = _random_tensor(rng, dtype, shape)
        scale = None
        if draw(st.booleans()):
            scale_shape = tuple(d if draw(st.booleans()) else 1 for d in shape)
            scale = rng.random(scale_shape, dtype=np.float32)
        shard = None
        if draw(st.booleans()):
            start = draw(st.integers(0, 3))
            shard = Shard(draw(st.integers(0, 1)), 2, 2, start, start + inner[0], start + inner[0] + 1)
        out.append(Tensor(f"t{k}", dtype, shape, arr.tobytes(), tuple(range(layers)), shard, scale,
                          {"compression": draw(st.sampled_from(["none", "lz4"])), "checksum": draw(st.booleans())}))
    return out


@st.composite
def step_batches(draw) -> StepBatch:
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    r = draw(st.integers(0, 5))
    ids = [f"req-{i}" for i in draw(st.permutations(range(8)))[:r]]
    groups = []
    for part in (0, 1):
        members = [i for i in draw(st.permutations(range(r))) if draw(st.booleans())]
        split = draw(st.integers(0, len(members)))
        for segs in (members[:split], members[split:]):  # up to two groups per part
            if not segs and draw(st.booleans()):
                continue
            rows = [draw(st.integers(0, 3)) for _ in segs]
            n = sum(rows)
            positions = rng.integers(-2, 5000, size=n)
            token_ids = rng.integers(-1, 50000, size=n) if draw(st.booleans()) else None
            groups.append(RowGroup(segs, rows, positions, draw(_tensor_entries(rng, n)), token_ids, part))
    return StepBatch(draw(st.sampled_from(["p", "prod-\u00e9"])), draw(st.integers(0, 2**62)),
                     draw(st.integers(-1, 10**6)), ids, rng.integers(0, 2**40, size=r), groups,
                     rng.integers(-3, 100, size=r) if draw(st.booleans()) else None, draw(st.integers(0, 2**63)))


@st.composite
def token_batches(draw) -> TokenBatch:
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    r = draw(st.integers(0, 6))
    counts = [draw(st.integers(0, 3)) for _ in range(r)]
    return TokenBatch("p", 1, draw(st.integers(0, 99)), [f"t{i}" for i in range(r)], rng.integers(0, 99, size=r),
                      counts, rng.integers(-1, 2**31, size=sum(counts)), rng.integers(0, 4096, size=r),
                      [draw(st.sampled_from([None, "stop", "length"])) for _ in range(r)])


@st.composite
def analysis_batches(draw) -> AnalysisBatch:
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    r = draw(st.integers(0, 5))
    rows = [draw(st.integers(0, 3)) for _ in range(r)]
    n = sum(rows)
    values = {}
    for name in draw(st.lists(st.sampled_from(["a", "b", "c"]), unique=True)):
        dtype = draw(st.sampled_from(sorted(spec_decoder.VALUE_DTYPES)))
        shape = (n, *draw(st.lists(st.integers(0, 3), max_size=2)))
        values[name] = (rng.integers(0, 2, size=shape).astype(bool) if dtype == "bool"
                        else rng.standard_normal(shape).astype(dtype) if dtype.startswith("float")
                        else rng.integers(-100, 100, size=shape).astype(dtype))
    labels = {"l": [draw(st.sampled_from([None, "x", "\u00e9"])) for _ in range(n)]} if draw(st.booleans()) else {}
    return AnalysisBatch("ana", 2, "tracker", [f"a{i}" for i in range(r)], rng.integers(0, 99, size=r), rows,
                         rng.integers(-1, 4096, size=n), values, labels, rng.integers(0, 2, size=n),
                         draw(st.integers(-1, 99)), "v1", 5, 6)


@pytest.fixture(scope="module")
def ring():
    """A small ring of this process in /dev/shm; every payload but empty ones goes into it."""
    writer = ShmRingWriter(size=8 << 20, min_bytes=1)
    reader = ShmRingReader()
    yield writer, reader
    writer.close()
    reader.close()
    assert not os.path.exists(writer.path)


def _check_selection(frames, views, keep, ids, reader):
    """``select_requests`` names exactly the kept requests, and both decoders give each kept request what the
    whole message gave it; so does the compacted selection, which holds only inline, selected rows."""
    header = decode_header(frames)
    sel, sel_header = select_requests(frames, header, keep)
    assert sel_header == decode_header(sel)  # valid for the broker's validator too
    assert sel_header["request_ids"] == [ids[i] for i in keep]
    kept = {ids[i] for i in keep}
    want = [v for v in views if v["request_id"] in kept]
    assert _agree(sel, shm=reader) == want
    extent = shm_extent(sel_header)
    if sel_header["kind"] == "step_batch" and extent is not None:  # 10.4: a shm entry weighs its kept rows
        weight = 0
        for g in sel_header["groups"]:
            n = int(np.frombuffer(g["rows"], _I64).sum())
            stored = g.get("stored_rows", n)
            weight += sum(e["nbytes"] if n == stored else e["nbytes"] * n // stored
                          for e in g["tensors"] if "shm" in e)
        assert extent[2] == weight
    small = compact(sel, reader)
    small_header = decode_header(small)
    assert "shm_ring" not in small_header
    for g in small_header.get("groups", []):
        assert "row0" not in g and "stored_rows" not in g
        assert all("shm" not in e and "crc32" not in e and e["compression"] == "none" for e in g["tensors"])
    assert _agree(small) == want


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(step_batches(), st.booleans(), st.data())
def test_property_step_batches_selections_and_rings_agree(ring, batch, in_ring, data):
    """Random steps (requests, groups, parts, rows, dtypes, scales, shards), inline or in a ring: both
    decoders agree on every field and on what each request gets; so on any selection and its compaction, and
    a selection of a selection."""
    writer, reader = ring
    frames = [bytes(f) if not isinstance(f, bytes) else f for f in encode(
        batch, shm=writer if in_ring else None, compression=data.draw(st.sampled_from(["none", "lz4"])),
        checksum=data.draw(st.booleans()))]
    views = _agree(frames, shm=reader)
    assert [(v["request_id"], v["part"]) for v in views] == sorted(
        {(batch.request_ids[i], g.part) for g in batch.groups for i in g.requests.tolist()},
        key=lambda x: (batch.request_ids.index(x[0]), x[1]))
    r = len(batch.request_ids)
    keep = sorted(data.draw(st.sets(st.integers(0, max(r - 1, 0)), max_size=r)))
    _check_selection(frames, views, keep, batch.request_ids, reader)
    if keep:  # a selection of a selection: row0 of row0
        sel, h = select_requests(frames, decode_header(frames), keep)
        again = sorted(data.draw(st.sets(st.integers(0, len(keep) - 1))))
        ids = h["request_ids"]
        _check_selection(sel, [v for v in views if v["request_id"] in ids], again, ids, reader)


@settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.one_of(token_batches(), analysis_batches()), st.data())
def test_property_token_and_analysis_batches_and_selections_agree(batch, data):
    frames = encode(batch)
    views = _agree(frames)
    r = len(batch.request_ids)
    keep = sorted(data.draw(st.sets(st.integers(0, max(r - 1, 0)), max_size=r)))
    _check_selection(frames, views, keep, batch.request_ids, None)


def test_a_selection_keeps_ring_positions_and_a_reader_copies_only_its_rows(ring):
    """10.4: the selection's entries are the original's (same ring positions, no payload byte copied); the
    reference reader gathers only the kept rows out of the ring (10.3) and both decoders give them."""
    writer, reader = ring
    rng = np.random.default_rng(3)
    hs = rng.standard_normal((2, 64, 128)).astype(np.float32)  # 64 rows of 512 bytes per layer
    batch = StepBatch("p", 1, 1, ["a", "b", "c"], [0, 0, 0],
                      [RowGroup([0, 1, 2], [16, 32, 16], np.arange(64), [Tensor.from_array("hs", hs)])])
    frames = encode(batch, shm=writer)
    sel, h = select_requests(frames, decode_header(frames), [1])
    entry = msgpack.unpackb(bytes(frames[1]))["groups"][0]["tensors"][0]
    assert h["groups"][0]["tensors"][0] == entry and len(sel) == 2  # no buffer frame: all in the ring
    assert np.frombuffer(h["groups"][0]["row0"], _I64).tolist() == [16] and h["groups"][0]["stored_rows"] == 64
    before = reader.bytes_copied
    got = decode(sel, shm=reader)
    assert reader.bytes_copied - before == hs[:, 16:48].nbytes  # the kept rows only
    assert shm_extent(h)[2] == hs.nbytes * 32 // 64
    np.testing.assert_array_equal(got.tensor("hs"), hs[:, 16:48])
    np.testing.assert_array_equal(spec_decoder.decode(sel).groups[0].tensors[0].values, hs[:, 16:48])


def test_compaction_is_uncompressed_whatever_a_tensor_meta_says():
    """10.4: a compacted selection has no compression and no crc32, also when a hand-written producer put
    "compression"/"checksum" keys into an entry's free-form meta (the encoder reads those as overrides)."""
    frames = encode(COLUMNAR_SAMPLES[0], compression="lz4", checksum=True)
    header = decode_header(frames)
    header["groups"][0]["tensors"][0]["meta"] = {"compression": "lz4", "checksum": True, "note": 1}
    frames = [b"", msgpack.packb(header, use_bin_type=True), *frames[2:]]
    sel, _ = select_requests(frames, decode_header(frames), [0])
    small = decode_header(compact(sel))
    entry = small["groups"][0]["tensors"][0]
    assert entry["compression"] == "none" and "crc32" not in entry and entry["meta"] == {"note": 1}


# --- 1.x recordings ------------------------------------------------------------------------------------------


def _as_major_1(frames, minor=3):
    return _reframe(frames, {"v": [1, minor]})


@pytest.mark.parametrize("msg", SAMPLES, ids=[m.KIND for m in SAMPLES])
def test_1x_recordings_read_as_2_0_by_both_decoders(msg):
    """2.1: a reader of recordings decodes a 1.x header exactly as the 2.0 header of its kind; a live
    receiver refuses it."""
    old = _as_major_1(encode(msg))
    spec = spec_decoder.decode(old, legacy=True)
    assert spec.version == (1, 3)
    assert {k: v for k, v in spec.fields.items() if k != "tensors"} == _fields(decode(old, legacy=True)) == _fields(msg)
    assert _outcome(decode, old) == _outcome(spec_decoder.decode, old) == "schema_version"
    assert _outcome(decode_header, old) == "schema_version"


def test_1x_tensor_frames_with_payloads_read_as_recorded():
    arr = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    old = _as_major_1(encode(TensorFrame("r", "p", 0, 1, 1, positions=[1, 2, 3],
                                         tensors=[Tensor.from_array("hs", arr)]), compression="lz4", checksum=True), 2)
    np.testing.assert_array_equal(spec_decoder.decode(old, legacy=True).tensors[0].values, arr)
    np.testing.assert_array_equal(decode(old, legacy=True).tensors[0].numpy(), arr)
    for major in (0, 3):
        bad = _reframe(old, {"v": [major, 0]})
        assert _outcome(decode, bad, legacy=True) == _outcome(spec_decoder.decode, bad, legacy=True) == \
            "schema_version"


# --- every receiver refuses the same bad input (one rule set) ------------------------------------------------


def _tensor_frames(**kw):
    arr = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    return encode(TensorFrame("r", "p", 0, 1, 1, tensors=[Tensor.from_array("hs", arr, layers=[0, 1])]), **kw)


def _header_of(frames) -> dict:
    return msgpack.unpackb(bytes(frames[1]), raw=False)


def _with_entry(frames, **changes):
    """``frames`` (a one-tensor ``tensors`` message) with its entry changed; a key set to ... is removed."""
    entry = {**_header_of(frames)["tensors"][0], **changes}
    entry = {k: v for k, v in entry.items() if v is not ...}
    return _reframe(frames, {"tensors": [entry]})


_RING_NAME = "mia-stream-ring-123-0123456789ab"


def _per_request_cases():
    tf = _tensor_frames()
    sample = {m.KIND: encode(m) for m in SAMPLES}
    cases = {
        # issue 13 item 10: the header variants the broker used to forward and every consumer refused
        "float nbytes": _with_entry(tf, nbytes=96.0),
        "float raw_nbytes": _with_entry(tf, raw_nbytes=96.0),
        "float shape element": _with_entry(tf, shape=[2, 3.0, 4]),
        "str in shape": _with_entry(tf, shape=[2, "3", 4]),
        "bool in shape": _with_entry(tf, shape=[2, True, 4]),
        "int name": _with_entry(tf, name=5),
        "str in layers": _with_entry(tf, layers=[0, "1"]),
        "str step": _reframe(tf, {"step": "1"}),
        # bools are not ints, anywhere
        "bool in v": _reframe(tf, {"v": [True, 3]}),
        "bool minor": _reframe(tf, {"v": [2, False]}),
        "bool seq": _reframe(tf, {"seq": True}),
        "bool instance": _reframe(sample["heartbeat"], {"instance": True}),
        "int ok": _reframe(sample["steer_ack"], {"ok": 1}),
        # element types of typed arrays
        "bool in positions": _reframe(tf, {"positions": [1, True]}),
        "str in token_ids": _reframe(tf, {"token_ids": ["a"]}),
        "float in prompt_token_ids": _reframe(sample["start"], {"prompt_token_ids": [1, 1.5]}),
        "nil in uncaptured_positions": _reframe(sample["end"], {"uncaptured_positions": [None]}),
        "a bare position in uncaptured_positions": _reframe(sample["end"], {"uncaptured_positions": [5]}),
        "reversed uncaptured range": _reframe(sample["end"], {"uncaptured_positions": [[7, 3]]}),
        "str in tokens.positions": _reframe(sample["tokens"], {"positions": ["7"]}),
        "str in steer.layers": _reframe(sample["steer"], {"layers": ["1"]}),
        "int in patterns": _reframe(sample["subscribe"], {"patterns": ["a", 1]}),
        "bin in unsubscribe.patterns": _reframe(sample["unsubscribe"], {"patterns": [b"x"]}),
        "str drops count": _reframe(sample["end"], {"drops": {"hwm": "1"}}),
        "bool drops count": _reframe(sample["end"], {"drops": {"hwm": True}}),
        # empty is a value, nil is a value (section 2)
        "empty shard": _with_entry(tf, shard={}),
        "nil shard": _with_entry(tf, shard=None),
        "empty shm_ring": _reframe(tf, {"shm_ring": ""}),
        "nil shm_ring": _reframe(tf, {"shm_ring": None}),
        "nil optional int": _reframe(tf, {"steering_version": None}),
        "nil optional map": _reframe(sample["start"], {"tags": None}),
        "nil optional bool": _reframe(sample["start"], {"resent": None}),
        "nil stats": _reframe(sample["heartbeat"], {"stats": None}),
        "nil meta": _with_entry(tf, meta=None),
        "nil compression": _with_entry(tf, compression=None),
        "nil crc32": _with_entry(tf, crc32=None),
        "nil layers": _with_entry(tf, layers=None),
        "nil v": _reframe(tf, {"v": None}),
        # ranges
        "negative seq (start)": _reframe(sample["start"], {"seq": -1}),
        "negative seq (tensors)": _reframe(tf, {"seq": -1}),
        "negative seq (tokens)": _reframe(sample["tokens"], {"seq": -2}),
        "negative seq (end)": _reframe(sample["end"], {"seq": -1}),
        "negative credit": _reframe(sample["credit"], {"nbytes": -1}),
        "negative window": _reframe(sample["subscribe"], {"window_bytes": -5}),
        "negative shape dimension": _with_entry(tf, shape=[-2, -12]),
        "negative nbytes": _with_entry(tf, nbytes=-1, compression="lz4"),
        "missing first > last": _reframe(sample["gap"], {"missing": [[5, 2]]}),
        "missing negative": _reframe(sample["gap"], {"missing": [[-1, 2]]}),
        "missing three": _reframe(sample["gap"], {"missing": [[1, 2, 3]]}),
        "missing bool": _reframe(sample["gap"], {"missing": [[True, 2]]}),
        "missing str": _reframe(sample["gap"], {"missing": [[1, "a"]]}),
        # shard geometry (4.6)
        "shard with a bool": _with_entry(tf, shard={"tp_rank": False, "tp_size": 2, "dim": 1, "start": 0,
                                                    "stop": 3, "total": 6}),
        "shard with a str": _with_entry(tf, shard={"tp_rank": "0", "tp_size": 2, "dim": 1, "start": 0,
                                                   "stop": 3, "total": 6}),
        "shard stop - start != shape[dim]": _with_entry(tf, shard={"tp_rank": 0, "tp_size": 2, "dim": 1,
                                                                   "start": 0, "stop": 2, "total": 6}),
        "shard dim past shape": _with_entry(tf, shard={"tp_rank": 0, "tp_size": 2, "dim": 3, "start": 0,
                                                       "stop": 3, "total": 6}),
        "shard rank >= size": _with_entry(tf, shard={"tp_rank": 2, "tp_size": 2, "dim": 1, "start": 0,
                                                     "stop": 3, "total": 6}),
        "shard stop > total": _with_entry(tf, shard={"tp_rank": 0, "tp_size": 2, "dim": 1, "start": 3,
                                                     "stop": 6, "total": 5}),
        # scale (4.7)
        "scale that does not broadcast": _reframe(_with_entry(tf, scale={"shape": [2, 1]}), buffers=[
            bytes(tf[2]), b"\0" * 8]),
        "scale with more dims": _reframe(_with_entry(tf, scale={"shape": [1, 1, 1, 1]}), buffers=[
            bytes(tf[2]), b"\0" * 4]),
        "scale buffer too short": _reframe(_with_entry(tf, scale={"shape": [2, 1, 1]}), buffers=[
            bytes(tf[2]), b"\0" * 4]),
        # ring references (section 9)
        "shm without shm_ring": _with_entry(tf, shm=0),
        "negative shm": _reframe(_with_entry(tf, shm=-1), {"shm_ring": _RING_NAME}, buffers=[]),
        "bool shm": _reframe(_with_entry(tf, shm=True), {"shm_ring": _RING_NAME}, buffers=[]),
        "uppercase ring name": _reframe(tf, {"shm_ring": "mia-stream-ring-123-0123456789AB"}),
        "ring pid with a leading zero": _reframe(tf, {"shm_ring": "mia-stream-ring-0123-0123456789ab"}),
        "ring pid in non-ASCII digits": _reframe(tf, {"shm_ring": "mia-stream-ring-\u0661\u0662-0123456789ab"}),
        "ring name as a path": _reframe(tf, {"shm_ring": "../mia-stream-ring-123-0123456789ab"}),
        "ring tag too short": _reframe(tf, {"shm_ring": "mia-stream-ring-123-0123456789a"}),
        "int ring name": _reframe(tf, {"shm_ring": 5}),
        # other entry rules (4.1, 4.3, 4.4, 4.7)
        "dtype not a str": _with_entry(tf, dtype=[1]),
        "unknown dtype": _with_entry(tf, dtype="float64"),
        "unknown compression": _with_entry(tf, compression="zstd"),
        "str crc32": _with_entry(tf, crc32="x"),
        "shape not an array": _with_entry(tf, shape=5),
        "raw_nbytes not prod(shape) x itemsize": _with_entry(tf, shape=[2, 3, 5]),
        "uncompressed nbytes != raw_nbytes": _with_entry(tf, raw_nbytes=50),
        "missing raw_nbytes": _with_entry(tf, raw_nbytes=...),
        "entry not a map": _reframe(tf, {"tensors": [5]}, buffers=[]),
        "scale not a map": _reframe(_with_entry(tf, scale=3), buffers=[bytes(tf[2]), b"\0" * 4]),
        "scale of float16": _reframe(_with_entry(tf, scale={"dtype": "float16", "shape": [1]}), buffers=[
            bytes(tf[2]), b"\0" * 4]),
        "meta not a map": _with_entry(tf, meta=5),
        "str tensors": _reframe(tf, {"tensors": "hs"}, buffers=[]),
        # framing
        "extra buffer": [*tf, b"x"],
        "buffer on a token frame": [*sample["tokens"], b"x"],
        "short payload": [tf[0], tf[1], bytes(tf[2])[:-1]],
        "int map key": [b"", msgpack.packb({"v": [2, 0], "kind": "heartbeat", "sender_id": "s", "role": "r",
                                            "instance": 1, "stats": {1: 2}})],
        "unknown kind": _reframe(tf, {"kind": "no_such_kind"}),
        "str that is not UTF-8": [b"", msgpack.packb({"v": [2, 0], "kind": "heartbeat", "sender_id": "\u00ff\u00fe",
                                                      "role": "r", "instance": 1}).replace(
            "\u00ff\u00fe".encode(), b"\xff\xfe\xfd\xfc")],
        "required field only as a bin key": [b"", msgpack.packb({"v": [2, 0], "kind": "credit", b"nbytes": 5},
                                                                use_bin_type=True)],
        "batch as a message": _reframe(sample["heartbeat"], {"kind": "batch"}),
    }
    return cases


_PER_REQUEST = _per_request_cases()


@pytest.mark.parametrize("case", sorted(_PER_REQUEST))
def test_malformed_headers_are_refused_by_every_receiver(case):
    """Issue 13 items 10 and 13: the broker's validator (decode_header), the reference decoder and the spec
    decoder hold one rule set; each case breaks one rule the spec states."""
    _refused_by_all(_PER_REQUEST[case])


def _columnar_cases():
    sb_frames = encode(COLUMNAR_SAMPLES[0])
    sb = _header_of(sb_frames)
    tb = _header_of(encode(COLUMNAR_SAMPLES[1]))
    an = _header_of(encode(COLUMNAR_SAMPLES[2]))
    bufs = [bytes(f) for f in sb_frames[2:]]

    def step(update=None, buffers=None, group=None, group_index=0, drop=()):
        h = {**sb, **(update or {})}
        if group is not None:
            groups = [dict(g) for g in h["groups"]]
            groups[group_index] = {k: v for k, v in {**groups[group_index], **group}.items() if v is not ...}
            h["groups"] = groups
        h = {k: v for k, v in h.items() if k not in drop}
        return [b"", msgpack.packb(h, use_bin_type=True), *(bufs if buffers is None else buffers)]

    def tok(update=None, drop=()):
        h = {k: v for k, v in {**tb, **(update or {})}.items() if k not in drop}
        return [b"", msgpack.packb(h, use_bin_type=True)]

    def ana(update=None, value=None, drop=()):
        h = {k: v for k, v in {**an, **(update or {})}.items() if k not in drop}
        if value is not None:
            h["values"] = {**h["values"], "score": {**h["values"]["score"], **value}}
        return [b"", msgpack.packb(h, use_bin_type=True)]

    g0 = sb["groups"][0]
    entry = g0["tensors"][0]
    return {
        # columns (10.1)
        "seqs too short": step({"seqs": _col([1, 2])}),
        "seqs too long": step({"seqs": _col([1, 2, 3, 4])}),
        "seqs negative": step({"seqs": _col([1, -2, 3])}),
        "seqs not a multiple of 8 bytes": step({"seqs": _col([1, 2, 3])[:-1]}),
        "seqs as str": step({"seqs": "abcdefgh" * 3}),
        "seqs as array": step({"seqs": [1, 2, 3]}),
        "seqs nil": step({"seqs": None}),
        "seqs missing": step(drop=("seqs",)),
        "duplicate request ids": step({"request_ids": ["r0", "r1", "r0"]}),
        "int request id": step({"request_ids": ["r0", 1, "r2"]}),
        "steering_versions wrong length": step({"steering_versions": _col([1])}),
        "steering_versions nil": step({"steering_versions": None}),
        "groups not an array": step({"groups": {}}),
        "group not a map": step({"groups": [1]}, buffers=[]),
        # row groups (10.2)
        "request index out of range": step(group={"requests": _col([0, 3])}),
        "negative request index": step(group={"requests": _col([0, -1])}),
        "negative rows": step(group={"rows": _col([2, -3])}),
        "rows wrong length": step(group={"rows": _col([5])}),
        "requests missing": step(group={"requests": ...}),
        "positions wrong length": step(group={"positions": _col([0, 1, 7, 8])}),
        "positions missing": step(group={"positions": ...}),
        "token_ids wrong length": step(group={"token_ids": _col([1])}),
        "token_ids nil": step(group={"token_ids": None}),
        "negative part": step(group={"part": -1}),
        "bool part": step(group={"part": True}),
        "nil part": step(group={"part": None}),
        "two segments of one part in a group": step(group={"requests": _col([0, 0])}),
        "two segments of one part in two groups": step(group={"part": 0}, group_index=1),
        "row0 without stored_rows": step(group={"row0": _col([0, 2])}),
        "stored_rows without row0": step(group={"stored_rows": 5}),
        "row0 past stored_rows": step(group={"row0": _col([0, 3]), "stored_rows": 5}),
        "negative row0": step(group={"row0": _col([-1, 2]), "stored_rows": 5}),
        "negative stored_rows": step(group={"row0": _col([0, 2]), "stored_rows": -5}),
        "stored_rows not the tensors' rows": step(group={"row0": _col([0, 2]), "stored_rows": 6}),
        "row_index without stored_rows": step(group={"row_index": _col([0, 1, 2, 3, 4])}),
        "row_index past stored_rows": step(group={"row_index": _col([0, 1, 2, 3, 5]), "stored_rows": 5}),
        "row_index with row0": step(group={"row_index": _col([0, 1, 2, 3, 4]), "row0": _col([0, 2]),
                                           "stored_rows": 5}),
        "row_index wrong length": step(group={"row_index": _col([0, 1]), "stored_rows": 5}),
        "layer_index past the stored layers": step(group={"tensors": [{**entry, "layer_index": _col([2])}]}),
        "layer_index not ascending": step(group={"tensors": [{**entry, "layer_index": _col([1, 0])}]}),
        "entry of one dim": step(group={"tensors": [{**entry, "shape": [80], "layers": []}]}),
        "entry rows differ": step(group={"tensors": [{**entry, "shape": [2, 4, 10], "raw_nbytes": 320,
                                                       "nbytes": 320}]}, buffers=[b"\0" * 320, *bufs[1:]]),
        "scale of fewer dims in a group": step(group={"tensors": sb["groups"][1]["tensors"][:0] + [
            {**sb["groups"][1]["tensors"][0], "scale": {"dtype": "float32", "shape": [1, 1]}}]}, group_index=1,
            buffers=[bufs[0], bufs[1], b"\0" * 4]),
        "shard along the rows in a group": step(group={"tensors": [
            {**sb["groups"][1]["tensors"][0], "shard": {"tp_rank": 0, "tp_size": 1, "dim": 1, "start": 0,
                                                          "stop": 3, "total": 3}}]}, group_index=1),
        "missing buffer frame": step(buffers=bufs[:-1]),
        "extra buffer frame": step(buffers=[*bufs, b""]),
        "shm entry without shm_ring": step(group={"tensors": [{**entry, "shm": 0}]}, buffers=bufs[1:]),
        "bad shm_ring": step({"shm_ring": "ring"}),
        # token batches (3.14)
        "counts wrong length": tok({"counts": _col([1, 0])}),
        "negative count": tok({"counts": _col([1, -1, 3])}),
        "token_ids not sum(counts)": tok({"token_ids": _col([5, 6])}),
        "token_ids missing": tok(drop=("token_ids",)),
        "first_positions wrong length": tok({"first_positions": _col([3])}),
        "finish_reasons wrong length": tok({"finish_reasons": [None]}),
        "int finish reason": tok({"finish_reasons": [None, 1, None]}),
        "token batch with a buffer": [*tok(), b"x"],
        "token batch seqs negative": tok({"seqs": _col([0, -1, 0])}),
        # analysis (3.15)
        "negative analysis rows": ana({"rows": _col([4, -1])}),
        "analysis rows wrong length": ana({"rows": _col([3])}),
        "analysis positions wrong length": ana({"positions": _col([-1])}),
        "alert of 2": ana({"alerts": _col([0, 2, 0])}),
        "negative alert": ana({"alerts": _col([0, -1, 0])}),
        "value shape[0] != rows": ana(value={"shape": [2]}),
        "value bytes != shape": ana(value={"data": b"\0" * 8}),
        "value of an unknown dtype": ana(value={"dtype": "bfloat16"}),
        "value without dtype": ana(value={"dtype": None}),
        "value with a bool dim": ana(value={"shape": [True]}),
        "value of no dims": ana(value={"shape": []}),
        "value data as str": ana(value={"data": "abcdefghijkl"}),
        "bool value byte 2": ana({"values": {"hit": {"dtype": "bool", "shape": [3], "data": b"\x00\x02\x01"}}}),
        "value name as bin": ana({"values": {b"score": an["values"]["score"]}}),
        "values not a map": ana({"values": []}),
        "label wrong length": ana({"labels": {"why": ["a"]}}),
        "label element int": ana({"labels": {"why": ["a", 1, None]}}),
        "label name as bin": ana({"labels": {b"why": ["a", None, "c"]}}),
        "analyzer missing": ana(drop=("analyzer",)),
        "analysis with a buffer": [*ana(), b"x"],
    }


_COLUMNAR = _columnar_cases()


@pytest.mark.parametrize("case", sorted(_COLUMNAR))
def test_malformed_columnar_messages_are_refused_by_every_receiver(case):
    _refused_by_all(_COLUMNAR[case])


def test_a_bin_key_is_an_unknown_key():
    frames = [b"", msgpack.packb({"v": [2, 0], "kind": "credit", "nbytes": 5, b"nbytes": -1, b"x": None},
                                 use_bin_type=True)]
    assert decode(frames).nbytes == spec_decoder.decode(frames).fields["nbytes"] == 5
    assert _outcome(decode_header, frames) == "ok"


def test_the_malformed_cases_are_otherwise_valid():
    """Each malformed case is one change away from a message all three accept (so each case tests its rule)."""
    for frames in (_tensor_frames(), *(encode(m) for m in SAMPLES + COLUMNAR_SAMPLES)):
        assert _outcome(decode_header, frames) == _outcome(decode, frames) == "ok"
        assert _outcome(spec_decoder.decode, frames) == "ok"
    ring_ok = _reframe(_tensor_frames(), {"shm_ring": _RING_NAME})  # named, used by no entry: valid, no reader
    assert _outcome(decode_header, ring_ok) == _outcome(decode, ring_ok) == "ok"
    assert _outcome(spec_decoder.decode, ring_ok) == "ok"


def test_oversized_raw_nbytes_and_lz4_bombs():
    frames = _tensor_frames()
    total = sum(len(memoryview(f).cast("B")) for f in frames)
    decode(frames, max_message_bytes=total)
    with pytest.raises(OversizedMessageError, match=f"{total} bytes exceeds the limit of {total - 1}"):
        decode(frames, max_message_bytes=total - 1)
    assert _outcome(spec_decoder.decode, frames, total - 1) == "oversized"
    big_header = msgpack.packb({"v": [2, 0], "kind": "heartbeat", "sender_id": "x" * (17 << 20), "role": "b",
                                "instance": 1})
    with pytest.raises(OversizedMessageError, match="header"):
        decode([b"", big_header])
    assert _outcome(spec_decoder.decode, [b"", big_header]) == _outcome(decode_header, [b"", big_header]) == \
        "oversized"
    # an lz4 bomb: 300 bytes on the wire announcing 64 MiB, with a 1 MiB limit
    bomb = lz4.frame.compress(bytes(64 << 20), store_size=True)
    header = {"v": [2, 0], "kind": "tensors", "request_id": "r", "producer_id": "p", "epoch": 0, "seq": 1,
              "step": 1, "tensors": [{"name": "hs", "dtype": "uint8", "shape": [64 << 20], "raw_nbytes": 64 << 20,
                                      "nbytes": len(bomb), "compression": "lz4"}]}
    bombed = [b"r\0", msgpack.packb(header), bomb]
    with pytest.raises(OversizedMessageError, match="uncompressed bytes exceed the limit"):
        decode(bombed, max_message_bytes=1 << 20)
    assert _outcome(spec_decoder.decode, bombed, 1 << 20) == _outcome(
        decode_header, bombed, max_message_bytes=1 << 20) == "oversized"
    header["tensors"][0].update(raw_nbytes=100, shape=[100])  # lying about the size stops after 101 bytes
    lying = [b"r\0", msgpack.packb(header), bomb]
    with pytest.raises(MalformedFrameError, match="lz4 payload gave 101 bytes, header says 100"):
        decode(lying, max_message_bytes=1 << 20)
    assert _outcome(spec_decoder.decode, lying, 1 << 20) == "malformed"
    assert _outcome(decode_header, lying) == "ok"  # the broker never reads payloads


@pytest.mark.parametrize("compression", ["none", "lz4"])
def test_crc_mismatch_is_a_checksum_error(compression):
    arr = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    frames = encode(TensorFrame("r", "p", 0, 1, 1, tensors=[Tensor.from_array("hs", arr)]),
                    compression=compression, checksum=True)
    if compression == "none":
        payload = bytearray(frames[2])
        payload[7] ^= 0x01
    else:
        flipped = arr.copy()
        flipped.flat[3] += 1
        payload = lz4.frame.compress(flipped.tobytes(), store_size=True)
    bad = _reframe(_with_entry(frames, nbytes=len(payload)), buffers=[bytes(payload)])
    with pytest.raises(ChecksumError, match=r"tensor 'hs': crc32 0x[0-9a-f]{8} != header"):
        decode(bad)
    assert _outcome(spec_decoder.decode, bad) == "checksum"
    decode(bad, verify=False)  # verification can be switched off, e.g. by a recorder
    spec_decoder.decode(bad, verify=False)
    # a header rule broken after the corrupted payload makes the message malformed, not a checksum error:
    # every header rule is checked before any payload is read (section 6)
    second = {**_header_of(bad)["tensors"][0], "name": 5}
    both = _reframe(bad, {"tensors": [_header_of(bad)["tensors"][0], second]}, buffers=[bytes(payload)] * 2)
    assert _outcome(decode, both) == _outcome(spec_decoder.decode, both) == "malformed"


def test_truncated_messages():
    frames = _tensor_frames()
    with pytest.raises(MalformedFrameError, match="at least 2 frames"):
        decode(frames[:1])
    with pytest.raises(MalformedFrameError, match="buffer frame is missing"):
        decode(frames[:2])
    with pytest.raises(MalformedFrameError, match="not valid msgpack"):
        decode([frames[0], bytes(frames[1])[:-3], *frames[2:]])
    with pytest.raises(MalformedFrameError, match="buffer has 95 bytes, header says 96"):
        decode([frames[0], frames[1], bytes(frames[2])[:-1]])
    for bad in (frames[:1], frames[:2], [frames[0], bytes(frames[1])[:-3], *frames[2:]]):
        _refused_by_all(bad)
    lz = _tensor_frames(compression="lz4")
    payload = bytes(lz[2])[:-5]
    cut = _reframe(_with_entry(lz, nbytes=len(payload)), buffers=[payload])
    with pytest.raises(MalformedFrameError, match="lz4"):
        decode(cut)
    assert _outcome(spec_decoder.decode, cut) == "malformed"
    trailing = _reframe(_with_entry(lz, nbytes=len(lz[2]) + 3), buffers=[bytes(lz[2]) + b"abc"])
    assert _outcome(decode, trailing) == _outcome(spec_decoder.decode, trailing) == "malformed"


def test_wrong_major_version_is_a_clear_schema_version_error():
    for major in (0, 1, 3, 99):
        bad = _reframe(encode(SAMPLES[0]), {"v": [major, 0]})
        with pytest.raises(SchemaVersionError, match=rf"major version {major} .*speaks 2\.x"):
            decode(bad)
        assert _outcome(spec_decoder.decode, bad) == _outcome(decode_header, bad) == "schema_version"
    for bad in (None, "1.0", [2], [2, "0"], 5, [True, 3], [2, 0, 1], [2.0, 0]):
        frames = _reframe(encode(SAMPLES[0]), {"v": bad})
        with pytest.raises(MalformedFrameError, match="'v'"):
            decode(frames)
        _refused_by_all(frames)


def test_newer_minor_with_unknown_fields_is_accepted():
    frames = _reframe(encode(SAMPLES[2]), {"v": [2, 7], "added_in_2_7": {"x": 1}})
    assert _fields(decode(frames)) == _fields(SAMPLES[2])
    assert spec_decoder.decode(frames).version == (2, 7)
    cols = _reframe(encode(COLUMNAR_SAMPLES[0]), {"v": [2, 9], "added_in_2_9": [1]})
    _agree(cols)


def test_unknown_kind_missing_fields_and_wrong_types_name_the_field():
    with pytest.raises(MalformedFrameError, match="unknown message kind 'no_such_kind'"):
        decode(_reframe(encode(SAMPLES[5]), {"kind": "no_such_kind"}))
    with pytest.raises(MalformedFrameError, match="tokens header lacks required field 'seq'"):
        decode(_reframe(encode(SAMPLES[2]), header_delete=["seq"]))
    with pytest.raises(MalformedFrameError, match="tokens.seq must be int"):
        decode(_reframe(encode(SAMPLES[2]), {"seq": "3"}))
    with pytest.raises(MalformedFrameError, match="steer_ack.ok must be bool"):
        decode(_reframe(encode(SAMPLES[7]), {"ok": 1}))
    with pytest.raises(MalformedFrameError, match="must be a msgpack map"):
        decode([b"", msgpack.packb([1, 2])])
    with pytest.raises(MalformedFrameError, match="not valid msgpack"):
        decode([b"", msgpack.packb({1: "int key"})])
    with pytest.raises(MalformedFrameError, match="gap.missing"):
        decode(_reframe(encode(SAMPLES[4]), {"missing": [[5, 2]]}))
    with pytest.raises(MalformedFrameError, match="ring name"):
        decode(_reframe(_tensor_frames(), {"shm_ring": ""}))
    with pytest.raises(MalformedFrameError, match="inconsistent shard geometry"):
        decode(_PER_REQUEST["shard stop - start != shape[dim]"])
    with pytest.raises(MalformedFrameError, match="two segments of part 0"):
        decode(_COLUMNAR["two segments of one part in two groups"])
    with pytest.raises(MalformedFrameError, match="stored_rows with row0 or row_index"):
        decode(_COLUMNAR["stored_rows without row0"])


def test_buffer_count_and_size_mismatch():
    frames = _tensor_frames()
    with pytest.raises(MalformedFrameError, match="1 buffer frame.* not described"):
        decode([*frames, b"extra"])
    with pytest.raises(MalformedFrameError, match="unexpected buffer"):
        decode([*encode(SAMPLES[2]), b"extra"])
    with pytest.raises(MalformedFrameError, match="buffer has 97 bytes, header says 96"):
        decode([frames[0], frames[1], bytes(frames[2]) + b"x"])
    q = Tensor.from_array("q", np.zeros((2, 2), np.int8), scale=np.ones((2, 1), np.float32))
    scaled = encode(TensorFrame("r", "p", 0, 1, 1, tensors=[q]))
    with pytest.raises(MalformedFrameError, match="scale buffer is missing"):
        decode(scaled[:3])
    with pytest.raises(MalformedFrameError, match="scale buffer has 12 bytes, its shape needs 8"):
        decode([*scaled[:3], b"\0" * 12])
    for bad in ([*frames, b"extra"], scaled[:3], [*scaled[:3], b"\0" * 12]):
        _refused_by_all(bad)


# --- ring payloads that cannot be read: lost, not malformed (section 9) ---------------------------------------


def _ring_step(writer, rows=(2, 3)):
    hs = np.arange(2 * sum(rows) * 256, dtype=np.float32).reshape(2, sum(rows), 256)
    batch = StepBatch("p", 4, 9, ["a", "b"], [5, 7], [RowGroup([0, 1], list(rows), np.arange(sum(rows)),
                                                               [Tensor.from_array("hs", hs)])])
    return encode(batch, shm=writer), hs


def _lost_alike(frames, reason, reader):
    """Both decoders find the message lost for ``reason``, and the reference names one gap per request."""
    with pytest.raises(ShmOverrunError if reason == "shm_overrun" else ShmUnavailableError):
        decode(frames, shm=reader)
    with pytest.raises(spec_decoder.SpecLost) as lost:
        spec_decoder.decode(frames)
    assert lost.value.reason == reason
    assert _outcome(decode_header, frames) == "ok"  # the header is valid: only the ring shows the failure


def test_ring_failures_are_losses_with_one_gap_per_request(ring):
    writer, reader = ring
    frames, hs = _ring_step(writer)
    header = decode_header(frames)
    entry = header["groups"][0]["tensors"][0]
    # past what was written
    past = _reframe(frames, {"groups": [{**header["groups"][0], "tensors": [{**entry, "shm": writer.written}]}]})
    _lost_alike(past, "shm_unavailable", reader)
    # crossing the end of the data region
    cross = writer.size - 16 + writer.size * (writer.written // writer.size)
    crossing = _reframe(frames, {"groups": [{**header["groups"][0], "tensors": [{**entry, "shm": cross}]}]})
    _lost_alike(crossing, "shm_unavailable", reader)
    # a ring that does not exist (a valid name)
    gone = _reframe(frames, {"shm_ring": "mia-stream-ring-1-000000000000"})
    _lost_alike(gone, "shm_unavailable", reader)
    # each lost message becomes a gap of each request it names, each naming that request's seq (section 9): one
    # GapBatch for a message naming several
    try:
        decode(gone, shm=reader)
    except SharedBufferError as e:
        (batch,) = shm_loss_gaps(header, e, "consumer")
    assert isinstance(batch, GapBatch) and decode(encode(batch)).ranges() == batch.ranges()
    assert [(g.request_id, g.producer_id, g.epoch, g.missing, g.reason, g.origin) for g in batch.notices()] == [
        ("a", "p", 4, [[5, 5]], "shm_unavailable", "consumer"), ("b", "p", 4, [[7, 7]], "shm_unavailable",
                                                                  "consumer")]
    # overwritten: the writer laps the payload, for the whole message and for a selection's gathered rows
    sel, _ = select_requests(frames, header, [1])
    np.testing.assert_array_equal(decode(sel, shm=reader).tensor("hs"), hs[:, 2:])
    for _ in range(5):
        writer.put(b"\0" * (writer.size // 4 - 64))
    _lost_alike(frames, "shm_overrun", reader)
    _lost_alike(sel, "shm_overrun", reader)
    gaps = shm_loss_gaps(decode_header(sel), ShmOverrunError("x"), "broker")  # naming one request: a GapNotice
    assert [(type(g), g.request_id, g.missing, g.reason, g.origin) for g in gaps] == [
        (GapNotice, "b", [[7, 7]], "shm_overrun", "broker")]


def test_a_file_that_is_not_a_ring_is_unavailable(ring, tmp_path):
    writer, reader = ring
    frames, _ = _ring_step(writer)
    wrong_size = b"MIASHM01" + (8192).to_bytes(8, "little") + bytes(4096 - 16 + 4096)  # says 8192, holds 4096
    for content in (b"", b"x" * 100, b"NOTARING" + bytes(8000), wrong_size):
        (tmp_path / "mia-stream-ring-7-abcdefabcdef").write_bytes(content)
        fake = _reframe(frames, {"shm_ring": "mia-stream-ring-7-abcdefabcdef"})
        other = ShmRingReader(directory=str(tmp_path))
        try:
            with pytest.raises(ShmUnavailableError):
                decode(fake, shm=other)
        finally:
            other.close()
        with pytest.raises(spec_decoder.SpecLost, match="shm_unavailable"):
            spec_decoder.decode(fake, directory=str(tmp_path))


def test_ring_name_grammar_is_the_same_for_readers_and_sweeps(tmp_path):
    """Section 9's grammar: ASCII decimal pid without leading zero, 12 lowercase hex digits. A sweep skips a
    name whose pid no process can have instead of crashing (os.kill overflowed: every ShmRingWriter sweeps)."""
    from mia_stream.bus.shm_ring import is_ring_name

    good = ["mia-stream-ring-1-0123456789ab", "mia-stream-ring-4194304-abcdefabcdef"]
    bad = ["mia-stream-ring-01-0123456789ab", "mia-stream-ring-1-0123456789AB", "mia-stream-ring--1-0123456789ab",
           "mia-stream-ring-\u0661-0123456789ab", "mia-stream-ring-1-0123456789abc", "x/mia-stream-ring-1-0123456789ab",
           "mia-stream-ring-1-0123456789ab\n", "", None, 5]
    for name in good:
        assert is_ring_name(name) and spec_decoder.RING_NAME.fullmatch(name)
    for name in bad:
        assert not is_ring_name(name)
        assert not (isinstance(name, str) and spec_decoder.RING_NAME.fullmatch(name))
    huge = tmp_path / ("mia-stream-ring-" + "9" * 30 + "-0123456789ab")
    huge.write_bytes(b"")
    assert sweep_stale_rings(str(tmp_path)) == 0 and huge.exists()


# --- corrupted messages: both decoders reach the same outcome -------------------------------------------------


def _corrupt_one_byte(frames: list[bytes], position: int, byte: int) -> list[bytes]:
    """``frames`` with the byte at ``position`` (counted over all frames, modulo their total) set to ``byte``."""
    lengths = [len(f) for f in frames]
    which, offset = 0, position % sum(lengths)
    while offset >= lengths[which]:
        offset -= lengths[which]
        which += 1
    corrupted = bytearray(frames[which])
    corrupted[offset] = byte
    return frames[:which] + [bytes(corrupted)] + frames[which + 1:]


def _corruption_bases():
    arr = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    q = Tensor.from_array("q", np.arange(8, dtype=np.int8).reshape(2, 4), scale=np.ones((2, 1), np.float32),
                          shard=Shard(0, 2, 1, 0, 4, 8))
    out = []
    for compression in ("none", "lz4"):
        out.append([bytes(f) for f in encode(TensorFrame("r", "p", 0, 1, 1, positions=[1, 2, 3], token_ids=[4, 5, 6],
                                                         tensors=[Tensor.from_array("hs", arr), q]),
                                             compression=compression, checksum=True)])
        out.append([bytes(f) for f in encode(COLUMNAR_SAMPLES[0], compression=compression, checksum=True)])
    sel, _ = select_requests(out[1], decode_header(out[1]), [0, 2])
    out += [[bytes(f) for f in sel], [bytes(f) for f in encode(COLUMNAR_SAMPLES[1])],
            [bytes(f) for f in encode(COLUMNAR_SAMPLES[2])]]
    return out


_BASES = _corruption_bases()


@settings(max_examples=600, deadline=None)
@given(st.sampled_from(range(len(_BASES))), st.integers(0, 10_000), st.integers(0, 255))
def test_property_corrupted_bytes_get_the_same_outcome_from_every_decoder(base, position, byte):
    """Any single-byte corruption of a valid message: decode raises only WireErrors, and the spec decoder
    reaches the same outcome (decoded alike, malformed, checksum error...); the broker's validator passes
    only what decode passes or refuses for a payload (lz4, checksum)."""
    frames = _corrupt_one_byte(_BASES[base], position, byte)
    official = _outcome(decode, frames)
    assert official == _outcome(spec_decoder.decode, frames)
    header = _outcome(decode_header, frames)
    assert header == official or (header == "ok" and official in ("malformed", "checksum"))
    if official == "ok":
        message = decode(frames)
        if message.KIND in ("step_batch", "token_batch", "analysis"):
            _agree(frames)
        else:
            by_spec = spec_decoder.decode(frames)
            assert {k: v for k, v in by_spec.fields.items() if k != "tensors"} == _fields(message)
            assert [t.raw.tobytes() for t in by_spec.tensors] == [t.raw().tobytes() for t in message.tensors]


# --- batches (section 8) -------------------------------------------------------------------------------------


def test_batch_section_documents_its_fields():
    section = re.search(r"\n## 8\. Batches.*?(?=\n## 9)", DOC.read_text(), re.S)
    assert section, "docs/wire-format.md has no batch section"
    assert set(re.findall(r"^\| `(\w+)` \|", section.group(0), re.M)) == {"v", "kind", "frames"}


def test_batch_carries_every_kind_unchanged_and_both_decoders_agree():
    q = Tensor.from_array("q", np.arange(8, dtype=np.int8).reshape(2, 4), scale=np.ones((2, 1), np.float32))
    tf = TensorFrame("req-1", "prod-a", 7, 3, 11, tensors=[Tensor.from_array("hs", np.ones((1, 2, 3), np.float32)), q])
    messages = [encode(m) for m in (*SAMPLES, tf)]
    batch = encode_batch(messages + [encode(m) for m in COLUMNAR_SAMPLES])
    assert bytes(batch[0]) == b"" and msgpack.unpackb(batch[1]) == {
        "v": list(SCHEMA_VERSION), "kind": "batch", "frames": [len(m) for m in messages] + [
            len(encode(m)) for m in COLUMNAR_SAMPLES]}
    parts = split_batch(batch)
    assert len(parts) == len(messages) + len(COLUMNAR_SAMPLES)
    for part, original in zip(parts, messages):
        assert len(part) == len(original) and all(a is b for a, b in zip(part, original))  # no copies
    wire = [bytes(memoryview(f).cast("B")) for f in batch]  # as a receiver in any language gets it
    spec_parts = spec_decoder.split_batch(wire)
    assert [[bytes(memoryview(f).cast("B")) for f in m] for m in messages] == spec_parts[:len(messages)]
    for part, spec_part, msg in zip(split_batch(wire), spec_parts, (*SAMPLES, tf)):
        assert {k: v for k, v in spec_decoder.decode(spec_part).fields.items() if k != "tensors"} == _fields(msg)
        assert _fields(decode(part)) == _fields(msg)
    for spec_part in spec_parts[len(messages):]:
        _agree(spec_part)


def test_single_messages_are_not_batches():
    for msg in SAMPLES + COLUMNAR_SAMPLES:  # columnar messages have an empty topic too
        frames = encode(msg)
        assert split_batch(frames) is None
        assert spec_decoder.split_batch(frames) is None


def test_a_decoder_that_does_not_split_batches_rejects_one_as_an_unknown_kind():
    """A batch reaching a decoder that does not split batches is refused cleanly, never misread."""
    batch = encode_batch([encode(SAMPLES[2]), encode(SAMPLES[3])])
    with pytest.raises(MalformedFrameError, match="unknown message kind 'batch'"):
        decode(batch)
    with pytest.raises(spec_decoder.SpecMalformed, match="unknown kind 'batch'"):
        spec_decoder.decode(batch)
    with pytest.raises(MalformedFrameError, match="unknown message kind 'batch'"):  # batches do not nest
        decode(split_batch(encode_batch([batch]))[0])


@pytest.mark.parametrize("counts, match", [
    ([2, 2], "adds up to 4 frames, the batch carries 5"),
    ([2, 4], "adds up to 6 frames, the batch carries 5"),
    ([1, 4], "each >= 2"),
    ([True, 4], "each >= 2"),
    ([2, "3"], "each >= 2"),
    ([], "1 to 4096"),
    ([2] * 4097, "1 to 4096"),
    (5, "1 to 4096"),
])
def test_malformed_batches_are_refused_by_both_decoders(counts, match):
    frames = [bytes(f) for f in encode_batch([encode(SAMPLES[2]), encode(TensorFrame("r", "p", 0, 1, 1))])]
    frames[1] = msgpack.packb({"v": list(SCHEMA_VERSION), "kind": "batch", "frames": counts})
    frames.append(b"")  # 5 frames after the header: counts of 2 + 3 do not describe them either
    with pytest.raises(MalformedFrameError, match=match):
        split_batch(frames)
    with pytest.raises(spec_decoder.SpecMalformed):
        spec_decoder.split_batch(frames)


@pytest.mark.parametrize("v", [[1, 2], [3, 0], [True, 0]])
def test_a_batch_of_another_major_is_decoded_as_one_message_and_refused(v):
    """Section 8: only a header of this major can make a batch; anything else is one message, refused there."""
    batch = encode_batch([encode(SAMPLES[2])])
    batch[1] = msgpack.packb({"v": v, "kind": "batch", "frames": [2]})
    assert split_batch(batch) is None and spec_decoder.split_batch(batch) is None
    want = "malformed" if v[0] is True else "schema_version"
    assert _outcome(decode, batch) == _outcome(spec_decoder.decode, batch) == want


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 10_000), st.integers(0, 255))
def test_property_corrupted_batches_raise_only_wire_errors_and_split_alike(position, byte):
    frames = [bytes(f) for f in encode_batch([encode(SAMPLES[0]), _tensor_frames(), encode(SAMPLES[4]),
                                              encode(COLUMNAR_SAMPLES[0])])]
    frames = _corrupt_one_byte(frames, position, byte)
    try:
        parts = split_batch(frames)
    except WireError:
        parts = "malformed"
    try:
        spec_parts = spec_decoder.split_batch(frames)
    except spec_decoder.SpecMalformed:
        spec_parts = "malformed"
    assert parts == spec_parts or [[bytes(memoryview(f).cast("B")) for f in m] for m in parts] == spec_parts
    for part in parts if isinstance(parts, list) else []:
        assert _outcome(decode, part) == _outcome(spec_decoder.decode, part)


# --- gap batches (3.16, 10.6) ----------------------------------------------------------------------------


def _gap_batch_sample() -> GapBatch:
    return GapBatch.of("prod-a", 7, [("r0", [[3, 3], [7, 9]]), ("r1", []), ("r2", [[0, 0]])],
                       "consumer_queue_full", "broker", 17)


def test_a_gap_batch_reads_as_its_gap_notices_in_both_decoders():
    msg = _gap_batch_sample()
    frames = encode(msg)
    assert bytes(frames[0]) == b"" and len(frames) == 2
    decode_header(frames)
    official = decode(frames)
    spec = spec_decoder.decode(frames)
    assert spec.kind == official.KIND == "gap_batch" and spec.version == tuple(SCHEMA_VERSION)
    assert {k: v for k, v in spec.fields.items()} == {k: _plain(v) for k, v in _fields(official).items()}
    notices = [_fields(n) for n in official.notices()]
    assert spec.per_request() == notices == [_fields(n) for n in msg.notices()]
    assert notices[0]["missing"] == [[3, 3], [7, 9]] and notices[1]["missing"] == []
    assert official.count == sum(GapNotice(**n).count for n in notices) == 5


def test_a_selection_of_a_gap_batch_keeps_the_kept_requests_ranges():
    frames = encode(_gap_batch_sample())
    selected, header = select_requests(frames, decode_header(frames), [0, 2])
    decode_header(selected)
    assert spec_decoder.decode(selected).per_request() == [_fields(n) for n in decode(selected).notices()]
    assert [(n.request_id, n.missing) for n in decode(selected).notices()] == [("r0", [[3, 3], [7, 9]]),
                                                                             ("r2", [[0, 0]])]


def _gap_batch_cases() -> dict:
    base = msgpack.unpackb(encode(_gap_batch_sample())[1], raw=False)

    def gap(update=None, drop=()):
        h = {k: v for k, v in base.items() if k not in drop}
        h.update(update or {})
        return [b"", msgpack.packb(h, use_bin_type=True)]

    return {
        "counts wrong length": (gap({"counts": _col([2, 0])}), "counts has 2 values, needs 3"),
        "negative count": (gap({"counts": _col([2, -1, 2])}), "counts must be >= 0"),
        "firsts not sum(counts)": (gap({"firsts": _col([3, 7])}), "firsts has 2 values, needs 3"),
        "lasts not sum(counts)": (gap({"lasts": _col([3, 9, 0, 1])}), "lasts has 4 values, needs 3"),
        "first after last": (gap({"firsts": _col([3, 10, 0])}), "0 <= first <= last"),
        "negative first": (gap({"firsts": _col([-1, 7, 0])}), "0 <= first <= last"),
        "counts missing": (gap(drop=("counts",)), "lacks required field 'counts'"),
        "firsts missing": (gap(drop=("firsts",)), "lacks required field 'firsts'"),
        "lasts missing": (gap(drop=("lasts",)), "lacks required field 'lasts'"),
        "counts as an array": (gap({"counts": [2, 0, 1]}), "counts must be bin"),
        "lasts as nil": (gap({"lasts": None}), "lasts must be bin"),
        "firsts not whole int64s": (gap({"firsts": b"\0" * 20}), "firsts must be a bin of little-endian int64s"),
        "a request named twice": (gap({"request_ids": ["r0", "r1", "r0"]}), "names a request twice"),
        "a request id not a str": (gap({"request_ids": ["r0", 1, "r2"]}), "request_ids must be an array of strs"),
        "reason not a str": (gap({"reason": 3}), "reason must be str"),
        "epoch a bool": (gap({"epoch": True}), "epoch must be int"),
        "a buffer frame": ([*gap(), b"x"], "unexpected buffer frame"),
    }


_GAP_BATCH_CASES = _gap_batch_cases()


@pytest.mark.parametrize("case", sorted(_GAP_BATCH_CASES))
def test_malformed_gap_batches_are_refused_by_every_receiver_with_a_precise_error(case):
    frames, error = _GAP_BATCH_CASES[case]
    _refused_by_all(frames)
    for receiver in (decode, decode_header):
        with pytest.raises(MalformedFrameError, match=re.escape(error)):
            receiver(frames)
