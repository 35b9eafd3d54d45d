"""An engine's start-time settings against what requests ask of it, and a clean shutdown. One real vLLM engine
with the plugin (tests/limits_engine_run.py, in a subprocess: it needs its own environment), started with
MIA_STREAM_STEERING=0 and MIA_STREAM_CAPTURE_QK=0, every other setting default, in vLLM's default topology; the
broker runs here (its ring grace 1 s) and this process is the consumer.

- A request with ``steer`` / capturing ``qk`` / quantizing (MIA_STREAM_QUANTIZE off by default: no workspace) is
  refused at admission with an error naming the setting, and the engine keeps serving (before: the steered request killed the engine; the qk one streamed hs only, silently).
- Default settings keep whole prefill steps: a burst whose first step computes ``max_num_batched_tokens`` (4096
  on vLLM CPU) rows, twice the old 2048-row aperture, loses no frame, and the rows equal Hugging Face's.
- Shutdown: EngineCore holds no shared-memory ring (before: an unused 256 MiB one, left in /dev/shm whenever
  vLLM force-killed it); every process exits; no ring of the engine's processes remains once the broker's
  grace has passed; vLLM force-kills nothing. vLLM's grace is given 30 s here: on this loaded 2-core machine
  vLLM CPU's own EngineCore, without the plugin, does not exit within its default 5 s
  (scripts/bench_shutdown.py; docs/benchmarks.md).
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from limits_engine_run import CAPTURE_LAYER
from producer_helpers import StreamCollector, hf_trace, rel_err

pytestmark = pytest.mark.slow
HERE = Path(__file__).resolve().parent
BURST = 64
TOL = 1e-4  # as tests/test_producer.py: ten times the measured float32 drift against HF
RING_GRACE_S = 1.0


def _consume_while_running(col: StreamCollector, proc: subprocess.Popen, deadline: float) -> None:
    """Read the streams as the engine publishes them (ring payloads must be read before their producer's ring
    goes), until the engine process has exited."""
    client = col._stream._source
    while proc.poll() is None and time.monotonic() < deadline:
        for ev in client.events(timeout=0.5):
            col.events[ev.stream.request_id].append(ev)


@pytest.fixture(scope="module")
def run(model_dir):
    from mia_stream.broker import run_broker_in_thread

    prefix = f"lim-{uuid.uuid4().hex[:6]}"
    run_dir = tempfile.mkdtemp(prefix="mia-lim-", dir="/tmp")
    work = Path(tempfile.mkdtemp(prefix="mia-lim-out-"))
    env = dict(os.environ, MIA_STREAM_BROKER=run_dir, MIA_STREAM_STEERING="0", MIA_STREAM_CAPTURE_QK="0",
               VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               PYTHONPATH=os.pathsep.join(p for p in (str(HERE.parent), os.environ.get("PYTHONPATH")) if p))
    for name in ("MIA_STREAM_APERTURE_ROWS", "MIA_STREAM_HOST_RING_MB", "MIA_STREAM_QUANTIZE",
                 "VLLM_ENABLE_V1_MULTIPROCESSING"):
        env.pop(name, None)  # defaults, and vLLM's default multiprocess engine
    try:
        with run_broker_in_thread(address=run_dir, ring_grace_s=RING_GRACE_S):
            col = StreamCollector(run_dir, [f"{prefix}-*"])
            time.sleep(0.2)
            log = work / "engine.log"
            with open(log, "w") as f:
                proc = subprocess.Popen([sys.executable, str(HERE / "limits_engine_run.py"), "--model", model_dir,
                                         "--out", str(work / "out.json"), "--prefix", prefix, "--burst", str(BURST)],
                                        env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
                try:
                    _consume_while_running(col, proc, deadline=time.monotonic() + 480)
                finally:
                    if proc.poll() is None:
                        os.killpg(proc.pid, 9)
                        proc.wait(10)
            text = log.read_text()
            assert proc.returncode == 0 and (work / "out.json").exists(), text[-4000:]
            out = json.loads((work / "out.json").read_text())
            col.wait_ended(list(out["burst"]), timeout=30)
            col.close()
            time.sleep(RING_GRACE_S + 1.0)  # a ring handed over to the broker is its to remove after the grace
            rings_after = {name: sorted(glob.glob(f"/dev/shm/mia-stream-ring-{pid}-*"))
                           for name, pid in out["pids"].items()}
            yield {"out": out, "events": col.events, "log": text, "rings_after": rings_after, "prefix": prefix}
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)


def test_a_request_needing_a_switched_off_feature_is_refused_naming_the_setting(run):
    refused, out = run["out"]["refused"], run["out"]
    assert refused["steer"] is not None and "MIA_STREAM_STEERING=0" in refused["steer"], refused
    assert refused["qk"] is not None and "MIA_STREAM_CAPTURE_QK=0" in refused["qk"], refused
    assert refused["quantize"] is not None and "MIA_STREAM_QUANTIZE=1" in refused["quantize"], refused
    assert refused["quantize"].split(": ", 1)[1].startswith(
        "mia_stream: extra_args['mia_stream']['capture']['quantize']")
    assert refused["steer"].split(": ", 1)[1].startswith("mia_stream: extra_args['mia_stream']['steer']")
    assert refused["qk"].split(": ", 1)[1].startswith("mia_stream: extra_args['mia_stream']['capture']['qk']")
    # one error hierarchy: the refusal is the spec error a caller catches, whatever vLLM build wraps it
    assert "SteeringSpecError" in out["refused_kinds"]["steer"] and "MiaStreamError" in out["refused_kinds"]["steer"]
    assert "CaptureSpecError" in out["refused_kinds"]["qk"] and "MiaStreamError" in out["refused_kinds"]["qk"]
    # the engine kept serving after each refusal, and the refused requests never reached it
    assert len(out["served_after_refusal"]) == 3 and all("Paris" in t for t in out["served_after_refusal"])
    assert not [rid for rid in run["events"] if rid.endswith(("-steer", "-qk", "-quantize"))]
    assert "EngineDeadError" not in run["log"]


def test_default_settings_keep_every_row_of_a_full_prefill_step(run, hf_model):
    out, events = run["out"], run["events"]
    assert out["max_num_batched_tokens"] > 2048
    rows_per_step: Counter = Counter()
    for rid, info in out["burst"].items():
        evs = events[rid]
        end = [e for e in evs if e.kind == "end"][0].end
        assert end.frames_dropped == 0 and not end.drops and not evs[0].stream.gaps, (rid, end.drops)
        frames = [e.frame for e in evs if e.kind == "frame"]
        full = info["prompt_token_ids"] + info["token_ids"]
        assert [p for f in frames for p in f.positions] == list(range(len(full) - 1))
        for f in frames:
            rows_per_step[f.step] += len(f.positions)
    # a step of the burst computed more rows than the old 2048-row aperture held (the full budget, 4096, when
    # all 64 requests reached the engine before its first step), all captured
    assert 2048 < max(rows_per_step.values()) <= out["max_num_batched_tokens"], rows_per_step
    for rid in list(out["burst"])[:2]:  # the rows are the right ones
        info = out["burst"][rid]
        full = info["prompt_token_ids"] + info["token_ids"]
        hs = np.concatenate([e.frame.tensors["hs"] for e in events[rid] if e.kind == "frame"], axis=1)
        ref, _, _, _ = hf_trace(hf_model, full[:-1])
        assert hs.shape == (1, len(full) - 1, 576)
        assert rel_err(hs, ref[CAPTURE_LAYER:CAPTURE_LAYER + 1]).max() < TOL


def test_the_plugin_engine_shuts_down_cleanly_leaving_no_ring(run):
    out = run["out"]
    pids, during = out["pids"], out["rings_while_running"]
    assert {"engine_core", "worker0", "sidecar0"} <= set(pids), pids
    # EngineCore (steering control) and the frontend have no ring; the worker's host ring (the rows its copies
    # land in, which consumers read in place) and the drain sidecar's publisher ring are the only two, and
    # neither outlives the engine
    assert during["engine_core"] == [] and during["frontend"] == []
    assert len(during["worker0"]) == 1 and len(during["sidecar0"]) == 1
    assert set(out["exited_s"]) == {name for name in pids if name != "frontend"}, out["exited_s"]
    assert "force killing" not in run["log"]
    assert not any(run["rings_after"].values()), run["rings_after"]
    print(f"shutdown: returned after {out['shutdown_returned_s']:.2f} s; exits {out['exited_s']}")
