"""The consumer SDK under overload: a consumer behind its producer is sent a GapBatch for most messages (a step
batch lost, its token batch delivered, step after step). Every lost seq is still announced once and counted
exactly per request; the batch API (``open_batches``) merges a stream's announced losses into few "gap" events
instead of one per request per lost message; the per-request API (``open_stream``) still gets one at once; and
what the assembler keeps of the gaps of the streams it remembers stays bounded."""

from __future__ import annotations

import collections
import gc
import math
import time
import weakref

import numpy as np
import pytest

from bus_helpers import RawProducer, processes, run_dir, start_broker, stats, wait_for
from mia_stream.consumers import StreamAssembler, open_batches, open_stream
from mia_stream.consumers._assemble import GAP_RANGES_KEPT
from mia_stream.schemas import GapBatch, GapNotice, RowGroup, StepBatch, StreamEnd, StreamStart, Tensor, TokenBatch

REASON, ORIGIN = "shm_ahead_of_broker", "producer"


def _steps(pid: str, step: int, ids: list, seq: int) -> StepBatch:
    hs = np.full((1, len(ids), 16), step, np.float32)
    return StepBatch(pid, 1, step, ids, [seq] * len(ids),
                     groups=[RowGroup(np.arange(len(ids)), [1] * len(ids), [step] * len(ids),
                                      [Tensor.from_array("hs", hs, layers=(7,))])])


def _tokens(pid: str, step: int, ids: list, seq: int) -> TokenBatch:
    return TokenBatch(pid, 1, step, ids, [seq] * len(ids), token_ids=np.arange(len(ids)) + step)


def _lost(pid: str, ids: list, seq: int, reason: str = REASON) -> GapBatch:
    return GapBatch.of(pid, 1, [(rid, [[seq, seq]]) for rid in ids], reason, ORIGIN, 1000 + seq)


def _overloaded_run(pid: str, ids: list, steps: int, kept_every: int = 10, tokens_lost_every: int = 0,
                    other_reason_at=()) -> list:
    """What a consumer behind its producer gets: seq 0 start, step s = step batch seq 2s-1 (lost, announced by a
    GapBatch, except every ``kept_every``-th) and token batch seq 2s (delivered, except every
    ``tokens_lost_every``-th), end seq 2*steps+1."""
    out: list = [StreamStart(rid, pid, 1, 0) for rid in ids]
    for s in range(1, steps + 1):
        if s % kept_every:
            out.append(_lost(pid, ids, 2 * s - 1, "aperture_full" if s in other_reason_at else REASON))
        else:
            out.append(_steps(pid, s, ids, 2 * s - 1))
        if tokens_lost_every and s % tokens_lost_every == 0:
            out.append(_lost(pid, ids, 2 * s))
        else:
            out.append(_tokens(pid, s, ids, 2 * s))
    return out + [StreamEnd(rid, pid, 1, 2 * steps + 1) for rid in ids]


def _seqs_of(events) -> dict:
    """Per request, in event order: ("data", seq) for what was delivered, ("gap", seqs) for what was announced."""
    out = collections.defaultdict(list)
    for ev in events:
        if ev.kind == "batch":
            for rid, seq in zip(ev.batch.request_ids, ev.batch.seqs.tolist()):
                out[rid].append(("data", seq))
        elif ev.kind == "gap":
            out[ev.stream.request_id].append(("gap", [s for a, b in ev.gap.missing for s in range(a, b + 1)]))
        elif ev.kind == "start":
            out[ev.stream.request_id].append(("data", ev.stream.start.seq))
        elif ev.kind == "end":
            out[ev.stream.request_id].append(("data", ev.end.seq))
        elif ev.kind == "frame":
            out[ev.stream.request_id].append(("data", ev.frame.rank_frames[0].seq))
        elif ev.kind == "tokens":
            out[ev.stream.request_id].append(("data", ev.tokens.seq))
    return out


def _drain(stream, n_ends: int, timeout: float = 60.0) -> list:
    out, ends, deadline = [], 0, time.monotonic() + timeout
    for ev in stream:
        out.append(ev)
        ends += ev.kind == "end"
        if ends == n_ends:
            return out
        assert time.monotonic() < deadline, f"only {ends} of {n_ends} ends in {timeout} s"
    raise AssertionError(f"stream stopped after {ends} of {n_ends} ends")


# ---------------------------------------------------------------------------------------------- through a broker

def test_a_flood_of_gap_batches_through_a_broker_is_counted_exactly_and_merged_for_the_batch_api():
    """A producer loses 9 of 10 step batches of 48 requests (and 1 of 7 token batches) and announces each in a
    GapBatch, through a real
    broker to two SDK consumers. Both get every seq once, delivered or named lost, and each request's
    ``gap_seqs`` is exact. The per-request API gets a "gap" event per request per lost batch, in seq order; the
    batch API gets each request's losses merged (at most ``GAP_RANGES_KEPT`` ranges an event), all before its
    end. What a RequestStream keeps of its gaps stays within ``GAP_RANGES_KEPT`` ranges."""
    ids = [f"req-{i:03d}" for i in range(48)]
    steps, other_reason_at = 120, (55, 56)
    msgs = _overloaded_run("eng", ids, steps, tokens_lost_every=7, other_reason_at=other_reason_at)
    with run_dir() as d, processes() as procs:
        procs.append(start_broker(d))
        vec = open_batches(d, ["*"], timeout=5, consumer_id="vec", shm=False)
        per_request = open_stream(d, ["*"], timeout=5, consumer_id="per-request", shm=False)
        prod = RawProducer(d, "eng/1")
        try:
            wait_for(lambda: len(stats(d)["consumers"]) == 2, timeout=15)
            prod.hello()
            for m in msgs:
                prod.send(m)
            got_vec = _drain(vec, len(ids))
            got_per_request = _drain(per_request, len(ids))
            st = stats(d)
        finally:
            prod.close()
            vec.close()
            per_request.close()
    assert not any(c["dropped"] for c in st["consumers"].values())  # every loss is the producer's
    everything = list(range(2 * steps + 2))
    lost = sorted([2 * s - 1 for s in range(1, steps + 1) if s % 10] + [2 * s for s in range(7, steps + 1, 7)])
    for name, events in (("batches", got_vec), ("per-request", got_per_request)):
        per = _seqs_of(events)
        assert sorted(per) == ids, name
        for rid in ids:
            delivered = [s for kind, s in per[rid] if kind == "data"]
            announced = [s for kind, seqs in per[rid] if kind == "gap" for s in seqs]
            assert sorted(delivered + announced) == everything, (name, rid)  # each seq once
            assert sorted(announced) == lost, (name, rid)
        streams = {ev.stream.request_id: ev.stream for ev in events if ev.kind == "end"}
        gaps = collections.Counter(ev.stream.request_id for ev in events if ev.kind == "gap")
        for rid, rs in streams.items():
            assert rs.gap_seqs == len(lost) and rs.gap_events == gaps[rid], (name, rid)
            assert rs.gaps and sum(len(g.missing) for g in rs.gaps) <= GAP_RANGES_KEPT, (name, rid)
    for rid, seen in _seqs_of(got_per_request).items():  # one event per lost seq, in the stream's seq order
        order = [s for kind, x in seen for s in (x if kind == "gap" else [x])]
        assert order == everything and sum(kind == "gap" for kind, _ in seen) == len(lost), rid
    # the batch API: losses of one reason merged, every range announced before the request's end
    for rid, seen in _seqs_of(got_vec).items():
        n_gaps = sum(kind == "gap" for kind, _ in seen)
        assert n_gaps <= math.ceil(len(lost) / GAP_RANGES_KEPT) + 2 * len(other_reason_at) + 3, (rid, n_gaps)
        assert seen[-1] == ("data", 2 * steps + 1), rid
    reasons = {(ev.gap.reason, ev.gap.origin) for ev in got_vec if ev.kind == "gap"}
    assert reasons == {(REASON, ORIGIN), ("aperture_full", ORIGIN)}


# ---------------------------------------------------------------------------------------------- the assembler

def test_a_batch_mode_gap_waits_for_its_streams_next_per_request_event_or_the_reorder_timeout():
    """Batch mode, injected clock: a stream's announced losses are one pending gap, delivered by ``flush`` once
    it waited ``reorder_timeout_s``, before the stream's end, by ``finish``, when a loss of another reason comes,
    and once it names ``GAP_RANGES_KEPT`` ranges. Batches do not wait for it."""
    asm = StreamAssembler(batches=True, reorder_timeout_s=0.5)
    for rid in ("a", "b"):
        asm.feed(StreamStart(rid, "p", 1), now=10.0)
    assert asm.feed(_lost("p", ["a", "b"], 1), now=10.0) == [] and asm.holding
    assert [ev.kind for ev in asm.feed(_tokens("p", 1, ["a", "b"], 2), now=10.1)] == ["batch"]
    assert asm.feed(_lost("p", ["a", "b"], 3), now=10.2) == []
    assert [ev.kind for ev in asm.feed(_tokens("p", 2, ["a", "b"], 4), now=10.3)] == ["batch"]
    assert asm.flush(now=10.49) == []
    evs = asm.flush(now=10.5)
    assert [(ev.kind, ev.stream.request_id, ev.gap.missing, ev.gap.reason, ev.gap.origin, ev.gap.time_ns)
            for ev in evs] == [("gap", rid, [[1, 1], [3, 3]], REASON, ORIGIN, 1001) for rid in ("a", "b")]
    assert not asm.holding
    # a loss of another reason: the pending one goes at once
    asm.feed(_lost("p", ["a", "b"], 5), now=11.0)
    evs = asm.feed(_lost("p", ["a"], 6, reason="aperture_full"), now=11.0)
    assert [(ev.stream.request_id, ev.gap.missing, ev.gap.reason) for ev in evs] == [("a", [[5, 5]], REASON)]
    # before the stream's end (with the loss it merged), b's by finish
    evs = asm.feed(StreamEnd("a", "p", 1, 7), now=11.0)
    assert [(ev.kind, ev.gap.missing if ev.gap else None) for ev in evs] == [("gap", [[6, 6]]), ("end", None)]
    assert [(ev.kind, ev.stream.request_id, ev.gap.missing) for ev in asm.finish()] == [("gap", "b", [[5, 5]])]
    assert asm.counters["gap_seqs"] == 7 and not asm.holding
    rs = evs[-1].stream
    assert rs.gap_seqs == 4 and rs.gap_events == 3 and [g.missing for g in rs.gaps] == [[[1, 1], [3, 3]], [[5, 5]],
                                                                                          [[6, 6]]]
    # a long alternating loss: one event per GAP_RANGES_KEPT ranges
    asm = StreamAssembler(batches=True)
    asm.feed(StreamStart("c", "p", 1), now=0.0)
    events = []
    for s in range(1, 41):
        events += asm.feed(_lost("p", ["c"], 2 * s - 1), now=0.0)
        events += asm.feed(_tokens("p", s, ["c"], 2 * s), now=0.0)
    events += asm.finish()
    gaps = [ev.gap.missing for ev in events if ev.kind == "gap"]
    assert [len(m) for m in gaps] == [GAP_RANGES_KEPT, GAP_RANGES_KEPT, 40 - 2 * GAP_RANGES_KEPT]
    assert [s for m in gaps for a, b in m for s in range(a, b + 1)] == [2 * s - 1 for s in range(1, 41)]


@pytest.mark.parametrize("batches", [False, True], ids=["per-request", "batches"])
def test_a_gap_batch_names_only_what_is_news_and_a_seq_told_lost_is_never_delivered_after(batches):
    """Old news (delivered or already announced) is no gap; a message whose seq was announced lost that comes
    after all (e.g. re-sent after a re-subscription) is a duplicate: the seqs after it are not reported twice."""
    asm = StreamAssembler(batches=batches)
    events = []
    for m in (StreamStart("a", "p", 1), StreamStart("b", "p", 1), _tokens("p", 0, ["a", "b"], 1),
              GapBatch.of("p", 1, [("a", [[1, 3]]), ("b", [[1, 1]])], REASON, ORIGIN),
              GapBatch.of("p", 1, [("a", [[3, 3]])], REASON, ORIGIN),
              _tokens("p", 1, ["a", "b"], 2), _tokens("p", 2, ["b"], 3), _tokens("p", 3, ["a", "b"], 4)):
        got = asm.feed(m, now=0.0)
        if not batches and isinstance(m, GapBatch):  # the per-request API: each request's gap at once
            assert [(ev.stream.request_id, ev.gap.missing) for ev in got] == (
                [("a", [[2, 3]])] if m.request_ids == ["a", "b"] else [])
        events += got
    events += asm.feed(StreamEnd("a", "p", 1, 5), now=0.0) + asm.feed(StreamEnd("b", "p", 1, 5), now=0.0)
    events += asm.finish()
    per = _seqs_of(events)
    # batch mode: a's gap waits for its end, the batch with its seq 4 does not
    assert [s for kind, x in per["a"] for s in (x if kind == "gap" else [x])] == (
        [0, 1, 4, 2, 3, 5] if batches else [0, 1, 2, 3, 4, 5])
    assert per["b"] == [("data", s) for s in range(6)] and asm.counters["gap_seqs"] == 2
    assert asm.counters["batch_duplicates"] == (1 if batches else 0)
    ends = {ev.stream.request_id: ev.stream for ev in events if ev.kind == "end"}
    assert (ends["a"].gap_seqs, ends["b"].gap_seqs) == (2, 0) and not ends["b"].gaps


@pytest.mark.parametrize("batches", [False, True], ids=["per-request", "batches"])
def test_an_overloaded_assembler_keeps_a_bounded_part_of_the_gaps_of_the_streams_it_remembers(batches):
    """600 requests, 100 lost step batches each (alternating with delivered token batches), all ended: the
    assembler remembers their streams (for late analysis results), but their gap notices are a few each, not one
    per lost batch; each stream's counts stay exact, and the notices of its later gap events become garbage."""
    n_requests, lost_each, at_once = 600, 100, 60
    gc.collect()
    before = sum(type(o) is GapNotice for o in gc.get_objects())
    asm = StreamAssembler(batches=batches)
    late: list = []
    streams = []
    for first in range(0, n_requests, at_once):
        ids = [f"r{i:04d}" for i in range(first, first + at_once)]
        for m in _overloaded_run("p", ids, lost_each, kept_every=lost_each + 1):
            for ev in asm.feed(m, now=0.0):
                if ev.kind == "gap" and ev.stream.gap_events > GAP_RANGES_KEPT:
                    late.append(weakref.ref(ev.gap))
                elif ev.kind == "end":
                    streams.append(ev.stream)
        for ev in asm.finish():
            assert ev.kind != "gap"  # ends delivered every pending gap
    gc.collect()
    kept = sum(type(o) is GapNotice for o in gc.get_objects()) - before
    assert len(streams) == n_requests and len(asm._recent) == n_requests
    assert all(rs.gap_seqs == lost_each and sum(len(g.missing) for g in rs.gaps) <= GAP_RANGES_KEPT for rs in streams)
    assert asm.counters["gap_seqs"] == n_requests * lost_each
    assert kept <= n_requests * (GAP_RANGES_KEPT if not batches else 1), kept  # was one per lost batch: 60,000
    if not batches:
        assert late and all(r() is None for r in late)
