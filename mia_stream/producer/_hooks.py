"""How the producer enters vLLM: a post-import hook and ONE patch helper that checks signatures when it installs.

Generic machinery, no vLLM names: ``_vllm_adapter`` says which vLLM modules and functions are patched and with
what. ``hook`` is the one place a vLLM function is replaced (as nnsight's vLLM worker enters vLLM in one
documented place). Owns no state beyond the finder it puts on ``sys.meta_path``.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import inspect
import sys
from typing import Any, Callable

from mia_stream.errors import UnsupportedVLLMError


class PostImportHook(importlib.abc.MetaPathFinder):
    """Runs ``patches[name](module)`` right after ``name`` is imported, so a process never imports a module for
    the sake of patching it (the API server never imports runner code)."""

    def __init__(self, patches: dict[str, Callable[[Any], None]]):
        self.patches = patches

    def find_spec(self, fullname, path, target=None):
        if fullname not in self.patches:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return None
        loader, patch = spec.loader, self.patches[fullname]

        class _Loader(importlib.abc.Loader):
            def create_module(self, s):
                return loader.create_module(s)

            def exec_module(self, module):
                loader.exec_module(module)
                patch(module)

        spec.loader = _Loader()
        return spec


def positional_names(fn) -> list[str]:
    return [p.name for p in inspect.signature(fn).parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


def hook(owner, name: str, make: Callable[[Callable], Callable], *, expects: tuple | None = None,
         own: bool = False, required: bool = True, supported: str = "") -> bool:
    """Replace vLLM's ``owner.<name>`` (a method of a class, or a function of a module) with ``make(original)``.

    Before it installs, vLLM's signature is checked: its leading positional parameters must be named as the
    wrapper's (``expects`` when given, else the wrapper's own positional parameters before ``*args``), since the
    wrapper reads those arguments by position or name. A mismatch, or a missing function (``required``), raises
    ``UnsupportedVLLMError`` naming the function: the engine fails at start, not at a request. ``own``: the
    attribute must be the class's own (not inherited). Returns whether it installed."""
    where = f"{getattr(owner, '__module__', '')}.{getattr(owner, '__qualname__', getattr(owner, '__name__', owner))}"
    if isinstance(owner, type(sys)):
        where = owner.__name__
    orig = owner.__dict__.get(name) if own else getattr(owner, name, None)
    if orig is None:
        if not required:
            return False
        raise UnsupportedVLLMError(f"mia_stream: vLLM's {where}.{name} not found; this vLLM is not supported "
                                   f"({supported})")
    wrapper = make(orig)
    want = list(expects) if expects is not None else positional_names(wrapper)
    try:
        have = positional_names(orig)
    except (TypeError, ValueError):  # no signature to read (a builtin): nothing to check against
        have = want
    if have[:len(want)] != want:
        raise UnsupportedVLLMError(
            f"mia_stream: vLLM's {where}.{name} takes ({', '.join(have)}); the producer hooks it expecting "
            f"({', '.join(want)}, ...). This vLLM is not supported ({supported})")
    wrapper.__wrapped__ = orig
    setattr(owner, name, wrapper)
    return True
