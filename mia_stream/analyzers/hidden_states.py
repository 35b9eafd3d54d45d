"""``hidden_states``: per-layer reductions of the residual stream, streamed while the request runs.

Method: the logit-lens-style summaries interpretability tools take of a layer's residual stream (nostalgebraist,
"interpreting GPT: the logit lens", 2020; the per-token norms and mean-pooled states that probing work builds
on, e.g. Alain & Bengio, "Understanding intermediate layers using linear classifier probes", 2016), computed here
from the captured residual after each chosen layer (``hs``, HF's ``output_hidden_states[i + 1]`` before the
final norm).

Results (analyzer ``hidden_states``):

- every step, one row per captured token: ``norm`` ``[layers]`` float32, the L2 norm of each layer's residual
  at that position (``positions`` = the token position);
- at the request's end, one row (position -1): ``mean`` ``[layers, hidden]`` and ``last`` ``[layers, hidden]``
  float32, the mean over every captured position and the residual at the last captured position,
  ``last_position`` and ``tokens`` (positions reduced) int64;
- with ``stream_vectors``, the running ``mean`` and ``last`` also every step (one row per request, at its last
  position): 4 KiB x layers per request and step for a 1024-wide model, 32 KiB for an 8B one.

Config: ``layers`` (list or "all"), ``positions`` ("all" | "prompt" | "generated" | "last_prompt"),
``reductions`` (any of "norm", "mean", "last"), ``stream_vectors`` (bool).
"""

from __future__ import annotations

import numpy as np

from mia_stream.analyzers._base import (Analyzer, Needs, RequestTable, Results, layer_rows, layer_values,
                                        segments_of)
from mia_stream.errors import AnalyzerConfigError, AnalyzerInputError
from mia_stream.schemas import StepBatch, StreamEnd, StreamStart

REDUCTIONS = ("norm", "mean", "last")


class HiddenStates(Analyzer):
    """Per-layer reductions of the residual stream: per-token norms as it runs, mean and last state at the end."""

    name = "hidden_states"
    version = "1"
    defaults = {"layers": "all", "positions": "all", "reductions": list(REDUCTIONS), "stream_vectors": False}

    def configure(self, config: dict) -> None:
        layers = config["layers"]
        if layers != "all" and not (isinstance(layers, list) and layers and all(
                isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in layers)):
            raise AnalyzerConfigError(f"hidden_states config: 'layers' must be \"all\" or a non-empty list of "
                                      f"layer indices, got {layers!r}")
        red = config["reductions"]
        if not isinstance(red, list) or not red or any(r not in REDUCTIONS for r in red):
            raise AnalyzerConfigError(f"hidden_states config: 'reductions' must be a non-empty list of "
                                      f"{list(REDUCTIONS)}, got {red!r}")
        self.config_value("stream_vectors", bool)
        self._needs = Needs(hs_layers=layers if layers == "all" else tuple(layers), hs_positions=config["positions"])
        self.reductions = frozenset(red)
        self.stream_vectors = config["stream_vectors"]
        self.positions = config["positions"]
        self.layers: tuple[int, ...] | None = None if layers == "all" else tuple(sorted(set(layers)))
        self.hidden_size = 0
        self.table: RequestTable | None = None

    def needs(self) -> Needs:
        return self._needs

    def on_start(self, start: StreamStart) -> None:
        super().on_start(start)
        layers = tuple(range(start.num_layers)) if self.config["layers"] == "all" else self.layers
        if self.table is None:
            self.layers, self.hidden_size = layers, start.hidden_size
            n = len(layers)
            self.table = RequestTable(sum=((n, start.hidden_size), np.float64), count=((), np.int64),
                                      last=((n, start.hidden_size), np.float32), last_position=((), np.int64))
        elif layers != self.layers or start.hidden_size != self.hidden_size:
            raise AnalyzerInputError(
                f"request {start.request_id!r} is from a model with {start.num_layers} layers x "
                f"{start.hidden_size}, this analyzer process reduces layers {list(self.layers)} x "
                f"{self.hidden_size}: run one process per model")

    def on_batch(self, batch: StepBatch, out: Results) -> None:
        table = self.table
        if table is None:
            return
        ids = batch.request_ids
        want_mean, want_last = "mean" in self.reductions, "last" in self.reductions
        for g in batch.groups:
            if not g.has("hs"):
                continue
            t = g.tensor("hs")
            if t.shape[2] != self.hidden_size:
                raise AnalyzerInputError(f"hs rows have width {t.shape[2]}, the stream start said {self.hidden_size}")
            rows = layer_rows(t, self.layers)
            if len(rows) == t.shape[0] and (rows == np.arange(len(rows))).all():
                rows = slice(None)  # every captured layer, in order: no gather
            hs = layer_values(t, rows)  # [L, N, H] float32: only the configured layers, in their order
            mask = self.position_mask(batch, g, self.positions)
            positions, row_requests = g.positions, g.row_requests
            if mask is not None:  # the stream captures more positions than configured
                hs, positions, row_requests = hs[:, mask], positions[mask], row_requests[mask]
            if not hs.shape[1]:
                continue
            if "norm" in self.reductions:
                norms = np.sqrt(np.square(hs).sum(axis=2))  # [L, N]: row-wise, independent of the other rows
                out.add(ids, row_requests, positions, {"norm": norms.T})
            kept, off = segments_of(g.rows, mask)
            has_rows = kept > 0
            seg_requests, seg_rows, off = g.requests[has_rows], kept[has_rows], off[has_rows]
            slots = table.rows_of(table.slots([ids[i] for i in seg_requests.tolist()]))
            table["count"][slots] += seg_rows
            if want_mean:
                # one float32 sum per request segment (independent of the other requests of the step), kept in
                # float64 across steps
                seg = hs if len(off) == hs.shape[1] else np.add.reduceat(hs, off, axis=1)  # decode: 1 row each
                # widened explicitly: numpy's mixed-dtype in-place add was 1.6x slower (2.5 vs 1.6 ms, 256 x 4096)
                table["sum"][slots] += seg.transpose(1, 0, 2).astype(np.float64)
            last = off + seg_rows - 1
            if want_last or self.stream_vectors:
                table["last"][slots] = hs[:, last].transpose(1, 0, 2)
            table["last_position"][slots] = positions[last]
            if self.stream_vectors:
                out.add(ids, seg_requests, positions[last], self._vectors(slots))

    def on_end(self, request_id: str, end: StreamEnd | None, out: Results) -> None:
        table = self.table
        if table is None:
            return
        slot = table.slot(request_id)
        if slot is None:
            return
        if end is not None and table["count"][slot] > 0:
            values = {k: v[0] for k, v in self._vectors(np.asarray([slot])).items()}
            values["tokens"] = table["count"][slot]
            values["last_position"] = table["last_position"][slot]
            out.add_one(request_id, values)
        table.release(request_id)

    def _vectors(self, slots: np.ndarray) -> dict:
        table = self.table
        out = {}
        if "mean" in self.reductions:
            out["mean"] = (table["sum"][slots] / np.maximum(table["count"][slots], 1)[:, None, None]).astype(
                np.float32)
        if "last" in self.reductions:
            out["last"] = table["last"][slots].copy()
        return out
