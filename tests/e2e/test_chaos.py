"""Chaos over real processes (tiny models, few requests): the stack's processes and KV survive,
or go away, as an operator expects when something is killed with SIGKILL."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from shared.proto import gateway_pb2, gateway_pb2_grpc
from tests.support.stack import ROOT, Stack, free_port_base, running_stack

pytestmark = pytest.mark.e2e


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
        [sys.executable, "-m", "services.cli", "up", "--model", str(tiny_bpe_model), "--port-base",
         str(base), "--log-dir", str(tmp_path), "--torch-threads", "1"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    children: list[int] = []
    try:
        assert up.stdout is not None
        for line in up.stdout:
            if line.startswith("pdserve is up"):
                break
        else:
            pytest.fail(f"pdserve up exited ({up.wait()}) before it was up")
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
    with running_stack(
        str(tiny_bpe_model), tmp_path_factory.mktemp("logs-chaos"), up_args=["--decode-workers", "2"]
    ) as stack:
        yield stack


PROMPTS = ["The cache keeps", "Disaggregated serving moves", "A worker died while", "Tokens flow from"]


def _request(i: int) -> gateway_pb2.GenerateRequest:
    sampling: dict[str, Any] = dict(temperature=0) if i % 2 == 0 else dict(temperature=1.0, seed=1234 + i)
    return gateway_pb2.GenerateRequest(
        prompt=PROMPTS[i], max_tokens=160, ignore_eos=True, return_token_ids=True, **sampling
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
    and token ids as an undisturbed run (greedy and seeded), exact usage."""
    stack = two_decode_stack
    base = stack.port_base
    async with grpc.aio.insecure_channel(stack.gateway) as ch:
        stub = gateway_pb2_grpc.GatewayStub(ch)
        undisturbed = [await _stream(stub, i) for i in range(len(PROMPTS))]
        started = [asyncio.Event() for _ in PROMPTS]
        tasks = [asyncio.ensure_future(_stream(stub, i, started[i])) for i in range(len(PROMPTS))]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 60)
        os.kill(_pid_listening_on(f"127.0.0.1:{base + 20}"), signal.SIGKILL)
        disturbed = await asyncio.gather(*tasks)
    gateway_log = (stack.log_dir / "gateway.log").read_text()
    assert gateway_log.count('"event": "migrating"') >= 1, "no stream was on the killed worker"
    for i, (want, got) in enumerate(zip(undisturbed, disturbed, strict=True)):
        assert [t for f in got for t in f.token_ids] == [t for f in want for t in f.token_ids], i
        assert "".join(f.text for f in got) == "".join(f.text for f in want), i
        assert got[-1].usage.completion_tokens == 160
        assert got[-1].usage.prompt_tokens == want[-1].usage.prompt_tokens
        assert got[-1].finish_reason == want[-1].finish_reason
        assert got[0].kind == gateway_pb2.FRAME_KIND_FIRST
        assert gateway_pb2.FRAME_KIND_FIRST not in [f.kind for f in got][1:]
