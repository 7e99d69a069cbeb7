"""Micro-batches: the :class:`Sample` and :class:`Microbatch` pytrees, collation and unpacking.

Plain torch + optree; nothing here imports Megatron. A policy-gradient step sees a batch of
:class:`Sample` (prompt ids, response ids and per-response-token values) and runs it as a number
of micro-batches:

* :func:`fnppo.core.split.split_batch` decides which samples go into which micro-batch and returns a
  :class:`~fnppo.core.split.SplitPlan` (both re-exported here);
* :func:`collate_microbatch` turns the samples of one micro-batch into a :class:`Microbatch`, padded
  ``[batch, seq]`` or packed (THD) ``[1, total]`` with ``cu_seqlens``;
* :func:`unpack_per_sample` maps a per-position tensor (log-probs, entropies, ...) back to one
  per-response-token tensor per sample.

The sample checks live here, one function each, called where samples enter (collation, the
split, the training step): :func:`check_lengths`, :func:`check_same_fields`,
:func:`check_token_ids`, :func:`check_sample_values`, :func:`check_devices`,
:func:`check_routed_experts`, :func:`check_routing_rows`, :func:`check_positive_int`. Each names
``<arg>[i]``, ``i`` the position in the list it is given: ``samples[i]`` of
:func:`collate_microbatch`'s argument, ``batch[i]`` of the caller's batch in the training step.

Alignment (both layouts). Position ``t`` holds the input token ``input_ids[b, t]`` and predicts
``labels[b, t] = input_ids[b, t + 1]`` of the same sample (0 where there is none). Response token
``j`` of a sample with prompt length ``P`` is the label at position ``P - 1 + j``; ``loss_mask``,
``old_logprobs``, ``advantages``, ``ref_logprobs``, ``rollout_logprobs``, ``values`` and ``returns``
carry that token's value at that position and 0 everywhere else. ``position_ids`` restart at 0 for every sample and are 0 on
padding; ``seq_ids`` is the sample's index within the micro-batch, -1 on padding.

Megatron's ``PackedSeqParams`` is built from ``cu_seqlens``/``max_seqlen`` in :mod:`fnppo.megatron.model`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

import optree
import torch
from optree.registry import __GLOBAL_NAMESPACE as _OPTREE_GLOBAL  # noqa: PLC2701 - see _register

from fnppo.core.typing import (
    Bool,
    Float,
    Int,
    Int32,
    Integer,
    Shaped,
    ShapeError,
    Tensor,
    check_finite,
    check_mask01,
    check_range,
    describe,
    input_error,
    typechecked,
)

__all__ = [
    "Sample",
    "Microbatch",
    "SplitPlan",
    "collate_microbatch",
    "split_batch",
    "unpack_per_sample",
    "padding_multiple",
    "LAYOUTS",
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
_PER_TOKEN_FLOAT = ("advantages", "old_logprobs", "ref_logprobs", "rollout_logprobs", "values", "returns")
_ALL_OR_NONE = ("ref_logprobs", "rollout_logprobs", "values", "returns")
"""Optional per-token fields that one micro-batch holds for every sample or for none."""


@dataclasses.dataclass(frozen=True, eq=False)
class Sample:
    """One prompt and its response, with per-response-token training values (an optree pytree).

    Fields (``p`` = prompt length >= 1, ``r`` = response length >= 0):

    * ``prompt_ids: Int[Tensor, "p"]``, ``response_ids: Int[Tensor, "r"]`` (any integer dtype);
    * ``advantages``, ``old_logprobs``: ``Float[Tensor, "r"]`` or None (None -> zeros; the training
      step computes old log-probs itself when they are not given);
    * ``ref_logprobs``, ``rollout_logprobs``: ``Float[Tensor, "r"]`` or None (in one micro-batch
      either every sample has them or none);
    * ``response_mask``: a 0/1 tensor ``[r]`` (bool, int or float) or None (all ones); 0 removes a
      response token from the loss, e.g. tool output inside a multi-turn response;
    * ``multi_modal``: ``Mapping[str, Tensor]`` (default empty); dim 0 of each tensor indexes items
      (images, patches, ...) of this sample;
    * ``values``, ``returns``: ``Float[Tensor, "r"]`` or None, for the critic
      (:func:`fnppo.critic_step`): ``values[j]`` is the critic's value at rollout time of the state
      before response token ``j`` (:func:`fnppo.compute_values`), ``returns[j]`` its target (e.g.
      from :func:`fnppo.gae_advantages`); like ``ref_logprobs``, all samples of a batch or none;
    * ``routed_experts``: ``Integer[Tensor, "tokens layers topk"]`` or None: routing replay
      (:mod:`fnppo.megatron.routing`). Row ``t`` holds the top-k expert indices the routers chose for token
      ``t`` of ``prompt ++ response``, one entry per MoE layer in global layer order (dense layers
      skipped); ``len(sample)`` rows, or ``len(sample) - 1`` (an inference engine returns no route
      for the last generated token, whose output predicts nothing: there, as on padding, the router
      chooses itself). A row of ``-1`` (every entry) is a token without a route: the router chooses
      there too. In one batch either every sample has them or none. A sample with multi-modal
      items may carry the rows of the sequence the model runs, where an item takes several
      positions (an image placeholder expanded by :class:`fnppo.megatron.vlm.VLMCollate`, which checks the
      exact count): construction then asks for at least ``len(sample) - 1`` rows, and
      :func:`collate_microbatch` for ``len`` or ``len - 1`` rows of the sequence it collates.

    Construction checks types, ranks and lengths; value checks (0/1 mask, finite values, token range)
    happen where samples enter a computation: :func:`collate_microbatch`, and the training step's
    entry check of the whole batch (:func:`check_sample_values`). :meth:`from_lists` builds one
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

    def __post_init__(self) -> None:
        fn = "Sample"
        for name in ("prompt_ids", "response_ids"):
            t = getattr(self, name)
            if not isinstance(t, torch.Tensor) or t.ndim != 1 or t.dtype == torch.bool or t.is_floating_point() or t.is_complex():
                raise input_error(fn, name, "a 1-D integer tensor", _describe_any(t))
        if self.prompt_ids.numel() == 0:
            raise input_error(fn, "prompt_ids", "a non-empty prompt (length >= 1)", describe(self.prompt_ids))
        r = self.response_ids.shape[0]
        for name in (*_PER_TOKEN_FLOAT, "response_mask"):
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

    def _check_routed_experts(self, fn: str) -> None:
        """``routed_experts``: None or an integer ``[tokens, layers, topk]`` with ``len`` or ``len - 1``
        rows; at least ``len - 1`` rows on a sample with multi-modal items (the exact count is the
        check of the collate stage that expands them)."""
        t = self.routed_experts
        if t is None:
            return
        if not isinstance(t, torch.Tensor) or t.ndim != 3 or t.dtype == torch.bool or t.is_floating_point() or t.is_complex():
            raise input_error(fn, "routed_experts", "None or an integer tensor [tokens, layers, topk]", _describe_any(t))
        n = len(self)
        if any(int(v.shape[0]) for v in self.multi_modal.values()):
            if t.shape[0] < n - 1 or t.shape[1] < 1 or t.shape[2] < 1:
                raise input_error(
                    fn, "routed_experts",
                    f"at least {n - 1} rows (one per position of the sequence the model runs, whose multi-modal items may take "
                    "several positions each), at least one MoE layer and one expert per row", describe(t),
                )
            return
        if t.shape[0] not in (n, n - 1) or t.shape[1] < 1 or t.shape[2] < 1:
            raise input_error(
                fn, "routed_experts",
                f"{n} or {n - 1} rows (one per token of prompt + response; the last token's may be missing), "
                "at least one MoE layer and one expert per row", describe(t),
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
    ) -> Sample:
        """Build a :class:`Sample` from lists: ids become int64, values float32, the mask float32,
        routed experts int32 (an integer tensor keeps its dtype).

        A scalar ``advantages`` (one advantage per sequence, as in GRPO) is broadcast to every
        response token.
        """
        p = torch.as_tensor(prompt_ids, dtype=torch.int64)
        r = torch.as_tensor(response_ids, dtype=torch.int64)

        def floats(v: Any) -> Tensor | None:
            return None if v is None else torch.as_tensor(v, dtype=torch.float32)

        adv = floats(advantages)
        if adv is not None and adv.ndim == 0:
            adv = adv.expand(r.shape[0]).clone()
        mm = {k: torch.as_tensor(v) for k, v in (multi_modal or {}).items()}
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
            routed_experts=routed_experts if routed_experts is None or isinstance(routed_experts, Tensor)
            else torch.as_tensor(routed_experts, dtype=torch.int32),
        )


_register(
    Sample,
    leaves=("prompt_ids", "response_ids", *_PER_TOKEN_FLOAT, "response_mask", "multi_modal", "routed_experts"),
    static=(),
)


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
    (float32; the last four None when the samples have none),
    ``attention_mask`` (bool, padded layout only, True on real tokens), ``cu_seqlens`` (int32
    ``[n + 1]`` over the padded segment lengths, packed layout only), ``sample_index`` (int64 ``[n]``,
    indices of the samples into the original batch: a record for custom stages; results are put back
    in sample order by :meth:`SplitPlan.restore`), ``multi_modal`` (dict: per key, the items of all
    samples concatenated on dim 0 in sample order) and ``multi_modal_counts`` (dict: per key, int64
    ``[n]`` items per sample), ``routed_experts`` (int32 ``[batch, seq, layers, topk]`` or None: the
    experts routing replay forces for the token at each position, see :class:`Sample`; ``-1`` on
    padding and missing rows: the router chooses there).

    Static (treedef metadata): ``layout``, ``max_seqlen`` (longest padded segment, packed layout;
    None when padded), ``prompt_lens``, ``response_lens`` and ``pad_to_multiple_of``.
    """

    input_ids: Int[Tensor, "batch seq"]
    position_ids: Int[Tensor, "batch seq"]
    labels: Int[Tensor, "batch seq"]
    loss_mask: Float[Tensor, "batch seq"]
    old_logprobs: Float[Tensor, "batch seq"]
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
        return tuple(_round_up(n, self.pad_to_multiple_of) for n in self.seq_lens)

    @property
    def is_packed(self) -> bool:
        """Whether the layout is packed (THD, ``[1, total]``)."""
        return self.layout == "packed"


_MB_LEAVES = (
    "input_ids", "position_ids", "labels", "loss_mask", "old_logprobs", "advantages", "ref_logprobs",
    "rollout_logprobs", "seq_ids", "attention_mask", "cu_seqlens", "sample_index", "multi_modal",
    "multi_modal_counts", "values", "returns", "routed_experts",
)
_MB_STATIC = ("layout", "max_seqlen", "prompt_lens", "response_lens", "pad_to_multiple_of")
_register(Microbatch, leaves=_MB_LEAVES, static=_MB_STATIC)


def _round_up(n: int, m: int) -> int:
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


# ---------------------------------------------------------------------------------------------
# Sample checks: one function per check, called where samples enter
# ---------------------------------------------------------------------------------------------
def check_positive_int(fn: str, name: str, v: Any, allow_none: bool = False) -> None:
    """``v`` is an int >= 1 (not a bool), or None when ``allow_none``.

    Raises:
        InputError: ``"<fn>: argument '<name>' expected an int >= 1 [or None], received <v>"``.
    """
    if allow_none and v is None:
        return
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise input_error(fn, name, "an int >= 1" + (" or None" if allow_none else ""), repr(v))


def check_lengths(fn: str, samples: Sequence[Sample], limit: int, expected: str, *, arg: str = "samples") -> None:
    """Every sample has at most ``limit`` tokens (prompt + response); longer ones are refused, never cut.

    Args:
        fn, arg: the function and argument named in the error (``arg[i]`` is the sample).
        samples: the samples.
        limit: the largest allowed ``len(sample)``.
        expected: the error's "expected" text, e.g. ``"at most max_seq_len=8 tokens"``.

    Raises:
        InputError: for the first sample longer than ``limit``.
    """
    for i, s in enumerate(samples):
        if len(s) > limit:
            raise input_error(fn, f"{arg}[{i}]", expected, f"{len(s)} tokens (prompt {s.prompt_len} + response {s.response_len})")


def check_same_fields(fn: str, samples: Sequence[Sample], *, arg: str = "samples") -> dict[str, bool]:
    """``ref_logprobs`` / ``rollout_logprobs`` / ``values`` / ``returns`` / ``routed_experts`` are given
    for all samples or for none.

    Returns:
        ``{name: all samples have it}`` for each of these names.

    Raises:
        InputError: naming the first sample without the field and one that has it.
    """
    present: dict[str, bool] = {}
    for name in (*_ALL_OR_NONE, "routed_experts"):
        have = [getattr(s, name) is not None for s in samples]
        if any(have) and not all(have):
            missing = have.index(False)
            raise input_error(fn, f"{arg}[{missing}].{name}", f"a tensor ({arg}[{have.index(True)}] has {name}; all samples or none)", "None")
        present[name] = all(have)
    return present


def routing_dtype_holds(dtype: torch.dtype, num_experts: int) -> bool:
    """Whether an integer ``dtype`` holds every expert index ``0 .. num_experts - 1`` (uint8: 256 experts)."""
    return torch.iinfo(dtype).max >= num_experts - 1


def check_routed_experts(fn: str, samples: Sequence[Sample], *, num_layers: int | None = None, topk: int | None = None,
                         num_experts: int | None = None, arg: str = "samples", values: bool = True) -> None:
    """Routed experts (routing replay) that a step can force: one shape, the model's, valid indices.

    With ``routed_experts`` on the samples (:func:`check_same_fields` checks all-or-none): every
    sample's ``[tokens, layers, topk]`` has the layers and top-k of the first sample (and
    ``num_layers`` / ``topk`` when given: the model's MoE layers and router top-k); its dtype holds
    ``num_experts - 1``; with ``values``, every row is either ``-1`` in every entry (no route: the
    router chooses) or indices in ``[0, num_experts)`` (``>= 0`` when ``num_experts`` is None) whose
    ``topk`` entries are distinct (duplicates would route a token to fewer experts than top-k, and
    the dispatcher's token counts would no longer match).
    One host sync for the values; the samples are searched one by one only to name the first offender.

    Raises:
        InputError: naming ``<arg>[i].routed_experts``, with the layer and token of a bad row.
    """
    have = [s for s in samples if s.routed_experts is not None]
    if not have:
        return
    first = have[0].routed_experts
    want = (num_layers if num_layers is not None else first.shape[1], topk if topk is not None else first.shape[2])
    for i, s in enumerate(samples):
        t = s.routed_experts
        if t is None:
            continue
        if tuple(t.shape[1:]) != want:
            whose = "the model's MoE layers and top-k" if num_layers is not None else f"those of {arg}[0]"
            raise input_error(fn, f"{arg}[{i}].routed_experts", f"[tokens, {want[0]}, {want[1]}] ({whose})", describe(t))
        if num_experts is not None and not routing_dtype_holds(t.dtype, num_experts):
            raise input_error(fn, f"{arg}[{i}].routed_experts", f"an integer dtype that holds expert indices up to {num_experts - 1} (int16 or wider)",
                              f"{describe(t)} (max {torch.iinfo(t.dtype).max})")
    if not values:
        return
    high = num_experts if num_experts is not None else 2**62
    k = want[1]

    def bad_rows(t: Tensor) -> Tensor:
        rows = t.reshape(-1, k).to(torch.int64)
        ordered = rows.sort(dim=-1).values
        unset = (rows == -1).all(-1)  # no route: the router chooses
        return ~unset & (((rows < 0) | (rows >= high)).any(-1) | (ordered[:, 1:] == ordered[:, :-1]).any(-1))

    if not bool(bad_rows(torch.cat([s.routed_experts.reshape(-1, k).to(torch.int64) for s in have])).any()):
        return
    for i, s in enumerate(samples):
        t = s.routed_experts
        if t is None:
            continue
        bad = bad_rows(t).nonzero()
        if bad.numel():
            flat = int(bad[0, 0])
            token, layer = divmod(flat, want[0])
            row = t.reshape(-1, k)[flat].tolist()
            if min(row) < 0 or max(row) >= high:
                expected = (f"expert indices in [0, {num_experts}) (the model's num_experts)" if num_experts is not None
                            else "expert indices >= 0") + ", or -1 in every entry of a row (no route: the router chooses)"
            else:
                expected = f"{k} distinct experts per token and MoE layer"
            raise input_error(fn, f"{arg}[{i}].routed_experts", expected, f"experts {row} for token {token}, MoE layer {layer}")


def check_token_ids(fn: str, samples: Sequence[Sample], vocab_size: int | None, *, arg: str = "samples") -> None:
    """Token ids lie in ``[0, vocab_size)`` (``vocab_size=None``: are >= 0).

    One device-to-host sync over all samples; only when something is out of range are the
    samples checked one by one to name the first offender.

    Raises:
        InputError: ``"<arg>[i].prompt_ids"`` / ``".response_ids"`` with the range of its values.
    """
    high = vocab_size if vocab_size is not None else 2**63 - 1
    ids = [t.reshape(-1).to(torch.int64) for s in samples for t in (s.prompt_ids, s.response_ids)]
    flat = torch.cat(ids) if ids else torch.zeros(0, dtype=torch.int64)
    if flat.numel() == 0 or not bool(((flat < 0) | (flat >= high)).any()):
        return
    for i, s in enumerate(samples):
        for name in ("prompt_ids", "response_ids"):
            check_range(fn, f"{arg}[{i}].{name}", getattr(s, name), 0, high)


def check_devices(fn: str, samples: Sequence[Sample], *, arg: str = "samples") -> None:
    """Every tensor of every sample is on the device of the first sample.

    Raises:
        InputError: naming ``<arg>[i].<field>``, the device expected and the one received.
    """
    device = samples[0].prompt_ids.device
    for i, s in enumerate(samples):
        for name in ("prompt_ids", "response_ids", *_PER_TOKEN_FLOAT, "response_mask", "routed_experts"):
            t = getattr(s, name)
            if t is not None and t.device != device:
                raise input_error(fn, f"{arg}[{i}].{name}", f"a tensor on {device} (the device of {arg}[0])",
                                  f"{describe(t)} on {t.device}")


def check_sample_values(fn: str, samples: Sequence[Sample], *, arg: str = "samples") -> None:
    """Response masks are 0/1 and the per-token values (advantages, old / ref / rollout log-probs,
    values, returns) finite, in every sample.

    The one home of these value checks: :func:`collate_microbatch` runs it on the samples it is
    given, :func:`fnppo.train_step` (and the other step entry points) on the caller's whole batch
    before anything runs, with ``arg="batch"``. One check over all samples per field (one host sync
    for device tensors); only when it fails are the samples checked one by one, to name the first
    offender.

    Raises:
        InputError: naming ``<arg>[i].response_mask`` (a 0/1 mask) or ``<arg>[i].<field>`` (finite
            values), ``i`` the sample's position in ``samples``.
    """
    masks = [s.response_mask for s in samples if s.response_mask is not None and s.response_mask.dtype != torch.bool]
    fields = {name: [getattr(s, name) for s in samples if getattr(s, name) is not None] for name in _PER_TOKEN_FLOAT}
    flags = []
    if masks:
        m = torch.cat([t.reshape(-1) for t in masks])
        flags.append(((m != 0) & (m != 1)).any())
    for parts in fields.values():
        if parts:  # torch.cat promotes mixed float dtypes
            flags.append((~torch.isfinite(torch.cat([t.reshape(-1) for t in parts]))).any())
    if not flags or not bool(torch.stack(flags).any()):
        return
    for i, s in enumerate(samples):
        if s.response_mask is not None:
            check_mask01(fn, f"{arg}[{i}].response_mask", s.response_mask)
        for name in _PER_TOKEN_FLOAT:
            check_finite(fn, f"{arg}[{i}].{name}", getattr(s, name))


# ---------------------------------------------------------------------------------------------
# collate_microbatch
# ---------------------------------------------------------------------------------------------
@typechecked
def collate_microbatch(
    samples: Sequence[Sample],
    *,
    layout: str = "packed",
    pad_to_multiple_of: int = 1,
    pad_token_id: int = 0,
    max_seq_len: int | None = None,
    vocab_size: int | None = None,
    sample_index: Sequence[int] | None = None,
) -> Microbatch:
    """Collate samples into one :class:`Microbatch` (padded ``[n, S]`` or packed THD ``[1, T]``).

    For sample ``i`` with prompt ``x`` (length ``P``), response ``y`` (length ``R``) and
    ``L = P + R``, the tokens are ``z = x ++ y`` and, for ``t < L``::

        input_ids[t] = z[t]          labels[t] = z[t+1]  (0 at t = L-1)     position_ids[t] = t
        loss_mask[P-1+j] = response_mask[j],  old_logprobs[P-1+j] = old_logprobs[j], ...  (0 elsewhere)

    Padded layout: ``S = round_up(max_i L_i, m)`` with ``m = pad_to_multiple_of``, right padding,
    ``attention_mask`` True on real tokens. Packed layout: each sample padded to
    ``round_up(L_i, m)`` (the padding stays inside its own segment), concatenated;
    ``cu_seqlens = [0, cumsum(round_up(L_i, m))]`` (int32), ``max_seqlen = max_i round_up(L_i, m)``.
    Padding has token ``pad_token_id``, label 0, position 0, ``seq_ids`` -1 and every value 0.
    Packing without cross-contamination: Krell et al., arXiv 2107.02027.

    Multi-modal keys are the union over the samples; per key, the items of the samples that have it
    are concatenated on dim 0 in sample order and ``multi_modal_counts[key][i]`` is sample ``i``'s
    item count (0 where it has none). ``sample_index`` (default ``0..n-1``) records where the samples
    came from (:attr:`SplitPlan.microbatches` entries). Use :func:`padding_multiple` for ``m``.

    Raises:
        InputError: empty ``samples``, unknown ``layout``, a sample longer than ``max_seq_len``,
            token ids outside ``[0, vocab_size)``, a mask that is not 0/1, NaN/inf in a log-prob,
            advantage, value or return, ref/rollout log-probs, values or returns given for some
            samples only, mismatched multi-modal items, samples on different devices, routed
            experts that are not one row per token (or one fewer) or hold invalid indices.
    """
    fn = "collate_microbatch"
    samples = list(samples)
    index, present = _check_collate_inputs(fn, samples, layout, pad_to_multiple_of, max_seq_len, vocab_size, sample_index)
    device = samples[0].prompt_ids.device
    seg_lens = [_round_up(len(s), pad_to_multiple_of) for s in samples]
    per_token = _collate_fields(samples, seg_lens, layout, pad_token_id, present)
    mm, counts = _collate_multi_modal(fn, samples, device)
    routes = _collate_routing(samples, seg_lens, layout) if present["routed_experts"] else None
    return Microbatch(
        **per_token,  # type: ignore[arg-type]
        **_layout_fields(layout, per_token["seq_ids"], seg_lens, device),
        sample_index=torch.tensor(list(index), dtype=torch.int64, device=device),
        multi_modal=mm,
        multi_modal_counts=counts,
        layout=layout,
        prompt_lens=tuple(s.prompt_len for s in samples),
        response_lens=tuple(s.response_len for s in samples),
        pad_to_multiple_of=pad_to_multiple_of,
        routed_experts=routes,
    )


def _check_collate_inputs(fn: str, samples: list[Sample], layout: str, pad_to_multiple_of: int, max_seq_len: int | None,
                          vocab_size: int | None, sample_index: Sequence[int] | None) -> tuple[Sequence[int], dict[str, bool]]:
    """Every check of :func:`collate_microbatch`; returns the sample index and the optional fields present."""
    if layout not in LAYOUTS:
        raise input_error(fn, "layout", f"one of {LAYOUTS}", repr(layout))
    check_positive_int(fn, "pad_to_multiple_of", pad_to_multiple_of)
    check_positive_int(fn, "max_seq_len", max_seq_len, allow_none=True)
    check_positive_int(fn, "vocab_size", vocab_size, allow_none=True)
    n = len(samples)
    if n == 0:
        raise input_error(fn, "samples", "a non-empty sequence of Sample", "an empty sequence")
    if sample_index is None:
        sample_index = range(n)
    elif len(sample_index) != n:
        raise input_error(fn, "sample_index", f"{n} indices (one per sample)", f"{len(sample_index)} indices")
    check_devices(fn, samples)
    if max_seq_len is not None:
        check_lengths(fn, samples, max_seq_len, f"at most max_seq_len={max_seq_len} tokens")
    check_token_ids(fn, samples, vocab_size)
    check_sample_values(fn, samples)
    present = check_same_fields(fn, samples)
    check_routed_experts(fn, samples)
    check_routing_rows(fn, samples)
    return sample_index, present


def check_routing_rows(fn: str, samples: Sequence[Sample], *, arg: str = "samples") -> None:
    """Every sample's ``routed_experts`` has ``len(sample)`` or ``len(sample) - 1`` rows: one per
    token of the sequence being collated (shapes only, no host sync). :class:`Sample` checks this
    when it is built, except on a sample with multi-modal items, whose rows may be those of the
    sequence with its items expanded (:class:`fnppo.megatron.vlm.VLMCollate` expands both).

    Raises:
        InputError: naming ``<arg>[i].routed_experts``, the row counts expected and its shape.
    """
    for i, s in enumerate(samples):
        t = s.routed_experts
        if t is not None and t.shape[0] not in (len(s), len(s) - 1):
            raise input_error(fn, f"{arg}[{i}].routed_experts",
                              f"{len(s)} or {len(s) - 1} rows (one per token collated; routes of a sequence whose multi-modal "
                              "items take several positions need the collate stage that expands them, e.g. fnppo.VLMCollate)",
                              describe(t))




def _collate_fields(samples: list[Sample], seg_lens: list[int], layout: str, pad_token_id: int,
                    present: dict[str, bool]) -> dict[str, Tensor | None]:
    """Every per-token field of the micro-batch, built for all samples at once.

    Sample ``i`` occupies ``seg_lens[i]`` positions from ``start_i`` of the flat output (packed:
    ``cumsum`` of the segment lengths; padded: row ``i`` of ``[n, max seg_lens]``); its tokens go to
    ``start_i + t`` and its response values to ``start_i + P_i - 1 + j`` (see the alignment in
    :func:`collate_microbatch`), by one scatter per field. Absent optional fields are None.
    """
    device = samples[0].prompt_ids.device
    i64, f32 = torch.int64, torch.float32
    n = len(samples)
    plen = torch.tensor([s.prompt_len for s in samples], dtype=i64)
    rlen = torch.tensor([s.response_len for s in samples], dtype=i64)
    tlen = plen + rlen
    width = max(seg_lens) if layout == "padded" else sum(seg_lens)
    rows = n if layout == "padded" else 1
    starts = torch.arange(n, dtype=i64) * width if layout == "padded" else torch.tensor([0, *seg_lens[:-1]], dtype=i64).cumsum(0)

    def runs(lengths: Tensor, offsets: Tensor) -> tuple[Tensor, Tensor]:
        """For each sample's run of ``lengths[i]`` items: flat destinations ``offsets[i] + j`` and ``j``."""
        total = int(lengths.sum())
        within = torch.arange(total, dtype=i64) - (lengths.cumsum(0) - lengths).repeat_interleave(lengths)
        return offsets.repeat_interleave(lengths) + within, within

    dest, within = runs(tlen, starts)
    rdest, _ = runs(rlen, starts + plen - 1)
    dest_d, rdest_d = dest.to(device), rdest.to(device)
    z = torch.cat([t.to(i64) for s in samples for t in (s.prompt_ids, s.response_ids)])
    size = rows * width
    out: dict[str, Tensor | None] = {}
    out["input_ids"] = torch.full((size,), pad_token_id, dtype=i64, device=device).index_put_((dest_d,), z)
    not_last = (within < (tlen - 1).repeat_interleave(tlen)).nonzero().squeeze(1)
    labels = torch.zeros(size, dtype=i64, device=device)
    out["labels"] = labels.index_put_((dest[not_last].to(device),), z[(not_last + 1).to(device)])
    out["position_ids"] = torch.zeros(size, dtype=i64, device=device).index_put_((dest_d,), within.to(device))
    seq = torch.arange(n, dtype=i64).repeat_interleave(tlen).to(device)
    out["seq_ids"] = torch.full((size,), -1, dtype=i64, device=device).index_put_((dest_d,), seq)

    def place(values: list[Tensor]) -> Tensor:
        flat = torch.zeros(size, dtype=f32, device=device)
        return flat.index_put_((rdest_d,), torch.cat(values)) if values else flat

    ones = torch.ones(int(rlen.max()) if n else 0, dtype=f32, device=device)
    out["loss_mask"] = place([ones[: s.response_len] if s.response_mask is None else s.response_mask.to(f32) for s in samples])
    for name in _PER_TOKEN_FLOAT:
        if name in present and not present[name]:
            out[name] = None
            continue
        out[name] = place([torch.zeros(s.response_len, dtype=f32, device=device) if getattr(s, name) is None
                           else getattr(s, name).to(f32) for s in samples])
    return {k: (None if v is None else v.view(rows, width)) for k, v in out.items()}


def routing_fill(rows: int, layers: int, topk: int, *, device: Any = None) -> Tensor:
    """The route of a position without one (padding, a missing last token): ``-1``, int32
    ``[rows, layers, topk]``; routing replay lets the router choose there (:mod:`fnppo.megatron.routing`)."""
    return torch.full((rows, layers, topk), -1, dtype=torch.int32, device=device)


def _collate_routing(samples: list[Sample], seg_lens: list[int], layout: str) -> Tensor:
    """``routed_experts`` per position, int32: packed ``[1, T, L, k]``, padded ``[n, S, L, k]``.

    Sample ``i``'s rows fill positions ``0 .. len(rows) - 1`` of its segment (the token at each
    position); the rest of the segment (a missing last row, padding) gets :func:`routing_fill` (-1).
    """
    _, layers, topk = samples[0].routed_experts.shape
    width = max(seg_lens) if layout == "padded" else 0
    rows = []
    for s, seg in zip(samples, seg_lens, strict=True):
        own = s.routed_experts.to(torch.int32)
        size = max(seg, width)
        rows.append(torch.cat([own, routing_fill(size - own.shape[0], layers, topk, device=own.device)]))
    return torch.cat(rows).unsqueeze(0) if layout == "packed" else torch.stack(rows)


def _layout_fields(layout: str, seq_ids: Tensor, seg_lens: list[int], device: torch.device) -> dict[str, Any]:
    """``attention_mask`` (padded), ``cu_seqlens`` and ``max_seqlen`` (packed) of a micro-batch."""
    if layout == "packed":
        cu = torch.tensor([0, *seg_lens], dtype=torch.int64, device=device).cumsum(0).to(torch.int32)
        return {"attention_mask": None, "cu_seqlens": cu, "max_seqlen": max(seg_lens)}
    return {"attention_mask": seq_ids >= 0, "cu_seqlens": None, "max_seqlen": None}


def _collate_multi_modal(fn: str, samples: list[Sample], device: torch.device) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """Union of keys; per key, items concatenated on dim 0 in sample order, plus per-sample counts."""
    keys = sorted({k for s in samples for k in s.multi_modal})
    mm: dict[str, Tensor] = {}
    counts: dict[str, Tensor] = {}
    for key in keys:
        parts: list[Tensor] = []
        first: tuple[int, Tensor] | None = None
        per_sample: list[int] = []
        for i, s in enumerate(samples):
            t = s.multi_modal.get(key)
            if t is None:
                per_sample.append(0)
                continue
            if first is None:
                first = (i, t)
            else:
                j, t0 = first
                if t.shape[1:] != t0.shape[1:] or t.dtype != t0.dtype or t.device != t0.device:
                    raise input_error(
                        fn, f"samples[{i}].multi_modal[{key!r}]",
                        f"items like samples[{j}]'s: trailing shape {tuple(t0.shape[1:])}, {t0.dtype}, on {t0.device}",
                        f"{describe(t)} on {t.device}",
                    )
            parts.append(t)
            per_sample.append(int(t.shape[0]))
        mm[key] = torch.cat(parts, dim=0)  # parts is non-empty: key came from some sample
        counts[key] = torch.tensor(per_sample, dtype=torch.int64, device=device)
    return mm, counts


# ---------------------------------------------------------------------------------------------
# unpack_per_sample
# ---------------------------------------------------------------------------------------------
@typechecked
def unpack_per_sample(values: Shaped[Tensor, "batch seq"], mb: Microbatch) -> list[Tensor]:
    """Per-response-token values of every sample: the inverse of :func:`collate_microbatch`'s placement.

    ``out[i] = values[row_i, off_i + P_i - 1 : off_i + P_i - 1 + R_i]`` (length ``R_i``), where
    padded: ``row_i = i, off_i = 0``; packed: ``row_i = 0, off_i = cu_seqlens[i]``. Slices are views
    (autograd flows through them). Uses only the static lengths of ``mb`` (no device sync).

    Args:
        values: a per-position tensor of the shape of ``mb.input_ids`` (log-probs, entropies, ...).
        mb: the micro-batch it belongs to.

    Returns:
        One tensor per sample, of its response length, in the order of the micro-batch.

    Raises:
        ShapeError: ``values`` of another shape than ``mb.input_ids``.
    """
    if tuple(values.shape) != tuple(mb.input_ids.shape):
        raise ShapeError(
            f"fnppo.core.batch.unpack_per_sample: argument 'values' expected shape {tuple(mb.input_ids.shape)} "
            f"(that of mb.input_ids), received {describe(values)}"
        )
    out: list[Tensor] = []
    offset = 0
    for i, (p, r, seg) in enumerate(zip(mb.prompt_lens, mb.response_lens, mb.segment_lens, strict=True)):
        if mb.is_packed:
            out.append(values[0, offset + p - 1 : offset + p - 1 + r])
            offset += seg
        else:
            out.append(values[i, p - 1 : p - 1 + r])
    return out


def pad_microbatch(mb: Microbatch, length: int, *, pad_token_id: int = 0) -> Microbatch:
    """Pad a micro-batch along the sequence dimension to ``length`` tokens (pure).

    Packed layout: the extra tokens form one more segment at the end (its own document in the
    attention, ``seq_ids`` -1, ``loss_mask`` 0), so ``cu_seqlens`` gains an entry. Padded layout:
    columns are appended on the right (``attention_mask`` False). Real tokens, their positions and
    :func:`unpack_per_sample` are unchanged. Used to give every micro-batch of a step the same shape
    (e.g. for the interleaved pipeline schedule).

    Args:
        mb: the micro-batch.
        length: the new sequence length, ``>=`` the current one.
        pad_token_id: the token id of the padding.

    Returns:
        A new :class:`Microbatch` (``mb`` itself when it has that length already).

    Raises:
        InputError: ``length`` shorter than the micro-batch.
    """
    fn = "fnppo.pad_microbatch"
    cur = int(mb.input_ids.shape[1])
    if not isinstance(length, int) or length < cur:
        raise input_error(fn, "length", f"an int >= the current length {cur}", repr(length))
    extra = length - cur
    if extra == 0:
        return mb
    rows = int(mb.input_ids.shape[0])

    def pad(t: Tensor | None, value: float | int) -> Tensor | None:
        if t is None:
            return None
        return torch.cat([t, t.new_full((rows, extra), value)], dim=1)

    changes: dict[str, Any] = dict(
        input_ids=pad(mb.input_ids, pad_token_id),
        position_ids=pad(mb.position_ids, 0),
        labels=pad(mb.labels, 0),
        loss_mask=pad(mb.loss_mask, 0.0),
        old_logprobs=pad(mb.old_logprobs, 0.0),
        advantages=pad(mb.advantages, 0.0),
        ref_logprobs=pad(mb.ref_logprobs, 0.0),
        rollout_logprobs=pad(mb.rollout_logprobs, 0.0),
        values=pad(mb.values, 0.0),
        returns=pad(mb.returns, 0.0),
        seq_ids=pad(mb.seq_ids, -1),
        attention_mask=pad(mb.attention_mask, False),
    )
    if mb.routed_experts is not None:
        _, _, layers, topk = mb.routed_experts.shape
        fill = routing_fill(rows * extra, layers, topk, device=mb.routed_experts.device).reshape(rows, extra, layers, topk)
        changes["routed_experts"] = torch.cat([mb.routed_experts, fill], dim=1)
    if mb.cu_seqlens is not None:
        tail = mb.cu_seqlens.new_full((1,), length)
        changes["cu_seqlens"] = torch.cat([mb.cu_seqlens, tail])
        changes["max_seqlen"] = max(int(mb.max_seqlen or 0), extra)
    return dataclasses.replace(mb, **changes)


def to_device(mb: Microbatch, device: torch.device) -> Microbatch:
    """``mb`` with every tensor leaf moved to ``device`` (non-blocking; None stays None; CPU: ``mb`` itself)."""
    if device.type == "cpu":
        return mb
    return optree.tree_map(lambda x: x.to(device, non_blocking=True) if isinstance(x, torch.Tensor) else x, mb, none_is_leaf=False, namespace="fnppo")


def __getattr__(name: str) -> Any:
    """``SplitPlan`` and ``split_batch`` moved to :mod:`fnppo.core.split`; still importable from here."""
    if name in ("SplitPlan", "split_batch"):
        from fnppo.core import split

        return getattr(split, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
