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

import json

import numpy as np
import pytest

from producer_helpers import collecting

pytestmark = pytest.mark.slow

CAPTURE = {"qk": {"layers": [3, 9, 17], "heads": "all", "positions": "all"}}
TRACKER = {"heads": [[3, 0], [3, 4], [9, 8], [17, 2], [17, 6]], "threshold": 0.5}
RERANKER = {"heads": [[3, 1], [9, 0], [9, 7], [17, 5], [17, 8]]}
LINK = {"layer": 9, "head": 4, "temperature": 0.5, "top_p": 0.8}
TOL = 1e-5


@pytest.fixture(scope="module")
def hf_eager(model_dir):
    from mia_stream.analyzers._qk_runs import load_hf_eager

    return load_hf_eager(model_dir)


def _hf_attn(model, token_ids):
    """Per layer ``[heads, T, T]`` float64 attention probabilities from HF eager attention."""
    import torch

    with torch.no_grad():
        out = model(torch.tensor([list(token_ids)]), output_attentions=True)
    return [a[0].double().numpy() for a in out.attentions]


def _run(analyzer_name, config, events_by_rid):
    """Feed recorded SDK events through an AnalyzerRunner (the code ``mia-stream analyze`` runs); returns the
    rejected requests (id -> the one-line reason) and each request's analysis results."""
    from mia_stream.analyzers import AnalyzerRunner, create
    from mia_stream.analyzers._adapter import EventAdapter

    batches = []
    rejected: dict[str, str] = {}  # the runner forgets a rejection when its request ends
    runner = AnalyzerRunner(create(analyzer_name, config), [batches.append],
                            on_reject=lambda rid, why: rejected.__setitem__(rid, why))
    rejected_all = rejected
    adapter = EventAdapter(runner)
    # interleave the requests' events by step, as the live stream delivers them
    evs = sorted((e for evs in events_by_rid.values() for e in evs),
                 key=lambda e: (e.frame.step if e.kind == "frame" else -1 if e.kind == "start" else 1 << 40))
    for ev in evs:
        adapter.feed(ev)
    adapter.flush()
    results = {}
    for b in batches:
        for r in b.results():
            results.setdefault(r.request_id, []).append(r)
    return rejected, results


def _one_line(msg: str) -> bool:
    return "\n" not in msg and len(msg) < 300


@pytest.fixture(scope="module")
def streams(engine, tokenizer, broker_address):
    """One generate call: injection prompts, a reranking pair, a text-to-SQL prompt, and bad requests."""
    from vllm import SamplingParams

    from mia_stream.analyzers._attention_data import injection_set, rerank_set, sql_set
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
    for role, msgs in (("calibration", rr.calibration_messages), ("query", rr.messages)):
        pp = prompt_parts(tokenizer, msgs)
        prompts[f"at-rr-{role}"] = (pp, {**pp.tags(), "core_reranker": {"group": "g0", "role": role}}, CAPTURE)
        messages[f"at-rr-{role}"] = msgs
    pp = prompt_parts(tokenizer, sq.messages)
    prompts["at-sql"], messages["at-sql"] = (pp, {**pp.tags(), "attnlink": {"columns": sq.columns}}, CAPTURE), \
        sq.messages
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
    with collecting(broker_address, ["at-*"]) as col:
        engine.generate(token_ids, params, use_tqdm=False)
        col.wait_ended(list(prompts), timeout=120)
    return {"prompts": prompts, "messages": messages, "events": dict(col.events), "inj": inj, "rr": rr, "sq": sq}


def _flat(messages):
    return [{"role": m["role"], "content": m["content"] if isinstance(m["content"], str) else
             "".join(p if isinstance(p, str) else p[1] for p in m["content"])} for m in messages]


def test_spans_reproduce_the_hf_tokenization(tokenizer, streams):
    """The token ids the spans index are exactly HF's chat-template tokenization, which the engine received."""
    for rid, (pp, _, _) in streams["prompts"].items():
        ref = tokenizer.apply_chat_template(_flat(streams["messages"][rid]), tokenize=True, add_generation_prompt=True)
        ref = list(ref["input_ids"] if hasattr(ref, "keys") else ref)
        assert pp.token_ids == ref, rid
        assert list(streams["events"][rid][0].stream.start.prompt_token_ids) == ref, rid
    # each named piece's tokens decode to its text (an edge token may carry a neighbouring space)
    pp = streams["prompts"]["at-sql"][0]
    cols = [tokenizer.decode(pp.token_ids[a:b]).strip() for a, b in pp.ranges("column")]
    assert [c.split()[0] for c in cols] == [c.split(".")[1] for c in streams["sq"].columns]
    pp = streams["prompts"]["at-inj-1"][0]
    (a, b), = pp.ranges("data")
    assert tokenizer.decode(pp.token_ids[a:b]).strip() == streams["inj"][1].data
    assert any(len(p[0].token_ids) > 256 for p in streams["prompts"].values()), "no prompt spans two prefill chunks"


def test_attention_tracker_equals_hf_reference(streams, hf_eager):
    rejected, results = _run("attention_tracker", TRACKER, {r: streams["events"][r] for r in ("at-inj-0", "at-inj-1")})
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
        assert res.alerts == [focus < TRACKER["threshold"]]
        assert res.labels["verdict"] == ["injection" if focus < TRACKER["threshold"] else "normal"]


def test_core_reranker_equals_hf_reference(streams, hf_eager):
    rids = ("at-rr-calibration", "at-rr-query")
    rejected, results = _run("core_reranker", RERANKER, {r: streams["events"][r] for r in rids})
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


def test_attnlink_equals_hf_reference(streams, hf_eager):
    rejected, results = _run("attnlink", LINK, {"at-sql": streams["events"]["at-sql"]})
    assert not rejected
    (res,) = results["at-sql"]
    pp, tags, _ = streams["prompts"]["at-sql"]
    n = len(pp.token_ids)
    row = _hf_attn(hf_eager, pp.token_ids)[LINK["layer"]][LINK["head"], n - 1]
    scores = np.array([sum(row[j] for j in range(a, b)) for a, b in tags["spans"]["column"]])
    w = scores ** (1 / LINK["temperature"])  # softmax(log S / T)
    probs = w / w.sum()
    order = sorted(range(len(probs)), key=lambda i: -probs[i])
    chosen, cum = [], 0.0
    for i in order:
        chosen.append(i)
        cum += probs[i]
        if cum >= LINK["top_p"]:
            break
    c = int(res.value("num_columns")[0])
    assert c == len(streams["sq"].columns)
    np.testing.assert_allclose(res.value("scores")[0][:c], scores, atol=TOL, rtol=0)
    np.testing.assert_allclose(res.value("probs")[0][:c], probs, atol=TOL, rtol=0)
    assert sorted(np.flatnonzero(res.value("selected")[0][:c]).tolist()) == sorted(chosen)
    assert res.labels["columns"] == [",".join(streams["sq"].columns[i] for i in chosen)]


def test_bad_requests_are_rejected_with_one_line(streams):
    ev = {r: streams["events"][r] for r in streams["events"] if r.startswith("at-bad-")}
    rejected, results = _run("attention_tracker", TRACKER, ev)
    why = rejected
    assert set(why) == set(ev)
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
    rejected, _ = _run("attention_tracker", {"heads": [[3, 0], [31, 2]]}, {"at-inj-0": streams["events"]["at-inj-0"]})
    msg = rejected["at-inj-0"]
    assert "layer 31 is out of range: the model has layers 0..29" in msg and _one_line(msg)
    rejected, _ = _run("attnlink", {"layer": 3, "head": 9}, {"at-sql": streams["events"]["at-sql"]})
    msg = rejected["at-sql"]
    assert "head 9 is out of range: the model has query heads 0..8" in msg and _one_line(msg)


def test_reranker_pairs_and_uncalibrated_mode(streams):
    """Without its calibration twin no ranking is made; with calibrate: false every query is ranked alone."""
    rejected, results = _run("core_reranker", RERANKER, {"at-rr-query": streams["events"]["at-rr-query"]})
    assert not rejected and not results  # still waiting for the twin: no row, no error
    rejected, results = _run("core_reranker", {**RERANKER, "calibrate": False},
                           {r: streams["events"][r] for r in ("at-rr-calibration", "at-rr-query")})
    assert set(results) == {"at-rr-query"}  # the calibration twin gives no row
    rejected, _ = _run("core_reranker", RERANKER, {"at-inj-0": streams["events"]["at-inj-0"]})
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
