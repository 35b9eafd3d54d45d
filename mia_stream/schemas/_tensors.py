"""Tensors on the wire: dtypes, TP shard geometry, compression, checksums, numpy/torch views."""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mia_stream.errors import ChecksumError, MalformedFrameError

# Wire dtype name -> (numpy storage dtype, bytes per element). bfloat16 and float8 have no numpy
# dtype: their bits travel as uint16 / uint8 and `Tensor.numpy()` widens them exactly to float32.
WIRE_DTYPES: dict[str, tuple[np.dtype, int]] = {
    "float32": (np.dtype("<f4"), 4),
    "float16": (np.dtype("<f2"), 2),
    "bfloat16": (np.dtype("<u2"), 2),
    "int8": (np.dtype("i1"), 1),
    "uint8": (np.dtype("u1"), 1),
    "int32": (np.dtype("<i4"), 4),
    "int64": (np.dtype("<i8"), 8),
    "float8_e4m3fn": (np.dtype("u1"), 1),
    "float8_e5m2": (np.dtype("u1"), 1),
}
COMPRESSIONS = ("none", "lz4")

_TORCH_NAMES = {
    "float32": "float32", "float16": "float16", "bfloat16": "bfloat16", "int8": "int8",
    "uint8": "uint8", "int32": "int32", "int64": "int64",
    "float8_e4m3fn": "float8_e4m3fn", "float8_e5m2": "float8_e5m2",
}


def byte_view(array: np.ndarray) -> memoryview:
    """The bytes of a numpy array as a flat memoryview (copied only when not contiguous). Not
    ``memoryview(a).cast("B")``: that refuses arrays with a zero-length dimension (a step with no rows)."""
    return memoryview(np.ascontiguousarray(array).reshape(-1).view(np.uint8))


def wire_dtype_of(obj: Any) -> str:
    """Wire dtype name of a numpy array or torch tensor."""
    dt = getattr(obj, "dtype", None)
    name = str(dt).removeprefix("torch.")
    if name in WIRE_DTYPES:
        return name
    if isinstance(dt, np.dtype) and dt.newbyteorder("<") in (np.dtype("<f4"), np.dtype("<f2")):
        return {4: "float32", 2: "float16"}[dt.itemsize]
    raise MalformedFrameError(f"dtype {dt!r} has no wire encoding; supported: {sorted(WIRE_DTYPES)}")


@dataclass(frozen=True)
class Shard:
    """This tensor holds ``[start, stop)`` of ``total`` along ``dim`` of the full tensor (TP shard)."""

    tp_rank: int
    tp_size: int
    dim: int
    start: int
    stop: int
    total: int

    def to_wire(self) -> dict:
        return {"tp_rank": self.tp_rank, "tp_size": self.tp_size, "dim": self.dim,
                "start": self.start, "stop": self.stop, "total": self.total}

    @classmethod
    def from_wire(cls, d: dict) -> "Shard":
        try:
            return cls(**{k: int(d[k]) for k in ("tp_rank", "tp_size", "dim", "start", "stop", "total")})
        except (KeyError, TypeError, ValueError) as e:
            raise MalformedFrameError(f"bad shard geometry {d!r}: {e}") from None


@dataclass
class Tensor:
    """One named tensor of a frame. ``data`` is the raw little-endian bytes, uncompressed.

    ``layers`` names the model layers stacked along dim 0 (empty when the tensor is not per layer).
    Quantized tensors (int8 / float8) carry ``scale``: float32, broadcastable to ``shape``;
    ``dequantize()`` gives ``data * scale`` in float32.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    data: Any  # bytes-like (memoryview / bytes / zmq.Frame buffer), or a numpy array of the raw bits (a view
    # into a step batch's rows); zero-copy where possible
    layers: tuple[int, ...] = ()
    shard: Shard | None = None
    scale: np.ndarray | None = None
    meta: dict = field(default_factory=dict)

    @classmethod
    def from_array(cls, name: str, array: Any, *, layers=(), shard: Shard | None = None,
                   scale: np.ndarray | None = None, meta: dict | None = None) -> "Tensor":
        """Wrap a numpy array or a (CPU) torch tensor without copying when it is contiguous."""
        dtype = wire_dtype_of(array)
        shape = tuple(int(s) for s in array.shape)
        if hasattr(array, "detach"):  # torch: view the bytes through numpy, whatever the dtype
            t = array.detach().contiguous()
            data = memoryview(t.view(-1).view(__import__("torch").uint8).numpy()).cast("B")
        else:
            data = byte_view(array)
        return cls(name, dtype, shape, data, tuple(int(x) for x in layers), shard,
                   None if scale is None else np.ascontiguousarray(scale, dtype=np.float32), meta or {})

    @property
    def nbytes(self) -> int:
        data = self.data
        if isinstance(data, np.ndarray):
            return data.nbytes
        return memoryview(data).nbytes if not isinstance(data, bytes) else len(data)

    def buffer(self) -> Any:
        """The raw bytes as one contiguous bytes-like (copied only for a non-contiguous array view)."""
        data = self.data
        if isinstance(data, np.ndarray):
            return byte_view(data)
        return data

    def raw(self) -> np.ndarray:
        """Zero-copy numpy view of the stored bits (bfloat16 as uint16, float8 as uint8)."""
        np_dtype, itemsize = WIRE_DTYPES[self.dtype]
        data = self.data
        if isinstance(data, np.ndarray):
            if data.dtype != np_dtype:  # bytes (e.g. rows gathered by the decoder): viewed as the dtype
                data = np.ascontiguousarray(data).view(np.uint8).reshape(-1).view(np_dtype)
            if data.size != math.prod(self.shape):  # math.prod: np.prod cost 6 us here, per request per step
                raise MalformedFrameError(f"tensor {self.name!r}: {data.nbytes} bytes for shape {self.shape} "
                                          f"{self.dtype}")
            return data.reshape(self.shape)
        want = math.prod(self.shape) * itemsize
        if self.nbytes != want:
            raise MalformedFrameError(
                f"tensor {self.name!r}: {self.nbytes} bytes for shape {self.shape} {self.dtype} (want {want})")
        return np.frombuffer(self.data, dtype=np_dtype).reshape(self.shape)

    def numpy(self) -> np.ndarray:
        """Values as numpy: native dtypes as they are, bfloat16 and float8 widened exactly to float32."""
        bits = self.raw()
        if self.dtype == "bfloat16":
            return (bits.astype(np.uint32) << 16).view(np.float32)
        if self.dtype.startswith("float8"):
            return self.torch().float().numpy()
        return bits

    def dequantize(self) -> np.ndarray:
        values = self.numpy().astype(np.float32, copy=False)
        return values if self.scale is None else values * self.scale

    def torch(self):
        """A torch tensor of the exact wire dtype (shares memory with the frame; read-only source)."""
        import torch

        raw = self.raw()
        t = torch.from_numpy(raw.copy() if not raw.flags.writeable else raw)
        if self.dtype in ("bfloat16", "float8_e4m3fn", "float8_e5m2"):
            t = t.view(getattr(torch, _TORCH_NAMES[self.dtype]))
        return t


def compress(buf: Any, method: str) -> Any:
    if method == "none":
        return buf
    if method == "lz4":
        import lz4.frame

        return lz4.frame.compress(buf, compression_level=0, store_size=True)
    raise MalformedFrameError(f"unknown compression {method!r}; supported: {COMPRESSIONS}")


def decompress(buf: Any, method: str, expected_nbytes: int) -> Any:
    if method == "none":
        return buf
    if method == "lz4":
        import lz4.frame

        # Stop one byte past the size the header announced, so a forged payload cannot inflate without bound.
        try:
            decompressor = lz4.frame.LZ4FrameDecompressor()
            out = decompressor.decompress(buf, max_length=expected_nbytes + 1)
            complete = decompressor.eof and not decompressor.unused_data
        except RuntimeError as e:
            raise MalformedFrameError(f"lz4 payload does not decompress: {e}") from None
        if len(out) == expected_nbytes and not complete:
            raise MalformedFrameError(f"lz4 payload is truncated, has trailing bytes, or is longer than the {expected_nbytes} bytes announced")
        if len(out) != expected_nbytes:
            raise MalformedFrameError(f"lz4 payload gave {len(out)} bytes, header says {expected_nbytes}")
        return out
    raise MalformedFrameError(f"unknown compression {method!r}; supported: {COMPRESSIONS}")


def crc32(buf: Any) -> int:
    return zlib.crc32(buf) & 0xFFFFFFFF


def verify_crc32(name: str, buf: Any, expected: int) -> None:
    got = crc32(buf)
    if got != expected:
        raise ChecksumError(f"tensor {name!r}: crc32 {got:#010x} != header {expected:#010x}")
