"""The MCAP recorder and the recording reader: byte-identical frames, per-request index, rotation, and a
real ``kill -9`` of a recorder process fed over a real ZeroMQ socket."""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import msgpack
import numpy as np
import pytest

from mia_stream.schemas import SCHEMA_VERSION

import spec_decoder
from mia_stream.consumers import recording as recording_module
from mia_stream.consumers.recorder import Recorder
from mia_stream.consumers.recording import Recording, iter_recording
from mia_stream.schemas import (GapNotice, Heartbeat, StreamEnd, StreamStart, Tensor, TensorFrame, TokenFrame,
                                encode)

PY = sys.executable


def _frame(i: int, rid: str, seq: int, hidden: int = 4096, **enc) -> list[bytes]:
    """A deterministic TensorFrame: message ``i`` can be rebuilt byte for byte by the test."""
    hs = np.full((1, 1, hidden), i, dtype=np.float32)
    msg = TensorFrame(rid, "pub", 1, seq, seq, positions=[seq], token_ids=[i % 50000],
                      tensors=[Tensor.from_array("hs", hs, layers=[3])], time_ns=1_000 + i)
    return [bytes(f) for f in encode(msg, **enc)]


def _request(rid: str, n: int, start: int = 0) -> list[list[bytes]]:
    out = [[bytes(f) for f in encode(StreamStart(rid, "pub", 1, model="m", num_layers=4))]]
    out += [_frame(start + i, rid, i + 1, hidden=256) for i in range(n)]
    out.append([bytes(f) for f in encode(StreamEnd(rid, "pub", 1, n + 1, frames_sent=n + 2))])
    return out


def test_frames_come_back_byte_identical_in_order(tmp_path):
    rng = np.random.default_rng(0)
    bf16 = rng.integers(0, 2**16, size=(2, 3, 8), dtype=np.uint16)
    tensor = Tensor(name="hs", dtype="bfloat16", shape=bf16.shape, data=memoryview(bf16).cast("B"))
    sent = [
        *_request("a", 5),
        [bytes(f) for f in encode(TensorFrame("b", "p", 0, 1, 1, tensors=[tensor]), compression="lz4", checksum=True)],
        [bytes(f) for f in encode(TokenFrame("b", "p", 0, 2, 1, token_ids=[7]))],
        [bytes(f) for f in encode(GapNotice("b", "p", 0, missing=[[3, 4]], reason="hwm", origin="broker"))],
        *_request("c", 3, start=100),
    ]
    heartbeat = [bytes(f) for f in encode(Heartbeat("broker", "broker", 42))]
    with Recorder(tmp_path / "rec", chunk_bytes=2048) as rec:
        for i, frames in enumerate(sent):
            assert rec.write(frames, recv_time_ns=10_000 + i)
        assert rec.write(heartbeat)
    got = list(iter_recording(tmp_path / "rec", with_log_time=True))
    assert [g[0] for g in got] == sent
    assert [g[2] for g in got] == [10_000 + i for i in range(len(sent))]
    assert got[len(_request("a", 5)) + 2][1].count == 2  # the GapNotice, on request b's channel
    assert np.array_equal(got[len(_request("a", 5))][1].tensors[0].raw(), bf16)
    with_bus = list(iter_recording(tmp_path / "rec", include_bus=True))
    assert len(with_bus) == len(sent) + 1 and with_bus[-1][0] == heartbeat
    assert [f for f, _ in iter_recording(tmp_path / "rec", patterns=["b"])] == sent[len(_request("a", 5)):][:3]


def test_stock_mcap_reader_sees_schema_channels_metadata(tmp_path):
    from mcap.reader import NonSeekingReader, make_reader

    with Recorder(tmp_path / "rec", chunk_bytes=4096, source="ipc:///x") as rec:
        for frames in _request("r1", 10) + _request("r2", 10):
            rec.write(frames)
    part = tmp_path / "rec" / "part-00000.mcap"
    with open(part, "rb") as f:
        reader = make_reader(f)
        summary = reader.get_summary()
        assert summary.statistics.message_count == 24 and len(summary.chunk_indexes) > 1
        (schema,) = summary.schemas.values()
        assert (schema.name, schema.encoding) == ("mia_stream.multipart", "mia_stream/wire-format")
        assert {c.topic: c.message_encoding for c in summary.channels.values()} == {
            "r1": "mia_stream/multipart", "r2": "mia_stream/multipart"}
        (meta,) = list(reader.iter_metadata())
        assert meta.name == "mia_stream" and meta.metadata["schema_version"] == "{}.{}".format(*SCHEMA_VERSION)
        assert meta.metadata["source"] == "ipc:///x" and int(meta.metadata["recorder_start_ns"]) > 0
        assert reader.get_header().library.startswith("mia_stream ")
    with open(part, "rb") as f:  # CRC-validating linear read; data decoded with the spec's layout only
        datas = [m.data for _, _, m in NonSeekingReader(f, validate_crcs=True).iter_messages(log_time_order=False)]
    assert spec_decoder.decode(spec_decoder.decode_recorded(datas[1])).fields["seq"] == 1


class _CountingFile:
    def __init__(self, f):
        self._f = f
        self.bytes_read = 0

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


def test_one_request_loads_through_the_index_without_a_scan(tmp_path, monkeypatch):
    with Recorder(tmp_path / "rec", chunk_bytes=16 << 10) as rec:
        for r in range(40):
            for frames in _request(f"req-{r}", 20, start=r * 100):
                rec.write(frames)
    rec_dir = tmp_path / "rec"
    size = sum(p.stat().st_size for p in rec_dir.iterdir())
    recording = Recording(rec_dir)
    assert recording.requests() == [f"req-{r}" for r in range(40)]
    _CountingFile.total = 0
    monkeypatch.setattr(recording_module, "open", lambda *a, **k: _CountingFile(open(*a, **k)), raising=False)
    msgs = recording.messages("req-17")
    assert _CountingFile.total < size / 8, (_CountingFile.total, size)  # a few chunks, not the file
    assert [m.KIND for m in msgs] == ["start"] + ["tensors"] * 20 + ["end"]
    assert [m.tensors[0].numpy()[0, 0, 0] for m in msgs[1:-1]] == [1700.0 + i for i in range(20)]
    assert all(m.request_id == "req-17" for m in msgs)
    assert recording.frames("req-17") == _request("req-17", 20, start=1700)
    s = recording.summary()
    assert (s.messages, s.requests, s.parts, s.truncated_parts) == (40 * 22, 40, 1, [])


def test_rotation_by_size(tmp_path):
    sent = [_frame(i, f"r{i % 3}", i // 3 + 1) for i in range(300)]  # ~16 KiB each, ~4.8 MiB
    with Recorder(tmp_path / "rec", chunk_bytes=64 << 10, rotate_bytes=1 << 20) as rec:
        for frames in sent:
            rec.write(frames)
    parts = sorted((tmp_path / "rec").glob("part-*.mcap"))
    assert len(parts) >= 4
    assert all(p.stat().st_size <= (1 << 20) + (64 << 10) + 4096 for p in parts)
    recording = Recording(tmp_path / "rec")
    assert recording.parts == parts and recording.summary().truncated_parts == []
    assert [f for f, _ in iter_recording(tmp_path / "rec")] == sent
    assert recording.frames("r1") == sent[1::3]
    assert [p._summary is not None for p in recording._parts] == [True] * len(parts)  # each part finished
    assert [p.metadata()["part_index"] for p in recording._parts] == [str(i) for i in range(len(parts))]


def test_rotation_by_channel_count_and_appending_to_an_existing_recording(tmp_path):
    rids = [f"q{r:02d}" for r in range(23)]
    with Recorder(tmp_path / "rec", chunk_bytes=8 << 10, max_channels=5) as rec:
        for rid in rids:
            for frames in _request(rid, 2):
                rec.write(frames)
        for frames in _request("q00", 1, start=900):  # q00 again: a new channel in the current part
            rec.write(frames)
    recording = Recording(tmp_path / "rec")
    assert len(recording.parts) == 5
    assert [len(p.channels()) for p in recording._parts] == [5, 5, 5, 5, 4]
    assert recording.requests() == rids
    assert recording.frames("q07") == _request("q07", 2)
    assert recording.frames("q00") == _request("q00", 2) + _request("q00", 1, start=900)
    with Recorder(tmp_path / "rec") as rec:  # a restarted recorder appends a part, never overwrites
        rec.write(_request("late", 1)[0])
    assert Recording(tmp_path / "rec").parts[-1].name == "part-00005.mcap"
    assert Recording(tmp_path / "rec").requests()[-1] == "late"


def test_non_mia_stream_messages_are_counted_not_recorded(tmp_path):
    with Recorder(tmp_path / "rec") as rec:
        assert not rec.write([b"x\0", b"\xc1 not msgpack"])
        assert not rec.write([b"x\0"])
        assert not rec.write([b"", b"\x81\xa1v\x92\x03\x00"])  # {"v": [3, 0]}: another major version
        old = _request("old", 1)[0]  # a live 1.x peer's message: refused like any other major version
        header = msgpack.unpackb(old[1])
        assert header["v"][0] == 2
        assert not rec.write([old[0], msgpack.packb({**header, "v": [1, 3]})])
        assert rec.write(_request("ok", 1)[0])
        assert rec.stats.rejected == 4 and rec.stats.messages == 1
    assert [m.request_id for _, m in iter_recording(tmp_path / "rec")] == ["ok"]


# --- a real recorder process, killed -------------------------------------------------------------------------

N_SENT = 3000
CHUNK = 256 << 10


def _publish(endpoint: str, n: int, via_broker: bool) -> None:
    """A producer process: PUSH straight to the recorder, or a DEALER to the broker's producer endpoint."""
    import zmq

    sock = zmq.Context.instance().socket(zmq.DEALER if via_broker else zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    if via_broker:
        for r in range(4):
            sock.send_multipart([bytes(f) for f in encode(StreamStart(f"req-{r}", "pub", 1))], copy=False)
    for i in range(n):
        sock.send_multipart(_frame(i, f"req-{i % 4}", i // 4 + 1), copy=False)
        if i % 200 == 199:
            time.sleep(0.02)  # the test kills the recorder while this is still sending
    time.sleep(30)


def _expected(k: int, via_broker: bool) -> list[list[bytes]]:
    starts = [[bytes(f) for f in encode(StreamStart(f"req-{r}", "pub", 1))] for r in range(4)] if via_broker else []
    return (starts + [_frame(i, f"req-{i % 4}", i // 4 + 1) for i in range(N_SENT)])[:k]


@pytest.mark.slow
@pytest.mark.parametrize("via_broker", [False, True], ids=["pull", "broker"])
def test_kill_9_loses_at_most_the_last_chunk(tmp_path, via_broker):
    """A recorder process fed over real sockets (directly, or through a real broker) is killed with
    SIGKILL mid-stream: its file still opens and yields exactly a prefix of what was sent, covering every
    chunk that reached the disk."""
    rec_dir, run_dir = tmp_path / "rec", tmp_path / "run"
    if via_broker:
        from mia_stream.broker import run_broker_in_thread

        broker_cm = run_broker_in_thread(address=str(run_dir), consumer_queue_bytes=1 << 30)
        source_args, publish_to, ready = ["--broker", str(run_dir)], f"ipc://{run_dir}/producers.sock", None
    else:
        broker_cm = None
        source_args = ["--bind-pull", f"ipc://{tmp_path}/rec.sock"]
        publish_to, ready = f"ipc://{tmp_path}/rec.sock", tmp_path / "rec.sock"
    broker = broker_cm.__enter__() if broker_cm else None
    recorder = subprocess.Popen(
        [PY, "-m", "mia_stream.cli", "record", str(rec_dir), *source_args,
         "--chunk-bytes", str(CHUNK), "--flush-interval", "1000"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=Path(__file__).resolve().parents[1])
    publisher = multiprocessing.get_context("spawn").Process(target=_publish, args=(publish_to, N_SENT, via_broker),
                                                             daemon=True)
    try:
        deadline = time.monotonic() + 30
        while not (ready.exists() if ready else broker.stats()["consumers"]):
            assert recorder.poll() is None and time.monotonic() < deadline, recorder.stderr.read()
            time.sleep(0.02)
        publisher.start()
        part = rec_dir / "part-00000.mcap"
        while not (part.exists() and part.stat().st_size > 8 * CHUNK):
            assert time.monotonic() < deadline, "recorder wrote nothing"
            time.sleep(0.005)
        os.kill(recorder.pid, signal.SIGKILL)
        recorder.wait(10)
    finally:
        if recorder.poll() is None:
            recorder.kill()
            recorder.wait(10)
        if publisher.is_alive():
            publisher.kill()
            publisher.join(10)
        if broker_cm:
            broker_cm.__exit__(None, None, None)
    size = part.stat().st_size
    got = [frames for frames, _ in iter_recording(rec_dir)]
    k = len(got)
    assert 0 < k < N_SENT, k
    assert got == _expected(k, via_broker)  # exactly a prefix, byte for byte
    per_message = sum(map(len, got[-1])) + 4 * 5 + 31
    assert k * per_message >= size - CHUNK - (64 << 10), (k, size)  # every complete chunk on disk was read
    recording = Recording(rec_dir)
    summary = recording.summary()
    assert summary.truncated_parts == ["part-00000.mcap"] and summary.messages - summary.bus_messages == k
    assert recording.frames("req-2") == [f for f in got if f[0] == b"req-2\0"]  # streaming fallback, one request
