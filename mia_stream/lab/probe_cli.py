"""``mia-stream probe``: make the data, train and evaluate the hallucination detectors (docs/hallucination.md).

    mia-stream probe collect DIR [--limit N] [--samples 10]          # DIR/recording (MCAP), DIR/labels.jsonl
    mia-stream probe train --recording DIR/recording --labels DIR/labels.jsonl --layer L [--detector D] [--out F]
    mia-stream probe eval --data DIR [--analyzers]                   # AUROC per detector and layer, baselines

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
    ap.add_argument("--sets", nargs="+", default=list(hd.SETS), choices=hd.SETS)
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


# ------------------------------------------------------------------------------------------------ train

def _train(argv) -> int:
    from mia_stream.lab import probe_train as pt

    ap = argparse.ArgumentParser(prog=f"{PROG} train", description=(
        "Train one detector's probe on the training requests of a collect run and write the probe file "
        "(format mia_stream.probe/1, with training metadata and held-out metrics)."))
    _data_args(ap)
    ap.add_argument("--detector", default="token_probe", choices=pt.DETECTORS)
    ap.add_argument("--layer", help="hidden-state layer (token_probe, semantic_entropy_probe), or 'best': the "
                                    "captured layer with the best grouped-CV AUROC on the training requests")
    ap.add_argument("--layers", default="all",
                    help="lookback_ratio: Q/K layers, comma-separated, or 'all' captured (default)")
    ap.add_argument("--position", default="last_prompt", choices=("last_prompt", "generated"),
                    help="semantic_entropy_probe: the last prompt row (TBG) or the last generated row (SLT)")
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
    layer, selection = None, None
    if args.detector != "lookback_ratio":
        if args.layer == "best":
            selection = {}
            for candidate in ds.f.hs_layers:  # cross-validation on the training requests only
                fit, _ = pt.train_detector(ds, args.detector, candidate, position=args.position)
                selection[str(candidate)] = fit["cv_auc"]
                _log(f"layer {candidate}: CV AUROC {fit['cv_auc']}")
            layer = int(max(selection, key=lambda k: selection[k] or 0))
        else:
            layer = int(args.layer)
    fit, metrics = pt.train_detector(ds, args.detector, layer, layers, args.position, args.window)
    probe = pt.make_probe(ds, args.detector, fit, metrics, layer=layer, layers=layers, position=args.position,
                          window=args.window, command=_command(["train", *argv]))
    if selection is not None:
        probe.training["layer_selection"] = {"by": "grouped CV AUROC on the training requests", "cv_auc": selection}
    out = pt.shipped_probe_path(args.detector) if args.ship else args.out
    if out:
        probe.save(out)
        _log(f"wrote {out}")
    print(json.dumps({"detector": args.detector, "layer": probe.layer, "C": fit["C"], "cv_auc": fit["cv_auc"],
                      **metrics}, indent=1))
    return 0


# ------------------------------------------------------------------------------------------------ eval

def _fmt(v) -> str:
    return "-" if v is None else f"{v:.3f}"


def _eval(argv) -> int:
    from mia_stream.lab import probe_train as pt

    ap = argparse.ArgumentParser(prog=f"{PROG} eval", description=(
        "Held-out AUROC of each detector per layer (trained here on the training requests, C by grouped CV) "
        "and of the baselines (token log-probability and entropy from vLLM's logprobs, sampled semantic "
        "entropy), on the same tokens and requests."))
    _data_args(ap)
    ap.add_argument("--detectors", nargs="+", default=list(pt.DETECTORS), choices=pt.DETECTORS)
    ap.add_argument("--layers", help="hidden-state layers to sweep, comma-separated (default: every captured one)")
    ap.add_argument("--analyzers", nargs="*", metavar="PROBE",
                    help="also run these probe files (default: the shipped ones) through their analyzers over the "
                         "recording's held-out requests and report the AUROC of what they publish")
    ap.add_argument("--json", help="write every number to this JSON file")
    args = ap.parse_args(argv)
    ds, rec, _ = _dataset(args)
    f = ds.f
    hs_layers = f.hs_layers if not args.layers else [int(x) for x in args.layers.split(",")]
    test = ds.requests("test")
    print(f"data: {len(ds.records)} requests ({int(ds.labels.sum())} wrong answers), held out: {len(test)} "
          f"({int(ds.labels[test].sum())} wrong), split by fact; model {ds.header.get('model')}")
    results: dict = {"header": {k: ds.header.get(k) for k in ("model", "sets", "limit", "samples",
                                                               "sample_temperature", "max_tokens", "requests")},
                     "held_out": {"requests": int(len(test)), "wrong": int(ds.labels[test].sum())}}
    t0 = time.time()
    if "token_probe" in args.detectors:
        print("\ntoken_probe: held-out AUROC (rows: answer-span tokens)")
        print(f"{'layer':>5} {'token':>7} {'answer(span max)':>17} {'answer(max)':>12} {'CV':>7} {'C':>6}")
        rows = {}
        for layer in hs_layers:
            fit, m = pt.train_detector(ds, "token_probe", layer)
            t = m["test"]
            rows[layer] = {"C": fit["C"], "cv_auc": fit["cv_auc"], **t}
            print(f"{layer:>5} {_fmt(t['token_auc']):>7} {_fmt(t['answer_auc_span']):>17} {_fmt(t['answer_auc']):>12} "
                  f"{_fmt(fit['cv_auc']):>7} {fit['C']:>6g}", flush=True)
        results["token_probe"] = rows
    if "semantic_entropy_probe" in args.detectors:
        for position in ("last_prompt", "generated"):
            name = "TBG: last prompt position" if position == "last_prompt" else "SLT: last generated row"
            print(f"\nsemantic_entropy_probe ({name}): held-out AUROC for wrong answers and for high SE")
            print(f"{'layer':>5} {'answer':>7} {'high SE':>8} {'CV':>7} {'C':>6}")
            rows = {}
            for layer in hs_layers:
                fit, m = pt.train_detector(ds, "semantic_entropy_probe", layer, position=position)
                t = m["test"]
                rows[layer] = {"C": fit["C"], "cv_auc": fit["cv_auc"], "se_threshold": fit["se_threshold"], **t}
                print(f"{layer:>5} {_fmt(t['answer_auc']):>7} {_fmt(t['se_auc']):>8} {_fmt(fit['cv_auc']):>7} "
                      f"{fit['C']:>6g}", flush=True)
            results[f"semantic_entropy_probe_{position}"] = rows
    if "lookback_ratio" in args.detectors and f.qk_layers:
        print(f"\nlookback_ratio (window {pt.LOOKBACK_WINDOW}): held-out AUROC (rows: answer-span tokens)")
        print(f"{'layers':>6} {'token':>7} {'answer(span max)':>17} {'answer(max)':>12} {'CV':>7} {'C':>6}")
        rows = {}
        for layers in [[x] for x in f.qk_layers] + [None]:
            fit, m = pt.train_detector(ds, "lookback_ratio", layers=layers)
            t = m["test"]
            key = "all" if layers is None else str(layers[0])
            rows[key] = {"C": fit["C"], "cv_auc": fit["cv_auc"], **t}
            print(f"{key:>6} {_fmt(t['token_auc']):>7} {_fmt(t['answer_auc_span']):>17} {_fmt(t['answer_auc']):>12} "
                  f"{_fmt(fit['cv_auc']):>7} {fit['C']:>6g}", flush=True)
        results["lookback_ratio"] = rows
    base = pt.baselines(ds)
    results["baselines"] = base
    print("\nbaselines (no training), same held-out tokens and requests:")
    print(f"{'baseline':>26} {'token':>7} {'answer(span max)':>17} {'answer(max)':>12} {'answer(mean)':>13}")
    for name in ("neg_logprob", "entropy"):
        b = base[name]
        print(f"{name:>26} {_fmt(b['token_auc']):>7} {_fmt(b['answer_auc_span']):>17} {_fmt(b['answer_auc']):>12} "
              f"{_fmt(b['answer_auc_mean']):>13}")
    se = base["semantic_entropy_sampled"]
    print(f"{'semantic entropy (' + str(se['samples']) + ' samples)':>26} {'':>7} {'':>17} {_fmt(se['answer_auc']):>12}")
    _log(f"eval fits took {time.time() - t0:.0f} s")
    if args.analyzers is not None:
        from mia_stream.lab.probe_replay import replay_scores

        probes = args.analyzers or [str(pt.shipped_probe_path(d)) for d in args.detectors]
        print("\nthe probe files through their analyzers (replay of the recording's held-out requests):")
        print(f"{'analyzer':>24} {'token':>7} {'answer':>7} {'requests':>9}  probe")
        results["analyzers"] = {}
        for path in probes:
            r = replay_scores(ds, rec, path)
            results["analyzers"][path] = r
            print(f"{r['analyzer']:>24} {_fmt(r['token_auc']):>7} {_fmt(r['answer_auc']):>7} {r['requests']:>9}  "
                  f"{path}", flush=True)
        sets = sorted({s for r in results["analyzers"].values() for s in r["answer_auc_per_set"]})
        print("\nanswer AUROC within each question set (held out; '-': one class only):")
        print(f"{'':>26} " + " ".join(f"{s:>12}" for s in sets))
        named = [(r["analyzer"], r["answer_auc_per_set"]) for r in results["analyzers"].values()]
        named += [(f"baseline {k}", base[k]["answer_auc_per_set"]) for k in ("neg_logprob", "entropy",
                                                                             "semantic_entropy_sampled")]
        for name, per in named:
            print(f"{name:>26} " + " ".join(f"{_fmt(per.get(s)):>12}" for s in sets))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1, default=_json_default) + "\n")
    return 0


def _json_default(o):
    if isinstance(o, np.generic):
        return o.item()
    if isinstance(o, np.ndarray):
        return o.tolist()
    raise TypeError(type(o).__name__)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {"collect": _collect, "train": _train, "eval": _eval}
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
