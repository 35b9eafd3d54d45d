"""Plain data the producer runtime is configured and fed with: no torch, no vLLM.

``RuntimeConfig``: the sizes fixed at engine start (read from ``mia_stream.settings``); the frontend reads the same
settings for admission (``mia_stream.spec.admission``) without importing the runtime. ``StepBatch``: one engine step as
the runner scheduled it, which the vLLM adapter builds and ``ProducerRuntime.begin_step`` routes. Owns no state.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mia_stream import settings


@dataclass
class RuntimeConfig:
    """Sizes fixed at engine start (CUDA graphs bake buffer addresses); defaults from ``mia_stream.settings``."""

    # None: the engine's max tokens per step (the scheduler's max_num_batched_tokens), so every row fits
    aperture_rows: int | None = field(default_factory=lambda: settings.get_int("MIA_STREAM_APERTURE_ROWS"))
    host_ring_bytes: int = field(default_factory=lambda: settings.get_size("MIA_STREAM_HOST_RING_MB"))
    copy_staging_bytes: int = field(default_factory=lambda: settings.get_size("MIA_STREAM_COPY_STAGING_MB"))
    steer_slots: int = field(default_factory=lambda: settings.get_int("MIA_STREAM_STEER_SLOTS"))
    max_ops_per_layer: int = field(default_factory=lambda: settings.get_int("MIA_STREAM_STEER_OPS_PER_LAYER"))
    capture_qk: bool = field(default_factory=lambda: settings.get_flag("MIA_STREAM_CAPTURE_QK"))
    quantize: bool = field(default_factory=lambda: settings.get_flag("MIA_STREAM_QUANTIZE"))
    steering: bool = field(default_factory=lambda: settings.get_flag("MIA_STREAM_STEERING"))
    detect: bool = field(default_factory=lambda: settings.get_flag("MIA_STREAM_DETECT"))
    probe_slots: int = field(default_factory=lambda: settings.get_int("MIA_STREAM_PROBE_SLOTS"))
    detectors_per_request: int = field(default_factory=lambda: settings.get_int("MIA_STREAM_DETECTORS_PER_REQUEST"))
    # step and token items waiting for the drain; beyond this they are dropped, counted and announced
    max_queued_messages: int = 100_000


@dataclass
class StepBatch:
    """One engine step as the runner scheduled it. Rows ``>= num_tokens`` are padding."""

    step: int
    req_ids: list[str]
    query_start: np.ndarray  # [num_reqs + 1] token-row offsets
    num_computed: np.ndarray  # [num_reqs] position of each request's first scheduled token
    num_tokens: int
    token_ids: np.ndarray | None  # [num_tokens] input token ids (host), or None: read from device_token_ids
    device_token_ids: Any = None  # torch.Tensor [>= num_tokens] on the device (V2): copied with the rows


