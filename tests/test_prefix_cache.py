"""The prefix-cache policy of streamed requests, in the session's real engine (prefix caching on, 128-token
blocks on the CPU): who reads and writes cached KV, read through vLLM's own ``num_cached_tokens``.

- a request that captures nothing of its prompt reads and writes the cache like any other;
- a capture of prompt positions recomputes them (``prefix_cache: "recompute"``, the default) or, with
  ``"reuse"``, takes them from the cache and names them in ``StreamEnd.uncaptured_positions``;
- steered requests share cache entries only with requests steered alike;
- a live steering change makes every block computed after it unreachable for other requests.
Captured rows are checked against HF on the same tokens, so a wrong cache hit would also show as wrong rows.
"""

from __future__ import annotations

import threading
import uuid

import numpy as np
import pytest

from producer_helpers import collecting, hf_trace, rel_err

pytestmark = pytest.mark.slow
LAYER, BLOCK, TOL = 10, 128, 1e-4


def _prompt(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(1000, 40000, n).tolist()


def _params(max_tokens, spec=None):
    from vllm import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                          extra_args={"mia_stream": spec} if spec is not None else None)


def _run(engine, prompt, params):
    return engine.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]


def _vec(seed: int) -> list:
    v = np.random.default_rng(seed).standard_normal(576).astype(np.float32)
    return (v / np.linalg.norm(v) * 4).tolist()


def test_capturing_generated_positions_reads_and_writes_the_cache(engine, broker_address, hf_model):
    prompt = _prompt(2 * BLOCK + 20, seed=11)
    rid = f"pc-gen-{uuid.uuid4().hex[:6]}"
    spec = {"capture": {"hidden_states": {"layers": [LAYER], "positions": "generated"}}, "id": rid}
    first = _run(engine, prompt, _params(4))  # a plain request fills the cache
    with collecting(broker_address, [rid]) as c:
        out = _run(engine, prompt, _params(4, spec))
        c.wait_ended([rid])
    assert first.num_cached_tokens == 0
    assert out.num_cached_tokens == 2 * BLOCK, "the streamed request did not read the plain request's blocks"
    assert list(out.outputs[0].token_ids) == list(first.outputs[0].token_ids)
    positions, _, hs = c.stacked(rid, "hs")
    full = prompt + list(out.outputs[0].token_ids)
    ref, _, _, _ = hf_trace(hf_model, full[:-1])
    assert positions == list(range(len(prompt), len(full) - 1))
    assert rel_err(hs, ref[[LAYER]][:, positions]).max() < TOL


def test_a_streamed_request_writes_the_cache_for_others(engine, broker_address):
    """Its second block exists only through the streamed request (it generated most of it)."""
    prompt = _prompt(BLOCK + 20, seed=12)
    rid = f"pc-write-{uuid.uuid4().hex[:6]}"
    spec = {"capture": {"hidden_states": {"layers": [LAYER], "positions": "generated"}}, "id": rid}
    with collecting(broker_address, [rid]) as c:
        out = _run(engine, prompt, _params(BLOCK, spec))
        c.wait_ended([rid])
    tokens = prompt + list(out.outputs[0].token_ids)
    follower = _run(engine, tokens[:2 * BLOCK + 1], _params(1))
    assert follower.num_cached_tokens == 2 * BLOCK


@pytest.mark.parametrize("policy", ["recompute", "reuse"])
def test_captured_prompt_positions_are_recomputed_or_named_uncaptured(engine, broker_address, hf_model, policy):
    prompt = _prompt(2 * BLOCK + 9, seed=20 + len(policy))
    _run(engine, prompt, _params(1))
    rid = f"pc-{policy}-{uuid.uuid4().hex[:6]}"
    spec = {"capture": {"hidden_states": {"layers": [LAYER], "positions": "all"}}, "id": rid,
            "prefix_cache": policy}
    with collecting(broker_address, [rid]) as c:
        out = _run(engine, prompt, _params(3, spec))
        c.wait_ended([rid])
    positions, _, hs = c.stacked(rid, "hs")
    end = c.kinds(rid, "end")[0].end
    full = prompt + list(out.outputs[0].token_ids)
    if policy == "recompute":
        assert out.num_cached_tokens == 0
        assert positions[0] == 0 and end.uncaptured_positions == []
    else:
        assert out.num_cached_tokens == 2 * BLOCK
        assert positions[0] == 2 * BLOCK and end.uncaptured_positions == [[0, 2 * BLOCK - 1]]
    assert positions == list(range(positions[0], len(full) - 1))
    ref, _, _, _ = hf_trace(hf_model, full[:-1])
    assert rel_err(hs, ref[[LAYER]][:, positions]).max() < TOL


def test_steered_requests_share_the_cache_only_with_requests_steered_alike(engine, broker_address):
    prompt = _prompt(2 * BLOCK + 5, seed=31)
    steer_a = [{"layer": LAYER, "op": "add", "vector": _vec(1), "scale": 1.0}]
    steer_b = [{"layer": LAYER, "op": "add", "vector": _vec(2), "scale": 1.0}]
    a1 = _run(engine, prompt, _params(2, {"steer": steer_a}))
    a2 = _run(engine, prompt, _params(2, {"steer": steer_a}))
    b = _run(engine, prompt, _params(2, {"steer": steer_b}))
    plain = _run(engine, prompt, _params(2))
    assert a1.num_cached_tokens == 0
    assert a2.num_cached_tokens == 2 * BLOCK  # same steering: same KV, shared
    assert b.num_cached_tokens == 0  # other steering never reads a's KV
    assert plain.num_cached_tokens == 0  # nor does an unsteered request


def _live_steered(engine, broker_address, prompt, rid, steer_after_frames):
    """Generate ``2 * BLOCK - len(prompt) + 8`` tokens capturing generated positions; send a live ``add`` after
    ``steer_after_frames`` frames (None: never). Returns (the output, the ack)."""
    from mia_stream.consumers import open_stream
    from mia_stream.schemas import SteeringCommand

    spec = {"capture": {"hidden_states": {"layers": [LAYER], "positions": "generated"}}, "id": rid}
    result, ack, frames = {}, None, 0
    with open_stream(broker_address, patterns=[rid]) as stream:
        t = threading.Thread(target=lambda: result.setdefault(
            "out", _run(engine, prompt, _params(2 * BLOCK - len(prompt) + 8, spec))))
        t.start()
        for ev in stream:
            if ev.kind == "frame":
                frames += 1
                if frames == steer_after_frames:
                    cmd = SteeringCommand(uuid.uuid4().hex, rid, "add",
                                          [{"layer": LAYER, "op": "add", "vector": _vec(3), "scale": 2.0}])
                    ack = stream.client.send_steering(cmd, 30.0)
            if ev.kind == "end":
                break
        t.join(120)
    return result["out"], ack


def test_a_live_steering_change_keeps_later_kv_from_every_other_request(engine, broker_address):
    """Block 0 (the prompt) is computed before the change, block 1 after it: a request whose prompt is the
    steered request's tokens may reuse block 0 only. Without the change, both blocks."""
    for changed in (False, True):
        prompt = _prompt(BLOCK + 4, seed=40 + changed)
        rid = f"pc-live-{changed}-{uuid.uuid4().hex[:6]}"
        out, ack = _live_steered(engine, broker_address, prompt, rid, 3 if changed else None)
        if changed:
            assert ack is not None and ack.ok, ack
        tokens = prompt + list(out.outputs[0].token_ids)
        assert len(tokens) > 2 * BLOCK
        follower = _run(engine, tokens, _params(1))
        assert follower.num_cached_tokens == (BLOCK if changed else 2 * BLOCK), (changed, follower.num_cached_tokens)
