"""Ring references in headers (spec section 9): what a message holds in a producer's ring, and losing it.

For the broker's budgets (``shm_extent``), for receivers that keep bytes (``inline_shm``: a recorder, a peer on
another host) and for the gaps that replace a message whose ring bytes were overwritten (``shm_loss_gaps``).
"""

from __future__ import annotations

import time
from typing import Any, Sequence

import msgpack
import numpy as np

from mia_stream.errors import MalformedFrameError, ShmOverrunError
from mia_stream.schemas._batches import GapBatch
from mia_stream.schemas._codec import compact
from mia_stream.schemas._framing import _I64, SHM_RING_KEY, _buffer_of, _len, _SIZED, _unpack_header
from mia_stream.schemas._kinds import COLUMNAR_KINDS
from mia_stream.schemas._messages import GapNotice
from mia_stream.schemas._oob import BufferSource

_SHM_MARK = msgpack.packb(SHM_RING_KEY)  # how the key looks inside a packed header


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
                    n += _layer_share(e, size if kept == stored else size * kept // max(stored, 1))
                    end = max(end, pos + size)
    return (name, oldest, n, end) if oldest is not None else None


def _layer_share(e: dict, size: int) -> int:
    """(2.2) Of an entry with ``layer_index`` (a selection of some of its stored layers), those layers' share."""
    li = e.get("layer_index")
    if type(li) is not bytes:
        return size
    return size * (len(li) // 8) // max(e["shape"][0], 1)


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
