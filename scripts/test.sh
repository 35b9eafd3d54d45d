#!/usr/bin/env bash
# The project's test command: set up the venv (a no-op when it is current), then run the whole test suite.
# Extra arguments go to pytest, e.g.  scripts/test.sh -m "not slow"   or   scripts/test.sh tests/test_model.py -x
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${MIA_STREAM_VENV:-$ROOT/.venv}"
"$ROOT/scripts/setup.sh"
cd "$ROOT"
exec "$VENV/bin/python" -m pytest --durations=15 "$@"
