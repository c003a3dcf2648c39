"""The math of MHA/GQA -> MLA conversion, as small pure functions on float64 matrices.

Conventions (source Llama layer): W_q [H*d, hidden], W_k/W_v [G*d, hidden], W_o [hidden, H*d];
query head h reads KV head g(h) = h // (H/G). Keys use transformers' rotate_half layout: frequency f
rotates the pair (k[f], k[f + d/2]), i.e. the complex number k_f = k[f] + i k[f + d/2] is multiplied
by exp(i theta_f pos).

Key facts used:
- Any complex-linear mix across KV heads of one frequency commutes with RoPE (both are complex
  multiplications), so keys can be rewritten per frequency in a new basis without any error.
  The principal component of each frequency (or of a group of F adjacent frequencies folded onto
  one rope slot) goes into the single shared RoPE key; the rest lose their rotation (the only
  approximation of the RoPE step) and join the NoPE keys.
Every function works on the device of its inputs and creates its helpers there (`kvconvert mla
--device cuda` runs them on a GPU, still in float64).

- The NoPE keys and all values are compressed into one latent c = A x by a weighted reduced-rank
  regression: minimise E||S (Y - B A x)||^2 with Y = [z_nope; v], S weighting key errors by the
  queries that read them and value errors by o_proj (what attention actually sees).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

Tensor = torch.Tensor


# ----------------------------------------------------------------------------- linear algebra
def sym_sqrt(m: Tensor, floor: float = 1e-8) -> tuple[Tensor, Tensor]:
    """(sqrt(M), pinv(sqrt(M))) of a symmetric PSD matrix, eigenvalues floored at floor*max."""
    vals, vecs = torch.linalg.eigh((m + m.T) / 2)
    vals = vals.clamp_min(vals.max().clamp_min(1e-300) * floor)
    root = vals.sqrt()
    return (vecs * root) @ vecs.T, (vecs / root) @ vecs.T


def top_eigh(m: Tensor) -> tuple[Tensor, Tensor]:
    """Eigenvalues (descending) and eigenvectors (columns) of a symmetric/Hermitian matrix."""
    vals, vecs = torch.linalg.eigh((m + m.mH) / 2)
    return vals.flip(0), vecs.flip(1)


# ----------------------------------------------------------------------------- RoPE step
def rope_slot_groups(head_dim: int, rope_dim: int) -> list[list[int]]:
    """Source frequencies folded onto each target rope slot.

    The target's rope head has rope_dim/2 slots with frequencies theta_j = base^(-2j/rope_dim)
    = source frequency F*j (F = head_dim/rope_dim). Slot j takes source frequencies
    F*j .. F*j + F - 1 (FreqFold); with F = 1 every frequency keeps its exact rotation.
    """
    half, slots = head_dim // 2, rope_dim // 2
    fold = half // slots
    return [list(range(j * fold, (j + 1) * fold)) for j in range(slots)]


@dataclass
class RopeBasis:
    """Per-slot complex bases. bases[j]: [G*F, G*F] unitary, columns = components, column 0 kept
    with RoPE. energy[j]: eigenvalues (key energy per component, descending)."""

    groups: list[list[int]]
    bases: list[Tensor]
    energy: list[Tensor]

    @property
    def kept_fraction(self) -> float:
        total = sum(float(e.sum()) for e in self.energy)
        return sum(float(e[0]) for e in self.energy) / max(total, 1e-300)


def complex_keys(w_k: Tensor, kv_heads: int) -> Tensor:
    """[G, d/2, hidden] complex weights: k_f = W[f] x + i W[f + d/2] x per KV head."""
    w = w_k.view(kv_heads, -1, w_k.shape[-1])
    half = w.shape[1] // 2
    return torch.complex(w[:, :half], w[:, half:])


def rope_basis(w_k: Tensor, cov_x: Tensor, kv_heads: int, head_dim: int, rope_dim: int) -> RopeBasis:
    """Complex PCA of the pre-RoPE keys, per rope slot (phase-aware: complex scalings commute with RoPE).
    (Weighting it by the query energy that reads each frequency measured worse on SmolLM2: ppl 128 vs
    125 at rank 64 + rope 32.)"""
    kc = complex_keys(w_k, kv_heads)  # [G, half, hidden]
    cov_c = cov_x.to(kc.dtype)
    groups = rope_slot_groups(head_dim, rope_dim)
    bases, energy = [], []
    for freqs in groups:
        rows = kc[:, freqs, :].reshape(kv_heads * len(freqs), -1)  # order (g, t)
        cov = rows @ cov_c @ rows.mH  # E[k k^H], [GF, GF]
        vecs = top_eigh(cov)[1]
        bases.append(vecs)
        energy.append(torch.einsum("im,ij,jm->m", vecs.conj(), cov, vecs).real)
    return RopeBasis(groups, bases, energy)


@dataclass
class RopeMaps:
    """Real linear maps built from a RopeBasis.

    key_rope  [R, G*d]:     pre-RoPE keys (all KV heads, concatenated) -> shared rope key (interleaved pairs)
    key_nope  [Dn, G*d]:    pre-RoPE keys -> NoPE key features (shared by all heads)
    query_rope [H, R, d]:   head's pre-RoPE query -> its rope query (interleaved pairs)
    query_nope [H, Dn, d]:  head's query -> NoPE query features; score_nope = q'_h . z_nope
    """

    key_rope: Tensor
    key_nope: Tensor
    query_rope: Tensor
    query_nope: Tensor


def _component_rows(u: Tensor, freqs: list[int], kv_heads: int, head_dim: int) -> Tensor:
    """Real rows [GF, 2, G, d]: (Re, Im) of every component z_m = sum_{g,t} conj(U[(g,t), m]) k_{g,f_t}
    as linear functions of the concatenated pre-RoPE keys (rotate_half layout per head).
    (a k with a = ar + i ai, k = kr + i ki: Re = ar kr - ai ki, Im = ai kr + ar ki.)"""
    F, half = len(freqs), head_dim // 2
    coef = u.conj().T.reshape(-1, kv_heads, F)  # a[m, g, t]
    rows = torch.zeros(coef.shape[0], 2, kv_heads, head_dim, dtype=coef.real.dtype, device=u.device)
    re_idx = torch.tensor(freqs, device=u.device)
    im_idx = re_idx + half
    rows[:, 0, :, re_idx] = coef.real
    rows[:, 0, :, im_idx] = -coef.imag
    rows[:, 1, :, re_idx] = coef.imag
    rows[:, 1, :, im_idx] = coef.real
    return rows


def rope_maps(basis: RopeBasis, heads: int, kv_heads: int, head_dim: int) -> RopeMaps:
    """Build the real maps. A query head's component rows are the key rows restricted to its KV
    head: q'_m = sum_t conj(U[(g(h),t), m]) q_{h,f_t} uses the same coefficients."""
    group, d = heads // kv_heads, head_dim
    rope, nope = [], []
    for freqs, u in zip(basis.groups, basis.bases):
        rows = _component_rows(u, freqs, kv_heads, d)
        rope.append(rows[0])  # [2, G, d]: interleaved (Re, Im) of the kept component
        nope.append(rows[1:].reshape(-1, kv_heads, d))
    key_rope = torch.cat(rope).reshape(-1, kv_heads, d)  # [R, G, d]
    key_nope = torch.cat(nope)  # [Dn, G, d]
    head_kv = torch.arange(heads, device=key_rope.device) // group
    return RopeMaps(
        key_rope=key_rope.reshape(key_rope.shape[0], kv_heads * d),
        key_nope=key_nope.reshape(key_nope.shape[0], kv_heads * d),
        query_rope=key_rope[:, head_kv].permute(1, 0, 2).contiguous(),
        query_nope=key_nope[:, head_kv].permute(1, 0, 2).contiguous(),
    )


# ----------------------------------------------------------------------------- latent step
@dataclass
class Latent:
    """c = down @ x (rank r); Y ~= up @ c for Y = [z_nope; v_0; ...; v_{G-1}].
    energy: weighted output energy per component (descending), for the report."""

    down: Tensor  # [r, hidden]
    up: Tensor  # [Dn + G*d, r]
    energy: Tensor  # [Dn + G*d]


@dataclass
class BlockMetric:
    """Block-diagonal metric S^T S: one NoPE-key block [Dn, Dn] and one value block [d, d] per KV head
    (kept as blocks: the dense matrix is 0.5 GB for an MHA 7B layer)."""

    key: Tensor
    values: list[Tensor]

    def dense(self) -> Tensor:
        return torch.block_diag(self.key, *self.values)

    def gram(self, w_y: Tensor) -> Tensor:
        """w_y^T metric w_y [hidden, hidden], block by block."""
        dn = self.key.shape[0]
        out = w_y[:dn].T @ self.key @ w_y[:dn] if dn else w_y.new_zeros(w_y.shape[1], w_y.shape[1])
        start = dn
        for block in self.values:
            part = w_y[start: start + block.shape[0]]
            out += part.T @ block @ part
            start += block.shape[0]
        return out


def attention_weights(w_q: Tensor, w_v: Tensor, w_o: Tensor, maps: RopeMaps, cov_x: Tensor, mean_x: Tensor,
                      heads: int, kv_heads: int, head_dim: int, key_weight: float) -> BlockMetric:
    """The metric S^T S of the latent objective, block-diagonal over [z_nope; v_0; ...; v_{G-1}].

    Value block g: sum_{h in g} W_o,h^T W_o,h, the value error seen through o_proj.
    Key block: a score error ds moves head h's output by about sum_n p_n ds_n W_o,h (v_n - mean v),
    so it is weighted by lambda_h = E||W_o,h (v - E v)||^2 (the head's output spread) times the
    covariance of the softmax-scaled NoPE queries that read the shared NoPE keys:
    key_weight * sum_h lambda_h QN_h (W_q,h C_x W_q,h^T) QN_h^T / head_dim. Both blocks are then in
    units of output error; key_weight 0.3 measured best on SmolLM2.
    """
    d, group = head_dim, heads // kv_heads
    dn = maps.key_nope.shape[0]
    key = cov_x.new_zeros(dn, dn)
    values = [cov_x.new_zeros(d, d) for _ in range(kv_heads)]
    wq = w_q.view(heads, d, -1)
    wv = w_v.view(kv_heads, d, -1)
    wo = w_o.view(w_o.shape[0], heads, d)
    centered = cov_x - torch.outer(mean_x, mean_x)
    for h in range(heads):
        g = h // group
        o_h = wo[:, h]  # [hidden, d]
        gram_o = o_h.T @ o_h
        if dn:
            spread = torch.trace(gram_o @ wv[g] @ centered @ wv[g].T)
            q_cov = wq[h] @ cov_x @ wq[h].T  # [d, d]: cheap, then lift to the NoPE space
            key += key_weight * spread * (maps.query_nope[h] @ q_cov @ maps.query_nope[h].T) / d
        values[g] += gram_o
    return BlockMetric(key, values)


def weighted_latent(w_y: Tensor, cov_x: Tensor, metric: "Tensor | BlockMetric", rank: int) -> Latent:
    """Reduced-rank regression: minimise E||S (w_y x - up down x)||^2 with S^T S = metric.

    Output side (Dy <= hidden): top-r eigenvectors U_r of S C_Y S^T (C_Y = w_y C_x w_y^T),
    down = U_r^T S w_y, up = S^+ U_r. Input side (Dy > hidden, e.g. MHA 7B): eigenvectors V_r of
    C^{1/2} w_y^T metric w_y C^{1/2}, down = sigma^-1 V_r^T C^{1/2} w_y^T metric w_y,
    up = w_y C^{1/2} V_r sigma^-1 (no square root of the big metric needed). Both give the same
    product up @ down; at full rank it equals w_y on the data's span.
    """
    dy, hidden = w_y.shape
    if dy <= hidden:
        s, s_inv = sym_sqrt(metric.dense() if isinstance(metric, BlockMetric) else metric)
        vals, vecs = top_eigh(s @ (w_y @ cov_x @ w_y.T) @ s)
        u_r = vecs[:, :rank]
        return Latent(down=u_r.T @ s @ w_y, up=s_inv @ u_r, energy=vals.clamp_min(0))
    c_half = sym_sqrt(cov_x)[0]  # drop the inverse root at once: 7B, 134 MB at the peak
    gram = metric.gram(w_y) if isinstance(metric, BlockMetric) else w_y.T @ metric @ w_y  # [hidden, hidden]
    vals, vecs = top_eigh(c_half @ gram @ c_half)
    sigma = vals[:rank].clamp_min(vals[0] * 1e-12).sqrt()
    v_r = vecs[:, :rank]
    down = (v_r / sigma).T @ c_half @ gram
    up = w_y @ c_half @ (v_r / sigma)
    return Latent(down=down, up=up, energy=vals.clamp_min(0))


def linearize_norm_scale(latent_sq_mean_max: float, eps: float, rho: float) -> float:
    """Scale a for the latent so mean(c^2) <= rho * eps on every calibration token.

    Then RMSNorm(a c) = a c / sqrt(eps) * (1 - mean(a^2 c^2) / (2 eps) + ...): linear up to a
    relative error <= rho / 2 per token, absorbed into kv_b_proj.
    """
    return (rho * eps / max(latent_sq_mean_max, 1e-300)) ** 0.5


def refit_o_proj(attn_out_cov: Tensor, cross: Tensor, w_o_init: Tensor, ridge: float = 1e-4) -> Tensor:
    """Least-squares o_proj: argmin_W E||W a - y||^2 + lam ||W - W0||^2.

    attn_out_cov = E[a a^T] [Din, Din] (converted attention outputs, all heads concatenated),
    cross = E[y a^T] [hidden, Din] (source attention block output y). lam = ridge * mean diag.
    """
    lam = ridge * attn_out_cov.diagonal().mean()
    eye = torch.eye(attn_out_cov.shape[0], dtype=attn_out_cov.dtype, device=attn_out_cov.device)
    rhs = cross + lam * w_o_init
    return torch.linalg.solve(attn_out_cov + lam * eye, rhs.T).T
