"""Replay: a consumer computes the same thing live and from the recording; replay into a broker re-publishes
the recorded messages; the recorded pace is kept."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from mia_stream.consumers.recorder import Recorder, _BrokerSource
from mia_stream.consumers.replay import iter_replay, main, replay
from mia_stream.schemas import GapNotice, StreamEnd, StreamStart, Tensor, TensorFrame, TokenFrame, decode, encode

ROOT = Path(__file__).resolve().parents[1]


class NormConsumer:
    """Per step: the L2 norm of each layer's hidden state, and the token ids; plus gaps and ends."""

    def __init__(self):
        self.out: list[tuple] = []

    def on_message(self, msg) -> None:
        if msg.KIND == "tensors":
            hs = msg.tensor("hs").dequantize().astype(np.float64)
            norms = tuple(float(x) for x in np.linalg.norm(hs.reshape(hs.shape[0], -1), axis=1))
            self.out.append((msg.request_id, msg.seq, msg.step, norms, tuple(msg.token_ids)))
        elif msg.KIND == "tokens":
            self.out.append((msg.request_id, msg.seq, "tokens", tuple(msg.token_ids)))
        elif msg.KIND == "gap":
            self.out.append((msg.request_id, "gap", tuple(map(tuple, msg.missing)), msg.origin))
        elif msg.KIND == "end":
            self.out.append((msg.request_id, msg.seq, "end", msg.finish_reason))


def _stream(rid: str, steps: int, seed: int, *, producer_id="p", epoch=1, lz4=False) -> list[list[bytes]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    msgs = [StreamStart(rid, producer_id, epoch, num_layers=3, hidden_size=32)]
    for step in range(steps):
        hs = torch.randn(3, 2, 32, generator=g).to(torch.bfloat16)
        msgs.append(TensorFrame(rid, producer_id, epoch, 2 * step + 1, step, positions=[2 * step, 2 * step + 1],
                                token_ids=[seed + step, seed + step + 1],
                                tensors=[Tensor.from_array("hs", hs, layers=[0, 4, 8])]))
        msgs.append(TokenFrame(rid, producer_id, epoch, 2 * step + 2, step, token_ids=[seed * 7 + step]))
    msgs.append(StreamEnd(rid, producer_id, epoch, 2 * steps + 1, finish_reason="length"))
    return [[bytes(f) for f in encode(m, compression="lz4" if lz4 else "none", checksum=lz4)] for m in msgs]


def _interleaved() -> list[list[bytes]]:
    a, b, c = _stream("a", 6, 1), _stream("b", 4, 2, lz4=True), _stream("c", 5, 3)
    out = []
    for i in range(max(map(len, (a, b, c)))):
        out += [s[i] for s in (a, b, c) if i < len(s)]
    out.insert(9, [bytes(f) for f in encode(GapNotice("b", "p", 1, missing=[[3, 4]], reason="hwm", origin="broker"))])
    return out


def test_consumer_output_is_identical_live_and_on_replay(tmp_path):
    sent = _interleaved()
    live = NormConsumer()
    with Recorder(tmp_path / "rec", chunk_bytes=4096) as rec:
        for frames in sent:
            live.on_message(decode(frames))  # what a live consumer computes, message by message
            rec.write(frames)
    replayed = NormConsumer()
    stats = replay(tmp_path / "rec", into=replayed)
    assert stats.messages == len(sent) and len(live.out) == len(sent) - 3  # starts produce no output
    assert replayed.out == live.out
    only_b = NormConsumer()
    replay(tmp_path / "rec", into=only_b, patterns=["b"])
    assert only_b.out == [o for o in live.out if o[0] == "b"]


def test_replay_dispatches_by_kind_without_on_message(tmp_path):
    class ByKind:
        def __init__(self):
            self.kinds, self.closed = [], False

        def on_start(self, m): self.kinds.append(m.KIND)
        def on_tensors(self, m): self.kinds.append(m.KIND)
        def on_end(self, m): self.kinds.append(m.KIND)
        def close(self): self.closed = True

    with Recorder(tmp_path / "rec") as rec:
        for frames in _stream("a", 2, 1):
            rec.write(frames)
    consumer = ByKind()
    replay(tmp_path / "rec", into=consumer)
    assert consumer.kinds == ["start", "tensors", "tensors", "end"] and consumer.closed


def test_recorded_pace_is_kept(tmp_path):
    frames = _stream("a", 4, 1)  # 10 messages, recorded 40 ms apart
    with Recorder(tmp_path / "rec") as rec:
        for i, f in enumerate(frames):
            rec.write(f, recv_time_ns=1_000_000_000 + i * 40_000_000)
    t0 = time.monotonic()
    arrivals = [time.monotonic() - t0 for _ in iter_replay(tmp_path / "rec", pace="recorded")]
    assert arrivals[-1] >= 0.36 - 0.005
    assert all(b - a >= 0.03 for a, b in zip(arrivals, arrivals[1:]))
    t0 = time.monotonic()
    assert len(list(iter_replay(tmp_path / "rec", pace="full"))) == 10 and time.monotonic() - t0 < 0.3
    with pytest.raises(ValueError, match="pace"):
        replay(tmp_path / "rec", into=NormConsumer(), pace="slow")


def _drain(source: _BrokerSource, n: int, timeout: float = 20) -> list[list[bytes]]:
    got, deadline = [], time.monotonic() + timeout
    while len(got) < n and time.monotonic() < deadline:
        got += [[bytes(f) for f in m] for m in source.recv_frames(0.05) if len(m[0])]  # skip broker heartbeats
    return got


@pytest.mark.slow
def test_live_through_a_real_broker_equals_replay_of_its_recording(tmp_path):
    """Producer (FramePublisher) -> broker -> {a live consumer, `mia-stream record` process}; then the
    recording is replayed into a fresh consumer (same output) and into a second broker (same messages)."""
    from mia_stream.broker import run_broker_in_thread
    from mia_stream.bus.publisher import FramePublisher

    run, run2, rec_dir = tmp_path / "run", tmp_path / "run2", tmp_path / "rec"
    with run_broker_in_thread(address=str(run)) as broker:
        live_source = _BrokerSource(str(run), ["*"], consumer_id="live")
        recorder = subprocess.Popen([sys.executable, "-m", "mia_stream.cli", "record", str(rec_dir),
                                     "--broker", str(run), "--flush-interval", "0.1"],
                                    cwd=ROOT, stderr=subprocess.PIPE)
        try:
            deadline = time.monotonic() + 30
            while len(broker.stats()["consumers"]) < 2:
                assert recorder.poll() is None, recorder.stderr.read()
                assert time.monotonic() < deadline, "recorder did not subscribe"
                time.sleep(0.02)
            with FramePublisher(str(run), producer_id="prod") as pub:
                sent = []
                for m in [decode(f) for f in _interleaved()]:
                    if m.KIND == "gap":
                        continue  # a producer announces only its own drops
                    m.producer_id, m.epoch = pub.producer_id, pub.epoch
                    m.seq = pub.next_seq(m.request_id)
                    assert pub.publish(m)
                    sent.append(m)
                assert pub.flush(10)
            live_frames = _drain(live_source, len(sent))
            deadline = time.monotonic() + 20
            while sum(1 for _ in _safe_iter(rec_dir)) < len(sent):
                assert time.monotonic() < deadline, "recorder did not record everything"
                time.sleep(0.05)
        finally:
            recorder.terminate()
            try:
                recorder.wait(10)
            finally:
                if recorder.poll() is None:
                    recorder.kill()
            live_source.close()
    assert recorder.returncode == 0
    live = NormConsumer()
    for frames in live_frames:
        live.on_message(decode(frames))
    assert len(live_frames) == len(sent) and len(live.out) == len(sent) - 3
    replayed = NormConsumer()
    replay(rec_dir, into=replayed)
    assert replayed.out == live.out
    from mia_stream.consumers.recording import iter_recording

    assert [f for f, _ in iter_recording(rec_dir)] == live_frames  # byte-identical to what the broker sent

    with run_broker_in_thread(address=str(run2)):
        sub = _BrokerSource(str(run2), ["*"], consumer_id="check")
        try:
            time.sleep(0.3)
            stats = replay(rec_dir, into=str(run2))
            again = _drain(sub, len(sent))
        finally:
            sub.close()
    assert stats.messages == len(sent) and stats.dropped == 0
    from_broker = NormConsumer()
    for frames in again:
        from_broker.on_message(decode(frames))
    assert from_broker.out == live.out


def _safe_iter(rec_dir):
    from mia_stream.consumers.recording import iter_recording

    try:
        yield from iter_recording(rec_dir)
    except Exception:
        return


def test_cli_replays_into_a_consumer_class(tmp_path, capsys):
    with Recorder(tmp_path / "rec") as rec:
        for frames in _stream("a", 3, 1):
            rec.write(frames)
    assert main([str(tmp_path / "rec"), "--consumer", "test_replay:NormConsumer"]) == 0
    assert "8 messages" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([str(tmp_path / "rec"), "--consumer", "no_such_module:X"])


def test_an_sdk_consumer_sees_the_same_events_from_replay_and_from_run_consumer(tmp_path):
    """replay() into an SDK Consumer goes through the SDK's assembler, as run_consumer(recording) does."""
    from mia_stream.consumers import Consumer, run_consumer

    class Norms(Consumer):
        def __init__(self):
            self.out = []

        def on_frame(self, stream, frame):
            hs = np.asarray(frame.tensors["hs"], dtype=np.float64)
            self.out.append((stream.request_id, frame.step, tuple(np.linalg.norm(hs.reshape(hs.shape[0], -1), axis=1))))

        def on_gap(self, stream, gap):
            self.out.append((stream.request_id, "gap"))

        def on_end(self, stream, end):
            self.out.append((stream.request_id, "end"))

    with Recorder(tmp_path / "rec") as rec:
        for frames in _interleaved():
            rec.write(frames)
    via_sdk, via_replay, paced = Norms(), Norms(), Norms()
    run_consumer(via_sdk, str(tmp_path / "rec"))
    replay(tmp_path / "rec", into=via_replay)
    replay(tmp_path / "rec", into=paced, pace="recorded")
    assert via_replay.out == via_sdk.out == paced.out
    assert sum(1 for o in via_sdk.out if o[1] == "end") == 3 and len(via_sdk.out) > 15


# --- gap batches (spec 3.16): the same events as their GapNotices, live and from a recording ---------------------


def _lossy_columnar() -> list:
    """Three requests in step and token batches of producer "p", an analyzer's results about them, and the
    losses of each announced by gap batches: some seqs lost, one gap naming seqs already delivered or announced
    (trimmed), one holding a request's later message behind a hole it explains, an analyzer's hole."""
    from mia_stream.schemas import AnalysisBatch, GapBatch, RowGroup, StepBatch, TokenBatch

    ids = ["a", "b", "c"]

    def steps(step: int, seqs: dict) -> StepBatch:
        rids = list(seqs)
        hs = np.arange(len(rids) * 8, dtype=np.float32).reshape(1, len(rids), 8) + step
        return StepBatch("p", 1, step, rids, list(seqs.values()),
                         groups=[RowGroup(np.arange(len(rids)), [1] * len(rids), [step] * len(rids),
                                          [Tensor.from_array("hs", hs, layers=(2,))])])

    msgs: list = [StreamStart(rid, "p", 1) for rid in ids]
    msgs += [steps(1, {"a": 1, "b": 1, "c": 1}), TokenBatch("p", 1, 1, ids, [2, 2, 2], token_ids=[5, 6, 7])]
    # seqs 3-6 (steps 2 and 3) of "a" and "b" are lost, 3-5 of "c", whose seq 6 comes early (held)
    msgs.append(TokenBatch("p", 1, 3, ["c"], [6], token_ids=[9]))
    msgs.append(GapBatch.of("p", 1, [("a", [[3, 3], [5, 6]]), ("b", [[5, 6], [3, 3]]), ("c", [[3, 5]])],
                            "consumer_queue_full", "broker", 11))
    msgs.append(GapBatch.of("p", 1, [("a", [[1, 4]]), ("b", [[4, 4]])], "consumer_queue_full", "broker", 12))
    msgs.append(AnalysisBatch("ana", 1, "x", ids, [0, 0, 0], values={"v": np.array([1.0, 2.0, 3.0])}))
    msgs.append(AnalysisBatch("ana", 1, "x", ["a", "b"], [2, 2], values={"v": np.array([4.0, 5.0])}))
    msgs.append(GapBatch.of("ana", 1, [("a", [[1, 1]]), ("b", [[1, 1]])], "analysis_dropped", "producer", 13))
    msgs.append(steps(4, {"a": 7, "b": 7, "c": 7}))
    msgs += [StreamEnd(rid, "p", 1, 8) for rid in ids]
    return msgs


def _as_gap_notices(msgs: list) -> list:
    from mia_stream.schemas import GapBatch

    return [n for m in msgs for n in (m.notices() if isinstance(m, GapBatch) else [m])]


def _event_view(ev) -> tuple:
    """An event as comparable values: what a consumer sees of it."""
    rid = ev.stream.request_id if ev.stream is not None else None
    if ev.kind == "gap":
        g = ev.gap  # a gap the consumer found itself (seq_jump) is stamped with the wall clock when found
        return ("gap", rid, g.producer_id, g.epoch, g.missing, g.reason, g.origin,
                None if g.origin == "consumer" else g.time_ns)
    if ev.kind == "frame":
        return ("frame", rid, ev.frame.step, ev.frame.tensors["hs"].tolist())
    if ev.kind == "tokens":
        return ("tokens", rid, ev.tokens.seq, ev.tokens.token_ids)
    if ev.kind == "analysis":
        return ("analysis", rid, ev.analysis.seq, ev.analysis.values["v"].tolist())
    if ev.kind == "batch":
        return ("batch", ev.batch.KIND, ev.batch.request_ids, getattr(ev.batch, "seqs", np.zeros(0)).tolist())
    return (ev.kind, rid)


def _events(msgs: list, batches: bool) -> list:
    from mia_stream.consumers import StreamAssembler

    asm = StreamAssembler(batches=batches)
    out = [e for m in msgs for e in asm.feed(m, now=1.0)]
    return [_event_view(e) for e in out + asm.finish()]


@pytest.mark.parametrize("batches", [False, True], ids=["per-request", "batches"])
def test_a_gap_batch_gives_the_events_of_its_gap_notices(batches):
    msgs = _lossy_columnar()
    got = _events(msgs, batches)
    assert got == _events(_as_gap_notices(msgs), batches)
    gaps = [e for e in got if e[0] == "gap"]
    named: dict = {}
    for e in gaps:
        named.setdefault((e[1], e[2]), []).extend(s for a, b in e[4] for s in range(a, b + 1))
    # every lost seq named once, in both modes (batch mode reports "c"'s hole and the analyzer's when the
    # message after it comes, as seq_jump: a batch is never held)
    assert {k: sorted(v) for k, v in named.items()} == {
        ("a", "p"): [3, 4, 5, 6], ("b", "p"): [3, 4, 5, 6], ("c", "p"): [3, 4, 5], ("a", "ana"): [1],
        ("b", "ana"): [1]}
    if not batches:  # trimmed to what is news: "a" and "b" 3, 5-6, then 4 from the second batch
        assert [(e[1], e[4], e[5]) for e in gaps] == [
            ("a", [[3, 3], [5, 6]], "consumer_queue_full"), ("b", [[3, 3], [5, 6]], "consumer_queue_full"),
            ("c", [[3, 5]], "consumer_queue_full"), ("a", [[4, 4]], "consumer_queue_full"),
            ("b", [[4, 4]], "consumer_queue_full"), ("a", [[1, 1]], "analysis_dropped"),
            ("b", [[1, 1]], "analysis_dropped")]
    assert [e[0] for e in got].count("end") == 3


def test_a_recorded_gap_batch_replays_to_the_events_it_gave_live(tmp_path):
    from mia_stream.consumers import open_batches, open_stream
    from mia_stream.consumers.recording import Recording, iter_recording
    from mia_stream.schemas import GapBatch

    msgs = _lossy_columnar()
    with Recorder(tmp_path / "rec", chunk_bytes=4096) as rec:
        for m in msgs:
            rec.write([bytes(f) for f in encode(m)])
    recorded = [m for _, m in iter_recording(tmp_path / "rec")]
    assert [type(m) for m in recorded] == [type(m) for m in msgs]
    assert [m.notices() for m in recorded if isinstance(m, GapBatch)] == [
        m.notices() for m in msgs if isinstance(m, GapBatch)]
    for opener, batches in ((open_stream, False), (open_batches, True)):
        with opener(str(tmp_path / "rec")) as events:
            assert [_event_view(e) for e in events] == _events(msgs, batches)
    # narrowed to one request, as a live consumer of that request would get it
    only_b = [m for _, m in iter_recording(tmp_path / "rec", patterns=["b"])]
    assert [n.missing for m in only_b if isinstance(m, GapBatch) for n in m.notices()] == [
        [[5, 6], [3, 3]], [[4, 4]], [[1, 1]]]
    assert all(m.request_ids == ["b"] for m in only_b if isinstance(m, GapBatch))
    loaded = Recording(tmp_path / "rec").messages("c")  # through the request index
    assert [n.missing for m in loaded if isinstance(m, GapBatch) for n in m.notices()] == [[[3, 5]]]


def test_a_consumer_without_on_gap_batch_replays_a_gap_batch_as_its_gap_notices(tmp_path):
    from mia_stream.schemas import GapBatch

    class Gaps:
        def __init__(self):
            self.gaps = []

        def on_gap(self, m): self.gaps.append((m.request_id, m.producer_id, m.missing, m.reason))

    msgs = _lossy_columnar()
    with Recorder(tmp_path / "rec") as rec:
        for m in msgs:
            rec.write([bytes(f) for f in encode(m)])
    consumer = Gaps()
    replay(tmp_path / "rec", into=consumer)
    assert consumer.gaps == [(n.request_id, n.producer_id, n.missing, n.reason)
                             for m in msgs if isinstance(m, GapBatch) for n in m.notices()]


def test_a_missing_recording_is_an_error_not_a_wait_for_a_broker(tmp_path):
    """``--source x.mcap`` that does not exist used to be taken for a broker's run dir and wait forever."""
    from mia_stream.consumers import open_stream
    from mia_stream.errors import StreamError

    with pytest.raises(StreamError, match="no recording at .*missing.mcap"):
        open_stream(str(tmp_path / "missing.mcap"))
    cli = subprocess.run([sys.executable, "-m", "mia_stream.cli", "analyze", "token_probe", "--source",
                          str(tmp_path / "missing.mcap")], capture_output=True, text=True, timeout=120)
    assert cli.returncode != 0 and "no recording at" in cli.stderr
