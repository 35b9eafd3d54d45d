"""Tensor entries (spec section 4): a ``Tensor`` to a header entry and its buffers, and validated entries back.

A payload goes inline as a buffer frame, or into the producer's ring through the out-of-band hook (``_oob``),
the entry then naming its position (spec section 9). Decoding reads only entries ``_validate`` has checked.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from mia_stream.errors import MalformedFrameError, ShmUnavailableError
from mia_stream.schemas._framing import SHM_RING_KEY, _len
from mia_stream.schemas._oob import BufferSink, BufferSource
from mia_stream.schemas._tensors import WIRE_DTYPES, Tensor, byte_view, compress, crc32, decompress, verify_crc32
from mia_stream.schemas._validate import _Entry


def _encode_tensor(t: Tensor, compression: str, checksum: bool, buffers: list, shm: BufferSink | None) -> dict:
    method = t.meta.get("compression", compression)
    raw = t.buffer()
    entry: dict[str, Any] = {"name": t.name, "dtype": t.dtype, "shape": list(t.shape),
                             "layers": list(t.layers), "raw_nbytes": t.nbytes}
    if t.meta.get("checksum", checksum):
        entry["crc32"] = crc32(raw)
    payload = compress(raw, method)
    entry["compression"] = method
    entry["nbytes"] = len(payload)
    if t.shard is not None:
        entry["shard"] = t.shard.to_wire()
    pos = shm.put(payload) if shm is not None else None
    if pos is None:
        buffers.append(payload)
    else:
        entry["shm"] = pos
    if t.scale is not None:
        entry["scale"] = {"dtype": "float32", "shape": list(t.scale.shape)}
        buffers.append(byte_view(np.ascontiguousarray(t.scale, dtype="<f4")))
    extra = {k: v for k, v in t.meta.items() if k not in ("compression", "checksum")}
    if extra:
        entry["meta"] = extra
    return entry


def _ring_of(header: dict, shm: BufferSource | None):
    """``(reader or None, ring name)`` for a header that names a ring, else None."""
    if SHM_RING_KEY not in header:
        return None
    return shm, header[SHM_RING_KEY]


def _decode_tensors(entries: list, buffers: list, verify: bool, ring: tuple | None = None,
                    take: tuple | None = None) -> list[Tensor]:
    """The tensors of ``entries`` (validated by ``_check_tensor_entries``, which gave each its buffer indices).

    ``take = (stored_rows, rows)``: each stored tensor has ``stored_rows`` along dim 1, of which only ``rows``
    (an index array) are wanted (a consumer given some requests of a step batch)."""
    out = []
    for p in entries:
        gathered = False
        if p.shm is not None:
            if ring is None:
                raise MalformedFrameError(f"tensor {p.name!r}: 'shm' without the header's {SHM_RING_KEY!r}")
            if ring[0] is None:  # only an entry that uses the ring needs a reader
                raise ShmUnavailableError(f"this message's tensors are in the shared-memory ring {ring[1]!r}; "
                                          "decode it with shm=ShmRingReader() (mia_stream.bus) on the producer's host")
            if p.layer_index is not None and p.method == "none":
                data = _gather_layers(p, ring, take)  # only this reader's layers (and rows) leave the ring
                gathered = True
            elif take is not None and p.method == "none" and len(p.shape) >= 2:
                # only this reader's rows leave the ring
                row_bytes = WIRE_DTYPES[p.dtype][1]
                for d in p.shape[2:]:
                    row_bytes *= d
                data = ring[0].gather(ring[1], p.shm, p.nbytes, p.shape[0], take[0], row_bytes, take[1])
                gathered = True
            elif p.method == "none" and getattr(ring[0], "zero_copy", False):
                payload = ring[0].view(ring[1], p.shm, p.nbytes)  # in place: the reader checks it stayed intact
                if payload.nbytes != p.nbytes:
                    raise MalformedFrameError(f"tensor {p.name!r}: ring gave {payload.nbytes} bytes, header says "
                                              f"{p.nbytes}")
            else:
                payload = ring[0].read(ring[1], p.shm, p.nbytes)
                if _len(payload) != p.nbytes:
                    raise MalformedFrameError(f"tensor {p.name!r}: ring gave {_len(payload)} bytes, header says "
                                              f"{p.nbytes}")
        else:
            payload = buffers[p.buf]
        if not gathered:
            data = decompress(payload, p.method, p.raw_nbytes)
            if verify and p.crc is not None:
                verify_crc32(p.name, data, p.crc)
        scale = None
        if p.scale is not None:
            scale = np.frombuffer(buffers[p.scale_buf], dtype="<f4").reshape(p.scale)
        shape, layers = p.shape, p.layers
        if p.layer_index is not None:  # (2.2) a selection of some stored layers
            li = p.layer_index
            shape = (len(li), *shape[1:])
            layers = tuple(layers[i] for i in li.tolist()) if layers else layers
            if not gathered:
                data = np.ascontiguousarray(np.frombuffer(data, np.uint8).reshape(p.shape[0], -1)[li])
            if scale is not None and scale.shape[0] == p.shape[0] and p.shape[0] != 1:
                scale = scale[li]
        if take is not None:
            shape = (shape[0], len(take[1]), *shape[2:])
            if not gathered:
                data = _take_rows(p, data, take, shape[0])
            if scale is not None and scale.shape[1] == take[0] and take[0] != 1:  # per row: its rows too
                scale = scale[:, take[1]]
        have = data.nbytes if type(data) is memoryview or isinstance(data, np.ndarray) else _len(data)
        want = WIRE_DTYPES[p.dtype][1]
        for d in shape:
            want *= d
        if have != want:
            raise MalformedFrameError(f"tensor {p.name!r}: {have} bytes for shape {shape} {p.dtype} (want {want})")
        out.append(Tensor(p.name, p.dtype, shape, data, layers, p.shard, scale,
                          dict(p.meta) if p.meta else {}))
    return out


def _row_bytes(p: _Entry) -> int:
    row_bytes = WIRE_DTYPES[p.dtype][1]
    for d in p.shape[2:]:
        row_bytes *= d
    return row_bytes


def _take_rows(p: _Entry, data: Any, take: tuple, outer: int) -> np.ndarray:
    """Rows ``take[1]`` (dim 1) of a stored tensor's bytes (``outer`` layers), as a new ``[L, rows, ...]`` uint8
    array."""
    arr = np.frombuffer(data, np.uint8).reshape(outer, take[0], _row_bytes(p))
    return np.ascontiguousarray(arr[:, take[1]])


def _gather_layers(p: _Entry, ring: tuple, take: tuple | None) -> np.ndarray:
    """The kept layers (``layer_index``) of an uncompressed ring payload, and of them only rows ``take`` when
    given: each layer's bytes are one range of the payload, so only those leave the ring (each read checked)."""
    stored_rows = p.shape[1]
    row_bytes = _row_bytes(p)
    layer_bytes = stored_rows * row_bytes
    if p.nbytes != p.shape[0] * layer_bytes:
        raise MalformedFrameError(f"tensor {p.name!r}: {p.nbytes} bytes are not {p.shape[0]} layers of {layer_bytes}")
    parts = []
    in_place = take is None and getattr(ring[0], "zero_copy", False)
    for li in p.layer_index.tolist():
        pos = p.shm + li * layer_bytes
        if in_place:  # one layer stays a view; several are joined (a copy of the selected layers only)
            parts.append(ring[0].view(ring[1], pos, layer_bytes))
        elif take is None:
            parts.append(np.frombuffer(ring[0].read(ring[1], pos, layer_bytes), np.uint8))
        else:
            parts.append(np.frombuffer(ring[0].gather(ring[1], pos, layer_bytes, 1, take[0], row_bytes, take[1]),
                                       np.uint8))
    if len(parts) == 1:
        return parts[0]
    return np.concatenate(parts) if parts else np.zeros(0, np.uint8)
