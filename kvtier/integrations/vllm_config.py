"""vLLM's ``kv_connector_extra_config`` as kvtier's vLLM adapter reads it, without vLLM.

:class:`kvtier.integrations.vllm.KVTierOffloadingSpec` takes the mapping vLLM hands it,
drops the keys vLLM reads itself, translates the keys of vLLM 0.33's
``TieringOffloadingSpec`` and of its built-in tiers into kvtier's, and builds kvtier's
own spec with the chunk size vLLM resolved. A configuration written for vLLM's own
spec thus runs when only ``spec_name`` and ``spec_module_path`` change. Every key that
kvtier reads otherwise than under its own name, or reads and has no use for, gets a
:class:`KeyReading` that says what became of it: ``kvtier plan`` prints them and the
adapter logs them. That reading lives here, apart from the adapter (which imports
vLLM), so that ``kvtier plan`` can check a configuration written for vLLM exactly as
the adapter will read it where vLLM is not installed.

What is translated (README, "Using kvtier inside vLLM", lists every key):

- back-pressure, top-level and per tier, merged field by field as vLLM merges them:
  vLLM's detector and policy classes become kvtier's detector and ``policy``, its
  keys kvtier's, and a mapping that names ``backpressure_cls`` gets the defaults of
  vLLM's detector for what it leaves out, so it means what it meant under vLLM;
- the fs tier's thread counts (its I/O depths) and ``max_bytes`` (``capacity_bytes``);
- the obj tier's ``store_config``, ``prefix`` and ``io_threads``, onto the s3 tier;
- the p2p tier's ``host`` and ``port`` (``listen``);
- ``tier_poll_interval_s`` and ``max_tracker_size`` at the top level.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvtier._secrets import SECRET_KEYS
from kvtier.errors import ConfigError
from kvtier.records import Locality, Medium

__all__ = [
    "ADAPTER_MODULE",
    "ADAPTER_SPEC",
    "VLLM_KEYS",
    "KeyReading",
    "Translation",
    "adapter_extra_config",
    "names_adapter",
    "translate",
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

#: The keys above that kvtier's own specs do not read (``block_size`` they do).
_VLLM_ONLY = VLLM_KEYS - {"spec_name", "spec_module_path", "block_size"}

#: vLLM's names of kvtier keys: top-level, in a ``backpressure`` mapping, and in a tier
#: of each type (``max_bytes``: the fs tier's byte limit of vLLM's open proposals).
_TOP_NAMES = {"max_tracker_size": "max_tracked_lookups"}
_BACKPRESSURE_NAMES = {
    "high_water_s": "high_water",
    "low_water_s": "low_water",
    "warmup_completions": "warmup",
}
_FS_NAMES = {
    "n_read_threads": "read_depth",
    "n_write_threads": "write_depth",
    "max_bytes": "capacity_bytes",
}
_OBJECT_STORE_NAMES = {"io_threads": "max_concurrency"}
_TIER_NAMES = {"fs": _FS_NAMES, "obj": _OBJECT_STORE_NAMES, "s3": _OBJECT_STORE_NAMES}

#: vLLM's built-in eviction policies named as out-of-tree classes would be, as the
#: names kvtier has them under.
_VLLM_POLICY_CLASSES = {
    ("vllm.v1.kv_offload.cpu.policies.lru", "LRUCachePolicy"): "lru",
    ("vllm.v1.kv_offload.cpu.policies.arc", "ARCCachePolicy"): "arc",
}

#: vLLM's back-pressure classes, by the names its factory takes: short, or under this
#: module.
_BACKPRESSURE_MODULE = "vllm.v1.kv_offload.tiering.backpressure"
_DETECTOR = "EMABackpressureDetector"
_POLICIES = {"DropStorePolicy": "drop", "ThrottledDropPolicy": "throttled"}

# The defaults of vLLM 0.33's EMABackpressureDetector, for a mapping that names it: the
# water marks (s/MiB) by locality (an obj tier's are remote), the EMA weight, the
# completions before it judges, and the failed stores in a row that pressure a storage
# tier (fs, obj). Its half-life and cool-down are kvtier's defaults too.
_VLLM_MARKS = {Locality.LOCAL: (0.010, 0.002), Locality.REMOTE: (0.050, 0.010)}
_VLLM_ALPHA = 0.15
_VLLM_WARMUP = 10
_VLLM_FAILURE_THRESHOLD = 3

#: vLLM's obj tier's ``store_config`` keys; an empty value is one not set, as there.
_STORE_CONFIG = (
    "bucket",
    "endpoint_override",
    "scheme",
    "region",
    "access_key",
    "secret_key",
    "session_token",
    "ca_bundle",
)
#: ``store_config`` keys and the s3 tier's keys they become (the endpoint's two aside).
_STORE_CONFIG_NAMES = {
    "bucket": "bucket",
    "region": "region",
    "access_key": "access_key_id",
    "secret_key": "secret_access_key",
    "session_token": "session_token",
    "ca_bundle": "ca_bundle",
}
# vLLM's obj tier speaks plain http to an endpoint_override unless told otherwise.
_DEFAULT_SCHEME = "http"

# vLLM's p2p tier's control socket when host or port is left out: its environment's
# defaults (VLLM_P2P_SIDE_CHANNEL_HOST, VLLM_P2P_SIDE_CHANNEL_PORT).
_P2P_HOST = "localhost"
_P2P_PORT = 5710
#: vLLM's p2p tier's keys that kvtier's p2p tier has no use for, and why.
_P2P_UNUSED = {
    "backends": "kvtier's p2p tier moves chunks over its own TCP connections (TLS "
    "optional), not over NIXL transports",
    "num_threads": "kvtier's p2p tier runs on the tier loop; it has no NIXL agent threads",
    "unbound_store_timeout_s": "kvtier's p2p tier serves chunks from the owner's primary "
    "tier when a peer asks; it holds none back for a consumer",
}

_TIER_PATH = re.compile(r"secondary_tiers\[\d+\]")
_BACKPRESSURE_PATH = re.compile(r"(?:secondary_tiers\[\d+\]\.)?backpressure")


@dataclass(frozen=True)
class KeyReading:
    """What the adapter made of one of vLLM's keys."""

    #: Where vLLM reads the key: ``secondary_tiers[0].store_config.endpoint_override``.
    path: str
    #: What kvtier reads instead (``secondary_tiers[0].endpoint_url = http://...``,
    #: credentials ``<hidden>``), or why it reads nothing (``not used: ...``).
    reads_as: str

    def __str__(self) -> str:
        return f"{self.path} -> {self.reads_as}"


@dataclass(frozen=True)
class Translation:
    """vLLM's ``kv_connector_extra_config`` as kvtier's, and how its keys were read."""

    extra_config: dict[str, Any]
    readings: tuple[KeyReading, ...]


def names_adapter(extra_config: Mapping[str, Any]) -> bool:
    """Whether ``extra_config`` makes vLLM load kvtier's adapter."""
    return (
        extra_config.get("spec_name") == ADAPTER_SPEC
        and extra_config.get("spec_module_path") == ADAPTER_MODULE
    )


def translate_extra_config(extra_config: Mapping[str, Any]) -> dict[str, Any]:
    """vLLM's ``kv_connector_extra_config`` as kvtier's (see :func:`translate`)."""
    return translate(extra_config).extra_config


def translate(extra_config: Mapping[str, Any]) -> Translation:
    """vLLM's ``kv_connector_extra_config`` as kvtier's: vLLM's own keys removed, the
    keys of vLLM's tiering spec and tiers translated, each such key's reading recorded.

    A value of the wrong type is left for kvtier's own reading to name, under kvtier's
    key.

    Raises:
        ConfigError: a vLLM key and the kvtier key it becomes are both set; a
            back-pressure class other than vLLM's own is named; ``store_config`` is
            not a mapping of vLLM's keys, or its scheme contradicts its endpoint; a p2p
            tier has no secret (vLLM's p2p tier has no kvtier equivalent without one).
    """
    readings: list[KeyReading] = []
    out = {k: v for k, v in extra_config.items() if k not in VLLM_KEYS}
    if "tier_poll_interval_s" in out:
        interval = out.pop("tier_poll_interval_s")
        if isinstance(interval, bool) or not isinstance(interval, (int, float)):
            raise ConfigError("tier_poll_interval_s", f"expected a number, got {interval!r}")
        readings.append(
            KeyReading(
                "tier_poll_interval_s",
                "not used: kvtier's tiers run on their own event loop, which takes each "
                "completion as it comes; there is no poll thread to pace",
            )
        )
    _rename(out, "", _TOP_NAMES, readings)
    _eviction_policy(out, readings)
    tiers = out.get("secondary_tiers")
    top = out.get("backpressure")
    if isinstance(top, Mapping):
        del out["backpressure"]
        defaults, named = _backpressure(top, "backpressure", readings)
        readings.append(
            KeyReading(
                "backpressure",
                "merged field by field under each tier's own backpressure, as vLLM merges it"
                if isinstance(tiers, list) and tiers
                else "not used: there are no secondary tiers",
            )
        )
    else:
        defaults, named = None, False
    if isinstance(tiers, list):
        out["secondary_tiers"] = [
            _tier(tier, i, defaults, named, readings) if isinstance(tier, Mapping) else tier
            for i, tier in enumerate(tiers)
        ]
    return Translation(out, tuple(readings))


def _eviction_policy(out: dict[str, Any], readings: list[KeyReading]) -> None:
    """vLLM's own LRU or ARC policy, named by its class and module, as kvtier's."""
    named: tuple[Any, Any] = (out.get("cache_policy_module_path"), out.get("eviction_policy"))
    policy = _VLLM_POLICY_CLASSES.get(named)
    if policy is None:
        return
    del out["cache_policy_module_path"]
    out["eviction_policy"] = policy
    readings.append(
        KeyReading(
            "eviction_policy, cache_policy_module_path",
            f"eviction_policy = {policy} (kvtier's own {policy.upper()})",
        )
    )


def _tier(
    tier: Mapping[str, Any],
    index: int,
    defaults: dict[str, Any] | None,
    defaults_named: bool,
    readings: list[KeyReading],
) -> dict[str, Any]:
    """One tier's mapping in kvtier's keys, its back-pressure merged over the top-level
    ``defaults`` (``defaults_named``: they name vLLM's detector class)."""
    path = f"secondary_tiers[{index}]"
    out = dict(tier)
    kind = out.get("type")
    _rename(out, path, _TIER_NAMES.get(kind, {}) if isinstance(kind, str) else {}, readings)
    if kind in ("obj", "s3") and "store_config" in out:
        _store_config(out, path, readings)
    if kind == "p2p":
        _peer(out, path, readings)
    locality = out.get("locality")
    localities = {member.value for member in Locality}
    if isinstance(locality, str) and locality not in localities and locality.lower() in localities:
        readings.append(KeyReading(f"{path}.locality", f"{path}.locality = {locality.lower()}"))
    if "enable_kv_events" in out:
        readings.append(
            KeyReading(
                f"{path}.enable_kv_events",
                "this tier reports its stores and evictions whenever the engine's events "
                "are on (kvtier's tiers do without opt-in)"
                if out["enable_kv_events"] is True
                else f"{path}.enable_kv_events = {out['enable_kv_events']!r}: this tier "
                "reports no events",
            )
        )
    own = out.get("backpressure")
    if own is not None and not isinstance(own, Mapping):
        return out  # kvtier's own reading names it
    merged, named = _backpressure(own or {}, f"{path}.backpressure", readings)
    merged = {**(defaults or {}), **merged}
    # vLLM's rule: a tier gets back-pressure when the merge gave it any key, or when
    # its configuration has a backpressure mapping, even an empty one.
    if merged or own is not None:
        if named or defaults_named:
            _detector_defaults(merged, out, path, readings)
        out["backpressure"] = merged
    return out


def _rename(
    out: dict[str, Any], path: str, names: Mapping[str, str], readings: list[KeyReading]
) -> None:
    """Rename vLLM's keys in ``out`` (the mapping at ``path``) to kvtier's."""
    for vllm_key, key in names.items():
        if vllm_key not in out:
            continue
        where = f"{path}.{vllm_key}" if path else vllm_key
        if key in out:
            raise ConfigError(where, f"set either {vllm_key} (vLLM's name) or {key}, not both")
        out[key] = out.pop(vllm_key)
        target = f"{path}.{key}" if path else key
        readings.append(KeyReading(where, f"{target} = {_shown(key, out[key])}"))


def _backpressure(
    raw: Mapping[str, Any], path: str, readings: list[KeyReading]
) -> tuple[dict[str, Any], bool]:
    """A ``backpressure`` mapping in kvtier's keys, and whether it names vLLM's
    detector class (then vLLM's detector defaults apply to what it leaves out)."""
    out = dict(raw)
    named = "backpressure_cls" in out
    if named:
        detector = out.pop("backpressure_cls")
        if _vllm_class(detector) != _DETECTOR:
            raise ConfigError(
                f"{path}.backpressure_cls",
                f"kvtier runs its own back-pressure detector (an EMA of store latency per "
                f"MiB, the model of vLLM's {_DETECTOR}) set by this mapping's keys, and "
                f"cannot run a detector class; got {detector!r}: name {_DETECTOR}, or "
                "remove backpressure_cls and set the keys",
            )
        readings.append(
            KeyReading(f"{path}.backpressure_cls", f"kvtier's detector (vLLM's {_DETECTOR})")
        )
    if "policy_cls" in out:
        policy_cls = out.pop("policy_cls")
        if policy_cls is not None:
            policy = _POLICIES.get(_vllm_class(policy_cls) or "")
            if policy is None:
                raise ConfigError(
                    f"{path}.policy_cls",
                    f"expected one of vLLM's policies {', '.join(_POLICIES)} (kvtier's "
                    f"{', '.join(_POLICIES.values())}); kvtier cannot run another policy "
                    f"class, got {policy_cls!r}",
                )
            if "policy" in out:
                raise ConfigError(
                    f"{path}.policy_cls", "set either policy_cls (vLLM's name) or policy, not both"
                )
            out["policy"] = policy
            readings.append(KeyReading(f"{path}.policy_cls", f"{path}.policy = {policy}"))
    _rename(out, path, _BACKPRESSURE_NAMES, readings)
    if "failure_threshold" in out and out["failure_threshold"] is None:
        readings.append(
            KeyReading(
                f"{path}.failure_threshold",
                "null: kvtier's default, each failed store a slow sample (kvtier does not "
                "ignore failed stores)",
            )
        )
    return out, named


def _vllm_class(name: object) -> str | None:
    """The class a vLLM back-pressure class name names, if it is one of vLLM's own:
    short, or under vLLM's back-pressure module; None for any other."""
    if not isinstance(name, str):
        return None
    module, _, short = name.rpartition(".")
    return short if module in ("", _BACKPRESSURE_MODULE) else None


def _detector_defaults(
    merged: dict[str, Any], tier: Mapping[str, Any], path: str, readings: list[KeyReading]
) -> None:
    """Fill in vLLM's detector defaults for what ``merged`` leaves out, for ``tier``."""
    locality, storage = _tier_kind(tier, path)
    high, low = _VLLM_MARKS[locality]
    defaults: dict[str, Any] = {
        "high_water": high,
        "low_water": low,
        "alpha": _VLLM_ALPHA,
        "warmup": _VLLM_WARMUP,
    }
    if storage:
        defaults["failure_threshold"] = _VLLM_FAILURE_THRESHOLD
    filled = {key: value for key, value in defaults.items() if key not in merged}
    if not filled:
        return
    merged.update(filled)
    shown = ", ".join(f"{key} = {value}" for key, value in filled.items())
    readings.append(
        KeyReading(
            f"{path}.backpressure",
            f"vLLM's {_DETECTOR} defaults for a {locality} "
            f"{'storage ' if storage else ''}tier where not set: {shown}",
        )
    )


def _tier_kind(tier: Mapping[str, Any], path: str) -> tuple[Locality, bool]:
    """A tier's locality as vLLM's detector defaults read it (remote when its
    configuration or its class says so), and whether it is storage (fs, s3)."""
    from kvtier.tiers.factory import SecondaryTierFactory

    try:
        tier_class = SecondaryTierFactory.get_tier_class(tier, path)
    except ConfigError:
        return Locality.LOCAL, False  # kvtier's own reading names the problem
    given = tier.get("locality")
    remote = Locality(tier_class.locality) is Locality.REMOTE or (
        isinstance(given, str) and given.lower() == Locality.REMOTE
    )
    return (Locality.REMOTE if remote else Locality.LOCAL), tier_class.medium is Medium.STORAGE


def _store_config(out: dict[str, Any], path: str, readings: list[KeyReading]) -> None:
    """vLLM's obj tier's ``store_config`` as the s3 tier's keys."""
    where = f"{path}.store_config"
    given = out.pop("store_config")
    if not isinstance(given, Mapping):
        raise ConfigError(
            where,
            "expected a mapping of the object store's connection (bucket, "
            "endpoint_override, scheme, region, access_key, secret_key, ...)",
        )
    for key in given:
        if key not in _STORE_CONFIG:
            raise ConfigError(
                f"{where}.{key}",
                f"unknown setting of vLLM's store_config (known: {', '.join(_STORE_CONFIG)})",
            )
    values = {key: value for key, value in given.items() if value not in ("", None)}
    readings.extend(
        KeyReading(f"{where}.{key}", "not set (empty): the s3 tier's default")
        for key in given
        if key not in values
    )
    moved = [
        (key, _STORE_CONFIG_NAMES[key], values[key]) for key in _STORE_CONFIG_NAMES if key in values
    ]
    endpoint = _endpoint_url(values, where, readings)
    if endpoint is not None:
        moved.append(("endpoint_override", "endpoint_url", endpoint))
    for vllm_key, key, value in moved:
        if key in out:
            raise ConfigError(
                f"{where}.{vllm_key}",
                f"set either store_config.{vllm_key} (vLLM's) or {key}, not both",
            )
        out[key] = value
        readings.append(KeyReading(f"{where}.{vllm_key}", f"{path}.{key} = {_shown(key, value)}"))


def _endpoint_url(values: Mapping[str, Any], where: str, readings: list[KeyReading]) -> str | None:
    """The s3 tier's ``endpoint_url`` from ``endpoint_override`` (``host:port``, or a
    URL) and ``scheme``; None without an endpoint (AWS)."""
    scheme = values.get("scheme")
    if scheme is not None and scheme not in ("http", "https"):
        raise ConfigError(f"{where}.scheme", f"expected http or https, got {scheme!r}")
    endpoint = values.get("endpoint_override")
    if endpoint is None:
        if scheme is not None:
            readings.append(
                KeyReading(
                    f"{where}.scheme",
                    "not used: without endpoint_override the tier reaches AWS over https",
                )
            )
        return None
    if not isinstance(endpoint, str):
        raise ConfigError(f"{where}.endpoint_override", f"expected a string, got {endpoint!r}")
    named, sep, _ = endpoint.partition("://")
    if not sep:
        if scheme is not None:
            readings.append(KeyReading(f"{where}.scheme", "the scheme of endpoint_url"))
        return f"{scheme or _DEFAULT_SCHEME}://{endpoint}"
    if scheme is not None:
        if scheme != named.lower():
            raise ConfigError(
                f"{where}.scheme",
                f"is {scheme} but endpoint_override is an {named} URL: set one of them",
            )
        readings.append(KeyReading(f"{where}.scheme", "the scheme endpoint_override names"))
    return endpoint


def _peer(out: dict[str, Any], path: str, readings: list[KeyReading]) -> None:
    """vLLM's p2p tier's keys as kvtier's p2p tier's.

    Raises:
        ConfigError: both ``host``/``port`` and ``listen`` are set;
            ``unbound_store_timeout_s`` is not a positive number (as vLLM checks it);
            neither ``secret`` nor ``secret_file`` is set (vLLM's p2p tier needs none).
    """
    if "host" in out or "port" in out:
        if "listen" in out:
            key = "host" if "host" in out else "port"
            raise ConfigError(
                f"{path}.{key}", "set either host and port (vLLM's names) or listen, not both"
            )
        given = ", ".join(f"{path}.{key}" for key in ("host", "port") if key in out)
        host = out.pop("host", None) or _P2P_HOST
        port = out.pop("port", None)
        out["listen"] = f"{host}:{_P2P_PORT if port is None else port}"
        readings.append(KeyReading(given, f"{path}.listen = {out['listen']}"))
    timeout = out.get("unbound_store_timeout_s")
    if timeout is not None and (
        isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0
    ):
        raise ConfigError(
            f"{path}.unbound_store_timeout_s", f"expected a number > 0, got {timeout!r}"
        )
    for key, why in _P2P_UNUSED.items():
        if key in out:
            del out[key]
            readings.append(KeyReading(f"{path}.{key}", f"not used: {why}"))
    if "secret" not in out and "secret_file" not in out:
        raise ConfigError(
            f"{path}.secret_file",
            "is required: vLLM's p2p tier (NIXL transfers to peers named per request in "
            "kv_transfer_params, with no authentication) has no kvtier equivalent that "
            "runs unchanged; kvtier's p2p tier shares the primary tiers of the nodes "
            "listed in peers and authenticates every connection with a shared secret: "
            "set secret_file (or secret, 16 bytes or more) and peers",
        )


def _shown(key: str, value: Any) -> str:
    """A value as a reading shows it: a credential hidden."""
    return "<hidden>" if key in SECRET_KEYS else str(value)


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
    if path in _VLLM_ONLY or path == "tier_poll_interval_s":
        own = "; kvtier's own specs take block_size (tokens per chunk)"
        return (
            f"a key of vLLM's kv_connector_extra_config, which {spec_name} does not read: "
            f"{adapter}{own if path == 'blocks_per_chunk' else ''}"
        )
    found = _kvtier_name(path)
    if found is None:
        return None
    whose, key = found
    if key is None:
        return f"a key of {whose} configuration in vLLM, which {spec_name} does not read: {adapter}"
    return (
        f"vLLM's name for {whose} {key}, which {spec_name} does not read: {adapter}; "
        f"kvtier's own specs take {key}"
    )


def _kvtier_name(path: str) -> tuple[str, str | None] | None:
    """Whose key vLLM's key at ``path`` is, and kvtier's name for it (None: kvtier's
    own specs have none); None for a key that is not vLLM's."""
    if path in _TOP_NAMES:
        return "the primary tier's", _TOP_NAMES[path]
    parent, _, key = path.rpartition(".")
    if _BACKPRESSURE_PATH.fullmatch(parent):
        names: dict[str, str | None] = {
            **_BACKPRESSURE_NAMES,
            "policy_cls": "policy",
            "backpressure_cls": None,
        }
        return ("back-pressure's", names[key]) if key in names else None
    if not _TIER_PATH.fullmatch(parent):
        return None
    tiers: dict[str, dict[str, str | None]] = {
        "the fs tier's": {**_FS_NAMES},
        "the s3 (vLLM's obj) tier's": {**_OBJECT_STORE_NAMES, "store_config": None},
        "the p2p tier's": {"host": "listen", "port": "listen", **dict.fromkeys(_P2P_UNUSED)},
    }
    for whose, names in tiers.items():
        if key in names:
            return whose, names[key]
    return None
