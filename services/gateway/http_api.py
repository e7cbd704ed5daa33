"""The OpenAI-compatible HTTP face of the gateway (FastAPI routes): read + check the body, convert
(http_convert) -> the same domain calls the gRPC servicer makes -> convert back. Streams are
server-sent events; a client that goes away cancels its request (aborted on the workers).

Routes: POST /v1/chat/completions, POST /v1/completions, GET /v1/models, GET /health.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable, Iterable
from functools import partial
from typing import Any, TypeVar

import anyio
import grpc
import structlog
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from opentelemetry import propagate, trace
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Receive, Scope, Send

from services.gateway import http_convert as conv
from services.gateway import http_models as m
from services.gateway import observe, tool_calls
from services.gateway.http_choices import ChoiceRun
from services.gateway.http_convert import HttpError, InvalidParam, Plan
from services.gateway.request import Completion, OutputFrame, TokenLogprob, new_request_id
from services.gateway.service import GatewayService
from services.gateway.tool_calls import ToolCall
from services.gateway.validation import validate_request_id
from shared.auth import AUTH_HEADER, UNAUTHENTICATED_MESSAGE, ApiKeys
from shared.errors import InvalidArgument
from shared.tracing import tracer

log = structlog.get_logger(__name__)

M = TypeVar("M", bound=BaseModel)

REQUEST_ID_HEADER = "X-Request-Id"
_JSON_TYPES = ("application/json",)


class _Refusal(Exception):
    """Ends a request early with an HTTP error (auth, body checks)."""

    def __init__(self, error: HttpError) -> None:
        super().__init__(error.body.error.message)
        self.error = error


def _refusal(status: int, message: str, type_: str, param: str | None = None) -> _Refusal:
    return _Refusal(HttpError(status, conv.error_body(message, type_, param), {}, grpc.StatusCode.UNKNOWN))


def _error_response(error: HttpError, request_id: str | None = None) -> JSONResponse:
    headers = dict(error.headers)
    if request_id:
        headers[REQUEST_ID_HEADER] = request_id
    return JSONResponse(error.body.model_dump(), status_code=error.status, headers=headers)


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


def _sse(payload: BaseModel | dict[str, Any], exclude: set[str] | None = None) -> str:
    if isinstance(payload, BaseModel):
        return f"data: {payload.model_dump_json(exclude=exclude)}\n\n"
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


class HttpApi:
    """The FastAPI app over one GatewayService. `is_serving` is the gateway's gRPC health."""

    def __init__(
        self,
        service: GatewayService,
        keys: ApiKeys,
        is_serving: Callable[[], bool],
        max_body_bytes: int,
    ) -> None:
        self._service = service
        self._keys = keys
        self._is_serving = is_serving
        self._max_body_bytes = max_body_bytes
        self._tasks: set[asyncio.Task[None]] = set()  # choices still running (cancelled ones too)
        self.app = self._build()

    def _build(self) -> FastAPI:
        app = FastAPI(title="pdserve", docs_url=None, redoc_url=None, openapi_url="/openapi.json")
        app.add_exception_handler(_Refusal, self._on_refusal)  # type: ignore[arg-type]
        app.add_exception_handler(StarletteHTTPException, self._on_http_exception)  # type: ignore[arg-type]
        app.add_api_route("/health", self.health, methods=["GET"])
        app.add_api_route("/v1/models", self.models, methods=["GET"], response_model=m.ModelList)
        app.add_api_route(
            "/v1/chat/completions", self.chat, methods=["POST"], response_model=m.ChatCompletion
        )
        app.add_api_route("/v1/completions", self.completions, methods=["POST"], response_model=m.Completion)
        return app

    # --- error handlers ---
    async def _on_refusal(self, request: Request, exc: _Refusal) -> JSONResponse:
        observe.record_error(exc.error.grpc_code.name)
        return _error_response(exc.error)

    async def _on_http_exception(self, request: Request, exc: StarletteHTTPException) -> JSONResponse:
        type_ = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        message = f"{request.method} {request.url.path}: {exc.detail}"
        if exc.status_code == 404:
            message += "; the API is POST /v1/chat/completions, POST /v1/completions, GET /v1/models"
        error = HttpError(
            exc.status_code, conv.error_body(message, type_), dict(exc.headers or {}), grpc.StatusCode.UNKNOWN
        )
        return _error_response(error)

    # --- routes ---
    async def health(self) -> Response:
        serving = self._is_serving()
        return JSONResponse(
            {"status": "SERVING" if serving else "NOT_SERVING"}, status_code=200 if serving else 503
        )

    async def models(self, request: Request) -> JSONResponse:
        self._authenticate(request)
        try:
            cards = await self._service.list_models()
        except Exception as exc:
            return self._fail(exc, "")
        return JSONResponse(conv.model_list(cards, int(time.time())).model_dump())

    async def chat(self, request: Request) -> Response:
        return await self._generate(request, m.ChatCompletionRequest, chat=True)

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, m.CompletionRequest, chat=False)

    # --- the request life over HTTP ---
    async def _generate(self, request: Request, model: type[M], chat: bool) -> Response:
        self._authenticate(request)
        request_id = ""
        try:
            request_id = _request_id(request)
            body = await self._read_json(request, model)
            unknown = conv.unsupported_and_unknown(body.model_extra)
            if unknown:
                log.debug("ignored_unknown_fields", fields=sorted(unknown))
            plan = (
                conv.chat_plan(body, request_id, self._service.tool_call_format)  # type: ignore[arg-type]
                if chat
                else conv.completion_plan(body, request_id)  # type: ignore[arg-type]
            )
        except InvalidArgument as exc:
            return self._fail(exc, request_id)
        span = tracer().start_span(
            request.url.path, context=propagate.extract(dict(request.headers)), kind=trace.SpanKind.SERVER
        )
        span.set_attribute("pdserve.request_id", request_id)
        run = ChoiceRun(self._service, plan.inputs, self._tasks)
        with trace.use_span(span, end_on_exit=False):  # the choices' tasks inherit the span
            work = asyncio.ensure_future(run.complete() if not plan.stream else run.first_frames())
            if plan.stream:
                run.stream()
        headers = {REQUEST_ID_HEADER: request_id}
        created = int(time.time())
        try:
            result = await _unless_disconnected(request, work, run)
        except BaseException as exc:
            run.cancel()
            span.end()
            if isinstance(exc, asyncio.CancelledError):
                raise
            return self._fail(exc, request_id)
        if result is None:
            span.end()
            observe.record_error(grpc.StatusCode.CANCELLED.name)
            return Response(status_code=499)  # nobody reads it: the client is gone
        echoes = _echoes(plan, self._service.decode)
        if not plan.stream:
            span.end()
            payload = _completion_body(
                plan, result, request_id, created, chat, self._service.token_text, echoes
            )
            return JSONResponse(payload.model_dump(), headers=headers)

        def close() -> None:
            run.cancel()
            span.end()

        return EventStream(
            _events(plan, run, result, request_id, created, chat, self._service.token_text, echoes),
            close,
            headers,
        )

    def _fail(self, exc: BaseException, request_id: str) -> JSONResponse:
        error = conv.http_error(exc)
        observe.record_error(error.grpc_code.name)
        if error.is_internal:
            log.error("unhandled_error", request_id=request_id, exc_info=exc)
        else:
            log.info("request_error", request_id=request_id, status=error.status, error=str(exc))
        return _error_response(error, request_id)

    def _authenticate(self, request: Request) -> None:
        if not self._keys.accepts(request.headers.get(AUTH_HEADER)):
            raise _Refusal(
                HttpError(
                    401,
                    conv.error_body(UNAUTHENTICATED_MESSAGE, "authentication_error", code="invalid_api_key"),
                    {"WWW-Authenticate": "Bearer"},
                    grpc.StatusCode.UNAUTHENTICATED,
                )
            )

    async def _read_json(self, request: Request, model: type[M]) -> M:
        """The body as `model`: JSON only, at most max_body_bytes, every problem a 4xx."""
        content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if content_type and content_type not in _JSON_TYPES and not content_type.endswith("+json"):
            raise _refusal(
                415,
                f"the body must be JSON (Content-Type: application/json), got Content-Type {content_type!r}; "
                "with curl add -H 'Content-Type: application/json'",
                "invalid_request_error",
            )
        limit = self._max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise _too_large(int(declared), limit)
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise _too_large(size, limit)
            chunks.append(chunk)
        raw = b"".join(chunks)
        if not raw.strip():
            raise InvalidParam("the request body is empty; send a JSON object", None)
        try:
            return model.model_validate_json(raw)
        except ValidationError as exc:
            raise _validation_error(exc) from None


def _too_large(size: int, limit: int) -> _Refusal:
    return _refusal(
        413,
        f"the request body is {size} bytes or more; the limit is {limit} bytes (--http-max-body-bytes)",
        "invalid_request_error",
    )


def _validation_error(exc: ValidationError) -> InvalidParam:
    """The first problem pydantic found, as a sentence naming the field."""
    err = exc.errors(include_url=False)[0]
    if err["type"] == "json_invalid":
        return InvalidParam(f"the body is not valid JSON: {err['msg']}", None)
    loc = [str(p) for p in err["loc"] if not str(p).startswith(("function-", "list[", "str", "int"))]
    where = ".".join(loc) or "the body"
    if err["type"] == "model_type" and not loc:
        return InvalidParam("the body must be a JSON object", None)
    message = f"{where}: {err['msg']}"
    if err["type"] == "missing":
        message = f"{where} is required"
    return InvalidParam(message, loc[0] if loc else None)


def _request_id(request: Request) -> str:
    given = request.headers.get(REQUEST_ID_HEADER, "")
    if given:
        try:
            validate_request_id(given)
        except InvalidArgument as exc:
            raise InvalidParam(f"{REQUEST_ID_HEADER}: {exc}", None) from None
        return given
    return new_request_id()


async def _unless_disconnected(request: Request, task: asyncio.Future[Any], run: ChoiceRun) -> Any:
    """Await `task` unless the client disconnects first: then cancel the run and return None."""

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        run.cancel()
        raise
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    log.info("client_disconnected", before="answer")
    task.cancel()
    run.cancel()
    return None


def _echoes(plan: Plan, decode: Callable[[tuple[int, ...]], str]) -> list[str] | None:
    """Completions with echo: each choice's prompt text (None without echo)."""
    return [conv.echo_text(inp, decode) for inp in plan.inputs] if plan.echo else None


def _echoed_logprobs(
    c: Completion | OutputFrame, token_text: Callable[[int], str], generated: m.CompletionLogprobs
) -> m.CompletionLogprobs:
    """Echo with logprobs: the prompt tokens' entries, then the generated ones (whose
    text_offset continues after the prompt's token texts)."""
    prompt = conv.prompt_completion_logprobs(c.prompt_token_ids, c.prompt_logprobs, token_text)
    shift = sum(len(t) for t in prompt.tokens)
    generated = generated.model_copy(update={"text_offset": [o + shift for o in generated.text_offset]})
    return conv.joined_logprobs(prompt, generated)


def _text_logprobs(c: Completion, token_text: Callable[[int], str], echo: bool) -> m.CompletionLogprobs:
    """A completions choice's logprobs (with echo, the prompt's first)."""
    generated = conv.completion_logprobs(c.logprobs, token_text)
    return _echoed_logprobs(c, token_text, generated) if echo else generated


def _completion_body(
    plan: Plan,
    done: list[Completion],
    request_id: str,
    created: int,
    chat: bool,
    token_text: Callable[[int], str],
    echoes: list[str] | None = None,
) -> m.ChatCompletion | m.Completion:
    usage = conv.usage(plan, [c.usage for c in done])
    model = done[0].model
    wants = [inp.logprobs is not None for inp in plan.inputs]
    if chat:
        choices = []
        for i, c in enumerate(done):
            content: str | None = c.text
            calls: list[ToolCall] = []
            if plan.tools is not None:
                content, calls = tool_calls.parse(c.text, plan.tools.fmt, plan.tools.forced)
            choices.append(
                m.ChatChoice(
                    index=i,
                    message=m.AssistantMessage(
                        content=content, tool_calls=conv.response_tool_calls(calls) or None
                    ),
                    finish_reason=conv.chat_finish_reason(c.finish_reason.value, bool(calls)),
                    logprobs=conv.chat_logprobs(c.logprobs, token_text) if wants[i] else None,
                )
            )
        return m.ChatCompletion(
            id=conv.chat_id(request_id), created=created, model=model, choices=choices, usage=usage
        )
    return m.Completion(
        id=conv.completion_id(request_id),
        created=created,
        model=model,
        choices=[
            m.CompletionChoice(
                index=i,
                text=(echoes[i] if echoes else "") + c.text,
                finish_reason=c.finish_reason.value,
                logprobs=_text_logprobs(c, token_text, echo=bool(echoes)) if wants[i] else None,
            )
            for i, c in enumerate(done)
        ],
        usage=usage,
    )


async def _events(
    plan: Plan,
    run: ChoiceRun,
    first: list[tuple[int, OutputFrame]],
    request_id: str,
    created: int,
    chat: bool,
    token_text: Callable[[int], str],
    echoes: list[str] | None = None,
) -> AsyncIterator[str]:
    """The SSE body: (chat) a role chunk per choice, one chunk per frame with text (the last one
    of a choice carries finish_reason), the usage chunk when asked, then [DONE]. An error after
    the stream started ends it with one `data: {"error": {...}}` event and no [DONE]. With
    logprobs, a chunk carries those of the tokens since the previous chunk of its choice. With
    echo (completions), a choice's first chunk starts with its prompt (and the prompt's logprobs)."""
    model = first[0][1].model
    exclude = None if plan.include_usage else {"usage"}
    usages: list[Any] = [None] * len(plan.inputs)
    rid = conv.chat_id(request_id) if chat else conv.completion_id(request_id)
    wants = [inp.logprobs is not None for inp in plan.inputs]
    pending: list[list[TokenLogprob]] = [[] for _ in plan.inputs]  # of frames without text
    offsets = [0] * len(plan.inputs)  # completions' text_offset: where the next token's text starts
    parsers = [plan.tools.parser() if plan.tools else None for _ in plan.inputs]
    calls_sent = [0] * len(plan.inputs)  # the next tool call's index, per choice
    opened: list[set[str]] = [set() for _ in plan.inputs]  # ids of calls streamed piecewise
    # per choice: the prompt text not yet sent (echo), None once sent
    to_echo: list[str | None] | None = list(echoes) if echoes else None

    def deltas(index: int, text: str, reason: str | None) -> tuple[list[dict[str, Any]], str | None]:
        """A chat frame's deltas (content, or each tool call as its name, then its arguments)
        and its finish_reason (tool_calls when the choice called any)."""
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
            reason = conv.chat_finish_reason(reason, parser.num_calls > 0)
        return out, reason

    def chunk(index: int, frame: OutputFrame | None) -> str | None:
        """The SSE event for one frame (None: the chat role chunk that opens a choice)."""
        reason: str | None = None
        text = ""
        logprobs: list[TokenLogprob] = []
        echo_frame: OutputFrame | None = None  # the choice's first frame, with echo
        if frame is not None:
            reason, text = conv.finish_reason(frame.finish_reason), frame.text
            pending_echo = to_echo[index] if to_echo is not None else None
            if to_echo is not None and pending_echo is not None:
                text, to_echo[index], echo_frame = pending_echo + text, None, frame
            if frame.usage is not None:
                usages[index] = frame.usage
            pending[index].extend(frame.logprobs)
            if not text and reason is None:
                return None  # nothing to say (text held back, e.g. a partial character)
            logprobs, pending[index] = pending[index], []
        if chat:
            if frame is None:
                parts: list[dict[str, Any]] = [{"role": "assistant", "content": ""}]
            else:
                parts, reason = deltas(index, text, reason)
                if not parts and reason is None:
                    pending[index][:0] = logprobs  # the parser holds the text back: later
                    return None
            parts = parts or [{}]
            chat_lp = conv.chat_logprobs(logprobs, token_text) if wants[index] and frame is not None else None
            events = []
            for n, delta in enumerate(parts):
                last = n == len(parts) - 1
                choice = m.ChatChunkChoice(
                    index=index,
                    delta=delta,
                    finish_reason=reason if last else None,
                    logprobs=chat_lp if n == 0 else None,
                )
                events.append(
                    _sse(
                        m.ChatCompletionChunk(
                            id=rid, created=created, model=model, choices=[choice], usage=None
                        ),
                        exclude,
                    )
                )
            return "".join(events)
        text_lp = None
        if wants[index]:
            text_lp = conv.completion_logprobs(logprobs, token_text, offsets[index])
            if echo_frame is not None:
                text_lp = _echoed_logprobs(echo_frame, token_text, text_lp)
            offsets[index] += sum(len(t) for t in text_lp.tokens)
        text_choice = m.CompletionChunkChoice(index=index, text=text, finish_reason=reason, logprobs=text_lp)
        return _sse(
            m.CompletionChunk(id=rid, created=created, model=model, choices=[text_choice], usage=None),
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
        for piece in pieces(first):
            yield piece
        async for index, frame in run.rest():
            event = chunk(index, frame)
            if event is not None:
                yield event
    except Exception as exc:
        error = conv.http_error(exc)
        observe.record_error(error.grpc_code.name)
        if error.is_internal:
            log.error("unhandled_error", request_id=request_id, exc_info=exc)
        else:
            log.info("stream_error", request_id=request_id, status=error.status, error=str(exc))
        yield _sse(error.body)
        return
    if plan.include_usage:
        tail_type = m.ChatCompletionChunk if chat else m.CompletionChunk
        yield _sse(
            tail_type(id=rid, created=created, model=model, choices=[], usage=conv.usage(plan, usages))
        )
    yield "data: [DONE]\n\n"
