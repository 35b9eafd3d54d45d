"""The drain's step batches against what the engine computed, without vLLM.

An emulated engine drives the real ``ProducerRuntime`` the way the adapter does (``begin_step``, the in-graph
capture ops on known values, ``end_step``, ``on_sampled``, ``finish_request``); the drain publishes through a
real ``FramePublisher`` over a real ZeroMQ socket to a stub broker that decodes what arrives
(tests/stub_broker.py). Every captured value is a function of (request, position, layer, channel or head), so
each row a request gets is checked against what the engine wrote for it, independently of the drain: right
rows, layers, heads, positions, input token ids, steering versions and parts, every position captured once,
every seq used once. TP=2 runs two ranks and merges their shards.
"""

from __future__ import annotations

import shutil
import tempfile
from collections import defaultdict

import numpy as np
import pytest
import torch

from mia_stream.kernels import ops as _ops  # noqa: F401  (registers torch.ops.mia_stream)
from mia_stream.producer._runtime import ProducerRuntime, RuntimeConfig, StepBatch as EngineStep
from mia_stream.bus.publisher import FramePublisher
from mia_stream.spec import ModelGeometry, parse_spec
from mia_stream.schemas import GapNotice, StepBatch, StreamEnd, StreamStart, TensorFrame, TokenBatch, TokenFrame
from stub_broker import StubBroker

GEO = ModelGeometry(num_layers=3, hidden_size=8, num_heads=4, num_kv_heads=2, head_dim=4)
KINDS = {"hs": 0, "q": 1, "k": 2}


def value(kind: str, req: int, pos: int, layer: int, width: int) -> np.ndarray:
    """What the emulated forward writes for (request, position, layer): exact in float32, unique per row."""
    return (req * 1_000_000 + KINDS[kind] * 300_000 + layer * 10_000 + pos * 100 + np.arange(width)).astype(np.float32)


def token_at(req: int, pos: int) -> int:
    return 1000 * (req + 1) + pos


@pytest.fixture
def run_dir():
    d = tempfile.mkdtemp(prefix="mia-drain-", dir="/tmp")
    yield d
    shutil.rmtree(d, ignore_errors=True)


class Engine:
    """An engine of ``len(runtimes)`` TP ranks: requests are scheduled by ``step``; the "forward" writes
    ``value(...)`` rows through the real capture ops."""

    def __init__(self, runtimes, geo=GEO):
        self.rts, self.geo = runtimes, geo
        self.index: dict[str, int] = {}
        self.prompt: dict[str, int] = {}
        self.k = 0

    def add(self, eid: str, spec: dict, prompt_len: int) -> None:
        self.index[eid] = len(self.index)
        self.prompt[eid] = prompt_len
        for rt in self.rts:
            rt.add_request(eid, f"s-{eid}", parse_spec(spec, self.geo),
                           [token_at(self.index[eid], p) for p in range(prompt_len)])

    def step(self, sched: list[tuple[str, int, int]], sample: bool = True) -> int:
        """One step computing ``n`` tokens from position ``first`` for each ``(eid, first, n)``."""
        self.k += 1
        geo = self.geo
        counts = [n for _, _, n in sched]
        qs = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        rows = [(self.index[e], f + t) for e, f, n in sched for t in range(n)]
        tokens = np.array([token_at(r, p) for r, p in rows], np.int64)
        for rt in self.rts:
            rt.begin_step(EngineStep(step=self.k, req_ids=[e for e, _, _ in sched], query_start=qs,
                                     num_computed=np.array([f for _, f, _ in sched]), num_tokens=len(rows),
                                     token_ids=tokens))
            st = rt.state
            for layer in range(geo.num_layers):
                def rows_of(kind, width, lo=0, hi=None):
                    return torch.from_numpy(np.stack([value(kind, r, p, layer, width)[lo:hi] for r, p in rows]))
                torch.ops.mia_stream.capture(st.hs_aperture, st.hs_route, rows_of("hs", geo.hidden_size),
                                                      None, layer)
                if rt.cfg.capture_qk:
                    qw, kw = rt.local_heads * geo.head_dim, rt.local_kv_heads * geo.head_dim
                    r0 = rt.tp_rank
                    torch.ops.mia_stream.capture(
                        st.q_aperture, st.qk_route, rows_of("q", geo.num_heads * geo.head_dim, r0 * qw, (r0 + 1) * qw),
                        None, layer)
                    torch.ops.mia_stream.capture(
                        st.k_aperture, st.qk_route,
                        rows_of("k", geo.num_kv_heads * geo.head_dim, r0 * kw, (r0 + 1) * kw), None, layer)
            rt.end_step()
            if sample:
                rt.on_sampled(self.k, [e for e, _, _ in sched],
                              [[token_at(self.index[e], f + n)] for e, f, n in sched])
        return self.k


def runtimes(pubs, cfg=None, geo=GEO):
    cfg = cfg or {}
    base = dict(aperture_rows=64, host_ring_bytes=1 << 20, steer_slots=4, max_ops_per_layer=2, capture_qk=True,
                steering=True)
    base.update(cfg)
    return [ProducerRuntime(geo=geo, model_name="toy", tokenizer="toy", dtype=torch.float32,
                            device=torch.device("cpu"), max_tokens=64, tp_rank=r, tp_size=len(pubs), dp_rank=0,
                            publisher=pub, cfg=RuntimeConfig(**base)) for r, pub in enumerate(pubs)]


def per_request(messages, producer_id=None) -> dict[str, list]:
    """Each request's messages in arrival order, columnar ones expanded: (seq, kind, message, index of the
    wire message it came in). What the publisher re-announces to a broker it has not heard from yet (starts
    with ``resent``, copies of ends) is left out."""
    out = defaultdict(list)
    for k, m in enumerate(messages):
        if producer_id is not None and getattr(m, "producer_id", None) != producer_id:
            continue
        if isinstance(m, StepBatch):
            for f in m.frames():
                out[f.request_id].append((f.seq, "frame", f, k))
        elif isinstance(m, TokenBatch):
            for t in m.frames():
                out[t.request_id].append((t.seq, "tokens", t, k))
        elif isinstance(m, TensorFrame):
            out[m.request_id].append((m.seq, "frame", m, k))
        elif isinstance(m, TokenFrame):
            out[m.request_id].append((m.seq, "tokens", m, k))
        elif isinstance(m, GapNotice):
            for a, b in m.missing:
                for s in range(a, b + 1):
                    out[m.request_id].append((s, "gap", m, k))
        elif isinstance(m, StreamStart) and not m.resent:
            out[m.request_id].append((m.seq, m.KIND, m, k))
        elif isinstance(m, StreamEnd) and not any(x[1] == "end" for x in out[m.request_id]):
            out[m.request_id].append((m.seq, m.KIND, m, k))  # (an end re-announced to a new broker: once)
    return out


def ended(messages) -> int:
    """Streams whose end arrived (a re-announced end counts once)."""
    return len({(m.request_id, m.producer_id) for m in messages if isinstance(m, StreamEnd)})


def seqs_exact(msgs: list) -> None:
    """seq 0..end.seq each used once, in order (the two parts of a request in one step batch share one seq);
    a gap notice comes before the request's next message; StreamEnd's counts add up to the seqs."""
    used = [s for s, _ in dict.fromkeys((s, k) for s, _, _, k in msgs)]
    end = msgs[-1][2]
    assert isinstance(end, StreamEnd)
    assert used == list(range(end.seq + 1)), used
    gaps = sum(1 for _, kind, _, _ in msgs if kind == "gap")
    assert end.frames_sent + end.frames_dropped == end.seq + 1, (end.frames_sent, end.frames_dropped, end.seq)
    assert end.frames_dropped == gaps


def check_rows(frame: TensorFrame, req: int, geo=GEO, tp_rank=0, tp_size=1) -> None:
    """Every tensor row is what the engine wrote for that request, position and layer (and head)."""
    for t in frame.tensors:
        name, data = t.name, t.numpy()
        for li, layer in enumerate(t.layers):
            for j, pos in enumerate(frame.positions):
                if name == "hs":
                    want = value("hs", req, pos, layer, geo.hidden_size)
                else:
                    heads = t.meta["heads"]
                    D = geo.head_dim
                    full = value(name, req, pos, layer, (geo.num_heads if name == "q" else geo.num_kv_heads) * D)
                    want = np.concatenate([full[h * D:(h + 1) * D] for h in heads]) if heads else full[:0]
                np.testing.assert_array_equal(data[li, j].reshape(-1), want, err_msg=f"{name} L{layer} p{pos}")


SPECS = {  # request -> (spec, prompt length)
    "a": ({"capture": {"hidden_states": {"layers": [0, 2], "positions": "all"}}}, 5),
    "b": ({"capture": {"hidden_states": {"layers": [1], "positions": "all"}}}, 3),
    "c": ({"capture": {"hidden_states": {"layers": [0, 2], "positions": "all"},
                       "qk": {"layers": [1], "heads": [1, 2], "positions": "all"}}}, 4),
    "d": ({"capture": {"hidden_states": {"layers": "all", "positions": "last_prompt"},
                       "qk": {"layers": [0, 2], "heads": "all", "positions": "generated"}}}, 6),
    "e": ({"capture": {"hidden_states": {"layers": [0, 2], "positions": "all"},
                       "qk": {"layers": [2], "heads": [3], "positions": "last_prompt"}}}, 4),
    "f": ({"capture": {"hidden_states": {"layers": [0, 2], "positions": "all"}}}, 2),
}
DECODE_STEPS = 4


def run_mixed(engine: Engine, steer_at: int | None = None) -> None:
    """Prefill a, b, c in step 1 (c chunked over steps 1-2), d, e, f in step 2 with a, b decoding, then
    decode steps; ``steer_at``: a steering change for "a" taking effect at that step."""
    for eid, (spec, plen) in SPECS.items():
        engine.add(eid, spec, plen)
    length = {e: 0 for e in SPECS}

    def sched(eids, chunk=None):
        out = []
        for e in eids:
            plen = SPECS[e][1]
            n = (chunk or {}).get(e, plen - length[e] if length[e] < plen else 1)
            out.append((e, length[e], n))
        return out

    steps = [sched("abc", chunk={"c": 2})]
    for s in steps[-1]:
        length[s[0]] += s[2]
    plan = [("abcdef", {})] + [("abcdef", {})] * DECODE_STEPS
    engine.step(steps[0], sample=True)
    for eids, _ in plan:
        if steer_at is not None and engine.k + 1 == steer_at:
            ops = parse_spec({"steer": [{"layer": 1, "op": "add", "vector": [0.0] * 8}]}, GEO).steer
            for rt in engine.rts:
                rt.update_steering("a", ops, 1)
        s = sched(eids)
        engine.step(s)
        for e, _, n in s:
            length[e] += n
    for e in SPECS:
        for rt in engine.rts:
            rt.finish_request(e, "length", length[e] + 1)
    return length


def expected_positions(eid: str, kind: str, total: int) -> list[int]:
    spec, plen = SPECS[eid]
    c = spec["capture"].get("hidden_states" if kind == "hs" else "qk")
    if c is None:
        return []
    mode = c["positions"]
    return [p for p in range(total) if mode == "all" or (mode == "generated" and p >= plen)
            or (mode == "prompt" and p < plen) or (mode == "last_prompt" and p == plen - 1)]


def test_each_request_gets_exactly_its_rows_one_batch_per_step(run_dir):
    broker = StubBroker(run_dir)
    pub = FramePublisher(run_dir, producer_id="drain-test")
    try:
        rt, = runtimes([pub])
        engine = Engine([rt])
        length = run_mixed(engine, steer_at=4)
        assert rt.wait_drained(10)
        msgs = broker.wait_for(lambda got: ended(got) == len(SPECS))
        rt.close()
    finally:
        pub.close()
        broker.close()
    assert not broker.malformed
    batches = [m for m in msgs if isinstance(m, StepBatch)]
    # one message per engine step carries every captured request (no per-request tensors/tokens messages)
    assert [b.step for b in batches] == list(range(1, engine.k + 1))
    assert not [m for m in msgs if isinstance(m, (TensorFrame, TokenFrame))]
    assert [b.step for b in msgs if isinstance(b, TokenBatch)] == list(range(1, engine.k + 1))
    decode = batches[-1]
    assert sorted(decode.request_ids) == sorted(f"s-{e}" for e in SPECS)
    # requests captured alike share a group: a and f (hs [0, 2] at all positions) are one group at decode
    hs02 = [g for g in decode.groups if g.has("hs") and g.tensor("hs").layers == (0, 2) and not g.has("q")]
    assert len(hs02) == 1 and sorted(decode.request_ids[i] for i in hs02[0].requests) == ["s-a", "s-e", "s-f"]
    streams = per_request(msgs)
    for eid in SPECS:
        req = engine.index[eid]
        msgs_e = streams[f"s-{eid}"]
        seqs_exact(msgs_e)
        frames = [m for _, kind, m, _ in msgs_e if kind == "frame"]
        total = length[eid]  # positions computed: 0 .. total-1
        got = {"hs": [], "qk": []}
        for f in frames:
            names = {t.name for t in f.tensors}
            check_rows(f, req)
            assert f.token_ids == [token_at(req, p) for p in f.positions]
            if "hs" in names:
                got["hs"] += f.positions
            if "q" in names:
                assert "k" in names
                got["qk"] += f.positions
            # part 1: Q/K at positions of their own, next to the step's hidden states; part 0 otherwise
            same_step = [g for g in frames if g.step == f.step and g is not f]
            if f.part == 1:
                assert names == {"q", "k"}
                assert [g.part for g in same_step] == [0] and same_step[0].positions != f.positions
            elif names == {"q", "k"}:
                assert not same_step  # Q/K alone at this step
            assert f.steering_version == (1 if eid == "a" and f.step >= 4 else 0)
        assert got["hs"] == expected_positions(eid, "hs", total), eid
        assert got["qk"] == expected_positions(eid, "qk", total), eid
        toks = [m for _, kind, m, _ in msgs_e if kind == "tokens"]
        assert [p for t in toks for p in t.positions] == list(range(SPECS[eid][1], SPECS[eid][1] + len(toks)))
        end = msgs_e[-1][2]
        assert end.frames_dropped == 0 and end.drops == {}


def test_tp2_every_rank_names_every_captured_step_and_carries_its_heads(run_dir):
    broker = StubBroker(run_dir)
    pubs = [FramePublisher(run_dir, producer_id=f"drain-tp:{r}") for r in range(2)]
    try:
        rts = runtimes(pubs)
        engine = Engine(rts)
        run_mixed(engine)
        for rt in rts:
            assert rt.wait_drained(10)
        msgs = broker.wait_for(lambda got: ended(got) == 2 * len(SPECS))
        for rt in rts:
            rt.close()
    finally:
        for pub in pubs:
            pub.close()
        broker.close()
    assert not broker.malformed
    ranks = [per_request(msgs, producer_id=f"drain-tp:{r}") for r in range(2)]
    for r in range(2):  # one step batch per step per rank; only rank 0 carries hidden states
        batches = [m for m in msgs if isinstance(m, StepBatch) and m.producer_id == f"drain-tp:{r}"]
        assert [b.step for b in batches] == list(range(1, engine.k + 1))
        assert any(g.has("hs") for b in batches for g in b.groups) == (r == 0)
    for eid, (spec, _) in SPECS.items():
        req = engine.index[eid]
        frames = [[m for _, kind, m, _ in ranks[r][f"s-{eid}"] if kind == "frame"] for r in range(2)]
        for r in range(2):
            seqs_exact(ranks[r][f"s-{eid}"])
        # the same segments on both ranks (what the consumers merge per step)
        assert ([(f.step, f.part, f.positions, f.token_ids) for f in frames[0]]
                == [(f.step, f.part, f.positions, f.token_ids) for f in frames[1]])
        qk = spec["capture"].get("qk")
        heads = list(range(GEO.num_heads)) if qk and qk["heads"] == "all" else (qk or {}).get("heads", [])
        kv = sorted({h // (GEO.num_heads // GEO.num_kv_heads) for h in heads})
        for f0, f1 in zip(*frames):
            check_rows(f0, req)
            check_rows(f1, req)
            t0, t1 = ({t.name: t for t in f.tensors} for f in (f0, f1))
            assert "hs" not in t1
            assert ("hs" in t0) == (f0.part == 0 and f0.positions[0] in expected_positions(eid, "hs", 99))
            for name, wanted in (("q", heads), ("k", kv)):
                if name not in t0:
                    assert name not in t1
                    continue
                shards = sorted((t0[name], t1[name]), key=lambda t: t.shard.tp_rank)
                assert [s.shard.tp_rank for s in shards] == [0, 1]
                assert shards[0].shard.start == 0 and shards[0].shard.stop == shards[1].shard.start
                assert shards[1].shard.stop == shards[1].shard.total == len(wanted)
                assert shards[0].meta["heads"] + shards[1].meta["heads"] == wanted


def _hold_engine(run_dir, **cfg):
    broker = StubBroker(run_dir)
    pub = FramePublisher(run_dir, producer_id="drain-hold")
    rt, = runtimes([pub], cfg={"capture_qk": False, **cfg})
    rt.hold_last_step = True
    return broker, pub, rt, Engine([rt])


def test_async_hold_trims_each_ended_request_past_its_stop_and_keeps_the_others(run_dir):
    broker, pub, rt, engine = _hold_engine(run_dir)
    try:
        spec = {"capture": {"hidden_states": {"layers": "all", "positions": "all"}}}
        for eid in "xyz":
            engine.add(eid, spec, 3)
        engine.step([(e, 0, 3) for e in "xyz"])
        engine.step([(e, 3, 1) for e in "xyz"])
        engine.step([(e, 4, 1) for e in "xyz"])  # y samples its stop token (position 5): 6 tokens in all
        engine.step([(e, 5, 1) for e in "xyz"])  # async scheduling computed y one step past it
        rt.finish_request("y", "stop", num_tokens=6)
        engine.step([(e, 6, 1) for e in "xz"])
        rt.finish_request("x", "length", num_tokens=8)  # its held step (position 6) is valid: published alone
        engine.step([("z", 7, 1)])
        rt.finish_request("z", "length", num_tokens=9)
        assert rt.wait_drained(10)
        msgs = broker.wait_for(lambda got: ended(got) == 3)
        rt.close()
    finally:
        pub.close()
        broker.close()
    streams = per_request(msgs)
    want = {"x": ([0, 1, 2, 3, 4, 5, 6], [3, 4, 5, 6, 7]), "y": ([0, 1, 2, 3, 4], [3, 4, 5]),
            "z": ([0, 1, 2, 3, 4, 5, 6, 7], [3, 4, 5, 6, 7, 8])}
    for eid, (positions, token_positions) in want.items():
        m = streams[f"s-{eid}"]
        seqs_exact(m)
        assert not [k for _, k, _, _ in m if k == "gap"], "trimming must not leave holes in the seqs"
        frames = [f for _, k, f, _ in m if k == "frame"]
        for f in frames:
            check_rows(f, engine.index[eid])
        assert [p for f in frames for p in f.positions] == positions
        assert [p for _, k, t, _ in m if k == "tokens" for p in t.positions] == token_positions
    batches = [b for b in msgs if isinstance(b, StepBatch)]
    # step 4 went out without y (past its stop) and with x and z in one group (y's rows between them)
    step4 = [b for b in batches if b.step == 4]
    assert [b.request_ids for b in step4] == [["s-x", "s-z"]] and len(step4[0].groups) == 1
    # step 5: x's part alone before x's end, z's in the step's batch later
    step5 = [b for b in batches if b.step == 5]
    assert [b.request_ids for b in step5] == [["s-x"], ["s-z"]]
    x_end = next(k for k, m in enumerate(msgs) if isinstance(m, StreamEnd) and m.request_id == "s-x")
    assert msgs.index(step5[0]) < x_end < msgs.index(step5[1])
    y_end = next(m for m in msgs if isinstance(m, StreamEnd) and m.request_id == "s-y")
    assert y_end.num_generated_tokens == 3 and y_end.frames_dropped == 0


def test_engine_drops_are_named_by_seq_and_counted_once_under_hold(run_dir):
    """A frame the engine could not capture (aperture full) gets the seq it would have had, named in a gap
    notice; StreamEnd: frames_sent + frames_dropped = the seqs the stream used (issue 13 item 4)."""
    broker, pub, rt, engine = _hold_engine(run_dir, aperture_rows=4)
    try:
        spec = {"capture": {"hidden_states": {"layers": [1], "positions": "all"}}}
        engine.add("w", spec, 6)
        engine.add("v", spec, 2)
        engine.step([("w", 0, 6), ("v", 0, 2)])  # w's 6 prompt rows exceed the 4-row aperture: dropped
        engine.step([("w", 6, 1), ("v", 2, 1)])
        engine.step([("w", 7, 1), ("v", 3, 1)])
        rt.finish_request("w", "length", num_tokens=9)
        rt.finish_request("v", "length", num_tokens=5)
        assert rt.wait_drained(10)
        msgs = broker.wait_for(lambda got: ended(got) == 2)
        rt.close()
    finally:
        pub.close()
        broker.close()
    streams = per_request(msgs)
    w = streams["s-w"]
    seqs_exact(w)
    gaps = [m for _, k, m, _ in w if k == "gap"]
    assert [(g.reason, g.origin) for g in gaps] == [("aperture_full", "producer")]
    end = w[-1][2]
    assert end.frames_dropped == 1 and end.drops == {"aperture_full": 1}
    assert end.frames_sent == end.seq  # every seq but the dropped frame's was a message sent
    assert [p for _, k, f, _ in w if k == "frame" for p in f.positions] == [6, 7]
    seqs_exact(streams["s-v"])


def test_per_request_mode_publishes_the_same_content_as_the_batches(run_dir, monkeypatch):
    """MIA_STREAM_STEP_BATCHES=0 (kept for comparisons): one TensorFrame per request part and one TokenFrame per
    request, with exactly what the request's segments of the step batches hold."""
    got = {}
    for mode in ("1", "0"):
        monkeypatch.setenv("MIA_STREAM_STEP_BATCHES", mode)
        broker = StubBroker(run_dir)
        pub = FramePublisher(run_dir, producer_id=f"drain-mode-{mode}")
        try:
            rt, = runtimes([pub])
            engine = Engine([rt])
            run_mixed(engine, steer_at=3)
            assert rt.wait_drained(10)
            msgs = broker.wait_for(lambda m: ended(m) == len(SPECS))
            rt.close()
        finally:
            pub.close()
            broker.close()
        kinds = {type(m).__name__ for m in msgs}
        assert ({"TensorFrame", "TokenFrame"} & kinds if mode == "0" else {"StepBatch", "TokenBatch"} & kinds)
        assert not ({"StepBatch", "TokenBatch"} & kinds if mode == "0" else {"TensorFrame", "TokenFrame"} & kinds)
        streams = per_request(msgs)
        for eid in SPECS:
            if mode == "0":
                seqs_exact_per_request = streams[f"s-{eid}"]
                used = [s for s, _, _, _ in seqs_exact_per_request]
                assert used == list(range(len(used)))
        got[mode] = {rid: [(k, m.step, getattr(m, "part", None), m.positions, m.token_ids,
                            getattr(m, "steering_version", None),
                            [(t.name, t.layers, t.shard, t.meta, t.numpy().tolist()) for t in getattr(m, "tensors", [])])
                           for _, k, m, _ in v if k in ("frame", "tokens")] for rid, v in streams.items()}
    assert got["1"] == got["0"]


def test_positions_never_captured_reach_the_end_as_ranges(run_dir):
    """A request first computed from position 3 (its prompt's start served by a cache) cannot have positions
    0-2 captured; its StreamEnd names them as an inclusive range (spec 3.4), which the 2.0 validator
    accepts (the stub broker decodes with it)."""
    broker = StubBroker(run_dir)
    pub = FramePublisher(run_dir, producer_id="drain-uncaptured")
    try:
        rt, = runtimes([pub], cfg={"capture_qk": False})
        engine = Engine([rt])
        engine.add("u", {"capture": {"hidden_states": {"layers": [0], "positions": "all"}},
                         "prefix_cache": "reuse"}, 5)
        engine.step([("u", 3, 2)])
        engine.step([("u", 5, 1)])
        rt.finish_request("u", "length", 7)
        assert rt.wait_drained(10)
        msgs = broker.wait_for(lambda got: ended(got) == 1)
        rt.close()
    finally:
        pub.close()
        broker.close()
    assert not broker.malformed
    m = per_request(msgs)["s-u"]
    seqs_exact(m)
    assert m[-1][2].uncaptured_positions == [[0, 2]]
    assert [p for _, k, f, _ in m if k == "frame" for p in f.positions] == [3, 4, 5]


def test_engine_drops_one_gap_item_covers_get_a_seq_each_before_the_end(run_dir):
    """The engine sends one gap item per request and reason while one still waits for the drain (a stalled
    drain must not be flooded); the end reports every drop. Each drop still holds a seq of its own, named
    before the end: frames_sent + frames_dropped = the seqs the stream used. A reason with no gap item is not
    a frame drop (a steering op the table had no slot for) and holds no seq."""
    from mia_stream.producer._drain import DrainConfig, StepDrain
    from mia_stream.producer._host_ring import HostRing
    from mia_stream.producer._items import End, Gap, Start, Tokens

    broker = StubBroker(run_dir)
    pub = FramePublisher(run_dir, producer_id="drain-covered")
    ring = HostRing.create(1 << 16)
    try:
        drain = StepDrain(DrainConfig(0, 1, 4, 2, 4, 4, 2, "float32", 4), pub, ring)
        drain.handle(Start("e", StreamStart("s-e", "", 0), {"prompt_len": 3}))
        drain.handle(Gap("e", "drain_queue_full", 1))
        drain.handle(Tokens(4, ["e"], [[7]]))
        drain.handle(End("e", "length", 5, {"frames_dropped": 4, "uncaptured": [],
                                                  "drops": {"drain_queue_full": 4, "steer_table_full": 1}}))
        msgs = broker.wait_for(lambda got: ended(got) == 1)
    finally:
        pub.close()
        broker.close()
        ring.close()
    m = per_request(msgs)["s-e"]
    seqs_exact(m)
    end = m[-1][2]
    assert end.frames_dropped == 4 and end.drops == {"drain_queue_full": 4, "steer_table_full": 1}
    assert [k for _, k, _, _ in m] == ["start", "gap", "tokens", "gap", "gap", "gap", "end"]
