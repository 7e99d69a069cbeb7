"""Helpers shared by the loss tests (test_loss, test_rollout_correction, test_float64_exact, test_value).

The float64 default dtype (a module-scoped autouse fixture: ``from tests.loss_helpers import
float64_default  # noqa: F401`` turns it on for a test module), fresh leaves and their gradients,
the random batch of the property tests, the loop form of the documented aggregation modes (used
by the plain-loop references), the flat view of a loss's settings that the references read
(:func:`flat_view`) and the split-invariance check of ``ppo_loss``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from fnppo.core.losses.aggregate import loss_normalizer
from fnppo.core.losses.flat import DEFAULTS, LOSS_FIELDS
from fnppo.core.losses.ppo import ppo_loss
from fnppo.core.losses.rollout_correction import SEQ_REJECTION_CRITERIA
from fnppo.core.metrics import finalize_metrics, merge_metrics


@pytest.fixture(autouse=True, scope="module")
def float64_default():
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(previous)


def t(*rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float64)


def leaf(x: torch.Tensor) -> torch.Tensor:
    return x.clone().requires_grad_(True)


def grad_of(loss: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    (g,) = torch.autograd.grad(loss, x, allow_unused=True)
    return torch.zeros_like(x) if g is None else g


def flat_view(**fields: Any) -> SimpleNamespace:
    """Every flat loss field (``fnppo.core.losses.flat.DEFAULTS`` overridden by ``fields``), as attributes,
    plus ``tis_active`` (a rollout correction is configured): what the plain-loop references read.
    ``from_flat(**fields)`` is the config they are compared with."""
    v = {**DEFAULTS, **fields}
    active = [v["tis_cap"], v["tis_reject_low"], v["tis_reject_high"], *(v[n] for n in SEQ_REJECTION_CRITERIA)]
    return SimpleNamespace(**v, tis_active=any(x is not None for x in active))


def read_by(name: str, fields: dict[str, Any]) -> dict[str, Any]:
    """``fields`` without the policy-loss parameters that the policy loss ``name`` does not read
    (``from_flat`` refuses those unless they keep their default)."""
    others = {f for loss_fields in LOSS_FIELDS.values() for f in loss_fields} - set(LOSS_FIELDS[name])
    return {k: v for k, v in fields.items() if k not in others}


def random_batch(seed: int, b: int, s: int, p_mask: float = 0.7):
    """``(lp, old, adv, mask, ent, ref, rollout)``, ``[b, s]`` float64 (the default dtype), from ``seed``."""
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(b, s, generator=g) * 3
    lp = old + 0.4 * torch.randn(b, s, generator=g)
    adv = torch.randn(b, s, generator=g)
    mask = (torch.rand(b, s, generator=g) < p_mask).double()
    ent = torch.rand(b, s, generator=g)
    ref = old + 0.3 * torch.randn(b, s, generator=g)
    rollout = old + 0.3 * torch.randn(b, s, generator=g)
    return lp, old, adv, mask, ent, ref, rollout


def aggregate(seqs: Sequence[Sequence[Any]], mode: str, scale: float | None = None) -> Any:
    """The documented aggregation of per-token terms, one list per sequence with tokens (not empty):

    token-mean ``sum / tokens``; seq-mean-token-sum ``sum / sequences``; seq-mean-token-mean ``mean over
    sequences of the token mean``; seq-mean-token-sum-norm ``sum / scale / sequences``.
    """
    if mode == "token-mean":
        return sum(sum(s) for s in seqs) / sum(len(s) for s in seqs)
    if mode == "seq-mean-token-sum":
        return sum(sum(s) for s in seqs) / len(seqs)
    if mode == "seq-mean-token-mean":
        return sum(sum(s) / len(s) for s in seqs) / len(seqs)
    return sum(sum(s) / scale for s in seqs) / len(seqs)


def check_split_invariance(
    batch: tuple, cfg: Any, cuts: Sequence[int], part_kwargs: Callable[[list[tuple[int, int]]], dict] | None = None
) -> None:
    """``ppo_loss`` on the rows of ``batch`` cut at ``cuts`` (each part with the global normalizer and
    ``part_kwargs(parts)``) sums to the loss of the whole batch; gradients and merged metrics agree."""
    lp0, old, adv, mask, ent, ref, rollout = batch
    b = lp0.shape[0]
    others = dict(entropy=ent, ref_logprobs=ref, rollout_logprobs=rollout)
    lp = leaf(lp0)
    full, full_m = ppo_loss(lp, old, adv, mask, cfg, **others)
    g_full = grad_of(full, lp)
    bounds = sorted({0, b, *[c for c in cuts if c < b]})
    parts = list(zip(bounds[:-1], bounds[1:], strict=True))
    n = sum(loss_normalizer(mask[i:j], cfg.agg) for i, j in parts)
    extra = part_kwargs(parts) if part_kwargs is not None else {}
    lp2 = leaf(lp0)
    losses, metrics = [], []
    for i, j in parts:
        loss_i, m_i = ppo_loss(
            lp2[i:j],
            old[i:j],
            adv[i:j],
            mask[i:j],
            cfg,
            normalizer=n,
            **{k: v[i:j] for k, v in others.items()},
            **extra,
        )
        losses.append(loss_i)
        metrics.append(m_i)
    total = sum(losses)
    torch.testing.assert_close(total, full)
    torch.testing.assert_close(grad_of(total, lp2), g_full)
    merged, whole = finalize_metrics(merge_metrics(metrics)), finalize_metrics(full_m)
    assert merged.keys() == whole.keys()
    for key in whole:
        assert merged[key] == pytest.approx(whole[key], rel=1e-5, abs=1e-6), key  # fp32 metrics
    assert torch.isfinite(g_full).all()


def log_hitting(value: float, base: float = 0.0, dtype: torch.dtype = torch.float64) -> float:
    """A number ``x`` of ``dtype`` with ``exp(x - base) == value`` exactly in ``dtype`` (``x - base``
    computed in ``dtype``): log-probs whose ratio sits exactly on a threshold."""
    x0 = torch.tensor(math.log(value) + base, dtype=dtype)
    up, down = x0.clone(), x0.clone()
    for _ in range(64):
        for x in (up, down):
            if torch.exp(x - torch.tensor(base, dtype=dtype)).item() == value:
                return x.item()
        up = torch.nextafter(up, torch.tensor(math.inf, dtype=dtype))
        down = torch.nextafter(down, torch.tensor(-math.inf, dtype=dtype))
    raise AssertionError(f"no {dtype} x with exp(x - {base}) == {value}")


def log_beyond(value: float, up: bool) -> float:
    """The float64 ``x`` nearest to ``log(value)`` with ``exp(x)`` strictly above (``up``) or below ``value``:
    a ratio one step beyond a threshold."""
    x = log_hitting(value)
    while torch.exp(torch.tensor(x, dtype=torch.float64)).item() == value:
        x = math.nextafter(x, math.inf if up else -math.inf)
    return x


def next_up(x: float) -> float:
    """The next float64 above ``x``."""
    return math.nextafter(x, math.inf)


def next_down(x: float) -> float:
    """The next float64 below ``x``."""
    return math.nextafter(x, -math.inf)


def unchanged_check(inputs: dict[str, torch.Tensor]) -> Callable[[], None]:
    """Record the versions and values of ``inputs``; the returned function asserts both are unchanged."""
    versions = {k: v._version for k, v in inputs.items()}
    copies = {k: v.detach().clone() for k, v in inputs.items()}

    def check() -> None:
        for k, v in inputs.items():
            assert v._version == versions[k], k
            assert torch.equal(v.detach(), copies[k]), k

    return check
