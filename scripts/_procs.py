"""Process teardown shared by the benchmark and evaluation scripts (they run brokers, consumers, analyzers)."""

from __future__ import annotations

import signal
import subprocess
from typing import Iterable


def stop_processes(procs: Iterable[subprocess.Popen], timeout: float = 10.0) -> None:
    """SIGTERM each process still running (in the given order), then SIGKILL what has not exited in ``timeout``."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(timeout)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
