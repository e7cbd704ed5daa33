"""OutputHandle: a step thread's outputs reach the caller's loop in order, one per step, and the
iteration ends after the finished one; a consumer cancelled while waiting leaves the handle usable."""

from __future__ import annotations

import asyncio
import threading

from services.worker.engine.api import RequestOutput
from services.worker.engine.handle import OutputHandle, deliver_batch


def _out(rid: str, n: int, finished: bool = False) -> RequestOutput:
    return RequestOutput(
        request_id=rid,
        new_token_ids=(n,),
        text_delta=f"t{n}",
        finished=finished,
        finish_reason=None,
        num_generated_tokens=n,
        num_prompt_tokens=3,
        num_local_cached_tokens=0,
        num_transferred_tokens=0,
    )


async def test_outputs_from_a_thread_arrive_in_order_one_each_and_end_at_finished() -> None:
    loop = asyncio.get_running_loop()
    a, b = OutputHandle("a", loop), OutputHandle("b", loop)

    def steps() -> None:  # a step thread: one batch per step, both requests in each
        for n in range(1, 6):
            deliver_batch([(a, _out("a", n, finished=n == 5)), (b, _out("b", n, finished=n == 5))])
        deliver_batch([(a, _out("a", 99))])  # after the finished one: never yielded

    thread = threading.Thread(target=steps)
    thread.start()
    got_a, got_b = await asyncio.gather(_drain(a), _drain(b))
    thread.join()
    assert [o.new_token_ids[0] for o in got_a] == [1, 2, 3, 4, 5]
    assert [o.text_delta for o in got_b] == ["t1", "t2", "t3", "t4", "t5"]
    assert got_a[-1].finished and not any(o.finished for o in got_a[:-1])


async def test_a_consumer_cancelled_while_waiting_leaves_the_handle_usable() -> None:
    handle = OutputHandle("c", asyncio.get_running_loop())
    waiting = asyncio.ensure_future(anext(aiter(handle)))
    await asyncio.sleep(0)
    waiting.cancel()
    await asyncio.gather(waiting, return_exceptions=True)
    handle._put(_out("c", 1))  # no waiter left to wake: queued, no error
    handle._put(_out("c", 2, finished=True))
    assert [o.new_token_ids[0] for o in await _drain(handle)] == [1, 2]


async def _drain(handle: OutputHandle) -> list[RequestOutput]:
    return [o async for o in handle]
