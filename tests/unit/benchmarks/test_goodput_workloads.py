"""Workloads and configurations of the goodput benchmark: seeded, cut to the drawn lengths,
shared prefix only where the workload says so; the pdserve up lines of each configuration."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from benchmarks.goodput import configs
from benchmarks.goodput.workloads import WORKLOADS, load_corpus, make_requests
from services.scheduler.policies import UNIFIED_DISAGGREGATE_THRESHOLD


class WordTokenizer:
    """One token per whitespace-separated word (ids assigned on first sight)."""

    def __init__(self) -> None:
        self.ids: dict[str, int] = {}
        self.words: list[str] = []

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        out = []
        for word in text.split():
            if word not in self.ids:
                self.ids[word] = len(self.words)
                self.words.append(word)
            out.append(self.ids[word])
        return out

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return " ".join(self.words[i] for i in ids)


def test_corpus_has_many_varied_passages() -> None:
    corpus = load_corpus()
    assert len(corpus) >= 20
    assert all(len(p) >= 3 for p in corpus)  # sentences per passage
    assert not any(s.startswith("#") for p in corpus for s in p)


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_requests_follow_the_workload_ranges(name: str) -> None:
    w, tok = WORKLOADS[name], WordTokenizer()
    requests = make_requests(w, tok, 12, seed=1, run="r")
    for r in requests:
        assert w.prompt_tokens[0] <= r.message_tokens <= w.prompt_tokens[1]
        assert w.output_tokens[0] <= r.max_tokens <= w.output_tokens[1]
        user = r.messages[-1]
        assert user["role"] == "user"
        _instruction, body = user["content"].split("\n\n", 1)
        assert len(tok.encode(body)) == r.message_tokens
    assert len({r.messages[-1]["content"] for r in requests}) == len(requests)


def test_same_seed_and_run_give_the_same_requests_and_others_differ() -> None:
    w = WORKLOADS["chat"]
    a = make_requests(w, WordTokenizer(), 5, seed=3, run="rate-1")
    assert a == make_requests(w, WordTokenizer(), 5, seed=3, run="rate-1")
    assert a != make_requests(w, WordTokenizer(), 5, seed=3, run="rate-2")
    assert a != make_requests(w, WordTokenizer(), 5, seed=4, run="rate-1")


def test_only_shared_prefix_shares_a_system_prompt() -> None:
    tok = WordTokenizer()
    shared = make_requests(WORKLOADS["shared_prefix"], tok, 4, seed=0, run="a")
    systems = {r.messages[0]["content"] for r in shared}
    assert len(systems) == 1 and all(r.messages[0]["role"] == "system" for r in shared)
    assert len(tok.encode(systems.pop())) >= WORKLOADS["shared_prefix"].system_tokens
    # another run of the same seed keeps the same system prompt (the cache can hold it)
    assert (
        make_requests(WORKLOADS["shared_prefix"], tok, 1, seed=0, run="b")[0].messages[0]
        == shared[0].messages[0]
    )
    chat = make_requests(WORKLOADS["chat"], tok, 4, seed=0, run="a")
    assert all(len(r.messages) == 1 for r in chat)


def test_quick_caps_outputs_only() -> None:
    q = WORKLOADS["long_output"].quick(16)
    assert q.output_tokens == (16, 16)
    assert q.prompt_tokens == WORKLOADS["long_output"].prompt_tokens
    assert WORKLOADS["chat"].quick(64).output_tokens == (32, 64)


def test_configurations_are_pdserve_up_lines_on_two_single_thread_processes() -> None:
    assert configs.config_args("disaggregated") == [
        "--prefill-workers", "1", "--decode-workers", "1", "--torch-threads", "1"
    ]  # fmt: skip
    assert configs.config_args("unified_dp2") == ["--unified", "--dp-size", "2", "--torch-threads", "1"]
    # unified_2workers aggregates every request: the scheduler's unified split is pinned off
    assert configs.config_args("unified_2workers") == [
        "--unified-workers", "2", "--torch-threads", "1", "--scheduler-arg=--unified-disaggregate-threshold=0"
    ]  # fmt: skip
    cond = configs.config_args("conditional", local_prefill_threshold=128)
    assert cond[: len(configs.config_args("disaggregated"))] == configs.config_args("disaggregated")
    assert cond[-1] == "--scheduler-arg=--local-prefill-threshold=128"
    assert configs.config_args("conditional@64")[-1] == "--scheduler-arg=--local-prefill-threshold=64"
    assert configs.is_config("conditional@0") and not configs.is_config("conditional@x")
    assert configs.config_args("conditional_unified@300") == [
        "--unified-workers",
        "2",
        "--torch-threads",
        "1",
        "--scheduler-arg=--unified-disaggregate-threshold=300",
    ]
    # the bare name measures the scheduler's default threshold, written out in the command
    assert configs.config_args("conditional_unified")[-1] == (
        f"--scheduler-arg=--unified-disaggregate-threshold={UNIFIED_DISAGGREGATE_THRESHOLD}"
    )
    # each threshold flag reaches only its own configuration
    assert configs.config_args("conditional_unified", local_prefill_threshold=7, unified_threshold=9)[-1] == (
        "--scheduler-arg=--unified-disaggregate-threshold=9"
    )
    assert configs.config_args("conditional", local_prefill_threshold=7, unified_threshold=9)[-1] == (
        "--scheduler-arg=--local-prefill-threshold=7"
    )
    with pytest.raises(ValueError, match="unknown configuration"):
        configs.config_args("colocated")


def test_up_command_is_printable_and_pins_cpus_when_asked() -> None:
    cmd = configs.up_command(
        "unified_dp2", model="m", port_base=57100, cpus="0,1", extra=["--log-level=debug"]
    )
    assert cmd[:3] == ["taskset", "-c", "0,1"]
    assert cmd[cmd.index("up") - 2 :][:3] == ["-m", "services.cli", "up"]
    assert "--port-base" in cmd and "57100" in cmd and cmd[-1] == "--log-level=debug"
    assert "services.cli up --model m" in configs.printable(cmd)
    assert configs.up_command("disaggregated", model="m", port_base=1)[0] != "taskset"


def test_http_base_url_is_found_in_the_ready_output() -> None:
    line = "pdserve is up: gateway 127.0.0.1:57000, HTTP http://127.0.0.1:57003/v1 (model x)"
    assert configs.http_base_url(line) == "http://127.0.0.1:57003/v1"
    assert (
        configs.http_base_url("  OpenAI-compatible API: http://0.0.0.0:8000/v1") == "http://0.0.0.0:8000/v1"
    )
    assert configs.http_base_url("pdserve is up: gateway 127.0.0.1:57000") is None


def test_command_line_defaults_and_refusals(monkeypatch: pytest.MonkeyPatch) -> None:
    from benchmarks import result_names
    from benchmarks.bench_goodput import parse_args
    from benchmarks.goodput.cli import default_out
    from benchmarks.goodput.harness import requests_at

    full, quick = parse_args([]), parse_args(["--quick"])
    assert full.configs == list(configs.CONFIG_NAMES) and full.workloads == list(WORKLOADS)
    assert (full.max_points, quick.max_points) == (8, 3) and full.dtype == "float32"
    # the result file is named after the machine class (benchmarks/result_names.py)
    monkeypatch.setattr(result_names, "machine_class", lambda device: f"{device}-x")
    assert default_out(full).name == "goodput-cpu-x.json"
    assert default_out(quick).name == "goodput-cpu-x-quick.json"
    assert default_out(parse_args(["--device", "cuda"])).name == "goodput-cuda-x.json"
    assert parse_args(["--device", "cuda"]).dtype == "bfloat16"
    tuned = parse_args(["--configs", "conditional@64,disaggregated"])
    assert tuned.configs == ["conditional@64", "disaggregated"]
    assert parse_args(["--base-url", "http://h:1/v1"]).configs == ["external"]
    # requests per rate: rate x duration, within the count bounds
    assert requests_at(0.01, full) == full.min_requests
    assert requests_at(100.0, full) == full.max_requests
    assert requests_at(0.3, full) == 36
    for bad in (["--workloads", "chit"], ["--configs", "colocated"], ["--slo-ttft-ms", "100"],
                ["--slo-ttft-ms", "100", "--slo-tpot-ms", "10"]):  # fmt: skip
        with pytest.raises(SystemExit):
            parse_args(bad)
