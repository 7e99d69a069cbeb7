"""The toy's ``--partial-rollouts``: responses continued across weight updates, each token with its version."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.test_example import SMALL, _rows, _run

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

from toy import checks, cli  # noqa: E402
from toy.errors import ArgumentError  # noqa: E402
from toy.partial import version_schedule  # noqa: E402
from toy.task import RESPONSE_LEN  # noqa: E402

sys.path.insert(0, str(ROOT / "benchmarks"))
from partial_rollouts import table  # noqa: E402


def test_version_schedule_starts_with_the_oldest_weights_and_only_moves_on():
    index = version_schedule(0, 7, 512, 5)
    assert index.shape == (512, RESPONSE_LEN) and (index[:, 0] == 0).all()
    steps = index[:, 1:] - index[:, :-1]
    assert ((steps == 0) | (steps == 1)).all() and int(index.max()) == RESPONSE_LEN - 1  # at most one move per token
    assert 0.4 < float(steps.float().mean()) < 0.6  # moves with probability 1/2
    assert (version_schedule(0, 7, 512, 2) == index.clamp_max(1)).all()  # never past the newest weights
    assert (version_schedule(0, 7, 512, 5) == index).all() and not (version_schedule(0, 8, 512, 5) == index).all()


@pytest.mark.parametrize("argv", [["--partial-rollouts"], ["--partial-rollouts", "--staleness", "0"]])
def test_partial_rollouts_need_a_staleness(argv, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args = cli.parse_args(argv)
    with pytest.raises(ArgumentError) as err:
        checks.validate_args(args, 1, cuda_available=False)
    assert str(err.value).startswith("--partial-rollouts continues responses across weight updates: it needs "), err
    assert not any(tmp_path.iterdir())


def test_partial_rollouts_train_each_token_at_its_own_age(tmp_path):
    """Step t (0-based) samples with the weights of versions max(0, t - K) .. t: every token of the first
    step is on-policy (age 0), later steps mix ages up to min(t, K); the loss reads the same ages
    (``token_staleness``, reduced by the step) as ``Staleness.prepare`` gave the samples. The newer
    weights do sample: at the second step (ages 0 and 1, about half the tokens 1 update old) the KL
    between the sampler and the trainer is well below the per-sample run's (every token 1 update old)."""
    _run(
        [
            *SMALL,
            "--steps",
            "3",
            "--staleness",
            "2",
            "--partial-rollouts",
            "--policy-loss",
            "decoupled",
            "--out-dir",
            str(tmp_path / "run"),
        ]
    )
    rows = _rows(tmp_path / "run" / "metrics.jsonl")
    assert [r["offpolicy/token_staleness_max"] for r in rows] == [0.0, 1.0, 2.0]
    means = [r["offpolicy/token_staleness_mean"] for r in rows]
    assert means[0] == 0.0 and 0.0 < means[1] < 1.0 and 0.0 < means[2] < 2.0, means
    for r in rows:
        assert r["token_staleness"] == pytest.approx(r["offpolicy/token_staleness_mean"], abs=1e-6)
    assert rows[0]["offpolicy/kl_behaviour_k3"] < 1e-6 < rows[2]["offpolicy/kl_behaviour_k3"]
    _run(
        [
            *SMALL,
            "--steps",
            "2",
            "--staleness",
            "2",
            "--policy-loss",
            "decoupled",
            "--out-dir",
            str(tmp_path / "per-sample"),
        ]
    )
    per_sample = _rows(tmp_path / "per-sample" / "metrics.jsonl")
    assert 0.0 < rows[1]["offpolicy/kl_behaviour_k3"] < 0.8 * per_sample[1]["offpolicy/kl_behaviour_k3"]


def test_benchmark_table_compares_the_modes_over_the_seeds_both_have():
    def row(mode, k, seed, final, reach, age, kl):
        return {"mode": mode, "staleness": k, "seed": seed, "final": final, "reach": reach, "token_age": age, "kl": kl}

    rows = [
        row("per-sample", 2, 0, 0.90, 50, 2.0, 0.1),
        row("per-sample", 2, 1, 0.94, None, 2.0, 0.3),
        row("partial", 2, 0, 0.93, 40, 1.0, 0.05),
        row("partial", 2, 1, 0.96, 44, 1.5, 0.05),
        row("partial", 2, 2, 0.10, None, 1.0, 0.05),  # no per-sample run of seed 2: left out
        row("per-sample", 4, 0, 0.97, 60, 4.0, 0.2),
        row("partial", 4, 0, 0.98, 30, 3.0, 0.1),
    ]
    lines = table(rows, [2, 4, 8], 0.02).splitlines()
    assert len(lines) == 4  # header, separator, K = 2 and 4 (no run of K = 8)
    assert (
        lines[2]
        == "| 2 | 0, 1 | 0.920 (0.900) | 0.945 (0.930) | +0.025 | no | 50 (1 never), 42 | 2.00, 1.25 | 2.00e-01, 5.00e-02 |"
    )
    assert (
        lines[3]
        == "| 4 | 0 | 0.970 (0.970) | 0.980 (0.980) | +0.010 | yes | 60, 30 | 4.00, 3.00 | 2.00e-01, 1.00e-01 |"
    )
