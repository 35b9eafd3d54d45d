"""A second decoder of the mia_stream wire format, written only from docs/wire-format.md.

It deliberately imports nothing from mia_stream: only msgpack, numpy (to read numbers) and lz4. If it and
``mia_stream.schemas.decode`` ever disagree, either the code or the spec is wrong. Section numbers in the
comments are those of docs/wire-format.md.

``decode(frames)`` returns a ``SpecMessage`` or raises a ``SpecDecodeError`` of one of the outcomes of section 6:
``SpecOversized``, ``SpecVersionError``, ``SpecMalformed``, ``SpecChecksumError`` or ``SpecLost`` (a ring payload
that cannot be read, section 9; its ``reason`` is ``shm_overrun`` or ``shm_unavailable``).
"""

from __future__ import annotations

import mmap
import os
import re
import struct
import zlib
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np

SUPPORTED_MAJOR = 2  # of any minor (2.1: gap_batch)
LEGACY_MAJOR = 1  # readers of recordings also accept it (2.1)
MAX_HEADER_BYTES = 1 << 24
SHM_DIR = "/dev/shm"
RING_NAME = re.compile(r"mia-stream-ring-[1-9][0-9]*-[0-9a-f]{12}")  # section 9
_RING_HEADER = 4096


class SpecDecodeError(Exception):
    outcome = "error"


class SpecMalformed(SpecDecodeError):
    outcome = "malformed"


class SpecOversized(SpecDecodeError):
    outcome = "oversized"


class SpecVersionError(SpecDecodeError):
    outcome = "schema_version"


class SpecChecksumError(SpecDecodeError):
    outcome = "checksum"


class SpecLost(SpecDecodeError):
    """A ring payload that cannot be read: the message is lost, not malformed (section 9)."""

    outcome = "lost"

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


# Section 4.3: wire dtype -> (storage numpy dtype, itemsize).
DTYPES = {
    "float32": ("<f4", 4), "float16": ("<f2", 2), "bfloat16": ("<u2", 2), "float8_e4m3fn": ("u1", 1),
    "float8_e5m2": ("u1", 1), "int8": ("i1", 1), "uint8": ("u1", 1), "int32": ("<i4", 4), "int64": ("<i8", 8),
}
# Section 3.15: analysis value dtypes -> (numpy dtype, itemsize); bool is one byte, 0 or 1.
VALUE_DTYPES = {
    "float32": ("<f4", 4), "float64": ("<f8", 8), "float16": ("<f2", 2), "int8": ("i1", 1), "uint8": ("u1", 1),
    "int32": ("<i4", 4), "int64": ("<i8", 8), "bool": ("u1", 1),
}

# Section 3: kind -> {field: (type, required, default)}. Column defaults depend on R or N: see _COLUMN_DEFAULTS.
_S, _I, _N, _B, _A, _M, _SN, _IN = "str", "int", "int>=0", "bool", "array", "map", "str|nil", "int|nil"
_AI, _AS, _MSI, _COL, _ASN = "array of int", "array of str", "map str->int", "column", "array of str|nil"
_STREAM = {"request_id": (_S, True, None), "producer_id": (_S, True, None), "epoch": (_I, True, None)}
_BATCH = {"producer_id": (_S, True, None), "epoch": (_I, True, None), "request_ids": (_AS, True, None),
          "seqs": (_COL, True, None)}
KINDS: dict[str, dict[str, tuple[str, bool, Any]]] = {
    "start": {**_STREAM, "seq": (_N, False, 0), "engine_request_id": (_S, False, ""), "model": (_S, False, ""),
              "tokenizer": (_S, False, ""), "tp_rank": (_I, False, 0), "tp_size": (_I, False, 1),
              "dp_rank": (_I, False, 0), "num_layers": (_I, False, 0), "hidden_size": (_I, False, 0),
              "num_heads": (_I, False, 0), "num_kv_heads": (_I, False, 0), "head_dim": (_I, False, 0),
              "dtype": (_S, False, ""), "capture": (_M, False, {}), "steering": (_A, False, []),
              "capture_after_steering": (_B, False, True), "prompt_token_ids": (_AI, False, []),
              "tags": (_M, False, {}), "time_ns": (_I, False, 0), "resent": (_B, False, False),
              "control_id": (_S, False, "")},
    "tensors": {**_STREAM, "seq": (_N, True, None), "step": (_I, True, None), "positions": (_AI, False, []),
                "token_ids": (_AI, False, []), "tensors": (_A, False, []), "steering_version": (_I, False, 0),
                "time_ns": (_I, False, 0), "part": (_I, False, 0)},
    "tokens": {**_STREAM, "seq": (_N, True, None), "step": (_I, True, None), "token_ids": (_AI, False, []),
               "positions": (_AI, False, []), "finish_reason": (_SN, False, None), "time_ns": (_I, False, 0)},
    "end": {**_STREAM, "seq": (_N, True, None), "finish_reason": (_S, False, "stop"),
            "num_prompt_tokens": (_I, False, 0), "num_generated_tokens": (_I, False, 0),
            "frames_sent": (_I, False, 0), "frames_dropped": (_I, False, 0), "bytes_sent": (_I, False, 0),
            "drops": (_MSI, False, {}), "uncaptured_positions": (_A, False, []), "error": (_SN, False, None),
            "time_ns": (_I, False, 0)},
    "gap": {**_STREAM, "missing": (_A, False, []), "reason": (_S, False, ""), "origin": (_S, False, ""),
            "time_ns": (_I, False, 0)},
    "heartbeat": {"sender_id": (_S, True, None), "role": (_S, True, None), "instance": (_I, True, None),
                  "time_ns": (_I, False, 0), "stats": (_M, False, {})},
    "steer": {"command_id": (_S, True, None), "request_id": (_S, True, None), "action": (_S, True, None),
              "ops": (_A, False, []), "layers": (_AI, False, []), "sender": (_S, False, ""),
              "time_ns": (_I, False, 0)},
    "steer_ack": {"command_id": (_S, True, None), "request_id": (_S, True, None), "ok": (_B, True, None),
                  "applied_step": (_IN, False, None), "steering_version": (_I, False, 0),
                  "error": (_SN, False, None), "producer_id": (_S, False, ""), "tp_rank": (_I, False, 0),
                  "time_ns": (_I, False, 0)},
    "subscribe": {"patterns": (_AS, False, []), "from_start": (_B, False, False), "consumer_id": (_S, False, ""),
                  "window_bytes": (_N, False, 0), "batch": (_B, False, False), "shm": (_B, False, False),
                  "select": (_M, False, {})},
    "unsubscribe": {"patterns": (_AS, False, [])},
    "credit": {"nbytes": (_N, True, None)},
    "error": {"code": (_S, True, None), "message": (_S, True, None), "request_id": (_SN, False, None),
              "time_ns": (_I, False, 0)},
    "step_batch": {**_BATCH, "step": (_I, True, None), "groups": (_A, False, []),
                   "steering_versions": (_COL, False, None), "time_ns": (_I, False, 0)},
    "token_batch": {**_BATCH, "step": (_I, True, None), "counts": (_COL, False, None),
                    "token_ids": (_COL, False, None), "first_positions": (_COL, False, None),
                    "finish_reasons": (_ASN, False, None), "time_ns": (_I, False, 0)},
    "analysis": {**_BATCH, "analyzer": (_S, True, None), "rows": (_COL, False, None),
                 "positions": (_COL, False, None), "values": (_M, False, {}), "labels": (_M, False, {}),
                 "alerts": (_COL, False, None), "step": (_I, False, -1), "analyzer_version": (_S, False, ""),
                 "time_ns": (_I, False, 0), "source_time_ns": (_I, False, 0)},
    # 3.16 (2.1)
    "gap_batch": {"producer_id": (_S, True, None), "epoch": (_I, True, None), "request_ids": (_AS, True, None),
                  "counts": (_COL, True, None), "firsts": (_COL, True, None), "lasts": (_COL, True, None),
                  "reason": (_S, False, ""), "origin": (_S, False, ""), "time_ns": (_I, False, 0)},
}
COLUMNAR = ("step_batch", "token_batch", "analysis")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)  # section 2: a msgpack bool is not an int


def _type_ok(typ: str, v: Any) -> bool:
    if typ == _S:
        return isinstance(v, str)
    if typ == _I:
        return _is_int(v)
    if typ == _N:
        return _is_int(v) and v >= 0
    if typ == _B:
        return isinstance(v, bool)
    if typ == _A:
        return isinstance(v, list)
    if typ == _M:
        return isinstance(v, dict)
    if typ == _SN:
        return v is None or isinstance(v, str)
    if typ == _IN:
        return v is None or _is_int(v)
    if typ == _AI:
        return isinstance(v, list) and all(_is_int(x) for x in v)
    if typ == _AS:
        return isinstance(v, list) and all(isinstance(x, str) for x in v)
    if typ == _ASN:
        return isinstance(v, list) and all(x is None or isinstance(x, str) for x in v)
    if typ == _MSI:
        return isinstance(v, dict) and all(isinstance(k, str) and _is_int(x) for k, x in v.items())
    if typ == _COL:
        return isinstance(v, bytes)
    raise AssertionError(typ)


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


# ---------------------------------------------------------------------------------------------- results

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

    def rows(self, a: int, b: int) -> "SpecTensor":
        """Rows ``[a, b)`` of dim 1 (one segment of a row group), with a per-row scale's rows too."""
        scale = self.scale
        if scale is not None and scale.shape[1] == self.shape[1] and self.shape[1] != 1:
            scale = scale[:, a:b]
        raw = self.raw[:, a:b]
        return SpecTensor(self.name, self.dtype, raw.shape, raw, self.values[:, a:b], self.layers, self.shard,
                          scale, self.meta)


@dataclass
class SpecGroup:
    part: int
    requests: list
    rows: list
    positions: list
    token_ids: list
    tensors: list  # SpecTensor, holding the segments' rows only (N along dim 1)
    row0: list | None
    stored_rows: int | None


@dataclass
class SpecMessage:
    topic: bytes
    version: tuple
    kind: str
    fields: dict  # every field of the kind (defaults filled in; columns as lists of ints)
    tensors: list  # SpecTensor of a `tensors` message
    groups: list = field(default_factory=list)  # SpecGroup of a `step_batch`
    values: dict = field(default_factory=dict)  # analysis values as numpy arrays (bool as bool)

    def per_request(self) -> list[dict]:
        """Section 10: what each request named in a columnar message gets, in request order (a request with
        segments in two parts gets two entries, part 0 first; one without a segment gets none)."""
        f = self.fields
        ids, seqs = f["request_ids"], f.get("seqs")
        out = []
        if self.kind == "step_batch":
            found = []
            for g in self.groups:
                off = 0
                for j, i in enumerate(g.requests):
                    a, b = off, off + g.rows[j]
                    off = b
                    found.append((i, g.part, {
                        "request_id": ids[i], "seq": seqs[i], "part": g.part, "step": f["step"],
                        "positions": g.positions[a:b], "token_ids": g.token_ids[a:b],
                        "steering_version": f["steering_versions"][i],
                        "tensors": [t.rows(a, b) for t in g.tensors]}))
            found.sort(key=lambda x: (x[0], x[1]))
            return [d for _, _, d in found]
        if self.kind == "token_batch":
            off = 0
            for i, rid in enumerate(ids):
                c = f["counts"][i]
                out.append({"request_id": rid, "seq": seqs[i], "step": f["step"],
                            "token_ids": f["token_ids"][off:off + c],
                            "positions": list(range(f["first_positions"][i], f["first_positions"][i] + c)),
                            "finish_reason": f["finish_reasons"][i]})
                off += c
            return out
        if self.kind == "analysis":
            off = 0
            for i, rid in enumerate(ids):
                a, b = off, off + f["rows"][i]
                off = b
                out.append({"request_id": rid, "seq": seqs[i], "step": f["step"], "analyzer": f["analyzer"],
                            "positions": f["positions"][a:b], "alerts": [x == 1 for x in f["alerts"][a:b]],
                            "values": {k: v[a:b] for k, v in self.values.items()},
                            "labels": {k: v[a:b] for k, v in f["labels"].items()}})
            return out
        if self.kind == "gap_batch":  # 3.16: each request's part is the GapNotice of that request
            off = 0
            for i, rid in enumerate(ids):
                c = f["counts"][i]
                out.append({"request_id": rid, "producer_id": f["producer_id"], "epoch": f["epoch"],
                            "missing": [[a, b] for a, b in zip(f["firsts"][off:off + c], f["lasts"][off:off + c])],
                            "reason": f["reason"], "origin": f["origin"], "time_ns": f["time_ns"]})
                off += c
            return out
        raise ValueError(f"{self.kind} is not a columnar kind")


# ---------------------------------------------------------------------------------------------- section 9

class _Ring:
    """One ring file, mapped read-only (section 9, reading step 1)."""

    def __init__(self, name: str, directory: str):
        path = os.path.join(directory, name)
        try:
            with open(path, "rb") as f:
                total = os.fstat(f.fileno()).st_size
                if total <= _RING_HEADER:
                    raise SpecLost("shm_unavailable", f"{path} is not larger than its header")
                self.mm = mmap.mmap(f.fileno(), total, prot=mmap.PROT_READ)
        except OSError as e:
            raise SpecLost("shm_unavailable", f"cannot open {path}: {e}") from None
        magic, size = struct.unpack_from("<8sQ", self.mm, 0)
        if magic != b"MIASHM01" or size < 1 or total != _RING_HEADER + size:
            self.mm.close()
            raise SpecLost("shm_unavailable", f"{path} is not a ring")
        self.size = size

    def reserved(self) -> int:
        return struct.unpack_from("<Q", self.mm, 16)[0]

    def read(self, pos: int, nbytes: int, rows: tuple | None = None) -> bytes:
        """Steps 2-5 of "Reading"; ``rows = (outer, stored_rows, row_bytes, wanted)`` copies only the wanted
        rows (dim 1) of an uncompressed payload (10.3)."""
        size = self.size
        off = pos % size
        if off + nbytes > size:  # 2
            raise SpecLost("shm_unavailable", f"reference {pos}+{nbytes} crosses the end of a ring of {size}")
        if self.reserved() > pos + size:  # 3
            raise SpecLost("shm_overrun", "overwritten before the copy")
        base = _RING_HEADER + off  # 4
        if rows is None:
            data = self.mm[base:base + nbytes]
        else:
            outer, stored, row_bytes, wanted = rows
            parts = []
            for o in range(outer):
                for r in wanted:
                    a = base + (o * stored + r) * row_bytes
                    parts.append(self.mm[a:a + row_bytes])
            data = b"".join(parts)
        reserved = self.reserved()  # after the copy
        if reserved < pos + nbytes:  # 5
            raise SpecLost("shm_unavailable", "reference past what was written")
        if reserved > pos + size:
            raise SpecLost("shm_overrun", "overwritten during the copy")
        return data

    def close(self) -> None:
        self.mm.close()


def read_ring(name: str, pos: int, nbytes: int, directory: str = SHM_DIR, rows: tuple | None = None) -> bytes:
    """Section 9: ``nbytes`` at position ``pos`` of the ring ``name`` (a name the header check accepted)."""
    ring = _Ring(name, directory)
    try:
        return ring.read(pos, nbytes, rows)
    finally:
        ring.close()


# ---------------------------------------------------------------------------------------------- header checks

def _malformed(what: str) -> SpecMalformed:
    return SpecMalformed(what)


def _unpack(buf: bytes, legacy: bool) -> dict:
    """Steps 2 and 3."""
    try:
        header = msgpack.unpackb(buf, raw=False, strict_map_key=True)  # one object; keys str or bin only
    except Exception as e:
        raise _malformed(f"header is not msgpack: {e}") from None
    if not isinstance(header, dict):
        raise _malformed("header is not a map")
    v = header.get("v")
    if not (isinstance(v, list) and len(v) == 2 and all(_is_int(x) for x in v)):
        raise _malformed(f"bad v {v!r}")
    if v[0] != SUPPORTED_MAJOR and not (legacy and v[0] == LEGACY_MAJOR):
        raise SpecVersionError(f"major {v[0]}")
    return header


def _column(where: str, value: bytes, count: int | None) -> list[int]:
    """Section 10.1: a bin of little-endian int64s, exactly ``count`` of them."""
    if not isinstance(value, bytes) or len(value) % 8 or (count is not None and len(value) != 8 * count):
        raise _malformed(f"{where}: not a column of {count} int64s")
    return np.frombuffer(value, "<i8").tolist()


def _check_fields(kind: str, header: dict) -> dict:
    """Step 4: every field present has its type and range; absent optional fields take their defaults."""
    fields = {}
    for name, (typ, required, default) in KINDS[kind].items():
        if name not in header:
            if required:
                raise _malformed(f"missing {name}")
            fields[name] = default
            continue
        if not _type_ok(typ, header[name]):  # nil is a value (section 2): only |nil types take it
            raise _malformed(f"{kind}.{name} has the wrong type or range: {header[name]!r}")
        fields[name] = header[name]
    ranges = {"gap": "missing", "end": "uncaptured_positions"}.get(kind)  # 3.5, 3.4
    if ranges is not None:
        for r in fields[ranges]:
            if not (isinstance(r, list) and len(r) == 2 and all(_is_int(x) for x in r) and 0 <= r[0] <= r[1]):
                raise _malformed(f"bad {kind}.{ranges} range {r!r}")
    if "shm_ring" in header and not (isinstance(header["shm_ring"], str)
                                     and RING_NAME.fullmatch(header["shm_ring"])):
        raise _malformed(f"bad ring name {header['shm_ring']!r}")  # section 9
    return fields


@dataclass
class _Entry:
    name: str
    dtype: str
    shape: tuple
    layers: list
    raw_nbytes: int
    nbytes: int
    method: str
    crc: int | None
    shard: dict | None
    scale: tuple | None
    meta: dict
    shm: int | None
    buf: int | None = None
    scale_buf: int | None = None
    layer_index: list | None = None  # 2.2: the stored layers kept (10.2)


def _entry(e: Any, has_ring: bool, max_message_bytes: int) -> _Entry:
    """Section 4.1 (with 4.3-4.7): every rule of one tensor entry."""
    if not isinstance(e, dict):
        raise _malformed("a tensor entry is not a map")

    def get(key, check, default=KeyError):
        if key not in e:
            if default is KeyError:
                raise _malformed(f"entry lacks {key}")
            return default
        if not check(e[key]):
            raise _malformed(f"entry field {key} = {e[key]!r}")
        return e[key]

    def ints(v, low=None):
        return isinstance(v, list) and all(_is_int(x) and (low is None or x >= low) for x in v)

    name = get("name", lambda v: isinstance(v, str))
    dtype = get("dtype", lambda v: isinstance(v, str) and v in DTYPES)
    shape = tuple(get("shape", lambda v: ints(v, 0)))
    layers = list(get("layers", ints, []))
    raw_nbytes = get("raw_nbytes", lambda v: _is_int(v) and v >= 0)
    nbytes = get("nbytes", lambda v: _is_int(v) and v >= 0)
    method = get("compression", lambda v: isinstance(v, str) and v in ("none", "lz4"), "none")
    crc = get("crc32", _is_int, None)
    meta = get("meta", lambda v: isinstance(v, dict), {})
    shm = get("shm", lambda v: _is_int(v) and v >= 0, None)
    if shm is not None and not has_ring:
        raise _malformed("an entry with shm in a header without shm_ring")
    if raw_nbytes > max_message_bytes:  # 2.2
        raise SpecOversized("raw_nbytes over the limit")
    if raw_nbytes != int(np.prod(shape, dtype=object)) * DTYPES[dtype][1]:
        raise _malformed("raw_nbytes is not prod(shape) x itemsize")
    if method == "none" and nbytes != raw_nbytes:
        raise _malformed("uncompressed but nbytes != raw_nbytes")
    shard = get("shard", lambda v: isinstance(v, dict), None)
    if shard is not None:  # 4.6
        keys = ("tp_rank", "tp_size", "dim", "start", "stop", "total")
        if not all(_is_int(shard.get(k)) for k in keys):
            raise _malformed(f"shard {shard!r}")
        if not (0 <= shard["tp_rank"] < shard["tp_size"] and 0 <= shard["dim"] < len(shape)
                and 0 <= shard["start"] <= shard["stop"] <= shard["total"]
                and shape[shard["dim"]] == shard["stop"] - shard["start"]):
            raise _malformed(f"inconsistent shard {shard!r} for {shape}")
    scale = get("scale", lambda v: isinstance(v, dict), None)
    if scale is not None:  # 4.7
        if not ints(scale.get("shape"), 0) or scale.get("dtype", "float32") != "float32":
            raise _malformed(f"scale {scale!r}")
        scale = tuple(scale["shape"])
        if len(scale) > len(shape) or any(s not in (1, d) for s, d in zip(reversed(scale), reversed(shape))):
            raise _malformed(f"scale {scale} does not broadcast to {shape}")
    return _Entry(name, dtype, shape, layers, raw_nbytes, nbytes, method, crc, shard, scale, meta, shm)


def _entries(entries: Any, frames: list, i: int, has_ring: bool, max_message_bytes: int,
             stored_rows: int | None = None) -> tuple[list[_Entry], int]:
    """Steps 6 and 7 for one list of entries whose buffer frames start at ``frames[i]``."""
    if not isinstance(entries, list):
        raise _malformed("tensors is not an array")
    out = []
    for e in entries:
        p = _entry(e, has_ring, max_message_bytes)
        if stored_rows is not None:  # 10.2
            if len(p.shape) < 2 or p.shape[1] != stored_rows:
                raise _malformed(f"a group entry of shape {p.shape} lacks the {stored_rows} stored rows")
            if p.scale is not None and len(p.scale) != len(p.shape):
                raise _malformed("a group entry's scale lacks the tensor's dims")
            if p.shard is not None and p.shard["dim"] < 2:
                raise _malformed("a group entry sharded along dim 0 or 1")
            if "layer_index" in e:  # 2.2
                li = _column("layer_index", e["layer_index"], None)
                if any(not 0 <= x < p.shape[0] for x in li) or any(b <= a for a, b in zip(li, li[1:])):
                    raise _malformed("layer_index not ascending within the stored layers")
                if p.layers and len(p.layers) != p.shape[0]:
                    raise _malformed("layer_index with layers not one per stored layer")
                p.layer_index = li
        if p.shm is None:
            if i >= len(frames) or len(frames[i]) != p.nbytes:
                raise _malformed(f"payload frame of {p.name} missing or not {p.nbytes} bytes")
            p.buf, i = i, i + 1
        if p.scale is not None:
            if i >= len(frames) or len(frames[i]) != 4 * int(np.prod(p.scale, dtype=object)):
                raise _malformed(f"scale frame of {p.name} missing or of the wrong length")
            p.scale_buf, i = i, i + 1
        out.append(p)
    return out, i


def _request_columns(kind: str, fields: dict) -> int:
    ids = fields["request_ids"]
    if len(set(ids)) != len(ids):
        raise _malformed("a request named twice")
    fields["seqs"] = _column("seqs", fields["seqs"], len(ids))
    if any(s < 0 for s in fields["seqs"]):
        raise _malformed("negative seq")
    return len(ids)


def _default_column(fields: dict, name: str, count: int, value: int) -> None:
    fields[name] = [value] * count if fields[name] is None else _column(name, fields[name], count)


@dataclass
class _GroupPlan:
    part: int
    requests: list
    rows: list
    positions: list
    token_ids: list
    row0: list | None
    stored_rows: int | None
    entries: list
    wanted: list | None = None  # the stored row of each row (from row0 or row_index)


def _check_step_batch(fields: dict, frames: list, has_ring: bool, max_message_bytes: int) -> list[_GroupPlan]:
    """Sections 3.13, 10.1, 10.2."""
    r = _request_columns("step_batch", fields)
    _default_column(fields, "steering_versions", r, 0)
    plans, seen, i = [], set(), 2
    for g in fields["groups"]:
        if not isinstance(g, dict):
            raise _malformed("a row group is not a map")
        part = g.get("part", 0)
        if not (_is_int(part) and part >= 0):
            raise _malformed(f"group part {part!r}")
        for key in ("requests", "rows", "positions"):
            if key not in g:
                raise _malformed(f"group lacks {key}")
        requests = _column("requests", g["requests"], None)
        rows = _column("rows", g["rows"], len(requests))
        if any(not 0 <= q < r for q in requests) or any(x < 0 for x in rows):
            raise _malformed("group request index or row count out of range")
        for q in requests:
            if (q, part) in seen:
                raise _malformed(f"two segments of request {q} in part {part}")
            seen.add((q, part))
        n = sum(rows)
        positions = _column("positions", g["positions"], n)
        token_ids = _column("token_ids", g["token_ids"], n) if "token_ids" in g else [-1] * n
        row0 = stored = None
        if ("row0" in g or "row_index" in g) != ("stored_rows" in g) or ("row0" in g and "row_index" in g):
            raise _malformed("stored_rows without exactly one of row0 and row_index, or the reverse")
        if "row_index" in g:  # 2.2
            stored = g["stored_rows"]
            if not (_is_int(stored) and stored >= 0):
                raise _malformed(f"stored_rows {stored!r}")
            row0 = None
            row_index = _column("row_index", g["row_index"], n)
            if any(not 0 <= x < stored for x in row_index):
                raise _malformed("row_index past stored_rows")
            wanted_rows = row_index
        else:
            wanted_rows = None
        if "row0" in g:
            row0 = _column("row0", g["row0"], len(requests))
            stored = g["stored_rows"]
            if not (_is_int(stored) and stored >= 0):
                raise _malformed(f"stored_rows {stored!r}")
            if any(a < 0 or a + c > stored for a, c in zip(row0, rows)):
                raise _malformed("row0 + rows past stored_rows")
            wanted_rows = [a + k for a, c in zip(row0, rows) for k in range(c)]
        entries, i = _entries(g.get("tensors", []), frames, i, has_ring, max_message_bytes,
                              n if stored is None else stored)
        plans.append(_GroupPlan(part, requests, rows, positions, token_ids, row0, stored, entries, wanted_rows))
    if i != len(frames):
        raise _malformed("undescribed buffer frames")
    return plans


def _check_token_batch(fields: dict) -> None:
    """Sections 3.14, 10.1."""
    r = _request_columns("token_batch", fields)
    _default_column(fields, "counts", r, 1)
    if any(c < 0 for c in fields["counts"]):
        raise _malformed("negative count")
    if fields["token_ids"] is None:
        if r:
            raise _malformed("token_batch without token_ids")
        fields["token_ids"] = []
    else:
        fields["token_ids"] = _column("token_ids", fields["token_ids"], sum(fields["counts"]))
    _default_column(fields, "first_positions", r, 0)
    if fields["finish_reasons"] is None:
        fields["finish_reasons"] = [None] * r
    elif len(fields["finish_reasons"]) != r:
        raise _malformed("finish_reasons is not R long")


def _check_analysis(fields: dict) -> dict:
    """Sections 3.15, 10.1; the values as numpy arrays."""
    r = _request_columns("analysis", fields)
    _default_column(fields, "rows", r, 1)
    if any(x < 0 for x in fields["rows"]):
        raise _malformed("negative rows")
    n = sum(fields["rows"])
    _default_column(fields, "positions", n, -1)
    _default_column(fields, "alerts", n, 0)
    if any(a not in (0, 1) for a in fields["alerts"]):
        raise _malformed("an alert is not 0 or 1")
    values = {}
    for name, v in fields["values"].items():
        if not isinstance(name, str) or not isinstance(v, dict):
            raise _malformed(f"value {name!r}")
        dtype, shape, data = v.get("dtype"), v.get("shape"), v.get("data")
        if not (isinstance(dtype, str) and dtype in VALUE_DTYPES):
            raise _malformed(f"value dtype {dtype!r}")
        if not (isinstance(shape, list) and shape and all(_is_int(d) and d >= 0 for d in shape) and shape[0] == n):
            raise _malformed(f"value shape {shape!r}, needs [{n}, ...]")
        np_dtype, itemsize = VALUE_DTYPES[dtype]
        if not (isinstance(data, bytes) and len(data) == int(np.prod(shape, dtype=object)) * itemsize):
            raise _malformed(f"value data of {name!r}")
        arr = np.frombuffer(data, np_dtype).reshape(shape)
        if dtype == "bool":
            if arr.size and arr.max() > 1:
                raise _malformed("a bool byte other than 0 or 1")
            arr = arr == 1
        values[name] = arr
    for name, v in fields["labels"].items():
        if not (isinstance(name, str) and isinstance(v, list) and len(v) == n
                and all(x is None or isinstance(x, str) for x in v)):
            raise _malformed(f"label {name!r}")
    return values


def _check_gap_batch(fields: dict) -> None:
    """Sections 3.16, 10.6."""
    ids = fields["request_ids"]
    if len(set(ids)) != len(ids):
        raise _malformed("a request named twice")
    fields["counts"] = _column("counts", fields["counts"], len(ids))
    if any(c < 0 for c in fields["counts"]):
        raise _malformed("negative count")
    n = sum(fields["counts"])
    fields["firsts"] = _column("firsts", fields["firsts"], n)
    fields["lasts"] = _column("lasts", fields["lasts"], n)
    if any(not 0 <= a <= b for a, b in zip(fields["firsts"], fields["lasts"])):
        raise _malformed("a range without 0 <= first <= last")


# ---------------------------------------------------------------------------------------------- payloads

def _decompress(payload: bytes, raw_nbytes: int) -> bytes:
    """Section 4.4: exactly one complete LZ4 frame giving exactly raw_nbytes bytes."""
    import lz4.frame

    if payload[:4] != b"\x04\x22\x4d\x18":
        raise _malformed("not an LZ4 frame")
    d = lz4.frame.LZ4FrameDecompressor()
    try:
        out = d.decompress(payload, max_length=raw_nbytes + 1)
    except RuntimeError as e:
        raise _malformed(f"lz4: {e}") from None
    if len(out) != raw_nbytes or not d.eof or d.unused_data:
        raise _malformed("lz4 payload is not one frame of raw_nbytes bytes")
    return out


def _tensor(p: _Entry, frames: list, ring_name: str | None, directory: str, verify: bool,
            take: tuple | None) -> SpecTensor:
    """Step 8 for one entry; ``take = (stored_rows, wanted rows)`` for a group with row0 (10.3)."""
    _, itemsize = DTYPES[p.dtype]
    shape, gathered = p.shape, False
    if p.shm is not None:
        rows = None
        if take is not None and p.method == "none" and p.layer_index is None:  # 10.3: just the wanted rows
            row_bytes = itemsize * int(np.prod(shape[2:], dtype=object))
            rows = (shape[0], take[0], row_bytes, take[1])
            gathered = True
        payload = read_ring(ring_name, p.shm, p.nbytes, directory, rows)
    else:
        payload = frames[p.buf]
    if not gathered:
        if p.method == "lz4":
            payload = _decompress(payload, p.raw_nbytes)
        if verify and p.crc is not None and (zlib.crc32(payload) & 0xFFFFFFFF) != p.crc:
            raise SpecChecksumError("crc32 mismatch")
    storage = DTYPES[p.dtype][0]
    scale = None
    if p.scale is not None:
        scale = np.frombuffer(frames[p.scale_buf], dtype="<f4").reshape(p.scale)
    if p.layer_index is not None:  # 2.2: the kept stored layers (dim 0), and their scale
        raw = np.frombuffer(payload, dtype=storage).reshape(p.shape)[p.layer_index]
        payload, shape = raw.tobytes(), (len(p.layer_index), *shape[1:])
        if scale is not None and scale.shape[0] == p.shape[0] and p.shape[0] != 1:
            scale = scale[p.layer_index]
    if take is not None:
        stored, wanted = take
        shape = (shape[0], len(wanted), *shape[2:])
        if not gathered:
            raw = np.frombuffer(payload, dtype=storage).reshape(shape[0], stored, *shape[2:])[:, wanted]
            payload = raw.tobytes()
        if scale is not None and scale.shape[1] == stored and stored != 1:
            scale = scale[:, wanted]
    raw = np.frombuffer(payload, dtype=storage).reshape(shape)
    if p.dtype == "bfloat16":
        values = bf16_to_f32(raw)
    elif p.dtype == "float8_e4m3fn":
        values = FP8_E4M3FN[raw]
    elif p.dtype == "float8_e5m2":
        values = FP8_E5M2[raw]
    else:
        values = raw
    layers = [p.layers[i] for i in p.layer_index] if p.layer_index is not None and p.layers else p.layers
    return SpecTensor(p.name, p.dtype, shape, raw, values, layers, p.shard, scale, dict(p.meta))


# ---------------------------------------------------------------------------------------------- section 6

def decode(frames: list, max_message_bytes: int = 1 << 30, *, legacy: bool = False, verify: bool = True,
           directory: str = SHM_DIR) -> SpecMessage:
    """Section 6, step by step: every header rule and frame size first (1-7), then the payloads (8)."""
    frames = [bytes(f) for f in frames]
    if len(frames) < 2:  # 1
        raise _malformed("fewer than 2 frames")
    if sum(len(f) for f in frames) > max_message_bytes or len(frames[1]) > MAX_HEADER_BYTES:
        raise SpecOversized("oversized")
    header = _unpack(frames[1], legacy)  # 2, 3
    kind = header.get("kind")  # 4
    if not isinstance(kind, str) or kind not in KINDS:
        raise _malformed(f"unknown kind {kind!r}")
    fields = _check_fields(kind, header)
    has_ring = "shm_ring" in header
    ring_name = header.get("shm_ring")
    version = tuple(header["v"])
    if kind == "step_batch":  # 5-7
        plans = _check_step_batch(fields, frames, has_ring, max_message_bytes)
        groups = []
        for g in plans:  # 8
            take = (g.stored_rows, g.wanted) if g.wanted is not None else None
            tensors = [_tensor(p, frames, ring_name, directory, verify, take) for p in g.entries]
            groups.append(SpecGroup(g.part, g.requests, g.rows, g.positions, g.token_ids, tensors, g.row0,
                                    g.stored_rows))
        return SpecMessage(frames[0], version, kind, fields, [], groups)
    if kind == "gap_batch":
        _check_gap_batch(fields)
        if len(frames) != 2:
            raise _malformed("buffers on a message without tensors")
        return SpecMessage(frames[0], version, kind, fields, [])
    if kind in ("token_batch", "analysis"):
        values = _check_token_batch(fields) if kind == "token_batch" else _check_analysis(fields)
        if len(frames) != 2:
            raise _malformed("buffers on a message without tensors")
        return SpecMessage(frames[0], version, kind, fields, [], [], values or {})
    if kind != "tensors":
        if len(frames) != 2:
            raise _malformed("buffers on a message without tensors")
        return SpecMessage(frames[0], version, kind, fields, [])
    entries, i = _entries(fields["tensors"], frames, 2, has_ring, max_message_bytes)  # 6, 7
    if i != len(frames):
        raise _malformed("undescribed buffers")
    tensors = [_tensor(p, frames, ring_name, directory, verify, None) for p in entries]  # 8
    return SpecMessage(frames[0], version, kind, fields, tensors)


def split_batch(frames: list) -> list[list[bytes]] | None:
    """Section 8: the messages of a batch, or None when ``frames`` is a single message."""
    frames = [bytes(f) for f in frames]
    if len(frames) < 3 or frames[0] != b"":
        return None
    try:
        header = _unpack(frames[1], legacy=False)
    except SpecDecodeError:
        return None  # not a header of this major: decoded as one message (it then fails there)
    if header.get("kind") != "batch":
        return None
    counts = header.get("frames")
    if not isinstance(counts, list) or not 1 <= len(counts) <= 4096:
        raise _malformed("batch.frames must list 1 to 4096 counts")
    if not all(_is_int(c) and c >= 2 for c in counts):
        raise _malformed("a frame count below 2")
    if sum(counts) != len(frames) - 2:
        raise _malformed("frame counts do not add up")
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
