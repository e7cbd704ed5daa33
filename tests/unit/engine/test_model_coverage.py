"""Model coverage: a tiny random model of every architecture family the engine serves
(tests/support/tiny_models.FAMILIES: Llama, Qwen2, Qwen3, Mistral, Gemma2, Phi3, OLMo2, Mixtral,
Qwen3-MoE, and windowed Qwen2, Mistral, Gemma2, Phi3 and a Gemma3 text model, 8-token windows),
served by the engine in fp32 on CPU, greedy, token-identical to transformers' `generate` on
prompts longer than the windows: several requests batched together; with prefill chunks, a
prefix-cache hit and n-gram speculation all on; on the BATCHED attention backend; and prefilled
on one engine, decoded on another."""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache
from pathlib import Path
from typing import Any

import pytest
import torch

from services.worker.engine import attention
from services.worker.engine.api import RequestOutput
from tests.support.tiny_models import FAMILIES, WINDOW
from tests.unit.engine.conftest import (
    EngineFactory,
    HandoffStats,
    collect,
    greedy,
    greedy_tokens,
    handoff_run,
    hf_greedy,
    random_prompt,
    request,
    tokens_of,
)

WINDOWED = sorted(f for f in FAMILIES if f.endswith("_windowed") or f == "gemma3_text")
NEW_TOKENS = 16
# settings of every engine here: blocks of 4 tokens (a window spans blocks), a small pool
BASE: dict[str, Any] = {"block_size": 4, "kv_cache_tokens": 1024}


@lru_cache(maxsize=64)
def _reference(model_path: str, prompt: tuple[int, ...]) -> tuple[int, ...]:
    """transformers' greedy continuation (EOS an ordinary token, as with ignore_eos)."""
    return tuple(hf_greedy(_hf_model(model_path), prompt, NEW_TOKENS))


@lru_cache(maxsize=16)
def _hf_model(model_path: str) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()


def _prompts() -> list[tuple[int, ...]]:
    """Longer than the 8-token windows, one shorter than a window."""
    return [random_prompt(n, seed) for seed, n in enumerate((21, 6, 34))]


async def _check_batched_requests(engine: Any, path: Path) -> None:
    prompts = _prompts()
    got = await greedy_tokens(engine, prompts, NEW_TOKENS)
    assert got == [list(_reference(str(path), p)) for p in prompts]


@pytest.mark.parametrize("family", sorted(FAMILIES))
async def test_family_matches_transformers(
    family: str, tiny_family: Callable[[str], Path], make_engine: EngineFactory
) -> None:
    path = tiny_family(family)
    await _check_batched_requests(make_engine(path, **BASE), path)


@pytest.mark.parametrize("family", sorted(FAMILIES))
async def test_family_with_chunks_prefix_hits_and_speculation(
    family: str, tiny_family: Callable[[str], Path], make_engine: EngineFactory
) -> None:
    """Prefill chunks of at most 12 tokens (every prompt here needs several), a second prompt
    sharing the first's first 24 tokens (6 cached blocks, well past the window), repetitive
    prompts, n-gram speculation of 3 tokens: verify passes over windowed layers."""
    path = tiny_family(family)
    engine = make_engine(
        path,
        **BASE,
        max_batch_tokens=12,
        speculative="ngram",
        num_speculative_tokens=3,
        spec_step_cost=False,
    )
    first = random_prompt(30, 11)
    shared = first[:24] + random_prompt(9, 12)
    # repetitive prompts: the random models' outputs soon repeat n-grams (proposals to verify)
    repetitive = (random_prompt(2, 13) * 12, random_prompt(6, 13) * 4)
    outs: list[list[RequestOutput]] = []
    for i, prompt in enumerate((first, shared, *repetitive)):
        outs.append(
            await collect(engine.add_request(request(f"r{i}", prompt, greedy(NEW_TOKENS, ignore_eos=True))))
        )
        assert tokens_of(outs[-1]) == list(_reference(str(path), prompt)), f"prompt {i}"
    assert outs[0][-1].num_prefill_chunks >= 3
    assert outs[1][-1].num_local_cached_tokens == 24
    assert engine.spec_stats(0).num_draft_tokens > 0


@pytest.mark.parametrize("family", WINDOWED)
async def test_windowed_family_on_the_batched_backend(
    family: str,
    tiny_family: Callable[[str], Path],
    make_engine: EngineFactory,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The backend CUDA runs by default, here on CPU: one padded call per layer with the window
    in its mask."""
    monkeypatch.setattr(
        attention.AttentionBackend,
        "default_for",
        staticmethod(lambda device: attention.AttentionBackend.BATCHED),
    )
    path = tiny_family(family)
    engine = make_engine(path, **BASE, max_batch_tokens=12)
    assert engine._ranks[0].runner.attention_backend is attention.AttentionBackend.BATCHED  # type: ignore[attr-defined]
    await _check_batched_requests(engine, path)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("family", WINDOWED)
async def test_windowed_family_on_cuda_matches_transformers(
    family: str, tiny_family: Callable[[str], Path], make_engine: EngineFactory
) -> None:
    """CUDA's defaults (graphs by batch size; on the lean loop FlexAttention over the pool with a
    mask per window, fused layers), fp32, prompts longer than the windows, several batched:
    transformers' greedy tokens, and every block back in the pool."""
    path = tiny_family(family)
    engine = make_engine(path, **BASE, device="cuda", dtype="float32")
    await _check_batched_requests(engine, path)
    assert engine.num_free_blocks(0) == engine.num_total_blocks(0)


@pytest.mark.parametrize("family", ["llama", *WINDOWED])
async def test_disaggregated_matches_transformers(
    family: str, tiny_family: Callable[[str], Path], make_engine: EngineFactory
) -> None:
    """Prefilled on one engine (in chunks), KV handed over, decoded on another, moving only what
    the decode side can still read (engine/kv_trim.py): of the 41-token prompt's 11 blocks the
    first (41 - 8 + 1) // 4 = 8 lie wholly behind every 8-token window at the first decode
    position, so they carry only the full-attention layers (nothing on an all-windowed model).
    Then on the decode engine: a handoff from an older prefill worker (which sends every block
    whole), a second handoff and local prefills whose prompts share the first's blocks (prefix
    lookups over blocks that arrived trimmed) all stay token-identical."""
    from transformers import AutoConfig

    from services.worker.engine.model_variants import attention_windows

    path = tiny_family(family)
    prefill, decode = make_engine(path, **BASE, max_batch_tokens=12), make_engine(path, **BASE)
    prompt = random_prompt(41, 21)
    stats = HandoffStats()
    first, rest = await handoff_run(prefill, decode, "d", prompt, greedy(NEW_TOKENS, ignore_eos=True), stats)
    assert list(first.new_token_ids) + tokens_of(rest) == list(_reference(str(path), prompt))

    windows = attention_windows(AutoConfig.from_pretrained(str(path)))
    num_layers, num_full = len(windows), windows.count(None)
    trimmed = 8 if family != "llama" else 0
    layout = decode.kv_layout
    layer_bytes = 2 * layout.num_kv_heads * layout.block_size * layout.head_dim * 4  # fp32
    assert stats.block_layers == (11 - trimmed) * num_layers + trimmed * num_full
    assert stats.bytes == stats.block_layers * layer_bytes
    assert stats.blocks == (11 if num_full else 11 - trimmed)
    if family != "llama":
        assert stats.bytes < 11 * num_layers * layer_bytes

    # An older prefill worker ignores the trim and sends every block whole: the decode side
    # writes what it holds and drops the blocks it released.
    old = HandoffStats()
    first3, rest3 = await handoff_run(
        prefill, decode, "d3", prompt, greedy(NEW_TOKENS, ignore_eos=True), old, trim=False
    )
    assert list(first3.new_token_ids) + tokens_of(rest3) == list(_reference(str(path), prompt))
    # (the first handoff's blocks are no prefix hits here, so all 11 travel; llama hits 10)
    assert old.block_layers == (1 if family == "llama" else 11) * num_layers
    # Later requests on the decode engine sharing the first prompt's first 24 tokens (6 blocks,
    # all trimmed above): a shorter one whose window still reads blocks 4 and 5, handed over;
    # the same served locally; the whole first prompt again. A prefix hit on trimmed blocks
    # would read layers that never arrived: they are never hits; blocks computed here are.
    shorter = prompt[:24] + random_prompt(2, 22)
    second, rest2 = await handoff_run(
        prefill, decode, "d2", shorter, greedy(NEW_TOKENS, ignore_eos=True), HandoffStats()
    )
    assert list(second.new_token_ids) + tokens_of(rest2) == list(_reference(str(path), shorter))
    for rid, p, hits in (("l1", shorter, 0), ("l2", prompt, 24)):
        # windowed: l1 finds nothing (blocks 0-5 arrived trimmed), l2 the 6 blocks l1 computed
        # here in full, not block 6 (trimmed); llama finds whatever is not evicted yet
        outs = await collect(decode.add_request(request(rid, p, greedy(NEW_TOKENS, ignore_eos=True))))
        assert tokens_of(outs) == list(_reference(str(path), p)), rid
        if family != "llama":
            assert outs[-1].num_local_cached_tokens == hits, rid

    for engine in (prefill, decode):
        assert engine.num_free_blocks(0) == engine.num_total_blocks(0)


def test_windowed_families_really_have_windows_shorter_than_the_prompts(
    tiny_family: Callable[[str], Path],
) -> None:
    """Guards the matrix: the windowed models window some layer to 8 tokens (< the prompts) and
    the others window nothing a prompt here reaches."""
    from transformers import AutoConfig

    from services.worker.engine.model_variants import attention_windows

    for family in FAMILIES:
        windows = attention_windows(AutoConfig.from_pretrained(str(tiny_family(family))))
        if family in WINDOWED:
            assert WINDOW in windows
        else:
            assert all(w is None or w > 64 for w in windows), family


@pytest.mark.parametrize(
    ("family", "releases"),
    [("mistral_windowed", True), ("phi3_windowed", True), ("gemma2_windowed", False)],
)
async def test_blocks_behind_every_window_go_back_to_the_pool(
    family: str, releases: bool, tiny_family: Callable[[str], Path], make_engine: EngineFactory
) -> None:
    """Every layer with an 8-token window (Mistral, Phi-3 here): the blocks of 4 tokens wholly
    behind it are given back as the request goes on, so a 30 + 48-token request holds a few
    blocks, not 20; the tokens stay transformers'. A model with a full-attention layer (Gemma 2
    alternates) keeps them all."""
    path = tiny_family(family)
    engine = make_engine(path, **BASE, max_batch_tokens=16)
    prompt = random_prompt(30, 31)
    outs: list[RequestOutput] = []
    held: list[int] = []
    async for out in engine.add_request(request("long", prompt, greedy(48, ignore_eos=True))):
        outs.append(out)
        if not out.finished:
            held.append(engine.num_total_blocks(0) - engine.num_free_blocks(0))
    assert tokens_of(outs) == hf_greedy(_hf_model(str(path)), prompt, 48)
    if releases:
        assert max(held) <= 5  # the window's 8 tokens, the block being filled, one more
    else:
        assert max(held) >= 19  # 30 + 47 tokens in blocks of 4
    assert engine.num_free_blocks(0) == engine.num_total_blocks(0)


async def test_given_back_blocks_survive_preemption_and_speculation(
    tiny_family: Callable[[str], Path], make_engine: EngineFactory
) -> None:
    """Six requests in a pool of 10 blocks: preempted requests (their blocks partly given back)
    recompute, speculation rolls back rejected proposals; tokens stay transformers', no block is
    freed twice, every block is free at the end."""
    path = tiny_family("mistral_windowed")
    engine = make_engine(
        path,
        block_size=4,
        kv_cache_tokens=40,
        max_batch_tokens=16,
        speculative="ngram",
        num_speculative_tokens=3,
        spec_step_cost=False,
    )
    prompts = [random_prompt(n, 40 + n) for n in (30, 25, 33, 28, 31, 22)]
    got = await greedy_tokens(engine, prompts, 40)
    model = _hf_model(str(path))
    assert got == [hf_greedy(model, p, 40) for p in prompts]
    assert engine.num_preemptions(0) > 0
    assert engine.num_free_blocks(0) == engine.num_total_blocks(0)
