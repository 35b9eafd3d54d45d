"""The drain sidecar: one process per producer (worker rank) that builds and publishes its stream messages.

Why a process: building and encoding a frame per request per step is Python; in the engine process it holds
the GIL that vLLM's own engine loop needs (on the H200, 256 decoding requests with one captured layer ran at
0.22-0.37 of plain vLLM). Here the engine process sends one pickled item per step (columnar, see
``_drain``) through a pipe, and the captured rows stay in the shared host ring; the drain publishes one
message per step for all its requests.

Lifecycle: ``DrainSidecar.start(ring, config, producer_id)`` spawns ``python -m mia_stream.producer._sidecar``
(a fresh interpreter: no re-import of the user's main module, no torch) with the ring's and the pipe's
descriptors, and returns once the sidecar says it is ready (its publisher made) on a second pipe: a sidecar
that cannot start (an import error, a bad setting) is a ``SidecarError`` naming its stderr's tail, which fails
the engine's start (issue 26: one was restarted every few seconds while the engine served and published
nothing); ``send(item)`` writes one item; ``close()`` closes the pipe, which the sidecar takes as "flush
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
import select
from multiprocessing.connection import Connection

from mia_stream.errors import MiaStreamError
from mia_stream.producer._items import Init

logger = logging.getLogger("mia_stream.producer")

_F_SETPIPE_SZ = 1031
_PIPE_BYTES = 1 << 20
_READY_TIMEOUT_S = 60.0  # a fresh interpreter importing numpy, zmq and msgpack: ~0.5 s, more on a loaded host
_LOG_TAIL_BYTES = 2000


class SidecarError(MiaStreamError, RuntimeError):
    """The drain sidecar cannot start, or is gone."""


class DrainSidecar:
    """Engine side of the sidecar: the process handle and the write end of its pipe."""

    def __init__(self, proc: subprocess.Popen, conn: Connection):
        self.proc, self._conn = proc, conn
        self.broken = False
        self.log_path = ""

    @classmethod
    def start(cls, ring, config, producer_id: str, ready_timeout: float = _READY_TIMEOUT_S) -> "DrainSidecar":
        """Spawn the sidecar and wait until it is ready; ``SidecarError`` (with its stderr's tail) if it exits
        first or is not ready within ``ready_timeout`` seconds."""
        read_fd, write_fd = os.pipe()
        ready_r, ready_w = os.pipe()
        try:
            fcntl.fcntl(write_fd, _F_SETPIPE_SZ, _PIPE_BYTES)  # a burst of steps never blocks the writer
        except OSError:
            pass
        cmd = [sys.executable, "-m", "mia_stream.producer._sidecar", "--pipe-fd", str(read_fd),
               "--ring-fd", str(ring.fd), "--ring-size", str(ring.size), "--ring-name", ring.name,
               "--parent", str(os.getpid()),
               "--ready-fd", str(ready_w)]
        # Its own log file, not the engine's stdout/stderr: vLLM's shutdown waits for the engine's output pipes
        # to close, and a sidecar still flushing held them open until vLLM killed the engine process.
        rank = producer_id.split(":")[-1]
        log_path = os.path.join(tempfile.gettempdir(), f"mia-stream-sidecar-{os.getpid()}-{rank}.log")
        log = open(log_path, "ab")
        log_start = log.tell()
        try:
            proc = subprocess.Popen(cmd, pass_fds=(read_fd, ring.fd, ready_w), stdin=subprocess.DEVNULL,
                                    stdout=subprocess.DEVNULL, stderr=log, env=_child_env())
        except BaseException:
            os.close(ready_r)
            raise
        finally:
            os.close(read_fd)
            os.close(ready_w)
            log.close()
        side = cls(proc, Connection(write_fd, readable=False))
        side.log_path = log_path
        try:
            side.send(Init(config, producer_id, ring.secret))  # through the pipe: never on a command line
            side._wait_ready(ready_r, ready_timeout, log_start)
        except SidecarError:
            side.close(timeout=1.0)
            raise
        finally:
            os.close(ready_r)
        logger.info("mia_stream: drain sidecar %d started; its log: %s", proc.pid, log_path)
        return side

    def _wait_ready(self, ready_fd: int, timeout: float, log_start: int) -> None:
        readable, _, _ = select.select([ready_fd], [], [], timeout)
        if readable and os.read(ready_fd, 1) == b"1":
            return
        try:  # the ready pipe closed without a word: the sidecar is exiting
            code = self.proc.wait(5.0 if readable else 0.0)
        except subprocess.TimeoutExpired:
            code = None
        why = (f"exited at start (exit {code})" if code is not None
               else f"was not ready within {timeout:.0f} s")
        raise SidecarError(
            f"mia_stream: the drain sidecar (`{sys.executable} -m mia_stream.producer._sidecar`, pid {self.proc.pid}) "
            f"{why}; nothing could be published. Its stderr ends with:\n{_log_tail(self.log_path, log_start)}\n"
            f"(full log: {self.log_path}; it imports mia_stream through PYTHONPATH="
            f"{_child_env().get('PYTHONPATH', '')!r})")

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


def _log_tail(path: str, start: int) -> str:
    """The end of what a sidecar wrote to its log since ``start``."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(start, f.tell() - _LOG_TAIL_BYTES))
            text = f.read().decode(errors="replace").strip()
    except OSError as e:
        return f"(its log could not be read: {e})"
    return text or "(nothing)"


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
def _serve(conn: Connection, ring, parent: int, ready_fd: int | None = None) -> None:
    from mia_stream.producer._drain import StepDrain
    from mia_stream.bus.publisher import make_publisher

    init = pickle.loads(conn.recv_bytes())
    if type(init) is not Init:
        raise SidecarError(f"the first item must be Init, not {type(init).__name__}")
    config, producer_id, ring.secret = init
    publisher = make_publisher(producer_id)
    drain = StepDrain(config, publisher, ring)
    if ready_fd is not None:  # the engine waits for this before it goes on starting
        os.write(ready_fd, b"1")
        os.close(ready_fd)
    closed = False
    try:
        while True:
            if not conn.poll(1.0):
                if os.getppid() != parent:  # the engine died without closing the pipe
                    logger.warning("mia_stream: engine process %d is gone; drain sidecar exiting", parent)
                    closed = True
                    return
                continue
            try:
                data = conn.recv_bytes()
            except EOFError:  # the engine closed the pipe: everything it sent has been handled
                drain.close()  # and what async scheduling held back can go: no later step will come
                closed = True
                return
            drain.handle(pickle.loads(data))
    finally:
        # the last to publish from the host ring (a restarted sidecar's predecessor dies first) hands it to the
        # broker, like the publisher's own ring, so consumers a little behind still read the last rows it
        # referenced; it removes the name itself when the broker does not take it
        taken = False
        if closed and ring.name:
            try:
                taken = publisher.hand_over_ring(ring.name, ring.mark_handed_over)
            except Exception:  # noqa: BLE001 -- at exit: the publisher still closes, and the ring is removed here
                logger.exception("mia_stream: handing the host ring to the broker failed")
        publisher.close(timeout=5.0)
        if closed and not taken:
            ring.unlink()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="mia_stream producer drain sidecar (started by the vLLM plugin)")
    ap.add_argument("--pipe-fd", type=int, required=True)
    ap.add_argument("--ring-fd", type=int, required=True)
    ap.add_argument("--ring-size", type=int, required=True)
    ap.add_argument("--ring-name", default="")
    ap.add_argument("--parent", type=int, required=True)
    ap.add_argument("--ready-fd", type=int, default=None)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s mia_stream sidecar %(levelname)s %(message)s")
    from mia_stream.producer._host_ring import HostRing

    ring = HostRing(args.ring_fd, args.ring_size, args.ring_name)
    conn = Connection(args.pipe_fd, writable=False)
    t0 = time.monotonic()
    try:
        _serve(conn, ring, args.parent, args.ready_fd)
    except Exception:
        logger.exception("mia_stream: drain sidecar failed after %.1f s", time.monotonic() - t0)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
