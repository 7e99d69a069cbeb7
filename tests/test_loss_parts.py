"""Tests of the loss parts (fnppo.core.losses): each part validates itself, from_flat maps the flat
settings onto the parts with the same behaviour, a user's own policy loss is a plain callable, the
configs are frozen and hashable, and the package keeps no mutable module-level state."""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import math
import re
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from fnppo.core.errors import InputError
from fnppo.core.losses import (
    POLICY_LOSSES,
    Aggregation,
    KLPenalty,
    LossConfig,
    PolicyInputs,
    RolloutCorrection,
    ValueLossConfig,
    cispo,
    clip_cov,
    dppo_tv,
    dro,
    from_flat,
    gmpo,
    gpg,
    gspo,
    icepop,
    ipo,
    kl_cov,
    kpop,
    ppo_clip,
    ppo_loss,
    reinforce,
    sapo,
)
from fnppo.core.losses.builtins import BUILTIN_LOSSES
from fnppo.core.losses.flat import DEFAULTS, LOSS_FIELDS
from fnppo.core.losses.policy import Builtin
from fnppo.core.metrics import finalize_metrics
from tests.loss_helpers import (
    float64_default,  # noqa: F401  (autouse: float64 default dtype in this module)
    grad_of,
    leaf,
    random_batch,
)
from tests.loss_reference import REFERENCES, example
from tests.messages import raises_message

# =============================================================================================
# Each part validates its parameters
# =============================================================================================
# (build, function named, argument, expected excerpt, received)
PART_ERRORS = {
    "ppo_clip-low": (lambda: ppo_clip(clip_low=-0.1), "ppo_clip", "clip_low", "a finite number >= 0", "-0.1"),
    "ppo_clip-high-nan": (lambda: ppo_clip(clip_high=math.nan), "ppo_clip", "clip_high", "a finite number >= 0", "nan"),
    "ppo_clip-dual": (lambda: ppo_clip(dual_clip=1.0), "ppo_clip", "dual_clip", "a number > 1 or None", "1.0"),
    "ppo_clip-dual-bool": (lambda: ppo_clip(dual_clip=True), "ppo_clip", "dual_clip", "a number > 1 or None", "True"),
    "gspo-low": (lambda: gspo(clip_low=-1.0), "gspo", "clip_low", "a finite number >= 0", "-1.0"),
    "gmpo-high": (lambda: gmpo(clip_high=math.inf), "gmpo", "clip_high", "a finite number >= 0", "inf"),
    "cispo-low": (lambda: cispo(clip_low=1.5), "cispo", "clip_low", "a number in [0, 1]", "1.5"),
    "cispo-high": (lambda: cispo(clip_high=-0.1), "cispo", "clip_high", "a number >= 0", "-0.1"),
    "sapo-tau": (lambda: sapo(tau_neg=0.0), "sapo", "tau_neg", "a number > 0", "0.0"),
    "sapo-tau-str": (lambda: sapo(tau_pos="1"), "sapo", "tau_pos", "a number > 0", "'1'"),
    "clip_cov-ratio": (lambda: clip_cov(ratio=2.0), "clip_cov", "ratio", "a number in [0, 1]", "2.0"),
    "clip_cov-ub": (lambda: clip_cov(lb=5.0, ub=1.0), "clip_cov", "ub", "a number > lb=5.0", "1.0"),
    "clip_cov-dual": (lambda: clip_cov(dual_clip=0.5), "clip_cov", "dual_clip", "a number > 1 or None", "0.5"),
    "kl_cov-ratio": (lambda: kl_cov(ratio=-0.1), "kl_cov", "ratio", "a number in [0, 1]", "-0.1"),
    "kl_cov-coef": (lambda: kl_cov(coef=-1.0), "kl_cov", "coef", "a number >= 0", "-1.0"),
    "KLPenalty-coef": (lambda: KLPenalty(-0.1), "KLPenalty", "coef", "a finite number >= 0", "-0.1"),
    "KLPenalty-estimator": (lambda: KLPenalty(0.1, "k4"), "KLPenalty", "estimator", "one of ['k1', 'k2'", "'k4'"),
    "Aggregation-mode": (lambda: Aggregation("mean"), "Aggregation", "mode", "one of ['token-mean'", "'mean'"),
    "Aggregation-scale": (
        lambda: Aggregation("seq-mean-token-sum-norm"),
        "Aggregation",
        "scale",
        "a number > 0 (the constant C",
        "None",
    ),
    "Aggregation-stray-scale": (
        lambda: Aggregation("token-mean", 3.0),
        "Aggregation",
        "scale",
        "None unless mode='seq-mean-token-sum-norm'",
        "3.0",
    ),
    "RolloutCorrection-cap": (
        lambda: RolloutCorrection(tis_cap=0.0),
        "RolloutCorrection",
        "tis_cap",
        "a number > 0 or None",
        "0.0",
    ),
    "RolloutCorrection-level": (
        lambda: RolloutCorrection(tis_cap=2.0, level="batch"),
        "RolloutCorrection",
        "level",
        "one of ['token', 'sequence']",
        "'batch'",
    ),
    "RolloutCorrection-empty": (
        lambda: RolloutCorrection(level="sequence"),
        "RolloutCorrection",
        "tis_cap",
        "a number > 0, or one of reject_low, reject_high, reject_seq_* set",
        "None",
    ),
    "ValueLossConfig-clip": (
        lambda: ValueLossConfig(clip_range=-1.0),
        "ValueLossConfig",
        "clip_range",
        "a number >= 0 or None",
        "-1.0",
    ),
    "ValueLossConfig-agg": (
        lambda: ValueLossConfig(agg="token-mean"),
        "ValueLossConfig",
        "agg",
        "an Aggregation",
        "'token-mean'",
    ),
    "kpop-threshold": (lambda: kpop(threshold=0.0), "kpop", "threshold", "a number > 0", "0.0"),
    "kpop-kl": (lambda: kpop(kl_coef=float("nan")), "kpop", "kl_coef", "a finite number >= 0", "nan"),
    "icepop-low": (lambda: icepop(low=-0.5), "icepop", "low", "a number > 0 (the lowest kept ratio)", "-0.5"),
    "icepop-band": (lambda: icepop(low=2.0, high=1.5), "icepop", "high", "a number above low=2.0", "1.5"),
    "LossConfig-policy": (
        lambda: LossConfig(policy="ppo"),
        "LossConfig",
        "policy",
        "a policy loss: a callable",
        "'ppo'",
    ),
    "LossConfig-policy-class": (  # a class is callable: it was accepted, and "called" at the first loss
        lambda: LossConfig(policy=ppo_clip),
        "LossConfig",
        "policy",
        "a policy loss instance: the loss built, e.g. ppo_clip()",
        "the class fnppo.core.losses.policy.ppo_clip",
    ),
    "LossConfig-agg": (lambda: LossConfig(agg="token-mean"), "LossConfig", "agg", "an Aggregation", "'token-mean'"),
    "LossConfig-kl": (lambda: LossConfig(kl=0.1), "LossConfig", "kl", "a KLPenalty or None", "0.1"),
    "LossConfig-correction": (
        lambda: LossConfig(correction=2.0),
        "LossConfig",
        "correction",
        "a RolloutCorrection or None",
        "2.0",
    ),
    "LossConfig-entropy": (
        lambda: LossConfig(entropy_coef=-0.01),
        "LossConfig",
        "entropy_coef",
        "a finite number >= 0",
        "-0.01",
    ),
    "LossConfig-clamp": (
        lambda: LossConfig(log_ratio_clamp=0.0),
        "LossConfig",
        "log_ratio_clamp",
        "a number > 0",
        "0.0",
    ),
    "LossConfig-bypass-tis": (
        lambda: LossConfig(bypass_old_logprobs=True, correction=RolloutCorrection(tis_cap=2.0)),
        "LossConfig",
        "correction.tis_cap",
        "None with bypass_old_logprobs=True and the ratio-based policy loss 'ppo_clip(clip_low=0.2",
        "2.0",
    ),
}


@pytest.mark.parametrize("case", list(PART_ERRORS))
def test_each_part_validates_its_parameters(case):
    build, fn, arg, expected, received = PART_ERRORS[case]
    with raises_message(fn, arg, expected, received):
        build()
    with pytest.raises(InputError, match=rf"^fnppo\.losses\.{fn}: argument '{re.escape(arg)}'"):
        build()


def test_replace_validates_again():
    with raises_message("cispo", "clip_low", "a number in [0, 1]", "2.0"):
        dataclasses.replace(cispo(), clip_low=2.0)
    with raises_message("RolloutCorrection", "reject_high", "a number > reject_low=2.0", "1.0"):
        dataclasses.replace(RolloutCorrection(reject_low=2.0), reject_high=1.0)
    with raises_message("LossConfig", "correction.tis_cap", "None with bypass_old_logprobs=True", "2.0"):
        dataclasses.replace(LossConfig(correction=RolloutCorrection(tis_cap=2.0)), bypass_old_logprobs=True)


def test_factories_have_the_documented_defaults():
    assert ppo_clip() == ppo_clip(0.2, 0.2, 3.0) and gspo() == gspo(0.2, 0.2) and gmpo() == gmpo(0.2, 0.2)
    assert cispo() == cispo(1.0, 0.28) and sapo() == sapo(1.0, 1.05) and kl_cov() == kl_cov(2e-4, 1.0)
    assert clip_cov() == clip_cov(2e-4, 1.0, 5.0, 0.2, 0.2, 3.0)
    assert not gpg().uses_ratio and not reinforce().uses_ratio
    ratio_based = [f for name, f in POLICY_LOSSES.items() if name not in ("gpg", "reinforce")]
    assert all(getattr(f(), "uses_ratio", True) for f in ratio_based)


# =============================================================================================
# from_flat: the same behaviour as the flat settings, the refusals
# =============================================================================================
# Per built-in loss: flat settings with a non-default value for every field it reads and for the fields
# of the whole loss, and the same loss built from parts by hand.
GENERAL = dict(
    loss_agg_mode="seq-mean-token-sum-norm",
    loss_scale_factor=3.0,
    entropy_coeff=0.02,
    kl_coef=0.1,
    kl_estimator="k2+",
    tis_cap=1.4,
    tis_level="sequence",
    tis_reject_low=0.8,
    tis_reject_level="token",
    reject_seq_k3=0.5,
    log_ratio_clamp=15.0,
)
GENERAL_PARTS = dict(
    agg=Aggregation("seq-mean-token-sum-norm", 3.0),
    entropy_coef=0.02,
    kl=KLPenalty(0.1, "k2+"),
    correction=RolloutCorrection(
        tis_cap=1.4, level="sequence", reject_low=0.8, reject_level="token", reject_seq_k3=0.5
    ),
    log_ratio_clamp=15.0,
)
FLAT_CASES = {
    cls.flat_name: (
        {
            field: REFERENCES[cls].params[attr]
            for field, attr in cls.flat_fields.items()
            if attr in REFERENCES[cls].params
        },
        example(cls),
    )
    for cls in BUILTIN_LOSSES
    if cls.flat_name is not None
}
"""Per built-in loss with a flat name: its flat settings with the parameters of its reference
(tests/loss_reference.py), every field it reads at a non-default value, and the same loss built from parts."""


def test_every_flat_field_of_every_loss_is_set_here():
    assert set(FLAT_CASES) == set(POLICY_LOSSES) == set(LOSS_FIELDS)
    for name, (fields, _) in FLAT_CASES.items():
        assert set(fields) == set(LOSS_FIELDS[name]), f"{name}: set every flat field in its reference's params"
        for field, value in fields.items():
            assert value != DEFAULTS[field], f"{name}: {field} at its default, so from_flat's mapping of it is untested"


# flat fields written by hand against the attribute they mean (a mapping swapped in a class's
# flat_fields would be invisible to FLAT_CASES, which reads the same mapping)
BY_HAND = {
    "ppo": (
        dict(clip_ratio_low=0.1, clip_ratio_high=0.3, clip_ratio_c=2.5),
        ppo_clip(clip_low=0.1, clip_high=0.3, dual_clip=2.5),
    ),
    "cispo": (dict(cispo_clip_low=0.4, cispo_clip_high=0.1), cispo(clip_low=0.4, clip_high=0.1)),
    "sapo": (dict(sapo_tau_pos=1.1, sapo_tau_neg=0.9), sapo(tau_pos=1.1, tau_neg=0.9)),
    "clip_cov": (
        dict(clip_cov_ratio=0.5, clip_cov_lb=-1.0, clip_cov_ub=3.0, clip_ratio_low=0.1, clip_ratio_high=0.3),
        clip_cov(ratio=0.5, lb=-1.0, ub=3.0, clip_low=0.1, clip_high=0.3),
    ),
    "kl_cov": (dict(kl_cov_ratio=0.3, kl_cov_coef=0.7), kl_cov(ratio=0.3, coef=0.7)),
    "dppo_tv": (
        dict(clip_ratio_low=0.1, clip_ratio_high=0.3, dppo_ratio_cap=5.0),
        dppo_tv(low=0.1, high=0.3, ratio_cap=5.0),
    ),
    "ipo": (dict(ipo_threshold=0.2, ipo_kl_coef=0.01), ipo(threshold=0.2, kl_coef=0.01)),
    "kpop": (dict(kpop_threshold=0.05, kpop_kl_coef=0.02), kpop(threshold=0.05, kl_coef=0.02)),
    "icepop": (dict(icepop_low=0.5, icepop_high=2.0), icepop(low=0.5, high=2.0)),
    "dro": (dict(dro_beta=0.3), dro(beta=0.3)),
}


@pytest.mark.parametrize("name", list(BY_HAND))
def test_flat_fields_mean_the_attributes_they_name(name):
    fields, policy = BY_HAND[name]
    assert from_flat(policy_loss=name, **fields).policy == policy


def test_every_builtin_loss_has_a_reference():
    missing = [cls.__name__ for cls in BUILTIN_LOSSES if cls not in REFERENCES]
    assert not missing, f"built-in losses without a float64 loop reference in tests/loss_reference.py: {missing}"


DOCS = Path(__file__).resolve().parents[1] / "docs"


def _site_markdown(page: str) -> str:
    """``docs/<page>`` as the site shows it after the hook that lists the built-in losses
    (``docs/_hooks/builtin_losses.py``, run by ``mkdocs build``)."""
    spec = importlib.util.spec_from_file_location("builtin_losses_hook", DOCS / "_hooks" / "builtin_losses.py")
    hook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hook)
    page_object = SimpleNamespace(file=SimpleNamespace(src_uri=page))
    return hook.on_page_markdown((DOCS / page).read_text(), page=page_object, config=None, files=None)


def test_the_docs_list_every_builtin_loss():
    """docs/compose.md's table of parts lists the built-in losses on the site: its `policy` row holds the
    marker that the site's hook replaces by every name of BUILTIN_LOSSES (no hand-written list), the
    default marked as such, the losses for stale rollouts after their note."""
    raw = (DOCS / "compose.md").read_text()
    assert "<!-- builtin-losses -->" in next(line for line in raw.splitlines() if line.startswith("| `policy` |"))
    shown = _site_markdown("compose.md")
    assert "builtin-losses" not in shown, "the hook left a marker on the page"
    row = next(line for line in shown.splitlines() if line.startswith("| `policy` |"))
    listed = re.findall(r"`(\w+)`", row)
    names = [cls.__name__ for cls in BUILTIN_LOSSES]
    assert sorted(n for n in listed if n not in ("policy", "PolicyInputs")) == sorted(names), (
        f"docs/compose.md's `policy` row on the site does not name the built-in losses {names}: {row}"
    )
    assert "`ppo_clip` (default, dual clip 3.0)" in row
    stale = [cls.__name__ for cls in BUILTIN_LOSSES if cls.__module__ == "fnppo.core.losses.offpolicy"]
    assert stale and f"for stale rollouts `{stale[0]}`" in row


def test_every_builtin_loss_has_one_public_name():
    """The one list (BUILTIN_LOSSES: each family module's __all__) holds every built-in loss class of the
    package; each is exported from fnppo.losses once, under its own lowercase name, and by no other
    name; its repr is the expression that builds it."""
    import fnppo.core.losses as package
    import fnppo.losses

    def subclasses(cls: type) -> list[type]:
        return [c for sub in cls.__subclasses__() for c in (sub, *subclasses(sub))]

    ours = {c for c in subclasses(Builtin) if c.__module__.startswith("fnppo.core.losses.")}
    missing = sorted(c.__name__ for c in ours - set(BUILTIN_LOSSES))
    assert not missing, f"built-in losses not in their module's __all__ (so in no list, no export, no test): {missing}"
    assert len(BUILTIN_LOSSES) == len(set(BUILTIN_LOSSES))
    exported = fnppo.losses.__all__
    assert len(exported) == len(set(exported)) and exported == package.__all__
    names_of_losses = [
        n
        for n in exported
        if isinstance(getattr(fnppo.losses, n), type) and issubclass(getattr(fnppo.losses, n), Builtin)
    ]
    assert names_of_losses == [c.__name__ for c in BUILTIN_LOSSES]  # one name each, no alias
    for cls in BUILTIN_LOSSES:
        assert cls.__name__.islower() and getattr(fnppo.losses, cls.__name__) is cls
        loss = example(cls)
        assert eval(repr(loss), vars(fnppo.losses)) == loss, repr(loss)  # noqa: S307 - a test of repr


def _run(cfg: LossConfig, seed: int = 4) -> tuple:
    lp0, old, adv, mask, ent, ref, rollout = random_batch(seed, 4, 6)
    lp, ent_l = leaf(lp0), leaf(ent)
    loss, m = ppo_loss(
        lp,
        None if cfg.bypass_old_logprobs else old,
        adv,
        mask,
        cfg,
        entropy=ent_l,
        ref_logprobs=ref,
        rollout_logprobs=rollout,
        generator=torch.Generator().manual_seed(0),
    )
    g_lp, g_ent = (
        torch.zeros_like(x) if g is None else g
        for g, x in zip(torch.autograd.grad(loss, [lp, ent_l], allow_unused=True), (lp, ent_l), strict=True)
    )
    return loss.detach(), g_lp, g_ent, finalize_metrics(m)


@pytest.mark.parametrize("name", list(FLAT_CASES))
def test_from_flat_equals_the_parts_bit_for_bit(name):
    fields, policy = FLAT_CASES[name]
    flat_cfg = from_flat(policy_loss=name, **fields, **GENERAL)
    hand = LossConfig(policy=policy, **GENERAL_PARTS)
    assert flat_cfg == hand and hash(flat_cfg) == hash(hand)
    got, want = _run(flat_cfg), _run(hand)
    for a, b in zip(got[:3], want[:3], strict=True):
        assert torch.equal(a, b)
    assert got[3] == want[3] and got[3]["tis_rejected_frac"] > 0 and got[3]["tis_truncated_frac"] > 0


def test_from_flat_maps_the_bypass_and_normalization_fields():
    flat = from_flat(policy_loss="gpg", bypass_old_logprobs=True, tis_cap=1.2, reject_seq_max_abs_log_ratio=0.6)
    hand = LossConfig(
        policy=gpg(),
        bypass_old_logprobs=True,
        correction=RolloutCorrection(tis_cap=1.2, reject_seq_max_abs_log_ratio=0.6),
    )
    assert flat == hand and all(torch.equal(a, b) for a, b in zip(_run(flat)[:3], _run(hand)[:3], strict=True))
    flat = from_flat(tis_cap=1.3, tis_batch_normalize=True, reject_seq_mean_log_ratio=[-0.3, 0.3], reject_seq_k2=0.1)
    hand = LossConfig(
        correction=RolloutCorrection(
            tis_cap=1.3, batch_normalize=True, reject_seq_k2=0.1, reject_seq_mean_log_ratio=(-0.3, 0.3)
        )
    )
    assert flat == hand and all(torch.equal(a, b) for a, b in zip(_run(flat)[:3], _run(hand)[:3], strict=True))


def test_from_flat_kl_mapping_keeps_the_kl_metric():
    # kl_coef == 0 with the default estimator: no KLPenalty; the kl_loss metric (k3) is reported all the same
    assert from_flat().kl is None and from_flat(kl_coef=0.0, kl_estimator="k3").kl is None
    assert from_flat(kl_estimator="k2").kl == KLPenalty(0.0, "k2")
    _, g_none, _, m_none = _run(LossConfig())
    _, g_zero, _, m_zero = _run(LossConfig(kl=KLPenalty(0.0, "k3")))
    assert m_none == m_zero and torch.equal(g_none, g_zero) and m_none["kl_loss"] > 0
    _, _, _, m_k2 = _run(from_flat(kl_estimator="k2"))
    assert m_k2["kl_loss"] != m_none["kl_loss"]  # the estimator of a zero-weight penalty still sets the metric
    assert {k: v for k, v in m_k2.items() if k != "kl_loss"} == {k: v for k, v in m_none.items() if k != "kl_loss"}


def test_from_flat_takes_a_mapping_or_keywords():
    assert from_flat({"policy_loss": "gspo", "clip_ratio_high": 0.3}) == from_flat(
        policy_loss="gspo", clip_ratio_high=0.3
    )
    assert from_flat({"policy_loss": "gspo"}, clip_ratio_high=0.3) == LossConfig(policy=gspo(clip_high=0.3))
    assert from_flat(dict(DEFAULTS)) == LossConfig()  # every field at its default


@pytest.mark.parametrize(
    "call, arg, expected, received",
    [
        (lambda: from_flat(clip_ratio=0.2), "clip_ratio", "a flat loss field, one of ['bypass_old_logprobs'", "0.2"),
        (lambda: from_flat({"kl_coeff": 0.1}), "kl_coeff", "a flat loss field", "0.1"),
        (lambda: from_flat({"kl_coef": 0.1}, kl_coef=0.2), "kl_coef", "a field given once", "0.1 and 0.2"),
        (lambda: from_flat(["policy_loss"]), "flat", "a mapping of flat field names", "['policy_loss']"),
        # a parameter of another loss, set to a value other than its default
        (
            lambda: from_flat(policy_loss="ppo", cispo_clip_high=0.3),
            "cispo_clip_high",
            "its default 0.28 (policy_loss='ppo' does not read it)",
            "0.3",
        ),
        (
            lambda: from_flat(policy_loss="cispo", clip_ratio_low=0.1),
            "clip_ratio_low",
            "its default 0.2 (policy_loss='cispo' does not read it)",
            "0.1",
        ),
        (
            lambda: from_flat(policy_loss="gspo", clip_ratio_c=None),
            "clip_ratio_c",
            "its default 3.0 (policy_loss='gspo' does not read it)",
            "None",
        ),
        (
            lambda: from_flat(policy_loss="gpg", sapo_tau_neg=2.0),
            "sapo_tau_neg",
            "its default 1.05 (policy_loss='gpg' does not read it)",
            "2.0",
        ),
        (
            lambda: from_flat(policy_loss="ppo", kl_cov_coef=0.5),
            "kl_cov_coef",
            "its default 1.0 (policy_loss='ppo' does not read it)",
            "0.5",
        ),
    ],
)
def test_from_flat_refuses(call, arg, expected, received):
    with raises_message("from_flat", arg, expected, received):
        call()


def test_from_flat_accepts_another_loss_parameter_at_its_default():
    assert from_flat(policy_loss="ppo", cispo_clip_high=0.28, sapo_tau_pos=1) == LossConfig()


# =============================================================================================
# A policy loss of your own: a plain callable
# =============================================================================================
def test_own_loss_function_in_ppo_loss():
    def my_reinforce(x: PolicyInputs):
        return -x.advantages * x.logprobs, {}

    # without uses_ratio it counts as ratio-based: bit for bit the built-in reinforce without TIS ...
    assert torch.equal(_run(LossConfig(policy=my_reinforce))[1], _run(LossConfig(policy=reinforce()))[1])
    # ... and refuses tis_cap in bypass mode
    with raises_message("LossConfig", "correction.tis_cap", "the ratio-based policy loss 'my_reinforce'", "1.2"):
        LossConfig(policy=my_reinforce, bypass_old_logprobs=True, correction=RolloutCorrection(tis_cap=1.2))

    def my_free(x: PolicyInputs):
        return -x.advantages * x.logprobs, {}

    my_free.uses_ratio = False
    mine = LossConfig(policy=my_free, bypass_old_logprobs=True, correction=RolloutCorrection(tis_cap=1.2))
    builtin = LossConfig(policy=gpg(), bypass_old_logprobs=True, correction=RolloutCorrection(tis_cap=1.2))
    got, want = _run(mine), _run(builtin)
    assert all(torch.equal(a, b) for a, b in zip(got[:3], want[:3], strict=True)) and got[3] == want[3]
    assert got[3]["tis_truncated_frac"] > 0

    class Bad:
        uses_ratio = "no"

        def __call__(self, x: PolicyInputs):
            return my_free(x)

    with raises_message("LossConfig", "policy", "a policy loss whose attribute uses_ratio (if any) is a bool", "Bad"):
        LossConfig(policy=Bad())


def test_own_loss_object_with_parameters():
    @dataclasses.dataclass(frozen=True)
    class Scaled:
        scale: float

        def __call__(self, x: PolicyInputs):
            return -self.scale * x.advantages * x.logprobs, {"my_metric": x.token_metric(x.advantages)}

    lp = leaf(torch.tensor([[-1.0, -2.0]]))
    loss, m = ppo_loss(
        lp, lp.detach(), torch.tensor([[1.0, 3.0]]), torch.tensor([[1.0, 0.0]]), LossConfig(policy=Scaled(3.0))
    )
    assert loss.item() == pytest.approx(3.0) and finalize_metrics(m)["my_metric"] == 1.0
    torch.testing.assert_close(grad_of(loss, lp), torch.tensor([[-3.0, 0.0]]))
    assert hash(LossConfig(policy=Scaled(3.0))) == hash(LossConfig(policy=Scaled(3.0)))


# =============================================================================================
# Frozen, hashable; no module-level mutable state
# =============================================================================================
def test_configs_are_frozen_and_hashable():
    cfg = from_flat(policy_loss="cispo", kl_coef=0.1, tis_cap=2.0, loss_agg_mode="seq-mean-token-mean")
    same = LossConfig(
        policy=cispo(),
        agg=Aggregation("seq-mean-token-mean"),
        kl=KLPenalty(0.1),
        correction=RolloutCorrection(tis_cap=2.0),
    )
    assert cfg == same and hash(cfg) == hash(same) and {cfg: 1}[same] == 1
    assert cfg != dataclasses.replace(cfg, entropy_coef=0.01)
    for obj, field in (
        (cfg, "policy"),
        (cfg.policy, "clip_high"),
        (cfg.agg, "mode"),
        (cfg.kl, "coef"),
        (cfg.correction, "tis_cap"),
        (ValueLossConfig(), "clip_range"),
    ):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(obj, field, None)
    hash(ValueLossConfig())
    with pytest.raises(TypeError):
        POLICY_LOSSES["mine"] = gpg  # type: ignore[index]  # a read-only table, not a registry
    with pytest.raises(TypeError):
        LOSS_FIELDS["ppo"]["x"] = "y"  # type: ignore[index]


MODULES = (
    "fnppo.core.losses",
    "fnppo.core.losses.policy",
    "fnppo.core.losses.kl",
    "fnppo.core.losses.aggregate",
    "fnppo.core.losses.config",
    "fnppo.core.losses.ppo",
    "fnppo.core.losses.value",
    "fnppo.core.losses.flat",
    "fnppo.core.losses.covariance",
    "fnppo.core.losses.offpolicy",
    "fnppo.core.losses.builtins",
    "fnppo.core.losses.staleness",
    "fnppo.core.losses.m2po",
    "fnppo.core.losses.rollout_correction",
    "fnppo.core.losses.rollout_weights",
    "fnppo.core.losses.checks",
    "fnppo.core.losses.kl_control",
)


def _globals() -> dict:
    return {name: dict(vars(sys.modules[name])) for name in MODULES}


def test_no_mutable_module_state():
    for name in MODULES:
        importlib.import_module(name)
    before = _globals()
    for name, values in before.items():
        for key, value in values.items():
            if not key.startswith("__"):
                assert not isinstance(value, (list, dict, set, bytearray)), f"{name}.{key} is a mutable {type(value)}"
    # importing again, building configs (every loss, from flat settings and from parts) and computing losses
    for name in MODULES:
        importlib.import_module(name)
    for name, (fields, policy) in FLAT_CASES.items():
        _run(from_flat(policy_loss=name, **fields, **GENERAL))
        _run(LossConfig(policy=policy, **GENERAL_PARTS))
    with pytest.raises(InputError):
        from_flat(policy_loss="mine")
    after = _globals()
    assert before.keys() == after.keys()
    for name in MODULES:
        assert before[name].keys() == after[name].keys(), name
        for key, value in before[name].items():
            assert after[name][key] is value, f"{name}.{key} changed"
