"""FP8 blockwise weights in the layout of DeepSeek-V3's and Qwen3's FP8 checkpoints, which
``transformers``' fine-grained FP8 loader (``quant_method: fp8``), vLLM and SGLang read.

A projection's weight ``W`` ``[out, in]`` is stored as ``weight`` (``torch.float8_e4m3fn``, the same
shape) and ``weight_scale_inv`` (fp32 ``[out / b0, in / b1]``, one per ``b0 x b1`` block, by default
128 x 128), and read back as ``W ~ weight * weight_scale_inv`` blockwise (transformers'
``Fp8Dequantize``: each block's codes times its scale). :func:`quantize_fp8_blockwise` computes, per
block ``B`` (Micikevicius et al., "FP8 Formats for Deep Learning", arXiv:2209.05433; DeepSeek-V3
report, arXiv:2412.19437, section 3.3)::

    scale_inv(B) = fl32(amax(B) / 448)            (fl32: fp32 division, round to nearest even)
    q(B)         = e4m3(clamp(fl32(W / scale_inv), -448, 448))   (round to nearest, ties to even)

with ``W`` first converted to fp32 (exact from bf16 / fp16 / fp32) and 448 the largest finite E4M3
value; an all-zero block gets ``scale_inv = 1`` and zero codes (as transformers' own ``Fp8Quantize``).
Each element is off by at most half an E4M3 step of its block: ``|q * s - W| <= max(|W| 2^-4,
s 2^-10)`` (3 mantissa bits; the subnormal step is ``2^-9``) up to the fp32 rounding of the division.

Which tensors: every linear projection's weight (attention ``q/k/v/o_proj``, the MLP's and the
experts' ``gate/up/down_proj``, Mixtral's ``w1/w2/w3``); the embedding, ``lm_head``, the norms, the
biases and the router gates (``mlp.gate``, ``shared_expert_gate``) stay in the export dtype, as in
DeepSeek-V3 and Qwen3-FP8 checkpoints. :func:`quantization_config` is the ``config.json`` entry
that says so. transformers' dequantizing loader (``dequantize=True``, and the CPU path) takes the
block size from the ratio of the weight's shape to its scales' shape, so every quantized weight's
dimensions must be multiples of the block: anything else is refused by name
(:func:`check_fp8_shapes`).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping

import torch

from fnppo.core.errors import check_positive_int, input_error
from fnppo.core.typing import Float, Tensor, typechecked

__all__ = [
    "E4M3_MAX",
    "FP8Blocks",
    "quantize_fp8_blockwise",
    "dequantize_fp8_blockwise",
    "is_fp8_weight",
    "scale_name",
    "check_fp8_shapes",
    "fp8_tensor_shapes",
    "quantization_config",
]

E4M3_MAX = 448.0
"""The largest finite ``float8_e4m3fn`` value."""
_QUANTIZED = re.compile(r"\.(?:[qkvo]_proj|gate_proj|up_proj|down_proj|w1|w2|w3)\.weight$")
_KEPT_MODULES = ("lm_head", "mlp.gate", "block_sparse_moe.gate", "mlp.shared_expert_gate", "score")


@dataclasses.dataclass(frozen=True)
class FP8Blocks:
    """FP8 E4M3 weights with one fp32 ``weight_scale_inv`` per ``block`` (rows, columns) of a
    projection's weight; ``block=(128, 128)`` is DeepSeek-V3's and Qwen3-FP8's."""

    block: tuple[int, int] = (128, 128)

    def __post_init__(self) -> None:
        fn = "fnppo.hf.FP8Blocks"
        if not isinstance(self.block, tuple) or len(self.block) != 2:
            raise input_error(fn, "block", "a tuple (rows, columns) of two ints >= 1", repr(self.block))
        for i, b in enumerate(self.block):
            check_positive_int(fn, f"block[{i}]", b)

    @property
    def name(self) -> str:
        """``"fp8-e4m3-<rows>x<cols>"``: the format in a :class:`~fnppo.io.hf.delta.WeightSnapshot`."""
        return f"fp8-e4m3-{self.block[0]}x{self.block[1]}"


def is_fp8_weight(name: str) -> bool:
    """Whether the Hugging Face tensor ``name`` is stored in FP8 (a linear projection's weight)."""
    return bool(_QUANTIZED.search(name))


def scale_name(name: str) -> str:
    """``<module>.weight_scale_inv`` of ``<module>.weight``."""
    return name.removesuffix(".weight") + ".weight_scale_inv"


def _check_weight(fn: str, weight: Tensor, block: tuple[int, int]) -> None:
    if not weight.dtype.is_floating_point or weight.dtype.itemsize < 2:
        raise input_error(fn, "weight", "a bf16, fp16 or fp32 tensor", f"dtype {weight.dtype}")
    rows, cols = weight.shape[-2:]
    if rows % block[0] or cols % block[1]:
        raise input_error(
            fn,
            "weight",
            f"dimensions divisible by the block {block} (transformers' dequantizing loader takes the block from "
            "the ratio of the weight's shape to its scales')",
            f"shape {tuple(weight.shape)}",
        )
    if not bool(torch.isfinite(weight).all()):
        raise input_error(fn, "weight", "finite values (a block's scale is its largest |value| / 448)", "NaN or inf")


@typechecked
def quantize_fp8_blockwise(
    weight: Float[Tensor, "*experts rows cols"], block: tuple[int, int] = (128, 128)
) -> tuple[Float[Tensor, "*experts rows cols"], Float[Tensor, "*experts row_blocks col_blocks"]]:
    """E4M3 codes and per-block ``scale_inv`` of ``weight`` (2-D, or 3-D stacked experts ``[E, out, in]``).

    Per ``block`` (rows, columns): ``scale_inv = fl32(amax / 448)`` (1 for an all-zero block),
    ``q = e4m3(clamp(fl32(W / scale_inv), -448, 448))`` rounded to nearest, ties to even (the module
    docstring; arXiv:2209.05433). Returns ``(q, scale_inv)``: ``float8_e4m3fn`` of ``weight``'s shape,
    fp32 ``[..., rows / block[0], cols / block[1]]``; new tensors, ``weight`` is not changed.

    Raises:
        InputError: a non-floating or 8-bit ``weight``, NaN or inf in it, dimensions that are not
            multiples of ``block`` (naming the shape); ``block`` not two ints >= 1.
        ShapeError: a 1-D tensor or more than 3 dimensions.
    """
    fn = "fnppo.hf.quantize_fp8_blockwise"
    block = FP8Blocks(block).block if not isinstance(block, FP8Blocks) else block.block
    if weight.dim() > 3:
        raise input_error(
            fn, "weight", "a 2-D weight or 3-D stacked experts [E, out, in]", f"shape {tuple(weight.shape)}"
        )
    _check_weight(fn, weight, block)
    rows, cols = weight.shape[-2:]
    lead = weight.shape[:-2]
    w = weight.detach().float().reshape(*lead, rows // block[0], block[0], cols // block[1], block[1])
    amax = w.abs().amax(dim=(-3, -1))
    scale_inv = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    scaled = w / scale_inv[..., :, None, :, None]
    q = scaled.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).reshape(weight.shape)
    return q, scale_inv.contiguous()


@typechecked
def dequantize_fp8_blockwise(
    q: Float[Tensor, "*experts rows cols"],
    scale_inv: Float[Tensor, "*experts row_blocks col_blocks"],
    dtype: torch.dtype = torch.float32,
) -> Float[Tensor, "*experts rows cols"]:
    """``W = q * scale_inv`` blockwise (each block's codes times its scale, computed in fp32, then
    cast to ``dtype``), as transformers' ``Fp8Dequantize`` reads the layout.

    Raises:
        InputError: ``q`` not ``float8_e4m3fn``, ``scale_inv`` not fp32, or a ``q`` shape that is not
            a whole number of blocks of the scales' grid.
    """
    fn = "fnppo.hf.dequantize_fp8_blockwise"
    if q.dtype != torch.float8_e4m3fn:
        raise input_error(fn, "q", "a torch.float8_e4m3fn tensor", f"dtype {q.dtype}")
    if scale_inv.dtype != torch.float32 or q.shape[:-2] != scale_inv.shape[:-2]:
        raise input_error(fn, "scale_inv", f"fp32 scales of leading shape {tuple(q.shape[:-2])}", _desc(scale_inv))
    (rows, cols), (br, bc) = q.shape[-2:], scale_inv.shape[-2:]
    if rows % br or cols % bc:
        raise input_error(fn, "scale_inv", f"a grid dividing the weight's shape {tuple(q.shape)}", _desc(scale_inv))
    lead = q.shape[:-2]
    x = q.float().reshape(*lead, br, rows // br, bc, cols // bc) * scale_inv[..., :, None, :, None]
    return x.reshape(q.shape).to(dtype)


def _desc(t: Tensor) -> str:
    return f"{t.dtype} of shape {tuple(t.shape)}"


def check_fp8_shapes(fn: str, shapes: Mapping[str, tuple[int, ...]], fp8: FP8Blocks) -> None:
    """Refuse, before anything is exported or streamed, a projection weight the block layout cannot hold.

    Raises:
        InputError: a quantized tensor that is not 2-D or whose dimensions are not multiples of the
            block (naming the tensor and its shape).
    """
    if not isinstance(fp8, FP8Blocks):
        raise input_error(fn, "fp8", "None or an fnppo.hf.FP8Blocks", repr(fp8))
    for name, shape in shapes.items():
        if not is_fp8_weight(name):
            continue
        if len(shape) != 2 or shape[0] % fp8.block[0] or shape[1] % fp8.block[1]:
            raise input_error(
                fn,
                "fp8",
                f"a block {fp8.block} dividing every projection weight (transformers' dequantizing loader takes "
                "the block from the ratio of the weight's shape to its scales'; pass FP8Blocks(block=...) with a "
                "divisor, or export without fp8)",
                f"{name!r} of shape {tuple(shape)}",
            )


def fp8_tensor_shapes(shapes: Mapping[str, tuple[int, ...]], fp8: FP8Blocks) -> dict[str, tuple[int, ...]]:
    """The names and shapes of the FP8 checkpoint of the tensors ``shapes``: each projection weight
    and its ``weight_scale_inv`` (``[rows / b0, cols / b1]``), the others as they are."""
    out: dict[str, tuple[int, ...]] = {}
    for name, shape in shapes.items():
        out[name] = tuple(shape)
        if is_fp8_weight(name):
            out[scale_name(name)] = (shape[0] // fp8.block[0], shape[1] // fp8.block[1])
    return out


def to_fp8(name: str, t: Tensor, fp8: FP8Blocks | None, dtype: torch.dtype | None = None) -> list[tuple[str, Tensor]]:
    """The exported tensors of the Hugging Face tensor ``(name, t)`` (``t`` in the parameters'
    dtype): with ``fp8``, a projection weight as its E4M3 codes and ``weight_scale_inv`` (quantized
    from ``t``); anything else cast to ``dtype`` (default: ``t``'s)."""
    if fp8 is None or not is_fp8_weight(name):
        return [(name, t if dtype is None else t.to(dtype))]
    q, s = quantize_fp8_blockwise(t, fp8.block)
    return [(name, q), (scale_name(name), s)]


def quantization_config(names: Mapping[str, object] | list[str], fp8: FP8Blocks) -> dict:
    """The ``quantization_config`` entry of the exported ``config.json``: transformers'
    ``FineGrainedFP8Config`` (``quant_method: fp8``, E4M3, dynamic activation scales, the block),
    with ``modules_to_not_convert`` naming the modules kept in high precision that transformers
    would otherwise replace by FP8 linears: ``lm_head`` (also when tied: it is the embedding) and,
    among the checkpoint's tensor ``names``, the router gates and a value head's ``score``."""
    present = {n.removesuffix(".weight") for n in names if n.endswith(".weight") and not is_fp8_weight(n)}
    kept = sorted({"lm_head"} | {k for k in _KEPT_MODULES for p in present if p == k or p.endswith("." + k)})
    return {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": list(fp8.block),
        "modules_to_not_convert": kept,
    }
