"""The monitor's one score-selection rule, used by the page (``_state``; the browser shows the key the server
sends, or one the user picks) and the terminal view (``terminal``).

A score is a per-row scalar value of an ``analysis`` stream, named ``ANALYZER.VALUE``: a value of one number per
row (shape ``[rows]`` or ``[rows, 1]``), of an analyzer that published at least one row at a token position
(position >= 0; rows at -1 are request-level results, not token scores). Tokens are coloured by ``--score``
when given, else by the first score whose value name looks like a risk (``risk``, then ``p_...``, ``prob``,
``score``), else by the first score seen.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import numpy as np

# value names that look like a risk score, preferred in this order when --score is not given
RISK_HINTS = ("risk", "p_", "prob", "score")


def scalar_column(arr: np.ndarray, rows: int) -> np.ndarray | None:
    """``arr`` as one float64 per row (``[rows]``), when it is a per-row scalar; else None."""
    arr = np.asarray(arr)
    if arr.shape[:1] != (rows,) or not (arr.ndim == 1 or (arr.ndim == 2 and arr.shape[1] == 1)):
        return None
    return arr.reshape(rows).astype(np.float64)


def new_score_keys(known: list[str], analyzer: str, scalars: Iterable[str], positions: Sequence[int]) -> None:
    """Add to ``known`` (first seen first) the score keys of one analysis message: its scalar values' names,
    when any of its rows is at a token position."""
    if any(p >= 0 for p in positions):
        for name in scalars:
            key = f"{analyzer}.{name}"
            if key not in known:
                known.append(key)


def choose_score_key(keys: Sequence[str], pinned: str | None = None) -> str | None:
    """The score tokens are coloured by: ``pinned`` (``--score``), else the first of ``keys`` whose value
    name looks like a risk (``RISK_HINTS``, in order), else the first of ``keys`` (None: no score yet)."""
    if pinned:
        return pinned
    for hint in RISK_HINTS:
        for k in keys:
            if hint in k.rsplit(".", 1)[-1]:
                return k
    return keys[0] if keys else None
