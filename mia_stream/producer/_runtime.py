"""The producer's engine-side runtime, independent of vLLM's classes (the adapter feeds it plain data).

Per engine step: ``begin_step`` turns the batch layout into routing slabs (token row -> aperture row, token
row -> steering slots) and copies them to the device; the forward pass writes the aperture in-graph;
``end_step`` queues an async copy of the used aperture rows into a chunk of the shared host ring and hands a
columnar step descriptor to the forwarder thread, which waits for the copy (with the GIL released) and passes
the descriptor to the drain (``_drain``): a sidecar process by default, so the per-request frame building never
competes with the engine loop for the GIL. The engine thread never waits on the bus: when the ring is full
the step's frames are dropped, counted, and announced as gaps.

Owns the lifetime of everything per engine: the live requests (``_routing._Request``), the device buffers
(``_device``), the host ring, the item queue and its forwarder thread, and the drain (a sidecar, or a
``StepDrain`` in the forwarder thread). Routing state per step is ``_routing``'s; items are ``_items``'.
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import logging
import queue
import threading
import time
from typing import Any

import numpy as np
import torch

from mia_stream.producer._config import RuntimeConfig, StepBatch
from mia_stream.producer._copy_staging import CopyStaging
from mia_stream.producer._device import DeviceState, _PinnedStaging, _SteeringTable
from mia_stream.producer._drain import DrainConfig, StepDrain
from mia_stream.producer._host_ring import HostRing, full_step_note
from mia_stream.producer._items import DATA_ITEMS, Config, End, Gap, Start, StepItem, Tokens
from mia_stream.producer._quantize import QuantizeState
from mia_stream.producer._routing import _DecodeCache, _KindRouting, _Request, hits, select
from mia_stream.producer._scores import DetectorRouting, DetectScores
from mia_stream.producer._sidecar import DrainSidecar, SidecarError
from mia_stream.schemas import StreamStart
from mia_stream.spec import ModelGeometry, RequestSpec, steer_wire

__all__ = ["DeviceState", "ProducerRuntime", "RuntimeConfig", "StepBatch"]

logger = logging.getLogger("mia_stream.producer")


def _locked(method):
    """Run under the runtime's lock: with an in-process executor the scheduler thread ends requests
    (``finish_request``) while the worker thread may be routing a step."""
    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)
    return wrapper


_SIDECAR_RESTARTS = 3  # replacements of a dead drain sidecar; then the drain runs in the engine process


def _text(error: Exception) -> str:
    return str(error).removeprefix("mia_stream: ")  # the log line says it already


class ProducerRuntime:
    """Owns the device buffers, per-request bookkeeping, the host ring, the forwarder thread and the drain.

    ``publisher=None`` (the plugin): the drain is a sidecar process publishing as ``producer_id`` to the broker
    named by ``MIA_STREAM_BROKER``. ``publisher=<FramePublisher>``: the drain runs in the forwarder thread and
    publishes through that object (tests; embedding without a broker env).
    """

    def __init__(self, *, geo: ModelGeometry, model_name: str, tokenizer: str, dtype: torch.dtype,
                 device: torch.device, max_tokens: int, tp_rank: int, tp_size: int, dp_rank: int,
                 publisher: Any = None, producer_id: str = "", cfg: RuntimeConfig | None = None,
                 control_id: str = ""):
        self.cfg = cfg or RuntimeConfig()
        if self.cfg.aperture_rows is None:
            self.cfg = dataclasses.replace(self.cfg, aperture_rows=max_tokens)
        self.geo, self.model_name, self.tokenizer = geo, model_name, tokenizer
        self.dtype, self.device, self.max_tokens = dtype, device, max_tokens
        self.tp_rank, self.tp_size, self.dp_rank = tp_rank, tp_size, dp_rank
        self.control_id = control_id
        if geo.num_heads % tp_size or (self.cfg.capture_qk and geo.num_kv_heads % tp_size):
            raise ValueError(f"Q/K capture needs heads divisible by TP={tp_size} "
                             f"(heads {geo.num_heads}, kv heads {geo.num_kv_heads}); set MIA_STREAM_CAPTURE_QK=0")
        self.local_heads = geo.num_heads // tp_size
        self.local_kv_heads = geo.num_kv_heads // tp_size if self.cfg.capture_qk else 0
        self.state = DeviceState(geo, self.local_heads * geo.head_dim, max(1, self.local_kv_heads) * geo.head_dim,
                                 max_tokens, self.cfg, dtype, device)
        self.steering = _SteeringTable(self.state, self.cfg.steer_slots) if self.cfg.steering else None
        self._layouts: dict = {}  # (id(ops), slots) -> (ops, (slots_by_layer, steer_rows)): see _steer_layout
        self.probes = (DetectorRouting(self.state, self.cfg.probe_slots, self.cfg.detectors_per_request,
                                       geo.num_layers, max_tokens, device) if self.cfg.detect else None)
        self._det_step: tuple | None = None  # (step, num tokens) of the forward whose rows detectors score
        self.requests: dict[str, _Request] = {}
        self._quantize = QuantizeState()  # capture.quantize: formats live requests want (producer/_quantize.py)
        self._ring = HostRing.create(self.cfg.host_ring_bytes)
        note = full_step_note(self.cfg.host_ring_bytes, max_tokens, geo.num_layers * geo.hidden_size * dtype.itemsize)
        if note and not tp_rank:  # admission sees one request: a prefill of many can still overflow the ring
            logger.info(note)
        self._ring_bytes = torch.from_numpy(self._ring.data)  # the data area as a uint8 tensor
        self.ring_pinned = self._pin_ring() if device.type == "cuda" else False
        self._queue: queue.Queue = queue.Queue()  # bounded by _enqueue (data items) and per request (the rest)
        self._data_put = 0  # step/tokens items queued (engine thread) and taken (forwarder thread)
        self._data_taken = 0
        self._gaps_queued: set = set()  # (engine id, reason) of gap items still in the queue
        self._dirty_rows = 0  # route rows written last step that must be reset to the sentinel
        self._dirty_rows_qk = 0
        self._dirty_steer_rows = 0
        self._dirty_probe_rows = 0
        self._uploaded: dict[str, np.ndarray] = {}  # the route last copied to the device, per route
        self._decode_cache: _DecodeCache | None = None
        self._config_epoch = 0  # bumped by every request/steering change: a cached decode step is then stale
        self._copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._last_copy_done = None
        staging = getattr(self.state, "copy_staging", None)  # MIA_STREAM_COPY_STAGING_MB
        self._copy_staging = CopyStaging(staging, device) if staging is not None else None
        self._step_tokens = None
        self._staging = _PinnedStaging(device) if device.type == "cuda" else None
        self._stats = {"steps": 0, "dropped_frames": 0, "items_lost": 0, "sidecar_restarts": 0, "drain_in_engine": 0}
        self._step_segments: tuple | None = None
        self._hold_last_step = False
        self._lock = threading.RLock()
        drain_cfg = DrainConfig(tp_rank=tp_rank, tp_size=tp_size, num_heads=geo.num_heads,
                                num_kv_heads=geo.num_kv_heads, head_dim=geo.head_dim, local_heads=self.local_heads,
                                local_kv_heads=self.local_kv_heads, wire_dtype=str(dtype).removeprefix("torch."),
                                itemsize=torch.empty((), dtype=dtype).element_size())
        self._drain_cfg, self._producer_id = drain_cfg, producer_id  # for a restart
        self._own_publisher = None  # the drain's publisher when it runs here after the sidecar failed
        self._sidecar: DrainSidecar | None = None
        self._drain: StepDrain | None = None
        if publisher is None:
            self._sidecar = DrainSidecar.start(self._ring, drain_cfg, producer_id)
            self._ring.leave_name_to_drain()
            self._sink = self._sidecar.send
            # at exit, hand the sidecar what the engine queued and go: it publishes the rest on its own, and an
            # engine process that waited for it could outlast vLLM's shutdown grace and be killed
            atexit.register(self.close, 2.0, False)
        else:
            self._drain = StepDrain(drain_cfg, publisher, self._ring)
            self._sink = self._drain.handle
        self._items_sent = 0
        self._forwarder = threading.Thread(target=self._forward_loop, name="mia-stream-forward", daemon=True)
        self._forwarder.start()

    def _pin_ring(self) -> bool:
        """Register the ring with the CUDA driver: device-to-host copies into it then run asynchronously."""
        t = self._ring_bytes
        err = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel(), 0)
        if int(err) != 0 or not t.is_pinned():
            logger.warning("mia_stream: cudaHostRegister of the %d MiB host ring failed (%s); host copies will "
                           "be synchronous", t.numel() >> 20, err)
            return False
        return True

    @property
    def stats(self) -> dict:
        """Engine-side counters plus the drain's (frames and bytes published, items handled)."""
        return {**self._stats, **self._ring.counters(), "ring_in_use": self._ring.in_use(),
                "drain_queued": self._data_put - self._data_taken}

    @property
    def hold_last_step(self) -> bool:
        """Under async scheduling a request may run one step past its stop token: the drain holds each
        stream's newest step until the next one (or the end, which says the final length) to trim it."""
        return self._hold_last_step

    @hold_last_step.setter
    def hold_last_step(self, value: bool) -> None:
        self._hold_last_step = bool(value)
        self._enqueue(Config({"hold_last_step": self._hold_last_step}))

    # ---------------------------------------------------------------- request lifecycle (engine thread)
    @_locked
    def add_request(self, engine_id: str, stream_id: str, spec: RequestSpec, prompt_token_ids: list) -> None:
        self._config_epoch += 1
        if engine_id in self.requests:
            return  # resumed after preemption: keep its stream (positions dedupe by next_pos)
        req = _Request(engine_id, stream_id, spec, len(prompt_token_ids), list(prompt_token_ids))
        req.capture_kinds = tuple(k for k in ((0, spec.hs_layers, spec.hs_positions),
                                               (1, spec.qk_layers if self.cfg.capture_qk else (), spec.qk_positions))
                                  if k[1])
        self.requests[engine_id] = req
        self._quantize.add(spec)
        capture, steer = spec.capture_wire(), spec.steer
        # The frontend refuses what a switched-off feature would need (docs/architecture.md); should such a request
        # reach a worker anyway (a frontend with other settings), it is served without it, and StreamStart and
        # StreamEnd.drops say so.
        if spec.qk_layers and not self.cfg.capture_qk:
            capture.pop("qk", None)
            req.drops["qk_capture_disabled"] = 1
        if steer and self.steering is None:
            req.drops["steering_disabled"] = len(steer)
            steer = ()
        if steer:
            self._set_steering(req, steer, 1)
        if spec.detect:
            if self.probes is not None:
                self.probes.add(req, spec.detect)
            else:
                req.drops["detect_disabled"] = len(spec.detect)
        # producer id and epoch are the publisher's: the drain stamps them
        start = StreamStart(
            request_id=stream_id, producer_id="", epoch=0, engine_request_id=engine_id,
            model=self.model_name, tokenizer=self.tokenizer, tp_rank=self.tp_rank, tp_size=self.tp_size,
            dp_rank=self.dp_rank, num_layers=self.geo.num_layers, hidden_size=self.geo.hidden_size,
            num_heads=self.geo.num_heads, num_kv_heads=self.geo.num_kv_heads, head_dim=self.geo.head_dim,
            dtype=str(self.dtype).removeprefix("torch."), capture=capture,
            steering=steer_wire(steer, compact=True), capture_after_steering=True,
            prompt_token_ids=list(prompt_token_ids), tags=spec.tags, time_ns=time.time_ns(),
            control_id=self.control_id)
        self._enqueue(Start(engine_id, start, {"prompt_len": req.prompt_len, "qk_heads": spec.qk_heads}))

    @_locked
    def finish_request(self, engine_id: str, reason: str, num_tokens: int | None = None) -> None:
        """End a request's stream. ``num_tokens`` (prompt + output, as the scheduler finished it) trims what
        async scheduling computed past the stop token: frames at positions >= num_tokens - 1 and tokens at
        positions >= num_tokens are never published."""
        self._config_epoch += 1
        req = self.requests.pop(engine_id, None)
        if req is None:
            return
        self._quantize.remove(req.spec)
        if self.steering is not None:
            self._release_steering(req)
        if self.probes is not None:
            self.probes.release(req)
        self._enqueue(End(engine_id, reason, num_tokens,
                       {"frames_dropped": req.frames_dropped, "drops": dict(req.drops), "uncaptured": req.uncaptured}))

    @_locked
    def update_steering(self, engine_id: str, ops: tuple, version: int) -> None:
        """Takes effect in the next ``begin_step`` (the scheduler attached it to that step)."""
        self._config_epoch += 1
        req = self.requests.get(engine_id)
        if req is not None:
            req.pending_steer = (ops if isinstance(ops, tuple) else tuple(ops), version)

    def _set_steering(self, req: _Request, ops: tuple, version: int) -> None:
        self._release_steering(req)
        req.steer_ops, req.steer_version = ops if isinstance(ops, tuple) else tuple(ops), version
        slots = self.steering.acquire_all(req.steer_ops)
        if None in slots:  # table full: those ops are dropped for this request and reported at the end
            for op, slot in zip(req.steer_ops, slots):
                if slot is None:
                    req.drops["steer_table_full"] = req.drops.get("steer_table_full", 0) + 1
                    logger.warning("mia_stream: steering table full (%d slots); op at layer %d of %s not applied",
                                   self.cfg.steer_slots, op.layer, req.stream_id)
        req.steer_slots = slots
        req.slots_by_layer, req.steer_rows = self._steer_layout(req.steer_ops, slots)

    def _steer_layout(self, ops: tuple, slots: list) -> tuple:
        """``(slots_by_layer, steer_rows)`` of ops placed in ``slots``: the same for every request whose parsed
        steering list (one ``SteerOps`` per distinct list) sits in the same slots, so made once for all of them
        (per request it was ~40 µs for 32 ops). Shared: read, never changed."""
        key = (id(ops), tuple(slots))
        hit = self._layouts.get(key)
        if hit is not None and hit[0] is ops:
            return hit[1]
        by_layer: dict = {}
        for op, slot in zip(ops, slots):
            if slot is not None:
                by_layer.setdefault(op.layer, []).append((slot, op))
        layout = (by_layer, self._steer_rows(by_layer) if by_layer else None)
        if len(self._layouts) >= 1024:
            self._layouts.pop(next(iter(self._layouts)))
        self._layouts[key] = (ops, layout)  # holds ops: its id is not reused while the entry lives
        return layout

    def _release_steering(self, req: _Request) -> None:
        if req.steer_slots:
            release = self.steering.release
            for op, slot in zip(req.steer_ops, req.steer_slots):
                if slot is not None:
                    release(op, slot)
        req.steer_slots, req.slots_by_layer, req.steer_rows = (), {}, None

    # ---------------------------------------------------------------- per step (engine thread)
    @property
    def idle(self) -> bool:
        """Nothing to route and nothing left routed from the last step: the step can skip the runtime."""
        return not self.requests and not (self._dirty_rows or self._dirty_rows_qk or self._dirty_steer_rows
                                          or self._dirty_probe_rows)

    @_locked
    def begin_step(self, batch: StepBatch) -> None:
        """Rewrite the routing slabs for this step. Cheap when nobody captures or steers."""
        st = self.state
        if self._last_copy_done is not None:
            # The aperture may be overwritten only after last step's D2H copy read it: a GPU-side wait on the
            # compute stream (the host never waits), placed before this step's forward, not before sampling.
            torch.cuda.current_stream(self.device).wait_event(self._last_copy_done)
            self._last_copy_done = None
        if self.steering is not None:
            self.steering.flush()  # the slots this step's new requests placed (add_request)
        n = batch.num_tokens
        self._step_tokens = (batch.device_token_ids, n) if batch.token_ids is None else batch.token_ids[:n]
        if self.probes is not None:
            self._det_step = (batch.step, n) if self.probes.route(batch, self.requests, self._config_epoch) else None
            host = self.probes.host_route
            if host is not None:
                self._write_route(st.probe_route, host if host.size else None, "_dirty_probe_rows", n)
        replayed = self._repeat_decode_step(batch) if self._decode_cache is not None else None
        if replayed is not None:
            self._set_step_segments(batch.step, *replayed)
            return
        self._drop_decode_cache()
        hs, qk = _KindRouting(), _KindRouting()  # kinds 0 and 1 of _Request.capture_kinds
        all_decode, plens, claimed, drops_before = True, [0] * len(batch.req_ids), [], self._stats["dropped_frames"]
        host_steer = None
        fast_rows: list = []  # decode steering: each request's token row and its cached (layers, ops, slots)
        fast_ops: list = []
        qs, computed = batch.query_start.tolist(), batch.num_computed.tolist()  # Python ints: cheap to index
        requests, steering = self.requests, self.steering is not None
        for i, eid in enumerate(batch.req_ids):
            req = requests.get(eid)
            if req is None:
                continue
            if req.pending_steer is not None and steering:
                ops, version = req.pending_steer
                req.pending_steer = None
                self._set_steering(req, ops, version)
            a, b = qs[i], qs[i + 1]
            if b <= a:
                continue
            first = computed[i]
            spec, plen = req.spec, req.prompt_len
            decode = b - a == 1 and req.first_computed is not None
            plens[i] = plen
            all_decode = all_decode and decode and first >= plen
            if decode:  # one token: scalar tests (the numpy path costs ~25 us per request)
                positions = None
            else:
                positions = np.arange(first, first + (b - a))
                if req.first_computed is None:
                    req.first_computed = first
                    if first > 0 and spec.needs_every_prompt_token:
                        req.uncaptured.append([0, first - 1])
            for kind, layers, mode in req.capture_kinds:
                routing = hs if kind == 0 else qk
                next_pos = req.next_pos[kind]
                if decode:
                    if first < next_pos or not hits(mode, first, plen):
                        continue
                    token_rows, picked, last = a, first, first
                else:
                    sel = select(positions, mode, plen, next_pos)
                    if not sel.size:
                        continue
                    token_rows, picked = a + sel, positions[sel]
                    last = int(picked[-1])
                if routing.claim(eid, layers, token_rows, picked, req.steer_version, self.cfg.aperture_rows):
                    req.next_pos[kind] = last + 1
                    claimed.append((req, kind, i))
                else:
                    self._drop_now(req, batch.step, "aperture_full")
            if not req.slots_by_layer:
                continue
            if decode:
                ops = req.steer_rows[0 if first < plen else 1]
                if ops is not None:
                    fast_rows.append(a)
                    fast_ops.append(ops)
                continue
            if host_steer is None:
                host_steer = np.full((self.geo.num_layers, max(n, self._dirty_steer_rows),
                                      self.cfg.max_ops_per_layer), -1, np.int32)
            # all of the request's ops over its rows of this chunk in one assignment per part (prompt rows,
            # generated rows): per (layer, op) it was 32 numpy calls per request steering every layer, 30-90 ms
            # per 8192-token prefill step of such requests (scripts/bench_begin_step.py)
            in_prompt = positions < plen
            for ops, mask in zip(req.steer_rows, (in_prompt, ~in_prompt)):
                if ops is not None and mask.any():
                    layers, ms, slots = ops
                    rows = a + np.nonzero(mask)[0]
                    host_steer[layers[:, None], rows[None, :], ms[:, None]] = slots[:, None]
        if fast_ops:
            if host_steer is None:
                host_steer = np.full((self.geo.num_layers, max(n, self._dirty_steer_rows),
                                      self.cfg.max_ops_per_layer), -1, np.int32)
            layers, ms, slots = (np.concatenate(x) for x in zip(*fast_ops))
            token_rows = np.repeat(np.asarray(fast_rows, np.int64), [len(o[0]) for o in fast_ops])
            host_steer[layers, token_rows, ms] = slots
        self._write_route(st.hs_route, hs.host_route(self.geo.num_layers, max(n, self._dirty_rows), st.sentinel),
                          "_dirty_rows", n)
        if self.cfg.capture_qk:
            self._write_route(st.qk_route, qk.host_route(self.geo.num_layers, max(n, self._dirty_rows_qk),
                                                         st.sentinel), "_dirty_rows_qk", n)
        if self.steering is not None:
            self.steering.flush()  # the slots of steering changes applied above (pending_steer)
            self._write_route(st.steer_slots, host_steer, "_dirty_steer_rows", n)
        self._set_step_segments(batch.step, hs, qk)
        if all_decode and n == len(batch.req_ids) and self._stats["dropped_frames"] == drops_before:
            self._decode_cache = _DecodeCache(list(batch.req_ids), self._config_epoch, np.asarray(plens),
                                              hs.segments(), qk.segments(), claimed)

    def _set_step_segments(self, step: int, hs: _KindRouting, qk: _KindRouting) -> None:
        self._step_segments = (step, hs, qk) if hs.next_row or qk.next_row else None

    def _repeat_decode_step(self, batch: StepBatch) -> tuple[_KindRouting, _KindRouting] | None:
        """Steady decode: the same requests in the same order, one token each, all past their prompts, nothing
        reconfigured since the last step. Then routes and steering slots on the device are still right (nothing
        to upload) and the routing is last step's with positions advanced: no per-request Python. None: the
        full path must run."""
        c, n = self._decode_cache, batch.num_tokens
        if c.epoch != self._config_epoch or n != len(c.req_ids) or batch.req_ids != c.req_ids:
            return None
        if not np.array_equal(batch.query_start, np.arange(n + 1)) or not (batch.num_computed >= c.plens).all():
            return None
        computed = np.asarray(batch.num_computed, np.int64)
        c.last_computed = computed
        return c.step_routing(0, computed), c.step_routing(1, computed)

    def _drop_decode_cache(self) -> None:
        """Leave the steady-decode path: the skipped per-request bookkeeping (next position) catches up."""
        c, self._decode_cache = self._decode_cache, None
        if c is not None and c.last_computed is not None:
            for req, kind, i in c.claimed:
                req.next_pos[kind] = max(req.next_pos[kind], int(c.last_computed[i]) + 1)

    def _steer_rows(self, slots_by_layer: dict) -> tuple:
        """The routed steering ops as ``(layers, op index, slots)`` arrays for a decode step in the prompt and in
        the generated part (None: no op applies there)."""
        entries = [(layer, m, slot, op.positions) for layer, es in slots_by_layer.items()
                   for m, (slot, op) in enumerate(es[: self.cfg.max_ops_per_layer])]

        def arrays(modes):
            picked = [e for e in entries if e[3] in modes]
            if not picked:
                return None
            return (np.asarray([e[0] for e in picked], np.int64), np.asarray([e[1] for e in picked], np.int64),
                    np.asarray([e[2] for e in picked], np.int32))
        return (arrays(("all", "prompt")), arrays(("all", "generated")))

    def reset_routes(self) -> None:
        """Route every token row to the sentinel again (before a dummy/profile forward)."""
        st = self.state
        self._drop_decode_cache()  # the device routes change under it
        self._write_route(st.hs_route, None, "_dirty_rows", 0)
        if self.cfg.capture_qk:
            self._write_route(st.qk_route, None, "_dirty_rows_qk", 0)
        if self.steering is not None:
            self._write_route(st.steer_slots, None, "_dirty_steer_rows", 0)
        if self.probes is not None:
            self._write_route(st.probe_route, None, "_dirty_probe_rows", 0)

    def _write_route(self, route: torch.Tensor, host: np.ndarray | None, dirty_attr: str, n: int) -> None:
        dirty = getattr(self, dirty_attr, 0)
        fill = -1 if route.dim() == 3 else self.state.sentinel
        if host is None:
            if dirty:
                route[:, :dirty].fill_(fill)
                setattr(self, dirty_attr, 0)
            self._uploaded.pop(dirty_attr, None)
            return
        last = self._uploaded.get(dirty_attr)
        if last is not None and last.shape == host.shape and np.array_equal(last, host):
            return  # steady decode: the device already holds exactly this route (only kernels read it)
        self._uploaded[dirty_attr] = host
        width = host.shape[1]
        if self.device.type == "cuda":
            src = self._staging.stage(dirty_attr, host)
        else:
            src = torch.from_numpy(host)
        route[:, :width].copy_(src, non_blocking=True)
        if self.device.type == "cuda":
            self._staging.record(dirty_attr)
        setattr(self, dirty_attr, width)

    def end_step(self) -> None:
        """Queue the copy of this step's used aperture rows into the host ring; never waits for it."""
        if self._det_step is not None:
            self.probes.after_forward(*self._det_step)
            self._det_step = None
        seg = self._step_segments
        self._step_segments = None
        step_tokens, self._step_tokens = self._step_tokens, None
        if seg is None:
            return
        step, hs, qk = seg
        self._stats["steps"] += 1
        st = self.state
        # Only the layers someone captured this step travel to the host (one layer of 32 = 1/32 the bytes).
        hs_seg, qk_seg = hs.segments(), qk.segments()
        hs_layers = tuple(sorted(set().union(*hs_seg.layer_sets)))
        qk_layers = tuple(sorted(set().union(*qk_seg.layer_sets)))
        parts = []  # (name, aperture, rows, layers): all of one step go in one ring chunk
        if hs.next_row and self.tp_rank == 0:  # hidden states are replicated: rank 0 carries them
            parts.append(("hs", st.hs_aperture, hs.next_row, hs_layers))
        if qk.next_row:
            parts.append(("q", st.q_aperture, qk.next_row, qk_layers))
            parts.append(("k", st.k_aperture, qk.next_row, qk_layers))
        device_tokens = isinstance(step_tokens, tuple) and step_tokens[0] is not None and step_tokens[1]
        if device_tokens:
            parts.append(("tok", step_tokens[0], step_tokens[1], None))
        try:
            parts = self._quantize.parts(parts, st)  # quantized on the device: fewer bytes copied, ringed, published
        except torch.OutOfMemoryError as e:  # a second format's outputs are allocated per step, outside vLLM's
            # budget (the first's are in the reserved workspace): the step's capture is lost, counted, not the engine
            if not self._stats.get("quantize_oom"):
                logger.error("mia_stream: no device memory to quantize step %d's captured rows (%s); its frames are "
                             "dropped as 'quantize_out_of_memory' (a lower gpu_memory_utilization leaves room)",
                             step, str(e).split(".")[0])
            self._stats["quantize_oom"] = self._stats.get("quantize_oom", 0) + 1
            self._drop_all(dict.fromkeys(hs_seg.eids + qk_seg.eids), step, "quantize_out_of_memory")
            return
        sizes = [rows * (len(layers) * ap.shape[2] if layers is not None else 1) * ap.element_size()
                 for _, ap, rows, layers in parts]
        aligned = [-(-s // 64) * 64 for s in sizes]
        got = self._ring.alloc(sum(aligned))
        if got is None:
            self._drop_all(dict.fromkeys(hs_seg.eids + qk_seg.eids), step, "host_ring_full")
            return
        offset, mark = got
        host, meta = [], {}
        token_ids = step_tokens if isinstance(step_tokens, np.ndarray) else None
        for (name, ap, rows, layers), size, room in zip(parts, sizes, aligned):
            view = self._ring_bytes[offset:offset + size].view(ap.dtype)
            if layers is None:  # the step's input token ids (V2 keeps them on the device)
                token_ids = ("ring", offset, rows, str(ap.dtype).removeprefix("torch."))
                host.append((view, ap[:rows]))
            else:
                view = view.view(len(layers), rows, ap.shape[2])
                meta[name] = (offset, layers, rows, ap.shape[2] * ap.element_size())
                if len(layers) == ap.shape[0]:  # every layer: one strided copy
                    host.append((view, ap[:, :rows]))
                else:
                    host.extend((view[j], ap[layer, :rows]) for j, layer in enumerate(layers))
            offset += room
        event = None
        staged = self._copy_staging.stage(host) if self._copy_staging is not None else None
        if staged is not None:
            half, host = staged
            self._stats["staged_copies"] = self._stats.get("staged_copies", 0) + 1
        elif self._copy_staging is not None:
            self._stats["unstaged_copies"] = self._stats.get("unstaged_copies", 0) + 1
        if self._copy_stream is not None:
            self._copy_stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._copy_stream):
                for dst, src in host:
                    dst.copy_(src, non_blocking=True)
                event = torch.cuda.Event()
                event.record(self._copy_stream)
            if staged is None:
                self._last_copy_done = event  # the next begin_step orders the next forward after it
            else:  # the next forward overwrites the aperture freely: the host copy reads the staging half
                self._copy_staging.read_by(half, event)
        else:
            for dst, src in host:
                dst.copy_(src)
        # time_ns of the step's frames: when its rows are on the host (here on the CPU; the forwarder
        # restamps it once a device copy has landed)
        item = StepItem(step=step, time_ns=time.time_ns(), mark=mark, parts=meta, hs=hs_seg, qk=qk_seg,
                        token_ids=token_ids)
        self._enqueue(item, event)

    def take_scores(self, upto_step: int | None = None) -> list[DetectScores]:
        """The in-engine detectors' scores of the steps run so far (up to ``upto_step``), for the engine core."""
        return self.probes.take(upto_step) if self.probes is not None else []

    def on_sampled(self, step: int, req_ids: list[str], sampled: list[list[int]]) -> None:
        """One item per step: the drain turns it into one TokenBatch for the streamed requests."""
        if self.tp_rank != 0:
            return
        reqs = self.requests
        eids, toks = [], []
        for eid, t in zip(req_ids, sampled):
            if eid in reqs and len(t):
                eids.append(eid)
                toks.append(t if type(t) is list else [int(x) for x in t])
        if eids:
            self._enqueue(Tokens(step, eids, toks))

    def _drop_all(self, eids, step: int, reason: str) -> None:
        """Each of ``eids`` still streamed loses its frame of ``step`` (counted, and named by a gap)."""
        for eid in eids:
            req = self.requests.get(eid)
            if req is not None:
                self._drop_now(req, step, reason)

    def _drop_now(self, req: _Request, step: int, reason: str) -> None:
        req.frames_dropped += 1
        req.drops[reason] = req.drops.get(reason, 0) + 1
        self._stats["dropped_frames"] += 1
        self._enqueue(Gap(req.engine_id, reason, step))

    def _enqueue(self, item, event=None) -> None:
        """Hand an item to the forwarder; never blocks. Step and token items beyond ``max_queued_messages``
        waiting are dropped: each request in them counts the loss (``drain_queue_full``) and gets a gap notice.
        Starts, ends and gaps always go: at most a few per request (a gap item still waiting covers later
        losses of its request and reason, which StreamEnd counts one by one)."""
        if isinstance(item, DATA_ITEMS):
            if self._data_put - self._data_taken >= self.cfg.max_queued_messages:
                self._drop_item(item)
                return
            self._data_put += 1
        elif type(item) is Gap:
            key = (item.eid, item.reason)
            if key in self._gaps_queued:
                return
            self._gaps_queued.add(key)
        self._queue.put_nowait((item, event))

    def _drop_item(self, item) -> None:
        """A step's frames or tokens that found the drain queue full. Its ring chunk is released with the next
        step the drain handles (release marks only grow)."""
        if type(item) is StepItem:
            step, eids = item.step, dict.fromkeys(item.hs.eids + item.qk.eids)
        else:
            step, eids = item.step, item.eids
        self._drop_all(eids, step, "drain_queue_full")

    # ---------------------------------------------------------------- forwarder thread
    def _forward_loop(self) -> None:
        """Hand items to the drain in engine order, each step once its host copy has landed."""
        while True:
            got = self._queue.get()
            if got is None:
                return
            item, event = got
            if isinstance(item, DATA_ITEMS):
                self._data_taken += 1
            elif type(item) is Gap:
                self._gaps_queued.discard((item.eid, item.reason))
            if event is not None:
                event.synchronize()  # releases the GIL; only this thread waits
                if type(item) is StepItem:
                    # a step ends for its frames when its rows are on the host: the engine thread stamped it
                    # when the forward was enqueued, up to a whole forward before the GPU ran it
                    item.time_ns = time.time_ns()
            try:
                self._sink(item)
                self._items_sent += 1
            except SidecarError as e:
                self._stats["items_lost"] += 1
                self._restart_sidecar(e, item)
            except Exception:
                self._stats["items_lost"] += 1
                logger.exception("mia_stream: forwarding a %s item failed", type(item).__name__)

    def _restart_sidecar(self, error: Exception, item) -> None:
        """A dead sidecar is replaced, at most ``_SIDECAR_RESTARTS`` times in the engine's life (a start that fails
        counts too); then the drain runs in the engine process (slower, it competes for the GIL, but the streams
        are published). Each replacement publishes under a new epoch, so the broker ends the old epoch's streams
        as ``producer_lost`` (their StreamEnd says so); the count and where the drain runs are in the producer's
        heartbeat stats (``mia-stream stats``: ``sidecar_restarts``, ``drain_in_engine``). Items meanwhile are
        counted in ``items_lost``."""
        self._sidecar.close(timeout=1.0)
        while self._drain is None:
            if self._stats["sidecar_restarts"] >= _SIDECAR_RESTARTS:
                self._drain_in_engine(error)
                break
            n = self._stats["sidecar_restarts"] = self._stats["sidecar_restarts"] + 1
            logger.error("mia_stream: %s; starting a new drain sidecar (%d of at most %d; streams in flight end as "
                         "producer_lost)", _text(error), n, _SIDECAR_RESTARTS)
            try:
                self._sidecar = DrainSidecar.start(self._ring, self._drain_cfg, self._producer_id)
            except Exception as e:
                error = e
                continue
            self._sink = self._sidecar.send
            break
        try:
            self._sink(Config({"hold_last_step": self._hold_last_step, "counters": self._drain_counters()}))
            self._sink(item)  # the item that found the old one dead (a stream start, most likely)
            self._stats["items_lost"] -= 1
            self._items_sent += 1
        except Exception:
            logger.exception("mia_stream: the new drain could not take the item the old one lost")

    def _drain_in_engine(self, error: Exception) -> None:
        from mia_stream.bus.publisher import make_publisher

        logger.error("mia_stream: the drain sidecar failed %d times (last: %s); publishing from the engine process "
                     "from now on (slower)", self._stats["sidecar_restarts"] + 1, _text(error))
        self._sidecar = None
        self._stats["drain_in_engine"] = 1
        self._own_publisher = make_publisher(self._producer_id)
        self._drain = StepDrain(self._drain_cfg, self._own_publisher, self._ring)
        self._sink = self._drain.handle

    def _drain_counters(self) -> dict:
        """What the drain's publisher reports in its heartbeat stats about the drain itself."""
        return {"sidecar_restarts": self._stats["sidecar_restarts"],
                "drain_in_engine": self._stats["drain_in_engine"]}

    def wait_drained(self, timeout: float = 10.0) -> bool:
        """Wait until the drain has handled everything queued so far (tests and benchmarks)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._queue.empty() and self._ring.counters()["handled"] >= self._items_sent:
                return True
            time.sleep(0.005)
        return False

    def close(self, timeout: float = 10.0, wait: bool = True) -> None:
        """Forward what is queued, then stop the drain (the sidecar publishes the rest and exits; ``wait``: for
        that too)."""
        if self._forwarder is None:
            return
        self._queue.put(None)
        self._forwarder.join(timeout)
        self._forwarder = None
        if self._drain is not None:
            self._drain.close()  # publish what async scheduling held back
        if self._own_publisher is not None:
            self._own_publisher.close(timeout=timeout if wait else 0.5)
        if self._sidecar is not None:
            self._sidecar.close(timeout, wait)
