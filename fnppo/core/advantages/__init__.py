"""Advantage estimators as pure functions (pure torch, no Megatron).

Per-token estimators (:mod:`fnppo.core.advantages.token`), padded ``[batch, seq]``, masked tokens
skipped:

* :func:`gae_advantages` -- generalized advantage estimation with a critic.
* :func:`reinforce_pp_advantages` -- REINFORCE++: discounted KL-shaped returns, whitened.
* :func:`reinforce_pp_baseline_advantages` -- REINFORCE++-baseline (:func:`masked_moments`: its
  whole-batch moments).
* :func:`broadcast_to_tokens` -- spread one scalar per sequence over its response tokens.
* :func:`whiten` -- masked whitening (e.g. of GAE advantages), whole-batch moments if given.
* :func:`discounted_scan` -- the log-depth scan behind the discounted sums.

Group estimators (:mod:`fnppo.core.advantages.group`), one score per sequence, ``[n]`` with group
ids or ``[n_groups, group_size]``:

* :func:`grpo_advantages` -- group-normalized outcome advantages (GRPO, Dr. GRPO without std).
* :func:`rloo_advantages` -- REINFORCE leave-one-out baseline.
* :func:`pass_at_k_advantages` -- the best-of-k (pass@k / max@k) objective.
* :func:`opo_advantages` -- OPO's length-weighted group mean.
* :func:`gpg_advantages`, :func:`gpg_batch_counts` -- GPG's rescaled group advantage.

Other baselines (:mod:`fnppo.core.advantages.baseline`):

* :func:`remax_advantages` -- ReMax: minus the greedy response's reward.
* :func:`optimal_token_baseline_advantages` -- the optimal token baseline (OTB).

These functions run once per step, outside the micro-batch loop. Shared checks and group
bookkeeping: :mod:`fnppo.core.advantages.inputs`.
"""

from __future__ import annotations

from fnppo.core.advantages.baseline import optimal_token_baseline_advantages, remax_advantages
from fnppo.core.advantages.group import (
    gpg_advantages,
    gpg_batch_counts,
    grpo_advantages,
    opo_advantages,
    pass_at_k_advantages,
    rloo_advantages,
)
from fnppo.core.advantages.multi import gdpo_advantages, maxrl_advantages
from fnppo.core.advantages.token import (
    broadcast_to_tokens,
    discounted_scan,
    gae_advantages,
    masked_moments,
    reinforce_pp_advantages,
    reinforce_pp_baseline_advantages,
    whiten,
)

__all__ = [
    "gae_advantages",
    "grpo_advantages",
    "rloo_advantages",
    "reinforce_pp_advantages",
    "broadcast_to_tokens",
    "discounted_scan",
    "pass_at_k_advantages",
    "reinforce_pp_baseline_advantages",
    "masked_moments",
    "whiten",
    "remax_advantages",
    "opo_advantages",
    "gpg_advantages",
    "gpg_batch_counts",
    "optimal_token_baseline_advantages",
    "gdpo_advantages",
    "maxrl_advantages",
]
