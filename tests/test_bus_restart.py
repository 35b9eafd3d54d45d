"""Broker kill -9 and restart on the same endpoints mid-stream: peers reconnect, the loss is named exactly."""

from __future__ import annotations

import json
import signal
import time

import pytest

from bus_helpers import assert_exact, kill, processes, run_dir, spawn, start_broker, stats, wait_for


@pytest.mark.slow
def test_broker_kill_9_and_restart_mid_stream(tmp_path):
    out = tmp_path / "c.json"
    with run_dir() as d, processes() as procs:
        broker = start_broker(d)
        procs.append(broker)
        # a consumer a bit slower than the producer, with a small credit window: at the kill the old broker
        # holds a backlog for it, which dies with it
        consumer = spawn("consume", "--address", d, "--patterns", "r*", "--ends", "2", "--timeout", "30",
                         "--sleep", "0.004", "--window", str(64 << 10), "--out", str(out))
        procs.append(consumer)
        wait_for(lambda: len(stats(d)["consumers"]) == 1, timeout=15)
        producer = spawn("produce", "--address", d, "--requests", "r1,r2", "--frames", "400", "--rate", "300",
                         "--nbytes", "2048", "--delay", "0")
        procs.append(producer)
        wait_for(lambda: any(s["next_seq"] > 150 for s in stats(d)["streams"].values()), timeout=15, interval=0.01)
        kill(broker, signal.SIGKILL)
        time.sleep(0.5)  # frames published now have no broker to go to
        broker = start_broker(d)
        procs.append(broker)
        assert producer.wait(60) == 0, producer.stderr.read()
        assert consumer.wait(60) == 0, consumer.stderr.read()
        st = stats(d)
    got = json.loads(out.read_text())
    client = got.pop("_client")
    assert client.get("broker_restarts_seen", 0) == 1 and client.get("resubscribed", 0) >= 1
    assert sorted(got) == ["r1", "r2"]
    r1, r2 = got["r1"], got["r2"]
    for rec in (r1, r2):
        assert_exact(rec)  # every seq delivered or named missing, exactly once
        assert rec["finish_reason"] == "stop"
    # r1 was live across the restart: it lost something, and that loss was reported
    assert r1["gap_seqs"], "the restart should have cost r1 some frames"
    assert set(r1["gap_reasons"]) <= {"seq_jump", "joined_late", "evicted_from_late_join_buffer"}
    assert r2["steps"][-1] == 399
    assert st["totals"].get("internal_errors", 0) == 0
