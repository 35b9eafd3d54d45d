"""What a "frame" event holds: ``StepFrame`` (one engine step of one request), and the lazy views that cut one
request's share out of a ``StepBatch`` without copying.

Rule: no state beyond the batch being expanded. A request's ``StepFrame`` from a StepBatch is built lazily: its
tensors are zero-copy views into the batch, made when first read (``_Segment.fill``); a request with segments in
parts 0 and 1 gets two frames from its one seq (``_Share``: what the sequencer holds for it).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mia_stream.schemas import RowGroup, StepBatch, Tensor, TensorFrame



@dataclass
class StepFrame:
    """One engine step of one request, TP shards merged. ``tensors`` are numpy (bf16 widened to float32, quantized
    captures dequantized to float32); ``raw_tensors`` are the ``schemas.Tensor`` objects (exact wire dtype: int8
    and float8 with their ``scale``, zero-copy where unmerged).

    From a ``StepBatch`` the frame is a view of the request's segment: ``positions``, ``token_ids``,
    ``raw_tensors``, ``layers`` and ``rank_frames`` are made on first use (zero-copy slices of the batch).
    A view keeps the whole step's buffers alive: copy (``np.array(frame.tensors["hs"])``) what you keep. Live on
    the broker's host the buffers are views of the producer's shared-memory ring, valid until the event is
    released: keep ``frame.copy()`` (or ``event.keep()``), never the frame itself."""

    request_id: str
    step: int
    positions: list
    token_ids: list
    steering_version: int
    raw_tensors: dict[str, Tensor]
    layers: dict[str, tuple]
    time_ns: int = 0
    rank_frames: list = field(default_factory=list, repr=False)  # the TensorFrames merged, by rank
    part: int = 0  # 0: hidden states (and Q/K at the same positions), 1: Q/K at positions of their own

    @functools.cached_property
    def tensors(self) -> dict[str, np.ndarray]:
        """name -> array: hs ``[L,T,H]``, q ``[L,T,heads,D]``, k ``[L,T,kv_heads,D]`` (computed on first use)."""
        return {name: t.numpy() if t.scale is None else t.dequantize() for name, t in self.raw_tensors.items()}

    def copy(self) -> "StepFrame":
        """This frame with its tensors copied: valid after its event is released (zero-copy tensors view a
        shared-memory ring the producer reuses; docs/wire-format.md 9.4)."""
        raw = {name: owned(t) for name, t in self.raw_tensors.items()}
        return StepFrame(self.request_id, self.step, list(self.positions), list(self.token_ids), self.steering_version,
                         raw, dict(self.layers), self.time_ns, [], self.part)

    def __getattr__(self, name: str) -> Any:
        # Only reached for an attribute not yet set: the lazy fields of a frame cut from a StepBatch segment.
        seg = self.__dict__.get("_segment")
        if seg is None or name not in _LAZY_FIELDS:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        seg.fill(self, name)
        return self.__dict__[name]


_LAZY_FIELDS = frozenset(("positions", "token_ids", "raw_tensors", "layers", "rank_frames"))


class _GroupView:
    """A row group of a StepBatch, prepared once for all its segments: row offsets, the raw arrays."""

    __slots__ = ("group", "offsets", "raws")

    def __init__(self, group: RowGroup):
        self.group = group
        self.offsets = group.offsets.tolist()
        self.raws = [(t, t.raw()) for t in group.tensors]

    def tensors(self, j: int) -> list[Tensor]:
        """Segment ``j``'s rows of every tensor: zero-copy views."""
        a, b = self.offsets[j], self.offsets[j + 1]
        out = []
        for t, raw in self.raws:
            view = raw[:, a:b]
            scale = t.scale
            if scale is not None and scale.ndim >= 2 and scale.shape[1] == t.shape[1]:
                scale = scale[:, a:b]
            out.append(Tensor(t.name, t.dtype, view.shape, view, t.layers, t.shard, scale, t.meta))
        return out


class _Segment:
    """One part of one request in a StepBatch: what fills a lazy StepFrame (or builds its TensorFrame)."""

    __slots__ = ("batch", "view", "i", "j", "version")

    def __init__(self, batch: StepBatch, view: _GroupView, i: int, j: int, version: int):
        self.batch, self.view, self.i, self.j, self.version = batch, view, i, j, version

    def step_frame(self, request_id: str) -> StepFrame:
        b = self.batch
        sf = object.__new__(StepFrame)  # the lazy fields are filled by fill() when first read
        d = sf.__dict__
        d["request_id"], d["step"], d["time_ns"], d["part"] = request_id, b.step, b.time_ns, self.view.group.part
        d["steering_version"] = self.version
        d["_segment"] = self
        return sf

    def fill(self, sf: StepFrame, name: str) -> None:
        d = sf.__dict__
        if name == "rank_frames":
            d["rank_frames"] = [self.tensor_frame()]
            return
        g, j = self.view.group, self.j
        a, e = self.view.offsets[j], self.view.offsets[j + 1]
        tensors = self.view.tensors(j)
        d["positions"], d["token_ids"] = g.positions[a:e].tolist(), g.token_ids[a:e].tolist()
        d["raw_tensors"] = {t.name: t for t in tensors}
        d["layers"] = {t.name: tuple(t.layers) for t in tensors}

    def tensor_frame(self) -> TensorFrame:
        b, v, j = self.batch, self.view, self.j
        a, e = v.offsets[j], v.offsets[j + 1]
        g = v.group
        tf = TensorFrame(b.request_ids[self.i], b.producer_id, b.epoch, int(b.seqs[self.i]), b.step,
                         g.positions[a:e].tolist(), g.token_ids[a:e].tolist(), v.tensors(j), self.version,
                         b.time_ns, g.part)
        return with_lease_of(b, tf)


def with_lease_of(source: Any, out: Any) -> Any:
    """``out`` (whose tensors view ``source``'s) with ``source``'s ring lease, if any (zero-copy: ``_ring_views``)."""
    lease = getattr(source, "_ring_lease", None)
    if lease is not None:
        out._ring_lease = lease
    return out


def owned(t: Tensor) -> Tensor:
    """``t`` with its bytes (and scale) copied: what a consumer keeps past an event's release."""
    data = np.array(t.raw(), copy=True)
    scale = None if t.scale is None else np.array(t.scale, copy=True)
    return Tensor(t.name, t.dtype, data.shape, data, t.layers, t.shard, scale, dict(t.meta))


class _Share:
    """What one request holds in a StepBatch (its segments, one per part: maybe none) under its one seq."""

    __slots__ = ("seq", "step", "segments")

    def __init__(self, seq: int, step: int, segments: list):
        self.seq, self.step, self.segments = seq, step, segments
