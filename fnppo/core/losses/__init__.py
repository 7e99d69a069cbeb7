"""The losses, built from parts (pure torch, no Megatron; public namespace later ``fnppo.losses``).

A :class:`LossConfig` composes small frozen parts; :func:`ppo_loss` computes the loss it describes::

    from fnppo.core.losses import Aggregation, KLPenalty, LossConfig, cispo, ppo_loss
    config = LossConfig(policy=cispo(clip_high=0.3), agg=Aggregation("seq-mean-token-mean"), kl=KLPenalty(0.05))
    loss, metrics = ppo_loss(logprobs, old_logprobs, advantages, loss_mask, config, ref_logprobs=ref_logprobs)

The modules, each with one job:

* :mod:`~fnppo.core.losses.policy` -- :class:`PolicyInputs` and the classic per-token policy
  losses; any callable with the :class:`PolicyLoss` signature is one too. A built-in loss is one
  lowercase frozen dataclass, called like a function (``ppo_clip(clip_high=0.28)``), declaring its
  flat name, flat fields and rule (:class:`~fnppo.core.losses.policy.Builtin`), and its name in its
  module's ``__all__``: the exports below, the tables of ``from_flat`` and the tests derive from it.
* :mod:`~fnppo.core.losses.covariance` -- the covariance-based policy losses.
* :mod:`~fnppo.core.losses.offpolicy` -- the losses for stale rollouts.
* :mod:`~fnppo.core.losses.builtins` -- :data:`~fnppo.core.losses.builtins.BUILTIN_LOSSES`, the one
  list of the built-in losses (each family module's ``__all__``).
* :mod:`~fnppo.core.losses.kl` -- :func:`kl_penalty` estimators and the :class:`KLPenalty` part.
* :mod:`~fnppo.core.losses.aggregate` -- :class:`Aggregation`, :func:`loss_normalizer`.
* :mod:`~fnppo.core.losses.config` -- :class:`LossConfig` and the rules across parts.
* :mod:`~fnppo.core.losses.ppo` -- :func:`ppo_loss`.
* :mod:`~fnppo.core.losses.value` -- :func:`value_loss` and :class:`ValueLossConfig` (the critic).
* :mod:`~fnppo.core.losses.flat` -- :func:`from_flat`: flat (verl-style) settings -> parts.
* :mod:`~fnppo.core.losses.distill` -- the distillation terms (:class:`ReverseKL`, :class:`ForwardKL`), the
  teacher signal :class:`TopK` and :func:`topk_divergence`; :mod:`~fnppo.core.losses.terms` --
  :class:`CrossEntropy` and :class:`RefKL`; :mod:`~fnppo.core.losses.objective` -- :func:`terms_loss`.

The rollout correction part (:class:`RolloutCorrection`) lives in :mod:`fnppo.core.losses.rollout_correction`,
its computation (:func:`compute_tis_weights`, :func:`tis_batch_stats`) in
:mod:`fnppo.core.losses.rollout_weights`; both are re-exported here.
"""

from fnppo.core.losses import covariance, offpolicy, policy
from fnppo.core.losses.aggregate import LOSS_AGG_MODES as LOSS_AGG_MODES
from fnppo.core.losses.aggregate import Aggregation as Aggregation
from fnppo.core.losses.aggregate import loss_normalizer as loss_normalizer
from fnppo.core.losses.config import LossConfig as LossConfig
from fnppo.core.losses.covariance import *  # noqa: F403 - its losses: covariance.__all__
from fnppo.core.losses.distill import TOPK_TAILS as TOPK_TAILS
from fnppo.core.losses.distill import Distill as Distill
from fnppo.core.losses.distill import ForwardKL as ForwardKL
from fnppo.core.losses.distill import ReverseKL as ReverseKL
from fnppo.core.losses.distill import TeacherSignal as TeacherSignal
from fnppo.core.losses.distill import TopK as TopK
from fnppo.core.losses.distill import topk_divergence as topk_divergence
from fnppo.core.losses.flat import POLICY_LOSSES as POLICY_LOSSES
from fnppo.core.losses.flat import from_flat as from_flat
from fnppo.core.losses.kl import KL_ESTIMATORS as KL_ESTIMATORS
from fnppo.core.losses.kl import KLPenalty as KLPenalty
from fnppo.core.losses.kl import kl_penalty as kl_penalty
from fnppo.core.losses.objective import local_normalizers as local_normalizers
from fnppo.core.losses.objective import terms_loss as terms_loss
from fnppo.core.losses.offpolicy import *  # noqa: F403 - its losses: offpolicy.__all__
from fnppo.core.losses.policy import *  # noqa: F403 - its losses: policy.__all__
from fnppo.core.losses.policy import PolicyInputs as PolicyInputs
from fnppo.core.losses.policy import PolicyLoss as PolicyLoss
from fnppo.core.losses.ppo import ppo_loss as ppo_loss
from fnppo.core.losses.rollout_correction import SEQ_REJECTION_CRITERIA as SEQ_REJECTION_CRITERIA
from fnppo.core.losses.rollout_correction import RolloutCorrection as RolloutCorrection
from fnppo.core.losses.rollout_weights import TISWeights as TISWeights
from fnppo.core.losses.rollout_weights import compute_tis_weights as compute_tis_weights
from fnppo.core.losses.rollout_weights import tis_batch_stats as tis_batch_stats
from fnppo.core.losses.staleness import Staleness as Staleness
from fnppo.core.losses.terms import CrossEntropy as CrossEntropy
from fnppo.core.losses.terms import RefKL as RefKL
from fnppo.core.losses.value import ValueLossConfig as ValueLossConfig
from fnppo.core.losses.value import value_loss as value_loss

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
    # the built-in policy losses, one name each: every family module's __all__ (fnppo.core.losses.builtins)
    *policy.__all__,
    *covariance.__all__,
    *offpolicy.__all__,
    # the terms beside the policy loss (distillation, cross-entropy, KL to the reference)
    *("Distill", "ReverseKL", "ForwardKL", "TeacherSignal", "TopK", "TOPK_TAILS", "topk_divergence"),
    *("CrossEntropy", "RefKL", "terms_loss", "local_normalizers"),
]
