"""The broker's tunables (``BrokerConfig``) and their defaults, and the two destinations of a direct message.

Rule: plain values, read by every part of the router, changed by none of them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mia_stream import settings
from mia_stream.bus import transport
from mia_stream.bus.transport import BrokerEndpoints, ServerKeys
from mia_stream.schemas import DEFAULT_MAX_MESSAGE_BYTES

PRODUCERS, CONSUMERS = "producers", "consumers"  # where an ``outbox`` message goes

DEFAULT_CONSUMER_QUEUE_BYTES = 256 << 20  # per consumer, beyond what its credit window has in flight
DEFAULT_LATE_JOIN_BYTES = 64 << 20  # per stream
DEFAULT_LATE_JOIN_TOTAL_BYTES = 1 << 30  # all streams together
DEFAULT_LATE_JOIN_LINGER_S = 10.0  # how long an ended stream stays joinable from its start
# silent this long: its open streams end (an engine can stall for seconds, e.g. compiling)
DEFAULT_PRODUCER_TIMEOUT_S = 30.0
DEFAULT_CONSUMER_TIMEOUT_S = 60.0  # no message from a consumer for this long: it is forgotten
DEFAULT_STEER_TIMEOUT_S = 30.0
DEFAULT_RING_GRACE_S = 10.0  # a ring its closed producer handed over stays this long for consumers still reading it


@dataclass
class BrokerConfig:
    """Tunables of a broker; every bound is in bytes or seconds."""

    endpoints: BrokerEndpoints
    keys: ServerKeys | None = None
    consumer_queue_bytes: int = DEFAULT_CONSUMER_QUEUE_BYTES
    late_join_bytes: int = DEFAULT_LATE_JOIN_BYTES
    late_join_total_bytes: int = DEFAULT_LATE_JOIN_TOTAL_BYTES
    late_join_linger_s: float = DEFAULT_LATE_JOIN_LINGER_S
    producer_timeout_s: float = DEFAULT_PRODUCER_TIMEOUT_S
    consumer_timeout_s: float = DEFAULT_CONSUMER_TIMEOUT_S
    steer_timeout_s: float = DEFAULT_STEER_TIMEOUT_S
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    heartbeat_s: float = transport.HEARTBEAT_S
    steering: bool = True
    batch: bool = True  # accept and send batches (off: behaves as a 1.1 broker, for comparisons and fallback)
    shm: bool = True  # tell producers to put large tensors in shared memory (off: every byte through the broker)
    ring_grace_s: float = DEFAULT_RING_GRACE_S
    # Limits per peer (docs/security.md; defaults from mia_stream.settings, sized for real serving)
    max_stats_bytes: int = field(default_factory=lambda: settings.get_size("MIA_STREAM_BROKER_MAX_STATS_BYTES"))
    max_streams_per_producer: int = field(
        default_factory=lambda: settings.get_int("MIA_STREAM_BROKER_MAX_STREAMS_PER_PRODUCER"))
    max_requests_per_message: int = field(
        default_factory=lambda: settings.get_int("MIA_STREAM_BROKER_MAX_REQUESTS_PER_MESSAGE"))
    max_patterns: int = field(default_factory=lambda: settings.get_int("MIA_STREAM_BROKER_MAX_PATTERNS"))
    max_gaps_per_stream: int = field(
        default_factory=lambda: settings.get_int("MIA_STREAM_BROKER_MAX_GAPS_PER_STREAM"))
    consumer_pipe_messages: int = field(
        default_factory=lambda: settings.get_int("MIA_STREAM_BROKER_CONSUMER_PIPE_MESSAGES"))

    @property
    def token_reserve_bytes(self) -> int:
        return max(1 << 20, self.consumer_queue_bytes // 8)
