"""The producer's drain: turns the engine's per-step descriptors into stream messages and publishes them.

It runs where the engine's Python does not: in a sidecar process (``_sidecar``, the default), or in a thread
of the engine process when the caller hands the runtime a publisher object (tests, embedding). Either way it
sees the same items, in the engine's order, and reads captured rows from the shared host ring. No torch here.

Items (tuples, first field the kind; all picklable, built by ``_runtime.ProducerRuntime``):

- ``("config", {...})``: settings (``hold_last_step``) that apply from here on;
- ``("start", eid, StreamStart, info)``: a new stream (producer id and epoch stamped here);
- ``("step", StepItem)``: one engine step's captured rows (columnar: one list entry per request segment);
- ``("tokens", step, eids, token_lists)``: what each request sampled at a step;
- ``("gap", eid, reason, step)``: a frame of this request's step was dropped by the engine (counted there);
- ``("end", eid, reason, num_tokens, drop_summary)``: the request finished.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mia_stream.schemas import GapNotice, Shard, StreamEnd, StreamStart, Tensor, TensorFrame, TokenFrame

logger = logging.getLogger("mia_stream.producer")


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
    time_ns: int  # when the step's forward was enqueued: the frames' time_ns
    mark: int  # host ring release mark of this step's chunk
    parts: dict  # "hs" / "q" / "k" -> (ring offset, captured layers, rows, row bytes)
    hs: Segments
    qk: Segments
    token_ids: Any = None  # np.ndarray [num_tokens] of the step's input ids, or ("ring", offset, n, dtype)


@dataclass
class DrainConfig:
    """What the drain needs of the engine's geometry (plain data: it crosses a process boundary)."""

    tp_rank: int
    tp_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    local_heads: int
    local_kv_heads: int
    wire_dtype: str  # of the captured rows
    itemsize: int


@dataclass
class _Stream:
    stream_id: str
    prompt_len: int
    qk_heads: tuple
    generated: int = 0


def _tensor(name: str, raw: np.ndarray, dtype: str, item: int, layers, **kw) -> Tensor:
    shape = raw.shape[:-1] + (raw.shape[-1] // item,)
    return Tensor(name, dtype, tuple(int(x) for x in shape), memoryview(raw).cast("B"), tuple(layers), **kw)


def _rows(host: np.ndarray, index: dict, layers: tuple, row0: int, n: int) -> np.ndarray:
    """A copy of ``[len(layers), n, row bytes]`` rows of a step's drained buffer (the ring chunk is reused
    once the step is released, so frames never point into it).

    Slice the rows first, then pick layers: indexing layers of the whole buffer would copy every row.
    """
    rows = host[:, row0:row0 + n]
    js = [index[layer] for layer in layers]
    if js == list(range(js[0], js[0] + len(js))):
        return np.array(rows[js[0]:js[0] + len(js)], order="C", copy=True)
    return rows[js]


class StepDrain:
    """Builds and publishes the stream messages; see the module docstring. ``handle`` one item at a time."""

    def __init__(self, cfg: DrainConfig, publisher: Any, ring: Any):
        self.cfg, self.publisher, self.ring = cfg, publisher, ring
        self.hold_last_step = False
        self._streams: dict[str, _Stream] = {}
        self._seq: dict[str, int] = {}  # frames sent per stream (StreamEnd.frames_sent)
        self._held: dict[str, list] = {}

    def handle(self, item: tuple) -> None:
        kind = item[0]
        try:
            getattr(self, "_on_" + kind)(*item[1:])
        except Exception:  # one bad item must not stop the stream of everything else
            logger.exception("mia_stream: drain failed on a %s item", kind)
            self.ring.count("drain_dropped")
        finally:
            self.ring.count("handled")

    # ---------------------------------------------------------------- items
    def _on_config(self, settings: dict) -> None:
        self.hold_last_step = bool(settings.get("hold_last_step", self.hold_last_step))

    def _on_start(self, eid: str, msg: StreamStart, info: dict) -> None:
        self._streams[eid] = _Stream(msg.request_id, info["prompt_len"], tuple(info.get("qk_heads") or ()))
        msg.producer_id, msg.epoch = self.publisher.producer_id, self.publisher.epoch
        # the engine hands steering vectors over as float32 bytes; the wire carries the op format's lists
        msg.steering = [dict(o, vector=np.frombuffer(o["vector"]["f32"], "<f4").tolist())
                        if isinstance(o.get("vector"), dict) and "f32" in o["vector"] else o for o in msg.steering]
        self._stamp_and_publish(msg)

    def _on_tokens(self, step: int, eids: list, token_lists: list) -> None:
        now = time.time_ns()
        for eid, toks in zip(eids, token_lists):
            st = self._streams.get(eid)
            if st is None or not toks:
                continue
            first = st.prompt_len + st.generated
            st.generated += len(toks)
            self._emit(eid, TokenFrame(request_id=st.stream_id, producer_id=self.publisher.producer_id,
                                       epoch=self.publisher.epoch, seq=0, step=step, token_ids=list(toks),
                                       positions=list(range(first, first + len(toks))), time_ns=now), step)

    def _on_gap(self, eid: str, reason: str, step: int) -> None:
        st = self._streams.get(eid)
        if st is not None:
            self._emit(eid, GapNotice(request_id=st.stream_id, producer_id=self.publisher.producer_id,
                                      epoch=self.publisher.epoch, missing=[], reason=reason, origin="producer",
                                      time_ns=time.time_ns()), step)

    def _on_end(self, eid: str, reason: str, num_tokens: int | None, drops: dict) -> None:
        st = self._streams.pop(eid, None)
        if st is None:
            return
        self._flush_held(eid, num_tokens)
        sid = st.stream_id
        generated = st.generated if num_tokens is None else min(st.generated, num_tokens - st.prompt_len)
        self._publish(StreamEnd(
            request_id=sid, producer_id=self.publisher.producer_id, epoch=self.publisher.epoch,
            seq=self._next_seq(sid), finish_reason=reason, num_prompt_tokens=st.prompt_len,
            num_generated_tokens=generated, frames_sent=self._seq.get(sid, 0),
            frames_dropped=drops["frames_dropped"], drops=dict(drops["drops"]),
            uncaptured_positions=drops["uncaptured"], time_ns=time.time_ns()))
        self._seq.pop(sid, None)

    def _on_step(self, it: StepItem) -> None:
        try:
            self._frames_of_step(it)
        finally:
            self.ring.release(it.mark)

    # ---------------------------------------------------------------- frames of one step
    def _frames_of_step(self, it: StepItem) -> None:
        cfg, ring = self.cfg, self.ring
        host = {name: ring.view(off, len(layers) * rows * width).reshape(len(layers), rows, width)
                for name, (off, layers, rows, width) in it.parts.items()}
        index = {name: {layer: j for j, layer in enumerate(layers)} for name, (_, layers, _, _) in it.parts.items()}
        ids = it.token_ids
        if isinstance(ids, tuple):  # the step's input ids came with the rows (copied from the device)
            _, off, n, dtype = ids
            ids = ring.view(off, n * np.dtype(dtype).itemsize).view(dtype)
        per_req: dict[str, dict] = {}
        for kind, seg in (("hs", it.hs), ("qk", it.qk)):
            for i, eid in enumerate(seg.eids):
                st = self._streams.get(eid)
                if st is None:
                    continue
                r0, n = seg.row0[i], seg.count[i]
                positions = seg.positions[r0:r0 + n]
                layers = seg.layer_sets[seg.layer_set[i]]
                entry = per_req.get(eid)
                if entry is None:
                    entry = per_req[eid] = self._entry(seg, i, positions, ids, part=0)
                elif kind == "qk" and not np.array_equal(entry["positions"], positions):
                    # hs and q/k cover different positions: q/k go in a frame of their own
                    entry = per_req[eid + "\x00qk"] = self._entry(seg, i, positions, ids, part=1)
                if kind == "hs":
                    # hidden states are replicated across TP ranks: only rank 0 carries them (every rank
                    # still publishes a frame for every captured step; the SDK merges per step over ranks)
                    if cfg.tp_rank == 0:
                        rows = _rows(host["hs"], index["hs"], layers, r0, n)
                        entry["tensors"].append(_tensor("hs", rows, cfg.wire_dtype, cfg.itemsize, layers))
                else:
                    entry["tensors"].extend(self._qk_tensors(st, host, index, layers, r0, n))
        nbytes = 0
        for entry in per_req.values():
            st = self._streams[entry["eid"]]
            frame = TensorFrame(request_id=st.stream_id, producer_id=self.publisher.producer_id,
                                epoch=self.publisher.epoch, seq=0, step=it.step,
                                positions=entry["positions"].tolist(), token_ids=entry["token_ids"],
                                tensors=entry["tensors"], steering_version=entry["steer_version"],
                                time_ns=it.time_ns, part=entry["part"])
            nbytes += sum(t.nbytes for t in frame.tensors)
            self._emit(entry["eid"], frame, it.step)
        ring.count("frames", len(per_req))
        ring.count("bytes", nbytes)

    @staticmethod
    def _entry(seg: Segments, i: int, positions: np.ndarray, ids, part: int) -> dict:
        r0, n = seg.row0[i], seg.count[i]
        token_ids = ids[seg.token_rows[r0:r0 + n]].tolist() if ids is not None else [-1] * n
        return {"eid": seg.eids[i], "part": part, "positions": positions, "token_ids": token_ids, "tensors": [],
                "steer_version": seg.steer_version[i]}

    def _qk_tensors(self, st: _Stream, host: dict, index: dict, layers: tuple, r0: int, n: int) -> list[Tensor]:
        cfg = self.cfg
        D = cfg.head_dim
        out = []
        heads = np.asarray(st.qk_heads)
        group = cfg.num_heads // cfg.num_kv_heads
        kv_heads = np.unique(heads // group)
        for name, wanted, local in (("q", heads, cfg.local_heads), ("k", kv_heads, cfg.local_kv_heads)):
            lo, hi = cfg.tp_rank * local, (cfg.tp_rank + 1) * local
            mine = np.nonzero((wanted >= lo) & (wanted < hi))[0]
            rows = _rows(host[name], index[name], layers, r0, n).reshape(len(layers), n, local, D * cfg.itemsize)
            data = rows if mine.size == local else np.ascontiguousarray(rows[:, :, wanted[mine] - lo])
            shard = None
            if cfg.tp_size > 1:
                start = int(mine[0]) if mine.size else int(np.searchsorted(wanted, lo))
                shard = Shard(cfg.tp_rank, cfg.tp_size, 2, start, start + int(mine.size), int(wanted.size))
            out.append(_tensor(name, data, cfg.wire_dtype, cfg.itemsize, layers, shard=shard,
                               meta={"heads": [int(h) for h in wanted[mine]]}))
        return out

    # ---------------------------------------------------------------- publication
    def _next_seq(self, stream_id: str) -> int:
        self._seq[stream_id] = self._seq.get(stream_id, 0) + 1
        return self.publisher.next_seq(stream_id)

    def _publish(self, msg) -> None:
        try:
            self.publisher.publish(msg)
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
