"""The recorder's MCAP writer (consumers/_mcap_writer.py) against the format's own reader: the ``mcap`` package
(the project's reference implementation of https://mcap.dev/spec) reads every record back with CRCs validated,
and the footer's summary CRC is recomputed here from the file's bytes as the spec defines it."""

from __future__ import annotations

import os
import struct
import zlib

import numpy as np
import pytest

from mia_stream.consumers._mcap_writer import MAGIC, McapWriter


def _write(path, compression: str, messages, flush_after=(), uncompressed_after=()) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        w = McapWriter(fd, compression=compression)
        w.start("prof", "lib 1")
        schema = w.register_schema("s", "enc", b"schema text")
        channels = [w.register_channel(t, "mia", schema, {"kind": t}) for t in ("a", "b")]
        w.add_metadata("meta", {"k": "v"})
        for i, pieces in enumerate(messages):
            w.add_message(channels[i % 2], 1000 + i, pieces, 500 + i, i)
            if i in flush_after:
                w.flush()
            if i in uncompressed_after:
                w.flush(compressed=False)
        w.add_attachment(7, 8, "index", "application/x-msgpack", b"attached" * 100)
        w.finish()
        assert w.offset == os.fstat(fd).st_size
    finally:
        os.close(fd)


def _messages(n: int, pieces_per_message: int = 3) -> list[list]:
    rng = np.random.default_rng(n)
    return [[struct.pack("<I", i)] + [rng.integers(0, 1 << 16, size=(2, 1 + i % 5), dtype=np.uint16)
                                      for _ in range(pieces_per_message - 1)] for i in range(n)]


def _joined(pieces) -> bytes:
    return b"".join(memoryview(p).cast("B").tobytes() for p in pieces)


@pytest.mark.parametrize("compression", ["none", "lz4"])
def test_the_mcap_reader_reads_every_record_back_with_crcs_validated(tmp_path, compression):
    from mcap.reader import make_reader
    from mcap.stream_reader import StreamReader

    path = tmp_path / "p.mcap"
    messages = _messages(40)
    _write(path, compression, messages, flush_after={9, 30}, uncompressed_after={20})
    with open(path, "rb") as f:
        reader = make_reader(f, validate_crcs=True)
        got = [(ch.topic, m.log_time, m.publish_time, m.sequence, m.data) for _, ch, m in reader.iter_messages()]
        summary = reader.get_summary()
        attachments = list(reader.iter_attachments())
        metadata = list(reader.iter_metadata())
        header = reader.get_header()
    assert got == [("ab"[i % 2], 1000 + i, 500 + i, i, _joined(p)) for i, p in enumerate(messages)]
    assert header.profile == "prof" and header.library == "lib 1"
    assert summary.statistics.message_count == 40 and summary.statistics.channel_message_counts == {1: 20, 2: 20}
    assert (summary.statistics.message_start_time, summary.statistics.message_end_time) == (1000, 1039)
    assert [c.topic for c in summary.channels.values()] == ["a", "b"] and summary.schemas[1].data == b"schema text"
    chunks = summary.chunk_indexes
    assert [c.compression for c in chunks] == (["lz4", "", "lz4", "lz4"] if compression == "lz4" else [""] * 4)
    assert [(c.message_start_time, c.message_end_time) for c in chunks] == [(1000, 1009), (1010, 1020),
                                                                           (1021, 1030), (1031, 1039)]
    assert attachments[0].data == b"attached" * 100 and attachments[0].name == "index"
    assert metadata[0].name == "meta" and metadata[0].metadata == {"k": "v"}
    # every record in file order, CRCs (chunks, attachment) checked by the streaming reader
    with open(path, "rb") as f:
        kinds = [type(r).__name__ for r in StreamReader(f, validate_crcs=True, skip_magic=False).records]
    assert kinds[0] == "Header" and kinds[-1] == "Footer" and kinds.count("Message") == 40
    assert kinds.count("MessageIndex") == 8 and kinds.count("DataEnd") == 1


def test_the_footer_summary_crc_is_the_crc_of_the_summary_bytes(tmp_path):
    path = tmp_path / "p.mcap"
    _write(path, "none", _messages(5))
    data = path.read_bytes()
    assert data[:8] == MAGIC and data[-8:] == MAGIC
    footer = len(data) - 8 - (1 + 8 + 20)  # opcode, length, summary_start, summary_offset_start, crc
    opcode, length, summary_start, offsets_start, crc = struct.unpack_from("<BQQQI", data, footer)
    assert (opcode, length) == (0x02, 20) and summary_start < offsets_start < footer
    # spec: the CRC of every byte from the summary's start through the footer's summary_offset_start field
    assert crc == zlib.crc32(data[summary_start:footer + 1 + 8 + 16])


def test_a_chunk_of_more_pieces_than_one_writev_takes_is_written_whole(tmp_path):
    """1,801 pieces in one chunk (Linux takes at most 1,024 buffers per writev)."""
    from mcap.reader import make_reader

    path = tmp_path / "p.mcap"
    messages = _messages(600)
    _write(path, "none", messages)
    with open(path, "rb") as f:
        got = [m.data for _, _, m in make_reader(f, validate_crcs=True).iter_messages()]
    assert got == [_joined(p) for p in messages]


def test_each_message_index_entry_points_at_its_message_in_the_chunk(tmp_path):
    """Message indexes read by the spec's layout: every (log_time, offset) names a message record of that
    channel and time in the chunk's records (readers seek by them; the mcap reader does not check them)."""
    from mcap.reader import make_reader

    path = tmp_path / "p.mcap"
    _write(path, "none", _messages(30), flush_after={11})
    data = path.read_bytes()
    with open(path, "rb") as f:
        chunks = make_reader(f).get_summary().chunk_indexes
    seen = 0
    for ci in chunks:
        at = ci.chunk_start_offset
        assert data[at] == 0x06
        (name_len,) = struct.unpack_from("<I", data, at + 9 + 28)
        records_at = at + 9 + 28 + 4 + name_len + 8
        for channel, offset in ci.message_index_offsets.items():
            opcode, _, ch, nbytes = struct.unpack_from("<BQHI", data, offset)
            assert (opcode, ch) == (0x07, channel)
            entries = np.frombuffer(data, dtype="<u8", count=nbytes // 8, offset=offset + 15).reshape(-1, 2)
            for log_time, rel in entries:
                op, _, msg_channel, _, msg_log_time = struct.unpack_from("<BQHIQ", data, records_at + int(rel))
                assert (op, msg_channel, msg_log_time) == (0x05, channel, log_time)
                seen += 1
    assert seen == 30
