"""Typed messages of the mia_stream bus. The wire encoding is in ``_codec.py``; the spec in docs/wire-format.md.

Every message is one ZeroMQ multipart message ``[topic, header, *buffers]``. Each class here is one
``kind`` of header. Fields with defaults are optional on the wire; unknown fields are ignored (minor
versions add optional fields, and new kinds sent only to peers that advertised them). A ``batch`` (1.2) is
not a message but an envelope of several: see ``_framing.encode_batch``. The columnar kinds (2.0) build on
these in ``_batches``; ``_kinds`` registers both (this module imports neither).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from mia_stream.schemas._tensors import Tensor

SCHEMA_VERSION = (2, 2)  # (major, minor): a new major breaks decoders, a new minor only adds (see the spec)

# Finish reasons of a stream: vLLM's plus the ones only the bus knows.
FINISH_REASONS = ("stop", "length", "abort", "error", "rejected", "producer_lost")


@dataclass
class Message:
    KIND: ClassVar[str] = ""

    def topic(self) -> bytes:
        rid = getattr(self, "request_id", None)
        return request_topic(rid) if rid is not None else b""


def request_topic(request_id: str) -> bytes:
    """The topic frame of a request's messages: its id, NUL-terminated, so a prefix can match exactly."""
    return request_id.encode("utf-8") + b"\x00"


@dataclass
class StreamStart(Message):
    """First message of a stream: one request as seen by one producer (one TP rank of one engine)."""

    KIND: ClassVar[str] = "start"
    request_id: str
    producer_id: str
    epoch: int
    seq: int = 0
    engine_request_id: str = ""
    model: str = ""
    tokenizer: str = ""
    tp_rank: int = 0
    tp_size: int = 1
    dp_rank: int = 0
    num_layers: int = 0
    hidden_size: int = 0
    num_heads: int = 0  # query heads of the whole model (not of this rank)
    num_kv_heads: int = 0
    head_dim: int = 0
    dtype: str = ""
    capture: dict = field(default_factory=dict)  # the normalized capture spec
    steering: list = field(default_factory=list)  # steering ops in force at the start
    capture_after_steering: bool = True  # captured residuals are read after that layer's steering
    prompt_token_ids: list = field(default_factory=list)
    tags: dict = field(default_factory=dict)
    time_ns: int = 0
    resent: bool = False  # re-announced after a broker restart; earlier frames may be missing
    control_id: str = ""  # (1.1) producer id of the peer that takes this request's steering ("" = this one)


@dataclass
class TensorFrame(Message):
    """The captured tensors of one request at one engine step (all requested layers stacked)."""

    KIND: ClassVar[str] = "tensors"
    request_id: str
    producer_id: str
    epoch: int
    seq: int
    step: int
    positions: list = field(default_factory=list)  # token positions of dim 1 of each tensor
    token_ids: list = field(default_factory=list)  # the input token id at each of those positions
    tensors: list = field(default_factory=list)  # list[Tensor]; buffers follow the header in this order
    steering_version: int = 0  # which steering config was in force (0 = none; bumps on every change)
    time_ns: int = 0
    part: int = 0  # (1.1) frames of one step that cover different positions: 0 = hidden states, 1 = Q/K

    def tensor(self, name: str) -> Tensor:
        for t in self.tensors:
            if t.name == name:
                return t
        raise KeyError(f"frame has no tensor {name!r}; it has {[t.name for t in self.tensors]}")


@dataclass
class TokenFrame(Message):
    """The token(s) a request generated at one engine step."""

    KIND: ClassVar[str] = "tokens"
    request_id: str
    producer_id: str
    epoch: int
    seq: int
    step: int
    token_ids: list = field(default_factory=list)
    positions: list = field(default_factory=list)  # position each generated token will occupy
    finish_reason: str | None = None
    time_ns: int = 0


@dataclass
class StreamEnd(Message):
    KIND: ClassVar[str] = "end"
    request_id: str
    producer_id: str
    epoch: int
    seq: int
    finish_reason: str = "stop"
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    frames_sent: int = 0
    frames_dropped: int = 0
    bytes_sent: int = 0
    drops: dict = field(default_factory=dict)  # reason -> frames dropped for it
    uncaptured_positions: list = field(default_factory=list)  # e.g. prompt positions served by a cache
    error: str | None = None
    time_ns: int = 0


@dataclass
class GapNotice(Message):
    """Frames of a stream that will never arrive, named exactly: inclusive ``[first, last]`` seq ranges."""

    KIND: ClassVar[str] = "gap"
    request_id: str
    producer_id: str
    epoch: int
    missing: list = field(default_factory=list)  # [[first_seq, last_seq], ...]
    reason: str = ""
    origin: str = ""  # "producer" | "broker" | "consumer"
    time_ns: int = 0

    @property
    def count(self) -> int:
        return sum(b - a + 1 for a, b in self.missing)


@dataclass
class Heartbeat(Message):
    KIND: ClassVar[str] = "heartbeat"
    sender_id: str
    role: str  # "producer" | "broker" | "consumer"
    instance: int  # random per process start: a change means the peer restarted
    time_ns: int = 0
    stats: dict = field(default_factory=dict)


@dataclass
class SteeringCommand(Message):
    """Change a running request's steering (or abort it). ``ops`` uses the steering-spec op format."""

    KIND: ClassVar[str] = "steer"
    command_id: str
    request_id: str
    action: str  # one of STEER_ACTIONS (_steering): "replace" | "add" | "remove" | "clear" | "abort"
    ops: list = field(default_factory=list)
    layers: list = field(default_factory=list)  # for "remove": the layers whose ops are removed
    sender: str = ""  # set by the broker: the authenticated identity that sent it
    time_ns: int = 0


@dataclass
class SteeringAck(Message):
    KIND: ClassVar[str] = "steer_ack"
    command_id: str
    request_id: str
    ok: bool
    applied_step: int | None = None  # first engine step computed with the new steering
    steering_version: int = 0
    error: str | None = None
    producer_id: str = ""
    tp_rank: int = 0
    time_ns: int = 0


@dataclass
class Subscribe(Message):
    """Consumer -> broker: deliver the streams whose request ids match any glob (``*`` = all)."""

    KIND: ClassVar[str] = "subscribe"
    patterns: list = field(default_factory=list)
    from_start: bool = False  # replay each matching live request from its first buffered message
    consumer_id: str = ""
    window_bytes: int = 0  # (1.1) credit flow control: bytes the broker may have in flight; 0 = off
    batch: bool = False  # (1.2) this consumer unpacks batch messages, so the broker may send it batches
    shm: bool = False  # (1.3) this consumer reads producers' shared-memory rings itself (same host)
    # (2.2) the layers, positions and tensors of step batches it wants ({} = all): {"layers": [15],
    # "positions": "generated" | "last_prompt" | "prompt" | "all" | [ints], "tensors": ["hs"]}; spec 3.9
    select: dict = field(default_factory=dict)

    def topic(self) -> bytes:
        return b""


@dataclass
class Unsubscribe(Message):
    KIND: ClassVar[str] = "unsubscribe"
    patterns: list = field(default_factory=list)

    def topic(self) -> bytes:
        return b""


@dataclass
class Credit(Message):
    """(1.1) Consumer -> broker: ``nbytes`` more bytes consumed; the broker may send that many more."""

    KIND: ClassVar[str] = "credit"
    nbytes: int

    def topic(self) -> bytes:
        return b""


@dataclass
class ErrorNotice(Message):
    """Something a peer sent was refused; ``code`` is machine-readable, ``message`` for people."""

    KIND: ClassVar[str] = "error"
    code: str
    message: str
    request_id: str | None = None
    time_ns: int = 0


def stream_key(msg: Any) -> tuple[str, str, int]:
    """The identity of a sequence-numbered stream: (request id, producer id, producer epoch)."""
    return (msg.request_id, msg.producer_id, msg.epoch)
