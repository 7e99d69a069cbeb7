"""Helpers shared by the multi-rank step tests (test_step, test_value, test_vlm, test_long_context).

Run inside the ranks of :func:`fnppo.testing.run_ranks` (gathering over data parallelism, the
schedule that drops the finalizer, the gradients as ``finalize_grads`` hands them on) or in the
parent (the comparisons with a one-process reference).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch

import fnppo
import fnppo.megatron.unwrap


def gather_dp(per_sample: list, layout) -> list:
    """Every DP rank's per-sample tensors, in global sample order (the list itself without DP)."""
    if layout.dp == 1:
        return per_sample
    import torch.distributed as dist

    out: list = [None] * layout.dp
    dist.all_gather_object(out, per_sample, group=layout.dp_group)
    return [t for part in out for t in part]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """``max |a - b| / max |b|`` in float64."""
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-12))


def max_metric_error(ref: dict, got: dict, keys: Iterable[str], what: str, tol: float) -> float:
    """Each metric of ``keys`` in ``got`` within ``tol`` of ``ref`` (relative); the largest error."""
    worst = 0.0
    for key in keys:
        r, g = ref[key], got[key]
        err = abs(g - r) / max(abs(r), 1e-12)
        assert err <= tol, f"{what}: metric {key} {g} vs reference {r} (rel {err:.2e})"
        worst = max(worst, err)
    return worst


def max_update_error(ref: dict, got: dict, what: str, tol: float) -> float:
    """Every parameter of ``ref["weights"]``: the same initial value (``"before"``) in both, a non-zero
    update in ``ref``, and ``got``'s update within ``tol`` of it (relative to the update, not to the
    weight: a norm weight moves by a small fraction of itself); the largest error."""
    worst = 0.0
    for name, w in ref["weights"].items():
        assert torch.equal(got["before"][name], ref["before"][name]), f"{what}: initial {name} differs"
        update_ref = w.double() - ref["before"][name].double()
        update_got = got["weights"][name].double() - got["before"][name].double()
        assert float(update_ref.abs().max()) > 0, f"{what}: parameter {name} did not move"
        err = rel_err(update_got, update_ref)
        assert err <= tol, f"{what}: update of parameter {name} rel err {err:.2e}"
        worst = max(worst, err)
    return worst


@contextlib.contextmanager
def finalize_dropped() -> Iterator[None]:
    """Megatron's schedule, with ``config.finalize_model_grads_func`` removed from every model chunk
    before it runs (what a refactor that drops it does)."""
    import megatron.core.pipeline_parallel as mpp

    real = mpp.get_forward_backward_func

    def dropping_finalize():
        fb = real()

        def run(**kw):
            for m in kw["model"]:
                fnppo.megatron.unwrap.unwrap_model(m).config.finalize_model_grads_func = None
            return fb(**kw)

        return run

    mpp.get_forward_backward_func = dropping_finalize
    try:
        yield
    finally:
        mpp.get_forward_backward_func = real


@contextlib.contextmanager
def finalized_grads() -> Iterator[dict]:
    """Yields a dict whose ``"grads"`` is, after each step, the ``main_grad`` of every parameter (one
    list per model chunk) as :func:`fnppo.megatron.grads.finalize_grads` hands them to the optimizer."""
    import fnppo.steps.schedule as step_module

    real = step_module.finalize_grads
    captured: dict = {}

    def spy(model, **kw):
        stats = real(model, **kw)
        captured["grads"] = [
            [p.main_grad.detach().clone() for p in fnppo.megatron.unwrap.unwrap_model(c).parameters()] for c in model
        ]
        return stats

    step_module.finalize_grads = spy
    try:
        yield captured
    finally:
        step_module.finalize_grads = real
