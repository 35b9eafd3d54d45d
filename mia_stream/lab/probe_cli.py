"""``mia-stream probe``: make the data, train and evaluate the hallucination detectors (docs/hallucination.md).

    mia-stream probe collect DIR [--limit N] [--samples 10]          # DIR/recording (MCAP), DIR/labels.jsonl
    mia-stream probe train --recording DIR/recording --labels DIR/labels.jsonl --layer L [--detector D] [--out F]
    mia-stream probe relabel DIR --hs-layers L,..                    # labels.jsonl again from DIR/recording
    mia-stream probe sample DIR [--samples 5]                        # sampled answers, semantic entropy
    mia-stream probe calibrate PROBE --data DIR [--out F]            # its threshold for a false-alert rate
    mia-stream probe eval --data DIR [--analyzers]                   # the report: detectors, baselines, CIs

``--data DIR`` stands for ``--recording DIR/recording --labels DIR/labels.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

import numpy as np

from mia_stream.errors import MiaStreamError
from mia_stream.lab.probe_metrics import json_default

PROG = "mia-stream probe"


def _command(argv) -> str:
    return "mia-stream probe " + " ".join(shlex.quote(a) for a in argv)


def _data_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--data", help="a collect directory: its recording/ and labels.jsonl")
    ap.add_argument("--recording", help="the recording (default DATA/recording)")
    ap.add_argument("--labels", help="the labels file (default DATA/labels.jsonl)")
    ap.add_argument("--no-cache", action="store_true", help="read the recording again (no features-*.npz cache)")


def _paths(args) -> tuple[Path, Path]:
    if args.data is None and (args.recording is None or args.labels is None):
        raise SystemExit(f"{PROG}: give --data DIR, or --recording and --labels")
    rec = Path(args.recording) if args.recording else Path(args.data) / "recording"
    labels = Path(args.labels) if args.labels else Path(args.data) / "labels.jsonl"
    return rec, labels


def _log(msg: str) -> None:
    print(f"[{PROG} {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _dataset(args):
    from mia_stream.lab import probe_train as pt

    rec, labels_path = _paths(args)
    labels = pt.load_labels(labels_path)
    feats = pt.read_features(rec, labels, labels_path, cache=not args.no_cache, log=_log)
    return pt.Dataset(*labels, feats), rec, labels_path


# ------------------------------------------------------------------------------------------------ collect

def _capture(hs: str, qk: str, model: str | None) -> dict:
    from mia_stream.lab.probe_collect import default_capture
    from mia_stream.model import resolve_model

    n = int(json.loads((Path(resolve_model(model)) / "config.json").read_text())["num_hidden_layers"])

    def layers(text: str, what: str):
        if text == "all":
            return "all"
        if text == "every2":
            return default_capture(n)["hidden_states"]["layers"]
        try:
            out = sorted({int(x) for x in text.split(",")})
        except ValueError:
            raise SystemExit(f"{PROG} collect: {what} must be comma-separated layer numbers, got {text!r}") from None
        if not out or out[0] < 0 or out[-1] >= n:
            raise SystemExit(f"{PROG} collect: {what} must be layers 0..{n - 1}, got {text!r}")
        return out

    capture = {"hidden_states": {"layers": layers(hs, "--hs-layers"), "positions": "all"}}
    if qk != "none":
        capture["qk"] = {"layers": layers(qk, "--qk-layers"), "heads": "all", "positions": "all"}
    return capture


def _collect(argv) -> int:
    from mia_stream.lab import hallucination_data as hd
    from mia_stream.lab.probe_collect import collect

    ap = argparse.ArgumentParser(prog=f"{PROG} collect", description=(
        "Ask the model generated questions with checkable answers through a real vLLM engine with capture; "
        "record the streams (broker + recorder processes) into DIR/recording, label each answer and write "
        "DIR/labels.jsonl (format: mia_stream/analyzers/_probe_collect.py)."))
    ap.add_argument("out", help="output directory (created)")
    ap.add_argument("--sets", nargs="+", default=list(hd.SETS), choices=hd.ALL_SETS,
                    help="question sets (default: all but long_form, which wants --max-tokens 64)")
    ap.add_argument("--questions", help="your own questions instead of --sets: JSON lines with 'question', "
                                        "'answers' (aliases), optional 'set', 'group' (the entity), 'kind' "
                                        f"(one of {', '.join(hd.KINDS)}; default contains)")
    ap.add_argument("--limit", type=int, help="at most this many questions per set (seeded sample)")
    ap.add_argument("--samples", type=int, default=10, help="answers sampled per question for semantic entropy")
    ap.add_argument("--temperature", type=float, default=0.5,
                    help="sampling temperature of those answers (default 0.5: on a 100-question pilot the "
                         "semantic entropy of 10 answers separated wrong answers with AUROC 0.78 at 0.5, 0.75 at "
                         "0.7, 0.58 at 1.0, where a 135M model's samples are mostly noise)")
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--model", help="model dir (default: the embedded model)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-num-seqs", type=int, default=64, help="vLLM's concurrent requests")
    ap.add_argument("--hs-layers", default="every2",
                    help="hidden-state layers to capture: comma-separated, 'all', or 'every2' (0, 2, ..., and the "
                         "last; default)")
    ap.add_argument("--qk-layers", default="all", help="Q/K layers to capture: comma-separated, 'all' (default), "
                                                       "or 'none' (no lookback_ratio data)")
    args = ap.parse_args(argv)
    capture = _capture(args.hs_layers, args.qk_layers, args.model)
    questions = None
    if args.questions:
        questions = hd.load_questions(args.questions)
        if args.limit is not None:
            questions = questions[:args.limit]
    summary = collect(args.out, sets=args.sets, limit=args.limit, samples=args.samples,
                      temperature=args.temperature, max_tokens=args.max_tokens, model=args.model, seed=args.seed,
                      max_num_seqs=args.max_num_seqs, capture=capture, command=_command(["collect", *argv]),
                      questions=questions)
    print(json.dumps(summary, indent=1))
    return 0


def _relabel(argv) -> int:
    from mia_stream.lab import hallucination_data as hd
    from mia_stream.lab.probe_relabel import relabel

    ap = argparse.ArgumentParser(prog=f"{PROG} relabel", description=(
        "Rebuild DIR/labels.jsonl from DIR/recording alone with the current labeller (token ids from the "
        "recording, logprobs from its last layer through the output head; no sampled answers)."))
    ap.add_argument("dir", help="a collect directory (its recording/)")
    ap.add_argument("--sets", nargs="+", default=list(hd.SETS), choices=hd.ALL_SETS, help="as collect was given")
    ap.add_argument("--questions", help="as collect was given")
    ap.add_argument("--limit", type=int)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model")
    ap.add_argument("--hs-layers", required=True, help="the recording's hidden-state layers, comma-separated")
    args = ap.parse_args(argv)
    questions = hd.load_questions(args.questions) if args.questions else None
    summary = relabel(Path(args.dir) / "recording", args.dir, sets=args.sets, limit=args.limit, seed=args.seed,
                      model=args.model, hs_layers=[int(x) for x in args.hs_layers.split(",")], questions=questions,
                      command=_command(["relabel", *argv]), log=_log)
    print(json.dumps(summary, indent=1))
    return 0


def _sample(argv) -> int:
    from mia_stream.lab.probe_collect import add_samples

    ap = argparse.ArgumentParser(prog=f"{PROG} sample", description=(
        "Sample answers for every request of DIR/labels.jsonl on a plain engine (no capture) and write their "
        "clusters and semantic entropy into it (after relabel, or when collect's sampling pass died)."))
    ap.add_argument("dir")
    ap.add_argument("--samples", type=int, default=5)
    ap.add_argument("--temperature", type=float, default=0.5)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    args = ap.parse_args(argv)
    print(json.dumps(add_samples(args.dir, samples=args.samples, temperature=args.temperature,
                                 max_tokens=args.max_tokens, max_num_seqs=args.max_num_seqs,
                                 command=_command(["sample", *argv]))))
    return 0


# ------------------------------------------------------------------------------------------------ train

def _train(argv) -> int:
    from mia_stream.lab import probe_eval as pe
    from mia_stream.lab import probe_metrics as pm
    from mia_stream.lab import probe_train as pt

    ap = argparse.ArgumentParser(prog=f"{PROG} train", description=(
        "Train one detector's probe on the training requests of a collect run and write the probe file "
        "(format mia_stream.probe/1, with training metadata, held-out metrics and an alert threshold calibrated "
        "on the validation split for a false-alert rate on correct answers)."))
    _data_args(ap)
    ap.add_argument("--detector", default="token_probe", choices=pt.DETECTORS)
    ap.add_argument("--layer", help="hidden-state layer (token_probe, semantic_entropy_probe), or 'best': the "
                                    "captured layer (and C) with the best validation answer AUROC (labels files "
                                    "without a validation split: grouped-CV AUROC on the training requests)")
    ap.add_argument("--layers", default="all",
                    help="lookback_ratio: Q/K layers, comma-separated, or 'all' captured (default)")
    ap.add_argument("--position", default="last_prompt", choices=("last_prompt", "generated"),
                    help="semantic_entropy_probe: the last prompt row (TBG) or the last generated row (SLT)")
    ap.add_argument("--rows", default="all", choices=("all", "span"),
                    help="token_probe / lookback_ratio training rows: every generated token with its claim-level "
                         "label (default; function words are negatives) or the answer-span tokens with the "
                         "answer's label")
    ap.add_argument("--logit", action="store_true",
                    help="token_probe: add the token's -log p and entropies (computed by the analyzer from the "
                         "last layer through the output head) to the residual")
    ap.add_argument("--logit-only", action="store_true",
                    help="token_probe: the logit features alone (a learned combination of the free signals)")
    ap.add_argument("--false-alert-rate", type=float, default=pm.FALSE_ALERT_RATE,
                    help="the threshold lets at most this fraction of correct validation answers alert")
    ap.add_argument("--window", type=int, default=pt.LOOKBACK_WINDOW, help="lookback_ratio: feature window")
    ap.add_argument("--out", help="probe file to write (default: print the metrics only)")
    ap.add_argument("--ship", action="store_true", help="write it where the analyzer's default probe lives")
    args = ap.parse_args(argv)
    if args.detector != "lookback_ratio" and args.layer is None:
        ap.error(f"--layer is required for {args.detector}")
    if args.layer not in (None, "best") and not args.layer.isdigit():  # before the recording is read
        ap.error(f"--layer must be a layer number or 'best', got {args.layer!r}")
    ds, _, _ = _dataset(args)
    layers = None if args.layers == "all" else [int(x) for x in args.layers.split(",")]
    opts = {"rows": args.rows, "logit": "only" if args.logit_only else args.logit} if args.detector == "token_probe" else \
        {"position": args.position} if args.detector == "semantic_entropy_probe" else {"rows": args.rows}
    layer, selection, cs = None, None, pt.CS
    if args.detector != "lookback_ratio":
        if args.layer == "best" and ds.calibration_split() == "val":
            fit, layer, table = pe.select_and_fit(ds, args.detector, ds.f.hs_layers, opts, log=_log)
            selection = {"by": "answer AUROC on the validation split (fit on the training requests)",
                         "auc": table}
            cs = (fit["C"],)
        elif args.layer == "best":
            selection = {}
            for candidate in ds.f.hs_layers:  # cross-validation on the training requests only
                fit, _ = pt.train_detector(ds, args.detector, candidate, **opts)
                selection[str(candidate)] = fit["cv_auc"]
                _log(f"layer {candidate}: CV AUROC {fit['cv_auc']}")
            layer = int(max(selection, key=lambda k: selection[k] or 0))
            selection = {"by": "grouped CV AUROC on the training requests", "cv_auc": selection}
        else:
            layer = int(args.layer)
    fit, metrics = pt.train_detector(ds, args.detector, layer, layers, window=args.window, cs=cs, **opts)
    if args.detector != "lookback_ratio":  # the analyzer's answer_risk, calibrated and measured
        split = ds.calibration_split()
        val, test = ds.requests(split), ds.requests("test")
        s_val = pe.answer_scores(ds, args.detector, fit, val.tolist(), layer=layer, **opts)
        s_test = pe.answer_scores(ds, args.detector, fit, test.tolist(), layer=layer, **opts)
        fit["threshold"] = pm.calibrate(s_val[ds.labels[val] == 0], args.false_alert_rate)
        fit["threshold_info"] = (f"answer_risk >= threshold on at most {args.false_alert_rate:.0%} of the correct "
                                 f"{split} answers ({int((ds.labels[val] == 0).sum())})")
        y, groups = ds.labels[test], ds.groups[test]
        metrics["test"]["answer"] = pm.bootstrap(y, {"answer_risk": s_test}, groups)["answer_risk"]
        metrics["test"]["alerts"] = pm.alert_rates(y, s_test, fit["threshold"], groups)
    probe = pt.make_probe(ds, args.detector, fit, metrics, layer=layer, layers=layers, position=args.position,
                          window=args.window, command=_command(["train", *argv]))
    if selection is not None:
        probe.training["layer_selection"] = selection
    out = pt.shipped_probe_path(args.detector) if args.ship else args.out
    if out:
        probe.save(out)
        _log(f"wrote {out}")
    print(json.dumps({"detector": args.detector, "layer": probe.layer, "C": fit["C"], "cv_auc": fit["cv_auc"],
                      "threshold": probe.threshold, **metrics}, indent=1, default=json_default))
    return 0


def _calibrate(argv) -> int:
    from mia_stream.lab import probe_metrics as pm
    from mia_stream.lab.probe_replay import calibrate_file

    ap = argparse.ArgumentParser(prog=f"{PROG} calibrate", description=(
        "Set a probe file's alert threshold from its analyzer's answer_risk on the validation split of a collect "
        "run: the lowest at which at most --false-alert-rate of the correct answers alert."))
    ap.add_argument("probe")
    _data_args(ap)
    ap.add_argument("--false-alert-rate", type=float, default=pm.FALSE_ALERT_RATE)
    ap.add_argument("--out", help="the file to write (default: the probe file itself)")
    args = ap.parse_args(argv)
    ds, rec, _ = _dataset(args)
    r = calibrate_file(ds, rec, args.probe, args.false_alert_rate, args.out or args.probe)
    print(json.dumps(r, indent=1, default=json_default))
    return 0


# ------------------------------------------------------------------------------------------------ eval

def _fmt(v) -> str:
    return "-" if v is None else f"{v:.3f}"


def _eval(argv) -> int:
    from mia_stream.lab import probe_eval as pe
    from mia_stream.lab import probe_metrics as pm
    from mia_stream.lab import probe_train as pt

    ap = argparse.ArgumentParser(prog=f"{PROG} eval", description=(
        "The detectors' report on a collect run: held-out AUROC (95 %% bootstrap CIs by entity) of each detector "
        "(layer and C chosen on the validation split) beside every free baseline of the same moment (token "
        "-log p, entropy, first-token entropy, answer length, the question's prior, sampled semantic entropy), "
        "the paired difference against the best baseline, recall of wrong answers at a threshold calibrated on "
        "the validation split for a false-alert rate on correct answers, per set, and leave-one-relation-out."))
    _data_args(ap)
    ap.add_argument("--variants", nargs="+", default=None, choices=list(pe.VARIANTS),
                    help="detectors to fit and report (default: all; the semantic-entropy probes need samples)")
    ap.add_argument("--layers", help="hidden-state layers to choose from, comma-separated (default: every captured one)")
    ap.add_argument("--false-alert-rate", type=float, default=pm.FALSE_ALERT_RATE,
                    help="calibrate thresholds so at most this fraction of correct answers alert (default 0.1)")
    ap.add_argument("--no-loro", action="store_true", help="skip leave-one-relation-out")
    ap.add_argument("--analyzers", nargs="*", metavar="PROBE",
                    help="also run these probe files (default: the shipped ones) through their analyzers over the "
                         "recording's held-out requests and report the AUROC of what they publish")
    ap.add_argument("--json", help="write every number to this JSON file")
    args = ap.parse_args(argv)
    ds, rec, _ = _dataset(args)
    layers = None if not args.layers else [int(x) for x in args.layers.split(",")]
    variants = args.variants or [v for v in pe.VARIANTS
                                 if ds.header.get("samples") or pe.VARIANTS[v][0] != "semantic_entropy_probe"]
    t0 = time.time()
    rep = pe.evaluate(ds, variants, layers, args.false_alert_rate, loro=not args.no_loro, log=_log)
    rep["command"] = _command(["eval", *argv])
    print(pe.format_report(rep))
    _log(f"eval took {time.time() - t0:.0f} s")
    if args.analyzers is not None:
        from mia_stream.lab.probe_replay import replay_scores

        probes = args.analyzers or [str(pt.shipped_probe_path(d)) for d in pt.DETECTORS]
        print("\nthe probe files through their analyzers (replay of the recording's held-out requests; AUROC of "
              "the published answer_risk, its alerts at the file's threshold):")
        print(f"{'analyzer':>24} {'token':>7} {'answer':>7} {'95% CI':>15} {'false alerts':>12} {'recall':>7} "
              f"{'requests':>9}  probe")
        rep["analyzers"] = {}
        for path in probes:
            r = replay_scores(ds, rec, path)
            rep["analyzers"][path] = r
            print(f"{r['analyzer']:>24} {_fmt(r['token_auc']):>7} {_fmt(r['answer_auc']):>7} "
                  f"[{_fmt(r['answer_ci'][0])},{_fmt(r['answer_ci'][1])}] {_fmt(r['false_alert_rate']):>12} "
                  f"{_fmt(r['recall']):>7} {r['requests']:>9}  {path}", flush=True)
            vs = versus_baseline(ds, r["answer_risk"])
            rep["analyzers"][path]["versus_baseline"] = vs
            if vs is None:
                print(f"{'':>24} (no request scored: the recording lacks what the probe reads?)")
            else:
                p, w = vs["pooled"], vs["within_set"]
                print(f"{'':>24} against {vs['reference']} on the same requests: pooled {_fmt(p['auroc'])} vs "
                      f"{_fmt(p['reference_auroc'])}, difference {p['diff']:+.3f} [{p['diff_ci'][0]:+.3f},"
                      f"{p['diff_ci'][1]:+.3f}]; within each set {_fmt(w['auroc'])} vs {_fmt(w['reference_auroc'])}, "
                      f"difference {w['diff']:+.3f} [{w['diff_ci'][0]:+.3f},{w['diff_ci'][1]:+.3f}]")
            for set_name, a in r["alerts_per_set"].items():
                ci = r["answer_ci_per_set"][set_name]
                print(f"{'':>10}{set_name:>14} {'':>7} {_fmt(r['answer_auc_per_set'][set_name]):>7} "
                      f"[{_fmt(ci[0])},{_fmt(ci[1])}] {_fmt(a['false_alert_rate']):>12} {_fmt(a['recall']):>7} "
                      f"[{_fmt(a['recall_ci'][0])},{_fmt(a['recall_ci'][1])}] ({a['correct']} right, "
                      f"{a['wrong']} wrong)")
    if args.json:
        Path(args.json).write_text(json.dumps(rep, indent=1, default=json_default) + "\n")
    return 0


def versus_baseline(ds, answer_risk: dict, reference: str = "mean_neg_logprob") -> dict | None:
    """A replayed probe's published answer_risk against a free baseline on the same held-out requests: AUROC of
    both and the paired difference with its bootstrap CI by entity, pooled and within each set; None when no
    request was scored."""
    from mia_stream.lab import probe_metrics as pm

    test = ds.requests("test")
    prior = pm.question_prior(ds.records, ds.requests("train").tolist())
    base = pm.baseline_scores(ds.records, test.tolist(), prior, ds.rows)[reference]
    keep = [i for i, r in enumerate(test.tolist()) if ds.records[r]["request_id"] in answer_risk]
    if not keep:
        return None
    reqs = test[keep]
    s = np.asarray([answer_risk[ds.records[r]["request_id"]] for r in reqs.tolist()])
    y, g = ds.labels[reqs], ds.groups[reqs]
    sets = np.asarray([ds.records[r].get("set") for r in reqs.tolist()])
    out = {"reference": reference}
    for name, strata in (("pooled", None), ("within_set", sets)):
        b = pm.bootstrap(y, {"probe": s, reference: np.asarray(base)[keep]}, g, reference=reference, strata=strata)
        out[name] = {"auroc": b["probe"]["auroc"], "ci": b["probe"]["ci"], "diff": b["probe"]["diff"],
                     "diff_ci": b["probe"]["diff_ci"], "reference_auroc": b[reference]["auroc"]}
    return out


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {"collect": _collect, "relabel": _relabel, "sample": _sample, "train": _train, "calibrate": _calibrate, "eval": _eval}
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in commands:
        print(__doc__.strip(), file=sys.stderr if argv and argv[0] not in ("-h", "--help") else sys.stdout)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    try:
        return commands[argv[0]](argv[1:])
    except MiaStreamError as e:
        print(f"{PROG} {argv[0]}: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
