"""Batched next-token sampling: greedy, temperature, top-k, top-p, per-request seeded generators.

Sampling uses the exponential-race form of categorical sampling (argmax of p / E with E ~ Exp(1)),
so each request draws its noise from its own generator: a seeded request gets the same tokens
whatever else is in the batch. A row with a seed has its generator re-seeded right before its draw
(the seed of an output index, Request.draw_seed), so several rows of one request (a speculative run)
each draw what plain decoding would have drawn at their index.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from services.worker.engine.api import SamplingConfig


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingConfig],
    generators: Sequence[torch.Generator | None],
    seeds: Sequence[int | None] | None = None,
) -> torch.Tensor:
    """logits [n, vocab] -> token ids [n] (long, on logits' device). seeds[i], when given and
    not None, re-seeds generators[i] before row i's draw."""
    greedy = [p.temperature <= 0.0 for p in params]
    if all(greedy):
        return logits.argmax(dim=-1)
    logits = logits.float()
    vocab = logits.shape[1]
    device = logits.device
    temps = torch.tensor([p.temperature if p.temperature > 0 else 1.0 for p in params], device=device)
    scaled = logits / temps[:, None]
    top_ks = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
    if any(top_ks):
        max_k = max(top_ks)
        kth_idx = torch.tensor([k - 1 if k else max_k - 1 for k in top_ks], device=device)
        top_vals = scaled.topk(max_k, dim=-1).values
        kth = top_vals.gather(1, kth_idx[:, None])
        apply = torch.tensor([k > 0 for k in top_ks], device=device)[:, None]
        scaled = scaled.masked_fill(apply & (scaled < kth), float("-inf"))
    top_ps = [p.top_p for p in params]
    if any(0.0 < tp < 1.0 for tp in top_ps):
        sorted_logits, sorted_idx = scaled.sort(dim=-1, descending=True)
        probs_sorted = sorted_logits.softmax(dim=-1)
        cum = probs_sorted.cumsum(dim=-1)
        tp = torch.tensor([t if 0.0 < t < 1.0 else 1.0 for t in top_ps], device=device)
        # drop a token when the mass before it already reaches top_p (the first always stays)
        drop = (cum - probs_sorted) >= tp[:, None]
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        scaled = torch.empty_like(scaled).scatter_(1, sorted_idx, sorted_logits)
    probs = scaled.softmax(dim=-1)
    noise = torch.empty_like(probs)
    unseeded = [i for i, g in enumerate(generators) if g is None]
    if unseeded:
        noise[unseeded] = torch.empty(len(unseeded), vocab, device=device).exponential_()
    for i, g in enumerate(generators):
        if g is not None:
            seed = seeds[i] if seeds is not None else None
            if seed is not None:
                g.manual_seed(seed)
            noise[i].exponential_(generator=g)
    sampled = (probs / noise).argmax(dim=-1)
    greedy_mask = torch.tensor(greedy, device=device)
    return torch.where(greedy_mask, logits.argmax(dim=-1), sampled)
