"""Quantized capture (``capture.quantize``, issue 29): which formats a step's rows are quantized to on the device
before the host copy, and the parts of the host-ring chunk that carry them.

Rule: ``QuantizeState`` owns the count of live capturing requests per format (``""`` = not quantized), changed
only by ``add``/``remove`` (the runtime's add_request/finish_request). At ``end_step`` it adds, for each
captured part (hs, q, k) and each format some live request wants, the quantized rows and their per-row scales
(parts ``"hs:int8"`` and ``"hs:int8:scale"``, ...), and leaves out the raw part when no live request wants it.
The drain reads a request's rows from the part of its format (``_quantized_rows``, which needs no torch). One
quantizing pass over the step's used rows of the captured layers per part and format; no per-request Python.
"""

from __future__ import annotations

from collections import Counter

import torch

from mia_stream.kernels.quantize import quantize_rows
from mia_stream.producer._quantized_rows import SCALE_SUFFIX


class QuantizeState:
    def __init__(self):
        self.live: Counter = Counter()  # format ("" = raw) -> live capturing requests
        # (layers, device) -> that index on the device: made once, so a step never copies host -> device (a
        # pageable copy would wait for the forward)
        self._index: dict = {}

    def add(self, spec) -> None:
        if spec.captures:
            self.live[spec.quantize] += 1

    def remove(self, spec) -> None:
        if spec.captures and self.live[spec.quantize] > 0:
            self.live[spec.quantize] -= 1

    def parts(self, parts: list) -> list:
        """``parts`` (``(name, aperture, rows, layers)`` of a step) with the quantized parts added, and the raw
        ones dropped when no live request reads them."""
        formats = [f for f, n in self.live.items() if f and n > 0]
        if not formats:
            return parts
        raw = self.live.get("", 0) > 0
        out = []
        for name, ap, rows, layers in parts:
            if name not in ("hs", "q", "k"):
                out.append((name, ap, rows, layers))
                continue
            if raw:
                out.append((name, ap, rows, layers))
            if len(layers) == ap.shape[0]:
                src = ap[:, :rows]
            else:
                key = (layers, ap.device)
                index = self._index.get(key)
                if index is None:
                    if len(self._index) > 1024:  # layer sets come and go with requests
                        self._index.clear()
                    index = self._index[key] = torch.tensor(layers, device=ap.device)
                src = ap[:, :rows].index_select(0, index)
            for fmt in formats:
                q, scale = quantize_rows(src, fmt)
                out.append((f"{name}:{fmt}", q, rows, layers))
                out.append((f"{name}:{fmt}{SCALE_SUFFIX}", scale, rows, layers))
        return out
