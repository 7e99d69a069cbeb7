"""train_step / compute_logprobs / finalize_grads over real Megatron on CPU (gloo ranks).

The acceptance test is invariance: with the same global batch and the same full initial weights
(``layout_invariant_init``), every layout and every micro-batch split gives the same loss, grad norm
and updated parameters as one process with one micro-batch.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

import fnppo
from fnppo.core.losses import Aggregation, KLPenalty, LossConfig, loss_normalizer, ppo_clip, ppo_loss
from fnppo.testing import run_ranks, synthetic_samples, tiny_model_config
from tests.messages import messages_of
from tests.step_helpers import finalize_dropped, finalized_grads, max_metric_error, max_update_error

MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
N_SAMPLES = 8
REL = 1e-5


def _model_cfg(layers: int = 4) -> fnppo.ModelConfig:
    return tiny_model_config(num_layers=layers, tie_embeddings=True)


def _loss_cfg(mode: str) -> LossConfig:
    return LossConfig(
        policy=ppo_clip(),
        agg=Aggregation(mode, 8.0 if mode == "seq-mean-token-sum-norm" else None),
        entropy_coef=0.01,
        kl=KLPenalty(0.05, "k3"),
    )


def _build_state(lr: float = 10.0):
    # Adam with a large eps makes the first update ~ lr * g / eps: linear in the gradient, so
    # comparing updated parameters compares gradients (the distributed optimizer is Adam-only).
    chunks = fnppo.build_gpt(_model_cfg())
    fnppo.models.layout_invariant_init(chunks, seed=3)
    ddp = fnppo.wrap_ddp(chunks, use_distributed_optimizer=True)
    opt = fnppo.build_optimizer(ddp, lr=lr, adam_eps=10.0, clip_grad=0.0)
    return fnppo.TrainState(model=ddp, optimizer=opt)


def _one_update(split: dict, mode: str, layout_name: str) -> dict:
    """One update on this rank's DP share: full weights before and after it, compute_logprobs of
    every DP rank's samples (in global order), on rank 0 only.

    lr = 1e4 with Adam's eps = 10 makes the update ~1000 g: large enough that rounding the updated
    fp32 weights (~6e-8 |w|) is far below the tolerance relative to the update itself.
    """
    import torch.distributed as dist

    layout = fnppo.parallel.current_layout()
    state = _build_state(lr=1e4)
    samples = fnppo.shard_for_data_parallel(synthetic_samples(N_SAMPLES, seed=7, multi_modal_every=3), layout)
    cfg = fnppo.StepConfig(loss=_loss_cfg(mode), **split)
    logprobs, entropy = fnppo.compute_logprobs(state.model, samples, with_entropy=True, config=cfg)
    before = fnppo.models.gather_full_weights(state.model)
    state, metrics = fnppo.train_step(state, samples, cfg)
    megatron_norm = float(state.optimizer.get_grad_norm())
    full = fnppo.models.gather_full_weights(state.model)
    every = [None] * layout.dp
    dist.all_gather_object(every, (logprobs, entropy), group=layout.dp_group)
    if layout.rank != 0:
        return {}
    return {
        "metrics": metrics,
        "before": before,
        "weights": full,
        "megatron_norm": megatron_norm,
        "step": state.step,
        "logprobs": [t for lp, _ in every for t in lp],
        "entropy": [t for _, e in every for t in e],
    }


SPLITS = {
    "1mb": {},
    "4mb": {"num_microbatches": 4},
    "budget": {"max_tokens_per_microbatch": 24},
}


def _all_modes(splits: tuple[str, ...], layout_name: str) -> dict:
    return {(mode, s): _one_update(SPLITS[s], mode, layout_name) for mode in MODES for s in splits}


@pytest.fixture(scope="module")
def reference():
    return run_ranks(_all_modes, 1, ("1mb", "4mb", "budget"), "1proc")[0]


def _compare(ref: dict, got: dict, what: str) -> float:
    worst = max_metric_error(
        ref["metrics"], got["metrics"], ("loss", "grad_norm", "pg_loss", "entropy", "kl_loss"), what, REL
    )
    assert set(ref["weights"]) == set(got["weights"]) == set(got["before"])
    worst = max(worst, max_update_error(ref, got, what, REL))
    assert len(got["logprobs"]) == len(ref["logprobs"]) == N_SAMPLES, what  # every DP rank's samples
    for kind in ("logprobs", "entropy"):
        for i, (a, b) in enumerate(zip(got[kind], ref[kind], strict=True)):
            assert a.shape == b.shape and torch.allclose(a, b, rtol=1e-5, atol=1e-5), (
                f"{what}: compute_logprobs {kind} of sample {i}"
            )
    return worst


def test_single_process_splits_are_invariant(reference):
    for mode in MODES:
        base = reference[(mode, "1mb")]
        assert base["metrics"]["skipped"] == 0.0 and base["step"] == 1
        # the update is real: parameters moved and grads are non-zero
        assert base["metrics"]["grad_norm"] > 1e-4
        # fnppo's grad norm equals Megatron's optimizer's own norm
        assert abs(base["megatron_norm"] - base["metrics"]["grad_norm"]) <= 1e-5 * base["megatron_norm"]
        for split in ("4mb", "budget"):
            _compare(base, reference[(mode, split)], f"{mode}/{split}")


def test_modes_differ(reference):
    """Sanity: the four aggregation modes are actually different losses here."""
    losses = {m: reference[(m, "1mb")]["metrics"]["loss"] for m in MODES}
    assert len({round(v, 6) for v in losses.values()}) == len(MODES), losses


@pytest.mark.parametrize(
    "world,tp,pp,vpp",
    [(2, 1, 1, None), (2, 2, 1, None), (2, 1, 2, None), (2, 1, 2, 2), (4, 2, 1, None)],
    ids=["dp2", "tp2", "pp2", "pp2-vpp2", "dp2xtp2"],
)
def test_layouts_match_single_process(reference, world, tp, pp, vpp):
    name = f"tp{tp}-pp{pp}-vpp{vpp}-ws{world}"
    splits = ("4mb",) if world == 4 else ("1mb", "budget") if vpp is None else ("4mb",)
    results = run_ranks(_all_modes, world, splits, name, tp=tp, pp=pp, vpp=vpp)[0]
    worst = 0.0
    for (mode, split), got in results.items():
        worst = max(worst, _compare(reference[(mode, "1mb")], got, f"{name}/{mode}/{split}"))
    print(f"{name}: max relative difference {worst:.2e}")


# --------------------------------------------------------------------------------------------
# finalize is never skipped silently
# --------------------------------------------------------------------------------------------
def _train_with_schedule_that_skips_finalize() -> str:
    with finalize_dropped():
        try:
            state = _build_state()
            fnppo.train_step(state, synthetic_samples(4, seed=1), fnppo.StepConfig(loss=_loss_cfg("token-mean")))
        except fnppo.models.FinalizeNotCalledError as err:
            return str(err)
    return "no error"


def test_dropped_finalize_is_detected():
    msg = run_ranks(_train_with_schedule_that_skips_finalize, 1)[0]
    assert msg == (
        "train_step: Megatron's schedule returned without calling finalize_model_grads; "
        "gradients were not reduced across data-parallel ranks"
    )


# --------------------------------------------------------------------------------------------
# non-finite steps are skipped and leave everything bit-identical
# --------------------------------------------------------------------------------------------
def _adam_moments(optimizer) -> dict[str, torch.Tensor]:
    """Every Adam state tensor (exp_avg, exp_avg_sq, step) of the inner torch optimizers, by position."""
    out = {}
    for i, sub in enumerate(getattr(optimizer, "chained_optimizers", None) or [optimizer]):
        inner = sub.optimizer
        for j, group in enumerate(inner.param_groups):
            for k, p in enumerate(group["params"]):
                for name, value in inner.state.get(p, {}).items():
                    if isinstance(value, torch.Tensor):
                        out[f"{i}.{j}.{k}.{name}"] = value.detach().clone()
    return out


def _nan_loss_finite_grad(bad_call: int):
    """A ``StepFns.loss`` whose ``bad_call``-th micro-batch has a NaN loss but finite gradients.

    The NaN is a constant added to the loss (no gradient flows through it), so only the loss check
    of train_step can see it: the gradients and their norm stay finite.
    """
    calls = [0]

    def loss_fn(*args, **kwargs):
        loss, metrics = ppo_loss(*args, **kwargs)
        i, calls[0] = calls[0], calls[0] + 1
        if i == bad_call:
            nan = torch.full((), float("nan"), dtype=loss.dtype, device=loss.device)
            loss = loss + nan
            metrics = dict(metrics, loss=metrics["loss"] + nan.float())
        return loss, metrics

    return loss_fn


def _nan_step() -> dict:
    chunks = fnppo.build_gpt(_model_cfg())
    fnppo.models.layout_invariant_init(chunks, seed=3)
    ddp = fnppo.wrap_ddp(chunks, use_distributed_optimizer=True)
    state = fnppo.TrainState(model=ddp, optimizer=fnppo.build_optimizer(ddp, optimizer="adam", lr=1e-2, clip_grad=1.0))
    good = synthetic_samples(4, seed=2)
    cfg = fnppo.StepConfig(loss=_loss_cfg("token-mean"), num_microbatches=2)
    state, m1 = fnppo.train_step(state, good, cfg)  # a real step so Adam has state
    before = {k: v.detach().clone() for k, v in fnppo.megatron.unwrap.unwrap_model(state.model[0]).named_parameters()}
    moments_before = _adam_moments(state.optimizer)
    bad_cfg = dataclasses.replace(cfg, fns=fnppo.StepFns(loss=_nan_loss_finite_grad(bad_call=1)))
    state, m2 = fnppo.train_step(state, good, bad_cfg)
    after = {k: v.detach().clone() for k, v in fnppo.megatron.unwrap.unwrap_model(state.model[0]).named_parameters()}
    moments_after = _adam_moments(state.optimizer)
    state, m3 = fnppo.train_step(state, good, cfg)
    moved = any(
        not torch.equal(after[k], v) for k, v in fnppo.megatron.unwrap.unwrap_model(state.model[0]).named_parameters()
    )
    moments_later = _adam_moments(state.optimizer)
    return {
        "m1": m1,
        "m2": m2,
        "m3": m3,
        "moved": moved,
        "params_same": sorted(k for k in before if not torch.equal(before[k], after[k])),
        "moment_names": sorted(moments_before),
        "moments_same": sorted(k for k in moments_before if not torch.equal(moments_before[k], moments_after[k])),
        "moments_later_changed": sum(not torch.equal(moments_after[k], moments_later[k]) for k in moments_after),
    }


def test_non_finite_step_is_skipped_and_state_untouched():
    r = run_ranks(_nan_step, 1)[0]
    assert r["m1"]["skipped"] == 0.0 and r["m1"]["updates"] == 1.0
    # one micro-batch's loss is NaN, the gradients are finite: only the loss check can skip the step
    assert math.isnan(r["m2"]["loss"]) and math.isfinite(r["m2"]["grad_norm"]) and r["m2"]["grad_norm"] > 0
    assert r["m2"]["skipped"] == 1.0 and r["m2"]["updates"] == 0.0
    assert r["params_same"] == [], f"parameters changed by a skipped step: {r['params_same']}"
    names = r["moment_names"]
    assert any(n.endswith(".exp_avg") for n in names) and any(n.endswith(".exp_avg_sq") for n in names), names
    assert r["moments_same"] == [], f"Adam moments changed by a skipped step: {r['moments_same']}"
    # the next good step proceeds and does move the parameters and the moments
    assert r["m3"]["skipped"] == 0.0 and r["moved"] and r["moments_later_changed"] > 0


# --------------------------------------------------------------------------------------------
# custom stages: a user's own policy loss (any callable) through train_step
# --------------------------------------------------------------------------------------------
def _sign_loss(x):
    return -x.logprobs * torch.sign(x.advantages), {}


def _custom_loss_step() -> dict:
    state = _build_state()
    cfg = fnppo.StepConfig(loss=LossConfig(policy=_sign_loss))
    state, metrics = fnppo.train_step(state, synthetic_samples(4, seed=5), cfg)
    return metrics


def test_custom_registered_loss_runs_in_train_step():
    m = run_ranks(_custom_loss_step, 1)[0]
    assert m["skipped"] == 0.0 and m["grad_norm"] > 0


# --------------------------------------------------------------------------------------------
# old_logprobs: the step never computes them; a loss that reads them refuses samples without them
# --------------------------------------------------------------------------------------------
def _params(state) -> dict:
    return {k: v.detach().clone() for k, v in fnppo.megatron.unwrap.unwrap_model(state.model[0]).named_parameters()}


def _old_logprobs_cases() -> dict:
    from fnppo.core.losses import RolloutCorrection, ValueLossConfig, ipo, reinforce

    state = _build_state()
    good = synthetic_samples(4, seed=5, with_rollout=True)
    no_old = [dataclasses.replace(s, old_logprobs=None) for s in good]
    partial = [*good[:2], *no_old[2:]]
    before = _params(state)
    refused = messages_of(
        {
            "ppo": lambda: fnppo.train_step(state, no_old, fnppo.StepConfig()),
            "partial": lambda: fnppo.train_step(state, partial, fnppo.StepConfig()),
            "reinforce-with-correction": lambda: fnppo.train_step(
                state,
                no_old,
                fnppo.StepConfig(loss=LossConfig(policy=reinforce(), correction=RolloutCorrection(tis_cap=2.0))),
            ),
            "config-value-loss": lambda: fnppo.train_step(state, good, ValueLossConfig()),
            "config-critic": lambda: fnppo.train_step(state, good, fnppo.CriticConfig()),
            "logprobs-critic-config": lambda: fnppo.compute_logprobs(state.model, good, config=fnppo.CriticConfig()),
            "logprobs-dict-config": lambda: fnppo.compute_logprobs(state.model, good, config={}),
            "ipo-rollout-above-0": lambda: fnppo.train_step(
                state,
                [*good[:3], dataclasses.replace(good[3], rollout_logprobs=good[3].rollout_logprobs.abs() + 0.1)],
                fnppo.StepConfig(loss=LossConfig(policy=ipo(), bypass_old_logprobs=True)),
            ),
        }
    )
    unchanged = all(torch.equal(v, before[k]) for k, v in _params(state).items()) and state.step == 0
    # a loss that reads none trains without them; so does bypass mode, on the rollout log-probs
    state, plain = fnppo.train_step(state, no_old, fnppo.StepConfig(loss=LossConfig(policy=reinforce())))
    state, bypass = fnppo.train_step(state, no_old, fnppo.StepConfig(loss=LossConfig(bypass_old_logprobs=True)))
    mb = fnppo.collate_microbatch(no_old)
    return {
        "refused": refused,
        "unchanged": unchanged,
        "plain": plain,
        "bypass": bypass,
        "collated": mb.old_logprobs is None,
        "collate_partial": messages_of({"c": lambda: fnppo.collate_microbatch(partial)})["c"],
    }


def test_train_step_refuses_samples_without_old_logprobs_for_a_loss_that_reads_them():
    """Samples without old_logprobs were trained against zeros (pg_clipfrac 0.5 on a toy, no error):
    now refused by name before anything changes, with how to get them; a loss that reads none
    (REINFORCE without correction) and bypass mode train without them; collate gives None, not zeros.
    A config of the wrong kind (the critic's, a loss config, a dict) is refused by name too, and so are
    rollout log-probs above 0 for IPO in bypass mode (a probability above 1)."""
    r = run_ranks(_old_logprobs_cases, 1)[0]
    how = "compute them before the step with fnppo.compute_logprobs"
    for case, where in (("ppo", "batch[0]"), ("partial", "batch[2]"), ("reinforce-with-correction", "batch[0]")):
        msg = r["refused"][case]
        assert msg.startswith(f"train_step: argument '{where}.old_logprobs' expected a tensor"), (case, msg)
        assert how in msg and "bypass_old_logprobs=True" in msg and msg.endswith("received None"), msg
    assert "rollout correction" in r["refused"]["reinforce-with-correction"]
    for case in ("config-value-loss", "config-critic"):
        msg = r["refused"][case]
        assert msg.startswith("train_step: argument 'config' expected a fnppo.StepConfig"), msg
    for case, received in (("logprobs-critic-config", "CriticConfig"), ("logprobs-dict-config", "dict {}")):
        msg = r["refused"][case]
        assert msg.startswith("compute_logprobs: argument 'config' expected a fnppo.StepConfig or None"), msg
        assert f"received {received}" in msg, msg
    msg = r["refused"]["ipo-rollout-above-0"]
    assert msg.startswith("train_step: argument 'batch[3].rollout_logprobs' expected log-probs <= 0"), msg
    assert r["unchanged"], "a refused step changed the parameters or the step counter"
    assert r["plain"]["skipped"] == 0.0 and r["plain"]["offpolicy/old_logprobs_read"] == 0.0
    assert "ppo_kl" not in r["plain"]  # no old log-probs, no ppo_kl
    assert r["bypass"]["skipped"] == 0.0 and "ppo_kl" in r["bypass"]
    assert r["collated"]
    assert (
        "samples[2].old_logprobs' expected a tensor (samples[0] has old_logprobs; all samples or none)"
        in r["collate_partial"]
    ), r["collate_partial"]


# --------------------------------------------------------------------------------------------
# An independent reference: one plain forward of the whole batch (no schedule, no micro-batches,
# no DDP), fp64 log-softmax over the real vocabulary, ppo_loss with the global normalizer, autograd.
# train_step's reduced gradient (captured right after finalize_grads, before the optimizer) and
# its reported loss must equal it; so must compute_logprobs' log-probs and entropies. The model's
# vocabulary (151) is padded by make_vocab_size_divisible_by; the padding rows of the output layer
# are random, so any padding column in the softmax is a gross error.
# --------------------------------------------------------------------------------------------
REAL_VOCAB = 151
REF_TOL = 1e-6


def _ref_model_cfg(divisible: int, layers: int = 2) -> fnppo.ModelConfig:
    return tiny_model_config(
        num_layers=layers, vocab_size=REAL_VOCAB, tie_embeddings=True, make_vocab_size_divisible_by=divisible
    )


def _ref_samples():
    return synthetic_samples(N_SAMPLES, vocab_size=REAL_VOCAB, seed=17)


def _case_model_cfg(case: tuple) -> fnppo.ModelConfig:
    """The model of a reference case ``(mode, divisible)`` or ``(mode, divisible, layers)``."""
    return _ref_model_cfg(*case[1:])


def _plain_reference(cases: list) -> dict:
    """case -> loss, full gradients, per-sample log-probs and entropies (1 process); a case is
    ``(mode, divisible)`` or ``(mode, divisible, layers)``."""
    from fnppo.core.batching.collate import collate_microbatch, unpack_per_sample

    out = {}
    for case in cases:
        mode = case[0]
        (chunk,) = fnppo.build_gpt(_case_model_cfg(case))
        fnppo.models.layout_invariant_init([chunk], seed=3)
        samples = _ref_samples()
        mb = collate_microbatch(samples, layout="packed", pad_to_multiple_of=1)
        logits = fnppo.forward_logits(chunk, mb)
        assert logits.shape[-1] == _case_model_cfg(case).padded_vocab_size
        logp = torch.log_softmax(logits.double()[..., :REAL_VOCAB], dim=-1)
        lp = logp.gather(-1, mb.labels[..., None])[..., 0]
        ent = -(logp.exp() * logp).sum(-1)
        cfg = _loss_cfg(mode)
        loss, _ = ppo_loss(
            lp,
            mb.old_logprobs,
            mb.advantages,
            mb.loss_mask,
            cfg,
            entropy=ent,
            ref_logprobs=mb.ref_logprobs,
            normalizer=loss_normalizer(mb.loss_mask, cfg, seq_ids=mb.seq_ids),
            seq_ids=mb.seq_ids,
        )
        loss.backward()
        grads = {name: p.grad.detach().clone() for name, p in chunk.named_parameters()}
        out[case] = {
            "loss": float(loss),
            "grads": grads,
            "logprobs": [t.detach().float() for t in unpack_per_sample(lp, mb)],
            "entropy": [t.detach().float() for t in unpack_per_sample(ent, mb)],
        }
    return out


def _reduced_grads_of_train_step(cases: list, split: dict) -> dict:
    """case -> train_step's loss, finalized full gradients, compute_logprobs (all DP ranks); cases as
    in :func:`_plain_reference`."""
    import torch.distributed as dist

    layout = fnppo.parallel.current_layout()
    out = {}
    with finalized_grads() as captured:  # the gradients train_step hands to the optimizer
        for case in cases:
            mode = case[0]
            chunks = fnppo.build_gpt(_case_model_cfg(case))
            fnppo.models.layout_invariant_init(chunks, seed=3)
            ddp = fnppo.wrap_ddp(chunks, use_distributed_optimizer=False)  # full reduced grads on every DP rank
            state = fnppo.TrainState(model=ddp, optimizer=fnppo.build_optimizer(ddp, lr=1e-3, clip_grad=0.0))
            samples = fnppo.shard_for_data_parallel(_ref_samples(), layout)
            cfg = fnppo.StepConfig(loss=_loss_cfg(mode), **split)
            logprobs, entropy = fnppo.compute_logprobs(state.model, samples, with_entropy=True, config=cfg)
            state, metrics = fnppo.train_step(state, samples, cfg)
            # the captured gradients, gathered like weights: copy them into the parameters, gather
            with torch.no_grad():
                for c, grads in zip(state.model, captured.pop("grads"), strict=True):
                    for p, g in zip(fnppo.megatron.unwrap.unwrap_model(c).parameters(), grads, strict=True):
                        p.copy_(g)
            full = fnppo.models.gather_full_weights(state.model)
            every = [None] * layout.dp
            dist.all_gather_object(every, (logprobs, entropy), group=layout.dp_group)
            out[case] = {
                "metrics": metrics,
                "grads": full,
                "logprobs": [t for lp, _ in every for t in lp],
                "entropy": [t for _, e in every for t in e],
            }
    return out if layout.rank == 0 else {}


def _rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.double() - ref.double()).abs().max() / ref.double().abs().max().clamp_min(1e-30))


def _compare_with_plain_reference(ref: dict, got: dict, what: str) -> None:
    assert set(got) == set(ref), what
    for key, r in ref.items():
        g = got[key]
        name = f"{what}/{key}"
        assert g["metrics"]["skipped"] == 0.0
        loss_err = abs(g["metrics"]["loss"] - r["loss"]) / abs(r["loss"])
        assert loss_err <= REF_TOL, f"{name}: reported loss {g['metrics']['loss']!r} vs reference {r['loss']!r}"
        assert sorted(g["grads"]) == sorted(r["grads"]), name
        for pname, rg in r["grads"].items():
            assert float(rg.abs().max()) > 0, f"{name}: reference gradient of {pname} is zero"
            err = _rel_err(g["grads"][pname], rg)
            assert err <= REF_TOL, f"{name}: gradient of {pname}: relative error {err:.2e}"
        norm = math.sqrt(sum(float(t.double().square().sum()) for t in r["grads"].values()))
        assert abs(g["metrics"]["grad_norm"] - norm) <= REF_TOL * norm, (name, g["metrics"]["grad_norm"], norm)
        assert len(g["logprobs"]) == len(r["logprobs"]) == N_SAMPLES, name
        for kind in ("logprobs", "entropy"):
            for i, (a, b) in enumerate(zip(g[kind], r[kind], strict=True)):
                assert a.shape == b.shape and float((a - b).abs().max()) <= 1e-5, (
                    f"{name}: compute_logprobs {kind} of sample {i}"
                )


INTERLEAVED_CASE = ("token-mean", 1, 4)  # 4 layers: one per chunk under pp=2 x vpp=2


@pytest.fixture(scope="module")
def plain_reference():
    cases = [(mode, d) for mode in MODES for d in (1, 2, 128)] + [INTERLEAVED_CASE]
    return run_ranks(_plain_reference, 1, cases)[0]


def test_train_step_matches_plain_reference_one_process(plain_reference):
    cases = [(mode, d) for mode in MODES for d in (1, 2, 128)]
    got = run_ranks(_reduced_grads_of_train_step, 1, cases, {"num_microbatches": 3})[0]
    _compare_with_plain_reference({k: v for k, v in plain_reference.items() if k in got}, got, "1proc")


@pytest.mark.slow
def test_train_step_matches_plain_reference_tp2(plain_reference):
    cases = [(mode, d) for mode in MODES for d in (2, 128)]
    got = run_ranks(_reduced_grads_of_train_step, 2, cases, {"max_tokens_per_microbatch": 24}, tp=2)[0]
    _compare_with_plain_reference({k: v for k, v in plain_reference.items() if k in got}, got, "tp2")


# --------------------------------------------------------------------------------------------
# The interleaved pipeline schedule (vpp) over gloo: as many micro-batches as stages (which
# deadlocked while every pipeline send was preceded by a blocking shape exchange), counts decided
# at run time (rounded up to a multiple of pp), and the refusals, all in one run with a short
# gloo timeout so that a hang fails the test instead of stalling the suite.
# --------------------------------------------------------------------------------------------
INTERLEAVED_SPLITS = {
    "2mb": {"num_microbatches": 2},  # num_microbatches == pp
    "budget": {"max_tokens_per_microbatch": 26},  # first-fit decreasing: 3 micro-batches -> 4
    "size8": {"microbatch_size": 8},  # 1 micro-batch -> 2
}


def _interleaved_refusals() -> dict:
    """The message of every configuration the interleaved schedule cannot run (or "no error")."""
    from fnppo.core.batching.collate import collate_microbatch, pad_microbatch

    chunks = fnppo.build_gpt(_case_model_cfg(INTERLEAVED_CASE))
    value_chunks = fnppo.build_gpt(_case_model_cfg(INTERLEAVED_CASE), head="value")
    samples = _ref_samples()
    cfg = fnppo.StepConfig(loss=_loss_cfg("token-mean"))
    mbs = [collate_microbatch(samples[i::2], layout="packed", pad_to_multiple_of=1) for i in range(2)]
    longest = max(int(mb.input_ids.shape[1]) for mb in mbs)
    calls = {
        "three": lambda: fnppo.train_step(
            fnppo.TrainState(model=chunks, optimizer=None), samples, dataclasses.replace(cfg, num_microbatches=3)
        ),
        "default": lambda: fnppo.compute_logprobs(chunks, samples),
        "padded": lambda: fnppo.train_step(
            fnppo.TrainState(model=chunks, optimizer=None),
            samples,
            dataclasses.replace(cfg, layout="padded", num_microbatches=2),
        ),
        "critic": lambda: fnppo.critic_step(
            fnppo.TrainState(model=value_chunks, optimizer=None), samples, fnppo.CriticConfig(num_microbatches=3)
        ),
        "values": lambda: fnppo.compute_values(value_chunks, samples),
        "too-few": lambda: fnppo.compute_logprobs(chunks, samples[:1], microbatch_size=1),
        "fwd-count": lambda: fnppo.forward_only(
            chunks, [pad_microbatch(mb, longest) for mb in mbs] + mbs[:1], lambda lg, mb: None
        ),
        "fwd-shapes": lambda: fnppo.forward_only(chunks, mbs, lambda lg, mb: None),
    }
    return messages_of(calls)


def _interleaved_cases() -> dict:
    """Refusals first (every rank raises before any communication: the runs after them would
    time out otherwise), then train_step + compute_logprobs per split, recording the number of
    micro-batches each schedule ran."""
    import fnppo.steps.schedule as schedule_module
    import fnppo.steps.train as train_module

    out = {"refusals": _interleaved_refusals(), "runs": {}}
    users = (schedule_module, train_module)  # the modules that run the schedule (forward-only, update)
    real = schedule_module.run_schedule
    counts: list = []

    def spy(model, mbs, *args, **kw):
        counts.append((kw["forward_only"], len(mbs), {tuple(mb.input_ids.shape) for mb in mbs}))
        return real(model, mbs, *args, **kw)

    for module in users:
        module.run_schedule = spy
    try:
        for name, split in INTERLEAVED_SPLITS.items():
            counts.clear()
            got = _reduced_grads_of_train_step([INTERLEAVED_CASE], split)
            out["runs"][name] = {"counts": list(counts), **got}
    finally:
        for module in users:
            module.run_schedule = real
    return out


def _interleaved_cp_case() -> dict:
    return _reduced_grads_of_train_step([INTERLEAVED_CASE], {"num_microbatches": 2})


def test_interleaved_schedule_under_context_parallelism_matches_plain_reference(plain_reference):
    """CP=2 x PP=2 x VPP=2 (4 ranks): each CP rank's shard through the interleaved schedule."""
    got = run_ranks(_interleaved_cp_case, 4, pp=2, vpp=2, cp=2, timeout_s=90)[0]
    _compare_with_plain_reference({INTERLEAVED_CASE: plain_reference[INTERLEAVED_CASE]}, got, "cp2-pp2-vpp2")


def test_interleaved_schedule_runs_every_split_and_refuses_what_it_cannot(plain_reference):
    got = run_ranks(_interleaved_cases, 2, pp=2, vpp=2, timeout_s=60)[0]
    ref = {INTERLEAVED_CASE: plain_reference[INTERLEAVED_CASE]}
    expected_counts = {"2mb": 2, "budget": 4, "size8": 2}
    for name, run in got["runs"].items():
        n = expected_counts[name]
        # compute_logprobs (forward only), then train_step, each on n micro-batches of one shape
        assert [(fwd, k, len(shapes)) for fwd, k, shapes in run["counts"]] == [(True, n, 1), (False, n, 1)], (
            name,
            run["counts"],
        )
        if name == "budget":  # split further than first-fit decreasing did: still within the token cap
            assert all(s[0] * s[1] <= 26 for _, _, shapes in run["counts"] for s in shapes), run["counts"]
        _compare_with_plain_reference(ref, {k: v for k, v in run.items() if k != "counts"}, f"pp2-vpp2/{name}")
    r = got["refusals"]
    where = "under the interleaved pipeline schedule (pp=2, vpp=2)"
    assert r["three"].startswith(f"train_step: argument 'config.num_microbatches' expected a multiple of 2 {where}"), r[
        "three"
    ]
    assert "(e.g. 4;" in r["three"] and r["three"].endswith("received 3"), r["three"]
    assert r["default"].startswith("compute_logprobs: argument 'config.num_microbatches' expected a multiple of 2"), r[
        "default"
    ]
    assert "(e.g. 2;" in r["default"] and r["default"].endswith("received None (one micro-batch)"), r["default"]
    assert r["padded"].startswith(f"train_step: argument 'config.layout' expected 'packed' {where}"), r["padded"]
    assert r["padded"].endswith("received 'padded'"), r["padded"]
    assert r["critic"].startswith("critic_step: argument 'config.num_microbatches' expected a multiple of 2"), r[
        "critic"
    ]
    assert r["values"].startswith("compute_values: argument 'config.num_microbatches' expected a multiple of 2"), r[
        "values"
    ]
    assert r["too-few"].startswith(
        "split_batch: argument 'samples' expected at least 2 samples on every data-parallel rank"
    ), r["too-few"]
    assert "1 rounded up to a multiple of 2" in r["too-few"], r["too-few"]
    assert r["fwd-count"] == (
        f"forward_only: argument 'microbatches' expected a multiple of 2 micro-batches {where}, which runs "
        "micro-batches in groups of 2 per virtual stage, received 3 micro-batches"
    ), r["fwd-count"]
    assert r["fwd-shapes"].startswith(
        f"forward_only: argument 'microbatches' expected micro-batches of one shape {where}"
    ), r["fwd-shapes"]
