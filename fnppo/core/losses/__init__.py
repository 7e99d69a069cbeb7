"""The losses, built from parts (pure torch, no Megatron; public namespace later ``fnppo.losses``).

A :class:`LossConfig` composes small frozen parts; :func:`ppo_loss` computes the loss it describes::

    from fnppo.core.losses import Aggregation, KLPenalty, LossConfig, cispo, ppo_loss
    config = LossConfig(policy=cispo(clip_high=0.3), agg=Aggregation("seq-mean-token-mean"), kl=KLPenalty(0.05))
    loss, metrics = ppo_loss(logprobs, old_logprobs, advantages, loss_mask, config, ref_logprobs=ref_logprobs)

The modules, each with one job:

* :mod:`~fnppo.core.losses.policy` -- :class:`PolicyInputs` and the per-token policy losses
  (``ppo_clip``, ``gspo``, ``cispo``, ``gmpo``, ``sapo``, ``gpg``, ``reinforce``); any callable
  with the :class:`PolicyLoss` signature is one too. A built-in loss is one class (its own factory,
  declaring its flat name, flat fields and rule, :class:`~fnppo.core.losses.policy.Builtin`) and the
  line of its lowercase name: the tables of ``from_flat`` and these ``__all__`` lists derive from it.
* :mod:`~fnppo.core.losses.covariance` -- the covariance-based policy losses ``clip_cov``, ``kl_cov``.
* :mod:`~fnppo.core.losses.offpolicy` -- the losses for stale rollouts ``dppo_tv``, ``dppo_kl``, ``ipo``, ``kpop``, ``icepop``, ``dro``.
* :mod:`~fnppo.core.losses.kl` -- :func:`kl_penalty` estimators and the :class:`KLPenalty` part.
* :mod:`~fnppo.core.losses.aggregate` -- :class:`Aggregation`, :func:`loss_normalizer`.
* :mod:`~fnppo.core.losses.config` -- :class:`LossConfig` and the rules across parts.
* :mod:`~fnppo.core.losses.ppo` -- :func:`ppo_loss`.
* :mod:`~fnppo.core.losses.value` -- :func:`value_loss` and :class:`ValueLossConfig` (the critic).
* :mod:`~fnppo.core.losses.flat` -- :func:`from_flat`: flat (verl-style) settings -> parts.

The rollout correction part (:class:`RolloutCorrection`, :func:`compute_tis_weights`,
:func:`tis_batch_stats`) lives in :mod:`fnppo.core.rollout_correction` and is re-exported here.
"""

from fnppo.core.losses import covariance as _covariance
from fnppo.core.losses import offpolicy as _offpolicy
from fnppo.core.losses import policy as _policy
from fnppo.core.losses.aggregate import LOSS_AGG_MODES as LOSS_AGG_MODES
from fnppo.core.losses.aggregate import Aggregation as Aggregation
from fnppo.core.losses.aggregate import loss_normalizer as loss_normalizer
from fnppo.core.losses.config import LossConfig as LossConfig
from fnppo.core.losses.covariance import *  # noqa: F403 - the built-in losses (covariance.LOSS_NAMES)
from fnppo.core.losses.flat import POLICY_LOSSES as POLICY_LOSSES
from fnppo.core.losses.flat import from_flat as from_flat
from fnppo.core.losses.kl import KL_ESTIMATORS as KL_ESTIMATORS
from fnppo.core.losses.kl import KLPenalty as KLPenalty
from fnppo.core.losses.kl import kl_penalty as kl_penalty
from fnppo.core.losses.offpolicy import *  # noqa: F403 - the built-in losses (offpolicy.LOSS_NAMES)
from fnppo.core.losses.policy import *  # noqa: F403 - the built-in losses (policy.LOSS_NAMES)
from fnppo.core.losses.policy import PolicyInputs as PolicyInputs
from fnppo.core.losses.policy import PolicyLoss as PolicyLoss
from fnppo.core.losses.ppo import ppo_loss as ppo_loss
from fnppo.core.losses.value import ValueLossConfig as ValueLossConfig
from fnppo.core.losses.value import value_loss as value_loss
from fnppo.core.rollout_correction import SEQ_REJECTION_CRITERIA as SEQ_REJECTION_CRITERIA
from fnppo.core.rollout_correction import RolloutCorrection as RolloutCorrection
from fnppo.core.rollout_correction import TISWeights as TISWeights
from fnppo.core.rollout_correction import compute_tis_weights as compute_tis_weights
from fnppo.core.rollout_correction import tis_batch_stats as tis_batch_stats
from fnppo.core.staleness import Staleness as Staleness

__all__ = [
    "LossConfig",
    "PolicyInputs",
    "PolicyLoss",
    "Aggregation",
    "LOSS_AGG_MODES",
    "loss_normalizer",
    "KLPenalty",
    "KL_ESTIMATORS",
    "kl_penalty",
    "RolloutCorrection",
    "SEQ_REJECTION_CRITERIA",
    "TISWeights",
    "compute_tis_weights",
    "tis_batch_stats",
    "Staleness",
    "ppo_loss",
    "ValueLossConfig",
    "value_loss",
    "POLICY_LOSSES",
    "from_flat",
    *_policy.LOSS_NAMES,
    *_covariance.LOSS_NAMES,
    *_offpolicy.LOSS_NAMES,
]
