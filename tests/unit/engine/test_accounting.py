"""Token accounting, stop rules and incremental detokenization (byte-fallback tokenizer), with a
scripted sampler so the generated tokens are chosen by the test."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from services.worker.engine import draws
from services.worker.engine.api import Engine, RequestKind, RequestOutput
from tests.unit.engine.conftest import (
    EngineFactory,
    collect,
    greedy,
    request,
    text_of,
    tokens_of,
)

EOS = 2
SMILE = [243, 162, 156, 133]  # <0xF0> <0x9F> <0x99> <0x82> = '🙂' in the byte-fallback model
HELLO = [314, 316, 482]  # '▁', 'he', 'llo'
PROMPT = (316, 482, 314, 365, 297, 289)


@pytest.fixture
def script(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """Tokens the sampler returns, in order (one request at a time in these tests)."""
    tokens: list[int] = []

    def scripted(
        logits: torch.Tensor,
        params: Sequence[Any],
        generators: Sequence[Any],
        seeds: Any = None,
        histories: Any = None,
    ) -> torch.Tensor:
        # engine warm-ups sample too: they get token 0
        return torch.tensor([tokens.pop(0) if tokens else 0 for _ in params])

    monkeypatch.setattr(draws, "sample", scripted)
    yield tokens


@pytest.fixture
def engine(make_engine: EngineFactory, tiny_byte_fallback: Path) -> Engine:
    return make_engine(model_path=tiny_byte_fallback)


def _expected_text(engine: Any, generated: list[int]) -> str:
    tok = engine.tokenizer
    kw = {"skip_special_tokens": False}
    return str(tok.decode(list(PROMPT) + generated, **kw))[len(tok.decode(list(PROMPT), **kw)) :]


async def _run(engine: Engine, max_tokens: int, **kw: Any) -> list[RequestOutput]:
    return await collect(engine.add_request(request("a", PROMPT, greedy(max_tokens, **kw))))


async def test_immediate_eos_counts_zero(engine: Engine, script: list[int]) -> None:
    script.extend([EOS])
    outs = await _run(engine, 5)
    assert [o.finished for o in outs] == [True]
    assert outs[0].num_generated_tokens == 0 and outs[0].new_token_ids == ()
    assert outs[0].text_delta == ""
    assert outs[0].finish_reason is not None and outs[0].finish_reason.value == "stop"


async def test_multi_token_character_text_held_back(engine: Engine, script: list[int]) -> None:
    script.extend([*HELLO, *SMILE, EOS])
    outs = await _run(engine, 20)
    assert tokens_of(outs) == [*HELLO, *SMILE]
    assert outs[-1].num_generated_tokens == 7
    assert text_of(outs) == _expected_text(engine, [*HELLO, *SMILE])
    assert text_of(outs).endswith("🙂")
    assert all("\ufffd" not in o.text_delta for o in outs)


async def test_max_tokens_inside_a_character(engine: Engine, script: list[int]) -> None:
    script.extend([*HELLO, *SMILE[:2]])
    outs = await _run(engine, 5)
    assert outs[-1].num_generated_tokens == 5
    assert outs[-1].finish_reason is not None and outs[-1].finish_reason.value == "length"
    assert text_of(outs) == _expected_text(engine, HELLO)  # the partial character is not shown


async def test_stop_token_id_counted_text_excluded(engine: Engine, script: list[int]) -> None:
    script.extend([*HELLO, 365])
    outs = await _run(engine, 10, stop_token_ids=(365,))
    assert outs[-1].num_generated_tokens == 4
    assert outs[-1].finish_reason is not None and outs[-1].finish_reason.value == "stop"
    assert text_of(outs) == _expected_text(engine, HELLO)


async def test_stop_token_at_max_tokens_is_length(engine: Engine, script: list[int]) -> None:
    script.extend([*HELLO, 365])
    outs = await _run(engine, 4, stop_token_ids=(365,), include_stop_in_output=True)
    assert outs[-1].finish_reason is not None and outs[-1].finish_reason.value == "length"
    assert text_of(outs) == _expected_text(engine, [*HELLO, 365])


async def test_stop_string(engine: Engine, script: list[int]) -> None:
    script.extend([*HELLO, *SMILE, 314, 365, 297, 289, EOS])
    outs = await _run(engine, 20, stop=("wor",))
    full = _expected_text(engine, [*HELLO, *SMILE, 314, 365, 297, 289])
    assert text_of(outs) == full[: full.index("wor")]
    assert outs[-1].num_generated_tokens == 9  # up to the token completing "wor"
    assert outs[-1].finish_reason is not None and outs[-1].finish_reason.value == "stop"
    script.clear()
    script.extend([*HELLO, *SMILE, 314, 365, 297, 289, EOS])
    outs = await collect(
        engine.add_request(request("b", PROMPT, greedy(20, stop=("wor",), include_stop_in_output=True)))
    )
    assert text_of(outs) == full[: full.index("wor") + 3]


async def test_ignore_eos(engine: Engine, script: list[int]) -> None:
    script.extend([EOS, EOS, 316])
    outs = await _run(engine, 3, ignore_eos=True)
    assert tokens_of(outs) == [EOS, EOS, 316]
    assert outs[-1].num_generated_tokens == 3


async def test_decode_remote_continues_text_after_partial_first_token(
    make_engine: EngineFactory, tiny_byte_fallback: Path, script: list[int]
) -> None:
    prefill = make_engine(model_path=tiny_byte_fallback)
    decode = make_engine(model_path=tiny_byte_fallback)
    sampling = greedy(6)
    script.extend([SMILE[0]])
    first = await collect(prefill.add_request(request("r", PROMPT, sampling, kind=RequestKind.PREFILL_ONLY)))
    assert first[0].text_delta == "" and first[0].num_generated_tokens == 1
    admission, handle = decode.admit_remote(request("r", PROMPT, sampling, kind=RequestKind.DECODE_REMOTE))
    for chunk in prefill.export_kv("r", admission.num_cached_blocks, 1 << 20):
        decode.import_kv(admission.transfer_ticket, chunk)
    prefill.release("r")
    script.extend([*SMILE[1:], EOS])
    decode.finish_import(admission.transfer_ticket, len(PROMPT), SMILE[0], 1)
    outs = await collect(handle)
    assert tokens_of(outs) == SMILE[1:]
    assert outs[-1].num_generated_tokens == 3
    assert text_of(outs) == _expected_text(prefill, SMILE)


async def test_decode_remote_length_counts_prefill_token(
    make_engine: EngineFactory, tiny_byte_fallback: Path, script: list[int]
) -> None:
    decode = make_engine(model_path=tiny_byte_fallback)
    sampling = greedy(3, ignore_eos=True)
    admission, handle = decode.admit_remote(request("r", PROMPT, sampling, kind=RequestKind.DECODE_REMOTE))
    prefill = make_engine(model_path=tiny_byte_fallback)
    script.extend([7])
    await collect(prefill.add_request(request("r", PROMPT, sampling, kind=RequestKind.PREFILL_ONLY)))
    for chunk in prefill.export_kv("r", 0, 1 << 20):
        decode.import_kv(admission.transfer_ticket, chunk)
    script.extend([8, 9, 10])
    decode.finish_import(admission.transfer_ticket, len(PROMPT), 7, 1)
    outs = await collect(handle)
    assert tokens_of(outs) == [8, 9]
    assert outs[-1].num_generated_tokens == 2
    assert outs[-1].finish_reason is not None and outs[-1].finish_reason.value == "length"


async def _handoff(
    prefill: Engine, decode: Engine, sampling: Any, first: list[int], rest: list[int], script: list[int]
) -> tuple[list[RequestOutput], list[RequestOutput]]:
    script.extend(first)
    head = await collect(prefill.add_request(request("h", PROMPT, sampling, kind=RequestKind.PREFILL_ONLY)))
    admission, handle = decode.admit_remote(request("h", PROMPT, sampling, kind=RequestKind.DECODE_REMOTE))
    for chunk in prefill.export_kv("h", admission.num_cached_blocks, 1 << 20):
        decode.import_kv(admission.transfer_ticket, chunk)
    prefill.release("h")
    script.extend(rest)
    decode.finish_import(
        admission.transfer_ticket, len(PROMPT), head[0].new_token_ids[0], head[0].num_generated_tokens
    )
    return head, await collect(handle)


async def test_stop_string_spanning_the_handoff_matches_unified(
    make_engine: EngineFactory, tiny_byte_fallback: Path, script: list[int]
) -> None:
    """'he' (prefill's first token) + 'llo' (decode) completes the stop string 'hel': the prefill
    worker must hold back the possible stop prefix, and the decode worker must match across it."""
    sampling = greedy(8, stop=("hel",))
    # all engines first: their warm-ups also draw from the scripted sampler
    unified, prefill, decode = (make_engine(model_path=tiny_byte_fallback) for _ in range(3))
    script.extend([316, 482, 314, 316, 482])
    cold = await collect(unified.add_request(request("u", PROMPT, sampling)))
    assert cold[-1].finish_reason is not None and cold[-1].finish_reason.value == "stop"
    script.clear()
    head, rest = await _handoff(prefill, decode, sampling, [316], [482, 314, 316, 482], script)
    assert head[0].text_delta + text_of(rest) == text_of(cold)
    assert "he" not in head[0].text_delta  # held back: it may start the stop string
    assert rest[-1].finish_reason == cold[-1].finish_reason
    assert head[0].num_generated_tokens + rest[-1].num_generated_tokens == cold[-1].num_generated_tokens == 2
