"""Shared-prefix packing against unshared packing: GRPO groups whose prompt is forwarded once.

One process, one model, both packings measured side by side (alternating, after one warm-up round):
``train_step`` and ``compute_logprobs`` on ``--groups`` prompt groups of ``--group-size`` responses
(lengths drawn uniformly in ``[--response-min, --response-max]``, seeded) for each prompt length
of ``--prompts``. Throughput is counted in unshared tokens (``sum(prompt + response)`` over the
samples, what the unshared step computes) per second, so the speed-up is the ratio of the step
times; the token budget ``--max-tokens`` per micro-batch is in computed tokens for both (a shared
group counts its prompt once). Peak memory is ``torch.cuda.max_memory_allocated`` during each call.
Both packings' log-probs are compared (the largest difference is printed: rounding of the dtype).
Prints a markdown table; writes ``shared_prefix.json`` under ``--out`` (default: ``$OUT`` when set).

On one GPU (Qwen2.5-1.5B widths, bf16, fnppo's local layer spec, the fused output layer)::

    .venv/bin/python benchmarks/shared_prefix.py

``--tiny``: a CPU run of the same code on a tiny model (the test suite runs it).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time
from pathlib import Path

import torch

import fnppo
from fnppo import losses

QWEN25_15B = dict(
    num_layers=28,
    hidden_size=1536,
    num_attention_heads=12,
    num_query_groups=2,
    ffn_hidden_size=8960,
    vocab_size=151936,
    add_qkv_bias=True,
    rotary_base=1000000.0,
    tie_embeddings=True,
    layernorm_epsilon=1e-6,
)
TINY = dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=64, vocab_size=64)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="a tiny model on the CPU (a smoke run of the same code)")
    p.add_argument("--prompts", type=str, default="2048,512", help="prompt lengths, comma-separated")
    p.add_argument("--groups", type=int, default=8, help="prompt groups per step")
    p.add_argument("--group-size", type=int, default=8, help="responses per prompt (G)")
    p.add_argument("--response-min", type=int, default=256)
    p.add_argument("--response-max", type=int, default=1024)
    p.add_argument("--max-tokens", type=int, default=12288, help="computed tokens per micro-batch (both packings)")
    p.add_argument("--steps", type=int, default=3, help="timed rounds (after one warm-up round)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--out", type=str, default=os.environ.get("OUT"), help="write shared_prefix.json here (default: $OUT)"
    )
    args = p.parse_args(argv)
    if args.tiny:
        args.prompts, args.groups, args.group_size = "24,8", 2, 4
        args.response_min, args.response_max, args.max_tokens, args.steps = 4, 12, 96, 1
    return args


def make_samples(prompt_len: int, args: argparse.Namespace, vocab: int) -> list[fnppo.Sample]:
    """``--groups`` groups of ``--group-size`` samples sharing a random prompt of ``prompt_len`` tokens."""
    g = torch.Generator().manual_seed(args.seed * 1000 + prompt_len)
    out = []
    for _ in range(args.groups):
        prompt = torch.randint(0, vocab, (prompt_len,), generator=g)
        for _ in range(args.group_size):
            r = int(torch.randint(args.response_min, args.response_max + 1, (), generator=g))
            out.append(
                fnppo.Sample(
                    prompt_ids=prompt,
                    response_ids=torch.randint(0, vocab, (r,), generator=g),
                    advantages=torch.randn(r, generator=g),
                    old_logprobs=-2.0 + 0.1 * torch.randn(r, generator=g),
                )
            )
    return out


def timed(fn, device: torch.device) -> tuple[float, float | None, object]:
    """``(seconds, peak GiB or None, result)`` of one call."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None
    return time.perf_counter() - t0, peak, out


def run(args: argparse.Namespace) -> list[dict]:
    device = torch.device("cpu" if args.tiny else "cuda")
    fnppo.init_parallel(tp=1, pp=1, device=device.type)
    shape = TINY if args.tiny else QWEN25_15B
    prompts = [int(p) for p in args.prompts.split(",")]
    cfg = fnppo.ModelConfig(
        **shape,
        max_seq_len=max(prompts) + args.response_max + 1,
        dtype="fp32" if args.tiny else "bf16",
    )
    chunks = fnppo.build_gpt(cfg, layer_spec=fnppo.models.local_layer_spec(cfg))
    ddp = fnppo.wrap_ddp(chunks, use_distributed_optimizer=True)
    state = fnppo.TrainState(model=ddp, optimizer=fnppo.build_optimizer(ddp, lr=1e-7))
    base = fnppo.StepConfig(
        loss=losses.LossConfig(), max_tokens_per_microbatch=args.max_tokens, fns=fnppo.StepFns.fused()
    )
    configs = {"unshared": base, "shared": dataclasses.replace(base, packing=fnppo.batching.SharedPrefix())}
    rows = []
    for prompt_len in prompts:
        samples = make_samples(prompt_len, args, shape["vocab_size"])
        tokens = sum(len(s) for s in samples)
        times: dict = {(c, m): [] for c in ("train_step", "compute_logprobs") for m in configs}
        peaks: dict = {}
        logprobs: dict = {}
        for round_ in range(args.steps + 1):  # both packings' log-probs at the same weights, then both steps
            for call in ("compute_logprobs", "train_step"):
                for mode, step_cfg in configs.items():
                    if call == "train_step":
                        fn = lambda step_cfg=step_cfg: fnppo.train_step(state, samples, step_cfg)  # noqa: E731
                    else:
                        fn = lambda step_cfg=step_cfg: fnppo.compute_logprobs(state.model, samples, config=step_cfg)  # noqa: E731
                    seconds, peak, out = timed(fn, device)
                    if call == "train_step":
                        state = out[0]
                    else:
                        logprobs[mode] = out[0]
                    if round_:
                        times[(call, mode)].append(seconds)
                        peaks[(call, mode)] = max(peaks.get((call, mode)) or 0.0, peak or 0.0) if peak else None
                    print(f"prompt {prompt_len} round {round_} {mode} {call}: {seconds * 1e3:.1f} ms", flush=True)
        diff = max(float((a - b).abs().max()) for a, b in zip(logprobs["unshared"], logprobs["shared"], strict=True))
        for call in ("train_step", "compute_logprobs"):
            med = {m: statistics.median(times[(call, m)]) for m in configs}
            rows.append(
                {
                    "prompt": prompt_len,
                    "call": call,
                    "samples": len(samples),
                    "unshared_tokens": tokens,
                    "unshared_tok_per_s": tokens / med["unshared"],
                    "shared_tok_per_s": tokens / med["shared"],
                    "speedup": med["unshared"] / med["shared"],
                    "unshared_peak_gib": peaks.get((call, "unshared")),
                    "shared_peak_gib": peaks.get((call, "shared")),
                    "max_abs_logprob_diff": diff,
                }
            )
    return rows


def table(rows: list[dict], args: argparse.Namespace) -> str:
    head = (
        f"G={args.group_size} responses of {args.response_min}-{args.response_max} tokens per prompt, "
        f"{args.groups} prompts per step, {args.max_tokens} computed tokens per micro-batch\n\n"
        "| prompt | call | unshared tok/s | shared tok/s | speed-up | peak GiB unshared | peak GiB shared | largest log-prob difference |\n"
        "|---|---|---|---|---|---|---|---|\n"
    )

    def gib(v: float | None) -> str:
        return "-" if v is None else f"{v:.1f}"

    body = "".join(
        f"| {r['prompt']} | {r['call']} | {r['unshared_tok_per_s']:,.0f} | {r['shared_tok_per_s']:,.0f} | "
        f"{r['speedup']:.2f}x | {gib(r['unshared_peak_gib'])} | {gib(r['shared_peak_gib'])} | "
        f"{r['max_abs_logprob_diff']:.2e} |\n"
        for r in rows
    )
    return head + body


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    rows = run(args)
    print(table(rows, args))
    if args.out:
        path = Path(args.out) / "shared_prefix.json"
        path.write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
