"""A request's output handle (engine/handle.py): outputs queued while the consumer was busy come
out as one, with every token, text piece and logprob in order and the later one's figures; an
output that arrives alone is yielded at once; the terminal output ends the stream."""

from __future__ import annotations

import asyncio
from dataclasses import replace

from services.worker.engine.api import RequestOutput, TokenLogprobs
from services.worker.engine.handle import OutputHandle, deliver_batch
from shared.cluster import FinishReason

BASE = RequestOutput(
    request_id="r",
    new_token_ids=(),
    text_delta="",
    finished=False,
    finish_reason=None,
    num_generated_tokens=0,
    num_prompt_tokens=5,
    num_local_cached_tokens=0,
    num_transferred_tokens=0,
)


def _token(i: int, text: str, num_computed_tokens: int = 0) -> RequestOutput:
    lp = TokenLogprobs(token_id=i, logprob=-0.5 * i, top=())
    return replace(
        BASE,
        new_token_ids=(i,),
        text_delta=text,
        num_generated_tokens=i,
        new_logprobs=(lp,),
        num_computed_tokens=num_computed_tokens,
    )


async def test_outputs_queued_while_the_consumer_was_busy_come_out_as_one() -> None:
    handle = OutputHandle("r", asyncio.get_running_loop())
    it = handle.__aiter__()
    deliver_batch([(handle, _token(1, "a"))])
    await asyncio.sleep(0)  # delivered through call_soon_threadsafe
    first = await anext(it)
    assert first.new_token_ids == (1,)  # alone: not held back for the next
    deliver_batch([(handle, _token(2, "b"))])
    deliver_batch([(handle, _token(3, "c", num_computed_tokens=0))])
    deliver_batch([(handle, replace(_token(4, "d"), finished=True, finish_reason=FinishReason.LENGTH))])
    await asyncio.sleep(0)
    merged = await anext(it)
    assert merged.new_token_ids == (2, 3, 4)
    assert merged.text_delta == "bcd"
    assert [lp.token_id for lp in merged.new_logprobs] == [2, 3, 4]
    assert merged.num_generated_tokens == 4  # the later output's running count
    assert merged.finished and merged.finish_reason is FinishReason.LENGTH
    assert [o async for o in it] == []  # the terminal output ended the stream


async def test_a_prefill_s_progress_merges_to_the_furthest_and_stops_at_the_terminal_output() -> None:
    handle = OutputHandle("r", asyncio.get_running_loop())
    progress = [
        replace(BASE, num_computed_tokens=n, num_prefill_chunks=i + 1) for i, n in enumerate((16, 32))
    ]
    final = replace(_token(7, "x"), finished=True, num_computed_tokens=40, num_prefill_chunks=3)
    late = _token(8, "never")
    deliver_batch([(handle, progress[0]), (handle, progress[1])])
    deliver_batch([(handle, final), (handle, late)])
    await asyncio.sleep(0)
    got = [o async for o in handle]
    assert len(got) == 1
    assert got[0].num_computed_tokens == 40 and got[0].num_prefill_chunks == 3
    assert got[0].new_token_ids == (7,) and got[0].finished  # nothing after the terminal output
