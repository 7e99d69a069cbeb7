"""A complete PPO/GRPO run that a tiny Megatron GPT learns from scratch on a laptop CPU.

Task ("count on"): the prompt is ``BOS a`` with a random symbol ``a`` out of 8 (ordered cyclically);
the ideal response is the 4 symbols that follow it, ``a+1 a+2 a+3 a+4`` (mod 8). The reward is the
fraction of response positions that are right, so a random policy (over 16 tokens) scores about
1/16 and a perfect one 1.0.

Each step: prompts -> responses sampled from the current policy (temperature sampling through
Megatron's forward-only schedule) -> rewards -> GRPO group-normalized advantages -> old and
reference log-probs (``compute_logprobs``) -> ``train_step`` (clipped PPO, optional entropy bonus,
k3 KL to the reference, optional TIS).

``--algo ppo``: PPO with a critic instead of group advantages. A value model
(``build_gpt(cfg, head="value")``, its own ``TrainState`` and optimizer, starting from the actor's
initial trunk with a fresh value head, or from a Hugging Face value model with
``--critic-checkpoint DIR``: a token or sequence classifier with one label, or a TRL / OpenRLHF /
verl critic, read by ``fnppo.io.hf``) gives the values of the response tokens
(``compute_values``); each response token earns its own reward (1/4 when it is right, so the
tokens' rewards sum to the sequence reward), and GAE (``--gamma``, ``--lam``) turns rewards and
values into per-token advantages and returns. Every step runs one ``train_step`` of the actor and
one ``critic_step`` of the critic (clipped value loss, ``--value-clip``, learning rate
``--critic-lr`` on the same schedule); both are in the checkpoints. With ``--kl-target`` the KL coefficient follows the adaptive
controller of Ziegler et al. (``fnppo.kl.adaptive_kl_init`` / ``adaptive_kl_update``, starting at
``--kl-coef``); its state is a value of the loop, saved in the checkpoints and restored on ``--resume``.

    python examples/ppo_toy.py                                   # 1 process, CPU
    torchrun --nproc-per-node 2 examples/ppo_toy.py --tp 2       # gloo on CPU, or NCCL with --device cuda
    python examples/ppo_toy.py --algo ppo                        # PPO with a critic and GAE
    python examples/ppo_toy.py --moe                             # Mixture of Experts (4 experts, top-2)
    torchrun --nproc-per-node 2 examples/ppo_toy.py --moe --ep 2 # experts split over 2 ranks
    python examples/ppo_toy.py --steps 1 --layout-check --target-reward 0   # first-step loss/grad norm
    python examples/ppo_toy.py --batch-invariant                 # rollout == trainer log-probs, ratio - 1 = 0
    python examples/ppo_toy.py --lora-rank 8                     # LoRA: adapters train, the base stays frozen

Each run writes to its own directory (``runs/ppo_toy/run000``, ``run001``, ... or ``--out-dir``),
created when its first file is written: ``metrics.jsonl`` (unless ``--metrics-out`` puts the metrics
elsewhere), ``ppo_toy.png`` (unless ``--no-plot``), ``profile.txt`` (``--profile-step``, unless
``--profile-out``), with ``--save-every``, checkpoints, and with ``--log tensorboard,wandb,mlflow`` (any
subset; rank 0; ``--log-to`` under torchrun, which takes ``--log`` for its own ``--log-dir``) the metrics and the run's settings for those tools: ``tensorboard/``, ``wandb/`` (offline)
and ``mlruns/`` (MLflow's file store). Without a terminal (CI logs) the progress bar is a line every
``--progress-every`` steps. ``--resume`` continues the newest run (or
``--out-dir``) from its newest checkpoint, bit-identical to an uninterrupted run (data and sampling
are functions of (seed, step); the run's settings are stored in the checkpoint), in any layout: a run
saved under ``torchrun --nproc-per-node 2 ... --tp 2`` continues in one process (``--tp``, ``--pp``,
``--ep`` and the number of processes may change; the next steps agree to float rounding). A damaged
newest checkpoint is refused unless ``--resume-fallback`` (then the previous one is used); ``--overwrite``
replaces the run in ``--out-dir`` (its metrics and checkpoints are removed when the run starts).
Every argument is checked before anything is imported or created: an invalid one, or a refused
``--resume`` (other settings, a damaged checkpoint), ends with one line and exit 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import sys
import time
from pathlib import Path

# An example script may import its heavy dependencies late: torch, Megatron and fnppo are imported only
# on the run path, after every argument (numbers, paths, the run directory, --resume) is validated, so
# --help and a refused command line take a fraction of a second and create nothing.

PAD, BOS = 0, 1
FIRST_SYMBOL, NUM_SYMBOLS = 2, 8
VOCAB = 16
PROMPT_LEN, RESPONSE_LEN = 2, 4
FINAL_WINDOW = 5  # the final reward is the mean over this many last steps
RUNS_ROOT = Path("runs/ppo_toy")
#: flags that define a run's trajectory: a resume must use the values stored in the checkpoint
RUN_DEFINING = (
    "seed",
    "dtype",
    "prompts",
    "group_size",
    "num_microbatches",
    "max_tokens_per_microbatch",
    "minibatches",
    "lr",
    "lr_final",
    "schedule_steps",
    "temperature",
    "entropy_coeff",
    "kl_coef",
    "tis_cap",
    "advantage",
    "hidden",
    "layers",
    "hf_checkpoint",
    "kl_target",
    "kl_horizon",
    "moe",
    "moe_experts",
    "moe_topk",
    "moe_aux_coeff",
    "moe_z_coeff",
    "spec",
    "batch_invariant",
    "lora_rank",
    "lora_alpha",
    "lora_lr",
    "init_std",
    "lora_output_std",
)
#: the run-defining flags of --algo ppo (stored only for PPO runs, so GRPO checkpoints keep their settings)
PPO_DEFINING = ("algo", "gamma", "lam", "critic_lr", "value_clip", "critic_checkpoint", "whiten")
SETTING_DEFAULTS = {
    "algo": "grpo",
    "spec": "default",
    "critic_checkpoint": None,
    "batch_invariant": False,
    "whiten": False,
    "lora_rank": 0,
    "lora_alpha": None,
    "lora_lr": None,
    "init_std": None,
    "lora_output_std": None,
}  # what a checkpoint without the key was written with
DEFAULT_KL_HORIZON = 10_000.0
#: the random base of a LoRA run has its own (untied) output layer of this std: the frozen output layer
#: bounds the logits' range, at 0.02 the best symbol's probability stays below 0.2 (docs/lora.md)
LORA_OUTPUT_STD = 0.15
LORA_LR = 5e-3

EPILOG = """\
exit status: 0 when the run finished and its final reward (mean of the last 5 steps) reached
--target-reward (pass --target-reward 0 to skip the check), or it stopped at --exit-after;
1 when the final reward missed the target; 2 for invalid arguments or a refused --resume.
"""


class ArgumentError(Exception):
    """An invalid command line: printed as one line on rank 0, exit status 2."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="ppo_toy.py",
        description=__doc__.splitlines()[0],
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--steps", type=int, default=100, help="training steps (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel size")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--prompts", type=int, default=16, help="prompts per step (global)")
    p.add_argument("--group-size", type=int, default=32, help="responses per prompt (GRPO group)")
    p.add_argument("--num-microbatches", type=int, default=None, help="micro-batches per mini-batch (default 2)")
    p.add_argument("--max-tokens-per-microbatch", type=int, default=None, help="token budget per micro-batch")
    p.add_argument("--minibatches", type=int, default=2, help="optimizer steps per training step")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    p.add_argument("--lr-final", type=float, default=0.1, help="final lr as a fraction of --lr (linear decay)")
    p.add_argument("--schedule-steps", type=int, default=None, help="steps over which the lr decays (default: --steps)")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--entropy-coeff", type=float, default=0.0)
    p.add_argument("--kl-coef", type=float, default=0.001, help="KL coefficient (the start value with --kl-target)")
    p.add_argument(
        "--kl-target",
        type=float,
        default=None,
        help="adaptive KL controller (Ziegler et al.): target k3 KL to the reference per token (off by default)",
    )
    p.add_argument(
        "--kl-horizon",
        type=float,
        default=None,
        help=f"horizon of the adaptive KL controller in samples (default {DEFAULT_KL_HORIZON:g})",
    )
    p.add_argument("--tis-cap", type=float, default=None, help="truncated importance sampling cap (off by default)")
    p.add_argument("--advantage", choices=["grpo", "rloo"], default="grpo", help="group advantage of --algo grpo")
    p.add_argument(
        "--algo",
        choices=["grpo", "ppo"],
        default="grpo",
        help="grpo: group advantages; ppo: a critic (value model) and GAE (default: %(default)s)",
    )
    p.add_argument("--gamma", type=float, default=1.0, help="--algo ppo: GAE discount (default: %(default)s)")
    p.add_argument("--lam", type=float, default=0.95, help="--algo ppo: GAE lambda (default: %(default)s)")
    p.add_argument(
        "--critic-lr", type=float, default=None, help="--algo ppo: the critic's peak learning rate (default: --lr)"
    )
    p.add_argument(
        "--whiten",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="--algo ppo: whiten the GAE advantages over the batch (fnppo.advantages.whiten; default: on)",
    )
    p.add_argument(
        "--value-clip", type=float, default=0.2, help="--algo ppo: value clipping range (default: %(default)s)"
    )
    p.add_argument(
        "--critic-checkpoint",
        type=str,
        default=None,
        help="--algo ppo: start the critic from this Hugging Face value model (default: the actor's initial trunk, a fresh value head)",
    )
    p.add_argument(
        "--spec",
        choices=["default", "local", "te"],
        default="default",
        help="layer spec: build_gpt's default (Transformer Engine's when installed, else fnppo's local spec), local or te",
    )
    p.add_argument(
        "--batch-invariant",
        action="store_true",
        help="batch-invariant numerics (ModelConfig(batch_invariant=True)): rollout log-probs equal compute_logprobs' "
        "bit for bit and the first update's ratio - 1 is exactly 0 (reported per step)",
    )
    p.add_argument(
        "--lora-rank",
        type=int,
        default=0,
        help="LoRA adapters of this rank on every linear of the policy; the base stays frozen and the reference "
        "policy is the base (the adapters switched off, no second model). 0: full-weight training (default)",
    )
    p.add_argument("--lora-alpha", type=float, default=None, help="LoRA alpha (default: 2 x --lora-rank)")
    p.add_argument("--lora-lr", type=float, default=None, help="peak learning rate of the adapters (default: 5e-3)")
    p.add_argument(
        "--lora-output-std",
        type=float,
        default=None,
        help="with --lora-rank and a random base: the base has its own output layer (untied), drawn with this std "
        "(default: 0.15, see docs/lora.md)",
    )
    p.add_argument(
        "--init-std",
        type=float,
        default=None,
        help="std of the random model's initial matrices (default: Megatron's 0.02)",
    )
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--moe", action="store_true", help="Mixture-of-Experts MLPs (--moe-experts, top --moe-topk)")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel size (with --moe)")
    p.add_argument("--moe-experts", type=int, default=4)
    p.add_argument("--moe-topk", type=int, default=2)
    p.add_argument("--moe-aux-coeff", type=float, default=0.0, help="load-balancing aux loss coefficient (0: off)")
    p.add_argument("--moe-z-coeff", type=float, default=1e-3, help="router z-loss coefficient")
    p.add_argument(
        "--hf-checkpoint",
        type=str,
        default=None,
        help="start from a Hugging Face checkpoint directory (Llama/Qwen2/Qwen3)",
    )
    p.add_argument("--out-dir", type=str, default=None, help="run directory (default: a new runs/ppo_toy/runNNN)")
    p.add_argument("--overwrite", action="store_true", help="replace the run in --out-dir instead of refusing")
    p.add_argument("--metrics-out", type=str, default=None, help="JSONL metrics file (default: OUT_DIR/metrics.jsonl)")
    p.add_argument("--save-every", type=int, default=0, help="checkpoint every N steps (0: off)")
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue --out-dir (default: the newest run) from its newest checkpoint, in any --tp/--pp/--ep layout",
    )
    p.add_argument(
        "--resume-fallback",
        action="store_true",
        help="with --resume: if the newest checkpoint is damaged, report it and resume from the previous one",
    )
    p.add_argument(
        "--exit-after",
        type=int,
        default=None,
        help="stop after this many steps of this invocation (simulates a preempted job)",
    )
    p.add_argument(
        "--target-reward", type=float, default=0.9, help="exit 1 if the final reward is below it (default: %(default)s)"
    )
    p.add_argument(
        "--layout-check", action="store_true", help="print the first step's loss and grad norm with full precision"
    )
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--no-progress", action="store_true")
    add_logging_args(p)
    p.add_argument(
        "--profile-step",
        type=int,
        default=None,
        help="profile this step (1-based): wall time per phase, torch.profiler and cProfile summaries",
    )
    p.add_argument(
        "--profile-out",
        type=str,
        default=None,
        help="file for the --profile-step report (default: OUT_DIR/profile.txt)",
    )
    args = p.parse_args(argv)
    if args.schedule_steps is None:
        args.schedule_steps = args.steps
    if args.critic_lr is None:
        args.critic_lr = args.lr
    return args


def validate_args(args: argparse.Namespace, world_size: int, cuda_available: bool) -> None:
    """Raise :class:`ArgumentError` for a command line that cannot run: numbers out of range (NaN and
    infinities included), combinations, paths that must exist (``--hf-checkpoint`` /
    ``--critic-checkpoint``: a Hugging Face checkpoint directory) or must not be in the way, the run
    directory (a run in ``--out-dir`` without ``--resume`` / ``--overwrite``, ``--resume`` with nothing
    to resume). Pure Python and read-only: runs before torch is imported and before anything is created."""
    for name in (
        "steps",
        "prompts",
        "group_size",
        "minibatches",
        "hidden",
        "layers",
        "tp",
        "pp",
        "schedule_steps",
        "moe_experts",
        "moe_topk",
    ):
        if getattr(args, name) < 1:
            raise ArgumentError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    for name in ("num_microbatches", "max_tokens_per_microbatch", "exit_after", "profile_step"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise ArgumentError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    check_logging_args(args)
    if args.lora_rank < 0:
        raise ArgumentError(f"--lora-rank must be >= 0, got {args.lora_rank}")
    for name in ("lora_alpha", "lora_lr", "lora_output_std"):
        value = getattr(args, name)
        if value is not None and not (value > 0 and math.isfinite(value) and args.lora_rank > 0):
            raise ArgumentError(f"--{name.replace('_', '-')} needs --lora-rank > 0 and a finite value > 0, got {value}")
    if args.save_every < 0:
        raise ArgumentError(f"--save-every must be >= 0, got {args.save_every}")
    if not (args.lr > 0 and 0 <= args.lr_final <= 1 and args.temperature > 0):
        raise ArgumentError(
            f"need --lr > 0, 0 <= --lr-final <= 1 and --temperature > 0, got {args.lr}, {args.lr_final}, {args.temperature}"
        )
    _check_floats(args)
    if args.spec != "default" and args.hf_checkpoint:
        raise ArgumentError("--spec applies to the random model; --hf-checkpoint builds its own")
    if args.batch_invariant and (args.tp > 1 or args.hf_checkpoint):
        raise ArgumentError(
            "--batch-invariant runs with --tp 1 (the sampler compares full-vocabulary log-probs) and without --hf-checkpoint"
        )
    if args.device == "cuda" and not cuda_available:
        raise ArgumentError(
            "--device cuda: this torch has no CUDA device (torch.cuda.is_available() is False); use --device cpu"
        )
    if args.ep < 1 or (args.ep > 1 and not args.moe):
        raise ArgumentError(f"--ep must be >= 1 and needs --moe, got --ep {args.ep}")
    if args.moe and (args.tp > 1 or args.hf_checkpoint):
        raise ArgumentError(
            "--moe runs without --tp (Megatron trains MoE under TP only with sequence parallelism) and without --hf-checkpoint"
        )
    if args.moe and (
        args.moe_experts % args.ep or not 1 <= args.moe_topk <= args.moe_experts or world_size % (args.ep * args.pp)
    ):
        raise ArgumentError(
            f"--moe needs --ep dividing --moe-experts and the processes per stage, and 1 <= --moe-topk <= --moe-experts; got --ep {args.ep}, --moe-experts {args.moe_experts}, --moe-topk {args.moe_topk}"
        )
    if world_size % (args.tp * args.pp):
        raise ArgumentError(
            f"--tp {args.tp} x --pp {args.pp} = {args.tp * args.pp} does not divide the {world_size} processes"
        )
    dp = world_size // (args.tp * args.pp)
    if args.prompts % dp:
        raise ArgumentError(f"--prompts {args.prompts} must be divisible by the data-parallel size {dp}")
    if args.overwrite and args.resume:
        raise ArgumentError("--overwrite and --resume exclude each other")
    if args.resume_fallback and not args.resume:
        raise ArgumentError("--resume-fallback applies to --resume")
    if args.critic_checkpoint and (args.algo != "ppo" or args.moe):
        raise ArgumentError("--critic-checkpoint needs --algo ppo (a critic) and runs without --moe")
    if args.algo == "ppo":
        if args.advantage != "grpo":
            raise ArgumentError(
                "--advantage chooses the group advantage of --algo grpo; --algo ppo uses GAE (--gamma, --lam)"
            )
        if not (0 <= args.gamma <= 1 and 0 <= args.lam <= 1 and args.critic_lr > 0 and args.value_clip > 0):
            raise ArgumentError(
                f"--algo ppo needs 0 <= --gamma <= 1, 0 <= --lam <= 1, --critic-lr > 0 and --value-clip > 0, got "
                f"{args.gamma}, {args.lam}, {args.critic_lr}, {args.value_clip}"
            )
    if args.kl_horizon is not None and args.kl_target is None:
        raise ArgumentError("--kl-horizon needs --kl-target")
    if args.kl_target is not None:
        horizon = kl_horizon(args)
        if not (args.kl_target > 0 and horizon > 0 and args.kl_coef > 0):
            raise ArgumentError(
                f"--kl-target needs --kl-target > 0, --kl-horizon > 0 and --kl-coef > 0, got "
                f"{args.kl_target}, {horizon}, {args.kl_coef}"
            )
        if 0.2 * args.prompts * args.group_size >= horizon:
            raise ArgumentError(
                f"--kl-horizon {horizon:g} must exceed 0.2 x the {args.prompts * args.group_size} samples per step"
            )
    if args.profile_out is not None and args.profile_step is None:
        raise ArgumentError("--profile-out needs --profile-step")
    if args.profile_step is not None and args.profile_step > args.steps:
        raise ArgumentError(f"--profile-step {args.profile_step} is beyond --steps {args.steps}: that step never runs")
    for flag, path in (("--hf-checkpoint", args.hf_checkpoint), ("--critic-checkpoint", args.critic_checkpoint)):
        if path is not None:
            check_hf_directory(flag, path)
    check_run_paths(args)


def _check_floats(args: argparse.Namespace) -> None:
    """Every float flag finite (NaN and infinities refused), coefficients >= 0, ``--tis-cap`` > 0."""
    for name in (
        "lr",
        "lr_final",
        "temperature",
        "entropy_coeff",
        "kl_coef",
        "kl_target",
        "kl_horizon",
        "tis_cap",
        "gamma",
        "lam",
        "critic_lr",
        "value_clip",
        "moe_aux_coeff",
        "moe_z_coeff",
        "target_reward",
    ):
        value = getattr(args, name)
        if value is not None and not math.isfinite(value):
            raise ArgumentError(f"--{name.replace('_', '-')} must be a finite number, got {value}")
    for name in ("entropy_coeff", "kl_coef", "moe_aux_coeff", "moe_z_coeff"):
        if getattr(args, name) < 0:
            raise ArgumentError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    if args.tis_cap is not None and args.tis_cap <= 0:
        raise ArgumentError(f"--tis-cap must be > 0, got {args.tis_cap}")


def check_hf_directory(flag: str, path: str) -> None:
    """Refuse a ``flag`` path that is not a Hugging Face checkpoint directory: it must exist, be a
    directory, hold a ``config.json`` with a JSON object and ``model.safetensors`` (or its index)."""
    d = Path(path)
    if not d.exists():
        raise ArgumentError(f"{flag} {path}: does not exist")
    if not d.is_dir():
        raise ArgumentError(f"{flag} {path}: is not a directory (a Hugging Face checkpoint directory is expected)")
    config = d / "config.json"
    if not config.is_file():
        raise ArgumentError(f"{flag} {path}: has no config.json (not a Hugging Face checkpoint directory)")
    try:
        parsed = json.loads(config.read_text())
    except (OSError, ValueError) as err:  # (json.JSONDecodeError and UnicodeDecodeError are ValueErrors)
        raise ArgumentError(f"{flag} {path}: config.json is not valid JSON ({err})") from None
    if not isinstance(parsed, dict):
        raise ArgumentError(f"{flag} {path}: config.json holds a {type(parsed).__name__}, not a JSON object")
    if not ((d / "model.safetensors").is_file() or (d / "model.safetensors.index.json").is_file()):
        raise ArgumentError(f"{flag} {path}: has no model.safetensors or model.safetensors.index.json (the weights)")


def _check_file_target(flag: str, path: str) -> None:
    """``path`` can become a file: it is no directory, and its nearest existing ancestor is a directory."""
    p = Path(path)
    if p.is_dir():
        raise ArgumentError(f"{flag} {path}: is a directory (a file path is expected)")
    parent = p.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if parent.exists() and not parent.is_dir():
        raise ArgumentError(f"{flag} {path}: {parent} is a file, not a directory")


def newest_checkpoint(root: Path) -> Path | None:
    """The complete checkpoint (a directory with a readable ``manifest.json``) with the highest step
    under ``root``, or None: what ``fnppo.checkpoint.latest_checkpoint`` finds, in plain Python (no torch)."""
    best: tuple[int, Path] | None = None
    for d in root.iterdir() if root.is_dir() else ():
        try:
            step = int(json.loads((d / "manifest.json").read_text())["step"])
        except (OSError, ValueError, KeyError, TypeError):  # (json.JSONDecodeError is a ValueError)
            continue
        if best is None or step > best[0]:
            best = (step, d)
    return None if best is None else best[1]


def check_run_paths(args: argparse.Namespace, root: Path | None = None) -> None:
    """The run directory and the files the run will write: ``--out-dir`` (a directory or nothing),
    ``--metrics-out`` / ``--profile-out`` (file paths; a non-empty ``--metrics-out`` only with
    ``--resume`` or ``--overwrite``), the run to resume (a complete checkpoint written with this
    ``--algo``), no run to replace without ``--overwrite`` (:func:`choose_run_dir`)."""
    if args.out_dir is not None and Path(args.out_dir).exists() and not Path(args.out_dir).is_dir():
        raise ArgumentError(f"--out-dir {args.out_dir}: is a file, not a directory")
    for flag, path in (("--metrics-out", args.metrics_out), ("--profile-out", args.profile_out)):
        if path is not None:
            _check_file_target(flag, path)
    out_dir = choose_run_dir(args, root)
    if args.metrics_out is not None and not (args.resume or args.overwrite):
        m = Path(args.metrics_out)
        if m.is_file() and m.stat().st_size > 0:
            raise ArgumentError(
                f"--metrics-out {m} already holds metrics; pass --resume to continue its run, "
                "--overwrite to replace it, or another --metrics-out"
            )
    if args.resume:
        latest = newest_checkpoint(out_dir / "checkpoints")
        if latest is None:
            raise ArgumentError(f"--resume: {out_dir} has no complete checkpoint (write some with --save-every N)")
        stored = json.loads((latest / "manifest.json").read_text()).get("states")
        if stored != (["policy", "critic"] if args.algo == "ppo" else None):
            raise ArgumentError(
                f"--resume: the checkpoint was written with --algo {'ppo' if stored else 'grpo'} "
                f"(now {args.algo}); resume with the stored values"
            )


# ---------------------------------------------------------------------------------------------
# the task
# ---------------------------------------------------------------------------------------------
def make_prompts(seed: int, step: int, n: int):
    """``[n, PROMPT_LEN]`` prompts ``BOS a``; a function of (seed, step) only."""
    import torch

    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    sym = torch.randint(FIRST_SYMBOL, FIRST_SYMBOL + NUM_SYMBOLS, (n, 1), generator=g)
    return torch.cat([torch.full((n, 1), BOS), sym], dim=1)


def reward(prompt, response) -> float:
    """Fraction of response positions equal to ``a+1, a+2, ...`` (mod NUM_SYMBOLS)."""
    import torch

    a = int(prompt[1]) - FIRST_SYMBOL
    target = FIRST_SYMBOL + (a + 1 + torch.arange(response.numel())) % NUM_SYMBOLS
    return float((response == target).float().mean()) if response.numel() else 0.0


def token_rewards(prompt, response):
    """Per-token rewards of ``--algo ppo``: ``1 / RESPONSE_LEN`` for each right token (they sum to :func:`reward`)."""
    import torch

    a = int(prompt[1]) - FIRST_SYMBOL
    target = FIRST_SYMBOL + (a + 1 + torch.arange(response.numel())) % NUM_SYMBOLS
    return (response == target).float() / max(1, response.numel())


# ---------------------------------------------------------------------------------------------
# sampling through Megatron's forward-only schedule (works for any TP/PP layout)
# ---------------------------------------------------------------------------------------------
def sample_responses(chunks, prompts, uniforms, *, temperature: float, layout, device, invariant: bool = False):
    """Autoregressive sampling by inverse CDF with given uniforms ``[n, RESPONSE_LEN]``.

    Returns tokens ``[n, RESPONSE_LEN]`` and their log-probs (fp32). The uniforms are drawn for the
    global batch from (seed, step), so every layout samples the same tokens. Only the ``VOCAB`` real
    columns are sampled from (a padded vocabulary's extra columns are never drawn). ``invariant``
    (a batch-invariant model): the log-probs are :func:`invariant_logprobs`, bit for bit those of
    ``compute_logprobs``.
    """
    import torch

    import fnppo

    n = prompts.shape[0]
    seqs = prompts.clone()
    logps = torch.zeros(n, RESPONSE_LEN)
    for t in range(RESPONSE_LEN):
        samples = [fnppo.Sample(prompt_ids=seqs[i], response_ids=seqs.new_zeros(0)) for i in range(n)]
        mb = fnppo.collate_microbatch(samples, layout="padded", pad_to_multiple_of=1)
        mb = _to(mb, device)

        def last_logits(logits, mb):
            return gather_vocab(logits[:, -1, :].float(), layout)[:, :VOCAB]

        out = fnppo.forward_only(chunks, [mb], last_logits)
        pick = torch.zeros(2, n)
        if out is not None:
            logp = torch.log_softmax(out[0].cpu().double() / temperature, dim=-1)
            cdf = logp.exp().cumsum(-1)
            tok = (cdf < uniforms[:, t : t + 1].double() * cdf[:, -1:]).sum(-1).clamp_max(VOCAB - 1)
            pick[0] = tok.float()
            pick[1] = logp.gather(1, tok[:, None]).squeeze(1).float()
            if invariant:  # the inference engine's log-probs computed as the trainer computes them
                pick[1] = invariant_logprobs(out[0], tok, temperature, layout).cpu()
        pick = from_last_stage(pick, layout, device)
        seqs = torch.cat([seqs, pick[0].long()[:, None]], dim=1)
        logps[:, t] = pick[1]
    return seqs[:, PROMPT_LEN:], logps


def invariant_logprobs(logits, tokens, temperature: float, layout):
    """``log softmax(logits / T)[token]`` by fnppo's log-prob kernel under batch-invariant numerics:
    with the model's batch-invariant forward, bit for bit what ``compute_logprobs`` gives the token
    (one tensor-parallel rank: ``logits`` are the full vocabulary)."""
    import fnppo
    from fnppo.core.batch_invariant import batch_invariant

    with batch_invariant(True):
        lp, _ = fnppo.logprob_and_entropy(
            logits[:, None, :].float(),
            tokens[:, None].to(logits.device),
            temperature=temperature,
            with_entropy=False,
            vocab_size=VOCAB,
            impl="torch",
        )
    return lp[:, 0].float()


def gather_vocab(x, layout):
    """``x [n, vocab_shard]`` of every tensor-parallel rank, concatenated: ``[n, padded vocab]``."""
    import torch
    import torch.distributed as dist

    if layout.tp == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(layout.tp)]
    dist.all_gather(parts, x.contiguous(), group=layout.tp_group)
    return torch.cat(parts, dim=-1)


def from_last_stage(x, layout, device):
    """The last pipeline stage's ``x`` (a CPU tensor) on every stage."""
    import torch.distributed as dist

    if layout.pp == 1:
        return x
    buf = x.to(device)
    dist.broadcast(buf, src=dist.get_global_rank(layout.pp_group, layout.pp - 1), group=layout.pp_group)
    return buf.cpu()


def _to(mb, device):
    if device.type == "cpu":
        return mb
    import optree

    return optree.tree_map(lambda x: x.to(device), mb, namespace="fnppo")


# ---------------------------------------------------------------------------------------------
# setup
# ---------------------------------------------------------------------------------------------
def build(args: argparse.Namespace, head: str = "lm"):
    """The actor's (``head="lm"``) or the critic's (``head="value"``) train state.

    The critic has the actor's architecture and initial trunk (the same checkpoint, or the same
    layout-invariant initialization from ``--seed``) and a fresh value head; with
    ``--critic-checkpoint`` it is that value model, head included.
    """
    import fnppo

    checkpoint = args.critic_checkpoint if head == "value" and args.critic_checkpoint else args.hf_checkpoint
    if checkpoint:
        from fnppo.io.hf import build_gpt_from_hf, load_hf_weights

        flag = "--critic-checkpoint" if checkpoint == args.critic_checkpoint and head == "value" else "--hf-checkpoint"
        try:  # a checkpoint fnppo.io.hf refuses (architecture, names, shapes) is a refused argument: exit 2
            chunks = build_gpt_from_hf(checkpoint, dtype=args.dtype, head=head)
            load_hf_weights(
                chunks, checkpoint
            )  # a value model: the trunk (and a value checkpoint's head); lm_head is skipped
        except fnppo.InputError as err:
            raise ArgumentError(f"{flag} {checkpoint}: {err}") from None
    else:
        cfg = fnppo.ModelConfig(
            num_layers=args.layers,
            hidden_size=args.hidden,
            num_attention_heads=4,
            num_query_groups=2,
            ffn_hidden_size=2 * args.hidden,
            vocab_size=VOCAB,
            max_seq_len=PROMPT_LEN + RESPONSE_LEN,
            dtype=args.dtype,
            tie_embeddings=not (args.lora_rank and head == "lm"),
            **(moe_fields(args) if args.moe else {}),
            **({"batch_invariant": True, "deterministic": True} if args.batch_invariant else {}),
        )
        if args.spec == "te" and not fnppo.models.te_available():
            raise ArgumentError("--spec te: Transformer Engine is not installed (pip install 'fnppo[te]')")
        spec = {"default": None, "local": fnppo.models.local_layer_spec, "te": fnppo.models.default_layer_spec}[
            args.spec
        ]
        chunks = fnppo.build_gpt(cfg, head=head, layer_spec=None if spec is None else spec(cfg))
        fnppo.models.layout_invariant_init(chunks, seed=args.seed, std=init_std(args))
        if head == "lm" and args.lora_rank:  # a base whose frozen output layer can express sure answers
            scale_output_layer(chunks, lora_output_std(args) / init_std(args))
    if head == "lm" and args.lora_rank:  # adapters on the policy; only they train (the critic stays full)
        fnppo.lora.apply_lora(chunks, lora_config(args))
    ddp = fnppo.wrap_ddp(chunks, use_distributed_optimizer=True)
    optimizer = fnppo.build_optimizer(
        ddp, lr=args.critic_lr if head == "value" else policy_lr(args), clip_grad=1.0, weight_decay=0.0
    )
    return fnppo.TrainState(model=ddp, optimizer=optimizer, step=0)


def lora_config(args: argparse.Namespace):
    """The policy's ``fnppo.lora.LoRAConfig`` (every linear; alpha default 2 x rank; ``A`` from ``--seed``)."""
    import fnppo

    alpha = args.lora_alpha if args.lora_alpha is not None else 2.0 * args.lora_rank
    return fnppo.lora.LoRAConfig(rank=args.lora_rank, alpha=alpha, seed=args.seed)


def init_std(args: argparse.Namespace) -> float:
    """The random model's initial std: ``--init-std``, else Megatron's 0.02."""
    return args.init_std if args.init_std is not None else 0.02


def lora_output_std(args: argparse.Namespace) -> float:
    """The std of a LoRA run's random output layer: ``--lora-output-std``, else :data:`LORA_OUTPUT_STD`."""
    return args.lora_output_std if args.lora_output_std is not None else LORA_OUTPUT_STD


def scale_output_layer(chunks, factor: float) -> None:
    """Multiply the (untied) output layer of freshly built chunks by ``factor`` (its weights are then
    N(0, (factor x init std)^2), the same in every layout); the last pipeline stage holds it."""
    import torch

    import fnppo

    with torch.no_grad():
        for chunk in chunks:
            layer = getattr(fnppo.models.unwrap_model(chunk), "output_layer", None)
            if layer is not None and layer.weight is not None:
                layer.weight.copy_(layer.weight * factor)


def policy_lr(args: argparse.Namespace) -> float:
    """The policy's peak learning rate: ``--lr``, or with LoRA ``--lora-lr`` (default :data:`LORA_LR`)."""
    if not args.lora_rank:
        return args.lr
    return args.lora_lr if args.lora_lr is not None else LORA_LR


def moe_fields(args: argparse.Namespace) -> dict:
    """ModelConfig MoE fields of the command line (aux loss off unless --moe-aux-coeff > 0)."""
    return dict(
        num_experts=args.moe_experts,
        moe_topk=args.moe_topk,
        moe_ffn_hidden_size=2 * args.hidden,
        moe_load_balancing="aux_loss" if args.moe_aux_coeff > 0 else "none",
        moe_aux_loss_coeff=args.moe_aux_coeff,
        moe_z_loss_coeff=args.moe_z_coeff or None,
    )


def step_config(args: argparse.Namespace):
    import fnppo

    loss = fnppo.losses.from_flat(
        policy_loss="ppo",
        loss_agg_mode="token-mean",
        entropy_coeff=args.entropy_coeff,
        kl_coef=args.kl_coef,
        kl_estimator="k3",
        tis_cap=args.tis_cap,
    )
    split = {}
    if args.max_tokens_per_microbatch:
        split["max_tokens_per_microbatch"] = args.max_tokens_per_microbatch
    else:
        split["num_microbatches"] = args.num_microbatches or 2
    return fnppo.StepConfig(
        loss=loss, layout="packed", temperature=args.temperature, num_minibatches=args.minibatches, **split
    )


def critic_config(args: argparse.Namespace):
    """The critic's split is the actor's (same micro-batches and mini-batches)."""
    import fnppo

    cfg = step_config(args)
    split = {
        k: getattr(cfg, k) for k in ("num_microbatches", "max_tokens_per_microbatch") if getattr(cfg, k) is not None
    }
    return fnppo.CriticConfig(
        loss=fnppo.losses.ValueLossConfig(clip_range=args.value_clip),
        layout="packed",
        num_minibatches=args.minibatches,
        **split,
    )


def kl_horizon(args: argparse.Namespace) -> float:
    return DEFAULT_KL_HORIZON if args.kl_horizon is None else args.kl_horizon


def kl_controller(args: argparse.Namespace):
    """The KL controller's start state and update: adaptive with ``--kl-target``, else fixed at ``--kl-coef``."""
    import fnppo

    if args.kl_target is None:
        return fnppo.kl.fixed_kl_init(args.kl_coef), fnppo.kl.fixed_kl_update
    return fnppo.kl.adaptive_kl_init(args.kl_coef, args.kl_target, kl_horizon(args)), fnppo.kl.adaptive_kl_update


def learning_rate(args: argparse.Namespace, step: int, peak: float | None = None) -> float:
    """Linear decay from ``peak`` (default ``--lr``) to ``--lr-final * peak`` over ``--schedule-steps``, then constant."""
    frac = min(1.0, step / max(1, args.schedule_steps))
    return (args.lr if peak is None else peak) * (1.0 - (1.0 - args.lr_final) * frac)


def rollout(state, ref_params, args, layout, device, step: int, critic=None, phase=None):
    """Prompts -> responses -> rewards -> advantages -> old/ref log-probs: this DP rank's samples.

    With a ``critic`` (``--algo ppo``): per-token rewards, the critic's values (``compute_values``)
    and GAE advantages and returns; the samples carry ``values`` and ``returns`` for ``critic_step``.
    ``phase``: optional ``phase(name)`` context factory timing the parts (``--profile-step``).
    """
    import contextlib

    import torch
    import torch.distributed as dist

    import fnppo

    n_prompts = args.prompts // layout.dp
    prompts = make_prompts(args.seed, step, args.prompts)[layout.dp_rank * n_prompts : (layout.dp_rank + 1) * n_prompts]
    prompts = prompts.repeat_interleave(args.group_size, dim=0)
    g = torch.Generator().manual_seed(args.seed * 7_919 + step)
    uniforms = torch.rand(args.prompts * args.group_size, RESPONSE_LEN, generator=g)
    per = n_prompts * args.group_size
    uniforms = uniforms[layout.dp_rank * per : (layout.dp_rank + 1) * per]
    phase = phase or (lambda name: contextlib.nullcontext())
    with phase("sampling"):
        responses, rollout_lp = sample_responses(
            state.model,
            prompts,
            uniforms,
            temperature=args.temperature,
            layout=layout,
            device=device,
            invariant=args.batch_invariant,
        )
    rewards = torch.tensor([reward(p, r) for p, r in zip(prompts, responses, strict=True)])
    if critic is not None:
        samples = _ppo_samples(critic, prompts, responses, rollout_lp, args)
    else:
        grouped = rewards.view(-1, args.group_size)
        if args.advantage == "rloo":
            adv = fnppo.advantages.rloo_advantages(grouped).reshape(-1)
        else:
            adv = fnppo.advantages.grpo_advantages(grouped).reshape(-1)
        samples = [
            fnppo.Sample(
                prompt_ids=prompts[i],
                response_ids=responses[i],
                advantages=torch.full((RESPONSE_LEN,), float(adv[i])),
                rollout_logprobs=rollout_lp[i],
            )
            for i in range(prompts.shape[0])
        ]
    cfg = step_config(args)
    with phase("old and reference log-probs"):
        old, _ = fnppo.compute_logprobs(state.model, samples, config=cfg)
        ref, _ = fnppo.compute_logprobs(state.model, samples, params=ref_params, config=cfg)
    samples = [
        dataclasses.replace(s, old_logprobs=o, ref_logprobs=r) for s, o, r in zip(samples, old, ref, strict=True)
    ]
    total = torch.tensor([float(rewards.sum()), float(rewards.numel())], dtype=torch.float64)
    if layout.dp > 1:
        total = total.to(device)
        dist.all_reduce(total, group=layout.dp_group)
        total = total.cpu()
    return samples, float(total[0] / total[1])


def _ppo_samples(critic, prompts, responses, rollout_lp, args):
    """Per-token rewards, the critic's values and GAE: samples with advantages, values and returns."""
    import torch

    import fnppo

    bare = [
        fnppo.Sample(prompt_ids=p, response_ids=r, rollout_logprobs=lp)
        for p, r, lp in zip(prompts, responses, rollout_lp, strict=True)
    ]
    values = torch.stack(fnppo.compute_values(critic.model, bare, config=critic_config(args)))  # [n, RESPONSE_LEN]
    token_r = torch.stack([token_rewards(p, r) for p, r in zip(prompts, responses, strict=True)])
    mask = torch.ones_like(values)
    adv, ret = fnppo.advantages.gae_advantages(token_r, values, mask, gamma=args.gamma, lam=args.lam)
    if args.whiten:  # the returns (the critic's targets) stay as they are
        adv = fnppo.advantages.whiten(adv, mask)
    return [
        dataclasses.replace(s, advantages=a, values=v, returns=r)
        for s, a, v, r in zip(bare, adv, values, ret, strict=True)
    ]


def set_lr(optimizer, lr: float) -> None:
    """Set the learning rate of every parameter group of a Megatron optimizer."""
    for group in optimizer.param_groups:
        group["lr"] = lr


# ---------------------------------------------------------------------------------------------
# the plot
# ---------------------------------------------------------------------------------------------
def smooth(values: list[float], window: int = FINAL_WINDOW) -> list[float]:
    """Trailing moving average over ``window`` steps (fewer at the start)."""
    out = []
    for i in range(len(values)):
        part = values[max(0, i - window + 1) : i + 1]
        out.append(sum(part) / len(part))
    return out


def pyplot():
    """matplotlib's pyplot on the file-only Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: Path, title: str) -> None:
    """Title ``fig``, lay it out, write it to ``path`` (100 dpi) and close it."""
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    pyplot().close(fig)


def write_plot(rows: list[dict], path: Path, *, title: str, target: float, critic: bool = False) -> None:
    """Four panels (reward, entropy, KL, grad norm), with ``critic`` six (value loss, explained
    variance); raw points and a smoothed line, the verdict in the title."""
    plt = pyplot()
    panels = [
        ("reward", "mean reward (fraction of tokens right)"),
        ("entropy", "entropy (nats / token)"),
        ("kl_loss", "KL to reference, k3 (nats / token)"),
        ("grad_norm", "grad norm before clipping (L2)"),
    ]
    if critic:
        panels += [
            ("vf_loss", "critic: clipped value loss"),
            ("vf_explained_var", "critic: explained variance (axis from -1)"),
        ]
    fig, axes = plt.subplots(2, len(panels) // 2, figsize=(5.5 * len(panels) // 2, 7))
    steps = [r["step"] for r in rows]
    for ax, (key, label) in zip(axes.flat, panels, strict=True):
        raw = [float(r.get(key, float("nan"))) for r in rows]
        ax.plot(steps, raw, ".", color="tab:blue", alpha=0.35, label="per step")
        ax.plot(steps, smooth(raw), "-", color="tab:blue", label=f"mean of last {FINAL_WINDOW} steps")
        ax.set_ylabel(label)
        ax.set_xlabel("training step")
        ax.grid(alpha=0.3)
        if key == "vf_explained_var":
            ax.set_ylim(-1.0, 1.05)  # the first steps' large negative values would flatten the rest
        if key == "reward":
            ax.set_ylim(0.0, 1.0)
            ax.axhline(target, color="tab:green", ls="--", label=f"target {target:g}")
            ax.axhline(1.0 / VOCAB, color="tab:gray", ls=":", label=f"chance 1/{VOCAB}")
            ax.legend(loc="lower right", fontsize=8)
    save_figure(fig, path, title)


# ---------------------------------------------------------------------------------------------
# run directory, resume
# ---------------------------------------------------------------------------------------------
def choose_run_dir(args: argparse.Namespace, root: Path | None = None) -> Path:
    """The run directory (decided on rank 0 from the file system; see the module docstring).

    ``root`` (default ``runs/ppo_toy``) holds the numbered runs; ``examples/vlm_toy.py`` passes its own.
    """
    root = RUNS_ROOT if root is None else root
    if args.out_dir is not None:
        out = Path(args.out_dir)
        holds_run = (out / "metrics.jsonl").exists() or (out / "checkpoints").exists()
        if args.resume and not holds_run:
            raise ArgumentError(f"--resume: {out} holds no run to resume")
        if holds_run and not (args.resume or args.overwrite):
            raise ArgumentError(
                f"{out} already holds a run; pass --resume to continue it, --overwrite to replace it, or another --out-dir"
            )
        return out
    runs = sorted(p for p in root.glob("run[0-9][0-9][0-9]") if p.is_dir())
    if args.resume:
        if not runs:
            raise ArgumentError(f"--resume: no run under {root}; start one without --resume")
        return runs[-1]
    return root / f"run{int(runs[-1].name[3:]) + 1 if runs else 0:03d}"


def agreed_run_dir(args: argparse.Namespace, layout, root: Path | None = None) -> Path:
    """:func:`choose_run_dir` on rank 0, the same directory (or the same :class:`ArgumentError`) on every rank."""
    choice: Path | ArgumentError
    try:
        choice = choose_run_dir(args, root) if layout.rank == 0 else Path()
    except ArgumentError as err:
        choice = err
    choice = _agree(choice, layout)
    if isinstance(choice, ArgumentError):
        raise choice
    return choice


def append_row(rows: list[dict], path: Path, row: dict) -> None:
    """Rank 0: one step's metrics, kept in ``rows`` and appended to the JSONL file ``path`` (created,
    with its directory, by the first row)."""
    rows.append(row)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")


def run_settings(args: argparse.Namespace) -> dict:
    keys = RUN_DEFINING + (PPO_DEFINING if args.algo == "ppo" else ())
    out = {k: getattr(args, k) for k in keys}
    # the value in effect: a checkpoint without it (a tied LoRA base) is refused
    out["lora_output_std"] = lora_output_std(args) if args.lora_rank and not args.hf_checkpoint else None
    return out


def check_resume_settings(stored: dict, args: argparse.Namespace) -> None:
    """Refuse a resume whose run-defining flags differ from the checkpoint's."""
    now = run_settings(args)
    keys = RUN_DEFINING + PPO_DEFINING
    diff = [k for k in keys if stored.get(k, SETTING_DEFAULTS.get(k)) != now.get(k, SETTING_DEFAULTS.get(k))]
    if diff:
        parts = ", ".join(
            f"--{k.replace('_', '-')} {stored.get(k, SETTING_DEFAULTS.get(k))} (now {now.get(k, SETTING_DEFAULTS.get(k))})"
            for k in diff
        )
        hint = ""
        if "schedule_steps" in diff:
            hint = f"; to train longer on the stored schedule, pass --schedule-steps {stored.get('schedule_steps')}"
        raise ArgumentError(f"--resume: the checkpoint was written with {parts}; resume with the stored values{hint}")


# ---------------------------------------------------------------------------------------------
# metrics sinks (--log) and the progress report
# ---------------------------------------------------------------------------------------------
LOG_SINKS = ("tensorboard", "wandb", "mlflow")  # fnppo.sinks.SINKS, known here before fnppo is imported


def add_logging_args(p: argparse.ArgumentParser) -> None:
    """``--log`` and ``--progress-every`` (shared with examples/vlm_toy.py)."""
    p.add_argument(
        "--log",
        "--log-to",  # the spelling torchrun passes on: it reads --log itself as an abbreviation of its --log-dir
        dest="log",
        type=str,
        default="",
        help="metrics sinks besides metrics.jsonl, any of tensorboard,wandb,mlflow (comma-separated; rank 0 "
        "writes them under the run directory: tensorboard/, wandb/ offline, mlruns/; under torchrun: --log-to)",
    )
    p.add_argument(
        "--progress-every",
        type=int,
        default=10,
        help="when stdout is not a terminal, a progress line every N steps instead of a bar (default: %(default)s)",
    )


def check_logging_args(args: argparse.Namespace) -> None:
    """``--log``: known names whose package is installed; ``--progress-every`` >= 1 (before torch is imported)."""
    import importlib.util

    if args.progress_every < 1:
        raise ArgumentError(f"--progress-every must be >= 1, got {args.progress_every}")
    for name in (n.strip() for n in args.log.split(",") if n.strip()):
        if name not in LOG_SINKS:
            raise ArgumentError(f"--log {name}: expected any of {','.join(LOG_SINKS)}")
        if importlib.util.find_spec(name) is None:
            raise ArgumentError(f"--log {name}: the {name} package is not installed (pip install 'fnppo[log]')")


def open_logging(args: argparse.Namespace, out_dir: Path, layout) -> list:
    """Rank 0: the ``--log`` sinks under ``out_dir``, given the run's settings (every argument and the
    layout) as hyperparameters; other ranks: none."""
    from fnppo import sinks

    opened = sinks.open_sinks(args.log, out_dir, rank=layout.rank, run_name=out_dir.name)
    settings = {**vars(args), "world_size": layout.world_size, "dp": layout.dp, "ep": layout.ep}
    sinks.log_hparams(opened, settings)
    return opened


class LineProgress:
    """The progress report when stdout is not a terminal (CI logs): one line every ``every`` steps and
    at the last, instead of a bar redrawn at every step (the ``tqdm`` methods the loops use)."""

    def __init__(self, total: int, initial: int, desc: str, every: int) -> None:
        self.total, self.n, self.desc, self.every = total, initial, desc, every
        self.start_n, self.t0, self.postfix = initial, time.perf_counter(), {}

    def set_postfix(self, **values) -> None:
        self.postfix = values

    def update(self, n: int = 1) -> None:
        self.n += n
        if self.n % self.every == 0 or self.n >= self.total:
            rate = (time.perf_counter() - self.t0) / max(1, self.n - self.start_n)
            fields = " ".join(f"{k}={v}" for k, v in self.postfix.items())
            print(f"{self.desc} {self.n}/{self.total} {fields} ({rate:.2f} s/step)", flush=True)

    def close(self) -> None:
        pass


def make_progress(args: argparse.Namespace, initial: int, desc: str):
    """Rank 0's progress report: a ``tqdm`` bar on a terminal, :class:`LineProgress` otherwise, None
    with ``--no-progress``."""
    if args.no_progress:
        return None
    if not sys.stdout.isatty():
        return LineProgress(args.steps, initial, desc, args.progress_every)
    from tqdm import tqdm

    return tqdm(total=args.steps, initial=initial, desc=desc, unit="step", dynamic_ncols=True)


# ---------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------
def _is_rank0_env() -> bool:
    return os.environ.get("RANK", "0") == "0"


def _cuda_available(args: argparse.Namespace) -> bool:
    """Whether torch sees a CUDA device; asked (importing torch) only for ``--device cuda``."""
    if getattr(args, "device", "cpu") != "cuda":
        return False
    import torch

    return torch.cuda.is_available()


def cli_main(prog: str, argv: list[str] | None, parse, validate, run_fn) -> int:
    """A toy run's command line: ``parse(argv)``, ``validate(args, world_size, cuda_available)`` it
    before torch is imported (``cuda_available`` is asked only for ``--device cuda``, else False; an
    :class:`ArgumentError` is printed as ``{prog}: error: ...`` on rank 0 and every rank exits with
    status 2), then import fnppo, set up the parallel layout, ``run_fn(args, layout)`` (its
    ArgumentError likewise: one line from rank 0, exit 2 on every rank raising it), tear the layout down."""
    args = parse(argv)
    try:
        validate(args, int(os.environ.get("WORLD_SIZE", "1")), _cuda_available(args))
    except ArgumentError as err:
        if _is_rank0_env():
            print(f"{prog}: error: {err}", file=sys.stderr)
        else:  # torchrun stops every rank when one exits: give rank 0 time to print the one line
            time.sleep(3.0)
        return 2
    import fnppo

    layout = fnppo.init_parallel(args.tp, args.pp, ep=getattr(args, "ep", 1), seed=args.seed, device=args.device)
    try:
        return run_fn(args, layout)
    except ArgumentError as err:
        if fnppo.megatron.parallel.is_rank_zero():
            print(f"{prog}: error: {err}", file=sys.stderr)
        return 2
    finally:
        fnppo.megatron.parallel.destroy_parallel()


def main(argv: list[str] | None = None) -> int:
    return cli_main("ppo_toy.py", argv, parse_args, validate_args, run)


def _agree(value, layout):
    """Rank 0's value on every rank (an error on rank 0 becomes the same error everywhere)."""
    import torch.distributed as dist

    if layout.world_size == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _setup_run(args, layout):
    """Run directory, state, critic (``--algo ppo``, else None), reference params and the KL
    controller's state (restored on resume)."""
    import fnppo

    out_dir = agreed_run_dir(args, layout)
    state = build(args)
    critic = build(args, head="value") if args.algo == "ppo" else None
    # the reference policy is the initial one: a copy of the weights, or with LoRA the base (adapters off)
    ref_params = fnppo.lora.adapters_off(state.model) if args.lora_rank else fnppo.models.snapshot_params(state.model)
    kl_state, _ = kl_controller(args)
    if args.resume:  # validate_args found a complete checkpoint written with this --algo
        try:  # a damaged newest checkpoint: refused on every rank (unless --resume-fallback), nothing loaded
            latest = fnppo.checkpoint.latest_checkpoint(out_dir / "checkpoints", fallback=args.resume_fallback)
        except fnppo.checkpoint.CheckpointError as err:
            raise ArgumentError(f"--resume: {err}; pass --resume-fallback to resume from the previous one") from None
        if latest is None:
            raise ArgumentError(f"--resume: {out_dir} has no complete checkpoint (write some with --save-every N)")
        try:  # a damaged file, another model: refused on every rank, nothing loaded (any layout loads)
            if critic is not None:
                states, extra = fnppo.checkpoint.load_checkpoint(latest, {"policy": state, "critic": critic})
                state, critic = states["policy"], states["critic"]
            else:
                state, extra = fnppo.checkpoint.load_checkpoint(latest, state)
        except fnppo.checkpoint.CheckpointError as err:
            raise ArgumentError(f"--resume: {err}") from None
        check_resume_settings(extra.get("settings", {}), args)
        # the reference policy is the initial one: rebuilt above from the settings, in this run's layout
        if "kl_state" in extra:
            kl_state = fnppo.kl.KLControllerState(**extra["kl_state"])
        if layout.rank == 0:
            print(f"resumed from {latest} (checkpoint of step {state.step // args.minibatches})")
    return out_dir, state, critic, ref_params, kl_state


def _metrics_file(args, out_dir: Path, done: int) -> tuple[Path, list[dict]]:
    """Rank 0: the metrics file and its rows: on ``--resume`` exactly the rows of steps ``<= done``
    (rewritten so; the run appends after them), else none (a replaced file is removed; the first row
    creates the file, so a run that fails before its first step leaves no metrics behind)."""
    path = Path(args.metrics_out) if args.metrics_out else out_dir / "metrics.jsonl"
    rows = []
    if args.resume and path.exists():
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        rows = [r for r in rows if r["step"] <= done]
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif path.exists():
        path.unlink()
    return path, rows


def _replace_run(out_dir: Path) -> None:
    """Rank 0, ``--overwrite``: remove the replaced run's metrics, checkpoints and ``--log`` files from
    ``out_dir`` (a later ``--resume`` must not continue the old run's checkpoints)."""
    for sub in ("checkpoints", "tensorboard", "wandb", "mlruns"):
        if (out_dir / sub).is_dir():
            shutil.rmtree(out_dir / sub)
    if (out_dir / "metrics.jsonl").is_file():
        (out_dir / "metrics.jsonl").unlink()


def seed_everything(seed: int) -> None:
    """Seed every generator a checkpoint saves and restores: torch's, Python's and NumPy's (Megatron's
    trackers are seeded by ``init_parallel``). The run itself draws only from torch's and from generators
    of (seed, step); seeding the others makes a run's whole RNG state a function of its settings."""
    import random

    import numpy as np
    import torch

    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


def run(args: argparse.Namespace, layout) -> int:
    import torch

    import fnppo

    device = torch.device("cuda" if args.device == "cuda" else "cpu")
    seed_everything(args.seed)
    cfg = step_config(args)  # the configs first: nothing is created for a run that cannot start
    ccfg = critic_config(args) if args.algo == "ppo" else None
    out_dir, state, critic, ref_params, kl_state = _setup_run(args, layout)
    _, kl_update = kl_controller(args)
    rank0 = layout.rank == 0
    start_step = state.step // args.minibatches
    if rank0 and args.overwrite:
        _replace_run(out_dir)
    metrics_path, rows = _metrics_file(args, out_dir, start_step) if rank0 else (None, [])
    sinks = open_logging(args, out_dir, layout)
    progress = make_progress(args, start_step, "ppo") if rank0 else None
    start = time.perf_counter()
    step = start_step
    durations: list[float] = []  # wall time per step of this invocation
    while step < args.steps:
        t_step = time.perf_counter()
        if args.exit_after is not None and step - start_step >= args.exit_after:
            if rank0:
                print(f"stopped after {args.exit_after} steps (--exit-after); resume with --resume")
            fnppo.sinks.close_sinks(sinks)
            return 0
        profiling = args.profile_step is not None and step + 1 == args.profile_step
        with profiled(profiling, args, out_dir, device, rank0) as phase:
            with phase("rollout"):
                samples, mean_reward = rollout(state, ref_params, args, layout, device, step, critic, phase=phase)
            set_lr(state.optimizer, learning_rate(args, step, policy_lr(args)))
            step_cfg = dataclasses.replace(cfg, loss=fnppo.kl.with_kl_coef(cfg.loss, kl_state))
            with phase("train_step"):
                state, metrics = fnppo.train_step(state, samples, step_cfg)
            critic_metrics = {}
            if critic is not None:
                set_lr(critic.optimizer, learning_rate(args, step, args.critic_lr))
                with phase("critic_step"):
                    critic, critic_metrics = fnppo.critic_step(critic, samples, ccfg)
        step += 1
        durations.append(time.perf_counter() - t_step)
        row = {"step": step, "reward": mean_reward, **{k: v for k, v in metrics.items() if k != "step"}}
        row.update(
            {
                k if k.startswith(("vf_", "vpred")) else f"critic_{k}": v
                for k, v in critic_metrics.items()
                if k != "step"
            }
        )
        if args.kl_target is not None:
            row["kl_coef"] = kl_state.coef  # the coefficient this step trained with
        if args.batch_invariant:  # the sampler's log-probs against compute_logprobs' (0 bits differ in the mode)
            row["onpolicy/rollout_vs_old_max_abs_diff"] = max(
                float((s.rollout_logprobs - s.old_logprobs).abs().max()) for s in samples
            )
        kl_state = kl_update(kl_state, metrics["kl_loss"], n_steps=args.prompts * args.group_size)
        if args.layout_check and step == 1 and rank0:
            critic_part = (
                ""
                if critic is None
                else f" critic vf_loss={critic_metrics['vf_loss']:.10e} critic grad_norm={critic_metrics['grad_norm']:.10e}"
            )
            print(
                f"layout-check tp={layout.tp} pp={layout.pp} dp={layout.dp} ep={layout.ep}: first-step loss={metrics['loss']:.10e} grad_norm={metrics['grad_norm']:.10e}{critic_part}",
                flush=True,
            )
        if rank0:
            append_row(rows, metrics_path, row)
            fnppo.sinks.log_metrics(sinks, step, row)
            if progress is not None:
                extra_bar = (
                    {}
                    if critic is None
                    else {"vf": f"{critic_metrics['vf_loss']:.4f}", "ev": f"{critic_metrics['vf_explained_var']:.2f}"}
                )
                progress.set_postfix(
                    reward=f"{mean_reward:.3f}",
                    kl=f"{metrics.get('kl_loss', 0.0):.4f}",
                    ent=f"{metrics.get('entropy', 0.0):.3f}",
                    gnorm=f"{metrics['grad_norm']:.3f}",
                    **extra_bar,
                )
                progress.update(1)
        if args.save_every and step % args.save_every == 0:
            extra = {"settings": run_settings(args), "kl_state": kl_state._asdict()}
            states = state if critic is None else {"policy": state, "critic": critic}  # one manifest: both or neither
            fnppo.checkpoint.save_checkpoint(out_dir / "checkpoints" / f"step{step:06d}", states, extra=extra)
    if progress is not None:
        progress.close()
    fnppo.sinks.close_sinks(sinks)
    if not rank0:
        return 0
    return _report(args, layout, rows, out_dir, metrics_path, time.perf_counter() - start, step - start_step, durations)


class _Phases:
    """Wall time per named phase of a profiled step (device-synchronized at both ends)."""

    def __init__(self, device, enabled: bool):
        self.device, self.enabled, self.times = device, enabled, []

    def __call__(self, name: str):
        import contextlib

        if not self.enabled:
            return contextlib.nullcontext()
        return self._timed(name)

    def _sync(self):
        import torch

        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def _timed(self, name: str):
        import contextlib

        @contextlib.contextmanager
        def block():
            self._sync()
            t0 = time.perf_counter()
            yield
            self._sync()
            self.times.append((name, time.perf_counter() - t0))

        return block()


def profiled(enabled: bool, args, out_dir: Path, device, rank0: bool):
    """Context of one training step: a :class:`_Phases` timer, and with ``enabled`` torch.profiler
    (kernels and operators) and cProfile (Python functions) around it; rank 0 writes the report."""
    import contextlib

    @contextlib.contextmanager
    def block():
        phases = _Phases(device, enabled)
        if not enabled:
            yield phases
            return
        import cProfile
        import io
        import pstats

        import torch
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        cpu_prof = cProfile.Profile()
        with profile(activities=activities) as prof:
            cpu_prof.enable()
            t0 = time.perf_counter()
            yield phases
            phases._sync()
            wall = time.perf_counter() - t0
            cpu_prof.disable()
        if not rank0:
            return
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        busy = sum(e.time_range.end - e.time_range.start for e in kernels) / 1e6
        lines = [
            f"profiled step {args.profile_step} on {device}: {wall:.3f} s wall, "
            f"{len(kernels)} kernels taking {busy:.3f} s of device time"
        ]
        lines += [f"  {name}: {dt:.3f} s" for name, dt in phases.times]
        sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
        lines.append(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=50))
        if device.type == "cuda":
            lines.append(prof.key_averages().table(sort_by=sort, row_limit=15, max_name_column_width=50))
        stream = io.StringIO()
        pstats.Stats(cpu_prof, stream=stream).sort_stats("cumulative").print_stats(45)
        stream.write("\n")
        pstats.Stats(cpu_prof, stream=stream).sort_stats("tottime").print_stats(30)
        lines.append(stream.getvalue())
        path = Path(args.profile_out) if args.profile_out else out_dir / "profile.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("\n".join(lines) + "\n")
        parts = ", ".join(f"{name} {dt:.3f} s" for name, dt in phases.times)
        print(f"profile of step {args.profile_step}: {wall:.3f} s ({parts}) -> {path}", flush=True)

    return block()


def _report(
    args,
    layout,
    rows: list[dict],
    out_dir: Path,
    metrics_path: Path,
    elapsed: float,
    steps_done: int,
    durations: list[float] | None = None,
) -> int:
    last = rows[-FINAL_WINDOW:]
    final = sum(r["reward"] for r in last) / max(1, len(last))
    ok = final >= args.target_reward
    print(
        f"steps: {args.steps}, wall time {elapsed:.1f} s ({elapsed / max(1, steps_done):.3f} s/step), layout tp={layout.tp} pp={layout.pp} dp={layout.dp}"
    )
    if durations and len(durations) > 3:  # the first steps compile kernels on CUDA
        later = sorted(durations[3:])
        print(f"median step after the first 3: {later[len(later) // 2]:.3f} s")
    print(f"metrics: {metrics_path}")
    verdict = "PASS" if ok else "FAIL"
    if not args.no_plot and rows:
        plot = out_dir / "ppo_toy.png"  # in the run directory, also when --metrics-out puts the metrics elsewhere
        out_dir.mkdir(parents=True, exist_ok=True)
        algo = (
            "GRPO"
            if args.algo == "grpo"
            else f"PPO (critic, GAE gamma {args.gamma:g} lambda {args.lam:g}, critic lr {args.critic_lr:g})"
        )
        title = (
            f"fnppo toy {algo} run: {verdict}, final reward {final:.3f} (target {args.target_reward:g})\n"
            f"seed {args.seed}, tp={layout.tp} pp={layout.pp} dp={layout.dp}, {args.dtype}, lr {args.lr:g} -> {args.lr * args.lr_final:g}, "
            f"{args.prompts} prompts x {args.group_size}, kl {args.kl_coef:g}"
            f"{'' if args.kl_target is None else f' (adaptive, target {args.kl_target:g})'}, entropy {args.entropy_coeff:g}"
        )
        try:
            write_plot(rows, plot, title=title, target=args.target_reward, critic=args.algo == "ppo")
            print(f"plot: {plot}")
        except ImportError:
            print("plot: skipped (matplotlib is not installed; pip install 'fnppo[examples]')")
    if args.batch_invariant and rows:
        gaps = [(r["onpolicy/max_abs_ratio_minus_1"], r["onpolicy/rollout_vs_old_max_abs_diff"]) for r in rows]
        print(
            f"batch-invariant: max |ratio - 1| at the first pass over {len(rows)} steps: {max(g[0] for g in gaps):.3g}; "
            f"max |rollout - compute_logprobs| log-prob: {max(g[1] for g in gaps):.3g}"
        )
    print(
        f"final reward (mean of last {len(last)} steps): {final:.3f} -> {verdict}: {'reached' if ok else 'did NOT reach'} the target {args.target_reward:g}"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
