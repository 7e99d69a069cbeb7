"""The host side of the fused output layer's Triton kernels (:mod:`fnppo.core.kernels.linear_logprob_triton`):
:func:`forward_stats` (the per-token softmax statistics over this rank's vocabulary shard) and
:func:`backward_grads` (the logit-gradient blocks contracted at once into ``d hidden`` and ``d weight``):
grids, vocabulary splits, TMA tensor descriptors and the cuBLAS contractions.

The bf16/fp16 tiles go through TMA descriptors on Hopper and newer GPUs where the tensors' layout
allows it (:func:`_tma_wanted`: the device decides; a comparison of pointer loads replaces it, as
``benchmarks/linear_logprob.py --no-tma`` does).
"""

from __future__ import annotations

import functools
import math

import torch
import triton

from fnppo.core.kernels.linear_logprob_triton import (
    _FWD_BM,
    _INTERP,
    LN2,
    LOG2E,
    TensorDescriptor,
    _dz_blocks,
    _dz_kernel,
    _dz_tuned,
    _fwd_blocks,
    _fwd_kernel,
    _fwd_tuned,
    _label_kernel,
    _merge_kernel,
)

__all__ = ["forward_stats", "backward_grads", "LOG2E", "LN2"]


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _num_splits(n: int, n_voc: int, device: torch.device, bm: int) -> int:
    """Vocabulary splits per row block: the grid fills whole waves of the GPU's SMs."""
    row_blocks = -(-n // bm)
    max_splits = max(1, min(64, -(-n_voc // 1024)))
    if device.type != "cuda":
        return min(3, max_splits)  # the interpreter: a few splits exercise the merge
    sms = _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    best, best_eff = 1, 0.0
    for k in range(1, max_splits + 1):
        programs = row_blocks * k
        eff = programs / (math.ceil(programs / sms) * sms)
        if eff > best_eff + 1e-9:
            best, best_eff = k, eff
    return best


@functools.cache
def _has_tma(device_index: int) -> bool:
    return TensorDescriptor is not None and torch.cuda.get_device_capability(device_index)[0] >= 9


def _tma_wanted(device: torch.device) -> bool:
    """Whether the 16-bit kernels read (and write) their tiles through TMA tensor descriptors: on CUDA
    devices of compute capability 9 (Hopper) and newer. (The interpreter's check of both variants on the
    CPU, and the benchmark's comparison with pointer loads, replace this function.)"""
    if device.type != "cuda":
        return False
    return _has_tma(device.index if device.index is not None else torch.cuda.current_device())


def _tma_ok(*tensors: torch.Tensor) -> bool:
    """TMA's layout rules: 2-d, unit last stride, 16-byte aligned base and row stride, 16-bit dtype."""
    for t in tensors:
        if t.dtype not in (torch.bfloat16, torch.float16) or t.dim() != 2 or t.stride(1) != 1 or min(t.shape) == 0:
            return False
        if t.data_ptr() % 16 or (t.stride(0) * t.element_size()) % 16:
            return False
    return True


def _desc(t: torch.Tensor) -> TensorDescriptor:
    # The block shape is a placeholder: the autotuner's hooks (or the caller) set the tiles'.
    return TensorDescriptor(t, list(t.shape), list(t.stride()), [16, 16])


def _with_blocks(desc: TensorDescriptor, shape: list[int]) -> TensorDescriptor:
    desc.block_shape = shape
    return desc


def forward_stats(
    h2: torch.Tensor, w_valid: torch.Tensor, labels: torch.Tensor, vocab_start: int, inv_t: float, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Per-token ``(m, s, w, zl)`` of this shard in natural units; ``w`` is None without entropy."""
    n, hid = h2.shape
    n_voc = w_valid.shape[0]
    f32 = dict(dtype=torch.float32, device=h2.device)
    if n == 0 or n_voc == 0:
        empty = torch.zeros(n, **f32)
        return torch.full((n,), float("-inf"), **f32), empty, (empty.clone() if with_entropy else None), empty.clone()
    w_valid = w_valid if w_valid.stride(-1) == 1 else w_valid.contiguous()
    interp = _fwd_tuned is None
    bm = _INTERP["BM"] if interp else _FWD_BM
    splits = _num_splits(n, n_voc, h2.device, bm)
    per = -(-(-(-n_voc // splits)) // 256) * 256  # noqa: B002 - ceil divisions: columns per split, a multiple of every BN
    splits = -(-n_voc // per)
    m, s, w = (torch.empty((splits, n), **f32) for _ in range(3))
    ieee = h2.dtype == torch.float32
    tma = _tma_wanted(h2.device) and _tma_ok(h2, w_valid)
    hp, wp = (_desc(h2), _desc(w_valid)) if tma else (h2, w_valid)
    args = (hp, wp, m, s, w, n, n_voc, hid, h2.stride(0), w_valid.stride(0), inv_t * LOG2E, per)
    grid = (splits, -(-n // bm))
    if interp:
        cfg = dict(BM=bm, BN=_INTERP["BN"], BK=_INTERP["BK"])
        if tma:
            _fwd_blocks({**cfg, "TMA": True, "h_ptr": hp, "w_ptr": wp})
        _fwd_kernel[grid](*args, WITH_ENT=with_entropy, IEEE=ieee, EVEN_K=hid % _INTERP["BK"] == 0, TMA=tma, **cfg)
    else:
        _fwd_tuned[grid](*args, WITH_ENT=with_entropy, BM=bm, IEEE=ieee, TMA=tma)
    # Launched after the tiles (the GPU starts on the long kernel sooner): label logits, the merge.
    zl = torch.empty(n, **f32)
    br, bh = (16, 16) if interp else (16, 128)
    _label_kernel[(-(-n // br),)](
        h2, w_valid, labels, zl, n, n_voc, hid, h2.stride(0), w_valid.stride(0), vocab_start, inv_t, BR=br, BH=bh
    )
    m_all, s_all = torch.empty(n, **f32), torch.empty(n, **f32)
    w_all = torch.empty(n, **f32) if with_entropy else None
    br = 16 if interp else 128
    _merge_kernel[(-(-n // br),)](
        m,
        s,
        w,
        m_all,
        s_all,
        w_all if with_entropy else s_all,
        n,
        splits,
        WITH_ENT=with_entropy,
        BR=br,
        BS=triton.next_power_of_2(splits),
    )
    return m_all, s_all, w_all, zl


@functools.cache
def _addmm_fp32_ok(device_type: str) -> bool:
    """Whether ``torch.addmm(acc_fp32, a_half, b_half, out_dtype=float32, out=acc)`` accumulates correctly here."""
    if device_type != "cuda":
        return False
    try:
        g = torch.Generator(device="cuda").manual_seed(0)
        a = torch.randn(64, 48, device="cuda", generator=g).bfloat16()
        b = torch.randn(48, 32, device="cuda", generator=g).bfloat16()
        acc = torch.randn(64, 32, device="cuda", generator=g)
        want = acc + a.float() @ b.float()
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
        return bool(torch.allclose(acc, want, rtol=1e-4, atol=1e-4))
    except Exception:  # noqa: BLE001 - not supported by this build: use the fallback
        return False


def _accumulate(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``acc += a @ b`` with an fp32 ``acc`` and half-precision (or fp32) ``a``, ``b``."""
    if a.dtype == torch.float32:
        acc.addmm_(a, b)
    elif _addmm_fp32_ok(acc.device.type):
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    else:
        acc.add_(torch.mm(a.float(), b.float()))


def scaled_coefficients(coef: tuple[torch.Tensor, ...], inv_t: float) -> tuple[torch.Tensor, ...]:
    """``(a, b, c, lse)`` -> ``(a/T, b ln2/T, c/T, lse log2 e)``: what the logit-gradient kernel reads.

    With them ``dz = p (c/T - (b ln2/T) log2 p) + (a/T) 1[j = label]`` needs no per-logit scaling.
    """
    a, b, c, lse = coef
    return a * inv_t, b * (LN2 * inv_t), c * inv_t, lse * LOG2E


_DZ_CHOSEN: dict[tuple, triton.Config] = {}  # the autotuner's pick per key (as its own cache's key)


def _launch_dz(ptrs, labels, coef2, block, strides, col_start, scale2, has_gh, tma):  # noqa: ANN001
    """One block of logit gradients, ``dz[:n_tok, :n_cols] = f(h[g0 : g0 + n_tok] @ w[c0 : c0 + n_cols].T)``.

    ``ptrs``: ``(h, w, dz)`` as tensors, or as tensor descriptors when ``tma``; ``block``:
    ``(g0, n_tok, c0, n_cols)``; ``strides``: row strides of ``h``, ``w``, ``dz``; ``coef2`` from
    :func:`scaled_coefficients` (whole batch, as ``labels``).
    """
    g0, n, c0, n_cols = block
    hid = ptrs[0].shape[1]
    ieee = (ptrs[0].base if tma else ptrs[0]).dtype == torch.float32
    a, b, c, lse2 = coef2
    args = (ptrs[0], ptrs[1], labels, a, b, c, lse2, ptrs[2], g0, n, c0, n_cols, hid, *strides, col_start, scale2)
    if _dz_tuned is None:
        cfg = dict(_INTERP, GROUP_M=2)
        if tma:
            _dz_blocks({**cfg, "TMA": True, "h_ptr": ptrs[0], "w_ptr": ptrs[1], "dz_ptr": ptrs[2]})
        grid = (-(-n // cfg["BM"]) * -(-n_cols // cfg["BN"]),)
        _dz_kernel[grid](*args, HAS_GH=has_gh, IEEE=ieee, EVEN_K=hid % cfg["BK"] == 0, TMA=tma, **cfg)
        return
    key = (hid, has_gh, ieee, tma, str(labels.device), str((ptrs[0].base if tma else ptrs[0]).dtype))
    best = _DZ_CHOSEN.get(key)
    if best is None:  # first call for this key: the autotuner times its configs, then picks one
        grid = lambda meta: (triton.cdiv(n, meta["BM"]) * triton.cdiv(n_cols, meta["BN"]),)  # noqa: E731
        _dz_tuned[grid](*args, HAS_GH=has_gh, IEEE=ieee, TMA=tma)
        _DZ_CHOSEN[key] = _dz_tuned.best_config
        return
    # Later calls launch the chosen config directly: on an H200 machine a launch through the
    # autotuner took 56-92 us of host time, directly 33-53 us (`benchmarks/linear_logprob.py
    # --launch-cost`, BENCHMARKS.md), and the backward launches one per block (32 at 8,192 x 151,936).
    kw = best.kwargs
    if tma and ptrs[0].block_shape != [kw["BM"], kw["BK"]]:
        _dz_blocks({**kw, "TMA": True, "h_ptr": ptrs[0], "w_ptr": ptrs[1], "dz_ptr": ptrs[2]})
    grid = (-(-n // kw["BM"]) * -(-n_cols // kw["BN"]),)
    _dz_kernel[grid](
        *args,
        HAS_GH=has_gh,
        IEEE=ieee,
        EVEN_K=hid % kw["BK"] == 0,
        TMA=tma,
        **kw,
        num_warps=best.num_warps,
        num_stages=best.num_stages,
    )


def backward_grads(
    h2: torch.Tensor,
    w_valid: torch.Tensor,
    labels: torch.Tensor,
    coef: tuple[torch.Tensor, ...],
    has_gh: bool,
    cfg,
    need_h: bool,
    dw: torch.Tensor | None,
    *,
    group_tokens: int,
    block_vocab: int,  # noqa: ANN001
    dh_out: torch.Tensor | None = None,
    dz_space: torch.Tensor | None = None,
    acc_space: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """``dh`` (or None) in ``h2``'s dtype; writes the valid rows' weight gradient into ``dw``.

    ``dh_out``, ``dz_space``, ``acc_space``: optional preallocated ``dh``, logit-gradient block
    and fp32 accumulator (at least ``[group, block]`` and ``[group, hidden]``; their leading views
    are used), so that nothing is allocated here (the backward's CUDA graphs,
    :class:`fnppo.core.ops.linear_logprob.BackwardGraphs`).
    """
    n, hid = h2.shape
    n_valid = w_valid.shape[0]
    dh = (torch.empty_like(h2) if dh_out is None else dh_out) if need_h else None
    if n == 0:
        if dw is not None:
            dw.zero_()
        return dh
    w_valid = w_valid if w_valid.stride(-1) == 1 else w_valid.contiguous()
    coef2 = scaled_coefficients(coef, cfg.inv_t)
    scale2 = cfg.inv_t * LOG2E
    dz_shape = (min(group_tokens, n), min(block_vocab, max(n_valid, 1)))
    if dz_space is None:
        dz_buf = torch.empty(dz_shape, dtype=h2.dtype, device=h2.device)
    else:
        dz_buf = dz_space[: dz_shape[0], : dz_shape[1]]
    acc_buf = None
    if need_h:
        if acc_space is None:
            acc_buf = torch.empty((dz_shape[0], hid), dtype=torch.float32, device=h2.device)
        else:
            acc_buf = acc_space[: dz_shape[0]]
    tma = _tma_wanted(h2.device) and _tma_ok(h2, w_valid, dz_buf)
    ptrs = (_desc(h2), _desc(w_valid), _desc(dz_buf)) if tma else (h2, w_valid, dz_buf)
    strides = (h2.stride(0), w_valid.stride(0), dz_buf.stride(0))

    def launch(block: tuple[int, int, int, int]) -> None:
        _launch_dz(ptrs, labels, coef2, block, strides, cfg.vocab_start + block[2], scale2, has_gh, tma)

    return grouped_backward(
        h2, w_valid, dz_buf, acc_buf, dh, dw, launch, group_tokens=group_tokens, block_vocab=block_vocab
    )


def grouped_backward(h2, w_valid, dz_buf, acc_buf, dh, dw, launch, *, group_tokens, block_vocab):  # noqa: ANN001, ANN201
    """The backward loop the fused heads share (:mod:`fnppo.core.ops.linear_logprob`,
    :mod:`fnppo.core.ops.linear_distill`): for each group of ``group_tokens`` rows of ``h2`` and each block
    of ``block_vocab`` rows of ``w_valid``, ``launch((g0, n_tok, c0, n_cols))`` writes that block's logit
    gradient into ``dz_buf[:n_tok, :n_cols]``; then ``dh[group] = sum_blocks dz @ w[block]`` (in the fp32
    accumulator ``acc_buf``, one reused per group; ``dh`` None: not computed) and
    ``dw[block] = sum_groups dz^T h[group]`` (``dw`` None: not computed). Returns ``dh``."""
    n, n_valid = h2.shape[0], w_valid.shape[0]
    for g0 in range(0, n, group_tokens):
        g1 = min(n, g0 + group_tokens)
        hg = h2[g0:g1]
        acc = None if acc_buf is None else acc_buf[: g1 - g0].zero_()
        for c0 in range(0, n_valid, block_vocab):
            c1 = min(n_valid, c0 + block_vocab)
            launch((g0, g1 - g0, c0, c1 - c0))
            dz = dz_buf[: g1 - g0, : c1 - c0]
            if acc is not None:
                _accumulate(acc, dz, w_valid[c0:c1])
            if dw is not None:
                if g0 == 0:
                    torch.mm(dz.t(), hg, out=dw[c0:c1])
                else:
                    dw[c0:c1].addmm_(dz.t(), hg)
        if dh is not None:
            dh[g0:g1].copy_(acc)
    return dh
