"""The monitor page against an attacker (issue 24, items 13 and 14): a real ``mia-stream monitor`` process on a
free port, a real broker with a hand-made producer (``bus_helpers.RawProducer``) where a stream is needed, and
real HTTP (httpx, raw sockets for many connections). No browser: the event stream is read as the page reads it
(``EventSource``; ``JSON.parse``, which has no NaN or Infinity).
"""

from __future__ import annotations

import json
import math
import os
import queue
import re
import select
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import httpx

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))
PY = sys.executable

from bus_helpers import RawProducer, kill, run_dir, start_broker, wait_for  # noqa: E402


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("MIA_STREAM_BROKER", None)
    return env


class Monitor:
    """A running ``mia-stream monitor``: its printed URL, the base URL and the token it holds (None: none)."""

    def __init__(self, proc: subprocess.Popen, url: str):
        self.proc, self.url = proc, url
        parts = urlsplit(url)
        self.base = f"{parts.scheme}://{parts.netloc}/"
        self.host, self.port = parts.hostname, parts.port
        self.token = parse_qs(parts.query).get("token", [None])[0]

    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}

    def get(self, path: str, headers: dict | None = None, **kw) -> httpx.Response:
        return httpx.get(self.base + path, headers={**self.headers(), **(headers or {})}, **kw)

    def post(self, path: str, headers: dict | None = None, **kw) -> httpx.Response:
        return httpx.post(self.base + path, headers={**self.headers(), **(headers or {})}, **kw)


@contextmanager
def monitor(source: str, *args: str):
    """``mia-stream monitor --source SOURCE --port 0 ARGS`` as a process; yields a ``Monitor``."""
    proc = subprocess.Popen([PY, "-m", "mia_stream.cli", "monitor", "--source", source, "--port", "0", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())
    try:
        deadline = time.monotonic() + 60
        while True:
            assert time.monotonic() < deadline, "the monitor printed no URL within 60 s"
            r, _, _ = select.select([proc.stdout], [], [], 0.1)
            if r:
                line = proc.stdout.readline()
                m = re.search(r"(http://\S+)", line)
                if m:
                    break
            if proc.poll() is not None:
                raise AssertionError(f"the monitor exited with {proc.returncode}: {proc.stderr.read()[-2000:]}")
        yield Monitor(proc, m.group(1))
    finally:
        kill(proc, signal.SIGTERM)


def _strict_json(text: str):
    """``JSON.parse``: no NaN, Infinity or -Infinity."""
    def refuse(name):
        raise ValueError(f"not JSON: {name}")

    return json.loads(text, parse_constant=refuse)


class EventStream(threading.Thread):
    """``/api/events`` read on a thread as the page's EventSource does: each event's data parsed as JSON
    (strictly). ``events`` gets (event, data) tuples, then ("closed", why) when the stream ends."""

    def __init__(self, mon: Monitor):
        super().__init__(daemon=True)
        self.mon, self.events = mon, queue.Queue()
        self.client: str | None = None
        self._client = httpx.Client(timeout=httpx.Timeout(5.0, read=None))
        self._halt = threading.Event()
        self.start()

    def run(self) -> None:
        why = "ended"
        try:
            with self._client.stream("GET", self.mon.base + "api/events", headers=self.mon.headers()) as r:
                if r.status_code != 200:
                    why = f"status {r.status_code}"
                    return
                event, data = "message", []
                for line in r.iter_lines():
                    if self._halt.is_set():
                        return
                    if line == "":
                        if data:
                            try:
                                self.events.put((event, _strict_json("\n".join(data))))
                            except ValueError as e:
                                why = f"bad JSON in a {event!r} event: {e}"
                                return
                        event, data = "message", []
                    elif line.startswith("event:"):
                        event = line[6:].strip()
                    elif line.startswith("data:"):
                        data.append(line[5:].lstrip())
        except Exception as e:  # noqa: BLE001  (the reason is what the test reports)
            why = f"{type(e).__name__}: {e}"
        finally:
            self.events.put(("closed", why))

    def next(self, predicate, timeout: float, what: str):
        """The first event (event, data) satisfying ``predicate``; fails if the stream closes first."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            assert left > 0, f"the event stream sent no {what} within {timeout} s"
            try:
                event, data = self.events.get(timeout=left)
            except queue.Empty:
                continue
            assert event != "closed", f"the event stream closed before {what}: {data}"
            if event == "hello":
                self.client = data["client"]
            if predicate(event, data):
                return event, data

    def close(self) -> None:
        self._halt.set()
        self._client.close()


def _row(data: dict, rid: str):
    return next((r for r in data.get("rows", []) if r[0] == rid), None)


def _nested(depth: int):
    x: object = "leaf"
    for _ in range(depth):
        x = {"a": x}
    return x


BAD_TAGS = {"bin": b"\x00\xff" * 50, "nan": math.nan, "inf": math.inf, b"bytes-key": "v", "deep": _nested(1000),
            "long": "x" * 200_000, "many": {f"k{i}": i for i in range(10_000)}, "list": [b"\x01", math.nan, 1.5]}


def _bad_start():
    from mia_stream.schemas import StreamStart

    return StreamStart("bad-1", "evil", 1, 0, prompt_token_ids=[1, 2, 3], tags=BAD_TAGS, time_ns=time.time_ns())


def _good_request(pub, rid: str, n: int) -> None:
    from mia_stream.schemas import StreamEnd, StreamStart, TokenFrame

    pub.publish(StreamStart(rid, pub.producer_id, pub.epoch, pub.next_seq(rid), prompt_token_ids=[1, 2],
                            tags={"user": "alice"}, time_ns=time.time_ns()))
    for step in range(n):
        pub.publish(TokenFrame(rid, pub.producer_id, pub.epoch, pub.next_seq(rid), step, token_ids=[10 + step],
                               positions=[2 + step], time_ns=time.time_ns()))
    pub.publish(StreamEnd(rid, pub.producer_id, pub.epoch, pub.next_seq(rid), "length", 2, n,
                          time_ns=time.time_ns()))
    pub.flush(10)


# ---------------------------------------------------------------------------------------------- item 13 (a)

def test_a_start_with_bin_nan_and_deep_tags_breaks_neither_the_event_stream_nor_the_snapshot():
    """A producer's StreamStart whose tags hold msgpack bin values, NaN and inf, a bytes key, 1,000-deep nesting,
    a 200 kB string and 10,000 keys: an open page's event stream goes on (a following good request's tokens
    arrive on it), a page connecting afterwards gets a full update in strict JSON, /api/snapshot answers 200 with
    placeholders, and what was altered is counted."""
    from mia_stream.broker import fetch_stats
    from mia_stream.bus.publisher import FramePublisher

    with run_dir() as address:
        broker = start_broker(address)
        evil = pub = None
        try:
            with monitor(address) as mon:
                open_page = EventStream(mon)
                open_page.next(lambda e, d: e == "update" and d["full"], 30, "a first update")
                wait_for(lambda: any(n.startswith("monitor-") for n in fetch_stats(address)["consumers"]), 30)
                evil = RawProducer(address, "evil")
                evil.hello()
                evil.send(_bad_start())
                wait_for(lambda: mon.get("api/stats").json()["counters"].get("starts", 0) >= 1, 20)
                # the open page's stream carries on: a good request's tokens arrive on it
                pub = FramePublisher(address, producer_id="good", shm_bytes=0)
                _good_request(pub, "good-1", 5)
                _, data = open_page.next(lambda e, d: (r := _row(d, "good-1")) is not None and r[4] == 5, 30,
                                         "good-1's 5 generated tokens")
                # a page connecting now (a reconnect) gets its full update, the bad request's row with it
                late = EventStream(mon)
                _, full = late.next(lambda e, d: e == "update" and d["full"], 30, "a full update")
                bad = _row(full, "bad-1")
                assert bad is not None and "<100 bytes>" in bad[1] and len(bad[1]) < 20_000, bad
                assert _row(full, "good-1") is not None
                # choosing the bad request shows it (its tags, as placeholders) on that page
                r = mon.post("api/view", json={"client": late.client, "select": "bad-1"})
                assert r.status_code == 200, r.text
                _, upd = late.next(lambda e, d: (d.get("detail") or {}).get("info") is not None, 30, "bad-1's detail")
                tags = upd["detail"]["info"]["tags"]
                assert tags["bin"] == "<100 bytes>" and tags["bytes-key"] == "v"
                assert tags["nan"] in (None, "nan") and tags["inf"] in (None, "inf")
                assert len(json.dumps(tags)) < 20_000
                # /api/snapshot: 200, strict JSON, the same placeholders
                for params in ({}, {"select": "bad-1"}):
                    snap = mon.get("api/snapshot", params=params)
                    assert snap.status_code == 200, snap.text[:500]
                    body = _strict_json(snap.text)
                assert body["detail"]["info"]["tags"]["bin"] == "<100 bytes>"
                assert body["detail"]["info"]["tags"]["list"][0] == "<1 bytes>"
                counters = mon.get("api/stats").json()["counters"]
                altered = {k: v for k, v in counters.items() if k.startswith("unsafe_")}
                assert altered.get("unsafe_bytes", 0) >= 2 and altered.get("unsafe_floats", 0) >= 3, counters
                assert altered.get("unsafe_keys", 0) >= 1 and altered.get("unsafe_deep", 0) >= 1, counters
                assert altered.get("unsafe_large", 0) >= 2, counters
                # and both streams are still open
                _good_request(pub, "good-2", 3)
                for page in (open_page, late):
                    page.next(lambda e, d: (r := _row(d, "good-2")) is not None and r[4] == 3, 30, "good-2")
                open_page.close()
                late.close()
        finally:
            for peer in (evil, pub):
                if peer is not None:
                    peer.close()
            broker.terminate()
            broker.wait(10)


# ---------------------------------------------------------------------------------------------- item 13 (b)

def test_every_route_answers_bad_input_with_400(tmp_path):
    """Non-object JSON, no JSON, and fields of the wrong type to /api/view, and a tick that is no number to
    /api/snapshot: 400 with a message saying what is wrong (not 500 or 422). A good request still works."""
    with monitor(str(tmp_path)) as mon:  # (a directory holding no recording: the server serves all the same)
        page = EventStream(mon)
        page.next(lambda e, d: e == "hello", 30, "hello")
        cid = page.client
        for body in ([1, 2], "x", None, 3, True):
            r = mon.post("api/view", json=body)
            assert r.status_code == 400, (body, r.status_code, r.text)
            assert "JSON object" in r.json()["error"], r.text
        r = mon.post("api/view", content=b"{not json", headers={"Content-Type": "application/json"})
        assert r.status_code == 400 and "not JSON" in r.json()["error"], r.text
        for field, value in (("client", 5), ("select", {"a": 1}), ("select", [1]), ("tick", "abc"), ("tick", 1.5),
                             ("tick", True), ("tick", [1])):
            r = mon.post("api/view", json={"client": cid, field: value})
            assert r.status_code == 400 and field in r.json()["error"], (field, value, r.status_code, r.text)
        r = mon.post("api/view", content=b"{" + b" " * (2 << 20) + b"}",
                     headers={"Content-Type": "application/json"})
        assert r.status_code == 413, r.status_code
        for params in ({"tick": "abc"}, {"tick": "1e999"}):
            r = mon.get("api/snapshot", params=params)
            assert r.status_code == 400 and "tick" in r.json()["error"], (params, r.status_code, r.text)
        assert mon.post("api/view", json={"client": cid, "select": "r1"}).status_code == 200
        assert mon.post("api/view", json={"client": "nobody"}).status_code == 404
        assert mon.get("api/snapshot", params={"select": "r1"}).status_code == 200
        page.close()


# ---------------------------------------------------------------------------------------------- item 13 (c)

def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _status_of(sock: socket.socket, buf: bytearray) -> int | None:
    """The HTTP status of the response on ``sock`` once its status line is in (None: not yet)."""
    try:
        chunk = sock.recv(4096)
    except BlockingIOError:
        return None
    if not chunk:
        return -1
    buf += chunk
    m = re.match(rb"HTTP/1\.1 (\d{3}) ", bytes(buf))
    return int(m.group(1)) if m else None


def test_2000_idle_event_streams_are_bounded_and_stats_still_answer():
    """2,000 event-stream connections opened at once from one process, never read: the monitor serves its
    ``--max-pages`` (default 64) and answers the rest 503 with a reason; /api/stats answers within 2 s all along,
    the open streams idle cost little CPU, and closing them frees their places."""
    with run_dir() as address:
        broker = start_broker(address)
        socks: list = []
        try:
            with monitor(address) as mon:  # live: the broker's stats change the page every second
                auth = f"Authorization: Bearer {mon.token}\r\n" if mon.token else ""
                request = (f"GET /api/events HTTP/1.1\r\nHost: 127.0.0.1:{mon.port}\r\n{auth}"
                           f"Accept: text/event-stream\r\n\r\n").encode()
                for _ in range(2000):
                    s = socket.create_connection((mon.host, mon.port))
                    s.sendall(request)
                    s.setblocking(False)
                    socks.append(s)
                status: dict = {}
                bufs = {s: bytearray() for s in socks}
                sel = selectors.DefaultSelector()  # (select() stops at descriptor 1023)
                for s in socks:
                    sel.register(s, selectors.EVENT_READ)
                deadline = time.monotonic() + 60
                while len(status) < len(socks) and time.monotonic() < deadline:
                    for key, _ in sel.select(0.5):
                        code = _status_of(key.fileobj, bufs[key.fileobj])
                        if code is not None:
                            status[key.fileobj] = code
                            sel.unregister(key.fileobj)
                sel.close()
                codes = sorted(status.values())
                served, refused = codes.count(200), codes.count(503)
                assert served == 64 and refused == 2000 - 64, {c: codes.count(c) for c in set(codes)}
                refusal = next(bytes(bufs[s]) for s in socks if status.get(s) == 503)
                assert b"--max-pages" in refusal, refusal[-300:]
                # the monitor still answers, promptly, while its limit is reached
                for _ in range(5):
                    t0 = time.monotonic()
                    r = mon.get("api/stats", timeout=10)
                    assert r.status_code == 200 and time.monotonic() - t0 < 2.0, time.monotonic() - t0
                    assert r.json()["pages"] == 64
                    time.sleep(0.2)
                # 64 idle pages cost no busy work: well under a tenth of a core over 5 s (an update a second each)
                cpu0, t0 = _cpu_s(mon.proc.pid), time.monotonic()
                time.sleep(5)
                share = (_cpu_s(mon.proc.pid) - cpu0) / (time.monotonic() - t0)
                assert share < 0.25, f"the monitor used {share:.0%} of a core with 64 idle pages"
                for s in socks:
                    s.close()
                socks.clear()
                wait_for(lambda: mon.get("api/stats").json()["pages"] == 0, 20)
                page = EventStream(mon)  # the places are free again
                page.next(lambda e, d: e == "hello", 30, "hello")
                page.close()
        finally:
            for s in socks:
                s.close()
            broker.terminate()
            broker.wait(10)


# ---------------------------------------------------------------------------------------------- item 14

def test_a_token_is_required_by_default_on_loopback_too(tmp_path):
    """Bound to 127.0.0.1 with no token given, the monitor makes one up and prints it in the URL: without it
    every route answers 401 (another local user cannot read the requests); with it (query, cookie, bearer) 200.
    The cookie is per port, so two monitors do not log each other out. --help says what the default is."""
    with monitor(str(tmp_path)) as mon:
        assert mon.host == "127.0.0.1" and mon.token is not None and len(mon.token) >= 24, mon.url
        for path in ("", "static/monitor.js", "api/snapshot", "api/ticks", "api/stats", "api/events"):
            assert httpx.get(mon.base + path).status_code == 401, path
            assert httpx.get(mon.base + path, params={"token": "wrong-token"}).status_code == 401, path
        assert httpx.post(mon.base + "api/view", json={"client": "x"}).status_code == 401
        assert mon.get("api/snapshot").status_code == 200
        r = httpx.get(mon.url)  # the printed URL as a browser opens it: the token goes into a cookie
        assert r.status_code == 200
        cookie = next(c for c in r.cookies.jar)
        assert cookie.value == mon.token and str(mon.port) in cookie.name
        assert cookie.has_nonstandard_attr("HttpOnly")
        assert httpx.get(mon.base + "api/snapshot", cookies={cookie.name: cookie.value}).status_code == 200
    out = subprocess.run([PY, "-m", "mia_stream.cli", "monitor", "--help"], capture_output=True, text=True,
                         env=_env(), timeout=60).stdout
    assert "--no-token" in out and re.search(r"default[^.]*token[^.]*loopback|token[^.]*default", out), out


def test_no_token_is_an_explicit_opt_out_allowed_only_on_loopback(tmp_path):
    """``--no-token`` serves loopback Host names without a token and says what it gives up; on any other address
    it is refused at start (exit 2, one line), as is --no-token with --token."""
    with monitor(str(tmp_path), "--no-token") as mon:
        assert mon.token is None and "token" not in mon.url
        assert httpx.get(mon.base + "api/snapshot").status_code == 200
        assert httpx.get(mon.base, headers={"Host": f"evil.example:{mon.port}"}).status_code == 403
    for args, message in ((["--no-token", "--host", "0.0.0.0"], "--no-token is allowed only on loopback"),
                          (["--no-token", "--token", "a-long-token"], "--no-token and --token")):
        r = subprocess.run([PY, "-m", "mia_stream.cli", "monitor", "--source", str(tmp_path), "--port", "0", *args],
                           capture_output=True, text=True, env=_env(), timeout=60)
        assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, (r.returncode, r.stderr)
    r = subprocess.Popen([PY, "-m", "mia_stream.cli", "monitor", "--source", str(tmp_path), "--port", "0",
                          "--no-token"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())
    try:
        ready, _, _ = select.select([r.stderr], [], [], 60)
        line = r.stderr.readline() if ready else ""
        assert "--no-token" in line and "any local user" in line, line
    finally:
        r.terminate()
        r.wait(15)
