#!/usr/bin/env python
"""Evaluate the attention analyzers on generated sets, through the product path: a vLLM engine (CPU) streams
each request's Q/K through a broker, and the analyzers (``AnalyzerRunner``, the code ``mia-stream analyze``
runs) score them from the stream. One command per table of docs/analyzers.md:

    python scripts/eval_analyzers.py injection   # attention_tracker: discovery, then AUROC on 5 test sets vs keywords
    python scripts/eval_analyzers.py rerank      # core_reranker (ICR, CoRe heads) vs. BM25: nDCG@10, top-1, MRR
    python scripts/eval_analyzers.py sql         # attnlink (seed and project variant): recall vs. BM25, held-out pool

Heads are chosen on data disjoint from the test sets: for injection the paper's head-finding set; for rerank and
sql a *selection pool* (people / tables, document and question templates) that the *test pool* never uses.
Every number is printed with a 95% bootstrap interval over test items, beside its baseline (keyword regex, BM25,
random). Configs are written to ``--configs`` (default /tmp/mia-eval-configs).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import threading
import time
import uuid
from pathlib import Path

import numpy as np

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Head discovery captures Q/K of all 30 layers at every prompt position: ~92 KB per token, ~94 MB for a step of
# 1024 tokens. A producer drops what runs more than a quarter of its ring ahead of the broker (the default
# 256 MiB ring lost a frame to shm_ahead_of_broker here), so the ring is 4x a step's bytes (README).
os.environ.setdefault("MIA_STREAM_SHM_BYTES", str(1 << 30))


# ------------------------------------------------------------------------------------------ streaming

def stream_requests(sllm, prompts, specs, timeout=300.0):
    """Generate ``prompts`` (token id lists), each with its own ``mia_stream`` spec; yield the SDK's batch events
    (``open_batches``, what ``mia-stream analyze`` reads) until every request ended. Request ``i`` is
    ``PREFIX-i``."""
    from vllm import SamplingParams

    from mia_stream.consumers import open_batches

    prefix = f"eval-{uuid.uuid4().hex[:8]}"
    params, ids = [], []
    for i, spec in enumerate(specs):
        rid = f"{prefix}-{i}"
        ids.append(rid)
        params.append(SamplingParams(max_tokens=1, temperature=0.0, extra_args={"mia_stream": {**spec, "id": rid}}))
    done: dict = {}
    ended = set()
    with open_batches(sllm.broker, patterns=[f"{prefix}-*"], timeout=timeout) as events:
        worker = threading.Thread(target=lambda: done.setdefault("out", sllm.llm.generate(
            [{"prompt_token_ids": list(p)} for p in prompts], params, use_tqdm=False)), daemon=True)
        worker.start()
        for ev in events:
            yield ev
            if ev.kind == "end":
                ended.add(ev.stream.request_id)
                if len(ended) == len(ids):
                    break
        worker.join()
    if len(ended) != len(ids):
        raise RuntimeError(f"{len(ids) - len(ended)} request(s) never ended (timeout {timeout} s)")


def run_analyzers(sllm, analyzers, prompts, tags, chunk=8, about=None):
    """Stream ``prompts`` (with per-prompt ``tags``) once, capturing what every analyzer needs, and feed the
    events to each analyzer's runner. Returns, per analyzer, a list (per prompt) of its ``Analysis`` results,
    and the number of gaps seen. ``about(result)``: the request id a result is about (default its own)."""
    from mia_stream.analyzers import AnalyzerRunner

    capture = _union_capture([a.capture_spec() for a in analyzers])
    per = [[None] * len(prompts) for _ in analyzers]
    gaps = 0
    for c0 in range(0, len(prompts), chunk):
        part = list(range(c0, min(c0 + chunk, len(prompts))))
        sinks = [[] for _ in analyzers]
        runners = [AnalyzerRunner(a, [s.append], on_reject=lambda rid, why: print(f"  rejected {rid}: {why}",
                                                                                  file=sys.stderr))
                   for a, s in zip(analyzers, sinks)]
        specs = [{"capture": capture, "tags": tags[i]} for i in part]
        for ev in stream_requests(sllm, [prompts[i] for i in part], specs):
            gaps += ev.kind == "gap"
            for r in runners:
                r.feed(ev)
        for a_i, sink in enumerate(sinks):
            for batch in sink:
                for res in batch.results():
                    rid = about(res) if about is not None and "error" not in res.labels else res.request_id
                    i = part[int(rid.rsplit("-", 1)[1])]
                    per[a_i][i] = res if per[a_i][i] is None or "error" in per[a_i][i].labels else per[a_i][i]
    return per, gaps


def _union_capture(specs):
    layers, heads = set(), set()
    for s in specs:
        qk = s["qk"]
        if qk["layers"] == "all" or qk["heads"] == "all":
            return {"qk": {"layers": "all", "heads": "all", "positions": "prompt"}}
        layers.update(qk["layers"])
        heads.update(qk["heads"])
    return {"qk": {"layers": sorted(layers), "heads": sorted(heads), "positions": "prompt"}}


def _error(res):
    return res is None or "error" in res.labels


# ------------------------------------------------------------------------------------------ injection

def eval_injection(sllm, tok, geo, args):
    from mia_stream.analyzers import create
    from mia_stream.analyzers.attention_tracker import probe_messages
    from mia_stream.lab.attention_data import KEYWORD_PATTERN, TRIGGER_FREE_SPLITS, injection_set
    from mia_stream.lab.eval_stats import auroc, bootstrap_ci, fmt_ci
    from mia_stream.lab.head_discovery import config_from_discovery, discover
    from mia_stream.lab.qk_runs import vllm_attention
    from mia_stream.spans import prompt_parts

    t0 = time.time()
    attend = lambda prompts, layers: vllm_attention(sllm, prompts, layers, chunk=4)  # noqa: E731
    res = discover(tok, attend, geo.num_hidden_layers, args.num_discovery, 4.0)
    k_used = 4.0
    print(f"discovery ({res['num_normal']} normal + {res['num_attack']} attacked, instruction 'Say xxxxxx'): "
          f"heads passing by k: {res['heads_by_k']}; best margin at k=4: {res['best_margin']:.4f} "
          f"(layer {res['best_head'][0]} head {res['best_head'][1]})", flush=True)
    if not res["heads"]:
        k_used = max(float(k) for k, n in res["heads_by_k"].items() if n > 0)
        res = discover(tok, attend, geo.num_hidden_layers, args.num_discovery, k_used)
        print(f"no head at k=4 (the paper's); using k={k_used:g}: {len(res['heads'])} head(s)")
    config = config_from_discovery(res, tok.name_or_path)
    Path(args.configs).mkdir(parents=True, exist_ok=True)
    (Path(args.configs) / "attention_tracker.json").write_text(json.dumps(config, indent=1))
    print(f"heads {config['heads']}, threshold {config['threshold']:.4f} = mean - 4 std of the normal discovery "
          f"prompts' focus (the reference code's rule; the midpoint of the two means would be "
          f"{res['threshold_midway']:.4f}) ({time.time() - t0:.0f} s)", flush=True)

    modes = {"probe": config, "request": {**config, "mode": "request", "probe_token_ids": None}}
    analyzers = [create("attention_tracker", cfg) for cfg in modes.values()]
    # The same rule (mean - 4 std of normal prompts only) on normal prompts like the deployment's: the normal half
    # of another seed of the templated generator (no attack seen), in each mode; the test sets never see them.
    calib = [e for e in injection_set("test", args.num_test, seed=99) if not e.attack]
    calibrated = {}
    for (mode, cfg), analyzer in zip(modes.items(), analyzers):
        pps = [prompt_parts(tok, probe_messages(e.data) if mode == "probe" else e.messages) for e in calib]
        (results,), _ = run_analyzers(sllm, [analyzer], [p.token_ids for p in pps], [p.tags() for p in pps])
        f = np.array([float(r.value("focus")[0]) for r in results])
        calibrated[mode] = float(f.mean() - 4 * f.std())
    print(f"threshold recalibrated by the same rule on {len(calib)} normal prompts of another seed (no attacks): "
          + ", ".join(f"mode {m} {t:.4f}" for m, t in calibrated.items()), flush=True)
    for split in ("test",) + TRIGGER_FREE_SPLITS:
        test = injection_set(split, args.num_test)
        attack = np.array([e.attack for e in test])
        y = attack.astype(int)
        groups = list(range(len(test)))  # every example has its own random sentences: each is an entity
        kw = np.array([len(re.findall(KEYWORD_PATTERN, e.data, re.I)) for e in test], np.float64)
        t0 = time.time()
        print(f"[{split}] {int((~attack).sum())} normal + {int(attack.sum())} attacked", flush=True)
        for (mode, cfg), analyzer in zip(modes.items(), analyzers):
            pps = [prompt_parts(tok, probe_messages(e.data) if mode == "probe" else e.messages) for e in test]
            (results,), gaps = run_analyzers(sllm, [analyzer], [p.token_ids for p in pps], [p.tags() for p in pps])
            focus = np.array([np.nan if _error(r) else float(r.value("focus")[0]) for r in results])
            assert not np.isnan(focus).any(), "a request was rejected"
            s = -focus  # an attack lowers the focus
            a = fmt_ci(auroc(s, y), bootstrap_ci(lambda ix: auroc(s[ix], y[ix]), groups))
            flagged = focus <= cfg["threshold"]
            recal = focus <= calibrated[mode]
            print(f"  attention_tracker mode {mode:<8} AUROC {a}; at threshold {cfg['threshold']:.4f}: TPR "
                  f"{flagged[attack].mean():.3f} FPR {flagged[~attack].mean():.3f}; recalibrated "
                  f"{calibrated[mode]:.4f}: TPR {recal[attack].mean():.3f} FPR {recal[~attack].mean():.3f}  "
                  f"({gaps} gaps)", flush=True)
        n_tok = np.array([float(len(tok(e.data, add_special_tokens=False)["input_ids"])) for e in test])
        print(f"  data length alone (tokens) AUROC {auroc(n_tok, y):.3f}")
        a = fmt_ci(auroc(kw, y), bootstrap_ci(lambda ix: auroc(kw[ix], y[ix]), groups))
        hit = kw > 0
        print(f"  keyword regex baseline   AUROC {a}; any match: TPR {hit[attack].mean():.3f} FPR "
              f"{hit[~attack].mean():.3f}   ({time.time() - t0:.0f} s)", flush=True)


# ------------------------------------------------------------------------------------------ rerank

def _words(text):
    return re.findall(r"[a-z0-9]+", text.lower())


def eval_rerank(sllm, tok, geo, args):
    from rank_bm25 import BM25Okapi

    from mia_stream.analyzers import create
    from mia_stream.lab.attention_data import rerank_set
    from mia_stream.lab.qk_runs import vllm_attention
    from mia_stream.analyzers.core_reranker import ndcg, rank, reciprocal_rank
    from mia_stream.lab.head_discovery import choose_heads
    from mia_stream.spans import prompt_parts

    t0 = time.time()
    attend = lambda prompts, layers: vllm_attention(sllm, prompts, layers, chunk=4)  # noqa: E731
    core = choose_heads(tok, attend, geo.num_hidden_layers, geo.num_attention_heads, args.num_detection, args.top,
                        seed=1)
    Path(args.configs).mkdir(parents=True, exist_ok=True)
    (Path(args.configs) / "core_reranker.json").write_text(json.dumps(core, indent=1))
    print(f"CoRe heads (top {args.top} by MRR on {args.num_detection} detection questions of the selection pool: "
          f"people, document and query templates disjoint from the test pool): {core['heads']} "
          f"({time.time() - t0:.0f} s)")

    test = rerank_set(args.num_test, seed=0, pool="test")
    prompts, tags = [], []
    for i, e in enumerate(test):
        for role, msgs in (("calibration", e.calibration_messages), ("query", e.messages)):  # calibration first
            pp = prompt_parts(tok, msgs)
            prompts.append(pp.token_ids)
            tags.append({**pp.tags(), "core_reranker": {"group": f"q{i}", "role": role}})
    variants = [("ICR (all heads, N/A calibration, mean-2std mask)", {"heads": "all"}),
                ("ICR without calibration", {"heads": "all", "calibrate": False}),
                (f"CoRe heads ({len(core['heads'])}), calibrated", {"heads": core["heads"]})]
    analyzers = [create("core_reranker", cfg) for _, cfg in variants]
    t0 = time.time()
    per, gaps = run_analyzers(sllm, analyzers, prompts, tags, chunk=4,
                              about=lambda r: r.labels["query_request"][0])
    print(f"test: {len(test)} questions x {len(test[0].documents)} documents (1 relevant; hard negatives: the same "
          f"person's other facts, other people's same fact), half with paraphrased queries; {gaps} gaps, "
          f"{time.time() - t0:.0f} s")

    from mia_stream.lab.eval_stats import bootstrap_ci

    def table(name, rankings):
        nd = np.array([np.nan if r is None else ndcg(r, e.relevant) for r, e in zip(rankings, test)])
        ok = ~np.isnan(nd)
        lo, hi = bootstrap_ci(lambda ix: nd[ix][ok[ix]].mean(), list(range(len(test))))  # each query is its entity
        rows = {}
        for subset, pick in (("all", lambda e: True), ("lexical", lambda e: not e.paraphrased),
                             ("paraphrased", lambda e: e.paraphrased)):
            sel = [(r, e) for r, e in zip(rankings, test) if pick(e) and r is not None]
            rows[subset] = (np.mean([ndcg(r, e.relevant) for r, e in sel]),
                            np.mean([r[0] in e.relevant for r, e in sel]),
                            np.mean([reciprocal_rank(r, e.relevant) for r, e in sel]), len(sel))
        print(f"  {name:<50} " + "  ".join(f"{s}: nDCG@10 {v[0]:.3f} top-1 {v[1]:.3f} MRR {v[2]:.3f} (n={v[3]})"
                                           for s, v in rows.items()) + f"  [all nDCG@10 95% CI {lo:.3f}, {hi:.3f}]")

    bm25 = []
    for e in test:
        scorer = BM25Okapi([_words(d) for d in e.documents])
        bm25.append(list(rank(scorer.get_scores(_words(e.query)))))
    table("BM25 (rank-bm25 Okapi, same documents)", bm25)
    n_docs = len(test[0].documents)
    print(f"  {'random order (expected)':<50} all: nDCG@10 "
          f"{np.mean([1 / np.log2(r + 2) for r in range(min(n_docs, 10))]) * min(n_docs, 10) / n_docs:.3f} "
          f"top-1 {1 / n_docs:.3f} MRR {np.mean([1 / (r + 1) for r in range(n_docs)]):.3f}")
    for (name, _), results in zip(variants, per):
        rankings = []
        for i in range(len(test)):
            r = results[2 * i + 1]  # the query request (prompts alternate calibration, query)
            rankings.append(None if _error(r) else list(r.value("ranking")[0][:int(r.value("num_docs")[0])]))
        table(name, rankings)


# ------------------------------------------------------------------------------------------ sql

def _bm25_order(e):
    from rank_bm25 import BM25Okapi

    docs = [_words(c.replace(".", " ").replace("_", " ")) for c in e.columns]
    return np.argsort(-BM25Okapi(docs).get_scores(_words(e.question)), kind="stable")


SQL_VARIANTS = {  # name -> (head selection and analyzer settings, prompt form)
    "seed": ({"anchor": "last_prompt", "pooling": "mean", "top_p": 0.8}, "seed"),
    "project": ({"anchor": "question", "pooling": "sum", "top_p": 0.9}, "project"),
}


def eval_sql(sllm, tok, geo, args):
    from mia_stream.analyzers import create
    from mia_stream.lab.attention_data import sql_set
    from mia_stream.lab.eval_stats import bootstrap_ci, fmt_ci
    from mia_stream.lab.head_discovery import choose_head
    from mia_stream.lab.qk_runs import vllm_attention
    from mia_stream.spans import prompt_parts

    attend = lambda prompts, layers: vllm_attention(sllm, prompts, layers, chunk=4)  # noqa: E731
    Path(args.configs).mkdir(parents=True, exist_ok=True)
    for name in args.variants:
        settings, form = SQL_VARIANTS[name]
        t0 = time.time()
        cfg = choose_head(tok, attend, geo.num_hidden_layers, args.num_detection, seed=1, top_p=settings["top_p"],
                          temperature=1.0, anchor=settings["anchor"], pooling=settings["pooling"], form=form)
        (Path(args.configs) / f"attnlink-{name}.json").write_text(json.dumps(cfg, indent=1))
        print(f"[{name}] prompt form {form!r}, anchor {settings['anchor']}, pooling {settings['pooling']}, top_p "
              f"{settings['top_p']}: head layer {cfg['layer']} head {cfg['head']} (gold MRR "
              f"{cfg['selection']['gold_mrr']:.3f} on {args.num_detection} questions of the selection pool) "
              f"({time.time() - t0:.0f} s)", flush=True)
        test = sql_set(args.num_test, seed=0, pool="test", form=form)
        pps = [prompt_parts(tok, e.messages) for e in test]
        tags = [{**pp.tags(), "attnlink": {"columns": e.columns}} for pp, e in zip(pps, test)]
        t0 = time.time()
        (results,), gaps = run_analyzers(sllm, [create("attnlink", cfg)], [p.token_ids for p in pps], tags)
        print(f"  test pool: {len(test)} questions ({len(set(e.question for e in test))} templates, tables and "
              f"templates disjoint from the selection pool), {np.mean([len(e.columns) for e in test]):.1f} "
              f"columns, {np.mean([len(e.gold) for e in test]):.1f} gold; {gaps} gaps, {time.time() - t0:.0f} s")
        rows = []  # per question: recall, precision, size, recall@|gold|, BM25 recall (same size), random, BM25@|gold|
        for r, e in zip(results, test):
            if _error(r):
                print(f"  error: {r.labels if r else None}")
                continue
            n = int(r.value("num_columns")[0])
            sel = set(np.flatnonzero(r.value("selected")[0][:n]).tolist())
            top = set(np.argsort(-r.value("scores")[0][:n], kind="stable")[:len(e.gold)].tolist())
            bm = _bm25_order(e)
            g = len(e.gold)
            rows.append((len(sel & e.gold) / g, len(sel & e.gold) / len(sel), len(sel), len(top & e.gold) / g,
                         len(set(bm[:len(sel)].tolist()) & e.gold) / g, min(len(sel), n) / n,
                         len(set(bm[:g].tolist()) & e.gold) / g, g / n, e.question))
        m = np.array([r[:8] for r in rows], np.float64)
        groups = [r[8] for r in rows]  # resample question templates

        def col(j):
            return fmt_ci(m[:, j].mean(), bootstrap_ci(lambda ix: m[ix, j].mean(), groups))

        print(f"  attnlink [{name}]  recall {col(0)}  precision {col(1)}  selected {m[:, 2].mean():.1f} columns  "
              f"recall@|gold| {col(3)}  (n={len(m)})")
        print(f"  same selection sizes: BM25 over column names recall {col(4)}; random recall (expected) "
              f"{m[:, 5].mean():.3f}")
        print(f"  recall@|gold|: BM25 {col(6)}; random (expected) {m[:, 7].mean():.3f}", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("task", choices=("injection", "rerank", "sql"))
    ap.add_argument("--model", help="model dir (default: the embedded model)")
    ap.add_argument("--configs", default="/tmp/mia-eval-configs", help="where the chosen configs are written")
    ap.add_argument("--num-discovery", type=int, default=25, help="injection: normal and attacked prompts each")
    ap.add_argument("--num-detection", type=int, default=20, help="rerank/sql: head selection questions")
    ap.add_argument("--num-test", type=int, default=None,
                    help="test size (injection: per class, default 100; rerank: questions, 40; sql: 42)")
    ap.add_argument("--top", type=int, default=8, help="rerank: CoRe heads to keep")
    ap.add_argument("--variants", nargs="+", choices=("seed", "project"), default=["seed", "project"],
                    help="sql: the seed's attnlink (column@table prompt, last prompt row, mean, top_p 0.8) and/or "
                         "the project's variant (SQL prompt, question rows, sum, top_p 0.9)")
    args = ap.parse_args()
    if args.num_test is None:
        args.num_test = {"injection": 50, "rerank": 40, "sql": 40}[args.task]

    from transformers import AutoConfig, AutoTokenizer

    from mia_stream import StreamLLM
    from mia_stream.model import resolve_model

    model_dir = resolve_model(args.model)
    tok = AutoTokenizer.from_pretrained(model_dir)
    geo = AutoConfig.from_pretrained(model_dir)
    t0 = time.time()
    with StreamLLM(model_dir, dtype="float32", enforce_eager=True, max_model_len=2048, max_num_batched_tokens=1024,
                   seed=0) as sllm:
        print(f"model {model_dir}; engine started in {time.time() - t0:.0f} s", flush=True)
        {"injection": eval_injection, "rerank": eval_rerank, "sql": eval_sql}[args.task](sllm, tok, geo, args)
        sllm.llm.llm_engine.engine_core.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
