"""``StreamLLM``: offline convenience around ``vllm.LLM`` — a broker, capture specs per prompt, frames back.

Plain ``vllm.LLM`` with ``extra_args["mia_stream"]`` stays the primary interface; this only wires the pieces::

    with StreamLLM(dtype="float32") as sllm:                     # the embedded model, a private broker
        for r in sllm.generate(["The capital of France is"], capture={"hidden_states": {"layers": [29]}}):
            print(r.text, r.tensor("hs").shape)                  # [layers, positions, hidden]
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import uuid
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import numpy as np

from mia_stream.bus.transport import ENV_BROKER as BROKER_ENV


@dataclass
class StreamResult:
    """One prompt's vLLM output and its stream, in order."""

    request_id: str
    output: Any  # vllm.RequestOutput
    events: list = field(default_factory=list)

    @property
    def text(self) -> str:
        return self.output.outputs[0].text

    @property
    def frames(self) -> list:
        return [e.frame for e in self.events if e.kind == "frame"]

    @property
    def end(self):
        return next((e.end for e in self.events if e.kind == "end"), None)

    @property
    def gaps(self) -> list:
        return [e.gap for e in self.events if e.kind == "gap"]

    def positions(self, name: str = "hs") -> list[int]:
        return [p for f in self.frames if name in f.raw_tensors for p in f.positions]

    def tensor(self, name: str = "hs") -> np.ndarray:
        """All frames' ``name`` tensors concatenated along the token dim: hs ``[L, T, H]``, q/k ``[L, T, heads, D]``."""
        parts = [f.tensors[name] for f in self.frames if name in f.raw_tensors]
        if not parts:
            raise KeyError(f"request {self.request_id!r} has no {name!r} frames")
        return np.concatenate(parts, axis=1)


class StreamLLM:
    """A ``vllm.LLM`` whose requests stream through a broker (started here unless ``broker`` names one)."""

    def __init__(self, model: str | None = None, *, broker: str | None = None, llm: Any = None,
                 **llm_kwargs: Any):
        self._run_dir = self._broker_ctx = None
        if broker is None:
            from mia_stream.broker import run_broker_in_thread

            self._run_dir = tempfile.mkdtemp(prefix="mia-sllm-", dir="/tmp")  # short: unix socket paths
            self._broker_ctx = run_broker_in_thread(address=self._run_dir)
            self._broker_ctx.__enter__()
            broker = self._run_dir
        self.broker = broker
        if llm is None:
            # The plugin reads the broker address when vLLM loads it (in every process it starts).
            os.environ[BROKER_ENV] = broker
            # vLLM CPU (ignored elsewhere): 1 GiB of KV cache, as the demo; its default reserves 90% of RAM and
            # refuses to start when other processes use more than a tenth of it
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
            from vllm import LLM

            from mia_stream.model import resolve_model

            llm = LLM(resolve_model(model), **llm_kwargs)
        self.llm = llm

    @classmethod
    def from_llm(cls, llm: Any, broker: str) -> "StreamLLM":
        """Wrap an engine that was started with ``MIA_STREAM_BROKER=broker``."""
        return cls(broker=broker, llm=llm)

    def _params(self, n: int, sampling_params, capture, steer, tags, prefix):
        from vllm import SamplingParams

        base = sampling_params if sampling_params is not None else SamplingParams(max_tokens=16, temperature=0.0)
        bases = list(base) if isinstance(base, (list, tuple)) else [base] * n
        caps = capture if isinstance(capture, (list, tuple)) else [capture] * n
        steers = steer if (isinstance(steer, (list, tuple)) and steer and isinstance(steer[0], (list, tuple))) \
            else [steer] * n
        out, ids = [], []
        for i in range(n):
            rid = f"{prefix}-{i}"
            spec: dict = {"id": rid}
            if caps[i]:
                spec["capture"] = caps[i]
            if steers[i]:
                spec["steer"] = list(steers[i])
            if tags:
                spec["tags"] = tags
            p = bases[i].clone()
            p.extra_args = dict(p.extra_args or {}, mia_stream=spec)
            out.append(p)
            ids.append(rid)
        return out, ids

    def stream(self, prompts: Sequence[Any], sampling_params=None, *, capture=None, steer=None,
               tags: dict | None = None, timeout: float = 60.0) -> Iterator:
        """Yield the events of every prompt's stream live, while the engine generates in the background."""
        from mia_stream.consumers import open_stream

        prefix = f"sllm-{uuid.uuid4().hex[:8]}"
        params, ids = self._params(len(prompts), sampling_params, capture, steer, tags, prefix)
        outputs: dict = {}
        with open_stream(self.broker, patterns=[f"{prefix}-*"], timeout=timeout) as events:
            worker = threading.Thread(target=lambda: outputs.setdefault(
                "out", self.llm.generate(list(prompts), params, use_tqdm=False)), daemon=True)
            worker.start()
            ended = set()
            for ev in events:
                yield ev
                if ev.kind == "end":
                    ended.add(ev.stream.request_id)
                    if ended == set(ids):
                        break
            worker.join()
        self._last_outputs = dict(zip(ids, outputs.get("out", [])))

    def generate(self, prompts: Sequence[Any], sampling_params=None, *, capture=None, steer=None,
                 tags: dict | None = None, timeout: float = 60.0) -> list[StreamResult]:
        """Generate and return each prompt's output with its whole stream.

        ``capture``/``steer``: one spec for every prompt, or a list with one per prompt (``None`` = not streamed
        beyond its tokens).
        """
        by_id: dict[str, list] = {}
        for ev in self.stream(prompts, sampling_params, capture=capture, steer=steer, tags=tags, timeout=timeout):
            # kept past its release: a copy of tensors that may view a producer's ring (wire-format.md 9)
            by_id.setdefault(ev.stream.request_id, []).append(ev.keep())
        return [StreamResult(rid, out, by_id.get(rid, [])) for rid, out in self._last_outputs.items()]

    def close(self) -> None:
        if self._broker_ctx is not None:
            self._broker_ctx.__exit__(None, None, None)
            self._broker_ctx = None
        if self._run_dir is not None:
            shutil.rmtree(self._run_dir, ignore_errors=True)
            self._run_dir = None

    def __enter__(self) -> "StreamLLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
