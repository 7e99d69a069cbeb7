"""Per-call overhead of fnppo's call-time shape/dtype checking (jaxtyping + beartype).

For ``ppo_loss``, ``logprob_and_entropy`` and ``collate_microbatch`` on small CPU inputs (4 sequences
of 64 tokens, vocabulary 128), times single calls with checking on and off
(``fnppo.core.typing.typechecking(False)``) and prints the median per-call time of each and the
difference. The on/off measurements alternate in rounds so that drift affects both alike. For
context it also prints the wall time of a tiny ``train_step`` (real Megatron on CPU, one process)
with checking on and off.

"Checked" includes everything the switch controls: the annotation check and the value checks that
are skipped with checking off (``logprob_and_entropy``'s label-range check, ``ppo_loss``'s 0/1-mask
and finite-value checks).

    python benchmarks/typecheck_overhead.py                 # defaults: 2000 calls per function
    python benchmarks/typecheck_overhead.py --calls 500 --steps 3
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

import fnppo
from fnppo.core.typing import typechecking

BATCH, SEQ, VOCAB = 4, 64, 128


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="per-call overhead of fnppo's call-time type checking")
    p.add_argument("--calls", type=int, default=2000, help="timed calls per function and setting")
    p.add_argument("--rounds", type=int, default=10, help="alternating on/off rounds")
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--steps", type=int, default=5, help="timed train_step calls per setting (0: skip)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    return p.parse_args(argv)


def _time_calls(fn: Callable[[], object], n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter_ns()
        fn()
        out.append((time.perf_counter_ns() - t0) / 1e3)
    return out


def measure(fn: Callable[[], object], calls: int, rounds: int, warmup: int) -> tuple[float, float]:
    """Median per-call time in microseconds with checking (on, off)."""
    on: list[float] = []
    off: list[float] = []
    with typechecking(True):
        _time_calls(fn, warmup)
    with typechecking(False):
        _time_calls(fn, warmup)
    per = max(1, calls // rounds)
    for _ in range(rounds):
        with typechecking(True):
            on += _time_calls(fn, per)
        with typechecking(False):
            off += _time_calls(fn, per)
    return statistics.median(on), statistics.median(off)


def cases() -> dict[str, Callable[[], object]]:
    g = torch.Generator().manual_seed(0)
    lp = -2.0 + 0.3 * torch.randn(BATCH, SEQ, generator=g)
    old = lp + 0.05 * torch.randn(BATCH, SEQ, generator=g)
    adv = torch.randn(BATCH, SEQ, generator=g)
    mask = (torch.rand(BATCH, SEQ, generator=g) > 0.2).float()
    cfg = fnppo.losses.from_flat()
    logits = torch.randn(BATCH, SEQ, VOCAB, generator=g)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    samples = [
        fnppo.Sample(
            prompt_ids=torch.randint(0, VOCAB, (16,), generator=g),
            response_ids=torch.randint(0, VOCAB, (SEQ - 16,), generator=g),
            advantages=torch.randn(SEQ - 16, generator=g),
            old_logprobs=-2.0 + 0.3 * torch.randn(SEQ - 16, generator=g),
        )
        for _ in range(BATCH)
    ]
    return {
        f"ppo_loss [{BATCH},{SEQ}]": lambda: fnppo.ppo_loss(lp, old, adv, mask, cfg),
        f"logprob_and_entropy [{BATCH},{SEQ},{VOCAB}]": lambda: fnppo.logprob_and_entropy(logits, labels),
        f"collate_microbatch {BATCH}x{SEQ} padded": lambda: fnppo.collate_microbatch(
            samples, layout="padded", vocab_size=VOCAB
        ),
    }


def train_step_times(steps: int) -> tuple[float, float]:
    """Median wall time (ms) of a tiny train_step with checking on and off (alternating)."""
    from fnppo.testing import megatron_on_cpu, synthetic_samples

    with megatron_on_cpu():
        fnppo.init_parallel(1, 1, device="cpu", seed=0)
        try:
            cfg = fnppo.ModelConfig(
                num_layers=2,
                hidden_size=64,
                num_attention_heads=4,
                num_query_groups=2,
                ffn_hidden_size=128,
                vocab_size=VOCAB,
                max_seq_len=SEQ,
            )
            chunks = fnppo.wrap_ddp(fnppo.build_gpt(cfg))
            state = fnppo.TrainState(model=chunks, optimizer=fnppo.build_optimizer(chunks, lr=1e-5))
            samples = synthetic_samples(
                BATCH, vocab_size=VOCAB, seed=1, prompt_len=(16, 16), response_len=(SEQ - 16, SEQ - 16)
            )
            step_cfg = fnppo.StepConfig(num_microbatches=2)
            times: dict[bool, list[float]] = {True: [], False: []}
            for enabled in (True, False):  # warm-up
                with typechecking(enabled):
                    state, _ = fnppo.train_step(state, samples, step_cfg)
            for _ in range(steps):
                for enabled in (True, False):
                    with typechecking(enabled):
                        t0 = time.perf_counter()
                        state, _ = fnppo.train_step(state, samples, step_cfg)
                        times[enabled].append((time.perf_counter() - t0) * 1e3)
        finally:
            fnppo.megatron.parallel.destroy_parallel()
    return statistics.median(times[True]), statistics.median(times[False])


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), CPU; median of {args.calls} calls per setting"
    )
    print()
    header = f"| {'function (inputs)':<42} | {'checked µs':>10} | {'unchecked µs':>12} | {'overhead µs':>11} | {'overhead':>8} |"
    print(header)
    print("|" + "|".join("-" * (len(c)) for c in header.split("|")[1:-1]) + "|")
    for name, fn in cases().items():
        on, off = measure(fn, args.calls, args.rounds, args.warmup)
        print(f"| {name:<42} | {on:>10.1f} | {off:>12.1f} | {on - off:>11.1f} | {100 * (on - off) / off:>7.0f}% |")
    if args.steps > 0:
        on, off = train_step_times(args.steps)
        print()
        print(
            f"tiny train_step (2 layers, hidden 64, {BATCH} samples x {SEQ} tokens, 2 micro-batches, 1 process), "
            f"median of {args.steps}: checked {on:.1f} ms, unchecked {off:.1f} ms, difference {on - off:.1f} ms ({100 * (on - off) / off:.1f}%)"
        )


if __name__ == "__main__":
    main()
