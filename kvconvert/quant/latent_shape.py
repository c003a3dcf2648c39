"""Latent shaping for MLA caches: a non-orthogonal transform of the latent, folded into the weights.

Why it is exact. kvconvert's conversions keep kv_a_layernorm in its linear range (kvconvert.mla:
mean(c^2) <= rho * eps on every calibration token), so the cached latent is w * c / sqrt(eps) up to a
relative error of mean(c^2) / (2 eps). Any invertible T then folds exactly:
``kv_a[:rank] <- T kv_a[:rank]`` and ``kv_b <- kv_b diag(w) T^-1`` (norm weight -> 1). An orthogonal R
(rotate.py's Hadamard) is the special case that needs no linear range.

Why it helps a quantized cache. A 4-bit block format (and FP8's floating point) rounds each value with
an error proportional to the magnitudes it is stored among. If the latent has covariance Sigma with
eigenvalues l_i and an error e costs ||e||^2 (kvconvert's conversions build the latent in a basis where
the attention-weighted error is isotropic: mla.factorize.weighted_latent), storing the latent as is
costs about sum(l_i) per unit of relative noise. Storing Q Sigma^-1/4 c instead, Q a dense random
orthogonal matrix that evens the energy over all values and blocks, gives every stored value the
variance mean(sqrt(l)) and costs (sum sqrt(l_i))^2 / rank after the inverse map: by Cauchy-Schwarz
never more, and much less for a steep spectrum (the classical optimal bit allocation, rate-distortion
with one noise level). ``power`` p generalizes Sigma^-1/4 to Sigma^-p (0: orthogonal Q only).

The transform is normalized so that tr(T Sigma T^T) = tr(Sigma): the latent's mean energy, and so the
norm's linear range, is kept on average.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvconvert.errors import KVConvertError

# mean(c^2) / eps above this on a calibration token: the latent norm is not linear enough for a
# non-orthogonal fold (relative error mean(c^2) / (2 eps) = 0.5% at the limit; conversions write 3e-4).
LINEAR_NORM_LIMIT = 1e-2


@dataclass
class LatentMoments:
    """Pre-norm latent statistics of one layer: sum of c c^T (float64 [rank, rank]), token count, and the
    largest mean(c^2) / eps over the tokens (how far the norm is from its linear range)."""

    gram: torch.Tensor
    tokens: int = 0
    max_norm_ratio: float = 0.0

    @classmethod
    def empty(cls, rank: int) -> "LatentMoments":
        return cls(torch.zeros(rank, rank, dtype=torch.float64))

    def add(self, latent: torch.Tensor, eps: float) -> None:
        """latent: [..., rank] pre-norm outputs of kv_a_proj_with_mqa (the first rank values)."""
        c = latent.reshape(-1, latent.shape[-1]).double().cpu()
        self.gram += c.T @ c
        self.tokens += c.shape[0]
        if c.shape[0]:
            self.max_norm_ratio = max(self.max_norm_ratio, float((c * c).mean(-1).max()) / eps)

    @property
    def covariance(self) -> torch.Tensor:
        return self.gram / max(self.tokens, 1)


def norm_is_linear(moments: LatentMoments) -> bool:
    return moments.max_norm_ratio <= LINEAR_NORM_LIMIT


def check_linear_norm(moments: LatentMoments, layer: int) -> None:
    """Refuse shaping when the layer's latent norm leaves its linear range (the fold would not be exact)."""
    if not norm_is_linear(moments):
        raise KVConvertError(
            f"--latent-shaping needs kv_a_layernorm in its linear range (mean(c^2)/eps <= {LINEAR_NORM_LIMIT} on "
            f"every calibration token), but layer {layer} reaches {moments.max_norm_ratio:.3g}: the fold would "
            "change the model. Checkpoints written by `kvconvert mla` are in range; for this one use --latent-shaping 0")


def random_orthogonal(dim: int, seed: int) -> torch.Tensor:
    """A dense orthogonal [dim, dim] float64 matrix (QR of a seeded Gaussian, signs fixed)."""
    g = torch.Generator().manual_seed(seed)
    q, r = torch.linalg.qr(torch.randn(dim, dim, generator=g, dtype=torch.float64))
    return q * torch.sign(torch.diagonal(r))[None, :]


def shaping_transform(covariance: torch.Tensor, power: float, seed: int = 0) -> torch.Tensor:
    """T = Q Sigma^-power, scaled so tr(T Sigma T^T) = tr(Sigma). covariance: [rank, rank]; float64 out.

    Eigenvalues below 1e-8 of the largest are floored there (a latent direction the data never uses)."""
    sigma = covariance.double()
    vals, vecs = torch.linalg.eigh(sigma)
    vals = vals.clamp_min(float(vals.max()) * 1e-8)
    shape = (vecs * vals.pow(-power)) @ vecs.T
    t = random_orthogonal(sigma.shape[0], seed) @ shape
    return t * (torch.trace(sigma) / torch.trace(t @ sigma @ t.T)).sqrt()


def predicted_noise_ratio(covariance: torch.Tensor, transform: torch.Tensor) -> float:
    """Relative-noise model of the module docstring: the isotropic error a quantized cache adds, after
    the transform and back, over the same without it. Each stored value's error is taken proportional to
    the stored energy spread evenly over the values; 1.0 = no change, lower = less noise."""
    sigma = covariance.double()
    t = transform.double()
    t_inv = torch.linalg.inv(t)
    stored = torch.trace(t @ sigma @ t.T) / sigma.shape[0]  # per-value energy after the dense mix
    return float(stored * torch.trace(t_inv.T @ t_inv) / torch.trace(sigma))
