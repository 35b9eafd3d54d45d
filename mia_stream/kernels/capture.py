"""In-graph capture: scatter the rows of the tokens being watched into a fixed aperture buffer.

``scatter_rows`` picks Triton on CUDA and the torch reference on CPU (see ``_dispatch``). Both write into the
given ``dst`` only: no allocation in the Triton path, one launch with a grid fixed by the shapes, no host sync.
"""

from __future__ import annotations

import torch
from torch import Tensor

from mia_stream.kernels import _checks, _dispatch
from mia_stream.kernels._reference import scatter_rows_reference

try:
    import triton
    import triton.language as tl

    from mia_stream.kernels._triton_util import round_to_bfloat16
except Exception:  # no Triton: only the reference exists
    triton = None

__all__ = ["scatter_rows", "scatter_rows_reference", "scatter_rows_triton"]

# A program copies a [BLOCK_T, BLOCK_H] tile: rows wider than _MAX_BLOCK_H are split over a second grid axis
# (keeps H = 4096..8192 spread over many SMs), short rows are stacked to about _TILE values per program.
_MAX_BLOCK_H = 1024
_TILE = 2048


def scatter_rows(dst: Tensor, src: Tensor, route: Tensor, residual: Tensor | None = None) -> None:
    """Write token rows into their aperture rows: ``dst[route[t]] = src[t] (+ residual[t])`` for ``t < T``.

    - ``dst``: ``[R, H]`` (or ``[R, ...]`` whose dims after the first are contiguous, e.g. ``aperture[layer]``).
      Row ``R - 1`` is the caller's sentinel: tokens that are not watched are routed there, and it holds
      whichever of them was written last.
    - ``src``: ``[T, H]`` (or ``[T, ...]``, e.g. q ``[T, heads, head_dim]``), any row stride, so a slice of a
      fused qkv output works as is. ``T == 0`` is a no-op.
    - ``route``: int32 or int64 ``[>= T]``; entries past ``T`` are ignored. The caller guarantees
      ``0 <= route[t] < R``.
    - ``residual``: optional, same shape and dtype as ``src``; then ``src + residual`` is formed in float32.
    - The value is cast to ``dst.dtype`` (round to nearest even), so a float32 aperture can take bf16/fp16 rows.

    The result is bit-identical between the Triton and reference implementations.
    """
    if _dispatch.active_backend(dst.device) == "triton":
        scatter_rows_triton(dst, src, route, residual)
        _dispatch._record("scatter_rows", "triton")
    elif dst.device.type == "cpu" and _only_sentinel_cpu(dst, src, route, residual):
        _dispatch._record("scatter_rows", "reference")
    else:
        scatter_rows_reference(dst, src, route, residual)
        _dispatch._record("scatter_rows", "reference")


def _config(width: int) -> tuple[int, int, int]:
    """(BLOCK_T, BLOCK_H, num_warps): the column block that pads the row least (largest on ties), and
    BLOCK_T rows stacked to _TILE values per program. Measured on an H200 (scripts/bench_kernels.py --tune):
    H=576 -> (8, 256, 4) 5.6 µs vs 6.9 µs for (2, 1024, 4) at T=8192; H=4096 -> (2, 1024, 4) within 1% of the best.
    """
    block_h = min((256, 512, _MAX_BLOCK_H), key=lambda b: (triton.cdiv(width, b) * b, -b))
    block_h = min(block_h, triton.next_power_of_2(width))
    return max(1, _TILE // block_h), block_h, 4


def _only_sentinel_cpu(dst: Tensor, src: Tensor, route: Tensor, residual: Tensor | None) -> bool:
    """CPU (the op body runs eagerly, so reading the route costs no sync): a step where no row is watched
    writes only the sentinel row, whose contents are junk by contract, and can skip the copy."""
    _checks.scatter_args(dst, src, route, residual)  # the same errors as the full path
    tokens = src.shape[0]
    return tokens > 0 and not bool((route[:tokens] != dst.shape[0] - 1).any())


def scatter_rows_triton(dst: Tensor, src: Tensor, route: Tensor, residual: Tensor | None = None) -> None:
    """The Triton implementation of ``scatter_rows`` (CUDA tensors, or CPU under ``TRITON_INTERPRET=1``)."""
    if triton is None:
        raise RuntimeError("Triton is not importable")
    dst_rows, src_rows, route, residual_rows = _checks.scatter_args(dst, src, route, residual)
    if src_rows.shape[0] and src_rows.shape[1]:
        _launch(dst_rows, src_rows, route, residual_rows, *_config(src_rows.shape[1]))


def _launch(dst_rows, src_rows, route, residual_rows, block_t: int, block_h: int, num_warps: int) -> None:
    tokens, width = src_rows.shape
    has_residual = residual_rows is not None
    round_bf16 = dst_rows.dtype == torch.bfloat16 and (has_residual or src_rows.dtype != torch.bfloat16)
    grid = (triton.cdiv(tokens, block_t), triton.cdiv(width, block_h))
    _scatter_rows_kernel[grid](
        dst_rows,
        src_rows,
        residual_rows if has_residual else src_rows,
        route,
        tokens,
        width,
        dst_rows.stride(0),
        src_rows.stride(0),
        residual_rows.stride(0) if has_residual else 0,
        HAS_RESIDUAL=has_residual,
        ROUND_BF16=round_bf16,
        BLOCK_T=block_t,
        BLOCK_H=block_h,
        num_warps=num_warps,
    )


if triton is not None:

    @triton.jit
    def _scatter_rows_kernel(
        dst_ptr,
        src_ptr,
        residual_ptr,
        route_ptr,
        tokens,
        width,
        dst_row_stride,
        src_row_stride,
        residual_row_stride,
        HAS_RESIDUAL: tl.constexpr,
        ROUND_BF16: tl.constexpr,
        BLOCK_T: tl.constexpr,
        BLOCK_H: tl.constexpr,
    ):
        token = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        in_batch = token < tokens
        rows = tl.load(route_ptr + token, mask=in_batch, other=0).to(tl.int64)
        mask = in_batch[:, None] & (cols < width)[None, :]
        token = token.to(tl.int64)
        values = tl.load(src_ptr + token[:, None] * src_row_stride + cols[None, :], mask=mask)
        if HAS_RESIDUAL:
            values = values.to(tl.float32) + tl.load(
                residual_ptr + token[:, None] * residual_row_stride + cols[None, :], mask=mask
            ).to(tl.float32)
        if ROUND_BF16:
            values = round_to_bfloat16(values.to(tl.float32))
        tl.store(dst_ptr + rows[:, None] * dst_row_stride + cols[None, :], values.to(dst_ptr.dtype.element_ty),
                 mask=mask)
