"""On-policy distillation inside train_step: tokens/s and peak memory of RL alone, RL + a teacher model
in the step, and distillation from the teacher's top-k carried by the samples.

One process, one GPU, bf16: a student of Qwen2.5-1.5B's widths (hidden 1536, 12 heads, 2 KV groups,
FFN 8960) and a teacher of Qwen2.5-7B's widths (hidden 3584, 28 heads, 4 KV groups, FFN 18944; 12
layers by default), both with the 151,936-token vocabulary; micro-batches of 16,384 tokens (packed).
The rows:

* ``rl``: ``LossConfig()`` (clipped PPO), the student alone;
* ``rl+teacher``: ``LossConfig(distill=ReverseKL(teacher=TeacherModel(teacher)))``: the teacher runs
  forward-only over the micro-batches, the loss projects its hidden states chunk by chunk (full
  vocabulary reverse KL beside the PPO loss);
* ``topk``: ``LossConfig(policy=None, distill=ReverseKL(teacher=TopK()))``: the samples carry the
  teacher's top-k (``--topk``, default 20) ids and log-probs (what an inference engine returns);
* with ``--fused``, the same with ``StepFns.fused()`` (the fused output path: the head's own
  divergence kernel when it has one, else the logits formed from the hidden states).

Before the steps, the divergence on its own at the same size (``--tokens`` x the vocabulary, bf16
student logits, forward + backward): the peers' way (both log-softmaxes materialized in fp32,
autograd), fnppo's function with the teacher's logits materialized, fnppo's function from the
teacher's hidden states and output weight (its logits one chunk at a time), and
``logprob_and_entropy`` alone (the baseline); time and peak memory above the inputs, in logits copies.

Prints markdown tables (median step time, tokens/s, peak memory, peak above the state) and writes
``$OUT/distill_step.json`` when ``OUT`` is set. On an H100 / H200::

    python benchmarks/distill_step.py --device cuda

``--tiny`` is a CPU smoke run of the same code with a tiny student and teacher (tests/test_benchmarks.py).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

import fnppo
from fnppo import losses

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import peak_extra_bytes, time_ms  # noqa: E402

STUDENT = dict(hidden=1536, heads=12, groups=2, ffn=8960, layers=12)
TEACHER = dict(hidden=3584, heads=28, groups=4, ffn=18944, layers=12)
TINY_STUDENT = dict(hidden=64, heads=4, groups=2, ffn=128, layers=2)
TINY_TEACHER = dict(hidden=96, heads=4, groups=2, ffn=192, layers=2)


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--tiny", action="store_true", help="CPU smoke run: tiny models, vocabulary 512, 512 tokens")
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--tokens", type=int, default=16384, help="tokens per micro-batch (packed)")
    p.add_argument("--seq", type=int, default=2048, help="tokens per sample (prompt + response)")
    p.add_argument("--microbatches", type=int, default=1)
    p.add_argument("--student-layers", type=int, default=STUDENT["layers"])
    p.add_argument("--teacher-layers", type=int, default=TEACHER["layers"])
    p.add_argument("--topk", type=int, default=20)
    p.add_argument("--steps", type=int, default=5, help="timed steps per row (after one warm-up step)")
    p.add_argument("--fused", action="store_true", help="also the rows of the fused output path")
    p.add_argument("--no-op", action="store_true", help="skip the divergence on its own")
    args = p.parse_args(argv)
    if args.tiny:
        args.device, args.vocab, args.tokens, args.seq, args.steps = "cpu", 512, 512, 128, 1
        args.student_layers, args.teacher_layers = TINY_STUDENT["layers"], TINY_TEACHER["layers"]
    return args


def model_config(shape: dict, layers: int, args) -> fnppo.ModelConfig:
    return fnppo.ModelConfig(
        num_layers=layers,
        hidden_size=shape["hidden"],
        num_attention_heads=shape["heads"],
        num_query_groups=shape["groups"],
        ffn_hidden_size=shape["ffn"],
        vocab_size=args.vocab,
        max_seq_len=args.seq,
        dtype="bf16" if args.device == "cuda" else "fp32",
    )


def make_samples(args, with_topk: bool) -> list[fnppo.Sample]:
    """``tokens * microbatches / seq`` samples of ``seq`` tokens (a quarter prompt), with old log-probs and
    advantages, and (``with_topk``) a random teacher top-k (sorted log-probs of a random distribution)."""
    g = torch.Generator().manual_seed(0)
    n = args.tokens * args.microbatches // args.seq
    prompt = args.seq // 4
    out = []
    for _ in range(n):
        r = args.seq - prompt
        extra = {}
        if with_topk:
            lq = torch.log_softmax(torch.randn(r, args.topk, generator=g) * 2, -1) - 0.1  # the top-k holds ~90%
            extra = dict(
                teacher_topk_ids=torch.stack([torch.randperm(args.vocab, generator=g)[: args.topk] for _ in range(r)]),
                teacher_topk_logprobs=lq.sort(dim=-1, descending=True).values,
            )
        out.append(
            fnppo.Sample(
                prompt_ids=torch.randint(0, args.vocab, (prompt,), generator=g),
                response_ids=torch.randint(0, args.vocab, (r,), generator=g),
                advantages=torch.randn(r, generator=g),
                old_logprobs=-2.0 + 0.3 * torch.randn(r, generator=g),
                **extra,
            )
        )
    return out


def run_row(name: str, state, samples, cfg, args, device) -> dict:
    """One warm-up step, then ``--steps`` timed ones; median time, tokens/s, peak memory."""
    times = []
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if device.type == "cuda" else 0
    metrics = {}
    for i in range(args.steps + 1):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        state, metrics = fnppo.train_step(state, samples, cfg)
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i:
            times.append(time.perf_counter() - t0)
        print(f"{name}: step {i} ({'timed' if i else 'warm-up'}) {1e3 * (time.perf_counter() - t0):.1f} ms", flush=True)
    med = statistics.median(times)
    tokens = sum(len(s) for s in samples)
    peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else None
    return {
        "row": name,
        "step_ms": 1e3 * med,
        "tokens_per_s": tokens / med,
        "peak_gib": None if peak is None else peak / 2**30,
        "peak_above_state_gib": None if peak is None else (peak - base) / 2**30,
        "loss": metrics.get("loss"),
        "distill_loss": metrics.get("distill_loss"),
    }


def op_rows(args, device, teacher_hidden: int) -> list[dict]:
    """The divergence alone at ``--tokens`` x ``--vocab``: ms (forward + backward) and peak memory above the
    inputs in logits copies (CUDA), for the peers' way and fnppo's; ``logprob_and_entropy`` as the baseline."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    g = torch.Generator(device=device).manual_seed(0)
    n, v = args.tokens, args.vocab
    x = (torch.randn(n, v, generator=g, device=device) * 2).to(dtype).requires_grad_()
    hidden = torch.randn(n, teacher_hidden, generator=g, device=device).to(dtype)
    weight = (torch.randn(v, teacher_hidden, generator=g, device=device) / teacher_hidden**0.5).to(dtype)
    teacher_logits = (hidden @ weight.T).detach()
    labels = torch.randint(0, v, (n,), generator=g, device=device)

    def peers():  # both log-softmaxes materialized (fp32), KL(student || teacher), autograd
        lp = torch.log_softmax(x.float(), -1)  # noqa: F821
        lq = torch.log_softmax(teacher_logits.float(), -1)  # noqa: F821
        kl = (lp.exp() * (lp - lq)).sum(-1)
        return kl.sum() + lp.gather(-1, labels[:, None]).sum()

    def ours_logits():
        lp, ent, kl = fnppo.ops.logprob_entropy_and_divergence(x, labels, teacher_logits=teacher_logits)  # noqa: F821
        return kl.sum() + lp.sum() + ent.sum()

    def ours_hidden():
        lp, ent, kl = fnppo.ops.logprob_entropy_and_divergence(x, labels, teacher_hidden=hidden, teacher_weight=weight)  # noqa: F821
        return kl.sum() + lp.sum() + ent.sum()

    def baseline():
        lp, ent = fnppo.logprob_and_entropy(x, labels)  # noqa: F821
        return lp.sum() + ent.sum()

    copy = n * v * x.element_size()
    rows = []
    for name, fn in (
        ("logprob_and_entropy alone", baseline),
        ("peers: log-softmaxes materialized, autograd", peers),
        ("fnppo: teacher logits given", ours_logits),
        ("fnppo: teacher hidden + output weight", ours_hidden),
    ):

        def step(fn=fn):
            x.grad = None  # noqa: F821
            fn().backward()

        try:
            ms = time_ms(step, device, reps=max(1, args.steps), warmup=1)
            peak = peak_extra_bytes(step, device, [x])
        except torch.OutOfMemoryError:  # the peers' way at full size may not fit: a row that says so
            x.grad = None
            gc.collect()
            torch.cuda.empty_cache()
            rows.append({"row": name, "ms": None, "extra_logits_copies": None, "oom": True})
            print(f"{name}: out of memory", flush=True)
            continue
        rows.append({"row": name, "ms": ms, "extra_logits_copies": None if peak is None else peak / copy})
        print(f"{name}: {ms:.1f} ms", flush=True)
    del x, hidden, weight, teacher_logits
    return rows


def main(argv=None) -> int:
    args = parse(argv)
    device = torch.device(args.device)
    fnppo.init_parallel(tp=1, pp=1, device=args.device)
    teacher_hidden = (TINY_TEACHER if args.tiny else TEACHER)["hidden"]
    ops = [] if args.no_op else op_rows(args, device, teacher_hidden)
    student_shape = TINY_STUDENT if args.tiny else STUDENT
    teacher_shape = TINY_TEACHER if args.tiny else TEACHER
    chunks = fnppo.wrap_ddp(
        fnppo.build_gpt(model_config(student_shape, args.student_layers, args)), use_distributed_optimizer=False
    )
    state = fnppo.TrainState(model=chunks, optimizer=fnppo.build_optimizer(chunks, lr=1e-7))
    teacher = fnppo.TeacherModel(fnppo.build_gpt(model_config(teacher_shape, args.teacher_layers, args)))
    for c in teacher.chunks:
        c.requires_grad_(False)
    plain, topk = make_samples(args, False), make_samples(args, True)
    split = fnppo.batching.ByCount(args.microbatches)
    rows = {
        "rl": (plain, losses.LossConfig()),
        "rl+teacher": (plain, losses.LossConfig(distill=losses.ReverseKL(teacher=teacher))),
        "topk": (topk, losses.LossConfig(policy=None, distill=losses.ReverseKL(teacher=losses.TopK()))),
    }
    results = []
    for fused in (False, True) if args.fused else (False,):
        for name, (samples, loss) in rows.items():
            fns = fnppo.StepFns.fused() if fused else fnppo.StepFns()
            cfg = fnppo.StepConfig(split=split, loss=loss, fns=fns)
            label = f"{name} (fused)" if fused else name
            results.append(run_row(label, state, samples, cfg, args, device))
    report(results, ops, args, device)
    return 0


def report(results: list[dict], ops: list[dict], args, device) -> None:
    gpu = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(
        f"\n{gpu}; student {args.student_layers} layers of hidden {STUDENT['hidden'] if not args.tiny else TINY_STUDENT['hidden']}, "
        f"teacher {args.teacher_layers} layers of hidden {TEACHER['hidden'] if not args.tiny else TINY_TEACHER['hidden']}, "
        f"vocab {args.vocab}, {args.microbatches} micro-batch(es) of {args.tokens} tokens, top-k {args.topk}\n"
    )
    if ops:
        print(f"| the divergence alone ({args.tokens} x {args.vocab}, forward + backward) | ms | extra logits copies |")
        print("|---|---|---|")
        for r in ops:
            if r.get("oom"):
                print(f"| {r['row']} | out of memory | - |")
                continue
            copies = "-" if r["extra_logits_copies"] is None else f"{r['extra_logits_copies']:.2f}"
            print(f"| {r['row']} | {r['ms']:.2f} ({r['ms'] / ops[0]['ms']:.2f}x) | {copies} |")
        print()
    print("| row | step (ms) | tokens/s | peak (GiB) | peak above the state (GiB) |")
    print("|---|---|---|---|---|")
    base = results[0]["step_ms"]
    for r in results:
        peak = "-" if r["peak_gib"] is None else f"{r['peak_gib']:.2f}"
        above = "-" if r["peak_above_state_gib"] is None else f"{r['peak_above_state_gib']:.2f}"
        print(
            f"| {r['row']} | {r['step_ms']:.1f} ({r['step_ms'] / base:.2f}x) | {r['tokens_per_s']:.0f} | {peak} | {above} |"
        )
    out = os.environ.get("OUT")
    if out:
        path = Path(out) / "distill_step.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"device": gpu, "args": vars(args), "rows": results, "op": ops}, indent=1))
        print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
