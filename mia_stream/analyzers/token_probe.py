"""``token_probe``: a linear probe on one layer's residual at every generated token, a hallucination risk per
token while the request runs.

Method: O. Obeso, A. Arditi, J. Ferrando, J. Freeman, C. Holmes, N. Nanda, "Real-Time Detection of
Hallucinated Entities in Long-Form Generation", arXiv:2509.03531 (2025): a linear (logistic) probe on the
residual stream at each token, trained on token-level labels of entity spans (hallucinated or supported),
scores every token as it is generated; span scores aggregate token scores (max). They report AUC 0.90 for the
probe vs 0.71 for semantic entropy on Llama-3.3-70B long-form entities.

Here, for each generated token at position p (its residual after decoder layer ``layer``, captured in the step
that feeds the token back into the model, the one that samples token p + 1)::

    risk = sigmoid(((h - mean) / scale) . w + b)     the probe file's standardization and weights

computed as ``h . (w / scale) + c`` in one row-wise pass. Published values (``analyzers/_risk.py``): per token
``risk``, ``window_risk``, ``span_risk`` (max over the word so far) and the alert flag ``risk >= threshold``;
at the end ``answer_risk`` (default: ``risk_max``, Obeso et al.'s max aggregation), ``risk_max``,
``risk_mean``, ``risk_last``, ``window_max``, ``tokens``.

Training (``mia-stream probe train``, docs/hallucination.md): questions with checkable answers generated here,
the model's own greedy answers labelled right or wrong automatically; the rows of the answer-span tokens carry
the answer's label (1 = wrong). The shipped probe (``probes/token-probe-smollm2-135m.json``) is for the
embedded model; its training data, layer, held-out metrics and the command are in the file.

Logit features (optional, the probe file's ``extra.logit_features``, e.g. ``["neg_logprob", "entropy",
"next_entropy"]``, ``num_features`` = hidden size + their count, or their count alone with ``extra.hidden:
false``): the free uncertainty signals appended to the residual, computed here from the captured last layer
through the model's output head (``analyzers/_logits.py``; the model dir from the stream's start or config
``model_dir``): at token k's row, its -log p and the top-20 entropy of the distribution it was drawn from (the
previous row's logits; for k = 0 the last prompt row) and the top-20 entropy of the next token's distribution
(this row's logits). These need the last layer at every position (the last prompt row included).

Config: ``probe`` (path, or a shipped probe's file name), ``threshold`` (default: the probe's), ``window``
(rows in ``window_risk``, default 4), ``answer_score`` ("max" | "mean" | "last"), ``model_dir`` (logit
features: the model whose output head to use; default the stream's).
"""

from __future__ import annotations

import numpy as np

from mia_stream.analyzers._base import Needs, layer_rows
from mia_stream.analyzers._probe import LinearProbe, sigmoid
from mia_stream.analyzers._risk import RiskDetector
from mia_stream.errors import AnalyzerConfigError, AnalyzerInputError
from mia_stream.schemas import StepBatch

DEFAULT_PROBE = "token-probe-smollm2-135m.json"
LOGIT_FEATURES = ("neg_logprob", "entropy", "next_entropy")


def hidden_rows(detector: RiskDetector, batch: StepBatch, g, positions: str):
    """The probe layer's rows of ``g`` at ``positions`` of their requests: (x [N, H] float32, positions,
    row_requests, token_ids or None); None when the group has none."""
    probe = detector.probe
    if not g.has("hs"):
        return None
    t = g.tensor("hs")
    if t.shape[2] != probe.hidden_size:
        raise AnalyzerInputError(f"hs rows of width {t.shape[2]}, the probe needs {probe.hidden_size}")
    x = np.asarray(t.numpy()[int(layer_rows(t, (probe.layer,))[0])], np.float32)  # [N, H]
    pos, rr, tok = g.positions, g.row_requests, g.token_ids
    mask = detector.position_mask(batch, g, positions)
    if mask is not None:  # the stream captures more positions than the probe reads
        x, pos, rr = x[mask], pos[mask], rr[mask]
        tok = None if tok is None else tok[mask]
    return (x, pos, rr, tok) if len(x) else None


class TokenProbe(RiskDetector):
    """Linear probe on one layer's residual at every generated token (Obeso et al. 2025): risk per token."""

    name = "token_probe"
    version = "1"
    defaults = {"probe": DEFAULT_PROBE, "threshold": None, "window": 4, "answer_score": None,
                "alert": None, "model_dir": None}

    def load(self, probe: LinearProbe, config: dict) -> None:
        if probe.position != "generated":
            raise AnalyzerConfigError(f"probe file {probe.path}: a token probe reads 'generated' positions, "
                                      f"not {probe.position!r}")
        if probe.logit_features:
            raise AnalyzerConfigError(f"probe file {probe.path}: it reads the sampler's logit features, which only "
                                      "the engine has: name it in a request's 'detect' (docs/detectors.md)")
        self.logit_features = list(probe.extra.get("logit_features") or [])
        self.use_hidden = bool(probe.extra.get("hidden", True))
        bad = sorted(set(self.logit_features) - set(LOGIT_FEATURES))
        if bad:
            raise AnalyzerConfigError(f"probe file {probe.path}: 'extra.logit_features' must be among "
                                      f"{list(LOGIT_FEATURES)}, got {bad}")
        width = (probe.hidden_size if self.use_hidden else 0) + len(self.logit_features)
        if (probe.num_features or probe.hidden_size) != width:
            raise AnalyzerConfigError(f"probe file {probe.path}: a token probe reads {width} features (hidden "
                                      f"states{' and ' + str(len(self.logit_features)) + ' logit features' if self.logit_features else ''}), "
                                      f"its 'num_features' is {probe.num_features}")
        self.v, self.c = probe.folded(np.float32)
        if not self.logit_features:
            self._needs = Needs(hs_layers=(probe.layer,), hs_positions="generated")
            return
        if not probe.num_layers:
            raise AnalyzerConfigError(f"probe file {probe.path}: logit features need 'num_layers' (the last layer)")
        self.last_layer = probe.num_layers - 1
        self.model_dir = config.get("model_dir")
        self._heads: dict[str, object] = {}
        self._head_of: dict[str, object] = {}
        self._prev: dict[str, np.ndarray] = {}  # request -> log-probabilities of its last scored row
        layers = tuple(sorted({probe.layer, self.last_layer})) if self.use_hidden else (self.last_layer,)
        self._needs = Needs(hs_layers=layers, hs_positions="all")

    def start_request(self, start) -> None:
        if not self.logit_features:
            return
        from mia_stream.analyzers._logits import OutputHead

        key = str(self.model_dir or start.model or "")
        if key not in self._heads:
            from pathlib import Path

            if not key or not Path(key).is_dir():
                raise AnalyzerInputError(f"request {start.request_id!r}: logit features need the model's files; "
                                         f"the stream names model {key!r} (config 'model_dir' gives a local dir)")
            self._heads[key] = OutputHead.from_model_dir(key)
        self._head_of[start.request_id] = self._heads[key]

    def end_request(self, request_id: str) -> None:
        if self.logit_features:
            self._prev.pop(request_id, None)
            self._head_of.pop(request_id, None)

    def score(self, batch: StepBatch, g):
        if self.logit_features:
            return self._score_with_logits(batch, g)
        rows = hidden_rows(self, batch, g, "generated")
        if rows is None:
            return None
        x, pos, rr, tok = rows
        # row-wise sums, not a BLAS matvec whose blocking may depend on the batch: bit-identical live and replayed
        risk = sigmoid((x * self.v).sum(axis=1, dtype=np.float64) + self.c)
        return rr, pos, risk, {}, tok

    def _score_with_logits(self, batch: StepBatch, g):
        """Rows at the last prompt position keep their log-probabilities; generated rows get [hidden, logit
        features] scored. Rows of one request come in position order."""
        from mia_stream.analyzers._logits import top_entropy

        if not g.has("hs"):
            return None
        t = g.tensor("hs")
        arr = t.numpy()
        last = np.asarray(arr[int(layer_rows(t, (self.last_layer,))[0])], np.float32)
        hid = np.asarray(arr[int(layer_rows(t, (self.probe.layer,))[0])], np.float32) if self.use_hidden else None
        ids = batch.request_ids
        plen = np.repeat([self.prompt_lengths.get(ids[i], 0) for i in g.requests.tolist()], g.rows)
        keep = np.flatnonzero(g.positions >= plen - 1)
        out_rows, feats = [], []
        for j in keep.tolist():
            rid = ids[int(g.row_requests[j])]
            head = self._head_of.get(rid)
            if head is None:
                continue
            logp = head.log_softmax(last[j:j + 1])[0]
            prev = self._prev.get(rid)
            self._prev[rid] = logp
            if g.positions[j] < plen[j] or prev is None:
                continue  # the last prompt row: only its distribution is needed (for token 0)
            token = int(g.token_ids[j])
            if not 0 <= token < len(prev):
                raise AnalyzerInputError(f"request {rid!r}: logit features need the token ids of the stream")
            values = {"neg_logprob": -prev[token], "entropy": float(top_entropy(prev[None])[0]),
                      "next_entropy": float(top_entropy(logp[None])[0])}
            f = np.asarray([values[n] for n in self.logit_features], np.float32)
            feats.append(np.concatenate([hid[j], f]) if hid is not None else f)
            out_rows.append(j)
        if not out_rows:
            return None
        x = np.stack(feats)
        risk = sigmoid((x * self.v).sum(axis=1, dtype=np.float64) + self.c)
        sel = np.asarray(out_rows)
        return g.row_requests[sel], g.positions[sel], risk, {}, g.token_ids[sel]
