"""Fixtures for engine tests: tiny models (built once per session) and engine factories."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from services.worker.engine import create_engine
from services.worker.engine.api import (
    Engine,
    EngineConfig,
    EngineRequest,
    RequestHandle,
    RequestKind,
    RequestOutput,
    SamplingConfig,
)
from tests.support.tiny_models import build_tiny_family, build_tiny_model


@pytest.fixture(scope="session")
def tiny_bpe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny_bpe"), "bpe")


@pytest.fixture(scope="session")
def tiny_byte_fallback(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny_bf"), "byte_fallback")


@pytest.fixture(scope="session")
def tiny_family(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """Tiny random models of the families in tests/support/tiny_models.FAMILIES, each built once
    per session on first use."""
    root = tmp_path_factory.mktemp("tiny_families")
    return lambda family: build_tiny_family(root / family, family)


EngineFactory = Callable[..., Engine]


@pytest.fixture
def make_engine(tiny_bpe: Path) -> Iterator[EngineFactory]:
    """Builds started engines (tiny bpe model by default); shuts them all down afterwards."""
    engines: list[Engine] = []

    def factory(model_path: Path | str | None = None, **overrides: Any) -> Engine:
        settings: dict[str, Any] = {"kv_cache_tokens": 4096, "max_batch_tokens": 512}
        settings.update(overrides)
        engine = create_engine(EngineConfig(model_path=str(model_path or tiny_bpe), **settings))
        engine.start()
        engines.append(engine)
        return engine

    yield factory
    for engine in engines:
        engine.shutdown()


def greedy(max_tokens: int, **kw: Any) -> SamplingConfig:
    return SamplingConfig(max_tokens=max_tokens, temperature=0.0, **kw)


def request(
    request_id: str,
    prompt: tuple[int, ...] | list[int],
    sampling: SamplingConfig,
    kind: RequestKind = RequestKind.FULL,
    dp_rank: int = 0,
) -> EngineRequest:
    return EngineRequest(request_id, tuple(prompt), sampling, dp_rank=dp_rank, kind=kind)


async def collect(handle: RequestHandle) -> list[RequestOutput]:
    return [out async for out in handle]


def tokens_of(outputs: list[RequestOutput]) -> list[int]:
    return [t for o in outputs for t in o.new_token_ids]


def text_of(outputs: list[RequestOutput]) -> str:
    return "".join(o.text_delta for o in outputs)


async def drain(handles: list[RequestHandle]) -> list[list[RequestOutput]]:
    import asyncio

    return list(await asyncio.gather(*(collect(h) for h in handles)))


async def greedy_tokens(engine: Engine, prompts: list[tuple[int, ...]], max_tokens: int) -> list[list[int]]:
    """Each prompt's greedy tokens (EOS ignored), all requests in flight together."""
    handles = [
        engine.add_request(request(f"p{i}", p, greedy(max_tokens, ignore_eos=True)))
        for i, p in enumerate(prompts)
    ]
    return [tokens_of(o) for o in await drain(handles)]


def hf_greedy(model: Any, prompt: tuple[int, ...] | list[int], max_new_tokens: int) -> list[int]:
    import torch
    from transformers import GenerationConfig

    # no EOS: the engine side runs with ignore_eos, so EOS is an ordinary token on both sides
    config = GenerationConfig(
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=model.config.vocab_size + 1,
        pad_token_id=0,
    )
    ids = torch.tensor([list(prompt)])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
    return [int(t) for t in out[0, len(prompt) :].tolist()]


def random_prompt(n: int, seed: int) -> tuple[int, ...]:
    """n seeded random token ids of the tiny models' vocabulary (specials excluded)."""
    import random

    rng = random.Random(seed)
    return tuple(rng.randrange(3, 450) for _ in range(n))


async def run_all(engine: Engine, reqs: list[EngineRequest]) -> list[list[RequestOutput]]:
    return await drain([engine.add_request(r) for r in reqs])


def assert_same_outputs(off: list[RequestOutput], on: list[RequestOutput]) -> None:
    """Same tokens, text, finish reason and generated count (speculation off vs on)."""
    assert tokens_of(on) == tokens_of(off)
    assert "".join(o.text_delta for o in on) == "".join(o.text_delta for o in off)
    assert on[-1].finish_reason == off[-1].finish_reason
    assert on[-1].num_generated_tokens == off[-1].num_generated_tokens


@dataclass
class HandoffStats:
    """What a handoff_run moved: blocks (one count per block, whatever its layers), block-layers
    (blocks x layers carried) and bytes."""

    blocks: int = 0
    block_layers: int = 0
    bytes: int = 0


async def handoff_run(
    prefill: Engine,
    decode: Engine,
    rid: str,
    prompt: tuple[int, ...],
    sampling: SamplingConfig,
    stats: HandoffStats | None = None,
    trim: bool = True,
) -> tuple[RequestOutput, list[RequestOutput]]:
    """One request prefilled on `prefill` and decoded on `decode`, its KV and proposals handed
    over as the workers do (the decode side's trim passed on unless `trim` is False, as with an
    older prefill worker): (the prefill's output, the decode's outputs)."""
    (first,) = await collect(
        prefill.add_request(request(rid, prompt, sampling, kind=RequestKind.PREFILL_ONLY))
    )
    admission, handle = decode.admit_remote(request(rid, prompt, sampling, kind=RequestKind.DECODE_REMOTE))
    num_trim = admission.num_trim_blocks if trim else 0
    num_layers = prefill.kv_layout.num_layers
    for chunk in prefill.export_kv(rid, admission.num_cached_blocks, 20_000, num_trim):
        if stats is not None:
            stats.blocks += chunk.num_blocks
            stats.block_layers += chunk.num_blocks * len(chunk.layers or range(num_layers))
            stats.bytes += len(chunk.data)
        decode.import_kv(admission.transfer_ticket, chunk)
    prefill.release(rid)
    decode.finish_import(
        admission.transfer_ticket,
        len(prompt),
        first.new_token_ids[0],
        first.num_generated_tokens,
        first.draft_token_ids,
    )
    return first, await collect(handle)


def metrics_core(engine: Engine) -> Any:
    """A unified WorkerCore over `engine` with no KV pusher: what turns the engine's counts into
    Prometheus figures (refresh_metrics)."""
    from services.worker.core import WorkerCore
    from shared.cluster import Role, WorkerInfo

    identity = WorkerInfo(
        worker_id="w",
        address="a:1",
        role=Role.UNIFIED,
        model_id="tiny",
        dp_size=1,
        kv_layout=engine.kv_layout,
    )
    return WorkerCore(engine, identity, pusher=None)  # type: ignore[arg-type]
