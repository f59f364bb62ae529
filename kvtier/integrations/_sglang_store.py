"""SGLang's side of kvtier's SGLang backend that needs no SGLang: its page names as
kvtier keys, its settings as a kvtier configuration, and the error for a host pool
kvtier cannot store (the public face and the design are in
:mod:`kvtier.integrations.sglang`; the pages move through the engine-neutral
:class:`kvtier.hosts.PageStore`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvtier.config import OffloadingConfig
from kvtier.errors import ConfigError, KVTierError
from kvtier.hosts.pages import IOSample, PageStore, Segment
from kvtier.keys import OffloadKey, make_offload_key
from kvtier.specs.factory import with_spec_name

__all__ = [
    "IOSample",
    "PageStore",
    "Segment",
    "UnsupportedPoolError",
    "offloading_config",
    "page_key",
]

#: The prefix of the requests SGLang's calls are to the tiers (``sglang-<n>``).
REQUEST_PREFIX = "sglang"


class UnsupportedPoolError(KVTierError):
    """SGLang registered a host pool whose pages kvtier cannot store (raised by the
    backend while SGLang attaches it, which then fails with this message)."""


def page_key(page_hash: str) -> OffloadKey:
    """The kvtier key of an SGLang page: its 64-hex-digit chained hash as bytes.

    A name that is not hex (no SGLang KV page has one) is used as its UTF-8 bytes.
    """
    try:
        raw = bytes.fromhex(page_hash)
    except ValueError:
        raw = page_hash.encode()
    return make_offload_key(raw or b"\0")


def offloading_config(
    kvtier_config: Mapping[str, Any],
    *,
    engine_id: str,
    page_tokens: int,
    page_bytes: int,
    model_name: str,
    kv_format: str,
    shard: str = "",
    config_path: str = "kvtier",
) -> OffloadingConfig:
    """The kvtier configuration of one SGLang rank.

    ``kv_format`` names what the bytes of a page mean beyond the model (KV dtype, host
    pool kind, memory layout); ``shard`` which part of the model's KV this rank holds
    (tensor- and pipeline-parallel rank and size; empty when every rank holds the same
    bytes, as MLA ranks do). Both go into the storage namespace, so ranks, layouts and
    models never read each other's chunks.

    Raises:
        ConfigError: ``kvtier_config`` is not a mapping, or sets ``block_size`` to
            another size than the page (the rest is checked when the spec is built).
    """
    if not isinstance(kvtier_config, Mapping):
        raise ConfigError(
            config_path, f"expected a mapping of kvtier settings, got {type(kvtier_config)}"
        )
    extra = with_spec_name(kvtier_config)
    block_size = extra.setdefault("block_size", page_tokens)
    if block_size != page_tokens:
        raise ConfigError(
            f"{config_path}.block_size",
            f"one SGLang page is one kvtier chunk: expected {page_tokens} (the page "
            f"size) or no block_size, got {block_size!r}",
        )
    return OffloadingConfig(
        engine_id=engine_id,
        kv_bytes_per_block=page_bytes,
        tokens_per_block=page_tokens,
        world_size=1,
        rank=0,
        model_name=f"{model_name}@{shard}" if shard else model_name,
        kv_dtype=kv_format,
        extra_config=extra,
    )
