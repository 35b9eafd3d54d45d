"""attnlink: text-to-SQL schema linking from one attention head (AttnLink-U).

Method: Song, Liu, Zheng, Li, Li, Zan, "AttnLink: Turning Attention into Schema Links for Text-to-SQL",
arXiv:2608.00693 (2026), as the seed (IBM/vLLM-Hook ``mia/analyzers/attnlink_analyzer.py``,
``docs/use_cases/attnlink.md``) ships it. The prompt asks the model to copy one relevant ``column@table``
identifier from a final "Candidate Columns" block (``lab.attention_data.sql_messages(form="seed")``), so the
next token starts an identifier; at that generation anchor (the last prompt token) one chosen (layer, head)
spreads attention over the candidates. Defaults are the seed's:

    alpha   = softmax(q_anchor . K^T * scale)            over the whole prompt
    S_c     = mean_{i in c} alpha[i]                     the mean over the identifier's tokens (pooling "mean")
    p_c     = softmax(log(S_c + 1e-8) / T)               over the candidates (T: ``temperature``, 1)
    selected = the shortest prefix of the ranking (descending S, ties in input order) whose cumulative p
               reaches ``top_p`` (0.8), at least one column

Named options (the project's variant, kept with its own numbers in docs/analyzers.md): ``pooling: "sum"`` (the
span's attention mass instead of its mean) and ``anchor: "question"`` (the mean attention of the question's
rows instead of the last prompt row), which this project used with the "Write the SQL query" prompt; the
shipped ``configs/attnlink-question-smollm2-135m.json`` is that variant.

No training: the head is chosen once per model on labelled questions whose schemas and question templates are
disjoint from the evaluation's (``select_head``: the head whose ranking puts the gold columns highest, by mean
reciprocal rank). The prompt carries one ``column`` span per candidate (``mia_stream.spans.prompt_parts``), and
may carry ``tags["attnlink"]["columns"]``: the candidates' names, the labels of the published selection.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np

from mia_stream.analyzers._span_analyzer import (PromptState, SpanAttentionAnalyzer, check_number, check_span_name,
                                                 pad_rows)
from mia_stream.errors import AnalyzerConfigError, AnalyzerInputError

TAG = "attnlink"
EPS = 1e-8  # the seed's smoothing inside log(S + eps)
POOLINGS = ("mean", "sum")


def column_scores(alpha_anchor: np.ndarray, column_spans: Sequence[tuple[int, int]],
                  pooling: str = "mean") -> np.ndarray:
    """``alpha_anchor [..., T]`` -> ``[..., C]``: each column span's mean attention (the seed), or its sum."""
    n = alpha_anchor.shape[-1]
    if pooling not in POOLINGS:
        raise ValueError(f"pooling must be one of {POOLINGS}, got {pooling!r}")
    out = np.empty(alpha_anchor.shape[:-1] + (len(column_spans),), dtype=np.float64)
    for c, (a, b) in enumerate(column_spans):
        if not 0 <= a < b <= n:
            raise AnalyzerInputError(f"column span [{a}, {b}) is out of range: the keys cover {n} tokens")
        span = alpha_anchor[..., a:b]
        out[..., c] = span.mean(axis=-1) if pooling == "mean" else span.sum(axis=-1)
    return out


def link_probabilities(scores: np.ndarray, temperature: float = 1.0) -> np.ndarray:
    """``softmax(log(S + 1e-8) / T)`` over the last axis."""
    z = np.log(np.asarray(scores, np.float64) + EPS) / temperature
    z -= z.max(axis=-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=-1, keepdims=True)


def select_top_p(probs: np.ndarray, top_p: float) -> np.ndarray:
    """Column indices, most probable first (ties in input order), up to and including the one where the
    cumulative probability reaches ``top_p`` (nucleus selection; at least one column)."""
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


def link(alpha_anchor: np.ndarray, column_spans: Sequence[tuple[int, int]], temperature: float,
         top_p: float, pooling: str = "mean") -> dict:
    """One request's linking: ``scores``, ``probs`` per column and the ``selected`` column indices."""
    s = column_scores(alpha_anchor, column_spans, pooling)
    p = link_probabilities(s, temperature)
    return {"scores": s, "probs": p, "selected": select_top_p(p, top_p)}


class AttnLink(SpanAttentionAnalyzer):
    """Text-to-SQL schema linking: one head's attention at the generation anchor ranks the columns (AttnLink-U)."""

    name = "attnlink"
    version = "2"  # 2: the seed's mean pooling and top_p 0.8 by default (1 summed the span, top_p 0.9)
    defaults = {"layer": None, "head": None, "temperature": 1.0, "top_p": 0.8, "pooling": "mean",
                "column_span": "column", "anchor": "last_prompt", "scale": None, "selection": None, "model": None,
                "prompt_form": None}

    def configure(self, config: dict) -> None:
        for key in ("layer", "head"):
            v = config[key]
            if v is None:
                shipped = Path(__file__).parent / "configs" / "attnlink-smollm2-135m.json"
                raise AnalyzerConfigError(f"{self.name} config lacks {key!r} (choose the head with "
                                          "python -m mia_stream.lab.head_discovery attnlink select-head; the embedded "
                                          f"model's: --config {shipped})")
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise AnalyzerConfigError(f"{self.name} config: {key!r} must be a non-negative integer, got {v!r}")
        self.configure_heads([[config["layer"], config["head"]]])
        self.temperature = check_number(config, "temperature", self.name, positive=True)
        self.top_p = check_number(config, "top_p", self.name, lo=1e-9, hi=1.0)
        self.scale = check_number(config, "scale", self.name, positive=True, optional=True)
        self.pooling = config["pooling"]
        if self.pooling not in POOLINGS:
            raise AnalyzerConfigError(f"{self.name} config: 'pooling' must be one of {list(POOLINGS)}, "
                                      f"got {self.pooling!r}")
        self.column_span = check_span_name(config, "column_span", self.name)
        self.anchor = check_span_name(config, "anchor", self.name)
        self.span_names = (self.column_span,) + (() if self.anchor == "last_prompt" else (self.anchor,))

    def check_request(self, st: PromptState) -> None:
        if self.anchor != "last_prompt":
            if len(st.spans[self.anchor]) != 1:
                raise AnalyzerInputError(f"request {st.request_id!r}: {len(st.spans[self.anchor])} spans named "
                                         f"{self.anchor!r} (the anchor), want 1")
            end = st.spans[self.anchor][0][1]
            last_col = max(b for _, b in st.spans[self.column_span])
            if end < last_col:  # causal attention: the anchor's rows cannot see columns after them
                raise AnalyzerInputError(f"request {st.request_id!r}: the anchor span {self.anchor!r} ends at token "
                                         f"{end}, before the last {self.column_span!r} span (ends {last_col}): its "
                                         f"rows cannot attend to later columns (use the prompt form with the "
                                         f"question after the schema, or anchor 'last_prompt')")
        names = self.column_names(st)
        n = len(st.spans[self.column_span])
        if names is not None and len(names) != n:
            raise AnalyzerInputError(f"request {st.request_id!r}: tags[{TAG!r}]['columns'] names {len(names)} "
                                     f"columns, the prompt has {n} {self.column_span!r} spans")

    @staticmethod
    def column_names(st: PromptState) -> list | None:
        tag = st.start.tags.get(TAG) if isinstance(st.start.tags, dict) else None
        if tag is None:
            return None
        cols = tag.get("columns") if isinstance(tag, dict) else None
        if not isinstance(cols, list) or not all(isinstance(c, str) for c in cols):
            raise AnalyzerInputError(f"request {st.request_id!r}: tags[{TAG!r}] must be {{'columns': [names]}}, "
                                     f"got {tag!r}")
        return cols

    def anchor_rows(self, st: PromptState) -> np.ndarray:
        if self.anchor == "last_prompt":
            return np.array([st.prompt_len - 1])
        (a, b), = st.spans[self.anchor]
        return np.arange(a, b)

    def score(self, st: PromptState) -> dict:
        alpha = st.attention(self.anchor_rows(st), self.scale)[0].mean(axis=0)  # the one head, anchor rows: [T]
        return link(alpha, st.spans[self.column_span], self.temperature, self.top_p, self.pooling)

    def report(self, scored: list, out) -> None:
        ids, chosen, labels = [], [], []
        for st, r in scored:
            ids.append(st.request_id)
            mask = np.zeros(len(r["probs"]), bool)
            mask[r["selected"]] = True
            chosen.append(mask)
            names = self.column_names(st)
            labels.append(",".join(names[i] if names else str(i) for i in r["selected"].tolist()))
        out.add(ids, np.arange(len(ids)), [st.prompt_len - 1 for st, _ in scored],
                {"probs": pad_rows([r["probs"] for _, r in scored], np.nan),
                 "scores": pad_rows([r["scores"] for _, r in scored], np.nan),
                 "selected": pad_rows(chosen, False),
                 "num_columns": np.array([len(r["probs"]) for _, r in scored], np.int64)},
                {"columns": labels})
