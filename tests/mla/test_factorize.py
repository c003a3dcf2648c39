"""The conversion math against direct computation (float64, tight tolerances)."""

import pytest
import torch

from kvconvert.mla import factorize as fz
from kvconvert.models.common import Rope


def _random_psd(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(n, 2 * n, generator=g, dtype=torch.float64)
    return a @ a.T / (2 * n)


def _setup(G, H, d, rope, hidden=48, seed=0):
    g = torch.Generator().manual_seed(seed)
    w_k = torch.randn(G * d, hidden, generator=g, dtype=torch.float64)
    w_q = torch.randn(H * d, hidden, generator=g, dtype=torch.float64)
    cov = _random_psd(hidden, seed)
    basis = fz.rope_basis(w_k, cov, G, d, rope)
    return w_k, w_q, cov, basis, fz.rope_maps(basis, H, G, d)


@pytest.mark.parametrize("G,H,d,rope", [(1, 4, 16, 16), (2, 4, 16, 16), (3, 9, 16, 8), (4, 4, 32, 8)])
def test_rope_split_is_exact_without_rotation(G, H, d, rope):
    """At zero relative distance the rewrite is exact: q.k = q_rope.k_rope + q_nope.k_nope."""
    w_k, w_q, cov, basis, maps = _setup(G, H, d, rope)
    x = torch.randn(5, w_k.shape[1], dtype=torch.float64)
    k = (x @ w_k.T).view(5, G, d)
    q = (x @ w_q.T).view(5, H, d)
    k_rope = k.reshape(5, -1) @ maps.key_rope.T
    k_nope = k.reshape(5, -1) @ maps.key_nope.T
    for h in range(H):
        g = h // (H // G)
        direct = (q[:, h] * k[:, g]).sum(-1)
        rewritten = (q[:, h] @ maps.query_rope[h].T * k_rope).sum(-1) + (q[:, h] @ maps.query_nope[h].T * k_nope).sum(-1)
        torch.testing.assert_close(rewritten, direct, rtol=1e-10, atol=1e-10)


def test_bases_are_unitary_and_sorted():
    _, _, _, basis, _ = _setup(3, 9, 16, 8)
    for u, e in zip(basis.bases, basis.energy):
        torch.testing.assert_close(u.mH @ u, torch.eye(u.shape[0], dtype=u.dtype), rtol=0, atol=1e-10)
        assert e[0] >= e[1:].max() - 1e-9


def test_mqa_full_rope_is_exact_under_rotation():
    """One KV head and rope_dim = head_dim: every frequency keeps its rotation, scores are exact
    at any pair of positions (interleaved target layout vs rotate_half source layout)."""
    G, H, d = 1, 3, 16
    w_k, w_q, cov, basis, maps = _setup(G, H, d, d)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    x = torch.randn(7, w_k.shape[1], dtype=torch.float64)
    pos = torch.tensor([0, 3, 10, 31, 100, 511, 2047])
    source, target = Rope(inv_freq), Rope(inv_freq, interleaved=True)
    cos, sin = source.cos_sin(pos, torch.float64, torch.float64)
    k = source(x @ w_k.T, cos, sin)
    q_all = (x @ w_q.T).view(7, H, d)
    k_rope = target(x @ w_k.T @ maps.key_rope.T, cos, sin)
    for h in range(H):
        q = source(q_all[:, h], cos, sin)
        q_rope = target(q_all[:, h] @ maps.query_rope[h].T, cos, sin)
        torch.testing.assert_close(q_rope @ k_rope.T, q @ k.T, rtol=1e-9, atol=1e-9)


def test_freq_fold_groups():
    assert fz.rope_slot_groups(64, 64) == [[f] for f in range(32)]
    assert fz.rope_slot_groups(64, 32)[:2] == [[0, 1], [2, 3]]
    assert fz.rope_slot_groups(64, 16)[-1] == [28, 29, 30, 31]


@pytest.mark.parametrize("dy,hidden", [(20, 40), (60, 24)])
def test_weighted_latent_full_rank_is_exact(dy, hidden):
    """Both solver sides (output-side eig, input-side eig) reproduce w_y at full rank."""
    g = torch.Generator().manual_seed(1)
    w_y = torch.randn(dy, hidden, generator=g, dtype=torch.float64)
    cov = _random_psd(hidden, 1)
    metric = _random_psd(dy, 2) + 0.1 * torch.eye(dy, dtype=torch.float64)
    lat = fz.weighted_latent(w_y, cov, metric, min(dy, hidden))
    torch.testing.assert_close(lat.up @ lat.down, w_y, rtol=1e-7, atol=1e-7)


def test_weighted_latent_is_optimal_in_its_metric():
    """Truncated solution beats plain (unweighted) SVD truncation under the weighted error."""
    g = torch.Generator().manual_seed(2)
    dy, hidden, r = 24, 40, 6
    w_y = torch.randn(dy, hidden, generator=g, dtype=torch.float64)
    cov = _random_psd(hidden, 3)
    metric = torch.diag(torch.logspace(-3, 2, dy, dtype=torch.float64))
    lat = fz.weighted_latent(w_y, cov, metric, r)

    def err(approx):
        e = w_y - approx
        return torch.trace(metric @ e @ cov @ e.T)

    u, s, vh = torch.linalg.svd(w_y)
    plain = u[:, :r] @ torch.diag(s[:r]) @ vh[:r]
    assert err(lat.up @ lat.down) < 0.7 * err(plain)
    # and it equals the sum of the discarded eigenvalues of S C_Y S
    torch.testing.assert_close(err(lat.up @ lat.down), lat.energy[r:].sum(), rtol=1e-6, atol=1e-9)


def test_linearised_norm_matches_linear_map():
    """RMSNorm(a c) * w0 ~= w0 a c / sqrt(eps) with relative error <= rho/2 per token."""
    eps, rho = 1e-6, 3e-4
    c = torch.randn(100, 32, dtype=torch.float64) * torch.linspace(0.1, 5, 100, dtype=torch.float64)[:, None]
    a = fz.linearize_norm_scale(float(c.pow(2).mean(-1).max()), eps, rho)
    normed = (a * c) / torch.sqrt((a * c).pow(2).mean(-1, keepdim=True) + eps)
    linear = a * c / eps ** 0.5
    rel = ((normed - linear).norm(dim=-1) / linear.norm(dim=-1)).max()
    assert rel <= rho / 2 + 1e-12


def test_refit_o_proj_recovers_exact_map():
    g = torch.Generator().manual_seed(4)
    w_true = torch.randn(8, 12, generator=g, dtype=torch.float64)
    a = torch.randn(500, 12, generator=g, dtype=torch.float64)
    y = a @ w_true.T
    w = fz.refit_o_proj(a.T @ a / 500, y.T @ a / 500, torch.zeros(8, 12, dtype=torch.float64), ridge=1e-10)
    torch.testing.assert_close(w, w_true, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dy_over_hidden", [False, True])
def test_closed_form_stays_on_its_inputs_device(dy_over_hidden):
    """Every step of the closed form on meta tensors returns meta tensors: no helper (eye, zeros, index)
    is made on the CPU, which on a GPU (kvconvert mla --device cuda) would be a device mismatch."""
    G, H, d, rope, hidden = 2, 4, 16, 8, (24 if dy_over_hidden else 96)
    meta = dict(dtype=torch.float64, device="meta")
    w_q, w_k, w_v = (torch.empty(n * d, hidden, **meta) for n in (H, G, G))
    w_o, cov, mean = torch.empty(hidden, H * d, **meta), torch.empty(hidden, hidden, **meta), torch.empty(hidden, **meta)
    basis = fz.rope_basis(w_k, cov, G, d, rope)
    maps = fz.rope_maps(basis, H, G, d)
    metric = fz.attention_weights(w_q, w_v, w_o, maps, cov, mean, H, G, d, 0.3)
    w_y = torch.cat([maps.key_nope @ w_k, w_v])
    latent = fz.weighted_latent(w_y, cov, metric, 8)
    refit = fz.refit_o_proj(torch.empty(H * d, H * d, **meta), torch.empty(hidden, H * d, **meta), w_o)
    out = [*basis.bases, maps.key_rope, maps.query_nope, metric.key, *metric.values, latent.down, latent.up, refit]
    assert all(t.device.type == "meta" for t in out)
