"""A recording's byte budget: past it the recorder stops recording data and names what it left out.

Rule: ``RecordingBudget`` owns whether the budget is spent (``exhausted``) and the seqs of each stream it
dropped since (``pending``: stream key -> inclusive ranges), until the recorder takes them as gap notices
(``take_gaps`` before the stream's next recorded message, ``take_all`` when it closes). Once spent it stays
spent: every later data message of every stream is left out, so a stream's recording ends in one named gap
(reason ``recorder_budget``) rather than holes here and there.
"""

from __future__ import annotations

import time

import numpy as np

from mia_stream.schemas import COLUMNAR_KINDS, GapNotice
from mia_stream.schemas import seqranges

BUDGET_GAP_REASON = "recorder_budget"
# what the budget stops: messages that carry captured data; starts, ends, gaps and steering are still recorded
DATA_KINDS = frozenset(("tensors", "tokens", "step_batch", "token_batch", "analysis"))
_I64 = np.dtype("<i8")


class RecordingBudget:
    """``limit``: the recorded bytes (every message) past which no data message is recorded; starts, ends and
    gaps still are, on top."""

    def __init__(self, limit: int):
        if limit <= 0:
            raise ValueError(f"a recording budget is a byte count > 0, got {limit}")
        self.limit = limit
        self.exhausted = False
        self.dropped_messages = 0
        self.pending: dict[tuple, list[list[int]]] = {}

    def admits(self, kind: str, recorded_bytes: int, nbytes: int) -> bool:
        """Whether a message of ``kind`` and ``nbytes`` may still be recorded after ``recorded_bytes``."""
        if kind not in DATA_KINDS:
            return True
        if not self.exhausted and recorded_bytes + nbytes <= self.limit:
            return True
        self.exhausted = True
        return False

    def drop(self, header: dict) -> None:
        """Note a data message left out: the seq it held of each stream it names."""
        self.dropped_messages += 1
        pid, epoch = str(header.get("producer_id", "")), header.get("epoch", 0)
        if header.get("kind") in COLUMNAR_KINDS:
            named = zip(header["request_ids"], np.frombuffer(header["seqs"], _I64).tolist())
        else:
            named = [(str(header.get("request_id", "")), int(header.get("seq", 0)))]
        for rid, seq in named:
            seqranges.add_seq(self.pending.setdefault((rid, pid, epoch), []), seq)

    def take_gaps(self, request_id: str) -> list[GapNotice]:
        """The gap notices of ``request_id``'s streams' dropped seqs, to record before its next message."""
        if not self.pending:
            return []
        keys = [k for k in self.pending if k[0] == request_id]
        return [self._notice(k, self.pending.pop(k)) for k in keys]

    def take_all(self) -> list[GapNotice]:
        out = [self._notice(k, r) for k, r in self.pending.items()]
        self.pending = {}
        return out

    @staticmethod
    def _notice(key: tuple, ranges: list[list[int]]) -> GapNotice:
        return GapNotice(key[0], key[1], key[2], ranges, BUDGET_GAP_REASON, "consumer",
                         time.time_ns())
