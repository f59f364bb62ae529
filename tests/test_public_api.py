import subprocess
import sys

import kvtier

# The public names of kvtier, in the order the design lists them: a name added or dropped
# is a change of the public contract, made here on purpose.
PUBLIC_NAMES = [
    "OffloadKey",
    "make_offload_key",
    "key_block_hash",
    "key_group_idx",
    "LookupResult",
    "ReqContext",
    "ScheduleEndContext",
    "OffloadingEvent",
    "Medium",
    "OffloadingConfig",
    "ConfigError",
    "OffloadingSpec",
    "CPUOffloadingSpec",
    "TieringOffloadingSpec",
    "OffloadingSpecFactory",
    "TieringOffloadingManager",
    "CachePolicy",
    "CachePolicyFactory",
    "SecondaryTier",
    "SecondaryTierFactory",
    "TierContext",
    "TransferJob",
    "JobResult",
    "SharedOffloadRegion",
    "KVTier",
    "prefix_keys",
]


def test_kvtier_exports_exactly_the_design_names():
    assert sorted(kvtier.__all__) == sorted(PUBLIC_NAMES)


def test_every_exported_name_resolves():
    for name in kvtier.__all__:
        assert getattr(kvtier, name) is not None


def test_config_error_is_a_value_error():
    assert issubclass(kvtier.ConfigError, ValueError)


def test_importing_kvtier_never_imports_pytest():
    """Only kvtier.testing (the tier contract) needs pytest, and only when imported."""
    check = "import sys, kvtier; assert 'pytest' not in sys.modules, 'pytest was imported'"
    result = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


# The host layer every host is a shell over; a synchronous engine uses its PageStore.
HOST_NAMES = [
    "Fence",
    "IOSample",
    "PageStore",
    "Requests",
    "Segment",
    "Step",
    "StoreRoom",
    "step_until",
    "step_until_blocking",
]


def test_the_host_layer_exports_its_names():
    import kvtier.hosts

    assert sorted(kvtier.hosts.__all__) == sorted(HOST_NAMES)
    assert all(getattr(kvtier.hosts, name) is not None for name in HOST_NAMES)


def test_sglangs_page_store_is_the_host_layers():
    import kvtier.hosts
    import kvtier.integrations.sglang

    assert kvtier.integrations.sglang.PageStore is kvtier.hosts.PageStore
