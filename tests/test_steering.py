"""Per-request steering in a real vLLM engine, checked against HF transformers with the same formula in a hook.

The steered residual is read back through capture (which reads after that layer's steering), and the
logits through vLLM's sampled-token logprobs. Tolerances as in test_producer (float32, 1e-4 relative).
"""

from __future__ import annotations

import threading
import uuid

import numpy as np
import pytest
import torch

from mia_stream import settings
from mia_stream.spec.vectors import register_vector, vector_by_digest, vector_digest
from producer_helpers import collecting, hf_trace, rel_err

TOL = 1e-4
LAYER = 10
pytestmark = pytest.mark.slow


def _params(max_tokens, spec=None, **kw):
    from vllm import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=0,
                          extra_args={"mia_stream": spec} if spec is not None else None, **kw)


def _direction(seed=0, hidden=576):
    v = np.random.default_rng(seed).standard_normal(hidden).astype(np.float32)
    return v / np.linalg.norm(v)


def _formula(op, v, scale=1.0, threshold=0.0):
    """The documented steering formulas, written independently of the kernels (torch, float32)."""
    vt = torch.tensor(v)

    def apply(x):
        if op == "add":
            return x + scale * vt
        proj = x @ vt
        if op == "cap":
            return x - torch.clamp(proj - threshold, min=0.0)[..., None] * vt
        return x - proj[..., None] * vt

    return apply


def _hook_for(layer, fn, from_position=0):
    def hook(i, h):
        if i != layer:
            return h
        h = h.clone()
        h[:, from_position:] = fn(h[:, from_position:])
        return h
    return hook


def _hf_logprobs(logits, token_ids, start):
    lp = torch.log_softmax(torch.tensor(logits), dim=-1).numpy()
    return np.array([lp[p - 1, token_ids[p]] for p in range(start, len(token_ids))])


@pytest.mark.parametrize("op, scale, threshold", [("add", 6.0, 0.0), ("cap", 1.0, 0.5), ("ablate", 1.0, 0.0)])
def test_steering_equals_hf_hook(engine, hf_model, broker_address, op, scale, threshold):
    v = _direction(1)
    rid = f"steer-{op}"
    spec = {"steer": [{"layer": LAYER, "op": op, "vector": v.tolist(), "scale": scale, "threshold": threshold}],
            "capture": {"hidden_states": {"layers": [LAYER, LAYER + 1, 29], "positions": "all"}}, "id": rid}
    prompt = "The weather today in the mountains is"
    with collecting(broker_address, [rid]) as col:
        out = engine.generate([prompt], _params(10, spec))[0]
        col.wait_ended([rid])
    full = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)
    ref_hs, _, _, ref_logits = hf_trace(hf_model, full[:-1], steer_hook=_hook_for(LAYER, _formula(op, v, scale, threshold)))
    positions, _, hs = col.stacked(rid, "hs")
    assert positions == list(range(len(full) - 1))
    assert rel_err(hs, ref_hs[[LAYER, LAYER + 1, 29]]).max() < TOL
    if op == "ablate":  # the steered residual has no component along v at the steered layer
        assert np.abs(hs[0] @ v).max() < 1e-3 * np.abs(hs[0]).max()
    if op == "cap":
        assert (hs[0] @ v).max() <= threshold + 1e-3
    got = np.array([list(lp.values())[0].logprob for lp in out.outputs[0].logprobs])
    want = _hf_logprobs(ref_logits, full[:-1] + [full[-1]], len(out.prompt_token_ids))
    np.testing.assert_allclose(got, want, atol=2e-3)
    start = col.events[rid][0].stream.start
    assert start.capture_after_steering and start.steering[0]["op"] == op
    assert {f.steering_version for f in col.frames(rid)} == {1}


def test_unsteered_requests_in_a_steered_batch_are_bit_identical(engine, broker_address):
    """The same batch twice: once with its fourth request steered, once not. Batch shape and order are equal,
    so any difference in the other three requests can only come from steering leaking across rows."""
    prompts = ["Once upon a time", "The best way to cook rice is", "In 1969, astronauts", "Once upon a time"]
    watch = {"capture": {"hidden_states": {"layers": [LAYER, 29], "positions": "all"}}}
    steer = [{"layer": LAYER, "op": "add", "vector": (_direction(2) * 8).tolist()}]
    with collecting(broker_address, ["bit-*"]) as col:
        for run in ("plain", "steered"):
            last = dict(watch, id=f"bit-{run}-3", **({"steer": steer} if run == "steered" else {}))
            engine.generate(prompts, [_params(8, dict(watch, id=f"bit-{run}-{i}")) for i in range(3)]
                            + [_params(8, last)])
        col.wait_ended([f"bit-{run}-{i}" for run in ("plain", "steered") for i in range(4)])
    for i in range(3):
        _, _, a = col.stacked(f"bit-plain-{i}", "hs")
        _, _, b = col.stacked(f"bit-steered-{i}", "hs")
        assert a.shape == b.shape and np.array_equal(a, b), f"request {i} changed by another's steering"
    _, _, a = col.stacked("bit-plain-3", "hs")
    _, _, b = col.stacked("bit-steered-3", "hs")
    assert np.abs(a[0] - b[0]).max() > 1.0, "the steered request was not steered"


def test_live_steering_command_applies_from_the_acked_step(engine, hf_model, broker_address):
    from mia_stream.consumers import open_stream
    from mia_stream.schemas import SteeringCommand

    rid = f"live-{uuid.uuid4().hex[:6]}"
    v = _direction(3)
    spec = {"capture": {"hidden_states": {"layers": [LAYER, 29], "positions": "all"}}, "id": rid}
    result = {}
    with open_stream(broker_address, patterns=[rid]) as stream:
        t = threading.Thread(target=lambda: result.setdefault(
            "out", engine.generate(["Once upon a time, a dragon"], _params(40, spec, ignore_eos=True))[0]))
        t.start()
        frames, ack = [], None
        for ev in stream:
            if ev.kind == "frame":
                frames.append(ev.frame)
                if len(frames) == 4 and ack is None:
                    cmd = SteeringCommand(uuid.uuid4().hex, rid, "add",
                                          [{"layer": LAYER, "op": "add", "vector": (v * 10).tolist()}])
                    ack = stream.client.send_steering(cmd, 30.0)
            if ev.kind == "end":
                break
        t.join(60)
    assert ack is not None and ack.ok, ack
    k = ack.applied_step
    assert k is not None and k > frames[3].step
    before = [f for f in frames if f.step < k]
    after = [f for f in frames if f.step >= k]
    assert before and after
    assert {f.steering_version for f in before} == {0} and {f.steering_version for f in after} == {1}
    out = result["out"]
    full = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)
    first_steered = after[0].positions[0]
    ref_hs, _, _, _ = hf_trace(hf_model, full[:-1], steer_hook=_hook_for(LAYER, _formula("add", v, 10.0), first_steered))
    hs = np.concatenate([f.tensors["hs"] for f in frames], axis=1)
    positions = [p for f in frames for p in f.positions]
    assert positions == list(range(len(full) - 1))
    assert rel_err(hs, ref_hs[[LAYER, 29]]).max() < TOL


def test_steering_command_for_unknown_request_gets_an_error(broker_address):
    from mia_stream.consumers import open_stream
    from mia_stream.schemas import SteeringCommand

    with open_stream(broker_address, patterns=["nobody"]) as stream:
        ack = stream.client.send_steering(SteeringCommand(uuid.uuid4().hex, "no-such-request", "clear"), 10.0)
    assert not ack.ok and "unknown" in ack.error


def test_vector_forms_steer_identically_and_leave_the_callers_params_alone(engine, broker_address):
    """A list, a numpy array and float32 bytes are one vector: the steered rows are bit-identical. The frontend
    hands vLLM the normalized spec (vectors as bytes, so vLLM's deepcopy of the params stays cheap) without
    touching the caller's SamplingParams, which may be shared by several prompts."""
    v = (_direction(3) * 6).astype(np.float32)
    register_vector("test-forms", v)
    forms = {"list": v.tolist(), "array": v, "f32": {"f32": v.astype("<f4").tobytes()}, "named": {"name": "test-forms"}}
    params = {name: _params(4, {"capture": {"hidden_states": {"layers": [LAYER], "positions": "all"}},
                                "steer": [{"layer": LAYER, "op": "add", "vector": vec}], "id": f"form-{name}"})
              for name, vec in forms.items()}
    before = {name: dict(p.extra_args["mia_stream"]) for name, p in params.items()}
    with collecting(broker_address, ["form-*"]) as col:
        for p in params.values():  # one request per batch: equal batch shapes, so equal vectors give equal bits
            engine.generate(["The sea is"], p)
        col.wait_ended([f"form-{n}" for n in forms])
    for name, p in params.items():
        spec = p.extra_args["mia_stream"]
        assert spec.keys() == before[name].keys() and spec["steer"][0]["vector"] is forms[name]
    stacks = {name: col.stacked(f"form-{name}", "hs")[2] for name in forms}
    assert all(np.array_equal(stacks["list"], stacks[name]) for name in forms)
    start = col.events["form-f32"][0].stream.start
    wire = start.steering[0]["vector"]  # the wire: float32 bytes (docs/wire-format.md 3.1)
    assert wire.keys() == {"f32"}
    np.testing.assert_array_equal(np.frombuffer(wire["f32"], "<f4"), v)
    named = col.events["form-named"][0].stream.start.steering[0]["vector"]  # a registered vector: its name and digest
    assert named == {"name": "test-forms", "digest": vector_digest(v)}
    np.testing.assert_array_equal(vector_by_digest(named["digest"]), v)


def test_an_inline_vectors_second_request_reuses_its_parsed_ops(engine, broker_address):
    """Issue 26: a numpy vector is content-hashed and parsed once in the frontend (this process); the second
    request with an equal array (a fresh object) hits the parsed-op cache, parses nothing, and steers the same."""
    from mia_stream.spec import op_cache_info

    v = (_direction(11) * 5).astype(np.float32)
    steer = lambda: [{"layer": layer, "op": "add", "vector": v.copy()} for layer in (LAYER - 1, LAYER)]  # noqa: E731
    cap = {"hidden_states": {"layers": [LAYER], "positions": "all"}}
    with collecting(broker_address, ["reuse-*"]) as col:
        engine.generate(["The sea is"], _params(4, {"capture": cap, "steer": steer(), "id": "reuse-1"}))
        before = op_cache_info()
        engine.generate(["The sea is"], _params(4, {"capture": cap, "steer": steer(), "id": "reuse-2"}))
        after = op_cache_info()
        col.wait_ended(["reuse-1", "reuse-2"])
    assert after["hits"] - before["hits"] == 2 and after["misses"] == before["misses"]
    assert np.array_equal(col.stacked("reuse-1", "hs")[2], col.stacked("reuse-2", "hs")[2])


def test_the_engines_control_id_carries_the_token_this_process_made(engine, broker_address):
    """Issue 24 item 5: the frontend (this process) made the token before vLLM started the engine core; the
    engine core (control peer) and its worker (StreamStart.control_id) agree on ``host:pid:engine:TOKEN``, and live
    steering reaches it (test_live_steering_command_applies_from_the_acked_step)."""
    import re

    with collecting(broker_address, ["ctl-id"]) as col:
        engine.generate(["The sea is"], _params(2, {"capture": {"hidden_states": {"layers": [LAYER]}}, "id": "ctl-id"}))
        col.wait_ended(["ctl-id"])
    control_id = col.events["ctl-id"][0].stream.start.control_id
    token = settings.get_text("MIA_STREAM_CONTROL_TOKEN")
    assert re.fullmatch(rf"[^:]+:\d+:engine:{token}", control_id) and re.fullmatch(r"[0-9a-f]{16}", token)


def _two_layer_hook(layers, fn):
    def hook(i, h):
        return _hook_for(i, fn)(i, h) if i in layers else h
    return hook


@pytest.mark.parametrize("form", ["ndarray", "list"])
def test_a_vector_changed_in_place_steers_the_next_request_with_its_new_content(engine, hf_model, broker_address, form):
    """Issue 26: inline vectors are cached by the caller's object and checked against its bytes on every request.
    The same spec object sent twice, its vector changed in place in between (the whole array; one element of the
    list), steers the second request with the new content: HF transformers with that content added at both layers
    is the reference, and the cached (old) content is not."""
    old = (_direction(21) * 6).astype(np.float32)
    new = (_direction(22) * 6).astype(np.float32) if form == "ndarray" else old.copy()
    if form == "list":
        new[7] += 3.0
    vec = old.copy() if form == "ndarray" else old.tolist()
    layers = (LAYER - 1, LAYER)
    spec = {"steer": [{"layer": layer, "op": "add", "vector": vec} for layer in layers],  # one object, two ops
            "capture": {"hidden_states": {"layers": [LAYER], "positions": "all"}}}
    tag = uuid.uuid4().hex[:6]
    prompt = "The river flows past the old mill and"
    outs = {}
    with collecting(broker_address, [f"mut-{tag}-*"]) as col:
        for run in ("before", "after"):
            if run == "after":
                if form == "ndarray":
                    vec[:] = new
                else:
                    vec[7] = float(new[7])
            outs[run] = engine.generate([prompt], _params(4, dict(spec, id=f"mut-{tag}-{run}")))[0]
        col.wait_ended([f"mut-{tag}-before", f"mut-{tag}-after"])
    for run, content in (("before", old), ("after", new)):
        out = outs[run]
        full = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)
        ref, _, _, _ = hf_trace(hf_model, full[:-1], steer_hook=_two_layer_hook(layers, _formula("add", content)))
        _, _, hs = col.stacked(f"mut-{tag}-{run}", "hs")
        assert rel_err(hs, ref[[LAYER]]).max() < TOL, run
        if run == "after":
            stale, _, _, _ = hf_trace(hf_model, full[:-1], steer_hook=_two_layer_hook(layers, _formula("add", old)))
            assert rel_err(hs, stale[[LAYER]]).max() > 100 * TOL, "the second request was steered by the old vector"


def test_every_form_steering_all_layers_is_bit_identical_and_equals_hf(engine, hf_model, broker_address):
    """All 30 layers steered by one vector given as a list, an array, float32 bytes and a name: the steered rows
    are bit-identical (the normalized spec carries the bytes once and the other 29 ops name them by digest), equal
    to HF with the vector added after every layer, and StreamStart still lists each op with its whole vector."""
    v = (_direction(23) * 0.5).astype(np.float32)
    register_vector("test-all-layers", v)
    forms = {"list": v.tolist(), "array": v, "f32": {"f32": v.tobytes()}, "named": {"name": "test-all-layers"}}
    tag = uuid.uuid4().hex[:6]
    watch = {"hidden_states": {"layers": [LAYER, 29], "positions": "all"}}
    prompt = "A short story about a lighthouse keeper"
    outs = {}
    with collecting(broker_address, [f"all-{tag}-*"]) as col:
        for name, vec in forms.items():  # one request per batch: equal batch shapes, so equal vectors give equal bits
            spec = {"steer": [{"layer": i, "op": "add", "vector": vec} for i in range(30)], "capture": watch,
                    "id": f"all-{tag}-{name}"}
            outs[name] = engine.generate([prompt], _params(4, spec))[0]
        col.wait_ended([f"all-{tag}-{n}" for n in forms])
    stacks = {name: col.stacked(f"all-{tag}-{name}", "hs")[2] for name in forms}
    assert all(np.array_equal(stacks["list"], stacks[name]) for name in forms)
    out = outs["list"]
    full = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)
    ref, _, _, _ = hf_trace(hf_model, full[:-1], steer_hook=lambda i, h: _formula("add", v)(h))
    assert rel_err(stacks["list"], ref[[LAYER, 29]]).max() < TOL
    for name in ("array", "f32"):
        steering = col.events[f"all-{tag}-{name}"][0].stream.start.steering
        assert [op["layer"] for op in steering] == list(range(30))
        assert all(op["vector"].keys() == {"f32"} and op["vector"]["f32"] == v.tobytes() for op in steering)
