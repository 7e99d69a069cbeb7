"""Tests for fnppo.megatron.packed_attention, core_attention and layer_specs: packed (THD) causal attention for Megatron's local layer spec."""

from __future__ import annotations

import itertools
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from fnppo.core.errors import InputError, ShapeError
from fnppo.megatron.core_attention import PackedDotProductAttention, thd_packed_seq_params
from fnppo.megatron.layer_specs import default_layer_spec, local_layer_spec, te_available
from fnppo.megatron.packed_attention import (
    document_causal_mask,
    flex_bucket_length,
    packed_causal_attention,
    segment_ids,
)
from fnppo.testing import megatron_on_cpu, run_ranks

warnings.filterwarnings("ignore", message=".*flex_attention.*")

BACKENDS = ["sdpa", "flex"]  # flex runs in eager mode on CPU (slow, exact)


def _cu(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32)


def _qkv(total: int, heads: int, groups: int, dim: int, seed: int = 0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(total, heads, dim, generator=g, dtype=dtype)
    k = torch.randn(total, groups, dim, generator=g, dtype=dtype)
    v = torch.randn(total, groups, dim, generator=g, dtype=dtype)
    return q, k, v


def _reference(q, k, v, lens, scale=None):
    """Each sequence on its own: causal SDPA (is_causal) after Megatron's repeat_interleave of k/v."""
    rep = q.shape[1] // k.shape[1]
    outs, start = [], 0
    for n in lens:
        sl = slice(start, start + n)
        qs = q[sl].transpose(0, 1)
        ks = k[sl].repeat_interleave(rep, dim=1).transpose(0, 1)
        vs = v[sl].repeat_interleave(rep, dim=1).transpose(0, 1)
        if n:
            outs.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale).transpose(0, 1))
        start += n
    return torch.cat(outs) if outs else q.new_zeros(0, q.shape[1], v.shape[-1])


# ---------------------------------------------------------------------------------------------
# segment ids and the dense mask
# ---------------------------------------------------------------------------------------------
@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(0, 6), min_size=1, max_size=5))
def test_segment_ids_and_mask_match_loops(lens):
    total = sum(lens)
    cu = _cu(lens)
    seg = segment_ids(cu, total)
    expected = [k for k, n in enumerate(lens) for _ in range(n)]
    assert seg.tolist() == expected
    mask = document_causal_mask(cu, total)
    for i in range(total):
        for j in range(total):
            assert bool(mask[i, j]) == (expected[i] == expected[j] and j <= i)


# ---------------------------------------------------------------------------------------------
# the kernel: equality with per-sequence attention, isolation, GQA
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
def test_three_segments_match_per_segment_sdpa(backend):
    lens = [5, 11, 7]
    q, k, v = _qkv(sum(lens), 4, 4, 8)
    out = packed_causal_attention(q, k, v, _cu(lens), backend=backend)
    torch.testing.assert_close(out, _reference(q, k, v, lens), atol=1e-5, rtol=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_gqa_and_custom_scale(backend):
    lens = [6, 3, 9]
    q, k, v = _qkv(sum(lens), 6, 2, 8, seed=1)
    out = packed_causal_attention(q, k, v, _cu(lens), softmax_scale=0.37, backend=backend)
    torch.testing.assert_close(out, _reference(q, k, v, lens, scale=0.37), atol=1e-5, rtol=0)


def test_flex_bucket_lengths():
    """Few buckets, each a multiple of 128 and at most 12.5% (or 127 tokens) longer than the pack."""
    lengths = [flex_bucket_length(t) for t in range(1, 40_000)]
    for t, b in enumerate(lengths, start=1):
        assert b >= t and b % 128 == 0 and (b - t < 128 or b <= 1.125 * t), (t, b)
    assert lengths == sorted(lengths)
    assert flex_bucket_length(8192) == 8192 and flex_bucket_length(8193) == 9216
    assert len(set(lengths[4096:8192])) == 8  # packs of 4,097..8,192 tokens share 8 kernels


def test_flex_padding_to_the_bucket_changes_nothing():
    lens = [100, 0, 37, 163]  # 300 tokens -> padded to 384 for flex
    q, k, v = _qkv(sum(lens), 4, 2, 16, seed=11)
    ref = _reference(q, k, v, lens)
    exact = packed_causal_attention(q, k, v, _cu(lens), backend="flex")  # the default: no padding
    padded = packed_causal_attention(q, k, v, _cu(lens), backend="flex", buckets=True)
    torch.testing.assert_close(padded, ref, atol=1e-5, rtol=0)
    torch.testing.assert_close(padded, exact, atol=1e-5, rtol=0)


def test_hand_computed_two_tokens():
    # One sequence of two tokens, one head of dim 1: out_0 = v_0; out_1 = softmax(q1 k0, q1 k1) . v.
    q = torch.tensor([[[1.0]], [[2.0]]])
    k = torch.tensor([[[0.5]], [[-1.0]]])
    v = torch.tensor([[[3.0]], [[7.0]]])
    out = packed_causal_attention(q, k, v, _cu([2]), softmax_scale=1.0)
    a, b = math.exp(2.0 * 0.5), math.exp(2.0 * -1.0)
    assert out[0, 0, 0].item() == pytest.approx(3.0, abs=1e-6)
    assert out[1, 0, 0].item() == pytest.approx((3.0 * a + 7.0 * b) / (a + b), abs=1e-6)
    # Two sequences of one token each: every token sees only itself.
    out = packed_causal_attention(q, k, v, _cu([1, 1]), softmax_scale=1.0)
    torch.testing.assert_close(out, v, atol=1e-6, rtol=0)


@settings(max_examples=20, deadline=None)
@given(
    lens=st.lists(st.integers(0, 9), min_size=1, max_size=4).filter(lambda x: sum(x) > 0),
    groups=st.sampled_from([1, 2, 4]),
    rep=st.sampled_from([1, 2]),
    seed=st.integers(0, 2**16),
)
def test_property_matches_reference(lens, groups, rep, seed):
    q, k, v = _qkv(sum(lens), groups * rep, groups, 4, seed=seed)
    out = packed_causal_attention(q, k, v, _cu(lens), backend="sdpa")
    torch.testing.assert_close(out, _reference(q, k, v, lens), atol=1e-5, rtol=0)


def test_sdpa_rows_of_many_lengths_match_reference_in_float64():
    """The sdpa path pads sequences into rows of a few widths (16-multiples up to 128, then 8 per
    octave) and restores the packed order: lengths on both sides of each width boundary, empty
    sequences and one long sequence, outputs and gradients against each sequence alone."""
    lens = [3, 0, 16, 17, 130, 1, 128, 129, 0, 300, 15, 33]
    q, k, v = (t.double().requires_grad_() for t in _qkv(sum(lens), 4, 2, 8, seed=5))
    out = packed_causal_attention(q, k, v, _cu(lens), backend="sdpa")
    ref = _reference(q, k, v, lens)
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=0)
    w = torch.randn_like(ref)
    grads = torch.autograd.grad((out * w).sum(), (q, k, v))
    ref_grads = torch.autograd.grad((ref * w).sum(), (q, k, v))
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, atol=1e-12, rtol=0)


def test_sdpa_nan_stays_in_its_sequence_forward_and_backward():
    lens = [5, 7, 6]
    q, k, v = _qkv(sum(lens), 4, 2, 8, seed=3)
    v = v.clone()
    v[7, 1, 2] = float("nan")  # sequence 1 (tokens 5..11)
    kg, vg = k.clone().requires_grad_(), v.clone().requires_grad_()
    out = packed_causal_attention(q, kg, vg, _cu(lens), backend="sdpa")
    other = torch.ones(sum(lens), dtype=torch.bool)
    other[5:12] = False
    assert torch.isfinite(out[other]).all() and torch.isnan(out[7:12]).any()
    out[other].sum().backward()
    assert torch.isfinite(kg.grad[other]).all() and torch.isfinite(vg.grad[other]).all()


def _plain_attention_f64(q, k, v, lens):
    """Causal softmax attention in float64, query by query over the keys it sees (its sequence, at or
    before it; a masked key is left out, not multiplied by 0), key/value group ``h // (heads // groups)``."""
    rep = q.shape[1] // k.shape[1]
    rows, start = [], 0
    for n in lens:
        for i in range(start, start + n):
            ks = k[start : i + 1].double().repeat_interleave(rep, 1).transpose(0, 1)  # [H, i+1-start, D]
            vs = v[start : i + 1].double().repeat_interleave(rep, 1).transpose(0, 1)
            scores = (ks @ q[i].double().unsqueeze(-1)).squeeze(-1) / q.shape[-1] ** 0.5  # [H, keys]
            rows.append((scores.softmax(-1).unsqueeze(1) @ vs).squeeze(1))  # [H, D]
        start += n
    return torch.stack(rows)


def test_flex_nan_reaches_exactly_the_outputs_plain_attention_gives_nan():
    """flex attention zeroes non-finite values (a masked 0 times NaN would spread over a block) and
    puts NaN back at the outputs (query token, head) whose visible keys hold one: non-finite at
    exactly the (token, head) outputs where plain attention is (which makes only the affected
    channels non-finite, and inf rather than NaN for an inf value); the others equal it."""
    lens = [5, 7, 0, 6, 9]
    q, k, v = _qkv(sum(lens), 4, 2, 8, seed=4)
    v = v.clone()
    v[7, 1, 2] = float("nan")  # sequence 1 (tokens 5..11), group 1: heads 2, 3 from token 7 on
    v[20, 0, 0] = float("inf")  # sequence 4 (tokens 18..26), group 0: heads 0, 1 from token 20 on
    out = packed_causal_attention(q, k, v, _cu(lens), backend="flex")
    ref = _plain_attention_f64(q, k, v, lens)
    bad = (~ref.isfinite()).any(-1)  # [T, heads]
    assert bad.any() and torch.equal((~out.isfinite()).any(-1), bad)
    finite = ~bad
    torch.testing.assert_close(out[finite].double(), ref[finite], atol=1e-5, rtol=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_attention_across_sequences(backend):
    lens = [4, 6, 5]
    cu = _cu(lens)
    q, k, v = _qkv(sum(lens), 4, 2, 8, seed=2)
    mid = slice(4, 10)
    q2, k2, v2 = (t.clone() for t in (q, k, v))
    for t in (q2, k2, v2):
        t[mid] = 100.0 * torch.randn_like(t[mid])
    out = packed_causal_attention(q, k, v, cu, backend=backend)
    out2 = packed_causal_attention(q2, k2, v2, cu, backend=backend)
    keep = torch.ones(sum(lens), dtype=torch.bool)
    keep[mid] = False
    torch.testing.assert_close(out2[keep], out[keep], atol=1e-6, rtol=0)
    assert not torch.allclose(out2[mid], out[mid])
    if backend == "flex":
        return  # flex_attention has no backward on CPU
    # Gradients: the loss on sequences 1 and 3 does not depend on sequence 2's keys and values.
    kg, vg = k.clone().requires_grad_(), v.clone().requires_grad_()
    packed_causal_attention(q, kg, vg, cu, backend=backend)[keep].square().sum().backward()
    assert torch.count_nonzero(kg.grad[mid]) == 0 and torch.count_nonzero(vg.grad[mid]) == 0
    assert torch.count_nonzero(kg.grad[keep]) > 0 and torch.count_nonzero(vg.grad[keep]) > 0


def test_dropout_is_applied_and_stays_within_sequences():
    lens = [5, 6, 4]
    cu = _cu(lens)
    q, k, v = _qkv(sum(lens), 2, 2, 8, seed=3)
    plain = packed_causal_attention(q, k, v, cu)
    torch.manual_seed(0)
    a = packed_causal_attention(q, k, v, cu, dropout_p=0.5)
    v2 = v.clone()
    v2[5:11] += 50.0
    torch.manual_seed(0)
    b = packed_causal_attention(q, k, v2, cu, dropout_p=0.5)
    assert not torch.allclose(a, plain)
    keep = torch.ones(sum(lens), dtype=torch.bool)
    keep[5:11] = False
    torch.testing.assert_close(a[keep], b[keep], atol=1e-6, rtol=0)
    with pytest.raises(InputError, match="dropout"):
        packed_causal_attention(q, k, v, cu, dropout_p=0.5, backend="flex")


def test_inputs_are_not_modified():
    lens = [3, 4]
    q, k, v = _qkv(7, 2, 1, 4)
    cu = _cu(lens)
    before = [(t._version, t.clone()) for t in (q, k, v, cu)]
    packed_causal_attention(q, k, v, cu)
    for t, (ver, val) in zip((q, k, v, cu), before, strict=True):
        assert t._version == ver and torch.equal(t, val)


def test_mask_memo_follows_in_place_changes():
    q, k, v = _qkv(6, 2, 2, 4, seed=4)
    cu = _cu([3, 3])
    first = packed_causal_attention(q, k, v, cu)
    cu[1] = 2  # now [2, 4]: must not reuse the memoized mask
    second = packed_causal_attention(q, k, v, cu)
    torch.testing.assert_close(second, _reference(q, k, v, [2, 4]), atol=1e-5, rtol=0)
    assert not torch.allclose(first, second)


@pytest.mark.parametrize(
    "cu, match",
    [
        ([1, 4, 7], "from 0"),
        ([0, 5, 3, 7], "non-decreasing"),
        ([0, 3, 6], "token count 7"),
        ([0], "at least 2"),
    ],
)
def test_bad_cu_seqlens_values(cu, match):
    q, k, v = _qkv(7, 2, 2, 4)
    with pytest.raises(InputError, match=match) as err:
        packed_causal_attention(q, k, v, torch.tensor(cu, dtype=torch.int32))
    assert "packed_causal_attention" in str(err.value) and "cu_seqlens" in str(err.value)


def test_bad_types_and_shapes():
    q, k, v = _qkv(7, 4, 2, 4)
    with pytest.raises(ShapeError, match="cu_seqlens"):
        packed_causal_attention(q, k, v, torch.tensor([0, 7]))  # int64
    with pytest.raises(ShapeError):
        packed_causal_attention(q, k[:6], v[:6], _cu([7]))  # token counts differ
    q3, k3, v3 = _qkv(7, 3, 2, 4)
    with pytest.raises(InputError, match="dividing the 3 query heads"):
        packed_causal_attention(q3, k3, v3, _cu([7]))
    with pytest.raises(InputError, match="dropout_p"):
        packed_causal_attention(q, k, v, _cu([7]), dropout_p=1.0)


def test_thd_packed_seq_params():
    cu = _cu([3, 0, 8, 2])
    p = thd_packed_seq_params(cu)
    assert p.qkv_format == "thd" and p.cu_seqlens_q is cu and p.cu_seqlens_kv is cu
    assert p.max_seqlen_q == p.max_seqlen_kv == 8
    with pytest.raises(InputError, match="non-decreasing"):
        thd_packed_seq_params(torch.tensor([0, 4, 2], dtype=torch.int32))


# ---------------------------------------------------------------------------------------------
# layer specs
# ---------------------------------------------------------------------------------------------
def test_local_layer_spec():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    megatron = get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=True)
    ours = local_layer_spec(normalization="RMSNorm", qk_layernorm=True)
    assert ours.submodules.self_attention.submodules.core_attention is PackedDotProductAttention
    assert megatron.submodules.self_attention.submodules.core_attention is DotProductAttention
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    from fnppo.megatron.norms import SequenceParallelNorm

    def expected(module):  # Megatron's torch norms become the same norms usable with sequence parallelism
        return SequenceParallelNorm if module is WrappedTorchNorm else module

    for name in ("linear_qkv", "linear_proj", "q_layernorm", "k_layernorm"):
        assert getattr(ours.submodules.self_attention.submodules, name) is expected(
            getattr(megatron.submodules.self_attention.submodules, name)
        )
    for name in ("input_layernorm", "pre_mlp_layernorm"):
        assert getattr(ours.submodules, name) is expected(getattr(megatron.submodules, name))
    assert ours.submodules.mlp == megatron.submodules.mlp
    plain = local_layer_spec(packed_attention=False)
    assert plain.submodules.self_attention.submodules.core_attention is DotProductAttention
    with pytest.raises(InputError, match="normalization"):
        local_layer_spec(normalization="BatchNorm")  # type: ignore[arg-type]


def test_spec_options_come_from_a_config():
    class Cfg:
        normalization = "RMSNorm"
        qk_layernorm = True

    from_cfg = local_layer_spec(Cfg())
    explicit = local_layer_spec(normalization="RMSNorm", qk_layernorm=True)
    assert from_cfg.submodules.input_layernorm is explicit.submodules.input_layernorm
    assert (
        from_cfg.submodules.self_attention.submodules.q_layernorm
        is explicit.submodules.self_attention.submodules.q_layernorm
    )
    assert local_layer_spec(Cfg(), qk_layernorm=False).submodules.self_attention.submodules.q_layernorm is not (
        explicit.submodules.self_attention.submodules.q_layernorm
    )


def test_default_layer_spec_picks_te_or_local(monkeypatch):
    from megatron.core.models.gpt import gpt_layer_specs

    import fnppo.megatron.layer_specs as layer_specs

    monkeypatch.setattr(layer_specs, "te_available", lambda: False)
    spec = default_layer_spec(normalization="RMSNorm")
    assert spec.submodules.self_attention.submodules.core_attention is PackedDotProductAttention
    sentinel = object()
    monkeypatch.setattr(layer_specs, "te_available", lambda: True)
    monkeypatch.setattr(gpt_layer_specs, "get_gpt_layer_with_transformer_engine_spec", lambda **kw: (sentinel, kw))
    got, kw = default_layer_spec(qk_layernorm=True)
    assert got is sentinel and kw["qk_layernorm"] is True


def test_te_available_agrees_with_import():
    try:
        import transformer_engine  # noqa: F401

        importable = True
    except ImportError:
        importable = False
    assert te_available() == importable


# ---------------------------------------------------------------------------------------------
# Megatron's THD RoPE restarts positions per sequence (what makes packed == padded with RoPE)
# ---------------------------------------------------------------------------------------------
class _OneRankGroup:
    def size(self) -> int:
        return 1

    def rank(self) -> int:
        return 0


def _rope_closed_form(x: torch.Tensor, positions: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """Rotate-half RoPE (arXiv:2104.09864, GPT-NeoX layout): pairs (x_i, x_{i+d/2}) at angle p*base^(-2i/d)."""
    d = x.shape[-1]
    inv = base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = positions.double()[:, None] * inv[None, :]  # [T, d/2]
    cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]
    x1, x2 = x[..., : d // 2].double(), x[..., d // 2 :].double()
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def test_megatron_thd_rope_restarts_positions_per_sequence():
    from types import SimpleNamespace

    from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    lens, d = [5, 11, 7], 8
    cu = _cu(lens)
    x = torch.randn(sum(lens), 3, d, generator=torch.Generator().manual_seed(0))
    config = SimpleNamespace(apply_rope_fusion=False, rotary_interleaved=False, multi_latent_attention=False)
    rope = RotaryEmbedding(kv_channels=d, rotary_percent=1.0, use_cpu_initialization=True)
    params = thd_packed_seq_params(cu)
    with megatron_on_cpu():
        freqs = rope(params.max_seqlen_q, packed_seq=True)
        got = apply_rotary_pos_emb(x, freqs, config=config, cu_seqlens=cu, cp_group=_OneRankGroup())
    restart = torch.cat([torch.arange(n) for n in lens])
    torch.testing.assert_close(got, _rope_closed_form(x, restart), atol=1e-5, rtol=0)
    assert not torch.allclose(got, _rope_closed_form(x, torch.arange(sum(lens))), atol=1e-3)


# ---------------------------------------------------------------------------------------------
# Real Megatron on CPU: the module and a whole GPTModel, padded vs packed (1 rank and TP=2)
# ---------------------------------------------------------------------------------------------
LENS = [5, 11, 7]
VOCAB = 64


def _gpt(tp: int, rope_fusion: bool = False):
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    if rope_fusion:
        from fnppo.megatron.patches import patch_fused_rope

        patch_fused_rope()  # fnppo's one-pass RoPE (Transformer Engine is absent here)

    cfg = TransformerConfig(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=64,
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        use_cpu_initialization=True,
        params_dtype=torch.float32,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=rope_fusion,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        bias_dropout_fusion=False,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        tensor_model_parallel_size=tp,
    )
    spec = local_layer_spec(cfg)
    model = GPTModel(cfg, spec, vocab_size=VOCAB, max_sequence_length=64, position_embedding_type="rope")
    return cfg, model


def _logits_and_grads(model, input_ids, position_ids, psp, weights):
    model.zero_grad(set_to_none=True)
    logits = model(input_ids, position_ids, None, packed_seq_params=psp)
    (logits * weights).sum().backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return logits.detach(), grads


def _model_check(tp: int) -> dict[str, float]:
    """Runs on each rank: padded [3, S] vs packed [1, T] through one GPTModel; returns max diffs."""
    from megatron.core.packed_seq_params import PackedSeqParams

    _, model = _gpt(tp)
    n_seq, S, T = len(LENS), max(LENS), sum(LENS)
    cu = _cu(LENS)
    g = torch.Generator().manual_seed(7)
    tokens = [torch.randint(0, VOCAB, (n,), generator=g) for n in LENS]
    vshard = VOCAB // tp
    # Random weights per (real) token and vocab entry of this rank's shard; padding weighs 0.
    w_packed = torch.randn(1, T, vshard, generator=g)
    padded = torch.zeros(n_seq, S, dtype=torch.long)
    w_padded = torch.zeros(n_seq, S, vshard)
    for i, n in enumerate(LENS):
        padded[i, :n] = tokens[i]
        w_padded[i, :n] = w_packed[0, cu[i] : cu[i + 1]]
    pos_padded = torch.arange(S).expand(n_seq, S)
    pos_packed = torch.cat([torch.arange(n) for n in LENS])[None]
    lp, gp = _logits_and_grads(model, padded, pos_padded, None, w_padded)
    psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=S, max_seqlen_kv=S)
    lk, gk = _logits_and_grads(model, torch.cat(tokens)[None], pos_packed, psp, w_packed)
    # The same weights with apply_rope_fusion (fnppo's RoPE adapters for [s, b, h, d] and THD).
    _, fused = _gpt(tp, rope_fusion=True)
    fused.load_state_dict(model.state_dict())
    lpf, gpf = _logits_and_grads(fused, padded, pos_padded, None, w_padded)
    lkf, gkf = _logits_and_grads(fused, torch.cat(tokens)[None], pos_packed, psp, w_packed)
    out = {
        "logits": max((lp[i, :n] - lk[0, cu[i] : cu[i + 1]]).abs().max().item() for i, n in enumerate(LENS)),
        "grads": max((gp[n] - gk[n]).abs().max().item() for n in gp),
        "n_grads": float(len(gp)),
        "grads_same_names": float(set(gp) == set(gk)),
        "min_grad_norm": min(g.norm().item() for g in gp.values()),
        "rope_fused_logits": max((lpf - lp).abs().max().item(), (lkf - lk).abs().max().item()),
        "rope_fused_grads": max(
            max((gpf[n] - gp[n]).abs().max().item() for n in gp), max((gkf[n] - gk[n]).abs().max().item() for n in gk)
        ),
    }
    if tp == 1:
        out.update(_module_check())
    return out


def _module_check() -> dict[str, float]:
    """PackedDotProductAttention itself: delegation when unpacked, THD layouts, errors."""
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    cfg, _ = _gpt(1)
    kwargs = dict(config=cfg, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")
    ours, megatron = PackedDotProductAttention(**kwargs), DotProductAttention(**kwargs)
    g = torch.Generator().manual_seed(3)
    hn = cfg.kv_channels
    q = torch.randn(9, 2, 4, hn, generator=g)
    k = torch.randn(9, 2, 2, hn, generator=g)
    v = torch.randn(9, 2, 2, hn, generator=g)
    out = {"delegate": (ours(q, k, v, None) - megatron(q, k, v, None)).abs().max().item()}
    # THD: [T, np, hn] as Megatron's Attention passes it, and [T, 1, np, hn].
    T = sum(LENS)
    q, k, v = _qkv(T, 4, 2, hn, seed=5)
    psp = thd_packed_seq_params(_cu(LENS))
    got3 = ours(q, k, v, None, packed_seq_params=psp)
    got4 = ours(q[:, None], k[:, None], v[:, None], None, packed_seq_params=psp)
    ref = _reference(q, k, v, LENS).reshape(T, -1)
    out["thd_3d"] = (got3 - ref).abs().max().item()
    out["thd_4d"] = (got4.reshape(T, -1) - ref).abs().max().item()
    out["thd_shapes_ok"] = float(got3.shape == (T, 4 * hn) and got4.shape == (T, 1, 4 * hn))
    errors = 0
    for bad in (
        dict(attention_mask=torch.zeros(1, 1, T, T, dtype=torch.bool)),
        dict(packed_seq_params=PackedSeqParams(qkv_format="sbhd", cu_seqlens_q=_cu(LENS))),
        dict(packed_seq_params=PackedSeqParams(qkv_format="thd", cu_seqlens_q=_cu(LENS), cu_seqlens_kv=_cu([T]))),
        dict(attn_mask_type=AttnMaskType.no_mask),
    ):
        call = dict(attention_mask=None, packed_seq_params=psp)
        call.update(bad)
        try:
            ours(q, k, v, call.pop("attention_mask"), **call)
        except InputError as err:
            errors += "PackedDotProductAttention.forward" in str(err)
    out["errors_raised"] = float(errors)
    return out


def _assert_model_results(res: dict[str, float]) -> None:
    assert res["logits"] < 1e-5, res
    assert res["grads"] < 1e-5, res
    assert res["rope_fused_logits"] < 1e-5 and res["rope_fused_grads"] < 1e-5, res
    assert res["grads_same_names"] == 1.0 and res["n_grads"] >= 10, res
    assert res["min_grad_norm"] > 0, res


def test_gpt_packed_equals_padded_one_rank():
    (res,) = run_ranks(_model_check, 1, 1)
    _assert_model_results(res)
    assert res["delegate"] < 1e-6, res
    assert res["thd_3d"] < 1e-5 and res["thd_4d"] < 1e-5 and res["thd_shapes_ok"] == 1.0, res
    assert res["errors_raised"] == 4.0, res


def test_gpt_packed_equals_padded_tp2():
    for res in run_ranks(_model_check, 2, 2, tp=2):
        _assert_model_results(res)
