"""The adapter's one way into vLLM (``producer._hooks.hook``) and its frontend hand-over of a parsed spec, tested
without vLLM: a vLLM function whose signature is not the one a wrapper reads fails at install, naming it."""

from __future__ import annotations

import types

import pytest

from mia_stream.errors import UnsupportedVLLMError
from mia_stream.producer._hooks import hook


class Runner:
    def execute_model(self, scheduler_output, intermediate_tensors=None, dummy_run=False):
        return ("ran", scheduler_output, dummy_run)


def _wrap(orig):
    def execute_model(self, scheduler_output, *args, **kwargs):
        return ("wrapped", *orig(self, scheduler_output, *args, **kwargs))
    return execute_model


def test_a_matching_signature_installs_the_wrapper():
    cls = type("R", (Runner,), {})
    assert hook(cls, "execute_model", _wrap, expects=("self", "scheduler_output", "intermediate_tensors",
                                                       "dummy_run"))
    assert cls().execute_model("so", None, True) == ("wrapped", "ran", "so", True)
    assert cls.execute_model.__wrapped__ is Runner.execute_model


def test_a_changed_signature_fails_at_install_naming_the_function():
    class Other:
        def execute_model(self, batch, dummy_run=False):
            return None

    with pytest.raises(UnsupportedVLLMError, match=r"Other\.execute_model takes \(self, batch, dummy_run\)"):
        hook(Other, "execute_model", _wrap)
    with pytest.raises(UnsupportedVLLMError, match="dummy_run"):
        hook(type("R", (Runner,), {}), "execute_model", _wrap, expects=("self", "scheduler_output", "dummy_run"))


def test_a_missing_function_fails_unless_optional_and_own_means_not_inherited():
    with pytest.raises(UnsupportedVLLMError, match="sample_tokens not found"):
        hook(Runner, "sample_tokens", _wrap)
    assert hook(Runner, "sample_tokens", _wrap, required=False) is False
    sub = type("Sub", (Runner,), {})
    with pytest.raises(UnsupportedVLLMError, match="not found"):
        hook(sub, "execute_model", _wrap, own=True)


def test_a_module_function_is_hooked_by_name():
    mod = types.ModuleType("fake_vllm_utils")

    def check_stop(request, max_model_len):
        return request == "stop"
    mod.check_stop = check_stop

    def wrap(orig):
        def check_stop(request, *args, **kwargs):
            return request == "abort" or orig(request, *args, **kwargs)
        return check_stop
    hook(mod, "check_stop", wrap)
    assert mod.check_stop("abort", 9) and mod.check_stop("stop", 9) and not mod.check_stop("go", 9)


def test_generate_hands_its_parsed_spec_to_process_inputs_only_for_that_very_wire():
    from mia_stream.producer._vllm_adapter import _CheckedSpecs

    specs = _CheckedSpecs(limit=2)
    wire, spec = {"steer": []}, object()
    specs.put(wire, spec)
    assert specs.take(dict(wire)) is None  # an equal copy is not the object generate checked
    assert specs.take(wire) is spec and specs.take(wire) is None  # taken once
    kept = [({"i": i}, object()) for i in range(3)]
    for w, s in kept:
        specs.put(w, s)
    assert specs.take(kept[0][0]) is None and specs.take(kept[2][0]) is kept[2][1]  # bounded: the oldest went
