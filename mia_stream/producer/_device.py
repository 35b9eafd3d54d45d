"""Device-resident state of the producer runtime: the persistent buffers the in-graph ops read and write.

Owns: ``DeviceState`` (aperture, routing slabs, steering table and detector probe tensors; fixed at engine start,
since CUDA graphs bake their addresses), ``_SteeringTable`` (which steering slot holds which op, ref-counted across
requests), ``_ProbeTable`` (which probe slot holds which detector probe, likewise) and
``_PinnedStaging`` (pinned host buffers for the per-step route uploads). Op codes are the kernels' own.
"""

from __future__ import annotations

import numpy as np
import torch

from mia_stream.producer._config import RuntimeConfig
from mia_stream.schemas import OP_CODES
from mia_stream.spec import ModelGeometry, SteerOp, SteerOps


class _SteeringTable:
    """Device-resident steering slots, shared by every request with identical ops (ref-counted).

    A new slot's vector, op code, scale and threshold are staged on the host and written to the device by
    ``flush`` (``begin_step``, before the step's routes): one upload per step for all the slots the step's new
    requests placed, not four small ones per op (256 requests with distinct vectors placed 256 slots a step)."""

    def __init__(self, state: "DeviceState", slots: int):
        self.vectors, self.op_codes = state.vectors, state.op_codes
        self.scales, self.thresholds = state.scales, state.thresholds
        self._by_key: dict[str, int] = {}
        self._refs = [0] * slots
        self._free = list(range(slots - 1, -1, -1))
        self._pending: dict[int, SteerOp] = {}  # slot -> the op it now holds, not yet on the device

    def _place(self, op: SteerOp, key: str) -> int | None:
        slot = self._by_key.get(key)
        if slot is None:
            if not self._free:
                return None
            slot = self._free.pop()
            self._by_key[key] = slot
            self._pending[slot] = op
        return slot

    def acquire(self, op: SteerOp) -> int | None:
        slot = self._place(op, op.key())
        if slot is not None:
            self._refs[slot] += 1
        return slot

    def acquire_all(self, ops: tuple) -> list:
        """``acquire`` of each op (None: the table is full), with one dict lookup per op for ops already placed
        (``SteerOps`` carry their keys: no key is computed per request)."""
        keys = ops.table_keys if isinstance(ops, SteerOps) else [o.key() for o in ops]
        slots = list(map(self._by_key.get, keys))
        if None in slots:
            for i, slot in enumerate(slots):
                if slot is None:
                    slots[i] = self._place(ops[i], keys[i])
        refs = self._refs
        for slot in slots:
            if slot is not None:
                refs[slot] += 1
        return slots

    def release(self, op: SteerOp, slot: int) -> None:
        self._refs[slot] -= 1
        if self._refs[slot] == 0:
            self._by_key.pop(op.key(), None)
            self._free.append(slot)

    def flush(self) -> None:
        """Write the slots placed since the last flush to the device (non-blocking: a blocking host-to-device
        copy would wait for the step in flight; those slots are free, so no step in flight reads them)."""
        if not self._pending:
            return
        pending, self._pending = self._pending, {}
        device = self.vectors.device
        idx = torch.tensor(list(pending), dtype=torch.long).to(device, non_blocking=True)
        ops = list(pending.values())
        vectors = torch.from_numpy(np.stack([o.array for o in ops]))
        self.vectors.index_copy_(0, idx, vectors.to(device, non_blocking=True))
        for table, values, dtype in ((self.op_codes, [OP_CODES[o.op] for o in ops], torch.int32),
                                     (self.scales, [o.scale for o in ops], torch.float32),
                                     (self.thresholds, [o.threshold for o in ops], torch.float32)):
            table.index_copy_(0, idx, torch.tensor(values, dtype=dtype).to(device, non_blocking=True))


class _ProbeTable:
    """Device-resident detector probe directions (the folded ``w / scale`` of each probe), shared by every request
    naming the same probe file (keyed by its content digest, ref-counted)."""

    def __init__(self, state: "DeviceState", slots: int):
        self.table = state.probe_table
        self._by_digest: dict[str, int] = {}
        self._refs = [0] * slots
        self._free = list(range(slots - 1, -1, -1))

    def acquire(self, digest: str, direction: np.ndarray) -> int | None:
        slot = self._by_digest.get(digest)
        if slot is None:
            if not self._free:
                return None
            slot = self._free.pop()
            self._by_digest[digest] = slot
            # non-blocking: a blocking host-to-device copy would wait for the step in flight
            self.table[slot].copy_(torch.from_numpy(np.ascontiguousarray(direction, np.float32)), non_blocking=True)
        self._refs[slot] += 1
        return slot

    def release(self, digest: str, slot: int) -> None:
        self._refs[slot] -= 1
        if self._refs[slot] == 0:
            self._by_digest.pop(digest, None)
            self._free.append(slot)


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
        if cfg.quantize:  # capture.quantize's outputs, 1 byte a value (int8 / fp8 views), float32 scale per row
            buf("hs_quantized", (L, rows, geo.hidden_size), torch.uint8)
            buf("hs_quantized_scale", (L, rows, 1), torch.float32)
            if cfg.capture_qk:
                buf("q_quantized", (L, rows, local_q_width), torch.uint8)
                buf("q_quantized_scale", (L, rows, 1), torch.float32)
                buf("k_quantized", (L, rows, local_k_width), torch.uint8)
                buf("k_quantized_scale", (L, rows, 1), torch.float32)
        if cfg.steering:
            buf("steer_slots", (L, max_tokens, cfg.max_ops_per_layer), torch.int32, -1)
            buf("vectors", (cfg.steer_slots, geo.hidden_size), torch.float32)
            buf("op_codes", (cfg.steer_slots,), torch.int32)
            buf("scales", (cfg.steer_slots,), torch.float32)
            buf("thresholds", (cfg.steer_slots,), torch.float32)
        if cfg.copy_staging_bytes:  # two halves a step's rows are copied into on the device before the host copy
            buf("copy_staging", (2, -(-cfg.copy_staging_bytes // 256) * 256), torch.uint8)
        if cfg.detect:  # in-engine detectors: probe directions, per-layer routing, one score per (row, detector)
            buf("probe_table", (cfg.probe_slots, geo.hidden_size), torch.float32)
            buf("probe_route", (L, max_tokens, cfg.detectors_per_request), torch.int32, -1)
            buf("probe_out", (max_tokens, cfg.detectors_per_request), torch.float32)

    def device_bytes(self) -> int:
        """The bytes of every buffer (the plugin's whole device footprint: apertures, routes, steering table)."""
        return sum(b.numel() * b.element_size() for b in self.buffers())
