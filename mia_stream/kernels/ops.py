"""The torch custom ops around the kernels, so torch.compile (fullgraph) and CUDA graphs keep them in the graph.

    torch.ops.mia_stream.capture_rows(dst, src, route, residual)   # mutates dst
    torch.ops.mia_stream.capture_layer_rows(aperture, layer, src, route, residual)  # mutates aperture[layer]
    torch.ops.mia_stream.steer_rows(hidden, residual, vectors, op_codes, scales, thresholds, slots)  # mutates hidden

Importing this module registers them (once per process). The real implementation dispatches between Triton and
the torch reference (``mia_stream.kernels.active_backend``); the fake one only declares the in-place write.
"""

from __future__ import annotations

import torch
from torch import Tensor

from mia_stream.kernels.capture import scatter_rows
from mia_stream.kernels.steer import steer_rows as _steer_rows

__all__ = ["capture_layer_rows", "capture_rows", "steer_rows"]


@torch.library.custom_op("mia_stream::capture_rows", mutates_args=("dst",), device_types=("cpu", "cuda"))
def capture_rows(dst: Tensor, src: Tensor, route: Tensor, residual: Tensor | None) -> None:
    """``dst[route[t]] = src[t] (+ residual[t])``: see ``mia_stream.kernels.scatter_rows``."""
    scatter_rows(dst, src, route, residual)


@capture_rows.register_fake
def _capture_rows_fake(dst: Tensor, src: Tensor, route: Tensor, residual: Tensor | None) -> None:
    return None


@torch.library.custom_op("mia_stream::capture_layer_rows", mutates_args=("aperture",), device_types=("cpu", "cuda"))
def capture_layer_rows(aperture: Tensor, layer: int, src: Tensor, route: Tensor, residual: Tensor | None) -> None:
    """``capture_rows(aperture[layer], ...)`` that declares the whole buffer as mutated.

    Use it under vLLM: it compiles with ``enable_auto_functionalized_v2=False``, where a mutated *view* such as
    ``aperture[layer]`` makes inductor clone the whole aperture on every call; a whole graph input does not.
    """
    scatter_rows(aperture[layer], src, route, residual)


@capture_layer_rows.register_fake
def _capture_layer_rows_fake(
    aperture: Tensor, layer: int, src: Tensor, route: Tensor, residual: Tensor | None
) -> None:
    return None


@torch.library.custom_op("mia_stream::steer_rows", mutates_args=("hidden",), device_types=("cpu", "cuda"))
def steer_rows(
    hidden: Tensor,
    residual: Tensor | None,
    vectors: Tensor,
    op_codes: Tensor,
    scales: Tensor,
    thresholds: Tensor,
    slots: Tensor,
) -> None:
    """Steer ``hidden + residual`` in place in ``hidden``: see ``mia_stream.kernels.steer_rows``."""
    _steer_rows(hidden, residual, vectors, op_codes, scales, thresholds, slots)


@steer_rows.register_fake
def _steer_rows_fake(
    hidden: Tensor,
    residual: Tensor | None,
    vectors: Tensor,
    op_codes: Tensor,
    scales: Tensor,
    thresholds: Tensor,
    slots: Tensor,
) -> None:
    return None
