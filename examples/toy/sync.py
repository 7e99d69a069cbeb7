"""``--sync``: the sampler as a separate inference engine that runs only the weights it was sent.

After every update the trainer streams its weights in Hugging Face names (``fnppo.hf``): ``full``
(``stream_hf_weights``), ``delta`` (``stream_hf_deltas``: only the changed tensors, blocks or
elements, each with its SHA-256 digest, checked and applied by ``apply_hf_deltas``), ``fp8`` and
``fp8-delta`` (the same with E4M3 projection weights and their per-block ``weight_scale_inv``). Rank 0
plays the engine: it holds the received weights, dequantizes FP8 ones (codes times block scales, as
transformers' fine-grained FP8 loader does) and hands them to the sampler's own copy of the model
(``load_hf_weights`` from a directory in the run directory), which samples the next rollouts. With
``delta`` and ``full`` the sampler's weights are the trainer's bit for bit; with FP8 it runs the
dequantized FP8 weights (a slightly different policy: the off-policy KL is reported).
"""

from __future__ import annotations

import dataclasses
import math
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import fnppo
from fnppo import hf

MODES = ("off", "full", "delta", "fp8", "fp8-delta")


@dataclasses.dataclass(frozen=True)
class Engine:
    """The sampler's side: its model, the weights it holds (rank 0) and the snapshots of the last sync."""

    model: Any
    weights: dict
    held: Any = None  # the receiver's WeightSnapshot (rank 0)
    since: Any = None  # the sender's WeightSnapshot (every rank)


def fp8_block(chunks) -> tuple[int, int]:
    """The largest power-of-two block (at most 128) dividing every projection weight of the model."""
    dims = [d for n, s in hf.hf_tensor_shapes(chunks).items() if n.endswith("_proj.weight") for d in s]
    g = math.gcd(*dims)
    b = 1
    while b * 2 <= min(g, 128) and g % (b * 2) == 0:
        b *= 2
    return b, b


def make_engine(chunks) -> Engine:
    """The sampler's model: the policy's architecture (``fnppo_config``), weights to come by sync."""
    core = fnppo.models.unwrap_model(chunks[0])
    model = fnppo.build_gpt(core.fnppo_config)
    family = getattr(core, "fnppo_hf_family", None)
    if family is not None:  # the Hugging Face names the policy streams (e.g. Mixtral's, not Qwen2-MoE's)
        for chunk in model:
            fnppo.models.unwrap_model(chunk).fnppo_hf_family = family
    return Engine(model=model, weights={})


def sync(engine: Engine, chunks, mode: str, step: int, out_dir: Path, layout) -> tuple[Engine, dict]:
    """Stream the policy's weights to the engine, load them into its model; the new engine and the
    sync's metrics (bytes of tensor data on the wire, seconds of stream + apply on rank 0)."""
    fp8 = hf.FP8Blocks(fp8_block(chunks)) if mode.startswith("fp8") else None
    t0 = time.perf_counter()
    weights, held, since = engine.weights, engine.held, engine.since
    if mode in ("full", "fp8"):
        buckets = list(hf.stream_hf_weights(chunks, fp8=fp8))
        weights = {n: t.detach().cpu().clone() for b in buckets for n, t in b}
        sent = sum(t.numel() * t.element_size() for t in weights.values())
    else:
        stream = hf.stream_hf_deltas(chunks, since, step=step, granularity="elements", fp8=fp8)
        buckets = list(stream)
        since = stream.snapshot
        sent = sum(r.nbytes for b in buckets for r in b if isinstance(r, hf.TensorDelta))
        if layout.rank == 0:
            weights, held = hf.apply_hf_deltas(weights, buckets, held)
    seconds = time.perf_counter() - t0
    directory = out_dir / "sampler-weights"
    if layout.rank == 0:
        _write(directory, weights, fnppo.models.unwrap_model(engine.model[0]).fnppo_config.vocab_size)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
    hf.load_hf_weights(engine.model, directory)
    total = sum(t.numel() * t.element_size() for t in weights.values())
    metrics = {"sync/bytes": float(sent), "sync/seconds": seconds, "sync/fraction": sent / total if total else 0.0}
    return dataclasses.replace(engine, weights=weights, held=held, since=since), metrics


def _write(directory: Path, weights: dict, vocab: int) -> None:
    """The engine's weights as a plain safetensors checkpoint (FP8 dequantized, vocabulary padding
    dropped) that the sampler's model loads."""
    from safetensors.torch import save_file

    plain = {}
    for name, t in weights.items():
        if name.endswith("weight_scale_inv"):
            continue
        scale = weights.get(name.removesuffix(".weight") + ".weight_scale_inv")
        value = t if scale is None else hf.dequantize_fp8_blockwise(t, scale, torch.float32)
        plain[name] = value[:vocab] if name.endswith(("embed_tokens.weight", "lm_head.weight")) else value
    directory.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in plain.items()}, str(directory / "model.safetensors"))
