"""The mia_stream broker: producers' streams in, demuxed by request id to subscribed consumers.

``mia-stream broker`` runs one (``main``); ``mia-stream stats`` prints a running one's counters
(``stats_main``); ``run_broker_in_thread`` runs one inside this process. Every routing rule is in
``_routing.Router`` (no I/O; one module per concern beside it); ``_broker.Broker`` is its socket loop.
Protocol: docs/bus.md.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time

import msgpack
import zmq

from mia_stream.bus import transport
from mia_stream.broker._broker import GC_FREEZE_S, Broker, run_broker_in_thread
from mia_stream.broker._config import (DEFAULT_CONSUMER_QUEUE_BYTES, DEFAULT_CONSUMER_TIMEOUT_S,
                                       DEFAULT_LATE_JOIN_BYTES, DEFAULT_LATE_JOIN_LINGER_S,
                                       DEFAULT_LATE_JOIN_TOTAL_BYTES, DEFAULT_PRODUCER_TIMEOUT_S,
                                       DEFAULT_RING_GRACE_S, BrokerConfig)
from mia_stream.broker._routing import Router
from mia_stream.errors import BrokerTimeoutError, MiaStreamError
from mia_stream.schemas import DEFAULT_MAX_MESSAGE_BYTES

__all__ = ["Broker", "BrokerConfig", "Router", "run_broker_in_thread", "main", "stats_main", "fetch_stats"]


def _endpoints_from_args(args) -> transport.BrokerEndpoints:
    eps = transport.endpoints_for(args.address)
    return transport.BrokerEndpoints(args.producers or eps.producers, args.consumers or eps.consumers,
                                      args.stats or eps.stats)


def _add_address_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--address", help="broker address: a run dir, ipc://DIR/producers.sock or tcp://HOST:PORT "
                                      f"(default ${transport.ENV_BROKER} or the default run dir)")
    ap.add_argument("--producers", help="producers endpoint (overrides --address)")
    ap.add_argument("--consumers", help="consumers endpoint (overrides --address)")
    ap.add_argument("--stats", help="stats endpoint (overrides --address)")
    ap.add_argument("--keys", help="CURVE key dir (from `mia-stream keys`); required for tcp")


def main(argv: list[str]) -> int:
    """``mia-stream broker``: serve until SIGINT/SIGTERM."""
    ap = argparse.ArgumentParser(prog="mia-stream broker", description="Run the mia_stream broker.")
    _add_address_args(ap)
    ap.add_argument("--consumer-queue-bytes", type=int, default=DEFAULT_CONSUMER_QUEUE_BYTES,
                    help="per-consumer outbound budget before tensor frames are dropped (reported as gaps)")
    ap.add_argument("--late-join-bytes", type=int, default=DEFAULT_LATE_JOIN_BYTES,
                    help="per-stream buffer for Subscribe(from_start=True)")
    ap.add_argument("--late-join-total-bytes", type=int, default=DEFAULT_LATE_JOIN_TOTAL_BYTES)
    ap.add_argument("--late-join-linger", type=float, default=DEFAULT_LATE_JOIN_LINGER_S,
                    help="seconds an ended stream stays joinable from its start")
    ap.add_argument("--producer-timeout", type=float, default=DEFAULT_PRODUCER_TIMEOUT_S,
                    help="seconds without a message before a producer's open streams end as producer_lost")
    ap.add_argument("--consumer-timeout", type=float, default=DEFAULT_CONSUMER_TIMEOUT_S)
    ap.add_argument("--max-message-bytes", type=int, default=DEFAULT_MAX_MESSAGE_BYTES)
    ap.add_argument("--heartbeat", type=float, default=transport.HEARTBEAT_S)
    ap.add_argument("--no-steering", action="store_true", help="refuse every steering command")
    ap.add_argument("--no-batch", action="store_true",
                    help="neither accept nor send batch messages (behave as a schema 1.1 broker)")
    ap.add_argument("--no-shm", action="store_true",
                    help="do not let producers put large tensors in shared memory (every byte through the broker)")
    ap.add_argument("--ring-grace", type=float, default=DEFAULT_RING_GRACE_S,
                    help="seconds a closed producer's shared-memory ring is kept for consumers still reading it")
    try:
        limits = BrokerConfig(transport.BrokerEndpoints("", "", ""))  # defaults: mia_stream.settings
    except MiaStreamError as e:  # a MIA_STREAM_BROKER_* value that does not parse
        print(f"mia-stream broker: {e}", file=sys.stderr)
        return 2
    ap.add_argument("--max-stats-bytes", type=int, default=limits.max_stats_bytes,
                    help="bytes of heartbeat stats kept per producer (MIA_STREAM_BROKER_MAX_STATS_BYTES)")
    ap.add_argument("--max-streams-per-producer", type=int, default=limits.max_streams_per_producer,
                    help="open streams per producer connection (MIA_STREAM_BROKER_MAX_STREAMS_PER_PRODUCER)")
    ap.add_argument("--max-requests-per-message", type=int, default=limits.max_requests_per_message,
                    help="requests one columnar message may name (MIA_STREAM_BROKER_MAX_REQUESTS_PER_MESSAGE)")
    ap.add_argument("--max-patterns", type=int, default=limits.max_patterns,
                    help="glob patterns per consumer (MIA_STREAM_BROKER_MAX_PATTERNS)")
    ap.add_argument("--max-gaps-per-stream", type=int, default=limits.max_gaps_per_stream,
                    help="producer gap notices kept per stream before they are merged "
                         "(MIA_STREAM_BROKER_MAX_GAPS_PER_STREAM)")
    ap.add_argument("--consumer-pipe-messages", type=int, default=limits.consumer_pipe_messages,
                    help="zmq messages held per consumer beyond its queue (MIA_STREAM_BROKER_CONSUMER_PIPE_MESSAGES)")
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args(argv)
    import logging

    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING)
    try:
        eps = _endpoints_from_args(args)
        keys = transport.load_server_keys(args.keys) if args.keys else None
        config = BrokerConfig(eps, keys, args.consumer_queue_bytes, args.late_join_bytes,
                              args.late_join_total_bytes, args.late_join_linger, args.producer_timeout,
                              args.consumer_timeout, max_message_bytes=args.max_message_bytes,
                              heartbeat_s=args.heartbeat, steering=not args.no_steering,
                              batch=not args.no_batch, shm=not args.no_shm, ring_grace_s=args.ring_grace,
                              max_stats_bytes=args.max_stats_bytes,
                              max_streams_per_producer=args.max_streams_per_producer,
                              max_requests_per_message=args.max_requests_per_message,
                              max_patterns=args.max_patterns, max_gaps_per_stream=args.max_gaps_per_stream,
                              consumer_pipe_messages=args.consumer_pipe_messages)
        broker = Broker(config, gc_freeze_s=GC_FREEZE_S)  # its own process: see GC_FREEZE_S
    except MiaStreamError as e:
        print(f"mia-stream broker: {e}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, lambda *_: broker.stop())
    signal.signal(signal.SIGINT, lambda *_: broker.stop())
    print(f"mia-stream broker ready: producers={eps.producers} consumers={eps.consumers} stats={eps.stats} "
          f"instance={broker.instance:x}", flush=True)
    try:
        broker.run()
    finally:
        broker.close()
    return 0


def fetch_stats(address=None, *, stats_endpoint: str | None = None, keys=None, timeout: float = 2.0) -> dict:
    """Ask a running broker for its stats dict (see ``Broker.stats``)."""
    endpoint = stats_endpoint or transport.endpoints_for(address).stats
    client_keys = transport.resolve_client_keys(keys, "consumer")
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.REQ)
    try:
        transport.configure(sock)
        transport.connect(sock, endpoint, client_keys)
        sock.send(b"msgpack")
        if not sock.poll(int(timeout * 1000)):
            raise BrokerTimeoutError(f"no stats reply from {endpoint} within {timeout:g} s")
        return msgpack.unpackb(sock.recv(), raw=False, strict_map_key=False)
    finally:
        sock.close(0)


def _human(n: float) -> str:
    for unit in ("", "K", "M", "G", "T"):
        if abs(n) < 1024 or unit == "T":
            return f"{n:.0f}{unit}" if unit == "" else f"{n:.1f}{unit}"
        n /= 1024
    return str(n)


def _table(stats: dict) -> str:
    b = stats["broker"]
    lines = [f"broker instance {b['instance']:x} pid {b['pid']} up {b['uptime_s']:.0f} s; curve={b['curve']} "
             f"steering={b['steering']} late-join buffer {_human(b['late_join_buffer_bytes'])}B"]
    totals = stats["totals"]
    lines.append("totals: " + (", ".join(f"{k}={v}" for k, v in sorted(totals.items())) or "none"))
    lines.append("")
    lines.append(f"{'producer':<32} {'frames/s':>10} {'bytes/s':>10} {'messages':>10} {'open':>5} {'drops rep.':>10}")
    for name, p in sorted(stats["producers"].items()):
        lines.append(f"{name:<32} {p['frames_per_s']:>10.1f} {_human(p['bytes_per_s']):>10} {p['messages']:>10} "
                     f"{p['open_streams']:>5} {p['gaps_reported']:>10}")
    lines.append("")
    lines.append(f"{'consumer':<32} {'queue msgs':>10} {'queue B':>10} {'delivered':>10} {'dropped':>8} {'gaps':>8}")
    for name, c in sorted(stats["consumers"].items()):
        lines.append(f"{name:<32} {c['queue_messages']:>10} {_human(c['queue_bytes']):>10} {c['delivered']:>10} "
                     f"{c['dropped']:>8} {c['gaps_notified']:>8}")
    lines.append("")
    lines.append(f"{'stream (request|producer|epoch)':<48} {'messages':>9} {'bytes':>9} {'next seq':>8} {'ended':>6}")
    for name, s in sorted(stats["streams"].items()):
        lines.append(f"{name[:48]:<48} {s['messages']:>9} {_human(s['bytes']):>9} {s['next_seq']:>8} "
                     f"{str(s['ended']):>6}")
    return "\n".join(lines)


def stats_main(argv: list[str]) -> int:
    """``mia-stream stats``: print a running broker's statistics (a table, or --json)."""
    ap = argparse.ArgumentParser(prog="mia-stream stats", description="Print a running broker's statistics.")
    _add_address_args(ap)
    ap.add_argument("--json", action="store_true", help="print the raw stats as JSON")
    ap.add_argument("--timeout", type=float, default=2.0)
    ap.add_argument("--watch", type=float, default=0.0, help="repeat every N seconds")
    args = ap.parse_args(argv)
    while True:
        try:
            stats = fetch_stats(stats_endpoint=_endpoints_from_args(args).stats, keys=args.keys,
                                timeout=args.timeout)
        except MiaStreamError as e:
            print(f"mia-stream stats: {e}", file=sys.stderr)
            return 1
        print(json.dumps(stats, indent=2, sort_keys=True) if args.json else _table(stats), flush=True)
        if not args.watch:
            return 0
        time.sleep(args.watch)
