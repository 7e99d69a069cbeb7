"""The smallest real GRPO loop with fnppo: sample, reward, advantages, log-probs, one training step.

A tiny Megatron GPT learns the "count on" task from scratch on the CPU in about a minute: the prompt
is ``BOS a`` with a symbol ``a`` out of 8 (ordered cyclically), the ideal response is the 4 symbols
after it, ``a+1 a+2 a+3 a+4`` (mod 8), and the reward is the fraction of response tokens that are
right (a random policy over the 16 tokens scores about 1/16).

Each step, read top to bottom below:

1. prompts, and responses sampled from the current policy token by token through Megatron's
   forward-only schedule (``fnppo.forward_only``);
2. rewards, and GRPO advantages (each reward normalized within its group of responses to one prompt);
3. the old and reference log-probs of the responses (``fnppo.compute_logprobs``);
4. ``fnppo.train_step``: the clipped PPO loss with a k3 KL penalty to the reference, inside
   Megatron's schedule; the loss is a ``fnppo.losses.LossConfig`` built from its parts (a per-token
   policy loss, the aggregation, the KL penalty), each a small checked value you can swap.

    python examples/minimal_grpo.py                 # 40 steps, one process, CPU
    python examples/minimal_grpo.py --steps 80

It runs in one process (``init_parallel`` sets up Megatron with gloo on the CPU). The main job,
``examples/ppo_toy.py``, is the same loop with every option: tensor/pipeline/data parallelism,
checkpoints and resume, a critic, MoE, LoRA, metrics sinks, stale rollouts.
"""

from __future__ import annotations

import argparse
import dataclasses

import torch

import fnppo
from fnppo import advantages, losses, models, parallel

PAD, BOS = 0, 1
FIRST_SYMBOL, NUM_SYMBOLS = 2, 8
VOCAB = 16
PROMPT_LEN, RESPONSE_LEN = 2, 4


# ---------------------------------------------------------------------------------------------
# the task
# ---------------------------------------------------------------------------------------------
def make_prompts(n: int, generator: torch.Generator) -> torch.Tensor:
    """``[n, 2]`` prompts ``BOS a`` with random symbols ``a``."""
    symbols = torch.randint(FIRST_SYMBOL, FIRST_SYMBOL + NUM_SYMBOLS, (n, 1), generator=generator)
    return torch.cat([torch.full((n, 1), BOS), symbols], dim=1)


def rewards_of(prompts: torch.Tensor, responses: torch.Tensor) -> torch.Tensor:
    """``[n]``: the fraction of response tokens equal to ``a+1, a+2, ...`` (mod 8)."""
    a = prompts[:, 1:2] - FIRST_SYMBOL
    target = FIRST_SYMBOL + (a + 1 + torch.arange(RESPONSE_LEN)) % NUM_SYMBOLS
    return (responses == target).float().mean(dim=1)


# ---------------------------------------------------------------------------------------------
# the sampler: one forward pass per response token through Megatron's forward-only schedule
# ---------------------------------------------------------------------------------------------
def sample(model, prompts: torch.Tensor, temperature: float, generator: torch.Generator):
    """Responses ``[n, RESPONSE_LEN]`` drawn from the policy, and their log-probs (the sampler's own)."""
    seqs = prompts
    logps = []
    for _ in range(RESPONSE_LEN):
        batch = [fnppo.Sample(prompt_ids=s, response_ids=s.new_zeros(0)) for s in seqs]
        mb = fnppo.collate_microbatch(batch, layout="padded", pad_to_multiple_of=1)
        # the logits of the last position, over the real vocabulary (the model's may be padded)
        (last,) = fnppo.forward_only(model, [mb], lambda logits, mb: logits[:, -1, :VOCAB].float())
        logp = torch.log_softmax(last / temperature, dim=-1)
        token = torch.multinomial(logp.exp(), 1, generator=generator)
        logps.append(logp.gather(1, token))
        seqs = torch.cat([seqs, token], dim=1)
    return seqs[:, PROMPT_LEN:], torch.cat(logps, dim=1)


# ---------------------------------------------------------------------------------------------
# the loop
# ---------------------------------------------------------------------------------------------
def train(
    steps: int = 40,
    prompts: int = 16,
    group_size: int = 16,
    lr: float = 3e-3,
    temperature: float = 1.0,
    seed: int = 0,
    log=print,
) -> list[dict]:
    """Train a fresh policy for ``steps`` steps; returns one metrics row per step (reward first)."""
    fnppo.init_parallel(tp=1, pp=1, seed=seed)  # gloo on the CPU, one process
    try:
        cfg = fnppo.ModelConfig(
            num_layers=2,
            hidden_size=64,
            num_attention_heads=4,
            ffn_hidden_size=128,
            vocab_size=VOCAB,
            max_seq_len=PROMPT_LEN + RESPONSE_LEN,
        )
        chunks = fnppo.build_gpt(cfg)
        models.layout_invariant_init(chunks, seed=seed)
        ddp = fnppo.wrap_ddp(chunks)
        state = fnppo.TrainState(model=ddp, optimizer=fnppo.build_optimizer(ddp, lr=lr, clip_grad=1.0))
        reference = models.snapshot_params(state.model)  # the initial policy, frozen: the KL anchor

        loss = losses.LossConfig(
            policy=losses.ppo_clip(clip_low=0.2, clip_high=0.2),  # per token; any function of PolicyInputs will do
            agg=losses.Aggregation("token-mean"),  # per-token losses -> one number: the mean over trained tokens
            kl=losses.KLPenalty(coef=0.001, estimator="k3"),  # the pull toward the reference policy
        )
        config = fnppo.StepConfig(
            loss=loss,
            layout="packed",  # sequences packed end to end, no padding
            temperature=temperature,
            num_microbatches=2,  # gradient accumulation; the loss does not depend on the split
            num_minibatches=2,  # two optimizer updates per step (the second one off-policy: clipping acts)
        )
        g = torch.Generator().manual_seed(seed)
        rows = []
        for step in range(1, steps + 1):
            # 1. prompts (each repeated for its group) and responses from the current policy
            p = make_prompts(prompts, g).repeat_interleave(group_size, dim=0)
            responses, sampler_logprobs = sample(state.model, p, temperature, g)

            # 2. rewards and group-normalized advantages, one per response, given to each of its tokens
            r = rewards_of(p, responses)
            adv = advantages.grpo_advantages(r.view(prompts, group_size)).reshape(-1)
            samples = [
                fnppo.Sample(
                    prompt_ids=p[i],
                    response_ids=responses[i],
                    advantages=adv[i].expand(RESPONSE_LEN),
                    rollout_logprobs=sampler_logprobs[i],
                )
                for i in range(p.shape[0])
            ]

            # 3. old log-probs (the policy that sampled, as the trainer computes them) and the reference's
            old, _ = fnppo.compute_logprobs(state.model, samples, config=config)
            ref, _ = fnppo.compute_logprobs(state.model, samples, params=reference, config=config)
            samples = [
                dataclasses.replace(s, old_logprobs=o, ref_logprobs=rf)
                for s, o, rf in zip(samples, old, ref, strict=True)
            ]

            # 4. the update: PPO clip + KL penalty, backward and optimizer inside Megatron's schedule
            state, metrics = fnppo.train_step(state, samples, config)
            row = {"step": step, "reward": float(r.mean()), **{k: v for k, v in metrics.items() if k != "step"}}
            rows.append(row)
            log(
                f"step {step:3d}  reward {row['reward']:.3f}  loss {row['loss']:+.4f}  "
                f"kl {row['kl_loss']:.4f}  entropy {row['entropy']:.3f}  grad_norm {row['grad_norm']:.3f}"
            )
        return rows
    finally:
        parallel.destroy_parallel()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.steps < 1:
        ap.error(f"--steps must be >= 1, got {args.steps}")
    rows = train(steps=args.steps, seed=args.seed)
    final = sum(r["reward"] for r in rows[-5:]) / len(rows[-5:])
    print(f"reward: first step {rows[0]['reward']:.3f}, mean of the last 5 steps {final:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
