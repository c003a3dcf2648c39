"""The serving engines a converted checkpoint is for, and the MLA shapes each of them takes.

`kvconvert mla --target` (default vllm) writes only latents the target serves, so a stock engine
never refuses the checkpoint at its first request. The engine facts (docs/engines.md has the
sources and the tests that check them here):

* vLLM: its common MLA code (MLACommonMetadata) accepts kv_lora_rank + qk_rope_head_dim of 576 or
  320 only ("Head dimension 192 is not supported by MLA"); its fastest decode kernels (FlashMLA,
  TRTLLM-gen, CPU_MLA) take 576 = 512 + 64 only, the Triton MLA backend serves 320.
* TensorRT-LLM: DeepSeek's MLA kernels are built for kv_lora_rank 512 and qk_rope_head_dim 64.
* llama.cpp: its DEEPSEEK2 model (src/models/deepseek2.cpp, as vendored in llama-cpp-python 0.3.36) loads
  any kv_lora_rank and qk_rope_head_dim (it asserts qk_nope_head_dim >= 1) and caches the row
  [latent | k_rope] once, in its K cache. Its quantized caches (q8_0, q4_0, ... : blocks of 32 values)
  need whole blocks in the cached K row (kv_lora_rank + rope) and in the latent V views (kv_lora_rank)
  under flash attention, which a quantized V requires (src/llama-context.cpp): so kv_lora_rank and
  qk_rope_head_dim in multiples of 32. The --target keeps to those, so every llama.cpp cache type serves
  what it writes (kvconvert.engines.llamacpp checks the same at run time).
* kvconvert: the bundled paged runtime serves every shape (research shapes, per-layer studies).

This module is torch-free (the CLI's `budget`/`plan` import it without loading a model).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvconvert.errors import KVConvertError
from kvconvert.kvformat import GGML_BLOCK as LLAMACPP_BLOCK  # the values in one block of llama.cpp's types



def llamacpp_shape_problem(head_k: int, head_v: int, k_quantized: bool = True, v_quantized: bool = True) -> str | None:
    """llama.cpp's servable-shape rule for its caches, the one every command asks (calibrate, the runtime, validate,
    plan, export-gguf, the engine's own check): a quantized cache type stores blocks of 32 values, which must divide
    the head size it stores (src/llama-context.cpp, under flash attention, which a quantized V requires). The head
    sizes: per-head K/V, head_dim for K and for V; MLA (DEEPSEEK2), the K row kv_lora_rank + rope and the V view
    kv_lora_rank, i.e. both kv_lora_rank and rope in multiples of 32. None when served, else why not."""
    for kind, size, quantized in (("K", head_k, k_quantized), ("V", head_v, v_quantized)):
        if quantized and size % LLAMACPP_BLOCK:
            return (f"llama.cpp's quantized cache types store blocks of {LLAMACPP_BLOCK} values, which do not divide "
                    f"the {size} values of a cached {kind} head")
    return None


def llamacpp_config_problem(config: dict) -> str | None:
    """Why llama.cpp cannot serve a model (its config.json) with a quantized cache, or None (llamacpp_shape_problem)."""
    from kvconvert.kvmath import kv_shape

    shape = kv_shape(config)
    if shape.is_mla:
        return llamacpp_shape_problem(shape.kv_lora_rank + shape.qk_rope_head_dim, shape.kv_lora_rank)
    return llamacpp_shape_problem(shape.head_dim, shape.head_dim)


def check_llamacpp_shape(kv_dtype: str, mla: bool, head_dim: int = 0, rank: int = 0, rope_dim: int = 0) -> None:
    """Refuse, before any work, a cache in llama.cpp's block types (`kv_dtype`, a format or a K/V pair) for a model
    llama.cpp cannot serve it for (llamacpp_shape_problem): per-head K/V of `head_dim`, or an MLA row rank + rope_dim.
    Other formats pass."""
    from kvconvert.kvformat import kv_pair

    pair = kv_pair(kv_dtype)
    k_q, v_q = (bool(pair.side(s).ggml_type) for s in ("k", "v"))
    if not (k_q or v_q):
        return
    heads = (rank + rope_dim, rank) if mla else (head_dim, head_dim)
    problem = llamacpp_shape_problem(*heads, k_q, k_q if mla else v_q)  # MLA: V is a view of the K row
    if problem:
        shape = f"MLA {rank}+{rope_dim}" if mla else f"head_dim {head_dim}"
        fix = ("convert to a latent whose kv_lora_rank and rope are multiples of 32 (kvconvert mla --target llamacpp)"
               if mla else "use a float cache (bf16, fp16) or a format of another engine (fp8, nvfp4)")
        raise KVConvertError(f"KV dtype {kv_dtype} on this model ({shape}): {problem}, so llama.cpp refuses the "
                             f"cache and nothing here would measure what it serves; {fix}")


@dataclass(frozen=True)
class Target:
    name: str
    # kv_lora_rank + qk_rope_head_dim values the engine serves; None = every shape
    latent_sizes: tuple[int, ...] | None
    # qk_rope_head_dim the engine's kernels assume; None = any valid rope dim
    rope_dims: tuple[int, ...] | None
    note: str
    # a quantized cache's block of values, which must tile the MLA row and its latent (llamacpp_shape_problem:
    # kv_lora_rank and qk_rope_head_dim in multiples of it); None = any
    multiple_of: int | None = None

    def serves(self, rank: int, rope_dim: int) -> bool:
        return ((self.latent_sizes is None or rank + rope_dim in self.latent_sizes)
                and (self.rope_dims is None or rope_dim in self.rope_dims)
                and (self.multiple_of is None or llamacpp_shape_problem(rank + rope_dim, rank) is None))


TARGETS: dict[str, Target] = {
    "vllm": Target("vllm", (576, 320), None,
                   "vLLM's MLA takes kv_lora_rank + qk_rope_head_dim = 576 or 320 (its FlashMLA / "
                   "TRTLLM-gen / CPU decode kernels: 576 = 512 + 64 only)"),
    "tensorrt-llm": Target("tensorrt-llm", (576,), (64,),
                           "TensorRT-LLM's DeepSeek MLA kernels take kv_lora_rank 512 + qk_rope_head_dim 64"),
    "llamacpp": Target("llamacpp", None, None,
                       "llama.cpp's DEEPSEEK2 serves any latent with a float cache; its quantized caches (q8_0, q4_0, "
                       "...) store blocks of 32 values, so kv_lora_rank and qk_rope_head_dim must be multiples of 32",
                       multiple_of=LLAMACPP_BLOCK),
    "kvconvert": Target("kvconvert", None, None, "the bundled paged runtime serves every shape"),
    "any": Target("any", None, None, "every shape (research; not every engine serves it)"),
}
DEFAULT_TARGET = "vllm"
SERVING_ENGINES = tuple(name for name in TARGETS if name != "any")  # the targets that are engines


def get_target(name: str) -> Target:
    try:
        return TARGETS[name]
    except KeyError:
        raise KVConvertError(f"--target {name!r}: choose one of {', '.join(TARGETS)}") from None


def engines_serving(kv_dtype: str, rank: int | None = None, rope_dim: int | None = None) -> tuple[str, ...]:
    """The engines that serve a KV cache in `kv_dtype` (kvconvert.kvformat's engines / served_by) for the source's
    own attention (rank None) or an MLA latent of rank + rope_dim (the shapes each engine takes, above)."""
    from kvconvert.kvformat import kv_pair

    takes_shape = [e for e in SERVING_ENGINES if rank is None or TARGETS[e].serves(rank, rope_dim)]
    return tuple(e for e in takes_shape if e in kv_pair(kv_dtype).served_by(mla=rank is not None))


def rope_dims_for(head_dim: int) -> list[int]:
    """qk_rope_head_dim values that fold head_dim's frequencies into whole groups (even, <= 64)."""
    half = head_dim // 2
    return [2 * s for s in range(1, half + 1) if half % s == 0 and 2 * s <= min(64, head_dim)]


def servable_shapes(target: Target, kv_heads: int, head_dim: int) -> list[tuple[int, int]]:
    """(rank, rope_dim) pairs (rope_dim >= 8) this target serves for a source with kv_heads x head_dim, largest
    latent first and, within a latent size, the larger RoPE part first (DeepSeek's 64 when it fits).
    rank is capped at 2 x kv_heads x head_dim - rope_dim (beyond it the latent holds nothing new)."""
    if target.latent_sizes is None:
        raise ValueError("servable_shapes needs a target with a fixed list of latent sizes")
    out = []
    for size in sorted(target.latent_sizes, reverse=True):
        for rope in sorted((r for r in rope_dims_for(head_dim) if r >= 8), reverse=True):
            rank = size - rope
            if 1 <= rank <= 2 * kv_heads * head_dim - rope and target.serves(rank, rope):
                out.append((rank, rope))
    return out


def check_servable(target_name: str, rank: int, rope_dim: int, kv_heads: int, head_dim: int) -> None:
    """Refuse a shape the target engine would refuse at its first request, naming what it serves."""
    target = get_target(target_name)
    if target.serves(rank, rope_dim):
        return
    full = 2 * kv_heads * head_dim
    if target.latent_sizes is None:  # any latent size, in whole blocks
        raise KVConvertError(
            f"--rank {rank} --rope-dim {rope_dim}: {target.name} does not serve it: {target.note}. Round both to "
            f"multiples of {target.multiple_of}, or use --target any (or kvconvert, the bundled runtime) to write it "
            "anyway as a research shape.")
    shapes = servable_shapes(target, kv_heads, head_dim)
    if shapes:
        fits = "; ".join(f"--rank {r} --rope-dim {p} ({r + p} values, {100 * (r + p) / full:.0f}% of the source K+V)"
                         for r, p in shapes[:2])
        hint = f"Servable for this model: {fits}."
    else:
        hint = (f"No servable shape fits this model: its K+V holds {full} values per token and layer, fewer than "
                f"the smallest latent {target.name} takes ({min(target.latent_sizes)}).")
    raise KVConvertError(
        f"--rank {rank} --rope-dim {rope_dim}: a latent of {rank + rope_dim} values per token and layer, which "
        f"{target.name} does not serve: {target.note}. {hint} Use --target any (or kvconvert, the bundled "
        "runtime) to write it anyway as a research shape.")
