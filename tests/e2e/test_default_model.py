"""The bundled default model (SmolLM2-135M-Instruct) end to end: disaggregated and unified stacks
agree with transformers' generate token for token on a chat prompt, and the answer is sensible."""

from __future__ import annotations

import grpc
import openai
import pytest

from shared.model_store import resolve_model
from shared.proto import gateway_pb2, gateway_pb2_grpc
from tests.support.reference import hf_greedy, tokenize
from tests.support.stack import running_stack

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


async def _chat(address: str, max_tokens: int) -> list[gateway_pb2.GenerateResponse]:
    async with grpc.aio.insecure_channel(address) as channel:
        req = gateway_pb2.GenerateRequest(
            messages=[gateway_pb2.ChatMessage(**m) for m in MESSAGES],
            max_tokens=max_tokens,
            temperature=0,
            return_token_ids=True,
        )
        return [f async for f in gateway_pb2_grpc.GatewayStub(channel).Generate(req, timeout=300)]


async def test_smollm2_disaggregated_unified_and_hf_agree(tmp_path_factory: pytest.TempPathFactory) -> None:
    folder = resolve_model("default")
    want = hf_greedy(folder, tokenize(folder, messages=MESSAGES), 24)
    results = {}
    for unified in (False, True):
        with running_stack("default", tmp_path_factory.mktemp("logs-smol"), unified=unified) as stack:
            frames = await _chat(stack.gateway, 24)
            async with openai.AsyncOpenAI(
                base_url=stack.http_base_url, api_key="none", max_retries=0
            ) as client:
                http = await client.chat.completions.create(
                    model="",
                    messages=MESSAGES,  # type: ignore[arg-type]
                    max_tokens=24,
                    temperature=0,
                )
        results[unified] = frames
        # the OpenAI-compatible HTTP API answers the same, with the same usage
        assert http.choices[0].message.content == "".join(f.text for f in frames)
        assert http.usage is not None and http.usage.completion_tokens == frames[-1].usage.completion_tokens
        assert http.usage.prompt_tokens == frames[-1].usage.prompt_tokens
        tokens = [t for f in frames for t in f.token_ids]
        assert tokens[: len(want)] == want
        assert frames[-1].usage.completion_tokens == len(want)
    text = "".join(f.text for f in results[False])
    assert "Paris" in text
    assert text == "".join(f.text for f in results[True])
