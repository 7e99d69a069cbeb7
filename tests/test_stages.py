"""How train_step composes its parts, over real Megatron on CPU (one gloo rank).

* Every stage of :class:`fnppo.StepFns` (collate, forward, logprob, loss, and the fused path's head)
  can be swapped for a user function: the function is called once per micro-batch and its result is what the step uses
  (compared with an equivalent step that needs no swap).
* ``ppo_epochs`` x ``num_minibatches`` updates in one call equal a plain loop of single updates
  on the strided mini-batches (weights bit-identical, metrics merged exactly).
* Megatron's model config: ``train_step`` installs fnppo's finalizer for its schedule only; the
  four fields it sets are restored (also when the step fails), so a user's own schedule after it
  runs with the user's settings.

All checks run in one ``run_ranks`` call (Megatron's import dominates the time); the tests read the
returned dict.
"""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch

import fnppo
from fnppo.core.losses import KLPenalty, LossConfig, loss_normalizer, ppo_loss
from fnppo.testing import run_ranks, synthetic_samples, tiny_model_config

HOOKS = ("finalize_model_grads_func", "no_sync_func", "grad_sync_func", "param_sync_func")
REL = 1e-6


def _state(optimizer: str = "adam") -> fnppo.TrainState:
    cfg = tiny_model_config()
    chunks = fnppo.build_gpt(cfg)
    fnppo.models.layout_invariant_init(chunks, seed=5)
    ddp = fnppo.wrap_ddp(chunks)
    return fnppo.TrainState(
        model=ddp, optimizer=fnppo.build_optimizer(ddp, optimizer=optimizer, lr=1e-2, clip_grad=0.0)
    )


def _weights(state: fnppo.TrainState) -> dict[str, torch.Tensor]:
    core = fnppo.megatron.unwrap.unwrap_model(state.model[0])
    return {k: v.detach().clone() for k, v in core.named_parameters()}


def _loss_cfg() -> LossConfig:
    return LossConfig(entropy_coef=0.01, kl=KLPenalty(0.05))


def _step(samples, **kw):
    state = _state()
    state, metrics = fnppo.train_step(state, samples, fnppo.StepConfig(loss=_loss_cfg(), num_microbatches=2, **kw))
    return _weights(state), metrics


# ---------------------------------------------------------------------------------------------
# stage swaps
# ---------------------------------------------------------------------------------------------
def _stage_swaps(samples) -> dict:
    calls = {"collate": 0, "forward": 0, "logprob": 0, "loss": 0, "head": 0}

    def collate(group, *, layout, pad_to_multiple_of, sample_index):
        calls["collate"] += 1
        mb = fnppo.collate_microbatch(
            group, layout=layout, pad_to_multiple_of=pad_to_multiple_of, sample_index=sample_index
        )
        return dataclasses.replace(mb, advantages=-mb.advantages)

    def forward(model, microbatch, *, params=None):
        calls["forward"] += 1
        return 2.0 * fnppo.forward_logits(model, microbatch, params=params)

    def logprob(logits, labels, *, tp_group, temperature, with_entropy, vocab_size):
        calls["logprob"] += 1
        return fnppo.logprob_and_entropy(
            logits, labels, tp_group=tp_group, temperature=4.0, with_entropy=with_entropy, vocab_size=vocab_size
        )

    def head(hidden, weight, labels, *, tp_group, temperature, with_entropy, vocab_size):
        calls["head"] += 1
        return fnppo.ops.linear_logprob_and_entropy(
            hidden, weight, labels, tp_group=tp_group, temperature=4.0, with_entropy=with_entropy, vocab_size=vocab_size
        )

    def loss(*args, **kwargs):
        calls["loss"] += 1
        value, metrics = ppo_loss(*args, **kwargs)
        return 3.0 * value, {**metrics, "user_metric": torch.tensor([6.0, 2.0])}

    flipped = [dataclasses.replace(s, advantages=-s.advantages) for s in samples]
    out = {}
    for name, fn, reference in (
        ("collate", collate, _step(flipped)),  # the negated advantages are what the loss saw
        ("forward", forward, _step(samples, temperature=0.5)),  # 2 * logits == logits / 0.5
        ("logprob", logprob, _step(samples, temperature=4.0)),  # the user's temperature wins
        ("loss", loss, None),
        ("head", head, _step(samples, temperature=4.0, fns=fnppo.StepFns.fused())),  # the user's temperature wins
    ):
        before = dict(calls)
        got = _step(samples, fns=fnppo.StepFns.fused(head=fn) if name == "head" else fnppo.StepFns(**{name: fn}))
        out[name] = {
            "calls": calls[name] - before[name],
            "others": {k: calls[k] - before[k] for k in calls if k != name},
            "got": got,
            "reference": reference,
        }
    out["default"] = _step(samples)
    return out


# ---------------------------------------------------------------------------------------------
# epochs x mini-batches vs a plain loop of single updates
# ---------------------------------------------------------------------------------------------
def _epochs_vs_loop(samples) -> dict:
    loss_cfg = _loss_cfg()
    state = _state()
    state, metrics = fnppo.train_step(state, samples, fnppo.StepConfig(loss=loss_cfg, num_minibatches=2, ppo_epochs=2))
    combined = {"weights": _weights(state), "metrics": metrics, "step": state.step}
    state = _state()
    singles = []
    for _epoch in range(2):
        for k in range(2):
            minibatch = samples[k::2]
            state, m = fnppo.train_step(state, minibatch, fnppo.StepConfig(loss=loss_cfg))
            tokens = float(loss_normalizer(fnppo.collate_microbatch(minibatch).loss_mask, loss_cfg))
            singles.append({"metrics": m, "tokens": tokens})
    loop = {"weights": _weights(state), "singles": singles, "step": state.step}
    # the same updates in another order end elsewhere (the comparison can tell orders apart)
    state = _state()
    for minibatch in (samples[:4], samples[4:], samples[:4], samples[4:]):
        state, _ = fnppo.train_step(state, minibatch, fnppo.StepConfig(loss=loss_cfg))
    return {"combined": combined, "loop": loop, "contiguous_weights": _weights(state)}


# ---------------------------------------------------------------------------------------------
# Megatron's config
# ---------------------------------------------------------------------------------------------
def _megatron_config(samples) -> dict:
    from megatron.core.pipeline_parallel import get_forward_backward_func

    state = _state()
    config = fnppo.megatron.unwrap.unwrap_model(state.model[0]).config
    calls: list[str] = []

    def user_finalize(model, num_tokens=None, *args, **kwargs):
        calls.append("finalize")

    @contextlib.contextmanager
    def user_no_sync():
        calls.append("no_sync")
        yield

    def user_grad_sync(params):
        calls.append("grad_sync")

    def user_param_sync(params):
        calls.append("param_sync")

    user = {
        "finalize_model_grads_func": user_finalize,
        "no_sync_func": user_no_sync,
        "grad_sync_func": user_grad_sync,
        "param_sync_func": user_param_sync,
    }
    for name, value in user.items():
        setattr(config, name, value)
    state, metrics = fnppo.train_step(state, samples, fnppo.StepConfig(loss=_loss_cfg(), num_microbatches=2))
    out = {
        "updates": metrics["updates"],
        "calls_during_step": list(calls),
        "restored": {name: getattr(config, name) is user[name] for name in HOOKS},
    }

    def boom(*args, **kwargs):
        raise RuntimeError("user loss failed")

    try:
        fnppo.train_step(state, samples, fnppo.StepConfig(num_microbatches=2, fns=fnppo.StepFns(loss=boom)))
        out["error"] = None
    except RuntimeError as err:
        out["error"] = str(err)
    out["restored_after_error"] = {name: getattr(config, name) is user[name] for name in HOOKS}

    # a user's own schedule after train_step: Megatron calls the user's hooks, not fnppo's
    mbs = [fnppo.collate_microbatch(g) for g in fnppo.split_batch(samples, num_microbatches=2).apply(samples)]

    def forward_step(data_iterator, model):
        mb = next(data_iterator)

        def loss_func(logits):
            lp, _ = fnppo.logprob_and_entropy(logits, mb.labels, with_entropy=False)
            return -(lp * mb.loss_mask).sum() / mb.loss_mask.sum(), {}

        return fnppo.forward_logits(model, mb), loss_func

    calls.clear()
    get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter(mbs),
        model=list(state.model),
        num_microbatches=len(mbs),
        seq_length=max(int(mb.input_ids.shape[1]) for mb in mbs),
        micro_batch_size=1,
        forward_only=False,
    )
    out["calls_in_user_schedule"] = list(calls)
    return out


# ---------------------------------------------------------------------------------------------
# compute_logprobs: the fields it needs as keywords, config= still accepted
# ---------------------------------------------------------------------------------------------
def _logprob_keywords(samples) -> dict:
    model = _state().model
    by_config = fnppo.compute_logprobs(
        model, samples, with_entropy=True, config=fnppo.StepConfig(num_microbatches=2, temperature=2.0, layout="padded")
    )
    by_keywords = fnppo.compute_logprobs(
        model, samples, with_entropy=True, num_microbatches=2, temperature=2.0, layout="padded"
    )
    # a keyword wins over config; a token budget reorders the samples, restored afterwards
    budget = fnppo.split_batch(samples, max_tokens_per_microbatch=24)
    mixed = fnppo.compute_logprobs(
        model,
        samples,
        with_entropy=True,
        max_tokens_per_microbatch=24,
        temperature=2.0,
        config=fnppo.StepConfig(num_microbatches=2, temperature=1.0),
    )
    plain = fnppo.compute_logprobs(model, samples)
    return {
        "by_config": by_config,
        "by_keywords": by_keywords,
        "mixed": mixed,
        "plain": plain,
        "budget_order": budget.order,
        "lengths": [s.response_len for s in samples],
    }


def _all() -> dict:
    samples = synthetic_samples(8, seed=3)
    return {
        "stages": _stage_swaps(samples),
        "epochs": _epochs_vs_loop(samples),
        "megatron": _megatron_config(samples),
        "logprobs": _logprob_keywords(samples),
    }


@pytest.fixture(scope="module")
def results():
    return run_ranks(_all, 1)[0]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


def _assert_weights(got: dict, want: dict, rel: float, what: str) -> None:
    assert got.keys() == want.keys()
    for k in want:
        err = _rel(got[k], want[k])
        assert err <= rel, f"{what}: parameter {k} differs by {err:.2e}"


def _moved(a: dict, b: dict) -> float:
    return max(_rel(a[k], b[k]) for k in a)


@pytest.mark.parametrize("stage", ["collate", "forward", "logprob", "loss", "head"])
def test_each_stage_can_be_swapped(results, stage):
    r = results["stages"][stage]
    default_weights, default_metrics = results["stages"]["default"]
    got_weights, got_metrics = r["got"]
    assert r["calls"] == 2, f"{stage}: called {r['calls']} times for 2 micro-batches"
    assert all(n == 0 for n in r["others"].values()), r["others"]
    assert got_metrics["skipped"] == 0.0
    assert _moved(got_weights, default_weights) > 1e-4, f"{stage}: the user function's result was not used"
    if stage == "loss":
        # 3 x the loss: 3 x the gradient; the user's own metric reaches the step's metrics
        assert got_metrics["grad_norm"] == pytest.approx(3 * default_metrics["grad_norm"], rel=1e-5)
        assert got_metrics["loss"] == pytest.approx(default_metrics["loss"], rel=1e-6)
        assert got_metrics["user_metric"] == 3.0
        return
    ref_weights, ref_metrics = r["reference"]
    _assert_weights(got_weights, ref_weights, REL, stage)
    for key in ("loss", "pg_loss", "entropy", "kl_loss", "grad_norm"):
        assert got_metrics[key] == pytest.approx(ref_metrics[key], rel=1e-5), key


def test_epochs_and_minibatches_equal_a_loop_of_single_updates(results):
    r = results["epochs"]
    combined, loop = r["combined"], r["loop"]
    assert combined["step"] == loop["step"] == 4
    assert combined["metrics"]["updates"] == 4.0 and combined["metrics"]["skipped"] == 0.0
    assert combined["metrics"]["step"] == 4.0
    _assert_weights(combined["weights"], loop["weights"], 0.0, "epochs x minibatches")  # bit-identical
    singles = loop["singles"]
    assert combined["metrics"]["grad_norm"] == pytest.approx(
        sum(s["metrics"]["grad_norm"] for s in singles) / 4, rel=1e-6
    )
    # metrics merge exactly: token-mean loss of all four updates = sum(num) / sum(tokens)
    for key in ("loss", "pg_loss", "entropy", "kl_loss"):
        num = sum(s["metrics"][key] * s["tokens"] for s in singles)
        assert combined["metrics"][key] == pytest.approx(num / sum(s["tokens"] for s in singles), rel=1e-5), key
    # another order of the same samples gives other weights, so the comparison above is sharp
    assert _moved(r["contiguous_weights"], loop["weights"]) > 1e-4


def test_megatron_config_is_restored_for_a_user_schedule(results):
    r = results["megatron"]
    assert r["updates"] == 1.0 and r["calls_during_step"] == []  # fnppo's hooks ran, not the user's
    assert all(r["restored"].values()), r["restored"]
    assert r["error"] == "user loss failed"
    assert all(r["restored_after_error"].values()), r["restored_after_error"]
    assert "finalize" in r["calls_in_user_schedule"] and "no_sync" in r["calls_in_user_schedule"]


def test_compute_logprobs_takes_its_fields_as_keywords(results):
    r = results["logprobs"]
    assert r["budget_order"] != tuple(range(8))  # the budget split does reorder the samples
    (lp_c, ent_c), (lp_k, ent_k), (lp_m, ent_m) = r["by_config"], r["by_keywords"], r["mixed"]
    assert [t.numel() for t in lp_c] == r["lengths"]
    for a, b in zip(lp_c + ent_c, lp_k + ent_k):
        assert torch.equal(a, b)
    for a, b in zip(lp_c + ent_c, lp_m + ent_m):  # other split and layout: same values, in sample order
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    lp_p, ent_p = r["plain"]
    assert ent_p is None
    assert max(float((a - b).abs().max()) for a, b in zip(lp_p, lp_c)) > 1e-3  # the temperature was used
