"""What quantizing a step's captured rows costs on the device (issue 29), against copying them raw to the host.

    python3 scripts/bench_quantize.py [--layers 32 --rows 256 --width 4096]     # the 8B decode step, all layers

Per format (int8, fp8_e4m3) and implementation (Triton, the torch reference): the time of ``quantize_rows`` on
a bf16 ``[layers, rows, width]`` aperture slice (CUDA events, median of ``--iters``), and the device-to-host copy
into pinned memory of the raw rows vs the quantized rows plus scales: what ``end_step`` does per step. Prints
one JSON line per row. CUDA only.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from mia_stream.kernels.quantize import quantize_rows_reference, quantize_rows_triton


def _time(fn, iters: int) -> float:
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--width", type=int, default=4096)
    ap.add_argument("--iters", type=int, default=50)
    a = ap.parse_args()
    x = torch.randn(a.layers, a.rows, a.width, device="cuda").to(torch.bfloat16)
    raw_host = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
    q_host = torch.empty(x.shape, dtype=torch.int8, pin_memory=True)
    s_host = torch.empty((a.layers, a.rows, 1), dtype=torch.float32, pin_memory=True)
    mib = x.numel() * x.element_size() / 2**20
    rows = [{"row": "raw d2h copy", "ms": _time(lambda: raw_host.copy_(x, non_blocking=True), a.iters)}]
    for fmt in ("int8", "fp8_e4m3"):
        for impl, fn in (("triton", quantize_rows_triton), ("reference", quantize_rows_reference)):
            rows.append({"row": f"quantize {fmt} ({impl})", "ms": _time(lambda: fn(x, fmt), a.iters)})
        q, s = quantize_rows_triton(x, fmt)
        rq, rs = quantize_rows_reference(x, fmt)
        rows.append({"row": f"{fmt} triton == reference (bytes)", "ms": 0.0,
                     "identical": bool(torch.equal(q.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(s, rs))})

        def copy_quantized():
            q_host.view(q.dtype).copy_(q, non_blocking=True)
            s_host.copy_(s, non_blocking=True)

        rows.append({"row": f"{fmt} d2h copy (rows + scales)", "ms": _time(copy_quantized, a.iters)})

        def both():
            q2, s2 = quantize_rows_triton(x, fmt)
            q_host.view(q2.dtype).copy_(q2, non_blocking=True)
            s_host.copy_(s2, non_blocking=True)

        rows.append({"row": f"{fmt} quantize + d2h copy", "ms": _time(both, a.iters)})
    for r in rows:
        print(json.dumps({"shape": [a.layers, a.rows, a.width], "step_mib_bf16": round(mib, 1), **r,
                          "ms": round(r["ms"], 4), "device": torch.cuda.get_device_name()}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
