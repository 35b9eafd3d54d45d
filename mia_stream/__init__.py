"""mia_stream: watch and steer what an LLM computes while vLLM serves it.

Public entry points: ``mia_stream.StreamLLM`` (offline convenience), ``mia_stream.consumers`` (open_stream,
Consumer), ``mia_stream.schemas`` (the wire format), ``mia_stream.errors``; the vLLM plugin loads by itself
when ``MIA_STREAM_BROKER`` is set.
"""

__version__ = "0.1.0"
__all__ = ["StreamLLM", "StreamResult", "__version__"]


def __getattr__(name):  # lazy: `import mia_stream` must not import vLLM or torch
    if name in ("StreamLLM", "StreamResult"):
        from mia_stream import _stream_llm

        return getattr(_stream_llm, name)
    raise AttributeError(f"module 'mia_stream' has no attribute {name!r}")
