"""Tiny random Llama models with locally trained tokenizers, for tests that need *a* model.

Two tokenizer kinds, because token accounting differs between them:
- "bpe": byte-level BPE (like SmolLM2/GPT-2): every byte is a token, multi-byte characters
  usually split into several tokens whose text pieces only make sense together.
- "byte_fallback": BPE over characters with `<0xXX>` byte tokens for unknown characters (like
  Llama/Mistral): '🙂' becomes 4 byte tokens that decode to one character, or U+FFFD when partial.

Usage: `build_tiny_model(folder, kind)` or `python -m tests.support.tiny_models FOLDER --kind bpe`.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world! This is a tiny model used for pdserve tests.",
    "Prefill and decode run on different workers; the KV cache moves between them.",
    "Tokens, blocks, ranks and schedulers: serving language models in production.",
    "user assistant system What is the capital of France? Paris is the capital.",
    "numbers 0 1 2 3 4 5 6 7 8 9 10 100 1000 and punctuation , . ; : ! ? ( ) [ ] { }",
]


def _train_tokenizer(kind: str) -> object:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if kind == "bpe":
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=600,
            special_tokens=SPECIAL_TOKENS,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        )
    elif kind == "byte_fallback":
        tok = Tokenizer(models.BPE(byte_fallback=True))
        tok.pre_tokenizer = pre_tokenizers.Metaspace()
        tok.decoder = decoders.Sequence(
            [
                decoders.Replace("\u2581", " "),
                decoders.ByteFallback(),
                decoders.Fuse(),
                decoders.Strip(" ", 1, 0),
            ]
        )
        byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
        trainer = trainers.BpeTrainer(
            vocab_size=700,
            special_tokens=SPECIAL_TOKENS + byte_tokens,
            limit_alphabet=100,
        )
    else:
        raise ValueError(f"unknown tokenizer kind {kind!r}")
    tok.train_from_iterator(CORPUS * 20, trainer=trainer)
    return tok


def build_tiny_model(
    folder: str | Path, kind: str = "bpe", seed: int = 0, text_tokens: tuple[str, ...] = ()
) -> Path:
    """Write a tiny random LlamaForCausalLM + tokenizer to `folder` (idempotent); returns it.
    `text_tokens` are added to the tokenizer as non-special added tokens (as Qwen's <think>)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    folder = Path(folder)
    if (folder / "config.json").exists() and (folder / "tokenizer.json").exists():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    raw = _train_tokenizer(kind)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=raw,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|im_end|>",
        unk_token=None,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    if text_tokens:
        from tokenizers import AddedToken

        tokenizer.add_tokens([AddedToken(t, special=False) for t in text_tokens])
    tokenizer.save_pretrained(str(folder))
    eos_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert isinstance(eos_id, int)  # one token, one id
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=2048,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
        bos_token_id=None,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.generation_config.eos_token_id = eos_id
    model.generation_config.pad_token_id = eos_id
    model.save_pretrained(str(folder))
    (folder / "pdserve-tiny.json").write_text(json.dumps({"kind": kind, "seed": seed}))
    return folder


def build_tiny_draft(target: str | Path, folder: str | Path, num_layers: int = 1, noise: float = 0.0) -> Path:
    """A draft model for speculation tests (idempotent; returns `folder`): `target`'s tokenizer
    and its first `num_layers` layers (embeddings, norm and LM head too), every weight plus
    Gaussian `noise` (std) when given, so it agrees with the target often but not always."""
    import shutil

    import torch
    from transformers import AutoConfig, LlamaForCausalLM

    folder = Path(folder)
    if (folder / "config.json").exists():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    for f in Path(target).iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(f, folder / f.name)
    config = AutoConfig.from_pretrained(str(target))
    config.num_hidden_layers = num_layers
    source = LlamaForCausalLM.from_pretrained(str(target)).state_dict()
    draft = LlamaForCausalLM(config)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in draft.state_dict().items():
            param.copy_(source[name] + noise * torch.randn(param.shape, generator=gen))
    draft.save_pretrained(str(folder))
    return folder


# Tiny random models of each architecture family the engine serves (tests/unit/engine/
# test_model_coverage.py), all 2 layers, hidden 64, 4 query / 2 KV heads of 16 dims, over the
# local "bpe" tokenizer. Each entry: (transformers config class, its keyword arguments).
# Windowed variants have an 8-token window, shorter than the tests' prompts.
WINDOW = 8
_COMMON = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": False,
}
FAMILIES: dict[str, tuple[str, dict[str, object]]] = {
    "llama": ("LlamaConfig", {}),
    "qwen2": ("Qwen2Config", {}),
    "qwen2_windowed": (  # layers from max_window_layers on are windowed: layer 1
        "Qwen2Config",
        {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1},
    ),
    "qwen3": ("Qwen3Config", {}),
    "mistral": ("MistralConfig", {"sliding_window": None}),
    "mistral_windowed": ("MistralConfig", {"sliding_window": WINDOW}),  # every layer
    "gemma2": (  # Gemma 2's soft-caps and query_pre_attn_scalar; window longer than any prompt
        "Gemma2Config",
        {
            "sliding_window": 4096,
            "query_pre_attn_scalar": 24,
            "attn_logit_softcapping": 50.0,
            "final_logit_softcapping": 30.0,
        },
    ),
    "gemma2_windowed": (  # layer 0 windowed, layer 1 full (Gemma 2's alternation)
        "Gemma2Config",
        {
            "sliding_window": WINDOW,
            "query_pre_attn_scalar": 24,
            "attn_logit_softcapping": 50.0,
            "final_logit_softcapping": 30.0,
        },
    ),
    "gemma3_text": (
        "Gemma3TextConfig",
        {
            "sliding_window": WINDOW,
            "layer_types": ["sliding_attention", "full_attention"],
            "query_pre_attn_scalar": 24,
        },
    ),
    "phi3": ("Phi3Config", {"sliding_window": None, "pad_token_id": 0}),
    "phi3_windowed": ("Phi3Config", {"sliding_window": WINDOW, "pad_token_id": 0}),
    "olmo2": ("Olmo2Config", {}),
    "mixtral": ("MixtralConfig", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "decoder_sparse_step": 1},
    ),
}


def build_tiny_family(folder: str | Path, family: str, seed: int = 0) -> Path:
    """Write a tiny random model of `family` (a FAMILIES key) with the "bpe" tokenizer to `folder`
    (idempotent); returns it."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    folder = Path(folder)
    if (folder / "config.json").exists():
        return folder
    base = build_tiny_model(folder / "base", "bpe")  # its tokenizer files
    folder.mkdir(parents=True, exist_ok=True)
    for f in base.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            (folder / f.name).write_bytes(f.read_bytes())
    class_name, extra = FAMILIES[family]
    vocab = json.loads((base / "config.json").read_text())["vocab_size"]
    eos_id = json.loads((base / "config.json").read_text())["eos_token_id"]
    kwargs: dict[str, object] = {**_COMMON, "vocab_size": vocab, "eos_token_id": eos_id}
    kwargs.setdefault("pad_token_id", eos_id)
    kwargs.update(extra)
    config = getattr(transformers, class_name)(**kwargs)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config.eos_token_id = eos_id
    model.save_pretrained(str(folder))
    return folder


# every projection a Llama decoder layer has (PEFT's module names)
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def build_tiny_lora(
    base: str | Path,
    folder: str | Path,
    seed: int = 1,
    rank: int = 8,
    alpha: int = 16,
    targets: tuple[str, ...] = LORA_TARGETS,
    scale: float = 0.5,
    use_rslora: bool = False,
) -> Path:
    """A PEFT LoRA adapter of the model in `base`, saved by peft (adapter_config.json +
    adapter_model.safetensors) to `folder` (idempotent); returns it. Both of its matrices are
    random (std `scale`; peft starts B at zero, which would adapt nothing), so the adapter
    visibly changes the model's output."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    folder = Path(folder)
    if (folder / "adapter_config.json").exists():
        return folder
    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    config = LoraConfig(
        r=rank, lora_alpha=alpha, target_modules=list(targets), lora_dropout=0.0, use_rslora=use_rslora
    )
    peft_model = get_peft_model(model, config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * scale)
    peft_model.save_pretrained(str(folder))
    return folder


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("folder")
    parser.add_argument("--kind", default="bpe", choices=["bpe", "byte_fallback"])
    args = parser.parse_args()
    print(build_tiny_model(args.folder, args.kind))


if __name__ == "__main__":
    main()
