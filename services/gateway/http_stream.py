"""Streamed OpenAI HTTP responses: server-sent events for a request's choices (chat: a role chunk
per choice, then a chunk per frame with text, reasoning and tool calls as deltas; completions: a
chunk per frame),
the usage chunk when asked, then [DONE]; an error after the stream started ends it with one error
event. `EventStream` stops when the client disconnects and then cancels the request's choices."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import AsyncIterator, Callable, Iterable
from functools import partial
from typing import Any

import anyio
import structlog
from fastapi.responses import StreamingResponse
from pydantic import BaseModel
from starlette.types import Receive, Scope, Send

from services.gateway import http_models as m
from services.gateway import http_responses as resp
from services.gateway import observe, tool_calls
from services.gateway.http_choices import ChoiceRun
from services.gateway.http_convert import Plan
from services.gateway.http_errors import http_error
from services.gateway.http_sse import ChunkTemplate
from services.gateway.http_token_ids import OutputText, StreamIds
from services.gateway.inputs import TokenLogprob
from services.gateway.reasoning import Decode, ReasoningParser
from services.gateway.request import OutputFrame

log = structlog.get_logger(__name__)


class EventStream(StreamingResponse):
    """Server-sent events that stop when the client disconnects (whatever the server's ASGI spec
    version), then run `on_close` (which cancels the request's choices)."""

    def __init__(self, body: AsyncIterator[str], on_close: Callable[[], None], headers: dict[str, str]):
        super().__init__(body, media_type="text/event-stream", headers=headers)
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as group:

                async def run_then_stop(fn: Callable[[], Any]) -> None:
                    await fn()
                    group.cancel_scope.cancel()

                group.start_soon(run_then_stop, partial(self.stream_response, send))
                await run_then_stop(partial(self.listen_for_disconnect, receive))
        finally:
            self._on_close()


def _items(parts: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """One-key deltas ({"content": ...} / {"reasoning_content": ...}) as (key, text); one empty
    content (the `{}` delta of a chunk that only carries the finish_reason) for none."""
    return [next(iter(p.items())) for p in parts] or [("content", "")]


def _usage_so_far(frame: OutputFrame) -> m.Usage:
    """vLLM's continuous usage of one choice at `frame`: its prompt, the tokens it generated so
    far (usage.completion_tokens at its FINAL frame), their total; cached_tokens as in usage."""
    return m.Usage(
        prompt_tokens=frame.prompt_tokens,
        completion_tokens=frame.completion_tokens,
        total_tokens=frame.prompt_tokens + frame.completion_tokens,
        prompt_tokens_details=m.PromptTokensDetails(cached_tokens=frame.cached_tokens),
    )


def _sse(payload: BaseModel | dict[str, Any], exclude: set[str] | None = None) -> str:
    if isinstance(payload, BaseModel):
        return f"data: {payload.model_dump_json(exclude=exclude)}\n\n"
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


async def events(
    plan: Plan,
    run: ChoiceRun,
    first: list[tuple[int, OutputFrame]],
    request_id: str,
    created: int,
    chat: bool,
    token_text: Callable[[int], str],
    echoes: list[str] | None = None,
    decode: Decode | None = None,
    output_text: OutputText | None = None,
) -> AsyncIterator[str]:
    """The SSE body: (chat) a role chunk per choice, one chunk per frame with text (the last one
    of a choice carries finish_reason), the usage chunk when asked, then [DONE]. An error after
    the stream started ends it with one `data: {"error": {...}}` event and no [DONE]. With
    logprobs, a chunk carries those of the tokens since the previous chunk of its choice. With
    echo (completions), a choice's first chunk starts with its prompt (and the prompt's logprobs).
    With plan.reasoning (chat, --reasoning-parser), a frame's text is split into
    `{"reasoning_content": ...}` and content deltas (a tag is held back until it is whole, and
    never sent), tool calls are parsed from the content only, and the usage chunk counts the
    reasoning tokens (from the choices' token ids: `decode` turns them into text). With
    plan.continuous_usage (vLLM's continuous_usage_stats) every chunk of a choice carries that
    choice's usage so far (a role chunk: no tokens yet; reasoning_tokens only in the usage chunk,
    which sums the choices as always). A choice's chunk with finish_reason carries vLLM's
    stop_reason (read from its ids: `output_text` turns them into the workers' text); with
    return_token_ids each chunk carries the ids generated since its choice's previous chunk, and
    each choice's first chunk the prompt's (chat: on the role chunk, at the top level)."""
    model = first[0][1].model
    exclude = None if plan.include_usage else {"usage"}
    usages: list[Any] = [None] * len(plan.inputs)
    rid = resp.chat_id(request_id) if chat else resp.completion_id(request_id)
    template = ChunkTemplate(rid, created, model, chat, plan.include_usage)  # the per-token chunks
    wants = [inp.logprobs is not None for inp in plan.inputs]
    name = resp.token_names(plan, token_text)  # how logprobs name tokens
    progress: list[m.Usage | None] = [None] * len(plan.inputs)  # continuous usage, per choice
    if plan.continuous_usage:
        for index, opening in first:
            if progress[index] is None:  # the role chunk's: the prompt, no tokens yet
                progress[index] = _usage_so_far(dataclasses.replace(opening, completion_tokens=0))
    pending: list[list[TokenLogprob]] = [[] for _ in plan.inputs]  # of frames without text
    offsets = [0] * len(plan.inputs)  # completions' text_offset: where the next token's text starts
    parsers = [plan.tools.parser() if plan.tools else None for _ in plan.inputs]
    calls_sent = [0] * len(plan.inputs)  # the next tool call's index, per choice
    opened: list[set[str]] = [set() for _ in plan.inputs]  # ids of calls streamed piecewise
    reasoners = [ReasoningParser(plan.reasoning) if plan.reasoning else None for _ in plan.inputs]
    generated: list[list[int]] = [[] for _ in plan.inputs]  # with reasoners: each choice's token ids
    # per choice: the prompt text not yet sent (echo), None once sent
    to_echo: list[str | None] | None = list(echoes) if echoes else None
    echo_frames: list[OutputFrame | None] = [None] * len(plan.inputs)  # echoed, its chunk not sent
    ids = StreamIds(plan, output_text or (lambda token_ids, skip: ""))
    for index, opening in first:
        ids.note_prompt(index, opening)  # chat's role chunks carry it before any frame is relayed

    def deltas(index: int, text: str, reason: str | None) -> tuple[list[dict[str, Any]], str | None]:
        """A chat frame's deltas: its reasoning and content, in the order written (the content
        through the tool-call parser), and its finish_reason."""
        reasoner = reasoners[index]
        if reasoner is None:
            return content_deltas(index, text, reason)
        out: list[dict[str, Any]] = []
        for piece in reasoner.feed(text) + (reasoner.finish() if reason is not None else []):
            if piece.reasoning:
                out.append({"reasoning_content": piece.text})
            else:
                out.extend(content_deltas(index, piece.text, None)[0])
        if reason is not None:
            tail, reason = content_deltas(index, "", reason)
            out.extend(tail)
        return out, reason

    def content_deltas(index: int, text: str, reason: str | None) -> tuple[list[dict[str, Any]], str | None]:
        """A chat frame's content deltas (content, or each tool call as its name, then its
        arguments) and its finish_reason (tool_calls when the choice called any)."""
        parser = parsers[index]
        if parser is None:
            return ([{"content": text}] if text else []), reason
        events = parser.feed(text) + (parser.finish() if reason is not None else [])
        out: list[dict[str, Any]] = []
        for event in events:
            if isinstance(event, str):
                out.append({"content": event})
                continue
            if isinstance(event, tool_calls.ArgumentsDelta):  # of the call opened last
                k = calls_sent[index] - 1
                out.append({"tool_calls": [{"index": k, "function": {"arguments": event.text}}]})
                continue
            if isinstance(event, tool_calls.ToolCall) and event.id in opened[index]:
                continue  # streamed piecewise already: its CallStart and arguments went out
            k = calls_sent[index]
            calls_sent[index] += 1
            function = {"name": event.name, "arguments": ""}
            out.append(
                {"tool_calls": [{"index": k, "id": event.id, "type": "function", "function": function}]}
            )
            if isinstance(event, tool_calls.CallStart):
                opened[index].add(event.id)
            else:
                out.append({"tool_calls": [{"index": k, "function": {"arguments": event.arguments}}]})
        if reason is not None:
            reason = resp.chat_finish_reason(reason, parser.num_calls > 0)
        return out, reason

    def chunk(index: int, frame: OutputFrame | None) -> str | None:
        """The SSE event for one frame (None: the chat role chunk that opens a choice)."""
        reason: str | None = None
        stop: int | str | None = None  # vLLM's stop_reason, on the chunk with finish_reason
        text = ""
        logprobs: list[TokenLogprob] = []
        echo_frame: OutputFrame | None = None  # the choice's first frame, with echo
        if frame is not None:
            reason, text = resp.finish_reason(frame.finish_reason), frame.text
            pending_echo = to_echo[index] if to_echo is not None else None
            if to_echo is not None and pending_echo is not None:
                text, to_echo[index], echo_frames[index] = pending_echo + text, None, frame
            ids.record(index, frame)
            stop = ids.stop_reason(index, frame.finish_reason)
            if frame.usage is not None:
                usages[index] = frame.usage
            pending[index].extend(frame.logprobs)
            if reasoners[index] is not None:
                generated[index].extend(frame.token_ids)
            if plan.continuous_usage:
                progress[index] = _usage_so_far(frame)
            if not text and reason is None:
                return None  # nothing to say (text held back, e.g. a partial character)
            logprobs, pending[index] = pending[index], []
            echo_frame, echo_frames[index] = echo_frames[index], None
        so_far = progress[index]
        usage_json = None if so_far is None else so_far.model_dump_json()
        if chat:
            if frame is None:
                parts: list[dict[str, Any]] = [{"role": plan.role, "content": ""}]
            elif parsers[index] is None and reasoners[index] is None and not wants[index] and not ids.shown:
                # a content delta (or {}): no model built
                return template.event(index, text, reason, usage=usage_json, stop_reason=stop)
            else:
                parts, reason = deltas(index, text, reason)
                if not parts and reason is None:
                    pending[index][:0] = logprobs  # the parser holds the text back: later
                    return None
                if parsers[index] is None and not wants[index] and not ids.shown:
                    items = _items(parts)  # reasoning / content deltas only
                    return "".join(
                        template.event(
                            index, piece, reason if n == len(items) - 1 else None, key, usage_json, stop
                        )
                        for n, (key, piece) in enumerate(items)
                    )
            parts = parts or [{}]
            chat_lp = (
                resp.chat_logprobs(logprobs, token_text, name) if wants[index] and frame is not None else None
            )
            token_ids = ids.take(index) if frame is not None else None
            events = []
            for n, delta in enumerate(parts):
                last = n == len(parts) - 1
                choice = m.ChatChunkChoice(
                    index=index,
                    delta=delta,
                    finish_reason=reason if last else None,
                    logprobs=chat_lp if n == 0 else None,
                    stop_reason=stop,
                    token_ids=token_ids if n == 0 else None,
                )
                chunk = m.ChatCompletionChunk(
                    id=rid,
                    created=created,
                    model=model,
                    choices=[choice],
                    usage=so_far,
                    prompt_token_ids=ids.prompt(index) if frame is None else None,
                )
                events.append(_sse(chunk, exclude))
            return "".join(events)
        if not wants[index] and not ids.shown:
            return template.event(index, text, reason, usage=usage_json, stop_reason=stop)
        text_lp = None
        if wants[index]:
            text_lp = resp.completion_logprobs(logprobs, name, offsets[index])
            if echo_frame is not None:
                text_lp = resp.echoed_logprobs(echo_frame, name, text_lp, plan.inputs[index].logprobs)
            offsets[index] += sum(len(t) for t in text_lp.tokens)
        text_choice = m.CompletionChunkChoice(
            index=index,
            text=text,
            finish_reason=reason,
            logprobs=text_lp,
            stop_reason=stop,
            prompt_token_ids=ids.prompt(index),
            token_ids=ids.take(index),
        )
        return _sse(
            m.CompletionChunk(id=rid, created=created, model=model, choices=[text_choice], usage=so_far),
            exclude,
        )

    def pieces(frames: Iterable[tuple[int, OutputFrame | None]]) -> Iterable[str]:
        for index, frame in frames:
            piece = chunk(index, frame)
            if piece is not None:
                yield piece

    try:
        if chat:
            for piece in pieces((i, None) for i in range(len(plan.inputs))):
                yield piece
            if plan.chat_echo:  # vLLM's chat echo: a content chunk per choice, before its output
                for i, so_far in enumerate(progress):
                    usage = None if so_far is None else so_far.model_dump_json()
                    yield template.event(i, plan.chat_echo, None, usage=usage)
        for piece in pieces(first):
            yield piece
        async for index, frame in run.rest():
            event = chunk(index, frame)
            if event is not None:
                yield event
    except Exception as exc:
        error = http_error(exc)
        observe.record_error(error.grpc_code.name)
        if error.is_internal:
            log.error("unhandled_error", request_id=request_id, exc_info=exc)
        else:
            log.info("stream_error", request_id=request_id, status=error.status, error=str(exc))
        yield _sse(error.body)
        return
    if plan.include_usage:
        thought_tokens = None
        if plan.reasoning is not None:
            assert decode is not None
            thought_tokens = [
                resp.reasoning_tokens(plan, tuple(ids), u.completion_tokens, decode)
                for ids, u in zip(generated, usages, strict=True)
            ]
        tail_type = m.ChatCompletionChunk if chat else m.CompletionChunk
        total = resp.usage(plan, usages, thought_tokens)
        yield _sse(tail_type(id=rid, created=created, model=model, choices=[], usage=total))
    yield "data: [DONE]\n\n"
