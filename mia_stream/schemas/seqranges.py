"""Inclusive seq ranges: ``[[first, last], ...]``, sorted and disjoint once normalized.

The one implementation behind every loss count: the wire format's ``gap.missing`` and
``end.uncaptured_positions`` (spec: docs/wire-format.md), a publisher's and an analyzer runner's unannounced
drops, the broker's per-consumer gap runs and the consumer SDK's sequencers. Plain lists of two ints, because
that is what msgpack carries and what every caller already holds.
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence

from mia_stream.errors import MalformedFrameError

Ranges = list  # list[list[int]]: [[first, last], ...]


def add_seq(ranges: Ranges, seq: int) -> None:
    """Add ``seq`` in place. Seqs come in increasing order on every path (O(1) then); one that comes out of
    order (a broker evicting tokens after later tensors) re-normalizes the list."""
    if ranges and ranges[-1][1] == seq - 1:
        ranges[-1][1] = seq
        return
    ranges.append([seq, seq])
    if len(ranges) > 1 and ranges[-2][0] > seq:
        ranges[:] = union([], ranges)


def union(ranges: Iterable[Sequence[int]], add: Iterable[Sequence[int]]) -> Ranges:
    """The sorted, disjoint, coalesced union of two range lists (new lists; the inputs are untouched)."""
    merged: Ranges = []
    for a, b in sorted([list(r) for r in ranges] + [list(r) for r in add]):
        if merged and a <= merged[-1][1] + 1:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return merged


def subtract(ranges: Sequence[Sequence[int]], lo: int, hi: int) -> Ranges:
    """The parts of ``[lo, hi]`` that ``ranges`` (sorted, disjoint) does not cover."""
    out, cur = [], lo
    for a, b in ranges:
        if b < cur:
            continue
        if a > hi:
            break
        if a > cur:
            out.append([cur, a - 1])
        cur = max(cur, b + 1)
        if cur > hi:
            break
    if cur <= hi:
        out.append([cur, hi])
    return out


def count(ranges: Iterable[Sequence[int]]) -> int:
    """How many seqs the ranges name (disjoint ranges)."""
    return sum(b - a + 1 for a, b in ranges)


def lenient(missing: Any) -> Ranges:
    """The well-formed ranges of an untrusted value, normalized; anything else in it is ignored (a consumer
    must never fail on a peer's bad gap list: the codec already refused malformed messages)."""
    out = []
    if isinstance(missing, list):
        for r in missing:
            if (isinstance(r, (list, tuple)) and len(r) == 2 and all(isinstance(x, int) for x in r)
                    and 0 <= r[0] <= r[1]):
                out.append([r[0], r[1]])
    return union([], out)


def check(missing: Any, name: str = "gap.missing") -> None:
    """Refuse what is not a list of ``[first, last]`` int ranges with 0 <= first <= last (the wire format)."""
    for r in missing:
        if (type(r) is not list or len(r) != 2 or type(r[0]) is not int or type(r[1]) is not int
                or r[0] < 0 or r[0] > r[1]):
            raise MalformedFrameError(f"{name} must hold [first, last] int ranges with 0 <= first <= last, "
                                      f"got {r!r}")


def from_columns(counts: Sequence[int], firsts: Sequence[int], lasts: Sequence[int]) -> list[Ranges]:
    """Each request's ranges from a GapBatch's columns (``counts[i]`` ranges for request i, in order)."""
    out, k = [], 0
    for n in counts:
        out.append([[firsts[j], lasts[j]] for j in range(k, k + n)])
        k += n
    return out
