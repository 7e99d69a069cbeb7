"""Faults: non-finite steps, a rank failing inside the schedule, checkpoints, determinism.

Everything runs real Megatron on CPU (gloo ranks through :func:`fnppo.testing.run_ranks`). Each
``run_ranks`` call checks several things and returns a dict; the tests below read the dicts.

* A non-finite gradient in one micro-batch skips the optimizer step, leaves parameters and
  optimizer state bit-identical, is reported in the metrics, and the next good step proceeds (the
  NaN-*loss* case is ``tests/test_step.py::test_non_finite_step_is_skipped_and_state_untouched``).
* A rank that raises inside Megatron's schedule: its error reaches the caller unchanged, and a
  rank left waiting in a collective raises after the documented timeout instead of hanging.
* Checkpoints: resume is bit-identical (model, optimizer, RNG, step, data order) with one rank and
  with DP=2 (the distributed optimizer's per-rank shards); the data of every step draws from every
  generator a checkpoint restores (torch's, Python's, NumPy's; dropout draws from Megatron's
  trackers), and a save / draw / load / draw round trip gives the same draws from each of them (CUDA's
  too on a GPU machine). A missing directory, an interrupted save, a missing manifest, a truncated
  or altered file and another model shape are refused in the standard message format (the shape
  refusal names the first differing parameter and both shapes) and load nothing; a DP=2 checkpoint
  loads under TP=2. A full disk (on one rank of two, or the only one) and a crash before the final
  rename fail on every rank and leave nothing behind; incomplete checkpoints are reported and
  skipped by ``latest_checkpoint``, a damaged newest one is refused unless ``fallback=True``.
* Determinism: two runs with the same seed and layout give bit-identical metrics and weights.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
import struct
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

import fnppo
from fnppo.megatron.unwrap import unwrap_model
from fnppo.testing import RankError, run_ranks, synthetic_samples, tiny_model_config

N_STEPS = 4  # uninterrupted run length
SAVE_AT = 2  # the interrupted run saves here, a fresh process state resumes from it
GLOBAL_BATCH = 8
FAIL_TIMEOUT_S = 6.0  # init_parallel(timeout_s=...) for the fail-fast test


# ---------------------------------------------------------------------------------------------
# helpers (run inside the ranks)
# ---------------------------------------------------------------------------------------------
def _model_cfg(hidden: int = 32, dropout: float = 0.0) -> fnppo.ModelConfig:
    return tiny_model_config(hidden_size=hidden, hidden_dropout=dropout, attention_dropout=dropout)


def _build(init_seed: int = 3, hidden: int = 32, dropout: float = 0.0, lr: float = 1e-2) -> fnppo.TrainState:
    chunks = fnppo.build_gpt(_model_cfg(hidden, dropout))
    fnppo.models.layout_invariant_init(chunks, seed=init_seed)
    ddp = fnppo.wrap_ddp(chunks, use_distributed_optimizer=True)
    return fnppo.TrainState(model=ddp, optimizer=fnppo.build_optimizer(ddp, lr=lr, clip_grad=1.0))


def _seed_everything(seed: int) -> None:
    """What a fresh process does: every RNG (torch, Python, NumPy, Megatron's trackers) from ``seed``."""
    from megatron.core import tensor_parallel

    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def _step_cfg(**kw) -> fnppo.StepConfig:
    loss = fnppo.losses.from_flat(entropy_coeff=0.01, kl_coef=0.05)
    return fnppo.StepConfig(loss=loss, **kw)


def _clone_tree(x):
    if isinstance(x, torch.Tensor):
        return x.detach().clone()
    if isinstance(x, dict):
        return {k: _clone_tree(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_clone_tree(v) for v in x)
    return x


def _bit_diff(a, b, path: str = "") -> list[str]:
    """Paths where two nested structures differ; tensors are compared byte for byte (dtype too)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return [path]
        if a.dtype != b.dtype or a.shape != b.shape:
            return [path]
        ab = a.detach().contiguous().reshape(-1).view(torch.uint8)
        bb = b.detach().contiguous().reshape(-1).view(torch.uint8)
        return [] if torch.equal(ab, bb) else [path]
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            return [f"{path}{{keys}}"]
        return [d for k in a for d in _bit_diff(a[k], b[k], f"{path}.{k}")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return [f"{path}[len]"]
        return [d for i, (x, y) in enumerate(zip(a, b, strict=True)) for d in _bit_diff(x, y, f"{path}[{i}]")]
    if isinstance(a, float) and isinstance(b, float):
        return [] if struct.pack("<d", a) == struct.pack("<d", b) else [path]
    return [] if a == b else [path]


def _params(state: fnppo.TrainState) -> dict[str, torch.Tensor]:
    return {
        f"{i}.{k}": v.detach().clone() for i, c in enumerate(state.model) for k, v in unwrap_model(c).named_parameters()
    }


def _opt_state(state: fnppo.TrainState):
    """Everything a checkpoint keeps of the optimizer: its state dict and this rank's shard of the
    distributed optimizer's parameter state (main parameters, Adam moments)."""
    opt = state.optimizer
    subs = list(getattr(opt, "chained_optimizers", None) or [opt])
    shards = [
        s.get_parameter_state_dp_reshardable() if hasattr(s, "get_parameter_state_dp_reshardable") else None
        for s in subs
    ]
    return _clone_tree({"state_dict": opt.state_dict(), "param_state": shards})


def _snapshot(state: fnppo.TrainState) -> dict:
    return {"params": _params(state), "opt": _opt_state(state), "step": state.step}


def _batch(data_rng: torch.Generator) -> list[fnppo.Sample]:
    """This DP rank's share of a global batch whose content comes from ``data_rng`` and from the global
    generators of torch, Python and NumPy, and whose order comes from Python's (each must be restored
    on resume, or the resumed steps train on other data)."""
    seed = int(torch.randint(0, 2**29, (), generator=data_rng)) + int(torch.randint(0, 2**29, ()))
    seed += random.randrange(2**29) + int(np.random.randint(0, 2**29))
    samples = synthetic_samples(GLOBAL_BATCH, seed=seed, multi_modal_every=3)
    random.shuffle(samples)
    return fnppo.shard_for_data_parallel(samples)


def _train(
    state: fnppo.TrainState, data_rng: torch.Generator, steps: range, cfg: fnppo.StepConfig
) -> tuple[fnppo.TrainState, list[dict]]:
    rows = []
    for _ in steps:
        state, metrics = fnppo.train_step(state, _batch(data_rng), cfg)
        rows.append(metrics)
    return state, rows


def _uninterrupted(cfg: fnppo.StepConfig) -> dict:
    """``N_STEPS`` steps from seed 0 with dropout on (so the RNG matters)."""
    _seed_everything(0)
    state = _build(dropout=0.1)
    data_rng = torch.Generator().manual_seed(11)
    state, rows = _train(state, data_rng, range(N_STEPS), cfg)
    return {"metrics": rows, **_snapshot(state)}


def _resumed(cfg: fnppo.StepConfig, ckpt: Path) -> dict:
    """``SAVE_AT`` steps, save; then a fresh process state (other seeds, other weights) loads and
    continues to ``N_STEPS``."""
    _seed_everything(0)
    state = _build(dropout=0.1)
    data_rng = torch.Generator().manual_seed(11)
    state, rows = _train(state, data_rng, range(SAVE_AT), cfg)
    fnppo.checkpoint.save_checkpoint(ckpt, state, extra={"data_rng": data_rng.get_state(), "metrics": rows})
    del state
    # "restart": nothing of the first run survives but the directory
    _seed_everything(12345)
    state = _build(init_seed=99, dropout=0.1)
    state, extra = fnppo.checkpoint.load_checkpoint(ckpt, state)
    data_rng = torch.Generator()
    data_rng.set_state(extra["data_rng"])
    state, more = _train(state, data_rng, range(state.step, N_STEPS), cfg)
    return {"metrics": list(extra["metrics"]) + more, **_snapshot(state)}


def _compare_runs(a: dict, b: dict) -> list[str]:
    return (
        _bit_diff(a["metrics"], b["metrics"], "metrics")
        + _bit_diff(a["params"], b["params"], "params")
        + _bit_diff(a["opt"], b["opt"], "optimizer")
        + _bit_diff(a["step"], b["step"], "step")
    )


def _trained(state: fnppo.TrainState) -> fnppo.TrainState:
    """One step, so that the optimizer has state to lose."""
    return fnppo.train_step(state, fnppo.shard_for_data_parallel(synthetic_samples(4, seed=8)), _step_cfg())[0]


def _quiet() -> None:
    # With dropout on CPU, Megatron's RNG tracker (whose "CUDA" generator is the CPU one here) logs a
    # warning per forked region; it is expected and only noise.
    logging.getLogger("megatron.core.tensor_parallel.random").setLevel(logging.ERROR)


def _rng_draws() -> dict[str, float]:
    """One draw from every generator a checkpoint restores: torch's (CPU), Python's, NumPy's, Megatron's
    model-parallel tracker (what dropout in tensor-parallel regions draws from) and, on a machine with
    CUDA, CUDA's."""
    from megatron.core import tensor_parallel

    draws = {"torch": float(torch.rand(())), "python": random.random(), "numpy": float(np.random.random_sample())}
    with tensor_parallel.get_cuda_rng_tracker().fork():
        draws["megatron"] = float(torch.rand(()))
    if torch.cuda.is_available():
        draws["cuda"] = float(torch.rand((), device="cuda"))
    return draws


def _rng_round_trip(ckpt: Path, state: fnppo.TrainState) -> dict:
    """Save, draw from every generator, load, draw again: the same draws (a generator the load does not
    restore continues its sequence instead). Also the draws of a second load without the first draws
    in between, so that a generator that never moves cannot pass."""
    _seed_everything(5)
    if torch.cuda.is_available():
        torch.cuda.manual_seed(5)
        torch.rand((), device="cuda")  # initialized, so the checkpoint holds CUDA's state
    fnppo.checkpoint.save_checkpoint(ckpt, state)
    first = _rng_draws()
    second = _rng_draws()  # without a load in between: each generator moved on
    fnppo.checkpoint.load_checkpoint(ckpt, state)
    again = _rng_draws()
    return {"first": first, "second": second, "again": again}


def _refusal(ckpt: Path, state: fnppo.TrainState) -> str:
    """Try to load ``ckpt`` into ``state``; return the error message, and check nothing was loaded."""
    before = _snapshot(state)
    rng_before = torch.get_rng_state()
    try:
        fnppo.checkpoint.load_checkpoint(ckpt, state)
    except fnppo.checkpoint.CheckpointError as err:
        changed = _bit_diff(before, _snapshot(state)) + _bit_diff(rng_before, torch.get_rng_state(), "rng")
        return f"{err}" + (f" [BUT STATE CHANGED: {changed}]" if changed else "")
    except Exception as err:  # noqa: BLE001 - a raw error fails only its own case
        return f"{type(err).__name__} instead of a CheckpointError: {err}"
    return "loaded without error"


# ---------------------------------------------------------------------------------------------
# non-finite gradient in one micro-batch
# ---------------------------------------------------------------------------------------------
class _NaNGradient(torch.autograd.Function):
    """Identity forward (the loss stays finite), NaN backward."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return torch.full_like(g, float("nan"))


def _logprob_poisoning(call: int, rank: int | None):
    """A ``StepFns.logprob`` whose ``call``-th micro-batch (on ``rank``, or every rank) gets NaN grads."""
    calls = [0]

    def logprob(logits, labels, **kw):
        i = calls[0]
        calls[0] += 1
        if i == call and (rank is None or dist.get_rank() == rank):
            logits = _NaNGradient.apply(logits)
        return fnppo.logprob_and_entropy(logits, labels, **kw)

    return logprob


def _nan_gradient_case(poison_rank: int | None) -> dict:
    """good step, poisoned step (2nd of 2 micro-batches), good step; vs. good, good on a twin."""
    _seed_everything(0)
    good = _step_cfg(num_microbatches=2)
    bad = _step_cfg(num_microbatches=2, fns=fnppo.StepFns(logprob=_logprob_poisoning(1, poison_rank)))
    batch = fnppo.shard_for_data_parallel(synthetic_samples(GLOBAL_BATCH, seed=5))
    state = _build()
    state, m1 = fnppo.train_step(state, batch, good)
    before = _snapshot(state)
    state, m2 = fnppo.train_step(state, batch, bad)
    after = _snapshot(state)
    state, m3 = fnppo.train_step(state, batch, good)
    final = _params(state)
    twin = _build()  # the same run without the poisoned step
    twin, _ = fnppo.train_step(twin, batch, good)
    twin, t3 = fnppo.train_step(twin, batch, good)
    return {
        "m1": m1,
        "m2": m2,
        "m3": m3,
        "t3": t3,
        "untouched": _bit_diff(before["params"], after["params"], "params")
        + _bit_diff(before["opt"], after["opt"], "optimizer"),
        "moved": any(not torch.equal(final[k], after["params"][k]) for k in final),
        "same_as_twin": _bit_diff(final, _params(twin), "params"),
        "step": state.step,
    }


# ---------------------------------------------------------------------------------------------
# the world-1 and DP=2 runs
# ---------------------------------------------------------------------------------------------
def _one_rank_run(root: str) -> dict:
    root = Path(root)
    _quiet()
    cfg = _step_cfg(num_microbatches=2)
    out: dict = {"nan_grad": _nan_gradient_case(None)}
    straight = _uninterrupted(cfg)
    resumed = _resumed(cfg, root / "step2")
    out["straight_metrics"] = straight["metrics"]
    out["straight_params"] = straight["params"]
    out["resume_diff"] = _compare_runs(straight, resumed)

    # --- refusals; each loads into a mid-run state that must stay bit-identical ----------------
    state = _trained(_build(init_seed=7))
    good = root / "step2"
    out["rng_round_trip"] = _rng_round_trip(root / "rng", state)
    out["missing_dir"] = _refusal(root / "never_saved", state)
    (root / "a_file").write_text("not a checkpoint")
    out["not_a_dir"] = _refusal(root / "a_file", state)

    def variant(name: str, damage) -> str:
        d = root / name
        shutil.copytree(good, d)
        damage(d)
        return _refusal(d, state)

    rank_file = "__0_0.distcp"  # rank 0's shards (torch.distributed.checkpoint)
    out["no_manifest"] = variant("no_manifest", lambda d: (d / "manifest.json").unlink())

    def truncate(d: Path) -> None:
        f = d / rank_file
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])

    out["truncated"] = variant("truncated", truncate)

    def flip(d: Path) -> None:
        f = d / rank_file
        data = bytearray(f.read_bytes())
        data[len(data) // 2] ^= 0xFF
        f.write_bytes(bytes(data))

    out["altered"] = variant("altered", flip)
    out["missing_file"] = variant("missing_file", lambda d: (d / rank_file).unlink())
    out["not_json"] = variant("not_json", lambda d: (d / "manifest.json").write_text("{half a manif"))

    def manifest_edit(change):
        def damage(d: Path) -> None:
            manifest = json.loads((d / "manifest.json").read_text())
            change(manifest)
            (d / "manifest.json").write_text(json.dumps(manifest))

        return damage

    out["layout_array"] = variant("layout_array", manifest_edit(lambda m: m.update(layout=[1, 1])))
    out["file_entry_array"] = variant(
        "file_entry_array", manifest_edit(lambda m: m["files"].update({rank_file: [m["files"][rank_file]["size"]]}))
    )
    wider = _trained(_build(hidden=48))
    out["other_shape"] = _refusal(good, wider)
    # the first tensor (in the model's order) whose global shape differs, read off Megatron's sharded
    # state dicts of the two models
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    saved_shapes, wider_shapes = (
        {
            k: list(v.global_shape)
            for k, v in unwrap_model(s.model[0]).sharded_state_dict().items()
            if isinstance(v, ShardedTensor)
        }
        for s in (_build(), wider)
    )
    first = next(k for k in wider_shapes if saved_shapes.get(k) != wider_shapes[k])
    out["other_shape_first"] = (first, saved_shapes[first], wider_shapes[first])

    # --- a save that dies: a full disk (fsync fails), a crash before the final rename -----------
    out["crashes"] = {
        "full_disk": _failed_save(root / "full", state, "fsync", OSError(28, "No space left on device")),
        "rename": _failed_save(root / "renamed", state, "replace", OSError("simulated crash before the rename")),
    }
    # --- latest_checkpoint: incomplete ones reported and skipped; a damaged newest one refused ---
    runs = root / "runs"
    shutil.copytree(good, runs / "step2")
    shutil.copytree(good, runs / "step9")
    (runs / "step9" / "manifest.json").unlink()  # an interrupted save (no manifest)
    shutil.copytree(good, runs / ".step10.tmp-0123")  # the temporary directory of a save that died
    (runs / ".step10.tmp-0123" / "manifest.json").unlink()
    with _logged("fnppo.checkpoint") as records:
        latest = fnppo.checkpoint.latest_checkpoint(runs)
    out["latest"] = None if latest is None else latest.name
    out["latest_reported"] = list(records)
    shutil.copytree(good, runs / "step4")  # the newest, damaged
    manifest = json.loads((runs / "step4" / "manifest.json").read_text())
    (runs / "step4" / "manifest.json").write_text(json.dumps({**manifest, "step": 4}))
    flip(runs / "step4")
    try:
        fnppo.checkpoint.latest_checkpoint(runs)
        out["damaged_newest"] = "no error"
    except fnppo.checkpoint.CheckpointError as err:
        out["damaged_newest"] = str(err)
    with _logged("fnppo.checkpoint") as records:
        fallback = fnppo.checkpoint.latest_checkpoint(runs, fallback=True)
    out["fallback"] = (None if fallback is None else fallback.name, list(records))
    return out


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


class _logged:
    """The warnings logged on ``name`` inside the block, as a list of messages."""

    def __init__(self, name: str) -> None:
        self.logger, self.handler = logging.getLogger(name), _Records()

    def __enter__(self) -> list[str]:
        self.logger.addHandler(self.handler)
        return self.handler.lines

    def __exit__(self, *exc) -> None:
        self.logger.removeHandler(self.handler)


def _failed_save(d: Path, state: fnppo.TrainState, call: str, error: OSError, rank: int | None = None) -> dict:
    """Save to ``d`` with ``os.<call>`` failing (on ``rank``, or every rank): the error on every rank, and
    what is left next to ``d``."""
    real = getattr(os, call)

    def failing(*args, **kw):
        if rank is None or dist.get_rank() == rank:
            raise error
        return real(*args, **kw)

    setattr(os, call, failing)
    try:
        fnppo.checkpoint.save_checkpoint(d, state)
        result = {"save": "no error"}
    except fnppo.checkpoint.CheckpointError as err:
        result = {"save": str(err)}
    finally:
        setattr(os, call, real)
    dist.barrier()
    result["left"] = sorted(p.name for p in d.parent.iterdir() if p.name.startswith((d.name, f".{d.name}")))
    return result


def _two_rank_run(root: str) -> dict:
    """DP=2 with the distributed optimizer: NaN gradient on rank 1 only, resume, then TP=2 refusal."""
    root = Path(root)
    lay = fnppo.parallel.current_layout()
    _quiet()
    cfg = _step_cfg(num_microbatches=2)
    out: dict = {"dp": lay.dp, "nan_grad": _nan_gradient_case(1)}
    straight = _uninterrupted(cfg)
    resumed = _resumed(cfg, root / "dp2_step2")
    out["resume_diff"] = _compare_runs(straight, resumed)
    out["straight_metrics"] = straight["metrics"]
    with open(root / "dp2_step2" / "manifest.json") as f:
        out["manifest_files"] = sorted(json.load(f)["files"])
    # a full disk on rank 1 only: both ranks raise, nothing is left behind
    out["full_disk"] = _failed_save(root / "full", _build(), "fsync", OSError(28, "No space left on device"), rank=1)
    # the same world re-initialized as TP=2: the DP=2 checkpoint loads (resharded) and trains on
    fnppo.init_parallel(2, 1, seed=1234, device="cpu", timeout_s=120.0)
    out["tp"] = fnppo.parallel.current_layout().tp
    state, _ = fnppo.checkpoint.load_checkpoint(root / "dp2_step2", _build(init_seed=99))
    out["other_layout_step"] = state.step
    state, metrics = fnppo.train_step(state, _batch(torch.Generator().manual_seed(5)), cfg)
    out["other_layout_metrics"] = metrics
    return out


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    return run_ranks(_one_rank_run, 1, str(tmp_path_factory.mktemp("ckpt1")))[0]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return run_ranks(_two_rank_run, 2, str(tmp_path_factory.mktemp("ckpt2")))


# ---------------------------------------------------------------------------------------------
# tests: non-finite gradients
# ---------------------------------------------------------------------------------------------
def _check_nan_gradient(r: dict) -> None:
    assert r["m1"]["skipped"] == 0.0 and r["m1"]["updates"] == 1.0
    # the poisoned step: the loss is finite, the gradient is not; skipped and reported
    assert r["m2"]["skipped"] == 1.0 and r["m2"]["updates"] == 0.0
    assert np.isfinite(r["m2"]["loss"]) and not np.isfinite(r["m2"]["grad_norm"])
    assert r["untouched"] == [], f"parameters / optimizer state changed by a skipped step: {r['untouched'][:5]}"
    # the next good step proceeds, exactly as if the poisoned step had never happened
    assert r["m3"]["skipped"] == 0.0 and r["m3"]["updates"] == 1.0 and r["moved"]
    assert r["same_as_twin"] == [], r["same_as_twin"][:5]
    assert r["m3"]["loss"] == r["t3"]["loss"] and r["m3"]["grad_norm"] == r["t3"]["grad_norm"]
    assert r["step"] == 3  # TrainState.step counts skipped steps too


def test_non_finite_gradient_in_one_microbatch_skips_step(one_rank):
    _check_nan_gradient(one_rank["nan_grad"])


def test_non_finite_gradient_on_one_dp_rank_skips_step_on_every_rank(two_ranks):
    for _rank, r in enumerate(two_ranks):
        assert r["dp"] == 2
        _check_nan_gradient(r["nan_grad"])
        # metrics are reduced over the DP group: both ranks report the same step
        assert r["nan_grad"]["m2"]["loss"] == two_ranks[0]["nan_grad"]["m2"]["loss"]


# ---------------------------------------------------------------------------------------------
# tests: checkpoints
# ---------------------------------------------------------------------------------------------
def test_resume_is_bit_identical_one_rank(one_rank):
    assert one_rank["resume_diff"] == [], one_rank["resume_diff"][:10]
    assert len(one_rank["straight_metrics"]) == N_STEPS
    # the run really trains: every step updates and the loss changes
    assert all(m["updates"] == 1.0 for m in one_rank["straight_metrics"])
    assert len({m["loss"] for m in one_rank["straight_metrics"]}) == N_STEPS


def test_resume_is_bit_identical_dp2_distributed_optimizer(two_ranks):
    for r in two_ranks:
        assert r["resume_diff"] == [], r["resume_diff"][:10]
        assert r["manifest_files"] == [".metadata", "__0_0.distcp", "__1_0.distcp", "common.pt", "metadata.json"]
    # both DP ranks report the same (globally reduced) metrics
    assert two_ranks[0]["straight_metrics"] == two_ranks[1]["straight_metrics"]


_STANDARD = re.compile(r"^load_checkpoint: argument '(directory|state)' expected .+, received .+", re.DOTALL)


@pytest.mark.parametrize(
    "case, arg, needle",
    [
        ("missing_dir", "directory", "never_saved', which does not exist"),
        ("not_a_dir", "directory", "a_file', which is not a directory"),
        ("no_manifest", "directory", "has no manifest.json"),
        ("truncated", "directory", "is truncated or altered"),
        ("altered", "directory", "sha256 differs from the manifest"),
        ("missing_file", "directory", "__0_0.distcp is missing"),
        ("not_json", "directory", "is not valid JSON"),
        ("layout_array", "directory", "holding 'layout' = [1, 1] (an object of parallel sizes is expected)"),
        ("file_entry_array", "directory", "holding files['__0_0.distcp'] holding a JSON array"),
        ("other_shape", "state", "a model that differs from the checkpoint's: parameter"),
    ],
    ids=[
        "missing_dir",
        "not_a_dir",
        "no_manifest",
        "truncated",
        "altered",
        "missing_file",
        "not_json",
        "layout_array",
        "file_entry_array",
        "other_shape",
    ],
)
def test_bad_checkpoint_is_refused_and_loads_nothing(one_rank, case, arg, needle):
    msg = one_rank[case]
    match = _STANDARD.match(msg)
    assert match and match.group(1) == arg and needle in msg, msg
    assert "BUT STATE CHANGED" not in msg, msg


def test_checkpoint_of_another_shape_names_the_first_differing_parameter(one_rank):
    """Not digests: the parameter, the checkpoint's shape and this model's (both read off the models)."""
    name, saved, ours = one_rank["other_shape_first"]
    assert saved != ours
    assert f"parameter '{name}': checkpoint {saved}, this model {ours}" in one_rank["other_shape"], one_rank[
        "other_shape"
    ]
    assert "digest" not in one_rank["other_shape"]


@pytest.mark.parametrize("generator", ["torch", "python", "numpy", "megatron", "cuda"])
def test_load_restores_every_generator(one_rank, generator):
    """After a load, each generator the checkpoint saved gives the draws it gave right after the save."""
    if generator == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device: the CUDA generator is not saved")
    r = one_rank["rng_round_trip"]
    assert r["first"][generator] != r["second"][generator]  # it moves, so a missing restore shows
    assert r["again"][generator] == r["first"][generator], (generator, r)


def test_checkpoint_of_dp2_loads_under_tp2_and_trains_on(two_ranks):
    for r in two_ranks:
        assert r["tp"] == 2 and r["other_layout_step"] == SAVE_AT
        assert r["other_layout_metrics"]["updates"] == 1.0 and np.isfinite(r["other_layout_metrics"]["loss"])


_SAVE = re.compile(r"^save_checkpoint: argument 'directory' expected .+, received .+", re.DOTALL)


def test_full_disk_fails_on_every_rank_and_leaves_nothing(one_rank, two_ranks):
    for r in [one_rank["crashes"]["full_disk"], *(x["full_disk"] for x in two_ranks)]:
        assert _SAVE.match(r["save"]) and "No space left on device" in r["save"], r["save"]
        assert r["left"] == [], r["left"]  # no temporary directory, no checkpoint


def test_crash_before_the_final_rename_leaves_nothing(one_rank):
    r = one_rank["crashes"]["rename"]
    assert _SAVE.match(r["save"]) and "simulated crash before the rename" in r["save"], r["save"]
    assert r["left"] == [], r["left"]


def test_latest_skips_incomplete_checkpoints_and_reports_them(one_rank):
    # the newest *complete* checkpoint is the step-2 one, not the interrupted step-9 / step-10 saves
    assert one_rank["latest"] == "step2"
    reported = one_rank["latest_reported"]
    assert any("step9" in m and "no readable manifest.json" in m for m in reported), reported
    assert any(".step10.tmp-0123" in m and "a save that did not finish" in m for m in reported), reported


def test_damaged_newest_checkpoint_is_refused_unless_fallback(one_rank):
    msg = one_rank["damaged_newest"]
    assert msg.startswith("latest_checkpoint: argument 'root' expected a newest checkpoint that verifies"), msg
    assert "step4" in msg and "sha256 differs from the manifest" in msg, msg
    name, reported = one_rank["fallback"]
    assert name == "step2"
    assert any("skipping damaged checkpoint" in m and "step4" in m for m in reported), reported


# ---------------------------------------------------------------------------------------------
# determinism
# ---------------------------------------------------------------------------------------------
def _straight_only() -> dict:
    _quiet()
    r = _uninterrupted(_step_cfg(num_microbatches=2))
    return {"metrics": r["metrics"], "params": r["params"]}


def test_same_seed_same_layout_is_bit_identical_across_runs(one_rank):
    again = run_ranks(_straight_only, 1, fresh=True)[0]  # another process, not the reused rank
    assert _bit_diff(one_rank["straight_metrics"], again["metrics"], "metrics") == []
    assert _bit_diff(one_rank["straight_params"], again["params"], "params") == []


# ---------------------------------------------------------------------------------------------
# a rank that raises inside the schedule
# ---------------------------------------------------------------------------------------------
FAULT = "injected fault in forward on rank 1"


def _forward_failing_on_rank1(model, microbatch, *, params=None):
    if dist.get_rank() == 1:
        raise RuntimeError(FAULT)
    return fnppo.forward_logits(model, microbatch, params=params)


def _fail_inside_schedule(verdict: str) -> None:
    """Rank 1 raises in its forward. Rank 0 is then stuck waiting for rank 1 in the gradient
    reduction; it must raise by itself within the timeout. Rank 1 stays alive (a hung peer, the
    worst case) until rank 0 has reported, then re-raises its original error."""
    rank = dist.get_rank()
    state = _build()
    cfg = _step_cfg(fns=fnppo.StepFns(forward=_forward_failing_on_rank1))
    batch = fnppo.shard_for_data_parallel(synthetic_samples(4, seed=1))
    t0 = time.monotonic()
    try:
        fnppo.train_step(state, batch, cfg)
    except Exception as err:
        if rank == 0:
            Path(verdict).write_text(
                json.dumps({"error": type(err).__name__, "message": str(err)[:500], "elapsed": time.monotonic() - t0})
            )
            return
        deadline = time.monotonic() + 3 * FAIL_TIMEOUT_S
        while not Path(verdict).exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        raise
    if rank == 0:
        Path(verdict).write_text(json.dumps({"error": None, "elapsed": time.monotonic() - t0}))


def test_rank_failing_inside_schedule_fails_all_ranks_fast(tmp_path):
    verdict = tmp_path / "rank0.json"
    t0 = time.monotonic()
    with pytest.raises(RankError) as info:
        run_ranks(_fail_inside_schedule, 2, str(verdict), timeout_s=FAIL_TIMEOUT_S)
    wall = time.monotonic() - t0
    msg = str(info.value)
    # the caller sees the original error, from the rank that raised it
    assert "rank 1 of 2 raised" in msg and f"RuntimeError: {FAULT}" in msg, msg[-2000:]
    # the rank left waiting did not hang: it raised by itself within the timeout
    r0 = json.loads(verdict.read_text())
    assert r0["error"] is not None, "rank 0 finished a step whose peer failed"
    assert r0["elapsed"] <= FAIL_TIMEOUT_S + 10.0, r0
    assert wall <= FAIL_TIMEOUT_S + 60.0, wall
