"""Model configuration: :class:`ModelConfig`, what a model is, checked when it is made, and the value its
``batch_invariant`` field takes, :class:`InvariantKernels` (every behaviour the record changes:
:mod:`fnppo.megatron.numerics`).

Its translation into Megatron's ``TransformerConfig`` for a parallel layout is
:func:`fnppo.megatron.megatron_config.transformer_config`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from fnppo.core.errors import check_bool_fields, check_float, check_number, check_positive_int, input_error

__all__ = [
    "ModelConfig",
    "MOE_EXPERTS",
    "FP8_FORMATS",
    "FP8_RECIPES",
    "InvariantKernels",
    "CUDA_MIN_ROWS",
    "resolve_kernels",
    "kernels_named",
]

MOE_EXPERTS = ("stacked", "te_grouped", "sequential")
FP8_FORMATS = (None, "e4m3", "hybrid")
FP8_RECIPES = ("tensorwise", "delayed", "blockwise")


CUDA_MIN_ROWS = 2048
"""The fewest tokens a micro-batch has with :data:`InvariantKernels.FAST` (fnppo's steps pad it). On one H200 (bf16,
the Qwen2.5-1.5B widths and vocabulary), cuBLAS gave a row other bits than in a 16,384-row product only at 333
rows or fewer (the ``fc2`` product, K = 8,960: split-K), and torch's row reductions over the vocabulary
likewise; from 1,000 rows on every product and reduction gave the same bits (``benchmarks/batch_invariance.py
--probe``)."""


@dataclass(frozen=True)
class InvariantKernels:
    """Which kernels the batch-invariant mode runs: each field one behaviour, read in :mod:`fnppo.megatron.numerics`.

    Attributes:
        name: how messages and docs name the record.
        tiles: the schedule runs inside fnppo's fixed-tile torch kernels (products, norms, softmaxes,
            reductions: :func:`fnppo.core.ops.batch_invariant.batch_invariant`).
        megatron_products: the products run in Megatron-core's persistent Triton matmul (with Transformer
            Engine's GEMM / RMSNorm patches where installed) instead of the tiles; CUDA only.
        min_rows: every micro-batch has at least this many tokens (None: as collated); the library kernels
            keep a row's bits from this many rows on.
        flex_attention: one flex-attention launch over sequences started at multiples of its key block
            (CUDA; elsewhere :func:`fnppo.core.kernels.invariant.sequence_attention`, one sequence at a time).
        stacked_experts: MoE experts as one grouped GEMM per projection (``"stacked"``; else
            ``"sequential"``, whose products the tiles take).
        router_tiles: an MoE router's logits in fixed row tiles
            (:func:`fnppo.core.kernels.invariant.invariant_router_logits`).
        fusions: Megatron's fused element-wise kernels stay on by default (off where the tiles' torch
            function mode must see the plain ops).
        context_parallel: context parallelism keeps the bits of one process; False: refused by name.
    """

    name: str
    tiles: bool
    megatron_products: bool = False
    min_rows: int | None = None
    flex_attention: bool = False
    stacked_experts: bool = False
    router_tiles: bool = False
    fusions: bool = False
    context_parallel: bool = True

    FAST: ClassVar[InvariantKernels]
    TORCH: ClassVar[InvariantKernels]
    MEGATRON: ClassVar[InvariantKernels]

    def __post_init__(self) -> None:
        fn = "fnppo.models.InvariantKernels"
        if not isinstance(self.name, str) or not self.name:
            raise input_error(fn, "name", "a non-empty str", repr(self.name))
        check_bool_fields(fn, self)
        check_positive_int(fn, "min_rows", self.min_rows, allow_none=True)
        if self.tiles and self.stacked_experts:  # the grouped GEMM is neither the tiles' nor Megatron's product
            raise input_error(fn, "stacked_experts", "False with tiles=True (experts 'sequential')", "True")
        if self.megatron_products and not self.tiles:
            raise input_error(fn, "megatron_products", "False with tiles=False (the tiles take the rest)", "True")


InvariantKernels.FAST = InvariantKernels(
    name="fast",
    tiles=False,
    min_rows=CUDA_MIN_ROWS,
    flex_attention=True,
    stacked_experts=True,
    router_tiles=True,
    fusions=True,
    context_parallel=False,
)
"""CUDA: the library's own kernels, forward and backward at full speed, on micro-batches the steps shape."""
InvariantKernels.TORCH = InvariantKernels(name="torch", tiles=True)
"""fnppo's fixed-tile torch kernels (any device; the CPU's only choice); context parallelism included."""
InvariantKernels.MEGATRON = InvariantKernels(name="megatron", tiles=True, megatron_products=True)
"""Megatron-core's Triton matmul (and Transformer Engine patches) for the products, the tiles for the rest (CUDA)."""


def resolve_kernels(batch_invariant: Any, *, cuda: bool) -> InvariantKernels | None:
    """The record a ``ModelConfig.batch_invariant`` value stands for on a model built for CUDA or not:
    None for False, the platform's default for True (:data:`InvariantKernels.FAST` on CUDA,
    :data:`InvariantKernels.TORCH` elsewhere), the record itself otherwise.

    Raises:
        InputError: anything but a bool or an :class:`InvariantKernels`.
    """
    if isinstance(batch_invariant, InvariantKernels):
        return batch_invariant
    if not isinstance(batch_invariant, bool):
        raise input_error(
            "ModelConfig", "batch_invariant", "a bool or an fnppo.models.InvariantKernels", repr(batch_invariant)
        )
    if not batch_invariant:
        return None
    return InvariantKernels.FAST if cuda else InvariantKernels.TORCH


def kernels_named(name: str) -> InvariantKernels:
    """The built-in record called ``name`` (``"fast"``, ``"torch"`` or ``"megatron"``): for scripts that take
    the choice from a command line or an environment variable.

    Raises:
        InputError: another name.
    """
    records = (InvariantKernels.FAST, InvariantKernels.TORCH, InvariantKernels.MEGATRON)
    for record in records:
        if record.name == name:
            return record
    raise input_error("kernels_named", "name", f"one of {[r.name for r in records]}", repr(name))


@dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a decoder-only GPT (Llama/Qwen2 family by default).

    ``dtype`` is the parameter/compute dtype: ``"fp32"``, ``"bf16"`` or ``"fp16"`` (half precision
    models are wrapped in Megatron's ``Float16Module``; logits stay in that dtype).

    Mixture of Experts (``num_experts`` set; Megatron's ``MoELayer`` with a top-k router and no
    token dropping):

    * ``moe_layer_freq``: which layers are MoE layers, as Megatron's ``moe_layer_freq``: an int
      ``k`` (layers ``0, k, 2k, ...``; default 1: every layer) or one 0/1 per layer (1: MoE); the
      other layers are dense MLPs of ``ffn_hidden_size``;
    * ``moe_topk`` experts per token, each an MLP of ``moe_ffn_hidden_size`` (default
      ``ffn_hidden_size``); ``moe_shared_expert_size``: the hidden size of an always-on shared
      expert (Qwen2-MoE style), None for none; ``moe_shared_expert_gate``: the shared expert's
      output is scaled by ``sigmoid(x . w)`` (Qwen2-MoE's ``shared_expert_gate``);
    * ``moe_pre_softmax``: the gate weights are the softmax over *all* experts at the chosen ones
      (not renormalized: Qwen2/3-MoE with ``norm_topk_prob=False``); False (default): the softmax
      over the chosen experts' logits (Mixtral; Qwen-MoE with ``norm_topk_prob=True``);
    * ``moe_load_balancing``: ``"none"``, ``"aux_loss"`` (switch load-balancing loss over a
      micro-batch) or ``"seq_aux_loss"`` (per sequence: a row of the micro-batch, so with the packed
      layout, one row per micro-batch, it equals ``"aux_loss"``; per sample with
      ``StepConfig(layout="padded")``), weighted by ``moe_aux_loss_coeff``;
      ``moe_z_loss_coeff``: router z-loss (ST-MoE), None for none;
    * ``moe_score_function``: ``"softmax"`` or ``"sigmoid"``; ``moe_router_dtype``: ``"fp32"``,
      ``"fp64"`` or None (the model's dtype) for the routing computation;
    * ``moe_expert_bias``: aux-loss-free balancing (a per-expert bias added to the scores for
      the choice of experts, updated after every step by ``moe_bias_update_rate`` times the sign of
      the load error; a rate of 0 keeps it fixed); only with ``moe_score_function="sigmoid"``;
    * ``moe_freeze_router``: the router weights get no gradient and are not updated;
    * ``moe_dispatcher``: ``"alltoall"`` or ``"allgather"`` token dispatch over expert parallelism;
    * ``moe_experts``: how the local experts compute: ``"stacked"`` (fnppo's
      :class:`~fnppo.megatron.stacked_experts.StackedExperts`: each projection's weights stacked
      into one parameter and one grouped GEMM, ``torch._grouped_mm``; any device, no Transformer
      Engine needed), ``"te_grouped"`` (Megatron's ``TEGroupedMLP``: one Transformer Engine GEMM
      and one parameter per expert; needed for FP8 experts), ``"sequential"`` (Megatron's
      ``SequentialMLP``: one MLP per expert); None: ``"stacked"`` on a CUDA model without FP8,
      ``"te_grouped"`` with FP8, ``"sequential"`` on CPU. With ``batch_invariant`` the record's
      ``stacked_experts`` decides: ``"stacked"`` only (the fast CUDA kernels: a row's bits in the grouped
      GEMM do not depend on the group sizes; per-expert library GEMMs do) or ``"sequential"`` only (the
      tiles take its products).

    ``fp8``: FP8 training through Transformer Engine (Hopper or newer GPU, ``dtype="bf16"``):
    ``"e4m3"`` (every FP8 tensor E4M3) or ``"hybrid"`` (E4M3 forward, E5M2 gradients), with
    ``fp8_recipe`` ``"tensorwise"`` (current per-tensor scaling), ``"delayed"`` (scales from an
    amax history) or ``"blockwise"`` (1x128 / 128x128 blocks). The transformer layers' linear
    layers run their GEMMs in FP8; the embedding, the output layer and the log-prob computation
    stay in bf16/fp32. Refused on CPU and without Transformer Engine.

    ``fusions``: Megatron's fused element-wise kernels (see :func:`transformer_config`): None turns
    them on where the model is built for CUDA (NCCL) and off on CPU (and with ``batch_invariant``
    unless its record keeps them, ``fusions``);
    True or False forces them.

    ``deterministic``: repeatable results on a GPU (measured: repeated MoE forwards agree bit for
    bit; the backward uses torch's deterministic kernels where torch has them). Megatron's
    ``deterministic_mode`` (the embedding lookup by indexing instead of ``F.embedding``, whose
    backward adds atomically; Transformer Engine's attention then needs
    ``NVTE_ALLOW_NONDETERMINISTIC_ALGO=0``, which :func:`fnppo.megatron.build.build_gpt` sets where it is unset), and
    every schedule run of fnppo's steps on the model under
    ``torch.use_deterministic_algorithms(True, warn_only=True)`` (restored afterwards), under which
    Megatron's MoE layers route with ``index_put`` and un-permute expert outputs with ``index_add``
    instead of the atomic ``scatter_add``. Without it an MoE model in bf16 on a GPU gives a
    slightly different forward each call, which moves tokens whose top-k choice is a near tie to
    another expert (BENCHMARKS.md, "MoE log-probs from one forward to the next"). On CPU every
    kernel is deterministic already. For repeatable cuBLAS products set
    ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` in the environment before CUDA starts (torch warns
    otherwise).

    ``batch_invariant``: exactly on-policy numerics (``docs/batch-invariance.md``): ``True`` (the
    platform's kernels: :data:`~fnppo.megatron.config.InvariantKernels.FAST` on a model built for
    CUDA, :data:`~fnppo.megatron.config.InvariantKernels.TORCH` elsewhere) or an
    :class:`~fnppo.megatron.config.InvariantKernels` record, chosen once when Megatron's config is
    built and stored on it; :mod:`fnppo.megatron.numerics` holds everything it changes. A sample's
    per-token log-probs and entropies then have the same bits whatever its micro-batch companions,
    position in the pack, token budget, number of micro-batches or layout (packed or padded), in
    ``compute_logprobs`` and inside ``train_step`` (with or without recomputation). The record says how:
    fnppo's fixed-tile kernels around the schedule (:func:`fnppo.megatron.numerics.batch_invariant_numerics`)
    and the attention one sequence at a time (:func:`fnppo.core.kernels.invariant.sequence_attention`), or
    the library's own kernels on micro-batches the steps shape; an MoE model's schedules run under torch's
    deterministic algorithms whatever ``deterministic`` says (the routing's ``index_put`` and the
    un-permutation's ``index_add``), without Megatron's ``deterministic_mode`` unless asked. Megatron's
    ``TransformerConfig.batch_invariant_mode`` is set on the built config (Transformer Engine's attention
    then runs with ``num_splits=1``). Context parallelism gives the bits of ``cp = 1`` with records that
    allow it (``context_parallel``: the torch kernels with the local spec); it is refused with the others.
    Not covered: another tensor-parallel size (``tp`` above 2 is refused, as a sum of more than two
    partial results is not commutative bit for bit), dropout (refused: the training forward would differ
    from the log-prob forward anyway), another device, dtype, thread count or library version, and the
    backward pass (gradients are not claimed invariant).

    Raises:
        InputError: a switch (a field annotated ``bool``, or ``bool | None`` such as ``fusions``) holding anything but a bool (or None there): ``"yes"``, ``0`` or ``1``
            are refused, never read as truthy later; sizes that are not ints >= 1 or do not divide;
            unknown ``dtype``, ``normalization`` or MoE choices; out-of-range MoE coefficients;
            ``moe_expert_bias`` without ``moe_score_function="sigmoid"``; ``batch_invariant`` that is
            neither a bool nor an ``InvariantKernels``, or with dropout or FP8 (:func:`transformer_config`:
            with ``tp`` above 2, or context parallelism on kernels without ``context_parallel``).
    """

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    ffn_hidden_size: int
    vocab_size: int
    max_seq_len: int
    num_query_groups: int | None = None
    kv_channels: int | None = None
    normalization: str = "RMSNorm"
    layernorm_epsilon: float = 1e-6
    swiglu: bool = True
    add_bias_linear: bool = False
    add_qkv_bias: bool = False
    qk_layernorm: bool = False
    position_embedding_type: str = "rope"
    rotary_base: float = 10000.0
    rotary_percent: float = 1.0
    rope_scaling: bool = False
    rope_scaling_factor: float = 8.0
    tie_embeddings: bool = True
    init_method_std: float = 0.02
    dtype: str = "fp32"
    attention_dropout: float = 0.0
    hidden_dropout: float = 0.0
    make_vocab_size_divisible_by: int = 1
    num_experts: int | None = None
    moe_topk: int = 2
    moe_ffn_hidden_size: int | None = None
    moe_shared_expert_size: int | None = None
    moe_shared_expert_gate: bool = False
    moe_layer_freq: int | tuple[int, ...] = 1
    moe_pre_softmax: bool = False
    moe_load_balancing: str = "none"
    moe_aux_loss_coeff: float = 0.0
    moe_z_loss_coeff: float | None = None
    moe_score_function: str = "softmax"
    moe_router_dtype: str | None = "fp32"
    moe_expert_bias: bool = False
    moe_bias_update_rate: float = 1e-3
    moe_freeze_router: bool = False
    moe_dispatcher: str = "alltoall"
    moe_experts: str | None = None
    fp8: str | None = None
    fp8_recipe: str = "tensorwise"
    fusions: bool | None = None
    deterministic: bool = False
    batch_invariant: bool | InvariantKernels = False
    extra: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        fn = "ModelConfig"
        check_bool_fields(fn, self)
        for name in (
            "num_layers",
            "hidden_size",
            "num_attention_heads",
            "ffn_hidden_size",
            "vocab_size",
            "max_seq_len",
        ):
            check_positive_int(fn, name, getattr(self, name))
        check_positive_int(fn, "num_query_groups", self.num_query_groups, allow_none=True)
        check_positive_int(fn, "kv_channels", self.kv_channels, allow_none=True)
        for name in ("attention_dropout", "hidden_dropout"):
            check_float(fn, name, getattr(self, name), low=0.0, high=1.0, high_open=True)
        for name in ("layernorm_epsilon", "rotary_base", "rope_scaling_factor", "init_method_std"):
            check_float(fn, name, getattr(self, name), low=0.0, low_open=True)
        check_float(fn, "rotary_percent", self.rotary_percent, low=0.0, high=1.0, low_open=True)
        check_positive_int(fn, "make_vocab_size_divisible_by", self.make_vocab_size_divisible_by)
        for name in ("moe_ffn_hidden_size", "moe_shared_expert_size"):
            check_positive_int(fn, name, getattr(self, name), allow_none=True)
        if self.hidden_size % self.num_attention_heads and self.kv_channels is None:
            raise input_error(
                fn,
                "hidden_size",
                f"a multiple of num_attention_heads={self.num_attention_heads}",
                repr(self.hidden_size),
            )
        groups = self.num_query_groups or self.num_attention_heads
        if self.num_attention_heads % groups:
            raise input_error(
                fn, "num_query_groups", f"a divisor of num_attention_heads={self.num_attention_heads}", repr(groups)
            )
        if self.dtype not in ("fp32", "bf16", "fp16"):
            raise input_error(fn, "dtype", "one of 'fp32', 'bf16', 'fp16'", repr(self.dtype))
        if self.normalization not in ("RMSNorm", "LayerNorm"):
            raise input_error(fn, "normalization", "'RMSNorm' or 'LayerNorm'", repr(self.normalization))
        if self.fp8 not in FP8_FORMATS:
            raise input_error(fn, "fp8", f"one of {FP8_FORMATS}", repr(self.fp8))
        if self.fp8_recipe not in FP8_RECIPES:
            raise input_error(fn, "fp8_recipe", f"one of {FP8_RECIPES}", repr(self.fp8_recipe))
        if self.fp8 is not None and self.dtype != "bf16":
            raise input_error(fn, "dtype", "'bf16' with fp8 set (FP8 GEMMs keep bf16 parameters)", repr(self.dtype))
        if self.num_experts is not None:
            self._check_moe(fn)
        resolve_kernels(self.batch_invariant, cuda=False)  # a bool or a record, else refused by name
        if self.batch_invariant and self.fp8 is not None:
            raise input_error(
                fn, "fp8", "None with batch_invariant=True (FP8 scales depend on the batch)", repr(self.fp8)
            )
        if self.batch_invariant:
            for name in ("attention_dropout", "hidden_dropout"):
                if getattr(self, name) != 0.0:
                    raise input_error(fn, name, "0.0 with batch_invariant=True", repr(getattr(self, name)))

    def _check_moe(self, fn: str) -> None:
        check_positive_int(fn, "num_experts", self.num_experts, allow_none=True)
        check_number(fn, "moe_topk", self.moe_topk, integer=True, low=1, high=self.num_experts, also=" (num_experts)")
        choices = {
            "moe_load_balancing": ("none", "aux_loss", "seq_aux_loss"),
            "moe_score_function": ("softmax", "sigmoid"),
            "moe_router_dtype": (None, "fp32", "fp64"),
            "moe_dispatcher": ("alltoall", "allgather"),
            "moe_experts": (None, *MOE_EXPERTS),
        }
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise input_error(fn, name, f"one of {allowed}", repr(getattr(self, name)))
        for name in ("moe_aux_loss_coeff", "moe_bias_update_rate"):
            check_float(fn, name, getattr(self, name), low=0.0)
        check_float(fn, "moe_z_loss_coeff", self.moe_z_loss_coeff, low=0.0, allow_none=True)
        if self.moe_load_balancing == "none" and self.moe_aux_loss_coeff > 0:
            raise input_error(
                fn, "moe_aux_loss_coeff", "0 with moe_load_balancing='none'", repr(self.moe_aux_loss_coeff)
            )
        freq = self.moe_layer_freq
        if isinstance(freq, list):
            object.__setattr__(self, "moe_layer_freq", tuple(freq))
            freq = self.moe_layer_freq
        if isinstance(freq, tuple):
            if (
                len(freq) != self.num_layers
                or any(v not in (0, 1) or isinstance(v, bool) for v in freq)
                or not any(freq)
            ):
                raise input_error(
                    fn,
                    "moe_layer_freq",
                    f"an int >= 1 or {self.num_layers} entries of 0/1 (one per layer, at least one 1)",
                    repr(freq),
                )
        elif not isinstance(freq, int) or isinstance(freq, bool) or freq < 1:
            raise input_error(
                fn,
                "moe_layer_freq",
                f"an int >= 1 or {self.num_layers} entries of 0/1 (one per layer, at least one 1)",
                repr(freq),
            )
        if self.moe_shared_expert_gate and self.moe_shared_expert_size is None:
            raise input_error(
                fn, "moe_shared_expert_gate", "False without a shared expert (moe_shared_expert_size=None)", "True"
            )
        if self.moe_expert_bias and self.moe_score_function != "sigmoid":  # Megatron refuses it at build time
            raise input_error(
                fn,
                "moe_expert_bias",
                "False unless moe_score_function='sigmoid' (aux-loss-free balancing)",
                f"True with moe_score_function={self.moe_score_function!r}",
            )

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """Global 0-based indices of the MoE layers (none for a dense model)."""
        if self.num_experts is None:
            return ()
        freq = self.moe_layer_freq
        pattern = freq if isinstance(freq, tuple) else tuple(int(i % freq == 0) for i in range(self.num_layers))
        return tuple(i for i, v in enumerate(pattern) if v)

    @property
    def torch_dtype(self) -> torch.dtype:
        return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[self.dtype]

    @property
    def padded_vocab_size(self) -> int:
        m = self.make_vocab_size_divisible_by
        return -(-self.vocab_size // m) * m
