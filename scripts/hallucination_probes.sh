#!/usr/bin/env bash
# Reproduce the hallucination detectors' data, shipped probes and results (docs/hallucination.md):
#
#   scripts/hallucination_probes.sh [DIR]          # collect (engine), train the three probes, evaluate
#   SKIP_COLLECT=1 scripts/hallucination_probes.sh DIR   # train and evaluate again from DIR's recording
#   NO_SHIP=1 ...                                  # write the probes into DIR instead of the package
#
# DIR (default /tmp/mia-hallucination) gets recording/ (about 5 GB), labels.jsonl, the features cache,
# eval.json and eval.txt. Nothing downloads: the questions come from the seed and the fact packages.
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-/tmp/mia-hallucination}
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python
probe() { nice -n 5 "$PY" -m mia_stream.cli probe "$@"; }

if [ -z "${SKIP_COLLECT:-}" ]; then
  probe collect "$DIR" ${COLLECT_ARGS:-}
fi
ship=(--ship)
[ -n "${NO_SHIP:-}" ] && ship=()
out() { if [ -n "${NO_SHIP:-}" ]; then echo --out "$DIR/$1.json"; fi; }
# token_probe: every generated token with its claim-level label, layer and C by validation, threshold calibrated
# for at most 10 % alerting correct validation answers; with the logit features (TOKEN_ARGS= trains without)
probe train --data "$DIR" --detector token_probe --layer best ${TOKEN_ARGS---logit} "${ship[@]}" $(out token-probe) \
  > "$DIR/train-token_probe.json"
probe train --data "$DIR" --detector semantic_entropy_probe --layer best "${ship[@]}" $(out semantic-entropy-probe) \
  > "$DIR/train-semantic_entropy_probe.json"
if [ -z "${NO_LOOKBACK:-}" ]; then  # needs Q/K in the recording (collect's default --qk-layers all)
  probe train --data "$DIR" --detector lookback_ratio "${ship[@]}" $(out lookback-ratio) > "$DIR/train-lookback_ratio.json"
  # its threshold: calibrated on the validation split by replaying the analyzer (train leaves it at 0.5)
  if [ -n "${NO_SHIP:-}" ]; then lb="$DIR/lookback-ratio.json"; else lb=mia_stream/analyzers/probes/lookback-ratio-smollm2-135m.json; fi
  probe calibrate "$lb" --data "$DIR" > "$DIR/calibrate-lookback_ratio.json"
fi
# A shipped file says where it stands against the best free baseline (metrics.versus_baseline, printed by
# 'mia-stream analyze' and checked by tests/test_hallucination_detectors.py): write it from eval.txt after shipping.
if [ -n "${NO_SHIP:-}" ]; then
  probe eval --data "$DIR" --json "$DIR/eval.json" --analyzers "$DIR"/token-probe.json \
    "$DIR"/semantic-entropy-probe.json | tee "$DIR/eval.txt"
else
  probe eval --data "$DIR" --json "$DIR/eval.json" --analyzers \
    mia_stream/analyzers/probes/token-probe-smollm2-135m.json \
    mia_stream/analyzers/probes/semantic-entropy-probe-smollm2-135m.json | tee "$DIR/eval.txt"
fi
