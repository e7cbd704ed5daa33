"""The trimmed KV handoff (engine/kv_trim.py): the arithmetic against the release rule, what a
decode-side reservation holds and registers, and the NIXL READ of only the planes the decode side
reads (windowed Mistral: every layer windowed; Gemma 2: layer 0 windowed, layer 1 full)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from services.worker.engine.api import EngineRequest, RequestKind, SamplingConfig
from services.worker.engine.block_manager import BlockManager
from services.worker.engine.kv_trim import KvTrim
from services.worker.engine.request import Request
from services.worker.engine.scheduler import Scheduler
from tests.support.nixl import progressed
from tests.unit.engine.conftest import (
    EngineFactory,
    collect,
    greedy,
    hf_greedy,
    random_prompt,
    request,
    tokens_of,
)


def test_trim_is_the_release_rule_at_the_first_decode_position() -> None:
    """A query at position n sees keys n - W + 1 .. n: blocks ending at or before n - W + 1 are
    behind; the longest windowed layer decides; full layers still travel."""
    mistral = KvTrim.of([4096] * 32)
    assert mistral.releases and mistral.full_layers == ()
    # 8k prompt, blocks of 16: keys 4097.. are read, so blocks 0..255 (tokens 0..4095) are not
    assert mistral.trim_blocks(8192, 16) == (8192 - 4096 + 1) // 16 == 256
    assert mistral.trim_blocks(4096, 16) == 0  # the window reaches token 1: nothing behind
    assert mistral.trim_blocks(4096 + 15, 16) == 1  # token 15 is the first one out of reach
    gemma2 = KvTrim.of([4096, None] * 21)
    assert not gemma2.releases and gemma2.full_layers == tuple(range(1, 42, 2))
    assert gemma2.trim_blocks(8192, 16) == 256
    mixed_windows = KvTrim.of([8, 16, None])  # behind EVERY window: the longest one counts
    assert mixed_windows.trim_blocks(41, 4) == (41 - 16 + 1) // 4
    llama = KvTrim.of([None] * 4)
    assert llama.trim_blocks(8192, 16) == 0 and not llama.releases
    # the same figure as Scheduler._release_behind_window once the prompt is computed
    blocks = BlockManager(64, 4, enable_prefix_caching=True)
    sched = Scheduler(blocks, 64, 4, kv_window_tokens=8, kv_trim=KvTrim.of([8, 8]))
    req = _request("full", 41, RequestKind.FULL)
    sched.add(req)
    while req.num_computed_tokens < 41:
        for s in sched.schedule().scheduled:
            sched.on_computed(s.request, s.num_new_tokens)
    assert req.num_released_blocks == KvTrim.of([8, 8]).trim_blocks(41, 4) == 8


def _request(rid: str, n: int, kind: RequestKind, first: int = 0) -> Request:
    prompt = tuple(range(first, first + n))
    return Request.from_engine_request(EngineRequest(rid, prompt, SamplingConfig(max_tokens=4), kind=kind))


@pytest.mark.parametrize(("windows", "held"), [([8, 8], 3), ([8, None], 11)])
def test_a_trimmed_reservation_holds_and_registers_only_what_arrives(
    windows: list[int | None], held: int
) -> None:
    """41 prompt tokens + the handoff token in blocks of 4: 11 blocks, 8 of them trimmed. Every
    layer windowed: those 8 are never held; with a full layer they are held (its K/V arrives)
    but, like the released ones, never registered in the prefix cache; blocks 8-9 are."""
    blocks = BlockManager(32, 4, enable_prefix_caching=True)
    trim = KvTrim.of(windows)
    sched = Scheduler(blocks, 64, 4, kv_window_tokens=8 if trim.releases else None, kv_trim=trim)
    req = _request("r", 41, RequestKind.DECODE_REMOTE)
    assert sched.reserve_remote(req) == 0
    assert req.num_trimmed_blocks == 8
    assert req.num_released_blocks == (8 if trim.releases else 0)
    assert len(req.block_ids) == 11  # block table covers the prompt + first token
    assert blocks.num_used_blocks == held
    req.start_from_handoff(7)
    sched.start_remote(req)
    assert req.num_hashed_blocks == 10
    assert blocks.lookup_prefix(req.prompt_token_ids, 10) == []  # chain starts trimmed
    assert [blocks.block_hash(b) is not None for b in req.block_ids[8:10]] == [True, True]
    # a prompt computed here in full registers blocks 0-7; the chain then runs into 8-9
    local = _request("l", 41, RequestKind.FULL)
    sched.add(local)
    while local.num_computed_tokens < 41:
        for s in sched.schedule().scheduled:
            sched.on_computed(s.request, s.num_new_tokens)
    assert len(blocks.lookup_prefix(req.prompt_token_ids, 10)) == 10
    for r in (req, local):
        sched.remove(r)
    assert blocks.num_free_blocks == 32


def test_a_failed_read_after_a_trimmed_reservation_recomputes_in_fresh_blocks() -> None:
    """NIXL's recompute policy needs every block again: the request starts over like a
    preempted one (its placeholders are never written)."""
    blocks = BlockManager(32, 4, enable_prefix_caching=True)
    sched = Scheduler(blocks, 64, 4, kv_window_tokens=8, kv_trim=KvTrim.of([8, 8]))
    req = _request("r", 41, RequestKind.DECODE_REMOTE)
    sched.reserve_remote(req)
    req.start_from_handoff(7)
    sched.recompute_remote(req)
    assert req.block_ids == [] and req.num_released_blocks == 0 and req.num_trimmed_blocks == 0
    scheduled = sched.schedule().scheduled
    assert scheduled[0].num_new_tokens == 42 and len(set(req.block_ids)) == len(req.block_ids) == 11


@pytest.mark.parametrize(("family", "full_layers"), [("mistral_windowed", 0), ("gemma2_windowed", 1)])
async def test_nixl_reads_only_the_planes_the_decode_side_reads(
    family: str, full_layers: int, tiny_family: Callable[[str], Path], make_engine: EngineFactory
) -> None:
    """Two engines, two NIXL agents in one process: the decode side READs blocks 8-10 of the
    41-token prompt whole and of blocks 0-7 only the full-attention layer (Gemma 2) or nothing
    (Mistral); tokens are transformers'."""
    from transformers import AutoModelForCausalLM

    from services.worker.kv_nixl import NixlKvAgent, load_nixl

    if load_nixl() is None:
        pytest.skip("nixl-cu13 is not installed")
    path = tiny_family(family)
    settings = {"block_size": 4, "kv_cache_tokens": 1024}
    prefill, decode = make_engine(path, **settings, max_batch_tokens=12), make_engine(path, **settings)
    layout = decode.kv_layout
    src = NixlKvAgent.create(prefill.kv_pools(), layout)
    dst = NixlKvAgent.create(decode.kv_pools(), layout)
    assert src is not None and dst is not None
    prompt = random_prompt(41, 21)
    sampling = greedy(16, ignore_eos=True)
    (first,) = await collect(
        prefill.add_request(request("n", prompt, sampling, kind=RequestKind.PREFILL_ONLY))
    )
    admission, handle = decode.admit_remote(request("n", prompt, sampling, kind=RequestKind.DECODE_REMOTE))
    assert admission.num_trim_blocks == 8
    dp_rank, block_ids = prefill.export_block_ids("n", admission.num_cached_blocks)
    source = src.source(dp_rank, block_ids, admission.num_cached_blocks)
    with progressed(src):  # the prefill worker progresses its agent while the READ runs
        nbytes = decode.import_kv_direct(
            admission.transfer_ticket,
            source.first_block,
            len(block_ids),
            lambda off, rank, ids, trimmed, layers: dst.read(source, off, rank, ids, 10.0, trimmed, layers),
        )
    prefill.release("n")
    decode.finish_import(
        admission.transfer_ticket, len(prompt), first.new_token_ids[0], first.num_generated_tokens
    )
    outs = await collect(handle)
    model = AutoModelForCausalLM.from_pretrained(str(path)).eval()
    assert list(first.new_token_ids) + tokens_of(outs) == hf_greedy(model, prompt, 16)
    layer_bytes = 2 * layout.num_kv_heads * layout.block_size * layout.head_dim * 4
    assert nbytes == (3 * layout.num_layers + 8 * full_layers) * layer_bytes
    assert decode.num_free_blocks(0) == decode.num_total_blocks(0)
