"""Encode typed messages to ZeroMQ multipart frames and back: ``[topic, msgpack header, *tensor buffers]``."""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Sequence

import msgpack

from mia_stream.errors import (MalformedFrameError, OversizedMessageError, SchemaVersionError, ShmOverrunError,
                               ShmUnavailableError, WireError)
from mia_stream.schemas._messages import MESSAGE_TYPES, SCHEMA_VERSION, GapNotice, Message, TensorFrame
from mia_stream.schemas._shm import ShmRingReader, ShmRingWriter
from mia_stream.schemas._tensors import (COMPRESSIONS, WIRE_DTYPES, Shard, Tensor, compress, crc32,
                                        decompress, verify_crc32)

DEFAULT_MAX_MESSAGE_BYTES = 1 << 30  # 1 GiB: larger messages are refused (broker sets zmq MAXMSGSIZE too)
_MAX_HEADER_BYTES = 16 << 20
SHM_RING_KEY = "shm_ring"  # header field: the ring that holds the buffers of entries with a "shm" position
_SHM_MARK = msgpack.packb(SHM_RING_KEY)  # how the key looks inside a packed header

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


def encode(msg: Message, *, compression: str = "none", checksum: bool = False,
           shm: ShmRingWriter | None = None) -> list[Any]:
    """Frames for ``socket.send_multipart(frames, copy=False)``: tensor buffers are not copied.

    ``compression`` ("none" | "lz4") and ``checksum`` (crc32 of the raw bytes) apply to every tensor
    whose ``meta`` does not override them. ``shm``: tensor buffers the ring takes (large ones) are copied
    into it and referenced from the header instead of sent (spec section 9).
    """
    header: dict[str, Any] = {"v": list(SCHEMA_VERSION), "kind": msg.KIND}
    buffers: list[Any] = []
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


def _encode_tensor(t: Tensor, compression: str, checksum: bool, buffers: list, shm: ShmRingWriter | None) -> dict:
    method = t.meta.get("compression", compression)
    raw = t.data
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
        buffers.append(memoryview(t.scale).cast("B"))
    extra = {k: v for k, v in t.meta.items() if k not in ("compression", "checksum")}
    if extra:
        entry["meta"] = extra
    return entry


def _unpack_header(buf: Any, nbytes: int) -> dict:
    """The header map of a message, with its size, msgpack form and major version checked."""
    if nbytes > _MAX_HEADER_BYTES:
        raise OversizedMessageError(f"header of {nbytes} bytes exceeds {_MAX_HEADER_BYTES}")
    try:
        header = msgpack.unpackb(buf, raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises many types (ExtraData, FormatError, ValueError, ...)
        raise MalformedFrameError(f"header is not valid msgpack: {type(e).__name__}: {e}") from None
    if not isinstance(header, dict):
        raise MalformedFrameError(f"header must be a msgpack map, got {type(header).__name__}")
    version = header.get("v")
    if (not isinstance(version, (list, tuple)) or len(version) != 2
            or not isinstance(version[0], int) or not isinstance(version[1], int)):
        raise MalformedFrameError(f"header field 'v' must be [major, minor], got {version!r}")
    if version[0] != SCHEMA_VERSION[0]:
        raise SchemaVersionError(
            f"schema major version {version[0]} is not supported by this decoder "
            f"(it speaks {SCHEMA_VERSION[0]}.x); upgrade mia_stream on this side")
    return header


def decode(frames: Sequence[Any], *, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
           verify: bool = True, shm: ShmRingReader | None = None) -> Message:
    """Decode ``[topic, header, *buffers]``; tensors view the received buffers without copying.

    Tensors carried in a producer's shared-memory ring are copied out of it through ``shm``. Raises a
    ``WireError`` subclass for anything that is not a valid message of a known major version (a
    ``SharedBufferError`` for ring bytes that cannot be read).
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
    header = _unpack_header(head, len(head) if type(head) in _SIZED else _len(head))
    kind = header.get("kind")
    cls = MESSAGE_TYPES.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise MalformedFrameError(f"unknown message kind {kind!r}; known: {sorted(MESSAGE_TYPES)}")
    missing = [n for n in _REQUIRED[kind] if n not in header]
    if missing:
        raise MalformedFrameError(f"{kind} header lacks required field(s) {missing}")
    fields = {n: header[n] for n in _FIELDS[kind] if n in header}
    buffers = [_buffer_of(f) for f in frames[2:]] if len(frames) > 2 else []
    if cls is TensorFrame:
        fields["tensors"] = _decode_tensors(header.get("tensors", []), buffers, verify, max_message_bytes,
                                            _ring_of(header, shm))
    elif buffers:
        raise MalformedFrameError(f"{kind} message carries {len(buffers)} unexpected buffer frame(s)")
    try:
        msg = cls(**fields)
    except TypeError as e:
        raise MalformedFrameError(f"{kind} header: {e}") from None
    _check_types(msg)
    if isinstance(msg, GapNotice):
        _check_gap_ranges(msg.missing)
    return msg


def _check_gap_ranges(missing: list) -> None:
    for r in missing:
        if (not isinstance(r, (list, tuple)) or len(r) != 2
                or not all(isinstance(x, int) and not isinstance(x, bool) for x in r) or r[0] > r[1]):
            raise MalformedFrameError(f"gap.missing must hold [first_seq, last_seq] int ranges, got {r!r}")


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
_NO_LAYERS: list = []


def _exact_int_tuple(values: Any) -> tuple[int, ...] | None:
    """``tuple(values)`` when it is a list of exact ints, else None (then ``_int_list`` decides)."""
    if type(values) is not list:
        return None
    for x in values:
        if type(x) is not int:
            return None
    return tuple(values)


def _int_list(e: dict, key: str, default: Any = dataclasses.MISSING) -> tuple[int, ...]:
    values = _entry_field(e, key, list, default)
    if not all(isinstance(x, int) and not isinstance(x, bool) for x in values):
        raise MalformedFrameError(f"tensor entry field {key!r} must be a list of ints, got {values!r}")
    return tuple(values)


def _ring_of(header: dict, shm: ShmRingReader | None):
    """``(reader, ring name)`` for a header that references a ring, else None."""
    name = header.get(SHM_RING_KEY)
    if name is None:
        return None
    if type(name) is not str:
        raise MalformedFrameError(f"header field {SHM_RING_KEY!r} must be str, got {type(name).__name__}")
    if shm is None:
        raise ShmUnavailableError(f"this message's tensors are in the shared-memory ring {name!r}; decode it "
                                  "with shm=ShmRingReader() on the producer's host")
    return shm, name


def _decode_tensors(entries: Any, buffers: list, verify: bool, max_message_bytes: int,
                    ring: tuple | None = None) -> list[Tensor]:
    if not isinstance(entries, list):
        raise MalformedFrameError("'tensors' must be a list")
    out, i = [], 0
    for e in entries:
        if not isinstance(e, dict):
            raise MalformedFrameError(f"bad tensor entry {e!r}: must be a map")
        # type(x) is T is the common case (msgpack builds exact types); anything else takes the checking path
        name = e.get("name")
        if type(name) is not str:
            name = _entry_field(e, "name", str)
        dtype = e.get("dtype")
        if type(dtype) is not str:
            dtype = _entry_field(e, "dtype", str)
        shape = _exact_int_tuple(e.get("shape"))
        if shape is None:
            shape = _int_list(e, "shape")
        for d in shape:
            if d < 0:
                raise MalformedFrameError(f"tensor {name!r}: negative dimension in shape {list(shape)}")
        layers = _exact_int_tuple(e.get("layers", _NO_LAYERS))
        if layers is None:
            layers = _int_list(e, "layers", [])
        method = e.get("compression", "none")
        if type(method) is not str:
            method = _entry_field(e, "compression", str, "none")
        nbytes, raw_nbytes = e.get("nbytes"), e.get("raw_nbytes")
        if type(nbytes) is not int or type(raw_nbytes) is not int:
            nbytes, raw_nbytes = _entry_field(e, "nbytes", int), _entry_field(e, "raw_nbytes", int)
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
        if method == "none" and raw_nbytes != nbytes:
            raise MalformedFrameError(f"tensor {name!r}: uncompressed but raw_nbytes {raw_nbytes} != nbytes {nbytes}")
        if "shm" in e:
            pos = e["shm"]
            if type(pos) is not int or ring is None:
                raise MalformedFrameError(f"tensor {name!r}: 'shm' must be an int position in the header's "
                                          f"{SHM_RING_KEY!r}, got {pos!r}")
            payload = ring[0].read(ring[1], pos, nbytes)
        else:
            if i >= len(buffers):
                raise MalformedFrameError(f"tensor {name!r}: its buffer frame is missing")
            payload = buffers[i]
            i += 1
        if _len(payload) != nbytes:
            raise MalformedFrameError(f"tensor {name!r}: buffer has {_len(payload)} bytes, header says {nbytes}")
        data = decompress(payload, method, raw_nbytes)
        if verify and "crc32" in e:
            verify_crc32(name, data, _entry_field(e, "crc32", int))
        scale = None
        if "scale" in e:
            import numpy as np

            scale_entry = _entry_field(e, "scale", dict)
            sshape = _int_list(scale_entry, "shape")
            if scale_entry.get("dtype", "float32") != "float32":
                raise MalformedFrameError(f"tensor {name!r}: scale dtype must be float32, got {scale_entry['dtype']!r}")
            if i >= len(buffers):
                raise MalformedFrameError(f"tensor {name!r}: its scale buffer is missing")
            try:
                scale = np.frombuffer(buffers[i], dtype="<f4").reshape(sshape)
            except ValueError as err:
                raise MalformedFrameError(f"tensor {name!r}: bad scale buffer: {err}") from None
            i += 1
        t = Tensor(name, dtype, shape, data, layers,
                   Shard.from_wire(e["shard"]) if e.get("shard") else None, scale, dict(meta))
        if (type(data) is bytes or type(data) is memoryview and data.contiguous) and dtype in WIRE_DTYPES:
            # Tensor.raw()'s size check without building the array (same error)
            want = WIRE_DTYPES[dtype][1]
            for d in shape:
                want *= d
            have = data.nbytes if type(data) is memoryview else len(data)
            if have != want:
                raise MalformedFrameError(
                    f"tensor {name!r}: {have} bytes for shape {shape} {dtype} (want {want})")
        else:
            t.raw()  # validates size against shape and dtype
        out.append(t)
    if i != len(buffers):
        raise MalformedFrameError(f"{len(buffers) - i} buffer frame(s) not described by the header")
    return out


_TYPE_CHECKS = {
    "str": lambda v: isinstance(v, str),
    "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "bool": lambda v: isinstance(v, bool),
    "list": lambda v: isinstance(v, list),
    "dict": lambda v: isinstance(v, dict),
    "str | None": lambda v: v is None or isinstance(v, str),
    "int | None": lambda v: v is None or (isinstance(v, int) and not isinstance(v, bool)),
}
# The exact types msgpack gives for each annotation: one set lookup per field in the common case.
_EXACT_TYPES = {"str": {str}, "int": {int}, "bool": {bool}, "list": {list}, "dict": {dict},
                "str | None": {str, type(None)}, "int | None": {int, type(None)}}
# Per kind, the (field, exact types, annotation, check) tuples, built once (other annotations are not checked).
_CHECKS = {kind: [(name, frozenset(_EXACT_TYPES[str(f.type)]), str(f.type), _TYPE_CHECKS[str(f.type)])
                  for name, f in fields.items() if str(f.type) in _TYPE_CHECKS]
           for kind, fields in _FIELDS.items()}


def _check_types(msg: Message) -> None:
    for name, exact, ann, ok in _CHECKS[msg.KIND]:
        value = getattr(msg, name)
        if type(value) not in exact and not ok(value):
            raise MalformedFrameError(f"{msg.KIND}.{name} must be {ann}, got {type(value).__name__}")


_ROUTING_TYPES = (("request_id", str), ("producer_id", str), ("epoch", int), ("seq", int))
_ROUTING = {kind: [(name, typ) for name, typ in _ROUTING_TYPES if name in fields] for kind, fields in _FIELDS.items()}


def decode_header(frames: Sequence[Any], *, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> dict:
    """Validate a message's framing and header without building tensors; return the header map.

    For the broker's hot path: it checks what ``decode`` checks about the header and the buffer sizes
    (version, kind, required fields, routing field types, one buffer per tensor of the declared size)
    but never touches tensor bytes. Raises the same ``WireError`` subclasses as ``decode``.
    """
    n = len(frames)
    if n < 2:
        raise MalformedFrameError(f"a message has at least 2 frames (topic, header); got {n}")
    sizes = [len(f) if type(f) in _SIZED else _len(_buffer_of(f)) for f in frames]
    total = sum(sizes)
    if total > max_message_bytes:
        raise OversizedMessageError(f"message of {total} bytes exceeds the limit of {max_message_bytes}")
    head = frames[1]
    header = _unpack_header(head if type(head) in _SIZED else _buffer_of(head), sizes[1])  # msgpack reads a Frame
    kind = header.get("kind")
    if not isinstance(kind, str) or kind not in MESSAGE_TYPES:
        raise MalformedFrameError(f"unknown message kind {kind!r}; known: {sorted(MESSAGE_TYPES)}")
    for name in _REQUIRED[kind]:
        if name not in header:
            raise MalformedFrameError(f"{kind} header lacks required field {name!r}")
    for name, typ in _ROUTING[kind]:
        if name in header:
            value = header[name]
            if type(value) is not typ and (not isinstance(value, typ) or isinstance(value, bool)):
                raise MalformedFrameError(f"{kind}.{name} must be {typ.__name__}, got {type(value).__name__}")
    if kind == "tensors":
        ring = header.get(SHM_RING_KEY)
        if ring is not None and type(ring) is not str:
            raise MalformedFrameError(f"header field {SHM_RING_KEY!r} must be str, got {type(ring).__name__}")
        _check_tensor_entries(header.get("tensors", []), sizes[2:], ring is not None)
    elif n > 2:
        raise MalformedFrameError(f"{kind} message carries {n - 2} unexpected buffer frame(s)")
    return header


def _check_tensor_entries(entries: Any, sizes: list[int], has_ring: bool = False) -> None:
    if not isinstance(entries, list):
        raise MalformedFrameError("'tensors' must be a list")
    i = 0
    for e in entries:
        try:
            name, dtype, method = e["name"], e["dtype"], e.get("compression", "none")
            nbytes, raw_nbytes = int(e["nbytes"]), int(e["raw_nbytes"])
            count = 1
            for s in e["shape"]:
                if int(s) < 0:
                    raise ValueError("negative dimension")
                count *= int(s)
        except (KeyError, TypeError, ValueError, AttributeError) as err:
            raise MalformedFrameError(f"bad tensor entry {e!r}: {err}") from None
        if dtype not in WIRE_DTYPES:
            raise MalformedFrameError(f"tensor {name!r}: unknown dtype {dtype!r}")
        if method not in COMPRESSIONS:
            raise MalformedFrameError(f"tensor {name!r}: unknown compression {method!r}")
        if raw_nbytes != count * WIRE_DTYPES[dtype][1] or (method == "none" and nbytes != raw_nbytes):
            raise MalformedFrameError(f"tensor {name!r}: sizes do not match shape and dtype")
        if "shm" in e:
            pos = e["shm"]
            if not has_ring or type(pos) is not int or pos < 0:
                raise MalformedFrameError(f"tensor {name!r}: 'shm' must be a position in the header's ring")
        elif i >= len(sizes) or sizes[i] != nbytes:
            raise MalformedFrameError(f"tensor {name!r}: buffer missing or not {nbytes} bytes")
        else:
            i += 1
        if "scale" in e:
            i += 1
            if i > len(sizes):
                raise MalformedFrameError(f"tensor {name!r}: its scale buffer is missing")
    if i != len(sizes):
        raise MalformedFrameError(f"{len(sizes) - i} buffer frame(s) not described by the header")


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
    """``(ring, lowest position, bytes, end)`` of a decoded header's ring-held buffers, or None without any.
    The lowest position is the first to be overwritten; the bytes count as the message's size in every
    budget; ``end`` is the highest position + nbytes (how far a receiver of this message has the ring)."""
    name = header.get(SHM_RING_KEY)
    if type(name) is not str or header.get("kind") != "tensors":
        return None
    oldest, n, end = None, 0, 0
    for e in header.get("tensors", ()):
        if isinstance(e, dict) and type(e.get("shm")) is int:
            pos = e["shm"]
            oldest = pos if oldest is None else min(oldest, pos)
            size = e.get("nbytes")
            if type(size) is int:
                n += size
                end = max(end, pos + size)
    return (name, oldest, n, end) if oldest is not None else None


def shm_loss_reason(error: Exception) -> str:
    """The gap reason for a message whose ring-held bytes could not be read."""
    return "shm_overrun" if isinstance(error, ShmOverrunError) else "shm_unavailable"


def shm_loss_gap(header: dict, error: Exception, origin: str) -> GapNotice:
    """The GapNotice that replaces a message (``header``) whose ring-held bytes could not be read."""
    seq, epoch = header.get("seq", 0), header.get("epoch")
    return GapNotice(str(header.get("request_id", "")), str(header.get("producer_id", "")),
                     epoch if type(epoch) is int else 0, [[seq, seq]], shm_loss_reason(error), origin,
                     time.time_ns())


def inline_shm(frames: Sequence[Any], shm: ShmRingReader) -> list[Any]:
    """The same message with its ring-held buffers copied in as frames (for a recorder, a peer on another
    host, anything that keeps the bytes). Raises ``SharedBufferError`` when the ring cannot give them."""
    head = frames[1]
    header = _unpack_header(head if type(head) in _SIZED else _buffer_of(head), _len(_buffer_of(head)))
    name = header.pop(SHM_RING_KEY, None)
    if name is None:
        return list(frames)
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
