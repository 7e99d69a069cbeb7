"""One step's data: prompts -> sampled responses -> rewards -> advantages (GRPO/RLOO, or a critic and
GAE) -> old and reference log-probs."""

from __future__ import annotations

import contextlib
import dataclasses

import torch
import torch.distributed as dist

import fnppo
from toy.model import critic_config, step_config
from toy.partial import version_schedule
from toy.sampling import sample_responses
from toy.task import RESPONSE_LEN, make_prompts, reward, token_rewards


def rollout(
    state,
    ref_params,
    args,
    layout,
    device,
    step: int,
    critic=None,
    phase=None,
    behaviour=None,
    sampler=None,
    versions=None,
):
    """Prompts -> responses -> rewards -> advantages -> old/ref log-probs: this DP rank's samples.

    With a ``critic`` (``--algo ppo``): per-token rewards, the critic's values (``compute_values``)
    and GAE advantages and returns; the samples carry ``values`` and ``returns`` for ``critic_step``.
    ``phase``: optional ``phase(name)`` context factory timing the parts (``--profile-step``).
    ``behaviour``: the sampler's weights (``--staleness``: an older snapshot), None: the current ones.
    ``sampler``: the model that samples (``--sync``: the engine's, with the weights streamed to it).
    ``versions``: ``--partial-rollouts``: the weights of consecutive versions, oldest first, and the
    version of the first (``(weights, first_version)``); every response is continued across them
    (:func:`toy.partial.version_schedule`) and the samples carry each token's version.

    Returns this rank's samples, the global mean reward and the off-policy metrics of the batch
    (:func:`offpolicy_metrics`).
    """
    n_prompts = args.prompts // layout.dp
    prompts = make_prompts(args.seed, step, args.prompts)[layout.dp_rank * n_prompts : (layout.dp_rank + 1) * n_prompts]
    prompts = prompts.repeat_interleave(args.group_size, dim=0)
    g = torch.Generator().manual_seed(args.seed * 7_919 + step)
    uniforms = torch.rand(args.prompts * args.group_size, RESPONSE_LEN, generator=g)
    per = n_prompts * args.group_size
    uniforms = uniforms[layout.dp_rank * per : (layout.dp_rank + 1) * per]
    phase = phase or (lambda name: contextlib.nullcontext())
    schedule, token_versions = None, None
    if versions is not None:
        weights, first_version = versions
        index = version_schedule(args.seed, step, args.prompts * args.group_size, len(weights))
        index = index[layout.dp_rank * per : (layout.dp_rank + 1) * per]
        schedule, token_versions = (weights, index), first_version + index
    with phase("sampling"):
        responses, rollout_lp = sample_responses(
            state.model if sampler is None else sampler,
            prompts,
            uniforms,
            temperature=args.temperature,
            layout=layout,
            device=device,
            invariant=args.batch_invariant,
            params=behaviour,
            bf16=args.sampler_dtype == "bf16",
            schedule=schedule,
        )
    rewards = torch.tensor([reward(p, r) for p, r in zip(prompts, responses, strict=True)])
    if critic is not None:
        samples = ppo_samples(critic, prompts, responses, rollout_lp, args)
        if token_versions is not None:
            samples = [dataclasses.replace(s, versions=v) for s, v in zip(samples, token_versions, strict=True)]
    else:
        grouped = rewards.view(-1, args.group_size)
        if args.advantage == "rloo":
            adv = fnppo.advantages.rloo_advantages(grouped).reshape(-1)
        else:
            adv = fnppo.advantages.grpo_advantages(grouped).reshape(-1)
        samples = [
            fnppo.Sample(
                prompt_ids=prompts[i],
                response_ids=responses[i],
                advantages=torch.full((RESPONSE_LEN,), float(adv[i])),
                rollout_logprobs=rollout_lp[i],
                versions=None if token_versions is None else token_versions[i],
            )
            for i in range(prompts.shape[0])
        ]
    cfg = step_config(args)
    with phase("old and reference log-probs"):
        old, _ = fnppo.compute_logprobs(state.model, samples, config=cfg)
        ref, _ = fnppo.compute_logprobs(state.model, samples, params=ref_params, config=cfg)
    samples = [
        dataclasses.replace(s, old_logprobs=o, ref_logprobs=r) for s, o, r in zip(samples, old, ref, strict=True)
    ]
    log_ratio = torch.cat([s.old_logprobs - s.rollout_logprobs for s in samples]).double()  # log pi_old / pi_behaviour
    total = torch.stack(
        [
            torch.tensor(float(rewards.sum()), dtype=torch.float64),
            torch.tensor(float(rewards.numel()), dtype=torch.float64),
            (-log_ratio).sum(),  # k1 of KL(behaviour || current)
            (log_ratio.exp() - 1 - log_ratio).sum(),  # k3 of the same (>= 0 per token)
            torch.tensor(float(log_ratio.numel()), dtype=torch.float64),
        ]
    )
    if layout.dp > 1:
        total = total.to(device)
        dist.all_reduce(total, group=layout.dp_group)
        total = total.cpu()
    return samples, float(total[0] / total[1]), offpolicy_metrics(args, step, total[2:])


def offpolicy_metrics(args, step: int, sums) -> dict[str, float]:
    """With ``--staleness``, ``--sampler-dtype bf16`` or ``--sync fp8*``: the staleness (updates between the sampler's
    weights and the current ones: ``min(step, K)`` for the 0-based ``step``) and the KL between the behaviour
    policy (the sampler's log-probs) and the current one (the trainer's recompute before the update),
    per token, estimated on the behaviour's samples (k1: mean of log pi_b - log pi; k3: mean of
    r - 1 - log r with r = pi / pi_b; Schulman, "Approximating KL divergence", 2020). Empty otherwise
    (an on-policy run's rows keep their keys)."""
    if not args.staleness and args.sampler_dtype == "same" and not args.sync.startswith("fp8"):
        return {}
    k1, k3, n = (float(x) for x in sums)
    return {
        "offpolicy/staleness": float(min(step, args.staleness)),
        "offpolicy/kl_behaviour_k1": k1 / n,
        "offpolicy/kl_behaviour_k3": k3 / n,
    }


def ppo_samples(critic, prompts, responses, rollout_lp, args):
    """Per-token rewards, the critic's values and GAE: samples with advantages, values and returns."""
    bare = [
        fnppo.Sample(prompt_ids=p, response_ids=r, rollout_logprobs=lp)
        for p, r, lp in zip(prompts, responses, rollout_lp, strict=True)
    ]
    values = torch.stack(fnppo.compute_values(critic.model, bare, config=critic_config(args)))  # [n, RESPONSE_LEN]
    token_r = torch.stack([token_rewards(p, r) for p, r in zip(prompts, responses, strict=True)])
    mask = torch.ones_like(values)
    adv, ret = fnppo.advantages.gae_advantages(token_r, values, mask, gamma=args.gamma, lam=args.lam)
    if args.whiten:  # the returns (the critic's targets) stay as they are
        adv = fnppo.advantages.whiten(adv, mask)
    return [
        dataclasses.replace(s, advantages=a, values=v, returns=r)
        for s, a, v, r in zip(bare, adv, values, ret, strict=True)
    ]
