"""What crosses the NATS hop: subjects, one message's frames packed into one payload, chunks under the server's
max payload, and the kinds a bridge may forward.

Subjects (``PREFIX`` = ``mia`` by default; ``ENGINE`` a token naming one engine's bridge); the JetStream stream
stores ``PREFIX.>``:
  ``PREFIX.ENGINE.s.REQUEST``  a request's starts (a late joiner reads these alone to learn the live requests)
  ``PREFIX.ENGINE.e.REQUEST``  its ends
  ``PREFIX.ENGINE.r.REQUEST``  its other messages (tensors, tokens, gap, analysis)
  ``PREFIX.ENGINE.b.KIND``     columnar messages naming many requests (step_batch, token_batch, analysis_batch,
                               gap_batch): one per engine step, not one per request
  ``PREFIX-steer.ENGINE``      steering commands (core NATS request/reply, outside the stream)

``REQUEST`` is the request id itself when it is a safe subject token (letters, digits, ``_``, ``-``, not
starting with ``~``), else ``~`` and the hex of its UTF-8 bytes, so any id maps to one token and back.

Payload: the message's ZeroMQ frames as the ``mia_stream/multipart`` encoding of recordings (u32le count, u32le
lengths, the frames): the same wire bytes as on the local bus. A payload over the chunk size is published as
``n`` chunks under the same subject, each with the header ``Mia-Chunk: ID I N``.
"""

from __future__ import annotations

import re
import struct
from typing import Any, Sequence

from mia_stream.errors import BridgeError, MalformedFrameError

DEFAULT_PREFIX = "mia"
DEFAULT_STREAM = "MIA"
CHUNK_HEADER = "Mia-Chunk"
MSG_ID_HEADER = "Nats-Msg-Id"  # JetStream drops a retried publish it already stored (duplicate window)
HEADER_ROOM = 1024  # payload bytes left for headers under the server's max payload

# The kinds a bridge may forward (``--kinds``) and the wire kinds each covers. Starts, ends and gaps always
# cross: without them a consumer cannot sequence or close a stream.
KIND_GROUPS = {
    "tokens": ("tokens", "token_batch"),
    "analysis": ("analysis", "analysis_batch"),
    "tensors": ("tensors", "step_batch"),
}
ALWAYS = ("start", "end", "gap", "gap_batch")
DEFAULT_KINDS = ("tokens", "analysis")
COLUMNAR = ("step_batch", "token_batch", "analysis_batch", "gap_batch")

# The consumer's reorder tolerance for a stream read from NATS: a message the bridge published again after a
# failover lands after later ones (by up to its ack timeout plus the election), so a hole waits this long before
# the consumer names it itself; the bridge names what it gave up on.
REORDER_OPTIONS = {"reorder_window": 10_000, "reorder_timeout_s": 15.0}

_SAFE = re.compile(r"[A-Za-z0-9_-]+")


def check_token(value: str, what: str) -> str:
    """``value`` when it is one safe subject token, else a BridgeError naming ``what``."""
    if not isinstance(value, str) or not _SAFE.fullmatch(value):
        raise BridgeError(f"{what} {value!r}: use letters, digits, '_' and '-' only (one NATS subject token)")
    return value


def wire_kinds(kinds: Sequence[str]) -> frozenset:
    """The wire kinds a bridge forwards for the ``--kinds`` names ``kinds``."""
    out = set(ALWAYS)
    for k in kinds:
        if k not in KIND_GROUPS:
            raise BridgeError(f"--kinds: unknown kind {k!r}; choose from {sorted(KIND_GROUPS)}")
        out.update(KIND_GROUPS[k])
    return frozenset(out)


def request_token(request_id: str) -> str:
    if _SAFE.fullmatch(request_id) and not request_id.startswith("~"):
        return request_id
    return "~" + request_id.encode("utf-8").hex()


def request_from_token(token: str) -> str:
    if token.startswith("~"):
        return bytes.fromhex(token[1:]).decode("utf-8")
    return token


_PER_REQUEST = {"start": "s", "end": "e"}


def request_subject(prefix: str, engine: str, request_id: str, kind: str = "") -> str:
    return f"{prefix}.{engine}.{_PER_REQUEST.get(kind, 'r')}.{request_token(request_id)}"


def batch_subject(prefix: str, engine: str, kind: str) -> str:
    return f"{prefix}.{engine}.b.{kind}"


def steer_subject(prefix: str, engine: str) -> str:
    return f"{prefix}-steer.{engine}"


def stream_subjects(prefix: str) -> list[str]:
    """What the JetStream stream stores: every engine's subjects (steering is outside it)."""
    return [f"{prefix}.>"]


def engine_filters(prefix: str, engines: Sequence[str] | None, part: str = "*") -> list[str]:
    """Consumer filter subjects: the ``part`` subjects (``s``, ``e``, ``*``...) of ``engines`` (None: all)."""
    return [f"{prefix}.{e}.{part}.*" for e in (engines or ["*"])]


def parse_subject(subject: str) -> tuple[str, str, str]:
    """``(engine, part, name)`` of a stream subject ``PREFIX.ENGINE.PART.NAME``."""
    parts = subject.rsplit(".", 3)
    if len(parts) != 4:
        raise MalformedFrameError(f"subject {subject!r} is not PREFIX.ENGINE.PART.NAME")
    return parts[1], parts[2], parts[3]


def pack(frames: Sequence[Any]) -> bytes:
    """The ``mia_stream/multipart`` encoding: u32le count, u32le lengths, frames concatenated (one copy)."""
    views = [memoryview(getattr(f, "buffer", f)).cast("B") for f in frames]
    head = struct.pack(f"<{len(views) + 1}I", len(views), *(len(v) for v in views))
    return b"".join([head, *views])


def unpack(data: bytes | memoryview) -> list[memoryview]:
    """Inverse of ``pack`` (zero-copy views); MalformedFrameError when the lengths do not add up."""
    view = memoryview(data)
    if len(view) < 4:
        raise MalformedFrameError(f"a bridged payload of {len(view)} bytes has no frame count")
    (count,) = struct.unpack_from("<I", view, 0)
    offset = 4 + 4 * count
    if count > 1_000_000 or offset > len(view):
        raise MalformedFrameError(f"a bridged payload claims {count} frames but holds {len(view)} bytes")
    lengths = struct.unpack_from(f"<{count}I", view, 4)
    if offset + sum(lengths) != len(view):
        raise MalformedFrameError(f"bridged frame lengths sum to {sum(lengths)}, payload holds {len(view) - offset}")
    frames = []
    for n in lengths:
        frames.append(view[offset:offset + n])
        offset += n
    return frames


def chunks(payload: bytes, size: int) -> list[memoryview]:
    view = memoryview(payload)
    return [view[i:i + size] for i in range(0, len(view), size)] or [view]


class Reassembler:
    """Chunks back into payloads, per (subject, chunk id). A chunked message whose chunks stop coming (one was
    refused or lost) is dropped when a later message of its subject completes; the consumer's sequencer then
    names its seqs missing (and the bridge sent a gap for it)."""

    def __init__(self, max_pending: int = 64):
        self.pending: dict[tuple[str, str], list] = {}
        self.max_pending = max_pending
        self.dropped = 0

    def add(self, subject: str, header: str, data: bytes) -> bytes | None:
        try:
            cid, i, n = header.split()
            i, n = int(i), int(n)
        except ValueError as e:
            raise MalformedFrameError(f"bad {CHUNK_HEADER} header {header!r}") from e
        key = (subject, cid)
        parts = self.pending.get(key)
        if parts is None:
            if i != 0:
                self.dropped += 1
                return None
            if len(self.pending) >= self.max_pending:
                self.pending.pop(next(iter(self.pending)))
                self.dropped += 1
            parts = self.pending[key] = []
        if i != len(parts):  # a chunk went missing: this message cannot be rebuilt
            self.pending.pop(key, None)
            self.dropped += 1
            return None
        parts.append(bytes(data))
        if len(parts) < n:
            return None
        self.pending.pop(key, None)
        return b"".join(parts)
