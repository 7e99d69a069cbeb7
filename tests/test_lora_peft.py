"""LoRA against an independent reference: ``peft`` on the ``transformers`` model.

A tiny Qwen2 (q/k/v biases, grouped queries, tied embeddings; the configs of ``tests/test_hf.py``)
gets a PEFT LoRA adapter on every projection (q, k, v, o, gate, up, down) with random ``A`` and ``B``
(``init_lora_weights=False``), saved by ``peft``. Under TP=2 and PP=2 (one 2-rank launch) fnppo
builds the model from the checkpoint, puts adapters of the adapter's rank and alpha on it
(``lora_config_from_peft``), loads PEFT's file and must give PEFT's log-probs within 1e-5 (fp32);
the adapter-free parameter set must give the base model's (transformers without the adapter). The
adapter saved back in PEFT's format equals PEFT's file bit for bit, and the merged export
(``export_hf_weights``; ``stream_hf_weights`` streams the same tensors) loaded by transformers gives
PEFT's logits within 1e-5.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import fnppo
from fnppo.testing import run_ranks
from tests.test_hf import FAMILIES, _hf_model

RANK, ALPHA = 4, 12.0
SEQ, PROMPT = 12, 4
TOL = 1e-5
PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _logprobs(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Log-probs of the response tokens ``ids[0, PROMPT:]`` from ``[1, SEQ, V]`` logits (float64)."""
    lp = torch.log_softmax(logits.double()[0, PROMPT - 1 : -1], dim=-1)
    return lp.gather(-1, ids[0, PROMPT:, None])[:, 0]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Base checkpoint, PEFT adapter, token ids, and transformers' / PEFT's log-probs and logits."""
    peft = pytest.importorskip("peft")
    root = tmp_path_factory.mktemp("lora-peft")
    vocab = FAMILIES["qwen2"][1]["vocab_size"]
    model = _hf_model("qwen2", seed=41)
    model.save_pretrained(str(root / "base"))
    ids = torch.randint(0, vocab, (1, SEQ), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        base_logits = model(input_ids=ids).logits.float()
    torch.manual_seed(5)
    config = peft.LoraConfig(
        r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=PROJECTIONS, init_lora_weights=False
    )
    adapted = peft.get_peft_model(model, config).eval()
    adapted.save_pretrained(str(root / "adapter"))
    with torch.no_grad():
        logits = adapted(input_ids=ids).logits.float()
    return {
        "root": root,
        "ids": ids,
        "peft_logits": logits,
        "peft": _logprobs(logits, ids),
        "base": _logprobs(base_logits, ids),
    }


def _worker(root: str, ids: torch.Tensor) -> dict:
    out = {}
    for name, (tp, pp) in {"tp2": (2, 1), "pp2": (1, 2)}.items():
        fnppo.init_parallel(tp, pp, seed=1234, device="cpu", timeout_s=120.0)
        base, adapter = f"{root}/base", f"{root}/adapter"
        chunks = fnppo.hf.build_gpt_from_hf(base)
        fnppo.hf.load_hf_weights(chunks, base)
        fnppo.lora.apply_lora(chunks, fnppo.lora.lora_config_from_peft(adapter))
        empty = fnppo.lora.load_peft_adapter(chunks, adapter)
        model = fnppo.wrap_ddp(chunks)
        sample = [fnppo.Sample.from_lists(ids[0, :PROMPT].tolist(), ids[0, PROMPT:].tolist())]
        (lp,), _ = fnppo.compute_logprobs(model, sample)
        (off,), _ = fnppo.compute_logprobs(model, sample, params=fnppo.lora.adapters_off(model))
        fnppo.lora.save_peft_adapter(model, f"{root}/{name}-adapter")
        blocked = Path(root) / f"{name}-blocked"  # the weights file's name taken by a directory
        (blocked / "adapter_model.safetensors").mkdir(parents=True, exist_ok=True)
        try:
            fnppo.lora.save_peft_adapter(model, blocked)
            out[f"{name}-blocked"] = "no error"
        except Exception as err:  # noqa: BLE001 - the type and message are what is tested
            out[f"{name}-blocked"] = f"{type(err).__name__}: {err}"
        fnppo.hf.export_hf_weights(model, f"{root}/{name}-merged", hf_config=base)
        streamed = {k: v.clone() for k, v in itertools.chain.from_iterable(fnppo.hf.stream_hf_weights(model))}
        out[name] = {"logprobs": lp, "off": off, "empty": empty, "streamed": streamed}
    return out


@pytest.fixture(scope="module")
def runs(reference):
    return run_ranks(_worker, 2, str(reference["root"]), reference["ids"], timeout_s=900)


@pytest.mark.parametrize("layout", ["tp2", "pp2"])
def test_peft_adapter_gives_peft_logprobs(reference, runs, layout):
    for rank in range(2):
        got = runs[rank][layout]
        assert got["empty"] == []
        err = float((got["logprobs"].double() - reference["peft"]).abs().max())
        assert err <= TOL, (layout, rank, err)
        gap = float((reference["peft"] - reference["base"]).abs().max())
        assert gap > 0.05, gap  # the adapter matters
        err_off = float((got["off"].double() - reference["base"]).abs().max())
        assert err_off <= TOL, (layout, rank, err_off)


@pytest.mark.parametrize("layout", ["tp2", "pp2"])
def test_adapter_saved_back_is_peft_file(reference, runs, layout):  # runs: writes the adapters
    want = load_file(str(reference["root"] / "adapter" / "adapter_model.safetensors"))
    got = load_file(str(reference["root"] / f"{layout}-adapter" / "adapter_model.safetensors"))
    assert sorted(got) == sorted(want)
    for k in want:
        assert torch.equal(got[k], want[k]), k
    peft = pytest.importorskip("peft")
    cfg = peft.PeftConfig.from_pretrained(str(reference["root"] / f"{layout}-adapter"))
    assert (cfg.r, cfg.lora_alpha, sorted(cfg.target_modules)) == (RANK, ALPHA, sorted(PROJECTIONS))


@pytest.mark.parametrize("layout", ["tp2", "pp2"])
def test_merged_export_is_the_adapted_model(reference, runs, layout):
    transformers = pytest.importorskip("transformers")
    path = reference["root"] / f"{layout}-merged"
    merged = transformers.AutoModelForCausalLM.from_pretrained(str(path)).float().eval()
    with torch.no_grad():
        logits = merged(input_ids=reference["ids"]).logits.float()
    err = float((logits - reference["peft_logits"]).abs().max())
    assert err <= TOL * max(1.0, float(reference["peft_logits"].abs().max())), err
    files = {}
    for f in path.glob("*.safetensors"):
        files.update(load_file(str(f)))
    streamed = runs[0][layout]["streamed"]
    assert sorted(streamed) == sorted(files)
    assert all(torch.equal(streamed[k], files[k]) for k in files)


@pytest.mark.parametrize("layout", ["tp2", "pp2"])
def test_an_adapter_rank0_cannot_write_is_a_checkpoint_error_on_every_rank(runs, layout):
    for rank in range(2):
        msg = runs[rank][f"{layout}-blocked"]
        head = "CheckpointError: fnppo.lora.save_peft_adapter: argument 'path' expected a directory rank 0 can write"
        assert msg.startswith(head) and "-blocked" in msg and "Is a directory" in msg, (rank, msg)
