"""In-engine detectors, the worker's side: which token rows each request's detectors score at which layer, and the
step's scores back on the host.

Owns (one ``DetectorRouting`` per producer runtime): each streamed request's detectors (``_Detector``: its column
in the score buffer, probe slot, layer, positions, bias), the probe table's slots (``_device._ProbeTable``), the
per-layer routing slab ``probe_route`` it writes before each forward, the step's scored pairs, and the pinned host
copies of ``probe_out``. The forward pass computes ``probe_out[t, k] = x_t . v_k`` in-graph
(``kernels.ops.project``); ``take`` turns the copied values into risks, ``sigmoid(x . v + c)``, the probe file's
formula with its standardization folded in (``LinearProbe.folded``), and hands them to the engine core with the
step's output (``DetectScores``), where the alert policy runs (``_detect_engine``).

A steady decode step (the same requests as the last step, one generated token each, nothing reconfigured) reuses the
last step's routing: the device slab is unchanged and only the positions advance, so the per-step host cost does
not grow with per-request Python.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import torch

from mia_stream.producer._device import _ProbeTable
from mia_stream.producer._routing import hits, select
from mia_stream.spec.probes import sigmoid


class DetectScores(NamedTuple):
    """One step's in-engine scores (what rides on the step's ModelRunnerOutput to the engine core; pickled there
    when the worker is another process)."""

    step: int
    eids: list  # engine request id of each scored row
    cols: np.ndarray  # int64: the detector's index in the request's spec ``detect`` list
    positions: np.ndarray  # int64: the token position scored (the row computed while token p is the input)
    risk: np.ndarray  # float64: sigmoid(x . v + c)
    time_ns: int  # when the scores were on the host


@dataclass
class _Detector:
    col: int
    slot: int
    layer: int
    positions: str
    bias: float
    digest: str
    featw: np.ndarray | None = None  # weights of the logit features (LOGIT_FEATURES order), None: reads none


@dataclass
class _Steady:
    req_ids: list
    epoch: int
    plens: np.ndarray
    eids: list
    cols: np.ndarray
    token_rows: np.ndarray
    bias: np.ndarray
    featw: np.ndarray | None
    feat_eids: list
    feat_rows: np.ndarray
    reqs: list = field(default_factory=list)  # the cached requests (their next position catches up on leaving)
    last: np.ndarray | None = None


class DetectorRouting:
    def __init__(self, state: Any, slots: int, columns: int, num_layers: int, max_tokens: int,
                 device: torch.device):
        self.state, self.columns, self.num_layers = state, columns, num_layers
        self.table = _ProbeTable(state, slots)
        self.device = device
        self._steady: _Steady | None = None
        self._step: tuple | None = None  # this step's (eids, cols, token_rows, positions, bias)
        self._pending: list = []  # (step, eids, cols, token_rows, positions, bias, host values or (buffer, event))
        self._pinned = [torch.empty((max_tokens, columns), dtype=torch.float32, pin_memory=True)
                        for _ in range(3)] if device.type == "cuda" else []
        self._turn = 0
        self.host_route: np.ndarray | None = None  # the slab to upload for this step (None: unchanged / cleared)
        self._folded: dict[str, tuple] = {}  # probe digest -> (v, c, logit feature weights or None)
        # logit features (a probe's "logit_features"): requests that read them, each step's sampled positions of
        # those requests, the sampling statistics not yet read, and each request's newest ones
        self.feature_requests = 0
        self.current_step, self._batch_req_ids = -1, []
        self._sampled: dict[int, tuple] = {}  # step -> (engine ids, position of the token each sampled)
        self._stats_pending: list = []  # (step, engine ids in the sampler's row order, values or (buf, event))
        self._last_stats: dict[str, tuple] = {}  # engine id -> (position, logprob, entropy)

    # ------------------------------------------------------------------------------- request lifetime
    def add(self, req: Any, spec_detect: tuple) -> None:
        """Give each of the request's detectors a probe slot (refusals counted in ``req.drops``)."""
        req.detectors = []
        for col, det in enumerate(spec_detect[: self.columns]):
            folded = self._folded.get(det.digest)
            if folded is None:  # once per probe file, not per request (0.7 % of a loaded engine core's samples)
                if len(self._folded) >= 1024:
                    self._folded.pop(next(iter(self._folded)))
                v, c = det.probe.folded(np.float32)
                u, d = det.probe.logit_feature_weights()
                folded = self._folded[det.digest] = (v, c + d, u if det.probe.logit_features else None)
            v, c, featw = folded
            slot = self.table.acquire(det.digest, v)
            if slot is None:
                req.drops["probe_table_full"] = req.drops.get("probe_table_full", 0) + 1
                continue
            req.detectors.append(_Detector(col, slot, det.probe.layer, det.positions, c, det.digest, featw))
        if any(d.featw is not None for d in req.detectors):
            self.feature_requests += 1
        if len(spec_detect) > self.columns:
            req.drops["detectors_over_limit"] = len(spec_detect) - self.columns

    def release(self, req: Any) -> None:
        dets = getattr(req, "detectors", ())
        if any(d.featw is not None for d in dets):
            self.feature_requests -= 1
        self._last_stats.pop(req.engine_id, None)
        for d in dets:
            self.table.release(d.digest, d.slot)
        req.detectors = []

    # ------------------------------------------------------------------------------- per step
    def route(self, batch: Any, requests: dict, epoch: int) -> bool:
        """This step's scored pairs and routing slab (``host_route``); False when no row is scored and the slab
        needs no change."""
        self.host_route = None
        self.current_step, self._batch_req_ids = batch.step, batch.req_ids
        s = self._steady
        n = batch.num_tokens
        if (s is not None and s.epoch == epoch and batch.req_ids == s.req_ids and n == len(s.req_ids)
                and np.array_equal(batch.query_start, np.arange(n + 1)) and (batch.num_computed >= s.plens).all()):
            computed = np.asarray(batch.num_computed, np.int64)
            s.last = computed
            self._step = (s.eids, s.cols, s.token_rows, computed[s.token_rows], s.bias, s.featw)
            if s.feat_eids:
                self._sampled[batch.step] = (s.feat_eids, computed[s.feat_rows] + 1)
            return bool(len(s.eids))
        self._leave_steady()
        qs, computed = batch.query_start.tolist(), batch.num_computed.tolist()
        eids, cols, rows, positions, bias, layers, slots, featw = [], [], [], [], [], [], [], []
        feat_eids, feat_rows, feat_pos = [], [], []
        all_decode, plens, reqs = True, np.zeros(len(batch.req_ids), np.int64), []
        for i, eid in enumerate(batch.req_ids):
            req = requests.get(eid)
            dets = getattr(req, "detectors", None) if req is not None else None
            a, b = qs[i], qs[i + 1]
            if not dets or b <= a:
                all_decode = all_decode and b - a == 1
                continue
            first, plen = computed[i], req.prompt_len
            plens[i] = plen
            decode = b - a == 1
            all_decode = all_decode and decode and first >= plen
            reqs.append((req, i))
            if any(d.featw is not None for d in dets):  # the position of the token this step samples for it
                feat_eids.append(eid)
                feat_rows.append(i)
                feat_pos.append(first + (b - a))
            next_pos = req.next_pos[2]
            for d in dets:
                if decode:
                    if first < next_pos or not hits(d.positions, first, plen):
                        continue
                    sel_rows, sel_pos = np.asarray([a]), np.asarray([first])
                else:
                    sel = select(np.arange(first, first + (b - a)), d.positions, plen, next_pos)
                    if not sel.size:
                        continue
                    sel_rows, sel_pos = a + sel, first + sel
                m = len(sel_rows)
                eids.extend([eid] * m)
                cols.append(np.full(m, d.col, np.int64))
                rows.append(sel_rows)
                positions.append(sel_pos)
                bias.append(np.full(m, d.bias, np.float64))
                layers.append(np.full(m, d.layer, np.int64))
                slots.append(np.full(m, d.slot, np.int32))
                featw.append(np.tile(d.featw if d.featw is not None else np.full(2, np.nan), (m, 1)))
            req.next_pos[2] = max(next_pos, first + (b - a))
        if feat_eids:
            self._sampled[batch.step] = (feat_eids, np.asarray(feat_pos, np.int64))
        if not eids:
            self._step = None
            self.host_route = np.zeros((0, 0, 0), np.int32)  # clear what the last step routed
            return False
        cols_a, rows_a = np.concatenate(cols), np.concatenate(rows).astype(np.int64)
        host = np.full((self.num_layers, n, self.columns), -1, np.int32)
        host[np.concatenate(layers), rows_a, cols_a] = np.concatenate(slots)
        self.host_route = host
        fw = np.concatenate(featw)
        fw = None if np.isnan(fw).all() else fw  # NaN rows: detectors that read no logit features
        self._step = (eids, cols_a, rows_a, np.concatenate(positions).astype(np.int64), np.concatenate(bias), fw)
        if all_decode and n == len(batch.req_ids):
            self._steady = _Steady(list(batch.req_ids), epoch, plens, eids, cols_a, rows_a, self._step[4], fw,
                                   feat_eids, np.asarray(feat_rows, np.int64), [r for r, _ in reqs])
        return True

    def _leave_steady(self) -> None:
        s, self._steady = self._steady, None
        if s is not None and s.last is not None:
            for req in s.reqs:  # the positions the cached steps scored are done (dedupes a recompute)
                i = s.req_ids.index(req.engine_id)
                req.next_pos[2] = max(req.next_pos[2], int(s.last[i]) + 1)

    def after_forward(self, step: int, n: int) -> None:
        """Queue the host copy of this step's scores (CUDA: async on the compute stream, into a pinned buffer)."""
        got, self._step = self._step, None
        if got is None:
            return
        out = self.state.probe_out
        if self.device.type == "cuda":
            buf = self._pinned[self._turn]
            self._turn = (self._turn + 1) % len(self._pinned)
            buf[:n].copy_(out[:n], non_blocking=True)
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
            values = (buf, event)
        else:
            values = out[:n].numpy().copy()
        self._pending.append((step, *got, values))

    def take(self, upto_step: int | None = None) -> list[DetectScores]:
        """The scores of the steps up to ``upto_step`` (None: all) whose forward ran since the last call (normally
        one; under async scheduling the next step's forward may be queued already and is left for its own call)."""
        out = []
        if upto_step is None:
            pending, self._pending = self._pending, []
        else:
            pending = [p for p in self._pending if p[0] <= upto_step]
            self._pending = [p for p in self._pending if p[0] > upto_step]
        for step, eids, cols, rows, positions, bias, featw, values in pending:
            if self._stats_pending:
                self._read_stats(step - 1)  # the statistics of the tokens this step's rows are the inputs of
            if isinstance(values, tuple):
                buf, event = values
                event.synchronize()  # the sampler synced already: this returns at once
                values = buf.numpy()
            logit = values[rows, cols].astype(np.float64) + bias
            if featw is not None:
                logit = logit + self._feature_terms(eids, positions, featw)
            out.append(DetectScores(step, list(eids), cols, positions, sigmoid(logit), time.time_ns()))
        if self._stats_pending:
            self._read_stats(upto_step)
        return out

    # ------------------------------------------------------------------------------- logit features
    def distribution_stats(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The raw logits ``[rows, vocab]`` of the step routed last, read before the sampler changes them in place:
        (log-probabilities of the step's rows, their entropies), float32 on the device."""
        with torch.no_grad():
            n = min(len(self._batch_req_ids), logits.shape[0])
            lp = torch.log_softmax(logits[:n].float(), dim=-1)
            return lp, -(lp.exp() * lp).sum(dim=-1)

    def on_logits(self, raw: tuple[torch.Tensor, torch.Tensor], sampled: torch.Tensor) -> None:
        """``distribution_stats`` of the step routed last (a row per request, in the step's order) and its sampled
        token ids: queue each row's log-probability of its sampled token and the entropy of its distribution
        (float32, on the device, copied to the host without a sync). Only while some request reads logit
        features."""
        step, req_ids = self.current_step, self._batch_req_ids
        if not self.feature_requests or step not in self._sampled:
            return
        lp, entropy = raw
        with torch.no_grad():
            n = lp.shape[0]
            chosen = lp.gather(1, sampled[:n].reshape(n, -1)[:, :1].long()).squeeze(1)
            stats = torch.stack([chosen, entropy], dim=1)
        if self.device.type == "cuda":
            buf = torch.empty(stats.shape, dtype=torch.float32, pin_memory=True)
            buf.copy_(stats, non_blocking=True)
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
            self._stats_pending.append((step, list(req_ids[:n]), (buf, event)))
        else:
            self._stats_pending.append((step, list(req_ids[:n]), stats.numpy().copy()))

    def _read_stats(self, upto_step: int | None) -> None:
        keep = []
        for step, ids, values in self._stats_pending:
            if upto_step is not None and step > upto_step:
                keep.append((step, ids, values))
                continue
            if isinstance(values, tuple):
                values[1].synchronize()
                values = values[0].numpy()
            eids, pos = self._sampled.pop(step, ((), ()))
            row_of = {eid: i for i, eid in enumerate(ids)}
            for eid, p in zip(eids, np.asarray(pos).tolist()):
                i = row_of.get(eid)
                if i is not None:
                    self._last_stats[eid] = (p, float(values[i, 0]), float(values[i, 1]))
        self._stats_pending = keep
        for step in [s for s in self._sampled if upto_step is None or s < upto_step - 8]:
            del self._sampled[step]  # steps whose sampler output never came (a preempted or dummy step)

    def _feature_terms(self, eids: list, positions: np.ndarray, featw: np.ndarray) -> np.ndarray:
        """Each row's logit-feature term: the statistics of the token at its position (sampled by the request's
        step before), NaN where the probe reads features but they are unknown (the row is then not scored)."""
        terms = np.zeros(len(eids))
        last = self._last_stats
        for j, (eid, p) in enumerate(zip(eids, positions.tolist())):
            w = featw[j]
            if np.isnan(w[0]):
                continue  # a detector that reads no logit features
            st = last.get(eid)
            terms[j] = st[1] * w[0] + st[2] * w[1] if st is not None and st[0] == p else np.nan
        return terms
