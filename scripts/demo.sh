#!/usr/bin/env bash
# The project's demo: set up the venv (a no-op when it is current), then `mia-stream demo` on the embedded model.
# Extra arguments go to the demo, e.g.  scripts/demo.sh --enforce-eager   or   scripts/demo.sh --model /path/to/hf-dir
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${MIA_STREAM_VENV:-$ROOT/.venv}"
"$ROOT/scripts/setup.sh"
exec "$VENV/bin/mia-stream" demo "$@"
