"""M2PO's second-moment trust region as one batch-global cutoff (pure torch, no Megatron).

M2PO masks the tokens with the largest squared log-ratio ``m_t = d_t^2`` between the proximal
(trainer's old) and the behaviour (rollout) log-probs, ``d_t = logp_old_t - logp_rollout_t``, until
the mean of ``m`` over the kept tokens of the batch is below a threshold ``tau``. Whether a token is
kept depends on every token of the batch, so the rule is reduced to one number, the *cutoff* ``c``
(a token is kept iff ``m_t < c``), computed from all the valid tokens of the mini-batch (every
micro-batch, every data-parallel rank) before the schedule runs: the loss is then the same whatever
the split and layout (the existing normalizers work the same way).

With ``s_0 >= s_1 >= ... >= s_{n-1}`` the sorted values and ``k`` the first index with
``mean(s_k, ..., s_{n-1}) < tau``: ``c = +inf`` when ``k = 0`` (nothing masked), else ``c = s_{k-1}``
(the tokens tied with the last masked value are masked too, so ties are broken by value, never by
position). When no suffix is below ``tau``, only the tokens equal to the smallest value are kept (AReaL
keeps one token). The kept mean is then below ``tau`` whenever any suffix mean is.

Reference: M2PO, "Prosperity before Collapse: How Far Can Off-Policy RL Reach with Stale Data on
LLMs?" (arXiv:2510.01161); AReaL ``_apply_m2po_masking`` / ``_get_m2po_loss_mask`` (PR #480), where the
statistic is per micro-batch.
"""

from __future__ import annotations

import math

import torch

from fnppo.core.errors import check_finite, describe, input_error
from fnppo.core.losses.checks import finite_number
from fnppo.core.typing import Float, Scalar, Tensor, typechecked

__all__ = ["m2po_cutoff", "m2_values", "check_m2_cutoff"]


def check_m2_cutoff(fn: str, cutoff: float | Tensor, arg: str = "m2_cutoff") -> None:
    """A cutoff is a number ``> 0`` or ``+inf`` (keep every token), never NaN: a NaN cutoff would mask
    nothing (``m >= NaN`` is False) and one ``<= 0`` everything (``m >= 0`` always).

    Raises:
        InputError: naming ``arg``.
    """
    if isinstance(cutoff, Tensor):
        ok = cutoff.numel() == 1 and cutoff.is_floating_point() and bool(cutoff > 0)  # False for NaN
        if not ok:
            value = describe(cutoff) + (f" = {cutoff.item()!r}" if cutoff.numel() == 1 else "")
            raise input_error(
                fn,
                arg,
                "a number > 0 or inf (m2po_cutoff's result; NaN or <= 0 would mask nothing or everything)",
                value,
            )
        return
    ok = (
        not isinstance(cutoff, bool)
        and isinstance(cutoff, (int, float))
        and (finite_number(cutoff) or cutoff == math.inf)
    )
    if not (ok and cutoff > 0):
        raise input_error(
            fn,
            arg,
            "a number > 0 or inf (m2po_cutoff's result; NaN or <= 0 would mask nothing or everything)",
            repr(cutoff),
        )


@typechecked
def m2po_cutoff(values: Float[Tensor, " n"], threshold: float) -> Scalar:
    """The cutoff ``c`` of the module docstring for the valid tokens' squared log-ratios ``values``
    (all of the mini-batch, in any order; the result does not depend on it): keep ``m < c``.

    Returns:
        A 0-dim float64 tensor (``inf``: keep all; an empty ``values`` keeps all).

    Raises:
        InputError: a ``threshold`` that is not a finite number > 0 (NaN would keep only the smallest
            value's tokens, a negative one too); NaN/inf in ``values`` (a NaN sorts first and could
            become the cutoff, which masks nothing).
    """
    fn = "fnppo.core.losses.m2po.m2po_cutoff"
    if not (finite_number(threshold) and threshold > 0):
        raise input_error(fn, "threshold", "a finite number > 0", repr(threshold))
    check_finite(fn, "values", values)
    s = torch.sort(values.detach().to(torch.float64), descending=True).values
    n = s.numel()
    inf = torch.full((), math.inf, dtype=torch.float64, device=values.device)
    if n == 0:
        return inf
    suffix_mean = s.flip(0).cumsum(0).flip(0) / torch.arange(n, 0, -1, dtype=torch.float64, device=s.device)
    below = torch.nonzero(suffix_mean < threshold)
    if below.numel() == 0:  # keep the smallest value's tokens only
        return torch.nextafter(s[-1], inf)
    k = int(below[0, 0])
    return inf if k == 0 else s[k - 1]


def m2_values(train: Tensor, rollout: Tensor, mask: Tensor, clamp: float) -> Tensor:
    """The squared clamped log-ratios ``clamp(train - rollout)^2`` of the valid tokens, 1-D float64
    (what :func:`m2po_cutoff` takes; concatenate them over micro-batches and ranks)."""
    m = mask != 0
    d = torch.clamp(train.detach().to(torch.float64) - rollout.detach().to(torch.float64), -clamp, clamp)
    return (d * d)[m]
