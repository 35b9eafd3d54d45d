"""The host ring: a FIFO of drained steps in one shared-memory file that the engine and its drain both map.

The engine process allocates a chunk per step (``alloc``, never blocks: ``None`` when full) and queues the
device-to-host copies of the step's aperture rows into it; the drain (a sidecar process, or a thread) reads
the chunk once the copy has finished and releases it (``release``) after cutting it into frames. Chunks are
released in allocation order, so the ring is two counters: ``head`` (bytes handed out, engine-side) and
``tail`` (bytes released, in the shared header). The header also carries the drain's counters, so the
engine can report them without a round trip.

The file is a ``memfd`` (anonymous, freed with the last mapping); the sidecar inherits its descriptor. On CUDA
the engine registers the mapping with the driver (``cudaHostRegister``) so the copies run asynchronously.
No torch here: the sidecar imports this module. Owns the ring file, its mapping and its counters.
"""

from __future__ import annotations

import mmap
import os
import struct
import threading

import numpy as np

_HEADER = 4096  # a page: the data area starts page-aligned
_ALIGN = 64
# header slots (u64 each): what the drain has released, and its counters
_TAIL, _FRAMES, _BYTES, _HANDLED, _DRAIN_DROPS = range(5)
_COUNTERS = {"frames": _FRAMES, "bytes": _BYTES, "handled": _HANDLED, "drain_dropped": _DRAIN_DROPS}


class HostRing:
    """One mapping of the ring file. ``HostRing.create(capacity)`` in the engine, ``HostRing(fd, size)`` in the
    drain; both see the same bytes."""

    def __init__(self, fd: int, size: int):
        self.fd, self.size = fd, size
        self.capacity = size - _HEADER
        self.mm = mmap.mmap(fd, size)
        self.data = np.frombuffer(self.mm, dtype=np.uint8, count=self.capacity, offset=_HEADER)
        self._head = 0
        self._lock = threading.Lock()

    @classmethod
    def create(cls, capacity: int) -> "HostRing":
        capacity = max(_ALIGN, -(-capacity // mmap.PAGESIZE) * mmap.PAGESIZE)
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
            if self._head + pad + need - self._read(_TAIL) > self.capacity:
                return None
            offset = 0 if pad else pos
            self._head += pad + need
            return offset, self._head

    def in_use(self) -> int:
        return self._head - self._read(_TAIL)

    def counters(self) -> dict[str, int]:
        return {name: self._read(slot) for name, slot in _COUNTERS.items()}

    # ------------------------------------------------------------------ drain side
    def view(self, offset: int, nbytes: int) -> np.ndarray:
        return self.data[offset:offset + nbytes]

    def release(self, mark: int) -> None:
        """Everything allocated up to ``mark`` is read (chunks are released in allocation order)."""
        self._write(_TAIL, mark)

    def count(self, name: str, n: int = 1) -> None:
        slot = _COUNTERS[name]
        self._write(slot, self._read(slot) + n)

    # ------------------------------------------------------------------ shared header
    def _read(self, slot: int) -> int:
        return struct.unpack_from("<Q", self.mm, slot * 8)[0]

    def _write(self, slot: int, value: int) -> None:
        struct.pack_into("<Q", self.mm, slot * 8, value)  # one aligned 8-byte store: the reader never sees half

    def close(self) -> None:
        try:
            self.data = None
            self.mm.close()
        except BufferError:  # a frame still references the mapping; the OS frees it at exit
            pass
