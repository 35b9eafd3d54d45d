"""Tests of mia_stream.kernels: Triton == reference, reference == an independent numpy formula, dispatch, and
the torch custom ops under torch.compile.

The Triton kernels run here on CPU tensors in the Triton interpreter, in one subprocess started with
``TRITON_INTERPRET=1`` (the variable must be set before Triton is imported, and other test modules of this
pytest process may have imported it already). That subprocess is this file run as a script: it only runs the
kernels on the inputs the parent wrote and saves what they produced; every comparison happens in the parent.
On a CUDA machine, ``test_triton_on_cuda_*`` run the compiled kernels, also inside a captured CUDA graph.
"""

from __future__ import annotations

import os
import subprocess
import sys
from functools import cache

import numpy as np
import pytest
import torch

from mia_stream.kernels import (
    OP_ABLATE,
    OP_ADD,
    OP_CAP,
    OP_NONE,
    active_backend,
    backend_calls,
    last_backend,
    reset_backend_record,
    scatter_rows,
    scatter_rows_reference,
    steer_rows,
    steer_rows_reference,
)

_CHILD_FLAG = "--run-kernels-interpreted"
_DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}
_INT_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().view(_INT_VIEW[tensor.dtype])


def _same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-identical, except that any NaN equals any NaN: torch itself writes NaN as 0x7FC0 or 0xFFFF in bf16
    depending on its code path (scalar, vectorized CPU, CUDA), so NaN payloads are not part of the contract."""
    nan_a, nan_b = torch.isnan(a), torch.isnan(b)
    return torch.equal(nan_a, nan_b) and torch.equal(_bits(a)[~nan_a], _bits(b)[~nan_b])


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ---------------------------------------------------------------- cases (built identically in parent and child)


def _scatter_case(seed, dtype, tokens, width, rows, *, residual=False, src_dtype=None, route_dtype=torch.int32,
                  extra_route=0, src_stride_pad=0, dst_inner=None):
    g = _gen(seed)
    src_dtype = src_dtype or dtype
    dst = torch.randn(rows, width, generator=g).to(dtype)  # pre-filled: rows nobody writes must keep their bits
    wide = torch.randn(tokens, width + src_stride_pad, generator=g).to(src_dtype)
    src = wide[:, src_stride_pad:]  # a slice of a fused output: row stride != width
    # Distinct rows for watched tokens, the rest to the sentinel row (rows - 1).
    watched = torch.randperm(rows - 1, generator=g)[:tokens]
    route = torch.full((tokens + extra_route,), rows - 1, dtype=route_dtype)
    keep = torch.rand(tokens, generator=g) < 0.7
    route[:tokens] = torch.where(keep, watched.to(route_dtype), route[:tokens])
    case = {"dst": dst, "src": src, "route": route, "residual": None}
    if residual:
        case["residual"] = torch.randn(tokens, width, generator=g).to(src_dtype)
    if dst_inner is not None:  # [R, heads, head_dim] aperture fed by [T, heads, head_dim] q
        case["dst"] = dst.view(rows, *dst_inner)
        case["src"] = src.view(tokens, *dst_inner) if src_stride_pad == 0 else src.unflatten(1, dst_inner)
        if residual:
            case["residual"] = case["residual"].view(tokens, *dst_inner)
    return case


def _rounding_case() -> dict:
    """float32 rows cast into a bf16 aperture: exact ties (round half to even), carries into the exponent, NaN, inf."""
    bits = torch.tensor(
        [0x3F808000, 0x3F818000, 0x3F80C000, 0x3F7FFFFF, 0x7F7FFFFF, 0x7FC00001, 0x7FFFFFFF, 0xFF800000,
         0x00000001, 0x80008000, 0x3F800000, 0xBF818001],
        dtype=torch.int64,
    ).to(torch.int32)
    src = bits.view(torch.float32).repeat(3).view(3, 12)
    return {"dst": torch.zeros(4, 12, dtype=torch.bfloat16), "src": src,
            "route": torch.tensor([2, 0, 1], dtype=torch.int32), "residual": None}


@cache
def _scatter_cases() -> dict[str, dict]:
    cases = {}
    for i, (name, dtype) in enumerate(_DTYPES.items()):
        cases[f"h576_t9_{name}"] = _scatter_case(10 + i, dtype, 9, 576, 16)
        cases[f"h576_t9_residual_{name}"] = _scatter_case(20 + i, dtype, 9, 576, 16, residual=True)
        cases[f"h1500_t5_strided_residual_{name}"] = _scatter_case(
            30 + i, dtype, 5, 1500, 8, residual=True, src_stride_pad=300)
    cases["t0"] = _scatter_case(1, torch.bfloat16, 0, 576, 4)
    cases["t0_residual"] = _scatter_case(1, torch.bfloat16, 0, 64, 4, residual=True)
    cases["t1"] = _scatter_case(2, torch.bfloat16, 1, 576, 4)
    cases["t1_all_to_sentinel_rows2"] = _scatter_case(3, torch.float16, 1, 96, 2)
    cases["route_int64_longer_than_t"] = _scatter_case(4, torch.bfloat16, 6, 200, 12, route_dtype=torch.int64,
                                                       extra_route=5)
    cases["bf16_rows_into_f32_aperture_residual"] = _scatter_case(5, torch.float32, 7, 576, 12, residual=True,
                                                                  src_dtype=torch.bfloat16)
    cases["f16_rows_into_bf16_aperture"] = _scatter_case(6, torch.bfloat16, 7, 100, 12, src_dtype=torch.float16)
    cases["q_heads_3d_strided"] = _scatter_case(7, torch.bfloat16, 6, 9 * 64, 10, src_stride_pad=128,
                                                dst_inner=(9, 64))
    cases["f32_into_bf16_rounding"] = _rounding_case()
    return cases


def _steer_table(width: int, g: torch.Generator) -> dict:
    raw = torch.randn(9, width, generator=g)
    unit = raw / raw.norm(dim=1, keepdim=True)
    vectors = torch.stack([
        raw[0] * 0.1,        # 0 ADD +0.75 (raw: its length is the strength)
        raw[1] * 0.1,        # 1 ADD -1.5  (negative scale)
        unit[2],             # 2 CAP, high threshold: the tokens built below stay under it
        unit[3],             # 3 CAP, threshold 0.5: the tokens built below are above it
        raw[4] * 3.0,        # 4 ABLATE, raw vector (the kernel normalizes)
        unit[5],             # 5 ABLATE, unit vector
        raw[6],              # 6 NONE
        torch.zeros(width),  # 7 CAP with a zero vector: no-op
        raw[3] * 7.0,        # 8 CAP of direction 3 again, raw, threshold 0.5: same as slot 3
    ])
    return {
        "vectors": vectors,
        "op_codes": torch.tensor([OP_ADD, OP_ADD, OP_CAP, OP_CAP, OP_ABLATE, OP_ABLATE, OP_NONE, OP_CAP, OP_CAP],
                                 dtype=torch.int32),
        "scales": torch.tensor([0.75, -1.5, 0, 0, 0, 0, 5.0, 0, 0]),
        "thresholds": torch.tensor([0, 0, 8.0, 0.5, 0, 0, 0, 0.5, 0.5]),
    }


# Slot rows cycled over the tokens: unsteered rows, every op alone, compositions, repeats, gaps.
_SLOT_PATTERNS = [
    [-1, -1, -1], [0, -1, -1], [1, -1, -1], [2, -1, -1], [3, -1, -1], [4, -1, -1], [5, -1, -1],
    [-1, -1, -1], [3, 0, 5], [0, 0, 0], [-1, 4, -1], [6, -1, -1], [7, -1, -1], [8, 1, 3], [5, 4, 2],
    [-1, -1, 2], [1, 3, 4],
]


def _steer_case(seed, dtype, tokens, width, num_slots, *, residual=True, spare_rows=3, stride_pad=0):
    g = _gen(seed)
    table = _steer_table(width, g)
    h_wide = torch.randn(tokens, width + stride_pad, generator=g)
    hidden = h_wide[:, :width]
    res = torch.randn(tokens, width, generator=g) if residual else None
    x = hidden + (res if residual else 0)
    # Put every token's projection on the CAP directions far from the thresholds: +4 on slot 3 (above 0.5),
    # and a projection near 0 on slot 2 (far below 8), whatever the random draw gave.
    for slot, target in ((3, 4.0), (2, 0.0)):
        unit = table["vectors"][slot]
        hidden += (target - x @ unit)[:, None] * unit[None, :]
        x = hidden + (res if residual else 0)
    slots = torch.tensor([_SLOT_PATTERNS[t % len(_SLOT_PATTERNS)][:num_slots] for t in range(tokens + spare_rows)],
                         dtype=torch.int32).reshape(tokens + spare_rows, num_slots)
    slots[tokens:] = 0  # rows past T must be ignored even though they name an op
    h_wide = h_wide.to(dtype)
    if dtype != torch.float32 and tokens:
        # A NaN with an odd payload in an unsteered row (row 0): a kernel that rewrote the row, even with
        # the same value, would store a canonical NaN instead and change these bits.
        h_wide[0, 5] = torch.tensor(-63, dtype=torch.int16).view(dtype)  # 0xFFC1
    case = {"hidden": h_wide[:, :width], "residual": None if res is None else res.to(dtype), "slots": slots}
    case.update(table)
    return case


@cache
def _steer_cases() -> dict[str, dict]:
    cases = {}
    for i, (name, dtype) in enumerate(_DTYPES.items()):
        cases[f"h576_t17_m3_{name}"] = _steer_case(100 + i, dtype, 17, 576, 3)
        cases[f"h1000_t17_m2_strided_{name}"] = _steer_case(110 + i, dtype, 17, 1000, 2, stride_pad=24)
    cases["h576_t17_m1_bf16"] = _steer_case(120, torch.bfloat16, 17, 576, 1)
    cases["h333_t17_m3_no_residual_f32"] = _steer_case(121, torch.float32, 17, 333, 3, residual=False)
    cases["h2048_t9_m3_bf16"] = _steer_case(122, torch.bfloat16, 9, 2048, 3)
    cases["t0_bf16"] = _steer_case(123, torch.bfloat16, 0, 576, 3)
    cases["t1_bf16"] = _steer_case(124, torch.bfloat16, 1, 576, 3, spare_rows=0)
    return cases


# ---------------------------------------------------------------- the interpreter subprocess


def _run_interpreted(in_path: str, out_path: str) -> None:
    cases = torch.load(in_path)
    out = {"scatter": {}, "steer": {}, "backends": {}}
    for name, case in cases["scatter"].items():
        dst = case["dst"].clone()
        scatter_rows(dst, case["src"], case["route"], case["residual"])
        out["scatter"][name] = dst
        out["backends"][f"scatter/{name}"] = last_backend("scatter_rows")
    for name, case in cases["steer"].items():
        hidden = case["hidden"].clone()
        steer_rows(hidden, case["residual"], case["vectors"], case["op_codes"], case["scales"],
                   case["thresholds"], case["slots"])
        out["steer"][name] = hidden
        out["backends"][f"steer/{name}"] = last_backend("steer_rows")
    torch.save(out, out_path)


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory) -> dict:
    folder = tmp_path_factory.mktemp("triton_interpreter")
    in_path, out_path = folder / "cases.pt", folder / "outputs.pt"
    torch.save({"scatter": _scatter_cases(), "steer": _steer_cases()}, in_path)
    env = dict(os.environ, TRITON_INTERPRET="1", MIA_STREAM_KERNELS="triton")
    proc = subprocess.run([sys.executable, __file__, _CHILD_FLAG, str(in_path), str(out_path)],
                          env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, f"interpreter run failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return torch.load(out_path)


# ---------------------------------------------------------------- comparisons


def _reference_scatter(case: dict) -> torch.Tensor:
    dst = case["dst"].clone()
    scatter_rows_reference(dst, case["src"], case["route"], case["residual"])
    return dst


def _assert_scatter_matches(got: torch.Tensor, case: dict) -> None:
    want = _reference_scatter(case)
    rows = want.shape[0]
    got2, want2 = got.reshape(rows, -1), want.reshape(rows, -1)
    # Every row but the sentinel: bit-exact (written rows and untouched rows alike).
    assert _same_values(got2[:-1], want2[:-1])
    # The sentinel absorbs every unwatched token. With several, the GPU's programs race on it, so each element
    # holds that element of one of them (not necessarily the same one across the row).
    tokens = case["src"].shape[0]
    to_sentinel = [t for t in range(tokens) if int(case["route"][t]) == rows - 1]
    if not to_sentinel:
        assert _same_values(got2[-1], case["dst"].reshape(rows, -1)[-1])
    else:
        src = case["src"].reshape(tokens, -1)
        res = None if case["residual"] is None else case["residual"].reshape(tokens, -1)
        candidates = torch.stack(
            [(src[t].float() + (0 if res is None else res[t].float())).to(got.dtype) for t in to_sentinel])
        same = (_bits(candidates) == _bits(got2[-1])[None]) | (torch.isnan(candidates) & torch.isnan(got2[-1])[None])
        assert bool(same.any(dim=0).all())


@pytest.mark.parametrize("name", list(_scatter_cases()))
def test_scatter_triton_interpreted_is_bit_exact(interpreted, name):
    assert interpreted["backends"][f"scatter/{name}"] == "triton"
    _assert_scatter_matches(interpreted["scatter"][name], _scatter_cases()[name])


def _reference_steer(case: dict) -> torch.Tensor:
    hidden = case["hidden"].clone()
    steer_rows_reference(hidden, case["residual"], case["vectors"], case["op_codes"], case["scales"],
                         case["thresholds"], case["slots"])
    return hidden


def _ordered(bits: torch.Tensor) -> torch.Tensor:
    """Sign-magnitude float bits -> integers in value order, so a difference counts ulps."""
    b = bits.to(torch.int64)
    width = 32 if bits.dtype == torch.int32 else 16
    return torch.where(b < 0, -(b & ((1 << (width - 1)) - 1)), b)


def _assert_steer_matches(got: torch.Tensor, case: dict) -> None:
    want = _reference_steer(case)
    tokens = want.shape[0]
    untouched = (case["slots"][:tokens] < 0).all(dim=1)
    # Unsteered tokens: the very bits that came in (the kernel must not even store a round trip).
    assert torch.equal(_bits(got[untouched]), _bits(case["hidden"][untouched]))
    if got.dtype == torch.float32:
        # Both sides run the same float32 formula; only the order of the H-term sums (x.v, |v|^2) differs.
        # That perturbs x.v by ~eps32*sqrt(H)*|x||v| (about 1e-6 relative here) and each element by
        # < 1e-5 absolute for |x_i| ~ 1..10: an error in the op's math (a missing norm, a wrong sign or order) is
        # >= 1e-2.
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-5)
    else:
        # The float32 values agree to ~1e-6 relative, far below a bf16/fp16 ulp, so after rounding they are
        # equal except where the float32 value sits within that of a rounding midpoint: at most 1 ulp apart,
        # and rarely.
        ulps = (_ordered(_bits(got)) - _ordered(_bits(want))).abs()
        ulps = torch.where(torch.isnan(got) & torch.isnan(want), 0, ulps).flatten()  # NaN payloads: see _same_values
        if ulps.numel():
            assert int(ulps.max()) <= 1
            assert float((ulps == 0).float().mean()) >= 0.99
    # The steering did something where it should: the steered rows changed.
    changed = (_bits(want) != _bits(case["hidden"])).any(dim=1)
    assert bool(changed[~untouched].any()) or tokens == 0 or bool(untouched.all())


@pytest.mark.parametrize("name", list(_steer_cases()))
def test_steer_triton_interpreted_matches_reference(interpreted, name):
    assert interpreted["backends"][f"steer/{name}"] == "triton"
    _assert_steer_matches(interpreted["steer"][name], _steer_cases()[name])


# ---------------------------------------------------------------- the reference against numpy


def _numpy_steer(hidden, residual, vectors, op_codes, scales, thresholds, slots) -> np.ndarray:
    """The spec, token by token, in float64 and written independently of the torch reference."""
    h = hidden.double().numpy()
    x_all = h + (0 if residual is None else residual.double().numpy())
    out = h.copy()
    vec = vectors.double().numpy()
    for t in range(h.shape[0]):
        x = x_all[t].copy()
        for s in slots[t].tolist():
            if s < 0:
                continue
            v, op = vec[s], int(op_codes[s])
            norm = np.linalg.norm(v)
            if op == OP_ADD:
                x = x + float(scales[s]) * v
            elif op in (OP_CAP, OP_ABLATE) and norm > 0:
                u = v / norm
                p = float(x @ u)
                x = x - (max(0.0, p - float(thresholds[s])) if op == OP_CAP else p) * u
        out[t] = h[t] + (x - x_all[t])
    return out


@pytest.mark.parametrize("name", ["h576_t17_m3_f32", "h1000_t17_m2_strided_f32", "h333_t17_m3_no_residual_f32"])
def test_steer_reference_matches_numpy_formula(name):
    case = _steer_cases()[name]
    got = _reference_steer(case)
    want = _numpy_steer(case["hidden"], case["residual"], case["vectors"], case["op_codes"], case["scales"],
                        case["thresholds"], case["slots"][: case["hidden"].shape[0]])
    np.testing.assert_allclose(got.double().numpy(), want, rtol=1e-5, atol=2e-5)


def _one_hot_steer(ops: list[tuple[int, float, float]], x: list[float]) -> torch.Tensor:
    """Steer one token x (no residual) along e0 with the (op, scale, threshold) list applied in order."""
    width = len(x)
    vectors = torch.zeros(len(ops), width)
    vectors[:, 0] = 1.0
    hidden = torch.tensor([x])
    steer_rows_reference(
        hidden, None, vectors,
        torch.tensor([op for op, _, _ in ops], dtype=torch.int32),
        torch.tensor([sc for _, sc, _ in ops], dtype=torch.float32),
        torch.tensor([th for _, _, th in ops], dtype=torch.float32),
        torch.arange(len(ops), dtype=torch.int32)[None, :],
    )
    return hidden[0]


def test_steer_composition_order_and_each_op():
    x = [3.0, 1.0, -2.0]
    assert _one_hot_steer([(OP_ADD, 2.0, 0)], x).tolist() == [5.0, 1.0, -2.0]
    assert _one_hot_steer([(OP_ADD, -4.0, 0)], x).tolist() == [-1.0, 1.0, -2.0]
    assert _one_hot_steer([(OP_CAP, 0, 1.0)], x).tolist() == [1.0, 1.0, -2.0]    # above: capped to 1
    assert _one_hot_steer([(OP_CAP, 0, 5.0)], x).tolist() == [3.0, 1.0, -2.0]    # below: untouched
    assert _one_hot_steer([(OP_ABLATE, 0, 0)], x).tolist() == [0.0, 1.0, -2.0]
    # Order matters and each op sees the previous one's result.
    assert _one_hot_steer([(OP_ADD, 2.0, 0), (OP_ABLATE, 0, 0)], x).tolist() == [0.0, 1.0, -2.0]
    assert _one_hot_steer([(OP_ABLATE, 0, 0), (OP_ADD, 2.0, 0)], x).tolist() == [2.0, 1.0, -2.0]
    assert _one_hot_steer([(OP_ADD, 4.0, 0), (OP_CAP, 0, 6.0)], x).tolist() == [6.0, 1.0, -2.0]
    assert _one_hot_steer([(OP_CAP, 0, 6.0), (OP_ADD, 4.0, 0)], x).tolist() == [7.0, 1.0, -2.0]


def test_steer_reference_normalizes_cap_and_ablate_vectors():
    case = _steer_cases()["h576_t17_m3_f32"]
    scaled = dict(case, vectors=case["vectors"] * 3.5)  # ADD slots change with the scale; compare CAP/ABLATE only
    slots = case["slots"][:17]
    active = slots >= 0
    cap_ablate = ((case["op_codes"][slots.clamp(min=0)] != OP_ADD) | ~active).all(dim=1) & active.any(dim=1)
    assert int(cap_ablate.sum()) >= 5
    torch.testing.assert_close(_reference_steer(scaled)[cap_ablate], _reference_steer(case)[cap_ablate],
                               rtol=1e-5, atol=1e-5)


def test_scatter_reference_matches_numpy_formula():
    case = _scatter_cases()["h576_t9_residual_f32"]
    got = _reference_scatter(case).numpy()
    want = case["dst"].numpy().copy()
    for t in range(case["src"].shape[0]):
        want[int(case["route"][t])] = case["src"][t].numpy() + case["residual"][t].numpy()
    np.testing.assert_array_equal(got[:-1], want[:-1])


def test_steer_leaves_unsteered_rows_bit_identical_even_nan():
    hidden = torch.tensor([[float("nan"), 1.0], [2.0, 3.0]], dtype=torch.bfloat16)
    before = _bits(hidden).clone()
    steer_rows_reference(hidden, torch.ones_like(hidden), torch.ones(1, 2), torch.tensor([OP_ADD], dtype=torch.int32),
                         torch.tensor([1.0]), torch.tensor([0.0]), torch.tensor([[-1], [0]], dtype=torch.int32))
    assert torch.equal(_bits(hidden)[0], before[0])
    assert hidden[1].tolist() == [3.0, 4.0]


def test_shape_errors_are_clear():
    with pytest.raises(ValueError, match="route has 2 entries for 3 tokens"):
        scatter_rows(torch.zeros(4, 8), torch.zeros(3, 8), torch.zeros(2, dtype=torch.int32))
    with pytest.raises(ValueError, match="dst rows hold 8 values but src rows 6"):
        scatter_rows(torch.zeros(4, 8), torch.zeros(3, 6), torch.zeros(3, dtype=torch.int32))
    with pytest.raises(ValueError, match="slots must be int32"):
        steer_rows(torch.zeros(3, 8), None, torch.zeros(1, 8), torch.zeros(1, dtype=torch.int32), torch.zeros(1),
                   torch.zeros(1), torch.zeros(2, 1, dtype=torch.int32))
    with pytest.raises(ValueError, match="contiguous"):
        scatter_rows(torch.zeros(8, 4).t(), torch.zeros(3, 8), torch.zeros(3, dtype=torch.int32))


# ---------------------------------------------------------------- dispatch


def test_dispatch_picks_reference_on_cpu_and_honours_the_override(monkeypatch):
    monkeypatch.delenv("MIA_STREAM_KERNELS", raising=False)
    assert active_backend("cpu") == "reference"
    assert active_backend(torch.device("cuda", 0)) == "triton"  # Triton imports here; a CUDA tensor would use it
    monkeypatch.setenv("MIA_STREAM_KERNELS", "reference")
    assert active_backend("cuda") == "reference"
    monkeypatch.setenv("MIA_STREAM_KERNELS", "triton")
    assert active_backend("cpu") == "triton"
    monkeypatch.setenv("MIA_STREAM_KERNELS", "fast")
    with pytest.raises(ValueError, match="MIA_STREAM_KERNELS"):
        active_backend("cpu")


def test_dispatch_records_which_implementation_ran(monkeypatch):
    monkeypatch.delenv("MIA_STREAM_KERNELS", raising=False)
    reset_backend_record()
    case = _steer_cases()["t1_bf16"]
    hidden = case["hidden"].clone()
    steer_rows(hidden, case["residual"], case["vectors"], case["op_codes"], case["scales"], case["thresholds"],
               case["slots"])
    scatter_rows(torch.zeros(3, 4), torch.ones(2, 4), torch.tensor([0, 2], dtype=torch.int32))
    assert last_backend("steer_rows") == "reference" and last_backend("scatter_rows") == "reference"
    assert backend_calls() == {("steer_rows", "reference"): 1, ("scatter_rows", "reference"): 1}
    assert torch.equal(_bits(hidden), _bits(_reference_steer(case)))


# ---------------------------------------------------------------- custom ops and torch.compile


def _op_inputs(seed: int = 0):
    g = _gen(seed)
    layers, rows, width, tokens = 3, 8, 64, 5
    table = _steer_table(width, g)
    route = torch.full((layers, tokens + 2), 7, dtype=torch.int32)  # wider than the step: rows past it unused
    route[1, :tokens] = torch.tensor([0, 7, 2, 7, 3], dtype=torch.int32)
    slots = torch.full((layers, tokens + 2, 2), -1, dtype=torch.int32)
    slots[1, :tokens] = torch.tensor([[0, 3], [-1, -1], [4, -1], [1, 5], [-1, 8]], dtype=torch.int32)
    return {
        "aperture": torch.randn(layers, rows, width, generator=g),
        "q_aperture": torch.randn(layers, rows, width, generator=g),
        "src": torch.randn(tokens, width, generator=g),
        "route": route,
        "hidden": torch.randn(tokens, width, generator=g),
        "residual": torch.randn(tokens, width, generator=g),
        "slots": slots,
        **table,
    }


def _layer_step(aperture, q_aperture, src, route, hidden, residual, vectors, op_codes, scales, thresholds, slots):
    """What a patched decoder layer (layer 1) does: capture q and hs, steer the MLP output, hand on hidden +
    residual."""
    import mia_stream.kernels.ops  # noqa: F401  (registers the ops)

    mlp_out = hidden * 2.0
    torch.ops.mia_stream.capture(q_aperture, route, src * 0.5, None, 1)
    torch.ops.mia_stream.steer(mlp_out, residual, vectors, op_codes, scales, thresholds, slots, 1)
    torch.ops.mia_stream.capture(aperture, route, mlp_out, residual, 1)
    return mlp_out + residual


def test_custom_ops_eager_match_the_reference():
    import mia_stream.kernels.ops  # noqa: F401

    inputs = _op_inputs()
    expected_ap, expected_q = inputs["aperture"].clone(), inputs["q_aperture"].clone()
    mlp_out = inputs["hidden"] * 2.0
    tokens = inputs["src"].shape[0]
    route = inputs["route"][1, :tokens]
    scatter_rows_reference(expected_q[1], inputs["src"] * 0.5, route)
    steer_rows_reference(mlp_out, inputs["residual"], inputs["vectors"], inputs["op_codes"], inputs["scales"],
                         inputs["thresholds"], inputs["slots"][1, :tokens])
    scatter_rows_reference(expected_ap[1], mlp_out, route, inputs["residual"])
    out = _layer_step(**inputs)
    assert torch.equal(out, mlp_out + inputs["residual"])
    assert torch.equal(inputs["aperture"], expected_ap) and torch.equal(inputs["q_aperture"], expected_q)


def test_custom_ops_opcheck():
    import mia_stream.kernels.ops  # noqa: F401

    inputs = _op_inputs()
    tests = ("test_schema", "test_faketensor")
    torch.library.opcheck(torch.ops.mia_stream.capture.default,
                          (inputs["q_aperture"], inputs["route"], inputs["src"], None, 1), test_utils=tests)
    torch.library.opcheck(torch.ops.mia_stream.capture.default,
                          (inputs["aperture"], inputs["route"], inputs["src"], inputs["residual"], 1),
                          test_utils=tests)
    torch.library.opcheck(torch.ops.mia_stream.steer.default,
                          tuple(inputs[k] for k in ("hidden", "residual", "vectors", "op_codes", "scales",
                                                    "thresholds", "slots")) + (1,), test_utils=tests)


@pytest.mark.slow
def test_custom_ops_compile_fullgraph_with_inductor_without_copies():
    from torch._inductor import config as inductor_config
    from torch._inductor.utils import run_and_get_code

    eager_inputs, compiled_inputs = _op_inputs(), _op_inputs()
    expected = _layer_step(**eager_inputs)
    torch._dynamo.reset()
    # vLLM compiles with auto_functionalized v1; whole buffers (not views) then need no defensive clone.
    with inductor_config.patch(enable_auto_functionalized_v2=False):
        compiled = torch.compile(_layer_step, fullgraph=True, backend="inductor")
        got, (code, *_) = run_and_get_code(compiled, **compiled_inputs)
    assert torch.equal(got, expected)
    for name in ("aperture", "q_aperture"):
        assert torch.equal(compiled_inputs[name], eager_inputs[name])
    for op in ("capture", "steer"):
        assert f"torch.ops.mia_stream.{op}.default(" in code
    assert "clone" not in code, "inductor copies a buffer the ops mutate"


# ---------------------------------------------------------------- on a GPU


def _to_cuda(case: dict) -> dict:
    return {k: (v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in case.items()}


def _to_cpu(case: dict) -> dict:
    return {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in case.items()}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_triton_on_cuda_matches_reference(monkeypatch):
    monkeypatch.delenv("MIA_STREAM_KERNELS", raising=False)
    for name, case in _scatter_cases().items():
        dev = _to_cuda(case)
        dst = dev["dst"].clone()
        scatter_rows(dst, dev["src"], dev["route"], dev["residual"])
        assert last_backend("scatter_rows") == "triton"
        _assert_scatter_matches(dst.cpu(), case)
    for name, case in _steer_cases().items():
        dev = _to_cuda(case)
        hidden = dev["hidden"].clone()
        steer_rows(hidden, dev["residual"], dev["vectors"], dev["op_codes"], dev["scales"], dev["thresholds"],
                   dev["slots"])
        assert last_backend("steer_rows") == "triton"
        _assert_steer_matches(hidden.cpu(), case)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_triton_on_cuda_inside_a_cuda_graph(monkeypatch):
    """Capture both kernels once, then replay with new tensor contents at the same addresses."""
    monkeypatch.delenv("MIA_STREAM_KERNELS", raising=False)
    first, second = _steer_case(200, torch.bfloat16, 17, 576, 3), _steer_case(201, torch.bfloat16, 17, 576, 3)
    second["slots"] = second["slots"].roll(1, dims=0)
    sc_first = _scatter_case(202, torch.bfloat16, 17, 576, 24, residual=True)
    sc_second = _scatter_case(203, torch.bfloat16, 17, 576, 24, residual=True)
    steer_in, scatter_in = _to_cuda(first), _to_cuda(sc_first)
    hidden = steer_in["hidden"].clone()
    dst = scatter_in["dst"].clone()

    def step():
        steer_rows(hidden, steer_in["residual"], steer_in["vectors"], steer_in["op_codes"], steer_in["scales"],
                   steer_in["thresholds"], steer_in["slots"])
        scatter_rows(dst, scatter_in["src"], scatter_in["route"], scatter_in["residual"])

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # warm-up compiles the kernels outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for steer_case, scatter_case in ((first, sc_first), (second, sc_second)):
        for key in ("hidden", "residual", "vectors", "scales", "thresholds", "slots"):
            steer_in[key].copy_(steer_case[key])
        hidden.copy_(steer_case["hidden"])
        for key in ("dst", "src", "route", "residual"):
            scatter_in[key].copy_(scatter_case[key])
        dst.copy_(scatter_case["dst"])
        graph.replay()
        torch.cuda.synchronize()
        _assert_steer_matches(hidden.cpu(), steer_case)
        _assert_scatter_matches(dst.cpu(), scatter_case)


if __name__ == "__main__" and len(sys.argv) == 4 and sys.argv[1] == _CHILD_FLAG:
    _run_interpreted(sys.argv[2], sys.argv[3])


# ---------------------------------------------------------------- CPU fast paths of the dispatch


def test_cpu_steer_of_only_the_slotted_rows_is_bit_identical_to_the_full_reference():
    from mia_stream.kernels import steer_rows_reference

    g = torch.Generator().manual_seed(7)
    hidden, residual = torch.randn(9, 576, generator=g), torch.randn(9, 576, generator=g)
    vectors = torch.randn(3, 576, generator=g)
    op_codes = torch.tensor([OP_ADD, OP_CAP, OP_ABLATE], dtype=torch.int32)
    scales, thresholds = torch.tensor([2.0, 1.0, 1.0]), torch.tensor([0.0, 0.3, 0.0])
    slots = torch.full((12, 2), -1, dtype=torch.int32)
    slots[1, 0], slots[4] = 0, torch.tensor([1, 2], dtype=torch.int32)
    slots[8, 1] = 2
    full, fast = hidden.clone(), hidden.clone()
    steer_rows_reference(full, residual, vectors, op_codes, scales, thresholds, slots)
    steer_rows(fast, residual, vectors, op_codes, scales, thresholds, slots)  # dispatch: only rows 1, 4, 8
    assert torch.equal(fast, full) and not torch.equal(fast[[1, 4, 8]], hidden[[1, 4, 8]])
    untouched = hidden.clone()
    steer_rows(untouched, residual, vectors, op_codes, scales, thresholds, torch.full((12, 2), -1, dtype=torch.int32))
    assert torch.equal(untouched, hidden)


def test_cpu_scatter_with_every_row_on_the_sentinel_writes_nothing_else():
    dst = torch.full((5, 4), 7.0)
    scatter_rows(dst, torch.zeros(3, 4), torch.full((3,), 4, dtype=torch.int32))
    assert torch.equal(dst[:4], torch.full((4, 4), 7.0))
    scatter_rows(dst, torch.ones(3, 4), torch.tensor([4, 1, 4], dtype=torch.int32))  # one watched row
    assert torch.equal(dst[1], torch.ones(4)) and torch.equal(dst[0], torch.full((4,), 7.0))
