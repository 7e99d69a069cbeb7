"""What a model chunk is under its wrappers: the ``GPTModel`` inside, and the head it ends in.

Every layer that handles model chunks (building, forwarding, weights, routing, MoE metrics, the
steps, checkpoints) reads the module inside Megatron's ``DistributedDataParallel`` /
``Float16Module`` wrappers through :func:`unwrap_model`, and which head the last stage carries
(:data:`HEADS`) through :func:`model_head` / :func:`check_head`. No Megatron import is needed.
"""

from __future__ import annotations

from torch import nn

from fnppo.core.errors import input_error

__all__ = ["HEADS", "unwrap_model", "model_head", "check_head"]

HEADS = ("lm", "value")
"""What the last pipeline stage ends in: ``"lm"`` (the vocabulary output layer, logits) or
``"value"`` (a scalar value head per token, :class:`fnppo.megatron.value.GPTValueModel`)."""


def unwrap_model(model: nn.Module) -> nn.Module:
    """The ``GPTModel`` inside DDP / ``Float16Module`` wrappers."""
    while hasattr(model, "module") and isinstance(model.module, nn.Module):
        model = model.module
    return model


def model_head(model: nn.Module) -> str:
    """``"value"`` for a value model (``build_gpt(cfg, head="value")``), else ``"lm"`` (any wrapper)."""
    return getattr(unwrap_model(model), "fnppo_head", "lm")


def check_head(fn: str, arg: str, model: nn.Module, head: str) -> None:
    """``model`` (any wrapper) ends in ``head`` (one of :data:`HEADS`); the one home of this check.

    Raises:
        InputError: naming ``fn`` and ``arg``, e.g. a value model given to
            :func:`fnppo.megatron.forward.forward_logits`.
    """
    have = model_head(model)
    if have != head:
        want = (
            "a value model (fnppo.build_gpt(cfg, head='value'))"
            if head == "value"
            else "a language model with a vocabulary output layer (head='lm')"
        )
        got = (
            "a value model (head='value')"
            if have == "value"
            else f"{type(unwrap_model(model)).__name__} with a vocabulary output layer (head='lm')"
        )
        raise input_error(fn, arg, want, got)
