"""The token-probe arms of scripts/eval_acting.py (``--detector token_probe``): the shipped claim-level
``token_probe`` (``probes/token-probe-smollm2-135m.json``, its calibrated threshold) as an in-engine detector
(``detect``, docs/detectors.md), acting on its first alert, against the free baseline at the same moment: an
in-engine detector on the token's own -log p (a probe file with no residual weights and one logit feature),
its threshold calibrated the same way as the probe's (on the validation entities: at most 10 % of correct
answers alert, an answer alerting when any token does).

Data: the questions of ``lab/hallucination_data.py`` (every set, ``--per-set`` each, seeded), asked as the probe
was trained (chat template, "Answer in a few words.", greedy, 24 tokens); validation and held-out entities by
``entity_split`` (the probe's own split: it never trained on either). Labelled by ``check_answer``.

Arms on the held-out questions (in-engine detectors only: an action lands at the next step, docs/detectors.md):
- ``no action``: both detectors score and alert, nothing is done (their alerts' precision and recall);
- ``token_probe -> abort`` / ``-> steer`` (steer: ablate the probe's own direction ``w / scale`` at its layer
  from the alert on: the feature that raised the alert removed from the residual);
- ``-log p -> abort``: the free baseline.

Reported per arm: accuracy, hallucination rate (answered wrong / all), abstentions (aborted), correct answers
lost (right without action, aborted here), wrong answers stopped, tokens emitted after the alerting token.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path

import numpy as np

from mia_stream.lab import hallucination_data as hd
from mia_stream.lab import probe_metrics as pm

TOKEN_PROBE = "token-probe-smollm2-135m.json"
MAX_TOKENS = 24


def _log(*a):
    print(f"[{time.strftime('%H:%M:%S')}]", *a, file=sys.stderr, flush=True)


def neg_logprob_probe(path: Path, like: dict, threshold: float) -> Path:
    """A probe file whose risk is ``sigmoid(-log p - threshold)``: alert (risk >= 0.5) exactly when the token's
    -log p >= threshold. No residual weights (the engine still reads the layer's row, unused)."""
    h = like["hidden_size"]
    probe = {"format": "mia_stream.probe/1", "analyzer": "neg_logprob", "model": like["model"], "hidden_size": h,
             "num_layers": like["num_layers"], "layer": like["layer"], "position": "generated",
             "final_norm": False, "pool": "last", "mean": [0.0] * h, "scale": [1.0] * h, "weights": [0.0] * h,
             "bias": -float(threshold), "threshold": 0.5,
             "logit_features": {"names": ["logprob"], "mean": [0.0], "scale": [1.0], "weights": [-1.0]},
             "positive": "the token's -log p is at or above the calibrated threshold",
             "training": {"threshold": "max token -log p over the answer, calibrated on the validation entities: "
                                       "at most 10 % of correct answers alert"}}
    path.write_text(json.dumps(probe))
    return path


def generate_watching(llm, run_dir: str, pattern: str, prompts: list, params: list, on_event) -> tuple[list, float]:
    """``llm.generate`` of ``prompts`` (64 at a time) while a thread subscribed to ``pattern`` hands every bus
    event to ``on_event`` until all of them have ended: ``(outputs, generate seconds)``. Shared by these arms and
    eval_acting.py's in-engine arms."""
    from mia_stream.consumers import open_stream

    ready, done = threading.Event(), threading.Event()

    def collect():
        ended = 0
        with open_stream(run_dir, patterns=[pattern], timeout=120) as events:
            ready.set()
            for ev in events:
                on_event(ev)
                ended += ev.kind == "end"
                if ended >= len(prompts) and done.is_set():
                    break
    t = threading.Thread(target=collect, daemon=True)
    t.start()
    ready.wait(30)
    time.sleep(0.5)
    t0 = time.monotonic()
    outs = []
    for a in range(0, len(prompts), 64):
        outs += llm.generate(prompts[a:a + 64], params[a:a + 64], use_tqdm=False)
    secs = time.monotonic() - t0
    done.set()
    t.join(60)
    return outs, secs


class Engine:
    def __init__(self, run_dir: str, max_num_seqs: int = 64):
        import os

        os.environ["MIA_STREAM_BROKER"] = run_dir
        from transformers import AutoTokenizer
        from vllm import LLM

        from mia_stream.model import default_model_dir

        model = str(default_model_dir())
        self.run_dir = run_dir
        self.tok = AutoTokenizer.from_pretrained(model)
        t0 = time.monotonic()
        # as the probe's data were collected (lab/probe_collect.py): float32, no prefix caching
        self.llm = LLM(model, dtype="float32", enforce_eager=True, max_model_len=512, seed=0,
                       max_num_seqs=max_num_seqs, enable_prefix_caching=False)
        _log(f"engine up in {time.monotonic() - t0:.0f} s")

    def prompts(self, items):
        out = []
        for it in items:
            text = self.tok.apply_chat_template(hd.chat_messages(it), add_generation_prompt=True, tokenize=False)
            out.append({"prompt_token_ids": self.tok(text, add_special_tokens=False)["input_ids"]})
        return out

    def run(self, tag: str, items, detect: list | None):
        """Answer ``items`` greedily with ``detect`` in every request's spec; per request: the output, the first
        alerting position of each detector, and the engine's action records."""
        from vllm import SamplingParams

        ids = [f"act-{tag}-{i}" for i in range(len(items))]
        names = [f"engine:{d['name']}" for d in detect or []]
        first_alert: dict = {n: {} for n in names}
        actions: dict = {}

        def on_event(ev):
            if ev.kind == "analysis" and ev.analysis.analyzer in first_alert and ev.analysis.step >= 0:
                a, rid = ev.analysis, ev.stream.request_id
                hot = [p for p, al in zip(a.positions, a.alerts) if al]
                if hot and rid not in first_alert[a.analyzer]:
                    first_alert[a.analyzer][rid] = min(hot)
            elif ev.kind == "analysis" and ev.analysis.analyzer == "alert_action":
                a = ev.analysis
                actions[ev.stream.request_id] = {"alert_step": int(a.values["alert_step"][0]),
                                                 "applied_step": int(a.values["applied_step"][0]),
                                                 "position": int(a.positions[0])}
        params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, seed=0, logprobs=0,
                                 extra_args={"mia_stream": {"id": rid, **({"detect": detect} if detect else {})}})
                  for rid in ids]
        outs, secs = generate_watching(self.llm, self.run_dir, f"act-{tag}-*", self.prompts(items), params,
                                       on_event)
        return {"ids": ids, "outs": outs, "first_alert": first_alert, "actions": actions, "secs": secs}

    def stop(self):
        self.llm.llm_engine.engine_core.shutdown()


def _neg_logprobs(out) -> list[float]:
    c = out.outputs[0]
    return [-float(lp[t].logprob) for t, lp in zip(c.token_ids, c.logprobs or [])]


def _entity_ci(hit: np.ndarray, groups: np.ndarray, n: int = 1000, seed: int = 0) -> list[float]:
    uniq, inv = np.unique(groups, return_inverse=True)
    members = [np.flatnonzero(inv == g) for g in range(len(uniq))]
    rng = np.random.default_rng(seed)
    rates = [hit[np.concatenate([members[g] for g in rng.integers(0, len(uniq), len(uniq))])].mean()
             for _ in range(n)]
    return [round(float(np.quantile(rates, 0.025)), 3), round(float(np.quantile(rates, 0.975)), 3)]


def score_arm(items, res, base_correct=None, detector=None) -> dict:
    n = len(items)
    correct = wrong = aborted = lost = stopped = 0
    after = []
    for i, (it, o) in enumerate(zip(items, res["outs"])):
        c = o.outputs[0]
        rid = res["ids"][i]
        if c.finish_reason == "abort":
            aborted += 1
            if base_correct is not None:
                lost += base_correct[i]
                stopped += not base_correct[i]
        elif hd.check_answer(it, c.text):
            correct += 1
        else:
            wrong += 1
        if detector is not None and rid in res["first_alert"][detector]:
            k = res["first_alert"][detector][rid] - len(o.prompt_token_ids)  # the alerting token's index
            after.append(len(c.token_ids) - 1 - k)
    r = {"n": n, "accuracy": correct / n, "hallucination_rate": wrong / n, "abstained": aborted / n,
         "correct": correct, "wrong": wrong, "aborted": aborted,
         "outcomes": [o.outputs[0].finish_reason == "abort" and "aborted" or
                      ("correct" if hd.check_answer(it, o.outputs[0].text) else "wrong")
                      for it, o in zip(items, res["outs"])]}
    if base_correct is not None:
        r.update(correct_lost=int(lost), wrong_stopped=int(stopped))
    if after:
        r["tokens_after_alert"] = {"median": float(np.median(after)), "max": int(max(after)), "alerts": len(after)}
    if res["actions"]:
        d = [a["applied_step"] - a["alert_step"] for a in res["actions"].values() if a["applied_step"] >= 0]
        r["actions_applied"] = len(d)
        r["steps_alert_to_applied"] = {"min": min(d), "max": max(d)} if d else None
    return r


def main(args, run_dir: str) -> dict:
    from mia_stream.spec.probes import resolve_probe_path

    probe_path = resolve_probe_path(TOKEN_PROBE, "probe")
    probe = json.loads(Path(probe_path).read_text())
    items = hd.question_set(hd.SETS, limit=args.per_set, seed=0)
    split = [hd.entity_split(it["group"]) for it in items]
    val = [it for it, s in zip(items, split) if s == "val"]
    test = [it for it, s in zip(items, split) if s == "test"]
    if args.limit:
        test = test[:args.limit]
    results = {"command": "python scripts/eval_acting.py " + " ".join(args.argv),
               "data": f"hallucination_data sets, {args.per_set} per set (seed 0): {len(val)} validation / "
                       f"{len(test)} held-out questions (the probe's entity split)",
               "token_probe": {"file": TOKEN_PROBE, "layer": probe["layer"], "threshold": probe["threshold"]}}
    eng = Engine(run_dir)
    try:
        # the free baseline's threshold, calibrated the probe's way on the validation entities
        t0 = time.monotonic()
        v = eng.run("val", val, None)
        y_val = np.asarray([not hd.check_answer(it, o.outputs[0].text) for it, o in zip(val, v["outs"])])
        s_val = np.asarray([max(_neg_logprobs(o)[:-1] or [0.0]) for o in v["outs"]])  # rows with a state
        lp_thr = pm.calibrate(s_val[~y_val], pm.FALSE_ALERT_RATE)
        results["neg_logprob"] = {"threshold": lp_thr, "validation": {"n": len(val), "wrong": int(y_val.sum())}}
        _log(f"validation: {len(val)} questions ({int(y_val.sum())} wrong), -log p threshold {lp_thr:.3f} "
             f"({time.monotonic() - t0:.0f} s)")
        lp_file = neg_logprob_probe(Path(run_dir) / "neg-logprob.json", probe, lp_thr)

        def det(name, path, action=None):
            d = {"probe": str(path), "name": name, "positions": "generated"}
            return d | ({"action": action} if action is not None else {})

        unit = np.asarray(probe["weights"]) / np.asarray(probe["scale"])
        ablate = {"steer": [{"layer": probe["layer"], "op": "ablate",
                             "vector": (unit / np.linalg.norm(unit)).tolist()}]}
        arms = {}
        base = eng.run("base", test, [det("token_probe", probe_path), det("neg_logprob", lp_file)])
        base_correct = [bool(hd.check_answer(it, o.outputs[0].text)) for it, o in zip(test, base["outs"])]
        arms["no action"] = score_arm(test, base)
        # the -log p detector's alerts against vLLM's own logprobs of the same tokens (a check of the probe file)
        by_logprobs = {rid for rid, o in zip(base["ids"], base["outs"])
                       if max(_neg_logprobs(o)[:-1] or [0.0]) >= lp_thr}
        results["neg_logprob"]["engine_alerts_equal_vllm_logprobs"] = \
            by_logprobs == set(base["first_alert"]["engine:neg_logprob"])
        for name in ("token_probe", "neg_logprob"):
            flagged = set(base["first_alert"][f"engine:{name}"])
            wrong_ids = {rid for rid, ok in zip(base["ids"], base_correct) if not ok}
            arms["no action"][f"alerts_{name}"] = {
                "alerted": len(flagged), "precision": len(flagged & wrong_ids) / max(1, len(flagged)),
                "recall": len(flagged & wrong_ids) / max(1, len(wrong_ids)),
                "false_alerts_on_correct": len(flagged - wrong_ids) / max(1, len(base["ids"]) - len(wrong_ids)),
                "tokens_after_alert": score_arm(test, base, None, f"engine:{name}").get("tokens_after_alert")}
        for arm, d in (("token_probe -> abort", det("token_probe", probe_path, "abort")),
                       ("token_probe -> steer (ablate its direction)", det("token_probe", probe_path, ablate)),
                       ("-log p -> abort", det("neg_logprob", lp_file, "abort"))):
            res = eng.run(f"arm{len(arms)}", test, [d])
            arms[arm] = score_arm(test, res, base_correct, f"engine:{d['name']}")
            _log(f"{arm}: {arms[arm]} ({res['secs']:.0f} s)")
        groups = np.asarray([it["group"] for it in test])
        for r in arms.values():  # 95 % bootstrap CIs over entities (questions of one entity resampled together)
            out = np.asarray(r.pop("outcomes"))
            for key, what in (("hallucination_rate", "wrong"), ("accuracy", "correct"), ("abstained", "aborted")):
                r[key + "_ci"] = _entity_ci(out == what, groups)
        results["held_out"] = arms
    finally:
        eng.stop()
    return results


def print_table(results: dict) -> None:
    print(f"\n{'arm':<46} {'accuracy':>8} {'halluc.':>8} {'abstain':>8} {'halluc. 95% CI':>15} {'lost':>5} "
          f"{'stopped':>7}  "
          f"tokens after alert (median/max)")
    for name, r in results["held_out"].items():
        ta = r.get("tokens_after_alert")
        print(f"{name:<46} {r['accuracy']:8.3f} {r['hallucination_rate']:8.3f} {r['abstained']:8.3f} "
              f"[{r['hallucination_rate_ci'][0]:.3f},{r['hallucination_rate_ci'][1]:.3f}] "
              f"{r.get('correct_lost', '-'):>5} {r.get('wrong_stopped', '-'):>7}  "
              + (f"{ta['median']:g} / {ta['max']}" if ta else ""))
    for k, v in results["held_out"]["no action"].items():
        if k.startswith("alerts_"):
            print(f"  {k[7:]}: {v}")
