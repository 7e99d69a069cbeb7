"""Every composition a user can ask for runs on a GPU (skipped without CUDA).

On one H100 (torch 2.11) a local-spec MoE model (hidden 2048, 32 heads, 4 query groups, 32 experts
top-4, 6 layers, bf16) failed in ``compute_logprobs`` when each of 24 samples of 50-3,000 tokens was its
own micro-batch: Inductor found no valid flex-attention configuration (``NoValidChoicesError``). Here: a
dense model and that MoE model, samples of 1 to 3,000 tokens, every sample alone, a few at a time and
under token budgets, packed and padded; every log-prob is finite and agrees with one packed micro-batch
(dense: to bf16 rounding; MoE: on average, since a token whose top-k choice is a near tie may take
another expert in another composition), and a ``train_step`` on micro-batches of one sample each runs
and gives a finite loss.

Run on a GPU machine: ``python -m pytest -q tests/test_cuda_compositions.py`` (or
``python tests/test_cuda_compositions.py`` where pytest is absent).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import fnppo

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

LENGTHS = [
    50,
    3000,
    77,
    1999,
    5,
    130,
    2048,
    64,
    513,
    1,
    1024,
    300,
    2700,
    17,
    999,
    128,
    60,
    2500,
    255,
    3,
    1500,
    90,
    700,
    33,
]


def _samples(vocab: int) -> list[fnppo.Sample]:
    g = torch.Generator().manual_seed(0)
    out = []
    for n in LENGTHS:
        p = max(1, n // 3)
        r = max(1, n - p)
        out.append(
            fnppo.Sample(
                prompt_ids=torch.randint(0, vocab, (p,), generator=g),
                response_ids=torch.randint(0, vocab, (r,), generator=g),
                advantages=torch.randn(r, generator=g),
            )
        )
    return out


def _model(moe: bool) -> list:
    fields = dict(
        num_layers=2,
        hidden_size=512,
        num_attention_heads=8,
        num_query_groups=2,
        ffn_hidden_size=1024,
        vocab_size=4096,
        max_seq_len=4096,
        dtype="bf16",
    )
    if moe:
        fields.update(num_experts=8, moe_topk=2, moe_ffn_hidden_size=512, moe_load_balancing="none")
    chunks = fnppo.build_gpt(fnppo.ModelConfig(**fields))
    fnppo.models.layout_invariant_init(chunks, seed=1)
    return chunks


@pytest.fixture(scope="module")
def layout():
    lay = fnppo.init_parallel(tp=1, pp=1)
    yield lay
    fnppo.parallel.destroy_parallel()


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_every_composition_runs_and_agrees(layout, moe):
    chunks = _model(moe)
    samples = _samples(4096)
    ref, _ = fnppo.compute_logprobs(chunks, samples, max_tokens_per_microbatch=32768)
    for split in (dict(num_microbatches=len(samples)), dict(num_microbatches=7), dict(max_tokens_per_microbatch=3072)):
        for layout_name in ("packed", "padded"):
            got, _ = fnppo.compute_logprobs(chunks, samples, layout=layout_name, **split)
            for i, b in enumerate(got):
                assert bool(torch.isfinite(b).all()), (moe, split, layout_name, i)
            diff = torch.cat([(a - b).abs() for a, b in zip(ref, got, strict=True)])
            worst = float(diff.mean()) if moe else float(diff.max())
            assert worst < (0.05 if moe else 0.15), (moe, split, layout_name, worst)


def test_train_step_on_one_sample_micro_batches(layout):
    chunks = _model(True)
    ddp = fnppo.wrap_ddp(chunks)
    state = fnppo.TrainState(model=ddp, optimizer=fnppo.build_optimizer(ddp, lr=1e-5))
    samples = _samples(4096)
    old, _ = fnppo.compute_logprobs(state.model, samples, num_microbatches=len(samples))
    batch = [dataclasses.replace(s, old_logprobs=o) for s, o in zip(samples, old, strict=True)]
    state, metrics = fnppo.train_step(state, batch, fnppo.StepConfig(num_microbatches=len(samples)))
    assert metrics["skipped"] == 0.0 and torch.isfinite(torch.tensor(metrics["loss"])), metrics


@pytest.mark.parametrize("kind", [None, "reverse_kl", "forward_kl"])
@pytest.mark.parametrize("divergence_grad", [True, False])
def test_fused_heads_run_their_triton_kernels_and_equal_float64(kind, divergence_grad):
    """The fused log-prob head (``kind=None``) and its divergence to a teacher on the compiled Triton kernels
    (several token groups and vocabulary blocks, a vocabulary cut by ``vocab_size``), values and gradients
    against the float64 reference of tests/test_linear_distill.py; with ``divergence_grad`` False the
    distillation op's backward takes the head's kernels (no divergence gradient)."""
    if kind is None and not divergence_grad:
        pytest.skip("the head has no divergence")
    errors = fused_head_errors("cuda", "triton", kind, divergence_grad)
    assert max(errors.values()) < 1e-4, (kind, divergence_grad, errors)


def fused_head_errors(device: str, impl: str, kind: str | None, divergence_grad: bool) -> dict[str, float]:
    """Max error relative to the largest float64 value, per output and gradient (also runs on the CPU with
    ``impl="torch"``)."""
    from fnppo.core.ops.linear_logprob import linear_logprob_and_entropy
    from tests.test_linear_distill import problem, reference, run_ours

    *tensors, grads = problem(lead=(3, 250), hidden=96, teacher_hidden=80, vocab=3000, seed=5)
    h, w, labels, ht, wt = (t.to(device) for t in tensors)
    labels = labels % 2990  # real tokens only
    grads = tuple(g.to(device) for g in grads)
    grads = grads if divergence_grad else (*grads[:2], None)
    sizes = dict(chunk_tokens=256, chunk_vocab=1024, vocab_size=2990, temperature=0.9, impl=impl)
    if kind is None:
        hg, wg = h.clone().requires_grad_(), w.clone().requires_grad_()
        lp, ent = linear_logprob_and_entropy(hg, wg, labels, **sizes)
        ((lp * grads[0]).sum() + (ent * grads[1]).sum()).backward()
        ref = reference(h, w, labels, ht, wt, "reverse_kl", t=0.9, vocab_size=2990, grads=(*grads[:2], None))
        pairs = {"logprobs": (lp, ref[0]), "entropy": (ent, ref[1]), "dh": (hg.grad, ref[3]), "dw": (wg.grad, ref[4])}
    else:
        got = run_ours(h, w, labels, ht, wt, grads, kind=kind, **sizes)
        ref = reference(h, w, labels, ht, wt, kind, t=0.9, vocab_size=2990, grads=grads)
        pairs = dict(zip(("logprobs", "entropy", "divergence", "dh", "dw"), zip(got, ref, strict=True), strict=True))
    return {
        name: float((a.detach().double() - b).abs().max() / b.abs().max().clamp(min=1e-12))
        for name, (a, b) in pairs.items()
    }


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))
