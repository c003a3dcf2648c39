"""The KV-cache formats kvconvert knows, defined once. Pure Python: no torch import.

Every other module (the planner's byte counts, the runtime's stores and CLI choices, calibrate's
exported scales and names, the kernels' cache modes, validate's choices) reads these entries;
docs/formats.md ("The format registry") has the table :func:`markdown_table` writes.

Conventions (docs/formats.md, "KV-cache number formats and scales"):

* A quantized format is stored with scales; the checkpoint's exported ``k_scale`` / ``v_scale`` is
  ``amax / amax_divisor``: 448 (the E4M3 max) for FP8 E4M3 and for NVFP4, 57344 for FP8 E5M2, 127 for
  INT8 (TensorRT-LLM's: ``q = rne_sat(x * (1 / scale))``, docs/engines.md "INT8 KV cache").
  Those scales are per tensor (or per KV head), fp32, a few bytes per layer: not counted in bytes.
* ``shared_kv_scale``: the engine stores K and V of a layer with one scale, ``max(k_scale, v_scale)``
  (TensorRT-LLM's INT8 cache: one kv_cache_scaling_factor per layer); calibrate writes them equal.
* NVFP4: E2M1 codes, one E4M3 scale per block of 16 values along head_dim (the latent for MLA),
  plus an fp32 global scale = kv_scale / 6.
* Under a 4-bit format MLA stores k_rope (the last qk_rope_head_dim values of its cached row) in the
  format named by ``mla_rope``: 16 bits for ``nvfp4`` (FlashMLA's layout: it carries the position
  signal), FP8 E4M3 with the row's own kv scale for ``nvfp4_fp8rope`` (as vLLM's FP8 MLA cache scales
  its k_rope), which buys twice the RoPE dims for the same bytes (docs/BENCHMARKS.md, "Under 25%").
* `engines` are kvconvert.targets names (which MLA shapes each engine serves is there).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvconvert.errors import KVConvertError

FP8_E4M3_MAX = 448.0
FP8_E5M2_MAX = 57344.0
INT8_MAX = 127.0  # symmetric INT8: amax maps to 127 (the engine saturates at -128 / 127)
E2M1_MAX = 6.0
NVFP4_BLOCK = 16
GGML_BLOCK = 32  # values in one block of llama.cpp's quantized types (q8_0, q5_0, q4_0, iq4_nl, ...)


@dataclass(frozen=True)
class KVFormat:
    """One KV-cache number format (module docstring for the conventions)."""

    name: str
    title: str
    bits: int  # per stored value
    quantized: bool  # stored with scales (a calibrated or dynamic kv scale per tensor / head)
    torch_dtype: str | None = None  # torch dtype the values are stored in; None: packed codes
    block: int | None = None  # values sharing one block scale, along head_dim; None: no block scales
    block_scale: str | None = None  # number format of a block scale
    block_scale_bytes: int = 0  # bytes of one block scale
    amax_divisor: float | None = None  # exported kv scale = amax / amax_divisor
    mla_rope: str | None = None  # MLA: the format k_rope is stored in when not the latent's ("bf16", "fp8")
    mla_only: bool = False  # an MLA cache layout (its k_rope is stored apart): refused for per-head K/V
    kernel_mode: str | None = None  # kvconvert.kernels cache mode; None: the Triton kernels cannot read it
    exports: tuple[str, ...] = ()  # checkpoint scale names it is written under (SCALE_SUFFIXES keys)
    compressed_tensors: bool = False  # config.json gets a compressed-tensors kv_cache_scheme (vLLM)
    modelopt_algo: str | None = None  # hf_quant_config.json kv_cache_quant_algo (ModelOpt / TensorRT-LLM)
    engines: tuple[str, ...] = ()  # kvconvert.targets names that serve it; () = planning only
    mla_engines: tuple[str, ...] | None = None  # those that serve it for an MLA latent (None: as `engines`)
    vllm_cache_dtype: str | None = None  # vLLM's kv_cache_dtype for it ("auto": the model's dtype)
    ggml_type: str | None = None  # llama.cpp's cache type (kvconvert.ggml_formats); no calibrated scale
    shared_kv_scale: bool = False  # K and V stored with one scale per layer, max(k_scale, v_scale)
    aliases: tuple[str, ...] = ()

    @property
    def has_kv_scale(self) -> bool:
        """Stored with a calibrated (or dynamic) kv scale per tensor / head; llama.cpp's types set theirs per block."""
        return self.quantized and self.amax_divisor is not None

    @property
    def integer(self) -> bool:
        """Stored as integer codes of x * (1 / kv scale) (int8), not as a float format."""
        return self.torch_dtype is not None and self.torch_dtype.startswith("int")

    @property
    def bytes_per_value(self) -> float:
        """Average bytes per value for vectors whose length is a multiple of the block."""
        return self.bits / 8 + (self.block_scale_bytes / self.block if self.block else 0.0)

    def vector_bytes(self, num_values: int, rope_tail: int = 0) -> int:
        """Bytes to store one cached vector of `num_values` values: the codes, then one scale per
        block (a partial last block still needs its own). `rope_tail`: the vector is an MLA row whose
        last `rope_tail` values are k_rope, stored in the `mla_rope` format by a format that has one."""
        tail = rope_tail if self.mla_rope else 0
        n = num_values - tail
        blocks = math.ceil(n / self.block) if self.block else 0
        rope_bytes = kv_format(self.mla_rope).vector_bytes(tail) if tail else 0
        return math.ceil(n * self.bits / 8) + blocks * self.block_scale_bytes + rope_bytes

    def rope_tail(self, is_mla: bool, rope_dim: int) -> int:
        """Values at the end of a cached row stored apart in the `mla_rope` format (0: the whole row alike)."""
        return rope_dim if is_mla and self.mla_rope else 0

    def check_cache_kind(self, is_mla: bool) -> None:
        """Refuse an MLA-only layout for a model that caches per-head K/V."""
        if self.mla_only and not is_mla:
            raise KVConvertError(
                f"KV dtype {self.name} ({self.title}) stores MLA's k_rope apart from its latent; this model caches "
                f"per-head K and V (no k_rope): use --kv-dtype nvfp4, or convert it to MLA first (kvconvert mla)")

    @property
    def scale_rule(self) -> str:
        """How the exported kv scale is made (calibration_report.json's scale_convention)."""
        if self.amax_divisor is None:
            return "-"
        nvfp4 = f"; NVFP4 global scale = scale / {E2M1_MAX:g}" if self.block_scale == "e4m3" else ""
        shared = "; K and V stored with max(k_scale, v_scale)" if self.shared_kv_scale else ""
        return f"amax / {self.amax_divisor:g}{nvfp4}{shared}"

    def served_by(self, mla: bool = False) -> tuple[str, ...]:
        """Engines that serve this cache format, for an MLA latent or for per-head K/V."""
        return self.mla_engines if mla and self.mla_engines is not None else self.engines

    def engine_scales(self, k_scale, v_scale):
        """(K, V) scales the engine stores with, from a checkpoint's k_scale / v_scale (floats or tensors): both
        max(k_scale, v_scale) where it keeps one scale per layer (shared_kv_scale; tensors elementwise)."""
        if not self.shared_kv_scale:
            return k_scale, v_scale
        shared = k_scale.maximum(v_scale) if hasattr(k_scale, "maximum") else max(k_scale, v_scale)
        return shared, shared

    def scale_from_amax(self, amax):
        """Exported kv scale for an amax (float or tensor): amax / amax_divisor."""
        return amax / self.amax_divisor


_RUNTIME = "kvconvert"  # the bundled paged runtime (kvconvert.targets)
_E4M3_SCALED = dict(quantized=True, amax_divisor=FP8_E4M3_MAX)

KV_FORMATS: dict[str, KVFormat] = {f.name: f for f in (
    KVFormat("bf16", "bfloat16", 16, False, "bfloat16", kernel_mode="none",
             engines=("vllm", "tensorrt-llm", "llamacpp", _RUNTIME), vllm_cache_dtype="bfloat16"),
    KVFormat("fp16", "IEEE float16", 16, False, "float16", kernel_mode="none",
             engines=("vllm", "tensorrt-llm", "llamacpp", _RUNTIME), vllm_cache_dtype="float16"),
    # vLLM has no fp32 cache dtype: "auto" caches in the model's dtype, fp32 for `validate --engine vllm`
    KVFormat("fp32", "IEEE float32", 32, False, "float32", kernel_mode="none", engines=("vllm", "llamacpp", _RUNTIME),
             vllm_cache_dtype="auto"),
    KVFormat("fp8", "FP8 E4M3", 8, torch_dtype="float8_e4m3fn", kernel_mode="fp8", exports=("vllm", "modelopt"),
             compressed_tensors=True, modelopt_algo="FP8", engines=("vllm", "tensorrt-llm", _RUNTIME),
             vllm_cache_dtype="fp8", aliases=("fp8_e4m3",), **_E4M3_SCALED),
    # no checkpoint format in either engine (vLLM refuses it with a kv-cache scheme, ModelOpt has no
    # E5M2 KV): its scales go under the vLLM names for kvconvert's runtime, with no config
    KVFormat("fp8_e5m2", "FP8 E5M2", 8, True, "float8_e5m2", amax_divisor=FP8_E5M2_MAX, exports=("vllm",),
             engines=("vllm", _RUNTIME), vllm_cache_dtype="fp8_e5m2"),
    # vLLM: GQA NVFP4 KV on SM100 only, refused for MLA; compressed-tensors has no static NVFP4 scheme
    KVFormat("nvfp4", "NVFP4", 4, block=NVFP4_BLOCK, block_scale="e4m3", block_scale_bytes=1,
             mla_rope="bf16", kernel_mode="nvfp4", exports=("modelopt",), modelopt_algo="NVFP4",
             engines=("tensorrt-llm", _RUNTIME), mla_engines=(_RUNTIME,),  # TRT-LLM MLA + NVFP4: not verified
             **_E4M3_SCALED),
    # MLA only: the latent as nvfp4, k_rope FP8 E4M3 scaled by the same kv scale (amax of the whole row /
    # 448): the runtime and kernels store it; no engine's checkpoint format names it (no hf_quant_config)
    KVFormat("nvfp4_fp8rope", "NVFP4 latent + FP8 k_rope", 4, block=NVFP4_BLOCK, block_scale="e4m3",
             block_scale_bytes=1, mla_rope="fp8", mla_only=True, kernel_mode="nvfp4", exports=("modelopt",),
             mla_engines=(_RUNTIME,), **_E4M3_SCALED),
    # llama.cpp's cache types (kvconvert.ggml_formats): blocks of 32 values along the row with an fp16 scale
    # (and an fp16 minimum for the _1 types) set as each row is written, so there is no kv scale to calibrate;
    # an MLA row [latent | k_rope] is quantized whole. llama.cpp serves them for per-head K/V and for MLA.
    *(KVFormat(name, f"llama.cpp {name}", bits, True, block=32, block_scale="fp16" if scale_bytes == 2 else
               "fp16 scale + min", block_scale_bytes=scale_bytes, ggml_type=name, engines=("llamacpp", _RUNTIME))
      for name, bits, scale_bytes in (("q8_0", 8, 2), ("q5_1", 5, 4), ("q5_0", 5, 2), ("q4_1", 4, 4),
                                      ("q4_0", 4, 2), ("iq4_nl", 4, 2))),
    # TensorRT-LLM's INT8 cache (GPUs without FP8): int8 codes of x * (1 / scale), scale = amax / 127 per tensor,
    # one scale for K and V (max); hf_quant_config.json kv_cache_quant_algo INT8. No Triton kernel reads it (the
    # runtime's torch backend does); TensorRT-LLM's MLA + INT8: not verified. vLLM has no static INT8 cache
    # (its int8_per_token_head is dynamic: docs/engines.md)
    KVFormat("int8", "INT8", 8, True, "int8", amax_divisor=INT8_MAX, exports=("modelopt",), modelopt_algo="INT8",
             engines=("tensorrt-llm", _RUNTIME), mla_engines=(_RUNTIME,), shared_kv_scale=True),
    # planning only (`kvconvert budget`): our int4 convention, symmetric 4-bit integers with one fp16 scale per
    # 32 values (0.5625 bytes/value, as NVFP4)
    KVFormat("int4", "int4", 4, True, block=32, block_scale="fp16", block_scale_bytes=2, mla_rope="bf16"),
)}
ALIASES = {alias: f.name for f in KV_FORMATS.values() for alias in f.aliases}
AUTO = "auto"  # a CLI's "the engine's own unquantized cache"
KERNEL_MODES = tuple(dict.fromkeys(f.kernel_mode for f in KV_FORMATS.values() if f.kernel_mode))


def kv_format(name: str) -> KVFormat:
    """The format named `name` (or one of its aliases), case-insensitive."""
    key = name.lower()
    try:
        return KV_FORMATS[ALIASES.get(key, key)]
    except KeyError:
        raise KVConvertError(f"unknown KV dtype {name!r}; choose one of {', '.join(KV_FORMATS)}") from None


def kv_dtype_names(engine: str | None = None, quantized: bool | None = None, aliases: bool = False,
                   auto: bool = False) -> tuple[str, ...]:
    """Format names in registry order: those `engine` serves, for per-head K/V or for MLA (None: all), only
    the quantized or the unquantized ones, each followed by its aliases, "auto" first."""
    names = [AUTO] if auto else []
    for f in KV_FORMATS.values():
        served = (*f.engines, *f.served_by(mla=True))
        if (engine is None or engine in served) and (quantized is None or f.quantized == quantized):
            names += [f.name, *(f.aliases if aliases else ())]
    return tuple(names)


# ----------------------------------------------------------------------------------------------
# K and V apart: a cache whose K and V halves are stored in two formats, written KTYPE/VTYPE
# ----------------------------------------------------------------------------------------------

PAIR_SEP = "/"
PAIR_ENGINES = ("llamacpp", _RUNTIME)  # engines that take a K type and a V type apart (-ctk / -ctv)


@dataclass(frozen=True)
class KVPair:
    """The K format and the V format of one KV cache. Written ``KTYPE/VTYPE`` (``q5_0/iq4_nl``); one name
    means both halves. Bytes per token are the sum of both halves' bytes.

    A mixed pair is llama.cpp's: its K and V caches take any two of its block types (-ctk / -ctv), and
    kvconvert's runtime emulates each half bit-exactly. Engines with one cache dtype for both (vLLM,
    TensorRT-LLM) refuse it. An MLA model caches one row [latent | k_rope] in llama.cpp's K cache and reads
    its V as a view of that row, so it has no V half of its own: a mixed pair is refused for MLA."""

    k: KVFormat
    v: KVFormat

    @property
    def mixed(self) -> bool:
        return self.k != self.v

    @property
    def name(self) -> str:
        """The canonical spelling: one name when both halves agree, else ``k/v``."""
        return f"{self.k.name}{PAIR_SEP}{self.v.name}" if self.mixed else self.k.name

    @property
    def title(self) -> str:
        return f"K {self.k.title}, V {self.v.title}" if self.mixed else self.k.title

    def side(self, quantity: str) -> KVFormat:
        """The format of a cached quantity: "k", "v", or "kv" (an MLA row, in the K cache)."""
        return self.v if quantity == "v" else self.k

    @property
    def quantized(self) -> bool:
        return self.k.quantized or self.v.quantized

    @property
    def bits(self) -> float:
        """Mean bits per stored value over a K and a V of equal size."""
        return (self.k.bits + self.v.bits) / 2

    @property
    def bytes_per_value(self) -> float:
        """Mean bytes per value over a K and a V of equal size (whole blocks)."""
        return (self.k.bytes_per_value + self.v.bytes_per_value) / 2

    @property
    def has_kv_scale(self) -> bool:
        """Either half stored with a calibrated (or dynamic) kv scale (a mixed pair never: llama.cpp's blocks)."""
        return self.k.has_kv_scale or self.v.has_kv_scale

    @property
    def ggml_types(self) -> tuple[str, str] | None:
        """llama.cpp's (-ctk, -ctv) types, or None when either half is not a llama.cpp block type."""
        return (self.k.ggml_type, self.v.ggml_type) if self.k.ggml_type and self.v.ggml_type else None

    def token_bytes(self, k_values: int, v_values: int, rope_tail: int = 0) -> int:
        """Bytes of one cached K vector of `k_values` plus one V vector of `v_values` (kvformat's vector_bytes)."""
        return self.k.vector_bytes(k_values, rope_tail) + self.v.vector_bytes(v_values)

    def check_cache_kind(self, is_mla: bool) -> None:
        """Refuse what the model's cache cannot hold: an MLA-only layout for per-head K/V, a mixed pair for MLA."""
        if self.mixed and is_mla:
            raise KVConvertError(
                f"KV dtype {self.name}: an MLA model caches one row [latent | k_rope] per token, in llama.cpp's K "
                f"cache, and reads V as a view of that row, so it has no V half to store apart; give one format "
                f"for the row (--kv-dtype {self.k.name} or {self.v.name})")
        self.k.check_cache_kind(is_mla)

    def served_by(self, mla: bool = False) -> tuple[str, ...]:
        """Engines that serve this cache: both halves' engines; a mixed pair only where K and V are apart."""
        if not self.mixed:
            return self.k.served_by(mla)
        if mla:
            return ()
        v_engines = self.v.served_by(mla)
        return tuple(e for e in self.k.served_by(mla) if e in v_engines and e in PAIR_ENGINES)

    def check_engine(self, engine: str) -> None:
        """Refuse a mixed pair on an engine that takes one cache dtype for K and V (vLLM, TensorRT-LLM)."""
        if self.mixed and engine not in PAIR_ENGINES:
            raise KVConvertError(
                f"KV dtype {self.name}: {engine} stores K and V in one cache dtype and cannot take a K/V pair; give "
                f"one format (--kv-dtype {self.k.name}), or serve the pair with llama.cpp (--engine llamacpp: "
                f"-ctk {self.k.name} -ctv {self.v.name})")


def kv_pair(name: str) -> KVPair:
    """The pair written `name`: ``KTYPE/VTYPE``, or one format name for both (aliases and any case accepted).
    A mixed pair's halves must both be llama.cpp block types (KVPair)."""
    parts = [p.strip() for p in str(name).split(PAIR_SEP)]
    if len(parts) > 2 or not all(parts):
        raise KVConvertError(f"KV dtype {name!r}: write one format (q4_0) or a K/V pair KTYPE/VTYPE (q5_0/iq4_nl)")
    pair = KVPair(kv_format(parts[0]), kv_format(parts[-1]))
    if pair.mixed and not pair.ggml_types:
        raise KVConvertError(
            f"KV dtype {name!r}: K and V in two formats is llama.cpp's cache (-ctk / -ctv), whose halves are its block "
            f"types: {', '.join(ggml_type_names())}; for other formats give one name for both")
    return pair


def kv_dtype_slug(name: str) -> str:
    """A KV dtype as part of a file or folder name: a pair's K+V (q5_0+iq4_nl), a format as it is."""
    return name.replace(PAIR_SEP, "+")


def ggml_type_names() -> tuple[str, ...]:
    """The llama.cpp block types in the registry (q8_0, q5_1, ...)."""
    return tuple(f.name for f in KV_FORMATS.values() if f.ggml_type)


def is_pair(name: str) -> bool:
    """`name` spells a mixed K/V pair (``q5_0/iq4_nl``), not one format."""
    return name != AUTO and kv_pair(name).mixed


def check_kv_dtype(name: str, choices: tuple[str, ...]) -> str:
    """`name` (a format, an alias, "auto" or a K/V pair) when each half is one of `choices`; a pair in its canonical
    spelling (``Q5_0/IQ4_NL`` -> ``q5_0/iq4_nl``, ``q4_0/q4_0`` -> ``q4_0``). ValueError (pydantic's) otherwise."""
    value = str(name).strip().lower()
    if value in choices:
        return value
    try:
        pair = kv_pair(value)
    except KVConvertError as exc:
        raise ValueError(str(exc)) from None
    if pair.name in choices:
        return pair.name
    if not pair.mixed:
        raise ValueError(f"{name!r} is not one of {', '.join(choices)} (or a K/V pair KTYPE/VTYPE of llama.cpp's types)")
    outside = [h for h in (pair.k.name, pair.v.name) if h not in choices]
    if outside:
        raise ValueError(f"KV dtype {name!r}: {', '.join(outside)} is not one of {', '.join(choices)}")
    return pair.name


def kv_dtype_type(choices: tuple[str, ...]):
    """The annotation of an option that takes a KV dtype from `choices` or a K/V pair of them (``q5_0/iq4_nl``):
    a str, checked and canonicalized by check_kv_dtype (pydantic imported here only)."""
    from typing import Annotated

    from pydantic import AfterValidator

    return Annotated[str, AfterValidator(lambda v: check_kv_dtype(v, choices))]


def pair_help(choices: tuple[str, ...]) -> str:
    """The choices of a KV dtype option, for its help text."""
    return (f"One of {', '.join(choices)}; or K and V apart as KTYPE/VTYPE of llama.cpp's block types "
            f"(q5_0/iq4_nl: -ctk q5_0 -ctv iq4_nl).")


RUNTIME_KV_DTYPES = kv_dtype_names(_RUNTIME, aliases=True)  # kvconvert.runtime's kv_dtype choices
CALIBRATE_KV_DTYPES = kv_dtype_names(_RUNTIME, quantized=True)  # `kvconvert calibrate --kv-dtype`
VALIDATE_KV_DTYPES = kv_dtype_names(_RUNTIME, aliases=True, auto=True)  # `kvconvert validate`, recipes
INSPECT_KV_DTYPES = ("bf16", "fp8", "nvfp4")  # `kvconvert inspect` lists one format per width: 16, 8, 4 bits
# and llama.cpp's cache types it serves the model with (-ctk / -ctv): 8 bits, 5-bit keys with 4-bit values, 4 bits
INSPECT_LLAMACPP_KV_DTYPES = ("q8_0", "q5_0/iq4_nl", "iq4_nl")

# ----------------------------------------------------------------------------------------------
# checkpoint names of the KV scales: "model.layers.{i}.self_attn." + suffix, per export format and
# cached quantity ("k", "v", or "kv" = MLA's one [latent | k_rope] row, whose scale vLLM reads as
# k_scale; SGLang remaps the ModelOpt-style kv_a_proj_with_mqa.k_scale)
# ----------------------------------------------------------------------------------------------

SCALE_SUFFIXES = {
    "vllm": {"k": "k_scale", "v": "v_scale", "kv": "k_scale"},  # compressed-tensors / vLLM
    "modelopt": {"k": "k_proj.k_scale", "v": "v_proj.v_scale", "kv": "kv_a_proj_with_mqa.k_scale"},  # + TRT-LLM
}
SHARED_SCALE_SUFFIX = "kv_scale"  # read only: vLLM maps one shared kv_scale to both K and V


def scale_name(export: str, kind: str, layer: int) -> str:
    return f"model.layers.{layer}.self_attn.{SCALE_SUFFIXES[export][kind]}"


def scale_names(kind: str, layer: int) -> list[str]:
    """The names kvconvert writes for a scale, in the order readers prefer them (vLLM's first)."""
    return [scale_name(export, kind, layer) for export in SCALE_SUFFIXES]


# ----------------------------------------------------------------------------------------------
# weight dtypes: the names `--dtype` flags and recipes use, their config.json/torch names and bytes
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class WeightDType:
    name: str  # flag / recipe name
    torch_name: str  # torch attribute and config.json torch_dtype
    bytes: int


WEIGHT_DTYPES = {d.name: d for d in (WeightDType("bf16", "bfloat16", 2), WeightDType("fp16", "float16", 2),
                                     WeightDType("fp32", "float32", 4))}
WEIGHT_DTYPE_NAMES = tuple(WEIGHT_DTYPES)  # choices of a --dtype that names a dtype
AUTO_WEIGHT_DTYPE_NAMES = ("auto", *WEIGHT_DTYPE_NAMES)  # ... or keeps the checkpoint's own ("auto")
_BY_TORCH_NAME = {d.torch_name: d for d in WEIGHT_DTYPES.values()}


def weight_dtype(name: str) -> WeightDType:
    if name not in WEIGHT_DTYPES:
        raise KVConvertError(f"--dtype {name!r} is unknown; choose one of {', '.join(WEIGHT_DTYPE_NAMES)}")
    return WEIGHT_DTYPES[name]


def torch_dtype(name: str):
    """The torch dtype of a flag name (torch imported here: this module is torch-free)."""
    import torch

    return getattr(torch, weight_dtype(name).torch_name)


def stored_bytes(torch_name: str | None, default: int = 4) -> int:
    """Bytes per weight of a config.json torch_dtype ("bfloat16", ...); `default` when absent or unknown."""
    found = _BY_TORCH_NAME.get(str(torch_name).removeprefix("torch."))
    return found.bytes if found else default


# ----------------------------------------------------------------------------------------------
# docs/formats.md's table
# ----------------------------------------------------------------------------------------------


def markdown_table() -> str:
    """The registry as the markdown table of docs/formats.md."""
    rows = ["| name | bits | block scales | exported scale | MLA k_rope | kernel mode | scale names | "
            "hf_quant_config | vLLM kv_cache_dtype | engines |", "|" + " --- |" * 10]
    for f in KV_FORMATS.values():
        name = " / ".join(f"`{n}`" for n in (f.name, *f.aliases))
        blocks = f"{f.block_scale} per {f.block}" if f.block else "-"
        rope = {None: "as the latent", "bf16": "16-bit"}.get(f.mla_rope) or kv_format(f.mla_rope).title
        mla_only = f"{', '.join(f.mla_engines or ())} (MLA only)" if f.mla_engines else "planning only"
        engines = ", ".join(f.engines) or mla_only
        cells = (name, f.bits, blocks, f.scale_rule, rope, f.kernel_mode, ", ".join(f.exports), f.modelopt_algo,
                 f.vllm_cache_dtype, engines)
        rows.append("| " + " | ".join(str(c or "-") for c in cells) + " |")
    return "\n".join(rows)
