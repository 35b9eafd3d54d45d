"""The consumer SDK on columnar messages (schema 2.0): per-request events from StepBatch / TokenBatch /
AnalysisBatch exactly as from per-request frames, the batch API (``open_batches``, ``Consumer.on_batch``),
ordering and gaps with injected time, TP merge, ring losses in the live client, and recordings of batches
(MCAP files on disk: producer channels, the request index, replay equal to live)."""

from __future__ import annotations

import hashlib
import shutil
import struct

import numpy as np
import pytest

from mia_stream.consumers import (Consumer, StreamAssembler, open_batches, open_stream, run_consumer,
                                  subset_batch)
from mia_stream.consumers import recording as recording_module
from mia_stream.bus.client import BrokerClient
from mia_stream.consumers.recorder import Recorder
from mia_stream.consumers.recording import INDEX_ATTACHMENT, Recording, iter_recording
from mia_stream.consumers.replay import replay
from mia_stream.errors import IncompleteShardError
from mia_stream.schemas import (AnalysisBatch, GapBatch, GapNotice, RowGroup, Shard, StepBatch, StreamEnd,
                                StreamStart, Tensor, TensorFrame, TokenBatch, TokenFrame, decode, encode,
                                select_requests, shm_extent)
from mia_stream.bus.shm_ring import ShmRingReader, ShmRingWriter
from mia_stream.schemas._codec import decode_header

H = 16  # hidden size of the synthetic model
HEADS, HEAD_DIM = 4, 8


# ---------------------------------------------------------------------------------------------- a synthetic engine

class Engine:
    """A producer of columnar messages: requests join and leave, each step one StepBatch (hidden states of
    every running request at layers {1, 3}, one request also at layer {0} in a second group, Q/K of some
    requests at their own positions as part 1) and one TokenBatch. Seqs per request as the spec says."""

    def __init__(self, producer_id: str = "eng-tp0", epoch: int = 7, seed: int = 0, tp: tuple = (0, 1)):
        self.pid, self.epoch, self.rng = producer_id, epoch, np.random.default_rng(seed)
        self.tp_rank, self.tp_size = tp
        self.seq: dict[str, int] = {}
        self.pos: dict[str, int] = {}
        self.version: dict[str, int] = {}

    def start(self, rid: str, prompt: int = 3) -> StreamStart:
        self.seq[rid], self.pos[rid], self.version[rid] = 1, prompt, 0
        return StreamStart(rid, self.pid, self.epoch, tp_rank=self.tp_rank, tp_size=self.tp_size, hidden_size=H,
                           num_layers=4, prompt_token_ids=list(range(prompt)))

    def _next(self, rid: str) -> int:
        s = self.seq[rid]
        self.seq[rid] = s + 1
        return s

    def step(self, step: int, rids: list[str], *, odd: str | None = None, qk: tuple = (),
             silent: tuple = (), bf16: bool = False) -> list:
        """The StepBatch and TokenBatch of one step. ``odd``: a request captured at layer 0 only (its own
        group); ``qk``: requests with Q/K at positions of their own (part 1); ``silent``: named without rows."""
        seqs = [self._next(r) for r in rids]
        index = {r: i for i, r in enumerate(rids)}
        main = [r for r in rids if r != odd and r not in silent] if not self.tp_rank else []  # rank > 0: no hs
        groups = []
        for members, layers in ((main, (1, 3)), ([odd] if odd in index else [], (0,))):
            if not members:
                continue
            rows = [1 + (step + index[r]) % 2 for r in members]  # 1 or 2 rows each
            n = sum(rows)
            positions = np.concatenate([np.arange(self.pos[r], self.pos[r] + k) for r, k in zip(members, rows)])
            data = self.rng.standard_normal((len(layers), n, H)).astype(np.float32)
            if bf16:
                bits = np.ascontiguousarray((data.view(np.uint32) >> 16).astype(np.uint16))
                t = Tensor("hs", "bfloat16", bits.shape, memoryview(bits).cast("B"), layers)
            else:
                t = Tensor.from_array("hs", data, layers=layers)
            groups.append(RowGroup([index[r] for r in members], rows, positions, [t], positions * 10 + 1))
        if qk:
            members = [r for r in qk if r in index]
            q = self.rng.standard_normal((1, len(members), HEADS // self.tp_size, HEAD_DIM)).astype(np.float32)
            k = self.rng.standard_normal((1, len(members), HEADS // self.tp_size, HEAD_DIM)).astype(np.float32)
            shard = None
            if self.tp_size > 1:
                per = HEADS // self.tp_size
                shard = Shard(self.tp_rank, self.tp_size, 2, self.tp_rank * per, (self.tp_rank + 1) * per, HEADS)
            positions = [self.pos[r] + 5 for r in members]
            groups.append(RowGroup([index[r] for r in members], [1] * len(members), positions,
                                   [Tensor.from_array("q", q, layers=[2], shard=shard),
                                    Tensor.from_array("k", k, layers=[2], shard=shard)], part=1))
        for r in rids:
            self.pos[r] += 2
        versions = [self.version[r] for r in rids]
        batch = StepBatch(self.pid, self.epoch, step, list(rids), seqs, groups, versions, time_ns=1000 + step)
        if self.tp_rank:
            return [batch]
        tseqs = [self._next(r) for r in rids]
        tokens = TokenBatch(self.pid, self.epoch, step, list(rids), tseqs, [1] * len(rids),
                            [100 * step + i for i in range(len(rids))], [self.pos[r] for r in rids],
                            [None] * len(rids), time_ns=2000 + step)
        return [batch, tokens]

    def end(self, rid: str, reason: str = "length") -> StreamEnd:
        return StreamEnd(rid, self.pid, self.epoch, self.seq[rid], finish_reason=reason)


def _run(engine: Engine | None = None, n_steps: int = 6) -> list:
    """A short serving run: a, b, c, d join at different steps, b leaves early, d is named silently once."""
    e = engine or Engine()
    out = [e.start("a"), e.start("b")]
    running = ["a", "b"]
    for step in range(n_steps):
        if step == 1:
            out.append(e.start("c"))
            running.append("c")
        if step == 2:
            out.append(e.start("d"))
            running.append("d")
        if step == 3:
            out.append(e.end("b"))
            running.remove("b")
        out += e.step(step, list(running), odd="c", qk=("a", "d"), silent=("d",) if step == 4 else ())
    for r in running:
        out.append(e.end(r))
    return out


def _wire(msgs: list) -> list:
    """Through the codec, as a consumer receives them."""
    return [decode([bytes(f) for f in encode(m)]) for m in msgs]


def _digest_frame(f) -> tuple:
    """A request step as a consumer sees it (tensor values hashed)."""
    tensors = tuple(sorted((n, t.dtype, tuple(t.shape), t.layers, hashlib.sha1(np.ascontiguousarray(t.raw())).hexdigest())
                           for n, t in f.raw_tensors.items()))
    return (f.request_id, f.step, f.part, tuple(f.positions), tuple(f.token_ids), f.steering_version, tensors)


def _digest(ev) -> tuple:
    """An event, comparable across assemblers."""
    rid = ev.stream.request_id if ev.stream is not None else None
    if ev.kind == "frame":
        return ("frame", *_digest_frame(ev.frame))
    if ev.kind == "tokens":
        t = ev.tokens
        return ("tokens", rid, t.seq, t.step, tuple(t.token_ids), tuple(t.positions), t.finish_reason)
    if ev.kind == "gap":
        return ("gap", rid, ev.gap.producer_id, tuple(map(tuple, ev.gap.missing)), ev.gap.reason, ev.gap.origin)
    if ev.kind == "end":
        return ("end", rid, ev.end.seq, ev.end.finish_reason)
    if ev.kind == "start":
        return ("start", rid)
    if ev.kind == "analysis":
        a = ev.analysis
        return ("analysis", rid, a.producer_id, a.seq, a.step, tuple(a.positions),
                tuple((k, v.tobytes()) for k, v in sorted(a.values.items())), tuple(a.alerts))
    if ev.kind == "batch":
        return ("batch", *_digest_batch(ev.batch))
    raise AssertionError(ev.kind)


def _digest_batch(b) -> tuple:
    if isinstance(b, StepBatch):
        return ("step", b.producer_id, b.step, tuple(b.request_ids), tuple(b.seqs.tolist()),
                tuple(sorted(_digest_frame_tf(f) for f in b.frames())))
    if isinstance(b, TokenBatch):
        return ("tokens", b.producer_id, b.step, tuple(b.request_ids), tuple(b.seqs.tolist()),
                tuple(f.token_ids[0] if f.token_ids else None for f in b.frames()))
    return ("analysis", b.producer_id, tuple(b.request_ids), tuple(b.seqs.tolist()))


def _digest_frame_tf(f: TensorFrame) -> tuple:
    tensors = tuple(sorted((t.name, t.dtype, tuple(t.shape), tuple(t.layers),
                            hashlib.sha1(np.ascontiguousarray(t.raw())).hexdigest()) for t in f.tensors))
    return (f.request_id, f.step, f.part, tuple(f.positions), tuple(f.token_ids), f.steering_version, tensors)


def _feed(asm: StreamAssembler, msgs: list, finish: bool = True) -> list:
    out = []
    for m in msgs:
        out += asm.feed(m, now=0.0)
    return out + (asm.finish() if finish else [])


# ---------------------------------------------------------------------------------------------- per-request events

def test_batches_give_each_request_the_events_its_own_frames_would():
    """Each request's events from StepBatch/TokenBatch equal what StepBatch.segment / TokenBatch.frames (the
    schema's own per-request cut) hold, in each request's seq order; a request named without rows uses its
    seq for nothing; two parts of one step are two frames of one seq."""
    msgs = _wire(_run())
    events = _feed(StreamAssembler(), msgs)
    expected: dict[str, list] = {}
    for m in msgs:
        if isinstance(m, StepBatch):
            for rid in m.request_ids:
                expected.setdefault(rid, []).extend(("frame", *_digest_frame_tf(f)) for f in m.segment(rid))
        elif isinstance(m, TokenBatch):
            for f in m.frames():
                expected.setdefault(f.request_id, []).append(
                    ("tokens", f.request_id, f.seq, f.step, tuple(f.token_ids), tuple(f.positions), None))
        elif isinstance(m, StreamStart):
            expected.setdefault(m.request_id, []).append(("start", m.request_id))
        elif isinstance(m, StreamEnd):
            expected.setdefault(m.request_id, []).append(("end", m.request_id, m.seq, m.finish_reason))
    got: dict[str, list] = {}
    for ev in events:
        got.setdefault(ev.stream.request_id, []).append(_digest(ev))
    assert got == expected
    parts = [(ev.frame.step, ev.frame.part) for ev in events if ev.kind == "frame" and ev.stream.request_id == "a"]
    assert parts == [(s, p) for s in range(6) for p in (0, 1)]  # hidden states and Q/K of every step
    d_steps = [ev.frame.step for ev in events if ev.kind == "frame" and ev.stream.request_id == "d" and ev.frame.part == 0]
    assert d_steps == [2, 3, 5]  # step 4 named d without rows
    assert all(ev.kind != "gap" for ev in events)  # the seq d used at step 4 is no hole
    assert [ev.stream.generated_token_ids for ev in events if ev.kind == "end" and ev.stream.request_id == "b"] == [[1, 101, 201]]


def test_a_request_frame_is_a_zero_copy_view_of_the_batch():
    e = Engine()
    msgs = _wire([e.start("a"), e.start("b"), *e.step(0, ["a", "b"])])
    batch = msgs[2]
    frames = [ev.frame for ev in _feed(StreamAssembler(), msgs) if ev.kind == "frame"]
    hs = batch.groups[0].tensor("hs").raw()
    for f in frames:
        assert np.shares_memory(f.raw_tensors["hs"].raw(), hs)
        assert f.tensors["hs"].shape[1] == len(f.positions)
    a_rows = batch.groups[0].rows[0]
    np.testing.assert_array_equal(frames[0].tensors["hs"], hs[:, :a_rows])
    np.testing.assert_array_equal(frames[1].tensors["hs"], hs[:, a_rows:])


def test_bf16_batches_widen_exactly():
    e = Engine()
    msgs = _wire([e.start("a"), *e.step(0, ["a"], bf16=True)])
    (f,) = [ev.frame for ev in _feed(StreamAssembler(), msgs) if ev.kind == "frame"]
    bits = msgs[1].groups[0].tensor("hs").raw()
    assert f.raw_tensors["hs"].dtype == "bfloat16"
    np.testing.assert_array_equal(f.tensors["hs"].view(np.uint32), bits.astype(np.uint32) << 16)


def test_order_holes_and_duplicates_of_batches_with_injected_time():
    """A request's seq hole in a batch holds its share (only its) until a GapNotice explains the hole or the
    reorder timeout passes (injected time); a repeated batch delivers nothing twice; after the end, nothing."""
    e = Engine()
    sa, sb = e.start("a"), e.start("b")
    step0 = e.step(0, ["a", "b"])
    e.seq["a"] += 1  # seq 3 of a is lost on the way (b keeps going)
    step1 = e.step(1, ["a", "b"])
    msgs = _wire([sa, sb, *step0, *step1])
    asm = StreamAssembler(reorder_timeout_s=0.5)
    out = []
    for m in msgs:
        out += asm.feed(m, now=10.0)
    a_frames = [ev.frame.step for ev in out if ev.kind == "frame" and ev.stream.request_id == "a" and ev.frame.part == 0]
    b_frames = [ev.frame.step for ev in out if ev.kind == "frame" and ev.stream.request_id == "b" and ev.frame.part == 0]
    assert a_frames == [0] and b_frames == [0, 1] and asm.holding
    assert asm.flush(now=10.4) == []  # not yet 0.5 s
    late = asm.flush(now=10.5)
    assert [_digest(ev)[:5] for ev in late if ev.kind == "gap"] == [("gap", "a", "eng-tp0", ((3, 3),), "seq_jump")]
    assert [ev.frame.step for ev in late if ev.kind == "frame" and ev.frame.part == 0] == [1]
    assert not asm.holding  # released: nothing waits for time any more
    assert asm.feed(msgs[2], now=11.0) == [] and asm.feed(msgs[3], now=11.0) == []  # duplicates
    # a GapNotice that comes in time releases the held share at once, without a seq_jump
    e2 = Engine(producer_id="p2")
    s2 = e2.start("x")
    first = e2.step(0, ["x"])
    e2.seq["x"] += 1
    second = e2.step(1, ["x"])
    asm2 = StreamAssembler()
    evs = _feed(asm2, _wire([s2, *first, second[0]]), finish=False)
    assert [ev.frame.step for ev in evs if ev.kind == "frame" and ev.frame.part == 0] == [0]
    evs = asm2.feed(GapNotice("x", "p2", 7, [[3, 3]], "slow_consumer", "broker"), now=0.0)
    assert [ev.kind for ev in evs] == ["gap", "frame"] and evs[0].gap.origin == "broker"
    assert not asm2.holding
    ended = _feed(asm2, _wire([second[1], e2.end("x")]), finish=False)
    assert [ev.kind for ev in ended] == ["tokens", "end"]
    assert asm2.feed(_wire(e2.step(2, ["x"]))[0], now=0.0) == [] and asm2.counters["after_end"] == 1


def test_sequencer_timer_uses_the_injected_clock():
    """Issue 13 item 11: a message held behind a hole is released ``reorder_timeout_s`` after it arrived on
    the caller's clock (the timer was stamped with the real monotonic clock, so injected times never fired)."""
    asm = StreamAssembler(reorder_timeout_s=0.2)
    asm.feed(StreamStart("r", "p", 1), now=1.0)
    asm.feed(TokenFrame("r", "p", 1, 2, 0, [5]), now=1.0)  # seq 1 missing
    asm.feed(TokenFrame("r", "p", 1, 4, 1, [6]), now=1.05)  # seq 3 missing too: _release runs again, holding
    assert asm.holding and asm.flush(now=1.1) == [] and asm.holding
    events = asm.flush(now=1.3)
    assert [(ev.kind, ev.gap.missing if ev.gap else ev.tokens.seq) for ev in events] == [
        ("gap", [[1, 1]]), ("tokens", 2), ("gap", [[3, 3]]), ("tokens", 4)]
    assert not asm.holding


def test_tp_ranks_batches_merge_per_request_step():
    """Two TP ranks, each a producer of its own StepBatches (rank 1: Q/K shards only): every request step of
    Q/K is merged along the heads; a step whose rank-1 batch is lost is incomplete, never half merged."""
    r0, r1 = Engine("rank0", seed=1, tp=(0, 2)), Engine("rank1", seed=2, tp=(1, 2))
    msgs = [r0.start("a"), r1.start("a"), r0.start("b"), r1.start("b")]
    rank1 = []
    for step in range(3):
        msgs += r0.step(step, ["a", "b"], qk=("a", "b"))
        rank1.append(r1.step(step, ["a", "b"], qk=("a", "b"))[0])
    lost = rank1.pop(1)
    msgs += rank1 + [r0.end("a"), r1.end("a"), r0.end("b"), r1.end("b")]
    msgs = _wire(msgs)
    events = _feed(StreamAssembler(), msgs)
    merged = [ev.frame for ev in events if ev.kind == "frame" and ev.frame.part == 1]
    assert sorted((f.request_id, f.step) for f in merged) == [("a", 0), ("a", 2), ("b", 0), ("b", 2)]
    incomplete = [ev for ev in events if ev.kind == "gap" and ev.gap.reason == "incomplete_shards"]
    holes = [ev for ev in events if ev.kind == "gap" and ev.gap.reason == "seq_jump"]
    assert sorted((ev.stream.request_id, ev.gap.producer_id, tuple(map(tuple, ev.gap.missing))) for ev in holes) == [
        ("a", "rank1", ((2, 2),)), ("b", "rank1", ((2, 2),))]  # rank 1's lost batch: one seq of each request
    # both parts of step 1 (rank 1's lost batch may have held shards of either)
    assert sorted((ev.stream.request_id, ev.error.step) for ev in incomplete) == [("a", 1), ("a", 1), ("b", 1), ("b", 1)]
    # rank 1 names the requests without hidden states: part 0 merges from rank 0's alone
    assert sorted((ev.frame.request_id, ev.frame.step) for ev in events if ev.kind == "frame" and ev.frame.part == 0) == [
        ("a", 0), ("a", 2), ("b", 0), ("b", 2)]
    assert all(isinstance(ev.error, IncompleteShardError) and ev.gap.reason == "incomplete_shards" for ev in incomplete)
    by_step = {m.step: m for m in msgs if isinstance(m, StepBatch) and m.producer_id == "rank0"}
    r1_by_step = {m.step: m for m in msgs if isinstance(m, StepBatch) and m.producer_id == "rank1"}
    for f in merged:
        q0 = by_step[f.step].segment(f.request_id)[1].tensor("q").numpy()
        q1 = r1_by_step[f.step].segment(f.request_id)[0].tensor("q").numpy()
        np.testing.assert_array_equal(f.tensors["q"], np.concatenate([q0, q1], axis=2))
        assert f.raw_tensors["q"].shard is None and len(f.rank_frames) == 2
    assert lost.step == 1


def _analysis(pid: str, seqs: dict, rids: list, step: int, epoch: int = 3) -> AnalysisBatch:
    rows = [1 + i % 2 for i in range(len(rids))]
    n = sum(rows)
    return AnalysisBatch(pid, epoch, "norms", list(rids), [seqs[r] for r in rids], rows, list(range(n)),
                         {"norm": np.arange(n, dtype=np.float32) + step, "bucket": np.arange(n, dtype=np.int32)},
                         {"label": [f"s{step}r{j}" for j in range(n)]}, [j % 2 for j in range(n)], step,
                         "1.0", 5000 + step, 4000 + step)


def test_analysis_results_are_per_request_events_in_seq_order_even_after_the_end():
    e = Engine()
    sa = e.start("a")
    step0 = e.step(0, ["a"])
    a0 = _analysis("an", {"a": 5, "z": 9}, ["a", "z"], 0)  # an analysis stream starts at the first seq seen
    a2 = _analysis("an", {"a": 7}, ["a"], 2)
    a1 = _analysis("an", {"a": 6}, ["a"], 1)
    msgs = _wire([sa, *step0, a0, a2, e.end("a"), a1])
    asm = StreamAssembler()
    events = _feed(asm, msgs, finish=False)
    kinds = [(ev.kind, ev.stream.request_id, ev.analysis.seq if ev.analysis else None) for ev in events]
    assert kinds == [("start", "a", None), ("frame", "a", None), ("tokens", "a", None), ("analysis", "a", 5),
                     ("analysis", "z", 9), ("end", "a", None), ("analysis", "a", 6), ("analysis", "a", 7)]
    last = events[-1].analysis
    assert last.step == 2 and last.analyzer == "norms" and last.source_time_ns == 4002
    np.testing.assert_array_equal(last.value("norm"), np.array([2.0], np.float32))
    assert events[-1].stream is events[0].stream  # the request's stream, though it ended
    # a hole in an analysis stream: its own GapNotice, and the rest delivered
    a4 = _wire([_analysis("an", {"a": 9}, ["a"], 4)])[0]
    assert asm.feed(a4, now=0.0) == [] and asm.holding
    evs = asm.feed(GapNotice("a", "an", 3, [[8, 8]], "slow_consumer", "broker"), now=0.0)
    assert [(ev.kind, ev.gap.missing if ev.gap else ev.analysis.seq) for ev in evs] == [("gap", [[8, 8]]), ("analysis", 9)]
    assert not asm.holding
    a6 = _wire([_analysis("an", {"a": 11}, ["a"], 6)])[0]  # seq 10 never comes: reported after the timeout
    assert asm.feed(a6, now=5.0) == [] and asm.flush(now=5.1) == []
    evs = asm.flush(now=5.2)
    assert [(ev.kind, ev.gap.missing if ev.gap else ev.analysis.seq) for ev in evs] == [("gap", [[10, 10]]), ("analysis", 11)]
    assert evs[0].gap.reason == "seq_jump" and evs[0].gap.producer_id == "an" and not asm.holding

    class Collect(Consumer):
        def __init__(self):
            self.got = []

        def on_analysis(self, stream, analysis):
            self.got.append((stream.request_id, analysis.seq, analysis.labels["label"]))

    from mia_stream.consumers import dispatch

    c = Collect()
    for ev in _feed(StreamAssembler(), msgs):
        dispatch(c, ev)
    assert c.got == [("a", 5, ["s0r0"]), ("z", 9, ["s0r1", "s0r2"]), ("a", 6, ["s1r0"]), ("a", 7, ["s2r0"])]


# ---------------------------------------------------------------------------------------------- batch mode

def test_batch_mode_delivers_each_columnar_message_once_with_per_request_starts_gaps_and_ends():
    msgs = _wire(_run())
    events = _feed(StreamAssembler(batches=True), msgs)
    batches = [ev.batch for ev in events if ev.kind == "batch"]
    assert [_digest_batch(b) for b in batches] == [_digest_batch(m) for m in msgs
                                                   if isinstance(m, (StepBatch, TokenBatch))]
    assert all(b is m for b, m in zip(batches, [m for m in msgs if isinstance(m, (StepBatch, TokenBatch))]))
    per_request = [(ev.kind, ev.stream.request_id) for ev in events if ev.kind != "batch"]
    assert per_request == [(m.KIND, m.request_id) for m in msgs if isinstance(m, (StreamStart, StreamEnd))]
    ends = {ev.stream.request_id: ev.stream.generated_token_ids for ev in events if ev.kind == "end"}
    assert ends["b"] == [1, 101, 201] and len(ends["a"]) == 6


def test_batch_mode_reports_holes_at_once_and_cuts_duplicates_out():
    e = Engine()
    sa, sb = e.start("a"), e.start("b")
    step0 = e.step(0, ["a", "b"])
    e.seq["a"] += 1  # a's seq 3 lost, no notice
    step1 = e.step(1, ["a", "b"])
    end_b = e.end("b")
    msgs = _wire([sa, sb, *step0, *step1])
    asm = StreamAssembler(batches=True)
    events = _feed(asm, msgs[:4], finish=False)
    ev = asm.feed(msgs[4], now=0.0)  # step 1's StepBatch: a jumped from 3 to 4
    assert [(x.kind, x.stream.request_id if x.stream else None) for x in ev] == [("gap", "a"), ("batch", None)]
    assert ev[0].gap.missing == [[3, 3]] and ev[0].gap.reason == "seq_jump" and ev[0].gap.origin == "consumer"
    assert ev[1].batch is msgs[4]
    # b's end arrives before b's tokens of step 1: held, then released right after the batch that precedes it
    assert asm.feed(_wire([end_b])[0], now=0.0) == []
    ev = asm.feed(msgs[5], now=0.0)
    assert [x.kind for x in ev] == ["batch", "end"] and ev[1].stream.request_id == "b"
    # a replayed StepBatch after a re-subscription: a already has it, c is new -> only c stays in it
    sc = e.start("c")
    dup = StepBatch(e.pid, e.epoch, 1, ["a", "c"], [msgs[4].seqs[0], 1],
                    [RowGroup([0, 1], [1, 1], [9, 9], [Tensor.from_array("hs", np.arange(2 * H, dtype=np.float32)
                                                                          .reshape(1, 2, H), layers=[1])])])
    asm.feed(_wire([sc])[0], now=0.0)
    (ev,) = asm.feed(_wire([dup])[0], now=0.0)
    assert ev.batch.request_ids == ["c"] and ev.batch.seqs.tolist() == [1]
    np.testing.assert_array_equal(ev.batch.tensor("hs"), np.arange(H, 2 * H, dtype=np.float32).reshape(1, 1, H))
    assert asm.counters["batch_duplicates"] == 1


def test_batch_mode_turns_per_request_frames_into_one_request_batches():
    hs = np.arange(2 * 3 * H, dtype=np.float32).reshape(2, 3, H)
    msgs = [StreamStart("r", "p", 1), TensorFrame("r", "p", 1, 1, 5, [4, 5, 6], [7, 8, 9],
                                                  [Tensor.from_array("hs", hs, layers=[0, 2])], 3),
            TokenFrame("r", "p", 1, 2, 5, [42], [7]), StreamEnd("r", "p", 1, 3)]
    events = _feed(StreamAssembler(batches=True), _wire(msgs))
    assert [ev.kind for ev in events] == ["start", "batch", "batch", "end"]
    step, tokens = events[1].batch, events[2].batch
    assert step.request_ids == ["r"] and step.seqs.tolist() == [1] and step.steering_versions.tolist() == [3]
    np.testing.assert_array_equal(step.tensor("hs"), hs)
    assert step.positions.tolist() == [4, 5, 6] and step.segment("r")[0].token_ids == [7, 8, 9]
    assert tokens.frames()[0].token_ids == [42] and tokens.frames()[0].positions == [7]
    assert events[3].stream.generated_token_ids == [42]


def test_subset_batch_keeps_the_named_requests_rows():
    msgs = _wire(_run())
    for m in msgs:
        if not isinstance(m, (StepBatch, TokenBatch)) or len(m.request_ids) < 3:
            continue
        keep = [0, 2]
        sub = subset_batch(m, keep)
        assert sub.request_ids == [m.request_ids[i] for i in keep]
        if isinstance(m, StepBatch):
            for rid in sub.request_ids:
                assert [_digest_frame_tf(f) for f in sub.segment(rid)] == [_digest_frame_tf(f) for f in m.segment(rid)]
        else:
            assert [f.token_ids for f in sub.frames()] == [m.frames()[i].token_ids for i in keep]
    a = _analysis("an", {"a": 1, "b": 2, "c": 3}, ["a", "b", "c"], 0)
    sub = subset_batch(a, [1])
    (res,) = sub.results()
    assert res.request_id == "b" and res.labels["label"] == a.results()[1].labels["label"]
    np.testing.assert_array_equal(res.value("norm"), a.results()[1].value("norm"))


def test_on_batch_consumer_is_fed_batches_and_per_request_lifecycle(tmp_path):
    msgs = _run()
    with Recorder(tmp_path / "rec") as rec:
        for m in msgs:
            rec.write([bytes(f) for f in encode(m)])

    class Vectorized(Consumer):
        def __init__(self):
            self.seen, self.frames = [], 0

        def on_batch(self, batch):
            self.seen.append((batch.KIND, batch.step, tuple(batch.request_ids)))

        def on_frame(self, stream, frame):
            self.frames += 1

        def on_start(self, stream):
            self.seen.append(("start", stream.request_id))

        def on_end(self, stream, end):
            self.seen.append(("end", stream.request_id))

    c = Vectorized()
    assert run_consumer(c, str(tmp_path / "rec")) == 4
    want = []
    for m in msgs:
        if isinstance(m, (StepBatch, TokenBatch)):
            want.append((m.KIND, m.step, tuple(m.request_ids)))
        else:
            want.append((m.KIND, m.request_id))
    assert c.seen == want and c.frames == 0
    c2 = Vectorized()
    replay(tmp_path / "rec", into=c2)
    assert c2.seen == want
    with open_batches(str(tmp_path / "rec")) as events:
        assert [ev.kind for ev in events] == [w[0] if w[0] in ("start", "end") else "batch" for w in want]


# ---------------------------------------------------------------------------------------------- the live client

def test_a_lost_ring_batch_becomes_one_gap_batch_naming_every_request_credited_once(tmp_path):
    """A StepBatch whose tensors the ring overwrote before the consumer read them: the BrokerClient hands on
    one consumer GapBatch naming each request it named (its seq, reason shm_overrun) and credits its weight once."""
    ring = ShmRingWriter(size=1 << 20, min_bytes=1024)
    try:
        e = Engine()
        msgs = [e.start(r) for r in ("a", "b", "c")]
        batch = e.step(0, ["a", "b", "c"])[0]
        batch.groups[0].tensors[0] = Tensor.from_array("hs", np.ones((2, batch.groups[0].num_rows, 4096), np.float32),
                                                       layers=[1, 3])
        frames = [bytes(f) for f in encode(batch, shm=ring)]
        header = decode_header(frames)
        assert "shm_ring" in header
        readable = decode(frames, shm=ShmRingReader())
        assert readable.request_ids == ["a", "b", "c"]
        for _ in range(8):  # overwrite the ring
            ring.put(np.zeros(200_000, np.uint8))
        client = BrokerClient(f"ipc://{tmp_path}/none", window_bytes=1 << 30, shm=True)
        try:
            first = client._accept(frames)
            assert not client._unbatched
            gap = first[1]
            assert isinstance(gap, GapBatch) and decode(first[0]).ranges() == gap.ranges()
            assert [(g.request_id, g.missing, g.reason, g.origin) for g in gap.notices()] == [
                ("a", [[1, 1]], "shm_overrun", "consumer"), ("b", [[1, 1]], "shm_overrun", "consumer"),
                ("c", [[1, 1]], "shm_overrun", "consumer")]
            weight = sum(map(len, frames)) + shm_extent(header)[2]
            assert client._unacked == weight and client.counters["ring_loss_gaps"] == 3
            asm = StreamAssembler()
            for m in _wire(msgs):
                asm.feed(m, now=0.0)
            evs = asm.feed(gap, now=0.0)
            assert [(ev.kind, ev.stream.request_id) for ev in evs] == [("gap", "a"), ("gap", "b"), ("gap", "c")]
        finally:
            client.close()
    finally:
        ring.close()


# ---------------------------------------------------------------------------------------------- recordings

def _record(path, msgs, **kw) -> list[list[bytes]]:
    sent = [[bytes(f) for f in encode(m)] for m in msgs]
    with Recorder(path, **kw) as rec:
        for i, frames in enumerate(sent):
            assert rec.write(frames, recv_time_ns=1_000_000 + 10 * i)
    return sent


def _interleaved_run() -> list:
    """Two engines (producers) whose runs interleave, plus an analyzer."""
    a, b = _run(Engine("eng-A", seed=3)), _run(Engine("eng-B", seed=4, epoch=2))
    b = [_rename(m) for m in b]
    out = []
    for i in range(max(len(a), len(b))):
        out += [x[i] for x in (a, b) if i < len(x)]
    out.insert(12, _analysis("analyzer", {"a": 0, "B-c": 0}, ["a", "B-c"], 1))
    out.append(_analysis("analyzer", {"a": 1}, ["a"], 5))
    return out


def _rename(m):
    """Engine B's requests are B-a, B-b, ... (request ids are global)."""
    if isinstance(m, (StepBatch, TokenBatch)):
        m.request_ids = [f"B-{r}" for r in m.request_ids]
    else:
        m.request_id = f"B-{m.request_id}"
    return m


def test_recording_stores_batches_on_producer_channels_and_replays_them_exactly(tmp_path):
    from mcap.reader import make_reader

    msgs = _interleaved_run()
    sent = _record(tmp_path / "rec", msgs, chunk_bytes=4096)
    with open(tmp_path / "rec" / "part-00000.mcap", "rb") as f:
        summary = make_reader(f).get_summary()
    topics = {c.topic: c.metadata.get("kind") for c in summary.channels.values()}
    assert topics == {"_producer/eng-A": "producer", "_producer/eng-B": "producer", "_producer/analyzer": "producer",
                      **{r: "request" for r in ("a", "b", "c", "d", "B-a", "B-b", "B-c", "B-d")}}
    assert [a.name for a in summary.attachment_indexes] == [INDEX_ATTACHMENT]
    got = list(iter_recording(tmp_path / "rec"))
    assert [f for f, _ in got] == sent  # byte-identical, in recorded order
    live = _feed(StreamAssembler(), _wire(msgs))
    with open_stream(str(tmp_path / "rec")) as events:
        assert [_digest(ev) for ev in events] == [_digest(ev) for ev in live]
    live_b = _feed(StreamAssembler(batches=True), _wire(msgs))
    with open_batches(str(tmp_path / "rec")) as events:
        assert [_digest(ev) for ev in events] == [_digest(ev) for ev in live_b]


def test_replay_with_patterns_narrows_batches_as_the_broker_would(tmp_path):
    msgs = _interleaved_run()
    sent = _record(tmp_path / "rec", msgs)
    got = list(iter_recording(tmp_path / "rec", patterns=["B-*"]))
    want = []
    for frames, m in zip(sent, msgs):
        if isinstance(m, (StepBatch, TokenBatch, AnalysisBatch)):
            header = decode_header(frames)
            keep = [i for i, r in enumerate(m.request_ids) if r.startswith("B-")]
            if keep:
                want.append(frames if len(keep) == len(m.request_ids) else select_requests(frames, header, keep)[0])
        elif m.request_id.startswith("B-"):
            want.append(frames)
    assert [f for f, _ in got] == want
    assert all(r.startswith("B-") for _, m in got for r in getattr(m, "request_ids", [getattr(m, "request_id", "B-")]))
    only_b = [ev for ev in _feed(StreamAssembler(), _wire(msgs)) if ev.stream.request_id.startswith("B-")]
    with open_stream(str(tmp_path / "rec"), patterns=["B-*"]) as events:
        assert [_digest(ev) for ev in events] == [_digest(ev) for ev in only_b]


class _CountingFile:
    total = 0

    def __init__(self, f):
        self._f = f

    def read(self, n=-1):
        data = self._f.read(n)
        _CountingFile.total += len(data)
        return data

    def __getattr__(self, name):
        return getattr(self._f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._f.close()


def _long_run(n_requests: int = 48, steps: int = 160, seed: int = 5, engine: Engine | None = None) -> list:
    """Requests joining and leaving over a long run (each lives ~20 steps), 8 KiB of hidden states per row."""
    e = engine or Engine(seed=seed)
    out, running, born = [], [], 0
    for step in range(steps):
        if born < n_requests and step % 3 == 0:
            rid = f"req-{born:03d}"
            out.append(e.start(rid))
            running.append(rid)
            born += 1
        for rid in list(running):
            if e.seq[rid] > 40:
                out.append(e.end(rid))
                running.remove(rid)
        if running:
            batch, tokens = e.step(step, list(running))
            for g in batch.groups:
                g.tensors = [Tensor.from_array("hs", np.full((2, g.num_rows, 1024), step, np.float32), layers=[1, 3])]
            out += [batch, tokens]
    return out + [e.end(r) for r in running]


def test_one_request_loads_through_the_request_index_without_a_scan(tmp_path, monkeypatch):
    msgs = _long_run()
    _record(tmp_path / "rec", msgs, chunk_bytes=256 << 10)
    size = sum(p.stat().st_size for p in (tmp_path / "rec").iterdir())
    recording = Recording(tmp_path / "rec")
    assert recording.requests() == [f"req-{i:03d}" for i in range(48)]
    _CountingFile.total = 0
    monkeypatch.setattr(recording_module, "open", lambda *a, **k: _CountingFile(open(*a, **k)), raising=False)
    got = recording.messages("req-020")
    assert _CountingFile.total < size / 4, (_CountingFile.total, size)
    monkeypatch.undo()
    want = [m for m in _wire(msgs) if getattr(m, "request_id", None) == "req-020"
            or "req-020" in getattr(m, "request_ids", ())]
    assert len(got) == len(want) > 40
    for g, w in zip(got, want):
        if isinstance(w, StepBatch):
            assert g.request_ids == ["req-020"]
            assert [_digest_frame_tf(f) for f in g.frames()] == [_digest_frame_tf(f) for f in w.segment("req-020")]
            assert g.groups[0].tensor("hs").raw().shape[1] == w.segment("req-020")[0].tensors[0].shape[1]
        elif isinstance(w, TokenBatch):
            assert g.request_ids == ["req-020"] and g.frames()[0] == [f for f in w.frames() if f.request_id == "req-020"][0]
        else:
            assert g == w
    # the same request from a copy of the part cut short (a killed recorder): no index, producer channels scanned
    part = tmp_path / "rec" / "part-00000.mcap"
    data = part.read_bytes()
    (tmp_path / "cut").mkdir()
    (tmp_path / "cut" / "part-00000.mcap").write_bytes(data[:len(data) - 4096])
    cut = Recording(tmp_path / "cut")
    assert cut._parts[0].request_index() is None
    assert [type(m).__name__ for m in cut.messages("req-020")] == [type(m).__name__ for m in got]


def test_ring_held_batch_tensors_are_recorded_inline_and_lost_ones_as_gaps(tmp_path):
    ring = ShmRingWriter(size=4 << 20, min_bytes=1024)
    try:
        e = Engine()
        msgs = [e.start(r) for r in ("a", "b")]
        batch = e.step(0, ["a", "b"])[0]
        batch.groups[0].tensors = [Tensor.from_array("hs", np.arange(2 * batch.groups[0].num_rows * 512,
                                                                     dtype=np.float32).reshape(2, -1, 512),
                                                     layers=[1, 3])]
        batch2 = e.step(1, ["a", "b"])[0]
        batch2.groups[0].tensors = [Tensor.from_array("hs", np.ones((2, batch2.groups[0].num_rows, 512), np.float32),
                                                      layers=[1, 3])]
        ring_frames = [bytes(f) for f in encode(batch, shm=ring)]
        selected, _ = select_requests(ring_frames, decode_header(ring_frames), [1])  # a consumer of b only
        lost_frames = [bytes(f) for f in encode(batch2, shm=ring)]
        with Recorder(tmp_path / "rec") as rec:
            for m in msgs:
                rec.write([bytes(f) for f in encode(m)])
            rec.write(ring_frames)
            rec.write(selected)
            for _ in range(40):
                ring.put(np.zeros(400_000, np.uint8))  # batch2's bytes are overwritten before the recorder reads
            rec.write(lost_frames)
            assert rec.stats.shm_lost == 1
        got = [m for _, m in iter_recording(tmp_path / "rec")]
        assert [type(m).__name__ for m in got] == ["StreamStart", "StreamStart", "StepBatch", "StepBatch",
                                                   "GapBatch"]
        np.testing.assert_array_equal(got[2].tensor("hs"), batch.groups[0].tensors[0].numpy())
        assert got[3].request_ids == ["b"]
        b_rows = batch.groups[0].rows.tolist()
        np.testing.assert_array_equal(got[3].tensor("hs"), batch.groups[0].tensors[0].numpy()[:, b_rows[0]:])
        recorded = [f for f, _ in iter_recording(tmp_path / "rec")]
        assert all("shm_ring" not in decode_header(f) for f in recorded)
        assert len(recorded[3][2]) == 2 * b_rows[1] * 512 * 4  # compacted: just b's rows
        assert [(g.request_id, g.missing, g.reason) for g in got[4].notices()] == [("a", [[3, 3]], "shm_overrun"),
                                                                                  ("b", [[3, 3]], "shm_overrun")]
    finally:
        ring.close()


LEGACY = __import__("pathlib").Path(__file__).parent / "data" / "recording-1.3.mcap"


def test_a_schema_1_recording_still_reads_and_replays(tmp_path):
    """tests/data/recording-1.3.mcap was written by the 1.3 recorder (commit 7ec5ead, see
    tests/data/make_recording_1_3.py): schema-1 headers, per-request TensorFrames and TokenFrames."""
    got = list(iter_recording(LEGACY))
    assert got and all(decode_header(f, legacy=True)["v"][0] == 1 for f, _ in got)
    with pytest.raises(Exception, match="major version 1"):
        decode(got[0][0])  # not as a live message
    events = list(open_stream(str(LEGACY)))
    kinds = [ev.kind for ev in events]
    assert kinds.count("start") == 2 and kinds.count("end") == 2 and kinds.count("frame") == 6
    frame = next(ev.frame for ev in events if ev.kind == "frame")
    np.testing.assert_array_equal(frame.tensors["hs"], np.full((2, 1, 8), frame.step, np.float32))
    batches = [ev.batch for ev in open_batches(str(LEGACY)) if ev.kind == "batch"]
    assert len(batches) == 12 and all(len(b.request_ids) == 1 for b in batches)
    assert Recording(LEGACY).messages("one")[0].KIND == "start"
    shutil.copy(LEGACY, tmp_path / "x.mcap")
    assert Recording(tmp_path / "x.mcap").summary().requests == 2


def test_pack_layout_of_a_recorded_batch_is_the_spec_layout(tmp_path):
    """Section 7: a recorded message is u32 count, u32 lengths, frames; a batch's frames are its wire frames."""
    from mcap.reader import make_reader

    e = Engine()
    msgs = [e.start("a"), *e.step(0, ["a"])]
    sent = _record(tmp_path / "rec", msgs)
    with open(tmp_path / "rec" / "part-00000.mcap", "rb") as f:
        datas = [m.data for _, c, m in make_reader(f).iter_messages() if c.topic.startswith("_producer/")]
    (n,) = struct.unpack_from("<I", datas[0])
    lengths = struct.unpack_from(f"<{n}I", datas[0], 4)
    assert list(lengths) == [len(x) for x in sent[1]] and datas[0][4 + 4 * n:] == b"".join(sent[1])


# ---------------------------------------------------------------------------------------------- a real engine

def _drain(stream, n_ends: int, timeout: float = 120.0) -> list:
    """Events of a live EventStream until ``n_ends`` requests ended."""
    import time

    out, ends, deadline = [], 0, time.monotonic() + timeout
    for ev in stream:
        out.append(ev)
        ends += ev.kind == "end"
        if ends == n_ends:
            return out
        assert time.monotonic() < deadline, f"only {ends} of {n_ends} ends in {timeout} s"
    raise AssertionError(f"stream stopped after {ends} of {n_ends} ends")


def _per_request(events) -> dict:
    """Each request's events in order (a batch event counts for each request it names)."""
    out: dict[str, list] = {}
    for ev in events:
        d = _digest(ev)
        for rid in (ev.batch.request_ids if ev.kind == "batch" else [ev.stream.request_id]):
            out.setdefault(rid, []).append(d)
    return out


@pytest.mark.slow
def test_live_equals_replay_on_a_real_engine_capture(engine, broker_address, tmp_path):
    """A real vLLM engine captures hidden states (3 layers, all positions) and Q/K of three requests; a
    `mia-stream record` process records them while two live SDK consumers read them (per-request events and
    the batch API). Replaying the recording gives both the same events, value for value."""
    import subprocess
    import sys
    import time
    import uuid
    from pathlib import Path

    from vllm import SamplingParams

    tag = uuid.uuid4().hex[:8]
    patterns = [f"lr-{tag}-*"]
    rec_dir = tmp_path / "rec"
    recorder = subprocess.Popen([sys.executable, "-m", "mia_stream.cli", "record", str(rec_dir), "--broker",
                                 broker_address, "--patterns", *patterns, "--flush-interval", "0.1"],
                                cwd=Path(__file__).resolve().parents[1], stderr=subprocess.PIPE)
    per_request = open_stream(broker_address, patterns=patterns, timeout=60, consumer_id=f"live-{tag}")
    batches = open_batches(broker_address, patterns=patterns, timeout=60, consumer_id=f"live-batches-{tag}")
    try:
        time.sleep(1.0)  # subscriptions (and the recorder's) reach the broker before the engine publishes
        assert recorder.poll() is None, recorder.stderr.read()
        prompts = ["The capital of France is", "Write a haiku about the sea:", "1, 2, 3, 4,"]
        spec = {"capture": {"hidden_states": {"layers": [0, 15, 29], "positions": "all"},
                            "qk": {"layers": [3], "heads": "all", "positions": "last_prompt"}}}
        params = [SamplingParams(max_tokens=8 + 3 * i, temperature=0,
                                 extra_args={"mia_stream": {**spec, "id": f"lr-{tag}-{i}"}}) for i in range(3)]
        engine.generate(prompts, params, use_tqdm=False)
        live = _drain(per_request, 3)
        live_batches = _drain(batches, 3)
        time.sleep(1.0)  # the recorder's last chunk (flushed every 0.1 s)
    finally:
        per_request.close()
        batches.close()
        recorder.terminate()
        recorder.wait(20)
    assert recorder.returncode == 0
    frames = [ev for ev in live if ev.kind == "frame"]
    assert len({ev.stream.request_id for ev in frames}) == 3 and len(frames) >= 3 * 8
    assert not [ev for ev in live if ev.kind == "gap"]
    assert {f.frame.tensors["hs"].shape[0] for f in frames if "hs" in f.frame.tensors} == {3}
    # the same events per request (the order across requests is the broker's interleaving for each consumer)
    with open_stream(str(rec_dir), patterns=patterns) as replayed:
        assert _per_request(replayed) == _per_request(live)
    with open_batches(str(rec_dir), patterns=patterns) as replayed:
        assert _per_request(replayed) == _per_request(live_batches)
    steps = [ev.batch for ev in live_batches if ev.kind == "batch" and isinstance(ev.batch, StepBatch)]
    # the batches carry exactly the captures the per-request events carry
    segments = {(f.request_id, f.step, f.part) for b in steps for f in b.frames()}
    assert segments == {(ev.stream.request_id, ev.frame.step, ev.frame.part) for ev in frames}


def test_the_readme_vectorized_consumer_computes_each_requests_mean_norm(tmp_path, capsys):
    """docs/consumers.md's batch-API example, run as written on a recording, against the per-request events."""
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "docs" / "consumers.md").read_text()
    code = re.search(r"```python\n(import numpy as np\nfrom mia_stream.consumers import Consumer, run_consumer\n.*?)```",
                     readme, re.S).group(1)
    code = code.replace('"/tmp/mia-run"', repr(str(tmp_path / "rec")))
    msgs = _run()
    _record(tmp_path / "rec", msgs)
    exec(compile(code, "docs/consumers.md", "exec"), {"__name__": "__main__"})
    printed = [eval(line.split(" ", 1)[1]) | {"step": int(line.split(" ", 1)[0])}
               for line in capsys.readouterr().out.splitlines()]
    want: dict[tuple, float] = {}
    for ev in _feed(StreamAssembler(), _wire(msgs)):
        if ev.kind == "frame" and "hs" in ev.frame.tensors:
            hs = ev.frame.tensors["hs"]
            want[(ev.frame.step, ev.stream.request_id)] = round(float(np.linalg.norm(hs, axis=-1).mean()), 2)
    got = {(p["step"], rid): v for p in printed for rid, v in p.items() if rid != "step"}
    assert got.keys() == want.keys() and len(got) > 10
    assert all(abs(got[k] - want[k]) <= 0.011 for k in want)


# ---------------------------------------------------------------------------------------------- through a broker

def _per_stream(events) -> dict:
    """Each stream's events in order: per request, its own streams' events and each analyzer's apart (the
    order between different producers' messages is the broker's interleaving)."""
    out: dict[tuple, list] = {}
    for ev in events:
        d = _digest(ev)
        if ev.kind == "batch":
            source = ev.batch.producer_id if isinstance(ev.batch, AnalysisBatch) else "request"
            for rid in ev.batch.request_ids:
                out.setdefault((rid, source), []).append(d)
            continue
        source = "request"
        if ev.kind == "analysis":
            source = ev.analysis.producer_id
        elif ev.kind == "gap" and ev.gap.producer_id == "analyzer":
            source = "analyzer"
        out.setdefault((ev.stream.request_id, source), []).append(d)
    return out


def test_columnar_messages_through_a_real_broker_reach_sdk_consumers_as_assembled_directly():
    """Two engines and an analyzer publish step, token and analysis batches (tensors through their
    shared-memory rings) into a real broker; three SDK consumers: every request per request (reading the
    rings), two requests of each engine per request without rings (the broker's compacted selections of
    every batch), and every request through the batch API. Each gets, stream by stream, what the SDK assembles from the messages directly."""
    pytest.importorskip("mia_stream.broker._routing", reason="the broker routes columnar kinds from branch h12b on")
    import tempfile
    import time

    from mia_stream.broker import run_broker_in_thread
    from mia_stream.bus.publisher import FramePublisher

    run = tempfile.mkdtemp(prefix="mia-h12c-", dir="/tmp")
    try:
        with run_broker_in_thread(address=run) as broker:
            every = open_stream(run, ["*"], timeout=3, consumer_id="every")
            some = open_stream(run, ["*req-00[13]"], timeout=3, consumer_id="some", shm=False)
            vec = open_batches(run, ["*"], timeout=3, consumer_id="vec")
            deadline = time.monotonic() + 20
            while len(broker.stats()["consumers"]) < 3:
                assert time.monotonic() < deadline, "consumers did not subscribe"
                time.sleep(0.02)
            pubs = {pid: FramePublisher(run, producer_id=pid) for pid in ("eng-A", "eng-B", "analyzer")}
            try:
                a = _long_run(n_requests=6, steps=30, seed=1, engine=Engine("eng-A", epoch=pubs["eng-A"].epoch))
                b = [_rename(m) for m in _long_run(n_requests=6, steps=30, seed=2,
                                                   engine=Engine("eng-B", epoch=pubs["eng-B"].epoch, seed=2))]
                msgs = []
                for i in range(max(len(a), len(b))):
                    msgs += [x[i] for x in (a, b) if i < len(x)]
                an_seq: dict[str, int] = {}
                for n, rids in enumerate((["req-000", "B-req-001"], ["req-000"], ["B-req-001", "req-002"])):
                    seqs = {r: an_seq.setdefault(r, 0) for r in rids}
                    for r in rids:
                        an_seq[r] += 1
                    msgs.insert(20 + 15 * n, _analysis("analyzer", seqs, rids, n, epoch=pubs["analyzer"].epoch))
                for m in msgs:
                    assert pubs[m.producer_id].publish(m)
                for p in pubs.values():
                    assert p.flush(10)
                assert pubs["eng-A"].shm_ring is not None  # tensors went through the ring
                n_ends = sum(isinstance(m, StreamEnd) for m in msgs)
                # until the ends, then what follows them (analyses) until 3 s without events
                got_every, got_some, got_vec = (_drain(every, n_ends) + list(every), _drain(some, 4) + list(some),
                                                _drain(vec, n_ends) + list(vec))
            finally:
                for p in pubs.values():
                    p.close()
                for s in (every, some, vec):
                    s.close()
    finally:
        shutil.rmtree(run, ignore_errors=True)
    direct = _per_stream(_feed(StreamAssembler(), _wire(msgs)))
    assert not [ev for ev in got_every + got_some if ev.kind == "gap"]
    assert _per_stream(got_every) == direct
    assert _per_stream(got_some) == {k: v for k, v in direct.items() if k[0][-5:] in ("q-001", "q-003")}
    assert {k[0] for k in _per_stream(got_some)} == {"req-001", "req-003", "B-req-001", "B-req-003"}
    assert _per_stream(got_vec) == _per_stream(_feed(StreamAssembler(batches=True), _wire(msgs)))


def test_a_recording_of_batches_replays_into_a_broker(tmp_path):
    """replay(recording, into=broker) re-publishes the recorded step, token and analysis batches; a consumer of
    that broker gets, stream by stream, what the SDK assembles from the original messages."""
    pytest.importorskip("mia_stream.broker._routing", reason="the broker routes columnar kinds from branch h12b on")
    import tempfile
    import time

    from mia_stream.broker import run_broker_in_thread

    msgs = _interleaved_run()
    _record(tmp_path / "rec", msgs)
    run = tempfile.mkdtemp(prefix="mia-h12c-", dir="/tmp")
    try:
        with run_broker_in_thread(address=run) as broker:
            events = open_stream(run, ["*"], timeout=3, consumer_id="replayed")
            try:
                deadline = time.monotonic() + 20
                while not broker.stats()["consumers"]:
                    assert time.monotonic() < deadline
                    time.sleep(0.02)
                stats = replay(tmp_path / "rec", into=run)
                got = _drain(events, sum(isinstance(m, StreamEnd) for m in msgs))
                got += list(events)  # the analysis after the last end (until 3 s without events)
            finally:
                events.close()
    finally:
        shutil.rmtree(run, ignore_errors=True)
    assert stats.messages == len(msgs) and stats.dropped == 0
    assert _per_stream(got) == _per_stream(_feed(StreamAssembler(), _wire(msgs)))


def test_a_long_running_assembler_lets_go_of_ended_requests():
    """An ended request is remembered for the analysis results that may follow it, but only among the most
    recent ended ones: its stream (start, tokens, gaps) must become garbage after enough later requests ended.
    Every ended stream used to stay reachable for the life of the consumer, so a monitor's memory and its full
    garbage collections grew with every request it ever saw (seconds per collection under load)."""
    import gc
    import weakref

    from mia_stream.consumers._assemble import _RECENT_STREAMS

    asm = StreamAssembler(batches=True)
    first = None
    for r in range(_RECENT_STREAMS + 50):
        rid = f"old-{r}"
        evs = asm.feed(StreamStart(rid, "p", 1), now=0.0)
        asm.feed(GapNotice(rid, "p", 1, [[1, 1]], "consumer_queue_full", "broker"), now=0.0)
        asm.feed(TokenFrame(rid, "p", 1, 2, 0, [5]), now=0.0)
        ended = asm.feed(StreamEnd(rid, "p", 1, 3, "length"), now=0.0)
        assert [e.kind for e in ended] == ["end"]
        if first is None:
            first = weakref.ref(evs[0].stream)
        del evs, ended
    gc.collect()
    assert first() is None, "the first request's stream is still reachable after 10,050 later requests ended"
    # and what ended stays refused
    assert asm.feed(TokenFrame("old-0", "p", 1, 4, 1, [6]), now=0.0) == [] and asm.counters["after_end"] == 1
