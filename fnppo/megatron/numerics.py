"""The numerics a model is built and run with, decided in one place: the batch-invariant mode's
kernels (:class:`InvariantKernels`, one record chosen once) and the context a schedule runs in.

``ModelConfig(batch_invariant=True | InvariantKernels.X)`` becomes a record once, when Megatron's config
is built (:func:`choose_kernels`; :func:`mark_config` stores it), and each behaviour it changes is one
function here reading the record's field for it through the one reader, :func:`kernels_of`: refused
layouts (:func:`choose_kernels`), ``fusions`` (:func:`fusions_default`), ``stacked_experts``
(:func:`invariant_experts`), ``flex_attention`` (:class:`InvariantAttention`, put in the spec by
:func:`invariant_layer_spec`), ``router_tiles`` (:func:`prepare_model`), ``min_rows`` and the flex block
(:func:`microbatch_shape`), ``tiles`` and ``megatron_products`` (:func:`batch_invariant_numerics`).
The builder calls :func:`invariant_layer_spec` and :func:`prepare_model`; the steps ask two questions
every model answers, in the mode or not: :func:`microbatch_shape` and :func:`running`. No environment
variable is read: a script turns a name into a record itself (:func:`~fnppo.megatron.config.kernels_named`). A new kernel path
is a new record, or a new field read in one function here (CONTRIBUTING.md, "Add a kernel path").
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import importlib.util
import math
import types
from collections.abc import Iterator
from typing import Any

import torch
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.spec_utils import ModuleSpec
from torch import nn

from fnppo.core.batching.context_parallel import context_parallel_sequence_attention
from fnppo.core.errors import check_positive_int, describe, input_error
from fnppo.core.kernels.invariant import invariant_router_logits, sequence_attention
from fnppo.core.ops.batch_invariant import batch_invariant
from fnppo.core.typing import Tensor, typechecking_enabled
from fnppo.megatron.config import InvariantKernels, resolve_kernels
from fnppo.megatron.core_attention import PackedDotProductAttention
from fnppo.megatron.forward import deterministic_algorithms
from fnppo.megatron.packed_attention import FLEX_BLOCK, packed_causal_attention
from fnppo.megatron.parallel import ParallelLayout
from fnppo.megatron.shared_prefix import SharedPackedSeqParams
from fnppo.megatron.stacked_experts import StackedExperts

__all__ = [
    "kernels_of",
    "choose_kernels",
    "mark_config",
    "fusions_default",
    "invariant_experts",
    "InvariantAttention",
    "invariant_layer_spec",
    "prepare_model",
    "MicrobatchShape",
    "microbatch_shape",
    "running",
    "batch_invariant_numerics",
    "megatron_invariant_kernels",
    "triton_product_registrations",
]

_ATTRIBUTE = "fnppo_invariant_kernels"  # the TransformerConfig attribute holding the record (None outside the mode)


def kernels_of(config: Any) -> InvariantKernels | None:
    """The batch-invariant kernels recorded on a Megatron config (None outside the mode): the one reader."""
    kernels = getattr(config, _ATTRIBUTE, None)
    return kernels if isinstance(kernels, InvariantKernels) else None


# -- building: Megatron's config, the spec, the model ---------------------------------------------------


def choose_kernels(batch_invariant: Any, layout: ParallelLayout, *, cuda: bool) -> InvariantKernels | None:
    """The record of ``ModelConfig.batch_invariant`` for a model built on ``layout`` (for CUDA or not),
    refusing the layouts under which its batch invariance cannot hold.

    Raises:
        InputError: naming ``ModelConfig.batch_invariant``: tp > 2 (partial sums of more ranks are added
            in a position-dependent order); cp > 1 with a record without ``context_parallel``;
            ``megatron_products`` on a model built for the CPU.
    """
    kernels = resolve_kernels(batch_invariant, cuda=cuda)
    if kernels is None:
        return None
    name = kernels.name
    refusals = (
        (
            layout.tp > 2,
            "False with tp > 2 (partial sums of more than two tensor-parallel ranks are added in a "
            "position-dependent order)",
            f"True with tp={layout.tp}",
        ),
        (
            layout.cp > 1 and not kernels.context_parallel,
            f"kernels with context_parallel=True under context parallelism (the {name!r} kernels' flex attention "
            "sees one rank's shard; InvariantKernels.TORCH runs fnppo's per-sequence attention, CP included)",
            f"{name!r} kernels with cp={layout.cp}",
        ),
        (
            kernels.megatron_products and not cuda,
            "kernels without megatron_products on a model built for the CPU (Megatron's Triton matmul is CUDA only)",
            f"{name!r} kernels",
        ),
    )
    for refused, expected, received in refusals:
        if refused:
            raise input_error("transformer_config", "ModelConfig.batch_invariant", expected, received)
    return kernels


def mark_config(config: Any, kernels: InvariantKernels | None) -> None:
    """Store ``kernels`` on a freshly built ``TransformerConfig`` (read back by :func:`kernels_of`) and set
    Megatron's ``batch_invariant_mode`` (Transformer Engine's attention then runs with ``num_splits=1``). Set
    after construction: Megatron's own check asks for its FlashAttention backend, which fnppo's local spec
    does not use."""
    config.batch_invariant_mode = kernels is not None
    setattr(config, _ATTRIBUTE, kernels)


def fusions_default(kernels: InvariantKernels | None, *, cuda: bool) -> bool:
    """Whether Megatron's fused element-wise kernels are on by default: on a model built for CUDA, unless the
    record's tiles need the plain element-wise ops their torch function mode sees (``fusions`` False)."""
    return cuda and (kernels is None or kernels.fusions)


def invariant_experts(kernels: InvariantKernels) -> str:
    """The only experts module of a model in the mode: ``"stacked"`` where the record says ``stacked_experts``
    (a token's row of the grouped GEMM has the same bits whatever the group sizes), else ``"sequential"``
    (the tiles or Megatron's Triton matmul take its products)."""
    return "stacked" if kernels.stacked_experts else "sequential"


def invariant_layer_spec(spec: Any, config: Any) -> Any:
    """``spec`` (a layer spec) for a model of Megatron config ``config``: in the mode, fnppo's
    :class:`~fnppo.megatron.core_attention.PackedDotProductAttention` becomes :class:`InvariantAttention`
    (another class, a subclass of either included, is kept as given); outside it, ``spec`` itself. A new
    spec is built (the given one is not modified).

    Raises:
        InputError: naming ``layer_spec``: under context parallelism a core attention other than fnppo's or an
            :class:`InvariantAttention` (Transformer Engine's CP attention merges partial softmax results of the
            ranks); experts stacked
            where the record says ``"sequential"``.
    """
    kernels = kernels_of(config)
    if kernels is None:
        return spec
    cp = getattr(config, "context_parallel_size", 1)

    def walk(node: Any, field: str) -> Any:
        module = node.module if isinstance(node, ModuleSpec) else node
        if field == "core_attention" and isinstance(module, type):
            if module is PackedDotProductAttention:  # fnppo's own: the mode's in its place
                return (
                    dataclasses.replace(node, module=InvariantAttention) if node is not module else InvariantAttention
                )
            if cp > 1 and not issubclass(module, InvariantAttention):  # a spec's own class is kept as given
                raise input_error(
                    "fnppo.build_gpt",
                    "layer_spec",
                    "a spec whose core attention is fnppo's PackedDotProductAttention (fnppo.models.local_layer_spec) "
                    "with batch_invariant=True and context parallelism",
                    f"{module.__module__}.{module.__qualname__}",
                )
        if field == "experts" and module is StackedExperts and not kernels.stacked_experts:
            raise input_error(
                "fnppo.build_gpt", "layer_spec", f"'sequential' experts with the {kernels.name!r} kernels", "'stacked'"
            )
        if dataclasses.is_dataclass(node) and not isinstance(node, type):
            changes = {f.name: walk(getattr(node, f.name), f.name) for f in dataclasses.fields(node)}
            changed = {k: v for k, v in changes.items() if v is not getattr(node, k)}
            return dataclasses.replace(node, **changed) if changed else node
        if isinstance(node, (list, tuple)):
            items = [walk(item, field) for item in node]
            return type(node)(items) if any(a is not b for a, b in zip(items, node, strict=True)) else node
        return node

    return walk(spec, "")


def prepare_model(model: nn.Module) -> nn.Module:
    """``model`` (one built chunk) as the mode asks: with ``router_tiles`` every MoE router's gating computes
    its logits in fixed row tiles (:func:`fnppo.core.kernels.invariant.invariant_router_logits`, in the router
    dtype as Megatron's gating), set on the router itself (no class is patched); else unchanged."""
    if not isinstance(model, nn.Module):
        raise input_error("fnppo.megatron.numerics.prepare_model", "model", "a torch.nn.Module", type(model).__name__)
    for router in (m for m in model.modules() if isinstance(m, TopKRouter)):
        kernels = kernels_of(router.config)
        if kernels is not None and kernels.router_tiles:
            router.gating = types.MethodType(_tiled_gating, router)
    return model


_ROUTER_DTYPES = {"fp32": torch.float32, "fp64": torch.float64}


def _tiled_gating(router: Any, input: Tensor) -> Tensor:  # noqa: A002 - Megatron's argument name
    dtype = _ROUTER_DTYPES.get(router.config.moe_router_dtype, input.dtype)
    return invariant_router_logits(input, router.weight, router.bias, dtype)


class InvariantAttention(PackedDotProductAttention):
    """The core attention of a model in the mode (:func:`invariant_layer_spec` puts it in place of
    :class:`~fnppo.megatron.core_attention.PackedDotProductAttention`; same constructor and arguments).

    With the record's ``flex_attention`` and CUDA tensors: one flex-attention launch over block-aligned
    sequences (:func:`_aligned_flex_attention`); otherwise every sequence alone
    (:func:`fnppo.core.kernels.invariant.sequence_attention`), packed (THD) or padded (each row of
    ``[s, b, heads, dim]`` one causal sequence; its right padding is never attended to by its real tokens);
    under context parallelism (packed only) this rank's rows with the bits of one process
    (:func:`fnppo.core.batching.context_parallel.context_parallel_sequence_attention`). Shared prefixes are
    refused: the mode's bits come from running every sample alone.
    """

    no_shared_prefix = "the batch-invariant mode: its bits come from running every sample alone, not a shared prefix"

    def forward(  # type: ignore[override]
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: Tensor | None = None,
        packed_seq_params: PackedSeqParams | None = None,
    ) -> Tensor:
        fn = "fnppo.megatron.numerics.InvariantAttention.forward"
        if isinstance(packed_seq_params, SharedPackedSeqParams):
            raise input_error(fn, "packed_seq_params", "no shared prefixes in the batch-invariant mode", "shared")
        mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
        if mask_type not in (AttnMaskType.causal, AttnMaskType.padding_causal) or attention_mask is not None:
            raise input_error(
                fn,
                "attention_mask",
                "None with a causal mask type in batch-invariant mode",
                f"{describe(attention_mask)} with {mask_type}",
            )
        if self.softmax_offset is not None or self.scale_mask_softmax.window_size is not None:
            raise input_error(fn, "config", "vanilla softmax without a window in batch-invariant mode", "other")
        coeff = self.scale_mask_softmax.scale
        scale = self.softmax_scale * (coeff if coeff is not None else 1.0)
        kernels = kernels_of(self.config)
        if query.is_cuda and kernels is not None and kernels.flex_attention:
            return _aligned_flex_attention(query, key, value, packed_seq_params, scale)
        cp = getattr(self.config, "context_parallel_size", 1)
        if packed_seq_params is not None:
            params = packed_seq_params
            cu = params.cu_seqlens_q_padded if params.cu_seqlens_q_padded is not None else params.cu_seqlens_q
            squeeze = query.dim() == 4
            q, k, v = (t[:, 0] for t in (query, key, value)) if squeeze else (query, key, value)
            if cp > 1:  # this rank's rows, the bits of cp = 1
                out = context_parallel_sequence_attention(q, k, v, cu, self.pg_collection.cp, softmax_scale=scale)
            else:
                out = sequence_attention(q, k, v, [int(x) for x in cu.tolist()], softmax_scale=scale)
            total = out.shape[0]
            return out.reshape(total, 1, -1) if squeeze else out.reshape(total, -1)
        if cp > 1:
            raise input_error(fn, "packed_seq_params", "THD parameters with context parallelism", "None")
        seq, batch = query.shape[0], query.shape[1]
        rows = [
            sequence_attention(query[:, b], key[:, b], value[:, b], [0, seq], softmax_scale=scale) for b in range(batch)
        ]
        return torch.stack(rows, dim=1).reshape(seq, batch, -1)


def _aligned_flex_attention(
    query: Tensor, key: Tensor, value: Tensor, params: PackedSeqParams | None, scale: float
) -> Tensor:
    """Batch-invariant attention in one flex-attention launch (CUDA, kernels with ``flex_attention``).

    Flex attention walks a query block's keys in blocks of :data:`FLEX_BLOCK` tokens from the start
    of the pack; when every sequence starts at a multiple of that block (:func:`microbatch_shape` aligns
    packed sequences to it, and a padded row ``[s, b]`` becomes ``b`` sequences of ``s`` tokens, ``s`` a
    multiple of it) a token's keys fall into the same blocks, in the same order, whatever precedes
    its sequence in the pack, so its output has the same bits in any composition. (Measured on one
    H200: 24 sequences of 20-3,000 tokens in 5 packings gave 0 differing outputs aligned, and
    differed in every packing but the first unaligned.)
    """
    fn = "fnppo.megatron.numerics.InvariantAttention.forward"
    if params is not None:
        cu = params.cu_seqlens_q_padded if params.cu_seqlens_q_padded is not None else params.cu_seqlens_q
        squeeze = query.dim() == 4
        q, k, v = (t[:, 0] for t in (query, key, value)) if squeeze else (query, key, value)
        if typechecking_enabled() and bool((cu % FLEX_BLOCK).any()):  # one host sync, skipped with checks off
            raise input_error(
                fn,
                "packed_seq_params.cu_seqlens_q",
                f"sequence starts at multiples of {FLEX_BLOCK} in batch-invariant mode (pad_to_multiple_of)",
                str(cu.tolist()),
            )
        out = packed_causal_attention(q, k, v, cu, softmax_scale=scale, backend="flex", dynamic=True)
        total = out.shape[0]
        return out.reshape(total, 1, -1) if squeeze else out.reshape(total, -1)
    seq, batch = query.shape[0], query.shape[1]
    if seq % FLEX_BLOCK:
        raise input_error(
            fn,
            "query",
            f"a padded length that is a multiple of {FLEX_BLOCK} in batch-invariant mode (pad_to_multiple_of)",
            f"{seq} tokens",
        )
    q, k, v = (t.transpose(0, 1).reshape(batch * seq, *t.shape[2:]) for t in (query, key, value))
    cu = torch.arange(0, (batch + 1) * seq, seq, dtype=torch.int32, device=query.device)
    out = packed_causal_attention(q, k, v, cu, softmax_scale=scale, backend="flex", dynamic=True)
    return out.reshape(batch, seq, -1).transpose(0, 1)


# -- running: the micro-batches' shape and the schedule's context --------------------------------------


@dataclasses.dataclass(frozen=True)
class MicrobatchShape:
    """What a model asks of its micro-batches: every packed sequence starts at (and every padded length is)
    a multiple of ``multiple`` tokens, and a micro-batch has at least ``min_tokens`` tokens (None: as
    collated)."""

    multiple: int = 1
    min_tokens: int | None = None

    def __post_init__(self) -> None:
        check_positive_int("fnppo.megatron.numerics.MicrobatchShape", "multiple", self.multiple)
        check_positive_int("fnppo.megatron.numerics.MicrobatchShape", "min_tokens", self.min_tokens, allow_none=True)


def microbatch_shape(
    config: Any, *, padded: bool = False, te_spec: bool = False, owner: str = "StepConfig"
) -> MicrobatchShape:
    """The :class:`MicrobatchShape` of a model of Megatron config ``config``: FP8 GEMMs need token counts
    divisible by 16 (Transformer Engine); in the mode, the record's ``min_rows`` and, with
    ``flex_attention``, sequences aligned to the attention's key block (:data:`FLEX_BLOCK`).

    Raises:
        InputError: naming ``{owner}.layout``: ``padded`` micro-batches for a model in the mode built from
            Transformer Engine's spec (``te_spec``: its padded attention is another kernel, other bits than packed).
    """
    fn = "fnppo.megatron.numerics.microbatch_shape"
    for name, value in (("padded", padded), ("te_spec", te_spec)):
        if not isinstance(value, bool):
            raise input_error(fn, name, "a bool", repr(value))
    if not isinstance(owner, str) or not owner:
        raise input_error(fn, "owner", "a non-empty str (the config class errors name)", repr(owner))
    multiple = 16 if getattr(config, "fp8", None) else 1
    kernels = kernels_of(config)
    if kernels is None:
        return MicrobatchShape(multiple)
    if padded and te_spec:
        raise input_error(
            owner,
            "layout",
            "'packed' for a batch-invariant model of Transformer Engine's spec (its padded attention "
            "is another kernel: other bits than the packed layout)",
            "'padded'",
        )
    if kernels.flex_attention:
        multiple = math.lcm(multiple, FLEX_BLOCK)
    return MicrobatchShape(multiple, kernels.min_rows)


@contextlib.contextmanager
def running(config: Any) -> Iterator[None]:
    """The context a schedule of a model of Megatron config ``config`` runs in: torch's deterministic
    algorithms (:func:`fnppo.megatron.forward.deterministic_algorithms`) with Megatron's
    ``deterministic_mode``, and for an MoE model in the mode (Megatron's routing map and its
    un-permutation's token sum take their repeatable ``index_put`` / ``index_add`` paths only then,
    ``moe_utils``, megatron-core 0.16.1; without torch's NaN fill of new tensors, a kernel per
    allocation, unless ``deterministic_mode`` asks for it); the mode's kernels
    (:func:`batch_invariant_numerics`)."""
    kernels = kernels_of(config)
    moe = getattr(config, "num_moe_experts", None) is not None
    fill = bool(getattr(config, "deterministic_mode", False))
    with (
        deterministic_algorithms(fill or (kernels is not None and moe), fill_uninitialized_memory=fill),
        batch_invariant_numerics(kernels),
    ):
        yield


@functools.cache
def megatron_invariant_kernels() -> Any:
    """Megatron-core's batch-invariant Triton kernels module
    (``megatron.core.transformer.custom_layers.batch_invariant_kernels``: a persistent matmul,
    log-softmax, mean, and a Transformer Engine GEMM/RMSNorm patch), or None where it cannot be
    imported (no Triton) or there is no CUDA."""
    if not torch.cuda.is_available():
        return None
    try:
        return importlib.import_module("megatron.core.transformer.custom_layers.batch_invariant_kernels")
    except Exception:  # noqa: BLE001 - no Triton (or an incompatible one)
        return None


@contextlib.contextmanager
def batch_invariant_numerics(kernels: InvariantKernels | None) -> Iterator[None]:
    """Run the block with the numerics of the batch-invariant ``kernels`` (None: nothing changes).

    A record without ``tiles`` (:data:`InvariantKernels.FAST`) swaps nothing: the micro-batches' shape
    (:func:`microbatch_shape`) is what makes a token's forward values independent of its micro-batch, and
    forward and backward run the ordinary kernels. With ``tiles``: fnppo's fixed-tile torch kernels
    (:func:`fnppo.core.ops.batch_invariant.batch_invariant`: products, norms, softmaxes and row reductions
    in fixed row tiles, invariant element-wise compositions); with ``megatron_products`` too,
    Megatron-core's ``set_batch_invariant_mode(True)`` (its ``aten`` overrides and Transformer Engine GEMM
    / RMSNorm patches, forward and backward) takes the products. Everything is restored on exit, also on
    an exception.

    Raises:
        InputError: ``kernels`` neither None nor an :class:`InvariantKernels`.
    """
    if kernels is not None and not isinstance(kernels, InvariantKernels):
        raise input_error(
            "fnppo.megatron.numerics.batch_invariant_numerics", "kernels", "an InvariantKernels or None", repr(kernels)
        )
    if kernels is None or not kernels.tiles:
        yield
        return
    megatron = megatron_invariant_kernels() if kernels.megatron_products else None
    with contextlib.ExitStack() as stack:
        if megatron is not None:
            if importlib.util.find_spec("transformer_engine") is not None:
                stack.enter_context(megatron.set_batch_invariant_mode(True))
            else:  # Megatron's switch also patches Transformer Engine and fails without it
                stack.enter_context(_aten_triton_products(megatron))
        stack.enter_context(batch_invariant(True, products=megatron is None))
        yield


@contextlib.contextmanager
def _aten_triton_products(kernels: Any) -> Iterator[None]:
    """Megatron's persistent Triton matmul for ``aten::mm`` / ``aten::addmm`` on CUDA for the
    duration of the block (the part of Megatron's batch-invariant switch that needs no Transformer
    Engine); the registrations are removed on exit, also on an exception."""
    lib = torch.library.Library("aten", "IMPL")
    try:
        for op, kernel, key in triton_product_registrations(kernels):
            lib.impl(op, kernel, key)
        yield
    finally:
        lib._destroy()


def triton_product_registrations(kernels: Any) -> tuple[tuple[str, Any, str], ...]:
    """What :func:`_aten_triton_products` registers: ``(aten op, Megatron's kernel, dispatch key)``
    for ``aten::mm`` and ``aten::addmm`` (``nn.Linear`` with a bias lowers to ``addmm``) on CUDA."""
    return (
        ("aten::mm", kernels.mm_batch_invariant, "CUDA"),
        ("aten::addmm", kernels.addmm_batch_invariant, "CUDA"),
    )
