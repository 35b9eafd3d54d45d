#!/usr/bin/env python
"""Micro-benchmark of the capture and steering kernels: Triton vs the torch reference vs a plain torch baseline.

    python scripts/bench_kernels.py            # on a CUDA machine (H100/H200)
    python scripts/bench_kernels.py --quick    # fewer repetitions

Each case is timed twice with triton.testing: eager launches (``do_bench``: includes the Python dispatch and
launch cost) and replayed from a CUDA graph (``do_bench_cudagraph``: the cost inside vLLM's graphs). GB/s counts
the bytes the op must move (read rows, write rows), bf16. On a machine without CUDA it says so and runs a
small Triton-interpreter smoke check against the reference instead.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before Triton is imported (by mia_stream.kernels)

from mia_stream.kernels import OP_ABLATE, OP_ADD, OP_CAP  # noqa: E402
from mia_stream.kernels.capture import scatter_rows_reference, scatter_rows_triton  # noqa: E402
from mia_stream.kernels.steer import steer_rows_reference, steer_rows_triton  # noqa: E402


def _cpu_smoke() -> int:
    print("bench_kernels: no CUDA device; timings are only meaningful on a GPU. Running an interpreter smoke check.")
    g = torch.Generator().manual_seed(0)
    tokens, width, rows = 8, 576, 12
    src = torch.randn(tokens, width, generator=g).to(torch.bfloat16)
    residual = torch.randn(tokens, width, generator=g).to(torch.bfloat16)
    route = torch.tensor([0, 11, 3, 11, 5, 6, 7, 1], dtype=torch.int32)
    a, b = torch.zeros(rows, width, dtype=torch.bfloat16), torch.zeros(rows, width, dtype=torch.bfloat16)
    scatter_rows_triton(a, src, route, residual)
    scatter_rows_reference(b, src, route, residual)
    scatter_ok = torch.equal(a[:-1].view(torch.int16), b[:-1].view(torch.int16))
    vectors = torch.randn(3, width, generator=g)
    op_codes = torch.tensor([OP_ADD, OP_CAP, OP_ABLATE], dtype=torch.int32)
    scales, thresholds = torch.tensor([-0.5, 0.0, 0.0]), torch.tensor([0.0, 0.2, 0.0])
    slots = torch.tensor([[0, 1, 2], [-1, -1, -1]] * 4, dtype=torch.int32)
    h1 = torch.randn(tokens, width, generator=g).to(torch.bfloat16)
    h2 = h1.clone()
    steer_rows_triton(h1, residual, vectors, op_codes, scales, thresholds, slots)
    steer_rows_reference(h2, residual, vectors, op_codes, scales, thresholds, slots)
    max_diff = (h1.float() - h2.float()).abs().max().item()
    print(f"scatter_rows triton == reference (bit-exact): {scatter_ok}")
    print(f"steer_rows   triton vs reference max |diff|: {max_diff:.3g} (bf16)")
    return 0 if scatter_ok and max_diff < 0.05 else 1


def _time(fn, quick: bool) -> tuple[float, float]:
    """(eager µs, CUDA-graph µs) per call."""
    import triton.testing

    rep = 30 if quick else 100
    eager = triton.testing.do_bench(fn, warmup=10, rep=rep) * 1e3
    graphed = triton.testing.do_bench_cudagraph(fn, rep=rep) * 1e3
    return eager, graphed


def _row(label: str, nbytes: int, times: tuple[float, float], base: float | None) -> str:
    eager, graphed = times
    ratio = f"{graphed / base:5.2f}x" if base else "  1.00x"
    return (f"  {label:<34} eager {eager:8.1f} µs   graph {graphed:8.1f} µs  {nbytes / graphed / 1e3:7.1f} GB/s"
            f"  graph time vs triton {ratio}")


def _bench_scatter(tokens: int, width: int, residual: bool, quick: bool) -> None:
    dev, dt = "cuda", torch.bfloat16
    rows = tokens + 1
    dst = torch.zeros(rows, width, device=dev, dtype=dt)
    src = torch.randn(tokens, width, device=dev, dtype=dt)
    res = torch.randn(tokens, width, device=dev, dtype=dt) if residual else None
    route = torch.randperm(tokens, device=dev).to(torch.int32)
    nbytes = tokens * width * 2 * (3 if residual else 2)
    print(f"scatter_rows T={tokens} H={width} bf16{' +residual' if residual else ''}:")
    triton_t = _time(lambda: scatter_rows_triton(dst, src, route, res), quick)
    print(_row("triton", nbytes, triton_t, None))
    print(_row("reference (index_copy_)", nbytes, _time(lambda: scatter_rows_reference(dst, src, route, res), quick),
               triton_t[1]))
    if residual:
        baseline = lambda: torch.add(src, res, out=dst[:tokens])  # noqa: E731  contiguous, no routing
        label = "baseline torch.add(out=dst[:T])"
    else:
        baseline = lambda: dst[:tokens].copy_(src)  # noqa: E731
        label = "baseline dst[:T].copy_(src)"
    print(_row(label, nbytes, _time(baseline, quick), triton_t[1]))


def _bench_steer(tokens: int, width: int, num_slots: int, steered_rows: int, quick: bool) -> None:
    dev, dt = "cuda", torch.bfloat16
    hidden = torch.randn(tokens, width, device=dev, dtype=dt)
    residual = torch.randn(tokens, width, device=dev, dtype=dt)
    vectors = torch.randn(4, width, device=dev)
    op_codes = torch.tensor([OP_ADD, OP_CAP, OP_ABLATE, OP_ADD], device=dev, dtype=torch.int32)
    scales = torch.tensor([0.01, 0.0, 0.0, -0.01], device=dev)
    thresholds = torch.tensor([0.0, 1e9, 0.0, 0.0], device=dev)  # the CAP never bites: timings stay stable
    slots = torch.full((tokens, num_slots), -1, device=dev, dtype=torch.int32)
    pattern = torch.tensor([0, 1, 2][:num_slots], device=dev, dtype=torch.int32)
    slots[:steered_rows] = pattern
    if num_slots == 1:
        op_codes[0] = OP_ADD  # the one op is an ADD: the baseline below does the same work
    coef = torch.tensor(0.0, device=dev)
    nbytes = steered_rows * width * 2 * 3 + tokens * num_slots * 4  # read hidden + residual, write hidden
    print(f"steer_rows T={tokens} H={width} M={num_slots} steered rows={steered_rows} bf16:")
    args = (hidden, residual, vectors, op_codes, scales, thresholds, slots)
    triton_t = _time(lambda: steer_rows_triton(*args), quick)
    print(_row("triton", nbytes, triton_t, None))
    print(_row("reference (torch ops)", nbytes, _time(lambda: steer_rows_reference(*args), quick), triton_t[1]))
    # The least a torch implementation can do: x + c*v on every row (no per-token slots, no dot products).
    print(_row("baseline hidden.add_(c * v)", nbytes, _time(lambda: hidden.add_(coef * vectors[0]), quick),
               triton_t[1]))


def _tune(quick: bool) -> None:
    """Sweep the launch parameters (graph-replayed times) that capture._config / steer._num_warps pick from."""
    import triton

    from mia_stream.kernels import capture, steer

    dev, dt = "cuda", torch.bfloat16
    for tokens, width in ((8192, 576), (8192, 4096), (256, 4096)):
        src = torch.randn(tokens, width, device=dev, dtype=dt)
        res = torch.randn_like(src)
        dst = torch.zeros(tokens + 1, width, device=dev, dtype=dt)
        route = torch.randperm(tokens, device=dev).to(torch.int32)
        chosen = capture._config(width)
        results = []
        for block_h in (256, 512, 1024):
            for tile in (1024, 2048, 4096):
                block_t = max(1, tile // block_h)
                for warps in (4, 8):
                    cfg = (block_t, block_h, warps)
                    fn = lambda: capture._launch(dst, src, route, res, *cfg)  # noqa: E731
                    results.append((_time(fn, quick)[1], cfg))
        results.sort()
        chosen_t = _time(lambda: capture._launch(dst, src, route, res, *chosen), quick)[1]
        print(f"tune scatter T={tokens} H={width} +residual: best {results[:3]}; chosen {chosen} {chosen_t:.1f} µs")
        vectors = torch.randn(4, width, device=dev)
        op_codes = torch.tensor([OP_ADD, OP_CAP, OP_ABLATE, OP_ADD], device=dev, dtype=torch.int32)
        scales, thresholds = torch.tensor([0.01, 0, 0, -0.01], device=dev), torch.tensor([0, 1e9, 0, 0.0], device=dev)
        for num_slots in (1, 3):
            slots = torch.tensor([0, 1, 2][:num_slots], device=dev, dtype=torch.int32).repeat(tokens, 1)
            args = (src.clone(), res, vectors, op_codes, scales, thresholds, slots)
            timings = {w: _time(lambda: steer._launch(args[0], *args[1:], w), quick)[1] for w in (2, 4, 8, 16)}
            block = triton.next_power_of_2(width)
            print(f"tune steer T={tokens} H={width} M={num_slots}: "
                  + "  ".join(f"warps {w}: {t:.1f} µs" for w, t in timings.items())
                  + f"  (chosen {steer._num_warps(block)})")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    parser.add_argument("--tune", action="store_true", help="sweep the kernels' launch parameters instead")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        return _cpu_smoke()
    import triton

    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}")
    if args.tune:
        _tune(args.quick)
        return 0
    for tokens in (256, 8192):
        for width in (576, 4096):
            _bench_scatter(tokens, width, residual=False, quick=args.quick)
            _bench_scatter(tokens, width, residual=True, quick=args.quick)
            _bench_steer(tokens, width, num_slots=1, steered_rows=tokens, quick=args.quick)
            _bench_steer(tokens, width, num_slots=3, steered_rows=tokens, quick=args.quick)
            _bench_steer(tokens, width, num_slots=3, steered_rows=max(1, tokens // 64), quick=args.quick)
    return 0


if __name__ == "__main__":
    sys.exit(main())
