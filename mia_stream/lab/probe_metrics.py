"""Metrics for the hallucination detectors' evaluation: AUROC with bootstrap confidence intervals by entity,
paired differences against a baseline on the same resamples, alert thresholds calibrated for a false-alert rate
on correct answers, and the free baselines' answer scores.

Rules: a bootstrap resamples entities (``group``), never rows, so the questions about one country move together;
a threshold is chosen on one split (validation) and measured on another (test).
"""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np

BOOTSTRAP = 1000
FALSE_ALERT_RATE = 0.10  # at most this fraction of correct answers raise an alert (default thresholds)


def auroc(y, s) -> float | None:
    """Area under the ROC curve (positive class 1), ties counted half (Mann-Whitney U); None with one class."""
    y = np.asarray(y, np.int64)
    s = np.asarray(s, np.float64)
    n_pos, n_neg = int((y == 1).sum()), int((y == 0).sum())
    if not n_pos or not n_neg:
        return None
    _, inv, counts = np.unique(s, return_inverse=True, return_counts=True)
    avg_rank = np.cumsum(counts) - (counts - 1) / 2.0  # 1-based average rank of each distinct value
    u = avg_rank[inv][y == 1].sum() - n_pos * (n_pos + 1) / 2.0
    return float(u / (n_pos * n_neg))


def _resamples(groups: Sequence, n: int, seed: int) -> list[np.ndarray]:
    """Row indices of ``n`` bootstrap resamples of the entities."""
    groups = np.asarray(groups)
    uniq, inv = np.unique(groups, return_inverse=True)
    members = [np.flatnonzero(inv == g) for g in range(len(uniq))]
    rng = np.random.default_rng(seed)
    return [np.concatenate([members[g] for g in rng.integers(0, len(uniq), len(uniq))]) for _ in range(n)]


def within_auroc(y, s, strata) -> float | None:
    """The AUROC within each stratum (a question set), averaged weighted by its size over the strata that hold
    both classes: what is left once knowing the set (its base rate) is worth nothing."""
    y, s, strata = np.asarray(y), np.asarray(s, np.float64), np.asarray(strata)
    total = weight = 0.0
    for k in np.unique(strata):
        m = strata == k
        a = auroc(y[m], s[m])
        if a is not None:
            total += a * m.sum()
            weight += m.sum()
    return total / weight if weight else None


def bootstrap(y, scores: Mapping[str, Sequence[float]], groups, reference: str | None = None,
              n: int = BOOTSTRAP, seed: int = 0, strata=None) -> dict:
    """Per named score: AUROC and its 95 % CI over entity resamples; with ``reference``, also the paired
    difference (score - reference) and its CI on the same resamples. ``strata``: the AUROC is
    ``within_auroc`` over them instead of the pooled one."""
    if strata is not None:
        strata = np.asarray(strata)
        metric = lambda yy, ss, idx: within_auroc(yy, ss, strata[idx])  # noqa: E731
    else:
        metric = lambda yy, ss, idx: auroc(yy, ss)  # noqa: E731
    y = np.asarray(y)
    arrays = {k: np.asarray(v, np.float64) for k, v in scores.items()}
    boots = {k: [] for k in arrays}
    diffs = {k: [] for k in arrays}
    for idx in _resamples(groups, n, seed):
        yy = y[idx]
        if len(np.unique(yy)) < 2:
            continue
        vals = {k: metric(yy, a[idx], idx) for k, a in arrays.items()}
        if any(v is None for v in vals.values()):
            continue
        for k, v in vals.items():
            boots[k].append(v)
            if reference is not None:
                diffs[k].append(v - vals[reference])
    out = {}
    everything = np.arange(len(y))
    for k, a in arrays.items():
        b = np.asarray(boots[k])
        row = {"auroc": _r(metric(y, a, everything)), "ci": [_r(np.percentile(b, 2.5)), _r(np.percentile(b, 97.5))]
               if len(b) else [None, None]}
        if reference is not None and k != reference and len(diffs[k]):
            d = np.asarray(diffs[k])
            row["diff_vs"] = reference
            row["diff"] = _r((row["auroc"] or 0) - (_r(metric(y, arrays[reference], everything)) or 0))
            row["diff_ci"] = [_r(np.percentile(d, 2.5)), _r(np.percentile(d, 97.5))]
        out[k] = row
    return out


def _r(v):
    return None if v is None or not np.isfinite(v) else round(float(v), 4)


def calibrate(scores_correct: Sequence[float], rate: float = FALSE_ALERT_RATE) -> float:
    """The lowest threshold t (alert when score >= t) at which at most ``rate`` of these correct answers
    alert."""
    s = np.sort(np.asarray(scores_correct, np.float64))[::-1]
    if not len(s):
        return 0.5
    allowed = int(np.floor(rate * len(s)))  # this many may alert
    if allowed >= len(s):
        return float(s[-1])
    # alerts are scores >= t: t just above the (allowed+1)-th largest score
    return float(np.nextafter(s[allowed], np.inf))


def alert_rates(y, s, threshold: float, groups, n: int = BOOTSTRAP, seed: int = 0) -> dict:
    """False-alert rate on correct answers and recall of wrong answers at ``threshold``, with CIs by entity."""
    y, s = np.asarray(y), np.asarray(s, np.float64)
    alert = s >= threshold

    def rates(idx):
        yy, aa = y[idx], alert[idx]
        far = float(aa[yy == 0].mean()) if (yy == 0).any() else np.nan
        rec = float(aa[yy == 1].mean()) if (yy == 1).any() else np.nan
        return far, rec

    far, rec = rates(np.arange(len(y)))
    boots = np.asarray([rates(i) for i in _resamples(groups, n, seed)])
    def ci(c):
        col = boots[:, c][~np.isnan(boots[:, c])]
        return [_r(np.percentile(col, 2.5)), _r(np.percentile(col, 97.5))] if len(col) else [None, None]

    return {"threshold": _r(threshold), "false_alert_rate": _r(far), "false_alert_ci": ci(0),
            "recall": _r(rec), "recall_ci": ci(1), "correct": int((y == 0).sum()), "wrong": int((y == 1).sum())}


# ------------------------------------------------------------------------------------------------ baselines

AFTER_ANSWER = ("mean_neg_logprob", "max_neg_logprob", "mean_entropy", "max_entropy", "answer_length")
BEFORE_ANSWER = ("first_token_entropy", "first_token_neg_logprob", "question_prior")


def baseline_scores(records: Sequence[dict], reqs: Sequence[int], prior: Mapping[str, float] | None = None,
                    rows: Sequence[int] | None = None) -> dict[str, np.ndarray]:
    """Free scores per request (higher = more likely wrong): from vLLM's logprobs of the greedy answer (over the
    tokens that have a state, ``rows[r]``, so the same tokens as the detectors' rows), its length, the
    first token's entropy (known before any answer token is fed back), the question's prior (the training
    wrong-rate of its set and difficulty), and sampled semantic entropy where samples were drawn."""
    out: dict[str, list] = {k: [] for k in AFTER_ANSWER + BEFORE_ANSWER + ("semantic_entropy",)}
    prior = prior or {}
    for r in reqs:
        rec = records[r]
        n = len(rec["token_ids"]) if rows is None else max(int(rows[r]), 1)
        lp = -np.asarray(rec["logprobs"][:n] or [0.0], np.float64)
        en = np.asarray(rec["entropies"][:n] or [0.0], np.float64)
        out["mean_neg_logprob"].append(lp.mean())
        out["max_neg_logprob"].append(lp.max())
        out["mean_entropy"].append(en.mean())
        out["max_entropy"].append(en.max())
        out["answer_length"].append(len(rec["token_ids"]))
        out["first_token_entropy"].append(float(rec["entropies"][0]) if rec["entropies"] else 0.0)
        out["first_token_neg_logprob"].append(-float(rec["logprobs"][0]) if rec["logprobs"] else 0.0)
        out["question_prior"].append(prior.get(prior_key(rec), prior.get("", 0.5)))
        out["semantic_entropy"].append(float(rec.get("semantic_entropy", 0.0)))
    return {k: np.asarray(v, np.float64) for k, v in out.items()}


def prior_key(rec: Mapping) -> str:
    return f"{rec.get('set')}|{rec.get('difficulty')}"


def question_prior(records: Sequence[dict], train: Sequence[int]) -> dict[str, float]:
    """The training wrong-rate per (set, difficulty) cell, and overall under ""."""
    cells: dict[str, list] = {}
    for r in train:
        cells.setdefault(prior_key(records[r]), []).append(records[r]["label"])
    out = {k: float(np.mean(v)) for k, v in cells.items()}
    out[""] = float(np.mean([records[r]["label"] for r in train])) if len(train) else 0.5
    return out


def json_default(o):
    """``json.dumps(..., default=json_default)`` for reports and metrics holding numpy values."""
    if isinstance(o, np.generic):
        return o.item()
    if isinstance(o, np.ndarray):
        return o.tolist()
    raise TypeError(type(o).__name__)
