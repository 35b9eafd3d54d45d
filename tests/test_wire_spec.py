"""The wire spec (docs/wire-format.md) against the code: a spec-only decoder must read exactly what
``mia_stream.schemas.encode`` writes, and the official decoder must refuse bad input with a clear WireError."""

from __future__ import annotations

import dataclasses
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
                               WireError)
from mia_stream.schemas import (MESSAGE_TYPES, SCHEMA_VERSION, WIRE_DTYPES, ErrorNotice, GapNotice, Heartbeat,
                                Shard, SteeringAck, SteeringCommand, StreamEnd, StreamStart, Subscribe, Tensor,
                                TensorFrame, TokenFrame, Unsubscribe, decode, encode, encode_batch, split_batch)

DOC = Path(__file__).resolve().parents[1] / "docs" / "wire-format.md"

SAMPLES = [
    StreamStart("req-1", "prod-a", 7, engine_request_id="e1", model="m", tokenizer="tok", tp_rank=1, tp_size=2,
                dp_rank=0, num_layers=30, hidden_size=576, num_heads=9, num_kv_heads=3, head_dim=64,
                dtype="bfloat16", capture={"layers": [1, 2], "what": ["hs"]}, steering=[{"layer": 3, "op": "add"}],
                capture_after_steering=False, prompt_token_ids=[1, 2, 3], tags={"user": "x"}, time_ns=123,
                resent=True, control_id="prod-0"),
    TensorFrame("req-1", "prod-a", 7, 3, 11, positions=[5, 6], token_ids=[42, 43], steering_version=2, time_ns=9),
    TokenFrame("req-1", "prod-a", 7, 4, 11, token_ids=[44], positions=[7], finish_reason="length", time_ns=10),
    StreamEnd("req-1", "prod-a", 7, 5, finish_reason="error", num_prompt_tokens=3, num_generated_tokens=2,
              frames_sent=5, frames_dropped=1, bytes_sent=999, drops={"hwm": 1}, uncaptured_positions=[0],
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


def _fields(msg) -> dict:
    return {f.name: getattr(msg, f.name) for f in dataclasses.fields(msg) if f.name != "tensors"}


def _reframe(frames, header_update=None, header_delete=(), buffers=None):
    header = msgpack.unpackb(bytes(frames[1]), raw=False)
    header.update(header_update or {})
    for k in header_delete:
        del header[k]
    return [bytes(frames[0]), msgpack.packb(header, use_bin_type=True),
            *([bytes(b) for b in frames[2:]] if buffers is None else buffers)]


# --- the spec is complete ------------------------------------------------------------------------------------


def test_spec_decoder_and_doc_cover_every_kind_and_field():
    """A kind or field added to _messages.py without documenting it fails here."""
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


@pytest.mark.parametrize("kind", sorted(MESSAGE_TYPES))
def test_required_fields_and_defaults_match_the_spec(kind):
    """A header holding only the spec's required fields decodes, with the spec's defaults for the rest."""
    spec = spec_decoder.KINDS[kind]
    example = {"str": "s", "int": 1, "bool": True, "array": [], "map": {}}
    header = {"v": list(SCHEMA_VERSION), "kind": kind}
    header.update({n: example[t] for n, (t, req, _) in spec.items() if req})
    msg = decode([b"", msgpack.packb(header, use_bin_type=True)])
    for name, (_, required, default) in spec.items():
        if not required:
            assert getattr(msg, name) == default, (kind, name)
    for name, (_, required, _) in spec.items():
        if required:
            with pytest.raises(MalformedFrameError, match=name):
                decode([b"", msgpack.packb({k: v for k, v in header.items() if k != name})])


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
        scale = np.asarray(rng.random(1), np.float32) if scaled else None
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


# --- the official decoder on bad input -----------------------------------------------------------------------


def _tensor_frames(**kw):
    arr = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    return encode(TensorFrame("r", "p", 0, 1, 1, tensors=[Tensor.from_array("hs", arr, layers=[0, 1])]), **kw)


def test_truncated_messages():
    frames = _tensor_frames()
    with pytest.raises(MalformedFrameError, match="at least 2 frames"):
        decode(frames[:1])
    with pytest.raises(MalformedFrameError, match="buffer frame is missing"):
        decode(frames[:2])
    with pytest.raises(MalformedFrameError, match="not valid msgpack"):
        decode([frames[0], bytes(frames[1])[:-3], *frames[2:]])
    with pytest.raises(MalformedFrameError, match="buffer has 95 bytes"):
        decode([frames[0], frames[1], bytes(frames[2])[:-1]])
    lz = _tensor_frames(compression="lz4")
    with pytest.raises(MalformedFrameError, match="lz4"):
        payload = bytes(lz[2])[:-5]
        decode(_reframe(lz, {"tensors": [{**msgpack.unpackb(bytes(lz[1]))["tensors"][0], "nbytes": len(payload)}]},
                        buffers=[payload]))


def test_wrong_major_version_is_a_clear_schema_version_error():
    for major in (0, 2, 99):
        with pytest.raises(SchemaVersionError, match=rf"major version {major} .*speaks 1\.x"):
            decode(_reframe(encode(SAMPLES[0]), {"v": [major, 0]}))
    for bad in (None, "1.0", [1], [1, "0"], 5):
        with pytest.raises(MalformedFrameError, match="'v'"):
            decode(_reframe(encode(SAMPLES[0]), {"v": bad}))


def test_newer_minor_with_unknown_fields_is_accepted():
    msg = decode(_reframe(encode(SAMPLES[2]), {"v": [1, 7], "added_in_1_7": {"x": 1}}))
    assert _fields(msg) == _fields(SAMPLES[2])


def test_unknown_kind_missing_fields_and_wrong_types():
    with pytest.raises(MalformedFrameError, match="unknown message kind 'no_such_kind'"):
        decode(_reframe(encode(SAMPLES[5]), {"kind": "no_such_kind"}))
    with pytest.raises(MalformedFrameError, match=r"lacks required field\(s\) \['seq'\]"):
        decode(_reframe(encode(SAMPLES[2]), header_delete=["seq"]))
    with pytest.raises(MalformedFrameError, match="tokens.seq must be int"):
        decode(_reframe(encode(SAMPLES[2]), {"seq": "3"}))
    with pytest.raises(MalformedFrameError, match="steer_ack.ok must be bool"):
        decode(_reframe(encode(SAMPLES[7]), {"ok": 1}))
    with pytest.raises(MalformedFrameError, match="heartbeat.instance must be int"):
        decode(_reframe(encode(SAMPLES[5]), {"instance": True}))
    with pytest.raises(MalformedFrameError, match="must be a msgpack map"):
        decode([b"", msgpack.packb([1, 2])])
    with pytest.raises(MalformedFrameError, match="not valid msgpack"):
        decode([b"", msgpack.packb({1: "int key"})])
    with pytest.raises(MalformedFrameError, match="gap.missing"):
        decode(_reframe(encode(SAMPLES[4]), {"missing": [[1, "a"]]}))
    with pytest.raises(MalformedFrameError, match="gap.missing"):
        decode(_reframe(encode(SAMPLES[4]), {"missing": [[5, 2]]}))


@pytest.mark.parametrize("field, value, match", [
    ("layers", ["a"], "'layers' must be a list of ints"),
    ("meta", 5, "'meta' must be dict"),
    ("dtype", [1], "'dtype' must be str"),
    ("dtype", "float64", "unknown dtype 'float64'"),
    ("compression", "zstd", "unknown compression 'zstd'"),
    ("crc32", "x", "'crc32' must be int"),
    ("name", 5, "'name' must be str"),
    ("shape", 5, "'shape' must be list"),
    ("shape", [-2, -12], "negative dimension"),
    ("shape", [2, 3, 5], "96 bytes for shape"),
    ("raw_nbytes", 50, "raw_nbytes 50 != nbytes 96"),
    ("shard", {"tp_rank": 0}, "bad shard geometry"),
    ("scale", 3, "'scale' must be dict"),
    ("scale", {"dtype": "float16", "shape": [1]}, "scale dtype must be float32"),
])
def test_bad_tensor_entries_are_malformed_not_crashes(field, value, match):
    """Regression: before the fix several of these escaped as ValueError/TypeError from inside decode."""
    frames = _tensor_frames()
    entry = msgpack.unpackb(bytes(frames[1]), raw=False)["tensors"][0]
    with pytest.raises(MalformedFrameError, match=match):
        decode(_reframe(frames, {"tensors": [{**entry, field: value}]}, buffers=[bytes(frames[2]), b"\0" * 4]
                        if field == "scale" else None))


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
    with pytest.raises(MalformedFrameError, match="bad scale buffer"):
        decode([*scaled[:3], b"\0" * 12])


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
    header_entry = msgpack.unpackb(bytes(frames[1]), raw=False)["tensors"][0]
    bad = _reframe(frames, {"tensors": [{**header_entry, "nbytes": len(payload)}]}, buffers=[bytes(payload)])
    with pytest.raises(ChecksumError, match=r"tensor 'hs': crc32 0x[0-9a-f]{8} != header"):
        decode(bad)
    decode(bad, verify=False)  # verification can be switched off, e.g. by a recorder


def test_oversized_messages():
    frames = _tensor_frames()
    total = sum(len(memoryview(f).cast("B")) for f in frames)
    decode(frames, max_message_bytes=total)
    with pytest.raises(OversizedMessageError, match=f"{total} bytes exceeds the limit of {total - 1}"):
        decode(frames, max_message_bytes=total - 1)
    big_header = msgpack.packb({"v": [1, 0], "kind": "heartbeat", "sender_id": "x" * (17 << 20), "role": "b",
                                "instance": 1})
    with pytest.raises(OversizedMessageError, match="header"):
        decode([b"", big_header])
    # an lz4 bomb: 300 bytes on the wire announcing 64 MiB, with a 1 MiB limit
    bomb = lz4.frame.compress(bytes(64 << 20), store_size=True)
    header = {"v": [1, 0], "kind": "tensors", "request_id": "r", "producer_id": "p", "epoch": 0, "seq": 1,
              "step": 1, "tensors": [{"name": "hs", "dtype": "uint8", "shape": [64 << 20], "raw_nbytes": 64 << 20,
                                      "nbytes": len(bomb), "compression": "lz4"}]}
    with pytest.raises(OversizedMessageError, match="uncompressed bytes exceed the limit"):
        decode([b"r\0", msgpack.packb(header), bomb], max_message_bytes=1 << 20)
    header["tensors"][0].update(raw_nbytes=100, shape=[100])  # lying about the size stops after 101 bytes
    with pytest.raises(MalformedFrameError, match="lz4 payload gave 101 bytes, header says 100"):
        decode([b"r\0", msgpack.packb(header), bomb], max_message_bytes=1 << 20)


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


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 10_000), st.integers(0, 255), st.sampled_from(["none", "lz4"]))
def test_property_corrupted_bytes_raise_only_wire_errors(position, byte, compression):
    """Any single-byte corruption of a valid message either decodes or raises a WireError, never anything else."""
    arr = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    q = Tensor.from_array("q", np.arange(8, dtype=np.int8).reshape(2, 4), scale=np.ones((2, 1), np.float32),
                          shard=Shard(0, 2, 1, 0, 4, 8))
    frames = [bytes(f) for f in encode(TensorFrame("r", "p", 0, 1, 1, positions=[1, 2, 3], token_ids=[4, 5, 6],
                                                   tensors=[Tensor.from_array("hs", arr), q]),
                                       compression=compression, checksum=True)]
    frames = _corrupt_one_byte(frames, position, byte)
    try:
        decode(frames)
    except WireError:
        pass


# --- batches (section 8) -------------------------------------------------------------------------------------


def test_batch_section_documents_its_fields():
    section = re.search(r"\n## 8\. Batches.*", DOC.read_text(), re.S)
    assert section, "docs/wire-format.md has no batch section"
    assert set(re.findall(r"^\| `(\w+)` \|", section.group(0), re.M)) == {"v", "kind", "frames"}


def test_batch_carries_every_kind_unchanged_and_both_decoders_agree():
    q = Tensor.from_array("q", np.arange(8, dtype=np.int8).reshape(2, 4), scale=np.ones((2, 1), np.float32))
    tf = TensorFrame("req-1", "prod-a", 7, 3, 11, tensors=[Tensor.from_array("hs", np.ones((1, 2, 3), np.float32)), q])
    messages = [encode(m) for m in (*SAMPLES, tf)]
    batch = encode_batch(messages)
    assert bytes(batch[0]) == b"" and msgpack.unpackb(batch[1]) == {
        "v": list(SCHEMA_VERSION), "kind": "batch", "frames": [len(m) for m in messages]}
    parts = split_batch(batch)
    assert len(parts) == len(messages)
    for part, original in zip(parts, messages):
        assert len(part) == len(original) and all(a is b for a, b in zip(part, original))  # no copies
    wire = [bytes(memoryview(f).cast("B")) for f in batch]  # as a receiver in any language gets it
    spec_parts = spec_decoder.split_batch(wire)
    assert [[bytes(memoryview(f).cast("B")) for f in m] for m in messages] == spec_parts
    for part, spec_part, msg in zip(split_batch(wire), spec_parts, (*SAMPLES, tf)):
        assert {k: v for k, v in spec_decoder.decode(spec_part).fields.items() if k != "tensors"} == _fields(msg)
        assert _fields(decode(part)) == _fields(msg)


def test_single_messages_are_not_batches():
    for msg in SAMPLES:
        frames = encode(msg)
        assert split_batch(frames) is None
        assert spec_decoder.split_batch(frames) is None


def test_a_1_1_decoder_rejects_a_batch_as_an_unknown_kind():
    """A batch reaching a decoder that does not split batches is refused cleanly, never misread."""
    batch = encode_batch([encode(SAMPLES[2]), encode(SAMPLES[3])])
    with pytest.raises(MalformedFrameError, match="unknown message kind 'batch'"):
        decode(batch)
    with pytest.raises(spec_decoder.SpecDecodeError, match="unknown kind 'batch'"):
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
    frames[1] = msgpack.packb({"v": [1, 2], "kind": "batch", "frames": counts})
    frames.append(b"")  # 5 frames after the header: counts of 2 + 3 do not describe them either
    with pytest.raises(MalformedFrameError, match=match):
        split_batch(frames)
    with pytest.raises(spec_decoder.SpecDecodeError):
        spec_decoder.split_batch(frames)


def test_batch_of_another_major_is_a_schema_version_error():
    batch = encode_batch([encode(SAMPLES[2])])
    batch[1] = msgpack.packb({"v": [2, 0], "kind": "batch", "frames": [2]})
    assert split_batch(batch) is None  # left to the single-message path, which names the version
    with pytest.raises(SchemaVersionError):
        decode(batch)
    with pytest.raises(spec_decoder.SpecDecodeError):
        spec_decoder.split_batch(batch)


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 10_000), st.integers(0, 255))
def test_property_corrupted_batches_raise_only_wire_errors(position, byte):
    frames = [bytes(f) for f in encode_batch([encode(SAMPLES[0]), _tensor_frames(), encode(SAMPLES[4])])]
    frames = _corrupt_one_byte(frames, position, byte)
    try:
        for part in split_batch(frames) or [frames]:
            try:
                decode(part)
            except WireError:
                pass
    except WireError:
        pass
