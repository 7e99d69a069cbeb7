"""The main job (examples/ppo_toy.py): resume is bit-identical, layouts agree on the first step, and
its command line: refusals (one line, exit 2, before torch is imported and before anything is
created) and where a run's files go for every combination of --out-dir, --metrics-out, --no-plot
and --resume.

These tests need only the ``[test]`` extra: runs pass --no-progress (tqdm is an ``[examples]``
dependency), and a plot is checked only where matplotlib is installed.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.scripts import run_script

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "ppo_toy.py"
SMALL = ["--prompts", "4", "--group-size", "4", "--no-progress", "--no-plot", "--target-reward", "0"]
HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None
#: runs the example with every generator its checkpoints restore drawn once per step (torch's, Python's,
#: NumPy's; CUDA's where it is initialized), the draws added to the step's metrics row: a generator
#: that a resume does not restore gives the resumed steps other draws than the uninterrupted run's
DRAWING = f"""
import random, sys
import numpy as np
sys.path.insert(0, {str(ROOT / "examples")!r})
import ppo_toy
from toy import rundir

def append_row(rows, path, row, _append=rundir.append_row):
    import torch
    draws = {{"draw_torch": float(torch.rand(())), "draw_python": random.random(), "draw_numpy": float(np.random.random_sample())}}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        draws["draw_cuda"] = float(torch.rand((), device="cuda"))
    _append(rows, path, {{**row, **draws}})

rundir.append_row = append_row
sys.exit(ppo_toy.main(sys.argv[1:]))
"""
#: runs the example and says on stdout whether torch was imported (refusals must come before it)
IMPORTS = f"""
import sys
sys.path.insert(0, {str(ROOT / "examples")!r})
import ppo_toy
code = ppo_toy.main(sys.argv[1:])
print("torch imported:", "torch" in sys.modules)
sys.exit(code)
"""


def _env() -> dict:
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    return dict(os.environ, PYTHONPATH=path, OMP_NUM_THREADS="1")


def _call(
    args: list[str], nproc: int = 1, cwd: Path | None = None, code: str | None = None
) -> subprocess.CompletedProcess:
    """The example (or ``code``, a launcher given the example's arguments) as ``python`` / ``torchrun``
    would run it, in forks of a server that imported torch and fnppo once (tests/scripts.py); the
    import check (``IMPORTS``) in a new interpreter, since what is imported is its point."""
    if code is IMPORTS:
        cmd = [sys.executable, "-c", code, *args]
        return subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=600, cwd=cwd)
    path = EXAMPLE if code is None else None
    return run_script(path, args, nproc=nproc, cwd=cwd or Path.cwd(), code=code, timeout=600)


def _run(args: list[str], nproc: int = 1, cwd: Path | None = None, code: str | None = None) -> str:
    out = _call(args, nproc, cwd, code)
    assert out.returncode == 0, f"{args} failed:\n{out.stdout[-3000:]}\n{out.stderr[-6000:]}"
    assert "Warning" not in out.stderr, out.stderr[-3000:]  # quiet by default
    return out.stdout


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _bit_diff(a, b, path: str = "") -> list[str]:
    """Paths where two nested structures differ; tensors compared byte for byte (dtype and shape too)."""
    import torch

    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        same = (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(
                a.detach().contiguous().reshape(-1).view(torch.uint8),
                b.detach().contiguous().reshape(-1).view(torch.uint8),
            )
        )
        return [] if same else [path]
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):  # (the order may differ: a loaded optimizer state inserts 'step' first)
            return [f"{path}{{keys}}"]
        return [d for k in a for d in _bit_diff(a[k], b[k], f"{path}.{k}")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return [f"{path}[len]"]
        return [d for i, (x, y) in enumerate(zip(a, b, strict=True)) for d in _bit_diff(x, y, f"{path}[{i}]")]
    if type(a).__module__ == "numpy" or type(b).__module__ == "numpy":  # NumPy's RNG state
        import numpy as np

        return (
            [] if type(a) is type(b) and np.asarray(a).dtype == np.asarray(b).dtype and np.array_equal(a, b) else [path]
        )
    if hasattr(a, "__dict__") and type(a) is type(b) and not isinstance(a, type):
        return _bit_diff(vars(a), vars(b), path)
    return [] if a == b else [path]


def _checkpoint(d: Path) -> dict:
    """Everything a checkpoint directory holds (tensors, per-rank RNG objects, common state), read in this process."""
    from fnppo.checkpoint import read_checkpoint

    return {k: v for k, v in read_checkpoint(d).items() if k != "manifest"}


def test_resume_continues_bit_identically(tmp_path):
    """A preempted run resumed from its checkpoint equals the uninterrupted run, bit for bit. With
    --kl-target the KL coefficient moves every step; the controller's state is in the checkpoint, so
    the resumed steps train with the coefficient the uninterrupted run had (not a fresh --kl-coef)."""

    steps = ["--steps", "4", "--kl-target", "0.0001", "--kl-horizon", "20", *SMALL]
    _run([*steps, "--out-dir", str(tmp_path / "straight"), "--save-every", "2"], code=DRAWING)
    # a preempted run: stops after 2 steps (checkpoint at step 2), then resumes to the end
    _run([*steps, "--out-dir", str(tmp_path / "resumed"), "--save-every", "2", "--exit-after", "3"], code=DRAWING)
    assert (tmp_path / "resumed" / "checkpoints" / "step000002" / "manifest.json").is_file()
    out = _run([*steps, "--out-dir", str(tmp_path / "resumed"), "--save-every", "2", "--resume"], code=DRAWING)
    assert "step000002 (checkpoint of step 2)" in out
    straight = _rows(tmp_path / "straight" / "metrics.jsonl")
    resumed = _rows(tmp_path / "resumed" / "metrics.jsonl")
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    coefs = [r["kl_coef"] for r in straight]
    assert coefs[0] == 0.001 and len(set(coefs)) == 4  # adaptive: a new coefficient every step
    for key in ("draw_torch", "draw_python", "draw_numpy"):  # every generator moves from step to step
        assert len({r[key] for r in straight}) == 4, key
    assert straight == resumed  # every metric of every step, bit for bit, kl_coef and the draws included
    # and the final state: every weight, optimizer tensor (Adam moments and steps), RNG state, extra
    final = [_checkpoint(d / "checkpoints" / "step000004") for d in (tmp_path / "straight", tmp_path / "resumed")]
    assert final[0]["common"]["fnppo"]["step"] == final[1]["common"]["fnppo"]["step"] > 0
    keys = final[0]["tensors"]
    assert (
        "embedding.word_embeddings.weight" in keys
        and "optimizer.state.exp_avg.embedding.word_embeddings.weight" in keys
    )
    assert [k for k in final[0]["objects"] if k.startswith("fnppo.rng")]  # every rank's RNG states
    diff = _bit_diff(*final)  # every RNG state too: the example seeds them all, the launcher draws from them
    assert diff == [], f"the resumed run's final state differs from the uninterrupted run's at {diff[:10]}"


def test_ppo_with_a_critic_resumes_bit_identically(tmp_path):
    """--algo ppo: the critic's weights and optimizer are in the checkpoint with the actor's (one
    manifest), so a resumed run gives every metric of the critic and the actor bit for bit."""

    steps = ["--steps", "4", "--algo", "ppo", *SMALL]
    plot = [a for a in steps if a != "--no-plot"] if HAS_MATPLOTLIB else steps  # the plot needs matplotlib
    _run([*plot, "--out-dir", str(tmp_path / "straight"), "--save-every", "2"], code=DRAWING)
    _run([*steps, "--out-dir", str(tmp_path / "resumed"), "--save-every", "2", "--exit-after", "3"], code=DRAWING)
    out = _run([*steps, "--out-dir", str(tmp_path / "resumed"), "--save-every", "2", "--resume"], code=DRAWING)
    assert "step000002 (checkpoint of step 2)" in out
    straight = _rows(tmp_path / "straight" / "metrics.jsonl")
    resumed = _rows(tmp_path / "resumed" / "metrics.jsonl")
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    assert all(r["critic_updates"] == 2.0 and "vf_explained_var" in r for r in straight)
    assert straight == resumed  # the critic's metrics too, bit for bit
    final = [_checkpoint(d / "checkpoints" / "step000004") for d in (tmp_path / "straight", tmp_path / "resumed")]
    assert sorted(final[0]["common"]["states"]) == ["critic", "policy"]
    assert "optimizer.state.exp_avg.critic.decoder.final_layernorm.weight" in final[0]["tensors"]
    diff = _bit_diff(*final)
    assert diff == [], f"the resumed run's final state differs from the uninterrupted run's at {diff[:10]}"
    if HAS_MATPLOTLIB:
        assert (tmp_path / "straight" / "ppo_toy.png").stat().st_size > 10_000  # six panels with the critic's
    # a PPO run is not resumed as GRPO: --resume takes --algo ppo from the run's settings, a contrary flag is refused
    out = _call(["--steps", "4", *SMALL, "--algo", "grpo", "--out-dir", str(tmp_path / "resumed"), "--resume"])
    assert out.returncode == 2 and "--resume: the run was written with --algo ppo (given: grpo)" in out.stderr, (
        out.stderr
    )


_CHECK = re.compile(r"first-step loss=(\S+) grad_norm=(\S+)")


def _first_step(args: list[str], nproc: int) -> tuple[float, float]:
    if nproc == 1:
        return _first_step_one_process(tuple(args))
    return _first_step_run(tuple(args), nproc)


@functools.cache
def _first_step_one_process(args: tuple[str, ...]) -> tuple[float, float]:
    """The one-process reference, run once per argument list for all the layouts compared with it."""
    return _first_step_run(args, 1)


def _first_step_run(args: tuple[str, ...], nproc: int) -> tuple[float, float]:
    out = _run(
        [
            "--steps",
            "1",
            "--layout-check",
            *SMALL,
            "--out-dir",
            f"/tmp/fnppo-layout-check-{os.getpid()}",
            "--overwrite",
            *args,
        ],
        nproc,
    )
    m = _CHECK.search(out)
    assert m, out
    return float(m.group(1)), float(m.group(2))


# DP=2 against one process: tests/test_readme.py::test_quoted_layout_check_values_match_the_code runs both
# with the default settings and holds each to README's quoted values (1e-6).
@pytest.mark.parametrize("layout,nproc", [(["--tp", "2"], 2), (["--pp", "2"], 2)], ids=["tp2", "pp2"])
def test_first_step_agrees_across_layouts(layout, nproc):
    ref_loss, ref_norm = _first_step([], 1)
    loss, norm = _first_step(layout, nproc)
    assert abs(loss - ref_loss) <= 1e-4 * abs(ref_loss), (loss, ref_loss)
    assert abs(norm - ref_norm) <= 1e-4 * abs(ref_norm), (norm, ref_norm)


def test_shared_prefix_trains_the_groups_with_the_same_rewards(tmp_path):
    """--shared-prefix on (every GRPO group's prompt forwarded once) against off, the same seed: the
    same reward at every step (sampling from weights equal up to float rounding), the loss and the
    grad norm within float rounding of each other."""
    rows = {}
    for mode in ("on", "off"):
        out = tmp_path / mode
        _run([*SMALL, "--steps", "3", "--shared-prefix", mode, "--out-dir", str(out)])
        rows[mode] = _rows(out / "metrics.jsonl")
    assert [r["reward"] for r in rows["on"]] == [r["reward"] for r in rows["off"]]
    # the flag reaches the step's config (auto: on with the local spec, off with --batch-invariant or a router loss)
    sys.path.insert(0, str(ROOT / "examples"))
    from toy.cli import parse_args
    from toy.model import critic_config, step_config

    import fnppo

    for flags, shared in (
        ([], True),
        (["--shared-prefix", "off"], False),
        (["--batch-invariant"], False),
        (["--moe"], False),  # its router z-loss counts the tokens the routers compute
        (["--moe", "--moe-z-coeff", "0"], True),
    ):
        args = parse_args([*flags, "--spec", "local"])
        assert isinstance(step_config(args).packing, fnppo.batching.SharedPrefix) is shared, flags
        assert isinstance(critic_config(args).packing, fnppo.batching.SharedPrefix) is shared, flags
    for a, b in zip(rows["on"], rows["off"], strict=True):
        for key in ("loss", "grad_norm"):
            assert abs(a[key] - b[key]) <= 1e-5 * max(abs(b[key]), 1e-3), (a["step"], key, a[key], b[key])


def test_ppo_first_step_agrees_between_one_process_and_pp2():
    """--algo ppo under torchrun --pp 2: the actor's and the critic's first step equal one process's."""
    ref = _first_step_ppo([], 1)
    got = _first_step_ppo(["--pp", "2"], 2)
    for name, r, g in zip(("loss", "grad_norm", "critic vf_loss", "critic grad_norm"), ref, got, strict=True):
        assert abs(g - r) <= 1e-4 * abs(r), (name, g, r)


_CHECK_PPO = re.compile(r"first-step loss=(\S+) grad_norm=(\S+) critic vf_loss=(\S+) critic grad_norm=(\S+)")


def _first_step_ppo(args: list[str], nproc: int) -> tuple[float, ...]:
    out = _run(
        [
            "--steps",
            "1",
            "--layout-check",
            "--algo",
            "ppo",
            *SMALL,
            "--out-dir",
            "/tmp/fnppo-layout-check-ppo",
            "--overwrite",
            *args,
        ],
        nproc,
    )
    m = _CHECK_PPO.search(out)
    assert m, out
    return tuple(float(v) for v in m.groups())


def test_starts_from_a_hugging_face_checkpoint(tmp_path):
    transformers = pytest.importorskip("transformers")
    import torch

    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=True,
    )
    transformers.Qwen2ForCausalLM(cfg).save_pretrained(tmp_path / "ckpt")
    _run(["--hf-checkpoint", str(tmp_path / "ckpt"), "--steps", "2", *SMALL, "--out-dir", str(tmp_path / "run")])
    rows = _rows(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2] and all(r["skipped"] == 0.0 for r in rows)


def test_ppo_critic_starts_from_a_value_checkpoint(tmp_path):
    """--critic-checkpoint: the critic is the checkpoint's value model, head included. Its score head
    is 0 * h + 3, so every value it predicts before its first update is 3.0 (a fresh head: about 0),
    and its trunk (another width than the actor's) trains."""
    transformers = pytest.importorskip("transformers")
    import torch

    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(
        vocab_size=32,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        num_labels=1,
    )
    model = transformers.Qwen2ForTokenClassification(cfg)
    with torch.no_grad():
        model.score.weight.zero_()
        model.score.bias.fill_(3.0)
    model.save_pretrained(tmp_path / "critic")
    common = ["--algo", "ppo", "--steps", "1", "--minibatches", "1", "--critic-lr", "1e-9", *SMALL]
    _run(["--critic-checkpoint", str(tmp_path / "critic"), *common, "--out-dir", str(tmp_path / "run")])
    _run([*common, "--out-dir", str(tmp_path / "fresh")])
    (row,), (fresh,) = _rows(tmp_path / "run" / "metrics.jsonl"), _rows(tmp_path / "fresh" / "metrics.jsonl")
    assert abs(row["vpred_mean"] - 3.0) <= 1e-5 and abs(fresh["vpred_mean"] - 3.0) > 1.0, (
        row["vpred_mean"],
        fresh["vpred_mean"],
    )
    assert row["critic_grad_norm"] > 0 and row["skipped"] == 0.0, row


# ---------------------------------------------------------------------------------------------
# the command line: errors, run directories, resume rules
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "args,message",
    [
        (["--steps", "-1"], "--steps must be >= 1, got -1"),
        (["--device", "cuda"], "--device cuda: this torch has no CUDA device"),
        (["--tp", "3"], "--tp 3 x --pp 1 = 3 does not divide the 1 processes"),
        (["--prompts", "0"], "--prompts must be >= 1, got 0"),
        (["--resume", "--overwrite"], "--overwrite and --resume exclude each other"),
        (["--kl-horizon", "100"], "--kl-horizon needs --kl-target"),
        (["--algo", "ppo", "--advantage", "rloo"], "--advantage chooses the group advantage of --algo grpo"),
        (
            ["--critic-checkpoint", "/nonexistent"],
            "--critic-checkpoint needs --algo ppo (a critic) and runs without --moe",
        ),
        (["--algo", "ppo", "--lam", "1.5"], "--algo ppo needs 0 <= --gamma <= 1, 0 <= --lam <= 1"),
        (["--tis-cap", "-1"], "--tis-cap must be > 0, got -1.0"),
        (["--kl-coef", "inf"], "--kl-coef must be a finite number, got inf"),
        (["--entropy-coeff", "-0.1"], "--entropy-coeff must be >= 0, got -0.1"),
        (["--lr", "nan"], "need --lr > 0, 0 <= --lr-final <= 1 and --temperature > 0, got nan"),
        (["--moe-experts", "0"], "--moe-experts must be >= 1, got 0"),
        (["--profile-step", "0"], "--profile-step must be >= 1, got 0"),
        (["--profile-step", "5", "--steps", "2"], "--profile-step 5 is beyond --steps 2: that step never runs"),
        (["--profile-out", "p.txt"], "--profile-out needs --profile-step"),
        (["--hf-checkpoint", "/nonexistent"], "--hf-checkpoint /nonexistent: does not exist"),
        (["--algo", "ppo", "--critic-checkpoint", "/nonexistent"], "--critic-checkpoint /nonexistent: does not exist"),
        (["--batch-invariant", "--tp", "2"], "--batch-invariant runs with --tp 1"),
        (["--shared-prefix", "on", "--batch-invariant"], "--shared-prefix on needs fnppo's local layer spec"),
    ],
    ids=[
        "negative-steps",
        "cuda-without-cuda",
        "tp-does-not-divide",
        "zero-prompts",
        "resume-and-overwrite",
        "kl-horizon-without-target",
        "ppo-with-group-advantage",
        "critic-checkpoint-without-ppo",
        "ppo-lambda-out-of-range",
        "negative-tis-cap",
        "infinite-kl-coef",
        "negative-entropy-coeff",
        "nan-lr",
        "no-experts",
        "profile-step-0",
        "profile-step-beyond-steps",
        "profile-out-without-step",
        "hf-checkpoint-missing",
        "critic-checkpoint-missing",
        "batch-invariant-with-tp",
        "shared-prefix-with-batch-invariant",
    ],
)
def test_invalid_arguments_print_one_line_and_exit_2(args, message, tmp_path):
    """Refused before torch is imported (only --device cuda asks torch) and before anything is created."""
    if "cuda" in args:
        import torch

        if torch.cuda.is_available():
            pytest.skip("this machine has CUDA")
    _refused([*args, "--out-dir", str(tmp_path / "run")], message, tmp_path, torch_ok="cuda" in args)


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() if p.is_file() else b"<dir>" for p in sorted(root.rglob("*"))}


def _refused(args: list[str], message: str, cwd: Path, torch_ok: bool = False) -> None:
    """``args`` end with exit 2 and the one line ``ppo_toy.py: error: {message}...`` on stderr, import no
    torch (unless ``torch_ok``) and leave ``cwd`` as they found it."""
    before = _tree(cwd)
    out = _call(args, cwd=cwd, code=IMPORTS)
    assert out.returncode == 2, (out.returncode, out.stderr[-2000:])
    assert out.stderr.strip().startswith(f"ppo_toy.py: error: {message}"), out.stderr
    assert len(out.stderr.strip().splitlines()) == 1 and "Traceback" not in out.stderr
    assert torch_ok or "torch imported: False" in out.stdout, out.stdout
    assert _tree(cwd) == before, "a refused command line created or changed files"


def _hf_dir(root: Path, config: str | None = "{}", weights: bool = True) -> Path:
    d = root / "hf"
    d.mkdir()
    if config is not None:
        (d / "config.json").write_text(config)
    if weights:
        (d / "model.safetensors").write_bytes(b"")
    return d


def _ppo_manifest(root: Path) -> None:
    """A run directory whose newest complete checkpoint holds a policy and a critic (``--algo ppo``)."""
    ckpt = root / "run" / "checkpoints" / "step000002"
    ckpt.mkdir(parents=True)
    (ckpt / "manifest.json").write_text(json.dumps({"step": 2, "states": ["policy", "critic"]}))
    (root / "run" / "checkpoints" / "step000003").mkdir()  # an interrupted save: no manifest, skipped


PATH_CASES = {
    "hf-file": (
        lambda r: (r / "hf").write_text("x"),
        ["--hf-checkpoint", "hf"],
        "--hf-checkpoint hf: is not a directory",
    ),
    "hf-without-config": (
        lambda r: _hf_dir(r, None),
        ["--hf-checkpoint", "hf"],
        "--hf-checkpoint hf: has no config.json",
    ),
    "hf-config-not-json": (
        lambda r: _hf_dir(r, "{half"),
        ["--hf-checkpoint", "hf"],
        "--hf-checkpoint hf: config.json is not valid JSON",
    ),
    "hf-config-not-object": (
        lambda r: _hf_dir(r, "[1]"),
        ["--hf-checkpoint", "hf"],
        "--hf-checkpoint hf: config.json holds a list",
    ),
    "hf-without-weights": (
        lambda r: _hf_dir(r, weights=False),
        ["--hf-checkpoint", "hf"],
        "--hf-checkpoint hf: has no model.safetensors",
    ),
    "critic-without-config": (
        lambda r: _hf_dir(r, None),
        ["--algo", "ppo", "--critic-checkpoint", "hf"],
        "--critic-checkpoint hf: has no config.json",
    ),
    "out-dir-is-a-file": (
        lambda r: (r / "run").write_text("x"),
        ["--out-dir", "run"],
        "--out-dir run: is a file, not a directory",
    ),
    "metrics-out-is-a-dir": (lambda r: (r / "m").mkdir(), ["--metrics-out", "m"], "--metrics-out m: is a directory"),
    "metrics-out-under-a-file": (
        lambda r: (r / "f").write_text("x"),
        ["--metrics-out", "f/sub/m.jsonl"],
        "--metrics-out f/sub/m.jsonl: f is a file, not a directory",
    ),
    "profile-out-is-a-dir": (
        lambda r: (r / "p").mkdir(),
        ["--profile-step", "1", "--steps", "1", "--profile-out", "p"],
        "--profile-out p: is a directory",
    ),
    "metrics-out-holds-metrics": (
        lambda r: (r / "m.jsonl").write_text('{"step": 1}\n'),
        ["--metrics-out", "m.jsonl"],
        "--metrics-out m.jsonl already holds metrics; pass --resume",
    ),
    "resume-without-checkpoint": (
        lambda r: (r / "run").mkdir() or (r / "run" / "metrics.jsonl").write_text("{}\n"),
        ["--resume", "--out-dir", "run"],
        "--resume: run has no complete checkpoint",
    ),
    "resume-ppo-as-grpo": (
        _ppo_manifest,
        ["--resume", "--out-dir", "run"],
        "--resume: the checkpoint was written with --algo ppo (now grpo)",
    ),
}


def test_a_checkpoint_the_loader_refuses_is_one_line_and_exit_2(tmp_path):
    """--hf-checkpoint passes the path checks (config.json, weights file) but fnppo.io.hf refuses its
    architecture: exit 2 with fnppo's message, no traceback, nothing created."""
    _hf_dir(tmp_path, json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    before = _tree(tmp_path)
    out = _call(["--hf-checkpoint", "hf", *SMALL, "--steps", "1"], cwd=tmp_path)
    err = out.stderr.strip()
    assert out.returncode == 2 and err.startswith("ppo_toy.py: error: --hf-checkpoint hf: "), (
        out.returncode,
        err[-3000:],
    )
    assert "argument '" in err and len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert _tree(tmp_path) == before


@pytest.mark.parametrize("case", list(PATH_CASES))
def test_invalid_paths_print_one_line_and_exit_2(case, tmp_path):
    """Paths that must exist and look right (a Hugging Face directory: config.json with an object, the
    weights), paths in the way of the files a run writes, and --resume with nothing to resume."""
    setup, args, message = PATH_CASES[case]
    setup(tmp_path)
    _refused([*args, *SMALL], message, tmp_path)


def test_invalid_layout_under_torchrun_is_one_line_from_rank_0(tmp_path):
    out = _call(["--tp", "3", "--out-dir", str(tmp_path / "run")], nproc=2)
    assert out.returncode != 0
    both = out.stdout + out.stderr
    assert both.count("ppo_toy.py: error: --tp 3 x --pp 1 = 3 does not divide the 2 processes") == 1, both[-3000:]
    assert 'ppo_toy.py", line' not in both  # no per-rank Python traceback


def test_help_is_fast_to_reach_and_states_the_exit_codes():
    code = (
        "import runpy, sys\n"
        f"sys.argv = ['ppo_toy.py', '--help']\n"
        "try:\n"
        f"    runpy.run_path({str(EXAMPLE)!r}, run_name='__main__')\n"
        "except SystemExit as e:\n"
        "    assert e.code == 0, e.code\n"
        "assert 'torch' not in sys.modules and 'megatron' not in sys.modules, 'heavy imports before --help'\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert "exit status: 0 when the run finished" in out.stdout and "2 for invalid arguments" in out.stdout


def test_run_directories_are_new_per_run_and_never_overwritten(tmp_path):
    args = ["--steps", "1", *SMALL]
    out = _run([a for a in args if a != "--no-plot"], cwd=tmp_path)  # the first run also draws its plot
    if importlib.util.find_spec("matplotlib") is not None:
        assert (tmp_path / "runs" / "ppo_toy" / "run000" / "ppo_toy.png").stat().st_size > 10_000
    assert "-> PASS: reached the target 0" in out
    _run(args, cwd=tmp_path)
    runs = sorted(p.name for p in (tmp_path / "runs" / "ppo_toy").iterdir())
    assert runs == ["run000", "run001"]
    out = _call([*args, "--out-dir", str(tmp_path / "runs" / "ppo_toy" / "run000")], cwd=tmp_path)
    assert (
        out.returncode == 2
        and "already holds a run; pass --resume to continue it, --overwrite to replace it" in out.stderr
    )
    _run([*args, "--out-dir", str(tmp_path / "runs" / "ppo_toy" / "run000"), "--overwrite"], cwd=tmp_path)
    assert len(_rows(tmp_path / "runs" / "ppo_toy" / "run000" / "metrics.jsonl")) == 1


def test_resume_refuses_missing_checkpoints_and_changed_settings(tmp_path):
    run = str(tmp_path / "run")
    out = _call(["--resume", *SMALL, "--out-dir", run])
    assert out.returncode == 2 and "holds no run to resume" in out.stderr
    out = _call(["--resume", *SMALL], cwd=tmp_path)
    assert out.returncode == 2 and "no run under runs/ppo_toy; start one without --resume" in out.stderr
    _run(["--steps", "2", "--save-every", "2", *SMALL, "--out-dir", run])
    out = _call(["--steps", "2", "--resume", "--lr", "0.01", *SMALL, "--out-dir", run])
    assert out.returncode == 2 and "--resume: the run was written with --lr 0.003 (given: 0.01)" in out.stderr, (
        out.stderr
    )
    out = _call(["--steps", "4", "--resume", "--schedule-steps", "4", *SMALL, "--out-dir", run])
    assert out.returncode == 2 and "--schedule-steps 2 (given: 4)" in out.stderr, out.stderr
    # --resume takes the stored schedule (not one derived from the new --steps): the run goes on past its
    # first --steps and appends to its metrics
    out = _run(["--steps", "3", "--resume", *SMALL, "--out-dir", run])
    assert "(checkpoint of step 2)" in out
    rows = _rows(Path(run) / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[2]["lr"] == pytest.approx(0.003 * 0.1)  # the stored schedule ended at 10% of --lr


def test_moe_first_step_agrees_between_one_process_and_ep2():
    """--moe: experts split over 2 ranks (EP=2, DP=2 for the dense layers) vs one process."""
    ref_loss, ref_norm = _first_step(["--moe"], 1)
    loss, norm = _first_step(["--moe", "--ep", "2"], 2)
    assert abs(loss - ref_loss) <= 1e-4 * abs(ref_loss), (loss, ref_loss)
    assert abs(norm - ref_norm) <= 1e-4 * abs(ref_norm), (norm, ref_norm)


# ---------------------------------------------------------------------------------------------
# where a run's files go: every combination of --out-dir, --metrics-out, --no-plot and --resume,
# and refused resumes; all in one process (ppo_toy.main called in turn), so the imports are paid once
# ---------------------------------------------------------------------------------------------
COMBOS = [
    (out, metrics, plot, resume)
    for out in (False, True)
    for metrics in (False, True)
    for plot in (False, True)
    for resume in (False, True)
]


def _combo_id(out: bool, metrics: bool, plot: bool, resume: bool) -> str:
    return "-".join(
        [
            "out-dir" if out else "numbered",
            "metrics-out" if metrics else "metrics-in-run",
            "plot" if plot else "no-plot",
            "resume" if resume else "fresh",
        ]
    )


def _in_process(argv: list[str], cwd: Path) -> dict:
    """``ppo_toy.main(argv)`` in ``cwd``: its exit status, stdout and stderr."""
    import contextlib
    import io

    sys.path.insert(0, str(ROOT / "examples"))
    import ppo_toy

    out, err = io.StringIO(), io.StringIO()
    here = os.getcwd()
    os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = ppo_toy.main(argv)
    except Exception as exc:  # noqa: BLE001 - reported as this call's outcome, so each test fails on its own
        code = f"{type(exc).__name__}: {exc}"
    finally:
        os.chdir(here)
    return {"code": code, "stdout": out.getvalue(), "stderr": err.getvalue()}


def _files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def _scenarios(root: str) -> dict:
    """Run in a subprocess (see the fixture): every combination, then the refused resumes."""
    root = Path(root)
    base = ["--prompts", "4", "--group-size", "4", "--no-progress", "--target-reward", "0", "--schedule-steps", "2"]
    results: dict = {}
    for out, metrics, plot, resume in COMBOS:
        d = root / _combo_id(out, metrics, plot, resume)
        d.mkdir()
        args = [
            *base,
            *(["--out-dir", "out"] if out else []),
            *(["--metrics-out", "elsewhere/m.jsonl"] if metrics else []),
            *([] if plot else ["--no-plot"]),
        ]
        calls = [_in_process([*args, "--steps", "1", *(["--save-every", "1"] if resume else [])], d)]
        if resume:
            calls.append(_in_process([*args, "--steps", "2", "--save-every", "1", "--resume"], d))
        results[d.name] = {"calls": calls, "files": _files(d)}
    # a damaged checkpoint: --resume refused, nothing changed; --overwrite replaces the run
    d = root / "refused"
    d.mkdir()
    args = [*base, "--no-plot", "--out-dir", "out"]
    first = _in_process([*args, "--steps", "1", "--save-every", "1"], d)
    ckpt = d / "out" / "checkpoints" / "step000001"
    before = _files(d)
    shard = ckpt / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    damaged = _in_process([*args, "--steps", "2", "--resume"], d)
    after_damaged = _files(d)
    overwrite = _in_process([*args, "--steps", "1", "--overwrite"], d)
    results["refused"] = {
        "first": first,
        "damaged": damaged,
        "overwrite": overwrite,
        "before": before,
        "after_damaged": after_damaged,
        "files": _files(d),
    }
    # an invalid value creates nothing, so the same --out-dir then runs
    d = root / "invalid-then-valid"
    d.mkdir()
    results["invalid-then-valid"] = {
        "invalid": _in_process([*args, "--steps", "1", "--tis-cap", "-1"], d),
        "files": _files(d),
        "valid": _in_process([*args, "--steps", "1"], d),
    }
    return results


@pytest.fixture(scope="module")
def scenarios(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("scenarios")
    code = (
        f"import json, sys; sys.path.insert(0, {str(ROOT / 'tests')!r}); import test_example; "
        f"json.dump(test_example._scenarios({str(root)!r}), open({str(root / 'results.json')!r}, 'w'))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=_env(), timeout=900, cwd=root, check=False
    )
    assert out.returncode == 0, out.stderr[-5000:]
    return {**json.loads((root / "results.json").read_text()), "root": str(root)}


@pytest.mark.parametrize("out,metrics,plot,resume", COMBOS, ids=[_combo_id(*c) for c in COMBOS])
def test_every_combination_of_run_directory_metrics_plot_and_resume(scenarios, out, metrics, plot, resume):
    """The run directory (--out-dir, else runs/ppo_toy/run000) holds the plot, the checkpoints and the
    run's lock (``.fnppo.lock``: one run per directory); the metrics go to --metrics-out or the run
    directory; a resume continues the same run and its metrics file."""
    r = scenarios[_combo_id(out, metrics, plot, resume)]
    for call in r["calls"]:
        assert call["code"] == 0, call["stderr"][-3000:]
    run_dir = "out" if out else "runs/ppo_toy/run000"
    metrics_file = "elsewhere/m.jsonl" if metrics else f"{run_dir}/metrics.jsonl"
    expected = {metrics_file, f"{run_dir}/.fnppo.lock"}
    if plot and HAS_MATPLOTLIB:
        expected.add(f"{run_dir}/ppo_toy.png")
        assert f"plot: {run_dir}/ppo_toy.png" in r["calls"][-1]["stdout"]
    if resume:
        expected |= {
            f"{run_dir}/checkpoints/step{s:06d}/{f}"
            for s in (1, 2)
            for f in ("manifest.json", ".metadata", "__0_0.distcp", "common.pt", "metadata.json")
        }
        expected.add(f"{run_dir}/settings.json")  # what a later --resume reads before torch is imported
        assert "resumed from" in r["calls"][1]["stdout"] and "(checkpoint of step 1)" in r["calls"][1]["stdout"]
    assert set(r["files"]) == expected, r["files"]
    assert f"metrics: {metrics_file}" in r["calls"][-1]["stdout"]


def test_metrics_rows_of_every_combination(scenarios):
    """The metrics file holds one row per step: [1] for a fresh run, [1, 2] after the resume."""
    root = Path(scenarios["root"])
    for out, metrics, plot, resume in COMBOS:
        d = root / _combo_id(out, metrics, plot, resume)
        path = d / ("elsewhere/m.jsonl" if metrics else f"{'out' if out else 'runs/ppo_toy/run000'}/metrics.jsonl")
        assert [row["step"] for row in _rows(path)] == ([1, 2] if resume else [1]), d.name


def test_refused_resume_exits_2_with_one_line_and_changes_nothing(scenarios):
    """A damaged checkpoint (a truncated shard file): the refusal becomes one line and exit 2 (no
    traceback), the run directory is left as it was, and --overwrite then replaces the run (the old
    checkpoints are removed with it, so a later --resume cannot continue them)."""
    r = scenarios["refused"]
    assert r["first"]["code"] == 0, r["first"]["stderr"][-3000:]
    err = r["damaged"]["stderr"].strip()
    assert r["damaged"]["code"] == 2, err[-3000:]
    assert err.startswith("ppo_toy.py: error: --resume: latest_checkpoint: argument 'root' expected "), err
    assert "is truncated or altered" in err and "--resume-fallback" in err, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert r["after_damaged"] == r["before"]
    assert r["overwrite"]["code"] == 0, r["overwrite"]["stderr"][-3000:]
    assert r["files"] == ["out/.fnppo.lock", "out/metrics.jsonl"], r["files"]


def test_invalid_value_creates_nothing_and_the_next_run_goes_ahead(scenarios):
    r = scenarios["invalid-then-valid"]
    assert (
        r["invalid"]["code"] == 2
        and r["invalid"]["stderr"].strip() == "ppo_toy.py: error: --tis-cap must be > 0, got -1.0"
    )
    assert r["files"] == []
    assert r["valid"]["code"] == 0, r["valid"]["stderr"][-3000:]


def test_torchrun_tp2_run_resumes_in_one_process(tmp_path):
    """A run saved under ``torchrun --nproc-per-node 2 ... --tp 2 --save-every 1`` continues with
    ``python ppo_toy.py --resume`` in one process: step 3 resumed from the step-2 checkpoint gives the
    uninterrupted two-process run's step 3 (loss and grad norm to 1e-5). A damaged newest checkpoint (step 3)
    is refused with exit 2, and taken over by the previous one only with --resume-fallback."""
    run = tmp_path / "run"
    _run(["--steps", "3", "--save-every", "1", "--tp", "2", *SMALL, "--out-dir", str(run)], nproc=2)
    straight = _rows(run / "metrics.jsonl")
    shard = run / "checkpoints" / "step000003" / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    out = _call(["--steps", "3", "--resume", *SMALL, "--out-dir", str(run)])
    err = out.stderr.strip()
    assert out.returncode == 2 and len(err.splitlines()) == 1, err[-3000:]
    assert "step000003" in err and "sha256 differs from the manifest" in err and "--resume-fallback" in err, err
    out = _call(["--steps", "3", "--resume", "--resume-fallback", *SMALL, "--out-dir", str(run)])
    assert out.returncode == 0, out.stderr[-3000:]
    assert "skipping damaged checkpoint" in out.stderr and "step000003" in out.stderr, out.stderr[-3000:]
    assert "step000002 (checkpoint of step 2)" in out.stdout
    resumed = _rows(run / "metrics.jsonl")
    assert resumed[:2] == straight[:2] and resumed[2]["step"] == 3
    for key in ("loss", "grad_norm"):
        assert abs(resumed[2][key] - straight[2][key]) <= 1e-5 * abs(straight[2][key]), (key, resumed[2], straight[2])
    assert resumed[2]["reward"] == straight[2]["reward"]


def test_lora_run_trains_adapters_only_and_resumes_bit_identically(tmp_path):
    """--lora-rank: the checkpoints hold the adapters and their Adam state only (the base is rebuilt from
    --seed and --init-std), and a preempted run resumes bit for bit."""
    steps = ["--steps", "3", "--lora-rank", "4", *SMALL]
    _run([*steps, "--out-dir", str(tmp_path / "straight"), "--save-every", "1"], code=DRAWING)
    _run([*steps, "--out-dir", str(tmp_path / "resumed"), "--save-every", "1", "--exit-after", "2"], code=DRAWING)
    _run([*steps, "--out-dir", str(tmp_path / "resumed"), "--save-every", "1", "--resume"], code=DRAWING)
    straight = _rows(tmp_path / "straight" / "metrics.jsonl")
    assert straight == _rows(tmp_path / "resumed" / "metrics.jsonl")
    final = [_checkpoint(d / "checkpoints" / "step000003") for d in (tmp_path / "straight", tmp_path / "resumed")]
    model_keys = [k for k in final[0]["tensors"] if not k.startswith("optimizer.")]
    assert model_keys and all(".lora_" in k for k in model_keys), model_keys
    moments = [k for k in final[0]["tensors"] if k.startswith("optimizer.state.exp_avg")]
    assert any(k.endswith("linear_qkv.lora_B") for k in moments) and all(".lora_" in k for k in moments), moments
    assert _bit_diff(*final) == []


def test_stale_rollouts_sample_with_the_policy_k_updates_old(tmp_path):
    """``--staleness K``: step t (0-based) samples with the weights after update max(0, t - K). So runs with
    K = 1 and K = 2 agree bit for bit on steps 1 and 2 (both sample with the initial weights) and part at
    step 3 (K = 1 samples with the weights after one update, K = 2 still with the initial ones); the first
    step is on-policy (the KL between the sampler and the trainer's recompute is rounding only), the second
    is not; a bf16 sampler (``--sampler-dtype bf16``) is off-policy by its numerics alone, by much less."""
    common = [*SMALL, "--steps", "3", "--policy-loss", "tis"]
    rows = {}
    for k in (1, 2):
        _run([*common, "--staleness", str(k), "--out-dir", str(tmp_path / f"k{k}")])
        rows[k] = _rows(tmp_path / f"k{k}" / "metrics.jsonl")
    assert rows[1][:2] == rows[2][:2]  # (the staleness metrics too: 0 and 1 update in both)
    assert rows[1][2]["loss"] != rows[2][2]["loss"]
    assert [r["offpolicy/staleness"] for r in rows[2]] == [0.0, 1.0, 2.0]
    kl = [r["offpolicy/kl_behaviour_k3"] for r in rows[2]]
    assert kl[0] < 1e-6 < 1e-4 < kl[1] < kl[2], kl
    _run([*common, "--steps", "1", "--sampler-dtype", "bf16", "--out-dir", str(tmp_path / "bf16")])
    (bf16,) = _rows(tmp_path / "bf16" / "metrics.jsonl")
    assert 1e-7 < bf16["offpolicy/kl_behaviour_k3"] < min(1e-3, kl[1]), (bf16, kl)
