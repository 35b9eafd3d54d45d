"""``mia-stream probe collect``: ask the model the generated questions through a real vLLM engine with
mia_stream capture, record the streams (broker and recorder as their own processes: the recording is the same
MCAP format as any), sample extra answers for semantic entropy, and write the labels file.

Labels file (``labels.jsonl``, format ``mia_stream.probe-labels/1``): a first line ``{"header": {...}}`` (format,
model, capture spec, sampling settings, sizes, the command), then one JSON object per request:

    request_id        the stream's request id in the recording ("probe-00042")
    id, set, relation, group, question, answer, answers, kind, difficulty     the item (hallucination_data)
    split             "train" | "val" | "test" (``hallucination_data.entity_split``: a hash of the entity, so an
                      entity -- a country, an element, a pair of operands -- is on one side in every set and run)
    prompt_len        P: generated token k is at position P + k (its hidden state is the row at P + k)
    token_ids, text   the greedy answer (temperature 0)
    correct, label    the automatic check; label 1 = wrong answer (a hallucination)
    answer_chars      [start, stop) of the answer in text, or null
    answer_tokens     indices k of the generated tokens that overlap it (positions P + k)
    token_labels      per generated token: 1 = a token of the answer span of a wrong answer, else 0 (claim level)
    logprobs          per generated token, its log-probability (vLLM's logprobs, raw model distribution)
    entropies         per generated token, the entropy of the top-``LOGPROBS`` distribution renormalized
                      (vLLM returns at most 20 log-probabilities; the tail is left out)
    samples           the ``--samples`` answers sampled at ``--temperature`` (not captured)
    sample_keys       their normalized answers (the clusters), semantic_entropy, clusters
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

from mia_stream.lab import datasets
from mia_stream.lab import hallucination_data as hd

LABELS_FORMAT = "mia_stream.probe-labels/1"
LOGPROBS = 20
REQUEST_PREFIX = "probe-"
TEST_FRACTION = hd.SPLIT_FRACTIONS["test"]


def _log(msg: str) -> None:
    print(f"[probe collect {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def default_capture(num_layers: int) -> dict:
    """Every other layer's residual (and the last) at every position, Q/K of every layer at every position:
    about 7 MB a request for the embedded model (43-token prompts, 24 answer tokens at most)."""
    hs_layers = sorted(set(range(0, num_layers, 2)) | {num_layers - 1})
    return {"hidden_states": {"layers": hs_layers, "positions": "all"},
            "qk": {"layers": "all", "heads": "all", "positions": "all"}}


def _spawn(args: Sequence[str], log: Path) -> subprocess.Popen:
    fh = open(log, "ab")
    return subprocess.Popen([sys.executable, "-m", "mia_stream.cli", *args], stdout=fh, stderr=subprocess.STDOUT)


def _wait(cond, what: str, timeout: float, procs: Sequence[subprocess.Popen] = ()) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        for p in procs:
            if p.poll() is not None:
                raise RuntimeError(f"{what}: a helper process exited with {p.returncode}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout:.0f} s")
        time.sleep(0.2)


def _recorder_stats(run_dir: str) -> dict | None:
    from mia_stream.broker import fetch_stats

    stats = fetch_stats(run_dir)
    return next((c for name, c in stats["consumers"].items() if name.startswith("recorder")), None)


def _entropy(top: dict) -> float:
    lps = [lp.logprob for lp in top.values()]
    m = max(lps)
    ps = [math.exp(x - m) for x in lps]
    z = sum(ps)
    return float(-sum(p / z * math.log(p / z) for p in ps if p > 0))


def label_record(k: int, it: dict, c: Any, prompt_len: int, tok: Any, sampled: Sequence[str], split: str,
                 request_id: str | None = None) -> dict:
    """One line of the labels file for item ``it`` and its generation ``c`` (a vLLM ``CompletionOutput`` with
    logprobs), its sampled answers' texts and its split."""
    ids = list(c.token_ids)
    text = c.text
    ranges = hd.token_char_ranges(tok, ids)
    span = hd.answer_span(it, text)
    lps = c.logprobs or []
    keys = [hd.answer_key(it, s) for s in sampled]
    se, n_clusters = hd.semantic_entropy(keys)
    correct = hd.check_answer(it, text)
    span_tokens = hd.span_token_indices(ranges, span)
    token_labels = hd.token_labels(len(ids), span_tokens, not correct)
    extra = {}
    if it.get("kind") == "long_form":  # every claim located: tokens of unsupported claims are the positives
        from mia_stream.lab.claims import find_claims, token_claim_labels

        found = find_claims(it, text)
        claim_tokens = token_claim_labels(ranges, found)
        token_labels = [int(x == 1) for x in claim_tokens]
        span_tokens = [k for k, x in enumerate(claim_tokens) if x >= 0]
        extra = {"claims": found, "token_claims": claim_tokens}
    return dict(
        request_id=request_id or f"{REQUEST_PREFIX}{k:05d}",
        **{f: it.get(f) for f in ("id", "set", "relation", "group", "question", "answer", "answers", "kind",
                                  "difficulty")},
        split=split, prompt_len=prompt_len, token_ids=ids, text=text, correct=correct,
        label=0 if correct else 1, answer_chars=list(span) if span else None,
        answer_tokens=span_tokens, token_labels=token_labels, **extra,
        logprobs=[float(lp[t].logprob) for lp, t in zip(lps, ids)],
        entropies=[_entropy(lp) for lp in lps], samples=list(sampled), sample_keys=keys,
        semantic_entropy=se, clusters=n_clusters)


def collect(out_dir: str | Path, *, sets: Sequence[str] = hd.SETS, limit: int | None = None, samples: int = 10,
            temperature: float = 0.5, max_tokens: int = 24, model: str | None = None, seed: int = 0,
            max_num_seqs: int = 64, capture: dict | None = None, command: str = "",
            questions: list[dict] | None = None) -> dict:
    """Run the questions (``questions``, e.g. ``hallucination_data.load_questions``, or ``sets``), record them into
    ``out_dir/recording``, write ``out_dir/labels.jsonl``; returns a summary (counts, accuracy, sizes, times)."""
    from transformers import AutoTokenizer

    from mia_stream.model import resolve_model

    t_start = time.time()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rec_dir = out / "recording"
    if rec_dir.exists() and any(rec_dir.iterdir()):
        raise FileExistsError(f"{rec_dir} exists and is not empty; collect into a new directory")
    model_dir = str(resolve_model(model))
    config = json.loads((Path(model_dir) / "config.json").read_text())
    spec_capture = capture or default_capture(int(config["num_hidden_layers"]))
    items = list(questions) if questions is not None else hd.question_set(sets, limit, seed)
    sets = list(dict.fromkeys(it["set"] for it in items))
    split = {i: hd.entity_split(it["group"], seed) for i, it in enumerate(items)}
    tok = AutoTokenizer.from_pretrained(model_dir)
    prompts = []
    for it in items:
        text = tok.apply_chat_template(hd.chat_messages(it), add_generation_prompt=True, tokenize=False)
        prompts.append(tok(text, add_special_tokens=False)["input_ids"])

    run_dir = tempfile.mkdtemp(prefix="mia-probe-", dir="/tmp")  # short: unix socket paths are limited
    log = out / "collect-processes.log"
    procs: dict[str, subprocess.Popen] = {}
    llm = None
    try:
        procs["broker"] = _spawn(["broker", "--address", run_dir], log)
        _wait(lambda: (Path(run_dir) / "consumers.sock").exists(), "broker start", 60, list(procs.values()))
        procs["recorder"] = _spawn(["record", str(rec_dir), "--broker", run_dir, "--patterns",
                                    f"{REQUEST_PREFIX}*"], log)
        _wait(lambda: _recorder_stats(run_dir) is not None, "recorder subscription", 60, list(procs.values()))

        os.environ["MIA_STREAM_BROKER"] = run_dir
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        from vllm import LLM, SamplingParams

        t0 = time.time()
        # no prefix caching: every prompt position is computed, so captured (lookback ratios need every key)
        llm = LLM(model_dir, dtype="float32", enforce_eager=True, max_model_len=512, seed=seed,
                  max_num_seqs=max_num_seqs, max_num_batched_tokens=512, enable_prefix_caching=False,
                  max_logprobs=LOGPROBS)
        t_engine = time.time() - t0
        _log(f"engine up in {t_engine:.0f} s; {len(items)} questions, greedy, capture {json.dumps(spec_capture)}")
        params = []
        for k in range(len(items)):
            p = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=LOGPROBS, seed=seed)
            p.extra_args = {"mia_stream": {"id": f"{REQUEST_PREFIX}{k:05d}", "capture": spec_capture,
                                           "tags": {"item": items[k]["id"]}}}
            params.append(p)
        t0 = time.time()
        greedy = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        t_greedy = time.time() - t0
        n_tokens = sum(len(o.outputs[0].token_ids) for o in greedy)
        _log(f"greedy: {n_tokens} tokens in {t_greedy:.0f} s")

        sampled: list[list[str]] = [[] for _ in items]
        t0 = time.time()
        if samples:
            # the engine's seeded generator, no per-request seed: vLLM 0.32's CPU sampler fails on a seeded
            # request whose prefill was chunked ("CPU Generator does not use offset"), which killed the engine
            sp = [SamplingParams(n=samples, max_tokens=max_tokens, temperature=temperature)
                  for _ in range(len(items))]
            for k, o in enumerate(llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)):
                sampled[k] = [c.text for c in o.outputs]
        t_samples = time.time() - t0
        _log(f"sampling: {samples} answers each in {t_samples:.0f} s")

        # the recorder has everything once the broker holds nothing more for it and every stream has ended
        def drained() -> bool:
            from mia_stream.broker import fetch_stats

            stats = fetch_stats(run_dir)
            rec = next((c for n, c in stats["consumers"].items() if n.startswith("recorder")), None)
            streams = [s for n, s in stats["streams"].items() if n.startswith(REQUEST_PREFIX)]
            return rec is not None and rec["queue_messages"] == 0 and all(s["ended"] for s in streams)

        _wait(drained, "recorder catching up", 600, list(procs.values()))
        rec_stats = _recorder_stats(run_dir) or {}
        time.sleep(2.0)  # what the broker handed over reaches the recorder's socket
    finally:
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()
        for name in ("recorder", "broker"):
            p = procs.get(name)
            if p is not None and p.poll() is None:
                p.send_signal(signal.SIGINT)
                try:
                    p.wait(60)
                except subprocess.TimeoutExpired:
                    p.kill()
        import shutil

        shutil.rmtree(run_dir, ignore_errors=True)

    records = [label_record(k, it, o.outputs[0], len(prompts[k]), tok, sampled[k], split[k])
               for k, (it, o) in enumerate(zip(items, greedy))]
    header = {"format": LABELS_FORMAT, "model": Path(model_dir).name, "model_dir": model_dir,
              "num_layers": int(config["num_hidden_layers"]), "num_heads": int(config["num_attention_heads"]),
              "hidden_size": int(config["hidden_size"]),
              "capture": spec_capture, "max_tokens": max_tokens, "greedy": "temperature 0",
              "samples": samples, "sample_temperature": temperature, "logprobs": LOGPROBS, "seed": seed,
              "sets": list(sets), "limit": limit, "instruction": datasets.INSTRUCTION, "requests": len(records),
              "test_fraction": TEST_FRACTION, "split": f"entity hash {hd.SPLIT_FRACTIONS} (seed {seed})",
              "engine": "vLLM, float32, enforce_eager, no prefix caching",
              "command": command, "date": time.strftime("%Y-%m-%d")}
    with open(out / "labels.jsonl", "w") as fh:
        fh.write(json.dumps({"header": header}) + "\n")
        for r in records:
            fh.write(json.dumps(r) + "\n")
    size = sum(f.stat().st_size for f in rec_dir.glob("*"))
    summary = {"requests": len(records), "wrong": sum(r["label"] for r in records),
               "by_set": {s: [sum(1 for r in records if r["set"] == s),
                              sum(r["label"] for r in records if r["set"] == s)] for s in sets},
               "recording_bytes": size, "recorder_dropped": rec_stats.get("dropped", 0),
               "engine_start_s": round(t_engine, 1), "greedy_s": round(t_greedy, 1),
               "sampling_s": round(t_samples, 1), "total_s": round(time.time() - t_start, 1),
               "greedy_tokens": n_tokens}
    (out / "collect-summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def add_samples(out_dir: str | Path, *, samples: int = 5, temperature: float = 0.5, max_tokens: int = 24,
                model: str | None = None, max_num_seqs: int = 64, command: str = "") -> dict:
    """Sample ``samples`` answers per request of ``out_dir/labels.jsonl`` (no capture: a plain engine) and write
    their clusters and semantic entropy into it (``probe relabel`` leaves none; a collect run whose sampling
    pass died gets them back)."""
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    from mia_stream.model import resolve_model

    path = Path(out_dir) / "labels.jsonl"
    lines = path.read_text().splitlines()
    header = json.loads(lines[0])["header"]
    records = [json.loads(x) for x in lines[1:] if x.strip()]
    model_dir = str(resolve_model(model or header.get("model_dir")))
    tok = AutoTokenizer.from_pretrained(model_dir)
    prompts = [tok(tok.apply_chat_template(hd.chat_messages(r), add_generation_prompt=True, tokenize=False),
                   add_special_tokens=False)["input_ids"] for r in records]
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    t0 = time.time()
    llm = LLM(model_dir, dtype="float32", enforce_eager=True, max_model_len=512, max_num_seqs=max_num_seqs,
              max_num_batched_tokens=512)
    try:
        sp = SamplingParams(n=samples, max_tokens=max_tokens, temperature=temperature)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    finally:
        llm.llm_engine.engine_core.shutdown()
    for r, o in zip(records, outs):
        r["samples"] = [c.text for c in o.outputs]
        r["sample_keys"] = [hd.answer_key(r, t) for t in r["samples"]]
        r["semantic_entropy"], r["clusters"] = hd.semantic_entropy(r["sample_keys"])
    header.update(samples=samples, sample_temperature=temperature,
                  samples_command=command or f"add_samples({samples}, {temperature})")
    with open(path, "w") as fh:
        fh.write(json.dumps({"header": header}) + "\n")
        for r in records:
            fh.write(json.dumps(r) + "\n")
    return {"requests": len(records), "samples": samples, "seconds": round(time.time() - t0, 1)}
