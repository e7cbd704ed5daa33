"""Structured outputs on a worker: one llguidance matcher per constrained request, its token
masks for the sampler, and the tokens it accepted (Request.append_output_token feeds it).

The grammar state is never shipped: a decode worker builds its own matcher from the request's
StructuredOutput and replays the accepted tokens (the handed-off first token; a migrated request's
generated prompt tail), so prefill, decode and migration constrain identically. Grammars are
compiled once per constraint (shared.structured_output's LRU cache) in the caller's thread when the request is
added, never in the step loop; the tokenizer's llguidance view (grammar_tokens.py, ~0.4 s for
SmolLM2) is built at the first constrained request."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from services.worker.engine.grammar_tokens import ll_tokenizer
from shared.errors import InvalidArgument
from shared.structured_output import InvalidStructuredOutput, StructuredOutput, grammar_of


class GrammarState:
    """One request's matcher. Not thread-safe: used under its rank's lock."""

    def __init__(self, matcher: Any, vocab_size: int) -> None:
        self._matcher = matcher
        self._vocab = vocab_size

    def accept(self, token_id: int) -> None:
        """A token was appended to the output (an invalid one leaves the matcher in error: every
        later mask then allows only what llguidance allows after an error, EOS)."""
        self._matcher.consume_token(token_id)

    def _mask(self) -> torch.Tensor:
        return _unpack(self._matcher.compute_bitmask(), self._vocab)

    def masks(self, drafts: Sequence[int]) -> torch.Tensor:
        """Allowed tokens [1 + len(drafts), vocab] (bool) for the next draw and for the draws
        after each proposal, as if the proposals were accepted. A proposal the grammar refuses
        will be rejected by verification (the row before it cannot draw it), so the rows after it
        repeat the last mask. The matcher ends where it started (rolled back)."""
        rows = [self._mask()]
        consumed = 0
        for token in drafts:
            if consumed == len(rows) - 1 and self._matcher.try_consume_tokens([token]) == 1:
                consumed += 1
                rows.append(self._mask())
            else:
                rows.append(rows[-1])
        if consumed:
            self._matcher.rollback(consumed)
        return torch.stack(rows)


def _unpack(bitmask: bytes, vocab: int) -> torch.Tensor:
    """llguidance's bitmask (little-endian int32 words, bit k of word w = token 32 w + k) ->
    bool [vocab]. numpy's unpackbits: ~10 us for 49k tokens on one thread, where the same in
    torch ops took 0.1-30 ms under CPU contention (intra-op threads)."""
    bits = np.unpackbits(np.frombuffer(bitmask, dtype=np.uint8), bitorder="little")[:vocab]
    return torch.from_numpy(bits.astype(np.bool_))


class Grammars:
    """Builds GrammarStates for one engine (its tokenizer and vocabulary size)."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        self._hf_tokenizer = tokenizer
        self._vocab = vocab_size
        self._ll_tokenizer: Any = None
        self._lock = threading.Lock()

    def _tokenizer(self) -> Any:
        if self._ll_tokenizer is None:
            self._ll_tokenizer = ll_tokenizer(self._hf_tokenizer, self._vocab)
        return self._ll_tokenizer

    def new_state(self, spec: StructuredOutput, replay: Sequence[int] = ()) -> GrammarState:
        """A matcher at the start of the output, then fed `replay` (tokens already generated: a
        migrated request's). Raises InvalidArgument for a constraint that does not compile."""
        import llguidance

        try:
            grammar = grammar_of(spec)  # cached per constraint
        except InvalidStructuredOutput as exc:
            raise InvalidArgument(f"structured output ({spec.kind}): {exc}") from None
        with self._lock:
            tokenizer = self._tokenizer()
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise InvalidArgument(f"structured output ({spec.kind}): {matcher.get_error()}")
        state = GrammarState(matcher, self._vocab)
        for token in replay:
            state.accept(token)
        return state
