"""``kvtier plan``: a configuration read the way the engine reads it, and the primary
region and tiers it describes. ``kvtier bench --config`` reads its file here too."""

from __future__ import annotations

import argparse
import dataclasses
import enum
import json
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvtier.cli._args import fail, read_json_object
from kvtier.config import OffloadingConfig
from kvtier.errors import KVTierError

if TYPE_CHECKING:
    from kvtier.specs.base import OffloadingSpec
    from kvtier.specs.settings import TierConfig

__all__ = ["as_kvtier_reads", "engine_spec", "plan_command"]


def as_kvtier_reads(extra: Mapping[str, Any], tokens_per_block: int) -> dict[str, Any]:
    """A file's ``extra_config`` as kvtier's spec will receive it.

    A configuration written for vLLM that loads kvtier's adapter (``spec_module_path``
    ``kvtier.integrations.vllm``) is read as the adapter reads it, vLLM's own keys
    translated, without importing vLLM: what the adapter hands kvtier is then checked
    like any other file. ``kvtier plan`` and ``kvtier bench --config`` both read a file
    through here and :func:`engine_spec`, so they accept and refuse the same files
    with the same messages.

    Raises:
        ConfigError: a vLLM key the adapter refuses.
    """
    from kvtier.integrations.vllm_config import adapter_extra_config, names_adapter

    if names_adapter(extra):
        return adapter_extra_config(extra, tokens_per_block)
    return dict(extra)


def engine_spec(config: OffloadingConfig) -> OffloadingSpec:
    """The spec the engine builds for ``config``: ``extra_config`` parsed and checked
    the way the engine reads it, connecting to nothing and opening nothing; a bare
    file's spec named by :func:`~kvtier.specs.factory.with_spec_name`.

    Raises:
        ConfigError: as the engine would raise it; for one of vLLM's keys given to a
            kvtier spec, saying where that key belongs.
    """
    from kvtier.errors import ConfigError
    from kvtier.integrations.vllm_config import vllm_key_hint
    from kvtier.specs.factory import OffloadingSpecFactory

    try:
        return OffloadingSpecFactory.create_spec(config)
    except ConfigError as exc:
        spec_name = str(config.extra_config.get("spec_name", "CPUOffloadingSpec"))
        hint = vllm_key_hint(exc.path, spec_name) if exc.problem.startswith("unknown") else None
        if hint is None:
            raise
        raise ConfigError(exc.path, f"unknown setting: {hint}") from None


def plan_command(args: argparse.Namespace) -> int:
    from kvtier.integrations.vllm_config import (
        ADAPTER_MODULE,
        ADAPTER_SPEC,
        VLLM_KEYS,
        names_adapter,
        translate,
    )
    from kvtier.specs.factory import with_spec_name

    extra = read_json_object(args.config) if args.config is not None else {}
    for item in args.overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            fail(f"--set expects KEY=VALUE, got {item!r}")
        try:
            extra[key] = json.loads(value)
        except json.JSONDecodeError:
            extra[key] = value
    try:
        config = OffloadingConfig(
            engine_id=args.engine_id,
            kv_bytes_per_block=args.kv_bytes_per_block,
            tokens_per_block=args.tokens_per_block,
            world_size=args.world_size,
            extra_config=with_spec_name(as_kvtier_reads(extra, args.tokens_per_block)),
        )
        spec = engine_spec(config)
    except KVTierError as exc:
        fail(str(exc))
    settings = spec.settings
    geometry = settings.geometry
    plan: dict[str, Any] = {"spec": type(spec).__name__}
    if names_adapter(extra):
        # What vLLM loads, and the keys it reads itself (unchecked here: vLLM's own).
        plan["vllm_spec"] = f"{ADAPTER_MODULE}.{ADAPTER_SPEC}"
        plan["vllm_keys"] = {
            key: extra[key]
            for key in sorted(VLLM_KEYS - {"spec_name", "spec_module_path"})
            if key in extra
        }
        # How each key of vLLM's tiering spec and tiers was read (renamed, or unused).
        plan["vllm_readings"] = [str(reading) for reading in translate(extra).readings]
    plan |= {
        "cpu_bytes_to_use": settings.cpu_bytes_to_use,
        "block_size": settings.block_size,
        "eviction_policy": settings.eviction_policy,
        "cache_policy_module_path": settings.cache_policy_module_path,
        "store_threshold": settings.store_threshold,
        "max_tracked_lookups": settings.max_tracked_lookups,
        "offload_prompt_only": settings.offload_prompt_only,
        "recompute_s_per_chunk": settings.recompute_s_per_chunk,
        "max_pending_s": settings.max_pending_s,
        "backpressure": _jsonable(settings.backpressure),
        "tokens_per_chunk": geometry.tokens_per_chunk,
        "blocks_per_chunk": geometry.blocks_per_chunk,
        "world_size": geometry.world_size,
        "column_bytes": geometry.column_bytes,
        "chunk_bytes": geometry.chunk_bytes,
        "num_chunks": geometry.num_chunks,
        "region_bytes": geometry.region_bytes,
        "unused_bytes": settings.cpu_bytes_to_use - geometry.region_bytes,
        "tokens_cached": geometry.num_chunks * geometry.tokens_per_chunk,
    }
    tiers = [_plan_tier(tier) for tier in settings.tiers]
    if args.json:
        print(json.dumps({**plan, "tiers": tiers}, indent=2))
        return 0
    readings = plan.pop("vllm_readings", [])
    width = max(len(key) for key in plan)
    for key, value in plan.items():
        print(f"{key:<{width}}  {_shown(value)}")
    if readings:
        print("vLLM keys read as")
        for reading in readings:
            print(f"  {reading}")
    print(f"{'tiers':<{width}}  {len(tiers) or 'none (the primary tier only)'}")
    for tier in tiers:
        print(f"tier {tier['label']}  {tier['class']} ({tier['locality']})")
        rows = {key: tier[key] for key in _runner_fields()}
        rows["enable_kv_events"] = tier["enable_kv_events"]
        rows["backpressure"] = tier["backpressure"] or "off"
        if tier["settings"] is not None:
            rows.update(tier["settings"])
        else:
            rows["parameters"] = (
                f"{', '.join(tier['parameters']) or 'none'} (read by the tier when it is built)"
            )
        row_width = max(len(key) for key in rows)
        for key, value in rows.items():
            print(f"  {key:<{row_width}}  {_shown(value)}")
    return 0


def _plan_tier(tier: TierConfig) -> dict[str, Any]:
    """One secondary tier as the engine will run it: every value, defaults included."""
    return {
        "label": tier.label,
        "type": tier.type_name,
        "class": f"{tier.tier_class.__module__}.{tier.tier_class.__qualname__}",
        "locality": tier.locality,
        "enable_kv_events": tier.events,
        **_as_data(tier.runner),
        "backpressure": _jsonable(tier.backpressure),
        "settings": _jsonable(tier.settings),
        # Only the names of what a tier without settings reads itself: its values may
        # hold credentials under names no redaction knows.
        "parameters": sorted(tier.params) if tier.settings is None else None,
    }


def _runner_fields() -> tuple[str, ...]:
    """The names of a tier's runner settings, in the order the plan lists them."""
    from kvtier.tiering.runner import RunnerSettings

    return tuple(f.name for f in dataclasses.fields(RunnerSettings))


def _jsonable(value: Any) -> Any:
    """``value`` as JSON-ready data, credentials hidden."""
    from kvtier._secrets import redact

    return redact(_as_data(value))


def _as_data(value: Any) -> Any:
    """``value`` as dicts, lists and scalars (credentials are left to redact)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _as_data(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, Mapping):
        return {str(k): _as_data(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_as_data(item) for item in value]
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, enum.Enum):
        return value.value
    return value


def _shown(value: Any) -> str:
    """A value in the text plan: strings bare (unless empty), counts with thousands
    separators, None as "not set", the rest as JSON."""
    if value is None:
        return "not set"
    if isinstance(value, str) and value:
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    return json.dumps(value)
