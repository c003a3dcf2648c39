"""Model runners: one small interface over the engines that `kvconvert validate` can drive.

    runner = LazyRunner(folder, engine="runtime" | "transformers", kv_dtype="auto")  # loads on first use
    runner.logits(ids)                  # ids: LongTensor [T]  -> fp32 logits [T, vocab]
    runner.greedy(ids, max_new_tokens, stop_ids, min_new_tokens=0)  # -> new token ids, stop excluded

Weights run in `dtype` (compute_dtype): "auto" = as stored (a bf16 checkpoint runs in bf16, the runtime
maps its weights from the files), except on a CPU without native bf16 (AVX2 only: cpu_kind), where 16-bit
weights run in fp32 (upcast exactly, when that copy fits), or bf16/fp16/fp32 on request. `close()` frees a model before the next one loads;
`check_memory()` refuses up front when one model cannot fit (kvconvert.memory).

- TransformersRunner: AutoModelForCausalLM from the folder (stored dtype), no remote code, its own
  greedy loop (argmax, KV cache, no generation_config knobs such as repetition penalty).
  K/V stay fp32 ("auto"/"fp32"); bf16/fp16 round every cached K/V; fp8/fp8_e5m2/nvfp4 use
  kvconvert.quant's fake-quant cache (quantize-dequantize of what an engine caches, with the
  scales of a `kvconvert calibrate` checkpoint), so prefill attention already reads quantized K/V.
- RuntimeRunner: kvconvert.runtime.LLM (the bundled paged-KV engine). Logits go through its
  paged path (`LLM.score`) and KV is stored like an engine stores it (bf16, fp8 with scales,
  nvfp4), so this is the engine that measures a quantized-KV candidate.

Every runner has a `fingerprint`: a hash of the checkpoint's content (per-file sha256s, see
kvconvert.checkpoint.fingerprint: an in-place edit changes it) plus the engine and KV format.
Cached per-sample results are keyed by it.
"""

from __future__ import annotations

import gc
import hashlib
import sys
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path

import torch

from kvconvert.device import resolve_device
from kvconvert.checkpoint import CheckpointReader, read_config
from kvconvert.checkpoint.fingerprint import checkpoint_fingerprint  # noqa: F401 (the runners' key; re-exported)
from kvconvert.errors import KVConvertError
from kvconvert.eval.options import KV_DTYPE_CHOICES  # "auto": the engine's own cache
from kvconvert.ggml_formats import rotation_enabled
from kvconvert.kvformat import AUTO, check_kv_dtype, kv_pair

PROBE_TEXT = "KV caches: 128K tokens in FP8 & NVFP4, see https://x.io/a_b?c=1 — naïve café 東京 <tag>\n\tend."


def _quantized(kv_dtype: str) -> bool:
    """Stored with kv scales read from the checkpoint (fp8, fp8_e5m2, nvfp4); "auto" and llama.cpp's types
    (block scales set as rows are written) are not."""
    return kv_dtype != AUTO and kv_pair(kv_dtype).has_kv_scale


# --------------------------------------------------------------------------- fingerprints

def check_same_tokenizer(source_tok, candidate_tok, source: Path, candidate: Path) -> None:
    """Source and candidate must tokenize identically, or no comparison is meaningful."""
    fix = "validate a candidate converted from this source (copy the source's tokenizer files)"
    if len(source_tok) != len(candidate_tok):
        raise KVConvertError(f"tokenizers differ: {source} has {len(source_tok)} tokens, {candidate} has "
                             f"{len(candidate_tok)}; {fix}")
    a = source_tok(PROBE_TEXT, add_special_tokens=False).input_ids
    b = candidate_tok(PROBE_TEXT, add_special_tokens=False).input_ids
    if a != b:
        first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        raise KVConvertError(f"tokenizers differ: a probe string tokenizes to {len(a)} ids with {source} and "
                             f"{len(b)} with {candidate} (first difference at position {first}); {fix}")


# --------------------------------------------------------------------------- runners

def argmax_allowed(logits: torch.Tensor, banned: tuple[int, ...]) -> int:
    """argmax of logits [vocab] with the `banned` ids excluded."""
    if banned:
        logits = logits.clone()
        logits[list(banned)] = float("-inf")
    return int(logits.argmax())


def resolve_kv_dtype(engine: str, kv_dtype: str, kv_scales: str = "checkpoint") -> str:
    """The KV format a runner will really use ("auto": runtime bf16, transformers fp32); errors for
    combinations an engine cannot run."""
    try:  # a format, or a K/V pair of llama.cpp's types (q5_0/iq4_nl)
        kv_dtype = check_kv_dtype(kv_dtype, KV_DTYPE_CHOICES)
    except ValueError as exc:
        raise KVConvertError(f"--kv-dtype {kv_dtype!r} is unknown; choose one of {', '.join(KV_DTYPE_CHOICES)}, or "
                             f"a K/V pair KTYPE/VTYPE of llama.cpp's types ({exc})") from None
    if engine != "transformers":
        return "bf16" if kv_dtype == "auto" else kv_dtype
    if kv_dtype in ("auto", "fp32"):
        return "fp32"
    kv_dtype = kv_pair(kv_dtype).name  # the transformers hook knows canonical names only (fp8_e4m3 -> fp8)
    if _quantized(kv_dtype) and kv_scales != "checkpoint":
        raise KVConvertError("--kv-scales dynamic is a runtime-engine option; with --engine transformers the "
                             "scales come from the calibrated checkpoint")
    return kv_dtype


def check_kv_scales(path: Path, engine: str, kv_dtype: str, kv_scales: str) -> None:
    """A quantized KV format with checkpoint scales needs scales in the checkpoint: say so before
    any model is loaded (the transformers engine also needs calibrate's calibration_report.json)."""
    if not _quantized(kv_dtype) or kv_scales != "checkpoint":
        return
    with CheckpointReader(path, verify=False) as reader:
        has_scales = any(name.endswith(("k_scale", "kv_scale")) for name in reader.keys())
    hint = "run `kvconvert calibrate --src ... --kv-dtype " + kv_dtype + "` on it"
    if not has_scales:
        extra = " or pass --kv-scales dynamic (runtime engine)" if engine == "runtime" else ""
        raise KVConvertError(f"{path}: --kv-dtype {kv_dtype} needs KV scales (k_scale/v_scale) and there are none; "
                             f"{hint}{extra}")
    if engine == "transformers" and not (Path(path) / "calibration_report.json").is_file():
        raise KVConvertError(f"{path}: --engine transformers reads KV scales through calibration_report.json, "
                             f"which is missing; {hint}, or use --engine runtime")


def runner_fingerprint(path: Path, engine: str, kv_dtype: str, kv_scales: str,
                       dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> str:
    """16 hex chars naming (checkpoint content, engine, KV format, KV scale source, weight dtype,
    device kind)."""
    key = f"{checkpoint_fingerprint(path)}|{engine}|kv={kv_dtype}"
    if dtype != torch.float32:  # fp32 runs keep the fingerprints they had before --dtype existed
        key += f"|dtype={str(dtype).removeprefix('torch.')}"
    if torch.device(device).type == "cuda":  # GPU kernels round differently
        key += "|cuda"
    if engine == "runtime" and _quantized(kv_dtype):
        key += f"|scales={kv_scales}"
    if kv_dtype != AUTO and kv_pair(kv_dtype).ggml_types and not rotation_enabled():  # llama.cpp's switch
        key += "|rotation=off"
    return hashlib.sha256(key.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class CPUKind:
    """The CPU's vector units as torch uses them. name: "AMX", "AVX-512", "AVX2" or "other"; capability: torch's
    kernel level (torch.backends.cpu.get_cpu_capability(), which ATEN_CPU_CAPABILITY lowers); flags: the vector
    flags /proc/cpuinfo lists; emulated: torch runs below what the CPU has (e.g. AVX2 kernels on AVX-512);
    native_bf16: bf16 matmuls run on bf16 instructions (AMX or AVX512_BF16, with AVX-512 kernels), not emulated."""

    name: str
    capability: str
    flags: tuple[str, ...]
    emulated: bool
    native_bf16: bool

    def describe(self) -> str:
        units = ", ".join(self.flags) or "none listed"
        run = f"torch runs {self.capability} kernels" + (" (lowered by ATEN_CPU_CAPABILITY / ONEDNN_MAX_CPU_ISA)"
                                                          if self.emulated else "")
        return f"{self.name} ({run}; /proc/cpuinfo: {units})"


VECTOR_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16")


def cpu_kind() -> CPUKind:
    """This machine's CPUKind (Linux /proc/cpuinfo; elsewhere torch's capability alone)."""
    capability = torch.backends.cpu.get_cpu_capability()
    try:
        words = next((line.split(":", 1)[1].split() for line in Path("/proc/cpuinfo").read_text().splitlines()
                      if line.startswith("flags")), [])
    except OSError:
        words = []
    flags = tuple(f for f in VECTOR_FLAGS if f in words)
    has = {"AMX": "amx_bf16" in flags, "AVX-512": "avx512f" in flags, "AVX2": "avx2" in flags}
    runs = {"AVX512": "AVX-512", "AVX2": "AVX2"}.get(capability, "other")
    name = "AMX" if runs == "AVX-512" and has["AMX"] else runs
    best = next((k for k in ("AMX", "AVX-512", "AVX2") if has[k]), runs)
    onednn_bf16 = bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    native = runs == "AVX-512" and onednn_bf16 and ("amx_bf16" in flags or "avx512_bf16" in flags)
    return CPUKind(name, capability, flags, emulated=bool(words) and best != name, native_bf16=native)


def compute_dtype(dtype: str | torch.dtype, stored: torch.dtype, path: Path, device: torch.device,
                  native_bf16: bool | None = None) -> torch.dtype:
    """The weights' compute dtype of a validation runner: `dtype` when given; for "auto" what the checkpoint
    stores, except on a CPU without native bf16 (native_bf16, default cpu_kind()'s; fp16 is never native here),
    where 16-bit weights are computed in fp32 (an exact upcast) unless that copy would take more than half the
    available memory.

    Measured (docs/BENCHMARKS.md, "The README's main job"): with AVX2 only, bf16 matmuls run about 3x slower
    than fp32 (SmolLM2's MLA 256+64, prefill of 512 tokens on one core: 8.7 s against 2.7 s), and the main job's MLA candidate took most
    of its 17 minutes there; with AVX512_BF16 bf16 is 1.2-1.4x faster. bf16 compute moves the logits by a KL
    of 0.0007-0.0008 nats/token against fp32 on the same weights (the quick suite's windows), far inside the
    gate's 0.05, so a checkpoint's numbers differ by about that between the two kinds of CPU; the fingerprint
    names the dtype, so their results never mix. A GPU keeps the stored dtype."""
    from kvconvert.memory import available_memory, resolve_dtype

    chosen = resolve_dtype(dtype, stored)
    if dtype not in ("auto", None) or device.type != "cpu" or chosen == torch.float32:
        return chosen
    if chosen == torch.bfloat16 and (cpu_kind().native_bf16 if native_bf16 is None else native_bf16):
        return chosen
    from kvconvert.checkpoint import estimate_checkpoint_bytes

    fits = 2 * estimate_checkpoint_bytes(path, itemsize=4) <= available_memory(device)
    return torch.float32 if fits else chosen


class RunnerInfo:
    """What a runner is, known before any model loads: path, engine, kv_dtype (resolved), kv_scales,
    config, max_context (longest sequence it can run), vocab_size, dtype (weights), device, fingerprint."""

    engine = "abstract"

    def __init__(self, path: Path, kv_dtype: str, kv_scales: str = "checkpoint", dtype: str | torch.dtype = "auto",
                 device: str | torch.device = "auto"):
        self.path = Path(path)
        self.device = resolve_device(device)
        self.kv_dtype = resolve_kv_dtype(self.engine, kv_dtype, kv_scales)
        self.kv_scales = kv_scales
        self.config = read_config(self.path)
        self.max_context = int(self.config.get("max_position_embeddings") or 2048)
        self.vocab_size = int(self.config["vocab_size"])
        with CheckpointReader(self.path, verify=False) as reader:
            self.dtype = compute_dtype(dtype, reader.stored_dtype("model.embed_tokens.weight"), self.path, self.device)
        self.fingerprint = runner_fingerprint(self.path, self.engine, self.kv_dtype, kv_scales, self.dtype, self.device)

    def describe(self) -> dict:
        return {"path": str(self.path), "engine": self.engine, "kv_dtype": self.kv_dtype,
                "dtype": str(self.dtype).removeprefix("torch."), "fingerprint": self.fingerprint,
                "architecture": (self.config.get("architectures") or ["?"])[0]}


@dataclass(frozen=True)
class SampleRequest:
    """One task sample's measurements through a runner. Greedy generation: at most max_new_tokens after prompt
    (token ids; 0 = none wanted), ended by any of stop_ids (the stop token excluded from the result), which are
    masked for the first min_new_tokens. Answer likelihood: the teacher-forced NLL of `reference` after prompt
    (empty = none wanted)."""

    prompt: tuple[int, ...]
    max_new_tokens: int = 0
    stop_ids: tuple[int, ...] = ()
    min_new_tokens: int = 0
    reference: tuple[int, ...] = ()

    @property
    def length(self) -> int:
        """Tokens its longer part reaches: the prompt and the generation or the reference, whichever is longer."""
        return len(self.prompt) + max(self.max_new_tokens, len(self.reference))


@dataclass
class SampleResult:
    tokens: list[int]  # the greedy continuation ([] when none was wanted)
    answer: dict | None  # answer_nll of the reference (None when none was wanted)


def answer_nll(rows: torch.Tensor, reference) -> dict:
    """rows [len(reference), vocab]: the logits that predict each reference token (row t, after prompt and
    reference[:t]) -> {"nll": sum of -log p over the reference tokens, "tokens": its length}. Summed in float64 (an
    answer is a handful to a few hundred tokens; fp32 would do, float64 keeps it exact for reuse)."""
    target = torch.tensor(list(reference), dtype=torch.long)
    nll = torch.nn.functional.cross_entropy(rows.double(), target, reduction="sum")
    return {"nll": float(nll), "tokens": len(target)}


class ModelRunner(RunnerInfo, ABC):
    """Interface shared by the engines: RunnerInfo's attributes, max_len (the longest sequence this
    run needs), and the methods logits, greedy, run_samples, close."""

    def __init__(self, path: Path, kv_dtype: str = "auto", kv_scales: str = "checkpoint",
                 dtype: str | torch.dtype = "auto", max_len: int | None = None, device: str | torch.device = "auto"):
        super().__init__(path, kv_dtype, kv_scales, dtype, device)
        self.max_len = min(max_len or self.max_context, self.max_context)
        self._load()  # each engine's model, from self.path in self.dtype on self.device

    @abstractmethod
    def logits(self, ids: torch.Tensor, logits_from: int = 0) -> torch.Tensor:
        """ids: int64 [T] -> fp32 logits [T - logits_from, vocab] of positions logits_from..; row i predicts token
        logits_from + i + 1."""

    @abstractmethod
    def greedy(self, ids: torch.Tensor, max_new_tokens: int, stop_ids: tuple[int, ...],
               min_new_tokens: int = 0) -> list[int]:
        """Greedy continuation of ids [T]: at most max_new_tokens ids, ending before a stop id;
        stop ids cannot be chosen for the first min_new_tokens steps."""

    def run_samples(self, requests: list[SampleRequest]) -> list[SampleResult]:
        """Each request's greedy continuation and answer likelihood, in order. Engines that decode several
        sequences at once override it; the default runs them one by one."""
        return [SampleResult(self._greedy_of(r), self._answer_of(r)) for r in requests]

    def _greedy_of(self, r: SampleRequest) -> list[int]:
        return self.greedy(torch.tensor(r.prompt, dtype=torch.long), r.max_new_tokens, r.stop_ids, r.min_new_tokens)

    def _answer_of(self, r: SampleRequest) -> dict | None:
        if not r.reference:
            return None
        # rows from the prompt's last position: row t predicts the reference's token t (the last row is not used)
        logits = self.logits(torch.tensor(r.prompt + r.reference, dtype=torch.long), len(r.prompt) - 1)
        return answer_nll(logits[:-1], r.reference)

    def close(self) -> None:
        """Release the model's memory."""


class TransformersRunner(ModelRunner):
    """Hugging Face transformers in fp32 (architectures transformers knows natively, e.g. Llama
    and DeepseekV3), on `device` (auto: the GPU when there is one). Cached K/V go through
    `self.kv_hook` (None = kept in fp32)."""

    engine = "transformers"

    def _load(self) -> None:
        from kvconvert.quant.capture import load_hf_model  # drops a calibration's KV quantization_config

        self.model = load_hf_model(self.path, dtype=self.dtype).to(self.device)
        self.kv_hook = _kv_hook(self.path, self.config, self.kv_dtype)

    def _cache(self):
        if self.kv_hook is None:
            from transformers import DynamicCache

            return DynamicCache()
        from kvconvert.quant.capture import KVHookCache

        return KVHookCache(self.kv_hook, config=self.model.config)

    @torch.inference_mode()
    def logits(self, ids: torch.Tensor, logits_from: int = 0) -> torch.Tensor:
        ids = ids.reshape(1, -1).to(self.device)
        keep = ids.shape[1] - logits_from  # logits_to_keep: only the last rows go through lm_head
        if self.kv_hook is None:
            out = self.model(input_ids=ids, use_cache=False, logits_to_keep=keep)
        else:  # the hook cache hands the attention quantized K/V, as an engine's cache would
            out = self.model(input_ids=ids, past_key_values=self._cache(), use_cache=True, logits_to_keep=keep)
        return out.logits[0].float().cpu()

    @torch.inference_mode()
    def greedy(self, ids: torch.Tensor, max_new_tokens: int, stop_ids: tuple[int, ...],
               min_new_tokens: int = 0) -> list[int]:
        if max_new_tokens <= 0:
            return []
        # logits_to_keep=1: only the last position's logits (skips a [T, vocab] lm_head product).
        out = self.model(input_ids=ids.reshape(1, -1).to(self.device), past_key_values=self._cache(),
                         use_cache=True, logits_to_keep=1)
        new: list[int] = []
        while True:
            token = argmax_allowed(out.logits[0, -1], stop_ids if len(new) < min_new_tokens else ())
            if token in stop_ids:
                break
            new.append(token)
            if len(new) == max_new_tokens:
                break
            step = torch.tensor([[token]], device=self.device)
            out = self.model(input_ids=step, past_key_values=out.past_key_values, use_cache=True)
        return new

    def close(self) -> None:
        del self.model


def _kv_hook(path: Path, config: dict, kv_dtype: str):
    """Cache hook (layer, key, value) -> (key, value) for a KV format, None for fp32.

    bf16/fp16: round every cached value to that type and back. fp8/fp8_e5m2/nvfp4:
    kvconvert.quant's bit-exact quantize-dequantize with the checkpoint's calibrated scales; llama.cpp's types
    (q8_0, q4_0, ...) as that engine stores them (kvconvert.quant.hooks.llamacpp_hook).
    """
    if kv_dtype == "fp32":
        return None
    if not kv_pair(kv_dtype).quantized:  # bf16, fp16
        low = getattr(torch, kv_pair(kv_dtype).k.torch_dtype)
        return lambda layer, key, value: (key.to(low).to(key.dtype), value.to(low).to(value.dtype))
    from kvconvert.quant.hooks import fake_quant_hook, llamacpp_hook
    from kvconvert.quant.layout import detect_kv_layout
    from kvconvert.quant.scales import read_kv_scales

    if kv_pair(kv_dtype).ggml_types:  # llama.cpp's types (a K/V pair too): block scales set as rows are written
        with CheckpointReader(path, verify=False) as reader:
            return llamacpp_hook(detect_kv_layout(config, reader.keys()), kv_dtype)
    scales = read_kv_scales(path)
    if scales.kv_dtype != kv_dtype:
        raise KVConvertError(f"{path}: KV scales were calibrated for {scales.kv_dtype}, not {kv_dtype}; "
                             f"pass --kv-dtype {scales.kv_dtype} or recalibrate")
    with CheckpointReader(path, verify=False) as reader:
        layout = detect_kv_layout(config, reader.keys())
    return fake_quant_hook(layout, scales)


RUNTIME_BLOCK = 16
# Greedy generation decodes up to GENERATION_SEQS sequences together (one decode step costs about as much for 1 as
# for 28 sequences of a small model on a CPU), in a KV pool of GENERATION_KV_BYTES, or of one max_len sequence when
# that is larger: the pool, not the suite, bounds the memory; requests that do not fit wait for blocks (FCFS).
# 512 MiB holds the quick suite's 22 short samples of SmolLM2-135M in one group in a bf16 cache (256 MiB split them
# in two, and each group decodes its longest answer's steps).
GENERATION_SEQS = 32
GENERATION_KV_BYTES = 512 << 20
# Prompts are prefilled in steps of up to PREFILL_TOKENS: a 4096-token prompt in one causal step, whose attention
# skips the masked half, where two 2048-token steps compute the second one's 2048 x 4096 scores in full.
PREFILL_TOKENS = 4096


def runtime_blocks(max_len: int) -> int:
    """KV blocks for one sequence of max_len tokens (+1 spare)."""
    return -(-max_len // RUNTIME_BLOCK) + 1


def generation_blocks(max_len: int, kv_bytes_per_token: int) -> int:
    """The runtime runner's pool: GENERATION_KV_BYTES of blocks, at least one sequence of max_len tokens."""
    return max(runtime_blocks(max_len), GENERATION_KV_BYTES // (kv_bytes_per_token * RUNTIME_BLOCK))


def memory_need(config: dict, engine: str, kv_dtype: str, dtype: torch.dtype, max_len: int):
    """MemoryEstimate of one runner: the model, its KV pool and one step (config.json only)."""
    from kvconvert.memory import dtype_name
    from kvconvert.runtime.kv_cache import bytes_per_token, decoded_bytes_per_token
    from kvconvert.runtime.memory import estimate_memory
    from kvconvert.runtime.models import kv_layout

    if engine == "runtime":  # its paged pool (with the decoded copy of a quantized one), prefilled in PREFILL_TOKENS steps
        per_token = bytes_per_token(kv_layout(config), kv_dtype)
        decoded = decoded_bytes_per_token(kv_layout(config), kv_dtype, dtype)
        kv = generation_blocks(max_len, per_token) * RUNTIME_BLOCK * (per_token + decoded)
        step = min(PREFILL_TOKENS, max_len)
    else:  # transformers: the whole sequence in one forward, its K/V cached in the model's dtype
        kv, step = max_len * bytes_per_token(kv_layout(config), dtype_name(dtype)), max_len
    return estimate_memory(config, dtype, kv_cache_bytes=kv, tokens_per_step=step, context=max_len)


class RuntimeRunner(ModelRunner):
    """kvconvert.runtime.LLM: the bundled paged-KV engine, with prefix caching and a quantized cache's decoded copy
    (EngineConfig.decoded_copy: each step copies the context instead of dequantizing it again). Perplexity windows
    are scored one
    at a time (logits); task samples run together (run_samples): their greedy continuations decode in one batch
    (up to GENERATION_SEQS sequences per step), and each answer likelihood is scored once its prompt's K/V is in the
    cache, so only the answer's own positions are computed again. A cached block holds the same K/V as a recomputed
    one up to the rounding of a product over another number of rows (fp32: last bits), so a sample's result does
    not depend on what runs with it beyond that (tests/eval/test_eval_batched.py)."""

    engine = "runtime"

    def _load(self) -> None:
        from kvconvert.runtime import LLM
        from kvconvert.runtime.kv_cache import bytes_per_token
        from kvconvert.runtime.models import kv_layout

        blocks = generation_blocks(self.max_len, bytes_per_token(kv_layout(self.config), self.kv_dtype))
        self.llm = LLM(str(self.path), kv_dtype=self.kv_dtype, kv_scales=self.kv_scales, block_size=RUNTIME_BLOCK,
                       num_blocks=blocks, max_model_len=self.max_len, attention_backend="torch",
                       enable_prefix_caching=True, max_num_seqs=GENERATION_SEQS, max_num_batched_tokens=PREFILL_TOKENS,
                       dtype=self.dtype,
                       device=self.device, decoded_copy=True)
        self.max_context = int(self.llm.max_model_len)
        self.cached_prompt_tokens = 0  # prompt tokens of generated samples the prefix cache held (Output's count)

    def logits(self, ids: torch.Tensor, logits_from: int = 0) -> torch.Tensor:
        return self.llm.score(ids.reshape(-1).tolist(), logits_from).float()

    def greedy(self, ids: torch.Tensor, max_new_tokens: int, stop_ids: tuple[int, ...],
               min_new_tokens: int = 0) -> list[int]:
        request = SampleRequest(tuple(ids.reshape(-1).tolist()), max_new_tokens, tuple(stop_ids), min_new_tokens)
        return self.run_samples([request])[0].tokens

    def run_samples(self, requests: list[SampleRequest]) -> list[SampleResult]:
        results: list[SampleResult | None] = [None] * len(requests)
        for chunk in self._chunks(requests):
            for i, result in zip(chunk, self._run_chunk([requests[i] for i in chunk])):
                results[i] = result
        return results

    def _chunks(self, requests: list[SampleRequest]):
        """Indices of requests that run together, longest first: their sequences fit the KV pool together (their
        prompts stay cached until their answers are scored), at most GENERATION_SEQS of them, the shortest at least
        half the longest (a decode step reads every sequence's blocks padded to the longest context: a 4K prompt
        among 500-token ones would make each of their steps read 4K). Longest first, because the longest prompts
        are the likeliest to share blocks with what the runner scored just before (the suite's long window)."""
        pool, chunk, used = self.llm.num_blocks * RUNTIME_BLOCK, [], 0
        length = [r.length for r in requests]
        for i in sorted(range(len(requests)), key=lambda i: -length[i]):  # stable: the suite's order among equals
            r = requests[i]
            need = len(r.prompt) + r.max_new_tokens + len(r.reference) + 2 * RUNTIME_BLOCK  # + copy-on-write blocks
            if chunk and (used + need > pool or len(chunk) == GENERATION_SEQS or 2 * length[i] < length[chunk[0]]):
                yield chunk
                chunk, used = [], 0
            chunk.append(i)
            used += need
        if chunk:
            yield chunk

    def _run_chunk(self, chunk: list[SampleRequest]) -> list[SampleResult]:
        from kvconvert.runtime import SamplingParams

        llm = self.llm
        # min_tokens masks the stop ids for the first steps, in the engine (one prefill, then decode steps)
        generating = {i: llm.add_request(list(r.prompt), SamplingParams(
            max_tokens=r.max_new_tokens, min_tokens=min(r.min_new_tokens, r.max_new_tokens), greedy=True,
            ignore_eos=True, stop_token_ids=tuple(r.stop_ids))) for i, r in enumerate(chunk) if r.max_new_tokens > 0}
        while not all(llm.prompt_computed(rid) for rid in generating.values()):
            llm.step()
        # row len(prompt) - 1 predicts the reference's first token: computed again, the prompt before it cached
        scoring = {i: llm.add_request(list(r.prompt + r.reference), SamplingParams(max_tokens=0),
                                      want_prompt_logits=True, logits_from=len(r.prompt) - 1)
                   for i, r in enumerate(chunk) if r.reference}
        results = [SampleResult([], None) for _ in chunk]
        pending = {**{("gen", i): rid for i, rid in generating.items()},
                   **{("score", i): rid for i, rid in scoring.items()}}
        while pending:
            llm.step()
            for (kind, i), rid in list(pending.items()):
                if kind == "gen" and (out := llm.take_output(rid)) is not None:
                    results[i].tokens = self._tokens(out, chunk[i])
                    self.cached_prompt_tokens += out.num_cached_tokens
                elif kind == "score" and (logits := llm.take_scores(rid)) is not None:
                    results[i].answer = answer_nll(logits[:-1].float(), chunk[i].reference)
                else:
                    continue
                del pending[(kind, i)]
        return results

    def _tokens(self, out, request: SampleRequest) -> list[int]:
        if out.error:
            raise KVConvertError(f"{self.path}: the runtime could not run a {len(request.prompt)}-token prompt: "
                                 f"{out.error}")
        tokens = list(out.token_ids)
        while tokens and tokens[-1] in request.stop_ids:  # the engine may return the stop token itself
            tokens.pop()
        return tokens

    def close(self) -> None:
        del self.llm


def runtime_available() -> str | None:
    """None when kvconvert.runtime.LLM imports, else the reason it does not."""
    try:
        from kvconvert.runtime import LLM  # noqa: F401
    except Exception as exc:  # any import-time failure of a module still being built
        return f"{type(exc).__name__}: {exc}"
    return None


def resolve_engine(engine: str | None) -> str:
    """'runtime' or 'transformers'. None/'auto' = runtime when it imports, else transformers
    (with a printed note)."""
    if engine not in (None, "auto", *RUNNERS):
        raise KVConvertError(f"--engine {engine!r} is unknown; choose runtime or transformers")
    reason = runtime_available() if engine != "transformers" else None
    if reason is None:
        return engine if engine in RUNNERS else "runtime"
    if engine == "runtime":
        raise KVConvertError(
            f"--engine runtime: kvconvert.runtime cannot be imported ({reason}); use --engine transformers")
    print(f"note: kvconvert.runtime is not importable ({reason}); using --engine transformers", file=sys.stderr)
    return "transformers"


RUNNERS = {"transformers": TransformersRunner, "runtime": RuntimeRunner}


class LazyRunner(RunnerInfo):
    """A runner that loads its model on first use, so a run whose results are all cached loads
    nothing. RunnerInfo's attributes are known up front. device: where the model runs
    (kvconvert.device; auto = cuda when visible)."""

    def __init__(self, path: Path, engine: str, kv_dtype: str = "auto", kv_scales: str = "checkpoint",
                 dtype: str | torch.dtype = "auto", device: str | torch.device = "auto"):
        if engine not in RUNNERS:
            raise KVConvertError(f"--engine {engine!r} is unknown; choose runtime or transformers")
        self.engine = engine
        super().__init__(path, kv_dtype, kv_scales, dtype, device)
        check_kv_scales(self.path, engine, self.kv_dtype, kv_scales)
        self.max_len: int | None = None  # set by the caller once it knows its longest sequence
        self._runner: ModelRunner | None = None

    @property
    def loaded(self) -> ModelRunner:
        if self._runner is None:
            self._runner = RUNNERS[self.engine](self.path, self.kv_dtype, self.kv_scales, self.dtype, self.max_len,
                                                self.device)
        return self._runner

    def memory_need(self, dtype: torch.dtype | None = None):
        max_len = min(self.max_len or self.max_context, self.max_context)
        return memory_need(self.config, self.engine, self.kv_dtype, dtype or self.dtype, max_len)

    def check_memory(self, role: str) -> None:
        """Refuse before loading when this model (with one sequence of max_len tokens) cannot fit."""
        from kvconvert.memory import check_memory

        hints = [("--dtype bf16", self.memory_need(torch.bfloat16))] if self.dtype == torch.float32 else []
        check_memory(self.memory_need(), f"validate's {role} ({self.path.name}, {self.engine} engine, "
                                         f"{str(self.dtype).removeprefix('torch.')})", hints, self.device)

    def logits(self, ids: torch.Tensor, logits_from: int = 0) -> torch.Tensor:
        return self.loaded.logits(ids, logits_from)

    def greedy(self, ids: torch.Tensor, max_new_tokens: int, stop_ids: tuple[int, ...],
               min_new_tokens: int = 0) -> list[int]:
        return self.loaded.greedy(ids, max_new_tokens, stop_ids, min_new_tokens)

    def run_samples(self, requests: list[SampleRequest]) -> list[SampleResult]:
        return self.loaded.run_samples(requests)

    def close(self) -> None:
        if self._runner is not None:
            self._runner.close()
            self._runner = None
            gc.collect()  # free the weights (and unmap mapped ones) before another model loads
