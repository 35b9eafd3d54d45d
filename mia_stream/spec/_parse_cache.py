"""The process-wide caches behind steering-op parsing (``spec.parse_steer_ops``): why the 2nd..Nth request with the
same steering costs tens of µs, whatever form its vectors are given in (issue 26).

Owns (one of each per process; each bounded in entries and in bytes, oldest out first, and counted: ``info()``):

- ``OPS``: parsed ops (``SteerOp``) by what identifies them: the model geometry, the vector's content token and
  the op's typed fields;
- ``LISTS``: parsed steering lists (``SteerOps``) by the tuple of their ops' keys: one object per distinct list, so
  what requests derive from a list (its wire forms, its cache salt, its ops' table keys) is computed once;
- ``INLINE``: the content tokens of inline vectors (numpy arrays, float lists) by the caller's object's ``id``.

Rule: an entry is found by content only. A token is ``("raw", dtype, bytes)`` of the vector as given, or a digest
that the vector's first parse in this process checked against its bytes; ``INLINE`` uses the ``id`` only to pick
the entry whose bytes it then compares (a memcmp) with the object's bytes of now: a mutated array or list, or
another object at a reused address, gets the token of its own content, never a stale one. This module holds the
containers; what a key is and what is cached is decided by ``spec``.
"""

from __future__ import annotations

import threading
from typing import Any


class BoundedCache:
    """A dict bounded in entries and in the bytes of what it holds (``put`` is told each entry's size), the oldest
    entry out first. ``hits``/``misses`` are the caller's to count; ``uncached``: lookups that had no key."""

    def __init__(self, max_entries: int, max_bytes: int):
        self.MAX_ENTRIES = max_entries
        self.MAX_BYTES = max_bytes
        self.entries: dict = {}
        self.sizes: dict = {}
        self.bytes = 0
        self.hits = self.misses = self.uncached = 0
        self._lock = threading.Lock()  # writes only: an in-process engine parses in more than one thread

    def get(self, key) -> Any:
        return self.entries.get(key)

    def put(self, key, value, size: int) -> None:
        with self._lock:
            if key in self.entries:  # replaced (INLINE: the object changed); it goes to the back
                del self.entries[key]
                self.bytes -= self.sizes.pop(key)
            while self.entries and (len(self.entries) >= self.MAX_ENTRIES or self.bytes + size > self.MAX_BYTES):
                old = next(iter(self.entries))
                del self.entries[old]
                self.bytes -= self.sizes.pop(old)
            self.entries[key] = value
            self.sizes[key] = size
            self.bytes += size

    def info(self) -> dict:
        return {"hits": self.hits, "misses": self.misses, "uncached": self.uncached, "entries": len(self.entries),
                "bytes": self.bytes}


class InlineTokens(BoundedCache):
    """Content tokens of inline vectors by ``id`` of the caller's object, each checked against the object's bytes
    of now (see the module rule). What it saves: the object's content is compared with one stored copy instead of
    hashed (16-32 KiB per vector of an 8B model), and the token it hands back is the object every cached key holds,
    so the keys compare by identity."""

    def token(self, oid: int, dtype: str, raw: bytes) -> tuple:
        entry = self.entries.get(oid)
        if entry is not None and entry[0] == dtype and entry[1] == raw:
            self.hits += 1
            return entry[2]
        self.misses += 1
        token = ("raw", dtype, raw)
        self.put(oid, (dtype, raw, token), len(raw))
        return token


OPS = BoundedCache(4096, 64 << 20)
LISTS = BoundedCache(1024, 64 << 20)
INLINE = InlineTokens(1024, 32 << 20)


def info() -> dict:
    """Counters and sizes of the three caches (the ops' counts at the top level: ``op_cache_info``)."""
    return {**OPS.info(), "lists": LISTS.info(), "inline": INLINE.info()}
