"""The bus: how peers reach the broker and each other on one host (ZeroMQ sockets, shared-memory rings).

- ``transport``: endpoints, sockets, CURVE keys, batching of frames (no message semantics).
- ``shm_ring``: the producer's shared-memory ring that large tensor buffers travel through.
- ``publisher``: ``FramePublisher``, a producer's connection (and ``make_publisher``); never blocks its caller.
- ``client``: ``BrokerClient``, a consumer's connection with its credit window.
- ``seqranges``: inclusive seq ranges, the one implementation every layer counts losses with.

The wire format itself is ``mia_stream.schemas``, which knows rings only through ``schemas._oob``.
"""

from mia_stream.bus.shm_ring import ShmRingReader, ShmRingWriter, shm_available, shm_reachable, sweep_stale_rings

__all__ = ["ShmRingReader", "ShmRingWriter", "shm_available", "shm_reachable", "sweep_stale_rings"]
