"""A real vLLM CPU engine's streams through broker + bridge + NATS to a consumer process that knows only the NATS
URL; steering from that remote consumer, applied by the engine; Prometheus metrics scraped from every process
during the run. The references are vLLM's own outputs (the token ids ``generate`` returned) and the NATS server's
own count of the messages in the stream.

- the remote consumer's tokens equal vLLM's output for every request; every seq is delivered or named (the
  tensor frames, not bridged by default, as ``not_bridged`` gaps); each request is tagged with its engine;
- a consumer identity the NATS server lets steer aborts a request: the ack comes back through NATS, the stream
  ends with ``abort`` and vLLM's output stops where the stream did; an identity without that permission gets
  ``not_authorised`` and its command never reaches the bridge;
- metrics, scraped from the engine's drain, the broker and the bridge while the engine runs: the messages the
  drain sent, the broker delivered to the bridge and the bridge published all equal the messages the NATS stream
  holds (the server's own count); no lag left; one steering command routed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from bus_helpers import _env, assert_exact, processes, run_dir, start_broker
from nats_engine_run import LONG_MAX_TOKENS
from nats_helpers import spawn_consumer, start_bridge, stop_bridge, wait_line

pytestmark = pytest.mark.slow
HERE = Path(__file__).resolve().parent
PASSWORD = "pw-test"


def _users(prefix: str) -> list[dict]:
    read = ["$JS.API.CONSUMER.>", "$JS.API.STREAM.INFO.>"]
    return [{"user": "bridge", "password": PASSWORD},
            {"user": "steerer", "password": PASSWORD, "publish": read + [f"{prefix}-steer.>"],
             "subscribe": ["_INBOX.>"]},
            {"user": "reader", "password": PASSWORD, "publish": read, "subscribe": ["_INBOX.>"]}]


def _scrape(base: int) -> dict:
    """Every /metrics page of the range ``base .. base+63``, by port."""
    from mia_stream.metrics import parse_exposition

    pages = {}
    for port in range(base, base + 64):
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
                pages[port] = parse_exposition(r.read().decode())
        except OSError:
            continue
    return pages


def _sum(pages: dict, name: str, **labels) -> float:
    total = 0.0
    for page in pages.values():
        for (n, lab), v in page.items():
            if n == name and all(dict(lab).get(k) == val for k, val in labels.items()):
                total += v
    return total


def test_engine_stream_through_nats_steered_remotely_with_metrics(model_dir, tmp_path, monkeypatch):
    import asyncio

    import nats

    from mia_stream.bridge.server import NatsCluster, free_ports
    from mia_stream.consumers import open_stream
    from mia_stream.schemas import SteeringCommand

    prefix, stream = "eng", "ENG"
    metrics_base = free_ports(1)[0]
    monkeypatch.setenv("MIA_STREAM_METRICS_PORT", str(metrics_base))  # every process started below serves metrics
    env = _env()
    env.update(VLLM_CPU_KVCACHE_SPACE="1")
    with NatsCluster(1, users=_users(prefix)) as c, run_dir() as d, processes() as procs:
        port = c.nodes[0].port
        q = f"?stream={stream}&prefix={prefix}"
        procs.append(start_broker(d))
        bridge = start_bridge(d, f"nats://bridge:{PASSWORD}@127.0.0.1:{port}", "cpu0", "--stream", stream,
                              "--prefix", prefix, env=env)
        procs.append(bridge)
        consumer = spawn_consumer("--url", f"nats://steerer:{PASSWORD}@127.0.0.1:{port}{q}", "--ends", "3",
                                  "--steer", "long", "--steer-after", "8", "--timeout", "400",
                                  "--out", str(tmp_path / "remote.json"))
        procs.append(consumer)
        wait_line(consumer, "subscribed", 60)
        hold = tmp_path / "hold"
        hold.write_text("")
        engine_env = dict(env, MIA_STREAM_BROKER=d)
        with open(tmp_path / "engine.log", "w") as log:
            engine = subprocess.Popen([sys.executable, str(HERE / "nats_engine_run.py"), "--model", model_dir,
                                       "--out", str(tmp_path / "vllm.json"), "--hold", str(hold)], env=engine_env,
                                      stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        procs.append(engine)
        # a reader identity: may read, may not steer
        denied = None
        with open_stream(f"nats://reader:{PASSWORD}@127.0.0.1:{port}{q}", patterns=["long"], timeout=300) as s:
            for ev in s:
                if ev.kind == "start":
                    denied = s.client.send_steering(SteeringCommand("", "long", "abort"), timeout=3)
                    break
        deadline = time.monotonic() + 400
        while not (tmp_path / "vllm.json").exists():
            assert engine.poll() is None, (tmp_path / "engine.log").read_text()[-3000:]
            assert time.monotonic() < deadline
            time.sleep(0.5)
        consumer.wait(120)
        time.sleep(1.5)  # the last acks, and a metrics scrape interval's worth of quiet
        pages = _scrape(metrics_base)

        async def stream_messages() -> int:
            nc = await nats.connect(f"nats://bridge:{PASSWORD}@127.0.0.1:{port}")
            info = await nc.jetstream().stream_info(stream)
            await nc.close()
            return info.state.messages

        held = asyncio.run(stream_messages())
        hold.unlink()
        engine.wait(120)
        err = stop_bridge(bridge)
    vllm = json.loads((tmp_path / "vllm.json").read_text())
    remote = json.loads((tmp_path / "remote.json").read_text())
    Path("/tmp/nats_engine_metrics.json").write_text(json.dumps(
        {str(p): {f"{n}{dict(l)}": v for (n, l), v in page.items() if n.startswith("mia_stream")}
         for p, page in pages.items()}, indent=1))
    for rid in ("n0", "n1", "long"):
        r = remote[rid]
        assert_exact(r)
        assert r["engine"] == "cpu0"
        assert r["tokens"] == vllm[rid]["token_ids"], rid
        assert set(r["gap_reasons"]) <= {"not_bridged"}
    # steering: the steerer's abort applied at the acked step; the reader refused by the NATS server
    steer = remote["_steer"]
    assert steer["ok"] and steer["applied_step"] is not None, steer
    assert remote["long"]["finish_reason"] == "abort" and vllm["long"]["finish_reason"] == "abort"
    assert steer["tokens_before"] <= len(vllm["long"]["token_ids"]) < LONG_MAX_TOKENS
    assert denied is not None and not denied.ok and denied.error.startswith("not_authorised"), denied
    assert "'steer_commands': 1" in err, err  # only the steerer's command reached the bridge
    # metrics against the stream's own counts
    published = _sum(pages, "mia_stream_bridge_published_total", engine="cpu0")
    assert published == held > 0, (published, held)
    # the worker's drain publisher (producer id HOST:PID:tp0) sent every stream message; the broker delivered
    # each to the bridge, which published each: one count at every hop, equal to what the stream holds
    drain_sent = sum(v for page in pages.values() for (n, lab), v in page.items()
                     if n == "mia_stream_publisher_sent_total" and dict(lab).get("producer", "").endswith(":tp0"))
    to_bridge = _sum(pages, "mia_stream_broker_consumer_delivered_total", consumer="bridge/cpu0")
    assert drain_sent == to_bridge == published == held, (drain_sent, to_bridge, published, held)
    assert _sum(pages, "mia_stream_broker_consumer_queue_messages", consumer="bridge/cpu0") == 0  # no lag left
    assert _sum(pages, "mia_stream_broker_steering_commands_total") == 1
