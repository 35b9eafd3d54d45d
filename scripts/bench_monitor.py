"""The monitor page at serving load: does it keep up with 256 live requests, and what does it cost?

    .venv/bin/python scripts/bench_monitor.py                          # 10 and 30 steps/s, 20 s each
    .venv/bin/python scripts/bench_monitor.py --rates 100 --seconds 10

Topology, every part a process as users run them: a broker; the synthetic producer of scripts/bench_load.py
(256 requests, 8B geometry: per request and step one 4096-wide bf16 hidden-state row, all 32 layers at its
prompt step; each request lives ``--tokens`` steps and is replaced; step batches); an analyzer publishing a risk
per request and step (``analysis`` messages, from each row's norm); ``mia-stream monitor`` (``--tokenizer`` the
embedded model's, whose vocabulary the producer's random ids fall in); a headless chromium (the system's, driven
by Playwright) showing the page with a running request chosen, picking the newest running request every 3 s.

Reported per rate, over the measured window (after a warm-up):
- monitor CPU: utime+stime of the monitor process / wall time (100% = one core), per request-step it took in
  (its tokens counter), and its private memory (USS; its RSS also counts the producer's ring pages it read);
- broker drops for the monitor's consumer (it fell behind) and the analysis rows it took in;
- the page: token -> page latency for the chosen request (producer's publish time to the moment its text is in
  the page, p50/p95/max), updates received per second, time to apply one update (p50/p95/max; and the part spent
  on the request list's rows, in updates that carry rows), bytes pushed per second; click -> text latency (a
  request picked in the list until its text shows);
- the lag column of every running request at the end (bus latency to the monitor, p50/max);
- chromium's CPU (all its processes).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import select
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from _procs import stop_processes  # noqa: E402  (scripts/_procs.py, beside this file)
_TICK = os.sysconf("SC_CLK_TCK")


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICK


def _private_mb(pid: int) -> float:
    """Unique set size: the process's own memory (RSS also counts the producer's ring pages it has read)."""
    import psutil

    return psutil.Process(pid).memory_full_info().uss / 2**20


# ---------------------------------------------------------------------------------------------- analyzer

def analyze(a: argparse.Namespace) -> None:
    """One ``risk`` per captured row, in [0, 1) (the rows are random bits, so any formula is as good)."""
    from mia_stream.consumers import open_batches
    from mia_stream.bus.publisher import FramePublisher
    from mia_stream.schemas import AnalysisBatch

    pub = FramePublisher(a.address, producer_id=f"bench-risk-{os.getpid()}", shm_bytes=0)
    deadline = time.monotonic() + 10
    while pub.broker_instance is None and time.monotonic() < deadline:
        time.sleep(0.01)

    def stop(*_):
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, stop)
    events = open_batches(a.address, patterns=["*"], consumer_id=f"bench-risk-{os.getpid()}")
    print("ready", flush=True)
    try:
        for ev in events:
            if ev.kind != "batch" or ev.batch.KIND != "step_batch":
                continue
            b = ev.batch
            for g in b.groups:
                if not g.has("hs"):
                    continue
                hs = g.tensor("hs").numpy()[-1]  # [N, H]: the last captured layer (read, as an analyzer would)
                finite = np.isfinite(hs).mean(axis=1)  # the producer's rows are random bf16 bits: not a real norm
                risk = np.modf(g.positions * 0.618034 + finite * 7.0)[0].astype(np.float32)  # spread over [0, 1)
                rids = [b.request_ids[i] for i in g.requests.tolist()]
                pub.publish(AnalysisBatch(pub.producer_id, pub.epoch, "bench_risk", rids,
                                          [pub.next_seq(r) for r in rids], rows=g.rows, positions=g.positions,
                                          values={"risk": risk}, alerts=risk > 0.99, step=b.step,
                                          time_ns=time.time_ns(), source_time_ns=b.time_ns))
    finally:
        events.close()
        pub.close(2)


# ---------------------------------------------------------------------------------------------- orchestration

def _spawn(args: list[str], env: dict, ready: str, timeout: float = 60) -> tuple[subprocess.Popen, str]:
    p = subprocess.Popen(args, stdout=subprocess.PIPE, text=True, env=env)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if select.select([p.stdout], [], [], 0.2)[0]:
            line = p.stdout.readline()
            if re.search(ready, line):
                return p, line
        if p.poll() is not None:
            break
    p.kill()
    raise RuntimeError(f"{args[:4]} did not start")


def _chromium_cpu_s() -> float:
    import psutil

    total = 0.0
    for c in psutil.Process().children(recursive=True):
        try:
            if "chrom" in c.name():
                t = c.cpu_times()
                total += t.user + t.system
        except psutil.Error:
            pass
    return total


PICK_NEWEST = """() => {
  const row = [...document.querySelectorAll('#requests tbody tr:not(.pad)')].find((tr) => !tr.hidden
    && tr.children[2].textContent === 'running' && !tr.classList.contains('selected'));
  if (!row) return null;
  window.__pick = {id: row.dataset.id, t0: performance.now(), t1: null};
  row.click();
  return row.dataset.id;
}"""
PICKED = """() => { const p = window.__pick, M = window.__mia;
  if (!p || p.t1 !== null || !M.d || M.d.id !== p.id || !M.d.tokens.length) return null;
  p.t1 = performance.now();
  return p.t1 - p.t0; }"""


def run_one(rate: float, a: argparse.Namespace, browser) -> dict:
    from mia_stream.broker import fetch_stats
    from mia_stream.model import default_model_dir

    env = dict(os.environ, PYTHONPATH=str(REPO))
    run_dir = tempfile.mkdtemp(prefix="mia-mon-", dir="/tmp")
    procs: list[subprocess.Popen] = []
    py = sys.executable
    try:
        broker, _ = _spawn([py, "-m", "mia_stream.broker", "--address", run_dir], env, "ready")
        procs.append(broker)
        mon, line = _spawn([py, "-m", "mia_stream.cli", "monitor", "--source", run_dir, "--port", "0",
                            "--tokenizer", str(default_model_dir())], env, "http://")
        procs.append(mon)
        url = re.search(r"(http://\S+)", line).group(1)
        ana, _ = _spawn([py, __file__, "analyze", "--address", run_dir], env, "ready")
        procs.append(ana)
        page = browser.new_page(viewport={"width": 1400, "height": 900})
        page.goto(url)
        page.wait_for_function("() => window.__mia.client !== null", timeout=30_000)
        prod, _ = _spawn([py, str(REPO / "scripts" / "bench_load.py"), "produce", "--address", run_dir, "--path",
                          "batch", "--rate", str(rate), "--seconds", str(a.seconds + a.warmup + 10), "--requests",
                          str(a.requests), "--tokens", str(a.tokens)], env, "ready")
        procs.append(prod)
        t_end = time.monotonic() + a.warmup
        while time.monotonic() < t_end and page.evaluate(PICK_NEWEST) is None:
            time.sleep(0.2)
        time.sleep(max(0.0, t_end - time.monotonic()))
        page.evaluate("() => { window.__mia.latency = []; window.__mia.renderMs = []; window.__mia.listMs = []; "
                      "window.__mia.updates = 0; "
                      "window.__pick = null; }")
        stats0 = json.loads(page.evaluate("async () => JSON.stringify(await (await fetch('api/stats')).json())"))
        cpu0, chrome0, t0 = _cpu_s(mon.pid), _chromium_cpu_s(), time.monotonic()
        latency: list = []
        clicks: list = []
        next_pick = t0 + 3
        while time.monotonic() < t0 + a.seconds and prod.poll() is None:
            picked = page.evaluate(PICKED)
            if picked is not None:
                clicks.append(picked)
            if time.monotonic() >= next_pick:
                latency += page.evaluate("() => window.__mia.latency.splice(0)")
                page.evaluate(PICK_NEWEST)
                next_pick += 3
            time.sleep(0.05)
        wall = time.monotonic() - t0
        cpu, chrome = _cpu_s(mon.pid) - cpu0, _chromium_cpu_s() - chrome0
        latency += page.evaluate("() => window.__mia.latency.splice(0)")
        render = page.evaluate("() => window.__mia.renderMs")
        list_ms = page.evaluate("() => window.__mia.listMs || []")
        updates = page.evaluate("() => window.__mia.updates")
        stats1 = json.loads(page.evaluate("async () => JSON.stringify(await (await fetch('api/stats')).json())"))
        snap = json.loads(page.evaluate("async () => JSON.stringify(await (await fetch('api/snapshot')).json())"))
        lags = [r[7] for r in snap["rows"] if r[2] == "running" and r[7] is not None]
        try:
            cons = fetch_stats(run_dir, timeout=10)["consumers"]
        except Exception as e:  # a broker too busy to answer is itself a result
            cons = {"monitor-?": {"dropped": f"unknown ({e})"}}
        mon_cons = next((c for name, c in cons.items() if name.startswith("monitor-")), {})
        rss = _private_mb(mon.pid)
        ingested = stats1["counters"].get("tokens", 0) - stats0["counters"].get("tokens", 0)  # one per request-step
        page.close()
        pct = lambda xs, q: float(np.percentile(xs, q)) if len(xs) else float("nan")  # noqa: E731
        return {"rate": rate, "wall_s": wall, "load_average": os.getloadavg()[0],
                "monitor_cpu_pct": 100 * cpu / wall, "monitor_private_mb": rss,
                "ingested_request_steps": ingested, "cpu_us_per_request_step": 1e6 * cpu / max(ingested, 1),
                "chromium_cpu_pct": 100 * chrome / wall,
                "token_to_page_ms": [pct(latency, 50), pct(latency, 95), max(latency, default=float("nan"))],
                "tokens_measured": len(latency), "updates_per_s": updates / wall,
                "apply_ms": [pct(render, 50), pct(render, 95), max(render, default=float("nan"))],
                "list_rows_ms": [pct(list_ms, 50), pct(list_ms, 95), max(list_ms, default=float("nan"))],
                "pushed_kb_per_s": (stats1["push_bytes"] - stats0["push_bytes"]) / wall / 1024,
                "click_to_text_ms": clicks, "lag_ms_running": [pct(lags, 50), max(lags, default=float("nan"))],
                "running": len(lags), "broker_dropped_for_monitor": mon_cons.get("dropped"),
                "monitor_counters": stats1["counters"]}
    finally:
        stop_processes(reversed(procs))


def report(r: dict) -> str:
    f = lambda xs: "/".join(f"{x:.0f}" for x in xs)  # noqa: E731
    clicks = r["click_to_text_ms"]
    return (f"{r['rate']:g} steps/s x {r['running']} running requests, {r['wall_s']:.1f} s measured "
            f"(load average {r['load_average']:.1f}):\n"
            f"    monitor CPU {r['monitor_cpu_pct']:.0f}% of a core ({r['cpu_us_per_request_step']:.0f} us per "
            f"request-step taken in, {r['ingested_request_steps']} of them), private memory "
            f"{r['monitor_private_mb']:.0f} MB; broker dropped {r['broker_dropped_for_monitor']} messages for it; "
            f"chromium CPU {r['chromium_cpu_pct']:.0f}%\n"
            f"    page: token->page p50/p95/max {f(r['token_to_page_ms'])} ms ({r['tokens_measured']} tokens), "
            f"{r['updates_per_s']:.1f} updates/s, apply p50/p95/max {'/'.join(f'{x:.1f}' for x in r['apply_ms'])} ms, "
            f"{r['pushed_kb_per_s']:.0f} KiB/s pushed; of which the list's rows p50/p95/max "
            f"{'/'.join(f'{x:.1f}' for x in r['list_rows_ms'])} ms\n"
            f"    click->text {', '.join(f'{x:.0f}' for x in clicks) or '-'} ms; lag of running requests p50/max "
            f"{f(r['lag_ms_running'])} ms; analysis rows taken in {r['monitor_counters'].get('analysis_rows', 0)}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["analyze"]:
        ap = argparse.ArgumentParser()
        ap.add_argument("--address", required=True)
        analyze(ap.parse_args(argv[1:]))
        return 0
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rates", default="10,30", help="producer steps/s (comma list)")
    ap.add_argument("--seconds", type=float, default=20, help="measured window per rate")
    ap.add_argument("--warmup", type=float, default=4)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=64, help="steps each request lives")
    ap.add_argument("--json", help="also write the results here")
    a = ap.parse_args(argv)
    import shutil

    from playwright.sync_api import sync_playwright

    results = []
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=shutil.which("chromium") or "chromium",
                                     args=["--no-sandbox"] if os.geteuid() == 0 else [])
        for rate in [float(x) for x in a.rates.split(",")]:
            r = run_one(rate, a, browser)
            results.append(r)
            print(report(r), flush=True)
        browser.close()
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
