"""``mia-stream top``: a live terminal table of every mia_stream process's metrics (rates, lag, drops).

    mia-stream top                          # the ports of MIA_STREAM_METRICS_PORT .. +63 on loopback
    mia-stream top --endpoints gpu07:9400 gpu08:9400 --interval 2

It scrapes each /metrics page every ``--interval`` s and shows one row per process part (a publisher, the broker
and each of its consumers, a bridge, a remote consumer): its message and byte rates over the last interval,
its lag (queued messages or bytes) and its drops and losses. ``--once`` prints one table (for pipes, tests).

Rule: ``Top`` owns the last scrape per endpoint (the rates are differences against it).
"""

from __future__ import annotations

import argparse
import sys
import time
import urllib.request
from typing import Any

from mia_stream import settings
from mia_stream.metrics import PORT_RANGE, parse_exposition

# row kind -> (rate counters, lag gauges, loss counters), by sample name without the mia_stream_ prefix
COLUMNS = {
    "publisher": (("publisher_sent_total", "publisher_sent_bytes_total"),
                  ("publisher_queue_messages", "publisher_shm_bytes_ahead_of_broker"),
                  ("publisher_dropped_total",)),
    "broker": (("broker_messages_in_total", "broker_bytes_in_total"), ("broker_late_join_buffer_bytes",), ()),
    "broker_consumer": (("broker_consumer_delivered_total", "broker_consumer_delivered_bytes_total"),
                        ("broker_consumer_queue_messages", "broker_consumer_queue_bytes"),
                        ("broker_consumer_dropped_total",)),
    "broker_producer": (("broker_producer_messages_total", "broker_producer_bytes_total"),
                        ("broker_producer_open_streams",), ()),
    "bridge": (("bridge_published_total", "bridge_published_bytes_total"), ("bridge_pending_publishes",),
               ("bridge_refused_total",)),
    "nats_consumer": (("nats_consumer_messages_total",), ("nats_consumer_lag_messages",),
                      ("nats_consumer_malformed_total",)),
    "consumer": (("consumer_messages_total",), (), ("consumer_malformed_total",)),
}


def scrape(endpoint: str, timeout: float = 1.0) -> dict | None:
    url = endpoint if endpoint.startswith("http") else f"http://{endpoint}/metrics"
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return parse_exposition(r.read().decode())
    except OSError:
        return None


def rows(endpoint: str, now: dict, before: dict | None, dt: float) -> list[list[str]]:
    """One table row per (kind, labels) found on ``endpoint``'s page."""
    out = []
    found: dict[tuple, dict] = {}
    for (name, labels), value in now.items():
        short = name[len("mia_stream_"):] if name.startswith("mia_stream_") else None
        if short is None:
            continue
        for kind in COLUMNS:
            if short.startswith(kind + "_") and not any(short.startswith(k + "_") and len(k) > len(kind)
                                                        for k in COLUMNS):
                key = (kind, tuple((k, v) for k, v in labels if k != "reason"))
                found.setdefault(key, {})[short] = found.get(key, {}).get(short, 0.0) + value
    for (kind, labels), values in sorted(found.items()):
        rates, lags, losses = COLUMNS[kind]
        prev: dict = {}
        if before is not None:
            for (name, lab), v in before.items():
                lab2 = tuple((k, x) for k, x in lab if k != "reason")
                if lab2 == labels and name.startswith("mia_stream_"):
                    prev[name[len("mia_stream_"):]] = prev.get(name[len("mia_stream_"):], 0.0) + v

        def rate(n: str) -> str:
            if n not in values:
                return "-"
            if n not in prev or dt <= 0:
                return f"{values[n]:.0f} total"
            return f"{(values[n] - prev[n]) / dt:,.1f}/s"

        out.append([endpoint, kind, ",".join(f"{k}={v}" for k, v in labels) or "-",
                    *(rate(n) for n in rates), *([""] * (2 - len(rates))),
                    " ".join(f"{values[n]:,.0f}" for n in lags if n in values) or "-",
                    " ".join(f"{values[n]:,.0f}" for n in losses if n in values) or "0"])
    return out


class Top:
    def __init__(self, endpoints: list[str]):
        self.endpoints = endpoints
        self.last: dict[str, tuple[float, dict]] = {}

    def table(self) -> Any:
        from rich.table import Table

        t = Table(title=f"mia_stream top  {time.strftime('%H:%M:%S')}", expand=False)
        for col in ("endpoint", "part", "labels", "messages", "bytes", "lag", "lost"):
            t.add_column(col, justify="right" if col in ("messages", "bytes", "lag", "lost") else "left")
        for ep in self.endpoints:
            page = scrape(ep)
            if page is None:
                continue
            now = time.monotonic()
            before = self.last.get(ep)
            for row in rows(ep, page, before[1] if before else None, now - before[0] if before else 0.0):
                t.add_row(*row)
            self.last[ep] = (now, page)
        return t


def default_endpoints() -> list[str]:
    base = settings.get_int("MIA_STREAM_METRICS_PORT")
    if base is None:
        return []
    host = settings.get_text("MIA_STREAM_METRICS_HOST") or "127.0.0.1"
    return [f"{host}:{p}" for p in range(base, base + PORT_RANGE)]


def main(argv: list[str] | None = None) -> int:
    """``mia-stream top``: a live table of the mia_stream processes' metrics."""
    from rich.console import Console
    from rich.live import Live

    ap = argparse.ArgumentParser(prog="mia-stream top", description=main.__doc__)
    ap.add_argument("--endpoints", nargs="+", help="HOST:PORT of /metrics pages (default: the setting's range)")
    ap.add_argument("--interval", type=float, default=1.0)
    ap.add_argument("--once", action="store_true", help="print two scrapes' table (rates over --interval) and exit")
    args = ap.parse_args(argv)
    endpoints = args.endpoints or default_endpoints()
    if not endpoints:
        print("mia-stream top: give --endpoints or set MIA_STREAM_METRICS_PORT", file=sys.stderr)
        return 2
    top = Top(endpoints)
    console = Console()
    if args.once:
        top.table()
        time.sleep(args.interval)
        console.print(top.table())
        return 0
    try:
        with Live(top.table(), console=console, auto_refresh=False) as live:
            while True:
                time.sleep(args.interval)
                live.update(top.table(), refresh=True)
    except KeyboardInterrupt:
        return 0
