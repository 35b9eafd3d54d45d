"""Security and resource bounds (issue 24): hand-made attacker messages against a real broker process, real
sockets, real recordings. Each test names the issue's item; each would fail on the code before its fix.

What every test asserts beside the attack's own outcome: the broker process is alive, answers a stats request
within 2 s, and a legitimate stream published after the attack is delivered whole.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import msgpack
import numpy as np
import pytest
import zmq

from bus_helpers import (RawConsumer, RawProducer, free_base_port, processes, run_dir, start_broker, stats,
                         wait_for)
from mia_stream.bus import transport
from mia_stream.schemas import (ErrorNotice, Heartbeat, StreamEnd, StreamStart, Tensor, TensorFrame, TokenBatch,
                                TokenFrame, encode)

ROOT = Path(__file__).resolve().parents[1]


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def _json_stats(address: str, timeout: float = 2.0) -> bytes:
    """What the monitor page asks for every second: the stats as JSON."""
    sock = zmq.Context.instance().socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(transport.endpoints_for(address).stats)
        sock.send(b"json")
        assert sock.poll(int(timeout * 1000)), f"no JSON stats reply within {timeout} s"
        return sock.recv()
    finally:
        sock.close(0)


def _legit_stream_is_delivered(address: str, name: str) -> None:
    """A fresh producer's stream (start, 3 tokens, end) reaches a fresh consumer whole and in order."""
    consumer = RawConsumer(address, f"legit-reader-{name}", [f"legit-{name}"])
    try:
        time.sleep(0.3)
        prod = RawProducer(address, f"legit-producer-{name}/1")
        prod.hello()
        rid = f"legit-{name}"
        prod.send(StreamStart(rid, f"legit-{name}", 1, 0))
        for seq in (1, 2, 3):
            prod.send(TokenFrame(rid, f"legit-{name}", 1, seq, seq, token_ids=[seq]))
        prod.send(StreamEnd(rid, f"legit-{name}", 1, 4, finish_reason="length"))
        got = consumer.read(10.0, until=lambda ms: any(m.KIND == "end" for _, m in ms))
        kinds = [m.KIND for _, m in got if m.KIND != "gap"]
        assert kinds == ["start", "tokens", "tokens", "tokens", "end"], kinds
        prod.close()
    finally:
        consumer.close()


def _healthy(broker: subprocess.Popen, address: str, name: str) -> None:
    assert broker.poll() is None, f"the broker died: {broker.stderr.read() if broker.stderr else ''}"
    t0 = time.monotonic()
    stats(address, timeout=2.0)
    assert time.monotonic() - t0 < 2.0
    _legit_stream_is_delivered(address, name)


# ---------------------------------------------------------------------------------------------- 1, 12: stats

def test_1_heartbeat_stats_with_bytes_or_deep_nesting_do_not_kill_the_json_stats_reply():
    with run_dir() as d, processes() as procs:
        broker = start_broker(d)
        procs.append(broker)
        evil = RawProducer(d, "evil/1")
        evil.send(Heartbeat("evil", "producer", 1, 0, {"blob": b"\x00\xff" * 8}))
        deep: dict = {}
        cur = deep
        for _ in range(1000):
            cur["x"] = {}
            cur = cur["x"]
        evil.send([encode(Heartbeat("evil2", "producer", 1, 0, {}))[0],
                   msgpack.packb({**msgpack.unpackb(encode(Heartbeat("evil2", "producer", 1, 0, {}))[1]),
                                  "stats": deep})])
        time.sleep(0.5)
        reply = _json_stats(d)  # the monitor page's request
        assert reply.startswith(b"{")
        _healthy(broker, d, "one")
        evil.close()


def test_12_heartbeat_stats_are_bounded_per_peer_and_the_overflow_is_named():
    with run_dir() as d, processes() as procs:
        broker = start_broker(d)
        procs.append(broker)
        rss0 = _rss_mb(broker.pid)
        peers = []
        for i in range(10):
            p = RawProducer(d, f"fat-{i}/1")
            p.send(Heartbeat(f"fat-{i}", "producer", 1, 0, {"junk": "x" * (4 << 20)}))
            peers.append(p)
        time.sleep(1.0)
        s = stats(d, timeout=2.0)
        assert _rss_mb(broker.pid) - rss0 < 100, "40 MB of stats kept"
        assert s["totals"].get("refused_stats_too_large", 0) >= 10
        assert len(msgpack.packb(s)) < (1 << 20)
        _healthy(broker, d, "twelve")
        for p in peers:
            p.close()


# ---------------------------------------------------------------------------------------------- 2: shapes

def test_2_a_tensor_shape_with_huge_dims_is_refused_in_milliseconds():
    with run_dir() as d, processes() as procs:
        broker = start_broker(d)
        procs.append(broker)
        evil = RawProducer(d, "evil/1")
        evil.hello()
        evil.send(StreamStart("victim-2", "evil", 1, 0))
        frames = encode(TensorFrame("victim-2", "evil", 1, 1, 0,
                                    tensors=[Tensor.from_array("hs", np.zeros((1, 1, 4), np.float32))]))
        header = msgpack.unpackb(frames[1])
        header["tensors"][0]["shape"] = [(1 << 64) - 1 - i for i in range(100_000)]
        t0 = time.monotonic()
        evil.send([frames[0], msgpack.packb(header), *frames[2:]])
        got = evil.poll(3.0, until=lambda m: isinstance(m, ErrorNotice))
        assert any(isinstance(m, ErrorNotice) for m in got), "no error to the sender"
        assert time.monotonic() - t0 < 2.0
        _healthy(broker, d, "two")
        evil.close()


# ---------------------------------------------------------------------------------------------- 4: forgery

def test_4_another_producer_cannot_end_or_feed_a_stream_it_did_not_start():
    with run_dir() as d, processes() as procs:
        broker = start_broker(d)
        procs.append(broker)
        reader = RawConsumer(d, "reader", ["owned-*"])
        time.sleep(0.3)
        owner = RawProducer(d, "owner/1")
        owner.hello()
        owner.send(StreamStart("owned-1", "owner", 7, 0))
        owner.send(TokenFrame("owned-1", "owner", 7, 1, 1, token_ids=[11]))
        forger = RawProducer(d, "forger/1")
        forger.hello()
        forger.send(TokenFrame("owned-1", "owner", 7, 2, 2, token_ids=[666]))
        forger.send(TokenBatch("owner", 7, 3, ["owned-1"], [3], token_ids=[667]))
        forger.send(StreamEnd("owned-1", "owner", 7, 4, finish_reason="stop"))
        refusals = forger.poll(2.0, until=lambda m: isinstance(m, ErrorNotice))
        assert any(isinstance(m, ErrorNotice) for m in refusals), "the forger was told nothing"
        # the owner's own messages still go through, with its seqs
        owner.send(TokenFrame("owned-1", "owner", 7, 2, 2, token_ids=[12]))
        owner.send(StreamEnd("owned-1", "owner", 7, 3, finish_reason="length"))
        got = reader.read(10.0, until=lambda ms: any(m.KIND == "end" for _, m in ms))
        tokens = [t for _, m in got if m.KIND == "tokens" for t in m.token_ids]
        ends = [m for _, m in got if m.KIND == "end"]
        assert tokens == [11, 12] and len(ends) == 1 and ends[0].finish_reason == "length"
        assert stats(d)["totals"].get("refused_not_stream_owner", 0) >= 3
        _healthy(broker, d, "four")
        for p in (owner, forger):
            p.close()
        reader.close()


# ---------------------------------------------------------------------------------------------- 7, 11: floods

def test_7_a_batch_naming_400k_unknown_requests_is_refused_without_a_stall():
    with run_dir() as d, processes() as procs:
        broker = start_broker(d)
        procs.append(broker)
        rss0 = _rss_mb(broker.pid)
        evil = RawProducer(d, "evil/1")
        evil.hello()
        n = 400_000
        t0 = time.monotonic()
        evil.send(TokenBatch("evil", 1, 1, [f"r{i}" for i in range(n)], np.ones(n, np.int64),
                             token_ids=np.zeros(n, np.int64)))
        got = evil.poll(3.0, until=lambda m: isinstance(m, ErrorNotice))
        assert any(isinstance(m, ErrorNotice) for m in got)
        assert time.monotonic() - t0 < 2.0
        assert _rss_mb(broker.pid) - rss0 < 150
        _healthy(broker, d, "seven")
        evil.close()


def test_7_streams_a_producer_may_hold_open_are_bounded():
    with run_dir() as d, processes() as procs:
        broker = start_broker(d, "--max-streams-per-producer", "1000")
        procs.append(broker)
        evil = RawProducer(d, "evil/1")
        evil.hello()
        for i in range(1500):
            evil.send(StreamStart(f"never-ends-{i}", "evil", 1, 0))
        wait_for(lambda: stats(d)["totals"].get("refused_too_many_streams", 0) >= 500, timeout=20)
        assert any(isinstance(m, ErrorNotice) for m in evil.poll(1.0))
        _healthy(broker, d, "seven-b")
        evil.close()


def test_11_a_subscribe_with_100k_patterns_is_refused():
    with run_dir() as d, processes() as procs:
        broker = start_broker(d)
        procs.append(broker)
        evil = RawConsumer(d, "evil-consumer", [f"p{i}-*" for i in range(100_000)])
        got = evil.read(3.0, until=lambda ms: any(isinstance(m, ErrorNotice) for _, m in ms))
        assert any(isinstance(m, ErrorNotice) for _, m in got)
        _healthy(broker, d, "eleven")
        evil.close()


# ---------------------------------------------------------------------------------------------- 16: split bus

def test_16_a_second_broker_on_a_live_run_dir_refuses_to_start():
    with run_dir() as d, processes() as procs:
        broker = start_broker(d)
        procs.append(broker)
        second = subprocess.run([sys.executable, "-m", "mia_stream.broker", "--address", d], capture_output=True,
                                text=True, timeout=30, env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert second.returncode != 0
        assert "in use" in second.stderr and "Traceback" not in second.stderr
        _healthy(broker, d, "sixteen")


# ---------------------------------------------------------------------------------------------- 15: recordings

def _recording(path: Path) -> Path:
    from mia_stream.consumers.recorder import Recorder

    with Recorder(path, chunk_bytes=1024) as rec:
        rec.write(encode(StreamStart("rec-1", "p", 1, 0)))
        for seq in range(1, 40):
            rec.write(encode(TokenFrame("rec-1", "p", 1, seq, seq, token_ids=[seq])))
        rec.write(encode(StreamEnd("rec-1", "p", 1, 40, finish_reason="length")))
    return path


def _replay_cli(path: Path, *extra: str) -> subprocess.CompletedProcess:
    """``mia-stream replay PATH --consumer ...`` as a user runs it (a real consumer class, so that the run gets
    past argument parsing and reads the recording)."""
    return subprocess.run([sys.executable, "-m", "mia_stream.cli", "replay", str(path), "--consumer",
                           "mia_stream.consumers:Consumer", *extra], capture_output=True, text=True, timeout=120,
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})


def _one_line_error(r: subprocess.CompletedProcess, *words: str) -> str:
    """A failed run whose stderr is one line naming what is wrong (no traceback)."""
    lines = r.stderr.strip().splitlines()
    assert r.returncode != 0 and "Traceback" not in r.stderr and len(lines) == 1, (r.returncode, r.stderr)
    for w in words:
        assert w in lines[0], (w, lines[0])
    return lines[0]


def _mcap_records(data: bytes) -> list[tuple[int, int, bytes]]:
    """(offset, opcode, body) of each top-level record of an MCAP file's bytes, up to the footer."""
    import struct

    out, pos = [], 8
    while pos + 9 <= len(data):
        opcode, length = struct.unpack_from("<BQ", data, pos)
        out.append((pos, opcode, data[pos + 9:pos + 9 + length]))
        pos += 9 + length
        if opcode == 0x02:  # footer
            break
    return out


def _chunk_record(inner_size: int, inner_crc: int, compression: str, payload: bytes) -> bytes:
    """A hand-made MCAP chunk record (opcode 0x06) declaring ``inner_size`` bytes uncompressed."""
    import struct

    body = (struct.pack("<QQQI", 1, 2, inner_size, inner_crc) + struct.pack("<I", len(compression))
            + compression.encode() + struct.pack("<Q", len(payload)) + payload)
    return struct.pack("<BQ", 0x06, len(body)) + body


def test_15_recording_files_are_private_like_the_bus(tmp_path):
    old = os.umask(0)  # umask-independent: even a umask of 0 must not open them up
    try:
        rec = _recording(tmp_path / "deep" / "rec")
    finally:
        os.umask(old)
    files = list(rec.glob("*.mcap"))
    assert files
    for f in files:
        assert f.stat().st_mode & 0o777 == 0o600, oct(f.stat().st_mode)
    assert rec.stat().st_mode & 0o777 == 0o700, oct(rec.stat().st_mode)


@pytest.mark.parametrize("case", ["file", "dir_of_non_mcap", "empty_file", "dir_without_parts", "missing"])
def test_15_replay_of_a_non_mcap_file_is_a_one_line_error(tmp_path, case):
    from mia_stream.consumers.recording import RecordingError, iter_recording

    target = tmp_path / "target"
    if case == "file":
        target = tmp_path / "not-a-recording.mcap"
        target.write_bytes(b"hello, this is not mcap" * 10)
    elif case == "dir_of_non_mcap":
        target.mkdir()
        for i in range(3):
            (target / f"part-{i:05d}.mcap").write_bytes(b"GIF89a not mcap either" * 20)
    elif case == "empty_file":
        target = tmp_path / "empty.mcap"
        target.write_bytes(b"")
    elif case == "dir_without_parts":
        target.mkdir()
        (target / "notes.txt").write_text("no parts here")
    _one_line_error(_replay_cli(target), str(target.name))
    with pytest.raises(RecordingError):
        list(iter_recording(target))


def _flip_bytes_as_the_issue_did(part: Path) -> None:
    data = bytearray(part.read_bytes())
    for i in range(200, len(data) - 200, 97):
        data[i] ^= 0xFF
    part.write_bytes(bytes(data))


def test_15_a_recording_with_flipped_bytes_says_so(tmp_path):
    from mia_stream.consumers.recording import CorruptRecordingError, Recording, iter_recording

    rec = _recording(tmp_path / "rec")
    assert len(list(iter_recording(rec))) == 41  # intact: every message
    (part,) = rec.glob("*.mcap")
    _flip_bytes_as_the_issue_did(part)
    line = _one_line_error(_replay_cli(rec), part.name, "CRC")
    assert "byte" in line or "summary" in line
    with pytest.raises(CorruptRecordingError, match="part-00000.mcap"):
        list(iter_recording(rec))
    with pytest.raises(CorruptRecordingError):
        Recording(rec).summary()
    # asked to, it skips what is damaged and says how much: never "0 events, exit 0, no error"
    r = _replay_cli(rec, "--skip-corrupt")
    assert r.returncode == 1 and "Traceback" not in r.stderr and "damaged record(s) skipped" in r.stderr, r.stderr
    assert "skipped:" in r.stderr and "CRC mismatch" in r.stderr


def test_15_one_flipped_byte_in_one_chunk_is_named_and_skippable(tmp_path):
    """A single bit of damage inside one message's bytes (nothing else touched: footer, summary and index
    intact) is caught by the chunk CRC: the indexed read names the chunk; with skip_corrupt every other chunk's
    messages are read and the skipped chunk is counted."""
    from mia_stream.consumers.recording import CorruptRecordingError, ReadReport, Recording, iter_recording

    rec = _recording(tmp_path / "rec")
    (part,) = rec.glob("*.mcap")
    data = bytearray(part.read_bytes())
    chunks = [(off, body) for off, op, body in _mcap_records(bytes(data)) if op == 0x06]
    assert len(chunks) > 3
    off, body = chunks[2]
    data[off + 9 + len(body) - 3] ^= 0x01  # a token id byte inside the third chunk's last message
    part.write_bytes(bytes(data))
    with pytest.raises(CorruptRecordingError, match=rf"part-00000.mcap at byte {off}: chunk CRC mismatch"):
        list(iter_recording(rec))
    with pytest.raises(CorruptRecordingError, match="chunk CRC mismatch"):
        Recording(rec).messages("rec-1")
    report = ReadReport()
    got = list(iter_recording(rec, skip_corrupt=True, report=report))
    assert 0 < len(got) < 41 and len(report.corrupt) == 1 and f"at byte {off}" in report.corrupt[0]
    r = _replay_cli(rec)
    _one_line_error(r, "part-00000.mcap", f"at byte {off}", "chunk CRC mismatch")


def test_15_a_truncated_recording_still_reads_to_its_last_complete_chunk_and_says_so(tmp_path):
    rec = _recording(tmp_path / "rec")
    (part,) = rec.glob("*.mcap")
    data = part.read_bytes()
    chunks = [(off, body) for off, op, body in _mcap_records(data) if op == 0x06]
    off, body = chunks[5]
    part.write_bytes(data[:off + 9 + len(body) // 2])  # cut inside the sixth chunk: no footer, as after a kill
    from mia_stream.consumers.recording import ReadReport, iter_recording

    report = ReadReport()
    got = list(iter_recording(rec, report=report))
    assert 0 < len(got) < 41 and report.corrupt == [] and len(report.truncated) == 1
    r = _replay_cli(rec)
    assert r.returncode == 0 and "cut short" in r.stderr and "Traceback" not in r.stderr, r.stderr


def _bomb_file(tmp_path: Path, *, declared_honestly: bool) -> Path:
    """A recorder-made part whose first chunk is replaced by a hand-made lz4 chunk: the original records
    followed by zeros, 570 MB uncompressed, about 2 MB compressed (made streaming: the test never holds it
    whole). ``declared_honestly``: the chunk declares its 570 MB; else it claims the original records' size."""
    import zlib

    import lz4.frame

    rec = _recording(tmp_path / "src")
    (part,) = rec.glob("*.mcap")
    data = part.read_bytes()
    off, _, body = next(r for r in _mcap_records(data) if r[1] == 0x06)
    import struct

    inner_size = struct.unpack_from("<Q", body, 16)[0]
    clen = struct.unpack_from("<I", body, 28)[0]
    inner = body[32 + clen + 8:]
    assert len(inner) == inner_size
    total = 570 * 10**6
    comp = lz4.frame.LZ4FrameCompressor()
    pieces, crc = [comp.begin(), comp.compress(inner)], zlib.crc32(inner)
    zeros = bytes(1 << 20)
    left = total - len(inner)
    while left:
        n = min(left, len(zeros))
        pieces.append(comp.compress(zeros[:n]))
        crc = zlib.crc32(zeros[:n], crc)
        left -= n
    pieces.append(comp.flush())
    payload = b"".join(pieces)
    chunk = (_chunk_record(total, crc, "lz4", payload) if declared_honestly
             else _chunk_record(inner_size, zlib.crc32(inner), "lz4", payload))
    bomb = tmp_path / ("bomb" if declared_honestly else "liar")
    bomb.mkdir()
    (bomb / "part-00000.mcap").write_bytes(data[:off] + chunk)  # no footer: read by streaming, as a killed part
    assert (bomb / "part-00000.mcap").stat().st_size < 4 << 20
    return bomb


_READ_WITH_RSS = """
import sys
from mia_stream.consumers.recording import RecordingError, iter_recording
try:
    n = len(list(iter_recording(sys.argv[1])))
    print("READ", n)
except RecordingError as e:
    print("ERROR", e)
# VmHWM: this process image's peak RSS (ru_maxrss would carry over the forking pytest's peak across exec)
hwm = next(line for line in open("/proc/self/status") if line.startswith("VmHWM:"))
print("MAXRSS_MB", int(hwm.split()[1]) / 1024)
"""


@pytest.mark.parametrize("declared_honestly", [True, False], ids=["declares_570MB", "declares_less"])
def test_15_an_lz4_chunk_bomb_is_refused_with_bounded_memory(tmp_path, declared_honestly):
    bomb = _bomb_file(tmp_path, declared_honestly=declared_honestly)
    r = subprocess.run([sys.executable, "-c", _READ_WITH_RSS, str(bomb)], capture_output=True, text=True,
                       timeout=120, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr
    out = dict(line.split(" ", 1) for line in r.stdout.strip().splitlines())
    assert "ERROR" in out and "part-00000.mcap" in out["ERROR"] and "lz4 chunk" in out["ERROR"], r.stdout
    assert float(out["MAXRSS_MB"]) < 250, out  # the 570 MB were never allocated
    _one_line_error(_replay_cli(bomb), "part-00000.mcap", "lz4 chunk")


# ---------------------------------------------------------------------------------------------- 3: roles on tcp


def _curve_dealer(endpoint: str, keys, identity: str) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.IDENTITY, identity.encode())
    transport.connect(sock, endpoint, keys)
    return sock


def _analysis(producer_id: str, rid: str, seq: int = 0):
    from mia_stream.schemas import AnalysisBatch

    return AnalysisBatch(producer_id, 1, "risk", [rid], [seq], alerts=[1], labels={"why": ["forged?"]})


def _drain(sock: zmq.Socket, timeout: float) -> list:
    from mia_stream.schemas import decode, split_batch

    got, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not sock.poll(50):
            continue
        frames = sock.recv_multipart()
        for m in split_batch(frames) or [frames]:
            got.append(decode(m))
    return got


def test_3_on_tcp_each_role_has_its_own_keys_and_only_analyzer_keys_publish_analysis(tmp_path):
    from mia_stream.schemas import AnalysisBatch, Subscribe

    keys = tmp_path / "keys"
    assert transport.keys_main([str(keys)]) == 0  # roles: producer, consumer (steers), analyzer
    for role in ("producers", "consumers", "analyzers"):
        assert list((keys / "roles" / role).glob("*.key")), role
    load = lambda name: transport.load_client_keys(keys, name)  # noqa: E731
    address = f"tcp://127.0.0.1:{free_base_port()}"
    eps = transport.endpoints_for(address)
    with processes() as procs:
        procs.append(start_broker(address, "--keys", str(keys)))
        reader = _curve_dealer(eps.consumers, load("consumer"), "reader")
        reader.send_multipart(encode(Subscribe(["*"])))
        time.sleep(0.5)
        # a consumer key on the producers endpoint: ZAP refuses the connection, nothing it sends arrives
        viewer = _curve_dealer(eps.producers, load("consumer"), "viewer-as-producer/1")
        viewer.send_multipart(encode(_analysis("viewer", "victim-3")))
        # a producer key may publish streams, not analysis
        prod = _curve_dealer(eps.producers, load("producer"), "prod/1")
        prod.send_multipart(encode(StreamStart("victim-3", "prod", 1, 0)))
        prod.send_multipart(encode(_analysis("prod", "victim-3")))
        assert any(isinstance(m, ErrorNotice) and m.code == "not_authorised" for m in _drain(prod, 2.0))
        # an analyzer key publishes analysis under its own name only
        ana = _curve_dealer(eps.producers, load("analyzer"), "ana/1")
        ana.send_multipart(encode(_analysis("someone-else/risk", "victim-3")))
        ana.send_multipart(encode(_analysis("analyzer/risk/host:1", "victim-3")))
        assert any(isinstance(m, ErrorNotice) and m.code == "not_authorised" for m in _drain(ana, 2.0))
        got = [m for m in _drain(reader, 2.0) if isinstance(m, AnalysisBatch)]
        assert [m.producer_id for m in got] == ["analyzer/risk/host:1"], [m.producer_id for m in got]
        from mia_stream.broker import fetch_stats  # (stats on tcp need a key)

        s = fetch_stats(address, keys=load("consumer"))
        assert s["totals"].get("refused_role", 0) >= 2
        assert "viewer-as-producer/1" not in s["producers"]
        for sock in (reader, viewer, prod, ana):
            sock.close(0)


# ------------------------------------------------------------------- 3: acting on alerts takes only trusted analyzers

def _steers(peer: RawProducer, timeout: float) -> list:
    return [m for m in peer.poll(timeout, until=lambda m: m.KIND == "steer") if m.KIND == "steer"]


@pytest.mark.parametrize("watcher_policy", [False, True], ids=["alerts_column", "watcher_policy"])
def test_3_a_forged_alert_from_a_producer_is_not_acted_on_and_a_trusted_one_is(watcher_policy):
    """A real broker; an engine's control peer (a RawProducer under the control id the stream names); an
    ``AlertWatcher`` with an abort ``AlertActor`` on the bus (the confused deputy of item 3). A plain producer
    publishes an ``analysis`` with an alert for the request: it reaches the watcher, which ignores and counts
    it, and no steering command reaches the engine side. The same alert from an analyzer runner's id
    (``analyzer/...``) aborts the request."""
    import threading

    from mia_stream.analyzers._actions import AlertActor, AlertWatcher
    from mia_stream.analyzers._alerts import AlertAction, AlertPolicy
    from mia_stream.schemas import AnalysisBatch, SteeringAck

    def alert(producer_id: str, seq: int = 0) -> AnalysisBatch:
        return AnalysisBatch(producer_id, 1, "risk", ["victim-3t"], [seq], [1], [5],
                             {"risk": np.asarray([0.99], np.float32)}, {}, [1], step=3)

    with run_dir() as d, processes() as procs:
        broker = start_broker(d)
        procs.append(broker)
        control = RawProducer(d, "host:77:engine/1")  # the engine's control peer: steering commands land here
        control.hello()
        worker = RawProducer(d, "host:77:tp0/1")
        worker.hello()
        worker.send(StreamStart("victim-3t", "host:77:tp0", 1, 0, control_id="host:77:engine"))
        actor = AlertActor(d, AlertAction.parse("abort"), publish=False, timeout=5.0)
        policy = AlertPolicy.from_config({"value": "risk", "threshold": 0.5}) if watcher_policy else None
        watcher = AlertWatcher("risk", policy, actor)
        t = threading.Thread(target=watcher.run, args=(d,), kwargs={"idle_timeout": 6.0}, daemon=True)
        t.start()
        time.sleep(1.0)  # subscribed (from_start: the start is replayed to it anyway)

        forger = RawProducer(d, "vllm-lookalike/1")  # any producer peer: no analyzer key needed on ipc
        forger.hello()
        forger.send(alert("vllm-lookalike"))
        wait_for(lambda: watcher.counters["untrusted_analyses_ignored"] >= 1, timeout=5)  # it did arrive
        assert not _steers(control, 1.5), "a forged alert steered the request"
        assert actor.records == {} and watcher.alerts == []
        assert watcher.trust.ignored == {"vllm-lookalike": 1}

        analyzer = RawProducer(d, "analyzer-risk/1")
        analyzer.hello()
        analyzer.send(alert("analyzer/risk/host:1"))
        (cmd,) = _steers(control, 5.0)
        assert (cmd.request_id, cmd.action) == ("victim-3t", "abort")
        control.send(SteeringAck(cmd.command_id, cmd.request_id, True, applied_step=4, producer_id="host:77:engine"))
        assert actor.wait(["victim-3t"], timeout=10)
        assert actor.records["victim-3t"].ok and actor.counters["alerts_acted_on"] == 1
        assert actor.counters.get("untrusted_alerts_ignored", 0) == 0  # the watcher stopped the forgery first
        t.join(15)
        actor.close()
        _healthy(broker, d, "three-trust")
        for peer in (control, worker, forger, analyzer):
            peer.close()


def test_3_trusted_analyzers_are_prefixes_or_key_names(monkeypatch):
    """``MIA_STREAM_TRUSTED_ANALYZERS`` entries are prefixes (``NAME/``) or analyzer key names (``NAME`` and
    ``NAME/...``, as the broker's roles check them); ``own`` ids (an analyzer runner's) are trusted too."""
    from mia_stream.analyzers._actions import AnalysisTrust
    from mia_stream.schemas import AnalysisBatch

    def batch(pid: str) -> AnalysisBatch:
        return AnalysisBatch(pid, 1, "risk", ["r"], [0], [1], [0], {}, {}, [1])

    default = AnalysisTrust()
    assert default.prefixes == ("analyzer/",)
    assert default(batch("analyzer/risk/h:1")) and not default(batch("analyzer"))
    assert not default(batch("evil/1")) and not default(batch("analyzerX/risk")) and default.ignored["evil/1"] == 1
    monkeypatch.setenv("MIA_STREAM_TRUSTED_ANALYZERS", "risk-key, lab/")
    named = AnalysisTrust(own=("analyzer/mine/h:2",))
    assert named(batch("risk-key")) and named(batch("risk-key/a")) and named(batch("lab/x"))
    assert named(batch("analyzer/mine/h:2")) and not named(batch("risk-key2/a")) and not named(batch("analyzer/x"))
    monkeypatch.setenv("MIA_STREAM_TRUSTED_ANALYZERS", "*")
    assert AnalysisTrust()(batch("anyone"))


# ---------------------------------------------------------------------------------------------- 5: control identity

def test_5_a_second_connection_named_after_an_engines_control_id_gets_no_steering():
    from mia_stream.schemas import SteeringCommand

    with run_dir() as d, processes() as procs:
        broker = start_broker(d)
        procs.append(broker)
        control = RawProducer(d, "host:42:engine/1")  # the engine's control peer, connected first
        control.hello()
        worker = RawProducer(d, "host:42:tp0/1")
        worker.hello()
        worker.send(StreamStart("steered-5", "host:42:tp0", 1, 0, control_id="host:42:engine"))
        thief = RawProducer(d, "host:42:engine/evil")  # takes the predictable control id
        thief.hello()
        steerer = RawConsumer(d, "steerer", ["nothing-*"])
        time.sleep(0.3)
        steerer.sock.send_multipart(encode(SteeringCommand("c5", "steered-5", "abort")))
        assert any(m.KIND == "steer" for m in control.poll(3.0, until=lambda m: m.KIND == "steer"))
        assert not [m for m in thief.poll(1.0) if m.KIND == "steer"], "the thief got the steering command"
        assert stats(d)["totals"].get("refused_control_claim", 0) >= 1
        _healthy(broker, d, "five")
        for p in (control, worker, thief):
            p.close()
        steerer.close()


# ---------------------------------------------------------------------------------------------- 8: consumer pipe

def test_8_a_never_reading_consumer_with_window_0_pins_a_bounded_amount_of_broker_memory():
    from mia_stream.schemas import Subscribe

    with run_dir() as d, processes() as procs:
        broker = start_broker(d, "--consumer-queue-bytes", str(4 << 20))
        procs.append(broker)
        stuck = zmq.Context.instance().socket(zmq.DEALER)  # subscribes to everything, then never reads
        stuck.setsockopt(zmq.LINGER, 0)
        stuck.setsockopt(zmq.RCVHWM, 1)
        stuck.setsockopt(zmq.RCVBUF, 4096)
        stuck.setsockopt(zmq.IDENTITY, b"stuck")
        stuck.connect(transport.endpoints_for(d).consumers)
        stuck.send_multipart(encode(Subscribe(["*"], window_bytes=0, batch=True)))
        time.sleep(0.5)
        rss0 = _rss_mb(broker.pid)
        prod = RawProducer(d, "big/1")
        prod.hello()
        prod.send(StreamStart("flood-8", "big", 1, 0))
        payload = np.zeros((1, 1, 64 << 10), np.float32)  # 256 KiB a frame, 300 MiB in all
        for seq in range(1, 1201):
            prod.send(TensorFrame("flood-8", "big", 1, seq, seq, tensors=[Tensor.from_array("hs", payload)]))
            if seq % 100 == 0:
                time.sleep(0.05)
        wait_for(lambda: stats(d)["streams"].get("flood-8|big|1", {}).get("next_seq", 0) >= 1201, timeout=30)
        time.sleep(0.5)
        grown = _rss_mb(broker.pid) - rss0
        assert grown < 220, f"the broker holds {grown:.0f} MB for a consumer that never reads"
        assert stats(d)["consumers"]["stuck"]["dropped"] > 0
        _healthy(broker, d, "eight")
        prod.close()
        stuck.close(0)


# ---------------------------------------------------------------------------------------------- 9: gap floods

def test_9_a_flood_of_gap_notices_into_one_stream_is_merged_and_bounded():
    from mia_stream.schemas import GapNotice

    with run_dir() as d, processes() as procs:
        broker = start_broker(d, "--late-join-bytes", str(1 << 20))
        procs.append(broker)
        prod = RawProducer(d, "gappy/1")
        prod.hello()
        prod.send(StreamStart("gaps-9", "gappy", 1, 0))
        n = 20_000
        for seq in range(1, n + 1):
            prod.send(GapNotice("gaps-9", "gappy", 1, [[seq, seq]], "queue_full", "producer"))
        prod.send(TokenFrame("gaps-9", "gappy", 1, n + 1, 0, token_ids=[1]))
        wait_for(lambda: stats(d)["streams"].get("gaps-9|gappy|1", {}).get("next_seq", 0) > n, timeout=60)
        s = stats(d)
        assert s["streams"]["gaps-9|gappy|1"]["buffered_bytes"] <= 1 << 20, "the stream's buffer passed its limit"
        assert s["totals"].get("producer_gaps_merged", 0) >= n - 1024
        # a late joiner still learns every missing seq
        late = RawConsumer(d, "late-9", ["gaps-9"], from_start=True)
        got = late.read(10.0, until=lambda ms: any(m.KIND == "tokens" for _, m in ms))
        named = set()
        for _, m in got:
            if m.KIND == "gap":
                for a, b in m.missing:
                    named.update(range(a, b + 1))
        assert named == set(range(1, n + 1))
        _healthy(broker, d, "nine")
        prod.close()
        late.close()


# ---------------------------------------------------------------------------------------------- 10: late join

def test_10_evicted_late_join_parts_are_freed():
    with run_dir() as d, processes() as procs:
        broker = start_broker(d, "--late-join-bytes", str(20 << 20), "--late-join-total-bytes", str(20 << 20))
        procs.append(broker)
        prod = RawProducer(d, "fat/1")
        prod.hello()
        prod.send(StreamStart("fat-10", "fat", 1, 0))
        time.sleep(0.3)
        rss0 = _rss_mb(broker.pid)
        payload = np.zeros((1, 1, 4 << 20), np.float32)  # 16 MiB a frame
        for seq in range(1, 13):
            prod.send(TensorFrame("fat-10", "fat", 1, seq, seq, tensors=[Tensor.from_array("hs", payload)]))
            time.sleep(0.1)
        wait_for(lambda: stats(d)["streams"].get("fat-10|fat|1", {}).get("next_seq", 0) >= 13, timeout=30)
        time.sleep(0.5)  # a few housekeeping ticks
        s = stats(d)
        assert s["broker"]["late_join_buffer_bytes"] <= 20 << 20
        grown = _rss_mb(broker.pid) - rss0
        assert grown < 100, f"{grown:.0f} MB held with a 20 MB late-join budget"
        _healthy(broker, d, "ten")
        prod.close()
