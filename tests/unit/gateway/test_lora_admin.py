"""Runtime LoRA updates at the gateway (lora_admin.py, no grpc): a load goes to every worker of
the base model at once (all roles, no other model's) and answers once the scheduler lists the
adapter on them; nothing is called when a check fails first (a worker without lora_runtime, a
name already loaded, a stale scheduler); a worker's failure unloads it from those that loaded it
(and from those that never answered), never from one that had it already, and the first error is
returned; an unload refused for running requests loads it again where it was unloaded; a caller
that goes away does not stop a rollback; the service's permission, base model and card refresh."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import pytest

from services.gateway import convert
from services.gateway.lora_admin import AdapterInUse, LoraAdmin, LoraUpdate
from services.gateway.ports import ClusterState, ClusterWorker, ModelCard
from services.gateway.service import GatewayService
from services.gateway.settings import GatewaySettings
from services.gateway.tokenization import PromptTokenizer
from shared.cluster import LORA_RUNTIME_CAPABILITY, Role
from shared.errors import (
    AlreadyExists,
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    Unavailable,
)
from shared.proto import common_pb2, scheduler_pb2

RUNTIME = ("generated_tokens", "lora", LORA_RUNTIME_CAPABILITY)


def node(
    worker_id: str,
    role: Role = Role.UNIFIED,
    model: str = "m",
    *adapters: str,
    caps: tuple[str, ...] = RUNTIME,
) -> ClusterWorker:
    return ClusterWorker(worker_id, f"{worker_id}:1", role, model, caps, adapters)


class Cluster:
    """The scheduler's list (ClusterView) and the workers' LoRA calls (LoraWorkerClient) over it:
    a worker's change shows in the list after `lag` more reads. `fail` maps a worker id (or
    (op, worker id)) to the error its next load or unload (or that op) raises; `gate`, when set,
    holds every call until it is set."""

    def __init__(self, *workers: ClusterWorker, lag: int = 0, stale: bool = False) -> None:
        self.workers = {w.worker_id: w for w in workers}
        self.listed = dict(self.workers)  # what the scheduler shows
        self.pending: list[tuple[int, ClusterWorker]] = []  # (reads left, the worker's new info)
        self.lag = lag
        self.stale = stale
        self.fail: dict[str | tuple[str, str], BaseException] = {}
        self.calls: list[tuple[str, str, str]] = []  # (op, worker id, name)
        self.paths: dict[tuple[str, str], str] = {}
        self.gate: asyncio.Event | None = None
        self.in_flight = 0
        self.most_in_flight = 0

    async def cluster_state(self, timeout_s: float | None) -> ClusterState:
        self.pending = [(left - 1, w) for left, w in self.pending]
        for _, w in [p for p in self.pending if p[0] < 0]:
            self.listed[w.worker_id] = w
        self.pending = [p for p in self.pending if p[0] >= 0]
        return ClusterState(tuple(self.listed.values()), self.stale)

    async def _call(self, op: str, worker: ClusterWorker, name: str) -> None:
        self.calls.append((op, worker.worker_id, name))
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            if self.gate is not None:
                await self.gate.wait()
            error = self.fail.pop((op, worker.worker_id), None) or self.fail.pop(worker.worker_id, None)
            if error is not None:
                raise error
        finally:
            self.in_flight -= 1

    def _change(self, worker_id: str, adapters: tuple[str, ...]) -> None:
        w = dataclasses.replace(self.workers[worker_id], lora_adapters=adapters)
        self.workers[worker_id] = w
        self.pending.append((self.lag, w))

    async def load_lora_adapter(self, worker: ClusterWorker, name: str, path: str, timeout_s: float) -> None:
        await self._call("load", worker, name)
        held = self.workers[worker.worker_id].lora_adapters
        if name in held:
            raise AlreadyExists(f"{worker}: {name!r} is loaded")
        self.paths[(worker.worker_id, name)] = path
        self._change(worker.worker_id, (*held, name))

    async def unload_lora_adapter(self, worker: ClusterWorker, name: str, timeout_s: float) -> str:
        await self._call("unload", worker, name)
        held = self.workers[worker.worker_id].lora_adapters
        if name not in held:
            raise NotFound(f"{worker}: {name!r} is not loaded")
        self._change(worker.worker_id, tuple(a for a in held if a != name))
        return self.paths.pop((worker.worker_id, name), "/start/" + name)

    def adapters(self) -> dict[str, tuple[str, ...]]:
        return {wid: w.lora_adapters for wid, w in self.workers.items()}


def admin(cluster: Cluster, settle_timeout_s: float = 5.0) -> LoraAdmin:
    return LoraAdmin(cluster, cluster, call_timeout_s=5.0, settle_timeout_s=settle_timeout_s, poll_s=0.001)


DISAGG = (node("p1", Role.PREFILL), node("d1", Role.DECODE), node("d2", Role.DECODE))


async def test_a_load_reaches_every_worker_of_the_base_model_at_once_and_waits_for_the_scheduler() -> None:
    cluster = Cluster(*DISAGG, node("u9", Role.UNIFIED, "other"), lag=3)
    cluster.gate = asyncio.Event()
    task = asyncio.create_task(admin(cluster).load("m", "sql", "/a/sql"))
    while cluster.in_flight < 3:
        await asyncio.sleep(0)
    cluster.gate.set()  # all three were called before any answered: concurrently
    update = await task
    assert update == LoraUpdate("sql", ("p1", "d1", "d2"))
    assert cluster.most_in_flight == 3
    assert {wid for _, wid, _ in cluster.calls} == {"p1", "d1", "d2"}  # not the other model's
    # it answered only once the scheduler listed the adapter on every one of them
    assert all("sql" in w.lora_adapters for w in cluster.listed.values() if w.model_id == "m")
    assert cluster.listed["u9"].lora_adapters == ()


@pytest.mark.parametrize(
    ("workers", "name", "error", "match"),
    [
        (
            (node("u1"), node("u2", caps=("lora",))),
            "sql",
            FailedPrecondition,
            r"unified worker u2 \(u2:1\) cannot load",
        ),
        (
            (node("u1"), node("u2", Role.UNIFIED, "m", "sql")),
            "sql",
            AlreadyExists,
            r"already loaded \(on unified worker u2",
        ),
        ((node("u1"), node("x1", Role.UNIFIED, "other", "sql")), "sql", AlreadyExists, "already loaded"),
        ((node("u1"), node("x1", Role.UNIFIED, "sql")), "sql", AlreadyExists, "already loaded"),
        ((node("u1"),), "m", AlreadyExists, "base model's id"),
        ((node("u1"),), "", InvalidArgument, "both lora_name and lora_path"),
        ((node("x1", Role.UNIFIED, "other"),), "sql", Unavailable, "no worker of 'm'"),
    ],
)
async def test_a_load_that_fails_a_check_touches_no_worker(
    workers: tuple[ClusterWorker, ...], name: str, error: type[Exception], match: str
) -> None:
    cluster = Cluster(*workers)
    with pytest.raises(error, match=match):
        await admin(cluster).load("m", name, "/a/sql")
    assert cluster.calls == []


async def test_nothing_changes_while_the_schedulers_list_is_stale() -> None:
    cluster = Cluster(node("u1", Role.UNIFIED, "m", "sql"), stale=True)
    for update in (admin(cluster).load("m", "chat", "/a"), admin(cluster).unload("m", "sql")):
        with pytest.raises(Unavailable, match="lost the load-monitor"):
            await update
    assert cluster.calls == []


async def test_a_failed_load_is_undone_where_it_loaded_or_may_have_and_the_first_error_returned() -> None:
    """p1 refuses the adapter (the engine's reason), d2 never answers (it may still load it), d1
    loaded it: d1 and d2 unload it (d2's NOT_FOUND is quiet); the error is p1's, with a note."""
    cluster = Cluster(*DISAGG)
    cluster.fail = {
        "p1": FailedPrecondition(
            "prefill worker p1: LoRA adapter 'sql' (/bad): no adapter_config.json there"
        ),
        "d2": DeadlineExceeded("the request ran past its deadline at decode worker d2"),
    }
    with pytest.raises(FailedPrecondition) as err:
        await admin(cluster).load("m", "sql", "/bad")
    assert "no adapter_config.json there" in str(err.value)
    assert "nothing stays loaded by this call" in str(err.value)
    assert sorted(c for c in cluster.calls if c[0] == "unload") == [
        ("unload", "d1", "sql"),
        ("unload", "d2", "sql"),
    ]
    assert cluster.adapters() == {"p1": (), "d1": (), "d2": ()}


async def test_a_worker_that_had_the_adapter_already_keeps_it() -> None:
    """Another gateway's load got to d1 first (ALREADY_EXISTS there): this one unloads only what
    it loaded itself."""
    cluster = Cluster(*DISAGG)
    cluster.workers["d1"] = dataclasses.replace(cluster.workers["d1"], lora_adapters=("sql",))
    with pytest.raises(AlreadyExists, match="'sql' is loaded"):
        await admin(cluster).load("m", "sql", "/a/sql")
    assert sorted(c for c in cluster.calls if c[0] == "unload") == [
        ("unload", "d2", "sql"),
        ("unload", "p1", "sql"),
    ]
    assert cluster.adapters() == {"p1": (), "d1": ("sql",), "d2": ()}


async def test_a_load_the_scheduler_never_shows_is_undone() -> None:
    cluster = Cluster(node("u1"), lag=10**9)
    with pytest.raises(Unavailable, match=r"did not list the LoRA adapter 'sql'.*unloaded again"):
        await admin(cluster, settle_timeout_s=0.05).load("m", "sql", "/a/sql")
    assert cluster.adapters() == {"u1": ()}


async def test_a_caller_that_goes_away_does_not_stop_the_rollback() -> None:
    cluster = Cluster(node("u1"), node("u2"))
    cluster.fail = {"u2": FailedPrecondition("bad adapter")}
    cluster.gate = asyncio.Event()
    task = asyncio.create_task(admin(cluster).load("m", "sql", "/bad"))
    while cluster.in_flight < 2:
        await asyncio.sleep(0)
    task.cancel()
    cluster.gate.set()
    with pytest.raises(asyncio.CancelledError):
        await task
    for _ in range(100):
        await asyncio.sleep(0)
    assert ("unload", "u1", "sql") in cluster.calls and cluster.adapters() == {"u1": (), "u2": ()}


async def test_an_unload_leaves_every_worker_and_waits_for_the_scheduler() -> None:
    cluster = Cluster(
        node("p1", Role.PREFILL, "m", "sql", "chat"),
        node("d1", Role.DECODE, "m", "sql"),
        node("d2", Role.DECODE, "m", "chat"),
        lag=2,
    )
    update = await admin(cluster).unload("m", "sql")
    assert update == LoraUpdate("sql", ("p1", "d1"))
    assert {wid for _, wid, _ in cluster.calls} == {"p1", "d1"}
    assert not any("sql" in w.lora_adapters for w in cluster.listed.values())
    assert cluster.adapters() == {"p1": ("chat",), "d1": (), "d2": ("chat",)}
    with pytest.raises(NotFound, match="'sql' is not loaded on any worker of 'm'"):
        await admin(cluster).unload("m", "sql")


async def test_an_unload_refused_for_running_requests_is_undone() -> None:
    """d1 still runs a request of it: p1, which had unloaded it, loads it again from the folder
    it had it from; the answer is AdapterInUse (FAILED_PRECONDITION) saying so."""
    cluster = Cluster(node("p1", Role.PREFILL, "m", "sql"), node("d1", Role.DECODE, "m", "sql"))
    cluster.paths[("p1", "sql")] = "/adapters/sql"
    cluster.fail = {"d1": FailedPrecondition("decode worker d1: 'sql' has 1 request(s) queued or running")}
    with pytest.raises(AdapterInUse, match=r"queued or running; 'sql' stays loaded on every worker"):
        await admin(cluster).unload("m", "sql")
    assert cluster.calls[-1] == ("load", "p1", "sql") and cluster.paths[("p1", "sql")] == "/adapters/sql"
    assert cluster.adapters() == {"p1": ("sql",), "d1": ("sql",)}
    assert (await admin(cluster).unload("m", "sql")).worker_ids == ("p1", "d1")  # once they ended


async def test_an_unload_where_a_worker_no_longer_has_it_counts_as_done_there() -> None:
    """The scheduler's list was behind: u2 had unloaded it already (its registration is on the way)."""
    cluster = Cluster(node("u1", Role.UNIFIED, "m", "sql"), node("u2", Role.UNIFIED, "m", "sql"), lag=1)
    cluster._change("u2", ())
    assert (await admin(cluster).unload("m", "sql")).worker_ids == ("u1", "u2")


# --- the service: permission, base model, cards ---


class Scheduler(Cluster):
    """The cluster, plus list_models as the scheduler's GetState would list them."""

    async def list_models(self) -> list[ModelCard]:
        state = await self.cluster_state(None)
        return [ModelCard("m", 64)] + [
            ModelCard(a, 64, "m") for a in sorted({a for w in state.workers for a in w.lora_adapters})
        ]


def service(cluster: Scheduler, allow: bool = True) -> GatewayService:
    none: Any = None
    return GatewayService(
        GatewaySettings(allow_runtime_lora_updating=allow),
        cluster,  # type: ignore[arg-type]  # lists models only (no request is scheduled here)
        none,
        PromptTokenizer(object(), "m", 100),
        lora_admin=admin(cluster),
    )


async def test_the_service_refuses_updates_unless_allowed() -> None:
    cluster = Scheduler(node("u1"))
    off = service(cluster, allow=False)
    with pytest.raises(PermissionDenied, match="--allow-runtime-lora-updating"):
        await off.load_lora_adapter("", "sql", "/a/sql")
    with pytest.raises(PermissionDenied, match="PDSERVE_ALLOW_RUNTIME_LORA_UPDATING"):
        await off.unload_lora_adapter("", "sql")
    assert cluster.calls == []
    await off.close()


async def test_the_service_names_the_adapter_at_once_after_a_load_and_not_after_an_unload() -> None:
    cluster = Scheduler(node("u1"), lag=2)
    svc = service(cluster)
    assert [c.id for c in await svc.list_models()] == ["m"]  # the cards are fresh now: no miss refresh
    await svc.load_lora_adapter("m", "sql", "/a/sql")
    assert await svc.lora_adapter("sql") == "sql"
    await svc.unload_lora_adapter("", "sql")
    with pytest.raises(NotFound, match="'sql' is not served here"):
        await svc.lora_adapter("sql")
    with pytest.raises(NotFound, match="'other' is not served here; this gateway serves 'm'"):
        await svc.load_lora_adapter("other", "sql", "/a/sql")
    await svc.close()


def test_the_schedulers_state_converts_to_the_workers_an_update_reaches() -> None:
    info = common_pb2.WorkerInfo(
        worker_id="d1",
        address="d1:1",
        role=common_pb2.WORKER_ROLE_DECODE,
        model_id="m",
        capabilities=["lora", LORA_RUNTIME_CAPABILITY],
        lora_adapters=["sql"],
    )
    unknown_role = common_pb2.WorkerInfo(worker_id="x", address="x:1", model_id="m")
    state = scheduler_pb2.GetStateResponse(
        workers=[scheduler_pb2.SchedulerWorker(info=info), scheduler_pb2.SchedulerWorker(info=unknown_role)],
        stale=True,
    )
    assert convert.cluster_state(state) == ClusterState(
        (ClusterWorker("d1", "d1:1", Role.DECODE, "m", ("lora", LORA_RUNTIME_CAPABILITY), ("sql",)),), True
    )
    update = LoraUpdate("sql", ("p1", "d1"))
    assert list(convert.load_lora_adapter_response(update).worker_ids) == ["p1", "d1"]
    assert list(convert.unload_lora_adapter_response(update).worker_ids) == ["p1", "d1"]


async def test_a_rollback_that_fails_says_where() -> None:
    """u1 loaded it, u2 refused, and u1's unload fails: the answer names u1 instead of claiming
    that nothing stays loaded."""
    cluster = Cluster(node("u1"), node("u2"))
    cluster.fail = {
        "u2": FailedPrecondition("bad adapter"),
        ("unload", "u1"): Unavailable("u1 is unavailable"),
    }
    with pytest.raises(FailedPrecondition, match=r"bad adapter; undoing it failed on unified worker u1"):
        await admin(cluster).load("m", "sql", "/bad")
    assert cluster.adapters() == {"u1": ("sql",), "u2": ()}
