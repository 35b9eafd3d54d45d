"""Framing shared by every codec module: frame sizes, the header map and its version, int64 columns, batches.

A message is ``[topic, msgpack header, *buffers]`` (spec sections 2-3); a batch (spec section 8) is one zmq
multipart message carrying several messages' frames unchanged. Nothing here knows a message kind's fields.
"""

from __future__ import annotations

from typing import Any, Sequence

import msgpack
import numpy as np

from mia_stream.errors import MalformedFrameError, OversizedMessageError, SchemaVersionError, WireError
from mia_stream.schemas._messages import SCHEMA_VERSION

DEFAULT_MAX_MESSAGE_BYTES = 1 << 30  # 1 GiB: larger messages are refused (broker sets zmq MAXMSGSIZE too)
_MAX_HEADER_BYTES = 16 << 20
SHM_RING_KEY = "shm_ring"  # header field: the ring that holds the buffers of entries with a "shm" position
LEGACY_MAJOR = 1  # recordings of schema 1.x stay readable: every 1.x kind is a 2.0 kind with the same fields
_I64 = np.dtype("<i8")


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


def _col(values: Any) -> bytes:
    """A numeric column on the wire: little-endian int64, as msgpack bin."""
    return np.ascontiguousarray(values, dtype=_I64).tobytes()


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
