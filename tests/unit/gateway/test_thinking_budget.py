"""vLLM's thinking_token_budget at the gateway: the value checked (-1 = no limit), a reasoning
parser required, the tags as token ids and whether the prompt left thinking open (deepseek_r1
only), the worker capability it needs, and the budget through the protobufs to the engine."""

from __future__ import annotations

import dataclasses

import pytest

from services.gateway import convert as gateway_convert
from services.gateway import thinking_budget
from services.gateway.capabilities import needed_capabilities
from services.gateway.inputs import Sampling, ThinkingBudget
from services.gateway.ports import WorkerJob
from services.gateway.validation import InvalidField
from services.worker import convert as worker_convert
from services.worker.engine import thinking_budget as engine_budget
from shared.proto import gateway_pb2

TAGS = ((5, 6), (7, 8, 9))


def _resolve(
    budget: int | None, kind: str | None, tail: str = "assistant\n<think>\n"
) -> ThinkingBudget | None:
    return thinking_budget.resolve(budget, kind, lambda: TAGS, lambda: tail)  # type: ignore[arg-type]


def test_values_are_checked_as_vllm_does() -> None:
    assert thinking_budget.check(None) is None and thinking_budget.check(-1) is None  # no limit
    assert thinking_budget.check(0) == 0 and thinking_budget.check(1 << 20) == 1 << 20
    for bad in (-2, 1 << 21, True, 1.5, "3"):
        with pytest.raises(InvalidField, match="thinking_token_budget") as err:
            thinking_budget.check(bad)  # type: ignore[arg-type]
        assert err.value.param == "thinking_token_budget"


def test_a_reasoning_parser_is_needed_and_gives_the_tags() -> None:
    assert _resolve(None, None) is None and _resolve(-1, None) is None
    with pytest.raises(InvalidField, match="--reasoning-parser") as err:
        _resolve(3, None)
    assert err.value.param == "thinking_token_budget"
    # deepseek_r1: open when the prompt ends inside <think>; qwen3 counts only a <think> written
    assert _resolve(3, "deepseek_r1") == ThinkingBudget(3, (5, 6), (7, 8, 9), open_at_start=True)
    assert _resolve(3, "deepseek_r1", "<think>\n\n</think>\n\n") == ThinkingBudget(3, *TAGS, False)
    assert _resolve(3, "deepseek_r1", "user\nhi") == ThinkingBudget(3, *TAGS, False)
    assert _resolve(0, "qwen3") == ThinkingBudget(0, *TAGS, False)


def test_the_budget_needs_its_capability_and_reaches_the_engine() -> None:
    budget = ThinkingBudget(4, *TAGS, True)
    plain = Sampling(max_tokens=8)
    with_budget = dataclasses.replace(plain, thinking_budget=budget)
    assert needed_capabilities(with_budget) == {"thinking_token_budget"}
    assert needed_capabilities(plain) == set()
    pb = gateway_convert.prefill_request(WorkerJob("r", (1, 2), with_budget, False), 0, None)
    sp = worker_convert.prefill_call_from_pb(pb).request.sampling
    assert sp.thinking_budget == engine_budget.ThinkingBudget(4, (5, 6), (7, 8, 9), open_at_start=True)
    assert sp.needs_history
    unset = gateway_convert.prefill_request(WorkerJob("r", (1, 2), plain, False), 0, None)
    assert not unset.sampling.HasField("thinking_budget")
    assert worker_convert.prefill_call_from_pb(unset).request.sampling.thinking_budget is None
    # gRPC GenerateRequest: unset means no limit
    unset_in = gateway_convert.generate_input(gateway_pb2.GenerateRequest(prompt="x"))
    assert unset_in.thinking_token_budget is None
    zero_in = gateway_convert.generate_input(gateway_pb2.GenerateRequest(prompt="x", thinking_token_budget=0))
    assert zero_in.thinking_token_budget == 0
