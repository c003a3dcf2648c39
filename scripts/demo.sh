#!/usr/bin/env bash
# The README's main job: set up (scripts/setup.sh), then on the embedded default model
# (SmolLM2-135M-Instruct) build two candidates for a smaller KV cache and measure both against the
# source in the bundled runtime (quick suite, gate recipes/gates/default.yaml):
#   1. MLA at the largest latent stock vLLM serves for this model (256 + 64 = 320 values per token
#      and layer, 83% of its K+V), one-shot, with a calibrated FP8 KV cache: 42% of the bf16 bytes;
#   2. what `kvconvert plan` picks for a budget of 50% of the bf16 KV bytes and stock vLLM (it measures
#      every candidate that fits; on SmolLM2: the source with a calibrated FP8 cache, "don't convert,
#      just quantize"), built and validated by `kvconvert pipeline --kv-budget 50%`.
# Ends with the side-by-side table, a picture, the gate of the candidate shipped and one sentence
# on what was traded. About 15-20 minutes on 2 CPU cores.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
out="${1:-out/demo}"
kvconvert pipeline --src smollm2-135m --heal none --kv-dtype fp8 --out "$out/mla320-fp8" --overwrite
kvconvert pipeline --src smollm2-135m --kv-budget 50% --target vllm --out "$out/plan50" --overwrite
python scripts/demo_summary.py --policy default --png "$out/summary.png" \
  "MLA 256+64 one-shot + FP8=$out/mla320-fp8" "kvconvert plan, 50% budget=$out/plan50"
