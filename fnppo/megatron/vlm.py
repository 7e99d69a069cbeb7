"""A vision-language GPT on Megatron: images reach the model through every split and layout.

**What it is.** :class:`VisionLanguageGPT` composes the three Megatron modules that Megatron's own
``LLaVAModel`` composes: a ViT (``CLIPViTModel``: a patchifying convolution, learned position
embeddings, a pre-norm and a few ``TransformerBlock`` layers with bidirectional attention), a
``MultimodalProjector`` (a 2-layer MLP, column- then row-parallel) and the language ``GPTModel``.
The projected image features replace the embeddings of the image-placeholder tokens; everything
after the embedding is the language model's own forward (``decoder_input=``).

**Why not ``LLaVAModel`` itself** (megatron-core 0.16.1, ``models/multimodal/llava_model.py``):

* it expands each placeholder into the image's positions *inside* ``forward``
  (``_preprocess_data``), so the sequence the model runs differs from the micro-batch: fnppo's
  labels, loss mask, per-token values and ``cu_seqlens`` (built by the collate stage and read by
  the log-prob and loss stages) would no longer line up, and the expanded loss mask it returns
  (``(output, new_loss_mask)``, not logits) would have to replace the micro-batch's;
* its expansion assumes the padded ``[batch, seq]`` layout: a packed (THD) micro-batch ``[1, T]``
  would be read as one sequence, with ``cu_seqlens`` describing the unexpanded documents;
* a text-only micro-batch must still pass an image tensor (``images=None`` fails on
  ``images.dtype``), which is the empty-micro-batch bug fnppo exists to prevent;
* under pipeline parallelism it pads every micro-batch to ``language_max_sequence_length``, and
  with the local layer spec its ViT spec (``get_vit_layer_with_local_spec``) is causal.

**Where a placeholder becomes N positions: in the collate stage.** A prompt holds one placeholder
token (``image_token_id``) per image; :class:`VLMCollate` (a :class:`fnppo.steps.step.CollateFn`) replaces
each by ``tokens_per_image`` copies of it and then calls the unchanged
:func:`fnppo.core.batch.collate_microbatch`. Every per-token field (labels, loss mask, positions, old /
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

**Layouts.** Tensor parallelism: the ViT's attention and MLP and the projector are TP-sharded like
the language model; the patch convolution, position embeddings and norms are replicated (their
gradients are equal on the TP ranks, as for layer norms). Data parallelism: images follow their
samples; vision gradients are reduced with every other gradient (a rank whose micro-batches hold
no image contributes zeros). Pipeline parallelism: the ViT and projector live on the first stage
(the chunk with ``pre_process``; with a virtual pipeline, virtual stage 0 of pipeline rank 0);
the other stages only receive hidden states, whose shape is the expanded micro-batch's. Sequence
parallelism is refused (the placeholder scatter would have to happen before the scatter to
sequence-parallel regions; the CPU path has no sequence parallelism to test it against), and with
it tensor parallelism for a Mixture-of-Experts language model (Megatron trains MoE layers under TP
only with sequence parallelism); expert parallelism (``ep``) is the MoE VLM's model parallelism
besides the pipeline. Context parallelism is refused too (the features are placed on the whole
expanded sequence, before any context-parallel split). The ViT and projector are dense: the expert grid is the language model's only.

**Freezing.** ``VisionConfig.freeze_vision`` sets ``requires_grad=False`` on the ViT (the
projector still trains, as in LLaVA's second stage): Megatron's DDP and optimizer then hold no
buffer for it and it never changes.

**Hugging Face Qwen2-VL / Qwen2.5-VL weights (not done here; what it would take).**

* Vision: Qwen2-VL's ViT patchifies with a 3-D convolution (temporal patch 2, spatial 14) over a
  variable number of patches per image (dynamic resolution, ``image_grid_thw``), uses 2-D rotary
  position embeddings instead of learned ones, RMS/LayerNorm blocks with bias, and (Qwen2.5-VL)
  window attention in most layers with full attention in a few, plus SwiGLU MLPs. ``CLIPViTModel``
  has a fixed image size and learned positions, so a Qwen ViT needs its own Megatron module
  (``TransformerBlock`` with a packed/THD attention over the patches of each image, which
  :mod:`fnppo.megatron.attention` provides for the causal case; a bidirectional and windowed mask is new).
* Merger: the ``PatchMerger`` (2x2 spatial merge, LayerNorm, 2-layer MLP) maps to a reshape plus
  this projector; its weights map one to one.
* Tokens: ``tokens_per_image`` becomes per image (``t * h * w / 4`` from ``image_grid_thw``);
  :class:`VLMCollate` would read it per item instead of one constant. The HF processor already
  expands ``<|image_pad|>`` this way, so its ``input_ids`` could be used as collated.
* Positions: the language model uses M-RoPE (3-D rotary positions: temporal, height, width for
  image tokens, equal for text); Megatron 0.16's ``GPTModel`` has an ``mrope`` position embedding
  type taking ``[3, batch, seq]`` position ids, so the collate stage would build those instead of
  ``0..L-1``, and the packed (THD) path would need the per-document restart handled for M-RoPE.
* Names: the language model is Qwen2 (``fnppo.io.hf`` maps it today); the vision names
  (``visual.blocks.N.attn.qkv``, ``visual.merger.mlp``) need a second name map and the fused QKV
  split into Megatron's grouped layout, as done for the language model.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fnppo.core.batch import Microbatch, Sample, collate_microbatch
from fnppo.megatron.model import ModelConfig, transformer_config
from fnppo.megatron.parallel import ParallelLayout, current_layout
from fnppo.core.typing import (
    Bool, Float, Int, Integer, Tensor, check_bool_fields, describe, input_error, typechecked, typechecking_enabled,
)

__all__ = [
    "VisionConfig",
    "VLMCollate",
    "VisionLanguageGPT",
    "build_vlm",
    "check_images",
    "expand_image_placeholders",
    "expand_image_routes",
    "scatter_image_features",
    "vision_layer_spec",
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
            raise input_error(fn, "hidden_size", f"a multiple of num_attention_heads={self.num_attention_heads}", repr(self.hidden_size))

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


def check_images(images: Tensor | None, image_shape: tuple[int, ...] | None, *, fn: str, arg: str,
                 values: bool = True) -> None:
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
    if images.dim() != rank or not images.is_floating_point() or (
            image_shape is not None and tuple(images.shape[1:]) != tuple(image_shape)):
        hint = " (an image without its leading item dimension k?)" if images.dim() == rank - 1 else ""
        raise input_error(fn, arg, f"floating images {want}{hint}", describe(images))
    if values and images.numel() and not bool(torch.isfinite(images).all()):
        bad = ~torch.isfinite(images).flatten(1)
        first = int(bad.any(1).nonzero()[0, 0])
        raise input_error(fn, arg, "finite pixel values", f"{describe(images)} with {int(bad.sum())} NaN/inf pixels "
                          f"(the first in image {first})")


def expand_image_placeholders(sample: Sample, *, image_token_id: int, tokens_per_image: int, image_key: str = "images",
                              image_shape: tuple[int, ...] | None = None, fn: str = "fnppo.megatron.vlm.expand_image_placeholders",
                              arg: str = "sample") -> Sample:
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
    check_images(sample.multi_modal.get(image_key), image_shape, fn=fn, arg=f"{arg}.multi_modal[{image_key!r}]",
                 values=typechecking_enabled())
    k = _image_count(sample, image_key)
    prompt = sample.prompt_ids
    is_image = prompt == image_token_id
    count = int(is_image.sum())
    if count != k:
        raise input_error(fn, f"{arg}.prompt_ids", f"one image placeholder (token {image_token_id}) per image: {k}", f"{count} placeholders")
    if bool((sample.response_ids == image_token_id).any()):
        raise input_error(fn, f"{arg}.response_ids", f"no image placeholder (token {image_token_id}) in the response", "a placeholder")
    routes = sample.routed_experts
    if routes is not None:
        is_image_token = torch.cat([is_image, torch.zeros_like(sample.response_ids, dtype=torch.bool)])
        routes = expand_image_routes(routes, is_image_token, tokens_per_image, fn=fn, arg=f"{arg}.routed_experts")
    if k == 0 or tokens_per_image == 1:
        return sample
    repeats = torch.where(is_image, tokens_per_image, 1)
    return dataclasses.replace(sample, prompt_ids=prompt.repeat_interleave(repeats), routed_experts=routes)


@typechecked
def expand_image_routes(routes: Integer[Tensor, "rows layers topk"], is_image: Bool[Tensor, " tokens"], tokens_per_image: int, *,
                        fn: str = "fnppo.megatron.vlm.expand_image_routes", arg: str = "routes") -> Integer[Tensor, "expanded layers topk"]:
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
        raise input_error(fn, arg, f"{full} rows (one per position of the expanded sequence: {k} image(s) x {tokens_per_image} positions; "
                          f"{rows} rows are ambiguous: the expanded sequence without its last row, or the {n} tokens with the placeholders unexpanded)",
                          describe(routes))
    if not expanded and not unexpanded:
        other = f", or {n} or {n - 1} (one per token, a row of -1 at each placeholder)" if extra else ""
        raise input_error(fn, arg, f"{full} or {full - 1} rows (one per position of the expanded sequence: {k} image(s) x {tokens_per_image} "
                          f"positions){other}", describe(routes))
    if expanded:
        return routes
    placeholders = is_image[:rows].nonzero().squeeze(1).to(routes.device)
    set_rows = ~(routes[placeholders].to(torch.int64) == -1).flatten(1).all(1)
    if bool(set_rows.any()):
        t = int(placeholders[set_rows.nonzero()[0, 0]])
        raise input_error(fn, arg, f"a row of -1 at each image placeholder ({rows} rows: one per token of the unexpanded sequence, the "
                          f"{tokens_per_image} positions of an image left to the router)", f"experts {routes[t].tolist()} at placeholder token {t}")
    dtype = torch.promote_types(routes.dtype, torch.int16)  # signed: holds the -1 of the missing last row
    fill = torch.full((n - rows, *routes.shape[1:]), -1, dtype=dtype, device=routes.device)
    repeats = torch.where(is_image, tokens_per_image, 1).to(routes.device)
    return torch.cat([routes.to(dtype), fill]).repeat_interleave(repeats, dim=0)


@dataclass(frozen=True)
class VLMCollate:
    """The collate stage of a vision-language model (a :class:`fnppo.steps.step.CollateFn`).

    Each sample's placeholders are expanded (:func:`expand_image_placeholders`; its routed experts
    with them, :func:`expand_image_routes`), then :func:`fnppo.core.batch.collate_microbatch` builds the
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
        return expand_image_placeholders(sample, image_token_id=self.image_token_id, tokens_per_image=self.tokens_per_image,
                                         image_key=self.image_key, image_shape=self.image_shape, fn="fnppo.megatron.vlm.VLMCollate", arg=arg)

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
            expand_image_placeholders(s, image_token_id=self.image_token_id, tokens_per_image=self.tokens_per_image,
                                      image_key=self.image_key, image_shape=self.image_shape, fn=fn, arg=where)
            if own is not None:
                check_images(s.multi_modal.get(self.image_key), own, fn=fn,
                             arg=f"{where}.multi_modal[{self.image_key!r}]", values=False)

    def collated_length(self, sample: Sample) -> int:
        """Tokens the sample takes once collated: ``len(sample) + k * (tokens_per_image - 1)``."""
        return len(sample) + _image_count(sample, self.image_key) * (self.tokens_per_image - 1)

    def __call__(self, samples: Sequence[Sample], *, layout: str = "packed", pad_to_multiple_of: int = 1,
                 sample_index: Sequence[int] | None = None, pad_token_id: int = 0, vocab_size: int | None = None) -> Microbatch:
        expanded = [self.expand(s, arg=f"samples[{i}]") for i, s in enumerate(samples)]
        return collate_microbatch(expanded, layout=layout, pad_to_multiple_of=pad_to_multiple_of, pad_token_id=pad_token_id,
                                  max_seq_len=self.max_seq_len, vocab_size=vocab_size, sample_index=sample_index)


# ---------------------------------------------------------------------------------------------
# the model
# ---------------------------------------------------------------------------------------------
@typechecked
def scatter_image_features(embeddings: Float[Tensor, "seq batch hidden"], input_ids: Int[Tensor, "batch seq"],
                           features: Float[Tensor, "n hidden"], image_token_id: int) -> Float[Tensor, "seq batch hidden"]:
    """Image features written into the embedding sequence at the placeholder positions (out of place).

    ``out[s, b] = features[j]`` where ``(b, s)`` is the ``j``-th placeholder position in
    sample-major order (row ``b`` of ``input_ids`` before row ``b + 1``, left to right within a
    row; for a packed ``[1, T]`` micro-batch this is sample order), ``out[s, b] = embeddings[s, b]``
    elsewhere. Gradients flow to both inputs (none to the replaced embeddings). As LLaVA
    (arXiv:2304.08485) and Qwen2-VL's ``masked_scatter`` of image embeddings.

    Raises:
        InputError: the placeholder count differs from ``n`` (checked while call-time checking is
            on: one host sync).
    """
    mask = input_ids == image_token_id  # [b, s]
    if typechecking_enabled():
        count = int(mask.sum())
        if count != features.shape[0]:
            raise input_error("fnppo.megatron.vlm.scatter_image_features", "features", f"{count} rows (one per placeholder position)", describe(features))
    by_sample = embeddings.transpose(0, 1)  # [b, s, h]: masked_scatter fills in row-major order
    out = by_sample.masked_scatter(mask.unsqueeze(-1), features.to(embeddings.dtype))
    return out.transpose(0, 1).contiguous()


def vision_layer_spec() -> Any:
    """ViT layer spec with bidirectional attention (``no_mask``): TE's when installed, else local."""
    from megatron.core.transformer.enums import AttnMaskType

    from fnppo.megatron.attention import local_layer_spec, te_available

    if te_available():
        from megatron.core.models.vision.vit_layer_specs import get_vit_layer_with_transformer_engine_spec

        return get_vit_layer_with_transformer_engine_spec()
    spec = local_layer_spec(packed_attention=False, normalization="LayerNorm")
    attn = spec.submodules.self_attention
    attn = dataclasses.replace(attn, params={**attn.params, "attn_mask_type": AttnMaskType.no_mask})
    return dataclasses.replace(spec, submodules=dataclasses.replace(spec.submodules, self_attention=attn))


def _vision_configs(lm: Any, vision: VisionConfig, layout: ParallelLayout) -> tuple[Any, Any]:
    """Transformer configs of the ViT and of the projector (TP as the language model, no pipeline,
    no experts: an MoE language model's expert grid is not theirs)."""
    flat = dataclasses.replace(layout, pp=1, vpp=None, ep=1, etp=layout.tp)
    common = dict(normalization="LayerNorm", swiglu=False, add_bias_linear=True, add_qkv_bias=True, dtype=_dtype_name(lm.params_dtype),
                  init_method_std=lm.init_method_std, vocab_size=layout.tp, max_seq_len=vision.tokens_per_image, layernorm_epsilon=1e-5)
    vit = ModelConfig(num_layers=vision.num_layers, hidden_size=vision.hidden_size, num_attention_heads=vision.num_attention_heads,
                      ffn_hidden_size=vision.ffn_hidden_size, **common)
    proj = ModelConfig(num_layers=1, hidden_size=lm.hidden_size, num_attention_heads=layout.tp,
                       ffn_hidden_size=vision.projector_hidden_size or lm.hidden_size, **common)
    return transformer_config(vit, flat), transformer_config(proj, flat)


def _dtype_name(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]


def _megatron_module() -> type:
    from megatron.core.transformer.module import MegatronModule

    return MegatronModule


class VisionLanguageGPT(_megatron_module()):  # type: ignore[misc]
    """ViT + projector + language ``GPTModel`` (see the module docstring); one pipeline chunk.

    Called like ``GPTModel`` (``input_ids, position_ids, attention_mask, packed_seq_params=``) plus
    ``multi_modal=`` / ``multi_modal_counts=`` (:attr:`takes_multi_modal`: what
    :func:`fnppo.megatron.model.forward_logits` looks for). Attributes read by fnppo and Megatron
    (``config``, ``pre_process``, ``post_process``, ``vocab_size``, ``max_sequence_length``,
    ``share_embeddings_and_output_weights``) are the language model's.
    """

    takes_multi_modal = True

    def __init__(self, language_model: nn.Module, vision: VisionConfig, vit_config: Any = None, projector_config: Any = None) -> None:
        super().__init__(config=language_model.config)
        self.language_model = language_model
        self.vision = vision
        self.pre_process = language_model.pre_process
        self.post_process = language_model.post_process
        self.vocab_size = language_model.vocab_size
        self.max_sequence_length = language_model.max_sequence_length
        self.share_embeddings_and_output_weights = language_model.share_embeddings_and_output_weights
        self.model_type = language_model.model_type
        self.vision_model = None
        self.vision_projection = None
        if self.pre_process:
            self._build_vision(vit_config, projector_config)

    def _build_vision(self, vit_config: Any, projector_config: Any) -> None:
        from megatron.core.models.vision.clip_vit_model import CLIPViTModel
        from megatron.core.models.vision.multimodal_projector import MultimodalProjector
        from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
        from megatron.core.transformer.mlp import MLPSubmodules
        from megatron.core.transformer.torch_norm import WrappedTorchNorm

        v = self.vision
        self.vision_model = CLIPViTModel(
            vit_config, vision_layer_spec(), ln_pre_impl=WrappedTorchNorm, add_class_token=False, class_token_len=0,
            patch_dim=v.patch_size, img_h=v.image_size, img_w=v.image_size, model_subtype="clip",
        )
        self.vision_projection = MultimodalProjector(
            projector_config, MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear), "mlp",
            input_size=v.hidden_size,
        )
        if v.freeze_vision:
            for p in self.vision_model.parameters():
                p.requires_grad = False

    def set_input_tensor(self, input_tensor: Any) -> None:
        self.language_model.set_input_tensor(input_tensor)

    def shared_embedding_or_output_weight(self) -> Tensor:
        return self.language_model.shared_embedding_or_output_weight()

    def image_features(self, images: Tensor) -> Tensor:
        """``[k, 3, H, W]`` images -> ``[k * tokens_per_image, hidden]`` language-model inputs."""
        dtype = self.vision_model.conv1.weight.dtype
        tokens = self.vision_model(images.to(dtype))  # [k, N, h_vision]
        projected = self.vision_projection(tokens)  # [k, N, h]
        return projected.reshape(-1, projected.shape[-1])

    def forward(self, input_ids: Tensor, position_ids: Tensor, attention_mask: Tensor | None, decoder_input: Tensor | None = None,
                *, packed_seq_params: Any = None, multi_modal: Mapping[str, Tensor] | None = None,
                multi_modal_counts: Mapping[str, Tensor] | None = None, **kwargs: Any) -> Tensor:
        """Logits (last stage) or hidden states; images enter on the first stage only.

        Raises:
            InputError: ``multi_modal[image_key]`` that is not ``[k, *VisionConfig.image_shape]``
                floating (e.g. 1-channel images for this 3-channel model, from a collate stage built
                without ``image_shape``), named with both shapes before the vision tower runs; image
                placeholders without images (while call-time checking is on).
        """
        if self.pre_process and decoder_input is None:
            emb = self.language_model.embedding(input_ids=input_ids, position_ids=position_ids)
            images = (multi_modal or {}).get(self.vision.image_key)
            # the model's own image shape, checked before the ViT sees the images (no host sync)
            check_images(images, self.vision.image_shape, fn="fnppo.megatron.vlm.VisionLanguageGPT.forward",
                         arg=f"multi_modal[{self.vision.image_key!r}]", values=False)
            if images is not None and images.shape[0] > 0:
                emb = scatter_image_features(emb, input_ids, self.image_features(images), self.vision.image_token_id)
            elif typechecking_enabled() and bool((input_ids == self.vision.image_token_id).any()):
                raise input_error("fnppo.megatron.vlm.VisionLanguageGPT.forward", "multi_modal", f"images for the placeholder tokens {self.vision.image_token_id}", "no images")
            decoder_input = emb
        return self.language_model(input_ids, position_ids, attention_mask, decoder_input=decoder_input,
                                   packed_seq_params=packed_seq_params, **kwargs)


def build_vlm(cfg: ModelConfig, vision: VisionConfig, *, layer_spec: Any = None, layout: ParallelLayout | None = None,
              **config_overrides: Any) -> list[nn.Module]:
    """Build this rank's chunks of a :class:`VisionLanguageGPT` (one per virtual pipeline stage).

    The language model is :func:`fnppo.megatron.model.build_gpt`'s ``GPTModel`` (``layer_spec`` as there:
    TE when installed, else the local spec with packed attention); the ViT and projector are built
    on the chunk that holds the embedding (first pipeline stage). Half precision wraps the whole
    chunk in ``Float16Module``. Returns chunks not yet wrapped by DDP (see :func:`fnppo.wrap_ddp`).

    Raises:
        InputError: ``image_token_id`` outside the vocabulary, sequence parallelism, context
            parallelism, TP > 1 with an MoE language model, and everything
            :func:`fnppo.megatron.model.transformer_config` refuses.
    """
    from megatron.core.transformer.module import Float16Module

    from fnppo.megatron.model import build_gpt

    fn = "fnppo.build_vlm"
    if vision.image_token_id >= cfg.vocab_size:
        raise input_error(fn, "vision.image_token_id", f"a token id below vocab_size={cfg.vocab_size}", repr(vision.image_token_id))
    if config_overrides.get("sequence_parallel") or dict(cfg.extra).get("sequence_parallel"):
        raise input_error(fn, "sequence_parallel", "False (image features are placed before any sequence-parallel scatter)", "True")
    layout = layout or current_layout()
    if layout.cp > 1:
        raise input_error(fn, "layout", "cp=1 (image features are placed on the whole expanded sequence, before any "
                          "context-parallel split; the ViT's attention has no context parallelism)", f"cp={layout.cp}")
    if cfg.num_experts is not None and layout.tp > 1:
        # Megatron's MoE layer refuses to train under TP without sequence parallelism (above)
        raise input_error(fn, "layout", "tp=1 for a Mixture-of-Experts language model (Megatron trains MoE layers under "
                          "tensor parallelism only with sequence parallelism, which a VLM does not take; use ep)",
                          f"tp={layout.tp}")
    chunks = []
    for chunk in build_gpt(cfg, layer_spec=layer_spec, layout=layout, **config_overrides):
        lm = chunk.module if isinstance(chunk, Float16Module) else chunk
        vit_cfg, proj_cfg = _vision_configs(lm.config, vision, layout) if lm.pre_process else (None, None)
        vlm = VisionLanguageGPT(lm, vision, vit_cfg, proj_cfg)
        if isinstance(chunk, Float16Module):
            vlm = Float16Module(lm.config, vlm)
        if torch.cuda.is_available() and layout.backend == "nccl":
            vlm = vlm.cuda(torch.cuda.current_device())
        chunks.append(vlm)
    return chunks
