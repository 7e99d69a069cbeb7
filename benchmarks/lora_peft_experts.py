"""MoE expert adapters against ``peft``, both of PEFT's forms: max |log-prob difference| per family.

The tiny random models and adapters of ``tests/test_lora_peft_experts.py`` (CPU, fp32; Qwen3-MoE,
Qwen2-MoE, Mixtral; the ``split`` form: PEFT's rank-``2r`` ``gate_up_proj`` adapter with a
block-diagonal ``B``; the ``fused`` form: PEFT's own rank-``r`` adapter of the fused parameter, with
per-layer ``rank_pattern`` / ``alpha_pattern``, rsLoRA for Qwen2-MoE). Two directions:

* ``peft -> fnppo``: PEFT's file loaded by fnppo (``SequentialMLP`` and stacked experts in one
  process, stacked experts under EP=2) against ``peft`` on ``transformers``;
* ``fnppo -> peft``: after one fnppo ``train_step`` (``SequentialMLP`` in one process, stacked under
  EP=2), the saved adapter loaded by ``peft`` against fnppo's log-probs (and the count of warnings
  ``peft`` gave on the load).

    python benchmarks/lora_peft_experts.py
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fnppo.testing import run_ranks  # noqa: E402
from tests.test_lora_peft_experts import (  # noqa: E402
    FORMS,
    MOE_FAMILIES,
    _base_model,
    _logprobs,
    _worker,
    build_references,
    peft_load,
)


def _key(run: str, family: str, form: str) -> tuple:
    return (run, family) if form == "split" else (run, family, form)


def _to_peft(root: Path, ref: dict, got: dict, family: str, form: str, run: str) -> tuple[float, int]:
    seed = 60 + list(MOE_FAMILIES).index(family)
    loaded, caught = peft_load(_base_model(family, seed), str(root / family / f"{run}-{form}-trained"))
    with torch.no_grad():
        lp = _logprobs(loaded(input_ids=ref[family]["ids"]).logits, ref[family]["ids"])
    return float((lp - got[_key(run, family, form)]["after"].double()).abs().max()), len(caught)


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root, ref = build_references(Path(tmp))
        ids = {f: r["ids"] for f, r in ref.items()}
        one = run_ranks(_worker, 1, str(root), ids, ["sequential", "stacked"], tuple(FORMS), timeout_s=900)[0]
        two = run_ranks(_worker, 2, str(root), ids, ["stacked-ep2"], tuple(FORMS), timeout_s=900)
        print(
            "| family | form | peft -> fnppo, sequential | stacked | stacked EP=2 | fnppo -> peft, sequential | EP=2 |"
        )
        print("|---|---|---|---|---|---|---|")
        for family in MOE_FAMILIES:
            for form in FORMS:
                want = ref[family][form]["peft"]
                cells = []
                for run, res in (
                    ("sequential", one),
                    ("stacked", one),
                    ("stacked-ep2", two[0]),
                    ("stacked-ep2", two[1]),
                ):
                    cells.append(float((res[_key(run, family, form)]["logprobs"].double() - want).abs().max()))
                ep2 = max(cells[2:])  # both ranks
                back = [
                    _to_peft(root, ref, res, family, form, run)
                    for run, res in (("sequential", one), ("stacked-ep2", two[0]))
                ]
                warned = sum(n for _, n in back)
                row = [f"{cells[0]:.1e}", f"{cells[1]:.1e}", f"{ep2:.1e}", f"{back[0][0]:.1e}", f"{back[1][0]:.1e}"]
                print(
                    f"| {family} | {form} | "
                    + " | ".join(row)
                    + " |"
                    + (f" ({warned} peft warnings)" if warned else "")
                )


if __name__ == "__main__":
    main()
