"""The command line: ``parse_args`` and ``validate_args`` (every refusal before torch is imported and
before anything is created; an :class:`~toy.errors.ArgumentError` becomes one line and exit 2)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
from pathlib import Path

from toy.errors import ArgumentError
from toy.losses import DEFAULT_TIS_CAP, POLICY_LOSSES
from toy.rundir import check_run_paths, choose_run_dir, read_settings
from toy.settings import DEFAULT_KL_HORIZON, adopt_stored_settings, kl_horizon

DESCRIPTION = "A complete PPO/GRPO run that a tiny Megatron GPT learns from scratch on a laptop CPU."
EPILOG = """\
exit status: 0 when the run finished and its final reward (mean of the last 5 steps) reached
--target-reward (pass --target-reward 0 to skip the check), or it stopped at --exit-after;
1 when the final reward missed the target; 2 for invalid arguments or a refused --resume (one line,
also for a setting the library refuses); 130 for Ctrl-C (the line printed says how to resume).
"""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="ppo_toy.py",
        description=DESCRIPTION,
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
    p.add_argument(
        "--tis-cap",
        type=float,
        default=None,
        help=f"truncated importance sampling cap (--policy-loss ppo: off by default; ppo-tis, tis: {DEFAULT_TIS_CAP:g})",
    )
    p.add_argument(
        "--policy-loss",
        choices=list(POLICY_LOSSES),
        default="ppo",
        help="the policy loss (default: %(default)s): "
        + "; ".join(f"{name}: {row.help}" for name, row in POLICY_LOSSES.items()),
    )
    p.add_argument(
        "--staleness",
        type=int,
        default=0,
        help="asynchronous RL stand-in: sample each step's rollouts with the policy this many updates old "
        "(its log-probs are the samples' rollout log-probs; default: %(default)s, on-policy)",
    )
    p.add_argument(
        "--sampler-dtype",
        choices=["same", "bf16"],
        default="same",
        help="the sampler's numerics: the trainer's (same), or bf16 autocast to stand in for an inference engine "
        "(default: %(default)s)",
    )
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
    # the flags given on the command line (a resume takes the others from the run's stored settings)
    for action in p._actions:
        action.default = argparse.SUPPRESS
    args.given_flags = tuple(sorted(vars(p.parse_args(argv))))
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
    to resume). Pure Python and read-only: runs before torch is imported and before anything is created.

    With ``--resume``, the run-defining settings not given on the command line are taken from the run's
    ``settings.json`` (:func:`toy.settings.adopt_stored_settings`); one given with another value is refused
    by name."""
    if args.overwrite and args.resume:
        raise ArgumentError("--overwrite and --resume exclude each other")
    if args.resume:
        stored = read_settings(choose_run_dir(args))
        if stored is not None:
            adopt_stored_settings(args, stored)
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
    _check_meaningful(args)
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


def _check_meaningful(args: argparse.Namespace) -> None:
    """Settings that would run but mean nothing: two micro-batch splits at once (one would be dropped), a
    LoRA rank above the layers' width, a zero or negative init std, flags of ``--algo ppo`` without it."""
    given = set(getattr(args, "given_flags", ()))
    if args.num_microbatches is not None and args.max_tokens_per_microbatch is not None:
        raise ArgumentError(
            f"--num-microbatches {args.num_microbatches} and --max-tokens-per-microbatch "
            f"{args.max_tokens_per_microbatch} exclude each other: the split is a number of micro-batches or a token budget"
        )
    if args.lora_rank < 0:
        raise ArgumentError(f"--lora-rank must be >= 0, got {args.lora_rank}")
    if args.lora_rank > args.hidden and not args.hf_checkpoint:
        raise ArgumentError(
            f"--lora-rank {args.lora_rank} exceeds --hidden {args.hidden}: an adapter's rank is at most the width of "
            "the layer it adapts (a low-rank update needs rank < hidden size)"
        )
    if args.init_std is not None:
        if not (math.isfinite(args.init_std) and args.init_std > 0):
            raise ArgumentError(f"--init-std must be a finite number > 0, got {args.init_std}")
        if args.hf_checkpoint:
            raise ArgumentError("--init-std applies to the random model; --hf-checkpoint loads its weights")
    row = POLICY_LOSSES[args.policy_loss]
    if args.tis_cap is not None and row.tis_cap == "refused":
        raise ArgumentError(f"--tis-cap: --policy-loss {args.policy_loss} takes no cap ({row.help})")
    if args.staleness < 0:
        raise ArgumentError(f"--staleness must be >= 0, got {args.staleness}")
    if args.sampler_dtype == "bf16" and args.dtype == "bf16":
        raise ArgumentError("--sampler-dtype bf16: the trainer already runs in bf16 (--dtype bf16); nothing differs")
    if args.batch_invariant and (args.staleness or args.sampler_dtype != "same"):
        raise ArgumentError(
            "--batch-invariant compares the sampler's log-probs with the trainer's: it needs --staleness 0 and "
            "--sampler-dtype same"
        )
    if args.staleness and args.resume:
        raise ArgumentError(
            f"--resume: a run with --staleness {args.staleness} cannot resume (the older weights it samples with "
            "are not in the checkpoints)"
        )
    if args.algo != "ppo":
        unused = [f for f in ("gamma", "lam", "critic_lr", "value_clip", "whiten") if f in given]
        if unused:
            flags = ", ".join("--whiten/--no-whiten" if f == "whiten" else f"--{f.replace('_', '-')}" for f in unused)
            raise ArgumentError(f"{flags}: only --algo ppo (a critic and GAE) reads it; this run is --algo {args.algo}")


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


LOG_SINKS = ("tensorboard", "wandb", "mlflow")  # fnppo.sinks.SINKS, known here before fnppo is imported


def add_logging_args(p: argparse.ArgumentParser) -> None:
    """``--log`` and ``--progress-every`` (shared with examples/vlm_toy.py)."""
    p.add_argument(
        "--log-to",  # the spelling that works everywhere: torchrun refuses --log as ambiguous (--log-dir, --logs-specs)
        "--log",
        dest="log",
        type=str,
        default="",
        help="metrics sinks besides metrics.jsonl, any of tensorboard,wandb,mlflow (comma-separated; rank 0 "
        "writes them under the run directory: tensorboard/, wandb/ offline, mlruns/; --log in one process only: torchrun "
        "refuses it as ambiguous with its own --log-dir)",
    )
    p.add_argument(
        "--progress-every",
        type=int,
        default=10,
        help="when stdout is not a terminal, a progress line every N steps instead of a bar (default: %(default)s)",
    )


def check_logging_args(args: argparse.Namespace) -> None:
    """``--log``: known names whose package is installed; ``--progress-every`` >= 1 (before torch is imported)."""
    if args.progress_every < 1:
        raise ArgumentError(f"--progress-every must be >= 1, got {args.progress_every}")
    for name in (n.strip() for n in args.log.split(",") if n.strip()):
        if name not in LOG_SINKS:
            raise ArgumentError(f"--log {name}: expected any of {','.join(LOG_SINKS)}")
        if importlib.util.find_spec(name) is None:
            raise ArgumentError(f"--log {name}: the {name} package is not installed (pip install 'fnppo[log]')")
