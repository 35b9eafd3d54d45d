#!/usr/bin/env python
"""Train the probes the hidden-state analyzers ship, on data made here, and measure them held out.

    python scripts/train_probes.py                      # generate + capture + train + write probes + evaluate
    python scripts/train_probes.py --reuse              # train again from the cached captures (no engine)
    python scripts/train_probes.py --eval-only          # the shipped probes through the analyzers, held out

1. Question sets with checkable answers from packages that ship facts (``mia_stream.lab.datasets``:
   country capitals from ``countryinfo``, element facts from ``periodictable``).
2. Each question goes through the embedded model in a real vLLM engine (CPU, float32, greedy, chat template)
   with mia_stream capture: pass A, every layer's residual at the last prompt token; pass B (element
   questions), the last layer's residual at every generated position. The answer is labelled automatically
   (1 = wrong answer, a hallucination).
3. ``hnode``: per layer, a standardized L2 logistic regression (scikit-learn), regularization and layer chosen by
   grouped 5-fold cross-validation on the training facts only; then refit and scored on held-out facts (30% of
   the facts, split by fact so rephrasings never straddle the split). H-Nodes: the 16 largest |w|.
   ``science_hallucination``: the same on the final-normed (model's RMSNorm) last-layer answer states, mean- or
   last-pooled (chosen by cross-validation).
4. ``--eval``: the held-out questions run through the engine again and the *analyzers* (the shipped probe files,
   the real capture path, ``AnalyzerRunner``) score them; the AUC of their final outputs is printed.

Outputs: ``mia_stream/analyzers/probes/{hnode,science}-smollm2-135m.json`` (format: ``analyzers/_probe.py``) and
the captures cache ``--work`` (default /tmp/mia-probes).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mia_stream.lab import datasets  # noqa: E402
from mia_stream.analyzers._probe import PROBES_DIR, LinearProbe  # noqa: E402

MAX_TOKENS = 24
SEED = 0
H_NODES = 16
CS = (0.001, 0.01, 0.1, 1.0)


def _log(*a):
    print(f"[{time.strftime('%H:%M:%S')}]", *a, file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------------ capture

def _prompts(tok, items):
    out = []
    for it in items:
        text = tok.apply_chat_template(datasets.chat_messages(it), add_generation_prompt=True, tokenize=False)
        out.append({"prompt_token_ids": tok(text, add_special_tokens=False)["input_ids"]})
    return out


def _generate(sllm, prompts, capture, chunk=96):
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, seed=SEED)
    results = []
    for i in range(0, len(prompts), chunk):
        results += sllm.generate(prompts[i:i + chunk], sp, capture=capture, timeout=120)
        _log(f"  {min(i + chunk, len(prompts))}/{len(prompts)}")
    return results


def capture(work: Path, model_dir: str) -> dict:
    from transformers import AutoTokenizer

    from mia_stream import StreamLLM

    caps, elems = datasets.capital_questions(), datasets.element_questions()
    items = caps + elems
    tok = AutoTokenizer.from_pretrained(model_dir)
    prompts = _prompts(tok, items)
    t0 = time.time()
    with StreamLLM(model_dir, dtype="float32", enforce_eager=True, max_model_len=512, seed=SEED,
                   max_num_seqs=64) as sllm:
        _log(f"engine up in {time.time() - t0:.0f} s; pass A: {len(items)} questions, all layers at last_prompt")
        ra = _generate(sllm, prompts, {"hidden_states": {"layers": "all", "positions": "last_prompt"}})
        last_prompt = np.stack([r.tensor("hs")[:, -1] for r in ra]).astype(np.float32)  # [N, L, H]
        texts = [r.text for r in ra]
        n_layers = last_prompt.shape[1]
        idx_b = [i for i, it in enumerate(items) if it["set"] == "elements"]
        _log(f"pass B: {len(idx_b)} element questions, layer {n_layers - 1} at generated positions")
        rb = _generate(sllm, [prompts[i] for i in idx_b],
                       {"hidden_states": {"layers": [n_layers - 1], "positions": "generated"}})
    same = sum(r.text == texts[i] for r, i in zip(rb, idx_b))
    _log(f"pass B answers identical to pass A: {same}/{len(idx_b)}")
    gen_rows = [r.tensor("hs")[0].astype(np.float32) for r in rb]
    labels = np.asarray([0 if datasets.is_correct(it, t) else 1 for it, t in zip(items, texts)], np.int64)
    work.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(work / "captures.npz", last_prompt=last_prompt, labels=labels,
                        gen_lengths=np.asarray([len(g) for g in gen_rows]),
                        gen_rows=np.concatenate(gen_rows) if gen_rows else np.zeros((0, last_prompt.shape[2])),
                        idx_b=np.asarray(idx_b))
    (work / "items.json").write_text(json.dumps({"items": items, "texts": texts, "texts_b": [r.text for r in rb]}))
    return load_captures(work)


def load_captures(work: Path) -> dict:
    z = np.load(work / "captures.npz")
    meta = json.loads((work / "items.json").read_text())
    off = np.concatenate([[0], np.cumsum(z["gen_lengths"])])
    rows = z["gen_rows"]  # read once: each z[...] decompresses the whole array again
    gen = [rows[off[i]:off[i + 1]] for i in range(len(off) - 1)]
    return {"items": meta["items"], "texts": meta["texts"], "labels": z["labels"], "last_prompt": z["last_prompt"],
            "idx_b": z["idx_b"].tolist(), "gen": gen}


# ------------------------------------------------------------------------------------------------ training

def _cv_auc(X, y, groups, C):
    from sklearn.linear_model import LogisticRegression
    from sklearn.metrics import roc_auc_score
    from sklearn.model_selection import GroupKFold
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    scores = np.zeros(len(y))
    for tr, te in GroupKFold(n_splits=5).split(X, y, groups):
        m = make_pipeline(StandardScaler(), LogisticRegression(C=C, class_weight="balanced", max_iter=2000))
        m.fit(X[tr], y[tr])
        scores[te] = m.decision_function(X[te])
    return roc_auc_score(y, scores)


def _fit(X, y, C):
    from sklearn.linear_model import LogisticRegression

    mean, scale = X.mean(0), X.std(0)
    scale[scale < 1e-8] = 1.0
    clf = LogisticRegression(C=C, class_weight="balanced", max_iter=5000).fit((X - mean) / scale, y)
    return mean, scale, clf.coef_[0].astype(np.float64), float(clf.intercept_[0])


def _metrics(probe: LinearProbe, X, y) -> dict:
    from sklearn.metrics import accuracy_score, roc_auc_score

    from mia_stream.analyzers._probe import sigmoid

    p = sigmoid(probe.logits(X))
    return {"auc": round(float(roc_auc_score(y, p)), 4), "accuracy": round(float(accuracy_score(y, p >= 0.5)), 4),
            "n": int(len(y)), "positives": int(y.sum())}


def _select(X_by_option: dict, y, groups):
    best = None
    table = {}
    for option, X in X_by_option.items():
        for C in CS:
            auc = _cv_auc(X, y, groups, C)
            table[f"{option}|C={C}"] = round(float(auc), 4)
            if best is None or auc > best[0]:
                best = (auc, option, C)
    return best, table


def train(data: dict, model_dir: str, command: str) -> dict:
    items, labels = data["items"], data["labels"]
    today = datetime.date.today().isoformat()
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    model_name = Path(model_dir).name
    out = {}

    # ---- hnode: capitals, last prompt token, best layer
    idx = [i for i, it in enumerate(items) if it["set"] == "capitals"]
    sub = [items[i] for i in idx]
    tr, te = datasets.group_split(sub, 0.3, SEED)
    y = labels[idx]
    groups = np.asarray([it["group"] for it in sub])
    X_all = data["last_prompt"][idx].astype(np.float64)  # [N, L, H]
    _log(f"hnode: {len(idx)} capital questions, {int(y.sum())} wrong answers; train {len(tr)} / test {len(te)}")
    (cv_auc, layer, C), table = _select({l: X_all[tr, l] for l in range(X_all.shape[1])}, y[tr], groups[tr])
    mean, scale, w, b = _fit(X_all[tr, layer], y[tr], C)
    nodes = np.argsort(-np.abs(w))[:H_NODES]
    z_tr = (X_all[tr, layer] - mean) / scale
    grounded = z_tr[y[tr] == 0][:, nodes]
    probe = LinearProbe("hnode", model_name, int(cfg["hidden_size"]), int(layer), "last_prompt", mean, scale, w, b,
                        0.5, False, "last", int(cfg["num_hidden_layers"]),
                        "hallucination: the model's answer to the question was wrong",
                        {"h_nodes": nodes.tolist(), "grounded_mean": grounded.mean(0).tolist(),
                         "grounded_std": np.maximum(grounded.std(0), 1e-6).tolist()})
    probe.training = {"data": "country-capital questions (countryinfo), 3 phrasings per country, chat template, "
                              f"greedy answers of {MAX_TOKENS} tokens, labelled by whether the capital's words appear",
                      "n_train": len(tr), "n_test": len(te), "split": "by country, 30% held out, seed 0",
                      "selection": "layer and C by grouped 5-fold CV AUC on the training countries",
                      "cv_auc": round(float(cv_auc), 4), "C": C, "class_weight": "balanced",
                      "cv_table_best_per_layer": {str(l): max(v for k, v in table.items() if k.startswith(f"{l}|"))
                                                  for l in range(X_all.shape[1])},
                      "engine": "vLLM CPU, float32, enforce_eager", "date": today, "command": command}
    probe.metrics = {"test": _metrics(probe, X_all[te, layer], y[te]),
                     "train": _metrics(probe, X_all[tr, layer], y[tr])}
    probe.save(PROBES_DIR / "hnode-smollm2-135m.json")
    _log(f"hnode: layer {layer}, C {C}, CV AUC {cv_auc:.3f}, held-out {probe.metrics['test']}")
    out["hnode"] = probe

    # ---- science_hallucination: element questions, final-normed last-layer answer states
    from mia_stream.analyzers.science_hallucination import final_norm, rms_norm

    weight, eps = final_norm(model_dir)
    idx_b = data["idx_b"]
    sub = [items[i] for i in idx_b]
    keep = [j for j, g in enumerate(data["gen"]) if len(g)]
    sub = [sub[j] for j in keep]
    gen = [rms_norm(data["gen"][j], weight, eps).astype(np.float64) for j in keep]
    y = labels[[idx_b[j] for j in keep]]
    groups = np.asarray([it["group"] for it in sub])
    tr, te = datasets.group_split(sub, 0.3, SEED)
    feats = {"mean": np.stack([g.mean(0) for g in gen]), "last": np.stack([g[-1] for g in gen])}
    _log(f"science: {len(sub)} element questions, {int(y.sum())} wrong answers; train {len(tr)} / test {len(te)}")
    (cv_auc, pool, C), table = _select({k: v[tr] for k, v in feats.items()}, y[tr], groups[tr])
    X = feats[pool]
    mean, scale, w, b = _fit(X[tr], y[tr], C)
    probe = LinearProbe("science_hallucination", model_name, int(cfg["hidden_size"]),
                        int(cfg["num_hidden_layers"]) - 1, "generated", mean, scale, w, b, 0.5, True, pool,
                        int(cfg["num_hidden_layers"]), "hallucination: the model's answer to the question was wrong")
    probe.training = {"data": "element questions (periodictable): symbol, atomic number, element of a symbol; chat "
                              f"template, greedy answers of {MAX_TOKENS} tokens, labelled automatically",
                      "features": f"last layer's residual at the generated positions, the model's final RMSNorm "
                                  f"applied (eps {eps}), {pool}-pooled",
                      "n_train": len(tr), "n_test": len(te), "split": "by element, 30% held out, seed 0",
                      "selection": "pooling and C by grouped 5-fold CV AUC on the training elements",
                      "cv_auc": round(float(cv_auc), 4), "cv_table": table, "C": C, "class_weight": "balanced",
                      "engine": "vLLM CPU, float32, enforce_eager", "date": today, "command": command}
    probe.metrics = {"test": _metrics(probe, X[te], y[te]), "train": _metrics(probe, X[tr], y[tr])}
    probe.save(PROBES_DIR / "science-smollm2-135m.json")
    _log(f"science: pool {pool}, C {C}, CV AUC {cv_auc:.3f}, held-out {probe.metrics['test']}")
    out["science_hallucination"] = probe
    return out


# ------------------------------------------------------------------------------------------------ evaluation

def evaluate(work: Path, model_dir: str) -> dict:
    """The shipped probes, through the analyzers and the real capture path, on the held-out questions: the
    engine streams to a broker, ``run_analyzer`` (what ``mia-stream analyze`` runs) consumes it in a thread."""
    import threading

    from sklearn.metrics import roc_auc_score
    from transformers import AutoTokenizer
    from vllm import SamplingParams

    from mia_stream import StreamLLM
    from mia_stream.analyzers import create, run_analyzer

    data = load_captures(work)
    items, labels = data["items"], data["labels"]
    tok = AutoTokenizer.from_pretrained(model_dir)
    out = {}
    with StreamLLM(model_dir, dtype="float32", enforce_eager=True, max_model_len=512, seed=SEED,
                   max_num_seqs=64) as sllm:
        for name, set_name in (("hnode", "capitals"), ("science_hallucination", "elements")):
            idx = [i for i, it in enumerate(items) if it["set"] == set_name]
            _, te = datasets.group_split([items[i] for i in idx], 0.3, SEED)
            test = [idx[j] for j in te]
            analyzer = create(name)
            finals: dict[str, float] = {}

            def sink(batch, finals=finals, name=name):
                for a in batch.results():
                    if "p_hallucination" in a.values and (name == "hnode" or a.step == -1):
                        finals[a.request_id] = float(a.values["p_hallucination"][-1])

            result = {}
            consumer = threading.Thread(target=lambda: result.setdefault("runner", run_analyzer(
                analyzer, sllm.broker, patterns=[f"eval-{name}-*"], sinks=[sink], max_streams=len(test),
                idle_timeout=300)))
            consumer.start()
            time.sleep(2.0)  # subscribed before the first request starts (from_start covers the rest)
            prompts = _prompts(tok, [items[i] for i in test])
            params = []
            for k in range(len(test)):
                p = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, seed=SEED)
                p.extra_args = {"mia_stream": {"capture": analyzer.capture_spec(), "id": f"eval-{name}-{k}"}}
                params.append(p)
            outputs = sllm.llm.generate(prompts, params, use_tqdm=False)
            consumer.join()
            runner = result["runner"]
            rids = [f"eval-{name}-{k}" for k in range(len(test))]
            y = np.asarray([labels[test[k]] for k, r in enumerate(rids) if r in finals])
            p = np.asarray([finals[r] for r in rids if r in finals])
            same = sum(o.outputs[0].text == data["texts"][test[k]] for k, o in enumerate(outputs))
            auc = float(roc_auc_score(y, p))
            out[name] = {"auc": round(auc, 4), "n": len(y), "positives": int(y.sum()),
                         "accuracy_at_threshold": round(float(((p >= analyzer.threshold) == y).mean()), 4),
                         "answers_as_in_training_capture": f"{same}/{len(test)}",
                         "rejected": runner.counters["rejected"], "request_steps": runner.counters["request_steps"],
                         "gap_seqs": runner.counters["gap_seqs"]}
            _log(f"{name} through the analyzer, held out: {out[name]}")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", default="/tmp/mia-probes", help="captures cache")
    ap.add_argument("--reuse", action="store_true", help="train from the cached captures")
    ap.add_argument("--eval", action="store_true", help="after training, evaluate the analyzers held out")
    ap.add_argument("--eval-only", action="store_true", help="only evaluate the shipped probes")
    ap.add_argument("--model", help="model dir (default: the embedded model)")
    args = ap.parse_args(argv)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from mia_stream.model import default_model_dir

    model_dir = args.model or str(default_model_dir())
    work = Path(args.work)
    if not args.eval_only:
        data = load_captures(work) if args.reuse else capture(work, model_dir)
        probes = train(data, model_dir, "python scripts/train_probes.py" + (" --reuse" if args.reuse else ""))
        print(json.dumps({k: {"layer": p.layer, "pool": p.pool, **p.metrics, "cv_auc": p.training["cv_auc"]}
                          for k, p in probes.items()}, indent=1))
    if args.eval or args.eval_only:
        print(json.dumps({"through_analyzers": evaluate(work, model_dir)}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
