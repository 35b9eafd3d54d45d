"""``mia-stream probe relabel``: the labels file rebuilt from a collect run's recording alone, with the current
labeller, so a recording outlives changes of the checkers, spans and splits (and a collect run whose engine died
after the greedy pass keeps its data).

Per recorded request: the item (its start tag ``item`` names it; the questions are the ones ``collect`` asked,
made again from the same sets, limit and seed), the sampled token ids (the recording's token batches), the text
(decoded as vLLM does, special tokens skipped), and the per-token -log p and top-20 entropy computed from the
captured last layer through the model's output head (``analyzers/_logits.py``: equal to vLLM's logprobs up to
float rounding; HF-checked in ``tests/test_probe_eval.py``). Sampled answers are not in a recording: semantic
entropy is 0 and ``samples`` 0 in the header. The features cache is written in the same pass.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Sequence

import numpy as np

from mia_stream.errors import ProbeDataError
from mia_stream.lab import hallucination_data as hd
from mia_stream.lab.probe_collect import LABELS_FORMAT, LOGPROBS, REQUEST_PREFIX, label_record


def relabel(recording: str | Path, out_dir: str | Path, *, sets: Sequence[str] = hd.SETS, limit: int | None = None,
            seed: int = 0, model: str | None = None, hs_layers: Sequence[int], questions: list[dict] | None = None,
            command: str = "", log=print) -> dict:
    from transformers import AutoTokenizer

    from mia_stream.analyzers._logits import OutputHead, top_entropy
    from mia_stream.lab import probe_train as pt
    from mia_stream.model import resolve_model

    rec = Path(recording)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model_dir = str(resolve_model(model))
    config = json.loads((Path(model_dir) / "config.json").read_text())
    last = int(config["num_hidden_layers"]) - 1
    if last not in hs_layers:
        raise ProbeDataError(f"relabel needs the last layer ({last}) in the recording's hidden states (the "
                             f"logprobs come from it); --hs-layers names {list(hs_layers)}")
    items = list(questions) if questions is not None else hd.question_set(sets, limit, seed)
    by_id = {it["id"]: it for it in items}
    t0 = time.time()
    reader = pt.FeatureReader(hs_layers, [])
    reader.gap_seqs = pt.read_recording(reader, rec)
    log(f"read {len(reader.rows)} requests from {rec} in {time.time() - t0:.0f} s")
    tok = AutoTokenizer.from_pretrained(model_dir)
    head = OutputHead.from_model_dir(model_dir)
    li = list(hs_layers).index(last)
    records, skipped = [], []
    for rid in sorted(reader.rows):
        if not rid.startswith(REQUEST_PREFIX):
            continue
        item = by_id.get(reader.tags.get(rid, {}).get("item"))
        toks = reader.tokens.get(rid, {})
        P = min(toks) if toks else None  # the first sampled token's position is the prompt's length
        rows = reader.rows[rid]
        ids = [toks[p] for p in sorted(toks)]
        if item is None or not P or not ids or any(p not in rows for p in range(P - 1, P + len(ids) - 1)):
            skipped.append(rid)
            continue
        logp = head.log_softmax(np.stack([rows[p][li] for p in range(P - 1, P + len(ids) - 1)]), batched=True)
        c = SimpleNamespace(token_ids=ids, text=tok.decode(ids, skip_special_tokens=True), logprobs=None)
        r = label_record(0, item, c, P, tok, [], hd.entity_split(item["group"], seed), request_id=rid)
        r["logprobs"] = [float(logp[k, t]) for k, t in enumerate(ids)]
        r["entropies"] = top_entropy(logp, LOGPROBS).tolist()
        records.append(r)
    header = {"format": LABELS_FORMAT, "model": Path(model_dir).name, "model_dir": model_dir,
              "num_layers": int(config["num_hidden_layers"]), "num_heads": int(config["num_attention_heads"]),
              "hidden_size": int(config["hidden_size"]),
              "capture": {"hidden_states": {"layers": list(hs_layers), "positions": "all"}}, "greedy": "temperature 0",
              "samples": 0, "logprobs": LOGPROBS, "logprobs_from": "the recorded last layer through the output head",
              "seed": seed, "sets": list(dict.fromkeys(it["set"] for it in items)), "limit": limit,
              "requests": len(records), "test_fraction": hd.SPLIT_FRACTIONS["test"],
              "split": f"entity hash {hd.SPLIT_FRACTIONS} (seed {seed})",
              "engine": "vLLM, float32, enforce_eager, no prefix caching (relabelled from the recording)",
              "command": command, "date": time.strftime("%Y-%m-%d")}
    labels_path = out / "labels.jsonl"
    with open(labels_path, "w") as fh:
        fh.write(json.dumps({"header": header}) + "\n")
        for r in records:
            fh.write(json.dumps(r) + "\n")
    pt.read_features(rec, (header, records), labels_path, cache=True, log=log, reader=reader)
    return {"requests": len(records), "wrong": sum(r["label"] for r in records), "skipped": len(skipped),
            "by_set": {s: [sum(r["set"] == s for r in records), sum(r["label"] for r in records if r["set"] == s)]
                       for s in header["sets"]}}
