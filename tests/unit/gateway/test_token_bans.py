"""vLLM's bad_words tokenization at the gateway (the workers get token sequences), and the
capabilities allowed_token_ids / bad_words a request needs of its workers."""

from __future__ import annotations

import dataclasses

import pytest

from services.gateway.capabilities import needed_capabilities
from services.gateway.inputs import Sampling
from services.gateway.tokenization import PromptTokenizer
from services.gateway.validation import InvalidField

# what a few words become as is and after a space
_TOKENS = {
    "hello": [10],
    " hello": [11],  # a word-initial token of its own: both variants banned
    "big cat": [20, 21],
    " big cat": [22, 21],
    "ab": [30, 31],
    " ab": [32, 30, 31],  # more tokens with the space: only the plain variant
    "x": [40],
    " x": [40],  # the same first token: only once
    "": [],
    " ": [],
}


class _Words:
    """A tokenizer of the texts above."""

    def __init__(self) -> None:
        self.special: list[bool] = []

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.special.append(add_special_tokens)
        return _TOKENS[text]


def test_bad_words_tokenize_as_vllm_does() -> None:
    fake = _Words()
    tok = PromptTokenizer(fake, "m", 100)
    got = tok.bad_word_sequences(["hello", "big cat", "ab", "x", "hello", "  x"])
    assert got == ((10,), (11,), (20, 21), (22, 21), (30, 31), (40,), (40,))
    assert not any(fake.special)  # no BOS or other special token in a bad word
    with pytest.raises(InvalidField, match="makes no token") as err:
        tok.bad_word_sequences([" "])
    assert err.value.param == "bad_words"


def test_each_needs_its_capability() -> None:
    plain = Sampling(max_tokens=4)
    assert needed_capabilities(dataclasses.replace(plain, allowed_token_ids=(1, 2))) == {"allowed_token_ids"}
    assert needed_capabilities(dataclasses.replace(plain, bad_words=((5,),))) == {"bad_words"}
    assert needed_capabilities(plain) == set()
