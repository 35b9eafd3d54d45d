"""Every MIA_STREAM_* setting is in one table (mia_stream/settings.py), read only through its typed getters, and
docs/settings.md's table of settings is generated from it. A value that does not parse stops what reads it with an
error naming the variable and the form it takes, a vLLM engine included (checked in a real process)."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from mia_stream import settings
from mia_stream.errors import SettingError

REPO = Path(__file__).resolve().parents[1]
NAME = re.compile(r"MIA_STREAM_[A-Z0-9_]*[A-Z0-9]")


def _tracked_files() -> list[Path]:
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                         capture_output=True, text=True, check=True).stdout.split()
    return [REPO / p for p in out if (REPO / p).is_file()]


def _texts() -> dict[Path, str]:
    texts = {}
    for path in _tracked_files():
        try:
            texts[path] = path.read_text()
        except UnicodeDecodeError:
            continue
    return texts


def test_every_mia_stream_name_in_the_tree_is_in_the_table_and_every_setting_is_read_somewhere():
    texts = _texts()
    found: dict[str, set] = {}
    for path, text in texts.items():
        for name in NAME.findall(text):
            found.setdefault(name, set()).add(str(path.relative_to(REPO)))
    unknown = {n: sorted(p) for n, p in found.items() if n not in settings.SETTINGS}
    assert not unknown, f"MIA_STREAM_ names missing from mia_stream/settings.py SETTINGS: {unknown}"
    table_only = ("mia_stream/settings.py", "README.md", "docs/settings.md")
    unused = [n for n in settings.SETTINGS if not (found.get(n, set()) - set(table_only))]
    assert not unused, f"settings that nothing reads or sets: {unused}"


def test_the_readme_table_is_generated_from_the_settings_table():
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "settings_table.py"), "--check"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    readme = (REPO / "docs" / "settings.md").read_text()
    for s in settings.SETTINGS.values():
        assert f"| `{s.name}` | {s.form_text()} | {s.default_text()} |" in readme


def _reads_env(node: ast.AST, names: set[str]) -> str | None:
    """The MIA_STREAM_ name an ``os.environ.get(X)`` / ``os.getenv(X)`` / ``os.environ[X]`` (load) reads, if any."""
    def name_of(arg):
        if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and arg.value.startswith("MIA_STREAM_"):
            return arg.value
        if isinstance(arg, ast.Name) and arg.id in names:
            return arg.id
        return None

    if isinstance(node, ast.Call) and node.args:
        f = ast.unparse(node.func)
        if f in ("os.environ.get", "os.getenv", "environ.get", "getenv", "os.environ.pop"):
            return name_of(node.args[0])
    if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and ast.unparse(node.value) == "os.environ":
        return name_of(node.slice)
    return None


def test_nothing_but_the_settings_module_parses_a_mia_stream_variable():
    offenders = []
    for path, text in _texts().items():
        if path.suffix != ".py" or path == REPO / "mia_stream" / "settings.py" or path == Path(__file__):
            continue
        tree = ast.parse(text)
        consts = {t.id for node in ast.walk(tree) if isinstance(node, ast.Assign)
                  and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
                  and node.value.value.startswith("MIA_STREAM_") for t in node.targets if isinstance(t, ast.Name)}
        for node in ast.walk(tree):
            name = _reads_env(node, consts)
            if name is not None:
                offenders.append(f"{path.relative_to(REPO)}:{node.lineno} reads {name}")
    assert not offenders, "read MIA_STREAM_ settings through mia_stream.settings getters:\n" + "\n".join(offenders)


@pytest.mark.parametrize("name,value,form", [
    ("MIA_STREAM_APERTURE_ROWS", "abc", "a whole number >= 1"),
    ("MIA_STREAM_APERTURE_ROWS", "0", "a whole number >= 1"),
    ("MIA_STREAM_HOST_RING_MB", "lots", "a size of at least 1M: MiB as a plain number"),
    ("MIA_STREAM_SHM_BYTES", "12 parsecs", "a size: bytes as a plain number"),
    ("MIA_STREAM_STEERING", "maybe", "1/true/yes/on or 0/false/no/off"),
    ("MIA_STREAM_KERNELS", "fast", "one of auto, triton, reference"),
])
def test_a_value_that_does_not_parse_names_the_variable_and_the_form(monkeypatch, name, value, form):
    monkeypatch.setenv(name, value)
    getter = {"int": settings.get_int, "size": settings.get_size, "flag": settings.get_flag,
              "choice": settings.get_choice}[settings.SETTINGS[name].form]
    with pytest.raises(SettingError) as err:
        getter(name)
    assert str(err.value).startswith(f"{name}={value!r}: expected {form}")
    assert isinstance(err.value, ValueError)


def test_values_parse_in_their_forms_and_units(monkeypatch):
    for value, expected in (("64", 64 << 20), ("1G", 1 << 30), ("512MiB", 512 << 20), (" 2048k ", 2 << 20)):
        monkeypatch.setenv("MIA_STREAM_HOST_RING_MB", value)  # a plain number is MiB here
        assert settings.get_size("MIA_STREAM_HOST_RING_MB") == expected
    monkeypatch.setenv("MIA_STREAM_SHM_BYTES", "65536")  # ... and bytes here
    assert settings.get_size("MIA_STREAM_SHM_BYTES") == 65536
    for value, expected in (("0", False), ("off", False), ("FALSE", False), ("1", True), ("Yes", True)):
        monkeypatch.setenv("MIA_STREAM_CAPTURE_QK", value)
        assert settings.get_flag("MIA_STREAM_CAPTURE_QK") is expected
    monkeypatch.setenv("MIA_STREAM_CAPTURE_QK", "")  # empty = unset = the default
    assert settings.get_flag("MIA_STREAM_CAPTURE_QK") is True
    monkeypatch.delenv("MIA_STREAM_APERTURE_ROWS", raising=False)
    assert settings.get_int("MIA_STREAM_APERTURE_ROWS") is None  # the engine's step budget, computed where read
    bogus = "MIA_STREAM_" + "NOT_A_SETTING"  # spelled apart: the tree scan above would find it
    with pytest.raises(SettingError, match=f"{bogus} is not a mia_stream setting"):
        settings.get_int(bogus)


def test_a_vllm_engine_with_a_setting_that_does_not_parse_fails_to_start_naming_it(model_dir, tmp_path):
    """A real vLLM engine start (the plugin active) in its own process: the frontend reads the engine settings
    when vLLM builds it, so the start fails at once with the variable's name, not with a bare int() error."""
    code = ("from vllm import LLM\n"
            f"LLM({model_dir!r}, dtype='float32', enforce_eager=True, max_model_len=256)\n")
    env = dict(os.environ, MIA_STREAM_BROKER=str(tmp_path), MIA_STREAM_APERTURE_ROWS="abc",
               VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1", PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "SettingError: MIA_STREAM_APERTURE_ROWS='abc': expected a whole number >= 1" in proc.stderr, \
        proc.stderr[-3000:]
