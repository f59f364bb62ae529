"""vLLM's ``kv_connector_extra_config`` as kvtier's vLLM adapter reads it, without vLLM.

:class:`kvtier.integrations.vllm.KVTierOffloadingSpec` takes the mapping vLLM hands it,
drops the keys vLLM reads itself, renames vLLM's fs-tier keys to kvtier's, and builds
kvtier's own spec with the chunk size vLLM resolved. That reading lives here, apart from
the adapter (which imports vLLM), so that ``kvtier plan`` can check a configuration
written for vLLM exactly as the adapter will read it where vLLM is not installed.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from kvtier.errors import ConfigError

__all__ = [
    "ADAPTER_MODULE",
    "ADAPTER_SPEC",
    "VLLM_KEYS",
    "adapter_extra_config",
    "names_adapter",
    "translate_extra_config",
    "vllm_key_hint",
]

#: ``spec_module_path`` and ``spec_name`` that make vLLM load kvtier's adapter.
ADAPTER_MODULE = "kvtier.integrations.vllm"
ADAPTER_SPEC = "KVTierOffloadingSpec"

#: Keys of ``kv_connector_extra_config`` that vLLM itself reads; kvtier never sees them.
#: ``block_size`` and ``blocks_per_chunk`` come back as the chunk size vLLM resolved.
VLLM_KEYS = frozenset(
    {
        "spec_name",
        "spec_module_path",
        "block_size",
        "blocks_per_chunk",
        "self_describing_kv_events",
        "canonical_layout",
        "sync_load_budget_bytes",
    }
)

#: vLLM's fs-tier thread counts, as the kvtier fs tier's I/O depths.
_FS_KEYS = {"n_read_threads": "read_depth", "n_write_threads": "write_depth"}

#: The keys above that kvtier's own specs do not read (``block_size`` they do).
_VLLM_ONLY = VLLM_KEYS - {"spec_name", "spec_module_path", "block_size"}

_TIER_KEY = re.compile(r"secondary_tiers\[\d+\]\.(\w+)")


def names_adapter(extra_config: Mapping[str, Any]) -> bool:
    """Whether ``extra_config`` makes vLLM load kvtier's adapter."""
    return (
        extra_config.get("spec_name") == ADAPTER_SPEC
        and extra_config.get("spec_module_path") == ADAPTER_MODULE
    )


def translate_extra_config(extra_config: Mapping[str, Any]) -> dict[str, Any]:
    """vLLM's ``kv_connector_extra_config`` as kvtier's: vLLM's own keys removed,
    vLLM's fs-tier keys renamed.

    Raises:
        ConfigError: an fs tier sets both a vLLM key and the kvtier key it maps to.
    """
    translated = {k: v for k, v in extra_config.items() if k not in VLLM_KEYS}
    tiers = translated.get("secondary_tiers")
    if isinstance(tiers, list):
        translated["secondary_tiers"] = [
            _translate_tier(tier, i) if isinstance(tier, Mapping) else tier
            for i, tier in enumerate(tiers)
        ]
    return translated


def _translate_tier(tier: Mapping[str, Any], index: int) -> dict[str, Any]:
    out = dict(tier)
    if out.get("type") != "fs":
        return out
    for vllm_key, kvtier_key in _FS_KEYS.items():
        if vllm_key in out:
            if kvtier_key in out:
                raise ConfigError(
                    f"secondary_tiers[{index}].{vllm_key}",
                    f"set either {vllm_key} (vLLM's name) or {kvtier_key}, not both",
                )
            out[kvtier_key] = out.pop(vllm_key)
    return out


def adapter_extra_config(extra_config: Mapping[str, Any], tokens_per_block: int) -> dict[str, Any]:
    """The ``extra_config`` of the kvtier spec the adapter builds from vLLM's
    ``extra_config``, for GPU blocks of ``tokens_per_block`` tokens: translated, its
    ``block_size`` the chunk vLLM resolves from ``blocks_per_chunk`` or ``block_size``
    (one block without either). Without ``spec_name``: the adapter picks the spec
    :func:`~kvtier.specs.factory.with_spec_name` picks.

    Raises:
        ConfigError: as :func:`translate_extra_config`; ``blocks_per_chunk`` is not a
            positive integer, or makes another chunk than ``block_size`` says.
    """
    translated = translate_extra_config(extra_config)
    translated["block_size"] = _chunk_tokens(extra_config, tokens_per_block)
    return translated


def _chunk_tokens(extra_config: Mapping[str, Any], tokens_per_block: int) -> Any:
    """Tokens per chunk; a bad ``block_size`` is left for kvtier's own check of it."""
    blocks = extra_config.get("blocks_per_chunk")
    block_size = extra_config.get("block_size")
    if blocks is None:
        return tokens_per_block if block_size is None else block_size
    if isinstance(blocks, bool) or not isinstance(blocks, int) or blocks < 1:
        raise ConfigError("blocks_per_chunk", f"expected a positive integer, got {blocks!r}")
    tokens = blocks * tokens_per_block
    if block_size is not None and block_size != tokens:
        raise ConfigError(
            "blocks_per_chunk",
            f"{blocks} blocks of {tokens_per_block} tokens make {tokens}-token chunks, "
            f"but block_size says {block_size!r}: set one of the two",
        )
    return tokens


def vllm_key_hint(path: str, spec_name: str) -> str | None:
    """What to say about an unknown setting at ``path`` that is one of vLLM's keys,
    which the spec ``spec_name`` does not read; None for any other key."""
    adapter = (
        f"for vLLM, name kvtier's adapter (spec_name {ADAPTER_SPEC}, spec_module_path "
        f"{ADAPTER_MODULE}), which reads it"
    )
    if path in _VLLM_ONLY:
        own = "; kvtier's own specs take block_size (tokens per chunk)"
        return (
            f"a key of vLLM's kv_connector_extra_config, which {spec_name} does not read: "
            f"{adapter}{own if path == 'blocks_per_chunk' else ''}"
        )
    found = _TIER_KEY.fullmatch(path)
    if found is not None and found.group(1) in _FS_KEYS:
        kvtier_key = _FS_KEYS[found.group(1)]
        return (
            f"vLLM's name for the fs tier's {kvtier_key}, which {spec_name} does not read: "
            f"{adapter}; kvtier's own specs take {kvtier_key}"
        )
    return None
