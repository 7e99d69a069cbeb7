"""The command line: ``parse_args`` (its checks are :mod:`toy.checks`), and ``resume_command``: the command
that continues a run."""

from __future__ import annotations

import argparse
import os
import shlex
from pathlib import Path

from toy.losses import DEFAULT_POLICY_LOSS, DEFAULT_TIS_CAP, POLICY_LOSSES, STALE_POLICY_LOSS
from toy.settings import DEFAULT_KL_HORIZON, PPO_DEFINING, RUN_DEFINING

DESCRIPTION = "A complete PPO/GRPO run that a tiny Megatron GPT learns from scratch on a laptop CPU."
EPILOG = """\
exit status: 0 when the run finished and its final reward (mean of the last 5 steps) reached
--target-reward (pass --target-reward 0 to skip the check), or it stopped at --exit-after;
1 when the final reward missed the target; 2 for invalid arguments or a refused --resume (one line,
also for a setting the library refuses, a sink whose package fails to import, or a checkpoint that
cannot be written); 130 for Ctrl-C (the line printed is the command that continues the run).
"""


def build_parser() -> argparse.ArgumentParser:
    """The command line's parser (every flag, its default and its help)."""
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
        default=None,
        help=f"the policy loss (default: {DEFAULT_POLICY_LOSS}, and with --staleness K > 0 "
        f"{STALE_POLICY_LOSS}: the loss docs/async.md recommends for stale rollouts; plain ppo falls behind from "
        "K = 2): " + "; ".join(f"{name}: {row.help}" for name, row in POLICY_LOSSES.items()),
    )
    p.add_argument(
        "--staleness",
        type=int,
        default=0,
        help="asynchronous RL stand-in: sample each step's rollouts with the policy this many updates old "
        "(its log-probs are the samples' rollout log-probs; default: %(default)s, on-policy); with K > 0 "
        f"--policy-loss defaults to {STALE_POLICY_LOSS}",
    )
    p.add_argument(
        "--partial-rollouts",
        action="store_true",
        help="with --staleness K: responses continued across weight updates; each response's first token is "
        "sampled by the weights K updates old and, before each later token, the sampler moves on to the next "
        "newer weights with probability 1/2 (never past the current ones); the samples carry each token's "
        "version, fnppo.losses.Staleness.prepare gives each token its age, and --policy-loss decoupled "
        "reads it per token",
    )
    p.add_argument(
        "--sampler-dtype",
        choices=["same", "bf16"],
        default="same",
        help="the sampler's numerics: the trainer's (same), or bf16 autocast to stand in for an inference engine "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--sync",
        choices=["off", "full", "delta", "fp8", "fp8-delta"],
        default="off",
        help="the sampler as an inference engine of its own, running only the weights streamed to it after each "
        "update: full (stream_hf_weights), delta (stream_hf_deltas + apply_hf_deltas), fp8 / fp8-delta (E4M3 "
        "projection weights with per-block scales, dequantized by the sampler); off: the sampler is the trainer's "
        "model (default: %(default)s)",
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
        "--shared-prefix",
        choices=["auto", "on", "off"],
        default="auto",
        help="pack each prompt's group with the prompt forwarded once (fnppo.batching.SharedPrefix; the same "
        "numbers as off up to float rounding): auto = on where that is exact (fnppo's local layer spec, "
        "not --batch-invariant, no MoE router loss)",
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
    p.add_argument(
        "--distill-from",
        type=str,
        default=None,
        help="on-policy distillation: a teacher toy run (its directory, or one of its checkpoints) whose "
        "next-token distribution every response token is pulled toward (reverse KL over the vocabulary, "
        "beside the GRPO loss)",
    )
    p.add_argument(
        "--distill-coef",
        type=float,
        default=1.0,
        help="--distill-from: the reverse-KL term's weight (default: %(default)s)",
    )
    p.add_argument(
        "--distill-only",
        action="store_true",
        help="--distill-from: the reverse-KL term alone (no policy loss, no KL penalty to the reference)",
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
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    # the flags given on the command line (a resume takes the others from the run's stored settings)
    for action in p._actions:
        action.default = argparse.SUPPRESS
    args.given_flags = tuple(sorted(vars(p.parse_args(argv))))
    if args.policy_loss is None:  # the loss for the rollouts' staleness (docs/async.md)
        args.policy_loss = STALE_POLICY_LOSS if args.staleness > 0 else DEFAULT_POLICY_LOSS
    if args.schedule_steps is None:
        args.schedule_steps = args.steps
    if args.critic_lr is None:
        args.critic_lr = args.lr
    return args


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


#: flags of one invocation that a resume command must not repeat (or that it sets itself)
NOT_REPEATED = ("resume", "resume_fallback", "overwrite", "exit_after", "out_dir")
SCRIPT = Path(__file__).resolve().parents[1] / "ppo_toy.py"


def _flag(action: argparse.Action, value) -> list[str]:
    """``action``'s flag with ``value`` as a command line spells it."""
    if isinstance(action, argparse.BooleanOptionalAction):
        return [action.option_strings[0] if value else action.option_strings[1]]
    if action.nargs == 0:  # store_true
        return [action.option_strings[0]] if value else []
    return [action.option_strings[0], str(value)]


def resume_command(args: argparse.Namespace, out_dir: Path, world_size: int | None = None) -> str:
    """The command that continues this run: ``--resume --out-dir OUT_DIR`` and every flag of this
    invocation that the run's settings do not store (``--steps``, ``--save-every``, ``--log-to``,
    ``--metrics-out``, the layout, ...; the stored ones a resume reads from the run), under ``torchrun``
    for a run of several processes. ``python`` runs this file as given."""
    world_size = int(os.environ.get("WORLD_SIZE", "1")) if world_size is None else world_size
    stored = set(RUN_DEFINING) | set(PPO_DEFINING) | set(NOT_REPEATED)
    given = set(getattr(args, "given_flags", ()))
    flags: list[str] = []
    for action in build_parser()._actions:
        if action.dest in given and action.dest not in stored and action.option_strings:
            flags += _flag(action, getattr(args, action.dest))
    script = os.path.relpath(SCRIPT)
    script = str(SCRIPT) if script.startswith("..") else script
    launcher = ["python"] if world_size == 1 else ["torchrun", f"--nproc-per-node={world_size}"]
    return shlex.join([*launcher, script, "--resume", "--out-dir", str(out_dir), *flags])
