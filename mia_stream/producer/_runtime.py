"""The producer's engine-side runtime, independent of vLLM's classes (the adapter feeds it plain data).

Per engine step: ``begin_step`` turns the batch layout into routing slabs (token row -> aperture row, token
row -> steering slots) and copies them to the device; the forward pass writes the aperture in-graph;
``end_step`` queues an async copy of the used aperture rows into a bounded pinned host ring and hands the
step to the drain thread, which cuts it into per-request frames and publishes them. The engine thread never
waits on the bus: when the ring is full the step's frames are dropped, counted, and announced as gaps.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch

from mia_stream.producer.spec import ModelGeometry, RequestSpec, SteerOp
from mia_stream.schemas import (GapNotice, Shard, StreamEnd, StreamStart, Tensor, TensorFrame,
                                TokenFrame)

logger = logging.getLogger("mia_stream.producer")

OP_CODES = {"add": 1, "cap": 2, "ablate": 3}


def _locked(method):
    """Run under the runtime's lock: with an in-process executor the scheduler thread ends requests
    (``finish_request``) while the worker thread may be routing a step."""
    import functools

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)
    return wrapper


def _host_bytes(t: torch.Tensor) -> np.ndarray:
    """A drained step buffer as uint8 numpy ``[layers, rows, width * itemsize]``: numpy slicing is ~50x
    cheaper per frame than torch's, and numpy has no bfloat16 (the wire carries raw bits anyway)."""
    return t.view(torch.uint8).numpy() if t.dim() else t.numpy()


def _rows(host: np.ndarray, index: dict, layers: tuple, row0: int, n: int) -> np.ndarray:
    """``[len(layers), n, ...]`` rows of a drained step buffer (``host`` holds the step's captured layers).

    Slice the rows first, then pick layers: indexing layers of the whole buffer would copy every row.
    """
    rows = host[:, row0:row0 + n]
    js = [index[layer] for layer in layers]
    if js == list(range(js[0], js[0] + len(js))):
        return np.ascontiguousarray(rows[js[0]:js[0] + len(js)])
    return np.ascontiguousarray(rows[js])


def _frame_entry(seg: "_Segment", part: int) -> dict:
    """What one TensorFrame of a request's step is built from (part 1: Q/K at other positions than hs)."""
    return {"engine_id": seg.engine_id, "part": part, "positions": seg.positions, "token_ids": seg.token_ids,
            "tensors": [], "steer_version": seg.steer_version}


def _tensor(name: str, raw: np.ndarray, dtype: str, item: int, layers, **kw) -> Tensor:
    shape = raw.shape[:-1] + (raw.shape[-1] // item,)
    return Tensor(name, dtype, tuple(int(x) for x in shape), memoryview(raw).cast("B"), tuple(layers), **kw)


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return int(value) if value else default


@dataclass
class RuntimeConfig:
    """Sizes fixed at engine start (CUDA graphs bake buffer addresses). Env vars override the defaults."""

    aperture_rows: int = field(default_factory=lambda: _env_int("MIA_STREAM_APERTURE_ROWS", 2048))
    host_ring_bytes: int = field(default_factory=lambda: _env_int("MIA_STREAM_HOST_RING_MB", 512) << 20)
    steer_slots: int = field(default_factory=lambda: _env_int("MIA_STREAM_STEER_SLOTS", 512))
    max_ops_per_layer: int = field(default_factory=lambda: _env_int("MIA_STREAM_STEER_OPS_PER_LAYER", 4))
    capture_qk: bool = field(default_factory=lambda: os.environ.get("MIA_STREAM_CAPTURE_QK", "1") != "0")
    steering: bool = field(default_factory=lambda: os.environ.get("MIA_STREAM_STEERING", "1") != "0")
    max_queued_messages: int = 100_000


@dataclass
class StepBatch:
    """One engine step as the runner scheduled it. Rows ``>= num_tokens`` are padding."""

    step: int
    req_ids: list[str]
    query_start: np.ndarray  # [num_reqs + 1] token-row offsets
    num_computed: np.ndarray  # [num_reqs] position of each request's first scheduled token
    num_tokens: int
    token_ids: np.ndarray | None  # [num_tokens] input token ids (host), or None: read from device_token_ids
    device_token_ids: torch.Tensor | None = None  # [>= num_tokens] on the device (V2): copied with the rows


@dataclass
class _Segment:
    """Rows ``[row0, row0 + n)`` of the aperture hold positions ``positions`` of one request this step."""

    engine_id: str
    row0: int
    positions: np.ndarray
    token_ids: np.ndarray | None  # None: resolved at drain time from the step's device token-id copy
    token_rows: np.ndarray | None = None  # the token rows of this step the positions came from
    steer_version: int = 0  # the steering config this step was computed with
    layers: tuple = ()  # the layers this request captures for this kind


@dataclass
class _Request:
    engine_id: str
    stream_id: str
    spec: RequestSpec
    prompt_len: int
    prompt_token_ids: list
    # per captured kind (0 = hidden states, 1 = Q/K): the next position not yet captured, which dedupes the
    # recomputation after a preemption
    next_pos: list = field(default_factory=lambda: [0, 0])
    first_computed: int | None = None
    steer_ops: tuple = ()
    steer_version: int = 0
    pending_steer: tuple | None = None  # (ops, version) taking effect at the next step
    slots_by_layer: dict = field(default_factory=dict)  # layer -> [(slot, positions-mode)]
    steer_rows: tuple | None = None  # cached (layers, op index, slots, applies-in-prompt, applies-generated)
    generated: int = 0
    frames_dropped: int = 0
    drops: dict = field(default_factory=dict)
    uncaptured: list = field(default_factory=list)
    capture_kinds: tuple = ()  # ((0 = hidden states | 1 = Q/K, layers, positions mode), ...) it captures


class _KindRouting:
    """One captured kind's routing for a step (hidden states, or Q/K): aperture rows handed out in request
    order, and the route entries grouped by layer set so each group is one numpy write."""

    def __init__(self):
        self.next_row = 0
        self.groups: dict[tuple, tuple[list, list, list, list]] = {}  # ints (decode) and arrays
        self.segments: list[_Segment] = []

    def claim(self, eid: str, layers: tuple, token_rows: np.ndarray, positions: np.ndarray, tokens: tuple,
              capacity: int) -> bool:
        """Give ``token_rows`` aperture rows at ``layers``; False (nothing taken) when the aperture is full."""
        count = len(token_rows)
        if self.next_row + count > capacity:
            return False
        group = self.groups.setdefault(layers, ([], [], [], []))
        if count == 1:  # decode: plain ints, one numpy write per layer set at the end
            group[0].append(token_rows.item())
            group[1].append(self.next_row)
        else:
            group[2].append(token_rows)
            group[3].append(np.arange(self.next_row, self.next_row + count, dtype=np.int32))
        self.segments.append(_Segment(eid, self.next_row, positions, *tokens, layers=layers))
        self.next_row += count
        return True

    def host_route(self, num_layers: int, width: int, sentinel: int) -> np.ndarray | None:
        if not self.groups:
            return None
        host = np.full((num_layers, width), sentinel, np.int32)
        for layers, (one_tokens, one_rows, token_rows, rows) in self.groups.items():
            tok = np.concatenate([np.asarray(one_tokens, np.int64), *token_rows])
            dst = np.concatenate([np.asarray(one_rows, np.int32), *rows])
            host[np.asarray(layers)[:, None], tok[None, :]] = dst[None, :]
        return host


class _SteeringTable:
    """Device-resident steering slots, shared by every request with identical ops (ref-counted)."""

    def __init__(self, state: "DeviceState", slots: int):
        self.vectors, self.op_codes = state.vectors, state.op_codes
        self.scales, self.thresholds = state.scales, state.thresholds
        self._by_key: dict[str, int] = {}
        self._refs = [0] * slots
        self._free = list(range(slots - 1, -1, -1))

    def acquire(self, op: SteerOp) -> int | None:
        key = op.key()
        slot = self._by_key.get(key)
        if slot is None:
            if not self._free:
                return None
            slot = self._free.pop()
            self._by_key[key] = slot
            self.vectors[slot].copy_(torch.tensor(op.vector, dtype=torch.float32))
            self.op_codes[slot] = OP_CODES[op.op]
            self.scales[slot] = op.scale
            self.thresholds[slot] = op.threshold
        self._refs[slot] += 1
        return slot

    def release(self, op: SteerOp, slot: int) -> None:
        self._refs[slot] -= 1
        if self._refs[slot] == 0:
            self._by_key.pop(op.key(), None)
            self._free.append(slot)


class _HostRing:
    """A bounded FIFO of host buffers (pinned on CUDA) for drained steps; ``alloc`` never blocks."""

    def __init__(self, capacity: int, pinned: bool):
        self.capacity = capacity
        self.pinned = pinned
        self._used = 0
        self._lock = threading.Lock()

    def alloc(self, shape: tuple, dtype: torch.dtype) -> torch.Tensor | None:
        nbytes = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
        with self._lock:
            if self._used + nbytes > self.capacity:
                return None
            self._used += nbytes
        # The caching host allocator makes repeated pinned allocations of similar sizes cheap.
        return torch.empty(shape, dtype=dtype, pin_memory=self.pinned)

    def free(self, t: torch.Tensor) -> None:
        with self._lock:
            self._used -= t.numel() * t.element_size()


def _hits(mode: str, position: int, prompt_len: int) -> bool:
    """Whether a capture positions-mode selects ``position`` (the scalar form of ``ProducerRuntime._select``)."""
    if mode == "all":
        return True
    if mode == "prompt":
        return position < prompt_len
    if mode == "generated":
        return position >= prompt_len
    return position == prompt_len - 1  # last_prompt


class _PinnedStaging:
    """Persistent pinned host buffers for the per-step route uploads, two per route (double-buffered).

    ``pin_memory()`` per step would be a cudaHostAlloc each time; instead a buffer is reused once the copy
    that last read it has finished (its event; normally long done, since it was two uploads ago).
    """

    def __init__(self, device: torch.device):
        self.device = device
        self._bufs: dict[str, list] = {}
        self._turn: dict[str, int] = {}

    def stage(self, key: str, host: np.ndarray) -> torch.Tensor:
        pair = self._bufs.setdefault(key, [[None, None], [None, None]])
        k = self._turn.get(key, 0)
        buf, event = pair[k]
        if event is not None:
            event.synchronize()
        if buf is None or buf.numel() < host.size:
            buf = torch.empty(max(host.size, 1 << 16), dtype=torch.int32, pin_memory=True)
            pair[k][0] = buf
        view = buf[: host.size].view(host.shape)
        view.numpy()[...] = host
        return view

    def record(self, key: str) -> None:
        k = self._turn.get(key, 0)
        event = self._bufs[key][k][1] or torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        self._bufs[key][k][1] = event
        self._turn[key] = 1 - k


class DeviceState(torch.nn.Module):
    """Persistent buffers the in-graph ops read and write (registered so torch.compile sees fixed tensors)."""

    def __init__(self, geo: ModelGeometry, local_q_width: int, local_k_width: int, max_tokens: int,
                 cfg: RuntimeConfig, dtype: torch.dtype, device: torch.device):
        super().__init__()
        rows = cfg.aperture_rows + 1  # + the sentinel row that absorbs unwatched tokens
        self.sentinel = rows - 1
        L = geo.num_layers

        def buf(name, shape, dt, fill=0):
            self.register_buffer(name, torch.full(shape, fill, dtype=dt, device=device), persistent=False)

        buf("hs_aperture", (L, rows, geo.hidden_size), dtype)
        buf("hs_route", (L, max_tokens), torch.int32, self.sentinel)
        if cfg.capture_qk:
            buf("q_aperture", (L, rows, local_q_width), dtype)
            buf("k_aperture", (L, rows, local_k_width), dtype)
            buf("qk_route", (L, max_tokens), torch.int32, self.sentinel)
        if cfg.steering:
            buf("steer_slots", (L, max_tokens, cfg.max_ops_per_layer), torch.int32, -1)
            buf("vectors", (cfg.steer_slots, geo.hidden_size), torch.float32)
            buf("op_codes", (cfg.steer_slots,), torch.int32)
            buf("scales", (cfg.steer_slots,), torch.float32)
            buf("thresholds", (cfg.steer_slots,), torch.float32)


class ProducerRuntime:
    """Owns the device buffers, per-request bookkeeping, the drain thread and the publisher."""

    def __init__(self, *, geo: ModelGeometry, model_name: str, tokenizer: str, dtype: torch.dtype,
                 device: torch.device, max_tokens: int, tp_rank: int, tp_size: int, dp_rank: int,
                 publisher: Any, cfg: RuntimeConfig | None = None, control_id: str = ""):
        self.cfg = cfg or RuntimeConfig()
        self.geo, self.model_name, self.tokenizer = geo, model_name, tokenizer
        self.dtype, self.device, self.max_tokens = dtype, device, max_tokens
        self.tp_rank, self.tp_size, self.dp_rank = tp_rank, tp_size, dp_rank
        # Streams are stamped with the publisher's identity and epoch (a restarted producer = a new epoch).
        self.producer_id, self.epoch, self.control_id = publisher.producer_id, publisher.epoch, control_id
        if geo.num_heads % tp_size or (self.cfg.capture_qk and geo.num_kv_heads % tp_size):
            raise ValueError(f"Q/K capture needs heads divisible by TP={tp_size} "
                             f"(heads {geo.num_heads}, kv heads {geo.num_kv_heads}); set MIA_STREAM_CAPTURE_QK=0")
        self.local_heads = geo.num_heads // tp_size
        self.local_kv_heads = geo.num_kv_heads // tp_size if self.cfg.capture_qk else 0
        self.state = DeviceState(geo, self.local_heads * geo.head_dim, max(1, self.local_kv_heads) * geo.head_dim,
                                 max_tokens, self.cfg, dtype, device)
        self.steering = _SteeringTable(self.state, self.cfg.steer_slots) if self.cfg.steering else None
        self.requests: dict[str, _Request] = {}
        self._publisher = publisher
        self._ring = _HostRing(self.cfg.host_ring_bytes, pinned=device.type == "cuda")
        self._queue: queue.Queue = queue.Queue(maxsize=self.cfg.max_queued_messages)
        self._seq: dict[str, int] = {}
        self._dirty_rows = 0  # route rows written last step that must be reset to the sentinel
        self._dirty_rows_qk = 0
        self._dirty_steer_rows = 0
        self._copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._last_copy_done = None
        self._step_tokens = None
        self._staging = _PinnedStaging(device) if device.type == "cuda" else None
        self.stats = {"steps": 0, "frames": 0, "dropped_frames": 0, "bytes": 0}
        self._step_segments: tuple | None = None
        # Under async scheduling a request may run one step past its stop token: hold each stream's newest
        # step until the next one (or the end, which says the final length) so that step can be trimmed.
        self.hold_last_step = False
        self._held: dict[str, list] = {}
        self._lock = threading.RLock()
        self._drain = threading.Thread(target=self._drain_loop, name="mia-stream-drain", daemon=True)
        self._drain.start()

    # ---------------------------------------------------------------- request lifecycle (engine thread)
    @_locked
    def add_request(self, engine_id: str, stream_id: str, spec: RequestSpec, prompt_token_ids: list) -> None:
        if engine_id in self.requests:
            return  # resumed after preemption: keep its stream (positions dedupe by next_pos)
        req = _Request(engine_id, stream_id, spec, len(prompt_token_ids), list(prompt_token_ids))
        req.capture_kinds = tuple(k for k in ((0, spec.hs_layers, spec.hs_positions),
                                               (1, spec.qk_layers if self.cfg.capture_qk else (), spec.qk_positions))
                                  if k[1])
        self.requests[engine_id] = req
        if spec.steer:
            self._set_steering(req, spec.steer, 1 if spec.steer else 0)
        start = StreamStart(
            request_id=stream_id, producer_id=self.producer_id, epoch=self.epoch, engine_request_id=engine_id,
            model=self.model_name, tokenizer=self.tokenizer, tp_rank=self.tp_rank, tp_size=self.tp_size,
            dp_rank=self.dp_rank, num_layers=self.geo.num_layers, hidden_size=self.geo.hidden_size,
            num_heads=self.geo.num_heads, num_kv_heads=self.geo.num_kv_heads, head_dim=self.geo.head_dim,
            dtype=str(self.dtype).removeprefix("torch."), capture=spec.capture_wire(),
            steering=[o.to_wire() for o in spec.steer], capture_after_steering=True,
            prompt_token_ids=list(prompt_token_ids), tags=spec.tags, time_ns=time.time_ns(),
            control_id=self.control_id)
        self._enqueue(("msg", engine_id, start, req))

    @_locked
    def finish_request(self, engine_id: str, reason: str, num_tokens: int | None = None) -> None:
        """End a request's stream. ``num_tokens`` (prompt + output, as the scheduler finished it) trims what
        async scheduling computed past the stop token: frames at positions >= num_tokens - 1 and tokens at
        positions >= num_tokens are never published."""
        req = self.requests.pop(engine_id, None)
        if req is None:
            return
        if self.steering is not None:
            self._release_steering(req)
        self._enqueue(("end", engine_id, req, reason, num_tokens))

    @_locked
    def update_steering(self, engine_id: str, ops: tuple, version: int) -> None:
        """Takes effect in the next ``begin_step`` (the scheduler attached it to that step)."""
        req = self.requests.get(engine_id)
        if req is not None:
            req.pending_steer = (tuple(ops), version)

    def _set_steering(self, req: _Request, ops: tuple, version: int) -> None:
        self._release_steering(req)
        req.steer_ops, req.steer_version, req.slots_by_layer, req.steer_rows = tuple(ops), version, {}, None
        for op in ops:
            slot = self.steering.acquire(op)
            if slot is None:  # table full: the op is dropped for this request and reported at the end
                req.drops["steer_table_full"] = req.drops.get("steer_table_full", 0) + 1
                logger.warning("mia_stream: steering table full (%d slots); op at layer %d of %s not applied",
                               self.cfg.steer_slots, op.layer, req.stream_id)
                continue
            req.slots_by_layer.setdefault(op.layer, []).append((slot, op))

    def _release_steering(self, req: _Request) -> None:
        for entries in req.slots_by_layer.values():
            for slot, op in entries:
                self.steering.release(op, slot)
        req.slots_by_layer, req.steer_rows = {}, None

    # ---------------------------------------------------------------- per step (engine thread)
    @property
    def idle(self) -> bool:
        """Nothing to route and nothing left routed from the last step: the step can skip the runtime."""
        return not self.requests and not (self._dirty_rows or self._dirty_rows_qk or self._dirty_steer_rows)

    @_locked
    def begin_step(self, batch: StepBatch) -> None:
        """Rewrite the routing slabs for this step. Cheap when nobody captures or steers."""
        st = self.state
        if self._last_copy_done is not None:
            # The aperture may be overwritten only after last step's D2H copy read it: a GPU-side wait on the
            # compute stream (the host never waits), placed before this step's forward, not before sampling.
            torch.cuda.current_stream(self.device).wait_event(self._last_copy_done)
            self._last_copy_done = None
        n = batch.num_tokens
        hs, qk = _KindRouting(), _KindRouting()  # kinds 0 and 1 of _Request.capture_kinds
        host_steer = None
        fast_steer: list = []
        for i, eid in enumerate(batch.req_ids):
            req = self.requests.get(eid)
            if req is None:
                continue
            if req.pending_steer is not None and self.steering is not None:
                ops, version = req.pending_steer
                req.pending_steer = None
                self._set_steering(req, ops, version)
            a, b = int(batch.query_start[i]), int(batch.query_start[i + 1])
            if b <= a:
                continue
            first = int(batch.num_computed[i])
            spec, plen = req.spec, req.prompt_len
            decode = b - a == 1 and req.first_computed is not None
            if decode:  # one token: scalar tests (the numpy path costs ~25 us per request)
                positions, one_row, one_pos = None, np.array((a,)), np.array((first,))
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
                    if first < next_pos or not _hits(mode, first, plen):
                        continue
                    token_rows, picked = one_row, one_pos
                else:
                    sel = self._select(positions, mode, plen, next_pos)
                    if not sel.size:
                        continue
                    token_rows, picked = a + sel, positions[sel]
                if routing.claim(eid, layers, token_rows, picked, self._tokens(batch, token_rows),
                                 self.cfg.aperture_rows):
                    req.next_pos[kind] = int(picked[-1]) + 1
                else:
                    self._drop_now(req, batch.step, "aperture_full")
            if not req.slots_by_layer:
                continue
            if decode:
                layers, ms, slots, in_prompt, in_gen = self._steer_rows(req)
                keep = in_prompt if first < plen else in_gen
                if keep.any():
                    fast_steer.append((layers[keep], np.full(int(keep.sum()), a), ms[keep], slots[keep]))
                continue
            if host_steer is None:
                host_steer = np.full((self.geo.num_layers, max(n, self._dirty_steer_rows),
                                      self.cfg.max_ops_per_layer), -1, np.int32)
            for layer, entries in req.slots_by_layer.items():
                for m, (slot, op) in enumerate(entries[: self.cfg.max_ops_per_layer]):
                    sel = self._select(positions, op.positions, plen, 0)
                    host_steer[layer, a + sel, m] = slot
        if fast_steer:
            if host_steer is None:
                host_steer = np.full((self.geo.num_layers, max(n, self._dirty_steer_rows),
                                      self.cfg.max_ops_per_layer), -1, np.int32)
            layers, token_rows, ms, slots = (np.concatenate(x) for x in zip(*fast_steer))
            host_steer[layers, token_rows, ms] = slots
        self._write_route(st.hs_route, hs.host_route(self.geo.num_layers, max(n, self._dirty_rows), st.sentinel),
                          "_dirty_rows", n)
        if self.cfg.capture_qk:
            self._write_route(st.qk_route, qk.host_route(self.geo.num_layers, max(n, self._dirty_rows_qk),
                                                         st.sentinel), "_dirty_rows_qk", n)
        if self.steering is not None:
            self._write_route(st.steer_slots, host_steer, "_dirty_steer_rows", n)
        hs_segments, qk_segments, hs_next_row, qk_next_row = hs.segments, qk.segments, hs.next_row, qk.next_row
        for seg in hs_segments + qk_segments:  # recorded now: the drain thread runs behind the engine
            seg.steer_version = self.requests[seg.engine_id].steer_version
        self._step_segments = (batch.step, hs_segments, hs_next_row, qk_segments, qk_next_row)
        self._step_tokens = (batch.device_token_ids, n) if batch.token_ids is None else None

    def _steer_rows(self, req: _Request) -> tuple:
        """The request's routed steering ops as arrays (cached until its ops change)."""
        if req.steer_rows is None:
            layers, ms, slots, in_prompt, in_gen = [], [], [], [], []
            for layer, entries in req.slots_by_layer.items():
                for m, (slot, op) in enumerate(entries[: self.cfg.max_ops_per_layer]):
                    layers.append(layer)
                    ms.append(m)
                    slots.append(slot)
                    in_prompt.append(op.positions in ("all", "prompt"))
                    in_gen.append(op.positions in ("all", "generated"))
            req.steer_rows = (np.asarray(layers, np.int64), np.asarray(ms, np.int64), np.asarray(slots, np.int32),
                              np.asarray(in_prompt, bool), np.asarray(in_gen, bool))
        return req.steer_rows

    @staticmethod
    def _tokens(batch: StepBatch, token_rows: np.ndarray) -> tuple:
        if batch.token_ids is None:
            return None, token_rows
        return batch.token_ids[token_rows], None

    def reset_routes(self) -> None:
        """Route every token row to the sentinel again (before a dummy/profile forward)."""
        st = self.state
        self._write_route(st.hs_route, None, "_dirty_rows", 0)
        if self.cfg.capture_qk:
            self._write_route(st.qk_route, None, "_dirty_rows_qk", 0)
        if self.steering is not None:
            self._write_route(st.steer_slots, None, "_dirty_steer_rows", 0)

    @staticmethod
    def _select(positions: np.ndarray, mode: str, prompt_len: int, next_pos: int) -> np.ndarray:
        """Indices into ``positions`` that a positions-mode selects, skipping ones already captured."""
        if mode == "all":
            mask = np.ones(positions.shape, bool)
        elif mode == "prompt":
            mask = positions < prompt_len
        elif mode == "generated":
            mask = positions >= prompt_len
        else:  # last_prompt
            mask = positions == prompt_len - 1
        if next_pos:
            mask &= positions >= next_pos
        return np.nonzero(mask)[0]

    def _write_route(self, route: torch.Tensor, host: np.ndarray | None, dirty_attr: str, n: int) -> None:
        dirty = getattr(self, dirty_attr, 0)
        fill = -1 if route.dim() == 3 else self.state.sentinel
        if host is None:
            if dirty:
                route[:, :dirty].fill_(fill)
                setattr(self, dirty_attr, 0)
            return
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
        """Queue the copy of this step's used aperture rows to host memory; never waits for it."""
        seg = self._step_segments
        self._step_segments = None
        if seg is None:
            return
        step, hs_segments, hs_rows, qk_segments, qk_rows = seg
        step_tokens, self._step_tokens = self._step_tokens, None
        if not hs_segments and not qk_segments:
            return
        self.stats["steps"] += 1
        st = self.state
        parts = []
        # Only the layers someone captured this step travel to the host (one layer of 32 = 1/32 the bytes).
        hs_layers = sorted(set().union(*(sg.layers for sg in hs_segments)))
        qk_layers = sorted(set().union(*(sg.layers for sg in qk_segments)))
        layer_index = {"hs": {l: j for j, l in enumerate(hs_layers)},
                       "q": {l: j for j, l in enumerate(qk_layers)}, "k": {l: j for j, l in enumerate(qk_layers)}}
        if hs_rows:
            parts.append(("hs", st.hs_aperture, hs_rows, hs_layers))
        if qk_rows:
            parts.append(("q", st.q_aperture, qk_rows, qk_layers))
            parts.append(("k", st.k_aperture, qk_rows, qk_layers))
        host: dict[str, torch.Tensor] = {}
        for name, ap, rows, layers in parts:
            buf = self._ring.alloc((len(layers), rows, ap.shape[2]), ap.dtype)
            if buf is None:
                for t in host.values():
                    self._ring.free(t)
                for s in hs_segments + qk_segments:
                    req = self.requests.get(s.engine_id)
                    if req is not None:
                        self._drop_now(req, step, "host_ring_full")
                return
            host[name] = buf
        if step_tokens is not None and step_tokens[0] is not None and step_tokens[1]:
            tok_src, ntok = step_tokens
            buf = self._ring.alloc((ntok,), tok_src.dtype)
            if buf is not None:
                host["tok"] = buf
                parts.append(("tok", tok_src, ntok, None))
        event = None
        if self._copy_stream is not None:
            self._copy_stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._copy_stream):
                self._copy_parts(parts, host, non_blocking=True)
                event = torch.cuda.Event()
                event.record(self._copy_stream)
            self._last_copy_done = event  # the next begin_step orders the next forward after it
        else:
            self._copy_parts(parts, host, non_blocking=False)
        # time_ns of the step's frames = when the step's forward was enqueued (step end on the engine thread)
        self._enqueue(("step", step, hs_segments, qk_segments, host, event, time.time_ns(), layer_index))

    @staticmethod
    def _copy_parts(parts, host, non_blocking: bool) -> None:
        for name, ap, rows, layers in parts:
            if layers is None:  # token ids
                host[name].copy_(ap[:rows], non_blocking=non_blocking)
            elif len(layers) == ap.shape[0]:  # every layer: one strided copy
                host[name].copy_(ap[:, :rows], non_blocking=non_blocking)
            else:
                for j, layer in enumerate(layers):
                    host[name][j].copy_(ap[layer, :rows], non_blocking=non_blocking)

    def on_sampled(self, step: int, req_ids: list[str], sampled: list[list[int]]) -> None:
        if self.tp_rank != 0:
            return
        for eid, toks in zip(req_ids, sampled):
            req = self.requests.get(eid)
            if req is None or not toks:
                continue
            first = req.prompt_len + req.generated
            req.generated += len(toks)
            self._enqueue(("tokens", eid, step, list(map(int, toks)), list(range(first, first + len(toks)))))

    def _drop_now(self, req: _Request, step: int, reason: str) -> None:
        req.frames_dropped += 1
        req.drops[reason] = req.drops.get(reason, 0) + 1
        self.stats["dropped_frames"] += 1
        self._enqueue(("gap", req.engine_id, req.stream_id, reason, step))

    def _enqueue(self, item: tuple) -> None:
        try:
            self._queue.put_nowait(item)
        except queue.Full:
            self.stats["dropped_frames"] += 1
            logger.warning("mia_stream: publish queue full; dropped a %s message", item[0])

    # ---------------------------------------------------------------- drain thread
    def _next_seq(self, stream_id: str) -> int:
        self._seq[stream_id] = self._seq.get(stream_id, 0) + 1
        return self._publisher.next_seq(stream_id)

    def _publish(self, msg) -> None:
        try:
            self._publisher.publish(msg)
        except Exception:  # the bus must never take the engine down
            logger.exception("mia_stream: publish failed")

    def _emit(self, eid: str, msg, step: int) -> None:
        """Publish a stream message now, or (async scheduling) hold it until its step is known to be valid.

        Seqs are stamped at publication, so trimming a held message never leaves a hole in the stream.
        """
        if not self.hold_last_step:
            self._stamp_and_publish(msg)
            return
        held = self._held.setdefault(eid, [])
        if held and held[-1][0] != step:
            for _, m in held:
                self._stamp_and_publish(m)
            held.clear()
        held.append((step, msg))

    def _stamp_and_publish(self, msg) -> None:
        if isinstance(msg, GapNotice):
            s = self._next_seq(msg.request_id)
            msg.missing = [[s, s]]
        else:
            msg.seq = self._next_seq(msg.request_id)
        self._publish(msg)

    def _flush_held(self, eid: str, num_tokens: int | None) -> None:
        for _, m in self._held.pop(eid, []):
            if num_tokens is not None:
                if isinstance(m, TensorFrame) and m.positions and m.positions[0] >= num_tokens - 1:
                    continue  # computed one step past the stop token (async scheduling): never valid
                if isinstance(m, TokenFrame) and m.positions and m.positions[0] >= num_tokens:
                    continue  # a token sampled after the request had already stopped
            self._stamp_and_publish(m)

    def _drain_loop(self) -> None:
        streams: dict[str, _Request] = {}
        while True:
            item = self._queue.get()
            if item is None:
                return
            kind = item[0]
            try:
                if kind == "msg":
                    # The request object travels with its start: by the time this thread gets here the engine
                    # may have finished it already (the drain runs behind), and its frames must still go out.
                    _, eid, msg, req = item
                    streams[eid] = req
                    self._stamp_and_publish(msg)
                elif kind == "step":
                    self._drain_step(streams, *item[1:])
                elif kind == "tokens":
                    _, eid, step, toks, positions = item
                    req = streams.get(eid)
                    if req is not None:
                        self._emit(eid, TokenFrame(request_id=req.stream_id, producer_id=self.producer_id,
                                                   epoch=self.epoch, seq=0, step=step, token_ids=toks,
                                                   positions=positions, time_ns=time.time_ns()), step)
                elif kind == "gap":
                    _, eid, sid, reason, step = item
                    self._emit(eid, GapNotice(request_id=sid, producer_id=self.producer_id, epoch=self.epoch,
                                              missing=[], reason=reason, origin="producer",
                                              time_ns=time.time_ns()), step)
                elif kind == "end":
                    _, eid, req, reason, num_tokens = item
                    self._flush_held(eid, num_tokens)
                    streams.pop(eid, None)
                    sid = req.stream_id
                    generated = req.generated if num_tokens is None else min(req.generated, num_tokens - req.prompt_len)
                    self._publish(StreamEnd(
                        request_id=sid, producer_id=self.producer_id, epoch=self.epoch, seq=self._next_seq(sid),
                        finish_reason=reason, num_prompt_tokens=req.prompt_len,
                        num_generated_tokens=generated, frames_sent=self._seq.get(sid, 0),
                        frames_dropped=req.frames_dropped, drops=dict(req.drops),
                        uncaptured_positions=req.uncaptured, time_ns=time.time_ns()))
                    self._seq.pop(sid, None)
            except Exception:
                logger.exception("mia_stream: drain failed on a %s item", kind)

    def _drain_step(self, streams, step, hs_segments, qk_segments, host, event, step_end_ns=None,
                    layer_index=None) -> None:
        if event is not None:
            event.synchronize()  # only this thread waits; the engine has moved on
        tok = host.get("tok")
        if tok is not None or any(s.token_ids is None for s in hs_segments + qk_segments):
            ids = tok.numpy() if tok is not None else None
            for s in hs_segments + qk_segments:
                if s.token_ids is None:
                    s.token_ids = ids[s.token_rows] if ids is not None else np.full(len(s.positions), -1)
        try:
            per_req: dict[str, dict] = {}
            # Every rank publishes a frame for every captured step (the SDK merges per step over all
            # ranks); hidden states are replicated across TP ranks, so only rank 0 carries them.
            wire = str(self.dtype).removeprefix("torch.")
            item = torch.empty((), dtype=self.dtype).element_size()
            hs = _host_bytes(host["hs"]) if "hs" in host else None
            for s in hs_segments:
                req = streams.get(s.engine_id)
                if req is None:
                    continue
                entry = per_req.setdefault(s.engine_id, _frame_entry(s, part=0))
                if self.tp_rank == 0:
                    rows = _rows(hs, layer_index["hs"], s.layers, s.row0, len(s.positions))
                    entry["tensors"].append(_tensor("hs", rows, wire, item, s.layers))
            qk_host = {n: _host_bytes(host[n]) for n in ("q", "k") if n in host}
            for s in qk_segments:
                req = streams.get(s.engine_id)
                if req is None:
                    continue
                entry = per_req.setdefault(s.engine_id, _frame_entry(s, part=0))
                if not np.array_equal(entry["positions"], s.positions):
                    # hs and q/k cover different positions: q/k go in a frame of their own
                    entry = per_req.setdefault(s.engine_id + "\x00qk", _frame_entry(s, part=1))
                entry["tensors"].extend(self._qk_tensors(req, qk_host, s, layer_index, wire, item))
            for key, entry in per_req.items():
                req = streams.get(entry["engine_id"])
                if req is None:
                    continue
                frame = TensorFrame(request_id=req.stream_id, producer_id=self.producer_id, epoch=self.epoch,
                                    seq=0, step=step,
                                    positions=[int(p) for p in entry["positions"]],
                                    token_ids=[int(t) for t in entry["token_ids"]], tensors=entry["tensors"],
                                    steering_version=entry["steer_version"], time_ns=step_end_ns or time.time_ns(),
                                    part=entry["part"])
                self.stats["frames"] += 1
                self.stats["bytes"] += sum(t.nbytes for t in frame.tensors)
                self._emit(entry["engine_id"], frame, step)
        finally:
            for t in host.values():
                self._ring.free(t)

    def _qk_tensors(self, req: _Request, host: dict, s: _Segment, layer_index: dict, wire: str,
                    item: int) -> list[Tensor]:
        geo, D = self.geo, self.geo.head_dim
        layers = list(s.layers)
        n = len(s.positions)
        out = []
        heads = np.asarray(req.spec.qk_heads)
        group = geo.num_heads // geo.num_kv_heads
        kv_heads = np.unique(heads // group)
        for name, wanted, local in (("q", heads, self.local_heads), ("k", kv_heads, self.local_kv_heads)):
            lo, hi = self.tp_rank * local, (self.tp_rank + 1) * local
            mine = np.nonzero((wanted >= lo) & (wanted < hi))[0]
            rows = _rows(host[name], layer_index[name], s.layers, s.row0, n).reshape(len(layers), n, local, D * item)
            data = rows if mine.size == local else np.ascontiguousarray(rows[:, :, wanted[mine] - lo])
            shard = None
            if self.tp_size > 1:
                start = int(mine[0]) if mine.size else int(np.searchsorted(wanted, lo))
                shard = Shard(self.tp_rank, self.tp_size, 2, start, start + int(mine.size), int(wanted.size))
            out.append(_tensor(name, data, wire, item, layers, shard=shard,
                               meta={"heads": [int(h) for h in wanted[mine]]}))
        return out

    def close(self) -> None:
        self._queue.put(None)
        self._drain.join(timeout=5)
