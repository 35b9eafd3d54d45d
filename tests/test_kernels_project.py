"""The in-graph detector op ``mia_stream::project`` (``kernels/project.py``): the torch reference against a numpy
formula written here, the Triton kernel (under ``TRITON_INTERPRET=1`` on this CPU machine, natively on a GPU)
against the reference, and the op's schema/fake implementation (``torch.library.opcheck``)."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from mia_stream.kernels.project import project_rows_reference

_CHILD = "--run-triton-interpreted"


def _case(seed: int, dtype: torch.dtype, tokens: int = 37, width: int = 576, cols: int = 4, slots: int = 6):
    g = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(tokens, width, generator=g) * 3).to(dtype)
    residual = (torch.randn(tokens, width, generator=g) * 3).to(dtype)
    table = torch.randn(slots, width, generator=g)
    route = torch.full((tokens + 11, cols), -1, dtype=torch.int32)  # rows past the step: padding
    pick = torch.rand(tokens, cols, generator=g) < 0.3
    route[:tokens][pick] = torch.randint(0, slots, (int(pick.sum()),), generator=g, dtype=torch.int32)
    out = torch.full((tokens + 11, cols), 123.0)
    return {"out": out, "hidden": hidden, "residual": residual, "table": table, "route": route}


CASES = {f"{dt}-{seed}": (seed, dt) for seed in (1, 2) for dt in (torch.float32, torch.bfloat16, torch.float16)}


def _numpy_formula(c) -> np.ndarray:
    """out[t, k] = round_dtype(h + r)[t] . table[route[t, k]] where routed, else the old value."""
    x = (c["hidden"].float() + c["residual"].float()).to(c["hidden"].dtype).double().numpy()
    table, route = c["table"].double().numpy(), c["route"].numpy()
    out = c["out"].double().numpy().copy()
    for t in range(x.shape[0]):
        for k in range(route.shape[1]):
            if route[t, k] >= 0:
                out[t, k] = x[t] @ table[route[t, k]]
    return out


@pytest.mark.parametrize("name", list(CASES))
def test_reference_matches_the_formula_and_leaves_unrouted_rows(name):
    c = _case(*CASES[name])
    want = _numpy_formula(c)
    got = c["out"].clone()
    project_rows_reference(got, c["hidden"], c["residual"], c["table"], c["route"])
    np.testing.assert_allclose(got.double().numpy(), want, rtol=1e-6, atol=1e-4)
    assert torch.equal(got[c["hidden"].shape[0]:], c["out"][c["hidden"].shape[0]:])  # padding rows untouched


def _child(in_path: str, out_path: str) -> None:
    from mia_stream.kernels.project import project_rows_triton

    cases = torch.load(in_path)
    out = {}
    for name, c in cases.items():
        got = c["out"].clone()
        project_rows_triton(got, c["hidden"], c["residual"], c["table"], c["route"])
        out[name] = got
    torch.save(out, out_path)


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory):
    d = tmp_path_factory.mktemp("project")
    cases = {name: _case(*spec) for name, spec in CASES.items()}
    torch.save(cases, d / "in.pt")
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, __file__, _CHILD, str(d / "in.pt"), str(d / "out.pt")], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return cases, torch.load(d / "out.pt")


@pytest.mark.parametrize("name", list(CASES))
def test_triton_interpreted_matches_the_reference(interpreted, name):
    cases, outs = interpreted
    c = cases[name]
    want = c["out"].clone()
    project_rows_reference(want, c["hidden"], c["residual"], c["table"], c["route"])
    # float32 accumulation over 576 terms in another order vs the reference's float64: ~1e-6 relative
    torch.testing.assert_close(outs[name], want, rtol=1e-5, atol=1e-4)


def test_the_op_schema_and_fake():
    import mia_stream.kernels.ops  # noqa: F401

    c = _case(3, torch.float32)
    slots = c["route"].unsqueeze(0).repeat(3, 1, 1)  # [layers, rows, cols]
    torch.library.opcheck(torch.ops.mia_stream.project.default,
                          (c["out"], c["hidden"], c["residual"], c["table"], slots, 1),
                          test_utils=("test_schema", "test_faketensor"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_triton_on_cuda_inside_a_cuda_graph():
    """Captured once, replayed with new routes and rows at the same addresses (what the engine's graphs do)."""
    from mia_stream.kernels.project import project_rows

    a, b = _case(5, torch.bfloat16), _case(6, torch.bfloat16)
    dev = {k: v.cuda() for k, v in a.items()}
    project_rows(dev["out"], dev["hidden"], dev["residual"], dev["table"], dev["route"])  # warm up (compile)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        project_rows(dev["out"], dev["hidden"], dev["residual"], dev["table"], dev["route"])
    for c in (a, b):
        for k, v in c.items():
            dev[k].copy_(v)
        graph.replay()
        torch.cuda.synchronize()
        want = c["out"].clone()
        project_rows_reference(want, c["hidden"], c["residual"], c["table"], c["route"])
        torch.testing.assert_close(dev["out"].cpu(), want, rtol=1e-5, atol=1e-3)


if __name__ == "__main__" and len(sys.argv) == 4 and sys.argv[1] == _CHILD:
    _child(sys.argv[2], sys.argv[3])
