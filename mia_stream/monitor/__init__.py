"""``mia-stream monitor``: a local web page to watch a broker's requests live, or to scrub through a recording.

    mia-stream monitor --source /tmp/mia-run --port 8765          # live: http://127.0.0.1:8765/?token=...
    mia-stream monitor --source runs/rec1 --port 8765             # a recording, with a timeline

The page lists live and recent requests (id, tags, state, tokens/s, drops, lag, alerts, top score); for the
chosen one it shows the text as it is generated, tokens coloured by a score from its ``analysis`` stream
(``--score ANALYZER.VALUE``, else the first that looks like a risk), alerts, the hidden-state norm per layer and
the chosen score over positions, and the broker's throughput and drop counters. Everything is reduced on the
server (``_state``): the browser never gets a tensor. Steering is not offered.

Access: bound to 127.0.0.1 by default, and every request must carry a token, on loopback too (the page shows
every request's text, and other users of this machine can reach loopback ports): ``--token``, else a random one
made at start and printed in the page's URL (``?token=``; the page then keeps it in an HttpOnly cookie).
``--no-token`` serves without one (loopback only; any local user can then read the page); any other
``--host`` always requires a token. At most ``--max-pages`` pages (64) are served at once.
"""

from __future__ import annotations

import argparse
import logging
import os
import secrets
import socket
import sys
from typing import Any

from mia_stream import settings
from mia_stream.monitor._ingest import Ingest
from mia_stream.monitor._server import DEFAULT_MAX_PAGES, MonitorServer, is_loopback
from mia_stream.monitor._state import MonitorState

__all__ = ["Ingest", "MonitorServer", "MonitorState", "build", "main"]


def _is_recording(source: Any) -> bool:
    from mia_stream.consumers import _is_recording as sdk_is_recording  # the SDK's own rule, live vs recorded

    return sdk_is_recording(source)


def build(source: Any, *, patterns=("*",), keys: Any = None, token: str | None = None, score: str | None = None,
          tokenizer: str | None = None, keep_ended: int = 256, max_rate: float = 10.0, list_rate: float = 2.0,
          from_start: bool = True, max_pages: int = DEFAULT_MAX_PAGES) -> tuple[MonitorState, Ingest, MonitorServer]:
    """The monitor's three parts for ``source`` (a broker address or a recording path); not started."""
    recording = _is_recording(source)
    state = MonitorState(recording=recording, keep_ended=keep_ended, score_key=score, tokenizer=tokenizer)
    ingest = Ingest(state, source, patterns=patterns, keys=keys, from_start=from_start,
                    consumer_id=f"monitor-{os.getpid()}")
    server = MonitorServer(state, token=token, max_rate=max_rate, list_rate=list_rate,
                           source=str(source or "default broker"), max_pages=max_pages)
    return state, ingest, server


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="mia-stream monitor", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--source", help="broker address (run dir, ipc://, tcp://) or recording path "
                                     "(default $MIA_STREAM_BROKER or the default run dir)")
    ap.add_argument("--port", type=int, default=8765, help="HTTP port (0: any free one; default 8765)")
    ap.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    ap.add_argument("--token", help="require this token (8+ characters) on every request (default: a random "
                                    "one made at start and printed in the URL, on loopback too)")
    ap.add_argument("--no-token", action="store_true",
                    help="serve without a token (loopback --host only): any user of this machine can then read "
                         "every request's text on the page (the default requires the printed token)")
    ap.add_argument("--max-pages", type=int, default=DEFAULT_MAX_PAGES,
                    help=f"pages (event streams) served at once; one more is answered 503 (default "
                         f"{DEFAULT_MAX_PAGES})")
    ap.add_argument("--patterns", nargs="+", default=["*"], help="request-id globs to watch (default *)")
    ap.add_argument("--keys", help="CURVE key dir (tcp brokers)")
    ap.add_argument("--score", help="colour tokens by this analysis value, ANALYZER.VALUE (default: the first "
                                    "that looks like a risk score)")
    ap.add_argument("--tokenizer", help="tokenizer dir or tokenizer.json for every stream (default: the one each "
                                        "stream names; never downloaded)")
    ap.add_argument("--keep", type=int, default=256, help="ended requests kept on the page (live; default 256)")
    ap.add_argument("--max-rate", type=float, default=10.0, help="updates per second per page (default 10)")
    ap.add_argument("--list-rate", type=float, default=2.0, help="request-list updates per second per page "
                                                                 "(default 2)")
    ap.add_argument("--log-level", default="warning")
    ap.add_argument("--terminal", action="store_true", help="a live view in this terminal instead of the web page "
                                                            "(mia_stream.monitor.terminal)")
    from mia_stream.monitor import terminal

    terminal.add_arguments(ap)
    args = ap.parse_args(argv)
    if args.terminal:
        return terminal.run_args(args)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    source = args.source or settings.raw("MIA_STREAM_BROKER")
    if source and "://" not in source and not os.path.exists(source):
        print(f"mia-stream monitor: {source!r} is neither a broker run dir nor a recording (no such path)",
              file=sys.stderr)
        return 2
    token = args.token
    if args.no_token:
        if token is not None:
            print("mia-stream monitor: --no-token and --token contradict each other: give one", file=sys.stderr)
            return 2
        if not is_loopback(args.host):
            print(f"mia-stream monitor: --no-token is allowed only on loopback (--host {args.host} would serve "
                  f"every request's text to anyone who can reach it): drop --no-token", file=sys.stderr)
            return 2
        print("mia-stream monitor: --no-token: any local user of this machine can read every request's text on "
              "this page (the bus itself is for this user only)", file=sys.stderr, flush=True)
    elif token is None:
        token = secrets.token_urlsafe(24)
    if args.max_pages < 1:
        print("mia-stream monitor: --max-pages must be at least 1", file=sys.stderr)
        return 2
    if token is not None and len(token) < 8:
        print("mia-stream monitor: --token must be at least 8 characters", file=sys.stderr)
        return 2
    try:
        sock = _bind(args.host, args.port)
    except OSError as e:
        print(f"mia-stream monitor: cannot listen on {args.host}:{args.port}: {e}", file=sys.stderr)
        return 2
    import uvicorn

    state, ingest, server = build(source, patterns=args.patterns, keys=args.keys, token=token, score=args.score,
                                  tokenizer=args.tokenizer, keep_ended=args.keep, max_rate=args.max_rate,
                                  list_rate=args.list_rate, max_pages=args.max_pages)
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    url = f"http://{shown}:{port}/" + (f"?token={token}" if token else "")
    mode = "recording" if state.recording else "live"
    print(f"mia-stream monitor: {url} ({mode}: {source or 'default broker'})", flush=True)
    ingest.start()
    config = uvicorn.Config(server.app, log_level=args.log_level if args.log_level != "warning" else "warning",
                            access_log=False, lifespan="off", timeout_graceful_shutdown=1)
    try:
        uvicorn.Server(config).run(sockets=[sock])
    except KeyboardInterrupt:
        pass
    finally:
        ingest.stop()
        sock.close()
    return 0
