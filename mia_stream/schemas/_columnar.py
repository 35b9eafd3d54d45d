"""The columnar kinds on the wire (spec section 10): step/token/analysis batch bodies, and narrowing them.

``select_requests`` rewrites a validated columnar header to name only some of its requests (the broker's
per-consumer delivery) without copying a tensor byte; ``columnar_requests`` gives what the broker routes by.
"""

from __future__ import annotations

from typing import Any, Sequence

import msgpack
import numpy as np

from mia_stream.errors import MalformedFrameError
from mia_stream.schemas._batches import VALUE_WIRE_DTYPES, AnalysisBatch, RowGroup, StepBatch, TokenBatch
from mia_stream.schemas._entries import _decode_tensors, _encode_tensor, _ring_of
from mia_stream.schemas._framing import _I64, SHM_RING_KEY, _col, _frame_sizes
from mia_stream.schemas._messages import Message
from mia_stream.schemas._oob import BufferSink, BufferSource
from mia_stream.schemas._validate import _check_columnar, _column, _request_columns


def _encode_columnar(msg: Message, header: dict, buffers: list, compression: str, checksum: bool,
                     shm: BufferSink | None) -> None:
    header.update(producer_id=msg.producer_id, epoch=msg.epoch, request_ids=list(msg.request_ids),
                  seqs=_col(msg.seqs), time_ns=msg.time_ns)
    if isinstance(msg, StepBatch):
        header["step"] = msg.step
        header["steering_versions"] = _col(msg.steering_versions)
        groups = []
        for g in msg.groups:
            entries = [_encode_tensor(t, compression, checksum, buffers, shm) for t in g.tensors]
            groups.append({"part": g.part, "requests": _col(g.requests), "rows": _col(g.rows),
                           "positions": _col(g.positions), "token_ids": _col(g.token_ids), "tensors": entries})
            if shm is not None and any("shm" in e for e in entries):
                header[SHM_RING_KEY] = shm.name
        header["groups"] = groups
    elif isinstance(msg, TokenBatch):
        header.update(step=msg.step, counts=_col(msg.counts), token_ids=_col(msg.token_ids),
                      first_positions=_col(msg.first_positions), finish_reasons=list(msg.finish_reasons))
    elif isinstance(msg, AnalysisBatch):
        header.update(analyzer=msg.analyzer, analyzer_version=msg.analyzer_version, step=msg.step,
                      rows=_col(msg.rows), positions=_col(msg.positions), alerts=_col(msg.alerts),
                      source_time_ns=msg.source_time_ns,
                      values={k: _encode_value(k, v) for k, v in msg.values.items()},
                      labels={k: list(v) for k, v in msg.labels.items()})


def _encode_value(name: str, v: np.ndarray) -> dict:
    dtype = "bool" if v.dtype == np.bool_ else str(v.dtype)
    if dtype not in VALUE_WIRE_DTYPES:
        raise MalformedFrameError(f"analysis value {name!r}: dtype {v.dtype} has no wire encoding")
    data = np.ascontiguousarray(v, dtype=VALUE_WIRE_DTYPES[dtype][0])
    return {"dtype": dtype, "shape": list(v.shape), "data": data.tobytes()}


def _decode_columnar(kind: str, header: dict, buffers: list, verify: bool, max_message_bytes: int,
                     shm: BufferSource | None) -> Message:
    plans = _check_columnar(kind, header, _frame_sizes(buffers) if buffers else [], max_message_bytes)
    ids, seqs = _request_columns(kind, header)
    common = {"producer_id": header["producer_id"], "epoch": header["epoch"], "request_ids": ids, "seqs": seqs,
              "time_ns": header.get("time_ns", 0)}
    if kind == "step_batch":
        ring = _ring_of(header, shm)
        groups = []
        for plan in plans:
            take = (plan.stored_rows, plan.take) if plan.take is not None else None
            tensors = _decode_tensors(plan.entries, buffers, verify, ring, take)
            groups.append(RowGroup(plan.requests, plan.rows, plan.positions, tensors, plan.token_ids, plan.part))
        return StepBatch(step=header["step"], groups=groups,
                         steering_versions=_column(kind, header, "steering_versions", len(ids), None), **common)
    if kind == "token_batch":
        return TokenBatch(step=header["step"], counts=_column(kind, header, "counts", len(ids), None),
                          token_ids=_column(kind, header, "token_ids", None, None),
                          first_positions=_column(kind, header, "first_positions", len(ids), None),
                          finish_reasons=header.get("finish_reasons"), **common)
    values = {}
    for name, v in header.get("values", {}).items():
        np_dtype = VALUE_WIRE_DTYPES[v["dtype"]][0]
        arr = np.frombuffer(v["data"], np_dtype).reshape(v["shape"])
        values[name] = arr.astype(bool) if v["dtype"] == "bool" else arr
    return AnalysisBatch(analyzer=header["analyzer"], analyzer_version=header.get("analyzer_version", ""),
                         step=header.get("step", -1), rows=_column(kind, header, "rows", len(ids), None),
                         positions=_column(kind, header, "positions", None, None),
                         alerts=_column(kind, header, "alerts", None, None), values=values,
                         labels=dict(header.get("labels", {})), source_time_ns=header.get("source_time_ns", 0),
                         **common)


# ---------------------------------------------------------------------------------------------- columnar routing

def columnar_requests(header: dict) -> tuple[list, list]:
    """``(request_ids, seqs)`` of a validated columnar header (the broker routes by them)."""
    return header["request_ids"], np.frombuffer(header["seqs"], _I64).tolist()


def select_requests(frames: Sequence[Any], header: dict, keep: Sequence[int]) -> tuple[list, dict]:
    """The message naming only requests ``keep`` (ascending indices into ``request_ids``) of a validated
    columnar message (or gap batch), and its header. Only the header is rewritten: tensor payloads (ring references and
    buffer frames) stay whole, and each row group says which of their rows remain (``row0``, ``stored_rows``:
    spec section 10), so no tensor byte is copied; ``compact`` copies out just those rows."""
    kind = header["kind"]
    keep_arr = np.asarray(keep, dtype=np.intp)
    remap = np.full(len(header["request_ids"]), -1, dtype=np.intp)
    remap[keep_arr] = np.arange(len(keep_arr))
    h = dict(header)
    ids = header["request_ids"]
    h["request_ids"] = [ids[i] for i in keep_arr.tolist()]
    if kind != "gap_batch":
        h["seqs"] = np.frombuffer(header["seqs"], _I64)[keep_arr].tobytes()
    buffers = list(frames[2:])
    if kind == "gap_batch":
        counts = np.frombuffer(header["counts"], _I64)
        h["counts"] = counts[keep_arr].tobytes()
        range_mask = np.repeat(remap >= 0, counts)
        h["firsts"] = np.frombuffer(header["firsts"], _I64)[range_mask].tobytes()
        h["lasts"] = np.frombuffer(header["lasts"], _I64)[range_mask].tobytes()
    elif kind == "step_batch":
        if "steering_versions" in header:
            h["steering_versions"] = np.frombuffer(header["steering_versions"], _I64)[keep_arr].tobytes()
        groups, kept_buffers, i = [], [], 0
        for g in header.get("groups", []):
            requests = np.frombuffer(g["requests"], _I64)
            rows = np.frombuffer(g["rows"], _I64)
            nbuf = sum((0 if "shm" in e else 1) + (1 if "scale" in e else 0) for e in g.get("tensors", []))
            mine = remap[requests] >= 0
            if not mine.any():  # none of its segments remain: the group and its buffers go
                i += nbuf
                continue
            kept_buffers.extend(buffers[i:i + nbuf])
            i += nbuf
            offsets = np.zeros(len(rows) + 1, dtype=_I64)
            np.cumsum(rows, out=offsets[1:])
            row0 = np.frombuffer(g["row0"], _I64) if "row0" in g else offsets[:-1]
            row_mask = np.repeat(mine, rows)
            ng = dict(g)
            ng["requests"] = remap[requests[mine]].astype(_I64).tobytes()
            ng["rows"] = rows[mine].tobytes()
            ng["positions"] = np.frombuffer(g["positions"], _I64)[row_mask].tobytes()
            if "token_ids" in g:
                ng["token_ids"] = np.frombuffer(g["token_ids"], _I64)[row_mask].tobytes()
            if not mine.all():
                ng["row0"] = row0[mine].tobytes()
                ng["stored_rows"] = g.get("stored_rows", int(offsets[-1]))
            groups.append(ng)
        h["groups"] = groups
        buffers = kept_buffers
    elif kind == "token_batch":
        counts = (np.frombuffer(header["counts"], _I64) if "counts" in header
                  else np.ones(len(ids), dtype=_I64))
        h["counts"] = counts[keep_arr].tobytes()
        if "token_ids" in header:
            h["token_ids"] = np.frombuffer(header["token_ids"], _I64)[np.repeat(remap >= 0, counts)].tobytes()
        if "first_positions" in header:
            h["first_positions"] = np.frombuffer(header["first_positions"], _I64)[keep_arr].tobytes()
        if "finish_reasons" in header:
            h["finish_reasons"] = [header["finish_reasons"][i] for i in keep_arr.tolist()]
    elif kind == "analysis":
        rows = np.frombuffer(header["rows"], _I64) if "rows" in header else np.ones(len(ids), dtype=_I64)
        h["rows"] = rows[keep_arr].tobytes()
        row_mask = np.repeat(remap >= 0, rows)
        for key in ("positions", "alerts"):
            if key in header:
                h[key] = np.frombuffer(header[key], _I64)[row_mask].tobytes()
        values = {}
        for name, v in header.get("values", {}).items():
            arr = np.frombuffer(v["data"], VALUE_WIRE_DTYPES[v["dtype"]][0]).reshape(v["shape"])[row_mask]
            values[name] = {"dtype": v["dtype"], "shape": list(arr.shape), "data": arr.tobytes()}
        h["values"] = values
        idx = np.flatnonzero(row_mask).tolist()
        h["labels"] = {name: [v[j] for j in idx] for name, v in header.get("labels", {}).items()}
    else:
        raise MalformedFrameError(f"select_requests: {kind!r} is not a columnar kind")
    if kind == "step_batch" and not any("shm" in e for g in h["groups"] for e in g.get("tensors", [])):
        h.pop(SHM_RING_KEY, None)
    return [frames[0], msgpack.packb(h, use_bin_type=True), *buffers], h


def has_partial_inline_rows(header: dict) -> bool:
    """Whether a (selected) step batch sends buffer frames of which only some rows are wanted: ``compact``
    then saves their other rows' bytes."""
    return any(any("shm" not in e and ("row0" in g or "row_index" in g or "layer_index" in e)
                   for e in g.get("tensors", ()))
               for g in header.get("groups", ()))
