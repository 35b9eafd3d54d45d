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


def _state(capture_qk: bool, steering: bool, detect: bool = True, quantize: bool = False) -> tuple[
        DeviceState, ModelGeometry, RuntimeConfig, int]:
    geo = ModelGeometry(num_layers=4, hidden_size=64, num_heads=8, num_kv_heads=2, head_dim=8)
    cfg = RuntimeConfig(aperture_rows=96, host_ring_bytes=1 << 20, steer_slots=16, max_ops_per_layer=2,
                        capture_qk=capture_qk, steering=steering, detect=detect, quantize=quantize, probe_slots=8,
                        detectors_per_request=3)
    max_tokens = 128
    return DeviceState(geo, 64, 16, max_tokens, cfg, torch.bfloat16, torch.device("cpu")), geo, cfg, max_tokens


def _expected_bytes(geo: ModelGeometry, cfg: RuntimeConfig, max_tokens: int) -> int:
    """The buffers the in-graph ops need, from their definition (docs/kernels.md): per captured kind an aperture
    [layers, rows + 1 sentinel, width] in the model dtype and an int32 route [layers, max tokens]; for steering an
    int32 slot table [layers, max tokens, ops per layer] and, per slot, a float32 vector, op code, scale and
    threshold; for in-engine detectors (issue 25) a float32 probe table [probe slots, hidden], an int32 route
    [layers, max tokens, detectors per request] and a float32 score buffer [max tokens, detectors per request];
    for quantized capture (issue 29) a one-byte copy of every aperture and a float32 scale per aperture row."""
    L, rows, bf16, i32, f32 = geo.num_layers, cfg.aperture_rows + 1, 2, 4, 4
    total = L * rows * geo.hidden_size * bf16 + L * max_tokens * i32
    if cfg.capture_qk:
        total += L * rows * (64 + 16) * bf16 + L * max_tokens * i32
    if cfg.quantize:
        widths = [geo.hidden_size] + ([64, 16] if cfg.capture_qk else [])
        total += sum(L * rows * w * 1 + L * rows * f32 for w in widths)
    if cfg.steering:
        total += L * max_tokens * cfg.max_ops_per_layer * i32 + cfg.steer_slots * (geo.hidden_size * f32 + 3 * 4)
    if cfg.detect:
        k = cfg.detectors_per_request
        total += cfg.probe_slots * geo.hidden_size * f32 + L * max_tokens * k * i32 + max_tokens * k * f32
    return total


def test_every_plugin_buffer_is_counted_in_vllms_model_memory():
    for qk, steering, detect, quantize in ((False, False, False, False), (False, False, True, False),
                                           (True, False, True, False), (False, True, True, False),
                                           (True, True, True, False), (False, False, False, True),
                                           (True, True, True, True)):
        state, geo, cfg, max_tokens = _state(qk, steering, detect, quantize)
        expected = _expected_bytes(geo, cfg, max_tokens)
        assert state.device_bytes() == expected, (qk, steering, detect, quantize)
        runner = SimpleNamespace(model_memory_usage=1_000_000)  # what vLLM's load_model measured (weights)
        assert _account_device_memory(runner, state.device_bytes()) == expected
        assert runner.model_memory_usage == 1_000_000 + expected


def test_a_runner_without_the_field_is_left_alone():
    """vLLM CPU's runner sizes its KV cache from free RAM after the plugin attached: nothing to add."""
    state, *_ = _state(False, False)
    runner = SimpleNamespace()
    assert _account_device_memory(runner, state.device_bytes()) == 0
    assert not hasattr(runner, "model_memory_usage")


def test_quantized_rows_are_written_into_the_reserved_workspace_not_a_new_allocation():
    """The first live format's outputs are views of the workspace counted above (so a step's quantization
    allocates nothing outside vLLM's budget; on an H100 a per-step 3.94 GiB allocation had killed the engine);
    a second format in the same step gets its own tensors. Values: the torch reference on a copy."""
    from mia_stream.kernels.quantize import quantize_rows_reference
    from mia_stream.producer._quantize import QuantizeState
    from mia_stream.spec import parse_spec

    state, geo, cfg, _ = _state(True, False, False, quantize=True)
    state.hs_aperture.normal_()
    qs = QuantizeState()
    qs.add(parse_spec({"capture": {"hidden_states": {"layers": "all"}, "quantize": "int8"}}, geo))
    qs.add(parse_spec({"capture": {"hidden_states": {"layers": "all"}, "quantize": "fp8_e4m3"}}, geo))
    rows, layers = 5, (1, 3)
    out = {name: (t, r, lay) for name, t, r, lay in qs.parts([("hs", state.hs_aperture, rows, layers)], state)}
    assert set(out) == {"hs:int8", "hs:int8:scale", "hs:fp8_e4m3", "hs:fp8_e4m3:scale"}  # raw: nobody reads it
    ws, ws_scale = state.hs_quantized, state.hs_quantized_scale
    q, scale = out["hs:int8"][0], out["hs:int8:scale"][0]
    assert q.data_ptr() == ws.data_ptr() and scale.data_ptr() == ws_scale.data_ptr()
    assert q.is_contiguous() and q.shape == (2, rows, geo.hidden_size) and q.dtype == torch.int8
    fp8 = out["hs:fp8_e4m3"][0]
    assert not (ws.data_ptr() <= fp8.data_ptr() < ws.data_ptr() + ws.numel())
    ref_q, ref_scale = quantize_rows_reference(state.hs_aperture[list(layers), :rows].clone(), "int8")
    assert torch.equal(q, ref_q) and torch.equal(scale, ref_scale)
