"""Per-token policy versions (partial rollouts): each response token's age, checked, reported and,
where asked, expired (pure torch, no Megatron).

In agentic and long-response RL a response is generated across several weight updates: the engine
is updated mid-generation, so the first tokens of a response come from older weights than the last
ones. A :class:`~fnppo.core.batching.sample.Sample` then carries ``versions``, the policy version of
each response token; for the version being trained (``current_version``) a token's age is
``staleness = current_version - version``. This module is the computation behind
:meth:`fnppo.losses.Staleness.prepare` (which owns the settings ``max_staleness`` and ``expire``):

* :func:`prepare_batch` -- the ages of every token of a batch, as a new batch whose samples carry
  them (``Sample.staleness``), and the batch's token-level metrics. A token from a version newer
  than the one being trained is refused; one older than ``max_staleness`` is refused too
  (``expire="refuse"``) or expired (``expire="tokens"``: its ``response_mask`` becomes 0, so it
  leaves the loss, and ``offpolicy/expired_token_frac`` counts it);
* :func:`uses_staleness` -- whether a policy loss's formula depends on the age (attribute
  ``uses_staleness``, as ``loglinear_decoupled`` declares);
* :func:`check_ages_given` -- the step's entry check: samples that carry per-token versions but no
  ages, trained with a loss that depends on the age, are refused (the loss would otherwise use one
  scalar age for tokens of several versions);
* :func:`check_ages` -- the loss call's check of a ``[batch, seq]`` age tensor.

Why the ages travel in the samples: the version being trained is the caller's state (its step
counter), so it is passed in once, to :meth:`~fnppo.losses.Staleness.prepare`, before the step; from
there the ages are per-token data like the advantages, split, packed, sharded over data and context
parallelism and unpacked by the same code, and the step needs no version counter of its own.
Reference: per-token versions and the expiry of stale tokens as prime-rl, slime and xtuner use them
for partial rollouts; the per-token age in AReaL's log-linear proximal policy (arXiv:2505.24298).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch

from fnppo.core.batching.sample import Sample
from fnppo.core.errors import describe, input_error
from fnppo.core.typing import Tensor

__all__ = ["EXPIRE", "prepare_batch", "uses_staleness", "check_ages_given", "check_ages", "TOKEN_METRICS"]

EXPIRE = ("refuse", "tokens")
"""What ``Staleness.expire`` can be: refuse a batch with a token older than allowed, or expire the token."""

TOKEN_METRICS = ("offpolicy/token_staleness_mean", "offpolicy/token_staleness_max", "offpolicy/expired_token_frac")
"""The token-level metrics of :func:`prepare_batch`."""


def uses_staleness(loss: Any) -> bool:
    """The ``uses_staleness`` attribute of a policy loss (False when it has none): whether its formula
    depends on each token's age."""
    return bool(getattr(loss, "uses_staleness", False))


def _check_current(fn: str, current_version: Any) -> None:
    if isinstance(current_version, bool) or not isinstance(current_version, int) or current_version < 0:
        raise input_error(fn, "current_version", "an int >= 0 (the version being trained)", repr(current_version))


def _per_sample_versions(fn: str, samples: list[Sample], versions: Sequence[int] | None) -> list[Tensor]:
    """The per-token versions of every sample: their own (all or none), or ``versions`` (one per sample)."""
    have = [s.versions is not None for s in samples]
    if versions is not None:
        if any(have):
            raise input_error(
                fn,
                "versions",
                f"None when the samples carry per-token versions (batch[{have.index(True)}].versions)",
                f"{type(versions).__name__} of {len(versions) if isinstance(versions, Sequence) else '?'}",
            )
        if isinstance(versions, (str, bytes)) or not isinstance(versions, Sequence) or len(versions) != len(samples):
            got = f"{len(versions)} versions" if isinstance(versions, Sequence) else repr(versions)[:80]
            raise input_error(fn, "versions", f"a sequence of {len(samples)} ints (one per sample)", got)
        for i, v in enumerate(versions):
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise input_error(fn, f"versions[{i}]", "an int >= 0 (the version that sampled the sample)", repr(v))
        return [torch.full((s.response_len,), v, dtype=torch.int64) for s, v in zip(samples, versions, strict=True)]
    if not any(have):
        raise input_error(
            fn,
            "batch[0].versions",
            "per-token versions on every sample (Sample.versions), or versions= with one version per sample",
            "None",
        )
    if not all(have):
        raise input_error(
            fn,
            f"batch[{have.index(False)}].versions",
            f"a tensor (batch[{have.index(True)}] has versions; all samples or none)",
            "None",
        )
    return [s.versions.to(torch.int64).cpu() for s in samples]


def _refuse_first(
    fn: str,
    per_sample: list[Tensor],
    bad: Callable[[Tensor], Tensor],
    current_version: int,
    expected: str,
    from_arg: bool,
) -> None:
    """Name the first token whose version is refused: ``bad(versions) -> bool mask``."""
    for i, v in enumerate(per_sample):
        flags = bad(v)
        if bool(flags.any()):
            j = int(flags.nonzero()[0, 0])
            arg = f"versions[{i}]" if from_arg else f"batch[{i}].versions"
            version = int(v[j])
            raise input_error(
                fn, arg, expected, f"token {j} of version {version} (staleness {current_version - version})"
            )


def prepare_batch(
    batch: Sequence[Sample],
    current_version: int,
    *,
    max_staleness: int,
    expire: str,
    versions: Sequence[int] | None = None,
    fn: str = "fnppo.losses.Staleness.prepare",
) -> tuple[list[Sample], dict[str, float]]:
    """The batch with each token's age (``Sample.staleness = current_version - versions``) and its metrics.

    Versions come from the samples (``Sample.versions``, every sample or none) or, for samples without
    them, from ``versions`` (one per sample: every token of a sample has its version). A token of a
    version above ``current_version`` is refused; one of age above ``max_staleness`` is refused
    (``expire="refuse"``) or expired (``expire="tokens"``: the returned sample's ``response_mask`` is 0
    there, in the mask's dtype, float32 when the sample had none). Nothing is changed in place: the
    samples returned are new, the ones given stay as they were.

    Metrics, over the tokens in the loss before expiry (``response_mask`` 1):
    ``offpolicy/token_staleness_mean``, ``offpolicy/token_staleness_max`` and
    ``offpolicy/expired_token_frac`` (0 without tokens).

    Raises:
        InputError: ``current_version`` not an int >= 0; an empty batch; versions on some samples only,
            on none (without ``versions``) or on the samples and in ``versions`` both; a token newer than
            ``current_version``; with ``expire="refuse"``, a token older than ``max_staleness``, naming
            ``batch[i].versions`` (or ``versions[i]``), the token and its version. Before anything is
            computed.
    """
    _check_current(fn, current_version)
    samples = list(batch)
    if not samples:
        raise input_error(fn, "batch", "a non-empty sequence of Sample", "an empty sequence")
    per_sample = _per_sample_versions(fn, samples, versions)
    flat = torch.cat(per_sample)
    low = current_version - max_staleness
    from_arg = versions is not None
    if flat.numel() and bool((flat > current_version).any()):
        _refuse_first(
            fn,
            per_sample,
            lambda v: v > current_version,
            current_version,
            f"versions <= {current_version} (the version being trained: a token cannot come from a newer policy)",
            from_arg,
        )
    if expire == "refuse" and flat.numel() and bool((flat < low).any()):
        _refuse_first(
            fn,
            per_sample,
            lambda v: v < low,
            current_version,
            f"versions in [{low}, {current_version}] (max_staleness={max_staleness}: an older token is refused, "
            "not trained on; Staleness(expire='tokens') masks it out of the loss instead)",
            from_arg,
        )
    out: list[Sample] = []
    counted, ages_all, expired = [], [], []
    for s, v in zip(samples, per_sample, strict=True):
        ages = current_version - v
        keep = ages <= max_staleness
        mask = s.response_mask
        in_loss = torch.ones(s.response_len, dtype=torch.bool) if mask is None else (mask.cpu() != 0)
        counted.append(in_loss)
        ages_all.append(ages)
        expired.append(in_loss & ~keep)
        new_mask = mask
        if not bool(keep.all()):  # (only with expire="tokens": older tokens were refused above)
            new_mask = _masked(mask, keep, s.response_len)
        device = s.response_ids.device
        out.append(dataclasses.replace(s, staleness=ages.to(device), response_mask=new_mask))
    in_loss, ages, gone = torch.cat(counted), torch.cat(ages_all), torch.cat(expired)
    n = int(in_loss.sum())
    metrics = {
        "offpolicy/token_staleness_mean": float(ages[in_loss].double().mean()) if n else 0.0,
        "offpolicy/token_staleness_max": float(ages[in_loss].max()) if n else 0.0,
        "offpolicy/expired_token_frac": float(gone.sum()) / n if n else 0.0,
    }
    return out, metrics


def _masked(mask: Tensor | None, keep: Tensor, r: int) -> Tensor:
    """``mask`` (None: all ones, float32) with 0 where ``keep`` is False, in the mask's dtype and device."""
    if mask is None:
        return keep.to(torch.float32)
    keep = keep.to(mask.device)
    if mask.dtype == torch.bool:
        return mask & keep
    return torch.where(keep, mask, torch.zeros_like(mask))


def check_ages_given(fn: str, samples: Sequence[Sample], policy: Any, *, arg: str = "batch") -> None:
    """Samples with per-token versions but no ages, for a policy loss that depends on the age: refused.

    The loss would use one scalar age for tokens of several versions; :meth:`fnppo.losses.Staleness.prepare`
    gives every token its own. (All-or-none of both fields is :func:`~fnppo.core.batching.checks.check_same_fields`'s.)

    Raises:
        InputError: naming ``<arg>[i].staleness`` of the first such sample.
    """
    if not uses_staleness(policy):
        return
    for i, s in enumerate(samples):
        if s.versions is not None and s.staleness is None:
            raise input_error(
                fn,
                f"{arg}[{i}].staleness",
                f"per-token ages since {arg}[{i}] carries per-token versions and the policy loss "
                f"{type(policy).__name__} depends on each token's age "
                "(Staleness.prepare(batch, current_version) computes them)",
                "None",
            )


def check_ages(fn: str, arg: str, ages: Tensor, mask: Tensor) -> None:
    """Per-token ages (``[batch, seq]``, floating) are whole numbers ``>= 0`` wherever ``mask`` is
    non-zero (one host sync; positions off the mask are never read).

    Raises:
        InputError: naming ``arg``, with the smallest offending value.
    """
    m = mask != 0
    bad = m & ~(torch.isfinite(ages) & (ages >= 0) & (ages == torch.floor(ages)))
    if bool(bad.any()):
        first = float(ages[bad].reshape(-1)[0])
        raise input_error(
            fn,
            arg,
            "whole numbers >= 0 (each token's age in versions) wherever loss_mask is 1",
            f"{describe(ages)} containing {first!r}",
        )
