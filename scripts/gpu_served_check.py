"""Served mode on a GPU host (issue 26): ``mia-stream serve`` (broker + vLLM's OpenAI server with the plugin, each
its own process) on a model there, then, through ``StreamClient`` and the official ``openai`` client:

1. a captured chat request: every position's hidden state of one layer arrives, in order, and the text equals
   the tokens the stream carried;
2. a steered chat request (greedy, the same prompt, ``add`` of a vector at one layer, captured at that layer):
   its frames carry steering version 1 and its prompt rows differ from the unsteered request's by the vector
   (the rows before the first generated token have identical inputs, so the difference is the vector alone,
   within bf16 rounding);
3. a bad spec: HTTP 400 naming the field, and the server keeps serving (a plain request after it succeeds).

Prints one ``RESULT {json}`` line (and writes it to ``--out``/served.json). The GPU host needs vLLM's API
server modules (``scripts/missing_modules.py`` lists what is missing):

    python3 scripts/gpu_served_check.py --model /tmp/models/smollm2-random --out $OUT
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mia_stream.served.serve import READY_PREFIX  # noqa: E402
from _procs import ensure_plugin_entry_point  # noqa: E402  (scripts/_procs.py, beside this file)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", default=".")
    ap.add_argument("--layer", type=int, default=10)
    ap.add_argument("--start-timeout", type=float, default=400)
    ap.add_argument("--vllm-args", default="--max-model-len 1024", help="extra `vllm serve` arguments")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    port, address = _free_port(), f"/tmp/mia-served-{os.getpid()}"
    ensure_plugin_entry_point(Path(f"/tmp/mia-served-ep-{os.getpid()}"))  # a checkout on PYTHONPATH has none
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    env.pop("MIA_STREAM_BROKER", None)
    log_path = out / "serve.log"
    cmd = [sys.executable, "-m", "mia_stream.cli", "serve", args.model, "--address", address, "--port", str(port),
           *args.vllm_args.split()]
    result: dict = {"command": " ".join(cmd)}
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            t0 = time.monotonic()
            while True:
                text = log_path.read_text(errors="replace")
                if READY_PREFIX in text:
                    break
                if proc.poll() is not None or time.monotonic() - t0 > args.start_timeout:
                    result["error"] = f"server not ready (exit {proc.poll()}): {text[-3000:]}"
                    return _finish(result, out, 1)
                time.sleep(1)
            result["start_s"] = round(time.monotonic() - t0, 1)
            result.update(_checks(f"http://127.0.0.1:{port}/v1", address, args))
        except Exception as e:  # reported, not raised: the server's log comes back beside it
            result["error"] = f"{type(e).__name__}: {e}"
        finally:
            try:
                os.killpg(proc.pid, signal.SIGINT)
                proc.wait(60)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                os.killpg(proc.pid, signal.SIGKILL)
    ok = "error" not in result and all(v is True for k, v in result.items() if k.startswith("ok_"))
    return _finish(result, out, 0 if ok else 1)


def _checks(url: str, broker: str, args) -> dict:
    import openai

    from mia_stream.served.client import StreamClient

    client = StreamClient(url, broker=broker, keep_frames=True)
    model = client.openai.models.list().data[0].id
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    layer = args.layer
    r: dict = {}
    # 1. captured
    with client.chat(messages, capture={"hidden_states": {"layers": [layer], "positions": "all"}}, max_tokens=16,
                     temperature=0.0) as req:
        for _ in req:
            pass
    frames = req.frames
    positions = [int(p) for f in frames for p in f.positions]
    hidden = int(frames[0].tensors["hs"].shape[-1]) if frames else 0
    plain_rows = {int(p): np.asarray(f.tensors["hs"][0, j], np.float32) for f in frames
                  for j, p in enumerate(f.positions)}
    r["captured_positions"] = len(positions)
    r["ok_captured_in_order"] = positions == list(range(len(positions))) and len(positions) > 16
    r["ok_captured_text"] = bool(req.text) and req.end is not None and req.end.finish_reason in ("length", "stop")
    r["end_status"] = getattr(req.end, "finish_reason", None)
    # 2. steered: the same prompt, a vector added at the captured layer
    vec = np.random.default_rng(0).standard_normal(hidden).astype(np.float32)
    vec *= 4.0 / np.linalg.norm(vec)
    with client.chat(messages, capture={"hidden_states": {"layers": [layer], "positions": "all"}},
                     steer=[{"layer": layer, "op": "add", "vector": vec.tolist()}], max_tokens=16,
                     temperature=0.0) as sreq:
        for _ in sreq:
            pass
    versions = {int(f.steering_version) for f in sreq.frames}
    # the prompt's rows: before the first decode step's row (its input is the first generated token)
    prompt_len = min(int(f.positions[0]) for f in frames if len(f.positions) == 1) if any(
        len(f.positions) == 1 for f in frames) else len(positions)
    errs = []
    for f in sreq.frames:
        for j, p in enumerate(f.positions):
            p = int(p)
            if p < prompt_len and p in plain_rows:
                row = np.asarray(f.tensors["hs"][0, j], np.float32)
                scale = max(float(np.abs(plain_rows[p]).max()), 1.0)
                errs.append(float(np.abs(row - plain_rows[p] - vec).max()) / scale)
    r["steered_versions"] = sorted(versions)
    r["steer_prompt_rows"] = len(errs)
    r["steer_max_rel_err"] = max(errs) if errs else None
    r["ok_steered_version"] = versions == {1}
    r["ok_steered_rows"] = bool(errs) and max(errs) < 2e-2  # bf16 rounding of rows of this size
    r["steered_text_differs"] = sreq.text != req.text
    # 3. a bad spec: a 400 naming the field; the server keeps serving
    oc = openai.OpenAI(base_url=url, api_key="EMPTY", max_retries=0)
    try:
        oc.chat.completions.create(model=model, messages=messages, max_tokens=2,
                                   extra_body={"vllm_xargs": {"mia_stream": json.dumps(
                                       {"capture": {"hidden_states": {"layers": [999]}}})}})
        r["bad_spec"] = "accepted"
    except openai.BadRequestError as e:
        r["bad_spec"] = {"status": e.status_code, "message": e.body.get("message") if isinstance(e.body, dict) else str(e)}
    r["ok_bad_spec_400"] = isinstance(r["bad_spec"], dict) and r["bad_spec"]["status"] == 400 and \
        "layer 999 is out of range" in (r["bad_spec"]["message"] or "")
    after = oc.chat.completions.create(model=model, messages=messages, max_tokens=4)
    r["ok_serves_after_400"] = bool(after.choices[0].message.content)
    return r


def _finish(result: dict, out: Path, rc: int) -> int:
    line = json.dumps(result, default=str)
    print("RESULT " + line, flush=True)
    (out / "served.json").write_text(line + "\n")
    return rc


if __name__ == "__main__":
    sys.exit(main())
