#!/usr/bin/env python
"""Train and evaluate ``science_hallucination`` as the seed's SciHal claim classifier (reference + claim ->
entailment / contradiction / unverifiable) on claims generated from package facts, held out by entity, beside
two baselines; writes ``mia_stream/analyzers/probes/science-smollm2-135m.json``.

    python scripts/eval_science.py             # capture (vLLM CPU engine, mia_stream capture) + train + evaluate
    python scripts/eval_science.py --reuse     # train and evaluate again from the cached captures

1. Data: ``lab.claims_data.claim_set()`` (countries from ``countryinfo``, chemical elements from
   ``periodictable``): per entity a reference passage and three claims, one per class. 30% of the entities held
   out (seed 0).
2. Capture: each claim in the seed's SciHal prompt (``scihal_messages``), every layer's residual at the last
   prompt token, through a vLLM engine with mia_stream capture. Baseline prompt: "is the claim true or false?"
   with the answer "true" appended; the engine's ``prompt_logprobs`` give the model's log-probability of "true".
3. Classifiers (multinomial logistic regression, C by grouped 5-fold CV on the training entities):
   ``seed`` the last layer with the model's final RMSNorm (the seed's features); ``best layer`` the layer with
   the best CV macro-F1 (even layers); baselines: a lexical-overlap classifier (claim words found in the
   reference, numbers of the claim missing from it) and the logprob of "true", each a multinomial LR on the same
   training entities. Macro-F1 and per-class recall held out, 95% bootstrap intervals over held-out entities.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
for _v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):  # BLAS threads on 2 shared cores made
    os.environ.setdefault(_v, "1")  # each scikit-learn fit 100-300x slower (0.1 s -> 11-39 s) under load

from mia_stream.analyzers._probe import PROBES_DIR  # noqa: E402
from mia_stream.analyzers.science_hallucination import (SCIHAL_CLASSES, MulticlassProbe, final_norm,  # noqa: E402
                                                        rms_norm)
from mia_stream.lab import datasets  # noqa: E402
from mia_stream.lab.claims_data import LABELS, claim_set, scihal_messages, true_false_messages  # noqa: E402
from mia_stream.lab.eval_stats import bootstrap_ci, fmt_ci, macro_f1, recall_per_class  # noqa: E402

SEED = 0
CS = (0.01, 0.1, 1.0)
CLASSES = list(range(len(LABELS)))


def _log(*a):
    print(f"[{time.strftime('%H:%M:%S')}]", *a, file=sys.stderr, flush=True)


def _ids(tok, messages):
    r = tok.apply_chat_template(messages, add_generation_prompt=True)
    return list(r["input_ids"] if hasattr(r, "keys") else r)


def capture(work: Path, model_dir: str, items: list) -> None:
    from transformers import AutoTokenizer
    from vllm import SamplingParams

    from mia_stream import StreamLLM

    tok = AutoTokenizer.from_pretrained(model_dir)
    prompts = [_ids(tok, scihal_messages(it["reference"], it["claim"])) for it in items]
    true_id = tok.encode("true", add_special_tokens=False)
    assert len(true_id) == 1, true_id
    tf = [_ids(tok, true_false_messages(it["reference"], it["claim"])) + true_id for it in items]
    cap = {"hidden_states": {"layers": "all", "positions": "last_prompt"}}
    t0 = time.time()
    with StreamLLM(model_dir, dtype="float32", enforce_eager=True, max_model_len=1024, seed=SEED, max_num_seqs=32,
                   enable_prefix_caching=False) as sllm:
        _log(f"engine up in {time.time() - t0:.0f} s; {len(items)} claims (prompts of {np.mean([len(p) for p in prompts]):.0f} tokens)")
        X = []
        for i in range(0, len(prompts), 32):
            for r in sllm.generate([{"prompt_token_ids": p} for p in prompts[i:i + 32]],
                                   SamplingParams(max_tokens=1, temperature=0.0), capture=cap, timeout=600):
                assert not r.gaps, r.gaps
                X.append(r.tensor("hs")[:, -1].astype(np.float32))
            _log(f"  {min(i + 32, len(prompts))}/{len(prompts)}")
        outs = sllm.llm.generate([{"prompt_token_ids": p} for p in tf],
                                 SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1), use_tqdm=False)
        lp_true = [o.prompt_logprobs[-1][true_id[0]].logprob for o in outs]
        sllm.llm.llm_engine.engine_core.shutdown()
    work.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(work / "science.npz", X=np.stack(X), lp_true=np.array(lp_true))
    _log(f"captured in {time.time() - t0:.0f} s -> {work}")


_STOP = set("a an the of is in are to from its it has have with by and or called use uses start lies".split())


def lexical_features(it: dict) -> list[float]:
    """Claim words (not the entity's name, not stopwords) found in the reference; numbers of the claim missing."""
    ref = set(re.findall(r"[a-z0-9.+]+", it["reference"].lower()))
    name = set(re.findall(r"[a-z0-9]+", it["entity"].lower()))
    words = [w for w in re.findall(r"[a-z0-9.+]+", it["claim"].lower()) if w not in _STOP and w not in name]
    found = [w in ref for w in words]
    nums = [w for w in words if re.fullmatch(r"[+]?[0-9.]+", w)]
    return [float(np.mean(found)) if words else 1.0, float(len(words) - sum(found)),
            float(any(n not in ref for n in nums))]


def _fit_lr(X, y, C):
    from sklearn.linear_model import LogisticRegression

    mean, scale = X.mean(0), X.std(0)
    scale[scale < 1e-8] = 1.0
    clf = LogisticRegression(C=C, max_iter=3000).fit((X - mean) / scale, y)
    return mean, scale, clf


def _cv_f1(X, y, groups, C):
    from sklearn.model_selection import GroupKFold

    pred = np.zeros(len(y), int)
    for tr, te in GroupKFold(n_splits=5).split(X, y, groups):
        mean, scale, clf = _fit_lr(X[tr], y[tr], C)
        pred[te] = clf.predict((X[te] - mean) / scale)
    return macro_f1(pred, y, CLASSES)


def _choose(X, y, groups):
    best = max(((_cv_f1(X, y, groups, C), C) for C in CS))
    return best


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", default="/tmp/mia-science")
    ap.add_argument("--reuse", action="store_true")
    ap.add_argument("--model")
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--through-analyzer", type=int, default=0, metavar="N",
                    help="only: run N held-out claims through the shipped analyzer on the engine (AnalyzerRunner on "
                         "the stream, as `mia-stream analyze` runs) and compare with the probe on the captures")
    args = ap.parse_args()
    if args.through_analyzer:
        return through_analyzer(args.through_analyzer, args.model, Path(args.work))
    from mia_stream.model import resolve_model

    model_dir = str(resolve_model(args.model))
    items = claim_set()
    work = Path(args.work)
    if not args.reuse:
        capture(work, model_dir, items)
    z = np.load(work / "science.npz")
    X_all, lp = z["X"].astype(np.float64), z["lp_true"]
    y = np.array([it["label"] for it in items])
    groups = np.array([it["group"] for it in items])
    tr, te = map(np.array, datasets.group_split(items, 0.3, SEED))
    L = X_all.shape[1]
    weight, eps = final_norm(model_dir)
    X_seed = rms_norm(X_all[:, L - 1].astype(np.float32), weight, eps).astype(np.float64)

    candidates = {"seed: last layer, final-normed": (X_seed, L - 1, True)}
    cv_by_layer = {}
    for layer in range(0, L, 2):
        f1, C = _choose(X_all[tr, layer], y[tr], groups[tr])
        cv_by_layer[layer] = round(f1, 4)
    best_layer = max(cv_by_layer, key=cv_by_layer.get)
    candidates[f"best layer by CV ({best_layer})"] = (X_all[:, best_layer], best_layer, False)
    lex = np.array([lexical_features(it) for it in items])
    baselines = {"baseline: lexical overlap LR": lex, "baseline: logprob of 'true' LR": lp[:, None]}

    yt, gt = y[te], groups[te]
    by_domain = ", ".join(f"{d}: {sum(it['domain'] == d for it in items)}" for d in ("countries", "elements"))
    print(f"{len(items)} claims ({by_domain}), "
          f"{len(set(groups))} entities; held out {len(te)} claims of {len(set(gt))} entities; classes {LABELS}")
    print(f"CV macro-F1 by layer (training entities): {cv_by_layer}")
    results, fitted = {}, {}
    for name, X in list({k: v[0] for k, v in candidates.items()}.items()) + list(baselines.items()):
        f1cv, C = _choose(X[tr], y[tr], groups[tr])
        mean, scale, clf = _fit_lr(X[tr], y[tr], C)
        pred = clf.predict((X - mean) / scale)
        fitted[name] = (mean, scale, clf, C, f1cv)
        pt = pred[te]
        f1 = fmt_ci(macro_f1(pt, yt, CLASSES), bootstrap_ci(lambda ix: macro_f1(pt[ix], yt[ix], CLASSES), gt))
        rec = recall_per_class(pt, yt, CLASSES)
        results[name] = {"macro_f1": f1, "recall": {LABELS[c]: round(r, 3) for c, r in zip(CLASSES, rec)},
                         "cv_macro_f1": round(f1cv, 4), "C": C}
        print(f"  {name:<36} macro-F1 {f1}  recall " + " ".join(f"{LABELS[c]} {r:.3f}" for c, r in zip(CLASSES, rec))
              + f"  (CV {f1cv:.3f}, C={C})", flush=True)
    for d in ("countries", "elements"):
        ix = np.array([k for k, i in enumerate(te) if items[i]["domain"] == d])
        line = []
        for name in results:
            mean, scale, clf = fitted[name][:3]
            X = {**{k: v[0] for k, v in candidates.items()}, **baselines}[name]
            line.append(f"{name.split(':')[0] if 'baseline' not in name else name.split(': ')[1]} "
                        f"{macro_f1(clf.predict((X[te][ix] - mean) / scale), yt[ix], CLASSES):.3f}")
        print(f"  held-out {d} only (n={len(ix)}): macro-F1 " + "; ".join(line))

    # ship the hidden-state classifier with the better CV macro-F1 as the default, and the seed's features (the
    # final layer, final-normed) beside it
    best = max(candidates, key=lambda k: fitted[k][4])
    for name in candidates:
        out = "science-smollm2-135m.json" if name == best else "science-final-norm-smollm2-135m.json"
        _write(name, candidates[name], fitted[name], items, tr, te, cv_by_layer, results, model_dir, out,
               args.no_write)
    return 0


def _write(name, candidate, fit, items, tr, te, cv_by_layer, results, model_dir, out, no_write):
    _, layer, normed = candidate
    mean, scale, clf, C, f1cv = fit
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    probe = MulticlassProbe("science_hallucination", Path(model_dir).name, int(cfg["hidden_size"]),
                            int(cfg["num_hidden_layers"]), int(layer), "last_prompt", bool(normed), list(LABELS),
                            mean, scale, clf.coef_.astype(np.float64), clf.intercept_.astype(np.float64))
    assert tuple(LABELS) == SCIHAL_CLASSES
    probe.training = {"data": "lab.claims_data.claim_set(): countries (countryinfo) and chemical elements "
                              "(periodictable), per entity a reference passage and one claim per class",
                      "prompt": "the seed's SciHal prompt (lab.claims_data.scihal_messages), last prompt token",
                      "chosen": name, "n_train": int(len(tr)), "n_test": int(len(te)),
                      "split": "by entity, 30% held out, seed 0", "C": C, "cv_macro_f1": round(f1cv, 4),
                      "cv_macro_f1_by_layer": {str(k): v for k, v in cv_by_layer.items()},
                      "engine": "vLLM CPU, float32, enforce_eager, mia_stream capture",
                      "command": "python scripts/eval_science.py", "date": datetime.date.today().isoformat()}
    probe.metrics = {"test": results}
    if not no_write:
        probe.save(PROBES_DIR / out)
        print(f"wrote the {name!r} classifier -> {out}")


def through_analyzer(n: int, model: str | None, work: Path) -> int:
    """The shipped analyzer on the engine's stream of ``n`` held-out claims: its probabilities equal the probe's
    on the training capture of the same claims (the capture path is the product's)."""
    from transformers import AutoTokenizer

    from eval_analyzers import stream_requests  # scripts/: the helper the attention evaluations use

    from mia_stream import StreamLLM
    from mia_stream.analyzers import AnalyzerRunner, create
    from mia_stream.analyzers.science_hallucination import load_multiclass_probe
    from mia_stream.model import resolve_model

    model_dir = str(resolve_model(model))
    items = claim_set()
    _, te = datasets.group_split(items, 0.3, SEED)
    te = te[:n]
    tok = AutoTokenizer.from_pretrained(model_dir)
    analyzer = create("science_hallucination", {})
    probe = load_multiclass_probe(PROBES_DIR / "science-smollm2-135m.json")
    X = np.load(work / "science.npz")["X"][te, probe.layer].astype(np.float64)
    if probe.final_norm:
        X = rms_norm(X.astype(np.float32), *final_norm(model_dir)).astype(np.float64)
    want = probe.probs(X)
    prompts = [_ids(tok, scihal_messages(items[i]["reference"], items[i]["claim"])) for i in te]
    got = {}
    runner = AnalyzerRunner(analyzer, [lambda b: got.update({r.request_id: r for r in b.results()})])
    with StreamLLM(model_dir, dtype="float32", enforce_eager=True, max_model_len=1024, seed=SEED,
                   enable_prefix_caching=False) as sllm:
        for ev in stream_requests(sllm, prompts, [{"capture": analyzer.capture_spec()}] * len(prompts)):
            runner.feed(ev)
        sllm.llm.llm_engine.engine_core.shutdown()
    rows = sorted(got.values(), key=lambda r: int(r.request_id.rsplit("-", 1)[1]))
    p = np.stack([r.value("probs")[0] for r in rows])
    print(f"{len(rows)} held-out claims through the analyzer: max |p - p_capture| {np.abs(p - want).max():.2e}; "
          f"same prediction {int((p.argmax(1) == want.argmax(1)).sum())}/{len(rows)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
