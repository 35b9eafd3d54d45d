"""The recorder's byte budget and its lz4 chunks (issue 29): a budget ends each stream's recording in one gap
of reason ``recorder_budget`` that names exactly the seqs left out; an lz4 recording replays byte-identical.

The messages are a synthetic engine's columnar stream (test_consumer_batches.Engine: step and token batches of
requests joining and leaving); recordings are real files read back by the SDK's reader.
"""

from __future__ import annotations

import numpy as np

from mia_stream.consumers import open_batches
from mia_stream.consumers.recorder import Recorder
from mia_stream.schemas import StepBatch, StreamStart, encode

from test_consumer_batches import _long_run


def _record(path, msgs, **options) -> Recorder:
    with Recorder(path, flush_interval_s=0.0, chunk_bytes=256 << 10, **options) as rec:
        for m in msgs:
            rec.write(encode(m))
    return rec


def _seqs_sent(msgs) -> dict:
    """Each request's seqs of data messages (step and token batches) and its end's seq, as sent."""
    data, ends = {}, {}
    for m in msgs:
        if hasattr(m, "request_ids"):
            for rid, seq in zip(m.request_ids, np.asarray(m.seqs).tolist()):
                data.setdefault(rid, set()).add(seq)
        elif m.KIND == "end":
            ends[m.request_id] = m.seq
    return data, ends


def test_a_spent_budget_ends_each_stream_in_one_named_gap(tmp_path):
    msgs = _long_run(n_requests=12, steps=80)
    total = sum(len(b) for m in msgs for b in encode(m))
    budget = total // 3
    rec = _record(tmp_path / "rec", msgs, budget_bytes=budget)
    assert rec.stats.budget_dropped > 0
    data, ends = _seqs_sent(msgs)
    got: dict = {}
    seen_of: dict = {}
    with open_batches(str(tmp_path / "rec")) as events:
        for ev in events:
            if ev.kind == "batch":
                for rid, seq in zip(ev.batch.request_ids, np.asarray(ev.batch.seqs).tolist()):
                    got.setdefault(rid, []).append(ev)
                    seen_of.setdefault(rid, set()).add(seq)
            else:
                got.setdefault(ev.stream.request_id, []).append(ev)
    assert set(got) == set(ends)
    ended_in_gap = 0
    for rid, evs in got.items():
        kinds = [e.kind for e in evs]
        assert kinds[0] == "start" and kinds[-1] == "end" and kinds.count("end") == 1
        seen = seen_of.get(rid, set())
        gaps = [e.gap for e in evs if e.kind == "gap"]
        missing = {s for g in gaps for a, b in g.missing for s in range(a, b + 1)}
        # every data seq sent is either recorded or named as left out, never both, and nothing else is missing
        assert seen | missing == data[rid] and not seen & missing, rid
        assert all(g.reason == "recorder_budget" and g.origin == "consumer" for g in gaps)
        if missing:
            ended_in_gap += 1
            assert len(gaps) == 1  # one gap per stream: the recording of a stream stops, it has no holes
            assert min(missing) > max(seen, default=0) and max(missing) == ends[rid] - 1
            assert kinds.index("gap") > max((i for i, k in enumerate(kinds) if k == "batch"), default=0)
    assert ended_in_gap >= 1 and any(not any(e.kind == "gap" for e in evs) for evs in got.values())
    # what was recorded of data stays within the budget; starts, ends and gaps come on top
    assert rec.stats.bytes - sum(len(b) for m in msgs if isinstance(m, StreamStart) for b in encode(m)) < budget + 4096 * len(ends)


def test_an_lz4_recording_replays_byte_identical_tensors(tmp_path):
    msgs = _long_run(n_requests=8, steps=50)
    _record(tmp_path / "plain", msgs)
    _record(tmp_path / "lz4", msgs, compression="lz4")
    from mcap.reader import make_reader

    for part in (tmp_path / "lz4").glob("part-*.mcap"):
        with open(part, "rb") as f:
            chunks = list(make_reader(f).get_summary().chunk_indexes)
        assert chunks and {c.compression for c in chunks} == {"lz4"}
    want = {}
    for m in msgs:
        if isinstance(m, StepBatch):
            for f in m.frames():
                want[(f.request_id, f.seq, f.part)] = {t.name: t.numpy().tobytes() for t in f.tensors}
    for rec in ("plain", "lz4"):
        got = {}
        with open_batches(str(tmp_path / rec)) as events:
            for ev in events:
                if ev.kind == "batch" and isinstance(ev.batch, StepBatch):
                    for f in ev.batch.frames():
                        got[(f.request_id, f.seq, f.part)] = {t.name: t.numpy().tobytes() for t in f.tensors}
        assert got == want, rec
    # the stream's values are compressible (each step's rows hold the step number): lz4 makes the file smaller
    size = {r: sum(p.stat().st_size for p in (tmp_path / r).iterdir()) for r in ("plain", "lz4")}
    assert size["lz4"] < size["plain"] / 4


def test_an_lz4_message_larger_than_a_reader_decompresses_is_recorded_and_replays(tmp_path, monkeypatch):
    """A message over MIA_STREAM_RECORDING_MAX_CHUNK_BYTES (an 8B model's all-layer decode step is 64 MiB, the
    default) once made an lz4 chunk its own reader refused as a bomb: it goes uncompressed in a chunk of its
    own, every compressed chunk stays within the limit, and the recording replays byte-identical."""
    from mcap.reader import make_reader

    from mia_stream.schemas import RowGroup, Tensor

    limit = 64 << 10
    monkeypatch.setenv("MIA_STREAM_RECORDING_MAX_CHUNK_BYTES", str(limit))
    rng = np.random.default_rng(0)
    start = StreamStart("big", "p", 0, tags={})
    big = rng.integers(0, 1 << 16, size=(2, 1, 40_000), dtype=np.uint16)  # 160 KB: past the limit
    small = np.zeros((2, 1, 64), np.uint16)
    msgs = [start]
    for step, rows in enumerate([small, big, small, small, big]):
        t = Tensor("hs", "bfloat16", rows.shape, rows, (0, 1))
        msgs.append(StepBatch("p", 1, step, ["big"], [step + 1], [RowGroup([0], [1], np.array([step]), [t])]))
    _record(tmp_path / "rec", msgs, compression="lz4")
    for part in (tmp_path / "rec").glob("part-*.mcap"):
        with open(part, "rb") as f:
            chunks = list(make_reader(f).get_summary().chunk_indexes)
        assert {c.compression for c in chunks} == {"lz4", ""}
        assert all(c.uncompressed_size <= limit for c in chunks if c.compression == "lz4")
    got = []
    with open_batches(str(tmp_path / "rec")) as events:
        for ev in events:
            if ev.kind == "batch":
                got.extend(t.numpy().tobytes() for f in ev.batch.frames() for t in f.tensors)
    # numpy() widens bfloat16 to float32: the same bits in the high half
    want = [(r.astype(np.uint32) << 16).tobytes() for r in (small, big, small, small, big)]
    assert [len(g) for g in got] == [len(w) for w in want] and got == want
