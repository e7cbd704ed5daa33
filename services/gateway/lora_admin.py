"""LoRA adapters loaded into and unloaded from the running cluster (vLLM's runtime LoRA updating:
POST /v1/load_lora_adapter and /v1/unload_lora_adapter, Gateway.LoadLoraAdapter /
UnloadLoraAdapter). Owns which workers an update goes to (every worker of the base model the
scheduler routes to, all roles: both halves of a disaggregated request need the adapter), the
checks made before any worker is touched, the concurrent calls with their timeout, the rollback
that puts back what the workers that succeeded changed when another failed (all or nothing),
and the wait until the scheduler routes by the workers' new lists, so that the next request may
name a loaded adapter, or gets 404 for an unloaded one. No grpc here: the scheduler and the
workers are reached through `ports.ClusterView` and `ports.LoraWorkerClient`.

Workers that join later do not get adapters loaded this way (--lora-modules, Helm
model.loraModules, is for adapters that must survive restarts and scale-out). One update at a
time goes through a gateway; two gateways updating the same adapter at once may both fail (each
rolls back), never leave it half loaded."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import structlog

from services.gateway.ports import ClusterState, ClusterView, ClusterWorker, LoraWorkerClient
from shared.cluster import LORA_RUNTIME_CAPABILITY
from shared.errors import (
    AlreadyExists,
    Cancelled,
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PdserveError,
    PermissionDenied,
    ResourceExhausted,
    Unavailable,
)

log = structlog.get_logger(__name__)

T = TypeVar("T")

# How often the scheduler's worker list is read while waiting for it to show a change (s).
DEFAULT_SETTLE_POLL_S = 0.05
# Errors that are a worker's answer: the call ran and changed nothing there. Any other failure
# (unreachable, past its deadline, internal) leaves it unknown whether the adapter changed.
_ANSWERS = (InvalidArgument, AlreadyExists, FailedPrecondition, NotFound, PermissionDenied)


class AdapterInUse(FailedPrecondition):
    """An unload refused because requests of the adapter are still queued or running."""


@dataclass(frozen=True)
class LoraUpdate:
    """A load or unload that took effect: the adapter and the workers it changed (ids)."""

    name: str
    worker_ids: tuple[str, ...]


class LoraAdmin:
    def __init__(
        self,
        cluster: ClusterView,
        workers: LoraWorkerClient,
        call_timeout_s: float,
        settle_timeout_s: float,
        poll_s: float = DEFAULT_SETTLE_POLL_S,
    ) -> None:
        """`call_timeout_s`: the longest one worker's load or unload may take (s);
        `settle_timeout_s`: the longest the scheduler may take to show the change (s)."""
        self._cluster = cluster
        self._workers = workers
        self._call_timeout_s = call_timeout_s
        self._settle_timeout_s = settle_timeout_s
        self._poll_s = poll_s
        self._lock = asyncio.Lock()  # one update at a time through this gateway

    async def load(self, base_model: str, name: str, path: str) -> LoraUpdate:
        """Load the PEFT adapter in folder `path` (on the workers' file systems) as `name` into
        every worker of `base_model`, or into none: the error of the first worker that failed
        (by the scheduler's order), after the others unloaded it again. Shielded: a caller that
        goes away does not cut the rollback short."""
        if not name or not path:
            raise InvalidArgument("both lora_name and lora_path are required")
        if name == base_model:
            raise AlreadyExists(f"{name!r} is the base model's id; give the LoRA adapter another name")
        return await _shielded(self._locked(self._load(base_model, name, path)))

    async def unload(self, base_model: str, name: str) -> LoraUpdate:
        """Unload adapter `name` from every worker of `base_model` listing it, or from none:
        AdapterInUse while requests of it run somewhere (the workers that had unloaded it load
        it again). NotFound when no worker lists it. Shielded like `load`."""
        if not name:
            raise InvalidArgument("lora_name is required")
        return await _shielded(self._locked(self._unload(base_model, name)))

    # --- load ---

    async def _load(self, base_model: str, name: str, path: str) -> LoraUpdate:
        state = await self._state()
        holders = [w for w in state.workers if name in w.lora_adapters or name == w.model_id]
        if holders:
            raise AlreadyExists(
                f"the LoRA adapter {name!r} is already loaded (on {_names(holders)}); unload it first "
                "to load it again"
            )
        targets = [w for w in state.workers if w.model_id == base_model]
        if not targets:
            raise Unavailable(f"no worker of {base_model!r} is registered; nothing to load {name!r} into")
        _require_runtime(targets)
        outcomes = await self._each(
            targets, lambda w: self._workers.load_lora_adapter(w, name, path, self._call_timeout_s)
        )
        failed = [(w, o) for w, o in zip(targets, outcomes, strict=True) if isinstance(o, BaseException)]
        if failed:
            # also where no answer came: a load past its deadline may still finish
            maybe = [w for w, o in zip(targets, outcomes, strict=True) if not isinstance(o, _ANSWERS)]
            stuck = await self._undo_load(maybe, name)
            worker, error = failed[0]
            log.warning("lora_load_failed", lora_adapter=name, worker_id=worker.worker_id, error=str(error))
            raise _with_note(error, _undone("nothing stays loaded by this call", stuck))
        ids = {w.worker_id for w in targets}
        if not await self._settle(
            lambda s: all(name in w.lora_adapters for w in s.workers if w.worker_id in ids)
        ):
            await self._undo_load(targets, name)
            raise Unavailable(
                f"the scheduler did not list the LoRA adapter {name!r} on its workers within "
                f"{self._settle_timeout_s:g} s (is the load-monitor reachable?); it was unloaded again"
            )
        log.info("lora_adapter_loaded", lora_adapter=name, base_model=base_model, workers=len(targets))
        return LoraUpdate(name, tuple(w.worker_id for w in targets))

    async def _undo_load(self, workers: Sequence[ClusterWorker], name: str) -> list[ClusterWorker]:
        """Unload `name` from `workers`; returns those where that failed (it may stay there)."""

        async def undo(w: ClusterWorker) -> bool:
            try:
                await self._workers.unload_lora_adapter(w, name, self._call_timeout_s)
            except NotFound:
                pass  # it never loaded there
            except Exception as exc:
                log.error("lora_rollback_failed", lora_adapter=name, worker=str(w), error=str(exc))
                return False
            return True

        undone = await asyncio.gather(*(undo(w) for w in workers))
        return [w for w, ok in zip(workers, undone, strict=True) if not ok]

    # --- unload ---

    async def _unload(self, base_model: str, name: str) -> LoraUpdate:
        state = await self._state()
        holders = [w for w in state.workers if w.model_id == base_model and name in w.lora_adapters]
        if not holders:
            raise NotFound(f"the LoRA adapter {name!r} is not loaded on any worker of {base_model!r}")
        _require_runtime(holders)
        outcomes = await self._each(
            holders, lambda w: self._workers.unload_lora_adapter(w, name, self._call_timeout_s)
        )
        unloaded = [(w, o) for w, o in zip(holders, outcomes, strict=True) if isinstance(o, str)]
        # NotFound: the worker no longer had it (unloaded since the scheduler's list): done there
        failed = [
            (w, o)
            for w, o in zip(holders, outcomes, strict=True)
            if isinstance(o, BaseException) and not isinstance(o, NotFound)
        ]
        if failed:
            stuck = await self._undo_unload(unloaded, name)
            worker, error = failed[0]
            if isinstance(error, FailedPrecondition):  # the worker's reason: requests of it run there
                error = AdapterInUse(str(error))
            log.warning("lora_unload_failed", lora_adapter=name, worker_id=worker.worker_id, error=str(error))
            raise _with_note(error, _undone(f"{name!r} stays loaded on every worker that had it", stuck))
        ids = {w.worker_id for w in holders}
        if not await self._settle(
            lambda s: not any(name in w.lora_adapters for w in s.workers if w.worker_id in ids)
        ):
            raise Unavailable(
                f"the LoRA adapter {name!r} was unloaded from {len(holders)} workers, but the "
                f"scheduler still lists it after {self._settle_timeout_s:g} s (is the load-monitor "
                "reachable?); requests naming it fail until it catches up"
            )
        log.info("lora_adapter_unloaded", lora_adapter=name, base_model=base_model, workers=len(holders))
        return LoraUpdate(name, tuple(w.worker_id for w in holders))

    async def _undo_unload(
        self, unloaded: Sequence[tuple[ClusterWorker, str]], name: str
    ) -> list[ClusterWorker]:
        """Load `name` again where it was unloaded, from the folder each worker had it from;
        returns the workers where that failed (they now lack it)."""

        async def undo(w: ClusterWorker, path: str) -> bool:
            try:
                if not path:
                    raise FailedPrecondition("the worker did not say where it had loaded it from")
                await self._workers.load_lora_adapter(w, name, path, self._call_timeout_s)
            except Exception as exc:
                log.error("lora_rollback_failed", lora_adapter=name, worker=str(w), error=str(exc))
                return False
            return True

        undone = await asyncio.gather(*(undo(w, path) for w, path in unloaded))
        return [w for (w, _), ok in zip(unloaded, undone, strict=True) if not ok]

    # --- helpers ---

    async def _locked(self, update: Awaitable[T]) -> T:
        async with self._lock:
            return await update

    async def _state(self) -> ClusterState:
        state = await self._cluster.cluster_state(self._settle_timeout_s)
        if state.stale:
            raise Unavailable(
                "the scheduler has lost the load-monitor and its list of workers may be out of "
                "date; retry the LoRA adapter update when it is back"
            )
        return state

    async def _each(
        self, workers: Sequence[ClusterWorker], call: Callable[[ClusterWorker], Awaitable[T]]
    ) -> list[T | BaseException]:
        """`call` on every worker at once; each one's result or error, in the workers' order."""
        return await asyncio.gather(*(call(w) for w in workers), return_exceptions=True)

    async def _settle(self, done: Callable[[ClusterState], bool]) -> bool:
        """Poll the scheduler's list until `done` holds for it (True) or settle_timeout_s ran out
        (False); a failed poll counts as not yet."""
        deadline_s = time.monotonic() + self._settle_timeout_s
        while True:
            try:
                if done(await self._cluster.cluster_state(self._settle_timeout_s)):
                    return True
            except PdserveError as exc:
                log.debug("lora_settle_poll_failed", error=str(exc))
            if time.monotonic() >= deadline_s:
                return False
            await asyncio.sleep(self._poll_s)


def _require_runtime(workers: Sequence[ClusterWorker]) -> None:
    lacking = [w for w in workers if LORA_RUNTIME_CAPABILITY not in w.capabilities]
    if lacking:
        raise FailedPrecondition(
            f"{_names(lacking)} cannot load or unload LoRA adapters while running (start workers "
            "with --enable-lora, or upgrade those older than 1.14); nothing was changed"
        )


def _undone(done: str, stuck: Sequence[ClusterWorker]) -> str:
    """What a rollback left: `done`, or which workers it could not put back."""
    if not stuck:
        return done
    return f"undoing it failed on {_names(stuck)} (see the gateway's log): check them, then retry"


def _names(workers: Sequence[ClusterWorker]) -> str:
    return ", ".join(str(w) for w in workers)


# domain errors whose one argument is the message (a note can be added to it)
_PLAIN_ERRORS = (
    *_ANSWERS,
    AdapterInUse,
    Unavailable,
    DeadlineExceeded,
    Cancelled,
    ResourceExhausted,
    PdserveError,
)


def _with_note(error: BaseException, note: str) -> BaseException:
    """`error` as the same class with `note` added to its message (other exceptions as they are:
    an unexpected one is INTERNAL, its message never shown)."""
    if type(error) in _PLAIN_ERRORS:
        return type(error)(f"{error}; {note}")
    return error


async def _shielded(update: Awaitable[T]) -> T:
    """Run `update` to its end even when the caller is cancelled (its rollback must not stop
    half way); a cancelled caller's update is logged when it fails."""
    task = asyncio.ensure_future(update)
    task.add_done_callback(lambda t: t.cancelled() or t.exception())  # retrieved if unawaited
    return await asyncio.shield(task)
