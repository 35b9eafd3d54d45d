"""Shape, dtype and device checks shared by the Triton and reference implementations.

They look at tensor metadata only (never values), so they are safe inside graph capture.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

_INDEX_DTYPES = (torch.int32, torch.int64)


def as_rows(name: str, tensor: Tensor) -> Tensor:
    """A 2-D ``[N, row]`` view of ``tensor`` (no copy); its dims after the first must be contiguous."""
    if tensor.dim() < 2:
        raise ValueError(f"{name}: expected at least 2 dims [rows, ...], got shape {tuple(tensor.shape)}")
    row = math.prod(tensor.shape[1:])
    expected = 1
    for size, stride in zip(reversed(tensor.shape[1:]), reversed(tensor.stride()[1:])):
        if size != 1 and stride != expected:
            raise ValueError(
                f"{name}: the dims after the first must be contiguous, got shape {tuple(tensor.shape)} "
                f"strides {tensor.stride()}"
            )
        expected *= size
    return tensor if tensor.dim() == 2 else tensor.view(tensor.shape[0], row)


def _same_device(*named: tuple[str, Tensor | None]) -> None:
    tensors = [(n, t) for n, t in named if t is not None]
    first_name, first = tensors[0]
    for name, tensor in tensors[1:]:
        if tensor.device != first.device:
            raise ValueError(f"{name} is on {tensor.device} but {first_name} is on {first.device}")


def scatter_args(
    dst: Tensor, src: Tensor, route: Tensor, residual: Tensor | None
) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """Validated ``(dst_rows, src_rows, route, residual_rows)`` for ``scatter_rows``."""
    _same_device(("dst", dst), ("src", src), ("route", route), ("residual", residual))
    dst_rows, src_rows = as_rows("dst", dst), as_rows("src", src)
    if dst_rows.shape[1] != src_rows.shape[1]:
        raise ValueError(f"dst rows hold {dst_rows.shape[1]} values but src rows {src_rows.shape[1]}")
    if not (dst.dtype.is_floating_point and src.dtype.is_floating_point):
        raise ValueError(f"dst and src must be floating point, got {dst.dtype} and {src.dtype}")
    if route.dim() != 1 or route.dtype not in _INDEX_DTYPES:
        raise ValueError(f"route must be 1-D int32/int64, got {route.dtype} shape {tuple(route.shape)}")
    if route.shape[0] < src_rows.shape[0]:
        raise ValueError(f"route has {route.shape[0]} entries for {src_rows.shape[0]} tokens")
    if route.shape[0] and route.stride(0) != 1:
        raise ValueError("route must be contiguous")
    residual_rows = None
    if residual is not None:
        if residual.shape != src.shape or residual.dtype != src.dtype:
            raise ValueError(
                f"residual {residual.dtype}{tuple(residual.shape)} must match src {src.dtype}{tuple(src.shape)}"
            )
        residual_rows = as_rows("residual", residual)
    return dst_rows, src_rows, route, residual_rows


def steer_args(
    hidden: Tensor,
    residual: Tensor | None,
    vectors: Tensor,
    op_codes: Tensor,
    scales: Tensor,
    thresholds: Tensor,
    slots: Tensor,
) -> tuple[Tensor, Tensor | None]:
    """Validated ``(hidden_rows, residual_rows)`` for ``steer_rows``; raises ValueError on a mismatch."""
    _same_device(
        ("hidden", hidden), ("residual", residual), ("vectors", vectors), ("op_codes", op_codes),
        ("scales", scales), ("thresholds", thresholds), ("slots", slots),
    )
    hidden_rows = as_rows("hidden", hidden)
    if not hidden.dtype.is_floating_point:
        raise ValueError(f"hidden must be floating point, got {hidden.dtype}")
    residual_rows = None
    if residual is not None:
        if residual.shape != hidden.shape or residual.dtype != hidden.dtype:
            raise ValueError(
                f"residual {residual.dtype}{tuple(residual.shape)} must match hidden {hidden.dtype}{tuple(hidden.shape)}"
            )
        residual_rows = as_rows("residual", residual)
    tokens, width = hidden_rows.shape
    if vectors.dim() != 2 or vectors.dtype != torch.float32 or vectors.shape[1] != width:
        raise ValueError(f"vectors must be float32 [S, {width}], got {vectors.dtype}{tuple(vectors.shape)}")
    if vectors.shape[0] and vectors.stride(1) != 1:
        raise ValueError("vectors rows must be contiguous")
    table = vectors.shape[0]
    for name, tensor, dtype in (
        ("op_codes", op_codes, torch.int32), ("scales", scales, torch.float32),
        ("thresholds", thresholds, torch.float32),
    ):
        if tensor.dim() != 1 or tensor.dtype != dtype or tensor.shape[0] != table:
            raise ValueError(f"{name} must be {dtype} [{table}], got {tensor.dtype}{tuple(tensor.shape)}")
        if table and tensor.stride(0) != 1:
            raise ValueError(f"{name} must be contiguous")
    if slots.dim() != 2 or slots.dtype != torch.int32 or slots.shape[0] < tokens:
        raise ValueError(f"slots must be int32 [>= {tokens}, M], got {slots.dtype}{tuple(slots.shape)}")
    return hidden_rows, residual_rows
