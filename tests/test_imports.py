"""The package layout: the pure-torch core works without Megatron, Megatron names load lazily.

Each check runs in a fresh interpreter (``subprocess``), because this test session has imported
Megatron already.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import fnppo

ROOT = Path(__file__).resolve().parents[1]

BLOCK_MEGATRON = """
import importlib.abc, sys

class _NoMegatron(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("megatron", "transformer_engine", "apex"):
            raise ImportError(f"{name} is blocked in this test")
        return None

sys.meta_path.insert(0, _NoMegatron())
"""

PURE_CORE = """
import json, sys
import torch
import fnppo, fnppo.losses, fnppo.advantages, fnppo.kl, fnppo.metrics, fnppo.batching, fnppo.ops, fnppo.typing
from fnppo.core.batching.sample import Sample
from fnppo.core.batching.split import SplitPlan, split_batch
from fnppo.core.batching.collate import collate_microbatch, unpack_per_sample
from fnppo.core.losses import LossConfig, loss_normalizer, ppo_clip, ppo_loss

samples = [Sample.from_lists([1, 2], [3, 4, 5], advantages=1.0, old_logprobs=[-1.0, -1.5, -2.0]),
           Sample.from_lists([6], [7, 8], advantages=-0.5, old_logprobs=[-0.5, -0.7])]
plan = split_batch(samples, num_microbatches=2)
mbs = [collate_microbatch(g, pad_to_multiple_of=2) for g in plan.apply(samples)]
cfg = LossConfig(policy=ppo_clip(), entropy_coef=0.01)
norm = sum(loss_normalizer(mb.loss_mask, cfg.agg) for mb in mbs)
torch.manual_seed(0)
total, per_sample = 0.0, []
for mb in mbs:
    logits = torch.randn(*mb.input_ids.shape, 16, requires_grad=True)
    lp, ent = fnppo.core.ops.logprob.logprob_and_entropy(logits, mb.labels)
    loss, metrics = ppo_loss(lp, mb.old_logprobs, mb.advantages, mb.loss_mask, cfg, entropy=ent,
                             normalizer=norm, seq_ids=mb.seq_ids)
    loss.backward()
    total += float(loss)
    per_sample.append([t.tolist() for t in unpack_per_sample(lp.detach(), mb)])
adv = fnppo.core.advantages.grpo_advantages(torch.tensor([[1.0, 0.0, 1.0, 0.0]]))
print(json.dumps({
    "loss": total,
    "grad_finite": bool(torch.isfinite(logits.grad).all()),
    "restored": [len(x) for x in plan.restore(per_sample)],
    "adv": adv.tolist(),
    "megatron": sorted(m for m in sys.modules if m.split(".")[0] == "megatron"),
    "fnppo": sorted(m for m in sys.modules if m.startswith("fnppo")),
}))
"""


def _run(code: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300
    )
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_pure_core_runs_with_megatron_unimportable():
    r = _run(BLOCK_MEGATRON + PURE_CORE)
    assert r["megatron"] == []
    assert r["grad_finite"] and r["loss"] == r["loss"]  # finite, not NaN
    assert r["restored"] == [3, 2]  # response lengths, back in sample order
    assert r["adv"][0][0] > 0 > r["adv"][0][1]
    # only the pure core and its namespaces were loaded (and the warning filters installed before Megatron)
    outside = [m for m in r["fnppo"] if not (m == "fnppo.core" or m.startswith("fnppo.core."))]
    pure = {f"fnppo.{ns}" for ns in fnppo._PURE}
    assert set(outside) <= {"fnppo", "fnppo.megatron", "fnppo.megatron.quiet", *pure}, outside


def test_megatron_names_fail_only_when_used():
    r = _run(
        BLOCK_MEGATRON
        + """
import json
import pytest

import fnppo
errors = {}
for name in ("train_step", "build_gpt", "models", "parallel"):
    try:
        getattr(fnppo, name)
        errors[name] = None
    except ImportError as e:
        errors[name] = str(e)
print(json.dumps(errors))
"""
    )
    assert all(err and "blocked" in err for err in r.values()), r


def test_import_fnppo_is_lazy():
    r = _run("""
import json, sys
import pytest

import fnppo
loaded = sorted(m for m in sys.modules if m.split(".")[0] == "megatron" or m.startswith("fnppo."))
fnppo.train_step  # a name that needs Megatron: the steps are imported now
print(json.dumps({"loaded": loaded, "after": "fnppo.steps.train" in sys.modules}))
""")
    assert not any(m.startswith("megatron") for m in r["loaded"]), r["loaded"]
    outside = [m for m in r["loaded"] if not (m == "fnppo.core" or m.startswith("fnppo.core."))]
    assert set(outside) <= {"fnppo.megatron", "fnppo.megatron.quiet"}, outside
    assert r["after"]


def test_the_top_level_is_small_and_every_name_resolves():
    """About 30 names at the top; every name of every namespace resolves; no name is in __all__ twice."""
    assert len(fnppo.__all__) == len(set(fnppo.__all__)) <= 32
    for name in fnppo.__all__:
        assert getattr(fnppo, name) is not None, name
    assert set(fnppo.__all__) <= set(dir(fnppo))
    for ns in (*fnppo._PURE, *fnppo._MEGATRON):
        module = getattr(fnppo, ns)
        for name in module.__all__:
            assert getattr(module, name) is not None, f"fnppo.{ns}.{name}"
    # a top-level name is the object of its namespace, not a copy
    assert fnppo.train_step is fnppo.steps.train_step and fnppo.build_gpt is fnppo.models.build_gpt
    assert fnppo.LossConfig is fnppo.losses.LossConfig and fnppo.Sample is fnppo.batching.Sample
    with pytest.raises(AttributeError, match="no attribute 'PolicyLossConfig'"):
        fnppo.PolicyLossConfig  # noqa: B018 - the flat 30-field config is gone (fnppo.losses.from_flat)
