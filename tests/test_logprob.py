"""Tests of fnppo.core.ops.logprob.logprob_and_entropy against an fp64 autograd reference."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fnppo.core.errors import InputError, ShapeError
from fnppo.core.ops.logprob import _chunk_rows, logprob_and_entropy
from fnppo.core.typing import typechecking
from tests.logprob_reference import assert_grad_close, fp64_logprob_entropy
from tests.messages import raises_message

REPO = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------------------------------
# The independent reference: fp64 log_softmax and autograd.
# ---------------------------------------------------------------------------------------------
def reference(x, labels, temperature, g_lp=None, g_h=None):
    """fp64 (logprobs, entropy, dL/dx) with L = sum(g_lp * logprobs + g_h * entropy)."""
    xr = x.detach().double()
    # -inf entries: a very negative finite value has p = 0 exactly in fp64 and keeps p log p = 0.
    xr = torch.where(torch.isneginf(xr), torch.full_like(xr, -1e6), xr).requires_grad_()
    lp, ent, loss = fp64_logprob_entropy(xr, labels, temperature, g_lp, g_h)
    (grad,) = torch.autograd.grad(loss, xr) if loss.requires_grad else (torch.zeros_like(xr),)
    return lp.detach(), ent.detach(), grad


def run_ours(x, labels, temperature, g_lp, g_h, **kw):
    xg = x.detach().clone().requires_grad_()
    lp, ent = logprob_and_entropy(xg, labels, temperature=temperature, **kw)
    loss = (lp * g_lp).sum() + (ent * g_h).sum()
    loss.backward()
    return lp, ent, xg.grad


DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("temperature", [1.0, 0.6, 2.5])
def test_values_and_grads_match_fp64(dtype, temperature):
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(3, 7, 53, generator=g) * 4).to(dtype)
    labels = torch.randint(0, 53, (3, 7), generator=g)
    g_lp, g_h = torch.randn(3, 7, generator=g), torch.randn(3, 7, generator=g)
    lp, ent, grad = run_ours(x, labels, temperature, g_lp, g_h, chunk_tokens=4)
    rlp, rent, rgrad = reference(x, labels, temperature, g_lp, g_h)
    assert lp.dtype == torch.float32 and ent.dtype == torch.float32
    assert lp.shape == (3, 7) and ent.shape == (3, 7) and grad.shape == x.shape
    torch.testing.assert_close(lp.double(), rlp, rtol=1e-5, atol=2e-5)
    torch.testing.assert_close(ent.double(), rent, rtol=1e-5, atol=2e-5)
    assert_grad_close(grad, rgrad, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_large_magnitude_logits_no_overflow(dtype):
    g = torch.Generator().manual_seed(2)
    # Spread of 1e4 (essentially one-hot distributions) and an offset of 1e4 with O(1) spread.
    for x in ((torch.randn(6, 40, generator=g) * 1e4), 1e4 + torch.randn(6, 40, generator=g) * 2):
        x = x.to(dtype)
        labels = torch.randint(0, 40, (6,), generator=g)
        g_lp, g_h = torch.randn(6, generator=g), torch.randn(6, generator=g)
        for t in (1.0, 0.5):
            lp, ent, grad = run_ours(x, labels, t, g_lp, g_h)
            rlp, rent, rgrad = reference(x, labels, t, g_lp, g_h)
            assert torch.isfinite(lp).all() and torch.isfinite(ent).all() and torch.isfinite(grad).all()
            # An fp32 logsumexp of values near 1e4 carries an absolute rounding of ~5e-4.
            torch.testing.assert_close(lp.double(), rlp, rtol=1e-6, atol=2e-3)
            torch.testing.assert_close(ent.double(), rent, rtol=1e-6, atol=2e-3)
            # Plus the rounding of the result to the logits' dtype.
            eps = 2.0**-8 if dtype == torch.bfloat16 else 0.0
            err = (grad.double() - rgrad).abs()
            assert bool((err <= eps * rgrad.abs() + 3e-3 * max(1.0, rgrad.abs().max().item())).all()), err.max()


def test_masked_positions_get_zero_gradient():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 9, 31, generator=g)
    labels = torch.randint(0, 31, (4, 9), generator=g)
    mask = (torch.rand(4, 9, generator=g) > 0.4).float()
    g_lp, g_h = torch.randn(4, 9, generator=g) * mask, torch.randn(4, 9, generator=g) * mask
    lp, ent, grad = run_ours(x, labels, 1.3, g_lp, g_h)
    rlp, rent, rgrad = reference(x, labels, 1.3, g_lp, g_h)
    assert bool((grad[mask == 0] == 0).all())
    assert bool((grad[mask == 1] != 0).any())
    assert_grad_close(grad, rgrad, torch.float32)
    torch.testing.assert_close(lp.double(), rlp, rtol=1e-5, atol=1e-5)


def test_neg_inf_logits_are_masked_vocabulary():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(5, 30, generator=g)
    x[:, 20:] = float("-inf")  # e.g. padded vocabulary
    x[1, :19] = float("-inf")  # a row with a single finite entry: p = one-hot, H = 0
    labels = torch.randint(0, 20, (5,), generator=g)
    labels[1] = 19
    g_lp, g_h = torch.randn(5, generator=g), torch.randn(5, generator=g)
    lp, ent, grad = run_ours(x, labels, 0.8, g_lp, g_h, chunk_tokens=2)
    rlp, rent, rgrad = reference(x, labels, 0.8, g_lp, g_h)
    assert torch.isfinite(grad).all()
    assert bool((grad[:, 20:] == 0).all())
    assert ent[1].item() == 0.0 and lp[1].item() == 0.0
    torch.testing.assert_close(lp.double(), rlp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent.double(), rent, rtol=1e-5, atol=1e-5)
    assert_grad_close(grad, rgrad, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_inputs_never_written(dtype):
    g = torch.Generator().manual_seed(5)
    base = torch.randn(8, 3, 64, generator=g, requires_grad=True)
    logits = (base * 2.0).to(dtype)  # a non-leaf, like a model's output
    labels = torch.randint(0, 64, (8, 3), generator=g)
    before_x, before_l = logits.detach().clone(), labels.clone()
    vx, vl = logits._version, labels._version
    lp, ent = logprob_and_entropy(logits, labels, temperature=0.9)
    # Something else that saved the logits (here a plain softmax) must still backpropagate.
    other = torch.softmax(logits.float(), -1)[..., 0].sum()
    (lp.sum() + 0.1 * ent.sum() + other).backward()
    assert logits._version == vx and labels._version == vl
    assert torch.equal(logits.detach(), before_x) and torch.equal(labels, before_l)
    assert base.grad is not None and torch.isfinite(base.grad).all()


def test_without_entropy_returns_none_and_same_logprobs():
    g = torch.Generator().manual_seed(6)
    x = torch.randn(2, 11, 45, generator=g, dtype=torch.float64).float()
    labels = torch.randint(0, 45, (2, 11), generator=g)
    g_lp = torch.randn(2, 11, generator=g)
    xg = x.clone().requires_grad_()
    lp, ent = logprob_and_entropy(xg, labels, temperature=1.7, with_entropy=False)
    assert ent is None
    (lp * g_lp).sum().backward()
    lp2, _ = logprob_and_entropy(x, labels, temperature=1.7)
    assert torch.equal(lp, lp2)
    rlp, _, rgrad = reference(x, labels, 1.7, g_lp, None)
    torch.testing.assert_close(lp.double(), rlp, rtol=1e-5, atol=1e-5)
    assert_grad_close(xg.grad, rgrad, torch.float32)


@pytest.mark.parametrize("which", ["logprobs", "entropy"])
def test_one_output_used(which):
    g = torch.Generator().manual_seed(7)
    x = torch.randn(6, 25, generator=g)
    labels = torch.randint(0, 25, (6,), generator=g)
    up = torch.randn(6, generator=g)
    xg = x.clone().requires_grad_()
    lp, ent = logprob_and_entropy(xg, labels)
    ((lp if which == "logprobs" else ent) * up).sum().backward()
    _, _, rgrad = reference(x, labels, 1.0, up if which == "logprobs" else None, up if which == "entropy" else None)
    assert_grad_close(xg.grad, rgrad, torch.float32)


def test_chunking_does_not_change_results():
    g = torch.Generator().manual_seed(8)
    x = torch.randn(37, 19, generator=g).bfloat16()
    labels = torch.randint(0, 19, (37,), generator=g)
    g_lp, g_h = torch.randn(37, generator=g), torch.randn(37, generator=g)
    outs = [run_ours(x, labels, 0.7, g_lp, g_h, chunk_tokens=c) for c in (1, 5, 37, None)]
    for o in outs[1:]:
        for a, b in zip(outs[0], o, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_default_chunk_keeps_fp32_temporaries_small():
    for n, v, dtype in ((16384, 151936, torch.bfloat16), (4096, 32000, torch.float32), (4, 10, torch.bfloat16)):
        x = torch.empty((n, v), dtype=dtype, device="meta")
        rows = _chunk_rows(x, None)
        if n >= 4096:  # two fp32 [rows, v] temporaries within 1/8 of the logits
            assert 2 * rows * v * 4 <= n * v * x.element_size() / 8
        assert rows >= 16


def test_flat_and_leading_dims_agree():
    g = torch.Generator().manual_seed(9)
    x = torch.randn(2, 3, 4, 17, generator=g)
    labels = torch.randint(0, 17, (2, 3, 4), generator=g)
    lp, ent = logprob_and_entropy(x, labels)
    lp2, ent2 = logprob_and_entropy(x.reshape(-1, 17), labels.reshape(-1))
    assert torch.equal(lp.reshape(-1), lp2) and torch.equal(ent.reshape(-1), ent2)
    lp0, ent0 = logprob_and_entropy(x[:0], labels[:0])
    assert lp0.shape == (0, 3, 4) and ent0.shape == (0, 3, 4)


def test_non_contiguous_logits():
    g = torch.Generator().manual_seed(10)
    full = torch.randn(6, 40, generator=g)
    x = full[:, 10:30]  # row stride 40
    labels = torch.randint(0, 20, (6,), generator=g)
    g_lp, g_h = torch.randn(6, generator=g), torch.randn(6, generator=g)
    lp, ent, grad = run_ours(x, labels, 1.0, g_lp, g_h)
    rlp, rent, rgrad = reference(x, labels, 1.0, g_lp, g_h)
    torch.testing.assert_close(lp.double(), rlp, rtol=1e-5, atol=1e-5)
    assert_grad_close(grad, rgrad, torch.float32)


# ---------------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------------
def _x_l():
    return torch.randn(4, 50), torch.randint(0, 50, (4,))


@pytest.mark.parametrize("bad", [50, -1, 1000])
def test_label_out_of_range_raises(bad):
    x, labels = _x_l()
    labels[2] = bad
    with raises_message(
        "logprob_and_entropy",
        "labels",
        "token ids in [0, 50)",
        f"i64[4] with values in [{int(labels.min())}, {int(labels.max())}] (first bad: {bad})",
    ):
        logprob_and_entropy(x, labels)


def test_label_out_of_range_without_checking_is_nan_not_wrong():
    x, labels = _x_l()
    labels[1] = 50
    with typechecking(False):
        lp, ent = logprob_and_entropy(x, labels)
    assert math.isnan(lp[1].item()) and torch.isfinite(lp[[0, 2, 3]]).all() and torch.isfinite(ent).all()


def test_shape_mismatch_raises():
    x, _ = _x_l()
    labels = torch.randint(0, 50, (5,))
    with raises_message("logprob_and_entropy", "labels", "Integer[Tensor, '*tok']", "i64[5]", ShapeError):
        logprob_and_entropy(x, labels)
    with (
        typechecking(False),
        raises_message(
            "logprob_and_entropy", "labels", "shape (4,) (the logits' leading dims)", "i64[5] with logits f32[4,50]"
        ),
    ):
        logprob_and_entropy(x, labels)


def test_vocab_size_mismatch_raises():
    x, labels = _x_l()
    logprob_and_entropy(x, labels, vocab_size=50)  # no padding: fine
    logprob_and_entropy(x, labels.clamp(max=48), vocab_size=49)  # one padding column: fine
    with raises_message(
        "logprob_and_entropy",
        "vocab_size",
        "at most vocab_shard * tp_size = 50 * 1 = 50 (the real vocabulary; the logits may hold a padded one)",
        "64",
    ):
        logprob_and_entropy(x, labels, vocab_size=64)
    for bad in (0, -3, True):
        with raises_message("logprob_and_entropy", "vocab_size", "None or an int >= 1", repr(bad)):
            logprob_and_entropy(x, labels, vocab_size=bad)
    with raises_message("logprob_and_entropy", "vocab_size", "int | None", "50.0", ShapeError):
        logprob_and_entropy(x, labels, vocab_size=50.0)


# ---------------------------------------------------------------------------------------------
# Padded vocabulary (make_vocab_size_divisible_by): columns >= vocab_size are not in the softmax
# ---------------------------------------------------------------------------------------------
REAL_VOCAB = 151


def _padded_size(vocab: int, divisible: int, tp: int) -> int:
    """Megatron's padding: the next multiple of ``divisible * tp``."""
    m = divisible * tp
    return -(-vocab // m) * m


def padded_problem(divisible: int, tp: int):
    """Logits over the padded vocabulary whose padding columns are large (and one NaN): any use shows."""
    g = torch.Generator().manual_seed(21)
    padded = _padded_size(REAL_VOCAB, divisible, tp)
    x = torch.randn(4, 6, padded, generator=g) * 3
    x[..., REAL_VOCAB:] = 40.0 + torch.randn(4, 6, padded - REAL_VOCAB, generator=g)
    if padded > REAL_VOCAB:
        x[0, 0, -1] = float("nan")
    labels = torch.randint(0, REAL_VOCAB, (4, 6), generator=g)
    labels[0, :3] = torch.tensor([0, REAL_VOCAB - 1, REAL_VOCAB // 2])
    g_lp, g_h = torch.randn(4, 6, generator=g), torch.randn(4, 6, generator=g)
    return x, labels, g_lp, g_h


def _check_padded(lp, ent, grad, x, labels, g_lp, g_h, dtype=torch.float32):
    """Values and gradient equal the fp64 reference over the real vocabulary; padding gets exactly 0."""
    rlp, rent, rgrad = reference(x[..., :REAL_VOCAB], labels, 0.9, g_lp, g_h)
    torch.testing.assert_close(lp.double(), rlp, rtol=1e-5, atol=2e-5)
    if ent is not None:
        torch.testing.assert_close(ent.double(), rent, rtol=1e-5, atol=2e-5)
    assert grad.shape == x.shape
    assert_grad_close(grad[..., :REAL_VOCAB], rgrad, dtype)
    assert bool((grad[..., REAL_VOCAB:] == 0).all()), "a padding column got a gradient"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("divisible", [1, 2, 128])
def test_padded_vocab_tp1_matches_real_vocab_fp64(divisible, dtype):
    x, labels, g_lp, g_h = padded_problem(divisible, 1)
    x = x.to(dtype)
    for chunk in (None, 5):
        lp, ent, grad = run_ours(x, labels, 0.9, g_lp, g_h, vocab_size=REAL_VOCAB, chunk_tokens=chunk)
        _check_padded(lp, ent, grad, x, labels, g_lp, g_h, dtype)
        xg = x.clone().requires_grad_()
        lp2, none = logprob_and_entropy(
            xg, labels, temperature=0.9, vocab_size=REAL_VOCAB, with_entropy=False, chunk_tokens=chunk
        )
        (lp2 * g_lp).sum().backward()
        assert none is None and torch.equal(lp2, lp)
        _check_padded(lp2, None, xg.grad, x, labels, g_lp, None, dtype)


def test_label_in_padding_raises():
    x, labels, _, _ = padded_problem(128, 1)
    labels[1, 2] = REAL_VOCAB  # a padding id: a real column of the logits, but no token
    with raises_message(
        "logprob_and_entropy",
        "labels",
        f"token ids in [0, {REAL_VOCAB}) (vocab_size)",
        f"i64[4,6] with values in [0, {REAL_VOCAB}] (first bad: {REAL_VOCAB})",
    ):
        logprob_and_entropy(x, labels, vocab_size=REAL_VOCAB)
    with typechecking(False):
        lp, ent = logprob_and_entropy(x, labels, vocab_size=REAL_VOCAB)
    assert math.isnan(lp[1, 2].item()) and torch.isfinite(ent).all()


def padded_tp_worker() -> dict:
    """Each rank's shard of the padded logits, for every ``make_vocab_size_divisible_by``."""
    from fnppo.megatron.parallel import current_layout

    layout = current_layout()
    out = {}
    for divisible in (1, 2, 128):
        x, labels, g_lp, g_h = padded_problem(divisible, layout.tp)
        shard = x.shape[-1] // layout.tp
        xs = x[..., layout.tp_rank * shard : (layout.tp_rank + 1) * shard].clone().requires_grad_()
        lp, ent = logprob_and_entropy(
            xs, labels, tp_group=layout.tp_group, temperature=0.9, vocab_size=REAL_VOCAB, chunk_tokens=7
        )
        ((lp * g_lp).sum() + (ent * g_h).sum()).backward()
        out[divisible] = (lp.detach(), ent.detach(), xs.grad)
    return out


@pytest.mark.slow
def test_padded_vocab_tp2_matches_real_vocab_fp64():
    from fnppo.testing import run_ranks

    outs = run_ranks(padded_tp_worker, 2, tp=2)
    for divisible in (1, 2, 128):
        x, labels, g_lp, g_h = padded_problem(divisible, 2)
        grad = torch.cat([o[divisible][2] for o in outs], dim=-1)
        for o in outs:  # every TP rank returns the full per-token values
            _check_padded(o[divisible][0], o[divisible][1], grad, x, labels, g_lp, g_h)


def test_non_floating_logits_raise():
    _, labels = _x_l()
    xi = torch.randint(0, 5, (4, 50))
    with raises_message("logprob_and_entropy", "logits", "Float[Tensor, '*tok vocab_shard']", "i64[4,50]", ShapeError):
        logprob_and_entropy(xi, labels)
    with (
        typechecking(False),
        raises_message("logprob_and_entropy", "logits", "a floating tensor (fp32, bf16, fp16 or fp64)", "i64[4,50]"),
    ):
        logprob_and_entropy(xi, labels)


@pytest.mark.parametrize("t", [0.0, -1.0, float("nan"), float("inf")])
def test_bad_temperature_raises(t):
    x, labels = _x_l()
    with raises_message("logprob_and_entropy", "temperature", "a finite float > 0", repr(t)):
        logprob_and_entropy(x, labels, temperature=t)


def test_bad_impl_raises(monkeypatch):
    x, labels = _x_l()
    with raises_message("logprob_and_entropy", "impl", "one of ('auto', 'triton', 'torch')", "'cuda'"):
        logprob_and_entropy(x, labels, impl="cuda")
    monkeypatch.setenv("FNPPO_LOGPROB_IMPL", "fast")  # no environment variable is read: the default stays "auto"
    torch.testing.assert_close(logprob_and_entropy(x, labels)[0], logprob_and_entropy(x, labels, impl="torch")[0])
    monkeypatch.delenv("FNPPO_LOGPROB_IMPL")
    if os.environ.get("TRITON_INTERPRET", "0") != "1":
        from fnppo.core.kernels import triton_available

        expected = (
            "'torch' or 'auto' for CPU tensors" if triton_available() else "'torch' or 'auto' (Triton is not installed)"
        )
        with raises_message("logprob_and_entropy", "impl", expected, "'triton'"):
            logprob_and_entropy(x, labels, impl="triton")  # CPU tensors, no interpreter


# ---------------------------------------------------------------------------------------------
# Properties
# ---------------------------------------------------------------------------------------------
@settings(max_examples=30, deadline=None)
@given(
    lead=st.lists(st.integers(1, 4), min_size=0, max_size=2),
    vocab=st.integers(1, 40),
    temperature=st.floats(0.2, 5.0),
    scale=st.sampled_from([0.1, 3.0, 30.0]),
    chunk=st.one_of(st.none(), st.integers(1, 7)),
    seed=st.integers(0, 2**16),
)
def test_property_matches_reference_and_shift_invariance(lead, vocab, temperature, scale, chunk, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, vocab, generator=g) * scale
    labels = torch.randint(0, vocab, tuple(lead), generator=g)
    g_lp, g_h = torch.randn(tuple(lead), generator=g), torch.randn(tuple(lead), generator=g)
    lp, ent, grad = run_ours(x, labels, temperature, g_lp, g_h, chunk_tokens=chunk)
    rlp, rent, rgrad = reference(x, labels, temperature, g_lp, g_h)
    torch.testing.assert_close(lp.double(), rlp, rtol=1e-5, atol=1e-5 * max(1.0, scale / temperature))
    torch.testing.assert_close(ent.double(), rent, rtol=1e-5, atol=1e-5 * max(1.0, scale / temperature))
    assert_grad_close(grad, rgrad, torch.float32, scale=max(1.0, scale / temperature))
    # Entropy lies in [0, log V]; a per-token constant added to the logits changes nothing.
    assert bool((ent >= -1e-5).all()) and bool((ent <= math.log(vocab) + 1e-5).all())
    shift = torch.randn((*lead, 1), generator=g).round()
    lp2, ent2 = logprob_and_entropy(x + shift, labels, temperature=temperature, chunk_tokens=chunk)
    torch.testing.assert_close(lp2, lp, rtol=1e-5, atol=1e-4 * max(1.0, scale / temperature))
    torch.testing.assert_close(ent2, ent, rtol=1e-5, atol=1e-4 * max(1.0, scale / temperature))


# ---------------------------------------------------------------------------------------------
# The Triton kernels, through Triton's CPU interpreter (skipped where Triton is not installed)
# ---------------------------------------------------------------------------------------------
_INTERP_SCRIPT = textwrap.dedent(
    """
    import torch
    from fnppo.core.ops.logprob import logprob_and_entropy
    from tests.test_logprob import reference
    g = torch.Generator().manual_seed(11)
    for dtype in (torch.float32, torch.bfloat16):
        for ent_on in (True, False):
            x = (torch.randn(9, 150, generator=g) * 3).to(dtype)
            x[0, 3] = float("-inf"); x[4, :140] = float("-inf")
            labels = torch.randint(140, 150, (9,), generator=g)
            g_lp, g_h = torch.randn(9, generator=g), torch.randn(9, generator=g)
            xg = x.clone().requires_grad_()
            lp, ent = logprob_and_entropy(xg, labels, temperature=0.7, with_entropy=ent_on, impl="triton")
            ((lp * g_lp).sum() + ((ent * g_h).sum() if ent_on else 0)).backward()
            rlp, rent, rgrad = reference(x, labels, 0.7, g_lp, g_h if ent_on else None)
            assert (lp.double() - rlp).abs().max() < 1e-5
            assert ent is None or (ent.double() - rent).abs().max() < 1e-5
            # The interpreter rounds fp32 -> bf16 toward zero (GPUs round to nearest): one bf16 ulp.
            tol = (2e-6 if dtype == torch.float32 else 2**-7) * rgrad.abs() + 1e-6
            assert bool(((xg.grad.double() - rgrad).abs() <= tol).all()), (xg.grad.double() - rgrad).abs().max()
    from tests.test_logprob import REAL_VOCAB, _check_padded, padded_problem
    x, labels, g_lp, g_h = padded_problem(128, 1)  # 105 padding columns, one of them NaN
    for dtype in (torch.float32,):  # (the interpreter's bf16 rounding is checked above)
        xg = x.to(dtype).requires_grad_()
        lp, ent = logprob_and_entropy(xg, labels, temperature=0.9, vocab_size=REAL_VOCAB, impl="triton")
        ((lp * g_lp).sum() + (ent * g_h).sum()).backward()
        _check_padded(lp, ent, xg.grad, x.to(dtype), labels, g_lp, g_h, dtype)
    print("interpreter ok")
    """
)


def test_triton_kernels_in_interpreter():
    pytest.importorskip("triton")
    env = dict(
        os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    )
    proc = subprocess.run(
        [sys.executable, "-c", _INTERP_SCRIPT], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0 and "interpreter ok" in proc.stdout, proc.stdout + proc.stderr


# ---------------------------------------------------------------------------------------------
# Tensor parallelism (gloo ranks, real Megatron process groups)
# ---------------------------------------------------------------------------------------------
TP_SHAPE = (3, 5, 48)


def _full_problem():
    g = torch.Generator().manual_seed(12)
    x = torch.randn(*TP_SHAPE, generator=g) * 3
    labels = torch.randint(0, TP_SHAPE[-1], TP_SHAPE[:-1], generator=g)
    g_lp, g_h = torch.randn(*TP_SHAPE[:-1], generator=g), torch.randn(*TP_SHAPE[:-1], generator=g)
    return x, labels, g_lp, g_h


def tp_worker(dtype_name: str, megatron_bug: bool = False):
    """Each rank takes its shard of the same full logits; returns values, grad shard, collective log.

    With ``megatron_bug``, also runs :func:`megatron_bug_demo` on this rank's shard.
    """
    import torch.distributed as dist

    from fnppo.megatron.parallel import current_layout

    layout = current_layout()
    dtype = getattr(torch, dtype_name)
    x, labels, g_lp, g_h = _full_problem()
    shard = TP_SHAPE[-1] // layout.tp
    xs = x[..., layout.tp_rank * shard : (layout.tp_rank + 1) * shard].to(dtype).clone().requires_grad_()
    before = xs.detach().clone()
    calls = []
    real_all_reduce = dist.all_reduce

    def counting_all_reduce(tensor, *args, **kwargs):
        calls.append(tensor.numel())
        return real_all_reduce(tensor, *args, **kwargs)

    dist.all_reduce = counting_all_reduce
    try:
        lp, ent = logprob_and_entropy(
            xs, labels, tp_group=layout.tp_group, temperature=0.8, vocab_size=TP_SHAPE[-1], chunk_tokens=4
        )
        n_forward = list(calls)
        ((lp * g_lp).sum() + (ent * g_h).sum()).backward()
        n_backward = calls[len(n_forward) :]
    finally:
        dist.all_reduce = real_all_reduce
    errors = []
    for kwargs in (dict(vocab_size=TP_SHAPE[-1]), {}):  # gathered logits; an out-of-range label
        try:
            if kwargs:
                logprob_and_entropy(x, labels, tp_group=layout.tp_group, **kwargs)
            else:
                bad = labels.clone()
                bad[0, 0] = TP_SHAPE[-1]
                logprob_and_entropy(xs.detach(), bad, tp_group=layout.tp_group)
        except InputError as err:
            errors.append(str(err))
    out = dict(
        lp=_np(lp),
        ent=_np(ent),
        grad=_np(xs.grad),
        unchanged=torch.equal(xs.detach(), before),
        n_forward=n_forward,
        n_backward=n_backward,
        errors=errors,
    )
    if megatron_bug:
        out["bug"] = megatron_bug_demo(layout)
    return out


def _np(t):
    return t.detach().float().numpy()


@pytest.fixture(scope="module")
def tp2_outputs():
    """One TP=2 launch (fp32 logits) shared by the TP test and the Megatron regression test."""
    from fnppo.testing import run_ranks

    return run_ranks(tp_worker, 2, "float32", megatron_bug=True, tp=2)


@pytest.mark.slow
@pytest.mark.parametrize("tp", [2, 4])
def test_tensor_parallel_equals_tp1(tp, request):
    from fnppo.testing import run_ranks

    dtype = torch.float32 if tp == 2 else torch.bfloat16
    outs = request.getfixturevalue("tp2_outputs") if tp == 2 else run_ranks(tp_worker, tp, "bfloat16", tp=tp)
    x, labels, g_lp, g_h = _full_problem()
    lp1, ent1, grad1 = run_ours(x.to(dtype), labels, 0.8, g_lp, g_h)
    rlp, rent, rgrad = reference(x.to(dtype), labels, 0.8, g_lp, g_h)
    grad_tp = torch.cat([torch.from_numpy(o["grad"]).to(dtype) for o in outs], dim=-1)  # exact round trip
    for o in outs:
        torch.testing.assert_close(torch.from_numpy(o["lp"]), lp1, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(torch.from_numpy(o["ent"]), ent1, rtol=1e-5, atol=1e-5)
        assert o["unchanged"]
        # Two collectives in the forward, each O(tokens): a max, then [tokens, 3] sums. None backward.
        assert o["n_forward"] == [15, 45] and o["n_backward"] == []
        assert len(o["errors"]) == 2
        assert "already gathered over tensor parallelism" in o["errors"][0]
        assert "argument 'labels' expected token ids in [0, 48)" in o["errors"][1]
    torch.testing.assert_close(grad_tp.float(), grad1.float(), rtol=2.0**-7, atol=1e-6)
    assert_grad_close(grad_tp, rgrad, dtype)


# ---------------------------------------------------------------------------------------------
# The original bug: Megatron's cross-entropy writes into fp32 logits
# ---------------------------------------------------------------------------------------------
def megatron_bug_demo(layout):
    """On this rank's vocab shard (TP from Megatron's parallel state), fp32 logits."""
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    g = torch.Generator().manual_seed(13)
    vocab = 40
    w_full = torch.randn(16, vocab, generator=g)
    h = torch.randn(2, 6, 16, generator=g)
    labels = torch.randint(0, vocab, (2, 6), generator=g)
    shard = vocab // layout.tp
    w = w_full[:, layout.tp_rank * shard : (layout.tp_rank + 1) * shard].clone().requires_grad_()

    def entropy(logits):  # vocab-parallel entropy written the way RL actors do, plus its autograd
        import torch.distributed as dist
        from torch.distributed.nn.functional import all_reduce

        m = logits.detach().amax(-1, keepdim=True)
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=layout.tp_group)
        e = torch.exp(logits - m)
        s = all_reduce(e.sum(-1), group=layout.tp_group)
        ez = all_reduce((e * logits).sum(-1), group=layout.tp_group)
        return torch.log(s) + m.squeeze(-1) - ez / s

    out = {}
    # 1) entropy first, then Megatron CE on the same fp32 logits: backward fails.
    logits = h @ w
    ent = entropy(logits)
    lp = -vocab_parallel_cross_entropy(logits, labels)
    try:
        (lp.sum() + 0.1 * ent.sum()).backward()
        out["entropy_first"] = "no error"
    except RuntimeError as err:
        out["entropy_first"] = str(err)
    # 2) Megatron CE first: no error, but the caller's logits now hold something else.
    logits = h @ w
    before = logits.detach().clone()
    lp_megatron = -vocab_parallel_cross_entropy(logits, labels)
    out["ce_changed_logits"] = not torch.equal(logits.detach(), before)
    # 3) fnppo on the same logits with the same entropy beside it: works, logits unchanged.
    w.grad = None
    logits = h @ w
    before, version = logits.detach().clone(), logits._version
    ent = entropy(logits)
    lp, ent2 = logprob_and_entropy(logits, labels, tp_group=layout.tp_group, vocab_size=vocab)
    (lp.sum() + 0.1 * ent.sum() + 0.1 * ent2.sum()).backward()
    out["ours_unchanged"] = torch.equal(logits.detach(), before) and logits._version == version
    out["ours_lp"], out["megatron_lp"] = _np(lp), _np(lp_megatron)
    out["ours_ent"], out["ref_ent"] = _np(ent2), _np(ent.detach())
    out["grad_finite"] = bool(torch.isfinite(w.grad).all())
    # The full-vocabulary fp64 reference for the log-probs and entropy.
    rlp, rent, _ = reference(h @ w_full, labels, 1.0)
    out["ref_lp64"], out["ref_ent64"] = rlp.numpy(), rent.numpy()
    return out


@pytest.mark.slow
def test_megatron_inplace_bug_is_avoided(tp2_outputs):
    for rank_out in tp2_outputs:
        out = rank_out["bug"]
        assert "modified by an inplace operation" in out["entropy_first"]
        assert out["ce_changed_logits"]
        assert out["ours_unchanged"] and out["grad_finite"]
        t = {k: torch.from_numpy(v).double() for k, v in out.items() if k.endswith(("_lp", "_ent", "_lp64", "_ent64"))}
        torch.testing.assert_close(t["ours_lp"], t["megatron_lp"], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(t["ours_lp"], t["ref_lp64"], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(t["ours_ent"], t["ref_ent64"], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(t["ref_ent"], t["ref_ent64"], rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# Tensor parallelism with shard maxima far apart and with exact ties across shards: the rescaling
# to the global maximum (the all-reduce MAX of the shard maxima) is what keeps these finite.
# ---------------------------------------------------------------------------------------------
LARGE_VOCAB = 48  # 24 columns per rank under TP=2


def _large_tp_problems() -> dict:
    """name -> (full logits [tokens, 48], labels, g_lp, g_h). Per token, rank 0's columns sit near +100
    and rank 1's near +10 (maxima ~90 apart), or the reverse, or both halves hold the same maximum."""
    g = torch.Generator().manual_seed(31)
    half = LARGE_VOCAB // 2
    n = 8

    def noise():
        return torch.randn(n, half, generator=g)

    hi, lo = 100.0 + noise(), 10.0 + noise()
    far = torch.cat([torch.cat([hi[:4], lo[:4]]), torch.cat([lo[4:], hi[4:]])], dim=1)  # rows 0-3: rank 0 high
    shared = noise().round(decimals=1)
    tie = torch.cat([shared, shared.flip(-1)], dim=1) + 60.0  # each half holds the same values: tied maxima
    flat = torch.full((n, LARGE_VOCAB), 75.0)  # every column equal: all ties
    spread = torch.cat([1e4 + noise(), 1e4 - 90.0 + noise()], dim=1)  # offset 1e4, maxima still ~90 apart
    out = {}
    for name, x in (("far", far), ("tie", tie), ("flat", flat), ("spread", spread)):
        labels = torch.randint(0, LARGE_VOCAB, (n,), generator=g)
        labels[:4] = torch.tensor([0, half - 1, half, LARGE_VOCAB - 1])  # labels in both halves
        out[name] = (x, labels, torch.randn(n, generator=g), torch.randn(n, generator=g))
    return out


LARGE_CASES = [(dtype, t) for dtype in ("float32", "bfloat16") for t in (1.0, 0.5)]


def large_tp_worker() -> dict:
    """Each rank's shard of every large-magnitude problem: (log-probs, entropy, gradient shard)."""
    from fnppo.megatron.parallel import current_layout

    layout = current_layout()
    shard = LARGE_VOCAB // layout.tp
    out = {}
    for name, (x, labels, g_lp, g_h) in _large_tp_problems().items():
        for dtype, t in LARGE_CASES:
            xs = x[:, layout.tp_rank * shard : (layout.tp_rank + 1) * shard].to(getattr(torch, dtype))
            xs = xs.clone().requires_grad_()
            lp, ent = logprob_and_entropy(xs, labels, tp_group=layout.tp_group, temperature=t, chunk_tokens=3)
            ((lp * g_lp).sum() + (ent * g_h).sum()).backward()
            out[name, dtype, t] = (lp.detach(), ent.detach(), xs.grad)
    return out


@pytest.mark.slow
def test_tensor_parallel_large_magnitudes_and_ties_match_fp64():
    """TP=2 log-probs, entropies and logit gradients equal the fp64 reference over the gathered
    logits when the shards' maxima are ~90 apart (either way round, also at an offset of 1e4) and when
    they tie exactly."""
    from fnppo.testing import run_ranks

    outs = run_ranks(large_tp_worker, 2, tp=2)
    for name, (x, labels, g_lp, g_h) in _large_tp_problems().items():
        for dtype_name, t in LARGE_CASES:
            dtype = getattr(torch, dtype_name)
            xd = x.to(dtype)
            rlp, rent, rgrad = reference(xd, labels, t, g_lp, g_h)
            grad = torch.cat([o[name, dtype_name, t][2] for o in outs], dim=-1)
            what = f"{name} {dtype_name} T={t}"
            for o in outs:  # every rank returns every token's values
                lp, ent, _ = o[name, dtype_name, t]
                assert bool(torch.isfinite(lp).all() and torch.isfinite(ent).all()), what
                # fp32 statistics of logits near |x| <= 1e4 / T: absolute rounding of the logsumexp
                atol = 2e-3 if name == "spread" else 1e-4
                torch.testing.assert_close(lp.double(), rlp, rtol=1e-6, atol=atol, msg=what)
                torch.testing.assert_close(ent.double(), rent, rtol=1e-6, atol=atol, msg=what)
            assert bool(torch.isfinite(grad).all()), what
            eps = 2.0**-8 if dtype == torch.bfloat16 else 2e-6
            err = (grad.double() - rgrad).abs()
            tol = eps * rgrad.abs() + (3e-3 if name == "spread" else 1e-5) * max(1.0, rgrad.abs().max().item())
            assert bool((err <= tol).all()), f"{what}: gradient max err {err.max().item():.3g}"
