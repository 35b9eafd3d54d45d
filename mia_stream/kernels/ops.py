"""The one custom-op registry: the in-graph ops the producer installs into decoder layers and attention.

    torch.ops.mia_stream.capture(aperture, route, src, residual, layer)   # mutates aperture
    torch.ops.mia_stream.steer(hidden, residual, vectors, op_codes, scales, thresholds, slots, layer)  # mutates hidden
    torch.ops.mia_stream.project(out, hidden, residual, table, slots, layer)  # mutates out (detector scores)

Importing this module registers them (once per process). Each op takes whole persistent buffers (aperture,
routing slab, steering table) plus a layer index baked in at trace time, mutates a buffer, and returns nothing: no
host sync, no allocation, no Python branching on tensor values, so it stays inside torch.compile graphs and CUDA
graphs. A whole buffer, not a view such as ``aperture[layer]``, is what is declared mutated: vLLM compiles with
``enable_auto_functionalized_v2=False``, where a mutated view makes inductor clone the whole buffer on every call.
Per-step variation lives only in the contents of the routing slabs, which the runtime rewrites before each forward.
The real implementation dispatches between Triton and the torch reference (``mia_stream.kernels.active_backend``);
the fake one only declares the in-place write.
"""

from __future__ import annotations

from typing import Optional

import torch

from mia_stream.kernels.capture import scatter_rows
from mia_stream.kernels.project import project_rows
from mia_stream.kernels.steer import steer_rows

__all__ = ["capture", "project", "steer"]


@torch.library.custom_op("mia_stream::capture", mutates_args=("aperture",))
def capture(aperture: torch.Tensor, route: torch.Tensor, src: torch.Tensor,
            residual: Optional[torch.Tensor], layer: int) -> None:
    """``aperture[layer][route[layer, t]] = src[t] (+ residual[t])`` for every token row t of this step."""
    tokens = src.shape[0]
    if residual is None:
        scatter_rows(aperture[layer], src.reshape(tokens, -1), route[layer, :tokens])
    else:
        scatter_rows(aperture[layer], src.reshape(tokens, -1), route[layer, :tokens],
                     residual.reshape(tokens, -1))


@capture.register_fake
def _capture_fake(aperture, route, src, residual, layer) -> None:
    return None


@torch.library.custom_op("mia_stream::steer", mutates_args=("hidden",))
def steer(hidden: torch.Tensor, residual: torch.Tensor, vectors: torch.Tensor, op_codes: torch.Tensor,
          scales: torch.Tensor, thresholds: torch.Tensor, slots: torch.Tensor, layer: int) -> None:
    """Apply the steering ops routed to each token row at this layer, in place on ``hidden``."""
    tokens = hidden.shape[0]
    steer_rows(hidden, residual, vectors, op_codes, scales, thresholds, slots[layer, :tokens])


@steer.register_fake
def _steer_fake(hidden, residual, vectors, op_codes, scales, thresholds, slots, layer) -> None:
    return None


@torch.library.custom_op("mia_stream::project", mutates_args=("out",))
def project(out: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor, table: torch.Tensor,
            slots: torch.Tensor, layer: int) -> None:
    """``out[t, k] = (hidden + residual)[t] . table[slots[layer, t, k]]`` for the rows routed to a detector here."""
    project_rows(out, hidden, residual, table, slots[layer])


@project.register_fake
def _project_fake(out, hidden, residual, table, slots, layer) -> None:
    return None
