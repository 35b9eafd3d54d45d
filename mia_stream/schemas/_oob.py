"""Out-of-band buffers: the hook through which the codec reaches a shared-memory ring without knowing it.

The wire format only says that a tensor entry may name a position (``"shm"``) in a ring (``"shm_ring"``, a name
of the grammar below) instead of carrying its bytes (spec: docs/wire-format.md, section 9). What a ring is, how
it is mapped and who owns it is the bus's business (``mia_stream.bus.shm_ring``); the codec is handed an object
with the methods below, as vLLM's serializer knows its transport only through ``OOBTensorConsumer/Provider``.
"""

from __future__ import annotations

import re
from typing import Protocol

import numpy as np

# spec 9: the writer's pid in ASCII decimal without leading zeros, then 12 lowercase hex digits (``\d`` would also
# match non-ASCII digits)
RING_NAME = re.compile(r"mia-stream-ring-([1-9][0-9]*)-[0-9a-f]{12}")


def is_ring_name(name: object) -> bool:
    """Whether ``name`` is a ring file name of the spec's grammar (section 9); any other is malformed."""
    return type(name) is str and RING_NAME.fullmatch(name) is not None


class BufferSink(Protocol):
    """Where an encoder may put a large buffer instead of a frame (the producer's ring)."""

    name: str

    def put(self, buf) -> int | None:
        """The buffer's position, or None when it stays inline (too small, or too large for the sink)."""


class BufferSource(Protocol):
    """Where a decoder reads the buffers a message names by position (any ring on this host)."""

    def read(self, name: str, pos: int, nbytes: int) -> bytes: ...

    def gather(self, name: str, pos: int, nbytes: int, outer: int, stored_rows: int, row_bytes: int,
               rows: np.ndarray) -> np.ndarray: ...

    # Optional: a source with ``zero_copy = True`` also has ``view(name, pos, nbytes) -> np.ndarray`` (read-only,
    # no copy); the decoder then takes uncompressed payloads that way, and the source answers for their validity.
