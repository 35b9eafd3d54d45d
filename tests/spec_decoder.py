"""A second decoder of the mia_stream wire format, written only from docs/wire-format.md.

It deliberately imports nothing from mia_stream: only msgpack, numpy (to read numbers) and lz4. If it and
``mia_stream.schemas.decode`` ever disagree, either the code or the spec is wrong.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np

SUPPORTED_MAJOR = 1
MAX_HEADER_BYTES = 1 << 24


class SpecDecodeError(Exception):
    pass


# Section 4.3: wire dtype -> (storage numpy dtype, itemsize).
DTYPES = {
    "float32": ("<f4", 4), "float16": ("<f2", 2), "bfloat16": ("<u2", 2), "float8_e4m3fn": ("u1", 1),
    "float8_e5m2": ("u1", 1), "int8": ("i1", 1), "uint8": ("u1", 1), "int32": ("<i4", 4), "int64": ("<i8", 8),
}

# Section 3: kind -> {field: (type, required, default)}.
_S, _I, _B, _A, _M, _SN, _IN = "str", "int", "bool", "array", "map", "str|nil", "int|nil"
_STREAM = {"request_id": (_S, True, None), "producer_id": (_S, True, None), "epoch": (_I, True, None)}
KINDS: dict[str, dict[str, tuple[str, bool, Any]]] = {
    "start": {**_STREAM, "seq": (_I, False, 0), "engine_request_id": (_S, False, ""), "model": (_S, False, ""),
              "tokenizer": (_S, False, ""), "tp_rank": (_I, False, 0), "tp_size": (_I, False, 1),
              "dp_rank": (_I, False, 0), "num_layers": (_I, False, 0), "hidden_size": (_I, False, 0),
              "num_heads": (_I, False, 0), "num_kv_heads": (_I, False, 0), "head_dim": (_I, False, 0),
              "dtype": (_S, False, ""), "capture": (_M, False, {}), "steering": (_A, False, []),
              "capture_after_steering": (_B, False, True), "prompt_token_ids": (_A, False, []),
              "tags": (_M, False, {}), "time_ns": (_I, False, 0), "resent": (_B, False, False),
              "control_id": (_S, False, "")},
    "tensors": {**_STREAM, "seq": (_I, True, None), "step": (_I, True, None), "positions": (_A, False, []),
                "token_ids": (_A, False, []), "tensors": (_A, False, []), "steering_version": (_I, False, 0),
                "time_ns": (_I, False, 0), "part": (_I, False, 0)},
    "tokens": {**_STREAM, "seq": (_I, True, None), "step": (_I, True, None), "token_ids": (_A, False, []),
               "positions": (_A, False, []), "finish_reason": (_SN, False, None), "time_ns": (_I, False, 0)},
    "end": {**_STREAM, "seq": (_I, True, None), "finish_reason": (_S, False, "stop"),
            "num_prompt_tokens": (_I, False, 0), "num_generated_tokens": (_I, False, 0),
            "frames_sent": (_I, False, 0), "frames_dropped": (_I, False, 0), "bytes_sent": (_I, False, 0),
            "drops": (_M, False, {}), "uncaptured_positions": (_A, False, []), "error": (_SN, False, None),
            "time_ns": (_I, False, 0)},
    "gap": {**_STREAM, "missing": (_A, False, []), "reason": (_S, False, ""), "origin": (_S, False, ""),
            "time_ns": (_I, False, 0)},
    "heartbeat": {"sender_id": (_S, True, None), "role": (_S, True, None), "instance": (_I, True, None),
                  "time_ns": (_I, False, 0), "stats": (_M, False, {})},
    "steer": {"command_id": (_S, True, None), "request_id": (_S, True, None), "action": (_S, True, None),
              "ops": (_A, False, []), "layers": (_A, False, []), "sender": (_S, False, ""),
              "time_ns": (_I, False, 0)},
    "steer_ack": {"command_id": (_S, True, None), "request_id": (_S, True, None), "ok": (_B, True, None),
                  "applied_step": (_IN, False, None), "steering_version": (_I, False, 0),
                  "error": (_SN, False, None), "producer_id": (_S, False, ""), "tp_rank": (_I, False, 0),
                  "time_ns": (_I, False, 0)},
    "subscribe": {"patterns": (_A, False, []), "from_start": (_B, False, False), "consumer_id": (_S, False, ""),
                  "window_bytes": (_I, False, 0), "batch": (_B, False, False), "shm": (_B, False, False)},
    "unsubscribe": {"patterns": (_A, False, [])},
    "credit": {"nbytes": (_I, True, None)},
    "error": {"code": (_S, True, None), "message": (_S, True, None), "request_id": (_SN, False, None),
              "time_ns": (_I, False, 0)},
}


@dataclass
class SpecTensor:
    name: str
    dtype: str
    shape: tuple
    raw: np.ndarray  # the stored elements (bf16 as uint16, fp8 as uint8)
    values: np.ndarray  # float32 for bf16/fp8, native otherwise
    layers: list
    shard: dict | None
    scale: np.ndarray | None
    meta: dict = field(default_factory=dict)

    def dequantized(self) -> np.ndarray:
        v = self.values.astype(np.float32)
        return v if self.scale is None else v * self.scale


@dataclass
class SpecMessage:
    topic: bytes
    version: tuple
    kind: str
    fields: dict
    tensors: list


def _type_ok(kind: str, v: Any) -> bool:
    return {
        _S: lambda: isinstance(v, str),
        _I: lambda: isinstance(v, int) and not isinstance(v, bool),
        _B: lambda: isinstance(v, bool),
        _A: lambda: isinstance(v, list),
        _M: lambda: isinstance(v, dict),
        _SN: lambda: v is None or isinstance(v, str),
        _IN: lambda: v is None or (isinstance(v, int) and not isinstance(v, bool)),
    }[kind]()


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    """Section 4.3: the float32 whose bits are u16 << 16."""
    return (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)


def _fp8_table(exp_bits: int, man_bits: int, bias: int, has_inf: bool) -> np.ndarray:
    out = np.empty(256, dtype=np.float32)
    for b in range(256):
        s = -1.0 if b & 0x80 else 1.0
        e = (b >> man_bits) & ((1 << exp_bits) - 1)
        m = b & ((1 << man_bits) - 1)
        e_max = (1 << exp_bits) - 1
        if has_inf and e == e_max:
            out[b] = s * np.inf if m == 0 else np.nan
        elif not has_inf and e == e_max and m == (1 << man_bits) - 1:
            out[b] = np.nan
        elif e == 0:
            out[b] = s * 2.0 ** (1 - bias) * (m / (1 << man_bits))
        else:
            out[b] = s * 2.0 ** (e - bias) * (1 + m / (1 << man_bits))
    return out


FP8_E4M3FN = _fp8_table(4, 3, 7, has_inf=False)
FP8_E5M2 = _fp8_table(5, 2, 15, has_inf=True)


def read_ring(name: Any, pos: Any, nbytes: int, directory: str = "/dev/shm") -> bytes:
    """Section 9: ``nbytes`` at position ``pos`` of the ring file ``name``."""
    import mmap
    import os
    import re
    import struct

    if not isinstance(name, str) or not re.fullmatch(r"mia-stream-ring-\d+-[0-9a-f]{12}", name):
        raise SpecDecodeError(f"bad ring name {name!r}")
    if not isinstance(pos, int) or isinstance(pos, bool) or pos < 0:
        raise SpecDecodeError("bad shm position")
    with open(os.path.join(directory, name), "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
    try:
        magic, size, _reserved = struct.unpack_from("<8sQQ", mm, 0)
        if magic != b"MIASHM01" or len(mm) != 4096 + size:
            raise SpecDecodeError("not a ring")
        off = pos % size
        if off + nbytes > size:
            raise SpecDecodeError("reference crosses the ring's end")
        data = mm[4096 + off:4096 + off + nbytes]
        (reserved,) = struct.unpack_from("<Q", mm, 16)  # after the copy
    finally:
        mm.close()
    if reserved < pos + nbytes:
        raise SpecDecodeError("reference past what was written")
    if reserved > pos + size:
        raise SpecDecodeError("shm_overrun")
    return data


def decode(frames: list, max_message_bytes: int = 1 << 30) -> SpecMessage:
    """Section 6, step by step."""
    frames = [bytes(f) for f in frames]
    if len(frames) < 2:  # 1
        raise SpecDecodeError("fewer than 2 frames")
    if sum(len(f) for f in frames) > max_message_bytes or len(frames[1]) > MAX_HEADER_BYTES:
        raise SpecDecodeError("oversized")
    header = msgpack.unpackb(frames[1], raw=False)  # 2
    if not isinstance(header, dict):
        raise SpecDecodeError("header is not a map")
    v = header.get("v")  # 3
    if not (isinstance(v, list) and len(v) == 2 and all(isinstance(x, int) for x in v)):
        raise SpecDecodeError("bad v")
    if v[0] != SUPPORTED_MAJOR:
        raise SpecDecodeError(f"major {v[0]}")
    kind = header.get("kind")  # 4
    if kind not in KINDS:
        raise SpecDecodeError(f"unknown kind {kind!r}")
    fields = {}
    for name, (typ, required, default) in KINDS[kind].items():
        if name not in header:
            if required:
                raise SpecDecodeError(f"missing {name}")
            fields[name] = default
            continue
        if not _type_ok(typ, header[name]):
            raise SpecDecodeError(f"{name} has wrong type")
        fields[name] = header[name]
    if kind != "tensors":  # 5
        if len(frames) != 2:
            raise SpecDecodeError("buffers on a non-tensor message")
        return SpecMessage(frames[0], tuple(v), kind, fields, [])
    tensors, i = [], 2  # 6
    for e in fields["tensors"]:
        dtype, method = e["dtype"], e.get("compression", "none")
        if dtype not in DTYPES or method not in ("none", "lz4"):  # a
            raise SpecDecodeError("bad dtype or compression")
        if "shm" in e:  # b (section 9)
            payload = read_ring(header.get("shm_ring"), e["shm"], e["nbytes"])
        else:
            if i >= len(frames):
                raise SpecDecodeError("missing payload")
            payload = frames[i]
            i += 1
        if len(payload) != e["nbytes"]:
            raise SpecDecodeError("payload length != nbytes")
        if method == "lz4":  # c
            if payload[:4] != b"\x04\x22\x4d\x18":
                raise SpecDecodeError("not an LZ4 frame")
            import lz4.frame

            payload = lz4.frame.decompress(payload)
        if len(payload) != e["raw_nbytes"]:
            raise SpecDecodeError("raw length != raw_nbytes")
        if "crc32" in e and (zlib.crc32(payload) & 0xFFFFFFFF) != e["crc32"]:  # d
            raise SpecDecodeError("crc32 mismatch")
        storage, itemsize = DTYPES[dtype]
        shape = tuple(e["shape"])
        if len(payload) != int(np.prod(shape, dtype=np.int64)) * itemsize:  # e
            raise SpecDecodeError("size does not match shape")
        raw = np.frombuffer(payload, dtype=storage).reshape(shape)  # f
        if dtype == "bfloat16":
            values = bf16_to_f32(raw)
        elif dtype == "float8_e4m3fn":
            values = FP8_E4M3FN[raw]
        elif dtype == "float8_e5m2":
            values = FP8_E5M2[raw]
        else:
            values = raw
        scale = None
        if "scale" in e:  # g
            if i >= len(frames):
                raise SpecDecodeError("missing scale")
            scale = np.frombuffer(frames[i], dtype="<f4").reshape(tuple(e["scale"]["shape"]))
            i += 1
        tensors.append(SpecTensor(e["name"], dtype, shape, raw, values, list(e.get("layers", [])),
                                  e.get("shard"), scale, dict(e.get("meta", {}))))  # h
    if i != len(frames):  # 7
        raise SpecDecodeError("undescribed buffers")
    return SpecMessage(frames[0], tuple(v), kind, fields, tensors)


def split_batch(frames: list) -> list[list[bytes]] | None:
    """Section 8: the messages of a batch, or None when ``frames`` is a single message."""
    frames = [bytes(f) for f in frames]
    if len(frames) < 2 or frames[0] != b"":  # a batch's topic is empty
        return None
    try:
        header = msgpack.unpackb(frames[1], raw=False)
    except Exception:
        return None
    if not isinstance(header, dict) or header.get("kind") != "batch":
        return None
    v = header.get("v")
    if not (isinstance(v, list) and len(v) == 2 and all(isinstance(x, int) for x in v)) or v[0] != SUPPORTED_MAJOR:
        raise SpecDecodeError("bad batch version")
    counts = header.get("frames")
    if not isinstance(counts, list) or not counts or len(counts) > 4096:
        raise SpecDecodeError("batch.frames must list 1 to 4096 counts")
    if not all(isinstance(c, int) and not isinstance(c, bool) and c >= 2 for c in counts):
        raise SpecDecodeError("a frame count below 2")
    if sum(counts) != len(frames) - 2:
        raise SpecDecodeError("frame counts do not add up")
    out, i = [], 2
    for c in counts:
        out.append(frames[i:i + c])
        i += c
    return out


def decode_recorded(data: bytes) -> list[bytes]:
    """Section 7: the ``mia_stream/multipart`` MCAP message encoding back to frames."""
    (n,) = np.frombuffer(data[:4], dtype="<u4")
    lengths = np.frombuffer(data[4:4 + 4 * int(n)], dtype="<u4")
    off, frames = 4 + 4 * int(n), []
    for ln in lengths:
        frames.append(data[off:off + int(ln)])
        off += int(ln)
    if off != len(data):
        raise SpecDecodeError("recorded message length mismatch")
    return frames
