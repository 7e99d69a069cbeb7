"""LoRA against full fine-tuning: step throughput and peak memory, and what the adapter-free reference saves.

The same model shapes, samples and timed step as ``benchmarks/step.py`` (random weights, bf16 on CUDA,
DDP + distributed Adam, path A's ``StepConfig``). For every configuration in turn (full fine-tuning,
then LoRA of each ``--ranks`` value on every linear, ``alpha = 2 r``), in one process with the
memory of the previous configuration released: tokens/s (median over the timed steps), step time,
the peak memory of the steps, the trainable parameters; a configuration that runs out of memory is
recorded as ``"OOM"`` and the next one runs. With LoRA it also measures the memory of the reference
policy: a second copy of the weights (``fnppo.models.snapshot_params``, what a full-weight run keeps
for the KL term) against ``fnppo.lora.adapters_off`` (the base model as a parameter set: one
expanded zero per adapter), and checks that the reference log-probs through ``adapters_off`` equal
those of the copy of the base weights.

    python benchmarks/lora.py --model qwen2.5-1.5b --ranks 32,64 --json lora.jsonl   # one GPU
    python benchmarks/lora.py --model qwen2.5-7b-12l --untied --ranks 32,64          # Qwen2.5-7B widths
    python benchmarks/lora.py --smoke                                                # tiny, CPU, seconds
    python benchmarks/lora.py --spec te --check-merged 2 --ranks 32                  # TE's layers (GPU)
    python benchmarks/lora.py --model qwen2.5-1.5b --ranks 32 --profile 25           # where a step's time goes
    python benchmarks/lora.py --model moe-5b-a1b --spec te --moe-experts stacked --ranks 32   # MoE, one H200
    python benchmarks/lora.py --smoke --model tiny-moe --moe-experts stacked         # MoE code path, CPU

MoE models: the adapters go on every linear, inside the experts too (``--moe-experts stacked``:
fnppo's stacked experts, each projection's per-expert adapters one more pair of grouped GEMMs;
``--expert-layout shared``: one adapter per projection for all experts of a layer).

``--json FILE`` appends one JSON line per configuration. On CUDA every configuration runs in a
process of its own (``--same-process`` to keep one), so that each peak memory is its own.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from batch_invariance import profile  # noqa: E402
from step import MODELS, layer_spec, make_samples, step_config, sync, timed_step  # noqa: E402

import fnppo  # noqa: E402

GIB = 2.0**30


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="LoRA vs full fine-tuning: tokens/s, peak memory, reference memory")
    p.add_argument("--model", choices=sorted(MODELS), default="qwen2.5-1.5b")
    p.add_argument("--ranks", default="32,64", help="LoRA ranks, comma-separated")
    p.add_argument("--no-full", action="store_true", help="skip the full fine-tuning configuration")
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--seq", type=int, default=2048, help="tokens per sample")
    p.add_argument("--mb-tokens", type=int, default=8192, help="micro-batch token budget")
    p.add_argument("--microbatches", type=int, default=4, help="micro-batches per step")
    p.add_argument("--steps", type=int, default=5, help="timed steps per configuration")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--untied", action="store_true", help="untied embeddings (Qwen2.5-7B's)")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument(
        "--spec",
        choices=["default", "local", "te"],
        default="default",
        help="layer spec: build_gpt's default (TE when installed), fnppo's local spec, or TE's (as benchmarks/step.py)",
    )
    p.add_argument(
        "--check-merged",
        type=int,
        default=0,
        metavar="LAYERS",
        help="first check, on a fp32 model of the same widths with LAYERS layers and random nonzero B, "
        "that the adapters' log-probs equal those of the merged weights W + s B A",
    )
    p.add_argument(
        "--moe-experts",
        choices=["auto", "stacked", "te_grouped", "sequential"],
        default="auto",
        help="ModelConfig.moe_experts of an MoE model (auto: the library's choice)",
    )
    p.add_argument(
        "--expert-layout",
        choices=["per_expert", "shared"],
        default="per_expert",
        help="LoRAConfig.expert_layout: an adapter per expert, or one shared by the experts of a layer",
    )
    p.add_argument(
        "--smoke",
        action="store_true",
        help="tiny model (or --model tiny-moe) on the CPU, one timed step: the code path only",
    )
    p.add_argument(
        "--same-process",
        action="store_true",
        help="measure every configuration in this process (on CUDA each runs in a process of its own by "
        "default: what one configuration leaves allocated would count in the next one's peak)",
    )
    p.add_argument("--json", default=None, help="append one JSON line per configuration to this file")
    p.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="N",
        help="also profile one step per configuration (torch.profiler) and print its N most expensive operations",
    )
    args = p.parse_args(argv)
    if args.smoke:
        args.model = args.model if args.model in ("tiny", "tiny-moe") else "tiny"
        args.device, args.vocab, args.seq, args.mb_tokens = "cpu", 64, 32, 64
        args.microbatches, args.steps, args.warmup, args.ranks = 2, 1, 1, "4,8"
    return args


def build(args, rank: int | None, *, dtype: str | None = None, layers: int | None = None):
    """The train state of one configuration: full weights (``rank`` None) or LoRA of ``rank``."""
    shape = dict(MODELS[args.model], **({"num_layers": layers} if layers else {}))
    cfg = fnppo.ModelConfig(
        vocab_size=args.vocab,
        max_seq_len=max(4096, args.seq),
        dtype=dtype or ("bf16" if args.device == "cuda" else "fp32"),
        tie_embeddings=not args.untied,
        add_qkv_bias=True,
        rotary_base=1_000_000.0,
        moe_experts=None if args.moe_experts == "auto" or "num_experts" not in shape else args.moe_experts,
        **shape,
    )
    chunks = fnppo.build_gpt(cfg, layer_spec=layer_spec(args, cfg))
    fnppo.models.layout_invariant_init(chunks, seed=0)
    if rank is not None:
        lora = fnppo.lora.LoRAConfig(rank=rank, alpha=2.0 * rank, expert_layout=args.expert_layout)
        fnppo.lora.apply_lora(chunks, lora)
    ddp = fnppo.wrap_ddp(chunks, use_distributed_optimizer=True)
    return fnppo.TrainState(model=ddp, optimizer=fnppo.build_optimizer(ddp, lr=1e-5, clip_grad=1.0))


def allocated(device) -> int:
    gc.collect()
    sync(device)
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0


def reference_memory(state, samples, cfg, device) -> dict:
    """Bytes of a full copy of the weights (a second reference model) against ``adapters_off``, and
    whether both give the same reference log-probs."""
    before = allocated(device)
    off = fnppo.lora.adapters_off(state.model)
    off_bytes = allocated(device) - before
    lp_off, _ = fnppo.compute_logprobs(state.model, samples, params=off, config=cfg)
    before = allocated(device)
    copy = fnppo.models.snapshot_params(state.model)
    copy_bytes = allocated(device) - before
    base = [{k: v for k, v in c.items() if not k.endswith("lora_B")} for c in copy]  # the copy, adapters off
    for c, o in zip(base, off, strict=True):
        c.update(o)
    lp_copy, _ = fnppo.compute_logprobs(state.model, samples, params=base, config=cfg)
    if device.type != "cuda":  # CPU: count the tensors instead
        copy_bytes = sum(t.numel() * t.element_size() for c in copy for t in c.values())
        off_bytes = sum(t.untyped_storage().nbytes() for c in off for t in c.values())
    del copy, base
    same = all(torch.equal(a, b) for a, b in zip(lp_off, lp_copy, strict=True))
    return {
        "reference_copy_gib": copy_bytes / GIB,
        "reference_adapters_off_gib": off_bytes / GIB,
        "same_logprobs": same,
    }


def merged_check(args, device) -> dict:
    """Max |log-prob difference| between the adapters' forward (``x W^T + s x A^T B^T``, every ``B``
    drawn at random) and the same modules with merged weights ``W + s B A`` and ``B = 0``, in fp32
    with ``args.check_merged`` layers: the adapters of this layer spec compute what PEFT's merge
    means. Also the spec's class of the fused QKV."""
    from fnppo.megatron.lora_linear import merged_delta

    rank = int(args.ranks.split(",")[0])
    state = build(args, rank, dtype="fp32", layers=args.check_merged)
    g = torch.Generator().manual_seed(3)
    adapted, merged = [], []
    qkv = None
    for chunk in state.model:
        core = fnppo.models.unwrap_model(chunk)
        a_set, m_set = {}, {}
        for name, module in core.named_modules():
            if not hasattr(module, "lora_B"):  # the linears' adapters (stacked experts keep theirs stacked)
                continue
            qkv = qkv or (type(module).__name__ if name.endswith("linear_qkv") else None)
            b = (torch.randn(module.lora_B.shape, generator=g) * 0.02).to(module.lora_B)
            a_set[f"{name}.lora_B"] = b
            m_set[f"{name}.lora_B"] = torch.zeros_like(b)
            m_set[f"{name}.weight"] = module.weight.detach() + merged_delta(module, b=b).to(module.weight)
        adapted.append(a_set)
        merged.append(m_set)
    samples = make_samples(2, min(args.seq, 512), args.vocab, seed=2)
    cfg = step_config("A", args.mb_tokens)
    lp_a, _ = fnppo.compute_logprobs(state.model, samples, params=adapted, config=cfg)
    lp_m, _ = fnppo.compute_logprobs(state.model, samples, params=merged, config=cfg)
    lp_0, _ = fnppo.compute_logprobs(state.model, samples, config=cfg)
    diff = max(float((a - m).abs().max()) for a, m in zip(lp_a, lp_m, strict=True))
    moved = max(float((a - z).abs().max()) for a, z in zip(lp_a, lp_0, strict=True))
    del state
    gc.collect()
    return {"check": "merged", "qkv_class": qkv, "max_abs_diff": diff, "adapter_effect": moved, "device": device.type}


def measure(args, rank: int | None, device) -> dict:
    row = {"model": args.model, "mode": "full" if rank is None else "lora", "rank": rank, "seq": args.seq}
    row.update(mb_tokens=args.mb_tokens, microbatches=args.microbatches, untied=args.untied, device=device.type)
    state = None
    try:
        state = build(args, rank)
        core = fnppo.models.unwrap_model(state.model[0])
        row["trainable_params"] = sum(p.numel() for p in core.parameters() if p.requires_grad)
        row["params"] = sum(p.numel() for p in core.parameters())
        n = args.microbatches * max(1, args.mb_tokens // args.seq)
        samples = make_samples(n, args.seq, args.vocab, seed=1)
        cfg = step_config("A", args.mb_tokens)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        times = []
        for i in range(args.warmup + args.steps):
            state, metrics, seconds, _ = timed_step(state, samples, cfg, device)
            if i >= args.warmup:
                times.append(seconds)
        step_s = statistics.median(times)
        tokens = sum(len(s) for s in samples)
        row.update(status="ok", step_s=step_s, tokens_per_s=tokens / step_s, loss=metrics["loss"])
        row["peak_gib"] = torch.cuda.max_memory_allocated(device) / GIB if device.type == "cuda" else None
        if args.profile:
            box = [state]

            def one_step():
                box[0], _ = fnppo.train_step(box[0], samples, cfg)

            print(f"== profile: {row['mode']} rank {rank}", flush=True)
            row["profile"] = profile(one_step, args.profile)
            state = box[0]
        if rank is not None:
            row.update(reference_memory(state, samples[:2], cfg, device))
    except torch.OutOfMemoryError:
        row.update(status="OOM")
    finally:
        del state
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return row


def isolated(argv: list[str], configs: list[int | None]) -> int:
    """Run every configuration in a fresh process of this script (its own CUDA context, so its peak
    memory is its own), the merged check in the first one only; rows go to ``--json`` as usual."""
    for i, rank in enumerate(configs):
        only = ["--ranks", ""] if rank is None else ["--no-full", "--ranks", str(rank)]
        extra = [] if i == 0 else ["--check-merged", "0"]
        cmd = [sys.executable, os.path.abspath(__file__), *argv, *only, *extra, "--same-process"]
        rc = subprocess.run(cmd, check=False).returncode
        if rc != 0:
            print(f"configuration {'full' if rank is None else f'LoRA r={rank}'} exited with {rc}", flush=True)
            return rc
    return 0


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    device = torch.device(args.device)
    ranks = [int(r) for r in args.ranks.split(",") if r]
    configs = ([] if args.no_full else [None]) + ranks
    if device.type == "cuda" and len(configs) > 1 and not args.same_process:
        return isolated(argv, configs)
    from fnppo.testing import megatron_on_cpu

    ctx = megatron_on_cpu() if device.type == "cpu" else contextlib.nullcontext()
    rows = []
    with ctx:
        fnppo.init_parallel(1, 1, device=args.device, seed=0)
        try:
            if args.check_merged:
                row = merged_check(args, device)
                rows.append(row)
                print(
                    f"merged check ({row['qkv_class']}, fp32, {args.check_merged} layers): max |log-prob diff| "
                    f"{row['max_abs_diff']:.2e} (the adapters move log-probs by up to {row['adapter_effect']:.2e})",
                    flush=True,
                )
            for rank in configs:
                row = measure(args, rank, device)
                rows.append(row)
                what = "full" if rank is None else f"LoRA r={rank}"
                if row["status"] != "ok":
                    print(f"{args.model} {what}: {row['status']}", flush=True)
                    continue
                peak = "n/a" if row["peak_gib"] is None else f"{row['peak_gib']:.1f} GiB"
                ref = (
                    ""
                    if rank is None
                    else f", reference: copy {row['reference_copy_gib']:.2f} GiB vs adapters_off "
                    f"{row['reference_adapters_off_gib']:.4f} GiB (same log-probs: {row['same_logprobs']})"
                )
                print(
                    f"{args.model} {what}: {row['tokens_per_s']:.0f} tokens/s, step {row['step_s']:.3f} s, "
                    f"peak {peak}, trainable {row['trainable_params']:,} of {row['params']:,}{ref}",
                    flush=True,
                )
        finally:
            fnppo.megatron.parallel.destroy_parallel()
    if args.json:
        with open(args.json, "a", encoding="utf-8") as fh:
            for row in rows:
                fh.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
