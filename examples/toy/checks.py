"""The command line's checks: ``validate_args`` refuses a command line that cannot run, or that would run
meaninglessly, with an :class:`~toy.errors.ArgumentError` (one line and exit 2). Pure Python and read-only:
it runs before torch is imported and before anything is created."""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
from pathlib import Path

from toy.cli import LOG_SINKS
from toy.distill import teacher_source
from toy.errors import ArgumentError
from toy.losses import POLICY_LOSSES
from toy.rundir import check_run_paths, choose_run_dir, read_settings
from toy.settings import adopt_stored_settings, kl_horizon


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
    if args.shared_prefix == "on" and (args.batch_invariant or args.spec == "te"):
        raise ArgumentError(
            "--shared-prefix on needs fnppo's local layer spec without --batch-invariant (use auto or off)"
        )
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
    _check_distill(args)
    check_run_paths(args)


def _check_distill(args: argparse.Namespace) -> None:
    """``--distill-from``: a teacher toy run (:func:`toy.distill.teacher_source`), a student of the toy's
    own model (no --hf-checkpoint, --moe or --lora-rank); ``--distill-coef`` a finite number >= 0, given
    with --distill-from; ``--distill-only`` with --distill-from, --algo grpo and no KL or entropy settings."""
    given = set(getattr(args, "given_flags", ()))
    if args.distill_from is None:
        extra = [f"--{f.replace('_', '-')}" for f in ("distill_coef", "distill_only") if f in given]
        if extra:
            raise ArgumentError(f"{', '.join(extra)}: needs --distill-from (a teacher run)")
        return
    if not (math.isfinite(args.distill_coef) and args.distill_coef >= 0):
        raise ArgumentError(f"--distill-coef must be a finite number >= 0, got {args.distill_coef}")
    if args.hf_checkpoint or args.moe or args.lora_rank:
        raise ArgumentError(
            "--distill-from: the student is the toy's own model (no --hf-checkpoint, --moe or --lora-rank)"
        )
    if args.distill_only:
        if args.algo != "grpo":
            raise ArgumentError("--distill-only: the distillation term alone has no use for a critic (--algo ppo)")
        unused = [
            f"--{f.replace('_', '-')}" for f in ("kl_coef", "kl_target", "entropy_coeff", "tis_cap") if f in given
        ]
        if unused:
            raise ArgumentError(f"{', '.join(unused)}: --distill-only trains the distillation term alone")
    teacher_source(args.distill_from)


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
        why = "" if "policy_loss" in given else f"; it is the default with --staleness {args.staleness}"
        raise ArgumentError(f"--tis-cap: --policy-loss {args.policy_loss} takes no cap ({row.help}{why})")
    if args.staleness < 0:
        raise ArgumentError(f"--staleness must be >= 0, got {args.staleness}")
    if args.partial_rollouts and args.staleness < 1:
        raise ArgumentError(
            "--partial-rollouts continues responses across weight updates: it needs --staleness K >= 1 "
            f"(the oldest weights a response starts with), got --staleness {args.staleness}"
        )
    if args.sampler_dtype == "bf16" and args.dtype == "bf16":
        raise ArgumentError("--sampler-dtype bf16: the trainer already runs in bf16 (--dtype bf16); nothing differs")
    if args.batch_invariant and (args.staleness or args.sampler_dtype != "same"):
        raise ArgumentError(
            "--batch-invariant compares the sampler's log-probs with the trainer's: it needs --staleness 0 and "
            "--sampler-dtype same"
        )
    if args.sync != "off" and args.staleness:
        raise ArgumentError(
            f"--sync {args.sync}: the sampler runs the last weights streamed to it; --staleness samples with older ones"
        )
    if args.batch_invariant and args.sync.startswith("fp8"):
        raise ArgumentError(
            f"--batch-invariant compares the sampler's log-probs with the trainer's: --sync {args.sync} samples with "
            "FP8 weights (use --sync delta or full)"
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


def check_logging_args(args: argparse.Namespace) -> None:
    """``--log``: known names whose package is installed; ``--progress-every`` >= 1 (before torch is imported)."""
    if args.progress_every < 1:
        raise ArgumentError(f"--progress-every must be >= 1, got {args.progress_every}")
    for name in (n.strip() for n in args.log.split(",") if n.strip()):
        if name not in LOG_SINKS:
            raise ArgumentError(f"--log {name}: expected any of {','.join(LOG_SINKS)}")
        if importlib.util.find_spec(name) is None:
            raise ArgumentError(f"--log {name}: the {name} package is not installed (pip install 'fnppo[log]')")
