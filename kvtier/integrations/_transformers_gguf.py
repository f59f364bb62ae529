"""GGUF checkpoints as ``transformers`` models: converted once, then loaded from the copy."""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

__all__ = ["MODEL_CACHE_ENV", "load_gguf", "model_cache_dir"]

logger = logging.getLogger(__name__)

#: Where :func:`load_gguf` keeps converted checkpoints unless told otherwise.
MODEL_CACHE_ENV = "KVTIER_MODEL_CACHE"


def model_cache_dir() -> Path:
    """``$KVTIER_MODEL_CACHE``, else ``kvtier/models`` under the user's cache directory."""
    configured = os.environ.get(MODEL_CACHE_ENV)
    if configured:
        return Path(configured).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "kvtier" / "models"


def load_gguf(
    gguf_file: str | os.PathLike[str],
    *,
    dtype: torch.dtype = torch.float32,
    cache_dir: str | os.PathLike[str] | None = None,
) -> tuple[Any, Any]:
    """Load a GGUF checkpoint as a ``transformers`` causal LM and its tokenizer.

    transformers dequantizes GGUF weights to ``dtype`` on every load, which takes
    tens of seconds even for a small model; the first load therefore saves the
    converted model (safetensors) and tokenizer under ``cache_dir`` (default
    :func:`model_cache_dir`), in a directory named for the file's content and the
    dtype, and later loads read that in seconds. Blocking: call it from a thread in
    an async program.

    Raises:
        FileNotFoundError: ``gguf_file`` does not exist.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = Path(gguf_file)
    if not source.is_file():
        raise FileNotFoundError(f"no GGUF file at {source}")
    root = Path(cache_dir) if cache_dir is not None else model_cache_dir()
    converted = root / f"{source.stem}-{_file_digest(source)}-{str(dtype).removeprefix('torch.')}"
    if not (converted / "config.json").is_file():
        logger.info("converting %s to %s once; later loads read %s", source, dtype, converted)
        model: Any = AutoModelForCausalLM.from_pretrained(
            str(source.parent), gguf_file=source.name, dtype=dtype
        )
        tokenizer = AutoTokenizer.from_pretrained(str(source.parent), gguf_file=source.name)
        # The weights are plain tensors of ``dtype`` now, but transformers still marks
        # the model as GGUF-quantized and refuses to save it that way.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        root.mkdir(parents=True, exist_ok=True)
        # Written aside and renamed, so a load interrupted half way leaves no directory
        # that a later load would take for a complete conversion.
        staging = Path(tempfile.mkdtemp(prefix=f".{converted.name}.", dir=root))
        try:
            model.save_pretrained(staging)
            tokenizer.save_pretrained(staging)
            staging.rename(converted)
        except OSError:
            if not (converted / "config.json").is_file():
                raise
            # Another process converted it meanwhile: use theirs.
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        return model.eval(), tokenizer
    loaded: Any = AutoModelForCausalLM.from_pretrained(str(converted), dtype=dtype)
    tokenizer = AutoTokenizer.from_pretrained(str(converted))
    return loaded.eval(), tokenizer


def _file_digest(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        while block := file.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()[:16]
