"""Batch-invariant mode: a sample's log-probs have the same bits whatever its micro-batch.

Kernel tests (in process): the invariant kernels against float64 references and against
themselves at other row counts / offsets / paddings; packed attention keeps a NaN in its sequence.
Model tests (one gloo rank, real Megatron on CPU, one launch): ``compute_logprobs`` of the same
samples under many compositions and ``train_step``'s on-policy metrics, dense and MoE; the NaN
isolation of a vision-language model's packed and padded layouts.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import random

import pytest
import torch
import torch.nn.functional as F

import fnppo
from fnppo.core.kernels import invariant as inv
from fnppo.core.ops.batch_invariant import batch_invariant
from fnppo.megatron.packed_attention import packed_causal_attention
from fnppo.testing import run_ranks, synthetic_samples, tiny_model_config


# ---------------------------------------------------------------------------------------------
# kernels
# ---------------------------------------------------------------------------------------------
def _rows_agree(fn, x: torch.Tensor, counts=(1, 2, 5, 17, 70, 130)) -> None:
    """Row r of fn(x[a:b]) has the bits of row r of fn(x) for windows of many sizes and offsets."""
    full = fn(x)
    for n in counts:
        for start in (0, 3, x.shape[0] - n):
            if 0 <= start <= x.shape[0] - n:
                part = fn(x[start : start + n].clone())
                assert torch.equal(part, full[start : start + n]), f"rows {start}:{start + n} differ"


def test_invariant_kernels_match_float64_and_keep_row_bits():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(150, 96, generator=g)
    w = torch.randn(80, 96, generator=g)
    b = torch.randn(80, generator=g)
    lin = functools.partial(inv.invariant_linear, weight=w, bias=b, tile=16)
    torch.testing.assert_close(lin(x).double(), x.double() @ w.double().T + b.double(), rtol=1e-5, atol=1e-4)
    _rows_agree(lin, x)
    gamma = torch.rand(96, generator=g) + 0.5
    rms = lambda t: inv.invariant_rms_norm(t, gamma, 1e-6, tile=16)  # noqa: E731
    xd = x.double()
    ref = xd / torch.sqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-6) * gamma.double()
    torch.testing.assert_close(rms(x).double(), ref, rtol=1e-5, atol=1e-6)
    _rows_agree(rms, x)
    long = torch.randn(6, 40_000, generator=g)  # long rows: few of them are split across threads
    lse = functools.partial(inv.invariant_row_reduce, "logsumexp", tile=4)
    torch.testing.assert_close(lse(long).double(), torch.logsumexp(long.double(), -1), rtol=1e-6, atol=1e-5)
    _rows_agree(lse, long, counts=(1, 2, 3, 6))
    flat = torch.randn(5000, generator=g) * 4
    for f, r in [(inv.invariant_silu, F.silu), (inv.invariant_sigmoid, torch.sigmoid), (inv.invariant_gelu, F.gelu)]:
        torch.testing.assert_close(f(flat).double(), r(flat.double()), rtol=1e-6, atol=1e-6)
        full = f(flat)
        for o in range(0, 40, 3):  # an element's bits do not depend on its offset in the tensor
            assert torch.equal(f(flat[o : o + 37].clone()), full[o : o + 37])


def _attention_reference(q, k, v, bounds, scale):
    """Per-sequence causal softmax attention in float64."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1).double(), v.repeat_interleave(rep, 1).double()
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[-1], dtype=torch.float64)
    for a, b in zip(bounds, bounds[1:]):
        s = torch.einsum("qhd,khd->hqk", q[a:b].double(), k[a:b]) * scale
        s = s.masked_fill(torch.ones(b - a, b - a, dtype=torch.bool).triu(1), float("-inf"))
        out[a:b] = torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), v[a:b])
    return out


def test_sequence_attention_is_exact_and_the_same_in_any_pack_or_padding():
    g = torch.Generator().manual_seed(1)
    lens = [5, 19, 1, 33, 8]
    bounds = [0, *torch.tensor(lens).cumsum(0).tolist()]
    q, k, v = (torch.randn(bounds[-1], h, 16, generator=g) for h in (4, 2, 2))
    out = inv.sequence_attention(q, k, v, bounds, softmax_scale=0.25, block=8)
    torch.testing.assert_close(out.double(), _attention_reference(q, k, v, bounds, 0.25), rtol=1e-5, atol=1e-6)
    for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
        alone = inv.sequence_attention(q[a:b], k[a:b], v[a:b], [0, b - a], softmax_scale=0.25, block=8)
        assert torch.equal(alone, out[a:b]), f"sequence {i}: alone vs packed"
        pad = 40 - (b - a)  # the padded layout: the row's padding after it, attended by nothing real
        junk = [torch.cat([t[a:b], 7 * torch.randn(pad, *t.shape[1:], generator=g)]) for t in (q, k, v)]
        padded = inv.sequence_attention(*junk, [0, 40], softmax_scale=0.25, block=8)
        assert torch.equal(padded[: b - a], out[a:b]), f"sequence {i}: padded vs packed"


@pytest.mark.parametrize("backend", ["sdpa", "flex", "invariant"])
def test_a_nan_stays_in_its_sequence_of_the_pack(backend):
    """NaN in one sequence's keys/values: that sequence's outputs after it are NaN, its neighbours'
    are those they have alone (the dense [T, T] mask let 0 * NaN through to every neighbour)."""
    g = torch.Generator().manual_seed(2)
    bounds = [0, 6, 15, 21]
    q, k, v = (torch.randn(21, h, 8, generator=g) for h in (4, 2, 2))
    k, v = k.clone(), v.clone()
    k[8, 1, 3] = float("nan")
    v[9, 0, 2] = float("nan")

    def attend(qq, kk, vv, bb):
        if backend == "invariant":
            return inv.sequence_attention(qq, kk, vv, bb)
        return packed_causal_attention(qq, kk, vv, torch.tensor(bb, dtype=torch.int32), backend=backend)

    with torch.no_grad():
        out = attend(q, k, v, bounds)
    assert bool(torch.isfinite(out[:6]).all()) and bool(torch.isfinite(out[15:]).all())
    assert bool(torch.isnan(out[9:15]).any(dim=-1).all())
    for a, b in ((0, 6), (15, 21)):
        with torch.no_grad():
            alone = attend(q[a:b], k[a:b], v[a:b], [0, b - a])
        torch.testing.assert_close(out[a:b], alone, rtol=1e-6, atol=1e-6)


def test_the_mode_is_scoped_and_restores_torch():
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(3, 64, generator=g), torch.randn(32, 64, generator=g)
    with batch_invariant(True, tile=8):
        inside = F.linear(x, w)
        assert torch.equal(inside[:1], F.linear(x[:1], w))
    assert torch.equal(inside, inv.invariant_linear(x, w, tile=8))
    assert torch.overrides._get_current_function_mode_stack() == []  # noqa: SLF001 - nothing left pushed


def test_every_product_entry_point_takes_the_invariant_matmul(monkeypatch):
    """``torch.addmm`` / ``Tensor.addmm`` (Megatron's and torch's linear layers call them), ``baddbmm``,
    ``mm``, ``bmm``, ``matmul``, ``@`` and ``F.linear``: inside the mode each goes to the CPU
    row-tiled kernel (counted by a spy), gives its bits (``c + invariant_matmul(a, b)``) and keeps
    a row's bits in any window of rows."""
    g = torch.Generator().manual_seed(5)
    a, b, c = torch.randn(150, 96, generator=g), torch.randn(96, 80, generator=g), torch.randn(150, 80, generator=g)
    a3, b3, c3 = a.reshape(3, 50, 96), torch.randn(3, 96, 80, generator=g), c.reshape(3, 50, 80)
    real, calls = inv.invariant_matmul, []

    def spy(x, y, *, tile=None):
        calls.append(tuple(x.shape))
        return real(x, y, tile=tile)

    monkeypatch.setattr(inv, "invariant_matmul", spy)
    entries = {
        "torch.addmm": lambda i: torch.addmm(c[i], a[i], b),
        "Tensor.addmm": lambda i: c[i].addmm(a[i], b),
        "torch.addmm beta/alpha": lambda i: torch.addmm(c[i], a[i], b, beta=0.5, alpha=2.0),
        "torch.baddbmm": lambda i: torch.baddbmm(c3[:, i], a3[:, i], b3),
        "Tensor.baddbmm": lambda i: c3[:, i].baddbmm(a3[:, i], b3),
        "torch.mm": lambda i: torch.mm(a[i], b),
        "Tensor.mm": lambda i: a[i].mm(b),
        "torch.bmm": lambda i: torch.bmm(a3[:, i], b3),
        "torch.matmul": lambda i: torch.matmul(a[i], b),
        "@": lambda i: a[i] @ b,
    }
    for name, f in entries.items():
        with batch_invariant(True, tile=16):
            calls.clear()
            full = f(slice(None))
            assert calls, f"{name} did not reach the invariant matmul"
            for start, n in ((0, 1), (3, 2), (7, 17), (20, 30)):
                assert torch.equal(f(slice(start, start + n)), full[..., start : start + n, :]), (name, start, n)
    with batch_invariant(True, tile=16):
        assert torch.equal(torch.addmm(c, a, b), c + real(a, b, tile=16))
        assert torch.equal(c.addmm(a, b, beta=0.5, alpha=2.0), c * 0.5 + real(a, b, tile=16) * 2.0)


def _cuda_kernels(op: str) -> list[str]:
    """The dispatcher's CUDA entries of ``op`` (a CPU-only torch has none of its own)."""
    return [line for line in torch._C._dispatch_dump(op).splitlines() if line.startswith("CUDA")]  # noqa: SLF001


def test_the_cuda_product_kernels_are_registered_for_mm_and_addmm():
    """The CUDA half of the mode without CUDA: the registration table names ``aten::mm`` and
    ``aten::addmm`` (``nn.Linear`` with a bias lowers to ``addmm``) with Megatron's kernel of each
    name on the CUDA key, and inside ``_aten_triton_products`` the dispatcher holds a CUDA kernel
    registered from fnppo for each, removed again on exit."""
    import types

    from fnppo.megatron import numerics

    kernels = types.SimpleNamespace(mm_batch_invariant=lambda a, b: a, addmm_batch_invariant=lambda c, a, b, **k: c)
    table = numerics.triton_product_registrations(kernels)
    assert {(op, key) for op, _, key in table} >= {("aten::mm", "CUDA"), ("aten::addmm", "CUDA")}
    for op, kernel, _ in table:
        assert kernel is getattr(kernels, f"{op.split('::')[1]}_batch_invariant"), op
    before = {op: _cuda_kernels(op) for op in ("aten::mm", "aten::addmm")}
    with numerics._aten_triton_products(kernels):  # noqa: SLF001
        for op in ("aten::mm", "aten::addmm"):
            added = [line for line in _cuda_kernels(op) if line not in before[op]]
            assert any("fnppo/megatron/numerics.py" in line for line in added), (op, _cuda_kernels(op))
    assert {op: _cuda_kernels(op) for op in before} == before


def test_onpolicy_gaps_are_masked_maxima_against_float64():
    from fnppo.steps.schedule import onpolicy_gaps

    g = torch.Generator().manual_seed(6)
    lp, old = -torch.rand(3, 7, generator=g) * 3, -torch.rand(3, 7, generator=g) * 3
    mask = (torch.rand(3, 7, generator=g) > 0.4).float()
    lp[0, 0], mask[0, 0] = float("nan"), 0.0  # a masked-out NaN is ignored
    gaps = onpolicy_gaps(lp, old, mask)
    d = (lp.double() - old.double())[mask.bool()]
    ref = torch.stack([d.abs().max(), torch.expm1(d).abs().max()])
    torch.testing.assert_close(gaps.double(), ref, rtol=1e-6, atol=1e-7)
    assert onpolicy_gaps(old, old, mask).tolist() == [0.0, 0.0]
    mask[0, 0] = 1.0  # a NaN on a kept token is reported, as inf
    assert onpolicy_gaps(lp, old, mask).tolist() == [float("inf"), float("inf")]


# ---------------------------------------------------------------------------------------------
# real Megatron (one launch): compositions, the train step's on-policy metrics, NaN isolation
# ---------------------------------------------------------------------------------------------
VOCAB = 64


def _cfg(**kw) -> fnppo.ModelConfig:
    return tiny_model_config(**{"vocab_size": VOCAB, "max_seq_len": 64, "batch_invariant": True, **kw})


MOE = dict(num_experts=4, moe_topk=2, moe_ffn_hidden_size=32, deterministic=True, moe_experts="sequential")
N = 8


def _compositions() -> dict[str, dict]:
    order = list(range(N))
    random.Random(0).shuffle(order)
    return {
        "one": {},
        "budget24": {"max_tokens_per_microbatch": 24},
        "alone": {"num_microbatches": N},
        "shuffled": {"order": order, "num_microbatches": 2},
        "padded3": {"layout": "padded", "num_microbatches": 3},
        "fused": {"fused": True},
        "fused_budget": {"fused": True, "max_tokens_per_microbatch": 24},
    }


def _logprobs(chunks, samples, comp: dict):
    comp = dict(comp)
    order = comp.pop("order", None)
    fused = comp.pop("fused", False)
    batch = samples if order is None else [samples[i] for i in order]
    cfg = fnppo.StepConfig(fns=fnppo.StepFns.fused() if fused else fnppo.StepFns())
    lp, ent = fnppo.compute_logprobs(chunks, batch, with_entropy=True, config=cfg, **comp)
    if order is not None:
        back = sorted(zip(order, lp, ent), key=lambda t: t[0])
        lp, ent = [t[1] for t in back], [t[2] for t in back]
    return lp, ent


def _bit_diffs(ref, got) -> int:
    return sum(int((a != b).sum()) for a, b in zip(ref, got, strict=True))


def _step_gaps(cfg: fnppo.ModelConfig, samples, step: dict) -> dict:
    chunks = fnppo.build_gpt(cfg)
    fnppo.models.layout_invariant_init(chunks, seed=3)
    ddp = fnppo.wrap_ddp(chunks)
    state = fnppo.TrainState(model=ddp, optimizer=fnppo.build_optimizer(ddp, lr=1e-3))
    old, _ = fnppo.compute_logprobs(state.model, samples, max_tokens_per_microbatch=40)
    batch = [dataclasses.replace(s, old_logprobs=o) for s, o in zip(samples, old)]
    loss = fnppo.losses.LossConfig(policy=fnppo.losses.ppo_clip(), agg=fnppo.losses.Aggregation("token-mean"))
    state, metrics = fnppo.train_step(state, batch, fnppo.StepConfig(loss=loss, **step))
    _, metrics2 = fnppo.train_step(state, batch, fnppo.StepConfig(loss=loss, **step))  # now off-policy
    keys = ("onpolicy/max_abs_logprob_diff", "onpolicy/max_abs_ratio_minus_1")
    return {"first": [metrics[k] for k in keys], "after_update": [metrics2[k] for k in keys]}


def _model_run() -> dict:
    samples = synthetic_samples(N, vocab_size=VOCAB, seed=5, prompt_len=(2, 9), response_len=(2, 9))
    out: dict = {}
    for name, extra in (("dense", {}), ("moe", MOE)):
        chunks = fnppo.build_gpt(_cfg(**extra))
        fnppo.models.layout_invariant_init(chunks, seed=3)
        comps = _compositions() if name == "dense" else {k: v for k, v in _compositions().items() if "fused" not in k}
        results = {k: _logprobs(chunks, samples, c) for k, c in comps.items()}
        ref = results["one"]
        fref = results.get("fused", ref)
        out[name] = {
            k: (_bit_diffs((fref if "fused" in k else ref)[0], lp), _bit_diffs((fref if "fused" in k else ref)[1], e))
            for k, (lp, e) in results.items()
        }
        out[name + "_finite"] = all(bool(torch.isfinite(t).all()) for t in ref[0])
    out["step_dense"] = _step_gaps(_cfg(), samples, {"num_microbatches": 3})
    recompute = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    out["step_recompute_padded"] = _step_gaps(_cfg(extra=recompute), samples, {"layout": "padded"})
    out["step_moe"] = _step_gaps(_cfg(**MOE), samples, {"max_tokens_per_microbatch": 24})
    out["shaped"] = _shaped_run(samples)
    return out


def _shaped_run(samples) -> dict:
    """The behaviours FAST takes on CUDA, asked of CPU kernels by a record: micro-batches padded to the
    record's ``min_rows`` (seen by a recording forward stage), MoE routers through the fixed-tile router
    logits (calls counted); the bits stay those of one micro-batch."""
    from fnppo.megatron import numerics
    from fnppo.megatron.config import InvariantKernels
    from fnppo.megatron.forward import forward_logits

    shaped = InvariantKernels(name="cpu-shaped", tiles=True, min_rows=96, router_tiles=True)
    seen: list[int] = []

    def recording(model, mb, **kw):
        seen.append(int(mb.input_ids.numel()))
        return forward_logits(model, mb, **kw)

    calls = []
    tiled = numerics.invariant_router_logits
    numerics.invariant_router_logits = lambda *a: (calls.append(1), tiled(*a))[1]
    out = {}
    for name, extra in (("dense", {}), ("moe", MOE)):
        chunks = fnppo.build_gpt(_cfg(batch_invariant=shaped, **extra))
        fnppo.models.layout_invariant_init(chunks, seed=3)
        cfg = fnppo.StepConfig(fns=fnppo.StepFns(forward=recording))
        one, _ = fnppo.compute_logprobs(chunks, samples, config=cfg)
        alone, _ = fnppo.compute_logprobs(chunks, samples, config=dataclasses.replace(cfg, num_microbatches=N))
        out[name] = {"bits": _bit_diffs(one, alone), "fewest_tokens": min(seen), "router_calls": len(calls)}
        seen.clear()
    return out


@functools.cache
def _model_results() -> dict:
    return run_ranks(_model_run, 1, timeout_s=900)[0]


def test_compute_logprobs_has_the_same_bits_in_every_composition_dense_and_moe():
    """Token budgets, micro-batch counts, every sample alone, shuffled, packed vs padded, fused output:
    0 log-prob and 0 entropy bits differ from one packed micro-batch (dense; MoE with deterministic)."""
    res = _model_results()
    assert res["dense_finite"] and res["moe_finite"]
    for name in ("dense", "moe"):
        bad = {k: v for k, v in res[name].items() if v != (0, 0)}
        assert not bad, f"{name}: bits differ (log-probs, entropies) by composition: {bad}"


def test_train_step_reports_exact_on_policy_gaps():
    """old = compute_logprobs (another split): the first update's forward gives ratio - 1 = 0 exactly,
    with recomputation and the padded layout too, dense and MoE; after an update it does not."""
    res = _model_results()
    for key in ("step_dense", "step_recompute_padded", "step_moe"):
        assert res[key]["first"] == [0.0, 0.0], f"{key}: {res[key]['first']}"
        assert min(res[key]["after_update"]) > 0.0, f"{key}: the policy moved, the gap must show it"


def test_a_record_shapes_micro_batches_and_tiles_routers_on_the_cpu_too():
    """The CUDA kernels' micro-batch floor and router tiles are fields of the record, so a CPU test asks
    for them: every micro-batch reaches ``min_rows`` tokens, an MoE model's routers take the tiled
    logits, a dense model none, and a sample alone has the bits of one micro-batch."""
    res = _model_results()["shaped"]
    assert res["dense"]["fewest_tokens"] >= 96 and res["moe"]["fewest_tokens"] >= 96, res
    assert res["dense"]["router_calls"] == 0 and res["moe"]["router_calls"] > 0, res
    assert res["dense"]["bits"] == 0 and res["moe"]["bits"] == 0, res


# ---------------------------------------------------------------------------------------------
# NaN isolation: a NaN pixel in one sample never reaches another's log-probs
# ---------------------------------------------------------------------------------------------
IMG, N_TOK = 5, 4


def _nan_run(invariant: bool) -> dict:
    from fnppo.core.batching.sample import Sample
    from fnppo.core.typing import typechecking
    from fnppo.megatron.vlm_collate import VisionConfig, VLMCollate
    from fnppo.megatron.vlm_model import build_vlm

    vision = VisionConfig(
        image_token_id=IMG,
        image_size=8,
        patch_size=4,
        num_layers=1,
        hidden_size=32,
        num_attention_heads=2,
        ffn_hidden_size=64,
        projector_hidden_size=48,
    )
    g = torch.Generator().manual_seed(4)
    images = torch.randn(1, 3, 8, 8, generator=g)
    images[0, 1, 2, 3] = float("nan")
    with_image = Sample(
        prompt_ids=torch.tensor([1, IMG, 3]), response_ids=torch.tensor([7, 8, 9]), multi_modal={"images": images}
    )
    text = Sample(prompt_ids=torch.tensor([2, 4, 6]), response_ids=torch.tensor([10, 11, 12, 13]))
    out = {}
    for name, extra in (("dense", {}), ("moe", MOE)):
        chunks = build_vlm(_cfg(batch_invariant=invariant, **extra), vision)
        fnppo.models.layout_invariant_init(chunks, seed=3)
        cfg = fnppo.StepConfig(fns=fnppo.StepFns(collate=VLMCollate(IMG, N_TOK)))
        with typechecking(False):  # the collate's own finite-pixel check is a call-time check
            alone, _ = fnppo.compute_logprobs(chunks, [text], config=cfg)
            for layout in ("packed", "padded"):
                lp, _ = fnppo.compute_logprobs(chunks, [with_image, text], config=cfg, layout=layout)
                out[(name, layout)] = (lp[0].tolist(), lp[1].tolist(), alone[0].tolist())
    return out


@pytest.mark.parametrize("invariant", [False, True])
def test_a_nan_pixel_never_reaches_the_text_only_neighbour(invariant):
    res = run_ranks(_nan_run, 1, invariant)[0]
    for key, (poisoned, neighbour, alone) in res.items():
        assert all(math.isnan(x) for x in poisoned), f"{key}: the NaN image's own sample must be NaN: {poisoned}"
        assert all(math.isfinite(x) for x in neighbour), f"{key}: NaN reached the neighbour: {neighbour}"
        torch.testing.assert_close(torch.tensor(neighbour), torch.tensor(alone), rtol=1e-5, atol=1e-5)
        if invariant:
            assert neighbour == alone, f"{key}: batch-invariant mode, bits differ from the sample alone"


# ---------------------------------------------------------------------------------------------
# refusals: where invariance cannot hold
# ---------------------------------------------------------------------------------------------
def _layout(**kw):
    from fnppo.megatron.parallel import ParallelLayout

    base = dict(world_size=4, rank=0, tp=1, pp=1, dp=1, vpp=None, tp_rank=0, pp_rank=0, dp_rank=0)
    return ParallelLayout(**{**base, **kw, "tp_group": None, "pp_group": None, "dp_group": None, "backend": "gloo"})


def test_batch_invariant_refuses_dropout_tp_above_2_and_cp_on_the_fast_kernels(monkeypatch):
    """Dropout and tp > 2 are refused; context parallelism only with kernels whose ``context_parallel``
    is False (FAST: its flex attention would see one rank's shard): fnppo's torch kernels take it (the
    CUDA choice is made here without a GPU, by the layout check the config reads); Megatron's products
    are refused on a CPU model; the record is stored as given and read back by ``kernels_of``."""
    from fnppo.core.errors import InputError
    from fnppo.megatron import megatron_config as config_module
    from fnppo.megatron.config import InvariantKernels
    from fnppo.megatron.megatron_config import transformer_config
    from fnppo.megatron.numerics import kernels_of
    from tests.messages import check_message

    with pytest.raises(InputError) as err:
        _cfg(hidden_dropout=0.1)
    check_message(err.value, InputError, "ModelConfig", "hidden_dropout", "0.0 with batch_invariant=True", "0.1")
    cfg = _cfg(num_attention_heads=4, num_query_groups=4)
    with pytest.raises(InputError) as err:
        transformer_config(cfg, _layout(tp=4))
    check_message(err.value, InputError, "transformer_config", "ModelConfig.batch_invariant", "False with", "tp=4")
    assert transformer_config(cfg, _layout(tp=2)).batch_invariant_mode is True
    assert kernels_of(transformer_config(cfg, _layout(cp=2))) is InvariantKernels.TORCH  # CPU: CP taken
    with pytest.raises(InputError) as err:
        transformer_config(dataclasses.replace(cfg, batch_invariant=InvariantKernels.MEGATRON), _layout())
    check_message(
        err.value, InputError, "transformer_config", "ModelConfig.batch_invariant", "megatron_products", "megatron"
    )
    monkeypatch.setattr(config_module, "_on_cuda", lambda layout: True)
    with pytest.raises(InputError) as err:
        transformer_config(cfg, _layout(cp=2))
    check_message(err.value, InputError, "transformer_config", "ModelConfig.batch_invariant", "'fast'", "cp=2")
    torch_on_cuda = dataclasses.replace(cfg, batch_invariant=InvariantKernels.TORCH)
    assert kernels_of(transformer_config(torch_on_cuda, _layout(cp=2))) is InvariantKernels.TORCH
    assert kernels_of(transformer_config(cfg, _layout())) is InvariantKernels.FAST  # True: CUDA's default


def test_sequence_attention_rows_are_the_rows_of_sequence_attention_whatever_the_other_queries():
    """``sequence_attention_rows`` (the blocks holding the asked rows only) gives those rows the bits of
    the whole ``sequence_attention``, in the order asked, also with every other query replaced; a
    float64 causal reference agrees to rounding; a row outside the tokens is refused by name."""
    from fnppo.core.errors import InputError
    from fnppo.core.kernels.invariant import sequence_attention, sequence_attention_rows

    g = torch.Generator().manual_seed(3)
    bounds = [0, 5, 5, 45, 140, 141]  # an empty sequence, one of one token, several blocks of 16
    total, heads, groups, d = bounds[-1], 4, 2, 8
    q = torch.randn(total, heads, d, generator=g)
    k, v = (torch.randn(total, groups, d, generator=g) for _ in range(2))
    full = sequence_attention(q, k, v, bounds, block=16)
    rows = torch.randperm(total, generator=g)[:37]
    got = sequence_attention_rows(q, k, v, bounds, rows, block=16)
    assert torch.equal(got, full[rows])
    others = torch.ones(total, dtype=torch.bool)
    others[rows] = False
    q2 = torch.where(others[:, None, None], torch.randn(total, heads, d, generator=g), q)
    assert torch.equal(sequence_attention_rows(q2, k, v, bounds, rows, block=16), got)
    ref = torch.empty(total, heads, d, dtype=torch.float64)
    for a, b in zip(bounds, bounds[1:]):
        if b == a:
            continue
        kk, vv = (t[a:b].double().repeat_interleave(heads // groups, dim=1).transpose(0, 1) for t in (k, v))
        ref[a:b] = F.scaled_dot_product_attention(q[a:b].double().transpose(0, 1), kk, vv, is_causal=True).transpose(
            0, 1
        )
    torch.testing.assert_close(got.double(), ref[rows], rtol=1e-5, atol=1e-6)
    with pytest.raises(InputError, match=r"argument 'rows' expected token indices in \[0, 141\)"):
        sequence_attention_rows(q, k, v, bounds, torch.tensor([0, 141]), block=16)
