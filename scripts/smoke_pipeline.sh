#!/usr/bin/env bash
# The CI smoke pipeline on the embedded default model (SmolLM2-135M-Instruct): convert to MLA at the
# largest latent stock vLLM serves for it (the default --target vllm shape: rank 256 + rope 64 = 320
# of 384 K+V values per token and layer, one-shot), calibrate FP8 KV scales (folded into the weights),
# validate against the source with the smoke suite in the bundled runtime (every task once: 2.5 minutes with
# the builds on 2 cores, against 4.5 with the quick suite), and gate with recipes/gates/smoke.yaml. Exits non-zero when any stage fails or the gate fails. Needs
# scripts/setup.sh to have run.
set -euo pipefail
cd "$(dirname "$0")/.."
. .venv/bin/activate
out="${1:-${TMPDIR:-/tmp}/kvconvert-smoke}"
kvconvert pipeline --src smollm2-135m --heal none --kv-dtype fp8 --policy smoke --suite smoke --out "$out" --overwrite --fail-on-gate
