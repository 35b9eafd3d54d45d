"""The shared half of the attention analyzers (attention_tracker, core_reranker, attnlink): per request, gather
the prompt's Q/K rows as its steps stream in (chunked prefill spreads a prompt over several steps), and once
the last prompt row has arrived score it (``score``: the attention of the rows it needs, rebuilt from Q/K)
and report every request scored in the step at once (``report``).

A request is rejected at its start (one line naming the missing piece) when its capture lacks the Q/K the
analyzer needs or its tags lack the spans (``mia_stream.spans.PromptParts.tags``). Q/K rows are copied out of
the batch (its buffers may be a shared-memory ring the producer reuses) and freed as soon as the request is
scored: a prompt of 400 tokens with all 30 layers of the embedded model holds ~37 MB until then.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from mia_stream.analyzers._attention import HeadSet, QKBuffer, head_attention, kv_index
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
    group: int = 1  # query heads per KV head
    _keep: dict = field(default_factory=dict)

    def keep_index(self, layers: list, q_heads: list, k_heads: list) -> tuple:
        """Indices into a frame's layers, query heads and KV heads of what the chosen pairs read (memoized per
        layout: the same for every step of a request)."""
        key = (tuple(layers), tuple(q_heads), tuple(k_heads))
        got = self._keep.get(key)
        if got is None:
            want_l, want_h = set(self.heads.layers), set(self.heads.heads)
            want_kv = {h // self.group for h in want_h}
            got = self._keep[key] = (np.array([i for i, l in enumerate(layers) if l in want_l], np.int64),
                                     np.array([i for i, h in enumerate(q_heads) if h in want_h], np.int64),
                                     np.array([i for i, h in enumerate(k_heads) if h in want_kv], np.int64))
        return got

    def attention(self, positions: Sequence[int], scale: float | None) -> np.ndarray:
        """Attention of the query rows at ``positions`` over keys ``0..max(positions)``, for the chosen heads
        (in ``heads.pairs`` order): ``[len(heads.pairs), len(positions), max + 1]`` float64."""
        positions = np.asarray(positions, dtype=np.int64)
        qk = self.qk
        kv = kv_index(qk.q_heads, qk.k_heads, self.start.num_heads, self.start.num_kv_heads)
        q = qk.queries(positions)  # [L', Tq, H', D]: the layers and heads the pairs use (see on_batch)
        k = qk.keys(int(positions.max()) + 1)
        li = {l: i for i, l in enumerate(qk.layers)}
        hi = {h: i for i, h in enumerate(qk.q_heads)}
        missing = [p for p in self.heads.pairs if p[0] not in li or p[1] not in hi]
        if missing:
            raise AnalyzerInputError(f"the stream lacks Q/K of (layer, head) {missing[:4]}")
        out = np.empty((len(self.heads.pairs), len(positions), k.shape[1]), dtype=np.float64)
        by_layer: dict[int, list] = {}
        for j, (l, h) in enumerate(self.heads.pairs):
            by_layer.setdefault(l, []).append((j, hi[h]))
        for l, items in by_layer.items():  # one layer at a time: memory stays one layer's worth
            rows = [j for j, _ in items]
            heads = np.array([h for _, h in items])
            out[rows] = head_attention(q[li[l]][:, heads].transpose(1, 0, 2),
                                       k[li[l]][:, kv[heads]].transpose(1, 0, 2), positions, scale)
        return out


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
    and ``self.span_names`` in ``configure`` and implement ``score`` and ``report``; ``check_request`` may refuse a
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
        state.group = self.start_geometry(state)
        self.check_request(state)
        self._requests[rid] = state

    def on_batch(self, batch: StepBatch, out: Results) -> None:
        ids = batch.request_ids
        finished: list[PromptState] = []
        for g in batch.groups:
            if not (g.has("q") and g.has("k")):
                continue
            qt, kt = g.tensor("q"), g.tensor("k")
            qraw, kraw = qt.raw(), kt.raw()  # bits; widened only for the rows and heads kept
            q_heads, k_heads = list(qt.meta.get("heads", ())), list(kt.meta.get("heads", ()))
            layers = list(qt.layers)
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
                li, qi, ki = st.keep_index(layers, q_heads, k_heads)
                if not len(qi):
                    continue  # a TP rank holding none of the heads this analyzer reads
                sel = np.flatnonzero(keep) + a
                # one gathering copy of only the layers and heads the pairs use (the batch's buffers may be a
                # ring the producer reuses)
                st.qk.add(g.positions[sel], qraw[np.ix_(li, sel, qi)], kraw[np.ix_(li, sel, ki)],
                          [layers[x] for x in li], [q_heads[x] for x in qi], [k_heads[x] for x in ki], qt.dtype)
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

    @staticmethod
    def start_geometry(st: PromptState) -> int:
        """Query heads per KV head (GQA group size) of the request's model."""
        nkv = st.start.num_kv_heads or st.start.num_heads
        if not nkv or st.start.num_heads % nkv:
            raise AnalyzerInputError(f"request {st.request_id!r}: bad head geometry {st.start.num_heads} query "
                                     f"/ {st.start.num_kv_heads} KV heads")
        return st.start.num_heads // nkv

    # ------------------------------------------------------------------------------------ to implement
    def check_request(self, state: PromptState) -> None:
        """Refuse a request at its start (``AnalyzerInputError``); the default accepts it."""

    def score(self, state: PromptState) -> Any:
        """The request's result once its whole prompt's Q/K is in (``AnalyzerInputError``: an error row)."""
        raise NotImplementedError

    def report(self, scored: list, out: Results) -> None:
        """Add the rows of the requests scored in one step (``scored``: ``[(state, result), ...]``)."""
        raise NotImplementedError
