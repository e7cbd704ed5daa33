"""The domain's results as OpenAI HTTP responses: a whole (non-streamed) chat or text completion,
usage over a request's choices, logprobs (vLLM's return_tokens_as_token_ids names tokens by id),
completions' echo (the prompt and its logprobs first), vLLM's prompt_logprobs, reasoning
(--reasoning-parser), tool calls, finish reasons, response ids and the model list. The streamed
form of the same results is `http_stream.py`."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from services.gateway import http_models as m
from services.gateway import reasoning, tool_calls
from services.gateway.accounting import Usage
from services.gateway.http_convert import Plan
from services.gateway.http_token_ids import ChoiceIds, OutputText
from services.gateway.inputs import GenerateInput, TokenLogprob
from services.gateway.ports import ModelCard
from services.gateway.reasoning import Decode
from services.gateway.request import Completion, OutputFrame
from services.gateway.tool_calls import ToolCall
from shared.cluster import FinishReason

# JSON has no -inf: a token top-k / top-p ruled out gets this logprob instead (as in vLLM)
LOGPROB_FLOOR = -9999.0


def finish_reason(reason: FinishReason | None) -> str | None:
    return None if reason is None else reason.value


def usage(plan: Plan, usages: Sequence[Usage], reasoning_tokens: Sequence[int] | None = None) -> m.Usage:
    """OpenAI's usage of all choices: each prompt counted once (its choices share it), completion
    tokens summed; cached_tokens of a prompt = the fewest any of its choices found cached;
    with `reasoning_tokens` (per choice: --reasoning-parser) completion_tokens_details too."""
    prompt_tokens = cached = completion = 0
    for group in sorted(set(plan.groups)):
        members = [u for g, u in zip(plan.groups, usages, strict=True) if g == group]
        prompt_tokens += members[0].prompt_tokens
        cached += min(u.cached_tokens for u in members)
    completion = sum(u.completion_tokens for u in usages)
    return m.Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion,
        total_tokens=prompt_tokens + completion,
        prompt_tokens_details=m.PromptTokensDetails(cached_tokens=cached),
        completion_tokens_details=(
            None
            if reasoning_tokens is None
            else m.CompletionTokensDetails(reasoning_tokens=sum(reasoning_tokens))
        ),
    )


def _logprob(value: float) -> float:
    return value if value > LOGPROB_FLOOR else LOGPROB_FLOOR  # -inf (and NaN) -> the floor


def token_id_name(token_id: int) -> str:
    """vLLM's return_tokens_as_token_ids name of a token (what verl and OpenRLHF parse)."""
    return f"token_id:{token_id}"


def token_names(plan: Plan, token_text: Callable[[int], str]) -> Callable[[int], str]:
    """How the plan's logprobs name tokens: by text, or (return_tokens_as_token_ids) by id."""
    return token_id_name if plan.return_tokens_as_token_ids else token_text


def chat_logprobs(
    logprobs: Sequence[TokenLogprob],
    token_text: Callable[[int], str],
    token_name: Callable[[int], str] | None = None,
) -> m.ChatLogprobs:
    """OpenAI chat's logprobs.content: per token its name (`token_name`, its text by default),
    the UTF-8 bytes of its text, logprob, alternatives."""

    def entry(token_id: int, value: float) -> m.TopLogprob:
        text = token_text(token_id)
        name = text if token_name is None else token_name(token_id)
        return m.TopLogprob(token=name, logprob=_logprob(value), bytes=list(text.encode()))

    content = []
    for lp in logprobs:
        chosen = entry(lp.token_id, lp.logprob)
        top = [entry(t, v) for t, v in lp.top]
        content.append(
            m.ChatTokenLogprob(
                token=chosen.token, logprob=chosen.logprob, bytes=chosen.bytes, top_logprobs=top
            )
        )
    return m.ChatLogprobs(content=content)


def completion_logprobs(
    logprobs: Sequence[TokenLogprob], token_text: Callable[[int], str], text_offset: int = 0
) -> m.CompletionLogprobs:
    """The legacy completions logprobs: parallel lists; text_offset counts characters of the
    token texts from `text_offset` (where the previous chunk's tokens ended)."""
    tokens = [token_text(lp.token_id) for lp in logprobs]
    offsets = []
    for text in tokens:
        offsets.append(text_offset)
        text_offset += len(text)
    return m.CompletionLogprobs(
        tokens=tokens,
        token_logprobs=[_logprob(lp.logprob) for lp in logprobs],
        top_logprobs=[{token_text(t): _logprob(v) for t, v in lp.top} for lp in logprobs],
        text_offset=offsets,
    )


def prompt_completion_logprobs(
    prompt_token_ids: Sequence[int],
    prompt_logprobs: Sequence[TokenLogprob],
    token_text: Callable[[int], str],
    top: int | None = None,
) -> m.CompletionLogprobs:
    """Echo's part of the legacy completions logprobs: every prompt token, the first with a null
    logprob and null alternatives (nothing precedes it; as OpenAI and vLLM), the others with
    their logprob and `top` alternatives (all the workers sent when None) under the raw model
    distribution. Empty without them."""
    if not prompt_logprobs:
        return m.CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
    if top is not None:  # the workers computed more for prompt_logprobs
        prompt_logprobs = [dataclasses.replace(lp, top=lp.top[:top]) for lp in prompt_logprobs]
    rest = completion_logprobs(prompt_logprobs, token_text, len(token_text(prompt_token_ids[0])))
    assert rest.top_logprobs is not None
    return m.CompletionLogprobs(
        tokens=[token_text(prompt_token_ids[0]), *rest.tokens],
        token_logprobs=[None, *rest.token_logprobs],
        top_logprobs=[None, *rest.top_logprobs],
        text_offset=[0, *rest.text_offset],
    )


def joined_logprobs(first: m.CompletionLogprobs, then: m.CompletionLogprobs) -> m.CompletionLogprobs:
    """Two runs of completions logprobs as one (echo: the prompt's, then the generated ones)."""
    return m.CompletionLogprobs(
        tokens=first.tokens + then.tokens,
        token_logprobs=first.token_logprobs + then.token_logprobs,
        top_logprobs=(first.top_logprobs or []) + (then.top_logprobs or []),
        text_offset=first.text_offset + then.text_offset,
    )


def echo_text(inp: GenerateInput, decode: Callable[[tuple[int, ...]], str]) -> str:
    """The echoed prompt: the string the client sent, or its token ids' text."""
    return inp.prompt if inp.prompt else decode(inp.prompt_token_ids)


def echoes(plan: Plan, decode: Callable[[tuple[int, ...]], str]) -> list[str] | None:
    """Completions with echo: each choice's prompt text (None without echo); "" with vLLM's
    return_token_ids, as vLLM (the prompt is in prompt_token_ids; its logprobs stay)."""
    if not plan.echo:
        return None
    if plan.return_token_ids:
        return [""] * len(plan.inputs)
    return [echo_text(inp, decode) for inp in plan.inputs]


def echoed_logprobs(
    c: Completion | OutputFrame,
    token_text: Callable[[int], str],
    generated: m.CompletionLogprobs,
    top: int | None = None,
) -> m.CompletionLogprobs:
    """Echo with logprobs: the prompt tokens' entries (`top` alternatives each), then the
    generated ones (whose text_offset continues after the prompt's token texts)."""
    prompt = prompt_completion_logprobs(c.prompt_token_ids, c.prompt_logprobs, token_text, top)
    shift = sum(len(t) for t in prompt.tokens)
    generated = generated.model_copy(update={"text_offset": [o + shift for o in generated.text_offset]})
    return joined_logprobs(prompt, generated)


def _text_logprobs(
    c: Completion, token_text: Callable[[int], str], echo: bool, top: int | None
) -> m.CompletionLogprobs:
    """A completions choice's logprobs (with echo, the prompt's first, `top` alternatives each)."""
    generated = completion_logprobs(c.logprobs, token_text)
    return echoed_logprobs(c, token_text, generated, top) if echo else generated


def _prompt_entry(
    token_id: int, value: float, rank: int | None, token_text: Callable[[int], str]
) -> m.PromptLogprob:
    text = token_text(token_id)
    return m.PromptLogprob(logprob=_logprob(value), rank=rank, decoded_token=text)


def prompt_logprobs(c: Completion, top: int, token_text: Callable[[int], str]) -> m.PromptLogprobs:
    """vLLM's prompt_logprobs: null for the first prompt token (nothing precedes it), then per
    prompt token {token id: its logprob, rank and text, then its `top` alternatives' (most
    likely first, ranks 1..top)} under the raw model distribution; -inf as -9999.0. A prompt
    token among the alternatives has its place there (vLLM's dict keeps the alternative's entry,
    which only differs from the worker's rank on a tie), any other the worker's rank (1 + the
    tokens more likely than it, as vLLM's), None from a worker older than 1.18, which sends
    none. Token texts stay texts with return_tokens_as_token_ids (as in vLLM)."""
    out: m.PromptLogprobs = [None]
    for lp in c.prompt_logprobs:
        alternatives = lp.top[:top]
        ranks = {t: r for r, (t, _) in enumerate(alternatives, start=1)}
        rank = ranks.get(lp.token_id, lp.rank)
        entry = {lp.token_id: _prompt_entry(lp.token_id, lp.logprob, rank, token_text)}
        for t, value in alternatives:
            if t not in entry:
                entry[t] = _prompt_entry(t, value, ranks[t], token_text)
        out.append(entry)
    return out


def response_tool_calls(calls: Sequence[tool_calls.ToolCall]) -> list[m.ResponseToolCall]:
    return [
        m.ResponseToolCall(id=c.id, function=m.ResponseFunctionCall(name=c.name, arguments=c.arguments))
        for c in calls
    ]


def chat_finish_reason(reason: str, called: bool) -> str:
    """OpenAI's finish_reason: tool_calls when the model stopped after calling tools."""
    return "tool_calls" if called and reason == FinishReason.STOP.value else reason


def reasoning_tokens(plan: Plan, token_ids: tuple[int, ...], completion_tokens: int, decode: Decode) -> int:
    """One choice's reasoning tokens (plan.reasoning set)."""
    assert plan.reasoning is not None
    return reasoning.reasoning_tokens(plan.reasoning, token_ids, completion_tokens, decode)


def chat_message(plan: Plan, text: str) -> tuple[m.AssistantMessage, bool]:
    """A whole chat output as its message (the reasoning split off, then tool calls parsed from
    the content only) and whether it called a tool. With a reasoning section, empty content is
    null (as vLLM's), and so is empty reasoning."""
    thought: str | None = None
    if plan.reasoning is not None:
        found = reasoning.split(text, plan.reasoning)
        text, thought = found.content, found.reasoning
    content: str | None = text
    calls: list[ToolCall] = []
    if plan.tools is not None:
        content, calls = tool_calls.parse(text, plan.tools.fmt, plan.tools.forced, plan.tools.tools)
    called = response_tool_calls(calls) or None
    if plan.reasoning is not None and thought is not None and not content:
        content = None
    if plan.chat_echo is not None:  # vLLM's: the echo goes before the parsed content, as is
        content = plan.chat_echo + (content or "")
    if plan.reasoning is None:
        return m.AssistantMessage(role=plan.role, content=content, tool_calls=called), bool(calls)
    message = m.ReasoningMessage(
        role=plan.role, content=content, tool_calls=called, reasoning_content=thought or None
    )
    return message, bool(calls)


def chat_id(request_id: str) -> str:
    return f"chatcmpl-{request_id}"


def completion_id(request_id: str) -> str:
    return f"cmpl-{request_id}"


def model_list(cards: Sequence[ModelCard], created: int) -> m.ModelList:
    return m.ModelList(
        data=[
            m.ModelCard(
                id=c.id,
                created=created,
                root=c.id,
                parent=c.parent or None,
                max_model_len=c.max_model_len or None,
            )
            for c in cards
        ]
    )


def completion_body(
    plan: Plan,
    done: list[Completion],
    request_id: str,
    created: int,
    chat: bool,
    token_text: Callable[[int], str],
    echoes: list[str] | None = None,
    decode: Decode | None = None,
    output_text: OutputText | None = None,
) -> m.ChatCompletion | m.Completion:
    """`decode` (token ids -> text): needed with plan.reasoning, to count reasoning tokens;
    `output_text` (ids -> the workers' text): where vLLM's stop_reason is read when the request
    has stop strings (http_token_ids)."""
    extras = [ChoiceIds.of(plan, i, c, output_text or (lambda ids, skip: "")) for i, c in enumerate(done)]
    thought_tokens = None
    if plan.reasoning is not None:
        assert decode is not None
        thought_tokens = [
            reasoning_tokens(plan, c.token_ids, c.usage.completion_tokens, decode) for c in done
        ]
    total = usage(plan, [c.usage for c in done], thought_tokens)
    model = done[0].model
    wants = [inp.logprobs is not None for inp in plan.inputs]
    name = token_names(plan, token_text)
    shown = plan.prompt_logprobs
    if chat:
        choices = []
        for i, c in enumerate(done):
            message, called = chat_message(plan, c.text)
            choices.append(
                m.ChatChoice(
                    index=i,
                    message=message,
                    finish_reason=chat_finish_reason(c.finish_reason.value, called),
                    logprobs=chat_logprobs(c.logprobs, token_text, name) if wants[i] else None,
                    stop_reason=extras[i].stop_reason,
                    token_ids=extras[i].token_ids,
                )
            )
        return m.ChatCompletion(
            id=chat_id(request_id),
            created=created,
            model=model,
            choices=choices,
            usage=total,
            # every choice ran the same prompt: the first one's
            prompt_logprobs=None if shown is None else prompt_logprobs(done[0], shown, token_text),
            prompt_token_ids=extras[0].prompt_token_ids,
        )
    return m.Completion(
        id=completion_id(request_id),
        created=created,
        model=model,
        choices=[
            m.CompletionChoice(
                index=i,
                text=(echoes[i] if echoes else "") + c.text,
                finish_reason=c.finish_reason.value,
                logprobs=(
                    _text_logprobs(c, name, bool(echoes), plan.inputs[i].logprobs) if wants[i] else None
                ),
                prompt_logprobs=None if shown is None else prompt_logprobs(c, shown, token_text),
                stop_reason=extras[i].stop_reason,
                prompt_token_ids=extras[i].prompt_token_ids,
                token_ids=extras[i].token_ids,
            )
            for i, c in enumerate(done)
        ],
        usage=total,
    )
