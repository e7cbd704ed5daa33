"""Same-host KV handoff: once a decode worker's PushKvResponse shows it shares the prefill
worker's shared-memory folder, later pushes carry file names instead of bytes, with the same
tokens as unified serving and no file left behind; workers that do not share a folder keep
sending bytes; bad file names are refused."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from services.worker.kv_shm import ShmKvFolder
from shared.proto import worker_pb2

from .harness import RunningWorker, collect, running_worker, sampling, worker_settings
from .test_worker_grpc import disaggregated, prompt_ids, token_ids_of, wait_blocks_free

TEXTS = [
    "Prefill and decode run on different workers; the KV cache moves between them.",
    "A second prompt, long enough to span several KV blocks of sixteen tokens each, goes next.",
    "And a third one: shared memory should carry this transfer instead of gRPC bytes, too.",
]


@pytest.fixture
async def unified(tiny_model: Path) -> AsyncIterator[RunningWorker]:
    async with running_worker(worker_settings(tiny_model, "unified", kv_shm_dir="")) as w:
        yield w


def _count_takes(decode: RunningWorker, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    taken: list[str] = []
    real = decode.app.shm.take

    def spy(name: str) -> bytes:
        taken.append(name)
        return real(name)

    monkeypatch.setattr(decode.app.shm, "take", spy)
    return taken


async def _unified_tokens(unified: RunningWorker, rid: str, ids: list[int]) -> list[int]:
    frames = await collect(unified.stub.Decode(worker_pb2.DecodeRequest(
        request_id=rid, prompt_token_ids=ids, sampling=sampling(12), local_prefill=True,
        return_token_ids=True)))
    return token_ids_of(frames)


async def test_same_folder_hands_kv_over_as_files(
    tiny_model: Path, tmp_path: Path, unified: RunningWorker, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = str(tmp_path)
    async with running_worker(worker_settings(tiny_model, "prefill", kv_shm_dir=folder)) as p, \
            running_worker(worker_settings(tiny_model, "decode", kv_shm_dir=folder)) as d:
        taken = _count_takes(d, monkeypatch)
        for i, text in enumerate(TEXTS):
            ids = prompt_ids(tiny_model, text)
            reply, frames = await disaggregated(p, d, f"s{i}", ids, 12)
            got = list(reply.token_ids) + token_ids_of(frames)
            assert got == await _unified_tokens(unified, f"u{i}", ids)
            if i == 0:
                # the first push learns the peer's domain from its reply: bytes in the messages
                assert taken == []
                assert reply.kv_bytes_sent > 0
            else:
                assert taken, "a push to a peer sharing the folder must use chunk files"
                assert reply.kv_bytes_sent > 0  # the payload is counted either way
        await wait_blocks_free(d)
        # only the two workers' markers remain: every chunk file was read and deleted
        assert sorted(f.name.split("-")[1] for f in tmp_path.iterdir()) == ["domain", "domain"]
    assert list(tmp_path.iterdir()) == []  # markers go with the workers


@pytest.mark.parametrize(
    ("prefill_dir", "decode_dir"),
    [("a", "b"), ("a", ""), ("", "a")],
    ids=["different-folders", "decode-without-folder", "prefill-without-folder"],
)
async def test_workers_not_sharing_a_folder_send_bytes(
    tiny_model: Path, tmp_path: Path, unified: RunningWorker, monkeypatch: pytest.MonkeyPatch,
    prefill_dir: str, decode_dir: str,
) -> None:
    for name in ("a", "b"):
        (tmp_path / name).mkdir()

    def folder(name: str) -> str:
        return str(tmp_path / name) if name else ""

    async with running_worker(worker_settings(tiny_model, "prefill",
                                              kv_shm_dir=folder(prefill_dir))) as p, \
            running_worker(worker_settings(tiny_model, "decode",
                                           kv_shm_dir=folder(decode_dir))) as d:
        taken = _count_takes(d, monkeypatch)
        for i, text in enumerate(TEXTS[:2]):
            ids = prompt_ids(tiny_model, text)
            reply, frames = await disaggregated(p, d, f"b{i}", ids, 12)
            assert list(reply.token_ids) + token_ids_of(frames) == \
                await _unified_tokens(unified, f"v{i}", ids)
        assert taken == []


async def test_push_naming_a_foreign_file_is_refused(tiny_model: Path, tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_bytes(b"x" * 64)
    async with running_worker(worker_settings(tiny_model, "decode",
                                              kv_shm_dir=str(tmp_path))) as d:
        layout = (await d.stub.Info(worker_pb2.InfoRequest())).kv_layout
        for name, code in [("../secret", grpc.StatusCode.INVALID_ARGUMENT),
                           ("pdserve-kv-" + "0" * 32, grpc.StatusCode.FAILED_PRECONDITION)]:
            chunk = worker_pb2.KvChunk(request_id="x", transfer_ticket="t", first_block=0,
                                       num_blocks=1, shm_file=name, last=True, layout=layout)

            async def one(c: worker_pb2.KvChunk = chunk) -> AsyncIterator[worker_pb2.KvChunk]:
                yield c

            with pytest.raises(grpc.aio.AioRpcError) as err:
                await d.stub.PushKv(one())
            assert err.value.code() == code, err.value.details()
    assert secret.read_bytes() == b"x" * 64


def test_folder_rules(tmp_path: Path) -> None:
    a, b = ShmKvFolder(str(tmp_path)), ShmKvFolder(str(tmp_path))
    a.open()
    b.open()
    assert a.enabled and a.shares_with(b.domain) and b.shares_with(a.domain)
    assert not a.shares_with("0" * 32) and not a.shares_with("../x")
    name = a.write(b"kv bytes")
    assert b.take(name) == b"kv bytes"
    assert not (tmp_path / name).exists()
    (tmp_path / ("pdserve-kv-" + "1" * 32)).symlink_to(tmp_path / "elsewhere")
    with pytest.raises(Exception, match="not in this worker's shared-memory folder"):
        b.take("pdserve-kv-" + "1" * 32)
    a.close()
    assert not b.shares_with(a.domain)
    missing = ShmKvFolder(str(tmp_path / "missing"))
    missing.open()
    assert not missing.enabled
    disabled = ShmKvFolder("")
    disabled.open()
    assert not disabled.enabled
    with pytest.raises(Exception, match="no shared-memory folder"):
        disabled.take(name)
    b.close()
