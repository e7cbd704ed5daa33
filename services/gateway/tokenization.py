"""Prompt tokenization: raw text, or chat messages (and the tools offered) through the model's chat
template."""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from services.gateway import tool_calls
from services.gateway.inputs import ChatTurn
from services.gateway.reasoning import THINK_END, THINK_START
from services.gateway.tool_calls import Format, Tool
from services.gateway.validation import InvalidField
from shared.errors import InvalidArgument

log = structlog.get_logger(__name__)

# apply_chat_template's own arguments and the template variables pdserve sets: a client's
# chat_template_kwargs may not name them (they would replace what pdserve passes)
RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "conversation",
        "messages",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)


@dataclass(frozen=True)
class Tokenized:
    """A prompt as the gateway would run it (Tokenize's answer)."""

    token_ids: tuple[int, ...]
    model: str
    max_model_len: int  # tokens; 0 while unknown
    token_strs: tuple[str, ...] = ()  # each id's vocabulary piece, when asked for


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

    def decode(self, token_ids: tuple[int, ...], skip_special_tokens: bool = False) -> str:
        """The text of token ids (special tokens kept, as a prompt shows them, unless
        skip_special_tokens)."""
        return str(self._tok.decode(list(token_ids), skip_special_tokens=skip_special_tokens))

    def pieces(self, token_ids: tuple[int, ...]) -> tuple[str, ...]:
        """Each id's piece as the tokenizer's vocabulary writes it (e.g. "Ġthe"), "" for an id
        beyond the tokenizer's vocabulary (a padded embedding)."""
        return tuple(str(p or "") for p in self._tok.convert_ids_to_tokens(list(token_ids)))

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self._tok, "chat_template", None))

    def encode_prompt(self, text: str) -> tuple[int, ...]:
        return tuple(int(t) for t in self._tok.encode(text))

    def encode_text(self, text: str) -> tuple[int, ...]:
        """Text's tokens without the special tokens a prompt gets (e.g. a BOS)."""
        return tuple(int(t) for t in self._tok.encode(text, add_special_tokens=False))

    @functools.cached_property
    def think_tag_ids(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The reasoning tags ("<think>", "</think>") as the model's tokens, without special
        tokens (vLLM's reasoning config tokenizes them so), computed once."""
        return self.encode_text(THINK_START), self.encode_text(THINK_END)

    def bad_word_sequences(self, words: Sequence[str]) -> tuple[tuple[int, ...], ...]:
        """vLLM's bad_words as token sequences (SamplingParams.update_from_tokenizer): each word
        once (repeats dropped), leading whitespace stripped, tokenized as is and after a space,
        without special tokens; the spaced variant is kept only when it is as many tokens and
        starts with another one (a word-initial token, as mid-text occurrences are written).
        InvalidArgument naming bad_words for a word that makes no token."""
        sequences: list[tuple[int, ...]] = []
        for word in dict.fromkeys(words):
            plain = self.encode_text(word.lstrip())
            if not plain:
                raise InvalidField(f"bad_words entry {word!r} makes no token", "bad_words")
            sequences.append(plain)
            spaced = self.encode_text(" " + word.lstrip())
            if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
                sequences.append(spaced)
        return tuple(sequences)

    @property
    def chat_template(self) -> str:
        template = getattr(self._tok, "chat_template", None)
        return template if isinstance(template, str) else ""

    def tool_call_format(self) -> Format:
        """The tool-call format the chat template itself uses (hermes when it says nothing)."""
        return tool_calls.detect_format(self.chat_template)

    def encode_chat(
        self,
        messages: Sequence[ChatTurn],
        tools: Sequence[Tool] = (),
        fmt: Format = "hermes",
        template_kwargs: Mapping[str, Any] | None = None,
        continue_final_message: bool = False,
        add_generation_prompt: bool = True,
    ) -> tuple[int, ...]:
        """The prompt of a conversation. Tools go through the template's `tools` when it renders
        them; otherwise (the bundled SmolLM2's template) a system preamble in `fmt` offers them,
        and earlier calls and tool results are written into the turns' text the same way.
        `template_kwargs`: the client's chat_template_kwargs, extra template variables (e.g.
        Qwen3's enable_thinking); none of RESERVED_TEMPLATE_KWARGS (checked by the caller).
        `continue_final_message`: the prompt ends inside the last message (an assistant reply
        the model continues: no end of turn after it, no generation prompt), as transformers'
        apply_chat_template(continue_final_message=True); otherwise a generation prompt follows
        the conversation, unless `add_generation_prompt` is False (the prompt then ends after the
        last message)."""
        if not self.has_chat_template:
            raise InvalidArgument(
                f"model {self.model_id!r} has no chat template; send a prompt instead of messages"
            )
        template = self.chat_template
        conversation = [_turn(m, fmt, "tool_calls" in template) for m in messages]
        extra: dict[str, Any] = dict(template_kwargs or {})
        if tools and "tools" in template:
            extra["tools"] = [t.as_openai() for t in tools]
        elif tools:
            text = tool_calls.preamble(tuple(tools), fmt)
            if conversation and conversation[0]["role"] == "system":
                conversation[0] = {**conversation[0], "content": f"{conversation[0]['content']}\n\n{text}"}
            else:
                conversation.insert(0, {"role": "system", "content": text})
        try:
            text = self._tok.apply_chat_template(
                conversation,
                add_generation_prompt=add_generation_prompt and not continue_final_message,
                continue_final_message=continue_final_message,
                tokenize=False,
                **extra,
            )
        except Exception as exc:  # jinja raise_exception() in templates: e.g. roles out of order
            raise InvalidArgument(f"the chat template rejected the messages: {exc}") from exc
        # The template writes any BOS itself; do not add special tokens twice.
        return tuple(int(t) for t in self._tok.encode(text, add_special_tokens=False))


def _turn(m: ChatTurn, fmt: Format, template_renders_calls: bool) -> dict[str, Any]:
    """One message for apply_chat_template: a template that renders tool calls gets them as
    OpenAI-style fields (arguments as a dict, as HF templates expect); otherwise calls and tool
    results become the turn's text in the parser's format."""
    turn: dict[str, Any] = {"role": m.role, "content": m.content}
    if template_renders_calls:
        if m.tool_calls:
            turn["tool_calls"] = [
                {
                    "id": tool_calls.template_call_id(c.id, fmt),
                    "type": "function",
                    "function": {"name": c.name, "arguments": json.loads(c.arguments)},
                }
                for c in m.tool_calls
            ]
        if m.tool_call_id:
            turn["tool_call_id"] = tool_calls.template_call_id(m.tool_call_id, fmt)
        return turn
    if m.tool_calls:
        calls = tool_calls.calls_text([(c.name, c.arguments) for c in m.tool_calls], fmt)
        turn["content"] = f"{m.content}\n{calls}" if m.content else calls
    if m.role == "tool":
        turn["content"] = tool_calls.tool_result_text(m.content, fmt)
    return turn
