"""Collation: samples -> one :class:`~fnppo.core.batching.sample.Microbatch`, and back to per-sample values.

Plain torch + optree; nothing here imports Megatron.

* :func:`collate_microbatch` turns the samples of one micro-batch into a :class:`Microbatch`, padded
  ``[batch, seq]`` or packed (THD) ``[1, total]`` with ``cu_seqlens`` (the alignment of labels and
  per-token values: :mod:`fnppo.core.batching.sample`);
* :func:`unpack_per_sample` maps a per-position tensor (log-probs, entropies, ...) back to one
  per-response-token tensor per sample;
* :func:`pad_microbatch` pads a micro-batch to a given length, :func:`to_device` moves it,
  :func:`routing_fill` is the route of a position without one.

Which samples go into which micro-batch is :func:`fnppo.core.batching.split.split_batch`'s decision.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import optree
import torch

from fnppo.core.batching.checks import (
    check_devices,
    check_lengths,
    check_routed_experts,
    check_routing_rows,
    check_same_fields,
    check_sample_values,
    check_token_ids,
)
from fnppo.core.batching.prefix import Pack, branch_tensors, check_prompt_groups, pack_layout
from fnppo.core.batching.sample import LAYOUTS, PER_TOKEN_FLOAT, Microbatch, Sample, round_up
from fnppo.core.batching.teacher import check_teacher_values, collate_teacher
from fnppo.core.errors import ShapeError, check_positive_int, describe, input_error
from fnppo.core.typing import Shaped, Tensor, typechecked

__all__ = ["collate_microbatch", "unpack_per_sample", "pad_microbatch", "to_device", "routing_fill"]


@typechecked
def collate_microbatch(
    samples: Sequence[Sample],
    *,
    layout: str = "packed",
    pad_to_multiple_of: int = 1,
    pad_token_id: int = 0,
    max_seq_len: int | None = None,
    vocab_size: int | None = None,
    sample_index: Sequence[int] | None = None,
    share_prefix: bool = False,
) -> Microbatch:
    """Collate samples into one :class:`Microbatch` (padded ``[n, S]`` or packed THD ``[1, T]``).

    For sample ``i`` with prompt ``x`` (length ``P``), response ``y`` (length ``R``) and
    ``L = P + R``, the tokens are ``z = x ++ y`` and, for ``t < L``::

        input_ids[t] = z[t]          labels[t] = z[t+1]  (0 at t = L-1)     position_ids[t] = t
        loss_mask[P-1+j] = response_mask[j],  old_logprobs[P-1+j] = old_logprobs[j], ...  (0 elsewhere)

    Padded layout: ``S = round_up(max_i L_i, m)`` with ``m = pad_to_multiple_of``, right padding,
    ``attention_mask`` True on real tokens. Packed layout: each sample padded to
    ``round_up(L_i, m)`` (the padding stays inside its own segment), concatenated;
    ``cu_seqlens = [0, cumsum(round_up(L_i, m))]`` (int32), ``max_seqlen = max_i round_up(L_i, m)``.
    Padding has token ``pad_token_id``, label 0, position 0, ``seq_ids`` -1 and every value 0.
    Packing without cross-contamination: Krell et al., arXiv 2107.02027.

    ``share_prefix`` (packed layout, no multi-modal items): each prompt group of the samples (equal
    ``prompt_ids`` or one declared ``Sample.group``) is one document ``[x[:-1] | x[-1] y_1 | ... |
    x[-1] y_G]``, padded to a multiple of ``m`` at its end (:mod:`fnppo.core.batching.prefix`): the
    tokens of sample ``g`` keep their labels, positions and response values, its segment placed
    after the prefix and the segments before it; ``seq_ids`` is -1 on a prefix shared by several
    samples; ``branch_ids``, ``root_ids`` and ``spans`` describe the runs for the attention and
    :func:`unpack_per_sample`. A group of one is collated exactly as without sharing.

    Multi-modal keys are the union over the samples; per key, the items of the samples that have it
    are concatenated on dim 0 in sample order and ``multi_modal_counts[key][i]`` is sample ``i``'s
    item count (0 where it has none). ``sample_index`` (default ``0..n-1``) records where the samples
    came from (:attr:`~fnppo.core.batching.split.SplitPlan.microbatches` entries). Use
    :func:`~fnppo.core.batching.sample.padding_multiple` for ``m``.

    Raises:
        InputError: empty ``samples``, unknown ``layout``, a sample longer than ``max_seq_len``,
            token ids outside ``[0, vocab_size)``, a mask that is not 0/1, NaN/inf in a log-prob,
            advantage, value or return, old/ref/rollout log-probs, values, returns, per-token versions
            or staleness given for some samples only, mismatched multi-modal items, samples on different devices, routed
            experts that are not one row per token (or one fewer) or hold invalid indices, a teacher's
            top-k or cross-entropy mask that :func:`~fnppo.core.batching.teacher.check_teacher_values`
            refuses; with ``share_prefix``: the padded layout, multi-modal items, a declared group whose
            prompts differ, a group whose routed experts differ on its shared prompt.
    """
    fn = "collate_microbatch"
    samples = list(samples)
    index, present = _check_collate_inputs(
        fn, samples, layout, pad_to_multiple_of, max_seq_len, vocab_size, sample_index
    )
    if share_prefix:
        if layout != "packed":
            raise input_error(fn, "layout", "'packed' with share_prefix=True (one document per group)", repr(layout))
        check_prompt_groups(fn, samples)
    device = samples[0].prompt_ids.device
    pack = _pack(samples, layout, pad_to_multiple_of, share_prefix)
    per_token = _collate_fields(samples, pack, layout, pad_token_id, present)
    mm, counts = _collate_multi_modal(fn, samples, device)
    routes = _collate_routing(samples, pack, layout) if present["routed_experts"] else None
    shared: dict[str, Any] = {}
    if pack.branches is not None:
        branch, root = branch_tensors(pack.branches, device)
        shared = {"branch_ids": branch, "root_ids": root, "spans": pack.spans}
    return Microbatch(
        **per_token,  # type: ignore[arg-type]
        **_collate_teacher_fields(samples, pack, layout),
        **_layout_fields(layout, per_token["seq_ids"], pack.doc_lens, device),
        **shared,
        sample_index=torch.tensor(list(index), dtype=torch.int64, device=device),
        multi_modal=mm,
        multi_modal_counts=counts,
        layout=layout,
        prompt_lens=tuple(s.prompt_len for s in samples),
        response_lens=tuple(s.response_len for s in samples),
        pad_to_multiple_of=pad_to_multiple_of,
        routed_experts=routes,
    )


def _pack(samples: list[Sample], layout: str, pad_to_multiple_of: int, share_prefix: bool) -> Pack:
    """Where each sample's tokens go: :func:`~fnppo.core.batching.prefix.pack_layout` (packed), or
    row ``i`` of ``[n, round_up(max len, m)]`` (padded)."""
    if layout == "packed":
        return pack_layout(samples, pad_to_multiple_of, share_prefix)
    n = len(samples)
    width = max(round_up(len(s), pad_to_multiple_of) for s in samples)
    return Pack([i * width for i in range(n)], [0] * n, [True] * n, [width] * n, (), None)


def _check_collate_inputs(
    fn: str,
    samples: list[Sample],
    layout: str,
    pad_to_multiple_of: int,
    max_seq_len: int | None,
    vocab_size: int | None,
    sample_index: Sequence[int] | None,
) -> tuple[Sequence[int], dict[str, bool]]:
    """Every check of :func:`collate_microbatch`; returns the sample index and the optional fields present."""
    if layout not in LAYOUTS:
        raise input_error(fn, "layout", f"one of {LAYOUTS}", repr(layout))
    check_positive_int(fn, "pad_to_multiple_of", pad_to_multiple_of)
    check_positive_int(fn, "max_seq_len", max_seq_len, allow_none=True)
    check_positive_int(fn, "vocab_size", vocab_size, allow_none=True)
    n = len(samples)
    if n == 0:
        raise input_error(fn, "samples", "a non-empty sequence of Sample", "an empty sequence")
    if sample_index is None:
        sample_index = range(n)
    elif len(sample_index) != n:
        raise input_error(fn, "sample_index", f"{n} indices (one per sample)", f"{len(sample_index)} indices")
    check_devices(fn, samples)
    if max_seq_len is not None:
        check_lengths(fn, samples, max_seq_len, f"at most max_seq_len={max_seq_len} tokens")
    check_token_ids(fn, samples, vocab_size)
    check_sample_values(fn, samples)
    present = check_same_fields(fn, samples)
    check_routed_experts(fn, samples)
    check_routing_rows(fn, samples)
    check_teacher_values(fn, samples, vocab_size)
    return sample_index, present


def _collate_fields(
    samples: list[Sample], pack: Pack, layout: str, pad_token_id: int, present: dict[str, bool]
) -> dict[str, Tensor | None]:
    """Every per-token field of the micro-batch, built for all samples at once.

    Sample ``i`` places its tokens from ``pack.firsts[i]`` on at ``pack.starts[i]`` onwards in the
    flat output (packed: one row of the documents; padded: row ``i`` of ``[n, width]``): token
    ``t`` at ``start_i + t - first_i``, its response values at ``start_i + P_i - 1 - first_i + j``
    (see the alignment in :func:`collate_microbatch`), by one scatter per field. Absent optional
    fields are None.
    """
    device = samples[0].prompt_ids.device
    i64, f32 = torch.int64, torch.float32
    n = len(samples)
    plen = torch.tensor([s.prompt_len for s in samples], dtype=i64)
    rlen = torch.tensor([s.response_len for s in samples], dtype=i64)
    first = torch.tensor(pack.firsts, dtype=i64)
    starts = torch.tensor(pack.starts, dtype=i64)
    tlen = plen + rlen
    if layout == "padded":
        rows, width = n, pack.doc_lens[0]
    else:
        rows, width = 1, sum(pack.doc_lens)

    def runs(lengths: Tensor, offsets: Tensor) -> tuple[Tensor, Tensor]:
        """For each sample's run of ``lengths[i]`` items: flat destinations ``offsets[i] + j`` and ``j``."""
        total = int(lengths.sum())
        within = torch.arange(total, dtype=i64) - (lengths.cumsum(0) - lengths).repeat_interleave(lengths)
        return offsets.repeat_interleave(lengths) + within, within

    placed = tlen - first  # tokens each sample places
    dest, within = runs(placed, starts)
    tok = within + first.repeat_interleave(placed)  # the token's index in its sample
    rdest, _ = runs(rlen, starts + plen - 1 - first)
    dest_d, rdest_d = dest.to(device), rdest.to(device)
    z_all = [torch.cat([s.prompt_ids.to(i64), s.response_ids.to(i64)]) for s in samples]
    z = torch.cat([zi[f:] for zi, f in zip(z_all, pack.firsts, strict=True)])
    size = rows * width
    out: dict[str, Tensor | None] = {}
    out["input_ids"] = torch.full((size,), pad_token_id, dtype=i64, device=device).index_put_((dest_d,), z)
    last = (tlen - 1).repeat_interleave(placed)
    not_last = (tok < last).nonzero().squeeze(1)
    labels = torch.zeros(size, dtype=i64, device=device)
    out["labels"] = labels.index_put_((dest[not_last].to(device),), z[(not_last + 1).to(device)])
    out["position_ids"] = torch.zeros(size, dtype=i64, device=device).index_put_((dest_d,), tok.to(device))
    seq = torch.arange(n, dtype=i64).repeat_interleave(placed)
    shared_prefix = (~torch.tensor(pack.own_prefix)).repeat_interleave(placed) & (
        tok < (plen - 1).repeat_interleave(placed)
    )
    seq = torch.where(shared_prefix, torch.full_like(seq, -1), seq).to(device)
    out["seq_ids"] = torch.full((size,), -1, dtype=i64, device=device).index_put_((dest_d,), seq)

    def place(values: list[Tensor]) -> Tensor:
        flat = torch.zeros(size, dtype=f32, device=device)
        return flat.index_put_((rdest_d,), torch.cat(values)) if values else flat

    ones = torch.ones(int(rlen.max()) if n else 0, dtype=f32, device=device)
    out["loss_mask"] = place(
        [ones[: s.response_len] if s.response_mask is None else s.response_mask.to(f32) for s in samples]
    )
    for name in PER_TOKEN_FLOAT:
        if name in present and not present[name]:
            out[name] = None
            continue
        out[name] = place(
            [
                torch.zeros(s.response_len, dtype=f32, device=device)
                if getattr(s, name) is None
                else getattr(s, name).to(f32)
                for s in samples
            ]
        )
    out["staleness"] = place([s.staleness.to(f32) for s in samples]) if present["staleness"] else None
    return {k: (None if v is None else v.view(rows, width)) for k, v in out.items()}


def _collate_teacher_fields(samples: list[Sample], pack: Pack, layout: str) -> dict[str, Tensor | None]:
    """The teacher signals and the cross-entropy mask (:func:`~fnppo.core.batching.teacher.collate_teacher`),
    each response token where ``pack`` puts it."""
    rows, width = (len(samples), pack.doc_lens[0]) if layout == "padded" else (1, sum(pack.doc_lens))
    starts = [st + s.prompt_len - 1 - f for s, st, f in zip(samples, pack.starts, pack.firsts, strict=True)]
    return collate_teacher(samples, starts, rows, width)


def routing_fill(rows: int, layers: int, topk: int, *, device: Any = None) -> Tensor:
    """The route of a position without one (padding, a missing last token): ``-1``, int32
    ``[rows, layers, topk]``; routing replay lets the router choose there (:mod:`fnppo.megatron.routing`)."""
    return torch.full((rows, layers, topk), -1, dtype=torch.int32, device=device)


def _collate_routing(samples: list[Sample], pack: Pack, layout: str) -> Tensor:
    """``routed_experts`` per position, int32: packed ``[1, T, L, k]``, padded ``[n, S, L, k]``.

    Sample ``i``'s rows from ``pack.firsts[i]`` on fill the positions of the tokens it places (the
    token at each position; a shared prefix takes the rows of the group's first sample); the other
    positions (a missing last row, padding) get :func:`routing_fill` (-1).
    """
    _, layers, topk = samples[0].routed_experts.shape
    rows_n = len(samples) if layout == "padded" else 1
    width = pack.doc_lens[0] if layout == "padded" else sum(pack.doc_lens)
    device = samples[0].routed_experts.device
    out = routing_fill(rows_n * width, layers, topk, device=device)
    dests, parts = [], []
    for s, start, f in zip(samples, pack.starts, pack.firsts, strict=True):
        own = s.routed_experts.to(torch.int32)[f:]
        dests.append(torch.arange(start, start + own.shape[0], dtype=torch.int64))
        parts.append(own)
    out = out.index_put_((torch.cat(dests).to(device),), torch.cat(parts))
    return out.view(rows_n, width, layers, topk)


def _layout_fields(layout: str, seq_ids: Tensor, seg_lens: list[int], device: torch.device) -> dict[str, Any]:
    """``attention_mask`` (padded), ``cu_seqlens`` and ``max_seqlen`` (packed: over the documents) of a micro-batch."""
    if layout == "packed":
        cu = torch.tensor([0, *seg_lens], dtype=torch.int64, device=device).cumsum(0).to(torch.int32)
        return {"attention_mask": None, "cu_seqlens": cu, "max_seqlen": max(seg_lens)}
    return {"attention_mask": seq_ids >= 0, "cu_seqlens": None, "max_seqlen": None}


def _collate_multi_modal(
    fn: str, samples: list[Sample], device: torch.device
) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """Union of keys; per key, items concatenated on dim 0 in sample order, plus per-sample counts."""
    keys = sorted({k for s in samples for k in s.multi_modal})
    mm: dict[str, Tensor] = {}
    counts: dict[str, Tensor] = {}
    for key in keys:
        parts: list[Tensor] = []
        first: tuple[int, Tensor] | None = None
        per_sample: list[int] = []
        for i, s in enumerate(samples):
            t = s.multi_modal.get(key)
            if t is None:
                per_sample.append(0)
                continue
            if first is None:
                first = (i, t)
            else:
                j, t0 = first
                if t.shape[1:] != t0.shape[1:] or t.dtype != t0.dtype or t.device != t0.device:
                    raise input_error(
                        fn,
                        f"samples[{i}].multi_modal[{key!r}]",
                        f"items like samples[{j}]'s: trailing shape {tuple(t0.shape[1:])}, {t0.dtype}, on {t0.device}",
                        f"{describe(t)} on {t.device}",
                    )
            parts.append(t)
            per_sample.append(int(t.shape[0]))
        mm[key] = torch.cat(parts, dim=0)  # parts is non-empty: key came from some sample
        counts[key] = torch.tensor(per_sample, dtype=torch.int64, device=device)
    return mm, counts


# ---------------------------------------------------------------------------------------------
# unpack_per_sample
# ---------------------------------------------------------------------------------------------
@typechecked
def unpack_per_sample(values: Shaped[Tensor, "batch seq"], mb: Microbatch) -> list[Tensor]:
    """Per-response-token values of every sample: the inverse of :func:`collate_microbatch`'s placement.

    ``out[i] = values[row_i, s_i : s_i + R_i]`` (length ``R_i``), ``s_i`` the start of sample ``i``'s
    segment (:attr:`~fnppo.core.batching.sample.Microbatch.token_spans`: ``off_i + P_i - 1``), where
    padded: ``row_i = i, off_i = 0``; packed: ``row_i = 0, off_i = cu_seqlens[i]`` (shared-prefix
    packing: the segment after its document's prefix and the segments before it). Slices are views
    (autograd flows through them). Uses only the static lengths of ``mb`` (no device sync).

    Args:
        values: a per-position tensor of the shape of ``mb.input_ids`` (log-probs, entropies, ...).
        mb: the micro-batch it belongs to.

    Returns:
        One tensor per sample, of its response length, in the order of the micro-batch.

    Raises:
        ShapeError: ``values`` of another shape than ``mb.input_ids``.
    """
    if tuple(values.shape) != tuple(mb.input_ids.shape):
        raise ShapeError(
            f"{__name__}.unpack_per_sample: argument 'values' expected shape {tuple(mb.input_ids.shape)} "
            f"(that of mb.input_ids), received {describe(values)}"
        )
    out: list[Tensor] = []
    for i, ((_, seg), r) in enumerate(zip(mb.token_spans, mb.response_lens, strict=True)):
        out.append(values[0 if mb.is_packed else i, seg : seg + r])
    return out


def pad_microbatch(mb: Microbatch, length: int, *, pad_token_id: int = 0) -> Microbatch:
    """Pad a micro-batch along the sequence dimension to ``length`` tokens (pure).

    Packed layout: the extra tokens form one more segment at the end (its own document in the
    attention, ``seq_ids`` -1, ``loss_mask`` 0), so ``cu_seqlens`` gains an entry. Padded layout:
    columns are appended on the right (``attention_mask`` False). Real tokens, their positions and
    :func:`unpack_per_sample` are unchanged. Used to give every micro-batch of a step the same shape
    (e.g. for the interleaved pipeline schedule).

    Args:
        mb: the micro-batch.
        length: the new sequence length, ``>=`` the current one.
        pad_token_id: the token id of the padding.

    Returns:
        A new :class:`Microbatch` (``mb`` itself when it has that length already).

    Raises:
        InputError: ``length`` shorter than the micro-batch.
    """
    fn = "fnppo.pad_microbatch"
    cur = int(mb.input_ids.shape[1])
    if not isinstance(length, int) or length < cur:
        raise input_error(fn, "length", f"an int >= the current length {cur}", repr(length))
    extra = length - cur
    if extra == 0:
        return mb
    rows = int(mb.input_ids.shape[0])

    def pad(t: Tensor | None, value: float | int) -> Tensor | None:
        if t is None:
            return None
        return torch.cat([t, t.new_full((rows, extra), value)], dim=1)

    changes: dict[str, Any] = dict(
        input_ids=pad(mb.input_ids, pad_token_id),
        position_ids=pad(mb.position_ids, 0),
        labels=pad(mb.labels, 0),
        loss_mask=pad(mb.loss_mask, 0.0),
        old_logprobs=pad(mb.old_logprobs, 0.0),
        advantages=pad(mb.advantages, 0.0),
        ref_logprobs=pad(mb.ref_logprobs, 0.0),
        rollout_logprobs=pad(mb.rollout_logprobs, 0.0),
        values=pad(mb.values, 0.0),
        returns=pad(mb.returns, 0.0),
        staleness=pad(mb.staleness, 0.0),
        seq_ids=pad(mb.seq_ids, -1),
        attention_mask=pad(mb.attention_mask, False),
        ce_mask=pad(mb.ce_mask, 0.0),
    )
    for name in ("teacher_topk_ids", "teacher_topk_logprobs"):
        t = getattr(mb, name)
        if t is not None:
            changes[name] = torch.cat([t, t.new_zeros((rows, extra, t.shape[2]))], dim=1)
    if mb.routed_experts is not None:
        _, _, layers, topk = mb.routed_experts.shape
        fill = routing_fill(rows * extra, layers, topk, device=mb.routed_experts.device)
        fill = fill.reshape(rows, extra, layers, topk)
        changes["routed_experts"] = torch.cat([mb.routed_experts, fill], dim=1)
    if mb.branch_ids is not None and mb.root_ids is not None:  # the padding: a run of its own
        new = int(mb.branch_ids.max()) + 1 if mb.branch_ids.numel() else 0
        changes["branch_ids"] = pad(mb.branch_ids, new)
        changes["root_ids"] = pad(mb.root_ids, new)
    if mb.cu_seqlens is not None:
        tail = mb.cu_seqlens.new_full((1,), length)
        changes["cu_seqlens"] = torch.cat([mb.cu_seqlens, tail])
        changes["max_seqlen"] = max(int(mb.max_seqlen or 0), extra)
    return dataclasses.replace(mb, **changes)


def to_device(mb: Microbatch, device: torch.device) -> Microbatch:
    """``mb`` with every tensor leaf moved to ``device`` (non-blocking; None stays None; CPU: ``mb`` itself)."""
    if device.type == "cpu":
        return mb
    return optree.tree_map(
        lambda x: x.to(device, non_blocking=True) if isinstance(x, torch.Tensor) else x,
        mb,
        none_is_leaf=False,
        namespace="fnppo",
    )
