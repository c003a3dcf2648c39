#!/usr/bin/env bash
# The README's main job: set up (scripts/setup.sh), then on the embedded default model
# (SmolLM2-135M-Instruct) build two candidates for a smaller KV cache and measure both against the
# source in the bundled runtime (quick suite: essays perplexity/KL, passkey, NIAH, a LongBench-mini
# subset; gate: the built-in `default` policy):
#   1. what `kvconvert plan` picks for a budget of 50% of the bf16 KV bytes and stock vLLM (it builds, with
#      the recipe's own options, and measures every candidate that fits and is not dominated; on SmolLM2: the
#      source with a calibrated FP8 cache, "don't convert, just quantize"), then validated by `kvconvert
#      pipeline --kv-budget 50%`, which uses the plan's build (its provenance record matches) instead of
#      calibrating again;
#   2. MLA at the largest latent stock vLLM serves for this model (256 + 64 = 320 values per token
#      and layer, 83% of its K+V), one-shot, with a calibrated FP8 KV cache: 42% of the bf16 bytes. It
#      fails the gate on purpose: it shows what the smaller cache costs without healing (a GPU job).
# The source is measured once for both candidates and the plan (validate keeps its results in
# ~/.cache/kvconvert/validate). Ends with the side-by-side table, a picture, the gate of the candidate
# shipped and one sentence on what was traded. Time on 2 CPU cores: docs/BENCHMARKS.md ("The README's
# main job").
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
out="${1:-out/demo}"
cat <<'EOF'

== kvconvert demo: two ways to shrink SmolLM2-135M's KV cache, each measured against the source ==
  [1/3] kvconvert plan for 50% of the bf16 KV bytes, served by stock vLLM: it builds what fits (with the
        calibration its recipe ships), measures it and picks the least damage; the pipeline then takes
        the plan's build as is, validates it (quick suite: perplexity/KL on essays, passkey, NIAH,
        LongBench-mini subset) and gates it.
  [2/3] MLA 256+64 one-shot + FP8 KV, 42% of the bf16 bytes: built, validated and gated the same way.
        It FAILS the gate on purpose ("gate FAILED" below is expected): one-shot MLA at this size costs
        more quality than the gate allows; healing it is a GPU job.
  [3/3] The two side by side: bytes, quality deltas, gate verdicts, a picture, and what was shipped.
  The source model is measured once, by the first validation, and reused by the second.

EOF
start=$SECONDS
phase() { echo; echo "== demo [$1/3] $2 (demo time so far: $((SECONDS - start)) s)"; }
phase 1 "kvconvert plan + pipeline, 50% KV budget"
kvconvert pipeline --src smollm2-135m --kv-budget 50% --target vllm --out "$out/plan50" --overwrite
phase 2 "MLA 256+64 one-shot + FP8 KV (fails its gate on purpose)"
kvconvert pipeline --src smollm2-135m --heal none --kv-dtype fp8 --out "$out/mla320-fp8" --overwrite
phase 3 "summary"
python scripts/demo_summary.py --policy default --png "$out/summary.png" \
  "MLA 256+64 one-shot + FP8=$out/mla320-fp8" "kvconvert plan, 50% budget=$out/plan50"
echo "demo: $((SECONDS - start)) s after setup"
