"""The value model of PPO with a critic: Megatron's ``GPTModel`` trunk with a scalar head per token.

:class:`GPTValueModel` is a ``GPTModel`` whose last pipeline stage ends, after the decoder's final
norm, in :class:`ValueHead` (``hidden -> 1``, weight and bias) instead of the vocabulary output
layer; the other stages are those of a ``GPTModel``, so Megatron's schedules, DDP, distributed
optimizer and ``finalize_model_grads`` treat it like any GPT. Build it with
``fnppo.build_gpt(cfg, head="value")``; it returns ``[batch, seq]`` values on the last stage.

Tensor parallelism. The head is replicated on every TP rank (its input, the decoder output, is
replicated too) and every TP rank computes the same values and the same loss, so each rank's
head and trunk gradients are already the full ones: nothing is reduced, and nothing is summed twice
(the vocabulary output layer's ``copy_to_tensor_model_parallel_region`` would be wrong here: it
all-reduces gradients that are already complete). Under sequence parallelism each TP rank holds
the decoder output of its slice of the sequence: the head maps its slice, the values are gathered
over the sequence (``gather_from_sequence_parallel_region`` with ``tensor_parallel_output_grad=False``:
its backward hands each rank the gradient of its own slice), and the head's parameters are marked
``sequence_parallel``, so Megatron's ``finalize_model_grads`` sums their partial gradients over the
TP group exactly once (as for the norms, :mod:`fnppo.megatron.norms`).

Pipeline parallelism. The head exists on the last stage only, and the model never ties its
embedding to an output layer (``share_embeddings_and_output_weights=False`` on every stage): no
stage builds or all-reduces a copy of the word embedding, so the first and last stages always agree
on the embedding-group collectives of ``finalize_model_grads``.

Hugging Face. The head is transformers' per-token scalar head of ``*ForTokenClassification`` with
``num_labels=1`` (``score.weight`` ``[1, hidden]``, ``score.bias`` ``[1]``) on the same normed
hidden state: :mod:`fnppo.io.hf` loads it from such a checkpoint (or from a ``*ForSequenceClassification``
reward model, bias 0), into every TP rank of the last stage, and exports a value model in that layout.

Reference: the value network of PPO, arXiv:1707.06347; a scalar head on a language model's last
hidden state as in Ziegler et al., arXiv:1909.08593.
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.models.gpt import GPTModel
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group
from torch import nn

from fnppo.core.errors import input_error

__all__ = ["GPTValueModel", "ValueHead", "VALUE_HEAD_PREFIX"]

VALUE_HEAD_PREFIX = "value_head."
"""Names of the value head's parameters start with this (``value_head.weight``, ``value_head.bias``)."""

_HEAD_SEED = 0


class ValueHead(nn.Module):
    """``values[b, s] = hidden[s, b] . w + c``: one scalar per token, replicated on every TP rank.

    The weight ``[1, hidden]`` is drawn from ``N(0, init_method_std^2)`` by a generator with a fixed
    seed (the same head on every TP rank; :func:`fnppo.models.layout_invariant_init` redraws it from the
    run's seed), the bias ``[1]`` is 0.
    """

    def __init__(self, config: Any, tp_group: Any) -> None:
        super().__init__()
        device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
        g = torch.Generator().manual_seed(_HEAD_SEED)
        weight = torch.randn(1, config.hidden_size, generator=g) * config.init_method_std
        self.weight = nn.Parameter(weight.to(device=device, dtype=config.params_dtype))
        self.bias = nn.Parameter(torch.zeros(1, device=device, dtype=config.params_dtype))
        self.sequence_parallel = bool(config.sequence_parallel)
        self.tp_group = tp_group
        for p in (self.weight, self.bias):
            p.sequence_parallel = self.sequence_parallel  # finalize_model_grads sums them over TP under SP

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden`` ``[seq, batch, hidden]`` (this rank's slice of ``seq`` under sequence
        parallelism) -> values ``[batch, seq]`` over the whole sequence, in the model's dtype."""
        values = torch.nn.functional.linear(hidden, self.weight, self.bias)  # [seq, batch, 1]
        if self.sequence_parallel:
            values = gather_from_sequence_parallel_region(
                values, tensor_parallel_output_grad=False, group=self.tp_group
            )
        return values.squeeze(-1).transpose(0, 1)


class GPTValueModel(GPTModel):
    """A ``GPTModel`` whose last stage returns values ``[batch, seq]`` (see the module docstring).

    Same constructor as ``GPTModel``; ``share_embeddings_and_output_weights`` is always False, and
    the vocabulary output layer that ``GPTModel`` builds on the last stage is removed (it exists for
    the duration of the constructor only).
    """

    fnppo_head = "value"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs["share_embeddings_and_output_weights"] = False
        super().__init__(*args, **kwargs)
        if getattr(self.config, "mtp_num_layers", None):
            raise input_error(
                "fnppo.build_gpt", "mtp_num_layers", "None with head='value'", repr(self.config.mtp_num_layers)
            )
        if self.post_process:
            del self.output_layer
            self.value_head = ValueHead(self.config, self.pg_collection.tp)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None) -> Any:
        """Megatron's sharded state dict (distributed checkpoints) of the trunk and the value head (replicated
        over TP). ``GPTModel``'s own marks the vocabulary output layer, which a value model does not have, so
        the module-by-module default is used (no output layer to tie or pad; no MTP layers)."""
        return MegatronModule.sharded_state_dict(
            self, prefix, sharded_offsets, ensure_metadata_has_dp_cp_group(metadata)
        )

    def _postprocess(self, hidden_states: torch.Tensor, **kwargs: Any) -> torch.Tensor:  # GPTModel.forward's last step
        if not self.post_process:
            return hidden_states
        return self.value_head(hidden_states)
