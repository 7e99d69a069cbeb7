"""Context parallelism and sequence parallelism in the training step: invariance against one process.

Every layout runs train_step (one Adam update, linear in the gradient) and compute_logprobs on the
same global batch and the same full initial weights as one process with one micro-batch, and must
agree to 1e-5 relative on the loss metrics, the grad norm, every updated parameter and every
sample's response log-probs. The batch mixes very different lengths, a sample shorter than
``2*cp`` tokens and multi-modal fields. One run_ranks call per layout.
"""

from __future__ import annotations

import pytest
import torch

import fnppo
from fnppo.core.losses import Aggregation, KLPenalty, LossConfig, ppo_clip
from fnppo.testing import run_ranks, synthetic_samples, tiny_model_config
from tests.step_helpers import gather_dp, max_metric_error

REL = 1e-5
N_SAMPLES = 8
METRICS = ("loss", "grad_norm", "pg_loss", "entropy", "kl_loss")
TABLE: dict[str, float] = {}


def _model_cfg() -> fnppo.ModelConfig:
    return tiny_model_config(max_seq_len=64, tie_embeddings=True)


def _samples() -> list:
    out = synthetic_samples(N_SAMPLES - 2, seed=7, response_len=(1, 12), multi_modal_every=3)
    g = torch.Generator().manual_seed(11)
    tiny = fnppo.Sample.from_lists(
        [5], [9], advantages=1.0, old_logprobs=[-2.0], ref_logprobs=[-2.1]
    )  # 2 tokens < 2*cp
    r = 41
    long = fnppo.Sample(
        prompt_ids=torch.randint(0, 64, (6,), generator=g),
        response_ids=torch.randint(0, 64, (r,), generator=g),
        advantages=torch.randn(r, generator=g),
        old_logprobs=-2.0 + 0.3 * torch.randn(r, generator=g),
        ref_logprobs=-2.0 + 0.3 * torch.randn(r, generator=g),
    )
    return out[:3] + [tiny] + out[3:] + [long]


def _update(splits: tuple[str, ...], sequence_parallel: bool = False) -> dict:
    layout = fnppo.parallel.current_layout()
    results = {}
    for split in splits:
        chunks = fnppo.build_gpt(_model_cfg(), sequence_parallel=sequence_parallel)
        fnppo.models.layout_invariant_init(chunks, seed=3)
        ddp = fnppo.wrap_ddp(chunks, use_distributed_optimizer=True)
        opt = fnppo.build_optimizer(ddp, lr=10.0, adam_eps=10.0, clip_grad=0.0)
        state = fnppo.TrainState(model=ddp, optimizer=opt)
        samples = fnppo.shard_for_data_parallel(_samples(), layout)
        loss = LossConfig(policy=ppo_clip(), agg=Aggregation("token-mean"), entropy_coef=0.01, kl=KLPenalty(0.05, "k3"))
        extra = {"2mb": {"num_microbatches": 2}, "fused": {"fns": fnppo.StepFns.fused()}}.get(split, {})
        cfg = fnppo.StepConfig(loss=loss, **extra)
        logprobs, entropy = fnppo.compute_logprobs(state.model, samples, with_entropy=True, config=cfg)
        if layout.cp > 1:
            _check_refusals(state, samples, cfg)
        state, metrics = fnppo.train_step(state, samples, cfg)
        full = fnppo.models.gather_full_weights(state.model)
        logprobs = gather_dp(logprobs, layout)
        results[split] = {
            "metrics": metrics,
            "weights": full,
            "logprobs": logprobs,
            "entropy": gather_dp(entropy, layout),
        }
    return results if layout.rank == 0 else {}


def _check_refusals(state, samples, cfg) -> None:
    """Under CP, sequence-level losses and the padded layout are refused before anything runs."""
    import dataclasses

    seq_loss = dataclasses.replace(cfg.loss, agg=Aggregation("seq-mean-token-mean"))
    for bad, match in (
        (dataclasses.replace(cfg, loss=seq_loss), "config.loss.agg.mode"),
        (dataclasses.replace(cfg, layout="padded"), "config.layout"),
        (dataclasses.replace(cfg, pad_to_multiple_of=2), "pad_to_multiple_of"),
    ):
        with pytest.raises(fnppo.InputError, match=match):
            fnppo.train_step(state, samples, bad)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


def _compare(ref: dict, got: dict, what: str) -> float:
    assert set(METRICS) <= set(ref["metrics"]) and set(ref["metrics"]) == set(got["metrics"]), what
    worst = max_metric_error(
        ref["metrics"], got["metrics"], ref["metrics"], what, REL
    )  # every metric, not only the loss terms
    assert set(ref["weights"]) == set(got["weights"])
    for name, w in ref["weights"].items():
        err = _rel(got["weights"][name], w)
        assert err <= REL, f"{what}: parameter {name} rel err {err:.2e}"
        worst = max(worst, err)
    assert len(got["logprobs"]) == len(ref["logprobs"]) == N_SAMPLES
    for i, (a, b) in enumerate(zip(got["logprobs"] + got["entropy"], ref["logprobs"] + ref["entropy"])):
        assert a.shape == b.shape, f"{what}: compute_logprobs sample {i % N_SAMPLES} shape {a.shape} vs {b.shape}"
        err = _rel(a, b)
        assert err <= REL, f"{what}: compute_logprobs/entropy sample {i % N_SAMPLES} rel err {err:.2e}"
        worst = max(worst, err)
    return worst


@pytest.fixture(scope="module")
def reference():
    ref = run_ranks(_update, 1, ("1mb",))[0]["1mb"]
    assert ref["metrics"]["grad_norm"] > 1e-4 and ref["metrics"]["skipped"] == 0.0
    return ref


LAYOUTS = {
    # name: (world, tp, pp, cp, sequence_parallel, splits)
    "cp2": (2, 1, 1, 2, False, ("1mb", "2mb", "fused")),
    "cp2-dp2": (4, 1, 1, 2, False, ("2mb",)),
    "cp2-tp2": (4, 2, 1, 2, False, ("1mb",)),
    "cp2-pp2": (4, 1, 2, 2, False, ("2mb",)),
    "tp2-sp": (2, 2, 1, 1, True, ("1mb", "fused")),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_matches_single_process(reference, name):
    world, tp, pp, cp, sp, splits = LAYOUTS[name]
    results = run_ranks(_update, world, splits, sp, tp=tp, pp=pp, cp=cp)[0]
    worst = max(_compare(reference, got, f"{name}/{split}") for split, got in results.items())
    print(f"\n{name}: max relative difference vs 1 process {worst:.2e}")
