"""What the monitor page shows, aggregated on the server: per request its tokens, scores, alerts, per-layer
hidden-state norms and drop counts; never a tensor. The page gets only these (small) records.

Every record carries its timeline time ``tau`` (ns): tokens and frames their producer's ``time_ns``, analysis
rows the ``source_time_ns`` of the frames they were computed from (so a score lines up with its token), starts,
ends and gaps their own ``time_ns``. A recording is shown "as of" a timeline tick: one tick per (producer, engine
step), at the latest ``tau`` of that step's tokens and frames; the view at a tick holds every record with
``tau`` at or before it. A live view holds everything. A message without a time (``time_ns`` 0, e.g. from a
synthetic producer) takes the time it was received (live) or the previous message's time (recording).

What a producer sends is made JSON-safe and bounded here, at intake (``_safe``: bytes, NaN, non-string keys,
deep nesting and oversized values in tags, names and error strings), so every view built from the state can be
served as strict JSON; what was altered is counted (``counters["unsafe_*"]``).

Thread model: the ingest thread calls the ``on_*`` methods, the server's event loop calls ``rows`` / ``detail``;
both hold ``lock``. ``on_change`` (set by the server) is called after every change, from the ingest thread.
"""

from __future__ import annotations

import bisect
import collections
import math
import threading
import time
from typing import Any, Callable

import numpy as np

from mia_stream.monitor import _safe
from mia_stream.monitor._detok import PieceDecoder, Tokenizers
from mia_stream.monitor._scores import choose_score_key, new_score_keys, scalar_column

# a request keeps at most this many positions of per-layer norms (the newest; older ones are dropped, counted)
MAX_NORM_POSITIONS = 4096
# per-layer profiles wider than this are not a "per-layer" value (e.g. a mean hidden state): not shown
MAX_PROFILE_WIDTH = 512
_EMPTY_CURSOR = {"t": 0, "s": 0, "a": 0, "n": 0, "v": -1}


def _round(v: float) -> float | None:
    """4 significant digits (JSON size), None for NaN/inf (JSON has neither)."""
    v = float(v)
    if not math.isfinite(v):
        return None
    return float(f"{v:.4g}")


class RequestRecord:
    """One request as the page sees it."""

    def __init__(self, rid: str, order: int):
        self.rid, self.order = rid, order
        self.started = False  # a StreamStart was seen (else: only analysis results or gaps so far)
        self.tags: dict = {}
        self.model = self.tokenizer_name = ""
        self.producer_id = ""
        self.stream_key: tuple = ()
        self.tp_size = 1
        self.t_start = 0
        self.t_end: int | None = None
        self.finish: str | None = None
        self.end_info: dict = {}
        self.n_prompt = 0
        # tokens, prompt first (tau, step; generated ones only count towards tokens/s)
        self.tok_ids: list[int] = []
        self.tok_pos: list[int] = []
        self.tok_tau: list[int] = []  # non-decreasing (see _mono)
        self.tok_step: list[int] = []
        self.gen_first_tau = 0
        self.pieces: list[str] = []  # text of tok_ids[:len(pieces)] (decoded lazily, for shown requests)
        self.decoder = None
        self.detok_note: str | None = None
        self.scores: list[tuple] = []  # (pos, key, value, tau)
        self.alerts: list[tuple] = []  # (pos, key, text, tau)
        self.totals: dict[str, tuple] = {}  # key -> (value, tau): request-level results (position -1)
        self.top: dict[str, float] = {}  # key -> highest finite score so far (the list's column, live)
        self.norms: list[tuple] = []  # (pos, layers_id, values, tau)
        self.norms_dropped = 0  # entries dropped from the front of ``norms`` (kept bounded)
        self.norms_from: str | None = None  # "frames" (computed here) or the analysis key they come from
        self.gaps: list[tuple] = []  # (count, reason, origin, tau)
        self.lag_ns: int | None = None
        self.version = 0

    # tokens/s of the generated tokens up to index n (of tok_*)
    def tokens_per_s(self, n: int) -> float | None:
        gen = n - self.n_prompt
        if gen < 2:
            return None
        span = self.tok_tau[n - 1] - self.gen_first_tau
        return (gen - 1) * 1e9 / span if span > 0 else None

    def state(self, at: int | None) -> str:
        if not self.started:
            return "no start"
        if self.t_end is not None and (at is None or self.t_end <= at):
            return self.finish or "ended"
        return "running"


class MonitorState:
    """All requests of one source, live or recorded (``recording=True``: keeps every request and the ticks)."""

    def __init__(self, *, recording: bool = False, keep_ended: int = 256, score_key: str | None = None,
                 tokenizer: str | None = None):
        self.recording = recording
        self.tokenizers = Tokenizers(tokenizer, on_loaded=self._tokenizer_loaded)
        self.keep_ended = keep_ended
        self.lock = threading.RLock()
        self.on_change: Callable[[], None] | None = None
        self.requests: dict[str, RequestRecord] = {}
        self._ended: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._order = 0
        self.version = 0
        self.score_keys: list[str] = []  # "analyzer.value" names of per-position scalars, first seen first
        self.profile_keys: list[str] = []  # per-layer vectors from analyzers (e.g. hidden_states.norm)
        self.score_key_pinned = score_key
        self.layer_sets: list[tuple] = []
        self._layer_ids: dict[tuple, int] = {}
        self._ticks: dict[tuple, int] = {}  # (producer, step) -> tau (recording only)
        self._tick_list: list[tuple] | None = None
        self._last_tau = 0
        self.counters: collections.Counter[str] = collections.Counter()
        self.broker_stats: dict | None = None
        self.source_note: str | None = None  # e.g. "loading", an error reading the source
        self.source_problem = False  # the note reports something wrong with the source (shown as such)
        self.loaded = not recording

    # ------------------------------------------------------------------------------------------ helpers

    def _tau(self, t: int, received_ns: int | None = None) -> int:
        """The timeline time of a message stamped ``t`` (0 = unstamped)."""
        if t:
            if self.recording:
                self._last_tau = max(self._last_tau, t)
            return t
        if not self.recording:
            return received_ns or time.time_ns()
        self._last_tau += 1  # keeps arrival order among unstamped messages
        return self._last_tau

    def _touch(self, rec: RequestRecord) -> None:
        rec.version += 1
        self.version += 1

    def _changed(self) -> None:
        cb = self.on_change
        if cb is not None:
            cb()

    def _record(self, rid: str) -> RequestRecord:
        rec = self.requests.get(rid)
        if rec is None:
            rec = self.requests[rid] = RequestRecord(rid, self._order)
            self._order += 1
        return rec

    def _layers_id(self, layers: tuple) -> int:
        i = self._layer_ids.get(layers)
        if i is None:
            i = self._layer_ids[layers] = len(self.layer_sets)
            self.layer_sets.append(layers)
        return i

    @staticmethod
    def _trim_norms(rec: RequestRecord) -> None:
        if len(rec.norms) > MAX_NORM_POSITIONS:
            cut = len(rec.norms) - MAX_NORM_POSITIONS
            del rec.norms[:cut]
            rec.norms_dropped += cut

    def _tick(self, producer: str, step: int, tau: int) -> None:
        if self.recording and step >= 0:
            key = (producer, step)
            if tau > self._ticks.get(key, -1):
                self._ticks[key] = tau
                self._tick_list = None

    @property
    def score_key(self) -> str | None:
        """The score tokens are coloured by unless the page picks another (the monitor's one rule, ``_scores``);
        the page gets it in the overview and does not choose on its own."""
        return choose_score_key(self.score_keys, self.score_key_pinned)

    # ------------------------------------------------------------------------------------------ ingest

    def _tokenizer_loaded(self) -> None:
        with self.lock:
            self.version += 1
        self._changed()

    def on_start(self, start: Any, received_ns: int | None = None) -> None:
        with self.lock:
            rec = self.requests.get(start.request_id)
            if (rec is not None and rec.started and rec.t_end is not None and not start.resent
                    and (start.producer_id, start.epoch) != rec.stream_key):
                self.requests.pop(rec.rid)  # a new request under an ended one's id: it starts over
                self._ended.pop(rec.rid, None)
                self.counters["ids_reused"] += 1
            rec = self._record(start.request_id)
            first = not rec.started
            rec.stream_key = (start.producer_id, start.epoch)
            rec.started = True
            c = self.counters
            tags = _safe.safe(start.tags if isinstance(start.tags, dict) else {"tags": start.tags}, c)
            rec.tags = _safe.fit(tags, _safe.MAX_TAGS_CHARS, c)
            rec.model, rec.tokenizer_name = _safe.text(start.model, c), _safe.text(start.tokenizer, c)
            rec.producer_id, rec.tp_size = _safe.text(start.producer_id, c), start.tp_size
            rec.t_start = rec.t_start or self._tau(start.time_ns, received_ns)
            if first:
                self.tokenizers.lookup(rec.tokenizer_name, rec.model)  # starts loading it, if new
                prompt = list(start.prompt_token_ids)
                rec.n_prompt = len(prompt)
                rec.tok_ids = prompt + rec.tok_ids
                rec.tok_pos = list(range(len(prompt))) + rec.tok_pos
                rec.tok_tau = [rec.t_start] * len(prompt) + rec.tok_tau
                rec.tok_step = [-1] * len(prompt) + rec.tok_step
            self.counters["starts"] += 1
            self._touch(rec)
        self._changed()

    # Tokens, norms and analysis rows come per columnar message (the SDK's batch API): one lock, one clock reading
    # and one notification per message, not per request (cProfile of 61,696 request-steps at 256 requests x 30
    # steps/s: 4.9 s in per-request calls, 2.5 s in these).

    def on_token_columns(self, producer: str, step: int, time_ns: int, rids: list, offsets: list, token_ids: list,
                         positions: list, received_ns: int | None = None) -> None:
        """Request ``rids[j]`` sampled ``token_ids[offsets[j]:offsets[j+1]]`` at those ``positions`` (empty:
        the positions after its last one)."""
        with self.lock:
            tau = self._tau(time_ns, received_ns)
            self._tick(producer, step, tau)
            lag = received_ns - time_ns if received_ns and time_ns else None
            total = 0
            for j, rid in enumerate(rids):
                a, b = offsets[j], offsets[j + 1]
                if a == b:
                    continue
                rec = self._record(rid)
                ids, pos = token_ids[a:b], positions[a:b]
                last = rec.tok_pos[-1] if rec.tok_pos else -1
                if not pos:
                    pos = list(range(last + 1, last + 1 + len(ids)))
                elif pos[0] <= last:  # a position already shown (another TP rank's tokens, a duplicate)
                    keep = [i for i, p in enumerate(pos) if p > last]
                    self.counters["tokens_repeated"] += len(pos) - len(keep)
                    if not keep:
                        continue
                    ids, pos = [ids[i] for i in keep], [pos[i] for i in keep]
                tau_m = max(tau, rec.tok_tau[-1]) if rec.tok_tau else tau  # non-decreasing: "as of" is a bisect
                if len(rec.tok_ids) == rec.n_prompt:
                    rec.gen_first_tau = tau_m
                n = len(ids)
                rec.tok_ids += ids
                rec.tok_pos += pos
                rec.tok_tau += [tau_m] * n
                rec.tok_step += [step] * n
                if lag is not None:
                    rec.lag_ns = lag
                total += n
                rec.version += 1
            self.counters["tokens"] += total
            self.version += 1
        self._changed()

    def on_norm_columns(self, producer: str, step: int, time_ns: int, rids: list, offsets: list,
                        positions: np.ndarray, layers: tuple, norms: np.ndarray,
                        received_ns: int | None = None) -> None:
        """A row group's norms ``[L, N]``: request ``rids[j]`` owns rows ``offsets[j]:offsets[j+1]``."""
        rows = np.ascontiguousarray(np.asarray(norms, dtype=np.float32).T)  # [N, L]: one small view per row
        pos = np.asarray(positions).tolist()
        with self.lock:
            tau = self._tau(time_ns, received_ns)
            self._tick(producer, step, tau)
            lid = self._layers_id(tuple(int(x) for x in layers))
            lag = received_ns - time_ns if received_ns and time_ns else None
            for j, rid in enumerate(rids):
                rec = self._record(rid)
                if rec.norms_from != "frames":  # the captured tensors themselves win over an analyzer's norms
                    rec.norms_dropped += len(rec.norms)
                    rec.norms.clear()
                    rec.norms_from = "frames"
                append = rec.norms.append
                for i in range(offsets[j], offsets[j + 1]):
                    append((pos[i], lid, rows[i], tau))
                if len(rec.norms) > MAX_NORM_POSITIONS:
                    self._trim_norms(rec)
                if lag is not None:
                    rec.lag_ns = lag
                rec.version += 1
            self.version += 1
        self._changed()

    def on_analysis_batch(self, b: Any, received_ns: int | None = None) -> None:
        """A whole ``AnalysisBatch``."""
        self.on_analysis_columns(b.analyzer, b.source_time_ns or b.time_ns, b.request_ids, b.offsets.tolist(),
                                 b.positions.tolist(), b.values, b.labels, b.alerts.tolist(), received_ns)

    def on_analysis_columns(self, analyzer: str, time_ns: int, rids: list, offsets: list, positions: list,
                            values: dict, labels: dict, alerts: list, received_ns: int | None = None) -> None:
        """An analyzer's rows: request ``rids[j]`` owns rows ``offsets[j]:offsets[j+1]``. A scalar value per row
        is a score at its position (tokens are coloured by one), at position -1 a request-level result; a
        ``norm`` vector per row (the ``hidden_states`` analyzer) feeds the per-layer plot when the stream's frames
        do not; wider values are not shown (counted)."""
        n = len(positions)
        scalars: dict[str, list] = {}
        profiles: dict[str, np.ndarray] = {}
        for name, arr in values.items():
            arr = np.asarray(arr)
            col = scalar_column(arr, n)
            if arr.shape[:1] != (n,):
                self.counters["analysis_values_malformed"] += 1
            elif col is not None:
                scalars[name] = col.tolist()
            elif arr.ndim == 2 and arr.shape[1] <= MAX_PROFILE_WIDTH:
                profiles[name] = arr.astype(np.float32)
            else:
                self.counters["analysis_values_not_shown"] += 1
        keys = {name: f"{analyzer}.{name}" for name in (*scalars, *profiles)}
        with self.lock:
            tau = self._tau(time_ns, received_ns)
            new_score_keys(self.score_keys, analyzer, scalars, positions)
            for name in profiles:
                if keys[name] not in self.profile_keys:
                    self.profile_keys.append(keys[name])
            for j, rid in enumerate(rids):
                rec = self._record(rid)
                a, b = offsets[j], offsets[j + 1]
                for name, vals in scalars.items():
                    key = keys[name]
                    top = rec.top.get(key, -math.inf)
                    for i in range(a, b):
                        if positions[i] < 0:
                            rec.totals[key] = (vals[i], tau)
                        else:
                            rec.scores.append((positions[i], key, vals[i], tau))
                            if vals[i] > top:  # (False for NaN)
                                top = rec.top[key] = vals[i]
                prof = profiles.get("norm")
                if prof is not None and rec.norms_from in (None, keys["norm"]):
                    rec.norms_from = keys["norm"]
                    lid = self._layers_id(tuple(range(prof.shape[1])))
                    rec.norms += [(positions[i], lid, prof[i], tau) for i in range(a, b) if positions[i] >= 0]
                    self._trim_norms(rec)
                for i in range(a, b):
                    if alerts[i]:
                        parts = [f"{k}={v[i]:.4g}" for k, v in scalars.items()]
                        parts += [f"{k}={v[i]}" for k, v in labels.items() if i < len(v) and v[i] is not None]
                        rec.alerts.append((positions[i], _safe.text(analyzer, self.counters),
                                           _safe.text(", ".join(parts), self.counters), tau))
                rec.version += 1
            self.counters["analysis_rows"] += n
            self.version += 1
        self._changed()

    def on_gap(self, gap: Any, received_ns: int | None = None) -> None:
        with self.lock:
            rec = self._record(gap.request_id)
            tau = self._tau(gap.time_ns, received_ns)
            rec.gaps.append((int(gap.count), _safe.text(gap.reason, self.counters) or "?",
                             _safe.text(gap.origin, self.counters) or "?", tau))
            self.counters["gap_seqs"] += int(gap.count)
            self._touch(rec)
        self._changed()

    def on_end(self, end: Any, received_ns: int | None = None) -> None:
        with self.lock:
            rec = self._record(end.request_id)
            rec.t_end = max(self._tau(end.time_ns, received_ns), rec.tok_tau[-1] if rec.tok_tau else 0)
            c = self.counters
            rec.finish = _safe.text(end.finish_reason, c) if end.finish_reason is not None else None
            rec.end_info = _safe.safe({"generated": end.num_generated_tokens, "frames_sent": end.frames_sent,
                                       "frames_dropped": end.frames_dropped, "drops": dict(end.drops or {}),
                                       "error": end.error}, c)
            self.counters["ends"] += 1
            self._touch(rec)
            if not self.recording:
                self._ended[rec.rid] = None
                while len(self._ended) > self.keep_ended:
                    old, _ = self._ended.popitem(last=False)
                    self.requests.pop(old, None)
                    self.counters["forgotten"] += 1
        self._changed()

    def set_broker_stats(self, stats: dict | None, note: str | None = None) -> None:
        with self.lock:
            self.broker_stats = _safe.safe(summarize_broker_stats(stats, note), self.counters, nodes=1 << 16)
            self.version += 1
        self._changed()

    def set_source_note(self, note: str | None, loaded: bool | None = None, problem: bool = False) -> None:
        with self.lock:
            self.source_note, self.source_problem = note, problem
            if loaded is not None:
                self.loaded = loaded
            self.version += 1
        self._changed()

    # ------------------------------------------------------------------------------------------ views

    def ticks(self) -> list[tuple]:
        """Recording timeline: (tau, step, producer) per engine step, in time order."""
        with self.lock:
            if self._tick_list is None:
                self._tick_list = sorted((tau, step, prod) for (prod, step), tau in self._ticks.items())
            return self._tick_list

    def visible(self, at: int | None) -> list[RequestRecord]:
        """Requests shown at ``at`` (None: now), newest first."""
        recs = [r for r in self.requests.values() if at is None or (r.started and r.t_start <= at)
                or (not r.started and (r.tok_tau or r.gaps or r.scores))]
        recs.sort(key=lambda r: -r.order)
        return recs

    def row(self, rec: RequestRecord, at: int | None) -> list:
        """[id, tags, state, prompt tokens, generated, tokens/s, drops, lag ms, alerts, max score, arrival order]."""
        n = len(rec.tok_ids) if at is None else bisect.bisect_right(rec.tok_tau, at)
        key = self.score_key
        top = None
        drops = 0
        for c, _r, _o, tau in rec.gaps:
            if at is None or tau <= at:
                drops += c
        alerts = sum(1 for x in rec.alerts if at is None or x[3] <= at)
        if key is not None and at is None:
            top = _round(rec.top[key]) if key in rec.top else None
        elif key is not None:
            vals = [v for _p, k, v, tau in rec.scores if k == key and tau <= at and math.isfinite(v)]
            if vals:
                top = _round(max(vals))
        tps = rec.tokens_per_s(n)
        lag = None if rec.lag_ns is None or self.recording else round(rec.lag_ns / 1e6, 1)
        tags = " ".join(f"{k}={v}" for k, v in rec.tags.items())
        return [rec.rid, tags, rec.state(at), min(n, rec.n_prompt), max(0, n - rec.n_prompt),
                None if tps is None else round(tps, 1), drops, lag, alerts, top, rec.order]

    def detail(self, rec: RequestRecord, at: int | None, cursor: dict | None) -> tuple[dict, dict]:
        """What the page needs for the chosen request: what is new since ``cursor`` (None: everything) and the
        cursor to pass next time. With ``at`` (a recording's tick) always everything up to that time."""
        n = len(rec.tok_ids) if at is None else bisect.bisect_right(rec.tok_tau, at)
        keep = (lambda tau: True) if at is None else (lambda tau: tau <= at)
        as_ids = False
        if rec.decoder is None:
            tok, note, final = self.tokenizers.lookup(rec.tokenizer_name, rec.model)
            rec.detok_note = note if tok is not None or not final else f"{note}: showing token ids"
            if final:
                rec.decoder = PieceDecoder(tok)
            else:  # its tokenizer is still loading (0.3-1.5 s for SmolLM2's on the shared 2-core machine): the
                as_ids = True  # tokens go out as ids now, not held back, and again as text once it has loaded
        if not as_ids and len(rec.pieces) < n:
            rec.pieces.extend(rec.decoder.extend(rec.tok_ids[len(rec.pieces):]))
        full = at is not None or cursor is None or cursor["t"] > n or (cursor.get("ids", False) and not as_ids)
        cur = _EMPTY_CURSOR if full else cursor
        out: dict = {"id": rec.rid, "reset": full}
        piece = (lambda i: f"#{rec.tok_ids[i]} ") if as_ids else rec.pieces.__getitem__
        out["tokens"] = [[rec.tok_pos[i], piece(i), rec.tok_tau[i] // 1_000_000, rec.tok_step[i],
                          1 if i < rec.n_prompt else 0] for i in range(cur["t"], n)]
        out["scores"] = [[p, k, _round(v), tau // 1_000_000] for p, k, v, tau in rec.scores[cur["s"]:] if keep(tau)]
        out["alerts"] = [[p, k, text, tau // 1_000_000] for p, k, text, tau in rec.alerts[cur["a"]:] if keep(tau)]
        first_norm = max(0, cur["n"] - rec.norms_dropped)  # cursor["n"] counts entries ever appended
        out["norms"] = [[p, lid, [_round(x) for x in vals.tolist()]]
                        for p, lid, vals, tau in rec.norms[first_norm:] if keep(tau)]
        out["layer_sets"] = {str(lid): list(self.layer_sets[lid]) for lid in {x[1] for x in out["norms"]}}
        if full or rec.version != cur["v"]:
            drops: collections.Counter[str] = collections.Counter()
            for c, reason, origin, tau in rec.gaps:
                if keep(tau):
                    drops[f"{reason} ({origin})"] += c
            state = rec.state(at)
            tps = rec.tokens_per_s(n)
            out["info"] = {"state": state, "tags": rec.tags, "model": rec.model, "tokenizer": rec.tokenizer_name,
                           "detok_note": rec.detok_note, "prompt_tokens": rec.n_prompt,
                           "generated": max(0, n - rec.n_prompt),
                           "tokens_per_s": None if tps is None else round(tps, 1),
                           "drops": sum(drops.values()), "drop_reasons": dict(drops),
                           "norms_dropped": rec.norms_dropped, "norms_from": rec.norms_from,
                           "end": rec.end_info if state not in ("running", "no start") else None,
                           "totals": {k: _round(v) for k, (v, tau) in rec.totals.items() if keep(tau)},
                           "lag_ms": None if rec.lag_ns is None or self.recording else round(rec.lag_ns / 1e6, 1),
                           "tp_size": rec.tp_size, "producer": rec.producer_id}
        new_cursor = {"t": n, "s": len(rec.scores), "a": len(rec.alerts), "n": rec.norms_dropped + len(rec.norms),
                      "v": rec.version, "ids": as_ids}
        return out, new_cursor

    def overview(self, at: int | None) -> dict:
        """Counters for the page header: requests live/ended, score keys, broker stats."""
        recs = self.visible(at)
        running = sum(1 for r in recs if r.state(at) == "running")
        return {"requests": len(recs), "running": running, "score_keys": list(self.score_keys),
                "score_key": self.score_key, "profile_keys": list(self.profile_keys),
                "broker": self.broker_stats, "counters": dict(self.counters), "note": self.source_note,
                "note_is_problem": self.source_problem, "loaded": self.loaded}


def summarize_broker_stats(stats: dict | None, note: str | None = None) -> dict | None:
    """The broker stats the page shows (throughput, drops; not the per-stream table, which can be huge)."""
    if stats is None:
        return {"error": note} if note else None
    totals = stats.get("totals", {})
    producers = {name: {"frames_per_s": round(p.get("frames_per_s", 0.0), 1),
                        "bytes_per_s": round(p.get("bytes_per_s", 0.0)), "messages": p.get("messages", 0),
                        "open_streams": p.get("open_streams", 0), "gaps_reported": p.get("gaps_reported", 0)}
                 for name, p in stats.get("producers", {}).items()}
    consumers = {name: {"delivered": c.get("delivered", 0), "dropped": c.get("dropped", 0),
                        "queue_messages": c.get("queue_messages", 0), "queue_bytes": c.get("queue_bytes", 0),
                        "gaps_notified": c.get("gaps_notified", 0)}
                 for name, c in stats.get("consumers", {}).items()}
    drops = {k: v for k, v in totals.items() if "drop" in k or "malformed" in k or "gap" in k or "lost" in k}
    return {"time_ms": stats.get("broker", {}).get("time_ns", 0) // 1_000_000,
            "uptime_s": round(stats.get("broker", {}).get("uptime_s", 0.0)),
            "frames_per_s": round(sum(p["frames_per_s"] for p in producers.values()), 1),
            "bytes_per_s": sum(p["bytes_per_s"] for p in producers.values()),
            "producers": producers, "consumers": consumers, "drops": drops,
            "streams": len(stats.get("streams", {})), "error": note}
