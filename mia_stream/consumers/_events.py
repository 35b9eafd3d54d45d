"""Consumer events: one class per kind, and the per-request record every event of a request shares.

Rule: events only carry what the assembler decided; they own no assembler state. ``RequestStream`` is the one
per-request record (start, tokens, kept gap notices, counts), filled by the assembler, read by consumers.

Each event class keeps the attributes of the former single ``Event`` (``kind``, ``stream``, ``frame``,
``tokens``, ``gap``, ``end``, ``error``, ``analysis``, ``batch``, ``start``): the ones its kind has are slots, the
others read None, so ``if ev.kind == "frame": ev.frame`` keeps working beside ``isinstance(ev, FrameEvent)``.
Dispatch on ``type(ev)`` (a dict of class -> handler), not on ``kind`` strings.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from mia_stream.schemas import GapNotice, StreamEnd, StreamStart

if TYPE_CHECKING:
    from mia_stream.consumers._frames import StepFrame
    from mia_stream.schemas import Analysis, AnalysisBatch, StepBatch, TokenBatch, TokenFrame

# seq ranges a RequestStream keeps in its gap notices (its counts stay exact), and the most a batch-mode "gap"
# event names (so a stream's first one is always kept whole)
GAP_RANGES_KEPT = 16


@dataclass
class RequestStream:
    """Everything known about one request's stream(s); the same object in every event of the request.

    ``gaps``: GapNotices of the request's "gap" events, the first ones, naming at most ``GAP_RANGES_KEPT`` seq
    ranges in all (the first is always kept). ``gap_events`` and ``gap_seqs`` count every "gap" event of the
    request and the seqs they named, kept or not."""

    request_id: str
    start: StreamStart | None = None  # TP rank 0's StreamStart
    starts: dict[int, StreamStart] = field(default_factory=dict)
    tp_size: int = 1
    generated_token_ids: list = field(default_factory=list)
    gaps: list = field(default_factory=list)
    ended: bool = False
    end: StreamEnd | None = None
    ends: dict[int, StreamEnd] = field(default_factory=dict)
    frames: int = 0
    gap_events: int = 0
    gap_seqs: int = 0
    _gap_ranges_kept: int = field(default=0, init=False, repr=False, compare=False)

    @property
    def prompt_token_ids(self) -> list:
        return list(self.start.prompt_token_ids) if self.start is not None else []

    def _add_gap(self, gap: GapNotice, seqs: int) -> None:
        # Bounded: the assembler remembers 10,000 ended streams, and under sustained overload each one kept a
        # notice per gap event (millions of objects: full collections of 1.2 s in bench_load.py's saturated `*`).
        self.gap_events += 1
        self.gap_seqs += seqs
        ranges = len(gap.missing)
        if not self.gaps or self._gap_ranges_kept + ranges <= GAP_RANGES_KEPT:
            self.gaps.append(gap)
            self._gap_ranges_kept += ranges


class Event:
    """The base of every consumer event (``isinstance(ev, Event)``). ``kind``: one of ``EVENT_KINDS`` (a class
    attribute); the fields a kind does not have are None here."""

    __slots__ = ()
    kind: ClassVar[str] = ""
    stream: RequestStream | None = None  # None for a "batch" event (it names many requests)
    frame: StepFrame | None = None
    tokens: TokenFrame | None = None
    gap: GapNotice | None = None
    end: StreamEnd | None = None
    error: Exception | None = None  # IncompleteShardError for reason "incomplete_shards"
    analysis: Analysis | None = None  # an "analysis" event: one request's rows of an AnalysisBatch
    batch: StepBatch | TokenBatch | AnalysisBatch | None = None  # a "batch" event (batch mode)

    @property
    def start(self) -> StreamStart | None:
        return self.stream.start

    def _values(self) -> tuple:
        return tuple(getattr(self, name) for name in type(self).__slots__)

    def __repr__(self) -> str:
        fields = ", ".join(f"{n}={getattr(self, n)!r}" for n in type(self).__slots__)
        return f"{type(self).__name__}(kind={self.kind!r}, {fields})"

    def __eq__(self, other: Any) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        return self._values() == other._values()

    __hash__ = None  # mutable, compared by value (as the former dataclass)


class StartEvent(Event):
    """A request's stream started (TP: rank 0's StreamStart, in ``stream.start``)."""

    __slots__ = ("stream",)
    kind = "start"

    def __init__(self, stream: RequestStream):
        self.stream = stream


class FrameEvent(Event):
    """One engine step of one request (TP shards merged): ``frame``."""

    __slots__ = ("stream", "frame")
    kind = "frame"

    def __init__(self, stream: RequestStream, frame: StepFrame):
        self.stream, self.frame = stream, frame


class TokensEvent(Event):
    """Tokens a request generated in a step: ``tokens`` (a TokenFrame)."""

    __slots__ = ("stream", "tokens")
    kind = "tokens"

    def __init__(self, stream: RequestStream, tokens: TokenFrame):
        self.stream, self.tokens = stream, tokens


class GapEvent(Event):
    """Lost seqs of a request's stream (``gap``); ``error``: the IncompleteShardError of an "incomplete_shards"
    gap, else None."""

    __slots__ = ("stream", "gap", "error")
    kind = "gap"

    def __init__(self, stream: RequestStream, gap: GapNotice, error: Exception | None = None):
        self.stream, self.gap, self.error = stream, gap, error


class EndEvent(Event):
    """A request's stream ended (TP: every rank's): ``end`` is rank 0's StreamEnd."""

    __slots__ = ("stream", "end")
    kind = "end"

    def __init__(self, stream: RequestStream, end: StreamEnd):
        self.stream, self.end = stream, end


class AnalysisEvent(Event):
    """One request's rows of an analyzer's results: ``analysis``."""

    __slots__ = ("stream", "analysis")
    kind = "analysis"

    def __init__(self, stream: RequestStream, analysis: Analysis):
        self.stream, self.analysis = stream, analysis


class BatchEvent(Event):
    """Batch mode: a whole columnar message (``batch``) naming many requests; ``stream`` is None."""

    __slots__ = ("batch",)
    kind = "batch"

    def __init__(self, batch: StepBatch | TokenBatch | AnalysisBatch):
        self.batch = batch


EVENT_CLASSES: dict[str, type[Event]] = {c.kind: c for c in (StartEvent, FrameEvent, TokensEvent, GapEvent,
                                                              EndEvent, AnalysisEvent, BatchEvent)}
EVENT_KINDS = tuple(EVENT_CLASSES)  # ("start", "frame", "tokens", "gap", "end", "analysis", "batch")
