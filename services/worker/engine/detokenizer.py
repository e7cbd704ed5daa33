"""Incremental detokenization and stop-string matching for one request.

IncrementalDetokenizer turns token ids into stable text pieces (text is held back while it ends in
U+FFFD, i.e. a multi-token character is incomplete, as with byte-fallback tokenizers). OutputText
accumulates those pieces, finds stop strings (text from the stop string on is cut unless
include_stop_in_output) and holds back the tail that could still become a stop string.

Decoding goes straight to a fast tokenizer's Rust backend (`backend_decoder`): transformers'
`decode` wrapper around it costs several times the decode itself, twice per generated token.
The text is the wrapper's, exactly: the same backend call, then the wrapper's clean-up of
tokenization spaces where the tokenizer would apply it.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

# tokens of context decoded before the first new token, so a leading space/merge is right
_PREFIX_WINDOW = 6


_BYTE_TOKEN = re.compile(r"^<0x[0-9A-Fa-f]{2}>$")


def hidden_token_ids(tokenizer: Any) -> frozenset[int]:
    """Special tokens whose text is never shown (like skip_special_tokens), except byte-fallback
    tokens `<0xXX>`, which some tokenizers register as special but which carry text."""
    ids = set()
    for token, token_id in zip(tokenizer.all_special_tokens, tokenizer.all_special_ids, strict=False):
        if not _BYTE_TOKEN.match(str(token)):
            ids.add(int(token_id))
    for token_id, added in getattr(tokenizer, "added_tokens_decoder", {}).items():
        if getattr(added, "special", False) and not _BYTE_TOKEN.match(str(added.content)):
            ids.add(int(token_id))
    return frozenset(ids)


def backend_decoder(tokenizer: Any) -> Callable[[list[int]], str]:
    """`ids -> tokenizer.decode(ids, skip_special_tokens=False)`, calling a fast tokenizer's
    backend directly when the tokenizer decodes exactly as transformers' TokenizersBackend does
    (its `decode` and `_decode` not overridden); `tokenizer.decode` itself otherwise (slow
    tokenizers, custom classes)."""

    def wrapper(ids: list[int]) -> str:
        return str(tokenizer.decode(ids, skip_special_tokens=False))

    try:
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:  # another transformers layout: its wrapper it is
        return wrapper
    cls = type(tokenizer)
    if (
        not isinstance(tokenizer, TokenizersBackend)
        or cls.decode is not PreTrainedTokenizerBase.decode
        or cls._decode is not TokenizersBackend._decode
    ):
        return wrapper
    backend_decode = tokenizer.backend_tokenizer.decode
    # TokenizersBackend._decode's rule: clean up when the tokenizer says so, except for a BPE
    # model (destructive there) unless forced
    force = "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output"
    clean = bool(tokenizer.clean_up_tokenization_spaces) and not (
        type(tokenizer.backend_tokenizer.model).__name__ == "BPE" and not getattr(tokenizer, force, False)
    )
    if clean:
        clean_up = tokenizer.clean_up_tokenization
        return lambda ids: str(clean_up(backend_decode(ids, skip_special_tokens=False)))
    return lambda ids: str(backend_decode(ids, skip_special_tokens=False))


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: tuple[int, ...] | list[int],
        hidden_ids: frozenset[int] = frozenset(),
        unshown_tail: int = 0,
    ) -> None:
        """`unshown_tail`: the last prompt tokens are output whose text was never shown (a
        migrated request resumed after an incomplete character): their text comes out with the
        first new token's."""
        self._decode = backend_decoder(tokenizer)
        self._hidden_ids = hidden_ids
        tail = max(0, min(unshown_tail, len(prompt_token_ids)))
        window = prompt_token_ids[-(_PREFIX_WINDOW + tail) :] if prompt_token_ids else ()
        context = [t for t in window[: len(window) - tail] if t not in hidden_ids]
        unshown = [t for t in window[len(window) - tail :] if t not in hidden_ids]
        self._ids: list[int] = context + unshown
        self._prefix_offset = 0  # ids[prefix_offset:read_offset] is already-emitted context
        self._read_offset = len(context)

    def append(self, token_id: int) -> str:
        """Feed one token; returns the text that became stable ("" while a char is partial)."""
        if token_id in self._hidden_ids:
            return ""
        self._ids.append(token_id)
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            delta = new_text[len(prefix_text) :]
            # drop ids no longer needed as context (keeps decode cost O(window))
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
            if self._prefix_offset > 4 * _PREFIX_WINDOW:
                cut = self._prefix_offset
                self._ids = self._ids[cut:]
                self._prefix_offset -= cut
                self._read_offset -= cut
            return delta
        return ""


class OutputText:
    """Generated text of one request, with stop strings and stream hold-back."""

    def __init__(self, stop: tuple[str, ...], include_stop: bool) -> None:
        self._stop = tuple(s for s in stop if s)
        self._include_stop = include_stop
        self._hold_chars = max((len(s) for s in self._stop), default=1) - 1
        self.text = ""
        self._emitted_chars = 0

    def add(self, delta: str) -> bool:
        """Append stable text; True when a stop string appeared (text is cut there)."""
        if not delta:
            return False
        start = max(0, len(self.text) - self._hold_chars)
        self.text += delta
        best: tuple[int, int] | None = None
        for s in self._stop:
            i = self.text.find(s, start)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, len(s))
        if best is None:
            return False
        i, n = best
        self.text = self.text[: i + n if self._include_stop else i]
        return True

    def take(self, final: bool) -> str:
        """Text not yet emitted; while running keeps back what may start a stop string."""
        end = len(self.text) if final else max(self._emitted_chars, len(self.text) - self._hold_chars)
        out = self.text[self._emitted_chars : end]
        self._emitted_chars = end
        return out


class DetokenizedText:
    """A request's TextTracker (engine/request.py): incremental detokenizer + OutputText."""

    def __init__(self, detokenizer: IncrementalDetokenizer, text: OutputText) -> None:
        self._detokenizer = detokenizer
        self._text = text

    def add_token(self, token_id: int, show: bool) -> bool:
        delta = self._detokenizer.append(token_id)
        return self._text.add(delta) if show else False

    def take(self, final: bool) -> str:
        return self._text.take(final)
