"""OpenAI's Files and Batch APIs through the `openai` client, against a real gateway in front of
real workers (tiny model): a batch's answers equal the same requests sent one by one (greedy),
bad requests land in the error file with the status they would get, keys see only their own
files and batches, a cancel aborts what is in flight and leaks no KV block, and a batch whose
gateway stopped is finished by the next gateway on the same folder, each request written once."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import pytest_asyncio

from services.gateway.batches import BatchStatus, BatchStore

from .http_stack import HttpStack, client_of, gateway_on, http_stack

pytestmark = pytest.mark.asyncio(loop_scope="module")

PROMPTS = ["the sky is", "one two three", "hello there", "a b c d"]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stack(tiny_model: Path) -> AsyncIterator[HttpStack]:
    async with http_stack(tiny_model) as served:
        yield served


def jsonl(url: str, bodies: dict[str, dict[str, Any]]) -> bytes:
    lines = [{"custom_id": k, "method": "POST", "url": url, "body": b} for k, b in bodies.items()]
    return "".join(json.dumps(x) + "\n" for x in lines).encode()


async def finished(client: openai.AsyncOpenAI, batch_id: str, timeout_s: float = 60.0) -> Any:
    async with asyncio.timeout(timeout_s):
        while True:
            batch = await client.batches.retrieve(batch_id)
            if batch.status in ("completed", "failed", "expired", "cancelled"):
                return batch
            await asyncio.sleep(0.05)


async def lines_of(client: openai.AsyncOpenAI, file_id: str | None) -> dict[str, Any]:
    if file_id is None:
        return {}
    text = (await client.files.content(file_id)).text
    values = [json.loads(raw) for raw in text.splitlines()]
    assert len({v["custom_id"] for v in values}) == len(values), "a request written twice"
    return {v["custom_id"]: v for v in values}


async def test_a_batch_answers_as_the_same_requests_one_by_one(stack: HttpStack, tmp_path: Path) -> None:
    async with gateway_on(stack, batch_dir=str(tmp_path), batch_poll_s=0.1) as gateway:
        client = client_of(gateway.http_url)
        try:
            bodies: dict[str, dict[str, Any]] = {
                f"q{i}": {
                    "model": "",
                    "messages": [{"role": "user", "content": p}],
                    "max_tokens": 6,
                    "temperature": 0,
                }
                for i, p in enumerate(PROMPTS)
            }
            bodies["bad"] = {"model": "", "messages": [{"role": "user", "content": "x"}], "max_tokens": -1}
            upload = await client.files.create(
                file=("in.jsonl", jsonl("/v1/chat/completions", bodies)),
                purpose="batch",
                expires_after={"anchor": "created_at", "seconds": 7200},
            )
            assert upload.purpose == "batch" and upload.bytes > 0
            assert upload.expires_at == upload.created_at + 7200
            batch = await client.batches.create(
                input_file_id=upload.id,
                endpoint="/v1/chat/completions",
                completion_window="24h",
                metadata={"job": "nightly"},
                output_expires_after={"anchor": "created_at", "seconds": 3600},
            )
            assert batch.status == "validating" and batch.metadata == {"job": "nightly"}
            batch = await finished(client, batch.id)
            assert batch.status == "completed", batch
            assert batch.request_counts is not None
            assert (
                batch.request_counts.total,
                batch.request_counts.completed,
                batch.request_counts.failed,
            ) == (5, 4, 1)
            out, err = (
                await lines_of(client, batch.output_file_id),
                await lines_of(client, batch.error_file_id),
            )
            assert sorted(out) == [f"q{i}" for i in range(len(PROMPTS))] and list(err) == ["bad"]
            for custom_id, body in bodies.items():
                if custom_id == "bad":
                    continue
                direct = await client.chat.completions.create(**body)
                answered = out[custom_id]["response"]
                assert answered["status_code"] == 200 and answered["request_id"]
                got = answered["body"]
                assert got["choices"][0]["message"]["content"] == direct.choices[0].message.content
                assert (
                    direct.usage is not None
                    and got["usage"]["completion_tokens"] == direct.usage.completion_tokens
                )
                assert got["usage"]["prompt_tokens"] == direct.usage.prompt_tokens
            refused = err["bad"]["response"]
            assert refused["status_code"] == 400 and refused["body"]["error"]["param"] == "max_tokens"
            listed = [b.id async for b in client.batches.list()]
            assert listed == [batch.id]
            output = await client.files.retrieve(batch.output_file_id or "")
            assert output.expires_at == output.created_at + 3600
            files = {f.id: f.purpose async for f in client.files.list()}
            assert files == {
                upload.id: "batch",
                batch.output_file_id: "batch_output",
                batch.error_file_id: "batch_output",
            }
            with pytest.raises(openai.ConflictError):  # completed: nothing to cancel
                await client.batches.cancel(batch.id)
            deleted = await client.files.delete(upload.id)
            assert deleted.deleted and upload.id not in {f.id async for f in client.files.list()}
        finally:
            await client.close()
    await stack.wait_idle()


async def test_keys_see_only_their_own_and_bad_requests_are_refused(stack: HttpStack, tmp_path: Path) -> None:
    async with gateway_on(stack, batch_dir=str(tmp_path), api_keys=("k1", "k2"), batch_poll_s=0.1) as gateway:
        one, two = client_of(gateway.http_url, "k1"), client_of(gateway.http_url, "k2")
        anonymous = client_of(gateway.http_url, "wrong")
        try:
            body = {"model": "", "prompt": "the sky is", "max_tokens": 3, "temperature": 0}
            upload = await one.files.create(
                file=("in.jsonl", jsonl("/v1/completions", {"a": body})), purpose="batch"
            )
            batch = await one.batches.create(
                input_file_id=upload.id, endpoint="/v1/completions", completion_window="24h"
            )
            with pytest.raises(openai.NotFoundError):
                await two.batches.retrieve(batch.id)
            with pytest.raises(openai.NotFoundError):
                await two.files.content(upload.id)
            with pytest.raises(openai.AuthenticationError):
                await anonymous.batches.retrieve(batch.id)
            assert [b async for b in two.batches.list()] == []
            done = await finished(one, batch.id)  # the batch's own requests pass the key check
            assert done.status == "completed" and done.request_counts is not None
            assert done.request_counts.completed == 1
            bads: list[tuple[dict[str, Any], str]] = [
                ({"endpoint": "/v1/embeddings"}, "endpoint"),
                ({"completion_window": "1h"}, "completion_window"),
                ({"input_file_id": "file-" + "0" * 32}, "input_file_id"),
                ({"input_file_id": done.output_file_id}, "input_file_id"),  # not a batch input
            ]
            for bad, param in bads:
                given = {
                    "input_file_id": upload.id,
                    "endpoint": "/v1/completions",
                    "completion_window": "24h",
                } | bad
                with pytest.raises(openai.BadRequestError) as refused:
                    await one.batches.create(**given)
                assert refused.value.body["param"] == param  # type: ignore[index]
            with pytest.raises(openai.BadRequestError) as refused:
                await one.files.create(file=("x.jsonl", b"{}\n"), purpose="fine-tune")
            assert refused.value.body["param"] == "purpose"  # type: ignore[index]
            with pytest.raises(openai.BadRequestError) as refused:  # under OpenAI's hour
                await one.files.create(
                    file=("x.jsonl", b"{}\n"),
                    purpose="batch",
                    expires_after={"anchor": "created_at", "seconds": 60},
                )
            assert refused.value.body["param"] == "expires_after"  # type: ignore[index]
            headers = {"authorization": "Bearer k1"}
            async with httpx.AsyncClient(base_url=gateway.http_url or "", headers=headers) as raw:
                files = [("file", ("a.jsonl", b"{}")), ("file", ("b.jsonl", b"{}"))]
                for sent in (
                    await raw.post("/v1/files", files=files, data={"purpose": "batch"}),  # two files
                    await raw.post("/v1/files", json={"purpose": "batch"}),  # not multipart
                ):
                    assert sent.status_code == 400 and sent.json()["error"]["param"] == "file", sent.text
        finally:
            for client in (one, two, anonymous):
                await client.close()
    async with gateway_on(stack) as off:  # no --batch-dir: the APIs say how to turn them on
        client = client_of(off.http_url)
        try:
            with pytest.raises(openai.NotFoundError, match="--batch-dir"):
                await client.batches.list()
        finally:
            await client.close()


async def test_a_cancel_frees_everything_and_a_stopped_gateways_batch_is_resumed(
    stack: HttpStack, tmp_path: Path
) -> None:
    bodies: dict[str, dict[str, Any]] = {
        f"r{i}": {"model": "", "prompt": f"count {i}", "max_tokens": 24, "temperature": 0} for i in range(10)
    }
    # one request at a time: the gateway stops with most of the second batch left to do
    settings: dict[str, Any] = dict(batch_dir=str(tmp_path), batch_poll_s=0.1, batch_concurrency=1)
    async with gateway_on(stack, **settings) as gateway:
        client = client_of(gateway.http_url)
        try:
            upload = await client.files.create(
                file=("in.jsonl", jsonl("/v1/completions", bodies)), purpose="batch"
            )
            batch = await client.batches.create(
                input_file_id=upload.id, endpoint="/v1/completions", completion_window="24h"
            )
            async with asyncio.timeout(60):
                while (await client.batches.retrieve(batch.id)).request_counts.completed < 2:  # type: ignore[union-attr]
                    await asyncio.sleep(0.02)
            cancelling = await client.batches.cancel(batch.id)
            assert cancelling.status in ("cancelling", "cancelled")
            cancelled = await finished(client, batch.id)
            assert cancelled.status == "cancelled" and cancelled.request_counts is not None
            out = await lines_of(client, cancelled.output_file_id)
            assert 2 <= len(out) == cancelled.request_counts.completed < 10
            resumed = await client.batches.create(
                input_file_id=upload.id, endpoint="/v1/completions", completion_window="24h"
            )
            async with asyncio.timeout(60):
                while (await client.batches.retrieve(resumed.id)).request_counts.completed < 2:  # type: ignore[union-attr]
                    await asyncio.sleep(0.02)
        finally:
            await client.close()
    await stack.wait_idle()  # the cancel and the stop aborted their requests: every block is back
    left = BatchStore(tmp_path).read(resumed.id)
    assert left.status == BatchStatus.IN_PROGRESS and 2 <= left.completed < 10
    async with gateway_on(stack, **settings) as successor:
        client = client_of(successor.http_url)
        try:
            done = await finished(client, resumed.id)
            assert done.status == "completed" and done.request_counts is not None
            assert (done.request_counts.completed, done.request_counts.failed) == (10, 0)
            out = await lines_of(client, done.output_file_id)
            direct = await client.completions.create(**bodies["r7"])
            assert (
                sorted(out) == sorted(bodies)
                and out["r7"]["response"]["body"]["choices"][0]["text"] == direct.choices[0].text
            )
        finally:
            await client.close()
    await stack.wait_idle()


async def test_pdserve_run_batch_writes_every_result_in_the_inputs_order(
    stack: HttpStack, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from services import batch_cli

    bodies: dict[str, dict[str, Any]] = {
        f"c{i}": {"model": "", "prompt": p, "max_tokens": 4, "temperature": 0} for i, p in enumerate(PROMPTS)
    }
    bodies["c1"]["max_tokens"] = -1  # answered 400: its line carries the error
    source, results = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_bytes(jsonl("/v1/completions", bodies))
    async with gateway_on(stack, batch_dir=str(tmp_path / "batches"), batch_poll_s=0.1) as gateway:
        argv = ["-i", str(source), "-o", str(results), "--url", gateway.http_url or "", "--poll-s", "0.05"]
        await asyncio.to_thread(batch_cli.main, argv)
        lines = [json.loads(raw) for raw in results.read_text().splitlines()]
        assert [x["custom_id"] for x in lines] == list(bodies)  # the input's order
        assert [x["response"]["status_code"] for x in lines] == [200, 400, 200, 200]
        assert "completed: 3 completed, 1 failed of 4" in capsys.readouterr().err
        source.write_bytes(jsonl("/v1/completions", {"a": bodies["c0"]}) * 2)  # a custom_id twice
        with pytest.raises(SystemExit) as failed:
            await asyncio.to_thread(batch_cli.main, argv)
        assert failed.value.code == 1 and "duplicate_custom_id" in capsys.readouterr().err
    await stack.wait_idle()
