"""A migrated request's detokenizer: output tokens that became prompt tokens, with their text not
shown yet (an incomplete character), come out with the next token's text, so the client's text is
the same as if nothing had moved."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from services.worker.engine.detokenizer import IncrementalDetokenizer
from tests.support.tiny_models import build_tiny_model


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> object:
    path = build_tiny_model(tmp_path_factory.mktemp("detok") / "bf", "byte_fallback")
    return AutoTokenizer.from_pretrained(path)


def _text(detok: IncrementalDetokenizer, ids: list[int]) -> tuple[str, list[str]]:
    pieces = [detok.append(t) for t in ids]
    return "".join(pieces), pieces


def test_resuming_at_every_point_gives_the_same_text(tokenizer: object) -> None:
    prompt = tokenizer.encode("Résumé: ")  # type: ignore[attr-defined]
    output = tokenizer.encode("naïve café — 東京 ok")  # type: ignore[attr-defined]
    whole, pieces = _text(IncrementalDetokenizer(tokenizer, prompt), output)
    assert "" in pieces, "the test needs tokens whose text is held back (multi-token characters)"
    for cut in range(1, len(output)):
        shown = "".join(pieces[:cut])
        unshown = 0
        while unshown < cut and pieces[cut - 1 - unshown] == "":
            unshown += 1
        resumed = IncrementalDetokenizer(tokenizer, prompt + output[:cut], unshown_tail=unshown)
        rest, _ = _text(resumed, output[cut:])
        assert shown + rest == whole, cut
