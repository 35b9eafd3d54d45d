"""In-graph detector scores: each watched token row's projection on its detectors' probe directions.

``project_rows(out, hidden, residual, table, slots)`` writes ``out[t, k] = x_t . table[slots[t, k]]`` for every
token row ``t`` of the step and detector column ``k`` whose slot is >= 0, where ``x_t`` is the row as the capture
op stores it (``hidden + residual`` rounded to the model's dtype), so an in-engine score equals the analyzer's on
the captured row. The rest of ``out`` is left as it was (the host reads only the pairs it routed). Triton on CUDA
(one program per token row, all its columns at once, no allocation, no host sync: it runs inside CUDA graphs) and
the torch reference on CPU; both accumulate in float32 on the GPU, the reference in float64.
"""

from __future__ import annotations

import torch
from torch import Tensor

from mia_stream.kernels import _dispatch

try:
    import triton
    import triton.language as tl

    from mia_stream.kernels._triton_util import round_to_bfloat16
except Exception:  # no Triton: only the reference exists
    triton = None

__all__ = ["project_rows", "project_rows_reference", "project_rows_triton"]


def _check(out: Tensor, hidden: Tensor, residual: Tensor | None, table: Tensor, slots: Tensor) -> None:
    tokens = hidden.shape[0]
    if out.dim() != 2 or out.dtype != torch.float32:
        raise ValueError(f"out must be float32 [rows, columns], got {out.dtype} {tuple(out.shape)}")
    if slots.dim() != 2 or slots.shape[1] != out.shape[1] or slots.shape[0] < tokens or out.shape[0] < tokens:
        raise ValueError(f"slots {tuple(slots.shape)} / out {tuple(out.shape)} do not cover {tokens} token rows")
    if table.dim() != 2 or table.dtype != torch.float32 or table.shape[1] != hidden.reshape(tokens, -1).shape[1]:
        raise ValueError(f"table must be float32 [slots, {hidden.reshape(tokens, -1).shape[1]}], got "
                         f"{table.dtype} {tuple(table.shape)}")
    if residual is not None and residual.shape != hidden.shape:
        raise ValueError(f"residual {tuple(residual.shape)} does not match hidden {tuple(hidden.shape)}")


def project_rows(out: Tensor, hidden: Tensor, residual: Tensor | None, table: Tensor, slots: Tensor) -> None:
    """See the module docstring. ``slots``: int32 ``[>= T, K]`` (this layer's routing), -1 = not scored here."""
    if _dispatch.active_backend(out.device) == "triton":
        project_rows_triton(out, hidden, residual, table, slots)
        _dispatch._record("project_rows", "triton")
    else:
        project_rows_reference(out, hidden, residual, table, slots)
        _dispatch._record("project_rows", "reference")


def project_rows_reference(out: Tensor, hidden: Tensor, residual: Tensor | None, table: Tensor,
                           slots: Tensor) -> None:
    _check(out, hidden, residual, table, slots)
    tokens = hidden.shape[0]
    routed = slots[:tokens]
    pairs = (routed >= 0).nonzero()
    if not len(pairs):  # (CPU: the op body runs eagerly, so looking costs no sync)
        return
    t, k = pairs[:, 0], pairs[:, 1]
    x = hidden.reshape(tokens, -1)[t].float()
    if residual is not None:
        x = x + residual.reshape(tokens, -1)[t].float()
    x = x.to(hidden.dtype).to(torch.float64)  # the row as the capture stores it
    w = table[routed[t, k].long()].to(torch.float64)
    out[t, k] = (x * w).sum(dim=1).to(torch.float32)


def project_rows_triton(out: Tensor, hidden: Tensor, residual: Tensor | None, table: Tensor, slots: Tensor) -> None:
    if triton is None:
        raise RuntimeError("Triton is not importable")
    _check(out, hidden, residual, table, slots)
    tokens = hidden.shape[0]
    if tokens == 0:
        return
    src = hidden.reshape(tokens, -1)
    res = residual.reshape(tokens, -1) if residual is not None else src
    width, cols = src.shape[1], out.shape[1]
    if src.stride(1) != 1 or res.stride(1) != 1 or not table.is_contiguous() or slots.stride(1) != 1:
        raise ValueError("project_rows_triton needs unit-stride rows")
    _project_kernel[(tokens,)](
        out, src, res, table, slots, width, cols, out.stride(0), src.stride(0), res.stride(0), slots.stride(0),
        HAS_RESIDUAL=residual is not None,
        ROUND=2 if hidden.dtype == torch.bfloat16 else 1 if hidden.dtype == torch.float16 else 0,
        BLOCK_K=triton.next_power_of_2(max(cols, 1)), BLOCK_H=min(1024, triton.next_power_of_2(width)),
        num_warps=4)


if triton is not None:

    @triton.jit
    def _project_kernel(out_ptr, src_ptr, res_ptr, table_ptr, slots_ptr, width, cols, out_stride, src_stride,
                        res_stride, slots_stride, HAS_RESIDUAL: tl.constexpr, ROUND: tl.constexpr,
                        BLOCK_K: tl.constexpr, BLOCK_H: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        ks = tl.arange(0, BLOCK_K)
        slot = tl.load(slots_ptr + t * slots_stride + ks, mask=ks < cols, other=-1)
        valid = slot >= 0
        if tl.sum(valid.to(tl.int32), axis=0) > 0:  # most rows of most layers: nothing to score, one load
            acc = tl.zeros([BLOCK_K], dtype=tl.float32)
            row = tl.where(valid, slot, 0).to(tl.int64)
            for h0 in range(0, width, BLOCK_H):
                hs = h0 + tl.arange(0, BLOCK_H)
                hm = hs < width
                x = tl.load(src_ptr + t * src_stride + hs, mask=hm, other=0.0).to(tl.float32)
                if HAS_RESIDUAL:
                    x = x + tl.load(res_ptr + t * res_stride + hs, mask=hm, other=0.0).to(tl.float32)
                if ROUND == 2:
                    x = round_to_bfloat16(x).to(tl.float32)
                elif ROUND == 1:
                    x = x.to(tl.float16).to(tl.float32)
                w = tl.load(table_ptr + row[:, None] * width + hs[None, :], mask=valid[:, None] & hm[None, :],
                            other=0.0)
                acc += tl.sum(w * x[None, :], axis=1)
            tl.store(out_ptr + t * out_stride + ks, acc, mask=valid)
