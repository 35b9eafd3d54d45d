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
    from mia_stream.producer.publisher import FramePublisher

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
