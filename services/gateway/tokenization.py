"""Prompt tokenization: raw text, or chat messages through the model's chat template."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import structlog

from services.gateway.request import ChatTurn
from shared.errors import InvalidArgument

log = structlog.get_logger(__name__)


class PromptTokenizer:
    """The served model's tokenizer (loaded from the same folder the workers load)."""

    def __init__(self, tokenizer: Any, model_id: str, vocab_size: int) -> None:
        self._tok = tokenizer
        self.model_id = model_id
        self.vocab_size = vocab_size
        self._token_texts: dict[int, str] = {}

    @classmethod
    def load(cls, folder: Path) -> PromptTokenizer:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(folder))
        vocab_size = len(tok)
        config = folder / "config.json"
        if config.exists():  # the embedding may be padded beyond the tokenizer's vocabulary
            vocab_size = max(vocab_size, int(json.loads(config.read_text()).get("vocab_size") or 0))
        log.info("tokenizer_loaded", folder=str(folder), vocab_size=vocab_size)
        return cls(tok, folder.name, vocab_size)

    def token_text(self, token_id: int) -> str:
        """One token's text on its own (logprobs show it; a byte that is part of a character
        decodes to U+FFFD, as in vLLM). Cached: the same few thousand ids come back all the time."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._tok.decode([token_id])
            if len(self._token_texts) < 1 << 16:
                self._token_texts[token_id] = text
        return text

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self._tok, "chat_template", None))

    def encode_prompt(self, text: str) -> tuple[int, ...]:
        return tuple(int(t) for t in self._tok.encode(text))

    def encode_chat(self, messages: Sequence[ChatTurn]) -> tuple[int, ...]:
        if not self.has_chat_template:
            raise InvalidArgument(
                f"model {self.model_id!r} has no chat template; send a prompt instead of messages"
            )
        conversation = [{"role": m.role, "content": m.content} for m in messages]
        try:
            text = self._tok.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
        except Exception as exc:  # jinja raise_exception() in templates: e.g. roles out of order
            raise InvalidArgument(f"the chat template rejected the messages: {exc}") from exc
        # The template writes any BOS itself; do not add special tokens twice.
        return tuple(int(t) for t in self._tok.encode(text, add_special_tokens=False))
