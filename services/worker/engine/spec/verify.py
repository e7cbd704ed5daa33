"""Acceptance of a proposed run against what the target sampled at each of its positions.

The target samples every verified position exactly as plain decoding would (greedy: argmax;
sampled: the exponential race with the request's (seed, output index) noise, sampler.py). A
proposal is accepted iff it equals the target's sample there; the first mismatch is replaced by the
target's token, and a fully accepted run gains the target's token after it (the bonus token).

For a deterministic proposer (n-gram, or a draft model's greedy argmax, spec/draft.py: the draft
distribution is a point mass q = 1 on x) this is exactly speculative rejection sampling: x is
accepted with probability p(x) = min(1, p(x)/q(x)), and on rejection the token comes from p without
x, renormalized = norm(max(0, p - q)). So the output follows the target distribution, and with a
seed it is token-identical to decoding without speculation, disaggregated or unified. (A sampled
draft, q not a point mass, would need the general rule: accept with min(1, p/q), resample from
norm(max(0, p - q)).)
"""

from __future__ import annotations

from collections.abc import Sequence


def accept_run(proposals: Sequence[int], targets: Sequence[int]) -> list[int]:
    """targets[i] is the target's token at the position of proposals[i] (len(targets) =
    len(proposals) + 1): returns the accepted proposals + the target's token after them."""
    if len(targets) != len(proposals) + 1:
        raise ValueError(
            f"{len(proposals)} proposals need {len(proposals) + 1} target tokens, got {len(targets)}"
        )
    accepted = 0
    while accepted < len(proposals) and proposals[accepted] == targets[accepted]:
        accepted += 1
    return list(targets[: accepted + 1])
