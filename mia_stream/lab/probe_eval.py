"""The detectors' evaluation report (``mia-stream probe eval``): every detector beside every free baseline of the
same moment of generation, on held-out entities, with bootstrap CIs by entity, an alert threshold calibrated on
the validation split for a false-alert rate on correct answers, recall of wrong answers at it, per set, and
leave-one-relation-out.

Moments and their baselines (``probe_metrics``):

- after the answer (``token_probe``'s published ``answer_risk`` = max over every generated row; the SLT
  semantic-entropy probe): mean / max token -log p, mean / max entropy, answer length, sampled semantic entropy;
- before the answer (the TBG semantic-entropy probe, at the last prompt row): the first token's entropy and
  -log p (the distribution the first answer token is drawn from), the question's prior (the training wrong-rate
  of its set and difficulty: what knowing the question's kind alone gives).

Selection: each detector's layer and C are chosen on the validation split's answer AUROC (training requests
fit, validation requests choose; the token-probe variants after the first reuse its layer), its threshold on the
validation split's correct answers; the test split is scored once. A detector "beats" the best baseline only where the CI of the paired difference excludes 0.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from mia_stream.lab import probe_metrics as pm
from mia_stream.lab import probe_train as pt

VARIANTS = {  # name: (detector, options, moment)
    "token_probe": ("token_probe", {"rows": "all"}, "after"),
    "token_probe_span": ("token_probe", {"rows": "span"}, "after"),
    "token_probe+logit": ("token_probe", {"rows": "all", "logit": True}, "after"),
    "token_logit_only": ("token_probe", {"rows": "all", "logit": "only"}, "after"),
    "sep_tbg": ("semantic_entropy_probe", {"position": "last_prompt"}, "before"),
    "sep_slt": ("semantic_entropy_probe", {"position": "generated"}, "after"),
    # every captured Q/K layer (the shipped probe's), Chuang et al.'s window of 8; needs --qk-layers at collect
    "lookback_ratio": ("lookback_ratio", {"rows": "all"}, "after"),
}
SEP_ON_LABEL = "sep_tbg_wrong"  # the TBG probe trained on "the answer is wrong" instead of high semantic entropy


def answer_scores(ds: pt.Dataset, detector: str, fit: dict, reqs: Sequence[int], **opts) -> np.ndarray:
    """What the analyzer publishes as ``answer_risk`` per request: max over every generated row (token probes),
    the one row's risk (semantic-entropy probes)."""
    feats = pt.detector_features(ds, detector, opts.get("layer"), None, opts.get("position", "last_prompt"),
                                 logit=opts.get("logit", False))
    return np.asarray([float(pt._probe_risk(fit, feats(r)).max()) for r in reqs], np.float64)


def select_and_fit(ds: pt.Dataset, detector: str, layers: Sequence[int], opts: dict, train_reqs=None,
                   log=print) -> tuple[dict, int, dict]:
    """The (layer, C) with the best validation answer AUROC, fit on the training requests: (fit, layer, table)."""
    val = ds.requests(ds.calibration_split())
    table, best = {}, None
    for layer in layers:
        for C in pt.CS:
            fit, _ = pt.train_detector(ds, detector, layer, cs=(C,), train_reqs=train_reqs, **opts)
            auc = pm.auroc(ds.labels[val], answer_scores(ds, detector, fit, val, layer=layer, **opts))
            table[f"{layer}/{C}"] = None if auc is None else round(auc, 4)
            if auc is not None and (best is None or auc > best[0]):
                best = (auc, layer, fit)
        log(f"{detector} {opts}: layer {layer}: validation AUROC {max(v or 0 for k, v in table.items() if k.startswith(f'{layer}/')):.3f}")
    if best is None:  # the validation answers are all right or all wrong (a small set): grouped CV on training
        log(f"{detector}: the validation split holds one class; layer and C by grouped CV on the training requests")
        for layer in layers:
            fit, _ = pt.train_detector(ds, detector, layer, train_reqs=train_reqs, **opts)
            table[f"{layer}/cv"] = fit["cv_auc"]
            if best is None or (fit["cv_auc"] or 0) > best[0]:
                best = (fit["cv_auc"] or 0, layer, fit)
    return best[2], best[1], table


def evaluate(ds: pt.Dataset, variants: Sequence[str] = tuple(VARIANTS), layers: Sequence[int] | None = None,
             rate: float = pm.FALSE_ALERT_RATE, loro: bool = True, log=print) -> dict[str, Any]:
    """The whole report as a dict (``format_report`` prints it)."""
    recs = ds.records
    train, test = ds.requests("train"), ds.requests("test")
    cal_split = ds.calibration_split()
    val = ds.requests(cal_split)
    layers = list(layers or ds.f.hs_layers)
    prior = pm.question_prior(recs, train.tolist())
    y_test, y_val = ds.labels[test], ds.labels[val]
    groups = ds.groups[test]
    base_test = pm.baseline_scores(recs, test.tolist(), prior, ds.rows)
    base_val = pm.baseline_scores(recs, val.tolist(), prior, ds.rows)
    has_samples = bool(ds.header.get("samples"))
    moments = {"after": list(pm.AFTER_ANSWER) + (["semantic_entropy"] if has_samples else []),
               "before": list(pm.BEFORE_ANSWER)}
    report: dict[str, Any] = {
        "data": {"requests": len(recs), "wrong": int(ds.labels.sum()), "train": len(train), "test": len(test),
                 "test_wrong": int(y_test.sum()), "calibration": cal_split, "calibration_requests": len(val),
                 "entities_test": int(len(np.unique(groups))), "model": ds.header.get("model"),
                 "samples": ds.header.get("samples"), "false_alert_rate": rate},
        "moments": moments, "detectors": {}, "baselines": {}}
    scores_test: dict[str, np.ndarray] = dict(base_test)
    token_layer = None
    for name in variants:
        detector, opts, moment = VARIANTS[name]
        if detector == "lookback_ratio" and not getattr(ds.f, "qk_layers", None):
            log(f"{name}: skipped, the data hold no Q/K (collect with --qk-layers)")
            continue
        # the token-probe variants share the first one's layer (choosing C only): a third of the fits
        if detector == "lookback_ratio":  # no hidden-state layer to choose: C only, on every Q/K layer
            choices = [None]
        elif detector == "token_probe" and token_layer is not None:
            choices = [token_layer]
        else:
            choices = layers
        fit, layer, table = select_and_fit(ds, detector, choices, opts, log=log)
        if detector == "token_probe" and token_layer is None:
            token_layer = layer
        s_val = answer_scores(ds, detector, fit, val.tolist(), layer=layer, **opts)
        s_test = answer_scores(ds, detector, fit, test.tolist(), layer=layer, **opts)
        thr = pm.calibrate(s_val[y_val == 0], rate)
        scores_test[name] = s_test
        report["detectors"][name] = {"detector": detector, "options": opts, "moment": moment, "layer": layer,
                                     "C": fit["C"], "selection": table, "fit": fit,
                                     "alerts": pm.alert_rates(y_test, s_test, thr, groups)}
    for moment, names in moments.items():
        for b in names:
            thr = pm.calibrate(base_val[b][y_val == 0], rate)
            report["baselines"][b] = {"moment": moment, "alerts": pm.alert_rates(y_test, base_test[b], thr, groups)}
    for moment, names in moments.items():
        dets = [d for d, v in report["detectors"].items() if v["moment"] == moment]
        aucs = {b: pm.auroc(y_test, base_test[b]) or 0 for b in names}
        best = max(aucs, key=aucs.get)
        boot = pm.bootstrap(y_test, {k: scores_test[k] for k in names + dets}, groups, reference=best)
        for k in names:
            report["baselines"][k].update(boot[k])
        for d in dets:
            report["detectors"][d].update(boot[d], beats_best_baseline=bool(boot[d].get("diff_ci", [0])[0] > 0))
        report[f"best_baseline_{moment}"] = best
    sets = np.asarray([recs[r].get("set") for r in test.tolist()])
    # within each set (its base rate worth nothing): every after-answer score against the best such baseline
    after = [k for k in moments["after"] if k != "semantic_entropy" or has_samples] + \
        [d for d, v in report["detectors"].items() if v["moment"] == "after"]
    w = {k: pm.within_auroc(y_test, scores_test[k], sets) or 0 for k in moments["after"]}
    best_w = max(w, key=w.get)
    report["within_set"] = pm.bootstrap(y_test, {k: scores_test[k] for k in after}, groups, reference=best_w,
                                        strata=sets)
    report["best_baseline_within_set"] = best_w
    report["per_set"] = {s: {k: _r(pm.auroc(y_test[sets == s], v[sets == s])) for k, v in scores_test.items()}
                         | {"n": int((sets == s).sum()), "wrong": int(y_test[sets == s].sum())}
                         for s in sorted(set(sets.tolist()))}
    if loro:
        report["leave_one_relation_out"] = leave_one_relation_out(ds, report, base_test, test, log=log)
    for d in report["detectors"].values():
        d.pop("fit")
    return report


def leave_one_relation_out(ds: pt.Dataset, report: dict, base_test: dict, test: np.ndarray, log=print) -> dict:
    """Per relation: the token probe and the TBG probe (their layer and C as selected in-distribution) trained on
    the training requests of the other relations, scored on this relation's test requests, beside the
    baselines on the same requests."""
    recs = ds.records
    rel = np.asarray([recs[r].get("relation") or recs[r].get("set") for r in range(len(recs))])
    train = ds.requests("train")
    out = {}
    pooled: dict[str, list] = {}
    pooled_y, pooled_g, pooled_rel = [], [], []
    for relation in sorted(set(rel[test].tolist())):
        t_idx = np.flatnonzero(rel[test] == relation)
        reqs = test[t_idx]
        y = ds.labels[reqs]
        if len(np.unique(y)) < 2:
            continue
        row = {"n": int(len(reqs)), "wrong": int(y.sum())}
        others = train[rel[train] != relation]
        scores = {}
        for name in ("token_probe", "token_probe+logit", "sep_tbg", "lookback_ratio"):
            if name not in report["detectors"]:
                continue
            d = report["detectors"][name]
            fit, _ = pt.train_detector(ds, d["detector"], d["layer"], cs=(d["C"],), train_reqs=others, **d["options"])
            scores[name] = answer_scores(ds, d["detector"], fit, reqs.tolist(), layer=d["layer"], **d["options"])
        for b in LORO_BASELINES:
            if b in base_test:
                scores[b] = base_test[b][t_idx]
        for k, v in scores.items():
            row[k] = _r(pm.auroc(y, v))
            pooled.setdefault(k, []).append(v)
        pooled_y.append(y)
        pooled_g.append(ds.groups[reqs])
        pooled_rel += [relation] * len(reqs)
        out[relation] = row
        log(f"leave out {relation}: {row}")
    if pooled_y:  # every relation scored by the probe that never saw it, within each relation, with CIs
        yy = np.concatenate(pooled_y)
        sc = {k: np.concatenate(v) for k, v in pooled.items() if len(v) == len(pooled_y)}
        w = {k: pm.within_auroc(yy, sc[k], pooled_rel) or 0 for k in LORO_BASELINES if k in sc}
        best = max(w, key=w.get)
        out["_pooled_within_relation"] = {"reference": best, **pm.bootstrap(
            yy, sc, np.concatenate(pooled_g), reference=best, strata=np.asarray(pooled_rel))}
    return out


LORO_BASELINES = ("mean_neg_logprob", "max_neg_logprob", "mean_entropy", "first_token_entropy", "answer_length",
                  "semantic_entropy")


def _r(v):
    return None if v is None else round(float(v), 3)


def _f(v) -> str:
    return "  -  " if v is None else f"{v:.3f}"


def format_report(rep: dict) -> str:
    d = rep["data"]
    lines = [f"data: {d['requests']} requests ({d['wrong']} wrong) of {d['model']}; training {d['train']}, "
             f"threshold calibration on {d['calibration']} ({d['calibration_requests']}), held out {d['test']} "
             f"({d['test_wrong']} wrong, {d['entities_test']} entities); splits by entity; CIs: 95 % bootstrap "
             f"over entities; thresholds: at most {d['false_alert_rate']:.0%} of correct {d['calibration']} "
             "answers alert"]
    for moment, title in (("after", "after the answer (answer_risk of the whole answer)"),
                          ("before", "before the answer (last prompt row)")):
        lines += ["", f"{title}: held-out AUROC for 'the answer is wrong'",
                  f"{'score':>26} {'AUROC':>6} {'95% CI':>13} {'diff vs best baseline':>28} {'thr':>7} "
                  f"{'false alerts':>12} {'recall [CI]':>20}"]
        rows = [(k, v) for k, v in rep["detectors"].items() if v["moment"] == moment]
        rows += [(f"baseline {k}", rep["baselines"][k]) for k in rep["moments"][moment]]
        for name, v in rows:
            a = v["alerts"]
            diff = (f"{v['diff']:+.3f} [{v['diff_ci'][0]:+.3f},{v['diff_ci'][1]:+.3f}]" if "diff" in v else
                    "(best baseline)" if name == f"baseline {rep['best_baseline_' + moment]}" else "")
            lines.append(f"{name:>26} {_f(v['auroc']):>6} [{_f(v['ci'][0])},{_f(v['ci'][1])}] {diff:>28} "
                         f"{a['threshold']:>7.3g} {_f(a['false_alert_rate']):>12} "
                         f"{_f(a['recall'])} [{_f(a['recall_ci'][0])},{_f(a['recall_ci'][1])}]")
        for name, v in rep["detectors"].items():
            if v["moment"] == moment:
                lines.append(f"  {name}: layer {v['layer']}, C {v['C']}; beats the best baseline "
                             f"({rep['best_baseline_' + moment]}): {'yes' if v['beats_best_baseline'] else 'no'}")
    if rep.get("within_set"):
        lines += ["", "within each set (AUROC per set, averaged by size: what knowing the set gives is removed), "
                      f"against the best such baseline ({rep['best_baseline_within_set']}):"]
        for k, v in rep["within_set"].items():
            diff = f"{v['diff']:+.3f} [{v['diff_ci'][0]:+.3f},{v['diff_ci'][1]:+.3f}]" if "diff" in v else ""
            lines.append(f"{k:>26} {_f(v['auroc']):>6} [{_f(v['ci'][0])},{_f(v['ci'][1])}] {diff:>28}")
    names = list(rep["detectors"]) + ["mean_neg_logprob", "max_neg_logprob", "first_token_entropy",
                                      "question_prior", "semantic_entropy"]
    lines += ["", "held-out AUROC within each set:", f"{'set':>16} {'n':>5} {'wrong':>5} " +
              " ".join(f"{n[:14]:>14}" for n in names)]
    for s, v in rep["per_set"].items():
        lines.append(f"{s:>16} {v['n']:>5} {v['wrong']:>5} " + " ".join(f"{_f(v.get(n)):>14}" for n in names))
    if rep.get("leave_one_relation_out"):
        cols = ["token_probe", "token_probe+logit", "sep_tbg", "lookback_ratio", "mean_neg_logprob", "max_neg_logprob",
                "mean_entropy", "first_token_entropy", "answer_length", "semantic_entropy"]
        lines += ["", "leave one relation out (trained on the other relations' training entities, scored on this "
                      "relation's held-out ones):", f"{'relation':>16} {'n':>5} {'wrong':>5} " +
                  " ".join(f"{c[:14]:>14}" for c in cols)]
        for relation, v in rep["leave_one_relation_out"].items():
            if relation.startswith("_"):
                continue
            lines.append(f"{relation:>16} {v['n']:>5} {v['wrong']:>5} " +
                         " ".join(f"{_f(v.get(c)):>14}" for c in cols))
        pooled = rep["leave_one_relation_out"].get("_pooled_within_relation")
        if pooled:
            lines += [f"all relations pooled (AUROC within each relation, averaged by size), against the best "
                      f"baseline ({pooled['reference']}):"]
            for k, v in pooled.items():
                if k == "reference":
                    continue
                diff = f"{v['diff']:+.3f} [{v['diff_ci'][0]:+.3f},{v['diff_ci'][1]:+.3f}]" if "diff" in v else ""
                lines.append(f"{k:>26} {_f(v['auroc']):>6} [{_f(v['ci'][0])},{_f(v['ci'][1])}] {diff:>28}")
    return "\n".join(lines)
