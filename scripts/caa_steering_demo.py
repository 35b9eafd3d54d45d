"""Contrastive activation addition (CAA) through mia_stream: capture, build a steering vector, steer, compare.

    .venv/bin/python scripts/caa_steering_demo.py [--layer 13] [--scale 2] [--name ocean] [--eager]

1. Capture. Sixteen contrast prompts (eight about the ocean, eight matched ones about cities, roads, deserts)
   run through the real engine with ``capture.hidden_states = {layers: [L, M], positions: "prompt"}``; the
   frames come back through a broker in this process.
2. Build. The vector is mean(ocean) - mean(other) of the layer-L residual, each prompt's rows averaged over
   its prompt positions except position 0. Why the prompt mean and not ``last_prompt``: the topic is spread
   over the content words, while the last token is a "." in every prompt; on this model the last-token
   difference is 3x weaker (|d| ~ 7 vs ~21 at layers 5-11) and moved nothing when added. Position 0 is
   left out because its row is an outlier in norm that carries no topic.
3. Register it (``register_vector(name, v)``) and generate the same neutral prompts unsteered and steered
   with ``{"steer": [{"layer": L, "op": "add", "vector": {"name": name}, "scale": s}]}`` (greedy; a
   repetition penalty of 1.2 on both arms keeps this 135M model out of loops).
4. Measure, automatically: (a) ocean keywords in the text; (b) the generated tokens' residual at a
   downstream layer M > L (captured in the same run) projected on the layer-M ocean direction, reported as
   the shift from unsteered in units of the ocean-vs-other gap of the contrast prompts (0 = unmoved,
   1 = moved as far as an ocean prompt is from a city prompt).

``--layer``/``--scale`` take comma-separated lists to compare several settings in one run (one engine;
every setting is a separate request in the same batch); the first pair is shown side by side.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
import textwrap
import time

import numpy as np

OCEAN = ["The ocean waves crashed against the rocky shore.",
         "Whales and dolphins swim in the deep blue sea.",
         "We sailed a small boat across the salty ocean.",
         "The tide brought seashells and seaweed onto the beach.",
         "Coral reefs full of fish lie beneath the sea.",
         "The sailors watched the ocean horizon from the ship.",
         "Sea water is cold and salty far from the coast.",
         "Marine life thrives in the vast Pacific Ocean."]
OTHER = ["The city traffic crawled along the busy highway.",
         "Cats and dogs sleep in the warm living room.",
         "We drove a small car across the dusty desert.",
         "The wind blew leaves and papers onto the street.",
         "Office buildings full of people line the avenue.",
         "The workers watched the city skyline from the tower.",
         "Desert air is hot and dry far from the mountains.",
         "Office life thrives in the busy downtown district."]
NEUTRAL = ["My favorite way to spend a weekend is",
           "Yesterday I went outside and",
           "The best thing about summer is",
           "Let me tell you a story about",
           "I think the most interesting place in the world is",
           "Here is what I did on my vacation:"]
KEYWORDS = re.compile(r"\b(oceans?|seas?|waves?|beach(es)?|shores?|tides?|coral|whales?|fish(es)?|ships?|boats?|"
                      r"sail(ing|ors?)?|marine|coast(al)?|seaweed|dolphins?|surf(ing)?|islands?|underwater|"
                      r"pacific|atlantic|sea(side|shells?|food)|reefs?|water)\b", re.I)


def keyword_count(text: str) -> int:
    return len(KEYWORDS.findall(text))


class _Frames:
    """Reads the broker stream in this thread (the broker queues while ``generate`` blocks)."""

    def __init__(self, address: str, patterns):
        from mia_stream.consumers import open_stream

        self._stream = open_stream(address, patterns=patterns, timeout=60.0)
        self.frames: dict[str, list] = {}
        self.ended: set[str] = set()
        time.sleep(0.2)  # let the subscription reach the broker before the engine publishes

    def wait(self, request_ids) -> None:
        want = set(request_ids)
        while not want <= self.ended:
            ev = next(self._stream, None)
            if ev is None:
                raise RuntimeError(f"streams did not end: {sorted(want - self.ended)[:5]}")
            rid = ev.stream.request_id
            if ev.kind == "frame":
                self.frames.setdefault(rid, []).append(ev.frame)
            elif ev.kind == "end":
                self.ended.add(rid)

    def hidden(self, rid: str, layer: int) -> tuple[list, np.ndarray]:
        """(positions, rows [T, hidden]) of ``layer`` for request ``rid``."""
        fs = self.frames.get(rid, [])
        pos = [p for f in fs for p in f.positions]
        rows = [f.tensors["hs"][list(f.layers["hs"]).index(layer)] for f in fs]
        return pos, (np.concatenate(rows) if rows else np.zeros((0, 0), np.float32))

    def close(self) -> None:
        self._stream.close()


def _floats(s: str) -> list[float]:
    return [float(x) for x in s.split(",") if x]


def run(args) -> int:
    from vllm import LLM, SamplingParams

    from mia_stream.spec.vectors import register_vector

    layers, scales = [int(x) for x in args.layer.split(",")], _floats(args.scale)
    M = args.measure_layer
    if M <= max(layers):
        raise SystemExit(f"--measure-layer ({M}) must come after the steered layers {layers}")
    settings = [(L, s) for L in layers for s in scales]
    t0 = time.perf_counter()
    llm = LLM(args.model, dtype="float32", enforce_eager=args.eager, max_model_len=512, seed=0)
    print(f"engine up in {time.perf_counter() - t0:.0f} s "
          f"({'enforce_eager' if args.eager else 'torch.compile'}, float32, CPU)\n", flush=True)
    from mia_stream import settings

    frames = _Frames(settings.get_address("MIA_STREAM_BROKER"), ["caa-*"])
    try:
        # 1. capture the contrast prompts
        cap = {"hidden_states": {"layers": sorted(set(layers + [M])), "positions": "prompt"}}
        ids = [f"caa-pos-{i}" for i in range(len(OCEAN))] + [f"caa-neg-{i}" for i in range(len(OTHER))]
        llm.generate(OCEAN + OTHER, [SamplingParams(max_tokens=1, extra_args={"mia_stream": {"capture": cap, "id": r}})
                                     for r in ids], use_tqdm=False)
        frames.wait(ids)

        def prompt_mean(rid, layer):
            pos, rows = frames.hidden(rid, layer)
            assert pos == list(range(len(pos))), f"{rid}: prompt rows missing ({pos})"
            return rows[1:].mean(0)

        def caa(layer):
            pos = np.mean([prompt_mean(r, layer) for r in ids[:len(OCEAN)]], 0)
            neg = np.mean([prompt_mean(r, layer) for r in ids[len(OCEAN):]], 0)
            return (pos - neg).astype(np.float32)

        # 2./3. build and register one vector per steered layer
        vectors = {L: caa(L) for L in layers}
        names = {L: args.name if i == 0 else f"{args.name}-L{L}" for i, L in enumerate(layers)}
        for L in layers:
            path = register_vector(names[L], vectors[L])
            print(f"registered {names[L]!r} (layer {L}, |v| = {np.linalg.norm(vectors[L]):.1f}) -> {path}")
        d_m = caa(M)
        unit_m = d_m / np.linalg.norm(d_m)
        gap_m = float(np.linalg.norm(d_m))  # mean(ocean)·û - mean(other)·û at layer M
        print(f"measure: layer {M}, ocean-vs-other gap along the layer-{M} direction = {gap_m:.1f}\n")

        # 4. generate unsteered and steered, capturing layer M of the generated tokens
        def params(rid, steer=None):
            spec = {"capture": {"hidden_states": {"layers": [M], "positions": "generated"}}, "id": rid}
            if steer:
                spec["steer"] = steer
            return SamplingParams(max_tokens=args.tokens, temperature=0.0, repetition_penalty=1.2,
                                  extra_args={"mia_stream": spec})

        arms = [("base", None)] + [(f"L{L}-s{s:g}", [{"layer": L, "op": "add", "vector": {"name": names[L]},
                                                       "scale": s}]) for L, s in settings]
        prompts, plist, rids = [], [], []
        for arm, steer in arms:
            for j, q in enumerate(NEUTRAL):
                rid = f"caa-gen-{arm}-{j}"
                prompts.append(q), plist.append(params(rid, steer)), rids.append(rid)
        t1 = time.perf_counter()
        outs = llm.generate(prompts, plist, use_tqdm=False)
        frames.wait(rids)
        gen_s = time.perf_counter() - t1
        text = {rid: o.outputs[0].text for rid, o in zip(rids, outs)}

        def proj(rid):
            rows = frames.hidden(rid, M)[1]
            return float((rows @ unit_m).mean())

        summary = {}
        for arm, _ in arms:
            ar = [f"caa-gen-{arm}-{j}" for j in range(len(NEUTRAL))]
            summary[arm] = (sum(keyword_count(text[r]) for r in ar), float(np.mean([proj(r) for r in ar])),
                            sum(1 for r in ar if keyword_count(text[r]) > 0))
    finally:
        frames.close()
        llm.llm_engine.engine_core.shutdown()

    main_arm = arms[1][0]
    L0, s0 = settings[0]
    width = 58
    print(f"=== side by side: unsteered | steered (layer {L0}, scale {s0:g}, vector {names[L0]!r}) ===")
    for j, q in enumerate(NEUTRAL):
        a, b = text[f"caa-gen-base-{j}"], text[f"caa-gen-{main_arm}-{j}"]
        print(f"\n> {q}")
        la = textwrap.wrap(" ".join(a.split()), width) or [""]
        lb = textwrap.wrap(" ".join(b.split()), width) or [""]
        for k in range(max(len(la), len(lb))):
            print(f"  {la[k] if k < len(la) else '':<{width}} | {lb[k] if k < len(lb) else ''}")
        print(f"  {'[ocean words: %d]' % keyword_count(a):<{width}} | [ocean words: {keyword_count(b)}]")
    base_kw, base_proj, base_hit = summary["base"]
    print(f"\n=== measures ({len(NEUTRAL)} prompts x {args.tokens} tokens per arm, generated in {gen_s:.0f} s) ===")
    print(f"{'arm':<14} {'ocean words':>11} {'prompts w/ any':>14} {f'proj L{M}':>9} {'shift / gap':>11}")
    for arm, (kw, p, hit) in summary.items():
        print(f"{arm:<14} {kw:>11d} {f'{hit}/{len(NEUTRAL)}':>14} {p:>9.2f} {(p - base_proj) / gap_m:>11.2f}")
    kw, p, _ = summary[main_arm]
    moved = kw > base_kw and p > base_proj
    print(f"\nsteered toward the ocean: {'YES' if moved else 'NO'} (ocean words {base_kw} -> {kw}, "
          f"layer-{M} projection shift {(p - base_proj) / gap_m:+.2f} of the contrast gap)")
    return 0 if moved else 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="model dir (default: the embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--layer", default="13", help="steered layer(s), comma-separated")
    ap.add_argument("--scale", default="2", help="scale(s) of the CAA vector, comma-separated")
    ap.add_argument("--measure-layer", type=int, default=24, help="downstream layer for the projection measure")
    ap.add_argument("--name", default="ocean", help="name to register the vector under")
    ap.add_argument("--tokens", type=int, default=40)
    ap.add_argument("--eager", action="store_true", help="enforce_eager (faster start, slower steps)")
    ap.add_argument("--broker", help="use this broker (run dir) instead of one in this process")
    args = ap.parse_args(argv)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if args.model is None:
        from mia_stream.model import default_model_dir

        args.model = str(default_model_dir())
    if args.broker:
        os.environ["MIA_STREAM_BROKER"] = args.broker
        return run(args)
    from mia_stream.broker import run_broker_in_thread

    run_dir = tempfile.mkdtemp(prefix="mia-caa-", dir="/tmp")  # short: unix socket paths are limited
    os.environ["MIA_STREAM_BROKER"] = run_dir
    try:
        with run_broker_in_thread(address=run_dir):
            return run(args)
    finally:
        import shutil

        shutil.rmtree(run_dir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
