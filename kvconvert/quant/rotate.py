"""Weight rewrites that change what is cached but not what the model computes (free at serving time).

All are exact in real arithmetic; tests check fp32 logits before/after.

GQA / MHA (Llama naming; weights ``[out, in]``):
* V rotation. For each KV head g an orthogonal R (head_dim x head_dim): the cache holds R v.
  ``v_proj[g] <- R @ v_proj[g]`` (and its bias), and for every query head h reading g,
  ``o_proj[:, h] <- o_proj[:, h] @ R^T``, so attention outputs R (sum p v) and o_proj undoes R.
* Key pair factors. RoPE multiplies pair (i, i + head_dim/2) of every head, read as the complex
  number c_i = x_i + j x_{i+d/2}, by e^{j theta_i t}. Any complex factor z_i per pair commutes with
  that: ``k_proj`` pair rows times z_i, the matching ``q_proj`` rows of every query head in the group
  times z_i / |z_i|^2, and every score q.k = sum_i Re(q_i conj(k_i)) is unchanged. |z_i| is a scale
  (equalizing the pairs' magnitudes for block formats, NVFP4), arg z_i a phase: it decides how the
  pair's product q.k splits between its two stored channels, which sets how much rounding noise the
  score gets (see :func:`pair_phase`). Mixing different pairs would not commute with RoPE.
DeepSeek-V3 MLA:
* Latent rotation. The cached latent is kv_a_layernorm(c) = w * c / rms(c) with c the first
  kv_lora_rank outputs of ``kv_a_proj_with_mqa``. rms is rotation-invariant but the weight w is not
  (w * Rc != R (w * c) unless w is uniform), so w is first folded into ``kv_b_proj`` columns
  (``kv_b <- kv_b diag(w)``, ``w <- 1``); then ``kv_a[:rank] <- R kv_a[:rank]`` and
  ``kv_b <- kv_b R^T``.
* Latent shaping (kvconvert.quant.latent_shape): a per-layer invertible T instead of R, folded the
  same way with T^-1 in place of R^T; exact only while the latent norm is in its linear range.
* k_rope pair factors: like the key pair factors above, on the shared rope key (rows after the
  latent in ``kv_a_proj_with_mqa``) and the rope rows of every query head (``q_proj`` or
  ``q_b_proj``). Pairs are (2i, 2i+1) when ``rope_interleave`` is set, else (i, i + r/2).

R is a normalized Hadamard matrix over blocks of ``block`` values (block-diagonal when block <
dim), optionally with random signs (R = H diag(s), seeded): it spreads an outlier over the block.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from kvconvert.errors import KVConvertError, UnsupportedModelError


def hadamard(n: int, dtype=torch.float64) -> torch.Tensor:
    """Normalized Sylvester Hadamard matrix [n, n] (n a power of two): orthogonal and symmetric."""
    if n < 1 or n & (n - 1):
        raise KVConvertError(f"Hadamard size must be a power of two, got {n}")
    h = torch.ones(1, 1, dtype=dtype)
    while h.shape[0] < n:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return h / math.sqrt(n)


def block_hadamard(dim: int, block: int, seed: int | None = None) -> torch.Tensor:
    """Orthogonal [dim, dim] float64: Hadamard blocks of size `block` on the diagonal, then random
    column signs when `seed` is given (R = blockdiag(H) @ diag(s))."""
    if block <= 0 or dim % block:
        raise KVConvertError(f"rotation block {block} must divide the rotated dim {dim}")
    r = torch.block_diag(*[hadamard(block)] * (dim // block))
    if seed is not None:
        g = torch.Generator().manual_seed(seed)
        signs = torch.randint(0, 2, (dim,), generator=g).double() * 2 - 1
        r = r * signs[None, :]
    return r


def rope_pairs(dim: int, interleave: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Indices (first, second) of the RoPE pairs in a head of `dim` rotary values."""
    half = dim // 2
    if interleave:
        return torch.arange(0, dim, 2), torch.arange(1, dim, 2)
    return torch.arange(half), torch.arange(half, dim)


@dataclass
class RotationPlan:
    """What to rewrite in each layer's attention weights (see module docstring).

    value_rotation: [dim, dim] orthogonal (float64) applied to V per KV head (gqa) or to the latent
    (mla), or None. key_pair_factor[l]: complex128 [kv_heads, dim/2] (gqa) or [rope/2] (mla), nonzero,
    or None (real tensors are taken as pure scales).
    """

    layout: KVShape
    value_rotation: torch.Tensor | None = None
    key_pair_factor: list[torch.Tensor] | None = None
    description: dict = field(default_factory=dict)
    latent_transform: list[torch.Tensor | None] | None = None  # mla: per layer [rank, rank] float64 (None:
    # nothing folded into that layer), instead of R

    def __post_init__(self):
        if self.latent_transform is not None and (self.value_rotation is not None or not self.layout.is_mla):
            raise ValueError("a latent transform replaces the value rotation, and exists for MLA only")

    @property
    def is_identity(self) -> bool:
        return self.value_rotation is None and self.key_pair_factor is None and self.latent_transform is None

    def apply(self, layer: int, w: dict[str, torch.Tensor], num_q_heads: int) -> dict[str, torch.Tensor]:
        """Rewrite one layer's attention tensors.

        w: names relative to the attention module ("v_proj.weight", "kv_b_proj.weight", ...) ->
        tensors; returns only the changed tensors, in their original dtypes (math in float64).
        """
        orig = {k: t.dtype for k, t in w.items()}
        w64 = {k: t.double() for k, t in w.items()}
        pair = None if self.key_pair_factor is None else self.key_pair_factor[layer].to(torch.complex128)
        if self.layout.is_mla:
            latent = self.value_rotation
            inverse = None if latent is None else latent.T  # orthogonal: R^-1 = R^T
            if self.latent_transform is not None and self.latent_transform[layer] is not None:
                latent = self.latent_transform[layer].double()
                inverse = torch.linalg.inv(latent)
            changed = _apply_mla(self.layout, w64, latent, inverse, pair, num_q_heads)
        else:
            changed = _apply_gqa(self.layout, w64, self.value_rotation, pair, num_q_heads)
        return {k: v.to(orig[k]).contiguous() for k, v in changed.items()}


def _require(w: dict, names: list[str]) -> None:
    missing = [n for n in names if n not in w]
    if missing:
        raise UnsupportedModelError(f"cannot fold a rotation: attention tensors {missing} are missing")


def _apply_gqa(layout: KVShape, w, rot, pair, n_q: int) -> dict:
    d, n_kv = layout.head_dim, layout.num_kv_heads
    group = n_q // n_kv
    out = {}
    if rot is not None:
        _require(w, ["v_proj.weight", "o_proj.weight"])
        v = w["v_proj.weight"].view(n_kv, d, -1)
        out["v_proj.weight"] = torch.einsum("ij,gjk->gik", rot, v).reshape(n_kv * d, -1)
        if "v_proj.bias" in w:
            out["v_proj.bias"] = (w["v_proj.bias"].view(n_kv, d) @ rot.T).reshape(-1)
        o = w["o_proj.weight"].view(w["o_proj.weight"].shape[0], n_q, d)
        out["o_proj.weight"] = torch.einsum("ohj,ij->ohi", o, rot).reshape(o.shape[0], n_q * d)
    if pair is not None:
        if "k_norm.weight" in w or "q_norm.weight" in w:
            raise UnsupportedModelError("key pair factors are not supported with q_norm/k_norm (Qwen3-style) attention")
        _require(w, ["k_proj.weight", "q_proj.weight"])
        pairs = rope_pairs(d, interleave=False)
        q_factor = query_factor(pair).repeat_interleave(group, dim=0)  # [n_q, d/2]
        out["k_proj.weight"] = multiply_pairs(w["k_proj.weight"].view(n_kv, d, -1), pair, pairs).reshape(n_kv * d, -1)
        out["q_proj.weight"] = multiply_pairs(w["q_proj.weight"].view(n_q, d, -1), q_factor, pairs).reshape(n_q * d, -1)
        if "k_proj.bias" in w:
            out["k_proj.bias"] = multiply_pairs(w["k_proj.bias"].view(n_kv, d, 1), pair, pairs).reshape(-1)
        if "q_proj.bias" in w:
            out["q_proj.bias"] = multiply_pairs(w["q_proj.bias"].view(n_q, d, 1), q_factor, pairs).reshape(-1)
    return out


def _apply_mla(layout: KVShape, w, rot, rot_inverse, pair, n_q: int) -> dict:
    rank, rope = layout.kv_lora_rank, layout.qk_rope_head_dim
    _require(w, ["kv_a_proj_with_mqa.weight", "kv_b_proj.weight", "kv_a_layernorm.weight"])
    out = {}
    kv_a = w["kv_a_proj_with_mqa.weight"].clone()
    kv_a_bias = w.get("kv_a_proj_with_mqa.bias")
    kv_a_bias = None if kv_a_bias is None else kv_a_bias.clone()
    if rot is not None:
        norm_w = w["kv_a_layernorm.weight"]
        kv_b = w["kv_b_proj.weight"] * norm_w[None, :]  # fold the norm weight: kv_b diag(w)
        out["kv_a_layernorm.weight"] = torch.ones_like(norm_w)
        out["kv_b_proj.weight"] = kv_b @ rot_inverse
        kv_a[:rank] = rot @ kv_a[:rank]
        if kv_a_bias is not None:
            kv_a_bias[:rank] = rot @ kv_a_bias[:rank]
    if pair is not None:
        pairs = rope_pairs(rope, layout.rope_interleave)
        kv_a[rank:] = multiply_pairs(kv_a[rank:][None], pair[None], pairs)[0]
        if kv_a_bias is not None:
            kv_a_bias[rank:] = multiply_pairs(kv_a_bias[rank:, None][None], pair[None], pairs).reshape(-1)
        q_name = "q_proj.weight" if "q_proj.weight" in w else "q_b_proj.weight"
        _require(w, [q_name])
        q = w[q_name].view(n_q, -1, w[q_name].shape[-1]).clone()  # [heads, nope + rope, in]
        q[:, -rope:] = multiply_pairs(q[:, -rope:], query_factor(pair)[None].expand(n_q, -1), pairs)
        out[q_name] = q.reshape(-1, q.shape[-1])
    out["kv_a_proj_with_mqa.weight"] = kv_a
    if kv_a_bias is not None:
        out["kv_a_proj_with_mqa.bias"] = kv_a_bias
    return out


def query_factor(key_factor: torch.Tensor) -> torch.Tensor:
    """The query pair factor that keeps Re(q conj(k)) when k is multiplied by z: z / |z|^2 (= 1/conj z)."""
    return key_factor / key_factor.abs().square()


def multiply_pairs(rows: torch.Tensor, factor: torch.Tensor, pairs: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Multiply each RoPE pair of weight rows, read as complex x_first + j x_second, by a factor.

    rows: float64 [heads, dim, in]; factor: complex128 [heads, dim/2]; pairs: (first, second) indices
    of length dim/2. Returns new rows [heads, dim, in] (x + jy) * (a + jb) = (ax - by) + j(bx + ay).
    """
    first, second = pairs
    a, b = factor.real[..., None], factor.imag[..., None]  # [heads, dim/2, 1]
    x, y = rows[:, first], rows[:, second]
    out = rows.clone()
    out[:, first], out[:, second] = a * x - b * y, b * x + a * y
    return out


def pair_phase(q_moment: torch.Tensor, k_moment: torch.Tensor) -> torch.Tensor:
    """Unit pair factors e^{j alpha} that minimize the rounding noise of q.k under element-wise
    relative rounding (FP8: every stored key value gets an independent relative error of variance s^2).

    A pair contributes Re(q conj(k)) = q_x k_x + q_y k_y to a score; rounding k_x, k_y adds noise of
    variance s^2 (q_x^2 k_x^2 + q_y^2 k_y^2). With q = r e^{j psi}, k = rho e^{j phi} that is
    s^2 r^2 rho^2 (2 + cos(2 psi - 2 phi) + cos(2 psi + 2 phi)) / 4. Rotating both by alpha leaves the
    difference term alone and turns the sum term into Re(e^{4 j alpha} q^2 k^2). With queries and keys
    independent, E[q^2 k^2] = E[q^2] E[k^2] =: Z, minimized by 4 alpha = pi - arg Z: the noise term
    Re Z / 4 becomes -|Z| / 4 (pair_noise). A pair whose phase RoPE spreads over a window (high
    frequency) has Z ~ 0 and gains nothing; slow pairs with a steady large product gain most.

    q_moment, k_moment: complex128 [..., pairs], the mean of q^2 and k^2 of post-RoPE pairs (q summed
    over the query heads that read the KV head). Returns complex128 [..., pairs] of modulus 1.
    """
    z = q_moment * k_moment
    return torch.polar(torch.ones_like(z.real), (math.pi - torch.angle(z)) / 4)


def pair_noise(q_moment, k_moment, q_power, k_power, factor=None) -> torch.Tensor:
    """Mean relative-rounding noise of the scores per pair, in units of the rounding variance s^2
    (see pair_phase), over independent queries and keys.

    q_power, k_power: float64 [..., pairs], the mean of |q|^2 and |k|^2; factor: the unit pair factor
    applied to both (None = identity). Returns float64 [..., pairs].
    """
    rotated = q_moment * k_moment
    if factor is not None:
        rotated = rotated * factor ** 4
    return q_power * k_power / 2 + ((q_moment * k_moment.conj()).real + rotated.real) / 4


def pair_equalizing_scale(pair_amax: torch.Tensor, strength: float, max_ratio: float = 16.0) -> torch.Tensor:
    """alpha per RoPE pair pulling every pair's amax toward the geometric mean of its head.

    pair_amax: [..., pairs] (> 0 where alive). alpha = (gm / amax)^strength, clamped to
    [1/max_ratio, max_ratio]; strength 0 = identity, 1 = full equalization. Dead pairs get 1.
    """
    a = pair_amax.double()
    alive = a > 0
    log_a = torch.where(alive, a.clamp_min(1e-30).log(), torch.zeros_like(a))
    gm = (log_a.sum(-1, keepdim=True) / alive.sum(-1, keepdim=True).clamp_min(1)).exp()
    alpha = (gm / a.clamp_min(1e-30)).pow(strength).clamp(1.0 / max_ratio, max_ratio)
    return torch.where(alive, alpha, torch.ones_like(alpha))


def pair_balance_scale(q_power: torch.Tensor, k_power: torch.Tensor, power: float = 0.5) -> torch.Tensor:
    """Real key pair scales s = (E|q|^2 / E|k|^2)^(power / 4), geometric mean 1 per head (queries get 1/s).

    When an engine turns each key by an orthogonal matrix over its head before a block quantizer (llama.cpp's
    Hadamard), the rounding error is spread evenly over the head, with a variance proportional to |k|^2, and a
    score q.k picks it up in proportion to |q|^2: the noise is E|q'|^2 E|k'|^2 = sum_i E|q_i|^2 / s_i^2 *
    sum_i s_i^2 E|k_i|^2, smallest (Cauchy-Schwarz) at s_i^2 = sqrt(E|q_i|^2 / E|k_i|^2), power 1 here; lower
    powers go part of the way. q_power, k_power: float64 [..., pairs] (pair_stats.PairMoments). Dead pairs get 1."""
    q, k = q_power.double(), k_power.double()
    alive = (q > 0) & (k > 0)
    log_s = torch.where(alive, (q.clamp_min(1e-300).log() - k.clamp_min(1e-300).log()) * power / 4,
                        torch.zeros_like(q))
    log_s = log_s - (log_s * alive).sum(-1, keepdim=True) / alive.sum(-1, keepdim=True).clamp_min(1)
    return torch.where(alive, log_s.exp(), torch.ones_like(q))


def pair_amax_from_channels(amax_channel: torch.Tensor, interleave: bool) -> torch.Tensor:
    """[..., dim] per-channel amax -> [..., dim/2] per-pair amax (max of the pair's two channels)."""
    first, second = rope_pairs(amax_channel.shape[-1], interleave)
    return torch.maximum(amax_channel[..., first], amax_channel[..., second])


@torch.no_grad()
def apply_plan_to_model(model, plan: RotationPlan) -> None:
    """Rewrite the in-memory model's attention weights with `plan` (same math as the export)."""
    from kvconvert.quant.capture import decoder_layers

    n_q = plan.layout.num_heads
    for i, layer in enumerate(decoder_layers(model)):
        for name, tensor in plan.apply(i, layer.self_attn.state_dict(), n_q).items():
            layer.self_attn.get_parameter(name).copy_(tensor)
