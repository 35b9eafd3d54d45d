"""Head discovery for the attention analyzers: run a generated, labelled prompt set through a model, score every
head, and write the analyzer's config. Offline work (it loads a model and the lab's data sets), so it lives in
the lab; the analyzers keep only the pure scoring math it calls (``discover_heads``, ``select_head``,
``select_heads``).

    python -m mia_stream.lab.head_discovery attention_tracker discover --out tracker.json [--k 4] [--model DIR]
    python -m mia_stream.lab.head_discovery core_reranker select-heads --out core.json [--top 8] [--num 20]
    python -m mia_stream.lab.head_discovery attnlink select-head --out link.json [--anchor question] [--num 20]

(``mia-stream heads ...`` is the same command.) ``attend`` is a ``lab.qk_runs`` backend: prompts -> one
``PromptAttention`` per prompt.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Sequence

import numpy as np

from mia_stream.analyzers.attention_tracker import (DEFAULT_K, DEFAULT_THRESHOLD_K, PROBE_INSTRUCTION, discover_heads,
                                                   instruction_ratios, probe_messages, span_masks)
from mia_stream.analyzers.attnlink import column_scores, select_head
from mia_stream.analyzers.core_reranker import doc_scores, rank, reciprocal_rank, select_heads
from mia_stream.spans import prompt_parts

# ---------------------------------------------------------------------------------------- attention_tracker


def all_head_ratios(attend, tokenizer, examples: Sequence, num_layers: int) -> np.ndarray:
    """Every head's ratio ``[len(examples), L, H]`` for examples with ``messages`` (spans ``instruction``/``data``)."""
    pps = [prompt_parts(tokenizer, e.messages) for e in examples]
    out = []
    for pp, att in zip(pps, attend([p.token_ids for p in pps], list(range(num_layers)))):
        n = len(pp.token_ids)
        alpha = att.rows([n - 1])[:, :, 0]  # [L, H, n]
        out.append(instruction_ratios(alpha, *span_masks(pp.tags()["spans"], n)))
    return np.stack(out)


def discover(tokenizer, attend, num_layers: int, num: int = 25, k: float = DEFAULT_K,
             threshold_k: float = DEFAULT_THRESHOLD_K) -> dict:
    """Run the discovery set through ``attend`` (``qk_runs``) and return ``discover_heads``' result, with the
    probe instruction's token ids (``probe_token_ids``) for mode "probe"."""
    from mia_stream.lab.attention_data import injection_set

    examples = injection_set("discovery", num)
    ratios = all_head_ratios(attend, tokenizer, examples, num_layers)
    flags = np.array([e.attack for e in examples])
    res = discover_heads(ratios[~flags], ratios[flags], k, threshold_k)
    pp = prompt_parts(tokenizer, probe_messages("x"))
    (a, b), = pp.ranges("instruction")
    res["probe_token_ids"] = [int(t) for t in pp.token_ids[a:b]]
    return res


def config_from_discovery(res: dict, model: str) -> dict | None:
    """The analyzer config a discovery result gives (None: no head passed): mode "probe" (the paper's)."""
    if not res["heads"]:
        return None
    rest = {k: v for k, v in res.items() if k not in ("heads", "threshold", "probe_token_ids")}
    return {"heads": res["heads"], "threshold": res["threshold"], "mode": "probe",
            "probe_token_ids": res["probe_token_ids"], "model": model,
            "discovery": {**rest, "probe_instruction": PROBE_INSTRUCTION}}


def attention_tracker_main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mia_stream.lab.head_discovery attention_tracker",
                                 description="Find a model's important heads for attention_tracker and write "
                                             "its config (normal vs. 'ignore previous instruction' data).")
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("discover", help="run the head discovery and write a config")
    d.add_argument("--out", required=True, help="config file to write (JSON)")
    d.add_argument("--model", help="model dir (default: the embedded model)")
    d.add_argument("--num", type=int, default=25, help="normal and attacked prompts each (default 25)")
    d.add_argument("--k", type=float, default=DEFAULT_K, help="the k of mu - k sigma (default 4, the paper's)")
    d.add_argument("--threshold-k", type=float, default=DEFAULT_THRESHOLD_K,
                   help="threshold = mean - k std of the normal prompts' focus (default 4, the reference code's)")
    d.add_argument("--backend", choices=("vllm", "hf"), default="vllm")
    args = ap.parse_args(argv)

    from transformers import AutoConfig

    from mia_stream.lab.qk_runs import attention_backend

    with attention_backend(args.model, args.backend) as (tok, attend):
        L = AutoConfig.from_pretrained(tok.name_or_path).num_hidden_layers
        res = discover(tok, attend, L, args.num, args.k, args.threshold_k)
    print(f"heads passing (mu_N - k sigma_N) - (mu_A + k sigma_A) > 0, by k: {res['heads_by_k']}", file=sys.stderr)
    config = config_from_discovery(res, tok.name_or_path)
    if config is None:
        print(f"no head separates the sets at k={args.k:g} (best margin {res['best_margin']:.4f} at layer "
              f"{res['best_head'][0]} head {res['best_head'][1]}); try a smaller --k", file=sys.stderr)
        return 1
    with open(args.out, "w") as f:
        json.dump(config, f, indent=1)
    print(f"{len(config['heads'])} head(s), threshold {config['threshold']:.4f} -> {args.out}", file=sys.stderr)
    return 0


# ------------------------------------------------------------------------------------------------- attnlink


def choose_head(tokenizer, attend, num_layers: int, num: int = 20, seed: int = 1, top_p: float = 0.8,
                temperature: float = 1.0, anchor: str = "last_prompt", pooling: str = "mean",
                form: str = "seed") -> dict:
    """Run labelled questions of the *selection* pool (``sql_set(num, seed, pool="selection", form=form)``:
    tables and question templates the evaluation's test pool never uses) through ``attend``; the config of the
    best head."""
    from mia_stream.lab.attention_data import sql_set

    examples = sql_set(num, seed=seed, pool="selection", form=form)
    pps = [prompt_parts(tokenizer, e.messages) for e in examples]
    per_head = []
    for pp, att in zip(pps, attend([p.token_ids for p in pps], list(range(num_layers)))):
        n = len(pp.token_ids)
        rows = [n - 1] if anchor == "last_prompt" else list(range(*pp.ranges(anchor)[0]))
        per_head.append(column_scores(att.rows(rows).mean(axis=2), pp.ranges("column"), pooling))  # [L, H, C]
    (layer, head), mrr = select_head(per_head, [e.gold for e in examples])
    return {"layer": layer, "head": head, "temperature": temperature, "top_p": top_p, "anchor": anchor,
            "pooling": pooling, "prompt_form": form, "model": getattr(tokenizer, "name_or_path", None),
            "selection": {"num": num, "seed": seed, "pool": "selection", "gold_mrr": float(mrr[layer, head])}}


def attnlink_main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mia_stream.lab.head_discovery attnlink",
                                 description="Choose attnlink's (layer, head) on generated labelled text-to-SQL "
                                             "questions and write its config.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("select-head", help="the head whose column ranking puts the gold columns highest")
    d.add_argument("--out", required=True, help="config file to write (JSON)")
    d.add_argument("--model", help="model dir (default: the embedded model)")
    d.add_argument("--num", type=int, default=20, help="labelled questions (default 20)")
    d.add_argument("--seed", type=int, default=1, help="question set seed (the selection pool's tables)")
    d.add_argument("--top-p", type=float, default=0.8, help="written into the config (default 0.8, the seed's)")
    d.add_argument("--temperature", type=float, default=1.0)
    d.add_argument("--anchor", default="last_prompt",
                   help="last_prompt (the method) or a span name whose rows are averaged (e.g. question)")
    d.add_argument("--pooling", choices=("mean", "sum"), default="mean", help="mean over a column's tokens "
                   "(the seed) or their sum (the project's variant)")
    d.add_argument("--form", choices=("seed", "project"), default="seed",
                   help="prompt form: the seed's column@table copying prompt, or the project's SQL prompt")
    d.add_argument("--backend", choices=("vllm", "hf"), default="vllm")
    args = ap.parse_args(argv)

    from transformers import AutoConfig

    from mia_stream.lab.qk_runs import attention_backend

    with attention_backend(args.model, args.backend) as (tok, attend):
        L = AutoConfig.from_pretrained(tok.name_or_path).num_hidden_layers
        config = choose_head(tok, attend, L, args.num, args.seed, args.top_p, args.temperature, args.anchor,
                             args.pooling, args.form)
    with open(args.out, "w") as f:
        json.dump(config, f, indent=1)
    print(f"layer {config['layer']} head {config['head']} (gold-column MRR {config['selection']['gold_mrr']:.3f} "
          f"on {args.num} questions) -> {args.out}", file=sys.stderr)
    return 0


# -------------------------------------------------------------------------------------------- core_reranker


def per_head_doc_scores(att_query, att_calib, spans: dict, calib_spans: dict,
                        mask_sigma: float | None = 2.0) -> np.ndarray:
    """Every head's calibrated document scores ``[L * H, N]`` of one example (from two ``PromptAttention``)."""
    q0, n = spans["query"][0][0], len(att_query.token_ids)
    c0, m = calib_spans["query"][0][0], len(att_calib.token_ids)
    aq = att_query.rows(np.arange(q0, n)).mean(axis=2)  # [L, H, n]
    ac = att_calib.rows(np.arange(c0, m)).mean(axis=2)  # [L, H, m]
    L, H = aq.shape[:2]
    aq, ac = aq.reshape(L * H, -1), ac.reshape(L * H, -1)
    docs = spans["doc"]
    return np.stack([doc_scores(aq[i], docs, ac[i], mask_sigma) for i in range(L * H)])


def choose_heads(tokenizer, attend, num_layers: int, num_heads: int, num: int = 20, top: int = 8,
                 seed: int = 1) -> dict:
    """Run a detection set (``rerank_set(num, seed, pool="selection")``: people, document and query templates
    that the evaluation's test pool never uses) through ``attend`` and return the config of the ``top`` heads
    by MRR."""
    from mia_stream.lab.attention_data import rerank_set

    examples = rerank_set(num, seed=seed, pool="selection")
    pq = [prompt_parts(tokenizer, e.messages) for e in examples]
    pc = [prompt_parts(tokenizer, e.calibration_messages) for e in examples]
    atts = attend([p.token_ids for pair in zip(pq, pc) for p in pair], list(range(num_layers)))
    per_head = []
    for q, c in zip(pq, pc):
        aq, ac = next(atts), next(atts)
        per_head.append(per_head_doc_scores(aq, ac, q.tags()["spans"], c.tags()["spans"]))
    best, mrr = select_heads(per_head, [e.relevant for e in examples], top)
    heads = sorted([int(i // num_heads), int(i % num_heads)] for i in best)
    all_mrr = float(np.mean([reciprocal_rank(rank(s.sum(0)), e.relevant) for s, e in zip(per_head, examples)]))
    return {"heads": heads, "model": getattr(tokenizer, "name_or_path", None),
            "selection": {"num": num, "seed": seed, "pool": "selection", "top": top,
                          "head_mrr": {f"{l},{h}": float(mrr[l * num_heads + h]) for l, h in heads},
                          "all_heads_mrr": all_mrr}}


def core_reranker_main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mia_stream.lab.head_discovery core_reranker",
                                 description="Choose CoRe heads for core_reranker on a generated detection set "
                                             "and write its config.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("select-heads", help="rank every head by the MRR it alone gives; write the top ones")
    d.add_argument("--out", required=True, help="config file to write (JSON)")
    d.add_argument("--model", help="model dir (default: the embedded model)")
    d.add_argument("--num", type=int, default=20, help="detection questions (default 20)")
    d.add_argument("--top", type=int, default=8, help="heads to keep (default 8)")
    d.add_argument("--seed", type=int, default=1, help="detection set seed (the evaluation uses seed 0)")
    d.add_argument("--backend", choices=("vllm", "hf"), default="vllm")
    args = ap.parse_args(argv)

    from transformers import AutoConfig

    from mia_stream.lab.qk_runs import attention_backend

    with attention_backend(args.model, args.backend) as (tok, attend):
        cfg = AutoConfig.from_pretrained(tok.name_or_path)
        config = choose_heads(tok, attend, cfg.num_hidden_layers, cfg.num_attention_heads, args.num, args.top,
                              args.seed)
    with open(args.out, "w") as f:
        json.dump(config, f, indent=1)
    sel = config["selection"]
    print(f"{len(config['heads'])} head(s) (MRR alone {min(sel['head_mrr'].values()):.3f}-"
          f"{max(sel['head_mrr'].values()):.3f}; all heads summed {sel['all_heads_mrr']:.3f}) -> {args.out}",
          file=sys.stderr)
    return 0


# --------------------------------------------------------------------------------------------------- entry

# analyzer -> its discovery command (one entry per analyzer that needs heads chosen)
ANALYZERS = {"attention_tracker": attention_tracker_main, "attnlink": attnlink_main,
             "core_reranker": core_reranker_main}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in ANALYZERS:
        print("usage: python -m mia_stream.lab.head_discovery ANALYZER ...  (mia-stream heads ANALYZER ...)\n"
              f"  ANALYZER: {', '.join(ANALYZERS)}; `... ANALYZER --help` describes its command", file=sys.stderr)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    return ANALYZERS[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
