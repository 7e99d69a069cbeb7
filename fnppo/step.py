"""The training step: the pure stages composed inside Megatron's own pipeline schedule.

This is the only module that knows the order of the stages::

    split_batch -> collate_microbatch -> forward_logits -> logprob_and_entropy -> ppo_loss
        -> (Megatron backward) -> finalize_grads -> optimizer

Every stage is a field of :class:`StepFns` and can be replaced by a function with the same
signature (a custom loss, a custom log-prob). State that persists (model chunks, optimizer, step
counter) lives in :class:`TrainState`, which is passed in and returned.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fnppo.batch import Microbatch, Sample, collate_microbatch, pad_microbatch, split_batch, unpack_per_sample
from fnppo.grads import FinalizeNotCalledError, GradStats, finalize_grads
from fnppo.logprob import logprob_and_entropy
from fnppo.loss import PolicyLossConfig, finalize_metrics, loss_normalizer, merge_metrics, ppo_loss
from fnppo.model import forward_logits, unwrap_model
from fnppo.parallel import ParallelLayout, current_layout
from fnppo.typing import check_range, describe, input_error, typechecking_enabled

__all__ = ["StepFns", "StepConfig", "TrainState", "train_step", "compute_logprobs", "forward_only", "shard_for_data_parallel"]


@dataclass(frozen=True)
class StepFns:
    """The swappable stages of a step. Each must keep the signature of the default.

    - ``collate(samples, *, layout, pad_to_multiple_of) -> Microbatch``
    - ``forward(model, microbatch, *, params=None) -> logits``
    - ``logprob(logits, labels, *, tp_group, temperature, with_entropy, vocab_size) -> (logprobs, entropy|None)``
      (``vocab_size``: the model's real vocabulary; logits columns at or beyond it are padding)
    - ``loss(logprobs, old_logprobs, advantages, loss_mask, config, *, entropy, ref_logprobs,
      rollout_logprobs, normalizer, seq_ids) -> (loss, metrics)``
    """

    collate: Callable[..., Microbatch] = collate_microbatch
    forward: Callable[..., torch.Tensor] = forward_logits
    logprob: Callable[..., tuple[torch.Tensor, torch.Tensor | None]] = logprob_and_entropy
    loss: Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]] = ppo_loss


@dataclass(frozen=True)
class StepConfig:
    """How a batch becomes micro-batches and updates.

    Exactly one of ``num_microbatches``, ``microbatch_size`` and ``max_tokens_per_microbatch``
    chooses the split (default: one micro-batch). ``num_minibatches`` optimizer steps are taken per
    epoch (mini-batch ``k`` holds samples ``k, k + num_minibatches, ...`` of this rank's batch, which
    makes the mini-batches the same in every data-parallel layout), ``ppo_epochs`` passes over the
    batch per call. ``pad_to_multiple_of`` defaults to the TP size. ``max_seq_len`` caps the
    length (prompt + response) of every sample; when None, the model's ``max_sequence_length`` is
    the cap. A longer sample is refused (:class:`~fnppo.typing.InputError`), never truncated.
    """

    loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    layout: str = "packed"
    num_microbatches: int | None = None
    microbatch_size: int | None = None
    max_tokens_per_microbatch: int | None = None
    pad_to_multiple_of: int | None = None
    max_seq_len: int | None = None
    temperature: float = 1.0
    num_minibatches: int = 1
    ppo_epochs: int = 1
    fns: StepFns = field(default_factory=StepFns)

    def __post_init__(self) -> None:
        fn = "StepConfig"
        if self.layout not in ("packed", "padded"):
            raise input_error(fn, "layout", "'packed' or 'padded'", repr(self.layout))
        given = [n for n in ("num_microbatches", "microbatch_size", "max_tokens_per_microbatch") if getattr(self, n) is not None]
        if len(given) > 1:
            raise input_error(fn, "num_microbatches/microbatch_size/max_tokens_per_microbatch", "at most one of them", f"{given}")
        for n in ("num_microbatches", "microbatch_size", "max_tokens_per_microbatch", "num_minibatches", "ppo_epochs", "pad_to_multiple_of", "max_seq_len"):
            v = getattr(self, n)
            if v is not None and (not isinstance(v, int) or v < 1):
                raise input_error(fn, n, "an int >= 1", repr(v))
        if not (self.temperature > 0 and math.isfinite(self.temperature)):
            raise input_error(fn, "temperature", "a finite float > 0", repr(self.temperature))


@dataclass(frozen=True)
class TrainState:
    """What persists between steps: DDP-wrapped model chunks, Megatron optimizer, step counter."""

    model: tuple[nn.Module, ...]
    optimizer: Any
    step: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.model, nn.Module):
            object.__setattr__(self, "model", (self.model,))
        else:
            object.__setattr__(self, "model", tuple(self.model))


def shard_for_data_parallel(samples: Sequence[Any], layout: ParallelLayout | None = None) -> list[Any]:
    """This data-parallel rank's contiguous share of a global list of samples.

    ``len(samples)`` must be divisible by the DP size; TP and PP ranks of one DP rank get the same
    share (which is what :func:`train_step` requires).
    """
    layout = layout or current_layout()
    if len(samples) % layout.dp:
        raise input_error("shard_for_data_parallel", "samples", f"a length divisible by dp={layout.dp}", str(len(samples)))
    per = len(samples) // layout.dp
    return list(samples[layout.dp_rank * per : (layout.dp_rank + 1) * per])


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------
def _device_of(chunks: Sequence[nn.Module]) -> torch.device:
    return next(unwrap_model(chunks[0]).parameters()).device


def _split(samples: Sequence[Sample], config: StepConfig, layout: ParallelLayout, max_seq_len: int | None = None):
    kw: dict[str, Any] = {}
    if config.max_tokens_per_microbatch is not None:
        kw["max_tokens_per_microbatch"] = config.max_tokens_per_microbatch
    elif config.microbatch_size is not None:
        kw["microbatch_size"] = config.microbatch_size
    else:
        kw["num_microbatches"] = config.num_microbatches or 1
    return split_batch(
        list(samples),
        dp_group=layout.dp_group if layout.dp > 1 else None,
        max_seq_len=max_seq_len if max_seq_len is not None else config.max_seq_len,
        pad_to_multiple_of=_pad_multiple(config, layout),
        layout=config.layout,
        **kw,
    )


def _pad_multiple(config: StepConfig, layout: ParallelLayout) -> int:
    return config.pad_to_multiple_of or layout.tp


def _model_limits(chunks: Sequence[nn.Module]) -> tuple[int | None, int | None]:
    """The model's (padded) vocabulary size and ``max_sequence_length`` (None where unknown)."""
    core = unwrap_model(chunks[0])
    return getattr(core, "vocab_size", None), getattr(core, "max_sequence_length", None)


def _real_vocab(chunks: Sequence[nn.Module]) -> int | None:
    """The model's real vocabulary (``ModelConfig.vocab_size``), without ``make_vocab_size_divisible_by`` padding."""
    core = unwrap_model(chunks[0])
    cfg = getattr(core, "fnppo_config", None)  # set by fnppo.build_gpt
    return cfg.vocab_size if cfg is not None else getattr(core, "vocab_size", None)


def _check_batch(fn: str, samples: Sequence[Sample], config: StepConfig, chunks: Sequence[nn.Module]) -> int | None:
    """Refuse samples the model cannot take; returns the sequence-length limit in force.

    The limit is ``config.max_seq_len``, else the model's ``max_sequence_length``. Token ids must lie
    in ``[0, vocab_size)`` of the model (checked while call-time checking is on: one host sync).
    Reference and rollout log-probs must be given for every sample or for none.
    """
    _, model_max = _model_limits(chunks)
    vocab = _real_vocab(chunks)
    limit = config.max_seq_len if config.max_seq_len is not None else model_max
    source = "StepConfig.max_seq_len" if config.max_seq_len is not None else "the model's max_sequence_length"
    for i, s in enumerate(samples):
        if not isinstance(s, Sample):
            raise input_error(fn, f"batch[{i}]", "a fnppo.Sample", type(s).__name__)
        if limit is not None and len(s) > limit:
            raise input_error(
                fn, f"batch[{i}]", f"at most {limit} tokens ({source})",
                f"{len(s)} tokens (prompt {s.prompt_len} + response {s.response_len})",
            )
    for name in ("ref_logprobs", "rollout_logprobs"):
        # all samples or none: micro-batches that separate them would each look fine on their own
        have = [getattr(s, name) is not None for s in samples]
        if any(have) and not all(have):
            i = have.index(False)
            raise input_error(fn, f"batch[{i}].{name}", f"a tensor (batch[{have.index(True)}] has {name}; all samples or none)", "None")
    if vocab is not None and typechecking_enabled():
        ids = torch.cat([t for s in samples for t in (s.prompt_ids, s.response_ids)])
        if ids.numel() and bool(((ids < 0) | (ids >= vocab)).any()):
            for i, s in enumerate(samples):
                for name in ("prompt_ids", "response_ids"):
                    check_range(fn, f"batch[{i}].{name}", getattr(s, name), 0, vocab)
    return limit


def _check_logits(fn: str, logits: torch.Tensor, vocab: int | None, layout: ParallelLayout) -> None:
    """The forward must return this rank's vocab shard: ``[..., vocab_size / tp]``."""
    if vocab is None or not isinstance(logits, torch.Tensor) or logits.dim() < 1:
        return
    shard = vocab // layout.tp
    if logits.shape[-1] != shard:
        hint = " (logits already gathered over tensor parallelism; return this rank's shard)" if logits.shape[-1] == vocab and layout.tp > 1 else ""
        raise input_error(
            fn, "logits", f"a last dimension of vocab_size / tp = {vocab} / {layout.tp} = {shard} (this rank's vocab shard)",
            f"{describe(logits)}{hint}",
        )


def _collate_all(samples: Sequence[Sample], config: StepConfig, layout: ParallelLayout, device: torch.device, max_seq_len: int | None = None) -> tuple[Any, list[Microbatch]]:
    plan = _split(samples, config, layout, max_seq_len)
    mbs = [
        _to_device(config.fns.collate(group, layout=config.layout, pad_to_multiple_of=_pad_multiple(config, layout), sample_index=indices), device)
        for indices, group in zip(plan.microbatches, plan.apply(list(samples)))
    ]
    if layout.vpp:
        # The interleaved schedule exchanges per-micro-batch shapes with batched p2p ops, which
        # gloo mismatches; one shape for all micro-batches of a step avoids shape exchanges.
        longest = max(int(mb.input_ids.shape[1]) for mb in mbs)
        mbs = [pad_microbatch(mb, longest) for mb in mbs]
    return plan, mbs


def _to_device(mb: Microbatch, device: torch.device) -> Microbatch:
    import optree

    if device.type == "cpu":
        return mb
    return optree.tree_map(lambda x: x.to(device, non_blocking=True) if isinstance(x, torch.Tensor) else x, mb, none_is_leaf=False, namespace="fnppo")


def _per_chunk(params: Any, n: int) -> list[Mapping[str, torch.Tensor] | None]:
    if params is None:
        return [None] * n
    if isinstance(params, Mapping):
        if n != 1:
            raise input_error("compute_logprobs", "params", f"a list of {n} dicts (one per model chunk)", "one dict")
        return [params]
    params = list(params)
    if len(params) != n:
        raise input_error("compute_logprobs", "params", f"{n} dicts (one per model chunk)", f"{len(params)}")
    return params


def _install_finalize(chunks: Sequence[nn.Module]) -> tuple[Any, dict[str, GradStats]]:
    """Point Megatron's config at fnppo's finalizer; the returned record proves it ran."""
    config = unwrap_model(chunks[0]).config
    record: dict[str, GradStats] = {}

    def finalize(model: list[nn.Module], num_tokens: torch.Tensor | None = None, *args: Any, **kwargs: Any) -> None:
        record["stats"] = finalize_grads(model, num_tokens=num_tokens if config.calculate_per_token_loss else None)

    config.finalize_model_grads_func = finalize
    no_sync = [c.no_sync for c in chunks]
    config.no_sync_func = no_sync[0] if len(no_sync) == 1 else no_sync
    config.grad_sync_func = None
    config.param_sync_func = None
    return config, record


def _reduce_metrics(store: Sequence[Mapping[str, torch.Tensor]], layout: ParallelLayout, device: torch.device) -> dict[str, torch.Tensor]:
    """Sum (weighted_sum, weight) metrics over micro-batches, DP ranks, then share across stages."""
    merged: dict[str, torch.Tensor] = {}
    if layout.is_last_stage:
        merged = merge_metrics([s["metrics"] for s in store]) if store else {}
        if layout.dp > 1 and merged:
            keys = sorted(merged)
            flat = torch.stack([merged[k].to(device=device, dtype=torch.float64) for k in keys])
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=layout.dp_group)
            merged = {k: flat[i].float() for i, k in enumerate(keys)}
        merged = {k: v.detach().cpu() for k, v in merged.items()}
    if layout.pp > 1:
        gathered: list[Any] = [None] * layout.pp
        dist.all_gather_object(gathered, merged, group=layout.pp_group)
        merged = gathered[-1]
    return merged


def _global_normalizer(mbs: Sequence[Microbatch], loss_cfg: PolicyLossConfig, layout: ParallelLayout, device: torch.device) -> torch.Tensor:
    local = torch.zeros((), dtype=torch.float64, device=device)
    for mb in mbs:
        local = local + loss_normalizer(mb.loss_mask, loss_cfg, seq_ids=mb.seq_ids).to(device=device, dtype=torch.float64)
    total = local.reshape(1).clone()
    if layout.dp > 1:
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=layout.dp_group)
    return total[0].float()


def _forward_step_fn(
    config: StepConfig,
    layout: ParallelLayout,
    *,
    normalizer: torch.Tensor | None,
    loss_scale: float,
    with_entropy: bool,
    vocab_size: int | None = None,
    real_vocab: int | None = None,
) -> Callable[[Iterator[Microbatch], nn.Module], Any]:
    fns = config.fns
    loss_cfg = config.loss

    def forward_step(data_iterator: Iterator[Microbatch], model: nn.Module):
        mb = next(data_iterator)
        out = fns.forward(model, mb)

        def loss_func(logits: torch.Tensor):
            _check_logits("train_step", logits, vocab_size, layout)
            lp, ent = fns.logprob(logits, mb.labels, tp_group=layout.tp_group if layout.tp > 1 else None, temperature=config.temperature, with_entropy=with_entropy, vocab_size=real_vocab)
            loss, metrics = fns.loss(
                lp, mb.old_logprobs, mb.advantages, mb.loss_mask, loss_cfg,
                entropy=ent, ref_logprobs=mb.ref_logprobs, rollout_logprobs=mb.rollout_logprobs,
                normalizer=normalizer, seq_ids=mb.seq_ids,
            )
            return loss * loss_scale, {"metrics": metrics}

        return out, loss_func

    return forward_step


def _run_schedule(chunks: Sequence[nn.Module], mbs: Sequence[Microbatch], forward_step: Callable, *, forward_only: bool) -> list[Any]:
    from megatron.core.pipeline_parallel import get_forward_backward_func

    fb = get_forward_backward_func()
    seq_len = max(int(mb.input_ids.shape[-1]) for mb in mbs)
    data = [iter(mbs) for _ in chunks]
    return fb(
        forward_step_func=forward_step,
        data_iterator=data if len(chunks) > 1 else data[0],
        model=list(chunks),
        num_microbatches=len(mbs),
        seq_length=seq_len,
        micro_batch_size=int(mbs[0].input_ids.shape[0]),
        forward_only=forward_only,
    )


# ---------------------------------------------------------------------------------------------
# public
# ---------------------------------------------------------------------------------------------
def train_step(state: TrainState, batch: Sequence[Sample], config: StepConfig) -> tuple[TrainState, dict[str, float]]:
    """One PPO/GRPO update (or ``ppo_epochs`` x ``num_minibatches`` updates) on this rank's samples.

    ``batch`` is this data-parallel rank's list of :class:`~fnppo.batch.Sample` (identical on the TP
    and PP ranks of one DP rank; see :func:`shard_for_data_parallel`). For each mini-batch:

    1. split into micro-batches (same count on every DP rank) and collate them;
    2. the loss normalizer (tokens or sequences, by ``loss_agg_mode``) is summed over all
       micro-batches and DP ranks *before* the schedule, so the sum of micro-batch losses is the
       full-batch loss whatever the split;
    3. Megatron's ``get_forward_backward_func`` runs ``forward -> logprob -> loss`` per micro-batch;
       each micro-batch loss is multiplied by ``num_microbatches * dp`` to cancel the schedule's mean
       over micro-batches and DDP's mean over DP ranks;
    4. :func:`~fnppo.grads.finalize_grads` reduces the gradients (installed as Megatron's
       ``finalize_model_grads_func``; if the schedule does not call it, :class:`FinalizeNotCalledError`);
    5. if the loss and grad norm are finite, the optimizer steps (Megatron clips to ``clip_grad``);
       otherwise the step is skipped, parameters and optimizer state stay untouched, and
       ``metrics["skipped"]`` counts it.

    Returns the new state (same objects, ``step`` advanced by the number of optimizer updates) and
    metrics reduced exactly over micro-batches and DP ranks, identical on every rank.

    Refused before anything runs (:class:`~fnppo.typing.InputError`, nothing changed): an empty
    batch, a batch length not divisible by ``num_minibatches``, a sample longer than
    ``config.max_seq_len`` (default: the model's ``max_sequence_length``), token ids outside the
    model's vocabulary (while call-time checking is on), ``ref_logprobs`` / ``rollout_logprobs``
    given for some samples only. Inside the schedule: logits from
    ``config.fns.forward`` whose last dimension is not this rank's vocab shard (e.g. logits already
    gathered over tensor parallelism). ``docs/errors.md`` lists every error.
    """
    chunks = state.model
    optimizer = state.optimizer
    layout = current_layout()
    device = _device_of(chunks)
    samples = list(batch)
    if not samples:
        raise input_error("train_step", "batch", "a non-empty list of samples", "an empty list")
    if len(samples) % config.num_minibatches:
        raise input_error("train_step", "batch", f"a length divisible by num_minibatches={config.num_minibatches}", str(len(samples)))
    max_seq_len = _check_batch("train_step", samples, config, chunks)
    vocab_size, _ = _model_limits(chunks)
    step = state.step
    totals: dict[str, torch.Tensor] = {}
    grad_norms: list[float] = []
    skipped = 0
    updates = 0
    for _epoch in range(config.ppo_epochs):
        for k in range(config.num_minibatches):
            # Strided mini-batches: with contiguous DP shards (shard_for_data_parallel) of a length
            # divisible by num_minibatches, mini-batch k holds the same samples in every layout.
            minibatch = samples[k :: config.num_minibatches]
            _plan, mbs = _collate_all(minibatch, config, layout, device, max_seq_len)
            normalizer = _global_normalizer(mbs, config.loss, layout, device)
            for c in chunks:
                c.zero_grad_buffer()
            optimizer.zero_grad()
            mconfig, record = _install_finalize(chunks)
            fwd = _forward_step_fn(
                config, layout, normalizer=normalizer, loss_scale=float(len(mbs) * layout.dp),
                with_entropy=True,  # always reported as a metric, whatever its coefficient
                vocab_size=vocab_size, real_vocab=_real_vocab(chunks),
            )
            try:
                store = _run_schedule(chunks, mbs, fwd, forward_only=False)
            finally:
                mconfig.finalize_model_grads_func = None
            if "stats" not in record:
                raise FinalizeNotCalledError(
                    "train_step: Megatron's schedule returned without calling finalize_model_grads; "
                    "gradients were not reduced across data-parallel ranks"
                )
            stats = record["stats"]
            metrics = _reduce_metrics(store, layout, device)
            loss_sum = metrics.get("loss", torch.zeros(2))
            finite = stats.finite and bool(torch.isfinite(loss_sum).all())
            if finite:
                ok, _norm, _zeros = optimizer.step()
                finite = bool(ok)
            if finite:
                updates += 1
            else:
                skipped += 1
            grad_norms.append(float(stats.grad_norm))
            for key, v in metrics.items():
                totals[key] = totals[key] + v if key in totals else v
            step += 1
    out = finalize_metrics(totals)
    out["grad_norm"] = sum(grad_norms) / len(grad_norms)
    out["skipped"] = float(skipped)
    out["updates"] = float(updates)
    out["step"] = float(step)
    lr = [g["lr"] for g in optimizer.param_groups] if hasattr(optimizer, "param_groups") else []
    if lr:
        out["lr"] = float(lr[0])
    return dataclasses.replace(state, step=step), out


def forward_only(
    model_chunks: Sequence[nn.Module],
    microbatches: Sequence[Microbatch],
    output_fn: Callable[[torch.Tensor, Microbatch], Any],
    *,
    params: Mapping[str, torch.Tensor] | Sequence[Mapping[str, torch.Tensor]] | None = None,
    forward: Callable[..., torch.Tensor] = forward_logits,
) -> list[Any] | None:
    """Run Megatron's schedule forward-only (eval mode, no autograd) over collated micro-batches.

    ``output_fn(logits, microbatch)`` is applied on the last pipeline stage to each micro-batch's
    vocab-parallel logits; the list of its results (in micro-batch order) is returned there, ``None``
    on other stages. ``params`` as in :func:`compute_logprobs`. Use it for sampling and evaluation.
    """
    chunks = list(model_chunks)
    if not microbatches:
        raise input_error("forward_only", "microbatches", "a non-empty sequence", "an empty sequence")
    by_chunk = {id(c): p for c, p in zip(chunks, _per_chunk(params, len(chunks)))}

    def forward_step(data_iterator: Iterator[Microbatch], model: nn.Module):
        mb = next(data_iterator)
        out = forward(model, mb, params=by_chunk.get(id(model)))

        def loss_func(logits: torch.Tensor):
            return logits.new_zeros((), dtype=torch.float32), {"out": output_fn(logits, mb)}

        return out, loss_func

    modes = [c.training for c in chunks]
    for c in chunks:
        c.eval()
    try:
        with torch.no_grad():
            store = _run_schedule(chunks, microbatches, forward_step, forward_only=True)
    finally:
        for c, m in zip(chunks, modes):
            c.train(m)
    if not current_layout().is_last_stage:
        return None
    return [s["out"] for s in store]


def compute_logprobs(
    model_chunks: Sequence[nn.Module],
    batch: Sequence[Sample],
    *,
    params: Mapping[str, torch.Tensor] | Sequence[Mapping[str, torch.Tensor]] | None = None,
    with_entropy: bool = False,
    config: StepConfig | None = None,
) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
    """Forward-only log-probs (and entropy) of every sample's response tokens, in sample order.

    Runs Megatron's schedule with ``forward_only=True`` in eval mode (no dropout) and without
    autograd. Returns, on every rank, one fp32 CPU tensor of length ``len(response_ids)`` per sample
    of ``batch`` (this DP rank's samples) in their original order, and the entropies likewise (or
    ``None``). ``params`` (one dict per model chunk, names of the unwrapped ``GPTModel``) evaluates
    another parameter set with the same modules, e.g. the frozen reference policy
    (:func:`fnppo.model.snapshot_params`). ``config`` supplies the split, layout and temperature
    (its loss settings are unused).
    """
    config = config or StepConfig()
    chunks = list(model_chunks)
    layout = current_layout()
    device = _device_of(chunks)
    samples = list(batch)
    if not samples:
        raise input_error("compute_logprobs", "batch", "a non-empty list of samples", "an empty list")
    max_seq_len = _check_batch("compute_logprobs", samples, config, chunks)
    vocab_size, _ = _model_limits(chunks)
    real_vocab = _real_vocab(chunks)
    plan, mbs = _collate_all(samples, config, layout, device, max_seq_len)
    tp_group = layout.tp_group if layout.tp > 1 else None

    def per_token(logits: torch.Tensor, mb: Microbatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        _check_logits("compute_logprobs", logits, vocab_size, layout)
        lp, ent = config.fns.logprob(logits, mb.labels, tp_group=tp_group, temperature=config.temperature, with_entropy=with_entropy, vocab_size=real_vocab)
        return lp, ent

    store = forward_only(chunks, mbs, per_token, params=params, forward=config.fns.forward)
    lengths = [int(s.response_ids.numel()) for s in samples]
    total = sum(lengths)
    n_out = 2 if with_entropy else 1
    flat = torch.zeros(n_out, total, dtype=torch.float32)
    if layout.is_last_stage:
        per_sample_lp: list[torch.Tensor | None] = [None] * len(samples)
        per_sample_ent: list[torch.Tensor | None] = [None] * len(samples)
        for indices, mb, out in zip(plan.microbatches, mbs, store):
            lps = unpack_per_sample(out[0], mb)
            ents = unpack_per_sample(out[1], mb) if with_entropy else [None] * len(lps)
            for idx, lp, ent in zip(indices, lps, ents):
                per_sample_lp[idx] = lp.float().cpu()
                per_sample_ent[idx] = None if ent is None else ent.float().cpu()
        flat[0] = torch.cat([t for t in per_sample_lp]) if total else flat[0]
        if with_entropy and total:
            flat[1] = torch.cat([t for t in per_sample_ent])
    if layout.pp > 1:
        buf = flat.to(device)
        src = dist.get_global_rank(layout.pp_group, layout.pp - 1)
        dist.broadcast(buf, src=src, group=layout.pp_group)
        flat = buf.cpu()
    lp_out = list(torch.split(flat[0], lengths))
    ent_out = list(torch.split(flat[1], lengths)) if with_entropy else None
    return lp_out, ent_out
