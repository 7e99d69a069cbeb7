"""The clipped value loss of PPO with a critic: :func:`value_loss` and :class:`ValueLossConfig` (pure torch).

Aggregated like the policy loss (:mod:`fnppo.core.losses.aggregate`), so a step's micro-batch losses
sum to the full-batch loss; :func:`fnppo.critic_step` composes it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from fnppo.core.errors import input_error
from fnppo.core.losses.aggregate import Aggregation, Tokens, agg_weights, denominator, mode_and_scale
from fnppo.core.losses.checks import Checker, check_non_empty, finite_number, validate_inputs
from fnppo.core.metrics import pair_metric, weighted_metric
from fnppo.core.typing import (
    Integer,
    PaddedFloat,
    PaddedMask,
    Scalar,
    Shaped,
    Tensor,
    typechecked,
    typechecking_enabled,
)

__all__ = ["ValueLossConfig", "value_loss"]


def _check_value_clip(fn: str, clip_range: Any) -> None:
    """``clip_range`` is a number >= 0 or None (the one home of this check)."""
    if clip_range is not None and not (finite_number(clip_range) and clip_range >= 0):
        raise input_error(fn, "clip_range", "a number >= 0 or None", repr(clip_range))


@dataclass(frozen=True)
class ValueLossConfig:
    """Configuration of the critic's :func:`value_loss` in :func:`fnppo.critic_step`. Frozen; validated when built.

    Attributes:
        clip_range: value clipping around the rollout-time values, ``>= 0``; ``None``: no clipping
            (then the samples need no ``values``).
        agg: the :class:`~fnppo.core.losses.aggregate.Aggregation` of the per-token losses.

    Raises:
        InputError: ``fnppo.losses.ValueLossConfig: argument 'clip_range' / 'agg' ...``.
    """

    clip_range: float | None = 0.2
    agg: Aggregation = Aggregation()

    def __post_init__(self) -> None:
        fn = "fnppo.losses.ValueLossConfig"
        _check_value_clip(fn, self.clip_range)
        Checker.of(self, fn).need(
            isinstance(self.agg, Aggregation), "agg", "an Aggregation (e.g. Aggregation('token-mean'))"
        )


@typechecked
def value_loss(
    values: PaddedFloat,
    old_values: PaddedFloat,
    returns: PaddedFloat,
    mask: PaddedMask,
    config: ValueLossConfig | float | None = 0.2,
    *,
    loss_agg_mode: str | None = None,
    loss_scale_factor: float | None = None,
    normalizer: float | int | Shaped[Tensor, ""] | None = None,
    seq_ids: Integer[Tensor, "batch seq"] | None = None,
) -> tuple[Scalar, dict[str, Tensor]]:
    """Clipped value loss of PPO with a critic.

    With ``d = V - old_V``: where ``|d| > clip_range`` (the clip is active),
    ``V_clip = old_V + clip(d, -clip_range, clip_range)``, elsewhere ``V_clip = V`` exactly; per
    token ``l_t = 1/2 max((V - R)^2, (V_clip - R)^2)`` (``clip_range=None``: ``1/2 (V - R)^2``),
    aggregated like :func:`fnppo.core.losses.ppo.ppo_loss` (``loss_agg_mode``, ``normalizer``,
    ``seq_ids``). Taking ``V_clip = V`` inside the clip range keeps fp32 rounding of ``old_V + d``
    from ever choosing the clipped branch there, so ``vf_clipfrac`` counts exactly the tokens whose
    loss is the clipped term (the tokens with zero gradient).

    Reference: PPO, arXiv:1707.06347 (value clipping as in the OpenAI baselines implementation);
    explained variance ``1 - Var(R - V) / Var(R)`` as reported by baselines.

    Args:
        values: ``[batch, seq]`` predicted values (carry the gradient).
        old_values, returns: the values at rollout time and the targets (detached).
        mask: 0/1 mask of the trained tokens.
        config: the :class:`ValueLossConfig` (its ``clip_range`` and ``agg``), as ``ppo_loss`` takes
            a ``LossConfig``. Sugar: a number ``>= 0`` or ``None`` is the ``clip_range`` alone, with
            ``loss_agg_mode`` (default ``"token-mean"``) and ``loss_scale_factor`` as the ``mode`` and
            ``scale`` of its aggregation; both must be left None with a ``ValueLossConfig``.
        normalizer, seq_ids: as in :func:`fnppo.core.losses.ppo.ppo_loss`.

    Returns:
        ``(loss, metrics)`` with ``vf_loss`` (numerator, local denominator), ``vf_clipfrac`` (the
        fraction of valid tokens whose loss is the clipped term), ``vpred_mean`` and the token means
        ``vf_returns``, ``vf_returns_sq``, ``vf_error``, ``vf_error_sq`` of ``R``, ``R^2``,
        ``R - V``, ``(R - V)^2``, from which :func:`~fnppo.core.metrics.finalize_metrics` derives the
        exact ``vf_explained_var`` of the whole step.

    Raises:
        InputError: an empty batch, a bad ``clip_range`` or mode, ``loss_agg_mode`` /
            ``loss_scale_factor`` given with a ``ValueLossConfig``; with checking on, as
            :func:`fnppo.core.losses.ppo.ppo_loss` for the mask, NaN/inf (in ``values``,
            ``old_values``, ``returns`` where ``mask`` is 1; other positions are never read),
            ``seq_ids`` and ``normalizer``.
    """
    fn = "fnppo.value_loss"
    check_non_empty(fn, "values", values)
    if isinstance(config, ValueLossConfig):
        for name, v in (("loss_agg_mode", loss_agg_mode), ("loss_scale_factor", loss_scale_factor)):
            if v is not None:
                raise input_error(fn, name, "None when config is a ValueLossConfig (its agg says it)", repr(v))
        clip_range, (mode, scale) = config.clip_range, mode_and_scale(fn, config)
    else:
        clip_range = config
        _check_value_clip(fn, clip_range)
        mode, scale = mode_and_scale(fn, "token-mean" if loss_agg_mode is None else loss_agg_mode, loss_scale_factor)
    if typechecking_enabled():
        validate_inputs(
            fn,
            mask,
            {"values": values, "old_values": old_values, "returns": returns},
            normalizer,
            seq_ids,
            mask_name="mask",
        )
    tok = Tokens.of(values, mask, seq_ids)
    v, old, ret = tok.clean(values, detach=False), tok.clean(old_values, detach=True), tok.clean(returns, detach=True)
    l1 = (v - ret) ** 2
    if clip_range is None:
        per_tok, clipped = 0.5 * l1, torch.zeros_like(tok.m)
    else:
        d = v - old
        active = d.abs() > clip_range
        v_clip = torch.where(active, old + torch.clamp(d, -clip_range, clip_range), v)
        l2 = (v_clip - ret) ** 2
        clipped = active & (l2 > l1)
        per_tok = 0.5 * torch.where(clipped, l2, l1)
    agg_w, local_den = agg_weights(tok.mf, tok.seg, mode, scale)
    num = (per_tok * agg_w).sum()
    loss = num / denominator(normalizer, local_den)
    err = (ret - v).detach()
    return loss, {
        "vf_loss": pair_metric(num, local_den),
        "vf_clipfrac": weighted_metric(clipped.to(tok.mf.dtype), tok.mf),
        "vpred_mean": weighted_metric(v, tok.mf),
        "vf_returns": weighted_metric(ret, tok.mf),
        "vf_returns_sq": weighted_metric(ret * ret, tok.mf),
        "vf_error": weighted_metric(err, tok.mf),
        "vf_error_sq": weighted_metric(err * err, tok.mf),
    }
