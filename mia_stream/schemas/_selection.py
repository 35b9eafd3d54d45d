"""Per-subscriber selection of a step batch's layers, positions and tensors (spec 3.9 ``select``, 10.4).

``parse_selection`` checks what a consumer asked for in its ``subscribe``; ``select_view`` narrows a validated
step batch header to it without copying a tensor byte: entries of unwanted tensors go with their buffer
frames, a kept entry that holds some unwanted layers gets ``layer_index`` (the stored layers it keeps), a group
with some unwanted rows gets ``row_index`` and ``stored_rows`` (the stored row of each kept row), and payloads
(ring references and buffer frames) stay as they are. A reader that gathers from the ring copies just the kept
layers' kept rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import msgpack
import numpy as np

from mia_stream.errors import MalformedFrameError
from mia_stream.schemas._framing import _I64, SHM_RING_KEY

# positions relative to a request's prompt (spec 3.9): what the capture spec calls them
RELATIVE_POSITIONS = ("all", "prompt", "generated", "last_prompt")
_SELECT_KEYS = ("layers", "positions", "tensors")


@dataclass(frozen=True)
class ViewSelection:
    """What one consumer wants of each step batch: ``layers`` (None: all), ``positions`` (one of
    ``RELATIVE_POSITIONS`` or a frozenset of positions), ``tensors`` (names; None: all)."""

    layers: frozenset | None = None
    positions: str | frozenset = "all"
    tensors: frozenset | None = None

    @property
    def needs_prompt_lengths(self) -> bool:
        return self.positions in ("prompt", "generated", "last_prompt")

    def key(self) -> tuple:
        """Hashable identity: consumers that select alike share one selected view of a message."""
        return (self.layers, self.positions, self.tensors)


def parse_selection(select: Any) -> ViewSelection | None:
    """A ``subscribe.select`` map (spec 3.9) as a ``ViewSelection``; None for an empty map (no selection).
    Raises ``MalformedFrameError`` naming the bad key."""
    if select is None or select == {}:
        return None
    if type(select) is not dict:
        raise MalformedFrameError(f"subscribe.select must be a map, got {type(select).__name__}")
    unknown = sorted(str(k) for k in select if k not in _SELECT_KEYS)
    if unknown:
        raise MalformedFrameError(f"subscribe.select: unknown key(s) {unknown}; known: {list(_SELECT_KEYS)}")
    layers = select.get("layers")
    if layers is not None:
        if type(layers) is not list or any(type(x) is not int or x < 0 for x in layers):
            raise MalformedFrameError(f"subscribe.select.layers must be an array of ints >= 0, got {layers!r}")
        layers = frozenset(layers)
    positions = select.get("positions", "all")
    if type(positions) is list:
        if any(type(x) is not int or x < 0 for x in positions):
            raise MalformedFrameError(f"subscribe.select.positions: an array holds ints >= 0, got {positions!r}")
        positions = frozenset(positions)
    elif positions not in RELATIVE_POSITIONS:
        raise MalformedFrameError(f"subscribe.select.positions must be one of {list(RELATIVE_POSITIONS)} or an "
                                  f"array of ints, got {positions!r}")
    tensors = select.get("tensors")
    if tensors is not None:
        if type(tensors) is not list or any(type(x) is not str for x in tensors):
            raise MalformedFrameError(f"subscribe.select.tensors must be an array of names, got {tensors!r}")
        tensors = frozenset(tensors)
    return ViewSelection(layers, positions, tensors)


def _row_mask(sel: ViewSelection, g: dict, prompt_lens: np.ndarray | None) -> np.ndarray | None:
    """Which of a group's rows the selection keeps (None: all)."""
    if sel.positions == "all":
        return None
    positions = np.frombuffer(g["positions"], _I64)
    if isinstance(sel.positions, frozenset):
        return np.isin(positions, np.fromiter(sel.positions, _I64, len(sel.positions)))
    if prompt_lens is None:
        raise MalformedFrameError(f"positions {sel.positions!r} need each request's prompt length")
    requests = np.frombuffer(g["requests"], _I64)
    plen = np.repeat(prompt_lens[requests], np.frombuffer(g["rows"], _I64))
    known = plen >= 0  # a request whose prompt length is unknown keeps every row
    if sel.positions == "prompt":
        keep = positions < plen
    elif sel.positions == "generated":
        keep = positions >= plen
    else:
        keep = positions == plen - 1
    return keep | ~known


def _entry_buffers(e: dict) -> int:
    return (0 if "shm" in e else 1) + (1 if "scale" in e else 0)


def select_view(frames: Sequence[Any], header: dict, sel: ViewSelection,
                prompt_lens: np.ndarray | None = None) -> tuple[list, dict]:
    """The step batch ``frames`` (validated ``header``) narrowed to ``sel``: only the header is rewritten and
    buffer frames of unwanted entries dropped. ``prompt_lens``: each request's prompt length (-1 unknown: all
    its rows stay), needed for positions relative to the prompt. A request that keeps no row of a group loses
    its segment there (its seq then carries nothing of that part, spec 10.2); a group that keeps no row, or
    whose tensors all go, goes."""
    if header.get("kind") != "step_batch":
        return list(frames), header
    buffers = list(frames[2:])
    groups, kept_buffers, i = [], [], 0
    for g in header.get("groups", []):
        entries = g.get("tensors", [])
        start = i
        i += sum(_entry_buffers(e) for e in entries)
        new_entries, new_buffers, j = [], [], start
        for e in entries:
            nb = _entry_buffers(e)
            mine = buffers[j:j + nb]
            j += nb
            if sel.tensors is not None and e["name"] not in sel.tensors:
                continue
            layers = e.get("layers") or []
            if sel.layers is not None and layers:
                stored = (np.frombuffer(e["layer_index"], _I64).tolist() if "layer_index" in e
                          else range(len(layers)))
                keep = [k for k in stored if layers[k] in sel.layers]
                if not keep:
                    continue
                if len(keep) < len(layers):
                    e = dict(e)
                    e["layer_index"] = np.asarray(keep, _I64).tobytes()
            new_entries.append(e)
            new_buffers.extend(mine)
        if entries and not new_entries:  # its tensors all go: the group and its buffers go
            continue
        ng = dict(g)
        ng["tensors"] = new_entries
        mask = _row_mask(sel, g, prompt_lens)
        if mask is not None and not mask.all():
            if not mask.any():
                continue
            rows = np.frombuffer(g["rows"], _I64)
            offsets = np.zeros(len(rows) + 1, dtype=_I64)
            np.cumsum(rows, out=offsets[1:])
            stored = g.get("stored_rows", int(offsets[-1]))
            if "row_index" in g:
                take = np.frombuffer(g["row_index"], _I64)
            elif "row0" in g:
                row0 = np.frombuffer(g["row0"], _I64)
                take = (np.repeat(row0 - offsets[:-1], rows) + np.arange(int(offsets[-1]), dtype=_I64))
            else:
                take = np.arange(int(offsets[-1]), dtype=_I64)
            segment_of_row = np.repeat(np.arange(len(rows)), rows)
            kept_rows = np.bincount(segment_of_row, weights=mask, minlength=len(rows)).astype(_I64)
            seg = kept_rows > 0
            ng["requests"] = np.frombuffer(g["requests"], _I64)[seg].tobytes()
            ng["rows"] = kept_rows[seg].astype(_I64).tobytes()
            ng["positions"] = np.frombuffer(g["positions"], _I64)[mask].tobytes()
            if "token_ids" in g:
                ng["token_ids"] = np.frombuffer(g["token_ids"], _I64)[mask].tobytes()
            ng.pop("row0", None)
            ng["row_index"] = take[mask].astype(_I64).tobytes()
            ng["stored_rows"] = stored
        groups.append(ng)
        kept_buffers.extend(new_buffers)
    h = dict(header)
    h["groups"] = groups
    if not any("shm" in e for g in groups for e in g.get("tensors", [])):
        h.pop(SHM_RING_KEY, None)
    return [frames[0], msgpack.packb(h, use_bin_type=True), *kept_buffers], h
