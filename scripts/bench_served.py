"""Served throughput and latency with and without capture: one ``mia-stream serve``, rows side by side.

    .venv/bin/python scripts/bench_served.py [--concurrency 8] [--prompt-words 48] [--max-tokens 32]
        [--rounds 3] [--enforce-eager] [--url URL --broker ADDR]   # the last two: an already running server

The topology a user runs: ``mia-stream serve`` (its broker, vLLM's OpenAI server and engine-core processes),
one consumer process iterating ``open_stream(broker, ["bench-*"])`` and this script as the HTTP client
(``openai.AsyncOpenAI``, streamed chat requests, ``ignore_eos`` so every request generates ``--max-tokens``).
Each round sends ``--concurrency`` requests at once for every row, rows in a rotating order; every request of
every round has a fresh random prompt (no prefix-cache reuse). Rows:

- ``no spec``: the plugin is loaded but the request carries no ``mia_stream`` spec (what every other request
  on a mia_stream server pays);
- ``HS 1 layer``: hidden states of one layer at all positions;
- ``HS all layers, last_prompt``: every layer at the last prompt position;
- ``steer 1 layer``: one ``add`` op, no capture (tokens still stream).

Printed per row (medians over rounds): output tokens/s of the round (all requests' generated tokens over the
round's wall time) and its ratio to ``no spec``; the median of per-round ratios (each round's row against the
same round's ``no spec``: they ran seconds apart, so load that changes between rounds cancels); time to first token and request latency p50/p99 (all rounds'
requests); and from the consumer process: captured rows received / expected, rows lost (gaps), and the lag
from a frame's engine timestamp to the consumer, p50/p99.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ROWS = {
    "no spec": None,
    "HS 1 layer": {"capture": {"hidden_states": {"layers": [15], "positions": "all"}}},
    "HS all layers, last_prompt": {"capture": {"hidden_states": {"layers": "all", "positions": "last_prompt"}}},
    "steer 1 layer": {"steer": [{"layer": 15, "op": "add", "vector": [0.01] * 576, "scale": 1.0}]},
}
_SYLLABLES = ["ka", "lo", "mi", "ne", "ru", "sa", "to", "vi", "zu", "pe", "da", "fo", "gi", "ha", "ju", "be"]


def _random_prompt(rng: np.random.Generator, words: int) -> str:
    text = " ".join("".join(rng.choice(_SYLLABLES, size=rng.integers(1, 4))) for _ in range(words))
    return f"Repeat these words and continue the list: {text}"


# ------------------------------------------------------------------------------------------ consumer process
def consumer_main(address: str, out: str) -> None:
    """Count what arrives per row (request ids ``bench-<row>-<round>-<i>``) until SIGTERM, then write JSON."""
    from mia_stream.consumers import open_stream

    def _stop(*_):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _stop)
    stats: dict = {}
    try:
        with open_stream(address, patterns=["bench-*"], from_start=True) as es:
            print("ready", flush=True)
            for ev in es:
                row = ev.stream.request_id.split("-")[1]
                s = stats.setdefault(row, {"rows": 0, "lost": 0, "ends": 0, "lag_ms": [], "expected": 0})
                if ev.kind == "frame":
                    n = len(ev.frame.positions)
                    s["rows"] += n
                    s["lag_ms"].append((time.time_ns() - ev.frame.time_ns) / 1e6)
                elif ev.kind == "gap":
                    s["lost"] += sum(b - a + 1 for a, b in ev.gap.missing)
                elif ev.kind == "end":
                    s["ends"] += 1
                    cap = ev.stream.start.capture.get("hidden_states") if ev.stream.start else None
                    if cap:
                        p, g = ev.end.num_prompt_tokens, ev.end.num_generated_tokens
                        s["expected"] += {"all": p + g - 1, "last_prompt": 1, "prompt": p,
                                          "generated": g - 1}[cap["positions"]]
    except KeyboardInterrupt:
        pass
    Path(out).write_text(json.dumps(stats))


# ------------------------------------------------------------------------------------------ client
async def _one(client, model: str, rid: str, prompt: str, spec: dict | None, max_tokens: int) -> dict:
    body = {"ignore_eos": True}
    if spec is not None:
        body["vllm_xargs"] = {"mia_stream": json.dumps(dict(spec, id=rid))}
    t0 = time.perf_counter()
    first, n = None, 0
    stream = await client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens, temperature=0,
        stream=True, stream_options={"include_usage": True}, extra_body=body)
    async for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].delta.content:
            first = time.perf_counter() - t0
        if chunk.usage is not None:
            n = chunk.usage.completion_tokens
    return {"ttft": first, "latency": time.perf_counter() - t0, "tokens": n}


async def _round(client, model, row, spec, rnd, args, rng) -> dict:
    key = row.split()[0] if row != "HS all layers, last_prompt" else "HSall"
    tag = {"no": "nospec", "HS": "hs1", "HSall": "hsall", "steer": "steer"}[key]
    t0 = time.perf_counter()
    results = await asyncio.gather(*(
        _one(client, model, f"bench-{tag}-{rnd}-{i}", _random_prompt(rng, args.prompt_words), spec,
             args.max_tokens) for i in range(args.concurrency)))
    wall = time.perf_counter() - t0
    return {"wall": wall, "tokens": sum(r["tokens"] for r in results), "ttft": [r["ttft"] for r in results],
            "latency": [r["latency"] for r in results]}


async def _bench(url: str, args) -> dict:
    import openai

    client = openai.AsyncOpenAI(base_url=url, api_key="EMPTY", max_retries=0)
    model = (await client.models.list()).data[0].id
    rng = np.random.default_rng(int(time.time()))
    # warm-up: one request per row (first-use costs: vector upload, steering slots, sidecar start)
    for row, spec in ROWS.items():
        await _one(client, model, f"bench-warm-{row[:2]}", _random_prompt(rng, 8), spec, 4)
    out = {row: [] for row in ROWS}
    names = list(ROWS)
    for rnd in range(args.rounds):
        order = names[rnd % len(names):] + names[:rnd % len(names)]
        for row in order:
            out[row].append(await _round(client, model, row, ROWS[row], rnd, args, rng))
            print(f"round {rnd} {row}: {out[row][-1]['tokens'] / out[row][-1]['wall']:.1f} tok/s", flush=True)
    return out


def _pct(values, q) -> float:
    values = [v for v in values if v is not None]
    return float(np.percentile(values, q)) if values else float("nan")


def _report(results: dict, consumer: dict, args) -> str:
    tags = {"no spec": "nospec", "HS 1 layer": "hs1", "HS all layers, last_prompt": "hsall",
            "steer 1 layer": "steer"}
    base = np.median([r["tokens"] / r["wall"] for r in results["no spec"]])
    lines = [f"concurrency {args.concurrency}, prompt ~{args.prompt_words} random words, {args.max_tokens} generated "
             f"tokens per request, {args.rounds} rounds (medians of rounds; latencies over all requests)", "",
             "| row | output tok/s | vs no spec | per-round ratio, median [min-max] | TTFT p50 / p99 ms | "
             "latency p50 / p99 ms | rows received / expected | rows lost | consumer lag p50 / p99 ms |",
             "|---|---|---|---|---|---|---|---|---|"]
    for row, rounds in results.items():
        tps = float(np.median([r["tokens"] / r["wall"] for r in rounds]))
        ttft = [t for r in rounds for t in r["ttft"]]
        lat = [t for r in rounds for t in r["latency"]]
        c = consumer.get(tags[row], {})
        captured = ROWS[row] is not None and "capture" in ROWS[row]
        got = f"{c.get('rows', 0)} / {c.get('expected', 0)}" if captured else "-"
        lag = c.get("lag_ms") or []
        lag_s = f"{_pct(lag, 50):.0f} / {_pct(lag, 99):.0f}" if captured else "-"
        # each round's row against the same round's no-spec row: the two ran seconds apart, under the same load
        ratios = [(r["tokens"] / r["wall"]) / (b["tokens"] / b["wall"]) for r, b in zip(rounds, results["no spec"])]
        per_round = f"{np.median(ratios):.3f} [{min(ratios):.2f}-{max(ratios):.2f}]"
        lines.append(f"| {row} | {tps:.1f} | {tps / base:.3f} | {per_round} | "
                     f"{_pct(ttft, 50) * 1e3:.0f} / {_pct(ttft, 99) * 1e3:.0f}"
                     f" | {_pct(lat, 50) * 1e3:.0f} / {_pct(lat, 99) * 1e3:.0f} | {got} | "
                     f"{c.get('lost', 0) if ROWS[row] is not None else '-'} | {lag_s} |")
    return "\n".join(lines)


def _wait_ready(proc: subprocess.Popen, log: Path, timeout: float) -> str:
    from mia_stream.serve import READY_PREFIX

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in log.read_text(errors="replace").splitlines():
            if line.startswith(READY_PREFIX):
                return line
        if proc.poll() is not None:
            raise SystemExit(f"mia-stream serve exited ({proc.returncode}); see {log}")
        time.sleep(1)
    raise SystemExit(f"mia-stream serve not ready in {timeout} s; see {log}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--prompt-words", type=int, default=48)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--enforce-eager", action="store_true", help="start the server without torch.compile")
    ap.add_argument("--url", help="an already running mia-stream server's /v1 URL (with --broker)")
    ap.add_argument("--broker", help="that server's broker address")
    ap.add_argument("--consumer", nargs=2, metavar=("ADDRESS", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.consumer:
        consumer_main(*args.consumer)
        return 0
    tmp = Path(tempfile.mkdtemp(prefix="mia-bench-served-", dir="/tmp"))
    serve = consumer = None
    try:
        if args.url:
            url, address = args.url, args.broker
        else:
            import socket

            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            address, log = str(tmp / "run"), tmp / "serve.log"
            cmd = [sys.executable, "-m", "mia_stream.cli", "serve", "--address", address, "--port", str(port),
                   "--max-model-len", "2048", "--seed", "0"] + (["--enforce-eager"] if args.enforce_eager else [])
            print("$", " ".join(cmd), flush=True)
            t0 = time.monotonic()
            serve = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True)
            print(_wait_ready(serve, log, 900), f"({time.monotonic() - t0:.0f} s)", flush=True)
            url = f"http://127.0.0.1:{port}/v1"
        out = tmp / "consumer.json"
        consumer = subprocess.Popen([sys.executable, __file__, "--consumer", address, str(out)],
                                    stdout=subprocess.PIPE, text=True)
        assert consumer.stdout.readline().strip() == "ready"
        results = asyncio.run(_bench(url, args))
        time.sleep(2)  # the last frames reach the consumer
        consumer.send_signal(signal.SIGTERM)
        consumer.wait(30)
        print()
        print(_report(results, json.loads(out.read_text()), args))
    finally:
        if consumer is not None and consumer.poll() is None:
            consumer.kill()
        if serve is not None:
            serve.send_signal(signal.SIGINT)
            try:
                serve.wait(120)
            except subprocess.TimeoutExpired:
                os.killpg(serve.pid, signal.SIGKILL)
        if serve is None or serve.returncode == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # kept when the server failed: its log is there
        else:
            print(f"server log kept in {tmp}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
