"""A paged KV cache's geometry, and what kvtier needs from it.

A host that keeps its KV cache in a pool of fixed-size blocks (as vLLM does) describes
the pool with :class:`PagedKVLayout`: layers, KV heads and head size of ONE worker
(tensor-parallel rank), the dtype and the tokens per block. From that it gets the
``kv_caches`` tensors to hand to :class:`~kvtier.KVTier` or ``spec.create_worker``, the
config's ``kv_bytes_per_block``, and a ``cpu_bytes_to_use`` that holds a given number
of tokens, so nothing has to be summed by hand.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvtier.config import OffloadingConfig, chunk_row_bytes
from kvtier.specs.factory import spec_name_for

__all__ = ["PagedKVLayout"]


@dataclass(frozen=True)
class PagedKVLayout:
    """The block pool of one worker: ``num_layers`` layers of K and V blocks.

    ``num_kv_heads`` is what this worker holds: a model's KV heads divided by the
    tensor-parallel size. A block holds ``tokens_per_block`` tokens of every layer.

    Raises:
        ValueError: a size is not a positive integer.
        TypeError: ``dtype`` is not a ``torch.dtype``.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    tokens_per_block: int = 16

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "tokens_per_block"):
            _check_positive(name, getattr(self, name))
        if not isinstance(self.dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype, not {type(self.dtype).__name__}")

    @property
    def block_shape(self) -> tuple[int, int, int, int]:
        """One layer's part of one block: ``(2, tokens_per_block, num_kv_heads, head_dim)``,
        K then V."""
        return (2, self.tokens_per_block, self.num_kv_heads, self.head_dim)

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes this worker holds for one token, all layers, K and V."""
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * itemsize

    @property
    def kv_bytes_per_block(self) -> int:
        """Bytes this worker holds for one block, all layers, K and V: the config's
        ``kv_bytes_per_block``."""
        return self.kv_bytes_per_token * self.tokens_per_block

    def allocate(self, num_blocks: int, device: str | torch.device = "cpu") -> list[torch.Tensor]:
        """A zeroed block pool: the ``kv_caches`` for ``KVTier`` or ``create_worker``.

        One tensor per layer, shaped ``(num_blocks, 2, tokens_per_block, num_kv_heads,
        head_dim)``: the block index first and each block's K and V one contiguous run,
        the layout kvtier copies from without reshaping. ``tensor[block, 0]`` is the
        block's K, ``tensor[block, 1]`` its V, token by token.
        """
        _check_positive("num_blocks", num_blocks)
        return [
            torch.zeros((num_blocks, *self.block_shape), dtype=self.dtype, device=device)
            for _ in range(self.num_layers)
        ]

    def cpu_bytes_for_tokens(
        self, tokens: int, *, tokens_per_chunk: int, world_size: int = 1
    ) -> int:
        """A ``cpu_bytes_to_use`` whose primary tier holds at least ``tokens`` tokens.

        The tier holds whole chunks of ``tokens_per_chunk`` tokens (the config's
        ``block_size``), each a row of every worker's bytes padded to the page size, so
        this is ``ceil(tokens / tokens_per_chunk)`` such rows. ``world_size`` workers
        share the region, each holding this layout.

        Raises:
            ValueError: ``tokens_per_chunk`` is not a multiple of ``tokens_per_block``,
                or a count is not a positive integer.
        """
        _check_positive("tokens", tokens)
        _check_positive("world_size", world_size)
        blocks_per_chunk = self._blocks_per_chunk(tokens_per_chunk)
        chunk_bytes = chunk_row_bytes(self.kv_bytes_per_block, blocks_per_chunk, world_size)
        return -(-tokens // tokens_per_chunk) * chunk_bytes

    def config(
        self,
        engine_id: str,
        *,
        cpu_tokens: int,
        tokens_per_chunk: int,
        model_name: str,
        kv_dtype: str,
        secondary_tiers: Sequence[Mapping[str, Any]] = (),
        world_size: int = 1,
        rank: int = 0,
        enable_kv_events: bool = False,
        **extra: Any,
    ) -> OffloadingConfig:
        """An :class:`~kvtier.OffloadingConfig` for this layout.

        The primary tier holds at least ``cpu_tokens`` tokens in chunks of
        ``tokens_per_chunk``. With ``secondary_tiers`` the spec is the
        ``TieringOffloadingSpec``, else the ``CPUOffloadingSpec``; ``extra`` adds other
        ``extra_config`` keys (``eviction_policy``, ``backpressure``, ``spec_name``...).

        ``model_name`` and ``kv_dtype`` are the cache's identity: chunks are shared only
        between configs that agree on them. Put in them everything that changes the KV
        values of the same tokens (model and revision, the weights' quantization, the
        KV dtype) and use the same string as the ``salt`` of
        :func:`~kvtier.prefix_keys`.

        Raises:
            ValueError: a sizing argument is bad, ``model_name`` or ``kv_dtype`` is
                empty, or ``extra`` sets ``cpu_bytes_to_use`` or ``block_size``.
            kvtier.ConfigError: the resulting config is invalid.
        """
        for name, value in (("model_name", model_name), ("kv_dtype", kv_dtype)):
            if not isinstance(value, str) or not value:
                raise ValueError(
                    f"{name} must be a non-empty string: it is part of the cache's identity"
                )
        for key in ("cpu_bytes_to_use", "block_size"):
            if key in extra:
                raise ValueError(f"{key} comes from cpu_tokens and tokens_per_chunk; drop it")
        extra_config: dict[str, Any] = {
            "cpu_bytes_to_use": self.cpu_bytes_for_tokens(
                cpu_tokens, tokens_per_chunk=tokens_per_chunk, world_size=world_size
            ),
            "block_size": tokens_per_chunk,
        }
        if secondary_tiers:
            extra_config["secondary_tiers"] = [dict(tier) for tier in secondary_tiers]
        extra_config.update(extra)
        extra_config.setdefault("spec_name", spec_name_for(extra_config))
        return OffloadingConfig(
            engine_id=engine_id,
            kv_bytes_per_block=self.kv_bytes_per_block,
            tokens_per_block=self.tokens_per_block,
            world_size=world_size,
            rank=rank,
            model_name=model_name,
            kv_dtype=kv_dtype,
            extra_config=extra_config,
            enable_kv_events=enable_kv_events,
        )

    def _blocks_per_chunk(self, tokens_per_chunk: int) -> int:
        _check_positive("tokens_per_chunk", tokens_per_chunk)
        if tokens_per_chunk % self.tokens_per_block:
            raise ValueError(
                f"tokens_per_chunk must be a multiple of tokens_per_block="
                f"{self.tokens_per_block}, got {tokens_per_chunk}"
            )
        return tokens_per_chunk // self.tokens_per_block


def _check_positive(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value}")
