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
):
    """Autoregressive sampling by inverse CDF with given uniforms ``[n, RESPONSE_LEN]``.

    Returns tokens ``[n, RESPONSE_LEN]`` and their log-probs (fp32). The uniforms are drawn for the
    global batch from (seed, step), so every layout samples the same tokens. Only the ``VOCAB`` real
    columns are sampled from (a padded vocabulary's extra columns are never drawn). ``invariant``
    (a batch-invariant model): the log-probs are :func:`invariant_logprobs`, bit for bit those of
    ``compute_logprobs``. ``params`` (one dict per model chunk, e.g. ``fnppo.models.snapshot_params``
    of an older policy): sample with these weights instead of the chunks' own (``--staleness``).
    ``bf16``: the forward runs under bf16 autocast, an inference engine's other numerics
    (``--sampler-dtype bf16``).
    """
    n = prompts.shape[0]
    seqs = prompts.clone()
    logps = torch.zeros(n, RESPONSE_LEN)
    for t in range(RESPONSE_LEN):
        samples = [fnppo.Sample(prompt_ids=seqs[i], response_ids=seqs.new_zeros(0)) for i in range(n)]
        mb = fnppo.collate_microbatch(samples, layout="padded", pad_to_multiple_of=1)
        mb = to_device(mb, device)

        def last_logits(logits, mb):
            return gather_vocab(logits[:, -1, :].float(), layout)[:, :VOCAB]

        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16), warnings.catch_warnings():
            # bf16 activations meet the fp32 norm weights: torch's unfused layer norm, as intended here
            warnings.filterwarnings("ignore", message="Mismatch dtype between input and weight")
            out = fnppo.forward_only(chunks, [mb], last_logits, params=params)
        pick = torch.zeros(2, n)
        if out is not None:
            logp = torch.log_softmax(out[0].cpu().double() / temperature, dim=-1)
            cdf = logp.exp().cumsum(-1)
            tok = (cdf < uniforms[:, t : t + 1].double() * cdf[:, -1:]).sum(-1).clamp_max(VOCAB - 1)
            pick[0] = tok.float()
            pick[1] = logp.gather(1, tok[:, None]).squeeze(1).float()
            if invariant:  # the inference engine's log-probs computed as the trainer computes them
                pick[1] = invariant_logprobs(out[0], tok, temperature, layout).cpu()
        pick = from_last_stage(pick, layout, device)
        seqs = torch.cat([seqs, pick[0].long()[:, None]], dim=1)
        logps[:, t] = pick[1]
    return seqs[:, PROMPT_LEN:], logps


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
