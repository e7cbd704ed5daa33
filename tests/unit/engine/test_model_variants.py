"""engine/model_variants.py: per-layer attention windows read from real transformers configs the
way each family's modeling code reads them, and a one-line refusal naming the config field for
every attention the engine cannot reproduce exactly (before any weight is loaded)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import transformers

from services.worker.engine import create_engine
from services.worker.engine.api import EngineConfig
from services.worker.engine.model_variants import (
    UnsupportedAttention,
    attention_softcap,
    attention_windows,
    check_supported,
)

SMALL = {"num_hidden_layers": 6, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2}


def _config(name: str, **kwargs: Any) -> Any:
    return getattr(transformers, name)(**{**SMALL, **kwargs})


@pytest.mark.parametrize(
    ("name", "kwargs", "windows"),
    [
        ("LlamaConfig", {}, [None] * 6),
        ("MistralConfig", {"sliding_window": 8}, [8] * 6),
        ("MistralConfig", {"sliding_window": None}, [None] * 6),
        ("MixtralConfig", {"sliding_window": 8}, [8] * 6),
        ("Phi3Config", {"sliding_window": 2047, "pad_token_id": 0}, [2047] * 6),
        ("Phi3Config", {"pad_token_id": 0}, [None] * 6),
        # Qwen2/3: use_sliding_window off ignores sliding_window; on, layers >= max_window_layers
        ("Qwen2Config", {"sliding_window": 8}, [None] * 6),
        (
            "Qwen2Config",
            {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 4},
            [None] * 4 + [8] * 2,
        ),
        ("Qwen3Config", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 0}, [8] * 6),
        ("Qwen3MoeConfig", {"use_sliding_window": True, "sliding_window": 8}, [8] * 6),
        ("Qwen3MoeConfig", {"sliding_window": 8}, [None] * 6),
        # Gemma 2 alternates from a windowed layer 0; Gemma 3 windows five layers of every six
        ("Gemma2Config", {"sliding_window": 8}, [8, None] * 3),
        ("Gemma3TextConfig", {"sliding_window": 8}, [8] * 5 + [None]),
        ("Gemma3TextConfig", {"sliding_window": 8, "sliding_window_pattern": 2}, [8, None] * 3),
        ("Olmo2Config", {}, [None] * 6),
        # OLMo 3 windows three layers of every four; SmolLM3 windows its NoPE layers when asked
        ("Olmo3Config", {"sliding_window": 8}, [8, 8, 8, None, 8, 8]),
        ("SmolLM3Config", {"use_sliding_window": True, "sliding_window": 8}, [None] * 3 + [8] + [None] * 2),
        ("SmolLM3Config", {"sliding_window": 8}, [None] * 6),
    ],
)
def test_windows_per_layer_as_transformers_masks_them(
    name: str, kwargs: dict[str, Any], windows: list[int | None]
) -> None:
    config = _config(name, **kwargs)
    check_supported(config)
    assert attention_windows(config) == windows


def test_layer_types_are_read_where_the_family_declares_them() -> None:
    config = _config(
        "Gemma3TextConfig", sliding_window=8, layer_types=["full_attention", "sliding_attention"] * 3
    )
    assert attention_windows(config) == [None, 8] * 3


def test_mistral_ignores_layer_types_as_its_modeling_code_does() -> None:
    config = _config("MistralConfig", sliding_window=8, layer_types=["full_attention"] * 6)
    assert attention_windows(config) == [8] * 6


def test_a_multimodal_config_is_read_through_its_text_config() -> None:
    config = transformers.Gemma3Config(
        text_config={**SMALL, "sliding_window": 8, "sliding_window_pattern": 3}
    )
    assert attention_windows(config) == [8, 8, None] * 2


def test_softcap_is_read_and_honoured() -> None:
    config = _config("Gemma2Config", attn_logit_softcapping=50.0)
    check_supported(config)
    assert attention_softcap(config) == 50.0
    assert attention_softcap(_config("LlamaConfig")) is None


@pytest.mark.parametrize(
    ("config", "field"),
    [
        (lambda: _config("GptOssConfig", num_local_experts=4), "sinks"),
        (lambda: _config("Llama4TextConfig", attention_chunk_size=64), "attention_chunk_size"),
        (
            lambda: _config("Gemma3TextConfig", use_bidirectional_attention=True),
            "use_bidirectional_attention",
        ),
        (
            lambda: _config("Gemma2Config", layer_types=["sliding_attention", "chunked_attention"] * 3),
            "layer_types",
        ),
        (lambda: _config("Gemma2Config", sliding_window=0), "sliding_window"),
        (lambda: _config("Gemma2Config", attn_logit_softcapping=-1.0), "attn_logit_softcapping"),
    ],
    ids=["sinks", "chunked", "bidirectional", "layer_types", "window", "softcap"],
)
def test_unsupported_attention_is_refused_naming_the_field(config: Any, field: str) -> None:
    with pytest.raises(UnsupportedAttention, match=field) as info:
        check_supported(config())
    assert "\n" not in str(info.value)
    assert isinstance(info.value, ValueError)  # the worker's one-line configuration error


def test_engine_refuses_at_start_before_loading_weights(tmp_path: Path) -> None:
    """Only config.json is there: the refusal comes before any weight (or tokenizer) is read."""
    from tests.support.tiny_models import build_tiny_model

    tiny = build_tiny_model(tmp_path / "tiny", "bpe")
    folder = tmp_path / "chunked"
    folder.mkdir()
    for f in tiny.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            (folder / f.name).write_bytes(f.read_bytes())
    config = json.loads((tiny / "config.json").read_text())
    config["attention_chunk_size"] = 8
    (folder / "config.json").write_text(json.dumps(config))
    engine = create_engine(EngineConfig(model_path=str(folder), kv_cache_tokens=256))
    with pytest.raises(UnsupportedAttention, match="attention_chunk_size=8"):
        engine.start()
    engine.shutdown()


def test_a_window_the_config_reading_misses_is_refused_at_warm_up(
    tiny_family: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The warm-up step checks each layer's own attention call (transformers passes the layer's
    sliding_window) against model_variants' reading: a family read wrongly is never served."""
    import torch

    from services.worker.engine import model_variants
    from services.worker.engine.model_loading import kv_layout_of, load_model
    from services.worker.engine.model_runner import ModelRunner

    cpu = torch.device("cpu")
    model = load_model(str(tiny_family("qwen2_windowed")), cpu, torch.float32)  # layer 1 windowed
    layout = kv_layout_of(model.config, 4, torch.float32)
    ModelRunner(model, layout, 8, cpu, torch.float32).warm_up()  # read right: fine
    monkeypatch.setattr(model_variants, "attention_windows", lambda config: [None, None])
    runner = ModelRunner(model, layout, 8, cpu, torch.float32)
    with pytest.raises(UnsupportedAttention, match="layer 1 attends with sliding_window=8"):
        runner.warm_up()
