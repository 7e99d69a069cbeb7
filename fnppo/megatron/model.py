"""Megatron GPT models: configuration, builders, full-weight loading, ``forward_logits`` and ``forward_values``.

This is one of the three modules that touch Megatron (with ``grads`` and ``step``). Everything here
is a function of its arguments: the model chunks are passed in and returned; Megatron's parallel
state is read through :func:`fnppo.megatron.parallel.current_layout`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from fnppo.core.batch import Microbatch
from fnppo.megatron.parallel import ParallelLayout, current_layout
from fnppo.core.typing import Float, InputError, Tensor, check_bool_fields, input_error, typechecked

__all__ = [
    "ModelConfig",
    "transformer_config",
    "fusion_fields",
    "deterministic_algorithms",
    "choose_layer_spec",
    "install_fused_rope",
    "build_gpt",
    "wrap_ddp",
    "build_optimizer",
    "unwrap_model",
    "forward_logits",
    "forward_values",
    "forward_hidden",
    "packed_seq_params",
    "load_full_weights",
    "gather_full_weights",
    "snapshot_params",
    "layout_invariant_init",
]


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
    * ``moe_grouped_gemm``: one grouped GEMM for the local experts (Transformer Engine); None
      chooses it when Transformer Engine is installed, else Megatron's ``SequentialMLP``.

    ``fusions``: Megatron's fused element-wise kernels (see :func:`transformer_config`): None turns
    them on where the model is built for CUDA (NCCL) and off on CPU; True or False forces them.

    ``deterministic``: repeatable results on a GPU (measured: repeated MoE forwards agree bit for
    bit; the backward uses torch's deterministic kernels where torch has them). Megatron's
    ``deterministic_mode`` (the embedding lookup by indexing instead of ``F.embedding``, whose
    backward adds atomically; Transformer Engine's attention then needs
    ``NVTE_ALLOW_NONDETERMINISTIC_ALGO=0``, which :func:`build_gpt` sets where it is unset), and
    every schedule run of fnppo's steps on the model under
    ``torch.use_deterministic_algorithms(True, warn_only=True)`` (restored afterwards), under which
    Megatron's MoE layers route with ``index_put`` and un-permute expert outputs with ``index_add``
    instead of the atomic ``scatter_add``. Without it an MoE model in bf16 on a GPU gives a
    slightly different forward each call, which moves tokens whose top-k choice is a near tie to
    another expert (BENCHMARKS.md, "MoE log-probs from one forward to the next"). On CPU every
    kernel is deterministic already. For repeatable cuBLAS products set
    ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` in the environment before CUDA starts (torch warns
    otherwise).

    Raises:
        InputError: a switch (a field annotated ``bool``, or ``bool | None`` such as ``fusions`` and
            ``moe_grouped_gemm``) holding anything but a bool (or None there): ``"yes"``, ``0`` or ``1``
            are refused, never read as truthy later; sizes that are not ints >= 1 or do not divide;
            unknown ``dtype``, ``normalization`` or MoE choices; out-of-range MoE coefficients;
            ``moe_expert_bias`` without ``moe_score_function="sigmoid"``.
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
    moe_grouped_gemm: bool | None = None
    fusions: bool | None = None
    deterministic: bool = False
    extra: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        fn = "ModelConfig"
        check_bool_fields(fn, self)
        for name in ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "vocab_size", "max_seq_len"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise input_error(fn, name, "an int >= 1", repr(v))
        if self.hidden_size % self.num_attention_heads and self.kv_channels is None:
            raise input_error(fn, "hidden_size", f"a multiple of num_attention_heads={self.num_attention_heads}", repr(self.hidden_size))
        groups = self.num_query_groups or self.num_attention_heads
        if self.num_attention_heads % groups:
            raise input_error(fn, "num_query_groups", f"a divisor of num_attention_heads={self.num_attention_heads}", repr(groups))
        if self.dtype not in ("fp32", "bf16", "fp16"):
            raise input_error(fn, "dtype", "one of 'fp32', 'bf16', 'fp16'", repr(self.dtype))
        if self.normalization not in ("RMSNorm", "LayerNorm"):
            raise input_error(fn, "normalization", "'RMSNorm' or 'LayerNorm'", repr(self.normalization))
        if self.num_experts is not None:
            self._check_moe(fn)

    def _check_moe(self, fn: str) -> None:
        if not isinstance(self.num_experts, int) or self.num_experts < 1:
            raise input_error(fn, "num_experts", "None or an int >= 1", repr(self.num_experts))
        if not isinstance(self.moe_topk, int) or not 1 <= self.moe_topk <= self.num_experts:
            raise input_error(fn, "moe_topk", f"an int in [1, num_experts={self.num_experts}]", repr(self.moe_topk))
        choices = {
            "moe_load_balancing": ("none", "aux_loss", "seq_aux_loss"),
            "moe_score_function": ("softmax", "sigmoid"),
            "moe_router_dtype": (None, "fp32", "fp64"),
            "moe_dispatcher": ("alltoall", "allgather"),
        }
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise input_error(fn, name, f"one of {allowed}", repr(getattr(self, name)))
        for name in ("moe_aux_loss_coeff", "moe_bias_update_rate"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise input_error(fn, name, "a finite float >= 0", repr(v))
        if self.moe_z_loss_coeff is not None and not (math.isfinite(self.moe_z_loss_coeff) and self.moe_z_loss_coeff >= 0):
            raise input_error(fn, "moe_z_loss_coeff", "None or a finite float >= 0", repr(self.moe_z_loss_coeff))
        if self.moe_load_balancing == "none" and self.moe_aux_loss_coeff > 0:
            raise input_error(fn, "moe_aux_loss_coeff", "0 with moe_load_balancing='none'", repr(self.moe_aux_loss_coeff))
        freq = self.moe_layer_freq
        if isinstance(freq, list):
            object.__setattr__(self, "moe_layer_freq", tuple(freq))
            freq = self.moe_layer_freq
        if isinstance(freq, tuple):
            if len(freq) != self.num_layers or any(v not in (0, 1) or isinstance(v, bool) for v in freq) or not any(freq):
                raise input_error(fn, "moe_layer_freq", f"an int >= 1 or {self.num_layers} entries of 0/1 (one per layer, at least one 1)", repr(freq))
        elif not isinstance(freq, int) or isinstance(freq, bool) or freq < 1:
            raise input_error(fn, "moe_layer_freq", f"an int >= 1 or {self.num_layers} entries of 0/1 (one per layer, at least one 1)", repr(freq))
        if self.moe_shared_expert_gate and self.moe_shared_expert_size is None:
            raise input_error(fn, "moe_shared_expert_gate", "False without a shared expert (moe_shared_expert_size=None)", "True")
        if self.moe_expert_bias and self.moe_score_function != "sigmoid":  # Megatron refuses it at build time
            raise input_error(fn, "moe_expert_bias",
                              "False unless moe_score_function='sigmoid' (aux-loss-free balancing)",
                              f"True with moe_score_function={self.moe_score_function!r}")

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


def choose_layer_spec(cfg: ModelConfig, layout: ParallelLayout, **options: Any):
    """The layer spec :func:`build_gpt` builds when it is given none.

    :func:`fnppo.megatron.attention.default_layer_spec` (Transformer Engine's spec where TE is installed,
    else the local spec), except under context parallelism (``layout.cp > 1``): there the local
    spec, whose packed attention computes exact document-causal attention across the CP group
    (:func:`fnppo.core.context_parallel.context_parallel_attention`, tested against one process).
    Megatron's own CP inside Transformer Engine's attention stays selectable with
    ``layer_spec=fnppo.default_layer_spec(cfg)``; its agreement with fnppo's CP has not been
    measured (it needs two GPUs).
    """
    from fnppo.megatron.attention import default_layer_spec, local_layer_spec

    if layout.cp > 1:
        return local_layer_spec(cfg, **options)
    return default_layer_spec(cfg, **options)


@contextlib.contextmanager
def deterministic_algorithms(enabled: bool) -> Iterator[None]:
    """Run the block under ``torch.use_deterministic_algorithms(True, warn_only=True)`` when
    ``enabled`` (a model built with ``ModelConfig(deterministic=True)``), and restore torch's
    previous setting afterwards, also on an exception; with ``enabled`` False, change nothing.

    Megatron-core consults ``torch.are_deterministic_algorithms_enabled()`` at call time: its MoE
    router then builds the routing map with ``index_put`` and its un-permutation adds the experts'
    outputs with ``index_add`` instead of ``scatter_add`` (atomic on CUDA, so the sum's order and
    bf16 rounding change from call to call). ``warn_only``: an operation without a deterministic
    implementation warns instead of failing the step. Reference: PyTorch "Reproducibility" notes
    (``torch.use_deterministic_algorithms``).
    """
    if not enabled:
        yield
        return
    before = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])


def fusion_fields(cfg: ModelConfig, layout: ParallelLayout) -> dict[str, bool]:
    """The ``TransformerConfig`` fusion switches for ``cfg`` on ``layout``.

    With ``cfg.fusions`` (None: whether the model is built for CUDA, i.e. CUDA is present and the
    backend is NCCL): ``bias_activation_fusion`` (SwiGLU, or GeLU with a bias, as one compiled
    kernel that saves only its input for backward), ``bias_dropout_fusion`` (bias + dropout +
    residual add in one kernel) and ``apply_rope_fusion`` (RoPE in one kernel: Transformer
    Engine's when installed, else :func:`fnppo.apply_rotary`, installed by
    :func:`install_fused_rope`). Megatron compiles the first two with ``torch.compile``.
    Always off: ``masked_softmax_fusion`` and ``persist_layer_norm`` (Apex or Megatron's own CUDA
    extensions; fnppo's packed attention has no masked softmax) and ``gradient_accumulation_fusion``
    (the output layer, a ``ColumnParallelLinear``, needs Apex's ``fused_weight_gradient_mlp_cuda``
    for it).
    """
    on = cfg.fusions if cfg.fusions is not None else (torch.cuda.is_available() and layout.backend == "nccl")
    return dict(
        bias_activation_fusion=bool(on and (cfg.swiglu or cfg.add_bias_linear)),
        bias_dropout_fusion=bool(on),
        apply_rope_fusion=bool(on and cfg.position_embedding_type == "rope"),
    )


def install_fused_rope() -> None:
    """Give Megatron a fused RoPE when Transformer Engine does not (once per process).

    Megatron's ``apply_rope_fusion`` calls ``rope_utils.fused_apply_rotary_pos_emb`` (``[s, b, h, d]``)
    and ``fused_apply_rotary_pos_emb_thd`` (packed ``[t, h, d]``), which only Transformer Engine
    provides; where they are missing they are set to adapters of :func:`fnppo.apply_rotary` (the
    same rotation, one kernel, no host sync). Cases outside it (interleaved RoPE, per-sample angle
    tables, context parallelism in THD) use Megatron's unfused functions. Transformer Engine's own
    functions are left in place.
    """
    from megatron.core.models.common.embeddings import rope_utils

    if rope_utils.fused_apply_rotary_pos_emb is None:
        rope_utils.fused_apply_rotary_pos_emb = _fused_rope_bshd
    if rope_utils.fused_apply_rotary_pos_emb_thd is None:
        rope_utils.fused_apply_rotary_pos_emb_thd = _fused_rope_thd


def _fused_rope_bshd(t: Tensor, freqs: Tensor, transpose_output_memory: bool = False, interleaved: bool = False) -> Tensor:
    """Megatron's fused-RoPE signature for ``t`` ``[s, b, h, d]``, ``freqs`` ``[s, 1, 1, rot]``."""
    from megatron.core.models.common.embeddings import rope_utils

    from fnppo.core.rope import apply_rotary

    s, b, h, d = t.shape
    if interleaved or freqs.dim() != 4 or freqs.shape[1] != 1 or freqs.shape[0] < s:
        return rope_utils._apply_rotary_pos_emb_bshd(t, freqs, rotary_interleaved=interleaved)
    pos = torch.arange(s, device=t.device).repeat_interleave(b)
    return apply_rotary(t.reshape(s * b, h, d), freqs[:, 0, 0, :], pos).view(s, b, h, d)


_THD_POSITIONS: Any = None  # WeakIdKeyDictionary: cu_seqlens tensor -> {(total, absolute, version): positions}


def _fused_rope_thd(t: Tensor, cu_seqlens: Tensor, freqs: Tensor, cp_size: int = 1, cp_rank: int = 0) -> Tensor:
    """Megatron's fused-RoPE signature for packed ``t`` ``[t, h, d]``, ``freqs`` ``[max_s, 1, 1, rot]``.

    Positions restart in every sequence, except when the table has exactly one row per packed token
    (Megatron's absolute-offset mode, which then uses token ``i``'s own row). They are computed once
    per ``cu_seqlens`` tensor (all layers of a micro-batch share it).
    """
    global _THD_POSITIONS
    from megatron.core.models.common.embeddings import rope_utils
    from torch.utils.weak import WeakIdKeyDictionary

    from fnppo.core.rope import apply_rotary, thd_positions

    total = t.shape[0]
    if cp_size > 1 or freqs.dim() != 4 or freqs.shape[1] != 1:
        from megatron.core import parallel_state

        return rope_utils._apply_rotary_pos_emb_thd(t, cu_seqlens, freqs, cp_group=parallel_state.get_context_parallel_group())
    if _THD_POSITIONS is None:
        _THD_POSITIONS = WeakIdKeyDictionary()
    absolute = freqs.shape[0] == total
    key = (total, absolute, cu_seqlens._version)
    cached = _THD_POSITIONS.get(cu_seqlens)
    if cached is None or key not in cached:
        pos = torch.arange(total, device=t.device) if absolute else thd_positions(cu_seqlens, total)
        cached = {key: pos}
        _THD_POSITIONS[cu_seqlens] = cached
    return apply_rotary(t, freqs[:, 0, 0, :], cached[key])


def transformer_config(cfg: ModelConfig, layout: ParallelLayout | None = None, **overrides: Any):
    """Megatron ``TransformerConfig`` for ``cfg`` under ``layout``.

    ``variable_seq_lengths`` is on, so pipeline stages exchange the shape of every micro-batch
    (packed micro-batches differ in length); fnppo's steps run the interleaved schedule (``vpp``)
    without it, on micro-batches of one shape (``fnppo.steps.step._run_schedule`` says why). Fusions: :func:`fusion_fields` (on where the model is
    built for CUDA unless ``cfg.fusions`` is False; off on CPU).
    """
    from megatron.core.transformer import TransformerConfig

    layout = layout or current_layout()
    groups = cfg.num_query_groups or cfg.num_attention_heads
    for name, n in (("num_attention_heads", cfg.num_attention_heads), ("num_query_groups", groups)):
        if n % layout.tp:
            raise input_error("transformer_config", name, f"a multiple of tp={layout.tp}", repr(n))
    if cfg.padded_vocab_size % layout.tp:
        raise input_error("transformer_config", "vocab_size", f"a multiple of tp={layout.tp} (set make_vocab_size_divisible_by)", repr(cfg.vocab_size))
    if layout.tp > 1 and cfg.padded_vocab_size // layout.tp >= cfg.vocab_size:
        raise input_error(
            "transformer_config", "make_vocab_size_divisible_by",
            f"a padding that leaves real tokens on more than one of tp={layout.tp} ranks (padded vocabulary "
            f"{cfg.padded_vocab_size} / tp >= vocab_size {cfg.vocab_size}; lower it)",
            repr(cfg.make_vocab_size_divisible_by),
        )
    if cfg.num_layers % (layout.pp * (layout.vpp or 1)):
        raise input_error("transformer_config", "num_layers", f"a multiple of pp*vpp={layout.pp}*{layout.vpp or 1}", repr(cfg.num_layers))
    dtype = cfg.torch_dtype
    kwargs: dict[str, Any] = dict(
        num_layers=cfg.num_layers,
        hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_attention_heads,
        num_query_groups=groups,
        ffn_hidden_size=cfg.ffn_hidden_size,
        kv_channels=cfg.kv_channels,
        normalization=cfg.normalization,
        layernorm_epsilon=cfg.layernorm_epsilon,
        gated_linear_unit=cfg.swiglu,
        activation_func=torch.nn.functional.silu if cfg.swiglu else torch.nn.functional.gelu,
        add_bias_linear=cfg.add_bias_linear,
        add_qkv_bias=cfg.add_qkv_bias,
        qk_layernorm=cfg.qk_layernorm,
        init_method_std=cfg.init_method_std,
        attention_dropout=cfg.attention_dropout,
        hidden_dropout=cfg.hidden_dropout,
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vpp,
        context_parallel_size=layout.cp,
        pipeline_dtype=dtype,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        use_cpu_initialization=not torch.cuda.is_available() or layout.backend == "gloo",
        variable_seq_lengths=True,  # off while fnppo runs the interleaved schedule (see step._run_schedule)
        moe_token_dispatcher_type="alltoall",
        cuda_graph_scope=[],  # the default ("full") is deprecated and warns on every build
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        **fusion_fields(cfg, layout),
        deterministic_mode=cfg.deterministic,
        deallocate_pipeline_outputs=layout.backend != "gloo",
        # gloo mismatches concurrent batched p2p messages between the same pair of ranks
        # (seen with the interleaved schedule: later micro-batches got wrong activations).
        batch_p2p_comm=layout.backend != "gloo",
    )
    kwargs.update(expert_model_parallel_size=layout.ep, expert_tensor_parallel_size=layout.etp)
    if cfg.num_experts is not None:
        kwargs.update(_moe_kwargs(cfg, layout))
    kwargs.update(dict(cfg.extra))
    kwargs.update(overrides)
    _check_recompute_modules(kwargs)
    if kwargs.get("apply_rope_fusion"):
        install_fused_rope()  # Megatron checks for a fused RoPE when the config is built
    return TransformerConfig(**kwargs)


# Megatron-core 0.16's output-discarding checkpoint (``CheckpointWithoutOutput``) takes its FP8 path
# whatever the precision (``self.fp8 = fp8 is not None`` with ``fp8=False``) and needs Transformer
# Engine there: these selective-recomputation modules fail at the first forward without it.
_TE_ONLY_RECOMPUTE = ("layernorm", "moe_act", "mla_up_proj")


def _check_recompute_modules(kwargs: dict[str, Any]) -> None:
    """Refuse, at build time, selective recomputation that Megatron cannot run without Transformer Engine."""
    if kwargs.get("recompute_granularity") != "selective":
        return
    from fnppo.megatron.attention import te_available

    bad = [m for m in kwargs.get("recompute_modules") or () if m in _TE_ONLY_RECOMPUTE]
    if bad and not te_available():
        raise input_error(
            "transformer_config", "recompute_modules",
            "modules that run without Transformer Engine (e.g. 'mlp', 'core_attn', 'moe', 'shared_experts'; "
            f"Megatron's {', '.join(repr(m) for m in _TE_ONLY_RECOMPUTE)} need it)", repr(list(kwargs["recompute_modules"])),
        )


def _moe_kwargs(cfg: ModelConfig, layout: ParallelLayout) -> dict[str, Any]:
    """Megatron ``TransformerConfig`` fields of ``cfg``'s MoE settings (no token dropping)."""
    if cfg.num_experts % layout.ep:
        raise input_error("transformer_config", "num_experts", f"a multiple of ep={layout.ep}", repr(cfg.num_experts))
    extra: dict[str, Any] = {}
    if cfg.moe_dispatcher == "allgather":
        # Megatron's allgather dispatcher refuses variable_seq_lengths, which fnppo needs only to
        # exchange per-micro-batch shapes between pipeline stages.
        if layout.pp > 1:
            raise input_error("transformer_config", "moe_dispatcher", "'alltoall' under pipeline parallelism (pp > 1)", "'allgather'")
        extra["variable_seq_lengths"] = False
    return dict(
        extra,
        num_moe_experts=cfg.num_experts,
        moe_layer_freq=list(cfg.moe_layer_freq) if isinstance(cfg.moe_layer_freq, tuple) else cfg.moe_layer_freq,
        moe_router_topk=cfg.moe_topk,
        moe_router_pre_softmax=cfg.moe_pre_softmax,
        moe_ffn_hidden_size=cfg.moe_ffn_hidden_size or cfg.ffn_hidden_size,
        moe_shared_expert_intermediate_size=cfg.moe_shared_expert_size,
        moe_shared_expert_gate=cfg.moe_shared_expert_gate,
        # every router gets its own replay slot (fnppo.megatron.routing); inactive unless a step sets it
        moe_enable_routing_replay=True,
        moe_router_load_balancing_type=cfg.moe_load_balancing,
        moe_aux_loss_coeff=float(cfg.moe_aux_loss_coeff),
        moe_z_loss_coeff=cfg.moe_z_loss_coeff,
        moe_router_score_function=cfg.moe_score_function,
        moe_router_dtype=cfg.moe_router_dtype,
        moe_router_enable_expert_bias=cfg.moe_expert_bias,
        moe_router_bias_update_rate=float(cfg.moe_bias_update_rate),
        moe_token_dispatcher_type=cfg.moe_dispatcher,
        moe_grouped_gemm=_grouped_gemm(cfg),
        moe_expert_capacity_factor=None,
    )


def _moe_without_te() -> None:
    """Two gaps of megatron-core 0.16.1's MoE code off the GPU, filled once per process.

    * The router gating reads ``moe_utils.te_general_gemm``, which it only defines when Transformer
      Engine imports; without TE the name is set to None (its own fallback: ``torch.mm`` in the
      router dtype).
    * The all-to-all dispatcher turns its split sizes into numpy arrays only when they are CUDA
      tensors; CPU split sizes stay tensors, which ``all_to_all_single`` refuses. The dispatcher's
      copy helper is wrapped so that CPU tensors asked for ``as_numpy`` become numpy arrays too.
    """
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    original = token_dispatcher.maybe_move_tensor_to_cpu
    if getattr(original, "_fnppo", False):
        return

    def move(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy()
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    move._fnppo = True  # type: ignore[attr-defined]
    token_dispatcher.maybe_move_tensor_to_cpu = move


def _grouped_gemm(cfg: ModelConfig) -> bool:
    if cfg.moe_grouped_gemm is not None:
        return bool(cfg.moe_grouped_gemm)
    from fnppo.megatron.attention import te_available

    return te_available()


HEADS = ("lm", "value")
"""What the last pipeline stage ends in: ``"lm"`` (the vocabulary output layer, logits) or
``"value"`` (a scalar value head per token, :class:`fnppo.megatron.value.GPTValueModel`)."""


def build_gpt(cfg: ModelConfig, *, head: str = "lm", layer_spec: Any = None, layout: ParallelLayout | None = None,
              **config_overrides: Any) -> list[nn.Module]:
    """Build this rank's model chunks (one per virtual pipeline stage) of a Megatron ``GPTModel``.

    ``head="lm"``: a ``GPTModel`` (logits, :func:`forward_logits`). ``head="value"``: the critic of
    PPO, a :class:`fnppo.megatron.value.GPTValueModel` with the same trunk and a scalar head per token on the
    last stage instead of the vocabulary output layer (values, :func:`forward_values`); it never
    ties its embedding (``cfg.tie_embeddings`` is ignored), and its fresh head can sit on an actor's
    or a Hugging Face policy's trunk (:func:`load_full_weights` with ``fresh_head=True``,
    :func:`fnppo.io.hf.load_hf_weights`), or trunk and head come from a Hugging Face value or reward
    model (``*ForTokenClassification`` / ``*ForSequenceClassification``, ``num_labels=1``).

    ``layer_spec`` defaults to :func:`choose_layer_spec`: Transformer Engine's spec when installed,
    else the local spec with packed-sequence attention, and the local spec under context
    parallelism; pass ``layer_spec=fnppo.local_layer_spec(cfg)`` or
    ``layer_spec=fnppo.default_layer_spec(cfg)`` to force either. With MoE layers ``layer_spec`` is the spec of the MoE layers, and dense layers
    (``moe_layer_freq``) get the default dense spec. Every router's replay slot is its own
    (``fnppo.megatron.routing``): it is taken off Megatron's global list of replay instances, so models built
    earlier never see a later replay. Half-precision models are
    wrapped in ``Float16Module``. Returns unwrapped-by-DDP chunks; see :func:`wrap_ddp`. Each
    ``GPTModel`` keeps ``cfg`` as ``fnppo_config`` (its ``vocab_size`` is the real vocabulary; the
    model's own ``vocab_size`` is the padded one).

    Raises:
        InputError: an unknown ``head``; the configuration errors of :func:`transformer_config`.
    """
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.module import Float16Module

    if head not in HEADS:
        raise input_error("fnppo.build_gpt", "head", f"one of {HEADS}", repr(head))
    if head == "value":
        from fnppo.megatron.value import GPTValueModel as model_class
    else:
        model_class = GPTModel
    layout = layout or current_layout()
    tcfg = transformer_config(cfg, layout, **config_overrides)
    if tcfg.deterministic_mode:  # Transformer Engine's attention refuses deterministic_mode without it
        os.environ.setdefault("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "0")
    dense_spec = None
    if cfg.num_experts is not None:
        _moe_without_te()
        spec = layer_spec if layer_spec is not None else choose_layer_spec(cfg, layout, moe_grouped_gemm=tcfg.moe_grouped_gemm)
        if len(cfg.moe_layers) < cfg.num_layers:
            dense_spec = choose_layer_spec(dataclasses.replace(cfg, num_experts=None), layout)
    else:
        spec = layer_spec if layer_spec is not None else choose_layer_spec(cfg, layout)
    chunks: list[nn.Module] = []
    stages = range(layout.vpp) if layout.vpp else [None]
    from megatron.core import parallel_state as ps

    for vp in stages:
        pre = ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp)
        post = ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp)
        model = model_class(
            config=tcfg,
            transformer_layer_spec=_block_spec(spec, tcfg, vp, dense_spec=dense_spec, moe_layers=cfg.moe_layers),
            vocab_size=cfg.padded_vocab_size,
            max_sequence_length=cfg.max_seq_len,
            pre_process=pre,
            post_process=post,
            parallel_output=True,
            share_embeddings_and_output_weights=cfg.tie_embeddings and head == "lm",
            position_embedding_type=cfg.position_embedding_type,
            rotary_percent=cfg.rotary_percent,
            rotary_base=int(cfg.rotary_base) if float(cfg.rotary_base).is_integer() else cfg.rotary_base,
            rope_scaling=cfg.rope_scaling,
            rope_scaling_factor=cfg.rope_scaling_factor,
            vp_stage=vp,
        )
        model.fnppo_config = cfg  # what it was built for: real vocabulary (fnppo.steps.step), rope (fnppo.io.hf)
        _own_replay_slots(model)
        if cfg.moe_freeze_router:
            _freeze_routers(model)
        if tcfg.fp16 or tcfg.bf16:
            model = Float16Module(tcfg, model)
        if torch.cuda.is_available() and layout.backend == "nccl":
            model = model.cuda(torch.cuda.current_device())
        chunks.append(model)
    return chunks


def _own_replay_slots(model: nn.Module) -> None:
    """Give every router of ``model`` its own replay slot (:func:`fnppo.megatron.routing.replay_slot`) in place
    of the one Megatron put on its global list (which would keep every model ever built alive and
    let one replay reach every model)."""
    from megatron.core.transformer.moe.router_replay import RouterReplay

    from fnppo.megatron.routing import replay_slot

    for m in model.modules():
        old = getattr(m, "router_replay", None)
        if old is not None:
            RouterReplay.global_router_replay_instances[:] = [r for r in RouterReplay.global_router_replay_instances if r is not old]
            m.router_replay = replay_slot()


def _freeze_routers(model: nn.Module) -> None:
    """Router weights (and bias) get no gradient: DDP and the optimizer then leave them out."""
    from megatron.core.transformer.moe.router import Router

    for module in model.modules():
        if isinstance(module, Router):
            for p in module.parameters(recurse=False):
                p.requires_grad_(False)


def _block_spec(spec: Any, tcfg: Any, vp: int | None, *, dense_spec: Any = None, moe_layers: Sequence[int] = ()) -> Any:
    """``spec`` as Megatron's block submodules with a sequence-parallel final norm when it needs one.

    Megatron gives a block built from a layer spec its default final norm; without Transformer
    Engine or Apex that is ``WrappedTorchNorm``, which refuses sequence parallelism. Then the block
    gets :class:`fnppo.megatron.norms.SequenceParallelNorm` (the same norm) instead; otherwise ``spec``.
    With ``dense_spec`` (a model whose MoE layers are ``moe_layers`` only), the block's local layers
    (this stage's global layers, Megatron's ``get_transformer_layer_offset``) get ``spec`` where
    they are MoE layers and ``dense_spec`` elsewhere, as Megatron's ``get_gpt_decoder_block_spec``.
    """
    from megatron.core.transformer import transformer_block as tb
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_layer import BaseTransformerLayer

    from fnppo.megatron.norms import SequenceParallelNorm

    layer_spec = isinstance(spec, ModuleSpec) and isinstance(spec.module, type) and issubclass(spec.module, BaseTransformerLayer)
    sp_norm = tcfg.sequence_parallel and tb.LayerNormImpl is WrappedTorchNorm
    if not layer_spec or (dense_spec is None and not sp_norm):
        return spec
    layers = tb.get_num_layers_to_build(tcfg, vp_stage=vp)
    specs = [spec] * layers
    if dense_spec is not None:
        offset = tb.get_transformer_layer_offset(tcfg, vp_stage=vp)
        specs = [spec if offset + i in moe_layers else dense_spec for i in range(layers)]
    return tb.TransformerBlockSubmodules(layer_specs=specs, layer_norm=SequenceParallelNorm if sp_norm else tb.LayerNormImpl)


def wrap_ddp(chunks: Sequence[nn.Module], *, use_distributed_optimizer: bool = True, overlap_grad_reduce: bool = False, **ddp_kwargs: Any) -> list[nn.Module]:
    """Wrap model chunks in Megatron's ``DistributedDataParallel`` (fp32 grad buffers)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ddp_cfg = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        use_distributed_optimizer=use_distributed_optimizer,
        overlap_grad_reduce=overlap_grad_reduce,
        **ddp_kwargs,
    )
    out = []
    for i, chunk in enumerate(chunks):
        out.append(
            DistributedDataParallel(
                unwrap_model(chunk).config,
                ddp_cfg,
                chunk,
                disable_bucketing=i > 0,
            )
        )
    return out


def build_optimizer(chunks: Sequence[nn.Module], *, optimizer: str = "adam", lr: float = 1e-5, weight_decay: float = 0.0, clip_grad: float = 1.0, adam_beta1: float = 0.9, adam_beta2: float = 0.999, adam_eps: float = 1e-8, **kwargs: Any):
    """Megatron's optimizer (``"adam"`` or ``"sgd"``; distributed when the chunks' DDP config says so).

    ``clip_grad`` > 0 clips the global grad norm (Megatron's own clipping); 0 disables it. On CUDA
    without Transformer Engine or Apex, Megatron's fallback for the grad norm of the clipping reads
    every parameter's norm to the host (one device sync per tensor); it is replaced by
    :func:`_l2_norm_without_syncs` (see there).
    """
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    if torch.cuda.is_available() and current_layout().backend == "nccl":
        _install_l2_norm_without_syncs()

    core = unwrap_model(chunks[0])
    ddp_cfg = getattr(chunks[0], "ddp_config", None)
    ocfg = OptimizerConfig(
        optimizer=optimizer,
        lr=lr,
        weight_decay=weight_decay,
        clip_grad=clip_grad,
        adam_beta1=adam_beta1,
        adam_beta2=adam_beta2,
        adam_eps=adam_eps,
        bf16=core.config.bf16,
        fp16=core.config.fp16,
        params_dtype=core.config.params_dtype,
        use_distributed_optimizer=bool(ddp_cfg and ddp_cfg.use_distributed_optimizer),
        **kwargs,
    )
    return get_megatron_optimizer(ocfg, list(chunks))


def _l2_norm_without_syncs(chunk_size: int, noop_flag: Tensor, tensor_lists: Sequence[Sequence[Tensor]], per_tensor: bool, *args: Any) -> tuple[Tensor, None]:
    r"""Drop-in for Megatron's ``local_multi_tensor_l2_norm``: :math:`\sqrt{\sum_t \|t\|_2^2}` over
    all tensors as a ``[1]`` fp32 device tensor, from ``torch._foreach_norm`` (a few kernels, no
    host sync; Megatron's fallback builds a host list of per-tensor norms)."""
    tensors = [t for group in tensor_lists for t in group]
    if not tensors:
        return torch.zeros(1, dtype=torch.float32, device="cuda"), None
    norms = torch._foreach_norm(tensors)
    return torch.linalg.vector_norm(torch.stack([n.float() for n in norms])).reshape(1), None


def _install_l2_norm_without_syncs() -> None:
    """Point Megatron's grad clipping at :func:`_l2_norm_without_syncs` where it uses its local
    fallback (neither Transformer Engine nor Apex installed; once per process)."""
    from megatron.core import utils as mutils
    from megatron.core.optimizer import clip_grads

    if clip_grads.l2_norm_impl is mutils.local_multi_tensor_l2_norm:
        clip_grads.l2_norm_impl = _l2_norm_without_syncs


def unwrap_model(model: nn.Module) -> nn.Module:
    """The ``GPTModel`` inside DDP / ``Float16Module`` wrappers."""
    while hasattr(model, "module") and isinstance(getattr(model, "module"), nn.Module):
        model = model.module
    return model


def _call_target(model: nn.Module) -> tuple[nn.Module, str]:
    """The module to call (DDP stripped: its forward only forwards) and the prefix to the GPTModel."""
    from megatron.core.distributed import DistributedDataParallel

    while isinstance(model, DistributedDataParallel):
        model = model.module
    prefix = ""
    inner = model
    while hasattr(inner, "module") and isinstance(getattr(inner, "module"), nn.Module):
        inner = inner.module
        prefix += "module."
    return model, prefix


def packed_seq_params(mb: Microbatch):
    """Megatron ``PackedSeqParams`` (THD) for a packed micro-batch, ``None`` for a padded one."""
    if mb.cu_seqlens is None:
        return None
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = mb.cu_seqlens.to(device=mb.input_ids.device, dtype=torch.int32)
    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        max_seqlen_q=int(mb.max_seqlen),
        max_seqlen_kv=int(mb.max_seqlen),
    )


def model_head(model: nn.Module) -> str:
    """``"value"`` for a value model (``build_gpt(cfg, head="value")``), else ``"lm"`` (any wrapper)."""
    return getattr(unwrap_model(model), "fnppo_head", "lm")


def check_head(fn: str, arg: str, model: nn.Module, head: str) -> None:
    """``model`` (any wrapper) ends in ``head`` (one of :data:`HEADS`); the one home of this check.

    Raises:
        InputError: naming ``fn`` and ``arg``, e.g. a value model given to :func:`forward_logits`.
    """
    have = model_head(model)
    if have != head:
        want = "a value model (fnppo.build_gpt(cfg, head='value'))" if head == "value" else "a language model with a vocabulary output layer (head='lm')"
        got = "a value model (head='value')" if have == "value" else f"{type(unwrap_model(model)).__name__} with a vocabulary output layer (head='lm')"
        raise input_error(fn, arg, want, got)


@typechecked
def forward_values(model: nn.Module, microbatch: Microbatch, *, params: Mapping[str, Tensor] | None = None) -> Float[Tensor, "..."]:
    """Run one chunk of a value model on a micro-batch: one value per position on the last stage.

    ``values[b, t] = V(input_ids[b, :t+1])``, the head of :class:`fnppo.megatron.value.GPTValueModel` on the
    decoder's (normed) output at position ``t``, ``[batch, seq]`` in the model's dtype (no fp32
    upcast), over the whole sequence also under sequence parallelism. With the alignment of
    :mod:`fnppo.core.batch`, the value at the position of response token ``j``'s label is the value of
    the state before that token (the last prompt token for ``j = 0``). Other stages return
    Megatron's hidden state ``[seq, batch, hidden]`` (the schedule sends it on). Packed micro-batches
    get ``PackedSeqParams``; ``params`` as in :func:`forward_logits`.

    Reference: the value function of PPO, arXiv:1707.06347.

    Raises:
        InputError: ``model`` is not a value model.
    """
    check_head("fnppo.forward_values", "model", model, "value")
    return _forward(model, microbatch, params)


@typechecked
def forward_logits(model: nn.Module, microbatch: Microbatch, *, params: Mapping[str, Tensor] | None = None) -> Float[Tensor, "..."]:
    """Run one model chunk on a micro-batch: vocab-parallel logits on the last pipeline stage.

    Returns ``[batch, seq, vocab_shard]`` logits in the model's dtype (no fp32 upcast copy) on the
    last stage, and Megatron's hidden state ``[seq, batch, hidden]`` on other stages (the schedule
    sends it on). Packed micro-batches get ``PackedSeqParams`` (THD); padded ones use causal
    attention with right padding, so padding never influences real tokens.

    A model whose unwrapped module sets ``takes_multi_modal = True`` (:class:`fnppo.megatron.vlm.VisionLanguageGPT`)
    also receives ``multi_modal=microbatch.multi_modal`` and ``multi_modal_counts=`` (items per
    sample); other models are called as before (their micro-batches' items are not read).

    ``params``: optional parameters (names as in the unwrapped ``GPTModel``'s ``named_parameters``)
    used instead of the module's own through ``torch.func.functional_call``, so one module skeleton
    evaluates several parameter sets (e.g. the reference policy). Missing names fall back to the
    module's own tensors.

    Raises:
        InputError: ``model`` is a value model (use :func:`forward_values`).
    """
    check_head("fnppo.forward_logits", "model", model, "lm")
    return _forward(model, microbatch, params)


def _forward(model: nn.Module, microbatch: Microbatch, params: Mapping[str, Tensor] | None) -> Tensor:
    """One chunk on one micro-batch (the body of :func:`forward_logits` / :func:`forward_values`)."""
    from megatron.core.transformer.module import Float16Module

    target, prefix = _call_target(model)
    args = (microbatch.input_ids, microbatch.position_ids, None)
    kwargs: dict[str, Any] = {"packed_seq_params": packed_seq_params(microbatch)}
    if getattr(unwrap_model(target), "takes_multi_modal", False):  # e.g. fnppo.megatron.vlm.VisionLanguageGPT
        kwargs["multi_modal"] = microbatch.multi_modal
        kwargs["multi_modal_counts"] = microbatch.multi_modal_counts
    if isinstance(target, Float16Module):
        kwargs["fp32_output"] = False
    if params is None:
        return target(*args, **kwargs)
    named = {prefix + k: v for k, v in params.items()}
    return torch.func.functional_call(target, named, args, kwargs, strict=False)


@typechecked
def forward_hidden(model: nn.Module, microbatch: Microbatch, *, params: Mapping[str, Tensor] | None = None) -> tuple[Float[Tensor, "..."], Tensor | None]:
    """Like :func:`forward_logits`, but the last pipeline stage stops before the output layer.

    Returns ``(hidden, weight)``. On the last stage: ``hidden`` ``[seq, batch, hidden]`` is the
    decoder's output after the final norm, in the model's dtype, made ready for this rank's
    output-weight shard the way Megatron's output layer (``ColumnParallelLinear``) readies its
    input: under tensor parallelism its gradient is summed over the TP group
    (``copy_to_tensor_model_parallel_region``); under sequence parallelism it is gathered over the
    sequence (``gather_from_sequence_parallel_region``); and ``weight`` ``[vocab_shard, hidden]`` is
    the output layer's weight shard, the word embedding when embeddings are tied
    (``GPTModel.shared_embedding_or_output_weight``; taken from ``params`` when given there). Feed
    both to :func:`fnppo.linear_logprob_and_entropy`: ``hidden @ weight.T`` are this rank's
    logits. On other stages: ``(hidden state to send, None)``, as :func:`forward_logits`. A model
    that wraps its ``GPTModel`` as ``language_model`` (:class:`fnppo.megatron.vlm.VisionLanguageGPT`) stops
    the same way; ``params`` are then named from the wrapper (``language_model.…``).
    """
    from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region, gather_from_sequence_parallel_region

    check_head("fnppo.forward_hidden", "model", model, "lm")
    core = unwrap_model(model)
    # a model that wraps its GPTModel (fnppo.megatron.vlm.VisionLanguageGPT: ``language_model``)
    lm, prefix = (core.language_model, "language_model.") if hasattr(core, "language_model") else (core, "")
    if not lm.post_process:
        return _forward(model, microbatch, params), None
    weight = _output_weight(lm, params, prefix)
    lm.post_process = False  # GPTModel._postprocess then returns the decoder's (normed) output
    try:
        hidden = _forward(model, microbatch, params)
    finally:
        lm.post_process = True
    layer = lm.output_layer
    if layer.sequence_parallel:
        hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=True, group=layer.tp_group)
    else:
        hidden = copy_to_tensor_model_parallel_region(hidden, group=layer.tp_group)
    return hidden, weight


def _output_weight(core: nn.Module, params: Mapping[str, Tensor] | None, prefix: str = "") -> Tensor:
    """The output layer's weight shard as ``GPTModel._postprocess`` would use it (``params`` named
    from the unwrapped model, whose GPTModel sits under ``prefix``)."""
    if core.share_embeddings_and_output_weights:
        name = "embedding.word_embeddings.weight" if (core.pre_process or core.mtp_process) else "output_layer.weight"
        own = core.shared_embedding_or_output_weight()
    else:
        name, own = "output_layer.weight", core.output_layer.weight
    name = prefix + name
    return params[name] if params is not None and name in params else own


def snapshot_params(model_chunks: Sequence[nn.Module]) -> list[dict[str, Tensor]]:
    """Detached copies of every chunk's parameters (names of the unwrapped ``GPTModel``).

    Use as ``params`` of :func:`forward_logits` / ``compute_logprobs`` (e.g. a frozen reference).
    """
    return [{k: v.detach().clone() for k, v in unwrap_model(c).named_parameters()} for c in model_chunks]


# ---------------------------------------------------------------------------------------------
# Full (unsharded) weights <-> this rank's shard. Full names are those of a 1-rank GPTModel:
# ``decoder.layers.<global index>.…``; ``output_layer.weight`` is absent when embeddings are tied.
# ---------------------------------------------------------------------------------------------
def _is_expert(param: Tensor) -> bool:
    """Megatron marks expert weights (sharded over expert parallelism) with ``allreduce=False``."""
    return not getattr(param, "allreduce", True)


def _tp_of(param: Tensor, layout: ParallelLayout) -> tuple[int, int]:
    """(size, rank) of the tensor-parallel group that shards ``param``: expert TP for experts."""
    return (layout.etp, layout.etp_rank) if _is_expert(param) else (layout.tp, layout.tp_rank)


def _global_name(core: nn.Module, name: str) -> str:
    """The 1-rank name: global layer index (any prefix, e.g. a VLM's ``language_model.``); local
    expert ``i`` of EP rank ``r`` is expert ``r * E / ep + i``."""
    parts = name.split(".")
    for j in range(len(parts) - 2):
        if parts[j] == "decoder" and parts[j + 1] == "layers" and parts[j + 2].isdigit():
            layer = core.get_submodule(".".join(parts[: j + 3]))
            parts[j + 2] = str(layer.layer_number - 1)
            break
    if "experts" in parts and core.config.num_moe_experts:
        from megatron.core import parallel_state as ps

        ep = ps.get_expert_model_parallel_world_size()
        offset = ps.get_expert_model_parallel_rank() * (core.config.num_moe_experts // ep)
        if "local_experts" in parts:  # SequentialMLP: experts.local_experts.<i>.linear_fc1.weight
            i = parts.index("local_experts") + 1
            parts[i] = str(int(parts[i]) + offset)
        else:  # grouped GEMM: experts.linear_fc1.weight<i>
            head, idx = parts[-1].rstrip("0123456789"), parts[-1][len(parts[-1].rstrip("0123456789")):]
            if idx:
                parts[-1] = f"{head}{int(idx) + offset}"
    return ".".join(parts)


def _tied_output(core: nn.Module, gname: str) -> bool:
    """Whether ``gname`` is an output layer tied to its model's word embeddings."""
    return gname.endswith("output_layer.weight") and bool(getattr(core, "share_embeddings_and_output_weights", False))


def _embedding_name(gname: str) -> str:
    """The word-embedding name beside an output layer: ``<prefix>output_layer.weight`` -> ``<prefix>embedding.word_embeddings.weight``."""
    return gname[: -len("output_layer.weight")] + "embedding.word_embeddings.weight"


def _is_gated_fc1(core: nn.Module, name: str) -> bool:
    """A gated MLP's fused ``[gate; up]`` fc1 (dense, expert or grouped-GEMM expert), judged by the
    config of the module that owns it (a VLM's vision MLP has its own)."""
    parts = name.split(".")
    if not ("mlp" in parts and len(parts) >= 3 and parts[-2] == "linear_fc1"
            and parts[-1].rstrip("0123456789") in ("weight", "bias")):
        return False
    owner = core.get_submodule(".".join(parts[:-2]))
    return bool(getattr(getattr(owner, "config", core.config), "gated_linear_unit", False))


def _shard(core: nn.Module, name: str, param: Tensor, full: Tensor, tp: int, tp_rank: int) -> Tensor:
    if not getattr(param, "tensor_model_parallel", False) or tp == 1:
        return full
    dim = param.partition_dim
    if _is_gated_fc1(core, name):
        gate, up = full.chunk(2, dim=dim)
        return torch.cat([gate.chunk(tp, dim=dim)[tp_rank], up.chunk(tp, dim=dim)[tp_rank]], dim=dim)
    return full.chunk(tp, dim=dim)[tp_rank]


def _is_value_head(gname: str) -> bool:
    from fnppo.megatron.value import VALUE_HEAD_PREFIX

    return gname.startswith(VALUE_HEAD_PREFIX)


def _skippable_with_fresh_head(gname: str) -> bool:
    """Tensors of ``full`` that ``fresh_head=True`` leaves aside: a policy's vocabulary output
    layer, a critic's value head."""
    return gname.endswith("output_layer.weight") or _is_value_head(gname)


def load_full_weights(model_chunks: Sequence[nn.Module], full: Mapping[str, Tensor], *, strict: bool = True,
                      fresh_head: bool = False) -> list[str]:
    """Copy this rank's TP/PP/EP shard of full (1-rank) weights into the model chunks' parameters.

    Expert weights: EP rank ``r`` holds experts ``r * E / ep ... (r + 1) * E / ep - 1`` (full names
    carry the global expert index), each sharded over expert TP (``etp``).

    Every parameter of every chunk must be found in ``full`` with a shape that shards to it; with
    ``strict`` no tensor of ``full`` may be left unused by the whole world. Collective: the ranks
    share their verdicts before anything is written, so a mismatch on any rank loads nothing anywhere
    and every rank raises the same error.

    ``fresh_head=True`` (value models, ``build_gpt(cfg, head="value")``): the trunk is loaded and the
    value head keeps the weights it has (a fresh head on an actor's trunk); a policy's vocabulary
    output layer (``output_layer.weight``) and a stored value head in ``full`` are skipped.

    Returns:
        The names of the tensors of ``full`` that were not loaded (sorted; empty with ``strict``
        unless ``fresh_head`` skipped some).

    Raises:
        InputError: a parameter missing from ``full`` or of another shape; with ``strict``, unused
            tensors; ``fresh_head`` for a model without a value head.
    """
    import torch.distributed as dist

    if fresh_head and not any(model_head(c) == "value" for c in model_chunks):
        raise input_error("load_full_weights", "fresh_head", "False for a model without a value head (head='lm')", "True")
    layout = current_layout()
    plan: list[tuple[Tensor, Tensor]] = []
    used: set[str] = set()
    problem: str | None = None
    for chunk in model_chunks:
        core = unwrap_model(chunk)
        for name, param in core.named_parameters():
            gname = _global_name(core, name)
            if fresh_head and _is_value_head(gname):
                continue  # keeps its weights
            if gname.endswith("output_layer.weight") and gname not in full and _embedding_name(gname) in full:
                gname = _embedding_name(gname)
            if gname not in full:
                problem = problem or str(input_error("load_full_weights", "full", f"a tensor named {gname!r}", "no such tensor"))
                continue
            used.add(gname)
            src = full[gname]
            tp, tp_rank = _tp_of(param, layout)
            shard = _shard(core, name, param, src, tp, tp_rank)
            full_shape = _full_shape(core, name, param, tp)  # uneven chunks can still fit a shard
            if tuple(src.shape) != full_shape or tuple(shard.shape) != tuple(param.shape):
                problem = problem or str(input_error(
                    "load_full_weights", f"full[{gname!r}]",
                    f"shape {full_shape} (shard {tuple(param.shape)} for tp_rank {tp_rank} of {tp})",
                    f"{tuple(src.shape)} (shard {tuple(shard.shape)})",
                ))
                continue
            plan.append((param, shard))
    # Every rank learns every rank's verdict before anyone writes: all load or none does.
    verdicts: list[Any] = [(problem, used)]
    if dist.is_initialized() and dist.get_world_size() > 1:
        verdicts = [None] * dist.get_world_size()
        dist.all_gather_object(verdicts, (problem, used))
    first = next((p for p, _ in verdicts if p), None)
    if first:
        raise InputError(first)
    unused = sorted(set(full) - set().union(*(u for _, u in verdicts)))
    if strict:
        bad = [n for n in unused if not (fresh_head and _skippable_with_fresh_head(n))]
        if bad:
            raise input_error("load_full_weights", "full", "only tensors of this model (strict=True)", f"unused tensors {bad[:5]}")
    with torch.no_grad():
        for param, shard in plan:
            param.copy_(shard.to(dtype=param.dtype, device=param.device))
    # DDP keeps fp32 main params for half precision in the optimizer; callers build the optimizer after loading.
    return unused


def gather_full_weights(model_chunks: Sequence[nn.Module]) -> dict[str, Tensor]:
    """All ranks' shards assembled into full (1-rank) weights, returned on every rank (CPU fp32 copies).

    The inverse of :func:`load_full_weights`. Collective over the whole world.
    """
    import torch.distributed as dist

    layout = current_layout()
    local: dict[str, Tensor] = {}
    for chunk in model_chunks:
        core = unwrap_model(chunk)
        for name, param in core.named_parameters():
            gname = _global_name(core, name)
            t = param.detach().to(torch.float32, copy=True)  # a copy even when already fp32
            tp, _ = _tp_of(param, layout)
            if getattr(param, "tensor_model_parallel", False) and tp > 1:
                parts = [torch.empty_like(t) for _ in range(tp)]
                dist.all_gather(parts, t.contiguous(), group=layout.etp_group if _is_expert(param) else layout.tp_group)
                dim = param.partition_dim
                if _is_gated_fc1(core, name):
                    gates = [p.chunk(2, dim=dim)[0] for p in parts]
                    ups = [p.chunk(2, dim=dim)[1] for p in parts]
                    t = torch.cat(gates + ups, dim=dim)
                else:
                    t = torch.cat(parts, dim=dim)
            if _tied_output(core, gname):
                continue
            local[gname] = t.cpu()
    if layout.ep > 1:  # each EP rank holds other experts (and the same dense weights)
        by_ep: list[Any] = [None] * layout.ep
        dist.all_gather_object(by_ep, local, group=layout.ep_group)
        for part in by_ep:
            local.update(part)
    if layout.pp == 1:
        return local
    gathered: list[Any] = [None] * layout.pp
    dist.all_gather_object(gathered, local if layout.tp_rank == 0 else local, group=layout.pp_group)
    out: dict[str, Tensor] = {}
    for part in gathered:
        out.update(part)
    return out


def _full_shape(core: nn.Module, name: str, param: Tensor, tp: int) -> tuple[int, ...]:
    shape = list(param.shape)
    if getattr(param, "tensor_model_parallel", False) and tp > 1:
        shape[param.partition_dim] *= tp
    return tuple(shape)


def _name_seed(seed: int, name: str) -> int:
    import zlib

    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63 - 1)


def layout_invariant_init(model_chunks: Sequence[nn.Module], *, seed: int = 0, std: float | None = None) -> None:
    """Initialize parameters so that every TP/PP/VPP layout holds the same full model.

    Megatron's own initialization depends on the layout (each rank draws its shard from its own RNG
    stream). Here every full tensor is drawn from a generator seeded by ``(seed, global name)`` and
    this rank keeps its shard, so runs with different layouts start from identical weights. Matrices
    get N(0, std^2) (output projections std/sqrt(2 * num_layers), as in Megatron), norm weights 1,
    biases 0. Collective-free.
    """
    layout = current_layout()
    with torch.no_grad():
        for chunk in model_chunks:
            core = unwrap_model(chunk)
            cfg = core.config
            sigma = std if std is not None else cfg.init_method_std
            for name, param in core.named_parameters():
                gname = _global_name(core, name)
                if _tied_output(core, gname):
                    gname = _embedding_name(gname)
                tp, tp_rank = _tp_of(param, layout)
                shape = _full_shape(core, name, param, tp)
                owner = name.split(".")[-2]
                if "norm" in owner or owner.startswith("ln_") or name.endswith("layer_norm_weight"):
                    full = torch.ones(shape)
                elif name.endswith("bias"):
                    full = torch.zeros(shape)
                else:
                    g = torch.Generator().manual_seed(_name_seed(seed, gname))
                    s = sigma / math.sqrt(2.0 * cfg.num_layers) if name.endswith(("linear_proj.weight", "linear_fc2.weight")) else sigma
                    full = torch.randn(shape, generator=g) * s
                param.copy_(_shard(core, name, param, full, tp, tp_rank).to(param.dtype))
