"""The share of an RL step that skipping the old-log-prob forward saves.

Two ways to train one batch from rollouts with the inference engine's log-probs:

* ``recompute``: ``compute_logprobs`` (the old-log-prob forward: the proximal policy), then
  ``train_step`` with PPO and a rollout correction against the engine's log-probs (decoupled PPO);
* ``bypass``: ``train_step`` with IPO in bypass mode (``LossConfig(bypass_old_logprobs=True)``): the
  engine's log-probs anchor the trust region, no forward before the step.

Prints the median time of each (ms) and the saving. On a GPU (bf16 model)::

    python benchmarks/offpolicy_step.py --device cuda --layers 8 --hidden 1024 --vocab 32768 --seq 2048

On CPU it is a smoke run of the same code (``--device cpu`` with the defaults).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import torch

import fnppo
from fnppo import losses
from fnppo.testing import synthetic_samples


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cpu")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--seq", type=int, default=64, help="longest response (prompt up to 1/4 of it)")
    p.add_argument("--samples", type=int, default=16)
    p.add_argument("--microbatches", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    args = p.parse_args()

    fnppo.init_parallel(tp=1, pp=1, device=args.device)
    cfg = fnppo.ModelConfig(
        num_layers=args.layers,
        hidden_size=args.hidden,
        num_attention_heads=max(1, args.hidden // 64),
        ffn_hidden_size=4 * args.hidden,
        vocab_size=args.vocab,
        max_seq_len=args.seq + args.seq // 4 + 1,
        dtype="bf16" if args.device == "cuda" else "fp32",
    )
    chunks = fnppo.wrap_ddp(fnppo.build_gpt(cfg), use_distributed_optimizer=False)
    state = fnppo.TrainState(model=chunks, optimizer=fnppo.build_optimizer(chunks, lr=1e-6))
    base = synthetic_samples(
        args.samples,
        vocab_size=args.vocab,
        prompt_len=(2, max(3, args.seq // 4)),
        response_len=(args.seq // 2, args.seq),
        with_rollout=True,
    )
    device = torch.device(args.device)
    samples = base  # train_step and compute_logprobs move the micro-batches to the model's device
    split = fnppo.batching.ByCount(args.microbatches)
    recompute = fnppo.StepConfig(split=split, loss=losses.LossConfig(correction=losses.RolloutCorrection(tis_cap=2.0)))
    bypass = fnppo.StepConfig(split=split, loss=losses.LossConfig(policy=losses.ipo(), bypass_old_logprobs=True))

    def run_recompute() -> None:
        nonlocal state
        old, _ = fnppo.compute_logprobs(state.model, samples, config=recompute)
        batch = [dataclasses.replace(s, old_logprobs=lp.to(s.response_ids.device)) for s, lp in zip(samples, old)]
        state, _ = fnppo.train_step(state, batch, recompute)

    def run_bypass() -> None:
        nonlocal state
        state, _ = fnppo.train_step(state, samples, bypass)

    times: dict[str, list[float]] = {"recompute": [], "bypass": []}
    for i in range(args.steps + 1):  # the first round warms up
        for name, fn in (("recompute", run_recompute), ("bypass", run_bypass)):
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize()
            ms = 1e3 * (time.perf_counter() - t0)
            print(f"round {i} ({'timed' if i else 'warm-up'}) {name}: {ms:.1f} ms", flush=True)
            if i:
                times[name].append(ms)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"recompute (old-log-prob forward + step): {med['recompute']:.1f} ms")
    print(f"bypass (IPO, no old-log-prob forward):    {med['bypass']:.1f} ms")
    print(f"saved: {100 * (1 - med['bypass'] / med['recompute']):.1f} % of the step")


if __name__ == "__main__":
    main()
