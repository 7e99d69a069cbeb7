"""Tests of fnppo.linear_logprob_and_entropy against an fp64 reference and materialized logits,
and of the step's fused output path (``StepConfig(fns=StepFns.fused())``) against the unfused one."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import fnppo
from fnppo.core.errors import InputError, ShapeError
from fnppo.core.ops.linear_logprob import linear_logprob_and_entropy
from fnppo.core.ops.linear_logprob_graphs import BackwardGraphs
from fnppo.core.ops.logprob import logprob_and_entropy
from fnppo.core.typing import typechecking
from tests.logprob_reference import assert_grad_close, fp64_logprob_entropy
from tests.messages import check_message

REPO = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------------------------------
# The independent reference: fp64 logits, log_softmax and autograd.
# ---------------------------------------------------------------------------------------------
def reference(h, w, labels, temperature, g_lp=None, g_h=None, vocab_size=None):
    """fp64 ``(logprobs, entropy, dL/dh, dL/dW)`` with ``L = sum(g_lp * logprobs + g_h * entropy)``."""
    hr = h.detach().double().requires_grad_()
    wr = w.detach().double().requires_grad_()
    x = hr @ wr.t()
    if vocab_size is not None:
        x = x[..., :vocab_size]
    lp, ent, loss = fp64_logprob_entropy(x, labels, temperature, g_lp, g_h)
    dh, dw = torch.autograd.grad(loss, (hr, wr)) if loss.requires_grad else (torch.zeros_like(hr), torch.zeros_like(wr))
    return lp.detach(), ent.detach(), dh, dw


def run_ours(h, w, labels, temperature, g_lp, g_h, **kw):
    hg, wg = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    lp, ent = linear_logprob_and_entropy(hg, wg, labels, temperature=temperature, **kw)
    loss = (lp * g_lp).sum() + ((ent * g_h).sum() if ent is not None else 0)
    loss.backward()
    return lp, ent, hg.grad, wg.grad


def problem(lead=(3, 7), hidden=24, vocab=53, dtype=torch.float32, seed=1, std=3.0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(*lead, hidden, generator=g).to(dtype)
    w = (torch.randn(vocab, hidden, generator=g) * std / hidden**0.5).to(dtype)
    labels = torch.randint(0, vocab, lead, generator=g)
    return h, w, labels, torch.randn(*lead, generator=g), torch.randn(*lead, generator=g)


# ---------------------------------------------------------------------------------------------
# Values and gradients
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("temperature", [1.0, 0.6, 2.5])
def test_values_and_grads_match_fp64(dtype, temperature):
    h, w, labels, g_lp, g_h = problem(dtype=dtype)
    lp, ent, dh, dw = run_ours(h, w, labels, temperature, g_lp, g_h, chunk_tokens=4, chunk_vocab=16)
    rlp, rent, rdh, rdw = reference(h, w, labels, temperature, g_lp, g_h)
    assert lp.dtype == torch.float32 and ent.dtype == torch.float32 and lp.shape == (3, 7) and ent.shape == (3, 7)
    torch.testing.assert_close(lp.double(), rlp, rtol=1e-5, atol=2e-5)
    torch.testing.assert_close(ent.double(), rent, rtol=1e-5, atol=2e-5)
    assert_grad_close(dh, rdh, dtype)
    assert_grad_close(dw, rdw, dtype)


def test_fp64_inputs_give_fp64_grads():
    h, w, labels, g_lp, g_h = problem(dtype=torch.float64)
    lp, ent, dh, dw = run_ours(h, w, labels, 0.8, g_lp, g_h)
    rlp, rent, rdh, rdw = reference(h, w, labels, 0.8, g_lp, g_h)
    assert lp.dtype == torch.float32 and dh.dtype == torch.float64 and dw.dtype == torch.float64
    torch.testing.assert_close(lp.double(), rlp, rtol=1e-5, atol=2e-5)
    assert_grad_close(dh, rdh, torch.float64)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_equals_logprob_and_entropy_on_materialized_logits(temperature):
    """fp32: the same function as logprob_and_entropy(hidden @ weight.T), values and gradients."""
    h, w, labels, g_lp, g_h = problem(lead=(2, 9), hidden=16, vocab=40, seed=3)
    lp, ent, dh, dw = run_ours(h, w, labels, temperature, g_lp, g_h, chunk_vocab=7)
    hg, wg = h.clone().requires_grad_(), w.clone().requires_grad_()
    lp2, ent2 = logprob_and_entropy(hg @ wg.t(), labels, temperature=temperature)
    ((lp2 * g_lp).sum() + (ent2 * g_h).sum()).backward()
    torch.testing.assert_close(lp, lp2, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent, ent2, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dh, hg.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(dw, wg.grad, rtol=1e-5, atol=1e-6)


def test_bf16_within_materialized_rounding():
    """bf16: the fused result is closer to fp64 than (or as close as) bf16-rounded materialized logits."""
    h, w, labels, g_lp, g_h = problem(lead=(64,), hidden=32, vocab=300, dtype=torch.bfloat16, seed=4)
    ours = run_ours(h, w, labels, 1.0, g_lp, g_h)
    hg, wg = h.clone().requires_grad_(), w.clone().requires_grad_()
    lp2, ent2 = logprob_and_entropy(hg @ wg.t(), labels)
    ((lp2 * g_lp).sum() + (ent2 * g_h).sum()).backward()
    ref = reference(h, w, labels, 1.0, g_lp, g_h)
    for mine, mat, r in zip(ours, (lp2, ent2, hg.grad, wg.grad), ref):
        err_mine = (mine.double() - r).abs().max().item()
        err_mat = (mat.double() - r).abs().max().item()
        assert err_mine <= max(err_mat, 2.0**-8 * r.abs().max().item()), (err_mine, err_mat)


def test_temperature_equals_scaled_weight():
    """f(h, W, T) = f(h, W / T, 1): values, dh, and dW by the chain rule (dW_T = dW' / T)."""
    h, w, labels, g_lp, g_h = problem(seed=5)
    t = 0.4
    lp, ent, dh, dw = run_ours(h, w, labels, t, g_lp, g_h, chunk_vocab=10)
    lp2, ent2, dh2, dw2 = run_ours(h, w / t, labels, 1.0, g_lp, g_h, chunk_vocab=10)
    torch.testing.assert_close(lp, lp2, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent, ent2, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dh, dh2, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dw, dw2 / t, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_large_logits_are_finite_and_exact(dtype):
    g = torch.Generator().manual_seed(6)
    h = torch.randn(6, 16, generator=g).to(dtype)
    labels = torch.randint(0, 40, (6,), generator=g)
    g_lp, g_h = torch.randn(6, generator=g), torch.randn(6, generator=g)
    # logits spread over ~1e4 (one-hot distributions), and logits near 1e4 with O(1) spread
    w_spread = (torch.randn(40, 16, generator=g) * 2500).to(dtype)
    h_off = torch.cat([h[:, :15], torch.full((6, 1), 100.0).to(dtype)], dim=1)
    w_off = torch.cat([torch.randn(40, 15, generator=g), torch.full((40, 1), 100.0)], dim=1).to(dtype)
    for hh, ww in ((h, w_spread), (h_off, w_off)):
        for t in (1.0, 0.5):
            lp, ent, dh, dw = run_ours(hh, ww, labels, t, g_lp, g_h, chunk_vocab=9)
            rlp, rent, rdh, rdw = reference(hh, ww, labels, t, g_lp, g_h)
            assert all(bool(torch.isfinite(x).all()) for x in (lp, ent, dh, dw))
            torch.testing.assert_close(lp.double(), rlp, rtol=1e-6, atol=5e-3)
            torch.testing.assert_close(ent.double(), rent, rtol=1e-6, atol=5e-3)
            # The logits themselves carry fp32 rounding (~1e-7 of sum |h_k w_jk|): the yardstick is
            # the same gradient from fp32 logits materialized by torch.
            hm, wm = hh.float().requires_grad_(), ww.float().requires_grad_()
            mlp, ment = logprob_and_entropy(hm @ wm.t(), labels, temperature=t)
            ((mlp * g_lp).sum() + (ment * g_h).sum()).backward()
            for got, mat, ref in ((dh, hm.grad, rdh), (dw, wm.grad, rdw)):
                err = (got.double() - ref).abs().max().item()
                err_mat = (mat.double() - ref).abs().max().item()
                assert err <= 2 * err_mat + 2.0**-7 * ref.abs().max().item(), (err, err_mat)


def test_vocab_size_leaves_padding_rows_out():
    """Rows at or beyond vocab_size never enter the softmax and get a zero weight gradient."""
    h, w, labels, g_lp, g_h = problem(lead=(11,), hidden=12, vocab=64, seed=7)
    w = w.clone()
    w[53:] = 50.0  # padding rows that would dominate the softmax if they were included
    labels = labels % 53
    lp, ent, dh, dw = run_ours(h, w, labels, 0.9, g_lp, g_h, vocab_size=53, chunk_vocab=20)
    rlp, rent, rdh, rdw = reference(h, w, labels, 0.9, g_lp, g_h, vocab_size=53)
    torch.testing.assert_close(lp.double(), rlp, rtol=1e-5, atol=2e-5)
    torch.testing.assert_close(ent.double(), rent, rtol=1e-5, atol=2e-5)
    assert_grad_close(dh, rdh, torch.float32)
    assert_grad_close(dw, rdw, torch.float32)
    assert bool((dw[53:] == 0).all())
    bad = labels.clone()
    bad[0] = 53
    with pytest.raises(InputError, match=r"argument 'labels' expected token ids in \[0, 53\)"):
        linear_logprob_and_entropy(h, w, bad, vocab_size=53)
    with pytest.raises(
        InputError, match=r"argument 'vocab_size' expected at most vocab_shard \* tp_size = 64 \* 1 = 64"
    ):
        linear_logprob_and_entropy(h, w, labels, vocab_size=65)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_inputs_never_written(dtype):
    g = torch.Generator().manual_seed(8)
    base = torch.randn(4, 5, 16, generator=g, requires_grad=True)
    hidden = (base * 2.0).to(dtype)  # a non-leaf, like a model's output
    weight = torch.randn(30, 16, generator=g).to(dtype).requires_grad_()
    labels = torch.randint(0, 30, (4, 5), generator=g)
    before = (hidden.detach().clone(), weight.detach().clone(), labels.clone())
    versions = (hidden._version, weight._version, labels._version)
    lp, ent = linear_logprob_and_entropy(hidden, weight, labels, temperature=0.9, chunk_vocab=8)
    other = torch.softmax(hidden.float(), -1)[..., 0].sum()  # another consumer of the hidden states
    (lp.sum() + 0.1 * ent.sum() + other).backward()
    assert (hidden._version, weight._version, labels._version) == versions
    assert (
        torch.equal(hidden.detach(), before[0])
        and torch.equal(weight.detach(), before[1])
        and torch.equal(labels, before[2])
    )
    assert base.grad is not None and torch.isfinite(base.grad).all() and torch.isfinite(weight.grad).all()


def test_without_entropy_and_single_outputs():
    h, w, labels, g_lp, g_h = problem(seed=9)
    lp, ent, dh, dw = run_ours(h, w, labels, 1.7, g_lp, None, with_entropy=False, chunk_vocab=11)
    assert ent is None
    rlp, _, rdh, rdw = reference(h, w, labels, 1.7, g_lp, None)
    torch.testing.assert_close(lp.double(), rlp, rtol=1e-5, atol=2e-5)
    assert_grad_close(dh, rdh, torch.float32)
    assert_grad_close(dw, rdw, torch.float32)
    for which in ("logprobs", "entropy"):  # only one output reaches the loss
        hg, wg = h.clone().requires_grad_(), w.clone().requires_grad_()
        lp, ent = linear_logprob_and_entropy(hg, wg, labels)
        ((lp if which == "logprobs" else ent) * g_lp).sum().backward()
        _, _, rdh, rdw = reference(
            h, w, labels, 1.0, g_lp if which == "logprobs" else None, g_lp if which == "entropy" else None
        )
        assert_grad_close(hg.grad, rdh, torch.float32)
        assert_grad_close(wg.grad, rdw, torch.float32)


def test_gradient_only_for_inputs_that_need_it():
    h, w, labels, g_lp, g_h = problem(seed=10)
    wg = w.clone().requires_grad_()
    lp, ent = linear_logprob_and_entropy(h, wg, labels)  # hidden without grad: only dW
    ((lp * g_lp).sum() + (ent * g_h).sum()).backward()
    _, _, _, rdw = reference(h, w, labels, 1.0, g_lp, g_h)
    assert_grad_close(wg.grad, rdw, torch.float32)


def test_chunking_does_not_change_results():
    h, w, labels, g_lp, g_h = problem(lead=(37,), hidden=10, vocab=45, seed=11)
    outs = [
        run_ours(h, w, labels, 0.7, g_lp, g_h, chunk_tokens=ct, chunk_vocab=cv)
        for ct, cv in ((1, 1), (5, 7), (37, 45), (None, None), (8, 100))
    ]
    for o in outs[1:]:
        for a, b in zip(outs[0], o):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_leading_dims_and_empty():
    h, w, labels, _, _ = problem(lead=(2, 3, 4), hidden=8, vocab=17, seed=12)
    lp, ent = linear_logprob_and_entropy(h, w, labels)
    lp2, ent2 = linear_logprob_and_entropy(h.reshape(-1, 8), w, labels.reshape(-1))
    torch.testing.assert_close(lp.reshape(-1), lp2, rtol=0, atol=1e-6)
    torch.testing.assert_close(ent.reshape(-1), ent2, rtol=0, atol=1e-6)
    hg = h[:0].clone().requires_grad_()
    lp0, ent0 = linear_logprob_and_entropy(hg, w, labels[:0])
    assert lp0.shape == (0, 3, 4) and ent0.shape == (0, 3, 4)
    # A transposed (non-contiguous) hidden, as a [seq, batch, hidden] model output seen as [batch, seq, hidden]
    ht = h.transpose(0, 1)
    lp3, _ = linear_logprob_and_entropy(ht, w, labels.transpose(0, 1))
    torch.testing.assert_close(lp3, lp.transpose(0, 1), rtol=0, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------------
def test_bad_inputs_raise_named_errors():
    h, w, labels, _, _ = problem(lead=(4,), hidden=8, vocab=20, seed=13)
    fn = "linear_logprob_and_entropy"
    with pytest.raises(
        InputError,
        match=rf"{fn}: argument 'weight' expected a \[vocab_shard, hidden\] tensor of the hidden states' dtype",
    ):
        linear_logprob_and_entropy(h, w.double(), labels)
    with typechecking(False):
        with pytest.raises(InputError, match=rf"{fn}: argument 'weight' expected shape \[vocab_shard > 0, 8\]"):
            linear_logprob_and_entropy(h, w[:, :7], labels)
        with pytest.raises(InputError, match=rf"{fn}: argument 'labels' expected shape \(4,\)"):
            linear_logprob_and_entropy(h, w, labels[:3])
        with pytest.raises(InputError, match=rf"{fn}: argument 'hidden' expected a floating"):
            linear_logprob_and_entropy(h.long(), w, labels)
        with pytest.raises(InputError, match=rf"{fn}: argument 'labels' expected an integer tensor"):
            linear_logprob_and_entropy(h, w, labels.float())
    with pytest.raises(ShapeError, match="weight"):
        linear_logprob_and_entropy(h, w[:, :7], labels)
    with pytest.raises(ShapeError, match="labels"):
        linear_logprob_and_entropy(h, w, labels[:3])
    for t in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(InputError, match="argument 'temperature' expected a finite float > 0"):
            linear_logprob_and_entropy(h, w, labels, temperature=t)
    bad = labels.clone()
    bad[1] = 20
    with pytest.raises(InputError, match=r"argument 'labels' expected token ids in \[0, 20\)"):
        linear_logprob_and_entropy(h, w, bad)
    with typechecking(False):  # no check, no sync: a NaN log-prob, never a silently wrong one
        lp, _ = linear_logprob_and_entropy(h, w, bad)
    assert torch.isnan(lp[1]) and torch.isfinite(lp[[0, 2, 3]]).all()
    with pytest.raises(InputError, match="argument 'impl'"):
        linear_logprob_and_entropy(h, w, labels, impl="cuda")
    with pytest.raises(InputError, match="argument 'chunk_vocab' expected None or an int >= 1"):
        linear_logprob_and_entropy(h, w, labels, chunk_vocab=0)
    if os.environ.get("TRITON_INTERPRET", "0") != "1":
        with pytest.raises(InputError, match="argument 'impl'"):
            linear_logprob_and_entropy(h, w, labels, impl="triton")  # CPU tensors, no interpreter


def test_exported_from_package():
    import fnppo

    assert fnppo.linear_logprob_and_entropy is linear_logprob_and_entropy
    assert fnppo.ops.BackwardGraphs is BackwardGraphs


# ---------------------------------------------------------------------------------------------
# BackwardGraphs: static (padded) buffers; off CUDA the same buffers without capture
# ---------------------------------------------------------------------------------------------
def _grads(graphs, h, w, labels, g_lp, g_h, **kw):
    """``(lp, ent, dh, dW)`` of ``sum(g_lp lp + g_h ent)`` with ``w`` itself (same address every call)."""
    hg = h.detach().clone().requires_grad_()
    lp, ent = linear_logprob_and_entropy(hg, w, labels, graphs=graphs, **kw)
    loss = (lp * g_lp).sum() if g_lp is not None else 0
    loss = loss + ((ent * g_h).sum() if g_h is not None and ent is not None else 0)
    dh, dw = torch.autograd.grad(loss, (hg, w))
    return lp.detach(), None if ent is None else ent.detach(), dh, dw


@pytest.mark.parametrize("kind", ["plain", "no_entropy", "entropy_only", "logprob_only", "masked", "temperature"])
def test_backward_graphs_give_the_gradients_of_a_call_without_them(kind):
    """A sequence of token counts through one cache: equal rows, fewer (stale rows of the larger
    call must be zeroed), more than the buffers hold (reallocated). Every call equals the call
    without the cache and the fp64 reference; inputs are untouched."""
    g = torch.Generator().manual_seed(21)
    hid, vocab = 24, 61
    vs = 50 if kind == "masked" else None
    t = 0.6 if kind == "temperature" else 1.0
    w = (torch.randn(vocab, hid, generator=g) * 0.8).requires_grad_()
    graphs = BackwardGraphs(row_multiple=16)
    seq = [20, 20, 7, 33, 33, 12, 48]
    for n in seq:
        h = torch.randn(n, hid, generator=g) * 2
        labels = torch.randint(0, vs or vocab, (n,), generator=g)
        g_lp = None if kind == "entropy_only" else torch.randn(n, generator=g)
        g_h = None if kind in ("no_entropy", "logprob_only") else torch.randn(n, generator=g)
        kw = dict(temperature=t, with_entropy=kind != "no_entropy", vocab_size=vs)
        before = [(x._version, x.clone()) for x in (h, w, labels)]
        got = _grads(graphs, h, w, labels, g_lp, g_h, **kw)
        want = _grads(None, h, w, labels, g_lp, g_h, **kw)
        for x, (ver, val) in zip((h, w, labels), before):
            assert x._version == ver and torch.equal(x.detach(), val)
        rlp, rent, rdh, rdw = reference(h, w, labels, t, g_lp, g_h, vocab_size=vs)
        for a, b, ref, name in zip(got, want, (rlp, rent, rdh, rdw), ("lp", "ent", "dh", "dW")):
            if a is None:
                assert b is None and name == "ent"
                continue
            scale = ref.abs().max().clamp_min(1e-12)
            assert float((a.double() - b.double()).abs().max() / scale) < 4e-6, (
                kind,
                n,
                name,
            )  # fp32 sums in other blocks
            assert float((a.double() - ref).abs().max() / scale) < 2e-5, (kind, n, name)
        if vs is not None:
            assert bool((got[3][vs:] == 0).all())
    assert (graphs.eager_calls, graphs.captures, graphs.replays) == (len(seq), 0, 0)  # CPU: never captured
    # one buffer set, reallocated for 33 (48 rows): hidden, its gradient, labels, 4 per-token rows, the weight's gradient
    assert graphs.nbytes() == 48 * hid * 4 * 2 + 48 * 8 + 4 * 48 * 4 + vocab * hid * 4


def test_backward_graphs_stale_rows_never_reach_a_later_call():
    """Rows a larger call left in the buffers (here NaN hidden states) are zeroed before a smaller
    call of the same padded size reads them."""
    g = torch.Generator().manual_seed(5)
    w = torch.randn(40, 16, generator=g).requires_grad_()
    graphs = BackwardGraphs(row_multiple=64)
    h = torch.randn(50, 16, generator=g)
    h[10:] = float("nan")
    labels = torch.randint(0, 40, (50,), generator=g)
    _grads(graphs, h, w, labels, torch.randn(50, generator=g), torch.randn(50, generator=g))
    h, labels, g_lp, g_h = (
        torch.randn(30, 16, generator=g),
        torch.randint(0, 40, (30,), generator=g),
        torch.randn(30, generator=g),
        torch.randn(30, generator=g),
    )
    got = _grads(graphs, h, w, labels, g_lp, g_h)
    want = _grads(None, h, w, labels, g_lp, g_h)
    for a, b in zip(got[2:], want[2:]):
        assert bool(torch.isfinite(a).all())
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_backward_graphs_keep_at_most_max_weights_and_clear():
    g = torch.Generator().manual_seed(8)
    ws = [torch.randn(30 + i, 8, generator=g).requires_grad_() for i in range(3)]
    graphs = BackwardGraphs(row_multiple=8, max_weights=2)
    h, labels = torch.randn(5, 8, generator=g), torch.randint(0, 30, (5,), generator=g)
    g_lp, g_h = torch.randn(5, generator=g), torch.randn(5, generator=g)
    sizes = []
    for w in ws + ws[:1]:
        got, want = _grads(graphs, h, w, labels, g_lp, g_h), _grads(None, h, w, labels, g_lp, g_h)
        for a, b in zip(got[2:], want[2:]):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
        sizes.append(graphs.nbytes())
    per = lambda v: 8 * 8 * 4 * 2 + 8 * 8 + 4 * 8 * 4 + v * 8 * 4  # noqa: E731
    assert sizes == [per(30), per(30) + per(31), per(31) + per(32), per(32) + per(30)]
    assert "weights=2" in repr(graphs)
    graphs.clear()
    assert graphs.nbytes() == 0 and "weights=0" in repr(graphs)


def test_backward_graphs_refuse_bad_arguments():

    for name in ("row_multiple", "max_graphs", "max_weights"):
        for bad in (0, -1, 2.0, True):
            with pytest.raises(InputError) as info:
                BackwardGraphs(**{name: bad})
            check_message(info.value, InputError, "fnppo.ops.BackwardGraphs", name, "an int >= 1", repr(bad))
    h, w, labels, _, _ = problem()
    with pytest.raises(InputError) as info:
        linear_logprob_and_entropy(h, w, labels, graphs="yes")
    check_message(
        info.value,
        InputError,
        "fnppo.linear_logprob_and_entropy",
        "graphs",
        "a fnppo.ops.BackwardGraphs or None",
        "'yes'",
    )


# ---------------------------------------------------------------------------------------------
# The Triton kernels, through Triton's CPU interpreter (skipped where Triton is not installed)
# ---------------------------------------------------------------------------------------------
_INTERP_SCRIPT = textwrap.dedent(
    """
    import os
    import torch
    from fnppo.core.kernels import linear_logprob_launch
    from fnppo.core.ops.linear_logprob import linear_logprob_and_entropy
    # the interpreter runs on the CPU: take the TMA descriptors there when the test asks for them
    linear_logprob_launch._tma_wanted = lambda device: os.environ["TEST_TMA"] == "1"
    from tests.test_linear_logprob import reference
    g = torch.Generator().manual_seed(11)
    for dtype in (torch.float32, torch.bfloat16):
        for hid, vocab, vs, ent_on, ct, cv in ((24, 70, None, True, None, 33), (32, 100, 93, True, 9, 64), (24, 40, None, False, None, 16)):
            h = torch.randn(37, hid, generator=g).to(dtype)
            w = (torch.randn(vocab, hid, generator=g) * 0.7).to(dtype)
            labels = torch.randint(0, vs or vocab, (37,), generator=g)
            g_lp, g_h = torch.randn(37, generator=g), torch.randn(37, generator=g)
            hg, wg = h.clone().requires_grad_(), w.clone().requires_grad_()
            lp, ent = linear_logprob_and_entropy(hg, wg, labels, temperature=0.7, with_entropy=ent_on, vocab_size=vs,
                                                 chunk_tokens=ct, chunk_vocab=cv, impl="triton")
            ((lp * g_lp).sum() + ((ent * g_h).sum() if ent_on else 0)).backward()
            rlp, rent, rdh, rdw = reference(h, w, labels, 0.7, g_lp, g_h if ent_on else None, vocab_size=vs)
            assert (lp.double() - rlp).abs().max() < 2e-5
            assert ent is None or (ent.double() - rent).abs().max() < 2e-5
            # bf16: the logit-gradient blocks are rounded to bf16 (as materialized bf16 logits'
            # gradients are), and the interpreter rounds toward zero.
            tol = 1e-5 if dtype == torch.float32 else 2e-2
            for got, ref in ((hg.grad, rdh), (wg.grad, rdw)):
                err = ((got.double() - ref).abs().max() / ref.abs().max()).item()
                assert err < tol, (dtype, hid, vocab, err)
            if vs is not None:
                assert bool((wg.grad[vs:] == 0).all())
    # One TP shard's statistics (rows 30..59 of 100): labels outside it add nothing to zl.
    from fnppo.core.kernels import linear_logprob_launch as k
    from fnppo.core.ops.linear_logprob import _forward_stats_torch
    h = torch.randn(37, 32, generator=g).bfloat16()
    w = (torch.randn(100, 32, generator=g) * 0.7).bfloat16()
    labels = torch.randint(0, 100, (37,), generator=g)
    got = k.forward_stats(h, w[30:60], labels, 30, 1 / 0.7, True)
    want = _forward_stats_torch(h, w[30:60], labels, 30, 1 / 0.7, True, 37, 30)
    for x, y in zip(got, want):
        assert (x - y).abs().max() < 1e-5, (x, y)
    inside = (labels >= 30) & (labels < 60)
    assert bool((got[3][~inside] == 0).all()) and bool((got[3][inside] != 0).all())
    # A vocabulary of 2,500 columns: three splits (the last one partial), merged by the merge kernel.
    assert k._num_splits(37, 2500, h.device, k._INTERP["BM"]) == 3
    w = (torch.randn(2500, 32, generator=g) * 0.7).bfloat16()
    labels = torch.randint(0, 2500, (37,), generator=g)
    for ent_on in (True, False):
        got = k.forward_stats(h, w, labels, 0, 1.3, ent_on)
        want = _forward_stats_torch(h, w, labels, 0, 1.3, ent_on, 37, 700)
        for x, y in zip(got, want):
            assert (x is None) == (y is None) and (x is None or (x - y).abs().max() < 1e-5), (x, y)
    # The backward through BackwardGraphs' buffers (preallocated dz / accumulator / dh; no capture on CPU).
    from fnppo.core.ops.linear_logprob_graphs import BackwardGraphs
    graphs = BackwardGraphs(row_multiple=16)
    w = (torch.randn(70, 24, generator=g) * 0.7).bfloat16().requires_grad_()
    for n in (20, 9, 33, 20):
        h = torch.randn(n, 24, generator=g).bfloat16()
        labels = torch.randint(0, 70, (n,), generator=g)
        g_lp, g_h = torch.randn(n, generator=g), torch.randn(n, generator=g)
        res = []
        for use in (None, graphs):
            hg = h.clone().requires_grad_()
            lp, ent = linear_logprob_and_entropy(hg, w, labels, chunk_vocab=32, impl="triton", graphs=use)
            res.append(torch.autograd.grad((lp * g_lp).sum() + (ent * g_h).sum(), (hg, w)))
        for x, y in zip(*res):
            assert ((x.float() - y.float()).abs().max() / y.float().abs().max()) < 1e-2, (n, x, y)
    assert graphs.eager_calls == 4, graphs
    print("interpreter ok")
    """
)


@pytest.mark.parametrize("tma", ["0", "1"])
def test_triton_kernels_in_interpreter(tma):
    """Both ways of reading tiles: pointer loads, and TMA descriptors (Hopper's path on a GPU)."""
    pytest.importorskip("triton")
    np = pytest.importorskip("numpy")
    if tuple(int(x) for x in np.__version__.split(".")[:2]) >= (2, 3):
        pytest.skip("Triton 3.6's interpreter needs numpy < 2.3 (range() over int arguments)")
    env = dict(
        os.environ,
        TRITON_INTERPRET="1",
        TEST_TMA=tma,
        PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    )
    proc = subprocess.run(
        [sys.executable, "-c", _INTERP_SCRIPT], cwd=REPO, env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0 and "interpreter ok" in proc.stdout, proc.stdout + proc.stderr


# ---------------------------------------------------------------------------------------------
# Tensor parallelism (gloo ranks, real Megatron process groups)
# ---------------------------------------------------------------------------------------------
TP_TOKENS, TP_HIDDEN, TP_VOCAB = (3, 5), 12, 48


def _tp_problem():
    g = torch.Generator().manual_seed(14)
    h = torch.randn(*TP_TOKENS, TP_HIDDEN, generator=g)
    w = torch.randn(TP_VOCAB, TP_HIDDEN, generator=g) * 0.8
    labels = torch.randint(0, 20, TP_TOKENS, generator=g)  # < 20: valid for every vocab_size below
    return h, w, labels, torch.randn(*TP_TOKENS, generator=g), torch.randn(*TP_TOKENS, generator=g)


def tp_worker():
    """Each rank takes its rows of the same full weight; returns values, grads and the collectives."""
    import torch.distributed as dist

    from fnppo.megatron.parallel import current_layout

    layout = current_layout()
    h, w, labels, g_lp, g_h = _tp_problem()
    shard = TP_VOCAB // layout.tp
    out = {}
    for vocab_size in (None, 45, 20):  # 20: rank 1 of TP=2 holds only padding rows
        ws = w[layout.tp_rank * shard : (layout.tp_rank + 1) * shard].clone().requires_grad_()
        hs = h.clone().requires_grad_()
        calls = []
        real = dist.all_reduce

        def counting(tensor, *args, **kwargs):
            calls.append(tuple(tensor.shape))
            return real(tensor, *args, **kwargs)

        dist.all_reduce = counting
        try:
            lp, ent = linear_logprob_and_entropy(
                hs, ws, labels, tp_group=layout.tp_group, temperature=0.8, vocab_size=vocab_size, chunk_vocab=5
            )
            n_forward = list(calls)
            ((lp * g_lp).sum() + (ent * g_h).sum()).backward()
            n_backward = calls[len(n_forward) :]
        finally:
            dist.all_reduce = real
        out[vocab_size] = dict(lp=lp.detach(), ent=ent.detach(), dh=hs.grad, dw=ws.grad, fwd=n_forward, bwd=n_backward)
    return out


@pytest.mark.slow
def test_tensor_parallel_equals_tp1():
    from fnppo.testing import run_ranks

    outs = run_ranks(tp_worker, 2, tp=2)
    h, w, labels, g_lp, g_h = _tp_problem()
    for vocab_size in (None, 45, 20):
        lp1, ent1, dh1, dw1 = run_ours(h, w, labels, 0.8, g_lp, g_h, vocab_size=vocab_size)
        rlp, rent, rdh, rdw = reference(h, w, labels, 0.8, g_lp, g_h, vocab_size=vocab_size)
        torch.testing.assert_close(lp1.double(), rlp, rtol=1e-5, atol=2e-5)
        for o in outs:
            r = o[vocab_size]
            torch.testing.assert_close(r["lp"], lp1, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(r["ent"], ent1, rtol=1e-5, atol=1e-5)
            # Two collectives in the forward, each O(tokens): a max of [15], then sums of [15, 3]. None backward.
            assert r["fwd"] == [(15,), (15, 3)] and r["bwd"] == []
        # Each rank's hidden gradient is its share; their sum is the TP=1 gradient (Megatron's
        # copy_to_tensor_model_parallel_region does that sum in a model).
        torch.testing.assert_close(outs[0][vocab_size]["dh"] + outs[1][vocab_size]["dh"], dh1, rtol=1e-5, atol=1e-5)
        dw_tp = torch.cat([o[vocab_size]["dw"] for o in outs], dim=0)
        torch.testing.assert_close(dw_tp, dw1, rtol=1e-5, atol=1e-5)
        assert_grad_close(dw_tp, rdw, torch.float32)
        if vocab_size is not None:
            assert bool((dw_tp[vocab_size:] == 0).all())


# ---------------------------------------------------------------------------------------------
# The step: StepConfig(fns=StepFns.fused()) equals the unfused path
# ---------------------------------------------------------------------------------------------
def _step_model_cfg(tied: bool):
    from fnppo.testing import tiny_model_config

    return tiny_model_config(tie_embeddings=tied)


def step_worker(
    tied: bool = True,
    build: dict | None = None,
    chunk_vocab: int | None = None,
    graphs: bool = False,
) -> dict:
    """train_step + compute_logprobs (current and reference weights), unfused then fused
    (``StepConfig(fns=StepFns.fused(...))``), from the same weights."""
    import fnppo
    import fnppo.steps.protocols as step_mod
    from fnppo.testing import synthetic_samples

    layout = fnppo.parallel.current_layout()
    loss = fnppo.losses.from_flat(
        policy_loss="ppo", loss_agg_mode="token-mean", entropy_coeff=0.01, kl_coef=0.05, kl_estimator="k3"
    )
    out: dict = {"calls": {}, "output_layer_calls": {}}
    real = step_mod.linear_logprob_and_entropy
    for fused in (False, True):
        calls = []
        step_mod.linear_logprob_and_entropy = lambda *a, **k: (
            calls.append((k.get("chunk_vocab"), k.get("graphs"))),
            real(*a, **k),
        )[1]
        try:
            chunks = fnppo.build_gpt(_step_model_cfg(tied), **(build or {}))
            fnppo.models.layout_invariant_init(chunks, seed=3)
            core = fnppo.megatron.unwrap.unwrap_model(chunks[-1])
            layer_calls = []
            if core.post_process:
                core.output_layer.register_forward_hook(lambda *a: layer_calls.append(1))
            ddp = fnppo.wrap_ddp(chunks, use_distributed_optimizer=True)
            state = fnppo.TrainState(
                model=ddp, optimizer=fnppo.build_optimizer(ddp, lr=10.0, adam_eps=10.0, clip_grad=0.0)
            )
            init = fnppo.models.gather_full_weights(state.model)
            frozen = fnppo.models.snapshot_params(state.model)
            samples = fnppo.shard_for_data_parallel(synthetic_samples(8, seed=7), layout)
            cache = fnppo.ops.BackwardGraphs(row_multiple=8) if graphs and fused else None
            fns = fnppo.StepFns.fused(chunk_vocab=chunk_vocab, graphs=cache) if fused else fnppo.StepFns()
            cfg = fnppo.StepConfig(loss=loss, num_microbatches=2, temperature=0.9, fns=fns)
            lp, ent = fnppo.compute_logprobs(state.model, samples, with_entropy=True, config=cfg)
            state, metrics = fnppo.train_step(state, samples, cfg)
            lp_ref, _ = fnppo.compute_logprobs(state.model, samples, params=frozen, config=cfg)
            full = fnppo.models.gather_full_weights(state.model)
        finally:
            step_mod.linear_logprob_and_entropy = real
        out["calls"][fused] = len(calls)
        out.setdefault("chunk_vocab", {})[fused] = {c for c, _ in calls}
        out.setdefault("graphs", {})[fused] = {id(g) if g is not None else None for _, g in calls}
        out.setdefault("graph_calls", {})[fused] = (
            None if not (graphs and fused) else (id(cache), cache.eager_calls, cache.nbytes())
        )
        out["output_layer_calls"][fused] = len(layer_calls)
        out[fused] = dict(lp=lp, ent=ent, lp_ref=lp_ref, metrics=metrics, update={k: full[k] - init[k] for k in full})
    return out


def _compare_fused(out: dict, what: str) -> None:
    a, b = out[False], out[True]
    for key in ("loss", "grad_norm", "pg_loss", "entropy", "kl_loss"):
        r, g = a["metrics"][key], b["metrics"][key]
        assert abs(g - r) <= 1e-5 * max(abs(r), 1e-12), f"{what}: {key} fused {g} vs unfused {r}"
    for name in ("lp", "ent", "lp_ref"):
        for x, y in zip(b[name], a[name]):
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5, msg=f"{what}: {name}")
    assert set(a["update"]) == set(b["update"])
    for k, u in a["update"].items():
        err = float((b["update"][k] - u).abs().max() / u.abs().max().clamp_min(1e-12))
        assert err <= 1e-5, f"{what}: update of {k} differs by {err:.2e} (relative)"


@pytest.mark.slow
def test_step_fused_output_equals_unfused_one_process():
    from fnppo.testing import run_ranks

    for tied in (True, False):
        out = run_ranks(step_worker, 1, tied)[0]
        _compare_fused(out, f"1 process, tied={tied}")
        # the fused path ran, and the output layer did not
        assert out["calls"][True] > 0 and out["calls"][False] == 0
        assert out["output_layer_calls"][True] == 0 and out["output_layer_calls"][False] > 0


def test_step_fused_output_chunk_vocab_reaches_the_function_and_changes_no_number():
    """``StepFns.fused(chunk_vocab=7)``: the same numbers, the chunk reaches the function; a chunk
    that is not an int >= 1 is refused by name."""
    from fnppo.testing import run_ranks

    out = run_ranks(step_worker, 1, True, None, 7)[0]  # 7 of 64 rows per block: 10 blocks
    _compare_fused(out, "chunk_vocab=7")
    assert out["calls"][True] > 0 and out["chunk_vocab"][True] == {7}
    for bad in (0, -3, 2.5, True):
        with pytest.raises(InputError) as info:
            fnppo.StepFns.fused(chunk_vocab=bad)
        check_message(info.value, InputError, "fnppo.FusedHead", "chunk_vocab", "an int >= 1 or None", repr(bad))


def test_step_fused_output_graphs_reach_the_function_and_change_no_number():
    """``StepFns.fused(graphs=cache)``: every fused call gets the cache the caller owns, the backward
    runs through its buffers (eagerly on CPU), and the step's numbers equal the unfused step's."""
    from fnppo.testing import run_ranks

    out = run_ranks(step_worker, 1, True, None, None, True)[0]
    _compare_fused(out, "graphs")
    cache_id, eager_calls, nbytes = out["graph_calls"][True]
    assert out["graphs"][True] == {cache_id} and eager_calls == 2 and nbytes > 0  # two micro-batches, one backward each


@pytest.mark.parametrize(
    "recompute",
    [
        dict(recompute_granularity="selective", recompute_modules=["mlp", "core_attn"]),
        dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
    ],
    ids=["selective-mlp", "full"],
)
def test_step_fused_output_with_activation_recomputation(recompute):
    """Recomputation (what lets the fused path's larger micro-batches fit) changes no number: fused
    equals unfused, and both equal the step without recomputation."""
    from fnppo.testing import run_ranks

    plain, out = run_ranks(step_worker, 1, True)[0], run_ranks(step_worker, 1, True, recompute)[0]
    _compare_fused(out, f"recompute {recompute}")
    for fused in (False, True):
        for key in ("loss", "grad_norm"):
            r, g = plain[fused]["metrics"][key], out[fused]["metrics"][key]
            assert abs(g - r) <= 1e-6 * abs(r), (fused, key, g, r)


@pytest.mark.slow
@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)], ids=["tp2", "pp2-tied"])
def test_step_fused_output_equals_unfused_parallel(tp, pp):
    from fnppo.testing import run_ranks

    outs = run_ranks(step_worker, 2, True, tp=tp, pp=pp)
    _compare_fused(outs[0], f"tp={tp} pp={pp}")
    last = outs[-1]  # the last pipeline stage (every rank under TP)
    assert last["calls"][True] > 0 and last["output_layer_calls"][True] == 0


def test_fused_stage_values():
    """``StepFns.fused`` builds the head stage (the forward stops before the output layer), which
    survives ``replace``; a head with the wrong forward or logprob stage is refused by name."""
    import dataclasses

    import fnppo
    from fnppo.megatron.forward import forward_hidden, forward_logits
    from fnppo.steps import FusedHead

    cache = BackwardGraphs()
    fns = fnppo.StepFns.fused(chunk_vocab=5, graphs=cache)
    assert fns.forward is forward_hidden and fns.head == FusedHead(chunk_vocab=5, graphs=cache)
    assert fns.head.graphs is cache  # the caller's object, not a copy
    cfg = fnppo.StepConfig(fns=fns)
    assert dataclasses.replace(cfg, temperature=2.0).fns.head.graphs is cache
    assert fnppo.StepConfig().fns.head is None and fnppo.StepConfig().fns.forward is forward_logits
    assert not hasattr(cfg, "fused_output")  # one way to ask for the fused head: the stage value
    with pytest.raises(InputError) as info:
        fnppo.StepFns(head=FusedHead())
    check_message(info.value, InputError, "StepFns", "forward", "forward_hidden when head is set", "forward_logits")
    with pytest.raises(InputError) as info:
        fnppo.StepFns(forward=forward_hidden, head=FusedHead(), logprob=lambda *a, **k: None)
    check_message(info.value, InputError, "StepFns", "logprob", "the default when head is set", "")
    with pytest.raises(InputError) as info:
        fnppo.StepFns.fused(chunk_vocab=3, head=FusedHead())
    check_message(info.value, InputError, "StepFns.fused", "head", "None when chunk_vocab or graphs is given", "")
    for bad, name in ((0, "chunk_vocab"), ("yes", "graphs")):
        with pytest.raises(InputError) as info:
            FusedHead(**{name: bad})
        check_message(info.value, InputError, "fnppo.FusedHead", name, "", repr(bad))


# ---------------------------------------------------------------------------------------------
# Tensor parallelism with shard maxima far apart and with ties across shards (fused path)
# ---------------------------------------------------------------------------------------------
LARGE_HIDDEN, LARGE_VOCAB = 10, 48  # 24 weight rows per rank under TP=2


def _large_tp_problem():
    """Hidden states and weight whose logits sit near +105 on rank 0's rows and +15 on rank 1's
    (maxima ~90 apart) for tokens 0-3, the reverse (-5 / +85) for tokens 4-7, and, for tokens 8-11,
    the same values on both ranks (rank 1's rows repeat rank 0's): tied maxima. Column 0 of the
    hidden state is a constant 1 carrying +50, column 1 the +-45 split between the halves."""
    g = torch.Generator().manual_seed(32)
    half, free = LARGE_VOCAB // 2, LARGE_HIDDEN - 2
    w_free = torch.randn(half, free, generator=g) * 0.5
    w = torch.cat(
        [
            torch.cat([torch.full((half, 1), 50.0), torch.full((half, 1), 45.0), w_free], dim=1),
            torch.cat([torch.full((half, 1), 50.0), torch.full((half, 1), -45.0), w_free], dim=1),
        ]
    )
    side = torch.tensor([1.0] * 4 + [-1.0] * 4 + [0.0] * 4)
    h = torch.cat([torch.ones(12, 1), side[:, None], torch.randn(12, free, generator=g)], dim=1)
    labels = torch.randint(0, LARGE_VOCAB, (12,), generator=g)
    labels[:4] = torch.tensor([0, half - 1, half, LARGE_VOCAB - 1])  # labels in both halves
    labels[8:10] = torch.tensor([3, half + 3])  # the same logit on both ranks
    return h, w, labels, torch.randn(12, generator=g), torch.randn(12, generator=g)


LARGE_CASES = [(dtype, t) for dtype in ("float32", "bfloat16") for t in (1.0, 0.5)]


def large_tp_worker() -> dict:
    """Each rank's rows of the weight: (log-probs, entropy, hidden gradient share, weight gradient shard)."""
    from fnppo.megatron.parallel import current_layout

    layout = current_layout()
    h, w, labels, g_lp, g_h = _large_tp_problem()
    shard = LARGE_VOCAB // layout.tp
    out = {}
    for dtype, t in LARGE_CASES:
        hs = h.to(getattr(torch, dtype)).clone().requires_grad_()
        ws = w[layout.tp_rank * shard : (layout.tp_rank + 1) * shard].to(getattr(torch, dtype)).clone().requires_grad_()
        lp, ent = linear_logprob_and_entropy(hs, ws, labels, tp_group=layout.tp_group, temperature=t, chunk_vocab=5)
        ((lp * g_lp).sum() + (ent * g_h).sum()).backward()
        out[dtype, t] = (lp.detach(), ent.detach(), hs.grad, ws.grad)
    return out


@pytest.mark.slow
def test_tensor_parallel_large_magnitudes_and_ties_match_fp64():
    """TP=2 log-probs, entropies and both gradients equal the fp64 reference over the full weight when
    the shards' maxima are ~90 apart (either way round) and when they tie."""
    from fnppo.testing import run_ranks

    outs = run_ranks(large_tp_worker, 2, tp=2)
    h, w, labels, g_lp, g_h = _large_tp_problem()
    for dtype_name, t in LARGE_CASES:
        dtype = getattr(torch, dtype_name)
        hd, wd = h.to(dtype), w.to(dtype)
        rlp, rent, rdh, rdw = reference(hd, wd, labels, t, g_lp, g_h)
        what = f"{dtype_name} T={t}"
        for o in outs:
            lp, ent, _, _ = o[dtype_name, t]
            assert bool(torch.isfinite(lp).all() and torch.isfinite(ent).all()), what
            torch.testing.assert_close(lp.double(), rlp, rtol=1e-6, atol=1e-4, msg=what)
            torch.testing.assert_close(ent.double(), rent, rtol=1e-6, atol=1e-4, msg=what)
        dh = outs[0][dtype_name, t][2].double() + outs[1][dtype_name, t][2].double()  # Megatron sums the shares
        dw = torch.cat([o[dtype_name, t][3] for o in outs], dim=0)
        assert bool(torch.isfinite(dh).all() and torch.isfinite(dw).all()), what
        eps = 2.0**-7 if dtype == torch.bfloat16 else 2e-6  # dh: two bf16 shares added
        for got, ref in ((dh, rdh), (dw.double(), rdw)):
            err = (got - ref).abs()
            tol = eps * ref.abs() + 1e-5 * max(1.0, ref.abs().max().item())
            assert bool((err <= tol).all()), f"{what}: gradient max err {err.max().item():.3g}"
