"""Whole training step: fnppo's ``train_step`` (A) against the loss path of a popular stateful actor (B).

Same process, same Megatron GPTModel (bf16, DDP + distributed Adam), same schedule and
micro-batches; steps of the paths alternate. B differs only in the stages: the actor's own log-prob,
entropy and loss, written from scratch in ``benchmarks/actor_baseline.py`` and dropped into
``train_step`` through ``StepFns``:

* log-probs from Megatron's ``vocab_parallel_cross_entropy`` on a *clone* of the logits,
* entropy from a vocab-parallel entropy whose softmax buffer is reused in place in backward,
* the vanilla (dual-clip) PPO loss with one global token normalizer, k3 KL to the reference.

Path C is A with ``StepConfig(fns=StepFns.fused())``: the last stage stops before the output layer and
``linear_logprob_and_entropy`` computes log-probs and entropy from the hidden states and the output
weight, never materializing the logits. Path D is C with ``StepFns.fused(graphs=fnppo.ops.BackwardGraphs())``
(the fused backward replayed as a CUDA graph).

Prints: tokens/s (median over the timed steps), model FLOPs utilization (MFU: model FLOPs per token
times tokens/s over the bf16 matrix-product rate measured in the same run), peak memory,
first-step log-probs of the paths, flex-attention compilations, and (``--search``) the largest
micro-batch token budget that fits for each path. ``--spec`` picks the layer spec (``te`` needs
Transformer Engine), ``--fusions off`` builds the model without Megatron's fused kernels, ``--checks
on`` keeps fnppo's call-time checks (host syncs) on during the timed steps, ``--profile FILE``
writes a torch.profiler summary of one step per path, ``--recompute full|selective`` (with
``--recompute-modules``) turns on Megatron's activation recomputation, ``--fused-chunk-vocab N``
sets path C's ``StepFns.fused(chunk_vocab=N)``, and ``--rotate`` starts each round of steps
with the next path and collects Python's garbage before every step, outside its time (the JSON has
every step's time and, per path, the median over rounds of A's step time over the path's). Every
step also records the time until ``train_step`` returned, the garbage collector's time, the caching
allocator's device allocations and a host-speed probe (a fixed pure-Python loop timed just before
the step), and ``--host-profile FILE`` writes a cProfile summary of one step per path;
``benchmarks/step_stats.py`` summarizes the JSON lines across runs.

    python benchmarks/step.py --model tiny --device cpu                       # anywhere (CPU)
    python benchmarks/step.py --model tiny-moe --device cpu                   # the MoE code path on CPU
    python benchmarks/step.py --model qwen2.5-0.5b --search                   # one GPU
    python benchmarks/step.py --model moe-5b-a1b --paths A,C                  # an MoE policy on one H200
    torchrun --nproc-per-node 2 benchmarks/step.py --model qwen2.5-0.5b --tp 2 # two GPUs

Mixture of Experts: a token passes the attention, the router and its top-k experts (and a shared
expert), so the model FLOPs count the *active* matrix weights (``matmul_params``; MFU by active
parameters), while the memory holds all of them (``params_total``). The MoE shape ``moe-5b-a1b``
(hidden 2,048, 16 layers, 16 heads of 128, 4 KV groups, 64 experts of FFN 768, top-8 in every layer,
vocab 151,936, tied) has 5.31e9 parameters, 1.09e9 active matrix weights per token (0.31e9 of them
the output layer) and 6.9e9 model FLOPs per token at 2,048-token samples. Its static memory on one
GPU (bf16 weights 2 B, fp32 gradient buffer 4 B, fp32 main weights and Adam moments 12 B per
parameter; DP=1: ``static_memory_gib_estimate``) is 89 GiB; activations of an 8,192-token
micro-batch add about 1 GiB per layer and a few logits copies (2.3 GiB each): it fits an H200. The
24-layer shape of the same width would need 131 GiB before any activation: it does not. Without
Transformer Engine the experts run as Megatron's ``SequentialMLP`` (one small GEMM per expert).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))

from actor_baseline import actor_fns  # noqa: E402

import fnppo  # noqa: E402

MODELS = {
    # Qwen2.5 shapes (random weights): hidden, layers, heads, kv groups, ffn, vocab; tied embeddings.
    "qwen2.5-0.5b": dict(
        hidden_size=896, num_layers=24, num_attention_heads=14, num_query_groups=2, ffn_hidden_size=4864
    ),
    "qwen2.5-1.5b": dict(
        hidden_size=1536, num_layers=28, num_attention_heads=12, num_query_groups=2, ffn_hidden_size=8960
    ),
    # Qwen2.5-7B's widths with 12 of its 28 layers (its full size does not fit one H200 with Adam);
    # untied embeddings as the real model
    "qwen2.5-7b-12l": dict(
        hidden_size=3584, num_layers=12, num_attention_heads=28, num_query_groups=4, ffn_hidden_size=18944
    ),
    "tiny": dict(hidden_size=64, num_layers=2, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=128),
    # Mixture of Experts (Qwen3-MoE-like widths, every layer MoE): see the module docstring for its memory
    "moe-5b-a1b": dict(
        hidden_size=2048,
        num_layers=16,
        num_attention_heads=16,
        num_query_groups=4,
        kv_channels=128,
        ffn_hidden_size=768,
        num_experts=64,
        moe_topk=8,
        moe_ffn_hidden_size=768,
    ),
    # Qwen3-30B-A3B's widths (128 experts of FFN 768, top-8, 32 heads of 128, 4 KV groups) with 8 of its
    # 48 layers: 5.3e9 parameters, what fits one H200 with Adam
    "qwen3-30b-a3b-8l": dict(
        hidden_size=2048,
        num_layers=8,
        num_attention_heads=32,
        num_query_groups=4,
        kv_channels=128,
        ffn_hidden_size=768,
        num_experts=128,
        moe_topk=8,
        moe_ffn_hidden_size=768,
    ),
    "tiny-moe": dict(
        hidden_size=64,
        num_layers=2,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=128,
        num_experts=4,
        moe_topk=2,
        moe_ffn_hidden_size=32,
    ),
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
    p.add_argument("--sp", action="store_true", help="sequence parallelism (with --tp > 1)")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument(
        "--spec",
        choices=["default", "local", "te"],
        default="default",
        help="layer spec: build_gpt's default (TE when installed), fnppo's local spec, or TE's",
    )
    p.add_argument(
        "--fusions", choices=["auto", "on", "off"], default="auto", help="ModelConfig.fusions (auto: on with CUDA)"
    )
    p.add_argument("--checks", choices=["on", "off"], default="off", help="fnppo's call-time checks during the steps")
    p.add_argument(
        "--moe-experts",
        choices=["auto", "stacked", "te_grouped", "sequential"],
        default="auto",
        help="ModelConfig.moe_experts (auto: the library's choice)",
    )
    p.add_argument("--fp8", choices=["none", "e4m3", "hybrid"], default="none", help="ModelConfig.fp8")
    p.add_argument("--fp8-recipe", choices=["tensorwise", "delayed", "blockwise"], default="tensorwise")
    p.add_argument(
        "--fp8-bf16-ends",
        default=None,
        metavar="START,END",
        help="with --fp8: keep the first START and last END layers in BF16 (Megatron's first_last_layers_bf16)",
    )
    p.add_argument("--deterministic", action="store_true", help="ModelConfig(deterministic=True)")
    p.add_argument("--untied", action="store_true", help="untied embeddings (Qwen2.5-7B's)")
    p.add_argument(
        "--recompute",
        choices=["none", "full", "selective"],
        default="none",
        help="activation recomputation: full = Megatron's recompute_granularity='full' (uniform, 1 layer per checkpoint); "
        "selective = recompute_granularity='selective' with --recompute-modules",
    )
    p.add_argument(
        "--recompute-modules",
        default="mlp",
        help="comma-separated recompute_modules of --recompute selective (Megatron's names: mlp, layernorm, core_attn, moe, ...)",
    )
    p.add_argument(
        "--fused-chunk-vocab",
        type=int,
        default=None,
        help="path C: StepFns.fused(chunk_vocab=N) (vocabulary rows per block of the fused backward)",
    )
    p.add_argument("--overlap", action="store_true", help="DDP overlap_grad_reduce (data parallelism)")
    p.add_argument("--search", action="store_true", help="find the largest micro-batch budget per path")
    p.add_argument("--search-max", type=int, default=262144)
    p.add_argument(
        "--search-seq",
        action="store_true",
        help="find the longest single sequence (one sample = one micro-batch) that trains, per path",
    )
    p.add_argument("--search-seq-max", type=int, default=524288)
    p.add_argument("--search-seq-unit", type=int, default=4096, help="bisection step of --search-seq (tokens)")
    p.add_argument("--paths", default="A,B,C")
    p.add_argument(
        "--rotate",
        action="store_true",
        help="each round of steps starts with the next path, and Python's garbage is collected before every step (outside its time)",
    )
    p.add_argument(
        "--host-profile", help="write a cProfile summary (host Python time) of one step per path to this file"
    )
    p.add_argument("--profile", default=None, help="write a torch.profiler summary of one step per path to this file")
    p.add_argument("--sync-report", default=None, help="write where one step of each path synchronizes with the device")
    p.add_argument("--json", default=None, help="append the results as one JSON line to this file")
    return p.parse_args(argv)


# ---------------------------------------------------------------------------------------------
# model FLOPs and the measured matrix-product rate
# ---------------------------------------------------------------------------------------------
def model_flops_per_token(shape: dict, vocab: int, seq: int) -> dict[str, float]:
    """Training FLOPs per token: ``6 N`` for the matrix-product weights a token passes (``N``: Q, K,
    V, output projection and the MLP of every layer, plus the output layer; embeddings lookups are
    free; in an MoE layer the router and the top-k experts instead of the MLP) plus causal
    attention, ``6 x layers x heads x head_dim x (seq + 1)`` (forward: ``QK^T`` and ``PV``, 2 x 2 x
    heads x head_dim flops per visible key, (seq + 1) / 2 visible keys on average; backward twice
    the forward). Recomputation is not counted (model FLOPs, PaLM appendix B, arXiv:2204.02311)."""
    h, layers, heads = shape["hidden_size"], shape["num_layers"], shape["num_attention_heads"]
    d = shape.get("kv_channels") or h // heads
    n = layers * _attention_weights(shape) + _mlp_weights(shape, active=True) + h * vocab
    attn = 6 * layers * heads * d * (seq + 1)
    return {
        "matmul_params": float(n),
        "flops_6n": 6.0 * n,
        "flops_attention": float(attn),
        "flops_per_token": 6.0 * n + attn,
    }


def _attention_weights(shape: dict) -> int:
    h, heads = shape["hidden_size"], shape["num_attention_heads"]
    groups, d = shape.get("num_query_groups") or heads, shape.get("kv_channels") or h // heads
    return h * heads * d + 2 * h * groups * d + heads * d * h  # qkv, proj


def _mlp_weights(shape: dict, *, active: bool) -> int:
    """The MLP matrix weights of all layers: dense gated MLPs (fc1 2x + fc2), or per MoE layer the
    router, the experts (the top-k of them when ``active``) and a shared expert."""
    h, layers, ffn = shape["hidden_size"], shape["num_layers"], shape["ffn_hidden_size"]
    experts = shape.get("num_experts")
    if not experts:
        return layers * 3 * h * ffn
    used = shape.get("moe_topk", 2) if active else experts
    shared = 3 * h * shape["moe_shared_expert_size"] if shape.get("moe_shared_expert_size") else 0
    return layers * (h * experts + used * 3 * h * (shape.get("moe_ffn_hidden_size") or ffn) + shared)


def param_count(shape: dict, vocab: int, *, qkv_bias: bool = True, tied: bool = True) -> int:
    """Every parameter of the shape (all experts, norms, q/k/v biases; the tied embedding once)."""
    h, layers, heads = shape["hidden_size"], shape["num_layers"], shape["num_attention_heads"]
    groups, d = shape.get("num_query_groups") or heads, shape.get("kv_channels") or h // heads
    biases = layers * d * (heads + 2 * groups) if qkv_bias else 0
    norms = layers * 2 * h + h
    return (
        layers * _attention_weights(shape)
        + _mlp_weights(shape, active=False)
        + h * vocab * (1 if tied else 2)
        + biases
        + norms
    )


def static_memory_gib(params: float, *, dtype: str, dp: int = 1, tp: int = 1) -> float:
    """Weights (2 B bf16 / 4 B fp32), the fp32 gradient buffer (4 B) and the distributed optimizer's
    fp32 main weights and Adam moments (12 B; 8 B for fp32 models, sharded over DP) per parameter, per GPU."""
    weight, main = (2, 12) if dtype in ("bf16", "fp16") else (4, 8)
    return params / tp * (weight + 4 + main / dp) / 2**30


def matmul_peak_tflops(device: torch.device, n: int = 8192, reps: int = 20) -> float:
    """bf16 ``n x n x n`` matrix product on random data: median TFLOP/s over ``reps`` (CUDA events)."""
    g = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, device=device, generator=g).bfloat16()
    b = torch.randn(n, n, device=device, generator=g).bfloat16()
    for _ in range(3):
        torch.mm(a, b)
    times = []
    for _ in range(reps):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        torch.mm(a, b)
        e1.record()
        e1.synchronize()
        times.append(e0.elapsed_time(e1) / 1e3)
    del a, b
    return 2 * n**3 / statistics.median(times) / 1e12


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


def layer_spec(args, cfg):
    if args.spec == "local":
        return fnppo.models.local_layer_spec(cfg)
    if args.spec == "te":
        if not fnppo.models.te_available():
            raise SystemExit("--spec te: Transformer Engine is not installed")
        return fnppo.models.default_layer_spec(cfg)
    return None


def build_state(args, layout):
    fusions = {"auto": None, "on": True, "off": False}[args.fusions]
    cfg = fnppo.ModelConfig(
        vocab_size=args.vocab,
        max_seq_len=max(4096, args.seq, args.search_seq_max if args.search_seq else 0),
        dtype="bf16" if args.device == "cuda" else "fp32",
        tie_embeddings=not args.untied,
        add_qkv_bias=True,
        rotary_base=1_000_000.0,
        fusions=fusions,
        moe_experts=None if args.moe_experts == "auto" else args.moe_experts,
        fp8=None if args.fp8 == "none" else args.fp8,
        fp8_recipe=args.fp8_recipe,
        deterministic=args.deterministic,
        **MODELS[args.model],
    )
    overrides = {"sequence_parallel": True} if args.sp else {}
    if getattr(args, "fp8_bf16_ends", None):
        start, end = (int(v) for v in args.fp8_bf16_ends.split(","))
        overrides.update(first_last_layers_bf16=True, num_layers_at_start_in_bf16=start, num_layers_at_end_in_bf16=end)
    if args.recompute == "full":
        overrides.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    elif args.recompute == "selective":
        overrides.update(
            recompute_granularity="selective", recompute_modules=[m for m in args.recompute_modules.split(",") if m]
        )
    chunks = fnppo.build_gpt(cfg, layer_spec=layer_spec(args, cfg), **overrides)
    fnppo.models.layout_invariant_init(chunks, seed=0)
    ddp = fnppo.wrap_ddp(chunks, use_distributed_optimizer=True, overlap_grad_reduce=args.overlap)
    opt = fnppo.build_optimizer(ddp, lr=1e-6, clip_grad=1.0)
    return fnppo.TrainState(model=ddp, optimizer=opt)


DATASHEET_BF16_TFLOPS = 989.0  # H100/H200 SXM dense BF16 (FP8: 1,979)


def experts_name(state) -> str | None:
    """The class of the first MoE layer's experts module (None for a dense model)."""
    core = fnppo.megatron.unwrap.unwrap_model(state.model[0])
    for layer in core.decoder.layers:
        experts = getattr(layer.mlp, "experts", None)
        if experts is not None:
            return type(experts).__name__
    return None


def spec_name(state) -> str:
    core = fnppo.megatron.unwrap.unwrap_model(state.model[0])
    layer = core.decoder.layers[0]
    return type(layer.self_attention.linear_qkv).__name__


def step_config(path: str, mb_tokens: int, chunk_vocab: int | None = None) -> fnppo.StepConfig:
    loss = fnppo.losses.from_flat(
        policy_loss="ppo", loss_agg_mode="token-mean", entropy_coeff=0.01, kl_coef=0.001, kl_estimator="k3"
    )
    if path in ("C", "D"):
        graphs = fnppo.ops.BackwardGraphs() if path == "D" else None
        fns = fnppo.StepFns.fused(chunk_vocab=chunk_vocab, graphs=graphs)
    else:
        fns = actor_fns() if path == "B" else fnppo.StepFns()
    return fnppo.StepConfig(loss=loss, layout="packed", max_tokens_per_microbatch=mb_tokens, fns=fns)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


class GcClock:
    """Time Python's garbage collector spends (``gc.callbacks``), and its collections per
    generation, for the steps' host-time accounting."""

    def __init__(self):
        self.seconds = 0.0
        self.counts = [0, 0, 0]
        self._t0 = 0.0

    def __call__(self, phase, info):
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._t0
            self.counts[info["generation"]] += 1

    def snapshot(self):
        return self.seconds, list(self.counts)


GC_CLOCK = GcClock()
gc.callbacks.append(GC_CLOCK)


def host_probe_s(n: int = 200_000) -> float:
    """Seconds a fixed pure-Python loop takes: the host's speed just before a step (to tell host
    jitter from device jitter when step times spread)."""
    t0 = time.perf_counter()
    x = 0
    for i in range(n):
        x += i & 7
    return time.perf_counter() - t0


def _allocator_counts(device) -> tuple[int, int]:
    if device.type != "cuda":
        return 0, 0
    m = torch.cuda.memory_stats()
    return m.get("num_device_alloc", 0), m.get("num_device_free", 0)


DIAGNOSTICS = ("host_return_s", "gc_s", "gc_collections", "device_allocs", "device_frees", "host_probe_s")


def timed_step(state, samples, cfg, device):
    """One ``train_step``: (state, metrics, seconds until the device is done, diagnostics: seconds
    until the host returned, garbage collections during the step (seconds and counts per
    generation), device allocations and frees by the caching allocator, a host-speed probe)."""
    probe = host_probe_s()
    sync(device)
    a0, f0 = _allocator_counts(device)
    s0, c0 = GC_CLOCK.snapshot()
    t0 = time.perf_counter()
    state, metrics = fnppo.train_step(state, samples, cfg)
    t1 = time.perf_counter()
    sync(device)
    t2 = time.perf_counter()
    s1, c1 = GC_CLOCK.snapshot()
    a1, f1 = _allocator_counts(device)
    diag = {
        "host_return_s": t1 - t0,
        "gc_s": s1 - s0,
        "gc_collections": [b - a for a, b in zip(c0, c1)],
        "device_allocs": a1 - a0,
        "device_frees": f1 - f0,
        "host_probe_s": probe,
    }
    return state, metrics, t2 - t0, diag


def fits(state, args, path, budget, layout, device, *, seq: int | None = None) -> bool:
    """Whether one ``train_step`` with micro-batches of ``budget`` tokens fits in memory: samples of
    ``args.seq`` tokens, or (``seq``) one sample of ``seq`` tokens in one micro-batch."""
    seq = seq or args.seq
    n = max(1, budget // seq)
    samples = make_samples(n, seq, args.vocab, seed=123)
    cfg = step_config(path, budget, args.fused_chunk_vocab)
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


def largest(ok, start: int, cap: int, unit: int) -> int:
    """The largest size ``n`` with ``ok(n)``: doubling from ``start`` up to ``cap``, then bisection
    to a multiple of ``unit`` between the last size that fit (or 0) and the first that did not;
    the last doubling's size when the cap is reached."""
    lo, hi, n = 0, None, start
    while n <= cap:
        if not ok(n):
            hi = n
            break
        lo, n = n, n * 2
    while hi is not None and hi - lo > unit:
        mid = (lo + hi) // 2 // unit * unit
        if mid <= lo:
            break
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo


def search(state, args, path, layout, device) -> int:
    """The largest micro-batch token budget that trains (samples of ``args.seq`` tokens)."""
    return largest(lambda b: fits(state, args, path, b, layout, device), args.mb_tokens, args.search_max, args.seq)


def search_seq(state, args, path, layout, device) -> int:
    """The longest single sequence (one sample, one micro-batch) that trains: doubling from
    ``args.seq``, then bisection to a multiple of ``args.search_seq_unit`` tokens."""
    return largest(
        lambda s: fits(state, args, path, s, layout, device, seq=s), args.seq, args.search_seq_max, args.search_seq_unit
    )


# ---------------------------------------------------------------------------------------------
# profile: one step per path, kernels grouped
# ---------------------------------------------------------------------------------------------
CATEGORIES = [  # (category, substrings of kernel names), first match wins
    ("flex attention", ("flex", "triton_tem_fused")),
    (
        "fnppo triton (log-prob, fused output, rope)",
        ("_fwd_kernel", "_bwd_kernel", "_dz_kernel", "_label_kernel", "_rope_kernel", "_lse", "_grad_kernel"),
    ),
    ("cuDNN / TE attention", ("cudnn", "fmha", "flash", "fused_attn")),
    ("matrix products", ("gemm", "cutlass", "nvjet", "sm90_xmma", "cublas", "wgmma")),
    ("optimizer", ("adam", "multi_tensor", "l2norm")),
    ("element-wise (compiled: SwiGLU, bias-dropout-add)", ("triton_poi", "triton_red", "triton_per")),
    ("norms", ("layer_norm", "LayerNorm", "rmsnorm", "RMSNorm", "GammaBeta")),
    ("concatenation", ("CatArrayBatched",)),
    ("copies", ("copy", "Memcpy", "memcpy", "Memset")),
    ("reductions", ("reduce", "Reduce")),
    ("element-wise", ("elementwise", "vectorized", "unrolled", "Elementwise")),
    ("NCCL", ("nccl",)),
]


def _is_annotation(name: str) -> bool:
    """Profiler ranges mirrored on the GPU timeline (e.g. ``Optimizer.step#AdamW.step``), not kernels."""
    return "#" in name or name.startswith(("ProfilerStep", "Optimizer.", "## "))


def _category(name: str) -> str:
    for cat, keys in CATEGORIES:
        if any(k in name for k in keys):
            return cat
    return "other"


def host_profile(state, samples, cfgs, paths, device, out: Path) -> dict:
    """cProfile of one ``train_step`` per path: where the host's time goes (Python and the calls
    it waits in). Written to ``out``; returns each path's profiled host time in seconds."""
    import cProfile
    import io
    import pstats

    lines, summary = [], {}
    for p in paths:
        sync(device)
        prof = cProfile.Profile()
        t0 = time.perf_counter()
        prof.enable()
        state, _ = fnppo.train_step(state, samples, cfgs[p])
        sync(device)
        prof.disable()
        summary[p] = time.perf_counter() - t0
        for key in ("tottime", "cumulative"):
            buf = io.StringIO()
            pstats.Stats(prof, stream=buf).sort_stats(key).print_stats(35)
            lines.append(f"== path {p}: one step under cProfile {summary[p] * 1e3:.1f} ms, sorted by {key}")
            lines.append(buf.getvalue())
    out.write_text("\n".join(lines))
    return summary


def profile_steps(state, samples, cfgs, paths, device, out: Path) -> dict:
    from torch.profiler import ProfilerActivity, profile

    lines, summary = [], {}
    for p in paths:
        sync(device)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            state, _ = fnppo.train_step(state, samples, cfgs[p])
            sync(device)
            wall = time.perf_counter() - t0
        kernels = [
            e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA and not _is_annotation(e.name)
        ]
        spans = sorted((e.time_range.start, e.time_range.end) for e in kernels)
        busy, end = 0.0, float("-inf")  # the union of the kernels' intervals (us)
        for a, b in spans:
            if b > end:
                busy += b - max(a, end)
                end = b
        busy /= 1e6
        by_cat: dict[str, list[float]] = {}
        by_name: dict[str, list[float]] = {}
        for e in kernels:
            dur = (e.time_range.end - e.time_range.start) / 1e6
            c = by_cat.setdefault(_category(e.name), [0.0, 0])
            c[0] += dur
            c[1] += 1
            n = by_name.setdefault(e.name[:110], [0.0, 0])
            n[0] += dur
            n[1] += 1
        cpu_ops = {}
        for e in prof.key_averages():
            if e.key.startswith("aten::") or e.key.startswith("cuda"):
                cpu_ops[e.key] = e.count
        summary[p] = {
            "wall_s": wall,
            "kernel_s": busy,
            "idle_s": max(0.0, wall - busy),
            "categories": {k: {"s": v[0], "share": v[0] / wall, "kernels": v[1]} for k, v in by_cat.items()},
            "aten_cat_calls": cpu_ops.get("aten::cat", 0),
            "cuda_syncs": cpu_ops.get("cudaStreamSynchronize", 0) + cpu_ops.get("cudaDeviceSynchronize", 0),
            "item_calls": cpu_ops.get("aten::item", 0) + cpu_ops.get("aten::_local_scalar_dense", 0),
        }
        lines.append(
            f"== path {p}: step {wall * 1e3:.1f} ms wall, kernels {busy * 1e3:.1f} ms, GPU idle {max(0.0, wall - busy) * 1e3:.1f} ms "
            f"({max(0.0, wall - busy) / wall:.1%}); aten::cat calls {summary[p]['aten_cat_calls']}, "
            f"host syncs (item/local_scalar_dense) {summary[p]['item_calls']}"
        )
        for k, v in sorted(by_cat.items(), key=lambda kv: -kv[1][0]):
            lines.append(f"  {k:<46} {v[0] * 1e3:9.1f} ms  {v[0] / wall:6.1%}  {v[1]:6d} kernels")
        lines.append("  top kernels:")
        for k, v in sorted(by_name.items(), key=lambda kv: -kv[1][0])[:25]:
            lines.append(f"    {v[0] * 1e3:8.2f} ms {v[1]:6d}x  {k}")
        lines.append(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))
    out.write_text("\n".join(lines) + "\n")
    return summary


def sync_report(state, samples, cfgs, paths, out: Path) -> dict:
    """One step per path under ``torch.cuda.set_sync_debug_mode("warn")``: every operation that makes
    the host wait for the device (``.item()``, device-to-host copies, copies from pageable host
    memory, ...) warns; counted by the innermost call site outside torch."""
    import collections
    import traceback
    import warnings

    summary, lines = {}, []
    for p in paths:
        sites: collections.Counter = collections.Counter()

        def record(message, category, filename, lineno, file=None, line=None):  # noqa: ANN001, ARG001
            if "synchroniz" not in str(message):
                return
            frames = [
                f
                for f in traceback.extract_stack()[:-1]
                if "/torch/" not in f.filename and "warnings" not in f.filename
            ]
            where = " <- ".join(f"{Path(f.filename).name}:{f.lineno}:{f.name}" for f in frames[-3:][::-1])
            sites[where] += 1

        torch.cuda.synchronize()
        old = warnings.showwarning
        warnings.showwarning = record
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("always")
                warnings.showwarning = record
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    state, _ = fnppo.train_step(state, samples, cfgs[p])
                finally:
                    torch.cuda.set_sync_debug_mode("default")
        finally:
            warnings.showwarning = old
        summary[p] = sum(sites.values())
        lines.append(f"== path {p}: {summary[p]} synchronizing operations in one step")
        lines += [f"  {n:5d}  {k}" for k, n in sites.most_common(40)]
    out.write_text("\n".join(lines) + "\n")
    return summary


# ---------------------------------------------------------------------------------------------
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
            fnppo.megatron.parallel.destroy_parallel()


def run(args, layout, device) -> int:
    rank0 = layout.rank == 0
    paths = args.paths.split(",")
    peak_tflops = matmul_peak_tflops(device) if device.type == "cuda" else None
    state = build_state(args, layout)
    n_per_rank = args.microbatches * max(1, args.mb_tokens // args.seq)
    samples = make_samples(n_per_rank * layout.dp, args.seq, args.vocab, seed=1)
    mine = fnppo.shard_for_data_parallel(samples, layout)
    tokens_per_step = sum(len(s) for s in samples)
    cfgs = {p: step_config(p, args.mb_tokens, args.fused_chunk_vocab) for p in paths}
    flops = model_flops_per_token(MODELS[args.model], args.vocab, args.seq)

    # First step from identical weights: log-probs of each path (no update applied).
    first = {}
    for p in paths:
        lp, _ = fnppo.compute_logprobs(state.model, mine[:2], config=cfgs[p])
        first[p] = {"logprobs": torch.cat(lp)}
    times = {p: [] for p in paths}
    diags = {p: [] for p in paths}  # per timed step: timed_step's diagnostics
    peak = {p: 0.0 for p in paths}
    gnorm = {p: [] for p in paths}
    compiles_before = fnppo.models.flex_compile_count()
    with fnppo.typing.typechecking(args.checks == "on"):
        for i in range(args.warmup + args.steps):
            for p in (paths[i % len(paths) :] + paths[: i % len(paths)]) if args.rotate else paths:
                if device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats()
                if args.rotate:
                    gc.collect()
                state, metrics, dt, diag = timed_step(state, mine, cfgs[p], device)
                gnorm[p].append(metrics["grad_norm"])
                if i >= args.warmup:
                    times[p].append(dt)
                    diags[p].append(diag)
                    if device.type == "cuda":
                        peak[p] = max(peak[p], torch.cuda.max_memory_allocated() / 2**30)
        profile = None
        if args.profile:
            try:
                profile = profile_steps(state, mine, cfgs, paths, device, Path(args.profile))
            except Exception as err:  # noqa: BLE001 - the timings above still count
                profile = {"error": repr(err)}
        hostprof = None
        if args.host_profile:
            try:
                hostprof = host_profile(state, mine, cfgs, paths, device, Path(args.host_profile))
            except Exception as err:  # noqa: BLE001
                hostprof = {"error": repr(err)}
        syncs = None
        if args.sync_report and device.type == "cuda":
            try:
                syncs = sync_report(state, mine, cfgs, paths, Path(args.sync_report))
            except Exception as err:  # noqa: BLE001
                syncs = {"error": repr(err)}
    result = {
        "model": args.model,
        "rotate": args.rotate,
        "spec": spec_name(state),
        "experts": experts_name(state),
        "fp8": args.fp8 if args.fp8 == "none" else f"{args.fp8}:{args.fp8_recipe}",
        "deterministic": args.deterministic,
        "fusions": args.fusions,
        "checks": args.checks,
        "fused_chunk_vocab": args.fused_chunk_vocab,
        "recompute": args.recompute if args.recompute != "selective" else f"selective:{args.recompute_modules}",
        "seq": args.seq,
        "tp": layout.tp,
        "sp": args.sp,
        "dp": layout.dp,
        "gpus": layout.world_size,
        "mb_tokens": args.mb_tokens,
        "microbatches": args.microbatches,
        "tokens_per_step": tokens_per_step,
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "matmul_peak_tflops": peak_tflops,
        **flops,
        "params_total": param_count(MODELS[args.model], args.vocab),
        "params_this_rank": sum(
            p.numel() for c in state.model for p in fnppo.megatron.unwrap.unwrap_model(c).parameters()
        ),
        "static_memory_gib_estimate": static_memory_gib(
            param_count(MODELS[args.model], args.vocab),
            dtype="bf16" if device.type == "cuda" else "fp32",
            dp=layout.dp,
            tp=layout.tp,
        ),
        "flex_compiles": fnppo.models.flex_compile_count(),
        "flex_compiles_in_timed_steps": fnppo.models.flex_compile_count() - compiles_before,
    }
    for p in paths:
        med = statistics.median(times[p])
        tps = tokens_per_step / med
        result[p] = {
            "step_s_median": med,
            "step_s": times[p],
            **{k: [d[k] for d in diags[p]] for k in DIAGNOSTICS},
            "tokens_per_s": tps,
            "peak_gib": peak[p],
            "first_grad_norm": gnorm[p][0],
        }
        if peak_tflops:
            result[p]["mfu"] = tps * flops["flops_per_token"] / (peak_tflops * 1e12 * layout.world_size)
            result[p]["mfu_6n"] = tps * flops["flops_6n"] / (peak_tflops * 1e12 * layout.world_size)
            # against the data sheet's dense BF16 peak of an H100/H200 (989 TFLOP/s), as published MFUs are
            result[p]["mfu_datasheet"] = (
                tps * flops["flops_per_token"] / (DATASHEET_BF16_TFLOPS * 1e12 * layout.world_size)
            )
        if rank0:  # right away: a run cut short still reports the paths it timed
            print(
                f"path {p}: {tps:,.0f} tokens/s, step {med * 1e3:.1f} ms, peak {peak[p]:.2f} GiB"
                + (f", MFU {result[p]['mfu']:.1%} ({result[p]['mfu_datasheet']:.1%} of 989)" if peak_tflops else ""),
                flush=True,
            )
    if "A" in paths and "B" in paths:
        d = (first["A"]["logprobs"] - first["B"]["logprobs"]).abs()
        result["first_logprobs_max_abs_diff"] = float(d.max())
        result["speedup_A_over_B"] = result["A"]["tokens_per_s"] / result["B"]["tokens_per_s"]
        logits_gib = args.mb_tokens * args.vocab / layout.tp * 2 / 2**30
        result["logits_copy_gib"] = logits_gib
        if device.type == "cuda":
            result["peak_saving_in_logits_copies"] = (result["B"]["peak_gib"] - result["A"]["peak_gib"]) / logits_gib
    if "A" in paths and "C" in paths:
        result["first_logprobs_max_abs_diff_C_vs_A"] = float(
            (first["C"]["logprobs"] - first["A"]["logprobs"]).abs().max()
        )
        result["speedup_C_over_A"] = result["C"]["tokens_per_s"] / result["A"]["tokens_per_s"]
    for p in (
        paths
    ):  # per round (the paths' steps of one round run back to back): A's step time over p's, median over rounds
        if p != "A" and "A" in paths:
            result[f"speedup_{p}_over_A_per_round_median"] = statistics.median(
                a / b for a, b in zip(times["A"], times[p])
            )
    if "A" in paths and "D" in paths:
        result["first_logprobs_max_abs_diff_D_vs_A"] = float(
            (first["D"]["logprobs"] - first["A"]["logprobs"]).abs().max()
        )
        result["speedup_D_over_A"] = result["D"]["tokens_per_s"] / result["A"]["tokens_per_s"]
        g = cfgs["D"].fns.head.graphs
        result["D"]["graphs"] = {
            "captures": g.captures,
            "replays": g.replays,
            "eager_calls": g.eager_calls,
            "gib": g.nbytes() / 2**30,
        }
    if profile is not None:
        result["profile"] = profile
    if syncs is not None:
        result["syncs_per_step"] = syncs
    if hostprof is not None:
        result["host_profile_s"] = hostprof
    if args.search and device.type == "cuda":
        with fnppo.typing.typechecking(args.checks == "on"):
            for p in paths:
                result[p]["max_mb_tokens"] = search(state, args, p, layout, device)
    if args.search_seq and device.type == "cuda":
        with fnppo.typing.typechecking(args.checks == "on"):
            for p in paths:
                result[p]["max_single_sequence"] = search_seq(state, args, p, layout, device)
                if rank0:
                    print(f"path {p}: longest single sequence {result[p]['max_single_sequence']:,} tokens", flush=True)
    if rank0:
        print(json.dumps(result, indent=1))
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps(result) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
