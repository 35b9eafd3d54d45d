"""The engine core's side of live steering: commands from the broker, applied at step boundaries.

Owns (one ``EngineControl`` per scheduler): the queue of commands received on the control publisher's thread, the
queue of in-engine detectors' actions (``queue_action``; the detectors themselves are ``_detect_engine``'s),
``streams`` (stream id -> engine request id of the live streamed requests), ``ops`` (engine request id -> the
request's current ``(ops, version)``) and the publisher that receives commands and sends acks. The set of
requests to abort is the adapter registry's (one per process: ``check_stop`` reads it). What a command does is
``_steer_command.apply_command``; what it touches in vLLM (is a request live, re-hash its KV blocks) the adapter
passes in as callables, so nothing here knows vLLM.
"""

from __future__ import annotations

import os
import re
import secrets
import socket
import threading
import time
from typing import Callable

from mia_stream import settings
from mia_stream.errors import SettingError, SpecError
from mia_stream.producer._steer_command import Outcome, apply_command
from mia_stream.spec import ModelGeometry, parse_steer_ops, steer_wire


_TOKEN_ENV = "MIA_STREAM_CONTROL_TOKEN"
_TOKEN = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


def ensure_control_token() -> str:
    """The engine's control token, made once (``secrets.token_hex(8)``) by the first process that loads the
    plugin and put in the environment before vLLM starts the engine core and its workers, which inherit it: the
    control id they agree on is then unpredictable to other peers (issue 24 item 5; docs/security.md)."""
    token = settings.get_text(_TOKEN_ENV)
    if token is None:
        token = os.environ[_TOKEN_ENV] = secrets.token_hex(8)
    elif not _TOKEN.match(token):  # it ends the broker identity's first segment: no '/', no ':'
        raise SettingError(f"{_TOKEN_ENV}={token!r}: expected letters, digits, '_' or '-' (at most 64)")
    return token


def engine_control_id(pid: int) -> str:
    """The control identity of the engine core ``pid``: ``host:pid:engine:TOKEN`` (what its workers put in
    StreamStart.control_id and what its control publisher connects as)."""
    return f"{socket.gethostname()}:{pid}:engine:{ensure_control_token()}"


class EngineControl:
    def __init__(self, geo: ModelGeometry, aborts: set):
        from mia_stream.bus.publisher import make_publisher

        self.geo = geo
        self.control_id = engine_control_id(os.getpid())
        self._lock = threading.Lock()
        self._commands: list = []
        self.streams: dict[str, str] = {}  # stream id -> engine request id
        # engine request id -> (ops, version); ops as the spec's wire list until a command needs them parsed
        self.ops: dict[str, tuple] = {}
        self.aborts = aborts  # engine request ids to stop at their next step (one set per process)
        self.steering = settings.get_flag("MIA_STREAM_STEERING")
        # it sends no tensors: no shared-memory ring (one would be 256 MiB of /dev/shm for nothing)
        self.publisher = make_publisher(self.control_id, on_command=self._on_command, shm_bytes=0)
        self._internal: list = []  # (SteeringCommand, callback(ack)): in-engine detectors' actions
        from mia_stream.producer._detect_engine import EngineDetectors

        self.detectors = EngineDetectors(self)

    def close(self) -> None:
        """At the engine core's shutdown: a last moment for queued acks, then the socket and thread go."""
        self.publisher.close(timeout=0.2)

    def _on_command(self, cmd) -> None:
        with self._lock:
            self._commands.append(cmd)

    def queue_action(self, cmd, on_ack: Callable) -> None:
        """An in-engine detector's steering action: applied by the next ``take`` like a broker command, its ack
        handed to ``on_ack`` instead of the broker (engine-core thread only)."""
        self._internal.append((cmd, on_ack))

    def add_request(self, stream_id: str, engine_id: str, ops_wire, detect_wire=None) -> None:
        """A streamed request entered the scheduler (``ops_wire``: its spec's steering ops, version 1). They are
        parsed only when a command reaches the request: the frontend checked them, and the workers parse the
        spec anyway (most requests never get a command)."""
        self.streams[stream_id] = engine_id
        if ops_wire:
            self.ops[engine_id] = (list(ops_wire), 1)
        if detect_wire:
            self.detectors.add_request(engine_id, stream_id, detect_wire)

    def forget(self, engine_id: str) -> None:
        """The request is freed: no command reaches it any more."""
        self.ops.pop(engine_id, None)
        self.aborts.discard(engine_id)
        self.detectors.forget(engine_id)
        for sid, eid in list(self.streams.items()):
            if eid == engine_id:
                del self.streams[sid]
                self.publisher.forget(sid)

    def take(self, step: int, is_live: Callable[[str], bool], on_change: Callable[[str, int], None]) -> list:
        """Apply the queued commands to the live requests and ack each; return the workers' updates for ``step``,
        ``[(engine id, ops in wire form, version)]``. ``on_change(engine id, version)``: the request's steering
        changed from this step on (the adapter makes its prefix-cache hashes diverge)."""
        from mia_stream.schemas import SteeringAck

        with self._lock:
            commands, self._commands = self._commands, []
        internal, self._internal = self._internal, []
        updates = []
        for cmd, on_ack in [*internal, *((c, None) for c in commands)]:
            eid = self.streams.get(cmd.request_id)
            if eid is None or not is_live(eid):
                err, version = f"unknown or finished request {cmd.request_id!r}", 0
            else:
                ops, version = self.ops.get(eid, ((), 0))
                out = None
                if isinstance(ops, list):  # the spec's own ops, still in wire form (checked by the frontend)
                    try:
                        ops = parse_steer_ops(ops, self.geo)
                        self.ops[eid] = (ops, version)
                    except SpecError as e:
                        out = Outcome((), version, error=str(e))
                if out is None:
                    out = apply_command(cmd.action, ops, version, cmd.ops, cmd.layers, steering=self.steering,
                                        parse=lambda raw: parse_steer_ops(raw, self.geo))
                err, version = out.error, out.version
                if out.abort:
                    self.aborts.add(eid)
                elif out.changed:
                    self.ops[eid] = (out.ops, version)
                    updates.append((eid, steer_wire(out.ops, compact=True, digest=True), version))
                    on_change(eid, version)
            ack = SteeringAck(
                command_id=cmd.command_id, request_id=cmd.request_id, ok=err is None,
                applied_step=None if err else step, steering_version=version, error=err,
                producer_id=self.control_id, time_ns=time.time_ns())
            if on_ack is None:
                self.publisher.ack(ack)
            else:
                on_ack(ack)
        return updates
