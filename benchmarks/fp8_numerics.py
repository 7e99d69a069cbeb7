"""What FP8 does to the forward numbers, layer by layer, from the same weights as BF16.

The model of ``benchmarks/step.py`` (``--model``; Transformer Engine's spec, random weights drawn by
``layout_invariant_init(seed=0)``) is built once in BF16 and once per FP8 variant: the recipes
``tensorwise`` (per-tensor current scaling), ``delayed`` (scales from an amax history) and
``blockwise`` (1x128 / 128x128 block scales), each also with the first and last layers kept in BF16
(Megatron's ``first_last_layers_bf16``; refused by Megatron for ``delayed``). For a fixed evaluation
set it records each layer's output hidden states and the output logits, and prints per variant:

* ``layer_rel_err``: ``||h_fp8 - h_bf16|| / ||h_bf16||`` of every layer's output (where the gap
  enters and how it grows with depth);
* ``kl``: the mean per-token ``KL(p_bf16 || p_fp8)`` over the full vocabulary, and its 99th
  percentile (the trainer/sampler mismatch an RL loss sees when the sampler runs BF16);
* ``logprob_abs_diff``: mean and max ``|log p_fp8 - log p_bf16|`` of the evaluation tokens;
* ``self_gap``: the same FP8 model on the same samples in another micro-batch composition (every
  sample alone against all in one): the mismatch when the sampler runs the same FP8 forward
  (per-tensor scales depend on the batch).

    python benchmarks/fp8_numerics.py --model qwen2.5-1.5b --json fp8_numerics.json     # one H200 with TE
    python benchmarks/fp8_numerics.py --smoke                                            # CPU: BF16 path only
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import step as stepbench  # noqa: E402

import fnppo  # noqa: E402
from fnppo.core.errors import InputError  # noqa: E402

VARIANTS = {
    "bf16": None,
    "tensorwise": ("tensorwise", None),
    "tensorwise+bf16-ends": ("tensorwise", "1,1"),
    "delayed": ("delayed", None),
    "blockwise": ("blockwise", None),
    "blockwise+bf16-ends": ("blockwise", "1,1"),
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="FP8 forward numerics against BF16 (per layer, KL, log-probs)")
    p.add_argument("--model", default="qwen2.5-1.5b", choices=sorted(stepbench.MODELS))
    p.add_argument("--untied", action="store_true")
    p.add_argument("--fp8", default="hybrid", choices=["e4m3", "hybrid"])
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated, of " + ", ".join(VARIANTS))
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--eval-samples", type=int, default=8)
    p.add_argument("--smoke", action="store_true", help="CPU, tiny model, the BF16 variant only")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    args.variants = [v for v in args.variants.split(",") if v]
    unknown = [v for v in args.variants if v not in VARIANTS]
    if unknown:
        p.error(f"--variants: unknown {unknown}")
    if "bf16" not in args.variants:
        args.variants.insert(0, "bf16")
    return args


def _state(args, variant: str, layout):
    fp8 = VARIANTS[variant]
    argv = ["--model", args.model, "--seq", str(args.seq), "--device", "cpu" if args.smoke else "cuda"]
    if fp8 is not None:
        argv += ["--fp8", args.fp8, "--fp8-recipe", fp8[0]]
        if fp8[1]:
            argv += ["--fp8-bf16-ends", fp8[1]]
    if args.untied:
        argv.append("--untied")
    if args.smoke:
        argv += ["--vocab", "256"]
    return stepbench.build_state(stepbench.parse_args(argv), layout)


def _record(state, samples, mb_tokens: int) -> dict:
    """Per-layer outputs and output logits (concatenated over micro-batches, on the device) and the
    evaluation log-probs, for ``samples`` in micro-batches of ``mb_tokens`` tokens."""
    core = fnppo.megatron.unwrap.unwrap_model(state.model[0])
    layers = {i: [] for i in range(len(core.decoder.layers))}
    logits: list[torch.Tensor] = []
    hooks = [
        layer.register_forward_hook(
            lambda m, a, out, i=i: layers[i].append((out[0] if isinstance(out, tuple) else out).detach().float())
        )
        for i, layer in enumerate(core.decoder.layers)
    ]
    hooks.append(core.output_layer.register_forward_hook(lambda m, a, out: logits.append(out[0].detach())))
    try:
        lp, _ = fnppo.compute_logprobs(state.model, samples, max_tokens_per_microbatch=mb_tokens)
    finally:
        for h in hooks:
            h.remove()
    flat = lambda ts: torch.cat([t.reshape(-1, t.shape[-1]) for t in ts])  # noqa: E731
    return {"layers": [flat(v) for v in layers.values()], "logits": flat(logits), "logprobs": torch.cat(lp).float()}


def _kl(ref: torch.Tensor, other: torch.Tensor, chunk: int = 2048) -> torch.Tensor:
    """Per-row ``KL(softmax(ref) || softmax(other))`` in fp32, chunked over rows."""
    out = []
    for i in range(0, ref.shape[0], chunk):
        a = torch.log_softmax(ref[i : i + chunk].float(), -1)
        b = torch.log_softmax(other[i : i + chunk].float(), -1)
        out.append((a.exp() * (a - b)).sum(-1))
    return torch.cat(out)


def compare(ref: dict, got: dict) -> dict:
    rel = [float((g - r).norm() / r.norm()) for r, g in zip(ref["layers"], got["layers"], strict=True)]
    kl = _kl(ref["logits"], got["logits"])
    d = (got["logprobs"] - ref["logprobs"]).abs()
    return {
        "layer_rel_err": [round(v, 5) for v in rel],
        "kl_mean": float(kl.mean()),
        "kl_p99": float(torch.quantile(kl.float().cpu(), 0.99)),
        "logprob_abs_diff_mean": float(d.mean()),
        "logprob_abs_diff_max": float(d.max()),
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.smoke:
        args.model, args.seq, args.eval_samples, args.variants = "tiny", 32, 4, ["bf16"]
    device = torch.device("cpu" if args.smoke else "cuda")
    from fnppo.testing import megatron_on_cpu

    ctx = megatron_on_cpu() if device.type == "cpu" else contextlib.nullcontext()
    with ctx:
        layout = fnppo.init_parallel(1, 1, device=device.type, seed=0)
        try:
            return run(args, layout)
        finally:
            fnppo.megatron.parallel.destroy_parallel()


def run(args, layout) -> int:
    vocab = 256 if args.smoke else 151936
    samples = stepbench.make_samples(args.eval_samples, args.seq, vocab, seed=7)
    whole = args.eval_samples * args.seq
    results: dict = {"model": args.model, "fp8": args.fp8, "tokens": whole, "variants": {}}
    ref = None
    for variant in args.variants:
        try:
            state = _state(args, variant, layout)
        except (InputError, ValueError) as err:
            results["variants"][variant] = {"refused": str(err).splitlines()[0]}
            print(f"{variant}: refused: {str(err).splitlines()[0]}", flush=True)
            continue
        rec = _record(state, samples, whole)
        if ref is None:
            ref = rec
            row = {"layers": len(rec["layers"])}
        else:
            row = compare(ref, rec)
        alone, _ = fnppo.compute_logprobs(state.model, samples, num_microbatches=len(samples))
        row["self_gap_max"] = float((torch.cat(alone).float() - rec["logprobs"]).abs().max())
        results["variants"][variant] = row
        print(f"{variant}: {json.dumps(row)}", flush=True)
        del state, rec
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
