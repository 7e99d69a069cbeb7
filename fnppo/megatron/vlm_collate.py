"""The collate stage of a vision-language model: image placeholders expanded before collation (pure torch).

**Where a placeholder becomes N positions: in the collate stage.** A prompt holds one placeholder
token (``image_token_id``) per image; :class:`VLMCollate` (a :class:`fnppo.steps.protocols.CollateFn`) replaces
each by ``tokens_per_image`` copies of it and then calls the unchanged
:func:`fnppo.core.batching.collate.collate_microbatch`. Every per-token field (labels, loss mask, positions, old /
reference log-probs, ``cu_seqlens``, ``seq_ids``) is therefore built on the expanded sequence and
no other stage knows about images; responses are untouched, so results per response token
(:func:`fnppo.compute_logprobs`) are unchanged. The split counts expanded lengths
(``VLMCollate.collated_length``), so a token budget is a hard cap on the collated micro-batch.
Images travel with their sample (``Sample.multi_modal["images"]``, ``[k, 3, H, W]``, ``k >= 0``);
a micro-batch without any image has no ``"images"`` key and never runs the vision encoder.

**Routing replay on an MoE language model.** An inference engine records the experts of the
sequence it ran, each image ``tokens_per_image`` positions; so does :func:`fnppo.compute_logprobs`
with ``return_routing=True`` under :class:`VLMCollate`. Such rows go on the sample as it is (one
placeholder per image) as ``Sample.routed_experts`` and the collate stage keeps them aligned with
the expanded tokens; rows of the unexpanded tokens with ``-1`` at each placeholder are accepted too
(the image positions are then left to the router), and a row count that fits both readings, or
neither, is refused (:func:`expand_image_routes`). Replaying a record reproduces its log-probs bit
for bit (``tests/test_vlm.py``).

:class:`VisionConfig` describes the vision side (image shape, tokens per image, the ViT's sizes);
the model itself is :mod:`fnppo.megatron.vlm_model`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from fnppo.core.batching.collate import collate_microbatch
from fnppo.core.batching.sample import Microbatch, Sample
from fnppo.core.errors import check_bool_fields, describe, input_error
from fnppo.core.typing import Bool, Integer, Tensor, typechecked, typechecking_enabled

__all__ = [
    "VisionConfig",
    "VLMCollate",
    "check_images",
    "expand_image_placeholders",
    "expand_image_routes",
]


@dataclass(frozen=True)
class VisionConfig:
    """The vision side of a :class:`VisionLanguageGPT`: a small ViT and its projector.

    Images are ``[3, image_size, image_size]``; each becomes ``(image_size / patch_size) ** 2``
    language-model positions (:attr:`tokens_per_image`). ``image_token_id`` is the placeholder
    token of the language vocabulary; ``image_key`` the ``Sample.multi_modal`` key of the images.
    """

    image_token_id: int
    image_size: int = 12
    patch_size: int = 4
    num_layers: int = 1
    hidden_size: int = 32
    num_attention_heads: int = 2
    ffn_hidden_size: int = 64
    projector_hidden_size: int | None = None
    freeze_vision: bool = False
    image_key: str = "images"

    def __post_init__(self) -> None:
        fn = "VisionConfig"
        check_bool_fields(fn, self)
        for name in ("image_size", "patch_size", "num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise input_error(fn, name, "an int >= 1", repr(v))
        if not isinstance(self.image_token_id, int) or self.image_token_id < 0:
            raise input_error(fn, "image_token_id", "a token id >= 0", repr(self.image_token_id))
        if self.image_size % self.patch_size:
            raise input_error(fn, "image_size", f"a multiple of patch_size={self.patch_size}", repr(self.image_size))
        if self.hidden_size % self.num_attention_heads:
            raise input_error(
                fn,
                "hidden_size",
                f"a multiple of num_attention_heads={self.num_attention_heads}",
                repr(self.hidden_size),
            )

    @property
    def tokens_per_image(self) -> int:
        """Language-model positions per image: the number of patches."""
        return (self.image_size // self.patch_size) ** 2

    @property
    def image_shape(self) -> tuple[int, int, int]:
        return (3, self.image_size, self.image_size)


# ---------------------------------------------------------------------------------------------
# the collate stage: placeholders expanded before any per-token field is built
# ---------------------------------------------------------------------------------------------
def _image_count(sample: Sample, image_key: str) -> int:
    t = sample.multi_modal.get(image_key)
    return 0 if t is None else int(t.shape[0])


def check_images(
    images: Tensor | None, image_shape: tuple[int, ...] | None, *, fn: str, arg: str, values: bool = True
) -> None:
    """Images ``[k, C, H, W]`` as a vision tower takes them: floating, 4-D, trailing shape ``image_shape``
    when given, and (``values``) finite.

    The shape is checked before anything counts items: an image without its leading item dimension
    (``[C, H, W]``) would otherwise be read as ``C`` images. The finiteness check reads every pixel
    (one host sync for device tensors); callers run it while call-time checking is on
    (:func:`fnppo.core.typing.typechecking_enabled`).

    Raises:
        InputError: naming ``arg``: a tensor that is not floating, not 4-D, of another trailing
            shape than ``image_shape``, or (``values``) with NaN/inf pixels (their count and the first
            offending image).
    """
    if images is None:
        return
    want = "[k, C, H, W]" if image_shape is None else f"[k, {', '.join(map(str, image_shape))}]"
    rank = 4 if image_shape is None else 1 + len(image_shape)
    if (
        images.dim() != rank
        or not images.is_floating_point()
        or (image_shape is not None and tuple(images.shape[1:]) != tuple(image_shape))
    ):
        hint = " (an image without its leading item dimension k?)" if images.dim() == rank - 1 else ""
        raise input_error(fn, arg, f"floating images {want}{hint}", describe(images))
    if values and images.numel() and not bool(torch.isfinite(images).all()):
        bad = ~torch.isfinite(images).flatten(1)
        first = int(bad.any(1).nonzero()[0, 0])
        raise input_error(
            fn,
            arg,
            "finite pixel values",
            f"{describe(images)} with {int(bad.sum())} NaN/inf pixels (the first in image {first})",
        )


def expand_image_placeholders(
    sample: Sample,
    *,
    image_token_id: int,
    tokens_per_image: int,
    image_key: str = "images",
    image_shape: tuple[int, ...] | None = None,
    fn: str = "fnppo.megatron.vlm_collate.expand_image_placeholders",
    arg: str = "sample",
) -> Sample:
    """The sample with each image placeholder of its prompt repeated ``tokens_per_image`` times (pure).

    With ``x`` the prompt and ``N = tokens_per_image``: ``x' = concat_t (N copies of x_t if x_t is
    the placeholder else [x_t])``. The response and every per-response-token value are unchanged
    (placeholders may only stand in the prompt). The prompt must hold exactly one placeholder per
    image of ``sample.multi_modal[image_key]`` (dim 0; no key: zero images). The layout follows
    LLaVA (arXiv:2304.08485): image features take the placeholder's place in the sequence.

    Routed experts (routing replay, :mod:`fnppo.megatron.routing`) come out with one row per position of the
    expanded sequence ``z' = x' ++ y`` (``L' = L + k (N - 1)`` for ``L = len(sample)`` and ``k``
    images); :func:`expand_image_routes` says which rows a sample may carry and how they expand.

    Raises:
        InputError: images that are not ``[k, C, H, W]`` floating tensors (checked first, so an image
            without its leading item dimension is named as such), whose trailing shape is not
            ``image_shape``, or (while call-time checking is on: :func:`check_images`) with NaN/inf
            pixels; a placeholder count that differs from the image count, a placeholder in the
            response, routed experts that fit neither the expanded nor the unexpanded sequence, or
            both (see :func:`expand_image_routes`).
    """
    check_images(
        sample.multi_modal.get(image_key),
        image_shape,
        fn=fn,
        arg=f"{arg}.multi_modal[{image_key!r}]",
        values=typechecking_enabled(),
    )
    k = _image_count(sample, image_key)
    prompt = sample.prompt_ids
    is_image = prompt == image_token_id
    count = int(is_image.sum())
    if count != k:
        raise input_error(
            fn,
            f"{arg}.prompt_ids",
            f"one image placeholder (token {image_token_id}) per image: {k}",
            f"{count} placeholders",
        )
    if bool((sample.response_ids == image_token_id).any()):
        raise input_error(
            fn, f"{arg}.response_ids", f"no image placeholder (token {image_token_id}) in the response", "a placeholder"
        )
    routes = sample.routed_experts
    if routes is not None:
        is_image_token = torch.cat([is_image, torch.zeros_like(sample.response_ids, dtype=torch.bool)])
        routes = expand_image_routes(routes, is_image_token, tokens_per_image, fn=fn, arg=f"{arg}.routed_experts")
    if k == 0 or tokens_per_image == 1:
        return sample
    repeats = torch.where(is_image, tokens_per_image, 1)
    return dataclasses.replace(sample, prompt_ids=prompt.repeat_interleave(repeats), routed_experts=routes)


@typechecked
def expand_image_routes(
    routes: Integer[Tensor, "rows layers topk"],
    is_image: Bool[Tensor, " tokens"],
    tokens_per_image: int,
    *,
    fn: str = "fnppo.megatron.vlm_collate.expand_image_routes",
    arg: str = "routes",
) -> Integer[Tensor, "expanded layers topk"]:
    """A VLM sample's routed experts, one row per position of its expanded sequence (pure).

    ``is_image[t]`` marks the image placeholders among the ``L`` tokens ``z = prompt ++ response``;
    with ``k`` placeholders and ``N = tokens_per_image`` the model runs ``L' = L + k (N - 1)``
    positions (each image takes ``N``). An inference engine (vLLM, SGLang) records routes for that
    sequence, and so does :func:`fnppo.compute_logprobs` (``return_routing=True``) under
    :class:`VLMCollate`. ``routes`` (``R``, ``r`` rows) may be:

    * **expanded**: ``r = L'`` or ``L' - 1`` (no row for the last token): row ``t`` is position ``t``
      of the expanded sequence; returned as is (``R' = R``);
    * **unexpanded**: ``r = L`` or ``L - 1``, the row of every placeholder ``-1`` in each entry (the
      image has no recorded route): ``R' = repeat_interleave(R_pad, where(is_image, N, 1))`` with
      ``R_pad`` the rows padded to ``L`` with ``-1`` rows, so every image position (and the missing
      last token) is left to the router, and every text token keeps its own row;

    ``-1`` rows are routed by the router itself (:mod:`fnppo.megatron.routing`), so only the expanded form
    replays the rollout's experts at the image positions. With ``k (N - 1) = 0`` both forms are the
    sequence itself. Row counts that fit both forms (``k (N - 1) = 1``, ``r = L = L' - 1``) are
    refused: the rows could be shifted by one against the tokens. Layout as LLaVA
    (arXiv:2304.08485): an image's positions stand where its placeholder stood; routing replay as
    Rollout Routing Replay (arXiv:2510.11370).

    Raises:
        InputError: naming ``arg``: a row count that fits neither form (expected ``L'`` or
            ``L' - 1``, or ``L`` or ``L - 1`` with ``-1`` placeholder rows), one that fits both, an
            unexpanded form whose placeholder rows are not ``-1`` (one host sync).
    """
    n = int(is_image.shape[0])
    k = int(is_image.sum())
    extra = k * (tokens_per_image - 1)
    full, rows = n + extra, int(routes.shape[0])
    expanded = rows in (full, full - 1)
    unexpanded = extra > 0 and rows in (n, n - 1)
    if expanded and unexpanded:
        raise input_error(
            fn,
            arg,
            f"{full} rows (one per position of the expanded sequence: {k} image(s) x {tokens_per_image} positions; "
            f"{rows} rows are ambiguous: the expanded sequence without its last row, or the {n} tokens "
            "with the placeholders unexpanded)",
            describe(routes),
        )
    if not expanded and not unexpanded:
        other = f", or {n} or {n - 1} (one per token, a row of -1 at each placeholder)" if extra else ""
        raise input_error(
            fn,
            arg,
            f"{full} or {full - 1} rows (one per position of the expanded sequence: {k} image(s) x {tokens_per_image} "
            f"positions){other}",
            describe(routes),
        )
    if expanded:
        return routes
    placeholders = is_image[:rows].nonzero().squeeze(1).to(routes.device)
    set_rows = ~(routes[placeholders].to(torch.int64) == -1).flatten(1).all(1)
    if bool(set_rows.any()):
        t = int(placeholders[set_rows.nonzero()[0, 0]])
        raise input_error(
            fn,
            arg,
            f"a row of -1 at each image placeholder ({rows} rows: one per token of the unexpanded sequence, the "
            f"{tokens_per_image} positions of an image left to the router)",
            f"experts {routes[t].tolist()} at placeholder token {t}",
        )
    dtype = torch.promote_types(routes.dtype, torch.int16)  # signed: holds the -1 of the missing last row
    fill = torch.full((n - rows, *routes.shape[1:]), -1, dtype=dtype, device=routes.device)
    repeats = torch.where(is_image, tokens_per_image, 1).to(routes.device)
    return torch.cat([routes.to(dtype), fill]).repeat_interleave(repeats, dim=0)


@dataclass(frozen=True)
class VLMCollate:
    """The collate stage of a vision-language model (a :class:`fnppo.steps.protocols.CollateFn`).

    Each sample's placeholders are expanded (:func:`expand_image_placeholders`; its routed experts
    with them, :func:`expand_image_routes`), then :func:`fnppo.core.batching.collate.collate_microbatch` builds the
    micro-batch on the expanded sequences, with ``max_seq_len`` checked on the expanded length. Use
    ``StepConfig(fns=StepFns(collate=...))``.

    Each sample's images are checked before its placeholders are counted (:func:`check_images`):
    ``[k, *image_shape]`` floating (``image_shape=None``: any ``[k, C, H, W]``; the model then checks
    its own image shape in :meth:`VisionLanguageGPT.forward`), and finite while call-time checking
    is on. Errors name ``samples[i]`` (the position in the samples this stage was called with) and
    the key, e.g. ``samples[3].multi_modal['images']``.
    """

    image_token_id: int
    tokens_per_image: int
    image_key: str = "images"
    image_shape: tuple[int, ...] | None = None
    max_seq_len: int | None = None

    @classmethod
    def from_config(cls, vision: VisionConfig, *, max_seq_len: int | None = None) -> VLMCollate:
        """The collate stage matching ``vision`` (and the language model's ``max_seq_len``)."""
        return cls(vision.image_token_id, vision.tokens_per_image, vision.image_key, vision.image_shape, max_seq_len)

    def expand(self, sample: Sample, *, arg: str = "sample") -> Sample:
        return expand_image_placeholders(
            sample,
            image_token_id=self.image_token_id,
            tokens_per_image=self.tokens_per_image,
            image_key=self.image_key,
            image_shape=self.image_shape,
            fn="fnppo.megatron.vlm_collate.VLMCollate",
            arg=arg,
        )

    def check_batch(self, fn: str, samples: Sequence[Sample], *, arg: str = "batch", model: Any = None) -> None:
        """The step's entry check of this stage's inputs (:func:`fnppo.train_step` and the other steps
        call it on the caller's whole batch before anything runs): every sample's images
        (:func:`check_images`, against ``image_shape`` and the image shape of ``model``, a
        :class:`VisionLanguageGPT`, when given) and placeholders, as :meth:`__call__` would expand
        them, naming ``{arg}[i]``.

        Raises:
            InputError: as :func:`expand_image_placeholders`, naming ``fn`` and ``{arg}[i]``.
        """
        vision = getattr(model, "vision", None)
        own = None if vision is None else vision.image_shape
        for i, s in enumerate(samples):
            where = f"{arg}[{i}]"
            expand_image_placeholders(
                s,
                image_token_id=self.image_token_id,
                tokens_per_image=self.tokens_per_image,
                image_key=self.image_key,
                image_shape=self.image_shape,
                fn=fn,
                arg=where,
            )
            if own is not None:
                check_images(
                    s.multi_modal.get(self.image_key),
                    own,
                    fn=fn,
                    arg=f"{where}.multi_modal[{self.image_key!r}]",
                    values=False,
                )

    def collated_length(self, sample: Sample) -> int:
        """Tokens the sample takes once collated: ``len(sample) + k * (tokens_per_image - 1)``."""
        return len(sample) + _image_count(sample, self.image_key) * (self.tokens_per_image - 1)

    def __call__(
        self,
        samples: Sequence[Sample],
        *,
        layout: str = "packed",
        pad_to_multiple_of: int = 1,
        sample_index: Sequence[int] | None = None,
        pad_token_id: int = 0,
        vocab_size: int | None = None,
    ) -> Microbatch:
        expanded = [self.expand(s, arg=f"samples[{i}]") for i, s in enumerate(samples)]
        return collate_microbatch(
            expanded,
            layout=layout,
            pad_to_multiple_of=pad_to_multiple_of,
            pad_token_id=pad_token_id,
            max_seq_len=self.max_seq_len,
            vocab_size=vocab_size,
            sample_index=sample_index,
        )
