"""The benchmark baselines and formulas: the actor's entropy and loss (``benchmarks/actor_baseline.py``)
against float64 references, and the model-FLOPs count of ``benchmarks/step.py`` against a published
parameter count."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from actor_baseline import InplaceVocabParallelEntropy, actor_loss  # noqa: E402

from fnppo.core.losses import KLPenalty, LossConfig, ppo_clip  # noqa: E402
from tests.scripts import run_script  # noqa: E402


def _run_benchmark(cmd: list[str], timeout: int = 300):
    """Run ``cmd`` (a benchmark script and its arguments) from the repository root as ``python`` would
    (:func:`tests.scripts.run_script`); it must exit 0 (else its output's tail is the failure message)."""
    done = run_script(ROOT / cmd[0], cmd[1:], cwd=ROOT, timeout=timeout)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def test_inplace_entropy_value_and_gradient_against_float64():
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(2, 1500, 37, generator=g, dtype=torch.float64) * 3).requires_grad_()  # > one row block
    before = x.detach().clone()
    ent = InplaceVocabParallelEntropy.apply(x, None)
    p = torch.softmax(x.detach(), -1)
    ref = -(p * torch.log_softmax(x.detach(), -1)).sum(-1)
    torch.testing.assert_close(ent, ref, rtol=0, atol=1e-12)
    up = torch.randn(ent.shape, generator=g, dtype=torch.float64)
    (grad,) = torch.autograd.grad(ent, x, up)
    xr = x.detach().clone().requires_grad_()
    (ref_grad,) = torch.autograd.grad(-(torch.softmax(xr, -1) * torch.log_softmax(xr, -1)).sum(-1), xr, up)
    torch.testing.assert_close(grad, ref_grad, rtol=0, atol=1e-12)
    assert torch.equal(x.detach(), before)  # the logits are read, never written


def test_actor_loss_against_a_token_loop():
    g = torch.Generator().manual_seed(1)
    b, s = 8, 16
    old, ref = (torch.randn(b, s, generator=g, dtype=torch.float64) * 0.3 - 2 for _ in range(2))
    lp = old + 1.5 * torch.randn(b, s, generator=g, dtype=torch.float64)  # ratios up to ~e^3: both clips bind
    adv = torch.randn(b, s, generator=g, dtype=torch.float64)
    ent = torch.rand(b, s, generator=g, dtype=torch.float64)
    mask = (torch.rand(b, s, generator=g) > 0.3).double()
    cfg = LossConfig(policy=ppo_clip(clip_low=0.2, clip_high=0.28), entropy_coef=0.01, kl=KLPenalty(coef=0.001))
    normalizer = torch.tensor(200.0, dtype=torch.float64)  # the step's global token count (other micro-batches too)
    loss, _ = actor_loss(lp, old, adv, mask, cfg, entropy=ent, ref_logprobs=ref, normalizer=normalizer)
    total = 0.0
    for i in range(b):
        for j in range(s):
            if not mask[i, j]:
                continue
            r = math.exp(max(-20.0, min(20.0, float(lp[i, j] - old[i, j]))))
            a = float(adv[i, j])
            pg = max(-a * r, -a * min(max(r, 0.8), 1.28))
            if a < 0:
                pg = min(pg, -3.0 * a)
            d = float(ref[i, j] - lp[i, j])
            k3 = max(-10.0, min(10.0, math.exp(d) - d - 1.0))
            total += pg - 0.01 * float(ent[i, j]) + 0.001 * k3
    assert abs(float(loss) - total / 200.0) < 1e-12


def test_actor_baseline_checks_itself_when_run():
    """``benchmarks/actor_baseline.py`` is a module with a main: run, it checks itself and says so."""
    done = _run_benchmark(["benchmarks/actor_baseline.py"])
    assert done.stdout.strip().endswith("PASS"), done.stdout + done.stderr[-3000:]
    helped = _run_benchmark(["benchmarks/actor_baseline.py", "--help"])
    assert "usage:" in helped.stdout


def test_model_flops_count_matches_the_published_parameter_count():
    from step import MODELS, model_flops_per_token

    # Qwen2.5-0.5B: 494,032,768 parameters, of which 27,648 are QKV biases and 43,904 norm weights;
    # the rest are matrix weights (the tied embedding counted once, as the output layer).
    f = model_flops_per_token(MODELS["qwen2.5-0.5b"], 151936, 2048)
    assert f["matmul_params"] == 494_032_768 - 27_648 - 43_904
    assert f["flops_6n"] == 6 * f["matmul_params"]
    assert f["flops_attention"] == 6 * 24 * 14 * 64 * 2049  # causal: (seq + 1) / 2 keys on average, x 2 x 2 x 3


def test_moe_flops_count_the_active_experts_and_memory_all_of_them():
    from step import MODELS, model_flops_per_token, param_count, static_memory_gib

    # tiny-moe: 2 layers of hidden 64, 4 heads of 16 (2 KV groups), 4 experts of FFN 32, top-2
    shape, vocab = MODELS["tiny-moe"], 512
    attention = 64 * 64 + 2 * 64 * 32 + 64 * 64  # q, k, v, proj
    expert, router = 3 * 64 * 32, 64 * 4
    f = model_flops_per_token(shape, vocab, 64)
    assert f["matmul_params"] == 2 * (attention + router + 2 * expert) + 64 * vocab
    assert (
        param_count(shape, vocab)
        == 2 * (attention + router + 4 * expert) + 64 * vocab + 2 * 16 * (4 + 2 * 2) + 2 * 2 * 64 + 64
    )
    # the H200 shape: 5.31e9 parameters in 89 GiB of weights, gradients and Adam state; 1.09e9 active
    big = MODELS["moe-5b-a1b"]
    assert (
        round(param_count(big, 151936) / 1e9, 2) == 5.31
        and round(model_flops_per_token(big, 151936, 2048)["matmul_params"] / 1e9, 2) == 1.09
    )
    assert 88 < static_memory_gib(param_count(big, 151936), dtype="bf16") < 90


def test_step_benchmark_runs_an_moe_shape_on_cpu(tmp_path):
    """benchmarks/step.py --model tiny-moe --device cpu: the three paths step on an MoE model, whose
    parameter count is the shape's, with selective recomputation, path C's block option and path D
    (C with ``BackwardGraphs``: on CPU every backward runs eagerly through its buffers)."""
    import json

    out = tmp_path / "step.jsonl"
    cmd = [
        "benchmarks/step.py",
        "--model",
        "tiny-moe",
        "--device",
        "cpu",
        "--vocab",
        "512",
        "--seq",
        "64",
        "--mb-tokens",
        "128",
        "--microbatches",
        "2",
        "--steps",
        "1",
        "--warmup",
        "0",
        "--json",
        str(out),
        "--recompute",
        "selective",
        "--recompute-modules",
        "moe,core_attn",
        "--fused-chunk-vocab",
        "100",
        "--paths",
        "A,B,C,D",
        "--rotate",
        "--host-profile",
        str(tmp_path / "host.txt"),
        "--moe-experts",
        "stacked",
    ]
    _run_benchmark(cmd)
    result = json.loads(out.read_text().splitlines()[-1])
    assert result["params_total"] == result["params_this_rank"]  # the formula counts the built model
    assert result["experts"] == "StackedExperts"
    assert result["recompute"] == "selective:moe,core_attn" and result["fused_chunk_vocab"] == 100
    for path in ("A", "B", "C", "D"):
        assert result[path]["tokens_per_s"] > 0 and math.isfinite(result[path]["first_grad_norm"]), path
        assert len(result[path]["step_s"]) == 1
        r = result[path]  # per-step diagnostics: host return <= step, the host probe, garbage collection
        assert 0 < r["host_return_s"][0] <= r["step_s"][0] and r["host_probe_s"][0] > 0 and r["gc_s"][0] >= 0
        assert len(r["gc_collections"][0]) == 3 and r["device_allocs"] == [0]
        assert result["host_profile_s"][path] > 0
    assert (tmp_path / "host.txt").read_text().count("one step under cProfile") == 8  # 4 paths x 2 orders
    assert result["first_logprobs_max_abs_diff"] <= 1e-5 and result["first_logprobs_max_abs_diff_C_vs_A"] <= 1e-5
    assert result["first_logprobs_max_abs_diff_D_vs_A"] <= 1e-5 and result["rotate"] is True
    # two steps of 2 micro-batches (the timed one and the one under cProfile), all eager on CPU
    assert result["D"]["graphs"]["eager_calls"] == 4 and result["D"]["graphs"]["captures"] == 0


def test_moe_determinism_benchmark_runs_on_cpu(tmp_path):
    """benchmarks/moe_determinism.py --device cpu: on CPU every kernel is deterministic, so the three
    calls, path B's stages and the routing replay agree exactly, and every (token, layer) row is counted."""
    import json

    out = tmp_path / "det.json"
    cmd = [
        "benchmarks/moe_determinism.py",
        "--device",
        "cpu",
        "--variants",
        "local,local_det",
        "--json",
        str(out),
    ]
    _run_benchmark(cmd)
    result = json.loads(out.read_text())
    for variant in ("local", "local_det"):
        r = result[variant]
        assert r["routing_rows"] == 4 * 64 * 4 and r["routing_rows_differing"] == 0, (
            r
        )  # 4 samples x 64 tokens x 4 layers
        assert r["A1_vs_A2"] == r["A1_vs_A3"] == r["A1_vs_B"] == r["A1_vs_A1replay"] == 0.0, r


def test_largest_size_search_doubles_then_bisects():
    """benchmarks/step.py's search for the largest micro-batch / sequence, against the true limit."""
    from step import largest

    for limit in (0, 1023, 1024, 5000, 8192, 9999, 40960, 10**6):
        tried = []

        def ok(n, limit=limit):
            tried.append(n)
            return n <= limit

        found = largest(ok, 1024, 65536, 512)
        if limit >= 65536:
            assert found == 65536, (limit, found)  # the cap
        else:
            assert found <= limit < found + 512 and found % 512 == 0, (limit, found)
        assert len(tried) <= 20, tried


def test_step_stats_per_round_ratios_quartiles_and_probe_correlation(tmp_path):
    """benchmarks/step_stats.py against hand-computed figures: per-round ratios A / D of
    [1, 2, 3, 4] over [2, 2, 2, 2] s are [0.5, 1, 1.5, 2] (median 1.25, inclusive quartiles 0.875
    and 1.625), the summed ratio 10 / 8; a probe proportional to A's steps correlates with r = 1."""
    import json

    import step_stats

    run = {
        "model": "m",
        "rotate": True,
        "A": {"step_s": [1.0, 2.0, 3.0, 4.0], "host_probe_s": [0.01, 0.02, 0.03, 0.04]},
        "D": {"step_s": [2.0, 2.0, 2.0, 2.0], "host_probe_s": [0.01, 0.01, 0.02, 0.01]},
        "B": {"tokens_per_s": 1.0},
    }  # no per-step data: skipped
    s = step_stats.run_summary(run)
    assert set(s["paths"]) == {"A", "D"}
    d = s["paths"]["D"]
    assert d["ratio_median"] == pytest.approx(1.25) and d["ratio_of_sums"] == pytest.approx(1.25)
    assert (d["ratio_q1"], d["ratio_q3"]) == (pytest.approx(0.875), pytest.approx(1.625))
    assert s["paths"]["A"]["probe_step_r"] == pytest.approx(1.0) and s["paths"]["A"]["median_ms"] == pytest.approx(
        2500.0
    )
    assert s["paths"]["D"]["probe_step_r"] is None  # no spread in D's steps
    other = dict(run, D={"step_s": [1.0, 1.0, 1.0, 1.0]})
    across = step_stats.across([s, step_stats.run_summary(other)])
    assert across["m"]["D"] == {"runs": 2, "median": pytest.approx((1.25 + 2.5) / 2), "min": 1.25, "max": 2.5}
    f = tmp_path / "s.jsonl"
    f.write_text(json.dumps(run) + "\n\n" + json.dumps(dict(run, model="other")) + "\n")
    assert step_stats.main([str(f), "--model", "m", "--markdown"]) == 0


def test_batch_invariance_benchmark_smoke_on_cpu(tmp_path):
    """benchmarks/batch_invariance.py --smoke: the tiny dense and MoE models give 0 differing bits in
    every composition and exactly 0 on-policy gaps in train_step, and the mode's time ratio is printed."""
    import json

    out = tmp_path / "bi.json"
    cmd = ["benchmarks/batch_invariance.py", "--smoke", "--steps", "1", "--json", str(out)]
    done = _run_benchmark(cmd, timeout=600)
    result = json.loads(out.read_text())
    assert set(result) == {"tiny", "tiny-moe"}
    for name, r in result.items():
        for comp in ("shuffled", "budget", "alone", "mixed", "padded"):
            assert r[comp]["logprob"] == [0, 0.0] and r[comp]["entropy"] == [0, 0.0], (name, comp, r[comp])
        assert r["train_step"] == {"onpolicy/max_abs_logprob_diff": 0.0, "onpolicy/max_abs_ratio_minus_1": 0.0}
        assert r["time_ratio"]["train_step"] > 0 and "time invariant/normal" in done.stdout


def test_fp8_numerics_compares_layers_kl_and_logprobs_against_float64():
    """benchmarks/fp8_numerics.py's comparison: relative error per layer, per-token KL(ref || other)
    over the full distribution (chunked), and the log-prob gaps, each against a float64 formula."""
    import fp8_numerics

    g = torch.Generator().manual_seed(0)
    ref = {"layers": [torch.randn(30, 8, generator=g) for _ in range(3)], "logits": torch.randn(30, 50, generator=g)}
    ref["logprobs"] = torch.randn(30, generator=g)
    got = {k: [t + 0.1 * torch.randn(t.shape, generator=g) for t in v] for k, v in ref.items() if k == "layers"}
    got["logits"] = ref["logits"] + 0.3 * torch.randn(30, 50, generator=g)
    got["logprobs"] = ref["logprobs"] + torch.linspace(-1, 2, 30)
    row = fp8_numerics.compare(ref, got)
    p, q = torch.log_softmax(ref["logits"].double(), -1), torch.log_softmax(got["logits"].double(), -1)
    kl = (p.exp() * (p - q)).sum(-1)
    assert math.isclose(row["kl_mean"], float(kl.mean()), rel_tol=1e-5)
    assert torch.allclose(fp8_numerics._kl(ref["logits"], got["logits"], chunk=7).double(), kl, rtol=1e-5, atol=1e-7)
    rel = [float((b.double() - a.double()).norm() / a.double().norm()) for a, b in zip(ref["layers"], got["layers"])]
    assert all(math.isclose(x, round(y, 5), abs_tol=1e-5) for x, y in zip(row["layer_rel_err"], rel))
    assert math.isclose(row["logprob_abs_diff_max"], 2.0, rel_tol=1e-6)


def test_fp8_benchmark_runs_its_bf16_half_on_cpu_and_reports_fp8_refused(tmp_path):
    """benchmarks/fp8.py --smoke: the BF16 side trains and writes its curves; FP8 is refused with fnppo's message."""
    import json

    out = tmp_path / "fp8.jsonl"
    _run_benchmark(["benchmarks/fp8.py", "--smoke", "--json", str(out)])
    result = json.loads(out.read_text().splitlines()[-1])
    bf = result["bf16"]
    assert len(bf["loss"]) == len(bf["grad_norm"]) == 2 and all(math.isfinite(x) for x in bf["loss"])
    assert bf["tokens_per_s"] > 0
    assert "argument 'dtype' expected 'bf16' with fp8 set" in result["fp8"]["refused"]


@pytest.mark.parametrize(
    "extra,fraction",
    [([], 4), (["--model", "tiny-moe", "--moe-experts", "stacked"], 2)],  # MoE: adapters on stacked experts too
    ids=["dense", "moe-stacked"],
)
def test_lora_benchmark_smoke_on_cpu(tmp_path, extra, fraction):
    """benchmarks/lora.py --smoke: full fine-tuning and two LoRA ranks step on the tiny model; LoRA trains
    a small fraction of the parameters, and the adapter-free reference equals a copy of the base weights in
    log-probs while holding (almost) none of their bytes."""
    import json

    out = tmp_path / "lora.jsonl"
    _run_benchmark(["benchmarks/lora.py", "--smoke", "--json", str(out), *extra])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["mode"], r["rank"]) for r in rows] == [("full", None), ("lora", 4), ("lora", 8)]
    full, *lora = rows
    assert all(r["status"] == "ok" and r["tokens_per_s"] > 0 for r in rows)
    assert full["trainable_params"] == full["params"]
    for r in lora:
        assert 0 < r["trainable_params"] < full["params"] / fraction, r
        assert r["same_logprobs"] and r["reference_copy_gib"] * 2**30 >= full["params"] * 4
        assert r["reference_adapters_off_gib"] * 2**30 < 1024, r
    assert lora[0]["trainable_params"] * 2 == lora[1]["trainable_params"]


def test_linear_distill_benchmark_tiny_on_cpu(tmp_path):
    """benchmarks/linear_distill.py --tiny: the fused distillation op (PyTorch path) passes its fp64
    checks, and the head alone, the op (both kinds) and the materialized peers' way all run and are reported."""
    import json

    out = tmp_path / "distill.json"
    done = _run_benchmark(["benchmarks/linear_distill.py", "--tiny", "--reps", "1", "--json", str(out)])
    assert "device checks against fp64 (torch): 12/12 passed" in done.stdout, done.stdout[-3000:]
    rows = json.loads(out.read_text())
    assert rows["checks_passed"] is True
    names = [r["method"] for r in rows["rows"]]
    assert len(names) == 4 and "peers' way" in names[-1] and all(r["ms"] > 0 for r in rows["rows"])
    table = [line for line in done.stdout.splitlines() if line.startswith("|")]
    assert len(table) == 2 + 4 and table[1].startswith("|---")  # header, separator, one row per method


def test_stream_delta_benchmark_tiny_on_cpu(tmp_path, monkeypatch):
    """benchmarks/stream_delta.py --tiny: every mode after each of two Adam steps; the script itself checks
    each delta's result bit for bit against the full stream (exit 1 otherwise); here the table's figures
    hold together: a delta never sends more than the full stream, FP8 about half of bf16."""
    import json

    monkeypatch.setenv("OUT", str(tmp_path))
    done = _run_benchmark(["benchmarks/stream_delta.py", "--tiny"])
    assert "| step | mode | MB sent |" in done.stdout
    rows = json.loads((tmp_path / "stream_delta.json").read_text())["rows"]
    modes = ["full", "delta-blocks", "delta-elements", "fp8", "fp8-delta"]
    assert [(r["step"], r["mode"]) for r in rows] == [(s, m) for s in (1, 2) for m in modes]
    for step in (1, 2):
        by = {r["mode"]: r for r in rows if r["step"] == step}
        full = by["full"]["bytes"]
        assert 0 < by["delta-blocks"]["bytes"] <= full and 0 < by["delta-elements"]["bytes"] <= full
        assert 0.5 * full < by["fp8"]["bytes"] < 0.7 * full  # codes 1 byte, embeddings and norms bf16
        assert 0 < by["fp8-delta"]["bytes"] <= by["fp8"]["bytes"]
        assert 0 < by["delta-elements"]["elements_changed"] <= 1


def test_distill_step_tiny_runs_every_row_and_writes_its_table(tmp_path, monkeypatch):
    """benchmarks/distill_step.py --tiny: RL alone, RL + the teacher model, top-k distillation and the fused
    rows each step on the CPU; the JSON under $OUT has one row each, with a distillation loss where one is
    trained."""
    import json

    monkeypatch.setenv("OUT", str(tmp_path))
    done = _run_benchmark(["benchmarks/distill_step.py", "--tiny", "--fused"], timeout=600)
    assert "| rl+teacher |" in done.stdout and "| topk (fused) |" in done.stdout
    rows = {r["row"]: r for r in json.loads((tmp_path / "distill_step.json").read_text())["rows"]}
    assert set(rows) == {"rl", "rl+teacher", "topk", "rl (fused)", "rl+teacher (fused)", "topk (fused)"}
    assert rows["rl"]["distill_loss"] is None
    for name in ("rl+teacher", "topk", "rl+teacher (fused)", "topk (fused)"):
        assert rows[name]["distill_loss"] > 0 and rows[name]["tokens_per_s"] > 0, rows[name]
    # the fused rows compute the same objective from the hidden states
    assert abs(rows["rl+teacher (fused)"]["distill_loss"] - rows["rl+teacher"]["distill_loss"]) < 1e-2
    ops = json.loads((tmp_path / "distill_step.json").read_text())["op"]
    assert [r["row"] for r in ops][0] == "logprob_and_entropy alone" and all(r["ms"] > 0 for r in ops)
    assert "| fnppo: teacher hidden + output weight |" in done.stdout


def test_shared_prefix_benchmark_runs_tiny(tmp_path):
    """benchmarks/shared_prefix.py --tiny: both packings train and score the same groups on the CPU,
    the table has a row per prompt length and call, the JSON lands in --out ($OUT by default), and
    the two packings' log-probs agree (fp32 on the CPU)."""
    import json

    done = _run_benchmark(["benchmarks/shared_prefix.py", "--tiny", "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "shared_prefix.json").read_text())["rows"]
    assert [(r["prompt"], r["call"]) for r in rows] == [
        (p, c) for p in (24, 8) for c in ("train_step", "compute_logprobs")
    ]
    assert all(r["speedup"] > 0 and r["max_abs_logprob_diff"] <= 1e-5 for r in rows)
    assert "| 24 | train_step |" in done.stdout


def test_study_runner_records_every_row_as_it_finishes(tmp_path, capsys):
    """benchmarks/toy_robustness.run_and_record (the studies' runner: toy_robustness, staleness,
    partial_rollouts): each finished run's row is appended to the rows file and described once."""
    import functools
    import json

    from toy_robustness import run_and_record

    rows_path = tmp_path / "rows.jsonl"
    rows_path.write_text(json.dumps({"seed": -1}) + "\n")  # an earlier study's row stays
    calls = [functools.partial(dict, seed=s) for s in range(5)]
    got = run_and_record(calls, 2, rows_path, lambda row: f"seed {row['seed']} done")
    assert sorted(r["seed"] for r in got) == list(range(5))
    kept = [json.loads(line) for line in rows_path.read_text().splitlines()]
    assert kept[0] == {"seed": -1} and sorted(r["seed"] for r in kept[1:]) == list(range(5))
    assert sorted(capsys.readouterr().out.splitlines()) == [f"seed {s} done" for s in range(5)]
