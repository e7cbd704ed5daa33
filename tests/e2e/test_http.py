"""`pdserve up --api-key --gateways 2`: the banner names the HTTP base URL, both faces require the
key (passed to each gateway in its environment), `pdserve generate --api-key` and the openai client
get through, and the two gateways share the HTTP port (the kernel spreads connections over them)."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from tests.support.stack import ROOT, Stack, running_stack

pytestmark = pytest.mark.e2e

KEY = "e2e-key-1"


@pytest.fixture(scope="module")
def keyed_stack(tiny_bpe_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with running_stack(
        str(tiny_bpe_model),
        tmp_path_factory.mktemp("logs-keyed"),
        unified=True,
        up_args=["--api-key", KEY, "--gateways", "2"],
    ) as stack:
        yield stack


@pytest.fixture
def client(keyed_stack: Stack) -> Iterator[openai.OpenAI]:
    """An openai client of the stack's HTTP face, closed after the test."""
    with openai.OpenAI(base_url=keyed_stack.http_base_url, api_key=KEY, max_retries=0) as c:
        yield c


def generate(stack: Stack, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "services.cli", "generate", "Hello", "--address", stack.gateway,
         "--max-tokens", "3", *extra],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def test_banner_keys_and_both_faces(keyed_stack: Stack, client: openai.OpenAI) -> None:
    banner = next(line for line in keyed_stack.output if line.startswith("pdserve is up"))
    assert f"HTTP {keyed_stack.http_base_url}" in banner
    deadline = time.monotonic() + 10  # the commands are printed right after the banner
    while "Ctrl-C" not in "\n".join(keyed_stack.output) and time.monotonic() < deadline:
        time.sleep(0.05)
    printed = "\n".join(keyed_stack.output)
    assert "Bearer <key>" in printed and f"curl -s {keyed_stack.http_base_url}/chat/completions" in printed
    assert KEY not in printed  # never printed
    denied = generate(keyed_stack)
    assert denied.returncode == 1 and "UNAUTHENTICATED" in denied.stderr
    ok = generate(keyed_stack, "--api-key", KEY)
    assert ok.returncode == 0, ok.stderr
    chat = client.chat.completions.create(
        model="", messages=[{"role": "user", "content": "Hi"}], max_tokens=3, stream=True
    )
    assert any(c.choices and c.choices[0].finish_reason for c in chat)
    with (
        openai.OpenAI(base_url=keyed_stack.http_base_url, api_key="nope", max_retries=0) as wrong,
        pytest.raises(openai.AuthenticationError),
    ):
        wrong.models.list()
    health = httpx.get(keyed_stack.http_base_url.removesuffix("/v1") + "/health", timeout=10)
    assert health.status_code == 200
    logs = keyed_stack.logs()
    assert KEY not in logs


def test_sampling_features_through_the_process_stack(client: openai.OpenAI) -> None:
    """Penalties, logit_bias, min_tokens, logprobs and a JSON schema through `pdserve up`'s
    gateway and worker processes with the openai client: the output validates, one logprob per
    counted token; echo scoring returns every prompt token's logprob."""
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "size": {"enum": ["s", "m", "l"]}},
        "required": ["ok", "size"],
        "additionalProperties": False,
    }
    reply = client.chat.completions.create(
        model="",
        messages=[{"role": "user", "content": "Describe it as JSON"}],
        max_tokens=40,
        temperature=0.9,
        seed=7,
        presence_penalty=0.5,
        frequency_penalty=0.3,
        logit_bias={"5": -100},
        logprobs=True,
        top_logprobs=2,
        response_format={"type": "json_schema", "json_schema": {"name": "desc", "schema": schema}},
        extra_body={"repetition_penalty": 1.1, "min_tokens": 2},
    )
    choice = reply.choices[0]
    jsonschema.validate(json.loads(choice.message.content or ""), schema)
    assert choice.finish_reason == "stop" and reply.usage is not None
    assert choice.logprobs is not None and choice.logprobs.content is not None
    assert len(choice.logprobs.content) == reply.usage.completion_tokens
    assert all(len(e.top_logprobs) == 2 for e in choice.logprobs.content)
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(
            model="",
            messages=[{"role": "user", "content": "x"}],
            extra_body={"response_format": {"type": "xml"}},
        )
    assert bad.value.body["param"] == "response_format"  # type: ignore[index]
    # log-likelihood scoring as evaluation harnesses send it: echo + logprobs + max_tokens 0
    scored = client.completions.create(
        model="", prompt="Paris is the capital of France", max_tokens=0, echo=True, logprobs=1
    )
    text = scored.choices[0]
    assert text.text == "Paris is the capital of France" and text.finish_reason == "length"
    assert scored.usage is not None and scored.usage.completion_tokens == 0
    lp = text.logprobs
    assert lp is not None and lp.token_logprobs is not None and lp.tokens is not None
    assert len(lp.tokens) == len(lp.token_logprobs) == scored.usage.prompt_tokens
    assert lp.token_logprobs[0] is None and all(v is not None and v <= 0 for v in lp.token_logprobs[1:])


def test_tool_calls_through_the_process_stack(client: openai.OpenAI) -> None:
    """A named function through `pdserve up`'s processes: the call's arguments validate against
    the tool's schema, finish_reason is tool_calls, and the streamed deltas (id and name first,
    then the arguments) reassemble to the unary call."""
    params = {
        "type": "object",
        "properties": {"unit": {"enum": ["C", "F"]}, "days": {"type": "integer", "minimum": 1, "maximum": 9}},
        "required": ["unit", "days"],
        "additionalProperties": False,
    }
    kw: Any = dict(
        model="",
        messages=[{"role": "user", "content": "Forecast?"}],
        tools=[{"type": "function", "function": {"name": "forecast", "parameters": params}}],
        tool_choice={"type": "function", "function": {"name": "forecast"}},
        max_tokens=120,  # the tiny tokenizer writes the call's JSON in about 60 tokens
        temperature=0.8,
        seed=5,
    )
    reply = client.chat.completions.create(**kw)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    call = choice.message.tool_calls[0]
    assert call.function.name == "forecast"
    jsonschema.validate(json.loads(call.function.arguments), params)
    names, arguments, reasons = [], "", []
    for chunk in client.chat.completions.create(stream=True, **kw):
        delta = chunk.choices[0].delta
        for tc in delta.tool_calls or ():
            assert tc.index == 0
            if tc.id:
                names.append(tc.function.name if tc.function else None)
            arguments += (tc.function.arguments if tc.function else None) or ""
        reasons.append(chunk.choices[0].finish_reason)
    assert names == ["forecast"] and arguments == call.function.arguments
    assert reasons[-1] == "tool_calls"


README = ROOT / "README.md"
README_BASE = "http://127.0.0.1:50091/v1"


def readme_http_blocks() -> tuple[list[str], str]:
    """The curl commands and the Python example of the README's HTTP API section."""
    text = README.read_text(encoding="utf-8")
    section = text[text.index("### OpenAI-compatible HTTP API") :]
    section = section[: section.index("\n## ")]
    sh = section.split("```sh\n", 1)[1].split("```", 1)[0]
    curls = [c.strip() for c in sh.replace("\\\n", " ").splitlines() if c.strip().startswith("curl")]
    python = section.split("```python\n", 1)[1].split("```", 1)[0]
    return curls, python


def test_readme_curl_and_openai_examples_run(keyed_stack: Stack) -> None:
    curls, python = readme_http_blocks()
    assert len(curls) == 2 and README_BASE in python
    for command in curls:
        argv = shlex.split(command.replace(README_BASE, keyed_stack.http_base_url))
        argv += ["-H", f"Authorization: Bearer {KEY}", "--fail-with-body", "--max-time", "120"]
        out = subprocess.run(argv, capture_output=True, text=True, timeout=150)
        assert out.returncode == 0, out.stdout + out.stderr
        assert '"finish_reason"' in out.stdout
    script = python.replace(README_BASE, keyed_stack.http_base_url).replace(
        'api_key="none"', f'api_key="{KEY}"'
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=150)
    assert out.returncode == 0, out.stderr
    assert "completion_tokens=" in out.stdout


def test_two_gateways_share_the_http_port(keyed_stack: Stack) -> None:
    """Requests on fresh connections reach both gateways (SO_REUSEPORT hashes each connection's
    addresses: 16 connections all on one of two gateways has odds 2 in 65,536). Each gateway logs
    request_end per request it served."""

    def served(name: str) -> int:
        return (keyed_stack.log_dir / f"{name}.log").read_text().count('"request_end"')

    before = {name: served(name) for name in ("gateway", "gateway-1")}
    body = {"model": "", "prompt": "Hi", "max_tokens": 1}
    for _ in range(16):
        with httpx.Client(base_url=keyed_stack.http_base_url, timeout=60) as client:  # one connection
            r = client.post("/completions", json=body, headers={"Authorization": f"Bearer {KEY}"})
            assert r.status_code == 200, r.text
    after = {name: served(name) for name in before}
    assert sum(after.values()) - sum(before.values()) == 16
    assert all(after[name] > before[name] for name in before), (before, after)
