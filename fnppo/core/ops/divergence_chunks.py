"""The row-chunk loops of :mod:`fnppo.core.ops.divergence` (pure torch; no collectives here).

Every function reads its inputs and writes only tensors it created. A chunk is ``rows`` token rows
of this rank's vocabulary shard (its real columns ``[0, n_valid)``), turned into fp32 temporaries:
the student's ``z = x / T`` and, with a teacher, the teacher's ``y = u / T`` (``u`` the teacher's
logits rows, or ``hidden_rows @ weight.T`` computed for the chunk only: the teacher's logits never
exist beyond one chunk).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from fnppo.core.typing import Tensor

__all__ = ["Teacher", "chunk_rows", "shard_stats", "divergence_sums", "student_grad"]

_MIN_CHUNK_ROWS = 16
_MIN_CHUNK_BYTES = 1 << 20


class Teacher(NamedTuple):
    """A full-vocabulary teacher: its logits rows ``[n, shard]`` (``logits``), or its hidden states
    ``[n, hidden]`` and output-weight shard ``[shard, hidden]`` (``hidden``, ``weight``)."""

    logits: Tensor | None
    hidden: Tensor | None
    weight: Tensor | None

    def rows(self, r0: int, r1: int, n_valid: int, inv_t: float) -> Tensor:
        """The teacher's ``y = u / T`` for rows ``r0:r1``, columns ``[0, n_valid)``, fp32 (a new tensor)."""
        if self.logits is not None:
            y = torch.empty((r1 - r0, n_valid), dtype=torch.float32, device=self.logits.device)
            y.copy_(self.logits[r0:r1, :n_valid])
        else:
            y = torch.nn.functional.linear(self.hidden[r0:r1], self.weight[:n_valid]).float()
        return y.mul_(inv_t)


def chunk_rows(n: int, v: int, elem: int, chunk_tokens: int | None, temporaries: int) -> int:
    """Rows per chunk: ``chunk_tokens``, else ``temporaries`` fp32 ``[rows, v]`` tensors within 1/8 of
    the logits (``n x v`` elements of ``elem`` bytes) or within 1 MiB, whichever allows more rows (a
    small problem runs in few chunks), at least 16 rows."""
    if chunk_tokens is not None:
        return max(1, chunk_tokens)
    per_row = max(1, 4 * temporaries * v)
    budget = max((n * v * elem) // 8, _MIN_CHUNK_BYTES)
    return max(_MIN_CHUNK_ROWS, budget // per_row)


def _row_max(z: Tensor) -> tuple[Tensor, Tensor]:
    """Row maxima and the shift that keeps ``z - shift`` finite (0 for a row without a finite value)."""
    m = z.amax(dim=1)
    return m, torch.where(m == float("-inf"), torch.zeros_like(m), m)


def shard_stats(
    x2: Tensor,
    labels: Tensor,
    ids: Tensor | None,
    teacher: Teacher | None,
    cfg: Any,
) -> dict[str, Tensor]:
    """Per-row statistics of this shard, each relative to the shard's own row maximum.

    Student: ``m`` (max of ``z``), ``s = sum e^{z - m}``, ``w = sum e^{z - m} (z - m)`` (with
    entropy), ``zl`` (the label's ``z`` where this shard holds it, else 0), ``zk`` ``[n, k]`` (the
    ``z`` of each top-k id held here, else 0). Teacher: ``mt``, ``st`` likewise.
    """
    n, v = x2.shape[0], cfg.n_valid
    f32 = dict(dtype=torch.float32, device=x2.device)
    out = {"m": torch.empty(n, **f32), "s": torch.empty(n, **f32), "zl": torch.empty(n, **f32)}
    if cfg.with_entropy:
        out["w"] = torch.empty(n, **f32)
    if ids is not None:
        out["zk"] = torch.empty(ids.shape, **f32)
    if teacher is not None:
        out["mt"], out["st"] = torch.empty(n, **f32), torch.empty(n, **f32)
    rows = chunk_rows(n, v, x2.element_size(), cfg.chunk_tokens, 3 if teacher is not None else 2)
    for r0 in range(0, n, rows):
        r1 = min(n, r0 + rows)
        z = torch.empty((r1 - r0, v), **f32)
        z.copy_(x2[r0:r1, :v])
        z.mul_(cfg.inv_t)
        out["zl"][r0:r1] = _gather_held(z, labels[r0:r1].unsqueeze(1), cfg.vocab_start).squeeze(1)
        if ids is not None:
            out["zk"][r0:r1] = _gather_held(z, ids[r0:r1], cfg.vocab_start)
        m, shift = _row_max(z)
        z.sub_(shift.unsqueeze(1))
        e = torch.exp(z)
        out["s"][r0:r1] = e.sum(dim=1)
        if cfg.with_entropy:
            out["w"][r0:r1] = torch.nansum(e.mul_(z), dim=1)  # 0 log 0 (NaN) dropped
        out["m"][r0:r1] = m
        del z, e
        if teacher is not None:
            y = teacher.rows(r0, r1, v, cfg.inv_t)
            mt, shift_t = _row_max(y)
            out["mt"][r0:r1] = mt
            out["st"][r0:r1] = torch.exp(y.sub_(shift_t.unsqueeze(1))).sum(dim=1)
            del y
    return out


def _gather_held(z: Tensor, ids: Tensor, vocab_start: int) -> Tensor:
    """``z[r, ids[r, i] - vocab_start]`` where this shard holds the id (``[0, z.shape[1])``), else 0."""
    loc = ids.to(torch.int64) - vocab_start
    inside = (loc >= 0) & (loc < z.shape[1])
    got = z.gather(1, loc.clamp(0, max(0, z.shape[1] - 1)))
    return torch.where(inside, got, torch.zeros_like(got))


def _log_probs(x2: Tensor, teacher: Teacher, r0: int, r1: int, lse: Tensor, lse_t: Tensor, cfg: Any):
    """Student and teacher log-probs ``(lp, lq)`` of rows ``r0:r1`` (fp32, new tensors)."""
    v = cfg.n_valid
    lp = torch.empty((r1 - r0, v), dtype=torch.float32, device=x2.device)
    lp.copy_(x2[r0:r1, :v])
    lp.mul_(cfg.inv_t).sub_(lse[r0:r1].unsqueeze(1))
    lq = teacher.rows(r0, r1, v, cfg.inv_t).sub_(lse_t[r0:r1].unsqueeze(1))
    return lp, lq


def _terms(lp: Tensor, lq: Tensor, kind: str, floor: float) -> tuple[Tensor, Tensor]:
    """Per element: the weight (``p`` for reverse KL, ``q`` for forward KL) and the log-ratio ``r``;
    the weighted terms ``weight * r`` are exactly 0 where the weight is 0."""
    if kind == "reverse_kl":
        weight = torch.exp(lp)
        r = lp - torch.clamp(lq, min=floor)
    else:
        weight = torch.exp(lq)
        r = lq - lp
    return weight, r


def divergence_sums(x2: Tensor, teacher: Teacher, lse: Tensor, lse_t: Tensor, cfg: Any) -> Tensor:
    """This shard's part of the divergence per row (the second pass, with the global normalizers):

    ``reverse_kl``: ``sum_j p_j (lp_j - max(lq_j, floor))``; ``forward_kl``: ``sum_j q_j (lq_j - lp_j)``,
    over the shard's real columns, each term 0 where its weight is 0.
    """
    n = x2.shape[0]
    out = torch.zeros(n, dtype=torch.float32, device=x2.device)
    rows = chunk_rows(n, cfg.n_valid, x2.element_size(), cfg.chunk_tokens, 4)
    for r0 in range(0, n, rows):
        r1 = min(n, r0 + rows)
        lp, lq = _log_probs(x2, teacher, r0, r1, lse, lse_t, cfg)
        weight, r = _terms(lp, lq, cfg.kind, cfg.floor)
        term = torch.where(weight > 0, weight * r, torch.zeros_like(r))
        out[r0:r1] = term.sum(dim=1)
        del lp, lq, weight, r, term
    return out


def student_grad(
    x2: Tensor,
    labels: Tensor,
    ids: Tensor | None,
    teacher: Teacher | None,
    saved: dict[str, Tensor],
    grads: dict[str, Tensor | None],
    cfg: Any,
) -> Tensor:
    """The gradient of the student's logits shard ``[n, shard]`` (padding columns 0), one chunk at a time::

        dz_j = g_lp (1[j = label] - p_j) - g_H p_j (lp_j + H) + sum_i g_k,i (1[j = id_i] - p_j)
               + g_D * ( p_j (r_j - D)   [reverse_kl]   |   p_j - q_j   [forward_kl] )

    times ``1 / T``; ``p_j = 0`` columns get no ``p log p`` or ``p r`` term (never ``0 * inf``).
    """
    n, shard = x2.shape
    v = cfg.n_valid
    grad = torch.zeros(x2.shape, dtype=x2.dtype, device=x2.device)
    zeros = torch.zeros(n, dtype=torch.float32, device=x2.device)
    g_lp = grads["lp"] if grads["lp"] is not None else zeros
    g_h = grads["ent"]
    g_k = grads["topk"]
    g_d = grads["div"] if teacher is not None else None
    c = -g_lp
    if g_h is not None:
        c = c - g_h * saved["ent"]
    if g_k is not None:
        c = c - g_k.sum(dim=1)
    if g_d is not None and cfg.kind == "reverse_kl":
        c = c - g_d * saved["div"]
    temporaries = 4 if teacher is not None else 2
    rows = chunk_rows(n, v, x2.element_size(), cfg.chunk_tokens, temporaries)
    for r0 in range(0, n, rows):
        r1 = min(n, r0 + rows)
        if teacher is not None:
            lp, lq = _log_probs(x2, teacher, r0, r1, saved["lse"], saved["lse_t"], cfg)
        else:
            lp = torch.empty((r1 - r0, v), dtype=torch.float32, device=x2.device)
            lp.copy_(x2[r0:r1, :v])
            lp.mul_(cfg.inv_t).sub_(saved["lse"][r0:r1].unsqueeze(1))
            lq = None
        p = torch.exp(lp)
        coef = c[r0:r1].unsqueeze(1).expand_as(lp).clone()  # per element: c (+ the p-proportional parts)
        if g_h is not None:
            coef.sub_(g_h[r0:r1].unsqueeze(1) * lp)
        if g_d is not None:
            weight, r = _terms(lp, lq, cfg.kind, cfg.floor)
            if cfg.kind == "reverse_kl":
                coef.add_(g_d[r0:r1].unsqueeze(1) * r)
            else:
                coef.add_(g_d[r0:r1].unsqueeze(1))
        dz = torch.where(p > 0, p * coef, torch.zeros_like(coef))
        if g_d is not None and cfg.kind == "forward_kl":
            dz.sub_(g_d[r0:r1].unsqueeze(1) * weight)
        _scatter_held(dz, labels[r0:r1].unsqueeze(1), g_lp[r0:r1].unsqueeze(1), cfg.vocab_start)
        if g_k is not None:
            _scatter_held(dz, ids[r0:r1], g_k[r0:r1], cfg.vocab_start)
        grad[r0:r1, :v] = dz.mul_(cfg.inv_t)
        del lp, lq, p, coef, dz
    if v < shard:
        grad[:, v:] = 0
    return grad


def _scatter_held(dz: Tensor, ids: Tensor, values: Tensor, vocab_start: int) -> None:
    """``dz[r, ids[r, i] - vocab_start] += values[r, i]`` where this shard holds the id (in place on ``dz``,
    a tensor of the caller's own)."""
    loc = ids.to(torch.int64) - vocab_start
    inside = (loc >= 0) & (loc < dz.shape[1])
    add = torch.where(inside, values, torch.zeros_like(values))
    dz.scatter_add_(1, loc.clamp(0, max(0, dz.shape[1] - 1)), add)
