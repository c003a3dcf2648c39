"""The fused, chunked distillation loss against plain autograd (kvconvert.heal.fused_loss).

Tolerances: float32 logits, loss and gradient to 1e-5 relative (the same float32 math in another
order); bfloat16 student logits, gradient to one bf16 rounding step (2^-8 relative of the largest
entry), since both round a float32 gradient to bf16 once."""

import pytest
import torch

from kvconvert.heal.fused_loss import (IGNORE, chunk_rows, fused_distill_loss, next_token_targets,
                                       reference_distill_loss)


def _case(batch, seq, vocab, seed=0, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, seq), generator=g)
    student = torch.randn(batch, seq, vocab, generator=g) * scale
    teacher = student + torch.randn(batch, seq, vocab, generator=g)
    return ids, student, teacher


def _loss_and_grad(fn, student, teacher, targets, **kw):
    z = student.detach().clone().requires_grad_(True)
    loss, parts = fn(z, teacher, targets, **kw)
    (loss * 0.5).backward()  # a non-unit upstream gradient, as grad_accum gives
    return loss.detach(), {k: v.detach() for k, v in parts.items()}, z.grad


def test_reference_kl_is_the_textbook_formula():
    torch.manual_seed(0)
    t, s = torch.randn(2, 3, 7), torch.randn(2, 3, 7)
    y = torch.full((2, 3), IGNORE)
    for tau in (1.0, 2.0):
        p, q = (t / tau).softmax(-1), (s / tau).softmax(-1)
        ref = tau ** 2 * (p * (p.log() - q.log())).sum(-1).mean()
        _, parts = reference_distill_loss(s, t, y, temperature=tau)
        assert torch.allclose(parts["kl"], ref, atol=1e-6)
    _, same = reference_distill_loss(t, t, y)
    assert float(same["kl"]) == 0.0


@pytest.mark.parametrize("shape", [(1, 5, 11), (2, 16, 64), (3, 33, 257)])
@pytest.mark.parametrize("tau, kl_w, lm_w", [(1.0, 1.0, 0.0), (2.0, 1.0, 0.0), (1.0, 0.0, 1.0), (1.5, 0.7, 0.3)])
@pytest.mark.parametrize("rows", [1, 7, None])
def test_fused_equals_reference_fp32(shape, tau, kl_w, lm_w, rows):
    ids, student, teacher = _case(*shape)
    targets = next_token_targets(ids)
    kw = dict(temperature=tau, kl_weight=kl_w, lm_weight=lm_w)
    ref_loss, ref_parts, ref_grad = _loss_and_grad(reference_distill_loss, student, teacher, targets, **kw)
    loss, parts, grad = _loss_and_grad(fused_distill_loss, student, teacher, targets, rows_per_chunk=rows, **kw)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    assert parts.keys() == ref_parts.keys()
    for k in parts:
        torch.testing.assert_close(parts[k], ref_parts[k], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-5, atol=1e-8)


def test_fused_equals_reference_bf16_student():
    ids, student, teacher = _case(2, 24, 512, seed=1)
    student, teacher = student.bfloat16(), teacher.bfloat16()
    targets = next_token_targets(ids)
    kw = dict(temperature=1.0, kl_weight=1.0, lm_weight=0.5)
    ref_loss, _, ref_grad = _loss_and_grad(reference_distill_loss, student, teacher, targets, **kw)
    loss, _, grad = _loss_and_grad(fused_distill_loss, student, teacher, targets, rows_per_chunk=5, **kw)
    assert grad.dtype == torch.bfloat16
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    step = 2.0 ** -8 * float(ref_grad.float().abs().max())
    assert float((grad.float() - ref_grad.float()).abs().max()) <= step


def test_only_the_student_gets_a_gradient_and_ignored_rows_get_none_from_ce():
    ids, student, teacher = _case(1, 6, 10)
    z = student.clone().requires_grad_(True)
    t = teacher.clone().requires_grad_(True)
    targets = torch.full_like(ids, IGNORE)  # no CE rows at all
    loss, parts = fused_distill_loss(z, t, targets, kl_weight=0.0, lm_weight=1.0)
    loss.backward()
    assert t.grad is None and float(parts["ce"]) == 0.0 and float(z.grad.abs().max()) == 0.0


def test_mismatched_positions_are_refused():
    ids, student, teacher = _case(1, 4, 8)
    with pytest.raises(ValueError, match="same positions"):
        fused_distill_loss(student, teacher[:, :3], next_token_targets(ids))


def test_next_token_targets_and_chunk_rows():
    ids = torch.tensor([[5, 6, 7]])
    assert next_token_targets(ids).tolist() == [[6, 7, IGNORE]]
    assert chunk_rows(49152) == 170 and chunk_rows(10 ** 9) == 1
