"""Benchmark of fnppo's fused distillation head (``linear_logprob_entropy_and_divergence``) against
the fused log-prob + entropy head alone and against the peers' way (both models' logits materialized).

Forward + backward, per token: the student's log-prob of the label, its entropy and (but for the head
alone) the KL divergence to a frozen teacher, from bf16 hidden states ``h [tokens, hidden]``, the
student's output weight ``W [vocab, hidden]``, the teacher's hidden states ``h_t [tokens, hidden_t]``
and output weight ``W_t [vocab, hidden_t]``; gradients for ``h`` and ``W`` (the teacher is frozen),
random upstream gradients for every output, TP=1:

* fused head alone         ``linear_logprob_and_entropy(h, W, labels)``
* fused head + reverse KL  ``linear_logprob_entropy_and_divergence(h, W, labels, h_t, W_t)`` (this op)
* fused head + forward KL  the same with ``kind="forward_kl"``
* peers' way               ``h_t @ W_t.T`` and ``h @ W.T`` materialized (bf16), ``log_softmax`` of each
                           in fp32, then gather, entropy and ``sum p_s (log p_s - log p_t)``

and the dense bf16 products in the same run: the student's logits ``h @ W.T`` and the teacher's
``h_t @ W_t.T`` (one ``torch.mm`` each). The fused head does 4 student-sized products (logits,
recompute, two gradient products); the distillation op adds 2 teacher-sized ones (its logits in the
forward and again in the backward's recompute), so its floor is ``(4 T_s + 2 T_t) / (4 T_s)`` of the
head's time, ``T_s``/``T_t`` the two products' times: at 1.5B/7B widths (hidden 1,536 / 3,584) that is
about 2.2x in FLOPs; a method that keeps the teacher's logits instead of recomputing them would
still be ``(4 T_s + T_t) / (4 T_s)``, about 1.6x, for one logits-sized buffer more.

Columns: median fwd+bwd time (CUDA events); time / the fused head's; extra peak memory in units of one
bf16 ``[tokens, vocab]`` logits tensor, = (peak during fwd+bwd - memory with the inputs allocated -
bytes of the two input gradients) / logits bytes (as ``benchmarks/linear_logprob.py``).

    .venv/bin/python benchmarks/linear_distill.py             # GPU: device checks, then 16,384 x 151,936, 1,536 / 3,584
    .venv/bin/python benchmarks/linear_distill.py --tiny      # CPU smoke run (PyTorch path), checks against fp64

Prints a markdown table; writes the rows as JSON to ``--json PATH`` or, with ``$OUT`` set, ``$OUT/linear_distill.json``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import peak_extra_bytes, sync, time_ms  # noqa: E402

from fnppo.core.ops.linear_distill import linear_logprob_entropy_and_divergence  # noqa: E402
from fnppo.core.ops.linear_logprob import linear_logprob_and_entropy  # noqa: E402


# ---------------------------------------------------------------------------------------------
# Methods: each takes (h, W, labels, h_t, W_t, grads) and returns the loss to backpropagate.
# ---------------------------------------------------------------------------------------------
def head_alone(h, W, labels, h_t, W_t, grads, impl=None):
    lp, ent = linear_logprob_and_entropy(h, W, labels, impl=impl)
    return (lp * grads[0]).sum() + (ent * grads[1]).sum()


def fused_distill(h, W, labels, h_t, W_t, grads, impl=None, kind="reverse_kl"):
    lp, ent, div = linear_logprob_entropy_and_divergence(h, W, labels, h_t, W_t, kind=kind, impl=impl)
    return (lp * grads[0]).sum() + (ent * grads[1]).sum() + (div * grads[2]).sum()


def fused_forward_kl(h, W, labels, h_t, W_t, grads, impl=None):
    return fused_distill(h, W, labels, h_t, W_t, grads, impl, kind="forward_kl")


def peers_way(h, W, labels, h_t, W_t, grads, impl=None):
    """Both logits materialized (bf16), each log-softmaxed in fp32: the usual full-vocabulary reverse KL."""
    with torch.no_grad():
        logp_t = (h_t @ W_t.t()).float().log_softmax(-1)  # the teacher's, as its forward would return them
    logp_s = (h @ W.t()).float().log_softmax(-1)
    p_s = logp_s.exp()
    lp = logp_s.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    ent = -(p_s * logp_s).sum(-1)
    kl = (p_s * (logp_s - logp_t)).sum(-1)
    return (lp * grads[0]).sum() + (ent * grads[1]).sum() + (kl * grads[2]).sum()


METHODS = [
    ("fused head alone (log-prob + entropy)", head_alone),
    ("fused head + reverse KL (this op)", fused_distill),
    ("fused head + forward KL (this op)", fused_forward_kl),
    ("peers' way: both logits materialized", peers_way),
]


# ---------------------------------------------------------------------------------------------
# Problems, the fp64 reference, checks
# ---------------------------------------------------------------------------------------------
def make_problem(tokens, hidden, hidden_t, vocab, device, dtype=torch.bfloat16, seed=0, std=2.0):
    """Hidden states N(0, 1); weights scaled so that both models' logits have standard deviation ``std``."""
    g = torch.Generator(device="cpu").manual_seed(seed)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(device=device, dtype=dtype)

    h = randn(tokens, hidden).requires_grad_()
    W = randn(vocab, hidden, scale=std / hidden**0.5).requires_grad_()
    h_t, W_t = randn(tokens, hidden_t), randn(vocab, hidden_t, scale=std / hidden_t**0.5)
    labels = torch.randint(0, vocab, (tokens,), generator=g).to(device)
    grads = tuple(torch.randn(tokens, generator=g).to(device) for _ in range(3))
    return h, W, labels, h_t, W_t, grads


def reference64(h, W, labels, h_t, W_t, grads, kind, t=1.0, tt=1.0, vocab_size=None, floor=-1e4):
    """fp64 values and (dh, dW), from both models' full logits (the formula of the op's docstring)."""
    hr, wr = h.detach().double().requires_grad_(), W.detach().double().requires_grad_()
    zs, zt = (hr @ wr.t()) / t, (h_t.double() @ W_t.double().t()) / tt
    if vocab_size is not None:
        zs, zt = zs[:, :vocab_size], zt[:, :vocab_size]
    zt = torch.where(torch.isfinite(zt), zt, torch.full_like(zt, floor)).clamp(min=floor)
    ls, lt = zs.log_softmax(-1), zt.log_softmax(-1)
    lp = ls.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    ent = -(ls.exp() * ls).sum(-1)
    div = (ls.exp() * (ls - lt)).sum(-1) if kind == "reverse_kl" else (lt.exp() * (lt - ls)).sum(-1)
    loss = sum((x * gx.double()).sum() for x, gx in zip((lp, ent, div), grads))
    dh, dw = torch.autograd.grad(loss, (hr, wr))
    return (lp.detach(), ent.detach(), div.detach()), (dh, dw)


def _run(h, W, labels, h_t, W_t, grads, **kw):
    hg, wg = h.detach().clone().requires_grad_(), W.detach().clone().requires_grad_()
    out = linear_logprob_entropy_and_divergence(hg, wg, labels, h_t, W_t, **kw)
    loss = sum((x * gx).sum() for x, gx in zip(out, grads))
    dh, dw = torch.autograd.grad(loss, (hg, wg))
    return out, (dh, dw)


def _errors(out, ref):
    """Worst value error relative to max(1, scale) and worst gradient error relative to the gradient's scale."""
    (vals, grads), (rvals, rgrads) = out, ref
    v = max(float((a.detach().double() - b).abs().max()) / max(1.0, float(b.abs().max())) for a, b in zip(vals, rvals))
    g = max(float((a.double() - b).abs().max()) / max(1e-12, float(b.abs().max())) for a, b in zip(grads, rgrads))
    return v, g


def device_checks(device, impl):
    """The op on this device (``impl``) against fp64, on small problems of every kind of edge."""
    cases, failed = 0, []
    shapes = ((37, 24, 40, 300, None), (130, 64, 96, 1000, 997), (257, 96, 48, 5000, None))
    for dtype in (torch.float32, torch.bfloat16) if device.type == "cuda" else (torch.float32,):
        for kind in ("reverse_kl", "forward_kl"):
            for n, hid, hid_t, vocab, vs in shapes:
                h, W, labels, h_t, W_t, grads = make_problem(n, hid, hid_t, vocab, device, dtype, seed=n + vocab)
                W_t = W_t.clone()
                W_t[3] = float("-inf")  # non-finite teacher logits: the floor
                labels = labels % (vs or vocab)
                for t, tt in ((1.0, 1.0), (0.7, 1.6)):
                    kw = dict(kind=kind, temperature=t, teacher_temperature=tt, vocab_size=vs, impl=impl)
                    ref = reference64(h, W, labels, h_t, W_t, grads, kind, t, tt, vs)
                    v, g = _errors(_run(h, W, labels, h_t, W_t, grads, **kw), ref)
                    g_tol = 1e-5 if dtype == torch.float32 else 2e-2  # bf16: the logit-gradient blocks are bf16
                    cases += 1
                    if not (v < 1e-5 and g < g_tol):
                        failed.append((str(dtype), kind, n, vocab, t, f"values {v:.2e}", f"grads {g:.2e}"))
    print(f"device checks against fp64 ({impl}): {cases - len(failed)}/{cases} passed", flush=True)
    for f in failed:
        print("  FAILED", f, flush=True)
    return not failed


def full_size_check(h, W, labels, h_t, W_t, grads):
    """At the benchmark's size, the Triton path against the chunked PyTorch path (fp32 blocks)."""
    a = _run(h, W, labels, h_t, W_t, grads, impl="triton")
    b = _run(h, W, labels, h_t, W_t, grads, impl="torch")
    return dict(zip(("values", "grads"), _errors(a, ((x.double() for x in b[0]), (x.double() for x in b[1])))))


# ---------------------------------------------------------------------------------------------
# Timing and memory
# ---------------------------------------------------------------------------------------------
def bench(tokens, hidden, hidden_t, vocab, device, reps, impl, methods):
    h, W, labels, h_t, W_t, grads = make_problem(tokens, hidden, hidden_t, vocab, device)
    logits_bytes = tokens * vocab * 2
    print(f"\n{tokens} tokens x vocab {vocab}, student hidden {hidden}, teacher hidden {hidden_t} "
          f"(bf16 logits {logits_bytes / 2**30:.2f} GiB)", flush=True)  # fmt: skip
    dense = {}
    if device.type == "cuda":
        with torch.no_grad():
            for name, (a, b) in (("student logits mm", (h, W)), ("teacher logits mm", (h_t, W_t))):
                out = torch.empty((tokens, vocab), dtype=h.dtype, device=device)
                dense[name] = time_ms(lambda a=a, b=b, out=out: torch.mm(a, b.t(), out=out), device, reps, 2)
                del out
        floor_ratio = (4 * dense["student logits mm"] + 2 * dense["teacher logits mm"]) / (
            4 * dense["student logits mm"]
        )
        print("  dense bf16 mm ms: " + ", ".join(f"{k} {v:.2f}" for k, v in dense.items())
              + f"; floor of this op / head = (4 T_s + 2 T_t) / 4 T_s = {floor_ratio:.2f}", flush=True)  # fmt: skip
        print("  full-size check, Triton vs PyTorch path (relative):", full_size_check(h, W, labels, h_t, W_t, grads))
    rows, head_ms = [], None
    for name, method in methods:

        def step(method=method):
            h.grad, W.grad = None, None
            method(h, W, labels, h_t, W_t, grads, impl=impl).backward()

        try:
            ms = time_ms(step, device, reps, 2)
            raw = peak_extra_bytes(step, device, (h, W))
            extra = None if raw is None else (raw - (h.numel() + W.numel()) * h.element_size()) / logits_bytes
        except torch.OutOfMemoryError:
            ms, extra = float("nan"), float("nan")
        h.grad, W.grad = None, None
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        head_ms = ms if head_ms is None else head_ms
        rows.append(dict(method=name, tokens=tokens, hidden=hidden, hidden_t=hidden_t, vocab=vocab, ms=ms,
                         vs_head=ms / head_ms, extra_logits=extra, device=str(device), impl=impl))  # fmt: skip
        fmt = "-" if extra is None else f"{extra:.3f}"
        print(f"  {name:<40} {ms:10.2f} ms  x{ms / head_ms:.2f} of the head  extra peak {fmt} logits", flush=True)
    return rows, dense


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tiny", action="store_true", help="CPU smoke run: small shapes, PyTorch path, checks against fp64")
    p.add_argument("--tokens", type=int, default=None)
    p.add_argument("--vocab", type=int, default=None)
    p.add_argument("--hidden", type=int, default=None, help="student hidden size (default 1,536)")
    p.add_argument("--teacher-hidden", type=int, default=None, help="teacher hidden size (default 3,584)")
    p.add_argument("--reps", type=int, default=None)
    p.add_argument("--methods", default=None, help="comma-separated substrings of method names")
    p.add_argument("--no-check", action="store_true")
    p.add_argument(
        "--json", default=None, help="write the rows here (default: $OUT/linear_distill.json when OUT is set)"
    )
    args = p.parse_args(argv)
    device = torch.device("cpu" if args.tiny else args.device)
    on_gpu = device.type == "cuda"
    impl = "auto" if on_gpu else "torch"
    tokens = args.tokens or (64 if args.tiny else 16384)
    vocab = args.vocab or (512 if args.tiny else 151936)
    hidden, hidden_t = args.hidden or (32 if args.tiny else 1536), args.teacher_hidden or (48 if args.tiny else 3584)
    reps = args.reps or (2 if args.tiny else 10)
    if on_gpu:
        import triton

        print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__, flush=True)
    ok = True
    if not args.no_check:
        ok = device_checks(device, "triton" if on_gpu else "torch")
    methods = [m for m in METHODS if not args.methods or any(s in m[0] for s in args.methods.split(","))]
    rows, dense = bench(tokens, hidden, hidden_t, vocab, device, reps, impl, methods)
    print("\n| method | tokens | vocab | hidden / teacher | fwd+bwd ms | / fused head | extra peak (logits) |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        extra = "-" if r["extra_logits"] is None else f"{r['extra_logits']:.3f}"
        print(f"| {r['method']} | {r['tokens']:,} | {r['vocab']:,} | {r['hidden']:,} / {r['hidden_t']:,} | "
              f"{r['ms']:.2f} | {r['vs_head']:.2f} | {extra} |")  # fmt: skip
    path = args.json or (Path(os.environ["OUT"]) / "linear_distill.json" if os.environ.get("OUT") else None)
    if path:
        path = Path(path)
        path.write_text(json.dumps(dict(rows=rows, dense_ms=dense, checks_passed=ok), indent=1))
        print("wrote", path)
    sync(device)
    if not ok:
        sys.exit(1)


if __name__ == "__main__":
    main()
