"""Streaming weights to an inference engine: memory and throughput of ``fnppo.hf.stream_hf_weights``.

Builds a Llama-shaped GPT (``--hidden``, ``--layers``, ``--ffn``, ``--vocab``; MoE with ``--experts``),
streams it to rank 0 in ``--bucket-mb`` buckets under the ``--tp`` / ``--pp`` / ``--ep`` layout of the
launch, and prints, per rank, the peak torch memory held while streaming (``fnppo.testing.LiveBytes``:
storages allocated by the iterator and still alive, the consumer's own copies left out; on CUDA also ``torch.cuda.max_memory_allocated``
above the model), the bound ``max(bucket, T) + T`` (``T``: the largest full tensor), the model's
size, and the wall time and GB/s of the whole stream (the consumer copies each bucket into a
preallocated buffer per tensor and lets go of it, as an engine's ``load_weights`` does).

    torchrun --nproc-per-node 8 benchmarks/stream_hf.py --device cuda --tp 2 --pp 2 --hidden 4096 --layers 32 --ffn 14336 --vocab 128256
    torchrun --nproc-per-node 2 benchmarks/stream_hf.py --smoke --tp 2     # CPU, tiny, seconds
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.distributed as dist

import fnppo
from fnppo import hf
from fnppo.testing import LiveBytes


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--ep", type=int, default=1)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--groups", type=int, default=4)
    p.add_argument("--ffn", type=int, default=4096)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--experts", type=int, default=0, help="MoE experts per layer (0: dense)")
    p.add_argument("--bucket-mb", type=float, default=64.0)
    p.add_argument("--dtype", choices=["fp32", "bf16"], default=None, help="default: bf16 on cuda, fp32 on cpu")
    p.add_argument("--smoke", action="store_true", help="a tiny model on the CPU (the CI check of this script)")
    args = p.parse_args(argv)
    if args.smoke:
        args.device, args.hidden, args.layers, args.heads, args.groups = "cpu", 64, 4, 4, 2
        args.ffn, args.vocab, args.bucket_mb = 128, 256, 0.1
    args.dtype = args.dtype or ("bf16" if args.device == "cuda" else "fp32")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    layout = fnppo.init_parallel(tp=args.tp, pp=args.pp, ep=args.ep, device=args.device)
    moe = (
        dict(num_experts=args.experts, moe_topk=2, moe_ffn_hidden_size=args.ffn, moe_router_dtype=None)
        if args.experts
        else {}
    )
    cfg = fnppo.ModelConfig(
        num_layers=args.layers,
        hidden_size=args.hidden,
        num_attention_heads=args.heads,
        num_query_groups=args.groups,
        ffn_hidden_size=args.ffn,
        vocab_size=args.vocab,
        max_seq_len=128,
        dtype=args.dtype,
        **moe,
    )
    chunks = fnppo.build_gpt(cfg)
    device = next(chunks[0].parameters()).device
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    bucket = int(args.bucket_mb * 2**20)
    tracker, total, largest = LiveBytes(), 0, 0
    dist.barrier()
    t0 = time.perf_counter()
    stream = hf.stream_hf_weights(chunks, bucket_bytes=bucket, dst_rank=0)
    while True:
        with tracker:  # the iterator's own allocations, not the consumer's
            got = next(stream, None)
        if got is None:
            break
        for _, t in got:  # what an engine does: copy in, let go
            torch.empty_like(t).copy_(t)
            del t
        total += sum(t.numel() * t.element_size() for _, t in got)
        largest = max([largest] + [t.untyped_storage().nbytes() for _, t in got])
        del got
    if device.type == "cuda":
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    res = {
        "rank": layout.rank,
        "peak_live_bytes": tracker.peak,
        "cuda_peak_above_model": torch.cuda.max_memory_allocated() - base if device.type == "cuda" else None,
    }
    everyone = [None] * layout.world_size
    dist.all_gather_object(everyone, res)
    out = {}
    if layout.rank == 0:
        out = {
            "layout": dict(tp=layout.tp, pp=layout.pp, ep=layout.ep, dp=layout.dp),
            "model_bytes": total,
            "bucket_bytes": bucket,
            "largest_tensor_bytes": largest,
            "bound_bytes": max(bucket, largest) + largest,
            "per_rank": everyone,
            "wall_s": round(wall, 4),
            "GB_per_s": round(total / wall / 1e9, 3),
        }
        print(json.dumps(out, indent=1))
        assert all(r["peak_live_bytes"] <= out["bound_bytes"] for r in everyone), "over the bound"
    fnppo.parallel.destroy_parallel()
    return out


if __name__ == "__main__":
    main()
