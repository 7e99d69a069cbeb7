"""The train states (actor, critic; random or from Hugging Face; LoRA, MoE), the step and critic
configs and the KL controller of a command line."""

from __future__ import annotations

import argparse
import dataclasses
import random

import numpy as np
import torch

import fnppo
from fnppo.io.hf import build_gpt_from_hf, load_hf_weights
from toy.errors import ArgumentError
from toy.losses import POLICY_LOSSES, STALENESS, flat_fields
from toy.settings import init_std, kl_horizon, lora_output_std, policy_lr
from toy.task import PROMPT_LEN, RESPONSE_LEN, VOCAB


def build(args: argparse.Namespace, head: str = "lm"):
    """The actor's (``head="lm"``) or the critic's (``head="value"``) train state.

    The critic has the actor's architecture and initial trunk (the same checkpoint, or the same
    layout-invariant initialization from ``--seed``) and a fresh value head; with
    ``--critic-checkpoint`` it is that value model, head included.
    """
    checkpoint = args.critic_checkpoint if head == "value" and args.critic_checkpoint else args.hf_checkpoint
    if checkpoint:
        flag = "--critic-checkpoint" if checkpoint == args.critic_checkpoint and head == "value" else "--hf-checkpoint"
        try:  # a checkpoint fnppo.io.hf refuses (architecture, names, shapes) is a refused argument: exit 2
            chunks = build_gpt_from_hf(checkpoint, dtype=args.dtype, head=head)
            load_hf_weights(
                chunks, checkpoint
            )  # a value model: the trunk (and a value checkpoint's head); lm_head is skipped
        except (fnppo.InputError, fnppo.checkpoint.CheckpointError) as err:  # (a damaged file: CheckpointError)
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
    alpha = args.lora_alpha if args.lora_alpha is not None else 2.0 * args.lora_rank
    return fnppo.lora.LoRAConfig(rank=args.lora_rank, alpha=alpha, seed=args.seed)


def scale_output_layer(chunks, factor: float) -> None:
    """Multiply the (untied) output layer of freshly built chunks by ``factor`` (its weights are then
    N(0, (factor x init std)^2), the same in every layout); the last pipeline stage holds it."""
    with torch.no_grad():
        for chunk in chunks:
            layer = getattr(fnppo.models.unwrap_model(chunk), "output_layer", None)
            if layer is not None and layer.weight is not None:
                layer.weight.copy_(layer.weight * factor)


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


def policy_loss_config(args: argparse.Namespace):
    """The ``LossConfig`` of ``--policy-loss`` (a row of :data:`toy.losses.POLICY_LOSSES`) with the run's
    entropy bonus and k3 KL penalty, token-mean aggregation."""
    loss = fnppo.losses.from_flat(
        loss_agg_mode="token-mean",
        entropy_coeff=args.entropy_coeff,
        kl_coef=args.kl_coef,
        kl_estimator="k3",
        **flat_fields(args.policy_loss, args.tis_cap),
    )
    part = POLICY_LOSSES[args.policy_loss].part
    if part is not None:
        factory, kwargs = part
        kwargs = {k: args.staleness if v == STALENESS else v for k, v in kwargs.items()}
        loss = dataclasses.replace(loss, policy=getattr(fnppo.losses, factory)(**kwargs))
    return loss


def packing(args: argparse.Namespace):
    """``--shared-prefix``: a GRPO group's prompt forwarded once (``fnppo.batching.SharedPrefix``), or None.
    ``auto`` shares where the step's numbers are the unshared step's up to rounding: fnppo's local
    layer spec (``--spec local``, or the default without Transformer Engine), not ``--batch-invariant``,
    and no MoE router loss (its balance and z-losses are statistics of the tokens the routers compute:
    a shared prompt counts once)."""
    local = args.spec == "local" or (args.spec == "default" and not fnppo.models.te_available())
    router_loss = args.moe and (args.moe_aux_coeff > 0 or args.moe_z_coeff > 0)
    exact = local and not args.batch_invariant and not router_loss
    on = args.shared_prefix == "on" or (args.shared_prefix == "auto" and exact)
    return fnppo.batching.SharedPrefix() if on else None


def step_config(args: argparse.Namespace):
    """The actor's ``StepConfig``: ``--policy-loss``, the split (2 micro-batches or a token budget),
    mini-batches, ``--shared-prefix``."""
    loss = policy_loss_config(args)
    split = {}
    if args.max_tokens_per_microbatch:
        split["max_tokens_per_microbatch"] = args.max_tokens_per_microbatch
    else:
        split["num_microbatches"] = args.num_microbatches or 2
    return fnppo.StepConfig(
        loss=loss,
        layout="packed",
        temperature=args.temperature,
        num_minibatches=args.minibatches,
        packing=packing(args),
        **split,
    )


def critic_config(args: argparse.Namespace):
    """The critic's split is the actor's (same micro-batches and mini-batches)."""
    cfg = step_config(args)
    split = {
        k: getattr(cfg, k) for k in ("num_microbatches", "max_tokens_per_microbatch") if getattr(cfg, k) is not None
    }
    return fnppo.CriticConfig(
        loss=fnppo.losses.ValueLossConfig(clip_range=args.value_clip),
        layout="packed",
        num_minibatches=args.minibatches,
        packing=cfg.packing,
        **split,
    )


def kl_controller(args: argparse.Namespace):
    """The KL controller's start state and update: adaptive with ``--kl-target``, else fixed at ``--kl-coef``."""
    if args.kl_target is None:
        return fnppo.kl.fixed_kl_init(args.kl_coef), fnppo.kl.fixed_kl_update
    return fnppo.kl.adaptive_kl_init(args.kl_coef, args.kl_target, kl_horizon(args)), fnppo.kl.adaptive_kl_update


def set_lr(optimizer, lr: float) -> None:
    """Set the learning rate of every parameter group of a Megatron optimizer."""
    for group in optimizer.param_groups:
        group["lr"] = lr


def seed_everything(seed: int) -> None:
    """Seed every generator a checkpoint saves and restores: torch's, Python's and NumPy's (Megatron's
    trackers are seeded by ``init_parallel``). The run itself draws only from torch's and from generators
    of (seed, step); seeding the others makes a run's whole RNG state a function of its settings."""
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)
