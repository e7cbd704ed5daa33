"""bench_serving's configuration names: a stack shape and `+` modifiers, as `pdserve up` flags."""

from __future__ import annotations

import pytest

from benchmarks.bench_serving import config_args


def test_configurations_become_pdserve_up_flags() -> None:
    assert config_args("unified") == ("unified", ["--gateways", "1"])
    assert config_args("unified+2gw") == ("unified", ["--gateways", "2"])
    assert config_args("disaggregated+graphs") == (
        "disaggregated",
        ["--gateways", "1", "--worker-arg=--cuda-graphs"],
    )
    assert config_args("disaggregated+graphs+3gw") == (
        "disaggregated",
        ["--gateways", "3", "--worker-arg=--cuda-graphs"],
    )
    assert config_args("disaggregated+eager") == (
        "disaggregated",
        ["--gateways", "1", "--worker-arg=--no-cuda-graphs"],
    )


@pytest.mark.parametrize("bad", ["unifed", "unified+0gw", "unified+gw", "disaggregated+fast", "+2gw"])
def test_unknown_configurations_are_refused(bad: str) -> None:
    with pytest.raises(ValueError, match="unknown"):
        config_args(bad)
