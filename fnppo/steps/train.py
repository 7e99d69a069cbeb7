"""The training steps: the pure stages composed inside Megatron's own pipeline schedule.

This module knows the order of the stages::

    train_step:   build_microbatches (split_batch -> collate) -> forward_logits -> logprob -> ppo_loss
                      -> (Megatron backward) -> finalize_grads -> optimizer
    critic_step:  build_microbatches (split_batch -> collate) -> forward_values -> value_loss
                      -> (Megatron backward) -> finalize_grads -> optimizer

Both run one update mechanism (:func:`_update`: micro-batches, the global loss normalizer, the
schedule with fnppo's finalizer, the finalize check, the non-finite skip, the optimizer step);
they differ only in the :class:`_Objective` it is given. Each call works out its
:class:`~fnppo.steps.plan.Plan` once, behind the entry checks agreed over every rank
(:mod:`fnppo.steps.checks`), and passes it down. State that persists (model chunks, optimizer,
step counter) lives in :class:`~fnppo.steps.config.TrainState`, which is passed in and returned.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import torch
from torch import nn

from fnppo.core.batching.sample import Microbatch, Sample
from fnppo.core.batching.split import SplitPlan
from fnppo.core.losses.token_staleness import check_ages_given
from fnppo.core.metrics import finalize_metrics, merge_metrics, reduce_metrics
from fnppo.megatron.grads import FinalizeNotCalledError
from fnppo.megatron.moe import router_derived_metrics
from fnppo.megatron.parallel import ParallelLayout, agree_on_refusal, current_layout
from fnppo.megatron.unwrap import check_head
from fnppo.steps.checks import (
    check_config,
    check_critic_targets,
    check_old_logprobs,
    check_probabilities,
    check_rollout_logprobs,
    checked_plan,
)
from fnppo.steps.config import Batching, CriticConfig, StepConfig, TrainState
from fnppo.steps.objective import check_objective, objective_stages, uses_terms
from fnppo.steps.plan import Plan, microbatches, model_facts, split_plan, with_cp_in_dp, without_routes
from fnppo.steps.protocols import CollateFn
from fnppo.steps.schedule import (
    fnppo_finalizer,
    global_m2_cutoff,
    global_normalizer,
    global_sums,
    onpolicy_max,
    policy_forward_step,
    routers,
    run_schedule,
    value_forward_step,
)

__all__ = ["train_step", "critic_step"]


class _Objective(NamedTuple):
    """What one update optimizes: the parts in which :func:`train_step` and :func:`critic_step` differ.

    ``global_sums(mbs, layout, device)`` runs before the schedule (the loss normalizer, summed over
    micro-batches and DP ranks, and whatever else the loss needs of the whole mini-batch);
    ``forward_step(sums, loss_scale)`` is Megatron's ``forward_step_func`` for those sums.
    """

    fn: str  # the public function, named in errors
    collate: CollateFn
    global_sums: Callable[[Sequence[Microbatch], ParallelLayout, torch.device], Any]
    forward_step: Callable[[Any, float], Callable[[Iterator[Microbatch], nn.Module], Any]]
    loss_key: str  # the metric whose non-finite value skips the update


def _update(
    state: TrainState, minibatch: Sequence[Sample], split: SplitPlan, objective: _Objective, plan: Plan
) -> tuple[dict[str, torch.Tensor], float, bool, torch.Tensor]:
    """One optimizer update on one mini-batch (split by ``split``): the five steps of :func:`train_step`
    (and of :func:`critic_step`, with its objective).

    Returns:
        ``(metrics, grad_norm, stepped, onpolicy)``: metric pairs reduced over micro-batches and DP
        ranks (identical on every rank), the global grad norm, whether the optimizer stepped, and
        the on-policy gaps of this update's forward (:func:`~fnppo.steps.schedule.onpolicy_max`;
        zeros for the critic).

    Raises:
        FinalizeNotCalledError: Megatron's schedule returned without calling the finalizer.
    """
    model, optimizer = plan.model, state.optimizer
    layout, device = model.layout, model.device
    _, mbs = microbatches(minibatch, plan, objective.collate, split)
    sums = objective.global_sums(mbs, with_cp_in_dp(layout), device)
    for c in model.chunks:
        c.zero_grad_buffer()
    optimizer.zero_grad()
    with fnppo_finalizer(model) as record, routers(model, mbs) as moe:
        # MoE: the loss is scaled by the step's router token count instead, so that the
        # routers' aux/z losses get exact weights (fnppo.megatron.moe.router_step).
        scale = moe.loss_scale if moe is not None else float(len(mbs) * layout.dp)
        store = run_schedule(model, mbs, objective.forward_step(sums, scale), forward_only=False)
    if "stats" not in record:
        raise FinalizeNotCalledError(
            f"{objective.fn}: Megatron's schedule returned without calling finalize_model_grads; "
            "gradients were not reduced across data-parallel ranks"
        )
    stats = record["stats"]
    per_microbatch = [s["metrics"] for s in store] if layout.is_last_stage else []
    summed = with_cp_in_dp(layout)  # every token once over data x context parallelism
    metrics = reduce_metrics(
        per_microbatch,
        device=device,
        dp_group=summed.dp_group if summed.dp > 1 else None,
        pp_group=layout.pp_group if layout.pp > 1 else None,
        is_last_stage=layout.is_last_stage,
    )
    if moe is not None:
        metrics.update(moe.metrics)
    gaps = onpolicy_max(
        store if layout.is_last_stage else [], layout, summed.dp_group if summed.dp > 1 else None, device
    )
    finite = stats.finite and bool(torch.isfinite(metrics.get(objective.loss_key, torch.zeros(2))).all())
    if finite:
        ok, _norm, _zeros = optimizer.step()
        finite = bool(ok)
    return metrics, float(stats.grad_norm), finite, gaps


def _train(
    state: TrainState, samples: list[Sample], objective: _Objective, config: Batching, plan: Plan
) -> tuple[TrainState, dict[str, float]]:
    """``ppo_epochs`` passes of ``num_minibatches`` updates (:func:`_update`); the step's metrics.

    Every mini-batch is planned before the first update (the plan is the same in every epoch), so
    that a split refused over the data-parallel group changes nothing."""
    totals: dict[str, torch.Tensor] = {}
    grad_norms: list[float] = []
    skipped = 0
    # Strided mini-batches: with contiguous DP shards (shard_for_data_parallel) of a length
    # divisible by num_minibatches, mini-batch k holds the same samples in every layout.
    minibatches = [samples[k :: config.num_minibatches] for k in range(config.num_minibatches)]
    splits = [split_plan(mb, plan, objective.collate) for mb in minibatches]
    first_gaps: torch.Tensor | None = None
    for _epoch in range(config.ppo_epochs):
        for minibatch, split in zip(minibatches, splits, strict=True):
            metrics, norm, stepped, gaps = _update(state, minibatch, split, objective, plan)
            first_gaps = gaps if first_gaps is None else first_gaps
            totals = merge_metrics([totals, metrics])
            grad_norms.append(norm)
            skipped += 0 if stepped else 1
    step = state.step + len(grad_norms)
    out = finalize_metrics(totals)
    out.update(router_derived_metrics(out))
    out["grad_norm"] = sum(grad_norms) / len(grad_norms)
    out["skipped"] = float(skipped)
    out["updates"] = float(len(grad_norms) - skipped)
    out["step"] = float(step)
    if objective.fn == "train_step" and first_gaps is not None:
        # the first update's forward ran before any optimizer step: on-policy, current == old
        out["onpolicy/max_abs_logprob_diff"] = float(first_gaps[0])
        out["onpolicy/max_abs_ratio_minus_1"] = float(first_gaps[1])
    if isinstance(config, StepConfig):
        # train_step never runs an old-log-prob forward itself: 1.0 when the loss read the samples'
        # old_logprobs (computed by compute_logprobs before the step), 0.0 in bypass mode or without them
        read = not config.loss.bypass_old_logprobs and samples[0].old_logprobs is not None
        out["offpolicy/old_logprobs_read"] = float(read)
    lr = [g["lr"] for g in state.optimizer.param_groups] if hasattr(state.optimizer, "param_groups") else []
    if lr:
        out["lr"] = float(lr[0])
    return dataclasses.replace(state, step=step), out


def train_step(state: TrainState, batch: Sequence[Sample], config: StepConfig) -> tuple[TrainState, dict[str, float]]:
    """One PPO/GRPO update (or ``ppo_epochs`` x ``num_minibatches`` updates) on this rank's samples.

    ``batch`` is this data-parallel rank's list of :class:`~fnppo.core.batching.sample.Sample` (identical on the TP
    and PP ranks of one DP rank; see :func:`~fnppo.steps.infer.shard_for_data_parallel`). For each mini-batch:

    1. split into micro-batches (same count on every DP rank) and collate them;
    2. the loss normalizer (tokens or sequences, by ``config.loss.agg.mode``) is summed over all
       micro-batches and DP ranks *before* the schedule, so the sum of micro-batch losses is the
       full-batch loss whatever the split (with ``config.loss.correction.batch_normalize``, the mean
       TIS weight of the mini-batch too, in the same all-reduce). Under context parallelism (``cp > 1``, packed layout,
       ``token-mean`` loss) every micro-batch is cut to this CP rank's tokens
       (:mod:`fnppo.core.batching.context_parallel`), and the normalizer and the metric pairs are summed over
       Megatron's data-parallel-with-CP group, so each token counts once over CP x DP;
    3. Megatron's ``get_forward_backward_func`` runs ``forward -> logprob -> loss`` per micro-batch;
       each micro-batch loss is multiplied by ``num_microbatches * dp`` to cancel the schedule's mean
       over micro-batches and DDP's mean over DP ranks (with CP, Megatron's schedule multiplies the
       loss by ``cp`` and DDP averages the gradients over the ``dp * cp`` ranks of its
       data-parallel-with-CP group: the factors cancel, and the CP ranks' partial losses add up);
    4. :func:`~fnppo.megatron.grads.finalize_grads` reduces the gradients (installed as Megatron's
       ``finalize_model_grads_func`` for the schedule only; if the schedule does not call it,
       :class:`FinalizeNotCalledError`);
    5. if the loss and grad norm are finite, the optimizer steps (Megatron clips to ``clip_grad``);
       otherwise the step is skipped, parameters and optimizer state stay untouched, and
       ``metrics["skipped"]`` counts it.

    MoE models: samples that carry ``routed_experts`` run every forward (and recomputation) with
    those experts forced (routing replay, :mod:`fnppo.megatron.routing`).

    Reference: PPO, arXiv:1707.06347 (epochs of mini-batch updates on one batch of rollouts).

    Returns:
        The new state (same objects, ``step`` advanced by the number of optimizer updates) and
        metrics reduced exactly over micro-batches, mini-batches and DP ranks, identical on every
        rank: the finalized loss metrics, ``grad_norm`` (mean over updates), ``skipped``,
        ``updates``, ``step`` and ``lr``; the on-policy check of the first update's forward, run
        before any optimizer step (the first mini-batch of the first epoch):
        ``onpolicy/max_abs_logprob_diff`` (the largest ``|log pi - old|`` over its response tokens,
        ``old`` being the log-probs the loss compares with: ``old_logprobs``, or
        ``rollout_logprobs`` in bypass mode) and ``onpolicy/max_abs_ratio_minus_1`` (the largest
        ``|pi / old - 1|``), both exactly 0 on-policy with ``ModelConfig(batch_invariant=True)``
        and ``old`` from ``compute_logprobs``; for MoE models the router metrics of
        :mod:`fnppo.megatron.moe` (aux and z losses, expert loads and imbalance).

    Raises:
        InputError: before anything runs, nothing changed (no parameter, optimizer state or
            ``state.step``, whichever mini-batch or epoch the offending sample would have been
            trained in), raised on every rank alike (the verdict is agreed over all ranks, the
            message is the lowest refusing rank's, followed by which ranks refused unless all
            refused alike), naming
            ``batch[i]`` with ``i`` the position in ``batch``: a value model (``head="value"``: use
            :func:`critic_step`), an empty batch, a batch length not divisible by
            ``num_minibatches``, a sample longer than ``config.max_seq_len`` (default: the model's
            ``max_sequence_length``), a ``num_microbatches`` above the mini-batch size, a sample
            longer than ``max_tokens_per_microbatch``, tensors on different devices, a response mask
            that is not 0/1, NaN/inf in advantages, log-probs, values or returns, token ids outside
            the model's vocabulary (while call-time checking is on; negative ones always),
            ``old_logprobs`` / ``ref_logprobs`` / ``rollout_logprobs`` given for some samples only, no
            ``old_logprobs`` for a loss that reads them (a ratio-based policy loss or a rollout
            correction outside bypass mode: compute them with :func:`~fnppo.steps.infer.compute_logprobs`,
            or set ``bypass_old_logprobs=True``), no ``rollout_logprobs`` in bypass mode or with
            rollout correction, a ``config`` that is not a ``StepConfig``, routed experts that do
            not fit the model (:func:`~fnppo.core.batching.checks.check_routed_experts`); per-token
            ``versions`` or ``staleness`` on some samples only, or samples with per-token versions but
            no ages for a policy loss that depends on the age
            (:func:`~fnppo.core.losses.token_staleness.check_ages_given`); under a virtual pipeline
            (``vpp``), a ``num_microbatches`` (default one) that is not a multiple of ``pp`` or the
            padded layout (:func:`~fnppo.steps.checks.check_interleaved`). Before the first update, on every rank: too
            few samples for the micro-batch count agreed over data parallelism. Inside the
            schedule: logits from ``config.fns.forward`` whose last dimension is not this rank's
            vocab shard. ``docs/errors.md`` lists every error.
        FinalizeNotCalledError: see step 4.
    """
    layout = current_layout()
    samples = list(batch)

    def entry() -> Plan:
        check_config(
            "train_step",
            config,
            StepConfig,
            "a fnppo.StepConfig (a CriticConfig or ValueLossConfig is the critic's: critic_step)",
        )
        check_head("train_step", "state.model", state.model[0], "lm")
        check_old_logprobs("train_step", samples, config.loss)
        check_probabilities("train_step", samples, config.loss)
        plan = checked_plan(
            "train_step",
            config,
            model_facts(state.model, layout),
            samples,
            num_minibatches=config.num_minibatches,
            loss=config.loss,
        )
        check_rollout_logprobs("train_step", samples, config.loss)
        check_ages_given("train_step", samples, config.loss.policy)
        check_objective("train_step", samples, config, plan)
        return plan

    plan = agree_on_refusal(entry, layout)

    def sums(mbs: Sequence[Microbatch], lay: ParallelLayout, dev: torch.device) -> tuple[Any, ...]:
        return (*global_sums(mbs, config.loss, lay, dev), global_m2_cutoff(mbs, config.loss, lay, dev))

    def forward_step(s: tuple[Any, ...], scale: float) -> Callable:
        return policy_forward_step(config, plan, normalizer=s[0], loss_scale=scale, tis_mean=s[1], m2_cutoff=s[2])

    if uses_terms(config.loss):  # distillation, cross-entropy or KL terms: fnppo.steps.objective
        sums, forward_step = objective_stages(config, plan)
    return _train(
        state, samples, _Objective("train_step", config.fns.collate, sums, forward_step, "loss"), config, plan
    )


def critic_step(
    state: TrainState, batch: Sequence[Sample], config: CriticConfig
) -> tuple[TrainState, dict[str, float]]:
    """One update of the critic (or ``ppo_epochs`` x ``num_minibatches`` updates) on this rank's samples.

    The value-model counterpart of :func:`train_step`, through the same update mechanism: split and
    collate, the loss normalizer of ``config.loss.agg.mode`` summed over all micro-batches and
    DP ranks before the schedule (so the loss and its gradient do not depend on the split or the
    layout), Megatron's schedule running ``forward_values -> value_loss`` per micro-batch (scaled as
    in :func:`train_step`), :func:`~fnppo.megatron.grads.finalize_grads` installed for the schedule (else
    :class:`FinalizeNotCalledError`), and the optimizer step unless the value loss or the grad norm
    is not finite (then ``metrics["skipped"]`` counts it and nothing changes). Per token, with
    ``V`` the values the forward returns at the position of response token ``j`` (the state before
    it), ``old_V = sample.values[j]`` and ``R = sample.returns[j]``, the loss is
    :func:`~fnppo.core.losses.value.value_loss`'s clipped ``1/2 max((V - R)^2, (V_clip - R)^2)``, aggregated by
    ``config.loss.agg`` over the tokens of ``response_mask``. Context parallelism as in
    :func:`train_step` (``token-mean`` only).

    Reference: PPO, arXiv:1707.06347 (the value function trained on the same rollouts as the policy).

    The policy's ``routed_experts`` (routing replay) are left out: an MoE critic routes on its own.

    Args:
        state: the critic's :class:`~fnppo.steps.config.TrainState` (a value model, ``build_gpt(cfg, head="value")``).
        batch: this DP rank's samples with ``returns`` (and ``values`` when
            ``config.loss.clip_range`` is set), as for :func:`train_step`.
        config: :class:`~fnppo.steps.config.CriticConfig`.

    Returns:
        The new state (``step`` advanced by the number of updates) and metrics reduced exactly over
        micro-batches, mini-batches and DP ranks, identical on every rank: ``vf_loss``,
        ``vf_clipfrac``, ``vpred_mean``, ``vf_explained_var`` (and the means it derives from:
        ``vf_returns``, ``vf_returns_sq``, ``vf_error``, ``vf_error_sq``), ``grad_norm`` (mean over
        updates), ``skipped``, ``updates``, ``step``, ``lr``.

    Raises:
        InputError: before anything runs, nothing changed, on every rank alike (as in
            :func:`train_step`): a model without a value head; the batch errors (NaN/inf
            ``returns`` or ``values`` included, naming ``batch[i]``) and the virtual-pipeline errors
            of :func:`train_step`; no ``returns``, or no ``values`` while the loss clips. Inside the
            schedule: values from ``config.fns.forward`` that are not ``[batch, seq]``.
        FinalizeNotCalledError: the schedule did not call the finalizer.
    """
    layout = current_layout()
    samples = without_routes(batch)

    def entry() -> Plan:
        check_config(
            "critic_step",
            config,
            CriticConfig,
            "a fnppo.CriticConfig (a StepConfig or LossConfig is the policy's: train_step)",
        )
        check_head("critic_step", "state.model", state.model[0], "value")
        plan = checked_plan(
            "critic_step",
            config,
            model_facts(state.model, layout),
            samples,
            num_minibatches=config.num_minibatches,
            loss=config.loss,
        )
        check_critic_targets("critic_step", samples, config.loss)
        return plan

    plan = agree_on_refusal(entry, layout)

    def sums(mbs: Sequence[Microbatch], lay: ParallelLayout, dev: torch.device) -> torch.Tensor:
        return global_normalizer(mbs, config.loss.agg, lay, dev)

    def forward_step(normalizer: torch.Tensor, scale: float) -> Callable:
        return value_forward_step(config, normalizer=normalizer, loss_scale=scale)

    return _train(
        state, samples, _Objective("critic_step", config.fns.collate, sums, forward_step, "vf_loss"), config, plan
    )
