"""Weight updates to an inference engine after real optimizer steps: bytes on the wire and time of the
full stream, delta streams (blocks, elements), FP8 and FP8 deltas (``fnppo.hf``).

One process, one device. Builds a dense Llama/Qwen-shaped GPT (default: Qwen2.5-1.5B's widths, hidden
1536, 28 layers, 12 heads / 2 groups, FFN 8960, vocabulary 151936) in ``--dtype`` (bf16 parameters,
Megatron's fp32 main weights and Adam), syncs an engine once in full, then runs ``--steps``
``fnppo.train_step`` updates (PPO loss on random prompts and responses with random advantages, Adam
at ``--lr``) and after each one streams the update in every mode to a receiver on the host:

* ``full``: ``stream_hf_weights``, every tensor (bf16);
* ``delta-blocks`` / ``delta-elements``: ``stream_hf_deltas(granularity=...)`` since the previous
  update, applied by ``apply_hf_deltas`` (digests checked);
* ``fp8`` / ``fp8-delta``: the same with ``fp8=FP8Blocks()`` (E4M3 codes and 128 x 128 block scales).

Each delta's result is checked bit for bit against the full stream of the same mode. Per update and
mode it prints the bytes of tensor data sent, their fraction of the full stream's, the fraction of
tensors / blocks / elements that changed, the stream's wall time (assembling, copying to the host,
hashing, encoding) and the receiver's (rebuild and SHA-256 check), as a markdown table; with
``$OUT`` set, also ``$OUT/stream_delta.json``.

    .venv/bin/python benchmarks/stream_delta.py --device cuda                  # 1.5B widths, one GPU, bf16, lr 1e-6
    .venv/bin/python benchmarks/stream_delta.py --tiny                         # CPU, tiny, seconds (the CI check)
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

import fnppo
from fnppo import hf, losses
from fnppo.io.hf.snapshot import bits_view


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
    p.add_argument("--hidden", type=int, default=1536)
    p.add_argument("--layers", type=int, default=28)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--groups", type=int, default=2)
    p.add_argument("--ffn", type=int, default=8960)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    p.add_argument("--lr", type=float, default=1e-6)
    p.add_argument("--steps", type=int, default=3, help="optimizer steps (one sync after each)")
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--seq", type=int, default=256, help="prompt + response tokens per sample")
    p.add_argument("--block", type=int, default=128, help="FP8 block (rows and columns)")
    p.add_argument("--tiny", action="store_true", help="a tiny model on the CPU (the CI check of this script)")
    args = p.parse_args(argv)
    if args.tiny:
        args.device, args.hidden, args.layers, args.heads, args.groups = "cpu", 64, 2, 4, 2
        args.ffn, args.vocab, args.samples, args.seq, args.block, args.steps = 128, 256, 4, 16, 16, 2
        args.lr = 1e-3
    return args


MODES = {  # name -> (fp8, granularity or None for the full stream)
    "full": (False, None),
    "delta-blocks": (False, "blocks"),
    "delta-elements": (False, "elements"),
    "fp8": (True, None),
    "fp8-delta": (True, "elements"),
}


def _samples(args, g: torch.Generator) -> list:
    half = args.seq // 2
    out = []
    for _ in range(args.samples):
        ids = torch.randint(0, args.vocab, (args.seq,), generator=g)
        lp = -torch.rand(args.seq - half, generator=g) - 1.0
        adv = torch.randn(1, generator=g).expand(args.seq - half)
        out.append(
            fnppo.Sample(
                prompt_ids=ids[:half], response_ids=ids[half:], advantages=adv, old_logprobs=lp, rollout_logprobs=lp
            )
        )
    return out


def _full(chunks, fp8) -> tuple[dict, float]:
    """The full stream, copied to the host (the engine's side of the wire), and its wall time."""
    t0 = time.perf_counter()
    got = {n: t.to("cpu", copy=True) for b in hf.stream_hf_weights(chunks, fp8=fp8) for n, t in b}
    return got, time.perf_counter() - t0


def _same(a: dict, b: dict) -> bool:
    def bits(t):
        return t.contiguous().reshape(-1).view(torch.uint8)

    return sorted(a) == sorted(b) and all(torch.equal(bits(a[k]), bits(b[k])) for k in a)


def _sync(chunks, mode: str, state: dict, step: int, fp8_blocks) -> dict:
    """One mode's sync after an update: its row, and the receiver's and sender's new states."""
    use_fp8, gran = MODES[mode]
    fp8 = fp8_blocks if use_fp8 else None
    if gran is None:
        got, seconds = _full(chunks, fp8)
        total = sum(t.numel() * t.element_size() for t in got.values())
        return dict(row=dict(bytes=total, fraction=1.0, stream_s=seconds, apply_s=0.0), state=state)
    t0 = time.perf_counter()
    stream = hf.stream_hf_deltas(chunks, state["since"], step=step, granularity=gran, fp8=fp8)
    buckets = list(stream)
    seconds = time.perf_counter() - t0
    t1 = time.perf_counter()
    weights, held = hf.apply_hf_deltas(state["weights"], buckets, state["held"])
    apply_s = time.perf_counter() - t1
    records = [r for b in buckets for r in b if isinstance(r, hf.TensorDelta)]
    total = sum(t.numel() * t.element_size() for t in weights.values())
    elems = sum(t.numel() for t in weights.values())
    changed = sum(r.values.numel() if r.encoding != "elements" else r.index.numel() for r in records)
    row = dict(
        bytes=sum(r.nbytes for r in records),
        fraction=sum(r.nbytes for r in records) / total,
        tensors_changed=len(records) / len(weights),
        elements_sent=changed / elems,  # blocks / full records count every element they carry
        encodings={e: sum(r.encoding == e for r in records) for e in ("full", "blocks", "elements")},
        stream_s=seconds,
        apply_s=apply_s,
    )
    if gran == "elements":  # the exact fraction of elements whose bits changed
        old = state["weights"]
        row["elements_changed"] = (
            sum(int((bits_view(t) != bits_view(old[k])).sum()) for k, t in weights.items()) / elems
        )
    full, _ = _full(chunks, fp8)
    assert _same(weights, full), f"{mode}: the receiver's weights are not the full stream's"
    return dict(row=row, state=dict(since=stream.snapshot, weights=weights, held=held))


def main(argv=None) -> dict:
    args = parse_args(argv)
    fnppo.init_parallel(device=args.device)
    cfg = fnppo.ModelConfig(
        num_layers=args.layers,
        hidden_size=args.hidden,
        num_attention_heads=args.heads,
        num_query_groups=args.groups,
        ffn_hidden_size=args.ffn,
        vocab_size=args.vocab,
        max_seq_len=args.seq,
        dtype=args.dtype,
        add_qkv_bias=True,
    )
    chunks = fnppo.build_gpt(cfg)
    fnppo.models.layout_invariant_init(chunks, seed=0)
    ddp = fnppo.wrap_ddp(chunks, use_distributed_optimizer=True)
    state = fnppo.TrainState(model=ddp, optimizer=fnppo.build_optimizer(ddp, lr=args.lr, clip_grad=1.0))
    step_cfg = fnppo.StepConfig(
        loss=losses.from_flat(policy_loss="ppo", clip_ratio_low=0.2, clip_ratio_high=0.2),
        layout="packed",
        num_microbatches=2,
    )
    fp8_blocks = hf.FP8Blocks((args.block, args.block))
    engines = {}
    for mode, (use_fp8, gran) in MODES.items():  # the first sync, in full
        if gran is not None:
            first = hf.stream_hf_deltas(ddp, None, step=0, granularity=gran, fp8=fp8_blocks if use_fp8 else None)
            buckets = list(first)
            weights, held = hf.apply_hf_deltas({}, buckets, None)
            engines[mode] = dict(since=first.snapshot, weights=weights, held=held)
    g = torch.Generator().manual_seed(0)
    rows = []
    for step in range(1, args.steps + 1):
        state, metrics = fnppo.train_step(state, _samples(args, g), step_cfg)
        for mode in MODES:
            res = _sync(ddp, mode, engines.get(mode), step, fp8_blocks)
            engines[mode] = res["state"]
            rows.append(dict(step=step, mode=mode, grad_norm=metrics["grad_norm"], **res["row"]))
    full_bytes = {r["step"]: r["bytes"] for r in rows if r["mode"] == "full"}
    print(
        f"\n{args.layers} layers, hidden {args.hidden}, FFN {args.ffn}, vocabulary {args.vocab}, {args.dtype}, "
        f"Adam lr {args.lr:g}, {args.device}\n"
    )
    print("| step | mode | MB sent | of full bf16 | tensors changed | elements changed | stream s | apply s |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['step']} | {r['mode']} | {r['bytes'] / 1e6:.1f} | {r['bytes'] / full_bytes[r['step']]:.2%} | "
            f"{r.get('tensors_changed', 1.0):.1%} | {_pct(r.get('elements_changed'))} | {r['stream_s']:.3f} | {r['apply_s']:.3f} |"
        )
    out = {"args": vars(args), "rows": rows}
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "stream_delta.json"), "w") as fh:
            json.dump(out, fh, indent=1)
    fnppo.parallel.destroy_parallel()
    return out


def _pct(x) -> str:
    return "" if x is None else f"{x:.3%}"


if __name__ == "__main__":
    main()
