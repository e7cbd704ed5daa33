"""Draft-model speculation through real workers: the prefill worker's draft model proposes the
first run, which travels with the KV (KvChunk.draft_token_ids); the decode worker verifies it and
drafts on with its own draft model; output equals a non-speculating unified worker's, both KV
pools of both workers end full. A missing draft or one with another tokenizer ends the worker
with one error line."""

from __future__ import annotations

import json
import random
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from services.worker.server import main
from shared.proto import worker_pb2
from tests.support.tiny_models import build_tiny_draft

from .harness import RunningWorker, collect, running_worker, sampling, worker_settings
from .test_worker_grpc import all_blocks_free, disaggregated, token_ids_of, wait_blocks_free


@pytest.fixture(scope="module")
def draft_model(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_draft(tiny_model, tmp_path_factory.mktemp("worker-draft"), num_layers=1)


@pytest.fixture
async def draft_prefill(tiny_model: Path) -> AsyncIterator[RunningWorker]:
    # the target as its own draft: the first run is exactly the target's continuation
    settings = worker_settings(
        tiny_model, "prefill", speculative="draft", draft_model=str(tiny_model), spec_step_cost=False
    )
    async with running_worker(settings) as w:
        yield w


@pytest.fixture
async def draft_decode(tiny_model: Path, draft_model: Path) -> AsyncIterator[RunningWorker]:
    # every proposal verified (no step-cost model): the test counts accepted positions
    settings = worker_settings(
        tiny_model, "decode", speculative="draft", draft_model=str(draft_model), spec_step_cost=False
    )
    async with running_worker(settings) as w:
        yield w


@pytest.fixture
async def plain_unified(tiny_model: Path) -> AsyncIterator[RunningWorker]:
    async with running_worker(worker_settings(tiny_model, "unified")) as w:
        yield w


def _draft_pool_full(w: RunningWorker) -> bool:
    free, total = w.app.engine.draft_blocks(0)  # type: ignore[union-attr]
    return bool(total) and free == total


async def test_draft_handoff_proposals_are_verified_and_output_is_unchanged(
    draft_prefill: RunningWorker, draft_decode: RunningWorker, plain_unified: RunningWorker
) -> None:
    rng = random.Random(4)
    ids = [rng.randrange(3, 450) for _ in range(60)]
    reply, frames = await disaggregated(draft_prefill, draft_decode, "d1", ids, 40)
    ref = await collect(
        plain_unified.stub.Decode(
            worker_pb2.DecodeRequest(
                request_id="d1-ref",
                prompt_token_ids=ids,
                sampling=sampling(40),
                local_prefill=True,
                return_token_ids=True,
            )
        )
    )
    assert list(reply.token_ids) + token_ids_of(frames) == token_ids_of(ref)
    assert reply.text + "".join(f.text for f in frames) == "".join(f.text for f in ref)
    assert frames[-1].finish_reason == ref[-1].finish_reason
    engine = draft_decode.app.engine
    assert engine is not None
    stats = engine.spec_stats(0)
    # the handed-over run (the target's own continuation) was verified and accepted
    assert len(stats.accepted_per_position) >= 4 and min(stats.accepted_per_position[:4]) >= 1
    await wait_blocks_free(draft_decode)
    await wait_blocks_free(draft_prefill)
    assert all_blocks_free(plain_unified)
    assert _draft_pool_full(draft_decode) and _draft_pool_full(draft_prefill)


@pytest.fixture
def isolated_main(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """`main` configures process-wide logging and tracing: keep both as they were."""
    import structlog

    from services.worker import server

    monkeypatch.setattr(server, "configure_tracing", lambda *a, **kw: None)
    saved = structlog.get_config()
    yield
    structlog.configure(**saved)
    structlog.contextvars.clear_contextvars()


def _exit_line(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exc:
        main(["--listen", "127.0.0.1:0", "--metrics-port", "-1", "--log-format", "json", *argv])
    assert exc.value.code == 1
    out = capsys.readouterr()
    (line,) = [json.loads(x) for x in (out.out + out.err).splitlines() if '"worker_failed"' in x]
    assert "traceback" not in json.dumps(line).lower()
    return str(line["error"])


def test_a_missing_draft_model_ends_the_worker_with_one_line(
    tiny_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], isolated_main: None
) -> None:
    missing = tmp_path / "nowhere"
    error = _exit_line(
        ["--model", str(tiny_model), "--speculative", "draft", "--draft-model", str(missing)], capsys
    )
    assert "--draft-model" in error and "nowhere" in error


def test_a_draft_with_another_tokenizer_ends_the_worker_with_one_line(
    tiny_model: Path, tiny_byte_fallback_model: Path, capsys: pytest.CaptureFixture[str], isolated_main: None
) -> None:
    argv = [
        "--model",
        str(tiny_model),
        "--speculative",
        "draft",
        "--draft-model",
        str(tiny_byte_fallback_model),
    ]
    assert "does not share the target's tokenizer" in _exit_line(argv, capsys)
