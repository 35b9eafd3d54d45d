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
from typing import TYPE_CHECKING, ClassVar

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
    attribute); the fields a kind does not have are None here. Each event class is a slotted dataclass of its
    own fields (as the former single ``Event``: ``dataclasses.replace`` and ``==`` work)."""

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

    def keep(self) -> "Event":
        """This event, safe to keep past its release: frame and batch events copy their tensors (they may view a
        producer's shared-memory ring, docs/wire-format.md 9.4); the others own what they hold."""
        return self


@dataclass(slots=True)
class StartEvent(Event):
    """A request's stream started (TP: rank 0's StreamStart, in ``stream.start``)."""

    kind = "start"
    stream: RequestStream


@dataclass(slots=True)
class FrameEvent(Event):
    """One engine step of one request (TP shards merged): ``frame``."""

    kind = "frame"
    stream: RequestStream
    frame: StepFrame

    def keep(self) -> "FrameEvent":
        """This event with its tensors copied, to keep past its release (zero-copy: ``_ring_views``)."""
        return FrameEvent(self.stream, self.frame.copy())


@dataclass(slots=True)
class TokensEvent(Event):
    """Tokens a request generated in a step: ``tokens`` (a TokenFrame)."""

    kind = "tokens"
    stream: RequestStream
    tokens: TokenFrame


@dataclass(slots=True)
class GapEvent(Event):
    """Lost seqs of a request's stream (``gap``); ``error``: the IncompleteShardError of an "incomplete_shards"
    gap, else None."""

    kind = "gap"
    stream: RequestStream
    gap: GapNotice
    error: Exception | None = None


@dataclass(slots=True)
class EndEvent(Event):
    """A request's stream ended (TP: every rank's): ``end`` is rank 0's StreamEnd."""

    kind = "end"
    stream: RequestStream
    end: StreamEnd


@dataclass(slots=True)
class AnalysisEvent(Event):
    """One request's rows of an analyzer's results: ``analysis``."""

    kind = "analysis"
    stream: RequestStream
    analysis: Analysis


@dataclass(slots=True)
class BatchEvent(Event):
    """Batch mode: a whole columnar message (``batch``) naming many requests; ``stream`` is None."""

    kind = "batch"
    batch: StepBatch | TokenBatch | AnalysisBatch

    def keep(self) -> "BatchEvent":
        """This event with its tensors copied, to keep past its release (zero-copy: ``_ring_views``)."""
        from mia_stream.consumers._batch_ops import owned_batch  # _batch_ops builds batches; events only carry them

        return BatchEvent(owned_batch(self.batch))


EVENT_CLASSES: dict[str, type[Event]] = {c.kind: c for c in (StartEvent, FrameEvent, TokensEvent, GapEvent,
                                                              EndEvent, AnalysisEvent, BatchEvent)}
EVENT_KINDS = tuple(EVENT_CLASSES)  # ("start", "frame", "tokens", "gap", "end", "analysis", "batch")
