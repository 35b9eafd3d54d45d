"""scripts/setup.sh's guards: the stamp fast path, a clear error when the disk is too small or Python is missing.

None of these installs anything: each one points MIA_STREAM_VENV at a fresh path under tmp_path and stops the
script before its first pip call.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SETUP = ROOT / "scripts" / "setup.sh"


def _setup(venv: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SETUP)], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "MIA_STREAM_VENV": str(venv), **env})


def _stamp_key() -> str:
    # The documented key: flavour + sha256 of pyproject.toml and setup.sh.
    gpu = shutil.which("nvidia-smi") and subprocess.run(["nvidia-smi", "-L"], capture_output=True).returncode == 0
    digest = hashlib.sha256((ROOT / "pyproject.toml").read_bytes() + SETUP.read_bytes()).hexdigest()[:16]
    return f"{'gpu' if gpu else 'cpu'}-{digest}"


def test_too_little_disk_is_a_clear_error_and_installs_nothing(tmp_path: Path) -> None:
    venv = tmp_path / "deep" / "venv"
    result = _setup(venv, MIA_STREAM_SETUP_NEED_GB="1000000")
    assert result.returncode == 2
    assert "not enough disk space for the virtualenv" in result.stderr
    assert "about 1000000 GiB needed" in result.stderr
    assert "MIA_STREAM_VENV" in result.stderr
    assert not (tmp_path / "deep").exists()


def test_a_missing_python_is_a_clear_error(tmp_path: Path) -> None:
    result = _setup(tmp_path / "venv", PYTHON=str(tmp_path / "no-python"))
    assert result.returncode == 2
    assert "missing or older than Python 3.10" in result.stderr
    assert not (tmp_path / "venv").exists()


def test_a_current_stamp_makes_setup_a_silent_no_op(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    venv.mkdir()
    (venv / ".mia-stream-setup").write_text(_stamp_key() + "\n")
    result = _setup(venv, MIA_STREAM_SETUP_NEED_GB="1000000")
    assert (result.returncode, result.stdout, result.stderr) == (0, "", "")


def test_a_stale_stamp_runs_setup_again(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    venv.mkdir()
    (venv / ".mia-stream-setup").write_text("cpu-0000000000000000\n")
    # It goes past the stamp and stops at the disk check (so still nothing is installed).
    result = _setup(venv, MIA_STREAM_SETUP_NEED_GB="1000000")
    assert result.returncode == 2
    assert "not enough disk space" in result.stderr


def _bin_without_chromium(tmp_path: Path, apt_get: str | None) -> str:
    """A PATH with the tools setup.sh's fast path uses, no chromium, and ``apt_get`` as apt-get's script (or none)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("bash", "cat", "sha256sum", "cut", "mkdir", "rm", "date", "grep", "head", "tr", "id", "dirname",
                 "nvidia-smi"):  # (nvidia-smi where there is one: the stamp's flavour)
        if shutil.which(tool):
            (bin_dir / tool).symlink_to(shutil.which(tool))
    if apt_get is not None:
        (bin_dir / "apt-get").write_text(f"#!{shutil.which('bash')}\n{apt_get}\n")
        (bin_dir / "apt-get").chmod(0o755)
    return str(bin_dir)


def test_chromium_that_cannot_be_installed_is_said_and_recorded_for_the_monitor_tests(tmp_path: Path) -> None:
    """With a current venv, setup.sh still looks for chromium; where it cannot install it, it writes why to
    $VENV/.mia-stream-no-chromium (tests/test_monitor.py then skips naming that reason, and fails otherwise)."""
    if os.geteuid() != 0:
        expected = "this user is not root"
        path = _bin_without_chromium(tmp_path, None)
    else:
        expected = "apt-get install chromium failed: E: Could not resolve deb.debian.org"
        path = _bin_without_chromium(tmp_path, 'echo "E: Could not resolve deb.debian.org"; exit 100')
    venv = tmp_path / "venv"
    venv.mkdir()
    (venv / ".mia-stream-setup").write_text(_stamp_key() + "\n")
    result = _setup(venv, PATH=path)
    assert result.returncode == 0, result.stderr
    reason = (venv / ".mia-stream-no-chromium").read_text()
    assert expected in reason
    assert f"the monitor's browser tests will skip: {reason.strip()}" in result.stderr
    # chromium back on PATH: the note goes
    (Path(path) / "chromium").symlink_to(shutil.which("true"))
    result = _setup(venv, PATH=path)
    assert (result.returncode, result.stdout, result.stderr) == (0, "", "")
    assert not (venv / ".mia-stream-no-chromium").exists()
