"""fnppo's process-wide changes to megatron-core: named, idempotent patches, queried from the patched objects.

megatron-core 0.16.1 leaves a few gaps where Transformer Engine (or Apex) is absent; fnppo fills
them by setting module attributes of megatron-core, once per process. Each gap is one
:class:`Patch`: a named function that applies it (a second call changes nothing) and a predicate
that reads, from the patched attribute itself, whether it is in place. :data:`PATCHES` lists them
(an immutable tuple); :func:`applied_patches` answers which are in effect now, without any
registry of its own. The patches:

* ``fused_rope``: ``rope_utils.fused_apply_rotary_pos_emb`` / ``fused_apply_rotary_pos_emb_thd``,
  which only Transformer Engine defines, set to fnppo's adapters (:mod:`fnppo.megatron.fused_rope`)
  where they are missing; applied when a CUDA model config asks for RoPE fusion.
* ``moe_router_gemm``: ``moe_utils.te_general_gemm`` set to None where Transformer Engine did not
  define it (the router's own fallback, ``torch.mm`` in the router dtype); applied by MoE builds.
* ``moe_dispatch_numpy``: ``token_dispatcher.maybe_move_tensor_to_cpu`` wrapped so that CPU split
  sizes asked for ``as_numpy`` become numpy arrays too (``all_to_all_single`` refuses CPU tensors
  there); applied by MoE builds.
* ``grad_clip_l2_norm``: ``clip_grads.l2_norm_impl`` pointed at :func:`l2_norm_without_syncs` where
  it is Megatron's local fallback (one host sync per tensor); applied by ``build_optimizer`` on NCCL.

The CPU mode of :mod:`fnppo.megatron.runtime` is not among them: it is a block that is entered and
left (every attribute restored), queried with :func:`fnppo.megatron.runtime.cpu_mode_active`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from megatron.core import utils as mutils
from megatron.core.models.common.embeddings import rope_utils
from megatron.core.optimizer import clip_grads
from megatron.core.transformer.moe import moe_utils, token_dispatcher

from fnppo.core.typing import Tensor
from fnppo.megatron.fused_rope import fused_rope_bshd, fused_rope_thd

__all__ = [
    "Patch",
    "PATCHES",
    "applied_patches",
    "patch_fused_rope",
    "patch_moe_router_gemm",
    "patch_moe_dispatch_numpy",
    "patch_grad_clip_l2_norm",
    "l2_norm_without_syncs",
]


@dataclass(frozen=True)
class Patch:
    """One named change to megatron-core: ``apply()`` makes it (idempotent), ``applied()`` reads
    whether it is in effect from the patched attribute."""

    name: str
    apply: Callable[[], None]
    applied: Callable[[], bool]


def patch_fused_rope() -> None:
    """Give Megatron a fused RoPE where Transformer Engine does not: the missing
    ``rope_utils.fused_apply_rotary_pos_emb`` (``[s, b, h, d]``) and ``fused_apply_rotary_pos_emb_thd``
    (packed ``[t, h, d]``) become adapters of :func:`fnppo.core.ops.rope.apply_rotary`; Transformer
    Engine's own functions are left in place."""
    if rope_utils.fused_apply_rotary_pos_emb is None:
        rope_utils.fused_apply_rotary_pos_emb = fused_rope_bshd
    if rope_utils.fused_apply_rotary_pos_emb_thd is None:
        rope_utils.fused_apply_rotary_pos_emb_thd = fused_rope_thd


def _fused_rope_applied() -> bool:
    return rope_utils.fused_apply_rotary_pos_emb is fused_rope_bshd or (
        rope_utils.fused_apply_rotary_pos_emb_thd is fused_rope_thd
    )


def patch_moe_router_gemm() -> None:
    """``moe_utils.te_general_gemm`` (read by the router's gating, defined only when Transformer
    Engine imports) set to None where it is missing: the router's own ``torch.mm`` fallback."""
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def _moe_router_gemm_applied() -> bool:
    return hasattr(moe_utils, "te_general_gemm") and moe_utils.te_general_gemm is None


def patch_moe_dispatch_numpy() -> None:
    """Wrap the all-to-all dispatcher's ``maybe_move_tensor_to_cpu`` so that CPU tensors asked for
    ``as_numpy`` become numpy arrays (megatron-core converts only CUDA tensors; CPU split sizes left
    as tensors are refused by ``all_to_all_single``). The wrapper is marked, so it is never wrapped twice."""
    original = token_dispatcher.maybe_move_tensor_to_cpu
    if getattr(original, "_fnppo", False):
        return

    def move(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy()
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    move._fnppo = True  # type: ignore[attr-defined]
    token_dispatcher.maybe_move_tensor_to_cpu = move


def _moe_dispatch_numpy_applied() -> bool:
    return bool(getattr(token_dispatcher.maybe_move_tensor_to_cpu, "_fnppo", False))


def l2_norm_without_syncs(
    chunk_size: int, noop_flag: Tensor, tensor_lists: Sequence[Sequence[Tensor]], per_tensor: bool, *args: Any
) -> tuple[Tensor, None]:
    r"""Drop-in for Megatron's ``local_multi_tensor_l2_norm``: :math:`\sqrt{\sum_t \|t\|_2^2}` over
    all tensors as a ``[1]`` fp32 device tensor, from ``torch._foreach_norm`` (a few kernels, no
    host sync; Megatron's fallback builds a host list of per-tensor norms)."""
    tensors = [t for group in tensor_lists for t in group]
    if not tensors:
        return torch.zeros(1, dtype=torch.float32, device="cuda"), None
    norms = torch._foreach_norm(tensors)
    return torch.linalg.vector_norm(torch.stack([n.float() for n in norms])).reshape(1), None


def patch_grad_clip_l2_norm() -> None:
    """Point Megatron's grad clipping at :func:`l2_norm_without_syncs` where it uses its local
    fallback (neither Transformer Engine nor Apex installed)."""
    if clip_grads.l2_norm_impl is mutils.local_multi_tensor_l2_norm:
        clip_grads.l2_norm_impl = l2_norm_without_syncs


def _grad_clip_l2_norm_applied() -> bool:
    return clip_grads.l2_norm_impl is l2_norm_without_syncs


PATCHES: tuple[Patch, ...] = (
    Patch("fused_rope", patch_fused_rope, _fused_rope_applied),
    Patch("moe_router_gemm", patch_moe_router_gemm, _moe_router_gemm_applied),
    Patch("moe_dispatch_numpy", patch_moe_dispatch_numpy, _moe_dispatch_numpy_applied),
    Patch("grad_clip_l2_norm", patch_grad_clip_l2_norm, _grad_clip_l2_norm_applied),
)
"""Every process-wide patch fnppo makes to megatron-core, in a fixed order."""


def applied_patches() -> tuple[str, ...]:
    """The names of the :data:`PATCHES` in effect in this process, read from the patched attributes."""
    return tuple(p.name for p in PATCHES if p.applied())
