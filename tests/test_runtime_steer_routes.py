"""The steering slots the runtime routes to each token row and layer, against a rule written out row by row:
an op applies to a row when its ``positions`` mode covers the row's position (prompt: < prompt length).
Chunked prefill, a chunk that crosses from prompt into generated positions (a preempted request recomputed),
several ops on one layer, and decode steps (the cached path) are covered. No engine: the runtime alone on the
CPU (the engine tests check that routed slots steer like the Hugging Face reference)."""

from __future__ import annotations

import numpy as np
import torch

from mia_stream.producer._runtime import ProducerRuntime, RuntimeConfig, StepBatch
from mia_stream.spec import ModelGeometry, parse_spec

GEO = ModelGeometry(num_layers=4, hidden_size=16, num_heads=4, num_kv_heads=2, head_dim=4)


class _NullPublisher:
    producer_id, epoch = "test", 1

    def next_seq(self, stream_id):
        return 0

    def publish(self, message):
        pass


def _op(layer, positions, seed):
    v = np.random.default_rng(seed).standard_normal(16).astype(np.float32)
    return {"layer": layer, "op": "add", "vector": v, "scale": 0.5, "positions": positions}


SPECS = {
    "a": {"steer": [_op(0, "all", 1), _op(0, "prompt", 2), _op(2, "generated", 3), _op(3, "prompt", 4)]},
    "b": {"steer": [_op(1, "prompt", 5), _op(1, "generated", 6)]},
    "c": {"capture": {"hidden_states": {"layers": [1], "positions": "all"}}},  # no steering
}
PROMPT_LEN = {"a": 6, "b": 4, "c": 3}


def _expected(rt, eid: str, position: int) -> np.ndarray:
    """[layers, ops per layer] slots for one row, from the request's ops one by one."""
    out = np.full((GEO.num_layers, rt.cfg.max_ops_per_layer), -1, np.int32)
    for layer, entries in rt.requests[eid].slots_by_layer.items():
        for m, (slot, op) in enumerate(entries):
            prompt = position < PROMPT_LEN[eid]
            if op.positions == "all" or (op.positions == "prompt") == prompt:
                out[layer, m] = slot
    return out


def _check(rt, rows: list[tuple[str, int]]) -> None:
    routed = rt.state.steer_slots[:, : len(rows)].numpy()
    for r, (eid, pos) in enumerate(rows):
        assert np.array_equal(routed[:, r], _expected(rt, eid, pos)), (r, eid, pos, routed[:, r])
    assert (rt.state.steer_slots[:, len(rows):].numpy() == -1).all()  # padding rows and stale rows: nothing


def _step(rt, step, chunks: list[tuple[str, int, int]]):
    """chunks: (request, first position, token count)."""
    counts = [n for _, _, n in chunks]
    batch = StepBatch(step=step, req_ids=[e for e, _, _ in chunks],
                      query_start=np.concatenate([[0], np.cumsum(counts)]),
                      num_computed=np.array([p for _, p, _ in chunks], np.int64), num_tokens=sum(counts),
                      token_ids=np.zeros(sum(counts), np.int64))
    rt.begin_step(batch)
    rt._step_segments = None  # nothing drains here
    return [(e, p + i) for e, p, n in chunks for i in range(n)]


def test_routed_slots_follow_each_ops_positions_through_prefill_recompute_and_decode():
    rt = ProducerRuntime(geo=GEO, model_name="m", tokenizer="t", dtype=torch.float32, device=torch.device("cpu"),
                         max_tokens=64, tp_rank=0, tp_size=1, dp_rank=0, publisher=_NullPublisher(),
                         cfg=RuntimeConfig(aperture_rows=64, capture_qk=False))
    for eid, raw in SPECS.items():
        rt.add_request(eid, eid, parse_spec(raw, GEO), list(range(PROMPT_LEN[eid])))
    _check(rt, _step(rt, 0, [("a", 0, 4), ("b", 0, 4), ("c", 0, 3)]))  # a's prompt is chunked
    _check(rt, _step(rt, 1, [("a", 4, 2), ("b", 4, 1), ("c", 3, 1)]))  # a's last prompt rows; b, c decode
    for step in range(2, 5):  # steady decode of all three
        _check(rt, _step(rt, step, [("a", 4 + step, 1), ("b", 3 + step, 1), ("c", 2 + step, 1)]))
    # a is preempted and recomputed: one chunk from prompt position 3 into its generated positions
    _check(rt, _step(rt, 5, [("a", 3, 6), ("b", 8, 1)]))
    _check(rt, _step(rt, 6, [("b", 9, 1)]))  # fewer rows than before: a's old rows are cleared


def _table_row(rt, slot):
    st = rt.state
    return st.vectors[slot].numpy(), int(st.op_codes[slot]), float(st.scales[slot]), float(st.thresholds[slot])


def test_slots_are_shared_by_equal_lists_uploaded_by_the_step_and_freed_with_their_last_request():
    """Issue 26: requests with the same steering list share its slots (one lookup per op, one layout); the
    slots the step's new requests placed reach the device table in begin_step's one upload, each holding its op
    as given (the spec's float32 vector, op code, scale); a slot is freed with its last request, and a new list
    placed there is on the device at the next step."""
    from mia_stream.schemas import OP_CODES

    rt = ProducerRuntime(geo=GEO, model_name="m", tokenizer="t", dtype=torch.float32, device=torch.device("cpu"),
                         max_tokens=64, tp_rank=0, tp_size=1, dp_rank=0, publisher=_NullPublisher(),
                         cfg=RuntimeConfig(aperture_rows=64, capture_qk=False))
    shared = SPECS["a"]
    for eid in ("a1", "a2"):
        rt.add_request(eid, eid, parse_spec(shared, GEO), list(range(6)))
    a1, a2 = rt.requests["a1"], rt.requests["a2"]
    assert a1.steer_slots == a2.steer_slots and None not in a1.steer_slots
    assert len(set(a1.steer_slots)) == len(shared["steer"])  # one slot per distinct op
    assert a1.steer_rows is a2.steer_rows  # the layout is made once
    _step(rt, 0, [("a1", 0, 6), ("a2", 0, 6)])
    for raw, slot in zip(shared["steer"], a1.steer_slots):
        vector, code, scale, threshold = _table_row(rt, slot)
        assert np.array_equal(vector, raw["vector"]) and code == OP_CODES[raw["op"]] and scale == raw["scale"]
    placed = set(a1.steer_slots)
    rt.finish_request("a1", "stop", 8)
    assert set(rt.steering._by_key.values()) == placed  # a2 still holds them
    rt.finish_request("a2", "stop", 8)
    assert not rt.steering._by_key  # freed with the last request
    other = {"steer": [_op(layer, "all", 40 + layer) for layer in range(4)]}
    rt.add_request("b1", "b1", parse_spec(other, GEO), list(range(4)))
    reused = rt.requests["b1"].steer_slots
    assert set(reused) & placed  # the freed slots are placed again
    _step(rt, 1, [("b1", 0, 4)])
    for raw, slot in zip(other["steer"], reused):
        assert np.array_equal(_table_row(rt, slot)[0], raw["vector"])
