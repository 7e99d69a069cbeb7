"""What a run's arguments mean beyond their values: the run-defining settings a checkpoint stores and a
resume must agree with, and the values derived from the arguments (learning rates, init std, KL horizon).
Pure Python: imported before torch."""

from __future__ import annotations

import argparse

from toy.errors import ArgumentError

FINAL_WINDOW = 5  # the final reward is the mean over this many last steps
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
    "policy_loss",
    "staleness",
    "sampler_dtype",
    "sync",
    "partial_rollouts",
    "distill_from",
    "distill_coef",
    "distill_only",
    "shared_prefix",
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
    "policy_loss": "ppo",
    "staleness": 0,
    "sampler_dtype": "same",
    "sync": "off",
    "partial_rollouts": False,
    "distill_from": None,
    "distill_coef": 1.0,
    "distill_only": False,
    "shared_prefix": "off",
}  # what a checkpoint without the key was written with


DEFAULT_KL_HORIZON = 10_000.0


#: the random base of a LoRA run has its own (untied) output layer of this std: the frozen output layer
#: bounds the logits' range, at 0.02 the best symbol's probability stays below 0.2 (docs/lora.md)
LORA_OUTPUT_STD = 0.15


LORA_LR = 5e-3


def init_std(args: argparse.Namespace) -> float:
    """The random model's initial std: ``--init-std``, else Megatron's 0.02."""
    return args.init_std if args.init_std is not None else 0.02


def lora_output_std(args: argparse.Namespace) -> float:
    """The std of a LoRA run's random output layer: ``--lora-output-std``, else :data:`LORA_OUTPUT_STD`."""
    return args.lora_output_std if args.lora_output_std is not None else LORA_OUTPUT_STD


def policy_lr(args: argparse.Namespace) -> float:
    """The policy's peak learning rate: ``--lr``, or with LoRA ``--lora-lr`` (default :data:`LORA_LR`)."""
    if not args.lora_rank:
        return args.lr
    return args.lora_lr if args.lora_lr is not None else LORA_LR


def kl_horizon(args: argparse.Namespace) -> float:
    return DEFAULT_KL_HORIZON if args.kl_horizon is None else args.kl_horizon


def learning_rate(args: argparse.Namespace, step: int, peak: float | None = None) -> float:
    """Linear decay from ``peak`` (default ``--lr``) to ``--lr-final * peak`` over ``--schedule-steps``, then constant."""
    frac = min(1.0, step / max(1, args.schedule_steps))
    return (args.lr if peak is None else peak) * (1.0 - (1.0 - args.lr_final) * frac)


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


def adopt_stored_settings(args: argparse.Namespace, stored: dict) -> None:
    """``--resume``: set every run-defining setting not given on the command line (``args.given_flags``)
    to its stored value; refuse, by name, one given with another value than the stored one."""
    given = set(getattr(args, "given_flags", ()))
    keys = RUN_DEFINING + PPO_DEFINING
    differ = []
    for key in keys:
        if key not in stored and key not in SETTING_DEFAULTS:
            continue
        value = stored.get(key, SETTING_DEFAULTS.get(key))
        if key in given:
            if getattr(args, key) != value:
                differ.append(f"--{key.replace('_', '-')} {value} (given: {getattr(args, key)})")
        elif key != "lora_output_std" or value is not None:  # (stored as the value in effect, None without LoRA)
            setattr(args, key, value)
    if differ:
        raise ArgumentError(
            f"--resume: the run was written with {', '.join(differ)}; drop these flags to resume with the stored "
            "values (--steps may change)"
        )
