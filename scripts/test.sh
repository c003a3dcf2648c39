#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the whole test suite on CPU. Triton kernels run in the
# interpreter (TRITON_INTERPRET=1): no GPU is needed or used.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
export TRITON_INTERPRET=1
python -m pytest -q "$@"
