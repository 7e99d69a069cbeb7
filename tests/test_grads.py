"""Tests of fnppo.megatron.grads: the global grad norm over unique parameters (TP duplicates and the tied
output embedding counted once) against an independent computation and Megatron's optimizer, with
and without the distributed optimizer; the data-parallel reduction of finalize_grads; errors."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import fnppo
from fnppo.megatron.parallel import current_layout
from fnppo.megatron.unwrap import unwrap_model
from fnppo.testing import run_ranks, synthetic_samples, tiny_model_config

VOCAB = 64
N_MB = 2
REL = 1e-5


def _cfg() -> fnppo.ModelConfig:
    return tiny_model_config(num_layers=4, vocab_size=VOCAB, tie_embeddings=True)  # pp=2 x vpp=2: a layer per chunk


def _nll(logits: torch.Tensor, mb, total_tokens: torch.Tensor) -> torch.Tensor:
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    if current_layout().tp > 1:
        logits = gather_from_tensor_model_parallel_region(logits)
    lp = torch.log_softmax(logits.float(), dim=-1).gather(-1, mb.labels.unsqueeze(-1)).squeeze(-1)
    return -(lp * mb.loss_mask).sum() / total_tokens


def _backward(ddp, mbs) -> None:
    """Megatron's schedule, forward + backward (no finalize: the config has no finalize function)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from fnppo.core.batching.collate import pad_microbatch

    total = sum(mb.loss_mask.sum() for mb in mbs)
    n = len(mbs)
    if len(ddp) > 1:  # the interleaved schedule (vpp): one shape for all micro-batches, one iterator per chunk
        longest = max(int(mb.input_ids.shape[1]) for mb in mbs)
        mbs = [pad_microbatch(mb, longest) for mb in mbs]

    def forward_step(data_iterator, model):
        mb = next(data_iterator)

        def loss_func(logits):
            loss = _nll(logits, mb, total)
            return loss * n, {"loss": loss.detach()}

        return fnppo.forward_logits(model, mb), loss_func

    get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=[iter(mbs) for _ in ddp] if len(ddp) > 1 else iter(mbs),
        model=list(ddp),
        num_microbatches=n,
        seq_length=max(int(mb.input_ids.shape[1]) for mb in mbs),
        micro_batch_size=int(mbs[0].input_ids.shape[0]),
        forward_only=False,
    )


def _setup(distributed_optimizer: bool, seed: int = 4):
    chunks = fnppo.build_gpt(_cfg())
    # larger weights than usual make the norm-weight grads a visible part of the total
    fnppo.models.layout_invariant_init(chunks, seed=seed, std=0.3)
    ddp = fnppo.wrap_ddp(chunks, use_distributed_optimizer=distributed_optimizer)
    # clip_grad > 0 makes Megatron's step compute the norm; this large it never clips
    opt = fnppo.build_optimizer(ddp, optimizer="adam", lr=1e-3, clip_grad=1e6)
    for c in ddp:
        c.zero_grad_buffer()
    opt.zero_grad()
    return ddp, opt


def _params(ddp) -> list[tuple[str, torch.nn.Parameter]]:
    return [(n, p) for c in ddp for n, p in unwrap_model(c).named_parameters()]


def _mbs(n: int = N_MB):
    samples = synthetic_samples(8, vocab_size=VOCAB, seed=21)
    return [fnppo.collate_microbatch(samples[i::n], layout="padded") for i in range(n)]


def _norm_case(distributed_optimizer: bool) -> dict:
    """DP=1 layouts: fnppo's norm vs the full gradient's norm vs Megatron's optimizer."""
    ddp, opt = _setup(distributed_optimizer)
    # Megatron's interleaved schedule run directly keeps the model config's variable_seq_lengths, whose
    # blocking shape exchange deadlocks it over gloo at num_microbatches == pp (fnppo's steps turn it off)
    _backward(ddp, _mbs(4 if current_layout().vpp else N_MB))
    stats = fnppo.finalize_grads(ddp)
    again = fnppo.models.grad_norm(ddp)  # no side effects: same value when called again
    # every local parameter once per rank: double counts TP duplicates and the tied embedding
    naive_sq = torch.tensor(
        [sum(float(p.main_grad.double().square().sum()) for _, p in _params(ddp))], dtype=torch.float64
    )
    dist.all_reduce(naive_sq)
    ok, step_norm, _ = opt.step()
    megatron_norm = float(opt.get_grad_norm())
    with torch.no_grad():  # full (1-rank) gradients, gathered like weights
        for _, p in _params(ddp):
            p.copy_(p.main_grad)
    full = fnppo.models.gather_full_weights(ddp)
    full_norm = sum(float(g.double().square().sum()) for g in full.values()) ** 0.5
    return {
        "norm": float(stats.grad_norm),
        "finite": stats.finite,
        "again": float(again),
        "ok": bool(ok),
        "step_norm": float(step_norm),
        "megatron_norm": megatron_norm,
        "full_norm": full_norm,
        "naive_norm": float(naive_sq[0]) ** 0.5,
        "dtype": stats.grad_norm.dtype,
        "ndim": stats.grad_norm.ndim,
    }


def _unwrapped_errors() -> dict:
    raw = fnppo.build_gpt(_cfg())[0]
    out = {}
    for name, fn in (("grad_norm", fnppo.models.grad_norm), ("finalize_grads", fnppo.finalize_grads)):
        try:
            fn([raw])
            out[name] = "no error"
        except Exception as err:  # noqa: BLE001 - the type and message are what is tested
            kinds = "+".join(k.__name__ for k in (fnppo.InputError, TypeError) if isinstance(err, k))
            out[name] = f"{kinds}: {err}"
    return out


def _tp_or_pp_case() -> dict:
    return {
        "distributed": _norm_case(True),
        "plain": _norm_case(False),
        "errors": _unwrapped_errors(),
        "layout": (current_layout().tp, current_layout().pp, current_layout().dp),
        "chunks": current_layout().vpp or 1,
    }


def _dp_case(distributed_optimizer: bool) -> dict:
    """DP=2, different data per rank: finalize leaves the mean of the per-rank grads."""
    lay = current_layout()
    ddp, opt = _setup(distributed_optimizer)
    _backward(ddp, [_mbs()[lay.dp_rank]])
    params = _params(ddp)
    local = [p.main_grad.detach().clone() for _, p in params]
    stats = fnppo.finalize_grads(ddp)
    # independent reference: all-gather the local grads and average them
    mean = []
    for g in local:
        parts = [torch.empty_like(g) for _ in range(lay.dp)]
        dist.all_gather(parts, g.contiguous(), group=lay.dp_group)
        mean.append(torch.stack(parts).mean(0))
    ranks_differ = any(not torch.allclose(a, b) for a, b in zip(local, mean, strict=True))
    ref_norm = sum(float(m.double().square().sum()) for m in mean) ** 0.5
    out = {"norm": float(stats.grad_norm), "ref_norm": ref_norm, "ranks_differ": ranks_differ}
    if distributed_optimizer:
        # reduce-scatter: this rank's shard of every bucket holds the mean
        where = {id(p): i for i, (_, p) in enumerate(params)}
        worst, checked = 0.0, 0
        for buffer in ddp[0].buffers:
            expected = torch.zeros_like(buffer.grad_data)
            for p, (a, b, _bucket) in buffer.param_index_map.items():
                expected[a:b] = mean[where[id(p)]].flatten()
            for bucket in buffer.buckets:
                n = bucket.grad_data.numel() // lay.dp
                lo = bucket.offset + lay.dp_rank * n
                worst = max(worst, float((buffer.grad_data[lo : lo + n] - expected[lo : lo + n]).abs().max()))
                checked += n
        out["shard_err"], out["shard_checked"] = worst, checked
    else:
        out["mean_err"] = max(float((p.main_grad - m).abs().max()) for (_, p), m in zip(params, mean, strict=True))
        out["grads"] = [p.main_grad.detach().clone() for _, p in params]
    out["scale"] = max(float(m.abs().max()) for m in mean)
    ok, step_norm, _ = opt.step()
    out["step_norm"], out["megatron_norm"] = float(step_norm), float(opt.get_grad_norm())
    return out


def _dp_both() -> dict:
    return {"distributed": _dp_case(True), "plain": _dp_case(False)}


@pytest.fixture(scope="module")
def layouts() -> dict:
    return {
        "tp2": run_ranks(_tp_or_pp_case, 2, tp=2),
        "pp2": run_ranks(_tp_or_pp_case, 2, pp=2),
        "pp2-vpp2": run_ranks(_tp_or_pp_case, 2, pp=2, vpp=2),
    }


@pytest.fixture(scope="module")
def dp_case():
    return run_ranks(_dp_both, 2)


def _close(a: float, b: float, rel: float = REL) -> bool:
    return abs(a - b) <= rel * max(abs(b), 1e-12)


@pytest.mark.parametrize("optimizer", ["distributed", "plain"])
@pytest.mark.parametrize("name", ["tp2", "pp2", "pp2-vpp2"])
def test_grad_norm_counts_unique_params_once(layouts, name, optimizer):
    results = layouts[name]
    assert results[0]["layout"] == ((2, 1, 1) if name == "tp2" else (1, 2, 1))
    assert results[0]["chunks"] == (2 if name == "pp2-vpp2" else 1)
    norms = [r[optimizer]["norm"] for r in results]
    assert _close(norms[0], norms[1]), f"{name}: ranks disagree {norms}"
    for rank, r in enumerate(results):
        c = r[optimizer]
        what = f"{name}/{optimizer} rank {rank}"
        assert c["finite"] and c["ok"] and c["norm"] > 0, what
        assert c["dtype"] == torch.float32 and c["ndim"] == 0, what
        assert _close(c["again"], c["norm"]), what
        # the norm of the gathered full gradient (every unique tensor once)
        assert _close(c["norm"], c["full_norm"]), f"{what}: {c['norm']} vs full {c['full_norm']}"
        # Megatron's optimizer agrees (returned by step() and from get_grad_norm())
        assert _close(c["norm"], c["step_norm"]) and _close(c["norm"], c["megatron_norm"]), what
        # the test can tell: counting every local tensor gives a clearly larger norm
        assert c["naive_norm"] > c["norm"] * (1 + 1e-3), what


def test_grad_norm_is_layout_independent(layouts):
    # same full weights, same data: the same gradient, whatever the layout and optimizer
    norms = {(name, opt): layouts[name][0][opt]["norm"] for name in layouts for opt in ("distributed", "plain")}
    ref = norms[("tp2", "plain")]
    assert all(_close(v, ref) for v in norms.values()), norms


@pytest.mark.parametrize("optimizer", ["distributed", "plain"])
def test_finalize_grads_reduces_over_data_parallel(dp_case, optimizer):
    for rank, r in enumerate(dp_case):
        c = r[optimizer]
        what = f"dp2/{optimizer} rank {rank}"
        assert c["ranks_differ"], f"{what}: the ranks' local grads should differ (different data)"
        if optimizer == "plain":
            assert c["mean_err"] <= 1e-6 * c["scale"], what
        else:
            assert c["shard_checked"] > 0 and c["shard_err"] <= 1e-6 * c["scale"], what
        assert _close(c["norm"], c["ref_norm"]), f"{what}: {c['norm']} vs {c['ref_norm']}"
        assert _close(c["norm"], c["step_norm"]) and _close(c["norm"], c["megatron_norm"]), what
    if optimizer == "plain":  # both ranks hold the same reduced gradient
        for a, b in zip(dp_case[0]["plain"]["grads"], dp_case[1]["plain"]["grads"], strict=True):
            assert torch.equal(a, b)


def test_grad_norm_rejects_chunks_without_ddp(layouts):
    """An InputError (the documented type) that is still a TypeError (what it was before)."""
    results = layouts["tp2"]
    msg = results[0]["errors"]["grad_norm"]
    assert msg.startswith(
        "InputError+TypeError: grad_norm: argument 'model_chunks' expected Megatron DistributedDataParallel"
    ), msg
    assert "received GPTModel" in msg


def test_finalize_grads_rejects_chunks_without_ddp(layouts):
    results = layouts["tp2"]
    msg = results[0]["errors"]["finalize_grads"]
    assert msg.startswith("InputError+TypeError: finalize_grads: argument 'model_chunks' expected"), msg
    assert "received GPTModel" in msg
