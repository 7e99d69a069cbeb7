"""Bad input is refused loudly, at the boundary, with a message that says what went wrong.

Every case checks the error type and that the message names the function, the argument, what was
expected and what was received. Each case is one row of the table in ``docs/errors.md`` (that table
also lists the cases tested next to their functions, in ``tests/test_<module>.py``);
``test_every_case_is_in_the_error_table`` keeps the two in step.

The training-step cases (``train_step`` / ``compute_logprobs`` / ``forward_only``) run in one
``run_ranks`` call with tensor parallelism 2, which also checks that refused calls leave the model
untouched and that a good step still works afterwards. The hypothesis tests at the end feed random
sample lists (varied lengths, empty responses, mixed multi-modal items, all-masked responses,
corrupted values) through ``split_batch -> collate_microbatch -> logprob_and_entropy -> ppo_loss``:
only the documented errors may occur, every corruption is caught, and nothing is NaN.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fnppo
from fnppo import (
    InputError,
    Sample,
    ShapeError,
    StepConfig,
    collate_microbatch,
    logprob_and_entropy,
    split_batch,
)
from fnppo.advantages import gae_advantages, grpo_advantages, reinforce_pp_advantages, rloo_advantages
from fnppo.core.advantages import broadcast_to_tokens
from fnppo.core.losses import (
    LOSS_AGG_MODES,
    POLICY_LOSSES,
    Aggregation,
    KLPenalty,
    LossConfig,
    compute_tis_weights,
    kl_penalty,
    loss_normalizer,
    ppo_loss,
    value_loss,
)
from fnppo.megatron.parallel import ParallelLayout
from fnppo.sinks import open_sinks
from fnppo.testing import run_ranks, synthetic_samples, tiny_model_config
from tests.messages import check_message

ROOT = Path(__file__).resolve().parents[1]
TABLE = ROOT / "docs" / "errors.md"


# ---------------------------------------------------------------------------------------------
# in-process cases: (id, call, error type, function, argument, expected excerpt, received excerpt)
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Case:
    id: str
    call: Callable[[], Any]
    exc: type
    fn: str
    arg: str
    expected: str
    received: str


X = torch.zeros(2, 3)
M = torch.ones(2, 3)
NAN = torch.tensor([[0.0, math.nan, 0.0], [0.0, 0.0, 0.0]])
INF = torch.tensor([[0.0, 0.0, 0.0], [0.0, 0.0, math.inf]])
CFG = LossConfig()


def _layout(tp: int = 1, dp: int = 1) -> ParallelLayout:
    return ParallelLayout(
        world_size=tp * dp,
        rank=0,
        tp=tp,
        pp=1,
        dp=dp,
        vpp=None,
        tp_rank=0,
        pp_rank=0,
        dp_rank=0,
        tp_group=None,
        pp_group=None,
        dp_group=None,
        backend="gloo",
    )


CASES = [
    # --- rank / shape / dtype, mismatched sizes between log-probs, masks and advantages ---------
    Case(
        "ppo_loss-seq-mismatch",
        lambda: ppo_loss(X, X, torch.zeros(2, 4), M, CFG),
        ShapeError,
        "ppo_loss",
        "advantages",
        "Float[Tensor, 'batch seq']",
        "f32[2,4]",
    ),
    Case(
        "ppo_loss-batch-mismatch",
        lambda: ppo_loss(X, X, X, torch.ones(3, 3), CFG),
        ShapeError,
        "ppo_loss",
        "loss_mask",
        "Shaped[Tensor, 'batch seq']",
        "f32[3,3]",
    ),
    Case(
        "ppo_loss-wrong-rank",
        lambda: ppo_loss(X, X, X, M, CFG, entropy=torch.zeros(2, 3, 1)),
        ShapeError,
        "ppo_loss",
        "entropy",
        "Float[Tensor, 'batch seq']",
        "f32[2,3,1]",
    ),
    Case(
        "ppo_loss-wrong-dtype",
        lambda: ppo_loss(X.long(), X, X, M, CFG),
        ShapeError,
        "ppo_loss",
        "logprobs",
        "Float[Tensor, 'batch seq']",
        "i64[2,3]",
    ),
    Case(
        "value_loss-shape-mismatch",
        lambda: value_loss(X, X, torch.zeros(2, 4), M),
        ShapeError,
        "value_loss",
        "returns",
        "Float[Tensor, 'batch seq']",
        "f32[2,4]",
    ),
    Case(
        "kl_penalty-shape-mismatch",
        lambda: kl_penalty(torch.zeros(3), torch.zeros(4)),
        ShapeError,
        "kl_penalty",
        "ref_logprobs",
        "Float[Tensor, '*tok']",
        "f32[4]",
    ),
    Case(
        "gae-mask-shape-mismatch",
        lambda: gae_advantages(X, X, torch.ones(2, 4), gamma=1.0, lam=1.0),
        ShapeError,
        "gae_advantages",
        "mask",
        "Shaped[Tensor, 'batch seq']",
        "f32[2,4]",
    ),
    Case(
        "rloo-wrong-rank",
        lambda: rloo_advantages(torch.zeros(2, 2, 2)),
        ShapeError,
        "rloo_advantages",
        "scores",
        "Float[Tensor, 'groups group_size']",
        "f32[2,2,2]",
    ),
    # --- masks that are not 0/1 --------------------------------------------------------------------
    Case(
        "value_loss-mask-not-01",
        lambda: value_loss(X, X, X, -M),
        InputError,
        "value_loss",
        "mask",
        "a 0/1 mask",
        "containing -1.0",
    ),
    Case(
        "tis-mask-not-01",
        lambda: compute_tis_weights(X, X, 0.5 * M, cap=2.0),
        InputError,
        "compute_tis_weights",
        "loss_mask",
        "a 0/1 mask",
        "containing 0.5",
    ),
    Case(
        "reinforce_pp-mask-not-01",
        lambda: reinforce_pp_advantages(X, 0.5 * M),
        InputError,
        "reinforce_pp_advantages",
        "mask",
        "a 0/1 mask",
        "containing 0.5",
    ),
    Case(
        "broadcast-mask-not-01",
        lambda: broadcast_to_tokens(torch.zeros(2), 3 * M),
        InputError,
        "broadcast_to_tokens",
        "mask",
        "a 0/1 mask",
        "containing 3.0",
    ),
    # --- NaN / inf in advantages, log-probs, rewards --------------------------------------------
    Case(
        "ppo_loss-inf-ref-logprobs",
        lambda: ppo_loss(X, X, X, M, LossConfig(kl=KLPenalty(0.1)), ref_logprobs=INF),
        InputError,
        "ppo_loss",
        "ref_logprobs",
        "finite values",
        "1 NaN/inf",
    ),
    Case(
        "value_loss-inf-returns",
        lambda: value_loss(X, X, INF, M),
        InputError,
        "value_loss",
        "returns",
        "finite values",
        "1 NaN/inf",
    ),
    Case(
        "gae-inf-values",
        lambda: gae_advantages(X, INF, M, gamma=1.0, lam=0.95),
        InputError,
        "gae_advantages",
        "values",
        "finite values",
        "1 NaN/inf",
    ),
    Case(
        "reinforce_pp-nan-kl",
        lambda: reinforce_pp_advantages(X, M, kl=NAN, kl_coef=0.1),
        InputError,
        "reinforce_pp_advantages",
        "kl",
        "finite values",
        "1 NaN/inf",
    ),
    Case(
        "tis-nan-rollout",
        lambda: compute_tis_weights(X, NAN, M, cap=2.0),
        InputError,
        "compute_tis_weights",
        "rollout_logprobs",
        "finite values",
        "1 NaN/inf",
    ),
    # --- empty batches -----------------------------------------------------------------------------
    Case(
        "ppo_loss-empty",
        lambda: ppo_loss(torch.zeros(0, 3), torch.zeros(0, 3), torch.zeros(0, 3), torch.zeros(0, 3), CFG),
        InputError,
        "ppo_loss",
        "logprobs",
        "non-empty [batch, seq]",
        "f32[0,3]",
    ),
    Case(
        "value_loss-empty",
        lambda: value_loss(torch.zeros(2, 0), torch.zeros(2, 0), torch.zeros(2, 0), torch.zeros(2, 0)),
        InputError,
        "value_loss",
        "values",
        "non-empty [batch, seq]",
        "f32[2,0]",
    ),
    # --- unknown loss mode / estimator / layout -------------------------------------------------
    Case(
        "loss_normalizer-unknown-mode",
        lambda: loss_normalizer(M, "sum"),
        InputError,
        "loss_normalizer",
        "loss_agg_mode",
        "one of ['token-mean'",
        "'sum'",
    ),
    Case(
        "value_loss-unknown-mode",
        lambda: value_loss(X, X, X, M, loss_agg_mode="mean"),
        InputError,
        "value_loss",
        "loss_agg_mode",
        "'seq-mean-token-mean'",
        "'mean'",
    ),
    Case(
        "StepConfig-unknown-layout",
        lambda: StepConfig(layout="bshd"),
        InputError,
        "StepConfig",
        "layout",
        "'packed' or 'padded'",
        "'bshd'",
    ),
    # --- impossible configs ----------------------------------------------------------------------
    Case(
        "entropy_coeff-negative",
        lambda: LossConfig(entropy_coef=-0.01),
        InputError,
        "LossConfig",
        "entropy_coef",
        "a finite number >= 0",
        "-0.01",
    ),
    Case(
        "kl_coef-negative",
        lambda: KLPenalty(coef=-0.1),
        InputError,
        "KLPenalty",
        "coef",
        "a finite number >= 0",
        "-0.1",
    ),
    Case(
        "value_loss-negative-clip",
        lambda: value_loss(X, X, X, M, -0.1),
        InputError,
        "value_loss",
        "clip_range",
        "a number >= 0 or None",
        "-0.1",
    ),
    Case(
        "grpo-negative-eps",
        lambda: grpo_advantages(torch.zeros(4), torch.zeros(4, dtype=torch.long), eps=-1.0),
        InputError,
        "grpo_advantages",
        "eps",
        "a finite number >= 0",
        "-1.0",
    ),
    Case(
        "StepConfig-two-split-modes",
        lambda: StepConfig(num_microbatches=2, microbatch_size=2),
        InputError,
        "StepConfig",
        "num_microbatches/microbatch_size/max_tokens_per_microbatch",
        "at most one of them",
        "['num_microbatches', 'microbatch_size']",
    ),
    Case(
        "StepConfig-zero-microbatches",
        lambda: StepConfig(num_microbatches=0),
        InputError,
        "StepConfig",
        "num_microbatches",
        "an int >= 1",
        "0",
    ),
    Case(
        "StepConfig-zero-epochs",
        lambda: StepConfig(ppo_epochs=0),
        InputError,
        "StepConfig",
        "ppo_epochs",
        "an int >= 1",
        "0",
    ),
    Case(
        "StepConfig-zero-temperature",
        lambda: StepConfig(temperature=0.0),
        InputError,
        "StepConfig",
        "temperature",
        "a finite number > 0",
        "0.0",
    ),
    Case(
        "shard_for_data_parallel-indivisible",
        lambda: fnppo.shard_for_data_parallel([1, 2, 3], _layout(dp=2)),
        InputError,
        "shard_for_data_parallel",
        "samples",
        "a length divisible by dp=2",
        "3",
    ),
    Case(
        "init_parallel-bad-timeout",
        lambda: fnppo.init_parallel(1, timeout_s=0),
        InputError,
        "init_parallel",
        "timeout_s",
        "a finite number > 0 (seconds)",
        "0",
    ),
    # --- numbers: non-finite or non-numeric values, bools and strings where an int is expected ---
    *[
        Case(f"ModelConfig-{cid}", lambda kw=kw: _model_config(**kw), InputError, "ModelConfig", arg, exp, rec)
        for cid, kw, arg, exp, rec in [
            ("nan-dropout", {"hidden_dropout": math.nan}, "hidden_dropout", "a finite number >= 0.0", "nan"),
            ("inf-init-std", {"init_method_std": math.inf}, "init_method_std", "a finite number > 0.0", "inf"),
            ("zero-init-std", {"init_method_std": 0}, "init_method_std", "a finite number > 0.0", "0"),
            ("str-epsilon", {"layernorm_epsilon": "1e-6"}, "layernorm_epsilon", "a finite number", "'1e-6' (str)"),
            ("bool-layers", {"num_layers": True}, "num_layers", "an int >= 1", "True (bool)"),
            ("str-vocab", {"vocab_size": "64"}, "vocab_size", "an int >= 1", "'64' (str)"),
            ("bool-query-groups", {"num_query_groups": True}, "num_query_groups", "an int >= 1 or None", "True"),
            ("bool-topk", {"num_experts": 4, "moe_topk": True}, "moe_topk", "an int >= 1 and <= 4", "True (bool)"),
            (
                "nan-aux-loss",
                {"num_experts": 4, "moe_aux_loss_coeff": math.nan},
                "moe_aux_loss_coeff",
                "a finite",
                "nan",
            ),
            ("str-for-bool", {"deterministic": "yes"}, "deterministic", "a bool", "'yes'"),
            ("int-for-bool", {"swiglu": 1}, "swiglu", "a bool", "1"),
        ]
    ],
    Case(
        "init_parallel-str-seed",
        lambda: fnppo.init_parallel(1, seed="abc"),
        InputError,
        "init_parallel",
        "seed",
        "an int >= 0",
        "'abc' (str)",
    ),
    Case(
        "init_parallel-bool-tp",
        lambda: fnppo.init_parallel(True),
        InputError,
        "init_parallel",
        "tp",
        "an int >= 1",
        "True (bool)",
    ),
    Case(
        "init_parallel-inf-timeout",
        lambda: fnppo.init_parallel(1, timeout_s=math.inf),
        InputError,
        "init_parallel",
        "timeout_s",
        "a finite number > 0",
        "inf",
    ),
    # --- a policy loss callable that returns the wrong thing (ppo_loss; train_step: STEP_CASES) ---
    *[
        Case(
            f"ppo_loss-policy-{cid}",
            lambda f=f: ppo_loss(X, X, X, M, LossConfig(policy=f)),
            InputError,
            "ppo_loss",
            "policy loss '<lambda>'" + sub,
            exp,
            rec,
        )
        for cid, f, sub, exp, rec in [
            ("integer-loss", lambda x: (x.advantages.long(), {}), "", "a floating per-token loss", "i64[2,3]"),
            ("bool-loss", lambda x: (x.advantages > 0, {}), "", "a floating per-token loss", "bool[2,3]"),
            ("nan-loss", lambda x: (x.logprobs * math.nan, {}), "", "a finite per-token loss", "6 NaN/inf"),
            ("inf-loss", lambda x: (x.logprobs - math.inf, {}), "", "a finite per-token loss", "6 NaN/inf"),
            ("metrics-list", lambda x: (x.logprobs, [1.0]), "", "metrics as a dict", "list [1.0]"),
            (
                "metrics-scalar",
                lambda x: (x.logprobs, {"m": torch.tensor(1.0)}),
                " metrics['m']",
                "a floating [2] tensor",
                "f32[]",
            ),
            (
                "metrics-int",
                lambda x: (x.logprobs, {"m": torch.ones(2, dtype=torch.long)}),
                " metrics['m']",
                "a floating [2]",
                "i64[2]",
            ),
            ("not-a-pair", lambda x: x.logprobs, "", "to return a pair (per_token_loss, metrics)", "f32[2,3]"),
        ]
    ],
    # --- metrics sinks ---
    *[
        Case(
            f"open_sinks-{cid}",
            lambda kw=kw: open_sinks(run_dir="/nonexistent", **kw),
            InputError,
            "open_sinks",
            arg,
            exp,
            rec,
        )
        for cid, kw, arg, exp, rec in [
            ("names-none", {"names": None}, "names", "a str ('tensorboard,wandb') or a list of str", "None"),
            ("names-int-entry", {"names": ["tensorboard", 3]}, "names", "a list of str", "['tensorboard', 3]"),
            ("names-set", {"names": {"tensorboard"}}, "names", "a list of str", "{'tensorboard'}"),
            (
                "unknown-name",
                {"names": "tensorbord"},
                "names",
                "a subset of tensorboard, wandb, mlflow",
                "'tensorbord'",
            ),
            ("str-rank", {"names": [], "rank": "0"}, "rank", "an int >= 0", "'0' (str)"),
            (
                "bool-resume-step",
                {"names": [], "resume_step": True},
                "resume_step",
                "an int >= 0 or None",
                "True (bool)",
            ),
            ("negative-resume-step", {"names": [], "resume_step": -1}, "resume_step", "an int >= 0 or None", "-1"),
        ]
    ],
    # --- checkpoints: arguments refused before anything is read or written ---
    Case(
        "load_checkpoint-none",
        lambda: fnppo.checkpoint.load_checkpoint(None, None),
        fnppo.checkpoint.CheckpointError,
        "load_checkpoint",
        "directory",
        "a checkpoint directory path",
        "None",
    ),
    Case(
        "load_checkpoint-int",
        lambda: fnppo.checkpoint.load_checkpoint(3, None),
        fnppo.checkpoint.CheckpointError,
        "load_checkpoint",
        "directory",
        "a checkpoint directory path",
        "3",
    ),
    Case(
        "save_checkpoint-none",
        lambda: fnppo.checkpoint.save_checkpoint(None, None),
        InputError,
        "save_checkpoint",
        "directory",
        "a path (str or os.PathLike)",
        "None",
    ),
    Case(
        "save_checkpoint-extra-list",
        lambda: fnppo.checkpoint.save_checkpoint("/nonexistent/x", None, extra=[("step", 1)]),
        InputError,
        "save_checkpoint",
        "extra",
        "a mapping of names to values",
        "list",
    ),
    Case(
        "save_checkpoint-extra-str",
        lambda: fnppo.checkpoint.save_checkpoint("/nonexistent/x", None, extra="step=1"),
        InputError,
        "save_checkpoint",
        "extra",
        "a mapping of names to values",
        "str",
    ),
    Case(
        "save_checkpoint-onto-a-file",
        lambda: fnppo.checkpoint.save_checkpoint(__file__, None),
        fnppo.checkpoint.CheckpointError,
        "save_checkpoint",
        "directory",
        "a new path or a checkpoint directory",
        "an existing file (not replaced)",
    ),
    *[
        Case(
            f"{f.__name__}-{cid}",
            lambda f=f, st=st: f("/nonexistent/x", st),
            fnppo.checkpoint.CheckpointError,
            f.__name__,
            arg,
            exp,
            rec,
        )
        for f in (fnppo.checkpoint.save_checkpoint, fnppo.checkpoint.load_checkpoint)
        for cid, st, arg, exp, rec in [
            ("state-none", None, "state", "a TrainState (model, optimizer, step)", "NoneType"),
            ("state-list", [1], "state", "a TrainState (model, optimizer, step)", "list"),
            ("state-mapping-of-ints", {"policy": 1}, "state['policy']", "a TrainState", "int"),
            ("state-empty-mapping", {}, "state", "a non-empty mapping of non-empty names", "[]"),
        ]
    ],
    Case(
        "verify_checkpoint-none",
        lambda: fnppo.checkpoint.verify_checkpoint(None),
        fnppo.checkpoint.CheckpointError,
        "verify_checkpoint",
        "directory",
        "a checkpoint directory path",
        "None",
    ),
    Case(
        "read_checkpoint-none",
        lambda: fnppo.checkpoint.read_checkpoint(None),
        fnppo.checkpoint.CheckpointError,
        "read_checkpoint",
        "directory",
        "a checkpoint directory path",
        "None",
    ),
    Case(
        "latest_checkpoint-none",
        lambda: fnppo.checkpoint.latest_checkpoint(None),
        fnppo.checkpoint.CheckpointError,
        "latest_checkpoint",
        "root",
        "a path",
        "None",
    ),
    Case(
        "lock_directory-none",
        lambda: fnppo.checkpoint.lock_directory(None),
        fnppo.checkpoint.CheckpointError,
        "lock_directory",
        "root",
        "a path",
        "None",
    ),
    Case(
        "lock_directory-a-file",
        lambda: fnppo.checkpoint.lock_directory(__file__),
        fnppo.checkpoint.CheckpointError,
        "lock_directory",
        "root",
        "a directory that can be created",
        "test_bad_input.py",
    ),
]


def _model_config(**kw):
    return tiny_model_config(**kw)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input(case: Case):
    with pytest.raises(case.exc) as info:
        case.call()
    check_message(info.value, case.exc, case.fn, case.arg, case.expected, case.received)


def test_case_ids_are_unique():
    ids = [c.id for c in CASES] + list(STEP_CASES)
    assert len(ids) == len(set(ids))


# ---------------------------------------------------------------------------------------------
# the training step (TP=2: two ranks, real Megatron on CPU)
# ---------------------------------------------------------------------------------------------
VOCAB, MAX_LEN = 64, 32


def _gathered_forward(model, microbatch, *, params=None):
    """A forward that (wrongly) returns logits gathered over the TP group: [.., full vocab]."""
    logits = fnppo.forward_logits(model, microbatch, params=params)
    lay = fnppo.parallel.current_layout()
    if not lay.is_last_stage or lay.tp == 1:
        return logits
    parts = [torch.empty_like(logits) for _ in range(lay.tp)]
    dist.all_gather(parts, logits.detach().contiguous(), group=lay.tp_group)
    return torch.cat(parts, dim=-1)


def _sample(prompt: list[int], response: list[int], **kw) -> Sample:
    return Sample.from_lists(prompt, response, advantages=1.0, old_logprobs=[-1.0] * len(response), **kw)


def _export_where_rank0_cannot_write(ddp) -> None:
    """Export into a fresh directory holding a directory named ``model.safetensors``: rank 0 cannot
    replace it by the weights file (IsADirectoryError), every rank gets the error."""
    import shutil
    import tempfile

    box = [tempfile.mkdtemp() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    (Path(box[0]) / "model.safetensors").mkdir(exist_ok=True)
    try:
        fnppo.hf.export_hf_weights(ddp, box[0])
    finally:
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(box[0])


def _step_errors() -> dict:
    """Each bad call's (error type, message); then: were the parameters untouched, does a good step work?"""
    cfg = tiny_model_config(vocab_size=VOCAB, max_seq_len=MAX_LEN)
    chunks = fnppo.build_gpt(cfg)
    fnppo.models.layout_invariant_init(chunks, seed=3)
    ddp = fnppo.wrap_ddp(chunks)
    state = fnppo.TrainState(model=ddp, optimizer=fnppo.build_optimizer(ddp, lr=1e-2))
    lay = fnppo.parallel.current_layout()
    good = synthetic_samples(4, vocab_size=VOCAB, seed=2, with_ref=False)
    step = StepConfig()
    gathered = StepConfig(fns=fnppo.StepFns(forward=_gathered_forward))
    before = [p.detach().clone() for p in fnppo.megatron.unwrap.unwrap_model(ddp[0]).parameters()]
    full_logits = torch.randn(3, VOCAB)  # what the gathered forward would hand to logprob_and_entropy

    calls = {
        "train_step-empty-batch": lambda: fnppo.train_step(state, [], step),
        "compute_logprobs-empty-batch": lambda: fnppo.compute_logprobs(ddp, [], config=step),
        "forward_only-empty": lambda: fnppo.forward_only(ddp, [], lambda logits, mb: None),
        "train_step-not-a-sample": lambda: fnppo.train_step(state, [*good[:3], {"prompt_ids": [1]}], step),
        "train_step-indivisible-minibatches": lambda: fnppo.train_step(state, good[:3], StepConfig(num_minibatches=2)),
        "train_step-longer-than-model": lambda: fnppo.train_step(state, [*good[:3], _sample([1] * 20, [2] * 13)], step),
        "compute_logprobs-longer-than-config": lambda: fnppo.compute_logprobs(
            ddp, [*good[:3], _sample([1] * 8, [2] * 8)], config=StepConfig(max_seq_len=15)
        ),
        "train_step-token-out-of-vocab": lambda: fnppo.train_step(
            state, [*good[:2], _sample([1, 2], [3, VOCAB])], step
        ),
        "compute_logprobs-token-out-of-vocab": lambda: fnppo.compute_logprobs(ddp, [_sample([VOCAB + 6, 1], [3])]),
        "train_step-nan-advantage": lambda: fnppo.train_step(
            state,
            [*good[:3], Sample.from_lists([1], [2, 3], advantages=[0.0, math.nan], old_logprobs=[-1.0, -1.0])],
            step,
        ),
        "train_step-ref-for-some-samples": lambda: fnppo.train_step(
            state,
            [*synthetic_samples(3, vocab_size=VOCAB, seed=2), _sample([1], [2, 3])],
            StepConfig(num_microbatches=4),
        ),
        "train_step-bypass-without-rollout": lambda: fnppo.train_step(
            state, good, StepConfig(loss=LossConfig(bypass_old_logprobs=True))
        ),
        "compute_logprobs-params-per-chunk": lambda: fnppo.compute_logprobs(ddp, good, params=[{}, {}]),
        "logprob-gathered-logits-with-tp-group": lambda: logprob_and_entropy(
            full_logits, torch.zeros(3, dtype=torch.long), tp_group=lay.tp_group, vocab_size=VOCAB
        ),
        "stream_hf_weights-integer-dtype": lambda: fnppo.hf.stream_hf_weights(ddp, dtype=torch.int32),
        "export_hf_weights-bool-dtype": lambda: fnppo.hf.export_hf_weights(ddp, "/nonexistent", dtype=torch.bool),
        "export_hf_weights-str-dtype": lambda: fnppo.hf.export_hf_weights(ddp, "/nonexistent", dtype="bf16"),
        "export_hf_weights-bool-shard-size": lambda: fnppo.hf.export_hf_weights(
            ddp, "/nonexistent", max_shard_bytes=True
        ),
        "export_hf_weights-onto-a-file": lambda: fnppo.hf.export_hf_weights(ddp, __file__),
        "export_hf_weights-rank0-cannot-write": lambda: _export_where_rank0_cannot_write(ddp),
        # these raise inside Megatron's schedule (on every TP rank alike), before any update
        "train_step-policy-integer-loss": lambda: fnppo.train_step(
            state, good, _policy_step(lambda x: (x.advantages.long(), {}))
        ),
        "train_step-policy-nan-loss": lambda: fnppo.train_step(
            state, good, _policy_step(lambda x: (x.logprobs * math.nan, {}))
        ),
        "train_step-policy-metrics-list": lambda: fnppo.train_step(
            state, good, _policy_step(lambda x: (-x.logprobs, [0.0]))
        ),
        "train_step-gathered-logits": lambda: fnppo.train_step(state, good, gathered),
        "compute_logprobs-gathered-logits": lambda: fnppo.compute_logprobs(ddp, good, config=gathered),
    }
    out: dict[str, Any] = {"tp": lay.tp}
    for name, call in calls.items():
        try:
            call()
            out[name] = ("no error", "")
        except Exception as err:  # noqa: BLE001 - reported to the test
            out[name] = (type(err).__name__, str(err)[:3000])
    after = [p.detach().clone() for p in fnppo.megatron.unwrap.unwrap_model(ddp[0]).parameters()]
    out["untouched"] = all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    state, metrics = fnppo.train_step(state, good, step)
    out["good_step"] = metrics
    out["moved"] = any(
        not torch.equal(a, p)
        for a, p in zip(after, fnppo.megatron.unwrap.unwrap_model(ddp[0]).parameters(), strict=True)
    )
    return out


def _policy_step(policy) -> StepConfig:
    return StepConfig(loss=LossConfig(policy=policy))


# id -> (error type, function, argument, expected excerpt, received excerpt)
STEP_CASES = {
    "stream_hf_weights-integer-dtype": (
        InputError,
        "stream_hf_weights",
        "dtype",
        "None or a floating torch.dtype",
        "torch.int32",
    ),
    "export_hf_weights-bool-dtype": (
        InputError,
        "export_hf_weights",
        "dtype",
        "None or a floating torch.dtype",
        "torch.bool",
    ),
    "export_hf_weights-str-dtype": (
        InputError,
        "export_hf_weights",
        "dtype",
        "None or a floating torch.dtype",
        "'bf16'",
    ),
    "export_hf_weights-bool-shard-size": (
        InputError,
        "export_hf_weights",
        "max_shard_bytes",
        "an int >= 1",
        "True (bool)",
    ),
    "export_hf_weights-onto-a-file": (
        InputError,
        "export_hf_weights",
        "path",
        "a new or existing directory",
        "an existing file (not replaced)",
    ),
    "export_hf_weights-rank0-cannot-write": (
        fnppo.checkpoint.CheckpointError,
        "export_hf_weights",
        "path",
        "a directory rank 0 can write the weights into",
        "IsADirectoryError",
    ),
    "train_step-policy-integer-loss": (
        InputError,
        "ppo_loss",
        "policy loss '<lambda>'",
        "a floating per-token loss",
        "i64[",
    ),
    "train_step-policy-nan-loss": (
        InputError,
        "ppo_loss",
        "policy loss '<lambda>'",
        "a finite per-token loss",
        "NaN/inf entries",
    ),
    "train_step-policy-metrics-list": (
        InputError,
        "ppo_loss",
        "policy loss '<lambda>'",
        "metrics as a dict",
        "list [0.0]",
    ),
    "train_step-empty-batch": (InputError, "train_step", "batch", "a non-empty list of samples", "an empty list"),
    "compute_logprobs-empty-batch": (
        InputError,
        "compute_logprobs",
        "batch",
        "a non-empty list of samples",
        "an empty list",
    ),
    "forward_only-empty": (InputError, "forward_only", "microbatches", "a non-empty sequence", "an empty sequence"),
    "train_step-not-a-sample": (InputError, "train_step", "batch[3]", "a fnppo.Sample", "dict"),
    "train_step-indivisible-minibatches": (
        InputError,
        "train_step",
        "batch",
        "a length divisible by num_minibatches=2",
        "3",
    ),
    "train_step-longer-than-model": (
        InputError,
        "train_step",
        "batch[3]",
        f"at most {MAX_LEN} tokens (the model's max_sequence_length)",
        "33 tokens (prompt 20 + response 13)",
    ),
    "compute_logprobs-longer-than-config": (
        InputError,
        "compute_logprobs",
        "batch[3]",
        "at most 15 tokens (StepConfig.max_seq_len)",
        "16 tokens (prompt 8 + response 8)",
    ),
    "train_step-token-out-of-vocab": (
        InputError,
        "train_step",
        "batch[2].response_ids",
        f"values in [0, {VOCAB})",
        f"values in [3, {VOCAB}]",
    ),
    "compute_logprobs-token-out-of-vocab": (
        InputError,
        "compute_logprobs",
        "batch[0].prompt_ids",
        f"values in [0, {VOCAB})",
        f"values in [1, {VOCAB + 6}]",
    ),
    "train_step-nan-advantage": (
        InputError,
        "train_step",
        "batch[3].advantages",
        "finite values",
        "f32[2] with 1 NaN/inf entries",
    ),
    "train_step-ref-for-some-samples": (
        InputError,
        "train_step",
        "batch[3].ref_logprobs",
        "a tensor (batch[0] has ref_logprobs; all samples or none)",
        "None",
    ),
    "train_step-bypass-without-rollout": (
        InputError,
        "train_step",
        "batch[0].rollout_logprobs",
        "a tensor since bypass_old_logprobs=True in LossConfig",
        "None",
    ),
    "compute_logprobs-params-per-chunk": (
        InputError,
        "compute_logprobs",
        "params",
        "1 dicts (one per model chunk)",
        "2",
    ),
    "logprob-gathered-logits-with-tp-group": (
        InputError,
        "logprob_and_entropy",
        "logits",
        f"this rank's vocab shard: a last dimension below vocab_size={VOCAB} with tp_size=2",
        f"f32[3,{VOCAB}] (these look like logits already gathered over tensor parallelism",
    ),
    "train_step-gathered-logits": (
        InputError,
        "train_step",
        "logits",
        f"{VOCAB} / 2 = {VOCAB // 2} (this rank's vocab shard)",
        f",{VOCAB}] (logits already gathered over tensor parallelism",
    ),
    "compute_logprobs-gathered-logits": (
        InputError,
        "compute_logprobs",
        "logits",
        f"{VOCAB} / 2 = {VOCAB // 2} (this rank's vocab shard)",
        "already gathered over tensor parallelism",
    ),
}


@pytest.fixture(scope="module")
def step_errors():
    return run_ranks(_step_errors, 2, tp=2)


@pytest.mark.parametrize("case_id", list(STEP_CASES))
def test_step_bad_input(step_errors, case_id):
    exc, fn, arg, expected, received = STEP_CASES[case_id]
    for rank, r in enumerate(step_errors):
        assert r["tp"] == 2
        name, msg = r[case_id]
        assert name == exc.__name__, f"rank {rank}: {name}: {msg[:800]}"
        check_message(exc(msg), exc, fn, arg, expected, received)


def test_refused_step_inputs_leave_the_model_untouched(step_errors):
    for r in step_errors:
        assert r["untouched"], "a refused call changed parameters"
        assert r["good_step"]["skipped"] == 0.0 and r["good_step"]["updates"] == 1.0 and r["moved"]
    assert step_errors[0]["good_step"] == step_errors[1]["good_step"]


# ---------------------------------------------------------------------------------------------
# the table in docs/errors.md lists every case
# ---------------------------------------------------------------------------------------------
def test_every_case_is_in_the_error_table():
    text = TABLE.read_text()
    missing = [c.id for c in CASES if f"test_bad_input[{c.id}]" not in text]
    missing += [k for k in STEP_CASES if f"test_step_bad_input[{k}]" not in text]
    assert not missing, f"cases missing from {TABLE}: {missing}"
    # every test the table points to exists
    for path, name in set(re.findall(r"`(tests/test_\w+\.py)::(test_\w+)", text)):
        src = (ROOT / path).read_text()
        assert re.search(rf"^def {name}\(", src, re.MULTILINE), f"{path}::{name} named in {TABLE.name} does not exist"


# ---------------------------------------------------------------------------------------------
# fuzzing: split_batch -> collate_microbatch -> logprob_and_entropy -> ppo_loss
# ---------------------------------------------------------------------------------------------
FUZZ_VOCAB = 16
CORRUPTIONS = ("mask_not_01", "nan_advantage", "inf_old_logprob", "token_out_of_vocab")
# corruption -> (the sample's field the error must name, expected excerpt)
FUZZ_ERRORS = {
    "mask_not_01": ("response_mask", "a 0/1 mask"),
    "nan_advantage": ("advantages", "finite values"),
    "inf_old_logprob": ("old_logprobs", "finite values"),
    "token_out_of_vocab": ("prompt_ids", f"values in [0, {FUZZ_VOCAB})"),
}


@st.composite
def fuzz_batches(draw):
    """(samples, corruption or None). Lengths vary, responses may be empty or all masked, some
    samples carry images and/or audio items (mixed multi-modal), ref log-probs for all or none;
    in about a third of the batches one sample is corrupted."""
    n = draw(st.integers(0, 6))
    with_ref = draw(st.booleans())
    samples = []
    for _ in range(n):
        p, r = draw(st.integers(1, 6)), draw(st.integers(0, 6))
        g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
        mask_kind = draw(st.sampled_from(["none", "random", "all_masked"]))
        mask = (
            None
            if mask_kind == "none"
            else (torch.zeros(r) if mask_kind == "all_masked" else torch.randint(0, 2, (r,), generator=g).float())
        )
        mm = {}
        if draw(st.booleans()):
            mm["images"] = torch.randn(draw(st.integers(1, 2)), 3, 2, 2, generator=g)
        if draw(st.booleans()):
            mm["audio"] = torch.randn(draw(st.integers(1, 3)), 5, generator=g)
        samples.append(
            {
                "prompt_ids": torch.randint(0, FUZZ_VOCAB, (p,), generator=g),
                "response_ids": torch.randint(0, FUZZ_VOCAB, (r,), generator=g),
                "advantages": torch.randn(r, generator=g),
                "old_logprobs": -2.0 + 0.5 * torch.randn(r, generator=g),
                "ref_logprobs": (-2.0 + 0.5 * torch.randn(r, generator=g)) if with_ref else None,
                "response_mask": mask,
                "multi_modal": mm,
            }
        )
    bad = None
    if samples and draw(st.integers(0, 2)) == 0:
        i = draw(st.integers(0, n - 1))
        fields = samples[i]
        r = fields["response_ids"].numel()
        bad = draw(st.sampled_from(CORRUPTIONS if r else ("token_out_of_vocab",)))
        if bad == "mask_not_01":
            fields["response_mask"] = torch.full((r,), 0.5)
        elif bad == "nan_advantage":
            fields["advantages"] = torch.full((r,), math.nan)
        elif bad == "inf_old_logprob":
            fields["old_logprobs"] = torch.full((r,), -math.inf)
        else:
            fields["prompt_ids"] = fields["prompt_ids"].clone()
            fields["prompt_ids"][0] = FUZZ_VOCAB
        bad = (i, bad)
    return [Sample(**f) for f in samples], bad


def _loss_config(draw) -> LossConfig:
    mode = draw(st.sampled_from(LOSS_AGG_MODES))
    policy = draw(st.sampled_from(["ppo", "gspo", "cispo", "gpg", "reinforce", "gmpo", "sapo", "clip_cov", "kl_cov"]))
    kl_coef = draw(st.sampled_from([0.0, 0.1]))
    return LossConfig(
        policy=POLICY_LOSSES[policy](),
        agg=Aggregation(mode, 8.0 if mode == "seq-mean-token-sum-norm" else None),
        entropy_coef=draw(st.sampled_from([0.0, 0.01])),
        kl=KLPenalty(kl_coef) if kl_coef else None,
    )


def _finite_tree(metrics: dict[str, torch.Tensor]) -> bool:
    return all(bool(torch.isfinite(v).all()) for v in metrics.values())


def _round_up(n: int, k: int) -> int:
    return -(-n // k) * k


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(
    batch=fuzz_batches(),
    layout=st.sampled_from(["packed", "padded"]),
    m=st.integers(1, 3),
    mode=st.sampled_from(["num", "size", "tokens"]),
    size=st.integers(4, 40),
    data=st.data(),
)
def test_fuzz_split_collate_loss(batch, layout, m, mode, size, data):
    samples, applied = batch
    cfg = _loss_config(data.draw)
    kw = {
        "num": {"num_microbatches": size % 3 + 1},
        "size": {"microbatch_size": size % 3 + 1},
        "tokens": {"max_tokens_per_microbatch": size},
    }[mode]
    raised: list[BaseException] = []
    plan = None
    try:
        plan = split_batch(samples, pad_to_multiple_of=m, layout=layout, **kw)
        mbs = [
            collate_microbatch(group, layout=layout, pad_to_multiple_of=m, vocab_size=FUZZ_VOCAB, sample_index=list(ix))
            for ix, group in zip(plan.microbatches, plan.apply(samples), strict=True)
        ]
    except (InputError, ShapeError) as err:  # the documented errors; anything else fails the test
        raised.append(err)
    # a sample list is refused by split_batch exactly when the split is impossible
    impossible = (
        not samples
        or (mode == "num" and size % 3 + 1 > len(samples))
        or (mode == "tokens" and any(_round_up(len(s), m) > size for s in samples))
    )
    if impossible:
        assert raised and plan is None and str(raised[0]).startswith("split_batch: argument "), (raised, impossible)
        return
    if applied:  # refused by the collate of the corrupted sample's micro-batch, naming it and the field
        assert raised, f"corrupted input accepted: {applied}"
        i, kind = applied
        (j,) = [ix.index(i) for ix in plan.microbatches if i in ix]
        arg, expected = FUZZ_ERRORS[kind]
        check_message(raised[0], InputError, "collate_microbatch", f"samples[{j}].{arg}", expected, "")
        return
    assert not raised, raised
    if mbs[0].ref_logprobs is None and cfg.kl is not None:
        mb = mbs[0]
        with pytest.raises(InputError, match="'ref_logprobs' expected a tensor since kl.coef"):
            ppo_loss(mb.old_logprobs, mb.old_logprobs, mb.advantages, mb.loss_mask, cfg, entropy=mb.old_logprobs)
        cfg = dataclasses.replace(cfg, kl=None)
    normalizer = sum(float(loss_normalizer(mb.loss_mask, cfg, seq_ids=mb.seq_ids)) for mb in mbs)
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    for mb in mbs:
        logits = (3.0 * torch.randn(*mb.input_ids.shape, FUZZ_VOCAB, generator=g)).requires_grad_()
        lp, ent = logprob_and_entropy(logits, mb.labels)
        loss, metrics = ppo_loss(
            lp,
            mb.old_logprobs,
            mb.advantages,
            mb.loss_mask,
            cfg,
            entropy=ent,
            ref_logprobs=mb.ref_logprobs,
            normalizer=normalizer,
            seq_ids=mb.seq_ids,
            generator=torch.Generator().manual_seed(0),
        )
        loss.backward()
        assert torch.isfinite(loss), (loss, cfg)
        assert _finite_tree(metrics), metrics
        assert torch.isfinite(logits.grad).all()
        if float(mb.loss_mask.sum()) == 0:  # all masked (or empty responses): exactly nothing
            assert float(loss.detach()) == 0.0 and float(logits.grad.abs().sum()) == 0.0, cfg
