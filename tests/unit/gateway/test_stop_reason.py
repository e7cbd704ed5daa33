"""vLLM's stop_reason read from a finished request's generated ids: the stop string found first
in their text (ties: the one listed first), else a last token listed in stop_token_ids, else None
(EOS, length, abort; a terminating EOS is never among the ids, also when listed as a stop id)."""

from __future__ import annotations

from services.gateway.stop_reason import first_stop_string, stop_reason
from shared.cluster import FinishReason

TEXT = {1: "he", 2: "llo", 3: " wor", 4: "ld", 9: "<s>"}


def decode(ids: tuple[int, ...]) -> str:
    return "".join(TEXT[t] for t in ids)


def test_stop_token_string_eos_and_length() -> None:
    stop = FinishReason.STOP
    assert stop_reason(stop, (1, 2, 9), (), (9,), False, decode) == 9  # a stop token id: an int
    assert stop_reason(stop, (1, 2, 3), ("or", "wor"), (), False, decode) == "wor"  # first in text
    assert stop_reason(stop, (1, 2, 3), ("or", "o w"), (), True, decode) == "o w"
    # EOS: never among the ids, so a request stopped after (1, 2) by EOS has no stop reason,
    # also when the client listed EOS (7) among the stop ids and the output has no stop string
    assert stop_reason(stop, (1, 2), ("xyz",), (7,), False, decode) is None
    assert stop_reason(stop, (), ("he",), (7,), False, decode) is None  # an immediate EOS
    assert stop_reason(FinishReason.LENGTH, (1, 2, 9), ("llo",), (9,), False, decode) is None
    assert stop_reason(FinishReason.ABORT, (1, 2, 9), ("llo",), (9,), False, decode) is None


def test_a_stop_tokens_own_text_completes_a_stop_string_only_when_shown() -> None:
    """The worker hides a terminating stop token's text unless include_stop_in_output: only then
    can that text complete a stop string (vLLM's detokenizer skips it the same way)."""
    assert stop_reason(FinishReason.STOP, (1, 2, 9), ("lo<s>",), (9,), False, decode) == 9
    assert stop_reason(FinishReason.STOP, (1, 2, 9), ("lo<s>",), (9,), True, decode) == "lo<s>"


def test_first_stop_string_ties_go_to_the_first_listed() -> None:
    assert first_stop_string("hello world", ("wor", "world", "o")) == "o"
    assert first_stop_string("hello world", ("world", "wor")) == "world"
    assert first_stop_string("hello world", ("x", "")) is None
