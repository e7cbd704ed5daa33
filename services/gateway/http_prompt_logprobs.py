"""Which prompt logprobs an OpenAI HTTP request asks the workers for, and how many alternatives its
response shows: vLLM's `prompt_logprobs` (completions and chat) and completions' `echo` with
`logprobs` (prompt scoring) share the workers' one `prompt_logprobs` count (the larger of the
two; each view shows its own number of alternatives). The response side (vLLM's entries) is
`http_responses.prompt_logprobs`."""

from __future__ import annotations

from typing import NamedTuple

from services.gateway import http_models as m
from services.gateway.validation import MAX_LOGPROBS, InvalidField

MAX_PROMPT_LOGPROBS = MAX_LOGPROBS  # the gRPC API's limit, and vLLM's default --max-logprobs


class PromptLogprobs(NamedTuple):
    """A request's prompt logprobs: `to_workers` alternatives per prompt token computed (None:
    none computed), `shown` of them in the response's `prompt_logprobs` (None: no such field)."""

    to_workers: int | None
    shown: int | None


def asked(req: m._GenerationRequest) -> int | None:
    """The client's prompt_logprobs, checked as vLLM checks it: 0-20 alternatives (vLLM's -1, the
    whole vocabulary, is over that limit, as in vLLM with its default --max-logprobs); a streamed
    request may not ask for alternatives (its chunks have no place for them; 0 is accepted and
    shows nothing, as in vLLM). None when nothing is to be shown."""
    k = req.prompt_logprobs
    if k is None:
        return None
    if k == -1:
        raise InvalidField(
            f"prompt_logprobs -1 (every token of the vocabulary) is over the limit of "
            f"{MAX_PROMPT_LOGPROBS} alternatives per prompt token; ask for 0-{MAX_PROMPT_LOGPROBS}",
            "prompt_logprobs",
        )
    if not 0 <= k <= MAX_PROMPT_LOGPROBS:
        raise InvalidField(
            f"prompt_logprobs (alternatives per prompt token) must be in [0, {MAX_PROMPT_LOGPROBS}], got {k}",
            "prompt_logprobs",
        )
    if req.stream:
        if k > 0:
            raise InvalidField(
                "prompt_logprobs are not available with stream: true (as in vLLM); send the "
                "request unstreamed, or leave prompt_logprobs out",
                "prompt_logprobs",
            )
        return None
    return k


def chat(req: m.ChatCompletionRequest) -> PromptLogprobs:
    """Chat: the response's top-level prompt_logprobs (max_tokens may then be 0: only the
    prompt runs)."""
    k = asked(req)
    return PromptLogprobs(k, k)


def completion(req: m.CompletionRequest) -> PromptLogprobs:
    """Completions: prompt_logprobs, and echo (as in OpenAI and vLLM, also with n > 1 and
    stream): with logprobs k the echoed prompt's tokens get theirs too (k alternatives each),
    and (as in vLLM) the choice's prompt_logprobs shows them when prompt_logprobs is unset;
    max_tokens 0 only scores the prompt (then the domain needs prompt logprobs, 0 alternatives
    when logprobs is unset). max_tokens 0 needs echo or prompt_logprobs."""
    k = asked(req)
    echo: int | None = None
    if req.echo:
        if req.logprobs is not None:
            echo = req.logprobs
        elif req.max_tokens == 0:
            echo = 0
    elif req.max_tokens == 0 and k is None:
        raise InvalidField(
            "max_tokens 0 is only allowed with echo: true or prompt_logprobs (to score the "
            "prompt); set max_tokens >= 1 or leave it unset",
            "max_tokens",
        )
    if k is None and req.echo and not req.stream:
        k = req.logprobs  # vLLM computes echo's as prompt_logprobs, and shows them as such
    wanted = [n for n in (k, echo) if n is not None]
    return PromptLogprobs(max(wanted) if wanted else None, k)
