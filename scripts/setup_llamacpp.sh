#!/usr/bin/env bash
# Stock llama.cpp for kvconvert's engine checks: llama-cpp-python (its ctypes bindings of llama.cpp's C
# API, with llama.cpp vendored in the sdist) built from PyPI's sdist into kvconvert's own ./.venv (the
# `llamacpp` extra of pyproject.toml names the version). kvconvert drives it through
# kvconvert/engines/llamacpp.py (tests marked `llamacpp`, `kvconvert validate --engine llamacpp`).
#
# What is built: libllama and ggml's CPU backend only (no llava/mtmd, no common library, tools, examples,
# tests or server; no GPU backend), with GGML_NATIVE on: -march=native, so this CPU's AVX-512 or AVX2 paths.
# A native build must never reach a CPU without those instructions (SIGILL). So pip's wheel cache is not
# used for it (pip keys cached wheels by the sdist alone, not by the CPU): the wheel is built with
# --no-cache-dir and kept in kvconvert's own cache, $KVCONVERT_HOME/wheels/llama-cpp-python-VERSION-KEY/,
# KEY being a hash of the CPU's model name and instruction-set flags (/proc/cpuinfo), the compiler and the
# CMake arguments. Another CPU (a machine sharing $KVCONVERT_HOME, a copied venv) gets its own build.
# Only the first build on a CPU costs minutes; later setups install the kept wheel in seconds.
# Idempotent: a second run only checks (the marker .venv/kvconvert-llamacpp.key holds the installed KEY).
# Measured: docs/engines.md, "llama.cpp".
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
VENV=.venv
PY="$VENV/bin/python"
export PIP_DISABLE_PIP_VERSION_CHECK=1
if [ ! -x "$PY" ]; then
  echo "setup_llamacpp.sh: no $VENV here; run scripts/setup.sh first (llama-cpp-python installs into kvconvert's venv)" >&2
  exit 1
fi
# The one pin: pyproject.toml's optional extra `llamacpp = ["llama-cpp-python==X"]`.
VERSION=$("$PY" - <<'EOF'
import re, tomllib
extra = tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["llamacpp"]
print(next(re.fullmatch(r"llama-cpp-python==(\S+)", r).group(1) for r in extra if r.startswith("llama-cpp-python==")))
EOF
)
CMAKE_ARGS_LIST=(
  -DCMAKE_BUILD_TYPE=Release
  -DLLAVA_BUILD=OFF                       # llama-cpp-python's multimodal library (mtmd)
  "-DCMAKE_PROJECT_llama.cpp_INCLUDE=$ROOT/scripts/llamacpp_lib_only.cmake"  # common library off
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF
  -DLLAMA_BUILD_APP=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF
  -DGGML_NATIVE=ON -DGGML_CPU_ALL_VARIANTS=OFF -DGGML_BACKEND_DL=OFF -DGGML_CCACHE=OFF
  -DGGML_CUDA=OFF -DGGML_VULKAN=OFF -DGGML_METAL=OFF -DGGML_BLAS=OFF -DGGML_RPC=OFF
)
case "$ROOT" in *" "*) echo "setup_llamacpp.sh: the checkout's path has a space ($ROOT); CMAKE_ARGS cannot carry it" >&2; exit 1;; esac
cpu_id() {
  # model name + instruction-set flags: what -march=native compiles for
  grep -m1 -E '^model name' /proc/cpuinfo || true
  grep -m1 -E '^(flags|Features)' /proc/cpuinfo || true
  uname -m
}
KEY=$( { cpu_id; "${CC:-cc}" --version 2>/dev/null | head -1; echo "$VERSION ${CMAKE_ARGS_LIST[*]/$ROOT/}";
         cat scripts/llamacpp_lib_only.cmake; } \
       | sha256sum | cut -c1-16)
HOME_DIR=${KVCONVERT_HOME:-$HOME/.cache/kvconvert}
WHEELS="$HOME_DIR/wheels/llama-cpp-python-$VERSION-$KEY"
MARKER="$VENV/kvconvert-llamacpp.key"

installed() {
  "$PY" -c "import llama_cpp, sys; sys.exit(0 if llama_cpp.__version__ == '$VERSION' else 1)" 2>/dev/null \
    && [ "$(cat "$MARKER" 2>/dev/null)" = "$KEY" ]
}
report() {  # llama.cpp's own view of the CPU features it was built with
  "$PY" -c "import llama_cpp.llama_cpp as L; L.llama_backend_init(); \
print('llama.cpp system info:', L.llama_print_system_info().decode().strip())"
}
if installed; then
  echo "llama.cpp ready: llama-cpp-python $VERSION in $VENV (build $KEY, wheel kept in $WHEELS)"
  report
  exit 0
fi

started=$(date +%s)
wheel=$(ls "$WHEELS"/llama_cpp_python-"$VERSION"-*.whl 2>/dev/null | head -1 || true)
if [ -z "$wheel" ]; then
  mkdir -p "$HOME_DIR/wheels"
  build=$(mktemp -d "$HOME_DIR/wheels/.build-$KEY-XXXXXX")
  trap 'rm -rf "$build"' EXIT
  echo "setup_llamacpp.sh: building llama-cpp-python $VERSION from its sdist for this CPU (build $KEY; several" \
       "minutes on 2 cores, once per CPU; log: $build/build.log)"
  # --no-cache-dir: pip would otherwise keep this native wheel in its own cache, keyed by the sdist only
  if ! CMAKE_ARGS="${CMAKE_ARGS_LIST[*]}" CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)} \
      "$PY" -m pip wheel -v --no-cache-dir --no-deps --no-binary llama-cpp-python "llama-cpp-python==$VERSION" \
      -w "$build/wheel" >"$build/build.log" 2>&1; then
    cp "$build/build.log" "$HOME_DIR/wheels/llama-cpp-python-$VERSION-$KEY.failed.log"
    echo "setup_llamacpp.sh: the build failed; its log: $HOME_DIR/wheels/llama-cpp-python-$VERSION-$KEY.failed.log" >&2
    tail -20 "$build/build.log" >&2
    exit 1
  fi
  steps=$(grep -cE '^\s*\[[0-9]+/[0-9]+\]' "$build/build.log" || true)
  mkdir -p "$build/keep"
  mv "$build"/wheel/llama_cpp_python-"$VERSION"-*.whl "$build/keep/"
  cp "$build/build.log" "$build/keep/"
  cpu_id > "$build/keep/cpu.txt"
  rm -rf "$WHEELS"
  mv "$build/keep" "$WHEELS"  # whole or not at all: a killed build leaves only the .build-* temp folder
  wheel=$(ls "$WHEELS"/llama_cpp_python-"$VERSION"-*.whl | head -1)
  echo "setup_llamacpp.sh: built in $(( $(date +%s) - started )) s ($steps build steps; $(nproc) cores," \
       "load average $(cut -d' ' -f1-3 /proc/loadavg), which other work on the machine adds to)"
fi
pip_q() { "$PY" -m pip install -q "$@" 2>&1 | grep -vE "^WARNING: Location|is ignored" || true; }
pip_q --force-reinstall --no-deps "$wheel"
pip_q "$wheel"  # its Python dependencies (numpy, diskcache, jinja2, typing-extensions)
echo "$KEY" > "$MARKER"
installed || { echo "setup_llamacpp.sh: llama_cpp does not import from $VENV after installing $wheel" >&2; exit 1; }
echo "llama.cpp ready: llama-cpp-python $VERSION in $VENV (build $KEY), installed in $(( $(date +%s) - started )) s"
report
