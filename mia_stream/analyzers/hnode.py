"""``hnode``: a logistic hallucination probe on the standardized last-token hidden state of one layer, plus the
H-Node excess score.

Method: E. Yocam, V. Vaidyan, Y. Wang, "H-Node Attack and Defense in Large Language Models", arXiv:2603.26045
(2026), building on E. Yocam et al., "Adaptive Activation Cancellation for Hallucination Mitigation in Large
Language Models", arXiv:2603.10195 (2026): a logistic-regression probe trained on last-token hidden states
localizes the hallucination signal to a few high-variance dimensions, the Hallucination Nodes (H-Nodes); probe
AUC reaches 0.90 across four models (OPT-125M to Llama-3-8B). Their defense cancels each H-Node's *excess* over
its grounded baseline.

Here, for each captured row of the probe's layer (by default the last prompt token: the state whose logits pick
the first answer token, so the score is a prediction before the answer is written):

    z        = (h - mean) / scale                               standardized (the probe file's statistics)
    p        = sigmoid(z . w + b)                               P(hallucination)      -> value ``p_hallucination``
    excess_k = max(0, sign(w_k) (z_k - mu_k) / sigma_k)         for each H-Node k: how far it goes past its
                                                                grounded (label 0) training mean, in grounded
                                                                standard deviations, toward hallucination
    excess   = mean_k excess_k                                                        -> value ``h_node_excess``

H-Nodes are the ``k`` dimensions with the largest ``|w_k|`` (the probe file's ``extra.h_nodes``; ``mu``/``sigma``
in ``extra.grounded_mean`` / ``extra.grounded_std``). A row is an alert when ``p >= threshold``. The excess is our
reading of the paper's "H-Node excess" (the papers give no closed formula in their abstracts); it is reported,
never used for the alert.

The shipped probe (``probes/hnode-smollm2-135m.json``) was trained here by ``scripts/train_probes.py`` on
country-capital questions answered by the embedded model; its metadata and held-out metrics are in the file and
in docs/analyzers.md. Config: ``probe`` (path, or a shipped probe's file name), ``threshold`` (default: the
probe's), ``positions`` (default the probe's; "all" or "generated" score every such row).
"""

from __future__ import annotations

import numpy as np

from mia_stream.analyzers._base import Analyzer, Needs, Results, layer_rows, layer_values
from mia_stream.analyzers._probe import LinearProbe, load_probe, resolve_probe_path, sigmoid
from mia_stream.errors import AnalyzerConfigError, AnalyzerInputError
from mia_stream.schemas import StepBatch, StreamStart

DEFAULT_PROBE = "hnode-smollm2-135m.json"


class HNode(Analyzer):
    """Logistic hallucination probe on one layer's last-token state, plus the H-Node excess score."""

    name = "hnode"
    version = "1"
    defaults = {"probe": DEFAULT_PROBE, "threshold": None, "positions": None}

    def configure(self, config: dict) -> None:
        probe = load_probe(resolve_probe_path(config["probe"], "hnode config"), "hnode")
        self.probe: LinearProbe = probe
        extra = probe.extra
        try:
            nodes = np.asarray(extra["h_nodes"], np.int64)
            mu = np.asarray(extra["grounded_mean"], np.float64)
            sd = np.asarray(extra["grounded_std"], np.float64)
        except (KeyError, TypeError, ValueError) as e:
            raise AnalyzerConfigError(f"probe file {probe.path}: 'extra' needs h_nodes, grounded_mean and "
                                      f"grounded_std ({e})") from None
        if (nodes.ndim != 1 or not len(nodes) or mu.shape != nodes.shape or sd.shape != nodes.shape
                or nodes.min() < 0 or nodes.max() >= probe.hidden_size or (sd <= 0).any()):
            raise AnalyzerConfigError(f"probe file {probe.path}: 'extra' h_nodes must be indices below "
                                      f"{probe.hidden_size} with one positive grounded_std and one grounded_mean each")
        self.nodes, self.node_sign = nodes, np.sign(probe.weights[nodes])
        self.w_fold, self.c_fold = probe.folded(np.float32)
        self.node_mu, self.node_sd = mu, sd
        thr = config["threshold"]
        if thr is None:
            thr = probe.threshold
        if isinstance(thr, bool) or not isinstance(thr, (int, float)) or not 0 <= thr <= 1:
            raise AnalyzerConfigError(f"hnode config: 'threshold' must be a probability in [0, 1], got {thr!r}")
        self.threshold = float(thr)
        self.positions = config["positions"] or probe.position
        self._needs = Needs(hs_layers=(probe.layer,), hs_positions=self.positions)

    def needs(self) -> Needs:
        return self._needs

    def on_start(self, start: StreamStart) -> None:
        super().on_start(start)
        if start.hidden_size and start.hidden_size != self.probe.hidden_size:
            raise AnalyzerInputError(
                f"request {start.request_id!r}: the probe {self.probe.path} is for hidden size "
                f"{self.probe.hidden_size} ({self.probe.model}), the stream's model has {start.hidden_size}")

    def on_batch(self, batch: StepBatch, out: Results) -> None:
        probe = self.probe
        for g in batch.groups:
            if not g.has("hs") or not g.num_rows:
                continue
            t = g.tensor("hs")
            if t.shape[2] != probe.hidden_size:
                raise AnalyzerInputError(f"hs rows of width {t.shape[2]}, the probe needs {probe.hidden_size}")
            x = layer_values(t, int(layer_rows(t, (probe.layer,))[0]))  # [N, H] float32
            positions, row_requests = g.positions, g.row_requests
            mask = self.position_mask(batch, g, self.positions)
            if mask is not None:  # the stream captures more positions than the probe reads
                x, positions, row_requests = x[mask], positions[mask], row_requests[mask]
                if not len(x):
                    continue
            # x . (w / scale) + c in one pass over the rows; row-wise sums (not a BLAS matvec, whose blocking
            # may depend on the batch): a request's score never depends on which other requests share its step,
            # so live and replayed results are bit-identical
            p = sigmoid((x * self.w_fold).sum(axis=1, dtype=np.float64) + self.c_fold)
            z = (x[:, self.nodes] - probe.mean[self.nodes]) / probe.scale[self.nodes]  # the H-Nodes only
            dev = self.node_sign * (z - self.node_mu) / self.node_sd
            excess = np.maximum(dev, 0.0).mean(axis=1)
            out.add(batch.request_ids, row_requests, positions,
                    {"p_hallucination": p.astype(np.float32), "h_node_excess": excess.astype(np.float32)},
                    alerts=p >= self.threshold)
