"""core_reranker: document relevance from the attention the query pays to each document.

Methods:
- In-context re-ranking (ICR): Shijie Chen, Bernal Jiménez Gutiérrez, Yu Su, "Attention in Large Language Models
  Yields Efficient Zero-Shot Re-Rankers", arXiv:2410.02642 (2024), ICLR 2025. The documents and then the query
  go into one prompt; a document's score is the attention its tokens receive from the query tokens (mean over
  query rows, summed over heads), minus the same with the content-free query "N/A" (calibration against
  the model's position and token biases). Tokens whose calibrated score falls at or below ``mean - 2 std`` of
  their document are masked out (the reference implementation's ``masked_NA_calibration``, its default).
- CoRe heads: Linh Tran, Yulong Li, Radu Florian, Wei Sun, "Contrastive Retrieval Heads Improve
  Attention-Based Re-Ranking", arXiv:2510.02219 (2025). Aggregate only a few heads chosen by a contrastive,
  relative-ranking criterion on a detection set instead of all heads. ``select_heads`` ranks each head by the
  mean reciprocal rank it alone gives the relevant document (our reading of that criterion: the paper's exact
  scoring equation was not available offline).

Two requests per ranking: the real query and its "N/A" twin with the same documents (the same token prefix,
so document tokens sit at the same positions in both); both carry
``tags["core_reranker"] = {"group": G, "role": "query" | "calibration"}`` and the prompt's spans (``doc`` once
per document, ``query``: the late instruction and query, whose rows run to the end of the prompt).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from mia_stream.analyzers._attention import HeadSet
from mia_stream.errors import AnalyzerConfigError, AnalyzerInputError

NAME = "core_reranker"
VERSION = "1"
CALIBRATION_QUERY = "N/A"


def token_scores(alpha: np.ndarray) -> np.ndarray:
    """``alpha [P, Tq, Tk]`` (the chosen heads' attention of the query rows) -> ``[Tk]``: mean over query
    rows, summed over heads (ICR's aggregation)."""
    return alpha.mean(axis=1).sum(axis=0)


def _doc_slices(doc_spans: Sequence[tuple[int, int]], n: int) -> list[slice]:
    out = []
    for a, b in doc_spans:
        if not 0 <= a < b <= n:
            raise AnalyzerInputError(f"document span [{a}, {b}) is out of range: the keys cover {n} tokens")
        out.append(slice(a, b))
    return out


def doc_scores(query_tok: np.ndarray, doc_spans: Sequence[tuple[int, int]], calib_tok: np.ndarray | None = None,
               mask_sigma: float | None = 2.0) -> np.ndarray:
    """Each document's score: the sum of its tokens' (calibrated) scores.

    With ``calib_tok`` (the N/A query's token scores over the same positions) a token counts
    ``query - calibration``, and tokens whose calibrated score is at or below ``mean - mask_sigma * std`` of
    their document (sample std, as the reference's ``torch.std``) are left out; ``mask_sigma=None`` keeps all.
    """
    n = len(query_tok) if calib_tok is None else min(len(query_tok), len(calib_tok))
    out = np.empty(len(doc_spans), dtype=np.float64)
    for i, s in enumerate(_doc_slices(doc_spans, n)):
        q = query_tok[s].astype(np.float64)
        if calib_tok is None:
            out[i] = q.sum()
            continue
        cal = q - calib_tok[s]
        if mask_sigma is not None and len(cal) > 1:
            cal = cal[cal > cal.mean() - mask_sigma * cal.std(ddof=1)]
        out[i] = cal.sum()
    return out


def rank(scores: np.ndarray) -> np.ndarray:
    """Document indices, best first (stable for ties)."""
    return np.argsort(-np.asarray(scores), kind="stable")


def ndcg(ranking: Sequence[int], relevant: set, k: int = 10) -> float:
    """nDCG@k with binary relevance."""
    dcg = sum(1.0 / np.log2(r + 2) for r, d in enumerate(list(ranking)[:k]) if d in relevant)
    ideal = sum(1.0 / np.log2(r + 2) for r in range(min(len(relevant), k)))
    return float(dcg / ideal) if ideal else 0.0


def reciprocal_rank(ranking: Sequence[int], relevant: set) -> float:
    for r, d in enumerate(ranking):
        if d in relevant:
            return 1.0 / (r + 1)
    return 0.0


def select_heads(per_head_scores: Sequence[np.ndarray], relevant: Sequence[set], top: int) -> tuple[np.ndarray, np.ndarray]:
    """CoRe-style head selection: ``per_head_scores[e] [H, N_e]`` (every candidate head's calibrated document
    scores for detection example ``e``), ``relevant[e]`` its relevant documents -> (indices of the ``top`` heads,
    every head's mean reciprocal rank)."""
    if not per_head_scores:
        raise AnalyzerInputError("head selection needs at least one detection example")
    heads = per_head_scores[0].shape[0]
    mrr = np.zeros(heads)
    for s, rel in zip(per_head_scores, relevant):
        order = np.argsort(-s, axis=1, kind="stable")  # [H, N]
        hit = np.isin(order, list(rel))
        first = np.where(hit.any(1), hit.argmax(1), -1)
        mrr += np.where(first >= 0, 1.0 / (first + 1), 0.0)
    mrr /= len(per_head_scores)
    return np.argsort(-mrr, kind="stable")[:top], mrr


@dataclass
class RerankConfig:
    heads: HeadSet
    calibrate: bool = True
    mask_sigma: float | None = 2.0
    doc_span: str = "doc"
    query_span: str = "query"
    scale: float | None = None
    extra: dict = field(default_factory=dict)

    @classmethod
    def from_dict(cls, d: Any, num_layers: int, num_heads: int) -> "RerankConfig":
        if not isinstance(d, dict):
            raise AnalyzerConfigError(f"{NAME} config must be a JSON object, got {type(d).__name__}")
        known = {"heads", "calibrate", "mask_sigma", "doc_span", "query_span", "scale"}
        try:
            heads = HeadSet.parse(d.get("heads", "all"), num_layers, num_heads, f"{NAME} config: heads")
        except AnalyzerInputError as e:
            raise AnalyzerConfigError(str(e)) from None
        cal = d.get("calibrate", True)
        if not isinstance(cal, bool):
            raise AnalyzerConfigError(f"{NAME} config: calibrate must be true or false, got {cal!r}")
        sig = d.get("mask_sigma", 2.0)
        if sig is not None and (not isinstance(sig, (int, float)) or isinstance(sig, bool) or sig < 0):
            raise AnalyzerConfigError(f"{NAME} config: mask_sigma must be a number >= 0 or null, got {sig!r}")
        for key in ("doc_span", "query_span"):
            if key in d and (not isinstance(d[key], str) or not d[key]):
                raise AnalyzerConfigError(f"{NAME} config: {key} must be a span name, got {d[key]!r}")
        scale = d.get("scale")
        if scale is not None and (not isinstance(scale, (int, float)) or isinstance(scale, bool) or scale <= 0):
            raise AnalyzerConfigError(f"{NAME} config: scale must be a positive number, got {scale!r}")
        return cls(heads, cal, None if sig is None else float(sig), d.get("doc_span", "doc"),
                   d.get("query_span", "query"), None if scale is None else float(scale),
                   {k: v for k, v in d.items() if k not in known})

    @classmethod
    def load(cls, path: str | Path, num_layers: int, num_heads: int) -> "RerankConfig":
        try:
            d = json.loads(Path(path).read_text())
        except OSError as e:
            raise AnalyzerConfigError(f"{NAME} config {path}: {e.strerror}") from None
        except json.JSONDecodeError as e:
            raise AnalyzerConfigError(f"{NAME} config {path} is not valid JSON: {e}") from None
        return cls.from_dict(d, num_layers, num_heads)

    def to_dict(self) -> dict:
        return {"heads": [list(p) for p in self.heads.pairs], "calibrate": self.calibrate,
                "mask_sigma": self.mask_sigma, "doc_span": self.doc_span, "query_span": self.query_span,
                **({"scale": self.scale} if self.scale is not None else {}), **self.extra}

    def capture_spec(self) -> dict:
        return {"qk": self.heads.qk_spec("prompt")}
