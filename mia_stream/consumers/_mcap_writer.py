"""An MCAP writer (https://mcap.dev/spec) whose message bytes go from the caller's buffers to the kernel with
no copy in this process: a chunk holds its messages by reference until it closes, then its record header and
every message piece go out in ``os.writev`` calls.

Why not the ``mcap`` package's Writer: it copies a message into its chunk builder, copies the chunk into the
chunk record and again into its record builder (three copies, each a fresh allocation that faults its pages
in), after the recorder had joined the frames into one bytes (a fourth). On the 2-core dev machine it wrote
64 MiB step batches at 233 MB/s against 991 MB/s for ``write(2)`` of the same bytes (bench_record_rate.py).
The files it and this writer produce are the same records in the same places; the ``mcap`` package's reader
is the tests' reference for them.

Rule: a writer owns one file descriptor from ``start`` to ``finish`` and is its only writer; ``offset`` is
where the next record goes. Records reach the file in data-section order. Between ``add_message`` and the
chunk's close the caller must not change the buffers it passed (the recorder passes bytes or zmq frames it
no longer touches). The data-section CRC is not computed (0, as the ``mcap`` Writer's default); chunk CRCs,
attachment CRCs and the summary CRC are.
"""

from __future__ import annotations

import os
import struct
import zlib
from typing import Any, Iterable, Sequence

MAGIC = b"\x89MCAP0\r\n"
# record opcodes (the spec's; _mcap_part.py reads with the same)
OP_HEADER, OP_FOOTER, OP_SCHEMA, OP_CHANNEL, OP_MESSAGE, OP_CHUNK, OP_MESSAGE_INDEX = 1, 2, 3, 4, 5, 6, 7
OP_CHUNK_INDEX, OP_ATTACHMENT, OP_ATTACHMENT_INDEX, OP_STATISTICS = 8, 9, 10, 11
OP_METADATA, OP_METADATA_INDEX, OP_SUMMARY_OFFSET, OP_DATA_END = 12, 13, 14, 15
_IOV_MAX = 1024  # buffers per writev (Linux's IOV_MAX)


def _str(s: str) -> bytes:
    b = s.encode()
    return struct.pack("<I", len(b)) + b


def _string_map(d: dict[str, str]) -> bytes:
    body = b"".join(_str(k) + _str(v) for k, v in d.items())
    return struct.pack("<I", len(body)) + body


def _record(opcode: int, body: bytes) -> bytes:
    return struct.pack("<BQ", opcode, len(body)) + body


class McapWriter:
    """``start`` → ``register_schema`` / ``register_channel`` / ``add_metadata`` / ``add_message`` /
    ``add_attachment`` / ``flush`` → ``finish``. ``flush(compressed=False)`` closes a chunk uncompressed
    whatever ``compression`` says (a message too large for a reader to decompress)."""

    def __init__(self, fd: int, *, compression: str = "none", offset: int = 0):
        if compression not in ("none", "lz4"):
            raise ValueError(f"compression must be 'none' or 'lz4', got {compression!r}")
        self._fd, self.compression, self.offset = fd, compression, offset
        self._schemas: list[bytes] = []
        self._channels: list[bytes] = []
        self._chunk_indexes: list[bytes] = []
        self._attachment_indexes: list[bytes] = []
        self._metadata_indexes: list[bytes] = []
        self._message_count = 0
        self._start_time = self._end_time = 0
        self._channel_counts: dict[int, int] = {}
        self._reset_chunk()

    # ------------------------------------------------------------------------------------------ the file

    def _write(self, pieces: Sequence[Any]) -> None:
        """All of ``pieces`` at ``offset``: writev in groups of at most IOV_MAX, a short write resumed."""
        views = [v for v in (memoryview(p).cast("B") for p in pieces) if len(v)]
        i = 0
        while i < len(views):
            batch = views[i:i + _IOV_MAX]
            n = os.writev(self._fd, batch)
            self.offset += n
            for v in batch:
                if n >= len(v):
                    n -= len(v)
                    i += 1
                else:
                    views[i] = v[n:]
                    break

    def start(self, profile: str = "", library: str = "") -> None:
        self._write([MAGIC, _record(OP_HEADER, _str(profile) + _str(library))])

    # ------------------------------------------------------------------------------------------ records

    def register_schema(self, name: str, encoding: str, data: bytes) -> int:
        schema_id = len(self._schemas) + 1
        rec = _record(OP_SCHEMA, struct.pack("<H", schema_id) + _str(name) + _str(encoding)
                      + struct.pack("<I", len(data)) + data)
        self._schemas.append(rec)
        self._chunk_add(rec)
        return schema_id

    def register_channel(self, topic: str, message_encoding: str, schema_id: int,
                         metadata: dict[str, str] | None = None) -> int:
        channel_id = len(self._channels) + 1
        rec = _record(OP_CHANNEL, struct.pack("<HH", channel_id, schema_id) + _str(topic) + _str(message_encoding)
                      + _string_map(metadata or {}))
        self._channels.append(rec)
        self._chunk_add(rec)
        return channel_id

    def add_metadata(self, name: str, metadata: dict[str, str]) -> None:
        start = self.offset
        rec = _record(OP_METADATA, _str(name) + _string_map(metadata))
        self._write([rec])
        self._metadata_indexes.append(_record(OP_METADATA_INDEX, struct.pack("<QQ", start, len(rec)) + _str(name)))

    def add_message(self, channel_id: int, log_time: int, data: Any, publish_time: int, sequence: int = 0) -> None:
        """``data``: one buffer, or a sequence of buffers that together are the message's data."""
        pieces = [memoryview(data).cast("B")] if isinstance(data, (bytes, bytearray, memoryview)) \
            else [memoryview(p).cast("B") for p in data]
        size = sum(map(len, pieces))
        self._index.setdefault(channel_id, []).append((log_time, self._chunk_size))
        self._chunk_add(struct.pack("<BQHIQQ", OP_MESSAGE, 22 + size, channel_id, sequence, log_time, publish_time),
                        *pieces, size=31 + size)
        if self._chunk_messages == 0:
            self._chunk_start_time = self._chunk_end_time = log_time
        self._chunk_start_time = min(self._chunk_start_time, log_time)
        self._chunk_end_time = max(self._chunk_end_time, log_time)
        self._chunk_messages += 1
        self._start_time = log_time if self._message_count == 0 else min(self._start_time, log_time)
        self._end_time = max(self._end_time, log_time)
        self._message_count += 1
        self._channel_counts[channel_id] = self._channel_counts.get(channel_id, 0) + 1

    def add_attachment(self, create_time: int, log_time: int, name: str, media_type: str, data: bytes) -> None:
        self.flush()
        start = self.offset
        body = struct.pack("<QQ", log_time, create_time) + _str(name) + _str(media_type) + struct.pack("<Q", len(data))
        crc = zlib.crc32(data, zlib.crc32(body))
        rec_head = struct.pack("<BQ", OP_ATTACHMENT, len(body) + len(data) + 4) + body
        self._write([rec_head, data, struct.pack("<I", crc)])
        length = len(rec_head) + len(data) + 4
        self._attachment_indexes.append(_record(OP_ATTACHMENT_INDEX, struct.pack(
            "<QQQQQ", start, length, log_time, create_time, len(data)) + _str(name) + _str(media_type)))

    # ------------------------------------------------------------------------------------------ chunks

    def _reset_chunk(self) -> None:
        self._pieces: list[Any] = []
        self._chunk_size = 0
        self._chunk_messages = 0
        self._chunk_start_time = self._chunk_end_time = 0
        self._index: dict[int, list[tuple[int, int]]] = {}

    def _chunk_add(self, *pieces: Any, size: int | None = None) -> None:
        self._pieces.extend(pieces)
        self._chunk_size += len(pieces[0]) if size is None else size

    @property
    def chunk_bytes(self) -> int:
        """Bytes of records in the chunk being filled."""
        return self._chunk_size

    def flush(self, compressed: bool = True) -> None:
        """Close the chunk being filled (a chunk without messages stays open: its schema and channel records
        wait for a message, as in the ``mcap`` Writer) and hand it to the kernel with its message indexes."""
        if not self._chunk_messages:
            return
        crc = 0
        for p in self._pieces:
            crc = zlib.crc32(p, crc)
        if compressed and self.compression == "lz4":
            import lz4.frame

            payload: list[Any] = [lz4.frame.compress(b"".join(memoryview(p).cast("B") for p in self._pieces))]
            name, payload_size = "lz4", len(payload[0])
        else:
            payload, name, payload_size = self._pieces, "", self._chunk_size
        fields = struct.pack("<QQQI", self._chunk_start_time, self._chunk_end_time, self._chunk_size, crc) \
            + _str(name) + struct.pack("<Q", payload_size)
        head = struct.pack("<BQ", OP_CHUNK, len(fields) + payload_size) + fields
        chunk_start = self.offset
        self._write([head, *payload])
        chunk_length = self.offset - chunk_start
        index_start = self.offset
        offsets, indexes = {}, []
        for channel_id, entries in self._index.items():
            offsets[channel_id] = index_start + sum(map(len, indexes))
            flat = [v for e in entries for v in e]
            indexes.append(_record(OP_MESSAGE_INDEX, struct.pack(f"<HI{len(flat)}Q", channel_id, 8 * len(flat), *flat)))
        self._write(indexes)
        offset_map = b"".join(struct.pack("<HQ", c, o) for c, o in offsets.items())
        self._chunk_indexes.append(_record(OP_CHUNK_INDEX, struct.pack(
            "<QQQQ", self._chunk_start_time, self._chunk_end_time, chunk_start, chunk_length)
            + struct.pack("<I", len(offset_map)) + offset_map
            + struct.pack("<Q", self.offset - index_start) + _str(name)
            + struct.pack("<QQ", payload_size, self._chunk_size)))
        self._reset_chunk()

    # ------------------------------------------------------------------------------------------ the end

    def finish(self) -> None:
        """The last chunk, data end, the summary (schemas, channels, statistics, chunk / attachment /
        metadata indexes, one summary offset per group), the footer and the closing magic."""
        self.flush()
        self._write([_record(OP_DATA_END, struct.pack("<I", 0))])
        summary_start = self.offset
        counts = b"".join(struct.pack("<HQ", c, n) for c, n in self._channel_counts.items())
        statistics = _record(OP_STATISTICS, struct.pack(
            "<QHIIIIQQ", self._message_count, len(self._schemas), len(self._channels),
            len(self._attachment_indexes), len(self._metadata_indexes), len(self._chunk_indexes),
            self._start_time, self._end_time) + struct.pack("<I", len(counts)) + counts)
        groups = [(OP_SCHEMA, self._schemas), (OP_CHANNEL, self._channels), (OP_STATISTICS, [statistics]),
                  (OP_CHUNK_INDEX, self._chunk_indexes), (OP_ATTACHMENT_INDEX, self._attachment_indexes),
                  (OP_METADATA_INDEX, self._metadata_indexes)]
        summary, offsets, at = [], [], summary_start
        for opcode, records in groups:
            if not records:
                continue
            length = sum(map(len, records))
            offsets.append(_record(OP_SUMMARY_OFFSET, struct.pack("<BQQ", opcode, at, length)))
            summary.extend(records)
            at += length
        offsets_start = at
        footer_head = struct.pack("<BQQQ", OP_FOOTER, 20, summary_start, offsets_start)
        crc = 0
        for piece in _chain(summary, offsets, [footer_head]):
            crc = zlib.crc32(piece, crc)
        self._write([*summary, *offsets, footer_head, struct.pack("<I", crc), MAGIC])


def _chain(*lists: Iterable[bytes]) -> Iterable[bytes]:
    for items in lists:
        yield from items
