"""The monitor's HTTP side: FastAPI routes, token check, and one server-sent-event stream per open page.

Routes: ``/`` the page, ``/static/*`` its script and style (package data), ``/api/events`` the event stream
(first event ``hello`` with the page's client id, then ``update`` events), ``/api/view`` (POST: which request the
page shows and, on a recording, the timeline tick), ``/api/snapshot`` (GET: one full update, for scripts),
``/api/ticks`` (a recording's timeline), ``/api/stats`` (the monitor's own counters).

Every route checks its input: ``/api/view`` takes a JSON object of at most 64 KiB (``client`` a string,
``select`` a string or null, ``tick`` a whole number or null), ``/api/snapshot`` a whole-number ``tick``;
anything else is answered 400 (413 for a larger body) with what is wrong. Responses and events are strict JSON
(``_safe.dumps``: no NaN; the state holds only JSON-safe values, ``_safe``). At most ``max_pages`` event
streams are served at once (``--max-pages``, default 64): one more is answered 503 saying so, and the other
routes keep answering. An open page costs nothing while nothing changes (it waits on an event); each change
costs every page one update, at most ``max_rate`` a second.

Pushes are coalesced: a page gets an update when something changed, at most ``max_rate`` per second (the
request list at most ``list_rate`` per second), holding only what changed since its last one (request rows by
version; for the chosen request the tokens, scores, alerts and norms appended since).

With a token (``--token``, else one generated at start, on loopback too) every request must carry it:
``?token=`` once (it is then kept in an HttpOnly cookie named for the port, so monitors on two ports keep their
own), the cookie, or an ``Authorization: Bearer`` header. Without one (``--no-token``, loopback only), only
``Host`` headers naming a loopback address are served (a page on another site cannot reach the monitor through
DNS rebinding).
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
import secrets
import time
import weakref
from importlib import resources
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, Response
from fastapi.staticfiles import StaticFiles
from sse_starlette.sse import EventSourceResponse

from mia_stream.monitor import _safe
from mia_stream.monitor._state import MonitorState

COOKIE = "mia_monitor_token"  # + "_PORT": one cookie per monitor (cookies are per host, not per port)
MAX_BODY = 64 << 10  # bytes of a POST body
DEFAULT_MAX_PAGES = 64  # event streams (open pages) served at once
_LOOPBACK_NAMES = {"localhost", "localhost.localdomain"}


def is_loopback(host: str) -> bool:
    host = host.strip("[]")
    if host in _LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class BadInput(Exception):
    """A request's input is not what the route takes: answered 400 (or ``status``) with the message."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


def _error(message: str, status: int = 400) -> Response:
    return Response(_safe.dumps({"error": message}), status_code=status, media_type="application/json")


def _json(obj, counters=None) -> Response:
    return Response(_safe.dumps(obj, counters), media_type="application/json")


async def _json_object(request: Request) -> dict:
    """The request's body: a JSON object of at most ``MAX_BODY`` bytes, else ``BadInput``."""
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_BODY:
            raise BadInput(f"the body is larger than {MAX_BODY} bytes", 413)
    try:
        obj = json.loads(bytes(body))
    except (ValueError, RecursionError) as e:  # (UnicodeDecodeError is a ValueError)
        raise BadInput(f"the body is not JSON ({type(e).__name__}); send a JSON object") from None
    if not isinstance(obj, dict):
        raise BadInput(f"the body must be a JSON object, e.g. {{\"client\": \"...\", \"select\": \"REQUEST_ID\"}}; "
                       f"got {'null' if obj is None else type(obj).__name__}")
    return obj


def _field(obj: dict, name: str, kind: type, what: str):
    """``obj[name]``: None when absent or null, else of ``kind`` (bool is no int) or ``BadInput``."""
    v = obj.get(name)
    if v is None:
        return None
    if type(v) is not kind:
        raise BadInput(f"{name} must be {what} or null, got {type(v).__name__}")
    return v


def _int_param(value: str | None, name: str) -> int | None:
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise BadInput(f"{name} must be a whole number, got {value[:40]!r}") from None


def _host_of(header: str) -> str:
    """The host part of a Host header (``[::1]:8000`` -> ``::1``)."""
    if header.startswith("["):
        return header[1:].split("]", 1)[0]
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


class _Page:
    """One connected page: what it looks at and what it has already been sent."""

    def __init__(self, cid: str):
        self.cid = cid
        self.select: str | None = None
        self.at: int | None = None  # recording: the tick's tau
        self.tick: int | None = None
        self.rows_sent: dict[str, int] = {}  # request id -> version sent
        self.cursor: dict | None = None
        self.state_version = -1
        self.overview_sent = None
        self.dirty = asyncio.Event()
        self.dirty.set()
        self.full = True  # the next update is the page's first: everything
        self.detail_reset = False  # the next update sends the chosen request from its start (a new choice)
        self.rows_force = False  # the next update sends every row (a new tick: the list as of then)
        self.rows_due = 0.0  # monotonic time from which the list may be sent again
        self.rows_stale = False  # the list changed since it was last sent


class MonitorServer:
    """Builds the FastAPI app for one ``MonitorState``."""

    def __init__(self, state: MonitorState, *, token: str | None = None, max_rate: float = 10.0,
                 list_rate: float = 2.0, source: str = "", max_rows: int = 2000,
                 max_pages: int = DEFAULT_MAX_PAGES):
        self.state, self.token, self.source = state, token, source
        self.max_pages = max_pages
        self.pages_refused = 0
        self.min_interval = 1.0 / max_rate if max_rate > 0 else 0.0
        # The request list changes with every step of every request; re-laying out 256 rows is the page's
        # dominant cost (measured: scripts/bench_monitor.py), so it is sent at most list_rate times a second.
        self.list_interval = 1.0 / list_rate if list_rate > 0 else 0.0
        self.max_rows = max_rows
        self.pages: dict[str, _Page] = {}
        self.loop: asyncio.AbstractEventLoop | None = None
        self._wake_pending = False
        self.pushes = 0
        self.push_bytes = 0
        self.app = self._build()
        state.on_change = self._on_change

    # ------------------------------------------------------------------------------------------ wake-ups

    def _on_change(self) -> None:
        """From the ingest thread: wake the pages, at most one pending wake-up at a time."""
        loop = self.loop
        if loop is None or self._wake_pending:
            return
        self._wake_pending = True
        try:
            loop.call_soon_threadsafe(self._wake)
        except RuntimeError:  # loop closed (shutting down)
            pass

    def _wake(self) -> None:
        self._wake_pending = False
        for page in self.pages.values():
            page.dirty.set()

    # ------------------------------------------------------------------------------------------ auth

    @staticmethod
    def cookie_name(request: Request) -> str:
        server = request.scope.get("server") or ("", 0)
        return f"{COOKIE}_{server[1]}"

    def _check(self, request: Request) -> Response | None:
        if self.token is None:
            if not is_loopback(_host_of(request.headers.get("host", ""))):
                return Response("mia-stream monitor: only served to loopback Host names with --no-token\n",
                                status_code=403, media_type="text/plain")
            return None
        given = request.query_params.get("token") or request.cookies.get(self.cookie_name(request)) or ""
        auth = request.headers.get("authorization", "")
        if auth.lower().startswith("bearer "):
            given = given or auth[7:].strip()
        if given and hmac.compare_digest(given.encode(), self.token.encode()):
            return None
        return Response("mia-stream monitor: a valid token is required (open the URL printed at start)\n",
                        status_code=401, media_type="text/plain")

    # ------------------------------------------------------------------------------------------ updates

    def compose(self, page: _Page) -> dict | None:
        """The update ``page`` needs now (None: nothing changed)."""
        st = self.state
        with st.lock:
            full, reset, force_rows = page.full, page.full or page.detail_reset, page.full or page.rows_force
            page.full = page.detail_reset = page.rows_force = False
            now = time.monotonic()
            if st.version != page.state_version:
                page.rows_stale = True
            elif not reset and not force_rows and not (page.rows_stale and now >= page.rows_due):
                return None
            page.state_version = st.version
            at = page.at
            update: dict = {"server_ms": time.time() * 1000, "full": full}
            rows, gone = [], []
            if full:
                page.rows_sent = {}
            if force_rows or (page.rows_stale and now >= page.rows_due):
                page.rows_stale, page.rows_due = False, now + self.list_interval
                shown = set()
                for rec in st.visible(at)[:self.max_rows]:
                    shown.add(rec.rid)
                    if page.rows_sent.get(rec.rid) != rec.version or at is not None:
                        rows.append(st.row(rec, at))
                        page.rows_sent[rec.rid] = rec.version
                gone = [rid for rid in page.rows_sent if rid not in shown]
                for rid in gone:
                    del page.rows_sent[rid]
            update["rows"], update["gone"] = rows, gone
            overview = st.overview(at)
            if overview != page.overview_sent:
                update["overview"] = overview
                page.overview_sent = overview
            if page.select is not None:
                rec = st.requests.get(page.select)
                if rec is None:
                    update["detail"] = {"id": page.select, "missing": True, "reset": True}
                    page.cursor = None
                else:
                    detail, page.cursor = st.detail(rec, at, None if reset else page.cursor)
                    update["detail"] = detail
            if st.recording and force_rows:
                update["ticks"] = len(st.ticks())
                update["tick"] = page.tick
        if not full and not rows and not gone and "overview" not in update and not _has_news(update.get("detail")):
            return None
        return update

    async def _events(self, request: Request, page: _Page):
        yield {"event": "hello", "data": json.dumps({"client": page.cid, "recording": self.state.recording,
                                                     "source": self.source})}
        last = 0.0
        try:
            while True:
                if page.rows_stale:  # the list waits for its next slot even if nothing else changes
                    try:
                        await asyncio.wait_for(page.dirty.wait(), max(0.0, page.rows_due - time.monotonic()))
                    except asyncio.TimeoutError:
                        pass
                else:
                    await page.dirty.wait()
                page.dirty.clear()
                wait = last + self.min_interval - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)  # coalesce: whatever arrives meanwhile goes into this update
                if await request.is_disconnected():
                    return
                update = self.compose(page)
                last = time.monotonic()
                if update is None:
                    continue
                data = _safe.dumps(update, self.state.counters)
                self.pushes += 1
                self.push_bytes += len(data)
                yield {"event": "update", "data": data}
        finally:
            self.pages.pop(page.cid, None)

    # ------------------------------------------------------------------------------------------ app

    def _build(self) -> FastAPI:
        app = FastAPI(title="mia-stream monitor", docs_url=None, redoc_url=None, openapi_url=None)
        server = self
        static = resources.files("mia_stream.monitor") / "static"

        @app.middleware("http")
        async def auth(request: Request, call_next):
            server.loop = server.loop or asyncio.get_running_loop()
            refused = server._check(request)
            if refused is not None:
                return refused
            response = await call_next(request)
            if server.token and request.query_params.get("token"):
                response.set_cookie(server.cookie_name(request), server.token, httponly=True, samesite="strict")
            return response

        @app.exception_handler(BadInput)
        async def bad_input(request: Request, e: BadInput) -> Response:
            return _error(str(e), e.status)

        @app.get("/", response_class=HTMLResponse)
        async def index() -> HTMLResponse:
            return HTMLResponse((static / "index.html").read_text(), headers={"Cache-Control": "no-store"})

        @app.get("/api/events")
        async def events(request: Request):
            server.loop = asyncio.get_running_loop()
            if len(server.pages) >= server.max_pages:
                server.pages_refused += 1
                return Response(f"mia-stream monitor: {len(server.pages)} pages are open, the most it serves "
                                f"(--max-pages {server.max_pages}); close one, or start it with a higher "
                                f"--max-pages\n", status_code=503, media_type="text/plain",
                                headers={"Retry-After": "5"})
            page = _Page(secrets.token_hex(8))
            server.pages[page.cid] = page
            stream = server._events(request, page)
            # the page's place is given back when its stream is done: from the generator's ``finally``, or, for
            # a stream cancelled before it ever ran (a client gone at once), when the generator is collected
            weakref.finalize(stream, server.pages.pop, page.cid, None)
            return EventSourceResponse(stream, ping=15,
                                       headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"})

        @app.post("/api/view")
        async def view(request: Request) -> Response:
            body = await _json_object(request)
            client = _field(body, "client", str, "a string (the id of the page's hello event)")
            select = _field(body, "select", str, "a string (a request id)")
            tick = _field(body, "tick", int, "a whole number (a timeline tick)")
            if client is None:
                raise BadInput("client is required: the id of the page's hello event")
            page = server.pages.get(client)
            if page is None:
                return _error("unknown client (reconnect the event stream)", 404)
            select = select or None
            if select != page.select:
                page.select, page.detail_reset = select, True
            if server.state.recording and tick is not None:
                ticks = server.state.ticks()
                if not ticks:
                    return _error("the recording has no steps (yet)", 409)
                tick = max(0, min(tick, len(ticks) - 1))
                if tick != page.tick:
                    page.tick, page.at = tick, ticks[tick][0]
                    page.detail_reset = page.rows_force = True
            page.dirty.set()
            return _json({"ok": True, "tick": page.tick})

        @app.get("/api/snapshot")
        async def snapshot(request: Request) -> Response:
            select = request.query_params.get("select") or None
            tick = _int_param(request.query_params.get("tick"), "tick")
            page = _Page("snapshot")
            page.select = select
            if server.state.recording and tick is not None:
                ticks = server.state.ticks()
                if ticks:
                    page.tick = max(0, min(tick, len(ticks) - 1))
                    page.at = ticks[page.tick][0]
            return _json(server.compose(page), server.state.counters)

        @app.get("/api/ticks")
        async def ticks() -> Response:
            return _json([[tau // 1_000_000, step, prod] for tau, step, prod in server.state.ticks()],
                         server.state.counters)

        @app.get("/api/stats")
        async def stats() -> Response:
            """The monitor's own counters (pages, pushes, bytes pushed, what the ingest counted)."""
            with server.state.lock:
                counters = dict(server.state.counters)
            return _json({"pages": len(server.pages), "max_pages": server.max_pages,
                          "pages_refused": server.pages_refused, "pushes": server.pushes,
                          "push_bytes": server.push_bytes, "counters": counters})

        app.mount("/static", StaticFiles(directory=str(static)), name="static")
        return app


def _has_news(detail: dict | None) -> bool:
    if not detail:
        return False
    return bool(detail.get("reset") or detail.get("info") or detail.get("tokens") or detail.get("scores")
                or detail.get("alerts") or detail.get("norms") or detail.get("missing"))
