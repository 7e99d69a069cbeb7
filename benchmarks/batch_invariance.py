"""Batch invariance on one device: one set of samples through many compositions, and the mode's cost.

For each model (random weights, ``layout_invariant_init``) built with
``ModelConfig(batch_invariant=True)`` (``--deterministic``: with ``deterministic=True`` too, in both
modes; MoE models run under torch's deterministic algorithms in the mode either way), the same samples of
varied lengths go through ``compute_logprobs`` (with entropies) in several compositions:

* ``one``: one packed micro-batch (the reference);
* ``shuffled``: the samples in another order, two micro-batches;
* ``budget``: a token budget of about the longest sample (many micro-batches, other companions);
* ``alone``: every sample in its own micro-batch;
* ``padded``: the padded layout, three micro-batches;

and through ``train_step`` with ``old_logprobs`` from ``one`` (``onpolicy/max_abs_logprob_diff``
and ``onpolicy/max_abs_ratio_minus_1`` of its first, pre-update forward). It prints, per
composition, the number of log-prob and entropy values whose bits differ from ``one`` and the
largest difference (all must be 0), then the cost: the median ``train_step`` and ``compute_logprobs``
time in the mode over the same model built without it (``time_ratio``).

Models: ``qwen2.5-0.5b`` and ``qwen2.5-1.5b`` shapes (hidden, heads, groups, FFN, vocabulary of
Qwen2.5; ``--layers`` of them, fewer than the real 24 / 28 by default), ``moe`` (a small MoE:
hidden 1,024, 16 heads / 4 groups, 16 experts of FFN 512, top-4, every layer), and ``tiny`` /
``tiny-moe`` for ``--smoke`` (CPU, fp32, seconds).

    python benchmarks/batch_invariance.py                                  # one GPU: 0.5b, 1.5b, moe (bf16)
    python benchmarks/batch_invariance.py --spec te                        # Transformer Engine's spec
    python benchmarks/batch_invariance.py --kernels torch                  # fnppo's torch kernels only
    python benchmarks/batch_invariance.py --smoke --json out.json          # CPU, tiny shapes (CI)
    python benchmarks/batch_invariance.py --models qwen2.5-1.5b --profile 15   # where the time goes
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

import torch

import fnppo
from fnppo.megatron.config import kernels_named, resolve_kernels
from fnppo.megatron.numerics import megatron_invariant_kernels

MODELS = {
    "qwen2.5-0.5b": dict(
        hidden_size=896, num_attention_heads=14, num_query_groups=2, ffn_hidden_size=4864, vocab_size=151_936
    ),
    "qwen2.5-1.5b": dict(
        hidden_size=1536, num_attention_heads=12, num_query_groups=2, ffn_hidden_size=8960, vocab_size=151_936
    ),
    "moe": dict(
        hidden_size=1024,
        num_attention_heads=16,
        num_query_groups=4,
        ffn_hidden_size=2048,
        vocab_size=151_936,
        num_experts=16,
        moe_topk=4,
        moe_ffn_hidden_size=512,
    ),
    "tiny": dict(hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=128, vocab_size=96),
    "tiny-moe": dict(
        hidden_size=64,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=128,
        vocab_size=96,
        num_experts=4,
        moe_topk=2,
        moe_ffn_hidden_size=32,
    ),
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=None, help="comma-separated, of " + ", ".join(MODELS))
    p.add_argument("--layers", type=int, default=None, help="layers per model (default: 4 on GPU, 2 with --smoke)")
    p.add_argument("--samples", type=int, default=None, help="samples (default: 16 on GPU, 6 with --smoke)")
    p.add_argument("--max-len", type=int, default=None, help="longest sample (default: 1,024 on GPU, 14 with --smoke)")
    p.add_argument(
        "--spec", choices=["local", "te"], default="local", help="fnppo's local spec or Transformer Engine's"
    )
    p.add_argument("--steps", type=int, default=3, help="timed train_step calls per mode")
    p.add_argument("--smoke", action="store_true", help="CPU, fp32, tiny shapes")
    p.add_argument(
        "--kernels",
        choices=["fast", "torch", "megatron"],
        default=None,
        help="the CUDA mode's kernels, an InvariantKernels record by name (default: FNPPO_BATCH_INVARIANT_KERNELS if "
        "set, else the platform's): the library's with small products padded "
        "(fast), fnppo's fixed-tile torch kernels (torch), Megatron-core's Triton matmul and TE patches (megatron); "
        "default: fast",
    )
    p.add_argument("--min-len", type=int, default=None, help="shortest sample (default: a quarter of --max-len)")
    p.add_argument(
        "--probe",
        action="store_true",
        help="first check, product by product, at which row counts the library GEMMs of each model give a row "
        "other bits than in a 16,384-row product",
    )
    p.add_argument(
        "--deterministic",
        action="store_true",
        help="build every model with ModelConfig(deterministic=True) (Megatron's deterministic_mode), in both modes",
    )
    p.add_argument("--json", default=None, help="write the results to this file")
    p.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="N",
        help="also profile one train_step and one compute_logprobs per mode (torch.profiler) and print their N most expensive operations",
    )
    args = p.parse_args(argv)
    args.models = args.models or ("tiny,tiny-moe" if args.smoke else "qwen2.5-0.5b,qwen2.5-1.5b,moe")
    unknown = [m for m in args.models.split(",") if m not in MODELS]
    if unknown:
        p.error(f"--models: unknown {unknown}")
    args.layers = args.layers or (2 if args.smoke else 4)
    args.samples = args.samples or (6 if args.smoke else 16)
    args.max_len = args.max_len or (14 if args.smoke else 1024)
    args.min_len = args.min_len or max(4, args.max_len // 4)
    return args


def make_samples(n: int, max_len: int, vocab: int, seed: int = 0, min_len: int | None = None) -> list[fnppo.Sample]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        total = int(torch.randint(min_len or max(4, max_len // 4), max_len + 1, (), generator=g))
        prompt = max(2, total // 3)
        r = total - prompt
        out.append(
            fnppo.Sample(
                prompt_ids=torch.randint(0, vocab, (prompt,), generator=g),
                response_ids=torch.randint(0, vocab, (r,), generator=g),
                advantages=torch.randn(r, generator=g),
            )
        )
    return out


def build(name: str, args, invariant: bool):
    fields = dict(MODELS[name])
    cfg = fnppo.ModelConfig(
        num_layers=args.layers,
        max_seq_len=args.max_len,
        dtype="fp32" if args.smoke else "bf16",
        batch_invariant=chosen_kernels(args, "cpu" if args.smoke else "cuda") if invariant else False,
        deterministic=args.deterministic,
        **fields,
    )
    spec = fnppo.models.default_layer_spec(cfg) if args.spec == "te" else fnppo.models.local_layer_spec(cfg)
    chunks = fnppo.build_gpt(cfg, layer_spec=spec)
    fnppo.models.layout_invariant_init(chunks, seed=1)
    ddp = fnppo.wrap_ddp(chunks)
    return fnppo.TrainState(model=ddp, optimizer=fnppo.build_optimizer(ddp, lr=1e-5))


def compositions(n: int, max_len: int) -> dict[str, dict]:
    """The compositions each sample's values are compared across (``one`` is the reference)."""
    order = list(range(n))
    random.Random(0).shuffle(order)
    out = {
        "one": {},
        "shuffled": {"order": order, "num_microbatches": 2},
        "budget": {"max_tokens_per_microbatch": max_len + 1},
        "alone": {"num_microbatches": n},
        "mixed": {"others": 6, "num_microbatches": 3},
        "padded": {"layout": "padded", "num_microbatches": 3},
    }
    for budget in (4096, 16384):
        if budget > max_len:
            out[f"budget{budget}"] = {"max_tokens_per_microbatch": budget}
    return out


def logprobs(state, samples, comp, vocab: int):
    """Log-probs and entropies of ``samples`` in composition ``comp``, in the order of ``samples``
    (``others``: that many other samples are mixed in and their values dropped)."""
    comp = dict(comp)
    order = comp.pop("order", None)
    others = comp.pop("others", 0)
    batch = samples if order is None else [samples[i] for i in order]
    if others:
        extra = make_samples(others, max(len(s) for s in samples), vocab, seed=7, min_len=8)
        batch = [x for pair in zip(batch, extra + [None] * len(batch)) for x in pair if x is not None]
        keep = [i for i, x in enumerate(batch) if any(x is s for s in samples)]
    lp, ent = fnppo.compute_logprobs(state.model, batch, with_entropy=True, **comp)
    if others:
        lp, ent = [lp[i] for i in keep], [ent[i] for i in keep]
    if order is not None:
        back = sorted(zip(order, lp, ent), key=lambda t: t[0])
        lp, ent = [t[1] for t in back], [t[2] for t in back]
    return lp, ent


def probe_products(name: str) -> dict:
    """Row counts at which each product of ``name``'s shapes (bf16, CUDA's library GEMM) gives a row
    other bits than the same row in a 16,384-row product."""
    f = MODELS[name]
    h, heads, groups = f["hidden_size"], f["num_attention_heads"], f["num_query_groups"]
    kv = h // heads * groups
    ffn = f.get("moe_ffn_hidden_size") or f["ffn_hidden_size"]
    shapes = {
        "qkv": (h, h + 2 * kv),
        "proj": (h, h),
        "fc1": (h, 2 * ffn),
        "fc2": (ffn, h),
        "output": (h, f["vocab_size"]),
    }
    rows = [1, 3, 7, 50, 128, 333, 1000, 2048, 3001, 4096, 8192, 16384]
    g = torch.Generator(device="cuda").manual_seed(0)
    out = {}
    for key, (k, n) in shapes.items():
        x = torch.randn(16384, k, device="cuda", dtype=torch.bfloat16, generator=g)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g) / k**0.5
        ref = torch.nn.functional.linear(x, w)
        out[key] = [m for m in rows if not torch.equal(torch.nn.functional.linear(x[:m], w), ref[:m])]
    return out


def probe_moe(name: str, trials: int = 12) -> dict:
    """An MoE model's two other products, on CUDA: the router's (fp32, as few columns as experts), as
    row counts at which ``torch.mm`` gives a row other bits than in a 16,384-row product, ordinary and
    in fixed tiles (:func:`fnppo.core.kernels.invariant.invariant_router_logits`); and the experts' grouped GEMM
    (:func:`fnppo.ops.grouped_matmul`, bf16): the bits of 64 fixed rows of one expert, placed at random
    offsets among random group sizes of 2,048 to 40,000 rows in all, against their first placement."""
    from fnppo.core.kernels.invariant import invariant_router_logits

    f = MODELS[name]
    h, e, ffn = f["hidden_size"], f["num_experts"], f["moe_ffn_hidden_size"]
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(16384, h, device="cuda", dtype=torch.bfloat16, generator=g)
    w = torch.randn(e, h, device="cuda", dtype=torch.bfloat16, generator=g) / h**0.5
    ref = torch.mm(x.float(), w.float().t())
    tiled = invariant_router_logits(x, w, None, torch.float32)
    rows = [1, 3, 7, 50, 128, 333, 1000, 2048, 3001, 4096, 8192, 12000]
    out = {
        "router_mm": [m for m in rows if not torch.equal(torch.mm(x[:m].float(), w.float().t()), ref[:m])],
        "router_tiled": [
            m for m in rows if not torch.equal(invariant_router_logits(x[:m], w, None, torch.float32), tiled[:m])
        ],
    }
    cpu = torch.Generator().manual_seed(1)
    expert = e // 2
    for key, (k, n) in {"experts_fc1": (h, 2 * ffn), "experts_fc2": (ffn, h)}.items():
        weight = torch.randn(e, n, k, device="cuda", dtype=torch.bfloat16, generator=g) / k**0.5
        probe = torch.randn(64, k, device="cuda", dtype=torch.bfloat16, generator=g)
        first, bits = None, []
        for trial in range(trials):
            total = int(torch.randint(2048, 40000, (), generator=cpu))
            sizes = torch.multinomial(torch.rand(e, generator=cpu), total, replacement=True, generator=cpu)
            sizes = sizes.bincount(minlength=e)
            if trial == 1:
                sizes[expert] = 0  # the probe rows alone in their group
            offset = int(torch.randint(0, int(sizes[expert]) + 1, (), generator=cpu))
            start = int(sizes[:expert].sum()) + offset
            others = torch.randn(int(sizes.sum()), k, device="cuda", dtype=torch.bfloat16, generator=g)
            rows_x = torch.cat([others[:start], probe, others[start:]])
            sizes[expert] += 64
            ends = torch.cumsum(sizes, 0).to(device="cuda", dtype=torch.int32)
            y = fnppo.ops.grouped_matmul(rows_x, weight, ends)[start : start + 64]
            first = y if first is None else first
            bits.append(int((y != first).sum()))
        out[key] = bits
    return out


def differ(ref, got) -> tuple[int, float]:
    bits = sum(int((a != b).sum()) for a, b in zip(ref, got, strict=True))
    gap = max(float((a.double() - b.double()).abs().max()) if a.numel() else 0.0 for a, b in zip(ref, got))
    return bits, gap


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def profile(fn, top: int) -> list[dict]:
    """The ``top`` operations of one call of ``fn`` by self time on the device (CPU time on CPU),
    printed as a table and returned as rows (name, calls, self device ms, self CPU ms)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with torch_profile(activities=acts) as prof:
        t0 = time.perf_counter()
        fn()
        sync()
        wall = time.perf_counter() - t0
    key = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    events = prof.key_averages()
    print(events.table(sort_by=key, row_limit=top, max_name_column_width=70), flush=True)
    rows = sorted(
        events, key=lambda e: getattr(e, key.replace("cuda", "device"), 0) or getattr(e, key, 0), reverse=True
    )
    kernels = sum(getattr(e, "self_device_time_total", 0) for e in events) / 1e3
    split = {"wall_ms": wall * 1e3, "device_kernels_ms": kernels}
    print(f"profiled step: {wall * 1e3:.1f} ms wall, {kernels:.1f} ms of device kernels", flush=True)
    return [
        {
            "name": e.key,
            "calls": e.count,
            "self_device_ms": getattr(e, "self_device_time_total", 0) / 1e3,
            "self_cpu_ms": e.self_cpu_time_total / 1e3,
        }
        for e in rows[:top]
    ], split


def measure(name: str, args) -> dict:
    vocab = MODELS[name]["vocab_size"]
    samples = make_samples(args.samples, args.max_len, vocab, min_len=args.min_len)
    loss = fnppo.losses.LossConfig(policy=fnppo.losses.ppo_clip(), agg=fnppo.losses.Aggregation("token-mean"))
    budget = {"max_tokens_per_microbatch": max(4 * args.max_len, 64)}
    out: dict = {"layers": args.layers, "samples": args.samples, "tokens": sum(len(s) for s in samples)}
    times = {}
    for invariant in (True, False):
        state = build(name, args, invariant)
        if invariant:
            results = {}
            for k, c in compositions(args.samples, args.max_len).items():
                try:
                    results[k] = logprobs(state, samples, c, vocab)
                except fnppo.InputError as e:  # a composition the mode refuses (the padded layout under TE)
                    out.setdefault("refused", {})[k] = str(e).splitlines()[0]
            ref = results["one"]
            for k, (lp, ent) in results.items():
                out[k] = {"logprob": differ(ref[0], lp), "entropy": differ(ref[1], ent)}
            batch = [dataclasses.replace(s, old_logprobs=o) for s, o in zip(samples, ref[0])]
            _, metrics = fnppo.train_step(state, batch, fnppo.StepConfig(loss=loss, **budget))
            out["train_step"] = {
                k: metrics[k] for k in ("onpolicy/max_abs_logprob_diff", "onpolicy/max_abs_ratio_minus_1")
            }
        else:
            lp, _ = fnppo.compute_logprobs(state.model, samples, **budget)
            batch = [dataclasses.replace(s, old_logprobs=o) for s, o in zip(samples, lp)]
        step = lambda: fnppo.train_step(state, batch, fnppo.StepConfig(loss=loss, **budget))  # noqa: E731, F821
        infer = lambda: fnppo.compute_logprobs(state.model, samples, **budget)  # noqa: E731, F821
        step()  # warm-ups (compilations, autotuning): the forward-only call compiles its own kernels
        infer()
        times[invariant] = (timed(step, args.steps), timed(infer, args.steps))
        if args.profile:
            mode = "invariant" if invariant else "normal"
            for what, fn in (("train_step", step), ("compute_logprobs", infer)):
                print(f"-- {what}, {mode}", flush=True)
                rows, split = profile(fn, args.profile)
                key = "" if what == "train_step" else "_compute_logprobs"
                out.setdefault(f"profile{key}", {})[mode] = rows
                out.setdefault(f"profile_split{key}", {})[mode] = split
        del state
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    out["train_step_s"] = {"invariant": times[True][0], "normal": times[False][0]}
    out["compute_logprobs_s"] = {"invariant": times[True][1], "normal": times[False][1]}
    out["time_ratio"] = {
        "train_step": times[True][0] / times[False][0],
        "compute_logprobs": times[True][1] / times[False][1],
    }
    names = compositions(args.samples, args.max_len)
    out["max_bits_differing"] = max(max(v["logprob"][0], v["entropy"][0]) for k, v in out.items() if k in names)
    out["max_abs_diff"] = max(max(v["logprob"][1], v["entropy"][1]) for k, v in out.items() if k in names)
    return out


def chosen_kernels(args: argparse.Namespace, device: str):
    """The InvariantKernels record ``--kernels`` names, else the platform's (``batch_invariant=True``)."""
    return kernels_named(args.kernels) if args.kernels else resolve_kernels(True, cuda=device == "cuda")


def main(argv=None) -> int:
    args = parse_args(argv)
    # this script's default for the record, from the environment: the library reads no variable
    args.kernels = args.kernels or os.environ.get("FNPPO_BATCH_INVARIANT_KERNELS") or None
    device = "cpu" if args.smoke else "cuda"
    if args.kernels == "megatron" and device == "cuda" and megatron_invariant_kernels() is None:
        print("--kernels megatron: Megatron-core's Triton kernels do not import here", file=sys.stderr)
        return 2
    results = {}
    if args.probe and device == "cuda":
        for name in args.models.split(","):
            results.setdefault("probe", {})[name] = p = probe_products(name)
            if "num_experts" in MODELS[name]:
                p.update(probe_moe(name))
            print(f"probe {name}: row counts with other bits per product {p}", flush=True)
    fnppo.init_parallel(1, 1, device=device, seed=0)
    try:
        for name in args.models.split(","):
            kernels = chosen_kernels(args, device).name
            results[name] = r = measure(name, args)
            r["kernels"] = kernels
            print(
                f"{name} ({args.layers} layers, {args.spec} spec, {kernels} kernels): values with other bits {r['max_bits_differing']}, "
                f"max |diff| {r['max_abs_diff']:.3g}; train_step on-policy gaps {r['train_step']}; "
                f"time invariant/normal: train_step {r['time_ratio']['train_step']:.2f}x "
                f"({r['train_step_s']['invariant']:.3f} s / {r['train_step_s']['normal']:.3f} s), "
                f"compute_logprobs {r['time_ratio']['compute_logprobs']:.2f}x",
                flush=True,
            )
            print(json.dumps(r), flush=True)
    finally:
        fnppo.megatron.parallel.destroy_parallel()
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")
    bad = [n for n, r in results.items() if n != "probe" and (r["max_bits_differing"] or any(r["train_step"].values()))]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
