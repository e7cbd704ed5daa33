"""shared/model_store.py's random-weight models (`random:<shape>`): a folder with a config of a
real shape and the bundled tokenizer, weights built seeded on the device, the same in every
process; unknown names are refused with the choices."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

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
        model_store.resolve_model("random:llama-405b", cache)
    with pytest.raises(FileNotFoundError, match="random:llama-8b"):
        model_store.resolve_model("no-such-model", cache)


@pytest.mark.parametrize("name", ["smollm2", "tiny"])
def test_a_layer_hook_gets_each_layer_built_on_the_device_one_at_a_time(cache: Path, name: str) -> None:
    """With a hook (--quantization fp8 quantizes there) a random-weight model is made on the meta
    device and its layers built one at a time: each reaches the hook whole, while the layers
    after it are not built yet; the result has no meta tensor left, its tied head is its
    embedding, and the weights are the same in every load."""
    path = model_store.resolve_model(f"random:{name}", cache)
    seen: list[tuple[int, bool]] = []

    def hook(layer: Any) -> None:
        params = list(layer.parameters())
        seen.append((len(seen), all(p.device.type == "cpu" for p in params)))
        with torch.no_grad():
            layer.mlp.up_proj.weight.fill_(0.5)  # what the hook does stays

    a = model_store.load_causal_lm(path, "cpu", layer_hook=hook, dtype=torch.float32)
    layers = model_store.RANDOM_SHAPES[name]["num_hidden_layers"]
    assert seen == [(i, True) for i in range(layers)]
    assert not [n for n, t in [*a.named_parameters(), *a.named_buffers()] if t.device.type == "meta"]
    assert a.model.layers[0].mlp.gate_proj.weight.std() > 0 and a.model.norm.weight.eq(1).all()
    assert a.model.layers[-1].mlp.up_proj.weight.eq(0.5).all()
    if model_store.RANDOM_SHAPES[name]["tie_word_embeddings"]:
        assert a.lm_head.weight is a.model.embed_tokens.weight
    b = model_store.load_causal_lm(path, "cpu", layer_hook=hook, dtype=torch.float32)
    assert all(
        torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True)
    )
    # it computes: the rotary embedding was made for the config
    out = a(torch.tensor([[1, 2, 3]])).logits
    assert torch.isfinite(out).all()


def test_a_layer_hook_gets_each_layer_of_a_folder_too(cache: Path) -> None:
    path = cache / model_store.DEFAULT_MODEL
    seen: list[torch.nn.Module] = []
    model = model_store.load_causal_lm(path, "cpu", layer_hook=seen.append, dtype=torch.float32)
    assert seen == list(model.model.layers)
