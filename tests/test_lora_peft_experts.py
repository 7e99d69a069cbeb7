"""MoE expert adapters against ``peft`` on ``transformers`` 5's fused experts, both ways.

For each MoE family fnppo loads (Qwen3-MoE with a dense first layer, Qwen2-MoE with a shared expert,
Mixtral; the tiny configs of ``tests/test_hf.py``), ``peft`` puts adapters on the attention
projections (and Qwen2-MoE's shared expert) and, with ``target_parameters``, on every MoE layer's
fused ``mlp.experts.gate_up_proj`` / ``down_proj``, random ``A`` and ``B``, the ``gate_up_proj``
adapter of rank ``2r`` and alpha ``2 alpha`` with ``B`` block-diagonal over gate and up (what PEFT's
own conversion of per-projection expert adapters writes). fnppo builds the model from the base
checkpoint (Megatron's ``SequentialMLP`` in one process; fnppo's stacked experts in one process and
under EP=2), reads the config (``lora_config_from_peft``), loads the file, and must give PEFT's
log-probs within 1e-5 (fp32); the adapter it saves back is PEFT's file bit for bit, and ``peft``
loading fnppo's file gives the same logits.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import fnppo
from fnppo.core.errors import InputError
from fnppo.testing import run_ranks
from tests.test_hf import _COMMON, MOE_FAMILIES

RANK, ALPHA = 4, 12.0
SEQ, PROMPT = 12, 4
TOL = 1e-5
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
RUNS = {"sequential": (1, None), "stacked": (1, "stacked"), "stacked-ep2": (2, "stacked")}


def _logprobs(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    lp = torch.log_softmax(logits.double()[0, PROMPT - 1 : -1], dim=-1)
    return lp.gather(-1, ids[0, PROMPT:, None])[:, 0]


def _base_model(family: str, seed: int):
    transformers = pytest.importorskip("transformers")
    cls_name, kwargs = MOE_FAMILIES[family]
    config = getattr(transformers, cls_name)(**kwargs)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).float()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1.0 + 0.2 * noise if name.endswith("norm.weight") else 0.15 * noise)
    return model.eval()


def _block_diagonal(adapted, experts: int) -> None:
    """Zero the gate/up cross terms of every ``gate_up_proj`` adapter's ``B`` ``[2 ffn, 2r * E]``."""
    for name, p in adapted.named_parameters():
        if ".experts.base_layer.lora_B" in name:
            b = p.data.view(p.shape[0], 2 * RANK, experts)
            half = p.shape[0] // 2
            b[:half, RANK:] = 0
            b[half:, :RANK] = 0


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    peft = pytest.importorskip("peft")
    root = tmp_path_factory.mktemp("lora-peft-experts")
    out = {}
    for i, family in enumerate(MOE_FAMILIES):
        model = _base_model(family, seed=60 + i)
        model.save_pretrained(str(root / family / "base"))
        ids = torch.randint(0, _COMMON["vocab_size"], (1, SEQ), generator=torch.Generator().manual_seed(70 + i))
        with torch.no_grad():
            base_logits = model(input_ids=ids).logits.float()
        torch.manual_seed(80 + i)
        modules = ATTENTION + (["gate_proj", "up_proj", "down_proj"] if family == "qwen2_moe" else [])
        config = peft.LoraConfig(
            r=RANK,
            lora_alpha=ALPHA,
            target_modules=modules,
            target_parameters=["gate_up_proj", "down_proj"],
            rank_pattern={r".*\.gate_up_proj": 2 * RANK},
            alpha_pattern={r".*\.gate_up_proj": 2 * ALPHA},
            init_lora_weights=False,
        )
        adapted = peft.get_peft_model(model, config).eval()
        _block_diagonal(adapted, 4)
        adapted.save_pretrained(str(root / family / "adapter"))
        with torch.no_grad():
            logits = adapted(input_ids=ids).logits.float()
        out[family] = {
            "ids": ids,
            "logits": logits,
            "peft": _logprobs(logits, ids),
            "base": _logprobs(base_logits, ids),
        }
    return root, out


def _worker(root: str, ids: dict, runs: list[str]) -> dict:
    out = {}
    for run in runs:
        world, experts = RUNS[run]
        fnppo.init_parallel(ep=world, seed=1234, device="cpu", timeout_s=120.0)
        for family, tokens in ids.items():
            base, adapter = f"{root}/{family}/base", f"{root}/{family}/adapter"
            chunks = fnppo.hf.build_gpt_from_hf(base, dtype="fp32", moe_experts=experts)
            fnppo.hf.load_hf_weights(chunks, base)
            fnppo.lora.apply_lora(chunks, fnppo.lora.lora_config_from_peft(adapter))
            empty = fnppo.lora.load_peft_adapter(chunks, adapter)
            model = fnppo.wrap_ddp(chunks)
            sample = [fnppo.Sample.from_lists(tokens[0, :PROMPT].tolist(), tokens[0, PROMPT:].tolist())]
            (lp,), _ = fnppo.compute_logprobs(model, sample)
            (off,), _ = fnppo.compute_logprobs(model, sample, params=fnppo.lora.adapters_off(model))
            fnppo.lora.save_peft_adapter(model, f"{root}/{family}/{run}-saved")
            out[(run, family)] = {"logprobs": lp, "off": off, "empty": empty}
    return out


@pytest.fixture(scope="module")
def one_process(reference):
    root, ref = reference
    ids = {f: r["ids"] for f, r in ref.items()}
    return run_ranks(_worker, 1, str(root), ids, ["sequential", "stacked"], timeout_s=900)[0]


@pytest.fixture(scope="module")
def ep2(reference):
    root, ref = reference
    ids = {f: r["ids"] for f, r in ref.items()}
    return run_ranks(_worker, 2, str(root), ids, ["stacked-ep2"], timeout_s=900)


def _check(reference, got: dict, family: str) -> float:
    ref = reference[1][family]
    # experts of every MoE layer loaded; only adapters PEFT leaves out (dense MLP of qwen3_moe's layer 0) are empty
    assert not any(".experts." in n for n in got["empty"]), got["empty"]
    err = float((got["logprobs"].double() - ref["peft"]).abs().max())
    assert err <= TOL, (family, err)
    assert float((ref["peft"] - ref["base"]).abs().max()) > 0.05  # the adapters matter
    assert float((got["off"].double() - ref["base"]).abs().max()) <= TOL
    return err


@pytest.mark.parametrize("family", list(MOE_FAMILIES))
@pytest.mark.parametrize("run", ["sequential", "stacked"])
def test_peft_expert_adapter_gives_peft_logprobs(reference, one_process, family, run):
    _check(reference, one_process[(run, family)], family)


@pytest.mark.parametrize("family", list(MOE_FAMILIES))
def test_peft_expert_adapter_under_expert_parallelism(reference, ep2, family):
    for rank in range(2):
        _check(reference, ep2[rank][("stacked-ep2", family)], family)


@pytest.mark.parametrize("family", list(MOE_FAMILIES))
def test_expert_adapter_saved_back_is_peft_file_and_loads_into_peft(reference, one_process, family):
    peft = pytest.importorskip("peft")
    root, ref = reference
    want = load_file(str(root / family / "adapter" / "adapter_model.safetensors"))
    cfg_want = json.loads((root / family / "adapter" / "adapter_config.json").read_text())
    for run in ("sequential", "stacked"):
        saved = root / family / f"{run}-saved"
        got = load_file(str(saved / "adapter_model.safetensors"))
        assert sorted(got) == sorted(want), run
        for k in want:
            assert torch.equal(got[k], want[k]), (run, k)
        cfg = json.loads((saved / "adapter_config.json").read_text())
        for key in ("r", "lora_alpha", "rank_pattern", "alpha_pattern"):
            assert cfg[key] == cfg_want[key], (key, cfg[key], cfg_want[key])
        for key in ("target_modules", "target_parameters"):
            assert sorted(cfg[key]) == sorted(cfg_want[key]), (key, cfg[key], cfg_want[key])
    model = _base_model(family, seed=60 + list(MOE_FAMILIES).index(family))
    loaded = peft.PeftModel.from_pretrained(model, str(root / family / "stacked-saved")).eval()
    with torch.no_grad():
        logits = loaded(input_ids=ref[family]["ids"]).logits.float()
    assert float((logits - ref[family]["logits"]).abs().max()) <= TOL * max(1.0, float(logits.abs().max()))


def _refusal(root: str, family: str, edit: dict, tensors=None) -> str:
    """Copy the PEFT adapter with ``edit`` applied to its config (and ``tensors`` as its file)."""
    import shutil
    from pathlib import Path

    src, dst = Path(root) / family / "adapter", Path(root) / family / "edited"
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "adapter_config.json").read_text())
    if edit is None:  # not JSON
        (dst / "adapter_config.json").write_text("{'r': 4,")
    else:
        cfg.update(edit)
        (dst / "adapter_config.json").write_text(json.dumps(cfg))
    if tensors is not None:
        save_file(tensors, str(dst / "adapter_model.safetensors"))
    fnppo.init_parallel(seed=1234, device="cpu")
    base = f"{root}/{family}/base"
    chunks = fnppo.hf.build_gpt_from_hf(base, dtype="fp32", moe_experts="stacked")
    try:
        fnppo.lora.apply_lora(chunks, fnppo.lora.lora_config_from_peft(str(dst)))
        fnppo.lora.load_peft_adapter(chunks, str(dst))
    except (InputError, fnppo.checkpoint.CheckpointError) as err:  # (a damaged file: CheckpointError)
        return str(err)
    return "accepted"


def _refusals(root: str) -> dict:
    from pathlib import Path

    family = "mixtral"
    want = load_file(str(Path(root) / family / "adapter" / "adapter_model.safetensors"))
    crossed = dict(want)
    key = next(k for k in want if ".experts.base_layer.lora_B" in k)
    crossed[key] = want[key] + 0.01  # gate/up cross terms
    q0 = "base_model.model.model.layers.0.self_attn.q_proj"
    experts1 = "base_model.model.model.layers.1.mlp.experts"
    without = {k: v for k, v in want.items() if not k.startswith(q0)}
    half = {k: v for k, v in want.items() if k != f"{q0}.lora_B.weight"}
    no_experts = {k: v for k, v in want.items() if not k.startswith(f"{experts1}.base_layer.")}
    wider = dict(want)
    wider[f"{q0}.lora_A.weight"] = torch.zeros(RANK, 2 * _COMMON["hidden_size"])  # another hidden size
    fnppo.init_parallel(seed=1234, device="cpu")
    other = fnppo.hf.build_gpt_from_hf(f"{root}/{family}/base", dtype="fp32", moe_experts="stacked")
    saved = f"{root}/qwen3_moe/stacked-saved"  # fnppo's file: it records its base
    fnppo.lora.apply_lora(other, fnppo.lora.lora_config_from_peft(saved))
    try:
        fnppo.lora.load_peft_adapter(other, saved)
        base = "accepted"
    except InputError as err:
        base = str(err)
    return {
        "other base": base,
        "missing": _refusal(root, family, {}, without),
        "half": _refusal(root, family, {}, half),
        "missing experts": _refusal(root, family, {}, no_experts),
        "hidden": _refusal(root, family, {}, wider),
        "not json": _refusal(root, family, None),
        "rank_pattern": _refusal(root, family, {"rank_pattern": {r".*\.gate_up_proj": RANK}}),
        "other pattern": _refusal(root, family, {"rank_pattern": {"q_proj": 8}}),
        "target_parameters": _refusal(root, family, {"target_parameters": ["router.weight"]}),
        "modules_to_save": _refusal(root, family, {"modules_to_save": ["lm_head"]}),
        "lora_bias": _refusal(root, family, {"lora_bias": True}),
        "crossed": _refusal(root, family, {}, crossed),
    }


def test_unsupported_peft_expert_adapters_are_refused_by_name(reference, one_process):  # one_process: saves
    root, _ = reference
    got = run_ranks(_refusals, 1, str(root))[0]
    assert "'adapter_config.json['rank_pattern'] for gate_up_proj' expected 8" in got["rank_pattern"]
    assert (
        "'adapter_config.json['rank_pattern']' expected patterns for ['down_proj', 'gate_up_proj'] only"
        in (got["other pattern"])
    )
    assert "'adapter_config.json['target_parameters']' expected names from" in got["target_parameters"]
    assert "'adapter_config.json['modules_to_save']' expected None, received ['lm_head']" in got["modules_to_save"]
    assert "'adapter_config.json['lora_bias']' expected False, received True" in got["lora_bias"]
    q0 = "base_model.model.model.layers.0.self_attn.q_proj"
    assert (
        "argument 'path' expected the adapter of model.layers.0.self_attn.q_proj (its target_modules name 'q_proj'), received no tensors"
        in got["missing"]
    )
    assert (
        f"argument 'path' expected both {q0}.lora_A.weight and {q0}.lora_B.weight, received only {q0}.lora_A.weight"
        in got["half"]
    )
    assert (
        "expected the tensor base_model.model.model.layers.1.mlp.experts.base_layer.lora_A.weight (target_parameters names 'gate_up_proj')"
        in got["missing experts"]
    )
    assert (
        f"argument 'PEFT tensor {q0}.lora_A.weight' expected shape (4, 64) (the model's), received (4, 128)"
        in got["hidden"]
    )
    assert (
        "lora_config_from_peft: argument 'path' expected a JSON object in adapter_config.json, received "
        in got["not json"]
        and "which is not valid JSON (truncated or corrupt: " in got["not json"]
    )
    assert "expected a block-diagonal B over the 2 fused projections" in got["crossed"]
    assert (
        "argument 'path' expected an adapter saved for this base model, received one saved for a base with"
        in (got["other base"])
    )
    assert "family='qwen3_moe' (the model's 'mixtral')" in got["other base"]
    assert "non-zero gate/up cross terms in expert 0" in got["crossed"]
