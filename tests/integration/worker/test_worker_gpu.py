"""Workers on CUDA (skipped without a GPU): device auto picks cuda, dtype auto bfloat16, and
disaggregated generation still equals unified on the same device, over the gRPC push and over
NIXL in parts (VRAM to VRAM, each prompt chunk's blocks READ as soon as they are cued), and
with the Prefill reply before the handoff ends."""

from __future__ import annotations

from pathlib import Path

import pytest

from shared.proto import worker_pb2

from .harness import RunningWorker, collect, running_worker, sampling, worker_settings
from .test_worker_grpc import PROMPT, disaggregated, prompt_ids, token_ids_of, wait_blocks_free

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _needs_cuda() -> None:
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")


async def test_auto_device_and_dtype_on_cuda(tiny_model: Path) -> None:
    # max_num_seqs 4: graphs for 4 batch sizes at start, not 64 (a GPU window is short); blocks
    # of 16 tokens: attention in place on a GPU needs a multiple of 16 (the harness uses 4)
    async with running_worker(
        worker_settings(tiny_model, "unified", device="auto", dtype="auto", max_num_seqs=4, block_size=16)
    ) as w:
        info = await w.stub.Info(worker_pb2.InfoRequest())
        assert info.device == "cuda"
        assert info.kv_layout.dtype == "bfloat16"


_CUDA = dict(device="cuda", dtype="float32", max_num_seqs=4, block_size=16)


async def _unified(u: RunningWorker, request_id: str, ids: list[int]) -> list[worker_pb2.DecodeFrame]:
    """The unified worker's frames for the prompt, 16 tokens (local prefill)."""
    return await collect(
        u.stub.Decode(
            worker_pb2.DecodeRequest(
                request_id=request_id,
                prompt_token_ids=ids,
                sampling=sampling(16),
                local_prefill=True,
                return_token_ids=True,
            )
        )
    )


async def test_disaggregated_equals_unified_on_cuda(tiny_model: Path) -> None:
    ids = prompt_ids(tiny_model)
    async with (
        running_worker(worker_settings(tiny_model, "prefill", **_CUDA)) as p,
        running_worker(worker_settings(tiny_model, "decode", **_CUDA)) as d,
        running_worker(worker_settings(tiny_model, "unified", **_CUDA)) as u,
    ):
        reply, frames = await disaggregated(p, d, "g1", ids, 16)
        unified = await _unified(u, "g1", ids)
    assert list(reply.token_ids) + token_ids_of(frames) == token_ids_of(unified)
    assert reply.generated_tokens + frames[-1].generated_tokens == unified[-1].generated_tokens


async def test_disaggregated_over_nixl_in_parts_equals_unified_on_cuda(tiny_model: Path) -> None:
    """A prompt prefilled 16 tokens per step whose blocks the decode worker READs chunk by chunk
    over NIXL, from one GPU pool into another: the same tokens as unified. (A chunk's kernels
    must have run before its cue: a non-final chunk samples nothing, so nothing else waits.)"""
    pytest.importorskip("nixl_cu13._api", reason="nixl-cu13 is not installed")
    ids = prompt_ids(tiny_model, " ".join([PROMPT] * 5))  # > 3 blocks of 16
    async with (
        running_worker(worker_settings(tiny_model, "prefill", max_batch_tokens=16, **_CUDA)) as p,
        running_worker(worker_settings(tiny_model, "decode", **_CUDA)) as d,
        running_worker(worker_settings(tiny_model, "unified", **_CUDA)) as u,
    ):
        assert p.app.nixl is not None and d.app.nixl is not None
        reply, frames = await disaggregated(p, d, "n1", ids, 16, worker_pb2.KV_TRANSPORT_NIXL, True)
        unified = await _unified(u, "n1", ids)
    assert len(ids) > 48 and reply.kv_transport == worker_pb2.KV_TRANSPORT_NIXL and reply.num_chunks > 3
    assert list(reply.token_ids) + token_ids_of(frames) == token_ids_of(unified)


async def test_the_first_token_before_the_handoff_over_nixl_equals_unified_on_cuda(tiny_model: Path) -> None:
    """KvTarget.reply_before_handoff on CUDA: the Prefill reply comes at the first token while
    the decode worker READs the held VRAM blocks after it; the same tokens as unified, every
    block of both workers free afterwards."""
    pytest.importorskip("nixl_cu13._api", reason="nixl-cu13 is not installed")

    ids = prompt_ids(tiny_model, " ".join([PROMPT] * 5))
    async with (
        running_worker(worker_settings(tiny_model, "prefill", max_batch_tokens=16, **_CUDA)) as p,
        running_worker(worker_settings(tiny_model, "decode", **_CUDA)) as d,
        running_worker(worker_settings(tiny_model, "unified", **_CUDA)) as u,
    ):
        reply, frames = await disaggregated(p, d, "e1", ids, 16, worker_pb2.KV_TRANSPORT_NIXL, True, True)
        unified = await _unified(u, "e1", ids)
        await wait_blocks_free(p)
        await wait_blocks_free(d)
    assert not reply.HasField("kv_transport")  # answered before the handoff ended
    assert list(reply.token_ids) + token_ids_of(frames) == token_ids_of(unified)
