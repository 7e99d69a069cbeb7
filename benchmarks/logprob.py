"""Benchmark of fnppo.logprob_and_entropy against the usual ways of getting log-probs and entropy.

Forward + backward of per-token log-probs (and entropy) from bf16 logits ``[tokens, vocab]``, TP=1:

* fnppo (triton)         ``logprob_and_entropy`` on CUDA (Triton kernels)
* fnppo (torch chunked)  the same function with ``impl="torch"`` (the CPU path)
* fnppo, no entropy      ``with_entropy=False`` (same work as (a))
* (a) megatron CE        ``megatron.core.tensor_parallel.vocab_parallel_cross_entropy``, log-prob only
* (b) megatron CE + ent  CE on a clone of the logits + a vocab-parallel entropy that keeps the softmax
                         for autograd (the usual fix of the in-place bug)
* (c) plain torch        ``logits.float().log_softmax(-1)``, gather, ``-(p * logp).sum(-1)``

Columns: median fwd+bwd time, "extra copies" = (peak memory during fwd+bwd - memory with the
logits allocated) / logits bytes (the logits gradient alone is 1.0), and for fnppo the achieved
HBM bandwidth counting the minimum traffic (logits read once forward; read once and gradient
written once backward = 3 x logits bytes). A device-to-device copy gives the bandwidth ceiling.

On CPU (or with ``--device cpu``) it runs small sizes and prints the same table (no memory column).
``--tp2`` also runs TP=2 on two GPUs (NCCL; two processes): correctness against TP=1 on the same
logits, and time.

    python benchmarks/logprob.py                       # GPU: 16384 and 8192 tokens x 151936
    python benchmarks/logprob.py --tp2                 # plus TP=2 on two GPUs
    python benchmarks/logprob.py --device cpu          # small CPU run
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import fp64_logprob_entropy, peak_extra_bytes, time_ms  # noqa: E402
from _common import fwd_bwd as _fwd_bwd  # noqa: E402

from fnppo.core.ops.logprob import logprob_and_entropy  # noqa: E402


# ---------------------------------------------------------------------------------------------
# Methods: each takes (x, labels, g_lp, g_h) and returns the loss to backpropagate.
# ---------------------------------------------------------------------------------------------
def fnppo_triton(x, labels, g_lp, g_h):
    lp, ent = logprob_and_entropy(x, labels, impl="triton")
    return (lp * g_lp).sum() + (ent * g_h).sum()


def fnppo_torch(x, labels, g_lp, g_h):
    lp, ent = logprob_and_entropy(x, labels, impl="torch")
    return (lp * g_lp).sum() + (ent * g_h).sum()


def fnppo_no_entropy(x, labels, g_lp, g_h):
    lp, _ = logprob_and_entropy(x, labels, with_entropy=False)
    return (lp * g_lp).sum()


def megatron_ce(x, labels, g_lp, g_h):
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    lp = -vocab_parallel_cross_entropy(x, labels)
    return (lp * g_lp).sum()


def vocab_parallel_entropy(logits, group=None):
    """Entropy over the full vocabulary from vocab-parallel logits, as RL actors write it: the
    softmax of the logits, ``entropy = logsumexp - sum(p * x)``, autograd through it (the softmax
    and the fp32 logits are kept for backward)."""
    x = logits.float()
    if group is None:
        p = torch.softmax(x, dim=-1)
        lse = torch.logsumexp(x, dim=-1)
        return lse - (p * x).sum(-1)
    from torch.distributed.nn.functional import all_reduce

    m = x.detach().amax(-1, keepdim=True)
    dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    e = torch.exp(x - m)
    s = all_reduce(e.sum(-1, keepdim=True), group=group)
    p = e / s
    pz = all_reduce((p * x).sum(-1), group=group)
    return (torch.log(s) + m).squeeze(-1) - pz


def megatron_ce_clone_entropy(x, labels, g_lp, g_h):
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    lp = -vocab_parallel_cross_entropy(x.clone(), labels)
    ent = vocab_parallel_entropy(x)
    return (lp * g_lp).sum() + (ent * g_h).sum()


def plain_torch(x, labels, g_lp, g_h):
    logp = x.float().log_softmax(-1)
    lp = logp.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1)
    return (lp * g_lp).sum() + (ent * g_h).sum()


def fnppo_triton_unchecked(x, labels, g_lp, g_h):
    from fnppo.core.typing import typechecking

    with typechecking(False):  # no shape checks, no label-range sync (production setting)
        return fnppo_triton(x, labels, g_lp, g_h)


METHODS = [
    ("fnppo (triton)", fnppo_triton, "cuda"),
    ("fnppo (triton), checks off", fnppo_triton_unchecked, "cuda"),
    ("fnppo (torch chunked)", fnppo_torch, None),
    ("fnppo, no entropy", fnppo_no_entropy, None),
    ("(a) megatron CE, log-prob only", megatron_ce, None),
    ("(b) megatron CE on clone + entropy", megatron_ce_clone_entropy, None),
    ("(c) plain torch log_softmax", plain_torch, None),
]


# ---------------------------------------------------------------------------------------------
# Timing and memory
# ---------------------------------------------------------------------------------------------
def fwd_bwd(method, x, labels, g_lp, g_h):
    return _fwd_bwd(method, (x,), labels, g_lp, g_h)


def extra_copies(step, x, device):
    extra = peak_extra_bytes(step, device, (x,))
    return None if extra is None else extra / (x.numel() * x.element_size())


def copy_bandwidth(x, device, reps):
    """Device-to-device copy of the logits: GB/s counting bytes read + written (the ceiling)."""
    y = torch.empty_like(x)
    ms = time_ms(lambda: y.copy_(x), device, reps, 3)  # noqa: F821
    del y
    return 2 * x.numel() * x.element_size() / (ms * 1e-3) / 1e9


def make_problem(tokens, vocab, device, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    x = (torch.randn(tokens, vocab, generator=g, device=device) * 2.0).to(torch.bfloat16).requires_grad_()
    labels = torch.randint(0, vocab, (tokens,), generator=g, device=device)
    g_lp = torch.randn(tokens, generator=g, device=device)
    g_h = torch.randn(tokens, generator=g, device=device)
    return x, labels, g_lp, g_h


# ---------------------------------------------------------------------------------------------
# Correctness on the device (full size against the torch path; a slice against fp64)
# ---------------------------------------------------------------------------------------------
def check_correctness(x, labels, g_lp, g_h, impl):
    junk = torch.full_like(x, float("nan"))  # poison the allocator's block the gradient will reuse
    del junk
    xs = x.detach().requires_grad_()
    lp, ent = logprob_and_entropy(xs, labels, impl=impl)
    ((lp * g_lp).sum() + (ent * g_h).sum()).backward()
    grad = xs.grad
    out = {"all finite": bool(torch.isfinite(lp).all() and torch.isfinite(ent).all() and torch.isfinite(grad).all())}
    n = min(256, x.shape[0])
    xr = x.detach()[:n].double().requires_grad_()
    logp = xr.log_softmax(-1)
    rlp = logp.gather(-1, labels[:n].unsqueeze(-1)).squeeze(-1)
    rent = -(logp.exp() * logp).sum(-1)
    ((rlp * g_lp[:n].double()).sum() + (rent * g_h[:n].double()).sum()).backward()
    out["max |lp - fp64|"] = (lp[:n].double() - rlp).abs().max().item()
    out["max |H - fp64|"] = (ent[:n].double() - rent).abs().max().item()
    rg = xr.grad
    out["max |grad - fp64| / max|grad|"] = ((grad[:n].double() - rg).abs().max() / rg.abs().max()).item()
    # bf16 gradient = exact value rounded to nearest: within half a bf16 ulp (2^-9 relative) + fp32 error
    rel = (grad[:n].double() - rg).abs() / (rg.abs() + 1e-30)
    out["grad within bf16 rounding (frac)"] = (
        ((rel <= 2.0**-8) | ((grad[:n].double() - rg).abs() < 1e-7)).double().mean().item()
    )
    return out, (lp.detach(), ent.detach(), grad)


def device_checks(device):
    """fp64-reference checks of every path on the device: dtypes, temperatures, odd vocab sizes
    (unaligned rows), -inf entries, large logits, strided rows, one output unused."""

    def reference(x, labels, t, g_lp, g_h):
        xr = x.detach().double()
        xr = torch.where(torch.isneginf(xr), torch.full_like(xr, -1e6), xr).requires_grad_()
        lp, ent = fp64_logprob_entropy(xr, labels, t, g_lp, g_h)
        return lp, ent, xr.grad

    eps = {torch.float32: 2e-6, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
    g = torch.Generator(device=device).manual_seed(5)
    n_ok, n_all, worst = 0, 0, []
    # Few distinct (dtype, vocab) pairs: each is a new kernel specialization to compile and tune.
    cases = [(torch.bfloat16, v, t, "plain") for v in (7, 50257, 151936) for t in (1.0, 0.7)]
    cases += [(torch.float32, 1000, 0.7, "plain"), (torch.float16, 1000, 1.0, "plain")]
    cases += [
        (torch.bfloat16, 32000, 1.0, k)
        for k in ("neginf", "large", "strided", "no_entropy", "entropy_only", "logprob_only")
    ]
    cases += [(torch.float32, 1000, 0.5, k) for k in ("neginf", "large")]
    for dtype, vocab, t, kind in cases:
        tokens = 48
        x = torch.randn(tokens, vocab + (64 if kind == "strided" else 0), generator=g, device=device) * 3
        if kind == "large":
            x = x + 1e4
        x = x.to(dtype)
        if kind == "strided":
            x = x[:, 32 : 32 + vocab]
        if kind == "neginf":
            x[:, vocab // 2 :] = float("-inf")
            x[3, : vocab // 2 - 1] = float("-inf")
        labels = torch.randint(0, vocab // 2 if kind == "neginf" else vocab, (tokens,), generator=g, device=device)
        if kind == "neginf":
            labels[3] = vocab // 2 - 1  # the only finite entry of row 3
        g_lp = None if kind == "entropy_only" else torch.randn(tokens, generator=g, device=device)
        g_h = None if kind in ("no_entropy", "logprob_only") else torch.randn(tokens, generator=g, device=device)
        for impl in ("triton", "torch"):
            xg = x.detach().clone() if kind != "strided" else x.detach()
            xg.requires_grad_()
            lp, ent = logprob_and_entropy(xg, labels, temperature=t, with_entropy=kind != "no_entropy", impl=impl)
            loss = (lp * g_lp).sum() if g_lp is not None else 0
            loss = loss + ((ent * g_h).sum() if g_h is not None else 0)
            loss.backward()
            rlp, rent, rg = reference(x, labels, t, g_lp, g_h)
            vtol = 2e-3 if kind == "large" else 2e-5
            ok = (lp.double() - rlp).abs().max().item() <= vtol
            ok &= ent is None or (ent.double() - rent).abs().max().item() <= vtol
            err = (xg.grad.double() - rg).abs()
            if kind == "large":  # fp32 logsumexp near 1e4 rounds by ~5e-4, plus the dtype's rounding
                ok &= bool((err <= eps[dtype] * rg.abs() + 3e-3 * max(1.0, rg.abs().max().item())).all())
            else:
                ok &= bool((err <= eps[dtype] * rg.abs() + 1e-6 * max(1.0, rg.abs().max().item())).all())
            ok &= bool(torch.isfinite(xg.grad).all()) and xg.grad.dtype == dtype
            n_all += 1
            n_ok += int(ok)
            if not ok:
                worst.append(
                    (impl, str(dtype), vocab, t, kind, (lp.double() - rlp).abs().max().item(), err.max().item())
                )
    print(f"device checks against fp64: {n_ok}/{n_all} passed", flush=True)
    for w in worst:
        print("  FAILED:", w, flush=True)
    return n_ok == n_all


# ---------------------------------------------------------------------------------------------
# TP=2 on two GPUs
# ---------------------------------------------------------------------------------------------
def _tp2_rank(rank, world, port, tokens, vocab, reps, backend, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    try:
        device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        else:
            torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
        dist.init_process_group(backend, rank=rank, world_size=world, device_id=device if backend == "nccl" else None)
        group = dist.group.WORLD
        x, labels, g_lp, g_h = make_problem(tokens, vocab, device, seed=1)  # the same on every rank
        shard = vocab // world
        xs = x.detach()[:, rank * shard : (rank + 1) * shard].contiguous().requires_grad_()
        impl = "triton" if device.type == "cuda" else "torch"

        def step_tp():
            xs.grad = None
            lp, ent = logprob_and_entropy(xs, labels, tp_group=group, vocab_size=vocab, impl=impl)
            ((lp * g_lp).sum() + (ent * g_h).sum()).backward()
            return lp, ent

        lp2, ent2 = step_tp()
        grad2 = xs.grad.clone()
        # TP=1 on the full logits, on this rank, for comparison.
        lp1, ent1 = logprob_and_entropy(x, labels, impl=impl)
        ((lp1 * g_lp).sum() + (ent1 * g_h).sum()).backward()
        grad1 = x.grad[:, rank * shard : (rank + 1) * shard]
        res = {
            "max |lp_tp2 - lp_tp1|": (lp2 - lp1).abs().max().item(),
            "max |H_tp2 - H_tp1|": (ent2 - ent1).abs().max().item(),
            "max |grad_tp2 - grad_tp1| / max|grad|": (
                (grad2.float() - grad1.float()).abs().max() / grad1.float().abs().max()
            ).item(),
        }
        x.grad = None
        del grad1, grad2
        dist.barrier()
        res["fwd+bwd ms (TP=2)"] = time_ms(step_tp, device, reps, 3)
        xs.grad = None
        method = fnppo_triton if impl == "triton" else fnppo_torch
        res["fwd+bwd ms (TP=1, full logits, same device)"] = time_ms(
            fwd_bwd(method, x, labels, g_lp, g_h), device, reps, 3
        )
        queue.put((rank, res))
        dist.destroy_process_group()
    except BaseException as err:  # noqa: BLE001
        import traceback

        queue.put((rank, "ERROR " + repr(err) + "\n" + traceback.format_exc()))


def run_tp2(tokens, vocab, reps, backend):
    import multiprocessing as mp
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_tp2_rank, args=(r, 2, port, tokens, vocab, reps, backend, q)) for r in range(2)]
    for p in procs:
        p.start()
    results = dict(q.get(timeout=600) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    return results


# ---------------------------------------------------------------------------------------------
def init_megatron(device):
    """Megatron's TP=1 parallel state (its cross-entropy reads the TP group from it)."""
    from megatron.core import parallel_state

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ.setdefault("MASTER_PORT", str(s.getsockname()[1]))
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1, create_gloo_process_groups=device.type != "cuda")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tokens", type=int, nargs="+", default=None)
    ap.add_argument("--vocab", type=int, default=None)
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--tp2", action="store_true", help="also run TP=2 on two GPUs (NCCL)")
    ap.add_argument("--methods", default="", help="comma-separated substrings: run only matching methods")
    args = ap.parse_args()
    device = torch.device(args.device)
    on_gpu = device.type == "cuda"
    tokens_list = args.tokens or ([16384, 8192] if on_gpu else [512, 256])
    vocab = args.vocab or (151936 if on_gpu else 8192)
    reps = args.reps or (15 if on_gpu else 3)
    print(f"torch {torch.__version__}, device {torch.cuda.get_device_name(device) if on_gpu else 'cpu'}", flush=True)
    if on_gpu:
        import triton

        print(f"triton {triton.__version__}", flush=True)

    import contextlib

    cm = contextlib.nullcontext()
    if not on_gpu:
        from fnppo.testing import megatron_on_cpu

        cm = megatron_on_cpu()
    rows = []
    with cm:
        init_megatron(device)
        for tokens in tokens_list:
            x, labels, g_lp, g_h = make_problem(tokens, vocab, device)
            nbytes = x.numel() * x.element_size()
            if on_gpu:
                bw = copy_bandwidth(x, device, reps)
                print(
                    f"\n{tokens} x {vocab} bf16 logits = {nbytes / 1e9:.2f} GB; device copy {bw:.0f} GB/s "
                    f"(read+write); HBM floor for fwd+bwd (3 x logits bytes) at that rate: "
                    f"{3 * nbytes / bw / 1e6:.2f} ms",
                    flush=True,
                )
                corr, _ = check_correctness(x, labels, g_lp, g_h, "triton")
                corr_t, _ = check_correctness(x, labels, g_lp, g_h, "torch")
                print("  correctness, triton:", {k: f"{v:.3g}" for k, v in corr.items()}, flush=True)
                print("  correctness, torch :", {k: f"{v:.3g}" for k, v in corr_t.items()}, flush=True)
                x.grad = None
            for name, method, need in METHODS:
                if need == "cuda" and not on_gpu:
                    continue
                if args.methods and not any(s in name for s in args.methods.split(",")):
                    continue
                step = fwd_bwd(method, x, labels, g_lp, g_h)
                try:
                    ms = time_ms(step, device, reps, 3)
                    copies = extra_copies(step, x, device)
                except torch.OutOfMemoryError:
                    ms, copies = float("nan"), float("nan")
                x.grad = None
                gc.collect()
                extra = f"{3 * nbytes / (ms * 1e-3) / 1e9:.0f}" if name.startswith("fnppo") and on_gpu else ""
                if name == "fnppo (triton)" and on_gpu:
                    # forward alone (one read of the logits) and backward by difference
                    def fwd_only():
                        with torch.no_grad():
                            logprob_and_entropy(x, labels, impl="triton")  # noqa: F821

                    f_ms = time_ms(fwd_only, device, reps, 3)
                    print(
                        f"  fnppo (triton) {tokens}: forward {f_ms:.2f} ms ({nbytes / (f_ms * 1e-3) / 1e9:.0f} GB/s), "
                        f"backward {ms - f_ms:.2f} ms ({2 * nbytes / ((ms - f_ms) * 1e-3) / 1e9:.0f} GB/s)",
                        flush=True,
                    )
                    from fnppo.core.kernels import logprob_kernels

                    k = logprob_kernels()
                    print(
                        f"  autotuned: forward {k._fwd_tuned.best_config}, backward {k._bwd_tuned.best_config}",
                        flush=True,
                    )
                rows.append((name, tokens, vocab, ms, copies, extra))
                print(f"  {name:<38} {ms:9.2f} ms  " + ("" if copies is None else f"{copies:5.2f} copies"), flush=True)
            del x, labels, g_lp, g_h
            gc.collect()
            if on_gpu:
                torch.cuda.empty_cache()

    print(
        "\n| method | tokens | vocab | fwd+bwd ms (median) | extra copies | fnppo HBM GB/s (3 x logits bytes / time) |"
    )
    print("|---|---|---|---|---|---|")
    for name, tokens, v, ms, copies, extra in rows:
        c = "-" if copies is None else f"{copies:.2f}"
        print(f"| {name} | {tokens} | {v} | {ms:.2f} | {c} | {extra or '-'} |")

    if on_gpu:
        print(flush=True)
        device_checks(device)

    if args.tp2:
        if dist.is_initialized():
            dist.destroy_process_group()
        backend = "nccl" if on_gpu else "gloo"
        tokens = tokens_list[0]
        if on_gpu and torch.cuda.device_count() < 2:
            print("\nTP=2: needs two GPUs; skipped")
            return
        res = run_tp2(tokens, vocab, reps, backend)
        print(f"\nTP=2 ({backend}), {tokens} tokens x {vocab} vocab (shard {vocab // 2} per rank), bf16:")
        for r in sorted(res):
            print(f"  rank {r}: {res[r]}")


if __name__ == "__main__":
    main()
