"""Training and evaluating the hallucination detectors from a recording and its labels file
(``mia-stream probe train`` / ``eval``; the data come from ``mia-stream probe collect``).

Features are read from the recording by an analyzer (``FeatureReader``) run through the same runner as every
analyzer, so training sees exactly the rows a live analyzer sees: per request, the captured layers' residual
at the last prompt position (P - 1) and at each generated token's position (P + k, for k = 0 .. G - 2: the
last sampled token is never fed back, so it has no state), and the lookback ratios of each generated row
(``lookback_ratio.KeyCache``, the analyzer's own code). They are cached next to the labels file
(``features-<recording fingerprint>.npz``) so later commands skip the recording.

Rows and labels (label 1 = the model's greedy answer was wrong):

- ``token_probe`` and ``lookback_ratio`` train on the rows of the answer-span tokens (``answer_tokens`` of the
  labels file), each carrying its request's label (Obeso et al. train on entity-span tokens);
- ``semantic_entropy_probe`` trains on one row per request (the last prompt position, or the last generated
  row) with target ``semantic_entropy > t``, t the split of the training requests' values that minimizes the
  within-class squared error (Kossen et al.).

Every fit: features standardized on the training rows, L2 logistic regression with balanced class weights
(scikit-learn, lbfgs), its C chosen from ``CS`` by grouped 3-fold cross-validation on the training requests
(groups = facts: rephrasings never straddle a fold); the held-out requests (``split: test`` of the labels
file) are scored once, by the final probe. Metrics (AUROC, positive class = wrong answer):

- ``token_auc``: over the held-out answer-span tokens;
- ``answer_auc_span``: per held-out request, the max risk over its answer-span tokens;
- ``answer_auc``: per held-out request, the max risk over all its generated rows (what the analyzer's end
  row reports as ``risk_max``; semantic_entropy_probe: its one score).
"""

from __future__ import annotations

import datetime
import hashlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from mia_stream.lab import hallucination_data as hd
from mia_stream.analyzers._base import Analyzer, Needs, layer_rows
from mia_stream.analyzers._probe import PROBES_DIR, LinearProbe, sigmoid
from mia_stream.lab.probe_collect import LABELS_FORMAT, REQUEST_PREFIX
from mia_stream.analyzers.lookback_ratio import KeyCache, window_means
from mia_stream.errors import MiaStreamError, ProbeDataError

DETECTORS = ("token_probe", "semantic_entropy_probe", "lookback_ratio")
CS = (0.001, 0.01, 0.1, 1.0)
FOLDS = 3
LOOKBACK_WINDOW = 8  # Chuang et al.'s sliding window
SHIPPED = {"token_probe": "token-probe-smollm2-135m.json",
           "semantic_entropy_probe": "semantic-entropy-probe-smollm2-135m.json",
           "lookback_ratio": "lookback-ratio-smollm2-135m.json"}


# ------------------------------------------------------------------------------------------------ labels

def load_labels(path: str | Path) -> tuple[dict, list[dict]]:
    """The labels file's header and records; ProbeDataError (one line) when it is not one."""
    p = Path(path)
    where = f"labels file {p}"
    try:
        lines = p.read_text().splitlines()
    except OSError as e:
        raise ProbeDataError(f"{where}: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise ProbeDataError(f"{where}: not a text (JSON lines) file") from None
    try:
        rows = [json.loads(line) for line in lines if line.strip()]
    except json.JSONDecodeError as e:
        raise ProbeDataError(f"{where}: not JSON lines: {e.msg}") from None
    if not rows or not isinstance(rows[0], dict) or not isinstance(rows[0].get("header"), dict):
        raise ProbeDataError(f"{where}: the first line must be {{\"header\": {{...}}}} (mia-stream probe collect)")
    header = rows[0]["header"]
    if header.get("format") != LABELS_FORMAT:
        raise ProbeDataError(f"{where}: format must be {LABELS_FORMAT!r}, got {header.get('format')!r}")
    need = {"request_id": str, "group": str, "split": str, "prompt_len": int, "token_ids": list, "label": int,
            "answer_tokens": list, "logprobs": list, "entropies": list, "semantic_entropy": (int, float)}
    for n, r in enumerate(rows[1:], start=2):
        for key, kind in need.items():
            if not isinstance(r, dict) or not isinstance(r.get(key), kind):
                raise ProbeDataError(f"{where}: line {n}: {key!r} missing or not {getattr(kind, '__name__', kind)}")
    return header, rows[1:]


# ------------------------------------------------------------------------------------------------ features

class FeatureReader(Analyzer):
    """Collects, per request, the hidden-state rows a probe trains on and the lookback ratios of its generated
    rows (run through ``run_analyzer`` on a recording; publishes nothing)."""

    name = "probe_features"
    version = "1"

    def __init__(self, hs_layers: Sequence[int], qk_layers: Sequence[int]):
        super().__init__()
        self.hs_layers, self.qk_layers = list(hs_layers), list(qk_layers)
        self.rows: dict[str, dict[int, np.ndarray]] = {}  # rid -> position -> [L, H]
        self.ratios: dict[str, dict[int, np.ndarray]] = {}  # rid -> position -> [Lq, heads]
        self.cache = KeyCache(self.qk_layers) if self.qk_layers else None
        self.tokens: dict[str, dict[int, int]] = {}  # rid -> position -> sampled token id
        self.tags: dict[str, dict] = {}

    def on_start(self, start) -> None:
        super().on_start(start)
        self.tags[start.request_id] = dict(start.tags or {})

    def on_tokens(self, batch, out) -> None:
        counts = batch.counts if batch.counts is not None else np.ones(len(batch.request_ids), np.int64)
        offsets = np.r_[0, np.cumsum(counts)]
        for i, rid in enumerate(batch.request_ids):
            d = self.tokens.setdefault(rid, {})
            for j, t in enumerate(np.asarray(batch.token_ids)[offsets[i]:offsets[i + 1]].tolist()):
                d[int(batch.first_positions[i]) + j] = int(t)

    def needs(self) -> Needs:
        return Needs(hs_layers=tuple(self.hs_layers), hs_positions="all",
                     qk_layers=tuple(self.qk_layers), qk_positions="all")

    def on_batch(self, batch, out) -> None:
        ids = batch.request_ids
        for g in batch.groups:
            if g.has("hs") and self.hs_layers:
                t = g.tensor("hs")
                x = t.numpy()[layer_rows(t, self.hs_layers)]  # [L, N, H]
                plen = np.repeat([self.prompt_lengths.get(ids[i], 0) for i in g.requests.tolist()], g.rows)
                keep = np.flatnonzero(g.positions >= plen - 1)  # the last prompt row and the generated ones
                rr = g.row_requests
                for j in keep.tolist():
                    self.rows.setdefault(ids[rr[j]], {})[int(g.positions[j])] = np.array(x[:, j], np.float32)
            if self.cache is not None:
                found = self.cache.group_ratios(batch, g, self.prompt_lengths)
                if found is not None:
                    for i, p, lr in zip(*found):
                        self.ratios.setdefault(ids[i], {})[int(p)] = lr.astype(np.float32)

    def on_end(self, request_id, end, out) -> None:
        if self.cache is not None:
            self.cache.release(request_id)


@dataclass
class Features:
    request_ids: list
    hs_layers: list
    qk_layers: list
    tbg: np.ndarray  # [R, L, H] the last prompt row
    gen: np.ndarray  # [sum G', L, H] generated rows, request by request (G' = G - 1 rows each)
    offsets: np.ndarray  # [R + 1] into gen
    lr: np.ndarray  # [sum G', Lq, heads] lookback ratios of the same rows (empty without Q/K)
    info: dict = field(default_factory=dict)

    def of(self, r: int) -> slice:
        return slice(int(self.offsets[r]), int(self.offsets[r + 1]))


def _fingerprint(rec: Path) -> str:
    files = sorted(rec.glob("*.mcap")) if rec.is_dir() else [rec]
    h = hashlib.sha256()
    for f in files:
        st = f.stat()
        h.update(f"{f.name}|{st.st_size}|{st.st_mtime_ns}".encode())
    return h.hexdigest()[:16]


def read_features(recording: str | Path, labels: tuple[dict, list[dict]], labels_path: str | Path,
                  cache: bool = True, log=print, reader: "FeatureReader | None" = None) -> Features:
    """The features of every labelled request from ``recording`` (cached next to the labels file); ``reader``: a
    FeatureReader that already read it (``probe_relabel``)."""
    header, records = labels
    rec = Path(recording)
    if not rec.exists():
        raise ProbeDataError(f"recording {rec}: no such file or directory")
    cap = header.get("capture") or {}
    num_layers = int(header.get("num_layers") or 0)

    def layers_of(part: dict) -> list:
        v = part.get("layers") or []
        return list(range(num_layers)) if v == "all" else list(v)

    hs_layers = layers_of(cap.get("hidden_states") or {})
    qk_layers = layers_of(cap.get("qk") or {})
    cache_file = Path(labels_path).with_name(f"features-{_fingerprint(rec)}.npz")
    if cache and cache_file.exists():
        z = np.load(cache_file, allow_pickle=False)
        f = Features(z["request_ids"].tolist(), z["hs_layers"].tolist(), z["qk_layers"].tolist(), z["tbg"],
                     z["gen"], z["offsets"], z["lr"], json.loads(str(z["info"])))
        if f.request_ids == [r["request_id"] for r in records]:
            return f
    t0 = time.time()
    if reader is None:
        reader = FeatureReader(hs_layers, qk_layers)
        reader.gap_seqs = read_recording(reader, rec)
    H = None
    tbg, gen, lrs, offsets, missing = [], [], [], [0], []
    for r in records:
        rid, P, G = r["request_id"], r["prompt_len"], len(r["token_ids"])
        rows = reader.rows.get(rid, {})
        want = range(P - 1, P + G - 1)
        if any(p not in rows for p in want):
            missing.append(rid)
            rows = {p: rows.get(p) for p in want}
        H = H or next((v.shape for v in rows.values() if v is not None), None)
        blank = np.full(H or (len(hs_layers), 1), np.nan, np.float32)
        tbg.append(rows[P - 1] if rows[P - 1] is not None else blank)
        gen += [rows[p] if rows[p] is not None else blank for p in range(P, P + G - 1)]
        ratios = reader.ratios.get(rid, {})
        if qk_layers:
            z = np.full((len(qk_layers), int(header.get("num_heads") or 9)), np.nan, np.float32)
            lrs += [ratios.get(p, z) for p in range(P, P + G - 1)]
        offsets.append(offsets[-1] + G - 1)
    if missing:
        raise ProbeDataError(f"recording {rec}: {len(missing)} labelled request(s) lack captured rows (e.g. "
                             f"{missing[0]}: gaps or drops while recording); collect again")
    f = Features([r["request_id"] for r in records], hs_layers, qk_layers, np.stack(tbg),
                 np.stack(gen) if gen else np.zeros((0, *H), np.float32), np.asarray(offsets, np.int64),
                 np.stack(lrs) if lrs else np.zeros((0, len(qk_layers), 1), np.float32),
                 {"read_s": round(time.time() - t0, 1), "gaps": int(getattr(reader, "gap_seqs", 0))})
    log(f"read {len(records)} requests' features from {rec} in {f.info['read_s']} s")
    if cache:
        np.savez(cache_file, request_ids=np.asarray(f.request_ids), hs_layers=np.asarray(f.hs_layers),
                 qk_layers=np.asarray(f.qk_layers), tbg=f.tbg, gen=f.gen, offsets=f.offsets, lr=f.lr,
                 info=np.asarray(json.dumps(f.info)))
    return f


def read_recording(reader: FeatureReader, rec: Path) -> int:
    """Run ``reader`` over the recording's probe requests; the number of lost seqs (gaps)."""
    from mia_stream.analyzers import run_analyzer

    try:
        runner = run_analyzer(reader, str(rec), patterns=[f"{REQUEST_PREFIX}*"])
    except MiaStreamError as e:
        raise ProbeDataError(f"recording {rec}: {e}") from None
    if runner.rejected:
        rid, why = next(iter(runner.rejected.items()))
        raise ProbeDataError(f"recording {rec}: {len(runner.rejected)} request(s) lack what training reads, "
                             f"e.g. {why}")
    return int(runner.counters["gap_seqs"])


# ------------------------------------------------------------------------------------------------ data sets

@dataclass
class RowSet:
    """Rows to score and what to score them against."""

    X: np.ndarray  # [N, F]
    y: np.ndarray  # [N] 0/1
    groups: np.ndarray  # [N] fact of each row's request
    request: np.ndarray  # [N] index of each row's request


def _auc(y: np.ndarray, s: np.ndarray) -> float | None:
    from sklearn.metrics import roc_auc_score

    y = np.asarray(y)
    if len(np.unique(y)) < 2:
        return None
    return round(float(roc_auc_score(y, s)), 4)


class Dataset:
    """The labelled requests and their features, split as the labels file says."""

    def __init__(self, header: dict, records: list[dict], feats: Features):
        self.header, self.records, self.f = header, records, feats
        self.labels = np.asarray([r["label"] for r in records], np.int64)
        self.groups = np.asarray([r["group"] for r in records])
        self.split = np.asarray([r["split"] for r in records])
        self.rows = np.asarray([len(r["token_ids"]) - 1 for r in records], np.int64)  # generated rows
        # answer-span tokens that have a state (k <= G - 2)
        self.span = [[k for k in r["answer_tokens"] if k < len(r["token_ids"]) - 1] for r in records]
        # claim-level token labels of the rows (1 = an answer-span token of a wrong answer); older files: derived
        self.token_labels = [np.asarray((r.get("token_labels") or hd.token_labels(
            len(r["token_ids"]), r["answer_tokens"], bool(r["label"])))[:max(len(r["token_ids"]) - 1, 0)], np.int64)
            for r in records]

    def requests(self, split: str) -> np.ndarray:
        return np.flatnonzero((self.split == split) & (self.rows > 0))

    def calibration_split(self) -> str:
        """"val" where the labels file has a validation split, else "train" (older files)."""
        return "val" if len(self.requests("val")) else "train"

    def token_rows(self, split: str, features, rows: str = "span", reqs=None) -> RowSet:
        """Token rows of ``split``'s requests (or of ``reqs``); ``features(r) -> [G', F]`` per request.
        ``rows="span"``: the answer-span tokens, each with its request's label; ``"all"``: every generated row
        with its claim-level token label (function words and right claims are negatives)."""
        X, y, g, req = [], [], [], []
        for r in (self.requests(split) if reqs is None else np.asarray(reqs)).tolist():
            if rows == "all":
                X.append(features(r))
                n = int(self.rows[r])
                y += self.token_labels[r].tolist()
            else:
                if not self.span[r]:
                    continue
                X.append(features(r)[self.span[r]])
                n = len(self.span[r])
                y += [self.labels[r]] * n
            g += [self.groups[r]] * n
            req += [r] * n
        if not X:
            raise ProbeDataError(f"no {split} request has answer-span tokens with a captured state")
        return RowSet(np.concatenate(X), np.asarray(y), np.asarray(g), np.asarray(req))

    def semantic_targets(self) -> tuple[np.ndarray, float]:
        se = np.asarray([r["semantic_entropy"] for r in self.records], np.float64)
        threshold = hd.best_split(se[self.requests("train")].tolist())
        return (se > threshold).astype(np.int64), float(threshold)


def _fit_torch(Z: np.ndarray, y: np.ndarray, C: float) -> tuple[np.ndarray, float]:
    """scikit-learn's objective (``C * sum_i cw_i * logloss_i + |w|^2 / 2``, balanced class weights ``cw``)
    minimized by L-BFGS in torch float64 (GPU where there is one): where scikit-learn is not installed (the GPU
    host). The objective is strictly convex, so both reach the same weights."""
    import torch

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    Zt = torch.as_tensor(Z, dtype=torch.float64, device=dev)
    yt = torch.as_tensor(y, dtype=torch.float64, device=dev)
    n, n1 = len(y), float(y.sum())
    cw = torch.where(yt > 0, n / (2 * n1), n / (2 * (n - n1)))
    w = torch.zeros(Z.shape[1], dtype=torch.float64, device=dev, requires_grad=True)
    b = torch.zeros(1, dtype=torch.float64, device=dev, requires_grad=True)
    opt = torch.optim.LBFGS([w, b], lr=1, max_iter=500, tolerance_grad=1e-9, tolerance_change=1e-12,
                            history_size=20, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        z = Zt @ w + b
        loss = C * (cw * torch.nn.functional.softplus(-(2 * yt - 1) * z)).sum() + 0.5 * (w * w).sum()
        loss.backward()
        return loss

    for _ in range(5):
        opt.step(closure)
    return w.detach().cpu().numpy(), float(b.detach().cpu().item())


def fit_logistic(rows: RowSet, cs: Sequence[float] = CS, folds: int = FOLDS, seed: int = 0) -> dict:
    """Standardized L2 logistic regression; C by grouped k-fold CV AUROC on these (training) rows (one C given:
    no CV). scikit-learn where installed, else the same objective in torch (``_fit_torch``)."""
    try:
        from sklearn.linear_model import LogisticRegression
        from sklearn.model_selection import GroupKFold
    except ImportError:
        LogisticRegression = GroupKFold = None
    X, y = rows.X.astype(np.float64), rows.y
    if len(np.unique(y)) < 2:
        raise ProbeDataError(f"the training rows hold one class only ({len(y)} rows, label {int(y[0])}); "
                             "collect more questions")
    mean, scale = X.mean(0), X.std(0)
    scale[scale < 1e-8] = 1.0
    Z = (X - mean) / scale
    cv = {}
    n_groups = len(np.unique(rows.groups))
    if len(cs) > 1 and n_groups >= folds and GroupKFold is not None:
        for C in cs:
            scores = np.zeros(len(y))
            for tr, te in GroupKFold(n_splits=folds).split(Z, y, rows.groups):
                if len(np.unique(y[tr])) < 2:
                    scores[te] = 0.0
                    continue
                m = LogisticRegression(C=C, class_weight="balanced", max_iter=3000).fit(Z[tr], y[tr])
                scores[te] = m.decision_function(Z[te])
            cv[C] = _auc(y, scores) or 0.5
        C = max(cv, key=cv.get)
    else:
        C = cs[len(cs) // 2]
    if LogisticRegression is None:
        weights, bias = _fit_torch(Z, y, C)
    else:
        clf = LogisticRegression(C=C, class_weight="balanced", max_iter=5000).fit(Z, y)
        weights, bias = clf.coef_[0].astype(np.float64), float(clf.intercept_[0])
    return {"mean": mean, "scale": scale, "weights": weights, "bias": bias, "C": C, "cv_auc": cv.get(C),
            "cv": {str(k): v for k, v in cv.items()}}


def _probe_risk(fit: dict, X: np.ndarray) -> np.ndarray:
    """The analyzers' formula: x . (w / scale) + c, row-wise (see LinearProbe.folded)."""
    v = fit["weights"] / fit["scale"]
    c = fit["bias"] - (fit["mean"] / fit["scale"]) @ fit["weights"]
    return sigmoid((np.asarray(X, np.float64) * v).sum(axis=1) + c)


# ------------------------------------------------------------------------------------------------ detectors

def _layer_index(f: Features, layer: int) -> int:
    if layer not in f.hs_layers:
        raise ProbeDataError(f"layer {layer} is not in the recording (captured hidden-state layers: {f.hs_layers})")
    return f.hs_layers.index(layer)


def _lookback_columns(f: Features, layers: Sequence[int] | None) -> tuple[list, np.ndarray]:
    layers = list(f.qk_layers) if layers is None else list(layers)
    bad = sorted(set(layers) - set(f.qk_layers))
    if bad or not f.qk_layers:
        raise ProbeDataError(f"Q/K layer(s) {bad or layers} not in the recording (captured: {f.qk_layers})")
    return layers, np.asarray([f.qk_layers.index(x) for x in layers])


LOGIT_FEATURES = ("neg_logprob", "entropy", "next_entropy")


def logit_features(ds: Dataset, r: int) -> np.ndarray:
    """``[G', 3]`` per generated row k of request r: the token's -log p and the entropy of the distribution it
    was sampled from (the previous row's logits), and the entropy of the next token's distribution (this row's
    logits): what the row's own step knows."""
    rec, n = ds.records[r], int(ds.rows[r])
    lp = -np.asarray(rec["logprobs"], np.float64)
    en = np.asarray(rec["entropies"], np.float64)
    return np.stack([lp[:n], en[:n], en[1:n + 1]], axis=1).astype(np.float32)


def detector_features(ds: Dataset, detector: str, layer: int | None = None, layers: Sequence[int] | None = None,
                      position: str = "last_prompt", window: int = LOOKBACK_WINDOW, logit: bool = False):
    """``features(r) -> [G', F]`` per request (token_probe, lookback_ratio) or ``[1, F]`` (semantic_entropy_probe)."""
    f = ds.f
    if detector == "token_probe" and logit == "only":
        return lambda r: logit_features(ds, r)
    if detector == "token_probe" and logit:
        li = _layer_index(f, layer)
        return lambda r: np.concatenate([f.gen[f.of(r), li], logit_features(ds, r)], axis=1)
    if detector == "token_probe":
        li = _layer_index(f, layer)
        return lambda r: f.gen[f.of(r), li]
    if detector == "semantic_entropy_probe":
        li = _layer_index(f, layer)
        if position == "last_prompt":
            return lambda r: f.tbg[r, li][None]
        return lambda r: f.gen[f.of(r), li][-1:]
    if detector == "lookback_ratio":
        _, cols = _lookback_columns(f, layers)
        return lambda r: window_means(f.lr[f.of(r)][:, cols].reshape(ds.rows[r], -1), window)
    raise ProbeDataError(f"unknown detector {detector!r}; detectors: {', '.join(DETECTORS)}")


def _request_scores(ds: Dataset, reqs: np.ndarray, feats, fit: dict, span_only: bool) -> tuple[np.ndarray, np.ndarray]:
    """Per request of ``reqs``, the max risk over its span rows (``span_only``) or all its rows."""
    ys, ss = [], []
    for r in reqs.tolist():
        x = feats(r)
        if span_only:
            if not ds.span[r]:
                continue
            x = x[ds.span[r]]
        ys.append(ds.labels[r])
        ss.append(float(_probe_risk(fit, x).max()))
    return np.asarray(ys), np.asarray(ss)


def train_detector(ds: Dataset, detector: str, layer: int | None = None, layers: Sequence[int] | None = None,
                   position: str = "last_prompt", window: int = LOOKBACK_WINDOW,
                   cs: Sequence[float] = CS, rows: str = "span", logit: bool = False,
                   train_reqs=None) -> tuple[dict, dict]:
    """Fit one detector on the training requests (or ``train_reqs``); (fit, metrics) with held-out and training
    metrics. ``rows``: token detectors' training rows ("span" or "all", ``Dataset.token_rows``); ``logit``:
    token_probe's features add ``LOGIT_FEATURES``."""
    feats = detector_features(ds, detector, layer, layers, position, window, logit)
    metrics: dict[str, Any] = {}
    if detector == "semantic_entropy_probe":
        target, threshold = ds.semantic_targets()
        sets = {}
        for split in ("train", "test"):
            reqs = ds.requests(split) if split == "test" or train_reqs is None else np.asarray(train_reqs)
            X = np.concatenate([feats(r) for r in reqs.tolist()])
            sets[split] = (reqs, RowSet(X, target[reqs], ds.groups[reqs], reqs))
        fit = fit_logistic(sets["train"][1], cs)
        fit["se_threshold"] = threshold
        for split, (reqs, rows) in sets.items():
            risk = _probe_risk(fit, rows.X)
            metrics[split] = {"se_auc": _auc(rows.y, risk), "answer_auc": _auc(ds.labels[reqs], risk),
                              "requests": int(len(reqs)), "wrong": int(ds.labels[reqs].sum()),
                              "high_se": int(rows.y.sum())}
        return fit, metrics
    train_rows = ds.token_rows("train", feats, rows, train_reqs)
    fit = fit_logistic(train_rows, cs)
    fit["rows"], fit["logit"] = rows, logit
    for split in ("train", "test"):
        rowset = train_rows if split == "train" else ds.token_rows("test", feats, rows)
        risk = _probe_risk(fit, rowset.X)
        reqs = ds.requests(split) if split == "test" or train_reqs is None else np.asarray(train_reqs)
        m = {"token_auc": _auc(rowset.y, risk), "tokens": int(len(rowset.y)), "wrong_tokens": int(rowset.y.sum()),
             "token_accuracy": round(float(((risk >= 0.5) == rowset.y).mean()), 4)}
        y, s = _request_scores(ds, reqs, feats, fit, True)
        m["answer_auc_span"] = _auc(y, s)
        y, s = _request_scores(ds, reqs, feats, fit, False)
        m.update(answer_auc=_auc(y, s), requests=int(len(y)), wrong=int(y.sum()))
        metrics[split] = m
    return fit, metrics


def baselines(ds: Dataset, split: str = "test") -> dict:
    """Token log-probability and entropy (vLLM logprobs) and sampled semantic entropy on the same held-out
    tokens and requests as the detectors."""
    out = {}
    reqs = ds.requests(split)
    recs = ds.records

    def per_token(key: str, sign: float) -> np.ndarray:
        return lambda r: sign * np.asarray(recs[r][key][:ds.rows[r]], np.float64)[:, None]

    for name, key, sign in (("neg_logprob", "logprobs", -1.0), ("entropy", "entropies", 1.0)):
        feats = per_token(key, sign)
        rows = ds.token_rows(split, feats)
        ident = {"weights": np.ones(1), "scale": np.ones(1), "mean": np.zeros(1), "bias": 0.0}
        m = {"token_auc": _auc(rows.y, rows.X[:, 0])}
        y, s = _request_scores(ds, reqs, feats, ident, True)
        m["answer_auc_span"] = _auc(y, s)
        y, s = _request_scores(ds, reqs, feats, ident, False)
        m["answer_auc"] = _auc(y, s)
        m["answer_auc_mean"] = _auc(ds.labels[reqs], [float(feats(r).mean()) for r in reqs.tolist()])
        m["answer_auc_per_set"] = _per_set(ds, reqs, [float(feats(r).max()) for r in reqs.tolist()])
        out[name] = m
    se = np.asarray([recs[r]["semantic_entropy"] for r in reqs.tolist()])
    out["semantic_entropy_sampled"] = {"answer_auc": _auc(ds.labels[reqs], se),
                                       "answer_auc_per_set": _per_set(ds, reqs, se),
                                       "samples": ds.header.get("samples")}
    return out


def _per_set(ds: Dataset, reqs: np.ndarray, scores) -> dict:
    """Answer AUROC within each question set (None where a set's held-out answers are all right or all wrong):
    a detector that only recognized which set a question is from would score 0.5 here."""
    sets = np.asarray([ds.records[r].get("set") for r in reqs.tolist()])
    scores, y = np.asarray(scores), ds.labels[reqs]
    return {s: _auc(y[sets == s], scores[sets == s]) for s in sorted(set(sets.tolist()))}


# ------------------------------------------------------------------------------------------------ probe files

def make_probe(ds: Dataset, detector: str, fit: dict, metrics: dict, *, layer: int | None = None,
               layers: Sequence[int] | None = None, position: str = "last_prompt",
               window: int = LOOKBACK_WINDOW, command: str = "") -> LinearProbe:
    header = ds.header
    model = header.get("model", "")
    cfg = json.loads((Path(header["model_dir"]) / "config.json").read_text()) if header.get("model_dir") and \
        (Path(header["model_dir"]) / "config.json").exists() else {}
    hidden = int(cfg.get("hidden_size") or ds.f.gen.shape[-1])
    n_layers = int(cfg.get("num_hidden_layers") or 0)
    extra: dict[str, Any] = {}
    num_features = 0
    if detector == "token_probe":
        pos, positive = "generated", "the token is part of a wrong answer (the model's answer to a question)"
        if fit.get("rows") == "all":
            positive = ("the token is part of the claim (the answer span) of a wrong answer; every other generated "
                        "token (function words, right claims) is a negative")
        if fit.get("logit"):
            extra["logit_features"] = list(LOGIT_FEATURES)
            num_features = hidden + len(LOGIT_FEATURES)
        if fit.get("logit") == "only":
            extra["hidden"] = False
            num_features = len(LOGIT_FEATURES)
    elif detector == "semantic_entropy_probe":
        pos = position
        positive = (f"high semantic entropy: over {header.get('samples')} answers sampled at temperature "
                    f"{header.get('sample_temperature')}, entropy of the answer clusters > {fit['se_threshold']:.4f}")
        extra["se_threshold"] = fit["se_threshold"]
    else:
        layers, _ = _lookback_columns(ds.f, layers)
        heads = int(ds.f.lr.shape[2])
        pos, positive = "generated", "the token is part of a wrong answer (the model's answer to a question)"
        layer = layers[0]
        extra.update(layers=list(layers), heads=heads, window=window)
        num_features = len(layers) * heads
    train_n = metrics["train"]
    probe = LinearProbe(detector, model, hidden, int(layer), pos, fit["mean"], fit["scale"], fit["weights"],
                        fit["bias"], float(fit.get("threshold", 0.5)), False, "last", n_layers,
                        num_features=num_features, positive=positive, extra=extra)
    probe.training = {
        "data": (f"questions generated by mia_stream.lab.hallucination_data (sets {header.get('sets')}, "
                 f"limit {header.get('limit')} per set), answered greedily by the model (chat template, system "
                 f"prompt of the template, instruction {header.get('instruction')!r}, {header.get('max_tokens')} tokens "
                 "at most), labelled "
                 "automatically"),
        "rows": ("one row per request" if detector == "semantic_entropy_probe" else
                 "every generated token with its claim-level label (1 = a token of the answer span of a wrong "
                 "answer)" if fit.get("rows") == "all" else
                 "answer-span tokens, each with its request's label (1 = wrong answer)"),
        "threshold": fit.get("threshold_info", "0.5 (not calibrated)"),
        "features": {"token_probe": f"residual after decoder layer {layer}, at each generated token" + (
                         f", and {list(LOGIT_FEATURES)} from the output head" if fit.get("logit") else ""),
                     "semantic_entropy_probe": f"residual after decoder layer {layer} at the "
                                               f"{'last prompt position (TBG)' if pos == 'last_prompt' else 'last generated row (SLT)'}",
                     "lookback_ratio": f"lookback ratios of layers {layers} x {extra.get('heads')} heads, mean over "
                                       f"the last {window} generated tokens"}[detector],
        "split": header.get("split") or f"by fact (group), {header.get('test_fraction')} held out, seed "
                                        f"{header.get('seed')}",
        "selection": f"C from {list(CS)} by grouped {FOLDS}-fold CV AUROC on the training requests",
        "C": fit["C"], "cv_auc": fit["cv_auc"], "cv": fit["cv"], "class_weight": "balanced",
        "train_requests": train_n.get("requests"), "train_rows": train_n.get("tokens", train_n.get("requests")),
        "collect": {k: header.get(k) for k in ("command", "date", "engine", "samples", "sample_temperature",
                                               "max_tokens", "requests")},
        "date": datetime.date.today().isoformat(), "command": command}
    probe.metrics = metrics
    return probe


def shipped_probe_path(detector: str) -> Path:
    return PROBES_DIR / SHIPPED[detector]


__all__ = ["DETECTORS", "Dataset", "FeatureReader", "Features", "baselines", "detector_features", "fit_logistic",
           "load_labels", "make_probe", "read_features", "shipped_probe_path", "train_detector"]
