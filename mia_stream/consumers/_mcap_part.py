"""One MCAP part of a recording, read with every chunk checked (the reader ``recording`` builds on).

Rule: ``_Part`` owns one open file and what it learnt of it (summary, request index, whether it was cut short);
it reports damage (chunk CRCs, records that do not parse, compressed chunks past ``max_chunk_bytes``) as
``CorruptRecordingError`` naming the file and the offset, or, with ``skip_corrupt``, in its ``ReadReport``. The
recording format's names (channels, schema, metadata, index attachment) are defined here too, since both this
reader and the recorder write or read them; ``recording`` re-exports them.
"""

from __future__ import annotations

import io
import logging
import struct
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator

import msgpack
import numpy as np

from mia_stream.consumers._mcap_writer import (MAGIC, OP_ATTACHMENT, OP_CHANNEL, OP_CHUNK, OP_DATA_END, OP_FOOTER,
                                               OP_HEADER, OP_MESSAGE, OP_METADATA, OP_SCHEMA)
from mia_stream.errors import MiaStreamError
from mia_stream.schemas import SCHEMA_VERSION

MESSAGE_ENCODING = "mia_stream/multipart"
SCHEMA_NAME = "mia_stream.multipart"
SCHEMA_ENCODING = "mia_stream/wire-format"
SCHEMA_TEXT = (f"mia_stream wire format {SCHEMA_VERSION[0]}.{SCHEMA_VERSION[1]}: each message is "
               "u32le frame count, u32le length of each frame, then the frames [topic, msgpack header, *buffers] "
               "concatenated; see docs/wire-format.md").encode()
BUS_TOPIC = "_bus"
PRODUCER_TOPIC_PREFIX = "_producer/"  # + producer id: the channel of a producer's columnar messages
INDEX_ATTACHMENT = "mia_stream.request_index"  # per part: which producer-channel messages name each request
INDEX_MEDIA_TYPE = "application/msgpack"
METADATA_NAME = "mia_stream"
PART_GLOB = "part-*.mcap"
log = logging.getLogger(__name__)

_FOOTER_RECORD = 1 + 8 + 8 + 8 + 4  # opcode, length, summary start, summary offset start, summary crc
# MCAP opcodes (OP_*, _mcap_writer.py): 0x01..0x0F are the spec's records, 0x80..0xFF private ones (skipped);
# others mean damage


class RecordingError(MiaStreamError):
    """A recording that cannot be read (missing, not MCAP, or not written by mia_stream)."""


class CorruptRecordingError(RecordingError):
    """A recording whose bytes were damaged after they were written: a chunk whose CRC does not match, a
    record that does not parse, a compressed chunk past the bound. Its message names the file, the byte offset
    and what is wrong."""


@dataclass
class _RecordedMessage:
    channel_topic: str
    kind: str  # the channel's kind: "request", "producer" or "bus"
    log_time: int
    data: bytes

    @property
    def is_bus(self) -> bool:
        return self.kind == "bus"


def _kind(channel: Any) -> str:
    """A channel's kind from its metadata: "request" (one request's messages), "producer" (a producer's
    columnar messages) or "bus"."""
    return channel.metadata.get("kind", "request")


def _has_footer(f: io.BufferedReader) -> bool:
    f.seek(0, io.SEEK_END)
    size = f.tell()
    if size < 2 * len(MAGIC) + _FOOTER_RECORD:
        return False
    f.seek(size - len(MAGIC))
    return f.read(len(MAGIC)) == MAGIC


def max_chunk_bytes() -> int:
    """The most bytes a compressed chunk may declare (and decompress to):
    ``MIA_STREAM_RECORDING_MAX_CHUNK_BYTES``."""
    from mia_stream import settings

    return settings.get_size("MIA_STREAM_RECORDING_MAX_CHUNK_BYTES")


def _decompress(chunk: Any, limit: int) -> bytes:
    """A compressed chunk's records, never more than its declared size (itself at most ``limit``): a chunk
    that declares more is refused before any decompression, one that decompresses to more is corrupt."""
    declared = chunk.uncompressed_size
    if declared > limit:
        raise _Damage(f"a {chunk.compression} chunk declares {declared} bytes uncompressed, more than "
                      f"MIA_STREAM_RECORDING_MAX_CHUNK_BYTES ({limit}); refused before decompressing it "
                      "(mia-stream record compresses no chunk past it)")
    try:
        if chunk.compression == "lz4":
            import lz4.frame

            data = lz4.frame.LZ4FrameDecompressor().decompress(chunk.data, max_length=declared + 1)
        elif chunk.compression == "zstd":
            import zstandard

            reader = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(chunk.data))
            parts, got = [], 0
            while got <= declared:
                part = reader.read(declared + 1 - got)
                if not part:
                    break
                parts.append(part)
                got += len(part)
            data = b"".join(parts)
        else:
            raise _Damage(f"a chunk compressed with {chunk.compression!r}, which mia_stream does not read")
    except _Damage:
        raise
    except Exception as e:  # noqa: BLE001 (lz4/zstd errors on a damaged frame)
        raise _Damage(f"a {chunk.compression} chunk does not decompress ({type(e).__name__}: {e})") from None
    if len(data) != declared:
        more = "more" if len(data) > declared else f"{len(data)}"
        raise _Damage(f"a {chunk.compression} chunk declares {declared} bytes uncompressed and decompresses to "
                      f"{more} bytes")
    return data


def _chunk_records(body: bytes, limit: int) -> list[Any]:
    """The records of one chunk record's body (after opcode and length), with its CRC checked: an
    uncompressed chunk costs its own bytes, a compressed one at most ``limit``."""
    from mcap.data_stream import ReadDataStream
    from mcap.records import Chunk
    from mcap.stream_reader import breakup_chunk

    try:
        chunk = Chunk.read(ReadDataStream(io.BytesIO(body)))
    except Exception as e:  # noqa: BLE001 (a damaged length or string field)
        raise _Damage(f"an unreadable chunk header ({type(e).__name__}: {e})") from None
    if chunk.compression:
        data = _decompress(chunk, limit)
    else:
        data = chunk.data
        if chunk.uncompressed_size != len(data):
            raise _Damage(f"a chunk declares {chunk.uncompressed_size} bytes and holds {len(data)}")
    if chunk.uncompressed_crc:
        crc = zlib.crc32(data)
        if crc != chunk.uncompressed_crc:
            raise _Damage(f"chunk CRC mismatch (stored {chunk.uncompressed_crc:#010x}, computed {crc:#010x})")
    try:
        return breakup_chunk(Chunk(compression="", data=data, message_end_time=chunk.message_end_time,
                                   message_start_time=chunk.message_start_time, uncompressed_crc=0,
                                   uncompressed_size=len(data)))
    except Exception as e:  # noqa: BLE001 (records that do not parse, CRC unset)
        raise _Damage(f"chunk records do not parse ({type(e).__name__}: {e})") from None


class _Damage(Exception):
    """What is wrong with one record of a part (``_Part._damaged`` adds the file and the offset)."""


@dataclass
class ReadReport:
    """What reading a recording skipped: ``corrupt`` (with ``skip_corrupt``; else the first one raised
    ``CorruptRecordingError``) and ``truncated`` (parts cut short, e.g. a killed recorder: read up to their last
    complete chunk), one line each naming the file and what is wrong."""

    corrupt: list[str] = field(default_factory=list)
    truncated: list[str] = field(default_factory=list)


class RequestIndex:
    """A part's request index (the ``mia_stream.request_index`` attachment): for each request, the runs of
    consecutive messages of a producer channel that name it, as log-time ranges of that channel."""

    def __init__(self, data: bytes):
        try:
            index = msgpack.unpackb(data, raw=False)
            self.channels = [(c["topic"], np.frombuffer(c["log_times"], "<i8")) for c in index["channels"]]
            self._runs = {rid: np.frombuffer(r, "<i8").reshape(-1, 3) for rid, r in index["requests"].items()}
        except Exception as e:
            raise RecordingError(f"unreadable request index: {type(e).__name__}: {e}") from None

    def request_ids(self) -> list[str]:
        return list(self._runs)

    def ranges(self, request_id: str) -> list[tuple[str, int, int]]:
        """``(channel topic, first log time, last log time)`` of each run of messages naming the request."""
        out = []
        for c, first, last in self._runs.get(request_id, np.zeros((0, 3), "<i8")).tolist():
            topic, times = self.channels[c]
            out.append((topic, int(times[first]), int(times[last])))
        return out


class _Part:
    """One MCAP file: indexed reads when it has a summary, a streaming read of complete chunks otherwise.

    Every chunk read has its CRC checked, and a compressed chunk is bounded (``max_chunk_bytes``). Damage
    raises ``CorruptRecordingError`` naming the file, the offset and what is wrong; with ``skip_corrupt`` the
    damaged chunk (or, where the file cannot be followed past it, the rest of the part) is skipped and
    described in ``report.corrupt``. A part without a footer (a killed recorder) is read up to its last
    complete record and noted in ``report.truncated``: that is not damage."""

    def __init__(self, path: Path, *, skip_corrupt: bool = False, report: ReadReport | None = None):
        self.path = path
        self.truncated = False  # set once a read found it cut short (recorder killed)
        self.skip_corrupt = skip_corrupt
        self.report = report if report is not None else ReadReport()
        self._noted: set[str] = set()  # report lines already added (a part is read more than once)
        self._summary: Any = None
        self._index: Any = False  # not loaded yet
        self._limit = max_chunk_bytes()
        try:
            f = open(path, "rb")
        except OSError as e:
            raise RecordingError(f"{path}: cannot open it: {e.strerror or e}") from None
        with f:
            head = f.read(len(MAGIC))
            if head != MAGIC:
                what = "an empty file" if not head else "no MCAP magic at its start"
                raise RecordingError(f"{path} is not an MCAP file ({what})")
            self.complete = _has_footer(f)  # the writer finished it: reading stops short only on damage
            self.size = f.seek(0, io.SEEK_END)
            if self.complete:
                try:
                    self._summary = self._read_summary(f)
                except _Damage as e:  # the chunks themselves may be intact: read them in order
                    self._damaged(str(e) + ("; its chunks are read in file order instead" if skip_corrupt else ""),
                                  None)
                    self._summary = None
        self.indexed = self._summary is not None and bool(self._summary.chunk_indexes)
        if not self.indexed:
            self.truncated = not self.complete

    def _damaged(self, what: str, offset: int | None) -> None:
        where = f"{self.path}" + (f" at byte {offset}" if offset is not None else "")
        line = f"{where}: {what}"
        if not self.skip_corrupt:
            raise CorruptRecordingError(line)
        if line not in self._noted:
            self._noted.add(line)
            self.report.corrupt.append(line)
            log.warning("recording: skipped: %s", line)

    def _cut_short(self, offset: int) -> None:
        self.truncated = True
        line = (f"{self.path}: cut short at byte {offset} (no footer: its recorder did not finish it); read up "
                f"to its last complete chunk, {self.size - offset} bytes after it not read")
        if line not in self._noted:
            self._noted.add(line)
            self.report.truncated.append(line)

    def _read_summary(self, f: Any) -> Any:
        """The summary section, its CRC checked (the footer's ``summary_crc``)."""
        from mcap.reader import SeekingReader

        f.seek(self.size - len(MAGIC) - _FOOTER_RECORD)
        footer = f.read(_FOOTER_RECORD)
        opcode, _, summary_start, _, summary_crc = struct.unpack("<BQQQI", footer)
        if opcode != OP_FOOTER:
            raise _Damage("no footer record before the closing magic")
        if summary_start == 0:
            return None
        if not len(MAGIC) <= summary_start <= self.size - len(MAGIC) - _FOOTER_RECORD:
            raise _Damage(f"the footer's summary offset {summary_start} is outside the file")
        if summary_crc:
            f.seek(summary_start)
            crc = zlib.crc32(f.read(self.size - len(MAGIC) - 4 - summary_start))
            if crc != summary_crc:
                raise _Damage(f"summary CRC mismatch (stored {summary_crc:#010x}, computed {crc:#010x})")
        try:
            f.seek(0)
            return SeekingReader(f, record_size_limit=self.size).get_summary()
        except Exception as e:  # noqa: BLE001 (a summary without a CRC that does not parse)
            raise _Damage(f"unreadable summary ({type(e).__name__}: {e})") from None

    def channels(self) -> list[Any]:
        if self.indexed:
            return list(self._summary.channels.values())
        return list({c.id: c for c in self._stream_channels()}.values())

    def request_index(self) -> RequestIndex | None:
        """The part's request index, or None (a part without columnar messages, or cut short by a kill)."""
        if self._index is False:
            self._index = None
            for entry in (self._summary.attachment_indexes if self.indexed else ()):
                if entry.name == INDEX_ATTACHMENT:
                    data = self._attachment(entry.offset)
                    if data is not None:
                        self._index = RequestIndex(data)
        return self._index

    def _attachment(self, offset: int) -> bytes | None:
        """An attachment record's data, its CRC checked (None when damaged and skipped)."""
        from mcap.data_stream import ReadDataStream
        from mcap.records import Attachment

        with open(self.path, "rb") as f:
            f.seek(offset)
            head = f.read(9)
            try:
                if len(head) < 9:
                    raise _Damage("the request index's attachment is outside the file")
                opcode, length = struct.unpack("<BQ", head)
                if opcode != OP_ATTACHMENT or offset + 9 + length > self.size or length < 4:
                    raise _Damage(f"no attachment record where the summary says (opcode {opcode:#04x})")
                body = f.read(length)
                (stored,) = struct.unpack_from("<I", body, length - 4)
                if stored and zlib.crc32(memoryview(body)[:-4]) != stored:
                    raise _Damage("the request index's attachment CRC does not match")
                try:
                    return Attachment.read(ReadDataStream(io.BytesIO(body))).data
                except Exception as e:  # noqa: BLE001
                    raise _Damage(f"unreadable attachment ({type(e).__name__}: {e})") from None
            except _Damage as e:
                self._damaged(str(e), offset)
                return None

    def messages(self, topics: Iterable[str] | None = None, *, kinds: Iterable[str] | None = None,
                 start: int | None = None, end: int | None = None) -> Iterator[_RecordedMessage]:
        """Recorded messages in file order; ``topics`` selects channels via the chunk index, ``kinds`` by
        channel kind, ``start``/``end`` by log time (``end`` exclusive)."""
        wanted = None if topics is None else set(topics)
        kinds = None if kinds is None else set(kinds)
        if self.indexed:
            yield from self._indexed(wanted, kinds, start, end)
        else:
            yield from self._streamed(wanted, kinds, start, end)

    @staticmethod
    def _keep(channel: Any, wanted: set[str] | None, kinds: set[str] | None) -> bool:
        if kinds is not None and _kind(channel) not in kinds:
            return False
        return wanted is None or channel.topic in wanted

    def _indexed(self, wanted: set[str] | None, kinds: set[str] | None, start: int | None,
                 end: int | None) -> Iterator[_RecordedMessage]:
        """The chunks the summary's chunk index names for these topics and times, in file order (the recorder
        writes increasing log times within a part: file order is log-time order), each read here with its
        CRC checked and its decompression bounded."""
        summary = self._summary
        channels = summary.channels
        ids = None if wanted is None else {cid for cid, c in channels.items() if c.topic in wanted}
        with open(self.path, "rb") as f:
            for ci in sorted(summary.chunk_indexes, key=lambda c: c.chunk_start_offset):
                if start is not None and ci.message_end_time < start:
                    continue
                if end is not None and ci.message_start_time >= end:
                    continue
                if ids is not None and ci.message_index_offsets and not ids.intersection(ci.message_index_offsets):
                    continue
                records = self._chunk_at(f, ci.chunk_start_offset, ci.chunk_length)
                found = []
                for record in records:
                    if type(record).__name__ != "Message":
                        continue
                    channel = channels.get(record.channel_id)
                    if channel is None:
                        self._damaged(f"a message on channel {record.channel_id}, which the summary does not "
                                      "list", ci.chunk_start_offset)
                        continue
                    if ((start is None or record.log_time >= start) and (end is None or record.log_time < end)
                            and self._keep(channel, wanted, kinds)):
                        found.append(_RecordedMessage(channel.topic, _kind(channel), record.log_time, record.data))
                found.sort(key=lambda r: r.log_time)  # stable: file order among equal times
                yield from found

    def _chunk_at(self, f: Any, offset: int, length: int) -> list[Any]:
        """The records of the chunk the chunk index places at ``offset`` ([] when damaged and skipped)."""
        try:
            if not len(MAGIC) <= offset or offset + length > self.size or length < 9:
                raise _Damage(f"the chunk index names bytes {offset}..{offset + length}, outside the file")
            f.seek(offset)
            opcode, body_length = struct.unpack("<BQ", f.read(9))
            if opcode != OP_CHUNK or body_length != length - 9:
                raise _Damage(f"no chunk record where the chunk index says (opcode {opcode:#04x}, "
                              f"{body_length} bytes)")
            return _chunk_records(f.read(body_length), self._limit)
        except _Damage as e:
            self._damaged(str(e), offset)
            return []

    def _records(self) -> Iterator[Any]:
        """The part's records in file order (chunks opened, their CRCs checked). A record cut short by the end
        of a file without footer ends the readable part of a killed recorder's file; anything else that does
        not parse is damage."""
        from mcap.data_stream import ReadDataStream
        from mcap.records import Channel, Message as McapMessage, Metadata, Schema

        simple = {OP_CHANNEL: Channel.read, OP_SCHEMA: Schema.read, OP_METADATA: Metadata.read}
        with open(self.path, "rb") as f:
            pos = f.seek(len(MAGIC))
            while True:
                head = f.read(9)
                if len(head) < 9:
                    if self.complete:
                        self._damaged("the records end before the footer", pos)
                    else:
                        self._cut_short(pos)
                    return
                opcode, length = struct.unpack("<BQ", head)
                if pos + 9 + length > self.size:
                    if self.complete:
                        self._damaged(f"a record (opcode {opcode:#04x}) claims {length} bytes, past the end of "
                                      "the file; the rest of the part is not read", pos)
                    else:
                        self._cut_short(pos)
                    return
                if opcode == OP_FOOTER:
                    return
                if not (OP_HEADER <= opcode <= OP_DATA_END or opcode >= 0x80):
                    self._damaged(f"an unknown record opcode {opcode:#04x}; the rest of the part is not read", pos)
                    return
                if opcode == OP_CHUNK:
                    try:
                        records = _chunk_records(f.read(length), self._limit)
                    except _Damage as e:
                        self._damaged(str(e), pos)
                        records = []
                    yield from records
                elif opcode in simple or opcode == OP_MESSAGE:
                    body = f.read(length)
                    try:
                        stream = ReadDataStream(io.BytesIO(body))
                        record = McapMessage.read(stream, length) if opcode == OP_MESSAGE else simple[opcode](stream)
                    except Exception as e:  # noqa: BLE001
                        self._damaged(f"an unreadable record (opcode {opcode:#04x}: {type(e).__name__}: {e})", pos)
                    else:
                        yield record
                else:
                    f.seek(length, io.SEEK_CUR)
                pos += 9 + length

    def _stream_channels(self) -> Iterator[Any]:
        from mcap.records import Channel

        for record in self._records():
            if isinstance(record, Channel):
                yield record

    def _streamed(self, wanted: set[str] | None, kinds: set[str] | None, start: int | None,
                  end: int | None) -> Iterator[_RecordedMessage]:
        from mcap.records import Channel, Message as McapMessage

        channels: dict[int, Any] = {}
        for record in self._records():
            if isinstance(record, Channel):
                channels[record.id] = record
            elif isinstance(record, McapMessage):
                channel = channels.get(record.channel_id)
                if channel is None:
                    self._damaged(f"a message on channel {record.channel_id}, which no channel record declares",
                                  None)
                    continue
                if ((start is None or record.log_time >= start) and (end is None or record.log_time < end)
                        and self._keep(channel, wanted, kinds)):
                    yield _RecordedMessage(channel.topic, _kind(channel), record.log_time, record.data)

    def metadata(self) -> dict[str, str]:
        from mcap.records import Metadata

        if self.indexed:
            from mcap.reader import SeekingReader

            try:
                with open(self.path, "rb") as f:
                    reader = SeekingReader(f, record_size_limit=self.size)
                    reader._summary = self._summary
                    for record in reader.iter_metadata():
                        if record.name == METADATA_NAME:
                            return dict(record.metadata)
            except Exception as e:  # noqa: BLE001 (a metadata record that does not parse: no CRC covers it)
                self._damaged(f"unreadable metadata ({type(e).__name__}: {e})", None)
            return {}
        for record in self._records():
            if isinstance(record, Metadata) and record.name == METADATA_NAME:
                return dict(record.metadata)
        return {}
