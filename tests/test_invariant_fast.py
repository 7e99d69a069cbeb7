"""The CUDA batch-invariant mode's fast path, in the parts that run without a GPU.

The mode on CUDA keeps the library kernels and shapes their inputs instead (docs/batch-invariance.md):
products with few rows are zero-padded to :data:`~fnppo.core.batch_invariant.CUDA_MIN_ROWS` rows
(:class:`~fnppo.core.batch_invariant.MinRowsProducts`), each packed sequence starts at a multiple of
the flex-attention block and every micro-batch has at least that many tokens
(:mod:`fnppo.steps.plan`), and the choice of kernels is made once per model. The bits on a GPU are
measured by ``benchmarks/batch_invariance.py``; here: the padding is exact (float64 reference,
gradients too), it changes nothing at or above the threshold, the micro-batch shaping keeps every
sample's values where they were, and the kernel choice is recorded on the model's config.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import fnppo
from fnppo.core.batch_invariant import MinRowsProducts, invariant_kernels, min_rows_products
from fnppo.core.collate import collate_microbatch, unpack_per_sample
from fnppo.steps.plan import Plan, _min_tokens


def _operands(rows: int = 70, k: int = 48, n: int = 40):
    g = torch.Generator().manual_seed(0)
    return torch.randn(rows, k, generator=g), torch.randn(n, k, generator=g), torch.randn(n, generator=g)


def test_small_products_run_as_the_first_rows_of_a_padded_product():
    x, w, b = _operands()
    big = F.pad(x[:3], (0, 0, 0, 61))  # the same 3 rows inside a 64-row product
    expect = F.linear(big, w, b)[:3]
    with min_rows_products(64):
        got = {
            "linear": F.linear(x[:3], w, b),
            "matmul": torch.matmul(x[:3], w.t()) + b,
            "operator": (x[:3] @ w.t()) + b,
            "mm": torch.mm(x[:3], w.t()) + b,
            "addmm": torch.addmm(b, x[:3], w.t()),
            "Tensor.addmm": b.expand(3, -1).addmm(x[:3], w.t()),
            "3-d rows": F.linear(x[:3].reshape(1, 3, -1), w, b).reshape(3, -1),
        }
    reference = (x[:3].double() @ w.double().t() + b.double()).float()
    for name, y in got.items():
        assert y.shape == (3, 40), name
        torch.testing.assert_close(y, reference, rtol=1e-5, atol=1e-5, msg=name)
    # the bits of a padded product's rows, not merely close values
    assert torch.equal(got["linear"], expect)
    assert torch.equal(got["3-d rows"], expect)


def test_products_at_or_above_the_threshold_and_other_calls_pass_through():
    x, w, b = _operands()
    seen = []

    class Spy(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func is F.linear:
                seen.append(tuple(args[0].shape))
            return func(*args, **(kwargs or {}))

    with Spy(), MinRowsProducts(64):
        y = F.linear(x, w, b)  # 70 rows: unchanged
        z = F.linear(x[:5], w, b)  # 5 rows: padded to 64
        s = torch.softmax(x[:5], -1)  # not a product
    assert seen == [(70, 48), (64, 48)]
    assert torch.equal(y, F.linear(x, w, b))
    assert z.shape == (5, 40) and torch.equal(s, torch.softmax(x[:5], -1))


def test_padded_products_give_the_plain_gradients():
    x, w, b = _operands(rows=5)
    xs, ws = x.double().requires_grad_(), w.double().requires_grad_()
    ref = (F.linear(xs, ws) * torch.arange(40.0, dtype=torch.float64)).sum()
    ref.backward()
    xp, wp = x.clone().requires_grad_(), w.clone().requires_grad_()
    with min_rows_products(64):
        out = (F.linear(xp, wp) * torch.arange(40.0)).sum()
    out.backward()
    torch.testing.assert_close(xp.grad.double(), xs.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(wp.grad.double(), ws.grad, rtol=1e-5, atol=1e-5)


def test_min_rows_refuses_what_is_not_a_row_count():
    for bad in (0, -3, 2.5, True, "64"):
        try:
            MinRowsProducts(bad)
        except fnppo.InputError as e:
            assert "rows" in str(e) and repr(bad) in str(e)
        else:
            raise AssertionError(f"accepted rows={bad!r}")


def test_micro_batches_are_padded_to_the_minimum_without_moving_a_sample():
    g = torch.Generator().manual_seed(1)
    samples = [
        fnppo.Sample.from_lists(torch.randint(0, 50, (3 + i,), generator=g), torch.randint(0, 50, (4,), generator=g),
                                advantages=float(i))
        for i in range(3)
    ]
    for layout, multiple in (("packed", 8), ("padded", 8)):
        mb = collate_microbatch(samples, layout=layout, pad_to_multiple_of=multiple)
        plan = Plan(model=None, split=("num_microbatches", 1), layout=layout, pad_to_multiple_of=multiple,
                    max_seq_len=None, max_seq_len_source="", dp_group=None, same_length=False, count_multiple=1,
                    min_tokens=100)
        out = _min_tokens(mb, plan)
        rows, length = out.input_ids.shape
        assert rows * length >= 100 and length % multiple == 0, (layout, tuple(out.input_ids.shape))
        assert float(out.loss_mask.sum()) == float(mb.loss_mask.sum())
        for a, c in zip(unpack_per_sample(mb.advantages, mb), unpack_per_sample(out.advantages, out), strict=True):
            assert torch.equal(a, c)
        big = Plan(**{**plan.__dict__, "min_tokens": 1})
        assert _min_tokens(mb, big) is mb  # already large enough: unchanged


def test_the_kernel_choice_is_made_once_per_model(monkeypatch):
    monkeypatch.delenv("FNPPO_BATCH_INVARIANT_KERNELS", raising=False)
    assert invariant_kernels(cuda=False) == "torch"
    assert invariant_kernels(cuda=True) == "fast"
    assert invariant_kernels(cuda=True, moe=True) == "megatron"
    monkeypatch.setenv("FNPPO_BATCH_INVARIANT_KERNELS", "torch")
    assert invariant_kernels(cuda=True, moe=True) == "torch"
    monkeypatch.setenv("FNPPO_BATCH_INVARIANT_KERNELS", "tiles")
    try:
        invariant_kernels(cuda=True)
    except fnppo.InputError as e:
        assert "FNPPO_BATCH_INVARIANT_KERNELS" in str(e) and "'tiles'" in str(e)
    else:
        raise AssertionError("accepted an unknown kernel set")
