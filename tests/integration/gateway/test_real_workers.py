"""The gateway in front of REAL workers (prefill, decode, unified; in process, tiny random Llama
models with byte-level BPE and byte-fallback tokenizers): usage.completion_tokens equals the true
number of generated tokens (every token id, returned once), finish_reason matches the unified
path, streaming equals unary, including max_tokens hit inside a multi-token character.

The scheduler is a stand-in that routes by the test's choice of mode."""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import jsonschema
import pytest
import pytest_asyncio

from services.gateway.server import GatewayApp, build_app
from services.gateway.tokenization import PromptTokenizer
from services.worker.server import WorkerApp
from services.worker.settings import WorkerSettings
from shared.cluster import Role
from shared.proto import common_pb2, gateway_pb2, gateway_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc
from tests.support.tiny_models import build_tiny_model

from .conftest import gateway_settings
from .http_stack import Router

pytestmark = pytest.mark.asyncio(loop_scope="module")

MAX_MODEL_LEN = 256
LENGTH, STOP = common_pb2.FINISH_REASON_LENGTH, common_pb2.FINISH_REASON_STOP
PROMPTS = ["日本語のテキスト 🙂🚀 ok", "Hello world! 你好，世界", "The quick brown fox"]


@dataclass
class Stack:
    router: Router
    gateway: GatewayApp
    stub: gateway_pb2_grpc.GatewayStub
    tokenizer: PromptTokenizer

    async def run(
        self, mode: str, **fields: Any
    ) -> tuple[list[gateway_pb2.GenerateResponse], gateway_pb2.CompleteResponse]:
        self.router.mode = mode
        frames = [f async for f in self.stub.Generate(gateway_pb2.GenerateRequest(**fields), timeout=120)]
        done = await self.stub.Complete(gateway_pb2.GenerateRequest(**fields), timeout=120)
        return frames, done


@pytest_asyncio.fixture(scope="module", loop_scope="module", params=["bpe", "byte_fallback"])
async def stack(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Stack]:
    model = build_tiny_model(tmp_path_factory.mktemp("real-workers") / f"tiny-{request.param}", request.param)
    workers: list[WorkerApp] = []
    router = Router(max_model_len=MAX_MODEL_LEN)
    for role in ("prefill", "decode", "unified"):
        app = WorkerApp(
            WorkerSettings(
                role=Role(role),
                listen="127.0.0.1:0",
                metrics_port=-1,
                model=str(model),
                device="cpu",
                dtype="float32",
                block_size=4,
                kv_cache_tokens=2048,
                max_model_len=MAX_MODEL_LEN,
                torch_threads=1,
                drain_grace_s=1.0,
            )
        )
        await app.start()
        workers.append(app)
        router.targets[role] = scheduler_pb2.WorkerTarget(worker_id=app.worker_id, address=app.address)
    sched = grpc.aio.server()
    scheduler_pb2_grpc.add_SchedulerServicer_to_server(router, sched)
    port = sched.add_insecure_port("127.0.0.1:0")
    await sched.start()
    gateway = build_app(gateway_settings(model, f"127.0.0.1:{port}", block_size=4))
    await gateway.start()
    channel = grpc.aio.insecure_channel(gateway.server.address)
    try:
        yield Stack(router, gateway, gateway_pb2_grpc.GatewayStub(channel), PromptTokenizer.load(Path(model)))
    finally:
        await channel.close()
        await gateway.stop(0)
        await sched.stop(0)
        for app in workers:
            await app.stop()


def counts(usage: common_pb2.Usage) -> tuple[int, int, int]:
    """Usage without the cache figures (a repeated prompt hits the prefix cache the second time)."""
    return usage.prompt_tokens, usage.completion_tokens, usage.total_tokens


def ids_of(frames: list[gateway_pb2.GenerateResponse]) -> list[int]:
    return [t for f in frames for t in f.token_ids]


def check_consistent(
    frames: list[gateway_pb2.GenerateResponse], done: gateway_pb2.CompleteResponse, max_tokens: int
) -> None:
    last = frames[-1]
    true_count = len(ids_of(frames))  # every generated token id, sent once (EOS never included)
    assert last.usage.completion_tokens == true_count
    assert done.usage.completion_tokens == len(done.token_ids)
    if true_count >= max_tokens:
        assert last.finish_reason == LENGTH
    else:
        assert last.finish_reason == STOP
    assert all(f.prompt_tokens == last.usage.prompt_tokens for f in frames)
    u = last.usage
    assert u.cached_tokens == u.local_cached_tokens + u.transferred_cached_tokens <= u.prompt_tokens
    assert all(f.cached_tokens <= f.prompt_tokens for f in frames)
    assert last.usage.total_tokens == last.usage.prompt_tokens + true_count


@pytest.mark.parametrize("prompt", PROMPTS)
async def test_greedy_counts_exact_and_modes_agree(stack: Stack, prompt: str) -> None:
    fields = dict(prompt=prompt, max_tokens=12, temperature=0.0, return_token_ids=True)
    disagg, disagg_done = await stack.run("disaggregated", **fields)
    unified, unified_done = await stack.run("unified", **fields)
    for frames, done in ((disagg, disagg_done), (unified, unified_done)):
        check_consistent(frames, done, 12)
        assert done.text == "".join(f.text for f in frames)
        assert list(done.token_ids) == ids_of(frames)
        assert counts(done.usage) == counts(frames[-1].usage)
        assert done.finish_reason == frames[-1].finish_reason
    assert ids_of(disagg) == ids_of(unified)
    assert disagg_done.text == unified_done.text
    assert disagg[-1].finish_reason == unified[-1].finish_reason
    assert disagg[-1].usage.completion_tokens == unified[-1].usage.completion_tokens


@pytest.mark.parametrize("mode", ["disaggregated", "unified"])
async def test_sampled_byte_tokens_counted_exactly(stack: Stack, mode: str) -> None:
    fields = dict(prompt=PROMPTS[0], max_tokens=24, temperature=1.0, seed=7, return_token_ids=True)
    frames, done = await stack.run(mode, **fields)
    check_consistent(frames, done, 24)
    assert list(done.token_ids) == ids_of(frames)  # seeded: stream == unary
    assert counts(done.usage) == counts(frames[-1].usage) and done.finish_reason == frames[-1].finish_reason
    # the count does not depend on asking for token ids
    plain, plain_done = await stack.run(mode, **{**fields, "return_token_ids": False})
    assert counts(plain[-1].usage) == counts(frames[-1].usage) and counts(plain_done.usage) == counts(
        done.usage
    )


@pytest.mark.parametrize("mode", ["disaggregated", "unified"])
async def test_max_tokens_hit_inside_a_multi_token_character(stack: Stack, mode: str) -> None:
    tok = stack.tokenizer._tok
    base = dict(prompt=PROMPTS[0], temperature=1.0, ignore_eos=True, return_token_ids=True)
    for seed in range(40):
        frames, _ = await stack.run(mode, **base, seed=seed, max_tokens=32)
        ids = ids_of(frames)
        # a position whose token leaves a character incomplete
        cut = next((k for k in range(1, len(ids)) if tok.decode(ids[:k]).endswith("\ufffd")), None)
        if cut is not None:
            break
    else:
        pytest.skip("no partial character in 40 seeded samples")
    frames, done = await stack.run(mode, **base, seed=seed, max_tokens=cut)
    assert ids_of(frames) == ids[:cut]
    assert frames[-1].usage.completion_tokens == done.usage.completion_tokens == cut
    assert frames[-1].finish_reason == done.finish_reason == LENGTH
    assert done.text == "".join(f.text for f in frames)


async def test_stop_token_id_counted_and_reason_stop(stack: Stack) -> None:
    fields = dict(prompt=PROMPTS[2], max_tokens=12, temperature=0.0, return_token_ids=True)
    frames, _ = await stack.run("unified", **fields)
    first = ids_of(frames)[0]
    for mode in ("disaggregated", "unified"):
        frames, done = await stack.run(mode, **fields, stop_token_ids=[first])
        assert frames[-1].finish_reason == done.finish_reason == STOP
        assert (
            frames[-1].usage.completion_tokens == done.usage.completion_tokens == 1
        )  # the stop token counts


PENALTIES: dict[str, Any] = dict(presence_penalty=0.7, frequency_penalty=0.4, repetition_penalty=1.3)


@pytest.mark.parametrize("seed", [None, 11], ids=["greedy", "seeded"])
async def test_penalties_bias_and_min_tokens_modes_agree(stack: Stack, seed: int | None) -> None:
    """The prefill worker's first token and the decode worker's rest see the same penalties; an
    EOS pushed up by logit_bias ends the request right at min_tokens, counted exactly."""
    eos = stack.tokenizer._tok.eos_token_id
    sampled = {"temperature": 1.0, "seed": seed} if seed is not None else {"temperature": 0.0}
    base = dict(prompt=PROMPTS[2], max_tokens=12, ignore_eos=True, return_token_ids=True, **sampled)
    plain, _ = await stack.run("unified", **base)
    runs = {
        mode: await stack.run(mode, **base, **PENALTIES, logit_bias={7: 5.0})
        for mode in ("disaggregated", "unified")
    }
    (disagg, disagg_done), (unified, unified_done) = runs["disaggregated"], runs["unified"]
    assert ids_of(disagg) == ids_of(unified) == list(unified_done.token_ids) != ids_of(plain)
    assert disagg_done.text == unified_done.text
    for frames, done in runs.values():
        check_consistent(frames, done, 12)
    ended = dict(base, ignore_eos=False, min_tokens=3, logit_bias={eos: 100.0})
    for mode in ("disaggregated", "unified"):
        frames, done = await stack.run(mode, **ended)
        check_consistent(frames, done, 12)
        assert frames[-1].usage.completion_tokens == done.usage.completion_tokens == 3
        assert frames[-1].finish_reason == done.finish_reason == STOP


async def test_min_p_modes_agree_and_cuts_the_draws(stack: Stack) -> None:
    """min_p reaches the prefill worker (the first token) and the decode worker alike; a seeded
    sampled run with it differs from one without (it drops tokens a draw would take), and min_p 1
    keeps only the most likely token: greedy's output."""
    base = dict(prompt=PROMPTS[2], max_tokens=12, ignore_eos=True, return_token_ids=True)
    sampled = dict(base, temperature=1.5, seed=3)
    plain, _ = await stack.run("unified", **sampled)
    runs = {mode: await stack.run(mode, **sampled, min_p=0.7) for mode in ("disaggregated", "unified")}
    (disagg, disagg_done), (unified, unified_done) = runs["disaggregated"], runs["unified"]
    assert ids_of(disagg) == ids_of(unified) == list(unified_done.token_ids) != ids_of(plain)
    assert disagg_done.text == unified_done.text
    for frames, done in runs.values():
        check_consistent(frames, done, 12)
    greedy, _ = await stack.run("unified", **base, temperature=0.0)
    only_top, _ = await stack.run("disaggregated", **sampled, min_p=1.0)
    assert ids_of(only_top) == ids_of(greedy)


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({"presence_penalty": 3.0}, "presence_penalty must be in [-2, 2]"),
        ({"frequency_penalty": -2.5}, "frequency_penalty must be in [-2, 2]"),
        ({"repetition_penalty": 0.0}, "repetition_penalty must be in (0, 2]"),
        ({"logit_bias": {3: 150.0}}, "logit_bias[3] must be in [-100, 100]"),
        ({"logit_bias": {10**6: 1.0}}, "logit_bias has token id 1000000"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens (5) must be <= max_tokens (4)"),
    ],
)
async def test_bad_penalties_are_invalid_argument(stack: Stack, fields: dict[str, Any], words: str) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stack.stub.Complete(gateway_pb2.GenerateRequest(prompt="x", **fields), timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert words in (err.value.details() or "")


@pytest.mark.parametrize("seed", [None, 5], ids=["greedy", "seeded"])
async def test_logprobs_modes_agree_stream_and_unary(stack: Stack, seed: int | None) -> None:
    """The first token's logprobs come from the prefill worker, the rest from the decode worker:
    the same as unified to 1e-5 (their ranks exactly), one per counted token, streamed as
    unary; each token's rank is its place in the distribution drawn from (greedy: 1)."""
    sampled = {"temperature": 1.0, "seed": seed, "top_k": 50} if seed is not None else {"temperature": 0.0}
    fields = dict(prompt=PROMPTS[1], max_tokens=10, return_token_ids=True, logprobs=4, **sampled)
    runs = {
        mode: await stack.run(mode, **fields, presence_penalty=0.5) for mode in ("disaggregated", "unified")
    }
    got = {}
    for mode, (frames, done) in runs.items():
        check_consistent(frames, done, 10)
        streamed = [lp for f in frames for lp in f.logprobs]
        assert [lp.token_id for lp in streamed] == ids_of(frames) == [lp.token_id for lp in done.logprobs]
        assert len(streamed) == done.usage.completion_tokens
        for lp in streamed:
            assert len(lp.top_logprobs) == 4 and lp.logprob <= 0.0
            assert lp.HasField("rank") and lp.rank >= 1
            if seed is None:
                assert lp.top_logprobs[0].token_id == lp.token_id and lp.rank == 1
            if lp.token_id in [t.token_id for t in lp.top_logprobs]:  # all those above it are too
                assert lp.rank == 1 + sum(t.logprob > lp.logprob for t in lp.top_logprobs)
        got[mode] = [(lp.logprob, lp.rank, [t.logprob for t in lp.top_logprobs]) for lp in done.logprobs]
    for (a, rank_a, tops_a), (b, rank_b, tops_b) in zip(got["disaggregated"], got["unified"], strict=True):
        assert abs(a - b) <= 1e-5 and all(abs(x - y) <= 1e-5 for x, y in zip(tops_a, tops_b, strict=True))
        assert rank_a == rank_b
    frames, done = await stack.run("disaggregated", **{**fields, "logprobs": 0})
    assert all(len(lp.top_logprobs) == 0 for lp in done.logprobs) and len(done.logprobs) == 10
    plain, plain_done = await stack.run("disaggregated", prompt=PROMPTS[1], max_tokens=3)
    assert not plain_done.logprobs and not any(f.logprobs for f in plain)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stack.stub.Complete(gateway_pb2.GenerateRequest(prompt="x", logprobs=21), timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "logprobs (alternatives per token) must be in [0, 20]" in (err.value.details() or "")


async def test_structured_outputs_modes_agree_and_bad_ones_are_refused(stack: Stack) -> None:
    """The prefill worker constrains the first token, the decode worker replays it into its own
    matcher: the same tokens as unified, every output matching, counted exactly."""
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["ok", "n"],
        "additionalProperties": False,
    }
    constraints = [
        common_pb2.StructuredOutput(json_schema=json.dumps(schema)),
        common_pb2.StructuredOutput(regex=r"(ab|cd){2,3}!"),
        common_pb2.StructuredOutput(choice=["alpha", "beta", "日本"]),
        common_pb2.StructuredOutput(grammar='root ::= ("ab" | "cd") ("ab" | "cd") "?"'),
    ]
    for k, structured in enumerate(constraints):
        fields = dict(prompt=PROMPTS[k % 3], max_tokens=40, temperature=1.0, seed=k, return_token_ids=True)
        runs = {
            mode: await stack.run(mode, **fields, structured=structured)
            for mode in ("disaggregated", "unified")
        }
        (disagg, disagg_done), (unified, unified_done) = runs["disaggregated"], runs["unified"]
        assert ids_of(disagg) == ids_of(unified) and disagg_done.text == unified_done.text
        for frames, done in runs.values():
            check_consistent(frames, done, 40)
            assert done.finish_reason == STOP
        text = unified_done.text
        if k == 0:
            jsonschema.validate(json.loads(text), schema)
        elif k == 1:
            assert re.fullmatch(r"(ab|cd){2,3}!", text), text
        elif k == 2:
            assert text in ("alpha", "beta", "日本")
        else:
            assert re.fullmatch(r"(ab|cd){2}\?", text), text
    for structured, words in (
        (common_pb2.StructuredOutput(json_schema="{nope"), "not valid JSON"),
        (common_pb2.StructuredOutput(regex="[z-a]"), "regex"),
        (common_pb2.StructuredOutput(regex="a", choice=["a"]), "set exactly one of"),
        (common_pb2.StructuredOutput(grammar="root ::= missing"), "the grammar cannot be used"),
    ):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stack.stub.Complete(
                gateway_pb2.GenerateRequest(prompt="x", structured=structured), timeout=30
            )
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert words in (err.value.details() or ""), err.value.details()
