"""Kernels for in-graph capture (``scatter_rows``) and activation steering (``steer_rows``).

Each has a Triton implementation (CUDA) and a torch reference (CPU, and the spec the kernels are tested against);
the plain names dispatch between them (``MIA_STREAM_KERNELS`` overrides, see ``active_backend``). The torch
custom ops that torch.compile and CUDA graphs see live in ``mia_stream.kernels.ops``.
"""

from mia_stream.kernels._dispatch import active_backend, backend_calls, last_backend, reset_backend_record
from mia_stream.kernels.capture import scatter_rows, scatter_rows_reference
from mia_stream.kernels.steer import OP_ABLATE, OP_ADD, OP_CAP, OP_NONE, steer_rows, steer_rows_reference

__all__ = [
    "OP_ABLATE",
    "OP_ADD",
    "OP_CAP",
    "OP_NONE",
    "active_backend",
    "backend_calls",
    "last_backend",
    "reset_backend_record",
    "scatter_rows",
    "scatter_rows_reference",
    "steer_rows",
    "steer_rows_reference",
]
