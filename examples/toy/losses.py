"""The policy losses ``--policy-loss`` selects, by name: one table, one row per loss (plain data, read
before torch is imported). A row is the flat settings of ``fnppo.losses.from_flat`` (verl's names), and
optionally a policy part of :mod:`fnppo.losses` by name that replaces the flat policy: a loss added to
the library as a part (a factory in ``fnppo.losses``) is one more row here, nothing else.

The log-probs, as the toy passes them (``toy.rollout``): ``rollout_logprobs`` are the sampler's, of the
behaviour policy (``--staleness K`` updates old, in ``--sampler-dtype`` numerics); ``old_logprobs`` are the
trainer's recompute of the same tokens with the weights at the start of the step (the proximal policy).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

#: the ``--tis-cap`` of a row that reads it when the flag is not given
DEFAULT_TIS_CAP = 2.0
#: a cap no importance weight of the toy reaches: the untruncated estimator
NO_CAP = 1e6
#: a keyword value of a row's ``part`` that stands for the run's ``--staleness`` K
STALENESS = "--staleness"
#: ``--policy-loss`` when it is not given: on-policy PPO, and for stale rollouts (``--staleness`` > 0)
#: decoupled PPO with the log-linear proximal policy, the loss docs/async.md recommends (plain PPO reaches
#: a final reward of 0.58 at K = 4 where it reaches 0.98)
DEFAULT_POLICY_LOSS = "ppo"
STALE_POLICY_LOSS = "decoupled"


@dataclass(frozen=True)
class LossRow:
    """One ``--policy-loss`` choice.

    Attributes:
        help: one line for ``--help`` and the study's table.
        flat: ``fnppo.losses.from_flat`` fields (besides the run's entropy and KL settings).
        tis_cap: how the row reads ``--tis-cap``: ``"default"`` (the flag, else :data:`DEFAULT_TIS_CAP`),
            ``"optional"`` (the flag, else no truncated importance sampling) or ``"refused"`` (the flag
            means nothing to this loss, or the library refuses it: refused on the command line).
        part: ``(factory name in fnppo.losses, keyword arguments)``: the policy part that replaces the
            flat ``policy_loss`` (None: the flat one).
    """

    help: str
    flat: dict[str, Any] = field(default_factory=dict)
    tis_cap: str = "refused"
    part: tuple[str, dict[str, Any]] | None = None


POLICY_LOSSES = MappingProxyType(
    {
        "ppo": LossRow(
            "PPO clip around the trainer's recompute (proximal = current weights); the behaviour policy is "
            "corrected only with --tis-cap",
            {"policy_loss": "ppo"},
            tis_cap="optional",
        ),
        "ppo-tis": LossRow(
            "PPO clip around the trainer's recompute, times the truncated importance weight "
            "min(pi_old / pi_behaviour, --tis-cap) (decoupled behaviour correction)",
            {"policy_loss": "ppo"},
            tis_cap="default",
        ),
        "ppo-behaviour": LossRow(
            "PPO clip around the behaviour policy: the sampler's log-probs are the old log-probs (bypass mode)",
            {"policy_loss": "ppo", "bypass_old_logprobs": True},
        ),
        "tis": LossRow(
            "REINFORCE with the truncated importance weight min(pi / pi_behaviour, --tis-cap) (bypass mode)",
            {"policy_loss": "reinforce", "bypass_old_logprobs": True},
            tis_cap="default",
        ),
        "is": LossRow(
            "REINFORCE with the untruncated importance weight pi / pi_behaviour (bypass mode, no clip, no cap)",
            {"policy_loss": "reinforce", "bypass_old_logprobs": True, "tis_cap": NO_CAP},
        ),
        "dppo-tv": LossRow(
            "DPPO-TV: the policy-gradient masked where the token probability moved past the bound from the "
            "behaviour policy's, in the advantage's direction (bypass mode)",
            {"policy_loss": "dppo_tv", "bypass_old_logprobs": True},
        ),
        "m2po": LossRow(
            "PPO clip around the trainer's recompute, with M2PO's second-moment mask of the tokens furthest "
            "from the behaviour policy (one cutoff for the batch, tau 0.04)",
            {"policy_loss": "ppo", "m2_threshold": 0.04},
        ),
        "decoupled": LossRow(
            "decoupled PPO with AReaL's log-linear proximal policy (K-1)/K of the way from the behaviour "
            "policy, no recompute (bypass mode)",
            {"policy_loss": "ppo", "bypass_old_logprobs": True},
            part=("loglinear_decoupled", {"staleness": STALENESS}),
        ),
        "ipo": LossRow(
            "IPO (prime-rl's ipo loss): the importance-weighted gradient inside a probability band around the "
            "behaviour policy, plus a squared-log-ratio penalty (bypass mode)",
            {"policy_loss": "ipo", "bypass_old_logprobs": True},
        ),
        "kpop": LossRow(
            "KPop: IPO with a binary-KL band around the behaviour policy (bypass mode)",
            {"policy_loss": "kpop", "bypass_old_logprobs": True},
        ),
        "icepop": LossRow(
            "IcePop: the importance-weighted gradient where pi / pi_behaviour lies in [0.2, 5], dropped "
            "elsewhere (bypass mode)",
            {"policy_loss": "icepop", "bypass_old_logprobs": True},
        ),
    }
)


def flat_fields(name: str, tis_cap: float | None) -> dict[str, Any]:
    """The ``from_flat`` fields of row ``name`` with the command line's ``--tis-cap`` (None: not given)."""
    row = POLICY_LOSSES[name]
    fields = dict(row.flat)
    if row.tis_cap == "default":
        fields["tis_cap"] = DEFAULT_TIS_CAP if tis_cap is None else tis_cap
    elif row.tis_cap == "optional" and tis_cap is not None:
        fields["tis_cap"] = tis_cap
    return fields
