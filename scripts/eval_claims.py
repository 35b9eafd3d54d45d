"""Claim-level evaluation of the token probe on long-form answers (issue 27; Obeso et al. 2025's setting):
every checkable claim of "Tell me about X." (``lab/claims.py``) scored by the max risk over its tokens, AUROC for
"the claim is unsupported" on held-out entities, beside the free baselines on the same claims (max / mean token
-log p and entropy over the claim's tokens), with 95 % bootstrap CIs by entity.

    mia-stream probe collect DIR --sets long_form --samples 0 --max-tokens 64 --hs-layers 12,16,20,24,29 --qk-layers none
    python scripts/eval_claims.py --data DIR [--layers 12,16,20,24] [--logit] [--shipped PROBE.json]

The probe trains on every generated token of the training entities (1 = a token of an unsupported claim), its
layer and C chosen on the validation entities' claim AUROC. ``--shipped``: a probe file (trained on short
answers) scored on the same held-out claims, unchanged (its layer must be captured): how the detector users get
transfers to long-form text, with its alert rates at the file's threshold on claims and on the other tokens.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mia_stream.lab import probe_metrics as pm  # noqa: E402
from mia_stream.lab import probe_train as pt  # noqa: E402


def claims_of(ds, reqs):
    """(request, token indices with a state, label, entity) of every claim of these requests."""
    out = []
    for r in reqs:
        rec = ds.records[r]
        n = int(ds.rows[r])  # tokens with a state (the last sampled one has none)
        for c in rec.get("claims") or []:
            toks = [k for k in range(n) if _overlap(rec, k, c)]
            if toks:
                out.append((r, toks, int(not c["supported"]), rec["group"]))
    return out


def _overlap(rec, k, c):
    ranges = rec["_ranges"]
    s, e = ranges[k]
    return s < c["stop"] and e > c["start"]


def outside_claim_alerts(ds, reqs, token_scores, thr: float) -> tuple[int, int]:
    """``(alerting, all)`` generated tokens of ``reqs`` outside every claim; a token alerts when its score
    (``token_scores(r)``: one per token with a state) is at or above ``thr``."""
    alerts = total = 0
    for r in reqs:
        rec, scores = ds.records[r], np.asarray(token_scores(r))
        rest = [k for k in range(len(scores)) if not any(_overlap(rec, k, c) for c in rec.get("claims") or [])]
        total += len(rest)
        alerts += int((scores[rest] >= thr).sum())
    return alerts, total


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", required=True)
    ap.add_argument("--layers", default=None)
    ap.add_argument("--logit", action="store_true")
    ap.add_argument("--shipped", default=None, help="a probe file to score unchanged beside the trained probe")
    ap.add_argument("--logprob-alert", type=float, default=None,
                    help="the free detector's alert (a token's -log p at or above this; the shipped "
                         "neg-logprob-smollm2-135m.json: 2.1655): its alert rates beside the shipped probe's")
    args = ap.parse_args()
    from transformers import AutoTokenizer

    from mia_stream.lab import hallucination_data as hd

    labels_path = Path(args.data) / "labels.jsonl"
    labels = pt.load_labels(labels_path)
    feats = pt.read_features(Path(args.data) / "recording", labels, labels_path)
    ds = pt.Dataset(*labels, feats)
    tok = AutoTokenizer.from_pretrained(ds.header["model_dir"])
    for rec in ds.records:
        rec["_ranges"] = hd.token_char_ranges(tok, rec["token_ids"])
    layers = [int(x) for x in args.layers.split(",")] if args.layers else [x for x in ds.f.hs_layers
                                                                            if x != ds.header["num_layers"] - 1]
    val, test = ds.requests(ds.calibration_split()).tolist(), ds.requests("test").tolist()
    cv, ct = claims_of(ds, val), claims_of(ds, test)
    print(f"claims: validation {len(cv)} ({sum(c[2] for c in cv)} unsupported), held out {len(ct)} "
          f"({sum(c[2] for c in ct)} unsupported) in {len(test)} answers")

    def claim_scores(fit, layer, claims):
        f = pt.detector_features(ds, "token_probe", layer, logit=args.logit)
        cache = {}
        out = []
        for r, toks, _, _ in claims:
            if r not in cache:
                cache[r] = pt._probe_risk(fit, f(r))
            out.append(float(cache[r][toks].max()))
        return np.asarray(out)

    best = None
    for layer in layers:
        for C in pt.CS:
            fit, _ = pt.train_detector(ds, "token_probe", layer, cs=(C,), rows="all", logit=args.logit)
            a = pm.auroc([c[2] for c in cv], claim_scores(fit, layer, cv))
            if a is not None and (best is None or a > best[0]):
                best = (a, layer, C, fit)
    _, layer, C, fit = best
    y = np.asarray([c[2] for c in ct])
    groups = [c[3] for c in ct]
    scores = {"token_probe": claim_scores(fit, layer, ct)}
    for name, key, sign, agg in (("max_neg_logprob", "logprobs", -1, np.max), ("mean_neg_logprob", "logprobs", -1, np.mean),
                                 ("max_entropy", "entropies", 1, np.max)):
        scores[name] = np.asarray([agg(sign * np.asarray(ds.records[r][key])[toks]) for r, toks, _, _ in ct])
    shipped = None
    if args.shipped:
        import json

        d = json.loads(Path(args.shipped).read_text())
        shipped = {k: np.asarray(d[k], np.float64) for k in ("weights", "scale", "mean", "bias")}, d
        scores["shipped_probe"] = claim_scores(shipped[0], d["layer"], ct)
    base = {k: pm.auroc(y, v) or 0 for k, v in scores.items() if k not in ("token_probe", "shipped_probe")}
    ref = max(base, key=base.get)
    res = pm.bootstrap(y, scores, groups, reference=ref)
    print(f"token_probe{' + logit' if args.logit else ''}: layer {layer}, C {C} (validation claim AUROC {best[0]:.3f})")
    for k, v in res.items():
        diff = f"{v['diff']:+.3f} [{v['diff_ci'][0]:+.3f},{v['diff_ci'][1]:+.3f}]" if "diff" in v else "(best baseline)" if k == ref else ""
        print(f"{k:>18} claim AUROC {v['auroc']:.3f} [{v['ci'][0]:.3f},{v['ci'][1]:.3f}] {diff}")
    if shipped is not None:
        fit, d = shipped
        thr, flag = d["threshold"], scores["shipped_probe"] >= d["threshold"]
        f = pt.detector_features(ds, "token_probe", d["layer"])
        other_alerts, other = outside_claim_alerts(ds, test, lambda r: pt._probe_risk(fit, f(r)), thr)
        print(f"shipped probe {Path(args.shipped).name} (layer {d['layer']}, threshold {thr:.3f}): alerts on "
              f"{flag[y == 1].mean():.3f} of unsupported claims, {flag[y == 0].mean():.3f} of supported claims, "
              f"{other_alerts / max(other, 1):.3f} of the {other} other tokens")
        # the free score at the same false-alert rate on supported claims (its best threshold for that rate,
        # chosen on these held-out claims: generous to the baseline)
        free = scores["max_neg_logprob"]
        ok = np.sort(free[y == 0])[::-1]
        allowed = int(flag[y == 0].sum())
        cut = ok[allowed] if allowed < len(ok) else -np.inf
        caught = flag.astype(float) - (free > cut)  # per claim: the probe catches it and the free score not (+1)
        ent = np.asarray(groups)
        uniq = np.unique(ent)
        rng = np.random.default_rng(0)
        diffs = []
        for _ in range(2000):  # entities resampled: the recall difference on unsupported claims
            pick = np.concatenate([np.flatnonzero((ent == g) & (y == 1)) for g in rng.choice(uniq, len(uniq))])
            if len(pick):
                diffs.append(caught[pick].mean())
        lo, hi = np.percentile(diffs, [2.5, 97.5])
        print(f"max token -log p over the claim at that rate ({allowed} supported claims alerting, threshold > "
              f"{cut:.3f}, chosen on these claims): alerts on {(free[y == 1] > cut).mean():.3f} of unsupported "
              f"claims; the probe's recall minus it {caught[y == 1].mean():+.3f} [{lo:+.3f}, {hi:+.3f}] "
              "(95 % bootstrap over entities)")
    if args.logprob_alert is not None:
        thr = args.logprob_alert
        flag = scores["max_neg_logprob"] >= thr
        other_alerts, other = outside_claim_alerts(
            ds, test, lambda r: -np.asarray(ds.records[r]["logprobs"])[:int(ds.rows[r])], thr)
        print(f"free detector (a token's -log p >= {thr}): alerts on {flag[y == 1].mean():.3f} of unsupported "
              f"claims, {flag[y == 0].mean():.3f} of supported claims, {other_alerts / max(other, 1):.3f} of the "
              f"{other} other tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
