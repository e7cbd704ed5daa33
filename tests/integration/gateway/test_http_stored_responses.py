"""Stored responses of the Responses API through the `openai` client, against a real gateway in
front of real workers (tiny model): a stored response is retrieved as it was answered (streamed
or not), a follow-up with previous_response_id answers as the whole conversation sent to chat
completions (greedy), input items are listed, a delete does not break a later turn, keys see only
their own, background responses run to the same answer and can be cancelled (KV freed) through
this gateway or another one on the same folder; one left by a gateway that died or stopped
before it wrote output runs again on another gateway on the folder (the same answer, one
stream), one left after is failed, not left in progress."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import pytest_asyncio

from services.gateway.stored_responses import (
    ABANDONED,
    ResponseStore,
    RunRequest,
    StoredResponse,
    new_response_id,
)
from tests.support.prom import sample_total

from .http_stack import HttpStack, client_of, gateway_on, http_stack

pytestmark = pytest.mark.asyncio(loop_scope="module")

GREEDY: dict[str, Any] = {"model": "", "max_output_tokens": 6, "temperature": 0.0}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stack(tiny_model: Path) -> AsyncIterator[HttpStack]:
    async with http_stack(tiny_model) as served:
        yield served


async def ended(client: openai.AsyncOpenAI, response_id: str, timeout_s: float = 60.0) -> Any:
    async with asyncio.timeout(timeout_s):
        while True:
            got = await client.responses.retrieve(response_id)
            if got.status not in ("queued", "in_progress"):
                return got
            await asyncio.sleep(0.05)


async def test_stored_responses_continue_a_conversation(stack: HttpStack, tmp_path: Path) -> None:
    async with gateway_on(stack, response_dir=str(tmp_path)) as gateway:
        client = client_of(gateway.http_url)
        try:
            first = await client.responses.create(input="the sky is", instructions="Be brief.", **GREEDY)
            assert first.store is True and first.status in ("completed", "incomplete")
            assert (await client.responses.retrieve(first.id)).model_dump() == first.model_dump()
            second = await client.responses.create(input="and then", previous_response_id=first.id, **GREEDY)
            assert second.previous_response_id == first.id
            # the same conversation sent whole to chat completions (instructions are not carried)
            history: list[Any] = [
                {"role": "user", "content": "the sky is"},
                {"role": "assistant", "content": first.output_text},
                {"role": "user", "content": "and then"},
            ]
            direct = await client.chat.completions.create(
                model="", messages=history, max_tokens=6, temperature=0.0
            )
            assert second.output_text == direct.choices[0].message.content
            assert second.usage is not None and direct.usage is not None
            assert second.usage.input_tokens == direct.usage.prompt_tokens
            # streamed: the final Response is what is stored
            final = None
            stream = await client.responses.create(
                input="go on", previous_response_id=second.id, stream=True, **GREEDY
            )
            async for event in stream:
                if event.type in ("response.completed", "response.incomplete"):
                    final = event.response
            assert final is not None and final.store is True
            stored = await client.responses.retrieve(final.id)
            assert stored.output_text == final.output_text and stored.usage == final.usage
            items = [i async for i in client.responses.input_items.list(second.id)]
            shown = [i.model_dump(exclude_none=True) for i in items]
            assert [(i["type"], i["role"], i["content"]) for i in shown] == [
                ("message", "user", [{"type": "input_text", "text": "and then"}])
            ]
            # deleting an earlier turn leaves the later ones whole
            deleted = await client.responses.with_raw_response.delete(first.id)
            assert deleted.http_response.json() == {"id": first.id, "object": "response", "deleted": True}
            with pytest.raises(openai.NotFoundError):
                await client.responses.retrieve(first.id)
            third = await client.responses.create(input="more", previous_response_id=final.id, **GREEDY)
            assert third.status in ("completed", "incomplete")
            with pytest.raises(openai.NotFoundError) as missing:
                await client.responses.create(input="x", previous_response_id=first.id, **GREEDY)
            assert missing.value.body["param"] == "previous_response_id"  # type: ignore[index]
            unstored = await client.responses.create(input="x", store=False, **GREEDY)
            assert unstored.store is False
            with pytest.raises(openai.NotFoundError):
                await client.responses.retrieve(unstored.id)
            with pytest.raises(openai.BadRequestError) as bad:  # only background ones are cancelled
                await client.responses.cancel(third.id)
            assert bad.value.body["param"] == "response_id"  # type: ignore[index]
        finally:
            await client.close()
    await stack.wait_idle()


async def test_keys_see_only_their_own(stack: HttpStack, tmp_path: Path) -> None:
    async with gateway_on(stack, response_dir=str(tmp_path), api_keys=("k1", "k2")) as gateway:
        one, two = client_of(gateway.http_url, "k1"), client_of(gateway.http_url, "k2")
        try:
            mine = await one.responses.create(input="hello", **GREEDY)
            for call in (
                two.responses.retrieve(mine.id),
                two.responses.delete(mine.id),
                two.responses.create(input="x", previous_response_id=mine.id, **GREEDY),
            ):
                with pytest.raises(openai.NotFoundError):
                    await call
            assert (await one.responses.retrieve(mine.id)).id == mine.id
        finally:
            await one.close()
            await two.close()
    async with gateway_on(stack) as off:  # no --response-dir: nothing stored, and it says why
        client = client_of(off.http_url)
        try:
            plain = await client.responses.create(input="hello", **GREEDY)
            assert plain.store is False
            with pytest.raises(openai.NotFoundError, match="--response-dir"):
                await client.responses.retrieve(plain.id)
            for kw, param in (
                ({"previous_response_id": plain.id}, "previous_response_id"),
                ({"background": True}, "background"),
            ):
                with pytest.raises(openai.BadRequestError, match="--response-dir") as bad:
                    await client.responses.create(input="x", **kw, **GREEDY)
                assert bad.value.body["param"] == param  # type: ignore[index]
        finally:
            await client.close()
    await stack.wait_idle()


async def test_background_responses_run_and_cancel(stack: HttpStack, tmp_path: Path) -> None:
    async with (
        gateway_on(stack, response_dir=str(tmp_path)) as a,
        gateway_on(stack, response_dir=str(tmp_path)) as b,
    ):
        one, other = client_of(a.http_url), client_of(b.http_url)
        try:
            queued = await one.responses.create(input="the sky is", background=True, **GREEDY)
            assert queued.status == "queued" and queued.background is True and queued.output == []
            done = await ended(other, queued.id)  # read through the other gateway
            assert done.status in ("completed", "incomplete") and done.background is True
            foreground = await one.responses.create(input="the sky is", **GREEDY)
            assert done.output_text == foreground.output_text
            assert done.usage is not None and foreground.usage is not None
            assert done.usage.output_tokens == foreground.usage.output_tokens
            # a long one, cancelled through this gateway, then one through the other
            long: dict[str, Any] = {**GREEDY, "max_output_tokens": 1500, "extra_body": {"ignore_eos": True}}
            for canceller in (one, other):
                running = await one.responses.create(input="count", background=True, **long)
                await _until_running(one, running.id)
                cancelled = await canceller.responses.cancel(running.id)
                assert cancelled.status == "cancelled"
                await stack.wait_idle(timeout_s=30)  # aborted on the workers: every KV block back
                assert (await ended(one, running.id)).status == "cancelled"
                again = await one.responses.cancel(running.id)  # cancelling again changes nothing
                assert again.status == "cancelled"
            # deleted through the other gateway: the run here stops (within its poll), KV freed
            running = await one.responses.create(input="count", background=True, **long)
            await _until_running(one, running.id)
            await other.responses.delete(running.id)
            async with asyncio.timeout(30):
                while sample_total("pdserve_background_responses_running") > 0:
                    await asyncio.sleep(0.02)
            await stack.wait_idle(timeout_s=30)
            # nothing of it is left (a run that went on would write its end: a lock file)
            assert not list(tmp_path.glob(f"{running.id}*"))
            with pytest.raises(openai.BadRequestError) as bad:
                await one.responses.create(input="x", background=True, store=False, **GREEDY)
            assert bad.value.body["param"] == "store"  # type: ignore[index]
            with pytest.raises(openai.BadRequestError) as bad:  # only background events are kept
                await one.responses.retrieve(foreground.id, stream=True)
            assert bad.value.body["param"] == "stream"  # type: ignore[index]
        finally:
            await one.close()
            await other.close()
    await stack.wait_idle()


async def test_background_responses_stream_and_streams_resume(stack: HttpStack, tmp_path: Path) -> None:
    """background + stream: the events as they are logged; the same events again from any one
    on (starting_after), through another gateway too; a cancel ends a stream being read."""
    async with (
        gateway_on(stack, response_dir=str(tmp_path)) as a,
        gateway_on(stack, response_dir=str(tmp_path)) as b,
    ):
        one, other = client_of(a.http_url), client_of(b.http_url)
        try:
            created = await one.responses.create(input="a b c", background=True, stream=True, **GREEDY)
            streamed = [e async for e in created]
            kinds = [e.type for e in streamed]
            assert kinds[0] == "response.created"
            assert kinds[-1] in ("response.completed", "response.incomplete")
            assert [e.sequence_number for e in streamed] == list(range(len(streamed)))
            final = streamed[-1].response
            assert final.background is True and final.store is True
            stored = await other.responses.retrieve(final.id)
            assert stored.output_text == final.output_text and stored.status == final.status
            foreground = await one.responses.create(input="a b c", **GREEDY)
            assert final.output_text == foreground.output_text
            for client in (one, other):  # resumed after the third event, through either gateway
                resumed = await client.responses.retrieve(final.id, stream=True, starting_after=2)
                again = [e async for e in resumed]
                assert [e.model_dump() for e in again] == [e.model_dump() for e in streamed[3:]]
            # a long one: its reader sees deltas, then the cancel (through the other gateway) ends it
            long: dict[str, Any] = {**GREEDY, "max_output_tokens": 1500, "extra_body": {"ignore_eos": True}}
            reading = await one.responses.create(input="count", background=True, stream=True, **long)
            seen: list[str] = []
            async with asyncio.timeout(60):
                async for event in reading:
                    seen.append(event.type)
                    if event.type == "response.created":
                        response_id = event.response.id
                    if seen.count("response.output_text.delta") == 3:
                        assert (await other.responses.cancel(response_id)).status == "cancelled"
            assert seen.count("response.output_text.delta") >= 3 and "response.completed" not in seen
            assert (await one.responses.retrieve(response_id)).status == "cancelled"
            await stack.wait_idle(timeout_s=30)
        finally:
            await one.close()
            await other.close()
    await stack.wait_idle()


async def _until_running(client: openai.AsyncOpenAI, response_id: str) -> None:
    async with asyncio.timeout(30):
        while (await client.responses.retrieve(response_id)).status == "queued":
            await asyncio.sleep(0.02)


def _left_by_a_dead_gateway(
    store: ResponseStore, text: str, logged: tuple[str, ...], kept: bool = True
) -> str:
    """A background response as a gateway killed -9 leaves it: in progress, its run lock free,
    its request kept (unless not `kept`: an earlier version made it), events of the types
    `logged` in its log."""
    response_id = new_response_id()
    created = int(time.time())
    body = {
        "id": response_id,
        "object": "response",
        "created_at": created,
        "status": "in_progress",
        "output": [],
    }
    item = {
        "type": "message",
        "role": "user",
        "content": [{"type": "input_text", "text": text}],
        "id": "msg_0",
    }
    store.create(StoredResponse(response_id, "", created, body, (item,), (item,), background=True))
    if kept:
        asked = {"model": "", "input": text, "background": True, "max_output_tokens": 6, "temperature": 0.0}
        store.keep_request(response_id, RunRequest(asked, response_id.removeprefix("resp_"), created))
    log = store.event_log(response_id)
    for kind in logged:
        log.write({"type": kind, "sequence_number": log.next_sequence, "response": body, "delta": "x"})
    log.close()
    return response_id


async def _events(raw: httpx.AsyncClient, response_id: str) -> list[dict[str, Any]]:
    async with raw.stream("GET", f"/v1/responses/{response_id}", params={"stream": "true"}) as answer:
        return [json.loads(x[6:]) async for x in answer.aiter_lines() if x.startswith("data: ")]


async def test_a_response_left_by_a_dead_gateway_runs_again_unless_it_had_written_output(
    stack: HttpStack, tmp_path: Path
) -> None:
    """Left before its output (its log: response.created, .in_progress): a gateway on the folder
    takes it over and runs it from the start, numbering its events on (one response.created),
    to the answer of a fresh run; left after its first delta, or made by an earlier version (no
    request kept): it reads as failed, never in progress for ever."""
    store = ResponseStore(tmp_path)
    quiet = _left_by_a_dead_gateway(store, "the sky is", ("response.created", "response.in_progress"))
    preamble = ("response.created", "response.in_progress", "response.output_text.delta")
    spoke = _left_by_a_dead_gateway(store, "the sky is", preamble)
    older = _left_by_a_dead_gateway(store, "the sky is", (), kept=False)
    resumed = sample_total("pdserve_background_responses_resumed_total")
    async with gateway_on(stack, response_dir=str(tmp_path)) as gateway:
        client = client_of(gateway.http_url)
        try:
            async with httpx.AsyncClient(base_url=gateway.http_url or "") as raw:
                for left in (spoke, older):
                    got = (await raw.get(f"/v1/responses/{left}")).json()
                    assert got["status"] == "failed" and got["error"]["message"] == ABANDONED
                data = await _events(raw, older)
                assert [(e["type"], e["response"]["status"]) for e in data] == [("response.failed", "failed")]
                data = await _events(raw, spoke)  # what it wrote, then how it ended
                assert [e["type"] for e in data] == [*preamble, "response.failed"]
                done = await ended(client, quiet)
                fresh = await client.responses.create(input="the sky is", **GREEDY)
                assert done.status == fresh.status and done.output_text == fresh.output_text
                assert done.id == quiet and done.background is True
                data = await _events(raw, quiet)
            kinds = [e["type"] for e in data]
            assert [e["sequence_number"] for e in data] == list(range(len(data)))
            assert kinds.count("response.created") == 1 and kinds.count("response.in_progress") == 1
            assert kinds[-1] == f"response.{done.status}" and "response.output_text.delta" in kinds
        finally:
            await client.close()
    assert sample_total("pdserve_background_responses_resumed_total") == resumed + 1
    assert not list(tmp_path.glob("*.request"))  # each ended: nothing is run again
    await stack.wait_idle(timeout_s=30)


async def _no_first_token(*args: Any, **kwargs: Any) -> AsyncIterator[Any]:
    await asyncio.Event().wait()  # a prefill that has not answered yet
    yield None


async def _first_output(client: openai.AsyncOpenAI, response_id: str) -> None:
    """Until the background response has logged output (read through `client`'s gateway)."""
    async with asyncio.timeout(30):
        stream = await client.responses.retrieve(response_id, stream=True)
        async for event in stream:
            if event.type == "response.output_text.delta":
                break
        await stream.close()


async def test_a_background_response_outlives_a_gateway_that_stops(
    stack: HttpStack, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Gateway A stops (drain, no grace) while it runs background responses: those with no
    output yet run again on gateway B (the same answer as a fresh greedy run; one consistent
    stream through B); cancel and delete work before the take-over and during it; the one that
    had written output is failed; every KV block comes back."""
    long: dict[str, Any] = {**GREEDY, "max_output_tokens": 1500, "extra_body": {"ignore_eos": True}}
    resumed = sample_total("pdserve_background_responses_resumed_total")
    async with gateway_on(stack, response_dir=str(tmp_path)) as b:
        other = client_of(b.http_url)
        try:
            async with gateway_on(stack, response_dir=str(tmp_path), drain_grace_s=0.0) as a:
                one = client_of(a.http_url)
                try:
                    talking = await one.responses.create(input="count", background=True, **long)
                    await _first_output(other, talking.id)
                    monkeypatch.setattr(a.service, "generate", _no_first_token)  # A's next: no output
                    quiet = await one.responses.create(input="the sky is", background=True, **GREEDY)
                    doomed, gone, longer = [
                        (await one.responses.create(input="count", background=True, **long)).id
                        for _ in range(3)
                    ]
                    await a.drain()
                finally:
                    await one.close()
            # before B takes them over (or just after): a cancel and a delete through B
            assert (await other.responses.cancel(doomed)).status == "cancelled"
            await other.responses.delete(gone)
            done = await ended(other, quiet.id)
            fresh = await other.responses.create(input="the sky is", **GREEDY)
            assert done.status == fresh.status and done.output_text == fresh.output_text
            assert done.usage is not None and fresh.usage is not None
            assert done.usage.output_tokens == fresh.usage.output_tokens
            streamed = [e async for e in await other.responses.retrieve(quiet.id, stream=True)]
            numbers = [e.sequence_number for e in streamed]
            assert numbers == sorted(set(numbers))
            assert [e.type for e in streamed].count("response.created") == 1
            last = streamed[-1]
            assert last.type in ("response.completed", "response.incomplete")
            assert last.type == f"response.{done.status}" and last.response.output_text == done.output_text
            # during B's run: cancelled through B, aborted on the workers
            await _first_output(other, longer)
            assert (await other.responses.cancel(longer)).status == "cancelled"
            failed = await other.responses.retrieve(talking.id)
            assert (
                failed.status == "failed" and failed.error is not None and "stopped" in failed.error.message
            )
            assert (await ended(other, doomed)).status == "cancelled"
            with pytest.raises(openai.NotFoundError):
                await other.responses.retrieve(gone)
            # after: cancelling an ended one changes nothing; delete removes it
            assert (await other.responses.cancel(quiet.id)).status == done.status
            await other.responses.delete(quiet.id)
            async with asyncio.timeout(30):
                while sample_total("pdserve_background_responses_running") > 0:
                    await asyncio.sleep(0.02)
            await stack.wait_idle(timeout_s=30)
            assert not list(tmp_path.glob(f"{gone}*")) and not list(tmp_path.glob(f"{quiet.id}*"))
        finally:
            await other.close()
    # quiet and longer at least (doomed and gone too when B took them before the cancel, delete)
    assert 2 <= sample_total("pdserve_background_responses_resumed_total") - resumed <= 4
    await stack.wait_idle()


async def test_stored_responses_are_counted(stack: HttpStack, tmp_path: Path) -> None:
    before = sample_total("pdserve_responses_stored_total")
    async with gateway_on(stack, response_dir=str(tmp_path)) as gateway:
        client = client_of(gateway.http_url)
        try:
            await client.responses.create(input="hi", **GREEDY)
            queued = await client.responses.create(input="hi", background=True, **GREEDY)
            await ended(client, queued.id)
            async with asyncio.timeout(10):  # its task counts it as it ends
                while sample_total("pdserve_background_responses_running") != 0:
                    await asyncio.sleep(0.02)
        finally:
            await client.close()
    assert sample_total("pdserve_responses_stored_total") == before + 2


async def test_a_store_that_cannot_be_written_loses_no_answer(
    stack: HttpStack, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A full disk: the answer still goes out, saying it was not stored; a background response
    is refused (500) with nothing started."""

    def full(*args: Any) -> None:
        raise OSError(28, "No space left on device")

    async with gateway_on(stack, response_dir=str(tmp_path)) as gateway:
        client = client_of(gateway.http_url)
        try:
            monkeypatch.setattr(ResponseStore, "create", full)
            plain = await client.responses.create(input="hi", **GREEDY)
            assert plain.store is False and plain.output_text is not None
            final = None
            async for event in await client.responses.create(input="hi", stream=True, **GREEDY):
                if event.type in ("response.completed", "response.incomplete"):
                    final = event.response
            assert final is not None and final.store is False
            with pytest.raises(openai.InternalServerError):
                await client.responses.create(input="hi", background=True, **GREEDY)
            assert not list(tmp_path.glob("resp_*"))
        finally:
            await client.close()
    await stack.wait_idle()


async def test_truncation_auto_keeps_a_long_conversation_going(stack: HttpStack, tmp_path: Path) -> None:
    """A conversation grown past the context: "disabled" (the default) is a 400 saying the
    model's limit, "auto" drops its oldest turns until the prompt fits."""
    async with gateway_on(stack, response_dir=str(tmp_path)) as gateway:
        client = client_of(gateway.http_url)
        try:
            long = " ".join(f"w{i}" for i in range(200))
            async with httpx.AsyncClient(base_url=gateway.http_url or "") as raw:
                per_turn = (await raw.post("/tokenize", json={"prompt": long})).json()["count"]
            assert per_turn * 3 > 2048 > per_turn * 2 + 100  # two turns fit the context, three do not
            previous = None
            for _ in range(2):
                turn = await client.responses.create(input=long, previous_response_id=previous, **GREEDY)
                previous = turn.id
            with pytest.raises(openai.BadRequestError, match="at most 2048 tokens"):
                await client.responses.create(input=long, previous_response_id=previous, **GREEDY)
            cut = await client.responses.create(
                input=long, previous_response_id=previous, truncation="auto", **GREEDY
            )
            assert cut.truncation == "auto" and cut.usage is not None
            assert per_turn < cut.usage.input_tokens <= 2048 - GREEDY["max_output_tokens"]
            # the stored conversation is whole: a follow-up without truncation still overflows
            with pytest.raises(openai.BadRequestError):
                await client.responses.create(input="x", previous_response_id=cut.id, **GREEDY)
        finally:
            await client.close()
    await stack.wait_idle()


async def test_conversations_hold_the_turns_of_their_responses(stack: HttpStack, tmp_path: Path) -> None:
    """The Conversations API: a conversation made with items, a response in it (after its items,
    as the whole conversation sent to chat completions) adds its input and output items, a
    streamed one and a background one too; items listed, fetched, deleted; per key; refusals."""
    async with gateway_on(stack, response_dir=str(tmp_path), api_keys=("k1", "k2")) as gateway:
        client, other = client_of(gateway.http_url, "k1"), client_of(gateway.http_url, "k2")
        try:
            conv = await client.conversations.create(
                items=[{"type": "message", "role": "user", "content": "the sky is"}],
                metadata={"topic": "sky"},
            )
            assert conv.id.startswith("conv_") and conv.metadata == {"topic": "sky"}
            said = await client.responses.create(input="and then", conversation=conv.id, **GREEDY)
            assert said.conversation is not None and said.conversation.id == conv.id
            history: list[Any] = [
                {"role": "user", "content": "the sky is"},
                {"role": "user", "content": "and then"},
            ]
            direct = await client.chat.completions.create(
                model="", messages=history, max_tokens=6, temperature=0.0
            )
            assert said.output_text == direct.choices[0].message.content
            items = [i async for i in client.conversations.items.list(conv.id, order="asc")]
            assert [(i.type, getattr(i, "role", None)) for i in items] == [
                ("message", "user"),
                ("message", "user"),
                ("message", "assistant"),
            ]
            assert items[2].id == said.output[0].id  # the response's own output item
            streamed = await client.responses.create(
                input="more", conversation={"id": conv.id}, stream=True, **GREEDY
            )
            async for _ in streamed:
                pass
            queued = await client.responses.create(
                input="again", conversation=conv.id, background=True, **GREEDY
            )
            await ended(client, queued.id)
            items = [i async for i in client.conversations.items.list(conv.id)]  # newest first
            assert len(items) == 7 and getattr(items[0], "role", None) == "assistant"
            first = str(items[-1].id)
            assert (await client.conversations.items.retrieve(first, conversation_id=conv.id)).id == first
            await client.conversations.items.delete(first, conversation_id=conv.id)
            assert len([i async for i in client.conversations.items.list(conv.id)]) == 6
            updated = await client.conversations.update(conv.id, metadata={"topic": "sea"})
            assert updated.metadata == {"topic": "sea"}
            added = await client.conversations.items.create(
                conv.id, items=[{"type": "message", "role": "user", "content": "hi"}]
            )
            assert len(added.data) == 1 and added.data[0].id
            with pytest.raises(openai.NotFoundError):  # another key's
                await other.conversations.retrieve(conv.id)
            with pytest.raises(openai.NotFoundError) as missing:
                await other.responses.create(input="x", conversation=conv.id, **GREEDY)
            assert missing.value.body["param"] == "conversation"  # type: ignore[index]
            with pytest.raises(openai.BadRequestError) as both:
                await client.responses.create(
                    input="x", conversation=conv.id, previous_response_id=said.id, **GREEDY
                )
            assert both.value.body["param"] == "conversation"  # type: ignore[index]
            with pytest.raises(openai.BadRequestError) as bad:
                unknown: Any = [{"type": "computer_call"}]
                await client.conversations.items.create(conv.id, items=unknown)
            assert bad.value.body["param"] == "items"  # type: ignore[index]
            deleted = await client.conversations.delete(conv.id)
            assert deleted.deleted and deleted.id == conv.id
            with pytest.raises(openai.NotFoundError):
                await client.conversations.retrieve(conv.id)
        finally:
            await client.close()
            await other.close()
    await stack.wait_idle()
