"""Seq order and gap accounting of one stream (request, producer, epoch).

Each stream is delivered in seq order. A message ahead of the next expected seq waits in a bounded reorder
window (``reorder_window`` messages, ``reorder_timeout_s``) unless GapNotices already explain the hole; when the
window overflows or times out, the unexplained seqs become a ``GapNotice(origin="consumer", reason="seq_jump")``.
GapNotices from the producer or the broker are delivered once, trimmed to the seqs not yet delivered or
reported, so no seq is ever counted twice.

Rule: a ``_Sequencer`` owns its stream's next expected seq, the seqs announced missing past it (``known``), the
messages held behind a hole and its duplicate count; range arithmetic is ``schemas.seqranges``. It returns what
is ready, in order; turning that into events is the assembler's.
"""

from __future__ import annotations

import time

from mia_stream.schemas import GapBatch, GapNotice, Message
from mia_stream.schemas import seqranges


def _notice(key: tuple, news: list[list[int]], source: GapNotice | GapBatch) -> GapNotice:
    """The GapNotice of a gap event: ``source`` itself when it is one naming exactly ``news``."""
    if type(source) is GapNotice and news == source.missing:
        return source
    return GapNotice(key[0], key[1], key[2], news, source.reason, source.origin, source.time_ns)


class _Sequencer:
    """Seq order and gap accounting of one stream."""

    __slots__ = ("key", "expected", "known", "held", "held_since", "window", "duplicates")

    def __init__(self, key: tuple, window: int):
        self.key = key
        self.expected = 0
        self.known: list[list[int]] = []  # announced missing seqs >= expected
        self.held: dict[int, Message] = {}
        self.held_since = 0.0
        self.window = window
        self.duplicates = 0

    def gap(self, missing: list) -> list[list[int]] | None:
        """Record an announced gap (``missing``: its seq ranges); the ranges that are news (not delivered, not
        already announced), or None."""
        if not self.known and not self.held:  # the common case: what seqranges.lenient and subtract would give
            fast = self._gap_fast(missing)
            if fast is not None:
                if fast:
                    self.known = [list(r) for r in fast]
                    self._skip_known()  # a gap at ``expected``: the next message takes the in-order path
                return fast or None
        new: list[list[int]] = []
        for a, b in seqranges.lenient(missing):
            a = max(a, self.expected)
            if a <= b:
                new.extend(seqranges.subtract(self.known, a, b))
        if self.held:  # a seq that did arrive is not missing, whatever the notice says
            arrived = [[s, s] for s in sorted(self.held)]
            new = [part for a, b in new for part in seqranges.subtract(arrived, a, b)]
        if not new:
            return None
        self.known = seqranges.union(self.known, new)
        return new

    def _gap_fast(self, missing: list) -> list[list[int]] | None:
        """``missing`` past ``expected``, when its ranges are valid, ascending and apart (not touching); None
        otherwise (the general path). At saturation a consumer gets a gap for most requests of most steps: the
        general path's sorting and merging was ~35% of its samples (bench_load.py, py-spy)."""
        if type(missing) is not list:
            return None
        out: list[list[int]] = []
        last = -2
        expected = self.expected
        for r in missing:
            if (type(r) is not list and type(r) is not tuple) or len(r) != 2:
                return None
            a, b = r
            if type(a) is not int or type(b) is not int or not 0 <= a <= b or a <= last + 1:
                return None
            last = b
            if a < expected:
                a = expected
            if a <= b:
                out.append([a, b])
        return out

    def gap_range(self, first: int, last: int) -> int:
        """``gap([[first, last]])`` of a valid range when nothing is held or announced (the caller checked): the
        first seq of it that is news (news up to ``last``), or -1 when none is."""
        expected = self.expected
        if first < expected:
            first = expected
        if first > last:
            return -1
        if first == expected:
            self.expected = last + 1  # explained up to there: the next message takes the in-order path
        else:
            self.known = [[first, last]]
        return first

    def push(self, msg: Message, now: float) -> list:
        """Messages (and synthesized GapNotices) ready in order after ``msg`` arrived."""
        seq = msg.seq
        if seq == self.expected and not self.held and not self.known:  # in order: the common case
            self.expected = seq + 1
            return [msg]
        if seq < self.expected or seq in self.held:
            self.duplicates += 1
            return []
        self.held[seq] = msg
        if len(self.held) == 1:
            self.held_since = now
        return self._release(len(self.held) > self.window, now)

    def flush(self, now: float, timeout: float) -> list:
        if self.held and now - self.held_since >= timeout:
            return self._release(True, now)
        return []

    def _release(self, force: bool, now: float) -> list:
        """Held messages that can go now, in seq order (``force``: all of them, unexplained holes reported);
        ``now`` (the caller's clock) restarts the wait of whatever stays held."""
        out: list = []
        while self.held:
            self._skip_known()
            msg = self.held.pop(self.expected, None)
            if msg is not None:
                out.append(msg)
                self.expected += 1
                continue
            first = min(self.held)
            if not force and seqranges.subtract(self.known, self.expected, first - 1):
                break
            unexplained = seqranges.subtract(self.known, self.expected, first - 1)
            if unexplained:
                rid, pid, epoch = self.key
                out.append(GapNotice(rid, pid, epoch, unexplained, "seq_jump", "consumer", time.time_ns()))
            self.known = [r for r in self.known if r[0] >= first]
            self.expected = first
        self._skip_known()
        self.held_since = now if self.held else 0.0  # the caller's clock (injected in tests), not the real one
        return out

    def _skip_known(self) -> None:
        while self.known and self.known[0][0] <= self.expected:
            self.expected = max(self.expected, self.known[0][1] + 1)
            self.known.pop(0)
