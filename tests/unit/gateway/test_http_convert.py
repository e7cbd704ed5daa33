"""OpenAI JSON -> the gateway's domain inputs, usage of several choices, errors -> HTTP statuses."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import grpc
import pytest

from services.gateway import http_convert as conv
from services.gateway import http_errors as herr
from services.gateway import http_models as m
from services.gateway import http_responses as resp
from services.gateway.accounting import CacheStats, Usage
from services.gateway.inputs import ChatTurn, TokenLogprob
from services.gateway.request import Completion
from services.gateway.validation import InvalidField
from shared import errors
from shared.cluster import FinishReason
from shared.structured_output import StructuredOutput


def chat(**kw: Any) -> conv.Plan:
    body = {"messages": [{"role": "user", "content": "hi"}], **kw}
    return conv.chat_plan(m.ChatCompletionRequest.model_validate(body, strict=False), "rid")


def completion(**kw: Any) -> conv.Plan:
    return conv.completion_plan(m.CompletionRequest.model_validate(kw, strict=False), "rid")


def test_chat_becomes_the_grpc_input() -> None:
    plan = chat(
        messages=[
            {"role": "developer", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        ],
        max_completion_tokens=7,
        temperature=0.5,
        top_p=0.9,
        top_k=-1,
        seed=3,
        stop="END",
        ignore_eos=True,
    )
    (inp,) = plan.inputs
    assert inp.messages == (ChatTurn("system", "be brief"), ChatTurn("user", "a\nb"))
    # top_k -1 is vLLM's explicit "no top-k" (0): the model's default top_k does not apply
    assert (inp.max_tokens, inp.temperature, inp.top_p, inp.top_k, inp.seed) == (7, 0.5, 0.9, 0, 3)
    assert inp.stop == ("END",) and inp.ignore_eos and inp.request_id == "rid"
    assert not plan.stream and not plan.include_usage


def test_n_and_prompts_fan_out_with_derived_seeds() -> None:
    plan = completion(prompt=["a", "b"], n=2, seed=5, stream=True, stream_options={"include_usage": True})
    assert [i.prompt for i in plan.inputs] == ["a", "a", "b", "b"]
    assert plan.groups == (0, 0, 1, 1) and plan.include_usage
    assert [i.request_id for i in plan.inputs] == ["rid-0", "rid-1", "rid-2", "rid-3"]
    seeds = [i.seed for i in plan.inputs]
    assert seeds[0] == seeds[2] == 5 and seeds[1] == seeds[3] != 5
    assert all(0 <= s < 2**64 for s in seeds if s is not None)
    assert completion(prompt=[1, 2, 3]).inputs[0].prompt_token_ids == (1, 2, 3)
    assert [i.prompt_token_ids for i in completion(prompt=[[1], [2, 3]]).inputs] == [(1,), (2, 3)]
    assert completion(prompt="x", n=3).inputs[2].seed is None  # no seed: none derived


@pytest.mark.parametrize(
    ("kw", "param"),
    [
        ({"n": 0}, "n"),
        ({"n": 65}, "n"),
        ({"seed": -1}, "seed"),
        ({"top_k": -2}, "top_k"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"max_tokens": 3, "max_completion_tokens": 4}, "max_completion_tokens"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages"),
        ({"messages": [{"role": "user"}]}, "messages"),
    ],
)
def test_chat_refusals_name_the_field(kw: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidField) as err:
        chat(**kw)
    assert err.value.param == param


def test_penalties_bias_and_min_tokens_reach_the_domain_input() -> None:
    (inp,) = chat(
        presence_penalty=0.5,
        frequency_penalty=-1,
        repetition_penalty=1.2,
        logit_bias={"7": 5, "12": -100.0},
        min_tokens=3,
    ).inputs
    assert (inp.presence_penalty, inp.frequency_penalty, inp.repetition_penalty) == (0.5, -1.0, 1.2)
    assert inp.logit_bias == ((7, 5.0), (12, -100.0)) and inp.min_tokens == 3
    (plain,) = completion(prompt="x").inputs
    assert plain.logit_bias == () and plain.min_tokens is None and plain.presence_penalty is None
    with pytest.raises(InvalidField) as err:
        chat(logit_bias={"seven": 1})
    assert err.value.param == "logit_bias"


def test_logprobs_fields_and_their_json() -> None:
    assert chat(logprobs=True, top_logprobs=5).inputs[0].logprobs == 5
    assert chat(logprobs=True).inputs[0].logprobs == 0
    assert chat(logprobs=False).inputs[0].logprobs is None
    assert chat(top_logprobs=0).inputs[0].logprobs is None
    assert completion(prompt="x", logprobs=3).inputs[0].logprobs == 3
    for kw in (
        {"top_logprobs": 2},
        {"logprobs": True, "top_logprobs": 21},
        {"logprobs": True, "top_logprobs": -1},
    ):
        with pytest.raises(InvalidField) as err:
            chat(**kw)
        assert err.value.param == "top_logprobs"
    texts = {1: "a", 2: "bc", 3: "\u00e9"}
    lps = [TokenLogprob(1, -0.5, ((1, -0.5), (2, float("-inf")))), TokenLogprob(3, -1.25, ())]
    body = resp.chat_logprobs(lps, texts.__getitem__)
    assert body.content is not None and [e.token for e in body.content] == ["a", "\u00e9"]
    assert body.content[0].top_logprobs[1].logprob == resp.LOGPROB_FLOOR  # JSON has no -inf
    assert body.content[1].bytes == [0xC3, 0xA9]
    legacy = resp.completion_logprobs(lps, texts.__getitem__, text_offset=10)
    assert legacy.tokens == ["a", "\u00e9"] and legacy.token_logprobs == [-0.5, -1.25]
    assert legacy.top_logprobs == [{"a": -0.5, "bc": resp.LOGPROB_FLOOR}, {}]
    assert legacy.text_offset == [10, 11]


def test_response_format_and_guided_fields_become_a_constraint() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    (inp,) = chat(
        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    ).inputs
    assert inp.structured == StructuredOutput("json_schema", json.dumps(schema))
    assert chat(response_format={"type": "json_object"}).inputs[0].structured == StructuredOutput(
        "json_object"
    )
    assert chat(response_format={"type": "text"}).inputs[0].structured is None
    assert completion(prompt="x", guided_regex="a+").inputs[0].structured == StructuredOutput("regex", "a+")
    assert completion(prompt="x", guided_choice=["a", "b"]).inputs[0].structured == StructuredOutput(
        "choice", choices=("a", "b")
    )
    assert completion(prompt="x", guided_json=schema).inputs[0].structured == StructuredOutput(
        "json_schema", json.dumps(schema)
    )
    for kw, param in (
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": []}}}, "response_format"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": 3}}}},
            "response_format",
        ),
        ({"guided_regex": "("}, "guided_regex"),
        ({"guided_json": "{"}, "guided_json"),
        ({"guided_choice": ["a", ""]}, "guided_choice"),
        ({"guided_json": schema, "response_format": {"type": "json_object"}}, "guided_json"),
    ):
        with pytest.raises(InvalidField) as err:
            chat(**kw)
        assert err.value.param == param, kw


def test_completion_refusals() -> None:
    for prompt in ([], [-1]):
        with pytest.raises(InvalidField):
            completion(prompt=prompt)
    with pytest.raises(InvalidField, match="choices"):
        completion(prompt=["a"] * 9, n=8)


def test_echo_plan_and_prompt_logprobs_layout() -> None:
    """echo: logprobs k asks the prompt's too; max_tokens 0 only with echo (then prompt logprobs,
    0 alternatives without logprobs); the prompt's entries: the first token null, then each
    with its alternatives, offsets over the token texts."""
    plan = completion(prompt="ab", echo=True, logprobs=2, max_tokens=0)
    assert plan.echo and plan.inputs[0].prompt_logprobs == 2 and plan.inputs[0].max_tokens == 0
    assert completion(prompt="ab", echo=True, max_tokens=0).inputs[0].prompt_logprobs == 0
    assert completion(prompt="ab", echo=True).inputs[0].prompt_logprobs is None
    assert not completion(prompt="ab").echo
    with pytest.raises(InvalidField, match="only allowed with echo") as err:
        completion(prompt="ab", max_tokens=0)
    assert err.value.param == "max_tokens"
    assert resp.echo_text(plan.inputs[0], lambda ids: "never") == "ab"
    text = {1: "a", 2: "bc", 3: "d"}
    lp = resp.prompt_completion_logprobs(
        (1, 2, 3), (TokenLogprob(2, -1.0, ((3, -0.5),)), TokenLogprob(3, -float("inf"))), text.__getitem__
    )
    assert lp.tokens == ["a", "bc", "d"] and lp.text_offset == [0, 1, 3]
    assert lp.token_logprobs == [None, -1.0, resp.LOGPROB_FLOOR]
    assert lp.top_logprobs == [None, {"d": -0.5}, {}]
    assert resp.prompt_completion_logprobs((1,), (), text.__getitem__).tokens == []


def test_vllm_prompt_logprobs_token_ids_and_continuous_usage_plans() -> None:
    """prompt_logprobs 0-20 (chat and completions; max_tokens 0 then scores the prompt only);
    with echo the workers compute the larger count and a completions choice shows echo's as
    vLLM does; streamed, only 0 (which shows nothing); return_tokens_as_token_ids and
    continuous_usage_stats (only with include_usage, as vLLM) reach the plan."""
    plan = chat(prompt_logprobs=3, max_tokens=0)
    assert plan.prompt_logprobs == 3 and plan.inputs[0].prompt_logprobs == 3
    assert chat().prompt_logprobs is None and chat().inputs[0].prompt_logprobs is None
    scored = completion(prompt="ab", prompt_logprobs=0, max_tokens=0)
    assert (scored.prompt_logprobs, scored.inputs[0].prompt_logprobs) == (0, 0)
    both = completion(prompt="ab", echo=True, logprobs=2, prompt_logprobs=5)
    assert (both.prompt_logprobs, both.inputs[0].prompt_logprobs) == (5, 5)
    echoed = completion(prompt="ab", echo=True, logprobs=2)
    assert (echoed.prompt_logprobs, echoed.inputs[0].prompt_logprobs) == (2, 2)
    streamed = completion(prompt="ab", echo=True, logprobs=2, stream=True, prompt_logprobs=0)
    assert (streamed.prompt_logprobs, streamed.inputs[0].prompt_logprobs) == (None, 2)
    assert chat(stream=True, prompt_logprobs=0).inputs[0].prompt_logprobs is None
    for kw, words in (
        ({"prompt_logprobs": -1}, "every token of the vocabulary"),
        ({"prompt_logprobs": 21}, "[0, 20]"),
        ({"prompt_logprobs": -2}, "[0, 20]"),
        ({"prompt_logprobs": 1, "stream": True}, "stream"),
    ):
        for make in (chat, lambda **k: completion(prompt="ab", **k)):
            with pytest.raises(InvalidField) as err:
                make(**kw)
            assert err.value.param == "prompt_logprobs" and words in str(err.value), kw
    assert not chat().return_tokens_as_token_ids
    named = completion(prompt="ab", return_tokens_as_token_ids=True)
    assert resp.token_names(named, lambda t: "text")(42) == "token_id:42"
    usage = {"include_usage": True, "continuous_usage_stats": True}
    continuous = chat(stream=True, stream_options=usage, n=2)
    assert continuous.continuous_usage and all(i.continuous_usage for i in continuous.inputs)
    assert not chat(stream=True).inputs[0].continuous_usage
    assert not chat(stream=True, stream_options={"continuous_usage_stats": True}).continuous_usage
    assert not chat(stream=True, stream_options={"include_usage": True}).continuous_usage


def test_prompt_logprobs_and_token_id_names_in_the_json() -> None:
    """vLLM's prompt_logprobs: null first, then {token id: logprob, rank, decoded_token} with
    the prompt token first (its rank the worker's; among the alternatives, its place there, as
    vLLM; from a worker older than 1.18, which sends no rank, null outside them) and the
    alternatives trimmed to the count asked; left out of a response that did not ask.
    return_tokens_as_token_ids names logprobs' tokens by id, bytes stay the text's."""
    text = {1: "a", 2: "bc", 3: "\u00e9"}
    done = Completion(
        "rid",
        "x",
        (3,),
        FinishReason.STOP,
        Usage(3, 1, CacheStats()),
        "m",
        logprobs=(TokenLogprob(3, -0.25, ((3, -0.25), (1, -2.0))),),
        prompt_token_ids=(1, 2, 3, 1, 2),
        prompt_logprobs=(
            TokenLogprob(2, -1.0, ((3, -0.5), (2, -1.0), (1, -3.0))),  # an older worker: no rank
            TokenLogprob(3, -float("inf"), ((1, -0.1),)),
            TokenLogprob(1, -4.0, ((3, -0.5), (2, -1.0), (1, -4.0)), rank=7),  # outside the 2 shown
            TokenLogprob(2, -1.0, ((3, -1.0), (2, -1.0)), rank=1),  # tied with the first: its place
        ),
    )
    plan = dataclasses.replace(chat(logprobs=True, top_logprobs=1), prompt_logprobs=2)
    body = resp.completion_body(plan, [done], "rid", 5, True, text.__getitem__)
    dumped = json.loads(body.model_dump_json())
    assert dumped["prompt_logprobs"] == [
        None,
        {
            "2": {"logprob": -1.0, "rank": 2, "decoded_token": "bc"},
            "3": {"logprob": -0.5, "rank": 1, "decoded_token": "\u00e9"},
        },
        {
            "3": {"logprob": resp.LOGPROB_FLOOR, "rank": None, "decoded_token": "\u00e9"},
            "1": {"logprob": -0.1, "rank": 1, "decoded_token": "a"},
        },
        {
            "1": {"logprob": -4.0, "rank": 7, "decoded_token": "a"},
            "3": {"logprob": -0.5, "rank": 1, "decoded_token": "\u00e9"},
            "2": {"logprob": -1.0, "rank": 2, "decoded_token": "bc"},
        },
        {
            "2": {"logprob": -1.0, "rank": 2, "decoded_token": "bc"},
            "3": {"logprob": -1.0, "rank": 1, "decoded_token": "\u00e9"},
        },
    ]
    named = dataclasses.replace(plan, return_tokens_as_token_ids=True, prompt_logprobs=None)
    body = resp.completion_body(named, [done], "rid", 5, True, text.__getitem__)
    assert "prompt_logprobs" not in json.loads(body.model_dump_json())
    assert isinstance(body, m.ChatCompletion)
    (entry,) = body.choices[0].logprobs.content or []  # type: ignore[union-attr]
    assert entry.token == "token_id:3" and entry.bytes == [0xC3, 0xA9]
    assert [t.token for t in entry.top_logprobs] == ["token_id:3", "token_id:1"]
    # completions: per choice; echo's prompt part shows the logprobs count, the field its own
    echo = dataclasses.replace(completion(prompt="ab", echo=True, logprobs=1), prompt_logprobs=2)
    legacy = resp.completion_body(echo, [done], "rid", 5, False, text.__getitem__, ["ab"])
    assert isinstance(legacy, m.Completion)
    choice = legacy.choices[0]
    assert choice.logprobs is not None and choice.logprobs.top_logprobs is not None
    assert choice.logprobs.top_logprobs[:3] == [None, {"\u00e9": -0.5}, {"a": -0.1}]
    assert choice.prompt_logprobs is not None and len(choice.prompt_logprobs) == 5
    assert choice.prompt_logprobs[3] is not None and choice.prompt_logprobs[3][1].rank == 7


def test_chat_echo_and_the_replys_role_as_vllm() -> None:
    """The reply's role: assistant after a generation prompt, else the last message's; echo
    starts the content with the last message's text when it has that role (parts joined as
    the prompt joins them), after the parsed content, also when that content is null."""
    said = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": [{"type": "text", "text": "A"}, {"type": "text", "text": "B"}]},
    ]
    cont = chat(messages=said, echo=True, add_generation_prompt=False, continue_final_message=True)
    assert (cont.role, cont.chat_echo) == ("assistant", "A\nB")
    assert (chat(echo=True).role, chat(echo=True).chat_echo) == ("assistant", "")
    assert (chat().role, chat().chat_echo) == ("assistant", None)
    as_user = chat(echo=True, add_generation_prompt=False)
    assert (as_user.role, as_user.chat_echo) == ("user", "hi")
    message, _ = resp.chat_message(cont, " C")
    assert (message.role, message.content) == ("assistant", "A\nB C")
    message, _ = resp.chat_message(dataclasses.replace(cont, chat_echo=""), "")
    assert message.content == ""


def test_unsupported_fields_refused_unknown_ignored() -> None:
    assert conv.unsupported_and_unknown({"echo": False, "tools": [], "vendor_x": 1}) == ["vendor_x"]
    assert conv.unsupported_and_unknown({"tool_choice": "none", "best_of": 1}) == []
    for name, value in (
        ("echo", True),  # on the Responses API (chat and completions declare it)
        ("tools", [{"type": "function"}]),
        ("suffix", "def f():"),
    ):
        with pytest.raises(InvalidField) as err:
            conv.unsupported_and_unknown({name: value})
        assert err.value.param == name and name in str(err.value)


def test_usage_counts_each_prompt_once() -> None:
    plan = completion(prompt=["a", "b"], n=2)
    usages = [
        Usage(10, 3, CacheStats(4, 0)),
        Usage(10, 5, CacheStats(8, 0)),
        Usage(6, 1, CacheStats(0, 4)),
        Usage(6, 2, CacheStats(0, 4)),
    ]
    u = resp.usage(plan, usages)
    assert (u.prompt_tokens, u.completion_tokens, u.total_tokens) == (16, 11, 27)
    assert u.prompt_tokens_details.cached_tokens == 4 + 4


@pytest.mark.parametrize(
    ("exc", "status", "retry_after"),
    [
        (errors.InvalidArgument("bad"), 400, False),
        (errors.NotFound("model 'x' is not served here"), 404, False),
        (errors.AlreadyExists("dup"), 409, False),
        (errors.ResourceExhausted("full"), 429, True),
        (errors.Unavailable("down"), 503, True),
        (errors.DeadlineExceeded("late"), 504, False),
        (errors.FailedPrecondition("inner detail"), 500, False),
        (RuntimeError("secret detail"), 500, False),
    ],
)
def test_errors_map_to_http(exc: Exception, status: int, retry_after: bool) -> None:
    e = herr.http_error(exc)
    assert e.status == status
    assert ("Retry-After" in e.headers) == retry_after
    if status == 500:
        assert "detail" not in e.body.error.message and e.is_internal
    else:
        assert e.body.error.message == str(exc)
    unknown_model = herr.http_error(errors.NotFound("model 'x' is not served here")).body.error
    assert (unknown_model.param, unknown_model.code) == ("model", "model_not_found")  # OpenAI's
    assert herr.HTTP_BY_STATUS[grpc.StatusCode.UNAUTHENTICATED][0] == 401


def test_allowed_token_ids_and_bad_words_reach_the_domain_input() -> None:
    """vLLM's fields on both endpoints (ranges and the vocabulary are the domain's checks: an
    empty list stays one, to be refused there as vLLM does)."""
    for plan in (
        completion(prompt="ab", allowed_token_ids=[5, 3, 5], bad_words=["x", " y"]),
        chat(allowed_token_ids=[5, 3, 5], bad_words=["x", " y"]),
    ):
        inp = plan.inputs[0]
        assert inp.allowed_token_ids == (5, 3, 5) and inp.bad_words == ("x", " y")
    assert completion(prompt="ab", allowed_token_ids=[]).inputs[0].allowed_token_ids == ()
    unset = chat().inputs[0]
    assert unset.allowed_token_ids is None and unset.bad_words == ()


def test_retry_after_follows_the_admission_hint() -> None:
    from services.gateway.admission import Overloaded

    assert herr.http_error(Overloaded("busy", 2.5)).headers == {"Retry-After": "3"}
    assert herr.http_error(Overloaded("busy", 0.2)).headers == {"Retry-After": "1"}
    assert herr.http_error(Overloaded("busy", 2.5)).status == 429


def test_return_token_ids_stop_reason_and_truncation_side() -> None:
    """return_token_ids shows the ids (completions per choice, chat's prompt at the top level);
    the workers return them also when only a stop_reason needs them; echo's text leaves the
    prompt out then (vLLM's). truncation_side reaches the domain input ("left" by default)."""
    asked = completion(prompt="ab", return_token_ids=True, truncate_prompt_tokens=2, truncation_side="right")
    assert asked.return_token_ids and asked.inputs[0].return_token_ids
    assert (asked.inputs[0].truncate_prompt_tokens, asked.inputs[0].truncation_side) == (2, "right")
    assert completion(prompt="ab").inputs[0].truncation_side == "left"
    stops = completion(prompt="ab", stop="x")
    assert not stops.return_token_ids and stops.inputs[0].return_token_ids  # for stop_reason
    assert not completion(prompt="ab").inputs[0].return_token_ids
    assert resp.echoes(dataclasses.replace(asked, echo=True), lambda ids: "ab") == [""]
    done = Completion(
        "rid", "cd", (5, 6), FinishReason.STOP, Usage(2, 2, CacheStats()), "m", prompt_token_ids=(1, 2)
    )
    body = resp.completion_body(asked, [done], "rid", 5, False, str, output_text=lambda ids, skip: "")
    dumped = json.loads(body.model_dump_json())["choices"][0]
    assert (dumped["stop_reason"], dumped["prompt_token_ids"], dumped["token_ids"]) == (None, [1, 2], [5, 6])
    cut = dataclasses.replace(done, text="c")
    plan = chat(stop=["c"], stop_token_ids=[6], return_token_ids=True)
    reply = json.loads(
        resp.completion_body(
            plan, [cut], "rid", 5, True, str, output_text=lambda ids, skip: "cd"[: len(ids)]
        ).model_dump_json()
    )
    assert reply["prompt_token_ids"] == [1, 2] and reply["choices"][0]["token_ids"] == [5, 6]
    assert reply["choices"][0]["stop_reason"] == "c"  # a stop string wins over the stop token
    plain = json.loads(resp.completion_body(chat(), [done], "rid", 5, True, str).model_dump_json())
    assert plain["choices"][0]["stop_reason"] is None and "token_ids" not in plain["choices"][0]
    assert "prompt_token_ids" not in plain
