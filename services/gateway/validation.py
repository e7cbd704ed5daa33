"""Validation of client requests: every problem becomes one INVALID_ARGUMENT (or NOT_FOUND) a
person can act on, raised before anything is started anywhere."""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import dataclass

from services.gateway.inputs import GenerateInput
from shared.errors import InvalidArgument, NotFound
from shared.structured_output import InvalidStructuredOutput, grammar_of

CHAT_ROLES = ("system", "user", "assistant", "tool")
MAX_REQUEST_ID_CHARS = 128


PENALTY_RANGE = (-2.0, 2.0)  # presence_penalty, frequency_penalty (OpenAI)
MAX_REPETITION_PENALTY = 2.0  # repetition_penalty in (0, 2] (vLLM)
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1  # priority travels as a protobuf int32
MAX_CACHE_SALT_CHARS = 256
TRUNCATION_SIDES = ("left", "right")  # vLLM's truncation_side values
LOGIT_BIAS_RANGE = (-100.0, 100.0)  # OpenAI
MAX_LOGIT_BIAS_ENTRIES = 1024
MAX_LOGPROBS = 20  # alternatives per token (OpenAI's top_logprobs limit)
# allowed_token_ids entries: every vocabulary in use fits (Gemma's 262144 is the largest)
MAX_ALLOWED_TOKEN_IDS = 262_144
MAX_BAD_WORDS = 128  # words, and token sequences once tokenized (vLLM's VLLM_MAX_NUM_BAD_WORDS)
MAX_BAD_WORD_CHARS = 256
MAX_BAD_WORDS_TOKENS = 1024  # all sequences together (vLLM's VLLM_MAX_BAD_WORDS_TOTAL_TOKENS)


class InvalidField(InvalidArgument):
    """INVALID_ARGUMENT about one request field, on both faces (the HTTP face reports it as
    OpenAI's error.param; None: about the request as a whole, e.g. a body that is not JSON)."""

    def __init__(self, message: str, param: str | None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Limits:
    max_stop_strings: int = 16
    max_stop_string_chars: int = 256


def validate_model(model: str, served_model: str, adapters: Collection[str] = ()) -> None:
    """NotFound unless `model` is empty, the served model's id or one of `adapters` (the LoRA
    adapters of the served model that workers list)."""
    if model and model != served_model and model not in adapters:
        served = repr(served_model)
        if adapters:
            served += f" and its LoRA adapters {sorted(adapters)}"
        raise NotFound(
            f"model {model!r} is not served here; this deployment serves {served} "
            "(ListModels lists them; leave model empty to use the base model)"
        )


def validate_input(
    req: GenerateInput, limits: Limits, served_model: str, adapters: Collection[str] = ()
) -> None:
    """Checks that need no tokenizer and no scheduler (`adapters`: the LoRA adapters `model` may
    name besides the served model). Raises InvalidArgument / NotFound."""
    validate_model(req.model, served_model, adapters)
    given = [
        name
        for name, present in (
            ("prompt", bool(req.prompt)),
            ("prompt_token_ids", bool(req.prompt_token_ids)),
            ("messages", bool(req.messages)),
        )
        if present
    ]
    if not given:
        raise InvalidArgument(
            "the request has no input: set exactly one of prompt, prompt_token_ids, messages"
        )
    if len(given) > 1:
        raise InvalidArgument(
            f"set exactly one of prompt, prompt_token_ids, messages; this request sets {' and '.join(given)}"
        )
    for i, turn in enumerate(req.messages):
        if turn.role not in CHAT_ROLES:
            raise InvalidArgument(
                f"messages[{i}].role is {turn.role!r}; it must be one of {', '.join(CHAT_ROLES)}"
            )
    if req.continue_final_message and not (req.messages and req.messages[-1].role == "assistant"):
        raise InvalidField(
            "continue_final_message continues the last message, which must be an assistant message "
            "(the start of the reply); send messages ending with one",
            "continue_final_message",
        )
    validate_prompt_logprobs(req)
    if req.temperature is not None and not (math.isfinite(req.temperature) and req.temperature >= 0):
        raise InvalidArgument(f"temperature must be a finite number >= 0 (0 = greedy), got {req.temperature}")
    if req.top_p is not None and not (math.isfinite(req.top_p) and 0 < req.top_p <= 1):
        raise InvalidArgument(f"top_p must be in (0, 1] (1 disables nucleus sampling), got {req.top_p}")
    if not INT32_MIN <= req.priority <= INT32_MAX:
        raise InvalidField(
            f"priority must be a 32-bit integer ({INT32_MIN} .. {INT32_MAX}; lower is served "
            f"first, 0 by default), got {req.priority}",
            "priority",
        )
    if len(req.cache_salt) > MAX_CACHE_SALT_CHARS:
        raise InvalidField(
            f"cache_salt is {len(req.cache_salt)} characters; the limit is {MAX_CACHE_SALT_CHARS}",
            "cache_salt",
        )
    if req.truncate_prompt_tokens is not None and req.truncate_prompt_tokens < 1:
        raise InvalidField(
            f"truncate_prompt_tokens must be >= 1 (the prompt tokens kept), got {req.truncate_prompt_tokens}",
            "truncate_prompt_tokens",
        )
    if req.truncation_side not in TRUNCATION_SIDES:
        raise InvalidField(
            f'truncation_side must be "left" (truncate_prompt_tokens keeps the prompt\'s last tokens, '
            f'the default) or "right" (its first tokens), got {req.truncation_side!r}',
            "truncation_side",
        )
    if req.min_p is not None and not (math.isfinite(req.min_p) and 0 <= req.min_p <= 1):
        raise InvalidField(f"min_p must be in [0, 1] (0 disables min-p sampling), got {req.min_p}", "min_p")
    if len(req.stop) > limits.max_stop_strings:
        raise InvalidArgument(
            f"at most {limits.max_stop_strings} stop strings are allowed, got {len(req.stop)}"
        )
    for i, s in enumerate(req.stop):
        if not s:
            raise InvalidArgument(f"stop[{i}] is empty; remove it or give a non-empty string")
        if len(s) > limits.max_stop_string_chars:
            raise InvalidArgument(
                f"stop[{i}] is {len(s)} characters; the limit is {limits.max_stop_string_chars}"
            )
    validate_request_id(req.request_id)
    validate_penalties(req)
    validate_token_bans(req)
    if req.structured is not None:
        try:
            grammar_of(req.structured)  # cached per constraint; the workers compile the same
        except InvalidStructuredOutput as exc:
            raise InvalidField(f"structured output ({req.structured.kind}): {exc}", "structured") from None
    if req.logprobs is not None and not 0 <= req.logprobs <= MAX_LOGPROBS:
        raise InvalidField(
            f"logprobs (alternatives per token) must be in [0, {MAX_LOGPROBS}], got {req.logprobs}",
            "logprobs",
        )


def validate_prompt_logprobs(req: GenerateInput) -> None:
    """prompt_logprobs' range, and max_tokens: >= 1, or 0 to only score the prompt (with
    prompt_logprobs)."""
    if req.prompt_logprobs is not None and not 0 <= req.prompt_logprobs <= MAX_LOGPROBS:
        raise InvalidField(
            f"prompt_logprobs (alternatives per prompt token) must be in [0, {MAX_LOGPROBS}], "
            f"got {req.prompt_logprobs}",
            "prompt_logprobs",
        )
    if req.max_tokens is None or req.max_tokens >= 1:
        return
    if req.max_tokens == 0 and req.prompt_logprobs is not None:
        return
    raise InvalidField(
        f"max_tokens must be >= 1 (or unset for the default), got {req.max_tokens}; 0 is allowed "
        "only to score the prompt (with prompt_logprobs; over HTTP, completions with echo)",
        "max_tokens",
    )


def validate_penalties(req: GenerateInput) -> None:
    """presence / frequency / repetition penalties, logit_bias values and min_tokens (the
    logit_bias token ids are checked against the vocabulary in validate_token_ids)."""
    lo, hi = PENALTY_RANGE
    for name, value in (
        ("presence_penalty", req.presence_penalty),
        ("frequency_penalty", req.frequency_penalty),
    ):
        if value is not None and not (math.isfinite(value) and lo <= value <= hi):
            raise InvalidField(f"{name} must be in [{lo:g}, {hi:g}] (0 = off), got {value}", name)
    rp = req.repetition_penalty
    if rp is not None and not (math.isfinite(rp) and 0 < rp <= MAX_REPETITION_PENALTY):
        raise InvalidField(
            f"repetition_penalty must be in (0, {MAX_REPETITION_PENALTY:g}] (1 = off), got {rp}",
            "repetition_penalty",
        )
    if len(req.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
        raise InvalidField(
            f"logit_bias has {len(req.logit_bias)} entries; the limit is {MAX_LOGIT_BIAS_ENTRIES}",
            "logit_bias",
        )
    lo, hi = LOGIT_BIAS_RANGE
    for token_id, bias in req.logit_bias:
        if token_id < 0:
            raise InvalidField(f"logit_bias has a negative token id {token_id}", "logit_bias")
        if not (math.isfinite(bias) and lo <= bias <= hi):
            raise InvalidField(
                f"logit_bias[{token_id}] must be in [{lo:g}, {hi:g}], got {bias}", "logit_bias"
            )
    if req.min_tokens is not None:
        if req.min_tokens < 0:
            raise InvalidField(f"min_tokens must be >= 0, got {req.min_tokens}", "min_tokens")
        if req.max_tokens is not None and req.min_tokens > req.max_tokens:
            raise InvalidField(
                f"min_tokens ({req.min_tokens}) must be <= max_tokens ({req.max_tokens})", "min_tokens"
            )


def validate_token_bans(req: GenerateInput) -> None:
    """allowed_token_ids' and bad_words' sizes (the ids are checked against the vocabulary in
    validate_token_ids, the words' tokens in validate_bad_word_sequences)."""
    allowed = req.allowed_token_ids
    if allowed is not None and not allowed:
        raise InvalidField(
            "allowed_token_ids is empty, which would allow no token at all; list the token ids "
            "that may be generated, or leave the field out",
            "allowed_token_ids",
        )
    if allowed is not None and len(allowed) > MAX_ALLOWED_TOKEN_IDS:
        raise InvalidField(
            f"allowed_token_ids has {len(allowed)} entries; the limit is {MAX_ALLOWED_TOKEN_IDS}",
            "allowed_token_ids",
        )
    if len(req.bad_words) > MAX_BAD_WORDS:
        raise InvalidField(
            f"bad_words has {len(req.bad_words)} words; the limit is {MAX_BAD_WORDS}", "bad_words"
        )
    for i, word in enumerate(req.bad_words):
        if not word.strip():
            raise InvalidField(f"bad_words[{i}] is empty; remove it or give a word", "bad_words")
        if len(word) > MAX_BAD_WORD_CHARS:
            raise InvalidField(
                f"bad_words[{i}] is {len(word)} characters; the limit is {MAX_BAD_WORD_CHARS}",
                "bad_words",
            )


def validate_bad_word_sequences(sequences: tuple[tuple[int, ...], ...]) -> None:
    """The tokenized bad words (both variants of each) within vLLM's limits."""
    if len(sequences) > MAX_BAD_WORDS:
        raise InvalidField(
            f"bad_words make {len(sequences)} token sequences once tokenized (each word as written "
            f"and after a space); the limit is {MAX_BAD_WORDS}",
            "bad_words",
        )
    num_tokens = sum(len(s) for s in sequences)
    if num_tokens > MAX_BAD_WORDS_TOKENS:
        raise InvalidField(
            f"bad_words are {num_tokens} tokens once tokenized (each word as written and after a "
            f"space); the limit is {MAX_BAD_WORDS_TOKENS}",
            "bad_words",
        )


def validate_request_id(request_id: str) -> None:
    if len(request_id) > MAX_REQUEST_ID_CHARS:
        raise InvalidArgument(
            f"request_id is {len(request_id)} characters; the limit is {MAX_REQUEST_ID_CHARS} "
            "(or leave it empty and the gateway assigns one)"
        )
    for i, ch in enumerate(request_id):
        if not (" " <= ch <= "~"):
            raise InvalidArgument(
                f"request_id must be printable ASCII; character {i} is {ch!r} "
                "(or leave it empty and the gateway assigns one)"
            )


def validate_vocab_ids(name: str, ids: tuple[int, ...], vocab_size: int) -> None:
    """Every id in [0, vocab_size); a refusal names the field `name` (as the client's API calls it)."""
    for i, t in enumerate(ids):
        if not 0 <= t < vocab_size:
            raise InvalidField(
                f"{name}[{i}] = {t} is not a token of the served model (vocabulary size {vocab_size})",
                name,
            )


def validate_token_ids(
    prompt_token_ids: tuple[int, ...],
    stop_token_ids: tuple[int, ...],
    vocab_size: int,
    logit_bias: tuple[tuple[int, float], ...] = (),
    allowed_token_ids: tuple[int, ...] = (),
) -> None:
    """Token ids the client sent must exist in the served model's vocabulary."""
    validate_vocab_ids("prompt_token_ids", prompt_token_ids, vocab_size)
    validate_vocab_ids("stop_token_ids", stop_token_ids, vocab_size)
    validate_vocab_ids("allowed_token_ids", allowed_token_ids, vocab_size)
    for t, _ in logit_bias:
        if t >= vocab_size:
            raise InvalidField(
                f"logit_bias has token id {t}, which is not a token of the served model "
                f"(vocabulary size {vocab_size})",
                "logit_bias",
            )
    if not prompt_token_ids:
        raise InvalidArgument("the prompt is empty after tokenization; send some text or token ids")


def resolve_max_tokens(
    requested: int | None, default_max_tokens: int, prompt_tokens: int, max_model_len: int
) -> int:
    """Effective max_tokens once the workers' max_model_len is known (0 = unknown, no limit).

    An explicit max_tokens must fit: prompt + max_tokens <= max_model_len. An unset one is the
    default, shortened to what fits.
    """
    if max_model_len <= 0:
        return requested if requested is not None else default_max_tokens
    room = max_model_len - prompt_tokens
    if room < 1:
        raise InvalidArgument(
            f"the prompt is {prompt_tokens} tokens; the model accepts at most {max_model_len} tokens "
            "of prompt + generation, so shorten the prompt"
        )
    if requested is None:
        return min(default_max_tokens, room)
    if requested > room:
        raise InvalidArgument(
            f"prompt ({prompt_tokens} tokens) + max_tokens ({requested}) exceeds the model's "
            f"max_model_len ({max_model_len}); set max_tokens <= {room} or shorten the prompt"
        )
    return requested
