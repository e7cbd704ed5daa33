"""Structured outputs in the engine: the output matches its JSON schema / regex / choice list /
grammar (GBNF or Lark),
and the constrained tokens are the same unified, disaggregated (the prefill engine constrains
the first token, the decode engine replays it), after a migration and with speculation on."""

from __future__ import annotations

import dataclasses
import json
import random
import re
from pathlib import Path

import jsonschema
import pytest

from services.worker.engine.api import SamplingConfig
from services.worker.engine.structured import _unpack
from shared.errors import InvalidArgument
from shared.structured_output import StructuredOutput
from tests.unit.engine.conftest import EngineFactory, collect, handoff_run, request, text_of, tokens_of

SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "size": {"enum": ["small", "large"]},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
    },
    "required": ["ok", "size", "tags"],
    "additionalProperties": False,
}
PROMPT = tuple(random.Random(8).randrange(3, 450) for _ in range(21))
CASES = {
    "json_schema": StructuredOutput("json_schema", json.dumps(SCHEMA)),
    "regex": StructuredOutput("regex", r"[a-c]{3}-[0-9]{2}"),
    "choice": StructuredOutput("choice", choices=("yes", "no", "maybe not")),
    # GBNF (llama.cpp's syntax, vLLM's grammar examples) and Lark (llguidance's)
    "grammar_gbnf": StructuredOutput(
        "grammar", 'root ::= item ("," item)?\nitem ::= "red" | "green" | [0-9] [0-9]?'
    ),
    "grammar_lark": StructuredOutput(
        "grammar", 'start: item "+" item\nitem: "x" | "yy" | NUM\nNUM: /[0-9]{1,3}/'
    ),
}
GRAMMAR_TEXT = {
    "grammar_gbnf": r"(red|green|[0-9]{1,2})(,(red|green|[0-9]{1,2}))?",
    "grammar_lark": r"(x|yy|[0-9]{1,3})\+(x|yy|[0-9]{1,3})",
}


def test_bitmask_unpacking() -> None:
    import torch

    bits = torch.tensor([0b101, -(2**31)], dtype=torch.int32)  # tokens 0, 2 and 63
    mask = _unpack(bits.numpy().tobytes(), 64)
    assert mask.nonzero().flatten().tolist() == [0, 2, 63]
    assert _unpack(bits.numpy().tobytes(), 40).shape == (40,)


def _check(kind: str, text: str) -> None:
    if kind == "json_schema":
        jsonschema.validate(json.loads(text), SCHEMA)
    elif kind == "regex":
        assert re.fullmatch(r"[a-c]{3}-[0-9]{2}", text), text
    elif kind in GRAMMAR_TEXT:
        assert re.fullmatch(GRAMMAR_TEXT[kind], text), text
    else:
        assert text in ("yes", "no", "maybe not"), text


@pytest.mark.parametrize("kind", list(CASES))
async def test_constrained_output_matches_in_every_mode(make_engine: EngineFactory, kind: str) -> None:
    unified, prefill, decode = make_engine(), make_engine(), make_engine()
    spec = make_engine(speculative="ngram", num_speculative_tokens=3, spec_ngram_min=1, spec_step_cost=False)
    for seed in (1, 2, 3):
        sampling = SamplingConfig(
            max_tokens=60, temperature=1.0, seed=seed, structured=CASES[kind], logprobs=1
        )
        want = await collect(unified.add_request(request(f"u{seed}", PROMPT, sampling)))
        assert want[-1].finish_reason is not None and want[-1].finish_reason.value == "stop"  # EOS at the end
        _check(kind, text_of(want))
        first, rest = await handoff_run(prefill, decode, f"d{seed}", PROMPT, sampling)
        assert list(first.new_token_ids) + tokens_of(rest) == tokens_of(want)
        assert first.text_delta + text_of(rest) == text_of(want)
        assert tokens_of(await collect(spec.add_request(request(f"s{seed}", PROMPT, sampling)))) == tokens_of(
            want
        )
        if len(tokens_of(want)) > 2:
            k = len(tokens_of(want)) // 2
            moved = dataclasses.replace(sampling, max_tokens=60 - k, first_output_index=k)
            resumed = await collect(
                unified.add_request(request(f"m{seed}", PROMPT + tuple(tokens_of(want)[:k]), moved))
            )
            assert tokens_of(resumed) == tokens_of(want)[k:]
    # greedy too (random weights would otherwise repeat one token forever)
    greedy = SamplingConfig(max_tokens=60, temperature=0.0, structured=CASES[kind])
    _check(kind, text_of(await collect(unified.add_request(request("g", PROMPT, greedy)))))


async def test_a_bad_constraint_is_invalid_argument(make_engine: EngineFactory) -> None:
    engine = make_engine()
    for bad in (
        StructuredOutput("regex", "(a|b"),
        StructuredOutput("json_schema", '{"type": "objectx"}'),
        StructuredOutput("json_schema", "{not json"),
        StructuredOutput("choice", choices=()),
        StructuredOutput("grammar", "root ::= undefined_rule"),
        StructuredOutput("grammar", "  "),
    ):
        with pytest.raises(InvalidArgument, match="structured output"):
            engine.add_request(request("bad", PROMPT, SamplingConfig(max_tokens=4, structured=bad)))


async def test_a_finished_constraint_ends_even_before_min_tokens(make_engine: EngineFactory) -> None:
    engine = make_engine()
    sampling = SamplingConfig(max_tokens=20, temperature=0.0, min_tokens=15, structured=CASES["choice"])
    out = await collect(engine.add_request(request("c", PROMPT, sampling)))
    _check("choice", text_of(out))
    assert out[-1].finish_reason is not None and out[-1].finish_reason.value == "stop"
    assert out[-1].num_generated_tokens < 15


@pytest.mark.parametrize("kind", ["bpe", "byte_fallback"])
def test_added_text_tokens_like_think_tags_write_the_grammars_text(kind: str) -> None:
    """Added tokens marked special: false (Qwen's and DeepSeek-R1's <think>, </think>) are text:
    a constraint that writes them may use them, and consuming them keeps the matcher going. A
    walk taking the first allowed token at every step ends at EOS with matching text (before,
    the mask allowed only the <think> token and consuming it was an error)."""
    import llguidance
    from tokenizers import AddedToken
    from transformers import PreTrainedTokenizerFast

    from services.worker.engine.grammar_tokens import ll_tokenizer
    from shared.structured_output import grammar_of
    from tests.support.tiny_models import _train_tokenizer

    hf = PreTrainedTokenizerFast(tokenizer_object=_train_tokenizer(kind), eos_token="<|im_end|>")
    hf.add_tokens([AddedToken("<think>", special=False), AddedToken("</think>", special=False)])
    vocab = len(hf) + 3  # a model's embedding may be larger than the tokenizer
    ll = ll_tokenizer(hf, vocab)
    think = hf.convert_tokens_to_ids("<think>")
    for spec, pattern in (
        (StructuredOutput("regex", r"<think>[a-c]{2}</think>ok"), r"<think>[a-c]{2}</think>ok"),
        (StructuredOutput("choice", choices=("<think>x</think>", "plain")), r"<think>x</think>|plain"),
        (StructuredOutput("grammar", 'root ::= "<think>" [0-9] "</think>"'), r"<think>[0-9]</think>"),
    ):
        matcher = llguidance.LLMatcher(ll, grammar_of(spec), log_level=0)
        out: list[int] = []
        for _ in range(30):
            allowed = _unpack(matcher.compute_bitmask(), vocab).nonzero().flatten().tolist()
            assert allowed, spec
            if not out and spec.kind != "choice":
                assert think in allowed  # the tag's own token, as the model writes it
            if allowed == [hf.eos_token_id]:
                break
            token = next(t for t in allowed if t != hf.eos_token_id)
            matcher.consume_token(token)
            assert not matcher.is_error(), (spec, hf.convert_ids_to_tokens([*out, token]))
            out.append(token)
        assert matcher.is_accepting()
        text = str(hf.decode(out))
        assert re.fullmatch(pattern, text), text
    assert not ll.is_special_token(think) and ll.is_special_token(hf.eos_token_id)


async def test_a_model_with_think_tokens_writes_them_under_a_constraint(
    make_engine: EngineFactory, tmp_path: Path
) -> None:
    """Through the engine, unified and disaggregated: the output starts with the <think> token
    itself and matches; it ends with EOS, not cut off after the tag."""
    from tests.support.tiny_models import build_tiny_model

    folder = build_tiny_model(tmp_path / "think", text_tokens=("<think>", "</think>"))
    unified, prefill, decode = (make_engine(folder) for _ in range(3))
    from transformers import AutoTokenizer

    think = AutoTokenizer.from_pretrained(str(folder)).convert_tokens_to_ids("<think>")
    spec = StructuredOutput("regex", r"<think>[a-c]{2,4}</think>(ok|no)")
    for seed in (1, 2):
        sampling = SamplingConfig(max_tokens=30, temperature=1.0, seed=seed, structured=spec)
        want = await collect(unified.add_request(request(f"u{seed}", PROMPT, sampling)))
        assert re.fullmatch(r"<think>[a-c]{2,4}</think>(ok|no)", text_of(want)), text_of(want)
        assert want[-1].finish_reason is not None and want[-1].finish_reason.value == "stop"
        assert tokens_of(want)[0] == think
        first, rest = await handoff_run(prefill, decode, f"d{seed}", PROMPT, sampling)
        assert list(first.new_token_ids) + tokens_of(rest) == tokens_of(want)
