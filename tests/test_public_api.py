import kvtier

# DESIGN section 9, in the order it lists them.
DESIGN_NAMES = [
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
    assert sorted(kvtier.__all__) == sorted(DESIGN_NAMES)


def test_every_exported_name_resolves():
    for name in kvtier.__all__:
        assert getattr(kvtier, name) is not None


def test_config_error_is_a_value_error():
    assert issubclass(kvtier.ConfigError, ValueError)
