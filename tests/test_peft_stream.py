"""``fnppo.hf.stream_peft_adapter``: a LoRA run's adapters to an engine in PEFT's layout, per step.

A dense Qwen2 (TP=2) and a Qwen2-MoE with expert adapters (fnppo's stacked experts under EP=2) get
PEFT adapters loaded, then changed as a training step would change them (every adapter scaled);
the streamed ``(adapter_config, tensors)`` are given to ``peft`` on the ``transformers`` model
(``get_peft_model`` with that config, ``set_peft_model_state_dict`` with those tensors), whose
log-probs must equal fnppo's after the change within 1e-5 (fp32) and differ from those before it.
"""

from __future__ import annotations

import pytest
import torch

import fnppo
from fnppo.core.errors import InputError
from fnppo.testing import run_ranks
from tests.messages import check_message
from tests.test_hf import _COMMON, _hf_model
from tests.test_lora_peft_experts import _base_model, _block_diagonal

RANK, ALPHA, SEQ, PROMPT, TOL = 4, 12.0, 12, 4, 1e-5
CASES = {"qwen2": (2, 1, None), "qwen2_moe": (1, 2, "stacked")}  # family -> (tp, ep, experts)


def _logprobs(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    lp = torch.log_softmax(logits.double()[0, PROMPT - 1 : -1], dim=-1)
    return lp.gather(-1, ids[0, PROMPT:, None])[:, 0]


def _base(family: str):
    return _hf_model("qwen2", seed=41).eval() if family == "qwen2" else _base_model("qwen2_moe", seed=61)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    peft = pytest.importorskip("peft")
    root = tmp_path_factory.mktemp("peft-stream")
    ids = torch.randint(0, _COMMON["vocab_size"], (1, SEQ), generator=torch.Generator().manual_seed(9))
    for family in CASES:
        model = _base(family)
        model.save_pretrained(str(root / family / "base"))
        moe = family != "qwen2"
        config = peft.LoraConfig(
            r=RANK,
            lora_alpha=ALPHA,
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj"] + ([] if moe else ["gate_proj", "up_proj"]),
            target_parameters=["gate_up_proj", "down_proj"] if moe else None,
            rank_pattern={r".*\.gate_up_proj": 2 * RANK} if moe else {},
            alpha_pattern={r".*\.gate_up_proj": 2 * ALPHA} if moe else {},
            init_lora_weights=False,
        )
        torch.manual_seed(5)
        adapted = peft.get_peft_model(model, config).eval()
        if moe:
            _block_diagonal(adapted, 4)
        adapted.save_pretrained(str(root / family / "adapter"))
    return root, ids


def _worker(root: str, ids: torch.Tensor) -> dict:
    from fnppo.hf import stream_peft_adapter

    out = {}
    for family, (tp, ep, experts) in CASES.items():
        fnppo.init_parallel(tp=tp, ep=ep, seed=1234, device="cpu", timeout_s=120.0)
        base, adapter = f"{root}/{family}/base", f"{root}/{family}/adapter"
        chunks = fnppo.hf.build_gpt_from_hf(base, dtype="fp32", moe_experts=experts)
        fnppo.hf.load_hf_weights(chunks, base)
        fnppo.lora.apply_lora(chunks, fnppo.lora.lora_config_from_peft(adapter))
        fnppo.lora.load_peft_adapter(chunks, adapter)
        model = fnppo.wrap_ddp(chunks)
        sample = [fnppo.Sample.from_lists(ids[0, :PROMPT].tolist(), ids[0, PROMPT:].tolist())]
        (before,), _ = fnppo.compute_logprobs(model, sample)
        with torch.no_grad():  # a step's change of the adapters (zeros stay zero: PEFT's structure kept)
            for c in chunks:
                for name, p in fnppo.models.unwrap_model(c).named_parameters():
                    if fnppo.lora.is_adapter(p) and name.endswith("lora_B"):
                        p.copy_(p * 1.5)
        (after,), _ = fnppo.compute_logprobs(model, sample)
        config, tensors = stream_peft_adapter(model)
        fnppo.lora.save_peft_adapter(model, f"{root}/{family}/saved")
        out[family] = {"before": before, "after": after, "config": config, "tensors": tensors}
    try:
        stream_peft_adapter(model, tmp_dir="/nonexistent/dir")
    except InputError as err:
        out["bad-tmp"] = str(err)
    return out


@pytest.fixture(scope="module")
def streamed(adapters):
    root, ids = adapters
    return run_ranks(_worker, 2, str(root), ids, timeout_s=900)


@pytest.mark.parametrize("family", list(CASES))
def test_streamed_adapter_in_peft_gives_fnppo_logprobs(adapters, streamed, family):
    peft = pytest.importorskip("peft")
    from safetensors.torch import load_file

    root, ids = adapters
    got = streamed[0][family]
    assert all(streamed[1][family][k] in (None, []) for k in ("config", "tensors"))  # rank 0 receives
    names = [n for n, _ in got["tensors"]]
    assert names == sorted(names) and all(n.startswith("base_model.model.") for n in names)
    saved = load_file(str(root / family / "saved" / "adapter_model.safetensors"))  # the save path's file
    assert sorted(saved) == names and all(torch.equal(saved[n], t) for n, t in got["tensors"])
    model = peft.get_peft_model(_base(family), peft.get_peft_config(got["config"])).eval()
    _, unexpected = peft.set_peft_model_state_dict(model, dict(got["tensors"]))
    assert not unexpected
    with torch.no_grad():
        lp = _logprobs(model(input_ids=ids).logits.float(), ids)
    for rank in range(2):
        assert float((lp - streamed[rank][family]["after"].double()).abs().max()) <= TOL, (family, rank)
    assert float((lp - got["before"].double()).abs().max()) > 0.01  # the change matters


def test_a_bad_tmp_dir_is_refused(streamed):
    check_message(
        InputError(streamed[0]["bad-tmp"]),
        InputError,
        "stream_peft_adapter",
        "tmp_dir",
        "an existing directory",
        "/nonexistent",
    )
