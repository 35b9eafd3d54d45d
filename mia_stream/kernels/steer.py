"""Activation steering in the residual stream: add, cap or ablate directions, per token, inside the graph.

``steer_rows`` picks Triton on CUDA and the torch reference on CPU (see ``_dispatch``). The Triton kernel makes
one pass per token row: it loads the token's slots, and only if one is active loads ``hidden + residual`` once,
applies the ops in registers and stores once. Rows with no active slot are never loaded nor stored (a
device-side branch), so steering a few requests in a large batch costs little more than reading the slots.
"""

from __future__ import annotations

import torch
from torch import Tensor

from mia_stream.kernels import _checks, _dispatch
from mia_stream.kernels._reference import OP_ABLATE, OP_ADD, OP_CAP, OP_NONE, steer_rows_reference

try:
    import triton
    import triton.language as tl

    from mia_stream.kernels._triton_util import round_to_bfloat16
except Exception:  # no Triton: only the reference exists
    triton = None

__all__ = [
    "OP_ABLATE", "OP_ADD", "OP_CAP", "OP_NONE", "steer_rows", "steer_rows_reference", "steer_rows_triton",
]


def steer_rows(
    hidden: Tensor,
    residual: Tensor | None,
    vectors: Tensor,
    op_codes: Tensor,
    scales: Tensor,
    thresholds: Tensor,
    slots: Tensor,
) -> None:
    """Steer the residual stream ``x = hidden + residual`` of each token, writing the change into ``hidden``.

    Shapes and dtypes:
    - ``hidden``: ``[T, H]`` float32/bf16/fp16 (the decoder layer's MLP output), changed in place;
    - ``residual``: ``[T, H]`` same dtype, read only (None: ``x = hidden``);
    - ``vectors``: float32 ``[S, H]``; ``op_codes``: int32 ``[S]``; ``scales``, ``thresholds``: float32 ``[S]``;
    - ``slots``: int32 ``[T_max, M]``, ``T_max >= T`` (rows past ``T`` are ignored); the caller guarantees
      every slot is ``< S``; a slot ``< 0`` is empty.

    For each token and ``m = 0 .. M-1`` with ``s = slots[t, m] >= 0``, with ``v = vectors[s]`` and
    ``v̂ = v / |v|`` (computed here, so the table may hold raw or unit vectors alike):
    - ``OP_ADD``:    ``x += scales[s] * v``                           (raw ``v``: its length is the strength)
    - ``OP_CAP``:    ``x -= max(0, x·v̂ - thresholds[s]) * v̂``
    - ``OP_ABLATE``: ``x -= (x·v̂) * v̂``
    - ``OP_NONE`` and unknown codes do nothing; a zero vector makes CAP/ABLATE do nothing.
    Each op sees the ``x`` left by the previous one. All arithmetic is float32 over the full row; the total
    change is added to ``hidden`` in float32 and stored in ``hidden.dtype``, so the next layer's
    ``hidden + residual`` is the steered ``x``. Tokens whose slots are all ``< 0`` are left bit-identical.
    """
    if _dispatch.active_backend(hidden.device) == "triton":
        steer_rows_triton(hidden, residual, vectors, op_codes, scales, thresholds, slots)
        _dispatch._record("steer_rows", "triton")
    elif hidden.device.type == "cpu" and hidden.dim() == 2:
        _steer_active_rows_cpu(hidden, residual, vectors, op_codes, scales, thresholds, slots)
        _dispatch._record("steer_rows", "reference")
    else:
        steer_rows_reference(hidden, residual, vectors, op_codes, scales, thresholds, slots)
        _dispatch._record("steer_rows", "reference")


def _steer_active_rows_cpu(hidden, residual, vectors, op_codes, scales, thresholds, slots) -> None:
    """The reference on just the rows that have a slot (CPU: the op body runs eagerly, so a data-dependent
    row set costs no sync). Rows are independent, so the result is bit-identical to the full reference, and a
    step that steers nothing costs one comparison instead of ~80 small ops per layer."""
    _checks.steer_args(hidden, residual, vectors, op_codes, scales, thresholds, slots)  # the same errors
    tokens = hidden.shape[0]
    rows = (slots[:tokens] >= 0).any(dim=-1).nonzero().flatten()
    if rows.numel() == 0:
        return
    if rows.numel() == tokens:
        steer_rows_reference(hidden, residual, vectors, op_codes, scales, thresholds, slots)
        return
    sub = hidden.index_select(0, rows)
    steer_rows_reference(sub, None if residual is None else residual.index_select(0, rows), vectors, op_codes,
                         scales, thresholds, slots[:tokens].index_select(0, rows))
    hidden.index_copy_(0, rows, sub)


def _num_warps(block: int) -> int:
    # The row lives in registers (hidden, x0, the running change and one vector: 4 fp32 values per column).
    # 32 columns per thread was fastest on an H200 (scripts/bench_kernels.py --tune, T=8192): H=576 2 warps
    # 9.4 µs vs 11.5 with 4; H=4096 4 warps 50.8 µs vs 53.0 with 8 (M=1), 91 vs 120 µs (M=3).
    return max(2, min(16, block // 1024))


def steer_rows_triton(
    hidden: Tensor,
    residual: Tensor | None,
    vectors: Tensor,
    op_codes: Tensor,
    scales: Tensor,
    thresholds: Tensor,
    slots: Tensor,
) -> None:
    """The Triton implementation of ``steer_rows`` (CUDA tensors, or CPU under ``TRITON_INTERPRET=1``)."""
    if triton is None:
        raise RuntimeError("Triton is not importable")
    hidden_rows, residual_rows = _checks.steer_args(hidden, residual, vectors, op_codes, scales, thresholds, slots)
    if hidden_rows.shape[0] and hidden_rows.shape[1] and slots.shape[1]:
        block = triton.next_power_of_2(hidden_rows.shape[1])
        _launch(hidden_rows, residual_rows, vectors, op_codes, scales, thresholds, slots, _num_warps(block))


def _launch(hidden_rows, residual_rows, vectors, op_codes, scales, thresholds, slots, num_warps: int) -> None:
    tokens, width = hidden_rows.shape
    has_residual = residual_rows is not None
    _steer_rows_kernel[(tokens,)](
        hidden_rows,
        residual_rows if has_residual else hidden_rows,
        vectors,
        op_codes,
        scales,
        thresholds,
        slots,
        width,
        hidden_rows.stride(0),
        residual_rows.stride(0) if has_residual else 0,
        vectors.stride(0),
        slots.stride(0),
        slots.stride(1),
        NUM_SLOTS=slots.shape[1],
        HAS_RESIDUAL=has_residual,
        IS_BF16=hidden_rows.dtype == torch.bfloat16,
        BLOCK_H=triton.next_power_of_2(width),
        num_warps=num_warps,
    )


if triton is not None:

    @triton.jit
    def _steer_rows_kernel(
        hidden_ptr,
        residual_ptr,
        vectors_ptr,
        op_codes_ptr,
        scales_ptr,
        thresholds_ptr,
        slots_ptr,
        width,
        hidden_row_stride,
        residual_row_stride,
        vector_row_stride,
        slot_row_stride,
        slot_col_stride,
        NUM_SLOTS: tl.constexpr,
        HAS_RESIDUAL: tl.constexpr,
        IS_BF16: tl.constexpr,
        BLOCK_H: tl.constexpr,
    ):
        token = tl.program_id(0).to(tl.int64)
        slot_row = slots_ptr + token * slot_row_stride
        steered = tl.load(slot_row) >= 0
        for m in tl.static_range(1, NUM_SLOTS):
            steered = steered | (tl.load(slot_row + m * slot_col_stride) >= 0)
        # Device-side branches (no host sync, graph safe): an unsteered row is never loaded nor stored, and an
        # empty slot costs neither its vector load nor its two row reductions.
        if steered:
            cols = tl.arange(0, BLOCK_H)
            in_row = cols < width
            base = tl.load(hidden_ptr + token * hidden_row_stride + cols, mask=in_row, other=0.0).to(tl.float32)
            x0 = base
            if HAS_RESIDUAL:
                x0 = x0 + tl.load(
                    residual_ptr + token * residual_row_stride + cols, mask=in_row, other=0.0
                ).to(tl.float32)
            delta = tl.zeros([BLOCK_H], dtype=tl.float32)
            for m in tl.static_range(NUM_SLOTS):
                slot = tl.load(slot_row + m * slot_col_stride).to(tl.int64)
                if slot >= 0:
                    op = tl.load(op_codes_ptr + slot)
                    scale = tl.load(scales_ptr + slot)
                    threshold = tl.load(thresholds_ptr + slot)
                    vector = tl.load(vectors_ptr + slot * vector_row_stride + cols, mask=in_row, other=0.0)
                    dot = tl.sum((x0 + delta) * vector, axis=0)
                    norm_sq = tl.sum(vector * vector, axis=0)
                    inv_norm = tl.where(norm_sq > 0, 1.0 / tl.sqrt(tl.where(norm_sq > 0, norm_sq, 1.0)), 0.0)
                    projection = dot * inv_norm  # x . v_hat
                    removed = tl.where(
                        op == 2,  # OP_CAP
                        tl.maximum(projection - threshold, 0.0),
                        tl.where(op == 3, projection, 0.0),  # OP_ABLATE
                    )
                    coef = tl.where(op == 1, scale, -removed * inv_norm)  # OP_ADD
                    delta = delta + coef * vector
            steered_row = base + delta
            if IS_BF16:
                steered_row = round_to_bfloat16(steered_row)
            tl.store(hidden_ptr + token * hidden_row_stride + cols, steered_row.to(hidden_ptr.dtype.element_ty),
                     mask=in_row)
