"""attnlink: text-to-SQL schema linking from one attention head (AttnLink-U).

At the generation anchor (the last prompt token: the row that predicts the first token of the SQL), one
chosen (layer, head) spreads attention over the schema; a column's score is the attention its tokens receive,
``S_c = sum_{i in c} alpha[anchor, i]``. Columns are ranked by ``p_c = softmax(log(S_c) / T)`` (a temperature
softmax over log span scores: ``T = 1`` is the normalized span mass, lower ``T`` sharpens it) and the smallest
set whose probability reaches ``top_p`` is selected, so the number of linked columns adapts to how peaked the
head is. No training: the head is chosen once per model on a few labelled questions (``select_head``: the
head whose ranking puts the gold columns highest, by mean reciprocal rank).

The prompt carries one ``column`` span per schema column (``mia_stream.spans.prompt_parts``), and may carry
``tags["attnlink"]["columns"]``: the columns' names, used as the labels of the published selection.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from mia_stream.errors import AnalyzerConfigError, AnalyzerInputError

NAME = "attnlink"
VERSION = "1"
_TINY = 1e-30  # log of a column that got no attention at all


def column_scores(alpha_anchor: np.ndarray, column_spans: Sequence[tuple[int, int]]) -> np.ndarray:
    """``alpha_anchor [..., T]`` -> ``[..., C]``: attention mass on each column's tokens."""
    n = alpha_anchor.shape[-1]
    out = np.empty(alpha_anchor.shape[:-1] + (len(column_spans),), dtype=np.float64)
    for c, (a, b) in enumerate(column_spans):
        if not 0 <= a < b <= n:
            raise AnalyzerInputError(f"column span [{a}, {b}) is out of range: the keys cover {n} tokens")
        out[..., c] = alpha_anchor[..., a:b].sum(axis=-1)
    return out


def link_probabilities(scores: np.ndarray, temperature: float = 1.0) -> np.ndarray:
    """``softmax(log(S) / T)`` over the last axis."""
    z = np.log(np.maximum(scores, _TINY)) / temperature
    z -= z.max(axis=-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=-1, keepdims=True)


def select_top_p(probs: np.ndarray, top_p: float) -> np.ndarray:
    """Column indices, most probable first, up to and including the one where the cumulative probability
    reaches ``top_p`` (nucleus selection; at least one column)."""
    order = np.argsort(-probs, kind="stable")
    cum = np.cumsum(probs[order])
    n = int(np.searchsorted(cum, top_p - 1e-12) + 1)
    return order[:min(n, len(order))]


def select_head(per_head_scores: Sequence[np.ndarray], gold: Sequence[set]) -> tuple[tuple[int, int], np.ndarray]:
    """The (layer, head) whose column scores rank the gold columns highest: ``per_head_scores[e] [L, H, C_e]``
    for labelled question ``e`` -> (best (layer, head), mean reciprocal rank of the gold columns ``[L, H]``)."""
    if not per_head_scores:
        raise AnalyzerInputError("head selection needs at least one labelled question")
    total = np.zeros(per_head_scores[0].shape[:2])
    for s, g in zip(per_head_scores, gold):
        order = np.argsort(-s, axis=-1, kind="stable")  # [L, H, C]
        ranks = np.argsort(order, axis=-1, kind="stable")  # rank of each column
        gl = sorted(g)
        total += (1.0 / (ranks[..., gl] + 1)).mean(-1)
    mrr = total / len(per_head_scores)
    best = np.unravel_index(int(np.argmax(mrr)), mrr.shape)
    return (int(best[0]), int(best[1])), mrr


@dataclass
class LinkConfig:
    layer: int
    head: int
    temperature: float = 1.0
    top_p: float = 0.9
    column_span: str = "column"
    scale: float | None = None
    extra: dict = field(default_factory=dict)

    @classmethod
    def from_dict(cls, d: Any, num_layers: int, num_heads: int) -> "LinkConfig":
        if not isinstance(d, dict):
            raise AnalyzerConfigError(f"{NAME} config must be a JSON object, got {type(d).__name__}")
        known = {"layer", "head", "temperature", "top_p", "column_span", "scale"}
        missing = [x for x in ("layer", "head") if x not in d]
        if missing:
            raise AnalyzerConfigError(f"{NAME} config lacks {missing} (choose one with --select-head)")
        layer, head = d["layer"], d["head"]
        for what, v, hi in (("layer", layer, num_layers), ("head", head, num_heads)):
            if not isinstance(v, int) or isinstance(v, bool):
                raise AnalyzerConfigError(f"{NAME} config: {what} must be an integer, got {v!r}")
            if not 0 <= v < hi:
                raise AnalyzerConfigError(f"{NAME} config: {what} {v} is out of range: the model has "
                                          f"{'layers' if what == 'layer' else 'query heads'} 0..{hi - 1}")
        t = d.get("temperature", 1.0)
        if not isinstance(t, (int, float)) or isinstance(t, bool) or not t > 0:
            raise AnalyzerConfigError(f"{NAME} config: temperature must be a number > 0, got {t!r}")
        p = d.get("top_p", 0.9)
        if not isinstance(p, (int, float)) or isinstance(p, bool) or not 0 < p <= 1:
            raise AnalyzerConfigError(f"{NAME} config: top_p must be in (0, 1], got {p!r}")
        span = d.get("column_span", "column")
        if not isinstance(span, str) or not span:
            raise AnalyzerConfigError(f"{NAME} config: column_span must be a span name, got {span!r}")
        scale = d.get("scale")
        if scale is not None and (not isinstance(scale, (int, float)) or isinstance(scale, bool) or scale <= 0):
            raise AnalyzerConfigError(f"{NAME} config: scale must be a positive number, got {scale!r}")
        return cls(layer, head, float(t), float(p), span, None if scale is None else float(scale),
                   {k: v for k, v in d.items() if k not in known})

    @classmethod
    def load(cls, path: str | Path, num_layers: int, num_heads: int) -> "LinkConfig":
        try:
            d = json.loads(Path(path).read_text())
        except OSError as e:
            raise AnalyzerConfigError(f"{NAME} config {path}: {e.strerror}") from None
        except json.JSONDecodeError as e:
            raise AnalyzerConfigError(f"{NAME} config {path} is not valid JSON: {e}") from None
        return cls.from_dict(d, num_layers, num_heads)

    def to_dict(self) -> dict:
        return {"layer": self.layer, "head": self.head, "temperature": self.temperature, "top_p": self.top_p,
                "column_span": self.column_span, **({"scale": self.scale} if self.scale is not None else {}),
                **self.extra}

    def capture_spec(self) -> dict:
        return {"qk": {"layers": [self.layer], "heads": [self.head], "positions": "prompt"}}


def link(alpha_anchor: np.ndarray, column_spans: Sequence[tuple[int, int]], temperature: float,
         top_p: float) -> dict:
    """One request's linking: ``scores``, ``probs`` per column and the ``selected`` column indices."""
    s = column_scores(alpha_anchor, column_spans)
    p = link_probabilities(s, temperature)
    return {"scores": s, "probs": p, "selected": select_top_p(p, top_p)}
