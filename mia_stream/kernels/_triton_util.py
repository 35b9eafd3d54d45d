"""Triton helpers shared by the kernels (imported only where Triton is)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def round_to_bfloat16(values):
    """float32 -> bfloat16 rounded to nearest even, NaN -> 0x7FC0: the bits torch's ``.to(torch.bfloat16)`` gives.

    Done in integer ops rather than ``.to(tl.bfloat16)`` so that the result is the same on the GPU and in the
    Triton interpreter (whose float32 -> bfloat16 cast truncates); on the GPU it costs a few integer ops in a
    bandwidth-bound kernel.
    """
    bits = values.to(tl.uint32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    rounded = tl.where(values != values, 0x7FC0, rounded)
    return rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)
