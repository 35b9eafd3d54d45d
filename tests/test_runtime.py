"""The producer runtime without vLLM: the runner calls it the way the adapter does, the in-graph op writes the
aperture, and a real FramePublisher -> broker -> consumer carries the frames. Covers what the CPU engine
cannot show: async scheduling's step past the stop token, and steering versions under a lagging drain.
"""

from __future__ import annotations

import shutil
import tempfile
import time

import numpy as np
import pytest
import torch

from mia_stream.kernels import ops as _ops  # noqa: F401  (registers torch.ops.mia_stream)
from mia_stream.producer._items import StepItem
from mia_stream.producer._runtime import ProducerRuntime, RuntimeConfig, StepBatch
from mia_stream.spec import ModelGeometry, parse_spec

GEO = ModelGeometry(num_layers=2, hidden_size=8, num_heads=2, num_kv_heads=2, head_dim=4)


@pytest.fixture
def bus():
    from mia_stream.broker import run_broker_in_thread
    from mia_stream.consumers import open_stream
    from mia_stream.bus.publisher import FramePublisher

    run_dir = tempfile.mkdtemp(prefix="mia-rt-", dir="/tmp")
    try:
        with run_broker_in_thread(address=run_dir):
            stream = open_stream(run_dir, patterns=["rt-*"], timeout=3.0)
            time.sleep(0.2)
            pub = FramePublisher(run_dir, producer_id="runtime-test")
            yield pub, stream
            pub.close()
            stream.close()
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


def _runtime(pub, hold: bool) -> ProducerRuntime:
    cfg = RuntimeConfig(aperture_rows=16, host_ring_bytes=1 << 20, steer_slots=4, max_ops_per_layer=2,
                        capture_qk=False, steering=True)
    rt = ProducerRuntime(geo=GEO, model_name="toy", tokenizer="toy", dtype=torch.float32,
                         device=torch.device("cpu"), max_tokens=8, tp_rank=0, tp_size=1, dp_rank=0,
                         publisher=pub, cfg=cfg)
    rt.hold_last_step = hold
    return rt


def _step(rt, step, first_pos, token_ids, rid="e1"):
    """One engine step of request ``rid``: route, 'forward' (the in-graph ops on known values), drain."""
    n = len(token_ids)
    rt.begin_step(StepBatch(step=step, req_ids=[rid], query_start=np.array([0, n]),
                            num_computed=np.array([first_pos]), num_tokens=n, token_ids=np.array(token_ids)))
    st = rt.state
    for layer in range(GEO.num_layers):
        hidden = torch.arange(n * 8, dtype=torch.float32).reshape(n, 8) + 100 * first_pos + 1000 * layer
        torch.ops.mia_stream.steer(hidden, torch.zeros_like(hidden), st.vectors, st.op_codes,
                                            st.scales, st.thresholds, st.steer_slots, layer)
        torch.ops.mia_stream.capture(st.hs_aperture, st.hs_route, hidden, torch.zeros_like(hidden), layer)
    rt.end_step()


def _events(stream, until_end=True):
    out = []
    for ev in stream:
        out.append(ev)
        if until_end and ev.kind == "end":
            break
    return out


def test_async_step_past_the_stop_token_is_trimmed_without_a_gap(bus):
    pub, stream = bus
    rt = _runtime(pub, hold=True)
    spec = parse_spec({"capture": {"hidden_states": {"layers": "all", "positions": "all"}}}, GEO)
    rt.add_request("e1", "rt-async", spec, [5, 6, 7])
    _step(rt, 1, 0, [5, 6, 7]); rt.on_sampled(1, ["e1"], [[8]])
    _step(rt, 2, 3, [8]); rt.on_sampled(2, ["e1"], [[9]])
    _step(rt, 3, 4, [9]); rt.on_sampled(3, ["e1"], [[10]])  # 10 is the stop token: 6 tokens in all
    _step(rt, 4, 5, [10]); rt.on_sampled(4, ["e1"], [[11]])  # async scheduling ran one step too far
    rt.finish_request("e1", "stop", num_tokens=6)
    events = _events(stream)
    rt.close()
    frames = [e.frame for e in events if e.kind == "frame"]
    assert [f.positions for f in frames] == [[0, 1, 2], [3], [4]]
    assert [f.token_ids for f in frames] == [[5, 6, 7], [8], [9]]
    # the captured rows are exactly what the "forward" wrote for those positions
    np.testing.assert_array_equal(frames[1].tensors["hs"][1, 0], np.arange(8) + 300 + 1000)
    assert events[-1].stream.generated_token_ids == [8, 9, 10]
    assert not [e for e in events if e.kind == "gap"], "trimming must not leave holes in the seqs"
    assert events[-1].end.num_generated_tokens == 3 and events[-1].end.finish_reason == "stop"


def test_frames_carry_the_steering_version_of_the_step_not_of_the_drain(bus):
    pub, stream = bus
    rt = _runtime(pub, hold=False)
    spec = parse_spec({"capture": {"hidden_states": {"layers": [1], "positions": "all"}}}, GEO)
    rt.add_request("e1", "rt-version", spec, [1, 2])
    ops = parse_spec({"steer": [{"layer": 1, "op": "add", "vector": [1.0] * 8, "scale": 10.0}]}, GEO).steer
    _step(rt, 1, 0, [1, 2])
    rt.update_steering("e1", ops, 1)  # arrives for step 2, possibly before step 1 was drained
    _step(rt, 2, 2, [3])
    rt.finish_request("e1", "length", num_tokens=4)
    frames = [e.frame for e in _events(stream) if e.kind == "frame"]
    rt.close()
    assert [(f.step, f.steering_version) for f in frames] == [(1, 0), (2, 1)]
    base = np.arange(8) + 200 + 1000
    np.testing.assert_array_equal(frames[1].tensors["hs"][0, 0], base + 10.0)  # steered before capture
    np.testing.assert_array_equal(frames[0].tensors["hs"][0, 1], np.arange(8, 16) + 1000)  # unsteered


def test_a_request_that_ends_before_the_drain_reaches_its_start_keeps_its_frames(bus):
    """The drain thread runs behind the engine: hold it at the request's StreamStart until the engine has
    already finished the request; every frame must still be published."""
    import threading

    pub, stream = bus
    gate = threading.Event()
    real_next_seq = pub.next_seq

    def gated_next_seq(rid):  # the drain thread stamps the StreamStart first: make it wait there
        gate.wait(10)
        return real_next_seq(rid)

    pub.next_seq = gated_next_seq
    rt = _runtime(pub, hold=False)
    spec = parse_spec({"capture": {"hidden_states": {"layers": [0], "positions": "all"}}}, GEO)
    rt.add_request("e1", "rt-behind", spec, [1, 2, 3])
    _step(rt, 1, 0, [1, 2, 3]); rt.on_sampled(1, ["e1"], [[4]])
    _step(rt, 2, 3, [4]); rt.on_sampled(2, ["e1"], [[5]])
    rt.finish_request("e1", "length", num_tokens=5)
    assert "e1" not in rt.requests  # the engine side is done with it
    gate.set()
    events = _events(stream)
    rt.close()
    assert [e.frame.positions for e in events if e.kind == "frame"] == [[0, 1, 2], [3]]
    assert events[-1].stream.generated_token_ids == [4, 5]


class _SlowDeviceCopy:
    """Stands in for the CUDA event of a step's device-to-host copy (no GPU here): it lands ``delay_s`` after
    the engine thread enqueued the step, as a forward still running on the GPU would make it."""

    def __init__(self, delay_s: float):
        self.delay_s, self.landed_ns = delay_s, None

    def synchronize(self) -> None:
        time.sleep(self.delay_s)
        self.landed_ns = time.time_ns()


def test_a_frame_is_stamped_when_its_rows_reach_the_host_not_when_its_forward_was_enqueued(bus):
    pub, stream = bus
    rt = _runtime(pub, hold=False)
    copies, enqueued_ns = [], []
    real_enqueue = rt._enqueue

    def enqueue_with_a_device_copy(item, event=None):
        if type(item) is StepItem:
            copies.append(_SlowDeviceCopy(0.08))
            enqueued_ns.append(time.time_ns())
            event = copies[-1]
        real_enqueue(item, event)

    rt._enqueue = enqueue_with_a_device_copy
    spec = parse_spec({"capture": {"hidden_states": {"layers": [0], "positions": "all"}}}, GEO)
    rt.add_request("e1", "rt-stamp", spec, [1, 2])
    _step(rt, 1, 0, [1, 2]); rt.on_sampled(1, ["e1"], [[3]])
    _step(rt, 2, 2, [3]); rt.on_sampled(2, ["e1"], [[4]])
    rt.finish_request("e1", "length", num_tokens=4)
    frames = [e.frame for e in _events(stream) if e.kind == "frame"]
    rt.close()
    assert [f.step for f in frames] == [1, 2]
    for frame, copy, enq in zip(frames, copies, enqueued_ns):
        assert frame.time_ns >= copy.landed_ns, "stamped before its rows were on the host"
        assert frame.time_ns - enq >= 80e6


def test_steady_decode_steps_route_exactly_like_the_full_path(bus):
    """Steady decode replays the last step's routing (no per-request Python). Against a runtime that always takes
    the full path, on a run of decode steps broken by every event that must end the replay (a new request, a
    finish, a live steering change, a request leaving the batch and coming back with a prefill), the device
    routes, the steering slots and every segment are equal at every step."""
    pub, _ = bus
    geo = ModelGeometry(num_layers=3, hidden_size=8, num_heads=2, num_kv_heads=2, head_dim=4)
    cfg = dict(aperture_rows=64, host_ring_bytes=1 << 20, steer_slots=16, max_ops_per_layer=2, capture_qk=True,
               steering=True)
    rts = [ProducerRuntime(geo=geo, model_name="toy", tokenizer="toy", dtype=torch.float32,
                           device=torch.device("cpu"), max_tokens=32, tp_rank=0, tp_size=1, dp_rank=0,
                           publisher=pub, cfg=RuntimeConfig(**cfg)) for _ in range(2)]
    replayed, full = rts
    steer = [{"layer": 1, "op": "add", "vector": [1.0] * 8, "positions": "generated"}]
    specs = {"a": {"capture": {"hidden_states": {"layers": [0, 2], "positions": "all"}}},
             "b": {"capture": {"qk": {"layers": [1], "heads": [1], "positions": "generated"}}, "steer": steer},
             "c": {"capture": {"hidden_states": {"layers": "all", "positions": "last_prompt"}}},
             "d": {"steer": steer}}
    prompt = {"a": 3, "b": 4, "c": 2, "d": 5}
    length = dict(prompt)

    def add(eid):
        for rt in rts:
            rt.add_request(eid, f"rt-steady-{eid}", parse_spec(specs[eid], geo), list(range(prompt[eid])))

    def step(k, ids, prefill=()):
        counts = [length[e] if e in prefill else 1 for e in ids]
        qs = np.concatenate([[0], np.cumsum(counts)])
        computed = np.array([0 if e in prefill else length[e] - 1 for e in ids])
        out = []
        for rt in rts:
            if rt is full:
                rt._drop_decode_cache()
            rt.begin_step(StepBatch(step=k, req_ids=list(ids), query_start=qs, num_computed=computed,
                                    num_tokens=int(qs[-1]), token_ids=np.arange(int(qs[-1]))))
            _, hs, qk = rt._step_segments
            rt._step_segments = None  # routing only: nothing is drained
            segs = [(s.eids, s.row0, s.count, [s.layer_sets[j] for j in s.layer_set], s.steer_version,
                     s.positions.tolist(), s.token_rows.tolist()) for s in (hs.segments(), qk.segments())]
            n = int(qs[-1])
            st = rt.state
            out.append((segs, st.hs_route[:, :n].clone(), st.qk_route[:, :n].clone(), st.steer_slots[:, :n].clone()))
        for e in ids:
            length[e] += 1
        (sa, *ra), (sb, *rb) = out
        assert sa == sb, f"step {k}: segments differ"
        for x, y in zip(ra, rb):
            assert torch.equal(x, y), f"step {k}: routes differ"
        return replayed._decode_cache is not None

    for eid in "abc":
        add(eid)
    k = 0
    step(k := k + 1, "abc", prefill="abc")
    cached = [step(k := k + 1, "abc") for _ in range(4)]
    assert cached[1:] == [True] * 3  # the replay is really taken
    add("d")
    step(k := k + 1, "abcd", prefill="d")
    cached = [step(k := k + 1, "abcd") for _ in range(3)]
    for rt in rts:  # a live steering change on "b"
        rt.update_steering("b", parse_spec({"steer": [dict(steer[0], vector=[2.0] * 8)]}, geo).steer, 2)
    cached += [step(k := k + 1, "abcd") for _ in range(3)]
    # "a" is preempted: it leaves the batch, then recomputes its prompt and output (positions already
    # published must not be captured again: the replay must not have skipped "a"'s next position)
    cached += [step(k := k + 1, "bcd") for _ in range(2)]
    step(k := k + 1, "bcda", prefill="a")
    cached += [step(k := k + 1, "bcda") for _ in range(3)]
    for rt in rts:
        rt.finish_request("c", "length")
    cached += [step(k := k + 1, "bda") for _ in range(3)]
    assert sum(cached) >= 8
    for rt in rts:
        rt.close()


@pytest.mark.parametrize("hold", [False, True], ids=["sync", "async-hold"])
def test_stream_end_counts_each_seq_once_when_the_engine_drops_a_frame(bus, hold):
    """Issue 13 item 4: a frame the engine could not capture (its prefill exceeds the aperture) holds the seq it
    would have had, named by a producer gap notice; StreamEnd says frames_sent + frames_dropped = the seqs the
    stream used, so a consumer can check completeness from the end alone (before the fix the dropped frame
    was counted in both)."""
    pub, stream = bus
    cfg = RuntimeConfig(aperture_rows=4, host_ring_bytes=1 << 20, steer_slots=4, max_ops_per_layer=2,
                        capture_qk=False, steering=True)
    rt = ProducerRuntime(geo=GEO, model_name="toy", tokenizer="toy", dtype=torch.float32,
                         device=torch.device("cpu"), max_tokens=8, tp_rank=0, tp_size=1, dp_rank=0,
                         publisher=pub, cfg=cfg)
    rt.hold_last_step = hold
    spec = parse_spec({"capture": {"hidden_states": {"layers": "all", "positions": "all"}}}, GEO)
    rt.add_request("e1", "rt-counts", spec, [1, 2, 3, 4, 5, 6])
    _step(rt, 1, 0, [1, 2, 3, 4, 5, 6]); rt.on_sampled(1, ["e1"], [[7]])  # 6 rows > the 4-row aperture
    _step(rt, 2, 6, [7]); rt.on_sampled(2, ["e1"], [[8]])
    _step(rt, 3, 7, [8]); rt.on_sampled(3, ["e1"], [[9]])
    rt.finish_request("e1", "length", num_tokens=9)
    events = _events(stream)
    rt.close()
    end = events[-1].end
    gaps = [e.gap for e in events if e.kind == "gap"]
    assert [(g.reason, g.origin) for g in gaps] == [("aperture_full", "producer")]
    assert end.frames_dropped == 1 and end.drops == {"aperture_full": 1}
    assert end.frames_sent + end.frames_dropped == end.seq + 1
    frames = [e.frame for e in events if e.kind == "frame"]
    assert [f.positions for f in frames] == [[6], [7]]
    assert events[-1].stream.generated_token_ids == [7, 8, 9]


def test_a_stalled_sidecar_loses_steps_counted_and_announced_never_silently(monkeypatch):
    """The real drain sidecar, stopped (SIGSTOP) while the engine keeps stepping: its pipe fills (about 1,700
    steps of this toy), then the drain queue (8 items here), and later steps are dropped at the engine. Each loss must be named in the
    stream: a GapNotice (``drain_queue_full``) and, in StreamEnd, a counted drop, so that frames received plus
    frames dropped account for every step; and the stream's start and end are never among the losses."""
    import os
    import signal

    from mia_stream.broker import run_broker_in_thread
    from mia_stream.consumers import open_stream

    run_dir = tempfile.mkdtemp(prefix="mia-rt-stall-", dir="/tmp")
    monkeypatch.setenv("MIA_STREAM_BROKER", run_dir)  # the sidecar publishes there
    try:
        with run_broker_in_thread(address=run_dir):
            stream = open_stream(run_dir, patterns=["rt-stall"], timeout=30.0)
            time.sleep(0.2)
            cfg = RuntimeConfig(aperture_rows=16, host_ring_bytes=8 << 20, steer_slots=4, max_ops_per_layer=2,
                                capture_qk=False, steering=True, max_queued_messages=8)
            rt = ProducerRuntime(geo=GEO, model_name="toy", tokenizer="toy", dtype=torch.float32,
                                 device=torch.device("cpu"), max_tokens=8, tp_rank=0, tp_size=1, dp_rank=0,
                                 producer_id="rt-stall:tp0", cfg=cfg)
            spec = parse_spec({"capture": {"hidden_states": {"layers": "all", "positions": "all"}}}, GEO)
            rt.add_request("e1", "rt-stall", spec, [1, 2, 3])
            _step(rt, 1, 0, [1, 2, 3]); rt.on_sampled(1, ["e1"], [[4]])
            assert rt.wait_drained(60)  # the sidecar has started and published step 1
            side = rt._sidecar.proc.pid
            os.kill(side, signal.SIGSTOP)
            try:
                steps, stuck, deadline = 1, 0, time.monotonic() + 60
                # until the forwarder is stuck on the full pipe: the queue stays at its bound step after step
                while stuck < 50 and time.monotonic() < deadline:
                    steps += 1
                    _step(rt, steps, steps + 2, [steps + 3]); rt.on_sampled(steps, ["e1"], [[steps + 4]])
                    stuck = stuck + 1 if rt.stats["drain_queued"] >= 8 else 0
            finally:
                os.kill(side, signal.SIGCONT)
            rt.finish_request("e1", "length", num_tokens=steps + 4)
            events = _events(stream)
            rt.close()
            stream.close()
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    frames = [e for e in events if e.kind == "frame"]
    end = events[-1].end
    gaps = [e.gap for e in events if e.kind == "gap"]
    dropped = rt.stats["dropped_frames"]
    # 50 steps in a row ended with the queue at its bound: each dropped its step and token items, but the first
    # of them may have queued one item before the bound was reached (99 of 100 in one full-suite run)
    assert stuck == 50 and dropped >= 2 * stuck - 1, f"the stall never filled the queue in {steps} steps"
    assert events[0].kind == "start" and events[-1].kind == "end"
    assert end.drops.get("drain_queue_full") == dropped == end.frames_dropped
    assert gaps and {g.reason for g in gaps} == {"drain_queue_full"} and all(g.origin == "producer" for g in gaps)
    tokens = events[-1].stream.generated_token_ids
    # every step made one tensor frame and one token frame: each arrived or is counted as dropped
    assert len(frames) + len(tokens) + dropped == 2 * steps
    assert len(frames) < steps and [p for e in frames for p in e.frame.positions][:3] == [0, 1, 2]


def test_admission_refuses_what_the_engine_settings_cannot_serve_and_names_the_setting():
    """``check_admission`` (run by the frontend before the engine sees a request) against explicit settings: a
    switched-off feature, and a capture whose step, scheduled alone, cannot fit the aperture or the host ring."""
    from mia_stream.errors import CaptureSpecError, SteeringSpecError
    from mia_stream.spec.admission import check_admission

    geo = ModelGeometry(num_layers=4, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16)
    hs_all = parse_spec({"capture": {"hidden_states": {"layers": "all", "positions": "all"}}}, geo)
    hs_last = parse_spec({"capture": {"hidden_states": {"layers": "all", "positions": "last_prompt"}}}, geo)
    qk = parse_spec({"capture": {"qk": {"layers": [1], "heads": "all", "positions": "generated"}}}, geo)
    steer = parse_spec({"steer": [{"layer": 1, "op": "add", "vector": [1.0] * 64}]}, geo)

    def cfg(**kw):
        base = dict(aperture_rows=None, host_ring_bytes=512 << 20, steer_slots=4, max_ops_per_layer=2,
                    capture_qk=True, steering=True)
        return RuntimeConfig(**{**base, **kw})

    for spec in (hs_all, hs_last, qk, steer):  # the defaults serve everything
        check_admission(spec, 5000, geo, cfg(), max_tokens=4096, itemsize=4)
    with pytest.raises(SteeringSpecError, match="MIA_STREAM_STEERING=0"):
        check_admission(steer, 10, geo, cfg(steering=False), 4096, 4)
    with pytest.raises(CaptureSpecError, match="MIA_STREAM_CAPTURE_QK=0"):
        check_admission(qk, 10, geo, cfg(capture_qk=False), 4096, 4)
    # an explicit aperture smaller than a prompt's first step: its prefill frames would be lost every time
    with pytest.raises(CaptureSpecError, match="needs up to 3000 rows .* MIA_STREAM_APERTURE_ROWS=2048"):
        check_admission(hs_all, 3000, geo, cfg(aperture_rows=2048), 4096, 4)
    check_admission(hs_all, 2048, geo, cfg(aperture_rows=2048), 4096, 4)  # fits exactly
    check_admission(hs_last, 3000, geo, cfg(aperture_rows=2048), 4096, 4)  # one row a step
    # 4096 rows x 4 layers x 64 x 4 bytes = 4 MiB: more than a 1 MiB host ring holds in one step
    with pytest.raises(CaptureSpecError, match="MIA_STREAM_HOST_RING_MB=1"):
        check_admission(hs_all, 5000, geo, cfg(host_ring_bytes=1 << 20), 4096, 4)
    # quantized, the same step is 4096 x 4 x (64 x 1 byte + a 4-byte scale) = 1.06 MiB: a 2 MiB ring takes it
    hs_int8 = parse_spec({"capture": {"hidden_states": {"layers": "all", "positions": "all"}, "quantize": "int8"}},
                         geo)
    with pytest.raises(CaptureSpecError, match="MIA_STREAM_HOST_RING_MB=2"):
        check_admission(hs_all, 5000, geo, cfg(host_ring_bytes=2 << 20), 4096, 4)
    check_admission(hs_int8, 5000, geo, cfg(host_ring_bytes=2 << 20, quantize=True), 4096, 4)
    with pytest.raises(CaptureSpecError, match="MIA_STREAM_HOST_RING_MB=1"):
        check_admission(hs_int8, 5000, geo, cfg(host_ring_bytes=1 << 20, quantize=True), 4096, 4)
    with pytest.raises(CaptureSpecError, match=r"\['quantize'\]: .*without MIA_STREAM_QUANTIZE=1"):
        check_admission(hs_int8, 10, geo, cfg(quantize=False), 4096, 4)


def test_the_sidecar_gets_the_parents_sys_path_after_its_own_pythonpath(monkeypatch):
    """Issue 26: with mia_stream importable only through the engine's sys.path (a path added at run time), the
    sidecar (a fresh interpreter) could not import it. PYTHONPATH's own entries stay first."""
    import os
    import sys

    from mia_stream.producer._sidecar import _child_env

    monkeypatch.setenv("PYTHONPATH", "/first")
    monkeypatch.setattr(sys, "path", ["", "/added/at/run/time", "/first", *sys.path])
    entries = _child_env()["PYTHONPATH"].split(os.pathsep)
    assert entries[:2] == ["/first", "/added/at/run/time"] and "" not in entries and len(entries) == len(set(entries))


def _broken_mia_stream(tmp_path, monkeypatch):
    """A mia_stream copy that cannot be imported, for a sidecar's PYTHONPATH (its entries come first; and the
    working directory, which ``python -m`` puts before them, is one without a mia_stream)."""
    monkeypatch.chdir(tmp_path)
    pkg = tmp_path / "broken" / "mia_stream"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise ImportError('this mia_stream copy is broken on purpose')\n")
    return str(tmp_path / "broken")


def _sidecar_runtime(producer_id: str) -> ProducerRuntime:
    cfg = RuntimeConfig(aperture_rows=16, host_ring_bytes=1 << 20, steer_slots=4, max_ops_per_layer=2,
                        capture_qk=False, steering=True)
    return ProducerRuntime(geo=GEO, model_name="toy", tokenizer="toy", dtype=torch.float32,
                           device=torch.device("cpu"), max_tokens=8, tp_rank=0, tp_size=1, dp_rank=0,
                           producer_id=producer_id, cfg=cfg)


def test_a_sidecar_that_cannot_start_fails_the_engines_start_with_its_stderr(monkeypatch, tmp_path):
    """Issue 26: a sidecar that exits at start (here a real process importing a broken mia_stream) is an error
    when the runtime starts (in the engine: when the worker loads the model, so vLLM's start fails), naming the
    cause from the sidecar's stderr; not a restart loop under an engine that publishes nothing."""
    from mia_stream.errors import MiaStreamError

    monkeypatch.setenv("MIA_STREAM_BROKER", tempfile.mkdtemp(prefix="mia-rt-nostart-", dir="/tmp"))
    monkeypatch.setenv("PYTHONPATH", _broken_mia_stream(tmp_path, monkeypatch))
    t0 = time.monotonic()
    with pytest.raises(MiaStreamError, match=r"(?s)exited at start \(exit 1\).*broken on purpose"):
        _sidecar_runtime("rt-nostart:tp0")
    assert time.monotonic() - t0 < 30


def test_a_sidecar_that_dies_later_is_replaced_a_bounded_number_of_times_then_the_engine_publishes(monkeypatch,
                                                                                                   tmp_path):
    """Issue 26: the running sidecar is killed (-9) and every replacement fails at start (a real process, a broken
    mia_stream on its path): three replacements are tried and counted, then the drain runs in the engine process;
    the next stream is published whole, and the producer's heartbeat stats say how the drain runs."""
    import os
    import signal

    from mia_stream.broker import run_broker_in_thread
    from mia_stream.consumers import open_stream
    from mia_stream.producer import _runtime

    run_dir = tempfile.mkdtemp(prefix="mia-rt-dies-", dir="/tmp")
    monkeypatch.setenv("MIA_STREAM_BROKER", run_dir)
    spec = parse_spec({"capture": {"hidden_states": {"layers": "all", "positions": "all"}}}, GEO)
    try:
        with run_broker_in_thread(address=run_dir):
            stream = open_stream(run_dir, patterns=["rt-dies-*"], timeout=30.0)
            time.sleep(0.2)
            rt = _sidecar_runtime("rt-dies:tp0")
            try:
                rt.add_request("e1", "rt-dies-1", spec, [1, 2, 3])
                _step(rt, 1, 0, [1, 2, 3]); rt.on_sampled(1, ["e1"], [[4]])
                assert rt.wait_drained(60)
                # from here every new sidecar fails at start
                monkeypatch.setenv("PYTHONPATH", _broken_mia_stream(tmp_path, monkeypatch))
                dead = rt._sidecar.proc
                os.kill(dead.pid, signal.SIGKILL)
                dead.wait(10)
                rt.finish_request("e1", "length", num_tokens=5)  # its end goes to the dead sidecar
                rt.add_request("e2", "rt-dies-2", spec, [5, 6, 7])
                _step(rt, 2, 0, [5, 6, 7], rid="e2"); rt.on_sampled(2, ["e2"], [[8]])  # finds it dead
                _step(rt, 3, 3, [8], rid="e2"); rt.on_sampled(3, ["e2"], [[9]])
                rt.finish_request("e2", "length", num_tokens=5)
                assert rt.wait_drained(60)
                stats = dict(rt.stats)
                events = []
                for ev in stream:
                    if ev.stream is not None and ev.stream.request_id == "rt-dies-2":
                        events.append(ev)
                        if ev.kind == "end":
                            break
                heartbeat = rt._own_publisher.stats()
            finally:
                rt.close()
                stream.close()
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    assert stats["sidecar_restarts"] == _runtime._SIDECAR_RESTARTS and stats["drain_in_engine"] == 1
    assert heartbeat["sidecar_restarts"] == _runtime._SIDECAR_RESTARTS and heartbeat["drain_in_engine"] == 1
    kinds = [e.kind for e in events]
    assert kinds[0] == "start" and kinds[-1] == "end" and kinds.count("frame") == 2
    assert events[-1].end.frames_dropped == 0


def test_a_step_whose_quantization_finds_no_device_memory_is_a_counted_drop_not_a_crash(bus, monkeypatch):
    """On the H100 (two 8B engines at 0.45) quantizing a 16k-token prefill of every layer raised
    ``torch.OutOfMemoryError`` in ``end_step`` and killed the engine core. That step's frames are now dropped as
    ``quantize_out_of_memory``, named by a gap and counted in StreamEnd, and the next steps are captured. (The
    allocation failure is a GPU's: here it is raised by a stand-in for the quantizer, the one mock.)"""
    pub, stream = bus
    rt = _runtime(pub, hold=False)
    spec = parse_spec({"capture": {"hidden_states": {"layers": "all", "positions": "all"}, "quantize": "int8"}},
                      GEO)
    rt.add_request("e1", "rt-qoom", spec, [1, 2, 3])
    real_parts = rt._quantize.parts

    def parts(p, state=None):
        if rt._stats["steps"] == 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 3.94 GiB")
        return real_parts(p, state)

    monkeypatch.setattr(rt._quantize, "parts", parts)
    _step(rt, 1, 0, [1, 2, 3]); rt.on_sampled(1, ["e1"], [[7]])
    _step(rt, 2, 3, [7]); rt.on_sampled(2, ["e1"], [[8]])
    _step(rt, 3, 4, [8]); rt.on_sampled(3, ["e1"], [[9]])
    rt.finish_request("e1", "length", num_tokens=6)
    events = _events(stream)
    rt.close()
    gaps = [e.gap for e in events if e.kind == "gap"]
    assert [(g.reason, g.origin) for g in gaps] == [("quantize_out_of_memory", "producer")]
    end = events[-1].end
    assert end.drops == {"quantize_out_of_memory": 1} and end.frames_sent + end.frames_dropped == end.seq + 1
    frames = [e.frame for e in events if e.kind == "frame"]
    assert [list(f.positions) for f in frames] == [[0, 1, 2], [4]]
    assert frames[1].raw_tensors["hs"].dtype == "int8"  # the steps around it quantized as asked
    assert rt._stats["quantize_oom"] == 1


@pytest.mark.parametrize("staging", [0, 256])
def test_device_staging_of_a_steps_rows_gives_the_same_frames(bus, staging):
    """``MIA_STREAM_COPY_STAGING_MB``: a step's rows are first copied into one half of a device staging buffer, and
    the host copy reads that half, so the next forward need not wait for the host copy. Frames are the rows the
    'forward' wrote, with or without it; a step bigger than a half (the 6-token prefill here: 384 bytes against a
    256-byte half) takes the unstaged way. (On the CPU both copies are synchronous; what staging buys, the next
    forward not waiting for the host copy, is a CUDA-stream matter for the GPU run.)"""
    pub, stream = bus
    cfg = RuntimeConfig(aperture_rows=16, host_ring_bytes=1 << 20, steer_slots=4, max_ops_per_layer=2,
                        capture_qk=False, steering=True, copy_staging_bytes=staging)
    rt = ProducerRuntime(geo=GEO, model_name="toy", tokenizer="toy", dtype=torch.float32,
                         device=torch.device("cpu"), max_tokens=8, tp_rank=0, tp_size=1, dp_rank=0,
                         publisher=pub, cfg=cfg)
    spec = parse_spec({"capture": {"hidden_states": {"layers": "all", "positions": "all"}}}, GEO)
    rid = f"rt-stage-{staging}"
    rt.add_request("e1", rid, spec, [1, 2, 3, 4, 5, 6])
    _step(rt, 1, 0, [1, 2, 3, 4, 5, 6]); rt.on_sampled(1, ["e1"], [[7]])
    for k in range(4):
        _step(rt, 2 + k, 6 + k, [7 + k]); rt.on_sampled(2 + k, ["e1"], [[8 + k]])
    rt.finish_request("e1", "length", num_tokens=11)
    events = _events(stream)
    stats = dict(rt._stats)
    rt.close()
    frames = [e.frame for e in events if e.kind == "frame"]
    assert [list(f.positions) for f in frames] == [[0, 1, 2, 3, 4, 5], [6], [7], [8], [9]]
    for f in frames:  # what _step's 'forward' wrote: arange(n * 8) + 100 * first position + 1000 * layer
        n, first = len(f.positions), f.positions[0]
        want = np.stack([np.arange(n * 8, dtype=np.float32).reshape(n, 8) + 100 * first + 1000 * layer
                         for layer in range(GEO.num_layers)])
        np.testing.assert_array_equal(f.tensors["hs"], want)
    if staging:
        assert stats["staged_copies"] == 4 and stats["unstaged_copies"] == 1  # decode steps staged, prefill not
    else:
        assert "staged_copies" not in stats


def test_the_runtime_says_at_start_when_a_full_all_layer_step_cannot_fit_the_host_ring(bus, caplog):
    """Admission sees one request; a prefill step of many prompts capturing every layer can still overflow the
    host ring, and those steps are then dropped (run K on the H100: 1,004 of 1,024 prompt frames). The engine's
    log says so at start, with the size that would keep them: 32,768 rows x 2 layers x 8 x 4 bytes = 2 MiB
    against a 1 MiB ring; a ring that holds the step says nothing."""
    import logging

    pub, _ = bus
    kw = dict(geo=GEO, model_name="toy", tokenizer="toy", dtype=torch.float32, device=torch.device("cpu"),
              max_tokens=32768, tp_rank=0, tp_size=1, dp_rank=0, publisher=pub)
    assert GEO.num_layers * GEO.hidden_size * 4 * 32768 == 2 << 20
    for ring_bytes, said in ((1 << 20, True), (4 << 20, False)):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="mia_stream.producer"):
            rt = ProducerRuntime(**kw, cfg=RuntimeConfig(host_ring_bytes=ring_bytes, steer_slots=4,
                                                         max_ops_per_layer=2, capture_qk=False))
            rt.close()
        lines = [r.getMessage() for r in caplog.records if "host_ring_full" in r.getMessage()]
        assert bool(lines) == said, lines
        if said:
            assert "(MIA_STREAM_HOST_RING_MB=1) holds 16384 token rows" in lines[0] and "needs 2 MiB" in lines[0]
