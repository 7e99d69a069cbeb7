"""What a checkpoint holds, as Megatron sharded state dicts: model chunks, optimizer, RNG, run state.

* Model: each chunk's ``sharded_state_dict()`` (Megatron's global keys and shapes, so that any
  TP/PP/VPP/DP/EP/CP layout reads it back), without the parameters tagged ``fnppo_lora_base``
  (frozen base weights of LoRA adapters: the user loads them from the base model first).
* Optimizer: the optimizer's ``sharded_state_dict(model_sharded_state_dict, ...)``; the distributed
  optimizer's state in Megatron's ``fully_reshardable`` form (main parameters and Adam moments in the
  model's own sharding). A never-stepped Adam has its (zero) state made for the save and removed after,
  so a save before the first step works and a load continues exactly as a fresh optimizer would.
* RNG: every rank's generators (torch, Python, NumPy, CUDA, Megatron's trackers) as one sharded object
  ``fnppo.rng`` of shape ``[world size]``.
* Run state (step, train-state names, the caller's ``extra``): common (non-sharded) state, written by rank 0.
"""

from __future__ import annotations

import contextlib
import random
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import torch
from megatron.core import tensor_parallel
from megatron.core.dist_checkpointing.mapping import ShardedBase, ShardedObject

from fnppo.io.checkpoint.manifest import checkpoint_error
from fnppo.megatron.parallel import current_layout
from fnppo.megatron.state import TrainState, TrainStates
from fnppo.megatron.unwrap import unwrap_model

__all__ = [
    "OPTIMIZER_METADATA",
    "named_states",
    "layout_record",
    "lora_base_params",
    "model_sharded_state_dict",
    "optimizer_sharded_state_dict",
    "fill_empty_adam_state",
    "drop_filled_state",
    "sub_optimizers",
    "rng_state",
    "set_rng_state",
    "rng_object",
    "RNG_KEY",
    "quiet_checkpointing",
]

RNG_KEY = "fnppo.rng"
#: how the optimizer's state is sharded in the checkpoint: in model space (reshardable to any layout),
#: with keys that do not depend on how Megatron chains its optimizers
OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "fully_reshardable", "chained_optim_avoid_prefix": True}


def named_states(state: TrainStates, fn: str) -> dict[str, TrainState]:
    """``{name: TrainState}`` of a mapping (non-empty names), ``{"": state}`` of one train state."""
    expected = "a TrainState or a non-empty mapping of non-empty names to train states"
    named = dict(state) if isinstance(state, Mapping) else {"": state}
    if not (named and all(isinstance(k, str) and (k or not isinstance(state, Mapping)) for k in named)):
        raise checkpoint_error(fn, "state", expected, repr(list(named)))
    for name, one in named.items():
        if not all(hasattr(one, a) for a in ("model", "optimizer", "step")):  # a TrainState, by what is used
            where = "state" if not isinstance(state, Mapping) else f"state[{name!r}]"
            raise checkpoint_error(fn, where, "a TrainState (model, optimizer, step)", f"{type(one).__name__}")
    return named


def layout_record() -> dict[str, int]:
    """The current parallel layout, as the manifest records it."""
    lay = current_layout()
    return {
        "world_size": lay.world_size,
        "tp": lay.tp,
        "pp": lay.pp,
        "dp": lay.dp,
        "vpp": lay.vpp or 0,
        "ep": lay.ep,
        "etp": lay.etp,
        "cp": lay.cp,
    }


def lora_base_params(chunks: Any) -> set[int]:
    """``id`` of every parameter tagged ``param.fnppo_lora_base = True`` (left out of checkpoints)."""
    return {id(p) for c in chunks for p in unwrap_model(c).parameters() if getattr(p, "fnppo_lora_base", False)}


def _without(tree: Any, skip: set[int]) -> Any:
    """``tree`` (nested dicts of sharded entries) without the entries whose tensor is one of ``skip``."""
    if isinstance(tree, dict):
        kept = {k: _without(v, skip) for k, v in tree.items()}
        return {k: v for k, v in kept.items() if v is not _SKIPPED}
    if isinstance(tree, ShardedBase) and id(getattr(tree, "data", None)) in skip:
        return _SKIPPED
    return tree


_SKIPPED = object()


def model_sharded_state_dict(one: TrainState, prefix: str) -> dict[str, Any]:
    """``{"chunk<i>": chunk i's sharded state dict}`` of a train state's model (keys prefixed ``prefix``),
    LoRA base weights left out."""
    skip = lora_base_params(one.model)
    out = {}
    for i, chunk in enumerate(one.model):
        sd = unwrap_model(chunk).sharded_state_dict(prefix=prefix, metadata={})
        out[f"chunk{i}"] = _without(sd, skip)
    return out


def sub_optimizers(optimizer: Any) -> list[Any]:
    """Megatron wraps its optimizers in a ChainedOptimizer; the state lives in the parts."""
    return list(getattr(optimizer, "chained_optimizers", None) or [optimizer])


def _scalar_dtype() -> torch.dtype:
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


def fill_empty_adam_state(optimizer: Any) -> list[tuple[dict, Any]]:
    """Give each parameter of a never-stepped Adam/AdamW the state torch's Adam would make at its first step
    (step 0, zero moments); returns what was filled, for :func:`drop_filled_state`."""
    filled: list[tuple[dict, Any]] = []
    for sub in sub_optimizers(optimizer):
        inner = getattr(sub, "optimizer", None)
        if not isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)):
            continue
        for group in inner.param_groups:
            for p in group["params"]:
                if inner.state.get(p):
                    continue
                st = {
                    "step": torch.tensor(0.0, dtype=_scalar_dtype()),
                    "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                    "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
                }
                if group.get("amsgrad"):
                    st["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                inner.state[p] = st
                filled.append((inner.state, p))
    return filled


def drop_filled_state(filled: list[tuple[dict, Any]]) -> None:
    """Undo :func:`fill_empty_adam_state`: the optimizer is never-stepped again."""
    for state, p in filled:
        state.pop(p, None)


def _is_distributed(sub: Any) -> bool:
    return hasattr(sub, "load_parameter_state_from_fully_reshardable")


def optimizer_sharded_state_dict(
    optimizer: Any, model_sd: dict[str, Any], *, is_loading: bool
) -> tuple[dict[str, Any], list[list[int]] | None]:
    """The optimizer's sharded state dict over the model's (all chunks of one train state), and for a
    distributed optimizer the index that maps it back (each part's parameter indices).

    Megatron chains one distributed optimizer per gradient-buffer group, and how many there are depends
    on the layout (experts get their own under EP > 1). So the parts are merged into one layout-free dict:
    ``param_groups`` (all parts' groups; each part picks its own by Megatron's group keys on load) and
    ``param_state`` by model key (main parameter and Adam moments, each sharded like its parameter). A
    non-distributed optimizer is saved in Megatron's own (chained) form.
    """
    flat: dict[str, Any] = {}
    for chunk_sd in model_sd.values():
        flat.update(chunk_sd)
    subs = sub_optimizers(optimizer)
    if not all(_is_distributed(sub) for sub in subs):
        sd = optimizer.sharded_state_dict(flat, is_loading=is_loading, metadata=dict(OPTIMIZER_METADATA))
        return {"kind": "megatron", "state": sd}, None
    groups: list[Any] = []
    param_state: dict[int, Any] = {}
    for i, sub in enumerate(subs):
        sd = sub.sharded_state_dict(flat, is_loading=is_loading, metadata=dict(OPTIMIZER_METADATA))
        groups += sd["optimizer"]["param_groups"]
        param_state[i] = sd["param_state"]  # (sharded tensors only: matched by their keys, not by i)
    out = {"kind": "distributed", "param_groups": groups, "param_state": param_state}
    if getattr(subs[0], "grad_scaler", None) is not None and not is_loading:
        out["grad_scaler"] = subs[0].grad_scaler.state_dict()
    return out, [sorted(part) for part in param_state.values()]


def rng_state() -> dict[str, Any]:
    """Every generator of this process: torch's, Python's, NumPy's, CUDA's (when initialized), Megatron's trackers."""
    out: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = torch.cuda.get_rng_state()
    try:
        out["megatron"] = {
            k: v.clone() if isinstance(v, torch.Tensor) else v
            for k, v in tensor_parallel.get_cuda_rng_tracker().get_states().items()
        }
    except Exception:  # noqa: BLE001 - tracker not initialized
        pass
    return out


def set_rng_state(state: Mapping[str, Any], *, trackers: bool) -> None:
    """Restore :func:`rng_state`'s generators; Megatron's trackers only with ``trackers`` (same layout)."""
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    if trackers and "megatron" in state:
        tensor_parallel.get_cuda_rng_tracker().set_states(dict(state["megatron"]))


def rng_object(data: Any, rank: int, world: int) -> ShardedObject:
    """Rank ``rank``'s generators as its shard of the ``[world]``-shaped object :data:`RNG_KEY`."""
    return ShardedObject(RNG_KEY, data, (world,), (rank,), replica_id=0)


@contextlib.contextmanager
def quiet_checkpointing() -> Iterator[None]:
    """Without the deprecation notices torch.distributed.checkpoint prints on every call Megatron makes
    (``load_state_dict`` is deprecated; ShardedTensor is deprecated): they are about Megatron's calls, not
    the caller's."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed.*|megatron.*|fnppo.*")
        warnings.filterwarnings("ignore", message=".*(load_state_dict. is deprecated|deprecating ShardedTensor).*")
        yield
