"""The policy-gradient loss of PPO-style training: :func:`ppo_loss` (pure torch, no Megatron).

Everything here is a function of per-token tensors in the padded layout ``[batch, seq]`` (the packed
THD layout is ``[1, total]`` plus per-token sequence ids). Position ``t`` of every tensor refers to
the same target token: ``logprobs[b, t]`` is the log-probability of token ``t + 1`` given its prefix
and ``loss_mask[b, t]`` is 1 where that token is a trained response token.

:func:`ppo_loss` combines the parts of a :class:`~fnppo.core.losses.config.LossConfig`: the policy
loss (any callable, :mod:`fnppo.core.losses.policy`), weighted by the rollout correction
(:mod:`fnppo.core.losses.rollout_correction`), plus the entropy bonus and the KL penalty
(:mod:`fnppo.core.losses.kl`), aggregated split-invariantly (:mod:`fnppo.core.losses.aggregate`).
The exceptions to split invariance are ``clip_cov`` and ``kl_cov``, whose token selection uses
statistics of the micro-batch they see (as in their paper).

Metrics. Every metric is a detached fp32 tensor of shape ``[2]``: ``(weighted_sum, weight)``
(:mod:`fnppo.core.metrics`). ``loss``, ``pg_loss``, ``entropy`` and ``kl_loss`` carry the aggregation
numerator and the local denominator, so the finalized ``loss`` equals the full-batch loss and
``loss == pg_loss - entropy_coef * entropy + kl.coef * kl_loss``. Ratios and fractions
(``ppo_kl``, ``pg_clipfrac``, ``pg_clipfrac_lower``, ...) are means over valid tokens.

Validation (mask is 0/1, no NaN/inf at trained positions, sequence ids in range, normalizer >= 0)
costs one device-to-host sync. Positions where the mask is 0 are never read: whatever they hold,
NaN and inf included, the loss, its gradient and the metrics are those of any finite value there
(:func:`fnppo.collate_microbatch`, which builds the micro-batches of :func:`fnppo.train_step` from
samples, is stricter: it refuses NaN/inf at every response position). Validation runs while
call-time type checking is on (see :mod:`fnppo.core.typing`) and is skipped together with it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from fnppo.core.errors import describe, input_error
from fnppo.core.losses.aggregate import Tokens, agg_weights, denominator
from fnppo.core.losses.checks import check_non_empty, describe_value, validate_inputs
from fnppo.core.losses.config import LossConfig
from fnppo.core.losses.kl import kl_penalty
from fnppo.core.losses.m2po import check_m2_cutoff
from fnppo.core.losses.policy import PolicyInputs, loss_name, reads_probabilities
from fnppo.core.losses.rollout_correction import Rules
from fnppo.core.losses.rollout_weights import correction
from fnppo.core.losses.token_staleness import check_ages
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

__all__ = ["ppo_loss"]


def _check_loss_inputs(
    fn: str,
    config: LossConfig,
    old_logprobs: Tensor | None,
    entropy: Tensor | None,
    ref_logprobs: Tensor | None,
    rollout_logprobs: Tensor | None,
    tis_mean: Any,
    m2_cutoff: Any = None,
) -> None:
    """The optional inputs that ``config`` needs are given (and ``tis_mean``, ``m2_cutoff`` only when used)."""
    if old_logprobs is None and config.needs_old_logprobs:
        raise input_error(
            fn,
            "old_logprobs",
            f"a tensor: the policy loss {loss_name(config.policy)!r} reads them"
            + (" (its ratio)" if config.correction is None else " (so does the rollout correction)")
            + " (compute them with fnppo.compute_logprobs, or set LossConfig.bypass_old_logprobs=True "
            "to use the rollout log-probs)",
            "None",
        )
    if config.entropy_coef != 0 and entropy is None:
        raise input_error(fn, "entropy", f"a tensor since entropy_coef={config.entropy_coef!r}", "None")
    if config.kl is not None and config.kl.coef != 0 and ref_logprobs is None:
        raise input_error(fn, "ref_logprobs", f"a tensor since kl.coef={config.kl.coef!r}", "None")
    if config.bypass_old_logprobs and rollout_logprobs is None:
        raise input_error(
            fn, "rollout_logprobs", "a tensor since bypass_old_logprobs=True (they are the old log-probs)", "None"
        )
    if config.correction is not None and rollout_logprobs is None:
        raise input_error(
            fn, "rollout_logprobs", "a tensor since rollout correction (LossConfig.correction) is configured", "None"
        )
    if tis_mean is not None and not (config.correction is not None and config.correction.batch_normalize):
        raise input_error(fn, "tis_mean", "None unless correction.batch_normalize=True", describe_value(tis_mean))
    if m2_cutoff is not None and (config.correction is None or config.correction.m2_threshold is None):
        raise input_error(fn, "m2_cutoff", "None unless correction.m2_threshold is set", describe_value(m2_cutoff))
    if m2_cutoff is not None and (not isinstance(m2_cutoff, Tensor) or typechecking_enabled()):
        check_m2_cutoff(fn, m2_cutoff)  # a tensor costs a sync: checked while checking is on


def _check_probabilities(fn: str, config: LossConfig, old: Tensor | None, mask: Tensor) -> None:
    """A policy loss that reads ``exp(old)`` as a probability (:func:`~fnppo.core.losses.policy.reads_probabilities`:
    DPPO, IPO, KPop) refuses old log-probs above 0 where the mask is 1 (one sync, with checking on)."""
    if old is None or not reads_probabilities(config.policy):
        return
    above = (old > 0) & (mask != 0)
    if bool(above.any()):
        arg = "rollout_logprobs" if config.bypass_old_logprobs else "old_logprobs"
        raise input_error(
            fn,
            arg,
            f"log-probs <= 0 where loss_mask is 1 (the policy loss {loss_name(config.policy)!r} reads exp({arg}) "
            "as the probability of the token)",
            f"{describe(old)} with {int(above.sum())} entries above 0 (max {float(old[mask != 0].max())!r})",
        )


def _policy_term(fn: str, config: LossConfig, x: PolicyInputs, tok: Tokens) -> tuple[Tensor, dict[str, Tensor]]:
    """The policy loss per token (0 off the mask) and its metrics; checks what the callable returned.

    Refused, naming the policy loss: not a ``(tensor, mapping)`` pair, a per-token loss of another
    shape or a non-floating dtype (an integer loss would carry no gradient: it became 0), metrics
    that are not a mapping of names to ``[2]`` floating tensors, and (with checking on) NaN/inf in
    the per-token loss at tokens where the mask and the log-probs it was given are finite: a bug in
    the callable, not a fault of the model (a NaN from NaN log-probs passes on to the step, which
    skips it).
    """
    arg = f"policy loss {loss_name(config.policy)!r}"
    out = config.policy(x)
    if not (isinstance(out, tuple) and len(out) == 2):
        raise input_error(fn, arg, "to return a pair (per_token_loss, metrics)", _short(out))
    pg_tok, extra = out
    if not isinstance(pg_tok, Tensor) or pg_tok.shape != x.logprobs.shape:
        raise input_error(fn, arg, f"a per-token loss of shape {tuple(x.logprobs.shape)}", describe(pg_tok))
    if not pg_tok.is_floating_point():
        raise input_error(fn, arg, "a floating per-token loss (with a gradient)", describe(pg_tok))
    if not isinstance(extra, Mapping):
        raise input_error(fn, arg, "metrics as a dict of names to [2] tensors (weighted_sum, weight)", _short(extra))
    for key, value in extra.items():
        if not (
            isinstance(key, str) and isinstance(value, Tensor) and value.is_floating_point() and value.shape == (2,)
        ):
            raise input_error(
                fn, f"{arg} metrics[{key!r}]", "a floating [2] tensor (weighted_sum, weight)", _short(value)
            )
    if typechecking_enabled():
        bad = tok.m & ~torch.isfinite(pg_tok.detach()) & torch.isfinite(x.logprobs.detach())
        if bool(bad.any()):
            raise input_error(
                fn,
                arg,
                "a finite per-token loss where the log-probs it was given are finite",
                f"{describe(pg_tok)} with {int(bad.sum())} NaN/inf entries at such tokens",
            )
    return torch.where(tok.m, pg_tok.to(tok.zero.dtype), tok.zero), extra


def _short(v: Any) -> str:
    return describe(v) if isinstance(v, Tensor) else f"{type(v).__name__} {v!r}"[:120]


def _importance(
    config: LossConfig,
    train: Tensor,
    rollout_logprobs: Tensor | None,
    tok: Tokens,
    metrics: dict[str, Tensor],
    tis_mean: Any,
    m2_cutoff: Any = None,
) -> tuple[Tensor | None, Tensor]:
    """TIS weights (None without a correction) and the kept tokens; adds ``rollout_kl`` and the TIS metrics.

    ``train`` is the trainer side of the correction: the old log-probs, or ``sg(logp)`` in bypass mode.
    """
    if rollout_logprobs is None:
        return None, tok.mf
    rollout = tok.clean(rollout_logprobs, detach=True)
    metrics["rollout_kl"] = weighted_metric(rollout - train, tok.mf)
    if config.correction is None:
        return None, tok.mf
    rules = Rules.of(config.correction, config.log_ratio_clamp)
    tis, _ = correction(train, rollout, tok.m, tok.seg, rules, tis_mean, m2_cutoff)
    metrics.update(tis.metrics)
    return tis.weights.to(tok.mf.dtype), tis.keep.to(tok.mf.dtype)


def _add_regularizers(
    total_num: Tensor,
    config: LossConfig,
    lp: Tensor,
    entropy: Tensor | None,
    ref_logprobs: Tensor | None,
    tok: Tokens,
    term_w: Tensor,
    local_den: Tensor,
    metrics: dict[str, Tensor],
) -> Tensor:
    """``total_num - entropy_coef * H + kl.coef * KL`` (numerators); adds ``entropy`` / ``kl_loss``."""
    if entropy is not None:
        ent_num = (tok.clean(entropy, detach=config.entropy_coef == 0) * term_w).sum()
        metrics["entropy"] = pair_metric(ent_num, local_den)
        if config.entropy_coef != 0:
            total_num = total_num - config.entropy_coef * ent_num
    if ref_logprobs is not None:
        coef, estimator = (0.0, "k3") if config.kl is None else (config.kl.coef, config.kl.estimator)
        kl_tok = kl_penalty(
            lp if coef != 0 else lp.detach(),
            tok.clean(ref_logprobs, detach=True),
            estimator,
            log_ratio_clamp=config.log_ratio_clamp,
        )
        kl_num = (torch.where(tok.m, kl_tok, tok.zero) * term_w).sum()
        metrics["kl_loss"] = pair_metric(kl_num, local_den)
        if coef != 0:
            total_num = total_num + coef * kl_num
    return total_num


@typechecked
def ppo_loss(
    logprobs: PaddedFloat,
    old_logprobs: PaddedFloat | None,
    advantages: PaddedFloat,
    loss_mask: PaddedMask,
    config: LossConfig,
    *,
    entropy: PaddedFloat | None = None,
    ref_logprobs: PaddedFloat | None = None,
    rollout_logprobs: PaddedFloat | None = None,
    normalizer: float | int | Shaped[Tensor, ""] | None = None,
    seq_ids: Integer[Tensor, "batch seq"] | None = None,
    generator: torch.Generator | None = None,
    tis_mean: float | int | Shaped[Tensor, ""] | None = None,
    m2_cutoff: float | Shaped[Tensor, ""] | None = None,
    staleness: PaddedFloat | None = None,
) -> tuple[Scalar, dict[str, Tensor]]:
    """Policy loss + entropy bonus + KL penalty, aggregated with ``config.agg``.

    Per token: ``l_t = w^TIS_t * pg_t - entropy_coef * H_t + kl.coef * KL_t`` where ``pg_t`` is the
    policy loss ``config.policy``, ``w^TIS`` the truncated importance weight of ``config.correction``
    (:func:`~fnppo.core.losses.rollout_weights.compute_tis_weights`; rejected tokens drop out of all
    three terms but stay in ``N``; with ``batch_normalize`` divided by ``tis_mean``) and
    ``KL_t = kl_penalty(logprobs, ref_logprobs, kl.estimator)``. The scalar loss is
    ``sum_t a_t l_t / N`` with the weights ``a_t`` and the count ``N`` of the aggregation mode
    (:class:`~fnppo.core.losses.aggregate.Aggregation`: ``token-mean``, ``seq-mean-token-sum``,
    ``seq-mean-token-mean``, ``seq-mean-token-sum-norm``).

    ``N`` is ``normalizer`` when given (the step-wide sum of
    :func:`~fnppo.core.losses.aggregate.loss_normalizer`, which makes the sum of micro-batch losses
    equal the full-batch loss), else the local count. ``N = 0`` (no valid token anywhere) gives a loss
    of exactly 0 with zero gradient. ``logprobs`` itself is not checked for NaN/inf: it is the model's
    output, and a non-finite loss makes :func:`fnppo.train_step` skip the update. Positions where
    ``loss_mask`` is 0 are never read, in any argument, whatever the policy loss and layout: NaN or
    inf there leaves the loss, the gradient and the metrics unchanged.

    Bypass mode (``config.bypass_old_logprobs``): ``rollout_logprobs`` replace ``old_logprobs``
    (which may be None and are ignored), so every ratio is ``pi_theta / pi_rollout``, and the
    rollout correction compares ``sg(logprobs)`` with ``rollout_logprobs``.

    Reference: PPO, arXiv:1707.06347 (the policy losses cite their own papers, see
    :mod:`fnppo.core.losses.policy`; rollout correction: :mod:`fnppo.core.losses.rollout_correction`).

    Args:
        logprobs: ``[batch, seq]`` log-probs of the current policy (carries the gradient).
        old_logprobs: log-probs of the proximal policy, the trainer's recompute of the policy that
            generated the data (``fnppo.compute_logprobs``); None (ignored) in bypass mode, and
            allowed for a policy loss that uses no ratio (``gpg``, ``reinforce``) without a
            correction (``ppo_kl`` is then not reported).
        advantages: per-token advantages.
        loss_mask: 0/1 mask of the trained tokens (bool, int or float).
        config: :class:`~fnppo.core.losses.config.LossConfig`.
        entropy: per-token entropy (differentiated); needed when ``entropy_coef != 0``.
        ref_logprobs: reference-policy log-probs; needed when ``kl.coef != 0``. When given, the
            ``kl_loss`` metric is reported (estimator ``"k3"`` when ``config.kl`` is None).
        rollout_logprobs: the rollout engine's log-probs; needed with a correction or in bypass mode.
            When given, ``rollout_kl`` (``mean(logp_rollout - logp_old)``) is reported.
        normalizer: the global denominator (see above).
        seq_ids: packed layout: per-token sequence index within the micro-batch, -1 for no sequence.
        generator: RNG for randomized losses (``clip_cov``).
        tis_mean: with ``correction.batch_normalize``: the global mean TIS weight (the pairs of
            :func:`~fnppo.core.losses.rollout_weights.tis_batch_stats` summed over the step,
            ``sum / count``); None: the mean of this call. A mean of 0 (no kept unit anywhere)
            divides by 1.
        m2_cutoff: with ``correction.m2_threshold``: the M2PO cutoff of the whole mini-batch
            (:func:`~fnppo.core.losses.m2po.m2po_cutoff` of every valid token's squared log-ratio, as
            :func:`fnppo.train_step` computes it before the schedule); None: this call's own.
        staleness: partial rollouts: each token's age in versions (whole numbers >= 0 where
            ``loss_mask`` is 1; ``Microbatch.staleness``, from
            :meth:`~fnppo.core.losses.staleness.Staleness.prepare`), handed to the policy loss as
            ``PolicyInputs.staleness``; a loss whose formula depends on the age
            (``loglinear_decoupled``) uses each token's own. When given, ``token_staleness`` (its mean
            over valid tokens) is reported. None: the policy loss's own scalar, if any.

    Returns:
        ``(loss, metrics)``: the 0-dim loss and ``dict[str, Tensor]`` of detached ``[2]`` metrics
        (see the module docstring): ``loss``, ``pg_loss``, ``ppo_kl`` (``mean(logp_old - logp)``),
        ``pg_clipfrac``, ``pg_clipfrac_lower``, ``entropy`` / ``kl_loss`` (when given), the TIS
        metrics (and ``tis_batch_mean``, ``rollout_rejected_frac``, ``reject_seq_*_frac`` when
        configured), plus whatever the policy loss reports.

    Raises:
        ShapeError: shapes or dtypes that disagree (call-time check).
        InputError: an empty batch; an input the config needs left out (``old_logprobs`` outside
            bypass mode for a ratio-based policy loss or a rollout correction, ``rollout_logprobs``
            in bypass mode or with a correction); ``tis_mean`` without ``correction.batch_normalize``;
            ``m2_cutoff`` without ``correction.m2_threshold``, NaN or not > 0; with checking on,
            old (in bypass mode: rollout) log-probs above 0 for a policy loss that reads them as
            probabilities (DPPO, IPO, KPop); with checking on, a mask that is not 0/1, NaN/inf in
            ``advantages``, ``old_logprobs``, ``ref_logprobs`` or ``rollout_logprobs`` at positions
            where ``loss_mask`` is 1 (only there), ``seq_ids`` out of range, a negative or
            non-finite ``normalizer`` or ``tis_mean``; a policy loss whose output is not per-token.
    """
    fn = "fnppo.ppo_loss"
    check_non_empty(fn, "logprobs", logprobs)
    bypass = config.bypass_old_logprobs
    _check_loss_inputs(fn, config, old_logprobs, entropy, ref_logprobs, rollout_logprobs, tis_mean, m2_cutoff)
    if typechecking_enabled():
        validate_inputs(
            fn,
            loss_mask,
            {
                "advantages": advantages,
                "old_logprobs": None if bypass else old_logprobs,
                "ref_logprobs": ref_logprobs,
                "rollout_logprobs": rollout_logprobs,
                "staleness": staleness,
            },
            normalizer,
            seq_ids,
            tis_mean=tis_mean,
        )
        _check_probabilities(fn, config, rollout_logprobs if bypass else old_logprobs, loss_mask)
        if staleness is not None:
            check_ages(fn, "staleness", staleness, loss_mask)
    tok = Tokens.of(logprobs, loss_mask, seq_ids)
    lp = tok.clean(logprobs, detach=False)
    given = rollout_logprobs if bypass else old_logprobs  # None only for a loss that reads none
    old = lp.detach() if given is None else tok.clean(given, detach=True)
    ages = None if staleness is None else tok.clean(staleness, detach=True)
    inputs = PolicyInputs(
        lp, old, tok.clean(advantages, detach=True), tok.mf, tok.seg, config.log_ratio_clamp, generator, ages
    )
    pg_tok, extra = _policy_term(fn, config, inputs, tok)
    metrics: dict[str, Tensor] = {}
    train = lp.detach() if bypass else old
    tis_w, keep = _importance(config, train, rollout_logprobs, tok, metrics, tis_mean, m2_cutoff)
    if tis_w is not None:
        pg_tok = pg_tok * tis_w
    agg_w, local_den = agg_weights(tok.mf, tok.seg, config.agg.mode, config.agg.scale)
    pg_num = (pg_tok * agg_w).sum()
    metrics["pg_loss"] = pair_metric(pg_num, local_den)
    total_num = _add_regularizers(pg_num, config, lp, entropy, ref_logprobs, tok, agg_w * keep, local_den, metrics)
    loss = total_num / denominator(normalizer, local_den)
    metrics["loss"] = pair_metric(total_num, local_den)
    if given is not None:
        metrics["ppo_kl"] = weighted_metric(old - lp, tok.mf)
    if ages is not None:
        metrics["token_staleness"] = weighted_metric(ages, tok.mf)
    for key, value in extra.items():
        metrics[key] = value.detach().float()
    return loss, metrics
