"""Workloads: prompts share chunk keys exactly as far as they share a prefix."""

from kvtier.bench.workloads import WORKLOADS, WorkloadSize, build_workload, chain_keys


def test_workloads_share_keys_exactly_as_long_as_prompts_share_blocks():
    assert chain_keys([1, 2, 3])[:2] == chain_keys([1, 2, 9])[:2]
    assert chain_keys([1, 2, 3])[2] != chain_keys([1, 2, 9])[2]
    assert chain_keys([2, 1])[1] != chain_keys([1, 2])[1]
    for name in WORKLOADS:
        workload = build_workload(name, WorkloadSize(working_set=256, max_prompt=16))
        assert 128 <= workload.unique_chunks <= 512, name
