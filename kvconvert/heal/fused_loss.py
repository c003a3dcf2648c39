"""Distillation loss over the vocabulary, fused and chunked: KL(teacher || student) and CE in one pass.

The plain loss (`reference_distill_loss`, kept as the reference) materializes several float32
[N, V] tensors (both log-softmaxes, the teacher probabilities, their product) and autograd keeps
most of them alive for the backward: with N = 8 x 2048 tokens and SmolLM2's V = 49152 each one is
3.2 GB. Here the gradient with respect to the student logits is computed in closed form during
the forward, one chunk of rows at a time in float32, and stored once in the logits' own dtype:

    d/dz_s [tau^2 KL(softmax(z_t/tau) || softmax(z_s/tau))] = tau (softmax(z_s/tau) - softmax(z_t/tau))
    d/dz_s [CE(z_s, y)]                                      = softmax(z_s) - onehot(y)

The backward only scales that stored gradient by the incoming one. Peak memory is one [N, V]
gradient in the student dtype plus a few float32 [chunk, V] temporaries.

Shapes: student_logits, teacher_logits [N, V] (any float dtype; rows are positions); targets [N]
int64 next-token ids, IGNORE where a position has no next token. Means: KL over all N rows, CE over
the rows whose target is not IGNORE (what F.cross_entropy(..., ignore_index=IGNORE) does).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE = -100
# float32 bytes of one [chunk, V] temporary: 32 MiB (170 rows of a 49K vocabulary) keeps the ~4 live
# temporaries small next to the [N, V] gradient while each chunk is still a large operation.
CHUNK_BYTES = 32 * 2 ** 20


def chunk_rows(vocab: int, chunk_bytes: int = CHUNK_BYTES) -> int:
    """Rows per chunk so that one float32 [rows, vocab] temporary is about chunk_bytes."""
    return max(1, chunk_bytes // (4 * vocab))


def _chunk_loss_and_grad(zs: torch.Tensor, zt: torch.Tensor, y: torch.Tensor, tau: float, kl_scale: float,
                         ce_scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One chunk in float32: (sum of KL rows, sum of CE rows, gradient [rows, V]).

    kl_scale multiplies tau * (q_s - p_t) (kl_weight / N), ce_scale (softmax - onehot) (lm_weight / N_valid)."""
    # in place where possible: three float32 [rows, V] buffers live at once (log_p, p, log_q)
    if tau != 1.0:  # x / 1.0 == x exactly: no [rows, V] copies for the usual temperature
        zt, zs_tau = zt / tau, zs / tau
    else:
        zs_tau = zs
    log_p = F.log_softmax(zt, dim=-1)
    p = log_p.exp()
    log_q = F.log_softmax(zs_tau, dim=-1)
    kl_sum = log_p.sub_(log_q).mul_(p).sum()  # torch's blocked sum: BLAS dot drifts ~1e-5 over 8M terms
    q = log_q.exp_()
    grad = q.sub(p).mul_(kl_scale * tau)
    ce_sum = zs.new_zeros(())
    valid = y != IGNORE
    if ce_scale and bool(valid.any()):
        q1 = q if tau == 1.0 else torch.softmax(zs, dim=-1)
        rows = valid.nonzero().squeeze(1)
        lse = torch.logsumexp(zs[rows], dim=-1)
        ce_sum = (lse - zs[rows, y[rows]]).sum()
        g_ce = q1[rows]
        g_ce[torch.arange(rows.numel(), device=zs.device), y[rows]] -= 1.0
        grad[rows] += ce_scale * g_ce
    return kl_sum, ce_sum, grad


class _FusedDistillLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, student_logits, teacher_logits, targets, tau, kl_weight, lm_weight, rows_per_chunk):
        n = student_logits.shape[0]
        n_valid = int((targets != IGNORE).sum())
        kl_scale = kl_weight / n
        ce_scale = lm_weight / n_valid if lm_weight and n_valid else 0.0
        grad = torch.empty_like(student_logits)
        kl_sum = ce_sum = student_logits.new_zeros((), dtype=torch.float32)
        with torch.no_grad():
            for a in range(0, n, rows_per_chunk):
                b = min(n, a + rows_per_chunk)
                kl, ce, g = _chunk_loss_and_grad(student_logits[a:b].float(), teacher_logits[a:b].float(),
                                                 targets[a:b], tau, kl_scale, ce_scale)
                kl_sum, ce_sum = kl_sum + kl, ce_sum + ce
                grad[a:b] = g  # rounded once, to the logits' dtype (what autograd would hand them)
        ctx.save_for_backward(grad)
        kl_mean = kl_sum * tau ** 2 / n
        ce_mean = ce_sum / n_valid if n_valid else ce_sum
        loss = kl_weight * kl_mean + (lm_weight * ce_mean if lm_weight else 0.0)
        ctx.mark_non_differentiable(kl_mean, ce_mean)
        return loss, kl_mean, ce_mean

    @staticmethod
    def backward(ctx, grad_loss, _grad_kl, _grad_ce):
        (grad,) = ctx.saved_tensors
        # in place: a second [N, V] copy would double the loss's memory (this graph is used once)
        if float(grad_loss) != 1.0:
            grad.mul_(grad_loss.to(grad.dtype))
        return grad, None, None, None, None, None, None


def fused_distill_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, targets: torch.Tensor,
                       temperature: float = 1.0, kl_weight: float = 1.0, lm_weight: float = 0.0,
                       rows_per_chunk: int | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """kl_weight * tau^2 * mean KL(p_t || p_s) + lm_weight * mean CE(z_s, targets), and its parts.

    Logits [..., V] are flattened to rows; targets [...] (IGNORE = no next token). Only the student
    logits get a gradient. Returns (loss, {"kl": ..., "ce": ...}) with the parts detached; a part whose
    weight is 0 is left out."""
    vocab = student_logits.shape[-1]
    zs, zt = student_logits.reshape(-1, vocab), teacher_logits.reshape(-1, vocab).detach()
    y = targets.reshape(-1)
    if zt.shape != zs.shape or y.shape[0] != zs.shape[0]:
        raise ValueError(f"student {tuple(student_logits.shape)}, teacher {tuple(teacher_logits.shape)} and "
                         f"targets {tuple(targets.shape)} do not describe the same positions")
    rows = rows_per_chunk or chunk_rows(vocab)
    loss, kl, ce = _FusedDistillLoss.apply(zs, zt, y, float(temperature), float(kl_weight), float(lm_weight), rows)
    parts = {**({"kl": kl} if kl_weight else {}), **({"ce": ce} if lm_weight else {})}
    return loss, parts


def next_token_targets(ids: torch.Tensor) -> torch.Tensor:
    """[B, T] ids -> [B, T] targets: position t predicts ids[t + 1]; the last position has none."""
    return torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], IGNORE)], dim=1)


def reference_distill_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, targets: torch.Tensor,
                           temperature: float = 1.0, kl_weight: float = 1.0,
                           lm_weight: float = 0.0) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The same loss with plain autograd (float32 [N, V] temporaries): the fused loss's reference."""
    vocab = student_logits.shape[-1]
    zs, zt = student_logits.reshape(-1, vocab).float(), teacher_logits.reshape(-1, vocab).float()
    log_p = F.log_softmax(zt / temperature, dim=-1)
    log_q = F.log_softmax(zs / temperature, dim=-1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1).mean() * temperature ** 2
    ce = F.cross_entropy(zs, targets.reshape(-1), ignore_index=IGNORE)
    loss = kl_weight * kl + (lm_weight * ce if lm_weight else 0.0)
    parts = {**({"kl": kl.detach()} if kl_weight else {}), **({"ce": ce.detach()} if lm_weight else {})}
    return loss, parts
