"""``semantic_entropy_probe``: a linear probe on a hidden state that predicts the model's own answer
uncertainty (semantic entropy) without sampling, so before or while the answer is written.

Method: J. Kossen, J. Han, M. Razzak, L. Schut, S. Malik, Y. Gal, "Semantic Entropy Probes: Robust and Cheap
Hallucination Detection in LLMs", arXiv:2406.15902 (2024). Semantic entropy (S. Farquhar, J. Kossen, L. Kuhn,
Y. Gal, Nature 630, 2024) samples several answers, clusters them by meaning and takes the entropy over the
clusters; Kossen et al. binarize it (high / low, at the split that minimizes the within-class squared error)
and train a logistic probe on one layer's hidden state at the token before generation (TBG: the last prompt
token) or the second-last token of the answer (SLT); the probe then flags likely hallucinations at the cost of
one forward pass. They report SEP AUROCs for the model's accuracy close to sampled semantic entropy's.

Here the targets are computed by ``mia-stream probe collect``: for every question, ``--samples`` (10) answers
sampled at temperature 1, clustered by exact match of the normalized short answer (a number, or the answer's
content words; ``hallucination_data.answer_key``) -- adequate for answers of a word or a number, standing in
for the papers' bidirectional-entailment clustering -- and the discrete semantic entropy binarized as above.

Rows scored (the probe file's ``position``):

- ``last_prompt`` (TBG): one row at the last prompt position, in the prompt's step, before any answer token
  exists: ``risk`` = P(high semantic entropy);
- ``generated``: every generated token; the end row's ``risk_last`` is the SLT-like score (the last token fed,
  whose state predicts the end of the answer).

Published values (``analyzers/_risk.py``): ``risk``, ``window_risk``, ``span_risk``, alert ``risk >=
threshold``; at the end ``answer_risk`` (default ``risk_last``), ``risk_max``, ``risk_mean``, ``risk_last``,
``window_max``, ``tokens``. The shipped probe: ``probes/semantic-entropy-probe-smollm2-135m.json``.

Config: ``probe``, ``threshold``, ``window``, ``answer_score`` (as ``token_probe``).
"""

from __future__ import annotations

import numpy as np

from mia_stream.analyzers._base import Needs
from mia_stream.analyzers._probe import LinearProbe, sigmoid
from mia_stream.analyzers._risk import RiskDetector
from mia_stream.analyzers.token_probe import hidden_rows
from mia_stream.errors import AnalyzerConfigError
from mia_stream.schemas import StepBatch

DEFAULT_PROBE = "semantic-entropy-probe-smollm2-135m.json"


class SemanticEntropyProbe(RiskDetector):
    """Linear probe predicting high semantic entropy of the model's answer (Kossen et al. 2024)."""

    name = "semantic_entropy_probe"
    version = "1"
    defaults = {"probe": DEFAULT_PROBE, "threshold": None, "window": 4, "answer_score": None,
                "alert": None}
    default_answer_score = "last"

    def load(self, probe: LinearProbe, config: dict) -> None:
        if probe.position not in ("last_prompt", "generated"):
            raise AnalyzerConfigError(f"probe file {probe.path}: a semantic-entropy probe reads 'last_prompt' or "
                                      f"'generated' positions, not {probe.position!r}")
        if probe.num_features:
            raise AnalyzerConfigError(f"probe file {probe.path}: a semantic-entropy probe reads hidden states "
                                      f"(no 'num_features')")
        self.v, self.c = probe.folded(np.float32)
        self._needs = Needs(hs_layers=(probe.layer,), hs_positions=probe.position)

    def score(self, batch: StepBatch, g):
        rows = hidden_rows(self, batch, g, self.probe.position)
        if rows is None:
            return None
        x, pos, rr, tok = rows
        risk = sigmoid((x * self.v).sum(axis=1, dtype=np.float64) + self.c)
        return rr, pos, risk, {}, tok
