"""Closed-loop steering end to end: a consumer watches h·v̂ per generated token on the live stream and, when it
crosses a threshold, ablates the direction or aborts the request through the broker (scripts/closed_loop.py).

Real components only: the session vLLM engine, the session broker, the loop consumer in a thread, and an
independent collector reading the same stream. The direction and threshold come from an unsteered reference
run of the same greedy request: the direction is a mid-generation token's own residual and the threshold
sits just under its score, above every earlier row's, so the live stream crosses it mid-generation.

Bound K on the reaction, in engine steps. The frame of step s is drained after that step's forward while the
engine goes on (the bus never blocks it); a command is taken at the next schedule() after it reaches the
engine-control peer. A round trip (drain, broker, consumer, broker, engine) shorter than the engine core's
output handling lands at step s+1 (measured: +1, ~10 ms from seeing the crossing to the ack), one step
longer at s+2; K = 3 leaves one more step of slack for scheduling jitter on this shared 2-core machine.
"""

from __future__ import annotations

import sys
import threading
import uuid
from pathlib import Path

import numpy as np
import pytest

from producer_helpers import collecting

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from closed_loop import ThresholdSteerer  # noqa: E402

pytestmark = pytest.mark.slow

LAYER = 12
K = 3
N_TOKENS = 32
PROMPT = "Once upon a time, in a small village by the sea, there lived"


def _params(spec, max_tokens=N_TOKENS):
    from vllm import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, extra_args={"mia_stream": spec})


def _spec(rid, positions="generated"):
    return {"capture": {"hidden_states": {"layers": [LAYER], "positions": positions}}, "id": rid}


def _scored_rows(frames, unit):
    """(step, position, score, |h|, steering_version) of every captured row, from a collector's frames."""
    out = []
    for f in frames:
        rows = f.tensors["hs"][list(f.layers["hs"]).index(LAYER)]
        for pos, h in zip(f.positions, rows):
            out.append((f.step, pos, float(h @ unit), float(np.linalg.norm(h)), f.steering_version))
    return out


@pytest.fixture(scope="module")
def reference(engine, broker_address):
    """Direction and threshold from an unsteered run of the same request: the direction is the layer-L residual
    of a mid-generation token c (its own score |h_c| beats every earlier row's h_i·ĥ_c, whose cosine is < 1),
    the threshold lies between the best earlier score and |h_c|, so the live stream crosses first at token c."""
    rid = f"loop-ref-{uuid.uuid4().hex[:6]}"
    with collecting(broker_address, [rid]) as col:
        engine.generate([PROMPT], _params(_spec(rid)), use_tqdm=False)
        col.wait_ended([rid])
    hs = np.concatenate([f.tensors["hs"][0] for f in col.frames(rid)])  # [generated rows, hidden]
    for c in range(6, len(hs) - 10):  # leave room after the crossing for the reaction to show
        unit = hs[c] / np.linalg.norm(hs[c])
        scores = hs[:c + 1] @ unit
        if scores[c] > 1.02 * scores[:c].max():
            return unit.astype(np.float32), float((scores[:c].max() + scores[c]) / 2), c
    pytest.fail("no generated row whose own direction separates it from the rows before it")


def _run_loop(engine, broker_address, reference, action):
    unit, threshold, _ = reference
    rid = f"loop-{action}-{uuid.uuid4().hex[:6]}"
    loop = ThresholdSteerer(unit, LAYER, threshold, action, patterns=[rid])
    from mia_stream.consumers import run_consumer

    runner = threading.Thread(target=run_consumer, args=(loop, broker_address),
                              kwargs={"max_streams": 1, "idle_timeout": 120.0}, daemon=True)
    runner.start()
    with collecting(broker_address, [rid]) as col:  # subscribes, then waits 0.2 s (the loop uses from_start)
        out = engine.generate([PROMPT], _params(_spec(rid)), use_tqdm=False)[0]
        col.wait_ended([rid])
    runner.join(60)
    assert not runner.is_alive(), "the loop consumer did not see the stream end"
    rec = loop.records[rid]
    rows = _scored_rows(col.frames(rid), unit)
    return rid, loop, rec, rows, out, col


def _check_crossing(rec, rows, threshold, prompt_len):
    """The loop acted on the first generated row above the threshold, seen independently in the stream."""
    assert rec.error is None, rec.error
    assert rec.acted and rec.ack.ok, rec.ack
    first = next(r for r in rows if r[1] >= prompt_len and r[2] > threshold)
    assert (rec.crossing.step, rec.crossing.position) == (first[0], first[1])
    assert rec.crossing.position > prompt_len  # mid-generation, not the first generated row
    applied = rec.ack.applied_step
    assert rec.crossing.step < applied <= rec.crossing.step + K, (rec.crossing, applied)
    return applied


def test_loop_ablates_the_direction_within_k_steps_of_the_crossing(engine, broker_address, reference):
    unit, threshold, _ = reference
    rid, loop, rec, rows, out, col = _run_loop(engine, broker_address, reference, "ablate")
    prompt_len = len(out.prompt_token_ids)
    applied = _check_crossing(rec, rows, threshold, prompt_len)
    before = [r for r in rows if r[0] < applied]
    after = [r for r in rows if r[0] >= applied]
    assert before and len(after) >= 4
    assert {r[4] for r in before} == {0} and {r[4] for r in after} == {rec.ack.steering_version} == {1}
    for step, pos, score, norm, _ in after:  # ablated: no component along v̂ from the applied step on
        assert abs(score) < 1e-3 * norm, (step, pos, score, norm)
    assert min(abs(r[2]) for r in before) > 0.1 * threshold  # ... where it was large before
    assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == N_TOKENS
    assert col.kinds(rid, "end")[0].end.finish_reason == "length"
    print(f"\nablate: crossing at step {rec.crossing.step}, applied at step {applied} "
          f"(+{applied - rec.crossing.step}), reaction {(rec.acked_ns - rec.crossing.seen_ns) / 1e6:.1f} ms")


def test_loop_aborts_the_request_within_k_steps_of_the_crossing(engine, broker_address, reference):
    unit, threshold, _ = reference
    rid, loop, rec, rows, out, col = _run_loop(engine, broker_address, reference, "abort")
    prompt_len = len(out.prompt_token_ids)
    applied = _check_crossing(rec, rows, threshold, prompt_len)
    assert out.outputs[0].finish_reason == "abort"
    end = col.kinds(rid, "end")[0].end
    assert end.finish_reason == "abort" and rec.finish_reason == "abort"
    last_step = max(r[0] for r in rows)
    assert last_step <= applied <= rec.crossing.step + K  # nothing computed for it after the abort step
    # row p (computed at step s) chose token p+1; one more token per step until the abort step
    generated_at_crossing = rec.crossing.position - prompt_len + 1
    n = len(out.outputs[0].token_ids)
    assert generated_at_crossing < n <= generated_at_crossing + K and n < N_TOKENS
    assert end.num_generated_tokens == n
    print(f"\nabort: crossing at step {rec.crossing.step}, applied at step {applied}, last frame step {last_step}, "
          f"{n} of {N_TOKENS} tokens")
