"""A complete PPO/GRPO run that a tiny Megatron GPT learns from scratch on a laptop CPU.

Task ("count on"): the prompt is ``BOS a`` with a random symbol ``a`` out of 8 (ordered cyclically);
the ideal response is the 4 symbols that follow it, ``a+1 a+2 a+3 a+4`` (mod 8). The reward is the
fraction of response positions that are right, so a random policy (over 16 tokens) scores about
1/16 and a perfect one 1.0.

Each step: prompts -> responses sampled from the current policy (temperature sampling through
Megatron's forward-only schedule) -> rewards -> GRPO group-normalized advantages -> old and
reference log-probs (``compute_logprobs``) -> ``train_step`` (clipped PPO, entropy bonus, k3 KL
to the reference, optional TIS).

    python examples/ppo_toy.py                                   # 1 process, CPU
    torchrun --nproc-per-node 2 examples/ppo_toy.py --tp 2       # gloo on CPU, or NCCL with --device cuda
    python examples/ppo_toy.py --steps 5 --layout-check          # print first-step loss/grad norm

Metrics go to a JSONL file, a PNG plot is written at the end, checkpoints every ``--save-every``
steps; ``--resume`` continues from the newest complete checkpoint with the same result as an
uninterrupted run (data and sampling are functions of (seed, step)).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import fnppo
from fnppo.testing import megatron_on_cpu

PAD, BOS = 0, 1
FIRST_SYMBOL, NUM_SYMBOLS = 2, 8
VOCAB = 16
PROMPT_LEN, RESPONSE_LEN = 2, 4


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=80, help="training steps (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel size")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--prompts", type=int, default=16, help="prompts per step (global)")
    p.add_argument("--group-size", type=int, default=16, help="responses per prompt (GRPO group)")
    p.add_argument("--num-microbatches", type=int, default=None, help="micro-batches per mini-batch")
    p.add_argument("--max-tokens-per-microbatch", type=int, default=None, help="token budget per micro-batch")
    p.add_argument("--minibatches", type=int, default=2, help="optimizer steps per training step")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--entropy-coeff", type=float, default=0.001)
    p.add_argument("--kl-coef", type=float, default=0.001)
    p.add_argument("--tis-cap", type=float, default=None, help="truncated importance sampling cap (off by default)")
    p.add_argument("--advantage", choices=["grpo", "rloo"], default="grpo")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hf-checkpoint", type=str, default=None, help="start from a Hugging Face checkpoint directory (Llama/Qwen2/Qwen3)")
    p.add_argument("--out-dir", type=str, default="runs/ppo_toy")
    p.add_argument("--metrics-out", type=str, default=None, help="JSONL metrics file (default: OUT_DIR/metrics.jsonl)")
    p.add_argument("--save-every", type=int, default=0, help="checkpoint every N steps (0: off)")
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in OUT_DIR/checkpoints")
    p.add_argument("--exit-after", type=int, default=None, help="stop after this many steps of this invocation (simulates a preempted job)")
    p.add_argument("--target-reward", type=float, default=0.9)
    p.add_argument("--layout-check", action="store_true", help="print the first step's loss and grad norm with full precision")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--no-progress", action="store_true")
    return p.parse_args(argv)


# ---------------------------------------------------------------------------------------------
# the task
# ---------------------------------------------------------------------------------------------
def make_prompts(seed: int, step: int, n: int) -> torch.Tensor:
    """``[n, PROMPT_LEN]`` prompts ``BOS a``; a function of (seed, step) only."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    sym = torch.randint(FIRST_SYMBOL, FIRST_SYMBOL + NUM_SYMBOLS, (n, 1), generator=g)
    return torch.cat([torch.full((n, 1), BOS), sym], dim=1)


def reward(prompt: torch.Tensor, response: torch.Tensor) -> float:
    """Fraction of response positions equal to ``a+1, a+2, ...`` (mod NUM_SYMBOLS)."""
    a = int(prompt[1]) - FIRST_SYMBOL
    target = FIRST_SYMBOL + (a + 1 + torch.arange(response.numel())) % NUM_SYMBOLS
    return float((response == target).float().mean()) if response.numel() else 0.0


# ---------------------------------------------------------------------------------------------
# sampling through Megatron's forward-only schedule (works for any TP/PP layout)
# ---------------------------------------------------------------------------------------------
def sample_responses(chunks, prompts: torch.Tensor, uniforms: torch.Tensor, *, temperature: float, layout, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Autoregressive sampling by inverse CDF with given uniforms ``[n, RESPONSE_LEN]``.

    Returns tokens ``[n, RESPONSE_LEN]`` and their log-probs (fp32). The uniforms are drawn for the
    global batch from (seed, step), so every layout samples the same tokens.
    """
    n = prompts.shape[0]
    seqs = prompts.clone()
    logps = torch.zeros(n, RESPONSE_LEN)
    for t in range(RESPONSE_LEN):
        samples = [fnppo.Sample(prompt_ids=seqs[i], response_ids=seqs.new_zeros(0)) for i in range(n)]
        mb = fnppo.collate_microbatch(samples, layout="padded", pad_to_multiple_of=1)
        mb = _to(mb, device)

        def last_logits(logits: torch.Tensor, mb) -> torch.Tensor:
            last = logits[:, -1, :].float()
            if layout.tp > 1:
                parts = [torch.empty_like(last) for _ in range(layout.tp)]
                dist.all_gather(parts, last.contiguous(), group=layout.tp_group)
                last = torch.cat(parts, dim=-1)
            return last[:, :VOCAB]

        out = fnppo.forward_only(chunks, [mb], last_logits)
        pick = torch.zeros(2, n)
        if out is not None:
            logp = torch.log_softmax(out[0].cpu().double() / temperature, dim=-1)
            cdf = logp.exp().cumsum(-1)
            tok = (cdf < uniforms[:, t : t + 1].double() * cdf[:, -1:]).sum(-1).clamp_max(VOCAB - 1)
            pick[0] = tok.float()
            pick[1] = logp.gather(1, tok[:, None]).squeeze(1).float()
        if layout.pp > 1:
            buf = pick.to(device)
            dist.broadcast(buf, src=dist.get_global_rank(layout.pp_group, layout.pp - 1), group=layout.pp_group)
            pick = buf.cpu()
        seqs = torch.cat([seqs, pick[0].long()[:, None]], dim=1)
        logps[:, t] = pick[1]
    return seqs[:, PROMPT_LEN:], logps


def _to(mb, device):
    if device.type == "cpu":
        return mb
    import optree

    return optree.tree_map(lambda x: x.to(device), mb, namespace="fnppo")


# ---------------------------------------------------------------------------------------------
# setup
# ---------------------------------------------------------------------------------------------
def build(args: argparse.Namespace, layout):
    if args.hf_checkpoint:
        from fnppo.hf import build_gpt_from_hf, load_hf_weights

        chunks = build_gpt_from_hf(args.hf_checkpoint, dtype=args.dtype)
        load_hf_weights(chunks, args.hf_checkpoint)
    else:
        cfg = fnppo.ModelConfig(
            num_layers=args.layers,
            hidden_size=args.hidden,
            num_attention_heads=4,
            num_query_groups=2,
            ffn_hidden_size=2 * args.hidden,
            vocab_size=VOCAB,
            max_seq_len=PROMPT_LEN + RESPONSE_LEN,
            dtype=args.dtype,
            tie_embeddings=True,
        )
        chunks = fnppo.build_gpt(cfg)
        fnppo.layout_invariant_init(chunks, seed=args.seed)
    ddp = fnppo.wrap_ddp(chunks, use_distributed_optimizer=True)
    optimizer = fnppo.build_optimizer(ddp, lr=args.lr, clip_grad=1.0, weight_decay=0.0)
    return fnppo.TrainState(model=ddp, optimizer=optimizer, step=0)


def step_config(args: argparse.Namespace) -> fnppo.StepConfig:
    loss = fnppo.PolicyLossConfig(
        policy_loss="ppo",
        loss_agg_mode="token-mean",
        entropy_coeff=args.entropy_coeff,
        kl_coef=args.kl_coef,
        kl_estimator="k3",
        tis_cap=args.tis_cap,
    )
    split = {}
    if args.max_tokens_per_microbatch:
        split["max_tokens_per_microbatch"] = args.max_tokens_per_microbatch
    else:
        split["num_microbatches"] = args.num_microbatches or 2
    return fnppo.StepConfig(loss=loss, layout="packed", temperature=args.temperature, num_minibatches=args.minibatches, **split)


def rollout(state, ref_params, args, layout, device, step: int):
    """Prompts -> responses -> rewards -> advantages -> old/ref log-probs: this DP rank's samples."""
    n_prompts = args.prompts // layout.dp
    prompts = make_prompts(args.seed, step, args.prompts)[layout.dp_rank * n_prompts : (layout.dp_rank + 1) * n_prompts]
    prompts = prompts.repeat_interleave(args.group_size, dim=0)
    g = torch.Generator().manual_seed(args.seed * 7_919 + step)
    uniforms = torch.rand(args.prompts * args.group_size, RESPONSE_LEN, generator=g)
    per = n_prompts * args.group_size
    uniforms = uniforms[layout.dp_rank * per : (layout.dp_rank + 1) * per]
    responses, rollout_lp = sample_responses(state.model, prompts, uniforms, temperature=args.temperature, layout=layout, device=device)
    rewards = torch.tensor([reward(p, r) for p, r in zip(prompts, responses)])
    grouped = rewards.view(-1, args.group_size)
    if args.advantage == "rloo":
        adv = fnppo.rloo_advantages(grouped).reshape(-1)
    else:
        adv = fnppo.grpo_advantages(grouped).reshape(-1)
    samples = [
        fnppo.Sample(
            prompt_ids=prompts[i],
            response_ids=responses[i],
            advantages=torch.full((RESPONSE_LEN,), float(adv[i])),
            rollout_logprobs=rollout_lp[i],
        )
        for i in range(prompts.shape[0])
    ]
    cfg = step_config(args)
    old, _ = fnppo.compute_logprobs(state.model, samples, config=cfg)
    ref, _ = fnppo.compute_logprobs(state.model, samples, params=ref_params, config=cfg)
    samples = [
        fnppo.Sample(
            prompt_ids=s.prompt_ids, response_ids=s.response_ids, advantages=s.advantages,
            old_logprobs=o, ref_logprobs=r, rollout_logprobs=s.rollout_logprobs,
        )
        for s, o, r in zip(samples, old, ref)
    ]
    total = torch.tensor([float(rewards.sum()), float(rewards.numel())], dtype=torch.float64)
    if layout.dp > 1:
        total = total.to(device)
        dist.all_reduce(total, group=layout.dp_group)
        total = total.cpu()
    return samples, float(total[0] / total[1])


def set_lr(optimizer, lr: float) -> None:
    """Set the learning rate of every parameter group of a Megatron optimizer."""
    for group in optimizer.param_groups:
        group["lr"] = lr


def write_plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = [("reward", "mean reward"), ("entropy", "entropy"), ("kl_loss", "KL to reference (k3)"), ("grad_norm", "grad norm")]
    fig, axes = plt.subplots(2, 2, figsize=(10, 6.5))
    steps = [r["step"] for r in rows]
    for ax, (key, title) in zip(axes.flat, keys):
        ax.plot(steps, [r.get(key, float("nan")) for r in rows], marker=".")
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.suptitle("fnppo toy PPO run")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device("cuda" if args.device == "cuda" else "cpu")
    ctx = megatron_on_cpu() if device.type == "cpu" else contextlib.nullcontext()
    with ctx:
        layout = fnppo.init_parallel(args.tp, args.pp, seed=args.seed, device=args.device)
        try:
            return run(args, layout, device)
        finally:
            fnppo.parallel.destroy_parallel()


def run(args: argparse.Namespace, layout, device: torch.device) -> int:
    torch.manual_seed(args.seed)
    if args.prompts % layout.dp:
        raise SystemExit(f"--prompts {args.prompts} must be divisible by the data-parallel size {layout.dp}")
    out_dir = Path(args.out_dir)
    metrics_path = Path(args.metrics_out) if args.metrics_out else out_dir / "metrics.jsonl"
    ckpt_root = out_dir / "checkpoints"
    rank0 = fnppo.parallel.is_rank_zero()
    if rank0:
        out_dir.mkdir(parents=True, exist_ok=True)
        metrics_path.parent.mkdir(parents=True, exist_ok=True)
    state = build(args, layout)
    ref_params = fnppo.snapshot_params(state.model)
    if args.resume:
        latest = fnppo.latest_checkpoint(ckpt_root)
        if latest is not None:
            state, extra = fnppo.load_checkpoint(latest, state)
            ref_params = [{k: v for k, v in p.items()} for p in extra["ref_params"]]
            if rank0:
                print(f"resumed from {latest} at step {state.step}")
    rows: list[dict] = []
    if rank0:
        if args.resume and metrics_path.exists():
            rows = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
            rows = [r for r in rows if r["step"] <= state.step // args.minibatches]
        metrics_path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = step_config(args)
    progress = None
    if rank0 and not args.no_progress:
        from tqdm import tqdm

        progress = tqdm(total=args.steps, initial=state.step, desc="ppo", dynamic_ncols=True)
    start = time.perf_counter()
    start_step = state.step
    while state.step // args.minibatches < args.steps:
        step = state.step // args.minibatches
        if args.exit_after is not None and step - start_step // args.minibatches >= args.exit_after:
            if rank0:
                print(f"exiting after {args.exit_after} steps (--exit-after)")
            return 0
        samples, mean_reward = rollout(state, ref_params, args, layout, device, step)
        set_lr(state.optimizer, args.lr * (1.0 - 0.9 * step / max(1, args.steps)))  # linear decay to 10%
        state, metrics = fnppo.train_step(state, samples, cfg)
        row = {"step": step + 1, "reward": mean_reward, **{k: v for k, v in metrics.items() if k != "step"}}
        if args.layout_check and step == 0 and rank0:
            print(f"layout-check tp={layout.tp} pp={layout.pp} dp={layout.dp}: first-step loss={metrics['loss']:.10e} grad_norm={metrics['grad_norm']:.10e}", flush=True)
        if rank0:
            rows.append(row)
            with open(metrics_path, "a") as f:
                f.write(json.dumps(row) + "\n")
            if progress is not None:
                progress.set_postfix(reward=f"{mean_reward:.3f}", kl=f"{metrics.get('kl_loss', 0.0):.4f}", ent=f"{metrics.get('entropy', 0.0):.3f}", gnorm=f"{metrics['grad_norm']:.3f}")
                progress.update(1)
        if args.save_every and (step + 1) % args.save_every == 0:
            fnppo.save_checkpoint(ckpt_root / f"step{step + 1:06d}", state, extra={"ref_params": ref_params})
    if progress is not None:
        progress.close()
    elapsed = time.perf_counter() - start
    steps_done = state.step // args.minibatches - start_step // args.minibatches
    if rank0:
        final = sum(r["reward"] for r in rows[-3:]) / max(1, len(rows[-3:]))
        print(f"steps: {state.step // args.minibatches}, wall time {elapsed:.1f} s ({elapsed / max(1, steps_done):.3f} s/step), layout tp={layout.tp} pp={layout.pp} dp={layout.dp}")
        print(f"metrics: {metrics_path}")
        if not args.no_plot and rows:
            plot = out_dir / "ppo_toy.png"
            try:
                write_plot(rows, plot)
                print(f"plot: {plot}")
            except ImportError:
                print("plot: skipped (matplotlib is not installed; pip install 'fnppo[examples]')")
        ok = final >= args.target_reward
        print(f"final reward (mean of last 3 steps): {final:.3f} -> {'reached' if ok else 'did NOT reach'} the target {args.target_reward}")
        return 0 if ok or args.steps < 10 else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
