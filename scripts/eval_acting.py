#!/usr/bin/env python
"""Acting on hallucination alerts, measured: accuracy and hallucination rate on held-out questions with and
without an action taken live on each alert (abort, or steer along a truthfulness direction).

    python scripts/eval_acting.py [--layer 16] [--scales 2,4,8] [--train-subset 150] [--out results.json]
    python scripts/eval_acting.py --detector token_probe [--per-set 60] [--out results.json]

``--detector token_probe``: the shipped claim-level token probe in the engine (abort, steer) against a free
-log p detector calibrated the same way, on its held-out entities: scripts/_acting_token.py. The rest of this
docstring is the default ``hnode`` mode.

Data: the country-capital questions of ``mia_stream.lab.datasets`` (countryinfo); held out are the countries of
the test split the shipped before-answer ``hnode`` probe was trained with (scripts/eval_hnode.py: by entity, 30 %,
seed 0), so the detector never saw a held-out country; answers greedy, 24 tokens, chat template, labelled automatically (the capital's words in the
answer). Everything runs in the topology users run: a broker process, vLLM's multiprocess engine, the detector
(``mia-stream analyze hnode --publish``: P(hallucination) at the last prompt token, i.e. before the answer is
written; alert when p >= its threshold) and a watcher process that acts on each request's alert through the
live-steering path (``AlertWatcher`` + ``AlertActor``: the ack names the step it took effect).

The truthfulness direction (CAA-style, after scripts/caa_steering_demo.py: a difference of means of contrast
inputs): for every *training* country the statement "The capital of C is X." with the true capital and with the
capital of another training country; the layer-L residual averaged over the answer's tokens (X and the period);
v = mean(true) - mean(false). Its scale is chosen on training questions only (``--train-subset`` of them, always
steered from the first decode step), then frozen.

Arms on the held-out questions (every request is a separate stream of one batch):
- ``baseline``: no action (the detector's alerts are still recorded: their precision and recall);
- ``alert->abort``: the request is aborted at the acked step (an aborted answer is an abstention);
- ``alert->steer``: ``add`` s·v at layer L from the acked step on;
- ``always-steer``: s·v on every request from its first decode step (no detector): what gating by alerts adds;
- ``engine:alert->abort`` / ``engine:alert->steer``: the same probe, threshold and action as a detector in each
  request's spec (``detect``, docs/detectors.md): scored in the forward pass, acted on in the engine core before
  the next step (no analyzer or watcher process).

Reported per arm: accuracy (correct / all), hallucination rate (answered and wrong / all), abstentions, alerts,
and for the live actions the steps from the alert to the acked step.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from _procs import stop_processes  # noqa: E402  (scripts/_procs.py, beside this file)

from mia_stream.lab import datasets  # noqa: E402

MAX_TOKENS = 24
SEED = 0
DETECTOR = "hnode"
# the before-answer probe (last prompt token, question only): an action can still change the whole answer
PROBE = "hnode-before-answer-smollm2-135m.json"


def _log(*a):
    print(f"[{time.strftime('%H:%M:%S')}]", *a, file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------ the watcher process

def watch(broker: str, pattern: str, action_json: str, out: str, expected: str = "0") -> int:
    """Act on the detector's alerts until the detector has scored ``expected`` requests (or SIGTERM); write the
    alerts seen, the requests scored and the actions taken as JSON."""
    from mia_stream.analyzers._actions import AlertActor, AlertWatcher
    from mia_stream.analyzers._alerts import AlertAction
    from mia_stream.consumers import open_batches

    action = AlertAction.parse(json.loads(action_json), "eval_acting")
    actor = AlertActor(broker, action, value="p_hallucination") if action is not None else None
    watcher = AlertWatcher(DETECTOR, None, actor)  # the detector's own alerts (p >= its threshold)

    class Stop(Exception):
        pass

    def _term(*_):
        raise Stop

    signal.signal(signal.SIGTERM, _term)
    scored: set = set()
    try:
        # this arm's requests only: from_start also replays the earlier arms' streams the broker still holds,
        # whose alerts were counted again and acted on after their requests had ended (unknown_request)
        with open_batches(broker, [pattern], from_start=True,
                          consumer_id=f"alert-watcher:{DETECTOR}:{os.getpid()}") as events:
            Path(out + ".ready").write_text("1")
            for ev in events:
                watcher.feed(ev)
                # stop once every request's score is in (not after a fixed wait: the detector may lag)
                if ev.kind == "batch" and getattr(ev.batch, "KIND", "") == "analysis" \
                        and ev.batch.analyzer == DETECTOR:
                    scored.update(ev.batch.request_ids)
                    if len(scored) >= int(expected):
                        break
    except Stop:
        pass
    finally:
        if actor is not None:
            actor.close()
    recs = [] if actor is None else [
        {"request_id": r.request_id, "alert_step": r.alert_step, "applied_step": r.applied_step, "ok": r.ok,
         "error": r.error, "risk": r.risk} for r in actor.records.values()]
    Path(out).write_text(json.dumps({"alerts": [a[0] for a in watcher.alerts], "actions": recs,
                                     "scored": len(scored)}))
    return 0


# ------------------------------------------------------------------------------------------ the run

class Bench:
    def __init__(self, args):
        self.args = args
        self.run_dir = Path(tempfile.mkdtemp(prefix="mia-act-", dir="/tmp"))
        self.py = [sys.executable, "-m", "mia_stream.cli"]
        self.procs: dict = {}

    def start(self):
        self.procs["broker"] = subprocess.Popen(self.py + ["broker", "--address", str(self.run_dir)],
                                                stdout=subprocess.DEVNULL)
        while not (self.run_dir / "consumers.sock").exists():
            time.sleep(0.05)
        config = self.run_dir / "detector.json"
        config.write_text(json.dumps({"probe": PROBE}))
        self.procs["detector"] = subprocess.Popen(self.py + ["analyze", DETECTOR, "--config", str(config),
                                                             "--source", str(self.run_dir),
                                                             "--publish", "--patterns", "act-*"],
                                                  stderr=subprocess.DEVNULL)
        os.environ["MIA_STREAM_BROKER"] = str(self.run_dir)
        from transformers import AutoTokenizer
        from vllm import LLM

        from mia_stream.model import default_model_dir

        model = str(default_model_dir())
        self.tok = AutoTokenizer.from_pretrained(model)
        t0 = time.monotonic()
        self.llm = LLM(model, dtype="float32", enforce_eager=True, max_model_len=512, seed=SEED, max_num_seqs=64)
        _log(f"engine up in {time.monotonic() - t0:.0f} s (float32, enforce_eager: as the hnode probe was trained)")

    def stop(self):
        if getattr(self, "llm", None) is not None:
            self.llm.llm_engine.engine_core.shutdown()
        stop_processes(self.procs.values())

    def prompt_ids(self, items):
        out = []
        for it in items:
            text = self.tok.apply_chat_template(datasets.chat_messages(it), add_generation_prompt=True,
                                                tokenize=False)
            out.append({"prompt_token_ids": self.tok(text, add_special_tokens=False)["input_ids"]})
        return out

    def generate(self, tag, items, steer=None, action=None, capture=True):
        """Answer ``items`` (one batch); ``action``: what the watcher does on an alert (None: only record)."""
        from vllm import SamplingParams

        watcher_out = str(self.run_dir / f"watch-{tag}.json")
        watcher = subprocess.Popen([sys.executable, __file__, "--watch", str(self.run_dir), f"act-{tag}-*",
                                    json.dumps(action),
                                    watcher_out, str(len(items) if capture else 0)])
        while not Path(watcher_out + ".ready").exists():
            time.sleep(0.05)
        self._wait_consumers(f"alert-watcher:{DETECTOR}:{watcher.pid}")
        params = []
        for i in range(len(items)):
            spec = {"id": f"act-{tag}-{i}"}
            if capture:
                spec["capture"] = {"hidden_states": {"layers": [self.detector_layer], "positions": "last_prompt"}}
            if steer is not None:
                spec["steer"] = steer
            params.append(SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, seed=SEED,
                                         extra_args={"mia_stream": spec}))
        t0 = time.monotonic()
        outs = []
        for a in range(0, len(items), 64):
            outs += self.llm.generate(self.prompt_ids(items[a:a + 64]), params[a:a + 64], use_tqdm=False)
        secs = time.monotonic() - t0
        if capture:  # the watcher ends when the detector has scored every request of the arm
            try:
                watcher.wait(300)
            except subprocess.TimeoutExpired:
                _log(f"{tag}: the detector did not score every request within 300 s")
        else:
            time.sleep(1.0)
        if watcher.poll() is None:
            watcher.send_signal(signal.SIGTERM)
            watcher.wait(60)
        seen = json.loads(Path(watcher_out).read_text())
        return outs, seen, secs

    def generate_in_engine(self, tag, items, action):
        """Answer ``items`` with the detector inside the engine (each request's spec names the probe, alert and
        action: issue 25); the engine's ``alert_action`` records are collected from the bus."""
        from vllm import SamplingParams

        from _acting_token import generate_watching  # scripts/_acting_token.py, beside this file

        ids = [f"act-{tag}-{i}" for i in range(len(items))]
        seen = {"alerts": [], "actions": [], "scored": 0}

        def on_event(ev):
            if ev.kind == "analysis" and ev.analysis.analyzer == "engine:hnode" and ev.analysis.step >= 0:
                seen["scored"] += 1
                seen["alerts"] += [ev.stream.request_id] * int(sum(ev.analysis.alerts))
            elif ev.kind == "analysis" and ev.analysis.analyzer == "alert_action":
                a = ev.analysis
                applied = int(a.values["applied_step"][0])
                seen["actions"].append({"ok": applied >= 0, "applied_step": applied,
                                        "alert_step": int(a.values["alert_step"][0])})
        detect = [{"probe": PROBE, "positions": "last_prompt", "action": action}]
        params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, seed=SEED,
                                 extra_args={"mia_stream": {"id": rid, "detect": detect}}) for rid in ids]
        outs, secs = generate_watching(self.llm, str(self.run_dir), f"act-{tag}-*", self.prompt_ids(items), params,
                                       on_event)
        return outs, seen, secs

    def _wait_consumers(self, watcher_id, timeout=60):
        """Until the detector and this arm's watcher are subscribed."""
        from mia_stream.broker import fetch_stats

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                cons = fetch_stats(str(self.run_dir), timeout=1.0)["consumers"]
                if watcher_id in cons and any(k.startswith(f"analyzer:{DETECTOR}:") for k in cons):
                    return
            except Exception:  # noqa: BLE001 (stats not up yet)
                pass
            time.sleep(0.1)
        raise TimeoutError("the detector and the watcher did not subscribe")

    def direction(self, train_items, layer):
        """CAA truthfulness direction from training countries (see the module docstring)."""
        from mia_stream.consumers import open_stream
        from vllm import SamplingParams

        pairs = {}
        for it in train_items:
            pairs.setdefault(it["group"], it)
        facts = sorted(pairs.values(), key=lambda it: it["group"])
        caps = [it["answer"] for it in facts]
        rng = random.Random(SEED)
        wrong = caps[:]
        while any(a == b for a, b in zip(wrong, caps)):
            rng.shuffle(wrong)
        country = [it["group"].split(":", 1)[1] for it in facts]
        texts, spans = [], []
        for c, true, false in zip(country, caps, wrong):
            prefix = len(self.tok(f"The capital of {c} is", add_special_tokens=False)["input_ids"])
            for ans in (true, false):
                texts.append(f"The capital of {c} is {ans}.")
                spans.append(prefix)
        ids = [f"act-dir-{i}" for i in range(len(texts))]
        rows = {}
        with open_stream(str(self.run_dir), patterns=["act-dir-*"], timeout=120) as stream:
            time.sleep(0.3)
            sp = [SamplingParams(max_tokens=1, extra_args={"mia_stream": {
                "id": r, "capture": {"hidden_states": {"layers": [layer], "positions": "prompt"}}}}) for r in ids]
            self.llm.generate(texts, sp, use_tqdm=False)
            ended = 0
            for ev in stream:
                if ev.kind == "frame":
                    rows.setdefault(ev.stream.request_id, []).append((ev.frame.positions, ev.frame.tensors["hs"][0]))
                elif ev.kind == "end":
                    ended += 1
                    if ended == len(ids):
                        break
        means = []
        for r, start in zip(ids, spans):
            pos = [p for ps, _ in rows[r] for p in ps]
            hs = np.concatenate([h for _, h in rows[r]])
            order = np.argsort(pos)
            hs = hs[order]
            means.append(hs[start:].astype(np.float64).mean(0))  # the answer's tokens and the period
        means = np.asarray(means)
        v = means[0::2].mean(0) - means[1::2].mean(0)
        _log(f"direction: layer {layer}, {len(facts)} training countries, |v| = {np.linalg.norm(v):.2f}, "
             f"mean |h| {np.linalg.norm(means, axis=1).mean():.1f}")
        return v.astype(np.float32), len(facts)


def score(items, outs, seen=None):
    n = len(items)
    correct = wrong = aborted = 0
    for it, o in zip(items, outs):
        c = o.outputs[0]
        if c.finish_reason == "abort":
            aborted += 1
        elif datasets.is_correct(it, c.text):
            correct += 1
        else:
            wrong += 1
    res = {"n": n, "accuracy": correct / n, "hallucination_rate": wrong / n, "abstained": aborted / n,
           "correct": correct, "wrong": wrong, "aborted": aborted}
    if seen is not None:
        res["alerts"] = len(set(seen["alerts"]))
        res["scored"] = seen.get("scored")  # requests the detector's score reached the watcher for
        acts = seen["actions"]
        if acts:
            ok = [a for a in acts if a["ok"]]
            res["actions_ok"] = len(ok)
            res["actions_failed"] = len(acts) - len(ok)
            d = [a["applied_step"] - a["alert_step"] for a in ok]
            res["steps_alert_to_applied"] = {"min": min(d), "median": float(np.median(d)), "max": max(d)} if d else None
    return res


def _token_probe_arms(args, argv) -> int:
    import _acting_token as at  # scripts/_acting_token.py, beside this file

    args.argv = list(argv if argv is not None else sys.argv[1:])
    run_dir = tempfile.mkdtemp(prefix="mia-act-", dir="/tmp")
    broker = subprocess.Popen([sys.executable, "-m", "mia_stream.cli", "broker", "--address", run_dir],
                              stdout=subprocess.DEVNULL)
    try:
        while not (Path(run_dir) / "consumers.sock").exists():
            time.sleep(0.05)
        t0 = time.monotonic()
        results = at.main(args, run_dir)
        results["seconds"] = round(time.monotonic() - t0)
    finally:
        stop_processes([broker])
    print(json.dumps(results, indent=1))
    at.print_table(results)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layer", type=int, default=16, help="the steered layer (and the direction's)")
    ap.add_argument("--scales", default="2,4,8", help="steering scales tried on training questions")
    ap.add_argument("--train-subset", type=int, default=150, help="training questions used to pick the scale")
    ap.add_argument("--limit", type=int, help="held-out questions used (default: all; a quick check)")
    ap.add_argument("--out", help="write the results as JSON here")
    ap.add_argument("--detector", choices=("hnode", "token_probe"), default="hnode",
                    help="hnode: the before-answer probe's arms (below); token_probe: the shipped claim-level token "
                         "probe in the engine, abort / steer, against a -log p detector (scripts/_acting_token.py)")
    ap.add_argument("--per-set", type=int, default=60,
                    help="token_probe: questions per set of lab/hallucination_data (seeded sample)")
    ap.add_argument("--watch", nargs=5, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.watch:
        return watch(*args.watch)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    if args.detector == "token_probe":
        return _token_probe_arms(args, argv)
    from mia_stream.analyzers import create

    items = datasets.capital_questions()
    # held out: the countries the probe never saw, i.e. the test groups of the split it was trained on
    # (scripts/eval_hnode.py: the first capital phrasing and the element questions, by entity, 30 %, seed 0)
    probe_items = [it for it in items if it["id"].endswith("-0")] + datasets.element_questions()
    _, probe_te = datasets.group_split(probe_items, 0.3, SEED)
    held_out = {probe_items[i]["group"] for i in probe_te}
    train = [it for it in items if it["group"] not in held_out]
    test = [it for it in items if it["group"] in held_out]
    if args.limit:
        test = test[:args.limit]
    rng = random.Random(SEED)
    subset = rng.sample(train, min(args.train_subset, len(train)))
    scales = [float(s) for s in args.scales.split(",") if s]
    results = {"command": "python scripts/eval_acting.py " + " ".join(argv if argv is not None else sys.argv[1:]),
               "data": f"capital questions: {len(train)} train / {len(test)} held out (by country, seed {SEED})"}
    bench = Bench(args)
    bench.detector_layer = create(DETECTOR, {"probe": PROBE}).probe.layer
    try:
        bench.start()
        v, n_facts = bench.direction(train, args.layer)
        results["direction"] = {"layer": args.layer, "training_countries": n_facts, "norm": float(np.linalg.norm(v))}
        # the scale, on training questions only (always steered: the gated arm cannot be better than its best)
        choose = {}
        base_outs, _, _ = bench.generate("tr-base", subset, capture=False)
        choose["0"] = score(subset, base_outs)
        for s in scales:
            steer = [{"layer": args.layer, "op": "add", "vector": v.tolist(), "scale": s, "positions": "generated"}]
            outs, _, _ = bench.generate(f"tr-s{s:g}", subset, steer=steer, capture=False)
            choose[f"{s:g}"] = score(subset, outs)
            _log(f"train subset, scale {s:g}: {choose[f'{s:g}']}")
        best = max(scales, key=lambda s: (choose[f"{s:g}"]["accuracy"], -s))
        results["scale_selection"] = {"train_questions": len(subset), "by_scale": choose, "chosen": best}
        _log(f"scale chosen on training questions: {best:g} (baseline accuracy {choose['0']['accuracy']:.3f})")
        steer_ops = [{"layer": args.layer, "op": "add", "vector": v.tolist(), "scale": best}]
        arms = {}
        outs, seen, secs = bench.generate("baseline", test, action=None)
        arms["baseline"] = score(test, outs, seen)
        labels = {f"act-baseline-{i}": not datasets.is_correct(it, o.outputs[0].text)
                  for i, (it, o) in enumerate(zip(test, outs))}
        alerted = set(seen["alerts"])
        tp = sum(labels[r] for r in alerted)
        arms["baseline"]["alert_precision"] = tp / len(alerted) if alerted else None
        arms["baseline"]["alert_recall"] = tp / max(1, sum(labels.values()))
        outs, seen, _ = bench.generate("abort", test, action="abort")
        arms["alert->abort"] = score(test, outs, seen)
        outs, seen, _ = bench.generate("steer", test, action={"steer": steer_ops})
        arms["alert->steer"] = score(test, outs, seen)
        # the same detector inside the engine (issue 25): judged and acted on at the step boundary
        outs, seen, _ = bench.generate_in_engine("eabort", test, "abort")
        arms["engine:alert->abort"] = score(test, outs, seen)
        outs, seen, _ = bench.generate_in_engine("esteer", test, {"steer": steer_ops})
        arms["engine:alert->steer"] = score(test, outs, seen)
        always = [dict(steer_ops[0], positions="generated")]
        outs, seen, _ = bench.generate("always", test, steer=always, action=None)
        arms["always-steer"] = score(test, outs, seen)
        results["held_out"] = arms
    finally:
        bench.stop()
    print(json.dumps(results, indent=1))
    print(f"\n{'arm':<20} {'accuracy':>8} {'halluc.':>8} {'abstain':>8} {'alerts':>7} {'acted':>6}  alert->applied")
    for name, r in results["held_out"].items():
        st = r.get("steps_alert_to_applied")
        steps = f"+{st['min']}..+{st['max']} steps (median +{st['median']:g})" if st else ""
        print(f"{name:<20} {r['accuracy']:8.3f} {r['hallucination_rate']:8.3f} {r['abstained']:8.3f} "
              f"{r.get('alerts', '-'):>7} {r.get('actions_ok', '-'):>6}  {steps}"
              + (f"; {r['actions_failed']} too late" if r.get("actions_failed") else ""))
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
