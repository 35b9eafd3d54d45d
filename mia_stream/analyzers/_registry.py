"""Which analyzers exist: the built-in ones and those other packages register through the entry point group
``mia_stream.analyzers`` (``name = "module:Class"``); and how a config file becomes an analyzer."""

from __future__ import annotations

import importlib
import json
from importlib import metadata
from pathlib import Path
from typing import Any

from mia_stream.errors import AnalyzerConfigError, AnalyzerError

try:
    import tomllib
except ImportError:  # Python 3.10: JSON configs only
    tomllib = None

ENTRY_POINT_GROUP = "mia_stream.analyzers"

# Built-in analyzers, also declared in pyproject.toml's entry point group; listed here too so that a source
# checkout whose installed metadata predates an analyzer (an editable install) still finds it.
BUILTIN: dict[str, str] = {
    "hidden_states": "mia_stream.analyzers.hidden_states:HiddenStates",
    "attention_tracker": "mia_stream.analyzers.attention_tracker:AttentionTracker",
    "core_reranker": "mia_stream.analyzers.core_reranker:CoreReranker",
    "attnlink": "mia_stream.analyzers.attnlink:AttnLink",
    "hnode": "mia_stream.analyzers.hnode:HNode",
    "science_hallucination": "mia_stream.analyzers.science_hallucination:ScienceHallucination",
    "token_probe": "mia_stream.analyzers.token_probe:TokenProbe",
    "semantic_entropy_probe": "mia_stream.analyzers.semantic_entropy_probe:SemanticEntropyProbe",
    "lookback_ratio": "mia_stream.analyzers.lookback_ratio:LookbackRatio",
}


def available() -> dict[str, str]:
    """name -> "module:Class" of every analyzer that can be run (entry points may add and override)."""
    found = dict(BUILTIN)
    try:
        eps = metadata.entry_points(group=ENTRY_POINT_GROUP)
    except Exception:  # a broken distribution elsewhere must not hide the built-in analyzers
        eps = ()
    for ep in eps:
        found[ep.name] = ep.value
    return dict(sorted(found.items()))


def analyzer_class(name: str) -> type:
    """The Analyzer subclass registered as ``name``; AnalyzerError naming the known ones otherwise."""
    from mia_stream.analyzers._base import Analyzer

    target = available().get(name)
    if target is None:
        raise AnalyzerError(f"unknown analyzer {name!r}; available: {', '.join(available())}")
    module, _, qual = target.partition(":")
    try:
        obj: Any = importlib.import_module(module)
        for part in qual.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as e:
        raise AnalyzerError(f"analyzer {name!r} is registered as {target!r}, which does not load: {e}") from None
    if not (isinstance(obj, type) and issubclass(obj, Analyzer)):
        raise AnalyzerError(f"analyzer {name!r} ({target}) is not a mia_stream.analyzers.Analyzer subclass")
    return obj


def load_config(path: str | Path | None) -> dict:
    """An analyzer config file: a JSON or TOML object. AnalyzerConfigError (one line) when unreadable."""
    if path is None:
        return {}
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise AnalyzerConfigError(f"config file {p}: {e.strerror or e}") from None
    toml = p.suffix.lower() == ".toml"
    if toml and tomllib is None:
        raise AnalyzerConfigError(f"config file {p}: TOML needs Python 3.11+; use JSON")
    try:
        if toml:
            data = tomllib.loads(text)
        else:
            data = json.loads(text)
    except json.JSONDecodeError as e:
        raise AnalyzerConfigError(f"config file {p}: not valid JSON: {e.msg} at line {e.lineno} column "
                                  f"{e.colno}") from None
    except ValueError as e:  # tomllib.TOMLDecodeError
        raise AnalyzerConfigError(f"config file {p}: not valid TOML: {e}") from None
    if not isinstance(data, dict):
        raise AnalyzerConfigError(f"config file {p}: must hold an object of config keys, got "
                                  f"{type(data).__name__}")
    return data


def create(name: str, config: dict | None = None):
    """The analyzer ``name`` configured with ``config`` (its defaults for keys not given)."""
    return analyzer_class(name)(config)
