"""Delta weight streams: ``stream_hf_deltas`` + ``apply_hf_deltas`` rebuild the new weights bit for bit.

One launch of two gloo ranks (the pool of ``tests/test_hf_stream.py``, its checkpoints: a Llama and a
Qwen2-MoE with a shared expert) under TP=2, PP=2, DP=2 and EP=2 (the MoE model), and a LoRA-merged
Llama under TP=2: per layout, a full first sync, then the weights change (some elements of every
parameter; for LoRA, the adapters) and a delta stream in each granularity (tensors, blocks, elements)
and in FP8 is applied by the receiver to what it held. The reference is independent of the deltas:
the full stream (``stream_hf_weights``) of the new weights, compared bit for bit. The digests are
checked against ``hashlib`` over the tensors' bytes, and the snapshot is the same on both ranks and
in every layout. Bad snapshots, bad streams and receivers whose bits differ are refused by name with
nothing changed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools

import pytest
import torch

from fnppo.core.errors import InputError
from fnppo.testing import run_ranks
from tests.messages import check_message
from tests.test_hf_stream import stream_checkpoints  # noqa: F401 - the module's fixture

LAYOUTS = [("tp2", 2, 1, 1, 0), ("pp2", 1, 2, 1, 1), ("dp2", 1, 1, 1, 0), ("ep2", 1, 1, 2, 1)]
FP8 = (16, 16)  # divides every projection of the tiny checkpoints
GRANULARITIES = ("tensors", "blocks", "elements")
BLOCK_BYTES = 1024  # a few rows per block at these widths


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _same(a: dict, b: dict) -> bool:
    return sorted(a) == sorted(b) and all(a[k].dtype == b[k].dtype and torch.equal(_bits(a[k]), _bits(b[k])) for k in a)


def _perturb(chunks, seed: int, lora: bool) -> None:
    """Change some elements of every parameter (a LoRA model: its adapters), the same on every rank."""
    from fnppo.megatron.lora import is_adapter
    from fnppo.megatron.unwrap import unwrap_model

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for c in chunks:
            for _, p in sorted(unwrap_model(c).named_parameters()):
                if lora != is_adapter(p):
                    continue
                mask = torch.rand(p.shape, generator=g) < 0.05
                p.copy_(p + mask.to(p.dtype) * 0.05)


def _full(chunks, dst: int, fp8) -> dict:
    from fnppo.io.hf import stream_hf_weights

    pairs = itertools.chain.from_iterable(stream_hf_weights(chunks, dst_rank=dst, fp8=fp8))
    return {n: t.clone() for n, t in pairs}


def _sync(chunks, dst: int, rank: int, fp8, lora: bool) -> dict:
    """A full sync and a delta per granularity; on ``dst`` what the receiver rebuilt and the full stream."""
    from fnppo.io.hf import apply_hf_deltas, stream_hf_deltas

    out: dict = {}
    for gran in GRANULARITIES:
        first = stream_hf_deltas(chunks, None, step=0, granularity=gran, dst_rank=dst, fp8=fp8, block_bytes=BLOCK_BYTES)
        buckets = list(first)
        weights, held = apply_hf_deltas({}, buckets, None) if rank == dst else ({}, None)
        full0 = _full(chunks, dst, fp8)
        state = {n: p.detach().clone() for c in chunks for n, p in c.named_parameters()}
        _perturb(chunks, 7, lora)
        delta = stream_hf_deltas(
            chunks, first.snapshot, step=1, granularity=gran, dst_rank=dst, fp8=fp8, block_bytes=BLOCK_BYTES
        )
        dbuckets = list(delta)
        full1 = _full(chunks, dst, fp8)
        with torch.no_grad():  # back to the first weights for the next granularity
            for c in chunks:
                for n, p in c.named_parameters():
                    p.copy_(state[n])
        res = dict(digests=dict(delta.snapshot.digests), first_digests=dict(first.snapshot.digests))
        if rank == dst:
            new, new_held = apply_hf_deltas(weights, dbuckets, held)
            records = [r for b in dbuckets for r in b][1:-1]
            res.update(
                first_ok=_same(weights, full0),
                ok=_same(new, full1),
                held_ok=new_held.id == delta.snapshot.id,
                full=full1,
                encodings=sorted({r.encoding for r in records}),
                sent=sum(r.nbytes for r in records),
                total=sum(t.numel() * t.element_size() for t in full1.values()),
                unchanged_same=all(new[k] is weights[k] for k in weights if k not in {r.name for r in records}),
            )
        out[gran] = res
    return out


def _delta_worker(ckpts: dict) -> dict:
    import fnppo
    from fnppo.io.hf import build_gpt_from_hf, load_hf_weights

    res: dict = {}
    for name, tp, pp, ep, dst in LAYOUTS:
        layout = fnppo.init_parallel(tp=tp, pp=pp, ep=ep, device="cpu")
        families = ["qwen2_moe"] if ep > 1 else ["llama", "qwen2_moe"]
        for family in families:
            chunks = build_gpt_from_hf(ckpts[family][0], dtype="bf16")
            load_hf_weights(chunks, ckpts[family][0])
            for fp8 in (None, fnppo.hf.FP8Blocks(FP8)):
                res[(name, family, fp8 is not None)] = _sync(chunks, dst, layout.rank, fp8, lora=False)
        if name == "tp2":  # LoRA-merged: the adapters change, the merged weights are streamed
            chunks = build_gpt_from_hf(ckpts["llama"][0], dtype="bf16")
            load_hf_weights(chunks, ckpts["llama"][0])
            fnppo.lora.apply_lora(chunks, fnppo.lora.LoRAConfig(rank=4, alpha=8.0, seed=3))
            _perturb(chunks, 5, lora=True)  # B = 0 at the start: make the adapters matter
            res[("tp2", "llama-lora", False)] = _sync(chunks, dst, layout.rank, None, lora=True)
        res[(name, "layout")] = (layout.tp, layout.pp, layout.ep, layout.dp)
    return res


@pytest.fixture(scope="module")
def delta_run(stream_checkpoints):  # noqa: F811 - the imported fixture
    return run_ranks(_delta_worker, 2, stream_checkpoints, timeout_s=900)


def _cases(run: list) -> list:
    return sorted(k for k in run[0] if len(k) == 3)


@pytest.mark.parametrize("name", [lay[0] for lay in LAYOUTS])
def test_delta_plus_apply_is_the_new_weights_bit_for_bit(delta_run, name):
    _, tp, pp, ep, dst = next(lay for lay in LAYOUTS if lay[0] == name)
    assert delta_run[0][(name, "layout")] == (tp, pp, ep, 2 // (tp * pp))
    cases = [k for k in _cases(delta_run) if k[0] == name]
    assert len(cases) >= 2
    for key in cases:
        for gran, got in delta_run[dst][key].items():
            assert got["first_ok"] and got["ok"] and got["held_ok"], (key, gran)
            assert got["unchanged_same"], (key, gran)  # unchanged tensors are the receiver's own
            assert 0 < got["sent"] <= got["total"], (key, gran, got["sent"], got["total"])
            allowed = {"tensors": {"full"}, "blocks": {"full", "blocks"}, "elements": {"full", "blocks", "elements"}}
            assert set(got["encodings"]) <= allowed[gran], (key, gran, got["encodings"])
            if gran == "elements" and not key[2] and key[1] != "llama-lora":  # 5% of the elements changed
                assert "elements" in got["encodings"] and got["sent"] < got["total"] / 2, (key, got["sent"])
            if gran == "elements" and key[2]:  # FP8: a block's codes all change with its scale (its amax)
                assert got["sent"] < got["total"], (key, got["sent"])
            # LoRA-merged: a changed adapter changes every element of its merged weight (B A is dense)
            other = delta_run[1 - dst][key][gran]  # the same snapshot on both ranks
            assert other["digests"] == got["digests"] and other["first_digests"] == got["first_digests"]


def test_digests_are_sha256_of_the_bytes_and_the_same_in_every_layout(delta_run):
    from fnppo.io.hf.snapshot import rows_per_block

    for key in _cases(delta_run):
        dst = next(lay[4] for lay in LAYOUTS if lay[0] == key[0])
        got = delta_run[dst][key]["blocks"]
        for name, t in got["full"].items():  # an independent digest: hashlib over the block bytes
            raw = _bits(t).numpy().tobytes()
            rows = t.shape[0] if t.dim() else 1
            step = rows_per_block(tuple(t.shape), t.element_size(), BLOCK_BYTES) * (len(raw) // rows)
            blocks = b"".join(hashlib.sha256(raw[i : i + step]).digest() for i in range(0, len(raw), step))
            rpb = step // (len(raw) // rows)
            head = f"fnppo-tensor-v1|{t.dtype}|{list(t.shape)}|{rpb}|".encode()
            assert got["digests"][name] == hashlib.sha256(head + blocks).hexdigest(), (key, name)
    for family in ("llama", "qwen2_moe"):  # the snapshot does not depend on the parallel layout
        for fp8 in (False, True):
            seen = {
                k[0]: delta_run[0][k]["blocks"]["first_digests"] for k in _cases(delta_run) if k[1:] == (family, fp8)
            }
            assert len(seen) >= 3 and all(d == next(iter(seen.values())) for d in seen.values()), (family, fp8)


def _refusals(path: str, moe_path: str) -> dict:
    import fnppo
    from fnppo.io.hf import apply_hf_deltas, build_gpt_from_hf, load_hf_weights, stream_hf_deltas

    chunks = build_gpt_from_hf(path, dtype="bf16")
    load_hf_weights(chunks, path)
    moe = build_gpt_from_hf(moe_path, dtype="bf16")
    s0 = stream_hf_deltas(chunks, None, step=3, granularity="blocks", block_bytes=BLOCK_BYTES)
    b0 = list(s0)
    w0, h0 = apply_hf_deltas({}, b0, None)
    m0 = stream_hf_deltas(moe, None, step=3)
    list(m0)
    f0 = stream_hf_deltas(chunks, None, step=3, fp8=fnppo.hf.FP8Blocks(FP8))
    list(f0)
    with torch.no_grad():  # one element of each parameter: one block of each larger weight changes
        for p in chunks[0].parameters():
            p.view(-1)[0] += 0.5
    s1 = stream_hf_deltas(chunks, s0.snapshot, step=4, block_bytes=BLOCK_BYTES)
    b1 = list(s1)
    s2 = stream_hf_deltas(chunks, s1.snapshot, step=5, block_bytes=BLOCK_BYTES)
    b2 = list(s2)
    out: dict = {"b1": b1, "b2": b2, "w0": w0, "h0": h0, "h1_id": s1.snapshot.id}
    bad = {
        "another-model": lambda: stream_hf_deltas(chunks, m0.snapshot, step=4),
        "another-format": lambda: stream_hf_deltas(chunks, f0.snapshot, step=4),
        "another-dtype": lambda: stream_hf_deltas(chunks, s0.snapshot, step=4, dtype=torch.float32),
        "another-block": lambda: stream_hf_deltas(chunks, s0.snapshot, step=4),
        "same-step": lambda: stream_hf_deltas(chunks, s0.snapshot, step=3, block_bytes=BLOCK_BYTES),
        "no-bits": lambda: stream_hf_deltas(
            chunks, s0.snapshot, step=4, granularity="elements", block_bytes=BLOCK_BYTES
        ),
        "not-a-snapshot": lambda: stream_hf_deltas(chunks, {"step": 3}, step=4),
        "granularity": lambda: stream_hf_deltas(chunks, None, step=0, granularity="rows"),
        "step": lambda: stream_hf_deltas(chunks, None, step=-1),
        "step-str": lambda: stream_hf_deltas(chunks, None, step="1"),
        "block-bytes": lambda: stream_hf_deltas(chunks, None, step=0, block_bytes=0),
        "bucket-bytes": lambda: stream_hf_deltas(chunks, None, step=0, bucket_bytes=0),
        "dst-rank": lambda: stream_hf_deltas(chunks, None, step=0, dst_rank=1),
        "int-dtype": lambda: stream_hf_deltas(chunks, None, step=0, dtype=torch.int32),
        "another-config": lambda: stream_hf_deltas(chunks, None, step=0, hf_config=moe_path),
        "unfinished": lambda: stream_hf_deltas(chunks, None, step=0).snapshot,
    }
    for key, call in bad.items():
        try:
            call()
            out[key] = None
        except InputError as err:
            out[key] = str(err)
    return out


@pytest.fixture(scope="module")
def refusals(stream_checkpoints):  # noqa: F811 - the imported fixture
    return run_ranks(_refusals, 1, stream_checkpoints["llama"][0], stream_checkpoints["qwen2_moe"][0])[0]


def test_snapshots_of_another_model_format_or_step_are_refused_by_the_sender(refusals):
    fn = "fnppo.hf.stream_hf_deltas"
    r = refusals
    check_message(
        InputError(r["another-model"]), InputError, fn, "since", "a snapshot of this model", "a snapshot of model"
    )
    check_message(
        InputError(r["another-format"]), InputError, fn, "since", "in this stream's format 'plain", "'fp8-e4m3-16x16"
    )
    check_message(InputError(r["another-dtype"]), InputError, fn, "since", "dtype=torch.float32", "dtype=None")
    check_message(InputError(r["another-block"]), InputError, fn, "since", "block_bytes=65536", "block_bytes=1024")
    check_message(InputError(r["same-step"]), InputError, fn, "since", "a step before step=3", "step 3")
    check_message(
        InputError(r["no-bits"]), InputError, fn, "since", "holding the previous bits on dst_rank=0", "bits not kept"
    )
    check_message(InputError(r["not-a-snapshot"]), InputError, fn, "since", "None or a WeightSnapshot", "dict")
    check_message(InputError(r["granularity"]), InputError, fn, "granularity", "one of ('tensors'", "'rows'")
    check_message(InputError(r["step"]), InputError, fn, "step", "an int >= 0", "-1")
    check_message(InputError(r["step-str"]), InputError, fn, "step", "an int >= 0", "'1'")
    check_message(InputError(r["block-bytes"]), InputError, fn, "block_bytes", "an int >= 1", "0")
    check_message(
        InputError(r["unfinished"]), InputError, "DeltaStream.snapshot", "self", "iterated to its end", "not exhausted"
    )


def _refused(weights, stream, held) -> InputError:
    from fnppo.io.hf import apply_hf_deltas

    before = {k: v.clone() for k, v in weights.items()}
    with pytest.raises(InputError) as err:
        apply_hf_deltas(weights, stream, held)
    assert _same(weights, before)  # nothing changed
    return err.value


def test_receiver_refuses_truncated_foreign_or_mismatching_streams_and_changes_nothing(refusals):
    from fnppo.io.hf import apply_hf_deltas

    r = refusals
    fn = "fnppo.hf.apply_hf_deltas"
    w0, h0, b1, b2 = r["w0"], r["h0"], r["b1"], r["b2"]
    new, held = apply_hf_deltas(w0, b1, h0)  # the good stream applies
    assert held.id == r["h1_id"]
    items = [x for b in b1 for x in b]
    assert {x.encoding for x in items[1:-1]} == {"full", "blocks"}  # small tensors whole, larger ones by block
    changed = [n for n in new if not torch.equal(_bits(new[n]), _bits(w0[n]))]
    assert sorted(changed) == sorted(x.name for x in items[1:-1])
    check_message(_refused(w0, [items[:-1]], h0), InputError, fn, "stream", "ending with its DeltaEnd", "(truncated)")
    check_message(
        _refused(w0, [items[1:]], h0), InputError, fn, "stream", "starting with its DeltaHeader", "TensorDelta"
    )
    check_message(_refused(w0, [items[:2] + items[3:]], h0), InputError, fn, "stream", "tensor records", "(truncated)")
    check_message(_refused(w0, b2, h0), InputError, fn, "stream", "against the held snapshot (step 3", "step 4")
    check_message(_refused(w0, b1, None), InputError, fn, "held", "the snapshot the delta applies to", "None")
    other = dataclasses.replace(h0, model="0" * 16)
    check_message(_refused(w0, b1, other), InputError, fn, "stream", "a delta of the held model", "one of model")
    # a receiver whose bits differ from the snapshot: the rebuilt tensor's digest differs, nothing applied
    name = next(x.name for x in items[1:-1] if x.encoding != "full")
    corrupt = dict(w0)
    flat = corrupt[name].clone().reshape(-1)
    flat[-1] = flat[-1] + 1
    corrupt[name] = flat.reshape(corrupt[name].shape)
    check_message(
        _refused(corrupt, b1, h0), InputError, fn, f"stream[{name!r}]", "a rebuilt tensor of digest", "digest"
    )
    # a record whose values were altered on the way
    k = next(i for i, x in enumerate(items) if getattr(x, "encoding", None) == "blocks")
    bad = dataclasses.replace(items[k], values=items[k].values + 1)
    altered = items[:k] + [bad] + items[k + 1 :]
    check_message(_refused(w0, [altered], h0), InputError, fn, f"stream[{items[k].name!r}]", "rebuilt tensor", "digest")
    missing = {n: t for n, t in w0.items() if n != name}
    check_message(_refused(missing, b1, h0), InputError, fn, "weights", f"a tensor {name!r}", "none")
    check_message(_refused(w0, b1, "held"), InputError, fn, "held", "None or a WeightSnapshot", "str")
    with pytest.raises(InputError) as err:
        apply_hf_deltas(list(w0.items()), b1, h0)
    check_message(err.value, InputError, fn, "weights", "a mapping of Hugging Face names to tensors", "list")
    assert _same(new, new)
