"""Gateway settings: defaults, flags over env, validation."""

from __future__ import annotations

import pytest

from services.gateway.settings import GatewaySettings, load_settings


def test_defaults() -> None:
    s = load_settings([], env={})
    assert s == GatewaySettings()
    assert (s.listen, s.metrics_port, s.scheduler_address) == ("0.0.0.0:50051", 9100, "127.0.0.1:50052")
    assert (s.model, s.block_size, s.default_max_tokens, s.log_prompts) == ("default", 16, 256, False)
    assert s.drain_grace_s == 30.0


def test_flags_beat_env() -> None:
    env = {"PDSERVE_SCHEDULER_ADDRESS": "sched:1", "PDSERVE_BLOCK_SIZE": "32", "PDSERVE_LOG_PROMPTS": "true"}
    s = load_settings(["--scheduler-address", "other:2", "--metrics-port=-1"], env=env)
    assert s.scheduler_address == "other:2"
    assert s.block_size == 32
    assert s.log_prompts is True
    assert s.metrics_port == -1
    assert s.tool_call_parser == ""  # detected from the chat template
    assert load_settings(["--tool-call-parser", "llama3_json"], env={}).tool_call_parser == "llama3_json"
    for parser in ("pythonic", "qwen3_coder"):
        assert load_settings(["--tool-call-parser", parser], env={}).tool_call_parser == parser


@pytest.mark.parametrize(
    "argv",
    [
        ["--block-size", "0"],
        ["--default-max-tokens", "0"],
        ["--request-timeout-s", "0"],
        ["--log-format", "xml"],
        ["--tool-call-parser", "granite"],
    ],
)
def test_invalid_values_exit_with_a_message(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        load_settings(argv, env={})
    assert "pdserve gateway" in capsys.readouterr().err
