"""Maths shared by the model files: RMSNorm, RoPE (settings, frequencies, tables, rotation), causal
attention and the gated MLP.

Each reproduces transformers' arithmetic (same dtype casts, same order of operations), so the
runtime's fp32 logits match LlamaForCausalLM / DeepseekV3ForCausalLM to rounding.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F

from kvconvert.errors import UnsupportedModelError


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * x / sqrt(mean(x^2) + eps) over the last dim: normalised in fp32 (fp64 stays fp64),
    cast back to x's dtype, then times the weight (transformers' order)."""
    h = x if x.dtype == torch.float64 else x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T (+ bias) in x's dtype (weights may be stored narrower, e.g. a bf16 MLP)."""
    return F.linear(x, weight.to(x.dtype), None if bias is None else bias.to(x.dtype))


ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu, "relu": F.relu}


def check_activation(name: str) -> str:
    if name not in ACTIVATIONS:
        raise UnsupportedModelError(f"hidden_act {name!r} is not supported (supported: {', '.join(ACTIVATIONS)})")
    return name


def decoder_settings(c: dict) -> dict:
    """The shape fields every architecture reads alike from config.json `c` (its own default
    max_position_embeddings filled in): norm eps, layers, vocabulary, activation, context."""
    return dict(rms_eps=float(c.get("rms_norm_eps", 1e-6)), layers=c.get("num_hidden_layers", 0),
                vocab=c.get("vocab_size", 0), hidden_act=check_activation(c.get("hidden_act", "silu")),
                max_position_embeddings=c["max_position_embeddings"])


def short_names(w: dict) -> dict:
    """One layer's checkpoint tensors by short name: [model.layers.{i}.]self_attn.q_proj.weight ->
    q_proj, mlp.up_proj.bias -> up_proj_bias, input_layernorm.weight -> input_layernorm."""
    return {k.split(".")[-2] + ("_bias" if k.endswith(".bias") else ""): v for k, v in w.items()
            if k.endswith((".weight", ".bias"))}  # not k_scale, weight_scale, ...


def take(cls, w: dict, **extra):
    """A dataclass of tensors from the entries of w (short names) named like its fields; others are ignored."""
    return cls(**{f.name: w[f.name] for f in fields(cls) if f.name in w}, **extra)


@dataclass
class MLP:
    """down(act(gate(x)) * up(x)); weights nn.Linear-shaped [out, in]. gate and up stay separate
    tensors: fusing them would copy weights mapped from the checkpoint (twice the resident bytes)."""

    gate_proj: torch.Tensor
    up_proj: torch.Tensor
    down_proj: torch.Tensor
    act: str = "silu"
    gate_proj_bias: torch.Tensor | None = None
    up_proj_bias: torch.Tensor | None = None
    down_proj_bias: torch.Tensor | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., hidden] -> [..., hidden]."""
        gate = ACTIVATIONS[self.act](linear(x, self.gate_proj, self.gate_proj_bias))
        return linear(gate * linear(x, self.up_proj, self.up_proj_bias), self.down_proj, self.down_proj_bias)


@dataclass
class DecoderLayer:
    """One decoder layer's weights: the norms [hidden], the attention (the architecture's typed
    weights: llama.LlamaAttention, deepseek_v3.MLAAttention) and the MLP."""

    input_layernorm: torch.Tensor
    post_attention_layernorm: torch.Tensor
    attn: object
    mlp: MLP

    @classmethod
    def of(cls, w: dict, attention_cls, act: str = "silu") -> DecoderLayer:
        """From short names (see short_names)."""
        return cls(w["input_layernorm"], w["post_attention_layernorm"], take(attention_cls, w),
                   take(MLP, w, act=check_activation(act)))


def decoder_layer(h: torch.Tensor, w: DecoderLayer, s, attention) -> torch.Tensor:
    """h + attention(rms_norm(h)), then + mlp(rms_norm(.)), for the residual stream h [..., T, hidden];
    attention(xn, w.attn, s) -> [..., T, hidden] is the architecture's."""
    h = h + attention(rms_norm(h, w.input_layernorm, s.rms_eps), w.attn, s)
    return h + w.mlp(rms_norm(h, w.post_attention_layernorm, s.rms_eps))


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Full-sequence causal attention: q [B, H, T, dq], k [B, G, T, dq], v [B, G, T, dv] -> [B, H, T, dv]
    (query head h reads KV head h // (H / G), as transformers' repeat_kv)."""
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
    dq, dv = q.shape[-1], v.shape[-1]
    # PyTorch's fused CPU kernel needs equal q/k and v head dims (else a 10x slower fallback):
    # zero-padding v (or q and k) changes neither the scores nor the kept output columns.
    if dv < dq:
        v = F.pad(v, (0, dq - dv))
    elif dq < dv:
        q, k = F.pad(q, (0, dv - dq)), F.pad(k, (0, dv - dq))
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)[..., :dv]


# ------------------------------------------------------------------------------------ RoPE
SUPPORTED_ROPE = ("default", "linear", "llama3", "yarn")


def rope_parameters(config: dict, supported: tuple[str, ...] = SUPPORTED_ROPE) -> dict:
    """The checkpoint's RoPE settings in transformers 5's form (rope_parameters: rope_type,
    rope_theta, and original_max_position_embeddings for llama3/yarn), from either rope_parameters
    or the older rope_theta + rope_scaling keys (whose "type" becomes rope_type). A rope type
    outside `supported` is an UnsupportedModelError."""
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if params and all(isinstance(v, dict) for v in params.values()):
        raise UnsupportedModelError("per-layer-type rope_parameters are not supported")
    params = dict(params)
    params["rope_type"] = params.pop("type", None) or params.get("rope_type", "default")
    params.setdefault("rope_theta", config.get("rope_theta", 10000.0))
    if params["rope_type"] in ("llama3", "yarn"):
        params.setdefault("original_max_position_embeddings", config.get("max_position_embeddings"))
    if params["rope_type"] not in supported:
        raise UnsupportedModelError(
            f"RoPE type {params['rope_type']!r} is not supported (supported: {', '.join(supported)})")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise UnsupportedModelError("partial_rotary_factor != 1 is not supported")
    return params


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_inv_freq(dim: int, params: dict, max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [dim // 2] (fp32) and the cos/sin scale ("attention factor"), as
    transformers computes them for rope types default, linear, llama3 and yarn."""
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


@dataclass(frozen=True)
class Rope:
    """RoPE over `dim` values: inv_freq [dim/2] (fp32, transformers' values), the cos/sin scale, and
    the pair layout. interleaved=False (Llama, "neox"): pairs (i, i + dim/2); interleaved=True
    (DeepSeek's rope_interleave, "GPT-J"): pairs (2i, 2i+1), rotated in place (vLLM's cache layout;
    transformers de-interleaves q and k alike, so the dot products are the same)."""

    inv_freq: torch.Tensor
    scaling: float = 1.0
    interleaved: bool = False

    @classmethod
    def from_config(cls, config: dict, dim: int, interleaved: bool = False) -> Rope:
        params = rope_parameters(config)
        inv_freq, scaling = rope_inv_freq(dim, params, config.get("max_position_embeddings"))
        return cls(inv_freq, float(scaling), interleaved)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype,
                compute: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, dim/2] for positions [T], on positions' device: angles position * inv_freq
        in `compute` precision (float32 is transformers'; the functional blocks use float64), times
        the attention factor, cast to dtype."""
        angles = positions.to(compute)[:, None] * self.inv_freq.to(positions.device, compute)[None, :]
        return (angles.cos() * self.scaling).to(dtype), (angles.sin() * self.scaling).to(dtype)

    def table(self, length: int, device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [length, 1, dim/2] for positions 0..length-1 in float64 (the functional blocks'
        precision), shaped to rotate x [..., T, heads, dim]."""
        cos, sin = self.cos_sin(torch.arange(length, device=device), dtype, torch.float64)
        return cos[:, None], sin[:, None]

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [..., dim] rotated by cos/sin broadcastable to [..., dim/2]."""
        if self.interleaved:
            x1, x2 = x[..., 0::2], x[..., 1::2]
            return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
