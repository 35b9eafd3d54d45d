#!/usr/bin/env bash
# On the GPU host: collect the model parts carried by this call (scripts/stage_model_parts.sh) in /tmp/mparts
# (it lasts while the host stays warm); once every part is there and the sha256 matches, assemble /tmp/model.
# Exit 0 with MODEL_READY when /tmp/model is usable, 3 while parts are still missing.
set -uo pipefail
PARTS=${MPARTS:-/tmp/mparts}; MODEL=${MODEL_OUT:-/tmp/model}
mkdir -p "$PARTS"
for d in "$@"; do
  [ -d "$d" ] && cp -f "$d"/model.safetensors.part* "$d"/manifest.txt "$PARTS"/ 2>/dev/null
done
if [ -f "$MODEL/.complete" ]; then echo "MODEL_READY $MODEL"; exit 0; fi
[ -f "$PARTS/manifest.txt" ] || { echo "no manifest yet"; exit 3; }
np=$(sed -n 's/^nparts=//p' "$PARTS/manifest.txt"); want=$(sed -n 's/^sha256=//p' "$PARTS/manifest.txt")
have=$(ls "$PARTS"/model.safetensors.part* 2>/dev/null | wc -l)
echo "model parts on the device: $have of $np"
[ "$have" -lt "$np" ] && exit 3
mkdir -p "$MODEL"
cat "$PARTS"/model.safetensors.part* > "$MODEL/model.safetensors"
got=$(sha256sum "$MODEL/model.safetensors" | cut -d' ' -f1)
[ "$got" = "$want" ] || { echo "checksum mismatch: $got != $want"; exit 4; }
cp -f .stage/model/meta/* "$MODEL"/ 2>/dev/null
touch "$MODEL/.complete"
echo "MODEL_READY $MODEL ($(du -sh "$MODEL" | cut -f1))"
