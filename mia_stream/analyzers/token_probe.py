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

Config: ``probe`` (path, or a shipped probe's file name), ``threshold`` (default: the probe's), ``window``
(rows in ``window_risk``, default 4), ``answer_score`` ("max" | "mean" | "last").
"""

from __future__ import annotations

import numpy as np

from mia_stream.analyzers._base import Needs, layer_rows
from mia_stream.analyzers._probe import LinearProbe, sigmoid
from mia_stream.analyzers._risk import RiskDetector
from mia_stream.errors import AnalyzerConfigError, AnalyzerInputError
from mia_stream.schemas import StepBatch

DEFAULT_PROBE = "token-probe-smollm2-135m.json"


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
                "alert": None}

    def load(self, probe: LinearProbe, config: dict) -> None:
        if probe.position != "generated":
            raise AnalyzerConfigError(f"probe file {probe.path}: a token probe reads 'generated' positions, "
                                      f"not {probe.position!r}")
        if probe.logit_features:
            raise AnalyzerConfigError(f"probe file {probe.path}: it reads the sampler's logit features, which only "
                                      "the engine has: name it in a request's 'detect' (docs/detectors.md)")
        if probe.num_features:
            raise AnalyzerConfigError(f"probe file {probe.path}: a token probe reads hidden states "
                                      f"(no 'num_features')")
        self.v, self.c = probe.folded(np.float32)
        self._needs = Needs(hs_layers=(probe.layer,), hs_positions="generated")

    def score(self, batch: StepBatch, g):
        rows = hidden_rows(self, batch, g, "generated")
        if rows is None:
            return None
        x, pos, rr, tok = rows
        # row-wise sums, not a BLAS matvec whose blocking may depend on the batch: bit-identical live and replayed
        risk = sigmoid((x * self.v).sum(axis=1, dtype=np.float64) + self.c)
        return rr, pos, risk, {}, tok
