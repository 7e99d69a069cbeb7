"""Tests of fnppo.megatron.parallel and fnppo.testing: argument validation, the N-rank launcher, the CPU
redirection, and a tiny GPTModel forward/backward through Megatron's own schedule on 1 rank and on
2 ranks (TP=2, PP=2, DP=2), which must all give the loss and gradients of plain autograd on one
process with the same full weights.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import fnppo
from fnppo.megatron.parallel import current_layout, init_parallel
from fnppo.megatron.unwrap import unwrap_model
from fnppo.testing import RankError, megatron_on_cpu, run_ranks, synthetic_samples, tiny_model_config

VOCAB = 64
N_MB = 2


def _cfg() -> fnppo.ModelConfig:
    return tiny_model_config(vocab_size=VOCAB, tie_embeddings=True)


def _microbatches() -> list:
    samples = synthetic_samples(8, vocab_size=VOCAB, seed=11)
    return [fnppo.collate_microbatch(samples[i::N_MB], layout="padded") for i in range(N_MB)]


def _nll(logits: torch.Tensor, mb, total_tokens: torch.Tensor) -> torch.Tensor:
    """Token-mean negative log-likelihood of the labels, from full-vocab logits (gathered over TP)."""
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    if current_layout().tp > 1:
        logits = gather_from_tensor_model_parallel_region(logits)
    lp = torch.log_softmax(logits.float(), dim=-1).gather(-1, mb.labels.unsqueeze(-1)).squeeze(-1)
    return -(lp * mb.loss_mask).sum() / total_tokens


def _layout_fields() -> dict:
    lay = current_layout()
    return {
        "world_size": lay.world_size,
        "rank": lay.rank,
        "tp": lay.tp,
        "pp": lay.pp,
        "dp": lay.dp,
        "vpp": lay.vpp,
        "tp_rank": lay.tp_rank,
        "pp_rank": lay.pp_rank,
        "dp_rank": lay.dp_rank,
        "backend": lay.backend,
        "first": lay.is_first_stage,
        "last": lay.is_last_stage,
        "group_sizes": tuple(dist.get_world_size(g) for g in (lay.tp_group, lay.pp_group, lay.dp_group)),
    }


def _reference() -> dict:
    """Plain autograd on one process, no DDP and no schedule: the reference loss and grads."""
    (model,) = fnppo.build_gpt(_cfg())
    fnppo.models.layout_invariant_init([model], seed=4)
    mbs = _microbatches()
    total = sum(mb.loss_mask.sum() for mb in mbs)
    loss = sum(_nll(fnppo.forward_logits(model, mb), mb, total) for mb in mbs)
    loss.backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters()}
    return {"loss": float(loss), "grads": grads}


def _schedule_fwd_bwd() -> dict:
    """Forward/backward through ``get_forward_backward_func`` on this layout; full grads after finalize.

    With DP > 1 every data-parallel rank gets its own micro-batch(es); the loss is multiplied by the
    DP size to cancel DDP's mean over DP ranks, so the reduced gradient is the full-batch gradient.
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func

    lay = current_layout()
    chunks = fnppo.build_gpt(_cfg())
    fnppo.models.layout_invariant_init(chunks, seed=4)
    ddp = fnppo.wrap_ddp(chunks, use_distributed_optimizer=False)
    mbs = _microbatches()
    total = sum(mb.loss_mask.sum() for mb in mbs)
    mine = mbs[lay.dp_rank :: lay.dp]
    n = len(mine)

    def forward_step(data_iterator, model):
        mb = next(data_iterator)
        out = fnppo.forward_logits(model, mb)

        def loss_func(logits):
            loss = _nll(logits, mb, total)
            # Megatron divides each micro-batch loss by num_microbatches; DDP averages over DP.
            return loss * (n * lay.dp), {"loss": loss.detach()}

        return out, loss_func

    store = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter(mine),
        model=ddp,
        num_microbatches=n,
        seq_length=max(int(mb.input_ids.shape[1]) for mb in mine),
        micro_batch_size=int(mine[0].input_ids.shape[0]),
        forward_only=False,
    )
    # The loss lives on the last stage of every (DP, TP) rank: count one TP rank, sum over DP.
    counted = store and lay.tp_rank == 0
    loss = torch.tensor([float(sum(s["loss"] for s in store)) if counted else 0.0], dtype=torch.float64)
    dist.all_reduce(loss)
    local_finite = all(bool(torch.isfinite(p.main_grad).all()) for c in ddp for p in unwrap_model(c).parameters())
    stats = fnppo.finalize_grads(ddp)
    with torch.no_grad():  # put the grads where the weights were, then reuse the weight gather
        for c in ddp:
            for p in unwrap_model(c).parameters():
                p.copy_(p.main_grad)
    grads = fnppo.models.gather_full_weights(ddp)
    return {
        "layout": _layout_fields(),
        "loss": float(loss),
        "grads": grads,
        "finite": local_finite,
        "grad_norm": float(stats.grad_norm),
        "schedule": get_forward_backward_func().__name__,
    }


def _dp_checks() -> dict:
    """DP=2: the schedule result, plus init_parallel's divisibility error leaving the state intact."""
    out = _schedule_fwd_bwd()
    try:
        init_parallel(tp=3)
        out["indivisible"] = "no error"
    except ValueError as err:
        out["indivisible"] = str(err)
    out["layout_after_error"] = _layout_fields()
    return out


def _reference_and_single() -> dict:
    return {"ref": _reference(), "single": _schedule_fwd_bwd()}


@pytest.fixture(scope="module")
def reference() -> dict:
    return run_ranks(_reference_and_single, 1)[0]


def _assert_matches(ref: dict, got: dict, what: str) -> None:
    assert got["finite"], what
    assert abs(got["loss"] - ref["loss"]) <= 1e-5 * abs(ref["loss"]), f"{what}: loss {got['loss']} vs {ref['loss']}"
    assert set(got["grads"]) == set(ref["grads"]), what
    sq = 0.0
    for name, g_ref in ref["grads"].items():
        g = got["grads"][name]
        assert g.shape == g_ref.shape, f"{what}: {name}"
        scale = float(g_ref.abs().max())
        assert scale > 0, f"{what}: reference grad of {name} is zero"
        err = float((g - g_ref).abs().max())
        assert err <= 1e-4 * scale, f"{what}: grad of {name} differs by {err:.3e} (max |g| {scale:.3e})"
        sq += float(g_ref.double().square().sum())
    # fnppo's grad norm over unique params equals the norm of the full (1-rank) gradient
    assert abs(got["grad_norm"] - sq**0.5) <= 1e-5 * sq**0.5, what


# ---------------------------------------------------------------------------------------------
# init_parallel validation (raises before touching torch.distributed)
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs,arg,expected,received",
    [
        ({"tp": 0}, "tp", "an int >= 1", "0"),
        ({"tp": -2}, "tp", "an int >= 1", "-2"),
        ({"tp": 1.5}, "tp", "an int >= 1", "1.5"),
        ({"pp": 0}, "pp", "an int >= 1", "0"),
        ({"vpp": 2}, "vpp", "None or >= 1 with pp >= 2", "vpp=2, pp=1"),
        ({"pp": 2, "vpp": 0}, "vpp", "None or >= 1 with pp >= 2", "vpp=0, pp=2"),
        ({"ep": 0}, "ep", "an int >= 1", "0"),
        ({"etp": 0}, "etp", "an int >= 1", "0"),
    ],
)
def test_init_parallel_rejects_bad_sizes(kwargs, arg, expected, received):
    was_initialized = dist.is_initialized()
    with pytest.raises(ValueError) as info:
        init_parallel(**kwargs)
    assert str(info.value) == f"init_parallel: argument '{arg}' expected {expected}, received {received}"
    assert dist.is_initialized() == was_initialized  # nothing was set up


# ---------------------------------------------------------------------------------------------
# megatron_on_cpu
# ---------------------------------------------------------------------------------------------
_PATCHED = (
    "current_device",
    "synchronize",
    "get_rng_state",
    "set_rng_state",
    "manual_seed",
    "Stream",
    "current_stream",
    "stream",
)


def test_megatron_on_cpu_redirects_and_restores():
    from megatron.core.tensor_parallel import mappings
    from megatron.core.tensor_parallel import random as mrandom

    before = {n: getattr(torch.cuda, n) for n in _PATCHED}
    a2a_backward = mappings._AllToAll.__dict__["backward"]
    before_m = (mrandom._get_cuda_rng_state, mrandom._set_cuda_rng_state)
    with megatron_on_cpu():
        assert torch.cuda.current_device() == 0
        x = torch.zeros(3, device="cuda")
        assert x.device.type == "cpu"
        assert x.cuda() is x
        assert x.type() == "torch.cuda.FloatTensor"
        assert torch.ones(2).to("cuda").device.type == "cpu"
        state = torch.cuda.get_rng_state()
        a = torch.rand(4)
        torch.cuda.set_rng_state(state)
        assert torch.equal(torch.rand(4), a)  # the "CUDA" RNG is the CPU generator
        assert all(getattr(torch.cuda, n) is not before[n] for n in _PATCHED)
        # MoE dispatchers: one no-op stream; the expert all-to-all's backward allocates on the CPU
        assert torch.cuda.current_stream() == torch.cuda.Stream()
        with torch.cuda.stream(torch.cuda.Stream()):
            torch.cuda.current_stream().record_event().synchronize()
        assert mappings._AllToAll.__dict__["backward"] is not a2a_backward
    assert {n: getattr(torch.cuda, n) for n in _PATCHED} == before
    assert mappings._AllToAll.__dict__["backward"] is a2a_backward
    assert (mrandom._get_cuda_rng_state, mrandom._set_cuda_rng_state) == before_m
    assert torch.zeros(1).type() == "torch.FloatTensor"
    if not torch.cuda.is_available():
        with pytest.raises((RuntimeError, AssertionError)):
            torch.zeros(1, device="cuda")


def test_megatron_on_cpu_restores_after_an_exception():
    before = {n: getattr(torch.cuda, n) for n in _PATCHED}
    with pytest.raises(KeyError):
        with megatron_on_cpu():
            raise KeyError("inside")
    assert {n: getattr(torch.cuda, n) for n in _PATCHED} == before
    assert torch.zeros(1).type() == "torch.FloatTensor"


# ---------------------------------------------------------------------------------------------
# run_ranks error path
# ---------------------------------------------------------------------------------------------
def _fail_on_rank_one(pid_dir: str) -> None:
    pid_file = Path(pid_dir, "rank0.pid")
    if dist.get_rank() == 0:
        pid_file.write_text(str(os.getpid()))
        time.sleep(600)  # never returns: run_ranks must kill it
        return
    deadline = time.monotonic() + 60
    while not pid_file.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    raise ValueError("deliberate failure on rank one")


def test_run_ranks_reraises_with_remote_traceback_and_kills_the_others(tmp_path):
    start = time.monotonic()
    with pytest.raises(RankError) as info:
        run_ranks(_fail_on_rank_one, 2, str(tmp_path), timeout_s=120)
    elapsed = time.monotonic() - start
    msg = str(info.value)
    assert "rank 1 of 2" in msg
    assert "Traceback" in msg and "_fail_on_rank_one" in msg
    assert "ValueError: deliberate failure on rank one" in msg
    assert elapsed < 60, f"run_ranks took {elapsed:.1f}s to report a failing rank"
    pid = int((tmp_path / "rank0.pid").read_text())
    with pytest.raises(ProcessLookupError):  # the sleeping rank 0 was killed (and reaped)
        os.kill(pid, 0)


# ---------------------------------------------------------------------------------------------
# forward/backward through Megatron's get_forward_backward_func
# ---------------------------------------------------------------------------------------------
def test_one_rank_schedule_matches_plain_autograd(reference):
    single = reference["single"]
    assert single["schedule"] == "forward_backward_no_pipelining"
    lay = single["layout"]
    assert (lay["world_size"], lay["tp"], lay["pp"], lay["dp"], lay["vpp"]) == (1, 1, 1, 1, None)
    assert lay["first"] and lay["last"] and lay["backend"] == "gloo"
    _assert_matches(reference["ref"], single, "1 rank")
    assert max(float(g.abs().max()) for g in single["grads"].values()) > 0


def test_tp2_schedule_matches_single_process(reference):
    results = run_ranks(_schedule_fwd_bwd, 2, tp=2)
    assert [r["layout"]["rank"] for r in results] == [0, 1]  # rank order
    for rank, r in enumerate(results):
        lay = r["layout"]
        assert (lay["tp"], lay["pp"], lay["dp"], lay["vpp"]) == (2, 1, 1, None)
        assert (lay["tp_rank"], lay["pp_rank"], lay["dp_rank"]) == (rank, 0, 0)
        assert lay["group_sizes"] == (2, 1, 1)
        assert lay["first"] and lay["last"]
        _assert_matches(reference["ref"], r, f"tp2 rank {rank}")


def test_pp2_schedule_matches_single_process(reference):
    results = run_ranks(_schedule_fwd_bwd, 2, pp=2)
    assert results[0]["schedule"] == "forward_backward_pipelining_without_interleaving"
    for rank, r in enumerate(results):
        lay = r["layout"]
        assert lay["rank"] == rank
        assert (lay["tp"], lay["pp"], lay["dp"]) == (1, 2, 1)
        assert (lay["tp_rank"], lay["pp_rank"], lay["dp_rank"]) == (0, rank, 0)
        assert lay["group_sizes"] == (1, 2, 1)
        assert (lay["first"], lay["last"]) == (rank == 0, rank == 1)
        _assert_matches(reference["ref"], r, f"pp2 rank {rank}")


def test_dp2_schedule_reduces_to_the_full_batch_gradient(reference):
    results = run_ranks(_dp_checks, 2)
    for rank, r in enumerate(results):
        lay = r["layout"]
        assert (lay["tp"], lay["pp"], lay["dp"]) == (1, 1, 2)
        assert (lay["tp_rank"], lay["pp_rank"], lay["dp_rank"]) == (0, 0, rank)
        assert lay["group_sizes"] == (1, 1, 2)
        _assert_matches(reference["ref"], r, f"dp2 rank {rank}")
        assert "init_parallel" in r["indivisible"] and "world size 2" in r["indivisible"]
        assert "tp*pp = 3*1" in r["indivisible"]
        assert r["layout_after_error"] == lay  # a rejected call leaves Megatron's state alone


# ---------------------------------------------------------------------------------------------
# CPU without ceremony: init_parallel sets up Megatron-on-CPU by itself
# ---------------------------------------------------------------------------------------------
_AUTO_CPU = r"""
import torch, fnppo
from fnppo.megatron.runtime import cpu_mode_active
assert not cpu_mode_active()
layout = fnppo.init_parallel()                       # no megatron_on_cpu() block around it
assert cpu_mode_active() and layout.backend == "gloo"
chunks = fnppo.build_gpt(fnppo.ModelConfig(num_layers=1, hidden_size=16, num_attention_heads=2,
                                           ffn_hidden_size=32, vocab_size=8, max_seq_len=8))
lp, _ = fnppo.compute_logprobs(chunks, [fnppo.Sample.from_lists([1, 2], [3, 4])])
assert lp[0].shape == (2,) and bool(torch.isfinite(lp[0]).all())
fnppo.megatron.parallel.destroy_parallel()
assert not cpu_mode_active()                         # destroy_parallel leaves the CPU mode
with fnppo.testing.megatron_on_cpu():                # explicit use still works, and nests
    fnppo.init_parallel()
    fnppo.megatron.parallel.destroy_parallel()
    assert cpu_mode_active()
assert not cpu_mode_active()
print("ok")
"""


def test_init_parallel_sets_up_megatron_on_cpu_by_itself():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _AUTO_CPU], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-4000:]
    assert "Warning" not in out.stderr, out.stderr[-3000:]


def test_init_parallel_refuses_cuda_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(
        ValueError,
        match=r"init_parallel: argument 'device' expected 'cpu' or None on this machine \(torch.cuda.is_available\(\) is False\), received 'cuda'",
    ):
        fnppo.init_parallel(device="cuda")


def test_harmless_warning_filters_are_installed_and_can_be_shown():
    import subprocess
    import sys

    code = (
        "import warnings, fnppo\n"
        "warnings.warn_explicit('Apex is not installed. Falling back to Torch Norm', UserWarning, 'x.py', 1, module='megatron.core.models.backends')\n"
        "warnings.warn_explicit('something else', UserWarning, 'x.py', 2, module='megatron.core.models.backends')\n"
        # the distributed optimizer's read of its shard views' .grad, as attributed on a GPU; the same
        # message from anywhere else still shows
        "leaf = 'The .grad attribute of a Tensor that is not a leaf Tensor is being accessed.'\n"
        "warnings.warn_explicit(leaf, UserWarning, 'o.py', 3, module='megatron.core.optimizer.optimizer')\n"
        "warnings.warn_explicit(leaf + ' (elsewhere)', UserWarning, 'y.py', 4, module='mypackage.train')\n"
    )
    quiet = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "Apex is not installed" not in quiet.stderr and "something else" in quiet.stderr, quiet.stderr
    assert "o.py" not in quiet.stderr and "(elsewhere)" in quiet.stderr, quiet.stderr
    loud = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={**__import__("os").environ, "FNPPO_SHOW_WARNINGS": "1"},
    )
    assert "Apex is not installed" in loud.stderr, loud.stderr


# ---------------------------------------------------------------------------------------------
# run_ranks reuses its rank processes: each call starts from the same state
# ---------------------------------------------------------------------------------------------
def _what_a_call_sees(fail: bool = False) -> dict:
    """What this rank sees on entry, then changes everything a call may change (and the next must not see)."""
    seen = {
        "pid": os.getpid(),
        "env": os.environ.get("FNPPO_TEST_LEAK"),
        "dtype": torch.get_default_dtype(),
        "checking": fnppo.core.typing.typechecking_enabled(),
        "world": dist.get_world_size(),
        "tp": current_layout().tp,
        "draw": float(torch.rand(())),
    }
    os.environ["FNPPO_TEST_LEAK"] = "set by an earlier call"
    torch.set_default_dtype(torch.float64)
    fnppo.typing.set_typechecking(False)
    if fail and dist.get_rank() == 1:
        raise RuntimeError("planted failure")
    return seen


def _leave_threads(n: int) -> int:
    """Start ``n`` threads that outlive the call (as the gloo threads of a leaked process group do)."""
    import threading

    stop = threading.Event()
    for _ in range(n):
        threading.Thread(target=stop.wait, daemon=True).start()
    return os.getpid()


def test_run_ranks_replaces_a_rank_that_kept_too_many_threads():
    first = run_ranks(_leave_threads, 1, 4)
    assert run_ranks(_leave_threads, 1, 0) == first  # a few threads: reused
    many = run_ranks(_leave_threads, 1, 200)
    assert many == first
    assert run_ranks(_leave_threads, 1, 0) != many  # replaced after the call that left 200 threads


def test_run_ranks_reuses_its_processes_and_each_call_starts_clean():
    first = run_ranks(_what_a_call_sees, 2)
    second = run_ranks(_what_a_call_sees, 2, tp=2)  # another layout in the same processes
    assert [r["pid"] for r in second] == [r["pid"] for r in first]  # reused
    for r in second:
        assert r["env"] is None and r["dtype"] == torch.float32 and r["checking"] is True, r
        assert r["world"] == 2 and r["tp"] == 2, r
    assert [r["draw"] for r in second] == [r["draw"] for r in first]  # torch's generator seeded per call
    with pytest.raises(RankError, match="planted failure"):
        run_ranks(_what_a_call_sees, 2, fail=True)
    after = run_ranks(_what_a_call_sees, 2)  # a failed call ends the processes: new ones take the next
    assert not {r["pid"] for r in after} & {r["pid"] for r in first}
    assert all(r["env"] is None for r in after)
    fresh = run_ranks(_what_a_call_sees, 2, fresh=True)
    assert not {r["pid"] for r in fresh} & {r["pid"] for r in after}
    assert [r["pid"] for r in run_ranks(_what_a_call_sees, 2)] == [r["pid"] for r in after]  # the pool stayed
