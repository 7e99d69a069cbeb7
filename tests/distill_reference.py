"""The float64 references of the distillation tests, written from the formulas, and the peers' own
formulas transcribed (as documented in their code) for the comparison in test_distill_loss.

Nothing here imports fnppo's divergence code: the full-vocabulary divergences are loops over tokens
with explicit sums over the vocabulary (float64 tensors, so that autograd gives the reference
gradient), the top-k ones loops over tokens too.
"""

from __future__ import annotations

import math

import torch


def kl_row(z: torch.Tensor, y: torch.Tensor, kind: str, floor: float) -> torch.Tensor:
    """One token's divergence from float64 logits rows ``z`` (student) and ``y`` (teacher), already
    divided by the temperature: explicit ``log sum exp`` and sums (no log_softmax)."""
    mz = z.detach().max()
    lp = z - (mz + torch.log(torch.exp(z - mz).sum()))
    finite = y[torch.isfinite(y)]
    if finite.numel() == 0:
        lq = torch.full_like(y, -math.inf)
    else:
        my = finite.max()
        lq = y - (my + torch.log(torch.exp(y - my).sum()))
    total = torch.zeros((), dtype=torch.float64)
    for j in range(z.shape[0]):
        if kind == "reverse_kl":
            p = torch.exp(lp[j])
            if float(p.detach()) > 0:
                total = total + p * (lp[j] - torch.clamp(lq[j], min=floor))
        else:
            q = math.exp(float(lq[j]))
            if q > 0:
                total = total + q * (lq[j] - lp[j])
    return total


def full_vocab_reference(x, u, labels, *, kind, temperature=1.0, vocab=None, floor=-100.0):
    """float64 ``(logprobs, entropy, divergence)`` per token of student logits ``x`` and teacher
    logits ``u`` (``[*tok, V]``, the first ``vocab`` columns real), as autograd-able tensors of ``x``."""
    v = x.shape[-1] if vocab is None else vocab
    xs = x.reshape(-1, x.shape[-1])
    us = u.reshape(-1, u.shape[-1]).double()
    lab = labels.reshape(-1)
    lps, ents, divs = [], [], []
    for t in range(xs.shape[0]):
        z = xs[t, :v] / temperature
        y = us[t, :v] / temperature
        m = z.detach().max()
        lse = m + torch.log(torch.exp(z - m).sum())
        lp = z - lse
        lps.append(lp[lab[t]])
        ents.append(-(torch.exp(lp) * lp).sum())
        divs.append(kl_row(z, y, kind, floor))
    shape = labels.shape
    return torch.stack(lps).view(shape), torch.stack(ents).view(shape), torch.stack(divs).view(shape)


def topk_reference(lp, lq, *, kind, tail, floor=-100.0):
    """float64 top-k divergence per token, a loop over tokens and the ``k`` entries (``lp`` carries
    the gradient). The tail bucket's log-masses: ``log(1 - sum e^lp)``, floored; empty tails at the floor."""
    lps = lp.reshape(-1, lp.shape[-1])
    lqs = lq.reshape(-1, lq.shape[-1]).double()
    out = []
    for t in range(lps.shape[0]):
        a = lps[t]
        b = torch.clamp(lqs[t], min=floor)
        if tail == "renormalize":
            a_hat = a - torch.log(torch.exp(a).sum())
            b_hat = b - torch.log(torch.exp(b).sum())
            pairs = [(a_hat[i], b_hat[i]) for i in range(a.shape[0])]
        else:
            pairs = [(a[i], b[i]) for i in range(a.shape[0])]
            rest_p = 1.0 - torch.exp(a).sum()
            rest_q = 1.0 - float(torch.exp(b).sum())
            lt = torch.log(rest_p) if float(rest_p) > 0 else torch.tensor(floor, dtype=torch.float64)
            lt = torch.clamp(lt, min=floor)
            lqt = max(math.log(rest_q), floor) if rest_q > 0 else floor
            pairs.append((lt, torch.tensor(lqt, dtype=torch.float64)))
        total = torch.zeros((), dtype=torch.float64)
        for s, q in pairs:
            if kind == "reverse_kl":
                total = total + torch.exp(s) * (s - q)
            else:
                total = total + torch.exp(q) * (q - s)
        out.append(total)
    return torch.stack(out).view(lp.shape[:-1])


# ---------------------------------------------------------------------------------------------
# The peers' formulas, transcribed from their code (per token, float64)
# ---------------------------------------------------------------------------------------------
NEMO_RL_LOG_INFINITESIMAL = -100.0


def nemo_rl_topk_kl(student_topk_lp, teacher_topk_lp, h_all, *, kl_type, zero_outside_topk):
    """NeMo-RL's ``DistillationLossFn`` (``nemo_rl/algorithms/loss_functions.py``) per token, from the
    student's full-vocabulary log-probs ``s`` at the teacher's top-k ids and the teacher's ``t``::

        forward:  sum_k e^t (t - s)
        reverse:  sum_k e^s (s - t)   [+ H_rest - log_infinitesimal * P_rest   with zero_outside_topk]

    ``H_rest = H_all - sum_k e^s s`` and ``P_rest = 1 - sum_k e^s`` as written there, with
    ``log_infinitesimal = -100``. ``h_all`` is passed as ``sum_v p_v log p_v`` over the whole
    vocabulary (the negative entropy): the reading under which the correction is the reverse KL's
    part outside the top-k with the teacher's log-prob there taken as ``log_infinitesimal``."""
    ps = student_topk_lp.exp()
    pt = teacher_topk_lp.exp()
    correction = torch.zeros_like(ps[..., 0])
    if zero_outside_topk and kl_type != "forward":
        h_rest = h_all - (ps * student_topk_lp).sum(-1)
        p_rest = 1 - ps.sum(-1)
        correction = h_rest - NEMO_RL_LOG_INFINITESIMAL * p_rest
    if kl_type == "forward":
        per = pt * (teacher_topk_lp - student_topk_lp)
    else:
        per = ps * (student_topk_lp - teacher_topk_lp)
    return per.sum(-1) + correction


def verl_forward_kl_topk(student_topk_lp, teacher_topk_lp):
    """verl's ``forward_kl_topk`` (truncated to the teacher's top-k, then ``clamp_min(0)``), as its
    tail-aware RFC (#7856) quotes it: ``sum_{i in T} q_i (log q_i - log p_i)``, clamped at 0."""
    q = teacher_topk_lp.exp()
    return (q * (teacher_topk_lp - student_topk_lp)).sum(-1).clamp_min(0.0)


def verl_forward_kl_topk_tail(student_topk_lp, teacher_topk_lp):
    """verl PR #7855's ``forward_kl_topk_tail``: the truncated sum plus the tail bucket
    ``q_tail log(q_tail / p_tail)`` with ``p_tail = 1 - P``, ``q_tail = 1 - Q`` (no clamp)."""
    q = teacher_topk_lp.exp()
    inside = (q * (teacher_topk_lp - student_topk_lp)).sum(-1)
    p_tail = 1 - student_topk_lp.exp().sum(-1)
    q_tail = 1 - q.sum(-1)
    return inside + q_tail * torch.log(q_tail / p_tail)
