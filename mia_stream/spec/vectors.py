"""Named steering vectors: register once (``mia-stream vectors add NAME FILE``), reference by name.

Vectors live as float32 ``.npy`` files in ``$MIA_STREAM_VECTORS`` (default ``~/.cache/mia_stream/vectors``),
shared by every engine on the machine. Each version of a vector is also kept, write-once, under its content
digest (``.by-digest/DIGEST.npy``): the frontend hands the engine a named op as ``{"name", "digest"}`` and the
worker loads exactly the vector the frontend checked, even if the name is registered again in between. A
request steering 32 layers of an 8B model by name then moves 32 short strings through vLLM, the drain and the
bus instead of 512 KiB of vectors (1 MiB as float lists on the wire).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np

from mia_stream import settings
from mia_stream.spec._stored import DIGEST as _DIGEST
from mia_stream.spec._stored import NAME, registry_main, replace_atomically

_NAME = NAME


__all__ = ["list_vectors", "load_vector", "main", "named_vector", "register_vector", "vector_by_digest",
           "vector_digest", "vector_version", "vectors_dir"]

def vectors_dir() -> Path:
    key = (settings.raw("MIA_STREAM_VECTORS"), settings.raw("MIA_STREAM_CACHE"), os.environ.get("HOME"))
    hit = _dir_of.get(key)
    if hit is None:  # resolved once per environment: ~50 µs a call, and admission resolves every named op
        from mia_stream.model import cache_dir

        hit = _dir_of[key] = settings.get_path("MIA_STREAM_VECTORS") or cache_dir() / "vectors"
    return hit


_dir_of: dict[tuple, Path] = {}


def _path(name: str) -> Path:
    if not _NAME.match(name):
        raise ValueError(f"vector name {name!r} must match {_NAME.pattern}")
    return vectors_dir() / f"{name}.npy"


def register_vector(name: str, vector) -> Path:
    """Store ``vector`` (1-D, finite) under ``name``; replaces an existing one atomically."""
    arr = np.asarray(vector, dtype=np.float32)
    if arr.ndim != 1 or arr.size == 0:
        raise ValueError(f"a steering vector is 1-D and non-empty, got shape {arr.shape}")
    if not np.all(np.isfinite(arr)):
        raise ValueError("steering vector contains NaN or inf")
    path = _path(name)
    path.parent.mkdir(parents=True, exist_ok=True)
    _keep_by_digest(arr, vector_digest(arr))
    _write_atomically(path, arr)
    return path


def vector_digest(arr: np.ndarray) -> str:
    """The content digest of a float32 vector (what a normalized named op carries)."""
    return hashlib.blake2b(np.ascontiguousarray(arr, dtype="<f4").tobytes(), digest_size=16).hexdigest()


def _write_atomically(path: Path, arr: np.ndarray) -> None:
    replace_atomically(path, lambda f: np.save(f, arr))


def _digest_path(digest: str) -> Path:
    if not _DIGEST.match(digest):
        raise ValueError(f"vector digest {digest!r} must be 32 hex digits")
    return vectors_dir() / ".by-digest" / f"{digest}.npy"


def _keep_by_digest(arr: np.ndarray, digest: str) -> None:
    path = _digest_path(digest)
    if not path.exists():  # write-once: a digest names one content forever
        path.parent.mkdir(parents=True, exist_ok=True)
        _write_atomically(path, arr)



def vector_version(name: str) -> tuple | None:
    """What changes when the vector ``name`` is registered again (None: there is none, or a bad name)."""
    try:
        path = _path(name)
        st = os.stat(path)
    except (OSError, ValueError):
        return None
    return (str(path), st.st_mtime_ns, st.st_size, st.st_ino)


def load_vector(name: str) -> np.ndarray:
    """The registered vector ``name`` (read-only); ``KeyError`` if there is none.

    Read once per file version: a request steering every layer of an 8B model by name resolves 32 names, and an
    ``np.load`` each (~60 µs) was most of its admission; a stat (~2 µs) sees a replaced file."""
    path = _path(name)  # a bad name is a ValueError, as before
    version = vector_version(name)
    if version is None:
        _loaded.pop(name, None)
        raise KeyError(name)
    hit = _loaded.get(name)
    if hit is not None and hit[0] == version:
        return hit[1]
    arr = np.load(path)
    arr.setflags(write=False)
    if len(_loaded) >= _CACHE_ENTRIES:
        _loaded.pop(next(iter(_loaded)))
    _loaded[name] = (version, arr)
    return arr


_CACHE_ENTRIES = 4096
_loaded: dict[str, tuple[tuple, np.ndarray]] = {}


def named_vector(name: str) -> tuple[np.ndarray, str]:
    """The registered vector ``name`` and its digest; its version is kept under the digest (for
    ``vector_by_digest``). ``KeyError`` if there is none."""
    arr = load_vector(name)
    hit = _digests.get(id(arr))
    if hit is None or hit[0] is not arr:
        digest = vector_digest(arr)
        _keep_by_digest(arr, digest)  # vectors placed by hand or by an older mia_stream have no copy yet
        if len(_digests) >= _CACHE_ENTRIES:
            _digests.pop(next(iter(_digests)))
        hit = _digests[id(arr)] = (arr, digest)
    return arr, hit[1]


_digests: dict[int, tuple[np.ndarray, str]] = {}  # id(loaded array) -> (array, digest): one hash per version


def vector_by_digest(digest: str) -> np.ndarray:
    """The vector of content ``digest`` (read-only; read once: a digest's file never changes); ``KeyError`` if
    no vector of that content was registered on this machine."""
    arr = _by_digest.get(digest)
    if arr is None:
        try:
            arr = np.load(_digest_path(digest))
        except FileNotFoundError:
            raise KeyError(digest) from None
        arr.setflags(write=False)
        if len(_by_digest) >= _CACHE_ENTRIES:
            _by_digest.pop(next(iter(_by_digest)))
        _by_digest[digest] = arr
    return arr


_by_digest: dict[str, np.ndarray] = {}


def list_vectors() -> dict[str, int]:
    d = vectors_dir()
    return {p.stem: int(np.load(p, mmap_mode="r").shape[0]) for p in sorted(d.glob("*.npy"))} if d.exists() else {}


def _read_file(path: str) -> np.ndarray:
    if path.endswith(".npy"):
        return np.load(path)
    if path.endswith(".json"):
        import json

        return np.asarray(json.loads(Path(path).read_text()), dtype=np.float32)
    return np.loadtxt(path, dtype=np.float32).reshape(-1)


def main(argv: list[str]) -> int:
    return registry_main(
        argv, prog="mia-stream vectors", description=__doc__.splitlines()[0],
        add_help="register FILE (.npy, .json list, or whitespace-separated text) as NAME",
        list_help="list registered vectors and their lengths",
        add=lambda name, file: register_vector(name, _read_file(file)),
        rows=lambda: (f"{name}\t{n}" for name, n in list_vectors().items()), path_of=_path,
        errors=(ValueError, OSError, KeyError))
