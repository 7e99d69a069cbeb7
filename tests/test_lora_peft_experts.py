"""MoE expert adapters against ``peft`` on ``transformers`` 5's fused experts, both ways, both forms.

For each MoE family fnppo loads (Qwen3-MoE with a dense first layer, Qwen2-MoE with a shared expert,
Mixtral; the tiny configs of ``tests/test_hf.py``), ``peft`` puts random adapters (``A`` and ``B``)
on the attention projections (and Qwen2-MoE's shared expert) and, with ``target_parameters``, on the
fused ``mlp.experts.gate_up_proj`` / ``down_proj``, in two forms:

* ``split``: ``gate_up_proj`` of rank ``2r`` and alpha ``2 alpha`` with ``B`` block-diagonal over
  gate and up (what PEFT's own conversion of per-projection expert adapters writes);
* ``fused``: PEFT's own parameterization, one rank-``r`` adapter over the fused rows, with
  ``target_parameters`` spelled as PEFT's docs spell it (``mlp.experts.gate_up_proj``) and as one
  layer's full name (``model.layers.1.mlp.experts.down_proj``), a ``rank_pattern`` and an
  ``alpha_pattern`` that name one layer's expert projection (full name and a dot-separated tail) and
  an ``alpha_pattern`` for ``o_proj`` in every layer, ``target_modules`` with a dotted tail
  (``self_attn.q_proj``); Qwen2-MoE's with rsLoRA (``alpha / sqrt(r)``).

fnppo builds the model from the base checkpoint (Megatron's ``SequentialMLP`` in one process, fnppo's
stacked experts under EP=2; the two agree in one process too, ``tests/test_lora_experts.py``), reads
the config (``lora_config_from_peft``), loads the file, and must give PEFT's log-probs within 1e-5
(fp32). The adapter it saves back holds PEFT's
tensors bit for bit and gives, loaded by ``peft``, the ranks, scalings and logits of PEFT's model,
with no warning from ``peft``; the merged export (``W + s B A``) is PEFT's model. After one
``train_step`` the saved adapter loaded by ``peft`` gives fnppo's log-probs. Refusals of bad files:
``tests/test_lora_peft_refusals.py``.
"""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch
from safetensors.torch import load_file

import fnppo
from fnppo.testing import run_ranks, synthetic_samples
from tests.test_hf import _COMMON, MOE_FAMILIES

RANK, ALPHA = 4, 12.0
SEQ, PROMPT = 12, 4
TOL = 1e-5
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
RUNS = {"sequential": (1, None), "stacked": (1, "stacked"), "stacked-ep2": (2, "stacked")}
FORMS = {"split": "adapter", "fused": "fused"}  # form -> the directory of PEFT's adapter


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


def _peft_config(family: str, form: str):
    peft = pytest.importorskip("peft")
    modules = ATTENTION + (["gate_proj", "up_proj", "down_proj"] if family == "qwen2_moe" else [])
    if form == "split":
        return peft.LoraConfig(
            r=RANK,
            lora_alpha=ALPHA,
            target_modules=modules,
            target_parameters=["gate_up_proj", "down_proj"],
            rank_pattern={r".*\.gate_up_proj": 2 * RANK},
            alpha_pattern={r".*\.gate_up_proj": 2 * ALPHA},
            init_lora_weights=False,
        )
    return peft.LoraConfig(  # layer 1 is an MoE layer in every family (Qwen3-MoE's layer 0 is dense)
        r=RANK,
        lora_alpha=ALPHA,
        target_modules=["self_attn.q_proj", *modules[1:]],  # a dotted tail too
        target_parameters=["mlp.experts.gate_up_proj", "model.layers.1.mlp.experts.down_proj"],
        rank_pattern={"model.layers.1.mlp.experts.gate_up_proj": RANK + 2},
        alpha_pattern={"layers.1.mlp.experts.gate_up_proj": 30.0, "o_proj": 20.0},
        use_rslora=family == "qwen2_moe",  # alpha / sqrt(r)
        init_lora_weights=False,
    )


def peft_load(model, path: str):
    """``peft.PeftModel.from_pretrained`` and the warnings it gave (but transformers' deprecation of
    ``is_gradient_checkpointing``, which every PEFT load gives)."""
    peft = pytest.importorskip("peft")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = peft.PeftModel.from_pretrained(model, path).eval()
    return loaded, [str(w.message) for w in caught if "is_gradient_checkpointing" not in str(w.message)]


def _adapted(model) -> dict[str, tuple[int, float]]:
    """Rank and scaling of every adapted module or parameter of a PEFT model."""
    return {
        n: (m.r["default"], m.scaling["default"])
        for n, m in model.named_modules()
        if isinstance(getattr(m, "r", None), dict)
    }


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return build_references(tmp_path_factory.mktemp("lora-peft-experts"))


def build_references(root):
    """Per family: the base checkpoint and PEFT's adapter of each form under ``root``; the token ids,
    the base model's log-probs, and per form PEFT's logits, log-probs and adapted ranks and scalings."""
    peft = pytest.importorskip("peft")
    out = {}
    for i, family in enumerate(MOE_FAMILIES):
        model = _base_model(family, seed=60 + i)
        model.save_pretrained(str(root / family / "base"))
        ids = torch.randint(0, _COMMON["vocab_size"], (1, SEQ), generator=torch.Generator().manual_seed(70 + i))
        with torch.no_grad():
            base_logits = model(input_ids=ids).logits.float()
        out[family] = {"ids": ids, "base": _logprobs(base_logits, ids)}
        for j, (form, directory) in enumerate(FORMS.items()):
            torch.manual_seed(80 + i + 10 * j)
            adapted = peft.get_peft_model(_base_model(family, seed=60 + i), _peft_config(family, form)).eval()
            if form == "split":
                _block_diagonal(adapted, 4)
            adapted.save_pretrained(str(root / family / directory))
            with torch.no_grad():
                logits = adapted(input_ids=ids).logits.float()
            out[family][form] = {"logits": logits, "peft": _logprobs(logits, ids), "adapted": _adapted(adapted)}
    return root, out


def _train(model, config) -> None:
    """One ``train_step`` (Adam, every adapter moves)."""
    state = fnppo.TrainState(model=model, optimizer=fnppo.build_optimizer(model, lr=0.05, clip_grad=0.0))
    samples = fnppo.shard_for_data_parallel(synthetic_samples(4, vocab_size=_COMMON["vocab_size"], seed=9))
    fnppo.train_step(state, samples, fnppo.StepConfig(loss=fnppo.losses.from_flat(), num_microbatches=1))


def _worker(root: str, ids: dict, runs: list[str], forms: tuple[str, ...] = ("split",)) -> dict:
    """Per run, family and form: fnppo's log-probs of PEFT's adapter (and with the adapters off), the
    adapter saved back, then after one train step the log-probs and the adapter saved."""
    out = {}
    for run in runs:
        world, experts = RUNS[run]
        fnppo.init_parallel(ep=world, seed=1234, device="cpu", timeout_s=120.0)
        for family, tokens in ids.items():
            for form in forms:
                base, adapter = f"{root}/{family}/base", f"{root}/{family}/{FORMS[form]}"
                chunks = fnppo.hf.build_gpt_from_hf(base, dtype="fp32", moe_experts=experts)
                fnppo.hf.load_hf_weights(chunks, base)
                config = fnppo.lora.lora_config_from_peft(adapter, expert_gate_up=form)
                fnppo.lora.apply_lora(chunks, config)
                empty = fnppo.lora.load_peft_adapter(chunks, adapter)
                model = fnppo.wrap_ddp(chunks)
                sample = [fnppo.Sample.from_lists(tokens[0, :PROMPT].tolist(), tokens[0, PROMPT:].tolist())]
                (lp,), _ = fnppo.compute_logprobs(model, sample)
                (off,), _ = fnppo.compute_logprobs(model, sample, params=fnppo.lora.adapters_off(model))
                tag = f"{root}/{family}/{run}-{form}"
                fnppo.lora.save_peft_adapter(model, f"{tag}-saved")
                reread = fnppo.lora.lora_config_from_peft(f"{tag}-saved")  # the form from fnppo's record
                if run == "stacked-ep2":  # the merged weights W + s B A (stacked_merged_delta)
                    fnppo.hf.export_hf_weights(model, f"{tag}-merged", hf_config=base)
                _train(model, config)
                (after,), _ = fnppo.compute_logprobs(model, sample)
                fnppo.lora.save_peft_adapter(model, f"{tag}-trained")
                key = (run, family) if form == "split" else (run, family, form)
                out[key] = {
                    "logprobs": lp,
                    "off": off,
                    "empty": empty,
                    "config": config,
                    "after": after,
                    "reread": reread,
                }
    return out


def _experts_only(root: str, ids: torch.Tensor) -> dict:
    """Mixtral with split-form adapters on the experts only (random ``B``), saved and loaded back."""
    fnppo.init_parallel(seed=1234, device="cpu")
    base = f"{root}/mixtral/base"
    config = fnppo.lora.LoRAConfig(rank=RANK, alpha=ALPHA, targets=("linear_fc1", "linear_fc2"), seed=3)
    chunks = fnppo.hf.build_gpt_from_hf(base, dtype="fp32")
    fnppo.hf.load_hf_weights(chunks, base)
    fnppo.lora.apply_lora(chunks, config)
    fnppo.lora.save_peft_adapter(chunks, f"{root}/mixtral/experts-fresh")  # every B zero: all written
    full = fnppo.models.gather_full_weights(chunks, adapters=True)
    g = torch.Generator().manual_seed(4)
    fnppo.models.load_full_weights(
        chunks, {n: torch.randn(t.shape, generator=g) * 0.2 for n, t in full.items()}, adapters=True
    )
    sample = [fnppo.Sample.from_lists(ids[0, :PROMPT].tolist(), ids[0, PROMPT:].tolist())]
    (lp,), _ = fnppo.compute_logprobs(fnppo.wrap_ddp(chunks), sample)
    fnppo.lora.save_peft_adapter(chunks, f"{root}/mixtral/experts-only")
    again = fnppo.hf.build_gpt_from_hf(base, dtype="fp32")
    fnppo.hf.load_hf_weights(again, base)
    read = fnppo.lora.lora_config_from_peft(f"{root}/mixtral/experts-only")
    fnppo.lora.apply_lora(again, read)
    fnppo.lora.load_peft_adapter(again, f"{root}/mixtral/experts-only")
    (back,), _ = fnppo.compute_logprobs(fnppo.wrap_ddp(again), sample)
    return {"logprobs": lp, "back": back, "config": config, "read": read}


def _one_process_worker(root: str, ids: dict) -> dict:
    out = _worker(root, ids, ["sequential"], tuple(FORMS))
    out["experts-only"] = _experts_only(root, ids["mixtral"])
    return out


@pytest.fixture(scope="module")
def one_process(reference):
    root, ref = reference
    ids = {f: r["ids"] for f, r in ref.items()}
    return run_ranks(_one_process_worker, 1, str(root), ids, timeout_s=900)[0]


@pytest.fixture(scope="module")
def ep2(reference):
    root, ref = reference
    ids = {f: r["ids"] for f, r in ref.items()}
    return run_ranks(_worker, 2, str(root), ids, ["stacked-ep2"], tuple(FORMS), timeout_s=900)


def _check(reference, got: dict, family: str, form: str) -> float:
    ref = reference[1][family]
    if form == "split":  # experts of every MoE layer loaded; only the dense MLP of qwen3_moe's layer 0 is empty
        assert not any(".experts." in n for n in got["empty"]), got["empty"]
    else:  # the down_proj adapters of layer 0 (target_parameters names layer 1's) are zero
        assert {n.split(".experts.")[0] for n in got["empty"] if ".experts." in n} <= {"decoder.layers.0.mlp"}
    err = float((got["logprobs"].double() - ref[form]["peft"]).abs().max())
    assert err <= TOL, (family, form, err)
    assert float((ref[form]["peft"] - ref["base"]).abs().max()) > 0.05  # the adapters matter
    assert float((got["off"].double() - ref["base"]).abs().max()) <= TOL
    assert got["config"].expert_gate_up == form
    assert dataclasses.replace(got["reread"], seed=got["config"].seed) == got["config"]
    return err


def _key(run: str, family: str, form: str) -> tuple:
    return (run, family) if form == "split" else (run, family, form)


@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("family", list(MOE_FAMILIES))
def test_peft_expert_adapter_gives_peft_logprobs(reference, one_process, family, form):
    _check(reference, one_process[_key("sequential", family, form)], family, form)


@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("family", list(MOE_FAMILIES))
def test_peft_expert_adapter_under_expert_parallelism(reference, ep2, family, form):
    for rank in range(2):
        _check(reference, ep2[rank][_key("stacked-ep2", family, form)], family, form)


def test_fused_form_reads_per_layer_patterns_by_peft_rules(one_process):
    """Layer 1's ``gate_up_proj`` (rank 6, alpha 30) and every ``o_proj`` (alpha 20) are overrides;
    layer 0's expert projections keep ``r`` and ``lora_alpha`` (a suffix rule would change them)."""
    config = one_process[("sequential", "mixtral", "fused")]["config"]
    assert (config.rank, config.alpha, config.expert_gate_up) == (RANK, ALPHA, "fused")
    assert config.rank_alpha("decoder.layers.1.mlp.experts.linear_fc1") == (RANK + 2, 30.0)
    assert config.rank_alpha("decoder.layers.0.mlp.experts.linear_fc1") == (RANK, ALPHA)
    assert config.rank_alpha("decoder.layers.0.self_attention.linear_proj") == (RANK, 20.0)


@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("family", list(MOE_FAMILIES))
def test_expert_adapter_saved_back_loads_into_peft_without_warnings(reference, one_process, ep2, family, form):
    root, ref = reference
    want = load_file(str(root / family / FORMS[form] / "adapter_model.safetensors"))
    seed = 60 + list(MOE_FAMILIES).index(family)
    for run in ("sequential", "stacked-ep2"):
        saved = root / family / f"{run}-{form}-saved"
        got = load_file(str(saved / "adapter_model.safetensors"))
        assert sorted(got) == sorted(want), run
        for k in want:  # PEFT's tensors bit for bit
            assert torch.equal(got[k], want[k]), (run, k)
        if run == "stacked-ep2":
            continue  # the same file (above); peft loads SequentialMLP's
        loaded, caught = peft_load(_base_model(family, seed), str(saved))
        assert caught == [], caught
        adapted = _adapted(loaded)
        assert {n: adapted[n] for n in ref[family][form]["adapted"]} == ref[family][form]["adapted"]
        with torch.no_grad():
            logits = loaded(input_ids=ref[family]["ids"]).logits.float()
        want_logits = ref[family][form]["logits"]
        assert float((logits - want_logits).abs().max()) <= TOL * max(1.0, float(logits.abs().max()))


@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("family", list(MOE_FAMILIES))
def test_merged_export_of_expert_adapters_is_peft_model(reference, ep2, family, form):
    transformers = pytest.importorskip("transformers")
    root, ref = reference
    merged = transformers.AutoModelForCausalLM.from_pretrained(str(root / family / f"stacked-ep2-{form}-merged"))
    with torch.no_grad():
        logits = merged.float().eval()(input_ids=ref[family]["ids"]).logits.float()
    want = ref[family][form]["logits"]
    assert float((logits - want).abs().max()) <= TOL * max(1.0, float(want.abs().max()))


@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("family", list(MOE_FAMILIES))
def test_trained_expert_adapter_saved_gives_fnppo_logprobs_in_peft(reference, one_process, ep2, family, form):
    root, ref = reference
    seed = 60 + list(MOE_FAMILIES).index(family)
    runs = {"sequential": one_process, "stacked-ep2": ep2[0]}
    for run, results in runs.items():
        got = results[_key(run, family, form)]
        assert float((got["after"] - got["logprobs"]).abs().max()) > 1e-3  # the step moved the adapters
        loaded, caught = peft_load(_base_model(family, seed), str(root / family / f"{run}-{form}-trained"))
        assert caught == [], (run, caught)
        with torch.no_grad():
            lp = _logprobs(loaded(input_ids=ref[family]["ids"]).logits, ref[family]["ids"])
        err = float((lp - got["after"].double()).abs().max())
        assert err <= TOL, (run, err)


def test_experts_only_split_adapter_loads_into_peft_without_warnings(reference, one_process):
    """Split-form adapters on the experts only: ranks 2r (gate_up) and r (down), no module for a
    pattern key to match, so down_proj is written zero-padded to 2r; peft loads it without a
    warning, and fnppo reads back the same config and log-probs. Fresh adapters (every B zero) are
    all written, and give the base model in peft."""
    root, ref = reference
    got = one_process["experts-only"]
    assert dataclasses.replace(got["read"], seed=got["config"].seed) == got["config"]
    assert float((got["back"] - got["logprobs"]).abs().max()) == 0.0
    loaded, caught = peft_load(_base_model("mixtral", 62), str(root / "mixtral" / "experts-only"))
    assert caught == [], caught
    with torch.no_grad():
        lp = _logprobs(loaded(input_ids=ref["mixtral"]["ids"]).logits, ref["mixtral"]["ids"])
    assert float((lp - got["logprobs"].double()).abs().max()) <= TOL
    assert float((lp - ref["mixtral"]["base"]).abs().max()) > 0.05
    fresh, caught = peft_load(_base_model("mixtral", 62), str(root / "mixtral" / "experts-fresh"))
    assert caught == [], caught
    assert len(load_file(str(root / "mixtral" / "experts-fresh" / "adapter_model.safetensors"))) == 8  # 2 layers
    with torch.no_grad():
        lp = _logprobs(fresh(input_ids=ref["mixtral"]["ids"]).logits, ref["mixtral"]["ids"])
    assert float((lp - ref["mixtral"]["base"]).abs().max()) <= TOL
