"""Building blocks shared by the models: RMSNorm, gated MLP, rotary position embedding.

Each one reproduces transformers' arithmetic (same dtype casts, same order of operations) so the
runtime's fp32 logits match LlamaForCausalLM / DeepseekV3ForCausalLM to rounding.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from kvconvert.errors import UnsupportedModelError


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * x / sqrt(mean(x^2) + eps), normalised in fp32 then cast back (transformers' order)."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, weight, bias)


ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu, "relu": F.relu}


def activation(name: str):
    if name not in ACTIVATIONS:
        raise UnsupportedModelError(f"hidden_act {name!r} is not supported (supported: {', '.join(ACTIVATIONS)})")
    return ACTIVATIONS[name]


class GatedMLP:
    """down(act(gate(x)) * up(x)). x [T, hidden]. gate and up stay separate tensors: fusing them
    would copy weights that are mapped from the checkpoint (twice the resident bytes)."""

    def __init__(self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, act: str,
                 biases: tuple | None = None):
        self.gate, self.up, self.down = gate, up, down
        self.gate_bias, self.up_bias, self.down_bias = biases or (None, None, None)
        self.act = activation(act)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        gate = linear(x, self.gate, self.gate_bias)
        return linear(self.act(gate) * linear(x, self.up, self.up_bias), self.down, self.down_bias)


def final_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The last RMSNorm, kept in fp32 (its output feeds the fp32 logits)."""
    h = x.float()
    return weight.float() * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps))


LOGIT_CHUNK = 8192  # vocabulary rows upcast at a time: bounds the fp32 copy of lm_head (8192 x hidden)


def fp32_logits(hidden: torch.Tensor, lm_head: torch.Tensor) -> torch.Tensor:
    """hidden [N, hidden] -> fp32 logits [N, vocab] with fp32 products and output.

    A bf16 matmul accumulates in fp32 but rounds its output to bf16 (8 bits: a logit of 20 lands on
    a 0.125 grid), which perplexity and KL would see; so bf16/fp16 weights are upcast a chunk of
    rows at a time and multiplied in fp32. fp32 weights go straight through.
    """
    hidden = hidden.float()
    if lm_head.dtype == torch.float32:
        return F.linear(hidden, lm_head)
    out = hidden.new_empty(hidden.shape[0], lm_head.shape[0])
    for lo in range(0, lm_head.shape[0], LOGIT_CHUNK):
        hi = min(lo + LOGIT_CHUNK, lm_head.shape[0])
        out[:, lo:hi] = F.linear(hidden, lm_head[lo:hi].float())
    return out


# ------------------------------------------------------------------------------------ RoPE
SUPPORTED_ROPE = ("default", "linear", "llama3", "yarn")


def rope_parameters(config: dict) -> dict:
    """The checkpoint's RoPE settings in transformers 5's form (rope_parameters), from either
    rope_parameters or the older rope_theta + rope_scaling keys."""
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if params and all(isinstance(v, dict) for v in params.values()):
        raise UnsupportedModelError("per-layer-type rope_parameters are not supported by the runtime")
    params = dict(params)
    params.setdefault("rope_type", params.get("type", "default"))
    params.setdefault("rope_theta", config.get("rope_theta", 10000.0))
    if params["rope_type"] in ("llama3", "yarn"):
        params.setdefault("original_max_position_embeddings", config.get("max_position_embeddings"))
    if params["rope_type"] not in SUPPORTED_ROPE:
        raise UnsupportedModelError(
            f"RoPE type {params['rope_type']!r} is not supported by the runtime (supported: {', '.join(SUPPORTED_ROPE)})"
        )
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise UnsupportedModelError("partial_rotary_factor != 1 is not supported by the runtime")
    return params


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_inv_freq(dim: int, params: dict, max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [dim // 2] and the cos/sin scale ("attention factor"), as transformers
    computes them for rope types default, linear, llama3 and yarn."""
    base = params["rope_theta"]
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    kind = params["rope_type"]
    if kind == "default":
        return inv_freq, 1.0
    if kind == "linear":
        return inv_freq / params["factor"], 1.0
    if kind == "llama3":
        return _llama3_inv_freq(inv_freq, params), 1.0
    return _yarn_inv_freq(dim, params, max_position_embeddings)


def _llama3_inv_freq(inv_freq: torch.Tensor, params: dict) -> torch.Tensor:
    factor, low, high = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
    old_len = params["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_inv_freq(dim: int, params: dict, max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    base = params["rope_theta"]
    original = params["original_max_position_embeddings"]
    factor = params.get("factor") or max_position_embeddings / original
    attention_factor = params.get("attention_factor")
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = float(_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim))
        else:
            attention_factor = _yarn_mscale(factor)
    beta_fast, beta_slow = params.get("beta_fast") or 32, params.get("beta_slow") or 1

    def correction_dim(rotations):
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation_weight = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation_weight) + (1.0 / pos_freqs) * extrapolation_weight
    return inv_freq, attention_factor


def yarn_softmax_scale(params: dict, scale: float) -> float:
    """DeepSeek's softmax scale correction: times mscale(factor, mscale_all_dim)^2 when set."""
    if params.get("rope_type", "default") != "default":
        mscale_all_dim = params.get("mscale_all_dim", 0)
        if mscale_all_dim:
            m = _yarn_mscale(params["factor"], mscale_all_dim)
            scale = scale * m * m
    return scale


class Rotary:
    """RoPE over the last `dim` values of x [T, heads, dim].

    interleaved=False (Llama, "neox"): pairs (i, i + dim/2). interleaved=True (DeepSeek's
    rope_interleave, "GPT-J"): pairs (2i, 2i+1), rotated in place, which is the layout vLLM keeps
    in the cache. transformers de-interleaves q and k alike for the same dot products.
    cos/sin for every position up to max_positions are precomputed as transformers computes them:
    fp32 position * inv_freq, cos/sin, times the attention factor.
    """

    def __init__(self, dim: int, params: dict, max_position_embeddings: int, max_positions: int,
                 interleaved: bool = False, dtype: torch.dtype = torch.float32):
        inv_freq, attention_factor = rope_inv_freq(dim, params, max_position_embeddings)
        freqs = torch.arange(max_positions).float()[:, None] * inv_freq[None, :]
        self.cos = (freqs.cos() * attention_factor).to(dtype)  # [positions, dim/2]
        self.sin = (freqs.sin() * attention_factor).to(dtype)
        self.interleaved = interleaved

    def angles(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, 1, dim/2] for positions [T] (computed once per forward, shared by layers)."""
        return self.cos[positions][:, None, :], self.sin[positions][:, None, :]

    def __call__(self, x: torch.Tensor, angles: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """x [T, heads, dim] rotated by angles = self.angles(positions)."""
        cos, sin = angles
        if self.interleaved:
            x1, x2 = x[..., 0::2], x[..., 1::2]
            return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def load_decoder(reader, dtype, num_layers: int, make_layer) -> tuple:
    """(embed, final norm, lm_head, [make_layer(weights) per layer]) mapped from the checkpoint in
    `dtype` (views of the files when it is the stored dtype); lm_head falls back to the tied embedding."""
    def get(name):
        return reader.mapped(name, dtype)
    embed = get("model.embed_tokens.weight")
    lm_head = get("lm_head.weight") if "lm_head.weight" in reader else embed
    layers = []
    for i in range(num_layers):
        prefix = f"model.layers.{i}."
        layers.append(make_layer({k[len(prefix):]: v for k, v in reader.tensors(prefix, dtype, mapped=True).items()}))
    return embed, get("model.norm.weight"), lm_head, layers
