"""fnppo.vlm: images reach the model, through every split and layout (real Megatron on CPU).

The collate stage expands placeholders (checked against lists built by hand), the model writes
image features at the placeholders (checked against a per-sample forward assembled by hand), and
``train_step`` / ``compute_logprobs`` give the same loss, grad norm, updated parameters (vision
tower included) and log-probs for micro-batches with no image, all images and a mix, token-budget
splits, the padded layout, DP=2, TP=2 and PP=2 as one process with one micro-batch.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import fnppo
from fnppo.batch import Sample, collate_microbatch, unpack_per_sample
from fnppo.testing import run_ranks
from fnppo.typing import InputError
from tests.step_helpers import gather_dp, max_metric_error

IMG = 5  # the placeholder token
N_TOK = 4  # tokens per image: 8x8 images, 4x4 patches
REL = 1e-5


def _vision(freeze: bool = False):
    from fnppo.vlm import VisionConfig

    return VisionConfig(image_token_id=IMG, image_size=8, patch_size=4, num_layers=1, hidden_size=32,
                        num_attention_heads=2, ffn_hidden_size=64, projector_hidden_size=48, freeze_vision=freeze)


def _images(k: int, seed: int) -> torch.Tensor:
    return torch.randn(k, 3, 8, 8, generator=torch.Generator().manual_seed(seed))


# prompt, response, number of images: the first sample has none; contiguous pairs give micro-batches
# with no image (0,1), all images (2,3: 1 and 2 images), and two mixes (4,5 and 6,7).
LAYOUT = [
    ([1, 2, 3], [7, 8, 9], 0),
    ([1, 4], [10, 11], 0),
    ([1, IMG, 3], [12, 13, 14, 15], 1),
    ([IMG, 1, 2, IMG, 3], [16, 17], 2),
    ([1, 2, 3, 4], [18], 0),
    ([1, 2, IMG, 3], [19, 20, 21], 1),
    ([IMG, 2], [22, 23, 24, 25, 26], 1),
    ([1, 6], [27, 28], 0),
]


def _batch(pixel_seed: int = 0) -> list[Sample]:
    g = torch.Generator().manual_seed(11)
    out = []
    for i, (p, r, k) in enumerate(LAYOUT):
        n = len(r)
        out.append(Sample(
            prompt_ids=torch.tensor(p), response_ids=torch.tensor(r), advantages=torch.randn(n, generator=g),
            old_logprobs=-4.0 + 0.3 * torch.randn(n, generator=g), ref_logprobs=-4.0 + 0.3 * torch.randn(n, generator=g),
            multi_modal={"images": _images(k, 100 * pixel_seed + i)} if k else {},
        ))
    return out


# ---------------------------------------------------------------------------------------------
# placeholder expansion and collation (no Megatron)
# ---------------------------------------------------------------------------------------------
def _collate(**kw):
    from fnppo.vlm import VLMCollate

    return VLMCollate(IMG, N_TOK, image_shape=(3, 8, 8), **kw)


def _expanded_by_hand(prompt: list[int]) -> list[int]:
    out: list[int] = []
    for t in prompt:
        out += [t] * (N_TOK if t == IMG else 1)
    return out


@pytest.mark.parametrize("layout", ["packed", "padded"])
def test_collate_builds_every_field_on_the_expanded_sequence(layout):
    batch = _batch()
    mb = _collate()(batch, layout=layout, pad_to_multiple_of=2)
    by_hand = [dataclasses.replace(s, prompt_ids=torch.tensor(_expanded_by_hand(p))) for s, (p, _, _) in zip(batch, LAYOUT)]
    ref = collate_microbatch(by_hand, layout=layout, pad_to_multiple_of=2)
    for name in ("input_ids", "position_ids", "labels", "loss_mask", "old_logprobs", "advantages", "ref_logprobs", "seq_ids", "cu_seqlens", "attention_mask"):
        a, b = getattr(mb, name), getattr(ref, name)
        assert (a is None and b is None) or torch.equal(a, b), name
    assert mb.prompt_lens == tuple(len(_expanded_by_hand(p)) for p, _, _ in LAYOUT)
    assert torch.equal(mb.multi_modal["images"], torch.cat([s.multi_modal["images"] for s in batch if s.multi_modal]))
    assert mb.multi_modal_counts["images"].tolist() == [k for _, _, k in LAYOUT]
    assert int((mb.input_ids == IMG).sum()) == N_TOK * sum(k for _, _, k in LAYOUT)
    # the response values come back unchanged, per sample
    for s, lp in zip(batch, unpack_per_sample(mb.old_logprobs, mb)):
        assert torch.equal(lp, s.old_logprobs)


def test_text_only_microbatch_has_no_image_key():
    mb = _collate()(_batch()[:2])
    assert mb.multi_modal == {} and mb.multi_modal_counts == {}
    assert torch.equal(mb.input_ids, collate_microbatch(_batch()[:2]).input_ids)


@pytest.mark.parametrize(
    "change,arg,expected",
    [
        (dict(prompt_ids=torch.tensor([1, IMG, IMG])), "samples[0].prompt_ids", "one image placeholder (token 5) per image: 1"),
        (dict(multi_modal={}), "samples[0].prompt_ids", "per image: 0"),
        (dict(response_ids=torch.tensor([IMG, 7])), "samples[0].response_ids", "no image placeholder"),
        (dict(multi_modal={"images": torch.zeros(1, 3, 4, 4)}), "samples[0].multi_modal['images']", "floating images [k, 3, 8, 8]"),
    ],
    ids=["two-placeholders-one-image", "placeholder-without-image", "placeholder-in-response", "wrong-image-size"],
)
def test_collate_refuses_placeholders_that_do_not_match_the_images(change, arg, expected):
    s = Sample.from_lists([1, IMG, 2], [7, 8], multi_modal={"images": torch.zeros(1, 3, 8, 8)})
    with pytest.raises(InputError) as err:
        _collate()([dataclasses.replace(s, **change)])
    msg = str(err.value)
    assert msg.startswith("fnppo.vlm.VLMCollate") and arg in msg and expected in msg, msg


def test_collate_checks_the_expanded_length():
    s = Sample.from_lists([1, IMG, 2], [7], multi_modal={"images": torch.zeros(1, 3, 8, 8)})  # 4 tokens, 7 expanded
    _collate(max_seq_len=7)([s])
    with pytest.raises(InputError, match="max_seq_len=6"):
        _collate(max_seq_len=6)([s])


def test_token_budget_counts_expanded_lengths():
    from fnppo.split import build_microbatches

    budget = 16
    plan, mbs = build_microbatches(_batch(), ("max_tokens_per_microbatch", budget), layout="packed", pad_to_multiple_of=1,
                                   collate=_collate(), device=torch.device("cpu"))
    assert all(mb.input_ids.numel() <= budget for mb in mbs), [mb.input_ids.numel() for mb in mbs]
    # images travel with their sample
    for group, mb in zip(plan.microbatches, mbs):
        assert mb.multi_modal_counts.get("images", torch.zeros(len(group))).tolist() == [LAYOUT[i][2] for i in group]


def test_scatter_image_features_against_a_loop():
    from fnppo.vlm import scatter_image_features

    g = torch.Generator().manual_seed(0)
    ids = torch.tensor([[1, IMG, IMG, 2, 0], [IMG, IMG, 3, IMG, IMG]])  # padded [b, s]: sample-major order
    emb = torch.randn(5, 2, 3, generator=g, dtype=torch.float64)
    feats = torch.randn(6, 3, generator=g, dtype=torch.float64)
    out = scatter_image_features(emb, ids, feats, IMG)
    ref = emb.clone()
    j = 0
    for b in range(2):
        for s in range(5):
            if ids[b, s] == IMG:
                ref[s, b] = feats[j]
                j += 1
    assert torch.equal(out, ref) and torch.equal(emb, emb.clone())
    with pytest.raises(InputError, match="6 rows"):
        scatter_image_features(emb, ids, feats[:5], IMG)


# ---------------------------------------------------------------------------------------------
# real Megatron: one run_ranks call per layout, every case inside it
# ---------------------------------------------------------------------------------------------
def _lm_cfg() -> fnppo.ModelConfig:
    return fnppo.ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                             ffn_hidden_size=64, vocab_size=64, max_seq_len=64)


def _loss_cfg() -> fnppo.PolicyLossConfig:
    return fnppo.PolicyLossConfig(policy_loss="ppo", loss_agg_mode="token-mean", entropy_coeff=0.01, kl_coef=0.05, kl_estimator="k3")


def _state(freeze: bool):
    from fnppo.vlm import build_vlm

    chunks = build_vlm(_lm_cfg(), _vision(freeze))
    fnppo.layout_invariant_init(chunks, seed=3)
    ddp = fnppo.wrap_ddp(chunks, use_distributed_optimizer=True)
    # Adam with a large eps: the first update is ~ lr * g / eps, so updated weights compare gradients
    return fnppo.TrainState(model=ddp, optimizer=fnppo.build_optimizer(ddp, lr=10.0, adam_eps=10.0, clip_grad=0.0))


SPLITS = {
    "1mb": {},
    "4mb": {"num_microbatches": 4},  # no image / all images / mixed / mixed
    "2mb": {"num_microbatches": 2},
    "budget": {"max_tokens_per_microbatch": 24},
    "padded-4mb": {"num_microbatches": 4, "layout": "padded"},
}


def _update(split: str, freeze: bool) -> dict:
    from fnppo.vlm import VLMCollate

    layout = fnppo.current_layout()
    state = _state(freeze)
    before = fnppo.gather_full_weights(state.model)
    cfg = fnppo.StepConfig(loss=_loss_cfg(), fns=fnppo.StepFns(collate=VLMCollate.from_config(_vision(), max_seq_len=64)), **SPLITS[split])
    samples = fnppo.shard_for_data_parallel(_batch(), layout)
    logprobs, _ = fnppo.compute_logprobs(state.model, samples, config=cfg)
    state, metrics = fnppo.train_step(state, samples, cfg)
    after = fnppo.gather_full_weights(state.model)
    logprobs = gather_dp(logprobs, layout)
    megatron_norm = float(state.optimizer.get_grad_norm())  # collective
    if layout.rank != 0:
        return {}
    return {"metrics": metrics, "before": before, "weights": after, "logprobs": logprobs, "megatron_norm": megatron_norm}


def _layout_cases(splits: tuple[str, ...]) -> dict:
    return {(split, freeze): _update(split, freeze) for split in splits for freeze in (False, True)}


def _by_hand_logits(model, batch: list[Sample]) -> list[torch.Tensor]:
    """Each sample alone ([1, L] padded), its embeddings assembled by hand: text rows from the word
    embedding, each image's N rows from the vision tower run on that image alone."""
    vlm = fnppo.model.unwrap_model(model)
    out = []
    for s in batch:
        rows, images = [], list(s.multi_modal.get("images", torch.zeros(0, 3, 8, 8)))
        for t in torch.cat([s.prompt_ids, s.response_ids]).tolist():
            if t == IMG:
                rows += list(vlm.image_features(images.pop(0)[None]))
            else:
                rows.append(vlm.language_model.embedding.word_embeddings.weight[t])
        emb = torch.stack(rows)[:, None, :]  # [L, 1, h]
        pos = torch.arange(emb.shape[0])[None]
        ids = torch.zeros_like(pos)
        out.append(vlm.language_model(ids, pos, None, decoder_input=emb)[0])
    return out


def _reference_extras() -> dict:
    """One process: placement against a hand-built forward, pixels matter, text-only batches."""
    from fnppo.vlm import VLMCollate

    state = _state(False)
    model = state.model[0]
    col = VLMCollate.from_config(_vision(), max_seq_len=64)
    batch = _batch()
    with torch.no_grad():
        model.eval()
        mb = col(batch)
        packed = fnppo.forward_logits(model, mb)[0]  # [T, V]
        starts = mb.cu_seqlens.tolist()
        by_hand = _by_hand_logits(model, batch)
        placement = max(float((packed[a:a + len(h)] - h).abs().max()) for a, h in zip(starts, by_hand))
    cfg = fnppo.StepConfig(fns=fnppo.StepFns(collate=col))
    lp, _ = fnppo.compute_logprobs(state.model, batch, config=cfg)
    lp_other_pixels, _ = fnppo.compute_logprobs(state.model, _batch(pixel_seed=1), config=cfg)
    # text only: the VLM's log-probs equal a plain GPTModel holding its language weights
    text = [s for s in batch if not s.multi_modal]
    lp_text, _ = fnppo.compute_logprobs(state.model, text, config=cfg)
    gpt = fnppo.build_gpt(_lm_cfg())
    full = fnppo.gather_full_weights(state.model)
    fnppo.load_full_weights(gpt, {k[len("language_model."):]: v for k, v in full.items() if k.startswith("language_model.")})
    lp_gpt, _ = fnppo.compute_logprobs(gpt, text)
    return {"placement": placement, "lp": lp, "lp_other_pixels": lp_other_pixels, "lp_text": lp_text, "lp_gpt": lp_gpt}


def _reference() -> dict:
    return {"cases": _layout_cases(("1mb", "4mb", "budget", "padded-4mb")), **_reference_extras()}


@pytest.fixture(scope="module")
def reference():
    return run_ranks(_reference, 1)[0]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


def _compare(ref: dict, got: dict, what: str) -> float:
    worst = max_metric_error(ref["metrics"], got["metrics"], ("loss", "grad_norm", "pg_loss", "entropy", "kl_loss"), what, REL)
    assert set(ref["weights"]) == set(got["weights"]), what
    for name, w in ref["weights"].items():
        err = _rel(got["weights"][name], w)
        assert err <= REL, f"{what}: parameter {name} rel err {err:.2e}"
        worst = max(worst, err)
    for a, b in zip(got["logprobs"], ref["logprobs"], strict=True):
        assert torch.allclose(a, b, rtol=REL, atol=REL), f"{what}: compute_logprobs differs"
    return worst


def _vision_moved(case: dict) -> list[bool]:
    return [not torch.equal(case["before"][k], v) for k, v in case["weights"].items() if k.startswith("vision_model.")]


def test_single_process_splits_agree_and_the_vision_tower_trains_or_stays_frozen(reference):
    cases = reference["cases"]
    for freeze in (False, True):
        base = cases[("1mb", freeze)]
        assert base["metrics"]["skipped"] == 0.0 and base["metrics"]["grad_norm"] > 1e-4
        assert abs(base["megatron_norm"] - base["metrics"]["grad_norm"]) <= 1e-5 * base["megatron_norm"]
        for split in ("4mb", "budget", "padded-4mb"):
            _compare(base, cases[(split, freeze)], f"{split}/freeze={freeze}")
        moved = _vision_moved(base)
        assert moved and (not any(moved) if freeze else all(moved)), moved
        proj = [not torch.equal(base["before"][k], v) for k, v in base["weights"].items() if k.startswith("vision_projection.")]
        assert proj and all(proj)  # the projector trains either way
    # frozen and trained differ only through the vision tower's own update
    assert cases[("1mb", False)]["metrics"]["loss"] == cases[("1mb", True)]["metrics"]["loss"]


def test_image_features_land_on_their_placeholders(reference):
    assert reference["placement"] <= 1e-5, reference["placement"]


def test_pixels_change_the_response_logprobs_of_their_own_sample_only(reference):
    for (_, _, k), a, b in zip(LAYOUT, reference["lp"], reference["lp_other_pixels"], strict=True):
        diff = float((a - b).abs().max())
        assert diff > 1e-4 if k else diff == 0.0, (k, diff)


def test_text_only_batch_equals_the_plain_language_model(reference):
    for a, b in zip(reference["lp_text"], reference["lp_gpt"], strict=True):
        assert torch.allclose(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "world,tp,pp,splits",
    [(2, 1, 1, ("1mb", "2mb")), (2, 2, 1, ("1mb", "budget")), (2, 1, 2, ("4mb",))],
    ids=["dp2", "tp2", "pp2"],
)
def test_layouts_match_single_process(reference, world, tp, pp, splits):
    results = run_ranks(_layout_cases, world, splits, tp=tp, pp=pp)[0]
    worst = 0.0
    for (split, freeze), got in results.items():
        worst = max(worst, _compare(reference["cases"][("1mb", freeze)], got, f"tp{tp}-pp{pp}-ws{world}/{split}/freeze={freeze}"))
    print(f"tp{tp}-pp{pp}-ws{world}: max relative difference {worst:.2e}")
