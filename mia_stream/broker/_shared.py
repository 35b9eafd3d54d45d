"""What every part of the router shares: ``Context`` (the time, the clock, the counters, the outbox) and two
small helpers on frames and seq ranges.

Rule: ``Context.now`` is set only by the router's entry points (``_routing.Router``), before an input is
handled; ``outbox`` is appended to by any part and emptied only by ``Router.take_outbox``; ``counters``: see
``_counters``. Everything else in ``Context`` is fixed at construction.
"""

from __future__ import annotations

import logging
from typing import Callable

from mia_stream.broker._config import BrokerConfig
from mia_stream.broker._counters import Counters

log = logging.getLogger("mia_stream.broker")


class Context:
    """``config``; ``instance``: this broker's random id (heartbeats); ``accept_shm``: producers may reference
    rings; ``now``: the time of the input being handled; ``wall_ns``: the clock stamped into headers;
    ``outbox``: ``(PRODUCERS | CONSUMERS, identity, frames, steering command id or None)``, the messages the
    shell sends directly."""

    __slots__ = ("config", "instance", "accept_shm", "now", "wall_ns", "counters", "outbox")

    def __init__(self, config: BrokerConfig, instance: int, accept_shm: bool, now: float,
                 wall_ns: Callable[[], int]):
        self.config, self.instance, self.accept_shm, self.now, self.wall_ns = config, instance, accept_shm, now, wall_ns
        self.counters = Counters()
        self.outbox: list[tuple[str, bytes, list, str | None]] = []

    def safely(self, handler, *args) -> None:
        """Run ``handler``; an exception is counted (``internal_errors``) and logged, never raised: bad input
        must never stop the broker."""
        try:
            handler(*args)
        except Exception:
            self.internal_error()

    def internal_error(self) -> None:
        self.counters.internal_errors += 1
        log.exception("broker: error while handling a message (counted as internal_errors)")


def _frames_nbytes(frames: list) -> int:
    n = 0
    for f in frames:
        n += len(f)
    return n
