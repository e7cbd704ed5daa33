"""The detokenizer's direct call into a fast tokenizer's backend (detokenizer.backend_decoder)
gives, piece by piece, the text transformers' `decode` wrapper gave: for random token ids with
special ids, byte tokens and partial multi-byte characters, after any prompt, for byte-level BPE
and byte-fallback tokenizers, with and without the clean-up of tokenization spaces. Tokenizers
that decode their own way keep their `decode`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from services.worker.engine.detokenizer import IncrementalDetokenizer, backend_decoder, hidden_token_ids
from tests.support.tiny_models import build_tiny_model


@pytest.fixture(scope="module", params=["bpe", "byte_fallback", "bpe_cleanup"])
def tokenizer(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    kind = str(request.param)
    path = build_tiny_model(tmp_path_factory.mktemp("detok_backend") / kind, kind.removesuffix("_cleanup"))
    if kind == "bpe_cleanup":  # the wrapper's clean-up, forced on (it skips BPE otherwise)
        tok = AutoTokenizer.from_pretrained(path, clean_up_tokenization_spaces=True)
        tok.clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output = True
        assert tok.decode(tok.encode("a , b")) == "a, b"  # the clean-up applies
        return tok
    return AutoTokenizer.from_pretrained(path)


def _ids(tokenizer: Any) -> st.SearchStrategy[list[int]]:
    vocab = len(tokenizer)
    special = [*tokenizer.all_special_ids, *tokenizer.convert_tokens_to_ids(["<0xF0>", "<0x9F>", "<0x99>"])]
    # a few real characters' ids too, so multi-token characters come whole as well as cut
    text_ids = tokenizer.encode("naïve café — 東京 🙂 don't , ok !")
    one = st.one_of(
        st.integers(0, vocab - 1),
        st.sampled_from([i for i in special if isinstance(i, int) and 0 <= i < vocab]),
        st.sampled_from(text_ids),
    )
    return st.lists(one, max_size=24)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_backend_pieces_equal_the_wrapper_pieces(tokenizer: Any, data: st.DataObject) -> None:
    prompt = data.draw(_ids(tokenizer), label="prompt")
    output = data.draw(_ids(tokenizer), label="output")
    hidden = hidden_token_ids(tokenizer) if data.draw(st.booleans(), label="hide specials") else frozenset()
    tail = data.draw(st.integers(0, 3), label="unshown_tail")
    fast = IncrementalDetokenizer(tokenizer, prompt, hidden, tail)
    slow = IncrementalDetokenizer(tokenizer, prompt, hidden, tail)
    slow._decode = lambda ids: str(tokenizer.decode(ids, skip_special_tokens=False))
    assert [fast.append(t) for t in output] == [slow.append(t) for t in output]


def test_the_fast_path_is_taken_and_decodes_as_the_wrapper(tokenizer: Any) -> None:
    decode = backend_decoder(tokenizer)
    ids = tokenizer.encode("naïve café , 東京 🙂 don't !") + list(tokenizer.all_special_ids)
    assert "backend_decoder" in decode.__qualname__ and "wrapper" not in decode.__qualname__
    for n in range(len(ids) + 1):
        assert decode(ids[:n]) == tokenizer.decode(ids[:n], skip_special_tokens=False)


def test_a_tokenizer_with_its_own_decode_keeps_it(tmp_path: Path) -> None:
    base = AutoTokenizer.from_pretrained(build_tiny_model(tmp_path / "bpe", "bpe"))

    class Shouting(type(base)):  # type: ignore[misc]
        def decode(self, token_ids: Any, skip_special_tokens: bool = False, **kwargs: Any) -> str:
            return str(super().decode(token_ids, skip_special_tokens=skip_special_tokens, **kwargs)).upper()

    base.__class__ = Shouting
    ids = base.encode("hello world")
    assert backend_decoder(base)(ids) == "HELLO WORLD"
