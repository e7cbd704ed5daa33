"""Validation: each bad request gets one clear, actionable error."""

from __future__ import annotations

import math
from typing import Any

import pytest

from services.gateway.inputs import ChatTurn, GenerateInput
from services.gateway.validation import (
    InvalidField,
    Limits,
    resolve_max_tokens,
    validate_bad_word_sequences,
    validate_input,
    validate_request_id,
    validate_token_ids,
)
from shared.errors import InvalidArgument, NotFound
from shared.structured_output import StructuredOutput

MODEL = "tiny"
LIMITS = Limits(max_stop_strings=2, max_stop_string_chars=5)


def check(**fields: Any) -> None:
    validate_input(GenerateInput(**fields), LIMITS, MODEL)


def test_valid_prompt_passes() -> None:
    check(prompt="hi", max_tokens=3, temperature=0.0, top_p=1.0, stop=("a", "bb"))


def test_no_input() -> None:
    with pytest.raises(InvalidArgument, match="set exactly one of prompt, prompt_token_ids, messages"):
        check()


def test_two_inputs_named() -> None:
    with pytest.raises(InvalidArgument, match="sets prompt and messages"):
        check(prompt="x", messages=(ChatTurn("user", "y"),))


def test_unknown_model_is_not_found() -> None:
    with pytest.raises(NotFound, match=r"'other' is not served here.*'tiny'"):
        check(model="other", prompt="x")


def test_model_name_matches() -> None:
    check(model=MODEL, prompt="x")


@pytest.mark.parametrize("value", [0, -1])
def test_max_tokens_must_be_positive(value: int) -> None:
    with pytest.raises(InvalidArgument, match="max_tokens must be >= 1"):
        check(prompt="x", max_tokens=value)


def test_max_tokens_0_only_scores_the_prompt() -> None:
    check(prompt="x", max_tokens=0, prompt_logprobs=0)
    with pytest.raises(InvalidArgument, match="max_tokens must be >= 1"):
        check(prompt="x", max_tokens=-1, prompt_logprobs=0)
    for value in (-1, 21):
        with pytest.raises(InvalidArgument, match=r"prompt_logprobs .* must be in \[0, 20\]") as err:
            check(prompt="x", prompt_logprobs=value)
        assert getattr(err.value, "param", None) == "prompt_logprobs"


@pytest.mark.parametrize("value", [-0.1, math.inf, math.nan])
def test_temperature(value: float) -> None:
    with pytest.raises(InvalidArgument, match="temperature must be a finite number >= 0"):
        check(prompt="x", temperature=value)


@pytest.mark.parametrize("value", [0.0, -1.0, 1.01, math.nan])
def test_top_p(value: float) -> None:
    with pytest.raises(InvalidArgument, match=r"top_p must be in \(0, 1\]"):
        check(prompt="x", top_p=value)


@pytest.mark.parametrize("value", [-0.01, 1.01, math.inf, math.nan])
def test_min_p(value: float) -> None:
    with pytest.raises(InvalidArgument, match=r"min_p must be in \[0, 1\]") as err:
        check(prompt="x", min_p=value)
    assert getattr(err.value, "param", None) == "min_p"


def test_too_many_stop_strings() -> None:
    with pytest.raises(InvalidArgument, match="at most 2 stop strings"):
        check(prompt="x", stop=("a", "b", "c"))


def test_stop_string_too_long() -> None:
    with pytest.raises(InvalidArgument, match=r"stop\[1\] is 6 characters; the limit is 5"):
        check(prompt="x", stop=("a", "abcdef"))


def test_empty_stop_string() -> None:
    with pytest.raises(InvalidArgument, match=r"stop\[0\] is empty"):
        check(prompt="x", stop=("",))


def test_bad_chat_role() -> None:
    with pytest.raises(InvalidArgument, match=r"messages\[1\].role is 'robot'"):
        check(messages=(ChatTurn("user", "a"), ChatTurn("robot", "b")))


def test_request_id_rules() -> None:
    validate_request_id("")
    validate_request_id("abc-123 ~!")
    validate_request_id("x" * 128)
    with pytest.raises(InvalidArgument, match="129 characters; the limit is 128"):
        validate_request_id("x" * 129)
    with pytest.raises(InvalidArgument, match="printable ASCII; character 2"):
        validate_request_id("ab\ncd")
    with pytest.raises(InvalidArgument, match="printable ASCII"):
        validate_request_id("é")


def test_token_ids_in_vocabulary() -> None:
    validate_token_ids((0, 9), (), vocab_size=10)
    with pytest.raises(InvalidArgument, match=r"prompt_token_ids\[1\] = 10 is not a token.*size 10"):
        validate_token_ids((0, 10), (), vocab_size=10)
    with pytest.raises(InvalidArgument, match=r"stop_token_ids\[0\] = 99"):
        validate_token_ids((1,), (99,), vocab_size=10)


def test_empty_prompt_after_tokenization() -> None:
    with pytest.raises(InvalidArgument, match="empty after tokenization"):
        validate_token_ids((), (), vocab_size=10)


def test_resolve_max_tokens() -> None:
    assert resolve_max_tokens(None, 256, prompt_tokens=10, max_model_len=0) == 256
    assert resolve_max_tokens(5, 256, prompt_tokens=10, max_model_len=0) == 5
    assert resolve_max_tokens(None, 256, prompt_tokens=10, max_model_len=100) == 90  # default shortened
    assert resolve_max_tokens(90, 256, prompt_tokens=10, max_model_len=100) == 90
    with pytest.raises(InvalidArgument, match=r"\(10 tokens\) \+ max_tokens \(91\) exceeds.*\(100\).*<= 90"):
        resolve_max_tokens(91, 256, prompt_tokens=10, max_model_len=100)
    with pytest.raises(InvalidArgument, match="shorten the prompt"):
        resolve_max_tokens(None, 256, prompt_tokens=100, max_model_len=100)


def test_penalties_bias_and_min_tokens_in_range_pass() -> None:
    check(
        prompt="x",
        max_tokens=5,
        presence_penalty=-2.0,
        frequency_penalty=2.0,
        repetition_penalty=2.0,
        logit_bias=((0, -100.0), (9, 100.0)),
        min_tokens=5,
    )
    check(prompt="x", repetition_penalty=0.01, min_tokens=0)


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        ({"presence_penalty": 2.5}, "presence_penalty", "[-2, 2]"),
        ({"presence_penalty": math.nan}, "presence_penalty", "[-2, 2]"),
        ({"frequency_penalty": -2.01}, "frequency_penalty", "[-2, 2]"),
        ({"frequency_penalty": math.inf}, "frequency_penalty", "[-2, 2]"),
        ({"repetition_penalty": 0.0}, "repetition_penalty", "(0, 2]"),
        ({"repetition_penalty": 2.5}, "repetition_penalty", "(0, 2]"),
        ({"repetition_penalty": -1.0}, "repetition_penalty", "(0, 2]"),
        ({"logit_bias": ((5, 101.0),)}, "logit_bias", "[-100, 100]"),
        ({"logit_bias": ((5, math.nan),)}, "logit_bias", "[-100, 100]"),
        ({"logit_bias": ((-1, 1.0),)}, "logit_bias", "negative token id"),
        ({"logit_bias": tuple((i, 1.0) for i in range(1025))}, "logit_bias", "limit is 1024"),
        ({"min_tokens": -1}, "min_tokens", ">= 0"),
        ({"min_tokens": 6, "max_tokens": 5}, "min_tokens", "<= max_tokens"),
        ({"logprobs": 21}, "logprobs", "[0, 20]"),
        ({"logprobs": -1}, "logprobs", "[0, 20]"),
    ],
)
def test_bad_penalties_bias_and_min_tokens_name_the_field(
    fields: dict[str, Any], param: str, words: str
) -> None:
    with pytest.raises(InvalidField) as err:
        check(prompt="x", **fields)
    assert err.value.param == param
    assert param in str(err.value) and words in str(err.value)


def test_logit_bias_token_ids_must_be_in_the_vocabulary() -> None:
    validate_token_ids((1, 2), (), 10, ((9, 1.0),))
    with pytest.raises(InvalidField, match=r"logit_bias has token id 10.*vocabulary size 10") as err:
        validate_token_ids((1, 2), (), 10, ((10, 1.0),))
    assert err.value.param == "logit_bias"


def test_structured_outputs_are_compiled_at_the_gateway() -> None:
    check(prompt="x", structured=StructuredOutput("regex", "[a-z]+"))
    check(prompt="x", structured=StructuredOutput("json_object"))
    for bad, words in (
        (StructuredOutput("regex", "[z-a]"), "regex"),
        (StructuredOutput("json_schema", '{"type": "objectx"}'), "objectx"),
        (StructuredOutput("json_schema", "[]"), "must be a JSON object"),
        (StructuredOutput("choice", choices=("",)), "non-empty"),
    ):
        with pytest.raises(InvalidField, match=words) as err:
            check(prompt="x", structured=bad)
        assert err.value.param == "structured"


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({"allowed_token_ids": ()}, "allowed_token_ids is empty"),  # vLLM refuses [] too
        ({"allowed_token_ids": tuple(range(262_145))}, "limit is 262144"),
        ({"bad_words": ("a",) * 129}, "limit is 128"),
        ({"bad_words": ("ok", "")}, "bad_words[1] is empty"),
        ({"bad_words": ("  ",)}, "bad_words[0] is empty"),
        ({"bad_words": ("x" * 257,)}, "limit is 256"),
    ],
)
def test_bad_allowed_token_ids_and_bad_words_name_the_field(fields: dict[str, Any], words: str) -> None:
    param = next(iter(fields))
    with pytest.raises(InvalidField) as err:
        check(prompt="x", **fields)
    assert err.value.param == param and words in str(err.value)


def test_allowed_token_ids_must_be_in_the_vocabulary_and_bad_words_within_limits() -> None:
    check(prompt="x", allowed_token_ids=(1, 1, 9), bad_words=("a", " b c"))
    validate_token_ids((1, 2), (), 10, (), (0, 9))
    with pytest.raises(InvalidField, match=r"allowed_token_ids\[1\] = 10 .*vocabulary size 10") as err:
        validate_token_ids((1, 2), (), 10, (), (3, 10))
    assert err.value.param == "allowed_token_ids"
    validate_bad_word_sequences(((1,),) * 128)
    validate_bad_word_sequences(((1,) * 512, (2,) * 512))
    for sequences, words in ((((1,),) * 129, "129 token sequences"), (((1,) * 1025,), "1025 tokens")):
        with pytest.raises(InvalidField, match=words) as err:
            validate_bad_word_sequences(sequences)
        assert err.value.param == "bad_words"
