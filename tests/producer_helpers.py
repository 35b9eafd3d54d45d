"""Helpers for the producer tests: collect a live stream from the broker; trace HF for the same tokens."""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager

import numpy as np
import torch


class StreamCollector:
    """Subscribes at once; ``wait_ended`` then reads the broker until the named streams ended.

    The broker queues a consumer's messages while the test is blocked in ``generate`` (256 MiB budget).
    """

    def __init__(self, address: str, patterns=("*",)):
        from mia_stream.consumers import open_stream

        self.events = defaultdict(list)
        self._stream = open_stream(address, patterns=patterns, timeout=None)

    def _ended(self, request_ids):
        return all(any(e.kind == "end" for e in self.events.get(r, [])) for r in request_ids)

    def wait_ended(self, request_ids, timeout=60.0):
        deadline = time.monotonic() + timeout
        client = self._stream._source
        while not self._ended(request_ids) and time.monotonic() < deadline:
            for ev in client.events(timeout=0.5):
                self.events[ev.stream.request_id].append(ev)
                if self._ended(request_ids):
                    break
        if not self._ended(request_ids):
            raise AssertionError(f"streams did not end in {timeout}s: "
                                 f"{ {r: [e.kind for e in self.events.get(r, [])][-3:] for r in request_ids} }")

    def close(self):
        self._stream.close()

    def frames(self, rid):
        return [e.frame for e in self.events[rid] if e.kind == "frame"]

    def kinds(self, rid, kind):
        return [e for e in self.events[rid] if e.kind == kind]

    def stacked(self, rid, name):
        """(positions, token_ids, tensor concatenated over steps along the token dim)."""
        frames = [f for f in self.frames(rid) if name in f.raw_tensors]
        positions = [p for f in frames for p in f.positions]
        token_ids = [t for f in frames for t in f.token_ids]
        return positions, token_ids, np.concatenate([f.tensors[name] for f in frames], axis=1)


@contextmanager
def collecting(address, patterns=("*",)):
    c = StreamCollector(address, patterns)
    time.sleep(0.2)  # let the subscription reach the broker before the engine starts publishing
    try:
        yield c
    finally:
        c.close()


def hf_trace(model, token_ids, steer_hook=None):
    """Decoder-layer outputs ``[L, T, H]`` and post-RoPE q ``[L, T, heads, D]`` / k per layer, from HF."""
    import transformers.models.llama.modeling_llama as modeling

    outs, qk = {}, []
    hooks = []
    for i, layer in enumerate(model.model.layers):
        def hook(mod, args, out, i=i):
            h = out[0] if isinstance(out, tuple) else out
            if steer_hook is not None:
                h = steer_hook(i, h)
            outs[i] = h.detach().clone()
            if isinstance(out, tuple):
                return (h,) + tuple(out[1:])
            return h
        hooks.append(layer.register_forward_hook(hook))
    orig = modeling.apply_rotary_pos_emb

    def record(*a, **kw):
        r = orig(*a, **kw)
        qk.append((r[0][0].transpose(0, 1).detach().clone(), r[1][0].transpose(0, 1).detach().clone()))
        return r

    modeling.apply_rotary_pos_emb = record
    try:
        with torch.no_grad():
            logits = model(torch.tensor([list(token_ids)])).logits[0]
    finally:
        modeling.apply_rotary_pos_emb = orig
        for h in hooks:
            h.remove()
    hs = torch.stack([outs[i][0] for i in range(len(model.model.layers))]).numpy()
    q = [x[0].numpy() for x in qk]
    k = [x[1].numpy() for x in qk]
    return hs, q, k, logits.numpy()


def rel_err(a, b):
    """max |a - b| / max |b|, per leading index (per layer)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    axes = tuple(range(1, a.ndim))
    return np.abs(a - b).max(axis=axes) / np.abs(b).max(axis=axes)
