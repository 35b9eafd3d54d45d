"""mia_stream: watch and steer what an LLM computes while vLLM serves it.

Public entry points: ``mia_stream.StreamLLM`` (offline convenience), ``mia_stream.consumers`` (open_stream,
open_batches, Consumer, run_consumer), ``mia_stream.client`` (StreamClient, served mode), ``mia_stream.schemas``
(the wire format), ``mia_stream.errors``, the ``mia-stream`` CLI; the vLLM plugin loads by itself when
``MIA_STREAM_BROKER`` is set. docs/architecture.md draws the layout and the life of one request through it.

Dependency rule

  tier 0: errors
  tier 1: settings, spans
  tier 2: model, metrics
  tier 3: schemas
  tier 4: bus, kernels, spec
  tier 5: bridge
  tier 6: broker, producer, consumers
  tier 7: analyzers, monitor, served
  tier 8: lab, demo
  tier 9: cli, client, root

A module imports modules of its own unit (its first package or module under mia_stream) and of lower tiers only,
never a unit of its own tier or above. No module imports the producer: vLLM loads it through the entry point
``producer.plugin:register``. Only the producer imports ``kernels``. Lazy imports inside functions count.
tests/test_dependency_rule.py walks every import and reads the tiers from this docstring.

- ``errors`` (the one error hierarchy), ``settings`` (the one settings table), ``spans`` (prompt spans, tagged by
  served mode and read by analyzers), ``model`` (the embedded model): leaves. ``metrics``: Prometheus metrics of
  any process (``mia_stream_*``), read from the counters each component already keeps.
- ``schemas``: the wire format only; it reaches shared-memory rings through an out-of-band hook (``_oob``).
- ``bus``: sockets, rings, the publisher and the broker client. ``spec``: the per-request spec (parse, admission,
  named vectors), pure, so an API server checks a request without torch. ``kernels``: the in-graph ops.
- ``bridge``: beyond one host: the bridge (a broker's streams onto NATS JetStream, steering back) and the
  ``nats://`` source the consumers open; it speaks to the broker through ``bus`` like any consumer.
- ``broker``, ``producer``, ``consumers`` speak through the bus; ``analyzers``, ``monitor``, ``served`` are
  built on consumers; ``lab`` and ``demo`` on all of them.
- ``client``: the public alias of ``served.client``.
"""

__version__ = "0.1.0"
__all__ = ["StreamLLM", "StreamResult", "__version__"]


def __getattr__(name):  # lazy: `import mia_stream` must not import vLLM or torch
    if name in ("StreamLLM", "StreamResult"):
        from mia_stream.served import offline as _stream_llm

        return getattr(_stream_llm, name)
    raise AttributeError(f"module 'mia_stream' has no attribute {name!r}")
