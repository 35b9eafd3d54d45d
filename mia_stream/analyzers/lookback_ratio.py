"""``lookback_ratio``: per attention head, how much of its attention a generated token puts on the prompt versus
on the tokens generated so far, computed from the captured Q/K, fed to a logistic model over a sliding window.

Method: Y.-S. Chuang, L. Qiu, C.-Y. Hsieh, R. Krishna, Y. Kim, J. Glass, "Lookback Lens: Detecting and
Mitigating Contextual Hallucinations in Large Language Models Using Only Attention Maps", EMNLP 2024
(arXiv:2407.07071). For the query of generated token t, layer l, head h, with a prompt of N tokens::

    A_ctx = mean of the attention weights on the prompt keys 0 .. N-1
    A_new = mean of the attention weights on the generated keys N .. t (the token itself included)
    LR[l, h] = A_ctx / (A_ctx + A_new)

The feature vector of a token is the mean of the LR vectors (all captured layers x heads) over the last
``window`` generated tokens (the paper: 8), and a logistic regression maps it to a probability of
hallucination. They report AUROC 0.91 (span-level, NQ, LLaMA-2-7B-chat, predefined spans) and transfer
across tasks and models.

Here the attention weights are recomputed from the captured post-RoPE ``q`` and ``k`` of the probe's layers:
``softmax_k(q . k / sqrt(head_dim))`` over keys 0..t (causal), query head h reading key head
``h // (heads / kv_heads)`` (grouped-query attention), in float64. The analyzer keeps each request's keys
(every position: the prompt's arrive in its prefill steps) and needs every position captured
(``positions: "all"``); a request whose Q/K skips positions (a reused prefix cache, a gap) is rejected with a
one-line error. The first generated token attends only to the prompt and itself, as in the paper.

Published values (``analyzers/_risk.py``): per generated token ``risk`` (the logistic model on the windowed
LR features), ``window_risk``, ``span_risk``, alert ``risk >= threshold``, plus ``lookback`` float32 (the mean
LR over all heads at this token) and, with ``emit_ratios``, ``lookback_ratios`` float32 ``[layers, heads]``;
at the end ``answer_risk`` (default ``risk_max``), ``risk_max``, ``risk_mean``, ``risk_last``, ``window_max``,
``tokens``.

Probe file (``mia_stream.probe/1``, ``analyzer: "lookback_ratio"``): ``num_features`` = layers x heads,
``extra``: ``layers`` (the Q/K layers read, in feature order, layer-major), ``heads`` (query heads per layer),
``window`` (feature window); ``layer`` is the first of them. Shipped: ``probes/lookback-ratio-smollm2-135m.json``.

Config: ``probe``, ``threshold``, ``window`` (of ``window_risk``), ``answer_score``, ``emit_ratios`` (bool).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from mia_stream.analyzers._base import Needs, RequestTable, layer_rows
from mia_stream.analyzers._probe import LinearProbe, sigmoid
from mia_stream.analyzers._risk import RiskDetector
from mia_stream.errors import AnalyzerConfigError, AnalyzerInputError
from mia_stream.schemas import StepBatch, StreamStart

DEFAULT_PROBE = "lookback-ratio-smollm2-135m.json"


def lookback_ratios(q: np.ndarray, keys: np.ndarray, positions: np.ndarray, prompt_len: int) -> np.ndarray:
    """LR ``[m, L, H]`` of ``m`` query rows ``q`` ``[L, m, H, D]`` at ``positions`` (all >= ``prompt_len``)
    against ``keys`` ``[L, T, KV, D]`` (every position 0..T-1, T > max position); float64."""
    n_layers, m, heads, dim = q.shape
    kv = keys.shape[2]
    group = heads // kv
    t = int(positions.max()) + 1
    qg = q.astype(np.float64).reshape(n_layers, m, kv, group, dim)
    k = keys[:, :t].astype(np.float64)
    s = np.einsum("lmkgd,ltkd->lmkgt", qg, k) / np.sqrt(dim)  # [L, m, KV, G, T]
    causal = np.arange(t)[None, :] > positions[:, None]  # [m, T]: keys after the query
    s = np.where(causal[None, :, None, None, :], -np.inf, s)
    s -= s.max(axis=-1, keepdims=True)
    a = np.exp(s)
    a /= a.sum(axis=-1, keepdims=True)
    ctx = a[..., :prompt_len].mean(axis=-1)
    new = a[..., prompt_len:].sum(axis=-1) / (positions - prompt_len + 1)[None, :, None, None]
    lr = ctx / (ctx + new)  # [L, m, KV, G]
    return lr.reshape(n_layers, m, heads).transpose(1, 0, 2)


class KeyCache:
    """Each request's keys of the layers read, every position so far, and the lookback ratios of its generated
    rows: what the analyzer computes live and what training reads from a recording (one code path)."""

    def __init__(self, layers: Sequence[int]):
        self.layers = list(layers)
        self.keys: dict[str, list] = {}  # request id -> [keys [L, capacity, KV, D] float32, positions held]

    def release(self, request_id: str) -> None:
        self.keys.pop(request_id, None)

    def _append(self, rid: str, k: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """Add a request's key rows (positions contiguous from what it holds; a recomputed position replaces
        its old row); return its keys so far ``[L, T, KV, D]``."""
        entry = self.keys.get(rid)
        held = 0 if entry is None else entry[1]
        first = int(positions[0])
        if first > held or (np.diff(positions) != 1).any():
            raise AnalyzerInputError(f"request {rid!r}: Q/K of positions {held}..{first - 1} were not captured (a "
                                     f"reused prefix cache or a gap); lookback_ratio needs every position")
        end = first + len(positions)
        if entry is None or entry[0].shape[1] < end:
            cap = max(end, 2 * (entry[0].shape[1] if entry else 64))
            buf = np.zeros((k.shape[0], cap, k.shape[2], k.shape[3]), np.float32)
            if entry is not None:
                buf[:, :held] = entry[0][:, :held]
            entry = self.keys[rid] = [buf, held]
        entry[0][:, first:end] = k
        entry[1] = end
        return entry[0][:, :end]

    def group_ratios(self, batch: StepBatch, g, prompt_lengths: dict, scored_up_to=None):
        """The lookback ratios of ``g``'s generated rows: (row_requests, positions, LR ``[M, L, H]`` float64);
        None when it has none. ``scored_up_to(rid)``: the first position not yet scored (recomputed rows of a
        preempted request are scored once)."""
        if not (g.has("q") and g.has("k")):
            return None
        tq, tk = g.tensor("q"), g.tensor("k")
        q_all = tq.numpy()[layer_rows(tq, self.layers)]  # [L, N, H, D]
        k_all = tk.numpy()[layer_rows(tk, self.layers)]  # [L, N, KV, D]
        ids = batch.request_ids
        out_rr, out_pos, out_lr = [], [], []
        for i, off, n in zip(g.requests.tolist(), g.offsets.tolist(), g.rows.tolist()):
            rid = ids[i]
            pos = g.positions[off:off + n]
            keys = self._append(rid, k_all[:, off:off + n], pos)
            plen = prompt_lengths.get(rid, 0)
            gen = pos >= plen
            if scored_up_to is not None:
                gen &= pos >= scored_up_to(rid)
            if not plen or not gen.any():
                continue
            out_lr.append(lookback_ratios(q_all[:, off:off + n][:, gen], keys, pos[gen], plen))
            out_rr.append(np.full(int(gen.sum()), i, np.int64))
            out_pos.append(pos[gen])
        if not out_lr:
            return None
        return np.concatenate(out_rr), np.concatenate(out_pos), np.concatenate(out_lr)


def window_means(lr: np.ndarray, window: int) -> np.ndarray:
    """Per row of one request's LR vectors ``[G, F]`` (in generation order), the mean over its last ``window``
    rows: the features the logistic model reads (what the analyzer's ring buffer computes, summed in the same
    slot order so training and live features agree)."""
    out = np.empty_like(lr, dtype=np.float64)
    ring = np.zeros((window, lr.shape[1]))
    for r in range(len(lr)):
        ring[r % window] = lr[r]
        out[r] = ring.sum(axis=0) / min(r + 1, window)
    return out


class LookbackRatio(RiskDetector):
    """Lookback Lens (Chuang et al. 2024): prompt-vs-generated attention per head -> logistic model, windowed."""

    name = "lookback_ratio"
    version = "1"
    defaults = {"probe": DEFAULT_PROBE, "threshold": None, "window": 4, "answer_score": None,
                "emit_ratios": False, "alert": None}

    def load(self, probe: LinearProbe, config: dict) -> None:
        extra = probe.extra
        layers, heads, window = extra.get("layers"), extra.get("heads"), extra.get("window")
        if not (isinstance(layers, list) and layers and all(isinstance(x, int) and not isinstance(x, bool)
                                                             and x >= 0 for x in layers)
                and isinstance(heads, int) and heads > 0 and isinstance(window, int) and window > 0):
            raise AnalyzerConfigError(f"probe file {probe.path}: 'extra' needs layers (a list of layer indices), "
                                      f"heads and window (positive integers)")
        if probe.num_features != len(layers) * heads:
            raise AnalyzerConfigError(f"probe file {probe.path}: 'num_features' must be layers x heads = "
                                      f"{len(layers) * heads}, got {probe.num_features}")
        if not isinstance(config["emit_ratios"], bool):
            raise AnalyzerConfigError(f"lookback_ratio config: 'emit_ratios' must be true or false, "
                                      f"got {config['emit_ratios']!r}")
        self.emit_ratios = config["emit_ratios"]
        self.heads, self.feature_window = heads, window
        self.v, self.c = probe.folded(np.float64)
        self._needs = Needs(qk_layers=tuple(sorted(set(layers))), qk_heads="all", qk_positions="all")
        self.features = RequestTable(ring=((window, len(layers) * heads), np.float64), count=((), np.int64))
        self.cache = KeyCache(layers)

    def start_request(self, start: StreamStart) -> None:
        if start.num_heads and start.num_heads != self.heads:
            raise AnalyzerInputError(f"request {start.request_id!r}: the probe {self.probe.path} reads "
                                     f"{self.heads} heads per layer, the stream's model has {start.num_heads}")

    def end_request(self, request_id: str) -> None:
        self.cache.release(request_id)
        self.features.release(request_id)

    def _scored_up_to(self, rid: str) -> int:
        slot = self.table.slot(rid)
        return int(self.table["next_pos"][slot]) if slot is not None else 0

    def score(self, batch: StepBatch, g):
        found = self.cache.group_ratios(batch, g, self.prompt_lengths, self._scored_up_to)
        if found is None:
            return None
        rr, pos, lr = found  # lr [M, L, H]
        if lr.shape[2] != self.heads:
            raise AnalyzerInputError(f"q rows with {lr.shape[2]} heads, the probe needs {self.heads}")
        feats = self._window_features(batch.request_ids, rr, lr.reshape(len(lr), -1))
        risk = sigmoid((feats * self.v).sum(axis=1) + self.c)
        extra = {"lookback": lr.mean(axis=(1, 2)).astype(np.float32)}
        if self.emit_ratios:
            extra["lookback_ratios"] = lr.astype(np.float32)
        return rr, pos, risk, extra, None

    def _window_features(self, ids: list, rr: np.ndarray, lr: np.ndarray) -> np.ndarray:
        """Per row, the mean LR vector over its request's last ``window`` generated tokens (rows in order)."""
        t = self.features
        out = np.empty_like(lr)
        for r in range(len(lr)):
            s = t.slots([ids[rr[r]]])[0]
            c = t["count"][s]
            t["ring"][s, c % self.feature_window] = lr[r]
            t["count"][s] = c + 1
            out[r] = t["ring"][s].sum(axis=0) / min(c + 1, self.feature_window)
        return out
