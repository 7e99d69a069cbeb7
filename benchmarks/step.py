"""Whole training step: fnppo's ``train_step`` (A) against the loss path of today's stateful actors (B).

Same process, same Megatron GPTModel (local spec, bf16, DDP + distributed Adam), same schedule and
micro-batches; steps of A and B alternate. B differs only in the stages:

* log-probs from Megatron's ``vocab_parallel_cross_entropy`` on a *clone* of the logits (the usual
  fix for its in-place modification of the logits),
* entropy from a separate vocab-parallel entropy function that saves the softmax for backward,
* the loss reduced as a mean of per-micro-batch token means (fnppo uses one global normalizer).

Path C is A with ``StepConfig(fused_output=True)``: the last stage stops before the output layer and
``linear_logprob_and_entropy`` computes log-probs and entropy from the hidden states and the output
weight, never materializing the logits.

Prints: tokens/s (median over the timed steps), peak memory, first-step log-probs and grad norms of A
vs B, and (``--search``) the largest micro-batch token budget that fits for each path.

    python benchmarks/step.py --model tiny --device cpu                       # anywhere (CPU)
    python benchmarks/step.py --model qwen2.5-0.5b --search                   # one GPU
    torchrun --nproc-per-node 2 benchmarks/step.py --model qwen2.5-0.5b --tp 2 # two GPUs
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time

import torch
import torch.distributed as dist

import fnppo

MODELS = {
    # Qwen2.5 shapes (random weights): hidden, layers, heads, kv groups, ffn, vocab; tied embeddings.
    "qwen2.5-0.5b": dict(hidden_size=896, num_layers=24, num_attention_heads=14, num_query_groups=2, ffn_hidden_size=4864),
    "qwen2.5-1.5b": dict(hidden_size=1536, num_layers=28, num_attention_heads=12, num_query_groups=2, ffn_hidden_size=8960),
    "tiny": dict(hidden_size=64, num_layers=2, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=128),
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="fnppo train_step vs the usual actor loss path")
    p.add_argument("--model", choices=sorted(MODELS), default="qwen2.5-0.5b")
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--seq", type=int, default=2048, help="tokens per sample (prompt + response)")
    p.add_argument("--mb-tokens", type=int, default=8192, help="micro-batch token budget")
    p.add_argument("--microbatches", type=int, default=4, help="micro-batches per step (per DP rank)")
    p.add_argument("--steps", type=int, default=6, help="timed steps per path")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--search", action="store_true", help="find the largest micro-batch budget per path")
    p.add_argument("--search-max", type=int, default=262144)
    p.add_argument("--paths", default="A,B,C")
    p.add_argument("--json", default=None, help="append the results as one JSON line to this file")
    return p.parse_args(argv)


# ---------------------------------------------------------------------------------------------
# path B: the stages stateful actors use today (written here from scratch)
# ---------------------------------------------------------------------------------------------
class _VocabParallelEntropy(torch.autograd.Function):
    """Entropy of softmax over TP-sharded logits; saves the fp32 softmax (as actors do)."""

    @staticmethod
    def forward(ctx, logits, group):  # noqa: ANN001
        x = logits.float()
        m = x.max(dim=-1, keepdim=True).values
        if group is not None:
            dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
        e = (x - m).exp()
        s = e.sum(-1, keepdim=True)
        if group is not None:
            dist.all_reduce(s, group=group)
        p = e / s
        px = (p * x).sum(-1, keepdim=True)
        if group is not None:
            dist.all_reduce(px, group=group)
        h = (s.log() + m - px).squeeze(-1)
        ctx.save_for_backward(p, x, px)
        ctx.out_dtype = logits.dtype
        return h

    @staticmethod
    def backward(ctx, g):  # noqa: ANN001
        p, x, px = ctx.saved_tensors
        grad = -g.unsqueeze(-1) * p * (x - px)
        return grad.to(ctx.out_dtype), None


def baseline_logprob(logits, labels, *, tp_group=None, temperature=1.0, with_entropy=True):  # noqa: ANN001
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    x = logits / temperature if temperature != 1.0 else logits
    lp = -vocab_parallel_cross_entropy(x.clone(), labels)
    ent = _VocabParallelEntropy.apply(x, tp_group) if with_entropy else None
    return lp.float(), ent


def baseline_loss_fn(num_microbatches: int, dp: int):
    """ppo_loss with a per-micro-batch token mean, averaged over micro-batches (and DP ranks)."""

    def loss(*args, normalizer=None, **kwargs):  # noqa: ANN001, ARG001
        value, metrics = fnppo.ppo_loss(*args, normalizer=None, **kwargs)
        # train_step multiplies by num_microbatches * dp to cancel Megatron's averaging; undo it so
        # the result is Megatron's usual mean of per-micro-batch means.
        return value / (num_microbatches * dp), metrics

    return loss


# ---------------------------------------------------------------------------------------------
def make_samples(n: int, seq: int, vocab: int, seed: int) -> list[fnppo.Sample]:
    g = torch.Generator().manual_seed(seed)
    prompt = seq // 4
    out = []
    for _ in range(n):
        r = seq - prompt
        out.append(
            fnppo.Sample(
                prompt_ids=torch.randint(0, vocab, (prompt,), generator=g),
                response_ids=torch.randint(0, vocab, (r,), generator=g),
                advantages=torch.randn(r, generator=g),
                old_logprobs=-12.0 + 0.1 * torch.randn(r, generator=g),
                ref_logprobs=-12.0 + 0.1 * torch.randn(r, generator=g),
            )
        )
    return out


def build_state(args, layout):
    cfg = fnppo.ModelConfig(vocab_size=args.vocab, max_seq_len=max(4096, args.seq), dtype="bf16" if args.device == "cuda" else "fp32",
                            tie_embeddings=True, add_qkv_bias=True, rotary_base=1_000_000.0, **MODELS[args.model])
    chunks = fnppo.build_gpt(cfg)
    fnppo.layout_invariant_init(chunks, seed=0)
    ddp = fnppo.wrap_ddp(chunks, use_distributed_optimizer=True)
    opt = fnppo.build_optimizer(ddp, lr=1e-6, clip_grad=1.0)
    return fnppo.TrainState(model=ddp, optimizer=opt)


def step_config(path: str, mb_tokens: int, n_mb: int, dp: int) -> fnppo.StepConfig:
    loss = fnppo.PolicyLossConfig(policy_loss="ppo", loss_agg_mode="token-mean", entropy_coeff=0.01, kl_coef=0.001, kl_estimator="k3")
    fns = fnppo.StepFns(logprob=baseline_logprob, loss=baseline_loss_fn(n_mb, dp)) if path == "B" else fnppo.StepFns()
    return fnppo.StepConfig(loss=loss, layout="packed", max_tokens_per_microbatch=mb_tokens, fns=fns, fused_output=path == "C")


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed_step(state, samples, cfg, device):
    sync(device)
    t0 = time.perf_counter()
    state, metrics = fnppo.train_step(state, samples, cfg)
    sync(device)
    return state, metrics, time.perf_counter() - t0


def fits(state, args, path, budget, layout, device) -> bool:
    n = max(1, budget // args.seq)
    samples = make_samples(n, args.seq, args.vocab, seed=123)
    cfg = step_config(path, budget, 1, layout.dp)
    try:
        fnppo.train_step(state, samples, cfg)
        sync(device)
        ok = True
    except torch.cuda.OutOfMemoryError:
        ok = False
    torch.cuda.empty_cache() if device.type == "cuda" else None
    flag = torch.tensor([1.0 if ok else 0.0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def search(state, args, path, layout, device) -> int:
    unit = args.seq
    lo, hi = 0, None
    b = args.mb_tokens
    while b <= args.search_max:
        if fits(state, args, path, b, layout, device):
            lo = b
            b *= 2
        else:
            hi = b
            break
    if hi is None:
        return lo
    while hi - lo > unit:
        mid = (lo + hi) // 2 // unit * unit
        if mid <= lo:
            break
        if fits(state, args, path, mid, layout, device):
            lo = mid
        else:
            hi = mid
    return lo


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    from fnppo.testing import megatron_on_cpu

    ctx = megatron_on_cpu() if device.type == "cpu" else contextlib.nullcontext()
    with ctx:
        layout = fnppo.init_parallel(args.tp, 1, device=args.device, seed=0)
        try:
            return run(args, layout, device)
        finally:
            fnppo.parallel.destroy_parallel()


def run(args, layout, device) -> int:
    rank0 = layout.rank == 0
    paths = args.paths.split(",")
    state = build_state(args, layout)
    n_per_rank = args.microbatches * max(1, args.mb_tokens // args.seq)
    samples = make_samples(n_per_rank * layout.dp, args.seq, args.vocab, seed=1)
    mine = fnppo.shard_for_data_parallel(samples, layout)
    tokens_per_step = sum(len(s) for s in samples)
    cfgs = {p: step_config(p, args.mb_tokens, args.microbatches, layout.dp) for p in paths}

    # First step from identical weights: log-probs and grad norm of A vs B (no update applied).
    first = {}
    for p in paths:
        lp, _ = fnppo.compute_logprobs(state.model, mine[:2], config=cfgs[p])
        first[p] = {"logprobs": torch.cat(lp)}
    times = {p: [] for p in paths}
    peak = {p: 0.0 for p in paths}
    gnorm = {p: [] for p in paths}
    for i in range(args.warmup + args.steps):
        for p in paths:
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            state, metrics, dt = timed_step(state, mine, cfgs[p], device)
            gnorm[p].append(metrics["grad_norm"])
            if i >= args.warmup:
                times[p].append(dt)
                if device.type == "cuda":
                    peak[p] = max(peak[p], torch.cuda.max_memory_allocated() / 2**30)
    result = {
        "model": args.model, "tp": layout.tp, "dp": layout.dp, "gpus": layout.world_size, "mb_tokens": args.mb_tokens,
        "microbatches": args.microbatches, "tokens_per_step": tokens_per_step, "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
    }
    for p in paths:
        med = statistics.median(times[p])
        result[p] = {"step_s_median": med, "tokens_per_s": tokens_per_step / med, "peak_gib": peak[p], "first_grad_norm": gnorm[p][0]}
    if "A" in paths and "B" in paths:
        d = (first["A"]["logprobs"] - first["B"]["logprobs"]).abs()
        result["first_logprobs_max_abs_diff"] = float(d.max())
        result["speedup_A_over_B"] = result["A"]["tokens_per_s"] / result["B"]["tokens_per_s"]
        logits_gib = args.mb_tokens * args.vocab / layout.tp * 2 / 2**30
        result["logits_copy_gib"] = logits_gib
        if device.type == "cuda":
            result["peak_saving_in_logits_copies"] = (result["B"]["peak_gib"] - result["A"]["peak_gib"]) / logits_gib
    if "A" in paths and "C" in paths:
        result["first_logprobs_max_abs_diff_C_vs_A"] = float((first["C"]["logprobs"] - first["A"]["logprobs"]).abs().max())
        result["speedup_C_over_A"] = result["C"]["tokens_per_s"] / result["A"]["tokens_per_s"]
    if args.search and device.type == "cuda":
        for p in paths:
            result[p]["max_mb_tokens"] = search(state, args, p, layout, device)
    if rank0:
        print(json.dumps(result, indent=1))
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps(result) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
