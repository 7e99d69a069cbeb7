"""KL-coefficient controllers as pure ``init`` / ``update`` pairs (optax style, pure Python).

The state is an immutable :class:`KLControllerState`; ``update`` returns a new state and changes
nothing else, so the controller lives wherever the caller keeps its training state (and is
checkpointed with it). No globals, no hidden mutation::

    state = fnppo.kl.adaptive_kl_init(init_coef=0.05, target=0.02, horizon=10_000)
    for step in ...:
        loss_cfg = fnppo.kl.with_kl_coef(loss_cfg, state)     # replace(cfg, kl=replace(cfg.kl, coef=state.coef))
        state_train, metrics = fnppo.train_step(state_train, batch, dataclasses.replace(step_cfg, loss=loss_cfg))
        state = fnppo.kl.adaptive_kl_update(state, metrics["kl_loss"], n_steps=len(batch))

* :func:`adaptive_kl_init` / :func:`adaptive_kl_update` -- the proportional controller of Ziegler
  et al. (2019): ``e = clip(KL / target - 1, -0.2, 0.2)``, ``coef <- coef * (1 + e * n_steps / horizon)``.
* :func:`fixed_kl_init` / :func:`fixed_kl_update` -- the same signatures, the coefficient never
  changes (so the two are interchangeable in a training loop).
* :func:`with_kl_coef` -- the loss configuration with the controller's coefficient (``LossConfig.kl.coef``).

Reference: Ziegler et al., Fine-Tuning Language Models from Human Preferences, arXiv:1909.08593
(Section 2.2, the adaptive KL coefficient).
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import torch

from fnppo.core.errors import check_float, check_int, check_number, describe, input_error
from fnppo.core.losses.config import LossConfig

__all__ = [
    "KLControllerState",
    "adaptive_kl_init",
    "adaptive_kl_update",
    "fixed_kl_init",
    "fixed_kl_update",
    "with_kl_coef",
]

_ERROR_CLIP = 0.2
"""The proportional error is clipped to ``[-0.2, 0.2]`` (Ziegler et al.)."""


def _number(fn: str, arg: str, value: Any, *, positive: bool) -> float:
    check_float(fn, arg, value, low=0, low_open=positive)
    return float(value)


class _Fields(NamedTuple):
    coef: float
    target: float | None = None
    horizon: float | None = None


class KLControllerState(_Fields):
    """Immutable controller state (a named tuple), validated whenever one is built.

    ``KLControllerState(coef)`` is the fixed controller's state,
    ``KLControllerState(coef, target, horizon)`` the adaptive one's. Every way of building one
    checks its fields: the constructor (e.g. ``KLControllerState(**saved._asdict())`` when resuming
    from a checkpoint), ``_make`` and ``_replace``. The numbers are stored as floats.

    Attributes:
        coef: the current KL coefficient, a finite number ``>= 0``, e.g. ``LossConfig.kl.coef``.
        target: the target KL per token of the adaptive controller, a finite number ``> 0`` (a
            negative one would move the coefficient the wrong way, 0 would divide by zero); None:
            fixed.
        horizon: the adaptive controller's horizon in samples, a finite number ``> 0``; None: fixed.

    Raises:
        InputError: ``fnppo.kl.KLControllerState: argument '<field>' ...`` for a field out of range,
            NaN/inf, or not a number; ``target`` and ``horizon`` not both None or both numbers.
    """

    __slots__ = ()

    def __new__(cls, coef: float, target: float | None = None, horizon: float | None = None) -> KLControllerState:
        fn = "fnppo.kl.KLControllerState"
        coef = _number(fn, "coef", coef, positive=False)
        if target is None and horizon is None:
            return super().__new__(cls, coef, None, None)
        for arg, value, other in (("target", target, "horizon"), ("horizon", horizon, "target")):
            if value is None:
                raise input_error(
                    fn, arg, f"a finite number > 0 since {other} is set (both None: a fixed controller)", "None"
                )
        return super().__new__(
            cls, coef, _number(fn, "target", target, positive=True), _number(fn, "horizon", horizon, positive=True)
        )

    @classmethod
    def _make(cls, iterable: Any) -> KLControllerState:
        """Build from an iterable of the fields, validated like the constructor (``_replace`` uses it)."""
        return cls(*iterable)


def _observed(fn: str, observed_kl: Any) -> float:
    """A finite float from a Python number or a one-element tensor (one host sync for tensors)."""
    if isinstance(observed_kl, torch.Tensor):
        if observed_kl.numel() != 1 or not observed_kl.is_floating_point():
            raise input_error(
                fn, "observed_kl", "a finite number or a one-element floating tensor", describe(observed_kl)
            )
        observed_kl = float(observed_kl.detach().reshape(()).item())
    check_number(fn, "observed_kl", observed_kl, also=" (or a one-element floating tensor)")
    return float(observed_kl)


def _n_steps(fn: str, n_steps: Any) -> int:
    check_int(fn, "n_steps", n_steps, low=0)
    return n_steps


def adaptive_kl_init(init_coef: float, target: float, horizon: float) -> KLControllerState:
    """State of the adaptive controller: ``KLControllerState(init_coef, target, horizon)``.

    Args:
        init_coef: the starting coefficient, finite and ``>= 0`` (0 stays 0: the update is
            multiplicative).
        target: the KL the controller steers towards, ``> 0`` (the same quantity as the
            ``observed_kl`` later passed to :func:`adaptive_kl_update`).
        horizon: ``> 0``; the coefficient moves by at most ``0.2 * n_steps / horizon`` (relative)
            per update.

    Raises:
        InputError: a value out of range, NaN/inf, or not a number.
    """
    fn = "fnppo.kl.adaptive_kl_init"
    return KLControllerState(
        _number(fn, "init_coef", init_coef, positive=False),
        _number(fn, "target", target, positive=True),
        _number(fn, "horizon", horizon, positive=True),
    )


def adaptive_kl_update(state: KLControllerState, observed_kl: float | torch.Tensor, n_steps: int) -> KLControllerState:
    """One controller step: ``coef' = coef * (1 + clip(observed_kl / target - 1, -0.2, 0.2) * n_steps / horizon)``.

    Pure: returns a new state, ``state`` is unchanged. ``n_steps`` is the number of samples (or
    steps, in the unit of ``horizon``) since the last update. Unlike the reference code, an
    ``n_steps >= 5 * horizon`` is refused: with the error at -0.2 it would make the coefficient 0
    (for ever, the update being multiplicative) or negative.

    Reference: Ziegler et al., arXiv:1909.08593, Section 2.2.

    Args:
        state: from :func:`adaptive_kl_init` (or a previous update).
        observed_kl: the measured KL (Python number or one-element tensor; a tensor is read with
            one host sync), e.g. the finalized ``kl_loss`` metric of the step.
        n_steps: int in ``[0, 5 * horizon)``.

    Returns:
        The new :class:`KLControllerState` (same target and horizon).

    Raises:
        InputError: a fixed-controller state, a non-finite ``observed_kl``, a bad ``n_steps``.
    """
    fn = "fnppo.kl.adaptive_kl_update"
    if not isinstance(state, KLControllerState) or state.target is None or state.horizon is None:
        raise input_error(fn, "state", "a KLControllerState from adaptive_kl_init", repr(state))
    kl = _observed(fn, observed_kl)
    n = _n_steps(fn, n_steps)
    if n * _ERROR_CLIP >= state.horizon:
        raise input_error(fn, "n_steps", f"an int < 5 * horizon = {5 * state.horizon!r}", repr(n_steps))
    error = min(max(kl / state.target - 1.0, -_ERROR_CLIP), _ERROR_CLIP)
    return KLControllerState(state.coef * (1.0 + error * n / state.horizon), state.target, state.horizon)


def fixed_kl_init(coef: float) -> KLControllerState:
    """State of the fixed controller: ``KLControllerState(coef)`` (finite, ``>= 0``)."""
    return KLControllerState(_number("fnppo.kl.fixed_kl_init", "coef", coef, positive=False))


def fixed_kl_update(state: KLControllerState, observed_kl: float | torch.Tensor, n_steps: int) -> KLControllerState:
    """The fixed controller's update: returns ``state`` itself (arguments validated as in
    :func:`adaptive_kl_update`, so the two can be swapped in a training loop)."""
    fn = "fnppo.kl.fixed_kl_update"
    if not isinstance(state, KLControllerState):
        raise input_error(fn, "state", "a KLControllerState", repr(state))
    _observed(fn, observed_kl)
    _n_steps(fn, n_steps)
    return state


def with_kl_coef(config: LossConfig, state: KLControllerState) -> LossConfig:
    """``dataclasses.replace(config, kl=dataclasses.replace(config.kl, coef=state.coef))``: the loss
    configuration with the controller's coefficient and the same KL estimator (validated again by the
    constructors).

    A config without a KL penalty (``kl=None``, e.g. ``from_flat(kl_coef=0.0)``) is returned as it is
    while the coefficient is 0 (no penalty either way, the same ``kl_loss`` metric); a nonzero
    coefficient needs a penalty to set.

    Raises:
        InputError: a ``config`` that is not a :class:`~fnppo.core.losses.config.LossConfig`, or has no
            KL penalty while ``state.coef != 0`` (give it one, e.g. ``kl=KLPenalty(0.0, "k3")``); a
            ``state`` that is not a :class:`KLControllerState`.
    """
    fn = "fnppo.kl.with_kl_coef"
    if not isinstance(config, LossConfig):
        raise input_error(fn, "config", "a LossConfig", type(config).__name__)
    if not isinstance(state, KLControllerState):
        raise input_error(fn, "state", "a KLControllerState", repr(state))
    if config.kl is None and state.coef == 0:
        return config
    if config.kl is None:
        raise input_error(
            fn,
            "config",
            f"a LossConfig with a KL penalty (kl=KLPenalty(coef, estimator)) since state.coef={state.coef!r}",
            "kl=None",
        )
    return dataclasses.replace(config, kl=dataclasses.replace(config.kl, coef=state.coef))
