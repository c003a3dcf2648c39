#!/usr/bin/env bash
# The README's main job: set up (scripts/setup.sh), then on the embedded default model
# (SmolLM2-135M-Instruct) let `kvconvert plan` pick a KV cache for two budgets and engines, build each
# pick and measure it against the source in the bundled runtime (quick suite: essays perplexity/KL, also after
# 3478 cached tokens (the long NIAH prompt's last 512), passkey and NIAH at 512 and 4096 tokens, a LongBench-mini
# subset, every task sample's answer likelihood; the samples decode together; gate: the built-in `default` policy):
#   1. 50% of the bf16 KV bytes, served by stock vLLM: the plan builds and measures every candidate that
#      fits and is not dominated (on SmolLM2: the source with a calibrated FP8 cache, "don't convert, just
#      quantize"); `kvconvert pipeline --kv-budget 50%` validates the plan's build (its provenance record
#      matches) instead of calibrating again;
#   2. a third of the bf16 KV bytes (33%), served by stock llama.cpp, where the frontier bends: 4-bit keys and
#      values (iq4_nl, 4.5 bits per value with its block scales, 28%) against 5-bit keys with 4-bit values
#      (q5_0/iq4_nl, 31%: the 4-bit loss sits in the keys): the plan calibrates and measures both with the runtime's
#      bit-exact emulation of llama.cpp's cache (its Hadamard rotation included), picks the least damage and
#      the pipeline writes the GGUF with the llama-cli flags that serve it, then validates and gates it.
# Both calibrate on 4096 tokens (--calib-tokens): the second moments and amax they need settle well before
# calibrate's default 16384 (docs/BENCHMARKS.md, "The README's main job").
# The source is measured once for both candidates (validate keeps its results in ~/.cache/kvconvert/validate).
# Ends with the side-by-side table, a picture, the candidate shipped (the smallest that passes the gate) and
# what it traded against the larger one. Time on 2 CPU cores, per CPU kind (AVX2 / AVX-512 / AMX, printed
# first): docs/BENCHMARKS.md, "The README's main job".
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
out="${1:-out/demo}"
cat <<'EOF'

== kvconvert demo: SmolLM2-135M's KV cache at 50% (vLLM) and at a third (llama.cpp), each measured against the source ==
  [1/3] kvconvert plan for 50% of the bf16 KV bytes, served by stock vLLM: it builds what fits (with the
        calibration its recipe ships), measures it and picks the least damage; the pipeline then takes
        the plan's build as is, validates it (quick suite: perplexity/KL on essays, also after 3478 cached
        tokens, passkey and NIAH at 512 and 4096 tokens, LongBench-mini subset) and gates it.
  [2/3] kvconvert plan for 33%, served by stock llama.cpp: 4-bit K and V against 5-bit K with 4-bit V, built,
        measured, the least damage written
        as GGUF with the llama-cli flags that serve it, validated and gated the same way.
  [3/3] The two side by side: bytes, quality deltas, gate verdicts, a picture, what was shipped and traded.
  The source model is measured once, by the first validation, and reused by the second.

EOF
python scripts/demo_summary.py --machine  # CPU kind and expected time (docs/BENCHMARKS.md, "The README's main job")
start=$SECONDS
phase() { echo; echo "== demo [$1/3] $2 (demo time so far: $((SECONDS - start)) s)"; }
phase 1 "kvconvert plan + pipeline, 50% KV budget, vLLM"
kvconvert pipeline --src smollm2-135m --kv-budget 50% --target vllm --calib-tokens 4096 --out "$out/plan50" --overwrite
phase 2 "kvconvert plan + pipeline, 33% KV budget, llama.cpp's K/V types"
kvconvert pipeline --src smollm2-135m --kv-budget 33% --target llamacpp --kv-dtypes iq4_nl,q5_0/iq4_nl \
  --calib-tokens 4096 --out "$out/plan33" --overwrite
phase 3 "summary"
python scripts/demo_summary.py --policy default --png "$out/summary.png" \
  "kvconvert plan, 50%, vLLM=$out/plan50" "kvconvert plan, 33%, llama.cpp=$out/plan33"
echo "demo: $((SECONDS - start)) s after setup"
