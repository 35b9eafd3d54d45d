"""Device staging of a step's captured rows before their copy to the host (``MIA_STREAM_COPY_STAGING_MB``).

The aperture is single-buffered (CUDA graphs keep its address), so without staging the next forward must wait
for the step's device-to-host copy: 1.22 ms for an 8B model's 64 MiB of all-layer rows on an H100, the whole
8 % the all-layer capture cost there (docs/benchmarks.md, run K). Staged, the rows are copied on the device
into one half of ``DeviceState.copy_staging`` (inside vLLM's budget) on the compute stream, ordered before the
next forward, and the host copy reads that half; a half is reused two staged steps later, once the host copy
that read it has finished (normally long done). A step bigger than a half is not staged.

Owns: which half the next staged step uses, and per half the event of the host copy that last read it.
"""

from __future__ import annotations

import torch

_ALIGN = 256  # each part starts aligned in the half: any dtype's view of it is legal


class CopyStaging:
    def __init__(self, buffer: torch.Tensor, device: torch.device):
        self.buffer, self.device = buffer, device  # [2, half bytes] uint8
        self._turn = 0
        self._read_by: list = [None, None]

    def stage(self, host: list) -> tuple[int, list] | None:
        """``host``'s copies (``(host view, device source)``) re-pointed at one half, after copying the sources
        there on the current stream: ``(half, copies)``, or None when they do not fit a half."""
        sizes = [-(-src.numel() * src.element_size() // _ALIGN) * _ALIGN for _, src in host]
        if sum(sizes) > self.buffer.shape[1]:
            return None
        half = self._turn
        self._turn ^= 1
        read = self._read_by[half]
        if read is not None:
            torch.cuda.current_stream(self.device).wait_event(read)
            self._read_by[half] = None
        buf, offset, out = self.buffer[half], 0, []
        for (dst, src), size in zip(host, sizes):
            stage = buf[offset:offset + src.numel() * src.element_size()].view(src.dtype).view(src.shape)
            stage.copy_(src)
            out.append((dst, stage))
            offset += size
        return half, out

    def read_by(self, half: int, event) -> None:
        """The host copy that reads ``half`` ends with ``event`` (a CUDA event): the half is free after it."""
        self._read_by[half] = event
