"""Feeding the monitor's state from a source, through the consumer SDK: a live broker or a recording.

The SDK's batch API (``open_batches`` / ``StreamAssembler(batches=True)``) gives tensors, tokens and analysis
results as whole columnar messages (a per-request producer's messages as one-request batches), reduced
vectorized: one norm computation per row group of a step for every request in it, one state call per message.
"start", "gap" and "end" stay per request. Only reductions reach the state: per layer and position the L2 norm of
the residual (``hs``); Q/K are not read.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import numpy as np

from mia_stream.bridge import REORDER_OPTIONS, NatsClient, is_nats_url
from mia_stream.consumers import BatchEvent, BrokerClient, EndEvent, GapEvent, StartEvent, StreamAssembler
from mia_stream.monitor._state import MonitorState

log = logging.getLogger("mia_stream.monitor")

_STATS_PERIOD_S = 1.0


def hs_norms(tensor_like: Any) -> np.ndarray:
    """[L, T, H] hidden states -> [L, T] L2 norms, accumulated in float32 (float64 would double the cost; the
    page shows 4 significant digits)."""
    hs = tensor_like.numpy() if hasattr(tensor_like, "numpy") else np.asarray(tensor_like)
    hs = np.asarray(hs, dtype=np.float32)
    # vecdot: 0.07-0.2 ms for [1, 256, 4096] here, einsum 0.36-0.46 ms (widening bf16 to float32: 0.5-1.1 ms)
    with np.errstate(over="ignore", invalid="ignore"):  # an inf or NaN row is shown as a missing point
        return np.sqrt(_vecdot(hs, hs))


def _einsum_vecdot(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.einsum("...d,...d->...", a, b)


_vecdot = getattr(np, "vecdot", _einsum_vecdot)  # numpy >= 2.0


class Ingest:
    """Reads ``source`` into ``state`` on a thread of its own (``start``/``stop``)."""

    def __init__(self, state: MonitorState, source: Any, *, patterns=("*",), keys: Any = None,
                 from_start: bool = True, consumer_id: str | None = None):
        self.state, self.source, self.patterns, self.keys = state, source, tuple(patterns), keys
        self.from_start = from_start
        self.consumer_id = consumer_id
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.client: BrokerClient | NatsClient | None = None
        self.error: BaseException | None = None

    # ------------------------------------------------------------------------------------------ threads

    def start(self) -> None:
        target = self._run_recording if self.state.recording else self._run_live
        self._threads.append(threading.Thread(target=self._guard, args=(target,), name="monitor-ingest",
                                              daemon=True))
        if not self.state.recording and not is_nats_url(self.source):  # NATS: no broker to ask
            self._threads.append(threading.Thread(target=self._poll_stats, name="monitor-stats", daemon=True))
        for t in self._threads:
            t.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout)

    def _guard(self, target) -> None:
        try:
            target()
        except BaseException as e:  # shown on the page and logged: the server keeps serving what it has
            self.error = e
            log.exception("mia-stream monitor: reading %s failed", self.source)
            self.state.set_source_note(f"reading the source failed: {type(e).__name__}: {e}", loaded=True,
                                       problem=True)

    def _run_live(self) -> None:
        if is_nats_url(self.source):  # streams bridged to NATS JetStream (docs/nats.md)
            client = self.client = NatsClient(self.source, consumer_id=self.consumer_id)
            asm = StreamAssembler(batches=True, **REORDER_OPTIONS)
        else:
            client = self.client = BrokerClient(self.source, consumer_id=self.consumer_id, keys=self.keys)
            asm = StreamAssembler(batches=True)
        try:
            client.subscribe(self.patterns, self.from_start)
            holding, next_check = False, 0.0
            while not self._stop.is_set():
                got = client.recv(0.05 if holding else 0.2)
                now = time.monotonic()
                events = asm.feed(got[1], now) if got is not None else []
                if now >= next_check:  # ``holding`` walks every stream: at most every 50 ms, not per message
                    holding, next_check = asm.holding, now + 0.05
                    if holding:
                        events += asm.flush(now)
                if events:
                    received = time.time_ns()
                    for ev in events:
                        self.handle(ev, received)
        finally:
            self.client = None
            client.close()

    def _run_recording(self) -> None:
        from mia_stream.consumers import open_batches
        from mia_stream.consumers.recording import Recording

        self.state.set_source_note(f"loading {self.source}", loaded=False)
        t0 = time.monotonic()
        n = 0
        with open_batches(self.source, patterns=self.patterns) as events:
            for ev in events:
                if self._stop.is_set():
                    return
                self.handle(ev, None)
                n += 1
        note = f"{n} events loaded in {time.monotonic() - t0:.1f} s"
        cut = Recording(self.source).summary().truncated_parts  # read up to their last complete chunk: said
        if cut:
            note += f"; cut short (its recorder was killed?), read up to the last complete chunk: {', '.join(cut)}"
        self.state.set_source_note(note, loaded=True, problem=bool(cut))

    def _poll_stats(self) -> None:
        from mia_stream.broker import fetch_stats

        while not self._stop.is_set():
            try:
                self.state.set_broker_stats(fetch_stats(self.source, keys=self.keys, timeout=1.0))
            except Exception as e:  # a broker without a stats socket, or not up yet: said on the page
                self.state.set_broker_stats(None, f"broker stats unavailable: {type(e).__name__}: {e}")
            self._stop.wait(_STATS_PERIOD_S)

    # ------------------------------------------------------------------------------------------ events

    # handle's handler of each SDK event class
    _EVENTS = {BatchEvent: lambda self, ev, ns: self._on_batch(ev.batch, ns),
               StartEvent: lambda self, ev, ns: self.state.on_start(ev.stream.start, ns),
               GapEvent: lambda self, ev, ns: self.state.on_gap(ev.gap, ns),
               EndEvent: lambda self, ev, ns: self.state.on_end(ev.end, ns)}

    def handle(self, ev: Any, received_ns: int | None) -> None:
        handler = self._EVENTS.get(type(ev))
        if handler is not None:
            handler(self, ev, received_ns)


    def _on_batch(self, batch: Any, received_ns: int | None) -> None:
        kind, st = batch.KIND, self.state
        if kind == "step_batch":
            ids = batch.request_ids
            for g in batch.groups:
                if g.has("hs"):
                    t = g.tensor("hs")
                    st.on_norm_columns(batch.producer_id, batch.step, batch.time_ns,
                                       [ids[i] for i in g.requests.tolist()], g.offsets.tolist(), g.positions,
                                       tuple(t.layers), hs_norms(t), received_ns)  # every request at once
        elif kind == "token_batch":
            off = batch.offsets.tolist()
            firsts = batch.first_positions.tolist()
            positions = [p for i in range(len(firsts)) for p in range(firsts[i], firsts[i] + off[i + 1] - off[i])]
            st.on_token_columns(batch.producer_id, batch.step, batch.time_ns, batch.request_ids, off,
                                batch.token_ids.tolist(), positions, received_ns)
        elif kind == "analysis":
            st.on_analysis_batch(batch, received_ns)
