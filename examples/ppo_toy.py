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

This file is the entry point; the parts are the package ``examples/toy/`` (its ``__init__`` lists them).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the parts (examples/toy/), however this file is run
from toy.launch import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
