"""Prometheus metrics of any mia_stream process: ``mia_stream_*`` names in base units (``_total``, ``_seconds``,
``_bytes``), read at scrape time from the counters each component already keeps, so the hot paths pay nothing.

Opt-in: with ``MIA_STREAM_METRICS_PORT=P`` the first component that registers in a process starts an HTTP
server on the first free port of ``P .. P+63`` (``MIA_STREAM_METRICS_HOST``, loopback by default) and logs it;
``serve(port)`` does so explicitly. Components register a snapshot function with ``watch``; a registration
goes when the object it reads is collected.

Sample names: a snapshot key ``k`` of component ``c`` is ``mia_stream_c_k_total`` (a counter) unless ``k`` is
one of the component's gauges (``mia_stream_c_k``; a ``_s`` suffix becomes ``_seconds``); ``dropped_REASON``
keys are ``mia_stream_c_dropped_by_reason_total{reason="REASON"}``. Nested rows (per consumer of a broker) carry
the row's name as a label.

Rule: this module owns the process's registry, its sources (``_SOURCES``) and its one HTTP server.
"""

from __future__ import annotations

import logging
import re
import threading
import weakref
from typing import Any, Callable, Iterable

from mia_stream import settings

log = logging.getLogger("mia_stream.metrics")

PORT_RANGE = 64
_NAME_OK = re.compile(r"[^a-zA-Z0-9_]")
_LOCK = threading.Lock()
_SOURCES: list[tuple] = []  # (component, weakref or None, snapshot fn, labels, gauges, rows fn)
_STATE: dict[str, Any] = {"port": None, "registry": None}


def _metric_name(component: str, key: str) -> str:
    key = _NAME_OK.sub("_", key)
    if key.endswith("_s"):
        key = key[:-2] + "_seconds"
    return f"mia_stream_{component}_{key}"


def samples(component: str, snapshot: dict, labels: dict | None = None,
            gauges: Iterable[str] = ()) -> list[tuple[str, str, dict, float]]:
    """``(name, "counter"|"gauge", labels, value)`` for each number of ``snapshot`` (nested dicts: rows)."""
    labels = dict(labels or {})
    gauges = frozenset(gauges)
    out = []
    for key, value in snapshot.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if key.startswith("dropped_"):
            out.append((f"mia_stream_{component}_dropped_by_reason", "counter",
                        {**labels, "reason": key[len("dropped_"):]}, float(value)))
        elif key in gauges:
            out.append((_metric_name(component, key), "gauge", labels, float(value)))
        else:
            out.append((_metric_name(component, key), "counter", labels, float(value)))
    return out


def watch(component: str, snapshot: Callable[[], dict] | Callable[[Any], dict], labels: dict | None = None,
          gauges: Iterable[str] = (), owner: Any = None,
          rows: Callable[[Any], Iterable[tuple[str, dict, dict, Iterable[str]]]] | None = None) -> None:
    """Register a component's counters. ``owner``: the object they belong to (held weakly; ``snapshot`` then
    takes it as its argument). ``rows``: more samples per row (``(row component, labels, snapshot, gauges)``).
    Starts the metrics server when ``MIA_STREAM_METRICS_PORT`` is set and none runs yet."""
    ref = weakref.ref(owner) if owner is not None else None
    with _LOCK:
        _SOURCES.append((component, ref, snapshot, dict(labels or {}), frozenset(gauges), rows))
    if _STATE["port"] is None and settings.get_int("MIA_STREAM_METRICS_PORT") is not None:
        serve()


def enabled() -> bool:
    """Whether this process serves metrics (or will, at its first ``watch``): components register only then."""
    return _STATE["port"] is not None or settings.get_int("MIA_STREAM_METRICS_PORT") is not None


def collect_samples() -> list[tuple[str, str, dict, float]]:
    """Every registered source's samples now (sources whose owner is gone are dropped)."""
    out = []
    with _LOCK:
        sources = list(_SOURCES)
    dead = []
    for src in sources:
        component, ref, fn, labels, gauges, rows = src
        owner = None
        if ref is not None:
            owner = ref()
            if owner is None:
                dead.append(src)
                continue
        try:
            snap = fn(owner) if ref is not None else fn()
            out += samples(component, snap, labels, gauges)
            if rows is not None:
                for row_component, row_labels, row_snap, row_gauges in rows(owner):
                    out += samples(row_component, row_snap, {**labels, **row_labels}, row_gauges)
        except Exception as e:  # a snapshot racing its owner's thread: skip this scrape, never fail it
            log.debug("metrics: %s snapshot failed: %s", component, e)
    if dead:
        with _LOCK:
            for src in dead:
                if src in _SOURCES:
                    _SOURCES.remove(src)
    return out


class _Collector:
    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        families: dict[str, Any] = {}
        for name, kind, labels, value in collect_samples():
            keys = tuple(sorted(labels))
            fam_key = (name, kind, keys)
            fam = families.get(fam_key)
            if fam is None:
                cls = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
                fam = families[fam_key] = cls(name, f"mia_stream {name}", labels=list(keys))
            fam.add_metric([str(labels[k]) for k in keys], value)
        # one family per name: a name with two label sets would be refused by the exposition format
        seen = set()
        for (name, _kind, _keys), fam in families.items():
            if name in seen:
                continue
            seen.add(name)
            yield fam


def serve(port: int | None = None, host: str | None = None) -> int | None:
    """Serve /metrics for this process (once); the port bound, or None when none of the range was free."""
    from prometheus_client import CollectorRegistry, start_http_server

    with _LOCK:
        if _STATE["port"] is not None:
            return _STATE["port"]
        if port is None:
            port = settings.get_int("MIA_STREAM_METRICS_PORT")
        if port is None:
            return None
        host = host or settings.get_text("MIA_STREAM_METRICS_HOST") or "127.0.0.1"
        registry = CollectorRegistry()
        registry.register(_Collector())
        for p in range(port, port + PORT_RANGE):
            try:
                start_http_server(p, addr=host, registry=registry)
            except OSError:
                continue
            _STATE.update(port=p, registry=registry)
            log.info("mia_stream metrics on http://%s:%d/metrics", host, p)
            return p
    log.warning("mia_stream metrics: no free port in %d..%d", port, port + PORT_RANGE - 1)
    return None


def bound_port() -> int | None:
    return _STATE["port"]


def parse_exposition(text: str) -> dict[tuple[str, tuple], float]:
    """``{(name, ((label, value), ...)): value}`` of a /metrics page (``mia-stream top``, tests)."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out
