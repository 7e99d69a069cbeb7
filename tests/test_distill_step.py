"""train_step with an objective of several terms: a teacher model in the step (full-vocabulary reverse
KL from its hidden states and output layer), the teacher's top-k from the samples, cross-entropy and
KL terms with their own normalizers; against a plain float64 reference in one process, under every
layout (TP=2, PP=2, DP=2, CP=2 on gloo), and the refusals before anything changes.

The reference: the student's and the teacher's logits from ``forward_logits`` in one process and one
micro-batch (no DDP), float64 log-softmax over the real vocabulary, the terms written from their
formulas (floor -100 on the teacher's log-probs), autograd. train_step's loss and its reduced
gradient (captured after finalize_grads) must equal it to fp32 rounding.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

import fnppo
from fnppo.core.losses import Aggregation, CrossEntropy, ForwardKL, LossConfig, RefKL, ReverseKL, TopK, ppo_clip
from fnppo.testing import run_ranks, synthetic_samples, tiny_model_config
from tests.distill_reference import topk_reference
from tests.messages import messages_of
from tests.step_helpers import finalized_grads

VOCAB = 61  # padded to 62 (make_vocab_size_divisible_by=2): one padding column
N_SAMPLES = 8
TOL = 1e-5
FLOOR = -100.0


def _student_cfg() -> fnppo.ModelConfig:
    return tiny_model_config(vocab_size=VOCAB, make_vocab_size_divisible_by=2, tie_embeddings=True)


def _teacher_cfg() -> fnppo.ModelConfig:  # its own width and depth, the student's vocabulary
    return tiny_model_config(
        vocab_size=VOCAB, make_vocab_size_divisible_by=2, hidden_size=48, num_attention_heads=4, ffn_hidden_size=96
    )


def _samples(topk: int = 0):
    out = synthetic_samples(N_SAMPLES, vocab_size=VOCAB, seed=11)
    g = torch.Generator().manual_seed(12)
    done = []
    for i, s in enumerate(out):
        extra = {}
        if i % 3 == 1:
            extra["ce_mask"] = (torch.rand(s.response_len, generator=g) > 0.4).float()
        if topk:
            lq = torch.log_softmax(torch.randn(s.response_len, VOCAB, generator=g) * 2, -1)
            lq, ids = lq.topk(topk, dim=-1)
            if s.response_len > 1:
                lq[0, -1] = -math.inf  # a token the teacher never produces
            extra.update(teacher_topk_ids=ids, teacher_topk_logprobs=lq)
        done.append(dataclasses.replace(s, **extra))
    return done


def _loss(case: str, teacher=None) -> LossConfig:
    if case == "model":
        return LossConfig(policy=None, distill=ReverseKL(coef=1.0, teacher=teacher))
    if case == "mixed":  # policy + forward KL to the model + CE (own) + KL to the reference (shared)
        return LossConfig(
            policy=ppo_clip(),
            distill=ForwardKL(coef=0.5, teacher=teacher),
            ce=CrossEntropy(coef=0.3),
            ref_kl=RefKL(coef=0.1, normalizer="shared"),
        )
    return LossConfig(policy=None, distill=ReverseKL(coef=1.0, teacher=TopK(tail="bucket")), ce=CrossEntropy(0.2))


def _build(cfg, seed):
    chunks = fnppo.build_gpt(cfg)
    fnppo.models.layout_invariant_init(chunks, seed=seed)
    return chunks


# ---------------------------------------------------------------------------------------------
# The plain float64 reference (one process)
# ---------------------------------------------------------------------------------------------
def _plain_reference(cases: list) -> dict:
    from fnppo.core.batching.collate import collate_microbatch

    out = {}
    for case in cases:
        (chunk,) = _build(_student_cfg(), 3)
        (teacher,) = _build(_teacher_cfg(), 5)
        samples = _samples(topk=5 if case == "topk" else 0)
        mb = collate_microbatch(samples, layout="packed", pad_to_multiple_of=1)
        lp_full = torch.log_softmax(fnppo.forward_logits(chunk, mb).double()[..., :VOCAB], -1)
        with torch.no_grad():
            lq_full = torch.log_softmax(fnppo.forward_logits(teacher, mb).double()[..., :VOCAB], -1)
        lp = lp_full.gather(-1, mb.labels[..., None])[..., 0]
        mask = mb.loss_mask.double()
        ce_mask = mb.ce_mask.double()
        p, q = lp_full.exp(), lq_full.exp()
        if case == "topk":
            div = topk_reference(
                lp_full.gather(-1, mb.teacher_topk_ids), mb.teacher_topk_logprobs, kind="reverse_kl", tail="bucket"
            )
            loss = (div * mask).sum() / mask.sum() - 0.2 * (lp * ce_mask).sum() / ce_mask.sum()
        elif case == "model":
            div = (p * (lp_full - lq_full.clamp(min=FLOOR))).sum(-1)
            loss = (div * mask).sum() / mask.sum()
        else:
            div = (q * (lq_full - lp_full)).sum(-1)
            ratio = torch.exp(lp - mb.old_logprobs.double())
            adv = mb.advantages.double()
            pg = torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.2))
            ref = mb.ref_logprobs.double()
            k3 = torch.exp(ref - lp) - 1 - (ref - lp)
            n = mask.sum()
            loss = (pg * mask).sum() / n + 0.5 * (div * mask).sum() / n
            loss = loss - 0.3 * (lp * ce_mask).sum() / ce_mask.sum() + 0.1 * (k3 * mask).sum() / n
        loss.backward()
        out[case] = {"loss": float(loss), "grads": {k: p.grad.detach().clone() for k, p in chunk.named_parameters()}}
    return out


def _train_step_grads(cases: list, split: dict, fused: bool = False) -> dict:
    """case -> train_step's metrics and finalized full gradients (rank 0); ``fused``: the fused output path."""
    layout = fnppo.parallel.current_layout()
    out = {}
    calls = []
    if fused:  # count the fused op's calls (the head must take it, not form logits and hand them on)
        from fnppo.steps import protocols

        op = protocols.linear_logprob_entropy_and_divergence
        protocols.linear_logprob_entropy_and_divergence = lambda *a, **k: (calls.append(1), op(*a, **k))[1]
    with finalized_grads() as captured:
        for case in cases:
            chunks = _build(_student_cfg(), 3)
            teacher = fnppo.TeacherModel(_build(_teacher_cfg(), 5))
            ddp = fnppo.wrap_ddp(chunks, use_distributed_optimizer=False)
            state = fnppo.TrainState(model=ddp, optimizer=fnppo.build_optimizer(ddp, lr=1e-3, clip_grad=0.0))
            samples = fnppo.shard_for_data_parallel(_samples(topk=5 if case == "topk" else 0), layout)
            fns = fnppo.StepFns.fused(chunk_vocab=16) if fused else fnppo.StepFns()
            cfg = fnppo.StepConfig(loss=_loss(case, teacher), fns=fns, **split)
            state, metrics = fnppo.train_step(state, samples, cfg)
            with torch.no_grad():
                for c, grads in zip(state.model, captured.pop("grads"), strict=True):
                    for p, g in zip(fnppo.megatron.unwrap.unwrap_model(c).parameters(), grads, strict=True):
                        p.copy_(g)
            out[case] = {"metrics": metrics, "grads": fnppo.models.gather_full_weights(state.model)}
            out[case]["fused_calls"] = len(calls)
    return out if layout.rank == 0 else {}


def _compare(ref: dict, got: dict, what: str) -> None:
    for case, r in ref.items():
        g = got[case]
        assert g["metrics"]["skipped"] == 0.0, (what, case)
        err = abs(g["metrics"]["loss"] - r["loss"]) / abs(r["loss"])
        assert err <= TOL, f"{what}/{case}: loss {g['metrics']['loss']!r} vs reference {r['loss']!r}"
        for name, rg in r["grads"].items():
            assert float(rg.abs().max()) > 0, f"{what}/{case}: reference gradient of {name} is zero"
            e = float((g["grads"][name].double() - rg.double()).abs().max() / rg.double().abs().max())
            assert e <= TOL, f"{what}/{case}: gradient of {name}: relative error {e:.2e}"


ALL = ["model", "mixed", "topk"]


@pytest.fixture(scope="module")
def reference():
    return run_ranks(_plain_reference, 1, ALL)[0]


def test_objectives_match_the_float64_reference_in_one_process_over_micro_batches(reference):
    got = run_ranks(_train_step_grads, 1, ALL, {"num_microbatches": 3})[0]
    _compare(reference, got, "1proc-3mb")
    assert {"distill_loss", "ce_loss", "ref_kl_loss", "pg_loss"} <= set(got["mixed"]["metrics"])
    padded = run_ranks(_train_step_grads, 1, ["mixed", "topk"], {"num_microbatches": 2, "layout": "padded"})[0]
    _compare({c: reference[c] for c in ("mixed", "topk")}, padded, "1proc-2mb-padded")


def test_the_fused_head_computes_the_divergence_from_hidden_states_exactly(reference, monkeypatch):
    """StepFns.fused(): the teacher model's reverse and forward KL through FusedHead.with_divergence (both
    models' hidden states and output weights, chunked over the vocabulary, no logits) equal the float64
    reference (the floor of -100 binds nowhere here), over micro-batches and under TP=2."""
    got = run_ranks(_train_step_grads, 1, ["model", "mixed"], {"num_microbatches": 3}, True)[0]
    _compare({c: reference[c] for c in ("model", "mixed")}, got, "fused-1proc-3mb")
    assert got["model"]["fused_calls"] == 3, got["model"]["fused_calls"]  # one per micro-batch
    tp = run_ranks(_train_step_grads, 2, ["model"], {"max_tokens_per_microbatch": 24}, True, timeout_s=120, tp=2)[0]
    _compare({"model": reference["model"]}, tp, "fused-tp2")


@pytest.mark.parametrize(
    "name,layout,split,cases",
    [
        ("tp2", dict(tp=2), {"max_tokens_per_microbatch": 24}, ["model", "topk"]),
        ("pp2", dict(pp=2), {"num_microbatches": 2}, ["model"]),
        ("dp2", dict(), {"num_microbatches": 2}, ["model", "mixed"]),
        ("cp2", dict(cp=2), {"num_microbatches": 2}, ["model"]),
    ],
)
def test_full_vocabulary_reverse_kl_is_exact_under_every_layout(reference, name, layout, split, cases):
    got = run_ranks(_train_step_grads, 2, cases, split, timeout_s=120, **layout)[0]
    _compare({c: reference[c] for c in cases}, got, name)


# ---------------------------------------------------------------------------------------------
# Refusals: by name, before anything changes
# ---------------------------------------------------------------------------------------------
def _refusals() -> dict:
    chunks = _build(_student_cfg(), 3)
    ddp = fnppo.wrap_ddp(chunks, use_distributed_optimizer=False)
    state = fnppo.TrainState(model=ddp, optimizer=fnppo.build_optimizer(ddp, lr=1e-3, clip_grad=0.0))
    before = fnppo.models.gather_full_weights(state.model)
    plain = _samples()
    with_topk = _samples(topk=4)
    other_vocab = tiny_model_config(vocab_size=VOCAB + 3, make_vocab_size_divisible_by=2)
    other_padding = tiny_model_config(vocab_size=VOCAB, make_vocab_size_divisible_by=8)
    short = tiny_model_config(vocab_size=VOCAB, make_vocab_size_divisible_by=2, max_seq_len=8)

    def step(samples, loss, **kw):
        return lambda: fnppo.train_step(state, samples, fnppo.StepConfig(loss=loss, **kw))

    def teacher(cfg):
        return fnppo.TeacherModel(_build(cfg, 5))

    bad_ids = [dataclasses.replace(s, teacher_topk_ids=s.teacher_topk_ids.clone().fill_(VOCAB)) for s in with_topk]
    calls = {
        "no signal": step(plain, _loss("topk")),
        "vocab": step(plain, LossConfig(distill=ReverseKL(teacher=teacher(other_vocab)))),
        "padding": step(plain, LossConfig(distill=ReverseKL(teacher=teacher(other_padding)))),
        "length": step(plain, LossConfig(distill=ReverseKL(teacher=teacher(short)))),
        "ids": step(bad_ids, _loss("topk")),
        "logprob": lambda: fnppo.train_step(
            state,
            plain,
            fnppo.StepConfig(
                loss=LossConfig(distill=ReverseKL(teacher=teacher(_teacher_cfg()))),
                fns=fnppo.StepFns(logprob=lambda *a, **k: fnppo.logprob_and_entropy(*a, **k)),
            ),
        ),
        "ref": step([dataclasses.replace(s, ref_logprobs=None) for s in plain], LossConfig(ref_kl=RefKL(0.1))),
        "chunks": step(plain, LossConfig(distill=ReverseKL(teacher=fnppo.TeacherModel(_build(_teacher_cfg(), 5) * 2)))),
        "value": step(
            plain,
            LossConfig(distill=ReverseKL(teacher=fnppo.TeacherModel(fnppo.build_gpt(_teacher_cfg(), head="value")))),
        ),
        "empty": lambda: fnppo.TeacherModel([]),
    }
    got = messages_of(calls)
    got["unchanged"] = all(torch.equal(before[k], v) for k, v in fnppo.models.gather_full_weights(state.model).items())
    got["step"] = state.step
    return got


def test_bad_teachers_and_signals_are_refused_before_anything_changes():
    got = run_ranks(_refusals, 1)[0]
    t = "train_step: argument "
    assert got["no signal"].startswith(f"{t}'batch[0].teacher_topk_ids' expected a tensor: config.loss.distill"), got
    assert got["vocab"].startswith(
        f"{t}'config.loss.distill.teacher' expected a teacher of the student's vocabulary: 61 tokens"
    ), got
    assert "received one of 64 tokens" in got["vocab"]
    assert "padded to 62" in got["padding"] and "received one of 61 tokens, padded to 64" in got["padding"], got
    assert got["length"].startswith(f"{t}'config.loss.distill.teacher' expected a max_sequence_length of at least"), got
    assert got["ids"].startswith(f"{t}'batch[0].teacher_topk_ids' expected token ids in [0, 61)"), got
    assert got["logprob"].startswith(f"{t}'config.fns.logprob' expected the default with a distillation term"), got
    assert got["ref"].startswith(f"{t}'batch[0].ref_logprobs' expected a tensor since config.loss.ref_kl.coef=0.1"), got
    assert got["chunks"].startswith(f"{t}'config.loss.distill.teacher' expected 1 model chunks"), got
    assert "config.loss.distill.teacher" in got["value"] and "value" in got["value"], got
    assert got["empty"].startswith("fnppo.steps.TeacherModel: argument 'chunks' expected a non-empty list"), got
    assert got["unchanged"] and got["step"] == 0


def _cp_refusal() -> str:
    chunks = _build(_student_cfg(), 3)
    state = fnppo.TrainState(model=fnppo.wrap_ddp(chunks, use_distributed_optimizer=False), optimizer=None)
    loss = LossConfig(ce=CrossEntropy(agg=Aggregation("seq-mean-token-mean")))
    return messages_of({"cp": lambda: fnppo.train_step(state, _samples(), fnppo.StepConfig(loss=loss))})["cp"]


def test_a_term_aggregated_by_sequence_is_refused_under_context_parallelism():
    got = run_ranks(_cp_refusal, 2, cp=2)[0]
    assert got.startswith(
        "train_step: argument 'config.loss.ce.agg.mode' expected 'token-mean' with context parallelism"
    ), got
