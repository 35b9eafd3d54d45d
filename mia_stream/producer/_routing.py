"""Per-request and per-step routing state of the producer runtime (host side, numpy only; no device, no torch).

Owns: ``_Request`` (one streamed request's bookkeeping: capture kinds, next position per kind, steering ops and
slots), ``_KindRouting`` (one captured kind's aperture rows and columnar segments for ONE step, rebuilt every step),
``_DecodeCache`` (a steady-decode step's routing, replayed while the batch does not change). ``ProducerRuntime``
holds the instances and their lifetime; the positions-mode rules live here (``hits`` scalar, ``select`` array).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from mia_stream.producer._items import Segments
from mia_stream.spec import RequestSpec


@dataclass
class _Request:
    engine_id: str
    stream_id: str
    spec: RequestSpec
    prompt_len: int
    prompt_token_ids: list
    # per captured kind (0 = hidden states, 1 = Q/K; 2 = in-engine detectors): the next position not yet captured, which dedupes the
    # recomputation after a preemption
    next_pos: list = field(default_factory=lambda: [0, 0, 0])  # [2]: the next position a detector scores
    first_computed: int | None = None
    steer_ops: tuple = ()
    steer_version: int = 0
    pending_steer: tuple | None = None  # (ops, version) taking effect at the next step
    steer_slots: list | tuple = ()  # the steering-table slot of each of steer_ops (None: the table was full)
    slots_by_layer: dict = field(default_factory=dict)  # layer -> [(slot, op)]; shared between requests: read only
    steer_rows: tuple | None = None  # decode-step ops for (prompt, generated), shared likewise: see _steer_layout
    frames_dropped: int = 0
    drops: dict = field(default_factory=dict)
    uncaptured: list = field(default_factory=list)
    capture_kinds: tuple = ()  # ((0 = hidden states | 1 = Q/K, layers, positions mode), ...) it captures
    detectors: list = field(default_factory=list)  # _scores._Detector of each in-engine detector with a slot


class _KindRouting:
    """One captured kind's routing for a step (hidden states, or Q/K): aperture rows handed out in request
    order, the route entries grouped by layer set so each group is one numpy write, and the step's segments
    in columnar form (what crosses to the drain: one list entry per request, no per-request objects)."""

    def __init__(self):
        self.next_row = 0
        self.groups: dict[tuple, tuple[list, list, list, list]] = {}  # ints (decode) and arrays
        self.seg = Segments()
        self._layer_set_index: dict[tuple, int] = {}
        self._positions: list = []  # by aperture row: ints (decode) or arrays (prefill)
        self._token_rows: list = []
        self._scalar = True

    def claim(self, eid: str, layers: tuple, token_rows: np.ndarray | int, positions: np.ndarray | int,
              steer_version: int, capacity: int) -> bool:
        """Give ``token_rows`` aperture rows at ``layers``; False (nothing taken) when the aperture is full.
        A decode step passes ints (one row)."""
        count = 1 if isinstance(token_rows, int) else len(token_rows)
        if self.next_row + count > capacity:
            return False
        group = self.groups.setdefault(layers, ([], [], [], []))
        if isinstance(token_rows, int):  # decode: plain ints, one numpy write per layer set at the end
            group[0].append(token_rows)
            group[1].append(self.next_row)
        else:
            group[2].append(token_rows)
            group[3].append(np.arange(self.next_row, self.next_row + count, dtype=np.int32))
            self._scalar = False
        seg = self.seg
        ls = self._layer_set_index.get(layers)
        if ls is None:
            ls = self._layer_set_index[layers] = len(seg.layer_sets)
            seg.layer_sets.append(layers)
        seg.eids.append(eid)
        seg.row0.append(self.next_row)
        seg.count.append(count)
        seg.layer_set.append(ls)
        seg.steer_version.append(steer_version)
        self._positions.append(positions)
        self._token_rows.append(token_rows)
        self.next_row += count
        return True

    def segments(self) -> Segments:
        """The step's segments with ``positions`` / ``token_rows`` as arrays indexed by aperture row."""
        seg = self.seg
        if seg.positions is not None:  # built already (or replayed from a _DecodeCache)
            return seg
        if self._scalar:
            seg.positions = np.asarray(self._positions, np.int64)
            seg.token_rows = np.asarray(self._token_rows, np.int64)
        else:
            seg.positions = np.concatenate([np.atleast_1d(p) for p in self._positions]).astype(np.int64)
            seg.token_rows = np.concatenate([np.atleast_1d(t) for t in self._token_rows]).astype(np.int64)
        return seg

    def host_route(self, num_layers: int, width: int, sentinel: int) -> np.ndarray | None:
        if not self.groups:
            return None
        host = np.full((num_layers, width), sentinel, np.int32)
        for layers, (one_tokens, one_rows, token_rows, rows) in self.groups.items():
            tok = np.concatenate([np.asarray(one_tokens, np.int64), *token_rows])
            dst = np.concatenate([np.asarray(one_rows, np.int32), *rows])
            host[np.asarray(layers)[:, None], tok[None, :]] = dst[None, :]
        return host


class _DecodeCache:
    """A steady-decode step's routing, replayed while the batch does not change (see ``_repeat_decode_step``)."""

    def __init__(self, req_ids: list, epoch: int, plens: np.ndarray, hs: Segments, qk: Segments, claimed: list):
        self.req_ids, self.epoch, self.plens, self.claimed = req_ids, epoch, plens, claimed
        self.kinds = (hs, qk)
        self.last_computed: np.ndarray | None = None

    def step_routing(self, kind: int, computed: np.ndarray) -> _KindRouting:
        """This step's routing of ``kind``: the cached segments with each row at its request's new position
        (every segment is one row: the row's token row is the request's batch index)."""
        seg = self.kinds[kind]
        routing = _KindRouting()
        routing.next_row = len(seg.eids)
        routing.seg = Segments(seg.eids, seg.row0, seg.count, seg.layer_set, seg.steer_version, seg.layer_sets,
                               computed[seg.token_rows], seg.token_rows)
        return routing


def hits(mode: str, position: int, prompt_len: int) -> bool:
    """Whether a capture positions-mode selects ``position`` (the scalar form of ``select``)."""
    if mode == "all":
        return True
    if mode == "prompt":
        return position < prompt_len
    if mode == "generated":
        return position >= prompt_len
    return position == prompt_len - 1  # last_prompt


def select(positions: np.ndarray, mode: str, prompt_len: int, next_pos: int) -> np.ndarray:
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
