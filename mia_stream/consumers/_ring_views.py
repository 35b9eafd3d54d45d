"""Zero-copy ring views in consumer events (issue 29; docs/wire-format.md 9.4).

A live consumer on the broker's host reads producers' shared-memory rings in place: a message's tensors are
read-only views of the ring (``BrokerClient(zero_copy=True)``, the default), and the message carries a
``RingLease``. The producer's ring never waits for readers, so a view may be overwritten later. The source
checks each event's leases twice: when it hands the event out (overwritten while the assembler held it: the
event is replaced by "gap" events, reason ``shm_overrun``, as a copy that came too late would be) and when the
consumer releases it, i.e. asks for the next event or its callback returns (overwritten while in use: a "gap"
event of reason ``shm_overrun_in_use`` names the seq of each request the event carried; whatever the consumer
derived from it may be torn). What a consumer keeps past the release must be copied first: ``event.keep()``.

Rule: no state of its own; the source owns the counters it bumps.
"""

from __future__ import annotations

import time
from typing import Any

from mia_stream.bus.shm_ring import RingLease, ring_lease
from mia_stream.consumers._events import BatchEvent, Event, FrameEvent, GapEvent
from mia_stream.schemas import GapNotice

OVERRUN_BEFORE_HANDOUT = "shm_overrun"
OVERRUN_IN_USE = "shm_overrun_in_use"


def _sources(ev: Event) -> tuple:
    """The decoded messages whose ring views ``ev``'s tensors may be."""
    t = type(ev)
    if t is BatchEvent:
        return (ev.batch,)
    if t is FrameEvent:
        d = ev.frame.__dict__
        seg = d.get("_segment")
        if seg is not None:
            return (seg.batch,)
        return tuple(d.get("rank_frames", ()))
    return ()


def leases_of(ev: Event) -> list[RingLease]:
    """The ring leases ``ev``'s tensors depend on (empty: it owns its bytes)."""
    out = []
    for src in _sources(ev):
        lease = ring_lease(src)
        if lease is not None:
            out.append(lease)
    return out


def intact(leases: list[RingLease]) -> bool:
    for lease in leases:
        if not lease.intact():
            return False
    return True


def overrun_gaps(ev: Event, reason: str, assembler: Any) -> list[GapEvent]:
    """One "gap" event per request (and TP rank) that ``ev`` carried, naming the seq its share used."""
    now = time.time_ns()
    named: list[tuple] = []  # (request id, producer id, epoch, seq)
    if type(ev) is BatchEvent:
        b = ev.batch
        named = [(rid, b.producer_id, b.epoch, seq) for rid, seq in zip(b.request_ids, b.seqs.tolist())]
    else:
        d = ev.frame.__dict__
        seg = d.get("_segment")
        if seg is not None:
            b = seg.batch
            named = [(b.request_ids[seg.i], b.producer_id, b.epoch, int(b.seqs[seg.i]))]
        else:
            named = [(f.request_id, f.producer_id, f.epoch, f.seq) for f in d.get("rank_frames", ())
                     if ring_lease(f) is not None and not ring_lease(f).intact()]
    out = []
    for rid, pid, epoch, seq in named:
        gap = GapNotice(rid, pid, epoch, [[seq, seq]], reason, "consumer", now)
        out.append(GapEvent(assembler.note_gap((rid, pid, epoch), gap), gap))
    return out
