"""LoRA against ``peft``: max |log-prob difference| of fnppo's adapted forward (fp32) against ``peft`` on
the ``transformers`` model in fp32 and in float64, for a dense Qwen2 and the three MoE families
(Qwen3-MoE, Qwen2-MoE, Mixtral; expert adapters in PEFT's ``target_parameters`` form), with
Megatron's ``SequentialMLP`` experts and fnppo's stacked experts in one process, stacked under EP=2.

The tiny random models and adapters of ``tests/test_lora_peft.py`` / ``tests/test_lora_peft_experts.py``
(CPU, seconds). ``peft`` in float64 is the reference: how far fp32 rounding takes each side.

    python benchmarks/lora_peft.py
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fnppo.testing import run_ranks  # noqa: E402
from tests.test_lora_peft_experts import (  # noqa: E402
    ALPHA,
    ATTENTION,
    MOE_FAMILIES,
    RANK,
    SEQ,
    _base_model,
    _block_diagonal,
    _logprobs,
    _worker,
)


def _reference(root: Path, family: str, seed: int) -> dict:
    import peft

    from tests.test_hf import _COMMON, _hf_model

    dense = family == "qwen2"
    model = _hf_model("qwen2", seed=seed) if dense else _base_model(family, seed)
    model.save_pretrained(str(root / family / "base"))
    ids = torch.randint(0, _COMMON["vocab_size"], (1, SEQ), generator=torch.Generator().manual_seed(seed))
    torch.manual_seed(seed)
    mlp = ["gate_proj", "up_proj", "down_proj"]
    if dense:
        config = peft.LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=ATTENTION + mlp, init_lora_weights=False)
    else:
        config = peft.LoraConfig(
            r=RANK,
            lora_alpha=ALPHA,
            target_modules=ATTENTION + (mlp if family == "qwen2_moe" else []),
            target_parameters=["gate_up_proj", "down_proj"],
            rank_pattern={r".*\.gate_up_proj": 2 * RANK},
            alpha_pattern={r".*\.gate_up_proj": 2 * ALPHA},
            init_lora_weights=False,
        )
    adapted = peft.get_peft_model(model, config).eval()
    if not dense:
        _block_diagonal(adapted, 4)
    adapted.save_pretrained(str(root / family / "adapter"))
    with torch.no_grad():
        fp32 = _logprobs(adapted(input_ids=ids).logits, ids)
        model.config._experts_implementation = "eager"  # transformers' grouped_mm takes no float64
        f64 = _logprobs(adapted.double()(input_ids=ids).logits, ids)
    return {"ids": ids, "fp32": fp32, "f64": f64}


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        families = ["qwen2", *MOE_FAMILIES]
        refs = {f: _reference(root, f, seed=90 + i) for i, f in enumerate(families)}
        ids = {f: r["ids"] for f, r in refs.items()}
        moe = {f: ids[f] for f in MOE_FAMILIES}
        one = run_ranks(_worker, 1, str(root), ids, ["sequential"], timeout_s=900)[0]
        one.update(run_ranks(_worker, 1, str(root), moe, ["stacked"], timeout_s=900)[0])
        two = run_ranks(_worker, 2, str(root), moe, ["stacked-ep2"], timeout_s=900)
        print(f"{'family':10} {'experts':12} {'vs peft fp32':>13} {'vs peft f64':>12} {'peft fp32 vs f64':>17}")
        for f in families:
            runs = [("sequential", one)] + ([] if f == "qwen2" else [("stacked", one)])
            runs += [] if f == "qwen2" else [("stacked-ep2", two[r]) for r in range(2)]
            for run, res in runs:
                lp = res[(run, f)]["logprobs"].double()
                name = "dense" if f == "qwen2" else run
                print(
                    f"{f:10} {name:12} {float((lp - refs[f]['fp32']).abs().max()):13.2e} "
                    f"{float((lp - refs[f]['f64']).abs().max()):12.2e} "
                    f"{float((refs[f]['fp32'] - refs[f]['f64']).abs().max()):17.2e}"
                )


if __name__ == "__main__":
    main()
