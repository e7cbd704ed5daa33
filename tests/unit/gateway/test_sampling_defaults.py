"""The sampling defaults a model folder recommends (vLLM's --generation-config auto): the keys vLLM
reads, in range, and OpenAI's defaults where the file is silent, missing or wrong."""

from __future__ import annotations

import json
from pathlib import Path

from services.gateway.sampling_defaults import SamplingDefaults


def folder_with(tmp_path: Path, config: object) -> Path:
    (tmp_path / "generation_config.json").write_text(json.dumps(config))
    return tmp_path


def test_the_keys_vllm_reads_become_the_defaults(tmp_path: Path) -> None:
    config = {
        "temperature": 0.6,
        "top_p": 0.9,
        "top_k": 20,
        "min_p": 0.05,
        "repetition_penalty": 1.05,
        "max_new_tokens": 64,
        "do_sample": True,  # not one of them (vLLM ignores it too)
        "eos_token_id": [1, 2],
    }
    got = SamplingDefaults.of_model(folder_with(tmp_path, config))
    assert got == SamplingDefaults(
        temperature=0.6, top_p=0.9, top_k=20, min_p=0.05, repetition_penalty=1.05, max_tokens=64
    )


def test_silence_a_missing_or_broken_file_and_bad_values_give_openais_defaults(tmp_path: Path) -> None:
    openai = SamplingDefaults()
    assert openai.as_dict() == {
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": 0,
        "min_p": 0.0,
        "repetition_penalty": 1.0,
        "max_tokens": None,
    }
    assert SamplingDefaults.of_model(tmp_path) == openai  # no file
    assert SamplingDefaults.of_model(folder_with(tmp_path, {"eos_token_id": 2})) == openai
    (tmp_path / "generation_config.json").write_text("{not json")
    assert SamplingDefaults.of_model(tmp_path) == openai
    bad = {
        "temperature": -1,
        "top_p": 0,
        "top_k": 2.5,
        "min_p": 1.5,
        "repetition_penalty": 0,
        "max_new_tokens": 0,
    }
    assert SamplingDefaults.of_model(folder_with(tmp_path, bad)) == openai
    assert SamplingDefaults.of_model(folder_with(tmp_path, {"temperature": True, "top_k": None})) == openai
    assert SamplingDefaults.of_model(folder_with(tmp_path, {"temperature": 0})).temperature == 0.0
