#!/usr/bin/env python
"""Where the alerts fall: of the tokens that alert in wrong held-out answers, the share on the answer's claim
(its claim-level token label, lab/hallucination_data.token_labels), for a probe file at its threshold and for the
free per-token alternative (the token's -log p at a threshold), on a ``mia-stream probe collect`` directory.

    python scripts/alert_tokens_on_claims.py --data DIR [--probe token-probe-smollm2-135m.json] [--neg-logprob 2.1655]

The probe's risk is recomputed from the recording's features (the probe file's folded formula); the -log p is the
labels file's (vLLM's own logprobs).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mia_stream.lab import probe_train as pt  # noqa: E402
from mia_stream.spec.probes import load_probe, resolve_probe_path  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", required=True)
    ap.add_argument("--probe", default="token-probe-smollm2-135m.json")
    ap.add_argument("--neg-logprob", type=float, default=2.1655, help="the -log p threshold (the shipped "
                    "neg-logprob-smollm2-135m.json's)")
    args = ap.parse_args(argv)
    d = Path(args.data)
    labels = pt.load_labels(d / "labels.jsonl")
    ds = pt.Dataset(*labels, pt.read_features(d / "recording", labels, d / "labels.jsonl", cache=True, log=print))
    p = load_probe(resolve_probe_path(args.probe, "--probe"), "token_probe")
    v, c = p.folded(np.float64)
    li = ds.f.hs_layers.index(p.layer)
    # per detector: alert tokens of wrong answers on / off the claim; right answers with any alert; right answers
    stats = {"probe": [0, 0, 0, 0], "-log p": [0, 0, 0, 0]}
    for r in ds.requests("test").tolist():
        rec, n = ds.records[r], int(ds.rows[r])
        claim = ds.token_labels[r][:n] == 1
        risk = 1 / (1 + np.exp(-(ds.f.gen[ds.f.of(r), li].astype(np.float64) @ v + c)))
        nlp = -np.asarray(rec["logprobs"][:n], np.float64)
        for k, hot in (("probe", risk >= p.threshold), ("-log p", nlp >= args.neg_logprob)):
            s = stats[k]
            if rec["label"]:
                s[0] += int((hot & claim).sum())
                s[1] += int((hot & ~claim).sum())
            else:
                s[2] += int(hot.any())
                s[3] += 1
    for k, (on, off, right_alerting, right) in stats.items():
        print(f"{k:>7}: alert tokens in wrong answers {on + off}, on the claim {on / max(1, on + off):.3f}; "
              f"right answers alerting {right_alerting}/{right}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
