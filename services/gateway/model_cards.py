"""The cluster's model cards (each model id, and the smallest max_model_len a worker of it reports)
as the scheduler last listed them (`ports.SchedulerClient.list_models`, i.e. Scheduler/GetState):
ListModels fetches them fresh, and each request's budget is resolved against the cached figure
before it is scheduled (`budget.py`), so that no request costs a GetState of its own.

Freshness: a figure older than `ttl_s` is refreshed in the background while requests go on with
it; only lookups made before any fetch succeeded wait for the fetch in flight (bounded by their
timeout). A failed fetch keeps the last figures (before the first success: none, max_model_len
unknown). A stale figure is safe: the placement's own max_model_len is checked again
(`budget.MaxTokens.refit`).

LoRA adapters have cards of their own (`ModelCard.parent`: their base model), which is how a
request's `model` is known to name one (`lookup`): a name not listed refreshes the cards at once
(an adapter whose workers just registered), at most once per `miss_refresh_s`. No grpc here."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable

import structlog

from services.gateway.ports import ModelCard, SchedulerClient

log = structlog.get_logger(__name__)

# How old the cached cards may get before a lookup refreshes them (s): workers joining or leaving
# change a model's smallest max_model_len rarely, and a stale one is re-checked on the placement.
DEFAULT_TTL_S = 5.0
# A lookup of a name the cards do not list fetches them again unless a fetch began this recently
# (s): new adapters are found at once, and a flood of unknown names costs the scheduler at most
# one GetState per this long.
DEFAULT_MISS_REFRESH_S = 1.0


class ModelCards:
    def __init__(
        self,
        scheduler: SchedulerClient,
        ttl_s: float = DEFAULT_TTL_S,
        clock: Callable[[], float] = time.monotonic,
        miss_refresh_s: float = DEFAULT_MISS_REFRESH_S,
    ) -> None:
        self._scheduler = scheduler
        self._ttl_s = ttl_s
        self._miss_refresh_s = miss_refresh_s
        self._clock = clock
        self._cards: dict[str, ModelCard] | None = None  # None until a fetch succeeded
        self._asked_s: float | None = None  # when the last fetch began (the clock's seconds)
        self._refresh: asyncio.Task[None] | None = None

    async def fetch(self) -> list[ModelCard]:
        """The scheduler's cards now (ListModels); they replace the cached ones. Raises as the
        scheduler client does."""
        self._asked_s = self._clock()
        cards = list(await self._scheduler.list_models())
        self._cards = {c.id: c for c in cards}
        return cards

    async def max_model_len(self, model: str, timeout_s: float | None) -> int:
        """The smallest max_model_len of `model`'s workers (tokens; 0 = unknown: no such card,
        none of its workers reports one, or no fetch succeeded yet). `timeout_s`: the longest it
        waits for a fetch (only while nothing was fetched yet)."""
        card = await self._cached(model, timeout_s)
        return card.max_model_len if card is not None else 0

    async def lookup(self, model: str, timeout_s: float | None) -> ModelCard | None:
        """`model`'s card (None: not listed). A name the cards do not list waits for a fresh
        fetch (at most `timeout_s`), unless one began in the last `miss_refresh_s`."""
        card = await self._cached(model, timeout_s)
        if card is not None or (
            self._asked_s is not None and self._clock() - self._asked_s < self._miss_refresh_s
        ):
            return card
        self._start_refresh()
        await self._wait_refresh(timeout_s)
        return (self._cards or {}).get(model)

    @property
    def listed(self) -> bool:
        """Whether a fetch ever succeeded (before: no card is known, not even as missing)."""
        return self._cards is not None

    def adapters_of(self, base_model: str) -> list[str]:
        """The LoRA adapters of `base_model` as last listed (ids, sorted)."""
        return sorted(c.id for c in (self._cards or {}).values() if c.parent == base_model)

    async def _cached(self, model: str, timeout_s: float | None) -> ModelCard | None:
        """`model`'s card as last fetched; refreshed in the background after ttl_s (waited for,
        at most `timeout_s`, only while nothing was fetched yet)."""
        if self._asked_s is None or self._clock() - self._asked_s >= self._ttl_s:
            self._start_refresh()
        if self._cards is None:
            await self._wait_refresh(timeout_s)
        return (self._cards or {}).get(model)

    async def _wait_refresh(self, timeout_s: float | None) -> None:
        if self._refresh is not None and not self._refresh.done():
            with contextlib.suppress(TimeoutError):  # the fetch goes on for later lookups
                await asyncio.wait_for(asyncio.shield(self._refresh), timeout_s)

    def _start_refresh(self) -> None:
        if self._refresh is None or self._refresh.done():
            self._asked_s = self._clock()  # one refresh per ttl_s, however many lookups came
            self._refresh = asyncio.create_task(self._refresh_quietly(), name="gateway-model-cards")

    async def _refresh_quietly(self) -> None:
        try:
            await self.fetch()
        except Exception as exc:  # the lookups go on with the last figures; the next ttl_s retries
            log.warning("model_cards_fetch_failed", error=str(exc))

    async def close(self) -> None:
        if self._refresh is not None:
            self._refresh.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._refresh
            self._refresh = None
