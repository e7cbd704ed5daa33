"""Batched next-token sampling: structured-output masks and logits processors (allowed_token_ids,
bad_words, min_tokens, logit_bias, penalties), then greedy, temperature, top-k, top-p, per-request
seeded generators; optionally the logprobs of the distribution drawn from.

The order is vLLM v1's: the structured-output mask first (apply_allowed), then allowed_token_ids
keeps only the listed tokens and bad_words bans the tokens that would complete a bad word, then
min_tokens masks the stop tokens, logit_bias is added, then the repetition, frequency and presence
penalties apply; a row whose thinking_token_budget is spent (thinking_budget.py) then keeps only
the closing tag's next token (whatever the mask or the other processors allowed: the tag must
come); temperature, top-k and top-p then shape the distribution the draw uses. Every
processor is batched over the rows that use it (indexed ops over the (row, token) pairs involved,
never a Python loop over the vocabulary), and each row's result depends only on that row's logits,
parameters and tokens, so a request gets the same tokens whatever else is in the batch, on a
prefill worker (its first token) as on a decode worker.

Sampling uses the exponential-race form of categorical sampling (argmax of p / E with E ~ Exp(1)),
so each request draws its noise from its own generator: a seeded request gets the same tokens
whatever else is in the batch. A row with a seed has its generator re-seeded right before its draw
(the seed of an output index, Request.draw_seed), so several rows of one request (a speculative run)
each draw what plain decoding would have drawn at their index.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from services.worker.engine import thinking_budget
from services.worker.engine.api import SamplingConfig, TokenLogprobs
from services.worker.engine.pinned import to_device
from services.worker.engine.thinking_budget import ThinkingBudget, ThinkingState


@dataclass(frozen=True)
class TokenHistory:
    """A request's tokens before one draw, for penalties and min_tokens (Request.token_history).

    Derived from the token lists alone, so a prefill worker (first token), a decode worker (the
    prompt + the handed-off first token) and a migrated request (prompt + generated tokens as its
    prompt, first_output_index of them generated) see the same history at the same output index."""

    token_ids: Sequence[int]  # prompt + output tokens so far
    output_index: int  # output index of this draw = trailing tokens of token_ids that are output
    # token ids this draw may not produce while output_index < min_tokens (EOS unless
    # ignore_eos, and stop_token_ids)
    min_tokens_stop_ids: tuple[int, ...] = ()
    # thinking_token_budget: the budget and the state after the output tokens (None: no budget)
    thinking_budget: ThinkingBudget | None = None
    thinking: ThinkingState | None = None

    @property
    def forced_token(self) -> int | None:
        """The token this draw must produce (a spent thinking budget's closing tag), or None."""
        if self.thinking_budget is None or self.thinking is None:
            return None
        return thinking_budget.forced_token(self.thinking_budget, self.thinking)

    @property
    def output_token_ids(self) -> Sequence[int]:
        n = min(self.output_index, len(self.token_ids))
        return self.token_ids[len(self.token_ids) - n :]

    def extended(self, token_ids: Sequence[int]) -> TokenHistory:
        """The history of a later draw, once `token_ids` (accepted proposals) were output."""
        if not token_ids:
            return self
        longer = TokenHistory(
            [*self.token_ids, *token_ids], self.output_index + len(token_ids), self.min_tokens_stop_ids
        )
        if self.thinking_budget is None or self.thinking is None:
            return longer
        state = thinking_budget.advance(self.thinking_budget, self.thinking, longer.output_token_ids)
        return dataclasses.replace(longer, thinking_budget=self.thinking_budget, thinking=state)


def apply_allowed(logits: torch.Tensor, masks: Sequence[torch.Tensor | None]) -> torch.Tensor:
    """Structured outputs: a row with a mask (bool [vocab], engine/structured.py) keeps only its
    allowed tokens; applied before every other processor (as in vLLM), so penalties, bias,
    temperature and logprobs all see the constrained distribution. Returns a new tensor."""
    rows = [i for i, m in enumerate(masks) if m is not None]
    vocab = logits.shape[1]
    allowed = torch.zeros(len(rows), vocab, dtype=torch.bool)
    for k, i in enumerate(rows):
        mask = masks[i]
        assert mask is not None
        n = min(vocab, mask.shape[0])
        allowed[k, :n] = mask[:n]
    idx = to_device(rows, logits.device)
    out = logits.clone()
    if logits.device.type == "cuda":  # no synchronizing copy from pageable memory
        allowed = allowed.pin_memory().to(logits.device, non_blocking=True)
    out[idx] = out[idx].masked_fill(~allowed, float("-inf"))
    return out


def process_logits(
    logits: torch.Tensor,
    params: Sequence[SamplingConfig],
    histories: Sequence[TokenHistory | None] | None,
) -> torch.Tensor:
    """allowed_token_ids, bad_words, min_tokens, logit_bias and penalties, then a spent thinking
    budget's forced token, applied to float32 logits [n, vocab] (a new tensor when any row
    changes; `logits` itself is never written). A row that needs its history
    (SamplingConfig.needs_history) and has none is left unpenalized (and its bad words and
    thinking budget unchecked)."""
    n, vocab = logits.shape
    device = logits.device
    out = logits
    hist: Sequence[TokenHistory | None] = histories if histories is not None else [None] * n

    def writable() -> torch.Tensor:
        return out.clone(memory_format=torch.contiguous_format) if out is logits else out

    # allowed_token_ids: a row keeps only its listed tokens. One boolean [rows, vocab] mask
    # filled by one indexed write of every such row's ids (flattened), then one masked_fill
    allow_rows = [i for i, p in enumerate(params) if p.allowed_token_ids]
    if allow_rows:
        out = writable()
        flat = torch.cat([_allowed_ids(params[i], vocab) + k * vocab for k, i in enumerate(allow_rows)])
        keep = torch.zeros(len(allow_rows), vocab, dtype=torch.bool, device=device)
        keep.view(-1)[flat.to(device, non_blocking=True)] = True
        idx = to_device(allow_rows, device)
        out[idx] = out[idx].masked_fill(~keep, float("-inf"))

    # bad_words: the (row, token) pairs banned at this draw are found on the host, where the
    # output tokens are (a comparison of each bad word's prefix with the output's tail: work
    # grows with the bad words' tokens, not the vocabulary), then written in one indexed op
    bad_rows: list[int] = []
    bad_ids: list[int] = []
    for i, (p, h) in enumerate(zip(params, hist, strict=True)):
        if p.bad_words and h is not None:
            for t in banned_by_bad_words(p.bad_words, h.output_token_ids):
                if 0 <= t < vocab:
                    bad_rows.append(i)
                    bad_ids.append(t)
    if bad_rows:
        out = writable()
        out[to_device(bad_rows, device), to_device(bad_ids, device)] = float("-inf")

    # min_tokens: the stop tokens are masked while the output is shorter than min_tokens
    ban_rows: list[int] = []
    ban_ids: list[int] = []
    for i, (p, h) in enumerate(zip(params, hist, strict=True)):
        if h is not None and h.output_index < p.min_tokens:
            ids = [t for t in h.min_tokens_stop_ids if 0 <= t < vocab]
            ban_rows.extend([i] * len(ids))
            ban_ids.extend(ids)
    if ban_rows:
        out = writable()
        rows_t, ids_t = to_device(ban_rows, device), to_device(ban_ids, device)
        kept = out[rows_t, ids_t]
        out[rows_t, ids_t] = float("-inf")
        # a row left with no token at all (a structured output that may only end now) ends:
        # the constraint wins over min_tokens
        # (no host read: the kept values are written back where the row died)
        dead = ~torch.isfinite(out[rows_t]).any(dim=-1)
        out[rows_t, ids_t] = torch.where(dead, kept, out[rows_t, ids_t])

    # logit_bias: sparse (row, token, bias) triples added in one indexed op
    bias_rows: list[int] = []
    bias_ids: list[int] = []
    bias_vals: list[float] = []
    for i, p in enumerate(params):
        for t, b in p.logit_bias:
            if 0 <= t < vocab:
                bias_rows.append(i)
                bias_ids.append(t)
                bias_vals.append(b)
    if bias_rows:
        out = writable()
        out.index_put_(
            (to_device(bias_rows, device), to_device(bias_ids, device)),
            to_device(bias_vals, device, out.dtype),
            accumulate=True,
        )

    # penalties: sparse over the (row, token) pairs that occur; work grows with the tokens of the
    # penalized rows, not with their vocabulary (a dense [rows, vocab] pass costs ~2 ms per op
    # for 8 rows of a 49k vocabulary on one core: the whole step is ~45 ms)
    rows = [
        i
        for i, (p, h) in enumerate(zip(params, hist, strict=True))
        if h is not None
        and (p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 or p.repetition_penalty != 1.0)
    ]
    if rows:
        out = writable()
        flat = out.view(-1)
        seen_parts: list[torch.Tensor] = []
        out_parts: list[torch.Tensor] = []
        for i in rows:
            h = hist[i]
            assert h is not None
            p = params[i]
            if p.repetition_penalty != 1.0:
                seen_parts.append(_flat_ids(h.token_ids, i, vocab, device))
            if p.presence_penalty != 0.0 or p.frequency_penalty != 0.0:
                out_parts.append(_flat_ids(h.output_token_ids, i, vocab, device))
        if seen_parts:
            seen = torch.unique(torch.cat(seen_parts))
            rep = to_device([p.repetition_penalty for p in params], device, out.dtype)
            rep_of = rep[seen // vocab]
            vals = flat[seen]
            flat[seen] = torch.where(vals > 0, vals / rep_of, vals * rep_of)
        if out_parts:
            occurring, counts = torch.unique(torch.cat(out_parts), return_counts=True)
            freq = to_device([p.frequency_penalty for p in params], device, out.dtype)
            pres = to_device([p.presence_penalty for p in params], device, out.dtype)
            row_of = occurring // vocab
            flat[occurring] -= freq[row_of] * counts.to(out.dtype) + pres[row_of]

    # thinking_token_budget: a row whose budget is spent must draw the closing tag's next token:
    # its row becomes -inf but that token, 0 (two indexed writes over the forced rows; vLLM's
    # forcing, so the forced token's logprob is 0). Last, so nothing before it (bias,
    # penalties) can make another token possible
    force_rows: list[int] = []
    force_ids: list[int] = []
    for i, h in enumerate(hist):
        forced = h.forced_token if h is not None else None
        if forced is not None and 0 <= forced < vocab:
            force_rows.append(i)
            force_ids.append(forced)
    if force_rows:
        out = writable()
        idx = to_device(force_rows, device)
        out[idx] = float("-inf")
        out[idx, to_device(force_ids, device)] = 0.0
    return out


def banned_by_bad_words(bad_words: Sequence[Sequence[int]], output_token_ids: Sequence[int]) -> list[int]:
    """The tokens a draw may not produce after `output_token_ids` (vLLM's bad_words): the last
    token of every bad word whose other tokens are the output's last ones (a one-token bad word:
    always). Only generated tokens count, never the prompt."""
    num_out = len(output_token_ids)
    banned = []
    for word in bad_words:
        prefix_len = len(word) - 1
        if prefix_len > num_out:
            continue
        if all(output_token_ids[num_out - prefix_len + j] == word[j] for j in range(prefix_len)):
            banned.append(word[-1])
    return banned


def _allowed_ids(p: SamplingConfig, vocab: int) -> torch.Tensor:
    """A row's allowed_token_ids inside the vocabulary as a host long tensor (built once per
    request: SamplingConfig.allowed_ids_tensor)."""
    ids = p.allowed_ids_tensor
    if ids.numel() and int(ids[-1]) >= vocab:  # sorted: only a padded-vocabulary mismatch
        ids = ids[ids < vocab]
    return ids


def _flat_ids(token_ids: Sequence[int], row: int, vocab: int, device: torch.device) -> torch.Tensor:
    """Indices into a flattened [n, vocab] tensor of row `row`'s tokens (ids outside the
    vocabulary dropped)."""
    ids = to_device(list(token_ids), device, torch.long)
    ids = ids[(ids >= 0) & (ids < vocab)]
    return ids + row * vocab


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingConfig],
    generators: Sequence[torch.Generator | None],
    seeds: Sequence[int | None] | None = None,
    histories: Sequence[TokenHistory | None] | None = None,
) -> torch.Tensor:
    """logits [n, vocab] -> token ids [n] (long, on logits' device). seeds[i], when given and
    not None, re-seeds generators[i] before row i's draw; histories[i] is row i's tokens for
    penalties and min_tokens (None: the row uses neither)."""
    return sample_logits(process_logits(logits.float(), params, histories), params, generators, seeds)


def sample_with_logprobs(
    logits: torch.Tensor,
    params: Sequence[SamplingConfig],
    generators: Sequence[torch.Generator | None],
    seeds: Sequence[int | None] | None = None,
    histories: Sequence[TokenHistory | None] | None = None,
) -> tuple[torch.Tensor, list[TokenLogprobs | None]]:
    """`sample`, plus each row's TokenLogprobs when its SamplingConfig.logprobs is set (None for
    the other rows).

    The logprobs are those of the distribution the row drew from (vLLM's "processed_logprobs"):
    a sampled row's log_softmax after allowed_token_ids, bad_words, min_tokens, logit_bias,
    penalties, temperature, top-k and top-p (tokens those cut off have -inf); a greedy row's
    log_softmax after allowed_token_ids, bad_words, min_tokens, logit_bias and penalties
    (temperature, top-k and top-p do not change an argmax)."""
    tokens, _, result = sample_with_logprobs_to_host(logits, params, generators, seeds, histories)
    return tokens, result


def sample_with_logprobs_to_host(
    logits: torch.Tensor,
    params: Sequence[SamplingConfig],
    generators: Sequence[torch.Generator | None],
    seeds: Sequence[int | None] | None = None,
    histories: Sequence[TokenHistory | None] | None = None,
) -> tuple[torch.Tensor, list[int], list[TokenLogprobs | None]]:
    """`sample_with_logprobs` with the drawn tokens on the host too: the tokens and every
    logprob travel in one device-to-host copy (packed as float64, exact for token ids and
    float32 logprobs)."""
    processed = process_logits(logits.float(), params, histories)
    greedy = [p.temperature <= 0.0 for p in params]
    scaled = None if all(greedy) else scaled_logits(processed, params)
    tokens = sample_logits(processed, params, generators, seeds, scaled)
    rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    result: list[TokenLogprobs | None] = [None] * len(params)
    if not rows:
        return tokens, [int(t) for t in tokens.tolist()], result
    idx = to_device(rows, logits.device)
    if scaled is None or all(greedy[i] for i in rows):
        dist = processed.index_select(0, idx)
    elif not any(greedy[i] for i in rows):
        dist = scaled.index_select(0, idx)
    else:
        use_scaled = to_device([not greedy[i] for i in rows], logits.device)[:, None]
        dist = torch.where(use_scaled, scaled.index_select(0, idx), processed.index_select(0, idx))
    logp = dist.log_softmax(dim=-1)
    chosen = logp.gather(1, tokens.index_select(0, idx)[:, None])[:, 0]
    ranks = token_ranks(logp, chosen)
    max_k = max(params[i].logprobs or 0 for i in rows)
    top_vals, top_ids = logp.topk(max_k, dim=-1) if max_k > 0 else (logp[:, :0], logp[:, :0].long())
    n, r = len(params), len(rows)
    packed = torch.cat(
        [t.reshape(-1).double() for t in (tokens, chosen, ranks, top_vals, top_ids)]
    ).tolist()  # the one copy: n tokens, r chosen logprobs, r ranks, r x max_k values, r x max_k ids
    tokens_l = [int(t) for t in packed[:n]]
    chosen_l = packed[n : n + r]
    ranks_l = packed[n + r : n + 2 * r]
    vals_at, ids_at = n + 2 * r, n + 2 * r + r * max_k
    for k, i in enumerate(rows):
        m = params[i].logprobs or 0
        vals = packed[vals_at + k * max_k : vals_at + k * max_k + m]
        ids = [int(t) for t in packed[ids_at + k * max_k : ids_at + k * max_k + m]]
        result[i] = TokenLogprobs(
            tokens_l[i], float(chosen_l[k]), tuple(zip(ids, vals, strict=True)), int(ranks_l[k])
        )
    return tokens, tokens_l, result


def token_ranks(logp: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """logp [n, vocab] log-probabilities, chosen [n] the logprob of one token per row -> [n]
    (long) each token's 1-based rank in its row: 1 + the entries with a strictly greater logprob
    (vLLM's batched_count_greater_than + 1), so tied tokens share the best of their ranks and a
    row's most likely token has rank 1. One comparison over the rows, no loop per token."""
    return (logp > chosen[:, None]).sum(dim=-1) + 1


def sample_logits(
    logits: torch.Tensor,
    params: Sequence[SamplingConfig],
    generators: Sequence[torch.Generator | None],
    seeds: Sequence[int | None] | None = None,
    scaled: torch.Tensor | None = None,
) -> torch.Tensor:
    """The draw from processed logits [n, vocab]: greedy rows take the argmax, the others are
    scaled by temperature, cut by top-k and top-p (`scaled`, when the caller has it), and raced
    with their generators' noise."""
    greedy = [p.temperature <= 0.0 for p in params]
    if all(greedy):
        return logits.argmax(dim=-1)
    if scaled is None:
        scaled = scaled_logits(logits, params)
    vocab = logits.shape[1]
    device = logits.device
    probs = scaled.softmax(dim=-1)
    noise = torch.empty_like(probs)
    unseeded = [i for i, g in enumerate(generators) if g is None]
    if len(unseeded) == len(generators):
        noise.exponential_()
    elif unseeded:
        noise[to_device(unseeded, device)] = torch.empty(len(unseeded), vocab, device=device).exponential_()
    for i, g in enumerate(generators):
        if g is not None:
            seed = seeds[i] if seeds is not None else None
            if seed is not None:
                g.manual_seed(seed)
            noise[i].exponential_(generator=g)
    sampled = (probs / noise).argmax(dim=-1)
    greedy_mask = to_device(greedy, device)
    return torch.where(greedy_mask, logits.argmax(dim=-1), sampled)


def scaled_logits(logits: torch.Tensor, params: Sequence[SamplingConfig]) -> torch.Tensor:
    """Processed float32 logits divided by each row's temperature (greedy rows: 1), with the
    tokens outside top-k and top-p at -inf: the distribution a sampled row draws from."""
    vocab = logits.shape[1]
    device = logits.device
    temps = to_device([p.temperature if p.temperature > 0 else 1.0 for p in params], device)
    scaled = logits / temps[:, None]
    min_ps = [p.min_p if p.temperature > 0 else 0.0 for p in params]
    if any(min_ps):
        # vLLM's min-p, after temperature and before top-k / top-p: a token less likely than
        # min_p x the most likely one is dropped. p_i < min_p * p_max  <=>
        # logit_i < logit_max + log(min_p) (the softmax's normaliser cancels), so no softmax here;
        # min_p 0 gives log 0 = -inf: nothing dropped.
        mp = to_device(min_ps, device)
        floor = scaled.amax(dim=-1, keepdim=True) + mp.log()[:, None]
        scaled = scaled.masked_fill(scaled < floor, float("-inf"))
    top_ks = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
    if any(top_ks):
        max_k = max(top_ks)
        kth_idx = to_device([k - 1 if k else max_k - 1 for k in top_ks], device)
        top_vals = scaled.topk(max_k, dim=-1).values
        kth = top_vals.gather(1, kth_idx[:, None])
        apply = to_device([k > 0 for k in top_ks], device)[:, None]
        scaled = scaled.masked_fill(apply & (scaled < kth), float("-inf"))
    top_ps = [p.top_p for p in params]
    if any(0.0 < tp < 1.0 for tp in top_ps):
        sorted_logits, sorted_idx = scaled.sort(dim=-1, descending=True)
        probs_sorted = sorted_logits.softmax(dim=-1)
        cum = probs_sorted.cumsum(dim=-1)
        tp = to_device([t if 0.0 < t < 1.0 else 1.0 for t in top_ps], device)
        # drop a token when the mass before it already reaches top_p (the first always stays)
        drop = (cum - probs_sorted) >= tp[:, None]
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        scaled = torch.empty_like(scaled).scatter_(1, sorted_idx, sorted_logits)
    return scaled


# prompt logprobs are computed over at most this many positions at a time: a float32 copy of
# [rows, vocab] logits per slice (~50 MB for a 49k vocabulary) instead of one of a whole chunk's
_PROMPT_LOGPROBS_ROWS = 256


def prompt_logprobs(logits: torch.Tensor, targets: Sequence[int], ks: Sequence[int]) -> list[TokenLogprobs]:
    """Prompt logprobs: logits [n, vocab] at n prompt positions (the model's raw output, no
    processor applied), targets[i] the prompt token that follows position i, ks[i] how many
    most likely alternatives row i reports. Each row's log_softmax in float32 is that of the
    raw model distribution (vLLM's prompt logprobs), and each prompt token's rank is taken in
    that distribution (token_ranks); rows are independent of each other, so a prompt gets the
    same values however it was split into chunks or batched."""
    out: list[TokenLogprobs] = []
    for first in range(0, logits.shape[0], _PROMPT_LOGPROBS_ROWS):
        end = first + _PROMPT_LOGPROBS_ROWS
        out.extend(_prompt_logprobs_rows(logits[first:end], targets[first:end], ks[first:end]))
    return out


def _prompt_logprobs_rows(
    logits: torch.Tensor, targets: Sequence[int], ks: Sequence[int]
) -> list[TokenLogprobs]:
    logp = logits.float().log_softmax(dim=-1)
    idx = to_device(list(targets), logits.device, torch.long)
    chosen = logp.gather(1, idx[:, None])[:, 0]
    # one copy for both (float64: exact for float32 logprobs and for ranks)
    chosen_l, ranks = torch.stack([chosen.double(), token_ranks(logp, chosen).double()]).tolist()
    max_k = max(ks)
    top_vals, top_ids = logp.topk(max_k, dim=-1) if max_k > 0 else (logp[:, :0], logp[:, :0].long())
    vals_l, ids_l = top_vals.tolist(), top_ids.tolist()
    return [
        TokenLogprobs(
            int(t),
            float(chosen_l[i]),
            tuple(zip(ids_l[i][: ks[i]], vals_l[i][: ks[i]], strict=True)),
            int(ranks[i]),
        )
        for i, t in enumerate(targets)
    ]
