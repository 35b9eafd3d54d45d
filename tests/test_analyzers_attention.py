"""The attention analyzers (attention_tracker, core_reranker, attnlink) on real streams from the embedded model.

Each analyzer runs on Q/K captured by the session's vLLM engine (CPU, torch.compile, chunked prefill of 256
tokens, so the longer prompts arrive over several steps) and its output is compared with an independent
reference: Hugging Face ``transformers`` attention probabilities (eager attention, ``output_attentions=True``)
on the same token ids, reduced by the methods' formulas written out here again, loop by loop.

Tolerance: the attention rebuilt from the captured float32 Q/K differed from HF's eager probabilities by at most
5.2e-6 on these prompts (scratch run, all 30 layers); 1e-5 absolute on sums of at most a few hundred of them
leaves room for the summation order and still catches a wrong span, head or row (off by 1e-2 or more).
"""

from __future__ import annotations

import dataclasses
import json
import math
import time

import numpy as np
import pytest


pytestmark = pytest.mark.slow

CAPTURE = {"qk": {"layers": [3, 9, 17], "heads": "all", "positions": "all"}}
TRACKER = {"heads": [[3, 0], [3, 4], [9, 8], [17, 2], [17, 6]], "threshold": 0.5}
RERANKER = {"heads": [[3, 1], [9, 0], [9, 7], [17, 5], [17, 8]]}
LINK = {"layer": 9, "head": 4, "temperature": 0.5, "top_p": 0.8}
TOL = 1e-5


@pytest.fixture(scope="module")
def hf_eager(model_dir):
    from mia_stream.lab.qk_runs import load_hf_eager

    return load_hf_eager(model_dir)


def _hf_attn(model, token_ids):
    """Per layer ``[heads, T, T]`` float64 attention probabilities from HF eager attention."""
    import torch

    with torch.no_grad():
        out = model(torch.tensor([list(token_ids)]), output_attentions=True)
    return [a[0].double().numpy() for a in out.attentions]


def _run(analyzer_name, config, events, only=None):
    """Feed recorded SDK batch events (``open_batches``) through an AnalyzerRunner (the code ``mia-stream
    analyze`` runs), keeping the requests in ``only`` (all when None); returns the rejected requests (id -> the
    one-line reason) and each request's analysis results."""
    from mia_stream.analyzers import AnalyzerRunner, create
    from mia_stream.analyzers._runner import select

    batches = []
    rejected: dict[str, str] = {}  # the runner forgets a rejection when its request ends
    runner = AnalyzerRunner(create(analyzer_name, config), [batches.append],
                            on_reject=lambda rid, why: rejected.__setitem__(rid, why))
    for ev in events:
        if only is not None:
            if ev.kind == "batch":
                keep = np.array([rid in only for rid in ev.batch.request_ids])
                if not keep.any():
                    continue
                if not keep.all() and ev.batch.KIND == "step_batch":
                    ev = dataclasses.replace(ev, batch=select(ev.batch, keep))
            elif ev.stream.request_id not in only:
                continue
        runner.feed(ev)
    results = {}
    for b in batches:
        for r in b.results():
            results.setdefault(r.request_id, []).append(r)
    return rejected, results


class _BatchCollector:
    """Subscribes (batch mode, as the analyzer runner reads) before the engine runs; keeps every event."""

    def __init__(self, address, patterns):
        from mia_stream.consumers import open_batches

        self.events = []
        self._stream = open_batches(address, patterns=patterns, timeout=None)

    def wait_ended(self, request_ids, timeout):
        import time

        deadline = time.monotonic() + timeout
        ended = set()
        while ended != set(request_ids) and time.monotonic() < deadline:
            for ev in self._stream._source.events(timeout=0.5):
                self.events.append(ev)
                if ev.kind == "end":
                    ended.add(ev.stream.request_id)
                    if ended == set(request_ids):
                        break
        assert ended == set(request_ids), f"not ended in {timeout} s: {sorted(set(request_ids) - ended)}"

    def close(self):
        self._stream.close()


def _one_line(msg: str) -> bool:
    return "\n" not in msg and len(msg) < 300


@pytest.fixture(scope="module")
def streams(engine, tokenizer, broker_address):
    """One generate call: injection prompts, a reranking pair, a text-to-SQL prompt, and bad requests."""
    from vllm import SamplingParams

    from mia_stream.lab.attention_data import injection_set, rerank_set, sql_set
    from mia_stream.spans import prompt_parts

    inj = injection_set("test", 3, seed=5)
    inj = [inj[0], inj[3]]  # one normal, one attacked
    rr = rerank_set(1, seed=7, num_docs=12)[0]  # over 256 tokens: its prefill takes two steps
    sq = sql_set(1, seed=3)[0]
    prompts: dict[str, tuple] = {}  # rid -> (PromptParts, tags, capture)
    messages: dict[str, list] = {}
    for i, e in enumerate(inj):
        pp = prompt_parts(tokenizer, e.messages)
        prompts[f"at-inj-{i}"], messages[f"at-inj-{i}"] = (pp, pp.tags(), CAPTURE), e.messages
    from mia_stream.analyzers.attention_tracker import probe_messages

    pm = probe_messages(inj[1].data)  # attention_tracker's mode "probe": the data under "Say xxxxxx"
    pp = prompt_parts(tokenizer, pm)
    prompts["at-probe-1"], messages["at-probe-1"] = (pp, pp.tags(), CAPTURE), pm
    for role, msgs in (("calibration", rr.calibration_messages), ("query", rr.messages)):
        pp = prompt_parts(tokenizer, msgs)
        prompts[f"at-rr-{role}"] = (pp, {**pp.tags(), "core_reranker": {"group": "g0", "role": role}}, CAPTURE)
        messages[f"at-rr-{role}"] = msgs
    pp = prompt_parts(tokenizer, sq.messages)
    prompts["at-sql"], messages["at-sql"] = (pp, {**pp.tags(), "attnlink": {"columns": sq.columns}}, CAPTURE), \
        sq.messages
    sqp = sql_set(1, seed=3, form="project")[0]  # the project's variant's prompt: the question after the schema
    pp = prompt_parts(tokenizer, sqp.messages)
    prompts["at-sql-project"] = (pp, {**pp.tags(), "attnlink": {"columns": sqp.columns}}, CAPTURE)
    messages["at-sql-project"] = sqp.messages
    # bad requests: each lacks one thing the analyzers need
    bad_pp = prompt_parts(tokenizer, inj[1].messages)
    for rid in ("at-bad-nospans", "at-bad-range", "at-bad-noqk", "at-bad-lastonly"):
        messages[rid] = inj[1].messages
    n = len(bad_pp.token_ids)
    prompts["at-bad-nospans"] = (bad_pp, {"user": "x"}, CAPTURE)
    prompts["at-bad-range"] = (bad_pp, {"spans": {"instruction": [[3, 7]], "data": [[10, n + 5]]}}, CAPTURE)
    prompts["at-bad-noqk"] = (bad_pp, bad_pp.tags(), {"hidden_states": {"layers": [3], "positions": "all"}})
    prompts["at-bad-lastonly"] = (bad_pp, bad_pp.tags(),
                                  {"qk": {"layers": [3, 9, 17], "heads": "all", "positions": "last_prompt"}})
    params, token_ids = [], []
    for rid, (pp, tags, cap) in prompts.items():
        params.append(SamplingParams(max_tokens=2, temperature=0.0,
                                     extra_args={"mia_stream": {"id": rid, "capture": cap, "tags": tags}}))
        token_ids.append({"prompt_token_ids": pp.token_ids})
    col = _BatchCollector(broker_address, ["at-*"])
    time.sleep(0.2)  # let the subscription reach the broker before the engine publishes
    try:
        engine.generate(token_ids, params, use_tqdm=False)
        col.wait_ended(list(prompts), timeout=120)
    finally:
        col.close()
    starts = {ev.stream.request_id: ev.stream.start for ev in col.events if ev.kind == "start"}
    return {"prompts": prompts, "messages": messages, "events": col.events, "starts": starts, "inj": inj,
            "rr": rr, "sq": sq}


def _flat(messages):
    return [{"role": m["role"], "content": m["content"] if isinstance(m["content"], str) else
             "".join(p if isinstance(p, str) else p[1] for p in m["content"])} for m in messages]


def test_spans_reproduce_the_hf_tokenization(tokenizer, streams):
    """The token ids the spans index are exactly HF's chat-template tokenization, which the engine received."""
    for rid, (pp, _, _) in streams["prompts"].items():
        ref = tokenizer.apply_chat_template(_flat(streams["messages"][rid]), tokenize=True, add_generation_prompt=True)
        ref = list(ref["input_ids"] if hasattr(ref, "keys") else ref)
        assert pp.token_ids == ref, rid
        assert list(streams["starts"][rid].prompt_token_ids) == ref, rid
    # each named piece's tokens decode to its text (an edge token may carry a neighbouring space)
    pp = streams["prompts"]["at-sql"][0]
    cols = [tokenizer.decode(pp.token_ids[a:b]).strip() for a, b in pp.ranges("column")]
    assert cols == [f"{c.split('.')[1]}@{c.split('.')[0]}" for c in streams["sq"].columns]  # the seed's identifiers
    pp = streams["prompts"]["at-inj-1"][0]
    (a, b), = pp.ranges("data")
    assert tokenizer.decode(pp.token_ids[a:b]).strip() == streams["inj"][1].data
    assert any(len(p[0].token_ids) > 256 for p in streams["prompts"].values()), "no prompt spans two prefill chunks"


def test_attention_tracker_equals_hf_reference(streams, hf_eager):
    rejected, results = _run("attention_tracker", TRACKER, streams["events"], {"at-inj-0", "at-inj-1"})
    assert not rejected
    for rid in ("at-inj-0", "at-inj-1"):
        pp, tags, _ = streams["prompts"][rid]
        (res,) = results[rid]
        n = len(pp.token_ids)
        att = _hf_attn(hf_eager, pp.token_ids)
        (i0, i1), = tags["spans"]["instruction"]
        (d0, d1), = tags["spans"]["data"]
        ref = []
        for layer, head in TRACKER["heads"]:
            row = att[layer][head, n - 1]
            s_i = sum(row[j] for j in range(i0, i1))
            s_d = sum(row[j] for j in range(d0, d1))
            ref.append(s_i / (s_i + s_d + 1e-8))
        focus = sum(ref) / len(ref)
        assert res.positions == [n - 1]
        np.testing.assert_allclose(res.value("head_ratios")[0], ref, atol=TOL, rtol=0)
        assert abs(float(res.value("focus")[0]) - focus) < TOL
        assert res.alerts == [focus <= TRACKER["threshold"]]  # the reference code flags focus <= threshold
        assert res.labels["verdict"] == ["injection" if focus <= TRACKER["threshold"] else "normal"]


def test_attention_tracker_probe_mode(streams, hf_eager, tokenizer):
    """Mode "probe" (the paper's detector): the untrusted text under the fixed instruction "Say xxxxxx"; with the
    probe instruction's token ids configured, a request carrying any other instruction is rejected (one line)."""
    from mia_stream.analyzers.attention_tracker import PROBE_INSTRUCTION, probe_messages
    from mia_stream.spans import prompt_parts

    ids = tokenizer(PROBE_INSTRUCTION, add_special_tokens=False)["input_ids"]
    cfg = {**TRACKER, "mode": "probe", "probe_token_ids": ids}
    rejected, results = _run("attention_tracker", cfg, streams["events"], {"at-probe-1", "at-inj-1"})
    assert set(rejected) == {"at-inj-1"} and "mode 'probe'" in rejected["at-inj-1"]
    assert _one_line(rejected["at-inj-1"])
    pp, tags, _ = streams["prompts"]["at-probe-1"]
    assert pp.token_ids == prompt_parts(tokenizer, probe_messages(streams["inj"][1].data)).token_ids
    n = len(pp.token_ids)
    att = _hf_attn(hf_eager, pp.token_ids)
    (i0, i1), = tags["spans"]["instruction"]
    (d0, d1), = tags["spans"]["data"]
    assert tokenizer.decode(pp.token_ids[i0:i1]).strip() == PROBE_INSTRUCTION
    ref = []
    for layer, head in TRACKER["heads"]:
        row = att[layer][head, n - 1]
        s_i, s_d = sum(row[i0:i1]), sum(row[d0:d1])
        ref.append(s_i / (s_i + s_d + 1e-8))
    (res,) = results["at-probe-1"]
    assert abs(float(res.value("focus")[0]) - sum(ref) / len(ref)) < TOL


def test_attention_tracker_threshold_is_set_on_normal_prompts():
    """The reference code's rule (Attention-Tracker detector, normal examples only): threshold = mean - 4 std of
    the normal prompts' focus over the kept heads; the attacked prompts do not move it."""
    from mia_stream.analyzers.attention_tracker import discover_heads

    rng = np.random.default_rng(0)
    normal = rng.uniform(0.55, 0.65, (30, 4, 3))
    attack = rng.uniform(0.05, 0.15, (20, 4, 3))
    normal[:, 0, 0] = rng.uniform(0.2, 0.9, 30)  # a noisy head that fails the k = 4 criterion
    res = discover_heads(normal, attack, k=4.0)
    kept = [(l, h) for l in range(4) for h in range(3) if (l, h) != (0, 0)]
    assert sorted(map(tuple, res["heads"])) == kept
    focus = [float(np.mean([normal[i, l, h] for l, h in kept])) for i in range(30)]
    mu = sum(focus) / 30
    sd = (sum((f - mu) ** 2 for f in focus) / 30) ** 0.5
    assert abs(res["threshold"] - (mu - 4 * sd)) < 1e-12
    res2 = discover_heads(normal, attack * 0.5, k=4.0)
    assert res2["threshold"] == res["threshold"]


def test_core_reranker_equals_hf_reference(streams, hf_eager):
    rejected, results = _run("core_reranker", RERANKER, streams["events"], {"at-rr-calibration", "at-rr-query"})
    assert not rejected
    rows = [r for rs in results.values() for r in rs]
    assert len(rows) == 1 and rows[0].labels["query_request"] == ["at-rr-query"]
    res = rows[0]

    def token_scores(rid):
        pp, tags, _ = streams["prompts"][rid]
        n = len(pp.token_ids)
        att = _hf_attn(hf_eager, pp.token_ids)
        q0 = tags["spans"]["query"][0][0]
        tok = np.zeros(n)
        for layer, head in RERANKER["heads"]:
            tok += att[layer][head, q0:n].mean(axis=0)  # mean over the query rows, summed over heads
        return tok, tags["spans"]["doc"]

    tq, docs = token_scores("at-rr-query")
    tc, docs_c = token_scores("at-rr-calibration")
    assert docs == docs_c  # the same document tokens at the same positions
    ref = []
    for a, b in docs:
        cal = np.array([tq[j] - tc[j] for j in range(a, b)])
        thr = cal.mean() - 2 * cal.std(ddof=1)  # the reference code's torch.std is the sample std
        ref.append(sum(c for c in cal if c > thr))
    n_docs = int(res.value("num_docs")[0])
    assert n_docs == len(streams["rr"].documents)
    np.testing.assert_allclose(res.value("scores")[0][:n_docs], ref, atol=TOL, rtol=0)
    assert list(res.value("ranking")[0][:n_docs]) == sorted(range(n_docs), key=lambda i: -ref[i])


@pytest.mark.parametrize("anchor,pooling", [("last_prompt", None), ("question", "sum")])
def test_attnlink_equals_hf_reference(streams, hf_eager, anchor, pooling):
    """The seed's AttnLink-U (docs/use_cases/attnlink.md of IBM/vLLM-Hook), written out from its definition:
    score = the MEAN attention over the candidate's tokens, p = softmax(log(score + 1e-8) / T), the shortest
    descending prefix reaching top_p. ``pooling=None`` runs the analyzer's defaults (they must be the seed's:
    mean, top_p 0.8); "sum" is the project's named variant."""
    cfg = {"layer": LINK["layer"], "head": LINK["head"], "temperature": LINK["temperature"], "anchor": anchor}
    if pooling is not None:
        cfg["pooling"] = pooling
    top_p = 0.8  # the seed's default: not passed, so the analyzer's default is what is checked
    rid = "at-sql" if anchor == "last_prompt" else "at-sql-project"
    rejected, results = _run("attnlink", cfg, streams["events"], {rid})
    assert not rejected
    (res,) = results[rid]
    pp, tags, _ = streams["prompts"][rid]
    n = len(pp.token_ids)
    att = _hf_attn(hf_eager, pp.token_ids)[LINK["layer"]][LINK["head"]]
    rows = [n - 1] if anchor == "last_prompt" else range(*tags["spans"]["question"][0])
    row = sum(att[r] for r in rows) / len(rows)
    spans = tags["spans"]["column"]
    if pooling == "sum":
        scores = np.array([sum(row[j] for j in range(a, b)) for a, b in spans])
    else:
        scores = np.array([sum(row[j] for j in range(a, b)) / (b - a) for a, b in spans])
    logits = [math.log(s + 1e-8) / LINK["temperature"] for s in scores]
    z = sum(math.exp(v - max(logits)) for v in logits)
    probs = np.array([math.exp(v - max(logits)) / z for v in logits])
    order = sorted(range(len(scores)), key=lambda i: (-scores[i], i))
    chosen, cum = [], 0.0
    for i in order:
        chosen.append(i)
        cum += probs[i]
        if cum >= top_p:
            break
    c = int(res.value("num_columns")[0])
    assert c == len(spans)
    assert any(b - a > 1 for a, b in spans)  # multi-token spans: mean and sum differ
    assert res.positions == [n - 1]
    np.testing.assert_allclose(res.value("scores")[0][:c], scores, atol=TOL, rtol=0)
    np.testing.assert_allclose(res.value("probs")[0][:c], probs, atol=TOL, rtol=0)
    assert sorted(np.flatnonzero(res.value("selected")[0][:c]).tolist()) == sorted(chosen)
    names = tags["attnlink"]["columns"]
    assert res.labels["columns"] == [",".join(names[i] for i in chosen)]


def test_attnlink_question_anchor_before_the_columns_is_rejected(streams):
    """In the seed's prompt the question precedes the candidates: a question-row anchor cannot see them."""
    rejected, _ = _run("attnlink", {**LINK, "anchor": "question"}, streams["events"], {"at-sql"})
    assert "cannot attend to later columns" in rejected["at-sql"] and _one_line(rejected["at-sql"])


def test_attnlink_seed_prompt_makes_the_next_token_an_identifier(tokenizer):
    """The seed's prompt form: the candidates are the last block, written `column@table`, one span each."""
    from mia_stream.lab.attention_data import sql_set
    from mia_stream.spans import prompt_parts

    e = sql_set(1, seed=3, pool="test")[0]
    pp = prompt_parts(tokenizer, e.messages)
    spans = pp.ranges("column")
    texts = [tokenizer.decode(pp.token_ids[a:b]).strip() for a, b in spans]
    assert texts == [f"{c.split('.')[1]}@{c.split('.')[0]}" for c in e.columns]
    tail = tokenizer.decode(pp.token_ids[spans[-1][1]:])
    assert "Candidate Columns" not in tail and "@" not in tail and tail.rstrip().endswith("assistant")


def test_bad_requests_are_rejected_with_one_line(streams):
    bad = {r for r in streams["starts"] if r.startswith("at-bad-")}
    assert len(bad) == 4
    rejected, results = _run("attention_tracker", TRACKER, streams["events"], bad)
    why = rejected
    assert set(why) == bad
    assert "has no tags['spans']" in why["at-bad-nospans"]
    assert "span 'data'" in why["at-bad-range"] and "out of range" in why["at-bad-range"]
    assert "does not capture qk" in why["at-bad-noqk"]
    assert "positions 'last_prompt'" in why["at-bad-lastonly"] and "'prompt'" in why["at-bad-lastonly"]
    for rid, msg in why.items():
        assert _one_line(msg), msg
        (row,) = results[rid]
        assert row.labels["error"] == [msg]


def test_bad_configs_are_one_line_errors(streams):
    from mia_stream.analyzers import create
    from mia_stream.errors import AnalyzerConfigError

    for name, cfg, want in [
        ("attention_tracker", {"heads": [[3]]}, "is not a [layer, head] pair"),
        ("attention_tracker", {"heads": "some"}, "must be 'all' or a non-empty list"),
        ("attention_tracker", {"threshold": "high"}, "'threshold' must be a number"),
        ("attention_tracker", {"instruction_span": ""}, "'instruction_span' must be a span name"),
        ("attention_tracker", {"heads": "all", "bogus": 1}, "unknown key(s) ['bogus']"),
        ("core_reranker", {"calibrate": "yes"}, "'calibrate' must be true or false"),
        ("core_reranker", {"mask_sigma": -1}, "'mask_sigma' must be"),
        ("attnlink", {}, "lacks 'layer'"),
        ("attnlink", {"layer": 3, "head": 1, "top_p": 1.5}, "'top_p' must be"),
        ("attnlink", {"layer": 3, "head": 1, "temperature": 0}, "'temperature' must be a positive number"),
    ]:
        with pytest.raises(AnalyzerConfigError) as e:
            create(name, cfg)
        assert want in str(e.value) and _one_line(str(e.value)), (name, cfg, str(e.value))
    # heads the model does not have: known only once a stream says which model it is
    rejected, _ = _run("attention_tracker", {"heads": [[3, 0], [31, 2]]}, streams["events"], {"at-inj-0"})
    msg = rejected["at-inj-0"]
    assert "layer 31 is out of range: the model has layers 0..29" in msg and _one_line(msg)
    rejected, _ = _run("attnlink", {"layer": 3, "head": 9}, streams["events"], {"at-sql"})
    msg = rejected["at-sql"]
    assert "head 9 is out of range: the model has query heads 0..8" in msg and _one_line(msg)


def test_reranker_pairs_and_uncalibrated_mode(streams):
    """Without its calibration twin no ranking is made; with calibrate: false every query is ranked alone."""
    rejected, results = _run("core_reranker", RERANKER, streams["events"], {"at-rr-query"})
    assert not rejected and not results  # still waiting for the twin: no row, no error
    rejected, results = _run("core_reranker", {**RERANKER, "calibrate": False}, streams["events"],
                             {"at-rr-calibration", "at-rr-query"})
    assert set(results) == {"at-rr-query"}  # the calibration twin gives no row
    rejected, _ = _run("core_reranker", RERANKER, streams["events"], {"at-inj-0"})
    assert "its spans lack 'doc'" in rejected["at-inj-0"]


def test_print_spec_is_what_the_analyzers_need(tmp_path):
    from mia_stream.analyzers import analyze_main

    cfg = tmp_path / "t.json"
    cfg.write_text(json.dumps(TRACKER))
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert analyze_main(["attention_tracker", "--config", str(cfg), "--print-spec"]) == 0
    assert json.loads(buf.getvalue()) == {"capture": {"qk": {"layers": [3, 9, 17], "heads": [0, 2, 4, 6, 8],
                                                             "positions": "prompt"}}}
    # attnlink has no default head: its error names the config shipped for the embedded model, which works
    from mia_stream.analyzers import create
    from mia_stream.errors import AnalyzerConfigError

    with pytest.raises(AnalyzerConfigError) as e:
        create("attnlink", {})
    shipped = str(e.value).rsplit("--config ", 1)[1].rstrip(")")
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert analyze_main(["attnlink", "--config", shipped, "--print-spec"]) == 0
    assert json.loads(buf.getvalue())["capture"]["qk"]["positions"] == "prompt"


def test_qk_buffer_joins_tensor_parallel_shards():
    """With TP > 1 each rank streams its shard of the heads (KV heads possibly on several ranks); the buffer
    joins them by head id, whatever order the ranks' rows arrive in."""
    from mia_stream.analyzers._attention import QKBuffer

    rng = np.random.default_rng(0)
    q = rng.standard_normal((2, 7, 6, 4)).astype(np.float32)  # 2 layers, 7 positions, 6 query heads
    k = rng.standard_normal((2, 7, 3, 4)).astype(np.float32)  # 3 KV heads
    whole, shards = QKBuffer(), QKBuffer()
    whole.add(range(7), q, k, [4, 9], range(6), range(3))
    assert whole.heads_at(6) == set(range(6))
    # rank 1 (query heads 3-5, KV heads 1-2) first and in two prefill chunks, rank 0 (0-2, KV 0-1) after
    shards.add([0, 1, 2, 3], q[:, :4, 3:], k[:, :4, 1:], [4, 9], [3, 4, 5], [1, 2])
    shards.add([4, 5, 6], q[:, 4:, 3:], k[:, 4:, 1:], [4, 9], [3, 4, 5], [1, 2])
    assert shards.heads_at(6) == {3, 4, 5}  # rank 0 not in yet: not ready
    shards.add(range(7), q[:, :, :3], k[:, :, :2], [4, 9], [0, 1, 2], [0, 1])
    assert shards.heads_at(6) == set(range(6)) and shards.q_heads == tuple(range(6)) and shards.k_heads == (0, 1, 2)
    np.testing.assert_array_equal(shards.queries([6, 2]), q[:, [6, 2]])
    np.testing.assert_array_equal(shards.keys(7), k)


def test_live_analyzer_processes_equal_replay_of_the_recording(engine, tokenizer, broker_address, tmp_path):
    """The engine -> the session broker -> {`mia-stream analyze` processes for attention_tracker, core_reranker
    and attnlink, `mia-stream record`}; then the recording through `mia-stream analyze` again: the same JSON
    lines, byte for byte (the analyzers are deterministic, and live and replay take the same code path)."""
    import os
    import signal
    import subprocess
    import sys
    from pathlib import Path

    from vllm import SamplingParams

    from mia_stream.lab.attention_data import injection_set, rerank_set, sql_set
    from mia_stream.broker import fetch_stats
    from mia_stream.spans import prompt_parts

    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=str(root))
    inj = injection_set("test", 1, seed=11)  # one normal, one attacked
    rr = rerank_set(1, seed=13, num_docs=8)[0]
    sq = sql_set(1, seed=17)[0]
    reqs = {}  # rid -> (token ids, tags)
    for i, e in enumerate(inj):
        pp = prompt_parts(tokenizer, e.messages)
        reqs[f"lr-inj-{i}"] = (pp.token_ids, pp.tags())
    for role, msgs in (("calibration", rr.calibration_messages), ("query", rr.messages)):
        pp = prompt_parts(tokenizer, msgs)
        reqs[f"lr-rr-{role}"] = (pp.token_ids, {**pp.tags(), "core_reranker": {"group": "g", "role": role}})
    pp = prompt_parts(tokenizer, sq.messages)
    reqs["lr-sql"] = (pp.token_ids, {**pp.tags(), "attnlink": {"columns": sq.columns}})
    # name -> (config, pattern, streams, result rows): the reranker gives one row per query/calibration pair
    assert len(inj) == 2
    configs = {"attention_tracker": (TRACKER, "lr-inj-*", 2, 2), "core_reranker": (RERANKER, "lr-rr-*", 2, 1),
               "attnlink": (LINK, "lr-sql", 1, 1)}
    procs, rec = {}, tmp_path / "rec"
    for name, (cfg, pattern, n, _) in configs.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(cfg))
        procs[name] = subprocess.Popen(
            [sys.executable, "-m", "mia_stream.cli", "analyze", name, "--config", str(tmp_path / f"{name}.json"),
             "--source", broker_address, "--patterns", pattern, "--max-streams", str(n), "--idle-timeout", "120"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=root)
    recorder = subprocess.Popen([sys.executable, "-m", "mia_stream.cli", "record", str(rec), "--broker",
                                 broker_address, "--patterns", "lr-*", "--flush-interval", "0.1"],
                                stderr=subprocess.PIPE, env=env, cwd=root)
    try:
        deadline = time.monotonic() + 90
        want = [f"analyzer:{n}:" for n in configs] + ["recorder"]
        while not all(any(c.startswith(w) for c in fetch_stats(broker_address)["consumers"]) for w in want):
            for p in [*procs.values(), recorder]:
                assert p.poll() is None, p.stderr.read()
            assert time.monotonic() < deadline, f"not all of {want} subscribed"
            time.sleep(0.1)
        params = [SamplingParams(max_tokens=2, temperature=0.0, extra_args={"mia_stream": {
            "id": rid, "capture": CAPTURE, "tags": tags}}) for rid, (_, tags) in reqs.items()]
        engine.generate([{"prompt_token_ids": ids} for ids, _ in reqs.values()], params, use_tqdm=False)
        live = {name: p.communicate(timeout=180) for name, p in procs.items()}
        time.sleep(1.0)  # the recorder's last flush
    finally:
        recorder.send_signal(signal.SIGINT)
        try:
            recorder.wait(20)
        except subprocess.TimeoutExpired:
            recorder.kill()
        for p in procs.values():
            if p.poll() is None:
                p.kill()
    for name, (cfg, pattern, n, rows) in configs.items():
        out, err = live[name]
        assert procs[name].returncode == 0, err
        lines = [json.loads(x) for x in out.splitlines()]
        assert len(lines) == rows and all("error" not in x["labels"] for x in lines), out
        replay = subprocess.run([sys.executable, "-m", "mia_stream.cli", "analyze", name, "--config",
                                 str(tmp_path / f"{name}.json"), "--source", str(rec), "--patterns", pattern],
                                capture_output=True, text=True, timeout=120, env=env, cwd=root)
        assert replay.returncode == 0 and replay.stdout == out, (name, replay.stderr, replay.stdout, out)
