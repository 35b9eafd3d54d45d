"""Read mia_stream recordings: MCAP files (or a directory of rotated parts) written by ``mia-stream record``.

The format is specified in docs/wire-format.md, "Recording format". Every recorded message is the multipart
message as it was received (ring-held tensors copied in), so ``iter_recording`` yields its frames plus the
decoded ``Message``; with patterns, a columnar message (which names many requests) is narrowed to the
matching requests, as the broker narrows it for a live consumer with those patterns. A part whose recorder
was killed (no summary/footer) is read by streaming its complete chunks. Recordings of schema 1.x are read
too (every 1.x kind is a 2.0 kind).
"""

from __future__ import annotations

import fnmatch
import io
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence

import msgpack
import numpy as np

from mia_stream.errors import MalformedFrameError, MiaStreamError
from mia_stream.schemas import SCHEMA_VERSION, Message, compact, decode, decode_header, select_requests

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
    if size < 2 * len(_MCAP_MAGIC) + 29:
        return False
    f.seek(size - len(_MCAP_MAGIC))
    return f.read(len(_MCAP_MAGIC)) == _MCAP_MAGIC


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
    """One MCAP file: indexed reads when it has a summary, a streaming read of complete chunks otherwise."""

    def __init__(self, path: Path):
        self.path = path
        self.truncated = False  # set once a read found it cut short (recorder killed)
        self._summary: Any = None
        self._index: Any = False  # not loaded yet
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

    def request_index(self) -> RequestIndex | None:
        """The part's request index, or None (a part without columnar messages, or cut short by a kill)."""
        if self._index is False:
            self._index = None
            if self.indexed and any(a.name == INDEX_ATTACHMENT for a in self._summary.attachment_indexes):
                from mcap.reader import SeekingReader

                with open(self.path, "rb") as f:
                    reader = SeekingReader(f)
                    reader._summary = self._summary
                    for attachment in reader.iter_attachments():
                        if attachment.name == INDEX_ATTACHMENT:
                            self._index = RequestIndex(attachment.data)
        return self._index

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
        from mcap.reader import SeekingReader

        with open(self.path, "rb") as f:
            reader = SeekingReader(f)
            reader._summary = self._summary  # already read and validated in __init__
            # log_time order == file order: the recorder writes increasing log times within a part.
            for _, channel, record in reader.iter_messages(topics=None if wanted is None else sorted(wanted),
                                                          log_time_order=True, **_time_range(start, end)):
                if self._keep(channel, wanted, kinds):
                    yield _RecordedMessage(channel.topic, _kind(channel), record.log_time, record.data)

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
                    raise RecordingError(f"{self.path}: message on unknown channel {record.channel_id}")
                if ((start is None or record.log_time >= start) and (end is None or record.log_time < end)
                        and self._keep(channel, wanted, kinds)):
                    yield _RecordedMessage(channel.topic, _kind(channel), record.log_time, record.data)

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


def _time_range(start: int | None, end: int | None) -> dict:
    """``iter_messages`` keywords of a log-time range [start, end): mcap 1.6 renamed them."""
    if start is None and end is None:
        return {}
    import inspect

    from mcap.reader import SeekingReader

    if "starting_at" in inspect.signature(SeekingReader.iter_messages).parameters:
        return {"starting_at": start, "ending_before": end}
    return {"start_time": start, "end_time": end}


def _matches(request_id: str, patterns: Sequence[str]) -> bool:
    return any(fnmatch.fnmatchcase(request_id, p) for p in patterns)


def _decode(frames: list[bytes], where: str) -> Message:
    try:
        return decode(frames, legacy=True)  # 1.x recordings stay readable
    except MiaStreamError as e:
        raise type(e)(f"{where}: {e}") from None


class _Matcher:
    """Which request ids match the patterns (each id checked once: columnar messages repeat them)."""

    def __init__(self, patterns: Sequence[str]):
        self.patterns: tuple = tuple(patterns)
        self._seen: dict[str, bool] = {}

    def __call__(self, request_id: str) -> bool:
        hit = self._seen.get(request_id)
        if hit is None:
            hit = self._seen[request_id] = _matches(request_id, self.patterns)
        return hit


def narrow(frames: list, matcher: Callable[[str], bool], where: str = "") -> list | None:
    """A recorded message that names many requests (columnar, or a gap batch) narrowed to the requests
    ``matcher`` accepts (as the broker narrows it for a consumer with those patterns: only the header is
    rewritten), the message itself when it accepts all of them, or None when it accepts none."""
    try:
        header = decode_header(frames, legacy=True)
    except MiaStreamError as e:
        raise type(e)(f"{where}: {e}") from None
    ids = header["request_ids"]
    keep = [i for i, rid in enumerate(ids) if matcher(rid)]
    if len(keep) == len(ids):
        return frames
    if not keep:
        return None
    return select_requests(frames, header, keep)[0]


def iter_recording(path: str | os.PathLike, patterns: Sequence[str] = ("*",), *,
                   include_bus: bool = False, with_log_time: bool = False) -> Iterator[tuple]:
    """Each recorded message, in recorded order: ``(frames, message)`` (``(frames, message, log_time_ns)``
    with ``with_log_time``). ``patterns`` are globs on request ids (a columnar message is narrowed to the
    matching requests, and skipped when none match); messages of the ``_bus`` channel (heartbeats and other
    messages without a request id) are yielded only with ``include_bus``.
    """
    patterns = tuple(patterns)
    kinds = ("request", "producer", "bus") if include_bus else ("request", "producer")
    matcher = None if patterns == ("*",) else _Matcher(patterns)
    for part_path in part_files(path):
        part = _Part(part_path)
        topics = None
        if matcher is not None:
            topics = [c.topic for c in part.channels()
                      if _kind(c) == "producer" or (_kind(c) == "request" and matcher(c.topic))]
            if include_bus:
                topics.append(BUS_TOPIC)
            if not topics:
                continue
        for rec in part.messages(topics, kinds=kinds):
            frames = unpack_frames(rec.data)
            where = f"{part_path.name} @ {rec.log_time}"
            if matcher is not None and rec.kind == "producer":
                frames = narrow(frames, matcher, where)
                if frames is None:
                    continue
            msg = _decode(frames, where)
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
    """A recording on disk: its request ids, one request's messages (via the MCAP and request indexes), a summary."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self._parts = [_Part(p) for p in part_files(self.path)]

    @property
    def parts(self) -> list[Path]:
        return [p.path for p in self._parts]

    def requests(self) -> list[str]:
        """Request ids recorded, in order of first appearance (per part: request channels, then requests
        named only by columnar messages)."""
        seen: dict[str, None] = {}
        for part in self._parts:
            for c in sorted(part.channels(), key=lambda c: c.id):
                if _kind(c) == "request":
                    seen.setdefault(c.topic, None)
            index = part.request_index()
            if index is not None:
                for rid in index.request_ids():
                    seen.setdefault(rid, None)
        return list(seen)

    def frames(self, request_id: str) -> list[list[bytes]]:
        """The frames of one request's messages in recorded order, loaded through the MCAP chunk index and the
        request index (no full scan): its own channel's messages as recorded, and the producer-channel
        messages that name it, narrowed to it and compacted (only its rows). A part without a request index
        (cut short by a kill) has its producer channels read whole."""
        out = []
        matcher = {request_id}.__contains__
        for part in self._parts:
            where = f"{part.path.name} request {request_id!r}"
            channels = part.channels()
            found: list[_RecordedMessage] = []
            if any(c.topic == request_id and _kind(c) == "request" for c in channels):
                found += part.messages([request_id], kinds=("request",))
            producers = [c.topic for c in channels if _kind(c) == "producer"]
            if producers:
                index = part.request_index()
                if index is not None:
                    for topic, first, last in index.ranges(request_id):
                        found += part.messages([topic], kinds=("producer",), start=first, end=last + 1)
                else:
                    found += part.messages(producers, kinds=("producer",))
                found.sort(key=lambda r: r.log_time)  # recorded order: log times increase within a part
            for rec in found:
                frames = unpack_frames(rec.data)
                if rec.kind == "producer":
                    narrowed = narrow(frames, matcher, where)
                    if narrowed is None:
                        continue
                    frames = [bytes(f) for f in compact(narrowed)] if narrowed is not frames else frames
                out.append(frames)
        return out

    def messages(self, request_id: str) -> list[Message]:
        """One request's decoded messages in recorded order (columnar ones narrowed to it), loaded through the
        MCAP chunk index and the request index."""
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
                    if _kind(c) == "bus":
                        bus += stats.channel_message_counts.get(c.id, 0)
                    elif _kind(c) == "request":
                        requests.add(c.topic)
                index = part.request_index()
                if index is not None:
                    requests.update(index.request_ids())
                messages += stats.message_count
                start = stats.message_start_time if start is None else min(start, stats.message_start_time)
                end = max(end, stats.message_end_time)
                continue
            for rec in part.messages():
                messages += 1
                bus += rec.is_bus
                if rec.kind == "request":
                    requests.add(rec.channel_topic)
                start = rec.log_time if start is None else min(start, rec.log_time)
                end = max(end, rec.log_time)
            if part.truncated:
                truncated.append(part.path.name)
        meta = self._parts[0].metadata() if self._parts else {}
        return RecordingSummary(len(self._parts), messages, nbytes, len(requests), bus, start or 0, end,
                                truncated, meta)
