"""Writes recording-2.1.mcap and recording-2.1-events.json with the code from before the redesign (issue 23):

    git archive 9f39963 mia_stream | tar -x -C /tmp/old
    VLLM_CPU_KVCACHE_SPACE=1 PYTHONPATH=/tmp/old .venv/bin/python tests/data/make_recording_2_1.py tests/data

A real CPU vLLM engine (the embedded model, float32, greedy) serves three requests: hidden states of layers 0, 15
and 29 at every position, Q/K of layer 3 at the last prompt position, and one request steered at layer 10. A
`mia-stream record` process records them from a real broker. The events of the recording, read back by the same
(old) code through ``open_stream`` and ``open_batches``, are written as digests (``digest_events``; tensor values
hashed): tests/test_recording_compat.py replays the file with today's code and compares.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

PATTERN = "compat-*"


def _tensors(frame) -> list:
    return sorted([n, t.dtype, list(t.shape), list(t.layers), hashlib.sha1(np.ascontiguousarray(t.raw())).hexdigest()]
                  for n, t in frame.raw_tensors.items())


def _batch_tensors(batch) -> list:
    out = []
    for f in batch.frames():
        tensors = sorted([t.name, t.dtype, list(t.shape), list(t.layers),
                          hashlib.sha1(np.ascontiguousarray(t.raw())).hexdigest()] for t in getattr(f, "tensors", ()))
        out.append([f.request_id, f.step, getattr(f, "part", 0), list(f.positions), list(f.token_ids), tensors])
    return sorted(out, key=json.dumps)


def digest_event(ev) -> list:
    """One consumer event as plain JSON data: what a consumer reads from it, tensor bytes hashed."""
    if ev.kind == "batch":
        b = ev.batch
        return ["batch", type(b).__name__, b.producer_id, getattr(b, "step", None), list(b.request_ids),
                b.seqs.tolist(), _batch_tensors(b)]
    rid = ev.stream.request_id
    if ev.kind == "frame":
        f = ev.frame
        return ["frame", rid, f.step, f.part, list(f.positions), list(f.token_ids), f.steering_version, _tensors(f)]
    if ev.kind == "tokens":
        t = ev.tokens
        return ["tokens", rid, t.seq, t.step, list(t.token_ids), list(t.positions), t.finish_reason]
    if ev.kind == "gap":
        return ["gap", rid, [list(r) for r in ev.gap.missing], ev.gap.reason, ev.gap.origin]
    if ev.kind == "end":
        e = ev.end
        return ["end", rid, e.seq, e.finish_reason, e.num_prompt_tokens, e.num_generated_tokens, e.frames_sent,
                e.frames_dropped, e.drops]
    if ev.kind == "start":
        s = ev.stream.start
        return ["start", rid, s.num_layers, s.hidden_size, json.loads(json.dumps(s.capture, default=str))]
    return [ev.kind, rid]


def digest_events(source: str) -> dict:
    """Each request's events in order from both consumer APIs, read from a recording."""
    from mia_stream.consumers import open_batches, open_stream

    out = {}
    for name, opener in (("open_stream", open_stream), ("open_batches", open_batches)):
        per: dict[str, list] = {}
        with opener(source, patterns=[PATTERN]) as events:
            for ev in events:
                rids = ev.batch.request_ids if ev.kind == "batch" else [ev.stream.request_id]
                for rid in rids:
                    per.setdefault(rid, []).append(digest_event(ev))
        out[name] = per
    return out


def write_digests(out_dir: Path) -> None:
    digests = digest_events(str(out_dir / "recording-2.1.mcap"))
    assert all(len(v) == 3 for v in digests.values()), {k: list(v) for k, v in digests.items()}
    (out_dir / "recording-2.1-events.json").write_text(json.dumps(digests, separators=(",", ":")) + "\n")


def main(out_dir: Path) -> None:
    from vllm import LLM, SamplingParams

    from mia_stream.broker import run_broker_in_thread
    from mia_stream.model import default_model_dir

    run_dir = tempfile.mkdtemp(prefix="mia-compat-", dir="/tmp")
    rec_dir = Path(run_dir) / "rec"
    with run_broker_in_thread(address=run_dir):
        os.environ["MIA_STREAM_BROKER"] = run_dir
        recorder = subprocess.Popen([sys.executable, "-m", "mia_stream.cli", "record", str(rec_dir), "--broker",
                                     run_dir, "--patterns", PATTERN, "--flush-interval", "0.1"])
        llm = LLM(str(default_model_dir()), dtype="float32", max_model_len=512, max_num_seqs=4, seed=0,
                  enforce_eager=True)
        time.sleep(1.0)
        capture = {"hidden_states": {"layers": [0, 15, 29], "positions": "all"},
                   "qk": {"layers": [3], "heads": "all", "positions": "last_prompt"}}
        steer = [{"layer": 10, "op": "add", "vector": [0.01] * 576, "scale": 2.0, "positions": "generated"}]
        prompts = ["The capital of France is", "Write a haiku about the sea:", "1, 2, 3, 4,"]
        params = [SamplingParams(max_tokens=6 + 2 * i, temperature=0,
                                 extra_args={"mia_stream": {"capture": capture, "id": f"compat-{i}",
                                                            **({"steer": steer} if i == 1 else {})}})
                  for i in range(3)]
        llm.generate(prompts, params, use_tqdm=False)
        time.sleep(1.5)
        recorder.terminate()
        recorder.wait(20)
        llm.llm_engine.engine_core.shutdown()
    parts = sorted(rec_dir.glob("*.mcap"))
    assert len(parts) == 1, parts
    shutil.copy(parts[0], out_dir / "recording-2.1.mcap")
    write_digests(out_dir)
    shutil.rmtree(run_dir, ignore_errors=True)
    print(f"wrote {out_dir}/recording-2.1.mcap and recording-2.1-events.json")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--digests-only"]:  # the recording exists: (re)write its digests
        write_digests(Path(sys.argv[2]))
    else:
        main(Path(sys.argv[1]))
