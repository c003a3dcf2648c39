"""KV-cache size arithmetic from a Hugging Face config dict. Pure Python: no torch import.

What is cached per token and per layer:

* MHA / GQA / MQA (Llama family): one K and one V vector per KV head, each `head_dim` values:
  ``2 x num_key_value_heads x head_dim`` values.
* MLA (DeepSeek-V2/V3): one latent row of ``kv_lora_rank`` values plus one shared RoPE key of
  ``qk_rope_head_dim`` values: ``kv_lora_rank + qk_rope_head_dim`` values (576 for DeepSeek-V3).

Bytes per value depend on the cache format (kvconvert.kvformat, the one registry), counted with
everything the format really stores: NVFP4 is 4-bit values PLUS one E4M3 scale byte per block of
16 values, i.e. 0.5625 bytes/value, not the 0.5 that is commonly quoted; MLA keeps k_rope 16-bit.

Example: SmolLM2-135M in bf16 caches 30 layers x 2 x 3 heads x 64 x 2 bytes = 23040 bytes/token.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from kvconvert.errors import KVConvertError, UnsupportedModelError
from kvconvert.kvformat import KVFormat, KVPair, kv_pair

MHA, GQA, MQA, MLA = "MHA", "GQA", "MQA", "MLA"


# ----------------------------------------------------------------------------------------------
# attention shape from a config
# ----------------------------------------------------------------------------------------------


def text_config(config: dict) -> dict:
    """The language-model part of a config (multimodal configs nest it under `text_config`)."""
    if "num_hidden_layers" not in config and isinstance(config.get("text_config"), dict):
        return config["text_config"]
    return config


def attention_kind(config: dict) -> str:
    """MLA if the config has a kv_lora_rank; else MHA (kv heads == heads), MQA (one kv head) or
    GQA (several query heads per kv head)."""
    config = text_config(config)
    if config.get("kv_lora_rank") is not None:
        return MLA
    heads = config.get("num_attention_heads")
    if heads is None:
        raise UnsupportedModelError("config has no num_attention_heads; cannot tell the attention kind")
    kv_heads = config.get("num_key_value_heads") or heads
    if kv_heads == heads:
        return MHA
    return MQA if kv_heads == 1 else GQA


@dataclass(frozen=True)
class KVShape:
    """What one token caches in one layer. Non-MLA: 2 * num_kv_heads vectors of head_dim values
    (the tensors "k" and "v", [num_kv_heads, head_dim] each). MLA: one row "kv" of
    [latent (kv_lora_rank) | k_rope (qk_rope_head_dim)] values, the latent taken after kv_a_layernorm and
    k_rope after RoPE; rope_interleave: k_rope pairs are (2i, 2i+1) in the cache, else (i, i + r/2)."""

    kind: str
    num_layers: int
    num_heads: int
    num_kv_heads: int | None = None
    head_dim: int | None = None
    kv_lora_rank: int | None = None
    qk_rope_head_dim: int | None = None
    rope_interleave: bool = True

    def __post_init__(self):
        if self.kind not in (MHA, GQA, MQA, MLA):
            raise ValueError(f"unknown attention kind {self.kind!r}")
        needed = ("kv_lora_rank", "qk_rope_head_dim") if self.kind == MLA else ("num_kv_heads", "head_dim")
        for name in ("num_layers", "num_heads", *needed):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise UnsupportedModelError(f"{self.kind} attention needs a positive integer {name}, got {value!r}")
        if self.kind != MLA and self.num_heads % self.num_kv_heads:
            raise UnsupportedModelError(
                f"num_attention_heads {self.num_heads} is not a multiple of num_key_value_heads {self.num_kv_heads}")

    @property
    def is_mla(self) -> bool:
        return self.kind == MLA

    @property
    def cached_names(self) -> tuple[str, ...]:
        """Names of the tensors one layer caches: ("k", "v"), or ("kv",) for the MLA row."""
        return ("kv",) if self.is_mla else ("k", "v")

    @property
    def cached_heads(self) -> int:
        """Heads of each cached tensor: num_kv_heads, or 1 for the MLA row."""
        return 1 if self.is_mla else self.num_kv_heads

    @property
    def row_dim(self) -> int:
        """Values per head of each cached tensor: head_dim, or kv_lora_rank + qk_rope_head_dim for MLA."""
        return self.kv_lora_rank + self.qk_rope_head_dim if self.is_mla else self.head_dim

    @property
    def cached_vectors(self) -> list[int]:
        """Lengths of the vectors one token caches in one layer."""
        return [self.row_dim] * (len(self.cached_names) * self.cached_heads)

    @property
    def values_per_token_per_layer(self) -> int:
        return sum(self.cached_vectors)

    def layer_bytes(self, fmt: KVFormat | KVPair | str) -> int:
        """Bytes one token caches in one layer (MLA: k_rope is the row's tail, see KVFormat.vector_bytes); a K/V
        pair (q5_0/iq4_nl) counts K's vectors in its K format and V's in its V format."""
        pair = kv_pair(fmt) if isinstance(fmt, str) else KVPair(fmt, fmt) if isinstance(fmt, KVFormat) else fmt
        pair.check_cache_kind(self.kind == MLA)
        rope_tail = self.qk_rope_head_dim if self.kind == MLA else 0
        return sum(pair.side(name).vector_bytes(self.row_dim, rope_tail)
                   for name in self.cached_names for _ in range(self.cached_heads))


def head_dim(config: dict) -> int | None:
    """Per-head dimension: explicit `head_dim`, else hidden_size / num_attention_heads."""
    config = text_config(config)
    if config.get("head_dim"):
        return int(config["head_dim"])
    hidden, heads = config.get("hidden_size"), config.get("num_attention_heads")
    if hidden and heads and hidden % heads == 0:
        return hidden // heads
    return None


def kv_heads_held(config: dict, k_proj_shape) -> int | None:
    """The KV heads a Llama-family k_proj (or v_proj) of `k_proj_shape` [KV heads x head_dim, hidden_size]
    holds, to compare with what config.json says; None when the shape is not whole heads of head_dim
    over hidden_size (the checkpoint checks name that mismatch on its own)."""
    d = head_dim(config)
    shape = tuple(k_proj_shape)
    if not d or len(shape) != 2 or shape[1] != config.get("hidden_size") or shape[0] % d:
        return None
    return shape[0] // d


def kv_shape(config: dict) -> KVShape:
    """The cached shape of a model from its config; UnsupportedModelError names missing fields."""
    config = text_config(config)
    kind = attention_kind(config)
    layers, heads = config.get("num_hidden_layers"), config.get("num_attention_heads")
    if kind == MLA:
        return KVShape(MLA, layers, heads, kv_lora_rank=config.get("kv_lora_rank"),
                       qk_rope_head_dim=config.get("qk_rope_head_dim"),
                       # absent = True: transformers' DeepseekV3Config default, and vLLM's
                       # DeepSeek rotary is always GPT-J style (is_neox_style=False)
                       rope_interleave=bool(config.get("rope_interleave", True)))
    return KVShape(kind, layers, heads, num_kv_heads=config.get("num_key_value_heads") or heads,
                   head_dim=head_dim(config))


def mla_whatif(shape: KVShape, kv_lora_rank: int, rope_dim: int) -> KVShape:
    """The same model converted to MLA with a latent of `kv_lora_rank` values and a shared RoPE key
    of `rope_dim` values per layer (what `kvconvert mla` produces)."""
    if kv_lora_rank <= 0:
        raise KVConvertError(f"--mla-rank must be positive, got {kv_lora_rank}")
    if rope_dim <= 0 or rope_dim % 2:
        raise KVConvertError(f"--rope-dim must be a positive even number (RoPE rotates pairs), got {rope_dim}")
    if shape.kind != MLA and rope_dim > shape.head_dim:
        raise KVConvertError(
            f"--rope-dim {rope_dim} exceeds the source head_dim {shape.head_dim}: the shared RoPE key "
            "is built from the source's rotary frequencies; use at most head_dim")
    return KVShape(MLA, shape.num_layers, shape.num_heads, kv_lora_rank=kv_lora_rank, qk_rope_head_dim=rope_dim)


def kv_bytes_per_token(shape: KVShape, fmt: KVFormat | KVPair | str) -> int:
    """Bytes one token occupies in the cache, all layers together."""
    return shape.num_layers * shape.layer_bytes(fmt)


# ----------------------------------------------------------------------------------------------
# requests: context length and sliding windows
# ----------------------------------------------------------------------------------------------


def layer_windows(config: dict) -> list[int | None]:
    """Per layer, the sliding-window length in tokens (None: full attention).

    Follows the config conventions: `layer_types` ("sliding_attention"/"full_attention") when
    present; else an integer `sliding_window` applies to every layer unless `use_sliding_window`
    is false (Qwen2), and for Qwen2 only to layers >= `max_window_layers`.
    """
    config = text_config(config)
    n = config["num_hidden_layers"]
    window = config.get("sliding_window")
    if not isinstance(window, int) or window <= 0:
        return [None] * n
    if isinstance(config.get("layer_types"), list):
        return [window if t == "sliding_attention" else None for t in config["layer_types"]]
    if config.get("use_sliding_window") is False:
        return [None] * n
    first = config.get("max_window_layers", 0) if "use_sliding_window" in config else 0
    return [window if i >= first else None for i in range(n)]


def kv_bytes_per_request(shape: KVShape, fmt: KVFormat | str, context: int,
                         windows: list[int | None] | None = None) -> int:
    """Cache bytes for one sequence of `context` tokens; a sliding-window layer keeps at most its
    window of tokens."""
    if context <= 0:
        raise KVConvertError(f"--context must be positive, got {context}")
    per_layer = shape.layer_bytes(fmt)
    windows = windows if windows is not None else [None] * shape.num_layers
    if len(windows) != shape.num_layers:
        raise KVConvertError(f"{len(windows)} layer windows for {shape.num_layers} layers")
    return sum(per_layer * (context if w is None else min(context, w)) for w in windows)


# ----------------------------------------------------------------------------------------------
# parameter count from a config (when no weights are at hand)
# ----------------------------------------------------------------------------------------------


def _require(config: dict, *names: str) -> list[int]:
    missing = [n for n in names if not isinstance(config.get(n), int)]
    if missing:
        raise UnsupportedModelError(f"cannot count parameters: config lacks {', '.join(missing)}")
    return [config[n] for n in names]


def _llama_attention_params(config: dict, hidden: int) -> int:
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    d = head_dim(config)
    q, kv = heads * d, kv_heads * d
    weights = hidden * q + 2 * hidden * kv + q * hidden
    if config.get("model_type") == "qwen2":  # Qwen2: biases on q/k/v only, none on o_proj
        return weights + q + 2 * kv
    if config.get("attention_bias"):  # Llama's attention_bias adds q/k/v/o biases
        return weights + q + 2 * kv + hidden
    return weights


def _mla_attention_params(config: dict, hidden: int) -> int:
    heads = config["num_attention_heads"]
    rank, rope, nope, v = _require(config, "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim")
    q_dim = heads * (nope + rope)
    q_lora = config.get("q_lora_rank")
    q = hidden * q_dim if q_lora is None else hidden * q_lora + q_lora + q_lora * q_dim  # + q_a_layernorm
    kv = hidden * (rank + rope) + rank + rank * heads * (nope + v)  # kv_a_proj, kv_a_layernorm, kv_b_proj
    return q + kv + heads * v * hidden


def _mlp_params(config: dict, hidden: int, layer: int) -> int:
    dense = 3 * hidden * config["intermediate_size"] + (
        2 * config["intermediate_size"] + hidden if config.get("mlp_bias") else 0)
    n_routed = config.get("n_routed_experts")
    if not n_routed or layer < config.get("first_k_dense_replace", 0):
        return dense
    (moe_inter,) = _require(config, "moe_intermediate_size")
    experts = (n_routed + (config.get("n_shared_experts") or 0)) * 3 * hidden * moe_inter
    router = n_routed * hidden + (n_routed if config.get("topk_method") == "noaux_tc" else 0)  # + correction bias
    return experts + router


def parameter_count(config: dict) -> int:
    """Exact parameter count of a Llama-family (Llama, Mistral, Qwen2) or DeepSeek-V2/V3 model from
    its config, as the safetensors of the HF checkpoint would hold (tied lm_head counted once;
    DeepSeek-V3's multi-token-prediction module excluded)."""
    config = text_config(config)
    if config.get("num_local_experts") or config.get("num_experts"):
        raise UnsupportedModelError("cannot count parameters of this MoE layout from its config; pass a folder with weights")
    layers, hidden, vocab, _ = _require(config, "num_hidden_layers", "hidden_size", "vocab_size", "intermediate_size")
    attention = (_mla_attention_params if attention_kind(config) == MLA else _llama_attention_params)(config, hidden)
    norms = 2 * hidden
    total = sum(attention + norms + _mlp_params(config, hidden, i) for i in range(layers))
    embeddings = vocab * hidden * (1 if config.get("tie_word_embeddings") else 2)
    return total + hidden + embeddings  # + final norm


# ----------------------------------------------------------------------------------------------
# sizes
# ----------------------------------------------------------------------------------------------

_UNITS = {
    "": 2**30, "b": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
}


def parse_size(text: str, bare_unit: int = 2**30) -> int:
    """Bytes from '80GiB', '141GB', '80G' (= GiB), '512MiB' or a bare number (x bare_unit: GiB for
    GPU sizes, 1 where a bare number means bytes)."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    unit = match.group(2).lower() if match else None
    if not match or unit not in _UNITS:
        raise KVConvertError(f"cannot read size {text!r}; write e.g. 80GiB, 141GB or 512MiB")
    return int(float(match.group(1)) * (_UNITS[unit] if unit else bare_unit))


def format_bytes(n: float) -> str:
    """Binary units: 327680 -> '320.0 KiB', 42949672960 -> '40.00 GiB'."""
    for unit, size, digits in (("TiB", 2**40, 2), ("GiB", 2**30, 2), ("MiB", 2**20, 1), ("KiB", 2**10, 1)):
        if abs(n) >= size:
            return f"{n / size:.{digits}f} {unit}"
    return f"{n:.0f} B"
