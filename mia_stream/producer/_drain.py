"""The producer's drain: turns the engine's per-step descriptors into stream messages and publishes them.

It runs where the engine's Python does not: in a sidecar process (``_sidecar``, the default), or in a thread
of the engine process when the caller hands the runtime a publisher object (tests, embedding). Either way it
sees the same items, in the engine's order, and reads captured rows from the shared host ring. No torch here.

Items (``_items``: one class per kind, built by ``_runtime.ProducerRuntime``): ``Config``, ``Start``,
``StepItem``, ``Tokens``, ``Gap``, ``End``; ``handle`` dispatches on the type.

Owns (one ``StepDrain`` per producer): the live streams' publication state (``_Stream``: generated count, seqs
given to drops), the held newest step under async scheduling, the cached step grouping; releases ring chunks.

**One message per step** (schema 2.0, docs/wire-format.md 3.13-3.14): a step item becomes ONE ``StepBatch``
naming every streamed request the step captured, a tokens item ONE ``TokenBatch``; each request named holds
one seq in it, stamped at publication (``publisher.next_seq``). What a request gets from them is exactly what
its per-request ``TensorFrame`` (one per part) and ``TokenFrame`` held before: the same positions, input token
ids, steering version and tensors.

**Row groups.** A request's captured rows of one part go in the row group of key
``(part, hidden-state layers, Q/K layers, Q/K heads)``: requests captured alike share one group, whose tensors
(``hs [L, N, hidden]``, ``q [L, N, heads, head_dim]``, ``k [L, N, kv_heads, head_dim]``) hold their rows one
segment after the other. Part 0 is a request's hidden states, with its Q/K when they cover the same positions
(or its Q/K alone when it captures no hidden states); part 1 its Q/K at positions of their own. TP: only rank
0 carries ``hs`` (replicated on every rank); every rank carries its shard of the Q/K heads (``Shard`` on dim 2,
``meta.heads``), and every rank names each request it captured at the step, with its segments, even where it
carries no tensor for it: the consumers merge a step over ranks.

**Copies.** A group whose rows follow each other in the host ring and whose layers are the step's layers (a
decode step of requests captured alike) gets its tensor as a slice of the ring, no copy. When the host ring is
a /dev/shm ring (``HostRing.name``, the default) and every large tensor of the message is such a slice, the
message names them by position in the host ring (``HostRing.references``): no copy after the DMA, and the
chunk stays until the broker has received the message (issue 29). Otherwise the publisher copies them once,
into its own shared-memory ring by ``encode``, or into one buffer if they stay inline (the ring chunk is reused
once released). Other groups are gathered into a buffer of their own (one copy). The chunk is released when
the step's message was handed to the publisher.

**Async scheduling** (``hold_last_step``): the engine may compute a request one step past its stop token. The
drain then holds the newest step's messages (step batch, token batch, engine gap notices) until an item of
another step arrives, or publishes the ended request's part of them at its end, leaving out what lies past
its final length (frames at positions >= num_tokens - 1, tokens at positions >= num_tokens): nothing past the
stop token is published, and since seqs are stamped at publication the trim leaves no hole.

``MIA_STREAM_STEP_BATCHES=0`` (or ``StepDrain(step_batches=False)``) publishes the same content per request
(a TensorFrame per request part, a TokenFrame per request), the pre-2.0 form, for comparisons.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

import numpy as np

from mia_stream import settings
from mia_stream.bus.shm_ring import ownership_proof
from mia_stream.producer._items import Config, End, Gap, Segments, Start, StepItem, Tokens
from mia_stream.producer._quantized_rows import by_format, quantized_hosts, request_formats, row_scale
from mia_stream.schemas import (WIRE_DTYPES, GapNotice, RowGroup, Shard, StepBatch, StreamEnd, Tensor,
                                TokenBatch)

logger = logging.getLogger("mia_stream.producer")

_I64 = np.int64


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


class _Stream:
    __slots__ = ("stream_id", "prompt_len", "qk_heads", "generated", "dropped", "drops", "engine_gaps", "quantize")

    def __init__(self, stream_id: str, prompt_len: int, qk_heads: tuple):
        self.stream_id, self.prompt_len, self.qk_heads = stream_id, prompt_len, qk_heads
        self.generated = 0
        self.dropped = 0  # seqs this stream gave to dropped frames (each named by a GapNotice)
        self.drops: Counter = Counter()  # the drain's own drops by reason (the engine's come with the end)
        self.engine_gaps: Counter = Counter()  # seqs given to the engine's gap items, by reason
        self.quantize = ""  # capture.quantize: its rows come from that format's parts (producer/_quantize.py)


def _runs(row0: np.ndarray, count: np.ndarray) -> slice | np.ndarray:
    """The aperture rows of segments ``(row0, count)`` in order: a slice when they follow each other."""
    if len(row0) == 0:
        return slice(0, 0)
    if len(row0) == 1 or (row0[1:] == row0[:-1] + count[:-1]).all():
        return slice(int(row0[0]), int(row0[-1] + count[-1]))
    starts = np.zeros(len(count), dtype=_I64)
    np.cumsum(count[:-1], out=starts[1:])
    return np.repeat(row0 - starts, count) + np.arange(int(count.sum()), dtype=_I64)


def _layer_index(part_layers: tuple, layers: tuple) -> slice | list:
    """Where ``layers`` lie along dim 0 of a ring part holding ``part_layers``: a slice when consecutive."""
    js = [part_layers.index(layer) for layer in layers]
    if js == list(range(js[0], js[0] + len(js))):
        return slice(js[0], js[0] + len(js))
    return js


class _Group:
    """One row group of a step, before publication: which segments of the step it holds (``live`` masks the
    ones still to publish; an ended request's are taken out)."""

    __slots__ = ("part", "hs_layers", "qk_layers", "heads", "req", "hs_seg", "qk_seg", "live")

    def __init__(self, part, hs_layers, qk_layers, heads, req, hs_seg, qk_seg):
        self.part, self.hs_layers, self.qk_layers, self.heads = part, hs_layers, qk_layers, heads
        self.req, self.hs_seg, self.qk_seg = req, hs_seg, qk_seg
        self.live = np.ones(len(req), dtype=bool)


class _StepPlan:
    """One step item, grouped (``StepDrain._plan``); the message is built from it at publication."""

    __slots__ = ("step", "time_ns", "mark", "eids", "sids", "index", "versions", "groups", "parts", "hs", "qk",
                 "hs_tokens", "qk_tokens", "formats")


class _TokenPlan:
    __slots__ = ("step", "time_ns", "eids", "sids", "counts", "firsts", "token_ids", "live")


class _GapPlan:
    __slots__ = ("step", "eid", "reason", "live")

    def __init__(self, step, eid, reason):
        self.step, self.eid, self.reason, self.live = step, eid, reason, True


class StepDrain:
    """Builds and publishes the stream messages; see the module docstring. ``handle`` one item at a time."""

    def __init__(self, cfg: DrainConfig, publisher: Any, ring: Any, step_batches: bool | None = None):
        self.cfg, self.publisher, self.ring = cfg, publisher, ring
        if step_batches is None:
            step_batches = settings.get_flag("MIA_STREAM_STEP_BATCHES")
        self.step_batches = step_batches
        self.hold_last_step = False
        self._np_dtype = WIRE_DTYPES[cfg.wire_dtype][0]
        self._streams: dict[str, _Stream] = {}
        self._held: list = []  # the newest step's plans, in arrival order (hold_last_step)
        self._held_step: int | None = None
        self._streams_epoch = 0  # bumped by every start and end: a cached step grouping is then stale
        self._grouping_cache: tuple | None = None
        # a FramePublisher copies what stays inline of a message's ring views (publish(..., borrowed=));
        # for any other publisher the drain copies them before publishing
        self._publisher_copies = bool(getattr(publisher, "copies_borrowed", False))
        # the host ring is a /dev/shm ring (issue 29): a publisher that proves it owns it sends rows that lie in it
        # as references into it (no copy after the DMA); else they are copied into the publisher's own ring
        self._host_refs = bool(getattr(ring, "name", "")) and bool(getattr(publisher, "takes_host_ring", False))
        if self._host_refs:
            publisher.add_ring_proof(ownership_proof(ring.name, ring.secret))
        next_seqs = getattr(publisher, "next_seqs", None)
        self._next_seqs = next_seqs if next_seqs is not None else (lambda ids: [publisher.next_seq(r) for r in ids])
        self._handlers = {Config: self._on_config, Start: self._on_start, StepItem: self._on_step,
                          Tokens: self._on_tokens, Gap: self._on_gap, End: self._on_end}

    def handle(self, item) -> None:
        handler = self._handlers.get(type(item))
        if self._host_refs:
            self.ring.check_references()
        try:
            if handler is None:
                raise TypeError(f"not a drain item: {type(item).__name__}")
            handler(item)
        except Exception:  # one bad item must not stop the stream of everything else
            logger.exception("mia_stream: drain failed on a %s item", type(item).__name__)
            self.ring.count("drain_dropped")
        finally:
            self.ring.count("handled")

    def close(self) -> None:
        """Publish what is held (the engine is gone or closing: no later step can show it invalid)."""
        self._flush_held()

    # ---------------------------------------------------------------- items
    def _on_config(self, item: Config) -> None:
        settings = item.settings
        self.hold_last_step = bool(settings.get("hold_last_step", self.hold_last_step))
        for name, value in settings.get("counters", {}).items():  # the engine's word on the drain (restarts)
            self.publisher.counters[name] = value
        if not self.hold_last_step:
            self._flush_held()

    def _on_start(self, item: Start) -> None:
        eid, msg, info = item
        self._streams_epoch += 1
        self._streams[eid] = _Stream(msg.request_id, info["prompt_len"], tuple(info.get("qk_heads") or ()))
        self._streams[eid].quantize = (msg.capture or {}).get("quantize", "")
        msg.producer_id, msg.epoch = self.publisher.producer_id, self.publisher.epoch
        # steering ops stay in their compact form (float32 bytes, or a registered vector's name and digest):
        # as float lists, 32 ops of 4096 were 1 MiB of msgpack per request for the drain, the broker and every
        # consumer to encode and decode (docs/wire-format.md 3.1)
        msg.seq = self.publisher.next_seq(msg.request_id)
        self._publish(msg)

    def _on_tokens(self, item: Tokens) -> None:
        step, eids, token_lists = item
        streams = self._streams
        plan = _TokenPlan()
        plan.step, plan.time_ns = step, time.time_ns()
        kept, sids, counts, firsts, flat = [], [], [], [], []
        for eid, toks in zip(eids, token_lists):
            st = streams.get(eid)
            if st is None or not toks:
                continue
            kept.append(eid)
            sids.append(st.stream_id)
            counts.append(len(toks))
            firsts.append(st.prompt_len + st.generated)
            st.generated += len(toks)
            flat.extend(toks)
        if not kept:
            return
        plan.eids, plan.sids, plan.live = kept, sids, np.ones(len(kept), dtype=bool)
        plan.counts, plan.firsts = np.asarray(counts, _I64), np.asarray(firsts, _I64)
        plan.token_ids = np.asarray(flat, _I64)
        self._publish_or_hold(step, plan)

    def _on_gap(self, item: Gap) -> None:
        eid, reason, step = item
        if eid in self._streams:
            self._publish_or_hold(step, _GapPlan(step, eid, reason))

    def _on_step(self, it: StepItem) -> None:
        try:
            plan = self._plan(it)
        except Exception:
            self._flush_held()  # releasing this chunk releases every older one (marks only grow)
            self.ring.release(it.mark)
            self._drop_step(it, "drain_error")
            raise
        if plan is None:
            self._flush_held()
            self.ring.release(it.mark)
            return
        self._publish_or_hold(it.step, plan)

    def _on_end(self, item: End) -> None:
        eid, reason, num_tokens, drops = item
        st = self._streams.get(eid)
        if st is None:
            return
        self._publish_held_of(eid, num_tokens)
        self._name_uncovered_engine_drops(st, drops["drops"])
        del self._streams[eid]
        self._streams_epoch += 1
        sid = st.stream_id
        generated = st.generated if num_tokens is None else min(st.generated, num_tokens - st.prompt_len)
        seq = self.publisher.next_seq(sid)
        all_drops = Counter(drops["drops"])
        all_drops.update(st.drops)
        # seqs 0..seq: each is a message handed to the publisher or a dropped frame named by a gap notice (the
        # publisher moves its own drops from frames_sent to frames_dropped)
        self._publish(StreamEnd(
            request_id=sid, producer_id=self.publisher.producer_id, epoch=self.publisher.epoch, seq=seq,
            finish_reason=reason, num_prompt_tokens=st.prompt_len, num_generated_tokens=generated,
            frames_sent=seq + 1 - st.dropped, frames_dropped=st.dropped, drops=dict(all_drops),
            uncaptured_positions=drops["uncaptured"], time_ns=time.time_ns()))

    # ---------------------------------------------------------------- holding (async scheduling)
    def _publish_or_hold(self, step: int, plan) -> None:
        if not self.hold_last_step:
            self._publish_plan(plan)
            return
        if self._held and self._held_step != step:
            self._flush_held()
        self._held_step = step
        self._held.append(plan)

    def _flush_held(self) -> None:
        held, self._held, self._held_step = self._held, [], None
        for plan in held:
            self._publish_plan(plan)

    def _publish_held_of(self, eid: str, num_tokens: int | None) -> None:
        """A request ended: publish its part of the held step (what lies before its final length), in order,
        and take it out of the held messages."""
        for plan in self._held:
            if isinstance(plan, _GapPlan):
                if plan.eid == eid and plan.live:
                    plan.live = False
                    self._publish_gap(plan)
            elif isinstance(plan, _TokenPlan):
                hits = [i for i, e in enumerate(plan.eids) if e == eid and plan.live[i]]
                for i in hits:
                    plan.live[i] = False
                    if num_tokens is None or plan.firsts[i] < num_tokens:
                        mask = np.zeros(len(plan.eids), dtype=bool)
                        mask[i] = True
                        self._publish_tokens(plan, mask)
            else:
                r = plan.index.get(eid)
                if r is None:
                    continue
                masks = []
                for g in plan.groups:
                    mine = g.live & (g.req == r)
                    g.live &= g.req != r
                    if mine.any() and num_tokens is not None:
                        first = self._group_positions(plan, g, mine)[:1]
                        if len(first) and first[0] >= num_tokens - 1:
                            mine[:] = False  # computed one step past the stop token: never valid
                    masks.append(mine)
                if any(m.any() for m in masks):
                    self._publish_step(plan, masks)

    # ---------------------------------------------------------------- publication
    def _publish_plan(self, plan) -> None:
        if isinstance(plan, _StepPlan):
            try:
                self._publish_step(plan, [g.live for g in plan.groups])
            finally:
                self.ring.release(plan.mark)
        elif isinstance(plan, _TokenPlan):
            self._publish_tokens(plan, plan.live)
        elif plan.live:
            plan.live = False
            self._publish_gap(plan)

    def _publish_gap(self, plan: _GapPlan) -> None:
        st = self._streams.get(plan.eid)
        if st is None:
            return
        self._name_dropped(st, plan.reason, 1)

    def _name_dropped(self, st: _Stream, reason: str, n: int) -> None:
        """Give ``n`` frames the engine dropped the seqs they would have had, named in one gap notice."""
        seqs = [self.publisher.next_seq(st.stream_id) for _ in range(n)]  # consecutive: this thread's stream
        st.dropped += n
        st.engine_gaps[reason] += n
        self._publish(GapNotice(st.stream_id, self.publisher.producer_id, self.publisher.epoch,
                                [[seqs[0], seqs[-1]]], reason, "producer", time.time_ns()))

    def _name_uncovered_engine_drops(self, st: _Stream, engine_drops: dict) -> None:
        """The engine sends one gap item per request and reason while one is still waiting for the drain; the
        drops it covers beyond the first are named here, before the end, each with a seq of its own (so
        frames_sent + frames_dropped = the seqs the stream used). Reasons with no gap item are not frame drops
        (e.g. ``steer_table_full``)."""
        for reason, named in list(st.engine_gaps.items()):
            missing = engine_drops.get(reason, 0) - named
            if missing > 0:
                self._name_dropped(st, reason, missing)

    def _publish_tokens(self, plan: _TokenPlan, mask: np.ndarray) -> None:
        """Publish the requests ``mask`` keeps (their streams are live: an end takes its request out first)."""
        if mask.all():
            ids, counts, token_ids, firsts = plan.sids, plan.counts, plan.token_ids, plan.firsts
        else:
            keep = np.flatnonzero(mask).tolist()
            if not keep:
                return
            ids = [plan.sids[i] for i in keep]
            counts = plan.counts
            off = np.zeros(len(counts) + 1, dtype=_I64)
            np.cumsum(counts, out=off[1:])
            token_ids = np.concatenate([plan.token_ids[off[i]:off[i + 1]] for i in keep])
            counts, firsts = counts[keep], plan.firsts[keep]
        pub = self.publisher
        if self.step_batches:
            self._publish(TokenBatch(pub.producer_id, pub.epoch, plan.step, ids, self._next_seqs(ids), counts,
                                     token_ids, firsts, time_ns=plan.time_ns))
        else:
            for frame in TokenBatch(pub.producer_id, pub.epoch, plan.step, ids, np.zeros(len(ids), _I64), counts,
                                    token_ids, firsts, time_ns=plan.time_ns).frames():
                frame.seq = pub.next_seq(frame.request_id)
                self._publish(frame)

    def _publish_step(self, plan: _StepPlan, masks: list) -> None:
        try:
            built = self._build(plan, masks)
        except Exception:
            logger.exception("mia_stream: could not build step %d's message", plan.step)
            named = dict.fromkeys(r for g, m in zip(plan.groups, masks) for r in g.req[m].tolist())
            for r in named:  # the message would have held one seq of each: each is a dropped frame
                st = self._streams.get(plan.eids[r])
                if st is not None:
                    self._drop_named(st.stream_id, self.publisher.next_seq(st.stream_id), "drain_error")
            return
        if built is None:
            return
        batch, views, frames, nbytes = built
        if views and not self._publisher_copies:  # this publisher keeps references: own the bytes now
            for t in views:
                t.data = np.array(t.data, copy=True)
            views = []
        borrowed = bool(views)
        refs = self.ring.references(plan.mark) if borrowed and self._host_refs else None
        if self.step_batches:
            batch.seqs = np.asarray(self._next_seqs(batch.request_ids), _I64)
            self._publish(batch, borrowed, refs)
        else:
            for frame in batch.frames():  # one seq per request part, as before 2.0
                frame.seq = self.publisher.next_seq(frame.request_id)
                self._publish(frame, borrowed, refs)
        self.ring.count("frames", frames)
        self.ring.count("bytes", nbytes)

    def _publish(self, msg, borrowed: bool = False, refs=None) -> None:
        """Hand ``msg`` to the publisher (``refs``: the sink naming its chunk of the host ring, whose tensors it
        then references in place). If that fails, the seqs it held are dropped frames, each named."""
        try:
            if refs is not None:
                self.publisher.publish(msg, borrowed=self.ring.data, host_ring=refs)
                if refs.end:  # the chunk stays until the broker has received this message
                    self.ring.published_references(refs.end, refs.bytes)
            elif borrowed:
                self.publisher.publish(msg, borrowed=self.ring.data)
            else:
                self.publisher.publish(msg)
        except Exception:  # the bus must never take the engine down
            logger.exception("mia_stream: publish failed")
            if msg.KIND in ("step_batch", "token_batch"):
                named = zip(msg.request_ids, msg.seqs.tolist())
            elif msg.KIND in ("tensors", "tokens"):
                named = [(msg.request_id, msg.seq)]
            else:
                return
            for sid, seq in named:
                self._drop_named(sid, seq, "drain_error")

    def _drop_named(self, sid: str, seq: int, reason: str) -> None:
        st = next((s for s in self._streams.values() if s.stream_id == sid), None)
        if st is not None:
            st.dropped += 1
            st.drops[reason] += 1
        try:
            self.publisher.publish(GapNotice(sid, self.publisher.producer_id, self.publisher.epoch, [[seq, seq]],
                                             reason, "producer", time.time_ns()))
        except Exception:
            logger.exception("mia_stream: could not announce a dropped frame")

    def _drop_step(self, it: StepItem, reason: str) -> None:
        """A step the drain could not build: every request it captured loses that frame, each named."""
        for eid in dict.fromkeys(list(it.hs.eids) + list(it.qk.eids)):
            st = self._streams.get(eid)
            if st is not None:
                self._drop_named(st.stream_id, self.publisher.next_seq(st.stream_id), reason)

    # ---------------------------------------------------------------- grouping a step
    def _plan(self, it: StepItem) -> _StepPlan | None:
        """The step's segments in row groups; None if it names no stream."""
        hs, qk = it.hs, it.qk
        grouping = self._grouping(hs, qk)
        if grouping is None:
            return None
        eids, sids, index, versions, specs = grouping
        plan = _StepPlan()
        plan.step, plan.time_ns, plan.mark, plan.parts = it.step, it.time_ns, it.mark, it.parts
        plan.eids, plan.sids, plan.index, plan.versions, plan.hs, plan.qk = eids, sids, index, versions, hs, qk
        plan.groups = [_Group(*spec) for spec in specs]  # fresh: holding takes ended requests out of them
        plan.formats = request_formats(self._streams, eids)  # capture.quantize of each request (None: none)
        ids = it.token_ids
        if isinstance(ids, tuple):  # the step's input ids came with the rows (copied from the device)
            _, off, n, dtype = ids
            ids = self.ring.view(off, n * np.dtype(dtype).itemsize).view(dtype)
        ids = None if ids is None else np.asarray(ids, _I64)  # a copy out of the ring: small
        has_hs = any(spec[5] is not None for spec in specs)
        has_qk = any(spec[6] is not None for spec in specs)
        plan.hs_tokens = ids[np.asarray(hs.token_rows, _I64)] if ids is not None and has_hs else None
        plan.qk_tokens = ids[np.asarray(qk.token_rows, _I64)] if ids is not None and has_qk else None
        return plan

    def _grouping(self, hs: Segments, qk: Segments):
        """``(eids, stream ids, index, steering versions, group specs)`` of a step, or None; a steady decode
        step (the same requests and layer sets as the last, no stream started or ended since) reuses the last
        one's."""
        sig = (hs.eids, hs.layer_set, hs.steer_version, hs.layer_sets,
               qk.eids, qk.layer_set, qk.steer_version, qk.layer_sets)
        c = self._grouping_cache
        if (c is not None and c[0] == self._streams_epoch and c[1] == sig
                and self._same_positions_again(c[3], hs, qk)):
            return c[2]
        grouping, both = self._group(hs, qk)
        self._grouping_cache = (self._streams_epoch, sig, grouping, both)
        return grouping

    @staticmethod
    def _same_positions_again(both, hs: Segments, qk: Segments) -> bool:
        """Whether requests with hidden-state and Q/K segments still pair them as the cached grouping did
        (checked for one-row segments only; otherwise the grouping is recomputed)."""
        if both is None:
            return True
        i, j, same = both
        if not ((np.asarray(hs.count)[i] == 1).all() and (np.asarray(qk.count)[j] == 1).all()):
            return False
        now = (np.asarray(hs.positions)[np.asarray(hs.row0)[i]] == np.asarray(qk.positions)[np.asarray(qk.row0)[j]])
        return bool((now == same).all())

    def _group(self, hs: Segments, qk: Segments):
        """Group the step's segments by (part, hs layers, Q/K layers, Q/K heads)."""
        streams = self._streams
        index: dict[str, int] = {}
        eids: list[str] = []
        versions: list[int] = []
        hs_of: dict[int, int] = {}
        for i, eid in enumerate(hs.eids):
            if eid in streams:
                r = len(eids)
                index[eid] = r
                eids.append(eid)
                versions.append(hs.steer_version[i])
                hs_of[r] = i
        qk_of: dict[int, int] = {}
        for j, eid in enumerate(qk.eids):
            if eid in streams:
                r = index.get(eid)
                if r is None:
                    r = index[eid] = len(eids)
                    eids.append(eid)
                    versions.append(qk.steer_version[j])
                qk_of[r] = j
        if not eids:
            return None, None
        sids = [streams[eid].stream_id for eid in eids]
        keys: dict[tuple, list] = {}  # key -> [request indices, hs segments, qk segments]
        both: list[tuple] = []
        if not qk_of:  # hidden states only (the common case): one group per layer set
            for r, i in hs_of.items():
                g = keys.setdefault((0, hs.layer_set[i], -1, None), [[], [], None])
                g[0].append(r)
                g[1].append(i)
        else:
            for r, eid in enumerate(eids):
                i, j = hs_of.get(r), qk_of.get(r)
                heads = streams[eid].qk_heads if j is not None else None
                same = i is not None and j is not None and self._same_positions(hs, i, qk, j)
                if i is not None and j is not None:
                    both.append((i, j, same))
                if i is not None and j is not None and not same:
                    self._add(keys, (0, hs.layer_set[i], -1, None), r, i, None)
                    self._add(keys, (1, -1, qk.layer_set[j], heads), r, None, j)
                else:
                    self._add(keys, (0, hs.layer_set[i] if i is not None else -1,
                                     qk.layer_set[j] if j is not None else -1, heads), r, i, j)
        specs = [(part, hs.layer_sets[hs_ls] if hs_ls >= 0 else None, qk.layer_sets[qk_ls] if qk_ls >= 0 else None,
                  heads, np.asarray(req, _I64), None if hs_seg is None else np.asarray(hs_seg, _I64),
                  None if qk_seg is None else np.asarray(qk_seg, _I64))
                 for (part, hs_ls, qk_ls, heads), (req, hs_seg, qk_seg) in keys.items()]
        pairs = tuple(np.asarray(x) for x in zip(*both)) if both else None
        return (eids, sids, index, versions, specs), pairs

    @staticmethod
    def _add(keys: dict, key: tuple, r: int, i: int | None, j: int | None) -> None:
        g = keys.get(key)
        if g is None:
            g = keys[key] = [[], None if i is None else [], None if j is None else []]
        g[0].append(r)
        if i is not None:
            g[1].append(i)
        if j is not None:
            g[2].append(j)

    @staticmethod
    def _same_positions(hs: Segments, i: int, qk: Segments, j: int) -> bool:
        n = hs.count[i]
        if n != qk.count[j]:
            return False
        a, b = hs.row0[i], qk.row0[j]
        return bool(np.array_equal(hs.positions[a:a + n], qk.positions[b:b + n]))

    # ---------------------------------------------------------------- building the message
    @staticmethod
    def _seg_arrays(seg: Segments, picked: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return np.asarray(seg.row0, _I64)[picked], np.asarray(seg.count, _I64)[picked]

    def _group_positions(self, plan: _StepPlan, g: _Group, mask: np.ndarray) -> np.ndarray:
        seg, picked = (plan.hs, g.hs_seg) if g.hs_seg is not None else (plan.qk, g.qk_seg)
        row0, count = self._seg_arrays(seg, picked[mask])
        return np.asarray(seg.positions, _I64)[_runs(row0, count)]

    def _host(self, plan: _StepPlan, name: str) -> tuple[np.ndarray, tuple] | None:
        part = plan.parts.get(name)
        if part is None:
            return None
        off, layers, rows, width = part
        cfg = self.cfg
        arr = self.ring.view(off, len(layers) * rows * width).view(self._np_dtype)
        arr = arr.reshape(len(layers), rows, width // cfg.itemsize)
        if name != "hs":
            arr = arr.reshape(len(layers), rows, -1, cfg.head_dim)
        return arr, layers

    def _build(self, plan: _StepPlan, masks: list):
        """``(StepBatch with seqs unset, its tensors that view the host ring, request frames, tensor bytes)``
        of the plan's segments that ``masks`` keeps (one boolean mask per group); None when it keeps none."""
        cfg = self.cfg
        used = np.zeros(len(plan.eids), dtype=bool)
        for g, m in zip(plan.groups, masks):
            used[g.req[m]] = True
        if not used.any():
            return None
        if used.all():
            new_index, request_ids, versions = None, plan.sids, plan.versions
        else:
            new_index = np.cumsum(used) - 1
            keep = np.flatnonzero(used).tolist()
            request_ids = [plan.sids[r] for r in keep]
            versions = [plan.versions[r] for r in keep]
        raw_hosts = {name: self._host(plan, name) for name in ("hs", "q", "k")}
        raw_hosts["dtype"] = cfg.wire_dtype
        groups, views, frames, nbytes, quantized = [], [], 0, 0, {}
        for g, m, fmt in by_format(plan.groups, masks, plan.formats):
            if not m.any():
                continue
            hosts = raw_hosts
            if fmt:  # capture.quantize: the rows and per-row scales of that format's parts
                hosts = quantized.get(fmt) or quantized.setdefault(
                    fmt, quantized_hosts(self.ring, plan.parts, fmt, cfg.head_dim))
            primary_hs = g.hs_seg is not None
            seg, picked = (plan.hs, g.hs_seg[m]) if primary_hs else (plan.qk, g.qk_seg[m])
            row0, count = self._seg_arrays(seg, picked)
            rows = _runs(row0, count)
            positions = np.asarray(seg.positions, _I64)[rows]
            tokens = plan.hs_tokens if primary_hs else plan.qk_tokens
            tensors = []
            if primary_hs and hosts["hs"] is not None:
                data, view = self._take(hosts["hs"], g.hs_layers, rows)
                tensors.append(Tensor("hs", hosts["dtype"], data.shape, data, g.hs_layers,
                                      scale=row_scale(hosts, "hs", g.hs_layers, rows, self._take)))
                if view:
                    views.append(tensors[-1])
            if g.qk_seg is not None:
                qk_rows = rows
                if primary_hs:
                    qk_rows = _runs(*self._seg_arrays(plan.qk, g.qk_seg[m]))
                for t, view in self._qk_tensors(hosts, g, qk_rows):
                    tensors.append(t)
                    if view:
                        views.append(t)
            groups.append(RowGroup(g.req[m] if new_index is None else new_index[g.req[m]], count, positions, tensors,
                                   None if tokens is None else tokens[rows], g.part))
            frames += int(m.sum())
            nbytes += sum(t.nbytes for t in tensors)
        pub = self.publisher
        batch = StepBatch(pub.producer_id, pub.epoch, plan.step, request_ids, np.zeros(len(request_ids), _I64),
                          groups, versions, plan.time_ns)
        return batch, views, frames, nbytes

    @staticmethod
    def _take(host: tuple, layers: tuple, rows, heads: np.ndarray | None = None) -> tuple[np.ndarray, bool]:
        """``host``'s rows ``rows`` (a slice or an index array) at ``layers`` (and local ``heads``, dim 2):
        ``(array, whether it is a view of the ring)``; anything but slices is one gathering copy."""
        arr, part_layers = host
        index = [_layer_index(part_layers, layers), rows] + ([heads] if heads is not None else [])
        gathered = [not isinstance(x, slice) for x in index]
        if not any(gathered):
            return arr[tuple(index)], True
        if sum(gathered) > 1:  # numpy would pair several index arrays up: an outer product instead
            index = [np.arange(x.start, x.stop) if isinstance(x, slice) else x for x in index]
            return arr[np.ix_(*index)], False
        return arr[tuple(index)], False

    def _qk_tensors(self, hosts: dict, g: _Group, rows) -> list[tuple[Tensor, bool]]:
        """The group's ``q`` and ``k`` of this rank's heads, each with whether it views the ring."""
        cfg = self.cfg
        out = []
        heads = np.asarray(g.heads, _I64)
        group = cfg.num_heads // cfg.num_kv_heads
        kv_heads = np.unique(heads // group)
        for name, wanted, local in (("q", heads, cfg.local_heads), ("k", kv_heads, cfg.local_kv_heads)):
            host = hosts[name]
            if host is None:
                continue
            lo, hi = cfg.tp_rank * local, (cfg.tp_rank + 1) * local
            mine = np.nonzero((wanted >= lo) & (wanted < hi))[0]
            data, view = self._take(host, g.qk_layers, rows, None if mine.size == local else wanted[mine] - lo)
            shard = None
            if cfg.tp_size > 1:
                start = int(mine[0]) if mine.size else int(np.searchsorted(wanted, lo))
                shard = Shard(cfg.tp_rank, cfg.tp_size, 2, start, start + int(mine.size), int(wanted.size))
            out.append((Tensor(name, hosts["dtype"], data.shape, data, g.qk_layers, shard,
                               row_scale(hosts, name, g.qk_layers, rows, self._take),
                               meta={"heads": [int(h) for h in wanted[mine]]}), view))
        return out
