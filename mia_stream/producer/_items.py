"""The items the engine hands the drain, one class per kind, in engine order (all picklable: they cross the pipe
to the drain sidecar, one ``pickle.dumps`` each). Plain data; owns no state. The drain dispatches on the type
(``StepDrain.handle``), the runtime's queue bound on it (``DATA_ITEMS``).

- ``Init(config, producer_id)``: the sidecar's first item only;
- ``Config(settings)``: settings (``hold_last_step``) that apply from here on;
- ``Start(eid, msg, info)``: a new stream (``msg`` a StreamStart; producer id and epoch stamped by the drain);
- ``StepItem``: one engine step's captured rows (columnar ``Segments``: one list entry per request segment);
- ``Tokens(step, eids, token_lists)``: what each request sampled at a step;
- ``Gap(eid, reason, step)``: the engine dropped a frame of this request (counted there; while one waits for the
  drain, later drops of the request and reason come only in the end's count);
- ``End(eid, reason, num_tokens, drops)``: the request finished (``drops``: frames_dropped, drops, uncaptured).

NamedTuples, not dataclasses, for the small ones: they pickle as the class and its fields.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple


class Init(NamedTuple):
    config: Any  # DrainConfig
    producer_id: str
    ring_secret: bytes = b""  # the host ring's owner secret: the drain's publisher proves ownership with it


class Config(NamedTuple):
    settings: dict


class Start(NamedTuple):
    eid: str
    msg: Any  # StreamStart
    info: dict  # prompt_len, qk_heads


class Tokens(NamedTuple):
    step: int
    eids: list
    token_lists: list


class Gap(NamedTuple):
    eid: str
    reason: str
    step: int


class End(NamedTuple):
    eid: str
    reason: str
    num_tokens: int | None
    drops: dict  # frames_dropped, drops (by reason), uncaptured


@dataclass
class Segments:
    """One captured kind's request segments of a step, columnar. Segment ``i`` holds aperture rows
    ``[row0[i], row0[i] + count[i])``; ``positions`` and ``token_rows`` are indexed by aperture row."""

    eids: list = field(default_factory=list)
    row0: list = field(default_factory=list)
    count: list = field(default_factory=list)
    layer_set: list = field(default_factory=list)  # index into layer_sets
    steer_version: list = field(default_factory=list)
    layer_sets: list = field(default_factory=list)  # distinct layer tuples of this step
    positions: Any = None  # np.ndarray [rows]
    token_rows: Any = None  # np.ndarray [rows]: the step's token row each aperture row came from


@dataclass
class StepItem:
    step: int
    time_ns: int  # when the step's rows reached the host: the frames' time_ns
    mark: int  # host ring release mark of this step's chunk
    parts: dict  # "hs" / "q" / "k" -> (ring offset, captured layers, rows, row bytes)
    hs: Segments
    qk: Segments
    token_ids: Any = None  # np.ndarray [num_tokens] of the step's input ids, or ("ring", offset, n, dtype)


DATA_ITEMS = (StepItem, Tokens)  # what the drain queue bound applies to; starts, ends, gaps always go
