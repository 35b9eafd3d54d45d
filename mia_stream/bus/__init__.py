"""The bus: how peers reach the broker and each other on one host (ZeroMQ sockets, shared-memory rings).

- ``transport``: endpoints, sockets, CURVE keys, batching of frames (no message semantics).
- ``shm_ring``: the producer's shared-memory ring that large tensor buffers travel through.
- ``publisher``: ``FramePublisher``, a producer's connection (and ``make_publisher``); never blocks its caller.
- ``client``: ``BrokerClient``, a consumer's connection with its credit window.
- ``session``: the peer session with the broker: typed heartbeat capabilities, and what a broker heartbeat means
  (restart, unknown peer) for the publisher, the client and the recorder alike; no I/O.

The wire format itself is ``mia_stream.schemas`` (inclusive seq ranges: ``schemas.seqranges``), which knows rings
only through ``schemas._oob``.
"""

from mia_stream.bus.session import BrokerSession, Capabilities
from mia_stream.bus.shm_ring import (RingLease, ShmRingReader, ShmRingWriter, ring_lease, shm_available, shm_reachable,
                                     sweep_stale_rings)

__all__ = ["BrokerSession", "Capabilities", "RingLease", "ShmRingReader", "ShmRingWriter", "ring_lease", "shm_available",
           "shm_reachable", "sweep_stale_rings"]
