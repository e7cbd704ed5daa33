"""Chaos over real processes (tiny models, few requests): the stack's processes and KV survive,
or go away, as an operator expects when something is killed with SIGKILL."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import grpc
import httpx
import jsonschema
import openai
import pytest

from services import up_processes
from services.gateway.batches import BatchStatus, BatchStore
from shared.cluster import NIXL_CAPABILITY
from shared.proto import (
    common_pb2,
    gateway_pb2,
    gateway_pb2_grpc,
    load_monitor_pb2,
    load_monitor_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)
from tests.support.stack import ROOT, Stack, free_port_base, running_processes

pytestmark = pytest.mark.e2e

Metadata = Sequence[tuple[str, str]]  # internal calls carry the stack's cluster token


def _children_of(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == pid:
            out.append(int(entry.name))
    return out


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited


def test_sigkill_of_pdserve_up_takes_every_service_down(tiny_bpe_model: Path, tmp_path: Path) -> None:
    base = free_port_base()
    up = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "services.cli",
            "up",
            "--model",
            str(tiny_bpe_model),
            "--port-base",
            str(base),
            "--log-dir",
            str(tmp_path),
            "--torch-threads",
            "1",
            "--ready-timeout-s",
            "300",
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    children: list[int] = []
    try:
        assert up.stdout is not None
        seen = []
        for line in up.stdout:
            seen.append(line)
            if line.startswith("pdserve is up"):
                break
        else:
            pytest.fail(f"pdserve up exited ({up.wait()}) before it was up:\n{''.join(seen)}")
        children = _children_of(up.pid)
        assert len(children) == 5, children
        up.send_signal(signal.SIGKILL)
        up.wait()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and any(_alive(p) for p in children):
            time.sleep(0.2)
        alive = [p for p in children if _alive(p)]
        assert not alive, f"services outlived a SIGKILLed pdserve up: {alive}"
    finally:
        for pid in children:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        if up.poll() is None:
            up.kill()
            up.wait()


def _pid_listening_on(address: str) -> int:
    """The pid of the stack's process started with `--listen address`."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"--listen" in argv and address.encode() in argv:
            return int(entry.name)
    raise LookupError(f"no process listens on {address}")


@pytest.fixture(scope="module")
def two_decode_stack(tiny_bpe_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with running_processes(
        str(tiny_bpe_model),
        tmp_path_factory.mktemp("logs-chaos"),
        # n-gram speculation on every worker: the migrations below carry logprobs, penalty counts
        # and a grammar's state with speculation on (proposals verified, rejected tails rolled back)
        up_args=["--prefill-workers", "2", "--decode-workers", "2", "--worker-arg=--speculative=ngram"],
    ) as stack:
        yield stack


async def test_the_chaos_stack_moves_kv_over_nixl_where_it_loads(two_decode_stack: Stack) -> None:
    """With nixl-cu13 installed every worker offers NIXL, so the gateway pairs them over it and
    the kills and cancels of this module hit the NIXL path (READs in flight included)."""
    try:
        import nixl_cu13._api  # noqa: F401
    except ImportError:
        pytest.skip("nixl-cu13 is not installed: the stack moves KV over the gRPC push")
    base = two_decode_stack.port_base
    for address in (f"127.0.0.1:{base + o}" for o in (10, 11, 20, 21)):
        async with grpc.aio.insecure_channel(address) as ch:
            info = await worker_pb2_grpc.WorkerStub(ch).Info(
                worker_pb2.InfoRequest(), metadata=two_decode_stack.internal_metadata, timeout=10
            )
        assert NIXL_CAPABILITY in info.capabilities, address


PROMPTS = [
    "The cache keeps",
    "Disaggregated serving moves",
    "A worker died while",
    "Tokens flow from",
    "The grammar holds while",
]
GRAMMAR = r"[a-z ]+"  # the last stream's structured output (regex): its matcher state migrates too
# Long enough that every stream still runs when the victim is picked and stopped: with the tiny
# model a 160-token stream ended in ~0.2 s, sometimes before the first GetLoad saw it.
STREAM_TOKENS = 1000


def _request(i: int) -> gateway_pb2.GenerateRequest:
    sampling: dict[str, Any] = dict(temperature=0) if i % 2 == 0 else dict(temperature=1.0, seed=1234 + i)
    if i == 4:
        sampling = dict(temperature=1.0, seed=99, structured=common_pb2.StructuredOutput(regex=GRAMMAR))
    if i >= 2:  # penalty counts and logprobs survive the migration too
        sampling.update(
            presence_penalty=0.4, frequency_penalty=0.2, repetition_penalty=1.1, logit_bias={7: 2.0}
        )
        sampling.update(logprobs=2)
    return gateway_pb2.GenerateRequest(
        prompt=PROMPTS[i], max_tokens=STREAM_TOKENS, ignore_eos=True, return_token_ids=True, **sampling
    )


async def _stream(
    stub: gateway_pb2_grpc.GatewayStub, i: int, started: asyncio.Event | None = None
) -> list[gateway_pb2.GenerateResponse]:
    frames = []
    async for frame in stub.Generate(_request(i), timeout=120):
        frames.append(frame)
        if started is not None and len(frames) == 2:
            started.set()
    return frames


async def test_kill9_of_a_decode_worker_mid_stream_migrates_every_stream(two_decode_stack: Stack) -> None:
    """Streams on a decode worker killed with SIGKILL complete on the other one: the same text
    and token ids as an undisturbed run (greedy and seeded), exact usage; so does a tool call
    through the OpenAI client (its grammar's state migrates), all with speculation on."""
    stack = two_decode_stack
    base = stack.port_base
    client = openai.AsyncOpenAI(base_url=stack.http_base_url, api_key="none", max_retries=0)
    async with client, grpc.aio.insecure_channel(stack.gateway) as ch:
        stub = gateway_pb2_grpc.GatewayStub(ch)
        decode_workers = [f"127.0.0.1:{base + 20}", f"127.0.0.1:{base + 21}"]
        undisturbed = [await _stream(stub, i) for i in range(len(PROMPTS))]
        undisturbed_call = await _tool_call(client, "tool-call-undisturbed")
        # the tool call starts alone, so the decode worker running a request is the one it is on:
        # that worker is killed, so this call surely migrates (with the gRPC streams beside it)
        call_started = asyncio.Event()
        call = asyncio.ensure_future(_tool_call(client, "tool-call-migrated", call_started))
        await asyncio.wait_for(call_started.wait(), 60)
        victim = await _the_one_running(decode_workers, stack.internal_metadata, within_s=30)
        started = [asyncio.Event() for _ in PROMPTS]
        tasks = [asyncio.ensure_future(_stream(stub, i, started[i])) for i in range(len(PROMPTS))]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 60)
        assert not call.done(), "the tool call ended before the kill: make its argument longer"
        os.kill(_pid_listening_on(victim), signal.SIGKILL)
        disturbed = await asyncio.gather(*tasks)
        migrated_call = await call
        survivor = next(a for a in decode_workers if a != victim)
        async with grpc.aio.insecure_channel(survivor) as wch:
            load = await worker_pb2_grpc.WorkerStub(wch).GetLoad(
                worker_pb2.GetLoadRequest(), timeout=5, metadata=stack.internal_metadata
            )
        assert sum(r.spec_draft_tokens for r in load.ranks) > 0, "speculation is on: proposals verified"
    gateway_log = (stack.log_dir / "gateway.log").read_text()
    assert gateway_log.count('"event": "migrating"') >= 1, "no stream was on the killed worker"
    _assert_same_as_undisturbed(undisturbed, disturbed)
    # the tool call (HTTP, openai client, named function, speculation on) migrated and came out
    # as undisturbed: the same arguments, valid against the schema, finish_reason, exact usage
    migrations = [json.loads(line) for line in gateway_log.splitlines() if '"event": "migrating"' in line]
    assert any(m.get("request_id") == "tool-call-migrated" for m in migrations), migrations
    assert migrated_call == undisturbed_call
    name, arguments, reason, _ = migrated_call
    assert (name, reason) == ("write_down", "tool_calls")
    jsonschema.validate(json.loads(arguments), TOOL_PARAMS)


# A named function whose one argument is a long string: the grammar keeps the call running
# (1,000 characters or more: hundreds of the tiny tokenizer's tokens) long enough to be migrated.
TOOL_PARAMS: dict[str, Any] = {
    "type": "object",
    "properties": {"text": {"type": "string", "minLength": 1000}},
    "required": ["text"],
    "additionalProperties": False,
}


async def _tool_call(
    client: openai.AsyncOpenAI, request_id: str, started: asyncio.Event | None = None
) -> tuple[str, str, str | None, tuple[int, int]]:
    """A streamed chat tool call: (function name, arguments reassembled from the deltas,
    finish_reason, (prompt, completion) tokens of the usage)."""
    stream = await client.chat.completions.create(
        model="",
        messages=[{"role": "user", "content": "Write it down."}],
        tools=[{"type": "function", "function": {"name": "write_down", "parameters": TOOL_PARAMS}}],
        tool_choice={"type": "function", "function": {"name": "write_down"}},
        max_tokens=1500,  # the prompt (tools in the template) is ~520 tokens of 2,048
        temperature=1.0,
        seed=11,
        stream=True,
        stream_options={"include_usage": True},
        extra_headers={"X-Request-Id": request_id},
    )
    name, arguments, reason, usage = "", "", None, (0, 0)
    async for chunk in stream:
        if chunk.usage is not None:
            usage = (chunk.usage.prompt_tokens, chunk.usage.completion_tokens)
        if not chunk.choices:
            continue
        if started is not None:
            started.set()  # the gateway answered: the request is scheduled
        for tc in chunk.choices[0].delta.tool_calls or ():
            if tc.function is not None:
                name += tc.function.name or ""
                arguments += tc.function.arguments or ""
        reason = chunk.choices[0].finish_reason or reason
    return name, arguments, reason, usage


async def _streams_and_their_busiest_worker(
    stub: gateway_pb2_grpc.GatewayStub, decode_workers: list[str], metadata: Metadata
) -> tuple[list[Any], list[asyncio.Task[Any]], str]:
    """Every prompt streamed once undisturbed, then all again at once: (the undisturbed frames,
    the running streams' tasks, the decode worker carrying the most of them)."""
    undisturbed = [await _stream(stub, i) for i in range(len(PROMPTS))]
    started = [asyncio.Event() for _ in PROMPTS]
    tasks = [asyncio.ensure_future(_stream(stub, i, started[i])) for i in range(len(PROMPTS))]
    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 60)
    running = await _running(decode_workers, metadata)
    victim = max(decode_workers, key=lambda a: running.get(a, 0))  # the one carrying streams
    assert running.get(victim, 0) > 0, running
    return undisturbed, tasks, victim


def _assert_same_as_undisturbed(undisturbed: list[Any], disturbed: list[Any]) -> None:
    """Migrated streams: the undisturbed run's ids and text, exact usage, one FIRST frame first."""
    for i, (want, got) in enumerate(zip(undisturbed, disturbed, strict=True)):
        assert [t for f in got for t in f.token_ids] == [t for f in want for t in f.token_ids], i
        assert "".join(f.text for f in got) == "".join(f.text for f in want), i
        assert got[-1].usage.completion_tokens == STREAM_TOKENS
        assert got[-1].usage.prompt_tokens == want[-1].usage.prompt_tokens
        assert got[-1].finish_reason == want[-1].finish_reason
        assert got[0].kind == gateway_pb2.FRAME_KIND_FIRST
        assert gateway_pb2.FRAME_KIND_FIRST not in [f.kind for f in got][1:]
        want_lp = [lp for f in want for lp in f.logprobs]
        got_lp = [lp for f in got for lp in f.logprobs]
        assert len(got_lp) == len(want_lp) == (STREAM_TOKENS if i >= 2 else 0), i
        assert [lp.token_id for lp in got_lp] == [lp.token_id for lp in want_lp], i
        assert all(abs(a.logprob - b.logprob) <= 1e-5 for a, b in zip(got_lp, want_lp, strict=True)), i
        if i == 4:
            assert re.fullmatch(GRAMMAR, "".join(f.text for f in got)), i


async def _used_tokens(addresses: list[str], metadata: Metadata) -> dict[str, int]:
    """KV tokens in use per reachable worker (GetLoad)."""
    out = {}
    for address in addresses:
        async with grpc.aio.insecure_channel(address) as ch:
            try:
                load = await worker_pb2_grpc.WorkerStub(ch).GetLoad(
                    worker_pb2.GetLoadRequest(), timeout=5, metadata=metadata
                )
            except grpc.aio.AioRpcError:
                continue  # a killed worker
        out[address] = sum(r.num_used_tokens for r in load.ranks)
    return out


async def _running(addresses: list[str], metadata: Metadata) -> dict[str, int]:
    """Requests running per reachable worker (GetLoad)."""
    out = {}
    for address in addresses:
        async with grpc.aio.insecure_channel(address) as ch:
            try:
                load = await worker_pb2_grpc.WorkerStub(ch).GetLoad(
                    worker_pb2.GetLoadRequest(), timeout=5, metadata=metadata
                )
            except grpc.aio.AioRpcError:
                continue
        out[address] = sum(r.num_running for r in load.ranks)
    return out


async def _the_one_running(addresses: list[str], metadata: Metadata, within_s: float) -> str:
    """The address of the one worker running a request (polled until one is, within_s)."""
    deadline = time.monotonic() + within_s
    while True:
        running = [a for a, n in (await _running(addresses, metadata)).items() if n > 0]
        if len(running) == 1:
            return running[0]
        assert not running and time.monotonic() < deadline, running
        await asyncio.sleep(0.02)


async def _all_freed(addresses: list[str], within_s: float, metadata: Metadata) -> dict[str, int]:
    deadline = time.monotonic() + within_s
    used = await _used_tokens(addresses, metadata)
    while any(used.values()) and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
        used = await _used_tokens(addresses, metadata)
    return used


def _workers(stack: Stack) -> list[str]:
    base = stack.port_base
    return [f"127.0.0.1:{base + o}" for o in (10, 11, 20, 21)]


async def test_kill9_of_a_prefill_worker_during_prefill_and_push(two_decode_stack: Stack) -> None:
    """Long prompts in flight when a prefill worker dies: every request completes (retried before
    handoff on the other prefill worker, or, when its first token had gone out before the
    handoff ended, moved on with it: the decode worker ends a request whose push broke) and no
    decode worker keeps KV of a broken push."""
    stack = two_decode_stack
    victim = f"127.0.0.1:{stack.port_base + 11}"
    long_prompt = " ".join(f"word{i}" for i in range(120))
    async with grpc.aio.insecure_channel(stack.gateway) as ch:
        stub = gateway_pb2_grpc.GatewayStub(ch)
        req = gateway_pb2.GenerateRequest(prompt=long_prompt, max_tokens=8, ignore_eos=True, temperature=0)
        calls = [asyncio.ensure_future(stub.Complete(req, timeout=120)) for _ in range(12)]
        await asyncio.sleep(0.05)
        os.kill(_pid_listening_on(victim), signal.SIGKILL)
        replies = await asyncio.gather(*calls, return_exceptions=True)
    failed = [r for r in replies if isinstance(r, BaseException)]
    assert not failed, failed
    assert {r.usage.completion_tokens for r in replies if not isinstance(r, BaseException)} == {8}
    survivors = [w for w in _workers(stack) if w != victim]
    used = await _all_freed(survivors, within_s=15, metadata=stack.internal_metadata)
    assert not any(used.values()), f"KV still held after every request ended: {used}"


async def test_cancel_storm_leaves_every_pool_free(two_decode_stack: Stack) -> None:
    """40 streams: 30 % cancelled mid-stream, 10 % past a short deadline, the rest complete; then
    every worker's KV pool is free again and the stack still serves."""
    stack = two_decode_stack
    async with grpc.aio.insecure_channel(stack.gateway) as ch:
        stub = gateway_pb2_grpc.GatewayStub(ch)

        async def one(i: int) -> str:
            req = gateway_pb2.GenerateRequest(
                prompt=f"storm {i} " * 6, max_tokens=60 if i % 10 < 6 else 400, ignore_eos=True
            )
            timeout = 0.3 if i % 10 == 9 else 120
            call = stub.Generate(req, timeout=timeout)
            n = 0
            try:
                async for _ in call:
                    n += 1
                    if i % 10 in (6, 7, 8) and n == 3:
                        call.cancel()
                        return "cancelled"
            except grpc.aio.AioRpcError as exc:
                return exc.code().name
            return "ok"

        outcomes = await asyncio.gather(*(one(i) for i in range(40)))
        assert outcomes.count("ok") >= 24, outcomes
        assert set(outcomes) <= {"ok", "cancelled", "DEADLINE_EXCEEDED"}, outcomes
        used = await _all_freed(_workers(stack), within_s=15, metadata=stack.internal_metadata)
        assert not any(used.values()), f"KV still held after the storm: {used}"
        reply = await stub.Complete(
            gateway_pb2.GenerateRequest(prompt="after the storm", max_tokens=4, ignore_eos=True), timeout=60
        )
        assert reply.usage.completion_tokens == 4


def test_kill9_of_the_gateway_frees_every_workers_kv_and_a_new_gateway_finishes_its_batch(
    tiny_bpe_model: Path, tmp_path: Path
) -> None:
    """Streams in flight when the gateway dies: the workers see their calls end and free the KV.
    A batch it was running (requests in flight too) is finished by the gateway started after it
    on the same --batch-dir (its run lock died with it), each request answered once. On the same
    --response-dir, the background response it was running, which had written output (so it
    cannot be run again exactly), reads as failed (not in progress forever) and a stored
    conversation goes on."""
    batches = tmp_path / "batches"
    gateway_args = [
        "--batch-dir",
        str(batches),
        "--gateway-arg=--batch-concurrency=2",
        "--response-dir",
        str(tmp_path / "responses"),
    ]
    with running_processes(str(tiny_bpe_model), tmp_path, up_args=gateway_args) as stack:
        workers = [stack.prefill or "", stack.decode or ""]
        client = openai.OpenAI(base_url=stack.http_base_url, api_key="none", max_retries=0)
        bodies = {f"r{i}": {"prompt": f"batch {i}", "max_tokens": 300, "ignore_eos": True} for i in range(6)}
        lines = [
            {"custom_id": k, "method": "POST", "url": "/v1/completions", "body": b} for k, b in bodies.items()
        ]
        upload = client.files.create(
            file=("in.jsonl", "".join(json.dumps(x) + "\n" for x in lines).encode()), purpose="batch"
        )
        batch = client.batches.create(
            input_file_id=upload.id, endpoint="/v1/completions", completion_window="24h"
        )
        kept = client.responses.create(model="", input="remember this", max_output_tokens=4)
        background = client.responses.create(
            model="", input="go on", background=True, max_output_tokens=1500, extra_body={"ignore_eos": True}
        )
        with client.responses.retrieve(background.id, stream=True, timeout=60) as events:  # first output
            assert any(e.type == "response.output_text.delta" for e in events), "no output"

        async def run() -> dict[str, int]:
            ch = grpc.aio.insecure_channel(stack.gateway)
            stub = gateway_pb2_grpc.GatewayStub(ch)
            req = gateway_pb2.GenerateRequest(prompt="hold the kv " * 8, max_tokens=1500, ignore_eos=True)
            calls = [stub.Generate(req, timeout=120) for _ in range(4)]
            for call in calls:
                await call.read()  # each stream is running
            held = await _used_tokens(workers, stack.internal_metadata)
            assert any(held.values()), "no KV held while streams run"
            os.kill(_pid_listening_on(stack.gateway), signal.SIGKILL)
            used = await _all_freed(workers, within_s=10, metadata=stack.internal_metadata)
            await ch.close(grace=0)
            return used

        used = asyncio.run(run())
        assert not any(used.values()), f"KV held after the gateway died: {used}"
        left = BatchStore(batches).read(batch.id)  # what the dead gateway left
        assert left.status == BatchStatus.IN_PROGRESS and left.completed < 6, left
        successor = _gateway_like_the_stacks(stack, str(tiny_bpe_model), gateway_args, tmp_path)
        try:
            client = openai.OpenAI(base_url=stack.http_base_url, api_key="none", max_retries=3)
            deadline = time.monotonic() + 120
            while (done := client.batches.retrieve(batch.id)).status not in ("completed", "failed"):
                assert time.monotonic() < deadline, f"batch not finished: {done}\n{stack.logs()}"
                time.sleep(0.2)
            assert done.status == "completed" and done.request_counts is not None
            assert (done.request_counts.completed, done.request_counts.failed) == (6, 0)
            assert done.output_file_id is not None
            out = [json.loads(raw) for raw in client.files.content(done.output_file_id).text.splitlines()]
            assert sorted(x["custom_id"] for x in out) == sorted(bodies)  # each once
            assert {x["response"]["body"]["usage"]["completion_tokens"] for x in out} == {300}
            failed = client.responses.retrieve(background.id)
            assert failed.status == "failed" and failed.error is not None
            assert "stopped" in failed.error.message
            follow = client.responses.create(
                model="", input="and now?", previous_response_id=kept.id, max_output_tokens=4
            )
            assert follow.status in ("completed", "incomplete") and follow.previous_response_id == kept.id
        finally:
            up_processes.stop_all([successor], grace_s=10.0)


def _gateway_like_the_stacks(stack: Stack, model: str, up_args: list[str], log_dir: Path) -> Any:
    """A gateway process started as `pdserve up` starts the stack's own (same ports, scheduler,
    cluster token and flags), once the first is dead; returned when its HTTP health answers."""
    from services import up, up_shape

    args = up._parse(
        [
            "--model",
            model,
            "--port-base",
            str(stack.port_base),
            "--cluster-token",
            stack.cluster_token,
            *up_args,
        ]
    )
    child = next(c for c in up_shape.children(args, model) if c.name == "gateway")
    up_processes.start(child, str(log_dir / "successor"))
    health = f"http://127.0.0.1:{stack.port_base + 40}/health"
    deadline = time.monotonic() + 120
    while True:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(health, timeout=2).status_code == 200:
                return child
        assert time.monotonic() < deadline, "the new gateway did not come up"
        time.sleep(0.2)


# Leases short enough that a stopped worker leaves membership in a few seconds.
SHORT_LEASE_ARGS = [
    "--prefill-workers",
    "1",
    "--decode-workers",
    "2",
    "--load-monitor-arg=--lease-ttl-s=3",
    "--worker-arg=--heartbeat-interval-s=0.5",
    "--gateway-arg=--membership-poll-s=0.5",
    "--gateway-arg=--membership-probe-timeout-s=1",
]


async def _members(stack: Stack) -> set[str]:
    """Addresses of the workers the load-monitor holds a live lease for."""
    async with grpc.aio.insecure_channel(stack.load_monitor) as ch:
        snapshot = await load_monitor_pb2_grpc.LoadMonitorStub(ch).GetLoads(
            load_monitor_pb2.GetLoadsRequest(), timeout=5, metadata=stack.internal_metadata
        )
    return {w.info.address for w in snapshot.workers}


def test_sigstop_of_a_decode_worker_migrates_its_streams_once_it_leaves_membership(
    tiny_bpe_model: Path, tmp_path: Path
) -> None:
    """A decode worker carrying streams is stopped (SIGSTOP: alive, its connections open, silent).
    Once its lease expires the gateway migrates its streams: the same text and token ids as an
    undisturbed run (greedy and seeded), exact usage. After SIGCONT it finds its calls cancelled,
    frees their KV and rejoins the cluster."""
    with running_processes(str(tiny_bpe_model), tmp_path, up_args=SHORT_LEASE_ARGS) as stack:
        base = stack.port_base
        decode_workers = [f"127.0.0.1:{base + 20}", f"127.0.0.1:{base + 21}"]

        async def run() -> tuple[list[Any], list[Any], dict[str, int]]:
            async with grpc.aio.insecure_channel(stack.gateway) as ch:
                stub = gateway_pb2_grpc.GatewayStub(ch)
                undisturbed, tasks, victim = await _streams_and_their_busiest_worker(
                    stub, decode_workers, stack.internal_metadata
                )
                pid = _pid_listening_on(victim)
                os.kill(pid, signal.SIGSTOP)
                try:
                    # before keepalive (30 s + its 10 s timeout) could end the silent calls
                    disturbed = await asyncio.wait_for(asyncio.gather(*tasks), 35)
                    assert victim not in await _members(stack)
                finally:
                    os.kill(pid, signal.SIGCONT)
                # Back: its cancelled calls free their KV, and it registers again.
                used = await _all_freed([victim], within_s=30, metadata=stack.internal_metadata)
                deadline = time.monotonic() + 30
                while victim not in await _members(stack) and time.monotonic() < deadline:
                    await asyncio.sleep(0.2)
                assert victim in await _members(stack), "the resumed worker did not rejoin"
                after = await stub.Complete(
                    gateway_pb2.GenerateRequest(prompt="after the stop", max_tokens=4, ignore_eos=True),
                    timeout=60,
                )
                assert after.usage.completion_tokens == 4
            return undisturbed, disturbed, used

        undisturbed, disturbed, used = asyncio.run(run())
        gateway_log = (stack.log_dir / "gateway.log").read_text()
    assert not any(used.values()), f"the resumed worker still holds KV: {used}"
    assert '"event": "worker_gone_abandoning_streams"' in gateway_log
    assert gateway_log.count('"event": "migrating"') >= 1
    _assert_same_as_undisturbed(undisturbed, disturbed)
