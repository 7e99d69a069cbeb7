"""Tests of fnppo.core.losses.kl_control: closed forms, a plain-loop reference, purity, validation."""

from __future__ import annotations

import dataclasses
import math
import pickle

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fnppo.core.errors import InputError
from fnppo.core.losses import KLPenalty, LossConfig, from_flat, ppo_clip
from fnppo.core.losses.kl_control import (
    KLControllerState,
    adaptive_kl_init,
    adaptive_kl_update,
    fixed_kl_init,
    fixed_kl_update,
    with_kl_coef,
)
from tests.messages import raises_message


def reference_controller(coef, target, horizon, observations):
    """Ziegler et al. (arXiv:1909.08593, Sec. 2.2), written out as a loop."""
    out = []
    for kl, n in observations:
        error = kl / target - 1.0
        error = 0.2 if error > 0.2 else (-0.2 if error < -0.2 else error)
        coef = coef * (1.0 + error * n / horizon)
        out.append(coef)
    return out


def test_adaptive_closed_form():
    state = adaptive_kl_init(0.1, target=0.02, horizon=1000)
    assert state == KLControllerState(0.1, 0.02, 1000.0)
    # KL = 0.021: error 0.05, 100 samples -> coef * (1 + 0.05 * 0.1) = 0.1005
    assert adaptive_kl_update(state, 0.021, 100).coef == pytest.approx(0.1005, rel=1e-15, abs=0)
    # clipped from above (KL = 10 * target) and from below (KL = 0)
    assert adaptive_kl_update(state, 0.2, 100).coef == pytest.approx(0.1 * 1.02, rel=1e-15, abs=0)
    assert adaptive_kl_update(state, 0.0, 100).coef == pytest.approx(0.1 * 0.98, rel=1e-15, abs=0)
    # a k1 estimate can be negative: still clipped at -0.2
    assert adaptive_kl_update(state, -5.0, 100).coef == pytest.approx(0.1 * 0.98, rel=1e-15, abs=0)
    # on target, or n_steps = 0: unchanged
    assert adaptive_kl_update(state, 0.02, 100).coef == 0.1
    assert adaptive_kl_update(state, 3.0, 0).coef == 0.1
    # a tensor observation (one element, any float dtype)
    assert adaptive_kl_update(state, torch.tensor([0.021], dtype=torch.float64), 100).coef == pytest.approx(
        0.1005, rel=1e-15
    )


@settings(max_examples=50, deadline=None)
@given(
    coef=st.floats(0.0, 10.0),
    target=st.floats(1e-4, 1.0),
    horizon=st.floats(10.0, 1e5),
    obs=st.lists(st.tuples(st.floats(-1.0, 5.0), st.integers(0, 9)), max_size=20),
)
def test_adaptive_matches_loop(coef, target, horizon, obs):
    state = adaptive_kl_init(coef, target, horizon)
    expected = reference_controller(coef, target, horizon, obs)
    for (kl, n), exp in zip(obs, expected, strict=True):
        state = adaptive_kl_update(state, kl, n)
        assert state.coef == pytest.approx(exp, rel=1e-12, abs=1e-300)
        assert state.target == target and state.horizon == horizon and state.coef >= 0


@settings(max_examples=30, deadline=None)
@given(kl=st.floats(0.0, 5.0), n=st.integers(1, 100))
def test_adaptive_direction(kl, n):
    """Above target the coefficient grows, below it shrinks, by at most 0.2 n / horizon."""
    state = adaptive_kl_init(1.0, target=0.5, horizon=1000)
    new = adaptive_kl_update(state, kl, n).coef
    assert (new > 1.0) == (kl > 0.5) or kl == 0.5
    assert (new < 1.0) == (kl < 0.5)
    assert abs(new - 1.0) <= 0.2 * n / 1000 + 1e-15


def test_pure_and_fixed():
    state = adaptive_kl_init(0.1, 0.02, 1000)
    new = adaptive_kl_update(state, 1.0, 10)
    assert state.coef == 0.1 and new is not state  # the input state is unchanged (immutable)
    with pytest.raises(AttributeError):
        state.coef = 1.0  # type: ignore[misc]
    fixed = fixed_kl_init(0.3)
    assert fixed == KLControllerState(0.3, None, None)
    assert fixed_kl_update(fixed, 99.0, 1000) is fixed
    # the same loop runs either controller
    for init, update in (
        (lambda: adaptive_kl_init(0.3, 0.1, 100), adaptive_kl_update),
        (lambda: fixed_kl_init(0.3), fixed_kl_update),
    ):
        s = init()
        for kl in (0.0, 0.5, 0.1):
            s = update(s, kl, 5)
        assert isinstance(s, KLControllerState)


def test_with_kl_coef_updates_the_loss_config():
    cfg = LossConfig(policy=ppo_clip(clip_high=0.28), kl=KLPenalty(0.0))
    out = with_kl_coef(cfg, adaptive_kl_update(adaptive_kl_init(0.1, 0.02, 1000), 0.2, 100))
    assert out == dataclasses.replace(cfg, kl=KLPenalty(0.1 * 1.02)) and cfg.kl.coef == 0.0
    assert out.policy.clip_high == 0.28 and out.kl.estimator == "k3"
    # the estimator is kept; a flat config with a KL coefficient works the same
    assert with_kl_coef(LossConfig(kl=KLPenalty(0.5, "k2")), fixed_kl_init(0.25)).kl == KLPenalty(0.25, "k2")
    assert with_kl_coef(from_flat(kl_coef=0.05), fixed_kl_init(0.25)) == from_flat(kl_coef=0.25)
    with pytest.raises(InputError, match="with_kl_coef: argument 'config' expected a LossConfig, received dict"):
        with_kl_coef({"kl_coef": 0.1}, fixed_kl_init(0.1))
    with pytest.raises(InputError, match="with_kl_coef: argument 'config' expected a LossConfig with a KL penalty"):
        with_kl_coef(LossConfig(), fixed_kl_init(0.1))
    # no penalty and a zero coefficient: nothing to set (from_flat(kl_coef=0.0) has kl=None)
    assert with_kl_coef(from_flat(kl_coef=0.0), fixed_kl_init(0.0)) == LossConfig()
    with pytest.raises(InputError, match="with_kl_coef: argument 'state' expected a KLControllerState"):
        with_kl_coef(cfg, 0.1)


@pytest.mark.parametrize(
    "call,arg",
    [
        (lambda: adaptive_kl_init(-0.1, 0.02, 100), "init_coef"),
        (lambda: adaptive_kl_init(math.nan, 0.02, 100), "init_coef"),
        (lambda: adaptive_kl_init(0.1, 0.0, 100), "target"),
        (lambda: adaptive_kl_init(0.1, 0.02, -1), "horizon"),
        (lambda: adaptive_kl_init(0.1, True, 100), "target"),
        (lambda: adaptive_kl_update(adaptive_kl_init(0.1, 0.02, 100), math.inf, 1), "observed_kl"),
        (lambda: adaptive_kl_update(adaptive_kl_init(0.1, 0.02, 100), torch.ones(2), 1), "observed_kl"),
        (lambda: adaptive_kl_update(adaptive_kl_init(0.1, 0.02, 100), 0.1, -1), "n_steps"),
        (lambda: adaptive_kl_update(adaptive_kl_init(0.1, 0.02, 100), 0.1, 1.5), "n_steps"),
        (lambda: adaptive_kl_update(adaptive_kl_init(0.1, 0.02, 100), 0.1, 500), "n_steps"),
        (lambda: adaptive_kl_update(fixed_kl_init(0.1), 0.1, 1), "state"),
        (lambda: fixed_kl_init(-1.0), "coef"),
        (lambda: fixed_kl_update(fixed_kl_init(0.1), math.nan, 1), "observed_kl"),
        (lambda: fixed_kl_update((0.1, None, None), 0.1, 1), "state"),
    ],
)
def test_validation(call, arg):
    with pytest.raises(InputError, match=rf"fnppo\.kl\.\w+_kl_\w+: argument '{arg}' expected .+, received .+"):
        call()


# the state checks its own fields however it is built: the constructor (a checkpoint rebuilds it with
# KLControllerState(**saved)), _make and _replace; (fields, field named, expected, received)
BAD_STATES = {
    "negative-target": (dict(coef=0.1, target=-0.02, horizon=100.0), "target", "a finite number > 0", "-0.02"),
    "zero-target": (dict(coef=0.1, target=0.0, horizon=100.0), "target", "a finite number > 0", "0.0"),
    "nan-target": (dict(coef=0.1, target=math.nan, horizon=100.0), "target", "a finite number > 0", "nan"),
    "bool-target": (dict(coef=0.1, target=True, horizon=100.0), "target", "a finite number > 0", "True"),
    "negative-coef": (dict(coef=-0.1, target=0.02, horizon=100.0), "coef", "a finite number >= 0", "-0.1"),
    "inf-coef": (dict(coef=math.inf), "coef", "a finite number >= 0", "inf"),
    "string-coef": (dict(coef="0.1"), "coef", "a finite number >= 0", "'0.1'"),
    "zero-horizon": (dict(coef=0.1, target=0.02, horizon=0.0), "horizon", "a finite number > 0", "0.0"),
    "inf-horizon": (dict(coef=0.1, target=0.02, horizon=math.inf), "horizon", "a finite number > 0", "inf"),
    "target-without-horizon": (
        dict(coef=0.1, target=0.02),
        "horizon",
        "a finite number > 0 since target is set",
        "None",
    ),
    "horizon-without-target": (
        dict(coef=0.1, horizon=10.0),
        "target",
        "a finite number > 0 since horizon is set",
        "None",
    ),
}


@pytest.mark.parametrize("case", list(BAD_STATES))
def test_state_is_validated_however_it_is_built(case):
    fields, arg, expected, received = BAD_STATES[case]
    good = adaptive_kl_init(0.1, 0.02, 100.0)
    full = {"coef": fields["coef"], "target": fields.get("target"), "horizon": fields.get("horizon")}
    builds = {
        "constructor": lambda: KLControllerState(**fields),
        "positional": lambda: KLControllerState(*full.values()),
        "_make": lambda: KLControllerState._make([full["coef"], full["target"], full["horizon"]]),
        "_replace": lambda: good._replace(**full),
    }
    for build in builds.values():
        with raises_message("KLControllerState", arg, expected, received):
            build()


def test_a_refused_target_never_reaches_the_update():
    # without the check, target < 0 would raise the coefficient for a KL below target, and target = 0
    # would divide by zero; a state rebuilt from a checkpoint goes through the same constructor
    saved = adaptive_kl_init(0.1, 0.02, 100.0)._asdict()
    assert KLControllerState(**saved) == adaptive_kl_init(0.1, 0.02, 100.0)
    for target in (-0.02, 0.0):
        with raises_message("KLControllerState", "target", "a finite number > 0", repr(target)):
            adaptive_kl_update(KLControllerState(**{**saved, "target": target}), 0.01, 10)


def test_valid_states_round_trip():
    for state in (adaptive_kl_init(0.1, 0.02, 1000), fixed_kl_init(0.0), KLControllerState(0)):
        again = KLControllerState(**state._asdict())
        assert again == state and type(again) is KLControllerState
        assert state._replace(coef=0.5) == KLControllerState(0.5, state.target, state.horizon)
        assert pickle.loads(pickle.dumps(state)) == state
        assert all(v is None or type(v) is float for v in state)  # stored as floats
    assert KLControllerState(1, 2, 3) == (1.0, 2.0, 3.0)  # still a tuple
