#!/usr/bin/env python
"""Train and evaluate the ``hnode`` probes (the seed's question + answer mode and the before-answer variant) on
facts that Python packages ship, held out by entity, beside the model's own log-probability and entropy taken
at the same moment. Writes ``mia_stream/analyzers/probes/hnode-smollm2-135m.json`` (qa) and
``hnode-before-answer-smollm2-135m.json``.

    python scripts/eval_hnode.py                 # capture (vLLM CPU engine, mia_stream capture) + train + evaluate
    python scripts/eval_hnode.py --reuse         # train and evaluate again from the cached captures

Data (``lab.datasets``: ``countryinfo`` capitals, ``periodictable`` symbols; one entity = one country or element):

- **qa** (the seed's mode): "Q: What is the capital of Chile?\\nA: Santiago" (label 0) and the same question with
  another entity's answer (label 1), plain text, one prefill; the row is the last token (the answer's end).
  Baselines at that moment, from the same engine run (``prompt_logprobs``): the answer tokens' mean negative
  log-probability, and their mean entropy (top-20 renormalized).
- **before_answer** (the project's variant): the chat-templated question; the row is the last prompt token; the
  label is whether the model's greedy answer (16 tokens) is wrong. Baselines at that moment: the entropy of the
  first answer token's distribution (top-20) and the negative log-probability of the greedy first token.

Training: standardized L2 logistic regression; layer (every other one) and C by grouped 5-fold CV on the
training entities only; 30% of the entities held out (seed 0). H-Nodes: the 16 dimensions with the largest positive
standardized weights; baselines: the 90th percentile of their raw activation on the grounded training rows.
Every AUROC comes with a 95% bootstrap interval over held-out entities.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import random
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

from mia_stream.analyzers._probe import PROBES_DIR, LinearProbe, sigmoid  # noqa: E402
from mia_stream.lab import datasets  # noqa: E402
from mia_stream.lab.eval_stats import auroc, bootstrap_ci, fmt_ci  # noqa: E402

SEED = 0
H_NODES = 16
BASELINE_PERCENTILE = 90
CS = (0.001, 0.01, 0.1)
MAX_TOKENS = 16
TOPK = 20


def _log(*a):
    print(f"[{time.strftime('%H:%M:%S')}]", *a, file=sys.stderr, flush=True)


def qa_items(seed: int = SEED) -> list[dict]:
    """Question + answer pairs: each entity's question with its true answer (label 0) and with another entity's
    answer of the same kind (label 1)."""
    rng = random.Random(f"hnode-qa-{seed}")
    caps = [it for it in datasets.capital_questions() if it["id"].endswith("-0")]
    elems = [it for it in datasets.element_questions() if it["id"].startswith("symbol-")]
    out = []
    for pool in (caps, elems):
        answers = sorted({it["answer"] for it in pool})
        for it in pool:
            wrong = rng.choice([a for a in answers if a != it["answer"]])
            for label, ans in ((0, it["answer"]), (1, wrong)):
                out.append({**it, "id": f"{it['id']}-{label}", "given": ans, "label": label,
                            "head": f"Q: {it['question']}\nA:", "text": f"Q: {it['question']}\nA: {ans}"})
    return out


def before_items() -> list[dict]:
    caps = [it for it in datasets.capital_questions() if it["id"].endswith("-0")]
    return caps + datasets.element_questions()


def _entropy(top: dict) -> float:
    lps = np.array([lp.logprob for lp in top.values()], np.float64)
    p = np.exp(lps - lps.max())
    p /= p.sum()
    return float(-(p * np.log(np.maximum(p, 1e-300))).sum())


def capture(work: Path, model_dir: str) -> None:
    from transformers import AutoTokenizer
    from vllm import SamplingParams

    from mia_stream import StreamLLM

    tok = AutoTokenizer.from_pretrained(model_dir)
    cap = {"hidden_states": {"layers": "all", "positions": "last_prompt"}}
    qa, bef = qa_items(), before_items()
    t0 = time.time()
    with StreamLLM(model_dir, dtype="float32", enforce_eager=True, max_model_len=512, seed=SEED, max_num_seqs=64,
                   max_logprobs=TOPK, enable_prefix_caching=False) as sllm:
        _log(f"engine up in {time.time() - t0:.0f} s; qa: {len(qa)} prompts")
        qa_ids = [tok(it["text"])["input_ids"] for it in qa]
        head_len = [len(tok(it["head"])["input_ids"]) for it in qa]
        sp = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=TOPK)
        X, nll, ent = [], [], []
        for i in range(0, len(qa), 64):
            for k, r in enumerate(sllm.generate([{"prompt_token_ids": p} for p in qa_ids[i:i + 64]], sp,
                                                capture=cap, timeout=300)):
                j = i + k
                assert not r.gaps, r.gaps
                X.append(r.tensor("hs")[:, -1].astype(np.float32))  # [L, H]
                plp = r.output.prompt_logprobs
                pos = range(head_len[j], len(qa_ids[j]))  # the answer's tokens (their logprob given what precedes)
                nll.append(-np.mean([plp[t][qa_ids[j][t]].logprob for t in pos]))
                ent.append(np.mean([_entropy(plp[t]) for t in pos]))
        _log(f"qa done ({time.time() - t0:.0f} s); before_answer: {len(bef)} questions, greedy {MAX_TOKENS} tokens")
        bef_ids = [tok.apply_chat_template(datasets.chat_messages(it), add_generation_prompt=True) for it in bef]
        bef_ids = [list(p["input_ids"]) if isinstance(p, dict) or hasattr(p, "keys") else list(p) for p in bef_ids]
        sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=TOPK)
        Xb, texts, ent0, nll0 = [], [], [], []
        for i in range(0, len(bef), 64):
            for r in sllm.generate([{"prompt_token_ids": p} for p in bef_ids[i:i + 64]], sp, capture=cap,
                                   timeout=300):
                assert not r.gaps, r.gaps
                Xb.append(r.tensor("hs")[:, -1].astype(np.float32))
                c = r.output.outputs[0]
                texts.append(c.text)
                ent0.append(_entropy(c.logprobs[0]))
                nll0.append(-c.logprobs[0][c.token_ids[0]].logprob)
        sllm.llm.llm_engine.engine_core.shutdown()
    work.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(work / "hnode.npz", qa_X=np.stack(X), qa_nll=np.array(nll), qa_ent=np.array(ent),
                        b_X=np.stack(Xb), b_ent=np.array(ent0), b_nll=np.array(nll0))
    (work / "hnode.json").write_text(json.dumps({"qa": qa, "before": bef, "texts": texts}))
    _log(f"captured in {time.time() - t0:.0f} s -> {work}")


def _cv_auc(X, y, groups, C):
    from sklearn.linear_model import LogisticRegression
    from sklearn.model_selection import GroupKFold
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    s = np.zeros(len(y))
    for tr, te in GroupKFold(n_splits=5).split(X, y, groups):
        m = make_pipeline(StandardScaler(), LogisticRegression(C=C, class_weight="balanced", max_iter=2000))
        s[te] = m.fit(X[tr], y[tr]).decision_function(X[te])
    return auroc(s, y)


def train_probe(X, y, groups, tr, te, mode, model_dir, extra_baselines, command, data_desc):
    from sklearn.linear_model import LogisticRegression

    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    best, per_layer = None, {}
    for layer in range(0, X.shape[1], 2):  # every other layer: the CV grid stays small on 2 shared cores
        for C in CS:
            a = _cv_auc(X[tr, layer].astype(np.float64), y[tr], groups[tr], C)
            per_layer[layer] = max(per_layer.get(layer, 0.0), a)
            if best is None or a > best[0]:
                best = (a, layer, C)
    cv, layer, C = best
    Xl = X[:, layer].astype(np.float64)
    mean, scale = Xl[tr].mean(0), Xl[tr].std(0)
    scale[scale < 1e-8] = 1.0
    clf = LogisticRegression(C=C, class_weight="balanced", max_iter=5000).fit((Xl[tr] - mean) / scale, y[tr])
    w, b = clf.coef_[0].astype(np.float64), float(clf.intercept_[0])
    nodes = np.argsort(-w)[:H_NODES]  # largest positive weights: above baseline = toward hallucination
    grounded = Xl[tr][y[tr] == 0][:, nodes]
    base = np.percentile(grounded, BASELINE_PERCENTILE, axis=0)
    probe = LinearProbe("hnode", Path(model_dir).name, int(cfg["hidden_size"]), int(layer), "last_prompt", mean,
                        scale, w, b, threshold=0.5, num_layers=int(cfg["num_hidden_layers"]),
                        positive="hallucination: the answer (qa: the given one; before_answer: the model's) is wrong",
                        extra={"mode": mode, "h_nodes": nodes.tolist(), "h_node_baselines": base.tolist(),
                               "baseline_percentile": BASELINE_PERCENTILE})
    p = sigmoid(probe.logits(Xl))
    excess = np.maximum(Xl[:, nodes] - base, 0).mean(1)
    yt, gt = y[te], groups[te]

    def score_ci(s):
        s = np.asarray(s)[te]
        return fmt_ci(auroc(s, yt), bootstrap_ci(lambda ix: auroc(s[ix], yt[ix]), gt))

    rows = {"probe p_hallucination": score_ci(p), "h_node_excess alone": score_ci(excess)}
    for name, s in extra_baselines.items():
        rows[name] = score_ci(s)
    acc = float(np.mean((p[te] >= 0.5) == yt))
    probe.training = {"data": data_desc, "mode": mode, "n_train": int(len(tr)), "n_test": int(len(te)),
                      "split": "by entity (country / element), 30% held out, seed 0",
                      "selection": "layer and C by grouped 5-fold CV AUROC on the training entities",
                      "cv_auc": round(float(cv), 4), "C": C, "cv_auc_by_layer": {str(k): round(v, 4)
                                                                                 for k, v in per_layer.items()},
                      "h_nodes": f"top {H_NODES} positive standardized weights; baseline: percentile "
                                 f"{BASELINE_PERCENTILE} of the grounded training rows (raw units)",
                      "engine": "vLLM CPU, float32, enforce_eager, mia_stream capture", "command": command,
                      "date": datetime.date.today().isoformat()}
    probe.metrics = {"test_auc": round(auroc(p[te], yt), 4), "test_accuracy": round(acc, 4),
                     "test_n": int(len(te)), "test_positives": int(yt.sum()), "table": rows}
    return probe, rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", default="/tmp/mia-hnode")
    ap.add_argument("--reuse", action="store_true")
    ap.add_argument("--model")
    ap.add_argument("--no-write", action="store_true", help="do not overwrite the shipped probe files")
    ap.add_argument("--through-analyzer", type=int, default=0, metavar="N",
                    help="only: run N held-out question + answer pairs through the shipped analyzer on the engine "
                         "and compare with the probe on the captures")
    args = ap.parse_args()
    if args.through_analyzer:
        return through_analyzer(args.through_analyzer, args.model, Path(args.work))
    from mia_stream.model import resolve_model

    model_dir = str(resolve_model(args.model))
    work = Path(args.work)
    if not args.reuse:
        capture(work, model_dir)
    z = np.load(work / "hnode.npz")
    meta = json.loads((work / "hnode.json").read_text())
    command = "python scripts/eval_hnode.py"

    qa = meta["qa"]
    y = np.array([it["label"] for it in qa])
    groups = np.array([it["group"] for it in qa])
    tr, te = datasets.group_split(qa, 0.3, SEED)
    probe, rows = train_probe(z["qa_X"], y, groups, np.array(tr), np.array(te), "qa", model_dir,
                              {"baseline: answer mean -logprob": z["qa_nll"],
                               "baseline: answer mean entropy (top-20)": z["qa_ent"]}, command,
                              "question + answer pairs: country capitals (countryinfo) and element symbols "
                              "(periodictable), each with its true answer and another entity's answer")
    print(f"qa (the seed's mode): layer {probe.layer}, CV AUROC {probe.training['cv_auc']}; held out "
          f"{len(te)} pairs of {len(set(groups[te]))} entities ({int(y[te].sum())} wrong answers)")
    for k, v in rows.items():
        print(f"  {k:<42} AUROC {v}")
    if not args.no_write:
        probe.save(PROBES_DIR / "hnode-smollm2-135m.json")

    bef, texts = meta["before"], meta["texts"]
    y = np.array([0 if datasets.is_correct(it, t) else 1 for it, t in zip(bef, texts)])
    groups = np.array([it["group"] for it in bef])
    tr, te = datasets.group_split(bef, 0.3, SEED)
    probe, rows = train_probe(z["b_X"], y, groups, np.array(tr), np.array(te), "before_answer", model_dir,
                              {"baseline: first-token entropy (top-20)": z["b_ent"],
                               "baseline: first-token -logprob": z["b_nll"]}, command,
                              "chat-templated questions (capitals: 1 phrasing; elements: symbol, number, element of "
                              f"a symbol), greedy {MAX_TOKENS}-token answers labelled by string check")
    print(f"before_answer (variant): layer {probe.layer}, CV AUROC {probe.training['cv_auc']}; held out "
          f"{len(te)} questions of {len(set(groups[te]))} entities ({int(y[te].sum())} answered wrong)")
    for k, v in rows.items():
        print(f"  {k:<42} AUROC {v}")
    if not args.no_write:
        probe.save(PROBES_DIR / "hnode-before-answer-smollm2-135m.json")
    return 0


def through_analyzer(n: int, model: str | None, work: Path) -> int:
    """The shipped (question + answer) analyzer on the engine's stream of ``n`` held-out pairs: its
    ``p_hallucination`` and ``h_node_excess`` equal the probe's on the training capture of the same pairs."""
    from transformers import AutoTokenizer

    from eval_analyzers import stream_requests  # scripts/: the helper the attention evaluations use

    from mia_stream import StreamLLM
    from mia_stream.analyzers import AnalyzerRunner, create
    from mia_stream.analyzers._probe import load_probe
    from mia_stream.model import resolve_model

    model_dir = str(resolve_model(model))
    qa = qa_items()
    _, te = datasets.group_split(qa, 0.3, SEED)
    te = te[:n]
    tok = AutoTokenizer.from_pretrained(model_dir)
    analyzer = create("hnode", {})
    probe = load_probe(PROBES_DIR / "hnode-smollm2-135m.json", "hnode")
    X = np.load(work / "hnode.npz")["qa_X"][te, probe.layer].astype(np.float64)
    want_p = sigmoid(probe.logits(X))
    nodes, base = probe.extra["h_nodes"], np.asarray(probe.extra["h_node_baselines"])
    want_e = np.maximum(X[:, nodes] - base, 0).mean(1)
    prompts = [tok(qa[i]["text"])["input_ids"] for i in te]
    got = {}
    runner = AnalyzerRunner(analyzer, [lambda b: got.update({r.request_id: r for r in b.results()})])
    with StreamLLM(model_dir, dtype="float32", enforce_eager=True, max_model_len=512, seed=SEED,
                   enable_prefix_caching=False) as sllm:
        for ev in stream_requests(sllm, prompts, [{"capture": analyzer.capture_spec()}] * len(prompts)):
            runner.feed(ev)
        sllm.llm.llm_engine.engine_core.shutdown()
    rows = sorted(got.values(), key=lambda r: int(r.request_id.rsplit("-", 1)[1]))
    p = np.array([float(r.value("p_hallucination")[0]) for r in rows])
    e = np.array([float(r.value("h_node_excess")[0]) for r in rows])
    print(f"{len(rows)} held-out pairs through the analyzer: max |p - p_capture| {np.abs(p - want_p).max():.2e}, "
          f"max |excess - excess_capture| {np.abs(e - want_e).max():.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
