"""One real vLLM CPU engine with the plugin, for tests/test_nats_engine.py (a subprocess: vLLM needs its main guard
and its own environment, MIA_STREAM_BROKER naming the test's broker):

    python tests/nats_engine_run.py --model DIR --out out.json --hold HOLD_FILE

Three greedy requests stream their tokens (``n0``, ``n1``: 24 tokens; ``long``: up to LONG_MAX_TOKENS, which a remote
consumer aborts over NATS). ``out.json``: each request's token ids and finish reason as vLLM returned them (the
reference the remote consumer's stream is checked against). Then it waits until HOLD_FILE is gone, so the test
scrapes the metrics of the engine's processes while they run.
"""

from __future__ import annotations

import argparse
import json
import os
import time

# The abort is sent after 8 of its tokens reach the remote consumer. In CI (2 loaded cores) that consumer once
# lagged past all of a 400-token answer and the abort found the request finished: the answer is long enough that
# only a lost abort, not a slow path, lets it end by itself.
LONG_MAX_TOKENS = 3000
PROMPTS = {"n0": "The capital of France is", "n1": "Name three colors:",
           "long": "Write a very long story about a dragon and a knight."}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--hold", required=True)
    args = ap.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams

    llm = LLM(args.model, dtype="float32", max_model_len=LONG_MAX_TOKENS + 64, max_num_seqs=4, enforce_eager=True, seed=0)
    params = []
    for rid in PROMPTS:
        spec = {"id": rid, "capture": {"hidden_states": {"layers": [0], "positions": "all"}}}
        params.append(SamplingParams(max_tokens=LONG_MAX_TOKENS if rid == "long" else 24, temperature=0, ignore_eos=True,
                                     extra_args={"mia_stream": spec}))
    t0 = time.time()
    outs = llm.generate(list(PROMPTS.values()), params)
    result = {rid: {"token_ids": list(o.outputs[0].token_ids), "finish_reason": o.outputs[0].finish_reason}
              for rid, o in zip(PROMPTS, outs)}
    result["_generate_s"] = time.time() - t0
    with open(args.out + ".tmp", "w") as f:
        json.dump(result, f)
    os.replace(args.out + ".tmp", args.out)
    deadline = time.time() + 120
    while os.path.exists(args.hold) and time.time() < deadline:
        time.sleep(0.2)
    llm.llm_engine.engine_core.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
