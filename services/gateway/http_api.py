"""The OpenAI-compatible HTTP face of the gateway (FastAPI routes): read + check the body
(http_body), convert (http_convert, http_chat) -> the same domain calls the gRPC servicer makes ->
convert back (http_responses; streams: http_stream's server-sent events); errors answer through
http_errors. A client that goes away cancels its request (aborted on the workers).

Routes: POST /v1/chat/completions, POST /v1/completions, POST /v1/responses, GET /v1/models,
POST /tokenize, POST /detokenize, POST /v1/load_lora_adapter, POST /v1/unload_lora_adapter
(vLLM's runtime LoRA updating), GET /health; the Files and Batch APIs' routes are
http_batches', the stored Responses' (GET / DELETE /v1/responses/{id}, ...) and what a Responses
request keeps are http_stored_responses'.
"""

from __future__ import annotations

import asyncio
import functools
import secrets
import time
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any, TypeVar

import grpc
import structlog
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse, PlainTextResponse
from opentelemetry import propagate, trace
from opentelemetry.context import Context
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from services.gateway import http_convert as conv
from services.gateway import http_models as m
from services.gateway import http_responses, observe
from services.gateway import http_responses_api as responses_api
from services.gateway.http_body import read_json, read_request_id
from services.gateway.http_choices import ChoiceRun
from services.gateway.http_convert import Plan
from services.gateway.http_errors import (
    REQUEST_ID_HEADER,
    HttpError,
    Refusal,
    error_body,
    error_response,
    http_error,
    unauthenticated,
)
from services.gateway.http_responses import completion_body, model_list
from services.gateway.http_stored_responses import Emit, Keeping, Produce, ResponseFailed, StoredResponses
from services.gateway.http_stream import EventStream, events
from services.gateway.lora_admin import AdapterInUse
from services.gateway.service import GatewayService
from services.gateway.stored_responses import RunRequest
from services.gateway.validation import InvalidField
from shared.auth import AUTH_HEADER, ApiKeys
from shared.errors import PdserveError
from shared.tracing import tracer

log = structlog.get_logger(__name__)

M = TypeVar("M", bound=BaseModel)


class HttpApi:
    """The FastAPI app over one GatewayService. `is_serving` is the gateway's gRPC health."""

    def __init__(
        self,
        service: GatewayService,
        keys: ApiKeys,
        is_serving: Callable[[], bool],
        max_body_bytes: int,
        response_dir: str = "",
        response_retention_s: float = 0.0,
    ) -> None:
        self._service = service
        self._keys = keys
        self._is_serving = is_serving
        self._max_body_bytes = max_body_bytes
        # the models' `created` (unix s): when this gateway started serving them, the same in every
        # answer (a list and a retrieve a second apart agree)
        self._created = int(time.time())
        self._tasks: set[asyncio.Task[None]] = set()  # choices still running (cancelled ones too)
        # the key of this process's own calls (the Batch API's requests), never shown or logged
        inner_key = secrets.token_urlsafe(32)
        self.inner_authorization = f"Bearer {inner_key}"
        self._inner_keys = ApiKeys.of([inner_key])
        self.app = self._build()
        # stored Responses API responses: the routes that read them, what POST /v1/responses keeps
        self.stored = StoredResponses(
            self.app, keys, response_dir, response_retention_s, max_body_bytes, self._rerun
        )

    def _build(self) -> FastAPI:
        # FastAPI's own OpenTelemetry (on whenever a tracer provider is installed, as every
        # pdserve service installs one) is off: _generate opens the request's SERVER span itself
        # (continuing the caller's trace), so FastAPI's would be a second root per request, and
        # its ASGI wrapper runs on every send (each streamed chunk).
        app = FastAPI(
            title="pdserve",
            docs_url=None,
            redoc_url=None,
            openapi_url="/openapi.json",
            telemetry={"tracing": False, "metrics": False, "logs": False},
        )
        app.add_exception_handler(Refusal, self._on_refusal)  # type: ignore[arg-type]
        app.add_exception_handler(StarletteHTTPException, self._on_http_exception)  # type: ignore[arg-type]
        app.add_api_route("/health", self.health, methods=["GET"])
        app.add_api_route("/v1/models", self.models, methods=["GET"], response_model=m.ModelList)
        # ids may hold slashes (org/name)
        app.add_api_route(
            "/v1/models/{model_id:path}", self.model, methods=["GET"], response_model=m.ModelCard
        )
        app.add_api_route(
            "/v1/chat/completions", self.chat, methods=["POST"], response_model=m.ChatCompletion
        )
        app.add_api_route("/v1/completions", self.completions, methods=["POST"], response_model=m.Completion)
        app.add_api_route("/v1/responses", self.responses, methods=["POST"])
        # vLLM's paths (no /v1): the prompt as it would run, and the text of token ids
        app.add_api_route("/tokenize", self.tokenize, methods=["POST"])
        app.add_api_route("/detokenize", self.detokenize, methods=["POST"])
        # vLLM's runtime LoRA updating (--allow-runtime-lora-updating)
        app.add_api_route("/v1/load_lora_adapter", self.load_lora_adapter, methods=["POST"])
        app.add_api_route("/v1/unload_lora_adapter", self.unload_lora_adapter, methods=["POST"])
        return app

    # --- error handlers ---
    async def _on_refusal(self, request: Request, exc: Refusal) -> JSONResponse:
        observe.record_error(exc.error.grpc_code.name)
        return error_response(exc.error)

    async def _on_http_exception(self, request: Request, exc: StarletteHTTPException) -> JSONResponse:
        type_ = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        message = f"{request.method} {request.url.path}: {exc.detail}"
        if exc.status_code == 404:
            message += (
                "; the API is POST /v1/chat/completions, POST /v1/completions, POST /v1/responses, "
                "GET /v1/models, POST /tokenize, POST /detokenize, POST /v1/load_lora_adapter, "
                "POST /v1/unload_lora_adapter, GET/DELETE /v1/responses/{id} (stored responses), "
                "/v1/files and /v1/batches (the Batch API)"
            )
        error = HttpError(
            exc.status_code, error_body(message, type_), dict(exc.headers or {}), grpc.StatusCode.UNKNOWN
        )
        return error_response(error)

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
        return JSONResponse(model_list(cards, self._created).model_dump())

    async def model(self, request: Request, model_id: str) -> JSONResponse:
        """One served model's card (`client.models.retrieve`), or 404 model_not_found."""
        self._authenticate(request)
        try:
            cards = await self._service.list_models()
        except Exception as exc:
            return self._fail(exc, "")
        for card in model_list(cards, self._created).data:
            if card.id == model_id:
                return JSONResponse(card.model_dump())
        message = f"the model {model_id!r} is not served here; GET /v1/models lists the served ones"
        body = error_body(message, "invalid_request_error", param="model", code="model_not_found")
        error = HttpError(404, body, {}, grpc.StatusCode.NOT_FOUND)
        observe.record_error(error.grpc_code.name)
        return error_response(error)

    async def tokenize(self, request: Request) -> JSONResponse:
        """vLLM's /tokenize: {count, max_model_len, tokens, token_strs}; `count` is what a
        completion or chat request with the same prompt or messages reports as prompt_tokens."""
        self._authenticate(request)
        try:
            body = await read_json(request, m.TokenizeRequest, self._max_body_bytes)
            done = await self._service.tokenize(conv.tokenize_input(body), body.return_token_strs)
        except Exception as exc:
            return self._fail(exc, "")
        return JSONResponse(
            {
                "count": len(done.token_ids),
                "max_model_len": done.max_model_len,
                "tokens": list(done.token_ids),
                "token_strs": list(done.token_strs) if body.return_token_strs else None,
            }
        )

    async def detokenize(self, request: Request) -> JSONResponse:
        """vLLM's /detokenize: {prompt} (the text of `tokens`)."""
        self._authenticate(request)
        try:
            body = await read_json(request, m.DetokenizeRequest, self._max_body_bytes)
            text, _ = await self._service.detokenize(body.model, tuple(body.tokens), "tokens")
        except Exception as exc:
            return self._fail(exc, "")
        return JSONResponse({"prompt": text})

    async def load_lora_adapter(self, request: Request) -> Response:
        """vLLM's /v1/load_lora_adapter: 200 with a text message once every worker of the base
        model has the adapter (and /v1/models lists it); a bad adapter is 400 with the reason."""
        self._authenticate(request)
        try:
            body = await read_json(request, m.LoadLoraAdapterRequest, self._max_body_bytes)
            if body.load_inplace:
                raise InvalidField(
                    "load_inplace is not served: unload the adapter, then load it again", "load_inplace"
                )
            await self._service.load_lora_adapter(body.model, body.lora_name, body.lora_path)
        except Exception as exc:
            return self._fail(exc, "", _LORA_STATUSES)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    async def unload_lora_adapter(self, request: Request) -> Response:
        """vLLM's /v1/unload_lora_adapter: 200 with a text message once no worker serves it;
        409 while requests of it are running, 404 when no worker has it."""
        self._authenticate(request)
        try:
            body = await read_json(request, m.UnloadLoraAdapterRequest, self._max_body_bytes)
            await self._service.unload_lora_adapter(body.model, body.lora_name)
        except AdapterInUse as exc:
            return self._fail(exc, "", {grpc.StatusCode.FAILED_PRECONDITION: (409, "conflict_error")})
        except Exception as exc:
            return self._fail(exc, "", _LORA_STATUSES)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    async def chat(self, request: Request) -> Response:
        return await self._generate(request, m.ChatCompletionRequest, chat=True)

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, m.CompletionRequest, chat=False)

    async def responses(self, request: Request) -> Response:
        """OpenAI's Responses API, served by the chat path (http_responses_api.py)."""
        return await self._generate(request, responses_api.ResponsesRequest, chat=True)

    # --- the request life over HTTP ---
    async def _generate(self, request: Request, model: type[M], chat: bool) -> Response:
        self._authenticate(request)
        request_id = ""
        try:
            request_id = read_request_id(request)
            body = await read_json(request, model, self._max_body_bytes)
            unknown = conv.unsupported_and_unknown(body.model_extra)
            if unknown:
                log.debug("ignored_unknown_fields", fields=sorted(unknown))
            # a Responses request is served as the chat completion request it becomes, after
            # the conversation it continues (previous_response_id)
            asked = body if isinstance(body, responses_api.ResponsesRequest) else None
            keeping = None
            if asked is not None:
                inner = self._inner_keys.accepts(request.headers.get(AUTH_HEADER))
                keeping = self.stored.prepare(asked, request, inner)
                plan = await self._responses_plan(asked, keeping.context, request_id)
            elif chat:
                plan = self._chat_plan(body, request_id)
            else:
                plan = conv.completion_plan(body, request_id)  # type: ignore[arg-type]
        except PdserveError as exc:  # the body's faults; no tokenizer yet (truncation "auto")
            return self._fail(exc, request_id)
        if asked is not None and keeping is not None and asked.background:
            return self._background(request, asked, keeping, plan, request_id)
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
        if not plan.stream:
            span.end()
            service = self._service
            payload = completion_body(
                plan,
                result,
                request_id,
                created,
                chat,
                service.token_text,
                http_responses.echoes(plan, service.decode),
                service.decode,
                service.output_text,
            )
            if asked is not None and keeping is not None:
                assert isinstance(payload, m.ChatCompletion)
                body_json = responses_api.response_body(asked, payload, request_id, created, keeping.kept)
                self.stored.keep(keeping, body_json)
                return JSONResponse(body_json, headers=headers)
            return JSONResponse(payload.model_dump(), headers=headers)

        def close() -> None:
            run.cancel()
            span.end()

        if asked is not None and keeping is not None:
            keep = functools.partial(self.stored.keep, keeping)
            payloads = self._response_events(asked, keeping, plan, run, result, request_id, created, keep)
            return EventStream(responses_api.as_sse(payloads), close, headers)
        return EventStream(self._chat_events(plan, run, result, request_id, created, chat), close, headers)

    def _chat_events(
        self, plan: Plan, run: ChoiceRun, result: Any, request_id: str, created: int, chat: bool
    ) -> AsyncIterator[str]:
        """A streamed request's server-sent events (chat or completion chunks)."""
        s = self._service
        echoes = http_responses.echoes(plan, s.decode)
        return events(
            plan, run, result, request_id, created, chat, s.token_text, echoes, s.decode, s.output_text
        )

    def _response_events(
        self,
        asked: responses_api.ResponsesRequest,
        keeping: Keeping,
        plan: Plan,
        run: ChoiceRun,
        result: Any,
        request_id: str,
        created: int,
        on_done: Callable[[dict[str, Any]], None],
    ) -> AsyncIterator[dict[str, Any]]:
        """A streamed Responses request's events, from the chat stream it runs as; the final
        Response goes to `on_done` (the store)."""
        chat = self._chat_events(plan, run, result, request_id, created, True)
        model = result[0][1].model
        return responses_api.event_payloads(asked, chat, request_id, created, model, keeping.kept, on_done)

    def _chat_plan(self, body: BaseModel, request_id: str) -> Plan:
        service = self._service
        return conv.chat_plan(
            body,  # type: ignore[arg-type]
            request_id,
            service.tool_call_format,
            service.reasoning_parser,
        )

    async def _responses_plan(
        self, asked: responses_api.ResponsesRequest, context: tuple[dict[str, Any], ...], request_id: str
    ) -> Plan:
        """The plan of a Responses request after the conversation `context`; with truncation
        "auto", without as many of the conversation's oldest turns as its prompt needs to fit
        the model's context with max_output_tokens (at least one) after it."""
        while True:
            plan = self._chat_plan(responses_api.chat_request(asked, context), request_id)
            if asked.truncation != "auto" or not context:
                return plan
            fit = await self._service.tokenize(plan.inputs[0])
            room = fit.max_model_len - (asked.max_output_tokens or 1)
            if fit.max_model_len <= 0 or len(fit.token_ids) <= room:
                return plan
            context = responses_api.without_oldest_turn(context)

    def _background(
        self,
        request: Request,
        asked: responses_api.ResponsesRequest,
        keeping: Keeping,
        plan: Plan,
        request_id: str,
    ) -> Response:
        """A background Response: stored queued and answered at once (or its events streamed as
        they are logged); its run continues in this process, not tied to the connection, streamed
        whatever the request said: its events go to the response's log, the final Response to
        its record."""
        created = int(time.time())
        context = propagate.extract(dict(request.headers))
        produce = self._background_run(asked, keeping, plan, request_id, created, context)
        assert keeping.kept is not None and keeping.record is not None
        queued = responses_api.queued_body(asked, request_id, created, keeping.kept)
        again = RunRequest(asked.model_dump(mode="json", exclude_unset=True), request_id, created)
        try:
            answer = self.stored.start_background(keeping, queued, produce, again)
        except Exception as exc:  # the store cannot be written: nothing started
            return self._fail(exc, request_id)
        headers = {REQUEST_ID_HEADER: request_id}
        if asked.stream:  # its events as they are logged; going away leaves it running
            return self.stored.stream(answer["id"], keeping.record.owner, after=-1, headers=headers)
        return JSONResponse(answer, headers=headers)

    async def _rerun(
        self, asked: responses_api.ResponsesRequest, keeping: Keeping, request_id: str, created: int
    ) -> Produce:
        """The run of a background response that another gateway left before it wrote output,
        from the start, as its POST /v1/responses would run it (a trace of its own)."""
        plan = await self._responses_plan(asked, keeping.context, request_id)
        return self._background_run(asked, keeping, plan, request_id, created, None)

    def _background_run(
        self,
        asked: responses_api.ResponsesRequest,
        keeping: Keeping,
        plan: Plan,
        request_id: str,
        created: int,
        context: Context | None,
    ) -> Produce:
        """A background response's run: its events through `emit`, its final Response returned."""

        async def produce(emit: Emit) -> dict[str, Any]:
            span = tracer().start_span("/v1/responses", context=context, kind=trace.SpanKind.SERVER)
            span.set_attribute("pdserve.request_id", request_id)
            run = ChoiceRun(self._service, plan.inputs, self._tasks)
            final: dict[str, Any] = {}
            try:
                with trace.use_span(span, end_on_exit=False):
                    work = asyncio.ensure_future(run.first_frames())
                    run.stream()
                result = await work
                async for event in self._response_events(
                    asked, keeping, plan, run, result, request_id, created, final.update
                ):
                    emit(event)
                    if event["type"] == "error":
                        raise ResponseFailed(event.get("message") or "", event.get("code"))
            finally:
                run.cancel()
                span.end()
            return final

        return produce

    def _fail(
        self,
        exc: BaseException,
        request_id: str,
        statuses: Mapping[grpc.StatusCode, tuple[int, str]] | None = None,
    ) -> JSONResponse:
        error = http_error(exc, statuses)
        observe.record_error(error.grpc_code.name)
        if error.is_internal:
            log.error("unhandled_error", request_id=request_id, exc_info=exc)
        else:
            log.info("request_error", request_id=request_id, status=error.status, error=str(exc))
        return error_response(error, request_id)

    def _authenticate(self, request: Request) -> None:
        given = request.headers.get(AUTH_HEADER)
        if not (self._keys.accepts(given) or self._inner_keys.accepts(given)):
            raise unauthenticated()


# A runtime LoRA update's refusals that are the request's fault, as vLLM answers them: an
# adapter the workers cannot load (a bad path, an adapter of another model) or workers started
# without --enable-lora is 400, not a server error.
_LORA_STATUSES = {grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error")}


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
