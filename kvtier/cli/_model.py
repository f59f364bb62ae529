"""A model's KV cache shape, and the bytes one worker holds per GPU block: what
``kvtier plan`` computes ``--kv-bytes-per-block`` from when given the model instead.

One worker (tensor-parallel rank) holds, for one GPU block of ``tokens_per_block``
tokens, every layer's K and V for its share of the KV heads::

    layers x 2 (K and V) x KV heads per rank x head size x dtype bytes x tokens per block

An MLA model (DeepSeek-V2/V3 and kin) caches one latent vector per token and layer
instead of K and V per head, and every rank holds all of it::

    layers x latent size x dtype bytes x tokens per block

Pure arithmetic on a few integers and names: no torch, no transformers.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["DTYPE_BYTES", "ModelShape", "ModelShapeError", "dtype_bytes"]

#: Bytes per element of the KV cache dtypes an operator names: torch's names, the
#: short ones, and vLLM's ``--kv-cache-dtype`` values (its fp8 variants are one byte).
DTYPE_BYTES = {
    "float32": 4,
    "fp32": 4,
    "float": 4,
    "bfloat16": 2,
    "bf16": 2,
    "float16": 2,
    "fp16": 2,
    "half": 2,
    "fp8": 1,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
}

#: ``layer_types`` entries of a Hugging Face config whose layers keep a K and V cache
#: of the same shape (a sliding-window layer's blocks are as large as a full one's).
_ATTENTION_LAYER_TYPES = {"full_attention", "sliding_attention"}


class ModelShapeError(ValueError):
    """A model shape that cannot be read, or that does not give one answer."""


def dtype_bytes(name: str) -> int:
    """Bytes per element of the dtype called ``name`` (``bf16``, ``torch.float16``...).

    Raises:
        ModelShapeError: a name not in :data:`DTYPE_BYTES`.
    """
    key = name.strip().lower().removeprefix("torch.")
    if key not in DTYPE_BYTES:
        raise ModelShapeError(
            f"unknown dtype {name!r}; expected one of {', '.join(sorted(DTYPE_BYTES))}"
        )
    return DTYPE_BYTES[key]


@dataclass(frozen=True)
class ModelShape:
    """What sizes a model's KV cache: its attention layers, and per layer either K and
    V heads (``kv_heads`` x ``head_dim``) or one MLA latent (``latent_dim``)."""

    layers: int
    dtype: str
    kv_heads: int | None = None
    head_dim: int | None = None
    #: An MLA model's latent size per token and layer (``kv_lora_rank`` +
    #: ``qk_rope_head_dim``); None for K and V heads.
    latent_dim: int | None = None

    def __post_init__(self) -> None:
        for name in ("layers", "kv_heads", "head_dim", "latent_dim"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or value < 1):
                raise ModelShapeError(f"{name} must be a positive integer, got {value}")
        dtype_bytes(self.dtype)
        heads = self.kv_heads is not None and self.head_dim is not None
        if self.latent_dim is not None and (self.kv_heads is not None or self.head_dim is not None):
            raise ModelShapeError(
                "an MLA latent size and KV heads describe two different caches; give one"
            )
        if self.latent_dim is None and not heads:
            raise ModelShapeError("needs the KV heads and the head size, or an MLA latent size")

    @property
    def is_mla(self) -> bool:
        """One latent per token and layer, the same on every rank."""
        return self.latent_dim is not None

    def heads_per_rank(self, world_size: int) -> int:
        """The KV heads one of ``world_size`` tensor-parallel ranks holds: an even share,
        or one head when there are fewer heads than ranks (each then held by several).

        Raises:
            ModelShapeError: the heads do not split evenly over the ranks.
        """
        heads = self.kv_heads or 0
        if heads >= world_size:
            if heads % world_size:
                raise ModelShapeError(
                    f"{heads} KV heads do not split evenly over {world_size} "
                    "tensor-parallel ranks (--world-size)"
                )
            return heads // world_size
        if world_size % heads:
            raise ModelShapeError(
                f"{world_size} tensor-parallel ranks (--world-size) cannot share {heads} "
                "KV heads evenly "
                "(each head is held by the same number of ranks)"
            )
        return 1

    def kv_bytes_per_block(self, tokens_per_block: int, world_size: int) -> int:
        """The bytes one worker holds for one GPU block of ``tokens_per_block`` tokens."""
        size = dtype_bytes(self.dtype)
        if self.latent_dim is not None:
            return self.layers * self.latent_dim * size * tokens_per_block
        head_dim = self.head_dim or 0
        return (
            self.layers * 2 * self.heads_per_rank(world_size) * head_dim * size * tokens_per_block
        )

    def explain(self, tokens_per_block: int, world_size: int) -> str:
        """The product :meth:`kv_bytes_per_block` computes, factor by factor."""
        size = dtype_bytes(self.dtype)
        bytes_per_block = self.kv_bytes_per_block(tokens_per_block, world_size)
        if self.latent_dim is not None:
            factors = [
                f"{self.layers} layers",
                f"{self.latent_dim} latent (MLA, the same on every rank)",
            ]
        else:
            factors = [
                f"{self.layers} layers",
                "2 (K and V)",
                f"{self.heads_per_rank(world_size)} KV heads per rank",
                f"{self.head_dim} head size",
            ]
        factors += [f"{size} bytes ({self.dtype})", f"{tokens_per_block} tokens per block"]
        return f"{' x '.join(factors)} = {bytes_per_block:,}"

    @classmethod
    def from_hf_config(cls, path: Path, dtype: str | None = None) -> ModelShape:
        """The shape a Hugging Face ``config.json`` (or a model directory holding one)
        describes; ``dtype`` (the KV cache's, when it is not the model's) in place of
        its ``torch_dtype``.

        Raises:
            ModelShapeError: the file cannot be read, or lacks what sizes the cache.
        """
        file = path / "config.json" if path.is_dir() else path
        try:
            loaded = json.loads(file.read_text())
        except OSError as exc:
            raise ModelShapeError(f"cannot read {file}: {exc.strerror}") from None
        except json.JSONDecodeError as exc:
            raise ModelShapeError(f"{file} is not valid JSON: {exc}") from None
        if not isinstance(loaded, dict):
            raise ModelShapeError(f"{file} must hold a JSON object (a model's config.json)")
        # A multimodal model's language model, whose layers hold the KV cache.
        text = loaded.get("text_config")
        config: Mapping[str, Any] = {**loaded, **text} if isinstance(text, dict) else loaded
        return cls._from_mapping(config, file, dtype)

    @classmethod
    def _from_mapping(cls, config: Mapping[str, Any], file: Path, dtype: str | None) -> ModelShape:
        def integer(*names: str) -> int | None:
            for name in names:
                value = config.get(name)
                if value is not None:
                    if not isinstance(value, int) or isinstance(value, bool):
                        raise ModelShapeError(f"{file}: {name} must be an integer, got {value!r}")
                    return value
            return None

        def required(*names: str) -> int:
            value = integer(*names)
            if value is None:
                raise ModelShapeError(
                    f"{file} has no {' or '.join(names)}: not a transformer's config.json? "
                    "give the shape (--layers ...) or --kv-bytes-per-block instead"
                )
            return value

        layer_types = config.get("layer_types")
        if isinstance(layer_types, list):
            others = sorted({str(kind) for kind in layer_types} - _ATTENTION_LAYER_TYPES)
            if others:
                raise ModelShapeError(
                    f"{file}: layers of type {', '.join(others)} keep no K and V cache of "
                    "the attention layers' shape; give --kv-bytes-per-block as the engine "
                    "reports it"
                )
        layers = required("num_hidden_layers", "num_layers", "n_layer")
        model_dtype = config.get("torch_dtype") or config.get("dtype")
        if dtype is None or dtype == "auto":
            if not isinstance(model_dtype, str):
                raise ModelShapeError(f"{file} names no torch_dtype; give the KV cache's --dtype")
            dtype = model_dtype
        if config.get("kv_lora_rank") is not None:
            latent = required("kv_lora_rank") + (integer("qk_rope_head_dim") or 0)
            return cls(layers=layers, dtype=dtype, latent_dim=latent)
        attention_heads = required("num_attention_heads", "n_head")
        kv_heads = integer("num_key_value_heads") or attention_heads
        head_dim = integer("head_dim")
        if head_dim is None:
            hidden = required("hidden_size", "n_embd")
            if hidden % attention_heads:
                raise ModelShapeError(
                    f"{file}: hidden_size {hidden} is not a multiple of its "
                    f"{attention_heads} attention heads; give --head-dim"
                )
            head_dim = hidden // attention_heads
        return cls(layers=layers, dtype=dtype, kv_heads=kv_heads, head_dim=head_dim)
