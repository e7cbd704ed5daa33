"""shared/model_store.py's random-weight models (`random:<shape>`): a folder with a config of a
real shape and the bundled tokenizer, weights built seeded on the device, the same in every
process; unknown names are refused with the choices."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from shared import model_store
from tests.support.tiny_models import build_tiny_model


@pytest.fixture
def cache(tmp_path: Path) -> Path:
    """A model cache whose 'default' model is a tiny one (its tokenizer stands in for SmolLM2's,
    so nothing is converted)."""
    default = tmp_path / model_store.DEFAULT_MODEL
    build_tiny_model(tmp_path / "tiny", "bpe")
    shutil.copytree(tmp_path / "tiny", default)
    (default / ".pdserve-complete").write_text("ok\n")
    return tmp_path


@pytest.mark.parametrize("name", ["smollm2", "tiny"])
def test_a_random_shape_resolves_to_its_config_and_the_bundled_tokenizer(cache: Path, name: str) -> None:
    from transformers import AutoConfig, AutoTokenizer

    path = model_store.resolve_model(f"random:{name}", cache)
    assert path == cache / f"random-{name}" and model_store.is_random(path)
    assert not list(path.glob("*.safetensors"))  # no weights on disk
    config = AutoConfig.from_pretrained(str(path))
    shape = model_store.RANDOM_SHAPES[name]
    assert config.model_type == shape["model_type"]
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads"):
        assert getattr(config, key) == shape[key]
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    assert config.vocab_size == len(tokenizer)
    assert model_store.resolve_model(f"random:{name}", cache) == path  # made once
    assert not model_store.is_random(cache / model_store.DEFAULT_MODEL)


def test_random_weights_are_the_same_in_every_load_and_leave_the_rng_alone(cache: Path) -> None:
    path = model_store.resolve_model("random:smollm2", cache)
    torch.manual_seed(123)
    before = torch.random.get_rng_state()
    a = model_store.load_causal_lm(path, "cpu", dtype=torch.float32)
    assert torch.equal(torch.random.get_rng_state(), before)
    b = model_store.load_causal_lm(path, "cpu", dtype=torch.float32)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))
    assert a.dtype == torch.float32 and a.lm_head.weight is a.model.embed_tokens.weight  # tied
    assert a.model.layers[0].mlp.up_proj.weight.std() > 0


def test_unknown_models_and_shapes_are_refused_with_the_choices(cache: Path) -> None:
    with pytest.raises(FileNotFoundError, match="random:llama-8b"):
        model_store.resolve_model("random:llama-70b", cache)
    with pytest.raises(FileNotFoundError, match="random:llama-8b"):
        model_store.resolve_model("no-such-model", cache)
