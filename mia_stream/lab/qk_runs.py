"""Run prompts through a model and hand back each one's attention: what head discovery and the evaluation
scripts use. Two backends over the same interface (``PromptAttention.rows``):

- ``vllm``: the product path. A ``StreamLLM`` engine streams Q/K of the chosen layers at every prompt position;
  attention is rebuilt from them (``_attention.attention_rows``) exactly as the live analyzers do.
- ``hf``: Hugging Face ``transformers`` with eager attention and ``output_attentions=True`` (the independent
  reference the tests compare with).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import numpy as np

from mia_stream.analyzers._attention import QKBuffer, attention_rows, kv_index
from mia_stream.errors import AnalyzerInputError


@dataclass
class PromptAttention:
    """One prompt's attention source: ``rows(positions)`` -> ``[L, H, len(positions), max(positions) + 1]``
    for ``layers`` and every query head ``0..num_heads-1``."""

    token_ids: list
    layers: list
    num_heads: int
    num_kv_heads: int
    qk: QKBuffer | None = None  # vllm backend
    attentions: Any = None  # hf backend: [L, H, T, T] torch/numpy

    def rows(self, positions: Sequence[int]) -> np.ndarray:
        positions = np.asarray(positions, dtype=np.int64)
        if self.qk is not None:
            n = int(positions.max()) + 1
            kv = kv_index(self.qk.q_heads, self.qk.k_heads, self.num_heads, self.num_kv_heads)
            return attention_rows(self.qk.queries(positions), self.qk.keys(n), positions, kv)
        n = int(positions.max()) + 1
        return np.asarray(self.attentions[:, :, positions, :n], dtype=np.float64)


def qk_buffer_from_frames(frames: Sequence) -> QKBuffer:
    """A ``QKBuffer`` of one request from its consumer ``StepFrame``s (those that carry ``q``/``k``)."""
    buf = QKBuffer()
    for f in frames:
        if "q" not in f.raw_tensors or "k" not in f.raw_tensors:
            continue
        q, k = f.raw_tensors["q"], f.raw_tensors["k"]
        buf.add(f.positions, q.numpy(), k.numpy(), q.layers, q.meta.get("heads", ()), k.meta.get("heads", ()))
    return buf


def vllm_attention(sllm, prompts: Sequence[Sequence[int]], layers: Sequence[int], chunk: int = 4,
                   timeout: float = 300.0) -> Iterator[PromptAttention]:
    """Stream each prompt (token ids) through ``sllm`` (a ``StreamLLM``) with Q/K of ``layers``, all heads, at
    every prompt position; one ``PromptAttention`` per prompt, in order. ``chunk`` prompts are in flight at
    once: a prompt of 400 tokens carries ~37 MB of Q/K for 30 layers of the embedded model, and frames a
    consumer has not read within half a shared-memory ring (128 MiB by default) are lost (8 prompts of ~170
    tokens lost one frame to shm_overrun here)."""
    from vllm import SamplingParams

    capture = {"qk": {"layers": sorted(layers), "heads": "all", "positions": "prompt"}}
    params = SamplingParams(max_tokens=1, temperature=0.0)
    for i in range(0, len(prompts), chunk):
        part = [{"prompt_token_ids": list(p)} for p in prompts[i:i + chunk]]
        for prompt, res in zip(prompts[i:i + chunk], sllm.generate(part, params, capture=capture, timeout=timeout)):
            if res.gaps:
                why = sorted({f"{g.origin}:{g.reason}" for g in res.gaps})
                raise AnalyzerInputError(f"request {res.request_id} lost frames ({len(res.gaps)} gap(s), {why}); "
                                         "rerun with a smaller chunk")
            start = next(e.stream.start for e in res.events)
            buf = qk_buffer_from_frames(res.frames)
            yield PromptAttention(list(prompt), sorted(layers), start.num_heads, start.num_kv_heads, qk=buf)


def hf_attention(model, prompts: Sequence[Sequence[int]], layers: Sequence[int]) -> Iterator[PromptAttention]:
    """The same from Hugging Face (``model`` loaded with ``attn_implementation="eager"``)."""
    import torch

    cfg = model.config
    for p in prompts:
        with torch.no_grad():
            out = model(torch.tensor([list(p)]), output_attentions=True)
        att = torch.stack([out.attentions[l][0] for l in sorted(layers)]).float().numpy()
        yield PromptAttention(list(p), sorted(layers), cfg.num_attention_heads,
                              getattr(cfg, "num_key_value_heads", cfg.num_attention_heads), attentions=att)


def load_hf_eager(model_dir: str):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()


@contextmanager
def attention_backend(model: str | None = None, backend: str = "vllm", chunk: int = 4, **llm_kwargs):
    """``(tokenizer, attend)`` where ``attend(prompts, layers)`` yields one ``PromptAttention`` per prompt, on
    ``backend`` "vllm" (a private broker and a ``StreamLLM``, float32, eager) or "hf"."""
    from transformers import AutoTokenizer

    from mia_stream.model import resolve_model

    model_dir = resolve_model(model)
    tok = AutoTokenizer.from_pretrained(model_dir)
    if backend == "hf":
        m = load_hf_eager(model_dir)
        yield tok, lambda prompts, layers: hf_attention(m, prompts, layers)
    elif backend == "vllm":
        import os

        from mia_stream.served.offline import StreamLLM

        # all-layer Q/K at every prompt position: ~92 KB per token on the embedded model; a producer ring of 4x
        # a step's bytes keeps the source bound from dropping frames (scripts/eval_analyzers.py)
        os.environ.setdefault("MIA_STREAM_SHM_BYTES", str(1 << 30))

        kw = {"dtype": "float32", "enforce_eager": True, "max_model_len": 4096, **llm_kwargs}
        with StreamLLM(model_dir, **kw) as sllm:
            yield tok, lambda prompts, layers: vllm_attention(sllm, prompts, layers, chunk)
            sllm.llm.llm_engine.engine_core.shutdown()
    else:
        raise ValueError(f"backend must be 'vllm' or 'hf', got {backend!r}")
