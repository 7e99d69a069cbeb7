"""``--distill-from RUN``: on-policy distillation from a teacher that the toy trained.

The teacher is a toy run (any width and depth, e.g. ``--hidden 128``): ``RUN`` is its run directory
(its newest complete checkpoint) or one of its checkpoints (``RUN/checkpoints/stepNNNNNN``). The
student samples its own responses as always; every response token is pulled toward the teacher's
next-token distribution by a reverse-KL term, ``fnppo.losses.ReverseKL(coef=--distill-coef,
teacher=fnppo.TeacherModel(chunks))``, added to the GRPO loss (or, with ``--distill-only``, alone: no
policy loss, no KL penalty). The teacher runs inside ``train_step``, forward-only, over the student's
micro-batches; the loss reads its final hidden states and output layer over the full vocabulary.

:func:`teacher_source` resolves and checks ``RUN`` in plain Python (before torch is imported);
:func:`load_teacher` builds the teacher under this run's layout and loads its weights;
:func:`distill_loss` adds the term to a step's loss.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from toy.errors import ArgumentError
from toy.rundir import SETTINGS_FILE, newest_checkpoint

#: the teacher's settings that build its model (the rest are the student's: task, vocabulary, layout)
TEACHER_SETTINGS = ("hidden", "layers", "dtype", "init_std", "spec")


def teacher_source(path: str) -> tuple[Path, dict]:
    """``(checkpoint directory, the teacher run's settings)`` of ``--distill-from path``.

    Refused (:class:`ArgumentError`): a path that does not exist; no complete checkpoint; no readable
    ``settings.json`` in the run directory; a teacher run with LoRA, MoE, a Hugging Face start or a
    critic (``--algo ppo``: its checkpoints hold two train states).
    """
    flag = f"--distill-from {path}"
    p = Path(path)
    if not p.is_dir():
        raise ArgumentError(f"{flag}: is not a directory (a toy run directory or one of its checkpoints)")
    if (p / "manifest.json").is_file():
        checkpoint, run = p, p.parent.parent
    else:
        checkpoint, run = newest_checkpoint(p / "checkpoints"), p
        if checkpoint is None:
            raise ArgumentError(f"{flag}: holds no complete checkpoint (train the teacher with --save-every N)")
    try:
        settings = json.loads((run / SETTINGS_FILE).read_text())
    except (OSError, ValueError) as err:
        raise ArgumentError(f"{flag}: the teacher run's {SETTINGS_FILE} is not readable ({err})") from None
    if not isinstance(settings, dict) or any(k not in settings for k in ("hidden", "layers")):
        raise ArgumentError(f"{flag}: the teacher run's {SETTINGS_FILE} holds no model settings")
    for key, ok, what in (
        ("lora_rank", 0, "LoRA"),
        ("moe", False, "--moe"),
        ("hf_checkpoint", None, "--hf-checkpoint"),
        ("algo", "grpo", "--algo ppo"),
    ):
        if settings.get(key, ok) != ok:
            raise ArgumentError(f"{flag}: a teacher trained with {what} is not supported; train it without")
    return checkpoint, settings


def teacher_final_reward(path: str, window: int = 5) -> float | None:
    """The teacher run's final reward (mean of its last ``window`` steps' rewards in ``metrics.jsonl``), or None."""
    p = Path(path)
    run = p.parent.parent if (p / "manifest.json").is_file() else p
    try:
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    except (OSError, ValueError):
        return None
    last = [r["reward"] for r in rows[-window:] if "reward" in r]
    return sum(last) / len(last) if last else None


def load_teacher(args: argparse.Namespace):
    """The teacher: its model built with its own settings under this run's layout, weights loaded from
    its checkpoint (torch's generator state is kept as it was: loading a checkpoint restores the teacher
    run's). Returns a ``fnppo.TeacherModel``."""
    import torch

    import fnppo
    from toy.model import build

    checkpoint, settings = teacher_source(args.distill_from)
    own = {k: settings.get(k, getattr(args, k)) for k in TEACHER_SETTINGS}
    targs = argparse.Namespace(**{**vars(args), **own, "lora_rank": 0, "moe": False, "hf_checkpoint": None})
    targs.batch_invariant = False
    state = build(targs)
    rng = torch.get_rng_state()
    try:
        state, _ = fnppo.checkpoint.load_checkpoint(checkpoint, state)
    except fnppo.checkpoint.CheckpointError as err:
        raise ArgumentError(f"--distill-from {args.distill_from}: {err}") from None
    finally:
        torch.set_rng_state(rng)
    for chunk in state.model:
        chunk.requires_grad_(False)
    return fnppo.TeacherModel(state.model)


def distill_loss(loss, args: argparse.Namespace, teacher):
    """``loss`` with the reverse-KL term to ``teacher``; with ``--distill-only`` the term alone."""
    import fnppo

    term = fnppo.losses.ReverseKL(coef=args.distill_coef, teacher=teacher)
    if args.distill_only:
        return dataclasses.replace(
            loss, policy=None, kl=None, entropy_coef=0.0, correction=None, bypass_old_logprobs=False, distill=term
        )
    return dataclasses.replace(loss, distill=term)
