"""llguidance's view of a fast HF tokenizer (its LLTokenizer): which bytes each token id writes,
which ids are special, and how the text a grammar forces is tokenized.

llguidance's own conversion (`LLTokenizer(tokenizer_json)`) is used, with two corrections:
- Byte-fallback tokens (`<0xXX>`) that a tokenizer also registers as special added tokens are
  the byte they stand for: as special tokens llguidance's mask allowed them, then consuming one
  was an error.
- Added tokens the tokenizer marks `special: false` are text. llguidance treats every added
  token of the form `<...>` as special, but transformers decodes these into the output like any
  other text (Qwen's `<think>`, `</think>`, `<tool_call>`; DeepSeek-R1's `<think>`), and
  llguidance tokenizes the text a grammar forces with the tokenizer itself, which finds them: a
  regex or grammar that writes `<think>` got a mask allowing only the `<think>` token, and
  consuming it was an error, so the request could only end there (EOS), its output not
  matching. Such a tokenizer is rebuilt from the same token bytes with only `special: true`
  tokens special (llguidance's TokenizerWrapper), tokenizing forced text as before.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Callable, Sequence
from typing import Any

_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")


class _Tokenizer:
    """What llguidance's TokenizerWrapper reads: every id's bytes, EOS / BOS, the special ids,
    and a call that tokenizes text."""

    def __init__(
        self,
        tokens: list[bytes],
        specials: Sequence[int],
        eos: int | None,
        bos: int | None,
        tokenize: Callable[[str], list[int]],
    ) -> None:
        self.tokens = tokens
        self.special_token_ids = list(specials)
        self.eos_token_id = eos
        self.bos_token_id = bos
        self._tokenize = tokenize

    def __call__(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise TypeError("text only")  # llguidance probes with bytes; refused, it passes text
        return self._tokenize(text)


def ll_tokenizer(hf_tokenizer: Any, vocab_size: int) -> Any:
    """llguidance's LLTokenizer for a fast HF tokenizer and a model of `vocab_size` ids (~0.4 s
    for SmolLM2's 49k tokens; ~1 s more where added tokens are text)."""
    import llguidance

    backend = copy.copy(hf_tokenizer.backend_tokenizer)
    backend.no_padding()
    backend.no_truncation()
    spec = json.loads(backend.to_str())
    model = spec.get("model") or {}
    if model.get("byte_fallback"):
        spec["added_tokens"] = [
            t
            for t in spec.get("added_tokens", [])
            if not (
                _BYTE_TOKEN.fullmatch(t.get("content", "")) and t.get("content") in model.get("vocab", {})
            )
        ]
    eos = hf_tokenizer.eos_token_id
    base = llguidance.LLTokenizer(json.dumps(spec), n_vocab=vocab_size, eos_token=eos)
    text_ids = {t["id"] for t in spec.get("added_tokens", []) if not t.get("special")}
    if not any(base.is_special_token(i) for i in text_ids if 0 <= i < vocab_size):
        return base
    tokens = [base.decode_bytes([i]) for i in range(vocab_size)]
    specials = [i for i in range(vocab_size) if i not in text_ids and base.is_special_token(i)]
    wrapper = llguidance.TokenizerWrapper(
        _Tokenizer(tokens, specials, eos, hf_tokenizer.bos_token_id, base.tokenize_str)
    )
    return llguidance.LLTokenizer(wrapper, n_vocab=vocab_size, eos_token=eos)
