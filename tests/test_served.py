"""Served mode end to end, with real processes: ``mia-stream serve`` (broker, recorder and vLLM's OpenAI server
with the plugin, each its own process) and an analyzer process (``mia-stream analyze hidden_states --publish``),
then a plain vLLM server without mia_stream, both on the embedded model (CPU, float32, eager, greedy, seed 0).
The official ``openai`` client and ``StreamClient`` talk to them.

Two server lifetimes per run, one after the other (module fixture; the tests run in file order): 8-9 minutes
on the shared 2 cores at load average 10-40 (about 4 on a quieter machine); the analyzer's part is about 20 s
of it (its process start, the replay run).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from mia_stream.served.serve import READY_PREFIX, parse_args, vllm_console_script_works, vllm_server_command

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
TOL = 1e-4  # float32 engine vs float32 HF, relative to the layer's largest value (as in test_producer)
SERVER_ARGS = ["--enforce-eager", "--max-model-len", "1024", "--seed", "0", "--max-num-seqs", "8"]

# Every invalid spec the offline path refuses (tests/test_producer.py), as JSON over HTTP, and the words
# the 400 must carry. (The offline list's {"f32": bytes} vector cannot travel as JSON; a string in its place
# is refused the same way.)
BAD_SPECS = [
    ({"capture": {"hidden_states": {"layers": [99]}}}, "layer 99 is out of range"),
    ({"capture": {"hiden_states": {}}}, "unknown key"),
    ({"capture": {"qk": {"layers": [0], "heads": [9]}}}, "head 9 is out of range"),
    ({"capture": {"hidden_states": {"positions": "middle"}}}, "must be one of"),
    ({"steer": [{"layer": 3, "op": "add", "vector": [1.0, 2.0]}]}, "hidden size is 576"),
    ({"steer": [{"layer": 3, "op": "add", "vector": {"name": "no-such-vector"}}]}, "no registered vector"),
    ({"steer": [{"layer": 3, "op": "add", "vector": {"f32": "AAAA"}}]}, "must hold 576 float32 values"),
    ({"steer": [{"layer": 3, "op": "add", "vector": [True] * 576}]}, "must be a list of numbers"),
    ({"steer": [{"layer": 3, "op": "add", "vector": [0.5] * 575 + [True]}]}, "must be a list of numbers"),
    ({"detect": [{"probe": "no-such-probe"}]}, "no such probe"),
    ({"detect": [{"probe": "token-probe-smollm2-135m.json", "alert": {"mode": "loud"}}]}, "alert.mode"),
    ("{not json", "not valid JSON"),
    (7, "must be an object"),
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Proc:
    """A server process whose output goes to a log file; ``wait_for`` polls the log for a line."""

    def __init__(self, name: str, cmd: list[str], env: dict, log_dir: Path):
        self.name, self.log = name, log_dir / f"{name}.log"
        self._fh = open(self.log, "w")
        self.proc = subprocess.Popen(cmd, env=env, stdout=self._fh, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_for(self, predicate, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            text = self.text()
            hit = predicate(text)
            if hit:
                return hit
            if self.proc.poll() is not None:
                raise AssertionError(f"{self.name} exited ({self.proc.returncode}):\n{text[-4000:]}")
            time.sleep(0.5)
        raise AssertionError(f"{self.name} not ready in {timeout} s:\n{self.text()[-4000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGINT)
                self.proc.wait(60)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self._fh.close()


def _http_ready(url: str) -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


class Servers:
    def __init__(self, tmp: Path, model_dir: str):
        self.tmp = tmp
        self.address = str(tmp / "run")
        self.recording = str(tmp / "rec")
        self.port, self.plain_port = _free_port(), _free_port()
        env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
                   VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1",
                   MIA_STREAM_HOST_RING_MB="128")  # default 512: a shared 24 GiB machine, a few small captures
        env.pop("MIA_STREAM_BROKER", None)
        self.env, self.model_dir = env, model_dir
        self.serve = _Proc("serve", [sys.executable, "-m", "mia_stream.cli", "serve", model_dir, "--address",
                                     self.address, "--record", self.recording, "--port", str(self.port),
                                     *SERVER_ARGS], env, tmp)
        ready = self.serve.wait_for(
            lambda t: next((ln for ln in t.splitlines() if ln.startswith(READY_PREFIX)), None), 900)
        self.ready_line = ready
        self.pids = {k: int(v) for k, v in (kv.split("=") for kv in ready.split("pids:")[1].split())}
        self.url = f"http://127.0.0.1:{self.port}/v1"
        self.plain_url = f"http://127.0.0.1:{self.plain_port}/v1"
        self.plain = None

    def start_plain(self) -> None:
        """The same vLLM command line without the plugin (MIA_STREAM_BROKER unset); started after the mia_stream
        server stopped (two engines at once risk the OOM killer on this shared 24 GiB machine)."""
        cfg = parse_args([self.model_dir, "--port", str(self.plain_port), *SERVER_ARGS])
        self.plain = _Proc("plain", vllm_server_command(cfg.model, ["--host", "127.0.0.1", "--port",
                                                                    str(self.plain_port), *cfg.vllm_args]),
                           self.env, self.tmp)
        self.plain.wait_for(lambda t: _http_ready(f"http://127.0.0.1:{self.plain_port}/health"), 900)

    def stop(self) -> None:
        self.serve.stop()
        if self.plain is not None:
            self.plain.stop()


@pytest.fixture(scope="module")
def servers(model_dir):
    tmp = Path(tempfile.mkdtemp(prefix="mia-served-", dir="/tmp"))
    s = Servers(tmp, model_dir)
    try:
        yield s
    finally:
        s.stop()
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)


def _openai(url: str, **kw):
    import openai

    return openai.OpenAI(base_url=url, api_key="EMPTY", **kw)


MODEL = "SmolLM2-135M-Instruct"


# ------------------------------------------------------------------------------------------ the 400 path
def test_bad_spec_is_a_400_with_the_reason_and_the_server_keeps_serving(servers):
    import openai

    client = _openai(servers.url, max_retries=0)
    for spec, words in BAD_SPECS:
        raw = spec if isinstance(spec, str) else json.dumps(spec) if isinstance(spec, dict) else spec
        calls = {
            "chat": lambda s: client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2, stream=s,
                extra_body={"vllm_xargs": {"mia_stream": raw}}),
            "completion": lambda s: client.completions.create(
                model=MODEL, prompt="Hi", max_tokens=2, stream=s, extra_body={"vllm_xargs": {"mia_stream": raw}}),
        }
        for endpoint, call in calls.items():
            for stream in (False, True):
                with pytest.raises(openai.BadRequestError) as err:
                    result = call(stream)
                    if stream:
                        list(result)
                assert err.value.status_code == 400, (spec, endpoint, stream)
                message = err.value.body["message"]
                assert message.startswith("mia_stream: extra_args['mia_stream']") and words in message, message
                assert err.value.body["param"] == "mia_stream"
    # a 400 is not retried by the official client (its default retries 500s twice): one request, one answer
    counting = _openai(servers.url)  # default max_retries=2
    before = servers.serve.text().count('"POST /v1/chat/completions HTTP/1.1" 400')
    with pytest.raises(openai.BadRequestError):
        counting.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
                                         extra_body={"vllm_xargs": {"mia_stream": json.dumps(BAD_SPECS[0][0])}})
    time.sleep(0.5)
    assert servers.serve.text().count('"POST /v1/chat/completions HTTP/1.1" 400') == before + 1
    ok = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                        temperature=0)
    assert ok.choices[0].message.content


# ------------------------------------------------------------------------------------------ concurrent run
PROMPT_A = [{"role": "user", "content": "What is the capital of France?"}]
PROMPT_B = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Name a primary color."}]
PROMPT_C = [{"role": "user", "content": "Write one sentence about the ocean."}]
PROMPT_E = [{"role": "user", "content": "Count from one to five."}]


def _steer_vector() -> list[float]:
    return (np.random.default_rng(7).standard_normal(576) * 1.0).tolist()


def _requests(tokenizer):
    """name -> (kind, prompt, kwargs): streamed and not, chat and completion, different captures, one steered."""
    from mia_stream.spans import chat_spans

    return {
        "A": ("chat", PROMPT_A, dict(stream=True, capture={"hidden_states": {"layers": [0, 29], "positions": "all"}},
                                     request_id="ana-A", analyzers=[ANALYZER])),
        "B": ("chat", PROMPT_B, dict(stream=False, capture={"qk": {"layers": [3], "heads": [0, 1],
                                                                   "positions": "last_prompt"}})),
        "C": ("chat", PROMPT_C, dict(stream=True, capture={"hidden_states": {"layers": [10], "positions": "generated"}},
                                     steer=[{"layer": 10, "op": "add", "vector": _steer_vector(), "scale": 8.0}])),
        "D": ("chat", PROMPT_C, dict(stream=False, tags={"user": "d"})),  # C's prompt, unsteered, no capture
        "E": ("completion", chat_spans(tokenizer, PROMPT_E).token_ids,
              dict(stream=True, capture={"hidden_states": {"layers": [5], "positions": "prompt"}})),
    }


# The analyzer process: per-token norms of request A's captured layers, published back onto the bus.
ANALYZER = "hidden_states"
ANALYZER_CONFIG = {"layers": [0, 29], "positions": "all"}


def _analyze_cmd(config: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "mia_stream.cli", "analyze", ANALYZER, "--config", str(config), "--patterns",
            "ana-*", *args]


def _wait_subscribed(address: str, prefix: str, proc: subprocess.Popen, timeout: float = 60) -> None:
    from mia_stream.broker import fetch_stats

    deadline = time.monotonic() + timeout
    while not any(c.startswith(prefix) for c in fetch_stats(address)["consumers"]):
        assert proc.poll() is None, proc.communicate()[1]
        assert time.monotonic() < deadline, f"{prefix} did not subscribe"
        time.sleep(0.2)


@pytest.fixture(scope="module")
def concurrent_run(servers, tokenizer):
    """The five requests sent at once through StreamClient (one thread each), with the analyzer process running
    on the live broker (it analyzes request A, "ana-*"); their ServedRequests and events. The analyzer's printed
    results, stderr and exit status go to ``servers.live_analysis``."""
    from mia_stream.served.client import StreamClient

    config = servers.tmp / "analyzer.json"
    config.write_text(json.dumps(ANALYZER_CONFIG))
    servers.analyzer_config = config
    analyzer = subprocess.Popen(_analyze_cmd(config, "--source", servers.address, "--publish", "--print",
                                             "--max-streams", "1", "--idle-timeout", "300"),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=servers.env)
    try:
        _wait_subscribed(servers.address, f"analyzer:{ANALYZER}:", analyzer)
        client = StreamClient(servers.url, broker=servers.address, max_retries=0)
        reqs = {}
        for name, (kind, prompt, kw) in _requests(tokenizer).items():
            send = client.chat if kind == "chat" else client.completion
            reqs[name] = send(prompt, max_tokens=12, temperature=0, keep_frames=True, **kw)
        events: dict = {name: [] for name in reqs}
        errors = []

        def run(name):
            try:
                for ev in reqs[name]:
                    events[name].append(ev)
            except Exception as e:  # noqa: BLE001
                errors.append((name, e))

        threads = [threading.Thread(target=run, args=(n,)) for n in reqs]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        assert not errors, errors
        out, err = analyzer.communicate(timeout=120)  # --max-streams 1: it exits after request A's end
        servers.live_analysis = (out, err, analyzer.returncode)
    finally:
        if analyzer.poll() is None:
            analyzer.kill()
            analyzer.wait()
    return reqs, events


def _expected_positions(mode: str, prompt_len: int, generated: int) -> list[int]:
    return {"all": list(range(prompt_len + generated - 1)), "prompt": list(range(prompt_len)),
            "generated": list(range(prompt_len, prompt_len + generated - 1)), "last_prompt": [prompt_len - 1]}[mode]


def test_each_request_streams_complete_and_in_order(concurrent_run, tokenizer):
    from mia_stream.spans import chat_spans

    reqs, events = concurrent_run
    specs = _requests(tokenizer)
    for name, req in reqs.items():
        kind, prompt, kw = specs[name]
        kinds = [e.kind for e in events[name]]
        assert kinds.count("start") == 1 and kinds.count("end") == 1 and kinds.count("response") == 1, name
        assert kinds.index("start") < kinds.index("end"), name
        bus = [e for e in events[name] if e.bus is not None and e.kind != "analysis"]  # analysis: after the end
        assert bus[0].kind == "start" and bus[-1].kind == "end", name
        assert req.gaps == [] and req.end.frames_dropped == 0, (name, req.gaps)
        assert req.end.finish_reason == req.finish_reason, name
        start = req.stream.start
        prompt_ids = prompt if kind == "completion" else chat_spans(tokenizer, prompt).token_ids
        assert start.prompt_token_ids == prompt_ids, name  # the span helper's tokens are the served ones
        generated = req.stream.generated_token_ids
        assert len(generated) == req.end.num_generated_tokens > 0, name
        assert tokenizer.decode(generated, skip_special_tokens=True) == req.text, name
        steps = [f.step for f in req.frames]
        assert steps == sorted(set(steps)), name  # one frame per step, in step order
        cap = kw.get("capture")
        if not cap:
            assert req.frames == [], name
            continue
        which = "hidden_states" if "hidden_states" in cap else "qk"
        positions = [p for f in req.frames for p in f.positions]
        assert positions == _expected_positions(cap[which]["positions"], len(prompt_ids), len(generated)), name
        # rows follow the request's own tokens: prompt + generated, each row's input token
        full = list(prompt_ids) + list(generated)
        assert [t for f in req.frames for t in f.token_ids] == [full[p] for p in positions], name
    assert reqs["A"].frames[0].tensors["hs"].shape[0] == 2
    assert len(reqs["A"].frames) == 1 + reqs["A"].end.num_generated_tokens - 1  # prefill + each decode step
    assert reqs["C"].stream.start.steering and reqs["C"].frames[0].steering_version == 1


def test_captured_tensors_match_hugging_face(concurrent_run, hf_model):
    from producer_helpers import hf_trace, rel_err

    reqs, _ = concurrent_run
    a = reqs["A"]
    full = list(a.stream.start.prompt_token_ids) + list(a.stream.generated_token_ids)
    ref_hs, ref_q, _, _ = hf_trace(hf_model, full[:-1])
    hs = np.concatenate([f.tensors["hs"] for f in a.frames], axis=1)  # [2, positions, 576]
    assert rel_err(hs, ref_hs[[0, 29]]).max() < TOL
    b = reqs["B"]
    (frame,) = b.frames
    p = len(b.stream.start.prompt_token_ids) - 1
    _, ref_q, _, _ = hf_trace(hf_model, list(b.stream.start.prompt_token_ids))
    assert rel_err(frame.tensors["q"][0], ref_q[3][p:p + 1, [0, 1]]).max() < TOL


def _recorded(servers, live) -> tuple:
    """``live``'s request replayed from the recording once it holds its end and as many analysis results
    (the recorder writes a chunk at least every second)."""
    from mia_stream.served.client import StreamClient

    rec = StreamClient.recording(servers.recording)
    deadline = time.monotonic() + 30
    while True:
        replay = rec.open(live.request_id, keep_frames=True)
        replayed = list(replay)
        if replay.end is not None and len(replay.analyses) >= len(live.analyses):
            return replay, replayed
        assert time.monotonic() < deadline, (live.request_id, replay.end, len(replay.analyses))
        time.sleep(1)


def test_the_recording_replays_the_same_frames(concurrent_run, servers):
    reqs, events = concurrent_run
    for name, live in reqs.items():
        replay, replayed = _recorded(servers, live)
        # every bus event in the same order, the analyzer's "analysis" events (request A) included
        assert [e.kind for e in replayed if e.bus is not None] == [e.kind for e in events[name] if e.bus is not None]
        assert len(replay.frames) == len(live.frames), name
        for a, b in zip(live.frames, replay.frames):
            assert (a.step, a.positions, a.token_ids, a.steering_version) == \
                (b.step, b.positions, b.token_ids, b.steering_version)
            assert a.tensors.keys() == b.tensors.keys()
            for k in a.tensors:
                assert np.array_equal(a.tensors[k], b.tensors[k]), (name, k)
        assert replay.end.num_generated_tokens == live.end.num_generated_tokens
        assert replay.stream.generated_token_ids == live.stream.generated_token_ids
        assert replay.text == live.text, name  # decoded from the recorded tokens


def _results(stdout: str) -> list[dict]:
    return [json.loads(line) for line in stdout.splitlines()]


def test_an_analyzer_process_gives_the_same_results_live_and_on_the_recording(concurrent_run, servers, hf_model):
    """The analyzer process ran on the live broker with --publish: its results reached request A's StreamClient
    as "analysis" events (per step, then the final row after the end: the client waited for it), they equal
    Hugging Face's hidden-state norms of A's tokens, the recorder recorded them, and the same command run on
    the recording prints byte-identical results."""
    from producer_helpers import hf_trace, rel_err

    from mia_stream.analyzers._runner import result_dict

    reqs, events = concurrent_run
    out, err, rc = servers.live_analysis
    assert rc == 0, err
    assert f"mia-stream analyze {ANALYZER}: 1 request(s)" in err and "0 rejected, 0 seqs lost" in err, err
    live = _results(out)
    a = reqs["A"]
    assert {r["request_id"] for r in live} == {"ana-A"}
    # what the client received through the broker == what the analyzer printed, in order, final row last
    received = [result_dict(x) for x in a.analyses]
    assert received == live and received[-1]["step"] == -1
    assert [e.kind for e in events["A"] if e.bus is not None][-1] == "analysis"  # it came after the end
    assert all(not reqs[n].analyses for n in reqs if n != "A")  # the analyzer's patterns: "ana-*" only

    # the results are HF's: per-token norms of layers 0 and 29, mean and last state at the end
    full = list(a.stream.start.prompt_token_ids) + list(a.stream.generated_token_ids)
    ref_hs = hf_trace(hf_model, full[:-1])[0][[0, 29]].astype(np.float64)  # [2, positions, 576]
    steps = [r for r in live if r["step"] >= 0]
    assert [p for r in steps for p in r["positions"]] == list(range(len(full) - 1))
    norms = np.concatenate([np.asarray(r["values"]["norm"]) for r in steps])  # [positions, 2]
    assert rel_err(norms.T, np.linalg.norm(ref_hs, axis=-1)).max() < TOL
    assert rel_err(np.asarray(live[-1]["values"]["mean"][0]), ref_hs.mean(axis=1)).max() < TOL
    assert rel_err(np.asarray(live[-1]["values"]["last"][0]), ref_hs[:, -1]).max() < TOL

    # the recording holds the published results; the same analyzer replayed on it prints the same bytes
    replay, _ = _recorded(servers, a)
    assert [result_dict(x) for x in replay.analyses] == live
    again = subprocess.run(_analyze_cmd(servers.analyzer_config, "--source", servers.recording),
                           capture_output=True, text=True, env=servers.env, timeout=300)
    assert again.returncode == 0, again.stderr
    assert again.stdout == out


# ------------------------------------------------------------------------------------------ more clients
def test_async_client_streams_concurrent_requests(servers, concurrent_run):
    from mia_stream.served.client import AsyncStreamClient

    reqs, _ = concurrent_run

    async def main():
        client = AsyncStreamClient(servers.url, broker=servers.address, max_retries=0)
        a = client.chat(PROMPT_A, capture={"hidden_states": {"layers": [29], "positions": "last_prompt"}},
                        max_tokens=12, temperature=0, stream=True)
        d = client.chat(PROMPT_C, capture={"hidden_states": {"layers": [1], "positions": "generated"}},
                        max_tokens=12, temperature=0, stream=False)
        return await asyncio.gather(a.collect(), d.collect())

    a, d = asyncio.run(main())
    assert a.text == reqs["A"].text and d.text == reqs["D"].text
    assert [f.positions for f in a.frames] == [[len(a.stream.start.prompt_token_ids) - 1]]
    n = d.end.num_generated_tokens
    assert [p for f in d.frames for p in f.positions] == _expected_positions(
        "generated", len(d.stream.start.prompt_token_ids), n)
    # the same prompt's last-prompt row as request A captured at all positions
    from producer_helpers import rel_err

    a_all = reqs["A"].frames[0].tensors["hs"][1, -1]
    assert rel_err(a.frames[0].tensors["hs"][0, 0][None], a_all[None]).max() < 1e-5


def test_stream_id_without_an_id_in_the_spec_is_the_response_id(servers):
    """A plain openai call whose spec sets no id: the stream is named by the response's id (chat) or the
    response's id + "-<prompt index>" (completions)."""
    from mia_stream.consumers import open_stream

    client = _openai(servers.url, max_retries=0)
    spec = json.dumps({"capture": {"hidden_states": {"layers": [2], "positions": "last_prompt"}}})
    seen: dict = {}
    with open_stream(servers.address, patterns=["chatcmpl-*", "cmpl-*"], from_start=True, timeout=60) as es:
        chat = client.chat.completions.create(model=MODEL, messages=PROMPT_A, max_tokens=3,
                                              extra_body={"vllm_xargs": {"mia_stream": spec}})
        chunks = list(client.completions.create(model=MODEL, prompt="Hello", max_tokens=3, stream=True,
                                                extra_body={"vllm_xargs": {"mia_stream": spec}}))
        want = {chat.id, f"{chunks[0].id}-0"}
        for ev in es:
            seen.setdefault(ev.stream.request_id, []).append(ev)
            if want <= {r for r, evs in seen.items() if any(e.kind == "end" for e in evs)}:
                break
    assert want <= set(seen)
    start = seen[chat.id][0].start
    # what the worker sees: vLLM's internal id, the external one plus a random suffix
    assert start.engine_request_id.startswith(chat.id + "-")


def test_stream_client_detect_scores_in_the_engine_and_aborts_on_alert(servers):
    """Served mode with an in-engine detector (``StreamClient.chat(detect=...)`` through ``vllm_xargs``): the
    request's events carry the engine's scores (``engine:token_probe``) with no capture, and an alert debounced to
    the second generated row (2 hot rows of 2; every row is hot at threshold 0) aborts it in the engine: its answer
    is the three tokens sampled up to the alerting step. The scores come from the engine core, the stream's end
    from the worker's drain: the client waits for the detector's final result (step -1, sent after its last score
    row on the same channel), so the alerting step's scores are there too."""
    from mia_stream.served.client import StreamClient

    client = StreamClient(servers.url, broker=servers.address, max_retries=0)
    detect = [{"probe": "token-probe-smollm2-135m.json",
               "alert": {"threshold": 0.0, "mode": "tokens", "window": 2, "min_hits": 2}, "action": "abort"}]
    req = client.chat(PROMPT_A, max_tokens=12, temperature=0, detect=detect, request_id="served-detect-1",
                      stream=False)
    events = list(req)
    analyses = [e.bus.analysis for e in events if e.kind == "analysis"]
    response = next(e.response for e in events if e.kind == "response")
    assert response.choices[0].finish_reason == "abort" and response.usage.completion_tokens == 3
    scores = [a for a in analyses if a.analyzer == "engine:token_probe" and a.step >= 0]
    assert len(scores) == 2 and all(len(a.positions) == 1 for a in scores)  # both generated rows scored
    assert [int(a.alerts[0]) for a in scores] == [0, 1]  # the second hot row alerts (debounced)
    (final,) = [a for a in analyses if a.analyzer == "engine:token_probe" and a.step == -1]
    assert final.values["max_risk"][0] == max(float(a.values["risk"][0]) for a in scores)
    assert final.values["alert_rows"].tolist() == [1]
    assert not any(e.kind == "frame" for e in events)


def test_vllm_console_script_on_the_cpu_build():
    """The CPU build's `vllm` console script cannot start (its distribution is named vllm-cpu), so serve uses
    the api_server module there; where `vllm` is installed, `vllm serve`."""
    import importlib.metadata

    vllm_bin = Path(sys.executable).parent / "vllm"
    cmd = vllm_server_command("/m", ["--port", "1"])
    try:
        importlib.metadata.version("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("not the CPU build")
    assert not vllm_console_script_works()
    assert cmd[1:4] == ["-m", "vllm.entrypoints.openai.api_server", "--model"]
    if vllm_bin.exists():
        out = subprocess.run([str(vllm_bin), "--version"], capture_output=True, text=True, timeout=120)
        assert out.returncode != 0 and "PackageNotFoundError" in out.stderr


def test_abandoned_streamed_request_is_aborted(servers):
    """Closing a StreamClient request mid-way closes its HTTP stream: vLLM aborts it and the stream ends."""
    from mia_stream.served.client import StreamClient

    client = StreamClient(servers.url, broker=servers.address, max_retries=0, idle_timeout=3)
    req = client.chat(PROMPT_C, capture={"hidden_states": {"layers": [4], "positions": "generated"}},
                      max_tokens=400, temperature=0, request_id="abandon-1", extra_body={"ignore_eos": True})
    texts = 0
    with req:
        for ev in req:
            texts += ev.kind == "text"
            if texts >= 3:
                break
    watcher = client.open("abandon-1", keep_frames=True).collect()  # someone else's request, from its start
    assert watcher.end.finish_reason == "abort" and watcher.end.num_generated_tokens < 400
    # contiguous generated rows, each fed the token generated there; an abort lands after the last generated
    # token was fed back, so its row may be there too (at a normal end, the last token has no row)
    p0, generated = len(watcher.stream.start.prompt_token_ids), watcher.stream.generated_token_ids
    positions = [p for f in watcher.frames for p in f.positions]
    assert positions == list(range(p0, p0 + len(positions))) and len(positions) in (len(generated) - 1,
                                                                                    len(generated))
    assert [t for f in watcher.frames for t in f.token_ids] == generated[:len(positions)]
    from mia_stream.errors import BrokerTimeoutError

    t0 = time.monotonic()
    with pytest.raises(BrokerTimeoutError, match="no stream 'no-such-request'"):
        client.open("no-such-request").collect()
    assert time.monotonic() - t0 < 30


# ------------------------------------------------------------------------------------------ shutdown, then plain
def test_ctrl_c_stops_every_child(servers):
    serve = servers.serve.proc
    children = _session_pids(servers.pids["vllm"]) | {servers.pids["broker"], servers.pids["recorder"]}
    assert len(children) >= 4  # broker, recorder, api server, engine core (and its worker)
    serve.send_signal(signal.SIGINT)
    assert serve.wait(120) == 0
    # SIGKILLed children may take a moment to be gone under load (one was still there right after the wait,
    # gone a few seconds later, at load average 35)
    deadline = time.monotonic() + 30
    while (alive := {p for p in children if _alive(p)}) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not alive, {p: _cmdline(p) for p in alive}
    assert "mia-stream serve: stopped" in servers.serve.text()


def test_unsteered_answers_equal_a_server_without_mia_stream(concurrent_run, servers):
    reqs, _ = concurrent_run
    assert servers.serve.proc.poll() is not None  # runs after test_ctrl_c_stops_every_child
    servers.start_plain()
    plain = _openai(servers.plain_url, max_retries=0)
    answers: dict = {}

    def ask(name, messages):
        r = plain.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0)
        answers[name] = r.choices[0].message.content

    jobs = {"A": PROMPT_A, "B": PROMPT_B, "D": PROMPT_C}
    threads = [threading.Thread(target=ask, args=item) for item in jobs.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    for name in jobs:
        assert reqs[name].text == answers[name], name
    assert reqs["C"].text != reqs["D"].text  # the steering changed the answer to the same prompt


def _session_pids(sid: int) -> set[int]:
    out = subprocess.run(["ps", "-eo", "pid=,sid="], capture_output=True, text=True).stdout
    return {int(p) for p, s in (ln.split() for ln in out.splitlines() if ln.strip()) if int(s) == sid}


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return "?"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False
