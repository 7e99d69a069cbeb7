"""The fp64 reference of the log-prob tests (test_logprob, test_linear_logprob): log_softmax and
autograd in float64, and the gradient tolerance of "the exact gradient rounded to the dtype"."""

from __future__ import annotations

import torch


def fp64_logprob_entropy(x, labels, temperature, g_lp=None, g_h=None):
    """``(logprobs, entropy, L)`` of float64 logits ``x`` at ``temperature``, with
    ``L = sum(g_lp * logprobs) + sum(g_h * entropy)`` (a term left out when its weight is None)."""
    logp = (x / temperature).log_softmax(-1)
    lp = logp.gather(-1, labels.long().unsqueeze(-1)).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1)
    loss = torch.zeros((), dtype=torch.float64)
    if g_lp is not None:
        loss = loss + (lp * g_lp.double()).sum()
    if g_h is not None:
        loss = loss + (ent * g_h.double()).sum()
    return lp, ent, loss


def assert_grad_close(grad, ref, dtype, scale=1.0):
    """``grad`` is the exact gradient ``ref`` rounded to ``dtype``: allow that rounding plus fp32 error."""
    assert grad.dtype == dtype and grad.shape == ref.shape
    eps = {torch.float32: 2e-6, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float64: 2e-6}[dtype]
    tol = eps * ref.abs() + 1e-6 * scale * max(1.0, ref.abs().max().item())
    err = (grad.double() - ref).abs()
    assert bool((err <= tol).all()), f"max err {err.max().item():.3g} (max |ref| {ref.abs().max().item():.3g})"
