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

import collections
from typing import Sequence

import numpy as np

from mia_stream.analyzers._span_analyzer import (PromptState, SpanAttentionAnalyzer, check_number, check_span_name,
                                                 pad_rows)
from mia_stream.errors import AnalyzerInputError

CALIBRATION_QUERY = "N/A"
TAG = "core_reranker"
_MAX_PENDING_GROUPS = 4096  # pairs whose twin never came are forgotten, oldest first, past this many


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


class CoreReranker(SpanAttentionAnalyzer):
    """Document relevance from query-to-document attention, N/A-calibrated (ICR; CoRe heads)."""

    name = "core_reranker"
    version = "1"
    defaults = {"heads": "all", "calibrate": True, "mask_sigma": 2.0, "doc_span": "doc", "query_span": "query",
                "scale": None, "selection": None, "model": None}

    def configure(self, config: dict) -> None:
        self.configure_heads(config["heads"])
        self.calibrate = self.config_value("calibrate", bool, "true or false")
        self.mask_sigma = check_number(config, "mask_sigma", self.name, optional=True, lo=0.0, hi=1e9)
        self.scale = check_number(config, "scale", self.name, positive=True, optional=True)
        self.doc_span = check_span_name(config, "doc_span", self.name)
        self.query_span = check_span_name(config, "query_span", self.name)
        self.span_names = (self.doc_span, self.query_span)
        self._pending: collections.OrderedDict[str, dict] = collections.OrderedDict()  # group -> role -> (st, tok)

    def _role(self, st: PromptState) -> tuple[str | None, str]:
        tag = st.start.tags.get(TAG) if isinstance(st.start.tags, dict) else None
        if tag is None:
            if self.calibrate:
                raise AnalyzerInputError(f"request {st.request_id!r}: calibration needs tags[{TAG!r}] = "
                                         "{'group': G, 'role': 'query' | 'calibration'} (or config calibrate: false)")
            return None, "query"
        if not isinstance(tag, dict) or tag.get("role") not in ("query", "calibration") \
                or not isinstance(tag.get("group"), str):
            raise AnalyzerInputError(f"request {st.request_id!r}: tags[{TAG!r}] must be {{'group': str, 'role': "
                                     f"'query' | 'calibration'}}, got {tag!r}")
        return tag["group"], tag["role"]

    def check_request(self, st: PromptState) -> None:
        self._role(st)
        q = st.spans[self.query_span]
        if len(q) != 1:
            raise AnalyzerInputError(f"request {st.request_id!r}: {len(q)} spans named {self.query_span!r}, want 1")
        for a, b in st.spans[self.doc_span]:
            if b > q[0][0]:
                raise AnalyzerInputError(f"request {st.request_id!r}: document span [{a}, {b}) is not before the "
                                         f"query (at {q[0][0]})")

    def score(self, st: PromptState) -> np.ndarray:
        q0 = st.spans[self.query_span][0][0]
        alpha = st.attention(np.arange(q0, st.prompt_len), self.scale)  # [pairs, Tq, P]
        return token_scores(alpha)

    def report(self, scored: list, out) -> None:
        rows = []  # (emit under request id, scores, group, query request id)
        for st, tok in scored:
            group, role = self._role(st)
            if role == "calibration" and not self.calibrate:
                continue  # a calibration twin means nothing to an uncalibrated ranking: no row
            if group is None or not self.calibrate:
                rows.append((st.request_id, doc_scores(tok, st.spans[self.doc_span], None, self.mask_sigma), "",
                              st.request_id))
                continue
            pair = self._pending.setdefault(group, {})
            if role in pair:
                out.add_one(st.request_id, labels={"error": f"group {group!r} has two {role} requests"})
                continue
            pair[role] = (st, tok)
            if len(pair) < 2:
                while len(self._pending) > _MAX_PENDING_GROUPS:
                    self._pending.popitem(last=False)
                continue
            del self._pending[group]
            (qst, qtok), (cst, ctok) = pair["query"], pair["calibration"]
            if [tuple(x) for x in cst.spans[self.doc_span]] != [tuple(x) for x in qst.spans[self.doc_span]]:
                out.add_one(st.request_id, labels={"error": f"group {group!r}: the query and calibration "
                                                             "requests' document spans differ"})
                continue
            qdocs = qst.spans[self.doc_span]
            scores = doc_scores(qtok, qdocs, ctok, self.mask_sigma)
            # the query request's row when it is still running, else the calibration's (never a row for an
            # ended request: its analysis stream is closed)
            target = qst.request_id if qst.request_id in self._requests else cst.request_id
            rows.append((target, scores, group, qst.request_id))
        if not rows:
            return
        ids = [r[0] for r in rows]
        order = [rank(r[1]) for r in rows]
        out.add(ids, np.arange(len(rows)), None,
                {"scores": pad_rows([r[1] for r in rows], np.nan), "ranking": pad_rows(order, -1),
                 "num_docs": np.array([len(r[1]) for r in rows], np.int64)},
                {"group": [r[2] for r in rows], "query_request": [r[3] for r in rows]})
