"""The analyzer contract: what an analyzer needs, how it receives a step, how it reports results.

See the package docstring (``mia_stream.analyzers``) for the API an analyzer author uses.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, ClassVar, Iterable, Sequence

import numpy as np

from mia_stream.errors import AnalyzerConfigError, AnalyzerInputError
from mia_stream.schemas import AnalysisBatch, StepBatch, StreamEnd, StreamStart, Tensor, TokenBatch
from mia_stream.spec.request_table import RequestTable  # noqa: F401  (analyzers build on it; it lives low for alert policies)

POSITIONS = ("all", "prompt", "generated", "last_prompt")
# capture positions -> the positions each one covers (a need is met when the capture covers it)
_COVERS = {"all": {"all", "prompt", "generated", "last_prompt"}, "prompt": {"prompt", "last_prompt"},
           "generated": {"generated"}, "last_prompt": {"last_prompt"}}


def _int_list(value: Any, what: str) -> tuple[int, ...]:
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        value = [value]
    if not isinstance(value, (list, tuple)) or not value or not all(
            isinstance(x, (int, np.integer)) and not isinstance(x, bool) and x >= 0 for x in value):
        raise AnalyzerConfigError(f"{what} must be a non-empty list of non-negative integers, got {value!r}")
    return tuple(sorted({int(x) for x in value}))


@dataclass(frozen=True)
class Needs:
    """What an analyzer needs captured: hidden-state layers and Q/K layers, heads and positions.

    ``capture_spec()`` is the ``capture`` part of the request spec to send (``mia-stream analyze NAME
    --print-spec``); ``check(start)`` raises ``AnalyzerInputError`` naming the first missing piece when a
    stream's normalized capture (``StreamStart.capture``) does not provide it.
    """

    hs_layers: tuple[int, ...] | str = ()  # "all": every layer of the model
    hs_positions: str = "all"
    qk_layers: tuple[int, ...] | str = ()
    qk_heads: tuple[int, ...] | str = "all"
    qk_positions: str = "all"

    def __post_init__(self) -> None:
        for name in ("hs_layers", "qk_layers"):
            v = getattr(self, name)
            if v != "all":
                object.__setattr__(self, name, _int_list(v, name) if v else ())
        if self.qk_heads != "all":
            object.__setattr__(self, "qk_heads", _int_list(self.qk_heads, "qk_heads"))
        for name in ("hs_positions", "qk_positions"):
            if getattr(self, name) not in POSITIONS:
                raise AnalyzerConfigError(f"{name} must be one of {list(POSITIONS)}, got {getattr(self, name)!r}")

    def capture_spec(self) -> dict:
        """The ``capture`` object of ``extra_args["mia_stream"]`` that provides what this analyzer needs."""
        out: dict[str, Any] = {}
        if self.hs_layers:
            out["hidden_states"] = {"layers": _wire(self.hs_layers), "positions": self.hs_positions}
        if self.qk_layers:
            out["qk"] = {"layers": _wire(self.qk_layers),
                         "heads": self.qk_heads if self.qk_heads == "all" else list(self.qk_heads),
                         "positions": self.qk_positions}
        return out

    def check(self, start: StreamStart) -> None:
        """Raise ``AnalyzerInputError`` (one line, naming the missing piece) unless ``start``'s capture
        provides everything this analyzer needs."""
        cap = start.capture if isinstance(start.capture, dict) else {}
        rid = start.request_id
        if self.hs_layers:
            hs = cap.get("hidden_states") or {}
            _check_layers(rid, "hidden_states", _resolve(self.hs_layers, start), hs.get("layers") or [])
            _check_positions(rid, "hidden_states", self.hs_positions, hs.get("positions"))
        if self.qk_layers:
            qk = cap.get("qk") or {}
            _check_layers(rid, "qk", _resolve(self.qk_layers, start), qk.get("layers") or [])
            have_heads = qk.get("heads") or []
            want = range(start.num_heads) if self.qk_heads == "all" else self.qk_heads
            missing = sorted(set(want) - set(have_heads))
            if missing and (self.qk_heads != "all" or start.num_heads):
                raise AnalyzerInputError(f"request {rid!r} does not capture Q/K head(s) {missing} (captures "
                                         f"{sorted(have_heads)}); send the spec of --print-spec")
            _check_positions(rid, "qk", self.qk_positions, qk.get("positions"))


def _wire(layers: Any) -> Any:
    return "all" if layers == "all" else list(layers)


def _resolve(layers: Any, start: StreamStart) -> Sequence[int]:
    return range(start.num_layers) if layers == "all" else layers


def _check_layers(rid: str, what: str, want: Sequence[int], have: Sequence[int]) -> None:
    missing = sorted(set(want) - set(have))
    if missing:
        captured = f"captures layers {sorted(have)}" if have else f"captures no {what}"
        raise AnalyzerInputError(f"request {rid!r} does not capture {what} layer(s) {missing} ({captured}); "
                                 "send the spec of --print-spec")


def _check_positions(rid: str, what: str, want: str, have: Any) -> None:
    if want not in _COVERS.get(str(have), set()):
        raise AnalyzerInputError(f"request {rid!r} captures {what} at positions {have!r}, the analyzer needs "
                                 f"{want!r}; send the spec of --print-spec")


def layer_rows(t: Tensor, layers: Sequence[int]) -> np.ndarray:
    """Indices into dim 0 of ``t`` (which stacks ``t.layers``) of ``layers``; AnalyzerInputError if absent."""
    have = list(t.layers)
    try:
        return np.asarray([have.index(x) for x in layers], dtype=np.int64)
    except ValueError:
        missing = sorted(set(layers) - set(have))
        raise AnalyzerInputError(f"tensor {t.name!r} holds layers {have}, not {missing}") from None


def segments_of(rows: np.ndarray, mask: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """Per segment of a row group (``rows`` per segment), the rows ``mask`` keeps and the offset of each segment's
    first kept row among the kept rows (``mask`` None: all rows)."""
    if mask is None:
        kept = rows
    else:
        kept = np.bincount(np.repeat(np.arange(len(rows)), rows)[mask], minlength=len(rows)).astype(np.int64)
    off = np.zeros(len(kept), np.int64)
    np.cumsum(kept[:-1], out=off[1:])
    return kept, off


def layer_values(t: Tensor, rows: Any) -> np.ndarray:
    """``t``'s values at dim-0 index/indices ``rows`` (from ``layer_rows``) as float32, widening only those
    layers: ``Tensor.numpy()`` widens every captured layer of a bfloat16 tensor first (a prompt step capturing
    32 layers for an analyzer that reads one widened 32x too much), and shifts into a second new array."""
    raw = t.raw()[rows]
    if t.dtype == "bfloat16":
        out = raw.astype(np.uint32)
        out <<= 16  # bf16 bits are the high half of the float32
        return out.view(np.float32)
    if t.dtype in ("float32", "float16"):
        return raw.astype(np.float32, copy=False)
    return np.asarray(t.numpy()[rows], np.float32)  # float8 and the rest: the schema's exact widening




@dataclass
class Results:
    """What an analyzer reports for one step (or one request's end): rows, each about one request and one
    token position (-1: the request as a whole). Several ``add`` calls may be made; the runner turns them into
    one ``AnalysisBatch`` (rows grouped by request, requests in the order of the ``request_ids`` given). A value some adds do
    not give is NaN (floats) or 0 in their rows."""

    _chunks: list = field(default_factory=list)

    def add(self, request_ids: Sequence[str], row_requests: Any, positions: Any = None, values: dict | None = None,
            labels: dict | None = None, alerts: Any = None) -> None:
        """Rows for many requests at once. ``row_requests``: int array, for each row the index into
        ``request_ids`` of its request; ``positions``: int per row (None: -1); ``values``: name -> array with
        one leading entry per row; ``labels``: name -> list of str | None per row; ``alerts``: bool per row."""
        rr = np.asarray(row_requests, dtype=np.int64).reshape(-1)
        n = len(rr)
        pos = np.full(n, -1, np.int64) if positions is None else np.asarray(positions, np.int64).reshape(-1)
        vals = {k: np.asarray(v) for k, v in (values or {}).items()}
        for k, v in vals.items():
            if v.ndim == 0 or v.shape[0] != n:
                raise ValueError(f"value {k!r} has shape {v.shape}, want {n} rows first")
        labs = {k: list(v) for k, v in (labels or {}).items()}
        al = np.zeros(n, bool) if alerts is None else np.asarray(alerts, bool).reshape(-1)
        if len(pos) != n or len(al) != n or any(len(v) != n for v in labs.values()):
            raise ValueError("positions, alerts and labels need one entry per row")
        if n:
            self._chunks.append((list(request_ids), rr, pos, vals, labs, al))

    def add_one(self, request_id: str, values: dict | None = None, position: int = -1, labels: dict | None = None,
                alert: bool = False) -> None:
        """One row for one request: ``values`` name -> scalar or array (one row is added in front)."""
        vals = {k: np.asarray(v)[None] for k, v in (values or {}).items()}
        labs = {k: [v] for k, v in (labels or {}).items()}
        self.add([request_id], [0], [position], vals, labs, [alert])

    def __bool__(self) -> bool:
        return bool(self._chunks)

    def to_batch(self, analyzer: str, version: str, producer_id: str, epoch: int, seqs_for, step: int = -1,
                 source_time_ns: int = 0, time_ns: int = 0) -> AnalysisBatch | None:
        """One AnalysisBatch of every row added (None when there are none). ``seqs_for(request_ids)`` gives each
        request's next seq in its analysis stream."""
        if not self._chunks:
            return None
        chunks = self._chunks
        kinds: dict[str, tuple] = {}  # value name -> (dtype, row shape), from the first add that gives it
        for c in chunks:
            for k, v in c[3].items():
                dt, shape = kinds.setdefault(k, (v.dtype, v.shape[1:]))
                if v.shape[1:] != shape:
                    raise ValueError(f"value {k!r}: rows of shape {v.shape[1:]} and {shape} in one step")
        ids: list[str] = []
        index: dict[str, int] = {}
        rr_parts = []
        for chunk_ids, rr, *_ in chunks:
            remap = np.full(len(chunk_ids), -1, np.int64)
            for j in np.flatnonzero(np.bincount(rr, minlength=len(chunk_ids))).tolist():  # requests with rows
                rid = chunk_ids[j]
                i = index.get(rid)
                if i is None:
                    i = index[rid] = len(ids)
                    ids.append(rid)
                remap[j] = i
            rr_parts.append(remap[rr])
        rr = np.concatenate(rr_parts)
        order = np.argsort(rr, kind="stable")  # rows grouped by request, each request's rows in added order
        rows = np.bincount(rr, minlength=len(ids)).astype(np.int64)
        values = {k: np.concatenate([c[3][k] if k in c[3] else _blank(len(c[1]), *kinds[k]) for c in chunks])[order]
                  for k in sorted(kinds)}
        labels = {}
        for k in sorted({k for c in chunks for k in c[4]}):
            flat = [x for c in chunks for x in c[4].get(k, [None] * len(c[1]))]
            labels[k] = [flat[i] for i in order.tolist()]
        positions = np.concatenate([c[2] for c in chunks])[order]
        alerts = np.concatenate([c[5] for c in chunks])[order].astype(np.int64)
        self._chunks = []
        return AnalysisBatch(producer_id, epoch, analyzer, ids, seqs_for(ids), rows, positions, values, labels,
                             alerts, step, version, time_ns, source_time_ns)


def _blank(n: int, dtype: np.dtype, shape: tuple) -> np.ndarray:
    """Rows of a value some adds of a step did not give: NaN for floats, 0 otherwise."""
    return np.full((n, *shape), np.nan if dtype.kind == "f" else 0, dtype)


class Analyzer:
    """Base class of every analyzer; see the package docstring for the contract.

    Subclasses set ``name``, ``version``, ``defaults`` (the config keys they accept with their default values)
    and implement ``needs`` plus any of ``on_start`` / ``on_batch`` / ``on_tokens`` / ``on_end``.
    """

    name: ClassVar[str] = ""
    version: ClassVar[str] = "1"
    defaults: ClassVar[dict] = {}
    description: ClassVar[str] = ""

    def __init__(self, config: dict | None = None):
        # request id -> prompt length, kept by the runner from each StreamStart (what ``position_mask`` reads)
        self.prompt_lengths: dict[str, int] = {}
        cfg = copy.deepcopy(dict(self.defaults))
        if config is not None:
            if not isinstance(config, dict):
                raise AnalyzerConfigError(f"{self.name} config must be an object, got {type(config).__name__}")
            unknown = sorted(set(config) - set(cfg))
            if unknown:
                raise AnalyzerConfigError(f"{self.name} config: unknown key(s) {unknown}; "
                                          f"allowed: {sorted(cfg)}")
            cfg.update(config)
        self.config = cfg
        self.configure(cfg)

    # ---------------------------------------------------------------------------------- to override
    def configure(self, config: dict) -> None:
        """Validate ``config`` (defaults merged in); raise ``AnalyzerConfigError`` naming the bad key."""

    def needs(self) -> Needs:
        raise NotImplementedError

    def on_start(self, start: StreamStart) -> None:
        """A request's stream starts. Default: check that it captures what ``needs`` says (raises
        ``AnalyzerInputError``; the runner then reports the request as rejected and skips its data)."""
        self.needs().check(start)

    def on_batch(self, batch: StepBatch, out: Results) -> None:
        """One engine step of many requests (vectorize over ``batch.groups``)."""

    def on_tokens(self, batch: TokenBatch, out: Results) -> None:
        """What many requests sampled at one step."""

    def on_end(self, request_id: str, end: StreamEnd | None, out: Results) -> None:
        """A request ended (``end`` None: it was rejected or lost); report its final results and free its state."""

    # ---------------------------------------------------------------------------------- helpers
    def capture_spec(self) -> dict:
        return self.needs().capture_spec()

    def position_mask(self, batch: StepBatch, group: Any, positions: str) -> np.ndarray | None:
        """Which rows of ``group`` are at ``positions`` ("all" | "prompt" | "generated" | "last_prompt") of their
        request, as a bool array; None when every row is (a stream may capture more positions than needed)."""
        if positions == "all" or not group.num_rows:
            return None
        lengths = self.prompt_lengths
        plen = np.asarray([lengths.get(batch.request_ids[i], 0) for i in group.requests.tolist()], np.int64)
        row_plen = np.repeat(plen, group.rows)
        pos = group.positions
        mask = pos < row_plen if positions == "prompt" else (
            pos >= row_plen if positions == "generated" else pos == row_plen - 1)
        return None if mask.all() else mask

    def rows_at(self, batch: StepBatch, group: Any, positions: str) -> Any:
        """``position_mask`` as an index for a group's row arrays: a bool mask, or ``slice(None)`` (every row)."""
        mask = self.position_mask(batch, group, positions)
        return slice(None) if mask is None else mask

    def config_value(self, key: str, kind: type | tuple, what: str = "") -> Any:
        """``config[key]`` checked against ``kind`` (AnalyzerConfigError naming the key otherwise)."""
        v = self.config.get(key)
        ok = isinstance(v, kind) and not (isinstance(v, bool) and kind in (int, float, (int, float)))
        if not ok:
            names = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
            raise AnalyzerConfigError(f"{self.name} config: {key!r} must be {what or names}, got {v!r}")
        return v
