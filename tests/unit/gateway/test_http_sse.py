"""The per-token SSE chunks spliced from a template are byte for byte the pydantic chunk models'
(`model_dump_json`, usage excluded unless stream_options.include_usage), for any text (unicode,
control characters, quotes, backslashes, emoji), finish reason (with vLLM's stop_reason: a stop
string, a token id or null), choice index, id and model."""

from __future__ import annotations

from typing import NamedTuple

from hypothesis import given, settings
from hypothesis import strategies as st

from services.gateway import http_models as m
from services.gateway.http_sse import ChunkTemplate

_REASONS = st.sampled_from([None, "stop", "length", "abort", "tool_calls"])
_TEXT = st.text(alphabet=st.characters(codec="utf-8"), max_size=40)  # any valid text (no lone surrogates)
_STOPS = st.one_of(st.none(), st.integers(0, 2**31), _TEXT)


class _Case(NamedTuple):
    chat: bool
    rid: str
    created: int
    model: str
    include_usage: bool
    choice: int  # the choice index
    text: str
    reason: str | None
    stop: int | str | None  # vLLM's stop_reason (shown with a finish reason only)


def _pydantic(c: _Case) -> str:
    """What http_stream built for every chunk before the template: the models, dumped."""
    exclude = None if c.include_usage else {"usage"}
    body: m.ChatCompletionChunk | m.CompletionChunk
    if c.chat:
        delta = {"content": c.text} if c.text else {}
        choice = m.ChatChunkChoice(
            index=c.choice, delta=delta, finish_reason=c.reason, logprobs=None, stop_reason=c.stop
        )
        body = m.ChatCompletionChunk(id=c.rid, created=c.created, model=c.model, choices=[choice], usage=None)
    else:
        text = m.CompletionChunkChoice(
            index=c.choice, text=c.text, finish_reason=c.reason, logprobs=None, stop_reason=c.stop
        )
        body = m.CompletionChunk(id=c.rid, created=c.created, model=c.model, choices=[text], usage=None)
    return f"data: {body.model_dump_json(exclude=exclude)}\n\n"


@settings(max_examples=300, deadline=None)
@given(
    st.builds(
        _Case,
        chat=st.booleans(),
        rid=_TEXT,
        created=st.integers(0, 2**40),
        model=_TEXT,
        include_usage=st.booleans(),
        choice=st.integers(0, 200),
        text=_TEXT,
        reason=_REASONS,
        stop=_STOPS,
    )
)
def test_template_chunks_equal_the_models(c: _Case) -> None:
    template = ChunkTemplate(c.rid, c.created, c.model, c.chat, c.include_usage)
    assert template.event(c.choice, c.text, c.reason, stop_reason=c.stop) == _pydantic(c)


def test_a_chat_chunk_as_clients_see_it() -> None:
    """The shape itself (so that a change to both sides cannot pass unnoticed)."""
    event = ChunkTemplate("chatcmpl-1", 7, "m", True, False).event(0, 'é "\n', None)
    assert event == (
        'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":7,"model":"m",'
        '"choices":[{"index":0,"delta":{"content":"é \\"\\n"},"finish_reason":null,"logprobs":null}]}\n\n'
    )
    assert ChunkTemplate("cmpl-1", 7, "m", False, True).event(2, "", "length") == (
        'data: {"id":"cmpl-1","object":"text_completion","created":7,"model":"m",'
        '"choices":[{"index":2,"text":"","finish_reason":"length","logprobs":null,"stop_reason":null}],'
        '"usage":null}\n\n'
    )


def test_template_chunks_with_continuous_usage_equal_the_models() -> None:
    """vLLM's continuous usage: the usage spliced in place of the null is the model's."""
    usage = m.Usage(
        prompt_tokens=7,
        completion_tokens=3,
        total_tokens=10,
        prompt_tokens_details=m.PromptTokensDetails(cached_tokens=4),
    )
    for chat in (True, False):
        body: m.ChatCompletionChunk | m.CompletionChunk
        if chat:
            choice = m.ChatChunkChoice(
                index=1, delta={"content": 'é"'}, finish_reason="stop", logprobs=None, stop_reason=7
            )
            body = m.ChatCompletionChunk(id="r", created=5, model="x", choices=[choice], usage=usage)
        else:
            text = m.CompletionChunkChoice(
                index=1, text='é"', finish_reason="stop", logprobs=None, stop_reason=7
            )
            body = m.CompletionChunk(id="r", created=5, model="x", choices=[text], usage=usage)
        template = ChunkTemplate("r", 5, "x", chat, include_usage=True)
        event = template.event(1, 'é"', "stop", usage=usage.model_dump_json(), stop_reason=7)
        assert event == f"data: {body.model_dump_json()}\n\n"
