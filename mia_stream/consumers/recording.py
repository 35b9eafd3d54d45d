"""Read mia_stream recordings: MCAP files (or a directory of rotated parts) written by ``mia-stream record``.

The format is specified in docs/wire-format.md, "Recording format". Every recorded message is the raw
multipart message as it was received, so ``iter_recording`` yields byte-identical frames plus the decoded
``Message``. A part whose recorder was killed (no summary/footer) is read by streaming its complete chunks.
"""

from __future__ import annotations

import fnmatch
import io
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

from mia_stream.errors import MalformedFrameError, MiaStreamError
from mia_stream.schemas import SCHEMA_VERSION, Message, decode

MESSAGE_ENCODING = "mia_stream/multipart"
SCHEMA_NAME = "mia_stream.multipart"
SCHEMA_ENCODING = "mia_stream/wire-format"
SCHEMA_TEXT = (f"mia_stream wire format {SCHEMA_VERSION[0]}.{SCHEMA_VERSION[1]}: each message is "
               "u32le frame count, u32le length of each frame, then the frames [topic, msgpack header, *buffers] "
               "concatenated; see docs/wire-format.md").encode()
BUS_TOPIC = "_bus"
METADATA_NAME = "mia_stream"
PART_GLOB = "part-*.mcap"
_MCAP_MAGIC = b"\x89MCAP0\r\n"


class RecordingError(MiaStreamError):
    """A recording that cannot be read (missing, not MCAP, or not written by mia_stream)."""


def pack_frames(frames: Sequence[Any]) -> bytes:
    """``mia_stream/multipart`` encoding: u32le count, u32le lengths, frames concatenated (one copy)."""
    views = [memoryview(getattr(f, "buffer", f)).cast("B") for f in frames]
    head = struct.pack(f"<{len(views) + 1}I", len(views), *(len(v) for v in views))
    return b"".join([head, *views])


def unpack_frames(data: bytes | memoryview) -> list[bytes]:
    """Inverse of ``pack_frames``; raises MalformedFrameError when the lengths do not add up."""
    view = memoryview(data)
    if len(view) < 4:
        raise MalformedFrameError(f"recorded message of {len(view)} bytes has no frame count")
    (count,) = struct.unpack_from("<I", view, 0)
    offset = 4 + 4 * count
    if offset > len(view):
        raise MalformedFrameError(f"recorded message claims {count} frames but holds {len(view)} bytes")
    lengths = struct.unpack_from(f"<{count}I", view, 4)
    if offset + sum(lengths) != len(view):
        raise MalformedFrameError(f"recorded frame lengths sum to {sum(lengths)}, message holds {len(view) - offset}")
    frames = []
    for n in lengths:
        frames.append(bytes(view[offset:offset + n]))
        offset += n
    return frames


def part_files(path: str | os.PathLike) -> list[Path]:
    """The MCAP files of a recording in order: the file itself, or a directory's parts by name."""
    p = Path(path)
    if p.is_dir():
        parts = sorted(p.glob(PART_GLOB)) or sorted(p.glob("*.mcap"))
        if not parts:
            raise RecordingError(f"{p} holds no .mcap files")
        return parts
    if not p.exists():
        raise RecordingError(f"no recording at {p}")
    return [p]


@dataclass
class _RecordedMessage:
    channel_topic: str
    is_bus: bool
    log_time: int
    data: bytes


def _is_bus(channel: Any) -> bool:
    return channel.metadata.get("kind") == "bus"


def _has_footer(f: io.BufferedReader) -> bool:
    f.seek(0, io.SEEK_END)
    size = f.tell()
    if size < 2 * len(_MCAP_MAGIC) + 29:
        return False
    f.seek(size - len(_MCAP_MAGIC))
    return f.read(len(_MCAP_MAGIC)) == _MCAP_MAGIC


class _Part:
    """One MCAP file: indexed reads when it has a summary, a streaming read of complete chunks otherwise."""

    def __init__(self, path: Path):
        self.path = path
        self.truncated = False  # set once a read found it cut short (recorder killed)
        self._summary: Any = None
        with open(path, "rb") as f:
            if f.read(len(_MCAP_MAGIC)) != _MCAP_MAGIC:
                raise RecordingError(f"{path} is not an MCAP file")
            if _has_footer(f):
                from mcap.reader import SeekingReader

                try:
                    f.seek(0)
                    self._summary = SeekingReader(f).get_summary()
                except Exception:  # a damaged summary: fall back to streaming the chunks
                    self._summary = None
        self.indexed = self._summary is not None and bool(self._summary.chunk_indexes)
        if not self.indexed:
            self.truncated = not self._summary

    def channels(self) -> list[Any]:
        if self.indexed:
            return list(self._summary.channels.values())
        return list({c.id: c for c in self._stream_channels()}.values())

    def messages(self, topics: Iterable[str] | None = None, *, bus: bool | None = None) -> Iterator[_RecordedMessage]:
        """Recorded messages in file order; ``topics`` (request ids) selects channels via the chunk index."""
        wanted = None if topics is None else set(topics)
        if self.indexed:
            yield from self._indexed(wanted, bus)
        else:
            yield from self._streamed(wanted, bus)

    def _keep(self, channel: Any, wanted: set[str] | None, bus: bool | None) -> bool:
        if bus is not None and _is_bus(channel) != bus:
            return False
        return wanted is None or channel.topic in wanted

    def _indexed(self, wanted: set[str] | None, bus: bool | None) -> Iterator[_RecordedMessage]:
        from mcap.reader import SeekingReader

        with open(self.path, "rb") as f:
            reader = SeekingReader(f)
            reader._summary = self._summary  # already read and validated in __init__
            # log_time order == file order: the recorder writes non-decreasing log times within a part.
            for _, channel, record in reader.iter_messages(topics=None if wanted is None else sorted(wanted),
                                                          log_time_order=True):
                if self._keep(channel, wanted, bus):
                    yield _RecordedMessage(channel.topic, _is_bus(channel), record.log_time, record.data)

    def _records(self) -> Iterator[Any]:
        from mcap.stream_reader import StreamReader

        with open(self.path, "rb") as f:
            records = StreamReader(f, skip_magic=False).records
            while True:
                try:
                    record = next(records)
                except StopIteration:
                    return
                except Exception:  # a record cut short by a crash ends the readable part of the file
                    self.truncated = True
                    return
                yield record

    def _stream_channels(self) -> Iterator[Any]:
        from mcap.records import Channel

        for record in self._records():
            if isinstance(record, Channel):
                yield record

    def _streamed(self, wanted: set[str] | None, bus: bool | None) -> Iterator[_RecordedMessage]:
        from mcap.records import Channel, Message as McapMessage

        channels: dict[int, Any] = {}
        for record in self._records():
            if isinstance(record, Channel):
                channels[record.id] = record
            elif isinstance(record, McapMessage):
                channel = channels.get(record.channel_id)
                if channel is None:
                    raise RecordingError(f"{self.path}: message on unknown channel {record.channel_id}")
                if self._keep(channel, wanted, bus):
                    yield _RecordedMessage(channel.topic, _is_bus(channel), record.log_time, record.data)

    def metadata(self) -> dict[str, str]:
        from mcap.records import Metadata

        if self.indexed:
            from mcap.reader import SeekingReader

            with open(self.path, "rb") as f:
                reader = SeekingReader(f)
                reader._summary = self._summary
                for record in reader.iter_metadata():
                    if record.name == METADATA_NAME:
                        return dict(record.metadata)
            return {}
        for record in self._records():
            if isinstance(record, Metadata) and record.name == METADATA_NAME:
                return dict(record.metadata)
        return {}


def _matches(request_id: str, patterns: Sequence[str]) -> bool:
    return any(fnmatch.fnmatchcase(request_id, p) for p in patterns)


def _decode(frames: list[bytes], where: str) -> Message:
    try:
        return decode(frames)
    except MiaStreamError as e:
        raise type(e)(f"{where}: {e}") from None


def iter_recording(path: str | os.PathLike, patterns: Sequence[str] = ("*",), *,
                   include_bus: bool = False, with_log_time: bool = False) -> Iterator[tuple]:
    """Each recorded message, in recorded order: ``(frames, message)`` (``(frames, message, log_time_ns)``
    with ``with_log_time``). ``patterns`` are globs on request ids; messages of the ``_bus`` channel
    (heartbeats and other messages without a request id) are yielded only with ``include_bus``.
    """
    patterns = tuple(patterns)
    for part_path in part_files(path):
        part = _Part(part_path)
        topics = None
        if patterns != ("*",):
            topics = [c.topic for c in part.channels() if not _is_bus(c) and _matches(c.topic, patterns)]
            if include_bus:
                topics.append(BUS_TOPIC)
            if not topics:
                continue
        for rec in part.messages(topics, bus=None if include_bus else False):
            frames = unpack_frames(rec.data)
            msg = _decode(frames, f"{part_path.name} @ {rec.log_time}")
            yield (frames, msg, rec.log_time) if with_log_time else (frames, msg)


@dataclass
class RecordingSummary:
    parts: int
    messages: int
    file_bytes: int
    requests: int
    bus_messages: int
    start_ns: int
    end_ns: int
    truncated_parts: list[str] = field(default_factory=list)
    metadata: dict[str, str] = field(default_factory=dict)

    @property
    def duration_s(self) -> float:
        return (self.end_ns - self.start_ns) / 1e9 if self.messages else 0.0


class Recording:
    """A recording on disk: its request ids, one request's messages (via the MCAP index), a summary."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self._parts = [_Part(p) for p in part_files(self.path)]

    @property
    def parts(self) -> list[Path]:
        return [p.path for p in self._parts]

    def requests(self) -> list[str]:
        """Request ids recorded, in order of first appearance."""
        seen: dict[str, None] = {}
        for part in self._parts:
            for c in sorted(part.channels(), key=lambda c: c.id):
                if not _is_bus(c):
                    seen.setdefault(c.topic, None)
        return list(seen)

    def frames(self, request_id: str) -> list[list[bytes]]:
        """The raw frames of one request's messages, loaded through the chunk index (no full scan)."""
        out = []
        for part in self._parts:
            if not any(c.topic == request_id and not _is_bus(c) for c in part.channels()):
                continue
            out += [unpack_frames(r.data) for r in part.messages([request_id], bus=False)]
        return out

    def messages(self, request_id: str) -> list[Message]:
        """One request's decoded messages in recorded order, loaded through the chunk index."""
        return [_decode(f, f"{self.path.name} request {request_id!r}") for f in self.frames(request_id)]

    def summary(self) -> RecordingSummary:
        messages = nbytes = bus = 0
        start, end = None, 0
        requests: set[str] = set()
        truncated = []
        for part in self._parts:
            nbytes += part.path.stat().st_size
            stats = part._summary.statistics if part.indexed else None
            if stats is not None and stats.message_count:
                for c in part.channels():
                    if _is_bus(c):
                        bus += stats.channel_message_counts.get(c.id, 0)
                    else:
                        requests.add(c.topic)
                messages += stats.message_count
                start = stats.message_start_time if start is None else min(start, stats.message_start_time)
                end = max(end, stats.message_end_time)
                continue
            for rec in part.messages():
                messages += 1
                bus += rec.is_bus
                if not rec.is_bus:
                    requests.add(rec.channel_topic)
                start = rec.log_time if start is None else min(start, rec.log_time)
                end = max(end, rec.log_time)
            if part.truncated:
                truncated.append(part.path.name)
        meta = self._parts[0].metadata() if self._parts else {}
        return RecordingSummary(len(self._parts), messages, nbytes, len(requests), bus, start or 0, end,
                                truncated, meta)
