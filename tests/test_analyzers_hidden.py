"""The hidden-state analyzers on a real capture of the embedded model (CPU vLLM), as separate processes:
each one's output equals an independent reference computed with Hugging Face ``transformers`` on the same
tokens; live == replay of the recording; a crashing or killed analyzer leaves the engine and the other consumers
untouched."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from producer_helpers import collecting, hf_trace, rel_err
from test_analyzers_framework import slow_analyzers

from mia_stream.lab import datasets

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
PROBES = ROOT / "mia_stream" / "analyzers" / "probes"
TOL = 1e-4
HS_LAYERS = [0, 14, 29]


def _params(max_tokens, spec=None):
    from vllm import SamplingParams

    extra = {"mia_stream": spec} if spec is not None else None
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, extra_args=extra)


def _prompt_ids(tokenizer, item):
    text = tokenizer.apply_chat_template(datasets.chat_messages(item), add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _analyze(args, env, **kw):
    return subprocess.Popen([sys.executable, "-m", "mia_stream.cli", "analyze", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT, **kw)


def _wait_subscribed(address, names, procs, timeout=60):
    from mia_stream.broker import fetch_stats

    deadline = time.monotonic() + timeout
    while True:
        consumers = fetch_stats(address)["consumers"]
        if all(any(c.startswith(n) for c in consumers) for n in names):
            return
        for p in procs:
            if p.poll() is not None:
                raise AssertionError(p.stderr.read())
        assert time.monotonic() < deadline, f"not subscribed: {names} in {list(consumers)}"
        time.sleep(0.1)


def _results(stdout):
    out = {}
    for line in stdout.splitlines():
        r = json.loads(line)
        out.setdefault(r["request_id"], []).append(r)
    return out


def test_analyzers_equal_the_hf_reference_live_and_on_replay(engine, broker_address, hf_model, tokenizer,
                                                             tmp_path):
    """Three analyzer processes and a recorder on the live stream of real requests; each analyzer's output equals
    its formula applied to HF hidden states of the same tokens; replaying the recording through the same
    command gives byte-identical output."""
    items = [datasets.capital_questions()[3], datasets.element_questions()[0], datasets.element_questions()[4]]
    prompts = [{"prompt_token_ids": _prompt_ids(tokenizer, it)} for it in items]
    spec_all = {"hidden_states": {"layers": "all", "positions": "all"}}
    rids = [f"ana-{i}" for i in range(len(items))]
    cfg = tmp_path / "hs.json"
    cfg.write_text(json.dumps({"layers": HS_LAYERS}))
    rec = tmp_path / "rec"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    names = {"hidden_states": ["--config", str(cfg)], "hnode": [], "science_hallucination": []}
    procs = {n: _analyze([n, *extra, "--source", broker_address, "--patterns", "ana-*", "--max-streams",
                          str(len(items)), "--idle-timeout", "120"], env) for n, extra in names.items()}
    recorder = subprocess.Popen([sys.executable, "-m", "mia_stream.cli", "record", str(rec), "--broker",
                                 broker_address, "--patterns", "ana-*", "--flush-interval", "0.1"],
                                stderr=subprocess.PIPE, env=env, cwd=ROOT)
    try:
        _wait_subscribed(broker_address, [f"analyzer:{n}:" for n in names], list(procs.values()))
        time.sleep(1.0)  # the recorder subscribes too
        outs = engine.generate(prompts, [_params(10, {"capture": spec_all, "id": r}) for r in rids])
        live = {n: p.communicate(timeout=180) for n, p in procs.items()}
        time.sleep(1.0)
    finally:
        recorder.send_signal(signal.SIGINT)
        try:
            recorder.wait(20)
        except subprocess.TimeoutExpired:
            recorder.kill()
        for p in procs.values():
            if p.poll() is None:
                p.kill()
    for n, p in procs.items():
        assert p.returncode == 0, (n, live[n][1])

    # replay: the same command on the recording, byte-identical output
    for n, extra in names.items():
        r = subprocess.run([sys.executable, "-m", "mia_stream.cli", "analyze", n, *extra, "--source", str(rec)],
                           capture_output=True, text=True, env=env, cwd=ROOT, timeout=180)
        assert r.returncode == 0, r.stderr
        assert r.stdout == live[n][0], n

    hnode = json.loads((PROBES / "hnode-smollm2-135m.json").read_text())
    science = json.loads((PROBES / "science-smollm2-135m.json").read_text())
    res = {n: _results(live[n][0]) for n in names}
    for rid, out in zip(rids, outs):
        prompt_ids, gen_ids = list(out.prompt_token_ids), list(out.outputs[0].token_ids)
        full = prompt_ids + gen_ids
        n_pos = len(full) - 1  # the last sampled token is never fed back
        ref_hs, _, _, _ = hf_trace(hf_model, full[:-1])  # raw residual after each layer [30, T, 576]
        with torch.no_grad():
            normed_last = hf_model(torch.tensor([full[:-1]]), output_hidden_states=True).hidden_states[-1][0]
        ref64 = ref_hs.astype(np.float64)

        # hidden_states: per-token norms while running, mean and last at the end
        hs_rows = [r for r in res["hidden_states"][rid] if r["step"] >= 0]
        assert [p for r in hs_rows for p in r["positions"]] == list(range(n_pos))
        norms = np.concatenate([np.asarray(r["values"]["norm"]) for r in hs_rows])  # [T, 3]
        assert rel_err(norms.T, np.linalg.norm(ref64[HS_LAYERS], axis=-1)).max() < TOL
        final = [r for r in res["hidden_states"][rid] if r["step"] == -1]
        assert len(final) == 1 and final[0]["values"]["tokens"] == [n_pos]
        assert rel_err(np.asarray(final[0]["values"]["mean"][0]), ref64[HS_LAYERS].mean(axis=1)).max() < TOL
        assert rel_err(np.asarray(final[0]["values"]["last"][0]), ref64[HS_LAYERS, -1]).max() < TOL

        # hnode, the seed's definitions (IBM/vLLM-Hook mia/utils/hnode/score.py) on HF's raw residual at the last
        # prompt token: p = sigmoid(((h - mean) / scale) . w + b); excess = mean_j max(0, h_j - baseline_j) over
        # the H-Nodes, in raw (unstandardized) units
        x = ref64[hnode["layer"], len(prompt_ids) - 1]
        z = (x - np.asarray(hnode["mean"])) / np.asarray(hnode["scale"])
        p_ref = 1 / (1 + np.exp(-(z @ np.asarray(hnode["weights"]) + hnode["bias"])))
        nodes = hnode["extra"]["h_nodes"]
        excess_ref = sum(max(0.0, x[j] - b) for j, b in zip(nodes, hnode["extra"]["h_node_baselines"])) / len(nodes)
        (row,) = res["hnode"][rid]
        assert row["positions"] == [len(prompt_ids) - 1]
        assert abs(row["values"]["p_hallucination"][0] - p_ref) < 1e-4
        assert abs(row["values"]["h_node_excess"][0] - excess_ref) < 1e-3 * max(1.0, excess_ref)
        assert row["alerts"] == [bool(row["values"]["p_hallucination"][0] >= hnode["threshold"])]

        # science_hallucination, the seed's SciHal classifier: the final layer's state normalized by the model's
        # final norm (HF's own hidden_states[-1]) -- or, for a probe of another layer, HF's raw residual -- at the
        # last prompt token, standardized, multinomial logistic: softmax(W z + b), the argmax class
        last = len(prompt_ids) - 1
        feat = (normed_last[last].double().numpy() if science["final_norm"] else ref64[science["layer"], last])
        z = (feat - np.asarray(science["mean"])) / np.asarray(science["scale"])
        logits = [sum(wk * zk for wk, zk in zip(w_c, z)) + b_c for w_c, b_c in zip(science["weights"], science["bias"])]
        m = max(logits)
        probs_ref = np.exp(np.array(logits) - m) / np.exp(np.array(logits) - m).sum()
        (row,) = res["science_hallucination"][rid]
        assert row["positions"] == [last]
        np.testing.assert_allclose(row["values"]["probs"][0], probs_ref, atol=1e-4)
        k = int(np.argmax(probs_ref))
        assert row["labels"]["prediction"] == [science["classes"][k]] and row["values"]["class"] == [k]
        assert row["alerts"] == [science["classes"][k] in ("contradiction", "unverifiable")]


def test_a_stream_lacking_the_layer_is_a_one_line_error(engine, broker_address, tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    p = _analyze(["hnode", "--source", broker_address, "--patterns", "lack-*", "--max-streams", "1",
                  "--idle-timeout", "120"], env)
    try:
        _wait_subscribed(broker_address, ["analyzer:hnode:"], [p])
        engine.generate(["The sky is"], [_params(4, {"capture": {"hidden_states": {"layers": [0]}}, "id": "lack-0"})])
        out, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
    layer = json.loads((PROBES / "hnode-smollm2-135m.json").read_text())["layer"]
    assert p.returncode == 3
    lines = err.strip().splitlines()
    assert lines[0] == (f"mia-stream analyze hnode: request 'lack-0' does not capture hidden_states layer(s) "
                        f"[{layer}] (captures layers [0]); send the spec of --print-spec")
    assert "Traceback" not in err and json.loads(out)["labels"]["error"] == [lines[0].split("hnode: ", 1)[1]]


def test_a_crashing_or_killed_analyzer_leaves_the_engine_and_other_consumers_untouched(
        engine, broker_address, tmp_path):
    from mia_stream.broker import fetch_stats

    site = slow_analyzers(tmp_path)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(site)]))
    prompts = ["Write a short poem about the sea.", "List three colours.", "Count from one to ten."]
    spec = {"hidden_states": {"layers": "all", "positions": "all"}}
    baseline = engine.generate(prompts, [_params(24) for _ in prompts])
    crasher = _analyze(["crasher", "--source", broker_address, "--patterns", "crash-*"], env)
    sleeper = _analyze(["sleeper", "--source", broker_address, "--patterns", "crash-*", "--config",
                        str(_write(tmp_path / "s.json", {"seconds": 1.0}))], env)
    rids = [f"crash-{i}" for i in range(len(prompts))]
    try:
        _wait_subscribed(broker_address, ["analyzer:crasher:", "analyzer:sleeper:"], [crasher, sleeper])
        with collecting(broker_address, ["crash-*"]) as col:
            outs = engine.generate(prompts, [_params(24, {"capture": spec, "id": r}) for r in rids])
            col.wait_ended(rids)
            lag = {n: c for n, c in fetch_stats(broker_address)["consumers"].items() if n.startswith("analyzer:")}
            sleeper.send_signal(signal.SIGKILL)
            sleeper.wait(10)
            crasher.wait(60)
            # the engine goes on serving streamed requests after both analyzers are gone
            after = engine.generate(prompts[:1], [_params(24, {"capture": spec, "id": "crash-after"})])
            col.wait_ended(["crash-after"])
    finally:
        for p in (crasher, sleeper):
            if p.poll() is None:
                p.kill()
    err = crasher.stderr.read()
    assert crasher.returncode not in (0, None) and "RuntimeError: analyzer bug at step" in err
    assert sleeper.returncode == -signal.SIGKILL
    # its lag shows in broker stats while it runs: messages queued or in flight to it, not yet taken
    slow = [c for n, c in lag.items() if n.startswith("analyzer:sleeper:")]
    assert slow and slow[0]["in_flight_bytes"] + slow[0]["queue_bytes"] > 0, lag
    for rid, out, base in zip(rids, outs, baseline):
        assert out.outputs[0].token_ids == base.outputs[0].token_ids  # the engine computed the same
        frames = col.frames(rid)
        assert not [e for e in col.events[rid] if e.kind == "gap"]  # the other consumer lost nothing
        positions = [p for f in frames for p in f.positions]
        assert positions == list(range(len(out.prompt_token_ids) + len(out.outputs[0].token_ids) - 1))
    assert after[0].outputs[0].token_ids == baseline[0].outputs[0].token_ids
    assert not [e for e in col.events["crash-after"] if e.kind == "gap"]


def _write(path: Path, obj) -> Path:
    path.write_text(json.dumps(obj))
    return path
