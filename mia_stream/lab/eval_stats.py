"""Small statistics for the analyzers' held-out evaluations: AUROC, macro-F1, and bootstrap confidence
intervals that resample *entities* (a country, an element, a question template), never rows, so that rows that
share an entity move together (docs/analyzers.md: every number beside its baseline, with its interval)."""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np


def auroc(scores: Sequence[float], labels: Sequence[int]) -> float:
    """Area under the ROC curve of ``scores`` for ``labels`` (1 = positive), ties counted half (Mann-Whitney)."""
    s = np.asarray(scores, np.float64)
    y = np.asarray(labels).astype(bool)
    pos, neg = s[y], s[~y]
    if not len(pos) or not len(neg):
        return float("nan")
    greater = (pos[:, None] > neg[None, :]).sum()
    ties = (pos[:, None] == neg[None, :]).sum()
    return float((greater + 0.5 * ties) / (len(pos) * len(neg)))


def macro_f1(pred: Sequence[int], true: Sequence[int], classes: Sequence[int]) -> float:
    pred, true = np.asarray(pred), np.asarray(true)
    f1s = []
    for c in classes:
        tp = np.sum((pred == c) & (true == c))
        fp = np.sum((pred == c) & (true != c))
        fn = np.sum((pred != c) & (true == c))
        f1s.append(0.0 if tp == 0 else 2 * tp / (2 * tp + fp + fn))
    return float(np.mean(f1s))


def recall_per_class(pred: Sequence[int], true: Sequence[int], classes: Sequence[int]) -> list[float]:
    pred, true = np.asarray(pred), np.asarray(true)
    return [float(np.mean(pred[true == c] == c)) if np.any(true == c) else float("nan") for c in classes]


def bootstrap_ci(stat: Callable[[np.ndarray], float], groups: Sequence, n: int = 1000, seed: int = 0,
                 alpha: float = 0.05) -> tuple[float, float]:
    """``(lo, hi)``: the ``1 - alpha`` percentile interval of ``stat(rows)`` over resamples of the distinct
    ``groups`` (entities) with replacement; ``stat`` gets the row indices of one resample."""
    groups = np.asarray([str(g) for g in groups])
    uniq = np.unique(groups)
    rows_of = {g: np.flatnonzero(groups == g) for g in uniq}
    rng = np.random.default_rng(seed)
    vals = []
    for _ in range(n):
        pick = rng.choice(uniq, size=len(uniq), replace=True)
        v = stat(np.concatenate([rows_of[g] for g in pick]))
        if np.isfinite(v):
            vals.append(v)
    if not vals:
        return float("nan"), float("nan")
    return float(np.quantile(vals, alpha / 2)), float(np.quantile(vals, 1 - alpha / 2))


def fmt_ci(value: float, ci: tuple[float, float]) -> str:
    return f"{value:.3f} [{ci[0]:.3f}, {ci[1]:.3f}]"
