"""The sans-I/O core of a served request: what its events are and when it is over, with no socket, thread or
event loop (the split of h11: a protocol object that consumes what was read and produces events; the sync and
async clients in ``client.py`` are thin I/O shells that read and feed it).

Rule: ``RequestMachine`` owns one request's state (``RequestState``: what has arrived, whether the HTTP side and
the stream are done) and every decision on it: what a bus event, an openai chunk or a response becomes, when
the iteration ends, how long to wait for the stream's end after the response, which error to raise. The shells
own only their queue, threads/tasks and clock, and feed the machine items ``(kind, payload)``:

    ("bus", Event)           an event of the request's stream (consumer SDK)
    ("chunk", chunk)         a streamed openai chunk
    ("response", last)       the streamed response is over (its last chunk, or None)
    ("result", response)     a whole (not streamed) openai response
    ("http_error", exc) / ("bus_error", exc)        raised to the caller
    ("bus_closed", None)     the stream reader stopped
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Any

from mia_stream.consumers import (AnalysisEvent, EndEvent, Event, FrameEvent, GapEvent, RequestStream,
                                  StepFrame)
from mia_stream.errors import BrokerTimeoutError, MiaStreamError


@dataclass
class ServedEvent:
    """One thing that happened to a request. ``kind``: "text" (``text``: the delta; ``chunk``: the openai
    chunk when streamed), "response" (the HTTP side is done; ``response``: the final openai object, or the
    last chunk when streamed), or a consumer-SDK event kind ("start", "frame", "tokens", "gap", "end", and
    whatever the SDK adds) with the SDK's ``Event`` in ``bus``."""

    kind: str
    request_id: str
    text: str | None = None
    chunk: Any = None
    response: Any = None
    bus: Event | None = None

    @property
    def frame(self) -> StepFrame | None:
        return self.bus.frame if self.bus is not None else None

    @property
    def tokens(self):
        return self.bus.tokens if self.bus is not None else None

    @property
    def gap(self):
        return self.bus.gap if self.bus is not None else None

    @property
    def end(self):
        return self.bus.end if self.bus is not None else None

    @property
    def analysis(self):
        """An "analysis" event's ``Analysis`` (one analyzer's rows for this request at one step; step -1: final)."""
        return self.bus.analysis if self.bus is not None else None

    @property
    def stream(self) -> RequestStream | None:
        return self.bus.stream if self.bus is not None else None


# what a request awaits for each of its in-engine detectors (``detect=``): one final result (step -1) from an
# "engine:<name>" analyzer, published when the engine frees the request, after its last score row
ENGINE_DETECTOR = "in-engine detector #"


@dataclass
class StreamProgress:
    """Whether a request's stream is over for the client: its end came, and the final result (step -1) of every
    analyzer it waits for (they come after the end). Kept by the state and by the stream reader."""

    awaiting: set = field(default_factory=set)  # analyzers whose final result has not come yet
    ended: bool = False

    def see(self, ev: Event) -> None:
        if type(ev) is EndEvent:
            self.ended = True
        elif type(ev) is AnalysisEvent and ev.analysis.step == -1:
            name = ev.analysis.analyzer
            if name in self.awaiting:
                self.awaiting.discard(name)
            elif name.startswith("engine:"):  # an in-engine detector's final (its name is the probe's, engine-side)
                self.awaiting.discard(next((a for a in sorted(self.awaiting) if a.startswith(ENGINE_DETECTOR)), None))

    @property
    def done(self) -> bool:
        return self.ended and not self.awaiting


@dataclass
class RequestState:
    """What has arrived for one request (for live and recorded requests alike)."""

    request_id: str
    keep_frames: bool
    awaiting: set = field(default_factory=set)  # see StreamProgress
    text_parts: list = field(default_factory=list)
    chunks: list = field(default_factory=list)
    response: Any = None
    stream: RequestStream | None = None
    frames: list = field(default_factory=list)
    gaps: list = field(default_factory=list)
    http_done: bool = False
    analyses: list = field(default_factory=list)
    progress: StreamProgress = field(init=False)

    def __post_init__(self) -> None:
        self.progress = StreamProgress(self.awaiting)

    @property
    def bus_ended(self) -> bool:
        return self.progress.ended

    @property
    def bus_done(self) -> bool:
        return self.progress.done

    def on_bus(self, ev: Event) -> ServedEvent:
        self.stream = ev.stream
        self.progress.see(ev)
        handle = self._BUS.get(type(ev))
        if handle is not None:
            handle(self, ev)
        return ServedEvent(ev.kind, self.request_id, bus=ev)

    def _on_frame(self, ev: FrameEvent) -> None:
        if self.keep_frames:
            self.frames.append(ev.frame)

    def _on_gap(self, ev: GapEvent) -> None:
        self.gaps.append(ev.gap)

    def _on_analysis(self, ev: AnalysisEvent) -> None:
        self.analyses.append(ev.analysis)

    # on_bus's handler of each SDK event class (start, tokens, end: nothing kept beyond progress)
    _BUS = {FrameEvent: _on_frame, GapEvent: _on_gap, AnalysisEvent: _on_analysis}

    def on_text(self, delta: str, chunk: Any = None) -> ServedEvent:
        self.text_parts.append(delta)
        if chunk is not None:
            self.chunks.append(chunk)
        return ServedEvent("text", self.request_id, text=delta, chunk=chunk)

    def on_response(self, response: Any) -> ServedEvent:
        self.http_done = True
        self.response = response
        return ServedEvent("response", self.request_id, response=response)

    def end_timeout_error(self, end_timeout: float) -> BrokerTimeoutError:
        if self.bus_ended:
            return BrokerTimeoutError(
                f"request {self.request_id!r}: its stream ended but no final result came from analyzer(s) "
                f"{sorted(self.awaiting)} within {end_timeout:g} s (is each running with --publish on this broker "
                "and --patterns matching this request?)")
        return BrokerTimeoutError(
            f"request {self.request_id!r}: the response came but its stream did not end within {end_timeout:g} s "
            "(is the server running with MIA_STREAM_BROKER set to this broker?)")


def delta_of(chunk: Any, chat: bool) -> str:
    """The text a streamed chat or completion chunk adds."""
    choices = getattr(chunk, "choices", None) or []
    if not choices:
        return ""
    if chat:
        return getattr(getattr(choices[0], "delta", None), "content", None) or ""
    return getattr(choices[0], "text", None) or ""


def full_text(response: Any, chat: bool) -> str:
    """The text of a whole chat or completion response."""
    choices = getattr(response, "choices", None) or []
    if not choices:
        return ""
    if chat:
        return getattr(choices[0].message, "content", None) or ""
    return getattr(choices[0], "text", None) or ""


class RequestMachine:
    """One live request's protocol: feed it what the shells read (``receive``), take its events
    (``next_event``) until ``finished``; ``wait_time`` says how long a shell may wait for the next item and
    ``timeout_error`` what to raise when nothing came in that time.

    ``attached``: a request someone else sent (``open``): no HTTP side, so no deadline for the stream's end.
    ``end_timeout``: after the response, how long its stream's end (and the awaited final results) may take."""

    def __init__(self, request_id: str, *, chat: bool, keep_frames: bool, analyzers: frozenset = frozenset(),
                 attached: bool = False, end_timeout: float = 60.0):
        self.state = RequestState(request_id, keep_frames, awaiting=set(analyzers))
        self.chat, self.attached, self.end_timeout = chat, attached, end_timeout
        self.closed = False
        self._ready: collections.deque[ServedEvent] = collections.deque()
        self._http_done_at: float | None = None
        if attached:
            self.state.http_done = True

    def receive(self, kind: str, payload: Any) -> None:
        """One item read by a shell; raises the error an item carries."""
        st = self.state
        if kind == "bus":
            self._ready.append(st.on_bus(payload))
        elif kind == "chunk":
            delta = delta_of(payload, self.chat)
            if delta:
                self._ready.append(st.on_text(delta, payload))
            else:
                st.chunks.append(payload)  # a chunk without text (role, finish): kept, no event
        elif kind == "response":
            self._ready.append(st.on_response(payload))
        elif kind == "result":
            self._ready.append(st.on_text(full_text(payload, self.chat)))
            self._ready.append(st.on_response(payload))
        elif kind in ("http_error", "bus_error"):
            raise payload
        elif kind == "bus_closed" and not st.bus_done:
            raise MiaStreamError(f"stream {st.request_id!r}: the stream reader stopped before its end")

    def next_event(self) -> ServedEvent | None:
        """The next event to hand to the caller (None: feed the machine more)."""
        return self._ready.popleft() if self._ready else None

    @property
    def finished(self) -> bool:
        """The iteration is over: closed, or the response, the stream's end and every awaited final result came
        (and their events were taken)."""
        st = self.state
        return self.closed or (not self._ready and st.http_done and st.bus_done)

    def wait_time(self, now: float) -> float | None:
        """Seconds a shell may wait for the next item at monotonic time ``now`` (None: no deadline)."""
        if not self.state.http_done or self.attached:
            return None
        self._http_done_at = self._http_done_at or now
        return max(0.0, self._http_done_at + self.end_timeout - now)

    def timeout_error(self) -> BrokerTimeoutError:
        return self.state.end_timeout_error(self.end_timeout)


class Results:
    """Read access to a request's state, common to the live (sync and async) and the recorded requests."""

    _state: RequestState

    @property
    def request_id(self) -> str:
        """The stream id: the spec's ``id`` (what consumers subscribe to)."""
        return self._state.request_id

    @property
    def text(self) -> str:
        return "".join(self._state.text_parts)

    @property
    def response(self) -> Any:
        """The final openai object (``ChatCompletion`` / ``Completion``), or the last chunk when streamed."""
        return self._state.response

    @property
    def chunks(self) -> list:
        return self._state.chunks

    @property
    def stream(self) -> RequestStream | None:
        """The consumer SDK's ``RequestStream`` (``start``, ``generated_token_ids``, ``end``, ``gaps``)."""
        return self._state.stream

    @property
    def frames(self) -> list[StepFrame]:
        """The frames received, in order (kept with ``keep_frames=True`` or after ``collect()``)."""
        return self._state.frames

    @property
    def gaps(self) -> list:
        return self._state.gaps

    @property
    def analyses(self) -> list:
        """The analysis results received for this request (``Analysis``: analyzer, step, positions, values...),
        in arrival order."""
        return self._state.analyses

    @property
    def end(self):
        return self._state.stream.end if self._state.stream is not None else None

    @property
    def finish_reason(self) -> str | None:
        resp = self._state.response
        choices = getattr(resp, "choices", None) or []
        return getattr(choices[0], "finish_reason", None) if choices else None
