"""A refused step changes nothing and is refused on every rank alike.

``train_step`` / ``critic_step`` check the caller's whole batch before the first update of the first
mini-batch of the first epoch: a bad sample that only the last mini-batch of the last epoch would
train on is refused with parameters, Adam's moments and ``state.step`` bit-identical, and the error
names its position in the caller's batch (``batch[i]``), not in a micro-batch. Under several ranks
the verdict is agreed (one all-reduce): every rank raises the same error, none is left waiting in a
collective of a step the others gave up.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

import fnppo
from fnppo.testing import run_ranks, synthetic_samples
from tests.messages import check_message
from tests.test_step import _adam_moments, _build_state, _loss_cfg, _model_cfg

N = 8


def _optimizer_state(state) -> dict[str, torch.Tensor]:
    """The parameters of every model chunk, the optimizer's own (fp32 shard) parameters and Adam's
    moments, cloned: everything a step changes."""
    out = {
        f"chunk{c}.{n}": p.detach().clone()
        for c, m in enumerate(state.model)
        for n, p in fnppo.megatron.unwrap.unwrap_model(m).named_parameters()
    }
    for i, sub in enumerate(getattr(state.optimizer, "chained_optimizers", None) or [state.optimizer]):
        for j, group in enumerate(sub.optimizer.param_groups):
            for k, p in enumerate(group["params"]):
                out[f"opt{i}.{j}.{k}.param"] = p.detach().clone()
    out.update({f"adam.{k}": v for k, v in _adam_moments(state.optimizer).items()})
    return out


def _changed(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> list[str]:
    assert set(before) == set(after)
    return sorted(k for k in before if not torch.equal(before[k], after[k]))


def _refusal(state, step, batch, cfg) -> dict:
    """The call's InputError message (or what happened instead) and what it changed."""
    before, step_before = _optimizer_state(state), state.step
    try:
        step(state, batch, cfg)
        msg = "no error"
    except fnppo.InputError as err:
        msg = str(err)
    return {"msg": msg, "changed": _changed(before, _optimizer_state(state)), "step": (step_before, state.step)}


def _with(samples: list, i: int, **fields) -> list:
    return [dataclasses.replace(s, **fields) if j == i else s for j, s in enumerate(samples)]


def _grouped(samples: list, *members: int) -> list:
    """``samples`` with ``members`` one declared group sharing the first member's prompt."""
    first = samples[members[0]]
    out = list(samples)
    for i in members:
        out[i] = dataclasses.replace(samples[i], prompt_ids=first.prompt_ids.clone(), group=1)
    return out


def _nan_at(samples: list, i: int, field: str = "advantages") -> list:
    t = getattr(samples[i], field).clone()
    t[-1] = math.nan
    return _with(samples, i, **{field: t})


def _critic_samples() -> list:
    g = torch.Generator().manual_seed(21)
    out = []
    for s in synthetic_samples(N, seed=7):
        r = s.response_len
        values, returns = 0.3 * torch.randn(r, generator=g), torch.randn(r, generator=g)
        out.append(dataclasses.replace(s, values=values, returns=returns))
    return out


def _one_process_refusals() -> dict:
    """Each refused call after a real step (so that Adam has moments), then the same configs on good
    data: they do move every kind of state the refusals must leave alone."""
    state = _build_state(lr=1e-2)
    good = synthetic_samples(N, seed=2)
    loss = _loss_cfg("token-mean")
    state, _ = fnppo.train_step(state, good, fnppo.StepConfig(loss=loss))
    minibatches = fnppo.StepConfig(loss=loss, num_minibatches=2, ppo_epochs=2)
    microbatches = fnppo.StepConfig(loss=loss, ppo_epochs=2, num_microbatches=2)
    long_last = _with(good, 7, prompt_ids=torch.arange(24) % 64)
    half_mask = _with(good, 5, response_mask=torch.full((good[5].response_len,), 0.5))
    mask_of_2 = _with(good, 6, response_mask=2 * torch.ones(good[6].response_len))
    out = {
        # sample 7: mini-batch 1 (samples 1, 3, 5, 7) of two, trained in both epochs; micro-batch 1 of it
        "last-minibatch": _refusal(state, fnppo.train_step, _nan_at(good, 7), minibatches),
        # sample 7: samples[3] of micro-batch 1 (samples 4..7)
        "last-microbatch": _refusal(state, fnppo.train_step, _nan_at(good, 7), microbatches),
        "mask-in-last-minibatch": _refusal(state, fnppo.train_step, half_mask, minibatches),
        "too-many-microbatches": _refusal(
            state, fnppo.train_step, good, dataclasses.replace(minibatches, num_microbatches=5)
        ),
        "over-token-budget": _refusal(
            state, fnppo.train_step, long_last, dataclasses.replace(minibatches, max_tokens_per_microbatch=24)
        ),
        "compute_logprobs-mask": {
            "msg": _message(lambda: fnppo.compute_logprobs(state.model, mask_of_2, config=microbatches))
        },
        # shared-prefix packing: samples 5 and 7 (mini-batch 1) one declared group; kept whole it
        # exceeds the budget that each fits alone; declared with another prompt it is no group
        "shared-group-over-budget": _refusal(
            state,
            fnppo.train_step,
            _grouped(good, 5, 7),
            dataclasses.replace(
                minibatches, packing=fnppo.batching.SharedPrefix(split_groups=False), max_tokens_per_microbatch=13
            ),
        ),
        "shared-prompts-differ": _refusal(
            state,
            fnppo.train_step,
            _with(_grouped(good, 5, 7), 7, prompt_ids=good[7].prompt_ids.flip(0) + 1),
            dataclasses.replace(minibatches, packing=fnppo.batching.SharedPrefix()),
        ),
    }
    before = _optimizer_state(state)
    state, metrics = fnppo.train_step(state, good, minibatches)
    out["good"] = {
        "changed": _changed(before, _optimizer_state(state)),
        "keys": sorted(before),
        "step": state.step,
        "updates": metrics["updates"],
    }

    chunks = fnppo.build_gpt(_model_cfg(), head="value")
    fnppo.models.layout_invariant_init(chunks, seed=3)
    ddp = fnppo.wrap_ddp(chunks, use_distributed_optimizer=True)
    critic = fnppo.TrainState(model=ddp, optimizer=fnppo.build_optimizer(ddp, lr=1e-2))
    samples = _critic_samples()
    ccfg = fnppo.CriticConfig(num_minibatches=2, ppo_epochs=2)
    critic, _ = fnppo.critic_step(critic, samples, fnppo.CriticConfig())
    out["critic-last-minibatch"] = _refusal(critic, fnppo.critic_step, _nan_at(samples, 7, "returns"), ccfg)
    before = _optimizer_state(critic)
    critic, _ = fnppo.critic_step(critic, samples, ccfg)
    out["critic-good"] = {"changed": _changed(before, _optimizer_state(critic)), "keys": sorted(before)}
    return out


def _message(call) -> str:
    try:
        call()
    except fnppo.InputError as err:
        return str(err)
    return "no error"


@pytest.fixture(scope="module")
def one_process():
    return run_ranks(_one_process_refusals, 1)[0]


def _nan_received(samples: list, i: int) -> str:
    return f"f32[{samples[i].response_len}] with 1 NaN/inf entries"


NAN_7 = _nan_received(synthetic_samples(N, seed=2), 7)


REFUSALS = {  # case -> (function, argument, expected, received)
    "last-minibatch": ("train_step", "batch[7].advantages", "finite values", NAN_7),
    "last-microbatch": ("train_step", "batch[7].advantages", "finite values", NAN_7),
    "mask-in-last-minibatch": ("train_step", "batch[5].response_mask", "a 0/1 mask", "containing 0.5"),
    "too-many-microbatches": (
        "train_step",
        "config.num_microbatches",
        "at most the mini-batch size 4 (8 samples / num_minibatches=2; no empty micro-batches)",
        "5",
    ),
    "over-token-budget": (
        "train_step",
        "batch[7]",
        "at most max_tokens_per_microbatch=24 tokens",
        "tokens (prompt 24 + response",
    ),
    "critic-last-minibatch": ("critic_step", "batch[7].returns", "finite values", "with 1 NaN/inf entries"),
    "shared-group-over-budget": (
        "train_step",
        "batch[5]",
        "at most max_tokens_per_microbatch=13 tokens (a single sample longer than the token budget cannot be split); "
        "shared-prefix packing keeps the group (batch[5], batch[7]) whole with split_groups=False",
        "tokens as computed (a group of 2 samples",
    ),
    "shared-prompts-differ": (
        "train_step",
        "batch[7].prompt_ids",
        "the prompt of batch[5] (both declare group=1",
        "tokens) (vs",
    ),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_refused_step_changes_nothing_and_names_the_callers_sample(one_process, case):
    got = one_process[case]
    assert got["msg"] != "no error", case
    changed = got["changed"]
    assert changed == [], f"{case}: the refused call changed {len(changed)} tensors, e.g. {changed[:3]}"
    check_message(fnppo.InputError(got["msg"]), fnppo.InputError, *REFUSALS[case])
    assert "(refused on" not in got["msg"]  # one process: no agreement, no suffix
    before, after = got["step"]
    assert before == after == 1


def test_the_same_configs_on_good_data_change_every_kind_of_state(one_process):
    """The refusals above are not vacuous: the good step moves parameters, the optimizer's copies
    and Adam's moments (every entry the refusal test compares), and counts its updates."""
    for name in ("good", "critic-good"):
        got = one_process[name]
        kinds = {k.split(".", 1)[0] for k in got["changed"]}
        assert {"chunk0", "opt0", "adam"} <= kinds, (name, kinds)
        moments = [k for k in got["keys"] if k.startswith("adam.")]
        assert moments and set(moments) <= set(got["changed"]), name
    assert one_process["good"]["updates"] == 4.0 and one_process["good"]["step"] == 5


def test_compute_logprobs_names_the_callers_sample(one_process):
    check_message(
        fnppo.InputError(one_process["compute_logprobs-mask"]["msg"]),
        fnppo.InputError,
        "compute_logprobs",
        "batch[6].response_mask",
        "a 0/1 mask",
        "containing 2.0",
    )


# --------------------------------------------------------------------------------------------
# several ranks: the verdict is agreed
# --------------------------------------------------------------------------------------------
def _agreed_refusal() -> dict:
    """DP=2: the bad sample in data-parallel rank 1's shard only. PP=2: the bad sample on the last
    stage's copy of the batch only (the stages of one DP rank are meant to get the same batch).
    Then a good step on every rank: the process groups are still in step."""
    lay = fnppo.parallel.current_layout()
    state = _build_state(lr=1e-2)
    cfg = fnppo.StepConfig(loss=_loss_cfg("token-mean"), num_minibatches=2)
    good = fnppo.shard_for_data_parallel(synthetic_samples(N, seed=2), lay)
    bad = _nan_at(good, 2) if (lay.dp > 1 and lay.dp_rank == 1) or (lay.pp > 1 and lay.is_last_stage) else good
    msg = _message(lambda: fnppo.train_step(state, bad, cfg))
    state, metrics = fnppo.train_step(state, good, cfg)
    return {"msg": msg, "metrics": metrics, "rank": lay.rank}


@pytest.mark.parametrize(
    "world,pp,suffix",
    [
        (2, 1, "(refused on rank 1 of 2: data-parallel rank 1)"),
        (2, 2, "(refused on rank 1 of 2: data-parallel rank 0, pipeline stage 1)"),
    ],
    ids=["dp2", "pp2"],
)
def test_every_rank_raises_the_same_refusal(world, pp, suffix):
    # a short gloo timeout: a rank left in a collective fails the test instead of stalling it
    results = run_ranks(_agreed_refusal, world, pp=pp, timeout_s=60)
    msgs = [r["msg"] for r in results]
    assert msgs[0] == msgs[1], msgs
    check_message(
        fnppo.InputError(msgs[0]),
        fnppo.InputError,
        "train_step",
        "batch[2].advantages",
        "finite values",
        "1 NaN/inf entries",
    )
    assert msgs[0].endswith(suffix), msgs[0]
    assert results[0]["metrics"] == results[1]["metrics"] and results[0]["metrics"]["updates"] == 2.0
