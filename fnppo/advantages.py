"""Advantage estimators (pure torch): GRPO, RLOO, GAE, REINFORCE++, pass@k, ReMax, OPO, GPG and the
optimal token baseline, GDPO and MaxRL. Implementation: :mod:`fnppo.core.advantages`."""

from __future__ import annotations

from fnppo.core.advantages import broadcast_to_tokens as broadcast_to_tokens
from fnppo.core.advantages import discounted_scan as discounted_scan
from fnppo.core.advantages import gae_advantages as gae_advantages
from fnppo.core.advantages import gdpo_advantages as gdpo_advantages
from fnppo.core.advantages import gpg_advantages as gpg_advantages
from fnppo.core.advantages import gpg_batch_counts as gpg_batch_counts
from fnppo.core.advantages import grpo_advantages as grpo_advantages
from fnppo.core.advantages import masked_moments as masked_moments
from fnppo.core.advantages import maxrl_advantages as maxrl_advantages
from fnppo.core.advantages import opo_advantages as opo_advantages
from fnppo.core.advantages import optimal_token_baseline_advantages as optimal_token_baseline_advantages
from fnppo.core.advantages import pass_at_k_advantages as pass_at_k_advantages
from fnppo.core.advantages import reinforce_pp_advantages as reinforce_pp_advantages
from fnppo.core.advantages import reinforce_pp_baseline_advantages as reinforce_pp_baseline_advantages
from fnppo.core.advantages import remax_advantages as remax_advantages
from fnppo.core.advantages import rloo_advantages as rloo_advantages
from fnppo.core.advantages import whiten as whiten

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
