#!/usr/bin/env bash
# The GPU checks (kernels, runtime, distillation speed and memory) in one command, for a rarely lent
# GPU machine (one H100/H200, no network, Python with torch + Triton + transformers but not
# kvconvert's other dependencies).
#
#   here:       bash scripts/gpu_session.sh prepare    # downloads the missing wheels into .whl/ (git-ignored)
#   on the GPU: bash scripts/gpu_session.sh run        # with .whl carried; results under $OUT (or ./gpu-out)
#
# `run` installs the wheels and kvconvert into /tmp/site (no deps, nothing else touched; pytest runs
# with PYTHONSAFEPATH=1, inherited by the tests' subprocesses, so the checkout's kvconvert/, which lacks
# kernels/ and runtime/, does not shadow it), then, each
# step logged under $OUT and a failing step not stopping the next:
#   1. kernels  the kernel tests compiled on the GPU (TRITON_INTERPRET=0 KVCONVERT_TEST_DEVICE=cuda)
#   2. bench    scripts/bench_kernels.py's short run (~1.5 min on an H100): MLA and GQA at 8K and
#               32K, every cache mode and dot variant at the tuned launch configs, the design candidates' rows,
#               FlashInfer / FlashMLA rows (or their failure) on the same caches, each row vs bf16 and vs the
#               measured copy; writes $OUT/bench_kernels.{json,md} (BENCH_ARGS="--tune": the tuning sweep)
#   3. device   the runtime's GPU tests (tests/runtime/test_device.py: logits against transformers)
#   4. distill  scripts/bench_distill.py --device cuda: heal's distillation tokens/s per micro-batch
#               (DISTILL_VARIANTS; default b8s2048, b16s2048, b16s2048 with gradient checkpointing, b8s2048
#               LoRA, b8s2048 and b16s2048 with each decoder layer compiled), each row's peak
#               torch.cuda.max_memory_allocated beside kvconvert.heal.memory's estimate (target: 1.0-1.3x);
#               the first row's step profiled ($OUT/profile.txt) and its allocator trace replayed to what is
#               live at the peak ($OUT/memtrace.txt); writes $OUT/bench_distill.{json,md}
#   5. heal7b   the 7B check: a Llama-2-7B-shaped random-weight teacher and its MLA 512 + 64 student
#               (32 layers, from kvconvert.presets, drawn on the GPU and written in bf16: 27 GB of disk, nothing
#               large travels) distilled for 1 + 3 steps per row (HEAL7B_VARIANTS; default 1 x 2048 tokens
#               with and without gradient checkpointing, 2 x 2048 without) with recipes/llama-2-7b-mla512.yaml's
#               heal_distill settings (bf16, every attention weight trained, fused Adam): tokens/s, peak
#               memory and the estimate; writes $OUT/bench_distill_7b.json (log in distill.log)
# `run distill heal7b` is the distillation half (about 5 min on an H200: 200 + 180 s caps); `run kernels
# bench` picks other steps. Each step runs under `timeout` (STEP_TIMEOUT_<step>, seconds) so one slow
# step cannot eat a short lease; BENCH_ARGS passes options to bench_kernels.py (e.g. "--tune --quick --contexts
# 2048,32768": the sweep on 5 tuning configs instead of 11); the compiled kernel tests run on 8 pytest-xdist workers.
set -uo pipefail
cd "$(dirname "$0")/.."
WHEELS=(pydantic==2.14.3 pydantic-core==2.50.4 annotated-types==0.8.0 typing-inspection==0.4.5 gguf==0.19.0
        wonderwords==3.0.1)
# bench's peer: FlashInfer 0.6.4 (7.8 MB; it JIT-compiles its kernels with the machine's nvcc through
# ninja and apache-tvm-ffi) and what `import flashinfer` needs beyond the image's torch/numpy/requests/tqdm/
# packaging. Newer wheels do not fit: 0.6.18 is 18 MB and 0.7.x 34-62 MB, and both add cuda-python, cuda-tile
# and nccl4py; 0.6.4's cudnn-frontend (11.6 MB) and cutlass-dsl requirements are imported only by kernels the
# bench does not call. FlashMLA: sgl-flash-mla 1.0 (9.9 MB, torch's stable ABI; it asks for torch >= 2.14.1, the
# image has 2.11, so it may not load: the bench then records "not importable"). All of .whl: about 26 MB of the
# 64 MiB a device call carries.
WHEELS+=(flashinfer-python==0.6.4 apache-tvm-ffi==0.1.15.post2 click==8.5.1 einops==0.8.2 ninja==1.13.2
         nvidia-ml-py==13.615.71 tabulate==0.10.0 sgl-flash-mla==1.0.0)

prepare() {
  grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl "${WHEELS[@]}"
  ls -la .whl
  du -sh .whl  # a device call carries 64 MiB in all
}

recipe_distill() {
  # a recipe's heal_distill block as --stage JSON: its training switches (the shape and gradient
  # checkpointing come from --variants; data, tokens and schedule do not change memory or speed)
  python3 - "$1" <<'PY'
import json, sys
from kvconvert.recipe import load_recipe
d = load_recipe(sys.argv[1]).distill
print(json.dumps({k: getattr(d, k) for k in ("fused_optimizer", "targets", "train", "lora_rank", "kl_weight",
                                               "lm_weight", "hidden_weight")}))
PY
}

run() {
  local out="${OUT:-$PWD/gpu-out}" steps=("$@")
  [ ${#steps[@]} -eq 0 ] && steps=(kernels bench device distill heal7b)
  mkdir -p "$out"
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
    || { echo "wheel install failed"; exit 1; }
  # kvconvert itself; where the image's setuptools is too old for pyproject.toml, the same layout by
  # hand (pyproject's package-dir: runtime/ and kernels/ install as kvconvert.runtime / .kernels)
  python3 -m pip install -q --no-deps --no-build-isolation --target /tmp/site . 2>>"$out/setup.log" \
    || { mkdir -p /tmp/site && cp -r kvconvert /tmp/site/ && cp -r runtime /tmp/site/kvconvert/runtime \
         && cp -r kernels /tmp/site/kvconvert/kernels && echo "kvconvert copied (pip: $out/setup.log)"; }
  # /tmp/site/bin: the ninja that FlashInfer's JIT runs
  export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 PATH="/tmp/site/bin:$PATH"
  nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.mem --format=csv | tee -a "$out/setup.log"
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$out/setup.log"
  # a device call brings back at most 8 files: setup.log, tests.log (both pytest steps), bench.log,
  # distill.log (distill and heal7b), profile.txt, memtrace.txt and the benchmarks' JSON + markdown
  # (`run distill heal7b`: 7 files; `run kernels bench device`: 5)
  for step in "${steps[@]}"; do
    local started=$SECONDS log="$out/$step.log"
    case "$step" in kernels|device) log="$out/tests.log" ;; heal7b) log="$out/distill.log" ;; esac
    case "$step" in
      # -m "not slow": the only slow kernel tests are bench_kernels' CPU smoke runs (the interpreter), no use here
      kernels) KVCONVERT_TEST_DEVICE=cuda PYTHONSAFEPATH=1 timeout "${STEP_TIMEOUT_kernels:-240}" \
                 python3 -m pytest -q -n 8 -p no:cacheprovider -m "not slow" tests/kernels ;;
      bench) timeout "${STEP_TIMEOUT_bench:-420}" python3 scripts/bench_kernels.py ${BENCH_ARGS:-} \
               --json "$out/bench_kernels.json" --md "$out/bench_kernels.md" ;;
      device) PYTHONSAFEPATH=1 timeout "${STEP_TIMEOUT_device:-120}" python3 -m pytest -q -p no:cacheprovider tests/runtime/test_device.py ;;
      distill) timeout "${STEP_TIMEOUT_distill:-200}" python3 scripts/bench_distill.py --device cuda \
                 --variants "${DISTILL_VARIANTS:-b8s2048,b16s2048,b16s2048:ckpt,b8s2048:lora,b8s2048:compile,b16s2048:compile}" \
                 --profile "$out/profile.txt" --memory-trace "$out/memtrace.txt" ${DISTILL_ARGS:-} \
                 --json "$out/bench_distill.json" --md "$out/bench_distill.md" ;;
      heal7b) timeout "${STEP_TIMEOUT_heal7b:-180}" python3 scripts/bench_distill.py --device cuda \
                --preset llama-2-7b --rank 512 --rope-dim 64 --save-dtype bfloat16 \
                --variants "${HEAL7B_VARIANTS:-b1s2048:ckpt,b1s2048,b2s2048}" \
                --warmup 1 --steps 3 --mixed-precision bf16 --stage "$(recipe_distill recipes/llama-2-7b-mla512.yaml)" \
                --json "$out/bench_distill_7b.json" --md /tmp/bench_distill_7b.md ;;
      *) echo "unknown step $step: kernels, bench, device, distill, heal7b" ;;
    esac >> "$log" 2>&1
    echo "$step: exit $? in $((SECONDS - started)) s (log $log)"
    tail -3 "$log"
  done
}

case "${1:-}" in
  prepare) prepare ;;
  run) shift; run "$@" ;;
  *) echo "usage: $0 prepare | run [kernels] [bench] [device] [distill] [heal7b]"; exit 2 ;;
esac
