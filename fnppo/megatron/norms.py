"""Norm layers for Megatron's local layer spec that also work under sequence parallelism.

Megatron's local spec builds its norms with ``WrappedTorchNorm``, which refuses
``sequence_parallel=True`` (only Transformer Engine's and Apex's norms mark their parameters for
it). :class:`SequenceParallelNorm` builds the same ``torch.nn.LayerNorm`` / ``torch.nn.RMSNorm``
and sets ``param.sequence_parallel = config.sequence_parallel`` on its weight (and bias), as TE
does. Under sequence parallelism every TP rank normalizes its own slice of the sequence, so each
holds a partial gradient of the (TP-replicated) norm parameters: Megatron's
``finalize_model_grads`` sums the gradients of parameters marked ``sequence_parallel`` over the TP
group (``_allreduce_non_tensor_model_parallel_grads``), giving the gradient of the whole sequence.

Reference: sequence parallelism, Korthikanti et al., arXiv:2205.05198.
"""

from __future__ import annotations

from typing import Any

import torch

from fnppo.core.errors import input_error

__all__ = ["SequenceParallelNorm"]


class SequenceParallelNorm:
    """``torch.nn.LayerNorm`` or ``torch.nn.RMSNorm`` (``config.normalization``) for Megatron specs.

    Same constructor as Megatron's ``WrappedTorchNorm`` (``config, hidden_size, eps, ...``); the
    module returned is the plain torch norm, its parameters marked ``sequence_parallel`` as the
    config says (see the module docstring).

    Raises:
        InputError: a normalization other than LayerNorm/RMSNorm, or zero-centered gamma.
    """

    def __new__(
        cls,
        config: Any,
        hidden_size: int,
        eps: float = 1e-5,
        persist_layer_norm: bool = False,
        zero_centered_gamma: bool = False,
        normalization: str = "LayerNorm",
    ) -> torch.nn.Module:
        fn = "fnppo.megatron.norms.SequenceParallelNorm"
        if getattr(config, "layernorm_zero_centered_gamma", False):
            raise input_error(fn, "config.layernorm_zero_centered_gamma", "False (not supported)", "True")
        kinds = {"LayerNorm": torch.nn.LayerNorm, "RMSNorm": torch.nn.RMSNorm}
        if config.normalization not in kinds:
            raise input_error(fn, "config.normalization", "'LayerNorm' or 'RMSNorm'", repr(config.normalization))
        norm = kinds[config.normalization](normalized_shape=hidden_size, eps=eps)
        for p in norm.parameters():
            p.sequence_parallel = bool(config.sequence_parallel)
        return norm
