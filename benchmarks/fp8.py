"""FP8 against BF16: step throughput and what FP8 does to the numbers, from the same weights.

For each precision in turn (one model in memory at a time) the script builds the model of
``benchmarks/step.py`` (``--model``; Transformer Engine's spec, random weights drawn by
``layout_invariant_init(seed=0)``, so both precisions start from identical weights), computes the
log-probs of a fixed evaluation set, then trains ``--steps`` steps of fnppo's ``train_step`` on a
fixed sequence of batches, recording every step's loss, gradient norm and time. It prints and writes
(``--json``) tokens/s (median step time over the steps after ``--warmup``), MFU against the measured
bf16 matrix-product rate and against the data-sheet peaks (989 TFLOP/s BF16, 1,979 FP8, for
H100/H200), the FP8/BF16 throughput ratio, the max and mean ``|log-prob(FP8) - log-prob(BF16)|``
over the evaluation tokens, and the two loss and gradient-norm curves side by side.

    python benchmarks/fp8.py --model qwen2.5-1.5b                     # one H200 with Transformer Engine
    python benchmarks/fp8.py --model qwen2.5-7b-12l --untied --mb-tokens 8192 --microbatches 4
    python benchmarks/fp8.py --smoke                                  # CPU: the BF16 half only (FP8 is refused there)

On CPU (``--smoke``, a tiny model in fp32) FP8 cannot run: the script runs the BF16-side code path
and reports FP8 as refused with fnppo's message, which is what CI checks.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import step as stepbench  # noqa: E402

import fnppo  # noqa: E402
from fnppo.core.errors import InputError  # noqa: E402

FP8_DATASHEET_TFLOPS = 1979.0


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="FP8 vs BF16 training step (throughput and numerics)")
    p.add_argument("--model", default="qwen2.5-1.5b", choices=sorted(stepbench.MODELS))
    p.add_argument("--untied", action="store_true")
    p.add_argument("--fp8", default="hybrid", choices=["e4m3", "hybrid"])
    p.add_argument("--recipe", default="tensorwise", choices=["tensorwise", "delayed", "blockwise"])
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--mb-tokens", type=int, default=8192)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--steps", type=int, default=20, help="training steps per precision (the curves)")
    p.add_argument("--warmup", type=int, default=3, help="steps left out of the time median")
    p.add_argument("--eval-samples", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--smoke", action="store_true", help="CPU, tiny model, 2 steps")
    p.add_argument("--json", default=None)
    return p.parse_args(argv)


def _step_args(args, fp8: str | None):
    argv = [
        "--model",
        args.model,
        "--seq",
        str(args.seq),
        "--mb-tokens",
        str(args.mb_tokens),
        "--microbatches",
        str(args.microbatches),
        "--device",
        "cpu" if args.smoke else "cuda",
        "--fp8",
        fp8 or "none",
        "--fp8-recipe",
        args.recipe,
    ]
    if args.untied:
        argv.append("--untied")
    if args.smoke:
        argv += ["--vocab", "256"]
    return stepbench.parse_args(argv)


def run_precision(args, fp8: str | None, layout, device, samples, evals) -> dict:
    sargs = _step_args(args, fp8)
    try:
        state = stepbench.build_state(sargs, layout)
    except InputError as err:
        return {"refused": str(err)}
    for opt in getattr(state.optimizer, "chained_optimizers", [state.optimizer]):
        for group in opt.param_groups:
            group["lr"] = args.lr
    cfg = stepbench.step_config("A", args.mb_tokens)
    lp, _ = fnppo.compute_logprobs(state.model, evals, config=cfg)
    out = {"eval_logprobs": torch.cat(lp).float().cpu(), "loss": [], "grad_norm": [], "step_s": []}
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    for i in range(args.steps):
        batch = samples[i % len(samples)]
        state, metrics, dt, _ = stepbench.timed_step(state, batch, cfg, device)
        out["loss"].append(float(metrics["loss"]))
        out["grad_norm"].append(float(metrics["grad_norm"]))
        out["step_s"].append(dt)
    out["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else 0.0
    del state
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.smoke:
        args.model, args.seq, args.mb_tokens, args.microbatches, args.steps, args.warmup = "tiny", 32, 64, 2, 2, 0
    device = torch.device("cpu" if args.smoke else "cuda")
    from fnppo.testing import megatron_on_cpu

    ctx = megatron_on_cpu() if device.type == "cpu" else contextlib.nullcontext()
    with ctx:
        layout = fnppo.init_parallel(1, 1, device=device.type, seed=0)
        try:
            return run(args, layout, device)
        finally:
            fnppo.megatron.parallel.destroy_parallel()


def run(args, layout, device) -> int:
    vocab = 256 if args.smoke else 151936
    per_step = args.microbatches * max(1, args.mb_tokens // args.seq)
    batches = [stepbench.make_samples(per_step, args.seq, vocab, seed=100 + i) for i in range(args.steps)]
    evals = stepbench.make_samples(args.eval_samples, args.seq, vocab, seed=7)
    peak = stepbench.matmul_peak_tflops(device) if device.type == "cuda" else None
    flops = stepbench.model_flops_per_token(stepbench.MODELS[args.model], vocab, args.seq)
    tokens = sum(len(s) for s in batches[0])
    result = {"model": args.model, "fp8": f"{args.fp8}:{args.recipe}", "tokens_per_step": tokens, "matmul_tflops": peak}
    for name, fp8 in (("bf16", None), ("fp8", args.fp8)):
        got = run_precision(args, fp8, layout, device, batches, evals)
        result[name] = got
        if "refused" in got:
            print(f"{name}: refused: {got['refused']}", flush=True)
            continue
        med = statistics.median(got["step_s"][args.warmup :])
        got["tokens_per_s"] = tokens / med
        if peak:
            got["mfu_measured"] = got["tokens_per_s"] * flops["flops_per_token"] / (peak * 1e12)
            got["mfu_datasheet_bf16"] = got["tokens_per_s"] * flops["flops_per_token"] / (989e12)
            got["mfu_datasheet_fp8"] = got["tokens_per_s"] * flops["flops_per_token"] / (FP8_DATASHEET_TFLOPS * 1e12)
        print(
            f"{name}: {got['tokens_per_s']:,.0f} tokens/s, step {med * 1e3:.1f} ms, peak {got['peak_gib']:.1f} GiB",
            flush=True,
        )
    bf, f8 = result["bf16"], result["fp8"]
    if "refused" not in f8 and "refused" not in bf:
        d = (f8["eval_logprobs"] - bf["eval_logprobs"]).abs()
        result["logprob_abs_diff_max"] = float(d.max())
        result["logprob_abs_diff_mean"] = float(d.mean())
        result["speedup_fp8_over_bf16"] = f8["tokens_per_s"] / bf["tokens_per_s"]
        print(
            f"FP8/BF16 {result['speedup_fp8_over_bf16']:.2f}x; |log-prob diff| max {result['logprob_abs_diff_max']:.4f}, "
            f"mean {result['logprob_abs_diff_mean']:.5f}",
            flush=True,
        )
        print("step  loss(bf16)  loss(fp8)  grad_norm(bf16)  grad_norm(fp8)")
        for i, (a, b, c, e) in enumerate(zip(bf["loss"], f8["loss"], bf["grad_norm"], f8["grad_norm"])):
            print(f"{i:4d}  {a:10.5f}  {b:9.5f}  {c:15.4f}  {e:14.4f}")
    for side in ("bf16", "fp8"):
        result[side].pop("eval_logprobs", None)
    if args.json:
        with open(args.json, "a") as f:
            f.write(json.dumps(result) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
