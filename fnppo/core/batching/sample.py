"""Samples and micro-batches: the :class:`Sample` and :class:`Microbatch` pytrees.

Plain torch + optree; nothing here imports Megatron. A policy-gradient step sees a batch of
:class:`Sample` (prompt ids, response ids and per-response-token values) and runs it as a number
of :class:`Microbatch` (built by :func:`fnppo.core.batching.collate.collate_microbatch`, padded
``[batch, seq]`` or packed (THD) ``[1, total]`` with ``cu_seqlens``). Both are frozen dataclasses
registered with optree, so ``optree.tree_map`` walks into them. :func:`padding_multiple` is the
``pad_to_multiple_of`` the model's parallelism needs.

Alignment (both layouts). Position ``t`` holds the input token ``input_ids[b, t]`` and predicts
``labels[b, t] = input_ids[b, t + 1]`` of the same sample (0 where there is none). Response token
``j`` of a sample with prompt length ``P`` is the label at position ``P - 1 + j``; ``loss_mask``,
``old_logprobs``, ``advantages``, ``ref_logprobs``, ``rollout_logprobs``, ``values``, ``returns`` and
``staleness`` carry that token's value at that position and 0 everywhere else. ``position_ids`` restart at 0 for
every sample and are 0 on padding; ``seq_ids`` is the sample's index within the micro-batch, -1 on
padding.

Megatron's ``PackedSeqParams`` is built from ``cu_seqlens``/``max_seqlen`` in :mod:`fnppo.megatron.forward`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

import optree
import torch
from optree.registry import __GLOBAL_NAMESPACE as _OPTREE_GLOBAL  # noqa: PLC2701 - see _register

from fnppo.core.batching.teacher import check_teacher_shapes
from fnppo.core.errors import check_positive_int, describe, input_error
from fnppo.core.typing import Bool, Float, Int, Int32, Integer, Shaped, Tensor

__all__ = [
    "Sample",
    "Microbatch",
    "padding_multiple",
    "LAYOUTS",
    "PER_TOKEN_FLOAT",
    "PER_TOKEN_INT",
    "ALL_OR_NONE",
    "round_up",
]


LAYOUTS = ("packed", "padded")
"""The two micro-batch layouts: ``"packed"`` (THD, ``[1, total]``) and ``"padded"`` (``[batch, seq]``)."""

_C = TypeVar("_C")


def _register(cls: type[_C], leaves: tuple[str, ...], static: tuple[str, ...]) -> type[_C]:
    """Register a frozen dataclass with optree: ``leaves`` are children, ``static`` is metadata.

    Registered in optree's global namespace, so the plain ``optree.tree_map(f, x)`` (no
    ``namespace=`` argument) walks into it. Unflattening bypasses ``__init__``/``__post_init__``:
    a tree of shapes or of meta tensors is a valid result of ``tree_map`` and is not validated.
    """

    def flatten(obj: Any) -> tuple[tuple[Any, ...], tuple[Any, ...], tuple[str, ...]]:
        return (
            tuple(getattr(obj, f) for f in leaves),
            tuple(getattr(obj, f) for f in static),
            leaves,
        )

    def unflatten(meta: tuple[Any, ...], children: Any) -> Any:
        obj = object.__new__(cls)
        for name, value in zip(leaves, children, strict=True):
            object.__setattr__(obj, name, value)
        for name, value in zip(static, meta, strict=True):
            object.__setattr__(obj, name, value)
        return obj

    optree.register_pytree_node(
        cls,  # type: ignore[arg-type]
        flatten,
        unflatten,
        path_entry_type=optree.GetAttrEntry,
        namespace=_OPTREE_GLOBAL,
    )
    return cls


# ---------------------------------------------------------------------------------------------
# Sample
# ---------------------------------------------------------------------------------------------
PER_TOKEN_FLOAT = ("advantages", "old_logprobs", "ref_logprobs", "rollout_logprobs", "values", "returns")
"""The optional floating per-response-token fields of a :class:`Sample`."""
PER_TOKEN_INT = ("versions", "staleness")
"""The optional integer per-response-token fields of a :class:`Sample` (partial rollouts)."""
ALL_OR_NONE = ("old_logprobs", "ref_logprobs", "rollout_logprobs", "values", "returns", *PER_TOKEN_INT)
"""Optional per-token fields that one micro-batch holds for every sample or for none."""


@dataclasses.dataclass(frozen=True, eq=False)
class Sample:
    """One prompt and its response, with per-response-token training values (an optree pytree).

    Fields (``p`` = prompt length >= 1, ``r`` = response length >= 0):

    * ``prompt_ids: Int[Tensor, "p"]``, ``response_ids: Int[Tensor, "r"]`` (any integer dtype);
    * ``advantages``: ``Float[Tensor, "r"]`` or None (None -> zeros);
    * ``old_logprobs``: ``Float[Tensor, "r"]`` or None: the log-probs of the proximal policy, the
      trainer's recompute of the policy that sampled (:func:`fnppo.compute_logprobs`, before the
      step; :func:`fnppo.train_step` never computes them). A loss that reads them (a ratio-based
      policy loss or a rollout correction, outside bypass mode) refuses a sample without them,
      naming it; in bypass mode (``LossConfig(bypass_old_logprobs=True)``) the ``rollout_logprobs``
      take their place. Every sample of a batch has them or none (none: the micro-batch's
      ``old_logprobs`` is None, never zeros);
    * ``ref_logprobs``, ``rollout_logprobs``: ``Float[Tensor, "r"]`` or None (in one micro-batch
      either every sample has them or none);
    * ``response_mask``: a 0/1 tensor ``[r]`` (bool, int or float) or None (all ones); 0 removes a
      response token from the loss, e.g. tool output inside a multi-turn response;
    * ``multi_modal``: ``Mapping[str, Tensor]`` (default empty); dim 0 of each tensor indexes items
      (images, patches, ...) of this sample;
    * ``values``, ``returns``: ``Float[Tensor, "r"]`` or None, for the critic
      (:func:`fnppo.critic_step`): ``values[j]`` is the critic's value at rollout time of the state
      before response token ``j`` (:func:`fnppo.compute_values`), ``returns[j]`` its target (e.g.
      from :func:`fnppo.advantages.gae_advantages`); like ``ref_logprobs``, all samples of a batch or none;
    * ``routed_experts``: ``Integer[Tensor, "tokens layers topk"]`` or None: routing replay
      (:mod:`fnppo.megatron.routing`). Row ``t`` holds the top-k expert indices the routers chose for token
      ``t`` of ``prompt ++ response``, one entry per MoE layer in global layer order (dense layers
      skipped); ``len(sample)`` rows, or ``len(sample) - 1`` (an inference engine returns no route
      for the last generated token, whose output predicts nothing: there, as on padding, the router
      chooses itself). A row of ``-1`` (every entry) is a token without a route: the router chooses
      there too. In one batch either every sample has them or none. A sample with multi-modal
      items may carry the rows of the sequence the model runs, where an item takes several
      positions (an image placeholder expanded by :class:`fnppo.megatron.vlm_collate.VLMCollate`, which checks the
      exact count): construction then asks for at least ``len(sample) - 1`` rows, and
      :func:`~fnppo.core.batching.collate.collate_microbatch` for ``len`` or ``len - 1`` rows of the sequence it collates;
    * ``versions``: ``Integer[Tensor, "r"]`` or None: the policy version that sampled each response
      token (partial rollouts: a response generated across weight updates carries several; e.g. the
      optimizer step the engine's weights were taken at), integers ``>= 0``;
    * ``staleness``: ``Integer[Tensor, "r"]`` or None: each response token's age in versions,
      ``current_version - versions[j] >= 0``, as :meth:`fnppo.losses.Staleness.prepare` computes it
      from ``versions`` for the version being trained; the losses whose formula depends on the age
      (``loglinear_decoupled``) read it per token. Like ``ref_logprobs``, each of the two is given for
      all samples of a batch or for none;
    * ``teacher_topk_ids``: ``Integer[Tensor, "r k"]``, ``teacher_topk_logprobs``: ``Float[Tensor, "r k"]``
      or None (both or neither): a teacher's ``k`` most likely tokens at each response token and their
      log-probs, sorted by descending log-prob, for a distillation term
      (:class:`fnppo.core.losses.distill.TopK`); in one batch either every sample has them or none;
    * ``ce_mask``: a 0/1 tensor ``[r]`` or None: the tokens of the cross-entropy term
      (:class:`fnppo.core.losses.terms.CrossEntropy`; None: the response mask). See
      :mod:`fnppo.core.batching.teacher`.

    * ``group``: an int >= 0 or None: a declared group for shared-prefix packing
      (:class:`fnppo.core.batching.prefix.SharedPrefix`): samples of one group share their prompt,
      which is forwarded once (their ``prompt_ids`` must be equal; refused otherwise). None: samples
      are grouped by equal ``prompt_ids``. Ignored without shared-prefix packing.

    Construction checks types, ranks and lengths; value checks (0/1 mask, finite values, token range)
    happen where samples enter a computation: :func:`~fnppo.core.batching.collate.collate_microbatch`, and the training step's
    entry check of the whole batch (:func:`~fnppo.core.batching.checks.check_sample_values`). :meth:`from_lists` builds one
    from Python lists.
    """

    prompt_ids: Int[Tensor, " p"]
    response_ids: Int[Tensor, " r"]
    advantages: Float[Tensor, " r"] | None = None
    old_logprobs: Float[Tensor, " r"] | None = None
    ref_logprobs: Float[Tensor, " r"] | None = None
    rollout_logprobs: Float[Tensor, " r"] | None = None
    response_mask: Shaped[Tensor, " r"] | None = None
    multi_modal: Mapping[str, Tensor] = dataclasses.field(default_factory=dict)
    values: Float[Tensor, " r"] | None = None
    returns: Float[Tensor, " r"] | None = None
    routed_experts: Integer[Tensor, "tokens layers topk"] | None = None
    versions: Integer[Tensor, " r"] | None = None
    staleness: Integer[Tensor, " r"] | None = None
    teacher_topk_ids: Integer[Tensor, "r k"] | None = None
    teacher_topk_logprobs: Float[Tensor, "r k"] | None = None
    ce_mask: Shaped[Tensor, " r"] | None = None
    group: int | None = None

    def __post_init__(self) -> None:
        fn = "Sample"
        if self.group is not None and (
            isinstance(self.group, bool) or not isinstance(self.group, int) or self.group < 0
        ):
            raise input_error(fn, "group", "None or an int >= 0 (a declared prompt group)", _describe_any(self.group))
        for name in ("prompt_ids", "response_ids"):
            t = getattr(self, name)
            if not isinstance(t, torch.Tensor) or t.ndim != 1 or not _is_integer(t):
                raise input_error(fn, name, "a 1-D integer tensor", _describe_any(t))
        if self.prompt_ids.numel() == 0:
            raise input_error(fn, "prompt_ids", "a non-empty prompt (length >= 1)", describe(self.prompt_ids))
        r = self.response_ids.shape[0]
        for name in (*PER_TOKEN_FLOAT, "response_mask"):
            t = getattr(self, name)
            if t is None:
                continue
            if not isinstance(t, torch.Tensor) or t.ndim != 1:
                raise input_error(fn, name, f"None or a 1-D tensor of length {r}", _describe_any(t))
            if name != "response_mask" and not t.is_floating_point():
                raise input_error(fn, name, f"a floating tensor of length {r}", describe(t))
            if t.shape[0] != r:
                raise input_error(fn, name, f"length {r} (the response length)", describe(t))
        if not isinstance(self.multi_modal, Mapping):
            raise input_error(fn, "multi_modal", "a mapping from str to tensors", _describe_any(self.multi_modal))
        for key, t in self.multi_modal.items():
            if not isinstance(key, str):
                raise input_error(fn, "multi_modal", "str keys", repr(key))
            if not isinstance(t, torch.Tensor) or t.ndim < 1:
                raise input_error(fn, f"multi_modal[{key!r}]", "a tensor with dim 0 indexing items", _describe_any(t))
        object.__setattr__(self, "multi_modal", dict(self.multi_modal))
        self._check_routed_experts(fn)
        for name in PER_TOKEN_INT:
            _check_token_counts(fn, name, getattr(self, name), r)
        check_teacher_shapes(fn, self)

    def _check_routed_experts(self, fn: str) -> None:
        """``routed_experts``: None or an integer ``[tokens, layers, topk]`` with ``len`` or ``len - 1``
        rows; at least ``len - 1`` rows on a sample with multi-modal items (the exact count is the
        check of the collate stage that expands them)."""
        t = self.routed_experts
        if t is None:
            return
        if not isinstance(t, torch.Tensor) or t.ndim != 3 or not _is_integer(t):
            raise input_error(
                fn, "routed_experts", "None or an integer tensor [tokens, layers, topk]", _describe_any(t)
            )
        n = len(self)
        if any(int(v.shape[0]) for v in self.multi_modal.values()):
            if t.shape[0] < n - 1 or t.shape[1] < 1 or t.shape[2] < 1:
                raise input_error(
                    fn,
                    "routed_experts",
                    f"at least {n - 1} rows (one per position of the sequence the model runs, whose multi-modal "
                    "items may take several positions each), at least one MoE layer and one expert per row",
                    describe(t),
                )
            return
        if t.shape[0] not in (n, n - 1) or t.shape[1] < 1 or t.shape[2] < 1:
            raise input_error(
                fn,
                "routed_experts",
                f"{n} or {n - 1} rows (one per token of prompt + response; the last token's may be missing), "
                "at least one MoE layer and one expert per row",
                describe(t),
            )

    @property
    def prompt_len(self) -> int:
        return int(self.prompt_ids.shape[0])

    @property
    def response_len(self) -> int:
        return int(self.response_ids.shape[0])

    def __len__(self) -> int:
        """Token count ``len(prompt) + len(response)`` (without padding)."""
        return self.prompt_len + self.response_len

    @classmethod
    def from_lists(
        cls,
        prompt_ids: Sequence[int] | Tensor,
        response_ids: Sequence[int] | Tensor,
        *,
        advantages: float | Sequence[float] | Tensor | None = None,
        old_logprobs: Sequence[float] | Tensor | None = None,
        ref_logprobs: Sequence[float] | Tensor | None = None,
        rollout_logprobs: Sequence[float] | Tensor | None = None,
        response_mask: Sequence[float] | Tensor | None = None,
        multi_modal: Mapping[str, Any] | None = None,
        values: Sequence[float] | Tensor | None = None,
        returns: Sequence[float] | Tensor | None = None,
        routed_experts: Sequence[Sequence[Sequence[int]]] | Tensor | None = None,
        versions: int | Sequence[int] | Tensor | None = None,
        staleness: int | Sequence[int] | Tensor | None = None,
        teacher_topk_ids: Sequence[Sequence[int]] | Tensor | None = None,
        teacher_topk_logprobs: Sequence[Sequence[float]] | Tensor | None = None,
        ce_mask: Sequence[float] | Tensor | None = None,
        group: int | None = None,
    ) -> Sample:
        """Build a :class:`Sample` from lists: ids, versions and staleness become int64, values
        float32, the mask float32, routed experts int32 (an integer tensor keeps its dtype).

        A scalar ``advantages`` (one advantage per sequence, as in GRPO) is broadcast to every
        response token, and so is a scalar ``versions`` or ``staleness`` (one version per sample).
        """
        p = torch.as_tensor(prompt_ids, dtype=torch.int64)
        r = torch.as_tensor(response_ids, dtype=torch.int64)

        def floats(v: Any) -> Tensor | None:
            return None if v is None else torch.as_tensor(v, dtype=torch.float32)

        adv = floats(advantages)
        if adv is not None and adv.ndim == 0:
            adv = adv.expand(r.shape[0]).clone()
        mm = {k: torch.as_tensor(v) for k, v in (multi_modal or {}).items()}

        def counts(v: Any) -> Any:
            """Python integers as int64 (a scalar broadcast); anything else as given, refused by name
            when it is not integer (a float 1.5 is never truncated to a version)."""
            if v is None or isinstance(v, (Tensor, str)):
                return v
            try:
                t = torch.as_tensor(v)
            except (TypeError, ValueError, RuntimeError):
                return v
            if not _is_integer(t) and t.numel():
                return t
            t = t.to(torch.int64)  # (an empty list is float32 to torch)
            return t.expand(r.shape[0]).clone() if t.ndim == 0 else t

        return cls(
            prompt_ids=p,
            response_ids=r,
            advantages=adv,
            old_logprobs=floats(old_logprobs),
            ref_logprobs=floats(ref_logprobs),
            rollout_logprobs=floats(rollout_logprobs),
            response_mask=floats(response_mask),
            multi_modal=mm,
            values=floats(values),
            returns=floats(returns),
            routed_experts=routed_experts
            if routed_experts is None or isinstance(routed_experts, Tensor)
            else torch.as_tensor(routed_experts, dtype=torch.int32),
            versions=counts(versions),
            staleness=counts(staleness),
            teacher_topk_ids=teacher_topk_ids
            if teacher_topk_ids is None or isinstance(teacher_topk_ids, Tensor)
            else torch.as_tensor(teacher_topk_ids, dtype=torch.int64),
            teacher_topk_logprobs=floats(teacher_topk_logprobs),
            ce_mask=floats(ce_mask),
            group=group,
        )


_register(
    Sample,
    leaves=(
        "prompt_ids",
        "response_ids",
        *PER_TOKEN_FLOAT,
        "response_mask",
        "multi_modal",
        "routed_experts",
        *PER_TOKEN_INT,
        "teacher_topk_ids",
        "teacher_topk_logprobs",
        "ce_mask",
    ),
    static=("group",),
)


def _check_token_counts(fn: str, name: str, t: Any, r: int) -> None:
    """``versions`` / ``staleness``: None or a 1-D integer tensor of length ``r`` with values ``>= 0``
    (one host sync for a device tensor)."""
    if t is None:
        return
    what = "the policy version of each response token" if name == "versions" else "the age of each response token"
    if not isinstance(t, torch.Tensor) or t.ndim != 1 or not _is_integer(t):
        raise input_error(fn, name, f"None or a 1-D integer tensor of length {r} ({what})", _describe_any(t))
    if t.shape[0] != r:
        raise input_error(fn, name, f"length {r} (the response length)", describe(t))
    if r and int(t.min()) < 0:
        raise input_error(fn, name, f"integers >= 0 ({what})", f"{describe(t)} with minimum {int(t.min())}")


def _is_integer(t: Tensor) -> bool:
    """Whether ``t`` has an integer dtype (not bool, floating or complex)."""
    return not (t.dtype == torch.bool or t.is_floating_point() or t.is_complex())


def _describe_any(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        return describe(x)
    return f"{type(x).__name__} {x!r}"[:200]


# ---------------------------------------------------------------------------------------------
# Microbatch
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, eq=False)
class Microbatch:
    """One micro-batch, ready for the forward pass (an immutable optree pytree).

    Per-token tensors have shape ``[batch, seq]`` (padded layout) or ``[1, total]`` (packed THD
    layout); see the module docstring for the alignment of labels and per-token values.

    Leaves (moved by ``optree.tree_map(lambda x: x.to(device), mb)``; None stays None):
    ``input_ids``, ``position_ids``, ``labels``, ``seq_ids`` (int64), ``loss_mask``,
    ``old_logprobs``, ``advantages``, ``ref_logprobs``, ``rollout_logprobs``, ``values``, ``returns``
    (float32; all but ``advantages`` None when the samples have none),
    ``attention_mask`` (bool, padded layout only, True on real tokens), ``cu_seqlens`` (int32
    ``[n + 1]`` over the padded segment lengths, packed layout only), ``sample_index`` (int64 ``[n]``,
    indices of the samples into the original batch: a record for custom stages; results are put back
    in sample order by :meth:`~fnppo.core.batching.split.SplitPlan.restore`), ``multi_modal`` (dict: per key, the items of all
    samples concatenated on dim 0 in sample order) and ``multi_modal_counts`` (dict: per key, int64
    ``[n]`` items per sample), ``routed_experts`` (int32 ``[batch, seq, layers, topk]`` or None: the
    experts routing replay forces for the token at each position, see :class:`Sample`; ``-1`` on
    padding and missing rows: the router chooses there), ``teacher_topk_ids`` (int64) /
    ``teacher_topk_logprobs`` (float32) ``[batch, seq, k]`` and ``ce_mask`` (float32 ``[batch, seq]``), or
    None (:func:`fnppo.core.batching.teacher.collate_teacher`).

    Static (treedef metadata): ``layout``, ``max_seqlen`` (longest padded segment, packed layout;
    None when padded), ``prompt_lens``, ``response_lens`` and ``pad_to_multiple_of``.

    Shared-prefix packing (:func:`~fnppo.core.batching.collate.collate_microbatch` with
    ``share_prefix=True``; None otherwise): the samples of a prompt group form one packed document
    ``[prompt[:-1] | prompt[-1] r_1 | prompt[-1] r_2 | ...]`` (``cu_seqlens`` bounds the documents).
    ``branch_ids`` (int64 leaf) numbers the runs of the pack (a document's prefix, each segment),
    ``root_ids`` gives each token the run whose keys it sees besides its own (its document's
    prefix; the prefix itself for a prefix token): query ``i`` attends to key ``j`` iff ``j <= i``
    and ``branch(j)`` is ``branch(i)`` or ``root(i)``. ``spans`` (static) holds per sample
    ``(prefix start, segment start)`` in the pack: its tokens are the ``P - 1`` from the first and
    the ``R + 1`` from the second, its response values at ``segment start + j``.
    """

    input_ids: Int[Tensor, "batch seq"]
    position_ids: Int[Tensor, "batch seq"]
    labels: Int[Tensor, "batch seq"]
    loss_mask: Float[Tensor, "batch seq"]
    old_logprobs: Float[Tensor, "batch seq"] | None
    advantages: Float[Tensor, "batch seq"]
    ref_logprobs: Float[Tensor, "batch seq"] | None
    rollout_logprobs: Float[Tensor, "batch seq"] | None
    seq_ids: Int[Tensor, "batch seq"]
    attention_mask: Bool[Tensor, "batch seq"] | None
    cu_seqlens: Int32[Tensor, " n_plus_1"] | None
    sample_index: Int[Tensor, " n"]
    multi_modal: dict[str, Tensor]
    multi_modal_counts: dict[str, Int[Tensor, " n"]]
    layout: str
    max_seqlen: int | None
    prompt_lens: tuple[int, ...]
    response_lens: tuple[int, ...]
    pad_to_multiple_of: int
    values: Float[Tensor, "batch seq"] | None = None
    returns: Float[Tensor, "batch seq"] | None = None
    routed_experts: Int[Tensor, "batch seq layers topk"] | None = None
    staleness: Float[Tensor, "batch seq"] | None = None
    teacher_topk_ids: Int[Tensor, "batch seq k"] | None = None
    teacher_topk_logprobs: Float[Tensor, "batch seq k"] | None = None
    ce_mask: Float[Tensor, "batch seq"] | None = None
    branch_ids: Int[Tensor, "batch seq"] | None = None
    root_ids: Int[Tensor, "batch seq"] | None = None
    spans: tuple[tuple[int, int], ...] | None = None

    @property
    def num_samples(self) -> int:
        """Number of samples ``n`` in the micro-batch."""
        return len(self.prompt_lens)

    @property
    def seq_lens(self) -> tuple[int, ...]:
        """Real length ``prompt + response`` of every sample (without padding)."""
        return tuple(p + r for p, r in zip(self.prompt_lens, self.response_lens, strict=True))

    @property
    def segment_lens(self) -> tuple[int, ...]:
        """Length of every sample padded to ``pad_to_multiple_of`` (the packed segment lengths)."""
        return tuple(round_up(n, self.pad_to_multiple_of) for n in self.seq_lens)

    @property
    def is_packed(self) -> bool:
        """Whether the layout is packed (THD, ``[1, total]``)."""
        return self.layout == "packed"

    @property
    def is_shared(self) -> bool:
        """Whether the micro-batch is packed with shared prefixes (``spans`` set)."""
        return self.spans is not None

    @property
    def token_spans(self) -> tuple[tuple[int, int], ...]:
        """Per sample ``(prefix start, segment start)`` in its row: its ``P - 1`` prompt tokens but
        the last from the first, the last prompt token and its ``R`` response tokens from the second
        (``spans`` when shared; else consecutive: ``(start, start + P - 1)``, the start being 0 in a
        padded row and the packed segment's offset)."""
        if self.spans is not None:
            return self.spans
        out, offset = [], 0
        for p, seg in zip(self.prompt_lens, self.segment_lens, strict=True):
            start = offset if self.is_packed else 0
            out.append((start, start + p - 1))
            offset += seg
        return tuple(out)


_MB_LEAVES = (
    "input_ids",
    "position_ids",
    "labels",
    "loss_mask",
    "old_logprobs",
    "advantages",
    "ref_logprobs",
    "rollout_logprobs",
    "seq_ids",
    "attention_mask",
    "cu_seqlens",
    "sample_index",
    "multi_modal",
    "multi_modal_counts",
    "values",
    "returns",
    "routed_experts",
    "staleness",
    "teacher_topk_ids",
    "teacher_topk_logprobs",
    "ce_mask",
    "branch_ids",
    "root_ids",
)
_MB_STATIC = ("layout", "max_seqlen", "prompt_lens", "response_lens", "pad_to_multiple_of", "spans")
_register(Microbatch, leaves=_MB_LEAVES, static=_MB_STATIC)


def round_up(n: int, m: int) -> int:
    """The smallest multiple of ``m`` that is ``>= n``."""
    return -(-n // m) * m


def padding_multiple(tp_size: int = 1, cp_size: int = 1) -> int:
    """The ``pad_to_multiple_of`` Megatron needs: ``tp`` without context parallelism, else ``2*cp*tp``.

    Sequence parallelism splits a sequence over the ``tp`` ranks; context parallelism with load
    balancing splits it into ``2*cp`` chunks (Megatron-LM, arXiv 2205.05198 and its CP docs).

    Raises:
        InputError: a size that is not an int >= 1.
    """
    for name, v in (("tp_size", tp_size), ("cp_size", cp_size)):
        check_positive_int("padding_multiple", name, v)
    return tp_size if cp_size == 1 else 2 * cp_size * tp_size
