"""Which implementation a kernel call uses (Triton or the torch reference), and a record of what ran.

``MIA_STREAM_KERNELS`` picks the backend:

- unset / ``auto``: Triton for CUDA tensors when Triton imports, the torch reference otherwise;
- ``triton``: always Triton (on CPU this needs ``TRITON_INTERPRET=1`` set before Triton is imported);
- ``reference``: always the torch reference.

The record (``last_backend``, ``backend_calls``) is host-side Python state: it counts the calls that ran
Python (eager calls, and the one call made while a CUDA graph is captured), not graph replays.
"""

from __future__ import annotations

from collections import Counter
from typing import Literal

import torch

from mia_stream import settings

Backend = Literal["triton", "reference"]

ENV_VAR = "MIA_STREAM_KERNELS"

_triton_importable: bool | None = None
_last_backend: dict[str, Backend] = {}
_calls: Counter[tuple[str, Backend]] = Counter()


def _triton_available() -> bool:
    global _triton_importable
    if _triton_importable is None:
        try:
            import triton  # noqa: F401
            import triton.language  # noqa: F401

            _triton_importable = True
        except Exception:  # an ImportError, or a broken install that fails while importing
            _triton_importable = False
    return _triton_importable


def _requested() -> str:
    return settings.get_choice(ENV_VAR)


def active_backend(device: torch.device | str) -> Backend:
    """The implementation a kernel call on tensors of ``device`` uses now."""
    choice = _requested()
    if choice == "reference":
        return "reference"
    if choice == "triton":
        if not _triton_available():
            raise RuntimeError(f"{ENV_VAR}=triton but Triton cannot be imported")
        return "triton"
    return "triton" if torch.device(device).type == "cuda" and _triton_available() else "reference"


def _record(op: str, backend: Backend) -> None:
    _last_backend[op] = backend
    _calls[(op, backend)] += 1


def last_backend(op: str) -> Backend | None:
    """The backend the last Python-level call of ``op`` ("scatter_rows" or "steer_rows") used, or None."""
    return _last_backend.get(op)


def backend_calls() -> dict[tuple[str, Backend], int]:
    """How many Python-level calls each (op, backend) pair served since start (or ``reset_backend_record``)."""
    return dict(_calls)


def reset_backend_record() -> None:
    _last_backend.clear()
    _calls.clear()
