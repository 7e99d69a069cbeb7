"""The toy's ``--sync``: the sampler as an engine of its own, running only the weights streamed to it.

Three steps of the toy per mode (one process): ``--sync full`` and ``--sync delta`` (the delta applied
by ``apply_hf_deltas``, digests checked) give the rewards, losses and gradient norms of ``--sync off``
bit for bit (the sampler holds the trainer's bits); ``--sync fp8-delta`` gives those of ``--sync fp8``
bit for bit and the same final sampler weights (the deltas rebuild the FP8 codes and scales exactly),
while the FP8 sampler is another policy than the trainer (its off-policy KL is reported and > 0, its
weights are the dequantized E4M3 codes, not the trainer's). Each update's bytes on the wire are in
the metrics: FP8 sends fewer than bf16/fp32.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.test_example import _run

ARGS = ["--steps", "3", "--prompts", "4", "--group-size", "8", "--no-plot", "--no-progress", "--target-reward", "0"]
MODES = ["off", "full", "delta", "fp8", "fp8-delta"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("toy-sync")
    out = {}
    for mode in MODES:
        d = root / mode
        stdout = _run([*ARGS, "--sync", mode, "--out-dir", str(d)], cwd=root)
        rows = [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()]
        out[mode] = (d, rows, stdout)
    return out


def _trajectory(rows: list[dict]) -> list[tuple]:
    return [(r["reward"], r["loss"], r["grad_norm"]) for r in rows]


def test_full_and_delta_syncs_sample_with_the_trainers_bits(runs):
    off = _trajectory(runs["off"][1])
    assert _trajectory(runs["full"][1]) == off and _trajectory(runs["delta"][1]) == off
    for mode in ("full", "delta"):
        assert all(r["sync/bytes"] > 0 for r in runs[mode][1])
        assert f"sync {mode}:" in runs[mode][2]
        assert "offpolicy/kl_behaviour_k3" not in runs[mode][1][0]


def test_fp8_delta_sync_rebuilds_the_fp8_weights_exactly_and_the_sampler_runs_them(runs):
    assert _trajectory(runs["fp8-delta"][1]) == _trajectory(runs["fp8"][1])
    a = load_file(str(Path(runs["fp8"][0]) / "sampler-weights" / "model.safetensors"))
    b = load_file(str(Path(runs["fp8-delta"][0]) / "sampler-weights" / "model.safetensors"))
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    plain = load_file(str(Path(runs["delta"][0]) / "sampler-weights" / "model.safetensors"))
    proj = [k for k in a if k.endswith("_proj.weight")]
    assert proj and all(not torch.equal(a[k], plain[k]) for k in proj)  # the FP8 sampler's own weights
    g = math.gcd(*[d for k in proj for d in a[k].shape])
    b = max(2**i for i in range(8) if g % 2**i == 0)  # the toy's block: a power of two dividing every projection
    for k in proj:  # one scale per block: at most 127 magnitudes (E4M3's finite non-negative codes) in each
        blocks = a[k].reshape(a[k].shape[0] // b, b, -1, b).transpose(1, 2).reshape(-1, b * b)
        assert max(len(torch.unique(x.abs())) for x in blocks) <= 127 < len(torch.unique(plain[k][:b, :b].abs()))
    assert _trajectory(runs["fp8"][1]) != _trajectory(runs["off"][1])
    kl = [r["offpolicy/kl_behaviour_k3"] for r in runs["fp8"][1]]
    assert all(0 < x < 0.05 for x in kl), kl
    for step in range(3):  # FP8 puts fewer bytes on the wire than the trainer's fp32
        assert runs["fp8"][1][step]["sync/bytes"] < 0.5 * runs["full"][1][step]["sync/bytes"]
        assert runs["fp8-delta"][1][step]["sync/bytes"] <= runs["fp8"][1][step]["sync/bytes"]
