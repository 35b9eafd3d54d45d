"""Helpers for the NATS tests: a bridge process, and a consumer process that knows only the NATS URL.

    python tests/nats_helpers.py consume --url nats://127.0.0.1:P --ends 2 --out result.json [--from-start]
        [--steer REQUEST --steer-after N]   (abort REQUEST after N of its tokens, over NATS; the ack is recorded)
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bus_helpers import PY, _env, account, kill, wait_line  # noqa: E402


def start_bridge(broker: str, url: str, engine: str, *args: str, timeout: float = 30.0,
                 env: dict | None = None) -> subprocess.Popen:
    """``mia-stream bridge`` as a process; returns once it printed its ready line."""
    if "--max-bytes" not in args:  # each stream reserves its max bytes of the server's store
        args = (*args, "--max-bytes", str(64 << 20))
    proc = subprocess.Popen([PY, "-m", "mia_stream.cli", "bridge", "--broker", broker, "--nats", url, "--engine",
                             engine, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env or _env())
    try:
        wait_line(proc, "ready", timeout, "bridge")
    except RuntimeError:
        kill(proc)
        raise
    return proc


def stop_bridge(proc: subprocess.Popen) -> str:
    """SIGTERM (the bridge settles its publishes first); its stderr, with its final counters."""
    import signal

    proc.send_signal(signal.SIGTERM)
    try:
        _, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate(timeout=5)
    return err


def spawn_consumer(*args: str) -> subprocess.Popen:
    return subprocess.Popen([PY, str(Path(__file__).resolve()), "consume", *args], env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _consume(args) -> int:
    from mia_stream.consumers import open_stream
    from mia_stream.schemas import SteeringCommand

    stream = open_stream(args.url, patterns=tuple(args.patterns), from_start=args.from_start, timeout=args.timeout)
    print("subscribed", flush=True)
    engines, tokens, steer = {}, {}, {}

    def watch(events):
        deadline = time.monotonic() + args.timeout
        ended = 0
        for ev in events:
            rid = ev.stream.request_id
            if ev.kind == "start":
                engines[rid] = ev.stream.start.tags.get("engine")
            elif ev.kind == "tokens":
                tokens.setdefault(rid, []).extend(int(t) for t in ev.tokens.token_ids)
                if rid == args.steer and not steer and len(tokens[rid]) >= args.steer_after:
                    cmd = SteeringCommand("", rid, "abort")
                    ack = stream.client.send_steering(cmd, timeout=20)
                    steer.update(ok=ack.ok, error=ack.error, applied_step=ack.applied_step,
                                 tokens_before=len(tokens[rid]))
            yield ev
            if ev.kind == "end":
                ended += 1
                if ended >= args.ends:
                    return
            if time.monotonic() > deadline:
                return

    rec = account(watch(stream))
    for rid, r in rec.items():
        r["engine"] = engines.get(rid)
        r["tokens"] = tokens.get(rid, [])
    rec["_steer"] = steer
    rec["_client"] = dict(stream.client.counters)
    stream.close()
    Path(args.out).write_text(json.dumps(rec))
    return 0


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("consume")
    c.add_argument("--url", required=True)
    c.add_argument("--patterns", nargs="+", default=["*"])
    c.add_argument("--ends", type=int, default=1)
    c.add_argument("--timeout", type=float, default=60.0)
    c.add_argument("--from-start", action="store_true")
    c.add_argument("--steer", default=None)
    c.add_argument("--steer-after", type=int, default=4)
    c.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    return _consume(args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
