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

Layout. The request's protocol (what each item read becomes, when the request is over, which error to raise)
is one sans-I/O ``RequestMachine`` (``_protocol``); ``ServedRequest`` and ``AsyncServedRequest`` are thin I/O
shells that read and feed it, so the sync and async flavours cannot drift apart.

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
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from mia_stream.consumers import open_stream
from mia_stream.errors import BrokerTimeoutError, SpecError
from mia_stream.served._protocol import (ENGINE_DETECTOR, RequestMachine, RequestState, Results, ServedEvent,
                                         StreamProgress)

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
               request_id: str | None = None, spec: dict | None = None, detect: list | None = None) -> dict:
    """The ``mia_stream`` spec as plain JSON-able data (numpy / float32-bytes vectors become float lists;
    the server validates it: a bad one is an HTTP 400 naming the field)."""
    out = dict(spec or {})
    if capture is not None:
        out["capture"] = capture
    if steer is not None:
        out["steer"] = steer
    if detect is not None:  # in-engine detectors (docs/detectors.md)
        out["detect"] = detect
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


def _awaited(analyzers: Any, detect: list | None) -> tuple:
    """The analyzers whose final results a request waits for, plus one entry per in-engine detector: their
    scores come from the engine core, their StreamEnd from the drain, so only their own finals say all came."""
    names = [analyzers] if isinstance(analyzers, str) else list(analyzers or ())
    return (*names, *(f"{ENGINE_DETECTOR}{i}" for i in range(len(detect or ()))))


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
    seen = False
    progress = StreamProgress(set(analyzers))
    try:
        while not stop.is_set():
            with open_stream(source, patterns=[pattern], from_start=True, timeout=idle_timeout, **options) as es:
                subscribed()
                for ev in es:
                    if ev.stream.request_id != request_id:
                        continue
                    seen = True
                    put(("bus", ev.keep()))  # read by another thread, after this one moved on: its own tensors
                    progress.see(ev)
                    if progress.done or stop.is_set():
                        return
            if seen:
                what = (f"the final result of analyzer(s) {sorted(progress.awaiting)}" if progress.ended
                        else "its end")
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


def _http_worker(call: Callable[[], Any], stream: bool, put: Callable[[tuple], None],
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
                    put(("chunk", chunk))
            finally:
                close = getattr(result, "close", None)
                if close is not None:
                    close()
            put(("response", last))
        else:
            put(("result", result))
    except Exception as e:  # noqa: BLE001 — handed to the reader, which raises it
        put(("http_error", e))


# ------------------------------------------------------------------------------------------ sync
class ServedRequest(Results):
    """One request's events, in arrival order (text and stream interleaved). Iterate it (or ``collect()``);
    use it as a context manager so an abandoned request's threads are stopped. The I/O shell (a stream thread,
    an HTTP thread, a queue) of a ``RequestMachine``."""

    def __init__(self, request_id: str, *, source: Any, http_call: Callable[[], Any] | None, stream: bool,
                 chat: bool, keep_frames: bool, end_timeout: float, idle_timeout: float, options: dict,
                 analyzers: frozenset = frozenset()):
        self._machine = RequestMachine(request_id, chat=chat, keep_frames=keep_frames, analyzers=analyzers,
                                       attached=http_call is None, end_timeout=end_timeout)
        self._state = self._machine.state
        self._analyzers = analyzers
        self._q: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self._started = False
        self._args = (source, http_call, stream, idle_timeout, options)

    def _start(self) -> None:
        self._started = True
        source, http_call, stream, idle_timeout, options = self._args
        subscribed = threading.Event()
        self._bus = threading.Thread(target=_bus_worker, daemon=True, name=f"mia-bus-{self.request_id}",
                                     args=(source, self.request_id, self._q.put, self._stop, subscribed.set,
                                           idle_timeout, options, http_call is not None, self._analyzers))
        self._bus.start()
        subscribed.wait()  # subscribed before the request is sent: the stream is read from its first event
        if http_call is not None:
            threading.Thread(target=_http_worker, daemon=True, name=f"mia-http-{self.request_id}",
                             args=(http_call, stream, self._q.put, self._stop)).start()

    def __iter__(self) -> Iterator[ServedEvent]:
        return self

    def __next__(self) -> ServedEvent:
        if not self._started:
            self._start()
        m = self._machine
        while True:
            if m.finished:
                self.close()
                raise StopIteration
            ev = m.next_event()
            if ev is not None:
                return ev
            try:
                item = self._q.get(timeout=m.wait_time(time.monotonic()))
            except queue.Empty:
                self.close()
                raise m.timeout_error() from None
            try:
                m.receive(*item)
            except BaseException:
                self.close()
                raise

    def collect(self) -> "ServedRequest":
        """Consume every event (keeping the frames) and return self."""
        self._state.keep_frames = True
        for _ in self:
            pass
        return self

    def close(self) -> None:
        """Stop reading (the HTTP stream is closed; the stream thread ends at its next event or idle)."""
        self._machine.closed = True
        self._stop.set()

    def __enter__(self) -> "ServedRequest":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _ClientBase:
    """What the sync and async clients share: the request (spec, stream id, body) and the methods; each flavour
    says how a call is made (``_call``) and which request shell runs it (``_request_class``)."""

    _request_class: type
    _openai_class: str  # the openai client class of the flavour ("OpenAI" or "AsyncOpenAI")

    def __init__(self, base_url: str = "http://127.0.0.1:8000/v1", broker: Any = None, *, model: str | None = None,
                 api_key: str = "EMPTY", openai_client: Any = None, keep_frames: bool = False,
                 end_timeout: float = 60.0, idle_timeout: float = 30.0, stream_options: dict | None = None,
                 **openai_kwargs: Any):
        self.broker = broker
        self.model = model
        self.keep_frames = keep_frames
        self.end_timeout = end_timeout
        self.idle_timeout = idle_timeout
        self.stream_options = dict(stream_options or {})
        if openai_client is None:
            import openai

            openai_client = getattr(openai, self._openai_class)(base_url=base_url, api_key=api_key, **openai_kwargs)
        self.openai = openai_client

    def _request(self, kind: str, capture, steer, tags, request_id, spec, extra_body,
                 create_kwargs: dict, detect=None) -> tuple[str, dict]:
        if create_kwargs.get("n", 1) != 1:
            raise SpecError(f"{type(self).__name__} sends one choice per request (n=1)")
        rid = request_id or (spec or {}).get("id") or f"{kind}-{uuid.uuid4().hex[:20]}"
        body = dict(extra_body or {})
        xargs = dict(body.get("vllm_xargs") or {})
        xargs[SPEC_KEY] = json.dumps(build_spec(capture, steer, tags, rid, spec, detect))
        body["vllm_xargs"] = xargs
        return rid, body

    def _call(self, create: Callable, create_kwargs: dict, **kwargs: Any) -> Callable:
        raise NotImplementedError

    def _served(self, rid: str, call, stream: bool, chat: bool, keep_frames: bool | None, analyzers=()):
        return self._request_class(rid, source=self.broker, http_call=call, stream=stream, chat=chat,
                                   keep_frames=self.keep_frames if keep_frames is None else keep_frames,
                                   end_timeout=self.end_timeout, idle_timeout=self.idle_timeout,
                                   options=self.stream_options, analyzers=_analyzer_names(analyzers))

    def chat(self, messages: list, *, capture: dict | None = None, steer: list | None = None,
             tags: dict | None = None, request_id: str | None = None, spec: dict | None = None,
             stream: bool = True, keep_frames: bool | None = None, extra_body: dict | None = None,
             analyzers: Sequence[str] = (), detect: list | None = None, **create_kwargs: Any):
        """A chat completion with a capture/steering spec; nothing is sent until the first ``next``.
        ``create_kwargs`` go to ``chat.completions.create`` (``max_tokens``, ``temperature``, ``seed``...).
        ``analyzers``: names of analyzer processes publishing on this broker whose final results to wait for.
        ``detect``: in-engine detectors (docs/detectors.md); their scores arrive as analysis ``engine:<name>``."""
        rid, body = self._request("chat", capture, steer, tags, request_id, spec, extra_body, create_kwargs, detect)
        call = self._call(self.openai.chat.completions.create, create_kwargs, messages=messages, stream=stream,
                          extra_body=body)
        return self._served(rid, call, stream, True, keep_frames, _awaited(analyzers, detect))

    def completion(self, prompt: str | list[int], *, capture: dict | None = None, steer: list | None = None,
                   tags: dict | None = None, request_id: str | None = None, spec: dict | None = None,
                   stream: bool = True, keep_frames: bool | None = None, extra_body: dict | None = None,
                   analyzers: Sequence[str] = (), detect: list | None = None, **create_kwargs: Any):
        """A completion; ``prompt`` may be token ids (e.g. ``chat_spans(...).token_ids``: no re-tokenization)."""
        if isinstance(prompt, (list, tuple)) and prompt and isinstance(prompt[0], (list, tuple, str)):
            raise SpecError(f"{type(self).__name__}.completion takes one prompt (a string or a list of token ids)")
        rid, body = self._request("cmpl", capture, steer, tags, request_id, spec, extra_body, create_kwargs, detect)
        call = self._call(self.openai.completions.create, create_kwargs, prompt=prompt, stream=stream,
                          extra_body=body)
        return self._served(rid, call, stream, False, keep_frames, _awaited(analyzers, detect))

    def open(self, request_id: str, keep_frames: bool | None = None, analyzers: Sequence[str] = ()):
        """The stream of a request sent by someone else (live, from its start while the broker buffers it)."""
        return self._served(request_id, None, False, True, keep_frames, analyzers)

    @staticmethod
    def recording(path: Any) -> "RecordingClient":
        return RecordingClient(path)


class StreamClient(_ClientBase):
    """Requests to an OpenAI-compatible vLLM server with the mia_stream plugin, and their streams.

    ``base_url``: the server's ``/v1`` URL; ``broker``: the broker address the server publishes to (None =
    ``$MIA_STREAM_BROKER`` or the default run dir); ``model``: the served model name (None = the server's
    first); ``openai_client``: a ready ``openai.OpenAI`` (else one is made from ``base_url``/``api_key``).
    ``stream_options``: passed to ``open_stream`` (``window_bytes``, ``keys``, ...).
    """

    _request_class = ServedRequest
    _openai_class = "OpenAI"

    def _model(self) -> str:
        if self.model is None:
            self.model = self.openai.models.list().data[0].id
        return self.model

    def _call(self, create: Callable, create_kwargs: dict, **kwargs: Any) -> Callable[[], Any]:
        model = create_kwargs.pop("model", None) or self._model()
        return lambda: create(model=model, **kwargs, **create_kwargs)


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


class RecordedRequest(Results):
    def __init__(self, path: Any, request_id: str, keep_frames: bool):
        self._state = RequestState(request_id, keep_frames, http_done=True)
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
class AsyncServedRequest(Results):
    """The asyncio flavour of ``ServedRequest``: ``async for ev in req`` / ``await req.collect()``. The I/O
    shell (a stream thread, an HTTP task, an asyncio queue) of the same ``RequestMachine``."""

    def __init__(self, request_id: str, *, source: Any, http_call, stream: bool, chat: bool, keep_frames: bool,
                 end_timeout: float, idle_timeout: float, options: dict, analyzers: frozenset = frozenset()):
        self._machine = RequestMachine(request_id, chat=chat, keep_frames=keep_frames, analyzers=analyzers,
                                       attached=http_call is None, end_timeout=end_timeout)
        self._state = self._machine.state
        self._analyzers = analyzers
        self._stop = threading.Event()
        self._args = (source, http_call, stream, idle_timeout, options)
        self._q: asyncio.Queue | None = None
        self._task: asyncio.Task | None = None

    async def _start(self) -> None:
        loop = asyncio.get_running_loop()
        q = self._q = asyncio.Queue()
        source, http_call, stream, idle_timeout, options = self._args
        subscribed = asyncio.Event()

        def put(item):
            loop.call_soon_threadsafe(q.put_nowait, item)

        threading.Thread(target=_bus_worker, daemon=True, name=f"mia-bus-{self.request_id}",
                         args=(source, self.request_id, put, self._stop,
                               lambda: loop.call_soon_threadsafe(subscribed.set), idle_timeout, options,
                               http_call is not None, self._analyzers)).start()
        await subscribed.wait()
        if http_call is not None:
            self._task = asyncio.create_task(self._http(http_call, stream, q))

    async def _http(self, call, stream: bool, q: asyncio.Queue) -> None:
        try:
            result = await call()
            if stream:
                last = None
                try:
                    async for chunk in result:
                        last = chunk
                        q.put_nowait(("chunk", chunk))
                finally:
                    close = getattr(result, "close", None)
                    if close is not None:
                        await close()
                q.put_nowait(("response", last))
            else:
                q.put_nowait(("result", result))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 — raised by the reader
            q.put_nowait(("http_error", e))

    def __aiter__(self) -> "AsyncServedRequest":
        return self

    async def __anext__(self) -> ServedEvent:
        if self._q is None:
            await self._start()
        m = self._machine
        while True:
            if m.finished:
                self.close()
                raise StopAsyncIteration
            ev = m.next_event()
            if ev is not None:
                return ev
            try:
                item = await asyncio.wait_for(self._q.get(), m.wait_time(time.monotonic()))
            except asyncio.TimeoutError:
                self.close()
                raise m.timeout_error() from None
            try:
                m.receive(*item)
            except BaseException:
                self.close()
                raise

    async def collect(self) -> "AsyncServedRequest":
        self._state.keep_frames = True
        async for _ in self:
            pass
        return self

    def close(self) -> None:
        self._machine.closed = True
        self._stop.set()
        if self._task is not None and not self._task.done():
            self._task.cancel()

    async def __aenter__(self) -> "AsyncServedRequest":
        return self

    async def __aexit__(self, *exc) -> None:
        self.close()


class AsyncStreamClient(_ClientBase):
    """``StreamClient`` for asyncio: the request goes through ``openai.AsyncOpenAI``; same arguments."""

    _request_class = AsyncServedRequest
    _openai_class = "AsyncOpenAI"

    async def _model(self) -> str:
        if self.model is None:
            self.model = (await self.openai.models.list()).data[0].id
        return self.model

    def _call(self, create: Callable, create_kwargs: dict, **kwargs: Any) -> Callable:
        async def call():
            model = create_kwargs.pop("model", None) or await self._model()
            return await create(model=model, **kwargs, **create_kwargs)

        return call
