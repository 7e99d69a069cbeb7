"""fnppo.megatron.patches: each patch is idempotent, does what it claims, and is seen by applied_patches.

Single process, no process group: each test puts the patched attribute back into its unpatched
state (pytest's monkeypatch restores everything afterwards), applies the patch twice, and checks the
patched object, its behaviour against Megatron's own (or a float64 reference), and the query.
"""

from __future__ import annotations

import math
import re

import numpy as np
import torch
from megatron.core import utils as mutils
from megatron.core.models.common.embeddings import rope_utils
from megatron.core.optimizer import clip_grads
from megatron.core.transformer.moe import moe_utils, token_dispatcher

from fnppo.megatron import patches
from fnppo.megatron.fused_rope import fused_rope_bshd, fused_rope_thd


def _twice(patch) -> None:
    patch.apply()
    patch.apply()


def _patch(name: str) -> patches.Patch:
    (found,) = [p for p in patches.PATCHES if p.name == name]
    return found


def test_patches_are_named_once_and_each_has_a_patch_function():
    names = [p.name for p in patches.PATCHES]
    assert len(set(names)) == len(names) == 4
    assert {p.apply for p in patches.PATCHES} == {
        patches.patch_fused_rope,
        patches.patch_moe_router_gemm,
        patches.patch_moe_dispatch_numpy,
        patches.patch_grad_clip_l2_norm,
    }


def test_fused_rope(monkeypatch):
    monkeypatch.setattr(rope_utils, "fused_apply_rotary_pos_emb", None)
    monkeypatch.setattr(rope_utils, "fused_apply_rotary_pos_emb_thd", None)
    assert "fused_rope" not in patches.applied_patches()
    _twice(_patch("fused_rope"))
    assert rope_utils.fused_apply_rotary_pos_emb is fused_rope_bshd
    assert rope_utils.fused_apply_rotary_pos_emb_thd is fused_rope_thd
    assert "fused_rope" in patches.applied_patches()
    # what Megatron's RoPE fusion now calls rotates as its unfused function does
    g = torch.Generator().manual_seed(0)
    t = torch.randn(6, 2, 3, 8, generator=g, dtype=torch.float64)
    freqs = torch.randn(6, 1, 1, 8, generator=g, dtype=torch.float64)
    want = rope_utils._apply_rotary_pos_emb_bshd(t, freqs)
    torch.testing.assert_close(rope_utils.fused_apply_rotary_pos_emb(t, freqs), want, rtol=0, atol=1e-12)
    # an existing (Transformer Engine) function is left in place
    own = object()
    monkeypatch.setattr(rope_utils, "fused_apply_rotary_pos_emb", own)
    patches.patch_fused_rope()
    assert rope_utils.fused_apply_rotary_pos_emb is own


def test_moe_router_gemm(monkeypatch):
    monkeypatch.delattr(moe_utils, "te_general_gemm", raising=False)
    assert "moe_router_gemm" not in patches.applied_patches()
    _twice(_patch("moe_router_gemm"))
    assert moe_utils.te_general_gemm is None  # the router's own torch.mm fallback
    assert "moe_router_gemm" in patches.applied_patches()
    own = object()
    monkeypatch.setattr(moe_utils, "te_general_gemm", own)
    patches.patch_moe_router_gemm()
    assert moe_utils.te_general_gemm is own and "moe_router_gemm" not in patches.applied_patches()


def test_moe_dispatch_numpy(monkeypatch):
    original = moe_utils.maybe_move_tensor_to_cpu
    monkeypatch.setattr(token_dispatcher, "maybe_move_tensor_to_cpu", original)
    sizes = torch.tensor([3, 1, 2])
    assert torch.is_tensor(original(sizes, as_numpy=True))  # the gap: CPU split sizes stay tensors
    assert "moe_dispatch_numpy" not in patches.applied_patches()
    patches.patch_moe_dispatch_numpy()
    first = token_dispatcher.maybe_move_tensor_to_cpu
    patches.patch_moe_dispatch_numpy()
    assert token_dispatcher.maybe_move_tensor_to_cpu is first  # wrapped once, not twice
    assert "moe_dispatch_numpy" in patches.applied_patches()
    got = first(sizes, as_numpy=True)
    assert isinstance(got, np.ndarray) and got.tolist() == [3, 1, 2]
    assert first(sizes) is original(sizes)  # without as_numpy: Megatron's own function


def test_grad_clip_l2_norm(monkeypatch):
    monkeypatch.setattr(clip_grads, "l2_norm_impl", mutils.local_multi_tensor_l2_norm)
    assert "grad_clip_l2_norm" not in patches.applied_patches()
    _twice(_patch("grad_clip_l2_norm"))
    assert clip_grads.l2_norm_impl is patches.l2_norm_without_syncs
    assert "grad_clip_l2_norm" in patches.applied_patches()
    g = torch.Generator().manual_seed(1)
    groups = [[torch.randn(5, 3, generator=g), torch.randn(7, generator=g)], [torch.randn(4, generator=g)]]
    norm, _ = clip_grads.l2_norm_impl(2048 * 32, torch.zeros(1, dtype=torch.int), groups, False)
    ref = math.sqrt(sum(float(t.double().square().sum()) for grp in groups for t in grp))
    assert abs(float(norm) - ref) < 1e-6 * ref
    # another implementation (Apex, Transformer Engine) is left in place
    own = object()
    monkeypatch.setattr(clip_grads, "l2_norm_impl", own)
    patches.patch_grad_clip_l2_norm()
    assert clip_grads.l2_norm_impl is own


# ---------------------------------------------------------------------------------------------
# The boundary: Megatron's parallel state is read in one function, and patched in one module
# ---------------------------------------------------------------------------------------------
def test_parallel_state_is_read_only_in_current_layout():
    """Outside ``fnppo/megatron/parallel.py`` no module of fnppo reads Megatron's ``parallel_state``
    (the layout is passed in as a ``ParallelLayout``), and nothing outside ``patches.py`` assigns to
    the attributes the patches own."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "fnppo"
    readers = sorted(str(p.relative_to(root)) for p in root.rglob("*.py") if "parallel_state" in p.read_text())
    assert readers == ["megatron/parallel.py"], readers
    assign = re.compile(
        r"\b(rope_utils\.fused_apply_rotary_pos_emb\w*|moe_utils\.te_general_gemm|"
        r"token_dispatcher\.maybe_move_tensor_to_cpu|clip_grads\.l2_norm_impl)\s*=[^=]"
    )
    writers = sorted(str(p.relative_to(root)) for p in root.rglob("*.py") if assign.search(p.read_text()))
    assert writers == ["megatron/patches.py"], writers


def test_stage_ends_of_a_layout_match_megatron(monkeypatch):
    """``ParallelLayout.holds_stage_ends(vp)`` (what ``build_gpt`` passes as ``pre_process`` /
    ``post_process``) equals Megatron's ``is_pipeline_first_stage`` / ``is_pipeline_last_stage``
    (``ignore_virtual=False``) for every pipeline rank and chunk, with and without a virtual pipeline."""
    import dataclasses

    from megatron.core import parallel_state

    from fnppo.megatron.parallel import ParallelLayout

    base = ParallelLayout(
        world_size=1, rank=0, tp=1, pp=1, dp=1, vpp=None, tp_rank=0, pp_rank=0, dp_rank=0,
        tp_group=None, pp_group=None, dp_group=None, backend="gloo",
    )  # fmt: skip
    seen = set()
    for pp, vpp in ((1, None), (2, None), (4, None), (2, 2), (4, 3)):
        for rank in range(pp):
            lay = dataclasses.replace(base, pp=pp, vpp=vpp, pp_rank=rank)
            monkeypatch.setattr(parallel_state, "get_pipeline_model_parallel_rank", lambda r=rank: r)
            monkeypatch.setattr(parallel_state, "get_pipeline_model_parallel_world_size", lambda p=pp: p)
            monkeypatch.setattr(parallel_state, "get_virtual_pipeline_model_parallel_world_size", lambda v=vpp: v)
            for vp in range(vpp) if vpp else [None]:
                want = (
                    parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp),
                    parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp),
                )
                assert lay.holds_stage_ends(vp) == want, (pp, vpp, rank, vp)
                seen.add(want)
    assert seen == {(True, True), (True, False), (False, True), (False, False)}
