"""fnppo.megatron.numerics: each behaviour the batch-invariant record changes, one function each.

The spec (fnppo's attention becomes the mode's, other attention refused under CP, stacked experts refused
where the record says sequential), the routers (tiled gating set on the instance, Megatron's class left
alone), the micro-batches' shape (FP8, the record's rows and block) and the schedule's context
(determinism for MoE in the mode). The bits themselves: tests/test_batch_invariant.py.
"""

from __future__ import annotations

import copy
import dataclasses
from types import SimpleNamespace

import pytest
import torch
from megatron.core.transformer.moe.router import TopKRouter
from torch import nn

import fnppo
from fnppo.core.kernels.invariant import invariant_router_logits
from fnppo.megatron import numerics
from fnppo.megatron.config import CUDA_MIN_ROWS, InvariantKernels
from fnppo.megatron.core_attention import PackedDotProductAttention
from fnppo.megatron.layer_specs import local_layer_spec
from fnppo.megatron.numerics import (
    InvariantAttention,
    MicrobatchShape,
    invariant_layer_spec,
    microbatch_shape,
    prepare_model,
    running,
)
from fnppo.megatron.packed_attention import FLEX_BLOCK
from fnppo.megatron.stacked_experts import StackedExperts


def _config(kernels=None, **fields) -> SimpleNamespace:
    config = SimpleNamespace(context_parallel_size=1, fp8=None, num_moe_experts=None, deterministic_mode=False)
    vars(config).update(fields)
    numerics.mark_config(config, kernels)
    return config


def _core_attention(spec):
    return spec.submodules.self_attention.submodules.core_attention


def test_the_spec_takes_the_modes_attention_and_refuses_what_cannot_hold():
    spec = local_layer_spec(normalization="RMSNorm")
    assert _core_attention(spec) is PackedDotProductAttention
    assert invariant_layer_spec(spec, _config()) is spec  # outside the mode: the spec itself
    got = invariant_layer_spec(spec, _config(InvariantKernels.TORCH))
    assert _core_attention(got) is InvariantAttention and issubclass(InvariantAttention, PackedDotProductAttention)
    assert _core_attention(spec) is PackedDotProductAttention  # the given spec is not modified
    # another core attention: kept without CP, refused by name under it
    megatron = local_layer_spec(normalization="RMSNorm", packed_attention=False)
    assert invariant_layer_spec(megatron, _config(InvariantKernels.TORCH)) is megatron
    with pytest.raises(fnppo.InputError, match="argument 'layer_spec' expected a spec whose core attention is fnppo"):
        invariant_layer_spec(megatron, _config(InvariantKernels.TORCH, context_parallel_size=2))
    # a spec's own subclass is kept as given; under CP only the mode's attention (or a subclass of it) holds
    own = type("OwnAttention", (PackedDotProductAttention,), {})
    theirs = dataclasses.replace(
        spec,
        submodules=dataclasses.replace(
            spec.submodules,
            self_attention=dataclasses.replace(
                spec.submodules.self_attention,
                submodules=dataclasses.replace(spec.submodules.self_attention.submodules, core_attention=own),
            ),
        ),
    )
    assert _core_attention(invariant_layer_spec(theirs, _config(InvariantKernels.TORCH))) is own
    with pytest.raises(fnppo.InputError, match="argument 'layer_spec'"):
        invariant_layer_spec(theirs, _config(InvariantKernels.TORCH, context_parallel_size=2))
    cp = invariant_layer_spec(spec, _config(InvariantKernels.TORCH, context_parallel_size=2))
    assert _core_attention(cp) is InvariantAttention
    # stacked experts where the record says sequential (tiles): refused; with FAST taken
    moe = local_layer_spec(normalization="RMSNorm", num_experts=4, moe_experts="stacked")
    experts = moe.submodules.mlp.submodules.experts
    assert (experts.module if hasattr(experts, "module") else experts) is StackedExperts
    with pytest.raises(fnppo.InputError, match="'sequential' experts with the 'torch' kernels"):
        invariant_layer_spec(moe, _config(InvariantKernels.TORCH))
    fast = invariant_layer_spec(moe, _config(InvariantKernels.FAST))
    assert _core_attention(fast) is InvariantAttention


def _router(kernels, dtype="fp32") -> TopKRouter:
    router = TopKRouter.__new__(TopKRouter)
    nn.Module.__init__(router)
    g = torch.Generator().manual_seed(2)
    router.weight = nn.Parameter(torch.randn(4, 16, generator=g, dtype=torch.bfloat16))
    router.bias = None
    router.config = _config(kernels, moe_router_dtype=dtype)
    return router


def test_routers_of_the_mode_compute_tiled_logits_and_megatrons_class_is_left_alone():
    original = TopKRouter.gating
    x = torch.randn(3, 5, 16, generator=torch.Generator().manual_seed(3), dtype=torch.bfloat16)
    tiled = _router(InvariantKernels.FAST)
    prepare_model(nn.Sequential(tiled))
    got = tiled.gating(x)
    assert got.dtype == torch.float32
    assert torch.equal(got, invariant_router_logits(x, tiled.weight, None, torch.float32))
    assert TopKRouter.gating is original  # nothing process-wide
    copied = copy.deepcopy(tiled)  # a copy (a reference model) keeps the tiled gating, bound to itself
    assert copied.gating.__self__ is copied and torch.equal(copied.gating(x), got)
    for kernels in (None, InvariantKernels.TORCH, InvariantKernels.MEGATRON):  # no router_tiles: Megatron's
        other = _router(kernels)
        prepare_model(nn.Sequential(other))
        assert "gating" not in vars(other), kernels


def test_microbatch_shape_is_what_fp8_and_the_record_ask():
    assert microbatch_shape(_config()) == MicrobatchShape(1, None)
    assert microbatch_shape(_config(fp8="hybrid")) == MicrobatchShape(16, None)
    assert microbatch_shape(_config(InvariantKernels.TORCH)) == MicrobatchShape(1, None)
    assert microbatch_shape(_config(InvariantKernels.FAST)) == MicrobatchShape(FLEX_BLOCK, CUDA_MIN_ROWS)
    own = InvariantKernels(name="own", tiles=True, min_rows=96)
    assert microbatch_shape(_config(own)) == MicrobatchShape(1, 96)
    # a padded layout of Transformer Engine's spec in the mode: refused, naming the owner's field
    assert microbatch_shape(_config(), padded=True, te_spec=True) == MicrobatchShape(1, None)
    with pytest.raises(fnppo.InputError, match=r"StepConfig: argument 'layout' expected 'packed'"):
        microbatch_shape(_config(InvariantKernels.TORCH), padded=True, te_spec=True)


@pytest.mark.parametrize(
    "kernels, moe, deterministic, want",
    [
        (None, False, False, (False, None)),
        (None, True, False, (False, None)),
        (InvariantKernels.TORCH, False, False, (False, None)),
        (InvariantKernels.TORCH, True, False, (True, False)),  # MoE in the mode: the repeatable routing paths
        (None, False, True, (True, True)),
        (InvariantKernels.TORCH, True, True, (True, True)),
    ],
)
def test_running_switches_determinism_as_the_model_asks(kernels, moe, deterministic, want):
    config = _config(kernels, num_moe_experts=4 if moe else None, deterministic_mode=deterministic)
    before = torch.are_deterministic_algorithms_enabled()
    with running(config):
        on = torch.are_deterministic_algorithms_enabled()
        fill = torch.utils.deterministic.fill_uninitialized_memory if on else None
    assert (on, fill) == want
    assert torch.are_deterministic_algorithms_enabled() == before


def test_the_mode_is_read_from_the_record_alone():
    """A look-alike of a record (a namespace with the same fields) is not the mode: the one reader
    accepts an InvariantKernels only, so no other value can switch a behaviour on."""
    fake = SimpleNamespace(**dataclasses.asdict(InvariantKernels.FAST))
    config = _config()
    config.fnppo_invariant_kernels = fake
    assert numerics.kernels_of(config) is None
    assert microbatch_shape(config) == MicrobatchShape(1, None)


@pytest.mark.parametrize(
    "call, arg",
    [
        (lambda: microbatch_shape(_config(), padded="yes"), "padded"),
        (lambda: microbatch_shape(_config(), te_spec=1), "te_spec"),
        (lambda: microbatch_shape(_config(), owner=""), "owner"),
        (lambda: MicrobatchShape(0), "multiple"),
        (lambda: MicrobatchShape(1, -5), "min_tokens"),
        (lambda: MicrobatchShape(1.5), "multiple"),
        (lambda: prepare_model("chunk"), "model"),
        (lambda: numerics.batch_invariant_numerics("fast").__enter__(), "kernels"),
        (lambda: numerics.choose_kernels("yes", SimpleNamespace(tp=1, cp=1), cuda=False), "batch_invariant"),
        (lambda: numerics.choose_kernels(True, SimpleNamespace(tp=4, cp=1), cuda=False), "ModelConfig.batch_invariant"),
        (
            lambda: numerics.choose_kernels(InvariantKernels.MEGATRON, SimpleNamespace(tp=1, cp=1), cuda=False),
            "ModelConfig.batch_invariant",
        ),
        (
            lambda: numerics.choose_kernels(InvariantKernels.FAST, SimpleNamespace(tp=1, cp=2), cuda=True),
            "ModelConfig.batch_invariant",
        ),
    ],
)
def test_bad_inputs_are_refused_by_name(call, arg):
    with pytest.raises(fnppo.InputError, match=f"argument '{arg}'"):
        call()
