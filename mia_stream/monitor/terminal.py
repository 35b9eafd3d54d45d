"""``mia-stream monitor --terminal``: a live terminal view of a broker's requests, or of a recording.

    mia-stream monitor --terminal --source /tmp/mia-run              # live, until Ctrl-C
    mia-stream monitor --terminal --source runs/rec1                 # a recording (--speed 1: at its own pace)

One panel per request (running ones first, then the most recently ended): its id, state (running, or how it
finished), tokens so far, the newest and highest risk, its alerts and the actions taken on them (the
``alert_action`` results of ``mia_stream.analyzers._actions``), and its generated text with every token coloured
by its risk: green (0) through yellow to red (1); a token that raised an alert is underlined and marked ``!``.
``--numbers`` writes each token's risk after it.

The risk is one value of the requests' ``analysis`` streams, chosen by the rule the page uses too (``_scores``):
``--score ANALYZER.VALUE``, else the first per-token value whose name says risk (``risk``, then ``p_...``,
``prob``, ``score``), else the first seen. A score at position p colours the token at
position p (the input token of the row it was computed from). Built on ``rich``; with stdout not a terminal it
prints the final view once.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from mia_stream import settings
from mia_stream.monitor._scores import choose_score_key, new_score_keys, scalar_column
from mia_stream.spec.alerts import ACTION_ANALYZER  # (the one definition of the action outcome record)

log = logging.getLogger("mia_stream.monitor.terminal")



def risk_style(r: float) -> str:
    """A rich style for a risk in [0, 1]: background from green through yellow to red (clipped)."""
    if r is None or not math.isfinite(r):
        return "dim"
    r = min(max(r, 0.0), 1.0)
    if r < 0.5:
        red, green = int(510 * r), 170
    else:
        red, green = 255, int(170 * (1.0 - r) * 2)
    return f"black on rgb({red},{green},0)"


@dataclass
class RequestView:
    """What the view knows about one request."""

    request_id: str
    order: int
    started: bool = False
    prompt_len: int = 0
    tokenizer: str = ""
    tokens: list = field(default_factory=list)  # (position, token id) of generated tokens, in order
    pieces: list = field(default_factory=list)  # their text (decoded as they arrive)
    scores: dict = field(default_factory=dict)  # position -> risk
    alerts: dict = field(default_factory=dict)  # position -> analyzer that flagged it
    actions: list = field(default_factory=list)  # one line per action taken
    finish: str | None = None
    gaps: int = 0
    last_ns: int = 0
    decoder: Any = None


class TerminalMonitor:
    """Aggregates SDK batch events into ``RequestView`` s and renders them with rich (``render``)."""

    def __init__(self, score: str | None = None, tokenizer: str | None = None, numbers: bool = False,
                 lines: int = 3, keep: int = 64):
        self.score_pinned = score
        self.tokenizer_override = tokenizer
        self.numbers, self.lines, self.keep = numbers, max(1, lines), keep
        self.requests: dict[str, RequestView] = {}
        self.score_keys: list[str] = []  # ANALYZER.VALUE of per-row scalar values, first seen first
        self._order = 0
        self._tokenizers: dict[str, Any] = {}
        self.counters = {"analysis_rows": 0, "alerts": 0, "actions": 0, "gaps": 0}

    # ------------------------------------------------------------------------------------------ ingest

    @property
    def score_key(self) -> str | None:
        """The score tokens are coloured by: the monitor's one rule (``_scores``), as on the page."""
        return choose_score_key(self.score_keys, self.score_pinned)

    def _view(self, rid: str) -> RequestView:
        v = self.requests.get(rid)
        if v is None:
            v = self.requests[rid] = RequestView(rid, self._order)
            self._order += 1
            self._trim()
        return v

    def _trim(self) -> None:
        ended = [v for v in self.requests.values() if v.finish is not None]
        if len(ended) > self.keep:
            for v in sorted(ended, key=lambda v: v.order)[:len(ended) - self.keep]:
                del self.requests[v.request_id]

    def feed(self, ev: Any) -> None:
        handle = self._EVENTS.get(ev.kind)
        if handle is not None:
            handle(self, ev)

    def _on_batch(self, ev: Any) -> None:
        handle = self._BATCHES.get(ev.batch.KIND)
        if handle is not None:
            handle(self, ev.batch)

    def _on_start(self, ev: Any) -> None:
        start = ev.stream.start
        v = self._view(ev.stream.request_id)
        v.started = True
        v.prompt_len = len(start.prompt_token_ids)
        v.tokenizer = self.tokenizer_override or start.tokenizer or start.model

    def _on_end(self, ev: Any) -> None:
        v = self._view(ev.stream.request_id)
        v.finish = ev.end.finish_reason
        self._trim()

    def _on_gap(self, ev: Any) -> None:
        self._view(ev.stream.request_id).gaps += ev.gap.count
        self.counters["gaps"] += ev.gap.count

    # feed's handler of each event kind (by kind, not class: the event classes' package imports zmq) and batch kind
    _EVENTS = {"batch": lambda self, ev: self._on_batch(ev), "start": lambda self, ev: self._on_start(ev),
               "end": lambda self, ev: self._on_end(ev), "gap": lambda self, ev: self._on_gap(ev)}
    _BATCHES = {"token_batch": lambda self, b: self._on_tokens(b), "analysis": lambda self, b: self._on_analysis(b)}

    def _on_tokens(self, b: Any) -> None:
        off = b.offsets.tolist()
        ids = b.token_ids.tolist()
        first = b.first_positions.tolist()
        for i, rid in enumerate(b.request_ids):
            v = self._view(rid)
            for j, tid in enumerate(ids[off[i]:off[i + 1]]):
                v.tokens.append((first[i] + j, tid))
                v.pieces.append(self._piece(v, tid))
            v.last_ns = b.time_ns or time.time_ns()

    def _on_analysis(self, b: Any) -> None:
        if b.analyzer == ACTION_ANALYZER:
            for a in b.results():
                self._view(a.request_id).actions.append(_action_line(a))
                self.counters["actions"] += 1
            return
        off = b.offsets.tolist()
        pos = b.positions.tolist()
        alerts = b.alerts.tolist()
        cols = {name: c for name, c in ((name, scalar_column(v, len(pos))) for name, v in b.values.items())
                if c is not None}
        new_score_keys(self.score_keys, b.analyzer, cols, pos)
        analyzer, _, value = (self.score_key or "").rpartition(".")
        col = cols.get(value) if analyzer == b.analyzer else None
        scores = col.tolist() if col is not None else None
        for i, rid in enumerate(b.request_ids):
            v = self._view(rid)
            for j in range(off[i], off[i + 1]):
                if scores is not None and pos[j] >= 0 and math.isfinite(scores[j]):
                    v.scores[pos[j]] = scores[j]
                    self.counters["analysis_rows"] += 1
                if alerts[j]:
                    v.alerts[pos[j]] = b.analyzer
                    self.counters["alerts"] += 1

    def _piece(self, v: RequestView, token_id: int) -> str:
        if v.decoder is None:
            v.decoder = self._decoder(v.tokenizer)
        if v.decoder is False:
            return f"#{token_id} "
        tok, stream = v.decoder
        try:
            return stream.step(tok, int(token_id)) or ""
        except Exception:  # noqa: BLE001 (an id the tokenizer does not know: show it, keep going)
            return f"#{token_id}"

    def _decoder(self, name: str) -> Any:
        """(tokenizer, DecodeStream) for the stream's tokenizer dir (``tokenizer.json``), or False."""
        if not name:
            return False
        tok = self._tokenizers.get(name)
        if tok is None:
            path = Path(name).expanduser()
            path = path if path.is_file() else path / "tokenizer.json"
            try:
                from tokenizers import Tokenizer

                tok = Tokenizer.from_file(str(path))
            except Exception as e:  # noqa: BLE001 (shown as ids instead)
                log.warning("tokenizer %s: %s; showing token ids", name, e)
                tok = False
            self._tokenizers[name] = tok
        if tok is False:
            return False
        from tokenizers.decoders import DecodeStream

        return tok, DecodeStream(skip_special_tokens=True)

    # ------------------------------------------------------------------------------------------ render

    def ordered(self) -> list[RequestView]:
        """Running requests first (oldest first), then ended ones, most recent first."""
        running = [v for v in self.requests.values() if v.finish is None]
        ended = [v for v in self.requests.values() if v.finish is not None]
        return sorted(running, key=lambda v: v.order) + sorted(ended, key=lambda v: -v.order)

    def render(self, width: int = 100, height: int | None = None) -> Any:
        from rich.console import Group
        from rich.text import Text

        parts: list = [self._header()]
        budget = None if height is None else max(1, height - 2)
        shown = 0
        for v in self.ordered():
            block = self._request_block(v, width)
            if budget is not None and shown and len(block) > budget:
                break
            parts.extend(block)
            shown += 1
            if budget is not None:
                budget -= len(block)
        hidden = len(self.requests) - shown
        if hidden > 0:
            parts.append(Text(f"... {hidden} more request(s) not shown", style="dim"))
        return Group(*parts)

    def _header(self) -> Any:
        from rich.text import Text

        t = Text()
        running = sum(v.finish is None for v in self.requests.values())
        t.append(f"mia-stream monitor: {len(self.requests)} request(s), {running} running; "
                 f"risk = {self.score_key or '(no scores yet)'}; "
                 f"{self.counters['alerts']} alert(s), {self.counters['actions']} action(s)   ", style="bold")
        for r in (0.0, 0.25, 0.5, 0.75, 1.0):
            t.append(f" {r:g} ", style=risk_style(r))
        t.append(" ! alert", style="bold underline")
        return t

    def _request_block(self, v: RequestView, width: int) -> list:
        from rich.text import Text

        scored = [v.scores[p] for p, _ in v.tokens if p in v.scores]
        last = next((v.scores[p] for p, _ in reversed(v.tokens) if p in v.scores), None)
        state = v.finish or ("running" if v.started else "no start")
        head = Text()
        head.append(f"{v.request_id}", style="bold cyan")
        head.append(f"  {state}", style="bold red" if state == "abort" else "bold")
        head.append(f"  {len(v.tokens)} tokens")
        if scored:
            head.append(f"  risk {last:.2f} (max {max(scored):.2f})")
        if v.alerts:
            where = [p for p in sorted(v.alerts) if p >= 0]
            first = where[0] if where else -1
            at = f"at position {first}" if first >= 0 else "on the answer"
            head.append(f"  ALERT {at} ({v.alerts[first]})", style="bold red")
        if v.gaps:
            head.append(f"  {v.gaps} lost", style="yellow")
        block = [head]
        for line in v.actions:
            block.append(Text(f"  -> {line}", style="bold magenta"))
        body = Text()
        for (pos, _), piece in zip(v.tokens, v.pieces):
            r = v.scores.get(pos)
            style = risk_style(r)
            text = piece.replace("\n", "⏎")
            if pos in v.alerts:  # "!" in front of the token's first letter (after its leading space)
                word = text.lstrip()
                body.append(text[:len(text) - len(word)], style=style)
                body.append("!", style="bold red")
                text, style = word, style + " bold underline"
            body.append(text, style=style)
            if self.numbers and r is not None:
                body.append(f"({r:.2f})", style="dim")
        lines = body.wrap(_Console.get(width), width - 2)
        if len(lines) > self.lines:  # the newest tokens
            lines = lines[len(lines) - self.lines:]
        for ln in lines:
            block.append(Text("  ") + ln)
        return block


class _Console:
    """A rich Console only for measuring wrapped text (never prints)."""

    _consoles: dict[int, Any] = {}

    @classmethod
    def get(cls, width: int) -> Any:
        c = cls._consoles.get(width)
        if c is None:
            from rich.console import Console

            c = cls._consoles[width] = Console(width=width, file=open(os.devnull, "w"))
        return c


def _action_line(a: Any) -> str:
    """One action outcome (an ``alert_action`` result row) as text."""
    action = (a.labels.get("action") or ["?"])[0]
    error = (a.labels.get("error") or [None])[0]
    source = (a.labels.get("source") or [""])[0]
    alert_step = int(a.values["alert_step"][0]) if "alert_step" in a.values else -1
    applied = int(a.values["applied_step"][0]) if "applied_step" in a.values else -1
    what = "abort" if action == "abort" else f"steer ({action})"
    if error:
        return f"{what} on {source} alert at step {alert_step} failed: {error}"
    return f"{what} on {source} alert at step {alert_step}: applied at step {applied}"


def run(source: Any, *, patterns: Sequence[str] = ("*",), score: str | None = None, tokenizer: str | None = None,
        numbers: bool = False, lines: int = 3, keys: Any = None, speed: float = 0.0, rate: float = 8.0,
        max_streams: int | None = None, idle_timeout: float | None = None, console: Any = None) -> TerminalMonitor:
    """Show ``source`` (a broker address or a recording) until it ends (a recording), ``max_streams`` requests
    ended, ``idle_timeout`` s passed without events, or Ctrl-C. ``speed``: a recording at that multiple of its
    own pace (0: as fast as it reads). ``rate``: redraws per second at most. Returns the monitor."""
    from rich.console import Console
    from rich.live import Live

    from mia_stream.consumers import _is_recording, _Source

    if console is None:  # not a terminal (a file, a pipe): one final view, as wide as COLUMNS or 160
        console = Console() if sys.stdout.isatty() else Console(width=int(os.environ.get("COLUMNS") or 160))
    mon = TerminalMonitor(score, tokenizer, numbers, lines)
    recording = _is_recording(source)
    options = {} if recording else {"keys": keys, "consumer_id": f"terminal-monitor-{os.getpid()}"}
    # the SDK's event source, iterated in ticks (live: returns after `tick` s without events, still subscribed)
    src = _Source(source, patterns, True, batches=True, **options)
    tick, period = 0.1, 1.0 / max(rate, 0.1)
    ended, idle = 0, 0.0
    first_ns = wall0 = None

    def view() -> Any:
        return mon.render(console.width, console.height if console.is_terminal else None)

    live = Live(view(), console=console, auto_refresh=False,
                vertical_overflow="crop" if console.is_terminal else "visible")
    try:
        with live:
            last_draw = 0.0
            while True:
                got = False
                for ev in src.events(None if recording else tick):
                    got = True
                    if recording and speed > 0 and (t := _event_ns(ev)):
                        if first_ns is None:
                            first_ns, wall0 = t, time.monotonic()
                        delay = (t - first_ns) / 1e9 / speed - (time.monotonic() - wall0)
                        if delay > 0:
                            live.update(view(), refresh=True)
                            time.sleep(delay)
                    mon.feed(ev)
                    if ev.kind == "end":
                        ended += 1
                        if max_streams is not None and ended >= max_streams:
                            break
                    now = time.monotonic()
                    if now - last_draw >= period:
                        live.update(view(), refresh=True)
                        last_draw = now
                live.update(view(), refresh=True)
                last_draw = time.monotonic()
                if recording or (max_streams is not None and ended >= max_streams):
                    break
                idle = 0.0 if got else idle + tick
                if idle_timeout is not None and idle >= idle_timeout:
                    break
    except KeyboardInterrupt:
        pass
    finally:
        src.close()
    return mon


def _event_ns(ev: Any) -> int:
    if ev.kind == "batch":
        return int(getattr(ev.batch, "time_ns", 0) or 0)
    for attr in ("end", "gap"):
        m = getattr(ev, attr, None)
        if m is not None:
            return int(m.time_ns or 0)
    start = ev.stream.start if ev.stream is not None else None
    return int(start.time_ns or 0) if ev.kind == "start" and start is not None else 0


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="mia-stream monitor --terminal", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(ap)
    return ap


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The terminal view's own options (``mia-stream monitor`` adds them next to the web page's)."""
    g = ap.add_argument_group("terminal view (--terminal)")
    g.add_argument("--numbers", action="store_true", help="--terminal: write each token's risk after it")
    g.add_argument("--lines", type=int, default=3, help="--terminal: text lines per request (the newest; default 3)")
    g.add_argument("--speed", type=float, default=0.0,
                   help="--terminal, a recording: play it at this multiple of its own pace (default 0: at once)")
    g.add_argument("--max-streams", type=int, help="--terminal: exit after this many requests ended")
    g.add_argument("--idle-timeout", type=float, help="--terminal, live: exit after this many seconds without events")


def main(argv: list[str] | None = None) -> int:
    """``mia-stream monitor --terminal`` on its own (the web page's ``main`` hands ``--terminal`` here)."""
    ap = parser()
    ap.add_argument("--terminal", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--source", help="broker address or recording path (default $MIA_STREAM_BROKER)")
    ap.add_argument("--patterns", nargs="+", default=["*"], help="request-id globs (default: all)")
    ap.add_argument("--score", help="colour tokens by ANALYZER.VALUE (default: the first value named like a risk)")
    ap.add_argument("--tokenizer", help="tokenizer dir or tokenizer.json for every stream (default: the stream's)")
    ap.add_argument("--keys", help="CURVE key dir (tcp brokers)")
    return run_args(ap.parse_args(argv))


def run_args(args: argparse.Namespace) -> int:
    """Run the terminal view from parsed arguments (``source patterns score tokenizer keys`` and
    ``add_arguments``' options); the exit code."""
    from mia_stream.errors import MiaStreamError

    prog = "mia-stream monitor --terminal"
    source = args.source or settings.raw("MIA_STREAM_BROKER")
    if source and "://" not in source and not os.path.exists(source):
        print(f"{prog}: {source!r} is neither a broker run dir nor a recording (no such path)", file=sys.stderr)
        return 2
    if args.score is not None and "." not in args.score:
        print(f"{prog}: --score must be ANALYZER.VALUE, got {args.score!r}", file=sys.stderr)
        return 2
    if args.lines < 1 or args.speed < 0:
        print(f"{prog}: --lines must be >= 1 and --speed >= 0", file=sys.stderr)
        return 2
    try:
        run(source, patterns=args.patterns, score=args.score, tokenizer=args.tokenizer, numbers=args.numbers,
            lines=args.lines, keys=args.keys, speed=args.speed, max_streams=args.max_streams,
            idle_timeout=args.idle_timeout)
    except MiaStreamError as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
