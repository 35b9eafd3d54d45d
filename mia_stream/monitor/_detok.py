"""Token ids -> text pieces, with the tokenizer a stream names (``StreamStart.tokenizer``, else ``.model``).

Only local files are read: a directory holding ``tokenizer.json`` (what vLLM's model dirs and the embedded model
have) loads with the ``tokenizers`` library; anything else is tried through ``transformers`` with
``local_files_only`` (a Hugging Face id already in the local cache). Nothing is downloaded. A stream whose
tokenizer cannot be loaded shows its ids (``#1234``) and the reason.

Pieces come from ``tokenizers.decoders.DecodeStream``: byte-level tokens that end inside a UTF-8 character give
an empty piece and the character shows on the token that completes it, so the pieces concatenate to the text.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any, Callable

log = logging.getLogger("mia_stream.monitor")


def _load(name: str) -> Any:
    """A ``tokenizers.Tokenizer`` for ``name`` (a local path or a cached Hugging Face id); raises on failure."""
    from tokenizers import Tokenizer

    path = Path(name).expanduser()
    if path.is_file() and path.name.endswith(".json"):
        return Tokenizer.from_file(str(path))
    if (path / "tokenizer.json").is_file():
        return Tokenizer.from_file(str(path / "tokenizer.json"))
    if name.startswith(("/", ".", "~")) and not path.exists():
        raise FileNotFoundError(f"no such file or directory: {name}")
    from transformers import AutoTokenizer  # slow import (5-15 s here): only for what tokenizer.json cannot serve

    tok = AutoTokenizer.from_pretrained(name, local_files_only=True)
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is None:
        raise ValueError(f"{name}: only fast tokenizers are supported (this one is {type(tok).__name__})")
    return backend


class Tokenizers:
    """Tokenizers by name, loaded on threads of their own (a ``transformers`` fallback can take seconds: neither
    the ingest nor the web server waits for it); ``on_loaded`` is called when one finished loading or failed."""

    def __init__(self, override: str | None = None, on_loaded: Callable[[], None] | None = None):
        self.override = override
        self.on_loaded = on_loaded
        self._loaded: dict[str, tuple[Any, str | None]] = {}
        self._loading: set[str] = set()
        self._lock = threading.Lock()

    def lookup(self, *names: str) -> tuple[Any, str | None, bool]:
        """(tokenizer or None, why not, final) for the first usable of ``names`` (the override, when set, wins).
        Never blocks: a name not loaded yet starts loading and gives (None, "loading ...", False)."""
        candidates = [self.override] if self.override else [n for n in names if n]
        if not candidates:
            return None, "the stream names no tokenizer or model", True
        errors = []
        for name in candidates:
            with self._lock:
                hit = self._loaded.get(name)
                if hit is None:
                    if name not in self._loading:
                        self._loading.add(name)
                        threading.Thread(target=self._load, args=(name,), name="monitor-tokenizer",
                                         daemon=True).start()
                    return None, f"loading tokenizer {name}", False
            if hit[0] is not None:
                return hit[0], None, True
            errors.append(hit[1])
        return None, "; ".join(errors), True

    def _load(self, name: str) -> None:
        try:
            hit = (_load(name), None)
        except Exception as e:  # any loader failure is a per-stream notice, never a crash
            hit = (None, f"cannot load tokenizer {name!r}: {type(e).__name__}: {e}")
            log.warning("mia-stream monitor: %s", hit[1])
        with self._lock:
            self._loaded[name] = hit
            self._loading.discard(name)
        if self.on_loaded is not None:
            self.on_loaded()


class PieceDecoder:
    """One request's incremental detokenizer: ``extend(ids)`` returns one text piece per id."""

    __slots__ = ("tokenizer", "_stream")

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self._stream = None
        if tokenizer is not None:
            from tokenizers.decoders import DecodeStream

            self._stream = DecodeStream(skip_special_tokens=False)

    def extend(self, ids: list[int]) -> list[str]:
        if self._stream is None:
            return [f"#{i} " for i in ids]
        out = []
        step, tok = self._stream.step, self.tokenizer
        for i in ids:
            try:
                piece = step(tok, int(i))
            except Exception:  # an id outside the vocabulary: show it, keep decoding the rest
                piece = f"#{i}"
            out.append(piece or "")
        return out
