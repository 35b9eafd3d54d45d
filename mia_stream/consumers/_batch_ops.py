"""Columnar batches the consumer SDK builds itself: a per-request frame as a one-request batch (batch mode
gets the same shape from older producers and 1.x recordings), and a batch cut down to some of its requests
(requests a consumer already has, or was asked not to take)."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from mia_stream.consumers._frames import owned, with_lease_of
from mia_stream.schemas import AnalysisBatch, RowGroup, StepBatch, Tensor, TensorFrame, TokenBatch, TokenFrame


def frame_batch(m: TensorFrame) -> StepBatch:
    """A per-request TensorFrame as the StepBatch naming only its request (same tensors, no copy)."""
    n = len(m.positions)
    group = RowGroup([0], [n], m.positions, list(m.tensors), m.token_ids if len(m.token_ids) == n else None, m.part)
    return with_lease_of(m, StepBatch(m.producer_id, m.epoch, m.step, [m.request_id], [m.seq], [group],
                                      [m.steering_version], m.time_ns))


def owned_batch(b):
    """``b`` with its tensors copied (a StepBatch; other batches own their arrays): valid after its event is
    released (zero-copy tensors view a producer's ring)."""
    if not isinstance(b, StepBatch):
        return b
    groups = [RowGroup(g.requests, g.rows, g.positions, [owned(t) for t in g.tensors], g.token_ids, g.part)
              for g in b.groups]
    return StepBatch(b.producer_id, b.epoch, b.step, list(b.request_ids), b.seqs.copy(), groups,
                     b.steering_versions, b.time_ns)


def tokens_batch(m: TokenFrame) -> TokenBatch:
    """A per-request TokenFrame as the TokenBatch naming only its request."""
    first = m.positions[0] if m.positions else 0
    return TokenBatch(m.producer_id, m.epoch, m.step, [m.request_id], [m.seq], [len(m.token_ids)],
                      list(m.token_ids), [first], [m.finish_reason], m.time_ns)


def subset_batch(b, keep: Sequence[int]):
    """``b`` naming only requests ``keep`` (ascending indices into ``b.request_ids``); tensor rows are copied."""
    keep_arr = np.asarray(keep, dtype=np.intp)
    remap = np.full(len(b.request_ids), -1, dtype=np.int64)
    remap[keep_arr] = np.arange(len(keep_arr))
    ids = [b.request_ids[i] for i in keep_arr.tolist()]
    seqs = b.seqs[keep_arr]
    if isinstance(b, StepBatch):
        groups = []
        for g in b.groups:
            mine = remap[g.requests] >= 0
            if not mine.any():
                continue
            rows = np.flatnonzero(np.repeat(mine, g.rows))
            tensors = []
            for t in g.tensors:
                data = np.ascontiguousarray(t.raw()[:, rows])
                scale = t.scale
                if scale is not None and scale.ndim >= 2 and scale.shape[1] == t.shape[1]:
                    scale = np.ascontiguousarray(scale[:, rows])
                tensors.append(Tensor(t.name, t.dtype, data.shape, data, t.layers, t.shard, scale, t.meta))
            groups.append(RowGroup(remap[g.requests[mine]], g.rows[mine], g.positions[rows], tensors,
                                   g.token_ids[rows], g.part))
        return StepBatch(b.producer_id, b.epoch, b.step, ids, seqs, groups, b.steering_versions[keep_arr], b.time_ns)
    if isinstance(b, TokenBatch):
        tok_mask = np.repeat(remap >= 0, b.counts)
        return TokenBatch(b.producer_id, b.epoch, b.step, ids, seqs, b.counts[keep_arr], b.token_ids[tok_mask],
                          b.first_positions[keep_arr], [b.finish_reasons[i] for i in keep_arr.tolist()], b.time_ns)
    if isinstance(b, AnalysisBatch):
        row_mask = np.repeat(remap >= 0, b.rows)
        idx = np.flatnonzero(row_mask).tolist()
        return AnalysisBatch(b.producer_id, b.epoch, b.analyzer, ids, seqs, b.rows[keep_arr], b.positions[row_mask],
                             {k: v[row_mask] for k, v in b.values.items()},
                             {k: [v[j] for j in idx] for k, v in b.labels.items()}, b.alerts[row_mask], b.step,
                             b.analyzer_version, b.time_ns, b.source_time_ns)
    raise TypeError(f"not a columnar batch: {type(b).__name__}")
