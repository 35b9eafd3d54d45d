"""The header rules, one validator for every receiver (spec sections 3, 4, 6, 10).

``decode_header`` (the broker's, which never touches tensor bytes) and ``decode`` check the same rules with these
functions (``_check_fields``, ``_parse_entry``, ``_check_columnar``), so the broker never forwards a header that
a consumer would then refuse. Pure checks over header maps and frame sizes: nothing here reads a payload.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from mia_stream.errors import MalformedFrameError, OversizedMessageError
from mia_stream.schemas import seqranges
from mia_stream.schemas._batches import VALUE_WIRE_DTYPES
from mia_stream.schemas._framing import _I64, SHM_RING_KEY
from mia_stream.schemas._kinds import MESSAGE_TYPES, MULTI_REQUEST_KINDS
from mia_stream.schemas._oob import is_ring_name
from mia_stream.schemas._tensors import COMPRESSIONS, WIRE_DTYPES, Shard

_FIELDS = {kind: {f.name: f for f in dataclasses.fields(cls)} for kind, cls in MESSAGE_TYPES.items()}
_REQUIRED = {
    kind: [f.name for f in fields.values()
           if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    for kind, fields in _FIELDS.items()
}


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


# Shapes (spec 4.1): checked before any product, so a header cannot make a receiver do bigint work quadratic in its
# size (100k dims near 2^64 took a broker 46 s). Real tensors have a handful of dims; every element count is
# bounded by the message limit anyway (raw_nbytes = elements x itemsize <= max_message_bytes).
MAX_RANK = 32
MAX_DIM = 1 << 40


def _shape(e: dict, key: str, what: str) -> tuple[int, ...]:
    """A shape field: at most ``MAX_RANK`` ints, each ``0 <= d <= MAX_DIM``; checked in time linear in its size."""
    values = e.get(key, dataclasses.MISSING)
    if type(values) is list and len(values) > MAX_RANK:
        raise MalformedFrameError(f"{what}: shape has {len(values)} dims, at most {MAX_RANK} are allowed")
    shape = _int_tuple(e, key)
    for d in shape:
        if d < 0 or d > MAX_DIM:
            raise MalformedFrameError(f"{what}: dimension {d} in shape {list(shape)} is outside 0..{MAX_DIM}")
    return shape


def _elements(shape: tuple[int, ...]) -> int:
    """The element count of a checked shape (``_shape``): at most ``MAX_RANK`` factors of <= 2^40."""
    if 0 in shape:
        return 0
    count = 1
    for d in shape:
        count *= d
    return count


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
                 "crc", "shard", "count", "buf", "scale_buf", "layer_index")

    def __init__(self, name, dtype, shape, layers, method, nbytes, raw_nbytes, meta, shm, scale, crc, shard, count):
        self.name, self.dtype, self.shape, self.layers, self.method = name, dtype, shape, layers, method
        self.nbytes, self.raw_nbytes, self.meta, self.shm, self.scale = nbytes, raw_nbytes, meta, shm, scale
        self.crc, self.shard, self.count = crc, shard, count
        self.buf = self.scale_buf = None  # indices of its payload and scale buffer frames (_check_tensor_entries)
        self.layer_index = None  # (2.2, a row group's entry) the stored layers (dim 0) a selection keeps


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
    shape = _shape(e, "shape", f"tensor {name!r}")
    count = _elements(shape)
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
        scale = _shape(scale_entry, "shape", f"tensor {name!r} scale")
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
            if "layer_index" in e:
                p.layer_index = _layer_index(p, e)
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
            n = 4 * _elements(p.scale)
            if sizes[i] != n:
                raise MalformedFrameError(f"tensor {p.name!r}: scale buffer has {sizes[i]} bytes, its shape needs {n}")
            p.scale_buf = i
            i += 1
    return i


def _layer_index(p: _Entry, e: dict) -> np.ndarray:
    """(2.2, spec 10.2) A row group entry's ``layer_index``: ascending stored layers (dim 0) it keeps."""
    li = _column(f"tensor {p.name!r}", e, "layer_index", None)
    if len(li) and (int(li[0]) < 0 or int(li[-1]) >= p.shape[0] or (len(li) > 1 and int(np.diff(li).min()) <= 0)):
        raise MalformedFrameError(f"tensor {p.name!r}: layer_index must ascend within 0..{p.shape[0] - 1}")
    if p.layers and len(p.layers) != p.shape[0]:
        raise MalformedFrameError(f"tensor {p.name!r}: layer_index needs one of 'layers' per stored layer")
    return li.astype(np.intp)


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
        if ("row0" in g or "row_index" in g) != ("stored_rows" in g):
            raise MalformedFrameError(f"{kind}: a group has stored_rows with row0 or row_index, or none of them")
        if "row0" in g:
            row0 = _column(kind, g, "row0", len(requests))
            stored = g.get("stored_rows")
            if type(stored) is not int or stored < 0:
                raise MalformedFrameError(f"{kind}: a group with row0 needs stored_rows, an int >= 0")
            if len(row0) and (int(row0.min()) < 0 or int((row0 + rows).max()) > stored):
                raise MalformedFrameError(f"{kind}: row0 + rows runs past the group's {stored} stored rows")
            take = np.concatenate([np.arange(a, a + c, dtype=np.intp) for a, c in zip(row0.tolist(), rows.tolist())]
                                  ) if len(row0) else np.zeros(0, dtype=np.intp)
        if "row_index" in g:  # (2.2) the stored row of each row: a selection of some positions (spec 10.2)
            stored = g.get("stored_rows")
            if "row0" in g or type(stored) is not int or stored < 0:
                raise MalformedFrameError(f"{kind}: a group with row_index needs stored_rows (an int >= 0), no row0")
            take = _column(kind, g, "row_index", n).astype(np.intp)
            if n and (int(take.min()) < 0 or int(take.max()) >= stored):
                raise MalformedFrameError(f"{kind}: row_index names a row outside the group's {stored} stored rows")
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
        shape = _shape(v, "shape", f"{kind}: value {name!r}")
        if not shape or shape[0] != n:
            raise MalformedFrameError(f"{kind}: value {name!r} has shape {list(shape)}, needs [{n}, ...]")
        data = v.get("data")
        count = _elements(shape)
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
