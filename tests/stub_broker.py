"""A stand-in for the broker's producers side, for the producer's own tests: a real ROUTER socket on a run dir's
producers endpoint that answers a publisher's heartbeats (advertising batches and, optionally, shared-memory
rings with ``received`` kept, and gap batches, as the broker does) and decodes, with the same validator, everything it is sent.

It lets a test read exactly what a ``FramePublisher`` put on the wire (step batches included) and stop reading
at will (``pause``), independently of the broker's routing.
"""

from __future__ import annotations

import random
import threading
import time

import zmq

from mia_stream.bus import transport
from mia_stream.schemas import Heartbeat, decode, decode_header, encode, shm_extent, split_batch
from mia_stream.bus.shm_ring import ShmRingReader
from mia_stream.bus.shm_ring import SHM_RING_CLOSED_KEY, SHM_RING_TAKEN_KEY, remove_ring


class StubBroker:
    def __init__(self, address: str, shm: bool = False, gap_batch: bool = False):
        self.shm = shm
        self.gap_batch = gap_batch  # it says it takes gap batches (schema 2.1), as the broker does
        self.instance = random.getrandbits(63)
        self.messages: list = []  # decoded, in arrival order (heartbeats left out)
        self.malformed: list = []
        self._reader = ShmRingReader(writable=True)
        self._taken: list[str] = []
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(transport.endpoints_for(address).producers)
        self._reading = threading.Event()
        self._reading.set()
        self._stop = False
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def pause(self) -> None:
        """Stop reading (the producer's messages wait in zmq; ``received`` stops advancing)."""
        self._reading.clear()

    def resume(self) -> None:
        self._reading.set()

    def snapshot(self) -> list:
        with self._lock:
            return list(self.messages)

    def wait_for(self, predicate, timeout: float = 10.0) -> list:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            got = self.snapshot()
            if predicate(got):
                return got
            time.sleep(0.02)
        raise AssertionError(f"stub broker: condition not met within {timeout} s ({len(self.snapshot())} messages)")

    def close(self) -> None:
        self._stop = True
        self._reading.set()
        self._thread.join(5)
        self._sock.close(0)
        self._ctx.term()
        self._reader.close()
        for name in self._taken:
            remove_ring(name)

    def _run(self) -> None:
        sock = self._sock
        while not self._stop:
            if not self._reading.wait(0.05):
                continue
            if not sock.poll(50):
                continue
            frames = sock.recv_multipart()
            identity, body = frames[0], frames[1:]
            for m in split_batch(body) or [body]:
                self._handle(identity, m)

    def _handle(self, identity: bytes, m: list) -> None:
        try:
            header = decode_header(m)
            if header["kind"] == "heartbeat":
                extra = {}
                stats = header.get("stats") or {}
                if SHM_RING_CLOSED_KEY in stats:
                    self._taken.append(stats[SHM_RING_CLOSED_KEY])
                    extra[SHM_RING_TAKEN_KEY] = stats[SHM_RING_CLOSED_KEY]
                hb = Heartbeat("stub-broker", "broker", self.instance, time.time_ns(),
                               {"known": True, "batch": True, "shm": self.shm, "shm_received": self.shm,
                                "gap_batch": self.gap_batch, **extra})
                self._sock.send_multipart([identity, *encode(hb)])
                return
            extent = shm_extent(header)
            if extent is not None:
                self._reader.note_received(extent[0], extent[3])
            msg = decode(m, shm=self._reader)
        except Exception as e:  # recorded: a test asserts there were none
            with self._lock:
                self.malformed.append(repr(e))
            return
        with self._lock:
            self.messages.append(msg)
