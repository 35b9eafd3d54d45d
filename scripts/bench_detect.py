#!/usr/bin/env python
"""In-engine detectors vs the out-of-engine analyzer path, side by side in one run (issue 25).

    python3 scripts/bench_detect.py --out /tmp/bd                                   # CPU, the embedded model
    python3 scripts/bench_detect.py --model /tmp/models/smollm2-shape --dummy --n 256 --tokens 128 --out $OUT

The topology users run, each its own process: a broker (``mia-stream broker``), vLLM's default multiprocess
engine with the plugin (``vllm.LLM`` here), the out-of-engine detector (``mia-stream analyze token_probe
--publish`` with the same probe, alert threshold and action), and a subscriber process reading every stream
through ``open_batches``. Rounds alternate two arms on the same engine, fresh random prompts each round:

- ``engine``: each request names the probe in its spec (``detect``: scored in the forward pass, judged and acted
  on in the engine core);
- ``analyzer``: each request captures what the analyzer needs; the analyzer scores the rows and acts through the
  broker (today's path).

A calibration round (engine arm, no action) sets the alert threshold to the ``--quantile`` of all token risks, so
that alerts fall mid-generation in most requests. Reported per arm: scored rows; score latency at the subscriber
(receive - ``source_time_ns``, the time the step's rows or scores reached the host) p50/p99 in ms and in decode
steps (the median interval between consecutive steps' ``source_time_ns``); alert-to-applied steps
(``applied_step - alert_step`` of the ``alert_action`` records); tokens in the output after the alerting token
(``prompt + output - (alert position + 1)``: 1 = only the token sampled in the alerting step, the target);
actions that came too late (the request had ended: refused, or not aborted). Actions on request-level alerts
(the analyzer's answer score, published at the request's end) are counted apart: they can only come too late.
Writes ``results.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from _procs import ensure_plugin_entry_point, random_probe_file, stop_processes  # noqa: E402


def pct(xs, q) -> float:
    return float(np.percentile(np.asarray(xs, np.float64), q)) if len(xs) else float("nan")


def subscriber(address: str, out: str) -> int:
    """Every analysis batch (engine:*, token_probe, alert_action): receive time, its fields; until SIGTERM."""
    from mia_stream.consumers import open_batches

    rec: list = []
    stop = False

    def _term(*_):
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, _term)
    with open_batches(address, ["*"], from_start=False, timeout=0.2, consumer_id=f"bench-detect-{os.getpid()}") as ev:
        Path(out + ".ready").write_text("1")
        src = ev._source
        while not stop:
            for e in src.events(0.2):
                now = time.time_ns()
                if e.kind == "batch" and e.batch.KIND == "analysis":
                    b = e.batch
                    row = {"analyzer": b.analyzer, "ids": list(b.request_ids), "step": int(b.step),
                           "rows": b.rows.tolist(), "positions": b.positions.tolist(), "recv": now, "pub": int(b.time_ns),
                           "src": int(b.source_time_ns), "alerts": int(b.alerts.sum())}
                    if b.analyzer == "alert_action":
                        row["alert_step"] = b.values["alert_step"].tolist()
                        row["applied_step"] = b.values["applied_step"].tolist()
                        row["source"] = b.labels.get("source")
                        row["error"] = b.labels.get("error")
                    elif "risk" in b.values:
                        row["risk"] = np.asarray(b.values["risk"], np.float64).tolist()
                    rec.append(row)
                if stop:
                    break
    Path(out).write_text(json.dumps(rec))
    return 0


def step_ms(batches: list) -> float:
    """Median interval between consecutive engine steps' source times (a decode step on a loaded engine)."""
    by_step = {}
    for b in batches:
        if b["step"] >= 0 and b["src"]:
            by_step.setdefault(b["step"], b["src"])
    s = sorted(by_step)
    d = [(by_step[b] - by_step[a]) / 1e6 for a, b in zip(s, s[1:]) if b == a + 1]
    return float(np.median(d)) if d else float("nan")


def summarize(arm: str, batches: list, actions: list, outputs: dict, prompt_lens: dict) -> dict:
    lat = [(b["recv"] - b["src"]) / 1e6 for b in batches if b["src"]]
    st = step_ms(batches)
    pub = [(b["pub"] - b["src"]) / 1e6 for b in batches if b["src"]]  # until the publisher had it
    res = {"arm": arm, "messages": len(batches), "scored_rows": int(sum(sum(b["rows"]) for b in batches)),
           "publish_p50_ms": round(pct(pub, 50), 2), "publish_p99_ms": round(pct(pub, 99), 2),
           "score_p50_ms": round(pct(lat, 50), 2), "score_p99_ms": round(pct(lat, 99), 2),
           "step_ms": round(st, 2), "score_p50_steps": round(pct(lat, 50) / st, 2),
           "score_p99_steps": round(pct(lat, 99) / st, 2)}
    applied, after, late = [], [], 0
    ends = [a for a in actions if a["positions"][0] < 0]  # request-level alerts (an analyzer's answer score)
    actions = [a for a in actions if a["positions"][0] >= 0]
    for a in actions:
        rid = a["ids"][0]
        ok = a["applied_step"][0] >= 0 and (a["error"] or [None])[0] is None
        out = outputs.get(rid)
        if not ok or out is None or out["finish"] != "abort":
            late += 1
            continue
        applied.append(a["applied_step"][0] - a["alert_step"][0])
        after.append(prompt_lens[rid] + out["tokens"] - (a["positions"][0] + 1))
    res.update({"token_actions": len(actions), "too_late": late, "request_level_actions": len(ends),
                "alert_to_applied_steps_p50": pct(applied, 50), "alert_to_applied_steps_p99": pct(applied, 99),
                "tokens_after_alert_p50": pct(after, 50), "tokens_after_alert_p99": pct(after, 99),
                "tokens_after_alert_max": max(after) if after else None})
    return res


def parity(llm, SamplingParams, address: str, probe: str, rng, vocab: int, a) -> dict:
    """The in-engine score of every generated row vs the probe file's formula on the same rows captured in the same
    request (the model's dtype: bf16 on the GPU, float32 on the CPU): max and p99 absolute risk difference."""
    import threading

    from mia_stream.consumers import open_stream
    from mia_stream.spec.probes import load_probe

    p = load_probe(probe, None)
    ids = [f"par-{i}" for i in range(8)]
    rows: dict = {}
    scores: dict = {}
    with_logits: dict = {}
    done = threading.Event()

    def collect():
        with open_stream(address, patterns=["par-*"], timeout=60) as events:
            ended = 0
            for ev in events:
                rid = ev.stream.request_id
                if ev.kind == "frame" and "hs" in ev.frame.raw_tensors:
                    for pos, h in zip(ev.frame.positions, ev.frame.tensors["hs"][0]):
                        rows[(rid, int(pos))] = np.asarray(h, np.float64)
                elif ev.kind == "analysis" and ev.analysis.step == -1:
                    pass  # a detector's final result (max_risk, alert_rows) at the request's end
                elif ev.kind == "analysis" and ev.analysis.analyzer == "engine:with_logits":
                    for pos, r in zip(ev.analysis.positions, ev.analysis.values["risk"]):
                        with_logits[(rid, int(pos))] = float(r)
                elif ev.kind == "analysis" and ev.analysis.analyzer.startswith("engine:"):
                    for pos, r in zip(ev.analysis.positions, ev.analysis.values["risk"]):
                        scores[(rid, int(pos))] = float(r)
                elif ev.kind == "end":
                    ended += 1
                if ended >= len(ids) and len(scores) >= len(rows) > 0:
                    break
        done.set()

    t = threading.Thread(target=collect, daemon=True)
    t.start()
    time.sleep(1.0)
    # a second detector on the same probe with logit features (the sampler's statistics): it must score every
    # row too, and move the risks
    lf_probe = Path(address) / "probe-logit-features.json"
    raw = json.loads(Path(probe).read_text())
    raw["logit_features"] = {"names": ["logprob", "entropy"], "mean": [0.0, 0.0], "scale": [1.0, 1.0],
                             "weights": [-0.5, 0.5]}
    lf_probe.write_text(json.dumps(raw))
    spec = {"capture": {"hidden_states": {"layers": [p.layer], "positions": "generated"}},
            "detect": [{"probe": probe, "positions": "generated"},
                       {"probe": str(lf_probe), "name": "with_logits", "positions": "generated"}]}
    llm.generate([{"prompt_token_ids": rng.integers(100, vocab, a.prompt_len).tolist()} for _ in ids],
                 [SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True,
                                 extra_args={"mia_stream": {**spec, "id": rid}}) for rid in ids], use_tqdm=False)
    done.wait(60)
    keys = sorted(set(rows) & set(scores))
    if not keys:
        return {"rows": 0}
    ref = 1.0 / (1.0 + np.exp(-p.logits(np.stack([rows[k] for k in keys]))))
    diff = np.abs(np.asarray([scores[k] for k in keys]) - ref)
    lf = np.asarray([with_logits.get(k, np.nan) for k in keys])
    return {"rows": len(keys), "captured": len(rows), "scored": len(scores), "max_abs_diff": float(diff.max()),
            "p99_abs_diff": float(np.percentile(diff, 99)),
            "logit_feature_rows_scored": int(np.isfinite(lf).sum()),
            "logit_feature_mean_abs_shift": float(np.nanmean(np.abs(lf - ref))) if np.isfinite(lf).any() else None}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="model dir (default: the embedded model)")
    ap.add_argument("--dummy", action="store_true", help="load_format=dummy (a config-only model dir)")
    ap.add_argument("--probe", help="probe file (default: the shipped token probe for the embedded model, else a "
                                    "random probe of the model's shape)")
    ap.add_argument("--n", type=int, default=16, help="concurrent requests per round")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2, help="rounds per arm (alternating)")
    ap.add_argument("--quantile", type=float, default=0.97, help="alert threshold: this quantile of token risks")
    ap.add_argument("--gpu-mem", type=float, default=None)
    ap.add_argument("--eager", action="store_true")
    ap.add_argument("--parity-only", action="store_true", help="stop after the parity step")
    ap.add_argument("--out", required=True)
    ap.add_argument("--subscriber", nargs=2, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.subscriber:
        return subscriber(*a.subscriber)
    out_dir = Path(a.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="mia-bd-", dir="/tmp"))
    ensure_plugin_entry_point(work)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    from transformers import AutoConfig

    from mia_stream.model import default_model_dir

    model = a.model or str(default_model_dir())
    cfg = AutoConfig.from_pretrained(model)
    L, H = cfg.num_hidden_layers, cfg.hidden_size
    probe = a.probe
    if probe is None:
        from mia_stream.spec.probes import PROBES_DIR, load_probe

        shipped = PROBES_DIR / "token-probe-smollm2-135m.json"
        p = load_probe(shipped, None)
        probe = str(shipped) if (p.hidden_size, p.num_layers) == (H, L) else str(
            random_probe_file(work / "probe.json", H, L, L // 2))
    py = [sys.executable, "-m", "mia_stream.cli"]
    procs: dict = {}
    results: dict = {"model": model, "n": a.n, "tokens": a.tokens, "probe": probe, "arms": []}
    try:
        procs["broker"] = subprocess.Popen(py + ["broker", "--address", str(work)], stdout=subprocess.DEVNULL)
        while not (work / "consumers.sock").exists():
            time.sleep(0.05)
        sub_out = str(work / "sub.json")
        procs["subscriber"] = subprocess.Popen([sys.executable, __file__, "--out", a.out, "--subscriber", str(work),
                                                sub_out])
        while not Path(sub_out + ".ready").exists():
            time.sleep(0.05)
        os.environ["MIA_STREAM_BROKER"] = str(work)
        from vllm import LLM, SamplingParams

        kw = dict(model=model, max_model_len=max(1024, a.prompt_len + a.tokens + 16), enforce_eager=a.eager, seed=0)
        if a.gpu_mem:
            kw["gpu_memory_utilization"] = a.gpu_mem
        if a.dummy:
            kw["load_format"] = "dummy"
        import torch

        if not torch.cuda.is_available():
            kw["dtype"] = "float32"
        llm = LLM(**kw)
        rng = np.random.default_rng()
        vocab = min(int(cfg.vocab_size), 32000)
        prompt_lens: dict = {}
        outputs: dict = {}

        def generate(tag: str, spec_of) -> float:
            prompts, params, ids_ = [], [], []
            for i in range(a.n):
                ids = rng.integers(100, vocab, a.prompt_len).tolist()
                rid = f"{tag}-{i}"
                prompt_lens[rid] = len(ids)
                ids_.append(rid)
                prompts.append({"prompt_token_ids": ids})
                params.append(SamplingParams(max_tokens=a.tokens, temperature=0.0, ignore_eos=True,
                                             extra_args={"mia_stream": {**spec_of(rid), "id": rid}}))
            t0 = time.monotonic()
            outs = llm.generate(prompts, params, use_tqdm=False)
            dt = time.monotonic() - t0
            for rid, o in zip(ids_, outs):
                outputs[rid] = {"finish": o.outputs[0].finish_reason, "tokens": len(o.outputs[0].token_ids)}
            return dt

        results["parity"] = parity(llm, SamplingParams, str(work), probe, rng, vocab, a)
        print(f"parity: {json.dumps(results['parity'])}", flush=True)
        if a.parity_only:
            llm.llm_engine.engine_core.shutdown()
            (out_dir / "results.json").write_text(json.dumps(results, indent=1))
            return 0
        # calibration: the engine arm without an action sets the threshold
        generate("cal", lambda rid: {"detect": [{"probe": probe, "positions": "generated"}]})
        time.sleep(2.0)
        stop_processes([procs.pop("subscriber")])
        cal = json.loads(Path(sub_out).read_text())
        risks = [r for b in cal if b["analyzer"].startswith("engine:") for r in b.get("risk", [])]
        threshold = float(np.quantile(risks, a.quantile)) if risks else 0.5
        results["threshold"] = threshold
        results["calibration_rows"] = len(risks)
        print(f"threshold {threshold:.6f} (the {a.quantile} quantile of {len(risks)} token risks)", flush=True)

        acfg = work / "analyzer.json"
        acfg.write_text(json.dumps({"probe": probe, "alert": {"threshold": threshold, "action": "abort"}}))
        spec = subprocess.run(py + ["analyze", "token_probe", "--config", str(acfg), "--print-spec"],
                              capture_output=True, text=True, check=True)
        capture = json.loads(spec.stdout)["capture"]
        procs["analyzer"] = subprocess.Popen(py + ["analyze", "token_probe", "--config", str(acfg), "--source",
                                                   str(work), "--publish", "--patterns", "ana*"],
                                             stderr=subprocess.PIPE, text=True)
        sub_out = str(work / "sub2.json")
        procs["subscriber"] = subprocess.Popen([sys.executable, __file__, "--out", a.out, "--subscriber", str(work),
                                                sub_out])
        while not Path(sub_out + ".ready").exists():
            time.sleep(0.05)
        time.sleep(3.0)  # the analyzer's subscription reaches the broker
        detect = {"detect": [{"probe": probe, "positions": "generated",
                              "alert": {"threshold": threshold}, "action": "abort"}]}
        for r in range(a.rounds):
            for arm, spec_of in (("eng", lambda rid: detect), ("ana", lambda rid: {"capture": capture})):
                dt = generate(f"{arm}{r}", spec_of)
                print(f"round {r} {arm}: {dt:.2f} s", flush=True)
        time.sleep(3.0)
        stop_processes([procs.pop("subscriber")])
        got = json.loads(Path(sub_out).read_text())
        for arm, name in (("engine", "engine:token_probe"), ("analyzer", "token_probe")):
            tag = "eng" if arm == "engine" else "ana"
            batches = [b for b in got if b["analyzer"] == name]
            actions = [b for b in got if b["analyzer"] == "alert_action" and b["ids"][0].startswith(tag)]
            res = summarize(arm, batches, actions, {k: v for k, v in outputs.items() if k.startswith(tag)},
                            prompt_lens)
            results["arms"].append(res)
            print(json.dumps(res), flush=True)
        llm.llm_engine.engine_core.shutdown()
    finally:
        stop_processes(procs.values())
    (out_dir / "results.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
