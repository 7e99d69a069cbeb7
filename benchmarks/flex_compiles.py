"""How often the packed flex-attention kernel compiles over a run whose packs change length.

A "run" of ``--steps`` steps x ``--microbatches`` packed micro-batches: each pack holds sequences of
random lengths in ``[--min-len, --max-len]`` up to a ``--budget`` token total, so nearly every pack
has a new total length. Each micro-batch runs ``fnppo.megatron.packed_attention.packed_causal_attention`` forward
and backward (bf16, Qwen2.5-1.5B attention shape: 12 heads, 2 key/value groups of 128). Printed:
compilations of the flex kernel (``fnppo.megatron.packed_attention.flex_compile_count``) and all graphs that
``torch.compile`` produced, without fnppo's bucket padding (the default) and with it
(``buckets=True``; this script's children take it from ``FNPPO_FLEX_BUCKETS=1``), each in its own process (compiled kernels are cached per process).

    python benchmarks/flex_compiles.py            # needs CUDA (flex attention is compiled there only)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time


def one_run(args) -> dict:
    import torch

    from fnppo.megatron.packed_attention import packed_causal_attention

    g = torch.Generator().manual_seed(args.seed)
    device = torch.device("cuda")
    totals, t0 = [], time.perf_counter()
    for _ in range(args.steps * args.microbatches):
        lens, total = [], 0
        while True:
            n = int(torch.randint(args.min_len, args.max_len + 1, (1,), generator=g))
            if total + n > args.budget:
                break
            lens.append(n)
            total += n
        cu = torch.tensor([0] + lens, dtype=torch.int32).cumsum(0).to(torch.int32).to(device)
        q = torch.randn(total, 12, 128, device=device, dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(total, 2, 128, device=device, dtype=torch.bfloat16, requires_grad=True)
        v = torch.randn(total, 2, 128, device=device, dtype=torch.bfloat16, requires_grad=True)
        out = packed_causal_attention(q, k, v, cu, buckets=os.environ.get("FNPPO_FLEX_BUCKETS", "0") == "1")
        out.float().square().sum().backward()
        totals.append(total)
        print(json.dumps(_row(totals, t0)), flush=True)  # progress: the parent keeps the last line
    torch.cuda.synchronize()
    return _row(totals, t0)


def _row(totals, t0) -> dict:
    from torch._dynamo.utils import counters

    from fnppo.megatron.packed_attention import flex_bucket_length, flex_compile_count

    return {
        "buckets": os.environ.get("FNPPO_FLEX_BUCKETS", "0"),
        "flex_compiles": flex_compile_count(),
        "dynamo_unique_graphs": counters["stats"]["unique_graphs"],
        "distinct_pack_lengths": len(set(totals)),
        "distinct_buckets": len({flex_bucket_length(t) for t in totals}),
        "wall_s": time.perf_counter() - t0,
        "micro_batches": len(totals),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--budget", type=int, default=8192)
    p.add_argument("--min-len", type=int, default=256)
    p.add_argument("--max-len", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--timeout", type=float, default=150.0, help="seconds per run; a run cut short reports its count so far"
    )
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        one_run(args)
        return 0
    rows = []
    for buckets in ("0", "1"):
        env = dict(os.environ, FNPPO_FLEX_BUCKETS=buckets)
        cmd = [sys.executable, __file__, "--child", *[a for a in (argv if argv is not None else sys.argv[1:])]]
        try:
            out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True, timeout=args.timeout).stdout
            cut = False
        except subprocess.TimeoutExpired as err:
            out = err.stdout.decode() if isinstance(err.stdout, bytes) else (err.stdout or "")
            cut = True
        lines = [ln for ln in out.strip().splitlines() if ln.startswith("{")]
        row = json.loads(lines[-1]) if lines else {"buckets": buckets, "micro_batches": 0}
        row["cut_short_at_timeout"] = cut
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(
        "| bucket padding | micro-batches | distinct pack lengths | flex compilations | all torch.compile graphs | wall s |"
    )
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {'on' if r['buckets'] == '1' else 'off'} | {r.get('micro_batches')}{' (cut at the time limit)' if r['cut_short_at_timeout'] else ''} "
            f"| {r.get('distinct_pack_lengths')} | {r.get('flex_compiles')} | {r.get('dynamo_unique_graphs')} | {r.get('wall_s', float('nan')):.1f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
