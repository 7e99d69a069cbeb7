"""The loss path of a popular stateful RL actor, written here from scratch as ``StepFns`` stages.

Baseline B of ``benchmarks/step.py`` (and method (b) of ``benchmarks/logprob.py``). It reproduces
what that actor's Megatron path does, step by step, so that memory and time are those of its path:

* log-probs: Megatron's ``vocab_parallel_cross_entropy`` on a *clone* of the logits (the usual fix
  for its in-place writes to its input), ``logprob = -CE``;
* entropy: a vocab-parallel entropy (:class:`InplaceVocabParallelEntropy`) whose softmax buffer is
  allocated once in the logits' dtype, saved for backward and turned into the gradient in place
  there, with ``entropy = max + log(sum exp(x - max)) - sum(p x)``;
* loss (:func:`actor_loss`): the "vanilla" clipped PPO loss with dual clipping
  (``max(-A r, -A clip(r, 1 - eps, 1 + eps))``, and for ``A < 0`` at most ``-3 A``; PPO,
  arXiv:1707.06347; dual clip, arXiv:1912.09729), ``r = exp(clamp(logp - old, -20, 20))``, minus
  ``entropy_coeff`` times the entropy, plus ``kl_coef`` times the k3 estimator of KL to the
  reference (``exp(ref - logp) - (ref - logp) - 1``, clamped to [-10, 10]); every token term is
  summed and divided by one global token count (the step's loss normalizer: all micro-batches and
  data-parallel ranks), as the actor's global-token-normalized loss does.

Each stage runs as separate PyTorch kernels, as the actor's do (no fused loss). Memory at the
log-prob level with bf16 logits, forward + backward: the clone (1 copy), Megatron's fp32 working
copy that it keeps as its softmax (2 copies), the entropy's softmax buffer (1 copy); the gradients
reuse those buffers.

It is a module that ``benchmarks/step.py`` and ``benchmarks/logprob.py`` import. Run directly, it
checks itself on the CPU against float64 references and fnppo's own loss:

    .venv/bin/python benchmarks/actor_baseline.py
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import torch
import torch.distributed as dist

import fnppo
from fnppo.core.losses import KLPenalty, LossConfig, ppo_clip, ppo_loss
from fnppo.core.metrics import weighted_metric

__all__ = ["InplaceVocabParallelEntropy", "actor_logprob", "actor_loss", "actor_fns"]

_ROWS_PER_CHUNK = 1024  # backward works on this many rows at a time (keeps its temporaries small)


class InplaceVocabParallelEntropy(torch.autograd.Function):
    """Entropy of the softmax of vocab-parallel logits; the softmax buffer becomes the gradient.

    Forward: ``m = max_j x_j`` (all-reduced over the TP group), ``e = exp(x - m)`` into a new
    buffer of the logits' dtype, ``s = sum e`` (all-reduced), ``p = e / s`` in place,
    ``px = sum p x`` (all-reduced), ``H = m + log s - px``. Saves ``x``, ``p`` and ``px``.
    Backward: ``dH/dx_j = -p_j (x_j - px)``, computed in place in ``p`` (row blocks of
    ``_ROWS_PER_CHUNK`` for the ``x - px`` temporary); ``x`` is not modified.
    """

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, group: Any) -> torch.Tensor:  # noqa: ANN401
        m = logits.max(dim=-1, keepdim=True).values
        if group is not None:
            dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
        p = logits - m
        p.exp_()
        s = p.sum(dim=-1, keepdim=True)
        if group is not None:
            dist.all_reduce(s, group=group)
        p.div_(s)
        px = (p * logits).sum(dim=-1, keepdim=True)
        if group is not None:
            dist.all_reduce(px, group=group)
        ctx.save_for_backward(logits, p, px)
        return (m + s.log() - px).squeeze(-1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # noqa: ANN401
        logits, p, px = ctx.saved_tensors
        flat_p, flat_x, flat_px = p.view(-1, p.shape[-1]), logits.reshape(-1, p.shape[-1]), px.view(-1, 1)
        for r0 in range(0, flat_p.shape[0], _ROWS_PER_CHUNK):
            r1 = r0 + _ROWS_PER_CHUNK
            flat_p[r0:r1].mul_(flat_x[r0:r1] - flat_px[r0:r1])
        p.mul_(grad.unsqueeze(-1).to(p.dtype)).neg_()
        return p, None


def actor_logprob(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    tp_group: Any = None,
    temperature: float = 1.0,
    with_entropy: bool = True,
    vocab_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs from Megatron's cross-entropy on a clone, entropy from :class:`InplaceVocabParallelEntropy`
    (a ``logprob`` stage of :class:`fnppo.StepFns`). The vocabulary must not be padded (``vocab_size`` is the
    full one)."""
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    x = logits / temperature if temperature != 1.0 else logits
    lp = -vocab_parallel_cross_entropy(x.clone(), labels)
    ent = InplaceVocabParallelEntropy.apply(x, tp_group) if with_entropy else None
    return lp.float(), None if ent is None else ent.float()


def actor_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    config: LossConfig,
    *,
    entropy: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
    rollout_logprobs: torch.Tensor | None = None,
    normalizer: torch.Tensor | None = None,
    seq_ids: torch.Tensor | None = None,
    **_: Any,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:  # noqa: ARG001
    """Vanilla dual-clip PPO + entropy bonus + k3 KL, each token-summed over one global token count
    (a ``loss`` stage of :class:`fnppo.StepFns`; module docstring). From ``config`` (the step's
    :class:`~fnppo.core.losses.config.LossConfig`) it reads the clip bounds of its policy loss
    (``clip_low``, ``clip_high``: a PPO-clip loss), ``entropy_coef`` and the KL coefficient."""
    clip_low, clip_high = config.policy.clip_low, config.policy.clip_high
    kl_coef = 0.0 if config.kl is None else config.kl.coef
    mask = loss_mask.to(logprobs.dtype)
    denom = normalizer if normalizer is not None else mask.sum().clamp_min(1.0)
    log_ratio = torch.clamp(logprobs - old_logprobs, -20.0, 20.0)
    ratio = torch.exp(log_ratio)
    pg1 = -advantages * ratio
    pg2 = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    clipped = torch.maximum(pg1, pg2)
    dual = torch.minimum(-advantages * 3.0, clipped)
    pg = torch.where(advantages < 0, dual, clipped)
    loss = (pg * mask).sum() / denom
    metrics = {"pg_loss": weighted_metric(pg, mask)}
    if entropy is not None and config.entropy_coef:
        loss = loss - config.entropy_coef * (entropy * mask).sum() / denom
    if entropy is not None:
        metrics["entropy"] = weighted_metric(entropy, mask)
    if ref_logprobs is not None and kl_coef:
        d = ref_logprobs - logprobs
        k3 = torch.clamp(torch.exp(d) - d - 1.0, -10.0, 10.0)
        loss = loss + kl_coef * (k3 * mask).sum() / denom
        metrics["kl_loss"] = weighted_metric(k3, mask)
    metrics["loss"] = torch.stack([loss.detach().float() * denom.detach().float(), denom.detach().float()])
    return loss, metrics


def actor_fns() -> fnppo.StepFns:
    """The actor's stages in fnppo's step: its log-prob stage and its loss."""
    return fnppo.StepFns(logprob=actor_logprob, loss=actor_loss)


def self_check(seed: int = 0) -> dict[str, float]:
    """The baseline against references on random float64 inputs (CPU, one process): the entropy and
    its gradient against autograd through ``log_softmax`` (the logits never written), and
    :func:`actor_loss` against fnppo's ``ppo_loss`` with the same PPO-clip, entropy and k3 settings
    and the same global token count (the two agree where no token's k3 exceeds the actor's cap of 10)."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(4, 300, 37, generator=g, dtype=torch.float64) * 3).requires_grad_()
    before = x.detach().clone()
    ent = InplaceVocabParallelEntropy.apply(x, None)
    up = torch.randn(ent.shape, generator=g, dtype=torch.float64)
    (grad,) = torch.autograd.grad(ent, x, up)
    xr = x.detach().clone().requires_grad_()
    ref = -(torch.softmax(xr, -1) * torch.log_softmax(xr, -1)).sum(-1)
    (ref_grad,) = torch.autograd.grad(ref, xr, up)
    old, ref_lp = (torch.randn(8, 16, generator=g, dtype=torch.float64) * 0.3 - 2 for _ in range(2))
    lp = old + 0.5 * torch.randn(8, 16, generator=g, dtype=torch.float64)
    adv = torch.randn(8, 16, generator=g, dtype=torch.float64)
    entropy = torch.rand(8, 16, generator=g, dtype=torch.float64)
    mask = (torch.rand(8, 16, generator=g) > 0.3).double()
    config = LossConfig(policy=ppo_clip(clip_low=0.2, clip_high=0.28), entropy_coef=0.01, kl=KLPenalty(coef=0.001))
    normalizer = torch.tensor(200.0, dtype=torch.float64)
    actor, _ = actor_loss(lp, old, adv, mask, config, entropy=entropy, ref_logprobs=ref_lp, normalizer=normalizer)
    fn, _ = ppo_loss(lp, old, adv, mask, config, entropy=entropy, ref_logprobs=ref_lp, normalizer=normalizer)
    return {
        "entropy_max_abs_err": float((ent.detach() - ref.detach()).abs().max()),
        "entropy_grad_max_abs_err": float((grad - ref_grad).abs().max()),
        "logits_unchanged": float(torch.equal(x.detach(), before)),
        "loss_vs_fnppo_abs_diff": float((actor - fn).detach().abs()),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="Imported by benchmarks/step.py (path B) and benchmarks/logprob.py (method b). Run directly: check the "
        "baseline against float64 references and fnppo's ppo_loss.",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default 0)")
    args = p.parse_args(argv)
    results = self_check(args.seed)
    for k, v in results.items():
        print(f"{k}: {v:.3e}")
    ok = (
        results["entropy_max_abs_err"] < 1e-12
        and results["entropy_grad_max_abs_err"] < 1e-12
        and results["logits_unchanged"] == 1.0
        and results["loss_vs_fnppo_abs_diff"] < 1e-12
    )
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
