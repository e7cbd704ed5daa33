"""The README's grpcurl recipes: the parser, what the recipes cover, and each recipe run verbatim
(addresses remapped) against in-process servers with real reflection + health."""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from shared.proto import (
    common_pb2,
    gateway_pb2,
    gateway_pb2_grpc,
    load_monitor_pb2,
    load_monitor_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)
from tests.ops.grpcurl_recipes import (
    RecipeError,
    parse_recipes,
    recipe_argv,
    recipes,
)

GATEWAY, SCHEDULER, LOAD_MONITOR, PREFILL = (
    "127.0.0.1:50051",
    "127.0.0.1:50052",
    "127.0.0.1:50053",
    "127.0.0.1:50061",
)
ALLOWED_ADDRESSES = {GATEWAY, SCHEDULER, LOAD_MONITOR, PREFILL}


def md(*lines: str) -> str:
    return "\n".join(lines) + "\n"


# --- the parser --------------------------------------------------------------------------------


def test_parser_takes_grpcurl_lines_of_sh_blocks_inside_the_markers() -> None:
    text = md(
        "# Title",
        "```sh",
        "grpcurl -plaintext 127.0.0.1:1 list   ",
        "```",
        "<!-- ops:start -->",
        "Some prose with `grpcurl -plaintext x list` inline.",
        "```sh",
        "# a comment",
        "",
        "grpcurl -plaintext 127.0.0.1:50051 list",
        "helm install pdserve helm/pdserve",
        "$ grpcurl -plaintext 127.0.0.1:50053 pdserve.v1.LoadMonitor/GetLoads",
        "```",
        "```json",
        "grpcurl -plaintext 127.0.0.1:50051 describe",
        "```",
        "```",
        "grpcurl untagged block",
        "```",
        "```bash",
        'grpcurl -plaintext -d \'{"a": "b c"}\' \\',
        "  127.0.0.1:50051 pdserve.v1.Gateway/Generate",
        "```",
        "<!-- ops:end -->",
        "```sh",
        "grpcurl -plaintext after:1 list",
        "```",
    )
    assert parse_recipes(text) == [
        "grpcurl -plaintext 127.0.0.1:50051 list",
        "grpcurl -plaintext 127.0.0.1:50053 pdserve.v1.LoadMonitor/GetLoads",
        'grpcurl -plaintext -d \'{"a": "b c"}\' 127.0.0.1:50051 pdserve.v1.Gateway/Generate',
    ]


def test_parser_handles_longer_fences_containing_backticks() -> None:
    text = md("<!-- ops:start -->", "````sh", "grpcurl a", "```", "grpcurl b", "````", "<!-- ops:end -->")
    assert parse_recipes(text) == ["grpcurl a", "grpcurl b"]


@pytest.mark.parametrize(
    "text",
    [
        md("no markers"),
        md("<!-- ops:start -->", "```sh", "grpcurl x"),  # no end marker
        md("<!-- ops:end -->", "<!-- ops:start -->"),  # reversed
        md("<!-- ops:start -->", "<!-- ops:start -->", "<!-- ops:end -->"),  # twice
        md("<!-- ops:start -->", "```sh", "grpcurl x", "<!-- ops:end -->"),  # unterminated fence
    ],
)
def test_parser_rejects_malformed_sections(text: str) -> None:
    with pytest.raises(RecipeError):
        parse_recipes(text)


def test_recipe_argv_keeps_json_whole_and_remaps_addresses() -> None:
    cmd = 'grpcurl -plaintext -d \'{"prompt": "a b"}\' 127.0.0.1:50051 pdserve.v1.Gateway/Complete'
    assert recipe_argv(cmd, grpcurl="/x/grpcurl", addresses={GATEWAY: "127.0.0.1:4000"}) == [
        "/x/grpcurl",
        "-plaintext",
        "-d",
        '{"prompt": "a b"}',
        "127.0.0.1:4000",
        "pdserve.v1.Gateway/Complete",
    ]
    with pytest.raises(RecipeError):
        recipe_argv("helm list")


# --- what the README's recipes cover ------------------------------------------------------------


def readme_recipes() -> list[list[str]]:
    return [shlex.split(r) for r in recipes()]


def test_readme_recipes_cover_the_debugging_tasks() -> None:
    argvs = readme_recipes()
    assert argvs, "the README's ops section has no grpcurl recipes"

    def has(address: str, *words: str) -> bool:
        return any(address in a and all(w in a for w in words) for a in argvs)

    assert has(GATEWAY, "list")
    assert has(GATEWAY, "describe")
    assert has(GATEWAY, "grpc.health.v1.Health/Check")
    assert has(GATEWAY, "pdserve.v1.Gateway/Generate")
    assert has(GATEWAY, "pdserve.v1.Gateway/Complete")
    assert has(PREFILL, "pdserve.v1.Worker/GetLoad")
    assert has(LOAD_MONITOR, "pdserve.v1.LoadMonitor/GetLoads")
    generate = next(a for a in argvs if "pdserve.v1.Gateway/Generate" in a)
    body = json.loads(generate[generate.index("-d") + 1])
    assert body["messages"][0]["role"] == "user", "Generate recipe uses a chat message"


def test_readme_recipes_use_reflection_and_known_addresses() -> None:
    for argv in readme_recipes():
        assert argv[0] == "grpcurl" and "-plaintext" in argv
        assert not any(a.startswith(("-proto", "-import-path", "-protoset")) for a in argv), argv
        addresses = [a for a in argv if a.startswith("127.0.0.1:")]
        assert len(addresses) == 1 and addresses[0] in ALLOWED_ADDRESSES, argv
        if "-d" in argv:
            json.loads(argv[argv.index("-d") + 1])


# --- run verbatim against real reflection + health ---------------------------------------------


def grpcurl_binary() -> str | None:
    local = Path(sys.executable).parent / "grpcurl"
    return str(local) if local.is_file() else shutil.which("grpcurl")


class FakeGateway(gateway_pb2_grpc.GatewayServicer):
    def Generate(self, request, context):  # type: ignore[no-untyped-def]
        assert request.messages or request.prompt
        yield gateway_pb2.GenerateResponse(text="Paris", kind=gateway_pb2.FRAME_KIND_FIRST)
        yield gateway_pb2.GenerateResponse(
            text=".",
            kind=gateway_pb2.FRAME_KIND_FINAL,
            finish_reason=common_pb2.FINISH_REASON_STOP,
            usage=common_pb2.Usage(prompt_tokens=9, completion_tokens=2, total_tokens=11),
        )

    def Complete(self, request, context):  # type: ignore[no-untyped-def]
        return gateway_pb2.CompleteResponse(
            text=" of Rayleigh scattering", finish_reason=common_pb2.FINISH_REASON_LENGTH
        )

    def ListModels(self, request, context):  # type: ignore[no-untyped-def]
        return gateway_pb2.ListModelsResponse(models=[gateway_pb2.ModelCard(id="fake", max_model_len=2048)])

    def Tokenize(self, request, context):  # type: ignore[no-untyped-def]
        assert request.messages or request.prompt
        return gateway_pb2.TokenizeResponse(token_ids=[1, 2], count=2, model="fake", token_strs=["a", "b"])

    def LoadLoraAdapter(self, request, context):  # type: ignore[no-untyped-def]
        assert request.lora_name and request.lora_path
        return gateway_pb2.GatewayLoadLoraAdapterResponse(worker_ids=["w1"])

    def UnloadLoraAdapter(self, request, context):  # type: ignore[no-untyped-def]
        assert request.lora_name
        return gateway_pb2.GatewayUnloadLoraAdapterResponse(worker_ids=["w1"])


class FakeScheduler(scheduler_pb2_grpc.SchedulerServicer):
    def GetState(self, request, context):  # type: ignore[no-untyped-def]
        return scheduler_pb2.GetStateResponse()


class FakeLoadMonitor(load_monitor_pb2_grpc.LoadMonitorServicer):
    def GetLoads(self, request, context):  # type: ignore[no-untyped-def]
        return load_monitor_pb2.LoadSnapshot(version=3)


class FakeWorker(worker_pb2_grpc.WorkerServicer):
    def GetLoad(self, request, context):  # type: ignore[no-untyped-def]
        return worker_pb2.GetLoadResponse(worker_id="w1", ranks=[common_pb2.RankLoad(dp_rank=0)])

    def Info(self, request, context):  # type: ignore[no-untyped-def]
        return common_pb2.WorkerInfo(worker_id="w1", role=common_pb2.WORKER_ROLE_PREFILL)


def _serve(add, servicer, file_descriptor, service: str) -> tuple[grpc.Server, str]:  # type: ignore[no-untyped-def]
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    add(servicer, server)
    health_servicer = health.HealthServicer()
    for name in ("", file_descriptor.services_by_name[service].full_name):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    full_name = file_descriptor.services_by_name[service].full_name
    reflection.enable_server_reflection([full_name, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, f"127.0.0.1:{port}"


@pytest.fixture(scope="module")
def fake_stack() -> Iterator[dict[str, str]]:
    specs = {
        GATEWAY: (
            gateway_pb2_grpc.add_GatewayServicer_to_server,
            FakeGateway(),
            gateway_pb2.DESCRIPTOR,
            "Gateway",
        ),
        SCHEDULER: (
            scheduler_pb2_grpc.add_SchedulerServicer_to_server,
            FakeScheduler(),
            scheduler_pb2.DESCRIPTOR,
            "Scheduler",
        ),
        LOAD_MONITOR: (
            load_monitor_pb2_grpc.add_LoadMonitorServicer_to_server,
            FakeLoadMonitor(),
            load_monitor_pb2.DESCRIPTOR,
            "LoadMonitor",
        ),
        PREFILL: (
            worker_pb2_grpc.add_WorkerServicer_to_server,
            FakeWorker(),
            worker_pb2.DESCRIPTOR,
            "Worker",
        ),
    }
    servers = []
    mapping = {}
    try:
        for readme_address, (add, servicer, fd, service) in specs.items():
            server, address = _serve(add, servicer, fd, service)
            servers.append(server)
            mapping[readme_address] = address
        yield mapping
    finally:
        for server in servers:
            server.stop(None)


@pytest.mark.skipif(grpcurl_binary() is None, reason="grpcurl is not installed (make install)")
@pytest.mark.parametrize("command", recipes())
def test_recipe_runs_against_reflection(command: str, fake_stack: dict[str, str]) -> None:
    grpcurl = grpcurl_binary()
    assert grpcurl is not None
    argv = recipe_argv(command, grpcurl=grpcurl, addresses=fake_stack)
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, f"{command}\n{proc.stderr}"
    if "Health/Check" in command:
        assert json.loads(proc.stdout)["status"] == "SERVING"
    if command.endswith(" list"):
        assert "grpc.health.v1.Health" in proc.stdout
    if "Gateway/Generate" in command:
        assert "FRAME_KIND_FINAL" in proc.stdout
