"""What a live steering command does to a request's steering: one pure function, no I/O, no vLLM.

``apply_command(action, ops, version, raw_ops, layers, steering, parse)`` -> ``Outcome``: the request's ops and
version after the command, whether workers must get an update (``changed``), whether the request is to stop
(``abort``), or the error the ack reports. The engine core's control channel (``_control``) applies it to the
live requests and acks every command; the ack's ``steering_version`` is ``Outcome.version``. Owns no state.

- ``replace``: the parsed ``raw_ops`` become the request's ops; ``add``: appended to them; ``remove``: the ops at
  ``layers`` go; ``clear``: none are left. Each of these bumps the version by one, even when the ops end up the
  same (the version numbers configurations, and frames carry it).
- ``abort``: stops the request at its next step; steering is unchanged and the ack's version is 0 (no steering
  configuration is acknowledged). It works with steering switched off.
- With steering switched off (``steering=False``) every other action is refused, version 0.
- ``raw_ops`` that do not parse (``parse`` raises ``SpecError``), or an unknown action: refused with the
  request's current version, nothing changed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from mia_stream.errors import SpecError

ACTIONS = ("replace", "add", "remove", "clear", "abort")
STEERING_OFF = "this engine was started with MIA_STREAM_STEERING=0: it has no steering ops (only abort works)"


@dataclass(frozen=True)
class Outcome:
    ops: tuple  # the request's ops after the command (unchanged unless ``changed``)
    version: int  # its steering version after the command: what the ack reports
    changed: bool = False  # new ops and version: every worker applies them from the command's step
    abort: bool = False
    error: str | None = None  # the command is refused (the ack says why)


def apply_command(action: str, ops: tuple, version: int, raw_ops: Any = (), layers: Any = (), *,
                  steering: bool = True, parse: Callable[[Any], tuple] = tuple) -> Outcome:
    """The command's effect on a live request whose steering is ``(ops, version)``; see the module docstring.
    ``parse`` turns the command's raw ops (the steering-spec op format) into ``SteerOp``s."""
    if action == "abort":
        return Outcome(tuple(ops), 0, abort=True)
    if not steering:
        return Outcome(tuple(ops), 0, error=STEERING_OFF)
    try:
        new = parse(raw_ops) if action in ("replace", "add") else ()
    except SpecError as e:
        return Outcome(tuple(ops), version, error=str(e))
    if action == "replace":
        after = tuple(new)
    elif action == "add":
        after = tuple(ops) + tuple(new)
    elif action == "remove":
        drop = set(layers)
        after = tuple(o for o in ops if o.layer not in drop)
    elif action == "clear":
        after = ()
    else:
        return Outcome(tuple(ops), version, error=f"unknown action {action!r}; use replace, add, remove, clear or abort")
    return Outcome(after, version + 1, changed=True)
