"""Convert one Llama attention block to DeepSeek-V3 MLA weights (closed form, float64, on the
device of its inputs).

convert_layer is the one entry point (used by `kvconvert mla` and the budget search): the
closed form on the layer's calibration inputs, the latent RMSNorm linearisation, optional
low-rank queries and the least-squares o_proj refit, with the attention errors measured."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch

from kvconvert.mla import factorize as fz
from kvconvert.mla.options import LATENT_LINEAR_RHO
from kvconvert.models import deepseek_v3 as ds, llama
from kvconvert.models.common import take
from kvconvert.models.deepseek_v3 import MLAShape
from kvconvert.models.llama import LlamaShape


@dataclass(frozen=True)
class LayerPlan:
    """Target sizes shared by every layer (DeepSeek has one kv_lora_rank for all layers)."""

    rank: int  # kv_lora_rank
    rope_dim: int  # qk_rope_head_dim
    nope_dim: int  # qk_nope_head_dim = min(head_dim, rank)
    v_dim: int  # v_head_dim = min(head_dim, rank)
    key_weight: float = 0.3  # weight of key (score) errors vs value errors (both in output units)
    rho: float = LATENT_LINEAR_RHO  # latent RMSNorm linearisation margin (mean(c^2) <= rho * eps)
    latent_eps: float = 1e-6  # eps of kv_a_layernorm (transformers hard-codes 1e-6)

    @staticmethod
    def for_source(head_dim: int, rank: int, rope_dim: int, **kw) -> "LayerPlan":
        return LayerPlan(rank=rank, rope_dim=rope_dim, nope_dim=min(head_dim, rank), v_dim=min(head_dim, rank), **kw)


@dataclass
class LayerResult:
    weights: dict  # DeepSeek attention weights (short names): float64 (closed form), float32 (layer-wise fit)
    report: dict = field(default_factory=dict)


def max_rank(kv_heads: int, head_dim: int, rope_dim: int) -> int:
    """Largest useful kv_lora_rank: all NoPE key features plus all values (2*G*d - rope_dim)."""
    return 2 * kv_heads * head_dim - rope_dim


def convert_attention(w: dict, cov_x: torch.Tensor, mean_x: torch.Tensor, s: LlamaShape, plan: LayerPlan) -> LayerResult:
    """DeepSeek MLA weights for one layer, from source weights w (float64: q/k/v/o_proj) and
    the covariance cov_x = E[x x^T] of the layer's normed input.

    Returns q_proj, kv_a_proj_with_mqa (latent rows not yet scaled for the norm), kv_b_proj (same),
    o_proj, and a report. `finalize_latent_norm` then applies the RMSNorm linearisation.
    """
    H, G, d = s.heads, s.kv_heads, s.head_dim
    basis = fz.rope_basis(w["k_proj"], cov_x, G, d, plan.rope_dim)
    maps = fz.rope_maps(basis, H, G, d)
    dn = maps.key_nope.shape[0]
    w_y = torch.cat([maps.key_nope @ w["k_proj"], w["v_proj"]])  # [Dn + G*d, hidden]
    metric = fz.attention_weights(w["q_proj"], w["v_proj"], w["o_proj"], maps, cov_x, mean_x, H, G, d, plan.key_weight)
    latent = fz.weighted_latent(w_y, cov_x, metric, plan.rank)
    up_k, up_v = latent.up[:dn], latent.up[dn:]  # [Dn, r], [G*d, r]

    q_scale = ((plan.nope_dim + plan.rope_dim) / d) ** 0.5  # fold the softmax-scale change into q
    wq = w["q_proj"].view(H, d, -1)
    wo = w["o_proj"].view(w["o_proj"].shape[0], H, d)
    q_rows, kvb_rows, o_cols = [], [], []
    eye = torch.eye(plan.rank, dtype=cov_x.dtype, device=cov_x.device)
    for h in range(H):
        g = h // s.group
        uk = maps.query_nope[h].T @ up_k  # [d, r]: score_nope = q_h^T uk c
        uv = up_v[g * d:(g + 1) * d]  # [d, r]
        if plan.nope_dim == d:
            q_nope, w_uk = wq[h], uk
        else:  # rank < head_dim: move the key map into the query, identity W_UK
            q_nope, w_uk = uk.T @ wq[h], eye
        if plan.v_dim == d:
            w_uv, o_h = uv, wo[:, h]
        else:
            w_uv, o_h = eye, wo[:, h] @ uv
        q_rows += [q_scale * q_nope, q_scale * (maps.query_rope[h] @ wq[h])]
        kvb_rows += [w_uk, w_uv]
        o_cols.append(o_h)
    weights = {
        "q_proj": torch.cat(q_rows),
        "kv_a_proj_with_mqa": torch.cat([latent.down, maps.key_rope @ w["k_proj"]]),
        "kv_b_proj": torch.cat(kvb_rows),
        "o_proj": torch.cat(o_cols, dim=1),
    }
    total = float(latent.energy.sum())
    report = {
        "rope_energy_kept": basis.kept_fraction,
        "latent_energy_kept": float(latent.energy[: plan.rank].sum()) / max(total, 1e-300),
        "nope_key_dims": dn,
        "latent_spectrum": (latent.energy / max(float(latent.energy[0]), 1e-300)).tolist(),
        "rope_slot_energy": [float(e[0]) for e in basis.energy],
        "rope_slot_total": [float(e.sum()) for e in basis.energy],
    }
    return LayerResult(weights, report)


def finalize_latent_norm(weights: dict, latent_sq_mean: torch.Tensor, plan: LayerPlan) -> dict:
    """Make kv_a_layernorm (almost) linear and give the cached latent unit scale.

    latent_sq_mean: [N] mean(c^2) per calibration token for the unscaled latent c = down @ x.
    Scales the latent rows of kv_a_proj_with_mqa by a (mean((a c)^2) <= rho * eps on every token),
    sets a uniform norm weight w0 so the cached latent has RMS ~1 on a typical token, and divides
    kv_b_proj by the same factor: kv_b(w0 * a c / sqrt(eps)) = kv_b_eff(c).
    """
    r = plan.rank
    a, typical_rms, w0 = _linear_norm(latent_sq_mean, plan)
    kv_a = weights["kv_a_proj_with_mqa"].clone()
    kv_a[:r] *= a
    out = dict(weights)
    out["kv_a_proj_with_mqa"] = kv_a
    out["kv_a_layernorm"] = kv_a.new_full((r,), w0)
    out["kv_b_proj"] = weights["kv_b_proj"] * typical_rms
    return out


def _linear_norm(latent_sq_mean: torch.Tensor, plan: LayerPlan) -> tuple[float, float, float]:
    """(a, typical RMS, w0) for a latent with mean(c^2) = latent_sq_mean [N] per calibration token:
    a keeps a c in the norm's linear range, w0 = sqrt(eps) / (a * typical RMS) the uniform norm weight."""
    a = fz.linearize_norm_scale(float(latent_sq_mean.max()), plan.latent_eps, plan.rho)
    typical_rms = float(latent_sq_mean.mean().sqrt().clamp_min(1e-30))
    return a, typical_rms, plan.latent_eps ** 0.5 / (a * typical_rms)


def factorize_query(q_proj: torch.Tensor, flat_x: torch.Tensor, q_rank: int, plan: LayerPlan) -> dict:
    """Low-rank queries (DeepSeek's q_lora): q_proj ~= q_b_proj @ RMSNorm(q_a_proj x).

    Whitened SVD (minimises E||(W - W_r) x||^2 over the calibration inputs): W C^{1/2} = U S V^T,
    q_a = V_r^T C^{-1/2}, q_b = U_r S_r. q_a_layernorm is linearised like the KV latent (tiny scale,
    uniform weight) so the stock q_lora path computes the same product.
    """
    cov = flat_x.T @ flat_x / flat_x.shape[0]
    c_half, c_half_inv = fz.sym_sqrt(cov)
    u, s, vh = torch.linalg.svd(q_proj @ c_half, full_matrices=False)
    q_a = vh[:q_rank] @ c_half_inv
    q_b = u[:, :q_rank] * s[:q_rank]
    a, typical, w0 = _linear_norm((flat_x @ q_a.T).pow(2).mean(-1), plan)
    return {"q_a_proj": q_a * a, "q_a_layernorm": q_a.new_full((q_rank,), w0), "q_b_proj": q_b * typical}


def convert_layer(xn: torch.Tensor, w: dict, source: LlamaShape, target: MLAShape, plan: LayerPlan,
                  q_rank: int | None = None, refit_o_proj: bool = True, layer: int = 0) -> LayerResult:
    """DeepSeek MLA attention weights (float64, short names, on xn's device) for one source layer,
    and a report. Every input on one device (kvconvert mla --device).

    xn: [N, T, hidden] fp32 calibration inputs of the block (the layer's input RMSNorm applied);
    w: the source's q/k/v/o_proj in float64 (short names). report: the closed form's (see
    convert_attention), attn_rel_error = |A_mla(xn) - A_src(xn)| / |A_src(xn)| and, when the
    o_proj refit ran, attn_rel_error_refit after it."""
    flat = xn.reshape(-1, xn.shape[-1]).double()
    result = convert_attention(w, flat.T @ flat / flat.shape[0], flat.mean(0), source, plan)
    c = flat @ result.weights["kv_a_proj_with_mqa"][: plan.rank].T
    mla_w = finalize_latent_norm(result.weights, c.pow(2).mean(-1), plan)
    if q_rank is not None:
        mla_w.update(factorize_query(mla_w.pop("q_proj"), flat, q_rank, plan))
    y_src = llama.attention(xn, take(llama.LlamaAttention, _f32(w)), source)  # source block output
    report = dict(layer=layer, **result.report)
    report["attn_rel_error"] = _relative_error(xn, mla_w, target, y_src)
    if refit_o_proj:
        # least squares against the source block output, with the converted attention's own
        # probabilities and values (the most effective closed-form step)
        a = ds.attention_heads(xn, take(ds.MLAAttention, _f32(mla_w)), target).flatten(0, -2).double()
        y = y_src.reshape(-1, y_src.shape[-1]).double()
        mla_w["o_proj"] = fz.refit_o_proj(a.T @ a / a.shape[0], y.T @ a / a.shape[0], mla_w["o_proj"])
        report["attn_rel_error_refit"] = _relative_error(xn, mla_w, target, y_src)
    return LayerResult(mla_w, report)


_ATTENTION_KEYS = {f.name for cls in (llama.LlamaAttention, ds.MLAAttention) for f in fields(cls)}


def _f32(w: dict) -> dict:
    """The attention tensors of w in fp32 (the functional blocks' precision)."""
    return {k: v.float() for k, v in w.items() if k in _ATTENTION_KEYS}


def _relative_error(xn, mla_w: dict, target: MLAShape, y_src) -> float:
    y = ds.attention(xn, take(ds.MLAAttention, _f32(mla_w)), target)
    return float((y - y_src).norm() / y_src.norm().clamp_min(1e-30))
