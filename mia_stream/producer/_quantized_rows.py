"""Quantized rows in the drain (``capture.quantize``, issue 29): a quantizing request's rows and per-row scales
come from its format's parts of the step's host-ring chunk (``_quantize.QuantizeState`` put them there); they
travel as int8 or float8_e4m3fn tensors with a scale buffer (docs/wire-format.md 4.7). No torch here (the drain
runs in the sidecar).
"""

from __future__ import annotations

import numpy as np

SCALE_SUFFIX = ":scale"
_WIRE_DTYPES = {"int8": "int8", "fp8_e4m3": "float8_e4m3fn"}

_HOST_DTYPES = {"int8": np.int8, "fp8_e4m3": np.uint8}  # fp8 rows travel as their bytes (wire float8_e4m3fn)


def request_formats(streams: dict, eids: list) -> np.ndarray | None:
    """Each request's ``capture.quantize`` (``""`` raw) by request index of a step, or None when none quantizes
    (the common case: no per-request work)."""
    formats = [getattr(streams.get(eid), "quantize", "") for eid in eids]
    return np.asarray(formats, dtype=object) if any(formats) else None


def by_format(groups: list, masks: list, formats: np.ndarray | None):
    """``(group, mask, format)``: each group's kept segments split by their requests' format."""
    for g, m in zip(groups, masks):
        if formats is None:
            yield g, m, ""
            continue
        of = formats[g.req]
        for fmt in dict.fromkeys(of[m].tolist()):
            yield g, m & (of == fmt), fmt


def quantized_hosts(ring, parts: dict, fmt: str, head_dim: int) -> dict:
    """The host-ring views of format ``fmt``'s parts, as the drain's raw ones: ``name -> (array, layers)`` for
    hs, q, k (None when not captured this step) and their scales ``name + ":scale"``, and the wire ``dtype``."""
    out: dict = {"dtype": _WIRE_DTYPES[fmt]}
    for name in ("hs", "q", "k"):
        part = parts.get(f"{name}:{fmt}")
        if part is None:
            out[name] = None
            continue
        off, layers, rows, width = part
        arr = ring.view(off, len(layers) * rows * width).view(_HOST_DTYPES[fmt]).reshape(len(layers), rows, width)
        if name != "hs":
            arr = arr.reshape(len(layers), rows, -1, head_dim)
        out[name] = (arr, layers)
        s_off, _, _, _ = parts[f"{name}:{fmt}{SCALE_SUFFIX}"]
        out[name + SCALE_SUFFIX] = (ring.view(s_off, len(layers) * rows * 4).view(np.float32)
                                    .reshape(len(layers), rows, 1), layers)
    return out


def row_scale(hosts: dict, name: str, layers: tuple, rows, take) -> np.ndarray | None:
    """The per-row scales of ``name``'s rows ``rows`` at ``layers`` (shaped to broadcast: ``[L, N, 1]``, q/k
    ``[L, N, 1, 1]``), copied out of the ring; None for raw rows."""
    scales = hosts.get(name + SCALE_SUFFIX)
    if scales is None:
        return None
    data, _ = take(scales, layers, rows)
    data = np.array(data, dtype=np.float32)  # a copy: the ring chunk is released after publication
    return data if name == "hs" else data[..., None]
