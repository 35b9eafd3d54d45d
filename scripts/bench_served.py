"""Served throughput and latency with and without capture: one ``mia-stream serve``, rows side by side.

    .venv/bin/python scripts/bench_served.py [--concurrency 8] [--prompt-words 48] [--max-tokens 32]
        [--rounds 8] [--enforce-eager] [--url URL --broker ADDR]   # the last two: an already running server

The topology a user runs: ``mia-stream serve`` (its broker, vLLM's OpenAI server and engine-core processes),
one consumer process iterating ``open_stream(broker, ["bench-*"])`` and this script as the HTTP client
(``openai.AsyncOpenAI``, streamed chat requests, ``ignore_eos`` so every request generates ``--max-tokens``).
A batch sends ``--concurrency`` requests of one row at once, each with a fresh random prompt (no prefix-cache
reuse). Rows:

- ``no spec``: the plugin is loaded but the request carries no ``mia_stream`` spec (what every other request
  on a mia_stream server pays);
- ``HS 1 layer``: hidden states of one layer at all positions;
- ``HS all layers, last_prompt``: every layer at the last prompt position;
- ``steer 1 layer``: one ``add`` op, no capture (tokens still stream).

Why the schedule: on a shared machine the throughput of one batch moves 2-3x with other jobs' load (earlier
runs of this script: 13.6-45.3 tok/s for one row), far more than the capture costs. So each round runs
``no spec`` between every other row (N X1 N X2 N X3 N, the X order rotating per round) and each X batch is
compared with the mean of the two ``no spec`` batches right before and after it (seconds apart: load that
drifts linearly cancels); a warm-up round (every row once, not counted) comes first. Reported per row:
the median over rounds of that ratio, with its interquartile range and min-max, for output throughput (the
batch's generated tokens over its wall time), the batch's median time to first token and its median request
latency; the medians over rounds of the rows' own tok/s, TTFT and latency; and, from the consumer process,
captured rows received / expected, frames lost (gap notices), and the lag from a frame's engine timestamp to the
consumer, p50/p99. The load average (1 min) is printed with every round.
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
    """Count what arrives per row (request ids ``bench-<row>-<round>.<slot>-<i>``) until SIGTERM, then write JSON."""
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


TAGS = {"no spec": "nospec", "HS 1 layer": "hs1", "HS all layers, last_prompt": "hsall", "steer 1 layer": "steer"}


async def _batch(client, model, row, rnd, slot, args, rng) -> dict:
    """``--concurrency`` requests of one row at once; its throughput, TTFTs and latencies."""
    t0 = time.perf_counter()
    results = await asyncio.gather(*(
        _one(client, model, f"bench-{'warm' if rnd == 'warm' else ''}{TAGS[row]}-{rnd}.{slot}-{i}", _random_prompt(rng, args.prompt_words),
             ROWS[row], args.max_tokens) for i in range(args.concurrency)))
    wall = time.perf_counter() - t0
    tokens = sum(r["tokens"] for r in results)
    ttft = [r["ttft"] for r in results if r["ttft"] is not None]
    lat = [r["latency"] for r in results]
    return {"wall": wall, "tokens": tokens, "tps": tokens / wall, "ttft": ttft, "latency": lat,
            "ttft_p50": float(np.median(ttft)) if ttft else float("nan"), "latency_p50": float(np.median(lat))}


def schedule(rnd: int) -> list[str]:
    """Round ``rnd``'s batches: ``no spec`` before, between and after the other rows, their order rotating."""
    others = [r for r in ROWS if r != "no spec"]
    k = rnd % len(others)
    out = ["no spec"]
    for row in others[k:] + others[:k]:
        out += [row, "no spec"]
    return out


def bracketed_ratios(batches: list[tuple[str, dict]], key: str) -> dict[str, float]:
    """Each non-baseline batch's ``key`` over the mean of the ``no spec`` batches just before and after it."""
    out = {}
    for i, (row, b) in enumerate(batches):
        if row == "no spec":
            continue
        before, after = batches[i - 1], batches[i + 1]
        assert before[0] == after[0] == "no spec", (before[0], after[0])
        out[row] = b[key] / ((before[1][key] + after[1][key]) / 2)
    return out


async def _bench(url: str, args) -> dict:
    import openai

    client = openai.AsyncOpenAI(base_url=url, api_key="EMPTY", max_retries=0)
    model = (await client.models.list()).data[0].id
    rng = np.random.default_rng(int(time.time()))
    # warm-up, not counted: first-use costs (vector upload, steering slots, sidecar start, compiled shapes)
    for row in ROWS:
        b = await _batch(client, model, row, "warm", 0, args, rng)
        print(f"warm-up {row}: {b['tps']:.1f} tok/s", flush=True)
    rounds = []
    for rnd in range(args.rounds):
        load0 = os.getloadavg()[0]
        batches = []
        for slot, row in enumerate(schedule(rnd)):
            batches.append((row, await _batch(client, model, row, rnd, slot, args, rng)))
        ratios = {k: bracketed_ratios(batches, k) for k in ("tps", "ttft_p50", "latency_p50")}
        rounds.append({"batches": batches, "ratios": ratios, "load": (load0, os.getloadavg()[0])})
        print(f"round {rnd} (load {load0:.1f} -> {os.getloadavg()[0]:.1f}): " + ", ".join(
            f"{row} {b['tps']:.1f}" for row, b in batches) + " tok/s; vs bracketing no spec: " + ", ".join(
            f"{row} {r:.3f}" for row, r in ratios["tps"].items()), flush=True)
    return {"rounds": rounds}


def _pct(values, q) -> float:
    values = [v for v in values if v is not None]
    return float(np.percentile(values, q)) if values else float("nan")


def _spread(values: list[float]) -> str:
    q1, med, q3 = np.percentile(values, [25, 50, 75])
    return f"{med:.3f} [{q1:.2f}-{q3:.2f}] ({min(values):.2f}-{max(values):.2f})"


def _report(results: dict, consumer: dict, args) -> str:
    rounds = results["rounds"]
    loads = [x for r in rounds for x in r["load"]]
    lines = [f"concurrency {args.concurrency}, prompt ~{args.prompt_words} random words, {args.max_tokens} generated "
             f"tokens per request, {len(rounds)} rounds of {len(schedule(0))} batches; load average (1 min) "
             f"{min(loads):.1f}-{max(loads):.1f} (median {np.median(loads):.1f}) during the rounds", "",
             "Ratios: each batch against the mean of the `no spec` batches just before and after it; median over "
             "rounds [interquartile range] (min-max).", "",
             "| row | output tok/s | tok/s ratio | TTFT p50 ratio | latency p50 ratio | TTFT p50 / p99 ms | "
             "latency p50 / p99 ms | rows received / expected | frames lost (gaps) | consumer lag p50 / p99 ms |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for row in ROWS:
        mine = [b for r in rounds for name, b in r["batches"] if name == row]
        tps = float(np.median([b["tps"] for b in mine]))
        ttft = [t for b in mine for t in b["ttft"]]
        lat = [t for b in mine for t in b["latency"]]
        if row == "no spec":
            ratio_cells = ["1", "1", "1"]
        else:
            ratio_cells = [_spread([r["ratios"][k][row] for r in rounds]) for k in ("tps", "ttft_p50", "latency_p50")]
        c = consumer.get(TAGS[row], {})
        captured = ROWS[row] is not None and "capture" in ROWS[row]
        got = f"{c.get('rows', 0)} / {c.get('expected', 0)}" if captured else "-"
        lag = c.get("lag_ms") or []
        lag_s = f"{_pct(lag, 50):.0f} / {_pct(lag, 99):.0f}" if captured else "-"
        lines.append(f"| {row} | {tps:.1f} | " + " | ".join(ratio_cells) +
                     f" | {_pct(ttft, 50) * 1e3:.0f} / {_pct(ttft, 99) * 1e3:.0f}"
                     f" | {_pct(lat, 50) * 1e3:.0f} / {_pct(lat, 99) * 1e3:.0f} | {got} | "
                     f"{c.get('lost', 0) if ROWS[row] is not None else '-'} | {lag_s} |")
    return "\n".join(lines)


def _wait_ready(proc: subprocess.Popen, log: Path, timeout: float) -> str:
    from mia_stream.served.serve import READY_PREFIX

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
    ap.add_argument("--rounds", type=int, default=8)
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
    finished = False
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
        finished = True
    finally:
        if consumer is not None and consumer.poll() is None:
            consumer.kill()
        if serve is not None:
            serve.send_signal(signal.SIGINT)
            try:
                serve.wait(120)
            except subprocess.TimeoutExpired:
                os.killpg(serve.pid, signal.SIGKILL)
        if finished and (serve is None or serve.returncode == 0):
            shutil.rmtree(tmp, ignore_errors=True)  # kept when the run or the server failed: its log is there
        else:
            print(f"server log kept in {tmp}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
