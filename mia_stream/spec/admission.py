"""Admission: whether an engine started with given settings can serve a request spec, checked before the engine
sees the request. Pure (no torch, no vLLM, no producer runtime), so vLLM's frontend and API server check a spec with
the spec package alone. Owns no state.

``cfg`` is any object with the engine's start-time settings ``steering``, ``capture_qk``, ``quantize``, ``detect``,
``detectors_per_request``, ``aperture_rows`` (None:
``max_tokens``) and ``host_ring_bytes``: the producer's ``RuntimeConfig``, read from the same environment the workers
read when the engine starts.
"""

from __future__ import annotations

from typing import Any

from mia_stream.errors import CaptureSpecError, DetectSpecError, SteeringSpecError
from mia_stream.spec import SPEC_KEY, ModelGeometry, RequestSpec

__all__ = ["check_admission"]


def check_admission(spec: RequestSpec, prompt_len: int, geo: ModelGeometry, cfg: Any, max_tokens: int,
                    itemsize: int, tp_size: int = 1) -> None:
    """Refuse (``SpecError``) a request the engine's start-time settings cannot serve, before the engine sees it:
    steering or Q/K capture switched off, or a capture whose first step, scheduled alone (a prefill chunk of up
    to ``max_tokens``, the scheduler's max_num_batched_tokens), needs more aperture rows or host ring bytes than
    there are: its frames would be dropped at every such step."""
    if spec.steer and not cfg.steering:
        raise SteeringSpecError(
            f"extra_args['{SPEC_KEY}']['steer']: this engine was started with MIA_STREAM_STEERING=0, so it has no "
            "steering ops; start it without that setting to steer, or leave 'steer' out")
    if spec.detect and not getattr(cfg, "detect", True):
        raise DetectSpecError(
            f"extra_args['{SPEC_KEY}']['detect']: this engine was started with MIA_STREAM_DETECT=0, so it has no "
            "in-engine detector ops; start it without that setting, or run the detector as an analyzer")
    limit = getattr(cfg, "detectors_per_request", None)
    if limit is not None and len(spec.detect) > limit:
        raise DetectSpecError(
            f"extra_args['{SPEC_KEY}']['detect']: {len(spec.detect)} detectors, more than this engine's "
            f"MIA_STREAM_DETECTORS_PER_REQUEST={limit}")
    if spec.qk_layers and not cfg.capture_qk:
        raise CaptureSpecError(
            f"extra_args['{SPEC_KEY}']['capture']['qk']: this engine was started with MIA_STREAM_CAPTURE_QK=0, so it "
            "has no Q/K capture ops; start it without that setting to capture Q/K, or capture only hidden_states")
    if spec.quantize and spec.captures and not getattr(cfg, "quantize", True):
        raise CaptureSpecError(
            f"extra_args['{SPEC_KEY}']['capture']['quantize']: this engine was started without MIA_STREAM_QUANTIZE=1, "
            "so it has no device memory reserved for quantized rows; start it with that setting to quantize, or "
            "leave 'quantize' out")
    rows = cfg.aperture_rows if cfg.aperture_rows is not None else max_tokens
    need, row_bytes = 0, 0
    for layers, mode, width, parts in ((spec.hs_layers, spec.hs_positions, geo.hidden_size, 1),
                                       (spec.qk_layers, spec.qk_positions,
                                        (geo.num_heads + geo.num_kv_heads) // tp_size * geo.head_dim, 2)):
        if layers:
            need = max(need, min(prompt_len, max_tokens) if mode in ("all", "prompt") else 1)
            # quantized: one byte a value and a float32 scale per row, layer and part (q and k are two)
            row_bytes += len(layers) * (width + 4 * parts if spec.quantize else width * itemsize)
    if need > rows:
        raise CaptureSpecError(
            f"extra_args['{SPEC_KEY}']['capture']: capturing this {prompt_len}-token prompt needs up to {need} rows "
            f"in one engine step, more than the aperture's MIA_STREAM_APERTURE_ROWS={rows}; raise it to at least "
            f"{need}, or unset it (the default, max_num_batched_tokens, fits every step)")
    if need * row_bytes > cfg.host_ring_bytes:
        raise CaptureSpecError(
            f"extra_args['{SPEC_KEY}']['capture']: one engine step of this request captures up to "
            f"{need * row_bytes / 2**20:.0f} MiB, more than the host ring holds (MIA_STREAM_HOST_RING_MB="
            f"{cfg.host_ring_bytes >> 20}); raise it, or capture fewer layers or positions")
