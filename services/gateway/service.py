"""The gateway's domain facade: validate + tokenize, run the request life, build Complete's
single response from the same frames Generate streams, list models, load and unload LoRA
adapters at runtime (when allowed; lora_admin.py does the work)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator
from typing import cast

import structlog
from opentelemetry import trace

from services.gateway import observe, thinking_budget
from services.gateway.admission import Admission
from services.gateway.breaker import CircuitBreakers
from services.gateway.budget import MaxTokens
from services.gateway.dispatch import Dispatcher, PreparedRequest
from services.gateway.inputs import GenerateInput, Sampling, ThinkingBudget, TokenLogprob, new_request_id
from services.gateway.lora_admin import LoraAdmin, LoraUpdate
from services.gateway.membership import MembershipWatch
from services.gateway.model_cards import ModelCards
from services.gateway.ports import MembershipSource, ModelCard, SchedulerClient, WorkerClient
from services.gateway.reasoning import Kind as ReasoningKind
from services.gateway.request import Completion, OutputFrame, OutputFrameKind, RequestState, RequestStatus
from services.gateway.sampling_defaults import SamplingDefaults
from services.gateway.settings import GatewaySettings
from services.gateway.tokenization import PromptTokenizer, Tokenized
from services.gateway.tool_calls import Format
from services.gateway.validation import (
    Limits,
    validate_bad_word_sequences,
    validate_input,
    validate_model,
    validate_token_ids,
    validate_vocab_ids,
)
from shared.errors import (
    AlreadyExists,
    FailedPrecondition,
    NotFound,
    PdserveError,
    PermissionDenied,
    Unavailable,
)
from shared.tracing import tracer

log = structlog.get_logger(__name__)


class GatewayService:
    def __init__(
        self,
        settings: GatewaySettings,
        scheduler: SchedulerClient,
        workers: WorkerClient,
        tokenizer: PromptTokenizer | None = None,
        membership: MembershipSource | None = None,
        lora_admin: LoraAdmin | None = None,
    ) -> None:
        """`membership`: where the membership of decode workers carrying streams is checked
        (None: not checked); `lora_admin`: what loads and unloads LoRA adapters at runtime (None:
        nothing does)."""
        self._settings = settings
        self._lora_admin = lora_admin
        self._tokenizer = tokenizer
        self._defaults = SamplingDefaults()  # what unset sampling fields become (set_tokenizer)
        self._limits = Limits(settings.max_stop_strings, settings.max_stop_string_chars)
        self.membership = (
            None
            if membership is None
            else MembershipWatch(membership, settings.membership_poll_s, settings.membership_probe_timeout_s)
        )
        self.model_cards = ModelCards(scheduler)
        self.dispatcher = Dispatcher(
            scheduler,
            workers,
            settings.block_size,
            settings.worker_rpc_timeout_s,
            migration_limit=settings.migration_limit,
            first_token_before_handoff=settings.first_token_before_handoff,
            breakers=CircuitBreakers(settings.breaker_failures, settings.breaker_cooldown_s),
            membership=self.membership,
            model_cards=self.model_cards,
        )
        self.admission = Admission(
            settings.max_inflight_requests, settings.max_queued_requests, settings.max_queue_wait_s
        )
        self._in_flight: dict[str, asyncio.Task[object]] = {}  # request_id -> the RPC's task
        self._idle = asyncio.Event()
        self._idle.set()
        self._draining = False
        self._cancelled_by_drain: set[asyncio.Task[object]] = set()

    # --- lifecycle ---
    def set_tokenizer(self, tokenizer: PromptTokenizer, defaults: SamplingDefaults | None = None) -> None:
        """The served model's tokenizer and the sampling defaults it recommends (None: OpenAI's)."""
        self._tokenizer = tokenizer
        self._defaults = defaults or SamplingDefaults()

    def begin_drain(self) -> None:
        """New requests get UNAVAILABLE; in-flight ones continue."""
        self._draining = True

    async def drain(self, grace_s: float) -> None:
        """Refuse new requests, give in-flight ones `grace_s` to finish, then cancel the rest
        (their workers get Abort) and wait until those aborts went out."""
        self.begin_drain()
        try:
            await asyncio.wait_for(self._idle.wait(), grace_s)
        except TimeoutError:
            leftover = list(self._in_flight.values())
            log.warning("drain_grace_expired_aborting", in_flight=len(leftover))
            for task in leftover:
                self._cancelled_by_drain.add(task)
                task.cancel()
            if leftover:
                await asyncio.wait(leftover, timeout=5.0)
        await self.dispatcher.wait_for_aborts(timeout_s=5.0)

    async def close(self) -> None:
        """After the server stopped: let pending Abort calls finish, stop the membership watch
        and the model cards' refresh."""
        await self.dispatcher.wait_for_aborts(timeout_s=5.0)
        await self.model_cards.close()
        if self.membership is not None:
            await self.membership.close()

    @property
    def num_in_flight(self) -> int:
        return len(self._in_flight)

    # --- requests ---
    async def lora_adapter(self, model: str) -> str:
        """The LoRA adapter a request's `model` names: "" for the base model (empty, or the served
        model's id), else an adapter of the served model that workers list (the cards, refreshed
        when the name is new to them). NotFound, naming what is served, for anything else."""
        tok = self._require_tokenizer()
        if not model or model == tok.model_id:
            return ""
        await self.model_cards.lookup(model, self._settings.worker_rpc_timeout_s)
        if not self.model_cards.listed:  # the scheduler never answered: unknown, not missing
            raise Unavailable(
                f"cannot tell whether {model!r} is a LoRA adapter: the scheduler has not listed the "
                "cluster's models yet; retry shortly"
            )
        validate_model(model, tok.model_id, self.model_cards.adapters_of(tok.model_id))
        return model

    def prompt_token_ids(self, inp: GenerateInput, lora_adapter: str = "") -> tuple[int, ...]:
        """The prompt `inp` runs with (validated as a request; `lora_adapter`: the adapter its
        model names, from `lora_adapter`): its token ids, or its prompt or messages (with the
        tools offered) through the tokenizer and chat template (the base model's: an adapter
        has the same)."""
        tok = self._require_tokenizer()
        validate_input(inp, self._limits, tok.model_id, [lora_adapter] if lora_adapter else [])
        if inp.prompt_token_ids:
            prompt = inp.prompt_token_ids
        elif inp.messages:
            prompt = tok.encode_chat(
                inp.messages,
                inp.tools,
                self.tool_call_format,
                dict(inp.chat_template_kwargs),
                inp.continue_final_message,
                inp.add_generation_prompt,
            )
        else:
            prompt = tok.encode_prompt(inp.prompt)
        k = inp.truncate_prompt_tokens
        if k is not None:  # vLLM's: "left" cuts on the left (keeps the last k), "right" the first k
            prompt = prompt[-k:] if inp.truncation_side == "left" else prompt[:k]
        validate_token_ids(
            prompt, inp.stop_token_ids, tok.vocab_size, inp.logit_bias, inp.allowed_token_ids or ()
        )
        return prompt

    async def tokenize(self, inp: GenerateInput, return_token_strs: bool = False) -> Tokenized:
        """What Tokenize answers: the prompt a Generate of `inp` would run (its count is that
        request's usage.prompt_tokens) and the max_model_len of the model (or LoRA adapter) it
        names (0 while unknown)."""
        lora_adapter = await self.lora_adapter(inp.model)
        prompt = self.prompt_token_ids(inp, lora_adapter)
        tok = self._require_tokenizer()
        model = lora_adapter or tok.model_id
        max_len = await self.model_cards.max_model_len(model, self._settings.worker_rpc_timeout_s)
        return Tokenized(prompt, model, max_len, tok.pieces(prompt) if return_token_strs else ())

    async def detokenize(
        self, model: str, token_ids: tuple[int, ...], field: str = "token_ids"
    ) -> tuple[str, str]:
        """(the ids' text, the model id: `model` when it names a LoRA adapter) for ids of the
        served model's vocabulary; `field`: the ids' name in the client's API (refusals name it)."""
        lora_adapter = await self.lora_adapter(model)
        tok = self._require_tokenizer()
        validate_vocab_ids(field, token_ids, tok.vocab_size)
        return tok.decode(token_ids), lora_adapter or tok.model_id

    def prepare(self, inp: GenerateInput, lora_adapter: str = "") -> PreparedRequest:
        """`lora_adapter`: the adapter `inp.model` names (`lora_adapter`); "" = the base model."""
        prompt = self.prompt_token_ids(inp, lora_adapter)
        d = self._defaults
        temperature = d.temperature if inp.temperature is None else float(inp.temperature)
        sampling = Sampling(
            temperature=temperature,
            top_p=d.top_p if inp.top_p is None else float(inp.top_p),
            top_k=d.top_k if inp.top_k is None else inp.top_k,
            # a greedy request ignores min_p: not sent, so it needs no "min_p" worker
            min_p=(d.min_p if inp.min_p is None else float(inp.min_p)) if temperature != 0 else 0.0,
            cache_salt=inp.cache_salt,
            lora_adapter=lora_adapter,
            skip_special_tokens=inp.skip_special_tokens and not inp.show_tool_markers,
            special_tokens_hint=inp.skip_special_tokens and inp.show_tool_markers,
            seed=inp.seed,
            stop=inp.stop,
            stop_token_ids=inp.stop_token_ids,
            ignore_eos=inp.ignore_eos,
            include_stop_in_output=inp.include_stop_in_output,
            presence_penalty=float(inp.presence_penalty or 0.0),
            frequency_penalty=float(inp.frequency_penalty or 0.0),
            repetition_penalty=(
                d.repetition_penalty if inp.repetition_penalty is None else float(inp.repetition_penalty)
            ),
            logit_bias=tuple(sorted((t, float(b)) for t, b in inp.logit_bias if b != 0.0)),
            min_tokens=inp.min_tokens or 0,
            allowed_token_ids=tuple(sorted(set(inp.allowed_token_ids or ()))),
            bad_words=self._bad_words(inp.bad_words),
            thinking_budget=self._thinking_budget(inp.thinking_token_budget, prompt),
            logprobs=inp.logprobs,
            structured=inp.structured,
            prompt_logprobs=inp.prompt_logprobs,
        )
        return PreparedRequest(
            request_id=inp.request_id or new_request_id(),
            model=inp.model,
            prompt_token_ids=prompt,
            sampling=sampling,
            max_tokens=MaxTokens(inp.max_tokens, d.max_tokens or self._settings.default_max_tokens),
            return_token_ids=inp.return_token_ids,
            priority=inp.priority,
            continuous_usage=inp.continuous_usage,
        )

    def _bad_words(self, words: tuple[str, ...]) -> tuple[tuple[int, ...], ...]:
        """The bad words as the token sequences the workers ban, within the limits (tokenized
        once, here: the gateway owns the tokenizer)."""
        if not words:
            return ()
        sequences = self._require_tokenizer().bad_word_sequences(words)
        validate_bad_word_sequences(sequences)
        return sequences

    def _thinking_budget(self, budget: int | None, prompt: tuple[int, ...]) -> ThinkingBudget | None:
        """thinking_token_budget with the reasoning parser's tags in the model's tokens."""
        tok = self._require_tokenizer()
        tail = prompt[-thinking_budget.PROMPT_TAIL_TOKENS :]
        kind = self.reasoning_parser
        return thinking_budget.resolve(budget, kind, lambda: tok.think_tag_ids, lambda: tok.decode(tail))

    async def generate(
        self, inp: GenerateInput, client_timeout_s: float | None = None
    ) -> AsyncGenerator[OutputFrame, None]:
        """The streamed frames of one request (the last is FINAL). client_timeout_s: what is left
        of the client's deadline, if it set one."""
        arrival_s = time.monotonic()
        if self._draining:
            raise Unavailable("the gateway is shutting down; retry on another replica")
        prepared = self.prepare(inp, await self.lora_adapter(inp.model))
        # Admission: a slot, or a short wait for one (by priority, then arrival), or
        # RESOURCE_EXHAUSTED at once. The deadline clock starts at arrival, so time spent queued
        # counts against it.
        async with self.admission.slot(prepared.priority):
            if prepared.request_id in self._in_flight:
                raise AlreadyExists(
                    f"request_id {prepared.request_id!r} is already in flight; use a unique id or "
                    "leave it empty"
                )
            timeout_s = self._settings.request_timeout_s
            if client_timeout_s is not None:
                timeout_s = min(timeout_s, client_timeout_s)
            state = RequestState(
                request_id=prepared.request_id,
                prompt_token_ids=prepared.prompt_token_ids,
                return_token_ids=prepared.return_token_ids,
                continuous_usage=prepared.continuous_usage,
                # what responses echo as their model: the adapter's id for an adapter's request
                model=prepared.sampling.lora_adapter or self._require_tokenizer().model_id,
                arrival_s=arrival_s,
            )
            task = asyncio.current_task()
            assert task is not None
            self._in_flight[prepared.request_id] = task
            self._idle.clear()
            try:
                with (
                    structlog.contextvars.bound_contextvars(request_id=prepared.request_id),
                    tracer().start_as_current_span("generate") as span,
                ):
                    span.set_attribute("pdserve.request_id", prepared.request_id)
                    span.set_attribute("pdserve.prompt_tokens", state.num_prompt_tokens)
                    log.info(
                        "request_start",
                        prompt_tokens=state.num_prompt_tokens,
                        max_tokens=prepared.max_tokens.requested,
                        **(self._prompt_fields(inp) if self._settings.log_prompts else {}),
                    )
                    try:
                        frames = self.dispatcher.run(prepared, state, arrival_s + timeout_s)
                        async with contextlib.aclosing(frames):
                            async for frame in frames:
                                yield frame
                    except asyncio.CancelledError:
                        if task not in self._cancelled_by_drain:
                            raise  # the client went away
                        # We cancelled it (drain grace expired; workers got Abort): tell the client.
                        task.uncancel()
                        raise Unavailable(
                            "the gateway shut down before this request finished; retry it"
                        ) from None
                    finally:
                        self._log_end(state, span)
            finally:
                del self._in_flight[prepared.request_id]
                self._cancelled_by_drain.discard(task)
                if not self._in_flight:
                    self._idle.set()
                observe.record_finished(state)

    async def complete(self, inp: GenerateInput, client_timeout_s: float | None = None) -> Completion:
        """The same request life as generate, gathered into one response."""
        text: list[str] = []
        token_ids: list[int] = []
        logprobs: list[TokenLogprob] = []
        prompt: OutputFrame | None = None  # the frame with the prompt logprobs
        final: OutputFrame | None = None
        frames = self.generate(inp, client_timeout_s)
        async with contextlib.aclosing(frames):
            async for frame in frames:
                text.append(frame.text)
                token_ids.extend(frame.token_ids)
                logprobs.extend(frame.logprobs)
                if frame.prompt_token_ids:
                    prompt = frame
                if frame.kind is OutputFrameKind.FINAL:
                    final = frame
        assert final is not None and final.usage is not None and final.finish_reason is not None
        return Completion(
            final.request_id,
            "".join(text),
            tuple(token_ids),
            final.finish_reason,
            final.usage,
            final.model,
            tuple(logprobs),
            prompt.prompt_token_ids if prompt is not None else (),
            prompt.prompt_logprobs if prompt is not None else (),
        )

    async def list_models(self) -> list[ModelCard]:
        """Fresh from the scheduler (and cached for resolving budgets: model_cards.py)."""
        return await self.model_cards.fetch()

    # --- LoRA adapters at runtime ---
    async def load_lora_adapter(self, model: str, name: str, path: str) -> LoraUpdate:
        """Load the adapter in folder `path` as `name` into every worker of the base model
        `model` ("" = the served one), then refresh the model cards, so the next request may
        name it. PermissionDenied unless --allow-runtime-lora-updating."""
        admin = self._lora_admin_allowed()
        update = await admin.load(self._base_model(model), name, path)
        await self._refresh_model_cards()
        return update

    async def unload_lora_adapter(self, model: str, name: str) -> LoraUpdate:
        """Unload adapter `name` from the workers of the base model `model` ("" = the served
        one), then refresh the model cards. PermissionDenied unless allowed."""
        admin = self._lora_admin_allowed()
        update = await admin.unload(self._base_model(model), name)
        await self._refresh_model_cards()
        return update

    def _lora_admin_allowed(self) -> LoraAdmin:
        if not self._settings.allow_runtime_lora_updating:
            raise PermissionDenied(
                "loading and unloading LoRA adapters at runtime is off on this gateway; start it "
                "with --allow-runtime-lora-updating (env PDSERVE_ALLOW_RUNTIME_LORA_UPDATING=true)"
            )
        if self._lora_admin is None:
            raise FailedPrecondition("this gateway has no way to reach the workers' LoRA adapter calls")
        return self._lora_admin

    def _base_model(self, model: str) -> str:
        served = self._require_tokenizer().model_id
        if model and model != served:
            raise NotFound(f"the model {model!r} is not served here; this gateway serves {served!r}")
        return served

    async def _refresh_model_cards(self) -> None:
        try:
            await self.model_cards.fetch()
        except PdserveError as exc:  # the cards catch up at their next refresh (model_cards.py)
            log.warning("model_cards_fetch_failed", error=str(exc))

    @property
    def tool_call_format(self) -> Format:
        """How tool calls are written and read: --tool-call-parser, else the chat template's
        own format (hermes when it names none, or while the tokenizer loads)."""
        if self._settings.tool_call_parser:
            return cast(Format, self._settings.tool_call_parser)
        if self._tokenizer is None:
            return "hermes"
        return self._tokenizer.tool_call_format()

    @property
    def reasoning_parser(self) -> ReasoningKind | None:
        """--reasoning-parser: how chat output is split into reasoning and content (None: off)."""
        kind = self._settings.reasoning_parser
        return cast(ReasoningKind, kind) if kind else None

    def decode(self, token_ids: tuple[int, ...]) -> str:
        """Token ids' text (an echoed prompt given as token ids)."""
        return self._require_tokenizer().decode(token_ids)

    def output_text(self, token_ids: tuple[int, ...], skip_special_tokens: bool) -> str:
        """Generated ids' text as the workers write it (special tokens' text hidden unless
        skip_special_tokens is false): where a stop string is looked for (stop_reason.py)."""
        return self._require_tokenizer().decode(token_ids, skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """A generated token's text on its own (for logprobs)."""
        return self._require_tokenizer().token_text(token_id)

    # --- helpers ---
    def _require_tokenizer(self) -> PromptTokenizer:
        if self._tokenizer is None:
            raise Unavailable("the gateway is still loading the tokenizer; retry shortly")
        return self._tokenizer

    @staticmethod
    def _prompt_fields(inp: GenerateInput) -> dict[str, object]:
        """Only with --log-prompts: the client's input as given."""
        if inp.messages:
            return {"messages": [{"role": m.role, "content": m.content} for m in inp.messages]}
        if inp.prompt_token_ids:
            return {"prompt_token_ids": list(inp.prompt_token_ids)}
        return {"prompt": inp.prompt}

    def _log_end(self, state: RequestState, span: trace.Span) -> None:
        fields: dict[str, object] = {"status": state.status.name.lower(), "attempts": state.attempts}
        if state.status.is_finished and state.status is not RequestStatus.FAILED:
            usage = state.usage
            fields.update(
                finish_reason=state.finish_reason.value,
                prompt_tokens=usage.prompt_tokens,
                completion_tokens=usage.completion_tokens,
                cached_tokens=usage.cached_tokens,
                counts_reported=state.has_reported_counts,
            )
            span.set_attribute("pdserve.completion_tokens", usage.completion_tokens)
            span.set_attribute("pdserve.finish_reason", state.finish_reason.value)
        if self._settings.log_prompts:
            fields["completion"] = state.text
        log.info("request_end", **fields)
