"""What producers send, made safe to keep and serve as JSON: done once, at intake (``MonitorState``).

A producer's free-form fields (a ``StreamStart``'s tags above all: any msgpack value) may hold what JSON has no
form for, or more than a page should carry: a msgpack ``bin`` value becomes ``"<N bytes>"``; NaN and the
infinities ``"nan"``, ``"inf"``, ``"-inf"``; a key that is not a string a string (bytes decoded as UTF-8 where
they are, else ``"<N bytes>"``); nesting deeper than ``MAX_DEPTH`` ``"<deeper>"``; a string longer than
``MAX_STR`` characters is cut (its length said); a dict or list of more than ``MAX_ITEMS`` entries keeps the
first ones (how many more is said); a value holds at most ``MAX_NODES`` entries in all, and a request's tags
at most ``MAX_TAGS_CHARS`` characters of JSON (``fit``). Each alteration is
counted in the state's counters (``unsafe_bytes``, ``unsafe_floats``, ``unsafe_keys``, ``unsafe_deep``,
``unsafe_large``, ``unsafe_types``), which ``/api/stats`` and the page's overview carry. The work is bounded by
these limits, not by the size of what was sent.

``dumps`` is the server's encoder: strict JSON (no NaN, as ``JSON.parse`` wants), and should anything unsafe get
past intake after all, it is made safe there (``unsafe_at_output``) rather than ending a page's event stream.
"""

from __future__ import annotations

import itertools
import json
import math
from typing import Any

MAX_DEPTH = 6  # nesting levels kept
MAX_ITEMS = 64  # entries of one dict or list
MAX_STR = 1024  # characters of one string
MAX_NODES = 512  # values in one field, all levels together
MAX_TAGS_CHARS = 4096  # a request's tags, as JSON (they go out with its row in the request list)


class _Budget:
    __slots__ = ("left", "cut")

    def __init__(self, nodes: int):
        self.left, self.cut = nodes, False


def _count(counters: Any, key: str) -> None:
    if counters is not None:
        counters[key] += 1


def text(s: Any, counters: Any = None, limit: int = MAX_STR) -> str:
    """A producer's string field, bounded (a non-string made one)."""
    if s is None:
        return ""
    if not isinstance(s, str):
        return str(safe(s, counters))
    if len(s) > limit:
        _count(counters, "unsafe_large")
        return f"{s[:limit]}…(+{len(s) - limit} chars)"
    return s


def _key(k: Any, counters: Any) -> str:
    if isinstance(k, str):
        return text(k, counters)
    _count(counters, "unsafe_keys")
    if isinstance(k, (bytes, bytearray, memoryview)):
        b = bytes(k)
        try:
            return text(b.decode("utf-8"), counters)
        except UnicodeDecodeError:
            return f"<{len(b)} bytes>"
    if isinstance(k, float) and not math.isfinite(k):
        return str(k)
    return text(str(safe(k, counters)), counters)


def safe(value: Any, counters: Any = None, *, depth: int = MAX_DEPTH, nodes: int = MAX_NODES) -> Any:
    """``value`` as plain JSON data (dict with str keys, list, str, finite float, int, bool, None), bounded."""
    budget = _Budget(nodes)
    out = _safe(value, counters, depth, budget)
    if budget.cut:
        _count(counters, "unsafe_large")
    return out


def _safe(v: Any, counters: Any, depth: int, budget: _Budget) -> Any:
    budget.left -= 1
    if v is None or isinstance(v, bool):
        return v
    if isinstance(v, int):
        return int(v)
    if isinstance(v, float):
        if math.isfinite(v):
            return float(v)
        _count(counters, "unsafe_floats")
        return str(v)
    if isinstance(v, str):
        return text(v, counters)
    if isinstance(v, (bytes, bytearray, memoryview)):
        _count(counters, "unsafe_bytes")
        return f"<{len(bytes(v)) if isinstance(v, memoryview) else len(v)} bytes>"
    if isinstance(v, (dict, list, tuple)):
        if depth <= 0:
            _count(counters, "unsafe_deep")
            return "<deeper>"
        n = len(v)
        items = itertools.islice(v.items() if isinstance(v, dict) else v, MAX_ITEMS)
        if isinstance(v, dict):
            out: Any = {}
            for k, x in items:
                if budget.left <= 0:
                    budget.cut = True
                    break
                out[_key(k, counters)] = _safe(x, counters, depth - 1, budget)
            if len(out) < n:
                if n > MAX_ITEMS:
                    _count(counters, "unsafe_large")
                out["…"] = f"<{n - len(out)} more>"
            return out
        out = []
        for x in items:
            if budget.left <= 0:
                budget.cut = True
                break
            out.append(_safe(x, counters, depth - 1, budget))
        if len(out) < n:
            if n > MAX_ITEMS:
                _count(counters, "unsafe_large")
            out.append(f"<{n - len(out)} more>")
        return out
    if hasattr(v, "item") and hasattr(v, "dtype") and getattr(v, "ndim", 1) == 0:  # a numpy scalar
        return _safe(v.item(), counters, depth, budget)
    _count(counters, "unsafe_types")
    return f"<{type(v).__name__}>"


def fit(value: Any, limit: int, counters: Any = None) -> Any:
    """A safe ``value`` whose JSON is at most about ``limit`` characters: a dict keeps its entries in order while
    they fit (how many more is said); anything else too long becomes the start of its JSON text."""
    whole = json.dumps(value, separators=(",", ":"))
    if len(whole) <= limit:
        return value
    _count(counters, "unsafe_large")
    if isinstance(value, dict):
        out, used = {}, 2
        for k, v in value.items():
            size = len(json.dumps({k: v}, separators=(",", ":")))
            if used + size > limit:
                break
            out[k], used = v, used + size
        out["…"] = f"<{len(value) - len(out)} more>"
        return out
    return whole[:limit] + "…"


def dumps(obj: Any, counters: Any = None) -> str:
    """Strict, compact JSON of ``obj``; anything JSON cannot hold is made safe (counted ``unsafe_at_output``)."""
    try:
        return json.dumps(obj, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError, RecursionError):
        _count(counters, "unsafe_at_output")
        return json.dumps(_output_safe(obj, counters), separators=(",", ":"), allow_nan=False)


def _output_safe(v: Any, counters: Any) -> Any:
    """A whole update made safe without the intake limits' cuts on its own (large, trusted) structure: only
    the values JSON cannot hold, and nesting past what the encoder can take."""
    stack_limit = 64

    def walk(x: Any, depth: int) -> Any:
        if isinstance(x, dict):
            if depth > stack_limit:
                return "<deeper>"
            return {(k if isinstance(k, str) else _key(k, counters)): walk(y, depth + 1) for k, y in x.items()}
        if isinstance(x, (list, tuple)):
            if depth > stack_limit:
                return "<deeper>"
            return [walk(y, depth + 1) for y in x]
        if x is None or isinstance(x, (bool, int, str)):
            return x
        if isinstance(x, float):
            return x if math.isfinite(x) else None
        return _safe(x, counters, 0, _Budget(1))

    return walk(v, 0)
