"""Quantized capture (``capture.quantize``, issue 29): which formats a step's rows are quantized to on the device
before the host copy, and the parts of the host-ring chunk that carry them.

Rule: ``QuantizeState`` owns the count of live capturing requests per format (``""`` = not quantized), changed
only by ``add``/``remove`` (the runtime's add_request/finish_request). At ``end_step`` it adds, for each
captured part (hs, q, k) and each format some live request wants, the quantized rows and their per-row scales
(parts ``"hs:int8"`` and ``"hs:int8:scale"``, ...), and leaves out the raw part when no live request wants it.
The drain reads a request's rows from the part of its format (``_quantized_rows``, which needs no torch). One
quantizing pass over the step's used rows of the captured layers per part and format; no per-request Python.

Memory: the first format's outputs are written into the device state's workspace (``{part}_quantized`` and its
scales, reserved at engine start inside vLLM's budget when MIA_STREAM_QUANTIZE=1; reused every step under the
apertures' discipline: the next step writes it only after its forward, which waits for the last host copy or
copies from the staging). A second format live in the same step is allocated for that step.
"""

from __future__ import annotations

from collections import Counter

import torch

from mia_stream.kernels.quantize import QUANT_FORMATS, quantize_rows
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

    def parts(self, parts: list, state=None) -> list:
        """``parts`` (``(name, aperture, rows, layers)`` of a step) with the quantized parts added, and the raw
        ones dropped when no live request reads them. ``state``: the device state holding the workspace."""
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
            src, index = ap[:, :rows], None
            if len(layers) != ap.shape[0]:  # the kernel picks the layers in place (no copy of them)
                key = (layers, ap.device)
                index = self._index.get(key)
                if index is None:
                    if len(self._index) > 1024:  # layer sets come and go with requests
                        self._index.clear()
                    index = self._index[key] = torch.tensor(layers, device=ap.device)
            shape = (len(layers), rows, ap.shape[2])
            for i, fmt in enumerate(formats):
                reserved = _workspace(state, name, shape, fmt) if i == 0 else None
                q, scale = quantize_rows(src, fmt, reserved, layers=index)
                out.append((f"{name}:{fmt}", q, rows, layers))
                out.append((f"{name}:{fmt}{SCALE_SUFFIX}", scale, rows, layers))
        return out


def _workspace(state, name: str, shape: tuple, fmt: str):
    """Contiguous ``(q, scale)`` views at the start of the reserved workspace of part ``name``, of ``shape``
    ``[layers, rows, W]``; None where there is none (MIA_STREAM_QUANTIZE=0, or tests without a state)."""
    ws = getattr(state, f"{name}_quantized", None)
    if ws is None:
        return None
    scales = getattr(state, f"{name}_quantized_scale")
    n = shape[0] * shape[1]
    q = ws.view(-1)[:n * shape[2]].view(shape).view(QUANT_FORMATS[fmt][0])
    return q, scales.view(-1)[:n].view(*shape[:-1], 1)
