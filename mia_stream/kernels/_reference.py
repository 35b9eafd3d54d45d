"""Plain-torch implementations of the kernels: the CPU path, and the specification the Triton kernels are tested
against. Graph friendly: no ``.item()``, no branching on tensor values (only on shapes); they do allocate
temporaries, which is fine on the CPU path.
"""

from __future__ import annotations

import torch
from torch import Tensor

from mia_stream.kernels import _checks
from mia_stream.schemas import OP_ABLATE, OP_ADD, OP_CAP, OP_NONE  # noqa: F401  (the wire format's codes)


def scatter_rows_reference(dst: Tensor, src: Tensor, route: Tensor, residual: Tensor | None = None) -> None:
    """``dst[route[t]] = src[t] (+ residual[t])`` for ``t < src.shape[0]``; see ``capture.scatter_rows``."""
    dst_rows, src_rows, route, residual_rows = _checks.scatter_args(dst, src, route, residual)
    tokens = src_rows.shape[0]
    if tokens == 0:
        return
    values = src_rows if residual_rows is None else src_rows.float() + residual_rows.float()
    dst_rows.index_copy_(0, route[:tokens].long(), values.to(dst_rows.dtype))


def steer_rows_reference(
    hidden: Tensor,
    residual: Tensor | None,
    vectors: Tensor,
    op_codes: Tensor,
    scales: Tensor,
    thresholds: Tensor,
    slots: Tensor,
) -> None:
    """Steer ``hidden`` in place; see ``steer.steer_rows`` for the semantics."""
    hidden_rows, residual_rows = _checks.steer_args(hidden, residual, vectors, op_codes, scales, thresholds, slots)
    tokens = hidden_rows.shape[0]
    if tokens == 0 or slots.shape[1] == 0 or vectors.shape[0] == 0:
        return  # by contract every slot is < 0 when the table is empty
    base = hidden_rows.float()
    x0 = base if residual_rows is None else base + residual_rows.float()
    delta = torch.zeros_like(x0)
    token_slots = slots[:tokens].long()
    for m in range(token_slots.shape[1]):
        slot = token_slots[:, m]
        active = slot >= 0
        safe = slot.clamp(min=0)
        vector, op = vectors[safe], op_codes[safe]
        dot = ((x0 + delta) * vector).sum(dim=-1)
        norm_sq = (vector * vector).sum(dim=-1)
        inv_norm = torch.where(norm_sq > 0, norm_sq.rsqrt(), torch.zeros_like(norm_sq))
        projection = dot * inv_norm  # x . v_hat
        removed = torch.where(
            op == OP_CAP,
            (projection - thresholds[safe]).clamp(min=0),
            torch.where(op == OP_ABLATE, projection, torch.zeros_like(projection)),
        )
        coef = torch.where(op == OP_ADD, scales[safe], -removed * inv_norm)
        coef = torch.where(active, coef, torch.zeros_like(coef))
        delta = delta + coef[:, None] * vector
    touched = (token_slots >= 0).any(dim=-1)
    steered = (base + delta).to(hidden_rows.dtype)
    hidden_rows.copy_(torch.where(touched[:, None], steered, hidden_rows))
