"""The options of `kvconvert validate`: one pydantic model that is the recipe's `validate` block,
the argument of kvconvert.eval.validate.run_validate and (generated) the command's flags. Torch-free."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field

from kvconvert.device import DEVICE_FIELD
from kvconvert.eval.suites import SUITES
from kvconvert.kvformat import (  # "auto" + the runtime's formats, and K/V pairs of llama.cpp's types
    AUTO_WEIGHT_DTYPE_NAMES, VALIDATE_KV_DTYPES as KV_DTYPE_CHOICES, kv_dtype_type, pair_help,
)
from kvconvert.stage_options import StageOptions

ENGINES = ("auto", "runtime", "transformers", "vllm", "llamacpp")
SIDE_ENGINES = ("vllm", "llamacpp")  # stock engines that score the windows beside the bundled runtime


class ValidateOptions(StageOptions):
    suite: Literal[tuple(SUITES)] = Field("quick", description="smoke (tests) < quick (< 5 min on CPU) < standard "
                                                               "(~30 min) < full (GPU).")
    engine: Literal[ENGINES] = Field(
        "auto", description="auto = the bundled runtime when it imports, else transformers (with a note). vllm = the "
                            "suite in the bundled runtime, plus perplexity and KL computed by stock vLLM on the same "
                            "windows, side by side in the report (vLLM from ./.venv-vllm: bash scripts/setup_vllm.sh). llamacpp = the "
                            "same with stock llama.cpp (GGUF exports of both models; its KL and top-1 agreement; "
                            "llama-cpp-python in ./.venv: bash scripts/setup_llamacpp.sh).")
    kv_dtype: kv_dtype_type(KV_DTYPE_CHOICES) = Field(
        "auto", description="Candidate's KV-cache format (auto = the engine's unquantized cache: runtime bf16, "
                            "transformers fp32). " + pair_help(KV_DTYPE_CHOICES))
    source_kv_dtype: kv_dtype_type(KV_DTYPE_CHOICES) = Field("auto", description="Source's KV-cache format.")
    kv_scales: Literal["checkpoint", "dynamic"] = Field(
        "checkpoint", description="Runtime engine: fp8/nvfp4 scales from the checkpoint or from the first prefill.")
    dtype: Literal[AUTO_WEIGHT_DTYPE_NAMES] = Field(
        "auto", description="Both models' weights/activations: auto = as stored, except on a CPU without native bf16 "
                            "(AVX2 only), where 16-bit weights run in fp32 when that copy fits in half the free memory.")
    llamacpp_rotation: bool | None = Field(
        None, description="llama.cpp's Hadamard rotation of its quantized K/V caches (q8_0, q4_0, ...), in the "
                          "runtime's emulation and in llama.cpp alike: default as LLAMA_ATTN_ROT_DISABLE says (read "
                          "as llama.cpp reads it, with C's atoi: on when unset or 0, off for any other number, e.g. 1, "
                          "2 or 1.5); off = LLAMA_ATTN_ROT_DISABLE=1 for the run. llama.cpp rotates only a quantized "
                          "cache whose head size is a multiple of 64, and its MLA path never.")
    device: str = DEVICE_FIELD
    longbench_dir: Path | None = Field(None, description="LongBench folder of <task>.jsonl(.gz) files (default: "
                                                        "$KVCONVERT_LONGBENCH_DIR, else the LongBench-mini subset "
                                                        "shipped with kvconvert).")
