"""fnppo.core.ops.rope: the one-pass RoPE against a float64 closed form, Megatron's unfused THD/BSHD paths,
and the Triton kernel (in Triton's interpreter) against the torch path."""

from __future__ import annotations

import math

import pytest
import torch

from fnppo.core.ops.rope import apply_rotary, thd_positions
from tests.messages import raises_message


def _angles(table: int, rot: int, base: float = 10000.0) -> torch.Tensor:
    """Megatron's table: cat(theta, theta) per position, theta_i = p * base^(-2i/rot)."""
    inv = base ** (-torch.arange(0, rot, 2, dtype=torch.float64) / rot)
    f = torch.arange(table, dtype=torch.float64)[:, None] * inv[None, :]
    return torch.cat([f, f], dim=-1)


def _closed_form(x: torch.Tensor, positions: list[int], rot: int) -> torch.Tensor:
    """Pairs (x_i, x_{i + rot/2}) rotated by angle p * base^(-2i/rot), token by token in float64; the
    dimensions past ``rot`` unchanged."""
    out = x.detach().double().clone()
    half = rot // 2
    for t, p in enumerate(positions):
        for i in range(half):
            a = p * 10000.0 ** (-2 * i / rot)
            x1, x2 = x[t, :, i].double(), x[t, :, i + half].double()
            out[t, :, i] = x1 * math.cos(a) - x2 * math.sin(a)
            out[t, :, i + half] = x2 * math.cos(a) + x1 * math.sin(a)
    return out


def test_thd_positions_restart_per_sequence_and_skip_empty_ones():
    cu = torch.tensor([0, 3, 3, 8, 9], dtype=torch.int32)
    assert thd_positions(cu, 9).tolist() == [0, 1, 2, 0, 1, 2, 3, 4, 0]


@pytest.mark.parametrize("rot", [8, 6])  # the whole head, or a prefix (the rest passes through)
def test_matches_closed_form_and_its_gradient_is_the_inverse_rotation(rot):
    g = torch.Generator().manual_seed(0)
    cu = torch.tensor([0, 4, 4, 9, 12], dtype=torch.int32)
    pos = thd_positions(cu, 12)
    x = torch.randn(12, 3, 8, dtype=torch.float64, generator=g, requires_grad=True)
    before = x.detach().clone()
    version = x._version
    out = apply_rotary(x, _angles(8, rot), pos)
    torch.testing.assert_close(out.detach(), _closed_form(x, pos.tolist(), rot), rtol=0, atol=1e-12)
    # The rotation is orthogonal: the gradient is the upstream gradient rotated back.
    up = torch.randn(12, 3, 8, dtype=torch.float64, generator=g)
    (grad,) = torch.autograd.grad(out, x, up)
    back = apply_rotary(up, -_angles(8, rot), pos)  # rotation by -angle = the inverse
    torch.testing.assert_close(grad, back, rtol=0, atol=1e-12)
    assert x._version == version and torch.equal(x.detach(), before)


def test_adapters_match_megatron_unfused_thd_and_bshd():
    from megatron.core.models.common.embeddings import rope_utils

    from fnppo.megatron.fused_rope import fused_rope_bshd as _fused_rope_bshd
    from fnppo.megatron.fused_rope import fused_rope_thd as _fused_rope_thd

    class OneRank:
        def size(self):
            return 1

        def rank(self):
            return 0

    g = torch.Generator().manual_seed(1)
    cu = torch.tensor([0, 5, 16, 23], dtype=torch.int32)
    x = torch.randn(23, 4, 16, generator=g, requires_grad=True)
    for table in (11, 23):  # positions restart per sequence; a table of T rows: absolute positions
        freqs = _angles(table, 16).float()[:, None, None, :]
        ref = rope_utils._apply_rotary_pos_emb_thd(x, cu, freqs, cp_group=OneRank())
        got = _fused_rope_thd(x, cu.clone(), freqs)
        torch.testing.assert_close(got, ref, rtol=0, atol=1e-6)
        up = torch.randn(ref.shape, generator=g)
        torch.testing.assert_close(
            torch.autograd.grad(got, x, up)[0], torch.autograd.grad(ref, x, up)[0], rtol=0, atol=1e-6
        )
    xb = torch.randn(7, 2, 4, 16, generator=g)  # [s, b, h, d]
    freqs = _angles(7, 16).float()[:, None, None, :]
    torch.testing.assert_close(
        _fused_rope_bshd(xb, freqs), rope_utils._apply_rotary_pos_emb_bshd(xb, freqs), rtol=0, atol=1e-6
    )


def test_triton_kernel_in_interpreter_matches_torch_path(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    g = torch.Generator().manual_seed(2)
    cu = torch.tensor([0, 6, 13], dtype=torch.int32)
    pos = thd_positions(cu, 13)
    for rot in (16, 12):
        x = torch.randn(13, 7, 16, generator=g)[:, 1:6].requires_grad_()  # a view, as Megatron's QKV split gives
        f = torch.rand(7, rot, generator=g) * 6.0  # both halves' angles differ: a mix-up of halves shows
        ref = apply_rotary(x, f, pos, impl="torch")
        got = apply_rotary(x, f, pos, impl="triton")
        torch.testing.assert_close(got, ref, rtol=0, atol=2e-6)
        up = torch.randn(ref.shape, generator=g)
        torch.testing.assert_close(
            torch.autograd.grad(got, x, up)[0], torch.autograd.grad(ref, x, up)[0], rtol=0, atol=2e-6
        )


def test_bad_arguments():
    x = torch.randn(4, 2, 8)
    pos = torch.arange(4)
    with raises_message(
        "fnppo.ops.apply_rotary", "freqs", "an even number of angles per position, at most dim=8", "f32[6,9]"
    ):
        apply_rotary(x, torch.zeros(6, 9), pos)
    with raises_message("fnppo.ops.apply_rotary", "impl", "one of ('auto', 'triton', 'torch')", "'cuda'"):
        apply_rotary(x, torch.zeros(6, 8), pos, impl="cuda")
