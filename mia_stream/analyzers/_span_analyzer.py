"""The shared half of the attention analyzers (attention_tracker, core_reranker, attnlink): per request, gather
the prompt's Q/K rows as its steps stream in (chunked prefill spreads a prompt over several steps), and once
the last prompt row has arrived hand the request to ``on_prompt`` with its attention source and named spans.

A request is rejected at its start (one line naming the missing piece) when its capture lacks the Q/K the
analyzer needs or its tags lack the spans (``mia_stream.spans.PromptParts.tags``). Q/K rows are copied out of
the batch (its buffers may be a shared-memory ring the producer reuses) and freed as soon as the request is
scored: a prompt of 400 tokens with all 30 layers of the embedded model holds ~37 MB until then.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from mia_stream.analyzers._attention import HeadSet, QKBuffer, attention_rows, kv_index
from mia_stream.analyzers._base import Analyzer, Results
from mia_stream.errors import AnalyzerConfigError, AnalyzerInputError, SpanError
from mia_stream.schemas import StepBatch, StreamEnd, StreamStart
from mia_stream.spans import spans_from_tags


@dataclass
class PromptState:
    """One request while its prompt streams in."""

    request_id: str
    start: StreamStart
    prompt_len: int
    spans: dict
    heads: HeadSet
    qk: QKBuffer = field(default_factory=QKBuffer)
    done: bool = False

    def attention(self, positions: Sequence[int], scale: float | None) -> np.ndarray:
        """Attention of the query rows at ``positions`` over keys ``0..max(positions)``, for the chosen heads:
        ``[len(heads.pairs), len(positions), max + 1]``."""
        positions = np.asarray(positions, dtype=np.int64)
        qk = self.qk
        kv = kv_index(qk.q_heads, qk.k_heads, self.start.num_heads, self.start.num_kv_heads)
        # only the layers and query heads the chosen pairs use
        layers = self.heads.layers
        li = [qk.layers.index(l) for l in layers]
        hs = self.heads.heads
        hi = [qk.q_heads.index(h) for h in hs]
        q = qk.queries(positions)[li][:, :, hi]
        k = qk.keys(int(positions.max()) + 1)[li]
        alpha = attention_rows(q, k, positions, kv[hi], scale)  # [L', H', Tq, Tk]
        return self.heads.select(alpha, layers, hs)


def check_number(config: dict, key: str, name: str, *, positive: bool = False, optional: bool = False,
                 lo: float | None = None, hi: float | None = None) -> float | None:
    v = config.get(key)
    if v is None and optional:
        return None
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not np.isfinite(v) or (positive and v <= 0) \
            or (lo is not None and v < lo) or (hi is not None and v > hi):
        want = "a positive number" if positive else f"a number in [{lo}, {hi}]" if lo is not None else "a number"
        raise AnalyzerConfigError(f"{name} config: {key!r} must be {want}, got {v!r}")
    return float(v)


def check_span_name(config: dict, key: str, name: str) -> str:
    v = config.get(key)
    if not isinstance(v, str) or not v:
        raise AnalyzerConfigError(f"{name} config: {key!r} must be a span name, got {v!r}")
    return v


def pad_rows(rows: Sequence[np.ndarray], fill: Any) -> np.ndarray:
    """1-D arrays of different lengths as one ``[n, max_len]`` array (results of one step share a shape)."""
    width = max(len(r) for r in rows)
    dtype = np.result_type(*[r.dtype for r in rows])
    out = np.full((len(rows), width), fill, dtype=dtype)
    for i, r in enumerate(rows):
        out[i, :len(r)] = r
    return out


class SpanAttentionAnalyzer(Analyzer):
    """Base of the attention analyzers. Subclasses set ``self.heads_value`` (config ``heads``: pairs or "all")
    and ``self.span_names`` in ``configure`` and implement ``on_prompt``; ``check_request`` may refuse a
    request at its start (``AnalyzerInputError``)."""

    heads_value: Any = "all"
    span_names: tuple = ()
    scale: float | None = None

    def needs(self):
        from mia_stream.analyzers._base import Needs

        if self.heads_value == "all":
            return Needs(qk_layers="all", qk_heads="all", qk_positions="prompt")
        hs = HeadSet.parse(self.heads_value, None, None, f"{self.name} config: heads")
        return Needs(qk_layers=tuple(hs.layers), qk_heads=tuple(hs.heads), qk_positions="prompt")

    def __init__(self, config: dict | None = None):
        self._requests: dict[str, PromptState] = {}
        super().__init__(config)

    def configure_heads(self, value: Any) -> None:
        try:
            HeadSet.parse(value, None, None, f"{self.name} config: heads")
        except AnalyzerInputError as e:
            raise AnalyzerConfigError(str(e)) from None
        self.heads_value = value

    # ------------------------------------------------------------------------------------ stream callbacks
    def on_start(self, start: StreamStart) -> None:
        rid = start.request_id
        # the configured heads against the model first: "out of range" says more than "not captured"
        heads = HeadSet.parse(self.heads_value, start.num_layers, start.num_heads,
                              f"request {rid!r}: {self.name} config: heads")
        super().on_start(start)
        prompt_len = len(start.prompt_token_ids)
        if prompt_len == 0:
            raise AnalyzerInputError(f"request {rid!r}: the stream start carries no prompt token ids")
        try:
            spans = spans_from_tags(start.tags, prompt_len)
        except SpanError as e:
            raise AnalyzerInputError(f"request {rid!r}: {e}") from None
        for name in self.span_names:
            if name not in spans:
                raise AnalyzerInputError(f"request {rid!r}: its spans lack {name!r} (it has {sorted(spans)})")
        state = PromptState(rid, start, prompt_len, spans, heads)
        self.check_request(state)
        self._requests[rid] = state

    def on_batch(self, batch: StepBatch, out: Results) -> None:
        ids = batch.request_ids
        finished: list[PromptState] = []
        for g in batch.groups:
            if not (g.has("q") and g.has("k")):
                continue
            qt, kt = g.tensor("q"), g.tensor("k")
            qn, kn = qt.numpy(), kt.numpy()
            q_heads, k_heads = qt.meta.get("heads", ()), kt.meta.get("heads", ())
            off = g.offsets.tolist()
            for j, i in enumerate(g.requests.tolist()):
                st = self._requests.get(ids[i])
                if st is None or st.done:
                    continue
                a, b = off[j], off[j + 1]
                pos = g.positions[a:b]
                keep = pos < st.prompt_len
                if not keep.any():
                    continue
                sel = np.flatnonzero(keep) + a
                # copies: the batch's buffers may be a ring the producer overwrites
                st.qk.add(g.positions[sel], qn[:, sel], kn[:, sel], qt.layers, q_heads, k_heads)
                # scored once the last prompt row of every head it needs is in (TP > 1: of every rank)
                if st.prompt_len - 1 in pos[keep] and set(st.heads.heads) <= st.qk.heads_at(st.prompt_len - 1):
                    finished.append(st)
        if finished:
            ok = []
            for st in finished:
                st.done = True
                try:
                    ok.append((st, self.score(st)))
                except AnalyzerInputError as e:
                    out.add_one(st.request_id, labels={"error": str(e)}, position=st.prompt_len - 1)
                st.qk = QKBuffer()  # free the rows
            if ok:
                self.report(ok, out)

    def on_end(self, request_id: str, end: StreamEnd | None, out: Results) -> None:
        st = self._requests.pop(request_id, None)
        if st is not None and not st.done and end is not None:
            out.add_one(request_id, labels={"error": f"request {request_id!r} ended before its last prompt "
                                                     f"row ({st.prompt_len - 1}) arrived"})

    # ------------------------------------------------------------------------------------ to implement
    def check_request(self, state: PromptState) -> None:
        """Refuse a request at its start (``AnalyzerInputError``); the default accepts it."""

    def score(self, state: PromptState) -> Any:
        """The request's result once its whole prompt's Q/K is in (``AnalyzerInputError``: an error row)."""
        raise NotImplementedError

    def report(self, scored: list, out: Results) -> None:
        """Add the rows of the requests scored in one step (``scored``: ``[(state, result), ...]``)."""
        raise NotImplementedError
