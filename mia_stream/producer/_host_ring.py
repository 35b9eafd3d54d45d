"""The host ring: a FIFO of drained steps in one shared-memory file that the engine and its drain both map.

The engine process allocates a chunk per step (``alloc``, never blocks: ``None`` when full) and queues the
device-to-host copies of the step's aperture rows into it; the drain (a sidecar process, or a thread) reads
the chunk once the copy has finished and releases it (``release``) after cutting it into frames. Chunks are
released in allocation order, so the ring is two counters: ``head`` (bytes handed out, engine-side) and
``tail`` (bytes released, in the shared header). The header also carries the drain's counters, so the
engine can report them without a round trip.

**The host ring is a consumer ring** (issue 29; docs/wire-format.md 9.5). By default the file is a named
``/dev/shm`` ring with the header protocol of ``bus.shm_ring`` (magic, size, ``reserved``, ``received``, owner
digest): ``alloc`` stores ``reserved`` (the new head) before the DMA writes the chunk, so readers' overrun
check holds, and the drain publishes a step's rows that are already one contiguous slice of the ring as ring
references (name, position, bytes) straight into it (``references``): the bytes land once, by the DMA, and
every consumer on the host reads them in place. Since the broker has then to receive a reference before its
bytes may be reused, a chunk is free only once the drain released it AND, while references are in flight
(``ref_end``, written by the drain, past the broker's ``received``), the broker has received up to it.
``alloc`` still never waits: a full ring drops the step (``host_ring_full``, counted and announced). A broker
that stops receiving (a restart) would hold the ring forever: after ``_REFS_STALL_S`` without progress the
drain gives up on what was in flight (``ref_resets``). ``MIA_STREAM_HOST_RING_SHM=0`` (or no room in
/dev/shm) keeps the former anonymous ``memfd``, whose rows the publisher copies into its own ring.

On CUDA the engine registers the mapping with the driver (``cudaHostRegister``) so the copies run
asynchronously (a MAP_SHARED tmpfs mapping, as a memfd's is). The sidecar inherits the descriptor. No torch
here: the sidecar imports this module. Owns the ring file, its mapping and its counters.
"""

from __future__ import annotations

import logging
import mmap
import os
import struct
import threading
import time
import weakref

import numpy as np

from mia_stream import settings
from mia_stream.bus.shm_ring import (DATA_AT, DEFAULT_MIN_BYTES, HANDED_OVER_AT, RECEIVED_AT, RESERVED_AT,
                                     create_ring_file, shm_available, unlink_ring)

logger = logging.getLogger("mia_stream.producer")

_HEADER = DATA_AT  # a page: the data area starts page-aligned, after the shared-ring header
_ALIGN = 64
_SLOTS_AT = 256  # the host ring's own header slots (u64 each), after the shared-ring protocol's fields
# what the drain has released, its counters, and the end of the newest ring reference it published
_TAIL, _FRAMES, _BYTES, _HANDLED, _DRAIN_DROPS, _REF_END, _REF_RESETS, _REF_MESSAGES, _REF_BYTES = range(9)
_COUNTERS = {"frames": _FRAMES, "bytes": _BYTES, "handled": _HANDLED, "drain_dropped": _DRAIN_DROPS,
             "ref_resets": _REF_RESETS, "ref_messages": _REF_MESSAGES, "ref_bytes": _REF_BYTES}
_REFS_STALL_S = 3.0  # the broker received nothing of the references in flight for this long: they are lost


def full_step_note(capacity: int, max_rows: int, row_bytes: int) -> str | None:
    """What to say at start when a step of ``max_rows`` rows (max_num_batched_tokens) capturing every layer's
    hidden states (``row_bytes`` a row) cannot fit a ring of ``capacity``: such steps, a batch of prompts
    prefilled together, are dropped as ``host_ring_full`` (on an H100 1,004 of 1,024 prompt frames); else None."""
    need = max_rows * row_bytes
    if need <= capacity:
        return None
    return (f"mia_stream: the host ring (MIA_STREAM_HOST_RING_MB={capacity >> 20}) holds {capacity // row_bytes} "
            f"token rows of every layer's hidden states in one step; a step of {max_rows} rows "
            f"(max_num_batched_tokens) capturing every layer needs {-(-need >> 20)} MiB: such steps are dropped as "
            "'host_ring_full' (counted, named). Raise MIA_STREAM_HOST_RING_MB to keep them")


class HostRing:
    """One mapping of the ring file. ``HostRing.create(capacity)`` in the engine, ``HostRing(fd, size, name)`` in
    the drain; both see the same bytes. ``name`` is the ring's /dev/shm name ("" for a memfd: nothing is
    published by reference); ``secret`` its owner secret (the drain's publisher proves ownership with it)."""

    def __init__(self, fd: int, size: int, name: str = "", secret: bytes = b""):
        self.fd, self.size = fd, size
        self.capacity = size - _HEADER
        self.name, self.secret = name, secret
        self.mm = mmap.mmap(fd, size)
        self.data = np.frombuffer(self.mm, dtype=np.uint8, count=self.capacity, offset=_HEADER)
        self._data_addr = self.data.ctypes.data
        # the shared-ring header's fields as single aligned u64 accesses (numpy: one 8-byte load or store)
        self._reserved = np.frombuffer(self.mm, dtype="<u8", count=1, offset=RESERVED_AT) if name else None
        self._received = np.frombuffer(self.mm, dtype="<u8", count=1, offset=RECEIVED_AT) if name else None
        self._head = 0
        self._lock = threading.Lock()
        self._refs_seen = (0, time.monotonic())  # (received, when it last moved) while references are in flight
        self._unlink_at_exit = None

    @classmethod
    def create(cls, capacity: int, shared: bool | None = None) -> "HostRing":
        """``shared`` (default: setting ``MIA_STREAM_HOST_RING_SHM``): a named /dev/shm ring consumers read, else
        (or without room there) a memfd."""
        capacity = max(_ALIGN, -(-capacity // mmap.PAGESIZE) * mmap.PAGESIZE)
        if shared is None:
            shared = settings.get_flag("MIA_STREAM_HOST_RING_SHM")
        if shared and shm_available():
            try:
                fd, name, secret = create_ring_file(capacity)
            except OSError as e:
                logger.warning("mia_stream: no room for the %d MiB host ring in /dev/shm (%s): its rows are copied "
                               "into the publisher's ring instead", capacity >> 20, e)
            else:
                ring = cls(fd, _HEADER + capacity, name, secret)
                ring._unlink_at_exit = weakref.finalize(ring, unlink_ring, name)
                return ring
        fd = os.memfd_create("mia-stream-host-ring", 0)  # no MFD_CLOEXEC: the sidecar inherits it by pass_fds
        os.ftruncate(fd, _HEADER + capacity)
        return cls(fd, _HEADER + capacity)

    # ------------------------------------------------------------------ engine side
    def alloc(self, nbytes: int) -> tuple[int, int] | None:
        """``(offset into data, release mark)`` of ``nbytes`` contiguous bytes, or None when the ring is full."""
        need = -(-max(nbytes, 1) // _ALIGN) * _ALIGN
        if need > self.capacity:
            return None
        with self._lock:
            pos = self._head % self.capacity
            pad = self.capacity - pos if pos + need > self.capacity else 0  # wrap: skip the ring's tail end
            if self._head + pad + need - self._free_from() > self.capacity:
                return None
            offset = 0 if pad else pos
            self._head += pad + need
            if self._reserved is not None:
                self._reserved[0] = self._head  # before the DMA writes the chunk: readers of older bytes see it
            return offset, self._head

    def _free_from(self) -> int:
        """The oldest position still in use: released by the drain, and received by the broker where the drain
        published references (a reference in flight keeps its bytes)."""
        tail = self._read(_TAIL)  # read first: the drain stores ref_end before it releases
        if self._received is None:
            return tail
        ref_end = self._read(_REF_END)
        if ref_end:
            received = int(self._received[0])
            if received < ref_end:
                return min(tail, received)
        return tail

    def in_use(self) -> int:
        return self._head - self._free_from()

    def counters(self) -> dict[str, int]:
        return {name: self._read(slot) for name, slot in _COUNTERS.items()}

    def leave_name_to_drain(self) -> None:
        """The sidecar publishes last (it outlives the engine at exit): it removes the name, not this process."""
        if self._unlink_at_exit is not None:
            self._unlink_at_exit.detach()

    def mark_handed_over(self) -> None:
        """Stamp the shared header's ``handed_over`` time (the broker took the ring: no sweep removes it for its
        writers being gone until its grace has passed; spec section 9)."""
        if self.name:
            np.frombuffer(self.mm, dtype="<u8", count=1, offset=HANDED_OVER_AT)[0] = time.time_ns()

    def unlink(self) -> None:
        """Remove the ring's name (readers that mapped it keep reading); the last process to publish does."""
        if self.name:
            unlink_ring(self.name)

    # ------------------------------------------------------------------ drain side
    def view(self, offset: int, nbytes: int) -> np.ndarray:
        return self.data[offset:offset + nbytes]

    def release(self, mark: int) -> None:
        """Everything allocated up to ``mark`` is read (chunks are released in allocation order)."""
        self._write(_TAIL, mark)

    def count(self, name: str, n: int = 1) -> None:
        slot = _COUNTERS[name]
        self._write(slot, self._read(slot) + n)

    def references(self, mark: int) -> "RingReferences | None":
        """The sink through which the publisher names the chunk of release mark ``mark`` by position (None for
        a memfd ring)."""
        return RingReferences(self, mark) if self.name else None

    def position(self, offset: int, mark: int) -> int:
        """The absolute ring position of data offset ``offset`` in the chunk whose release mark is ``mark`` (the
        chunk's end: chunks never wrap, so the offset lies at most a ring before it)."""
        back = (mark - offset) % self.capacity or self.capacity
        return mark - back

    def published_references(self, end: int, nbytes: int) -> None:
        """A message naming ring bytes up to ``end`` went to the publisher: that chunk stays until the broker
        received it. Stored before the chunk's release (``alloc`` reads the tail first)."""
        if end > self._read(_REF_END):
            self._write(_REF_END, end)
        self.count("ref_messages")
        self.count("ref_bytes", nbytes)

    def check_references(self) -> None:
        """Give up on references the broker has not received anything of for ``_REFS_STALL_S`` (a broker that
        restarted will never receive them): the engine may reuse their chunks. Called by the drain per item."""
        if self._received is None:
            return
        ref_end = self._read(_REF_END)
        if not ref_end:
            return
        received = int(self._received[0])
        now = time.monotonic()
        if received >= ref_end:
            self._refs_seen = (received, now)
            return
        if received != self._refs_seen[0]:
            self._refs_seen = (received, now)
        elif now - self._refs_seen[1] >= _REFS_STALL_S:
            self._write(_REF_END, 0)
            self.count("ref_resets")
            self._refs_seen = (received, now)

    # ------------------------------------------------------------------ shared header
    def _read(self, slot: int) -> int:
        return struct.unpack_from("<Q", self.mm, _SLOTS_AT + slot * 8)[0]

    def _write(self, slot: int, value: int) -> None:
        struct.pack_into("<Q", self.mm, _SLOTS_AT + slot * 8, value)  # one aligned 8-byte store: the reader never sees half

    def close(self) -> None:
        try:
            self.data = None
            self._reserved = self._received = None
            self.mm.close()
        except BufferError:  # a frame still references the mapping; the OS frees it at exit
            pass


class RingReferences:
    """A ``schemas`` BufferSink over one chunk of the host ring: ``put(buf)`` gives the ring position of a buffer
    that lies inside the chunk (no copy), None for one too small for a ring (it goes inline) or one that lies
    elsewhere (``missed``: the message then takes the publisher's own ring). ``end`` / ``bytes``: what it named."""

    __slots__ = ("ring", "name", "mark", "min_bytes", "end", "bytes", "missed")

    def __init__(self, ring: HostRing, mark: int, min_bytes: int = DEFAULT_MIN_BYTES):
        self.ring, self.name, self.mark, self.min_bytes = ring, ring.name, mark, min_bytes
        self.begin()

    def begin(self) -> None:
        self.end = self.bytes = 0
        self.missed = False

    def put(self, buf) -> int | None:
        arr = buf if isinstance(buf, np.ndarray) else np.frombuffer(buf, np.uint8)
        n = arr.nbytes
        if n < self.min_bytes:
            return None
        ring = self.ring
        offset = arr.ctypes.data - ring._data_addr
        if offset < 0 or offset + n > ring.capacity or not arr.flags.c_contiguous:
            self.missed = True
            return None
        pos = ring.position(offset, self.mark)
        self.end = max(self.end, pos + n)
        self.bytes += n
        return pos
