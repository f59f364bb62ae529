"""``kvtier plan``: a configuration read the way the engine reads it, and the primary
region and tiers it describes. ``kvtier bench --config`` reads its file here too."""

from __future__ import annotations

import argparse
import dataclasses
import enum
import json
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvtier.cli._args import fail, read_json_object, spoken_list
from kvtier.cli._model import ModelShape, ModelShapeError
from kvtier.config import OffloadingConfig
from kvtier.errors import KVTierError

if TYPE_CHECKING:
    from kvtier.specs.base import OffloadingSpec
    from kvtier.specs.settings import TierConfig

__all__ = ["as_kvtier_reads", "engine_spec", "missing_paths", "model_shape", "plan_command"]


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
    shape = model_shape(args)
    try:
        kv_bytes_per_block = (
            args.kv_bytes_per_block
            if shape is None
            else shape.kv_bytes_per_block(args.tokens_per_block, args.world_size)
        )
    except ModelShapeError as exc:
        fail(str(exc))
    try:
        config = OffloadingConfig(
            engine_id=args.engine_id,
            kv_bytes_per_block=kv_bytes_per_block,
            tokens_per_block=args.tokens_per_block,
            world_size=args.world_size,
            extra_config=with_spec_name(as_kvtier_reads(extra, args.tokens_per_block)),
            # An MLA model's latent is the same on every rank: one copy per chunk.
            replicated=shape is not None and shape.is_mla,
        )
        spec = engine_spec(config)
    except KVTierError as exc:
        fail(str(exc))
    settings = spec.settings
    geometry = settings.geometry
    plan: dict[str, Any] = {"spec": type(spec).__name__}
    plan["kv_bytes_per_block"] = kv_bytes_per_block
    if shape is not None:
        plan["kv_bytes_per_block_from"] = shape.explain(args.tokens_per_block, args.world_size)
        plan["replicated"] = config.replicated
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
    for tier_config in settings.tiers:
        for warning in missing_paths(tier_config):
            print(f"kvtier: warning: {warning}", file=sys.stderr)
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


#: The plan's options that describe the model's shape, in the order they are named.
_SHAPE_OPTIONS = ("layers", "kv_heads", "head_dim", "mla_latent_dim")


def model_shape(args: argparse.Namespace) -> ModelShape | None:
    """The model's shape ``kvtier plan`` was given (None: ``--kv-bytes-per-block``),
    refusing a mix that would give two answers or none."""
    given = [name for name in _SHAPE_OPTIONS if getattr(args, name) is not None]
    shown = ", ".join(f"--{name.replace('_', '-')}" for name in given)
    if args.kv_bytes_per_block is not None:
        others = given + (["model_config"] if args.model_config is not None else [])
        others += ["dtype"] if args.dtype is not None else []
        if others:
            named = ", ".join(f"--{name.replace('_', '-')}" for name in others)
            fail(
                f"--kv-bytes-per-block and the model's shape ({named}) both size the KV "
                "cache; give one of them"
            )
        return None
    try:
        if args.model_config is not None:
            if given:
                fail(
                    f"--model-config gives the model's shape; {shown} would change it: give "
                    "the file or the shape options, not both"
                )
            return ModelShape.from_hf_config(args.model_config, args.dtype)
        if not given and args.dtype is None:
            fail(
                "the KV cache's size is missing: give --kv-bytes-per-block, or the model's "
                "shape (--model-config, or --layers, --kv-heads, --head-dim and --dtype)"
            )
        missing = [name for name in ("layers", "dtype") if getattr(args, name) is None]
        if args.mla_latent_dim is None:
            missing += [name for name in ("kv_heads", "head_dim") if getattr(args, name) is None]
        elif args.kv_heads is not None or args.head_dim is not None:
            fail(
                "--mla-latent-dim describes an MLA model's cache, --kv-heads and --head-dim "
                "another kind: give one or the other"
            )
        if missing:
            named = spoken_list([f"--{name.replace('_', '-')}" for name in missing])
            fail(f"the model's shape needs {named} too (or give --model-config)")
        if args.dtype == "auto":
            fail("--dtype auto means the model's dtype, read from --model-config; name it")
        return ModelShape(
            layers=args.layers,
            dtype=args.dtype,
            kv_heads=args.kv_heads,
            head_dim=args.head_dim,
            latent_dim=args.mla_latent_dim,
        )
    except ModelShapeError as exc:
        fail(str(exc))


def missing_paths(tier: TierConfig) -> list[str]:
    """Warnings for the paths a tier's settings name that this machine lacks: a
    directory (``*_dir``) whose parent does not exist (the tier creates the directory,
    never its parents), a file (``*_file``) that does not exist."""
    settings = tier.settings
    if not dataclasses.is_dataclass(settings) or isinstance(settings, type):
        return []
    warnings = []
    for field in dataclasses.fields(settings):
        path = getattr(settings, field.name)
        if not isinstance(path, Path):
            continue
        where = f"{tier.path}.{field.name}"
        if field.name.endswith("_dir") and not path.exists() and not path.parent.is_dir():
            warnings.append(
                f"{where}: {path.parent} does not exist on this machine; the {tier.type_name} "
                f"tier creates {path.name}, never its parents, so it would fail to start here"
            )
        elif field.name.endswith("_file") and not path.is_file():
            warnings.append(f"{where}: {path} is not a file on this machine")
    return warnings


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
