"""The gateway's cached model cards (what a request's budget is resolved against before it is
scheduled): one fetch per ttl, refreshed in the background, failures and a hung scheduler never
fail a lookup."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

from services.gateway.model_cards import ModelCards
from services.gateway.ports import ModelCard, Placement, ScheduleQuery
from shared.errors import Unavailable


@dataclass
class Lister:
    """list_models answers each item in turn (the last one repeats): cards, or an exception
    raised, or an Event waited for (a hung scheduler)."""

    answers: list[list[ModelCard] | Exception | asyncio.Event]
    calls: int = 0

    async def schedule(self, query: ScheduleQuery, timeout_s: float | None) -> Placement:
        raise NotImplementedError

    async def list_models(self) -> Sequence[ModelCard]:
        self.calls += 1
        item = self.answers[0] if len(self.answers) == 1 else self.answers.pop(0)
        if isinstance(item, asyncio.Event):
            await item.wait()
            return [ModelCard("m", 99)]
        if isinstance(item, Exception):
            raise item
        return item


class Clock:
    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


async def settle() -> None:
    for _ in range(3):
        await asyncio.sleep(0)


async def test_one_fetch_per_ttl_refreshed_in_the_background() -> None:
    lister = Lister([[ModelCard("m", 24), ModelCard("other", 0)], [ModelCard("m", 16)]])
    clock = Clock()
    cards = ModelCards(lister, ttl_s=5.0, clock=clock)
    assert await cards.max_model_len("m", 1.0) == 24  # the first lookup waits for the fetch
    assert await cards.max_model_len("other", 1.0) == 0  # no worker of it reports one
    assert await cards.max_model_len("unknown", 1.0) == 0
    clock.now_s = 4.9
    assert await cards.max_model_len("m", 1.0) == 24
    assert lister.calls == 1
    clock.now_s = 5.0
    assert await cards.max_model_len("m", 1.0) == 24  # stale: answered at once, refreshed behind
    await settle()
    assert lister.calls == 2
    assert await cards.max_model_len("m", 1.0) == 16
    await cards.close()


async def test_a_failed_fetch_keeps_the_last_cards_and_is_retried_after_the_ttl() -> None:
    lister = Lister([Unavailable("scheduler down"), [ModelCard("m", 24)], Unavailable("down again")])
    clock = Clock()
    cards = ModelCards(lister, ttl_s=5.0, clock=clock)
    assert await cards.max_model_len("m", 1.0) == 0  # nothing fetched: unknown
    assert await cards.max_model_len("m", 1.0) == 0 and lister.calls == 1  # not retried at once
    clock.now_s = 5.0
    assert await cards.max_model_len("m", 1.0) == 24
    clock.now_s = 10.0
    assert await cards.max_model_len("m", 1.0) == 24
    await settle()
    assert lister.calls == 3
    assert await cards.max_model_len("m", 1.0) == 24  # kept after the failure
    await cards.close()


async def test_a_hung_scheduler_delays_the_first_lookup_by_its_timeout_only() -> None:
    answered = asyncio.Event()
    lister = Lister([answered])
    cards = ModelCards(lister, ttl_s=5.0, clock=Clock())
    assert await cards.max_model_len("m", 0.05) == 0
    answered.set()  # the fetch went on: later lookups get its cards
    await settle()
    assert await cards.max_model_len("m", 0.05) == 99 and lister.calls == 1
    await cards.close()


async def test_list_models_fetches_fresh_and_fills_the_cache() -> None:
    lister = Lister([[ModelCard("m", 24)], [ModelCard("m", 32)]])
    cards = ModelCards(lister, ttl_s=5.0, clock=Clock())
    assert await cards.fetch() == [ModelCard("m", 24)]
    assert await cards.fetch() == [ModelCard("m", 32)]
    assert await cards.max_model_len("m", 1.0) == 32 and lister.calls == 2
