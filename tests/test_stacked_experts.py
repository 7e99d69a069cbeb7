"""Stacked MoE experts (``ModelConfig(moe_experts="stacked")``) and the grouped matmul under them.

The grouped matmul is checked against a float64 loop of plain matrix products; the stacked experts
against Megatron's own ``SequentialMLP`` (same full weights, one training step: loss, gradient norm,
updated weights) in one process and under expert and tensor parallelism, and through a Hugging Face
export and reload.
"""

from __future__ import annotations

import pytest
import torch

import fnppo
from fnppo.core.errors import InputError
from fnppo.core.ops.grouped_matmul import grouped_matmul
from fnppo.losses import Aggregation, LossConfig, ppo_clip
from fnppo.testing import run_ranks, synthetic_samples, tiny_model_config


def _groups(counts: list[int]) -> torch.Tensor:
    return torch.cumsum(torch.tensor(counts), 0).to(torch.int32)


def _reference(x: torch.Tensor, w: torch.Tensor, counts: list[int]) -> torch.Tensor:
    parts, start = [], 0
    for g, c in enumerate(counts):
        parts.append(x[start : start + c].double() @ w[g].double().T)
        start += c
    return torch.cat(parts)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float64, 1e-12), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("counts", [[3, 0, 5, 4], [0, 0, 12, 0], [1, 2, 3, 6]])
def test_grouped_matmul_and_its_gradients_match_a_float64_loop(dtype, tol, counts):
    g = torch.Generator().manual_seed(sum(counts) + len(counts))
    rows, k, n = sum(counts), 16, 24
    x = torch.randn(rows, k, generator=g).to(dtype).requires_grad_()
    w = torch.randn(len(counts), n, k, generator=g).to(dtype).requires_grad_()
    dy = torch.randn(rows, n, generator=g).to(dtype)
    y = grouped_matmul(x, w, _groups(counts))
    y.backward(dy)
    xd, wd = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    ref = _reference(xd, wd, counts)
    ref.backward(dy.double())
    scale = max(1.0, float(ref.detach().abs().max()))
    assert float((y.double() - ref).abs().max()) <= tol * scale
    assert float((x.grad.double() - xd.grad).abs().max()) <= tol * scale
    assert float((w.grad.double() - wd.grad).abs().max()) <= tol * scale
    for e, c in enumerate(counts):  # an expert without rows gets an exact zero gradient
        if c == 0:
            assert torch.equal(w.grad[e], torch.zeros_like(w.grad[e]))


@pytest.mark.parametrize("parts", [1, 2, 3])
def test_block_diagonal_parts_is_one_product_for_every_part(parts):
    """The gated fc1 adapter's ``B`` as one block-diagonal matrix: ``z @ B_bd^T`` equals each part's
    own ``z_p @ B_p^T`` side by side (float64 reference per expert with ``torch.block_diag``)."""
    from fnppo.megatron.stacked_experts import _block_diagonal_parts

    g = torch.Generator().manual_seed(parts)
    e, n, r = 3, 5, 2
    b = torch.randn(e, parts * n, r, generator=g, dtype=torch.float64)
    z = torch.randn(e, 4, parts * r, generator=g, dtype=torch.float64)
    got = torch.einsum("etk,enk->etn", z, _block_diagonal_parts(b, parts))
    ref = torch.stack([z[i] @ torch.block_diag(*b[i].chunk(parts, 0)).T for i in range(e)])
    assert got.shape == (e, 4, parts * n)
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-12)


def test_default_experts_module_follows_fp8_the_mode_and_the_device():
    from fnppo.megatron.config import InvariantKernels
    from fnppo.megatron.layer_specs import default_experts
    from fnppo.megatron.numerics import invariant_experts

    for fp8 in (False, True):
        for cuda in (False, True):
            want = "te_grouped" if fp8 else "stacked" if cuda else "sequential"
            assert default_experts(fp8=fp8, cuda=cuda) == want, (fp8, cuda)
    # in the mode: the grouped GEMM only with the fast kernels
    for kernels in (InvariantKernels.FAST, InvariantKernels.TORCH, InvariantKernels.MEGATRON):
        want = "stacked" if kernels is InvariantKernels.FAST else "sequential"
        assert invariant_experts(kernels) == want, kernels.name


def test_grouped_matmul_refuses_mixed_dtypes():
    with pytest.raises(InputError, match="argument 'weight' expected a torch.float32 tensor"):
        grouped_matmul(torch.zeros(2, 4), torch.zeros(1, 4, 4, dtype=torch.float64), _groups([2]))


def _cfg(**kw) -> fnppo.ModelConfig:
    # z-loss: a token mean over the step, the same however the batch is split
    return tiny_model_config(moe=True, **{"moe_z_loss_coeff": 0.01, **kw})


SP = dict(extra=dict(sequence_parallel=True))


def _step(experts: str, full: dict | None, overrides: dict) -> dict:
    layout = fnppo.parallel.current_layout()
    cfg = _cfg(moe_experts=experts, **overrides)
    chunks = fnppo.build_gpt(cfg)
    if full is None:
        fnppo.models.layout_invariant_init(chunks, seed=3, std=0.2)
        full = fnppo.models.gather_full_weights(chunks)
    else:
        fnppo.models.load_full_weights(chunks, full)
    kinds = sorted({type(m).__name__ for m in chunks[0].modules() if type(m).__name__.endswith(("MLP", "Experts"))})
    ddp = fnppo.wrap_ddp(chunks, use_distributed_optimizer=True)
    opt = fnppo.build_optimizer(ddp, lr=10.0, adam_eps=10.0, clip_grad=0.0)  # about SGD: differences stay visible
    state = fnppo.TrainState(model=ddp, optimizer=opt)
    loss = LossConfig(policy=ppo_clip(), agg=Aggregation("token-mean"))
    samples = fnppo.shard_for_data_parallel(synthetic_samples(8, seed=5), layout)
    state, metrics = fnppo.train_step(
        state, samples, fnppo.StepConfig(loss=loss, num_microbatches=1, pad_to_multiple_of=2)
    )
    out = {"metrics": metrics, "weights": fnppo.models.gather_full_weights(state.model), "full": full, "kinds": kinds}
    out["params"] = [n for n, _ in fnppo.models.unwrap_model(chunks[0]).named_parameters() if "experts" in n]
    return out if layout.rank == 0 else {}


def _one_process() -> dict:
    seq = _step("sequential", None, {})
    return {"sequential": seq, "stacked": _step("stacked", seq["full"], {})}


@pytest.fixture(scope="module")
def one_process():
    return run_ranks(_one_process, 1)[0]


def _assert_same_step(ref: dict, got: dict, what: str) -> None:
    for key in ("loss", "grad_norm", "moe_z_loss"):
        r, g = ref["metrics"][key], got["metrics"][key]
        assert abs(g - r) <= 1e-5 * max(abs(r), 1e-6), f"{what}: {key} {g} vs {r}"
    assert set(ref["weights"]) == set(got["weights"]), what
    for name, w in ref["weights"].items():
        err = float((got["weights"][name] - w).abs().max())
        assert err <= 1e-5 * float(w.abs().max().clamp_min(1e-6)), f"{what}: {name} differs by {err:.2e}"


def test_stacked_experts_train_like_megatrons_sequential_mlp(one_process):
    seq, st = one_process["sequential"], one_process["stacked"]
    assert seq["kinds"] == ["MLP", "SequentialMLP"] and st["kinds"] == ["StackedExperts"]
    # two parameters per MoE layer instead of two per expert
    assert sorted(st["params"]) == [f"decoder.layers.{i}.mlp.experts.weight{j}" for i in (0, 1) for j in (1, 2)]
    assert len(seq["params"]) == 2 * 2 * 4
    moved = max(float((st["weights"][k] - v).abs().max()) for k, v in st["full"].items())
    assert moved > 1e-4  # the step changed the weights, so the comparison below means something
    _assert_same_step(seq, st, "stacked vs sequential, one process")


LAYOUTS = {"ep2": (2, dict(ep=2)), "tp2-etp2": (2, dict(tp=2)), "ep2-pp2": (4, dict(ep=2, pp=2))}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_stacked_experts_under_expert_and_tensor_parallelism(one_process, name):
    world, kw = LAYOUTS[name]
    overrides = SP if kw.get("tp", 1) > 1 else {}
    got = run_ranks(_step, world, "stacked", one_process["sequential"]["full"], overrides, **kw)[0]
    _assert_same_step(one_process["sequential"], got, name)


def _refusals() -> dict:
    from fnppo.megatron.megatron_config import transformer_config

    out = {}
    for label, kw in {
        "fp8 on cpu": dict(fp8="e4m3", dtype="bf16"),
        "te_grouped without TE": dict(num_experts=4, moe_experts="te_grouped"),
        "stacked with fp8": dict(num_experts=4, moe_experts="stacked", fp8="e4m3", dtype="bf16"),
        "stacked batch-invariant": dict(num_experts=4, moe_experts="stacked", batch_invariant=True, deterministic=True),
    }.items():
        try:
            transformer_config(_cfg(**{"num_experts": None, **kw}))
            out[label] = "accepted"
        except InputError as err:
            out[label] = str(err)
    return out


def test_fp8_and_expert_modules_are_refused_clearly_where_they_cannot_run():
    got = run_ranks(_refusals, 1)[0]
    assert got["fp8 on cpu"] == (
        "transformer_config: argument 'fp8' expected None on CPU (FP8 GEMMs need a CUDA GPU, Hopper or newer), "
        "received 'e4m3'"
    )
    assert (
        "argument 'moe_experts' expected 'stacked' or 'sequential' (Transformer Engine is not installed)"
        in (got["te_grouped without TE"])
    )
    assert (
        "argument 'moe_experts' expected 'te_grouped' (or None) with fp8 set, received 'stacked'"
        in (got["stacked with fp8"])
    )
    assert (
        "argument 'moe_experts' expected 'sequential' or None with batch_invariant and the 'torch' kernels"
        in (got["stacked batch-invariant"])
    )
    for kw, arg in (
        (dict(fp8="e4m3", dtype="bf16", batch_invariant=True), "fp8"),
        (dict(fp8="e5m2"), "fp8"),
        (dict(fp8="e4m3", fp8_recipe="mx", dtype="bf16"), "fp8_recipe"),
        (dict(fp8="e4m3", dtype="fp32"), "dtype"),
        (dict(moe_experts="grouped"), "moe_experts"),
    ):
        with pytest.raises(InputError, match=f"ModelConfig: argument '{arg}' expected"):
            _cfg(**kw)
