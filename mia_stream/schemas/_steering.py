"""Steering vocabulary of the wire format: the op names a steering op carries (``StreamStart.steering``,
``SteeringCommand.ops``), the actions of a ``SteeringCommand``, and the integer code of each op.

Defined once here; the spec parser, the producer (op -> code), the kernels (codes) and the analyzers' actions
import them. A new op or action is a minor schema version (docs/wire-format.md).
"""

from __future__ import annotations

STEER_OPS = ("add", "cap", "ablate")  # an op's "op" field
STEER_ACTIONS = ("replace", "add", "remove", "clear", "abort")  # SteeringCommand.action

# Per steering slot, the code the steer kernels dispatch on (0: an empty slot, which does nothing)
OP_NONE, OP_ADD, OP_CAP, OP_ABLATE = 0, 1, 2, 3
OP_CODES = {"add": OP_ADD, "cap": OP_CAP, "ablate": OP_ABLATE}  # op name -> code, one per STEER_OPS
