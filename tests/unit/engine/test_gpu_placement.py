"""Which GPU each DP rank runs on (engine/gpu_placement.py): the worker's --cuda-devices or
every visible GPU, rank r on the (r mod n)-th; a bad list is refused with its reason."""

from __future__ import annotations

import pytest

from services.worker.engine.gpu_placement import rank_gpu, ranks_on, worker_gpus
from shared.errors import InvalidArgument


def test_a_worker_uses_its_listed_gpus_or_all_it_sees() -> None:
    assert worker_gpus("", 4) == (0, 1, 2, 3)
    assert worker_gpus(" ", 1) == (0,)
    assert worker_gpus("2,3", 4) == (2, 3)
    assert worker_gpus("3, 1", 4) == (3, 1)


def test_ranks_go_round_the_workers_gpus() -> None:
    gpus = (2, 3)
    assert [rank_gpu(r, gpus) for r in range(5)] == [2, 3, 2, 3, 2]
    assert ranks_on(2, 5, gpus) == 3 and ranks_on(3, 5, gpus) == 2 and ranks_on(0, 5, gpus) == 0
    assert [rank_gpu(r, (0,)) for r in range(3)] == [0, 0, 0]


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("0,0", "lists a GPU twice"),
        ("4", "names GPU 4, but this process sees 4 GPU"),
        ("-1", "names GPU -1"),
        ("0;1", "indices separated by commas"),
        ("a", "indices separated by commas"),
    ],
)
def test_a_bad_list_is_refused_with_its_reason(text: str, reason: str) -> None:
    with pytest.raises(InvalidArgument, match=reason):
        worker_gpus(text, 4)


def test_the_engine_puts_each_rank_on_its_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """RankBuilder's device per rank follows --cuda-devices (four GPUs pretended visible), and
    the KV pool's memory share counts the ranks that share its GPU."""
    import torch

    from services.worker.engine.api import EngineConfig
    from services.worker.engine.build import RankBuilder

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    cfg = EngineConfig(model_path="m", device="cuda", dp_size=3, cuda_devices="2,3")
    builder = RankBuilder(cfg, None, "m")
    assert [builder._device_for(r) for r in range(3)] == [torch.device("cuda", g) for g in (2, 3, 2)]
    every = RankBuilder(EngineConfig(model_path="m", device="cuda", dp_size=2), None, "m")
    assert [builder._device_for(r).index for r in range(2)] == [2, 3]
    assert [every._device_for(r).index for r in range(2)] == [0, 1]
    with pytest.raises(InvalidArgument, match="sees 4 GPU"):
        RankBuilder(EngineConfig(model_path="m", device="cuda", cuda_devices="5"), None, "m")._device_for(0)
