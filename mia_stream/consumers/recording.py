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
import logging
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

# the format's names and errors live with the part reader; re-exported here, where the recorder and users take them
from mia_stream.consumers._mcap_part import (BUS_TOPIC, INDEX_ATTACHMENT, INDEX_MEDIA_TYPE,  # noqa: F401
                                             MESSAGE_ENCODING, METADATA_NAME, PART_GLOB, PRODUCER_TOPIC_PREFIX,
                                             SCHEMA_ENCODING, SCHEMA_NAME, SCHEMA_TEXT, CorruptRecordingError,
                                             ReadReport, RecordingError, RequestIndex, _kind, _Part,
                                             _RecordedMessage, max_chunk_bytes)
from mia_stream.errors import MalformedFrameError, MiaStreamError
from mia_stream.schemas import Message, compact, decode, decode_header, select_requests

log = logging.getLogger(__name__)


def frame_pieces(frames: Sequence[Any]) -> list[memoryview]:
    """``mia_stream/multipart`` encoding as pieces, no byte copied: the u32le count and u32le lengths, then each
    frame. Their concatenation is ``pack_frames``."""
    views = [memoryview(getattr(f, "buffer", f)).cast("B") for f in frames]
    return [memoryview(struct.pack(f"<{len(views) + 1}I", len(views), *(len(v) for v in views))), *views]


def pack_frames(frames: Sequence[Any]) -> bytes:
    """``mia_stream/multipart`` encoding: u32le count, u32le lengths, frames concatenated (one copy)."""
    return b"".join(frame_pieces(frames))


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
            raise RecordingError(f"{p} holds no .mcap files: not a recording")
        return parts
    if not p.exists():
        raise RecordingError(f"{p}: no such file or directory")
    if not p.is_file():
        raise RecordingError(f"{p}: not a recording (neither a file nor a directory)")
    return [p]



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
                   include_bus: bool = False, with_log_time: bool = False, skip_corrupt: bool = False,
                   report: ReadReport | None = None) -> Iterator[tuple]:
    """Each recorded message, in recorded order: ``(frames, message)`` (``(frames, message, log_time_ns)``
    with ``with_log_time``). ``patterns`` are globs on request ids (a columnar message is narrowed to the
    matching requests, and skipped when none match); messages of the ``_bus`` channel (heartbeats and other
    messages without a request id) are yielded only with ``include_bus``.

    A damaged part (a chunk whose CRC does not match, a record that does not parse, a compressed chunk past
    ``MIA_STREAM_RECORDING_MAX_CHUNK_BYTES``) raises ``CorruptRecordingError`` when the reader reaches it; with
    ``skip_corrupt`` it is skipped and described in ``report.corrupt``. Parts cut short by a killed recorder
    are read up to their last complete chunk and listed in ``report.truncated``.
    """
    report = report if report is not None else ReadReport()
    patterns = tuple(patterns)
    kinds = ("request", "producer", "bus") if include_bus else ("request", "producer")
    matcher = None if patterns == ("*",) else _Matcher(patterns)
    for part_path in part_files(path):
        part = _Part(part_path, skip_corrupt=skip_corrupt, report=report)
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
    corrupt: list[str] = field(default_factory=list)  # what was skipped as damaged (``skip_corrupt``)

    @property
    def duration_s(self) -> float:
        return (self.end_ns - self.start_ns) / 1e9 if self.messages else 0.0


class Recording:
    """A recording on disk: its request ids, one request's messages (via the MCAP and request indexes), a summary."""

    def __init__(self, path: str | os.PathLike, *, skip_corrupt: bool = False):
        """``skip_corrupt``: skip damaged chunks (described in ``report.corrupt``) instead of raising
        ``CorruptRecordingError``."""
        self.path = Path(path)
        self.report = ReadReport()
        self._parts = [_Part(p, skip_corrupt=skip_corrupt, report=self.report) for p in part_files(self.path)]

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
                                truncated, meta, list(self.report.corrupt))
