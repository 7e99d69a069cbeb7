"""A GRPO run where a tiny Megatron vision-language GPT learns to count coloured squares in an image.

Task ("count the squares"): half the prompts of every batch are ``BOS <image> ASK`` with an 8x8
image holding k in 1..3 coloured 4x4 squares (distinct random cells of a 2x2 grid, colours drawn
from 6); the right answer is the token for k, so it is only solvable by
looking (always answering the same count scores 1/3 on them). The other half
are ``BOS ASK`` without an image; their right answer is the fixed token ``NONE``. The response is
one token, the reward 1 when it is right, else 0 (chance: 1/15, the image placeholder is never
sampled). Prompts with and without images come in shuffled blocks (:func:`image_flags`), so
micro-batches with no image, with only images and with both occur in every step; the mix seen by
``train_step`` is printed at the end and plotted per step. An entropy bonus (0.05) keeps the image
prompts exploring: without it the policy settles on one count for every image (reward 1/3)
before the vision tower has learnt anything.

The model is :func:`fnppo.megatron.vlm_model.build_vlm`: a one-layer ViT (4 patches of 4x4 pixels per image),
an MLP projector and a 2-layer GPT. The image placeholder becomes 4 positions in the collate stage
(:class:`fnppo.megatron.vlm_collate.VLMCollate`). Each step: prompts -> one answer token sampled per prompt and
group member through Megatron's forward-only schedule -> rewards -> GRPO advantages -> old and
reference log-probs (``compute_logprobs``) -> ``train_step`` (clipped PPO, k3 KL to the reference).

    python examples/vlm_toy.py                                   # 1 process, CPU
    torchrun --nproc-per-node 2 examples/vlm_toy.py --tp 2       # gloo on CPU (--pp 2 and DP work too)

Each run writes to its own directory (``runs/vlm_toy/run000``, ... or ``--out-dir``):
``metrics.jsonl``, ``vlm_toy.png`` and, with ``--save-every N``, a checkpoint every N steps
(``checkpoints/stepNNNNNN``: the model, the optimizer, every RNG state and the run's settings; the
reference parameters are the initial ones, rebuilt from the settings). ``--resume`` continues the newest run (or ``--out-dir``) from its newest
checkpoint, bit-identical to an uninterrupted run (data and sampling are functions of (seed, step));
``--exit-after N`` stops after N steps (a preempted job). The command line's skeleton (argument
errors, exit status, parallel set-up), the run directory, the metrics file on resume, the
learning-rate schedule, the sampling collectives (the logits gathered over TP, the draw sent from
the last pipeline stage), smoothing and saving the plot are those of ``examples/ppo_toy.py``
(imported from its parts, ``examples/toy/``).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from toy import checks, cli, launch, rundir, settings
from toy import plot as toy_plot  # noqa: E402  (the text toy's parts; no torch before validation)
from toy.errors import ArgumentError  # noqa: E402

# torch and fnppo are imported after the arguments are parsed, so --help and argument errors are fast.

PAD, BOS, IMG, ASK, NONE = 0, 1, 2, 3, 4
COUNT0 = 4  # the answer to "k squares" is token COUNT0 + k
MAX_SQUARES = 3
VOCAB = 16
IMAGE_SIZE, PATCH, GRID = 8, 4, 2
PALETTE = [
    (1.0, 0.5, 0.0),
    (1.0, 0.0, 0.5),
    (0.5, 1.0, 0.0),
    (0.0, 1.0, 0.5),
    (0.5, 0.0, 1.0),
    (0.0, 0.5, 1.0),
]  # equal brightness
FINAL_WINDOW = settings.FINAL_WINDOW
RUNS_ROOT = Path("runs/vlm_toy")
#: flags that define a run's trajectory: a resume must use the values stored in the checkpoint
RUN_DEFINING = (
    "seed",
    "tp",
    "pp",
    "prompts",
    "group_size",
    "num_microbatches",
    "minibatches",
    "lr",
    "lr_final",
    "schedule_steps",
    "temperature",
    "kl_coef",
    "entropy_coeff",
    "hidden",
    "layers",
    "freeze_vision",
)

EPILOG = """\
exit status: 0 when the run finished and its final reward (mean of the last 5 steps, over all
prompts and over the image prompts alone) reached --target-reward (pass --target-reward 0 to skip
the check), or it stopped at --exit-after; 1 when it missed the target; 2 for invalid arguments
(checked before anything is imported or created) or a refused --resume.
"""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="vlm_toy.py",
        description=__doc__.splitlines()[0],
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--steps", type=int, default=120, help="training steps (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel size")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--prompts", type=int, default=64, help="prompts per step (global; half with an image)")
    p.add_argument("--group-size", type=int, default=4, help="responses per prompt (GRPO group)")
    p.add_argument("--num-microbatches", type=int, default=8, help="micro-batches per mini-batch")
    p.add_argument("--minibatches", type=int, default=2, help="optimizer steps per training step")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    p.add_argument("--lr-final", type=float, default=0.1, help="final lr as a fraction of --lr (linear decay)")
    p.add_argument("--schedule-steps", type=int, default=None, help="steps over which the lr decays (default: --steps)")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--kl-coef", type=float, default=0.001)
    p.add_argument(
        "--entropy-coeff", type=float, default=0.05, help="entropy bonus (keeps the image prompts exploring)"
    )
    p.add_argument("--hidden", type=int, default=64, help="language model hidden size")
    p.add_argument("--layers", type=int, default=2, help="language model layers")
    p.add_argument(
        "--freeze-vision", action="store_true", help="keep the ViT at its initial weights (the projector trains)"
    )
    p.add_argument("--out-dir", type=str, default=None, help="run directory (default: a new runs/vlm_toy/runNNN)")
    p.add_argument("--overwrite", action="store_true", help="replace the run in --out-dir instead of refusing")
    p.add_argument("--metrics-out", type=str, default=None, help="JSONL metrics file (default: OUT_DIR/metrics.jsonl)")
    p.add_argument("--save-every", type=int, default=0, help="checkpoint every N steps (0: off)")
    p.add_argument(
        "--resume", action="store_true", help="continue --out-dir (default: the newest run) from its newest checkpoint"
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
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--no-progress", action="store_true")
    cli.add_logging_args(p)
    args = p.parse_args(argv)
    if args.schedule_steps is None:
        args.schedule_steps = args.steps
    return args


def validate_args(args: argparse.Namespace, world_size: int, cuda_available: bool) -> None:
    """Raise :class:`ArgumentError` for a command line that cannot run: numbers out of range (NaN
    included), combinations, the run directory (a run in ``--out-dir`` without ``--resume`` /
    ``--overwrite``, ``--resume`` with no run). Checked before torch is imported (``cuda_available``
    is asked only for ``--device cuda``) and before anything is created."""
    for name in (
        "steps",
        "prompts",
        "group_size",
        "minibatches",
        "num_microbatches",
        "hidden",
        "layers",
        "tp",
        "pp",
        "schedule_steps",
    ):
        if getattr(args, name) < 1:
            raise ArgumentError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.exit_after is not None and args.exit_after < 1:
        raise ArgumentError(f"--exit-after must be >= 1, got {args.exit_after}")
    checks.check_logging_args(args)
    if args.save_every < 0:
        raise ArgumentError(f"--save-every must be >= 0, got {args.save_every}")
    if not (args.lr > 0 and 0 <= args.lr_final <= 1 and args.temperature > 0):
        raise ArgumentError(
            f"need --lr > 0, 0 <= --lr-final <= 1 and --temperature > 0, got {args.lr}, {args.lr_final}, {args.temperature}"
        )
    if not (args.kl_coef >= 0 and args.entropy_coeff >= 0):
        raise ArgumentError(f"need --kl-coef >= 0 and --entropy-coeff >= 0, got {args.kl_coef}, {args.entropy_coeff}")
    if args.overwrite and args.resume:
        raise ArgumentError("--overwrite and --resume exclude each other")
    if args.prompts % 16:
        raise ArgumentError(f"--prompts {args.prompts} must be divisible by 16 (8 blocks, half of them with images)")
    if args.device == "cuda" and not cuda_available:
        raise ArgumentError(
            "--device cuda: this torch has no CUDA device (torch.cuda.is_available() is False); use --device cpu"
        )
    if world_size % (args.tp * args.pp):
        raise ArgumentError(
            f"--tp {args.tp} x --pp {args.pp} = {args.tp * args.pp} does not divide the {world_size} processes"
        )
    dp = world_size // (args.tp * args.pp)
    if args.prompts % 16 or args.prompts % dp:
        raise ArgumentError(
            f"--prompts {args.prompts} must be divisible by 16 (8 blocks, half of them with images) and by the data-parallel size {dp}"
        )
    per_minibatch = args.prompts // dp * args.group_size // args.minibatches
    if args.prompts // dp * args.group_size % args.minibatches or args.num_microbatches > per_minibatch:
        raise ArgumentError(
            f"--minibatches {args.minibatches} and --num-microbatches {args.num_microbatches} do not fit "
            f"{args.prompts // dp * args.group_size} samples per data-parallel rank"
        )
    rundir.choose_run_dir(args, RUNS_ROOT)  # read-only: a run in the way, --resume with nothing to resume


# ---------------------------------------------------------------------------------------------
# the task
# ---------------------------------------------------------------------------------------------
def render(k: int, g):
    """A ``[3, 8, 8]`` image with ``k`` squares filling distinct cells of a 2x2 grid (random colours, black background)."""
    import torch

    img = torch.zeros(3, IMAGE_SIZE, IMAGE_SIZE)
    for cell in torch.randperm(GRID * GRID, generator=g)[:k].tolist():
        row, col = divmod(cell, GRID)
        colour = torch.tensor(PALETTE[int(torch.randint(0, len(PALETTE), (), generator=g))])
        img[:, row * PATCH : (row + 1) * PATCH, col * PATCH : (col + 1) * PATCH] = colour[:, None, None]
    return img


def image_flags(n: int, g) -> list[bool]:
    """Which of ``n`` prompts get an image: exactly half, in 8 blocks of ``n / 8`` prompts.

    The blocks (in random order) are 2 without images, 2 with only images and 4 with a random
    half; at the default split a block is one micro-batch of ``train_step``, so each step runs
    micro-batches with no image, with only images and mixed ones.
    """
    import torch

    block = n // 8
    kinds = [0, 0, 1, 1, 2, 2, 2, 2]
    flags: list[bool] = []
    for b in torch.randperm(8, generator=g).tolist():
        if kinds[b] == 2:
            half = torch.zeros(block, dtype=torch.bool)
            half[torch.randperm(block, generator=g)[: block // 2]] = True
            flags += half.tolist()
        else:
            flags += [kinds[b] == 1] * block
    return flags


def make_prompts(seed: int, step: int, n: int) -> list[tuple[list[int], object, int]]:
    """``n`` prompts ``(token ids, image or None, right answer)``, exactly half with an image (:func:`image_flags`).

    A function of (seed, step) only, so every layout sees the same data.
    """
    import torch

    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    has_image = image_flags(n, g)
    out = []
    for flag in has_image:
        if flag:
            k = int(torch.randint(1, MAX_SQUARES + 1, (), generator=g))
            out.append(([BOS, IMG, ASK], render(k, g), COUNT0 + k))
        else:
            out.append(([BOS, ASK], None, NONE))
    return out


def to_sample(prompt: list[int], image, response: list[int], **values):
    import torch

    import fnppo

    mm = {} if image is None else {"images": image[None]}
    return fnppo.Sample(
        prompt_ids=torch.tensor(prompt),
        response_ids=torch.tensor(response, dtype=torch.int64),
        multi_modal=mm,
        **values,
    )


def vision_config(args: argparse.Namespace):
    from fnppo.megatron.vlm_collate import VisionConfig

    return VisionConfig(
        image_token_id=IMG,
        image_size=IMAGE_SIZE,
        patch_size=PATCH,
        num_layers=1,
        hidden_size=32,
        num_attention_heads=2,
        ffn_hidden_size=64,
        projector_hidden_size=args.hidden,
        freeze_vision=args.freeze_vision,
    )


# ---------------------------------------------------------------------------------------------
# sampling one answer token through Megatron's forward-only schedule (any TP/PP layout)
# ---------------------------------------------------------------------------------------------
def sample_answers(chunks, prompts, uniforms, *, collate, temperature: float, layout, device):
    """One token per prompt by inverse CDF with given uniforms ``[n]`` (the placeholder is never drawn)."""
    import torch
    from toy import collectives as toy_collectives

    import fnppo

    samples = [to_sample(p, img, []) for p, img, _ in prompts]
    mb = fnppo.core.batching.collate.to_device(
        collate(samples, layout="packed", pad_to_multiple_of=1, sample_index=range(len(samples))), device
    )

    def last_logits(logits, mb):
        ends = mb.cu_seqlens[:-1].long() + torch.tensor(mb.seq_lens, device=logits.device) - 1
        return toy_collectives.gather_vocab(logits[0, ends, :].float(), layout)[:, :VOCAB]

    out = fnppo.forward_only(chunks, [mb], last_logits)
    pick = torch.zeros(len(prompts))
    if out is not None:
        logits = out[0].cpu().double() / temperature
        logits[:, IMG] = float("-inf")
        cdf = torch.softmax(logits, dim=-1).cumsum(-1)
        pick = (cdf < uniforms[:, None].double() * cdf[:, -1:]).sum(-1).clamp_max(VOCAB - 1).float()
    return toy_collectives.from_last_stage(pick, layout, device).long()


# ---------------------------------------------------------------------------------------------
# setup, one step
# ---------------------------------------------------------------------------------------------
def build(args: argparse.Namespace):
    import fnppo
    from fnppo.megatron.vlm_model import build_vlm

    cfg = fnppo.ModelConfig(
        num_layers=args.layers,
        hidden_size=args.hidden,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=2 * args.hidden,
        vocab_size=VOCAB,
        max_seq_len=16,
        tie_embeddings=True,
    )
    chunks = build_vlm(cfg, vision_config(args))
    fnppo.models.layout_invariant_init(chunks, seed=args.seed)
    ddp = fnppo.wrap_ddp(chunks, use_distributed_optimizer=True)
    return fnppo.TrainState(model=ddp, optimizer=fnppo.build_optimizer(ddp, lr=args.lr, clip_grad=1.0), step=0)


class MixRecorder:
    """The collate stage of ``train_step``, recording each micro-batch's image mix: (samples with images, samples, images)."""

    def __init__(self, collate) -> None:
        self.collate = collate
        self.seen: list[tuple[int, int, int]] = []

    def collated_length(self, sample) -> int:
        return self.collate.collated_length(sample)

    def __call__(self, samples, **kw):
        mb = self.collate(samples, **kw)
        counts = mb.multi_modal_counts.get("images")
        with_images = 0 if counts is None else int((counts > 0).sum())
        self.seen.append((with_images, len(samples), 0 if counts is None else int(counts.sum())))
        return mb


def step_configs(args: argparse.Namespace, recorder: MixRecorder):
    import fnppo

    loss = fnppo.losses.from_flat(
        policy_loss="ppo",
        loss_agg_mode="token-mean",
        kl_coef=args.kl_coef,
        kl_estimator="k3",
        entropy_coeff=args.entropy_coeff,
    )
    train = fnppo.StepConfig(
        loss=loss,
        temperature=args.temperature,
        num_minibatches=args.minibatches,
        num_microbatches=args.num_microbatches,
        fns=fnppo.StepFns(collate=recorder),
    )
    logprobs = fnppo.StepConfig(loss=loss, temperature=args.temperature, fns=fnppo.StepFns(collate=recorder.collate))
    return train, logprobs


def rollout(state, ref_params, args, layout, device, step: int, collate, lp_cfg):
    """Prompts -> answers -> rewards -> advantages -> old/ref log-probs: this DP rank's samples and reward sums."""
    import torch
    import torch.distributed as dist

    import fnppo

    n_prompts = args.prompts // layout.dp
    prompts = make_prompts(args.seed, step, args.prompts)[layout.dp_rank * n_prompts : (layout.dp_rank + 1) * n_prompts]
    prompts = [p for p in prompts for _ in range(args.group_size)]
    g = torch.Generator().manual_seed(args.seed * 7_919 + step)
    uniforms = torch.rand(args.prompts * args.group_size, generator=g).view(args.prompts, args.group_size)
    uniforms = uniforms[layout.dp_rank * n_prompts : (layout.dp_rank + 1) * n_prompts].reshape(-1)
    answers = sample_answers(
        state.model, prompts, uniforms, collate=collate, temperature=args.temperature, layout=layout, device=device
    )
    rewards = torch.tensor([float(int(a) == right) for a, (_, _, right) in zip(answers.tolist(), prompts)])
    adv = fnppo.advantages.grpo_advantages(rewards.view(-1, args.group_size)).reshape(-1)
    samples = [
        to_sample(p, img, [int(a)], advantages=adv[i : i + 1].clone())
        for i, ((p, img, _), a) in enumerate(zip(prompts, answers.tolist()))
    ]
    old, _ = fnppo.compute_logprobs(state.model, samples, config=lp_cfg)
    ref, _ = fnppo.compute_logprobs(state.model, samples, params=ref_params, config=lp_cfg)
    samples = [
        fnppo.Sample(
            prompt_ids=s.prompt_ids,
            response_ids=s.response_ids,
            advantages=s.advantages,
            old_logprobs=o,
            ref_logprobs=r,
            multi_modal=s.multi_modal,
        )
        for s, o, r in zip(samples, old, ref, strict=True)
    ]
    image = torch.tensor([img is not None for _, img, _ in prompts])
    sums = torch.tensor(
        [float(rewards.sum()), float(rewards.numel()), float(rewards[image].sum()), float(image.sum())],
        dtype=torch.float64,
    )
    if layout.dp > 1:
        sums = sums.to(device)
        dist.all_reduce(sums, group=layout.dp_group)
        sums = sums.cpu()
    return samples, {
        "reward": float(sums[0] / sums[1]),
        "reward_image": float(sums[2] / sums[3]),
        "reward_text": float((sums[0] - sums[2]) / (sums[1] - sums[3])),
    }


def mix_summary(seen: list[tuple[int, int, int]], layout, device) -> dict[str, int]:
    """Micro-batch counts by image mix, summed over data-parallel ranks (every rank of a DP rank collates the same)."""
    import torch
    import torch.distributed as dist

    c = torch.zeros(4, dtype=torch.float64)
    for with_images, n, images in seen:
        kind = 0 if with_images == 0 else 1 if with_images == n else 2
        c[kind] += 1
        c[3] += images
    if layout.dp > 1:
        c = c.to(device)
        dist.all_reduce(c, group=layout.dp_group)
        c = c.cpu()
    return {"mb_no_image": int(c[0]), "mb_all_images": int(c[1]), "mb_mixed": int(c[2]), "mb_images": int(c[3])}


# ---------------------------------------------------------------------------------------------
# the plot
# ---------------------------------------------------------------------------------------------
def write_plot(rows: list[dict], path: Path, *, title: str, target: float) -> None:
    """Reward (all, image prompts, text prompts), KL, entropy and the micro-batch mix per step."""
    plt = toy_plot.pyplot()
    steps = [r["step"] for r in rows]
    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    ax = axes[0, 0]
    for key, colour, label in (
        ("reward", "tab:blue", "all prompts"),
        ("reward_image", "tab:red", "image prompts (count k)"),
        ("reward_text", "tab:gray", "text prompts (fixed answer)"),
    ):
        raw = [r[key] for r in rows]
        ax.plot(steps, raw, ".", color=colour, alpha=0.3)
        ax.plot(steps, toy_plot.smooth(raw), "-", color=colour, label=label)
    ax.axhline(target, color="tab:green", ls="--", label=f"target {target:g}")
    ax.axhline(1 / (VOCAB - 1), color="k", ls=":", label="chance 1/15")
    ax.set_ylim(0, 1.02)
    ax.set_ylabel("mean reward (answer right)")
    ax.legend(loc="lower right", fontsize=8)
    for ax, key, label in (
        (axes[0, 1], "entropy", "entropy (nats / token)"),
        (axes[1, 0], "kl_loss", "KL to reference, k3"),
    ):
        raw = [float(r.get(key, float("nan"))) for r in rows]
        ax.plot(steps, raw, ".", alpha=0.35)
        ax.plot(steps, toy_plot.smooth(raw), "-", color="tab:blue")
        ax.set_ylabel(label)
    ax = axes[1, 1]
    bottom = [0] * len(rows)
    for key, colour, label in (
        ("mb_no_image", "tab:gray", "no image"),
        ("mb_all_images", "tab:red", "all images"),
        ("mb_mixed", "tab:purple", "mixed"),
    ):
        vals = [r[key] for r in rows]
        ax.bar(steps, vals, bottom=bottom, color=colour, label=label, width=1.0)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_ylabel("train_step micro-batches per step")
    ax.legend(loc="lower right", fontsize=8)
    for ax in axes.flat:
        ax.set_xlabel("training step")
        ax.grid(alpha=0.3)
    toy_plot.save_figure(fig, path, title)


# ---------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    return launch.cli_main("vlm_toy.py", argv, parse_args, validate_args, run)


def run_settings(args: argparse.Namespace) -> dict:
    return {k: getattr(args, k) for k in RUN_DEFINING}


def check_resume_settings(stored: dict, args: argparse.Namespace) -> None:
    """Refuse a resume whose run-defining flags differ from the checkpoint's."""
    now = run_settings(args)
    diff = [k for k in RUN_DEFINING if stored.get(k) != now[k]]
    if diff:
        parts = ", ".join(f"--{k.replace('_', '-')} {stored.get(k)} (now {now[k]})" for k in diff)
        hint = ""
        if "schedule_steps" in diff:
            hint = f"; to train longer on the stored schedule, pass --schedule-steps {stored.get('schedule_steps')}"
        raise ArgumentError(f"--resume: the checkpoint was written with {parts}; resume with the stored values{hint}")


def seed_everything(seed: int) -> None:
    """Seed every generator a checkpoint restores (Python's, NumPy's, torch's): a run is a function of its settings."""
    import random

    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def setup_run(args: argparse.Namespace, layout):
    """Run directory, state and reference parameters; with ``--resume`` restored from the newest
    checkpoint (model, optimizer, RNG states), its settings checked. Nothing
    is written before the checkpoint loaded: a refused resume leaves the run as it was."""
    from toy import collectives as toy_collectives

    import fnppo

    out_dir = toy_collectives.agreed_run_dir(args, layout, RUNS_ROOT)
    state = build(args)
    ref_params = fnppo.models.snapshot_params(state.model)
    if args.resume:
        try:  # a damaged newest checkpoint or file, another model: refused on every rank, nothing loaded
            latest = fnppo.checkpoint.latest_checkpoint(out_dir / "checkpoints")
            if latest is None:
                raise ArgumentError(f"--resume: {out_dir} has no complete checkpoint (write some with --save-every N)")
            state, extra = fnppo.checkpoint.load_checkpoint(latest, state)
        except fnppo.checkpoint.CheckpointError as err:
            raise ArgumentError(f"--resume: {' '.join(str(err).split())}") from err
        check_resume_settings(extra.get("settings", {}), args)
        # the reference policy is the initial one: rebuilt above from the settings, in this run's layout
        if layout.rank == 0:
            print(f"resumed from {latest} (checkpoint of step {state.step // args.minibatches})")
    if args.overwrite and layout.rank == 0:
        rundir.replace_run(out_dir)  # the replaced run's checkpoints must not be resumed later
    return out_dir, state, ref_params


def run(args: argparse.Namespace, layout) -> int:
    import torch
    from toy import model as toy_model
    from toy import progress as toy_progress

    import fnppo
    from fnppo.megatron.vlm_collate import VLMCollate

    device = torch.device("cuda" if args.device == "cuda" else "cpu")
    seed_everything(args.seed)
    out_dir, state, ref_params = setup_run(args, layout)
    rank0 = layout.rank == 0
    start_step = state.step // args.minibatches
    metrics_path, rows = rundir.metrics_file(args, out_dir, start_step) if rank0 else (None, [])
    recorder = MixRecorder(VLMCollate.from_config(vision_config(args), max_seq_len=16))
    train_cfg, lp_cfg = step_configs(args, recorder)
    sinks = toy_progress.open_logging(args, out_dir, layout)
    progress = toy_progress.make_progress(args, start_step, "vlm") if rank0 else None
    start = time.perf_counter()
    for step in range(start_step, args.steps):
        if args.exit_after is not None and step - start_step >= args.exit_after:
            if rank0:
                print(f"stopped after {args.exit_after} steps (--exit-after); resume with --resume")
            fnppo.sinks.close_sinks(sinks)
            return 0
        samples, rewards = rollout(state, ref_params, args, layout, device, step, recorder.collate, lp_cfg)
        toy_model.set_lr(state.optimizer, settings.learning_rate(args, step))
        recorder.seen.clear()
        state, metrics = fnppo.train_step(state, samples, train_cfg)
        row = {
            "step": step + 1,
            **rewards,
            **mix_summary(recorder.seen, layout, device),
            **{k: v for k, v in metrics.items() if k != "step"},
        }
        if rank0:
            rundir.append_row(rows, metrics_path, row)
            fnppo.sinks.log_metrics(sinks, step + 1, row)
            if progress is not None:
                progress.set_postfix(
                    reward=f"{rewards['reward']:.3f}",
                    image=f"{rewards['reward_image']:.3f}",
                    kl=f"{metrics.get('kl_loss', 0.0):.4f}",
                )
                progress.update(1)
        if args.save_every and (step + 1) % args.save_every == 0:
            extra = {"settings": run_settings(args)}
            fnppo.checkpoint.save_checkpoint(out_dir / "checkpoints" / f"step{step + 1:06d}", state, extra=extra)
    if progress is not None:
        progress.close()
    fnppo.sinks.close_sinks(sinks)
    if not rank0:
        return 0
    return _report(args, layout, rows, out_dir, metrics_path, time.perf_counter() - start, args.steps - start_step)


def _report(args, layout, rows: list[dict], out_dir: Path, metrics_path: Path, elapsed: float, steps_run: int) -> int:
    last = rows[-FINAL_WINDOW:]
    final = sum(r["reward"] for r in last) / len(last)
    final_image = sum(r["reward_image"] for r in last) / len(last)
    ok = final >= args.target_reward and final_image >= args.target_reward
    verdict = "PASS" if ok else "FAIL"
    none, every, mixed, images = (
        sum(r[k] for r in rows) for k in ("mb_no_image", "mb_all_images", "mb_mixed", "mb_images")
    )
    total = none + every + mixed
    print(
        f"steps: {args.steps}, wall time {elapsed:.1f} s ({elapsed / max(1, steps_run):.3f} s/step), "
        f"layout tp={layout.tp} pp={layout.pp} dp={layout.dp}"
    )
    print(
        f"image-count mix of the {total} micro-batches train_step ran: no image {none}, all images {every}, mixed {mixed}; "
        f"{images} images in all ({images / max(1, total):.2f} per micro-batch)"
    )
    print(f"metrics: {metrics_path}")
    if not args.no_plot:
        plot = out_dir / "vlm_toy.png"
        plot.parent.mkdir(parents=True, exist_ok=True)  # the run directory, also when the metrics went elsewhere
        title = (
            f"fnppo VLM toy GRPO run (count the squares): {verdict}, final reward {final:.3f}, image prompts {final_image:.3f} "
            f"(target {args.target_reward:g})\nseed {args.seed}, tp={layout.tp} pp={layout.pp} dp={layout.dp}, lr {args.lr:g}, "
            f"{args.prompts} prompts x {args.group_size}, vision {'frozen' if args.freeze_vision else 'trained'}"
        )
        try:
            write_plot(rows, plot, title=title, target=args.target_reward)
            print(f"plot: {plot}")
        except ImportError:
            print("plot: skipped (matplotlib is not installed; pip install 'fnppo[examples]')")
    print(
        f"final reward (mean of last {len(last)} steps): {final:.3f}, image prompts {final_image:.3f} -> {verdict}: "
        f"{'reached' if ok else 'did NOT reach'} the target {args.target_reward:g}"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
