"""The monitor page (``mia-stream monitor``) in a real headless Chromium.

The browser is Debian's ``chromium`` (scripts/setup.sh installs it) driven by Playwright with ``executable_path``
pointing at it: nothing downloads a browser. The monitor, the broker's other consumers and the analyzer are
processes of their own, as users run them.

Scores come from a real analyzer process: ``mia-stream analyze token_probe --publish`` (the shipped token-level
hallucination probe): every step it publishes each generated token's ``risk`` (what the tokens are coloured by,
with its alerts), and at the end the answer's score (``answer_risk``), an alert when it reaches the threshold.
"""

from __future__ import annotations

import json
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
PY = sys.executable

# the layers the page's norm plot shows, with the one the shipped token probe reads
CAPTURE_LAYERS = sorted({0, 4, 8, 12, 16, 20, 24, 29, json.loads(
    (REPO / "mia_stream" / "analyzers" / "probes" / "token-probe-smollm2-135m.json").read_text())["layer"]})
# the per-token risk the page colours tokens by, and the request-level answer score published at the end
ANALYZER, SCORE, FINAL = "token_probe", "risk", "answer_risk"
# The page's latency target (tokens and scores shown within a second of their publication, issue 17) is measured
# by scripts/bench_monitor.py (token->page p50/p95/max), not asserted here: a loaded machine can miss it (1.41 s
# once on a shared 2-core machine, issue 24). The test asserts order and causality, and this generous bound.
BOUND_S = 10.0
CLOCK_SLACK_MS = 5  # the page's Date.now() is whole milliseconds; the producer's time_ns is not


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("MIA_STREAM_BROKER", None)
    return env


NO_CHROMIUM = Path(sys.prefix) / ".mia-stream-no-chromium"  # scripts/setup.sh writes why it could not install it


def chromium_path() -> str:
    """The system chromium. Missing, these tests skip only where scripts/setup.sh tried to install it and could
    not (it says why in the venv); anywhere else a missing browser is a failure, not a quiet skip."""
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is not None:
        return path
    if NO_CHROMIUM.is_file():
        pytest.skip(f"no chromium, and scripts/setup.sh could not install it: {NO_CHROMIUM.read_text().strip()}")
    pytest.fail("no chromium on PATH: run scripts/setup.sh (as root it installs Debian's chromium with apt) or "
                "apt-get install -y chromium")


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    args = ["--no-sandbox"] if os.geteuid() == 0 else []  # chromium refuses to run its sandbox as root
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=chromium_path(), args=args)
        try:
            yield b
        finally:
            b.close()


# ---------------------------------------------------------------------------------------------- processes

def _read_line(proc: subprocess.Popen, pattern: str, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        r, _, _ = select.select([proc.stdout], [], [], 0.1)
        if r:
            line = proc.stdout.readline()
            if re.search(pattern, line):
                return line
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[:4]} exited with {proc.returncode}: {proc.stderr.read()[-2000:]}")
    raise RuntimeError(f"{proc.args[:4]} printed no line matching {pattern!r} within {timeout} s")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


@contextmanager
def monitor(source: str, *args: str):
    """``mia-stream monitor`` as a process on a free port; yields its URL as printed (with its token: one is
    made at start unless --no-token) and the process. ``api(url, path)`` reaches its routes with that token."""
    proc = subprocess.Popen([PY, "-m", "mia_stream.cli", "monitor", "--source", source, "--port", "0", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())
    try:
        line = _read_line(proc, r"http://", 60)
        yield re.search(r"(http://\S+)", line).group(1), proc
    finally:
        _stop(proc)


@contextmanager
def scorer(address: str, patterns: str):
    """The analyzer process (``mia-stream analyze science_hallucination``); returns once it has subscribed."""
    proc = subprocess.Popen([PY, "-m", "mia_stream.cli", "analyze", ANALYZER, "--source", address, "--publish",
                             "--patterns", patterns],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())
    try:
        wait_for_consumer(address, f"analyzer:{ANALYZER}:{proc.pid}", process=proc)
        yield proc
    finally:
        _stop(proc)


def wait_for_consumer(address: str, prefix: str, timeout: float = 60, process=None) -> None:
    """Until the broker lists a consumer whose name starts with ``prefix`` (it has subscribed)."""
    from mia_stream.broker import fetch_stats

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(name.startswith(prefix) for name in fetch_stats(address)["consumers"]):
            return
        if process is not None and process.poll() is not None:
            raise AssertionError(f"{process.args[:5]} exited with {process.returncode}: {process.stderr.read()}")
        time.sleep(0.05)
    raise AssertionError(f"no consumer {prefix}* subscribed within {timeout} s")


# ---------------------------------------------------------------------------------------------- stream truth

class Truth:
    """What an independent SDK consumer saw: per request the tokens (with their publish time), the hidden-state
    norms per position and the analysis rows (with their publish time)."""

    def __init__(self):
        self.starts: dict = {}
        self.tokens: dict[str, list] = {}  # rid -> [(position, token id, step, time_ns)]
        self.norms: dict[str, dict] = {}  # rid -> position -> {layer: norm}
        self.scores: dict[str, dict] = {}  # rid -> position -> (score, alert, time_ns, step)
        self.final: dict[str, tuple] = {}  # rid -> (score, alert): the analyzer's end-of-request row
        self.ends: dict = {}

    def feed(self, ev) -> None:
        rid = ev.stream.request_id if ev.stream is not None else None
        if ev.kind == "start":
            self.starts[rid] = ev.start
        elif ev.kind == "tokens":
            t = ev.tokens
            self.tokens.setdefault(rid, []).extend((p, i, t.step, t.time_ns) for p, i in zip(t.positions, t.token_ids))
        elif ev.kind == "frame" and "hs" in ev.frame.raw_tensors:
            hs = ev.frame.tensors["hs"].astype(np.float64)
            norms = np.linalg.norm(hs, axis=2)
            for j, p in enumerate(ev.frame.positions):
                self.norms.setdefault(rid, {})[p] = dict(zip(ev.frame.layers["hs"], norms[:, j]))
        elif ev.kind == "analysis":
            a = ev.analysis
            per_token, final = a.values.get(SCORE), a.values.get(FINAL)
            for j, (p, al) in enumerate(zip(a.positions, a.alerts)):
                if p < 0 and final is not None:
                    self.final[a.request_id] = (float(final[j]), al)
                elif p >= 0 and per_token is not None:
                    self.scores.setdefault(a.request_id, {})[p] = (float(per_token[j]), al, a.time_ns, a.step)
        elif ev.kind == "end":
            self.ends[rid] = ev.end

    def complete(self, rids) -> bool:
        """Every request ended and the analyzer published its final result."""
        return all(r in self.ends and r in self.final for r in rids)

    def prompt_ids(self, rid: str) -> list:
        return list(self.starts[rid].prompt_token_ids)

    def token_ids(self, rid: str, max_step: int | None = None) -> list:
        return self.prompt_ids(rid) + [i for _p, i, s, _t in self.tokens.get(rid, [])
                                       if max_step is None or s <= max_step]


def collect(source: str, patterns: list, rids: list, timeout: float = 120) -> Truth:
    """Read ``source`` with the SDK until every request in ``rids`` is complete (see ``Truth.complete``)."""
    from mia_stream.consumers import open_stream

    truth = Truth()
    deadline = time.monotonic() + timeout
    with open_stream(source, patterns=patterns, from_start=True, timeout=timeout) as events:
        for ev in events:
            truth.feed(ev)
            if truth.complete(rids) or time.monotonic() > deadline:
                break
    return truth


class Collector(threading.Thread):
    """``collect`` on a thread, subscribed before it returns from ``start_collecting``."""

    def __init__(self, source: str, patterns: list, rids: list):
        super().__init__(daemon=True)
        from mia_stream.consumers import open_stream

        self.events = open_stream(source, patterns=patterns, from_start=True, timeout=120)
        self.rids, self.truth = rids, Truth()

    def run(self) -> None:
        with self.events:
            for ev in self.events:
                self.truth.feed(ev)
                if self.truth.complete(self.rids):
                    return


# ---------------------------------------------------------------------------------------------- the page

PAGE_DATA = """() => {
  const M = window.__mia, D = M.d;
  const spans = [...document.querySelectorAll('#text .tok')].map((s) => [+s.dataset.pos, s.textContent,
    s.dataset.score === undefined ? null : +s.dataset.score, M.shownAt[s.dataset.pos] ?? null,
    M.scoredAt[s.dataset.pos] ?? null, s.classList.contains('alert'), s.classList.contains('prompt')]);
  const norms = {};
  if (D) for (const [p, v] of D.norms) norms[p] = [D.layerSets[v[0]], v[1]];
  return {id: D ? D.id : null, state: D && D.info ? D.info.state : null,
    text: document.getElementById('text').textContent,
    spans, norms, info: document.getElementById('detail-info').textContent,
    alerts: [...document.querySelectorAll('#alerts li')].map((l) => l.textContent),
    broker: document.getElementById('broker-body').textContent, rows: [...M.rows.keys()],
    tick: M.tick, ticks: M.ticks, loaded: M.loaded, client: M.client, scoreKey: M.scoreKey,
    label: document.getElementById('tl-label').textContent};
}"""


# Screenshots are kept as test artifacts here (CI can upload the folder); docs/img/monitor.png is the live one.
ARTIFACTS = Path(os.environ.get("TEST_ARTIFACTS_DIR", REPO / "test-artifacts")) / "monitor"


def save_screenshot(page, name: str) -> Path:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    shot = ARTIFACTS / name
    page.screenshot(path=str(shot))
    assert shot.stat().st_size > 10_000, f"{shot}: an almost empty screenshot"
    return shot


def page_data(page) -> dict:
    return page.evaluate(PAGE_DATA)


def wait_page(page, predicate, timeout: float, what: str) -> dict:
    deadline = time.monotonic() + timeout
    data = page_data(page)
    while not predicate(data):
        if time.monotonic() > deadline:
            raise AssertionError(f"the page did not show {what} within {timeout} s; it shows: "
                                 f"{json.dumps({k: data[k] for k in ('id', 'state', 'text', 'info')})[:2000]}")
        time.sleep(0.05)
        data = page_data(page)
    return data


def api(url: str, path: str) -> tuple[str, dict]:
    """The address of route ``path`` of the monitor at ``url`` (as printed) and the headers carrying its token."""
    base, _, query = url.partition("?")
    token = re.search(r"token=([\w-]+)", query)
    return base + path, ({"Authorization": f"Bearer {token.group(1)}"} if token else {})


def wait_for_snapshot(url: str, predicate, timeout: float = 30) -> dict:
    import httpx

    deadline = time.monotonic() + timeout
    while True:
        address, headers = api(url, "api/snapshot")
        snap = httpx.get(address, headers=headers).json()
        if predicate(snap):
            return snap
        assert time.monotonic() < deadline, f"the monitor's snapshot never matched: {snap}"
        time.sleep(0.1)


def r4(v: float) -> float:
    return float(f"{v:.4g}")


def capture_spec(rid: str, **tags) -> dict:
    return {"capture": {"hidden_states": {"layers": CAPTURE_LAYERS, "positions": "all"}}, "id": rid, "tags": tags}


def check_scores(page_spans: list, truth_scores: dict) -> None:
    """Every scored position shows the analyzer's value (4 significant digits) and its alert mark."""
    by_pos = {s[0]: s for s in page_spans}
    for pos, (score, alert, _t, _step) in truth_scores.items():
        assert pos in by_pos, f"no token span at scored position {pos}"
        assert by_pos[pos][2] == pytest.approx(r4(score), rel=1e-3), (pos, by_pos[pos][2], score)
        assert by_pos[pos][5] == bool(alert), f"position {pos}: alert {alert}, page {by_pos[pos][5]}"


# ---------------------------------------------------------------------------------------------- tests

@pytest.mark.slow
def test_live_page_shows_tokens_and_scores_as_they_come(engine, broker_address, tokenizer, browser, tmp_path):
    """A real engine on the embedded model, the broker, the analyzer process and the monitor process: the page,
    opened on a request before it is sent, shows its text (detokenized on the server) token by token as it is
    generated (each after its publication, in position order), coloured by its score after the score's
    publication, the analyzer's alerts, per-layer norms equal to the captured hidden states' and the broker's
    counters. (How soon: scripts/bench_monitor.py measures token->page latency against the 1 s target.)"""
    from vllm import SamplingParams

    rids = ["mon-live-0", "mon-live-1", "mon-live-2"]
    prompts = ["Q: What is the chemical symbol of gold?\nA:", "Q: What is the atomic number of iron?\nA:",
               "Q: Which element has the chemical symbol W?\nA:"]
    with scorer(broker_address, "mon-live-*"), monitor(broker_address) as (url, _proc):
        page = browser.new_page(viewport={"width": 1280, "height": 720})
        errors: list = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(url + "#request=mon-live-0")
        wait_page(page, lambda d: d["client"] is not None, 30, "a connected event stream")
        wait_for_consumer(broker_address, "monitor-")
        collector = Collector(broker_address, ["mon-live-*"], rids)
        collector.start()
        params = [SamplingParams(max_tokens=40, temperature=0, extra_args={"mia_stream": capture_spec(
            rid, user=user, topic=topic)}) for rid, user, topic in zip(rids, ["alice", "bob", "carol"],
                                                                        ["gold", "iron", "tungsten"])]
        outputs = {}
        gen = threading.Thread(target=lambda: outputs.update(
            {o.request_id: o for o in engine.generate(prompts, params, use_tqdm=False)}))
        gen.start()
        gen.join(300)
        collector.join(120)
        truth = collector.truth
        assert truth.complete(rids), "the test's own consumer did not see every request end with its scores"
        rid = rids[0]
        n_scores = len(truth.scores[rid])
        # the analyzer's request-level row follows the stream's end: wait for it too
        data = wait_page(page, lambda d: d["state"] in ("stop", "length") and sum(s[2] is not None for s in d["spans"])
                         >= n_scores and f"{ANALYZER}.{FINAL} = " in d["info"], 30,
                         "the finished request with all its scores and the answer's score")
        # the text: the request's prompt and generated tokens, detokenized; it ends with what vLLM returned
        assert data["text"] == tokenizer.decode(truth.token_ids(rid))
        out_text = next(o.outputs[0].text for o in outputs.values() if o.prompt == prompts[0])
        assert out_text and tokenizer.decode(truth.token_ids(rid), skip_special_tokens=True).endswith(out_text)
        assert [s[0] for s in data["spans"]] == list(range(len(truth.token_ids(rid))))
        n_prompt = len(truth.prompt_ids(rid))
        assert all(s[6] == (s[0] < n_prompt) for s in data["spans"])  # prompt tokens are marked as such
        # each generated token was put on the page after the producer published it, the tokens in position order
        shown = {s[0]: s[3] for s in data["spans"]}
        token_delays = [shown[p] - t / 1e6 for p, _i, _s, t in truth.tokens[rid]]
        assert min(token_delays) >= -CLOCK_SLACK_MS and max(token_delays) <= BOUND_S * 1000, token_delays
        gen_shown = [shown[p] for p, _i, _s, _t in sorted(truth.tokens[rid])]
        assert gen_shown == sorted(gen_shown), gen_shown
        # the scores: the analyzer's values, coloured after their publication; alerts listed
        check_scores(data["spans"], truth.scores[rid])
        scored = {s[0]: s[4] for s in data["spans"]}
        score_delays = [scored[p] - t / 1e6 for p, (_v, _a, t, _s) in truth.scores[rid].items()]
        assert min(score_delays) >= -CLOCK_SLACK_MS and max(score_delays) <= BOUND_S * 1000, score_delays
        final, final_alert = truth.final[rid]  # the end row: a request-level result, and maybe an alert
        assert f"{ANALYZER}.{FINAL} = {r4(final)}" in data["info"]
        alerting = sorted(p for p, v in truth.scores[rid].items() if v[1])
        assert len(data["alerts"]) == len(alerting) + bool(final_alert)
        assert all(f"pos {p} · {ANALYZER}" in line for p, line in zip(alerting, data["alerts"]))
        assert not final_alert or data["alerts"][-1].startswith(f"request · {ANALYZER}: ")
        assert data["scoreKey"] == f"{ANALYZER}.{SCORE}"
        # per-layer norms: the captured hidden states' (computed here from the frames), at every position
        assert sorted(map(int, data["norms"])) == sorted(truth.norms[rid])
        for pos, (layers, values) in data["norms"].items():
            want = truth.norms[rid][int(pos)]
            assert layers == CAPTURE_LAYERS
            assert values == pytest.approx([want[layer] for layer in layers], rel=1e-3)
        # the list: every request with its tags and state; the broker panel: throughput and drops
        assert set(rids) <= set(data["rows"])
        row = page.locator("#requests tbody tr[data-id='mon-live-1']")
        assert "user=bob topic=iron" in row.inner_text()
        assert "frames/s" in data["broker"] and "consumer drops 0" in data["broker"]
        assert f"{ANALYZER}.{SCORE}" in page.locator("#score-key").inner_text()
        # choosing another request on the page shows that one
        row.click()
        data = wait_page(page, lambda d: d["id"] == "mon-live-1" and d["state"] in ("stop", "length")
                         and len(d["spans"]) == len(truth.token_ids("mon-live-1")), 10, "the second request")
        assert data["text"] == tokenizer.decode(truth.token_ids("mon-live-1"))
        check_scores(data["spans"], truth.scores["mon-live-1"])
        words = page.locator("#text .tok", has_text=re.compile(r"\w"))  # (a space or newline has no box to hover)
        words.nth(words.count() // 2).hover()  # the norm plot adds the hovered position
        page.locator("#requests tbody tr[data-id='mon-live-0']").click()
        wait_page(page, lambda d: d["id"] == "mon-live-0" and len(d["spans"]) > 0, 10, "the first request again")
        words.nth(words.count() - 4).hover()
        time.sleep(0.3)
        shot = save_screenshot(page, "monitor-live.png")
        print(f"screenshot: {shot}  (token delays ms: max {max(token_delays):.0f}, scores: "
              f"max {max(score_delays):.0f})")
        assert not errors, errors
        page.close()


@pytest.mark.slow
def test_recording_scrubs_to_a_step(engine, broker_address, tokenizer, browser, tmp_path):
    """A request recorded with its analysis stream (the recorder and the analyzer as processes), opened by the
    monitor: the timeline moves through the replay step by step, and at a step the page shows exactly the tokens
    generated up to it, the scores computed up to it, and the request as running; at the end, as finished."""
    from vllm import SamplingParams

    rid = "mon-rec-0"
    rec_dir = tmp_path / "rec"
    recorder = subprocess.Popen([PY, "-m", "mia_stream.cli", "record", str(rec_dir), "--broker", broker_address,
                                 "--patterns", "mon-rec-*"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                text=True, env=_env())
    try:
        with scorer(broker_address, "mon-rec-*"):
            wait_for_consumer(broker_address, "recorder")
            collector = Collector(broker_address, ["mon-rec-*"], [rid])
            collector.start()
            engine.generate(["Q: Name three primary colors.\nA:"], SamplingParams(
                max_tokens=20, temperature=0, extra_args={"mia_stream": capture_spec(rid, user="dave")}),
                use_tqdm=False)
            collector.join(120)
            assert collector.truth.complete([rid])
            time.sleep(1.0)  # the recorder has had the last analysis rows routed to it too
    finally:
        _stop(recorder)
    assert recorder.returncode == 0, recorder.stderr.read()[-2000:]
    truth = collect(str(rec_dir), ["*"], [rid])  # the recording, read back by the SDK: the reference
    assert truth.complete([rid])
    steps = sorted({s for _p, _i, s, _t in truth.tokens[rid]})
    assert len(steps) >= 10
    with monitor(str(rec_dir)) as (url, _proc):
        page = browser.new_page(viewport={"width": 1400, "height": 900})
        errors: list = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(url + f"#request={rid}")
        data = wait_page(page, lambda d: d["loaded"] and len(d["ticks"]) > 0 and d["state"] is not None, 60,
                         "the loaded recording")
        assert page.locator("#timeline").is_visible()
        ticks = data["ticks"]  # [time ms, step, producer]
        assert [t[1] for t in ticks] == sorted(t[1] for t in ticks) and {t[1] for t in ticks} >= set(steps)
        # at the end of the timeline: the whole request, finished
        assert data["state"] in ("stop", "length") and data["text"] == tokenizer.decode(truth.token_ids(rid))
        # scrub to a step in the middle (the slider), then one step on and back (the buttons)
        target = steps[len(steps) // 2]
        index = next(i for i, t in enumerate(ticks) if t[1] == target)
        page.locator("#tl-slider").evaluate("(el, v) => { el.value = v; el.dispatchEvent(new Event('input')); }",
                                            index)
        for button, step in ((None, target), ("#tl-next", ticks[index + 1][1]), ("#tl-prev", target)):
            if button:
                page.locator(button).click()
            want_ids = truth.token_ids(rid, max_step=step)
            data = wait_page(page, lambda d, n=len(want_ids), s=step: d["label"].startswith(f"step {s} ")
                             and len(d["spans"]) == n and d["state"] == "running", 10, f"step {step}")
            assert data["text"] == tokenizer.decode(want_ids)
            want_scores = {p: v for p, v in truth.scores[rid].items() if v[3] <= step}
            assert {s[0] for s in data["spans"] if s[2] is not None} == set(want_scores)
            check_scores(data["spans"], want_scores)
            assert len(data["alerts"]) == sum(1 for v in want_scores.values() if v[1])
            assert set(map(int, data["norms"])) == {p for p in truth.norms[rid] if p < len(want_ids) - 1}
        shot = save_screenshot(page, "monitor-recording.png")
        print(f"screenshot: {shot}")
        assert not errors, errors
        page.close()
    # the same recording cut in half (its recorder killed mid-write): what is complete is shown, and the cut said
    cut_dir = tmp_path / "cut"
    cut_dir.mkdir()
    parts = sorted(rec_dir.glob("*.mcap"))
    data = parts[-1].read_bytes()
    (cut_dir / parts[-1].name).write_bytes(data[: len(data) // 2])
    with monitor(str(cut_dir)) as (url, _proc):
        page = browser.new_page(viewport={"width": 1400, "height": 900})
        page.goto(url + f"#request={rid}")
        data = wait_page(page, lambda d: d["loaded"] and "cut short" in d["broker"], 60, "the cut recording loaded")
        assert parts[-1].name in data["broker"]
        assert page.locator("#broker-body .bad").count() == 1  # shown as a problem
        cut = collect(str(cut_dir), ["*"], [rid], timeout=30)  # what the SDK reads of it: the reference
        assert rid not in cut.ends
        if rid in cut.starts:  # (the cut may fall before the first complete chunk: then nothing is shown)
            want_ids = cut.token_ids(rid)
            assert len(want_ids) < len(truth.token_ids(rid))
            data = wait_page(page, lambda d: len(d["spans"]) == len(want_ids), 10, "the request's complete part")
            assert data["state"] == "running" and data["text"] == tokenizer.decode(want_ids)
        page.close()


# ---------------------------------------------------------------------------------------------- no engine

SYNTH_LAYERS, SYNTH_HIDDEN = (0, 1, 2, 3), 64


def _synthetic_load(address: str, model_dir: str, n: int, steps: int) -> dict:
    """A producer of ``n`` requests in step batches (the producer's 2.0 messages) plus an analyzer's results for
    every request each step, and the bad input a monitor must survive: a gap the producer announces, a NaN score,
    a result too wide to show, a request naming a tokenizer that does not exist, a result for a request that
    never started. Returns what was sent."""
    from tokenizers import Tokenizer

    from mia_stream.bus.publisher import FramePublisher
    from mia_stream.schemas import (AnalysisBatch, GapNotice, RowGroup, StepBatch, StreamEnd, StreamStart, Tensor,
                                    TokenBatch)

    tok = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
    words = tok.encode("Monitoring many requests at once: the page keeps up, and each token is coloured by "
                       "its score while the broker counts what it drops.").ids
    rng = np.random.default_rng(0)
    pub = FramePublisher(address, producer_id="synthetic-engine", shm_bytes=0)
    ana = FramePublisher(address, producer_id="synthetic-analyzer", shm_bytes=0)
    deadline = time.monotonic() + 10
    while (pub.broker_instance is None or ana.broker_instance is None) and time.monotonic() < deadline:
        time.sleep(0.01)
    rids = [f"req-{i:04d}" for i in range(n)]
    sent = {"tokens": {r: [] for r in rids}, "scores": {r: {} for r in rids}, "prompt": words[:4]}
    for i, rid in enumerate(rids):
        model = "/no/such/tokenizer" if rid == "req-0002" else model_dir  # (a stream's model dir is the fallback)
        pub.publish(StreamStart(rid, pub.producer_id, pub.epoch, pub.next_seq(rid), model=model, tokenizer=model,
                                num_layers=4, hidden_size=SYNTH_HIDDEN,
                                prompt_token_ids=words[:4], tags={"batch": str(i % 4)}, time_ns=time.time_ns()))
    for step in range(steps):
        now = time.time_ns()
        pos = 4 + step
        hs = rng.standard_normal((len(SYNTH_LAYERS), n, SYNTH_HIDDEN)).astype(np.float32)
        if step == 3:  # the producer drops req-0001's frames of this step and says so
            lost = pub.next_seq("req-0001")
            pub.publish(GapNotice("req-0001", pub.producer_id, pub.epoch, [[lost, lost]], "aperture_full",
                                  "producer", now))
        pub.publish(StepBatch(pub.producer_id, pub.epoch, step, rids, [pub.next_seq(r) for r in rids],
                              [RowGroup(np.arange(n), np.ones(n), np.full(n, pos - 1),
                                        [Tensor("hs", "float32", hs.shape, hs, SYNTH_LAYERS)])], time_ns=now))
        ids = np.array([words[(pos + i) % len(words)] for i in range(n)], dtype=np.int64)
        pub.publish(TokenBatch(pub.producer_id, pub.epoch, step, rids, [pub.next_seq(r) for r in rids],
                               token_ids=ids, first_positions=np.full(n, pos), time_ns=now))
        for i, rid in enumerate(rids):
            sent["tokens"][rid].append(int(ids[i]))
        risk = rng.random(n).astype(np.float32)
        if step == 5:
            risk[0] = np.nan  # req-0000's score at this position is not a number
        names = rids + (["ghost-1"] if step == 0 else [])
        values = {"risk": np.append(risk, 0.5).astype(np.float32) if step == 0 else risk}
        if step == 1:
            values["embedding"] = rng.standard_normal((n, 4096)).astype(np.float32)  # too wide to show
        ana.publish(AnalysisBatch(ana.producer_id, ana.epoch, "synthetic", names, [ana.next_seq(r) for r in names],
                                  positions=np.full(len(names), pos - 1), values=values,
                                  alerts=values["risk"] > 0.98, step=step, time_ns=time.time_ns(),
                                  source_time_ns=now))
        for i, rid in enumerate(rids):
            sent["scores"][rid][pos - 1] = float(risk[i])
        time.sleep(0.05)
    for rid in rids:
        pub.publish(StreamEnd(rid, pub.producer_id, pub.epoch, pub.next_seq(rid), "length", 4, steps,
                              time_ns=time.time_ns()))
    pub.flush(10)
    ana.flush(10)
    pub.close(5)
    ana.close(5)
    return sent


def test_the_page_lists_256_requests_and_reports_bad_input(browser, model_dir, tokenizer, tmp_path):
    """256 requests in step batches through a real broker process: the page lists every one, shows the chosen
    one's text and scores, and reports bad input without breaking: the producer's announced gap as a drop with its
    reason, a NaN score as uncoloured, a stream whose tokenizer does not exist with token ids and the reason, a
    result for a request that never started as "no start", an unknown request as unknown."""
    from bus_helpers import run_dir, start_broker

    n, steps = 256, 12
    with run_dir() as address:
        broker = start_broker(address)
        try:
            with monitor(address) as (url, _proc):
                page = browser.new_page(viewport={"width": 1400, "height": 900})
                errors: list = []
                page.on("pageerror", lambda e: errors.append(str(e)))
                page.goto(url + "#request=req-0000")
                wait_page(page, lambda d: d["client"] is not None, 30, "a connected event stream")
                wait_for_consumer(address, "monitor-")
                sent = _synthetic_load(address, model_dir, n, steps)
                want = sent["prompt"] + sent["tokens"]["req-0000"]
                data = wait_page(page, lambda d: d["state"] == "length" and len(d["spans"]) == len(want)
                                 and len(d["rows"]) == n + 1, 60, "every request, and req-0000 finished")
                assert data["text"] == tokenizer.decode(want)
                scores = {p: v for p, v in sent["scores"]["req-0000"].items() if v == v}
                assert {s[0]: s[2] for s in data["spans"] if s[2] is not None} == pytest.approx(
                    {p: r4(v) for p, v in scores.items()}, rel=1e-3)
                assert len(scores) == steps - 1  # the NaN one is not coloured, and nothing broke
                shot = save_screenshot(page, "monitor-256.png")
                print(f"screenshot: {shot}")
                row = page.locator("#requests tbody tr[data-id='ghost-1']")
                assert "no start" in row.inner_text()
                # the list is virtual (only the rows in view are in the page): the oldest request is reached by
                # scrolling to the bottom, as a user would
                assert page.locator("#requests tbody tr[data-id='req-0000']").count() == 0
                page.locator(".table-wrap").evaluate("(el) => { el.scrollTop = el.scrollHeight; }")
                page.locator("#requests tbody tr[data-id='req-0000']").wait_for(state="visible", timeout=5000)
                assert page.locator("#requests tbody tr[data-id='req-0255']").count() == 0
                page.locator(".table-wrap").evaluate("(el) => { el.scrollTop = 0; }")
                page.locator("#requests tbody tr[data-id='req-0255']").wait_for(state="visible", timeout=5000)
                # the announced gap: one message dropped, counted in the list and named in the detail
                page.locator("#filter").fill("req-0001")
                page.locator("#requests tbody tr[data-id='req-0001']").click()
                data = wait_page(page, lambda d: d["id"] == "req-0001" and d["state"] == "length", 10, "req-0001")
                assert "drops 1" in data["info"] and "1 aperture_full (producer)" in data["info"]
                cells = page.locator("#requests tbody tr[data-id='req-0001'] td").all_inner_texts()
                assert cells[6] == "1"
                # a tokenizer that cannot be loaded: ids shown, and why
                page.locator("#filter").fill("req-0002")
                page.locator("#requests tbody tr[data-id='req-0002']").click()
                data = wait_page(page, lambda d: d["id"] == "req-0002" and d["state"] == "length", 10, "req-0002")
                assert data["text"].split() == [f"#{i}" for i in sent["prompt"] + sent["tokens"]["req-0002"]]
                assert "cannot load tokenizer '/no/such/tokenizer'" in data["info"]
                # filtering the list by tag
                page.locator("#filter").fill("batch=3")
                assert page.locator("#counts").inner_text().endswith(f"{n // 4} shown of {n + 1}")
                visible = page.locator("#requests tbody tr:not(.pad):visible")
                assert 20 <= visible.count() < n // 4  # the rows in view, all of batch 3
                assert all(t == "batch=3" for t in visible.evaluate_all("(rs) => rs.map((r) => r.children[1].title)"))
                page.locator(".table-wrap").evaluate("(el) => { el.scrollTop = el.scrollHeight; }")
                page.locator("#requests tbody tr[data-id='req-0003']").wait_for(state="visible", timeout=5000)
                # an id the monitor never saw
                page.goto(url + "#request=nope")
                page.reload()
                wait_page(page, lambda d: "not known" in d["info"], 10, "an unknown request")
                assert not errors, errors
                page.close()
        finally:
            broker.terminate()
            broker.wait(10)


def test_a_token_guards_every_request_beyond_loopback(browser, tmp_path):
    """Bound beyond loopback, the monitor makes up a token and serves nothing without it (as it does on loopback
    by default: tests/test_monitor_security.py); on loopback with --no-token it serves only loopback Host names
    (no DNS rebinding). Bad arguments are one-line errors."""
    import httpx

    from bus_helpers import run_dir, start_broker

    with run_dir() as address:
        broker = start_broker(address)
        try:
            with monitor(address, "--host", "0.0.0.0") as (url, _proc):
                token = re.search(r"token=([\w-]+)", url).group(1)
                assert len(token) >= 24
                base = url.split("?")[0].replace("0.0.0.0", "127.0.0.1")
                for path in ("", "static/monitor.js", "api/snapshot", "api/ticks"):
                    assert httpx.get(base + path).status_code == 401
                    assert httpx.get(base + path, params={"token": "wrong-token"}).status_code == 401
                    assert httpx.get(base + path, headers={"Authorization": f"Bearer {token}"}).status_code == 200
                r = httpx.get(base, params={"token": token})
                port = base.rsplit(":", 1)[1].strip("/")
                cookie = f"mia_monitor_token_{port}"  # one per port: two monitors keep their own
                assert r.status_code == 200 and r.cookies.get(cookie) == token
                assert httpx.get(base + "api/snapshot", cookies={cookie: token}).status_code == 200
                assert httpx.post(base + "api/view", json={"client": "x"}).status_code == 401
                page = browser.new_page()
                page.goto(base + f"?token={token}")  # the cookie then carries it for the event stream
                data = wait_page(page, lambda d: d["client"] is not None, 30, "a connected event stream")
                assert data["rows"] == []
                page.close()
            with monitor(address, "--no-token") as (url, _proc):
                assert "token" not in url
                assert httpx.get(url).status_code == 200
                port = url.rsplit(":", 1)[1].strip("/")
                assert httpx.get(url, headers={"Host": f"evil.example:{port}"}).status_code == 403
                assert httpx.get(url, headers={"Host": f"localhost:{port}"}).status_code == 200
        finally:
            broker.terminate()
            broker.wait(10)
    with monitor(str(tmp_path)) as (url, _proc):  # a directory holding no recording: said, the server stays
        note = wait_for_snapshot(url, lambda s: "holds no .mcap files" in (s["overview"]["note"] or ""))
        assert note["overview"]["note"].startswith("reading the source failed: RecordingError")
        assert note["overview"]["note_is_problem"]
    garbage = tmp_path / "garbage"
    garbage.mkdir()
    (garbage / "part-00000.mcap").write_bytes(b"not a recording at all" * 100)
    with monitor(str(garbage)) as (url, _proc):  # a file that is no MCAP: said, the server stays
        note = wait_for_snapshot(url, lambda s: "is not an MCAP file" in (s["overview"]["note"] or ""))
        assert note["overview"]["note"].startswith("reading the source failed: RecordingError")
        assert httpx.get(url).status_code == 200  # the printed URL, token and all
    for args, message in ((["--source", "/no/such/dir"], "is neither a broker run dir nor a recording"),
                          (["--source", str(tmp_path), "--token", "short"], "--token must be at least 8")):
        r = subprocess.run([PY, "-m", "mia_stream.cli", "monitor", *args], capture_output=True, text=True, env=_env(),
                           timeout=60)
        assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr


def test_tokens_go_out_as_ids_while_their_tokenizer_loads(model_dir, tokenizer, monkeypatch):
    """A request's tokens are not held back while its tokenizer loads (0.3-1.5 s here): they are sent as ids,
    then the request is sent again whole, as text, once it has loaded. (The load is held on an event to make the
    order certain; the tokenizer and the state are the real ones.)"""
    from mia_stream.monitor import _detok
    from mia_stream.monitor._state import MonitorState
    from mia_stream.schemas import StreamStart

    release, real_load = threading.Event(), _detok._load
    monkeypatch.setattr(_detok, "_load", lambda name: (release.wait(30), real_load(name))[1])
    st = MonitorState()
    prompt = tokenizer.encode("The capital of France is")
    st.on_start(StreamStart("r", "p", 1, 0, model=model_dir, tokenizer=model_dir, num_layers=30, hidden_size=576,
                            prompt_token_ids=prompt, tags={}, time_ns=time.time_ns()))
    gen = tokenizer.encode(" Paris.", add_special_tokens=False)
    st.on_token_columns("p", 0, time.time_ns(), ["r"], [0, len(gen)], gen, [])
    rec = st.requests["r"]
    out, cursor = st.detail(rec, None, None)
    assert [t[1] for t in out["tokens"]] == [f"#{i} " for i in prompt + gen]
    assert out["info"]["detok_note"].startswith("loading tokenizer")
    out, cursor = st.detail(rec, None, cursor)  # nothing new while it loads
    assert not out["reset"] and out["tokens"] == []
    release.set()
    deadline = time.monotonic() + 30
    while st.tokenizers.lookup(model_dir)[0] is None and time.monotonic() < deadline:
        time.sleep(0.05)
    out, cursor = st.detail(rec, None, cursor)  # loaded: everything again, as text
    assert out["reset"] and "".join(t[1] for t in out["tokens"]) == tokenizer.decode(prompt + gen)
    assert out["info"]["detok_note"] is None
