"""fnppo.megatron.vlm: images reach the model, through every split and layout (real Megatron on CPU).

The collate stage expands placeholders (checked against lists built by hand), the model writes
image features at the placeholders (checked against a per-sample forward assembled by hand), and
``train_step`` / ``compute_logprobs`` give the same loss, grad norm, updated parameters (vision
tower included) and log-probs for micro-batches with no image, all images and a mix, token-budget
splits, the padded layout, DP=2, TP=2 and PP=2 as one process with one micro-batch. Routing replay
on an MoE language model: routed experts expand with the placeholders (checked against micro-batches
assembled by hand), misaligned ones are refused, and a recorded routing replays bit for bit.
"""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

import fnppo
import fnppo.megatron.unwrap
from fnppo.core.batching.collate import collate_microbatch, unpack_per_sample
from fnppo.core.batching.sample import Sample
from fnppo.core.errors import InputError
from fnppo.core.losses import Aggregation, KLPenalty, LossConfig, ppo_clip
from fnppo.testing import run_ranks, tiny_model_config
from tests.step_helpers import gather_dp, max_metric_error

IMG = 5  # the placeholder token
N_TOK = 4  # tokens per image: 8x8 images, 4x4 patches
REL = 1e-5


def _vision(freeze: bool = False):
    from fnppo.megatron.vlm_collate import VisionConfig

    return VisionConfig(
        image_token_id=IMG,
        image_size=8,
        patch_size=4,
        num_layers=1,
        hidden_size=32,
        num_attention_heads=2,
        ffn_hidden_size=64,
        projector_hidden_size=48,
        freeze_vision=freeze,
    )


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
        out.append(
            Sample(
                prompt_ids=torch.tensor(p),
                response_ids=torch.tensor(r),
                advantages=torch.randn(n, generator=g),
                old_logprobs=-4.0 + 0.3 * torch.randn(n, generator=g),
                ref_logprobs=-4.0 + 0.3 * torch.randn(n, generator=g),
                multi_modal={"images": _images(k, 100 * pixel_seed + i)} if k else {},
            )
        )
    return out


# ---------------------------------------------------------------------------------------------
# placeholder expansion and collation (no Megatron)
# ---------------------------------------------------------------------------------------------
def _collate(**kw):
    from fnppo.megatron.vlm_collate import VLMCollate

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
    by_hand = [
        dataclasses.replace(s, prompt_ids=torch.tensor(_expanded_by_hand(p))) for s, (p, _, _) in zip(batch, LAYOUT)
    ]
    ref = collate_microbatch(by_hand, layout=layout, pad_to_multiple_of=2)
    for name in (
        "input_ids",
        "position_ids",
        "labels",
        "loss_mask",
        "old_logprobs",
        "advantages",
        "ref_logprobs",
        "seq_ids",
        "cu_seqlens",
        "attention_mask",
    ):
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
        (
            dict(prompt_ids=torch.tensor([1, IMG, IMG])),
            "samples[0].prompt_ids",
            "one image placeholder (token 5) per image: 1",
        ),
        (dict(multi_modal={}), "samples[0].prompt_ids", "per image: 0"),
        (dict(response_ids=torch.tensor([IMG, 7])), "samples[0].response_ids", "no image placeholder"),
        (
            dict(multi_modal={"images": torch.zeros(1, 3, 4, 4)}),
            "samples[0].multi_modal['images']",
            "floating images [k, 3, 8, 8]",
        ),
    ],
    ids=["two-placeholders-one-image", "placeholder-without-image", "placeholder-in-response", "wrong-image-size"],
)
def test_collate_refuses_placeholders_that_do_not_match_the_images(change, arg, expected):
    s = Sample.from_lists([1, IMG, 2], [7, 8], multi_modal={"images": torch.zeros(1, 3, 8, 8)})
    with pytest.raises(InputError) as err:
        _collate()([dataclasses.replace(s, **change)])
    msg = str(err.value)
    assert msg.startswith("fnppo.megatron.vlm_collate.VLMCollate") and arg in msg and expected in msg, msg


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")], ids=["nan", "inf", "-inf"])
def test_collate_refuses_non_finite_pixels_naming_the_sample_and_key(bad):
    """A NaN/inf pixel is refused (while call-time checking is on) naming the sample and the key;
    with checking off it is not read (no host sync), as the other value checks."""
    from tests.messages import check_message

    batch = _batch()
    images = batch[3].multi_modal["images"].clone()
    images[1, 2, 5, 6] = bad
    batch[3] = dataclasses.replace(batch[3], multi_modal={"images": images})
    with pytest.raises(InputError) as err:
        _collate()(batch)
    check_message(
        err.value,
        InputError,
        "fnppo.megatron.vlm_collate.VLMCollate",
        "samples[3].multi_modal['images']",
        "finite pixel values",
        "f32[2,3,8,8] with 1 NaN/inf pixels (the first in image 1)",
    )
    with fnppo.core.typing.typechecking(False):
        mb = _collate()(batch)
    assert not bool(torch.isfinite(mb.multi_modal["images"]).all())


@pytest.mark.parametrize("image_shape", [(3, 8, 8), None], ids=["with-image-shape", "without-image-shape"])
def test_an_image_without_its_item_dimension_is_named_not_the_prompt(image_shape):
    """``[3, 8, 8]`` instead of ``[1, 3, 8, 8]`` would be read as 3 images: the image is refused by
    its key before the placeholders are counted, with or without ``image_shape``."""
    from fnppo.megatron.vlm_collate import VLMCollate
    from tests.messages import check_message

    s = Sample.from_lists([1, IMG, 2], [7, 8], multi_modal={"images": torch.zeros(3, 8, 8)})
    want = "floating images [k, 3, 8, 8]" if image_shape else "floating images [k, C, H, W]"
    with pytest.raises(InputError) as err:
        VLMCollate(IMG, N_TOK, image_shape=image_shape)([_batch()[0], s])
    check_message(
        err.value,
        InputError,
        "fnppo.megatron.vlm_collate.VLMCollate",
        "samples[1].multi_modal['images']",
        f"{want} (an image without its leading item dimension k?)",
        "f32[3,8,8]",
    )


def test_vision_config_takes_bools_only():
    from fnppo.megatron.vlm_collate import VisionConfig
    from tests.messages import check_message

    for value in ("yes", 0, 1):
        with pytest.raises(InputError) as err:
            VisionConfig(image_token_id=IMG, freeze_vision=value)
        check_message(err.value, InputError, "VisionConfig", "freeze_vision", "a bool", repr(value))


def _entry_refusals() -> dict:
    """The step's entry check of the VLM collate stage, and the model's own image-shape check.

    ``one_channel``: compute_logprobs through a collate stage built without image_shape, on 1-channel
    images (the model knows its image shape); ``forward``: the model itself on such a micro-batch;
    ``nan_pixel``: train_step with a NaN pixel in the last sample of the last mini-batch of the last
    epoch (``changed``: the weights it changed, none expected)."""
    from fnppo.megatron.vlm_collate import VLMCollate

    out = {}
    state = _state(False)
    chunks = state.model
    loose = VLMCollate(IMG, N_TOK)
    cfg = fnppo.StepConfig(loss=_loss_cfg(), fns=fnppo.StepFns(collate=loose))
    good = _batch()[:3]
    fnppo.compute_logprobs(chunks, good, config=cfg)  # 3-channel images run
    bad = dataclasses.replace(good[2], multi_modal={"images": torch.zeros(1, 1, 8, 8)})
    for key, call in {
        "one_channel": lambda: fnppo.compute_logprobs(chunks, [*good[:2], bad], config=cfg),
        "forward": lambda: fnppo.forward_logits(chunks[0], loose([bad])),
    }.items():
        try:
            call()
            out[key] = "no error"
        except InputError as err:
            out[key] = str(err)
    samples = _batch()[:4]
    nan = _images(LAYOUT[3][2], 7)  # sample 3 has two images: the second gets one NaN pixel
    nan[1, 1, 2, 3] = float("nan")
    samples[3] = dataclasses.replace(samples[3], multi_modal={"images": nan})
    step_cfg = fnppo.StepConfig(
        loss=_loss_cfg(),
        num_minibatches=2,
        ppo_epochs=2,
        fns=fnppo.StepFns(collate=VLMCollate.from_config(_vision(), max_seq_len=64)),
    )
    before = fnppo.models.gather_full_weights(state.model)
    try:
        fnppo.train_step(state, samples, step_cfg)
        out["nan_pixel"] = "no error"
    except InputError as err:
        out["nan_pixel"] = str(err)
    after = fnppo.models.gather_full_weights(state.model)
    out["changed"] = [k for k in before if not torch.equal(before[k], after[k])]
    return out


def test_the_step_and_the_model_refuse_images_of_another_shape_or_nan_pixels():
    """A hand-built VLMCollate without image_shape passes 1-channel images on; the step's entry check
    knows the model's image shape (VisionConfig) and refuses them naming the caller's sample, before
    anything runs; the model itself refuses them by name before its ViT runs; a NaN pixel in the last
    mini-batch of the last epoch is refused before the first update, naming batch[3]."""
    from tests.messages import check_message

    out = run_ranks(_entry_refusals, 1)[0]
    check_message(
        InputError(out["one_channel"]),
        InputError,
        "compute_logprobs",
        "batch[2].multi_modal['images']",
        "floating images [k, 3, 8, 8]",
        "f32[1,1,8,8]",
    )
    check_message(
        InputError(out["forward"]),
        InputError,
        "fnppo.megatron.vlm_model.VisionLanguageGPT.forward",
        "multi_modal['images']",
        "floating images [k, 3, 8, 8]",
        "f32[1,1,8,8]",
    )
    check_message(
        InputError(out["nan_pixel"]),
        InputError,
        "train_step",
        "batch[3].multi_modal['images']",
        "finite pixel values",
        "1 NaN/inf pixels (the first in image 1)",
    )
    assert out["changed"] == []


def test_collate_checks_the_expanded_length():
    s = Sample.from_lists([1, IMG, 2], [7], multi_modal={"images": torch.zeros(1, 3, 8, 8)})  # 4 tokens, 7 expanded
    _collate(max_seq_len=7)([s])
    with pytest.raises(InputError, match="max_seq_len=6"):
        _collate(max_seq_len=6)([s])


def test_token_budget_counts_expanded_lengths():
    from fnppo.core.batching.split import build_microbatches
    from fnppo.core.batching.splits.tokens import ByTokens

    budget = 16
    plan, mbs = build_microbatches(
        _batch(),
        ByTokens(budget),
        layout="packed",
        pad_to_multiple_of=1,
        collate=_collate(),
        device=torch.device("cpu"),
    )
    assert all(mb.input_ids.numel() <= budget for mb in mbs), [mb.input_ids.numel() for mb in mbs]
    # images travel with their sample
    for group, mb in zip(plan.microbatches, mbs):
        assert mb.multi_modal_counts.get("images", torch.zeros(len(group))).tolist() == [LAYOUT[i][2] for i in group]


def test_scatter_image_features_against_a_loop():
    from fnppo.megatron.vlm_model import scatter_image_features

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
# routing replay: the routes follow the expanded tokens (no Megatron)
# ---------------------------------------------------------------------------------------------
LAYERS, TOPK = 2, 2
UNSET = torch.full((LAYERS, TOPK), -1)


def _position_routes(n: int, offset: int = 0) -> torch.Tensor:
    """``[n, LAYERS, TOPK]`` int16 routes whose row ``t`` names ``t`` (``t + offset``): a row out of place shows."""
    t = torch.arange(n)[:, None, None] + offset
    return (t + 1000 * torch.arange(LAYERS * TOPK).view(1, LAYERS, TOPK)).to(torch.int16)


def _unexpanded_rows(expanded: torch.Tensor, prompt: list[int], response: list[int]) -> torch.Tensor:
    """The expanded rows of one sample cut to its unexpanded tokens, a row of -1 at each placeholder."""
    rows, t = [], 0
    for tok in prompt + response:
        rows.append(UNSET.to(expanded.dtype) if tok == IMG else expanded[t])
        t += N_TOK if tok == IMG else 1
    return torch.stack(rows)


def _rows_by_hand(routes: torch.Tensor, prompt: list[int], response: list[int], expanded: bool) -> list[torch.Tensor]:
    """One row per position of the expanded sequence, built token by token: the rows as given
    (``expanded``), else each token's own row and N rows of -1 per placeholder; -1 past the rows."""
    full = len(_expanded_by_hand(prompt)) + len(response)
    if expanded:
        rows = list(routes)
    else:
        rows = []
        for u, tok in enumerate(prompt + response):
            rows += [UNSET] * N_TOK if tok == IMG else [routes[u] if u < len(routes) else UNSET]
    return [r.to(torch.int32) for r in rows] + [UNSET.to(torch.int32)] * (full - len(rows))


# per sample of LAYOUT: (expanded form?, rows left out at the end); text samples have one form
FORMS = {
    "expanded": [(True, 0), (True, 1), (True, 0), (True, 1), (True, 0), (True, 1), (True, 0), (True, 0)],
    "unexpanded": [(True, 0), (True, 1), (False, 0), (False, 1), (True, 0), (False, 1), (False, 0), (True, 1)],
}


@pytest.mark.parametrize("form", list(FORMS))
def test_routes_follow_the_expanded_tokens(form):
    """Routes of the expanded sequence (what an engine records) or of the unexpanded tokens with -1
    at the placeholders: after collation every position holds the row of its own token (-1 at the
    image positions of the unexpanded form, at a missing last row and on padding), against a
    micro-batch assembled by hand; the caller's tensors are not written."""
    batch = []
    for i, ((p, r, _), (expanded, missing)) in enumerate(zip(LAYOUT, FORMS[form], strict=True)):
        rows = _position_routes(len(_expanded_by_hand(p)) + len(r), offset=100 * i)
        if not expanded:
            rows = _unexpanded_rows(rows, p, r)
        batch.append(dataclasses.replace(_batch()[i], routed_experts=rows[: len(rows) - missing]))
    batch[4] = dataclasses.replace(
        batch[4], routed_experts=batch[4].routed_experts.clone().index_fill_(0, torch.tensor([2]), -1)
    )
    before = [
        (s.prompt_ids.clone(), s.prompt_ids._version, s.routed_experts.clone(), s.routed_experts._version)
        for s in batch
    ]
    for layout in ("packed", "padded"):
        mb = _collate()(batch, layout=layout, pad_to_multiple_of=4)
        segments = []
        for s, (p, r, _), (expanded, _) in zip(batch, LAYOUT, FORMS[form], strict=True):
            rows = _rows_by_hand(s.routed_experts, p, r, expanded)
            width = mb.input_ids.shape[1] if layout == "padded" else -(-len(rows) // 4) * 4
            segments.append(torch.stack(rows + [UNSET.to(torch.int32)] * (width - len(rows))))
        want = torch.cat(segments)[None] if layout == "packed" else torch.stack(segments)
        assert mb.routed_experts.dtype == torch.int32 and torch.equal(mb.routed_experts, want), (form, layout)
        # every row given names its own sample and expanded position: nothing shifted against the tokens
        given = (mb.seq_ids >= 0) & (mb.routed_experts[..., 0, 0] >= 0)
        pos = mb.routed_experts[..., 0, 0] - 100 * mb.seq_ids
        assert torch.equal(pos[given], mb.position_ids[given])
        at_images = mb.routed_experts[mb.input_ids == IMG]
        assert bool((at_images >= 0).all() if form == "expanded" else (at_images == -1).all()), form
    for s, (ids, ids_v, routes, routes_v) in zip(batch, before, strict=True):
        assert torch.equal(s.prompt_ids, ids) and s.prompt_ids._version == ids_v
        assert torch.equal(s.routed_experts, routes) and s.routed_experts._version == routes_v


def test_expand_image_routes_against_a_loop():
    """The public function alone: several images, a missing last row, an unsigned engine dtype."""
    from fnppo.megatron.vlm_collate import expand_image_routes

    prompt, response = [IMG, 1, IMG, IMG, 2], [3, 4]
    is_image = torch.tensor([t == IMG for t in prompt + response])
    full = _position_routes(len(_expanded_by_hand(prompt)) + len(response))
    assert torch.equal(expand_image_routes(full[:-1], is_image, N_TOK), full[:-1])
    short = _unexpanded_rows(full, prompt, response)[:-1]
    got = expand_image_routes(short, is_image, N_TOK)
    assert got.dtype == torch.int16 and torch.equal(
        got.int(), torch.stack(_rows_by_hand(short, prompt, response, False))
    )
    # uint8 rows of an image-only prompt (the placeholder's row missing): signed output, -1 at the image
    got = expand_image_routes(torch.tensor([[[1, 2], [3, 4]]], dtype=torch.uint8), torch.tensor([False, True]), N_TOK)
    assert (
        got.dtype == torch.int16
        and got[0].tolist() == [[1, 2], [3, 4]]
        and bool((got[1:] == -1).all())
        and len(got) == 1 + N_TOK
    )


def _route_error(case: str) -> InputError:
    """The error of one case of routes that do not fit the expanded sequence."""
    from fnppo.megatron.vlm_collate import VLMCollate

    image = {"images": torch.zeros(1, 3, 8, 8)}
    p, r = [1, IMG, 2], [7, 8]  # 5 tokens, 8 expanded
    full = _position_routes(8)

    def sample(rows: torch.Tensor, prompt: list[int] = p) -> Sample:
        return Sample.from_lists(prompt, r, multi_modal=image, routed_experts=rows)

    cases = {
        "neither": lambda: _collate()([sample(full[:6])]),
        "ambiguous": lambda: VLMCollate(IMG, 2)([sample(full[:5])]),  # 5 = 6 expanded - 1 = the 5 tokens
        "placeholder-row": lambda: _collate()([sample(full[:5])]),  # unexpanded rows, a real route at the placeholder
        "plain-collate": lambda: collate_microbatch([sample(full)]),
        "too-few": lambda: sample(full[:3]),
    }
    with pytest.raises(InputError) as err:
        cases[case]()
    return err.value


ROUTE_ERRORS = {  # case -> (function, argument, expected, received)
    "neither": (
        "VLMCollate",
        "samples[0].routed_experts",
        "8 or 7 rows (one per position of the expanded sequence: 1 image(s) x 4 positions), or 5 or 4 (one per token, a row of -1 at each placeholder)",
        "int16[6,2,2]",
    ),
    "ambiguous": (
        "VLMCollate",
        "samples[0].routed_experts",
        "6 rows (one per position of the expanded sequence: 1 image(s) x 2 positions; 5 rows are ambiguous",
        "int16[5,2,2]",
    ),
    "placeholder-row": (
        "VLMCollate",
        "samples[0].routed_experts",
        "a row of -1 at each image placeholder (5 rows: one per token of the unexpanded sequence",
        "experts [[1, 1001], [2001, 3001]] at placeholder token 1",
    ),
    "plain-collate": (
        "collate_microbatch",
        "samples[0].routed_experts",
        "5 or 4 rows (one per token collated; routes of a sequence whose multi-modal "
        "items take several positions need the collate stage that expands them, e.g. fnppo.vlm.VLMCollate)",
        "int16[8,2,2]",
    ),
    "too-few": (
        "Sample",
        "routed_experts",
        "at least 4 rows (one per position of the sequence the model runs",
        "int16[3,2,2]",
    ),
}


@pytest.mark.parametrize("case", list(ROUTE_ERRORS))
def test_routes_that_do_not_fit_the_expanded_sequence_are_refused(case):
    from tests.messages import check_message

    check_message(_route_error(case), InputError, *ROUTE_ERRORS[case])


# ---------------------------------------------------------------------------------------------
# real Megatron: one run_ranks call per layout, every case inside it
# ---------------------------------------------------------------------------------------------
def _lm_cfg() -> fnppo.ModelConfig:
    return tiny_model_config(max_seq_len=64)


def _loss_cfg() -> LossConfig:
    return LossConfig(policy=ppo_clip(), agg=Aggregation("token-mean"), entropy_coef=0.01, kl=KLPenalty(0.05, "k3"))


def _state(freeze: bool):
    from fnppo.megatron.vlm_model import build_vlm

    chunks = build_vlm(_lm_cfg(), _vision(freeze))
    fnppo.models.layout_invariant_init(chunks, seed=3)
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
    from fnppo.megatron.vlm_collate import VLMCollate

    layout = fnppo.parallel.current_layout()
    state = _state(freeze)
    before = fnppo.models.gather_full_weights(state.model)
    cfg = fnppo.StepConfig(
        loss=_loss_cfg(), fns=fnppo.StepFns(collate=VLMCollate.from_config(_vision(), max_seq_len=64)), **SPLITS[split]
    )
    samples = fnppo.shard_for_data_parallel(_batch(), layout)
    logprobs, _ = fnppo.compute_logprobs(state.model, samples, config=cfg)
    state, metrics = fnppo.train_step(state, samples, cfg)
    after = fnppo.models.gather_full_weights(state.model)
    logprobs = gather_dp(logprobs, layout)
    megatron_norm = float(state.optimizer.get_grad_norm())  # collective
    if layout.rank != 0:
        return {}
    return {
        "metrics": metrics,
        "before": before,
        "weights": after,
        "logprobs": logprobs,
        "megatron_norm": megatron_norm,
    }


def _layout_cases(splits: tuple[str, ...]) -> dict:
    return {(split, freeze): _update(split, freeze) for split in splits for freeze in (False, True)}


def _by_hand_logits(model, batch: list[Sample]) -> list[torch.Tensor]:
    """Each sample alone ([1, L] padded), its embeddings assembled by hand: text rows from the word
    embedding, each image's N rows from the vision tower run on that image alone."""
    vlm = fnppo.megatron.unwrap.unwrap_model(model)
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
    from fnppo.megatron.vlm_collate import VLMCollate

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
        placement = max(float((packed[a : a + len(h)] - h).abs().max()) for a, h in zip(starts, by_hand))
    cfg = fnppo.StepConfig(fns=fnppo.StepFns(collate=col))
    lp, _ = fnppo.compute_logprobs(state.model, batch, config=cfg)
    lp_other_pixels, _ = fnppo.compute_logprobs(state.model, _batch(pixel_seed=1), config=cfg)
    # text only: the VLM's log-probs equal a plain GPTModel holding its language weights
    text = [s for s in batch if not s.multi_modal]
    lp_text, _ = fnppo.compute_logprobs(state.model, text, config=cfg)
    gpt = fnppo.build_gpt(_lm_cfg())
    full = fnppo.models.gather_full_weights(state.model)
    fnppo.models.load_full_weights(
        gpt, {k[len("language_model.") :]: v for k, v in full.items() if k.startswith("language_model.")}
    )
    lp_gpt, _ = fnppo.compute_logprobs(gpt, text)
    return {"placement": placement, "lp": lp, "lp_other_pixels": lp_other_pixels, "lp_text": lp_text, "lp_gpt": lp_gpt}


def _moe_replay() -> dict:
    """An MoE language model under the vision tower: record the routing of the expanded batch, replay
    it as recorded, as the unexpanded tokens with -1 at the placeholders, shifted by one row (a
    misalignment of the right length), with the image rows dropped (refused); training steps on the
    record and on the shifted rows, the record's log-probs as the old ones."""
    from fnppo.megatron.vlm_model import build_vlm

    run = _moe_record()
    chunks, step, batch, lp, routes, col, cfg = (
        run[k] for k in ("chunks", "step", "batch", "lp", "routes", "collate", "cfg")
    )

    def replay(rows: list[torch.Tensor]) -> list[torch.Tensor]:
        return fnppo.compute_logprobs(
            chunks, [dataclasses.replace(s, routed_experts=r) for s, r in zip(batch, rows, strict=True)], config=step
        )[0]

    out = {"lp": lp, "routes": routes, "lengths": [col.collated_length(s) for s in batch]}
    out["replay"] = replay(routes)
    out["unexpanded"] = replay([_unexpanded_rows(r, p, y) for r, (p, y, _) in zip(routes, LAYOUT, strict=True)])
    out["shifted"] = replay([r.roll(1, dims=0) for r in routes])

    def without_images(s: Sample, r: torch.Tensor) -> torch.Tensor:  # the rows of the text tokens only
        z = torch.cat([s.prompt_ids, s.response_ids])
        return r[(z != IMG).repeat_interleave(torch.where(z == IMG, N_TOK, 1))]

    for case, which in (("dropped-one-image", 2), ("dropped-two-images", 3)):  # samples with 1 and 2 images
        try:
            replay(
                [without_images(s, r) if i == which else r for i, (s, r) in enumerate(zip(batch, routes, strict=True))]
            )
        except InputError as e:
            out[case] = str(e)
    ddp = fnppo.wrap_ddp(chunks)
    state = fnppo.TrainState(
        model=ddp, optimizer=fnppo.build_optimizer(ddp, lr=0.0)
    )  # lr 0: both steps see these weights
    for case, rows in (("train", routes), ("train_shifted", [r.roll(1, dims=0) for r in routes])):
        replayed = [
            dataclasses.replace(s, routed_experts=r, old_logprobs=o) for s, r, o in zip(batch, rows, lp, strict=True)
        ]
        _, out[case] = fnppo.train_step(state, replayed, step)
    # Megatron's "block" recomputation of the first layer only: its router replays again in the
    # backward (from the language decoder's block, below the vision tower), the other keeps nothing.
    from fnppo.megatron.routing import _first_layers

    blocky = build_vlm(cfg, _vision(), recompute_granularity="full", recompute_method="block", recompute_num_layers=1)
    fnppo.models.layout_invariant_init(blocky, seed=3, std=0.2)
    out["first_layers"] = sorted(_first_layers(blocky[0]).values())
    ddp = fnppo.wrap_ddp(blocky)
    state = fnppo.TrainState(model=ddp, optimizer=fnppo.build_optimizer(ddp, lr=0.0))
    for case, rows in (("train_block", routes), ("train_block_shifted", [r.roll(1, dims=0) for r in routes])):
        replayed = [
            dataclasses.replace(s, routed_experts=r, old_logprobs=o) for s, r, o in zip(batch, rows, lp, strict=True)
        ]
        _, out[case] = fnppo.train_step(state, replayed, step)
    return out


def _moe_lm_cfg() -> fnppo.ModelConfig:
    return dataclasses.replace(_lm_cfg(), num_experts=4, moe_topk=2, moe_ffn_hidden_size=48)


def _moe_record() -> dict:
    """The MoE VLM (large router logits: replay and free routing tell apart), its step config and
    batch, and the batch's log-probs and recorded routes on this rank's layout."""
    from fnppo.megatron.vlm_collate import VLMCollate
    from fnppo.megatron.vlm_model import build_vlm

    cfg = _moe_lm_cfg()
    chunks = build_vlm(cfg, _vision())
    fnppo.models.layout_invariant_init(chunks, seed=3, std=0.2)
    col = VLMCollate.from_config(_vision(), max_seq_len=64)
    step = fnppo.StepConfig(loss=_loss_cfg(), fns=fnppo.StepFns(collate=col), num_microbatches=2, pad_to_multiple_of=4)
    batch = _batch()
    lp, _, routes = fnppo.compute_logprobs(chunks, batch, config=step, return_routing=True)
    return {"cfg": cfg, "collate": col, "chunks": chunks, "step": step, "batch": batch, "lp": lp, "routes": routes}


def _moe_layout_worker(reference_routes: list, reference_lp: list) -> dict:
    """The MoE VLM on a parallel layout, every rank with the whole batch: its record, its replay of
    the single-process record, and training steps on that record and on it shifted by one row."""
    run = _moe_record()
    chunks, step, batch = run["chunks"], run["step"], run["batch"]
    replayed = [dataclasses.replace(s, routed_experts=r) for s, r in zip(batch, reference_routes, strict=True)]
    out = {"routes": run["routes"], "lp": run["lp"], "replay": fnppo.compute_logprobs(chunks, replayed, config=step)[0]}
    ddp = fnppo.wrap_ddp(chunks)
    state = fnppo.TrainState(model=ddp, optimizer=fnppo.build_optimizer(ddp, lr=0.0))
    for case, rows in (("train", reference_routes), ("train_shifted", [r.roll(1, dims=0) for r in reference_routes])):
        samples = [
            dataclasses.replace(s, routed_experts=r, old_logprobs=o)
            for s, r, o in zip(batch, rows, reference_lp, strict=True)
        ]
        _, out[case] = fnppo.train_step(state, samples, step)
    layout = fnppo.parallel.current_layout()
    out["layout"] = (layout.tp, layout.pp, layout.ep)
    return out


def _fused_worker() -> dict:
    """compute_logprobs (current weights, and a snapshot as ``params``) and a train_step of the VLM,
    unfused then with ``StepConfig(fns=StepFns.fused(collate=...))``, from the same weights; the updates."""
    from fnppo.megatron.vlm_collate import VLMCollate
    from fnppo.megatron.vlm_model import build_vlm

    out = {}
    for fused in (False, True):
        chunks = build_vlm(_lm_cfg(), _vision())
        fnppo.models.layout_invariant_init(chunks, seed=3, std=0.2)
        col = VLMCollate.from_config(_vision(), max_seq_len=64)
        step = fnppo.StepConfig(
            loss=_loss_cfg(),
            fns=fnppo.StepFns.fused(collate=col) if fused else fnppo.StepFns(collate=col),
            num_microbatches=2,
            pad_to_multiple_of=4,
            temperature=0.9,
        )
        batch = _batch()
        frozen = fnppo.models.snapshot_params(chunks)
        lp, ent = fnppo.compute_logprobs(chunks, batch, with_entropy=True, config=step)
        ddp = fnppo.wrap_ddp(chunks)
        state = fnppo.TrainState(model=ddp, optimizer=fnppo.build_optimizer(ddp, lr=1e-2))
        init = fnppo.models.gather_full_weights(state.model)
        samples = [dataclasses.replace(s, old_logprobs=o.detach() - 0.05) for s, o in zip(batch, lp, strict=True)]
        state, metrics = fnppo.train_step(state, samples, step)
        lp_ref, _ = fnppo.compute_logprobs(state.model, batch, params=frozen, config=step)
        full = fnppo.models.gather_full_weights(state.model)
        out[fused] = {
            "lp": lp,
            "ent": ent,
            "lp_ref": lp_ref,
            "metrics": metrics,
            "update": {k: full[k] - init[k] for k in full},
        }
    return out


def _reference() -> dict:
    return {"cases": _layout_cases(("1mb", "4mb", "budget", "padded-4mb")), **_reference_extras(), "moe": _moe_replay()}


@pytest.fixture(scope="module")
def reference():
    return run_ranks(_reference, 1)[0]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


def _compare(ref: dict, got: dict, what: str) -> float:
    worst = max_metric_error(
        ref["metrics"], got["metrics"], ("loss", "grad_norm", "pg_loss", "entropy", "kl_loss"), what, REL
    )
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
        proj = [
            not torch.equal(base["before"][k], v)
            for k, v in base["weights"].items()
            if k.startswith("vision_projection.")
        ]
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


def test_moe_vlm_replays_its_recorded_routing_bit_for_bit(reference):
    from tests.messages import check_message

    moe = reference["moe"]
    for r, n in zip(moe["routes"], moe["lengths"], strict=True):  # one row per position of the expanded sequence
        assert r.dtype == torch.int16 and r.shape == (n, 2, 2), (r.shape, n)
    for got, want in zip(moe["replay"], moe["lp"], strict=True):
        assert torch.equal(got, want)
    # the image positions left to the router: it chooses what it chose when recording
    for got, want in zip(moe["unexpanded"], moe["lp"], strict=True):
        assert torch.equal(got, want)
    # the routes are forced: one row out of place changes the log-probs
    assert min(float((a - b).abs().max()) for a, b in zip(moe["shifted"], moe["lp"], strict=True)) > 1e-3
    # the rows of the text tokens only (the image rows dropped): refused where the count shows it
    # (one image: the unexpanded token count less one, whose placeholder row is the next token's)
    n, at = len(LAYOUT[2][0]) + len(LAYOUT[2][1]), LAYOUT[2][0].index(IMG)
    msg = moe["dropped-one-image"]
    # (the step's entry check asks the collate stage, VLMCollate.check_batch, naming the caller's batch[i])
    assert re.match(
        r"compute_logprobs: argument 'batch\[\d\]\.routed_experts' expected a row of -1 at each image "
        rf"placeholder \({n - 1} rows: one per token of the unexpanded sequence",
        msg,
    ), msg
    assert re.search(rf", received experts \[\[.*\]\] at placeholder token {at}$", msg), msg
    n = len(LAYOUT[3][0]) + len(LAYOUT[3][1])
    check_message(
        InputError(moe["dropped-two-images"]),
        InputError,
        "Sample",
        "routed_experts",
        f"at least {n - 1} rows",
        f"int16[{n - 2},2,2]",
    )
    # training on the record: the first forward reproduces the old log-probs exactly
    assert moe["train"]["ppo_kl"] == 0.0 and moe["train"]["pg_clipfrac"] == 0.0, moe["train"]
    assert abs(moe["train_shifted"]["ppo_kl"]) > 1e-4, moe["train_shifted"]
    # with the first layer recomputed: the routers belong to the decoder's block (first layer 1), and
    # the step (its gradients through the recomputed, replayed router) equals the plain one
    assert moe["first_layers"] == [1, 1], moe["first_layers"]
    # (the shifted rows are not what the router would choose: a recomputation routing freely would differ)
    for case in ("train", "train_shifted"):
        got, want = moe[case.replace("train", "train_block")], moe[case]
        assert (
            abs(got["ppo_kl"] - want["ppo_kl"]) <= 1e-7
            and abs(got["grad_norm"] - want["grad_norm"]) <= 1e-6 * want["grad_norm"]
        ), case


def _build_error(moe: bool) -> str:
    from fnppo.megatron.vlm_model import build_vlm

    cfg = _moe_lm_cfg() if moe else _lm_cfg()
    try:
        build_vlm(cfg, _vision())
    except InputError as err:
        return str(err)
    return "no error"


@pytest.mark.parametrize(
    "moe,kw,expected,received",
    [
        (True, dict(tp=2), "tp=1 for a Mixture-of-Experts language model", "tp=2"),
        (False, dict(cp=2), "cp=1 (image features are placed on the whole expanded sequence", "cp=2"),
    ],
    ids=["moe-tp2", "cp2"],
)
def test_build_vlm_refuses_layouts_it_cannot_train(moe, kw, expected, received):
    """An MoE VLM under TP (Megatron's MoE layers train under TP only with sequence parallelism) and
    any VLM under context parallelism are refused by name when built, not deep inside Megatron."""
    from tests.messages import check_message

    msg = run_ranks(_build_error, 2, moe, **kw)[0]
    check_message(InputError(msg), InputError, "fnppo.vlm.build_vlm", "layout", expected, received)


@pytest.mark.parametrize("world,pp", [(1, 1), (2, 2)], ids=["1-process", "pp2"])
def test_fused_output_layer_equals_the_unfused_step(world, pp):
    """StepFns.fused() on a VLM (whose GPTModel sits under ``language_model``): the
    log-probs, entropies, a snapshot's log-probs (``params``), the step's metrics and every weight's
    update equal the unfused path's."""
    for r in run_ranks(_fused_worker, world, pp=pp):
        a, b = r[False], r[True]
        for name in ("lp", "ent", "lp_ref"):
            for x, y in zip(b[name], a[name], strict=True):
                torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5, msg=name)
        for key in ("loss", "grad_norm", "pg_loss", "entropy"):
            assert abs(b["metrics"][key] - a["metrics"][key]) <= 1e-5 * max(abs(a["metrics"][key]), 1e-12), key
        assert set(a["update"]) == set(b["update"]) and any(k.startswith("vision_model.") for k in a["update"])
        for k, u in a["update"].items():
            assert float((b["update"][k] - u).abs().max()) <= 1e-5 * max(float(u.abs().max()), 1e-12) + 1e-9, k


@pytest.mark.parametrize("tp,pp,ep", [(1, 1, 2), (1, 2, 1)], ids=["ep2", "pp2"])
def test_moe_vlm_records_and_replays_the_same_routes_on_a_parallel_layout(reference, tp, pp, ep):
    """Under EP=2 (two experts a rank; the ViT and projector stay dense) and PP=2, every rank records
    the routes of the single process, replays the single-process record to its log-probs, and trains
    on it with the old log-probs reproduced (a record shifted by one row does not)."""
    moe = reference["moe"]
    ranks = run_ranks(_moe_layout_worker, 2, moe["routes"], moe["lp"], tp=tp, pp=pp, ep=ep)
    for r in ranks:
        assert r["layout"] == (tp, pp, ep)
        for got, want in zip(r["routes"], moe["routes"], strict=True):
            assert torch.equal(got, want)
        for name in ("lp", "replay"):
            for got, want in zip(r[name], moe["lp"], strict=True):
                assert (got - want).abs().max().item() <= 1e-5, name
        assert abs(r["train"]["ppo_kl"]) <= 1e-6 and r["train"]["pg_clipfrac"] == 0.0, r["train"]
        assert abs(r["train_shifted"]["ppo_kl"]) > 1e-4, r["train_shifted"]


@pytest.mark.parametrize(
    "world,tp,pp,splits",
    [(2, 1, 1, ("1mb", "2mb")), (2, 2, 1, ("1mb", "budget")), (2, 1, 2, ("4mb",))],
    ids=["dp2", "tp2", "pp2"],
)
def test_layouts_match_single_process(reference, world, tp, pp, splits):
    results = run_ranks(_layout_cases, world, splits, tp=tp, pp=pp)[0]
    worst = 0.0
    for (split, freeze), got in results.items():
        worst = max(
            worst,
            _compare(reference["cases"][("1mb", freeze)], got, f"tp{tp}-pp{pp}-ws{world}/{split}/freeze={freeze}"),
        )
    print(f"tp{tp}-pp{pp}-ws{world}: max relative difference {worst:.2e}")
