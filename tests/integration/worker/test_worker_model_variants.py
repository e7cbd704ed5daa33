"""Attention variants through real workers: a windowed model (Gemma 2's alternating 8-token
window, soft-caps) served disaggregated (its handoff trimmed to what the decode worker can still
read, over the gRPC push and NIXL) and unified gives transformers' greedy tokens on a prompt
longer than its window; a model whose attention the engine cannot reproduce (attention
sinks, chunked local attention) ends the worker at start with one error line naming the field."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from shared.proto import worker_pb2
from tests.support.reference import hf_greedy
from tests.support.tiny_models import build_tiny_family, build_tiny_model

from .harness import collect, running_worker, sampling, worker_settings
from .test_worker_grpc import disaggregated, token_ids_of
from .test_worker_spec_draft import _exit_line, isolated_main  # noqa: F401 (a fixture)


@pytest.fixture(scope="module")
def windowed_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_family(
        tmp_path_factory.mktemp("worker-variants") / "gemma2_windowed", "gemma2_windowed"
    )


async def test_windowed_model_disaggregated_and_unified_match_transformers(windowed_model: Path) -> None:
    rng = random.Random(5)
    ids = [rng.randrange(3, 450) for _ in range(27)]  # > the 8-token window
    max_tokens = 16
    want = hf_greedy(windowed_model, ids, max_tokens)
    async with (
        # 8 tokens per step: the gRPC push starts with the first chunk, trimmed blocks included
        running_worker(worker_settings(windowed_model, "prefill", max_batch_tokens=8)) as prefill,
        running_worker(worker_settings(windowed_model, "decode")) as decode,
        running_worker(worker_settings(windowed_model, "unified")) as unified,
    ):
        reply, frames = await disaggregated(prefill, decode, "w1", ids, max_tokens)
        assert list(reply.token_ids) + token_ids_of(frames) == want
        assert reply.num_chunks == 4
        # Of the 7 prompt blocks (4 tokens) the first (27 - 8 + 1) // 4 = 5 lie behind the window
        # at the first decode position: only their full-attention layer (1 of 2) travels.
        assert frames[0].trim_blocks == 5
        layout = decode.app.engine.kv_layout  # type: ignore[union-attr]
        layer_bytes = 2 * layout.num_kv_heads * layout.block_size * layout.head_dim * 4
        assert reply.kv_bytes_sent == (5 * 1 + 2 * 2) * layer_bytes
        if decode.app.nixl is not None and prefill.app.nixl is not None:  # the same over NIXL
            reply, frames = await disaggregated(
                prefill, decode, "w2", ids, max_tokens, kv_transport=worker_pb2.KV_TRANSPORT_NIXL
            )
            assert reply.kv_transport == worker_pb2.KV_TRANSPORT_NIXL
            assert list(reply.token_ids) + token_ids_of(frames) == want
            assert reply.kv_bytes_sent == (5 * 1 + 2 * 2) * layer_bytes
        unified_frames = await collect(
            unified.stub.Decode(
                worker_pb2.DecodeRequest(
                    request_id="w1-unified",
                    prompt_token_ids=ids,
                    sampling=sampling(max_tokens),
                    local_prefill=True,
                    return_token_ids=True,
                )
            )
        )
        assert token_ids_of(unified_frames) == want


def _config_only_model(folder: Path, tokenizer_from: Path, config: dict[str, object]) -> Path:
    """A model folder with a tokenizer and a config.json but no weights: a refusal must come
    before any weight is read."""
    folder.mkdir()
    for f in tokenizer_from.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            (folder / f.name).write_bytes(f.read_bytes())
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize(
    ("config", "field"),
    [
        ({"model_type": "gpt_oss", "architectures": ["GptOssForCausalLM"], "num_hidden_layers": 2}, "sinks"),
        (
            {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "attention_chunk_size": 8},
            "attention_chunk_size",
        ),
    ],
    ids=["sinks", "chunked"],
)
def test_unsupported_attention_ends_the_worker_with_one_line(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    isolated_main: None,  # noqa: F811
    config: dict[str, object],
    field: str,
) -> None:
    tokenizer = build_tiny_model(tmp_path / "tiny", "bpe")
    model = _config_only_model(tmp_path / "model", tokenizer, config)
    error = _exit_line(["--model", str(model)], capsys)
    assert field in error and "not supported" in error
