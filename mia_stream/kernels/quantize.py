"""Per-row quantization of captured rows on the device, before they leave it (issue 29).

``quantize_rows(src, fmt)`` turns ``[..., W]`` rows (any float dtype) into ``int8`` or ``float8_e4m3fn`` rows and
one float32 scale per row: ``scale = absmax(row) / QMAX`` (1 for a row of zeros), ``q = x / scale`` rounded
(int8: half away from zero, clamped to +-127; fp8: round to nearest even, clamped to +-448). Dequantized,
``q * scale`` is within ``scale / 2`` of ``x`` for int8 (1/254 of the row's absmax), and within half an fp8 step
(``2^-4`` of ``|x|`` for normal values, ``2^-10 * scale`` below them) for fp8. The wire format carries the
scales in a tensor's scale buffer (docs/wire-format.md 4.7).

On CUDA a Triton kernel does one pass per row (read once, write once, no float32 temporary); elsewhere the
torch reference, which is its spec (bit-identical: tests/test_quantize.py; the GPU run compares them).
"""

from __future__ import annotations

import torch
from torch import Tensor

from mia_stream.kernels import _dispatch

try:
    import triton
    import triton.language as tl
except Exception:  # no Triton: only the reference exists
    triton = None

__all__ = ["QUANT_FORMATS", "quantize_rows", "quantize_rows_reference", "quantize_rows_triton"]

# format -> (torch dtype, wire dtype, largest magnitude)
QUANT_FORMATS = {"int8": (torch.int8, "int8", 127.0), "fp8_e4m3": (torch.float8_e4m3fn, "float8_e4m3fn", 448.0)}


def _empty(shape: tuple, device, fmt: str, out: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor]:
    if fmt not in QUANT_FORMATS:
        raise ValueError(f"quantize: unknown format {fmt!r}; known: {sorted(QUANT_FORMATS)}")
    shape = tuple(shape)
    if out is not None:
        q, scale = out
        if (tuple(q.shape) != shape or q.dtype != QUANT_FORMATS[fmt][0] or tuple(scale.shape) != (*shape[:-1], 1)
                or scale.dtype != torch.float32 or not (q.is_contiguous() and scale.is_contiguous())):
            raise ValueError(f"quantize: out must be contiguous {shape} {QUANT_FORMATS[fmt][0]} and "
                             f"{(*shape[:-1], 1)} float32, got {tuple(q.shape)} {q.dtype} and "
                             f"{tuple(scale.shape)} {scale.dtype}")
        return q, scale
    q = torch.empty(shape, dtype=QUANT_FORMATS[fmt][0], device=device)
    scale = torch.empty((*shape[:-1], 1), dtype=torch.float32, device=device)
    return q, scale


def _out_shape(src: Tensor, layers: Tensor | None) -> tuple:
    if layers is None:
        return tuple(src.shape)
    if src.dim() != 3:
        raise ValueError(f"quantize: layers picks dim 0 of a [layers, rows, W] source, got {tuple(src.shape)}")
    return (layers.numel(), *src.shape[1:])


def quantize_rows(src: Tensor, fmt: str, out: tuple[Tensor, Tensor] | None = None,
                  layers: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """``(q, scale)``: ``src`` ``[..., W]`` quantized per row to ``fmt`` (``"int8"`` | ``"fp8_e4m3"``), and the
    float32 scales ``[..., 1]``: new tensors on ``src``'s device, or written into ``out`` (contiguous, of those
    shapes and dtypes: the producer's workspace inside vLLM's memory budget). ``layers`` (an int tensor on the
    device): only those entries of dim 0 of a ``[L, rows, W]`` source, in that order (the kernel reads them in
    place; an ``index_select`` copy of 16 of an 8B model's layers at a 16k-token prefill would be 2 GiB)."""
    if _dispatch.active_backend(src.device) == "triton" and src.numel():
        result = quantize_rows_triton(src, fmt, out, layers)
        _dispatch._record("quantize_rows", "triton")
        return result
    _dispatch._record("quantize_rows", "reference")
    return quantize_rows_reference(src, fmt, out, layers)


def quantize_rows_reference(src: Tensor, fmt: str, out: tuple[Tensor, Tensor] | None = None,
                            layers: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """The torch reference of ``quantize_rows`` (and its spec)."""
    q, scale = _empty(_out_shape(src, layers), src.device, fmt, out)
    if layers is not None:
        src = src.index_select(0, layers)
    qmax = QUANT_FORMATS[fmt][2]
    x = src.to(torch.float32)
    absmax = x.abs().amax(dim=-1, keepdim=True)
    s = absmax / qmax
    s = torch.where(s > 0, s, torch.ones_like(s))
    y = x / s
    if fmt == "int8":
        y = torch.sign(y) * torch.floor(y.abs() + 0.5)
    q.copy_(y.clamp(-qmax, qmax))
    scale.copy_(s)
    return q, scale


def quantize_rows_triton(src: Tensor, fmt: str, out: tuple[Tensor, Tensor] | None = None,
                         layers: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """The Triton implementation (CUDA, or CPU under ``TRITON_INTERPRET=1``): one program per row."""
    if triton is None:
        raise RuntimeError("Triton is not importable")
    q, scale = _empty(_out_shape(src, layers), src.device, fmt, out)
    width = src.shape[-1]
    if layers is not None and src.stride(-1) != 1:
        src = src.contiguous()
    if src.dim() == 3 and src.stride(-1) == 1:
        # [layers, rows, W] read in place: the capture's ``aperture[:, :rows]`` is not contiguous, and a
        # contiguous copy of it was 3.94 GiB at an 8B model's 16k-token prefill (an OOM outside vLLM's budget)
        rows, per_layer, layer_stride, row_stride = src, src.shape[1], src.stride(0), src.stride(1)
    else:
        rows = src.reshape(-1, width)
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        per_layer, layer_stride, row_stride = max(rows.shape[0], 1), 0, rows.stride(0)
    n = q.numel() // width if width else 0
    if n and width:
        block = triton.next_power_of_2(width)
        pick = layers is not None
        _quantize_rows_kernel[(n,)](rows, layers if pick else scale, q.view(-1, width), scale.view(-1), width,
                                    per_layer, layer_stride, row_stride, QMAX=QUANT_FORMATS[fmt][2],
                                    INT8=fmt == "int8", PICK=pick, BLOCK=block, num_warps=4 if block <= 2048 else 8)
    return q, scale


if triton is not None:

    @triton.jit
    def _quantize_rows_kernel(src_ptr, layer_ptr, q_ptr, scale_ptr, width, rows_per_layer, src_layer_stride,
                              src_row_stride, QMAX: tl.constexpr, INT8: tl.constexpr, PICK: tl.constexpr,
                              BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)  # the output row; the source row is (layer, row within it)
        cols = tl.arange(0, BLOCK)
        mask = cols < width
        layer = row // rows_per_layer
        if PICK:  # the output's j-th layer is the source's layer_ptr[j]
            layer = tl.load(layer_ptr + layer).to(tl.int64)
        src_row = layer * src_layer_stride + (row % rows_per_layer) * src_row_stride
        x = tl.load(src_ptr + src_row + cols, mask=mask, other=0.0).to(tl.float32)
        # correctly rounded divisions, as torch's: Triton's "/" on float32 is the approximate PTX division on
        # CUDA, and the H100 run of scripts/bench_quantize.py found its bytes differing from the reference
        s = tl.math.div_rn(tl.max(tl.abs(x), axis=0), QMAX)
        s = tl.where(s > 0, s, 1.0)
        y = tl.math.div_rn(x, s)
        if INT8:
            y = tl.where(y >= 0, tl.floor(y + 0.5), -tl.floor(-y + 0.5))
        else:  # round to e4m3's grid here (nearest even), so the cast below is exact whatever its rounding mode
            exponent = ((y.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
            step = ((tl.maximum(exponent, -6) - 3 + 127) << 23).to(tl.float32, bitcast=True)  # 2^(e-3), subnormal 2^-9
            z = tl.abs(y) / step
            r = tl.floor(z + 0.5)
            r = tl.where((r - z == 0.5) & (r - 2.0 * tl.floor(r * 0.5) == 1.0), r - 1.0, r)
            y = tl.where(y < 0, -(r * step), r * step)  # (a negative value rounded to 0 stays -0, as torch's cast)
        y = tl.minimum(tl.maximum(y, -QMAX), QMAX)
        tl.store(q_ptr + row * width + cols, y.to(q_ptr.dtype.element_ty), mask=mask)
        tl.store(scale_ptr + row, s)
