"""What the three hallucination detectors share: a risk score per scored row, aggregated per request as the
request runs, and the ``analysis`` rows every detector publishes under the same value names.

Published values (the contract the monitor and alert policies read; docs/hallucination.md):

every step, one row per scored token (``positions`` = the token's position; the row comes in the step that
computes that token's state, which is the step that samples the next token: one decode step after the token
was sampled)
    ``risk``         float32 in [0, 1], the detector's probability that this token is part of a hallucination
                     (semantic_entropy_probe: that the answer has high semantic entropy)
    ``window_risk``  float32, the mean ``risk`` of the request's last ``window`` scored rows (this one included)
    ``span_risk``    float32, the largest ``risk`` within the current word so far (a word: a token whose text
                     starts with a space, a newline or a non-alphanumeric character begins a new one; without
                     token ids or a tokenizer each token is its own word)
    alert flag       the detector's alert policy (config ``alert``, ``analyzers/_alerts.py``): by default
                     ``risk >= threshold``; debounced (k of the last n tokens), on ``window_risk`` or
                     ``span_risk``, and acting on the first alert (abort, steer) as the config says

at the request's end, one row (position -1, step -1)
    ``answer_risk``  float32, the request's score: ``risk_max``, ``risk_mean`` or ``risk_last`` as the config's
                     ``answer_score`` says (each detector has its default)
    ``risk_max``, ``risk_mean``, ``risk_last``, ``window_max`` float32; ``tokens`` int64 (rows scored)
    alert flag       ``answer_risk >= threshold``

A row whose position the request already scored (a preempted request recomputing its tokens) is skipped, so each
position is scored once. Every reduction is per row or per request (row-wise sums), never across requests: a
request's values are bit-identical whatever shares its steps, live or replayed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from mia_stream.analyzers._alerts import AlertPolicy
from mia_stream.analyzers._base import Analyzer, RequestTable, Results
from mia_stream.analyzers._probe import LinearProbe, load_probe, resolve_probe_path
from mia_stream.errors import AnalyzerConfigError
from mia_stream.schemas import StepBatch, StreamEnd, StreamStart

ANSWER_SCORES = ("max", "mean", "last")
_WORD_MARKS = ("Ġ", "Ċ", "▁", "\n", " ")  # byte-level BPE space/newline, SentencePiece space


def word_starts(tokenizer_file: Path) -> np.ndarray | None:
    """Per token id, whether its text begins a new word (see the module docstring); None without a
    ``tokenizer.json`` (the light ``tokenizers`` library reads it: no ``transformers`` import)."""
    if not tokenizer_file.is_file():
        return None
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_file))
    n = tok.get_vocab_size(with_added_tokens=True)
    out = np.ones(n, bool)
    for i in range(n):
        s = tok.id_to_token(i)
        if s and not s.startswith(_WORD_MARKS) and s[0].isalnum():
            out[i] = False
    return out


class RiskDetector(Analyzer):
    """Base of the detectors: subclasses load their probe (``load``), say what they need, and score rows
    (``score``); this class aggregates and publishes."""

    defaults: dict = {"probe": "", "threshold": None, "window": 4, "answer_score": None, "alert": None}
    default_answer_score = "max"

    # ---------------------------------------------------------------------------------- subclass API
    def load(self, probe: LinearProbe, config: dict) -> None:
        """Check the probe and config beyond the common keys; set ``self._needs``."""

    def score(self, batch: StepBatch, group: Any) -> tuple | None:
        """The rows of ``group`` this detector scores: ``(row_requests, positions, risk float64, extra values
        dict, token_ids or None)``, rows of one request contiguous and in position order; None: none."""
        raise NotImplementedError

    def start_request(self, start: StreamStart) -> None:
        """Per-request set-up after the common checks (default: nothing)."""

    def end_request(self, request_id: str) -> None:
        """Free per-request state of the subclass (default: nothing)."""

    @property
    def caveat(self) -> str:
        """What the probe file says of the detector against the best free baseline on held-out data
        (``metrics.versus_baseline``), printed where the detector starts: a user reads it before trusting an
        alert. Empty when the file says nothing."""
        v = self.probe.metrics.get("versus_baseline") if isinstance(self.probe.metrics, dict) else None
        return v if isinstance(v, str) else ""

    # ---------------------------------------------------------------------------------- Analyzer
    def configure(self, config: dict) -> None:
        probe = load_probe(resolve_probe_path(config["probe"], f"{self.name} config"), self.name)
        self.probe = probe
        thr = probe.threshold if config["threshold"] is None else config["threshold"]
        if isinstance(thr, bool) or not isinstance(thr, (int, float)) or not 0 <= thr <= 1:
            raise AnalyzerConfigError(f"{self.name} config: 'threshold' must be a probability in [0, 1], got {thr!r}")
        self.threshold = float(thr)
        window = config["window"]
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise AnalyzerConfigError(f"{self.name} config: 'window' must be a positive integer, got {window!r}")
        self.window = window
        answer = config["answer_score"] or probe.extra.get("answer_score") or self.default_answer_score
        if answer not in ANSWER_SCORES:
            raise AnalyzerConfigError(f"{self.name} config: 'answer_score' must be one of {list(ANSWER_SCORES)}, "
                                      f"got {answer!r}")
        self.answer_score = answer
        self.table = RequestTable(count=((), np.int64), total=((), np.float64), top=((), np.float64),
                                  last=((), np.float64), next_pos=((), np.int64), ring=((window,), np.float64),
                                  window_top=((), np.float64), span_top=((), np.float64))
        self._word_starts: dict[str, np.ndarray | None] = {}
        self._request_words: dict[str, np.ndarray | None] = {}
        self.load(probe, config)
        # issue 15 part B: the per-token alerts come from the shared policy (default: risk >= threshold)
        self.alert_policy = AlertPolicy.for_analyzer(config.get("alert"), f"{self.name} config",
                                                     threshold=self.threshold,
                                                     values=("risk", "window_risk", "span_risk"))

    def needs(self):
        return self._needs

    def on_start(self, start: StreamStart) -> None:
        super().on_start(start)
        self.probe.check_stream(start)
        key = start.tokenizer or start.model
        if key not in self._word_starts:
            self._word_starts[key] = word_starts(Path(key) / "tokenizer.json") if key else None
        self._request_words[start.request_id] = self._word_starts[key]
        self.start_request(start)

    def on_batch(self, batch: StepBatch, out: Results) -> None:
        for g in batch.groups:
            if not g.num_rows:
                continue
            scored = self.score(batch, g)
            if scored is not None and len(scored[2]):
                self._aggregate(batch.request_ids, *scored, out)

    def on_end(self, request_id: str, end: StreamEnd | None, out: Results) -> None:
        self.alert_policy.release(request_id)
        slot = self.table.slot(request_id)
        self._request_words.pop(request_id, None)
        self.end_request(request_id)
        if slot is None:
            return
        t = self.table
        n = int(t["count"][slot])
        if end is not None and n:
            values = {"risk_max": t["top"][slot], "risk_mean": t["total"][slot] / n, "risk_last": t["last"][slot],
                      "window_max": t["window_top"][slot]}
            answer = values[f"risk_{self.answer_score}"]
            values = {k: np.float32(v) for k, v in values.items()}
            values["answer_risk"] = np.float32(answer)
            values["tokens"] = np.int64(n)
            out.add_one(request_id, values, alert=bool(values["answer_risk"] >= self.threshold))
        t.release(request_id)

    # ---------------------------------------------------------------------------------- aggregation
    def _aggregate(self, ids: list, row_requests: np.ndarray, positions: np.ndarray, risk: np.ndarray,
                   extra: dict, token_ids: Any, out: Results) -> None:
        n = len(risk)
        t = self.table
        # k-th row of its request in this group: rows of one request are contiguous, so each pass over one k
        # touches each request at most once and updates all of them at once (decode steps: one pass)
        first = np.r_[0, np.flatnonzero(np.diff(row_requests)) + 1]
        k = np.arange(n) - np.repeat(first, np.diff(np.r_[first, n]))
        slots = t.slots([ids[i] for i in row_requests[first].tolist()])
        row_slots = np.repeat(slots, np.diff(np.r_[first, n]))
        starts = self._starts(ids, row_requests, token_ids)
        keep = np.zeros(n, bool)
        window_risk = np.zeros(n)
        span_risk = np.zeros(n)
        for kk in range(int(k.max()) + 1):
            rows = np.flatnonzero(k == kk)
            s = row_slots[rows]
            fresh = positions[rows] >= t["next_pos"][s]  # a recomputed position was scored already
            rows, s = rows[fresh], s[fresh]
            if not len(rows):
                continue
            r = risk[rows]
            keep[rows] = True
            c = t["count"][s]
            t["ring"][s, c % self.window] = r
            c = c + 1
            t["count"][s] = c
            t["total"][s] += r
            t["top"][s] = np.where(c == 1, r, np.maximum(t["top"][s], r))
            t["last"][s] = r
            t["next_pos"][s] = positions[rows] + 1
            w = t["ring"][s].sum(axis=1) / np.minimum(c, self.window)
            window_risk[rows] = w
            t["window_top"][s] = np.where(c == 1, w, np.maximum(t["window_top"][s], w))
            sp = np.where(starts[rows], r, np.maximum(t["span_top"][s], r))
            t["span_top"][s] = sp
            span_risk[rows] = sp
        if not keep.all():
            row_requests, positions, risk = row_requests[keep], positions[keep], risk[keep]
            window_risk, span_risk = window_risk[keep], span_risk[keep]
            extra = {name: v[keep] for name, v in extra.items()}
        if not len(risk):
            return
        values = {"risk": risk.astype(np.float32), "window_risk": window_risk.astype(np.float32),
                  "span_risk": span_risk.astype(np.float32), **extra}
        out.add(ids, row_requests, positions, values, alerts=self.alert_policy.judge(ids, row_requests, values))

    def _starts(self, ids: list, row_requests: np.ndarray, token_ids: Any) -> np.ndarray:
        """Per row, whether its token begins a word (True where unknown)."""
        n = len(row_requests)
        if token_ids is None:
            return np.ones(n, bool)
        token_ids = np.asarray(token_ids, np.int64)
        out = np.ones(n, bool)
        for i in np.unique(row_requests).tolist():
            table = self._request_words.get(ids[i])
            if table is None:
                continue
            rows = row_requests == i
            tid = token_ids[rows]
            ok = (tid >= 0) & (tid < len(table))
            out[rows] = np.where(ok, table[np.clip(tid, 0, len(table) - 1)], True)
        return out
