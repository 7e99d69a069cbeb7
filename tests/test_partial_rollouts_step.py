"""Per-token policy versions in ``train_step`` over real Megatron ranks (gloo on CPU).

Samples whose response tokens come from several policy versions (partial rollouts), given their
ages by ``Staleness.prepare``, trained with ``loglinear_decoupled`` in bypass mode: every split
(count, size, token budget), both layouts (packed, padded) and TP=2, PP=2, DP=2 give the gradient of
one process with one micro-batch computed by plain autograd (whose loss is checked against a float64
loop in ``tests/test_partial_rollouts.py``); where every token of a sample has the same version, the
per-token run is the per-sample run (one scalar ``staleness``), bit for bit in the same layout. The
step refuses, before anything changes, per-token versions without ages for a loss that depends on
the age, and versions on some samples only.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import fnppo
from fnppo.core.losses import LossConfig, Staleness, loglinear_decoupled, ppo_loss
from fnppo.core.metrics import finalize_metrics
from fnppo.testing import run_ranks, synthetic_samples, tiny_model_config
from tests.messages import check_message

# SGD without clipping: the first update is -lr * gradient (as in tests/test_rollout_correction.py)
LR = 1000.0
REL = 1e-6
CURRENT = 10
N = 8


def _cases(samples: list) -> dict:
    """``name: (prepared samples, loss config)``: mixed per-token ages; the same samples with one
    version per sample as uniform per-token ages and as the loss's scalar; mixed ages with expiry."""
    g = torch.Generator().manual_seed(4)
    versions = [
        (
            CURRENT
            - 4
            + torch.randint(0, 2, (1,), generator=g)
            + torch.randint(0, 2, (s.response_len,), generator=g).cumsum(0)
        ).clamp_max(CURRENT)
        for s in samples
    ]
    tokens = [dataclasses.replace(s, versions=v) for s, v in zip(samples, versions, strict=True)]

    def cfg(k: int) -> LossConfig:
        return LossConfig(policy=loglinear_decoupled(staleness=k, weight_cap=1.5), bypass_old_logprobs=True)

    contract = Staleness(max_staleness=4, proximal="behaviour")
    return {
        "tokens": (contract.prepare(tokens, CURRENT)[0], cfg(4)),
        "uniform": (contract.prepare(samples, CURRENT, versions=[CURRENT - 3] * len(samples))[0], cfg(3)),
        "scalar": (samples, cfg(3)),
        "expired": (Staleness(max_staleness=2, expire="tokens").prepare(tokens, CURRENT)[0], cfg(2)),
    }


def _chunks():
    chunks = fnppo.build_gpt(tiny_model_config(tie_embeddings=True))
    fnppo.models.layout_invariant_init(chunks, seed=3)
    return chunks


def _reference() -> dict:
    """Samples with rollout log-probs near the model's, and every case's gradient by plain autograd
    on one micro-batch (packed), one process; the step's refusals."""
    torch.set_default_dtype(torch.float32)
    chunks = _chunks()
    base = [dataclasses.replace(s, old_logprobs=None) for s in synthetic_samples(N, seed=11, with_rollout=True)]
    lps, _ = fnppo.compute_logprobs(fnppo.wrap_ddp(chunks, use_distributed_optimizer=False), base)
    g = torch.Generator().manual_seed(5)
    samples = [
        dataclasses.replace(s, rollout_logprobs=lp + 0.15 * torch.randn(lp.shape, generator=g))
        for s, lp in zip(base, lps, strict=True)
    ]
    core = fnppo.megatron.unwrap.unwrap_model(chunks[0])
    params = dict(core.named_parameters())
    out: dict = {"samples": samples, "cases": {}, "ages": {}}
    for name, (batch, cfg) in _cases(samples).items():
        mb = fnppo.collate_microbatch(batch, layout="packed")
        lp, ent = fnppo.logprob_and_entropy(fnppo.forward_logits(core, mb), mb.labels, with_entropy=True)
        loss, metrics = ppo_loss(
            lp,
            None,
            mb.advantages,
            mb.loss_mask,
            cfg,
            entropy=ent,
            rollout_logprobs=mb.rollout_logprobs,
            seq_ids=mb.seq_ids,
            staleness=mb.staleness,
        )
        grads = torch.autograd.grad(loss, list(params.values()))
        out["cases"][name] = {"grads": dict(zip(params, grads)), "metrics": finalize_metrics(metrics)}
        out["ages"][name] = None if mb.staleness is None else sorted(set(mb.staleness[mb.loss_mask != 0].tolist()))
    out["refusals"] = _refusals(samples)
    return out


def _refusals(samples: list) -> dict:
    """What train_step refuses (message, and whether the weights and step stayed as they were)."""
    tokens, cfg = _cases(samples)["tokens"]
    no_ages = [dataclasses.replace(s, staleness=None) for s in tokens]
    some = [*tokens[:5], dataclasses.replace(tokens[5], versions=None, staleness=None), *tokens[6:]]
    out = {}
    for name, batch in (("versions-without-ages", no_ages), ("versions-on-some-samples", some)):
        ddp = fnppo.wrap_ddp(_chunks(), use_distributed_optimizer=False)
        state = fnppo.TrainState(model=ddp, optimizer=fnppo.build_optimizer(ddp, optimizer="sgd", lr=LR, clip_grad=0.0))
        before = fnppo.models.gather_full_weights(state.model)
        try:
            fnppo.train_step(state, batch, fnppo.StepConfig(loss=cfg, num_microbatches=2))
            err = None
        except fnppo.InputError as e:
            err = e
        after = fnppo.models.gather_full_weights(state.model)
        out[name] = (err, state.step == 0 and all(torch.equal(before[k], after[k]) for k in before))
    return out


def _layout(samples: list, splits: dict) -> dict:
    """Every case under every split of ``splits``: the first update's gradient and the metrics (rank 0)."""
    torch.set_default_dtype(torch.float32)
    layout = fnppo.parallel.current_layout()
    out = {}
    for split_name, split in splits.items():
        for name, (batch, cfg) in _cases(samples).items():
            ddp = fnppo.wrap_ddp(_chunks(), use_distributed_optimizer=False)
            state = fnppo.TrainState(
                model=ddp, optimizer=fnppo.build_optimizer(ddp, optimizer="sgd", lr=LR, clip_grad=0.0)
            )
            w0 = fnppo.models.gather_full_weights(state.model)
            mine = fnppo.shard_for_data_parallel(batch, layout)
            state, metrics = fnppo.train_step(state, mine, fnppo.StepConfig(loss=cfg, **split))
            w1 = fnppo.models.gather_full_weights(state.model)
            out[(split_name, name)] = {"metrics": metrics, "grads": {k: (w0[k] - w1[k]) / LR for k in w0}}
    return out if layout.rank == 0 else {}


@pytest.fixture(scope="module")
def reference():
    return run_ranks(_reference, 1)[0]


def test_cases_are_not_vacuous_and_the_step_refuses_by_name(reference):
    ages = reference["ages"]
    assert len(ages["tokens"]) >= 4 and ages["uniform"] == [3.0] and ages["scalar"] is None  # mixed ages: 0..4
    assert max(ages["expired"]) <= 2.0
    cases = reference["cases"]
    tokens, scalar = cases["tokens"]["metrics"], cases["scalar"]["metrics"]
    assert 0.0 < tokens["token_staleness"] < 4.0 and "token_staleness" not in scalar
    assert tokens["behaviour_weight"] != pytest.approx(cases["uniform"]["metrics"]["behaviour_weight"], rel=1e-3)
    err, unchanged = reference["refusals"]["versions-without-ages"]
    check_message(
        err,
        fnppo.InputError,
        "train_step",
        "batch[0].staleness",
        "per-token ages since batch[0] carries per-token versions",
        "None",
    )
    assert unchanged
    err, unchanged = reference["refusals"]["versions-on-some-samples"]
    check_message(
        err, fnppo.InputError, "train_step", "batch[5].versions", "(batch[0] has versions; all samples or none)", "None"
    )
    assert unchanged


SPLITS = {
    "count-packed": {"num_microbatches": 3},
    "size-padded": {"microbatch_size": 3, "layout": "padded"},
    "budget-packed": {"max_tokens_per_microbatch": 24},
}
LAYOUTS = {  # (world, tp, pp, splits)
    "1proc": (1, 1, 1, tuple(SPLITS)),
    "tp2": (2, 2, 1, ("budget-packed", "size-padded")),
    "pp2": (2, 1, 2, ("count-packed",)),
    "dp2": (2, 1, 1, ("count-packed",)),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_every_split_and_layout_gives_the_one_process_gradient(reference, name):
    world, tp, pp, splits = LAYOUTS[name]
    got = run_ranks(_layout, world, reference["samples"], {s: SPLITS[s] for s in splits}, tp=tp, pp=pp)[0]
    worst = 0.0
    for (split, case), mine in got.items():
        ref = reference["cases"][case]
        assert mine["metrics"]["skipped"] == 0.0, (split, case)
        for key in ("loss", "pg_loss", "behaviour_weight", "token_staleness"):
            if key in ref["metrics"]:
                # (fp32 metric pairs: a loss summed from terms of both signs has a larger relative error)
                assert mine["metrics"][key] == pytest.approx(ref["metrics"][key], rel=1e-5, abs=1e-6), (
                    split,
                    case,
                    key,
                )
        for k, r in ref["grads"].items():
            err = float((mine["grads"][k] - r).abs().max() / r.abs().max().clamp_min(1e-12))
            worst = max(worst, err)
            assert err <= REL, f"{name}/{split}/{case}: gradient of {k} differs by {err:.2e}"
        if case == "uniform":  # one version per sample, as per-token ages = the loss's scalar: the same bits
            scalar = got[(split, "scalar")]
            for k in ref["grads"]:
                assert torch.equal(mine["grads"][k], scalar["grads"][k]), f"{name}/{split}: {k} uniform != scalar"
    print(f"{name}: max relative gradient difference {worst:.2e}")
