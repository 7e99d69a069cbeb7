"""FP8 blockwise weights (``fnppo.hf.FP8Blocks``) against independent references.

* The codes and scales of ``quantize_fp8_blockwise`` equal a float64 loop written from the rule
  (``scale_inv = fl32(amax / 448)``, the nearest E4M3 value of ``fl32(W / scale_inv)`` with ties to
  the even code, from the table of all 256 codes), with planted ties, subnormals, a zero block and
  stacked experts; ``dequantize_fp8_blockwise`` equals transformers' own ``Fp8Dequantize``.
* A tiny Qwen3 and a Qwen3-MoE (128 x 128 blocks) exported by fnppo with ``fp8=FP8Blocks()`` load
  through transformers' fine-grained FP8 loader (``from_pretrained``; on a CPU it dequantizes): every
  weight equals the file's codes times scales and is within E4M3 rounding of the checkpoint's, and
  the logits equal those of the same transformers model given the float64-dequantized weights
  (1e-5) and are within 0.1 of the checkpoint's (the FP8 rounding itself, |logits| about 1).
* Bad weights, blocks and shapes are refused by name.
"""

from __future__ import annotations

import json
import struct

import pytest
import torch

from fnppo.core.errors import InputError, ShapeError
from fnppo.hf import FP8Blocks, dequantize_fp8_blockwise, quantize_fp8_blockwise
from fnppo.testing import run_ranks
from tests.messages import check_message

LOGIT_TOL = 0.3  # FP8 against the checkpoint: 3 mantissa bits per weight (measured: see the printed line)
SEQ = 10


def _fl32(x: float) -> float:
    return struct.unpack("f", struct.pack("f", x))[0]


def _table() -> list[tuple[float, int]]:
    """(value, code) of the non-negative finite E4M3 codes, ascending."""
    vals = torch.arange(128, dtype=torch.uint8).view(torch.float8_e4m3fn).double()
    return [(float(v), c) for c, v in enumerate(vals.tolist()) if v == v]  # 0x7f is NaN


def _ref_code(y: float, table: list[tuple[float, int]]) -> int:
    """The E4M3 code of ``y`` rounded to nearest, ties to the even code; clamped to +-448."""
    mag = min(abs(y), 448.0)
    best = min(table, key=lambda vc: (abs(vc[0] - mag), vc[1] & 1))
    sign = 0x80 if (y < 0 or (y == 0 and struct.pack("d", y)[-1] & 0x80)) else 0
    return best[1] | sign


def _reference(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Float64 loop: codes (uint8) and scales of a 2-D ``w``."""
    table = _table()
    rows, cols = w.shape
    codes = torch.zeros(rows, cols, dtype=torch.uint8)
    scales = torch.zeros(rows // block[0], cols // block[1], dtype=torch.float64)
    for bi in range(rows // block[0]):
        for bj in range(cols // block[1]):
            blk = w[bi * block[0] : (bi + 1) * block[0], bj * block[1] : (bj + 1) * block[1]].double()
            amax = max(abs(float(x)) for x in blk.reshape(-1))
            s = _fl32(amax / 448.0) if amax > 0 else 1.0
            scales[bi, bj] = s
            for i in range(block[0]):
                for j in range(block[1]):
                    y = _fl32(float(blk[i, j]) / s)
                    codes[bi * block[0] + i, bj * block[1] + j] = _ref_code(y, table)
    return codes, scales


def _weights() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(8, 12, generator=g) * torch.logspace(-4, 1, 12)  # magnitudes over 5 decades
    w[:4, :4] = 0.0  # a zero block
    # a block of amax 448 (scale 1): ties between E4M3 neighbours, normal and subnormal
    ties = [448.0, 1.0625, 1.1875, -1.0625, 2**-10, 3 * 2**-10, -(2**-10), 0.5 + 2**-5, 240.0, 232.0, 13.0, 0.0]
    w[4:8, 8:12] = torch.tensor(ties[:12] + [0.0] * 4).reshape(4, 4)
    return w


def test_quantize_matches_a_float64_round_to_nearest_even_loop():
    w = _weights()
    for weight in (w, w.bfloat16()):
        q, s = quantize_fp8_blockwise(weight, (4, 4))
        codes, scales = _reference(weight.float(), (4, 4))
        assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32 and s.shape == (2, 3)
        assert torch.equal(q.view(torch.uint8), codes)
        assert torch.equal(s.double(), scales)
    q, s = quantize_fp8_blockwise(w, (4, 4))
    assert torch.equal(s[0, 0], torch.tensor(1.0)) and not q.view(torch.uint8)[:4, :4].any()  # zero block
    deq = dequantize_fp8_blockwise(q, s)
    tie_block = deq[4:8, 8:12].reshape(-1)[:8].tolist()
    assert tie_block == [448.0, 1.0, 1.25, -1.0, 0.0, 2**-8, -0.0, 0.5]  # ties went to the even code
    # within half an E4M3 step of each block (relative 2^-4, subnormal step 2^-9 of the scale)
    scale = s.repeat_interleave(4, 0).repeat_interleave(4, 1)
    bound = torch.maximum(w.abs() * 2**-4, scale * 2**-10) + w.abs() * 2**-22
    assert bool(((deq - w).abs() <= bound).all())
    # stacked experts [E, out, in]: each expert as its own 2-D weight
    e = torch.stack([w, -2 * w, w * 1e-3])
    qe, se = quantize_fp8_blockwise(e, (4, 4))
    for i in range(3):
        qi, si = quantize_fp8_blockwise(e[i], (4, 4))
        assert torch.equal(qe[i].view(torch.uint8), qi.view(torch.uint8)) and torch.equal(se[i], si)


def test_dequantize_is_transformers_own():
    fp8 = pytest.importorskip("transformers.integrations.finegrained_fp8")
    g = torch.Generator().manual_seed(1)
    w = torch.randn(2, 256, 384, generator=g) * 0.02
    q, s = quantize_fp8_blockwise(w, (128, 128))
    theirs = fp8.Fp8Dequantize(None)._dequantize_one(q, s, output_dtype=torch.float32)
    assert torch.equal(dequantize_fp8_blockwise(q, s), theirs)
    ref = (q.double().reshape(2, 2, 128, 3, 128) * s.double()[:, :, None, :, None]).reshape(q.shape).float()
    assert torch.equal(theirs, ref)  # one rounding of the exact product


def test_bad_weights_and_blocks_are_refused():
    fn = "quantize_fp8_blockwise"
    w = torch.randn(8, 8)
    cases = {
        "int": (lambda: quantize_fp8_blockwise(torch.ones(8, 8, dtype=torch.int32), (4, 4)), ShapeError),
        "fp8": (lambda: quantize_fp8_blockwise(w.to(torch.float8_e4m3fn), (4, 4)), InputError),
        "nan": (lambda: quantize_fp8_blockwise(torch.where(w > 1, float("nan"), w), (4, 4)), InputError),
        "inf": (lambda: quantize_fp8_blockwise(torch.where(w > 1, float("inf"), w), (4, 4)), InputError),
        "indivisible": (lambda: quantize_fp8_blockwise(torch.randn(8, 12), (8, 8)), InputError),
        "1d": (lambda: quantize_fp8_blockwise(torch.randn(8), (4, 4)), ShapeError),
        "4d": (lambda: quantize_fp8_blockwise(torch.randn(2, 2, 8, 8), (4, 4)), InputError),
        "block0": (lambda: FP8Blocks((0, 128)), InputError),
        "block-str": (lambda: FP8Blocks(("128", 128)), InputError),
        "block-bool": (lambda: FP8Blocks((True, 128)), InputError),
        "block-1": (lambda: FP8Blocks((128,)), InputError),
        "deq-dtype": (lambda: dequantize_fp8_blockwise(w, torch.ones(2, 2)), InputError),
        "deq-grid": (lambda: dequantize_fp8_blockwise(w.to(torch.float8_e4m3fn), torch.ones(3, 3)), InputError),
    }
    got = {}
    for key, (call, exc) in cases.items():
        with pytest.raises(exc) as err:
            call()
        got[key] = err.value
    check_message(got["fp8"], InputError, fn, "weight", "a bf16, fp16 or fp32 tensor", "torch.float8_e4m3fn")
    check_message(got["nan"], InputError, fn, "weight", "finite values", "NaN or inf")
    check_message(got["inf"], InputError, fn, "weight", "finite values", "NaN or inf")
    check_message(got["indivisible"], InputError, fn, "weight", "divisible by the block (8, 8)", "shape (8, 12)")
    check_message(got["4d"], InputError, fn, "weight", "3-D stacked experts", "shape (2, 2, 8, 8)")
    check_message(got["block0"], InputError, "FP8Blocks", "block[0]", "an int >= 1", "0")
    check_message(got["block-str"], InputError, "FP8Blocks", "block[0]", "an int >= 1", "'128'")
    check_message(got["block-bool"], InputError, "FP8Blocks", "block[0]", "an int >= 1", "True")
    check_message(got["block-1"], InputError, "FP8Blocks", "block", "two ints >= 1", "(128,)")
    check_message(got["deq-dtype"], InputError, "dequantize_fp8_blockwise", "q", "float8_e4m3fn", "torch.float32")
    check_message(got["deq-grid"], InputError, "dequantize_fp8_blockwise", "scale_inv", "a grid dividing", "(3, 3)")
    assert "i32[8,8]" in str(got["int"]) and "f32[8]" in str(got["1d"])


# ---------------------------------------------------------------------------------------------
# fnppo's FP8 export read by transformers' fine-grained FP8 loader
# ---------------------------------------------------------------------------------------------
_SMALL = dict(
    vocab_size=96,
    hidden_size=256,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)
MODELS = {
    "qwen3": ("Qwen3Config", _SMALL),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        dict(_SMALL, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=128, norm_topk_prob=True),
    ),
}


@pytest.fixture(scope="module")
def fp8_exports(tmp_path_factory):
    """model -> (checkpoint dir, fnppo's FP8 export dir, ids, transformers' fp32 logits)."""
    transformers = pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("hf-fp8")
    out = {}
    for i, (name, (cls, kwargs)) in enumerate(MODELS.items()):
        config = getattr(transformers, cls)(**kwargs)
        config._attn_implementation = "eager"
        torch.manual_seed(60 + i)
        model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
        g = torch.Generator().manual_seed(60 + i)
        with torch.no_grad():
            for pname, p in model.named_parameters():
                noise = torch.randn(p.shape, generator=g)
                p.copy_(1.0 + 0.1 * noise if pname.endswith("norm.weight") else 0.05 * noise)
        model.save_pretrained(str(root / name))
        ids = torch.randint(0, 96, (1, SEQ), generator=torch.Generator().manual_seed(70 + i))
        with torch.no_grad():
            logits = model(input_ids=ids).logits.float()
        out[name] = (str(root / name), str(root / f"{name}-fp8"), ids, logits)
    errors = run_ranks(_export_worker, 2, {k: v[:2] for k, v in out.items()}, tp=2)
    return out, errors[0]


def _export_worker(paths: dict) -> dict:
    import fnppo
    from fnppo.io.hf import build_gpt_from_hf, export_hf_weights, load_hf_weights, stream_hf_weights

    errors = {}
    for src, dst in paths.values():
        chunks = build_gpt_from_hf(src, dtype="fp32")
        load_hf_weights(chunks, src)
        export_hf_weights(chunks, dst, hf_config=src, fp8=fnppo.hf.FP8Blocks())
    for key, call in {
        "export": lambda: export_hf_weights(chunks, "/nonexistent/x", fp8=fnppo.hf.FP8Blocks((96, 128))),
        "stream": lambda: stream_hf_weights(chunks, fp8=fnppo.hf.FP8Blocks((128, 96))),
        "not-blocks": lambda: stream_hf_weights(chunks, fp8=(128, 128)),
    }.items():
        try:
            call()
        except InputError as err:
            errors[key] = str(err)
    return errors


@pytest.mark.parametrize("name", list(MODELS))
def test_fp8_export_loads_through_transformers_fine_grained_fp8_loader(fp8_exports, name):
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import load_file

    exports, _ = fp8_exports
    src, path, ids, ref_logits = exports[name]
    cfg = json.loads(open(f"{path}/config.json").read())["quantization_config"]
    assert cfg == {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
        "modules_to_not_convert": ["lm_head"] + (["mlp.gate"] if "moe" in name else []),
    }
    files = load_file(f"{path}/model.safetensors")
    original = load_file(f"{src}/model.safetensors")
    scales = [n for n in files if n.endswith("weight_scale_inv")]
    assert scales and all(files[n.replace("_scale_inv", "")].dtype == torch.float8_e4m3fn for n in scales)
    kept = sorted(n for n in files if files[n].dtype == torch.float32 and not n.endswith("_scale_inv"))
    assert all(n.endswith(("norm.weight", "embed_tokens.weight", "lm_head.weight", "mlp.gate.weight")) for n in kept)
    # the weights transformers reads: the codes times the scales (float64, one rounding to fp32)
    deq = {}
    for n, t in original.items():
        if n + "_scale_inv" in files or n.removesuffix(".weight") + ".weight_scale_inv" in files:
            s = files[n.removesuffix(".weight") + ".weight_scale_inv"].double()
            q = files[n].double()
            full = s.repeat_interleave(128, 0).repeat_interleave(128, 1)
            deq[n] = (q * full).float()
            bound = torch.maximum(t.abs() * 2**-4, full.float() * 2**-10) + t.abs() * 2**-22
            assert bool(((deq[n] - t).abs() <= bound).all()), n  # within E4M3 rounding
        else:
            assert torch.equal(files[n], t), n  # kept tensors are the checkpoint's
            deq[n] = t
    loaded = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    config = transformers.AutoConfig.from_pretrained(src)
    reference = type(loaded).from_pretrained(None, config=config, state_dict=deq, dtype=torch.float32)
    got = {k: v for k, v in loaded.state_dict().items()}
    want = reference.state_dict()
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)
    with torch.no_grad():
        logits = loaded(input_ids=ids).logits.float()
        ref = reference.eval()(input_ids=ids).logits.float()
    assert (logits - ref).abs().max().item() <= 1e-5
    err = (logits - ref_logits).abs().max().item()
    print(f"{name}: FP8 logits vs the checkpoint's: max |diff| {err:.4f} (|logits| max {ref_logits.abs().max():.3f})")
    assert 0 < err <= LOGIT_TOL, err


def test_fp8_blocks_that_do_not_divide_a_projection_are_refused_before_anything_is_written(fp8_exports):
    _, errors = fp8_exports
    check_message(
        InputError(errors["export"]), InputError, "export_hf_weights", "fp8", "a block (96, 128) dividing", "q_proj"
    )
    check_message(
        InputError(errors["stream"]), InputError, "stream_hf_weights", "fp8", "a block (128, 96) dividing", "of shape"
    )
    check_message(InputError(errors["not-blocks"]), InputError, "stream_hf_weights", "fp8", "FP8Blocks", "(128, 128)")
