#!/usr/bin/env python
"""What one analyzer process costs per request-step, and how many request-steps/s it sustains.

    python scripts/bench_analyzers.py                         # all six: 256 requests, 8B geometry, bf16
    python scripts/bench_analyzers.py --prefill-rows 1792 --analyzers attention_tracker core_reranker attnlink
    python scripts/bench_analyzers.py --requests 64 --rounds 50 --analyzers hnode

Input: synthetic ``StepBatch`` messages of ``--requests`` decoding requests (one row each), ``--layers`` captured
layers of ``--hidden`` bfloat16 values per row (8B geometry by default: 1 x 4096), encoded as the wire carries
them; fresh random rows every round. Each round times, in this process, what an analyzer process does per step:
decode the message (inline payload), assemble it, run the analyzer (vectorized numpy; its ``Results`` -> one
``AnalysisBatch``), encode the result for publishing. Analyzers are measured side by side in
one run, interleaved round by round. Probes of the benched width are random (cost does not depend on weights).

The attention analyzers (attention_tracker, core_reranker with 8 CoRe heads, attnlink; configs of
``scripts/bench_attention_analyzers.py``) read Q/K at prompt positions only, so decode rows cost them nothing: in
the same rounds they get the prefill that keeps ``--requests`` requests running, ``--prefill-rows`` prompt rows
per step (default: ``--requests`` new prompts of ``--prompt`` tokens every ``--decode-steps`` steps, i.e. each
request generates that many tokens), chunked as vLLM does, bf16 Q/K of the heads their config names (8B:
32 heads, 8 KV heads, head_dim 128), fresh random values every step; a request's start and end are fed as they
come. Their request-step is one of the ``--requests`` running requests in one step, as for the others.

Each step goes the way ``run_analyzer`` takes it: ``decode`` -> the SDK's assembler in batch mode (seq checks
per request) -> ``AnalyzerRunner.feed``. ``--per-request`` also times, side by side, the same step sent as 256
per-request ``tensors`` messages (a producer that does not send step batches; the SDK hands them over as
one-request batches). Socket I/O and the broker are not in these numbers (the bus at this load:
scripts/bench_load.py).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mia_stream.analyzers import AnalyzerRunner, create  # noqa: E402
from mia_stream.consumers import StreamAssembler  # noqa: E402
from mia_stream.analyzers._probe import LinearProbe  # noqa: E402
from mia_stream.analyzers.science_hallucination import MulticlassProbe  # noqa: E402
from mia_stream.schemas import RowGroup, StepBatch, StreamEnd, StreamStart, Tensor, decode, encode  # noqa: E402

ATTENTION = ("attention_tracker", "core_reranker", "attnlink")


def _bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits (uint16, round to nearest even)."""
    b = x.astype(np.float32).view(np.uint32)
    return ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).astype(np.uint16)


def _probe_files(tmp: Path, hidden: int, layer: int, num_layers: int, rng) -> dict:
    w = rng.standard_normal(hidden) / np.sqrt(hidden)
    common = dict(model="synthetic", hidden_size=hidden, mean=np.zeros(hidden), scale=np.ones(hidden),
                  weights=w, bias=0.0, num_layers=num_layers)
    hn = LinearProbe("hnode", layer=layer, position="last_prompt", **common,
                     extra={"mode": "qa", "h_nodes": list(range(16)), "h_node_baselines": [0.0] * 16,
                            "baseline_percentile": 90})
    # the SciHal classifier reads one row per request (its last prompt token); here every decode row, so the
    # bench measures its per-row cost
    sc = MulticlassProbe("science_hallucination", "synthetic", hidden, num_layers, num_layers - 1, "generated",
                         True, ["entailment", "contradiction", "unverifiable"], np.zeros(hidden), np.ones(hidden),
                         rng.standard_normal((3, hidden)) / np.sqrt(hidden), np.zeros(3))
    hn.save(tmp / "hnode.json")
    sc.save(tmp / "science.json")
    model = tmp / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"rms_norm_eps": 1e-5, "hidden_size": hidden}))
    from safetensors.numpy import save_file

    save_file({"model.norm.weight": np.ones(hidden, np.float32)}, str(model / "model.safetensors"))
    return {"hnode": {"probe": str(tmp / "hnode.json"), "positions": "generated"},
            "science_hallucination": {"probe": str(tmp / "science.json"), "model": str(model)},
            "hidden_states": {"layers": [layer]}}


def _step(rng, ids, step, layers, hidden, prompt):
    rows = _bf16(rng.standard_normal((len(layers), len(ids), hidden)).astype(np.float32))
    g = RowGroup(np.arange(len(ids)), np.ones(len(ids)), np.full(len(ids), prompt + step),
                 [Tensor("hs", "bfloat16", rows.shape, memoryview(rows).cast("B"), tuple(layers))],
                 np.full(len(ids), 11))
    return StepBatch("bench", 1, step, ids, np.full(len(ids), step + 1), [g], time_ns=time.time_ns())


class _Prefill:
    """The prompt rows of one step: new requests of ``prompt`` tokens admitted as the ``rows`` budget allows,
    each chunked over as many steps as it takes (vLLM's chunked prefill). The same schedule for every analyzer."""

    def __init__(self, rows: int, prompt: int):
        self.rows, self.prompt = rows, prompt
        self.next_id, self.current, self.done = 0, None, 0  # current: [request number, next position]

    def step(self) -> list[tuple[int, int, int]]:
        """(request number, first position, rows) for each request with prompt rows in this step."""
        out, budget = [], self.rows
        while budget > 0:
            if self.current is None:
                self.current = [self.next_id, 0]
                self.next_id += 1
            n = min(budget, self.prompt - self.current[1])
            out.append((self.current[0], self.current[1], n))
            budget -= n
            self.current[1] += n
            if self.current[1] == self.prompt:
                self.current, self.done = None, self.done + 1
        return out


class _AttentionPath:
    """One attention analyzer fed the prefill steps of ``_Prefill``, with the capture its --print-spec names."""

    def __init__(self, name: str, config: dict, args):
        import bench_attention_analyzers as attn  # noqa: E402  (scripts/: the attention bench's configs, spans)

        self.an = create(name, config)
        spec = self.an.capture_spec()["qk"]
        self.layers = list(range(args.num_layers)) if spec["layers"] == "all" else spec["layers"]
        self.q_heads = list(range(args.num_heads)) if spec["heads"] == "all" else spec["heads"]
        group = args.num_heads // args.num_kv_heads
        self.kv_heads = sorted({h // group for h in self.q_heads})
        self.capture = {"qk": {"layers": self.layers, "heads": self.q_heads, "positions": "prompt"}}
        self.tags = attn._tags(args.prompt)
        self.args = args
        self.runner = AnalyzerRunner(self.an, [lambda b: encode(b)])
        self.asm = StreamAssembler(batches=True)
        self.seqs: dict[str, int] = {}

    def messages(self, rng, step: int, chunks) -> list[list]:
        """The wire messages of one step: starts of new requests, the step batch, ends of finished prompts."""
        a = self.args
        wires, ids, counts, positions = [], [], [], []
        for num, first, n in chunks:
            rid = f"new-{num:07d}"
            if first == 0:
                self.seqs[rid] = 1
                wires.append(encode(StreamStart(
                    rid, "bench", 1, 0, capture=self.capture, num_layers=a.num_layers, num_heads=a.num_heads,
                    num_kv_heads=a.num_kv_heads, head_dim=a.head_dim, prompt_token_ids=list(range(a.prompt)),
                    tags=self.tags)))
            ids.append(rid)
            counts.append(n)
            positions.extend(range(first, first + n))
        rows = len(positions)
        q = _bf16(rng.standard_normal((len(self.layers), rows, len(self.q_heads), a.head_dim), np.float32))
        k = _bf16(rng.standard_normal((len(self.layers), rows, len(self.kv_heads), a.head_dim), np.float32))
        g = RowGroup(np.arange(len(ids)), counts, positions,
                     [Tensor("q", "bfloat16", q.shape, memoryview(q).cast("B"), tuple(self.layers),
                             meta={"heads": self.q_heads}),
                      Tensor("k", "bfloat16", k.shape, memoryview(k).cast("B"), tuple(self.layers),
                             meta={"heads": self.kv_heads})],
                     np.full(rows, 11), part=1)
        seqs = [self.seqs[rid] for rid in ids]
        for rid in ids:
            self.seqs[rid] += 1
        wires.append(encode(StepBatch("bench", 1, step, ids, seqs, [g], time_ns=time.time_ns())))
        for num, first, n in chunks:
            if first + n == a.prompt:
                rid = f"new-{num:07d}"
                wires.append(encode(StreamEnd(rid, "bench", 1, self.seqs.pop(rid), "length", a.prompt, 1)))
        return wires

    def feed(self, wires) -> None:
        for w in wires:
            for ev in self.asm.feed(decode(w)):
                self.runner.feed(ev)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=1, help="captured layers per row")
    ap.add_argument("--num-layers", type=int, default=32, help="layers of the (synthetic) model")
    ap.add_argument("--rounds", type=int, default=100)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--analyzers", nargs="+", default=["hidden_states", "hnode", "science_hallucination", *ATTENTION])
    ap.add_argument("--prompt", type=int, default=512, help="attention analyzers: prompt tokens per request")
    ap.add_argument("--decode-steps", type=int, default=256,
                    help="attention analyzers: tokens each request generates (sets the prefill rate)")
    ap.add_argument("--prefill-rows", type=int, default=None,
                    help="attention analyzers: prompt rows per step (default requests x prompt / decode-steps)")
    ap.add_argument("--num-heads", type=int, default=32)
    ap.add_argument("--num-kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--per-request", action="store_true", help="also time the per-request event path")
    ap.add_argument("--bus", action="store_true",
                    help="instead: broker, analyzer and producer as processes, paced at --rate steps/s")
    ap.add_argument("--rate", type=float, default=100.0, help="--bus: steps/s the producer is paced at")
    ap.add_argument("--seconds", type=float, default=10.0, help="--bus: how long the producer runs")
    ap.add_argument("--publish", action="store_true", help="--bus: the analyzer publishes its results")
    ap.add_argument("--broker-args", default="", help="--bus: extra arguments for mia-stream broker")
    args = ap.parse_args(argv)
    if args.bus:
        return bus(args)
    rng = np.random.default_rng(0)
    layers = list(range(args.num_layers - args.layers, args.num_layers))
    ids = [f"req-{i}" for i in range(args.requests)]
    prompt = 100
    tmp = Path(tempfile.mkdtemp(prefix="mia-bench-an-"))
    configs = _probe_files(tmp, args.hidden, layers[0], args.num_layers, rng)
    starts = [StreamStart(rid, "bench", 1, 0, capture={"hidden_states": {"layers": layers, "positions": "all"}},
                          num_layers=args.num_layers, hidden_size=args.hidden, prompt_token_ids=list(range(prompt)))
              for rid in ids]
    paths = {}  # label -> (assembler, runner, per_request)
    sys.path.insert(0, str(ROOT / "scripts"))
    import bench_attention_analyzers as attn  # noqa: E402

    attn_configs = attn._configs(args.num_layers, args.num_heads)
    attn_configs["core_reranker"] = attn_configs.pop("core_reranker (8 CoRe heads)")
    attention = {name: _AttentionPath(name, attn_configs[name], args) for name in args.analyzers if name in ATTENTION}
    prefill_rows = args.prefill_rows or args.requests * args.prompt // args.decode_steps
    prefill = _Prefill(prefill_rows, args.prompt)
    for name in args.analyzers:
        if name in ATTENTION:
            continue
        for per_request in ((False, True) if args.per_request else (False,)):
            an = create(name, configs[name] if name != "hidden_states" else {"layers": layers})
            runner = AnalyzerRunner(an, [lambda b: encode(b)])  # what publishing costs: the encode
            asm = StreamAssembler(batches=True)  # the SDK's batch mode, as run_analyzer reads it
            for st in starts:
                for ev in asm.feed(st):
                    runner.feed(ev)
            label = f"{name}{' (per-request messages)' if per_request else ''}"
            paths[label] = (asm, runner, per_request)
    times = {label: [] for label in [*paths, *attention]}
    cpu = {label: [] for label in times}  # this process's CPU time: what a loaded machine's wall time hides
    for rnd in range(args.warmup + args.rounds):
        chunks = prefill.step() if attention else []
        for name, path in attention.items():
            wires = path.messages(rng, rnd, chunks)
            t0, c0 = time.perf_counter(), time.process_time()
            path.feed(wires)
            if rnd >= args.warmup:
                times[name].append(time.perf_counter() - t0)
                cpu[name].append(time.process_time() - c0)
        if not paths:
            continue
        batch = _step(rng, ids, rnd, layers, args.hidden, prompt)
        wire = encode(batch)
        wires = [encode(f) for f in batch.frames()] if args.per_request else []  # a per-request producer's
        for label, (asm, runner, per_request) in paths.items():
            t0, c0 = time.perf_counter(), time.process_time()
            for w in (wires if per_request else (wire,)):
                for ev in asm.feed(decode(w)):
                    runner.feed(ev)
            dt = time.perf_counter() - t0
            if rnd >= args.warmup:
                times[label].append(dt)
                cpu[label].append(time.process_time() - c0)
        for label, (asm, runner, _) in paths.items():
            assert runner.counters["request_steps"] == len(ids) * (rnd + 1), (label, runner.counters)
    for name, path in attention.items():
        c = path.runner.counters
        assert c["analysis_rows"] == prefill.done and not c["rejected"], (name, dict(c))
    print(f"# {args.requests} requests x 1 row, {args.layers} layer(s) x {args.hidden} bf16 per row, "
          f"{args.rounds} rounds (+{args.warmup} warm-up)")
    if attention:
        why = ("--prefill-rows" if args.prefill_rows else
               f"{args.requests} requests x {args.prompt} prompt tokens / {args.decode_steps} generated")
        print(f"# attention analyzers: {prefill_rows} prompt rows per step ({why}), prompts of {args.prompt} tokens, "
              f"Q/K of {args.num_layers} layers x {args.num_heads} heads ({args.num_kv_heads} KV) x {args.head_dim} "
              f"bf16; {prefill.done} prompts scored")
    # sustained rate: the mean CPU per step (the median wall time hides the slow steps a backlog is made of)
    print(f"{'analyzer':<30} {'ms/step (median)':>16} {'p90 ms':>8} {'us/request-step':>16} "
          f"{'request-steps/s':>16} {'steps/s at R':>13} {'CPU ms/step (mean)':>19} {'CPU request-steps/s':>20}")
    for name, ts in times.items():
        med, p90, cpu_mean = statistics.median(ts), float(np.percentile(ts, 90)), statistics.fmean(cpu[name])
        print(f"{name:<30} {med * 1e3:>16.2f} {p90 * 1e3:>8.2f} {med / args.requests * 1e6:>16.2f} "
              f"{args.requests / med:>16.0f} {1 / med:>13.1f} {cpu_mean * 1e3:>19.2f} "
              f"{args.requests / cpu_mean:>20.0f}")
    return 0


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def bus(args) -> int:
    """The topology users run: ``mia-stream broker``, one ``mia-stream analyze NAME`` process per analyzer (one
    at a time), and a producer (this process) publishing one StepBatch + one TokenBatch per step for
    ``--requests`` decoding requests at ``--rate`` steps/s. Reports what the analyzer processed, what it lost,
    how long after the producer's last step it finished, and its CPU per request-step (/proc)."""
    from mia_stream.broker import fetch_stats
    from mia_stream.bus.publisher import FramePublisher
    from mia_stream.schemas import StreamEnd, TokenBatch

    rng = np.random.default_rng(0)
    layers = list(range(args.num_layers - args.layers, args.num_layers))
    ids = [f"req-{i:04d}" for i in range(args.requests)]
    tmp = Path(tempfile.mkdtemp(prefix="mia-bench-an-", dir="/tmp"))
    configs = _probe_files(tmp, args.hidden, layers[0], args.num_layers, rng)
    configs["hidden_states"] = {"layers": layers, "positions": "generated"}
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    steps = int(args.rate * args.seconds)
    rows = [_bf16(rng.standard_normal((len(layers), len(ids), args.hidden)).astype(np.float32)) for _ in range(8)]
    print(f"# bus: {args.requests} requests x {steps} steps at {args.rate:g} steps/s, {args.layers} layer(s) x "
          f"{args.hidden} bf16 per row; broker and analyzer as processes{'; results published' if args.publish else ''}")
    print(f"{'analyzer':<24} {'request-steps':>14} {'lost':>7} {'producer dropped msgs':>22} {'publish s':>10} "
          f"{'done after last step s':>23} {'analyzer CPU us/request-step':>29}")
    for name in args.analyzers:
        if name in ATTENTION:  # their workload is a prefill of Q/K: in-process only (this mode sends decode hs)
            print(f"{name:<24} (not in --bus: measured in one process, without --bus)")
            continue
        run = tempfile.mkdtemp(prefix="mia-bus-", dir="/tmp")
        cfg = tmp / f"config-{name}.json"
        cfg.write_text(json.dumps(configs[name]))
        procs = []
        try:
            broker = subprocess.Popen([sys.executable, "-m", "mia_stream.broker", "--address", run,
                                       *args.broker_args.split()],
                                      stdout=subprocess.PIPE, text=True, env=env)
            procs.append(broker)
            assert "ready" in broker.stdout.readline()
            cmd = [sys.executable, "-m", "mia_stream.cli", "analyze", name, "--config", str(cfg), "--source", run,
                   "--patterns", "req-*", "--max-streams", str(len(ids)), "--idle-timeout", "60"]
            an = subprocess.Popen(cmd + (["--publish"] if args.publish else []), stdout=subprocess.DEVNULL,
                                  stderr=subprocess.PIPE, text=True, env=env)
            procs.append(an)
            deadline = time.monotonic() + 60
            while not any(c.startswith("analyzer:") for c in fetch_stats(run)["consumers"]):
                assert an.poll() is None and time.monotonic() < deadline, an.stderr.read()
                time.sleep(0.1)
            cpu0 = _cpu_s(an.pid)  # its start-up (imports, subscribing) is not counted
            with FramePublisher(run, producer_id="bench-producer") as pub:
                for rid in ids:
                    pub.publish(StreamStart(rid, pub.producer_id, pub.epoch, 0, num_layers=args.num_layers,
                                            hidden_size=args.hidden, dtype="bfloat16", prompt_token_ids=[1] * 64,
                                            capture={"hidden_states": {"layers": layers, "positions": "generated"}}))
                pub.flush(10)
                t0 = time.monotonic()
                for step in range(steps):
                    wait = t0 + step / args.rate - time.monotonic()
                    if wait > 0:
                        time.sleep(wait)
                    pos = np.full(len(ids), 64 + step)
                    data = rows[step % len(rows)]
                    g = RowGroup(np.arange(len(ids)), np.ones(len(ids)), pos,
                                 [Tensor("hs", "bfloat16", data.shape, data, tuple(layers))])
                    now = time.time_ns()
                    pub.publish(StepBatch(pub.producer_id, pub.epoch, step, ids, np.full(len(ids), 1 + 2 * step),
                                          [g], time_ns=now))
                    pub.publish(TokenBatch(pub.producer_id, pub.epoch, step, ids, np.full(len(ids), 2 + 2 * step),
                                           token_ids=np.full(len(ids), 5), first_positions=pos + 1, time_ns=now))
                for rid in ids:
                    pub.publish(StreamEnd(rid, pub.producer_id, pub.epoch, 1 + 2 * steps, "length", 64, steps))
                publish_s = time.monotonic() - t0
                pub.flush(30)
                t_last = time.monotonic()
                producer_dropped = pub.counters["dropped"]
            _, status, usage = os.wait4(an.pid, 0)  # its rusage: the CPU it used, all of it
            an.returncode = os.waitstatus_to_exitcode(status)
            done_after = time.monotonic() - t_last
            err = an.stderr.read()
            cpu = usage.ru_utime + usage.ru_stime
            summary = err.strip().splitlines()[-1] if err.strip() else ""
            if os.environ.get("BENCH_VERBOSE"):
                print(err, file=sys.stderr)
            got = int(summary.split(" request-steps")[0].rsplit(", ", 1)[1]) if "request-steps" in summary else -1
            lost = int(summary.split(", ")[-1].split()[0]) if "seqs lost" in summary else -1
            cpu_us = (cpu - cpu0) / max(got, 1) * 1e6
            print(f"{name:<24} {got:>14} {lost:>7} {producer_dropped:>22} {publish_s:>10.1f} {done_after:>23.1f} "
                  f"{cpu_us:>29.1f}", flush=True)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.terminate()
                    try:
                        p.wait(10)
                    except subprocess.TimeoutExpired:
                        p.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main())
