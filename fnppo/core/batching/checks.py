"""The sample checks: one function per check, called where samples enter a computation.

:func:`fnppo.core.batching.collate.collate_microbatch` runs them on the samples it is given, the split
(:mod:`fnppo.core.batching.split`) and the training step on the caller's whole batch:
:func:`check_lengths`, :func:`check_same_fields`, :func:`check_token_ids`,
:func:`check_sample_values`, :func:`check_devices`, :func:`check_routed_experts`,
:func:`check_routing_rows`. Each names ``<arg>[i]``, ``i`` the position in the list it is given:
``samples[i]`` of :func:`~fnppo.core.batching.collate.collate_microbatch`'s argument, ``batch[i]`` of the
caller's batch in the training step. Every error is an :class:`~fnppo.core.errors.InputError` in
the standard format (:mod:`fnppo.core.errors`, also the home of ``check_positive_int``).

Plain torch; nothing here imports Megatron.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from fnppo.core.batching.sample import ALL_OR_NONE, PER_TOKEN_FLOAT, PER_TOKEN_INT, Sample
from fnppo.core.errors import check_finite, check_mask01, check_range, describe, input_error
from fnppo.core.typing import Tensor

__all__ = [
    "check_lengths",
    "check_same_fields",
    "check_routed_experts",
    "check_routing_rows",
    "check_token_ids",
    "check_devices",
    "check_sample_values",
    "routing_dtype_holds",
]


def check_lengths(fn: str, samples: Sequence[Sample], limit: int, expected: str, *, arg: str = "samples") -> None:
    """Every sample has at most ``limit`` tokens (prompt + response); longer ones are refused, never cut.

    Args:
        fn, arg: the function and argument named in the error (``arg[i]`` is the sample).
        samples: the samples.
        limit: the largest allowed ``len(sample)``.
        expected: the error's "expected" text, e.g. ``"at most max_seq_len=8 tokens"``.

    Raises:
        InputError: for the first sample longer than ``limit``.
    """
    for i, s in enumerate(samples):
        if len(s) > limit:
            raise input_error(
                fn, f"{arg}[{i}]", expected, f"{len(s)} tokens (prompt {s.prompt_len} + response {s.response_len})"
            )


def check_same_fields(fn: str, samples: Sequence[Sample], *, arg: str = "samples") -> dict[str, bool]:
    """``old_logprobs`` / ``ref_logprobs`` / ``rollout_logprobs`` / ``values`` / ``returns`` / ``versions`` / ``staleness`` /
    ``routed_experts`` are given for all samples or for none.

    Returns:
        ``{name: all samples have it}`` for each of these names.

    Raises:
        InputError: naming the first sample without the field and one that has it.
    """
    present: dict[str, bool] = {}
    for name in (*ALL_OR_NONE, "routed_experts"):
        have = [getattr(s, name) is not None for s in samples]
        if any(have) and not all(have):
            missing = have.index(False)
            raise input_error(
                fn,
                f"{arg}[{missing}].{name}",
                f"a tensor ({arg}[{have.index(True)}] has {name}; all samples or none)",
                "None",
            )
        present[name] = all(have)
    return present


def routing_dtype_holds(dtype: torch.dtype, num_experts: int) -> bool:
    """Whether an integer ``dtype`` holds every expert index ``0 .. num_experts - 1`` (uint8: 256 experts)."""
    return torch.iinfo(dtype).max >= num_experts - 1


def check_routed_experts(
    fn: str,
    samples: Sequence[Sample],
    *,
    num_layers: int | None = None,
    topk: int | None = None,
    num_experts: int | None = None,
    arg: str = "samples",
    values: bool = True,
) -> None:
    """Routed experts (routing replay) that a step can force: one shape, the model's, valid indices.

    With ``routed_experts`` on the samples (:func:`check_same_fields` checks all-or-none): every
    sample's ``[tokens, layers, topk]`` has the layers and top-k of the first sample (and
    ``num_layers`` / ``topk`` when given: the model's MoE layers and router top-k); its dtype holds
    ``num_experts - 1``; with ``values``, every row is either ``-1`` in every entry (no route: the
    router chooses) or indices in ``[0, num_experts)`` (``>= 0`` when ``num_experts`` is None) whose
    ``topk`` entries are distinct (duplicates would route a token to fewer experts than top-k, and
    the dispatcher's token counts would no longer match).
    One host sync for the values; the samples are searched one by one only to name the first offender.

    Raises:
        InputError: naming ``<arg>[i].routed_experts``, with the layer and token of a bad row.
    """
    have = [s for s in samples if s.routed_experts is not None]
    if not have:
        return
    first = have[0].routed_experts
    want = (num_layers if num_layers is not None else first.shape[1], topk if topk is not None else first.shape[2])
    for i, s in enumerate(samples):
        t = s.routed_experts
        if t is None:
            continue
        if tuple(t.shape[1:]) != want:
            whose = "the model's MoE layers and top-k" if num_layers is not None else f"those of {arg}[0]"
            raise input_error(
                fn, f"{arg}[{i}].routed_experts", f"[tokens, {want[0]}, {want[1]}] ({whose})", describe(t)
            )
        if num_experts is not None and not routing_dtype_holds(t.dtype, num_experts):
            raise input_error(
                fn,
                f"{arg}[{i}].routed_experts",
                f"an integer dtype that holds expert indices up to {num_experts - 1} (int16 or wider)",
                f"{describe(t)} (max {torch.iinfo(t.dtype).max})",
            )
    if not values:
        return
    high = num_experts if num_experts is not None else 2**62
    k = want[1]

    def bad_rows(t: Tensor) -> Tensor:
        rows = t.reshape(-1, k).to(torch.int64)
        ordered = rows.sort(dim=-1).values
        unset = (rows == -1).all(-1)  # no route: the router chooses
        return ~unset & (((rows < 0) | (rows >= high)).any(-1) | (ordered[:, 1:] == ordered[:, :-1]).any(-1))

    if not bool(bad_rows(torch.cat([s.routed_experts.reshape(-1, k).to(torch.int64) for s in have])).any()):
        return
    for i, s in enumerate(samples):
        t = s.routed_experts
        if t is None:
            continue
        bad = bad_rows(t).nonzero()
        if bad.numel():
            flat = int(bad[0, 0])
            token, layer = divmod(flat, want[0])
            row = t.reshape(-1, k)[flat].tolist()
            if min(row) < 0 or max(row) >= high:
                expected = (
                    f"expert indices in [0, {num_experts}) (the model's num_experts)"
                    if num_experts is not None
                    else "expert indices >= 0"
                )
                expected += ", or -1 in every entry of a row (no route: the router chooses)"
            else:
                expected = f"{k} distinct experts per token and MoE layer"
            raise input_error(
                fn, f"{arg}[{i}].routed_experts", expected, f"experts {row} for token {token}, MoE layer {layer}"
            )


def check_token_ids(fn: str, samples: Sequence[Sample], vocab_size: int | None, *, arg: str = "samples") -> None:
    """Token ids lie in ``[0, vocab_size)`` (``vocab_size=None``: are >= 0).

    One device-to-host sync over all samples; only when something is out of range are the
    samples checked one by one to name the first offender.

    Raises:
        InputError: ``"<arg>[i].prompt_ids"`` / ``".response_ids"`` with the range of its values.
    """
    high = vocab_size if vocab_size is not None else 2**63 - 1
    ids = [t.reshape(-1).to(torch.int64) for s in samples for t in (s.prompt_ids, s.response_ids)]
    flat = torch.cat(ids) if ids else torch.zeros(0, dtype=torch.int64)
    if flat.numel() == 0 or not bool(((flat < 0) | (flat >= high)).any()):
        return
    for i, s in enumerate(samples):
        for name in ("prompt_ids", "response_ids"):
            check_range(fn, f"{arg}[{i}].{name}", getattr(s, name), 0, high)


def check_devices(fn: str, samples: Sequence[Sample], *, arg: str = "samples") -> None:
    """Every tensor of every sample is on the device of the first sample.

    Raises:
        InputError: naming ``<arg>[i].<field>``, the device expected and the one received.
    """
    device = samples[0].prompt_ids.device
    for i, s in enumerate(samples):
        for name in ("prompt_ids", "response_ids", *PER_TOKEN_FLOAT, "response_mask", "routed_experts", *PER_TOKEN_INT):
            t = getattr(s, name)
            if t is not None and t.device != device:
                raise input_error(
                    fn,
                    f"{arg}[{i}].{name}",
                    f"a tensor on {device} (the device of {arg}[0])",
                    f"{describe(t)} on {t.device}",
                )


def check_sample_values(fn: str, samples: Sequence[Sample], *, arg: str = "samples") -> None:
    """Response masks are 0/1 and the per-token values (advantages, old / ref / rollout log-probs,
    values, returns) finite, in every sample.

    The one home of these value checks: :func:`~fnppo.core.batching.collate.collate_microbatch` runs it on the samples it is
    given, :func:`fnppo.train_step` (and the other step entry points) on the caller's whole batch
    before anything runs, with ``arg="batch"``. One check over all samples per field (one host sync
    for device tensors); only when it fails are the samples checked one by one, to name the first
    offender.

    Raises:
        InputError: naming ``<arg>[i].response_mask`` (a 0/1 mask) or ``<arg>[i].<field>`` (finite
            values), ``i`` the sample's position in ``samples``.
    """
    masks = [s.response_mask for s in samples if s.response_mask is not None and s.response_mask.dtype != torch.bool]
    fields = {name: [getattr(s, name) for s in samples if getattr(s, name) is not None] for name in PER_TOKEN_FLOAT}
    flags = []
    if masks:
        m = torch.cat([t.reshape(-1) for t in masks])
        flags.append(((m != 0) & (m != 1)).any())
    for parts in fields.values():
        if parts:  # torch.cat promotes mixed float dtypes
            flags.append((~torch.isfinite(torch.cat([t.reshape(-1) for t in parts]))).any())
    if not flags or not bool(torch.stack(flags).any()):
        return
    for i, s in enumerate(samples):
        if s.response_mask is not None:
            check_mask01(fn, f"{arg}[{i}].response_mask", s.response_mask)
        for name in PER_TOKEN_FLOAT:
            check_finite(fn, f"{arg}[{i}].{name}", getattr(s, name))


def check_routing_rows(fn: str, samples: Sequence[Sample], *, arg: str = "samples") -> None:
    """Every sample's ``routed_experts`` has ``len(sample)`` or ``len(sample) - 1`` rows: one per
    token of the sequence being collated (shapes only, no host sync). :class:`Sample` checks this
    when it is built, except on a sample with multi-modal items, whose rows may be those of the
    sequence with its items expanded (:class:`fnppo.megatron.vlm_collate.VLMCollate` expands both).

    Raises:
        InputError: naming ``<arg>[i].routed_experts``, the row counts expected and its shape.
    """
    for i, s in enumerate(samples):
        t = s.routed_experts
        if t is not None and t.shape[0] not in (len(s), len(s) - 1):
            raise input_error(
                fn,
                f"{arg}[{i}].routed_experts",
                f"{len(s)} or {len(s) - 1} rows (one per token collated; routes of a sequence whose "
                "multi-modal items take several positions need the collate stage that expands them, "
                "e.g. fnppo.vlm.VLMCollate)",
                describe(t),
            )
