"""Benchmark of fnppo.linear_logprob_and_entropy (fused output layer) against materialized logits.

Forward + backward of per-token log-probs and entropy from bf16 hidden states ``h [tokens, hidden]``
and an output weight ``W [vocab, hidden]``, gradients for both, TP=1:

* fused (triton)          ``linear_logprob_and_entropy(h, W, labels)`` (Triton kernels + cuBLAS)
* fused, checks off       the same under ``typechecking(False)`` (no shape checks, no label sync)
* fused (torch chunked)   ``impl="torch"``: the CPU path, fp32 blocks (slow on a GPU; a reference)
* materialized + fnppo    ``logits = h @ W.T`` (bf16), then ``logprob_and_entropy`` on the logits
* plain torch             ``logits = h @ W.T``, ``logits.float().log_softmax(-1)``, gather, entropy

and, timed in the same run, the dense bf16 matrix products the fused method must do: the logits
``h @ W.T`` (forward), the same again (the backward's recompute), ``G @ W`` and ``G.T @ h`` (the two
gradient products, ``G`` a bf16 ``[tokens, vocab]`` gradient), each as one ``torch.mm``.

Columns: median fwd+bwd time (CUDA events); TFLOP/s counting the model's 3 products
(``6 * tokens * vocab * hidden`` flops; the fused method executes a 4th, the recompute); extra peak
memory in units of one bf16 ``[tokens, vocab]`` logits tensor, = (peak during fwd+bwd - memory with
the inputs allocated - bytes of the two input gradients) / logits bytes; the same without
subtracting the gradients ("raw"); and the ratio of the fused time to the 4 dense products.

    python benchmarks/linear_logprob.py                 # GPU: device checks + 8192/16384 x 896/4096 x 151936
    python benchmarks/linear_logprob.py --check-only    # GPU: only the checks against fp64
    python benchmarks/linear_logprob.py --device cpu    # small CPU run
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import fp64_logprob_entropy, peak_extra_bytes, time_ms  # noqa: E402
from _common import fwd_bwd as _fwd_bwd  # noqa: E402

from fnppo.core.ops.linear_logprob import BackwardGraphs, linear_logprob_and_entropy  # noqa: E402
from fnppo.core.ops.logprob import logprob_and_entropy  # noqa: E402
from fnppo.core.typing import typechecking  # noqa: E402


# ---------------------------------------------------------------------------------------------
# Methods: each takes (h, W, labels, g_lp, g_h) and returns the loss to backpropagate.
# ---------------------------------------------------------------------------------------------
def fused(h, W, labels, g_lp, g_h, impl="triton"):
    lp, ent = linear_logprob_and_entropy(h, W, labels, impl=impl)
    return (lp * g_lp).sum() + (ent * g_h).sum()


def fused_unchecked(h, W, labels, g_lp, g_h):
    with typechecking(False):
        return fused(h, W, labels, g_lp, g_h)


GRAPHS = {}  # one BackwardGraphs per problem (by the weight's address), for the "graphs" method


def fused_graphed(h, W, labels, g_lp, g_h):
    """Checks off, the backward replayed as a CUDA graph (``graphs=fnppo.ops.BackwardGraphs()``)."""
    graphs = GRAPHS.setdefault(W.data_ptr(), BackwardGraphs())
    with typechecking(False):
        lp, ent = linear_logprob_and_entropy(h, W, labels, graphs=graphs)
    return (lp * g_lp).sum() + (ent * g_h).sum()


def fused_torch(h, W, labels, g_lp, g_h):
    return fused(h, W, labels, g_lp, g_h, impl="torch")


def materialized_fnppo(h, W, labels, g_lp, g_h):
    lp, ent = logprob_and_entropy(h @ W.t(), labels)
    return (lp * g_lp).sum() + (ent * g_h).sum()


def plain_torch(h, W, labels, g_lp, g_h):
    logp = (h @ W.t()).float().log_softmax(-1)
    lp = logp.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1)
    return (lp * g_lp).sum() + (ent * g_h).sum()


METHODS = [
    ("fused linear_logprob_and_entropy (triton)", fused, "cuda"),
    ("fused, checks off", fused_unchecked, "cuda"),
    ("fused, checks off, backward graphs", fused_graphed, "cuda"),
    ("fused, impl='torch' (chunked fp32 path)", fused_torch, None),
    ("h @ W.T, then logprob_and_entropy", materialized_fnppo, None),
    ("plain torch: h @ W.T, log_softmax", plain_torch, None),
]


# ---------------------------------------------------------------------------------------------
# Timing and memory
# ---------------------------------------------------------------------------------------------
def fwd_bwd(method, h, W, labels, g_lp, g_h):
    return _fwd_bwd(method, (h, W), labels, g_lp, g_h)


def extra_memory(step, h, W, device, logits_bytes):
    """(extra without the input gradients, raw extra), in logits tensors."""
    raw = peak_extra_bytes(step, device, (h, W))
    if raw is None:
        return None, None
    grads = h.numel() * h.element_size() + W.numel() * W.element_size()
    return (raw - grads) / logits_bytes, raw / logits_bytes


def dense_matmuls_ms(h, W, device, reps, b2b=1):
    """Median times of the 4 dense products the fused method does, each one torch.mm (bf16)."""
    t, hid = h.shape
    v = W.shape[0]
    hd, wd = h.detach(), W.detach()
    out_logits = torch.empty((t, v), dtype=h.dtype, device=device)
    grad = torch.randn((t, v), device=device, dtype=torch.float32).to(h.dtype) * 1e-3
    out_h = torch.empty((t, hid), dtype=h.dtype, device=device)
    out_w = torch.empty((v, hid), dtype=h.dtype, device=device)
    fwd = time_ms(lambda: torch.mm(hd, wd.t(), out=out_logits), device, reps, 3, b2b)  # noqa: F821
    dh = time_ms(lambda: torch.mm(grad, wd, out=out_h), device, reps, 3, b2b)  # noqa: F821
    dw = time_ms(lambda: torch.mm(grad.t(), hd, out=out_w), device, reps, 3, b2b)  # noqa: F821
    del out_logits, grad, out_h, out_w
    return {"logits (fwd)": fwd, "logits (recompute)": fwd, "dh = G @ W": dh, "dW = G.T @ h": dw}


def make_problem(tokens, hidden, vocab, device, dtype=torch.bfloat16, seed=0, logit_std=2.0):
    g = torch.Generator(device=device).manual_seed(seed)
    h = torch.randn(tokens, hidden, generator=g, device=device).to(dtype).requires_grad_()
    W = (torch.randn(vocab, hidden, generator=g, device=device) * (logit_std / hidden**0.5)).to(dtype).requires_grad_()
    labels = torch.randint(0, vocab, (tokens,), generator=g, device=device)
    g_lp = torch.randn(tokens, generator=g, device=device)
    g_h = torch.randn(tokens, generator=g, device=device)
    return h, W, labels, g_lp, g_h


# ---------------------------------------------------------------------------------------------
# Correctness on the device
# ---------------------------------------------------------------------------------------------
def reference64(h, W, labels, t, g_lp, g_h, vocab_size=None):
    hr = h.detach().double().requires_grad_()
    wr = W.detach().double().requires_grad_()
    x = hr @ wr.t()
    if vocab_size is not None:
        x = x[:, :vocab_size]
    lp, ent = fp64_logprob_entropy(x, labels, t, g_lp, g_h)
    return lp.detach(), ent.detach(), hr.grad, wr.grad


def _run(fn_impl, h, W, labels, t, g_lp, g_h, vocab_size, with_entropy=True):
    hg, wg = h.detach().clone().requires_grad_(), W.detach().clone().requires_grad_()
    if fn_impl == "materialized":
        x = hg @ wg.t()
        if vocab_size is not None:
            x = x[:, :vocab_size]
        lp, ent = logprob_and_entropy(x, labels, temperature=t, with_entropy=with_entropy)
    else:
        lp, ent = linear_logprob_and_entropy(
            hg, wg, labels, temperature=t, with_entropy=with_entropy, vocab_size=vocab_size, impl=fn_impl
        )
    loss = (lp * g_lp).sum() if g_lp is not None else 0
    loss = loss + ((ent * g_h).sum() if g_h is not None and ent is not None else 0)
    loss.backward()
    return lp, ent, hg.grad, wg.grad


def _errs(out, ref):
    lp, ent, dh, dw = out
    rlp, rent, rdh, rdw = ref
    e = {"lp": (lp.double() - rlp).abs().max().item()}
    e["ent"] = 0.0 if ent is None else (ent.double() - rent).abs().max().item()
    e["dh"] = ((dh.double() - rdh).abs().max() / rdh.abs().max().clamp_min(1e-30)).item()
    e["dW"] = ((dw.double() - rdw).abs().max() / rdw.abs().max().clamp_min(1e-30)).item()
    finite = all(bool(torch.isfinite(x).all()) for x in (lp, dh, dw)) and (
        ent is None or bool(torch.isfinite(ent).all())
    )
    return e, finite


def device_checks(device):
    """Triton and torch paths against fp64 (and the materialized path as the bf16 yardstick)."""
    g = torch.Generator(device=device).manual_seed(5)
    cases = []
    for dtype in (torch.bfloat16, torch.float32, torch.float16):
        for tokens, hid, vocab in ((300, 256, 5000), (1, 1000, 7), (257, 1000, 3001)):
            cases.append((dtype, tokens, hid, vocab, 1.0, "plain"))
    cases += [
        (torch.bfloat16, 300, 256, 5000, 0.7, k)
        for k in ("plain", "masked", "no_entropy", "logprob_only", "entropy_only", "large")
    ]
    cases += [(torch.float32, 300, 256, 5000, 0.7, k) for k in ("masked", "large")]
    n_ok, fails = 0, []
    for dtype, tokens, hid, vocab, t, kind in cases:
        std = 300.0 if kind == "large" else 3.0
        h = torch.randn(tokens, hid, generator=g, device=device).to(dtype)
        W = (torch.randn(vocab, hid, generator=g, device=device) * std / hid**0.5).to(dtype)
        vs = vocab - 37 if kind == "masked" else None
        labels = torch.randint(0, vs or vocab, (tokens,), generator=g, device=device)
        g_lp = None if kind == "entropy_only" else torch.randn(tokens, generator=g, device=device)
        g_h = None if kind in ("no_entropy", "logprob_only") else torch.randn(tokens, generator=g, device=device)
        ref = reference64(h, W, labels, t, g_lp, g_h, vs)
        base, _ = _errs(_run("materialized", h, W, labels, t, g_lp, g_h, vs, kind != "no_entropy"), ref)
        for impl in ("triton", "torch"):
            e, finite = _errs(_run(impl, h, W, labels, t, g_lp, g_h, vs, kind != "no_entropy"), ref)
            vtol = 5e-3 if kind == "large" else 1e-4  # fp32 sums over the hidden size (and logits ~ 1e3 when large)
            # within twice the error of the materialized path, or of the dtype's rounding
            gtol = 2 * max(base["dh"], base["dW"], 1e-5 if dtype == torch.float32 else 2.0**-9)
            ok = finite and e["lp"] <= vtol and e["ent"] <= vtol and e["dh"] <= gtol and e["dW"] <= gtol
            n_ok += int(ok)
            if not ok:
                fails.append(
                    (
                        impl,
                        str(dtype),
                        tokens,
                        hid,
                        vocab,
                        t,
                        kind,
                        {k: f"{v:.3g}" for k, v in e.items()},
                        "materialized:",
                        {k: f"{v:.3g}" for k, v in base.items()},
                    )
                )
    print(f"device checks against fp64: {n_ok}/{2 * len(cases)} passed", flush=True)
    for f in fails:
        print("  FAILED:", f, flush=True)
    return not fails


def graph_checks(device):
    """``graphs=BackwardGraphs()`` against the same call without it: for each case a sequence of
    token counts (shrinking within the buffers' rows, growing past them, repeated so that calls run
    eagerly, are captured and are replayed), the weight updated in place, then replaced by a new
    tensor, gradients accumulated over two backward passes into ``.grad``, and stale rows of a
    larger call holding NaN. Passes when every call's gradients equal the call without graphs
    within the dtype's rounding, and the cache's results (captured or replayed) equal bit for bit
    those of a fresh cache's eager call on the same padded problem."""
    g = torch.Generator(device=device).manual_seed(11)
    n_ok, n_all, fails = 0, 0, []
    cases = [
        (torch.bfloat16, 256, 5000, "plain"),
        (torch.bfloat16, 1000, 3001, "no_entropy"),
        (torch.bfloat16, 256, 5000, "entropy_only"),
        (torch.float32, 256, 5000, "plain"),
        (torch.bfloat16, 896, 151936, "plain"),
        (torch.float16, 256, 4999, "masked"),
    ]

    def loss_of(use, hg, W, labels, g_lp, g_h, kind, vs):
        lp, ent = linear_logprob_and_entropy(
            hg, W, labels, with_entropy=kind != "no_entropy", vocab_size=vs, graphs=use
        )
        return ((lp * g_lp).sum() if g_lp is not None else 0) + ((ent * g_h).sum() if g_h is not None else 0)

    def grads(use, h, W, labels, g_lp, g_h, kind, vs):
        hg = h.clone().requires_grad_()
        return torch.autograd.grad(loss_of(use, hg, W, labels, g_lp, g_h, kind, vs), (hg, W))

    for dtype, hid, vocab, kind in cases:
        graphs = BackwardGraphs()
        W = (torch.randn(vocab, hid, generator=g, device=device) * 3.0 / hid**0.5).to(dtype).requires_grad_()
        vs = vocab - 37 if kind == "masked" else None
        small = vocab < 100000
        seq = [300, 300, 300, 200, 200, 700, 700, 700, 260] if small else [8192, 8192, 8192, 8000, 8000]
        for step, n in enumerate(seq):
            if step == 2:
                with torch.no_grad():
                    W.add_(0.01 * torch.randn(W.shape, generator=g, device=device).to(dtype))  # updated in place
            elif step == 4:
                W = (
                    W.detach() + 0.01 * torch.randn(W.shape, generator=g, device=device).to(dtype)
                ).requires_grad_()  # a new tensor
            h = torch.randn(n, hid, generator=g, device=device).to(dtype)
            nan_step = small and step == 7
            if nan_step:
                h[250:] = float("nan")  # rows this call leaves in the buffers: the next, smaller call must not see them
            labels = torch.randint(0, vs or vocab, (n,), generator=g, device=device)
            g_lp = None if kind == "entropy_only" else torch.randn(n, generator=g, device=device)
            g_h = None if kind == "no_entropy" else torch.randn(n, generator=g, device=device)
            outs = [grads(use, h, W, labels, g_lp, g_h, kind, vs) for use in (None, graphs, BackwardGraphs())]
            n_all += 2
            if nan_step:
                errs, ok = [], True
            elif small:  # both against fp64: the cache's error within twice the plain call's (or the dtype's rounding)
                _, _, rdh, rdw = reference64(h, W, labels, 1.0, g_lp, g_h, vs)
                rel = lambda a, r: ((a.double() - r).abs().max() / r.abs().max().clamp_min(1e-30)).item()  # noqa: E731
                floor = 1e-5 if dtype == torch.float32 else 2.0**-9
                errs = [(rel(b, r), rel(a, r)) for a, b, r in zip(outs[0], outs[1], (rdh, rdw))]
                ok = all(eb <= 2 * max(ea, floor) for eb, ea in errs)
            else:  # 8,192 x 151,936: against the call without graphs, within a few bf16 roundings
                errs = [
                    ((a.float() - b.float()).abs().max() / a.float().abs().max().clamp_min(1e-30)).item()
                    for a, b in zip(outs[0], outs[1])
                ]
                ok = all(e <= 2.0**-6 for e in errs)
            n_ok += int(ok)
            if not ok:
                fails.append((str(dtype), hid, vocab, kind, step, n, "vs without graphs", errs))
            same = all(torch.equal(torch.nan_to_num(a), torch.nan_to_num(b)) for a, b in zip(outs[1], outs[2]))
            n_ok += int(same)
            if not same:
                fails.append(
                    (
                        str(dtype),
                        hid,
                        vocab,
                        kind,
                        step,
                        n,
                        "differs from a fresh cache's eager call of the same padded problem",
                    )
                )
            if step == 1:  # two backward passes accumulate into .grad: the returned gradients do not alias the buffers
                W.grad = None
                for _ in range(2):
                    loss_of(graphs, h, W, labels, g_lp, g_h, kind, vs).backward()
                n_all += 1
                one = outs[1][1].float()
                ok = bool((W.grad.float() - 2 * one).abs().max() <= one.abs().max() * 2.0**-6)
                n_ok += int(ok)
                if not ok:
                    fails.append((str(dtype), hid, vocab, kind, "accumulation over two backward passes"))
                W.grad = None
        print(f"  graphs {str(dtype)} {hid} x {vocab} {kind}: {graphs}", flush=True)
        n_all += 1
        n_ok += int(graphs.captures > 0 and graphs.replays > 0)
        if graphs.captures == 0 or graphs.replays == 0:
            fails.append((str(dtype), hid, vocab, kind, f"no capture or no replay: {graphs}"))
    print(f"graph checks against the call without graphs: {n_ok}/{n_all} passed", flush=True)
    for f in fails:
        print("  FAILED:", f, flush=True)
    return not fails


def fallback_checks(device):
    """A capture that fails falls back to eager: the fused backward made to synchronize with the
    device while its first capture runs (an operation CUDA graphs forbid) must warn once, give the
    gradients of a fresh cache's eager call bit for bit, run that key eagerly from then on without
    warning again, and leave the device healthy: another token count is then captured and replayed
    with the right results. Passes when all of that holds."""
    import warnings

    import fnppo.core.ops.linear_logprob as ll

    g = torch.Generator(device=device).manual_seed(13)
    hid, vocab = 256, 5000
    W = (torch.randn(vocab, hid, generator=g, device=device) * 3.0 / hid**0.5).to(torch.bfloat16).requires_grad_()
    graphs = BackwardGraphs()
    real, broken = ll._grads, [0]

    def syncing_grads(*a, **kw):  # noqa: ANN002, ANN003
        if torch.cuda.is_current_stream_capturing() and broken[0] == 0:
            broken[0] += 1
            torch.cuda.synchronize()  # not permitted while capturing: the capture fails
        return real(*a, **kw)

    def grads(use, n, seed):
        gg = torch.Generator(device=device).manual_seed(seed)
        h = torch.randn(n, hid, generator=gg, device=device).to(torch.bfloat16).requires_grad_()
        labels = torch.randint(0, vocab, (n,), generator=gg, device=device)
        lp, ent = linear_logprob_and_entropy(h, W, labels, graphs=use)
        return torch.autograd.grad((lp * torch.randn(n, generator=gg, device=device)).sum() + ent.sum(), (h, W))

    results, fails = [], []
    ll._grads = syncing_grads
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            for i, n in enumerate([300, 300, 300, 300, 700, 700, 700]):
                got = grads(graphs, n, 100 + i)
                want = grads(BackwardGraphs(), n, 100 + i)  # a fresh cache: its first call runs eagerly
                results.append(all(torch.equal(a, b) for a, b in zip(got, want)))
                torch.cuda.synchronize()
    finally:
        ll._grads = real
    ours = [w for w in seen if "capturing the fused backward failed" in str(w.message)]
    checks = {
        "the capture was made to fail once": broken[0] == 1,
        "one warning": len(ours) == 1,
        "every call's gradients equal a fresh cache's eager call": all(results),
        "the failed key ran eagerly (1 first sight + failed capture + 2 later calls), the other key was captured": graphs.eager_calls
        == 5
        and graphs.captures == 1,
        "the other key was replayed": graphs.replays == 1,
    }
    for name, ok in checks.items():
        if not ok:
            fails.append(name)
    print(
        f"  fallback: {graphs}; results equal: {results}; warnings: {[str(w.message)[:120] for w in ours]}", flush=True
    )
    print(f"capture-failure checks: {sum(checks.values())}/{len(checks)} passed", flush=True)
    for f in fails:
        print("  FAILED:", f, flush=True)
    return not fails


def full_size_check(h, W, labels, g_lp, g_h):
    """At the benchmark size: fused (triton) against fp64 on the first 256 tokens' values, and its
    gradients against the materialized bf16 path and the fp32 torch path."""
    out = {}
    n = min(256, h.shape[0])
    lp, ent, dh, dw = _run("triton", h, W, labels, 1.0, g_lp, g_h, None)
    x = h.detach()[:n].double() @ W.detach().double().t()
    logp = x.log_softmax(-1)
    out["max |lp - fp64| (256 tokens)"] = (
        (lp[:n].double() - logp.gather(-1, labels[:n].unsqueeze(-1)).squeeze(-1)).abs().max().item()
    )
    out["max |H - fp64| (256 tokens)"] = (ent[:n].double() + (logp.exp() * logp).sum(-1)).abs().max().item()
    del x, logp
    for name in ("materialized", "torch"):
        _, _, dh2, dw2 = _run(name, h, W, labels, 1.0, g_lp, g_h, None)
        out[f"max |dh - dh_{name}| / max|dh|"] = (
            (dh.float() - dh2.float()).abs().max() / dh2.float().abs().max()
        ).item()
        out[f"max |dW - dW_{name}| / max|dW|"] = (
            (dw.float() - dw2.float()).abs().max() / dw2.float().abs().max()
        ).item()
        del dh2, dw2
    out["all finite"] = bool(
        torch.isfinite(lp).all() and torch.isfinite(ent).all() and torch.isfinite(dh).all() and torch.isfinite(dw).all()
    )
    return out


def backward_parts(h, W, labels, reps):
    """The fused backward's three parts timed alone with its own block sizes: the Triton kernel that
    recomputes the logits and writes the logit-gradient blocks; dh += dz @ W_block (fp32
    accumulator); dW_block = dz.T @ h_group."""
    from fnppo.core.kernels import linear_logprob_launch as k
    from fnppo.core.ops import linear_logprob as ll

    n, hid = h.shape
    v = W.shape[0]
    cfg = ll._Cfg(1.0, True, None, 1, 0, v, v, "triton", None, None, None)
    sizes = ll._backward_chunks(n, v, hid, h.element_size(), cfg)
    gt, bv = sizes["group_tokens"], sizes["block_vocab"]
    hd, wd = h.detach(), W.detach()
    f32 = dict(dtype=torch.float32, device=h.device)
    coef = k.scaled_coefficients(
        (torch.randn(n, **f32), torch.randn(n, **f32), torch.randn(n, **f32), torch.full((n,), 12.0, **f32)), 1.0
    )
    dz = torch.zeros((min(gt, n), min(bv, v)), dtype=h.dtype, device=h.device)
    acc = torch.zeros((min(gt, n), hid), **f32)
    dw = torch.empty_like(wd)
    blocks = [(g0, min(n, g0 + gt), c0, min(v, c0 + bv)) for g0 in range(0, n, gt) for c0 in range(0, v, bv)]
    tma = k._tma_wanted(h.device) and k._tma_ok(hd, wd, dz)
    ptrs = (k._desc(hd), k._desc(wd), k._desc(dz)) if tma else (hd, wd, dz)
    strides = (hd.stride(0), wd.stride(0), dz.stride(0))

    def kern():
        for g0, g1, c0, c1 in blocks:
            k._launch_dz(ptrs, labels, coef, (g0, g1 - g0, c0, c1 - c0), strides, c0, k.LOG2E, True, tma)

    def dh_part():
        for g0, g1, c0, c1 in blocks:
            k._accumulate(acc[: g1 - g0], dz[: g1 - g0, : c1 - c0], wd[c0:c1])

    def dw_part():
        for g0, g1, c0, c1 in blocks:
            torch.mm(dz[: g1 - g0, : c1 - c0].t(), hd[g0:g1], out=dw[c0:c1])

    out = {"groups x tokens": f"{-(-n // gt)} x {gt}", "block vocab": bv}
    for name, fn in (("dz kernel", kern), ("dh mm", dh_part), ("dW mm", dw_part)):
        out[name] = round(time_ms(fn, h.device, reps, 2), 2)
    return out


FWD_VARIANTS = [  # (BN, BK, num_warps, num_stages, TMA) of the forward kernel (BM = 128)
    (256, 64, 8, 3, False),
    (256, 64, 8, 4, False),
    (128, 64, 8, 4, False),
    (256, 64, 8, 3, True),
    (256, 64, 8, 4, True),
    (128, 64, 8, 3, True),
    (128, 64, 8, 4, True),
    (128, 128, 8, 3, True),
    (256, 128, 8, 2, True),
    (128, 64, 4, 4, True),
]
DZ_VARIANTS = [  # (BM, BN, BK, num_warps, num_stages, GROUP_M, TMA) of the logit-gradient kernel
    (128, 256, 64, 8, 3, 8, False),
    (128, 256, 64, 8, 4, 8, False),
    (256, 128, 64, 8, 3, 8, False),
    (128, 256, 64, 8, 3, 8, True),
    (128, 256, 64, 8, 4, 8, True),
    (256, 128, 64, 8, 3, 8, True),
    (128, 128, 64, 8, 4, 8, True),
    (128, 128, 64, 4, 3, 8, True),
    (128, 128, 64, 4, 4, 8, True),
    (128, 256, 128, 8, 2, 8, True),
    (64, 256, 64, 4, 4, 8, True),
]


def kernel_variants(tokens, hidden, vocab, reps, device=None):
    """The fused kernels launched with each tile/pipeline variant (no autotuning), timed alone at
    one shape: the forward over the whole vocabulary, the logit-gradient kernel over one backward
    block of the function's own size; each against the dense bf16 product of the same size.
    ``TMA``: tiles read (and written) through tensor descriptors, else pointer loads."""
    from fnppo.core.kernels import linear_logprob_launch as k
    from fnppo.core.ops import linear_logprob as ll

    device = device or torch.device("cuda")
    h, W, labels, _, _ = make_problem(tokens, hidden, vocab, device)
    hd, wd = h.detach(), W.detach()
    n = tokens
    f32 = dict(dtype=torch.float32, device=device)
    rows = []
    splits = k._num_splits(n, vocab, device, k._FWD_BM)
    per = -(-(-(-vocab // splits)) // 256) * 256
    splits = -(-vocab // per)
    bufs = [torch.empty((splits, n), **f32) for _ in range(3)]
    dense_fwd = time_ms(lambda: torch.mm(hd, wd.t()), device, reps, 3)
    for bn, bk, warps, stages, tma in FWD_VARIANTS:
        ptrs = (
            (k._with_blocks(k._desc(hd), [k._FWD_BM, bk]), k._with_blocks(k._desc(wd), [bn, bk])) if tma else (hd, wd)
        )

        def fwd():
            k._fwd_kernel[(splits, -(-n // k._FWD_BM))](
                *ptrs,
                *bufs,
                n,
                vocab,
                hidden,
                hd.stride(0),
                wd.stride(0),
                k.LOG2E,
                per,
                WITH_ENT=True,
                BM=k._FWD_BM,
                BN=bn,
                BK=bk,
                IEEE=False,
                EVEN_K=hidden % bk == 0,
                TMA=tma,
                num_warps=warps,
                num_stages=stages,
            )

        name = f"BN={bn} BK={bk} warps={warps} stages={stages} {'TMA' if tma else 'pointers'}"
        try:
            ms = time_ms(fwd, device, reps, 2)
        except Exception as err:  # noqa: BLE001 - e.g. out of shared memory: report and go on
            ms = float("nan")
            print(f"  forward {name}: {type(err).__name__}: {str(err)[:160]}", flush=True)
        rows.append(("forward", name, ms, dense_fwd))
        print(f"  forward {name}: {ms:.3f} ms (dense {dense_fwd:.3f})", flush=True)
    cfg = ll._Cfg(1.0, True, None, 1, 0, vocab, vocab, "triton", None, None, None)
    sizes = ll._backward_chunks(n, vocab, hidden, h.element_size(), cfg)
    gt, bv = min(sizes["group_tokens"], n), min(sizes["block_vocab"], vocab)
    coef = k.scaled_coefficients(
        (torch.randn(gt, **f32), torch.randn(gt, **f32), torch.randn(gt, **f32), torch.full((gt,), 12.0, **f32)), 1.0
    )
    dz = torch.empty((gt, bv), dtype=h.dtype, device=device)
    hg, wb = hd[:gt], wd[:bv]
    dense_blk = time_ms(lambda: torch.mm(hg, wb.t(), out=dz), device, reps, 3)
    for bm, bn, bk, warps, stages, gm, tma in DZ_VARIANTS:
        if tma:
            ptrs = (
                k._with_blocks(k._desc(hg), [bm, bk]),
                k._with_blocks(k._desc(wb), [bn, bk]),
                k._with_blocks(k._desc(dz), [bm, bn]),
            )
        else:
            ptrs = (hg, wb, dz)

        def dzk():
            grid = (triton_cdiv(gt, bm) * triton_cdiv(bv, bn),)
            k._dz_kernel[grid](
                ptrs[0],
                ptrs[1],
                labels[:gt],
                *coef,
                ptrs[2],
                0,
                gt,
                0,
                bv,
                hidden,
                hg.stride(0),
                wb.stride(0),
                dz.stride(0),
                0,
                k.LOG2E,
                HAS_GH=True,
                BM=bm,
                BN=bn,
                BK=bk,
                GROUP_M=gm,
                IEEE=False,
                EVEN_K=hidden % bk == 0,
                TMA=tma,
                num_warps=warps,
                num_stages=stages,
            )

        name = f"BM={bm} BN={bn} BK={bk} warps={warps} stages={stages} GROUP_M={gm} {'TMA' if tma else 'pointers'}"
        try:
            ms = time_ms(dzk, device, reps, 2)
        except Exception as err:  # noqa: BLE001
            ms = float("nan")
            print(f"  dz {name}: {type(err).__name__}: {str(err)[:160]}", flush=True)
        rows.append(("logit-gradient block", name, ms, dense_blk))
        print(f"  dz {name}: {ms:.3f} ms (dense block {dense_blk:.3f})", flush=True)
    print(f"\n{tokens} x {hidden} x {vocab}; backward block {gt} x {bv} ({-(-vocab // bv)} blocks)")
    print("| kernel | variant | ms | dense product ms | ratio |")
    print("|---|---|---|---|---|")
    for kind, var, ms, dense in rows:
        print(f"| {kind} | {var} | {ms:.3f} | {dense:.3f} | {ms / dense:.2f} |")
    return rows


def host_time(tokens, hidden, vocab, device):
    """Host side of one fused forward + backward (checks off): when the host returns from it and when
    the GPU is done (no syncs inside), then cProfile's top functions over 5 steps."""
    import cProfile
    import io
    import pstats

    h, W, labels, g_lp, g_h = make_problem(tokens, hidden, vocab, device)
    step = fwd_bwd(fused_unchecked, h, W, labels, g_lp, g_h)
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    step()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    print(
        f"\nhost time {tokens} x {hidden} x {vocab} (checks off): one step returns to the host after "
        f"{1e3 * (t1 - t0):.2f} ms, the GPU is done after {1e3 * (t2 - t0):.2f} ms"
    )
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(5):
        step()
    prof.disable()
    torch.cuda.synchronize()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(15)
    print(out.getvalue())


def _host_us(fn, n=48):
    """Host time per call of ``fn`` while the GPU is busy far ahead (so that no call waits for it)."""
    torch.cuda.synchronize()
    torch.cuda._sleep(int(2e8))  # GPU work queued first: the calls below only enqueue
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / n * 1e6


def launch_cost(tokens, hidden, vocab, device):
    """Host time of the backward's pieces, per call: the logit-gradient kernel through Triton's
    autotuner, launched directly with its chosen config, and through ``_launch_dz`` (what the
    backward calls); the two cuBLAS products of a block; one whole ``backward_grads``."""
    import triton

    from fnppo.core.kernels import linear_logprob_launch as k
    from fnppo.core.ops.linear_logprob import _backward_chunks

    h, W, labels, g_lp, g_h = make_problem(tokens, hidden, vocab, device)
    fwd_bwd(fused_unchecked, h, W, labels, g_lp, g_h)()  # autotunes both kernels
    h2, wv = h.detach(), W.detach()
    n = tokens
    cfg = type(
        "Cfg", (), {"inv_t": 1.0, "vocab_start": 0, "n_valid": vocab, "chunk_tokens": None, "chunk_vocab": None}
    )()
    chunks = _backward_chunks(n, vocab, hidden, 2, cfg)
    cols = chunks["block_vocab"]
    dz_buf = torch.empty((n, cols), dtype=h2.dtype, device=device)
    acc = torch.zeros((n, hidden), dtype=torch.float32, device=device)
    dw = torch.empty_like(wv)
    coef = (g_lp.float(), g_h.float(), -g_lp.float(), torch.randn(n, device=device) + 12)
    coef2 = k.scaled_coefficients(coef, 1.0)
    print(f"\nhost time per call, {tokens} x {hidden} x {vocab} (blocks of {chunks['group_tokens']} x {cols}):")
    for tma in [True, False] if k._tma_wanted(device) else [False]:
        ptrs = (k._desc(h2), k._desc(wv), k._desc(dz_buf)) if tma else (h2, wv, dz_buf)
        strides = (h2.stride(0), wv.stride(0), dz_buf.stride(0))
        args = (ptrs[0], ptrs[1], labels, *coef2[:3], coef2[3], ptrs[2], 0, n, 0, cols, hidden, *strides, 0, k.LOG2E)
        tuned = lambda: k._dz_tuned[lambda meta: (triton.cdiv(n, meta["BM"]) * triton.cdiv(cols, meta["BN"]),)](  # noqa: E731
            *args, HAS_GH=True, IEEE=False, TMA=tma
        )
        tuned()
        best = k._dz_tuned.best_config
        kw = best.kwargs
        grid = (triton.cdiv(n, kw["BM"]) * triton.cdiv(cols, kw["BN"]),)
        direct = lambda: k._dz_kernel[grid](
            *args,
            HAS_GH=True,
            IEEE=False,
            EVEN_K=hidden % kw["BK"] == 0,
            TMA=tma,
            **kw,  # noqa: E731
            num_warps=best.num_warps,
            num_stages=best.num_stages,
        )
        wrapped = lambda: k._launch_dz(ptrs, labels, coef2, (0, n, 0, cols), strides, 0, k.LOG2E, True, tma)  # noqa: E731
        direct()
        wrapped()
        print(
            f"  logit-gradient kernel ({'TMA' if tma else 'pointer loads'}, {best}): autotuner {_host_us(tuned):.1f} us, "
            f"direct {_host_us(direct):.1f} us, _launch_dz {_host_us(wrapped):.1f} us"
        )
    dz, wb = dz_buf, wv[:cols]
    print(
        f"  dh += dz @ W_b (fp32 addmm) {_host_us(lambda: k._accumulate(acc, dz, wb)):.1f} us; "
        f"dW_b = dz.T @ h (mm, out=) {_host_us(lambda: torch.mm(dz.t(), h2, out=dw[:cols])):.1f} us"
    )
    whole = lambda: k.backward_grads(h2, wv, labels, coef, True, cfg, True, dw, **chunks)  # noqa: E731
    whole()
    blocks = -(-n // chunks["group_tokens"]) * -(-vocab // cols)
    print(f"  backward_grads: {_host_us(whole, 6) / 1e3:.2f} ms per call ({blocks} blocks)")
    for name, method in (("without graphs", fused_unchecked), ("backward graphs", fused_graphed)):
        step = fwd_bwd(method, h, W, labels, g_lp, g_h)
        for _ in range(3):
            step()
        print(f"  whole fused forward + backward, checks off, {name}: {_host_us(step, 6) / 1e3:.2f} ms host per call")


def profile_fused(tokens, hidden, vocab, device):
    """Kernels of one fused forward + backward (torch.profiler): time per kernel name, and the GPU idle time."""
    from torch.profiler import ProfilerActivity, profile

    h, W, labels, g_lp, g_h = make_problem(tokens, hidden, vocab, device)
    step = fwd_bwd(fused_unchecked, h, W, labels, g_lp, g_h)
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) * 1e3
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA and "#" not in e.name]
    spans = sorted((e.time_range.start, e.time_range.end) for e in kernels)
    busy, end = 0.0, float("-inf")
    for a, b in spans:
        if b > end:
            busy += b - max(a, end)
            end = b
    by_name = {}
    for e in kernels:
        t = by_name.setdefault(e.name[:90], [0.0, 0])
        t[0] += (e.time_range.end - e.time_range.start) / 1e3
        t[1] += 1
    print(
        f"\nprofile {tokens} x {hidden} x {vocab} (checks off): wall {wall:.2f} ms, kernels {busy / 1e3:.2f} ms, "
        f"first kernel to last {(spans[-1][1] - spans[0][0]) / 1e3:.2f} ms"
    )
    for name, (ms, count) in sorted(by_name.items(), key=lambda kv: -kv[1][0])[:14]:
        print(f"  {ms:8.3f} ms  {count:4d}x  {name}")
    seq = sorted(kernels, key=lambda e: e.time_range.start)
    gaps = sorted(
        ((b.time_range.start - a.time_range.end, a.name[:40], b.name[:40]) for a, b in zip(seq, seq[1:])), reverse=True
    )
    print(
        f"  idle between kernels: {sum(max(0, g[0]) for g in gaps) / 1e3:.2f} ms; largest gaps (us, after -> before):"
    )
    for g, a, b in gaps[:8]:
        print(f"    {g:8.1f}  {a} -> {b}")


def triton_cdiv(a, b):
    return -(-a // b)


# ---------------------------------------------------------------------------------------------
def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tokens", default=None, help="comma-separated token counts")
    p.add_argument("--hidden", default=None, help="comma-separated hidden sizes")
    p.add_argument("--vocab", type=int, default=None)
    p.add_argument("--reps", type=int, default=None)
    p.add_argument("--methods", default=None, help="comma-separated substrings of method names")
    p.add_argument("--check-only", action="store_true")
    p.add_argument(
        "--fallback-only",
        action="store_true",
        help="with --check-only: only the capture-failure checks of BackwardGraphs",
    )
    p.add_argument("--no-check", action="store_true")
    p.add_argument(
        "--variants", action="store_true", help="time the kernels' tile variants at the first shape, then stop"
    )
    p.add_argument(
        "--profile", action="store_true", help="profile one fused fwd+bwd per shape (kernels, GPU idle), then stop"
    )
    p.add_argument(
        "--back-to-back",
        type=int,
        default=1,
        metavar="N",
        help="time N calls issued back to back per sample (host launch latency hidden, as inside a step)",
    )
    p.add_argument(
        "--launch-cost", action="store_true", help="host time per launch of the backward's pieces, per shape, then stop"
    )
    p.add_argument(
        "--host-time", action="store_true", help="host time of one fused fwd+bwd per shape (and cProfile), then stop"
    )
    p.add_argument(
        "--no-tma", action="store_true", help="the 16-bit kernels read their tiles by pointer loads, not TMA"
    )
    args = p.parse_args()
    if args.no_tma:  # a comparison: the device would choose TMA descriptors on Hopper
        from fnppo.core.kernels import linear_logprob_launch

        linear_logprob_launch._tma_wanted = lambda device: False
    device = torch.device(args.device)
    on_gpu = device.type == "cuda"
    tokens_list = [int(x) for x in (args.tokens or ("8192,16384" if on_gpu else "256,512")).split(",")]
    hidden_list = [int(x) for x in (args.hidden or ("896,4096" if on_gpu else "64,256")).split(",")]
    vocab = args.vocab or (151936 if on_gpu else 8192)
    reps = args.reps or (10 if on_gpu else 3)
    if on_gpu:
        from fnppo.core.kernels import linear_logprob_launch as k

        print(
            torch.cuda.get_device_name(),
            "torch",
            torch.__version__,
            "triton",
            __import__("triton").__version__,
            flush=True,
        )
        print("fp32-accumulating addmm available:", k._addmm_fp32_ok("cuda"), flush=True)
        if args.variants:
            kernel_variants(tokens_list[0], hidden_list[0], vocab, reps)
            return
        if args.profile or args.host_time or args.launch_cost:
            fn = profile_fused if args.profile else (host_time if args.host_time else launch_cost)
            for hidden in hidden_list:
                for tokens in tokens_list:
                    fn(tokens, hidden, vocab, device)
            return
        if not args.no_check:
            if not args.fallback_only:
                device_checks(device)
                graph_checks(device)
            fallback_checks(device)
        if args.check_only:
            return
    rows = []
    for hidden in hidden_list:
        for tokens in tokens_list:
            rows += bench_one(tokens, hidden, vocab, device, reps, args)
    print(
        "\n| method | tokens | hidden | fwd+bwd ms | TFLOP/s (6TVH/t) | extra peak (logits) | raw extra peak (logits) | / 4 dense mm |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print("| " + " | ".join(r) + " |")


def bench_one(tokens, hidden, vocab, device, reps, args):
    on_gpu = device.type == "cuda"
    h, W, labels, g_lp, g_h = make_problem(tokens, hidden, vocab, device)
    logits_bytes = tokens * vocab * 2
    flops = 6 * tokens * vocab * hidden
    b2b = f", {args.back_to_back} calls back to back per timed sample" if args.back_to_back > 1 else ""
    print(
        f"\n{tokens} tokens x {hidden} hidden x {vocab} vocab (bf16 logits would be {logits_bytes / 2**30:.2f} GiB){b2b}",
        flush=True,
    )
    dense = dense_matmuls_ms(h, W, device, reps, args.back_to_back) if on_gpu else None
    dense_total = sum(dense.values()) if dense else None
    if dense:
        print(
            "  dense bf16 torch.mm ms: "
            + ", ".join(f"{k} {v:.2f}" for k, v in dense.items())
            + f"; total of 4: {dense_total:.2f}",
            flush=True,
        )
    if on_gpu and not args.no_check:
        print(
            "  full-size check:",
            {
                k: (f"{v:.3g}" if isinstance(v, float) else v)
                for k, v in full_size_check(h, W, labels, g_lp, g_h).items()
            },
            flush=True,
        )
        h.grad, W.grad = None, None
    rows = []
    for name, method, need in METHODS:
        if (need == "cuda" and not on_gpu) or (args.methods and not any(s in name for s in args.methods.split(","))):
            continue
        step = fwd_bwd(method, h, W, labels, g_lp, g_h)
        r = 2 if "torch'" in name else reps
        try:
            ms = time_ms(step, device, r, 1 if "torch'" in name else 3, 1 if "torch'" in name else args.back_to_back)
            extra, raw = extra_memory(step, h, W, device, logits_bytes)
        except torch.OutOfMemoryError:
            ms, extra, raw = float("nan"), float("nan"), float("nan")
        h.grad, W.grad = None, None
        gc.collect()
        if on_gpu:
            torch.cuda.empty_cache()
        ratio = f"{ms / dense_total:.2f}" if dense_total and "fused" in name else "-"
        fmt = lambda v: "-" if v is None else f"{v:.3f}"
        rows.append(
            (
                name,
                str(tokens),
                str(hidden),
                f"{ms:.2f}",
                f"{flops / (ms * 1e-3) / 1e12:.0f}",
                fmt(extra),
                fmt(raw),
                ratio,
            )
        )
        print(f"  {name:<44} {ms:9.2f} ms  extra {fmt(extra)} (raw {fmt(raw)})  ratio to dense {ratio}", flush=True)
    if on_gpu:

        def fwd_only():
            with torch.no_grad():
                linear_logprob_and_entropy(h, W, labels)  # noqa: F821

        f_ms = time_ms(fwd_only, device, reps, 2)
        print(
            f"  fused forward alone {f_ms:.2f} ms (dense logits mm {dense['logits (fwd)']:.2f}); backward by difference "
            f"{float(rows[0][3]) - f_ms:.2f} ms",
            flush=True,
        )
        from fnppo.core.kernels import linear_logprob_launch as k

        print(f"  autotuned: forward {k._fwd_tuned.best_config}, backward dz {k._dz_tuned.best_config}", flush=True)
        print(
            "  backward parts, ms (each timed alone over all blocks):", backward_parts(h, W, labels, reps), flush=True
        )
    del h, W, labels, g_lp, g_h
    gc.collect()
    return rows


if __name__ == "__main__":
    main()
