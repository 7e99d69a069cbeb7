"""Tests of fnppo.core.ops.linear_distill.linear_logprob_entropy_and_divergence against an fp64
reference written from the formulas (both models' full logits materialized in float64), gradcheck,
the edge cases it documents, tensor parallelism (TP=2 on gloo ranks), the Triton kernels in Triton's
CPU interpreter, and its refusals."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from fnppo.core.errors import InputError, ShapeError
from fnppo.core.ops.linear_distill import TEACHER_LOGIT_FLOOR, linear_logprob_entropy_and_divergence
from fnppo.core.ops.linear_logprob import linear_logprob_and_entropy
from fnppo.core.typing import typechecking
from tests.logprob_reference import assert_grad_close
from tests.messages import check_message

REPO = Path(__file__).resolve().parents[1]
KINDS = ("reverse_kl", "forward_kl")
FN = "linear_logprob_entropy_and_divergence"


# ---------------------------------------------------------------------------------------------
# The independent reference: both models' logits in float64, log_softmax, the KL sums, autograd.
# ---------------------------------------------------------------------------------------------
def reference(h, w, labels, ht, wt, kind, t=1.0, tt=None, vocab_size=None, floor=TEACHER_LOGIT_FLOOR, grads=None):
    """fp64 ``(logprobs, entropy, divergence, dL/dh, dL/dW)``, ``L = sum(g_lp lp + g_h H + g_d D)``.

    ``z_t`` is raised to ``floor`` and its non-finite values replaced by it (the documented rule)."""
    hr = h.detach().double().requires_grad_()
    wr = w.detach().double().requires_grad_()
    zs = (hr @ wr.t()) / t
    zt = (ht.detach().double() @ wt.detach().double().t()) / (t if tt is None else tt)
    if vocab_size is not None:
        zs, zt = zs[..., :vocab_size], zt[..., :vocab_size]
    zt = torch.where(torch.isfinite(zt), zt, torch.full_like(zt, floor)).clamp(min=floor)
    ls, lt = zs.log_softmax(-1), zt.log_softmax(-1)
    ps, pt = ls.exp(), lt.exp()
    lp = ls.gather(-1, labels.long().unsqueeze(-1)).squeeze(-1)
    ent = -(ps * ls).sum(-1)
    div = (ps * (ls - lt)).sum(-1) if kind == "reverse_kl" else (pt * (lt - ls)).sum(-1)
    if grads is None:
        return lp.detach(), ent.detach(), div.detach(), None, None
    loss = sum((x * gx.double()).sum() for x, gx in zip((lp, ent, div), grads) if gx is not None)
    dh, dw = torch.autograd.grad(loss, (hr, wr))
    return lp.detach(), ent.detach(), div.detach(), dh, dw


def run_ours(h, w, labels, ht, wt, grads, **kw):
    hg, wg = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    lp, ent, div = linear_logprob_entropy_and_divergence(hg, wg, labels, ht, wt, **kw)
    loss = sum((x * gx).sum() for x, gx in zip((lp, ent, div), grads) if gx is not None and x is not None)
    loss.backward()
    return lp, ent, div, hg.grad, wg.grad


def problem(lead=(3, 7), hidden=12, teacher_hidden=20, vocab=53, dtype=torch.float32, seed=1, std=3.0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(*lead, hidden, generator=g).to(dtype)
    w = (torch.randn(vocab, hidden, generator=g) * std / hidden**0.5).to(dtype)
    ht = torch.randn(*lead, teacher_hidden, generator=g).to(dtype)
    wt = (torch.randn(vocab, teacher_hidden, generator=g) * std / teacher_hidden**0.5).to(dtype)
    labels = torch.randint(0, vocab, lead, generator=g)
    grads = tuple(torch.randn(*lead, generator=g) for _ in range(3))
    return h, w, labels, ht, wt, grads


def assert_values(got, ref, scale_tol=2e-6):
    """fp32 values equal the fp64 ones to ~1e-6 of their scale (the logits' rounding)."""
    assert got.dtype == torch.float32 and bool(torch.isfinite(got).all())
    err = (got.double() - ref).abs().max().item()
    assert err <= scale_tol * max(1.0, ref.abs().max().item()), f"max err {err:.3g} (max |ref| {ref.abs().max():.3g})"


def check_all(out, ref, dtype=torch.float32):
    lp, ent, div, dh, dw = out
    rlp, rent, rdiv, rdh, rdw = ref
    assert_values(lp, rlp)
    if ent is not None:
        assert_values(ent, rent)
    assert_values(div, rdiv)
    assert_grad_close(dh, rdh, dtype)
    assert_grad_close(dw, rdw, dtype)


# ---------------------------------------------------------------------------------------------
# Values and gradients
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(("t", "tt"), [(1.0, None), (0.6, 1.7), (2.5, 0.8)])
def test_values_and_grads_match_fp64(kind, t, tt):
    h, w, labels, ht, wt, grads = problem(seed=2)
    out = run_ours(h, w, labels, ht, wt, grads, kind=kind, temperature=t, teacher_temperature=tt, chunk_vocab=7)
    check_all(out, reference(h, w, labels, ht, wt, kind, t, tt, grads=grads))
    assert out[2].abs().max() > 0.1  # the distributions differ: a real divergence was checked


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_inputs_give_the_exact_gradient_rounded(kind, dtype):
    h, w, labels, ht, wt, grads = problem(dtype=dtype, seed=3)
    out = run_ours(h, w, labels, ht, wt, grads, kind=kind, temperature=0.8, chunk_vocab=9, chunk_tokens=4)
    check_all(out, reference(h, w, labels, ht, wt, kind, 0.8, grads=grads), dtype)


def test_teacher_of_another_dtype():
    """A bf16 or fp64 teacher beside an fp32 student (each pair of hidden states and weight one dtype)."""
    h, w, labels, ht, wt, grads = problem(seed=18)
    for dtype in (torch.bfloat16, torch.float64):
        ht2, wt2 = ht.to(dtype), wt.to(dtype)
        for kind in KINDS:
            out = run_ours(h, w, labels, ht2, wt2, grads, kind=kind, chunk_vocab=11)
            check_all(out, reference(h, w, labels, ht2, wt2, kind, grads=grads))


@pytest.mark.parametrize("kind", KINDS)
def test_gradcheck_float64(kind):
    """torch.autograd.gradcheck on fp64 inputs. The outputs are fp32 statistics by contract (~1e-7
    relative), so the finite differences take steps of 1e-2 (truncation ~1e-5 here) and a tolerance of 1e-3."""
    h, w, labels, ht, wt, _ = problem(lead=(4,), hidden=5, teacher_hidden=7, vocab=11, dtype=torch.float64, seed=4)
    labels = labels % 9  # vocab_size=9: rows 9, 10 are padding
    hg, wg = h.clone().requires_grad_(), w.clone().requires_grad_()

    def fn(hh, ww):
        return linear_logprob_entropy_and_divergence(
            hh, ww, labels, ht, wt, kind=kind, temperature=0.7, teacher_temperature=1.3, vocab_size=9, chunk_vocab=4
        )

    assert torch.autograd.gradcheck(fn, (hg, wg), eps=1e-2, atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("kind", KINDS)
def test_padded_vocabulary_and_odd_chunks(kind):
    """Rows at or beyond vocab_size never enter either softmax (even NaN or huge ones) and get a zero gradient."""
    h, w, labels, ht, wt, grads = problem(lead=(13,), vocab=64, seed=5)
    w, wt = w.clone(), wt.clone()
    w[53:] = 50.0
    wt[53:57] = float("nan")
    wt[57:] = float("inf")
    labels = labels % 53
    ref = reference(h, w, labels, ht, wt, kind, 0.9, vocab_size=53, grads=grads)
    for ct, cv in ((1, 1), (5, 7), (13, 53), (None, None), (4, 100)):
        out = run_ours(
            h, w, labels, ht, wt, grads, kind=kind, temperature=0.9, vocab_size=53, chunk_tokens=ct, chunk_vocab=cv
        )
        check_all(out, ref)
        assert bool((out[4][53:] == 0).all())


def test_logprobs_and_entropy_equal_the_student_head():
    """The first two outputs (and their gradients) are linear_logprob_and_entropy's, whatever the teacher."""
    h, w, labels, ht, wt, (g_lp, g_h, _) = problem(seed=6)
    for kind in KINDS:
        ours = run_ours(h, w, labels, ht, wt, (g_lp, g_h, None), kind=kind, temperature=1.3, chunk_vocab=10)
        hg, wg = h.clone().requires_grad_(), w.clone().requires_grad_()
        lp, ent = linear_logprob_and_entropy(hg, wg, labels, temperature=1.3, chunk_vocab=10)
        ((lp * g_lp).sum() + (ent * g_h).sum()).backward()
        for a, b in zip(ours[:2] + ours[3:], (lp, ent, hg.grad, wg.grad)):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kind", KINDS)
def test_each_output_alone_and_without_entropy(kind):
    h, w, labels, ht, wt, grads = problem(seed=7)
    for keep in range(3):  # only one output reaches the loss
        one = tuple(g if i == keep else None for i, g in enumerate(grads))
        check_all(
            run_ours(h, w, labels, ht, wt, one, kind=kind, chunk_vocab=8),
            reference(h, w, labels, ht, wt, kind, grads=one),
        )
    out = run_ours(h, w, labels, ht, wt, grads, kind=kind, with_entropy=False, chunk_vocab=8)
    assert out[1] is None
    no_ent = (grads[0], None, grads[2])
    check_all(out, reference(h, w, labels, ht, wt, kind, grads=no_ent))


def test_temperatures_equal_scaled_weights():
    """T scales the student's logits, T_t the teacher's: the same as dividing the weights."""
    h, w, labels, ht, wt, _ = problem(seed=8)
    for kind in KINDS:
        a = linear_logprob_entropy_and_divergence(
            h, w, labels, ht, wt, kind=kind, temperature=0.5, teacher_temperature=2.0
        )
        b = linear_logprob_entropy_and_divergence(h, w / 0.5, labels, ht, wt / 2.0, kind=kind)
        c = linear_logprob_entropy_and_divergence(h, w, labels, ht, wt * 2.0, kind=kind, temperature=2.0)  # T_t = T
        d = linear_logprob_entropy_and_divergence(
            h, w, labels, ht, wt, kind=kind, temperature=2.0, teacher_temperature=1.0
        )
        for x, y in zip(a, b):
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)
        for x, y in zip(c, d):
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)


def test_gradient_only_for_inputs_that_need_it_and_leading_dims():
    h, w, labels, ht, wt, grads = problem(lead=(2, 3, 4), seed=9)
    wg = w.clone().requires_grad_()
    lp, ent, div = linear_logprob_entropy_and_divergence(h, wg, labels, ht, wt)  # hidden without grad
    ((lp * grads[0]).sum() + (ent * grads[1]).sum() + (div * grads[2]).sum()).backward()
    assert_grad_close(wg.grad, reference(h, w, labels, ht, wt, "reverse_kl", grads=grads)[4], torch.float32)
    flat = linear_logprob_entropy_and_divergence(h.reshape(-1, 12), w, labels.reshape(-1), ht.reshape(-1, 20), wt)
    for x, y in zip((lp, ent, div), flat):
        torch.testing.assert_close(x.detach().reshape(-1), y, rtol=0, atol=1e-6)
    # transposed (non-contiguous) hidden states of both models
    tr = linear_logprob_entropy_and_divergence(h.transpose(0, 1), w, labels.transpose(0, 1), ht.transpose(0, 1), wt)
    torch.testing.assert_close(tr[2], div.detach().transpose(0, 1), rtol=0, atol=1e-6)
    hg = h[:0].clone().requires_grad_()
    out = linear_logprob_entropy_and_divergence(hg, w, labels[:0], ht[:0], wt)
    assert [tuple(o.shape) for o in out] == [(0, 3, 4)] * 3
    sum(o.sum() for o in out).backward()
    assert hg.grad.shape == hg.shape


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_inputs_never_written(dtype):
    g = torch.Generator().manual_seed(10)
    base = torch.randn(4, 5, 16, generator=g, requires_grad=True)
    hidden = (base * 2.0).to(dtype)  # a non-leaf, like a model's output
    weight = torch.randn(30, 16, generator=g).to(dtype).requires_grad_()
    labels = torch.randint(0, 30, (4, 5), generator=g)
    ht, wt = torch.randn(4, 5, 24, generator=g).to(dtype), torch.randn(30, 24, generator=g).to(dtype)
    ht[0, 0] = float("nan")  # a token whose teacher has no finite logit: the floor path too
    inputs = (hidden, weight, labels, ht, wt)
    before = [x.detach().clone() for x in inputs]
    versions = [x._version for x in inputs]
    for kind in KINDS:
        lp, ent, div = linear_logprob_entropy_and_divergence(hidden, weight, labels, ht, wt, kind=kind, chunk_vocab=8)
        (lp.sum() + 0.1 * ent.sum() + div.sum()).backward(retain_graph=True)
    assert [x._version for x in inputs] == versions
    assert all(torch.equal(x.detach(), b) for x, b in zip(inputs, before, strict=True) if x.dtype != dtype) and all(
        torch.equal(x.detach().nan_to_num(), b.nan_to_num()) for x, b in zip(inputs, before, strict=True)
    )
    assert bool(torch.isfinite(base.grad).all() and torch.isfinite(weight.grad).all())


# ---------------------------------------------------------------------------------------------
# Edge cases (the values the docstring documents)
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_teacher_probabilities_that_underflow_give_the_exact_finite_divergence(kind):
    """Teacher log-probs of about -200 (p_t = e^-200 = 0 in fp32) on columns where the student has mass."""
    h, w, labels, ht, wt, grads = problem(lead=(6,), hidden=8, teacher_hidden=8, vocab=30, seed=11, std=1.0)
    ht = torch.cat([ht[:, :7], torch.ones(6, 1)], dim=1)
    wt = wt.clone()
    wt[:, 7] = 0.0
    wt[:10, 7] = -200.0  # the teacher's logits of columns 0..9 are ~200 below the others
    w = w.clone()
    w[:10] = w[:10] + 2.0 * h.mean(0) / h.mean(0).norm() ** 2  # the student puts mass on them
    out = run_ours(h, w, labels, ht, wt, grads, kind=kind, chunk_vocab=7)
    ref = reference(h, w, labels, ht, wt, kind, grads=grads)
    assert all(bool(torch.isfinite(x).all()) for x in out)
    if kind == "reverse_kl":
        assert out[2].min() > 20  # ~200 x the student's mass on the columns the teacher rules out
    check_all(out, ref)


@pytest.mark.parametrize("kind", KINDS)
def test_non_finite_teacher_logits_take_the_floor(kind):
    """-inf, +inf and NaN teacher logits (non-finite teacher inputs) are the floor: finite, as documented."""
    h, w, labels, ht, wt, grads = problem(lead=(6,), vocab=25, seed=12)
    wt, ht = wt.clone(), ht.clone()
    wt[3] = float("-inf")  # column 3: -inf or +inf or NaN depending on the signs of ht
    wt[7, 0] = float("nan")  # column 7: NaN
    ht[2] = float("nan")  # token 2: no finite teacher logit: a uniform teacher
    for floor in (TEACHER_LOGIT_FLOOR, -30.0, 0.5):  # 0.5 binds on ordinary logits too
        out = run_ours(h, w, labels, ht, wt, grads, kind=kind, chunk_vocab=6, teacher_logit_floor=floor)
        assert all(bool(torch.isfinite(x).all()) for x in out)
        check_all(out, reference(h, w, labels, ht, wt, kind, floor=floor, grads=grads))
    lp, ent, div = linear_logprob_entropy_and_divergence(h, w, labels, ht, wt, kind=kind)
    logp = torch.log_softmax(h[2].double() @ w.double().t(), -1)
    want = math.log(25) - ent[2].double() if kind == "reverse_kl" else -math.log(25) - logp.mean()
    assert abs(div[2].double() - want) < 1e-5  # against the uniform teacher, by hand


@pytest.mark.parametrize("kind", KINDS)
def test_ties_identical_models_and_masked_tokens(kind):
    """Student == teacher: the divergence is 0 and pushes nothing; tied maxima; tokens with zero
    incoming gradient (masked tokens) get exactly zero gradient rows."""
    h, w, labels, _, _, grads = problem(lead=(9,), hidden=10, vocab=40, seed=13)
    w = w.clone()
    w[5], w[17] = w[2], w[2]  # three tied columns, the largest logits of some tokens
    lp, ent, div, dh, dw = run_ours(h, w, labels, h, w, (None, None, grads[2]), kind=kind, chunk_vocab=6)
    assert div.abs().max() < 1e-6
    assert dh.abs().max() < 1e-6 and dw.abs().max() < 1e-6
    ht, wt = torch.randn(9, 7), torch.randn(40, 7)
    masked = tuple(g * (torch.arange(9) % 3 != 0) for g in grads)  # tokens 0, 3, 6 out of the loss
    out = run_ours(h, w, labels, ht, wt, masked, kind=kind, chunk_vocab=6)
    assert bool((out[3][::3] == 0).all()) and all(bool(torch.isfinite(x).all()) for x in out)
    check_all(out, reference(h, w, labels, ht, wt, kind, grads=masked))


@pytest.mark.parametrize("kind", KINDS)
def test_large_logits_are_finite_and_exact(kind):
    g = torch.Generator().manual_seed(14)
    h, ht = torch.randn(6, 16, generator=g), torch.randn(6, 16, generator=g)
    labels = torch.randint(0, 40, (6,), generator=g)
    grads = tuple(torch.randn(6, generator=g) for _ in range(3))
    w = torch.randn(40, 16, generator=g) * 300  # logits spread over ~1e3: near one-hot
    wt = torch.cat([torch.randn(40, 15, generator=g), torch.full((40, 1), 100.0)], dim=1)  # ~1e4 offset
    out = run_ours(h, w, labels, ht, wt, grads, kind=kind, chunk_vocab=9)
    ref = reference(h, w, labels, ht, wt, kind, grads=grads)
    assert all(bool(torch.isfinite(x).all()) for x in out)
    for got, want in zip(out[:3], ref[:3]):
        torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=5e-3)


# ---------------------------------------------------------------------------------------------
# Refusals
# ---------------------------------------------------------------------------------------------
def _call(h, w, labels, ht, wt, **kw):
    return linear_logprob_entropy_and_divergence(h, w, labels, ht, wt, **kw)


BAD = [
    # (case id, argument, replacement of (h, w, labels, ht, wt) or keyword, expected, received)
    ("hidden-int", "hidden", dict(h=lambda a: a.long()), "a floating [*tok, hidden] tensor", "i64[4,8]"),
    ("weight-dtype", "weight", dict(w=lambda a: a.double()), "hidden's dtype f32[4,8]", "f64[20,8]"),
    ("weight-width", "weight", dict(w=lambda a: a[:, :7]), "shape [vocab_shard > 0, 8]", "f32[20,7]"),
    ("teacher_hidden-int", "teacher_hidden", dict(ht=lambda a: a.int()), "a floating [*tok, hidden]", "i32[4,6]"),
    ("teacher_hidden-lead", "teacher_hidden", dict(ht=lambda a: a[:3]), "leading dims (4,)", "f32[3,6]"),
    ("teacher_hidden-empty", "teacher_hidden", dict(ht=lambda a: a[:, :0]), "with hidden > 0", "f32[4,0]"),
    ("teacher_weight-dtype", "teacher_weight", dict(wt=lambda a: a.half()), "teacher_hidden's dtype", "f16[20,6]"),
    (
        "teacher_weight-vocab",
        "teacher_weight",
        dict(wt=lambda a: a[:19]),
        "shape [20 (the rows of 'weight'",
        "f32[19,6]",
    ),
    ("teacher_weight-width", "teacher_weight", dict(wt=lambda a: a[:, :5]), "shape [20 (the rows", "f32[20,5]"),
    (
        "teacher_weight-3d",
        "teacher_weight",
        dict(wt=lambda a: a[None]),
        "a [vocab_shard, hidden] tensor",
        "f32[1,20,6]",
    ),
    ("labels-float", "labels", dict(labels=lambda a: a.float()), "an integer tensor", "f32[4]"),
    ("labels-shape", "labels", dict(labels=lambda a: a[:3]), "shape (4,)", "i64[3]"),
    (
        "teacher_hidden-grad",
        "teacher_hidden",
        dict(ht=lambda a: a.clone().requires_grad_()),
        "without grad",
        "one requiring grad",
    ),
    (
        "teacher_weight-grad",
        "teacher_weight",
        dict(wt=lambda a: a.clone().requires_grad_()),
        "pass teacher_weight.detach()",
        "one requiring grad",
    ),
    (
        "teacher_hidden-device",
        "teacher_hidden",
        dict(ht=lambda a: a.to("meta")),
        "the hidden states' device cpu",
        "one on meta",
    ),
    ("kind-name", "kind", dict(kind="kl"), "one of ('reverse_kl', 'forward_kl')", "'kl'"),
    ("kind-type", "kind", dict(kind=1), "one of", "1"),
    ("temperature-zero", "temperature", dict(temperature=0.0), "a finite float > 0", "0.0"),
    ("temperature-nan", "temperature", dict(temperature=float("nan")), "a finite float > 0", "nan"),
    ("temperature-str", "temperature", dict(temperature="1"), "a float > 0", "'1'"),
    (
        "teacher_temperature-neg",
        "teacher_temperature",
        dict(teacher_temperature=-1.0),
        "None or a finite float > 0",
        "-1.0",
    ),
    (
        "teacher_temperature-inf",
        "teacher_temperature",
        dict(teacher_temperature=float("inf")),
        "None or a finite",
        "inf",
    ),
    ("teacher_temperature-str", "teacher_temperature", dict(teacher_temperature="2"), "None or a finite", "'2'"),
    ("teacher_temperature-bool", "teacher_temperature", dict(teacher_temperature=True), "None or a finite", "True"),
    ("teacher_logit_floor-nan", "teacher_logit_floor", dict(teacher_logit_floor=float("nan")), "a finite float", "nan"),
    (
        "teacher_logit_floor-inf",
        "teacher_logit_floor",
        dict(teacher_logit_floor=-float("inf")),
        "a finite float",
        "-inf",
    ),
    ("teacher_logit_floor-str", "teacher_logit_floor", dict(teacher_logit_floor="-1e4"), "a finite float", "'-1e4'"),
    ("with_entropy-str", "with_entropy", dict(with_entropy="yes"), "a bool", "'yes'"),
    ("vocab_size-big", "vocab_size", dict(vocab_size=21), "at most vocab_shard * tp_size = 20 * 1 = 20", "21"),
    ("vocab_size-zero", "vocab_size", dict(vocab_size=0), "None or an int >= 1", "0"),
    ("chunk_vocab-zero", "chunk_vocab", dict(chunk_vocab=0), "None or an int >= 1", "0"),
    ("chunk_tokens-float", "chunk_tokens", dict(chunk_tokens=2.5), "None or an int >= 1", "2.5"),
    ("impl-name", "impl", dict(impl="cuda"), "one of ('auto', 'triton', 'torch')", "'cuda'"),
]


@pytest.mark.parametrize(("case", "arg", "change", "expected", "received"), BAD, ids=[b[0] for b in BAD])
def test_bad_inputs_are_refused_by_name(case, arg, change, expected, received):
    g = torch.Generator().manual_seed(15)
    args = dict(
        h=torch.randn(4, 8, generator=g),
        w=torch.randn(20, 8, generator=g),
        labels=torch.randint(0, 20, (4,), generator=g),
    )
    args.update(ht=torch.randn(4, 6, generator=g), wt=torch.randn(20, 6, generator=g))
    kw = {}
    for k, v in change.items():
        if k in args:
            args[k] = v(args[k])
        else:
            kw[k] = v
    with typechecking(False), pytest.raises(InputError) as err:
        _call(*args.values(), **kw)
    check_message(err.value, InputError, FN, arg, expected, received)


def test_bad_inputs_under_call_time_checking():
    h, w, labels, ht, wt, _ = problem(lead=(4,), hidden=8, teacher_hidden=6, vocab=20, seed=16)
    with pytest.raises(ShapeError, match="teacher_weight"):
        _call(h, w, labels, ht, wt[:19])  # another vocabulary partition
    with pytest.raises(ShapeError, match="teacher_hidden"):
        _call(h, w, labels, ht[:3], wt)
    bad = labels.clone()
    bad[1] = 20
    with pytest.raises(InputError) as err:
        _call(h, w, bad, ht, wt)
    check_message(err.value, InputError, FN, "labels", "token ids in [0, 20)", "(first bad: 20)")
    with pytest.raises(InputError) as err:
        _call(h, w, torch.full_like(labels, 12), ht, wt, vocab_size=10)  # a padding row as a label
    check_message(err.value, InputError, FN, "labels", "token ids in [0, 10)", "(first bad: 12)")
    with torch.no_grad():  # a teacher that requires grad is fine where no graph is built
        _call(h, w, labels, ht.requires_grad_(), wt)
    if os.environ.get("TRITON_INTERPRET", "0") != "1":
        with pytest.raises(InputError) as err:
            _call(h, w, labels, ht.detach(), wt, impl="triton")
        check_message(err.value, InputError, FN, "impl", "'torch' or 'auto'", "'triton'")


# ---------------------------------------------------------------------------------------------
# The Triton kernels, through Triton's CPU interpreter (skipped where Triton is not installed)
# ---------------------------------------------------------------------------------------------
_INTERP_SCRIPT = textwrap.dedent(
    """
    import torch
    from fnppo.core.kernels import distill_kernels
    from fnppo.core.ops import linear_distill as ld
    from tests.test_linear_distill import reference, run_ours
    g = torch.Generator().manual_seed(11)
    cases = ((37, 24, 40, 70, None, True, None, 33), (37, 32, 20, 100, 93, True, 9, 64), (20, 24, 48, 2500, None, False, None, 600))
    for dtype in (torch.float32, torch.bfloat16):
        for kind in ("reverse_kl", "forward_kl"):
            for n, hid, hid_t, vocab, vs, ent_on, ct, cv in cases:
                h = torch.randn(n, hid, generator=g).to(dtype)
                w = (torch.randn(vocab, hid, generator=g) * 0.7).to(dtype)
                ht = torch.randn(n, hid_t, generator=g).to(dtype)
                wt = (torch.randn(vocab, hid_t, generator=g) * 0.7).to(dtype)
                wt[5] = float("-inf")  # non-finite teacher logits: the floor
                ht[3] = float("nan")
                labels = torch.randint(0, vs or vocab, (n,), generator=g)
                grads = tuple(torch.randn(n, generator=g) for _ in range(3))
                grads = grads if ent_on else (grads[0], None, grads[2])
                kw = dict(kind=kind, temperature=0.7, teacher_temperature=1.4, with_entropy=ent_on, vocab_size=vs,
                          chunk_tokens=ct, chunk_vocab=cv, teacher_logit_floor=-50.0)
                lp, ent, div, dh, dw = run_ours(h, w, labels, ht, wt, grads, impl="triton", **kw)
                ref = reference(h, w, labels, ht, wt, kind, 0.7, 1.4, vs, -50.0, grads)
                for got, want in ((lp, ref[0]), (ent, ref[1]), (div, ref[2])):
                    assert got is None or (got.double() - want).abs().max() < 5e-6 * max(1, want.abs().max()), (kind, got, want)
                # bf16: the logit-gradient blocks are rounded to bf16 (as the student head's are)
                tol = 1e-5 if dtype == torch.float32 else 2e-2
                for got, want in ((dh, ref[3]), (dw, ref[4])):
                    err = ((got.double() - want).abs().max() / want.abs().max()).item()
                    assert err < tol, (dtype, kind, vocab, err)
                if vs is not None:
                    assert bool((dw[vs:] == 0).all())
                # only the divergence or only the head's outputs reach the loss (first shape)
                for keep in ((None, None, grads[2]), (grads[0], grads[1], None)) if vocab == 70 else ():
                    out = run_ours(h, w, labels, ht, wt, keep, impl="triton", **kw)
                    want = run_ours(h, w, labels, ht, wt, keep, impl="torch", **kw)
                    for a, b in zip(out[3:], want[3:]):
                        assert ((a.float() - b.float()).abs().max() / b.float().abs().max()) < tol
    # One TP shard's statistics (rows 30..59 of 100): the kernels' equal the PyTorch path's.
    h, ht = torch.randn(37, 32, generator=g).bfloat16(), torch.randn(37, 16, generator=g).bfloat16()
    w, wt = (torch.randn(100, 32, generator=g) * 0.7).bfloat16(), (torch.randn(100, 16, generator=g) * 0.7).bfloat16()
    labels = torch.randint(0, 100, (37,), generator=g)
    for reverse in (True, False):
        cfg = ld._Cfg(1 / 0.7, 1.2, -1e4, reverse, True, None, 2, 30, 30, 100, "triton", None, 7)
        got = distill_kernels().forward_stats(h, w[30:60], labels, ht, wt[30:60], cfg)
        want = ld._forward_stats_torch(h, w[30:60], labels, ht, wt[30:60], cfg)
        for x, y in zip(got, want):
            assert (x - y).abs().max() < 1e-5 * max(1, y.abs().max()), (x, y)
    print("interpreter ok")
    """
)


def test_triton_kernels_in_interpreter():
    pytest.importorskip("triton")
    np = pytest.importorskip("numpy")
    if tuple(int(x) for x in np.__version__.split(".")[:2]) >= (2, 3):
        pytest.skip("Triton 3.6's interpreter needs numpy < 2.3 (its scalar conversions)")
    env = dict(
        os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    )
    proc = subprocess.run(
        [sys.executable, "-c", _INTERP_SCRIPT], cwd=REPO, env=env, capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0 and "interpreter ok" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-5000:]


# ---------------------------------------------------------------------------------------------
# Tensor parallelism (gloo ranks)
# ---------------------------------------------------------------------------------------------
TP_TOKENS, TP_VOCAB, TP_CASES = (
    (3, 5),
    48,
    ((None, "reverse_kl"), (45, "forward_kl"), (20, "reverse_kl"), (45, "reverse_kl")),
)


def _tp_problem():
    g = torch.Generator().manual_seed(17)
    h, ht = torch.randn(*TP_TOKENS, 12, generator=g), torch.randn(*TP_TOKENS, 9, generator=g)
    w, wt = torch.randn(TP_VOCAB, 12, generator=g) * 0.8, torch.randn(TP_VOCAB, 9, generator=g) * 0.8
    wt[40] = float("-inf")  # a non-finite teacher column on rank 1 (the floor)
    labels = torch.randint(0, 20, TP_TOKENS, generator=g)  # < 20: valid for every vocab_size below
    return h, w, labels, ht, wt, tuple(torch.randn(*TP_TOKENS, generator=g) for _ in range(3))


def tp_worker():
    """Each rank takes its rows of both full weights; returns values, grads and the collectives' shapes."""
    import torch.distributed as dist

    from fnppo.megatron.parallel import current_layout

    layout = current_layout()
    h, w, labels, ht, wt, grads = _tp_problem()
    shard = TP_VOCAB // layout.tp
    rows = slice(layout.tp_rank * shard, (layout.tp_rank + 1) * shard)
    out = {}
    for vocab_size, kind in TP_CASES:
        calls = []
        real = dist.all_reduce

        def counting(tensor, *args, **kwargs):
            calls.append(tuple(tensor.shape))
            return real(tensor, *args, **kwargs)

        dist.all_reduce = counting
        try:
            res = run_ours(
                h, w[rows], labels, ht, wt[rows], grads, kind=kind, tp_group=layout.tp_group, temperature=0.8,
                teacher_temperature=1.1, vocab_size=vocab_size, chunk_vocab=5,
            )  # fmt: skip
        finally:
            dist.all_reduce = real
        out[vocab_size, kind] = ([x.detach() for x in res], calls)
    return out


@pytest.mark.slow
def test_tensor_parallel_equals_unsharded():
    from fnppo.testing import run_ranks

    outs = run_ranks(tp_worker, 2, tp=2)
    h, w, labels, ht, wt, grads = _tp_problem()
    for vocab_size, kind in TP_CASES:
        kw = dict(kind=kind, temperature=0.8, teacher_temperature=1.1, vocab_size=vocab_size)
        one = run_ours(h, w, labels, ht, wt, grads, **kw)
        check_all(one, reference(h, w, labels, ht, wt, kind, 0.8, 1.1, vocab_size, grads=grads))
        for res, calls in (o[vocab_size, kind] for o in outs):
            # forward: a MAX of [15, 2] (both maxima), one SUM of [15, 5]; nothing in the backward
            assert calls == [(15, 2), (15, 5)], calls
            for a, b in zip(res[:3], one[:3]):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        # each rank's hidden gradient is its share (the caller sums them); weight gradients are its rows
        dh = outs[0][vocab_size, kind][0][3] + outs[1][vocab_size, kind][0][3]
        torch.testing.assert_close(dh, one[3], rtol=1e-5, atol=1e-5)
        dw = torch.cat([o[vocab_size, kind][0][4] for o in outs], dim=0)
        torch.testing.assert_close(dw, one[4], rtol=1e-5, atol=1e-5)
        if vocab_size is not None:
            assert bool((dw[vocab_size:] == 0).all())
