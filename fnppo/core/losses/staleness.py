"""The off-policy contract of a step as one object: :class:`Staleness` (pure Python and torch).

Asynchronous RL trains on rollouts sampled by a policy ``s`` updates older than the one being
trained (``s = current_version - version``, the staleness). :class:`Staleness` owns what that means
for the loss, in one place:

* ``max_staleness``: samples older than this are refused by :meth:`Staleness.check` (a named
  error, before anything runs), never silently trained on;
* ``proximal``: which log-probs anchor the trust region (``LossConfig``'s ratio and clip):
  ``"old"``, the trainer's recomputed log-probs of the policy at the start of the update (one
  forward per batch, ``compute_logprobs``; the rollout engine's log-probs are the behaviour policy,
  corrected by ``LossConfig.correction``: decoupled PPO), or ``"behaviour"``, the rollout engine's
  log-probs themselves (bypass mode: no old-log-prob forward; IPO's contract);
* :meth:`Staleness.loss_config`: the ``LossConfig`` with that contract applied (``bypass_old_logprobs``);
* :meth:`Staleness.metrics`: the staleness of a batch, for the step's metrics;
* :meth:`Staleness.prepare`: partial rollouts, a version per token (``Sample.versions``): each
  token's age for the version being trained, carried in the samples (``Sample.staleness``) for the
  losses that depend on it (``loglinear_decoupled``); a token older than ``max_staleness`` refused
  or, with ``expire="tokens"``, masked out of the loss and counted
  (:mod:`fnppo.core.losses.token_staleness`).

The behaviour/proximal/current KL estimates and masked fractions of every step are the loss's own
metrics: ``rollout_kl`` (``mean(logp_rollout - logp_old)``, behaviour vs proximal), ``ppo_kl``
(``mean(logp_old - logp)``, proximal vs current; vs behaviour in bypass mode), ``pg_clipfrac``,
``tis_rejected_frac``, ``m2po_masked_frac``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from fnppo.core.batching.sample import Sample
from fnppo.core.errors import input_error
from fnppo.core.losses.config import LossConfig
from fnppo.core.losses.policy import bypass_only, loss_name
from fnppo.core.losses.token_staleness import EXPIRE, prepare_batch

__all__ = ["Staleness", "PROXIMAL", "EXPIRE"]

PROXIMAL = ("old", "behaviour")
"""What ``Staleness.proximal`` can be."""


@dataclass(frozen=True)
class Staleness:
    """The off-policy contract of a step (see the module docstring). Frozen; validated when built.

    Attributes:
        max_staleness: the largest ``current_version - version`` a sample may have, an int ``>= 0``
            (0: synchronous, on-policy up to the engine's numerics).
        proximal: ``"old"`` (recomputed old log-probs anchor the clip; the engine's are the behaviour
            policy) or ``"behaviour"`` (the engine's log-probs anchor it: bypass mode, no
            old-log-prob forward).
        expire: what :meth:`prepare` does with a token older than ``max_staleness`` (partial
            rollouts): ``"refuse"`` (the default: the batch is refused, naming the token) or
            ``"tokens"`` (the token is masked out of the loss and counted in
            ``offpolicy/expired_token_frac``; the rest of its response trains).

    Raises:
        InputError: ``fnppo.losses.Staleness: argument 'max_staleness' / 'proximal' / 'expire' ...``.
    """

    max_staleness: int = 0
    proximal: str = "old"
    expire: str = "refuse"

    def __post_init__(self) -> None:
        fn = "fnppo.losses.Staleness"
        if not (isinstance(self.max_staleness, int) and not isinstance(self.max_staleness, bool)):
            raise input_error(fn, "max_staleness", "an int >= 0", repr(self.max_staleness))
        if self.max_staleness < 0:
            raise input_error(fn, "max_staleness", "an int >= 0", repr(self.max_staleness))
        if not isinstance(self.proximal, str) or self.proximal not in PROXIMAL:
            raise input_error(fn, "proximal", f"one of {list(PROXIMAL)}", repr(self.proximal))
        if not isinstance(self.expire, str) or self.expire not in EXPIRE:
            raise input_error(fn, "expire", f"one of {list(EXPIRE)}", repr(self.expire))

    @property
    def needs_old_logprobs(self) -> bool:
        """Whether the samples need the trainer's old log-probs (one forward per batch): ``proximal == "old"``."""
        return self.proximal == "old"

    def loss_config(self, loss: LossConfig) -> LossConfig:
        """``loss`` with ``bypass_old_logprobs`` set by ``proximal`` (validated again).

        ``proximal="behaviour"`` turns bypass mode on; ``proximal="old"`` keeps it off, and refuses a
        ``loss`` that asked for it (the caller's flag and the contract would say opposite things).

        Raises:
            InputError: ``fnppo.losses.Staleness.loss_config``: ``loss`` not a ``LossConfig``; with
                ``proximal="old"``, a loss in bypass mode (``loss.bypass_old_logprobs``) or one that
                needs it (``loglinear_decoupled``, named ``proximal``); a policy loss assuming a
                staleness above ``max_staleness`` (``loss.policy.staleness``: no sample that old is
                accepted).
        """
        fn = "fnppo.losses.Staleness.loss_config"
        if not isinstance(loss, LossConfig):
            raise input_error(fn, "loss", "a fnppo.losses.LossConfig", f"{type(loss).__name__} {loss!r}"[:120])
        if self.proximal == "old" and bypass_only(loss.policy):
            raise input_error(
                fn,
                "proximal",
                f"'behaviour' for the policy loss {loss_name(loss.policy)!r} (it reads the behaviour policy's "
                "log-probs, which only bypass mode passes)",
                repr(self.proximal),
            )
        if self.proximal == "old" and loss.bypass_old_logprobs:
            raise input_error(
                fn,
                "loss.bypass_old_logprobs",
                "False with proximal='old' (the recomputed old log-probs anchor the clip; bypass mode is "
                "Staleness(proximal='behaviour'))",
                "True",
            )
        assumed = getattr(loss.policy, "staleness", None)
        if isinstance(assumed, int) and assumed > self.max_staleness:
            raise input_error(
                fn,
                "loss.policy.staleness",
                f"at most max_staleness={self.max_staleness} (the policy loss assumes samples {assumed} versions "
                "old, which this contract refuses)",
                repr(assumed),
            )
        return dataclasses.replace(loss, bypass_old_logprobs=self.proximal == "behaviour")

    def check(self, versions: Sequence[int], current_version: int) -> None:
        """Refuse a batch with a sample older than ``max_staleness`` or from the future.

        Args:
            versions: the policy version that sampled each sample (e.g. the optimizer step its
                weights were taken at).
            current_version: the version being trained.

        Raises:
            InputError: ``fnppo.losses.Staleness.check: argument 'versions[i]' expected a version in
                [current - max_staleness, current] ...``, naming the first stale sample (or one that is
                not an int); ``versions`` not a list or tuple (None, a string, a tensor);
                ``current_version`` not an int >= 0.
        """
        fn = "fnppo.losses.Staleness.check"
        if isinstance(versions, (str, bytes)) or not isinstance(versions, Sequence):
            raise input_error(
                fn,
                "versions",
                "a sequence (list or tuple) of ints, one per sample",
                f"{type(versions).__name__} {versions!r}"[:120],
            )
        if isinstance(current_version, bool) or not isinstance(current_version, int) or current_version < 0:
            raise input_error(fn, "current_version", "an int >= 0", repr(current_version))
        low = current_version - self.max_staleness
        for i, v in enumerate(versions):
            if isinstance(v, bool) or not isinstance(v, int) or not low <= v <= current_version:
                raise input_error(
                    fn,
                    f"versions[{i}]",
                    f"a version in [{low}, {current_version}] (max_staleness={self.max_staleness}: "
                    "an older sample is refused, not trained on)",
                    f"{v!r} (staleness {current_version - v if isinstance(v, int) else '?'})",
                )

    def metrics(self, versions: Sequence[int], current_version: int) -> dict[str, float]:
        """``offpolicy/staleness_mean`` and ``offpolicy/staleness_max`` of a checked batch, and
        ``offpolicy/old_logprob_forward`` (1.0 when the contract needs the old-log-prob forward)."""
        self.check(versions, current_version)
        ages = [current_version - v for v in versions]
        return {
            "offpolicy/staleness_mean": sum(ages) / len(ages) if ages else 0.0,
            "offpolicy/staleness_max": float(max(ages, default=0)),
            "offpolicy/old_logprob_forward": float(self.needs_old_logprobs),
        }

    def prepare(
        self, batch: Sequence[Sample], current_version: int, *, versions: Sequence[int] | None = None
    ) -> tuple[list[Sample], dict[str, float]]:
        """Partial rollouts: every token's age for the version being trained, checked, and the batch's metrics.

        ``current_version - v`` for each token's version ``v`` (``Sample.versions``, or ``versions``:
        one per sample for samples without per-token versions) becomes the returned samples'
        ``staleness``, which ``train_step`` hands to the losses whose formula depends on the age
        (``loglinear_decoupled``: ``alpha = (K - 1) / K`` with each token's own ``K``). A token newer
        than ``current_version`` is refused; one older than ``max_staleness`` is refused or, with
        ``expire="tokens"``, expired: 0 in the returned sample's ``response_mask``. Pure: the samples
        given are not changed (:func:`~fnppo.core.losses.token_staleness.prepare_batch`).

        Returns:
            ``(samples, metrics)``: the new samples and ``offpolicy/token_staleness_mean``,
            ``offpolicy/token_staleness_max``, ``offpolicy/expired_token_frac`` (over the tokens
            in the loss before expiry) and ``offpolicy/old_logprob_forward``.

        Raises:
            InputError: ``fnppo.losses.Staleness.prepare: argument 'batch[i].versions' expected
                versions in [low, current] ...``, naming the first refused token; and see
                :func:`~fnppo.core.losses.token_staleness.prepare_batch`.
        """
        out, metrics = prepare_batch(
            batch, current_version, max_staleness=self.max_staleness, expire=self.expire, versions=versions
        )
        metrics["offpolicy/old_logprob_forward"] = float(self.needs_old_logprobs)
        return out, metrics
