"""The peer session with the broker: typed capabilities, and what a broker's heartbeat means for a peer.

Rule: this module owns what a peer knows of its broker (``BrokerSession``: the broker's instance and its
capabilities) and the vocabulary heartbeats carry in ``Heartbeat.stats`` beyond counters (``Capabilities``).
It does no I/O: the publisher, the consumer client and the recorder's broker source feed it the heartbeats
they receive and act on what it says (re-announce their streams, subscribe again).

On the wire (docs/wire-format.md, heartbeat; docs/bus.md) capabilities stay what they were: keys of the
heartbeat's ``stats`` map, next to a producer's counters. A broker says ``known`` (whether it knows the peer it
answers), ``batch`` (it accepts batches), ``shm`` (it takes ring references, schema 1.3), ``shm_received`` (it
records in each ring how far it has received) and ``gap_batch`` (it takes gap batches, schema 2.1), and names a
ring it took under ``shm_ring_taken``; a producer presents ``shm_ring_proof`` and offers its ring at close under
``shm_ring_closed`` (spec section 9).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mia_stream.schemas import Heartbeat

# Heartbeat stats keys (the wire's names). The shm ones are also importable from ``bus.shm_ring``.
KNOWN_KEY = "known"
BATCH_KEY = "batch"
SHM_KEY = "shm"
# A broker's heartbeats carry this key, true, when it keeps each ring's ``received`` field (spec section 9)
SHM_RECEIVED_KEY = "shm_received"
GAP_BATCH_KEY = "gap_batch"
# A closing producer's last heartbeat offers its ring under this key; the broker's reply names the ring under
# the next when it took it, and removes it after its grace (spec section 9)
SHM_RING_CLOSED_KEY = "shm_ring_closed"
SHM_RING_TAKEN_KEY = "shm_ring_taken"
# A producer's heartbeats carry this key: {"ring": name, "secret": hex}, the secret whose SHA-256 is the ring's
# ``owner`` field; the broker accepts that ring's references only from the peer that presented it (spec section 9)
SHM_RING_PROOF_KEY = "shm_ring_proof"


@dataclass(frozen=True)
class Capabilities:
    """What a heartbeat says besides counters. ``None``: the heartbeat does not carry the key (a broker's
    carries its five flags, a producer's none of them). ``to_stats`` writes the keys in the order peers always
    wrote them, so heartbeat bytes are unchanged; ``from_stats`` reads them as every peer read them."""

    known: bool | None = None
    batch: bool | None = None
    shm: bool | None = None
    shm_received: bool | None = None
    gap_batch: bool | None = None
    ring_taken: str | None = None  # broker: the ring it took over from a closing producer
    ring_proof: Any = None  # producer: {"ring": name, "secret": hex}, checked by the broker
    ring_closed: Any = None  # producer: the ring it offers at close, checked by the broker

    @classmethod
    def of_broker(cls, known: bool, batch: bool, shm: bool, gap_batch: bool = True,
                  ring_taken: str | None = None) -> "Capabilities":
        """A broker's heartbeat: it keeps a ring's ``received`` field exactly when it takes rings."""
        return cls(known, batch, shm, shm, gap_batch, ring_taken)

    def to_stats(self) -> dict:
        out: dict[str, Any] = {}
        for key, value in ((KNOWN_KEY, self.known), (BATCH_KEY, self.batch), (SHM_KEY, self.shm),
                           (SHM_RECEIVED_KEY, self.shm_received), (GAP_BATCH_KEY, self.gap_batch),
                           (SHM_RING_TAKEN_KEY, self.ring_taken), (SHM_RING_PROOF_KEY, self.ring_proof),
                           (SHM_RING_CLOSED_KEY, self.ring_closed)):
            if value is not None:
                out[key] = value
        return out

    @classmethod
    def from_stats(cls, stats: Any) -> "Capabilities":
        """Lenient, as the peers always were: a flag is on only when it is ``true``; ``known`` is what its value
        says as a bool; a ring name that is not a str is no name; a producer's proof and offer are kept as sent
        (the broker checks them)."""
        if not isinstance(stats, dict):
            return cls()

        def flag(key: str) -> bool | None:
            return None if key not in stats else stats[key] is True

        taken = stats.get(SHM_RING_TAKEN_KEY)
        return cls(known=bool(stats[KNOWN_KEY]) if KNOWN_KEY in stats else None, batch=flag(BATCH_KEY),
                   shm=flag(SHM_KEY), shm_received=flag(SHM_RECEIVED_KEY), gap_batch=flag(GAP_BATCH_KEY),
                   ring_taken=taken if type(taken) is str else None, ring_proof=stats.get(SHM_RING_PROOF_KEY),
                   ring_closed=stats.get(SHM_RING_CLOSED_KEY))


@dataclass(frozen=True)
class BrokerNews:
    """What one broker heartbeat means to the peer that received it."""

    first: bool  # the first heartbeat this peer has from any broker
    restarted: bool  # from another broker instance than the last one (a restart)
    reannounce: bool  # the broker may not know this peer's state: announce it again (starts, subscription)


class BrokerSession:
    """What a peer knows of its broker, fed the broker's heartbeats (sans-I/O; not thread-safe: one owner).

    ``announce_on_first``: whether the first heartbeat also asks to re-announce. A producer's does (that broker
    may have missed starts sent before the connection was up), and the recorder's (its first subscription may
    not have gone out); a consumer client's does not (a broker that lacks its subscription says ``known: false``).
    Any later heartbeat from a new instance, or one that says ``known: false``, asks to re-announce.
    """

    def __init__(self, announce_on_first: bool):
        self.announce_on_first = announce_on_first
        self.instance: int | None = None  # the broker instance last heard (None: none yet)
        self.capabilities = Capabilities()

    @property
    def answered(self) -> bool:
        """Whether a broker has answered at all."""
        return self.instance is not None

    def on_heartbeat(self, hb: Heartbeat) -> BrokerNews:
        """Take a (decoded, so validated) broker heartbeat in; what it means for this peer."""
        previous, self.instance = self.instance, hb.instance
        self.capabilities = caps = Capabilities.from_stats(hb.stats)
        first = previous is None
        restarted = not first and previous != hb.instance
        unknown = caps.known is False
        return BrokerNews(first, restarted, restarted or unknown or (first and self.announce_on_first))
