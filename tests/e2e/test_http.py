"""`pdserve up --api-key`: the banner names the HTTP base URL, both faces require the key (passed
to the gateway in its environment), `pdserve generate --api-key` and the openai client get through."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.support.stack import ROOT, Stack, running_stack

pytestmark = pytest.mark.e2e

KEY = "e2e-key-1"


@pytest.fixture(scope="module")
def keyed_stack(tiny_bpe_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with running_stack(
        str(tiny_bpe_model), tmp_path_factory.mktemp("logs-keyed"), unified=True, up_args=["--api-key", KEY]
    ) as stack:
        yield stack


def generate(stack: Stack, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "services.cli", "generate", "Hello", "--address", stack.gateway,
         "--max-tokens", "3", *extra],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def test_banner_keys_and_both_faces(keyed_stack: Stack) -> None:
    banner = next(line for line in keyed_stack.output if line.startswith("pdserve is up"))
    assert f"HTTP {keyed_stack.http_base_url}" in banner
    assert KEY not in "\n".join(keyed_stack.output)  # never printed
    assert "Bearer <key>" in "\n".join(keyed_stack.output)
    denied = generate(keyed_stack)
    assert denied.returncode == 1 and "UNAUTHENTICATED" in denied.stderr
    ok = generate(keyed_stack, "--api-key", KEY)
    assert ok.returncode == 0, ok.stderr
    client = openai.OpenAI(base_url=keyed_stack.http_base_url, api_key=KEY, max_retries=0)
    chat = client.chat.completions.create(
        model="", messages=[{"role": "user", "content": "Hi"}], max_tokens=3, stream=True
    )
    assert any(c.choices and c.choices[0].finish_reason for c in chat)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=keyed_stack.http_base_url, api_key="nope", max_retries=0).models.list()
    health = httpx.get(keyed_stack.http_base_url.removesuffix("/v1") + "/health", timeout=10)
    assert health.status_code == 200
    logs = keyed_stack.logs()
    assert KEY not in logs
