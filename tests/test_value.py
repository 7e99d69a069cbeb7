"""The critic: the value model, forward_values, compute_values, critic_step (real Megatron on CPU).

Three multi-rank launches hold every check of this file:

* one process: a float64 plain-torch reference of the critic's loss and gradient (one forward of
  the whole batch, the documented per-token loss written out, autograd; no schedule, split or
  DDP), the values against a Hugging Face model's own hidden states (and against transformers' token classifier exported from the critic), the micro-batch splits, the
  non-finite skip, the finalize check, checkpoints of two train states, and every refusal;
* two ranks, re-initializing Megatron's layout in the same processes: DP=2, TP=2, TP=2 with
  sequence parallelism, PP=2, PP=2 with virtual pipeline 2, CP=2;
* four ranks: DP=2 x TP=2.

Every layout runs ``compute_values`` and one ``critic_step`` (Adam with a large eps: the update is
linear in the gradient) on the same global batch and full initial weights and must agree with one
process to 1e-5 relative: every metric, every updated parameter, every sample's values.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

import fnppo
import fnppo.megatron.layer_specs
import fnppo.megatron.unwrap
from fnppo.core.losses import Aggregation, ValueLossConfig, value_loss
from fnppo.testing import run_ranks, synthetic_samples, tiny_model_config
from tests.loss_helpers import aggregate
from tests.messages import check_message
from tests.step_helpers import finalize_dropped, finalized_grads, gather_dp, max_update_error
from tests.step_helpers import rel_err as _rel

MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
N_SAMPLES = 8
REL = 1e-5
CLIP = 0.2
SPLITS = {"1mb": {}, "4mb": {"num_microbatches": 4}, "budget": {"max_tokens_per_microbatch": 24}}


def _model_cfg(**kw) -> fnppo.ModelConfig:
    # tie_embeddings=True: the value model must ignore it (it has no output layer to tie)
    return tiny_model_config(**{"num_layers": 4, "tie_embeddings": True, **kw})


def _samples() -> list:
    """Samples with masked tokens, rollout-time values (spread so that some tokens clip) and returns."""
    g = torch.Generator().manual_seed(21)
    out = []
    for s in synthetic_samples(N_SAMPLES, seed=7):
        r = s.response_len
        out.append(
            dataclasses.replace(s, values=0.3 * torch.randn(r, generator=g), returns=torch.randn(r, generator=g))
        )
    return out


def _critic_cfg(mode: str, split: str = "1mb", clip: float | None = CLIP) -> fnppo.CriticConfig:
    loss = ValueLossConfig(clip_range=clip, agg=Aggregation(mode, 8.0 if mode.endswith("norm") else None))
    return fnppo.CriticConfig(loss=loss, **SPLITS[split])


def _build(sequence_parallel: bool = False, lr: float = 1e4, **opt):
    # lr = 1e4 with Adam's eps = 10: the first update is ~1000 g, so comparing updated weights
    # compares gradients, far above the rounding of the fp32 weights
    chunks = fnppo.build_gpt(_model_cfg(), head="value", sequence_parallel=sequence_parallel)
    fnppo.models.layout_invariant_init(chunks, seed=3)
    ddp = fnppo.wrap_ddp(chunks, use_distributed_optimizer=True)
    return fnppo.TrainState(model=ddp, optimizer=fnppo.build_optimizer(ddp, lr=lr, adam_eps=10.0, clip_grad=0.0, **opt))


def _one_update(mode: str, split: str, sequence_parallel: bool = False) -> dict:
    """compute_values and one critic_step on this rank's share; full weights before and after."""
    layout = fnppo.parallel.current_layout()
    state = _build(sequence_parallel)
    samples = fnppo.shard_for_data_parallel(_samples(), layout)
    cfg = _critic_cfg(mode, split)
    values = fnppo.compute_values(state.model, samples, config=cfg)
    before = fnppo.models.gather_full_weights(state.model)
    state, metrics = fnppo.critic_step(state, samples, cfg)
    return {
        "metrics": metrics,
        "before": before,
        "weights": fnppo.models.gather_full_weights(state.model),
        "values": gather_dp(values, layout),
        "step": state.step,
    }


def _compare(ref: dict, got: dict, what: str) -> float:
    worst = 0.0
    assert set(ref["metrics"]) == set(got["metrics"]), what
    for key, r in ref["metrics"].items():
        g = got["metrics"][key]
        # explained variance is 1 - (a ratio near 1 here): its error is relative to 1
        err = abs(g - r) / max(abs(r), 1.0 if key == "vf_explained_var" else 1e-6)
        assert err <= REL, f"{what}: metric {key} {g} vs one process {r} (rel {err:.2e})"
        worst = max(worst, err)
    assert set(ref["weights"]) == set(got["weights"]), what
    worst = max(worst, max_update_error(ref, got, what, REL))
    assert len(got["values"]) == len(ref["values"]) == N_SAMPLES, what
    for i, (a, b) in enumerate(zip(got["values"], ref["values"], strict=True)):
        assert a.shape == b.shape, f"{what}: values of sample {i}: {a.shape} vs {b.shape}"
        err = _rel(a, b)
        assert err <= REL, f"{what}: compute_values of sample {i} rel err {err:.2e}"
        worst = max(worst, err)
    return worst


# ---------------------------------------------------------------------------------------------
# the plain reference (float64): the documented loss, one token at a time
# ---------------------------------------------------------------------------------------------
def _plain_loss(values: list, samples: list, mode: str, clip: float | None, scale: float | None):
    """``(loss, clipped tokens, tokens, returns, errors)`` of the clipped value loss, written out."""
    seqs, clipped, rets, errs = [], 0, [], []
    for v, s in zip(values, samples, strict=True):
        mask = torch.ones(s.response_len) if s.response_mask is None else s.response_mask
        terms = []
        for j in range(s.response_len):
            if mask[j] == 0:
                continue
            V, old, R = v[j], float(s.values[j]), float(s.returns[j])
            term = (V - R) ** 2
            d = float(V.detach()) - old
            if clip is not None and abs(d) > clip:
                v_clip = old + math.copysign(clip, d)  # a constant: no gradient
                if (v_clip - R) ** 2 > float(term.detach()):
                    term, clipped = term * 0 + (v_clip - R) ** 2, clipped + 1
            terms.append(0.5 * term)
            rets.append(R)
            errs.append(R - float(V.detach()))
        if terms:
            seqs.append(terms)
    n_tok = sum(len(t) for t in seqs)
    return (
        aggregate(seqs, mode, scale),
        clipped,
        n_tok,
        torch.tensor(rets, dtype=torch.float64),
        torch.tensor(errs, dtype=torch.float64),
    )


def _plain_reference(modes) -> dict:
    """One forward of the whole batch (no schedule, no DDP), the plain loss, autograd."""
    from fnppo.core.batching.collate import collate_microbatch, unpack_per_sample

    out = {}
    samples = _samples()
    for mode in modes:
        (chunk,) = fnppo.build_gpt(_model_cfg(), head="value")
        fnppo.models.layout_invariant_init([chunk], seed=3)
        mb = collate_microbatch(samples, layout="packed", pad_to_multiple_of=1)
        values = [v.double() for v in unpack_per_sample(fnppo.forward_values(chunk, mb), mb)]
        loss, clipped, n_tok, rets, errs = _plain_loss(values, samples, mode, CLIP, 8.0)
        loss.backward()
        out[mode] = {
            "loss": float(loss.detach()),
            "clipfrac": clipped / n_tok,
            "explained_var": 1.0 - float(errs.var(unbiased=False) / rets.var(unbiased=False)),
            "vpred_mean": float(sum(float(v) for v in (rets - errs)) / n_tok),
            "grads": {name: p.grad.detach().clone() for name, p in chunk.named_parameters()},
            "values": [v.detach().float() for v in values],
        }
    return out


def _finalized_grads(modes, split: str) -> dict:
    """critic_step's gradients as the optimizer receives them (captured right after finalize_grads)."""
    out = {}
    with finalized_grads() as captured:
        for mode in modes:
            chunks = fnppo.build_gpt(_model_cfg(), head="value")
            fnppo.models.layout_invariant_init(chunks, seed=3)
            ddp = fnppo.wrap_ddp(chunks, use_distributed_optimizer=False)
            state = fnppo.TrainState(model=ddp, optimizer=fnppo.build_optimizer(ddp, lr=1e-3, clip_grad=0.0))
            _, metrics = fnppo.critic_step(state, _samples(), _critic_cfg(mode, split))
            names = [n for n, _ in fnppo.megatron.unwrap.unwrap_model(state.model[0]).named_parameters()]
            out[mode] = {"metrics": metrics, "grads": dict(zip(names, captured.pop("grads")[0], strict=True))}
    return out


# ---------------------------------------------------------------------------------------------
# single-process checks, all in one launch
# ---------------------------------------------------------------------------------------------
def _hf_values(path: str) -> dict:
    """A value model on a Hugging Face policy checkpoint: trunk loaded, lm_head skipped, head fresh;
    its values against transformers' own final hidden states times the head; exported with the
    policy's config (a token classifier, read by transformers in the test)."""
    import transformers

    chunks = fnppo.hf.build_gpt_from_hf(path, head="value", dtype="fp32")
    head_before = {
        k: v.detach().clone()
        for k, v in fnppo.megatron.unwrap.unwrap_model(chunks[0]).named_parameters()
        if k.startswith("value_head.")
    }
    skipped = fnppo.hf.load_hf_weights(chunks, path)
    policy = fnppo.hf.build_gpt_from_hf(path, dtype="fp32")
    skipped_policy = fnppo.hf.load_hf_weights(policy, path)
    core = fnppo.megatron.unwrap.unwrap_model(chunks[0])
    head_after = {k: v.detach().clone() for k, v in core.named_parameters() if k.startswith("value_head.")}
    g = torch.Generator().manual_seed(4)
    samples = [
        fnppo.Sample(
            prompt_ids=torch.randint(0, 96, (3 + i,), generator=g), response_ids=torch.randint(0, 96, (5,), generator=g)
        )
        for i in range(3)
    ]
    got = fnppo.compute_values(chunks, samples)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    want = []
    with torch.no_grad():
        for s in samples:
            ids = torch.cat([s.prompt_ids, s.response_ids])[None]
            hidden = hf.model(input_ids=ids).last_hidden_state[0].double()  # after the final norm
            v = hidden @ head_after["value_head.weight"].double()[0] + head_after["value_head.bias"].double()
            want.append(v[s.prompt_len - 1 : s.prompt_len - 1 + s.response_len].float())
    fnppo.hf.export_hf_weights(chunks, path + "-export", hf_config=path)
    return {
        "skipped": skipped,
        "skipped_policy": skipped_policy,
        "head_kept": all(torch.equal(head_before[k], head_after[k]) for k in head_before),
        "got": got,
        "want": want,
        "samples": samples,
        "export": path + "-export",
    }


def _structure() -> dict:
    """Names and ties of a value model; fresh-head loading from an actor's weights; layout_invariant_init."""
    (value,) = fnppo.build_gpt(_model_cfg(tie_embeddings=False), head="value")
    (actor,) = fnppo.build_gpt(_model_cfg(tie_embeddings=False))
    fnppo.models.layout_invariant_init([actor], seed=5)
    params = dict(value.named_parameters())
    head = {k: v.detach().clone() for k, v in params.items() if k.startswith("value_head.")}
    actor_full = fnppo.models.gather_full_weights([actor])
    skipped = fnppo.models.load_full_weights([value], actor_full, fresh_head=True)
    actor_params = dict(actor.named_parameters())
    trunk_same = all(
        torch.equal(p, actor_params[k]) for k, p in value.named_parameters() if not k.startswith("value_head.")
    )
    head_same = all(torch.equal(head[k], params[k]) for k in head)
    full = fnppo.models.gather_full_weights([value])
    reloaded_skip = fnppo.models.load_full_weights([value], full)  # a critic's own full weights: head included
    fnppo.models.layout_invariant_init([value], seed=5)
    w5 = params["value_head.weight"].detach().clone()
    fnppo.models.layout_invariant_init([value], seed=6)
    # a given layer spec is used as given (for both heads): Megatron's own core attention here
    spec = fnppo.megatron.layer_specs.local_layer_spec(_model_cfg(), packed_attention=False)
    attention = {
        head: type(
            fnppo.build_gpt(_model_cfg(), head=head, layer_spec=spec)[0].decoder.layers[0].self_attention.core_attention
        ).__name__
        for head in ("lm", "value")
    }
    attention["default"] = type(value.decoder.layers[0].self_attention.core_attention).__name__
    return {
        "attention": attention,
        "names": sorted(params),
        "shapes": {k: tuple(v.shape) for k, v in head.items()},
        "tied": value.share_embeddings_and_output_weights,
        "has_output_layer": hasattr(value, "output_layer"),
        "skipped": skipped,
        "trunk_same": trunk_same,
        "head_same": head_same,
        "full_has_head": sorted(k for k in full if k.startswith("value_head.")),
        "reloaded_skip": reloaded_skip,
        "seeded_heads_differ": not torch.equal(w5, params["value_head.weight"]),
        "bias_zero": bool((params["value_head.bias"] == 0).all()),
        "head_std": float(w5.std()),
    }


def _nan_loss(*args, **kwargs):
    loss, metrics = value_loss(*args, **kwargs)
    nan = torch.full((), float("nan"))
    return loss + nan, dict(metrics, vf_loss=metrics["vf_loss"] + nan)


def _faults() -> dict:
    """A non-finite value loss skips the update and leaves the parameters; a schedule that drops the
    finalizer is detected; a checkpoint of two train states round-trips."""
    import tempfile

    out: dict = {}
    state = _build(lr=1e-2)
    samples = _samples()
    cfg = _critic_cfg("token-mean", "4mb")
    state, out["m1"] = fnppo.critic_step(state, samples, cfg)
    before = {k: v.detach().clone() for k, v in fnppo.megatron.unwrap.unwrap_model(state.model[0]).named_parameters()}
    state, out["m2"] = fnppo.critic_step(state, samples, dataclasses.replace(cfg, fns=fnppo.CriticFns(loss=_nan_loss)))
    after = dict(fnppo.megatron.unwrap.unwrap_model(state.model[0]).named_parameters())
    out["changed_by_skip"] = sorted(k for k in before if not torch.equal(before[k], after[k]))
    state, out["m3"] = fnppo.critic_step(state, samples, cfg)
    out["moved_after"] = any(
        not torch.equal(before[k], v) for k, v in fnppo.megatron.unwrap.unwrap_model(state.model[0]).named_parameters()
    )

    with finalize_dropped():
        try:
            fnppo.critic_step(state, samples, cfg)
            out["finalize"] = "no error"
        except fnppo.models.FinalizeNotCalledError as err:
            out["finalize"] = str(err)

    # checkpoints: {"policy", "critic"} in one manifest, loaded into freshly built states
    policy_chunks = fnppo.build_gpt(_model_cfg())
    fnppo.models.layout_invariant_init(policy_chunks, seed=8)
    pddp = fnppo.wrap_ddp(policy_chunks)
    policy = fnppo.TrainState(model=pddp, optimizer=fnppo.build_optimizer(pddp, lr=1e-3))
    for _ in range(4):  # a policy with optimizer state
        policy, _ = fnppo.train_step(policy, samples, fnppo.StepConfig())
    with tempfile.TemporaryDirectory() as tmp:
        fnppo.checkpoint.save_checkpoint(tmp, {"policy": policy, "critic": state}, extra={"k": 1})
        fresh = {
            "policy": fnppo.TrainState(model=fnppo.wrap_ddp(fnppo.build_gpt(_model_cfg())), optimizer=None),
            "critic": _build(lr=1e-2),
        }
        fresh["policy"] = dataclasses.replace(
            fresh["policy"], optimizer=fnppo.build_optimizer(fresh["policy"].model, lr=1e-3)
        )
        loaded, extra = fnppo.checkpoint.load_checkpoint(tmp, fresh)
        out["ckpt_steps"] = {k: v.step for k, v in loaded.items()}
        out["ckpt_extra"] = extra
        out["ckpt_same"] = all(
            torch.equal(a, b)
            for name in ("policy", "critic")
            for a, b in zip(
                fnppo.megatron.unwrap.unwrap_model((policy if name == "policy" else state).model[0]).parameters(),
                fnppo.megatron.unwrap.unwrap_model(loaded[name].model[0]).parameters(),
                strict=True,
            )
        )
        # the optimizer states too: one more update of the saved and of the loaded critic agrees bit for bit
        cont, _ = fnppo.critic_step(state, samples, cfg)
        cont_loaded, _ = fnppo.critic_step(loaded["critic"], samples, cfg)
        out["ckpt_continues"] = all(
            torch.equal(a, b)
            for a, b in zip(
                fnppo.megatron.unwrap.unwrap_model(cont.model[0]).parameters(),
                fnppo.megatron.unwrap.unwrap_model(cont_loaded.model[0]).parameters(),
                strict=True,
            )
        )
        try:
            fnppo.checkpoint.load_checkpoint(tmp, {"critic": fresh["critic"]})
            out["ckpt_names"] = "no error"
        except fnppo.checkpoint.CheckpointError as err:
            out["ckpt_names"] = str(err)
    return out


def _wrong_shape_forward(model, mb, *, params=None):
    v = fnppo.forward_values(model, mb, params=params)
    return v[..., None] if v.dim() == 2 else v


def _errors() -> dict:
    """Every refusal of the critic's entry points: case -> message (or 'no error')."""
    state = _build(lr=1e-3)
    policy_chunks = fnppo.build_gpt(_model_cfg())
    pddp = fnppo.wrap_ddp(policy_chunks)
    policy = fnppo.TrainState(model=pddp, optimizer=fnppo.build_optimizer(pddp, lr=1e-3))
    samples = _samples()
    mb = fnppo.collate_microbatch(samples[:2])
    cfg = _critic_cfg("token-mean")
    no_values = [dataclasses.replace(s, values=None) for s in samples]
    no_returns = [dataclasses.replace(s, returns=None) for s in samples]
    nan_returns = [
        dataclasses.replace(samples[0], returns=torch.full((samples[0].response_len,), float("nan")))
    ] + samples[1:]
    cases = {
        "unknown-head": lambda: fnppo.build_gpt(_model_cfg(), head="critic"),
        "forward-logits-of-value-model": lambda: fnppo.forward_logits(state.model[0], mb),
        "forward-values-of-policy": lambda: fnppo.forward_values(policy.model[0], mb),
        "train-step-of-value-model": lambda: fnppo.train_step(state, samples, fnppo.StepConfig()),
        "compute-logprobs-of-value-model": lambda: fnppo.compute_logprobs(state.model, samples),
        "critic-step-of-policy": lambda: fnppo.critic_step(policy, samples, cfg),
        "compute-values-of-policy": lambda: fnppo.compute_values(policy.model, samples),
        "no-returns": lambda: fnppo.critic_step(state, no_returns, cfg),
        "no-values-with-clip": lambda: fnppo.critic_step(state, no_values, cfg),
        "no-values-without-clip": lambda: fnppo.critic_step(state, no_values, _critic_cfg("token-mean", clip=None)),
        "returns-for-some": lambda: fnppo.critic_step(state, samples[:1] + no_returns[1:], cfg),
        "nan-returns": lambda: fnppo.critic_step(state, nan_returns, cfg),
        "values-shape": lambda: fnppo.critic_step(
            state, samples, dataclasses.replace(cfg, fns=fnppo.CriticFns(forward=_wrong_shape_forward))
        ),
        "compute-values-shape": lambda: fnppo.compute_values(
            state.model, samples, config=dataclasses.replace(cfg, fns=fnppo.CriticFns(forward=_wrong_shape_forward))
        ),
        "fresh-head-of-policy": lambda: fnppo.models.load_full_weights(
            policy.model, fnppo.models.gather_full_weights(policy.model), fresh_head=True
        ),
        "value-head-missing": lambda: fnppo.models.load_full_weights(
            state.model, fnppo.models.gather_full_weights(policy.model)
        ),
    }
    out = {}
    for case, call in cases.items():
        try:
            result = call()
            out[case] = "no error" if case != "no-values-without-clip" else f"ran: skipped={result[1]['skipped']}"
        except (fnppo.InputError, fnppo.ShapeError) as err:
            out[case] = (type(err).__name__, str(err))
    return out


def _single_process(hf_path: str) -> dict:
    return {
        "reference": {(mode, split): _one_update(mode, split) for mode in MODES for split in SPLITS},
        "plain": _plain_reference(MODES),
        "finalized": _finalized_grads(MODES, "4mb"),
        "hf": _hf_values(hf_path),
        "structure": _structure(),
        "faults": _faults(),
        "errors": _errors(),
    }


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    path = tmp_path_factory.mktemp("hf") / "qwen2"
    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    transformers.Qwen2ForCausalLM(cfg).save_pretrained(str(path))
    return run_ranks(_single_process, 1, str(path))[0]


# ---------------------------------------------------------------------------------------------
# the tests: one process
# ---------------------------------------------------------------------------------------------
def test_value_model_has_a_fresh_scalar_head_and_no_output_layer(single):
    s = single["structure"]
    assert not any(n.startswith("output_layer") for n in s["names"]) and not s["has_output_layer"]
    assert s["shapes"] == {"value_head.weight": (1, 32), "value_head.bias": (1,)}
    assert s["tied"] is False  # never tied, although the config says tie_embeddings=True
    # an actor's weights: the trunk is loaded, the head keeps its weights, the LM output layer is skipped
    assert s["trunk_same"] and s["head_same"] and s["skipped"] == ["output_layer.weight"]
    assert s["full_has_head"] == ["value_head.bias", "value_head.weight"] and s["reloaded_skip"] == []
    assert s["seeded_heads_differ"] and s["bias_zero"] and 0.01 < s["head_std"] < 0.04  # N(0, 0.02^2) from the seed


def test_build_gpt_uses_the_given_layer_spec(single):
    assert single["structure"]["attention"] == {
        "lm": "DotProductAttention",
        "value": "DotProductAttention",
        "default": "PackedDotProductAttention",
    }


def test_value_model_on_a_hugging_face_policy_checkpoint(single):
    h = single["hf"]
    assert h["skipped"] == ["lm_head.weight"] and h["skipped_policy"] == [] and h["head_kept"]
    for got, want in zip(h["got"], h["want"], strict=True):
        assert got.shape == want.shape == (5,)
        assert float((got - want).abs().max()) <= 1e-5 * float(want.abs().max()), (got, want)
    # exported with the policy's config: a Qwen2ForTokenClassification whose logits[..., 0] are these values
    import transformers

    hf = transformers.AutoModelForTokenClassification.from_pretrained(h["export"], dtype=torch.float32).eval()
    assert type(hf).__name__ == "Qwen2ForTokenClassification" and hf.config.num_labels == 1
    for s, got in zip(h["samples"], h["got"], strict=True):
        with torch.no_grad():
            logits = hf(input_ids=torch.cat([s.prompt_ids, s.response_ids])[None]).logits[0, :, 0]
        want = logits[s.prompt_len - 1 : s.prompt_len - 1 + s.response_len]
        assert float((got - want).abs().max()) <= 1e-5 * float(want.abs().max()), (got, want)


@pytest.mark.parametrize("mode", MODES)
def test_critic_step_matches_the_plain_float64_reference(single, mode):
    plain, ref, got = single["plain"][mode], single["reference"][(mode, "1mb")], single["finalized"][mode]
    m = ref["metrics"]
    assert m["skipped"] == 0.0 and m["updates"] == 1.0 and ref["step"] == 1
    assert 0.0 < plain["clipfrac"] < 1.0  # some tokens clip, some do not
    assert m["vf_loss"] == pytest.approx(plain["loss"], rel=1e-6)
    assert m["vf_clipfrac"] == pytest.approx(plain["clipfrac"], rel=1e-6)
    assert m["vf_explained_var"] == pytest.approx(plain["explained_var"], rel=1e-5)
    assert m["vpred_mean"] == pytest.approx(plain["vpred_mean"], rel=1e-5)
    assert got["metrics"]["vf_loss"] == pytest.approx(plain["loss"], rel=1e-6)  # 4 micro-batches
    assert set(got["grads"]) == set(plain["grads"])
    for name, want in plain["grads"].items():
        assert float(want.abs().max()) > 0, f"{mode}: reference gradient of {name} is zero"
        err = _rel(got["grads"][name], want)
        assert err <= 1e-5, f"{mode}: finalized gradient of {name}: rel err {err:.2e}"
    for a, b in zip(ref["values"], plain["values"], strict=True):
        assert float((a - b).abs().max()) <= 1e-6


def test_critic_step_is_split_invariant_in_one_process(single):
    for mode in MODES:
        base = single["reference"][(mode, "1mb")]
        for split in ("4mb", "budget"):
            _compare(base, single["reference"][(mode, split)], f"1proc/{mode}/{split}")
    losses = {m: single["reference"][(m, "1mb")]["metrics"]["vf_loss"] for m in MODES}
    assert len({round(v, 6) for v in losses.values()}) == len(MODES), losses  # the modes differ here


def test_non_finite_value_loss_is_skipped_and_finalize_is_checked(single):
    f = single["faults"]
    assert f["m1"]["skipped"] == 0.0 and f["m1"]["step"] == 1.0
    assert math.isnan(f["m2"]["vf_loss"]) and f["m2"]["skipped"] == 1.0 and f["m2"]["updates"] == 0.0
    assert f["changed_by_skip"] == [] and f["m3"]["skipped"] == 0.0 and f["moved_after"]
    assert f["finalize"] == (
        "critic_step: Megatron's schedule returned without calling finalize_model_grads; "
        "gradients were not reduced across data-parallel ranks"
    )


def test_checkpoint_of_policy_and_critic_round_trips(single):
    f = single["faults"]
    assert f["ckpt_steps"] == {"policy": 4, "critic": 3} and f["ckpt_extra"] == {"k": 1} and f["ckpt_same"]
    assert f["ckpt_continues"]
    assert "checkpoint holds the train states ['policy', 'critic'], this run passes ['critic']" in f["ckpt_names"]


ERRORS = {
    # case: (error type, function, argument, expected excerpt, received excerpt)
    "unknown-head": ("InputError", "build_gpt", "head", "one of ('lm', 'value')", "'critic'"),
    "forward-logits-of-value-model": (
        "InputError",
        "forward_logits",
        "model",
        "a language model with a vocabulary output layer",
        "a value model (head='value')",
    ),
    "forward-values-of-policy": (
        "InputError",
        "forward_values",
        "model",
        "a value model (fnppo.build_gpt(cfg, head='value'))",
        "GPTModel with a vocabulary output layer",
    ),
    "train-step-of-value-model": ("InputError", "train_step", "state.model", "a language model", "a value model"),
    "compute-logprobs-of-value-model": (
        "InputError",
        "compute_logprobs",
        "model_chunks",
        "a language model",
        "a value model",
    ),
    "critic-step-of-policy": (
        "InputError",
        "critic_step",
        "state.model",
        "a value model",
        "GPTModel with a vocabulary output layer",
    ),
    "compute-values-of-policy": ("InputError", "compute_values", "model_chunks", "a value model", "GPTModel"),
    "no-returns": ("InputError", "critic_step", "batch[0].returns", "a tensor (the critic's targets", "None"),
    "no-values-with-clip": (
        "InputError",
        "critic_step",
        "batch[0].values",
        "since ValueLossConfig.clip_range=0.2",
        "None",
    ),
    "returns-for-some": (
        "InputError",
        "critic_step",
        "batch[1].returns",
        "a tensor (batch[0] has returns; all samples or none)",
        "None",
    ),
    "nan-returns": ("InputError", "critic_step", "batch[0].returns", "finite values", "NaN/inf"),
    "values-shape": ("InputError", "critic_step", "values", "(one value per position of the micro-batch)", "f32[1,"),
    "compute-values-shape": (
        "InputError",
        "compute_values",
        "values",
        "(one value per position of the micro-batch)",
        "f32[1,",
    ),
    "fresh-head-of-policy": (
        "InputError",
        "load_full_weights",
        "fresh_head",
        "False for a model without a value head",
        "True",
    ),
    "value-head-missing": (
        "InputError",
        "load_full_weights",
        "full",
        "a tensor named 'value_head.weight'",
        "no such tensor",
    ),
}


@pytest.mark.parametrize("case", list(ERRORS))
def test_critic_input_errors(single, case):
    kind, fn, arg, expected, received = ERRORS[case]
    got = single["errors"][case]
    assert got != "no error", case
    assert got[0] == kind, got
    check_message(getattr(fnppo, kind)(got[1]), getattr(fnppo, kind), fn, arg, expected, received)


def test_clipping_off_needs_no_rollout_values(single):
    assert single["errors"]["no-values-without-clip"] == "ran: skipped=0.0"


@pytest.mark.parametrize(
    "build,where",
    [
        (lambda: ValueLossConfig(clip_range=-0.1), "ValueLossConfig: argument 'clip_range'"),
        (lambda: ValueLossConfig(agg=Aggregation("mean")), "Aggregation: argument 'mode'"),
        (lambda: ValueLossConfig(agg=Aggregation("seq-mean-token-sum-norm")), "Aggregation: argument 'scale'"),
        (lambda: ValueLossConfig(agg="token-mean"), "ValueLossConfig: argument 'agg'"),
    ],
    ids=["negative-clip", "unknown-mode", "norm-without-scale", "agg-not-an-aggregation"],
)
def test_value_loss_config_is_checked_when_built(build, where):
    with pytest.raises(fnppo.InputError, match=f"{where} expected"):
        build()


def test_critic_config_is_checked_when_built():
    with pytest.raises(fnppo.InputError, match="CriticConfig: argument 'num_minibatches' expected an int >= 1"):
        fnppo.CriticConfig(num_minibatches=0)
    with pytest.raises(fnppo.InputError, match="CriticConfig: argument 'layout' expected 'packed' or 'padded'"):
        fnppo.CriticConfig(layout="thd")


# ---------------------------------------------------------------------------------------------
# pure torch: values and returns in the batch
# ---------------------------------------------------------------------------------------------
def test_values_and_returns_are_collated_like_the_other_per_token_fields():
    from fnppo.core.batching.collate import collate_microbatch, pad_microbatch, unpack_per_sample

    a = fnppo.Sample.from_lists([1, 2, 3], [4, 5], values=[0.5, -0.5], returns=[1.0, 2.0])
    b = fnppo.Sample.from_lists([6], [7, 8, 9], values=[0.1, 0.2, 0.3], returns=[3.0, 4.0, 5.0])
    for layout in ("packed", "padded"):
        mb = collate_microbatch([a, b], layout=layout, pad_to_multiple_of=4)
        for field in ("values", "returns"):
            got = unpack_per_sample(getattr(mb, field), mb)
            assert [t.tolist() for t in got] == [getattr(a, field).tolist(), getattr(b, field).tolist()]
            # placed at the position of each response token's label (the state before it), 0 elsewhere
            assert float(getattr(mb, field).abs().sum()) == pytest.approx(
                float(getattr(a, field).abs().sum() + getattr(b, field).abs().sum())
            )
        padded = pad_microbatch(mb, mb.input_ids.shape[1] + 3)
        assert padded.values.shape == padded.input_ids.shape and float(padded.values[:, -3:].abs().sum()) == 0.0
    plain = collate_microbatch([fnppo.Sample.from_lists([1], [2])])
    assert plain.values is None and plain.returns is None
    with pytest.raises(fnppo.InputError, match=r"Sample: argument 'returns' expected length 2 \(the response length\)"):
        fnppo.Sample.from_lists([1], [2, 3], returns=[1.0])
    with pytest.raises(
        fnppo.InputError, match=r"argument 'samples\[1\].values' expected a tensor \(samples\[0\] has values"
    ):
        collate_microbatch([a, fnppo.Sample.from_lists([1], [2], returns=[0.0])])


# ---------------------------------------------------------------------------------------------
# layouts
# ---------------------------------------------------------------------------------------------
TWO_RANKS = {
    # name: (tp, pp, vpp, cp, sequence_parallel, cases)
    "dp2": (1, 1, None, 1, False, [(m, "1mb") for m in MODES] + [("token-mean", "budget")]),
    "tp2": (2, 1, None, 1, False, [(m, "1mb") for m in MODES]),
    "tp2-sp": (2, 1, None, 1, True, [("token-mean", "1mb"), ("seq-mean-token-mean", "4mb")]),
    "pp2": (1, 2, None, 1, False, [(m, "4mb") for m in MODES]),
    "pp2-vpp2": (1, 2, 2, 1, False, [("token-mean", "4mb")]),
    "cp2": (1, 1, None, 2, False, [("token-mean", "1mb"), ("token-mean", "4mb")]),
}


def _layouts(table: dict) -> dict:
    import torch.distributed as dist

    out = {}
    for name, (tp, pp, vpp, cp, sp, cases) in table.items():
        layout = fnppo.init_parallel(tp=tp, pp=pp, vpp=vpp, cp=cp)
        out[name] = {"cases": {case: _one_update(*case, sequence_parallel=sp) for case in cases}}
        if cp > 1:  # the critic refuses a sequence-level loss under context parallelism, before anything runs
            state = _build()
            try:
                fnppo.critic_step(
                    state, fnppo.shard_for_data_parallel(_samples(), layout), _critic_cfg("seq-mean-token-mean")
                )
                out[name]["refusal"] = "no error"
            except fnppo.InputError as err:
                out[name]["refusal"] = str(err)
    return out if dist.get_rank() == 0 else {}


@pytest.fixture(scope="module")
def two_ranks():
    return run_ranks(_layouts, 2, TWO_RANKS)[0]


@pytest.mark.parametrize("name", list(TWO_RANKS))
def test_critic_layouts_match_one_process(single, two_ranks, name):
    worst = 0.0
    for (mode, split), got in two_ranks[name]["cases"].items():
        worst = max(worst, _compare(single["reference"][(mode, "1mb")], got, f"{name}/{mode}/{split}"))
    print(f"\n{name}: max relative difference vs 1 process {worst:.2e}")


def test_critic_refuses_sequence_losses_under_context_parallelism(two_ranks):
    msg = two_ranks["cp2"]["refusal"]
    check_message(
        fnppo.InputError(msg),
        fnppo.InputError,
        "critic_step",
        "config.loss.agg.mode",
        "'token-mean' with context parallelism (cp=2)",
        "'seq-mean-token-mean'",
    )


def test_critic_dp2_x_tp2_matches_one_process(single):
    table = {"dp2xtp2": (2, 1, None, 1, False, [("token-mean", "4mb"), ("seq-mean-token-mean", "1mb")])}
    got = run_ranks(_layouts, 4, table)[0]["dp2xtp2"]["cases"]
    worst = max(
        _compare(single["reference"][(mode, "1mb")], r, f"dp2xtp2/{mode}/{split}") for (mode, split), r in got.items()
    )
    print(f"\ndp2xtp2: max relative difference vs 1 process {worst:.2e}")
