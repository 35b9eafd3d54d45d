"""The evaluation's statistics (issue 27): AUROC against scikit-learn's, bootstrap CIs that resample entities
(not rows), thresholds calibrated for a false-alert rate on correct answers, and the free baselines computed from
the labels file's logprobs by their definitions."""

from __future__ import annotations

import numpy as np
import pytest
from sklearn.metrics import roc_auc_score

from mia_stream.lab import probe_metrics as pm


def test_auroc_equals_scikit_learn_with_ties():
    rng = np.random.default_rng(0)
    for _ in range(20):
        y = rng.integers(0, 2, 300)
        s = np.round(rng.standard_normal(300) + 0.7 * y, 1)  # rounded: many ties
        assert pm.auroc(y, s) == pytest.approx(roc_auc_score(y, s), abs=1e-12)
    assert pm.auroc([1, 1], [0.1, 0.2]) is None


def test_bootstrap_resamples_entities_so_duplicated_rows_do_not_narrow_the_interval():
    """Ten copies of each entity's row carry no more information than one: resampling entities gives the same
    width for both, resampling rows would give a narrower interval for the copies."""
    rng = np.random.default_rng(1)
    y = rng.integers(0, 2, 80)
    s = rng.standard_normal(80) + y
    groups = np.arange(80)
    one = pm.bootstrap(y, {"s": s}, groups, n=400)["s"]
    ten = pm.bootstrap(np.repeat(y, 10), {"s": np.repeat(s, 10)}, np.repeat(groups, 10), n=400)["s"]
    assert one["auroc"] == pytest.approx(ten["auroc"])
    w1, w10 = one["ci"][1] - one["ci"][0], ten["ci"][1] - ten["ci"][0]
    assert w10 == pytest.approx(w1, rel=0.25) and w1 > 0.1
    assert one["ci"][0] <= one["auroc"] <= one["ci"][1]


def test_paired_difference_against_a_reference_is_zero_for_the_reference_itself_and_signed():
    rng = np.random.default_rng(2)
    y = rng.integers(0, 2, 200)
    good, bad = rng.standard_normal(200) + 2 * y, rng.standard_normal(200)
    b = pm.bootstrap(y, {"good": good, "bad": bad}, np.arange(200) // 2, reference="bad", n=300)
    assert b["good"]["diff"] == pytest.approx(b["good"]["auroc"] - b["bad"]["auroc"], abs=1e-3)
    assert b["good"]["diff_ci"][0] > 0  # a clearly better score: the CI excludes 0
    assert "diff" not in b["bad"]


@pytest.mark.parametrize("rate", [0.0, 0.05, 0.1, 0.3])
def test_a_calibrated_threshold_alerts_on_at_most_the_rate_of_correct_answers_and_is_the_lowest_such(rate):
    rng = np.random.default_rng(3)
    correct = np.round(rng.standard_normal(157), 2)
    t = pm.calibrate(correct, rate)
    assert (correct >= t).mean() <= rate
    lower = correct[correct < t].max()  # any lower threshold reaching the next score alerts on more than the rate
    assert (correct >= lower).mean() > rate


def test_alert_rates_are_the_fractions_of_correct_and_wrong_answers_at_or_above_the_threshold():
    y = np.array([0, 0, 0, 0, 1, 1, 1])
    s = np.array([0.1, 0.2, 0.6, 0.3, 0.9, 0.4, 0.7])
    r = pm.alert_rates(y, s, 0.5, np.arange(7), n=50)
    assert r["false_alert_rate"] == pytest.approx(1 / 4, abs=1e-4) and r["recall"] == pytest.approx(2 / 3, abs=1e-4)


def test_baselines_follow_their_definitions():
    recs = [{"token_ids": [1, 2, 3], "logprobs": [-0.1, -2.0, -0.5], "entropies": [0.3, 1.5, 0.2], "set": "a",
             "difficulty": "x", "label": 1, "semantic_entropy": 0.7},
            {"token_ids": [4, 5], "logprobs": [-1.0, -0.2], "entropies": [0.9, 0.1], "set": "a",
             "difficulty": "y", "label": 0, "semantic_entropy": 0.0}]
    prior = pm.question_prior(recs, [0, 1])
    b = pm.baseline_scores(recs, [0, 1], prior)
    assert b["mean_neg_logprob"] == pytest.approx([(0.1 + 2.0 + 0.5) / 3, 0.6])
    assert b["max_neg_logprob"] == pytest.approx([2.0, 1.0])
    assert b["first_token_entropy"] == pytest.approx([0.3, 0.9])
    assert b["answer_length"].tolist() == [3, 2]
    assert b["question_prior"].tolist() == [1.0, 0.0]
    # restricted to the rows that have a state (the last token has none): the same tokens as the detectors
    b = pm.baseline_scores(recs, [0, 1], prior, rows=[2, 1])
    assert b["max_neg_logprob"] == pytest.approx([2.0, 1.0]) and b["mean_entropy"] == pytest.approx([0.9, 0.9])


def test_the_torch_fit_used_without_scikit_learn_reaches_scikit_learns_weights():
    """The GPU host has no scikit-learn: the same objective minimized in torch gives the same probe."""
    from sklearn.linear_model import LogisticRegression

    from mia_stream.lab.probe_train import _fit_torch

    rng = np.random.default_rng(4)
    X = rng.standard_normal((2000, 30))
    y = (X[:, 0] - 0.5 * X[:, 1] + rng.standard_normal(2000) > 1.0).astype(np.int64)
    for C in (0.01, 1.0):
        w, b = _fit_torch(X, y, C)
        ref = LogisticRegression(C=C, class_weight="balanced", max_iter=5000, tol=1e-10).fit(X, y)
        assert np.abs(w - ref.coef_[0]).max() < 1e-5 and abs(b - ref.intercept_[0]) < 1e-5


def test_the_output_head_outside_the_engine_gives_hugging_faces_log_probabilities(hf_model, tokenizer, model_dir):
    """``analyzers/_logits.OutputHead`` (final RMSNorm + unembedding read from the safetensors) on the last
    decoder layer's residual equals log_softmax of HF transformers' logits; the top-20 entropy is the entropy of
    the renormalized 20 largest probabilities."""
    import torch

    from mia_stream.analyzers._logits import OutputHead, top_entropy

    ids = tokenizer("The capital of France is Paris, and the capital of Peru is", return_tensors="pt")["input_ids"]
    caught = {}
    hook = hf_model.model.layers[-1].register_forward_hook(lambda m, i, o: caught.setdefault("h", o[0] if isinstance(o, tuple) else o))
    try:
        with torch.no_grad():
            logits = hf_model(ids).logits[0].double()
    finally:
        hook.remove()
    ref = torch.log_softmax(logits, -1).numpy()
    head = OutputHead.from_model_dir(model_dir)
    got = head.log_softmax(caught["h"][0].float().numpy())
    assert np.abs(got - ref).max() < 2e-3
    top = np.sort(ref[-1])[-20:]
    p = np.exp(top - top.max())
    p /= p.sum()
    assert top_entropy(got[-1:])[0] == pytest.approx(-(p * np.log(p)).sum(), abs=1e-3)


def test_the_within_set_auroc_is_the_size_weighted_mean_of_each_sets_auroc():
    """A score that only knows the set's base rate has a pooled AUROC above 0.5 and a within-set AUROC of 0.5."""
    rng = np.random.default_rng(5)
    sets = np.repeat(["a", "b", "c"], [100, 60, 40])
    y = (rng.random(200) < np.where(sets == "a", 0.8, 0.2)).astype(np.int64)
    base_rate = np.where(sets == "a", 0.8, 0.2)
    assert pm.auroc(y, base_rate) > 0.7
    assert pm.within_auroc(y, base_rate, sets) == pytest.approx(0.5)
    s = rng.standard_normal(200) + y
    ref = sum(roc_auc_score(y[sets == k], s[sets == k]) * (sets == k).sum() for k in "abc") / 200
    assert pm.within_auroc(y, s, sets) == pytest.approx(ref)
    b = pm.bootstrap(y, {"s": s, "prior": base_rate}, np.arange(200), reference="prior", strata=sets, n=200)
    assert b["s"]["auroc"] == pytest.approx(ref, abs=1e-4) and b["s"]["diff_ci"][0] > 0
