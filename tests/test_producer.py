"""The producer inside a real vLLM engine (CPU, torch.compile), checked against Hugging Face transformers.

Tolerance: both sides run float32 on the same weights and token ids; vLLM's CPU kernels and HF sum in a
different order, which measured 1.5e-5 of a layer's max |value| after 30 layers (shared/notes/measured.md).
We allow 1e-4: ten times the measured drift, still far below any real error (a wrong row, position or
layer is off by O(1)).
"""

from __future__ import annotations

import json

import pytest

from producer_helpers import collecting, hf_trace, rel_err

TOL = 1e-4
pytestmark = pytest.mark.slow


def _params(max_tokens=8, spec=None, **kw):
    from vllm import SamplingParams

    extra = {"mia_stream": spec} if spec is not None else None
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, extra_args=extra, **kw)


def _chat(tokenizer, text):
    return tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                         add_generation_prompt=True)


def test_engine_answers_paris(engine, tokenizer):
    out = engine.generate([_chat(tokenizer, "What is the capital of France?")], _params(16))
    assert "Paris" in out[0].outputs[0].text


def test_capture_equals_hf_and_leaves_output_unchanged(engine, tokenizer, hf_model, broker_address):
    prompt = _chat(tokenizer, "What is the capital of France?")
    spec = {"capture": {"hidden_states": {"layers": "all", "positions": "all"},
                        "qk": {"layers": [0, 7, 29], "heads": "all", "positions": "all"}},
            "id": "cap-hf", "tags": {"test": "hf"}}
    with collecting(broker_address, ["cap-hf"]) as col:
        captured = engine.generate([prompt], _params(12, spec))[0]
        col.wait_ended(["cap-hf"])
    plain = engine.generate([prompt], _params(12))[0]
    assert captured.outputs[0].token_ids == plain.outputs[0].token_ids, "capture changed greedy output"

    ev = col.events["cap-hf"]
    start = ev[0].stream.start
    assert ev[0].kind == "start" and start.tags == {"test": "hf"} and start.num_layers == 30
    prompt_ids = list(captured.prompt_token_ids)
    gen_ids = list(captured.outputs[0].token_ids)
    assert start.prompt_token_ids == prompt_ids
    assert ev[0].stream.generated_token_ids == gen_ids
    end = [e for e in ev if e.kind == "end"][0].end
    assert end.finish_reason == captured.outputs[0].finish_reason and end.num_generated_tokens == len(gen_ids)
    assert end.frames_dropped == 0 and not ev[0].stream.gaps
    # every seq of the stream is a message sent: one start, one per step batch and token batch, the end
    assert end.frames_sent + end.frames_dropped == end.seq + 1
    assert end.seq + 1 == 1 + len(col.frames("cap-hf")) + len(col.kinds("cap-hf", "tokens")) + 1

    positions, token_ids, hs = col.stacked("cap-hf", "hs")
    full = prompt_ids + gen_ids
    # every position whose row the engine computed: the whole prompt and all generated tokens but the last
    assert positions == list(range(len(full) - 1))
    assert token_ids == full[:-1]
    ref_hs, ref_q, ref_k, _ = hf_trace(hf_model, full[:-1])
    assert hs.shape == ref_hs.shape == (30, len(full) - 1, 576)
    assert rel_err(hs, ref_hs).max() < TOL
    _, _, q = col.stacked("cap-hf", "q")
    _, _, k = col.stacked("cap-hf", "k")
    assert q.shape == (3, len(full) - 1, 9, 64) and k.shape == (3, len(full) - 1, 3, 64)
    for j, layer in enumerate([0, 7, 29]):
        assert rel_err(q[j][None], ref_q[layer][None]).max() < TOL
        assert rel_err(k[j][None], ref_k[layer][None]).max() < TOL


def test_mixed_batch_each_stream_gets_exactly_its_rows(engine, tokenizer, hf_model, broker_address):
    """Several prompts at once, two longer than the step budget (chunked prefill), different specs."""
    long_a = _chat(tokenizer, "Summarise: " + " ".join(f"item {i} is blue." for i in range(70)))
    long_b = _chat(tokenizer, "List: " + " ".join(f"{i} apples" for i in range(90)))
    short = _chat(tokenizer, "Say hi.")
    specs = {
        "mix-a": {"capture": {"hidden_states": {"layers": [1, 2], "positions": "prompt"}}, "id": "mix-a"},
        "mix-b": {"capture": {"hidden_states": {"layers": [29], "positions": "generated"},
                              "qk": {"layers": [3], "heads": [1, 4], "positions": "last_prompt"}}, "id": "mix-b"},
        "mix-c": {"capture": {"hidden_states": {"layers": "all", "positions": "last_prompt"}}, "id": "mix-c"},
    }
    prompts = [long_a, long_b, short, short]
    params = [_params(6, specs["mix-a"]), _params(6, specs["mix-b"]), _params(6, specs["mix-c"]), _params(6)]
    with collecting(broker_address, ["mix-*"]) as col:
        outs = engine.generate(prompts, params)
        col.wait_ended(list(specs))
    assert len(outs[0].prompt_token_ids) > 256 and len(outs[1].prompt_token_ids) > 256  # chunked prefill
    assert set(col.events) == set(specs), "a request that did not ask was streamed"
    for rid, out in zip(specs, outs):
        full = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)
        plen = len(out.prompt_token_ids)
        ref_hs, ref_q, _, _ = hf_trace(hf_model, full[:-1])
        positions, token_ids, hs = col.stacked(rid, "hs")
        layers = [f for f in col.frames(rid) if "hs" in f.raw_tensors][0].layers["hs"]
        expect = {"mix-a": list(range(plen)), "mix-b": list(range(plen, len(full) - 1)),
                  "mix-c": [plen - 1]}[rid]
        assert positions == expect, rid
        assert token_ids == [full[p] for p in expect]
        assert rel_err(hs, ref_hs[list(layers)][:, expect]).max() < TOL, rid
    q_frames = [f for f in col.frames("mix-b") if "q" in f.raw_tensors]
    assert len(q_frames) == 1 and q_frames[0].positions == [len(outs[1].prompt_token_ids) - 1]
    q = q_frames[0].tensors["q"]
    assert q.shape == (1, 1, 2, 64) and q_frames[0].raw_tensors["q"].meta["heads"] == [1, 4]
    p = len(outs[1].prompt_token_ids) - 1
    _, ref_q, _, _ = hf_trace(hf_model, list(outs[1].prompt_token_ids))
    assert rel_err(q[0], ref_q[3][p:p + 1, [1, 4]]).max() < TOL


def test_json_string_spec_as_sent_by_vllm_xargs(engine, broker_address):
    spec = json.dumps({"capture": {"hidden_states": {"layers": [5], "positions": "last_prompt"}}, "id": "json-1"})
    with collecting(broker_address, ["json-1"]) as col:
        engine.generate(["The capital of France is"], _params(3, spec))
        col.wait_ended(["json-1"])
    frames = col.frames("json-1")
    assert len(frames) == 1 and frames[0].layers["hs"] == (5,)


@pytest.mark.parametrize("spec, words", [
    ({"capture": {"hidden_states": {"layers": [99]}}}, "layer 99 is out of range"),
    ({"capture": {"hiden_states": {}}}, "unknown key"),
    ({"capture": {"qk": {"layers": [0], "heads": [9]}}}, "head 9 is out of range"),
    ({"capture": {"hidden_states": {"positions": "middle"}}}, "must be one of"),
    ({"steer": [{"layer": 3, "op": "add", "vector": [1.0, 2.0]}]}, "hidden size is 576"),
    ({"steer": [{"layer": 3, "op": "add", "vector": {"name": "no-such-vector"}}]}, "no registered vector"),
    ({"steer": [{"layer": 3, "op": "add", "vector": {"f32": b"\0" * 8}}]}, "must hold 576 float32 values"),
    ({"steer": [{"layer": 3, "op": "add", "vector": [True] * 576}]}, "must be a list of numbers"),
    ({"steer": [{"layer": 3, "op": "add", "vector": [0.5] * 575 + [True]}]}, "must be a list of numbers"),
])
def test_invalid_spec_is_rejected_and_engine_keeps_serving(engine, spec, words):
    with pytest.raises(ValueError, match=words):
        engine.generate(["Hello"], _params(2, spec))
    out = engine.generate(["The capital of France is"], _params(4))
    assert out[0].outputs[0].text.strip()


def test_prefix_cache_never_hides_captured_prompt_rows(engine, broker_address):
    prompt = "Repeat after me: " + "the quick brown fox jumps over the lazy dog. " * 12
    engine.generate([prompt], _params(2))  # fills the prefix cache with this prompt's blocks
    spec = {"capture": {"hidden_states": {"layers": [0], "positions": "prompt"}}, "id": "pc-1"}
    with collecting(broker_address, ["pc-1"]) as col:
        out = engine.generate([prompt], _params(2, spec))[0]
        col.wait_ended(["pc-1"])
    positions, _, _ = col.stacked("pc-1", "hs")
    assert positions == list(range(len(out.prompt_token_ids)))
    end = col.kinds("pc-1", "end")[0].end
    assert end.uncaptured_positions == []


def _preemptions(engine) -> float:
    return sum(getattr(m, "value", 0) for m in engine.get_metrics() if m.name == "vllm:num_preemptions")


def test_preempted_and_resumed_requests_stream_each_position_once(engine, hf_model, broker_address):
    """More KV than the cache holds: the scheduler preempts and recomputes; streams stay exact."""
    from vllm import SamplingParams

    prompts = [f"Story {i}: " + " ".join(f"word{i}x{j}" for j in range(110)) for i in range(8)]
    ids = [f"pre-{i}" for i in range(8)]
    spec = {"capture": {"hidden_states": {"layers": [3], "positions": "all"}}}
    params = [SamplingParams(max_tokens=160, temperature=0.0, ignore_eos=True,
                             extra_args={"mia_stream": dict(spec, id=rid)}) for rid in ids]
    before = _preemptions(engine)
    with collecting(broker_address, ["pre-*"]) as col:
        outs = engine.generate(prompts, params)
        col.wait_ended(ids, timeout=300)
    assert _preemptions(engine) > before, "the workload did not force a preemption"
    for rid, out in zip(ids, outs):
        full = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)
        positions, token_ids, hs = col.stacked(rid, "hs")
        assert positions == list(range(len(full) - 1)), rid  # each position once, in order
        assert token_ids == full[:-1]
        end = col.kinds(rid, "end")[0].end
        assert end.num_generated_tokens == 160 and end.frames_dropped == 0
    # a sample of streams against the oracle (each HF forward over ~500 tokens costs a second)
    for rid, out in list(zip(ids, outs))[::3]:
        full = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)
        ref_hs, _, _, _ = hf_trace(hf_model, full[:-1])
        assert rel_err(col.stacked(rid, "hs")[2], ref_hs[[3]]).max() < TOL, rid


def test_stream_llm_wraps_an_engine_and_returns_each_prompt_with_its_stream(engine, broker_address, hf_model):
    from vllm import SamplingParams

    from mia_stream import StreamLLM

    sllm = StreamLLM.from_llm(engine, broker=broker_address)
    results = sllm.generate(["The capital of France is", "Water boils at"],
                            SamplingParams(max_tokens=5, temperature=0.0),
                            capture=[{"hidden_states": {"layers": [0, 29], "positions": "all"}}, None])
    assert [r.request_id.rsplit("-", 1)[1] for r in results] == ["0", "1"]
    first, second = results
    full = list(first.output.prompt_token_ids) + list(first.output.outputs[0].token_ids)
    assert first.positions() == list(range(len(full) - 1)) and first.end.finish_reason == "length"
    ref_hs, _, _, _ = hf_trace(hf_model, full[:-1])
    assert rel_err(first.tensor("hs"), ref_hs[[0, 29]]).max() < TOL
    assert second.frames == [] and second.end is not None  # streamed tokens only
    assert second.events[0].stream.generated_token_ids == list(second.output.outputs[0].token_ids)


def test_plugin_loaded_but_idle_generates_what_hf_generates(engine, hf_model, tokenizer):
    """No request streamed: the engine with the plugin active gives the independent oracle's greedy tokens."""
    import torch

    prompts = [_chat(tokenizer, "Name a primary color."), "The largest planet in the solar system is"]
    outs = engine.generate(prompts, _params(12))
    for prompt, out in zip(prompts, outs):
        ids = torch.tensor([list(out.prompt_token_ids)])
        with torch.no_grad():
            ref = hf_model.generate(ids, max_new_tokens=12, do_sample=False)[0, ids.shape[1]:].tolist()
        got = list(out.outputs[0].token_ids)
        n = min(len(got), len(ref))  # either may stop at EOS first
        assert n >= 3 and got[:n] == ref[:n], (prompt, got, ref)


def _sidecars() -> dict[int, int]:
    """Running drain sidecars: pid -> the engine process (``--parent``) it publishes for."""
    import os

    out = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            argv = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
        except OSError:
            continue
        if b"mia_stream.producer._sidecar" in argv:
            out[int(pid)] = int(argv[argv.index(b"--parent") + 1])
    return out


def test_frames_are_built_in_a_sidecar_process_not_in_the_engine(engine, broker_address):
    """The per-request frame building runs in a child of the engine process (it would hold the engine's GIL
    otherwise): the stream's producer is the engine worker, and a sidecar whose parent is that process is
    what publishes for it."""
    import os
    import socket

    spec = {"capture": {"hidden_states": {"layers": [2], "positions": "all"}}, "id": "sidecar-1"}
    with collecting(broker_address, ["sidecar-1"]) as col:
        engine.generate(["The capital of France is"], _params(3, spec))
        col.wait_ended(["sidecar-1"])
    start = col.events["sidecar-1"][0].stream.start
    host, engine_pid, rank = start.producer_id.split(":")
    assert host == socket.gethostname() and rank == "tp0" and int(engine_pid) != os.getpid()
    sidecars = _sidecars()
    assert int(engine_pid) in sidecars.values(), f"no drain sidecar for engine process {engine_pid}: {sidecars}"
    pid = next(p for p, parent in sidecars.items() if parent == int(engine_pid))
    assert int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1]) == int(engine_pid)  # its ppid
    assert len(col.frames("sidecar-1")) == 3 and col.kinds("sidecar-1", "end")


def test_a_killed_sidecar_is_replaced_and_the_engine_keeps_streaming(engine, broker_address):
    """kill -9 of the drain sidecar: the engine keeps serving, the next stream finds a new sidecar (a new epoch)
    and arrives complete."""
    import os
    import signal
    import time

    spec = {"capture": {"hidden_states": {"layers": [1], "positions": "all"}}, "id": "respawn-0"}
    with collecting(broker_address, ["respawn-0"]) as col:
        engine.generate(["The capital of France is"], _params(2, spec))
        col.wait_ended(["respawn-0"])
    start = col.events["respawn-0"][0].stream.start
    engine_pid = int(start.producer_id.split(":")[1])
    old = [p for p, parent in _sidecars().items() if parent == engine_pid]
    assert len(old) == 1
    os.kill(old[0], signal.SIGKILL)
    time.sleep(0.5)
    spec = dict(spec, id="respawn-1")
    with collecting(broker_address, ["respawn-1"]) as col:
        out = engine.generate(["The capital of France is"], _params(3, spec))
        col.wait_ended(["respawn-1"])
    assert out[0].outputs[0].text  # the engine answered
    new = [p for p, parent in _sidecars().items() if parent == engine_pid]
    assert new and old[0] not in new, f"no new sidecar for engine {engine_pid}: {new}"
    restarted = col.events["respawn-1"][0].stream.start
    assert restarted.epoch != start.epoch  # a new publisher: the broker tells the two lives apart
    assert len(col.frames("respawn-1")) == 3 and col.kinds("respawn-1", "end")[0].end.finish_reason == "length"
    assert not col.kinds("respawn-1", "gap")
