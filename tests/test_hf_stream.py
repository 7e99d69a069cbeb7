"""Tests for fnppo.io.hf.stream_hf_weights: weights streamed to an inference engine.

One launch of two gloo ranks loads a dense (Llama, untied) and an MoE (Qwen2-MoE: shared expert,
q/k/v bias, tied) Hugging Face checkpoint under TP=2, PP=2 (streamed to the last stage) and EP=2,
streams the weights to one rank in small buckets, and feeds every bucket, as it comes, to a
randomly initialized ``transformers`` model's ``load_state_dict``: its logits must equal fnppo's
and transformers' own on the checkpoint. Each rank's memory is measured while the iterator runs:
the torch storages it allocates that are still alive (``fnppo.testing.LiveBytes``),
bounded by one bucket plus one full tensor -- the whole model never is.
"""

from __future__ import annotations

import re

import pytest
import torch

from fnppo.core.errors import InputError
from fnppo.io.hf import build_gpt_from_hf, load_hf_weights, stream_hf_weights
from fnppo.testing import LiveBytes, run_ranks
from tests.messages import check_message, messages_of
from tests.test_hf import _COMMON, FAMILIES, MOE_FAMILIES, SEQ, _hf_logits, _megatron_logits

BUCKET = 64 * 2**10  # a few tensors of these tiny models; the models hold about 10 buckets each
LAYOUTS = [("tp2", 2, 1, 1, 0), ("pp2", 1, 2, 1, 1), ("ep2", 1, 1, 2, 0)]  # (name, tp, pp, ep, dst_rank)
STREAMED = {"llama": FAMILIES["llama"], "qwen2_moe": MOE_FAMILIES["qwen2_moe"]}


def _families(ckpts: dict, ep: int) -> dict:
    """The checkpoints a layout streams: under expert parallelism only the MoE one."""
    return {f: c for f, c in ckpts.items() if ep == 1 or f in MOE_FAMILIES}


def _stream_worker(ckpts: dict, bucket_bytes: int) -> dict:
    """Per layout and family: fnppo's logits (last stage), and on the receiving rank the buckets fed to
    a fresh transformers model, its logits, and the peak live bytes of each rank while streaming."""
    import transformers

    import fnppo

    res: dict = {}
    for name, tp, pp, ep, dst in LAYOUTS:
        layout = fnppo.init_parallel(tp=tp, pp=pp, ep=ep, device="cpu")
        for family, (path, ids, _) in _families(ckpts, ep).items():
            chunks = build_gpt_from_hf(path, dtype="fp32")
            load_hf_weights(chunks, path)
            res[(name, family, "fnppo")] = _megatron_logits(chunks, ids)
            engine, collected = None, {}
            if layout.rank == dst:
                torch.manual_seed(99)  # weights unlike the checkpoint's: every one must be streamed
                config = transformers.AutoConfig.from_pretrained(path)
                engine = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
            stream = stream_hf_weights(chunks, bucket_bytes=bucket_bytes, dst_rank=dst, hf_config=path)
            tracker, sizes, names = LiveBytes(), [], []
            while True:
                with tracker:
                    bucket = next(stream, None)
                if bucket is None:
                    break
                sizes.append([t.numel() * t.element_size() for _, t in bucket])
                names += [n for n, _ in bucket]
                if family in MOE_FAMILIES:  # transformers 5 fuses the experts: its checkpoint conversion does it
                    collected.update({n: t.clone() for n, t in bucket})
                else:
                    _, unexpected = engine.load_state_dict(dict(bucket), strict=False)
                    assert not unexpected, unexpected
                del bucket  # an engine copies the tensors in and lets go of them
            if collected:
                engine = type(engine).from_pretrained(None, config=config, state_dict=collected).eval()
            res[(name, family)] = dict(
                peak=tracker.peak,
                sizes=sizes,
                names=names,
                engine_keys=None if engine is None else sorted(engine.state_dict()),
                logits=None if engine is None else _hf_logits(engine, ids),
            )
        res[(name, "layout")] = (layout.tp, layout.pp, layout.ep)
    return res


def _errors(path: str) -> dict:
    chunks = build_gpt_from_hf(path, dtype="fp32")
    return messages_of(
        {
            "bucket": lambda: stream_hf_weights(chunks, bucket_bytes=0),
            "dst": lambda: stream_hf_weights(chunks, dst_rank=2),
        }
    )


@pytest.fixture(scope="module")
def stream_checkpoints(tmp_path_factory):
    """family -> (checkpoint dir, token ids [1, SEQ], transformers' logits on the checkpoint)."""
    transformers = pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("hf-stream")
    out = {}
    for i, (family, (cls_name, kwargs)) in enumerate(STREAMED.items()):
        config = getattr(transformers, cls_name)(**kwargs)
        config._attn_implementation = "eager"
        torch.manual_seed(40 + i)
        model = transformers.AutoModelForCausalLM.from_config(config).float()
        g = torch.Generator().manual_seed(40 + i)
        with torch.no_grad():  # larger than the default init, so every weight matters in the logits
            for pname, p in model.named_parameters():
                noise = torch.randn(p.shape, generator=g)
                p.copy_(1.0 + 0.2 * noise if pname.endswith("norm.weight") else 0.15 * noise)
        model.eval().save_pretrained(str(root / family))
        ids = torch.randint(0, _COMMON["vocab_size"], (1, SEQ), generator=torch.Generator().manual_seed(50 + i))
        out[family] = (str(root / family), ids, _hf_logits(model, ids))
    return out


@pytest.fixture(scope="module")
def stream_run(stream_checkpoints):
    return run_ranks(_stream_worker, 2, stream_checkpoints, BUCKET)


def _largest_and_total(tensors: dict) -> tuple[int, int]:
    """(bytes of the largest full Megatron tensor, of the whole model) from the Hugging Face tensors:
    q/k/v are one fused tensor, gate/up one fc1."""
    fused: dict[str, int] = {}
    for n, t in tensors.items():
        key = re.sub(r"(gate|up)_proj", "fc1", re.sub(r"[qkv]_proj", "qkv", n))
        fused[key] = fused.get(key, 0) + t.numel() * t.element_size()
    return max(fused.values()), sum(fused.values())


@pytest.mark.parametrize("name", [lay[0] for lay in LAYOUTS])
def test_streamed_weights_load_into_transformers_with_equal_logits_in_bounded_memory(
    stream_checkpoints, stream_run, name
):
    from safetensors.torch import load_file

    _, tp, pp, ep, dst = next(lay for lay in LAYOUTS if lay[0] == name)
    assert stream_run[0][(name, "layout")] == (tp, pp, ep)
    for family, (path, _, ref) in _families(stream_checkpoints, ep).items():
        checkpoint = load_file(f"{path}/model.safetensors")
        got = stream_run[dst][(name, family)]
        others = [r[(name, family)] for i, r in enumerate(stream_run) if i != dst]
        assert all(not o["sizes"] for o in others)  # only dst_rank receives
        # every tensor of the checkpoint once, in buckets of at most BUCKET bytes (or one tensor)
        assert sorted(got["names"]) == sorted(checkpoint), (name, family)
        assert len(got["sizes"]) > 3 and all(sum(s) <= BUCKET or len(s) == 1 for s in got["sizes"])
        if family not in MOE_FAMILIES:  # every weight of the engine was streamed (a tied lm_head is the embedding)
            keys = [k for k in got["engine_keys"] if k != "lm_head.weight" or k in checkpoint]
            assert sorted(keys) == sorted(got["names"])
        fn_logits = next(r[(name, family, "fnppo")] for r in stream_run if r[(name, family, "fnppo")] is not None)
        assert (got["logits"] - fn_logits).abs().max().item() <= 1e-5, (name, family)
        assert (got["logits"] - ref).abs().max().item() <= 1e-5, (name, family)
        # memory: at most one bucket plus one full tensor on every rank, far below the model
        largest, total = _largest_and_total(checkpoint)
        for r in stream_run:
            peak = r[(name, family)]["peak"]
            assert peak <= BUCKET + largest < total / 2, (name, family, peak, BUCKET + largest, total)
        print(
            f"{name} {family}: peak live bytes per rank {[r[(name, family)]['peak'] for r in stream_run]}, "
            f"bound {BUCKET + largest}, model {total}"
        )


def test_bad_arguments_are_refused(stream_checkpoints):
    res = run_ranks(_errors, 1, stream_checkpoints["llama"][0])[0]
    fn = "fnppo.io.hf.stream_hf_weights"
    check_message(InputError(res["bucket"]), InputError, fn, "bucket_bytes", "an int >= 1", "0")
    check_message(InputError(res["dst"]), InputError, fn, "dst_rank", "an int in [0, 1) (a rank of the world)", "2")


def test_live_bytes_counts_allocations_alive_not_views():
    x = torch.zeros(1000)
    with LiveBytes() as m:
        view = x[:500]
        x.add_(1)  # a view and an in-place op allocate nothing
        a = torch.empty(250)  # 1,000 bytes
        b = a * 2  # 1,000 more, both alive
        del a, b
        c = torch.ones(100)  # 400 bytes: the peak stays 2,000
    assert m.peak == 2000 and view.untyped_storage().nbytes() == 4000 and c.sum() == 100
