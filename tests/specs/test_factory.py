"""The spec family: factory selection, out-of-tree specs, lifecycle."""

from __future__ import annotations

import pytest
from helpers import make_config

from kvtier import ConfigError, CPUOffloadingSpec, OffloadingSpec, OffloadingSpecFactory
from kvtier.specs.factory import with_spec_name


class PlainCPUSpec(CPUOffloadingSpec):
    """An out-of-tree spec that accepts one key of its own."""

    extra_keys = frozenset({"team"})


def test_default_spec_is_the_cpu_spec(engine_id):
    spec = OffloadingSpecFactory.create_spec(make_config(engine_id))
    assert type(spec) is CPUOffloadingSpec
    spec.shutdown()


def test_out_of_tree_spec_is_imported_by_module_path(engine_id):
    config = make_config(engine_id, spec_name="PlainCPUSpec", spec_module_path=__name__, team="kv")
    spec = OffloadingSpecFactory.create_spec(config)
    assert type(spec).__name__ == "PlainCPUSpec"
    spec.shutdown()


def test_spec_module_path_must_name_a_spec_subclass(engine_id):
    config = make_config(engine_id, spec_name="OrderedDict", spec_module_path="collections")
    with pytest.raises(ConfigError, match=r"^spec_name: .*not a subclass of kvtier.OffloadingSpec"):
        OffloadingSpecFactory.create_spec(config)


def test_unknown_spec_name_lists_the_known_ones(engine_id):
    with pytest.raises(ConfigError, match=r"^spec_name: unknown spec 'GPUSpec'.*CPUOffloadingSpec"):
        OffloadingSpecFactory.create_spec(make_config(engine_id, spec_name="GPUSpec"))


def test_registered_spec_is_selected_by_name(engine_id):
    OffloadingSpecFactory.register_spec("PlainForTests", PlainCPUSpec)
    spec = OffloadingSpecFactory.create_spec(make_config(engine_id, spec_name="PlainForTests"))
    assert isinstance(spec, PlainCPUSpec)
    spec.shutdown()


def test_offloading_spec_is_abstract():
    with pytest.raises(TypeError):
        OffloadingSpec(make_config("abstract"))  # type: ignore[abstract]


def test_spec_exposes_the_host_hints(engine_id):
    spec = OffloadingSpecFactory.create_spec(make_config(engine_id, offload_prompt_only=False))
    assert spec.offload_prompt_only is False
    assert spec.block_size == 16
    spec.shutdown()


def test_shutdown_releases_manager_and_workers(engine_id):
    import torch

    spec = OffloadingSpecFactory.create_spec(make_config(engine_id, kv_bytes_per_block=4096))
    manager = spec.get_manager()
    worker = spec.create_worker([torch.zeros((8, 1024), dtype=torch.float32)])
    spec.shutdown()
    assert manager.region is not None and manager.region.closed
    assert worker.region.closed


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        ({}, "CPUOffloadingSpec"),
        ({"secondary_tiers": []}, "TieringOffloadingSpec"),
        ({"secondary_tiers": [{"type": "example"}]}, "TieringOffloadingSpec"),
        ({"backpressure": {"warmup": 1}}, "TieringOffloadingSpec"),
        ({"spec_name": "PlainForTests", "secondary_tiers": []}, "PlainForTests"),
    ],
)
def test_a_bare_extra_config_names_the_spec_its_keys_need(extra, expected):
    named = with_spec_name(extra)
    assert named["spec_name"] == expected
    assert "spec_name" not in extra or extra["spec_name"] == expected  # a copy


def test_the_library_default_stays_the_cpu_spec_which_refuses_tiers(engine_id):
    with pytest.raises(ConfigError, match=r"^secondary_tiers: CPUOffloadingSpec has no"):
        OffloadingSpecFactory.create_spec(make_config(engine_id, secondary_tiers=[]))
