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

import fnppo

ROOT = Path(__file__).resolve().parents[1]

BLOCK_MEGATRON = '''
import importlib.abc, sys

class _NoMegatron(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("megatron", "transformer_engine", "apex"):
            raise ImportError(f"{name} is blocked in this test")
        return None

sys.meta_path.insert(0, _NoMegatron())
'''

PURE_CORE = '''
import json, sys
import torch
import fnppo, fnppo.core.losses, fnppo.core.advantages, fnppo.core.logprob, fnppo.core.batch
from fnppo.core.batch import Sample, SplitPlan, collate_microbatch, split_batch, unpack_per_sample
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
    lp, ent = fnppo.core.logprob.logprob_and_entropy(logits, mb.labels)
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
'''


def _run(code: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env,
                         cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_pure_core_runs_with_megatron_unimportable():
    r = _run(BLOCK_MEGATRON + PURE_CORE)
    assert r["megatron"] == []
    assert r["grad_finite"] and r["loss"] == r["loss"]  # finite, not NaN
    assert r["restored"] == [3, 2]  # response lengths, back in sample order
    assert r["adv"][0][0] > 0 > r["adv"][0][1]
    # only the pure core was loaded (and the warning filters that fnppo installs before any Megatron import)
    outside = [m for m in r["fnppo"] if not (m == "fnppo.core" or m.startswith("fnppo.core."))]
    assert set(outside) <= {"fnppo", "fnppo.megatron", "fnppo.megatron.quiet"}, outside


def test_megatron_names_fail_only_when_used():
    r = _run(BLOCK_MEGATRON + '''
import json
import fnppo
try:
    fnppo.PackedDotProductAttention
    err = None
except ImportError as e:
    err = str(e)
print(json.dumps({"err": err}))
''')
    assert r["err"] and "blocked" in r["err"]


def test_import_fnppo_is_lazy():
    r = _run('''
import json, sys
import fnppo
loaded = sorted(m for m in sys.modules if m.split(".")[0] == "megatron" or m.startswith("fnppo."))
fnppo.train_step  # a lazy name: its module is imported now
print(json.dumps({"loaded": loaded, "after": "fnppo.steps.step" in sys.modules}))
''')
    assert not any(m.startswith("megatron") for m in r["loaded"]), r["loaded"]
    heavy = {"fnppo.megatron.attention", "fnppo.megatron.model", "fnppo.steps.step", "fnppo.megatron.grads", "fnppo.io.checkpoint", "fnppo.io.hf",
             "fnppo.megatron.parallel", "fnppo.testing", "fnppo.megatron.runtime", "fnppo.megatron.config", "fnppo.megatron.build",
             "fnppo.megatron.forward", "fnppo.megatron.weights", "fnppo.megatron.layer_specs", "fnppo.megatron.core_attention",
             "fnppo.megatron.fused_rope", "fnppo.megatron.routing", "fnppo.megatron.moe", "fnppo.megatron.vlm_model"}
    assert not heavy & set(r["loaded"]), r["loaded"]
    assert r["after"]


def test_all_names_resolve():
    assert len(fnppo.__all__) == len(set(fnppo.__all__))
    for name in fnppo.__all__:
        assert getattr(fnppo, name) is not None, name
    assert set(fnppo.__all__) <= set(dir(fnppo))
    # the names that moved out of loss.py / batch.py still import from there
    from fnppo.core.batch import SplitPlan, split_batch
    from fnppo.core.loss import PolicyLossInputs, Segments, finalize_metrics, merge_metrics, weighted_metric
    from fnppo.core.losses import PolicyInputs

    assert SplitPlan is fnppo.core.split.SplitPlan and split_batch is fnppo.core.split.split_batch
    assert PolicyLossInputs is PolicyInputs is fnppo.PolicyLossInputs and Segments is fnppo.core.segments.Segments
    assert (merge_metrics, finalize_metrics, weighted_metric) == (
        fnppo.core.metrics.merge_metrics, fnppo.core.metrics.finalize_metrics, fnppo.core.metrics.weighted_metric)
    for module in (fnppo.core.loss, fnppo.core.batch):
        for name in module.__all__:
            assert getattr(module, name) is not None, f"{module.__name__}.{name}"
