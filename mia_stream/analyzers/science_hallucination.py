"""``science_hallucination``: the seed's SciHal claim classifier. Given a reference and a claim, a classifier on
the model's final hidden state (with the model's final norm applied) says whether the reference supports the
claim (``entailment``), contradicts it (``contradiction``) or does not address it (``unverifiable``).

Seed: IBM/vLLM-Hook ``mia/analyzers/science_hallucination_analyzer.py`` and ``examples/demo_scihal.py``, after the
SciHal challenge (github.com/InfintyLab/SciHal-Challenge): the request is the SciHal prompt (a system task line,
solved examples, "Input: #Claim: ... #Reference: ...", "Output:"), the captured residual of the final layer is
normalized with the model's final RMSNorm and a trained scikit-learn classifier predicts one of the three labels.
Build the request with ``lab.claims_data.scihal_messages(reference, claim)`` (the seed's prompt) and send it with
the capture of ``--print-spec``.

Here: the row is the **last prompt token** (the state before the model writes its verdict); the seed reads the
last token of the prompt plus the model's own justification, which a 135M model does not write usefully (and
which costs a long generation). The classifier is a multinomial logistic regression stored as JSON (format
``mia_stream.multiclass_probe/1``: ``classes``, ``layer``, ``position``, ``final_norm``, ``mean``/``scale``
[H], ``weights`` [C, H], ``bias`` [C], ``training``, ``metrics``)::

    n      = x / sqrt(mean(x^2) + eps) * norm_weight        (when final_norm: the model dir's final norm)
    z      = (n - mean) / scale
    probs  = softmax(weights . z + bias)                  -> value ``probs`` [C]; label ``prediction``

One row per request at its last prompt position: ``probs`` (classes in the probe's order), ``class`` (index);
label ``prediction``; alert when the prediction is in ``alert_on`` (default: contradiction, unverifiable).
The shipped probe (``probes/science-smollm2-135m.json``) was trained here by ``scripts/eval_science.py`` on
claims generated from package facts (``lab.claims_data``; countries and chemical elements), held out by entity;
its metrics beside a lexical-overlap classifier and the model's own log-probability of "true" are in the file
and in docs/analyzers.md.

Config: ``probe`` (path or shipped file name), ``alert_on`` (class names), ``model`` (the model dir whose
final norm to apply; default: the stream's ``StreamStart.model`` when it is a local directory, else the
embedded model).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from mia_stream.analyzers._base import Analyzer, Needs, Results, layer_rows, layer_values
from mia_stream.analyzers._probe import resolve_probe_path
from mia_stream.errors import AnalyzerConfigError, AnalyzerInputError
from mia_stream.schemas import StepBatch, StreamStart

DEFAULT_PROBE = "science-smollm2-135m.json"
FORMAT = "mia_stream.multiclass_probe/1"
SCIHAL_CLASSES = ("entailment", "contradiction", "unverifiable")
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


@dataclass
class MulticlassProbe:
    """A multinomial logistic classifier on one layer's (optionally final-normed) hidden state."""

    analyzer: str
    model: str
    hidden_size: int
    num_layers: int
    layer: int
    position: str
    final_norm: bool
    classes: list
    mean: np.ndarray
    scale: np.ndarray
    weights: np.ndarray  # [C, H]
    bias: np.ndarray  # [C]
    training: dict = field(default_factory=dict)
    metrics: dict = field(default_factory=dict)
    path: str = ""

    def probs(self, x: np.ndarray) -> np.ndarray:
        """``[N, H]`` (already final-normed when ``final_norm``) -> ``[N, C]`` float64, row by row (row-wise sums:
        a row's result never depends on the other rows of its batch)."""
        z = (np.asarray(x, np.float64) - self.mean) / self.scale
        logits = (z[:, None, :] * self.weights[None]).sum(axis=-1) + self.bias
        logits -= logits.max(axis=1, keepdims=True)
        e = np.exp(logits)
        return e / e.sum(axis=1, keepdims=True)

    def to_json(self) -> dict:
        return {"format": FORMAT, "analyzer": self.analyzer, "model": self.model, "hidden_size": self.hidden_size,
                "num_layers": self.num_layers, "layer": self.layer, "position": self.position,
                "final_norm": self.final_norm, "classes": list(self.classes), "mean": self.mean.tolist(),
                "scale": self.scale.tolist(), "weights": self.weights.tolist(), "bias": self.bias.tolist(),
                "training": self.training, "metrics": self.metrics}

    def save(self, path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=1) + "\n")


def load_multiclass_probe(path, analyzer: str = "science_hallucination") -> MulticlassProbe:
    """Read and check a ``mia_stream.multiclass_probe/1`` file; one-line ``AnalyzerConfigError`` naming the key."""
    p = Path(path)
    where = f"probe file {p}"
    try:
        data = json.loads(p.read_text())
    except OSError as e:
        raise AnalyzerConfigError(f"{where}: {e.strerror or e}") from None
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise AnalyzerConfigError(f"{where}: not a JSON file") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise AnalyzerConfigError(f"{where}: 'format' must be {FORMAT!r}, got "
                                  f"{data.get('format') if isinstance(data, dict) else type(data).__name__!r}")
    if data.get("analyzer") != analyzer:
        raise AnalyzerConfigError(f"{where}: a probe for analyzer {data.get('analyzer')!r}, not {analyzer!r}")

    def need(key, check, desc):
        if key not in data:
            raise AnalyzerConfigError(f"{where}: missing key {key!r}")
        if not check(data[key]):
            raise AnalyzerConfigError(f"{where}: {key!r} must be {desc}, got {str(data[key])[:60]}")
        return data[key]

    is_int = lambda v: isinstance(v, int) and not isinstance(v, bool)  # noqa: E731
    hidden = need("hidden_size", lambda v: is_int(v) and v > 0, "a positive integer")
    classes = need("classes", lambda v: isinstance(v, list) and len(v) >= 2 and all(isinstance(c, str) for c in v)
                   and len(set(v)) == len(v), "a list of 2 or more distinct class names")
    C = len(classes)

    def array(key, shape, positive=False):
        try:
            a = np.asarray(need(key, lambda v: isinstance(v, list), "a list"), np.float64)
        except (TypeError, ValueError):
            raise AnalyzerConfigError(f"{where}: {key!r} must hold numbers") from None
        if a.shape != shape or not np.isfinite(a).all() or (positive and (a <= 0).any()):
            raise AnalyzerConfigError(f"{where}: {key!r} must be {'positive ' if positive else ''}finite numbers "
                                      f"of shape {list(shape)}, got {list(a.shape)}")
        return a

    return MulticlassProbe(
        analyzer=analyzer, model=str(data.get("model", "")), hidden_size=hidden,
        num_layers=int(data.get("num_layers", 0) or 0),
        layer=need("layer", lambda v: is_int(v) and v >= 0, "a layer index"),
        position=need("position", lambda v: v in ("last_prompt", "generated", "prompt", "all"),
                      "one of last_prompt, generated, prompt, all"),
        final_norm=bool(need("final_norm", lambda v: isinstance(v, bool), "true or false")), classes=classes,
        mean=array("mean", (hidden,)), scale=array("scale", (hidden,), positive=True),
        weights=array("weights", (C, hidden)), bias=array("bias", (C,)),
        training=data.get("training") if isinstance(data.get("training"), dict) else {},
        metrics=data.get("metrics") if isinstance(data.get("metrics"), dict) else {}, path=str(p))


class ScienceHallucination(Analyzer):
    """The seed's SciHal classifier: reference + claim -> entailment / contradiction / unverifiable."""

    name = "science_hallucination"
    version = "2"  # 2: the seed's three-class claim classifier (1 was a wrong-answer probe on element questions)
    defaults = {"probe": DEFAULT_PROBE, "alert_on": ["contradiction", "unverifiable"], "model": None}

    def configure(self, config: dict) -> None:
        probe = load_multiclass_probe(resolve_probe_path(config["probe"], "science_hallucination config"))
        self.probe = probe
        alert_on = config["alert_on"]
        if not isinstance(alert_on, list) or any(c not in probe.classes for c in alert_on):
            raise AnalyzerConfigError(f"science_hallucination config: 'alert_on' must be a list of the probe's "
                                      f"classes {probe.classes}, got {alert_on!r}")
        self.alert_index = np.array([c in alert_on for c in probe.classes])
        model = config["model"]
        if model is not None and not (isinstance(model, str) and Path(model).is_dir()):
            raise AnalyzerConfigError(f"science_hallucination config: 'model' must be a model directory, "
                                      f"got {model!r}")
        self._needs = Needs(hs_layers=(probe.layer,), hs_positions=probe.position)
        self.norm: tuple[np.ndarray, float] | None = None

    def needs(self) -> Needs:
        return self._needs

    def on_start(self, start: StreamStart) -> None:
        super().on_start(start)
        probe = self.probe
        if start.hidden_size and start.hidden_size != probe.hidden_size:
            raise AnalyzerInputError(f"request {start.request_id!r}: the probe {probe.path} is for hidden size "
                                     f"{probe.hidden_size} ({probe.model}), the stream's model has {start.hidden_size}")
        if start.num_layers and probe.num_layers and start.num_layers != probe.num_layers:
            raise AnalyzerInputError(f"request {start.request_id!r}: the probe {probe.path} is for a "
                                     f"{probe.num_layers}-layer model, the stream's model has {start.num_layers}")
        if probe.final_norm and self.norm is None:
            self.norm = final_norm(self._model_dir(start))

    def _model_dir(self, start: StreamStart) -> str:
        if self.config["model"]:
            return self.config["model"]
        if start.model and Path(start.model).is_dir():
            return start.model
        from mia_stream.model import default_model_dir

        return str(default_model_dir())

    def on_batch(self, batch: StepBatch, out: Results) -> None:
        probe = self.probe
        for g in batch.groups:
            if not g.has("hs") or not g.num_rows:
                continue
            t = g.tensor("hs")
            if t.shape[2] != probe.hidden_size:
                raise AnalyzerInputError(f"hs rows of width {t.shape[2]}, the probe needs {probe.hidden_size}")
            x = layer_values(t, int(layer_rows(t, (probe.layer,))[0]))  # [N, H] float32
            positions, row_requests = g.positions, g.row_requests
            mask = self.position_mask(batch, g, probe.position)
            if mask is not None:
                x, positions, row_requests = x[mask], positions[mask], row_requests[mask]
            if not len(x):
                continue
            if probe.final_norm:
                x = rms_norm(x, *self.norm)
            p = probe.probs(x)
            k = p.argmax(axis=1)
            out.add(batch.request_ids, row_requests, positions, {"probs": p, "class": k.astype(np.int64)},
                    {"prediction": [probe.classes[i] for i in k.tolist()]}, alerts=self.alert_index[k])
