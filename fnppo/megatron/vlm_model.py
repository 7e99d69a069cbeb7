"""A vision-language GPT on Megatron: ViT + projector + language model; images reach it through every layout.

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

The collate stage that expands each image placeholder into ``tokens_per_image`` positions (so every
per-token field is built on the sequence the model runs) is :mod:`fnppo.megatron.vlm_collate`.

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
expanded sequence, before any context-parallel split). The ViT and projector are dense: the expert
grid is the language model's only.

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
  :mod:`fnppo.megatron.packed_attention` provides for the causal case; a bidirectional and windowed mask is new).
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
from collections.abc import Mapping
from typing import Any

import torch
from megatron.core.models.vision import vit_layer_specs
from megatron.core.models.vision.clip_vit_model import CLIPViTModel
from megatron.core.models.vision.multimodal_projector import MultimodalProjector
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.mlp import MLPSubmodules
from megatron.core.transformer.module import Float16Module, MegatronModule
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from torch import nn

from fnppo.core.errors import describe, input_error
from fnppo.core.typing import Float, Int, Tensor, typechecked, typechecking_enabled
from fnppo.megatron.build import build_gpt
from fnppo.megatron.config import ModelConfig
from fnppo.megatron.layer_specs import local_layer_spec, te_available
from fnppo.megatron.megatron_config import transformer_config
from fnppo.megatron.parallel import ParallelLayout, current_layout
from fnppo.megatron.vlm_collate import VisionConfig, check_images

__all__ = ["VisionLanguageGPT", "build_vlm", "scatter_image_features", "vision_layer_spec"]


@typechecked
def scatter_image_features(
    embeddings: Float[Tensor, "seq batch hidden"],
    input_ids: Int[Tensor, "batch seq"],
    features: Float[Tensor, "n hidden"],
    image_token_id: int,
) -> Float[Tensor, "seq batch hidden"]:
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
            raise input_error(
                "fnppo.megatron.vlm_model.scatter_image_features",
                "features",
                f"{count} rows (one per placeholder position)",
                describe(features),
            )
    by_sample = embeddings.transpose(0, 1)  # [b, s, h]: masked_scatter fills in row-major order
    out = by_sample.masked_scatter(mask.unsqueeze(-1), features.to(embeddings.dtype))
    return out.transpose(0, 1).contiguous()


def vision_layer_spec() -> Any:
    """ViT layer spec with bidirectional attention (``no_mask``): TE's when installed, else local."""
    if te_available():
        return vit_layer_specs.get_vit_layer_with_transformer_engine_spec()
    spec = local_layer_spec(packed_attention=False, normalization="LayerNorm")
    attn = spec.submodules.self_attention
    attn = dataclasses.replace(attn, params={**attn.params, "attn_mask_type": AttnMaskType.no_mask})
    return dataclasses.replace(spec, submodules=dataclasses.replace(spec.submodules, self_attention=attn))


def _vision_configs(lm: Any, vision: VisionConfig, layout: ParallelLayout) -> tuple[Any, Any]:
    """Transformer configs of the ViT and of the projector (TP as the language model, no pipeline,
    no experts: an MoE language model's expert grid is not theirs)."""
    flat = dataclasses.replace(layout, pp=1, vpp=None, ep=1, etp=layout.tp)
    common = dict(
        normalization="LayerNorm",
        swiglu=False,
        add_bias_linear=True,
        add_qkv_bias=True,
        dtype=_dtype_name(lm.params_dtype),
        init_method_std=lm.init_method_std,
        vocab_size=layout.tp,
        max_seq_len=vision.tokens_per_image,
        layernorm_epsilon=1e-5,
    )
    vit = ModelConfig(
        num_layers=vision.num_layers,
        hidden_size=vision.hidden_size,
        num_attention_heads=vision.num_attention_heads,
        ffn_hidden_size=vision.ffn_hidden_size,
        **common,
    )
    proj = ModelConfig(
        num_layers=1,
        hidden_size=lm.hidden_size,
        num_attention_heads=layout.tp,
        ffn_hidden_size=vision.projector_hidden_size or lm.hidden_size,
        **common,
    )
    return transformer_config(vit, flat), transformer_config(proj, flat)


def _dtype_name(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]


class VisionLanguageGPT(MegatronModule):
    """ViT + projector + language ``GPTModel`` (see the module docstring); one pipeline chunk.

    Called like ``GPTModel`` (``input_ids, position_ids, attention_mask, packed_seq_params=``) plus
    ``multi_modal=`` / ``multi_modal_counts=`` (:attr:`takes_multi_modal`: what
    :func:`fnppo.megatron.forward.forward_logits` looks for). Attributes read by fnppo and Megatron
    (``config``, ``pre_process``, ``post_process``, ``vocab_size``, ``max_sequence_length``,
    ``share_embeddings_and_output_weights``) are the language model's.
    """

    takes_multi_modal = True

    def __init__(
        self, language_model: nn.Module, vision: VisionConfig, vit_config: Any = None, projector_config: Any = None
    ) -> None:
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
        v = self.vision
        self.vision_model = CLIPViTModel(
            vit_config,
            vision_layer_spec(),
            ln_pre_impl=WrappedTorchNorm,
            add_class_token=False,
            class_token_len=0,
            patch_dim=v.patch_size,
            img_h=v.image_size,
            img_w=v.image_size,
            model_subtype="clip",
        )
        self.vision_projection = MultimodalProjector(
            projector_config,
            MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear),
            "mlp",
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

    def forward(
        self,
        input_ids: Tensor,
        position_ids: Tensor,
        attention_mask: Tensor | None,
        decoder_input: Tensor | None = None,
        *,
        packed_seq_params: Any = None,
        multi_modal: Mapping[str, Tensor] | None = None,
        multi_modal_counts: Mapping[str, Tensor] | None = None,
        **kwargs: Any,
    ) -> Tensor:
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
            check_images(
                images,
                self.vision.image_shape,
                fn="fnppo.megatron.vlm_model.VisionLanguageGPT.forward",
                arg=f"multi_modal[{self.vision.image_key!r}]",
                values=False,
            )
            if images is not None and images.shape[0] > 0:
                emb = scatter_image_features(emb, input_ids, self.image_features(images), self.vision.image_token_id)
            elif typechecking_enabled() and bool((input_ids == self.vision.image_token_id).any()):
                raise input_error(
                    "fnppo.megatron.vlm_model.VisionLanguageGPT.forward",
                    "multi_modal",
                    f"images for the placeholder tokens {self.vision.image_token_id}",
                    "no images",
                )
            decoder_input = emb
        return self.language_model(
            input_ids,
            position_ids,
            attention_mask,
            decoder_input=decoder_input,
            packed_seq_params=packed_seq_params,
            **kwargs,
        )


def build_vlm(
    cfg: ModelConfig,
    vision: VisionConfig,
    *,
    layer_spec: Any = None,
    layout: ParallelLayout | None = None,
    **config_overrides: Any,
) -> list[nn.Module]:
    """Build this rank's chunks of a :class:`VisionLanguageGPT` (one per virtual pipeline stage).

    The language model is :func:`fnppo.megatron.build.build_gpt`'s ``GPTModel`` (``layer_spec`` as there:
    TE when installed, else the local spec with packed attention); the ViT and projector are built
    on the chunk that holds the embedding (first pipeline stage). Half precision wraps the whole
    chunk in ``Float16Module``. Returns chunks not yet wrapped by DDP (see :func:`fnppo.wrap_ddp`).

    Raises:
        InputError: ``image_token_id`` outside the vocabulary, sequence parallelism, context
            parallelism, TP > 1 with an MoE language model, and everything
            :func:`fnppo.megatron.megatron_config.transformer_config` refuses.
    """
    fn = "fnppo.vlm.build_vlm"
    if vision.image_token_id >= cfg.vocab_size:
        raise input_error(
            fn, "vision.image_token_id", f"a token id below vocab_size={cfg.vocab_size}", repr(vision.image_token_id)
        )
    if config_overrides.get("sequence_parallel") or dict(cfg.extra).get("sequence_parallel"):
        raise input_error(
            fn, "sequence_parallel", "False (image features are placed before any sequence-parallel scatter)", "True"
        )
    layout = layout or current_layout()
    if layout.cp > 1:
        raise input_error(
            fn,
            "layout",
            "cp=1 (image features are placed on the whole expanded sequence, before any "
            "context-parallel split; the ViT's attention has no context parallelism)",
            f"cp={layout.cp}",
        )
    if cfg.num_experts is not None and layout.tp > 1:
        # Megatron's MoE layer refuses to train under TP without sequence parallelism (above)
        raise input_error(
            fn,
            "layout",
            "tp=1 for a Mixture-of-Experts language model (Megatron trains MoE layers under "
            "tensor parallelism only with sequence parallelism, which a VLM does not take; use ep)",
            f"tp={layout.tp}",
        )
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
