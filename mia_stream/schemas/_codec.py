"""Encode typed messages to ZeroMQ multipart frames and back: ``[topic, msgpack header, *tensor buffers]``.

One validator serves every receiver: ``decode_header`` (the broker's, which never touches tensor bytes) and
``decode`` check the same header rules with the same functions (``_check_fields``, ``_parse_entry``,
``_check_columnar``), so the broker never forwards a header that a consumer would then refuse.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Sequence

import msgpack
import numpy as np

from mia_stream.errors import (MalformedFrameError, OversizedMessageError, SchemaVersionError, ShmOverrunError,
                               ShmUnavailableError, WireError)
from mia_stream.schemas._batches import (BATCH_MESSAGE_TYPES, VALUE_WIRE_DTYPES, AnalysisBatch, GapBatch, RowGroup,
                                         StepBatch, TokenBatch)
from mia_stream.schemas._messages import MESSAGE_TYPES, SCHEMA_VERSION, GapNotice, Message, TensorFrame
from mia_stream.schemas import seqranges
from mia_stream.schemas._oob import BufferSink, BufferSource, is_ring_name
from mia_stream.schemas._tensors import (COMPRESSIONS, WIRE_DTYPES, Shard, Tensor, byte_view, compress, crc32,
                                        decompress, verify_crc32)

DEFAULT_MAX_MESSAGE_BYTES = 1 << 30  # 1 GiB: larger messages are refused (broker sets zmq MAXMSGSIZE too)
_MAX_HEADER_BYTES = 16 << 20
SHM_RING_KEY = "shm_ring"  # header field: the ring that holds the buffers of entries with a "shm" position
_SHM_MARK = msgpack.packb(SHM_RING_KEY)  # how the key looks inside a packed header
LEGACY_MAJOR = 1  # recordings of schema 1.x stay readable: every 1.x kind is a 2.0 kind with the same fields

COLUMNAR_KINDS = frozenset(cls.KIND for cls in BATCH_MESSAGE_TYPES)  # name many requests, one seq of each
# every kind that names many requests (routed, recorded and narrowed by request_ids): the columnar kinds and
# gap_batch, which has no seqs
MULTI_REQUEST_KINDS = COLUMNAR_KINDS | {GapBatch.KIND}
_I64 = np.dtype("<i8")

_FIELDS = {kind: {f.name: f for f in dataclasses.fields(cls)} for kind, cls in MESSAGE_TYPES.items()}
_REQUIRED = {
    kind: [f.name for f in fields.values()
           if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    for kind, fields in _FIELDS.items()
}


def _buffer_of(frame: Any) -> Any:
    """bytes, memoryview or zmq.Frame -> a bytes-like without copying."""
    buf = getattr(frame, "buffer", None)
    return buf if buf is not None else frame


def _len(buf: Any) -> int:
    """``len(memoryview(buf))`` without building a memoryview for bytes and memoryviews (the hot path)."""
    t = type(buf)
    return len(buf) if t is bytes or t is memoryview else len(memoryview(buf))


try:  # len() of these is their size in bytes, as len(memoryview(frame.buffer)) is
    from zmq import Frame as _ZmqFrame
    _SIZED = frozenset((bytes, memoryview, _ZmqFrame))
except ImportError:  # pragma: no cover - pyzmq is a dependency
    _SIZED = frozenset((bytes, memoryview))


def _frame_sizes(frames: Sequence[Any]) -> list[int]:
    return [len(f) if type(f) in _SIZED else _len(_buffer_of(f)) for f in frames]


# ---------------------------------------------------------------------------------------------- encode

def encode(msg: Message, *, compression: str = "none", checksum: bool = False,
           shm: BufferSink | None = None) -> list[Any]:
    """Frames for ``socket.send_multipart(frames, copy=False)``: tensor buffers are not copied.

    ``compression`` ("none" | "lz4") and ``checksum`` (crc32 of the raw bytes) apply to every tensor
    whose ``meta`` does not override them. ``shm``: tensor buffers the ring takes (large ones) are copied
    into it and referenced from the header instead of sent (spec section 9).
    """
    header: dict[str, Any] = {"v": list(SCHEMA_VERSION), "kind": msg.KIND}
    buffers: list[Any] = []
    if msg.KIND in COLUMNAR_KINDS:
        _encode_columnar(msg, header, buffers, compression, checksum, shm)
    elif msg.KIND == GapBatch.KIND:
        header.update(producer_id=msg.producer_id, epoch=msg.epoch, request_ids=list(msg.request_ids),
                      counts=_col(msg.counts), firsts=_col(msg.firsts), lasts=_col(msg.lasts), reason=msg.reason,
                      origin=msg.origin, time_ns=msg.time_ns)
    else:
        for name in _FIELDS[msg.KIND]:
            value = getattr(msg, name)
            if name == "tensors":
                value = [_encode_tensor(t, compression, checksum, buffers, shm) for t in value]
                if shm is not None and any("shm" in e for e in value):
                    header[SHM_RING_KEY] = shm.name
            header[name] = value
    try:
        packed = msgpack.packb(header, use_bin_type=True)
    except (TypeError, ValueError) as e:
        raise MalformedFrameError(f"{msg.KIND} header is not msgpack-encodable: {e}") from None
    return [msg.topic(), packed, *buffers]


def _encode_tensor(t: Tensor, compression: str, checksum: bool, buffers: list, shm: BufferSink | None) -> dict:
    method = t.meta.get("compression", compression)
    raw = t.buffer()
    entry: dict[str, Any] = {"name": t.name, "dtype": t.dtype, "shape": list(t.shape),
                             "layers": list(t.layers), "raw_nbytes": t.nbytes}
    if t.meta.get("checksum", checksum):
        entry["crc32"] = crc32(raw)
    payload = compress(raw, method)
    entry["compression"] = method
    entry["nbytes"] = len(payload)
    if t.shard is not None:
        entry["shard"] = t.shard.to_wire()
    pos = shm.put(payload) if shm is not None else None
    if pos is None:
        buffers.append(payload)
    else:
        entry["shm"] = pos
    if t.scale is not None:
        entry["scale"] = {"dtype": "float32", "shape": list(t.scale.shape)}
        buffers.append(byte_view(np.ascontiguousarray(t.scale, dtype="<f4")))
    extra = {k: v for k, v in t.meta.items() if k not in ("compression", "checksum")}
    if extra:
        entry["meta"] = extra
    return entry


def _col(values: Any) -> bytes:
    """A numeric column on the wire: little-endian int64, as msgpack bin."""
    return np.ascontiguousarray(values, dtype=_I64).tobytes()


def _encode_columnar(msg: Message, header: dict, buffers: list, compression: str, checksum: bool,
                     shm: BufferSink | None) -> None:
    header.update(producer_id=msg.producer_id, epoch=msg.epoch, request_ids=list(msg.request_ids),
                  seqs=_col(msg.seqs), time_ns=msg.time_ns)
    if isinstance(msg, StepBatch):
        header["step"] = msg.step
        header["steering_versions"] = _col(msg.steering_versions)
        groups = []
        for g in msg.groups:
            entries = [_encode_tensor(t, compression, checksum, buffers, shm) for t in g.tensors]
            groups.append({"part": g.part, "requests": _col(g.requests), "rows": _col(g.rows),
                           "positions": _col(g.positions), "token_ids": _col(g.token_ids), "tensors": entries})
            if shm is not None and any("shm" in e for e in entries):
                header[SHM_RING_KEY] = shm.name
        header["groups"] = groups
    elif isinstance(msg, TokenBatch):
        header.update(step=msg.step, counts=_col(msg.counts), token_ids=_col(msg.token_ids),
                      first_positions=_col(msg.first_positions), finish_reasons=list(msg.finish_reasons))
    elif isinstance(msg, AnalysisBatch):
        header.update(analyzer=msg.analyzer, analyzer_version=msg.analyzer_version, step=msg.step,
                      rows=_col(msg.rows), positions=_col(msg.positions), alerts=_col(msg.alerts),
                      source_time_ns=msg.source_time_ns,
                      values={k: _encode_value(k, v) for k, v in msg.values.items()},
                      labels={k: list(v) for k, v in msg.labels.items()})


def _encode_value(name: str, v: np.ndarray) -> dict:
    dtype = "bool" if v.dtype == np.bool_ else str(v.dtype)
    if dtype not in VALUE_WIRE_DTYPES:
        raise MalformedFrameError(f"analysis value {name!r}: dtype {v.dtype} has no wire encoding")
    data = np.ascontiguousarray(v, dtype=VALUE_WIRE_DTYPES[dtype][0])
    return {"dtype": dtype, "shape": list(v.shape), "data": data.tobytes()}


# ---------------------------------------------------------------------------------------------- header checks

def _unpack_header(buf: Any, nbytes: int, legacy: bool = False) -> dict:
    """The header map of a message, with its size, msgpack form and major version checked; ``legacy``: a
    1.x header is accepted too (recordings)."""
    if nbytes > _MAX_HEADER_BYTES:
        raise OversizedMessageError(f"header of {nbytes} bytes exceeds {_MAX_HEADER_BYTES}")
    try:
        header = msgpack.unpackb(buf, raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises many types (ExtraData, FormatError, ValueError, ...)
        raise MalformedFrameError(f"header is not valid msgpack: {type(e).__name__}: {e}") from None
    if not isinstance(header, dict):
        raise MalformedFrameError(f"header must be a msgpack map, got {type(header).__name__}")
    version = header.get("v")
    if (type(version) is not list or len(version) != 2
            or type(version[0]) is not int or type(version[1]) is not int):
        raise MalformedFrameError(f"header field 'v' must be [major, minor] ints, got {version!r}")
    if version[0] != SCHEMA_VERSION[0] and not (legacy and version[0] == LEGACY_MAJOR):
        raise SchemaVersionError(
            f"schema major version {version[0]} is not supported by this decoder "
            f"(it speaks {SCHEMA_VERSION[0]}.x"
            f"{'' if not legacy else f' and reads {LEGACY_MAJOR}.x recordings'}); upgrade mia_stream on the "
            "older side")
    return header


def _is_int(v: Any) -> bool:
    return type(v) is int or (isinstance(v, int) and not isinstance(v, bool))


_TYPE_CHECKS = {
    "str": lambda v: isinstance(v, str),
    "int": _is_int,
    "bool": lambda v: isinstance(v, bool),
    "list": lambda v: isinstance(v, list),
    "dict": lambda v: isinstance(v, dict),
    "str | None": lambda v: v is None or isinstance(v, str),
    "int | None": lambda v: v is None or _is_int(v),
}
# The exact types msgpack gives for each annotation: one set lookup per field in the common case.
_EXACT_TYPES = {"str": {str}, "int": {int}, "bool": {bool}, "list": {list}, "dict": {dict},
                "str | None": {str, type(None)}, "int | None": {int, type(None)}}
# Arrays whose elements the spec types (kind, field) -> element type; the other arrays and maps are free-form.
_ELEMENTS = {("start", "prompt_token_ids"): int, ("tensors", "positions"): int, ("tensors", "token_ids"): int,
             ("tokens", "token_ids"): int, ("tokens", "positions"): int,
             ("steer", "layers"): int, ("subscribe", "patterns"): str, ("unsubscribe", "patterns"): str}
# Columnar kinds: their numeric columns are int64 bins (checked by _check_columnar), request ids strs.
# Int fields the spec bounds below (negative values are malformed).
_NON_NEGATIVE = {"start": ("seq",), "tensors": ("seq",), "tokens": ("seq",), "end": ("seq",),
                 "credit": ("nbytes",), "subscribe": ("window_bytes",)}
_COLUMNAR_TYPES = {"request_ids": "list", "seqs": "bin", "steering_versions": "bin", "groups": "list",
                   "counts": "bin", "token_ids": "bin", "first_positions": "bin", "finish_reasons": "list",
                   "rows": "bin", "positions": "bin", "alerts": "bin", "values": "dict", "labels": "dict",
                   "firsts": "bin", "lasts": "bin"}
# Per kind, the (field, exact types, annotation, check, element type) tuples, built once.
_CHECKS = {kind: [(name, frozenset(_EXACT_TYPES[str(f.type)]), str(f.type), _TYPE_CHECKS[str(f.type)],
                   _ELEMENTS.get((kind, name)))
                  for name, f in fields.items() if str(f.type) in _TYPE_CHECKS]
           for kind, fields in _FIELDS.items()}


def _check_fields(kind: str, header: dict) -> None:
    """Required fields present; every field the spec types has its type (a msgpack bool is not an int);
    the elements of typed arrays too. The same check for ``decode`` and ``decode_header``."""
    for name in _REQUIRED[kind]:
        if name not in header:
            raise MalformedFrameError(f"{kind} header lacks required field {name!r}")
    for name, exact, ann, ok, element in _CHECKS[kind]:
        if name not in header:
            continue
        value = header[name]
        if type(value) not in exact and not ok(value):
            raise MalformedFrameError(f"{kind}.{name} must be {ann}, got {type(value).__name__}")
        if element is int:
            for x in value:
                if type(x) is not int:
                    raise MalformedFrameError(f"{kind}.{name} must be an array of ints, got an element {x!r}")
        elif element is str:
            for x in value:
                if type(x) is not str:
                    raise MalformedFrameError(f"{kind}.{name} must be an array of strs, got an element {x!r}")
    for name in _NON_NEGATIVE.get(kind, ()):
        if header.get(name, 0) < 0:
            raise MalformedFrameError(f"{kind}.{name} must be >= 0, got {header[name]}")
    if kind == "gap":
        seqranges.check(header.get("missing", ()), "gap.missing")
    elif kind == "end":
        seqranges.check(header.get("uncaptured_positions", ()), "end.uncaptured_positions")
        for reason, count in header.get("drops", _NO_META).items():
            if type(reason) is not str or type(count) is not int:
                raise MalformedFrameError(f"end.drops must map str to int, got {reason!r}: {count!r}")
    if kind in MULTI_REQUEST_KINDS:
        for name, ann in _COLUMNAR_TYPES.items():
            if name in header and name in _FIELDS[kind]:
                value = header[name]
                ok = (type(value) is bytes if ann == "bin" else type(value) is list if ann == "list"
                      else type(value) is dict)
                if not ok:
                    raise MalformedFrameError(f"{kind}.{name} must be {ann}, got {type(value).__name__}")
    if SHM_RING_KEY in header and not is_ring_name(header[SHM_RING_KEY]):  # nil and "" too (spec 9)
        raise MalformedFrameError(f"header field {SHM_RING_KEY!r} must be a ring name "
                                  f"mia-stream-ring-<pid>-<12 hex digits>, got {header[SHM_RING_KEY]!r}")


def _entry_field(e: dict, key: str, kind: type, default: Any = dataclasses.MISSING) -> Any:
    """One field of a tensor entry, type-checked (a msgpack bool is not an int)."""
    if key not in e:
        if default is dataclasses.MISSING:
            raise MalformedFrameError(f"tensor entry lacks required field {key!r}: {e!r}")
        return default
    value = e[key]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise MalformedFrameError(f"tensor entry field {key!r} must be {kind.__name__}, got {value!r}")
    return value


_NO_META: dict = {}  # shared defaults, never mutated
_SHARD_KEYS = ("tp_rank", "tp_size", "dim", "start", "stop", "total")
_NO_LAYERS: list = []


def _int_tuple(e: dict, key: str, default: Any = dataclasses.MISSING) -> tuple[int, ...]:
    """A list-of-ints field of an entry as a tuple (msgpack gives exact ints; a bool is not one)."""
    values = e.get(key, default)
    if values is dataclasses.MISSING:
        raise MalformedFrameError(f"tensor entry lacks required field {key!r}: {e!r}")
    if type(values) is list:
        for x in values:
            if type(x) is not int:
                break
        else:
            return tuple(values)
    raise MalformedFrameError(f"tensor entry field {key!r} must be a list of ints, got {values!r}")


class _Entry:
    """A tensor entry's fields, validated (``_parse_entry``)."""

    __slots__ = ("name", "dtype", "shape", "layers", "method", "nbytes", "raw_nbytes", "meta", "shm", "scale",
                 "crc", "shard", "count", "buf", "scale_buf")

    def __init__(self, name, dtype, shape, layers, method, nbytes, raw_nbytes, meta, shm, scale, crc, shard, count):
        self.name, self.dtype, self.shape, self.layers, self.method = name, dtype, shape, layers, method
        self.nbytes, self.raw_nbytes, self.meta, self.shm, self.scale = nbytes, raw_nbytes, meta, shm, scale
        self.crc, self.shard, self.count = crc, shard, count
        self.buf = self.scale_buf = None  # indices of its payload and scale buffer frames (_check_tensor_entries)


def _parse_entry(e: Any, max_message_bytes: int, has_ring: bool) -> _Entry:
    """Every rule of a tensor entry (spec 4.1) that does not need its bytes; the same for broker and decoders."""
    if type(e) is not dict:
        raise MalformedFrameError(f"bad tensor entry {e!r}: must be a map")
    # type(x) is T is the common case (msgpack builds exact types); anything else takes the checking path
    name = e.get("name")
    if type(name) is not str:
        name = _entry_field(e, "name", str)
    dtype = e.get("dtype")
    if type(dtype) is not str:
        dtype = _entry_field(e, "dtype", str)
    shape = _int_tuple(e, "shape")
    count = 1
    for d in shape:
        if d < 0:
            raise MalformedFrameError(f"tensor {name!r}: negative dimension in shape {list(shape)}")
        count *= d
    layers = _int_tuple(e, "layers", _NO_LAYERS)
    method = e.get("compression", "none")
    if type(method) is not str:
        method = _entry_field(e, "compression", str, "none")
    nbytes, raw_nbytes = e.get("nbytes"), e.get("raw_nbytes")
    if type(nbytes) is not int or type(raw_nbytes) is not int:
        nbytes, raw_nbytes = _entry_field(e, "nbytes", int), _entry_field(e, "raw_nbytes", int)
    if nbytes < 0 or raw_nbytes < 0:
        raise MalformedFrameError(f"tensor {name!r}: negative nbytes or raw_nbytes")
    meta = e.get("meta", _NO_META)
    if type(meta) is not dict:
        meta = _entry_field(e, "meta", dict, {})
    if dtype not in WIRE_DTYPES:
        raise MalformedFrameError(f"tensor {name!r}: unknown dtype {dtype!r}")
    if method not in COMPRESSIONS:
        raise MalformedFrameError(f"tensor {name!r}: unknown compression {method!r}")
    if raw_nbytes > max_message_bytes:  # a small lz4 payload must not inflate past the message limit
        raise OversizedMessageError(
            f"tensor {name!r}: {raw_nbytes} uncompressed bytes exceed the limit of {max_message_bytes}")
    if raw_nbytes != count * WIRE_DTYPES[dtype][1]:
        raise MalformedFrameError(f"tensor {name!r}: raw_nbytes {raw_nbytes} is not shape {list(shape)} x "
                                  f"{WIRE_DTYPES[dtype][1]} bytes of {dtype}")
    if method == "none" and raw_nbytes != nbytes:
        raise MalformedFrameError(f"tensor {name!r}: uncompressed but raw_nbytes {raw_nbytes} != nbytes {nbytes}")
    pos = None
    if "shm" in e:
        pos = e["shm"]
        if type(pos) is not int or pos < 0 or not has_ring:
            raise MalformedFrameError(f"tensor {name!r}: 'shm' must be an int position >= 0 in the header's "
                                      f"{SHM_RING_KEY!r}, got {pos!r}")
    scale = None
    if "scale" in e:
        scale_entry = _entry_field(e, "scale", dict)
        scale = _int_tuple(scale_entry, "shape")
        if any(d < 0 for d in scale):
            raise MalformedFrameError(f"tensor {name!r}: negative dimension in scale shape {list(scale)}")
        if scale_entry.get("dtype", "float32") != "float32":
            raise MalformedFrameError(f"tensor {name!r}: scale dtype must be float32, got {scale_entry['dtype']!r}")
        # spec 4.7: it broadcasts to the tensor's shape (aligned at the trailing dims, each 1 or equal)
        if len(scale) > len(shape) or any(s != 1 and s != d for s, d in zip(reversed(scale), reversed(shape))):
            raise MalformedFrameError(f"tensor {name!r}: scale shape {list(scale)} does not broadcast to "
                                      f"{list(shape)}")
    crc = _entry_field(e, "crc32", int) if "crc32" in e else None
    shard = None
    if "shard" in e:
        sh = _entry_field(e, "shard", dict)
        if any(type(sh.get(k)) is not int for k in _SHARD_KEYS):  # a bool, float or str is not an int
            raise MalformedFrameError(f"tensor {name!r}: bad shard geometry {sh!r}: needs int {list(_SHARD_KEYS)}")
        shard = Shard.from_wire(sh)
        if not (0 <= shard.tp_rank < shard.tp_size and 0 <= shard.dim < len(shape)
                and 0 <= shard.start <= shard.stop <= shard.total and shape[shard.dim] == shard.stop - shard.start):
            raise MalformedFrameError(f"tensor {name!r}: inconsistent shard geometry {sh!r} for shape {list(shape)}")
    return _Entry(name, dtype, shape, layers, method, nbytes, raw_nbytes, meta, pos, scale, crc, shard, count)


def _check_tensor_entries(entries: Any, sizes: list[int], i: int, has_ring: bool, max_message_bytes: int,
                          stored_rows: int | None = None, parsed: list | None = None) -> int:
    """Check entries against the buffer frame sizes from index ``i``; the index after them. ``parsed`` gets
    each validated ``_Entry`` with its buffer indices: a decoder reads no payload before every header rule
    and frame size of the message has been checked (spec section 6)."""
    if type(entries) is not list:
        raise MalformedFrameError("'tensors' must be a list")
    for e in entries:
        p = _parse_entry(e, max_message_bytes, has_ring)
        if parsed is not None:
            parsed.append(p)
        if stored_rows is not None:  # an entry of a row group (spec 10.2)
            if len(p.shape) < 2 or p.shape[1] != stored_rows:
                raise MalformedFrameError(f"tensor {p.name!r}: shape {list(p.shape)} does not have the group's "
                                          f"{stored_rows} rows along dim 1")
            if p.scale is not None and len(p.scale) != len(p.shape):  # its dim 1 is then 1 or the rows
                raise MalformedFrameError(f"tensor {p.name!r}: in a row group a scale has the tensor's "
                                          f"{len(p.shape)} dims, got {list(p.scale)}")
            if p.shard is not None and p.shard.dim < 2:  # dims 0 and 1 are layers and rows
                raise MalformedFrameError(f"tensor {p.name!r}: in a row group a shard splits a dim >= 2, "
                                          f"got {p.shard.dim}")
        if p.shm is None:
            if i >= len(sizes):
                raise MalformedFrameError(f"tensor {p.name!r}: its buffer frame is missing")
            if sizes[i] != p.nbytes:
                raise MalformedFrameError(f"tensor {p.name!r}: buffer has {sizes[i]} bytes, header says {p.nbytes}")
            p.buf = i
            i += 1
        if p.scale is not None:
            if i >= len(sizes):
                raise MalformedFrameError(f"tensor {p.name!r}: its scale buffer is missing")
            n = 4
            for d in p.scale:
                n *= d
            if sizes[i] != n:
                raise MalformedFrameError(f"tensor {p.name!r}: scale buffer has {sizes[i]} bytes, its shape needs {n}")
            p.scale_buf = i
            i += 1
    return i


# ---------------------------------------------------------------------------------------------- columnar checks

def _column(kind: str, header: dict, key: str, n: int | None, default: Any = dataclasses.MISSING) -> np.ndarray:
    """A numeric column (int64 LE bin) of ``n`` values (any count when ``n`` is None)."""
    if key not in header:  # absent; a nil value is not absent: it is not a bin (spec 2)
        if default is dataclasses.MISSING:
            raise MalformedFrameError(f"{kind} header lacks required field {key!r}")
        return default
    v = header[key]
    if type(v) is not bytes or len(v) % 8:
        raise MalformedFrameError(f"{kind}.{key} must be a bin of little-endian int64s")
    arr = np.frombuffer(v, _I64)
    if n is not None and len(arr) != n:
        raise MalformedFrameError(f"{kind}.{key} has {len(arr)} values, needs {n}")
    return arr


def _request_ids(kind: str, header: dict) -> list:
    ids = header.get("request_ids")
    if type(ids) is not list or any(type(r) is not str for r in ids):
        raise MalformedFrameError(f"{kind}.request_ids must be an array of strs")
    if len(set(ids)) != len(ids):
        raise MalformedFrameError(f"{kind}.request_ids names a request twice")
    return ids


def _request_columns(kind: str, header: dict) -> tuple[list, np.ndarray]:
    ids = _request_ids(kind, header)
    seqs = _column(kind, header, "seqs", len(ids))
    if len(seqs) and int(seqs.min()) < 0:
        raise MalformedFrameError(f"{kind}.seqs must be >= 0")
    return ids, seqs


class _GroupPlan:
    """A row group's validated columns (from ``_check_step_batch``), reused by ``decode``."""

    __slots__ = ("g", "part", "requests", "rows", "positions", "token_ids", "stored_rows", "take", "entries")

    def __init__(self, g, part, requests, rows, positions, token_ids, stored_rows, take):
        self.g, self.part, self.requests, self.rows = g, part, requests, rows
        self.positions, self.token_ids, self.stored_rows, self.take = positions, token_ids, stored_rows, take


def _check_step_batch(header: dict, sizes: list[int], max_message_bytes: int) -> list[_GroupPlan]:
    kind = "step_batch"
    ids, _ = _request_columns(kind, header)
    r = len(ids)
    _column(kind, header, "steering_versions", r, None)
    groups = header.get("groups", [])
    if type(groups) is not list:
        raise MalformedFrameError(f"{kind}.groups must be an array of maps")
    has_ring = SHM_RING_KEY in header
    seen: set[tuple[int, int]] = set()
    plans, i = [], 0
    for g in groups:
        if type(g) is not dict:
            raise MalformedFrameError(f"{kind}: a row group must be a map, got {g!r}")
        part = g.get("part", 0)
        if type(part) is not int or part < 0:
            raise MalformedFrameError(f"{kind}: group part must be an int >= 0, got {part!r}")
        requests = _column(kind, g, "requests", None)
        rows = _column(kind, g, "rows", len(requests))
        if len(requests) and (int(requests.min()) < 0 or int(requests.max()) >= r):
            raise MalformedFrameError(f"{kind}: a group names a request index outside request_ids (0..{r - 1})")
        if len(rows) and int(rows.min()) < 0:
            raise MalformedFrameError(f"{kind}: a group has a negative row count")
        for q in requests.tolist():
            if (q, part) in seen:
                raise MalformedFrameError(f"{kind}: request {ids[q]!r} has two segments of part {part}")
            seen.add((q, part))
        n = int(rows.sum())
        positions = _column(kind, g, "positions", n)
        token_ids = _column(kind, g, "token_ids", n, None)
        stored, take = n, None
        if ("row0" in g) != ("stored_rows" in g):
            raise MalformedFrameError(f"{kind}: a group has row0 and stored_rows together or neither")
        if "row0" in g:
            row0 = _column(kind, g, "row0", len(requests))
            stored = g.get("stored_rows")
            if type(stored) is not int or stored < 0:
                raise MalformedFrameError(f"{kind}: a group with row0 needs stored_rows, an int >= 0")
            if len(row0) and (int(row0.min()) < 0 or int((row0 + rows).max()) > stored):
                raise MalformedFrameError(f"{kind}: row0 + rows runs past the group's {stored} stored rows")
            take = np.concatenate([np.arange(a, a + c, dtype=np.intp) for a, c in zip(row0.tolist(), rows.tolist())]
                                  ) if len(row0) else np.zeros(0, dtype=np.intp)
        plan = _GroupPlan(g, part, requests, rows, positions, token_ids, stored, take)
        plan.entries = []
        i = _check_tensor_entries(g.get("tensors", []), sizes, i, has_ring, max_message_bytes, stored, plan.entries)
        plans.append(plan)
    if i != len(sizes):
        raise MalformedFrameError(f"{len(sizes) - i} buffer frame(s) not described by the header")
    return plans


def _check_token_batch(header: dict) -> None:
    kind = "token_batch"
    ids, _ = _request_columns(kind, header)
    r = len(ids)
    counts = _column(kind, header, "counts", r, None)
    if counts is not None and len(counts) and int(counts.min()) < 0:
        raise MalformedFrameError(f"{kind}.counts must be >= 0")
    _column(kind, header, "token_ids", int(counts.sum()) if counts is not None else r,
            None if not r else dataclasses.MISSING)
    _column(kind, header, "first_positions", r, None)
    reasons = header.get("finish_reasons")
    if reasons is not None and (type(reasons) is not list or len(reasons) != r
                                or any(x is not None and type(x) is not str for x in reasons)):
        raise MalformedFrameError(f"{kind}.finish_reasons must be an array of {r} str|nil")


def _check_analysis(header: dict) -> None:
    kind = "analysis"
    ids, _ = _request_columns(kind, header)
    rows = _column(kind, header, "rows", len(ids), None)
    if rows is not None and len(rows) and int(rows.min()) < 0:
        raise MalformedFrameError(f"{kind}.rows must be >= 0")
    n = int(rows.sum()) if rows is not None else len(ids)
    _column(kind, header, "positions", n, None)
    alerts = _column(kind, header, "alerts", n, None)
    if alerts is not None and len(alerts) and (int(alerts.min()) < 0 or int(alerts.max()) > 1):
        raise MalformedFrameError(f"{kind}.alerts must be 0 or 1")
    for name, v in header.get("values", {}).items():
        if type(name) is not str:
            raise MalformedFrameError(f"{kind}: a value name must be a str, got {name!r}")
        if type(v) is not dict or type(v.get("dtype")) is not str or v["dtype"] not in VALUE_WIRE_DTYPES:
            raise MalformedFrameError(f"{kind}: value {name!r} must be a map with a dtype of "
                                      f"{sorted(VALUE_WIRE_DTYPES)}")
        shape = _int_tuple(v, "shape")
        if not shape or shape[0] != n or any(d < 0 for d in shape):
            raise MalformedFrameError(f"{kind}: value {name!r} has shape {list(shape)}, needs [{n}, ...]")
        data = v.get("data")
        count = 1
        for d in shape:
            count *= d
        if type(data) is not bytes or len(data) != count * VALUE_WIRE_DTYPES[v["dtype"]][1]:
            raise MalformedFrameError(f"{kind}: value {name!r}: data is not {count} {v['dtype']} values")
        if v["dtype"] == "bool" and data and max(data) > 1:
            raise MalformedFrameError(f"{kind}: value {name!r}: a bool is the byte 0 or 1")
    for name, v in header.get("labels", {}).items():
        if type(name) is not str:
            raise MalformedFrameError(f"{kind}: a label name must be a str, got {name!r}")
        if type(v) is not list or len(v) != n or any(x is not None and type(x) is not str for x in v):
            raise MalformedFrameError(f"{kind}: label {name!r} must be an array of {n} str|nil")


def _check_gap_batch(header: dict) -> tuple[list, np.ndarray, np.ndarray, np.ndarray]:
    """Spec 3.16: ``(request_ids, counts, firsts, lasts)``, each range ``0 <= first <= last``."""
    kind = "gap_batch"
    ids = _request_ids(kind, header)
    counts = _column(kind, header, "counts", len(ids))
    if len(counts) and int(counts.min()) < 0:
        raise MalformedFrameError(f"{kind}.counts must be >= 0")
    n = int(counts.sum())
    firsts = _column(kind, header, "firsts", n)
    lasts = _column(kind, header, "lasts", n)
    if n and (int(firsts.min()) < 0 or bool((firsts > lasts).any())):
        raise MalformedFrameError(f"{kind} ranges must have 0 <= first <= last")
    return ids, counts, firsts, lasts


def _check_columnar(kind: str, header: dict, sizes: list[int], max_message_bytes: int) -> list | None:
    if kind == "step_batch":
        return _check_step_batch(header, sizes, max_message_bytes)
    if sizes:
        raise MalformedFrameError(f"{kind} message carries {len(sizes)} unexpected buffer frame(s)")
    if kind == "token_batch":
        _check_token_batch(header)
    else:
        _check_analysis(header)
    return None


# ---------------------------------------------------------------------------------------------- decode

def decode(frames: Sequence[Any], *, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
           verify: bool = True, shm: BufferSource | None = None, legacy: bool = False) -> Message:
    """Decode ``[topic, header, *buffers]``; tensors view the received buffers without copying.

    Tensors carried in a producer's shared-memory ring are copied out of it through ``shm``. ``legacy``:
    also accept schema 1.x messages (recordings). Raises a ``WireError`` subclass for anything that is not
    a valid message of a known major version (a ``SharedBufferError`` for ring bytes that cannot be read).
    """
    if len(frames) < 2:
        raise MalformedFrameError(f"a message has at least 2 frames (topic, header); got {len(frames)}")
    # Sizes by len() where that is the size in bytes, and the header unpacked from the frame itself: a
    # zmq.Frame's .buffer (a new memoryview and weakref each time) is only taken for the tensor buffers.
    total = 0
    for f in frames:
        total += len(f) if type(f) in _SIZED else _len(_buffer_of(f))
    if total > max_message_bytes:
        raise OversizedMessageError(f"message of {total} bytes exceeds the limit of {max_message_bytes}")
    head = frames[1]
    if type(head) not in _SIZED:
        head = _buffer_of(head)
    header = _unpack_header(head, len(head) if type(head) in _SIZED else _len(head), legacy)
    kind = header.get("kind")
    cls = MESSAGE_TYPES.get(kind) if type(kind) is str else None
    if cls is None:
        raise MalformedFrameError(f"unknown message kind {kind!r}; known: {sorted(MESSAGE_TYPES)}")
    _check_fields(kind, header)
    buffers = [_buffer_of(f) for f in frames[2:]] if len(frames) > 2 else []
    if kind in COLUMNAR_KINDS:
        return _decode_columnar(kind, header, buffers, verify, max_message_bytes, shm)
    fields = {n: header[n] for n in _FIELDS[kind] if n in header}
    if cls is TensorFrame:
        entries: list[_Entry] = []
        i = _check_tensor_entries(header.get("tensors", []), _frame_sizes(buffers), 0, SHM_RING_KEY in header,
                                  max_message_bytes, None, entries)
        if i != len(buffers):
            raise MalformedFrameError(f"{len(buffers) - i} buffer frame(s) not described by the header")
        fields["tensors"] = _decode_tensors(entries, buffers, verify, _ring_of(header, shm))
    elif buffers:
        raise MalformedFrameError(f"{kind} message carries {len(buffers)} unexpected buffer frame(s)")
    if cls is GapBatch:
        ids, counts, firsts, lasts = _check_gap_batch(header)
        return GapBatch(header["producer_id"], header["epoch"], ids, counts, firsts, lasts,
                        header.get("reason", ""), header.get("origin", ""), header.get("time_ns", 0))
    try:
        return cls(**fields)
    except TypeError as e:
        raise MalformedFrameError(f"{kind} header: {e}") from None


def _ring_of(header: dict, shm: BufferSource | None):
    """``(reader or None, ring name)`` for a header that names a ring, else None."""
    if SHM_RING_KEY not in header:
        return None
    return shm, header[SHM_RING_KEY]


def _decode_tensors(entries: list, buffers: list, verify: bool, ring: tuple | None = None,
                    take: tuple | None = None) -> list[Tensor]:
    """The tensors of ``entries`` (validated by ``_check_tensor_entries``, which gave each its buffer indices).

    ``take = (stored_rows, rows)``: each stored tensor has ``stored_rows`` along dim 1, of which only ``rows``
    (an index array) are wanted (a consumer given some requests of a step batch)."""
    out = []
    for p in entries:
        gathered = False
        if p.shm is not None:
            if ring is None:
                raise MalformedFrameError(f"tensor {p.name!r}: 'shm' without the header's {SHM_RING_KEY!r}")
            if ring[0] is None:  # only an entry that uses the ring needs a reader
                raise ShmUnavailableError(f"this message's tensors are in the shared-memory ring {ring[1]!r}; "
                                          "decode it with shm=ShmRingReader() (mia_stream.bus) on the producer's host")
            if take is not None and p.method == "none" and len(p.shape) >= 2:
                # only this reader's rows leave the ring
                row_bytes = WIRE_DTYPES[p.dtype][1]
                for d in p.shape[2:]:
                    row_bytes *= d
                data = ring[0].gather(ring[1], p.shm, p.nbytes, p.shape[0], take[0], row_bytes, take[1])
                gathered = True
            else:
                payload = ring[0].read(ring[1], p.shm, p.nbytes)
                if _len(payload) != p.nbytes:
                    raise MalformedFrameError(f"tensor {p.name!r}: ring gave {_len(payload)} bytes, header says "
                                              f"{p.nbytes}")
        else:
            payload = buffers[p.buf]
        if not gathered:
            data = decompress(payload, p.method, p.raw_nbytes)
            if verify and p.crc is not None:
                verify_crc32(p.name, data, p.crc)
        scale = None
        if p.scale is not None:
            scale = np.frombuffer(buffers[p.scale_buf], dtype="<f4").reshape(p.scale)
        shape = p.shape
        if take is not None:
            shape = (shape[0], len(take[1]), *shape[2:])
            if not gathered:
                data = _take_rows(p, data, take)
            if scale is not None and scale.shape[1] == take[0] and take[0] != 1:  # per row: its rows too
                scale = scale[:, take[1]]
        have = data.nbytes if type(data) is memoryview or isinstance(data, np.ndarray) else _len(data)
        want = WIRE_DTYPES[p.dtype][1]
        for d in shape:
            want *= d
        if have != want:
            raise MalformedFrameError(f"tensor {p.name!r}: {have} bytes for shape {shape} {p.dtype} (want {want})")
        out.append(Tensor(p.name, p.dtype, shape, data, p.layers, p.shard, scale,
                          dict(p.meta) if p.meta else {}))
    return out


def _take_rows(p: _Entry, data: Any, take: tuple) -> np.ndarray:
    """Rows ``take[1]`` (dim 1) of a stored tensor's bytes, as a new ``[L, rows, ...]`` uint8 array."""
    row_bytes = WIRE_DTYPES[p.dtype][1]
    for d in p.shape[2:]:
        row_bytes *= d
    arr = np.frombuffer(data, np.uint8).reshape(p.shape[0], take[0], row_bytes)
    return np.ascontiguousarray(arr[:, take[1]])


def _decode_columnar(kind: str, header: dict, buffers: list, verify: bool, max_message_bytes: int,
                     shm: BufferSource | None) -> Message:
    plans = _check_columnar(kind, header, _frame_sizes(buffers) if buffers else [], max_message_bytes)
    ids, seqs = _request_columns(kind, header)
    common = {"producer_id": header["producer_id"], "epoch": header["epoch"], "request_ids": ids, "seqs": seqs,
              "time_ns": header.get("time_ns", 0)}
    if kind == "step_batch":
        ring = _ring_of(header, shm)
        groups = []
        for plan in plans:
            take = (plan.stored_rows, plan.take) if plan.take is not None else None
            tensors = _decode_tensors(plan.entries, buffers, verify, ring, take)
            groups.append(RowGroup(plan.requests, plan.rows, plan.positions, tensors, plan.token_ids, plan.part))
        return StepBatch(step=header["step"], groups=groups,
                         steering_versions=_column(kind, header, "steering_versions", len(ids), None), **common)
    if kind == "token_batch":
        return TokenBatch(step=header["step"], counts=_column(kind, header, "counts", len(ids), None),
                          token_ids=_column(kind, header, "token_ids", None, None),
                          first_positions=_column(kind, header, "first_positions", len(ids), None),
                          finish_reasons=header.get("finish_reasons"), **common)
    values = {}
    for name, v in header.get("values", {}).items():
        np_dtype = VALUE_WIRE_DTYPES[v["dtype"]][0]
        arr = np.frombuffer(v["data"], np_dtype).reshape(v["shape"])
        values[name] = arr.astype(bool) if v["dtype"] == "bool" else arr
    return AnalysisBatch(analyzer=header["analyzer"], analyzer_version=header.get("analyzer_version", ""),
                         step=header.get("step", -1), rows=_column(kind, header, "rows", len(ids), None),
                         positions=_column(kind, header, "positions", None, None),
                         alerts=_column(kind, header, "alerts", None, None), values=values,
                         labels=dict(header.get("labels", {})), source_time_ns=header.get("source_time_ns", 0),
                         **common)


def decode_header(frames: Sequence[Any], *, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                  legacy: bool = False) -> dict:
    """Validate a message's framing and header without building tensors; return the header map.

    For the broker's hot path: it checks every rule ``decode`` checks that does not need tensor bytes
    (version, kind, required fields and their types, tensor entries, columns, one buffer per tensor of the
    declared size), with the same functions, so what it passes every consumer accepts (ring bytes, lz4
    content and checksums aside). Raises the same ``WireError`` subclasses as ``decode``.
    """
    n = len(frames)
    if n < 2:
        raise MalformedFrameError(f"a message has at least 2 frames (topic, header); got {n}")
    sizes = _frame_sizes(frames)
    total = sum(sizes)
    if total > max_message_bytes:
        raise OversizedMessageError(f"message of {total} bytes exceeds the limit of {max_message_bytes}")
    head = frames[1]
    header = _unpack_header(head if type(head) in _SIZED else _buffer_of(head), sizes[1], legacy)
    kind = header.get("kind")
    if type(kind) is not str or kind not in MESSAGE_TYPES:
        raise MalformedFrameError(f"unknown message kind {kind!r}; known: {sorted(MESSAGE_TYPES)}")
    _check_fields(kind, header)
    if kind in COLUMNAR_KINDS:
        _check_columnar(kind, header, sizes[2:], max_message_bytes)
    elif kind == "tensors":
        i = _check_tensor_entries(header.get("tensors", []), sizes[2:], 0, SHM_RING_KEY in header,
                                  max_message_bytes)
        if i != n - 2:
            raise MalformedFrameError(f"{n - 2 - i} buffer frame(s) not described by the header")
    elif n > 2:
        raise MalformedFrameError(f"{kind} message carries {n - 2} unexpected buffer frame(s)")
    elif kind == "gap_batch":
        _check_gap_batch(header)
    return header


# ---------------------------------------------------------------------------------------------- batches
# A batch is one zmq multipart message carrying several messages' frames unchanged (spec section 8):
# ``[b"", header {"v", "kind": "batch", "frames": [frames of each message]}, *frames of message 0, ...]``.
# libzmq signals its pipe and I/O thread once per multipart message, so a batch pays that once for all.

BATCH_KIND = "batch"
MAX_BATCH_MESSAGES = 4096  # a receiver refuses bigger batches (senders use far fewer)


def batch_header(counts: list[int]) -> bytes:
    """The header frame of a batch whose messages have ``counts[i]`` frames each."""
    return msgpack.packb({"v": list(SCHEMA_VERSION), "kind": BATCH_KIND, "frames": counts})


def encode_batch(messages: Sequence[Sequence[Any]]) -> list[Any]:
    """One multipart message carrying ``messages`` (each ``[topic, header, *buffers]``); nothing is copied."""
    out: list[Any] = [b"", batch_header([len(m) for m in messages])]
    for m in messages:
        out.extend(m)
    return out


def split_batch(frames: Sequence[Any]) -> list[list[Any]] | None:
    """The messages of a batch, or None when ``frames`` is not one (left to the single-message path).

    Only an empty topic frame can start a batch, so stream messages cost one ``len()`` here. Raises
    ``MalformedFrameError`` for a batch whose frame counts do not describe its frames.
    """
    if len(frames) < 3 or len(frames[0]):
        return None
    head = frames[1]
    if type(head) not in _SIZED:
        head = _buffer_of(head)
    try:
        header = _unpack_header(head, len(head) if type(head) in _SIZED else _len(head))
    except WireError:
        return None  # not a valid header of any kind: the single-message path reports it
    if header.get("kind") != BATCH_KIND:
        return None
    counts = header.get("frames")
    if (not isinstance(counts, list) or not 1 <= len(counts) <= MAX_BATCH_MESSAGES
            or not all(type(c) is int and c >= 2 for c in counts)):
        raise MalformedFrameError("batch.frames must be a list of 1 to "
                                  f"{MAX_BATCH_MESSAGES} frame counts, each >= 2")
    if sum(counts) != len(frames) - 2:
        raise MalformedFrameError(f"batch.frames adds up to {sum(counts)} frames, the batch carries {len(frames) - 2}")
    out, i = [], 2
    for c in counts:
        out.append(frames[i:i + c])
        i += c
    return out


# ---------------------------------------------------------------------------------------------- columnar routing

def columnar_requests(header: dict) -> tuple[list, list]:
    """``(request_ids, seqs)`` of a validated columnar header (the broker routes by them)."""
    return header["request_ids"], np.frombuffer(header["seqs"], _I64).tolist()


def select_requests(frames: Sequence[Any], header: dict, keep: Sequence[int]) -> tuple[list, dict]:
    """The message naming only requests ``keep`` (ascending indices into ``request_ids``) of a validated
    columnar message (or gap batch), and its header. Only the header is rewritten: tensor payloads (ring references and
    buffer frames) stay whole, and each row group says which of their rows remain (``row0``, ``stored_rows``:
    spec section 10), so no tensor byte is copied; ``compact`` copies out just those rows."""
    kind = header["kind"]
    keep_arr = np.asarray(keep, dtype=np.intp)
    remap = np.full(len(header["request_ids"]), -1, dtype=np.intp)
    remap[keep_arr] = np.arange(len(keep_arr))
    h = dict(header)
    ids = header["request_ids"]
    h["request_ids"] = [ids[i] for i in keep_arr.tolist()]
    if kind != "gap_batch":
        h["seqs"] = np.frombuffer(header["seqs"], _I64)[keep_arr].tobytes()
    buffers = list(frames[2:])
    if kind == "gap_batch":
        counts = np.frombuffer(header["counts"], _I64)
        h["counts"] = counts[keep_arr].tobytes()
        range_mask = np.repeat(remap >= 0, counts)
        h["firsts"] = np.frombuffer(header["firsts"], _I64)[range_mask].tobytes()
        h["lasts"] = np.frombuffer(header["lasts"], _I64)[range_mask].tobytes()
    elif kind == "step_batch":
        if "steering_versions" in header:
            h["steering_versions"] = np.frombuffer(header["steering_versions"], _I64)[keep_arr].tobytes()
        groups, kept_buffers, i = [], [], 0
        for g in header.get("groups", []):
            requests = np.frombuffer(g["requests"], _I64)
            rows = np.frombuffer(g["rows"], _I64)
            nbuf = sum((0 if "shm" in e else 1) + (1 if "scale" in e else 0) for e in g.get("tensors", []))
            mine = remap[requests] >= 0
            if not mine.any():  # none of its segments remain: the group and its buffers go
                i += nbuf
                continue
            kept_buffers.extend(buffers[i:i + nbuf])
            i += nbuf
            offsets = np.zeros(len(rows) + 1, dtype=_I64)
            np.cumsum(rows, out=offsets[1:])
            row0 = np.frombuffer(g["row0"], _I64) if "row0" in g else offsets[:-1]
            row_mask = np.repeat(mine, rows)
            ng = dict(g)
            ng["requests"] = remap[requests[mine]].astype(_I64).tobytes()
            ng["rows"] = rows[mine].tobytes()
            ng["positions"] = np.frombuffer(g["positions"], _I64)[row_mask].tobytes()
            if "token_ids" in g:
                ng["token_ids"] = np.frombuffer(g["token_ids"], _I64)[row_mask].tobytes()
            if not mine.all():
                ng["row0"] = row0[mine].tobytes()
                ng["stored_rows"] = g.get("stored_rows", int(offsets[-1]))
            groups.append(ng)
        h["groups"] = groups
        buffers = kept_buffers
    elif kind == "token_batch":
        counts = (np.frombuffer(header["counts"], _I64) if "counts" in header
                  else np.ones(len(ids), dtype=_I64))
        h["counts"] = counts[keep_arr].tobytes()
        if "token_ids" in header:
            h["token_ids"] = np.frombuffer(header["token_ids"], _I64)[np.repeat(remap >= 0, counts)].tobytes()
        if "first_positions" in header:
            h["first_positions"] = np.frombuffer(header["first_positions"], _I64)[keep_arr].tobytes()
        if "finish_reasons" in header:
            h["finish_reasons"] = [header["finish_reasons"][i] for i in keep_arr.tolist()]
    elif kind == "analysis":
        rows = np.frombuffer(header["rows"], _I64) if "rows" in header else np.ones(len(ids), dtype=_I64)
        h["rows"] = rows[keep_arr].tobytes()
        row_mask = np.repeat(remap >= 0, rows)
        for key in ("positions", "alerts"):
            if key in header:
                h[key] = np.frombuffer(header[key], _I64)[row_mask].tobytes()
        values = {}
        for name, v in header.get("values", {}).items():
            arr = np.frombuffer(v["data"], VALUE_WIRE_DTYPES[v["dtype"]][0]).reshape(v["shape"])[row_mask]
            values[name] = {"dtype": v["dtype"], "shape": list(arr.shape), "data": arr.tobytes()}
        h["values"] = values
        idx = np.flatnonzero(row_mask).tolist()
        h["labels"] = {name: [v[j] for j in idx] for name, v in header.get("labels", {}).items()}
    else:
        raise MalformedFrameError(f"select_requests: {kind!r} is not a columnar kind")
    if kind == "step_batch" and not any("shm" in e for g in h["groups"] for e in g.get("tensors", [])):
        h.pop(SHM_RING_KEY, None)
    return [frames[0], msgpack.packb(h, use_bin_type=True), *buffers], h


def has_partial_inline_rows(header: dict) -> bool:
    """Whether a (selected) step batch sends buffer frames of which only some rows are wanted: ``compact``
    then saves their other rows' bytes."""
    return any("row0" in g and any("shm" not in e for e in g.get("tensors", ()))
               for g in header.get("groups", ()))


def compact(frames: Sequence[Any], shm: BufferSource | None = None) -> list[Any]:
    """The same message with every tensor payload inline and holding exactly its wanted rows (no ``row0``):
    what a consumer that cannot read the producer's ring, or that matches a few requests of a step, is sent.
    Raises ``SharedBufferError`` when the ring cannot give the bytes."""
    msg = decode(frames, shm=shm, verify=False)
    tensors = ([t for g in msg.groups for t in g.tensors] if isinstance(msg, StepBatch)
               else getattr(msg, "tensors", ()))
    for t in tensors:  # a wire meta naming these would be read by encode as an override (spec 10.4: none)
        if "compression" in t.meta or "checksum" in t.meta:
            t.meta = {k: v for k, v in t.meta.items() if k not in ("compression", "checksum")}
    return encode(msg)


# ---------------------------------------------------------------------------------------------- shared memory

def references_shm(frames: Sequence[Any]) -> bool:
    """Whether a message may reference a shared-memory ring (a byte search of its header: cheap; a false
    positive, e.g. the key inside a user tag, only costs the exact check of ``shm_extent``)."""
    if len(frames) < 2:
        return False
    head = frames[1]
    t = type(head)
    if t is not bytes:
        head = getattr(head, "bytes", None) or bytes(head)  # a zmq.Frame has .bytes; a memoryview has not
    return _SHM_MARK in head


def shm_extent(header: dict) -> tuple[str, int, int, int] | None:
    """``(ring, lowest position, bytes, end)`` of a validated header's ring-held buffers, or None without any.
    The lowest position is the first to be overwritten; the bytes count as the message's size in every
    budget (spec 9: of a row group that keeps ``rows`` of its ``stored_rows``, that share of each payload);
    ``end`` is the highest position + nbytes (how far a receiver of this message has the ring)."""
    name = header.get(SHM_RING_KEY)
    kind = header.get("kind")
    if type(name) is not str or kind not in ("tensors", "step_batch"):
        return None
    oldest, n, end = None, 0, 0
    if kind == "tensors":
        lists = [(header.get("tensors", ()), 1, 1)]
    else:
        lists = []
        for g in header.get("groups", ()):
            kept = sum(np.frombuffer(g["rows"], _I64).tolist())
            lists.append((g.get("tensors", ()), kept, g.get("stored_rows", kept)))
    for entries, kept, stored in lists:
        for e in entries:
            if isinstance(e, dict) and type(e.get("shm")) is int:
                pos = e["shm"]
                oldest = pos if oldest is None else min(oldest, pos)
                size = e.get("nbytes")
                if type(size) is int:
                    n += size if kept == stored else size * kept // max(stored, 1)
                    end = max(end, pos + size)
    return (name, oldest, n, end) if oldest is not None else None


def shm_loss_reason(error: Exception) -> str:
    """The gap reason for a message whose ring-held bytes could not be read."""
    return "shm_overrun" if isinstance(error, ShmOverrunError) else "shm_unavailable"


def shm_loss_gaps(header: dict, error: Exception, origin: str) -> list[GapNotice | GapBatch]:
    """The gaps that replace a message (``header``) whose ring-held bytes could not be read, each naming the seq
    it held of each request: one GapBatch for a columnar message naming several requests (a step batch names
    ~256, and a consumer far behind its ring meets many in a row), else one GapNotice."""
    epoch = header.get("epoch")
    epoch = epoch if type(epoch) is int else 0
    pid, reason, now = str(header.get("producer_id", "")), shm_loss_reason(error), time.time_ns()
    if header.get("kind") in COLUMNAR_KINDS:
        ids, seqs = header["request_ids"], np.frombuffer(header["seqs"], _I64)
        if len(ids) > 1:
            return [GapBatch(pid, epoch, list(ids), np.ones(len(ids), _I64), seqs, seqs, reason, origin, now)]
        return [GapNotice(rid, pid, epoch, [[seq, seq]], reason, origin, now)
                for rid, seq in zip(ids, seqs.tolist())]
    seq = header.get("seq", 0)
    return [GapNotice(str(header.get("request_id", "")), pid, epoch, [[seq, seq]], reason, origin, now)]


def shm_loss_gap(header: dict, error: Exception, origin: str) -> GapNotice:
    """The one GapNotice that replaces a per-request message whose ring-held bytes could not be read."""
    return shm_loss_gaps(header, error, origin)[0]


def inline_shm(frames: Sequence[Any], shm: BufferSource) -> list[Any]:
    """The same message with its ring-held buffers copied in as frames (for a recorder, a peer on another
    host, anything that keeps the bytes). Raises ``SharedBufferError`` when the ring cannot give them."""
    head = frames[1]
    header = _unpack_header(head if type(head) in _SIZED else _buffer_of(head), _len(_buffer_of(head)))
    name = header.pop(SHM_RING_KEY, None)
    if name is None:
        return list(frames)
    if header.get("kind") != "tensors":  # a step batch: its row groups may keep only some rows
        return compact(frames, shm)
    if type(name) is not str or not isinstance(header.get("tensors"), list):
        raise MalformedFrameError(f"bad {SHM_RING_KEY!r} message")
    buffers, i, rest = [], 0, list(frames[2:])
    for e in header["tensors"]:
        if not isinstance(e, dict):
            raise MalformedFrameError(f"bad tensor entry {e!r}: must be a map")
        if "shm" in e:
            pos, nbytes = e.pop("shm"), e.get("nbytes")
            if type(pos) is not int or type(nbytes) is not int:
                raise MalformedFrameError(f"bad shared-memory reference in tensor entry {e!r}")
            buffers.append(shm.read(name, pos, nbytes))
        else:
            if i >= len(rest):
                raise MalformedFrameError("a tensor's buffer frame is missing")
            buffers.append(rest[i])
            i += 1
        if "scale" in e:
            if i >= len(rest):
                raise MalformedFrameError("a tensor's scale buffer is missing")
            buffers.append(rest[i])
            i += 1
    return [frames[0], msgpack.packb(header, use_bin_type=True), *buffers]
