"""``science_hallucination``: a trained classifier that flags a wrong answer to a science question from the
model's own final hidden states, with the model's final norm applied as the model applies it.

Method: a linear probe of the final-layer representations of the answer tokens, in the line of
"The Internal State of an LLM Knows When It's Lying" (A. Azaria, T. Mitchell, Findings of EMNLP 2023: a
classifier on hidden states detects false statements) and "Discovering Latent Knowledge in Language Models Without
Supervision" (C. Burns et al., ICLR 2023). The capture reads the residual stream *before* the model's final norm
(``hs`` of the last layer = HF's ``output_hidden_states[-1]`` before ``model.norm``), so each row is first
normalized exactly as the model does before its LM head (Llama-style RMSNorm, in float32)::

    n = x / sqrt(mean(x^2) + eps) * norm_weight          (norm_weight, eps: the model dir's final norm, config)

then the rows of the request's generated tokens are mean-pooled (``pool`` "mean") or the last one taken
(``pool`` "last"), standardized and scored by the probe: ``p = sigmoid(z . w + b)`` = P(the answer is wrong).

Results: every step, one row per request (at its newest position) with the running ``p_hallucination`` over the
answer so far and ``tokens``; at the request's end one row (position -1) with the final ``p_hallucination``,
``tokens``, and ``alert`` when ``p >= threshold``. The shipped probe (``probes/science-smollm2-135m.json``) was
trained here by ``scripts/train_probes.py`` on element questions (symbols, atomic numbers, from the
``periodictable`` package) answered by the embedded model; metrics in the file and in docs/analyzers.md.

Config: ``probe`` (path or shipped file name), ``threshold`` (default: the probe's), ``model`` (the model dir
whose final norm to apply; default: the stream's ``StreamStart.model`` when it is a local directory, else the
embedded model).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import numpy as np

from mia_stream.analyzers._base import (Analyzer, Needs, RequestTable, Results, layer_rows, layer_values,
                                        segments_of)
from mia_stream.analyzers._probe import LinearProbe, load_probe, resolve_probe_path, sigmoid
from mia_stream.errors import AnalyzerConfigError, AnalyzerInputError
from mia_stream.schemas import StepBatch, StreamEnd, StreamStart

DEFAULT_PROBE = "science-smollm2-135m.json"
_NORM_KEYS = ("model.norm.weight", "norm.weight", "model.final_layernorm.weight")


@functools.lru_cache(maxsize=4)
def final_norm(model_dir: str) -> tuple[np.ndarray, float]:
    """The model's final RMSNorm: (weight float32 [hidden], eps) read from a Hugging Face model directory."""
    d = Path(model_dir)
    try:
        config = json.loads((d / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise AnalyzerConfigError(f"model dir {d}: no readable config.json ({e})") from None
    eps = config.get("rms_norm_eps")
    if not isinstance(eps, (int, float)):
        raise AnalyzerConfigError(f"model dir {d}: config.json has no rms_norm_eps (not an RMSNorm model?)")
    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise AnalyzerConfigError(f"model dir {d}: no *.safetensors weights")
    for f in files:
        found = _safetensors_vector(f, _NORM_KEYS)
        if found is not None:
            return found, float(eps)
    raise AnalyzerConfigError(f"model dir {d}: no final norm weight ({' / '.join(_NORM_KEYS)}) in its weights")


_ST_DTYPES = {"F32": "<f4", "F16": "<f2", "BF16": "<u2", "F64": "<f8"}


def _safetensors_vector(path: Path, keys: tuple) -> np.ndarray | None:
    """One 1-D tensor of a safetensors file as float32, read by hand: numpy has no bfloat16 (the safetensors
    package's numpy reader refuses it) and importing torch for one vector costs 5-16 s of an analyzer's start."""
    with open(path, "rb") as fh:
        n = int.from_bytes(fh.read(8), "little")
        try:
            header = json.loads(fh.read(n))
        except ValueError:
            raise AnalyzerConfigError(f"{path}: not a safetensors file") from None
        key = next((k for k in keys if k in header), None)
        if key is None:
            return None
        meta = header[key]
        dtype = _ST_DTYPES.get(meta.get("dtype"))
        a, b = meta.get("data_offsets", (0, 0))
        if dtype is None or len(meta.get("shape", ())) != 1:
            raise AnalyzerConfigError(f"{path}: {key} is {meta.get('dtype')} {meta.get('shape')}, want a vector")
        fh.seek(8 + n + a)
        raw = np.frombuffer(fh.read(b - a), dtype=dtype)
    if meta["dtype"] == "BF16":
        return (raw.astype(np.uint32) << 16).view(np.float32)
    return raw.astype(np.float32)


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """Llama RMSNorm as Hugging Face computes it (float32): x * rsqrt(mean(x^2) + eps) * weight; ``x`` [N, H]."""
    x = np.asarray(x, np.float32)
    var = np.square(x).mean(axis=-1, keepdims=True)
    return (x / np.sqrt(var + np.float32(eps))) * weight


class ScienceHallucination(Analyzer):
    """Trained classifier on the final-normed answer states: is this science answer wrong?"""

    name = "science_hallucination"
    version = "1"
    defaults = {"probe": DEFAULT_PROBE, "threshold": None, "model": None}

    def configure(self, config: dict) -> None:
        probe = load_probe(resolve_probe_path(config["probe"], "science_hallucination config"),
                           "science_hallucination")
        self.probe: LinearProbe = probe
        thr = probe.threshold if config["threshold"] is None else config["threshold"]
        if isinstance(thr, bool) or not isinstance(thr, (int, float)) or not 0 <= thr <= 1:
            raise AnalyzerConfigError(f"science_hallucination config: 'threshold' must be a probability in "
                                      f"[0, 1], got {thr!r}")
        self.threshold = float(thr)
        model = config["model"]
        if model is not None and not (isinstance(model, str) and Path(model).is_dir()):
            raise AnalyzerConfigError(f"science_hallucination config: 'model' must be a model directory, "
                                      f"got {model!r}")
        self._needs = Needs(hs_layers=(probe.layer,), hs_positions=probe.position)
        self.norm: tuple[np.ndarray, float] | None = None
        self.row_weights: np.ndarray | None = None  # norm weight x (w / scale): a row's score in one pass
        self.offset = 0.0
        # per request: the sum of its rows' scores (the mean's score is linear in the rows), the last row's
        # score, the rows counted: no hidden-size state per request
        self.table = RequestTable(score_sum=((), np.float64), last_score=((), np.float64), count=((), np.int64))

    def needs(self) -> Needs:
        return self._needs

    def on_start(self, start: StreamStart) -> None:
        super().on_start(start)
        probe = self.probe
        probe.check_stream(start, layers="the probe reads the final layer of a")
        if self.norm is None:
            weight, eps = self.norm = final_norm(self._model_dir(start))
            v, self.offset = probe.folded(np.float64)
            self.row_weights = (weight.astype(np.float64) * v).astype(np.float32)

    def _model_dir(self, start: StreamStart) -> str:
        if self.config["model"]:
            return self.config["model"]
        if start.model and Path(start.model).is_dir():
            return start.model
        from mia_stream.model import default_model_dir

        return str(default_model_dir())

    def on_batch(self, batch: StepBatch, out: Results) -> None:
        if self.norm is None:
            return
        eps = self.norm[1]
        probe, table = self.probe, self.table
        ids = batch.request_ids
        for g in batch.groups:
            if not g.has("hs"):
                continue
            t = g.tensor("hs")
            if t.shape[2] != probe.hidden_size:
                raise AnalyzerInputError(f"hs rows of width {t.shape[2]}, the probe needs {probe.hidden_size}")
            x = layer_values(t, int(layer_rows(t, (probe.layer,))[0]))  # [N, H] float32
            positions = g.positions
            mask = self.position_mask(batch, g, probe.position)
            if mask is not None:  # e.g. the prompt rows of a stream that captures every position
                x, positions = x[mask], positions[mask]
            if not len(x):
                continue
            # probe(norm(x)) = (x . (norm_weight * w / scale)) / rms(x) + c: one pass for the dot, one for the rms
            rms = np.sqrt(np.square(x).mean(axis=1, dtype=np.float32) + np.float32(eps))
            scores = (x * self.row_weights).sum(axis=1, dtype=np.float64) / rms
            kept, off = segments_of(g.rows, mask)
            keep = kept > 0
            seg_requests, seg_rows, off = g.requests[keep], kept[keep], off[keep]
            last = off + seg_rows - 1
            slots = table.slots([ids[i] for i in seg_requests.tolist()])
            table["score_sum"][slots] += np.add.reduceat(scores, off) if len(scores) != len(off) else scores
            table["last_score"][slots] = scores[last]
            table["count"][slots] += seg_rows
            out.add(ids, seg_requests, positions[last], self._scores(slots))

    def on_end(self, request_id: str, end: StreamEnd | None, out: Results) -> None:
        slot = self.table.slot(request_id)
        if slot is None:
            return
        if end is not None:
            values = {k: v[0] for k, v in self._scores(np.asarray([slot])).items()}
            out.add_one(request_id, values, alert=bool(values["p_hallucination"] >= self.threshold))
        self.table.release(request_id)

    def _scores(self, slots: np.ndarray) -> dict:
        table = self.table
        count = table["count"][slots]
        if self.probe.pool == "mean":
            logit = table["score_sum"][slots] / np.maximum(count, 1)
        else:
            logit = table["last_score"][slots]
        return {"p_hallucination": sigmoid(logit + self.offset).astype(np.float32), "tokens": count.copy()}
