"""Record bus messages into MCAP files as received (format: docs/wire-format.md §7).

    with Recorder("runs/rec1") as rec:
        rec.write(frames)            # the raw multipart message, e.g. from recv_multipart(copy=False)

One MCAP channel per request id (topic = request id) for per-request messages (start, end, gap, steering,
and 1.x-style tensors/tokens), one per producer (``_producer/<producer_id>``) for its messages that name many
requests (step and token batches, analyses, and the gap batches that name its streams' losses), messages without a request id on ``_bus``. Tensors a message holds in a
producer's shared-memory ring are copied in (a step batch: compacted to the rows it carries). When a part is
finished it gets a request index (an MCAP attachment): which messages of each producer channel name each
request, so one request loads without scanning the file. Chunks are written to the OS as soon as they are
complete and at least every ``flush_interval_s``, so a killed recorder loses at most the chunk being filled.
Parts rotate by size and before MCAP's u16 channel-id limit. ``compression="lz4"`` writes LZ4-frame chunks
(MCAP's own chunk compression, which the reader undoes), each within what a reader decompresses; a message
larger than that goes uncompressed in a chunk of its own. ``budget_bytes``: once the data messages recorded
would pass it, the recorder records no more data and closes each stream's recording with one gap notice of
reason ``recorder_budget`` naming every seq it left out (``_budget``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import re
import signal
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import msgpack
import numpy as np

from mia_stream import settings
from mia_stream.consumers._budget import RecordingBudget
from mia_stream.consumers._mcap_part import max_chunk_bytes
from mia_stream.consumers._mcap_writer import McapWriter
from mia_stream.consumers.recording import (BUS_TOPIC, INDEX_ATTACHMENT, INDEX_MEDIA_TYPE, MESSAGE_ENCODING,
                                            METADATA_NAME, PART_GLOB, PRODUCER_TOPIC_PREFIX, SCHEMA_ENCODING,
                                            SCHEMA_NAME, SCHEMA_TEXT, frame_pieces)
from mia_stream.errors import WireError
from mia_stream.schemas import MESSAGE_TYPES, MULTI_REQUEST_KINDS, SCHEMA_VERSION, encode, inline_shm, shm_loss_gaps
from mia_stream.bus.shm_ring import ShmRingReader
from mia_stream.schemas._codec import SHM_RING_KEY

log = logging.getLogger(__name__)

DEFAULT_CHUNK_BYTES = 4 << 20
DEFAULT_ROTATE_BYTES = 1 << 30
DEFAULT_MAX_CHANNELS = 65_000  # MCAP channel ids are u16 (max 65,535); keep a margin
DEFAULT_FLUSH_INTERVAL_S = 1.0
_MESSAGE_RECORD_OVERHEAD = 31  # opcode, length, channel id, sequence, log and publish time
_UNBOUNDED = 1 << 62


@dataclass
class RecorderStats:
    messages: int = 0
    bytes: int = 0  # recorded message bytes (frames + framing)
    parts: int = 0
    channels: int = 0
    rejected: int = 0  # messages whose header is not a mia_stream header: counted and logged, not recorded
    shm_lost: int = 0  # messages whose shared-memory tensors were gone: recorded as gaps instead (one gap batch
    # for a columnar message naming several requests, else a GapNotice)
    budget_dropped: int = 0  # data messages past the byte budget: named in recorder_budget gaps instead


def _mia_stream_version() -> str:
    try:
        from importlib.metadata import version

        return version("mia_stream")
    except Exception:
        return "unknown"


class Recorder:
    """Writes raw bus messages into an append-only, chunked, indexed MCAP recording directory."""

    def __init__(self, out_dir: str | os.PathLike, *, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                 rotate_bytes: int = DEFAULT_ROTATE_BYTES, max_channels: int = DEFAULT_MAX_CHANNELS,
                 flush_interval_s: float = DEFAULT_FLUSH_INTERVAL_S, patterns: Sequence[str] = ("*",),
                 source: str = "", budget_bytes: int = 0, compression: str = "none"):
        if not 1 <= max_channels <= 65_535:
            raise ValueError(f"max_channels must be in [1, 65535], got {max_channels}")
        self.out_dir = Path(out_dir)
        if self.out_dir.suffix == ".mcap":
            raise ValueError(f"{self.out_dir} looks like a file: a recording is a directory of part-NNNNN.mcap files")
        _private_dir(self.out_dir)
        self.chunk_bytes, self.rotate_bytes, self.max_channels = chunk_bytes, rotate_bytes, max_channels
        self.flush_interval_s = flush_interval_s
        self._patterns, self._source = list(patterns), source
        self._start_ns = time.time_ns()
        self.stats = RecorderStats()
        self._writer: McapWriter | None = None
        self._fd = -1
        self._part_path: Path | None = None
        self._channels: dict[str, int] = {}  # topic -> channel id, in the current part
        self._sequences: dict[int, int] = {}
        # producer channel id -> (log time, request ids) of each of its messages in the current part: the index
        self._batch_log: dict[int, tuple[list, list]] = {}
        self._part_index = self._next_part_index()
        self._chunk_fill = 0
        self._part_bytes = 0
        self._last_flush = time.monotonic()
        self._last_log_time = 0
        self._closed = False
        self._shm: ShmRingReader | None = None
        if compression not in ("none", "lz4"):
            raise ValueError(f"compression must be 'none' or 'lz4', got {compression!r}")
        self.compression = compression
        self._compressed_chunk_limit = max_chunk_bytes()
        self.budget = RecordingBudget(budget_bytes) if budget_bytes else None

    # ------------------------------------------------------------------------------------------ lifecycle

    def __enter__(self) -> "Recorder":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        """Finish the current part (summary, index, footer). Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self.budget is not None and self.budget.pending:  # every stream's seqs left out, named
            for gap in self.budget.take_all():
                frames = encode(gap)
                self._write(frames, self._header_of(frames), None)
        self._finish_part()
        if self._shm is not None:
            self._shm.close()

    @property
    def current_part(self) -> Path | None:
        return self._part_path if self._writer is not None else None

    # ------------------------------------------------------------------------------------------ writing

    def write(self, frames: Sequence[Any], *, recv_time_ns: int | None = None) -> bool:
        """Record one raw multipart message. Returns False (and counts it) if it is not a mia_stream message."""
        if self._closed:
            raise RuntimeError("recorder is closed")
        header = self._header_of(frames)
        if header is None:
            self.stats.rejected += 1
            return False
        if self.budget is not None and self.budget.exhausted and not self.budget.admits(header.get("kind"), 0, 0):
            self._leave_out(header)  # (before copying ring bytes it would not keep)
            return True
        if SHM_RING_KEY in header:  # a recording keeps the bytes, not a producer's ring position
            messages = self._inline_shm(frames, header)
        else:
            messages = [(frames, header)]
        for frames, header in messages:
            self._write(frames, header, recv_time_ns)
        return True

    def _write(self, frames: Sequence[Any], header: dict, recv_time_ns: int | None) -> None:
        columnar = header.get("kind") in MULTI_REQUEST_KINDS  # indexed by the requests it names
        topic = self._topic_of(frames, header)
        now = time.time_ns() if recv_time_ns is None else recv_time_ns
        # strictly increasing within a part: log-time order is recorded order, and a time range on one
        # channel names exactly the messages the request index lists
        log_time = max(now, self._last_log_time + 1)
        self._last_log_time = log_time
        publish_time = header.get("time_ns") if isinstance(header.get("time_ns"), int) else 0
        data = frame_pieces(frames)  # the recorded bytes, not joined: the writer hands them to the kernel as they are
        size = sum(map(len, data))
        budget = self.budget
        if budget is not None:
            if not budget.admits(header.get("kind"), self.stats.bytes, size):
                self._leave_out(header)
                return
            rid = header.get("request_id")
            if budget.pending and isinstance(rid, str):  # its stream's left-out seqs come before this message
                for gap in budget.take_gaps(rid):
                    gap_frames = encode(gap)
                    self._write(gap_frames, self._header_of(gap_frames), recv_time_ns)
        if self._writer is None:
            self._open_part()
        elif (self._part_bytes + self._chunk_fill + size > self.rotate_bytes and self._part_bytes + self._chunk_fill > 0):
            self._rotate()
        channel = self._channels.get(topic)
        if channel is None:
            if len(self._channels) >= self.max_channels:
                self._rotate()
            channel = self._register_channel(topic)
        record_bytes = size + _MESSAGE_RECORD_OVERHEAD
        oversized = self.compression != "none" and record_bytes > self._compressed_chunk_limit
        if self._chunk_fill and (oversized or (self.compression != "none" and
                                               self._chunk_fill + record_bytes > self._compressed_chunk_limit)):
            self.flush()  # a compressed chunk stays within what a reader decompresses
        seq = self._sequences[channel]
        self._sequences[channel] = seq + 1
        self._writer.add_message(channel_id=channel, log_time=log_time, data=data,
                                 publish_time=publish_time if publish_time > 0 else log_time, sequence=seq & 0xFFFFFFFF)
        if columnar:
            log = self._batch_log.setdefault(channel, ([], []))
            log[0].append(log_time)
            log[1].append(header.get("request_ids") or ())
        self._chunk_fill += record_bytes
        self.stats.messages += 1
        self.stats.bytes += size
        if oversized:
            self.flush(compressed=False)
        elif self._chunk_fill >= self.chunk_bytes:
            self.flush()
        else:
            self.tick()

    def _leave_out(self, header: dict) -> None:
        if not self.stats.budget_dropped:
            log.warning("recorder: the budget of %d bytes is spent: recording no more data (gaps of reason %r)",
                        self.budget.limit, "recorder_budget")
        self.stats.budget_dropped += 1
        self.budget.drop(header)

    def _inline_shm(self, frames: Sequence[Any], header: dict) -> list[tuple[list, dict]]:
        """The message with its ring-held bytes inline (a step batch compacted to its rows); when the ring
        lost them, the gaps that replace it (``shm_loss_gaps``: a step batch's as one GapBatch)."""
        if self._shm is None:
            self._shm = ShmRingReader()
        try:
            frames = inline_shm(frames, self._shm)
        except WireError as e:
            self.stats.shm_lost += 1
            log.warning("recorder: recorded gaps for a message whose tensors are gone: %s", e)
            return [(f, self._header_of(f)) for f in (encode(g) for g in shm_loss_gaps(header, e, "consumer"))]
        return [(frames, self._header_of(frames))]

    def tick(self) -> None:
        """Flush a partly filled chunk once it is ``flush_interval_s`` old (call this when idle too)."""
        if self._chunk_fill and time.monotonic() - self._last_flush >= self.flush_interval_s:
            self.flush()

    def flush(self, compressed: bool = True) -> None:
        """Close the chunk in progress and hand it (with its message index) to the OS. ``compressed=False``
        writes it uncompressed whatever ``compression`` says: a message larger than a reader decompresses
        (``MIA_STREAM_RECORDING_MAX_CHUNK_BYTES``; an 8B model's all-layer decode step is 64 MiB) goes in a
        chunk of its own that the reader reads from the file, unbounded by that limit."""
        if self._writer is not None and self._chunk_fill:
            self._writer.flush(compressed=compressed)
            self._part_bytes = self._writer.offset
            self._chunk_fill = 0
        self._last_flush = time.monotonic()

    # ------------------------------------------------------------------------------------------ internals

    @staticmethod
    def _header_of(frames: Sequence[Any]) -> dict | None:
        """The header map of a mia_stream message of this major version, or None (logged)."""
        if len(frames) < 2:
            return None
        try:
            header = msgpack.unpackb(getattr(frames[1], "buffer", frames[1]), raw=False)
        except Exception:
            log.warning("recorder: a message whose header is not msgpack was not recorded")
            return None
        if (not isinstance(header, dict) or not isinstance(header.get("v"), list) or not header["v"]
                or header["v"][0] != SCHEMA_VERSION[0] or header.get("kind") not in MESSAGE_TYPES):
            log.warning("recorder: a message with header v=%r kind=%r was not recorded",
                        header.get("v") if isinstance(header, dict) else None,
                        header.get("kind") if isinstance(header, dict) else None)
            return None
        return header

    @staticmethod
    def _topic_of(frames: Sequence[Any], header: dict) -> str:
        """The channel key: the request id, or NUL + producer id / bus (a request id never starts with NUL)."""
        if header.get("kind") in MULTI_REQUEST_KINDS:
            return "\0p" + str(header.get("producer_id", ""))
        rid = header.get("request_id")
        if isinstance(rid, str):
            return rid
        return "\0" + BUS_TOPIC

    def _next_part_index(self) -> int:
        indices = [int(m.group(1)) for p in self.out_dir.glob(PART_GLOB)
                   if (m := re.fullmatch(r"part-(\d+)\.mcap", p.name))]
        return max(indices) + 1 if indices else 0

    def _open_part(self) -> None:
        path = self.out_dir / f"part-{self._part_index:05d}.mcap"
        # never overwrite a part; 0600 whatever the umask (the bus is 0600: a recording holds the same text)
        self._part_path = path
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o600)
        os.fchmod(self._fd, 0o600)
        # Chunks are closed by this class (size and age); records go straight to the kernel (no user buffer).
        self._writer = McapWriter(self._fd, compression=self.compression)
        self._writer.start(profile="", library=f"mia_stream {_mia_stream_version()}")
        self._schema_id = self._writer.register_schema(SCHEMA_NAME, SCHEMA_ENCODING, SCHEMA_TEXT)
        self._writer.add_metadata(METADATA_NAME, {
            "mia_stream_version": _mia_stream_version(),
            "schema_version": f"{SCHEMA_VERSION[0]}.{SCHEMA_VERSION[1]}",
            "recorder_start_ns": str(self._start_ns),
            "recorder_start_utc": datetime.datetime.fromtimestamp(
                self._start_ns / 1e9, datetime.timezone.utc).isoformat(),
            "part_index": str(self._part_index),
            "patterns": json.dumps(self._patterns),
            "source": self._source,
            "hostname": socket.gethostname(),
        })
        self._part_bytes = self._writer.offset  # header + metadata written: even an empty killed part opens
        self._channels, self._sequences, self._batch_log = {}, {}, {}
        self._chunk_fill = 0
        self.stats.parts += 1
        log.info("recorder: writing %s", path)

    def _register_channel(self, topic: str) -> int:
        if topic == "\0" + BUS_TOPIC:
            cid = self._writer.register_channel(BUS_TOPIC, MESSAGE_ENCODING, self._schema_id, {"kind": "bus"})
        elif topic.startswith("\0p"):
            producer_id = topic[2:]
            cid = self._writer.register_channel(PRODUCER_TOPIC_PREFIX + producer_id, MESSAGE_ENCODING, self._schema_id,
                                                {"kind": "producer", "producer_id": producer_id})
        else:
            cid = self._writer.register_channel(topic, MESSAGE_ENCODING, self._schema_id,
                                                {"kind": "request", "request_id": topic})
        self._channels[topic] = cid
        self._sequences[cid] = 0
        self._chunk_fill += 64 + 2 * len(topic)
        self.stats.channels += 1
        return cid

    def _finish_part(self) -> None:
        if self._writer is None:
            return
        if self._batch_log:
            self._write_index()
        self._writer.finish()
        os.fsync(self._fd)
        os.close(self._fd)
        self._writer, self._fd = None, -1
        self._part_index += 1

    def _write_index(self) -> None:
        """The part's request index (spec 7): per producer channel the log time of each of its messages, and
        per request the runs of consecutive messages of a channel that name it."""
        channels, runs = [], {}
        topics = {cid: topic for topic, cid in self._channels.items()}
        for c, (cid, (log_times, names)) in enumerate(self._batch_log.items()):
            channels.append({"topic": PRODUCER_TOPIC_PREFIX + topics[cid][2:], "channel_id": cid,
                             "log_times": np.asarray(log_times, dtype="<i8").tobytes()})
            for n, ids in enumerate(names):
                for rid in ids:
                    r = runs.get(rid)
                    if r is not None and r[-3] == c and r[-1] == n - 1:
                        r[-1] = n
                    elif r is None:
                        runs[rid] = [c, n, n]
                    else:
                        r += (c, n, n)
        index = {"version": 1, "channels": channels,
                 "requests": {rid: np.asarray(r, dtype="<i8").tobytes() for rid, r in runs.items()}}
        now = time.time_ns()
        self._writer.add_attachment(create_time=now, log_time=now, name=INDEX_ATTACHMENT, media_type=INDEX_MEDIA_TYPE,
                                    data=msgpack.packb(index, use_bin_type=True))
        self._batch_log = {}

    def _rotate(self) -> None:
        self._finish_part()
        self._open_part()


def _private_dir(path: Path) -> None:
    """Create the recording directory 0700 whatever the umask (the parents it needs as ``mkdir -p`` would).
    An existing directory is left as it is, with a warning when others may read it."""
    try:
        path.mkdir(mode=0o700)
    except FileExistsError:
        if not path.is_dir():
            raise
        mode = path.stat().st_mode & 0o777
        if mode & 0o077:
            log.warning("recorder: %s is mode %o: other users may read the recording (new parts are 0600)",
                        path, mode)
        return
    except FileNotFoundError:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.mkdir(mode=0o700, exist_ok=True)
    os.chmod(path, 0o700)


# ---------------------------------------------------------------------------------------------- CLI

def _parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+)\s*([kmgt]i?b?)?\s*", text, re.I)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 1048576, 64MiB, 1GiB)")
    unit = (m.group(2) or "").lower()[:1]
    return int(m.group(1)) << {"": 0, "k": 10, "m": 20, "g": 30, "t": 40}[unit]


def _record_pull(rec: Recorder, endpoint: str, stop: list[bool]) -> None:
    """Receive raw messages on a bound PULL socket (a direct pipeline, without a broker)."""
    import zmq

    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.PULL)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.bind(endpoint)
    try:
        while not stop[0]:
            if sock.poll(100):
                while True:
                    try:
                        frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    rec.write(frames)
            rec.tick()
    finally:
        sock.close(0)


class _BrokerSource:
    """A raw subscription to the broker: a DEALER on its consumers endpoint, subscribed ``from_start``.

    It keeps the raw frames (the recorder must not re-encode), heartbeats the broker and re-subscribes when
    its ``BrokerSession`` says so (the first broker heartbeat, a new ``instance``, or ``known: false``). Losses
    are the broker's to report: its GapNotices arrive here like any message and are recorded on their
    request's channel.
    """

    def __init__(self, broker: str | None, patterns: Sequence[str], keys: Any = None,
                 consumer_id: str = "recorder"):
        import zmq

        from mia_stream.bus import transport
        from mia_stream.bus.session import BrokerSession
        from mia_stream.schemas import Subscribe, encode, split_batch
        from mia_stream.bus.shm_ring import shm_reachable

        self._zmq, self._transport, self._consumer_id = zmq, transport, consumer_id
        self._split_batch = split_batch
        endpoint = transport.endpoints_for(broker).consumers
        # on the broker's host the recorder copies producers' shared-memory tensors itself (Recorder.write)
        self._subscribe = encode(Subscribe(list(patterns), from_start=True, consumer_id=consumer_id, batch=True,
                                           shm=shm_reachable(endpoint)))
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        # Unbounded receive queue: the broker, not ZeroMQ, decides what is dropped (and says so).
        transport.configure(self._sock, sndhwm=1000, rcvhwm=0)
        transport.connect(self._sock, endpoint,
                           transport.resolve_client_keys(keys, "consumer"))
        self._broker = BrokerSession(announce_on_first=True)  # its first subscription may not have gone out
        self._last_heartbeat = 0.0
        self._send(self._subscribe)

    def _send(self, frames: list) -> None:
        try:
            self._sock.send_multipart(frames, self._zmq.NOBLOCK, copy=False)
        except self._zmq.Again:
            log.warning("recorder: broker connection is not ready; will retry with the next heartbeat")

    def _heartbeat(self) -> None:
        from mia_stream.schemas import Heartbeat, encode

        now = time.monotonic()
        if now - self._last_heartbeat >= self._transport.HEARTBEAT_S:
            self._last_heartbeat = now
            self._send(encode(Heartbeat(self._consumer_id, "consumer", os.getpid(), time.time_ns())))

    def _on_broker_heartbeat(self, frames: list) -> None:
        from mia_stream.schemas import Heartbeat, decode

        try:
            hb = decode(frames)
        except WireError as e:
            log.warning("recorder: malformed broker heartbeat: %s", e)
            return
        if not isinstance(hb, Heartbeat):
            return
        news = self._broker.on_heartbeat(hb)
        if news.reannounce:
            if not news.first:
                log.warning("recorder: broker restarted or lost us (instance %r); subscribing again", hb.instance)
            self._send(self._subscribe)

    def recv_frames(self, timeout_s: float) -> list[list[Any]]:
        """The messages received within ``timeout_s``, one frame list each (batches unpacked)."""
        self._heartbeat()
        out = []
        if self._sock.poll(int(timeout_s * 1000)):
            for _ in range(1024):
                try:
                    frames = self._sock.recv_multipart(self._zmq.NOBLOCK, copy=False)
                except self._zmq.Again:
                    break
                try:
                    messages = self._split_batch(frames)
                except WireError as e:
                    log.warning("recorder: malformed batch: %s", e)
                    messages = None  # passed on whole: Recorder.write counts it as rejected
                if messages is not None:
                    out.extend(messages)
                    continue
                if len(frames) >= 2 and len(frames[0]) == 0 and len(frames[1]) < 4096:  # maybe a heartbeat
                    header = Recorder._header_of(frames)
                    if header is not None and header.get("kind") == "heartbeat" and header.get("role") == "broker":
                        self._on_broker_heartbeat(frames)
                out.append(frames)
        return out

    def close(self) -> None:
        self._sock.close(0)
        self._ctx.term()


def _record_broker(rec: Recorder, broker: str | None, patterns: Sequence[str], stop: list[bool]) -> None:
    source = _BrokerSource(broker, patterns)
    try:
        while not stop[0]:
            for frames in source.recv_frames(timeout_s=0.1):
                rec.write(frames)
            rec.tick()
    finally:
        source.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="mia-stream record", description=(
        "Record mia_stream bus messages into an MCAP recording directory (part-NNNNN.mcap files)."))
    p.add_argument("out", help="recording directory (created; new parts are appended after existing ones)")
    p.add_argument("--broker", help="broker address (run dir, ipc:// or tcp://); default $MIA_STREAM_BROKER")
    p.add_argument("--patterns", nargs="+", default=["*"], metavar="GLOB", help="request-id globs (default: *)")
    p.add_argument("--rotate-bytes", type=_parse_size, default=DEFAULT_ROTATE_BYTES,
                   help="start a new part at this size (default 1GiB)")
    p.add_argument("--chunk-bytes", type=_parse_size, default=DEFAULT_CHUNK_BYTES,
                   help="MCAP chunk size; a crash loses at most one chunk (default 4MiB)")
    p.add_argument("--max-channels", type=int, default=DEFAULT_MAX_CHANNELS,
                   help="start a new part before this many request channels (default 65000; MCAP ids are u16)")
    p.add_argument("--flush-interval", type=float, default=DEFAULT_FLUSH_INTERVAL_S,
                   help="seconds after which a partly filled chunk is written anyway (default 1)")
    p.add_argument("--budget-bytes", type=_parse_size, default=0,
                   help="record at most this many bytes of data, then only a gap per stream naming what was left "
                        "out (reason recorder_budget); default: no budget")
    p.add_argument("--compression", choices=("none", "lz4"), default="none",
                   help="MCAP chunk compression (lz4: LZ4 frames; default none)")
    p.add_argument("--bind-pull", metavar="ENDPOINT",
                   help="record from a PULL socket bound here instead of a broker (direct pipelines, tests)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    stop = [False]

    def _stop(signum: int, _frame: Any) -> None:
        stop[0] = True

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    source = args.bind_pull or args.broker or settings.get_address("MIA_STREAM_BROKER") or ""
    with Recorder(args.out, chunk_bytes=args.chunk_bytes, rotate_bytes=args.rotate_bytes,
                  max_channels=args.max_channels, flush_interval_s=args.flush_interval,
                  patterns=args.patterns, source=source, budget_bytes=args.budget_bytes,
                  compression=args.compression) as rec:
        print(f"mia-stream record: recording into {rec.out_dir} (patterns {args.patterns})", file=sys.stderr, flush=True)
        if args.bind_pull:
            _record_pull(rec, args.bind_pull, stop)
        else:
            _record_broker(rec, args.broker, args.patterns, stop)
    s = rec.stats
    print(f"mia-stream record: {s.messages} messages, {s.bytes} bytes, {s.parts} part(s), "
          f"{s.channels} channel(s), {s.rejected} rejected, {s.budget_dropped} left out past the budget",
          file=sys.stderr)
    return 0
