"""Loading a Hugging Face safetensors checkpoint into this rank's shard of a built model
(:func:`load_hf_weights`): the checkpoint's ``config.json`` and tensors checked against the model,
then each parameter filled from only the rows/columns this rank holds.

Loading reads only the safetensors metadata first and validates every name and shape of the
whole checkpoint on every rank (so all ranks fail alike, before anything is written); it then reads,
one parameter at a time, only the rows/columns this rank holds (``safe_open(...).get_slice``), so
host memory never holds more than one parameter beyond the model itself.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from contextlib import ExitStack
from pathlib import Path

import torch
from torch import nn

from fnppo.core.errors import input_error
from fnppo.core.typing import Tensor
from fnppo.io.hf.arch import Arch, expected_hf_shapes, model_arch
from fnppo.io.hf.checks import check_hf_config, config_path
from fnppo.io.hf.config import checked_hf_config, read_hf_config
from fnppo.io.hf.keys import VALUE_HEAD_RULES, param_rule
from fnppo.io.hf.layouts import read_shard
from fnppo.io.hf.shards import Reader, open_shards, shard_files
from fnppo.io.hf.value_head import ValueHead, value_head_of
from fnppo.megatron.parallel import ParallelLayout, current_layout
from fnppo.megatron.stacked_experts import named_weights
from fnppo.megatron.unwrap import unwrap_model
from fnppo.megatron.weights import global_name as _global_name
from fnppo.megatron.weights import tp_of as _tp_of

_Plan = list[tuple[Tensor, str, tuple[str, ...]]]  # (parameter, kind, HF names) of every parameter to fill


def load_hf_weights(model_chunks: Sequence[nn.Module], path: str | os.PathLike) -> list[str]:
    """Load a Hugging Face safetensors checkpoint into this rank's TP/PP shard of the model.

    A value model (``build_gpt_from_hf(path, head="value")``) loads a value or reward model whole:
    a checkpoint whose ``config.json`` names ``<Family>ForTokenClassification`` or
    ``<Family>ForSequenceClassification`` with ``num_labels=1`` (or, without a ``config.json``,
    one that holds ``score.weight``) fills the trunk and the value head (``score.weight`` ``[1,
    hidden]`` -> ``value_head.weight``, ``score.bias`` -> ``value_head.bias``, zero where the
    checkpoint has none: sequence classifiers, ``token_classification_bias=false``), on every TP
    rank of the last pipeline stage (the head is replicated there). From a policy checkpoint
    (``*ForCausalLM``) it gets the trunk (embedding, layers, final norm) only: its value head keeps
    its fresh weights and the checkpoint's ``lm_head.weight`` (when stored) is skipped. Critics of
    other RL stacks (:data:`VALUE_HEAD_LAYOUTS`, :func:`value_head_of`): TRL's
    ``AutoModelForCausalLMWithValueHead`` (a ``*ForCausalLM`` config with ``v_head.summary.weight``
    / ``.bias``; its ``lm_head.weight`` skipped), OpenRLHF's ``CriticModel`` / ``RewardModel``
    (``<value_head_prefix>.weight``, no bias; ``normalize_reward: true`` folds
    ``(v - mean) / std`` into the head), verl's Megatron critic (a ``*ForCausalLM`` config with a
    one-row ``lm_head.weight``). Returns the
    names of the checkpoint's tensors that were not loaded (sorted): that ``lm_head.weight``, a tied
    model's stored copy of the embedding, ``*.rotary_emb.inv_freq`` buffers. A damaged file (a
    ``config.json``, the index or a shard that is truncated, corrupt or unreadable) raises
    ``CheckpointError`` naming the file and the cause (:mod:`fnppo.io.files`), before anything is loaded.

    ``path``: a local directory with ``model.safetensors`` or ``model.safetensors.index.json`` and
    its shards (or one ``.safetensors`` file). Names and layouts are converted as in :mod:`fnppo.io.hf.keys`
    and :mod:`fnppo.io.hf.layouts` (fused QKV in Megatron's per-group order, fused ``[gate; up]``).

    First the checkpoint's ``config.json`` (beside the shards), when present, must describe the
    architecture the model was built for: family (``model_type``, ``architectures``), sizes,
    ``head_dim``, ``vocab_size`` (the real one), ``rms_norm_eps``, rope (``rope_parameters`` of
    transformers 5 or ``rope_theta`` / ``rope_scaling``: type, theta, llama3 factors),
    ``partial_rotary_factor``, no sliding window (``sliding_window``, ``use_sliding_window``,
    ``layer_types``), ``tie_word_embeddings``, ``attention_bias``, ``mlp_bias``, ``hidden_act``,
    and for a value model the head (``architectures``; a classifier's ``id2label`` / ``num_labels``
    must give one label); a difference raises ``InputError`` naming the key as the file spells it,
    the model's value and the file's (and every other differing key). The file is read through its
    family's allow-list (:mod:`fnppo.io.hf.config_keys`): a key fnppo does not know or refuses
    (``no_rope_layers``, ``rope_interleave``, ...), or a value of the wrong type or range, raises
    ``InputError`` naming it; a file that is not a JSON object raises ``CheckpointError`` naming the
    path and the cause. Then every tensor name, shape and dtype of the
    checkpoint is checked against the whole model (all layers, all ranks) from the safetensors
    headers alone: a missing tensor, an unexpected one (``*.rotary_emb.inv_freq`` buffers are
    tolerated and ignored), a wrong shape, a non-floating dtype raise ``InputError`` naming the
    tensor, and nothing is loaded. A tied model refuses a stored ``lm_head.weight`` unless it
    equals ``model.embed_tokens.weight`` (transformers would untie the two; the error names both
    ways out: an untied model, or dropping the tensor). Then each parameter of each chunk is filled
    from only the rows/columns this rank holds (one parameter in host memory at a time), cast to the
    parameter's dtype. Vocabulary rows beyond the checkpoint's ``vocab_size``
    (``make_vocab_size_divisible_by`` padding) are zero.
    Not a collective: every rank reads on its own. Build the optimizer after loading (half-precision
    optimizers keep fp32 copies of the parameters).
    """
    fn = "fnppo.io.hf.load_hf_weights"
    a = model_arch(fn, model_chunks)
    layout = current_layout()
    root = Path(path)
    files = shard_files(fn, root)
    cfg_file = config_path(root)
    described, hf = None, None
    if cfg_file.is_file():
        hf = read_hf_config(fn, "path", cfg_file)
        if hf.get("model_type") == a.family:  # else check_hf_config names the other family
            hf = checked_hf_config(fn, hf, "config.json", head=False)[0]
        described = check_hf_config(fn, unwrap_model(model_chunks[0]), a, hf, "config.json", f"in {cfg_file}")
    with ExitStack() as stack:
        shapes, read = open_shards(fn, files, stack)
        vocab = _checkpoint_vocab(fn, a, model_chunks, hf, shapes)
        value_head = value_head_of(fn, a, described, hf, shapes, vocab)
        expected = expected_hf_shapes(a, vocab, "lm" if value_head is None else value_head.names)
        _check_tensors(fn, a, root, shapes, expected, value_head, vocab)
        plan = _plan(fn, a, model_chunks, value_head)
        _check_tied_head(fn, a, read, shapes)
        _fill(fn, a, plan, read, value_head, layout, vocab)
    skipped = {"lm_head.weight"} if a.value and (value_head is None or value_head.layout != "lm_head") else set()
    loaded = set(expected) - skipped  # by the whole model (all ranks)
    return sorted(set(shapes) - loaded)


def _checkpoint_vocab(
    fn: str, a: Arch, model_chunks: Sequence[nn.Module], hf: Mapping | None, shapes: Mapping[str, Sequence[int]]
) -> int:
    """The checkpoint's vocabulary: its ``config.json``'s ``vocab_size``, else the embedding's rows.

    Raises:
        InputError: more rows than the model's padded vocabulary, or another vocabulary than the one
            the model was built for (rows beyond it would be taken for real tokens).
    """
    v = None if hf is None else hf.get("vocab_size")
    if isinstance(v, int):
        vocab = v
    else:
        emb = shapes.get("model.embed_tokens.weight")
        vocab = int(emb[0]) if emb else -1
    if vocab > a.padded_vocab or vocab < 1:
        raise input_error(
            fn,
            "checkpoint['model.embed_tokens.weight']",
            f"at most {a.padded_vocab} rows (the model's vocabulary)",
            f"vocab_size {vocab}",
        )
    built = getattr(unwrap_model(model_chunks[0]), "fnppo_config", None)
    if built is not None and vocab != built.vocab_size:  # rows beyond it would be taken for real tokens
        raise input_error(
            fn,
            "checkpoint['model.embed_tokens.weight']",
            f"{built.vocab_size} rows (the model's vocab_size)",
            f"{vocab} rows",
        )
    return vocab


def _check_tensors(
    fn: str,
    a: Arch,
    root: Path,
    shapes: Mapping[str, tuple[int, ...]],
    expected: Mapping[str, tuple[int, ...]],
    value_head: ValueHead | None,
    vocab: int,
) -> None:
    """Every expected tensor stored with its shape (the value head's weight first: its labels), and no
    other tensor but the tolerated ones.

    Raises:
        InputError: a missing tensor, a wrong shape, an unexpected tensor (naming it).
    """
    head_names = () if value_head is None else value_head.names
    for name in sorted(expected, key=lambda n: (n not in head_names[:1], n)):  # the head's weight first (its labels)
        if name not in shapes:
            raise input_error(
                fn,
                "path",
                f"a tensor named {name!r}",
                f"a checkpoint without it ({len(shapes)} tensors in {str(root)!r})",
            )
        if shapes[name] != expected[name]:
            note = " (num_labels=1: one value per token)" if name in head_names else ""
            raise input_error(fn, f"checkpoint[{name!r}]", f"shape {expected[name]}{note}", f"shape {shapes[name]}")
    # a language model's lm_head where the model ties it (checked below), a value model's skipped
    # lm_head: a policy's or, beside TRL's v_head, its causal LM's
    lm_rows = value_head is None or value_head.layout == "v_head.summary"
    tolerated = {"lm_head.weight": expected.get("lm_head.weight", (vocab, a.hidden))} if lm_rows else {}
    for name in sorted(shapes):
        if name in expected or name.endswith(".rotary_emb.inv_freq"):
            continue
        if name in tolerated and shapes[name] == tolerated[name]:
            continue
        hint = (
            " (a value or reward model's head: load it into build_gpt_from_hf(path, head='value'))"
            if name.startswith("score.") and not a.value
            else ""
        )
        raise input_error(
            fn,
            "path",
            "only the tensors of the model's architecture",
            f"an unexpected tensor {name!r} of shape {shapes[name]}{hint}",
        )


def _check_tied_head(fn: str, a: Arch, read: Reader, shapes: Mapping[str, tuple[int, ...]]) -> None:
    """A tied model ignores a stored ``lm_head.weight`` only if it equals the embedding (transformers
    unties the two when they differ: loading such a checkpoint tied would give other logits)."""
    name, emb = "lm_head.weight", "model.embed_tokens.weight"
    if not a.tied or a.value or name not in shapes:  # a value model skips lm_head
        return
    rows, worst = shapes[emb][0], 0.0
    for r0 in range(0, rows, 4096):  # a few thousand rows at a time, on every rank (all agree)
        index = (slice(r0, min(rows, r0 + 4096)), slice(None))
        x, y = read(name, index).double(), read(emb, index).double()
        if not torch.equal(x, y):
            worst = max(worst, float((x - y).abs().nan_to_num(float("inf")).max()))
    if worst > 0:
        raise input_error(
            fn,
            f"checkpoint[{name!r}]",
            f"absent or equal to {emb!r} (the model ties them; transformers would untie them and use both: to do "
            f"the same, set tie_word_embeddings to false in config.json and rebuild the model; to keep them tied, "
            f"delete {name!r} from the checkpoint)",
            f"a different tensor (max |difference| {worst:.3g})",
        )


def _plan(fn: str, a: Arch, model_chunks: Sequence[nn.Module], value_head: ValueHead | None) -> _Plan:
    """What fills each parameter of this rank's chunks: its rule, or the value head's stored tensor
    (kind ``head``; ``zero`` for a bias the checkpoint has not); a policy's trunk leaves the value head
    as built."""
    plan: _Plan = []
    for chunk in model_chunks:
        core = unwrap_model(chunk)
        for name, param in named_weights(core):
            gname = _global_name(core, name)
            kind, names = param_rule(fn, a, gname)
            if a.value and gname in VALUE_HEAD_RULES:
                if value_head is None:  # a policy's trunk: the value head stays as built
                    continue
                stored = value_head.names[gname == "value_head.bias"]
                kind, names = ("head", (stored,)) if stored is not None else ("zero", ())
            plan.append((param, kind, names))
    return plan


def _fill(
    fn: str, a: Arch, plan: _Plan, read: Reader, value_head: ValueHead | None, layout: ParallelLayout, vocab: int
) -> None:
    """Copy each planned parameter's shard (one in host memory at a time), cast to its dtype; the value
    head with its normalisation (``scale * w``, ``scale * b + shift``)."""
    with torch.no_grad():
        for param, kind, names in plan:
            if kind in ("head", "zero") and value_head is not None:  # the value head, with its normalisation
                shard = (
                    torch.zeros(param.shape, dtype=torch.float64) if kind == "zero" else read(names[0], None).double()
                )
                is_bias = param.dim() == 1
                shard = shard * value_head.scale + (value_head.shift if is_bias else 0.0)
            else:
                shard = read_shard(read, a, kind, names, param, *_tp_of(param, layout), vocab)
            if tuple(shard.shape) != tuple(param.shape):  # cannot happen after the checks above
                raise AssertionError(
                    f"{fn}: shard of {names} has shape {tuple(shard.shape)}, parameter {tuple(param.shape)}"
                )
            param.copy_(shard.to(dtype=param.dtype, device=param.device))
            del shard
