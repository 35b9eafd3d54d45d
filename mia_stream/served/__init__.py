"""Served mode: ``mia-stream serve`` (vLLM's OpenAI server with broker and plugin), ``StreamClient`` (requests
with a spec, and the request's own stream), and ``StreamLLM`` (the same in one process, offline)."""
