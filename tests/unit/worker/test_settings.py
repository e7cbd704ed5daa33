"""Worker settings: per-role default ports, flags over env, validation, the engine's options
embedded and passed on whole."""

from __future__ import annotations

import dataclasses

import pytest

from services.worker.engine.api import EngineConfig, engine_options
from services.worker.engine.options import EngineOptions
from services.worker.settings import WorkerSettings
from shared.cluster import Role
from shared.settings import parse_settings


@pytest.mark.parametrize(
    ("role", "listen", "metrics_port"),
    [
        ("prefill", "0.0.0.0:50061", 9103),
        ("decode", "0.0.0.0:50071", 9104),
        ("unified", "0.0.0.0:50081", 9105),
    ],
)
def test_role_default_ports(role: str, listen: str, metrics_port: int) -> None:
    s = parse_settings(WorkerSettings, ["--role", role], env={})
    assert s.role is Role(role)
    assert s.listen == listen
    assert s.metrics_port == metrics_port
    assert s.service_name == f"{role}-worker"


def test_defaults() -> None:
    s = parse_settings(WorkerSettings, [], env={})
    assert s.role is Role.UNIFIED
    assert s.model == "default"
    assert s.device == "auto" and s.dtype == "auto"
    assert s.dp_size == 1 and s.block_size == 16
    assert s.load_monitor_address == ""
    assert s.drain_grace_s == 30.0
    assert s.kv_chunk_bytes == 1 << 20
    assert s.log_prompts is False
    assert s.max_batch_tokens == 0  # the engine picks by device (512 CPU, 2048 CUDA)
    assert s.cpu_prepack is True


def test_cpu_prepack_can_be_turned_off() -> None:
    assert parse_settings(WorkerSettings, ["--no-cpu-prepack"], env={}).cpu_prepack is False
    off = parse_settings(WorkerSettings, [], env={"PDSERVE_CPU_PREPACK": "false"})
    assert off.cpu_prepack is False


def test_lean_forward_is_on_by_default_and_can_be_turned_off() -> None:
    assert parse_settings(WorkerSettings, [], env={}).lean_forward is True
    assert parse_settings(WorkerSettings, ["--no-lean-forward"], env={}).lean_forward is False
    off = parse_settings(WorkerSettings, [], env={"PDSERVE_LEAN_FORWARD": "false"})
    assert off.lean_forward is False


def test_cuda_graphs_are_on_by_default_and_can_be_turned_off() -> None:
    assert parse_settings(WorkerSettings, [], env={}).cuda_graphs is True
    assert parse_settings(WorkerSettings, ["--no-cuda-graphs"], env={}).cuda_graphs is False
    off = parse_settings(WorkerSettings, [], env={"PDSERVE_CUDA_GRAPHS": "false"})
    assert off.cuda_graphs is False


def test_ipv6_pod_ip_is_advertised_in_brackets() -> None:
    s = parse_settings(WorkerSettings, [], env={"PDSERVE_ADVERTISE_ADDRESS": "fd00:10::7:50061"})
    assert s.advertise_address == "[fd00:10::7]:50061"


def test_env_and_flags() -> None:
    env = {
        "PDSERVE_ROLE": "decode",
        "PDSERVE_DP_SIZE": "2",
        "PDSERVE_LISTEN": "127.0.0.1:7000",
        "PDSERVE_LOAD_MONITOR_ADDRESS": "lm:50053",
        "PDSERVE_LOG_PROMPTS": "true",
    }
    s = parse_settings(WorkerSettings, ["--dp-size", "3", "--metrics-port", "-1"], env=env)
    assert s.role is Role.DECODE  # the enum, parsed from its value
    assert s.dp_size == 3  # flag beats env
    assert s.listen == "127.0.0.1:7000"
    assert s.metrics_port == -1
    assert s.load_monitor_address == "lm:50053"
    assert s.log_prompts is True


@pytest.mark.parametrize(
    "argv",
    [
        ["--role", "router"],
        ["--dp-size", "0"],
        ["--device", "tpu"],
        ["--listen", "nohost"],
        ["--kv-chunk-bytes", "0"],
        ["--drain-grace-s", "-1"],
        ["--max-batch-tokens", "-1"],
        ["--max-num-seqs", "0"],
        ["--advertise-address", "10.0.0.7"],
        ["--speculative", "draft"],  # without --draft-model
        ["--speculative", "eagle"],
        ["--draft-kv-cache-tokens", "-1"],
        ["--cuda-devices", "0,0"],
        ["--cuda-devices", "gpu1"],
    ],
)
def test_invalid_values_exit_with_a_message(argv: list[str]) -> None:
    with pytest.raises(SystemExit):
        parse_settings(WorkerSettings, argv, env={})


def test_unknown_role_names_the_allowed_ones(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_settings(WorkerSettings, ["--role", "router"], env={})
    assert "role: 'router' is not one of ['prefill', 'decode', 'unified']" in capsys.readouterr().err


def test_help_shows_the_role_by_value(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_settings(WorkerSettings, ["--help"], env={})
    assert "default 'unified'" in " ".join(capsys.readouterr().out.split())


def test_draft_speculation_settings() -> None:
    s = parse_settings(WorkerSettings, ["--speculative", "draft", "--draft-model", "default"], env={})
    assert (s.speculative, s.draft_model, s.draft_kv_cache_tokens) == ("draft", "default", 0)
    env = {
        "PDSERVE_SPECULATIVE": "draft",
        "PDSERVE_DRAFT_MODEL": "/m/d",
        "PDSERVE_DRAFT_KV_CACHE_TOKENS": "4096",
    }
    s = parse_settings(WorkerSettings, [], env=env)
    assert (s.speculative, s.draft_model, s.draft_kv_cache_tokens) == ("draft", "/m/d", 4096)


def test_every_engine_option_reaches_the_engine_config() -> None:
    argv = ["--no-lean-forward", "--speculative", "ngram", "--max-num-seqs", "7"]
    s = parse_settings(WorkerSettings, argv, env={"PDSERVE_CPU_KERNEL_CACHE_ENTRIES": "3"})
    cfg = EngineConfig(model_path="m", **engine_options(s, cuda_graph_warm_tokens=0))
    for f in dataclasses.fields(EngineOptions):
        want = 0 if f.name == "cuda_graph_warm_tokens" else getattr(s, f.name)
        assert getattr(cfg, f.name) == want, f.name
    assert (cfg.lean_forward, cfg.speculative, cfg.max_num_seqs, cfg.cpu_kernel_cache_entries) == (
        False,
        "ngram",
        7,
        3,
    )


def test_lora_modules_from_flags_or_env_name_the_adapters_in_order() -> None:
    argv = ["--lora-modules=sql=/adapters/sql", "--lora-modules", "org/chat=/adapters/chat"]
    s = parse_settings(WorkerSettings, argv, env={})
    assert s.lora_modules == ("sql=/adapters/sql", "org/chat=/adapters/chat")
    assert s.lora_adapters == ("sql", "org/chat")
    s = parse_settings(WorkerSettings, [], env={"PDSERVE_LORA_MODULES": "b=/x/b,a=/x/a"})
    assert s.lora_adapters == ("b", "a")
    assert parse_settings(WorkerSettings, [], env={}).lora_adapters == ()


def test_lora_is_enabled_by_enable_lora_or_by_lora_modules() -> None:
    """--enable-lora (env PDSERVE_ENABLE_LORA) turns the LoRA machinery on without adapters;
    --lora-modules implies it; the adapters' folders are kept by name (what an unload returns)."""
    assert not parse_settings(WorkerSettings, [], env={}).lora_enabled
    enabled = parse_settings(WorkerSettings, ["--enable-lora"], env={})
    assert enabled.lora_enabled and enabled.lora_adapters == ()
    assert parse_settings(WorkerSettings, [], env={"PDSERVE_ENABLE_LORA": "true"}).lora_enabled
    implied = parse_settings(WorkerSettings, ["--lora-modules=sql=/adapters/sql"], env={})
    assert implied.lora_enabled and implied.lora_module_paths == {"sql": "/adapters/sql"}


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        ("sql", "expected NAME=PATH"),
        ("=/adapters/sql", "expected NAME=PATH"),
        ("-sql=/adapters/sql", "the name '-sql' must be"),
    ],
)
def test_a_bad_lora_module_fails_at_start_with_a_one_line_message(
    spec: str, says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        parse_settings(WorkerSettings, [f"--lora-modules={spec}"], env={})
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert says in err and spec in err
    with pytest.raises(SystemExit):
        parse_settings(WorkerSettings, ["--lora-modules=a=/x", "--lora-modules=a=/y"], env={})
    assert "'a' is given twice" in capsys.readouterr().err
