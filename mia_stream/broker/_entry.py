"""A message as the router keeps it (``Entry``), and what a message's kind means for keeping and dropping it.

Rule: an entry is made by ``_streams`` (or ``_upkeep``'s producer-lost end, through ``_streams``) when its
message arrives, and its fields are fixed from then on, except its two caches, which ``_delivery`` fills on
first need (``inline``, ``notices``). One entry is shared by every late-join buffer and consumer queue that
holds its message.

A part: one stream's share of a message, as kept in its late-join buffer and replayed from it:
(arrival order, seq, kind, entry, index into a columnar entry's requests or -1, bytes accounted to the stream)
"""

from __future__ import annotations

import operator

import numpy as np

from mia_stream.schemas import seqranges

_STREAM_KINDS = frozenset(("start", "tensors", "tokens", "end"))
# A columnar message's part of one request is kept and dropped as the per-request kind it replaces: tensors are
# evicted and dropped first; tokens (and analysis rows) only beyond a reserve; start, end and gaps never.
_PART_KIND = {"step_batch": "tensors", "token_batch": "tokens", "analysis": "analysis"}
_DROPPABLE = frozenset(("tensors", "tokens", "analysis"))
_EVICT_FIRST = frozenset(("tensors", "analysis"))
_I64 = np.dtype("<i8")
_order_of = operator.itemgetter(0)


class _Entry:
    """One message as received: its frames are shared by the late-join buffers and every consumer's queue."""

    __slots__ = ("kind", "order", "frames", "nbytes", "ring", "key", "seq", "header", "ids", "seqs", "inline",
                 "notices", "prompt_lens")

    def __init__(self, kind: str, order: int, frames: list, nbytes: int, ring: tuple | None):
        self.kind, self.order, self.frames, self.nbytes = kind, order, frames, nbytes
        self.ring = ring  # (ring, oldest position, end) when tensor bytes are in the producer's ring (nbytes counts them)
        self.key: tuple | None = None  # a per-request message: its stream ...
        self.seq = -1  # ... and seq (-1: none, a gap notice)
        self.header: dict | None = None  # a columnar message (or a producer's gap): its header; request ids, seqs
        self.ids: list | None = None
        self.seqs: list | None = None
        self.inline: tuple | None = None  # (frames, nbytes) with ring bytes inline (or (None, reason)), on first need
        self.notices: dict[int, list] | None = None  # a producer's gap batch: request index -> its GapNotice's frames
        self.prompt_lens = None  # a step batch: each request's prompt length (-1 unknown), on a selection's first need

    def requests(self, idx: list[int] | None):
        """(stream key, seq) of each request the message (``idx``: the selection of a columnar one) names."""
        if self.ids is None:
            return [(self.key, self.seq)]
        h = self.header
        pid, epoch, ids, seqs = h["producer_id"], h["epoch"], self.ids, self.seqs
        return [((ids[i], pid, epoch), seqs[i]) for i in (range(len(ids)) if idx is None else idx)]


def _shares(h: dict, nbytes: int, r: int) -> list[int]:
    """Each request's share of a columnar message's bytes (late-join accounting): by its rows where the message
    has rows, else equal."""
    if not r:
        return []
    rows = None
    if h["kind"] == "step_batch":
        rows = np.zeros(r, dtype=_I64)
        for g in h.get("groups", ()):
            rows[np.frombuffer(g["requests"], _I64)] += np.frombuffer(g["rows"], _I64)  # a request once per group
    elif h["kind"] == "analysis" and "rows" in h:
        rows = np.frombuffer(h["rows"], _I64)
    if rows is not None:
        total = int(rows.sum())
        if total:
            return (rows * nbytes // total).tolist()
    return [nbytes // r] * r


def _gap_batch_ranges(h: dict) -> list[list[list[int]]]:
    """Each request's missing ranges in a validated gap batch header, in request order."""
    return seqranges.from_columns(np.frombuffer(h["counts"], _I64).tolist(), np.frombuffer(h["firsts"], _I64).tolist(),
                                  np.frombuffer(h["lasts"], _I64).tolist())
