"""The router's counters: a typed record, one int field per counter (the ``totals`` of the broker's stats).

Rule: one ``Counters`` per router, shared by its parts; each part only adds to the fields of its own concern
(noted per group below), and nothing ever lowers a field.

A counter appears in ``as_dict()`` (so in the stats) once it has been added to, even by 0, as the
``collections.Counter`` it replaces did: a field starts as ``_UNSET``, an int 0 that any ``+=`` replaces with a
plain int, so telling "never counted" from "counted 0" costs nothing per increment.
"""

from __future__ import annotations

from dataclasses import dataclass, fields


class _Unset(int):
    """The starting value of every counter: 0, and not yet counted."""

    __slots__ = ()


_UNSET = _Unset(0)


@dataclass(slots=True)
class Counters:
    # input checks and error replies (_routing, _peers)
    malformed: int = _UNSET
    malformed_from_producers: int = _UNSET
    malformed_from_consumers: int = _UNSET
    oversized: int = _UNSET
    oversized_from_producers: int = _UNSET
    oversized_from_consumers: int = _UNSET
    schema_version: int = _UNSET
    schema_version_from_producers: int = _UNSET
    schema_version_from_consumers: int = _UNSET
    malformed_batches: int = _UNSET
    unexpected_kind: int = _UNSET
    error_notices: int = _UNSET
    error_notices_suppressed: int = _UNSET
    internal_errors: int = _UNSET
    batches_in: int = _UNSET
    batched_messages_in: int = _UNSET
    # limits and impersonation (docs/security.md): each refusal also an ErrorNotice to the offender
    refused_stats_too_large: int = _UNSET
    stats_values_replaced: int = _UNSET  # bytes, NaN, non-str keys, too deep: made JSON-safe at intake
    refused_not_stream_owner: int = _UNSET
    refused_too_many_streams: int = _UNSET
    refused_too_many_requests: int = _UNSET
    refused_too_many_patterns: int = _UNSET
    refused_role: int = _UNSET  # a CURVE key sending what its role may not (analysis from a non-analyzer)
    refused_control_claim: int = _UNSET  # a second connection claiming a live engine's control identity
    # rings (_peers)
    shm_bytes_in: int = _UNSET
    held_for_ring_proof: int = _UNSET
    shm_rings_proven: int = _UNSET
    shm_ring_proof_refused: int = _UNSET
    shm_ring_not_owned: int = _UNSET
    shm_rings_handed_over: int = _UNSET
    shm_ring_handover_refused: int = _UNSET
    shm_rings_removed: int = _UNSET
    shm_rings_swept: int = _UNSET  # (_upkeep)
    # streams (_streams, _upkeep)
    after_end: int = _UNSET
    duplicate_starts: int = _UNSET
    gap_for_unknown_stream: int = _UNSET
    producer_gap_batches: int = _UNSET
    producer_gaps_merged: int = _UNSET  # past max_gaps_per_stream: kept as one notice of their ranges
    orphan_messages: int = _UNSET
    producers_lost: int = _UNSET
    # late join (_late_join)
    evicted: int = _UNSET
    # delivery (_delivery)
    selections: int = _UNSET
    view_selections: int = _UNSET  # step batches narrowed to a consumer's layers/positions/tensors (select)
    shm_inlined: int = _UNSET
    compacted: int = _UNSET
    shm_overrun: int = _UNSET
    shm_unavailable: int = _UNSET
    shm_stale_dropped: int = _UNSET
    dropped_for_consumers: int = _UNSET
    gap_batches: int = _UNSET
    producer_gaps_batched: int = _UNSET
    batches_out: int = _UNSET
    batched_messages_out: int = _UNSET
    consumers_lost: int = _UNSET
    consumers_timed_out: int = _UNSET
    discarded_for_gone_consumers: int = _UNSET
    # steering (_steering)
    steering_commands: int = _UNSET
    steering_refused: int = _UNSET
    unmatched_acks: int = _UNSET
    # the socket shell (_broker)
    stats_reply_failed: int = _UNSET

    def as_dict(self) -> dict[str, int]:
        """``{counter: value}`` of every counter added to so far (the stats' ``totals``)."""
        return {name: v for name in _NAMES if (v := getattr(self, name)) is not _UNSET}


_NAMES = tuple(f.name for f in fields(Counters))
