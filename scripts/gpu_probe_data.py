"""Hallucination-detector data at scale on a GPU host (issue 27): ask every question of the fact sets (and many
generated arithmetic questions) greedily and ``--captured-samples`` times sampled, with the residuals of
``--layers`` captured through mia_stream (a private broker, ``StreamLLM``; no recording: the rows are kept in
memory as float16), label every generation (``hallucination_data``), sample ``--se-samples`` uncaptured answers
per question for semantic entropy, then run the whole evaluation there (``probe_eval``: every detector beside
every baseline, entity-bootstrap CIs, calibrated thresholds, leave-one-relation-out), train the probes to ship
with calibrated thresholds, and write compact outputs to ``--out`` (at most 8 files, each < 16 MiB):

    report.json, report.txt     the evaluation (as ``mia-stream probe eval`` prints it)
    token-probe.json            token_probe, every generated token (claim-level labels), layer/C by validation
    token-probe-logit.json      the same with the logit features (``--logit``)
    semantic-entropy-probe.json the TBG probe (last prompt row)
    labels.jsonl.gz             every generation's labels file line (no sampled texts)
    tbg.npz                     float16 last-prompt rows of the TBG probe's layer, request ids (for re-fitting)
    log.txt                     the run's log

Runs on the CPU engine too (small: ``--limit 3 --arith-per-level 2``), which is how it was tested. On the GPU
host (vLLM 0.26 staged, ../shared/device/README.md; the model's files carried in parts, ``scripts/
stage_model_parts.sh``):

    python3 scripts/gpu_probe_data.py --model /tmp/model --out $OUT

A device command runs at most 10 minutes, so the run splits in phases that share ``--work DIR`` (the host's
/tmp lasts while it stays warm): ``--phase collect`` generates and labels and saves the rows there (float16
``.npy``); ``--phase report`` writes the evaluation and trains the probes to ship at the layer and C it chose;
``--phase ship`` only trains them (choosing again); ``all`` (the default) collects and reports in one process. ``--per-set N`` samples each set's questions until the set holds at
least N labelled generations (the issue's 10,000), ``--max-seconds`` ends the sampling rounds early (what was
collected is kept and said).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mia_stream.lab import fact_questions as fq  # noqa: E402
from mia_stream.lab import hallucination_data as hd  # noqa: E402
from mia_stream.lab.probe_collect import LABELS_FORMAT, LOGPROBS, label_record  # noqa: E402

T0 = time.time()
LOG: list[str] = []


def log(msg: str) -> None:
    line = f"[gpu_probe_data {time.time() - T0:7.1f} s] {msg}"
    LOG.append(line)
    print(line, file=sys.stderr, flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="the model dir (the embedded model's files)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--layers", default="8,12,16,20,24,29",
                    help="captured residual layers (the last is needed for the logit features' check)")
    ap.add_argument("--arith-per-level", type=int, default=300, help="arithmetic questions per difficulty level")
    ap.add_argument("--limit", type=int, help="at most this many questions per set (a small run)")
    ap.add_argument("--captured-samples", type=int, default=3, help="sampled generations per question, captured "
                                                                   "and labelled like the greedy one")
    ap.add_argument("--temperature", type=float, default=0.5)
    ap.add_argument("--se-samples", type=int, default=10, help="uncaptured samples per question for semantic entropy")
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--chunk", type=int, default=2048, help="prompts per streamed generate call")
    ap.add_argument("--gpu-mem", type=float, default=0.5)
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on a GPU, float32 on the CPU")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-loro", action="store_true")
    ap.add_argument("--per-set", type=int, default=0, help="sample until each set holds this many labelled "
                                                          "generations (more rounds for smaller sets)")
    ap.add_argument("--max-seconds", type=float, default=0, help="start no sampling round after this long")
    ap.add_argument("--phase", choices=("all", "collect", "report", "ship"), default="all")
    ap.add_argument("--work", help="where the collect phase saves the rows for the later phases")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    try:
        return run(args, out)
    finally:
        (out / "log.txt").write_text("\n".join(LOG) + "\n")


def _items(args) -> list[dict]:
    sets = [s for s in hd.SETS if s != "arithmetic"]
    items = hd.question_set(sets, args.limit, args.seed)
    arith = fq.arithmetic_questions(per_level=args.arith_per_level, seed=args.seed)
    return arith[:args.limit] + items if args.limit else arith + items


def rounds_per_item(items: list[dict], captured_samples: int, per_set: int) -> list[int]:
    """Generations per question (greedy + sampled): ``1 + captured_samples``, or enough that its set reaches
    ``per_set`` labelled generations."""
    size: dict[str, int] = {}
    for it in items:
        size[it["set"]] = size.get(it["set"], 0) + 1
    return [max(1 + captured_samples, -(-per_set // size[it["set"]]) if per_set else 0) for it in items]


def run(args, out: Path) -> int:
    if args.phase != "all" and not args.work:
        raise SystemExit("--phase collect/report/ship needs --work DIR")
    if args.phase in ("report", "ship"):
        header, records, layers, tbg, gen, offsets = load_work(Path(args.work))
        log(f"loaded {len(records)} labelled generations from {args.work}")
        evaluate_and_train(args, out, header, records, layers, tbg, gen, offsets)
        return 0
    import torch
    from transformers import AutoTokenizer
    from vllm import SamplingParams

    from mia_stream import StreamLLM

    gpu = torch.cuda.is_available()
    dtype = args.dtype or ("bfloat16" if gpu else "float32")
    layers = sorted({int(x) for x in args.layers.split(",")})
    config = json.loads((Path(args.model) / "config.json").read_text())
    items = _items(args)
    tok = AutoTokenizer.from_pretrained(args.model)
    prompts = [tok(tok.apply_chat_template(hd.chat_messages(it), add_generation_prompt=True, tokenize=False),
                   add_special_tokens=False)["input_ids"] for it in items]
    counts = {}
    for it in items:
        counts[it["set"]] = counts.get(it["set"], 0) + 1
    rounds = rounds_per_item(items, args.captured_samples, args.per_set)
    log(f"{len(items)} questions ({counts}); {sum(rounds)} captured generations "
        f"({min(rounds)}-{max(rounds)} per question); layers {layers}; {dtype}")
    kw = dict(dtype=dtype, max_model_len=512, seed=args.seed, max_num_seqs=args.max_num_seqs,
              enable_prefix_caching=False, max_logprobs=LOGPROBS)
    if gpu:
        kw["gpu_memory_utilization"] = args.gpu_mem
    else:
        kw.update(enforce_eager=True, max_num_batched_tokens=512)
    # round 0 (greedy) captures every position (its last prompt row is the TBG row); sampled rounds only the
    # generated ones: their prompt is the same, so is its last row (a third of the bytes through the bus)
    capture = {"hidden_states": {"layers": layers, "positions": "all"}}
    capture_gen = {"hidden_states": {"layers": layers, "positions": "generated"}}
    records, tbg, gen, offsets = [], [], [], [0]
    tbg_of: dict[int, np.ndarray] = {}
    with StreamLLM(args.model, **kw) as sllm:
        log("engine up")
        se_texts: list[list[str]] = [[] for _ in items]
        if args.se_samples:
            # seeded only on a GPU: vLLM 0.32's CPU sampler fails on a seeded request whose prefill was chunked
            sp = SamplingParams(n=args.se_samples, max_tokens=args.max_tokens, temperature=args.temperature,
                                seed=args.seed if gpu else None)
            outs = sllm.llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
            se_texts = [[c.text for c in o.outputs] for o in outs]
            log(f"semantic-entropy samples: {args.se_samples} x {len(items)}")
        # the greedy pass first (its last prompt row is every later generation's TBG row), then every sampled
        # generation in one list, in chunks of full batches; ordered so that each set advances at the same pace
        # (a --max-seconds cut leaves every set with the same share of its rounds)
        greedy = [(0, i) for i in range(len(items))]
        sampled = sorted(((r, i) for i in range(len(items)) for r in range(1, rounds[i])),
                         key=lambda job: (job[0] / rounds[job[1]], job[1]))
        for jobs in (greedy, sampled):
            for a in range(0, len(jobs), args.chunk):
                if jobs is sampled and args.max_seconds and time.time() - T0 > args.max_seconds:
                    log(f"--max-seconds {args.max_seconds}: {len(jobs) - a} of {len(jobs)} sampled generations "
                        f"not asked")
                    break
                chunk = jobs[a:a + args.chunk]
                sp = [SamplingParams(max_tokens=args.max_tokens, temperature=0.0 if r == 0 else args.temperature,
                                     logprobs=LOGPROBS, seed=args.seed * 1000 + r * 100003 + i if gpu else None)
                      for r, i in chunk]
                rows: dict[str, dict[int, np.ndarray]] = {}
                gaps = set()
                events = sllm.stream([{"prompt_token_ids": prompts[i]} for _, i in chunk], sp,
                                     capture=capture if jobs is greedy else capture_gen, timeout=600)
                for ev in events:
                    rid = ev.stream.request_id
                    if ev.kind == "gap":
                        gaps.add(rid)
                    elif ev.kind == "frame" and "hs" in ev.frame.raw_tensors:
                        k = chunk[int(rid.rsplit("-", 1)[1])][1]
                        P = len(prompts[k])
                        hs = ev.frame.tensors["hs"]  # [L, T, H]
                        for j, p in enumerate(ev.frame.positions):
                            if p >= P - 1:
                                rows.setdefault(rid, {})[int(p)] = hs[:, j].astype(np.float16)
                outputs = sllm._last_outputs
                for rid, o in outputs.items():
                    round_, k = chunk[int(rid.rsplit("-", 1)[1])]
                    c = o.outputs[0]
                    P, G = len(prompts[k]), len(c.token_ids)
                    got = rows.get(rid, {})
                    if round_ == 0 and P - 1 in got:
                        tbg_of[k] = got[P - 1]
                    elif k in tbg_of:
                        got[P - 1] = tbg_of[k]
                    if rid in gaps or G < 2 or any(p not in got for p in range(P - 1, P + G - 1)):
                        continue
                    rec = label_record(k, items[k], c, P, tok, se_texts[k], hd.entity_split(items[k]["group"],
                                                                                              args.seed),
                                       request_id=f"gen{round_}-{k:06d}")
                    rec["round"], rec["temperature"] = round_, 0.0 if round_ == 0 else args.temperature
                    rec.pop("samples")
                    records.append(rec)
                    tbg.append(got[P - 1])
                    gen.extend(got[p] for p in range(P, P + G - 1))
                    offsets.append(offsets[-1] + G - 1)
                log(f"{'greedy' if jobs is greedy else 'sampled'}: {a + len(chunk)} of {len(jobs)} asked: "
                    f"{len(records)} labelled generations so far, {len(gaps)} with gaps skipped")
    header = {"format": LABELS_FORMAT, "model": Path(args.model).name, "model_dir": str(args.model),
              "num_layers": int(config["num_hidden_layers"]), "num_heads": int(config["num_attention_heads"]),
              "hidden_size": int(config["hidden_size"]), "capture": capture, "max_tokens": args.max_tokens,
              "greedy": "round 0 temperature 0; rounds 1.. sampled", "samples": args.se_samples,
              "sample_temperature": args.temperature, "logprobs": LOGPROBS, "seed": args.seed,
              "sets": list(dict.fromkeys(it["set"] for it in items)), "requests": len(records),
              "split": f"entity hash {hd.SPLIT_FRACTIONS} (seed {args.seed})",
              "engine": f"vLLM {'GPU' if gpu else 'CPU'}, {dtype}, no prefix caching",
              "command": "python3 scripts/gpu_probe_data.py " + " ".join(sys.argv[1:]),
              "date": time.strftime("%Y-%m-%d")}
    with gzip.open(out / "labels.jsonl.gz", "wt") as fh:
        fh.write(json.dumps({"header": header}) + "\n")
        for r in records:
            fh.write(json.dumps(r) + "\n")
    per_set: dict[str, list[int]] = {}
    for r in records:
        per_set.setdefault(r["set"], []).append(r["label"])
    log(f"{len(records)} labelled generations, {sum(r['label'] for r in records)} wrong; per set (generations, "
        f"wrong): {({k: (len(v), sum(v)) for k, v in per_set.items()})}")
    tbg, gen, offsets = np.stack(tbg), np.stack(gen), np.asarray(offsets)
    if args.work:
        save_work(Path(args.work), header, records, layers, tbg, gen, offsets)
        log(f"saved the rows to {args.work} ({gen.nbytes / 2**30:.2f} GiB of generated rows)")
    if args.phase == "all":
        evaluate_and_train(args, out, header, records, layers, tbg, gen, offsets)
    return 0


def save_work(work: Path, header, records, layers, tbg, gen, offsets) -> None:
    work.mkdir(parents=True, exist_ok=True)
    (work / "records.json").write_text(json.dumps({"header": header, "records": records, "layers": layers}))
    np.save(work / "tbg.npy", tbg)
    np.save(work / "gen.npy", gen)
    np.save(work / "offsets.npy", offsets)


def load_work(work: Path):
    meta = json.loads((work / "records.json").read_text())
    return (meta["header"], meta["records"], meta["layers"], np.load(work / "tbg.npy"),
            np.load(work / "gen.npy"), np.load(work / "offsets.npy"))


def evaluate_and_train(args, out: Path, header, records, layers, tbg, gen, offsets) -> None:
    from mia_stream.lab import probe_eval as pe
    from mia_stream.lab import probe_metrics as pm
    from mia_stream.lab import probe_train as pt

    feats = pt.Features([r["request_id"] for r in records], layers, [], tbg.astype(np.float32),
                        gen.astype(np.float32), offsets, np.zeros((0, 0, 1), np.float32))
    ds = pt.Dataset(header, records, feats)
    variants = [v for v in pe.VARIANTS if header.get("samples") or pe.VARIANTS[v][0] != "semantic_entropy_probe"]
    eval_layers = [x for x in layers if x != header["num_layers"] - 1] or layers
    chosen: dict[str, tuple] = {}  # variant -> (layer, C, selection table) the report chose on validation
    if args.phase in ("all", "report"):
        rep = pe.evaluate(ds, variants, eval_layers, loro=not args.no_loro, log=log)
        rep["command"] = header["command"]
        (out / "report.json").write_text(json.dumps(rep, indent=1, default=pm.json_default) + "\n")
        (out / "report.txt").write_text(pe.format_report(rep) + "\n")
        log("report written")
        chosen = {v: (d["layer"], d["C"], d["selection"]) for v, d in rep["detectors"].items()}
    val, test = ds.requests(ds.calibration_split()), ds.requests("test")
    ships = [("token_probe", {"rows": "all", "logit": False}, "token-probe.json", "token_probe"),
             ("token_probe", {"rows": "all", "logit": True}, "token-probe-logit.json", "token_probe+logit")]
    if header.get("samples"):
        ships.append(("semantic_entropy_probe", {"position": "last_prompt"}, "semantic-entropy-probe.json",
                      "sep_tbg"))
    for detector, opts, name, variant in ships:
        if variant in chosen:  # the report's choice: one more fit, not the layer and C search again
            layer, C, table = chosen[variant]
            fit, metrics = pt.train_detector(ds, detector, layer, cs=(C,), **opts)
        else:
            fit, layer, table = pe.select_and_fit(ds, detector, eval_layers, opts, log=log)
            _, metrics = pt.train_detector(ds, detector, layer, cs=(fit["C"],), **opts)
        s_val = pe.answer_scores(ds, detector, fit, val.tolist(), layer=layer, **opts)
        s_test = pe.answer_scores(ds, detector, fit, test.tolist(), layer=layer, **opts)
        fit["threshold"] = pm.calibrate(s_val[ds.labels[val] == 0])
        fit["threshold_info"] = "answer_risk >= threshold on at most 10% of the correct validation answers"
        y, g = ds.labels[test], ds.groups[test]
        metrics["test"]["answer"] = pm.bootstrap(y, {"a": s_test}, g)["a"]
        metrics["test"]["alerts"] = pm.alert_rates(y, s_test, fit["threshold"], g)
        probe = pt.make_probe(ds, detector, fit, metrics, layer=layer, position=opts.get("position", "last_prompt"),
                              command=header["command"])
        probe.training["layer_selection"] = {"by": "validation answer AUROC", "auc": table}
        probe.save(out / name)
        if detector == "semantic_entropy_probe":
            li = layers.index(layer)
            np.savez_compressed(out / "tbg.npz", request_ids=np.asarray(feats.request_ids),
                                rows=tbg[:, li].astype(np.float16), layer=layer)
        log(f"wrote {name}: layer {layer}, C {fit['C']}, test {metrics['test'].get('answer')}")


if __name__ == "__main__":
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    sys.exit(main())
