"""``RequestTable``: per-request state as rows of numpy arrays (analyzers' running sums, alert policies' windows).

Owns nothing global: each table owns its rows, indexed by request id; a released row is zeroed when reused.
"""

from __future__ import annotations

from typing import Any, Iterable

import numpy as np


class RequestTable:
    """Per-request state as rows of numpy arrays, so an analyzer updates all requests of a step at once.

        table = RequestTable(sum=((30, 576), np.float64), count=((), np.int64))
        slots = table.slots(batch.request_ids)      # int64 [R]: new requests get zeroed rows
        table["sum"][slots] += step_sums             # one vectorized update for the whole step
        table.release("req-1")                       # its row is reused (and zeroed) later
    """

    def __init__(self, **columns: tuple):
        self._specs = {name: (tuple(shape), np.dtype(dtype)) for name, (shape, dtype) in columns.items()}
        self._index: dict[str, int] = {}
        self._free: list[int] = []
        self._capacity = 0
        self._arrays: dict[str, np.ndarray] = {n: np.zeros((0, *s), d) for n, (s, d) in self._specs.items()}

    def __getitem__(self, name: str) -> np.ndarray:
        return self._arrays[name]

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._index

    def __len__(self) -> int:
        return len(self._index)

    def add_column(self, name: str, shape: tuple, dtype: Any) -> None:
        """A column whose shape is known only later (e.g. the hidden size, from the first stream)."""
        self._specs[name] = (tuple(shape), np.dtype(dtype))
        self._arrays[name] = np.zeros((self._capacity, *shape), dtype)

    def slot(self, request_id: str) -> int | None:
        return self._index.get(request_id)

    def slots(self, request_ids: Iterable[str]) -> np.ndarray:
        """The row of each request (allocated, zeroed, for one not seen before)."""
        index = self._index
        out = []
        for rid in request_ids:
            s = index.get(rid)
            if s is None:
                s = index[rid] = self._allocate()
            out.append(s)
        return np.asarray(out, dtype=np.int64)

    @staticmethod
    def rows_of(slots: np.ndarray) -> Any:
        """``slots`` as a basic slice when they are consecutive (the usual case: requests keep their order from
        step to step), so ``table[name][rows] += x`` updates in place instead of gathering and scattering."""
        n = len(slots)
        if n and int(slots[-1]) - int(slots[0]) == n - 1 and (n < 2 or (np.diff(slots) == 1).all()):
            return slice(int(slots[0]), int(slots[0]) + n)
        return slots

    def release(self, request_id: str) -> None:
        s = self._index.pop(request_id, None)
        if s is not None:
            self._free.append(s)

    def _allocate(self) -> int:
        if not self._free:
            grow = max(16, self._capacity)
            for name, (shape, dtype) in self._specs.items():
                old = self._arrays[name]
                new = np.zeros((self._capacity + grow, *shape), dtype)
                new[:self._capacity] = old
                self._arrays[name] = new
            self._free.extend(range(self._capacity + grow - 1, self._capacity - 1, -1))
            self._capacity += grow
        s = self._free.pop()
        for a in self._arrays.values():
            a[s] = 0
        return s
