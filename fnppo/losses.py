"""The losses, built from parts: ``fnppo.losses.LossConfig(policy=fnppo.losses.cispo(...), kl=...)``.

A policy loss is any function of :class:`PolicyInputs` returning ``(per-token loss, metrics)``; the
built-in ones are small frozen parts with their own parameters. ``from_flat`` maps flat (verl-style)
settings to parts. Implementation: :mod:`fnppo.core.losses` and :mod:`fnppo.core.rollout_correction`."""

from __future__ import annotations

from fnppo.core.losses import KL_ESTIMATORS as KL_ESTIMATORS
from fnppo.core.losses import LOSS_AGG_MODES as LOSS_AGG_MODES
from fnppo.core.losses import POLICY_LOSSES as POLICY_LOSSES
from fnppo.core.losses import SEQ_REJECTION_CRITERIA as SEQ_REJECTION_CRITERIA
from fnppo.core.losses import Aggregation as Aggregation
from fnppo.core.losses import KLPenalty as KLPenalty
from fnppo.core.losses import LossConfig as LossConfig
from fnppo.core.losses import PolicyInputs as PolicyInputs
from fnppo.core.losses import PolicyLoss as PolicyLoss
from fnppo.core.losses import RolloutCorrection as RolloutCorrection
from fnppo.core.losses import TISWeights as TISWeights
from fnppo.core.losses import ValueLossConfig as ValueLossConfig
from fnppo.core.losses import cispo as cispo
from fnppo.core.losses import clip_cov as clip_cov
from fnppo.core.losses import compute_tis_weights as compute_tis_weights
from fnppo.core.losses import from_flat as from_flat
from fnppo.core.losses import gmpo as gmpo
from fnppo.core.losses import gpg as gpg
from fnppo.core.losses import gspo as gspo
from fnppo.core.losses import kl_cov as kl_cov
from fnppo.core.losses import kl_penalty as kl_penalty
from fnppo.core.losses import loss_normalizer as loss_normalizer
from fnppo.core.losses import ppo_clip as ppo_clip
from fnppo.core.losses import ppo_loss as ppo_loss
from fnppo.core.losses import reinforce as reinforce
from fnppo.core.losses import sapo as sapo
from fnppo.core.losses import tis_batch_stats as tis_batch_stats
from fnppo.core.losses import value_loss as value_loss

__all__ = [
    "LossConfig",
    "PolicyInputs",
    "PolicyLoss",
    "ppo_clip",
    "gspo",
    "cispo",
    "gmpo",
    "sapo",
    "clip_cov",
    "kl_cov",
    "gpg",
    "reinforce",
    "KLPenalty",
    "kl_penalty",
    "KL_ESTIMATORS",
    "Aggregation",
    "LOSS_AGG_MODES",
    "loss_normalizer",
    "RolloutCorrection",
    "SEQ_REJECTION_CRITERIA",
    "TISWeights",
    "compute_tis_weights",
    "tis_batch_stats",
    "ppo_loss",
    "value_loss",
    "ValueLossConfig",
    "from_flat",
    "POLICY_LOSSES",
]
