"""Shared-memory rings: large tensor buffers skip the broker (spec: docs/wire-format.md, section 9).

A producer on the broker's host writes each large tensor buffer into its own ring, a file in ``/dev/shm``
(mode 0600), and the message carries the buffer's position instead of its bytes. The broker forwards only
the small message; a consumer on the same host reads the bytes from the ring (a view, or a copy). That takes
the broker's copy in and copy out off every large frame (the bus did 4 copies per frame where one pyzmq hop
does 2). The producer's engine fills its host ring (producer/_host_ring.py) by DMA with this layout itself
(``create_ring_file``), so its rows reach consumers with no copy on the host.

The ring never blocks its writer: it overwrites its oldest bytes. So that what it overwrites is not still on
its way to the broker, the broker stores in the header how far it has received (``received``), and the
producer drops a frame at its source, counted and announced, rather than run more than a bound ahead of it
(the publication limit of Aeron's log buffers; ``FramePublisher(shm_ahead_bytes=...)``). A reader checks
*after* its copy that the writer has not reserved past that region since (``reserved <= pos + size``);
otherwise the bytes may be torn and the read fails with ``ShmOverrunError``, which consumers report as a
gap. Positions are absolute byte counts (u64), so a stale position is always recognised. The check relies
on stores becoming visible in program order (x86-64 TSO): the writer stores ``reserved`` before it copies.

Zero-copy readers (``ShmRingReader(zero_copy=True)``, what ``BrokerClient`` makes by default: setting
``MIA_STREAM_SHM_ZERO_COPY``) get ``view``: a read-only numpy view of the mapping instead of a copy, checked
like ``read`` when it is made, and a ``RingLease`` (``take_lease``) of the message's extent that says later
whether the writer has reserved past it since (``intact``): the consumer SDK checks it when it hands an event
out and again when the event is released (docs/wire-format.md 9.4). Buffers start 64-byte aligned, so such
views are aligned for every wire dtype.

A ring belongs to the producer that made it. Its header holds ``owner``, the SHA-256 of a random secret only
the writer knows; the writer presents the secret to its broker (``ownership_proof``, in its heartbeats), and
the broker accepts ring references, notes ``received`` and takes a handover only from the peer that proved it
(a peer that can read the ring, as every consumer can, sees only the digest).

Layout: a 4096-byte header (``magic``, ``size``, ``reserved``, ``pid``, ``handed_over``, ``received``:
little-endian u64s; ``owner``: 32 bytes) then ``size`` bytes of data; the buffer at position ``pos`` lies at
``4096 + pos % size`` and never wraps (the writer skips to the next lap instead).
"""

from __future__ import annotations

import hashlib
import hmac
import mmap
import os
import secrets
import struct
import time
import uuid
import weakref

import numpy as np

from mia_stream.errors import MalformedFrameError, ShmOverrunError, ShmUnavailableError
# the heartbeat keys of the ring handshake (spec section 9), defined in bus.session; the broker imports them here
from mia_stream.bus.session import (SHM_RECEIVED_KEY, SHM_RING_CLOSED_KEY, SHM_RING_PROOF_KEY,  # noqa: F401
                                    SHM_RING_TAKEN_KEY)
from mia_stream.schemas._oob import RING_NAME, is_ring_name

SHM_DIR = "/dev/shm"
DEFAULT_RING_BYTES = 256 << 20
DEFAULT_MIN_BYTES = 16 << 10  # smaller buffers stay inline (16 KiB frames: ring vs inline in docs/benchmarks.md)
_ALIGN = 64  # buffer start: a consumer's zero-copy view of a float32 (or int8 then float32) tensor stays aligned
_MAGIC = b"MIASHM01"
_HEADER = 4096
_RESERVED_AT = 16
_HANDED_OVER_AT = 32  # u64 CLOCK_REALTIME ns; 0 while its producer has it
_RECEIVED_AT = 40  # u64: the end of the newest payload the broker has received (the broker writes it)
_OWNER_AT, _OWNER_LEN = 48, 32  # SHA-256 of the writer's secret: what its ownership proof must hash to
HANDOVER_KEEP_S = 60.0  # a handed-over ring outlives its writer's pid this long before a sweep may remove it
_U64 = struct.Struct("<Q")
# Page tables filled at map time: touching a fresh page of a mapping otherwise costs a fault per 4 KiB, which
# on the first pass over a ring made the reader fall behind the writer (measured: docs/benchmarks.md)
_MAP_FLAGS = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)


def shm_available() -> bool:
    return os.path.isdir(SHM_DIR) and os.access(SHM_DIR, os.W_OK)


def shm_reachable(endpoint: str) -> bool:
    """Whether a peer of ``endpoint`` shares this host's rings: an ipc endpoint, with /dev/shm usable."""
    return endpoint.startswith("ipc://") and shm_available()


def create_ring_file(size: int, directory: str = SHM_DIR) -> tuple[int, str, bytes]:
    """A new ring file of ``size`` data bytes in ``directory`` with its header written (magic, size, pid, the
    owner digest of a fresh secret): ``(descriptor, name, secret)``. Its pages are allocated now: a store into a
    page a full tmpfs cannot back would be a SIGBUS; here it is an OSError (ENOSPC). A writer that is not a
    ``ShmRingWriter`` (the producer's host ring, which its engine fills by DMA) keeps the header protocol by
    storing ``reserved`` (``RESERVED_AT``) before it writes a region, and reads ``received`` (``RECEIVED_AT``)."""
    sweep_stale_rings(directory)
    name = f"mia-stream-ring-{os.getpid()}-{uuid.uuid4().hex[:12]}"
    path = os.path.join(directory, name)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    secret = secrets.token_bytes(16)  # never written anywhere readers can see: only its digest is
    try:
        os.posix_fallocate(fd, 0, _HEADER + size)
        head = bytearray(_OWNER_AT + _OWNER_LEN)
        head[:8] = _MAGIC
        _U64.pack_into(head, 8, size)
        _U64.pack_into(head, 24, os.getpid())
        head[_OWNER_AT:] = hashlib.sha256(secret).digest()
        os.pwrite(fd, bytes(head), 0)
    except BaseException:
        os.close(fd)
        _unlink(path)
        raise
    return fd, name, secret


RESERVED_AT, RECEIVED_AT, HANDED_OVER_AT, DATA_AT = _RESERVED_AT, _RECEIVED_AT, _HANDED_OVER_AT, _HEADER


def ownership_proof(name: str, secret: bytes) -> dict:
    """What a ring's writer presents to its broker (heartbeat stats key ``SHM_RING_PROOF_KEY``)."""
    return {"ring": name, "secret": secret.hex()}


def unlink_ring(name: str, directory: str = SHM_DIR) -> None:
    if is_ring_name(name):
        _unlink(os.path.join(directory, name))


class ShmRingWriter:
    """The producer's ring. ``put(buffer)`` -> its position, or None for a buffer that stays inline."""

    def __init__(self, size: int = DEFAULT_RING_BYTES, min_bytes: int = DEFAULT_MIN_BYTES, directory: str = SHM_DIR):
        self.size = int(size)
        self.min_bytes = int(min_bytes)
        self.max_bytes = self.size // 4  # a buffer this large would evict most of what is in flight
        # OSError (e.g. ENOSPC: a full /dev/shm) reaches the caller, which then sends inline
        fd, self.name, self._secret = create_ring_file(self.size, directory)
        self.path = os.path.join(directory, self.name)
        try:
            self._mm = mmap.mmap(fd, _HEADER + self.size, flags=_MAP_FLAGS)
        except BaseException:
            _unlink(self.path)
            raise
        finally:
            os.close(fd)
        self._view = memoryview(self._mm)
        self._reserved = _counter(self._mm)
        self._received = _counter(self._mm, _RECEIVED_AT)
        self._unlink_at_exit = weakref.finalize(self, _unlink, self.path)  # a writer never closed
        self.written = 0  # absolute position of the next buffer
        self.buffers = 0
        self.bytes = 0

    def put(self, buf) -> int | None:
        """Copy ``buf`` (bytes-like) into the ring; its absolute position, or None when it stays inline."""
        mv = buf if type(buf) is memoryview else memoryview(buf)
        if mv.ndim != 1 or mv.itemsize != 1:
            mv = mv.cast("B")
        n = mv.nbytes
        if n < self.min_bytes or n > self.max_bytes or self._view is None:
            return None
        size = self.size
        pos = -(-self.written // _ALIGN) * _ALIGN
        offset = pos % size
        if offset + n > size:  # never wrap a buffer: start the next lap
            pos += size - offset
            offset = 0
        self._reserved[0] = pos + n  # before the copy: readers of older bytes see it
        self._view[_HEADER + offset:_HEADER + offset + n] = mv
        self.written = pos + n
        self.buffers += 1
        self.bytes += n
        return pos

    def ownership_proof(self) -> dict:
        """What this ring's writer presents to its broker (heartbeat stats key ``SHM_RING_PROOF_KEY``) so that
        the broker accepts this ring's references from it and from no other peer."""
        return ownership_proof(self.name, self._secret)

    @property
    def received(self) -> int:
        """How far the broker has received this ring's payloads (the end position of the newest one; 0 until
        a broker that keeps the field has received one)."""
        return int(self._received[0]) if self._received is not None else 0

    def mark_handed_over(self) -> None:
        """Stamp the header's ``handed_over`` time: the broker removes this ring after its grace, and until
        ``HANDOVER_KEEP_S`` has passed no sweep removes it for its writer's pid being gone."""
        if self._view is not None:
            _U64.pack_into(self._mm, _HANDED_OVER_AT, time.time_ns())

    def close(self, unlink: bool = True) -> None:
        """Unmap; ``unlink`` removes the file (readers that mapped it keep reading until they unmap)."""
        if self._view is None:
            return
        self._view.release()
        self._view = None
        self._reserved = self._received = None
        self._mm.close()
        if unlink:
            self._unlink_at_exit()
        else:
            self._unlink_at_exit.detach()


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _counter(mm: mmap.mmap, offset: int = _RESERVED_AT) -> np.ndarray:
    """A header field as a one-element u64 array over the mapping: numpy reads and writes an aligned element
    with one 8-byte access, where ``struct.pack_into`` stores byte by byte and a reader can see it torn."""
    return np.frombuffer(mm, dtype="<u8", count=1, offset=offset)


class _MappedRing:
    __slots__ = ("mm", "size", "reserved", "received", "gone_since")

    def __init__(self, mm: mmap.mmap, size: int, writable: bool):
        self.mm, self.size, self.reserved = mm, size, _counter(mm)
        self.received = _counter(mm, _RECEIVED_AT) if writable else None
        self.gone_since = 0.0  # when its file was first seen removed (its producer closed or died)

    def close(self) -> None:
        reserved, received = self.reserved, self.received
        self.reserved = self.received = None  # the arrays hold the mapping's buffer: released first, or
        try:
            self.mm.close()  # close() refuses
        except BufferError:  # zero-copy views a consumer still holds: it stays mapped until they are gone
            self.reserved, self.received = reserved, received


class RingLease:
    """The extent ``[lo, hi)`` of ring ``name`` that a message's zero-copy views cover: ``intact()`` says whether
    the writer has not reserved past ``lo`` + the ring's size since, i.e. whether the views still hold the bytes
    the message referenced (the writer stores ``reserved`` before it copies, so a view is trusted only as long
    as this holds)."""

    __slots__ = ("ring", "name", "lo", "hi")

    def __init__(self, ring: _MappedRing, name: str, lo: int, hi: int):
        self.ring, self.name, self.lo, self.hi = ring, name, lo, hi

    def intact(self) -> bool:
        reserved = self.ring.reserved
        return reserved is None or int(reserved[0]) <= self.lo + self.ring.size

    def lag(self) -> float:
        """How far the writer is past ``lo``, in ring sizes (> 1: overwritten)."""
        reserved = self.ring.reserved
        return 0.0 if reserved is None else (int(reserved[0]) - self.lo) / self.ring.size


def ring_lease(msg: object) -> RingLease | None:
    """The lease of a message a zero-copy reader decoded (its tensors view a ring), else None."""
    return getattr(msg, "_ring_lease", None)


class ShmRingReader:
    """A consumer's (or the broker's) view of producers' rings, opened by name on first use and kept open.

    ``writable=True`` (the broker) maps them read-write, for ``note_received`` only. ``zero_copy=True``: the
    codec takes uncompressed payloads as ``view``s (read-only numpy views of the mapping) instead of ``read``
    copies; ``take_lease`` then gives the extent they cover, to check later (``RingLease.intact``)."""

    def __init__(self, directory: str = SHM_DIR, max_rings: int = 256, writable: bool = False,
                 zero_copy: bool = False):
        self.directory = directory
        self.writable = writable
        self.zero_copy = zero_copy
        self.max_rings = max_rings
        self._rings: dict[str, _MappedRing] = {}
        self.bytes_read = 0  # what read(), gather() and view() returned, in all (a caller's per-message figure is a difference)
        self.bytes_copied = 0  # ... of which copied (views are not), plus copies discarded because the writer overtook them
        self.bytes_viewed = 0  # ... of which handed out as views
        self._lease: list | None = None  # [ring, name, lo, hi] of the views since the last take_lease()

    def view(self, name: str, pos: int, nbytes: int) -> np.ndarray:
        """A read-only uint8 view of ``nbytes`` at ``pos`` of ring ``name`` (no copy), checked like ``read`` when it
        is made; the bytes stay trustworthy only while ``take_lease()``'s lease is ``intact()``."""
        ring, size, offset = self._locate(name, pos, nbytes)
        reserved = int(ring.reserved[0])
        if reserved < pos + nbytes:
            raise ShmUnavailableError(f"shared-memory reference {pos}+{nbytes} is past what ring {name!r} "
                                      f"holds ({reserved})")
        if reserved > pos + size:
            raise ShmOverrunError(f"ring {name!r} was overwritten before this reader got to {nbytes} bytes at {pos}")
        out = np.frombuffer(ring.mm, np.uint8, count=nbytes, offset=_HEADER + offset)
        if self.writable:  # only a read-only mapping gives read-only views by itself
            out.flags.writeable = False
        lease = self._lease
        if lease is None:
            self._lease = [ring, name, pos, pos + nbytes]
        elif lease[0] is ring:
            lease[2], lease[3] = min(lease[2], pos), max(lease[3], pos + nbytes)
        else:  # a message's buffers are in one ring (spec 9): another is malformed
            raise MalformedFrameError(f"one message references rings {lease[1]!r} and {name!r}")
        self.bytes_read += nbytes
        self.bytes_viewed += nbytes
        return out

    def _locate(self, name: str, pos: int, nbytes: int) -> tuple["_MappedRing", int, int]:
        """The ring of a reference (opened on first use), its size and the reference's offset in it; a negative
        reference is malformed, one past the ring's end unavailable (only the ring shows it: spec 9)."""
        ring = self._rings.get(name)
        if ring is None:
            ring = self._open(name)
        size = ring.size
        offset = pos % size
        if pos < 0 or nbytes < 0:
            raise MalformedFrameError(f"shared-memory reference {pos}+{nbytes}: negative position or size")
        if offset + nbytes > size:
            raise ShmUnavailableError(f"shared-memory reference {pos}+{nbytes} lies outside ring {name!r}")
        return ring, size, offset

    def take_lease(self) -> RingLease | None:
        """The extent of the views handed out since the last call (None: none), and start over."""
        lease, self._lease = self._lease, None
        return None if lease is None else RingLease(*lease)

    def read(self, name: str, pos: int, nbytes: int) -> bytes:
        """A copy of ``nbytes`` at ``pos`` of ring ``name``, checked not to have been overwritten."""
        ring, size, offset = self._locate(name, pos, nbytes)
        if int(ring.reserved[0]) > pos + size:  # already overwritten: no copy (a reader far behind its writer
            # would otherwise spend its time copying bytes it must discard, and never catch up)
            raise ShmOverrunError(f"ring {name!r} was overwritten before this reader got to {nbytes} bytes at {pos}")
        self.bytes_copied += nbytes
        data = ring.mm[_HEADER + offset:_HEADER + offset + nbytes]
        reserved = int(ring.reserved[0])
        if reserved < pos + nbytes:
            raise ShmUnavailableError(f"shared-memory reference {pos}+{nbytes} is past what ring {name!r} "
                                      f"holds ({reserved})")
        if reserved > pos + size:
            raise ShmOverrunError(f"ring {name!r} was overwritten before this reader copied {nbytes} bytes at "
                                  f"{pos} (the writer is {reserved - pos - size} bytes past them)")
        self.bytes_read += nbytes
        return data

    def gather(self, name: str, pos: int, nbytes: int, outer: int, stored_rows: int, row_bytes: int,
               rows: np.ndarray) -> np.ndarray:
        """Rows ``rows`` (dim 1) of the ``[outer, stored_rows, row_bytes]`` payload at ``pos``, copied out as a
        new uint8 array ``[outer, len(rows), row_bytes]`` and checked like ``read``: a reader given a few
        requests of a step copies only their rows."""
        ring = self._rings.get(name)
        if ring is None:
            ring = self._open(name)
        size = ring.size
        offset = pos % size
        if pos < 0 or nbytes < 0 or outer * stored_rows * row_bytes != nbytes:
            raise MalformedFrameError(f"shared-memory reference {pos}+{nbytes}: negative, or not "
                                      f"[{outer}, {stored_rows}, {row_bytes} bytes]")
        if offset + nbytes > size:
            raise ShmUnavailableError(f"shared-memory reference {pos}+{nbytes} lies outside ring {name!r}")
        if int(ring.reserved[0]) > pos + size:
            raise ShmOverrunError(f"ring {name!r} was overwritten before this reader got to {nbytes} bytes at {pos}")
        view = np.frombuffer(ring.mm, np.uint8, count=nbytes, offset=_HEADER + offset)
        out = view.reshape(outer, stored_rows, row_bytes)[:, rows]
        del view  # the mapping must not stay exported (close() refuses while it is)
        copied = out.nbytes
        self.bytes_copied += copied
        reserved = int(ring.reserved[0])
        if reserved < pos + nbytes:
            raise ShmUnavailableError(f"shared-memory reference {pos}+{nbytes} is past what ring {name!r} "
                                      f"holds ({reserved})")
        if reserved > pos + size:
            raise ShmOverrunError(f"ring {name!r} was overwritten before this reader copied {copied} bytes at "
                                  f"{pos} (the writer is {reserved - pos - size} bytes past them)")
        self.bytes_read += copied
        return out

    def lag(self, name: str, pos: int) -> float:
        """How far the writer of ring ``name`` is past ``pos``, in ring sizes (> 1: those bytes are gone);
        0.0 for a ring that cannot be opened (its readers will report that)."""
        ring = self._ring_or_none(name)
        return 0.0 if ring is None else (int(ring.reserved[0]) - pos) / ring.size

    def note_received(self, name: str, end: int) -> None:
        """Store in ring ``name``'s header that the broker has received its payloads up to ``end`` (only ever
        raised): its producer bounds how far it writes ahead of that. A ring that cannot be opened is skipped
        (its messages are reported lost where they are read)."""
        ring = self._ring_or_none(name)
        received = ring.received if ring is not None else None
        # never past what the writer reserved: a reference beyond it is malformed (and reported where read)
        if received is not None and int(received[0]) < end <= int(ring.reserved[0]):
            received[0] = end

    def verify_owner(self, name: str, proof: object) -> bool:
        """Whether ``proof`` (a writer's ``ownership_proof()["secret"]``, hex) hashes to ring ``name``'s ``owner``
        field: only the process that made the ring knows it. False for a ring that cannot be read. Reads the
        header alone (no mapping: mapping a ring populates its page tables, tens of ms for 256 MiB)."""
        if type(proof) is not str or len(proof) != 32 or type(name) is not str or not RING_NAME.fullmatch(name):
            return False
        try:
            secret = bytes.fromhex(proof)
            fd = os.open(os.path.join(self.directory, name), os.O_RDONLY)
        except (ValueError, OSError):
            return False
        try:
            head = os.pread(fd, _OWNER_AT + _OWNER_LEN, 0)
        except OSError:
            return False
        finally:
            os.close(fd)
        owner = head[_OWNER_AT:_OWNER_AT + _OWNER_LEN]
        return (head[:8] == _MAGIC and len(owner) == _OWNER_LEN and owner != bytes(_OWNER_LEN)
                and hmac.compare_digest(owner, hashlib.sha256(secret).digest()))

    def _ring_or_none(self, name: str) -> _MappedRing | None:
        """The mapped ring, opened on first use; None for one that cannot be opened (a caller that does not
        read its bytes: where they are read, the failure is reported)."""
        try:
            return self._rings.get(name) or self._open(name)
        except (MalformedFrameError, ShmUnavailableError):
            return None

    def _open(self, name: str) -> _MappedRing:
        if not is_ring_name(name):
            raise MalformedFrameError(f"not a shared-memory ring name: {name!r}")
        path = os.path.join(self.directory, name)
        try:
            fd = os.open(path, os.O_RDWR if self.writable else os.O_RDONLY)
        except OSError as e:
            raise ShmUnavailableError(f"cannot open the producer's shared-memory ring {path}: {e.strerror} (a "
                                      "producer on another host or of another user, or one that exited: set "
                                      "MIA_STREAM_SHM_BYTES=0 on the producer to send tensors inline)") from None
        try:
            total = os.fstat(fd).st_size
            if total <= _HEADER:
                raise ShmUnavailableError(f"shared-memory ring {path} is not initialised")
            prot = mmap.PROT_READ | (mmap.PROT_WRITE if self.writable else 0)
            mm = mmap.mmap(fd, total, flags=_MAP_FLAGS, prot=prot)
        finally:
            os.close(fd)
        if mm[:8] != _MAGIC or _U64.unpack_from(mm, 8)[0] != total - _HEADER:
            mm.close()
            raise ShmUnavailableError(f"{path} is not a mia_stream ring of the expected layout")
        if len(self._rings) >= self.max_rings:  # the oldest mapping goes (a producer long gone, usually)
            old = next(iter(self._rings))
            self._rings.pop(old).close()
        ring = self._rings[name] = _MappedRing(mm, total - _HEADER, self.writable)
        return ring

    def prune(self, grace_s: float = 10.0) -> int:
        """Unmap rings whose file was removed more than ``grace_s`` ago (their producer is gone; a mapping
        keeps all of its memory alive). The grace lets the frames still in flight be read. How many."""
        now = time.monotonic()
        closed = 0
        for name, ring in list(self._rings.items()):
            if os.path.exists(os.path.join(self.directory, name)):
                continue
            if not ring.gone_since:
                ring.gone_since = now
            elif now - ring.gone_since >= grace_s:
                self._rings.pop(name).close()
                closed += 1
        return closed

    def close(self) -> None:
        for ring in self._rings.values():
            ring.close()
        self._rings.clear()


def _recently_handed_over(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            head = f.read(_HANDED_OVER_AT + 8)
    except OSError:
        return False
    if len(head) < _HANDED_OVER_AT + 8 or head[:8] != _MAGIC:
        return False
    at = _U64.unpack_from(head, _HANDED_OVER_AT)[0]
    return at != 0 and time.time_ns() - at < HANDOVER_KEEP_S * 1e9


def remove_ring(name: str, directory: str = SHM_DIR) -> bool:
    """Remove ring ``name`` (a broker, once the grace after its producer handed it over has passed); whether
    a file was removed. Only a ring's name is accepted, never a path."""
    if not is_ring_name(name):
        return False
    try:
        os.unlink(os.path.join(directory, name))
        return True
    except OSError:
        return False


def sweep_stale_rings(directory: str = SHM_DIR) -> int:
    """Remove the rings of producers that died without closing (their pid is gone); how many."""
    removed = 0
    try:
        names = os.listdir(directory)
    except OSError:
        return 0
    for name in names:
        m = RING_NAME.fullmatch(name)
        if m is None:
            continue
        try:
            os.kill(int(m.group(1)), 0)
            continue
        except ProcessLookupError:
            pass
        except PermissionError:  # alive, another user's
            continue
        except (OverflowError, ValueError):  # a pid no process can have (a name another user made up)
            continue
        if _recently_handed_over(os.path.join(directory, name)):  # its broker removes it after its grace
            continue
        if remove_ring(name, directory):
            removed += 1
    return removed
