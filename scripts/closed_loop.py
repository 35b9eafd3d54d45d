"""Closed-loop steering: watch a per-token score on a live stream and act when it crosses a threshold.

    python scripts/closed_loop.py --broker DIR --vector NAME --layer L --threshold T --action ablate|abort

The score of a captured row is its layer-L residual projected on the unit direction v̂ (``h · v̂``, in the
residual's own units). The first row of a request whose score exceeds the threshold triggers one live
steering command through the broker, answered by the engine with a SteeringAck (``applied_step`` = the
first engine step computed with it):

- ``ablate``:   add ``{"op": "ablate"}`` on v̂ at layer L (the score is 0 from applied_step on);
- ``cap``:      add ``{"op": "cap", "threshold": T}`` (the score stays <= T from applied_step on);
- ``subtract``: add ``{"op": "add", "scale": -S}`` on v̂ (pushes the residual back along v̂);
- ``abort``:    abort the request (it finishes with ``finish_reason == "abort"``).

Requests must capture hidden states at layer L (``positions`` "generated" or "all"); only rows of
generated tokens are scored unless ``--include-prompt``. ``ThresholdSteerer`` is the importable core: run it
with ``mia_stream.consumers.run_consumer`` (in a thread if you like) and read ``records`` afterwards.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from mia_stream.consumers import Consumer, RequestStream, StepFrame, run_consumer
from mia_stream.errors import MiaStreamError, SteeringCommandError, TransportError
from mia_stream.schemas import SteeringAck

logger = logging.getLogger("mia_stream.closed_loop")

ACTIONS = ("ablate", "cap", "subtract", "abort")


@dataclass
class Crossing:
    """The row that crossed: computed at engine ``step`` for token ``position``."""

    step: int
    position: int
    score: float
    norm: float  # |h| of that row, for scale
    seen_ns: int  # time.time_ns() when the consumer saw it


@dataclass
class LoopRecord:
    """What the loop saw and did for one request."""

    request_id: str
    scores: list = field(default_factory=list)  # (step, position, score, |h|, steering_version) per scored row
    crossing: Crossing | None = None
    ack: SteeringAck | None = None
    acked_ns: int = 0
    error: str | None = None  # the command was refused or timed out, or the stream can't be watched
    finish_reason: str | None = None

    @property
    def acted(self) -> bool:
        return self.ack is not None


class ThresholdSteerer(Consumer):
    """Scores every captured row of ``layer`` on ``direction``; acts once per request on the first crossing.

    ``direction``: 1-D array (hidden size), normalized here. ``action``: one of ``ACTIONS``; ``scale`` is used
    by ``subtract``. ``records[request_id]`` is filled as streams arrive (guarded by ``lock``); ``acted`` is set
    after each command's ack, ``ended`` after each stream end.
    """

    def __init__(self, direction, layer: int, threshold: float, action: str = "ablate", scale: float = 1.0,
                 patterns=("*",), include_prompt: bool = False, steer_timeout: float = 10.0,
                 from_start: bool = True):
        if action not in ACTIONS:
            raise ValueError(f"action must be one of {ACTIONS}, got {action!r}")
        v = np.asarray(direction, dtype=np.float64).reshape(-1)
        norm = float(np.linalg.norm(v))
        if v.size == 0 or not np.isfinite(norm) or norm == 0.0:
            raise ValueError("the direction must be a non-zero, finite 1-D vector")
        self.unit = (v / norm).astype(np.float32)
        self.layer, self.threshold, self.action, self.scale = int(layer), float(threshold), action, float(scale)
        self.patterns, self.include_prompt, self.steer_timeout = tuple(patterns), include_prompt, steer_timeout
        self.from_start = from_start  # a request that started before we subscribed is still watched
        self.records: dict[str, LoopRecord] = {}
        self.lock = threading.Lock()
        self.acted = threading.Event()
        self.ended = threading.Event()

    # ------------------------------------------------------------------------------------------ callbacks
    def on_start(self, stream: RequestStream) -> None:
        rec = self._record(stream.request_id)
        start = stream.start
        hs = (start.capture or {}).get("hidden_states") if start is not None else None
        if not hs or self.layer not in hs.get("layers", ()):
            rec.error = f"the request does not capture hidden states at layer {self.layer}; not watched"
            logger.warning("%s: %s", stream.request_id, rec.error)
        elif start.hidden_size and start.hidden_size != self.unit.size:
            rec.error = f"direction has {self.unit.size} values; the model's hidden size is {start.hidden_size}"
            logger.warning("%s: %s", stream.request_id, rec.error)

    def on_frame(self, stream: RequestStream, frame: StepFrame) -> None:
        layers = frame.layers.get("hs")
        if not layers or self.layer not in layers:
            return
        rows = frame.tensors["hs"][list(layers).index(self.layer)]  # [T, hidden]
        scores, norms = rows @ self.unit, np.linalg.norm(rows, axis=-1)
        first_generated = len(stream.prompt_token_ids)
        rec = self._record(stream.request_id)
        crossing = None
        with self.lock:
            for pos, s, n in zip(frame.positions, scores.tolist(), norms.tolist()):
                if not self.include_prompt and pos < first_generated:
                    continue
                rec.scores.append((frame.step, pos, s, n, frame.steering_version))
                if crossing is None and rec.crossing is None and rec.error is None and s > self.threshold:
                    crossing = rec.crossing = Crossing(frame.step, pos, s, n, time.time_ns())
        if crossing is not None:
            self._act(stream.request_id, rec)

    def on_end(self, stream: RequestStream, end) -> None:
        with self.lock:
            self._record(stream.request_id).finish_reason = end.finish_reason
        self.ended.set()

    # ------------------------------------------------------------------------------------------ internals
    def _record(self, request_id: str) -> LoopRecord:
        rec = self.records.get(request_id)
        if rec is None:
            rec = self.records[request_id] = LoopRecord(request_id)
        return rec

    def command(self) -> tuple[str, list]:
        """(live-steering action, ops) this loop sends on a crossing."""
        v = self.unit.tolist()
        if self.action == "abort":
            return "abort", []
        if self.action == "ablate":
            return "add", [{"layer": self.layer, "op": "ablate", "vector": v}]
        if self.action == "cap":
            return "add", [{"layer": self.layer, "op": "cap", "vector": v, "threshold": self.threshold}]
        return "add", [{"layer": self.layer, "op": "add", "vector": v, "scale": -self.scale}]

    def _act(self, request_id: str, rec: LoopRecord) -> None:
        action, ops = self.command()
        try:
            ack = self.steer(request_id, action, ops, timeout=self.steer_timeout)
        except (SteeringCommandError, TransportError) as e:  # e.g. the request finished meanwhile
            with self.lock:
                rec.error = str(e)
            logger.warning("%s: %s", request_id, e)
        else:
            with self.lock:
                rec.ack, rec.acked_ns = ack, time.time_ns()
            logger.info("%s: score %.3f > %.3f at step %d (position %d); %s applied from step %s",
                        request_id, rec.crossing.score, self.threshold, rec.crossing.step, rec.crossing.position,
                        self.action, ack.applied_step)
        self.acted.set()


def _load_direction(args) -> np.ndarray:
    if args.vector_file:
        p = Path(args.vector_file)
        if p.suffix == ".npy":
            return np.load(p)
        return np.asarray(json.loads(p.read_text()), dtype=np.float32)
    from mia_stream.spec.vectors import load_vector

    try:
        return load_vector(args.vector)
    except KeyError:
        raise SystemExit(f"closed_loop: no registered vector named {args.vector!r} "
                         "(register it with `mia-stream vectors add NAME FILE`)") from None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--broker", required=True, help="broker address (a run dir, ipc://... or tcp://...)")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--vector", help="name of a registered vector (mia-stream vectors add)")
    src.add_argument("--vector-file", help="the direction inline: a .npy file or a .json list of floats")
    ap.add_argument("--layer", type=int, required=True, help="the captured layer whose residual is scored")
    ap.add_argument("--threshold", type=float, required=True, help="act when h·v̂ exceeds this")
    ap.add_argument("--action", choices=ACTIONS, default="ablate")
    ap.add_argument("--scale", type=float, default=4.0, help="for --action subtract: x -= scale·v̂")
    ap.add_argument("--patterns", nargs="+", default=["*"], help="request-id globs to watch")
    ap.add_argument("--include-prompt", action="store_true", help="score prompt rows too")
    ap.add_argument("--max-streams", type=int, help="exit after this many streams ended")
    ap.add_argument("--idle-timeout", type=float, help="exit after this many seconds without events")
    ap.add_argument("--keys", help="CURVE key dir (tcp)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    loop = ThresholdSteerer(_load_direction(args), args.layer, args.threshold, args.action, args.scale,
                            args.patterns, args.include_prompt)
    try:
        run_consumer(loop, args.broker, args.max_streams, args.idle_timeout, keys=args.keys)
    except KeyboardInterrupt:
        pass
    except MiaStreamError as e:
        print(f"closed_loop: {e}", file=sys.stderr)
        return 2
    for rid, rec in loop.records.items():
        c = rec.crossing
        what = (f"crossed at step {c.step} (pos {c.position}, score {c.score:.3f}); "
                f"{args.action} applied at step {rec.ack.applied_step}" if rec.acted else
                f"error: {rec.error}" if rec.error else "never crossed")
        print(f"{rid}: {len(rec.scores)} rows scored, finish {rec.finish_reason}; {what}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
