"""``StreamClient``: send a chat or completion request to a served model and read, concurrently, its text and
its stream (frames, tokens, gaps, end and any later kind, e.g. analysis results) from the broker.

    client = StreamClient("http://127.0.0.1:8000/v1", broker="/tmp/mia_stream-0")
    with client.chat([{"role": "user", "content": "Hi"}],
                     capture={"hidden_states": {"layers": [15], "positions": "all"}}, max_tokens=16) as req:
        for ev in req:
            if ev.kind == "text":
                print(ev.text, end="")
            elif ev.kind == "frame":
                hs = ev.frame.tensors["hs"]        # [layers, tokens, hidden]
    req.text, req.frames, req.end                  # what arrived, once the iteration is over

The request goes through the official ``openai`` client (its ``vllm_xargs`` carry the spec as a JSON string);
the stream comes from ``mia_stream.consumers.open_stream`` (the consumer SDK's per-request events, passed on
unchanged, so event kinds added later reach the caller as they are). ``AsyncStreamClient`` is the asyncio
flavour; ``StreamClient.recording(path)`` gives the same ``open(request_id)`` and events over a recording,
with ``text`` decoded from the recorded tokens.

The stream id. The spec's ``id`` names the stream; the client sets one (``request_id=``, or a fresh
``chat-<hex>`` / ``cmpl-<hex>``) and subscribes to it before it sends the request, so no frame is missed.
Without an ``id`` in the spec (plain ``openai`` calls), the stream is named by vLLM's request id: the chat
response's ``id`` (``chatcmpl-...``) and, for ``/v1/completions``, the response's ``id`` plus ``-<prompt
index>`` (``cmpl-...-0``); subscribe to ``chatcmpl-*`` with ``from_start=True`` to catch those.

Analysis results. Analyzer processes (``mia-stream analyze NAME --publish``) publish their results for the
request onto the bus; they arrive as "analysis" events in the same iteration (``req.analyses`` keeps them).
An analyzer reports a request's final results after that request's end, so ``analyzers=["NAME", ...]`` keeps
the request open until each named analyzer has sent its final result for it (the result of step -1, which
the analyzer runner sends when the request ends or when it refuses the request); otherwise the iteration ends
at the stream's end and later results are not read.

Stopping. The HTTP side runs in a thread (sync) or a task (async); the stream is read in a thread. A request
is over when its response, its stream's end and the final results of the ``analyzers`` it waits for have
arrived; a response without those within ``end_timeout`` s raises ``BrokerTimeoutError`` (e.g. a server started without ``MIA_STREAM_BROKER``). An
HTTP error (e.g. ``openai.BadRequestError`` for a bad spec) is raised by the iteration at once; the stream
thread, which waits for events it can no longer get, then ends within ``idle_timeout`` s (``open_stream``'s
iterator cannot be interrupted from another thread).
"""

from __future__ import annotations

import asyncio
import json
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from mia_stream.consumers import (AnalysisEvent, EndEvent, Event, FrameEvent, GapEvent, RequestStream, StepFrame,
                                  open_stream)
from mia_stream.errors import BrokerTimeoutError, MiaStreamError, SpecError

__all__ = ["AsyncServedRequest", "AsyncStreamClient", "RecordingClient", "ServedEvent", "ServedRequest",
           "StreamClient", "build_spec"]

SPEC_KEY = "mia_stream"


# ------------------------------------------------------------------------------------------ spec
def _jsonable_vector(vector: Any) -> Any:
    if isinstance(vector, np.ndarray):
        return np.asarray(vector, dtype=np.float64).tolist()
    if isinstance(vector, dict) and set(vector) == {"f32"}:
        return np.frombuffer(bytes(vector["f32"]), dtype="<f4").astype(np.float64).tolist()
    return vector


def build_spec(capture: dict | None = None, steer: list | None = None, tags: dict | None = None,
               request_id: str | None = None, spec: dict | None = None) -> dict:
    """The ``mia_stream`` spec as plain JSON-able data (numpy / float32-bytes vectors become float lists;
    the server validates it: a bad one is an HTTP 400 naming the field)."""
    out = dict(spec or {})
    if capture is not None:
        out["capture"] = capture
    if steer is not None:
        out["steer"] = steer
    if tags is not None:
        out["tags"] = tags
    if request_id is not None:
        out["id"] = request_id
    if "steer" in out:
        if not isinstance(out["steer"], (list, tuple)):
            raise SpecError("steer must be a list of operations")
        out["steer"] = [dict(op, vector=_jsonable_vector(op.get("vector"))) if isinstance(op, dict) else op
                        for op in out["steer"]]
    return out


def _analyzer_names(analyzers: Any) -> frozenset:
    if isinstance(analyzers, str):
        analyzers = [analyzers]
    names = frozenset(analyzers or ())
    if not all(isinstance(n, str) and n for n in names):
        raise SpecError(f"analyzers must be analyzer names, got {sorted(map(repr, names))}")
    return names


def _glob_escape(text: str) -> str:
    """A pattern that matches exactly ``text`` (the broker matches subscriptions with fnmatch)."""
    return "".join(f"[{c}]" if c in "[]*?" else c for c in text)


# ------------------------------------------------------------------------------------------ events
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


@dataclass
class _State:
    """What has arrived for one request (shared by the sync and async flavours)."""

    request_id: str
    keep_frames: bool
    text_parts: list = field(default_factory=list)
    chunks: list = field(default_factory=list)
    response: Any = None
    stream: RequestStream | None = None
    frames: list = field(default_factory=list)
    gaps: list = field(default_factory=list)
    http_done: bool = False
    bus_ended: bool = False
    awaiting: set = field(default_factory=set)  # analyzers whose final result (step -1) has not come yet
    analyses: list = field(default_factory=list)

    @property
    def bus_done(self) -> bool:
        return self.bus_ended and not self.awaiting

    def on_bus(self, ev: Event) -> ServedEvent:
        self.stream = ev.stream
        handle = self._BUS.get(type(ev))
        if handle is not None:
            handle(self, ev)
        return ServedEvent(ev.kind, self.request_id, bus=ev)

    def _on_frame(self, ev: FrameEvent) -> None:
        if self.keep_frames:
            self.frames.append(ev.frame)

    def _on_gap(self, ev: GapEvent) -> None:
        self.gaps.append(ev.gap)

    def _on_end(self, ev: EndEvent) -> None:
        self.bus_ended = True

    def _on_analysis(self, ev: AnalysisEvent) -> None:
        self.analyses.append(ev.analysis)
        if ev.analysis.step == -1:
            self.awaiting.discard(ev.analysis.analyzer)

    # on_bus's handler of each SDK event class (start and tokens: nothing to keep)
    _BUS = {FrameEvent: _on_frame, GapEvent: _on_gap, EndEvent: _on_end, AnalysisEvent: _on_analysis}

    def end_timeout_error(self, end_timeout: float) -> BrokerTimeoutError:
        if self.bus_ended:
            return BrokerTimeoutError(
                f"request {self.request_id!r}: its stream ended but no final result came from analyzer(s) "
                f"{sorted(self.awaiting)} within {end_timeout:g} s (is each running with --publish on this broker "
                "and --patterns matching this request?)")
        return BrokerTimeoutError(
            f"request {self.request_id!r}: the response came but its stream did not end within {end_timeout:g} s "
            "(is the server running with MIA_STREAM_BROKER set to this broker?)")

    def on_text(self, delta: str, chunk: Any = None) -> ServedEvent:
        self.text_parts.append(delta)
        if chunk is not None:
            self.chunks.append(chunk)
        return ServedEvent("text", self.request_id, text=delta, chunk=chunk)

    def on_response(self, response: Any) -> ServedEvent:
        self.http_done = True
        self.response = response
        return ServedEvent("response", self.request_id, response=response)


class _Results:
    """Read access to a request's state, common to ``ServedRequest`` and ``AsyncServedRequest``."""

    _state: _State

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


# ------------------------------------------------------------------------------------------ workers
def _bus_worker(source: Any, request_id: str, put: Callable[[tuple], None], stop: threading.Event,
                subscribed: Callable[[], None], idle_timeout: float, options: dict, reopen: bool,
                analyzers: frozenset = frozenset()) -> None:
    """Read ``request_id``'s events from ``source`` (live) and ``put`` them; ends at its end event (and the final
    results of ``analyzers``, which come after it) or ``stop``.

    ``reopen`` (a request this client sent): a session that ends idle before any event was seen is reopened
    (the request may still be queued); nothing was delivered from it, so nothing repeats. Without it (``open``
    of someone else's request), no event within ``idle_timeout`` is an error.
    """
    pattern = _glob_escape(request_id)
    seen = ended = False
    awaiting = set(analyzers)
    try:
        while not stop.is_set():
            with open_stream(source, patterns=[pattern], from_start=True, timeout=idle_timeout, **options) as es:
                subscribed()
                for ev in es:
                    if ev.stream.request_id != request_id:
                        continue
                    seen = True
                    put(("bus", ev))
                    ended = ended or ev.kind == "end"
                    if ev.kind == "analysis" and ev.analysis.step == -1:
                        awaiting.discard(ev.analysis.analyzer)
                    if (ended and not awaiting) or stop.is_set():
                        return
            if seen:
                what = f"the final result of analyzer(s) {sorted(awaiting)}" if ended else "its end"
                put(("bus_error", BrokerTimeoutError(
                    f"stream {request_id!r}: no event for {idle_timeout:g} s before {what} (idle_timeout)")))
                return
            if not reopen:
                put(("bus_error", BrokerTimeoutError(
                    f"no stream {request_id!r} on the broker within {idle_timeout:g} s (idle_timeout)")))
                return
    except Exception as e:  # noqa: BLE001 — handed to the reader, which raises it
        put(("bus_error", e))
    finally:
        subscribed()
        put(("bus_closed", None))


def _delta_of(chunk: Any, chat: bool) -> str:
    choices = getattr(chunk, "choices", None) or []
    if not choices:
        return ""
    if chat:
        return getattr(getattr(choices[0], "delta", None), "content", None) or ""
    return getattr(choices[0], "text", None) or ""


def _full_text(response: Any, chat: bool) -> str:
    choices = getattr(response, "choices", None) or []
    if not choices:
        return ""
    if chat:
        return getattr(choices[0].message, "content", None) or ""
    return getattr(choices[0], "text", None) or ""


def _http_worker(call: Callable[[], Any], stream: bool, chat: bool, put: Callable[[tuple], None],
                 cancelled: threading.Event) -> None:
    try:
        result = call()
        if stream:
            last = None
            try:
                for chunk in result:
                    if cancelled.is_set():
                        break
                    last = chunk
                    put(("text", (_delta_of(chunk, chat), chunk)))
            finally:
                close = getattr(result, "close", None)
                if close is not None:
                    close()
            put(("response", last))
        else:
            put(("text", (_full_text(result, chat), None)))
            put(("response", result))
    except Exception as e:  # noqa: BLE001 — handed to the reader, which raises it
        put(("http_error", e))


# ------------------------------------------------------------------------------------------ sync
class ServedRequest(_Results):
    """One request's events, in arrival order (text and stream interleaved). Iterate it (or ``collect()``);
    use it as a context manager so an abandoned request's threads are stopped."""

    def __init__(self, request_id: str, *, source: Any, http_call: Callable[[], Any] | None, stream: bool,
                 chat: bool, keep_frames: bool, end_timeout: float, idle_timeout: float, options: dict,
                 analyzers: frozenset = frozenset()):
        self._state = _State(request_id, keep_frames, awaiting=set(analyzers))
        self._analyzers = analyzers
        self._q: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self._end_timeout = end_timeout
        self._http_done_at: float | None = None
        self._closed = False
        self._started = False
        self._args = (source, http_call, stream, chat, idle_timeout, options)
        self._attached = http_call is None  # a request someone else sent: no HTTP side, no end deadline
        if self._attached:
            self._state.http_done = True

    def _start(self) -> None:
        self._started = True
        source, http_call, stream, chat, idle_timeout, options = self._args
        subscribed = threading.Event()
        self._bus = threading.Thread(target=_bus_worker, daemon=True, name=f"mia-bus-{self.request_id}",
                                     args=(source, self.request_id, self._q.put, self._stop, subscribed.set,
                                           idle_timeout, options, http_call is not None, self._analyzers))
        self._bus.start()
        subscribed.wait()  # subscribed before the request is sent: the stream is read from its first event
        if http_call is not None:
            threading.Thread(target=_http_worker, daemon=True, name=f"mia-http-{self.request_id}",
                             args=(http_call, stream, chat, self._q.put, self._stop)).start()

    def __iter__(self) -> Iterator[ServedEvent]:
        return self

    def __next__(self) -> ServedEvent:
        if not self._started:
            self._start()
        st = self._state
        while True:
            if self._closed or (st.http_done and st.bus_done):
                self.close()
                raise StopIteration
            timeout = None
            if st.http_done and not self._attached:
                self._http_done_at = self._http_done_at or time.monotonic()
                timeout = max(0.0, self._http_done_at + self._end_timeout - time.monotonic())
            try:
                kind, payload = self._q.get(timeout=timeout)
            except queue.Empty:
                self.close()
                raise st.end_timeout_error(self._end_timeout) from None
            if kind == "bus":
                return st.on_bus(payload)
            if kind == "text":
                delta, chunk = payload
                if delta or chunk is None:
                    return st.on_text(delta, chunk)
                if chunk is not None:
                    st.chunks.append(chunk)
                continue
            if kind == "response":
                return st.on_response(payload)
            if kind in ("http_error", "bus_error"):
                self.close()
                raise payload
            if kind == "bus_closed" and not st.bus_done:
                self.close()
                raise MiaStreamError(f"stream {self.request_id!r}: the stream reader stopped before its end")

    def collect(self) -> "ServedRequest":
        """Consume every event (keeping the frames) and return self."""
        self._state.keep_frames = True
        for _ in self:
            pass
        return self

    def close(self) -> None:
        """Stop reading (the HTTP stream is closed; the stream thread ends at its next event or idle)."""
        self._closed = True
        self._stop.set()

    def __enter__(self) -> "ServedRequest":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _ClientBase:
    def __init__(self, broker: Any, model: str | None, keep_frames: bool, end_timeout: float,
                 idle_timeout: float, stream_options: dict | None):
        self.broker = broker
        self.model = model
        self.keep_frames = keep_frames
        self.end_timeout = end_timeout
        self.idle_timeout = idle_timeout
        self.stream_options = dict(stream_options or {})

    def _request(self, kind: str, capture, steer, tags, request_id, spec, extra_body) -> tuple[str, dict]:
        rid = request_id or (spec or {}).get("id") or f"{kind}-{uuid.uuid4().hex[:20]}"
        body = dict(extra_body or {})
        xargs = dict(body.get("vllm_xargs") or {})
        xargs[SPEC_KEY] = json.dumps(build_spec(capture, steer, tags, rid, spec))
        body["vllm_xargs"] = xargs
        return rid, body


class StreamClient(_ClientBase):
    """Requests to an OpenAI-compatible vLLM server with the mia_stream plugin, and their streams.

    ``base_url``: the server's ``/v1`` URL; ``broker``: the broker address the server publishes to (None =
    ``$MIA_STREAM_BROKER`` or the default run dir); ``model``: the served model name (None = the server's
    first); ``openai_client``: a ready ``openai.OpenAI`` (else one is made from ``base_url``/``api_key``).
    ``stream_options``: passed to ``open_stream`` (``window_bytes``, ``keys``, ...).
    """

    def __init__(self, base_url: str = "http://127.0.0.1:8000/v1", broker: Any = None, *, model: str | None = None,
                 api_key: str = "EMPTY", openai_client: Any = None, keep_frames: bool = False,
                 end_timeout: float = 60.0, idle_timeout: float = 30.0, stream_options: dict | None = None,
                 **openai_kwargs: Any):
        super().__init__(broker, model, keep_frames, end_timeout, idle_timeout, stream_options)
        if openai_client is None:
            import openai

            openai_client = openai.OpenAI(base_url=base_url, api_key=api_key, **openai_kwargs)
        self.openai = openai_client

    def _model(self) -> str:
        if self.model is None:
            self.model = self.openai.models.list().data[0].id
        return self.model

    def _served(self, rid: str, call, stream: bool, chat: bool, keep_frames: bool | None,
                analyzers=()) -> ServedRequest:
        return ServedRequest(rid, source=self.broker, http_call=call, stream=stream, chat=chat,
                             keep_frames=self.keep_frames if keep_frames is None else keep_frames,
                             end_timeout=self.end_timeout, idle_timeout=self.idle_timeout,
                             options=self.stream_options, analyzers=_analyzer_names(analyzers))

    def chat(self, messages: list, *, capture: dict | None = None, steer: list | None = None,
             tags: dict | None = None, request_id: str | None = None, spec: dict | None = None,
             stream: bool = True, keep_frames: bool | None = None, extra_body: dict | None = None,
             analyzers: Sequence[str] = (), **create_kwargs: Any) -> ServedRequest:
        """A chat completion with a capture/steering spec; nothing is sent until the first ``next``.
        ``create_kwargs`` go to ``chat.completions.create`` (``max_tokens``, ``temperature``, ``seed``...).
        ``analyzers``: names of analyzer processes publishing on this broker whose final results to wait for."""
        rid, body = self._request("chat", capture, steer, tags, request_id, spec, extra_body)
        model = create_kwargs.pop("model", None) or self._model()
        if create_kwargs.get("n", 1) != 1:
            raise SpecError("StreamClient sends one choice per request (n=1)")

        def call():
            return self.openai.chat.completions.create(model=model, messages=messages, stream=stream,
                                                       extra_body=body, **create_kwargs)

        return self._served(rid, call, stream, True, keep_frames, analyzers)

    def completion(self, prompt: str | list[int], *, capture: dict | None = None, steer: list | None = None,
                   tags: dict | None = None, request_id: str | None = None, spec: dict | None = None,
                   stream: bool = True, keep_frames: bool | None = None, extra_body: dict | None = None,
                   analyzers: Sequence[str] = (), **create_kwargs: Any) -> ServedRequest:
        """A completion; ``prompt`` may be token ids (e.g. ``chat_spans(...).token_ids``: no re-tokenization)."""
        if isinstance(prompt, (list, tuple)) and prompt and isinstance(prompt[0], (list, tuple, str)):
            raise SpecError("StreamClient.completion takes one prompt (a string or a list of token ids)")
        rid, body = self._request("cmpl", capture, steer, tags, request_id, spec, extra_body)
        model = create_kwargs.pop("model", None) or self._model()
        if create_kwargs.get("n", 1) != 1:
            raise SpecError("StreamClient sends one choice per request (n=1)")

        def call():
            return self.openai.completions.create(model=model, prompt=prompt, stream=stream, extra_body=body,
                                                  **create_kwargs)

        return self._served(rid, call, stream, False, keep_frames, analyzers)

    def open(self, request_id: str, keep_frames: bool | None = None, analyzers: Sequence[str] = ()) -> ServedRequest:
        """The stream of a request sent by someone else (live, from its start while the broker buffers it)."""
        return self._served(request_id, None, False, True, keep_frames, analyzers)

    @staticmethod
    def recording(path: Any) -> "RecordingClient":
        return RecordingClient(path)


# ------------------------------------------------------------------------------------------ recording
class RecordingClient:
    """The same ``open(request_id)`` and events over a recording; ``text`` events are decoded from the
    recorded tokens with the tokenizer named in the stream's start (skipping special tokens), so they may
    differ from the server's detokenization in whitespace details."""

    def __init__(self, path: Any):
        self.path = path

    def request_ids(self, patterns=("*",)) -> list[str]:
        ids = []
        with open_stream(self.path, patterns=patterns) as es:
            for ev in es:
                if ev.kind == "start" and ev.stream.request_id not in ids:
                    ids.append(ev.stream.request_id)
        return ids

    def open(self, request_id: str, keep_frames: bool = False) -> "RecordedRequest":
        return RecordedRequest(self.path, request_id, keep_frames)


class RecordedRequest(_Results):
    def __init__(self, path: Any, request_id: str, keep_frames: bool):
        self._state = _State(request_id, keep_frames)
        self._state.http_done = True
        self._path = path
        self._gen = self._events()

    def _events(self) -> Iterator[ServedEvent]:
        tok, ids = None, []
        with open_stream(self._path, patterns=[_glob_escape(self.request_id)]) as es:
            for ev in es:
                if ev.stream.request_id != self.request_id:
                    continue
                yield self._state.on_bus(ev)
                if ev.kind == "tokens" and ev.tokens.token_ids:
                    if tok is None:
                        tok = _tokenizer(ev.stream.start.tokenizer if ev.stream.start else None)
                    if tok is not None:
                        before = tok.decode(ids, skip_special_tokens=True)
                        ids.extend(ev.tokens.token_ids)
                        after = tok.decode(ids, skip_special_tokens=True)
                        delta = after[len(before):] if after.startswith(before) else after
                        if delta:
                            yield self._state.on_text(delta)

    def __iter__(self) -> Iterator[ServedEvent]:
        return self._gen

    def __next__(self) -> ServedEvent:
        return next(self._gen)

    def collect(self) -> "RecordedRequest":
        self._state.keep_frames = True
        for _ in self._gen:
            pass
        return self

    def close(self) -> None:
        self._gen.close()

    def __enter__(self) -> "RecordedRequest":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


_TOKENIZERS: dict = {}


def _tokenizer(name: str | None):
    if not name:
        return None
    if name not in _TOKENIZERS:
        try:
            from transformers import AutoTokenizer

            _TOKENIZERS[name] = AutoTokenizer.from_pretrained(name)
        except Exception:  # noqa: BLE001 — no tokenizer here: the recording still gives tokens, not text
            _TOKENIZERS[name] = None
    return _TOKENIZERS[name]


# ------------------------------------------------------------------------------------------ asyncio
class AsyncServedRequest(_Results):
    """The asyncio flavour of ``ServedRequest``: ``async for ev in req`` / ``await req.collect()``."""

    def __init__(self, request_id: str, *, source: Any, http_call, stream: bool, chat: bool, keep_frames: bool,
                 end_timeout: float, idle_timeout: float, options: dict, analyzers: frozenset = frozenset()):
        self._state = _State(request_id, keep_frames, awaiting=set(analyzers))
        self._analyzers = analyzers
        self._stop = threading.Event()
        self._end_timeout = end_timeout
        self._args = (source, http_call, stream, chat, idle_timeout, options)
        self._q: asyncio.Queue | None = None
        self._task: asyncio.Task | None = None
        self._http_done_at: float | None = None
        self._closed = False
        self._attached = http_call is None
        if self._attached:
            self._state.http_done = True

    async def _start(self) -> None:
        loop = asyncio.get_running_loop()
        q = self._q = asyncio.Queue()
        source, http_call, stream, chat, idle_timeout, options = self._args
        subscribed = asyncio.Event()

        def put(item):
            loop.call_soon_threadsafe(q.put_nowait, item)

        threading.Thread(target=_bus_worker, daemon=True, name=f"mia-bus-{self.request_id}",
                         args=(source, self.request_id, put, self._stop,
                               lambda: loop.call_soon_threadsafe(subscribed.set), idle_timeout, options,
                               http_call is not None, self._analyzers)).start()
        await subscribed.wait()
        if http_call is not None:
            self._task = asyncio.create_task(self._http(http_call, stream, chat, q))

    async def _http(self, call, stream: bool, chat: bool, q: asyncio.Queue) -> None:
        try:
            result = await call()
            if stream:
                last = None
                try:
                    async for chunk in result:
                        last = chunk
                        q.put_nowait(("text", (_delta_of(chunk, chat), chunk)))
                finally:
                    close = getattr(result, "close", None)
                    if close is not None:
                        await close()
                q.put_nowait(("response", last))
            else:
                q.put_nowait(("text", (_full_text(result, chat), None)))
                q.put_nowait(("response", result))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 — raised by the reader
            q.put_nowait(("http_error", e))

    def __aiter__(self) -> "AsyncServedRequest":
        return self

    async def __anext__(self) -> ServedEvent:
        if self._q is None:
            await self._start()
        st = self._state
        while True:
            if self._closed or (st.http_done and st.bus_done):
                self.close()
                raise StopAsyncIteration
            try:
                if st.http_done and not self._attached:
                    self._http_done_at = self._http_done_at or time.monotonic()
                    left = max(0.0, self._http_done_at + self._end_timeout - time.monotonic())
                    kind, payload = await asyncio.wait_for(self._q.get(), left)
                else:
                    kind, payload = await self._q.get()
            except asyncio.TimeoutError:
                self.close()
                raise st.end_timeout_error(self._end_timeout) from None
            if kind == "bus":
                return st.on_bus(payload)
            if kind == "text":
                delta, chunk = payload
                if delta or chunk is None:
                    return st.on_text(delta, chunk)
                st.chunks.append(chunk)
                continue
            if kind == "response":
                return st.on_response(payload)
            if kind in ("http_error", "bus_error"):
                self.close()
                raise payload
            if kind == "bus_closed" and not st.bus_done:
                self.close()
                raise MiaStreamError(f"stream {self.request_id!r}: the stream reader stopped before its end")

    async def collect(self) -> "AsyncServedRequest":
        self._state.keep_frames = True
        async for _ in self:
            pass
        return self

    def close(self) -> None:
        self._closed = True
        self._stop.set()
        if self._task is not None and not self._task.done():
            self._task.cancel()

    async def __aenter__(self) -> "AsyncServedRequest":
        return self

    async def __aexit__(self, *exc) -> None:
        self.close()


class AsyncStreamClient(_ClientBase):
    """``StreamClient`` for asyncio: the request goes through ``openai.AsyncOpenAI``; same arguments."""

    def __init__(self, base_url: str = "http://127.0.0.1:8000/v1", broker: Any = None, *, model: str | None = None,
                 api_key: str = "EMPTY", openai_client: Any = None, keep_frames: bool = False,
                 end_timeout: float = 60.0, idle_timeout: float = 30.0, stream_options: dict | None = None,
                 **openai_kwargs: Any):
        super().__init__(broker, model, keep_frames, end_timeout, idle_timeout, stream_options)
        if openai_client is None:
            import openai

            openai_client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, **openai_kwargs)
        self.openai = openai_client

    async def _model(self) -> str:
        if self.model is None:
            self.model = (await self.openai.models.list()).data[0].id
        return self.model

    def _served(self, rid, call, stream, chat, keep_frames, analyzers=()) -> AsyncServedRequest:
        return AsyncServedRequest(rid, source=self.broker, http_call=call, stream=stream, chat=chat,
                                  keep_frames=self.keep_frames if keep_frames is None else keep_frames,
                                  end_timeout=self.end_timeout, idle_timeout=self.idle_timeout,
                                  options=self.stream_options, analyzers=_analyzer_names(analyzers))

    def chat(self, messages: list, *, capture: dict | None = None, steer: list | None = None,
             tags: dict | None = None, request_id: str | None = None, spec: dict | None = None,
             stream: bool = True, keep_frames: bool | None = None, extra_body: dict | None = None,
             analyzers: Sequence[str] = (), **create_kwargs: Any) -> AsyncServedRequest:
        rid, body = self._request("chat", capture, steer, tags, request_id, spec, extra_body)
        if create_kwargs.get("n", 1) != 1:
            raise SpecError("AsyncStreamClient sends one choice per request (n=1)")

        async def call():
            model = create_kwargs.pop("model", None) or await self._model()
            return await self.openai.chat.completions.create(model=model, messages=messages, stream=stream,
                                                             extra_body=body, **create_kwargs)

        return self._served(rid, call, stream, True, keep_frames, analyzers)

    def completion(self, prompt: str | list[int], *, capture: dict | None = None, steer: list | None = None,
                   tags: dict | None = None, request_id: str | None = None, spec: dict | None = None,
                   stream: bool = True, keep_frames: bool | None = None, extra_body: dict | None = None,
                   analyzers: Sequence[str] = (), **create_kwargs: Any) -> AsyncServedRequest:
        rid, body = self._request("cmpl", capture, steer, tags, request_id, spec, extra_body)
        if create_kwargs.get("n", 1) != 1:
            raise SpecError("AsyncStreamClient sends one choice per request (n=1)")

        async def call():
            model = create_kwargs.pop("model", None) or await self._model()
            return await self.openai.completions.create(model=model, prompt=prompt, stream=stream,
                                                        extra_body=body, **create_kwargs)

        return self._served(rid, call, stream, False, keep_frames, analyzers)

    def open(self, request_id: str, keep_frames: bool | None = None,
             analyzers: Sequence[str] = ()) -> AsyncServedRequest:
        return self._served(request_id, None, False, True, keep_frames, analyzers)

    @staticmethod
    def recording(path: Any) -> RecordingClient:
        return RecordingClient(path)
