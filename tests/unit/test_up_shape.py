"""`pdserve up`'s stack shape: worker counts per kind, their names, ports and pass-through flags
(pure argument handling; the e2e tests start real stacks)."""

from __future__ import annotations

import pytest

from services import up, up_processes, up_shape


def _children(*argv: str) -> list[up_shape.Child]:
    return up_shape.children(up._parse(["--port-base", "40000", *argv]), "/models/m")


def test_default_is_one_prefill_and_one_decode_worker() -> None:
    names = [c.name for c in _children()]
    assert names == ["load-monitor", "scheduler", "prefill-worker", "decode-worker", "gateway"]


def test_worker_counts_give_numbered_names_and_consecutive_ports() -> None:
    children = {c.name: c for c in _children("--prefill-workers", "2", "--decode-workers", "3")}
    assert [n for n in children if "worker" in n] == [
        "prefill-worker",
        "prefill-worker-1",
        "decode-worker",
        "decode-worker-1",
        "decode-worker-2",
    ]
    assert children["prefill-worker-1"].address == "127.0.0.1:40011"
    assert children["decode-worker-2"].address == "127.0.0.1:40022"
    args = children["decode-worker-2"].args
    assert args[args.index("--advertise-address") + 1] == "127.0.0.1:40022"


def test_unified_workers_replace_prefill_and_decode() -> None:
    children = _children("--unified-workers", "2", "--metrics")
    workers = [c for c in children if "worker" in c.name]
    assert [(c.name, c.address) for c in workers] == [
        ("worker", "127.0.0.1:40030"),
        ("worker-1", "127.0.0.1:40031"),
    ]
    assert all(c.args[c.args.index("--role") + 1] == "unified" for c in workers)
    assert workers[1].args[workers[1].args.index("--metrics-port") + 1] == "40081"
    assert [c.name for c in _children("--unified") if "worker" in c.name] == ["worker"]


def test_pass_through_flags_reach_only_their_service() -> None:
    children = {
        c.name: c
        for c in _children(
            "--scheduler-arg=--x-sched",
            "--gateway-arg=--x-gw",
            "--decode-worker-arg=--x-dec",
            "--prefill-worker-arg=--x-pre",
            "--worker-arg=--x-all",
            "--load-monitor-arg=--x-lm",
        )
    }
    assert "--x-sched" in children["scheduler"].args
    assert [n for n, c in children.items() if "--x-lm" in c.args] == ["load-monitor"]
    assert "--x-gw" in children["gateway"].args
    assert "--x-dec" in children["decode-worker"].args and "--x-pre" not in children["decode-worker"].args
    assert "--x-pre" in children["prefill-worker"].args
    assert all("--x-all" in children[n].args for n in ("prefill-worker", "decode-worker"))
    assert "--x-all" not in children["gateway"].args


@pytest.mark.parametrize(
    "argv", [["--decode-workers", "0"], ["--unified-workers", "11"], ["--prefill-workers", "-1"]]
)
def test_impossible_shapes_exit_with_one_line(argv: list[str]) -> None:
    with pytest.raises(SystemExit, match="must be between 1 and 10"):
        up._parse(argv)


def test_gateways_share_the_http_port_and_each_has_its_own_grpc_and_metrics_port() -> None:
    children = _children("--unified", "--gateways", "3", "--metrics")
    gateways = [c for c in children if c.module == "services.gateway"]
    assert [(c.name, c.address) for c in gateways] == [
        ("gateway", "127.0.0.1:40000"),
        ("gateway-1", "127.0.0.1:40091"),
        ("gateway-2", "127.0.0.1:40092"),
    ]

    def flag(c: up_shape.Child, name: str) -> str:
        return c.args[c.args.index(name) + 1]

    assert {flag(c, "--http-port") for c in gateways} == {"40040"}
    assert [flag(c, "--metrics-port") for c in gateways] == ["40050", "40141", "40142"]
    assert all("--http-reuse-port" in c.args for c in gateways)
    ports = {port for c in children for port in (c.address, flag(c, "--metrics-port"))}
    assert len(ports) == 2 * len(children)
    # one gateway (the default) keeps a port in use a start-up error: no SO_REUSEPORT
    assert not any("--http-reuse-port" in c.args for c in _children())
    with pytest.raises(SystemExit, match="--gateways must be between 1 and 9, got 0"):
        up._parse(["--gateways", "0"])


# --- the cluster token ---


def test_every_child_gets_one_random_cluster_token_in_its_environment_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("PDSERVE_CLUSTER_TOKEN", raising=False)
    children = _children()
    tokens = {c.env["PDSERVE_CLUSTER_TOKEN"] for c in children if c.env}
    assert len(tokens) == 1 and len(children) == 5 and all(c.env for c in children)
    (token,) = tokens
    assert len(token) >= 40  # secrets.token_urlsafe(32)
    assert all(token not in " ".join(c.args) for c in children), "a secret in argv is world-readable"
    gateway = next(c for c in children if c.name == "gateway")
    assert gateway.env is not None and "PDSERVE_API_KEYS" not in gateway.env
    assert _children()[0].env != children[0].env, "a new token per run"


def test_a_given_cluster_token_is_used_flag_first_then_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDSERVE_CLUSTER_TOKEN", "from-env")
    assert {c.env["PDSERVE_CLUSTER_TOKEN"] for c in _children() if c.env} == {"from-env"}
    given = _children("--cluster-token", "from-flag", "--api-key", "k1")
    assert {c.env["PDSERVE_CLUSTER_TOKEN"] for c in given if c.env} == {"from-flag"}
    gateway = next(c for c in given if c.name == "gateway")
    assert gateway.env is not None and gateway.env["PDSERVE_API_KEYS"] == "k1"


def test_a_cluster_token_that_cannot_travel_as_metadata_exits_with_one_line() -> None:
    with pytest.raises(SystemExit, match="cluster_token has a space"):
        up._parse(["--cluster-token", "two words"])


class _Proc:
    """Stands in for a child process: records SIGTERMs in a shared log, exits when waited on."""

    def __init__(self, name: str, log: list[tuple[str, str]]) -> None:
        self.name, self.log = name, log
        self.code: int | None = None

    def poll(self) -> int | None:
        return self.code

    def send_signal(self, sig: int) -> None:
        self.log.append(("term", self.name))

    def wait(self, timeout: float | None = None) -> int:
        self.log.append(("exited", self.name))
        self.code = 0
        return 0


def test_stop_order_gateways_then_all_workers_at_once_then_scheduler_and_load_monitor() -> None:
    children = _children("--prefill-workers", "2", "--decode-workers", "2", "--gateways", "2")
    log: list[tuple[str, str]] = []
    for child in children:
        child.proc = _Proc(child.name, log)  # type: ignore[assignment]
    up_processes.stop_all(children, grace_s=1.0)
    workers = {c.name for c in children if "worker" in c.name}
    # both gateways are signalled before either is waited for (each drains its own streams)
    assert [kind for kind, _ in log[:4]] == ["term", "term", "exited", "exited"]
    assert {name for _, name in log[:4]} == {"gateway", "gateway-1"}
    del log[:2]  # the rest as with one gateway
    # every worker is signalled before any of them is waited for
    assert {name for _, name in log[2:6]} == workers and all(kind == "term" for kind, _ in log[2:6])
    assert {name for _, name in log[6:10]} == workers and all(kind == "exited" for kind, _ in log[6:10])
    assert log[10:] == [
        ("term", "scheduler"),
        ("exited", "scheduler"),
        ("term", "load-monitor"),
        ("exited", "load-monitor"),
    ]


def _graphs_flags(*argv: str) -> dict[str, list[str]]:
    return {c.name: [a for a in c.args if "cuda-graphs" in a] for c in _children(*argv) if "worker" in c.name}


def test_on_a_gpu_only_prefill_workers_go_without_cuda_graphs() -> None:
    """Decode and unified workers keep their graphs on a shared GPU (issue 31 item 3; 6.3x the
    TPOT of eager steps on the 8B shape); prefill workers, which run prompt chunks only, are
    told not to capture any; on CPU the flag is left out; an explicit --worker-arg comes after
    ours and wins."""
    assert _graphs_flags("--device", "cuda") == {"prefill-worker": ["--no-cuda-graphs"], "decode-worker": []}
    assert _graphs_flags("--device", "cuda", "--unified", "--dp-size", "2") == {"worker": []}
    assert _graphs_flags("--device", "auto", "--unified-workers", "2") == {"worker": [], "worker-1": []}
    assert _graphs_flags("--device", "cuda", "--prefill-workers", "2") == {
        "prefill-worker": ["--no-cuda-graphs"],
        "prefill-worker-1": ["--no-cuda-graphs"],
        "decode-worker": [],
    }
    assert _graphs_flags() == {"prefill-worker": [], "decode-worker": []}
    forced = _graphs_flags("--device", "cuda", "--worker-arg=--cuda-graphs")
    assert forced["prefill-worker"] == ["--no-cuda-graphs", "--cuda-graphs"]
    off = _graphs_flags("--device", "cuda", "--decode-worker-arg=--no-cuda-graphs")
    assert off["decode-worker"] == ["--no-cuda-graphs"]


def _memory_flags(*argv: str) -> dict[str, list[str]]:
    """Per worker, its --gpu-memory-utilization values in order (`--flag value` and `--flag=value`)."""
    out = {}
    for c in _children(*argv):
        if "worker" in c.name:
            args = c.args
            out[c.name] = [
                args[k + 1] if a == "--gpu-memory-utilization" else a.split("=", 1)[1]
                for k, a in enumerate(args)
                if a == "--gpu-memory-utilization" or a.startswith("--gpu-memory-utilization=")
            ]
    return out


def test_workers_that_share_the_gpu_split_its_memory() -> None:
    """Each worker sizes its KV pool from its share of the GPU: two processes get 0.45 each,
    three 0.3 (rounded down, never over 0.9 together); one process (any DP ranks) and CPU stacks
    keep the worker's own default; a --worker-arg comes last and wins."""
    assert _memory_flags("--device", "cuda") == {"prefill-worker": ["0.45"], "decode-worker": ["0.45"]}
    three = _memory_flags("--device", "cuda", "--decode-workers", "2")
    assert sorted(three.values()) == [["0.3"]] * 3
    assert _memory_flags("--device", "cuda", "--unified", "--dp-size", "2") == {"worker": []}
    assert _memory_flags() == {"prefill-worker": [], "decode-worker": []}
    forced = _memory_flags("--device", "cuda", "--worker-arg=--gpu-memory-utilization=0.6")
    assert forced["decode-worker"] == ["0.45", "0.6"]


def _block_sizes(*argv: str) -> dict[str, str]:
    """Per child that takes one, its --block-size."""
    return {
        c.name: c.args[c.args.index("--block-size") + 1] for c in _children(*argv) if "--block-size" in c.args
    }


def test_block_size_defaults_by_device_and_reaches_workers_and_gateways_alike() -> None:
    """16-token blocks on CPU, 32 on a GPU (FlexAttention's KV tile is one block: 1.5x faster
    decode attention at 64 sequences on an H200); the gateways hash prompts with the workers'
    size; an explicit --block-size wins on any device."""
    assert set(_block_sizes().values()) == {"16"}
    on_gpu = _block_sizes("--device", "cuda", "--gateways", "2")
    assert set(on_gpu) == {"gateway", "gateway-1", "prefill-worker", "decode-worker"}
    assert set(on_gpu.values()) == {"32"}
    assert set(_block_sizes("--device", "auto", "--unified").values()) == {"32"}
    assert set(_block_sizes("--device", "cuda", "--block-size", "16").values()) == {"16"}
    assert set(_block_sizes("--block-size", "64").values()) == {"64"}
    with pytest.raises(SystemExit, match="--block-size"):
        up._parse(["--block-size", "-4"])


def _placed(*argv: str) -> dict[str, tuple[str, list[str]]]:
    """Per worker, its --cuda-devices (or "") and its --gpu-memory-utilization values."""
    memory = _memory_flags(*argv)
    out = {}
    for c in _children(*argv):
        if "worker" in c.name:
            devices = c.args[c.args.index("--cuda-devices") + 1] if "--cuda-devices" in c.args else ""
            out[c.name] = (devices, memory[c.name])
    return out


def test_workers_spread_over_the_gpus_before_they_share_one() -> None:
    """On a machine with several GPUs each worker gets its own (prefill workers first) and the
    whole of its memory share; only once every GPU has a worker do workers share one, and then
    the ones that share split its memory; a worker's DP ranks take consecutive GPUs."""
    four = ("--device", "cuda", "--gpus", "0,1,2,3")
    assert _placed(*four) == {"prefill-worker": ("0", []), "decode-worker": ("1", [])}
    assert _placed(*four, "--prefill-workers", "2", "--decode-workers", "2") == {
        "prefill-worker": ("0", []),
        "prefill-worker-1": ("1", []),
        "decode-worker": ("2", []),
        "decode-worker-1": ("3", []),
    }
    assert _placed(*four, "--unified", "--dp-size", "4") == {"worker": ("0,1,2,3", [])}
    assert _placed(*four, "--unified-workers", "2", "--dp-size", "2") == {
        "worker": ("0,1", []),
        "worker-1": ("2,3", []),
    }
    # five workers on four GPUs: GPU 0 carries two, which split its memory
    assert _placed(*four, "--prefill-workers", "2", "--decode-workers", "3") == {
        "prefill-worker": ("0", ["0.45"]),
        "prefill-worker-1": ("1", []),
        "decode-worker": ("2", []),
        "decode-worker-1": ("3", []),
        "decode-worker-2": ("0", ["0.45"]),
    }
    # the GPUs named, in the order given; two workers on one listed GPU share it as before
    assert _placed("--device", "cuda", "--gpus", "3,1") == {
        "prefill-worker": ("3", []),
        "decode-worker": ("1", []),
    }
    assert _placed("--device", "cuda", "--gpus", "2") == {
        "prefill-worker": ("2", ["0.45"]),
        "decode-worker": ("2", ["0.45"]),
    }
    # a DP size beyond the GPUs: the worker's ranks wrap round its own GPUs
    assert up_shape.place_workers(["worker"], 3, (0, 1)) == {"worker": up_shape.Placement((0, 1), None)}
    # CPU stacks place nothing
    assert _placed("--gpus", "0,1") == {"prefill-worker": ("", []), "decode-worker": ("", [])}


def test_the_gpus_counted_are_used_and_none_visible_keeps_one_shared_device() -> None:
    assert up_shape.gpu_list("", "cuda", lambda: 8) == tuple(range(8))
    assert up_shape.gpu_list("", "auto", lambda: 0) == ()

    def never() -> int:
        raise AssertionError("counted the GPUs of a CPU stack")

    assert up_shape.gpu_list("", "cpu", never) == ()
    # nothing visible (or a CPU host with --device auto): as on one GPU, the share split
    assert up_shape.place_workers(["a", "b"], 1, ()) == {
        "a": up_shape.Placement((), 0.45),
        "b": up_shape.Placement((), 0.45),
    }


@pytest.mark.parametrize("gpus", ["0,0", "a,b", "-1", "0;1"])
def test_a_bad_gpu_list_exits_with_one_line(gpus: str) -> None:
    with pytest.raises(SystemExit, match="--gpus"):
        up._parse(["--device", "cuda", "--gpus", gpus])


def test_lora_modules_given_once_reach_every_worker() -> None:
    """`--worker-arg=--lora-modules=NAME=PATH` (repeatable): every worker, whatever its role,
    serves the adapters, and reads them as its own flag would."""
    from services.worker.settings import WorkerSettings
    from shared.settings import parse_settings

    lora = ("--worker-arg=--lora-modules=sql=/a/sql", "--worker-arg=--lora-modules=chat=/a/chat")
    for shape in ((), ("--unified-workers", "2"), ("--prefill-workers", "2")):
        workers = [c for c in _children(*shape, *lora) if "worker" in c.name]
        assert workers
        for child in workers:
            settings = parse_settings(WorkerSettings, child.args, env={})
            assert settings.lora_modules == ("sql=/a/sql", "chat=/a/chat"), child.name
            assert settings.lora_adapters == ("sql", "chat")


def test_fp8_weights_given_once_reach_every_worker_alike() -> None:
    """`pdserve up --quantization fp8`: every worker of every role quantizes (a prefill and a
    decode worker must agree: their KV layouts say so); unset, none does."""
    from services.worker.settings import WorkerSettings
    from shared.settings import parse_settings

    for shape in ((), ("--unified-workers", "2"), ("--prefill-workers", "2")):
        for flag, want in ((("--quantization", "fp8"), "fp8"), ((), "")):
            workers = [c for c in _children(*shape, *flag) if "worker" in c.name]
            assert workers
            for child in workers:
                assert parse_settings(WorkerSettings, child.args, env={}).quantization == want, child.name


def test_runtime_lora_updating_is_turned_on_by_a_gateway_arg_and_a_worker_arg() -> None:
    """`--gateway-arg=--allow-runtime-lora-updating --worker-arg=--enable-lora` (the README's
    recipe): every gateway allows the updates and every worker of every role can take them."""
    from services.gateway.settings import GatewaySettings
    from services.worker.settings import WorkerSettings
    from shared.settings import parse_settings

    flags = ("--gateway-arg=--allow-runtime-lora-updating", "--worker-arg=--enable-lora")
    for shape in ((), ("--unified-workers", "2"), ("--gateways", "2")):
        children = _children(*shape, *flags)
        gateways = [c for c in children if c.name.startswith("gateway")]
        workers = [c for c in children if "worker" in c.name]
        assert gateways and workers
        for child in gateways:
            assert parse_settings(GatewaySettings, child.args, env={}).allow_runtime_lora_updating, child.name
        for child in workers:
            settings = parse_settings(WorkerSettings, child.args, env={})
            assert settings.lora_enabled and settings.lora_adapters == (), child.name


@pytest.mark.parametrize(("flag", "kind"), [("--batch-dir", "batches"), ("--response-dir", "responses")])
def test_the_gateways_share_the_folders_of_their_stack(flag: str, kind: str) -> None:
    def folder(*argv: str) -> list[str]:
        gateways = [c for c in _children("--gateways", "2", *argv) if c.name.startswith("gateway")]
        return [c.args[c.args.index(flag) + 1] for c in gateways]

    default = folder()
    assert len(set(default)) == 1 and default[0].endswith(f"/.cache/pdserve/{kind}/40040")
    assert folder(flag, "/data/b") == ["/data/b", "/data/b"]
    assert folder(flag, "off") == ["", ""]
