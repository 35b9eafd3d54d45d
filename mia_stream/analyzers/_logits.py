"""The model's output head outside the engine: next-token log-probabilities from a captured last-layer residual,
so a detector can read the free uncertainty signals (a token's -log p, the entropy of the distribution it came
from) from the stream, which carries hidden states but no logits.

``OutputHead.from_model_dir(dir)`` reads the final RMSNorm weight and the unembedding (``lm_head.weight``, or the
tied ``model.embed_tokens.weight``) from the model's safetensors (F32, F16 or BF16; read directly, no torch), and
``log_softmax(h)`` computes ``log softmax(rmsnorm(h) * w @ E^T)`` row-wise in float64 sums (one row's values do
not depend on the other rows). ``top_entropy(logp, k)`` is the entropy of the top-k distribution renormalized:
what the labels file stores from vLLM's top-20 logprobs (``probe_collect.LOGPROBS``), so the analyzer's features
equal the ones the probe was trained on.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np

from mia_stream.errors import AnalyzerConfigError

TOP_K = 20
_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": "bf16"}


def _read_tensors(files: list[Path], names: set[str]) -> dict[str, np.ndarray]:
    """The named tensors (float32) from safetensors files, read by offset."""
    out = {}
    for f in files:
        with open(f, "rb") as fh:
            n = struct.unpack("<Q", fh.read(8))[0]
            header = json.loads(fh.read(n))
            base = 8 + n
            for name in names - set(out):
                meta = header.get(name)
                if meta is None:
                    continue
                dtype = _DTYPES.get(meta["dtype"])
                if dtype is None:
                    raise AnalyzerConfigError(f"model file {f}: tensor {name!r} has dtype {meta['dtype']}, "
                                              f"not one of {list(_DTYPES)}")
                a, b = meta["data_offsets"]
                fh.seek(base + a)
                raw = fh.read(b - a)
                if dtype == "bf16":
                    arr = (np.frombuffer(raw, np.uint16).astype(np.uint32) << 16).view(np.float32)
                else:
                    arr = np.frombuffer(raw, dtype).astype(np.float32)
                out[name] = arr.reshape(meta["shape"])
    return out


class OutputHead:
    """Final norm + unembedding of a Llama-style model (float32)."""

    def __init__(self, norm_weight: np.ndarray, unembed: np.ndarray, eps: float):
        self.norm_weight, self.unembed, self.eps = norm_weight, np.ascontiguousarray(unembed), float(eps)

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> "OutputHead":
        d = Path(model_dir)
        try:
            config = json.loads((d / "config.json").read_text())
        except (OSError, ValueError) as e:
            raise AnalyzerConfigError(f"model dir {d}: no readable config.json ({e})") from None
        files = sorted(d.glob("*.safetensors"))
        if not files:
            raise AnalyzerConfigError(f"model dir {d}: no *.safetensors (the logit features read the output head)")
        want = {"model.norm.weight", "lm_head.weight", "model.embed_tokens.weight"}
        t = _read_tensors(files, want)
        unembed = t.get("lm_head.weight", t.get("model.embed_tokens.weight"))
        if "model.norm.weight" not in t or unembed is None:
            raise AnalyzerConfigError(f"model dir {d}: the safetensors lack model.norm.weight or the unembedding")
        return cls(t["model.norm.weight"], unembed, config.get("rms_norm_eps", 1e-5))

    def log_softmax(self, h: np.ndarray, batched: bool = False) -> np.ndarray:
        """``[N, H]`` last-layer residuals -> ``[N, V]`` float64 next-token log-probabilities. Row by row by
        default (a row's values do not depend on the batch: live equals replayed); ``batched``: one matrix
        product (offline, much faster; equal up to float rounding)."""
        h = np.asarray(h, np.float32)
        var = (h.astype(np.float64) ** 2).mean(axis=1, keepdims=True)
        x = (h / np.sqrt(var + self.eps)).astype(np.float32) * self.norm_weight
        logits = (x @ self.unembed.T if batched else np.stack([self.unembed @ row for row in x])).astype(np.float64)
        m = logits.max(axis=1, keepdims=True)
        return logits - m - np.log(np.exp(logits - m).sum(axis=1, keepdims=True))


def top_entropy(logp: np.ndarray, k: int = TOP_K) -> np.ndarray:
    """Row-wise entropy of the top-``k`` distribution renormalized (``[N, V]`` -> ``[N]``)."""
    logp = np.atleast_2d(logp)
    top = np.take_along_axis(logp, np.argpartition(-logp, k - 1, axis=1)[:, :k], axis=1)
    top = top - top.max(axis=1, keepdims=True)
    p = np.exp(top)
    p /= p.sum(axis=1, keepdims=True)
    return -(p * np.log(np.where(p > 0, p, 1.0))).sum(axis=1)
