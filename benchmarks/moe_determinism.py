"""Is an MoE policy's forward repeatable? The same ``compute_logprobs`` call three times, with routing.

Builds a 4-layer MoE GPT (hidden 2,048, 16 heads of 128, 4 KV groups, 64 experts of FFN 768, top-8 in
every layer, vocab 151,936, tied; bf16 on CUDA) from fixed weights (``layout_invariant_init``), takes
four 2,048-token samples (``benchmarks/step.py``'s ``make_samples``), and reports, per variant:

* ``A1_vs_A2``, ``A1_vs_A3``, ``A2_vs_A3``: max |log-prob difference| between three identical
  ``compute_logprobs`` calls (path A's config: packed, 8,192-token micro-batches);
* ``A1_vs_B``: the same against path B's stages (``benchmarks/actor_baseline.py``: Megatron's
  cross entropy on a clone of the logits), whose forward is the same model call;
* ``routing_rows_differing`` of ``routing_rows``: (token, MoE layer) rows whose set of chosen experts
  differs between the first two calls (``return_routing=True``);
* ``A1_vs_A1replay``: the first call against a call that replays the first call's routing
  (``Sample.routed_experts``);
* ``compute_logprobs_s``: the median of the three timed calls.

Variants: ``te`` (the default spec with Transformer Engine's grouped-GEMM experts,
``moe_experts="te_grouped"``), ``te_nogg`` (the same with ``moe_experts="sequential"``), ``stacked``
(the default spec with fnppo's stacked experts) and ``stacked_det`` (with
``ModelConfig(deterministic=True)``), ``local`` (fnppo's local spec, Megatron's ``SequentialMLP``) and
``local_det`` (``local`` with ``ModelConfig(deterministic=True)``).

    python benchmarks/moe_determinism.py --variants te,te_nogg,local           # one GPU (TE installed)
    CUBLAS_WORKSPACE_CONFIG=:4096:8 python benchmarks/moe_determinism.py --variants local,local_det
    python benchmarks/moe_determinism.py --device cpu                          # anywhere: small shape, fp32
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from step import make_samples, step_config  # noqa: E402

import fnppo  # noqa: E402

VARIANTS = {
    "te": (None, {"moe_experts": "te_grouped"}),
    "te_nogg": (None, {"moe_experts": "sequential"}),
    "stacked": (None, {"moe_experts": "stacked"}),
    "stacked_det": (None, {"moe_experts": "stacked", "deterministic": True}),
    "local": ("local", {"moe_experts": "sequential"}),
    "local_det": ("local", {"moe_experts": "sequential", "deterministic": True}),
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--variants", default="local,local_det", help=f"comma-separated, of {', '.join(VARIANTS)}")
    p.add_argument("--json", default=None, help="write the results to this file")
    args = p.parse_args(argv)
    unknown = [v for v in args.variants.split(",") if v not in VARIANTS]
    if unknown:
        p.error(f"--variants: unknown {unknown}; expected some of {', '.join(VARIANTS)}")
    return args


def _max_diff(x: list[torch.Tensor], y: list[torch.Tensor]) -> float:
    return max(float((a - b).abs().max()) for a, b in zip(x, y))


def measure(variant: str, device: torch.device) -> dict:
    cpu = device.type == "cpu"
    vocab, hidden, seq = (512, 64, 64) if cpu else (151936, 2048, 2048)
    spec, extra = VARIANTS[variant]
    cfg = fnppo.ModelConfig(
        vocab_size=vocab,
        max_seq_len=4096,
        dtype="fp32" if cpu else "bf16",
        tie_embeddings=True,
        add_qkv_bias=True,
        rotary_base=1e6,
        hidden_size=hidden,
        num_layers=4,
        num_attention_heads=16,
        num_query_groups=4,
        kv_channels=hidden // 16,
        ffn_hidden_size=768,
        num_experts=64,
        moe_topk=8,
        moe_ffn_hidden_size=768,
        **extra,
    )
    chunks = fnppo.build_gpt(cfg, layer_spec=fnppo.models.local_layer_spec(cfg) if spec == "local" else None)
    fnppo.models.layout_invariant_init(chunks, seed=0)
    model = fnppo.wrap_ddp(chunks, use_distributed_optimizer=True)
    samples = make_samples(4, seq, vocab, seed=1)
    a, b = step_config("A", 8192), step_config("B", 8192)

    def sync():
        if not cpu:
            torch.cuda.synchronize()

    r: dict = {"experts": type(fnppo.megatron.unwrap.unwrap_model(model[0]).decoder.layers[0].mlp.experts).__name__}
    with torch.no_grad():
        lp1, _, rt1 = fnppo.compute_logprobs(model, samples, config=a, return_routing=True)
        lp2, _, rt2 = fnppo.compute_logprobs(model, samples, config=a, return_routing=True)
        lp_b, _ = fnppo.compute_logprobs(model, samples, config=b)
        times = []
        for _ in range(3):
            sync()
            t0 = time.perf_counter()
            lp3, _ = fnppo.compute_logprobs(model, samples, config=a)
            sync()
            times.append(time.perf_counter() - t0)
        replayed = [dataclasses.replace(s, routed_experts=rt) for s, rt in zip(samples, rt1)]
        lp_replay, _ = fnppo.compute_logprobs(model, replayed, config=a)
    differing = sum(int((x.sort(-1).values != y.sort(-1).values).any(-1).sum()) for x, y in zip(rt1, rt2))
    r.update(
        A1_vs_A2=_max_diff(lp1, lp2),
        A1_vs_A3=_max_diff(lp1, lp3),
        A2_vs_A3=_max_diff(lp2, lp3),
        A1_vs_B=_max_diff(lp1, lp_b),
        routing_rows_differing=differing,
        routing_rows=sum(x.shape[0] * x.shape[1] for x in rt1),
        A1_vs_A1replay=_max_diff(lp1, lp_replay),
        compute_logprobs_s=statistics.median(times),
    )
    del model, chunks
    if not cpu:
        torch.cuda.empty_cache()
    return r


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    fnppo.init_parallel(1, 1, device=args.device, seed=0)
    out = {}
    try:
        for v in args.variants.split(","):
            out[v] = measure(v, device)
            print(v, json.dumps(out[v]), flush=True)
    finally:
        fnppo.megatron.parallel.destroy_parallel()
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
