"""The plugin's device memory is counted inside vLLM's budget (issue 26).

vLLM sizes the KV cache as ``gpu_memory_utilization`` x the GPU minus the model memory ``load_model`` measured
(``model_memory_usage``) minus the profile run's increase. The plugin allocates its buffers right after
``load_model``, so vLLM 0.26 counted them nowhere and the plugin engine held ~9 GiB beyond its budget on an H100.
The adapter adds them to ``model_memory_usage``. The buffers here are the real ``DeviceState`` on the CPU; the
runner is a stand-in carrying vLLM's GPU runner field (the GPU runner cannot be built without a GPU; the GPU
machine runs scripts/gpu_memory_check.py against real engines).
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from mia_stream.producer._config import RuntimeConfig
from mia_stream.producer._device import DeviceState
from mia_stream.producer._vllm_adapter import _account_device_memory
from mia_stream.spec import ModelGeometry


def _state(capture_qk: bool, steering: bool, detect: bool = True) -> tuple[DeviceState, ModelGeometry,
                                                                          RuntimeConfig, int]:
    geo = ModelGeometry(num_layers=4, hidden_size=64, num_heads=8, num_kv_heads=2, head_dim=8)
    cfg = RuntimeConfig(aperture_rows=96, host_ring_bytes=1 << 20, steer_slots=16, max_ops_per_layer=2,
                        capture_qk=capture_qk, steering=steering, detect=detect, probe_slots=8,
                        detectors_per_request=3)
    max_tokens = 128
    return DeviceState(geo, 64, 16, max_tokens, cfg, torch.bfloat16, torch.device("cpu")), geo, cfg, max_tokens


def _expected_bytes(geo: ModelGeometry, cfg: RuntimeConfig, max_tokens: int) -> int:
    """The buffers the in-graph ops need, from their definition (docs/kernels.md): per captured kind an aperture
    [layers, rows + 1 sentinel, width] in the model dtype and an int32 route [layers, max tokens]; for steering an
    int32 slot table [layers, max tokens, ops per layer] and, per slot, a float32 vector, op code, scale and
    threshold; for in-engine detectors (issue 25) a float32 probe table [probe slots, hidden], an int32 route
    [layers, max tokens, detectors per request] and a float32 score buffer [max tokens, detectors per request]."""
    L, rows, bf16, i32, f32 = geo.num_layers, cfg.aperture_rows + 1, 2, 4, 4
    total = L * rows * geo.hidden_size * bf16 + L * max_tokens * i32
    if cfg.capture_qk:
        total += L * rows * (64 + 16) * bf16 + L * max_tokens * i32
    if cfg.steering:
        total += L * max_tokens * cfg.max_ops_per_layer * i32 + cfg.steer_slots * (geo.hidden_size * f32 + 3 * 4)
    if cfg.detect:
        k = cfg.detectors_per_request
        total += cfg.probe_slots * geo.hidden_size * f32 + L * max_tokens * k * i32 + max_tokens * k * f32
    return total


def test_every_plugin_buffer_is_counted_in_vllms_model_memory():
    for qk, steering, detect in ((False, False, False), (False, False, True), (True, False, True),
                                 (False, True, True), (True, True, True)):
        state, geo, cfg, max_tokens = _state(qk, steering, detect)
        expected = _expected_bytes(geo, cfg, max_tokens)
        assert state.device_bytes() == expected, (qk, steering, detect)
        runner = SimpleNamespace(model_memory_usage=1_000_000)  # what vLLM's load_model measured (weights)
        assert _account_device_memory(runner, state.device_bytes()) == expected
        assert runner.model_memory_usage == 1_000_000 + expected


def test_a_runner_without_the_field_is_left_alone():
    """vLLM CPU's runner sizes its KV cache from free RAM after the plugin attached: nothing to add."""
    state, *_ = _state(False, False)
    runner = SimpleNamespace()
    assert _account_device_memory(runner, state.device_bytes()) == 0
    assert not hasattr(runner, "model_memory_usage")
