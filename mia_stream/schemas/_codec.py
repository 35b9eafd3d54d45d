"""Encode typed messages to ZeroMQ multipart frames and back: ``[topic, msgpack header, *tensor buffers]``.

The entry points, dispatching by kind: ``encode``, ``decode``, ``decode_header`` (validation only, the broker's)
and ``compact``. The work is split by concern, one way (each imports only those before it):
``_framing`` (frames, header map, batches) <- ``_validate`` (every header rule) <- ``_entries`` (tensor
entries) <- ``_columnar`` (columnar bodies, narrowing) <- this module <- ``_rings`` (ring references).
"""

from __future__ import annotations

from typing import Any, Sequence

import msgpack

from mia_stream.errors import MalformedFrameError, OversizedMessageError
from mia_stream.schemas._batches import GapBatch, StepBatch
from mia_stream.schemas._columnar import _decode_columnar, _encode_columnar
from mia_stream.schemas._entries import _decode_tensors, _encode_tensor, _ring_of
from mia_stream.schemas._framing import (_SIZED, DEFAULT_MAX_MESSAGE_BYTES, SHM_RING_KEY, _buffer_of, _col,
                                         _frame_sizes, _len, _unpack_header)
from mia_stream.schemas._framing import batch_header  # noqa: F401  (imported from here by the broker)
from mia_stream.schemas._kinds import COLUMNAR_KINDS, MESSAGE_TYPES
from mia_stream.schemas._messages import SCHEMA_VERSION, Message, TensorFrame
from mia_stream.schemas._oob import BufferSink, BufferSource
from mia_stream.schemas._validate import (_FIELDS, _Entry, _check_columnar, _check_fields, _check_gap_batch,
                                          _check_tensor_entries)


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
