"""Sampling through Megatron's forward-only schedule (any TP/PP layout), by inverse CDF from given uniforms."""

from __future__ import annotations

import warnings

import optree
import torch

import fnppo
from fnppo.core.ops.batch_invariant import batch_invariant
from toy.collectives import from_last_stage, gather_vocab
from toy.task import PROMPT_LEN, RESPONSE_LEN, VOCAB


def sample_responses(
    chunks,
    prompts,
    uniforms,
    *,
    temperature: float,
    layout,
    device,
    invariant: bool = False,
    params=None,
    bf16: bool = False,
    schedule=None,
):
    """Autoregressive sampling by inverse CDF with given uniforms ``[n, RESPONSE_LEN]``.

    Returns tokens ``[n, RESPONSE_LEN]`` and their log-probs (fp32). The uniforms are drawn for the
    global batch from (seed, step), so every layout samples the same tokens. Only the ``VOCAB`` real
    columns are sampled from (a padded vocabulary's extra columns are never drawn). ``invariant``
    (a batch-invariant model): the log-probs are :func:`invariant_logprobs`, bit for bit those of
    ``compute_logprobs``. ``params`` (one dict per model chunk, e.g. ``fnppo.models.snapshot_params``
    of an older policy): sample with these weights instead of the chunks' own (``--staleness``).
    ``bf16``: the forward runs under bf16 autocast, an inference engine's other numerics
    (``--sampler-dtype bf16``). ``schedule``: ``(weights, index)`` for partial rollouts
    (``--partial-rollouts``): token ``t`` of response ``i`` is sampled with ``weights[index[i, t]]``
    (one list of per-chunk dicts per version; ``params`` is then unused).
    """
    n = prompts.shape[0]
    seqs = prompts.clone()
    logps = torch.zeros(n, RESPONSE_LEN)
    for t in range(RESPONSE_LEN):
        logits = next_token_logits(
            chunks, seqs, t, layout=layout, device=device, params=params, bf16=bf16, schedule=schedule
        )
        pick = torch.zeros(2, n)
        if logits is not None:
            logp = torch.log_softmax(logits.cpu().double() / temperature, dim=-1)
            cdf = logp.exp().cumsum(-1)
            tok = (cdf < uniforms[:, t : t + 1].double() * cdf[:, -1:]).sum(-1).clamp_max(VOCAB - 1)
            pick[0] = tok.float()
            pick[1] = logp.gather(1, tok[:, None]).squeeze(1).float()
            if invariant:  # the inference engine's log-probs computed as the trainer computes them
                pick[1] = invariant_logprobs(logits, tok, temperature, layout).cpu()
        pick = from_last_stage(pick, layout, device)
        seqs = torch.cat([seqs, pick[0].long()[:, None]], dim=1)
        logps[:, t] = pick[1]
    return seqs[:, PROMPT_LEN:], logps


def next_token_logits(chunks, seqs, t: int, *, layout, device, params, bf16: bool, schedule):
    """The logits ``[n, VOCAB]`` of the token after ``seqs`` (None off the last pipeline stage): one
    forward with ``params``, or with a ``schedule`` one forward per version that samples token ``t``
    of some response, over those responses only."""
    if schedule is None:
        groups = [(params, None)]
    else:
        weights, index = schedule
        groups = [(weights[j], (index[:, t] == j).nonzero().squeeze(1)) for j in index[:, t].unique().tolist()]
    full = None
    for weights_j, rows in groups:
        part = seqs if rows is None else seqs[rows]
        samples = [fnppo.Sample(prompt_ids=part[i], response_ids=part.new_zeros(0)) for i in range(part.shape[0])]
        mb = to_device(fnppo.collate_microbatch(samples, layout="padded", pad_to_multiple_of=1), device)

        def last_logits(logits, mb):
            return gather_vocab(logits[:, -1, :].float(), layout)[:, :VOCAB]

        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16), warnings.catch_warnings():
            # bf16 activations meet the fp32 norm weights: torch's unfused layer norm, as intended here
            warnings.filterwarnings("ignore", message="Mismatch dtype between input and weight")
            out = fnppo.forward_only(chunks, [mb], last_logits, params=weights_j)
        if out is None:
            continue
        if rows is None:
            return out[0]
        if full is None:
            full = out[0].new_zeros(seqs.shape[0], out[0].shape[-1])
        full = full.index_copy(0, rows.to(full.device), out[0])
    return full


def invariant_logprobs(logits, tokens, temperature: float, layout):
    """``log softmax(logits / T)[token]`` by fnppo's log-prob kernel under batch-invariant numerics:
    with the model's batch-invariant forward, bit for bit what ``compute_logprobs`` gives the token
    (one tensor-parallel rank: ``logits`` are the full vocabulary)."""
    with batch_invariant(True):
        lp, _ = fnppo.logprob_and_entropy(
            logits[:, None, :].float(),
            tokens[:, None].to(logits.device),
            temperature=temperature,
            with_entropy=False,
            vocab_size=VOCAB,
            impl="torch",
        )
    return lp[:, 0].float()


def to_device(mb, device):
    if device.type == "cpu":
        return mb

    return optree.tree_map(lambda x: x.to(device), mb, namespace="fnppo")
