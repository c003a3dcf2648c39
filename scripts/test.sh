#!/usr/bin/env bash
# The README's test command: set up kvconvert (scripts/setup.sh) and stock vLLM for the engine tests
# (scripts/setup_vllm.sh: ./.venv-vllm, ~3.4 GB), then run the whole test suite on CPU. Triton
# kernels run in the interpreter (TRITON_INTERPRET=1): no GPU is needed or used. The vLLM engine
# tests are required (KVCONVERT_REQUIRE_VLLM=1: a missing vLLM fails them instead of skipping);
# KVCONVERT_SKIP_VLLM=1 skips the vLLM setup and lets those tests skip. Likewise stock llama.cpp
# (scripts/setup_llamacpp.sh: llama-cpp-python built for this CPU into ./.venv, minutes the first time on a
# CPU, seconds after): its engine tests are required (KVCONVERT_REQUIRE_LLAMACPP=1);
# KVCONVERT_SKIP_LLAMACPP=1 skips that setup and lets them skip.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
if [ "${KVCONVERT_SKIP_VLLM:-0}" != "1" ]; then
  bash scripts/setup_vllm.sh
  export KVCONVERT_REQUIRE_VLLM=1
fi
if [ "${KVCONVERT_SKIP_LLAMACPP:-0}" != "1" ]; then
  bash scripts/setup_llamacpp.sh
  export KVCONVERT_REQUIRE_LLAMACPP=1
fi
. .venv/bin/activate
export TRITON_INTERPRET=1
python -m pytest -q "$@"
