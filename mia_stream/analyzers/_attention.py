"""Attention weights rebuilt from captured post-RoPE Q/K: what the attention analyzers read.

The engine never materializes attention probabilities (fused kernels), but it computes them from the Q and K
it feeds its attention op, which the capture streams (``q [L, T, heads, D]``, ``k [L, T, kv_heads, D]``, after
RoPE). For a decoder-only model with plain causal attention this rebuild is exact:

    alpha[l, h, i, j] = softmax_j(q[l, i, h] . k[l, j, kv(h)] * scale),  j <= position(i)

with ``kv(h) = h // (num_heads // num_kv_heads)`` (grouped-query attention: each KV head serves a group of
consecutive query heads, as ``repeat_kv`` in Hugging Face) and ``scale = head_dim ** -0.5`` unless the model says
otherwise. Models with sliding windows, attention sinks, logit soft-capping or ALiBi need more than this and
are not handled here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np

from mia_stream.errors import AnalyzerInputError

__all__ = ["HeadSet", "QKBuffer", "attention_rows", "auroc", "head_attention", "kv_index", "span_mask", "widen"]


def kv_index(q_heads: Sequence[int], k_heads: Sequence[int], num_heads: int, num_kv_heads: int) -> np.ndarray:
    """For each captured query head, the index (into the captured KV heads ``k_heads``) of the KV head it reads."""
    if num_kv_heads <= 0 or num_heads % num_kv_heads:
        raise AnalyzerInputError(f"bad head geometry: {num_heads} query heads, {num_kv_heads} KV heads")
    group = num_heads // num_kv_heads
    k_heads = np.asarray(k_heads, dtype=np.int64)
    want = np.asarray(q_heads, dtype=np.int64) // group
    idx = np.searchsorted(k_heads, want)
    ok = (idx < len(k_heads)) & (k_heads[np.minimum(idx, len(k_heads) - 1)] == want) if len(k_heads) else \
        np.zeros(len(want), bool)
    if not ok.all():
        missing = sorted(set(want[~ok].tolist()))
        raise AnalyzerInputError(f"the stream's K has KV heads {k_heads.tolist()}, not KV head(s) {missing} that "
                                 "the captured query heads read")
    return idx


_BLAS = None


def _one_blas_thread():
    """BLAS on one thread for these small products: OpenBLAS's two threads on the 2 shared cores here took
    21 ms median for a [2, 90, 128] x [2, 128, 512] product that one thread does in 1.4 ms (load average 8:
    its threads spin waiting for each other). A cached controller costs 8 us per use."""
    global _BLAS
    if _BLAS is None:
        from threadpoolctl import ThreadpoolController

        _BLAS = ThreadpoolController()
    return _BLAS.limit(limits=1, user_api="blas")


def head_attention(q: np.ndarray, k: np.ndarray, q_positions: Sequence[int], scale: float | None = None
                   ) -> np.ndarray:
    """Attention probabilities of heads given side by side: ``q [H, Tq, D]`` at token positions ``q_positions``,
    ``k [H, Tk, D]`` (each head's K, its KV head's, at positions ``0..Tk-1``) -> ``[H, Tq, Tk]`` float64, zero
    past each query's position (the causal mask). One BLAS product per head, in float64."""
    pos = np.asarray(q_positions, dtype=np.int64)
    tk = k.shape[1]
    if pos.shape != (q.shape[1],):
        raise AnalyzerInputError(f"{len(pos)} query positions for {q.shape[1]} query rows")
    if len(pos) and (pos.min() < 0 or pos.max() >= tk):
        raise AnalyzerInputError(f"query positions {pos.min()}..{pos.max()} need keys 0..{pos.max()}, "
                                 f"the stream has {tk}")
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    # contiguous float64 operands: matmul takes the BLAS path only for those (a transposed view of the frame's
    # rows ran its generic loop, 40x slower: 78 ms per layer for 90 x 512 rows of 8 heads)
    q = np.ascontiguousarray(q, dtype=np.float64)
    k = np.ascontiguousarray(k, dtype=np.float64)
    with _one_blas_thread():
        logits = np.matmul(q, k.transpose(0, 2, 1))
    logits *= scale
    masked = np.arange(tk)[None, :] > pos[:, None]  # [Tq, Tk]
    if masked.any():
        logits[:, masked] = -np.inf
    logits -= logits.max(axis=-1, keepdims=True)
    np.exp(logits, out=logits)
    logits /= logits.sum(axis=-1, keepdims=True)
    return logits


def attention_rows(q: np.ndarray, k: np.ndarray, q_positions: Sequence[int], kv_of_q: np.ndarray,
                   scale: float | None = None) -> np.ndarray:
    """Attention probabilities of some query rows over all keys before them, every captured head.

    ``q``: ``[L, Tq, Hq, D]`` at token positions ``q_positions``; ``k``: ``[L, Tk, Hk, D]`` at positions
    ``0..Tk-1`` (every key the queries may see); ``kv_of_q``: ``[Hq]`` index into dim 2 of ``k`` per query head
    (``kv_index``). Returns ``[L, Hq, Tq, Tk]`` float64 (layer by layer: memory stays one layer's worth).
    """
    q = np.asarray(q)
    k = np.asarray(k)
    if q.ndim != 4 or k.ndim != 4 or q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise AnalyzerInputError(f"Q {q.shape} and K {k.shape} must be [layers, tokens, heads, head_dim] with "
                                 "the same layers and head_dim")
    kv = np.asarray(kv_of_q, dtype=np.int64)
    out = np.empty((q.shape[0], q.shape[2], q.shape[1], k.shape[1]), dtype=np.float64)
    for l in range(q.shape[0]):
        out[l] = head_attention(q[l].transpose(1, 0, 2), k[l][:, kv].transpose(1, 0, 2), q_positions, scale)
    return out


@dataclass(frozen=True)
class HeadSet:
    """A set of (layer, head) pairs, as analyzer configs name them, and the capture that provides them."""

    pairs: tuple  # ((layer, head), ...), sorted

    @classmethod
    def parse(cls, value, num_layers: int | None, num_heads: int | None, what: str = "heads") -> "HeadSet":
        """``[[layer, head], ...]`` or ``"all"`` (every head of every layer), checked against the model's
        geometry when it is given (``AnalyzerInputError`` naming the first bad pair)."""
        if value == "all":
            if num_layers is None or num_heads is None:
                return cls(())
            return cls(tuple((l, h) for l in range(num_layers) for h in range(num_heads)))
        if not isinstance(value, (list, tuple)) or not value:
            raise AnalyzerInputError(f"{what}: must be 'all' or a non-empty list of [layer, head] pairs, got "
                                     f"{value!r}")
        out = set()
        for p in value:
            if (not isinstance(p, (list, tuple)) or len(p) != 2
                    or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in p)):
                raise AnalyzerInputError(f"{what}: {p!r} is not a [layer, head] pair of non-negative integers")
            l, h = p
            if num_layers is not None and l >= num_layers:
                raise AnalyzerInputError(f"{what}: layer {l} is out of range: the model has layers "
                                         f"0..{num_layers - 1}")
            if num_heads is not None and h >= num_heads:
                raise AnalyzerInputError(f"{what}: head {h} is out of range: the model has query heads "
                                         f"0..{num_heads - 1}")
            out.add((l, h))
        return cls(tuple(sorted(out)))

    @property
    def layers(self) -> list[int]:
        return sorted({l for l, _ in self.pairs})

    @property
    def heads(self) -> list[int]:
        return sorted({h for _, h in self.pairs})

    def select(self, per_layer_head: np.ndarray, layers: Sequence[int], heads: Sequence[int]) -> np.ndarray:
        """Values of these pairs out of an array ``[len(layers), len(heads), ...]`` indexed by captured layers
        and heads: ``[len(pairs), ...]``."""
        li = {l: i for i, l in enumerate(layers)}
        hi = {h: i for i, h in enumerate(heads)}
        try:
            rows = [li[l] for l, _ in self.pairs]
            cols = [hi[h] for _, h in self.pairs]
        except KeyError:
            have = sorted(set(self.pairs) - {(l, h) for l in layers for h in heads})
            raise AnalyzerInputError(f"the stream lacks Q/K of (layer, head) {have[:4]}"
                                     f"{'...' if len(have) > 4 else ''}: capture layers {self.layers}, heads "
                                     f"{self.heads}") from None
        return per_layer_head[rows, cols]


class QKBuffer:
    """One request's captured Q/K rows, gathered by token position across the steps that streamed them.

    ``add`` takes one frame's (or one TP rank's) tensors: ``q [L, T, Hq, D]``, ``k [L, T, Hk, D]`` with their
    layers and the query / KV heads they hold (``Tensor.meta["heads"]``). With TP > 1 each rank adds its shard
    of the heads; ``queries`` / ``keys`` join them by head id. ``keys(n)`` returns K at positions ``0..n-1``,
    ``queries(positions)`` Q at those positions, over ``q_heads`` / ``k_heads`` (sorted), or raise a one-line
    ``AnalyzerInputError`` naming what the stream lacks.
    """

    def __init__(self) -> None:
        self.layers: tuple | None = None
        self.dtype: str | None = None
        self._parts: dict[tuple, dict] = {}  # (q heads, k heads) -> {"pos": [...], "q": [...], "k": [...]}

    def add(self, positions: Iterable[int], q: np.ndarray, k: np.ndarray, layers: Sequence[int],
            q_heads: Sequence[int], k_heads: Sequence[int], dtype: str | None = None) -> None:
        """``dtype``: the wire dtype when ``q``/``k`` are raw bits (``Tensor.raw()``: "bfloat16" as uint16);
        rows are widened to float32 only when read."""
        self.dtype = dtype
        layers = tuple(int(x) for x in layers)
        if self.layers is None:
            self.layers = layers
        elif layers != self.layers:
            raise AnalyzerInputError(f"the request's Q/K frames changed layers mid-stream ({list(self.layers)} "
                                     f"then {list(layers)})")
        key = (tuple(int(h) for h in q_heads), tuple(int(h) for h in k_heads))
        if len(key[0]) != q.shape[2] or len(key[1]) != k.shape[2]:
            raise AnalyzerInputError(f"Q/K frames name heads {list(key[0])} / {list(key[1])} for tensors of "
                                     f"{q.shape[2]} / {k.shape[2]} heads")
        part = self._parts.setdefault(key, {"pos": [], "q": [], "k": []})
        part["pos"].append(np.asarray(list(positions), dtype=np.int64))
        part["q"].append(q)
        part["k"].append(k)

    @property
    def empty(self) -> bool:
        return not self._parts

    def heads_at(self, position: int) -> set:
        """The query heads whose rows at ``position`` have arrived (TP: every rank's shard, once all came)."""
        return {h for (qh, _), part in self._parts.items() if any((p == position).any() for p in part["pos"])
                for h in qh}

    @property
    def q_heads(self) -> tuple:
        return tuple(sorted({h for qh, _ in self._parts for h in qh}))

    @property
    def k_heads(self) -> tuple:
        return tuple(sorted({h for _, kh in self._parts for h in kh}))

    def _gather(self, name: str, positions: np.ndarray) -> np.ndarray:
        if not self._parts:
            raise AnalyzerInputError("the stream has no Q/K frames (capture spec lacks 'qk')")
        blocks, heads = [], []
        for (qh, kh), part in self._parts.items():
            hs = qh if name == "q" else kh
            new = [i for i, h in enumerate(hs) if h not in heads]  # KV heads replicated across TP ranks: once
            if not new:
                continue
            allpos = np.concatenate(part["pos"])
            order = np.argsort(allpos, kind="stable")
            sorted_pos = allpos[order]
            idx = np.searchsorted(sorted_pos, positions)
            found = (idx < len(sorted_pos)) & (sorted_pos[np.minimum(idx, len(sorted_pos) - 1)] == positions)
            if not found.all():
                miss = positions[~found]
                raise AnalyzerInputError(f"the stream lacks {name.upper()} at {len(miss)} position(s) (first: "
                                         f"{int(miss[0])}); capture Q/K with positions 'prompt' or 'all'")
            rows = part[name][0] if len(part[name]) == 1 else np.concatenate(part[name], axis=1)
            block = rows[:, order[idx]]
            blocks.append(block if len(new) == len(hs) else block[:, :, new])
            heads.extend(hs[i] for i in new)
        out = blocks[0] if len(blocks) == 1 else np.concatenate(blocks, axis=2)
        by_head = np.argsort(heads, kind="stable")
        out = out if (by_head == np.arange(len(heads))).all() else out[:, :, by_head]
        return widen(out, self.dtype)

    def keys(self, n: int) -> np.ndarray:
        return self._gather("k", np.arange(n, dtype=np.int64))

    def queries(self, positions: Sequence[int]) -> np.ndarray:
        return self._gather("q", np.asarray(positions, dtype=np.int64))


def widen(bits: np.ndarray, dtype: str | None) -> np.ndarray:
    """Raw wire bits as numbers: bfloat16 (uint16 bits) exactly to float32; other dtypes as they are."""
    if dtype == "bfloat16":
        return (bits.astype(np.uint32) << 16).view(np.float32)
    if dtype is not None and dtype.startswith("float8"):
        raise AnalyzerInputError(f"Q/K arrive as {dtype}: the attention analyzers read float32, float16 or "
                                 "bfloat16 captures")
    return bits


def span_mask(ranges: Sequence[tuple[int, int]], n: int, name: str = "span") -> np.ndarray:
    """A boolean mask over ``n`` key positions covering token ranges ``[(start, stop), ...]``."""
    mask = np.zeros(n, dtype=bool)
    for a, b in ranges:
        if not 0 <= a < b <= n:
            raise AnalyzerInputError(f"{name} [{a}, {b}) is out of range: the prompt has {n} tokens")
        mask[a:b] = True
    return mask


def auroc(positive: Sequence[float], negative: Sequence[float]) -> float:
    """Area under the ROC curve for scores where positives should score higher (Mann-Whitney U, ties 1/2)."""
    pos = np.asarray(positive, dtype=np.float64)
    neg = np.asarray(negative, dtype=np.float64)
    if not len(pos) or not len(neg):
        raise ValueError("AUROC needs at least one positive and one negative score")
    greater = (pos[:, None] > neg[None, :]).sum()
    ties = (pos[:, None] == neg[None, :]).sum()
    return float((greater + 0.5 * ties) / (len(pos) * len(neg)))
