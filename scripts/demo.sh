#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the main job on the embedded default model (SmolLM2-135M-Instruct):
# convert to MLA (rank 96 + rope 32, 33% of the source KV), calibrate FP8 KV scales, validate against the
# source in the bundled runtime and gate. Prints the report table and where the pictures are.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
kvconvert pipeline --src smollm2-135m --heal none --out "${1:-out/smollm2-mla}" --overwrite
