"""Linear probe files: a logistic classifier on standardized hidden states, with how it was trained.

Format ``mia_stream.probe/1``: one JSON object (small: 4 vectors of the hidden size), readable from any
language::

    {"format": "mia_stream.probe/1", "analyzer": "hnode", "model": "SmolLM2-135M-Instruct",
     "hidden_size": 576, "num_layers": 30,
     "layer": 14,                      # the captured layer (residual after decoder layer 14)
     "num_features": 270,              # optional: vectors of this length instead of hidden_size (probes on
                                       # features other than one hidden state, e.g. lookback ratios)
     "position": "last_prompt",        # which rows it was trained on (hnode: last_prompt; science: generated)
     "final_norm": false,              # true: the model's final RMSNorm is applied to each row first
     "pool": "last",                   # "last" row | "mean" over the rows (science_hallucination)
     "mean": [...], "scale": [...],    # z = (x - mean) / scale
     "weights": [...], "bias": 0.1,    # p = sigmoid(z . weights + bias) = P(label 1)
     "logit_features": {               # optional: the token's own sampling statistics beside the residual
        "names": ["logprob", "entropy"],   #   (LOGIT_FEATURES; the model's raw distribution at the step that
        "mean": [...], "scale": [...],     #   sampled the token: its log-probability, the entropy in nats)
        "weights": [...]},                 #   p = sigmoid(z . weights + ((f - mean) / scale) . weights' + bias)
     "threshold": 0.5,                 # alert when p >= threshold
     "positive": "hallucination: the model's answer was wrong",
     "extra": {...},                   # analyzer-specific (hnode: the H-Nodes and their grounded baseline)
     "training": {...},                # data set, sizes, split, seed, regularization, the command
     "metrics": {...}}                 # held-out results (test_auc, ...)

A file that is not such an object is an ``AnalyzerConfigError`` naming the file and the bad key.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from mia_stream import settings
from mia_stream.spec._stored import DIGEST as _DIGEST
from mia_stream.spec._stored import NAME as _NAME
from mia_stream.spec._stored import registry_main, replace_atomically
from mia_stream.errors import AnalyzerConfigError, AnalyzerInputError

FORMAT = "mia_stream.probe/1"
LOGIT_FEATURES = ("logprob", "entropy")  # what an in-engine detector can read beside the residual
PROBES_DIR = Path(__file__).resolve().parents[1] / "analyzers" / "probes"  # the shipped probe files (data only)


@dataclass
class LinearProbe:
    analyzer: str
    model: str
    hidden_size: int
    layer: int
    position: str
    mean: np.ndarray
    scale: np.ndarray
    weights: np.ndarray
    bias: float
    threshold: float = 0.5
    final_norm: bool = False
    pool: str = "last"
    num_layers: int = 0
    num_features: int = 0  # 0: the vectors have hidden_size entries
    logit_features: dict = field(default_factory=dict)  # {"names", "mean", "scale", "weights"} (arrays), or empty
    positive: str = ""
    extra: dict = field(default_factory=dict)
    training: dict = field(default_factory=dict)
    metrics: dict = field(default_factory=dict)
    path: str = ""

    def logits(self, x: np.ndarray) -> np.ndarray:
        """``[N, H]`` rows -> ``[N]`` float64 logits (vectorized; float64 so results never depend on the batch)."""
        z = (np.asarray(x, np.float64) - self.mean) / self.scale
        return (z * self.weights).sum(axis=1) + self.bias  # row-wise: independent of the batch's other rows

    def logit_feature_weights(self) -> tuple[np.ndarray, float]:
        """(u, d): the logit features' contribution to the logit is ``f . u + d`` with ``f`` in ``LOGIT_FEATURES``
        order (zeros for the features the probe does not read)."""
        u, d = np.zeros(len(LOGIT_FEATURES)), 0.0
        lf = self.logit_features
        for name, m, sc, w in zip(lf.get("names", ()), lf.get("mean", ()), lf.get("scale", ()), lf.get("weights", ())):
            u[LOGIT_FEATURES.index(name)] += w / sc
            d -= m / sc * w
        return u, d

    def folded(self, dtype=np.float32) -> tuple[np.ndarray, float]:
        """(v, c) with ``logits(x) == x . v + c``: the standardization folded into the weights, so scoring a row
        reads it once (v = w / scale, c = b - (mean / scale) . w)."""
        v = self.weights / self.scale
        return v.astype(dtype), float(self.bias - (self.mean / self.scale) @ self.weights)

    def standardize(self, x: np.ndarray) -> np.ndarray:
        return (np.asarray(x, np.float64) - self.mean) / self.scale

    def to_json(self) -> dict:
        return {"format": FORMAT, "analyzer": self.analyzer, "model": self.model, "hidden_size": self.hidden_size,
                "num_layers": self.num_layers, "layer": self.layer, "position": self.position,
                "final_norm": self.final_norm, "pool": self.pool, "mean": self.mean.tolist(),
                "scale": self.scale.tolist(), "weights": self.weights.tolist(), "bias": float(self.bias),
                "threshold": float(self.threshold), "positive": self.positive, "extra": self.extra,
                "training": self.training, "metrics": self.metrics,
                **({"num_features": self.num_features} if self.num_features else {}),
                **({"logit_features": {k: (list(v) if not isinstance(v, np.ndarray) else v.tolist())
                                       for k, v in self.logit_features.items()}} if self.logit_features else {})}

    def check_stream(self, start: Any, layers: str = "the probe {path} is for a") -> None:
        """``AnalyzerInputError`` when the stream's model (``StreamStart.hidden_size`` / ``num_layers``; 0:
        unknown) is not the probe's. ``layers``: the start of the layer-count message, naming what the probe
        reads (``{path}`` is filled in)."""
        if start.hidden_size and start.hidden_size != self.hidden_size:
            raise AnalyzerInputError(f"request {start.request_id!r}: the probe {self.path} is for hidden size "
                                     f"{self.hidden_size} ({self.model}), the stream's model has {start.hidden_size}")
        if start.num_layers and self.num_layers and start.num_layers != self.num_layers:
            raise AnalyzerInputError(f"request {start.request_id!r}: {layers.format(path=self.path)} "
                                     f"{self.num_layers}-layer model, the stream's model has {start.num_layers}")

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=1) + "\n")


def _logit_features(raw: Any, where: str) -> dict:
    if not isinstance(raw, dict) or set(raw) != {"names", "mean", "scale", "weights"}:
        raise AnalyzerConfigError(f"{where}: 'logit_features' must be an object with names, mean, scale, weights")
    names = raw["names"]
    if (not isinstance(names, list) or not names or len(set(names)) != len(names)
            or any(n not in LOGIT_FEATURES for n in names)):
        raise AnalyzerConfigError(f"{where}: logit_features.names must be distinct names of {list(LOGIT_FEATURES)}, "
                                  f"got {names!r}")
    out: dict[str, Any] = {"names": list(names)}
    for key in ("mean", "scale", "weights"):
        try:
            arr = np.asarray(raw[key], np.float64)
        except (TypeError, ValueError):
            arr = np.zeros(0)
        if arr.shape != (len(names),) or not np.isfinite(arr).all() or (key == "scale" and (arr <= 0).any()):
            raise AnalyzerConfigError(f"{where}: logit_features.{key} must be {len(names)} finite"
                                      f"{' positive' if key == 'scale' else ''} numbers")
        out[key] = arr.tolist()
    return out


def sigmoid(x: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * np.asarray(x, np.float64)))  # overflow-free logistic


def resolve_probe_path(value: Any, what: str) -> Path:
    """A probe path from a config: a file path, or the name of a probe shipped in ``analyzers/probes``."""
    if not isinstance(value, str) or not value:
        raise AnalyzerConfigError(f"{what}: 'probe' must be a file path, got {value!r}")
    p = Path(value).expanduser()
    if not p.exists() and (PROBES_DIR / value).exists():
        p = PROBES_DIR / value
    return p


def load_probe(path: str | Path, analyzer: str | None) -> LinearProbe:
    """Read and check a probe file; AnalyzerConfigError (one line, naming the file and key) if malformed.
    ``analyzer`` None: a probe of any analyzer."""
    p = Path(path)
    where = f"probe file {p}"
    try:
        return probe_from_text(p.read_text(), analyzer, str(p))
    except UnicodeDecodeError:
        raise AnalyzerConfigError(f"{where}: not a text (JSON) file") from None
    except OSError as e:
        raise AnalyzerConfigError(f"{where}: {e.strerror or e}") from None


def probe_from_text(text: str, analyzer: str | None, path: str = "") -> LinearProbe:
    """A probe from a probe file's text (``path``: what errors and ``LinearProbe.path`` name)."""
    p = path
    where = f"probe file {p}"
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise AnalyzerConfigError(f"{where}: not valid JSON: {e.msg} at line {e.lineno}") from None
    if not isinstance(data, dict):
        raise AnalyzerConfigError(f"{where}: must hold a JSON object, got {type(data).__name__}")
    if data.get("format") != FORMAT:
        raise AnalyzerConfigError(f"{where}: 'format' must be {FORMAT!r}, got {data.get('format')!r}")
    if analyzer is not None and data.get("analyzer") != analyzer:
        raise AnalyzerConfigError(f"{where}: a probe for analyzer {data.get('analyzer')!r}, not {analyzer!r}")

    def need(key: str, kind, check=None, desc: str = ""):
        if key not in data:
            raise AnalyzerConfigError(f"{where}: missing key {key!r}")
        v = data[key]
        if not isinstance(v, kind) or isinstance(v, bool) and kind is not bool or (check and not check(v)):
            raise AnalyzerConfigError(f"{where}: {key!r} must be {desc or getattr(kind, '__name__', kind)}, "
                                      f"got {str(v)[:60]}")
        return v

    hidden = need("hidden_size", int, lambda v: v > 0, "a positive integer")
    width = need("num_features", int, lambda v: v > 0, "a positive integer") if "num_features" in data else hidden

    def vector(key: str, positive: bool = False) -> np.ndarray:
        v = need(key, list, None, f"a list of {width} numbers")
        try:
            arr = np.asarray(v, dtype=np.float64)
        except (TypeError, ValueError):
            raise AnalyzerConfigError(f"{where}: {key!r} must be a list of {width} numbers") from None
        if arr.shape != (width,) or not np.isfinite(arr).all() or (positive and (arr <= 0).any()):
            raise AnalyzerConfigError(f"{where}: {key!r} must be {width} finite{' positive' if positive else ''} "
                                      f"numbers, got shape {arr.shape}")
        return arr

    finite = lambda v: math.isfinite(v)  # noqa: E731
    logit_features = _logit_features(data.get("logit_features"), where) if "logit_features" in data else {}
    return LinearProbe(
        analyzer=str(data.get("analyzer", "")), model=str(data.get("model", "")), hidden_size=hidden,
        layer=need("layer", int, lambda v: v >= 0, "a layer index"),
        position=need("position", str, lambda v: v in ("all", "prompt", "generated", "last_prompt"),
                      "one of all, prompt, generated, last_prompt"),
        mean=vector("mean"), scale=vector("scale", positive=True), weights=vector("weights"),
        bias=float(need("bias", (int, float), finite, "a number")),
        threshold=float(need("threshold", (int, float), lambda v: 0 <= v <= 1, "a probability in [0, 1]")),
        final_norm=bool(data.get("final_norm", False)),
        pool=need("pool", str, lambda v: v in ("last", "mean"), "'last' or 'mean'") if "pool" in data else "last",
        num_layers=int(data.get("num_layers", 0) or 0), num_features=width if "num_features" in data else 0,
        logit_features=logit_features,
        positive=str(data.get("positive", "")),
        extra=data.get("extra") if isinstance(data.get("extra"), dict) else {},
        training=data.get("training") if isinstance(data.get("training"), dict) else {},
        metrics=data.get("metrics") if isinstance(data.get("metrics"), dict) else {}, path=str(p))


# ---------------------------------------------------------------------------------------------- the registry
# Registered probes (``mia-stream probes add NAME FILE``) live as checked probe files in ``$MIA_STREAM_PROBES``
# (default ``~/.cache/mia_stream/probes``), shared by every engine on the machine. Every version a request used is
# also kept, write-once, under its content digest (``.by-digest/DIGEST.json``): the frontend hands the engine a
# detector's probe as ``{"digest", "ref"}`` and the engine scores with exactly the file the frontend checked, even
# if the name is registered again in between (the same rule as named steering vectors).



def probes_dir() -> Path:
    from mia_stream.model import cache_dir

    return settings.get_path("MIA_STREAM_PROBES") or cache_dir() / "probes"


def probe_digest(text: str) -> str:
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


def _write_atomically(path: Path, text: str) -> None:
    replace_atomically(path, lambda f: f.write(text.encode()))


def _registered_path(name: str) -> Path:
    if not _NAME.match(name):
        raise AnalyzerConfigError(f"probe name {name!r} must match {_NAME.pattern}")
    return probes_dir() / f"{name}.json"


def register_probe(name: str, file: str | Path) -> Path:
    """Check the probe file ``file`` and store it as ``name`` (replacing an existing one atomically)."""
    path = _registered_path(name)
    text = Path(file).read_text()
    probe_from_text(text, None, str(file))  # refuse a malformed file here, not at a request's admission
    _write_atomically(path, text)
    return path


def list_probes() -> dict[str, LinearProbe]:
    d = probes_dir()
    return {p.stem: load_probe(p, None) for p in sorted(d.glob("*.json"))} if d.exists() else {}


def _by_digest_path(digest: str) -> Path:
    return probes_dir() / ".by-digest" / f"{digest}.json"


_loaded: dict[tuple, tuple[LinearProbe, str]] = {}  # (path, mtime, size) or digest -> (probe, digest)
_CACHE_ENTRIES = 256


def _remember(key: Any, value: tuple) -> tuple:
    if len(_loaded) >= _CACHE_ENTRIES:
        _loaded.pop(next(iter(_loaded)))
    _loaded[key] = value
    return value


def resolve_probe(ref: Any) -> tuple[LinearProbe, str]:
    """A detector's probe and its content digest. ``ref``: a registered name, a shipped probe's file name (with or
    without ``.json``), a file path, or ``{"digest": D, ...}`` as a normalized spec carries it. ``KeyError`` naming
    what was looked for when there is no such probe; ``AnalyzerConfigError`` for a malformed file."""
    if isinstance(ref, dict):
        digest = ref.get("digest")
        if not isinstance(digest, str) or not _DIGEST.match(digest):
            raise KeyError(f"probe digest {digest!r}")
        hit = _loaded.get(digest)
        if hit is not None:
            return hit
        try:
            text = _by_digest_path(digest).read_text()
        except FileNotFoundError:
            # a process with another probes dir (a worker started with other settings): the name or path the
            # request gave, if it still holds exactly this content
            given = ref.get("ref")
            if isinstance(given, str) and given:
                try:
                    hit = resolve_probe(given)
                except KeyError:
                    hit = None
                if hit is not None and hit[1] == digest:
                    return _remember(digest, hit)
            raise KeyError(f"probe of digest {digest} (none on this machine)") from None
        return _remember(digest, (probe_from_text(text, None, str(ref.get("ref", digest))), digest))
    if not isinstance(ref, str) or not ref:
        raise KeyError(f"probe {ref!r}")
    candidates = [Path(ref).expanduser()]
    if _NAME.match(ref):
        candidates += [probes_dir() / f"{ref}.json", PROBES_DIR / ref, PROBES_DIR / f"{ref}.json"]
    for path in candidates:
        try:
            st = path.stat()
        except OSError:
            continue
        if not path.is_file():
            continue
        key = (str(path), st.st_mtime_ns, st.st_size)
        hit = _loaded.get(key)
        if hit is not None:
            return hit
        text = path.read_text()
        probe = probe_from_text(text, None, str(path))
        digest = probe_digest(text)
        keep = _by_digest_path(digest)
        if not keep.exists():
            _write_atomically(keep, text)
        return _remember(key, (probe, digest))
    raise KeyError(f"probe {ref!r} (not a registered probe, a shipped probe or a file)")


def main(argv: list[str]) -> int:
    """``mia-stream probes add NAME FILE | list | remove NAME``."""
    def rows():
        for name, p in list_probes().items():
            yield f"{name}\t{p.analyzer}\tlayer {p.layer}\t{p.position}\t{p.model}"
        for path in sorted(PROBES_DIR.glob("*.json")):
            yield f"{path.name}\t(shipped)"

    return registry_main(
        argv, prog="mia-stream probes", description="register detector probes that requests name in 'detect'",
        add_help="check FILE (a mia_stream.probe/1 file) and register it as NAME",
        list_help="list registered probes (and the shipped ones)", add=register_probe, rows=rows,
        path_of=_registered_path, errors=(ValueError, OSError, AnalyzerConfigError))
