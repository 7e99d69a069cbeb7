"""Tests of fnppo.core.ops.divergence: the student's log-probs, entropy and a divergence to a teacher
(or the student's log-probs at top-k ids) in one autograd function, against float64 loops."""

from __future__ import annotations

import math

import pytest
import torch

from fnppo.core.errors import ShapeError
from fnppo.core.ops.divergence import logprob_entropy_and_divergence, logprob_entropy_and_topk
from fnppo.testing import LiveBytes
from tests.distill_reference import full_vocab_reference
from tests.messages import raises_message

KINDS = ("reverse_kl", "forward_kl")


def _problem(seed=0, lead=(2, 5), v=23, scale=2.5, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(*lead, v, generator=g) * scale).to(dtype)
    u = (torch.randn(*lead, v, generator=g) * scale).to(dtype)
    labels = torch.randint(0, v, lead, generator=g)
    grads = [torch.randn(*lead, generator=g, dtype=torch.float64) for _ in range(3)]
    return x, u, labels, grads


def _ours(x, labels, grads, **kw):
    xg = x.detach().clone().requires_grad_()
    lp, ent, div = logprob_entropy_and_divergence(xg, labels, **kw)
    ((lp * grads[0]).sum() + (ent * grads[1]).sum() + (div * grads[2]).sum()).backward()
    return lp, ent, div, xg.grad


def _reference(x, u, labels, grads, kind, temperature=1.0, vocab=None, floor=-100.0):
    xr = x.detach().double().requires_grad_()
    lp, ent, div = full_vocab_reference(xr, u, labels, kind=kind, temperature=temperature, vocab=vocab, floor=floor)
    ((lp * grads[0]).sum() + (ent * grads[1]).sum() + (div * grads[2]).sum()).backward()
    return lp.detach(), ent.detach(), div.detach(), xr.grad


def _close(got, ref, rtol=2e-5, atol=2e-6):
    torch.testing.assert_close(got.double(), ref.double(), rtol=rtol, atol=atol)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_values_and_gradient_match_a_float64_loop(kind, temperature):
    x, u, labels, grads = _problem()
    lp, ent, div, grad = _ours(x, labels, grads, teacher_logits=u, kind=kind, temperature=temperature, chunk_tokens=3)
    r = _reference(x, u, labels, grads, kind, temperature)
    for got, ref in zip((lp, ent, div, grad), r, strict=True):
        _close(got, ref)
    assert float(div.detach().min()) >= 0


@pytest.mark.parametrize("kind", KINDS)
def test_teacher_as_hidden_states_and_output_weight_is_the_same_divergence(kind):
    g = torch.Generator().manual_seed(3)
    x, _, labels, grads = _problem(seed=3)
    hidden = torch.randn(2, 5, 7, generator=g)
    weight = torch.randn(23, 7, generator=g)
    u = hidden @ weight.T
    got = _ours(x, labels, grads, teacher_hidden=hidden, teacher_weight=weight, kind=kind, chunk_tokens=4)
    for a, b in zip(got, _reference(x, u, labels, grads, kind), strict=True):
        _close(a, b)


@pytest.mark.parametrize("kind", KINDS)
def test_padded_vocabulary_columns_are_left_out(kind):
    x, u, labels, grads = _problem(v=24)
    labels = labels % 20
    x = x.clone()
    x[..., 20:] = 50.0  # padding columns that would dominate the softmax if read
    lp, ent, div, grad = _ours(x, labels, grads, teacher_logits=u, kind=kind, vocab_size=20)
    r = _reference(x, u, labels, grads, kind, vocab=20)
    for got, ref in zip((lp, ent, div, grad[..., :20]), r[:3] + (r[3][..., :20],), strict=True):
        _close(got, ref)
    assert float(grad[..., 20:].abs().max()) == 0.0


def test_inputs_are_never_written_and_the_teacher_gets_no_gradient():
    x, u, labels, grads = _problem()
    xg = x.clone().requires_grad_()
    ug = u.clone().requires_grad_()
    before_x, before_u, versions = x.clone(), u.clone(), (xg._version, ug._version)
    lp, ent, div = logprob_entropy_and_divergence(xg, labels, teacher_logits=ug)
    (lp.sum() + ent.sum() + div.sum()).backward()
    assert torch.equal(xg.detach(), before_x) and torch.equal(ug.detach(), before_u)
    assert (xg._version, ug._version) == versions
    assert ug.grad is None and xg.grad is not None


def test_backward_creates_one_logits_sized_buffer():
    """The forward creates no [tokens, vocab] tensor beyond fp32 chunks of 1/8 of the logits; the
    backward one gradient of the logits' size plus chunk temporaries."""
    g = torch.Generator().manual_seed(4)
    n, v = 4096, 320  # 5 MiB of fp32 logits; the chunks (1/8 of them, at least 1 MiB) stay well below
    x = torch.randn(n, v, generator=g).requires_grad_()
    u = torch.randn(n, v, generator=g)
    labels = torch.randint(0, v, (n,), generator=g)
    logits_bytes = n * v * 4
    with LiveBytes() as fwd:
        lp, ent, div = logprob_entropy_and_divergence(x, labels, teacher_logits=u)
        loss = lp.sum() + ent.sum() + div.sum()
    assert fwd.peak <= 0.6 * logits_bytes, fwd.peak / logits_bytes
    with LiveBytes() as bwd:
        (grad,) = torch.autograd.grad(loss, x)
    assert grad.shape == x.shape
    assert bwd.peak <= 1.6 * logits_bytes, bwd.peak / logits_bytes


@pytest.mark.parametrize("kind", KINDS)
def test_teacher_minus_inf_and_tiny_log_probs_give_finite_values_and_gradients(kind):
    """A teacher logit of -inf (a token it never produces) and one ~e^-60 below the rest where the
    student has mass: finite values and gradients, equal to the float64 loop with the floor."""
    x, u, labels, grads = _problem(seed=5)
    u = u.clone()
    u[0, 0, 3] = -math.inf
    u[0, 1, :] = -60.0
    u[0, 1, 4] = 0.0  # every other token ~e^-60 below token 4
    x = x.clone()
    x[0, 0, 3] = 6.0  # the student puts most of its mass where the teacher has none
    x[0, 1, 7] = 6.0
    lp, ent, div, grad = _ours(x, labels, grads, teacher_logits=u, kind=kind)
    assert bool(torch.isfinite(div).all()) and bool(torch.isfinite(grad).all())
    r = _reference(x, u, labels, grads, kind)
    _close(div, r[2], rtol=3e-5)
    _close(grad, r[3], rtol=3e-5, atol=1e-5)
    if kind == "reverse_kl":  # token 3 costs p_3 (lp_3 + 100): the floor, not infinity
        p3 = float(torch.softmax(x[0, 0].double(), -1)[3])
        assert p3 * (math.log(p3) + 100) - 5 < float(div[0, 0]) < p3 * (math.log(p3) + 100) + 5


def test_a_teacher_row_without_any_finite_logit_is_floored():
    x, u, labels, grads = _problem(seed=6)
    u = u.clone()
    u[1, 2, :] = -math.inf
    lp, ent, div, grad = _ours(x, labels, grads, teacher_logits=u, kind="reverse_kl")
    p = torch.softmax(x[1, 2].double(), -1)
    expected = float((p * (torch.log(p) + 100.0)).sum())
    assert abs(float(div[1, 2]) - expected) < 1e-4
    _, _, fwd, fgrad = _ours(x, labels, grads, teacher_logits=u, kind="forward_kl")
    assert float(fwd[1, 2]) == 0.0 and bool(torch.isfinite(fgrad).all())


def test_topk_logprobs_and_gradient_match_float64():
    g = torch.Generator().manual_seed(7)
    x, _, labels, grads = _problem(seed=7)
    ids = torch.stack([torch.randperm(23, generator=g)[:4] for _ in range(10)]).view(2, 5, 4)
    gk = torch.randn(2, 5, 4, generator=g, dtype=torch.float64)
    xg = x.clone().requires_grad_()
    lp, ent, tk = logprob_entropy_and_topk(xg, labels, ids, temperature=0.8, chunk_tokens=3)
    ((lp * grads[0]).sum() + (ent * grads[1]).sum() + (tk * gk).sum()).backward()
    xr = x.double().requires_grad_()
    ref = torch.log_softmax(xr / 0.8, -1)
    rlp = ref.gather(-1, labels[..., None])[..., 0]
    rent = -(ref.exp() * ref).sum(-1)
    rtk = ref.gather(-1, ids)
    ((rlp * grads[0]).sum() + (rent * grads[1]).sum() + (rtk * gk).sum()).backward()
    for a, b in ((lp, rlp), (ent, rent), (tk, rtk), (xg.grad, xr.grad)):
        _close(a, b.detach())


def test_bad_arguments_are_refused_by_name():
    x, u, labels, _ = _problem()
    with raises_message("logprob_entropy_and_divergence", "teacher_logits", "exactly one teacher", "None"):
        logprob_entropy_and_divergence(x, labels)
    with raises_message("logprob_entropy_and_divergence", "kind", "one of", "'jsd'"):
        logprob_entropy_and_divergence(x, labels, teacher_logits=u, kind="jsd")
    for floor in (1.0, math.nan, math.inf, True):
        with raises_message("logprob_entropy_and_divergence", "logprob_floor", "<= 0", repr(floor)):
            logprob_entropy_and_divergence(x, labels, teacher_logits=u, logprob_floor=floor)
    with raises_message("logprob_entropy_and_divergence", "logprob_floor", "float | int", "'low'", exc=ShapeError):
        logprob_entropy_and_divergence(x, labels, teacher_logits=u, logprob_floor="low")
    ids = torch.full((2, 5, 3), 23)
    with raises_message("logprob_entropy_and_topk", "labels", "token ids in [0, 23)", "23"):
        logprob_entropy_and_topk(x, labels, ids)
