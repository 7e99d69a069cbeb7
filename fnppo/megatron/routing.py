"""Routing replay for Mixture-of-Experts policies: record the experts the routers choose, force them later.

RL on an MoE policy drifts when training routes a token to other experts than the rollout did: the
log-probability ratio then compares two different sub-networks. Routing replay records the top-k
expert indices of every token in every MoE layer where the data is produced (the inference engine,
or :func:`fnppo.compute_logprobs` with ``return_routing=True``) and forces the same experts in
later forwards (``compute_logprobs`` and ``train_step`` on samples that carry
``Sample.routed_experts``). The router still computes its scores: the gate weights of the forced
experts come from the current router (so the router keeps its gradient) and the auxiliary
losses see the router's own choice; only the choice of experts is replaced.
References: Rollout Routing Replay (R3), Ma et al., arXiv:2510.11370; "routing replay" in GSPO,
Zheng et al., arXiv:2507.18071.

**Layout of the routes.** ``Sample.routed_experts[t, j, :]`` holds the ``topk`` expert indices of
token ``t`` of ``prompt ++ response`` in the ``j``-th MoE layer, MoE layers in global order over all
pipeline (and virtual pipeline) stages, dense layers skipped (:func:`moe_layer_indices`). The
collate stage places row ``t`` at the position that holds token ``t`` (``Microbatch.routed_experts``,
``[batch, seq, layers, topk]``), so the routes follow the tokens through packing, padding, the
split into micro-batches and the context-parallel shard (:func:`fnppo.core.batching.context_parallel.shard_microbatch`).
Positions without a route (padding, the missing last token of an engine's ``len - 1`` rows, a
sample's rows of ``-1``) hold ``-1`` (:func:`fnppo.core.batching.collate.routing_fill`) and are routed by the
router itself (its own top-k of its current scores). No other token's output depends on the route
of padding or of the last token (tokens pass the experts independently, without token dropping,
and attention is causal per sample), but the experts' matrix products see their rows: letting the
router choose them as it did when recording makes a replay of recorded routes reproduce the
recorded log-probs bit for bit (a ``-1`` row elsewhere changes what later tokens see unless the
router chooses as when recording). A vision-language sample carries the rows of the sequence the
model runs, each image ``tokens_per_image`` positions (what an inference engine records, and what
:func:`fnppo.compute_logprobs` returns under :class:`fnppo.megatron.vlm_collate.VLMCollate`), or the rows of its
unexpanded tokens with ``-1`` at the placeholders; the collate stage expands them with the tokens
(:func:`fnppo.megatron.vlm_collate.expand_image_routes`).

**How the experts are forced.** megatron-core 0.16.1 gives every ``TopKRouter`` built with
``moe_enable_routing_replay`` a ``RouterReplay`` slot (``transformer/moe/router_replay.py``) with
three actions: ``RECORD`` (keep the top-k indices of the last forward), ``REPLAY_FORWARD`` (use the
target indices: ``scores.gather(1, target)`` instead of ``topk``) and ``REPLAY_BACKWARD`` (pop
targets from a FIFO, for activation recomputation inside the backward). fnppo builds every MoE
model with it and replaces each router's slot by a :func:`replay_slot` (the same slot, whose
replay lets the router choose for rows marked ``-1``), kept off Megatron's global instance list:
:func:`routed` sets the slots of the routers of *one model chunk* from *one micro-batch's*
routes, around that chunk's forward, and nothing else reaches them. Each router reads the rows of
the tokens it sees, in its own order (``[seq, batch]`` flattened, seq-major; under sequence
parallelism the tensor-parallel rank's slice of the sequence). When a router's forward is
recomputed in the backward (full recomputation of its layer, or selective recomputation with
``"moe"`` in ``recompute_modules``), its slot is left on ``REPLAY_BACKWARD`` after a training
forward: the recomputed forward pops the same micro-batch's target from the slot's FIFO
(micro-batches are recomputed in forward order per chunk); otherwise no target is kept past its
forward. :func:`clear_routing` empties every slot when the schedule ends.

**Checks** (where the routes enter, :func:`fnppo.core.batching.checks.check_routed_experts`): every sample or
none carries routes, of the model's MoE layers and top-k, in a dtype that holds ``num_experts - 1``
(uint8 holds only 256 experts), indices in ``[0, num_experts)`` and distinct within a row (a
repeated index would route the token to fewer than top-k experts and break the dispatcher's
token counts), or ``-1`` in every entry of a row; one row per collated token (or one fewer),
checked by :func:`fnppo.core.batching.collate.collate_microbatch` after any expansion. Recorded routes are int16
(int32 above 32,768 experts): :func:`record_dtype`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction
from megatron.core.transformer.transformer_block import TransformerBlock
from torch import nn

from fnppo.core.batching.context_parallel import gather_tokens
from fnppo.core.batching.sample import Microbatch
from fnppo.core.errors import input_error
from fnppo.core.typing import Tensor
from fnppo.megatron.unwrap import unwrap_model

__all__ = [
    "moe_layer_indices",
    "record_dtype",
    "replay_target",
    "routed",
    "RoutingRecorder",
    "clear_routing",
    "routing_spec",
]


def moe_layer_indices(config: Any) -> list[int]:
    """Global 0-based indices of a Megatron config's MoE layers, in order (``moe_layer_freq``: an
    int ``k`` puts MoE layers at ``0, k, 2k, ...``; a list has one 0/1 per layer)."""
    freq = config.moe_layer_freq
    pattern = list(freq) if isinstance(freq, (list, tuple)) else [int(i % freq == 0) for i in range(config.num_layers)]
    return [i for i, v in enumerate(pattern) if v]


def routing_spec(model_chunks: Sequence[nn.Module]) -> tuple[int, int, int] | None:
    """``(MoE layers, top-k, num_experts)`` of the model, or None for a dense model."""
    cfg = unwrap_model(model_chunks[0]).config
    if not getattr(cfg, "num_moe_experts", None):
        return None
    return len(moe_layer_indices(cfg)), int(cfg.moe_router_topk), int(cfg.num_moe_experts)


def record_dtype(num_experts: int) -> torch.dtype:
    """The dtype of recorded routes: int16 up to 32,768 experts, else int32."""
    return torch.int16 if num_experts <= 2**15 else torch.int32


class PartialRouterReplay(RouterReplay):
    """``RouterReplay`` with rows left to the router: target rows ``-1`` take its own top-k."""

    def __init__(self) -> None:  # RouterReplay.__init__ would append to the global list
        self.target_topk_idx = None
        self.recorded_topk_idx = None
        self.router_replay_action = None
        self.replay_backward_list = []

    def get_replay_topk(  # noqa: ANN001
        self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None
    ):
        action = self.router_replay_action
        if action not in (RouterReplayAction.REPLAY_FORWARD, RouterReplayAction.REPLAY_BACKWARD):
            return super().get_replay_topk(scores, topk, num_groups, group_topk, default_compute_topk)
        target = (
            self.target_topk_idx if action is RouterReplayAction.REPLAY_FORWARD else self.replay_backward_list.pop(0)
        )
        target = target.to(scores.device)
        # the router's own choice where there is no route (no host sync: computed for every row)
        _, own = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        target = torch.where(target[:, :1] < 0, own, target)
        return scores.gather(1, target), target


def replay_slot() -> PartialRouterReplay:
    """A new router replay slot: Megatron's ``RouterReplay`` whose replay keeps the router's own
    top-k choice for target rows marked ``-1`` (positions without a route), not on Megatron's
    global instance list (the slot is reached through its router only)."""
    return PartialRouterReplay()


def _slots(model: nn.Module) -> list[tuple[nn.Module, int]]:
    """``(router, MoE layer index)`` of every router of one model chunk, in module order."""
    core = unwrap_model(model)
    index = {layer: j for j, layer in enumerate(moe_layer_indices(core.config))}
    out = []
    for m in core.modules():
        if isinstance(m, TopKRouter):
            if m.router_replay is None:  # built without moe_enable_routing_replay (not by fnppo.build_gpt)
                raise input_error(
                    "fnppo.megatron.routing.routed",
                    "model",
                    "MoE routers built with moe_enable_routing_replay=True (fnppo.build_gpt does)",
                    "a router without a replay slot",
                )
            out.append((m, index[m.layer_number - 1]))
    return out


def _sequence_shard(router: nn.Module) -> tuple[int, int, Any]:
    """``(size, rank, group)`` of the sequence-parallel split of the router's input (1, 0, None without)."""
    cfg = router.config
    if not cfg.sequence_parallel or cfg.tensor_model_parallel_size == 1:
        return 1, 0, None
    group = router.tp_group
    return dist.get_world_size(group), dist.get_rank(group), group


def replay_target(routes: Tensor, router: nn.Module, layer: int) -> Tensor:
    """The experts to force on ``router`` (MoE layer ``layer``) from a micro-batch's ``routed_experts``.

    ``routes`` ``[batch, seq, layers, topk]`` (this CP rank's tokens) becomes the router's token order
    ``[seq, batch]`` flattened (``routes[:, :, layer].transpose(0, 1)``), cut to this rank's slice of
    the sequence under sequence parallelism (contiguous chunks, Megatron's
    ``scatter_to_sequence_parallel_region``); int64 ``[tokens, topk]``.
    """
    t = routes[:, :, layer].transpose(0, 1)
    size, rank, _ = _sequence_shard(router)
    if size > 1:
        t = t.chunk(size, dim=0)[rank]
    return t.reshape(-1, t.shape[-1]).to(torch.int64)


def clear_routing(model_chunks: Sequence[nn.Module]) -> None:
    """Empty every router's replay slot (no action, no targets, no record)."""
    for chunk in model_chunks:
        for router, _ in _slots(chunk):
            router.router_replay.clear_router_replay_action()
            router.router_replay.clear_indices()


class RoutingRecorder:
    """What the routers chose in a forward-only run, per micro-batch, and its assembly per sample.

    :func:`routed` adds each chunk's routes of a micro-batch (gathered over sequence and context
    parallelism, ``[batch, seq, topk]`` per MoE layer, in the collated positions);
    :meth:`per_sample` cuts every sample's rows out, puts the samples back in batch order and
    gathers the layers of the other pipeline stages.
    """

    def __init__(self, num_experts: int) -> None:
        self.dtype = record_dtype(num_experts)
        self.by_mb: dict[int, dict[int, Tensor]] = {}

    def add(self, mb: Microbatch, layer: int, routes: Tensor) -> None:
        self.by_mb.setdefault(id(mb), {})[layer] = routes.to(device="cpu", dtype=self.dtype)

    def per_sample(self, mbs: Sequence[Microbatch], plan: Any, num_layers: int, pp_group: Any) -> list[Tensor]:
        """One ``[len(sample), num_layers, topk]`` tensor per sample, in batch order, on every rank."""
        groups = []
        for mb in mbs:
            layers = self.by_mb.get(id(mb), {})
            keys = sorted(layers)
            stacked = torch.stack([layers[k] for k in keys], dim=2) if keys else None  # [batch, seq, L_stage, k]
            rows = []
            for i, ((start, seg), p, length) in enumerate(
                zip(mb.token_spans, mb.prompt_lens, mb.seq_lens, strict=True)
            ):
                if stacked is None:
                    rows.append(None)
                    continue
                row = stacked[0 if mb.is_packed else i]  # a shared prefix's rows, then the sample's segment
                rows.append(torch.cat([row[start : start + p - 1], row[seg : seg + length - p + 1]]))
            groups.append([(keys, r) for r in rows])
        local = plan.restore(groups)
        if pp_group is not None and dist.get_world_size(pp_group) > 1:
            everyone: list[Any] = [None] * dist.get_world_size(pp_group)
            dist.all_gather_object(everyone, local, group=pp_group)
        else:
            everyone = [local]
        out = []
        for i in range(len(local)):
            parts = sorted(
                (k, j, r) for stage in everyone for (keys, r) in [stage[i]] if r is not None for j, k in enumerate(keys)
            )
            if [k for k, _, _ in parts] != list(range(num_layers)):  # cannot happen: every MoE layer lives on one stage
                raise AssertionError(
                    f"fnppo.megatron.routing: recorded MoE layers {[k for k, _, _ in parts]}, "
                    f"expected 0..{num_layers - 1}"
                )
            out.append(torch.stack([r[:, j] for _, j, r in parts], dim=1))
        return out


def _gather_record(router: nn.Module, indices: Tensor, mb: Microbatch) -> Tensor:
    """A router's recorded ``[tokens, topk]`` as ``[batch, seq, topk]`` of the whole (CP-unsharded) micro-batch."""
    batch = int(mb.input_ids.shape[0])
    t = indices.reshape(-1, batch, indices.shape[-1])  # [seq shard, batch, k]
    size, _, group = _sequence_shard(router)
    if size > 1:
        parts = [torch.empty_like(t) for _ in range(size)]
        dist.all_gather(parts, t.contiguous(), group=group)
        t = torch.cat(parts, dim=0)
    t = t.transpose(0, 1)  # [batch, seq (this CP rank's tokens), k]
    cp_group = router.cp_group
    if router.config.context_parallel_size > 1:
        t = gather_tokens(t, mb.cu_seqlens, cp_group, dim=1)
    return t


def _recomputes(router: nn.Module, first_layer: int) -> bool:
    """Whether the router's forward runs again in the backward (Megatron's activation recomputation).

    ``recompute_granularity="full"``: every layer with ``recompute_method="uniform"``, the first
    ``recompute_num_layers`` layers of each model chunk with ``"block"`` (``first_layer``: the
    chunk's first global layer number); ``"selective"``: only when ``recompute_modules`` holds
    ``"moe"`` (the MoE layer, router included, is checkpointed; ``"mlp"``, ``"layernorm"``,
    ``"core_attn"`` or ``"moe_act"`` leave the router's forward alone). A router that is not
    recomputed keeps no target for the backward: Megatron's replay FIFO would otherwise grow by
    one target per micro-batch.
    """
    cfg = router.config
    if cfg.recompute_granularity == "selective":
        return "moe" in (cfg.recompute_modules or ())
    if cfg.recompute_granularity == "full":
        if cfg.recompute_method == "block":
            return router.layer_number - first_layer < (cfg.recompute_num_layers or 0)
        return True
    return False


def _first_layers(model: nn.Module) -> dict[int, int]:
    """``id(router) -> `` the global (1-based) number of the first layer of the transformer block
    that holds it, in one model chunk (a vision-language model's language decoder included)."""
    out: dict[int, int] = {}
    for block in unwrap_model(model).modules():
        if isinstance(block, TransformerBlock):
            first = min((layer.layer_number for layer in block.layers), default=1)
            out.update((id(m), first) for m in block.modules() if isinstance(m, TopKRouter))
    return out


@contextlib.contextmanager
def routed(model: nn.Module, mb: Microbatch, recorder: RoutingRecorder | None = None) -> Iterator[None]:
    """Around one forward of one model chunk on one micro-batch: force ``mb.routed_experts``, or record.

    * ``mb.routed_experts`` given: every router of the chunk gets its target (:func:`replay_target`)
      and ``REPLAY_FORWARD``; after the forward, ``REPLAY_BACKWARD`` while autograd is on and the
      model recomputes activations (a recomputation in the backward replays the same targets from
      the slot's FIFO, which is kept only then), else the slots are emptied.
    * ``recorder`` given: ``RECORD``; after the forward each router's top-k indices go to the
      recorder (a collective over the sequence- and context-parallel groups).
    * neither, or a dense chunk: nothing.

    Raises:
        InputError: both given (``forward_only``'s ``recorder`` with micro-batches that carry
            routed experts: the record would be the forced routes).
    """
    replay = mb.routed_experts is not None
    if not replay and recorder is None:
        yield
        return
    if replay and recorder is not None:
        raise input_error(
            "forward_only",
            "recorder",
            "None for micro-batches that carry routed_experts (those are replayed, not recorded)",
            "a RoutingRecorder",
        )
    slots = _slots(model)
    recomputed: dict[int, bool] = {}  # id(router) -> whether its forward runs again in the backward
    if replay:
        first = _first_layers(model) if any(r.config.recompute_method == "block" for r, _ in slots) else {}
        recomputed = {id(r): _recomputes(r, first.get(id(r), 1)) for r, _ in slots}
    for router, layer in slots:
        slot = router.router_replay
        if replay:
            slot.set_target_indices(replay_target(mb.routed_experts, router, layer))
            if not recomputed[id(router)]:  # the FIFO serves recomputation only: keep no targets for it
                slot.replay_backward_list.clear()
            slot.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
        else:
            slot.clear_indices()
            slot.set_router_replay_action(RouterReplayAction.RECORD)
    try:
        yield
    except BaseException:
        for router, _ in slots:
            router.router_replay.clear_router_replay_action()
            router.router_replay.clear_indices()
        raise
    for router, layer in slots:
        slot = router.router_replay
        if replay and torch.is_grad_enabled() and recomputed[id(router)]:
            slot.set_router_replay_action(RouterReplayAction.REPLAY_BACKWARD)
            continue
        if not replay:
            recorder.add(mb, layer, _gather_record(router, slot.get_recorded_indices(), mb))
        slot.clear_router_replay_action()
        slot.clear_indices()
