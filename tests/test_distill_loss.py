"""Tests of the objective's terms (fnppo.core.losses.distill, terms, objective): the top-k divergences
and every term against float64 loops, their edges, the normalizers over micro-batches, the peers'
formulas, and the refusals of the parts."""

from __future__ import annotations

import math

import pytest
import torch

from fnppo.core.losses import Aggregation, KLPenalty, LossConfig, ppo_clip
from fnppo.core.losses.distill import ForwardKL, ReverseKL, TopK, topk_divergence
from fnppo.core.losses.objective import local_normalizers, terms_loss
from fnppo.core.losses.terms import CrossEntropy, RefKL
from fnppo.core.ops.divergence import logprob_entropy_and_divergence
from tests.distill_reference import (
    nemo_rl_topk_kl,
    topk_reference,
    verl_forward_kl_topk,
    verl_forward_kl_topk_tail,
)
from tests.messages import raises_message

KINDS = ("reverse_kl", "forward_kl")
TAILS = ("bucket", "renormalize")


def _topk_problem(seed=0, n=12, v=30, k=5):
    """Student and teacher full distributions and the teacher's top-k ids and log-probs (sorted)."""
    g = torch.Generator().manual_seed(seed)
    zs = torch.randn(n, v, generator=g, dtype=torch.float64) * 2
    zt = torch.randn(n, v, generator=g, dtype=torch.float64) * 2
    lq_full = torch.log_softmax(zt, -1)
    lq, ids = lq_full.topk(k, dim=-1)
    return zs, ids, lq


def _student_topk(zs, ids):
    return torch.log_softmax(zs, -1).gather(-1, ids)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("tail", TAILS)
def test_topk_divergence_and_gradient_match_a_float64_loop(kind, tail):
    zs, ids, lq = _topk_problem()
    a = _student_topk(zs, ids).detach().requires_grad_()
    got, mass_s, mass_t = topk_divergence(a, lq, kind=kind, tail=tail)
    g = torch.randn(got.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    (got * g).sum().backward()
    b = a.detach().clone().requires_grad_()
    ref = topk_reference(b, lq, kind=kind, tail=tail)
    (ref * g).sum().backward()
    torch.testing.assert_close(got, ref.detach(), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(a.grad, b.grad, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(mass_s, a.detach().exp().sum(-1))
    torch.testing.assert_close(mass_t, lq.exp().sum(-1))
    assert float(got.min()) >= -1e-12  # a divergence, never negative


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("tail", TAILS)
def test_topk_edges_are_finite_and_match_the_reference(kind, tail):
    """A teacher log-prob of -inf, one of -60 where the student has mass, ties at the boundary, a
    top-k holding the whole vocabulary (no tail), a student with all its mass in the top-k."""
    zs, ids, lq = _topk_problem(seed=2, n=6, v=8, k=4)
    lq = lq.clone()
    lq[0, 3] = -math.inf  # a token the teacher never produces
    lq[1, 1:] = -60.0  # e^-60 where the student has mass
    lq[2, 2] = lq[2, 3] = lq[2, 1]  # ties at the boundary
    zs = zs.clone()
    zs[1, ids[1, 2]] = 8.0
    full_ids = torch.argsort(zs[3], descending=True)
    ids = ids.clone()
    lp = _student_topk(zs, ids)
    lp_full = torch.log_softmax(zs[3:4], -1)[:, full_ids]  # k = V: the tail holds nothing
    lq_full = torch.log_softmax(torch.randn(1, 8, dtype=torch.float64), -1).sort(descending=True).values
    cases = [(lp, lq), (lp_full, lq_full)]
    zs5 = zs.clone()
    zs5[4] = -30.0
    zs5[4, ids[4]] = 30.0  # the student's whole mass in the top-k (in fp64 its tail rounds to 0)
    cases.append((_student_topk(zs5, ids)[4:5], lq[4:5]))
    for a0, q in cases:
        a = a0.detach().requires_grad_()
        got, _, _ = topk_divergence(a, q, kind=kind, tail=tail)
        got.sum().backward()
        assert bool(torch.isfinite(got).all()) and bool(torch.isfinite(a.grad).all()), (got, a.grad)
        b = a0.detach().requires_grad_()
        ref = topk_reference(b, q, kind=kind, tail=tail)
        torch.testing.assert_close(got, ref.detach(), rtol=1e-9, atol=1e-9)


def test_topk_tail_bucket_penalizes_shrinking_the_topk_mass_and_truncation_does_not():
    """verl's note (PR #5041): the truncated top-k reverse KL is made small by shrinking the student's
    own top-k mass. Shrinking it lowers the truncated sum; the tail bucket rises."""
    lq = torch.log(torch.tensor([[0.25, 0.15, 0.1]], dtype=torch.float64))  # the teacher: mass 0.5 in S
    lp = lq + math.log(1.6)  # the student: mass 0.8 in S, a positive truncated KL
    shrunk = lp - 3.0  # the same top-k shape with e^-3 of the mass; the rest went to the tail
    truncated = [(torch.exp(x) * (x - lq)).sum() for x in (lp, shrunk)]
    bucket = [topk_divergence(x, lq, kind="reverse_kl", tail="bucket")[0].sum() for x in (lp, shrunk)]
    assert float(truncated[1]) < float(truncated[0])
    assert float(bucket[1]) > float(bucket[0])


def test_peer_nemo_rl_topk_reverse_kl_with_zero_outside_topk_is_our_floored_full_reverse_kl():
    """NeMo-RL's top-k reverse KL with ``zero_outside_topk`` (its log_infinitesimal -100) is the full
    reverse KL with the teacher's log-prob -100 outside the top-k: our full-vocabulary reverse KL of
    a teacher whose logits are -inf outside the top-k, with our floor -100."""
    zs, ids, lq = _topk_problem(seed=4, n=10, v=30, k=6)
    lq = lq - torch.logsumexp(lq, -1, keepdim=True)  # the teacher renormalized over its top-k
    teacher_logits = torch.full_like(zs, -math.inf).scatter(-1, ids, lq)
    lp_full = torch.log_softmax(zs, -1)
    h_all = (lp_full.exp() * lp_full).sum(-1)
    peer = nemo_rl_topk_kl(lp_full.gather(-1, ids), lq, h_all, kl_type="reverse", zero_outside_topk=True)
    labels = torch.zeros(10, dtype=torch.int64)
    _, _, ours = logprob_entropy_and_divergence(zs.float(), labels, teacher_logits=teacher_logits.float())
    torch.testing.assert_close(ours.double(), peer, rtol=2e-6, atol=2e-5)


def test_peer_truncated_topk_kls_are_our_tail_bucket_minus_the_tail_term():
    """NeMo-RL's truncated top-k KLs (no zero_outside_topk) and verl's ``forward_kl_topk`` are our tail
    bucket without the tail term (verl clamps at 0); verl's ``forward_kl_topk_tail`` (PR #7855) is our
    forward tail bucket."""
    zs, ids, lq = _topk_problem(seed=5, n=16, v=30, k=4)
    lp = _student_topk(zs, ids)
    p_tail, q_tail = 1 - lp.exp().sum(-1), 1 - lq.exp().sum(-1)
    for kind, peer_kind in (("reverse_kl", "reverse"), ("forward_kl", "forward")):
        ours, _, _ = topk_divergence(lp, lq, kind=kind, tail="bucket")
        tail_term = p_tail * torch.log(p_tail / q_tail) if kind == "reverse_kl" else q_tail * torch.log(q_tail / p_tail)
        nemo = nemo_rl_topk_kl(lp, lq, None, kl_type=peer_kind, zero_outside_topk=False)
        torch.testing.assert_close(nemo + tail_term, ours, rtol=1e-10, atol=1e-12)
    ours_fwd, _, _ = topk_divergence(lp, lq, kind="forward_kl", tail="bucket")
    torch.testing.assert_close(verl_forward_kl_topk_tail(lp, lq), ours_fwd, rtol=1e-10, atol=1e-12)
    fwd_tail = q_tail * torch.log(q_tail / p_tail)
    torch.testing.assert_close(verl_forward_kl_topk(lp, lq), (ours_fwd - fwd_tail).clamp_min(0.0))


# ---------------------------------------------------------------------------------------------
# terms_loss: every term against a loop, the normalizers, the split, the masked edges
# ---------------------------------------------------------------------------------------------
def _batch(seed=0, b=4, s=7, k=3, v=12):
    g = torch.Generator().manual_seed(seed)
    zs = torch.randn(b, s, v, generator=g, dtype=torch.float64) * 1.5
    lp_full = torch.log_softmax(zs, -1)
    labels = torch.randint(0, v, (b, s), generator=g)
    lq, ids = torch.log_softmax(torch.randn(b, s, v, generator=g, dtype=torch.float64), -1).topk(k, dim=-1)
    mask = (torch.rand(b, s, generator=g) > 0.3).double()
    mask[3] = 0.0  # a sequence without trained tokens
    ce_mask = (torch.rand(b, s, generator=g) > 0.5).double()
    ref = lp_full.gather(-1, labels[..., None])[..., 0].detach() + 0.3 * torch.randn(
        b, s, generator=g, dtype=torch.float64
    )
    div = torch.rand(b, s, generator=g, dtype=torch.float64)
    return dict(zs=zs, labels=labels, ids=ids, lq=lq, mask=mask, ce_mask=ce_mask, ref=ref, div=div)


def _loop_term(values, mask, mode):
    """``sum_t a_t l_t / N`` by loops: token-mean, or seq-mean-token-mean over rows."""
    if mode == "token-mean":
        num = sum(float(values[i, j]) for i in range(mask.shape[0]) for j in range(mask.shape[1]) if mask[i, j])
        den = float(mask.sum())
        return num / den if den else 0.0
    total, seqs = 0.0, 0
    for i in range(mask.shape[0]):
        tok = [float(values[i, j]) for j in range(mask.shape[1]) if mask[i, j]]
        if tok:
            total += sum(tok) / len(tok)
            seqs += 1
    return total / seqs if seqs else 0.0


def test_terms_loss_matches_loops_with_own_and_shared_normalizers():
    d = _batch()
    lp_full = torch.log_softmax(d["zs"], -1)
    lp = lp_full.gather(-1, d["labels"][..., None])[..., 0]
    stk = lp_full.gather(-1, d["ids"])
    cfg = LossConfig(
        policy=ppo_clip(),
        agg=Aggregation("seq-mean-token-mean"),
        distill=ReverseKL(coef=0.7, teacher=TopK("bucket")),
        ce=CrossEntropy(coef=0.2, normalizer="shared"),
        ref_kl=RefKL(coef=0.05, estimator="k3", agg=Aggregation("seq-mean-token-mean")),
    )
    loss, metrics = terms_loss(
        lp, d["mask"], cfg, student_topk=stk, teacher_topk=d["lq"], ce_mask=d["ce_mask"], ref_logprobs=d["ref"]
    )
    kl_rows = topk_reference(stk, d["lq"], kind="reverse_kl", tail="bucket")
    distill = _loop_term(kl_rows, d["mask"], "token-mean")
    # shared: LossConfig.agg (seq-mean-token-mean) over the CE tokens, divided by the policy's sequence count
    shared_den = sum(1 for i in range(4) if d["mask"][i].sum() > 0)
    ce_num = 0.0
    for i in range(4):
        tok = [-float(lp[i, j]) for j in range(7) if d["ce_mask"][i, j]]
        ce_num += sum(tok) / len(tok) if tok else 0.0
    ce = ce_num / shared_den
    r = d["ref"]
    k3 = (torch.exp(r - lp) - 1) - (r - lp)  # Schulman: (ratio - 1) - log ratio, ratio = pi_ref / pi
    ref_kl = _loop_term(k3, d["mask"], "seq-mean-token-mean")
    expected = 0.7 * distill + 0.2 * ce + 0.05 * ref_kl
    assert abs(float(loss) - expected) < 1e-10
    for key, value in (("distill_loss", distill), ("ce_loss", ce), ("ref_kl_loss", ref_kl)):
        pair = metrics[key]
        assert abs(float(pair[0] / pair[1]) - value) < 1e-5, key


def test_terms_over_microbatches_with_the_step_normalizers_equal_the_full_batch():
    d = _batch(seed=1)
    lp_full = torch.log_softmax(d["zs"], -1).requires_grad_()
    cfg = LossConfig(
        policy=None,
        distill=ForwardKL(coef=1.0, teacher=TopK("renormalize"), agg=Aggregation("seq-mean-token-mean")),
        ce=CrossEntropy(coef=0.5),
    )

    def run(rows):
        lp = lp_full[rows].gather(-1, d["labels"][rows][..., None])[..., 0]
        return lp, lp_full[rows].gather(-1, d["ids"][rows])

    def call(rows, normalizers):
        lp, stk = run(rows)
        return terms_loss(
            lp,
            d["mask"][rows],
            cfg,
            student_topk=stk,
            teacher_topk=d["lq"][rows],
            ce_mask=d["ce_mask"][rows],
            normalizers=normalizers,
        )[0]

    full = call(slice(None), None)
    (g_full,) = torch.autograd.grad(full, lp_full)
    parts = [slice(0, 1), slice(1, 3), slice(3, 4)]
    locals_ = [local_normalizers(cfg, d["mask"][p], ce_mask=d["ce_mask"][p]) for p in parts]
    sums = {k: sum(n[k] for n in locals_) for k in locals_[0]}
    split = sum(call(p, sums) for p in parts)
    (g_split,) = torch.autograd.grad(split, lp_full)
    torch.testing.assert_close(split, full, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(g_split, g_full, rtol=1e-12, atol=1e-12)


def test_an_all_masked_microbatch_gives_zero_loss_and_zero_gradient_even_with_nan_off_the_mask():
    d = _batch(seed=2)
    lp_full = torch.log_softmax(d["zs"], -1).requires_grad_()
    lp = lp_full.gather(-1, d["labels"][..., None])[..., 0]
    stk = lp_full.gather(-1, d["ids"])
    teacher = torch.full_like(d["lq"], math.nan)
    ref = torch.full_like(d["ref"], math.inf)
    cfg = LossConfig(policy=None, distill=ReverseKL(), ref_kl=RefKL(0.1))
    zero = torch.zeros_like(d["mask"])
    loss, metrics = terms_loss(
        lp,
        zero,
        cfg,
        student_topk=stk,
        teacher_topk=teacher,
        ref_logprobs=ref,
        normalizers={"shared": 0.0, "distill": 0.0, "ref_kl": 0.0},
    )
    (grad,) = torch.autograd.grad(loss, lp_full)
    assert float(loss) == 0.0 and float(grad.abs().max()) == 0.0
    assert all(bool(torch.isfinite(m).all()) for m in metrics.values())


def test_a_full_vocabulary_teacher_reads_the_divergence():
    d = _batch(seed=3)
    lp = torch.log_softmax(d["zs"], -1).gather(-1, d["labels"][..., None])[..., 0]

    class Full(TopK):  # a full-vocabulary signal (what fnppo.steps.TeacherModel is)
        full_vocabulary = True

    cfg = LossConfig(policy=None, distill=ReverseKL(coef=2.0, teacher=Full()))
    loss, _ = terms_loss(lp, d["mask"], cfg, divergence=d["div"])
    assert abs(float(loss) - 2.0 * _loop_term(d["div"], d["mask"], "token-mean")) < 1e-12
    with raises_message("terms_loss", "divergence", "a tensor", "None"):
        terms_loss(lp, d["mask"], cfg)


# ---------------------------------------------------------------------------------------------
# Refusals of the parts and the config
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("coef", [-1.0, math.nan, math.inf, True, "1"])
@pytest.mark.parametrize("part", [ReverseKL, ForwardKL, CrossEntropy, RefKL])
def test_term_weights_that_are_negative_nan_or_not_numbers_are_refused(part, coef):
    with raises_message(f"fnppo.losses.{part.__name__}", "coef", "a finite number >= 0", repr(coef)):
        part(coef=coef)


def test_bad_term_settings_are_refused_by_name():
    with raises_message("fnppo.losses.TopK", "tail", "one of", "'clip'"):
        TopK(tail="clip")
    with raises_message("fnppo.losses.ReverseKL", "normalizer", "one of", "'global'"):
        ReverseKL(normalizer="global")
    with raises_message("fnppo.losses.CrossEntropy", "agg", "None with normalizer='shared'", "Aggregation"):
        CrossEntropy(agg=Aggregation(), normalizer="shared")
    with raises_message("fnppo.losses.ReverseKL", "teacher", "a TeacherSignal", "'vllm'"):
        ReverseKL(teacher="vllm")
    with raises_message("fnppo.losses.ReverseKL", "logprob_floor", "<= 0", "5.0"):
        ReverseKL(logprob_floor=5.0)
    with raises_message("fnppo.losses.RefKL", "estimator", "one of", "'k9'"):
        RefKL(0.1, estimator="k9")


def test_loss_config_rules_across_terms():
    with raises_message("fnppo.losses.LossConfig", "policy", "None together with a term", "None"):
        LossConfig(policy=None)
    with raises_message("fnppo.losses.LossConfig", "entropy_coef", "0 with policy=None", "0.01"):
        LossConfig(policy=None, distill=ReverseKL(), entropy_coef=0.01)
    with raises_message("fnppo.losses.LossConfig", "kl", "None with policy=None", "KLPenalty"):
        LossConfig(policy=None, distill=ReverseKL(), kl=KLPenalty(0.1))
    with raises_message("fnppo.losses.LossConfig", "kl", "one KL to the reference", "KLPenalty"):
        LossConfig(kl=KLPenalty(0.1), ref_kl=RefKL(0.1))
    with raises_message("fnppo.losses.LossConfig", "distill", "a ReverseKL or ForwardKL", "CrossEntropy"):
        LossConfig(distill=CrossEntropy())
    with raises_message("fnppo.losses.LossConfig", "bypass_old_logprobs", "False with policy=None", "True"):
        LossConfig(policy=None, ce=CrossEntropy(), bypass_old_logprobs=True)
    cfg = LossConfig(policy=None, distill=ReverseKL(), ce=CrossEntropy(0.1))  # pure distillation + SFT: accepted
    assert cfg.policy is None and cfg.distill.kind == "reverse_kl"
