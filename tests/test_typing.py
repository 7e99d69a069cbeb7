"""Tests of fnppo.core.typing: the call-time shape/dtype checker, its on/off switch, and the value checks."""

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

from fnppo.core import typing as ft
from fnppo.core.errors import InputError, ShapeError, check_finite, check_mask01, check_range, describe, input_error
from fnppo.core.typing import (
    Float,
    Int,
    Tensor,
    TokenFloat,
    TokenIds,
    set_typechecking,
    typechecked,
    typechecking,
    typechecking_enabled,
)


@typechecked
def matmul(a: Float[Tensor, "b n"], b: Float[Tensor, "n m"]) -> Float[Tensor, "b m"]:
    """Matrix product (a test function)."""
    return a @ b


@typechecked
def wrong_return(a: Float[Tensor, "b n"]) -> Float[Tensor, " b"]:
    return a  # rank 2, annotated rank 1


@typechecked
def count_ids(ids: Int[Tensor, " n"]) -> int:
    return int(ids.numel())


@typechecked
def masked_sum(values: TokenFloat, ids: TokenIds) -> Float[Tensor, ""]:
    return (values * (ids >= 0)).sum()


@typechecked
def raises_inside(a: Float[Tensor, " n"]) -> None:
    raise ValueError("from the body")


@pytest.fixture(autouse=True)
def _checking_on():
    previous = set_typechecking(True)
    yield
    set_typechecking(previous)


# ---------------------------------------------------------------------------------------------
# ShapeError messages
# ---------------------------------------------------------------------------------------------
def test_shape_error_names_function_argument_expected_and_received():
    with pytest.raises(ShapeError) as info:
        matmul(torch.zeros(2, 3), torch.zeros(4, 5))
    first = str(info.value).splitlines()[0]
    assert isinstance(info.value, TypeError)
    assert first == (
        f"{__name__}.matmul: argument 'b' has n=4, but 'a' bound n=3 (shapes [4,5] vs [2,3]); "
        "expected Float[Tensor, 'n m'], received f32[4,5]"
    )


def test_named_dims_are_consistent_across_arguments():
    assert matmul(torch.ones(2, 3), torch.ones(3, 4)).shape == (2, 4)
    with pytest.raises(ShapeError, match="argument 'b' has n=2, but 'a' bound n=3"):
        matmul(torch.ones(2, 3), torch.ones(2, 4))  # n = 3 from a, 2 from b


def test_rank_mismatch_is_an_error():
    with pytest.raises(ShapeError, match=r"argument 'a' has 3 dimension\(s\), expected 2 for dims 'b n'"):
        matmul(torch.ones(2, 3, 1), torch.ones(3, 4))


def test_dtype_mismatch_is_an_error():
    with pytest.raises(ShapeError) as info:
        matmul(torch.ones(2, 3, dtype=torch.int64), torch.ones(3, 4))
    assert "argument 'a' has the wrong dtype" in str(info.value) and "received i64[2,3]" in str(info.value)
    with pytest.raises(ShapeError, match="f32\\[3\\]"):
        count_ids(torch.ones(3))  # float where int expected
    assert count_ids(torch.ones(3, dtype=torch.int32)) == 3


@pytest.mark.parametrize(
    "values,ids,expected",
    [
        (
            torch.zeros(5),
            torch.zeros(4, dtype=torch.long),
            "argument 'ids' has *tok=[4], but 'values' bound *tok=[5] (shapes [4] vs [5])",
        ),
        (
            torch.zeros(2, 5),
            torch.zeros(2, 4, dtype=torch.long),
            "argument 'ids' has *tok=[2,4], but 'values' bound *tok=[2,5] (shapes [2,4] vs [2,5])",
        ),
        (
            torch.zeros(1, 9),
            torch.zeros(1, 8, dtype=torch.long),
            "argument 'ids' has *tok=[1,8], but 'values' bound *tok=[1,9] (shapes [1,8] vs [1,9])",
        ),
    ],
    ids=["1d", "2d", "packed"],
)
def test_shape_error_first_line_points_at_the_mismatch(values, ids, expected):
    with pytest.raises(ShapeError) as info:
        masked_sum(values, ids)
    first, *rest = str(info.value).splitlines()
    assert first.startswith(f"{__name__}.masked_sum: {expected}; expected Integer[Tensor, '*tok'], received i64"), first
    assert rest == ["(set FNPPO_FULL_TYPE_ERRORS=1 for the full type-check report)"]


def test_library_shape_error_names_both_arguments_and_sizes():
    from fnppo.core.losses import ppo_loss
    from fnppo.core.losses.flat import from_flat as PolicyLossConfig

    lp, adv, mask = torch.zeros(2, 4), torch.zeros(2, 5), torch.ones(2, 4)
    with pytest.raises(ShapeError) as info:
        ppo_loss(lp, lp, adv, mask, PolicyLossConfig())
    assert (
        str(info.value)
        .splitlines()[0]
        .endswith(
            "ppo_loss: argument 'advantages' has seq=5, but 'logprobs' bound seq=4 (shapes [2,5] vs [2,4]); "
            "expected Float[Tensor, 'batch seq'], received f32[2,5]"
        )
    )


def test_full_report_only_when_asked(monkeypatch):
    with pytest.raises(ShapeError) as info:
        matmul(torch.zeros(2, 3), torch.zeros(4, 5))
    assert "Called with parameters" not in str(info.value)
    monkeypatch.setenv("FNPPO_FULL_TYPE_ERRORS", "1")
    with pytest.raises(ShapeError) as info:
        matmul(torch.zeros(2, 3), torch.zeros(4, 5))
    msg = str(info.value)
    assert msg.splitlines()[0].startswith(f"{__name__}.matmul: argument 'b' has n=4")
    assert "Called with parameters" in msg and "Actual value: f32[4,5]" in msg


def test_return_value_is_checked():
    with pytest.raises(ShapeError, match="return"):
        wrong_return(torch.ones(2, 3))


def test_non_type_errors_pass_through_unchanged():
    with pytest.raises(ValueError, match="from the body") as info:
        raises_inside(torch.ones(2))
    assert not isinstance(info.value, ShapeError)


def test_wrapper_keeps_metadata():
    assert matmul.__name__ == "matmul" and matmul.__doc__ == "Matrix product (a test function)."
    a, b = torch.ones(2, 3), torch.ones(4, 5)
    # the unchecked original is reachable (used by nothing at call time, but documented)
    with pytest.raises(RuntimeError):  # torch's own error: the shapes really do not multiply
        matmul.__wrapped_unchecked__(a, b)


def test_library_function_is_checked():
    from fnppo.core.ops.logprob import logprob_and_entropy

    with pytest.raises(ShapeError) as info:
        logprob_and_entropy(torch.zeros(2, 3, 8), torch.zeros(2, 4, dtype=torch.int64))
    assert "logprob_and_entropy" in str(info.value) and "labels" in str(info.value)


# ---------------------------------------------------------------------------------------------
# the switch
# ---------------------------------------------------------------------------------------------
def _unchecked_call_goes_through() -> bool:
    """A wrong shape that the function itself accepts: only the checker can reject it."""
    try:
        out = wrong_return(torch.ones(2, 3))
    except ShapeError:
        return False
    assert out.shape == (2, 3)
    return True


def test_set_typechecking_turns_checks_off_and_on():
    assert typechecking_enabled()
    assert set_typechecking(False) is True  # returns the previous setting
    assert not typechecking_enabled()
    assert _unchecked_call_goes_through()
    assert set_typechecking(True) is False
    assert typechecking_enabled()
    assert not _unchecked_call_goes_through()


def test_typechecking_context_restores_even_on_error():
    with typechecking(False):
        assert not typechecking_enabled() and _unchecked_call_goes_through()
        with typechecking(True):
            assert not _unchecked_call_goes_through()
        assert not typechecking_enabled()
    assert typechecking_enabled()
    with pytest.raises(KeyError):
        with typechecking(False):
            raise KeyError("x")
    assert typechecking_enabled() and not _unchecked_call_goes_through()


@pytest.mark.parametrize(
    "value,enabled",
    [("0", False), ("false", False), ("OFF", False), (" no ", False), ("1", True), ("", True), ("yes", True)],
)
def test_env_values(monkeypatch, value, enabled):
    monkeypatch.setenv("FNPPO_TYPECHECK", value)
    assert ft._env_default() is enabled


def test_env_variable_disables_checking_at_import(tmp_path):
    script = textwrap.dedent(
        """
        import torch
        from fnppo.core.typing import Float, Tensor, typechecked, typechecking_enabled, set_typechecking
        from fnppo.core.errors import ShapeError

        @typechecked
        def f(a: Float[Tensor, "b n"]) -> Float[Tensor, "b"]:
            return a

        print("enabled", typechecking_enabled())
        print("shape", tuple(f(torch.ones(2, 3)).shape))
        set_typechecking(True)
        try:
            f(torch.ones(2, 3))
            print("on: no error")
        except ShapeError:
            print("on: ShapeError")
        """
    )
    env = dict(os.environ, FNPPO_TYPECHECK="0", PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    res = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split("\n")[:3] == ["enabled False", "shape (2, 3)", "on: ShapeError"]


# ---------------------------------------------------------------------------------------------
# value checks
# ---------------------------------------------------------------------------------------------
def test_input_error_format():
    err = input_error("fnppo.f", "x", "a positive int", "-1")
    assert isinstance(err, InputError) and isinstance(err, ValueError)
    assert str(err) == "fnppo.f: argument 'x' expected a positive int, received -1"


def test_describe():
    assert describe(torch.zeros(2, 3)) == "f32[2,3]"
    assert describe(torch.zeros((), dtype=torch.bfloat16)) == "bf16[]"
    assert describe(torch.zeros(0, dtype=torch.int64)) == "i64[0]"
    assert describe(torch.zeros(5, dtype=torch.bool)) == "bool[5]"
    assert describe(torch.zeros(1, 2, dtype=torch.float16)) == "f16[1,2]"
    assert describe(torch.zeros(2, dtype=torch.int32)) == "i32[2]"
    assert describe(torch.zeros(2, dtype=torch.complex64)) == "complex64[2]"
    assert describe(3) == "3" and describe("ab") == "'ab'" and describe(None) == "None"


@pytest.mark.parametrize(
    "mask",
    [
        torch.tensor([True, False]),
        torch.tensor([0.0, 1.0, 1.0]),
        torch.tensor([1, 0], dtype=torch.int32),
        torch.zeros(0),
        torch.ones(2, 3, dtype=torch.bfloat16),
    ],
)
def test_check_mask01_accepts_0_1(mask):
    check_mask01("f", "mask", mask)


def test_check_mask01_rejects_other_values():
    with pytest.raises(InputError) as info:
        check_mask01("fnppo.g", "loss_mask", torch.tensor([[0.0, 1.0, 0.5], [1.0, 1.0, 1.0]]))
    assert str(info.value) == "fnppo.g: argument 'loss_mask' expected a 0/1 mask, received f32[2,3] containing 0.5"
    with pytest.raises(InputError, match="i64\\[3\\] containing 2"):
        check_mask01("g", "m", torch.tensor([0, 2, 1]))
    with pytest.raises(InputError, match="containing -1"):
        check_mask01("g", "m", torch.tensor([-1.0, 1.0]))
    with pytest.raises(InputError, match="containing nan"):
        check_mask01("g", "m", torch.tensor([float("nan"), 1.0]))


def test_check_finite():
    check_finite("f", "x", torch.tensor([1.0, -2.0]))
    check_finite("f", "x", None)
    check_finite("f", "x", torch.tensor([1, 2]))  # integers are always finite
    bad = torch.tensor([1.0, float("nan"), float("inf"), -float("inf")])
    with pytest.raises(InputError) as info:
        check_finite("fnppo.h", "advantages", bad)
    assert (
        str(info.value)
        == "fnppo.h: argument 'advantages' expected finite values, received f32[4] with 3 NaN/inf entries"
    )
    # `where`: only positions where it is non-zero count
    check_finite("f", "x", bad, where=torch.tensor([1, 0, 0, 0]))
    with pytest.raises(InputError, match="with 1 NaN/inf entries"):
        check_finite("f", "x", bad, where=torch.tensor([1.0, 0.0, 1.0, 0.0]))
    with pytest.raises(InputError, match="with 2 NaN/inf entries"):
        check_finite("f", "x", bad, where=torch.tensor([False, True, False, True]))


def test_check_range():
    check_range("f", "ids", torch.tensor([0, 5, 9]), 0, 10)
    check_range("f", "ids", torch.zeros(0, dtype=torch.int64), 0, 1)
    with pytest.raises(InputError) as info:
        check_range("fnppo.k", "labels", torch.tensor([[0, 10], [3, 4]]), 0, 10)  # high is exclusive
    assert (
        str(info.value)
        == "fnppo.k: argument 'labels' expected values in [0, 10), received i64[2,2] with values in [0, 10]"
    )
    with pytest.raises(InputError, match=r"values in \[-1, 3\]"):
        check_range("f", "ids", torch.tensor([-1, 3]), 0, 10)


# ---------------------------------------------------------------------------------------------
# property tests
# ---------------------------------------------------------------------------------------------
dims = st.integers(1, 5)


@settings(max_examples=30, deadline=None)
@given(b=dims, n=dims, m=dims)
def test_matching_shapes_pass(b, n, m):
    assert matmul(torch.ones(b, n), torch.ones(n, m)).shape == (b, m)


@settings(max_examples=30, deadline=None)
@given(b=dims, n=dims, n2=dims, m=dims)
def test_mismatched_inner_dim_fails(b, n, n2, m):
    if n == n2:
        n2 = n + 1
    with pytest.raises(ShapeError):
        matmul(torch.ones(b, n), torch.ones(n2, m))


@settings(max_examples=30, deadline=None)
@given(shape=st.lists(dims, min_size=0, max_size=3), data=st.data())
def test_variadic_token_dims(shape, data):
    values, ids = torch.ones(shape), torch.zeros(shape, dtype=torch.int64)
    assert float(masked_sum(values, ids)) == math.prod(shape)
    other = data.draw(st.lists(dims, min_size=0, max_size=3).filter(lambda s: s != shape))
    with pytest.raises(ShapeError):
        masked_sum(values, torch.zeros(other, dtype=torch.int64))
    with typechecking(False):  # unchecked: broadcasting may or may not succeed, but no ShapeError
        try:
            masked_sum(values, torch.zeros(other, dtype=torch.int64))
        except RuntimeError:
            pass
