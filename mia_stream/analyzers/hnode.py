"""``hnode``: a logistic hallucination probe on one layer's last-token hidden state, plus the H-Node excess score,
as the seed ships it (IBM/vLLM-Hook ``mia/analyzers/hnode_hallucination_analyzer.py``, ``mia/utils/hnode/score.py``,
``docs/use_cases/hnode_detector.md``).

Method: E. Yocam, V. Vaidyan, Y. Wang, "H-Node Attack and Defense in Large Language Models", arXiv:2603.26045
(2026): a logistic-regression probe on last-token hidden states of the best layer; its largest-weight hidden
dimensions are the Hallucination Nodes (H-Nodes). The seed scores a *question + answer* pair ("Q: ...\nA: ...",
plain text, one prefill): the state of its last token says whether the answer is grounded or hallucinated.

For each captured row ``h`` (raw residual of the probe's layer; by default the last prompt token)::

    p        = sigmoid(((h - mean) / scale) . w + b)          P(hallucinated)              -> ``p_hallucination``
    excess   = mean_k max(0, h[k] - baseline[k])              over the H-Nodes k, raw units -> ``h_node_excess``

``baseline[k]``: a percentile (the probe file's ``extra.baseline_percentile``) of H-Node k's raw activation over
the grounded (label 0) training rows; H-Nodes: the probe's ``extra.h_nodes`` (the dimensions with the largest
positive standardized weights, so that rising above the baseline is the hallucination direction). A row is an
alert when ``p >= threshold``; the excess is reported, never used for the alert (the seed's definition).

Two probe modes (``extra.mode``; the analyzer reads whichever the probe file was trained for):
``"qa"`` (the seed's; shipped ``probes/hnode-smollm2-135m.json``), the request is the question + the answer to
check; ``"before_answer"`` (this project's earlier variant; ``probes/hnode-before-answer-smollm2-135m.json``),
the request is the chat-templated question and the row is the last prompt token, so the score predicts, before
the answer is written, whether the model's own answer will be wrong. Both were trained here by
``scripts/eval_hnode.py``; their data, split and held-out metrics are in the files and in docs/analyzers.md.

Config: ``probe`` (path, or a shipped probe's file name), ``threshold`` (default: the probe's), ``positions``
(default the probe's; "all" or "generated" score every such row).
"""

from __future__ import annotations

import numpy as np

from mia_stream.analyzers._base import Analyzer, Needs, Results, layer_rows, layer_values
from mia_stream.analyzers._probe import LinearProbe, load_probe, resolve_probe_path, sigmoid
from mia_stream.errors import AnalyzerConfigError, AnalyzerInputError
from mia_stream.schemas import StepBatch, StreamStart

DEFAULT_PROBE = "hnode-smollm2-135m.json"


class HNode(Analyzer):
    """Logistic hallucination probe on one layer's last-token state, plus the H-Node excess score (the seed's)."""

    name = "hnode"
    version = "2"  # 2: the seed's excess, mean(max(0, h - percentile baseline)) in raw units; question+answer probe
    defaults = {"probe": DEFAULT_PROBE, "threshold": None, "positions": None}

    def configure(self, config: dict) -> None:
        probe = load_probe(resolve_probe_path(config["probe"], "hnode config"), "hnode")
        self.probe: LinearProbe = probe
        extra = probe.extra
        try:
            nodes = np.asarray(extra["h_nodes"], np.int64)
            base = np.asarray(extra["h_node_baselines"], np.float64)
        except (KeyError, TypeError, ValueError) as e:
            raise AnalyzerConfigError(f"probe file {probe.path}: 'extra' needs h_nodes and h_node_baselines "
                                      f"({e})") from None
        if (nodes.ndim != 1 or not len(nodes) or base.shape != nodes.shape or not np.isfinite(base).all()
                or nodes.min() < 0 or nodes.max() >= probe.hidden_size):
            raise AnalyzerConfigError(f"probe file {probe.path}: 'extra' h_nodes must be indices below "
                                      f"{probe.hidden_size} with one finite h_node_baselines value each")
        self.nodes, self.node_baselines = nodes, base.astype(np.float32)
        self.mode = str(extra.get("mode", "qa"))
        self.w_fold, self.c_fold = probe.folded(np.float32)
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
            excess = np.maximum(x[:, self.nodes] - self.node_baselines, 0.0).mean(axis=1)  # raw units
            out.add(batch.request_ids, row_requests, positions,
                    {"p_hallucination": p.astype(np.float32), "h_node_excess": excess.astype(np.float32)},
                    alerts=p >= self.threshold)
