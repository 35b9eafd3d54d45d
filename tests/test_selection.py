"""Per-subscriber selection (issue 29): a consumer that subscribes with ``select`` gets only the layers,
positions and tensors it chose of each step batch, and the broker copies no tensor byte for it.

The reference is an unselected subscriber of the same live stream of a real vLLM engine: what a selecting
subscriber gets must be exactly that subscriber's frames cut by numpy to the chosen layers and positions.
"""

from __future__ import annotations

import time
import uuid

import numpy as np
import pytest

import spec_decoder
from mia_stream.consumers import open_stream
from mia_stream.errors import MalformedFrameError, SpecError, StreamError
from mia_stream.schemas import RowGroup, StepBatch, Tensor, decode, encode, parse_selection, select_view


def _synthetic_batch() -> StepBatch:
    """Two requests in one group (hs of layers [2, 5, 9], rows at positions 0..4 and 7..8) and a q/k group."""
    rng = np.random.default_rng(0)
    hs = rng.standard_normal((3, 7, 4)).astype(np.float32)
    q = rng.standard_normal((1, 2, 2, 3)).astype(np.float32)
    g0 = RowGroup(np.array([0, 1]), np.array([5, 2]), np.array([0, 1, 2, 3, 4, 7, 8]),
                  [Tensor("hs", "float32", hs.shape, hs, [2, 5, 9])], np.arange(7) + 100, 0)
    g1 = RowGroup(np.array([0, 1]), np.array([1, 1]), np.array([4, 8]),
                  [Tensor("q", "float32", q.shape, q, [5])], np.array([104, 108]), 1)
    return StepBatch(producer_id="p", epoch=1, request_ids=["a", "b"], seqs=np.array([3, 4]), step=9,
                     groups=[g0, g1], steering_versions=np.zeros(2, dtype=np.int64))


def _frames_of(msg) -> dict:
    """(request, part) -> (positions, {name: (layers, array)})."""
    return {(f.request_id, f.part): (list(f.positions), {t.name: (tuple(t.layers), t.numpy()) for t in f.tensors})
            for f in msg.frames()}


def _cut(frames: dict, layers, keep_position, names) -> dict:
    """The numpy reference: each frame (keyed by (request, ...)) cut to ``layers``, the positions ``keep_position(request, p)`` keeps and
    tensors ``names``; frames left with no row or tensor go."""
    out = {}
    for key, (positions, tensors) in frames.items():
        rid = key[0]
        rows = [i for i, p in enumerate(positions) if keep_position(rid, p)]
        kept = {}
        for n, (lay, arr) in tensors.items():
            if names is not None and n not in names:
                continue
            li = [i for i, x in enumerate(lay) if layers is None or x in layers]
            if li and rows:
                kept[n] = (tuple(lay[i] for i in li), arr[li][:, rows])
        if kept:
            out[key] = ([positions[i] for i in rows], kept)
    return out


def _assert_same(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for k in want:
        assert got[k][0] == want[k][0], k
        assert got[k][1].keys() == want[k][1].keys(), k
        for n in want[k][1]:
            assert got[k][1][n][0] == want[k][1][n][0]
            np.testing.assert_array_equal(got[k][1][n][1], want[k][1][n][1])


def test_select_view_rewrites_only_the_header_and_decodes_to_the_chosen_layers_and_positions():
    import msgpack

    frames = encode(_synthetic_batch())
    h = msgpack.unpackb(frames[1], raw=False)
    whole = _frames_of(decode(frames))
    for select, layers, keep, names in [
        ({"layers": [2, 9]}, {2, 9}, lambda r, p: True, None),
        ({"positions": [1, 3, 8]}, None, lambda r, p: p in (1, 3, 8), None),
        ({"positions": "generated", "layers": [5]}, {5}, lambda r, p: p >= {"a": 3, "b": 8}[r], None),
        ({"positions": "last_prompt", "tensors": ["hs"]}, None, lambda r, p: p == {"a": 3, "b": 8}[r] - 1, {"hs"}),
    ]:
        out, nh = select_view(frames, h, parse_selection(select), np.array([3, 8]))
        # no payload byte is copied: every buffer frame sent is one of the original frames, the same object
        assert all(any(b is f for f in frames[2:]) for b in out[2:])
        got = decode(out)
        _assert_same(_frames_of(got), _cut(whole, layers, keep, names))
        # the spec's independent decoder (tests/spec_decoder.py, written from docs/wire-format.md) agrees
        spec = spec_decoder.decode(out)
        assert [[(t.name, tuple(t.layers), t.values.tobytes()) for t in g.tensors] for g in spec.groups] == [
            [(t.name, tuple(t.layers), t.numpy().tobytes()) for t in g.tensors] for g in got.groups]


def test_bad_selections_are_refused_naming_the_key():
    for bad, word in [({"layer": [1]}, "layer"), ({"layers": [-1]}, "layers"), ({"positions": "last"}, "positions"),
                      ({"tensors": "hs"}, "tensors")]:
        with pytest.raises(MalformedFrameError, match=word):
            parse_selection(bad)
    with pytest.raises(SpecError, match="positions"):
        open_stream("/nonexistent-broker-dir-for-test", select={"positions": "middle"})
    with pytest.raises(StreamError, match="recording"):
        open_stream(__file__, select={"layers": [1]})


class _Reader:
    """A live per-request consumer that collects frames and ends until the named requests ended."""

    def __init__(self, address: str, patterns, **options):
        self.stream = open_stream(address, patterns=patterns, timeout=None, **options)
        self.frames: dict = {}
        self.ended: set = set()
        self.gaps: list = []

    def drain(self, rids, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        src = self.stream._source
        while not self.ended >= set(rids):
            assert time.monotonic() < deadline, f"ended {sorted(self.ended)} of {rids}"
            for ev in src.events(timeout=0.5):
                rid = ev.stream.request_id
                if ev.kind == "frame":
                    f = ev.frame
                    self.frames[(rid, f.step, f.part)] = (
                        list(f.positions), {n: (tuple(f.layers[n]), np.array(t)) for n, t in f.tensors.items()})
                elif ev.kind == "end":
                    self.ended.add(rid)
                elif ev.kind == "gap":
                    self.gaps.append(ev)

    def bytes_read(self) -> int:
        return self.stream._source.client._shm.bytes_read

    def close(self):
        self.stream.close()


@pytest.mark.slow
def test_selection_delivers_exactly_the_chosen_layers_and_positions_of_a_real_engine(engine, broker_address):
    """Four consumers read one live capture of a real engine (hidden states of 4 layers at all positions, Q/K
    at the last prompt position; one prompt long enough to be prefilled in two chunks): one unselected, and
    three that select layers, positions (prompt-relative and a set) and tensors. Each selecting consumer's
    frames equal the unselected one's cut to its choice, and it read fewer ring bytes."""
    from vllm import SamplingParams

    tag = uuid.uuid4().hex[:8]
    patterns = [f"sel-{tag}-*"]
    selects = {"gen": {"layers": [3, 15], "positions": "generated", "tensors": ["hs"]},
               "last": {"layers": [15], "positions": "last_prompt"},
               "set": {"positions": [1, 2, 5, 300, 301]}}
    readers = {"all": _Reader(broker_address, patterns, consumer_id=f"sel-all-{tag}")}
    readers.update({k: _Reader(broker_address, patterns, consumer_id=f"sel-{k}-{tag}", select=s)
                    for k, s in selects.items()})
    try:
        time.sleep(1.0)  # subscriptions reach the broker before the engine publishes
        tok = engine.get_tokenizer()
        long_prompt = " ".join(f"word{i}" for i in range(150))  # > 256 tokens: prefilled in two chunks
        prompts = ["The capital of France is", "Write a haiku about the sea:", long_prompt]
        spec = {"capture": {"hidden_states": {"layers": [0, 3, 15, 29], "positions": "all"},
                            "qk": {"layers": [15], "heads": "all", "positions": "last_prompt"}}}
        params = [SamplingParams(max_tokens=6, temperature=0,
                                 extra_args={"mia_stream": {**spec, "id": f"sel-{tag}-{i}"}}) for i in range(3)]
        outs = engine.generate(prompts, params, use_tqdm=False)
        rids = [f"sel-{tag}-{i}" for i in range(3)]
        for r in readers.values():
            r.drain(rids)
    finally:
        for r in readers.values():
            r.close()
    prompt_len = {f"sel-{tag}-{i}": len(o.prompt_token_ids) for i, o in enumerate(outs)}
    assert prompt_len[rids[2]] > 256 and prompt_len[rids[2]] == len(tok(long_prompt).input_ids)
    base = readers["all"]
    assert not any(r.gaps for r in readers.values())
    assert len({k[1] for k in base.frames if k[0] == rids[2] and min(base.frames[k][0]) < prompt_len[rids[2]]}) >= 2
    keeps = {"gen": lambda r, p: p >= prompt_len[r], "last": lambda r, p: p == prompt_len[r] - 1,
             "set": lambda r, p: p in (1, 2, 5, 300, 301)}
    for name, sel in selects.items():
        want = _cut(base.frames, set(sel["layers"]) if "layers" in sel else None, keeps[name],
                    set(sel["tensors"]) if "tensors" in sel else None)
        assert want, name
        _assert_same(readers[name].frames, want)
        assert readers[name].bytes_read() < base.bytes_read() / 2, name
    # what "last" got: layer 15 at the last prompt position of each request, hidden states and Q/K
    assert {(k[0], k[2]) for k in readers["last"].frames} == {(r, p) for r in rids for p in (0, 1)}


def test_selection_through_a_real_broker_for_ring_readers_inline_readers_and_late_joiners():
    """A synthetic engine publishes step batches (hidden states of layers 1 and 3, tensors through its ring) into
    a real broker. Consumers that select layer 3 at a set of positions get the unselected consumer's frames cut
    to that choice: one reading the ring (header rewrite only), one without rings (the broker compacts its
    selection), and one that joins after the run with from_start (the late-join replay)."""
    import shutil
    import tempfile

    from mia_stream.broker import run_broker_in_thread
    from mia_stream.bus.publisher import FramePublisher
    from mia_stream.schemas import StreamEnd

    from test_consumer_batches import Engine, _long_run

    chosen = {"layers": [3], "positions": list(range(0, 400, 3))}
    run = tempfile.mkdtemp(prefix="mia-sel-", dir="/tmp")
    try:
        with run_broker_in_thread(address=run) as broker:
            readers = {"all": _Reader(run, ["*"], consumer_id="all"),
                       "ring": _Reader(run, ["*"], consumer_id="ring", select=chosen),
                       "inline": _Reader(run, ["*"], consumer_id="inline", select=chosen, shm=False)}
            deadline = time.monotonic() + 20
            while len(broker.stats()["consumers"]) < 3:
                assert time.monotonic() < deadline, "consumers did not subscribe"
                time.sleep(0.02)
            pub = FramePublisher(run, producer_id="eng-A")
            try:
                msgs = _long_run(n_requests=6, steps=40, seed=1, engine=Engine("eng-A", epoch=pub.epoch))
                for m in msgs:
                    assert pub.publish(m)
                assert pub.flush(10) and pub.shm_ring is not None
                rids = sorted({m.request_id for m in msgs if isinstance(m, StreamEnd)})
                for r in readers.values():
                    r.drain(rids, timeout=60)
                late = _Reader(run, ["*"], consumer_id="late", select=chosen, from_start=True)
                late.drain(rids, timeout=60)
                readers["late"] = late
                totals = broker.stats()["totals"]
            finally:
                pub.close()
                for r in readers.values():
                    r.close()
    finally:
        shutil.rmtree(run, ignore_errors=True)
    want = _cut(readers["all"].frames, {3}, lambda r, p: p % 3 == 0, None)
    assert want and len(want) < len(readers["all"].frames)
    for name in ("ring", "inline", "late"):
        assert not readers[name].gaps, name
        _assert_same(readers[name].frames, want)
    # the inline reader's selections were compacted (payloads inline) or inlined from the ring
    assert totals["view_selections"] > 0 and totals.get("compacted", 0) + totals.get("shm_inlined", 0) > 0
