"""The teacher's per-token signals that samples carry, and the cross-entropy's token mask: their checks
and their collation (plain torch).

A :class:`~fnppo.core.batching.sample.Sample` may carry, per response token ``j``:

* ``teacher_topk_ids`` ``[r, k]`` and ``teacher_topk_logprobs`` ``[r, k]``: the teacher's ``k`` most
  likely next tokens at that position and their log-probs under its full distribution (what an
  inference engine returns), sorted by descending log-prob; both or neither;
* ``ce_mask`` ``[r]``: the tokens of the cross-entropy term (:class:`fnppo.core.losses.terms.CrossEntropy`).

:func:`check_teacher_shapes` runs when a sample is built (types and shapes), :func:`check_teacher_values`
where samples enter a computation (collation, the steps' entry checks), :func:`collate_teacher` puts
them at the positions of :func:`~fnppo.core.batching.collate.collate_microbatch`'s alignment (response
token ``j`` of a sample with prompt length ``P`` at position ``P - 1 + j``; zeros elsewhere).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch

from fnppo.core.errors import check_mask01, describe, input_error
from fnppo.core.typing import Tensor

__all__ = ["TEACHER_FIELDS", "check_teacher_shapes", "check_teacher_values", "collate_teacher"]

TEACHER_FIELDS = ("teacher_topk_ids", "teacher_topk_logprobs", "ce_mask")
"""The fields of this module, on :class:`~fnppo.core.batching.sample.Sample` and on the micro-batch."""


def _is_int(t: Tensor) -> bool:
    return not (t.dtype == torch.bool or t.is_floating_point() or t.is_complex())


def _what(x: Any) -> str:
    return describe(x) if isinstance(x, Tensor) else f"{type(x).__name__} {x!r}"[:200]


def check_teacher_shapes(fn: str, sample: Any) -> None:
    """Types and shapes when a sample is built: ``teacher_topk_ids`` an integer ``[r, k]`` and
    ``teacher_topk_logprobs`` a floating ``[r, k]`` (``k >= 1``, both or neither); ``ce_mask`` a
    ``[r]`` tensor or None (``r`` the response length)."""
    r = sample.response_ids.shape[0]
    ids, lps = sample.teacher_topk_ids, sample.teacher_topk_logprobs
    if (ids is None) != (lps is None):
        missing = "teacher_topk_ids" if ids is None else "teacher_topk_logprobs"
        other = "teacher_topk_logprobs" if ids is None else "teacher_topk_ids"
        raise input_error(fn, missing, f"a tensor (given with {other}: both or neither)", "None")
    if ids is not None:
        if not isinstance(ids, Tensor) or ids.ndim != 2 or not _is_int(ids) or ids.shape[0] != r or ids.shape[1] < 1:
            raise input_error(fn, "teacher_topk_ids", f"an integer tensor [{r}, k] with k >= 1", _what(ids))
        if not isinstance(lps, Tensor) or not lps.is_floating_point() or tuple(lps.shape) != tuple(ids.shape):
            raise input_error(
                fn, "teacher_topk_logprobs", f"a floating tensor of the ids' shape {list(ids.shape)}", _what(lps)
            )
    m = sample.ce_mask
    if m is not None and (not isinstance(m, Tensor) or m.ndim != 1 or m.shape[0] != r):
        raise input_error(fn, "ce_mask", f"None or a 1-D tensor of length {r} (the response length)", _what(m))


def check_teacher_values(fn: str, samples: Sequence[Any], vocab_size: int | None, *, arg: str = "samples") -> None:
    """The teacher's top-k and the cross-entropy masks of ``samples``, where they enter a computation.

    Top-k: given for every sample or none, with one ``k`` for all, ``k <= vocab_size``, on the
    samples' device; ids in ``[0, vocab_size)`` (``>= 0`` without ``vocab_size``) and distinct in
    each row; log-probs not NaN and ``<= 0`` (``-inf`` allowed: a token the teacher never produces),
    sorted by descending log-prob in each row (ties in any order). ``ce_mask``: 0/1 values. One
    host sync when everything is fine; the samples are searched one by one only to name the first
    offender.

    Raises:
        InputError: naming ``<arg>[i].<field>``.
    """
    device = samples[0].prompt_ids.device
    for i, s in enumerate(samples):
        for name in TEACHER_FIELDS:
            t = getattr(s, name, None)
            if t is not None and t.device != device:
                raise input_error(
                    fn, f"{arg}[{i}].{name}", f"a tensor on {device} (the device of {arg}[0])", str(t.device)
                )
        if s.ce_mask is not None:
            check_mask01(fn, f"{arg}[{i}].ce_mask", s.ce_mask)
    have = [s.teacher_topk_ids is not None for s in samples]
    if not any(have):
        return
    if not all(have):
        missing = have.index(False)
        raise input_error(
            fn,
            f"{arg}[{missing}].teacher_topk_ids",
            f"a tensor ({arg}[{have.index(True)}] has the teacher's top-k; all samples or none)",
            "None",
        )
    k = samples[0].teacher_topk_ids.shape[1]
    for i, s in enumerate(samples):
        if s.teacher_topk_ids.shape[1] != k:
            raise input_error(
                fn, f"{arg}[{i}].teacher_topk_ids", f"k = {k} columns (that of {arg}[0])", describe(s.teacher_topk_ids)
            )
    if vocab_size is not None and k > vocab_size:
        raise input_error(
            fn,
            f"{arg}[0].teacher_topk_ids",
            f"k <= the vocabulary size {vocab_size}",
            f"k = {k} ({describe(samples[0].teacher_topk_ids)})",
        )
    high = vocab_size if vocab_size is not None else 2**62
    ids = torch.cat([s.teacher_topk_ids.to(torch.int64) for s in samples])
    lps = torch.cat([s.teacher_topk_logprobs.float() for s in samples])
    if not bool(_bad_rows(ids, lps, high).any()):
        return
    for i, s in enumerate(samples):
        _name_first(
            fn, f"{arg}[{i}]", s.teacher_topk_ids.to(torch.int64), s.teacher_topk_logprobs.float(), high, vocab_size
        )


def _bad_rows(ids: Tensor, lps: Tensor, high: int) -> Tensor:
    """Per row: an id out of range, a repeated id, a NaN or positive log-prob, or an increase."""
    ordered = ids.sort(dim=-1).values
    bad = ((ids < 0) | (ids >= high)).any(-1) | (ordered[:, 1:] == ordered[:, :-1]).any(-1)
    bad = bad | (torch.isnan(lps) | (lps > 0)).any(-1)
    return bad | (lps[:, 1:] > lps[:, :-1]).any(-1)


def _name_first(fn: str, where: str, ids: Tensor, lps: Tensor, high: int, vocab_size: int | None) -> None:
    rows = _bad_rows(ids, lps, high).nonzero()
    if not rows.numel():
        return
    j = int(rows[0, 0])
    row_ids, row_lp = ids[j].tolist(), lps[j].tolist()
    if any(v < 0 or v >= high for v in row_ids):
        rng = f"[0, {vocab_size})" if vocab_size is not None else ">= 0"
        raise input_error(
            fn, f"{where}.teacher_topk_ids", f"token ids in {rng}", f"ids {row_ids} at response token {j}"
        )
    if len(set(row_ids)) != len(row_ids):
        raise input_error(
            fn, f"{where}.teacher_topk_ids", "distinct ids in each row", f"ids {row_ids} at response token {j}"
        )
    if any(v != v or v > 0 for v in row_lp):
        raise input_error(
            fn, f"{where}.teacher_topk_logprobs", "log-probs in [-inf, 0] (no NaN)", f"{row_lp} at response token {j}"
        )
    raise input_error(
        fn,
        f"{where}.teacher_topk_logprobs",
        "each row sorted by descending log-prob (the teacher's most likely token first)",
        f"{row_lp} at response token {j}",
    )


def collate_teacher(
    samples: Sequence[Any], response_starts: Sequence[int], rows: int, width: int
) -> dict[str, Tensor | None]:
    """The micro-batch fields: ``teacher_topk_ids`` (int64) and ``teacher_topk_logprobs`` (fp32)
    ``[rows, width, k]`` (None without top-k), ``ce_mask`` (fp32 ``[rows, width]``; None when no sample
    has one, else a sample without it contributes its response mask), sample ``i``'s response token
    ``j`` at flat position ``response_starts[i] + j`` of the ``rows x width`` micro-batch (where
    :func:`~fnppo.core.batching.collate.collate_microbatch` places its other per-token values: the
    packed, padded and shared-prefix layouts alike), zeros elsewhere."""
    out: dict[str, Tensor | None] = {name: None for name in TEACHER_FIELDS}
    if samples[0].teacher_topk_ids is not None:
        k = samples[0].teacher_topk_ids.shape[1]
        place = functools.partial(_place, samples, response_starts, rows, width)
        out["teacher_topk_ids"] = place(lambda s: s.teacher_topk_ids, torch.int64, k)
        out["teacher_topk_logprobs"] = place(lambda s: s.teacher_topk_logprobs, torch.float32, k)
    if any(s.ce_mask is not None for s in samples):

        def mask_of(s: Any) -> Tensor:
            if s.ce_mask is not None:
                return s.ce_mask
            if s.response_mask is not None:
                return s.response_mask
            return torch.ones(s.response_len, device=s.prompt_ids.device)

        out["ce_mask"] = _place(samples, response_starts, rows, width, mask_of, torch.float32, None)
    return out


def _place(
    samples: Sequence[Any], response_starts: Sequence[int], rows: int, width: int, get, dtype, k: int | None
) -> Tensor:
    """Each sample's ``get(s)`` rows at flat positions ``response_starts[i] ...``, zeros elsewhere."""
    tail = () if k is None else (k,)
    device = samples[0].prompt_ids.device
    dest = torch.cat(
        [torch.arange(a, a + s.response_len, dtype=torch.int64) for s, a in zip(samples, response_starts, strict=True)]
    )
    values = torch.cat([get(s).to(dtype=dtype, device=device) for s in samples])
    flat = torch.zeros((rows * width, *tail), dtype=dtype, device=device)
    return flat.index_put_((dest.to(device),), values).view(rows, width, *tail)
