"""The drain sidecar: one process per producer (worker rank) that builds and publishes its stream messages.

Why a process: building and encoding a frame per request per step is Python; in the engine process it holds
the GIL that vLLM's own engine loop needs (on the H200, 256 decoding requests with one captured layer ran at
0.22-0.37 of plain vLLM). Here the engine process sends one pickled item per step (columnar, see
``_drain``) through a pipe, and the captured rows stay in the shared host ring; the drain publishes one
message per step for all its requests.

Lifecycle: ``DrainSidecar.start(ring, config, producer_id)`` spawns ``python -m mia_stream.producer._sidecar``
(a fresh interpreter: no re-import of the user's main module, no torch) with the ring's and the pipe's
descriptors; ``send(item)`` writes one item; ``close()`` closes the pipe, which the sidecar takes as "flush
what you have and exit". The sidecar also exits when the engine process dies (its parent changes).
Owns (engine side) the sidecar process handle and the pipe's write end; (sidecar side) its StepDrain and
publisher. The sidecar imports mia_stream as its parent did (``_child_env``: the parent's sys.path).
"""

from __future__ import annotations

import argparse
import fcntl
import logging
import os
import pickle
import subprocess
import sys
import tempfile
import time
from multiprocessing.connection import Connection

from mia_stream.producer._items import Init

logger = logging.getLogger("mia_stream.producer")

_F_SETPIPE_SZ = 1031
_PIPE_BYTES = 1 << 20


class SidecarError(RuntimeError):
    pass


class DrainSidecar:
    """Engine side of the sidecar: the process handle and the write end of its pipe."""

    def __init__(self, proc: subprocess.Popen, conn: Connection):
        self.proc, self._conn = proc, conn
        self.broken = False
        self.log_path = ""

    @classmethod
    def start(cls, ring, config, producer_id: str) -> "DrainSidecar":
        read_fd, write_fd = os.pipe()
        try:
            fcntl.fcntl(write_fd, _F_SETPIPE_SZ, _PIPE_BYTES)  # a burst of steps never blocks the writer
        except OSError:
            pass
        cmd = [sys.executable, "-m", "mia_stream.producer._sidecar", "--pipe-fd", str(read_fd),
               "--ring-fd", str(ring.fd), "--ring-size", str(ring.size), "--parent", str(os.getpid())]
        # Its own log file, not the engine's stdout/stderr: vLLM's shutdown waits for the engine's output pipes
        # to close, and a sidecar still flushing held them open until vLLM killed the engine process.
        rank = producer_id.split(":")[-1]
        log_path = os.path.join(tempfile.gettempdir(), f"mia-stream-sidecar-{os.getpid()}-{rank}.log")
        log = open(log_path, "ab")
        try:
            proc = subprocess.Popen(cmd, pass_fds=(read_fd, ring.fd), stdin=subprocess.DEVNULL,
                                    stdout=subprocess.DEVNULL, stderr=log, env=_child_env())
        finally:
            os.close(read_fd)
            log.close()
        logger.info("mia_stream: drain sidecar %d started; its log: %s", proc.pid, log_path)
        side = cls(proc, Connection(write_fd, readable=False))
        side.log_path = log_path
        side.send(Init(config, producer_id))
        return side

    def send(self, item) -> None:
        """Write one item (blocks only while the pipe is full: call it from the forwarder thread)."""
        if self.broken:
            raise SidecarError("the drain sidecar is gone")
        try:
            self._conn.send_bytes(pickle.dumps(item, protocol=pickle.HIGHEST_PROTOCOL))
        except (BrokenPipeError, OSError) as e:
            self.broken = True
            raise SidecarError(f"the drain sidecar (pid {self.proc.pid}) is gone: exit {self.proc.poll()}; "
                               f"its log: {self.log_path}") from e

    def close(self, timeout: float = 10.0, wait: bool = True) -> None:
        """Close the pipe (the sidecar publishes what it has, then exits); ``wait`` for that up to ``timeout``."""
        try:
            self._conn.close()
        except OSError:
            pass
        if not wait:
            return
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            logger.warning("mia_stream: drain sidecar %d did not finish in %.0f s; killing it", self.proc.pid, timeout)
            self.proc.kill()
            self.proc.wait()


def _child_env() -> dict:
    """This environment with PYTHONPATH extended by this process's ``sys.path``: the sidecar must import the
    mia_stream its parent imported, also when that one is importable only through the parent's ``sys.path`` (a
    script's directory, a path added at run time; issue 26). PYTHONPATH's own entries stay first, as they were."""
    env = dict(os.environ)
    entries = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    entries += [p for p in sys.path if p and isinstance(p, str)]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(entries))
    return env


# ------------------------------------------------------------------------------------------ the process
def _serve(conn: Connection, ring, parent: int) -> None:
    from mia_stream.producer._drain import StepDrain
    from mia_stream.bus.publisher import make_publisher

    init = pickle.loads(conn.recv_bytes())
    if type(init) is not Init:
        raise SidecarError(f"the first item must be Init, not {type(init).__name__}")
    config, producer_id = init
    publisher = make_publisher(producer_id)
    drain = StepDrain(config, publisher, ring)
    try:
        while True:
            if not conn.poll(1.0):
                if os.getppid() != parent:  # the engine died without closing the pipe
                    logger.warning("mia_stream: engine process %d is gone; drain sidecar exiting", parent)
                    return
                continue
            try:
                data = conn.recv_bytes()
            except EOFError:  # the engine closed the pipe: everything it sent has been handled
                drain.close()  # and what async scheduling held back can go: no later step will come
                return
            drain.handle(pickle.loads(data))
    finally:
        publisher.close(timeout=5.0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="mia_stream producer drain sidecar (started by the vLLM plugin)")
    ap.add_argument("--pipe-fd", type=int, required=True)
    ap.add_argument("--ring-fd", type=int, required=True)
    ap.add_argument("--ring-size", type=int, required=True)
    ap.add_argument("--parent", type=int, required=True)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s mia_stream sidecar %(levelname)s %(message)s")
    from mia_stream.producer._host_ring import HostRing

    ring = HostRing(args.ring_fd, args.ring_size)
    conn = Connection(args.pipe_fd, writable=False)
    t0 = time.monotonic()
    try:
        _serve(conn, ring, args.parent)
    except Exception:
        logger.exception("mia_stream: drain sidecar failed after %.1f s", time.monotonic() - t0)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
