"""Bench tiers: a tier type joins kvtier bench by registering one entry."""

from __future__ import annotations

import contextlib
import dataclasses
import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from kvtier import SecondaryTier, TierContext
from kvtier.bench import (
    BENCH_TIERS,
    BenchSettings,
    BenchTier,
    BenchTierRegistry,
    Direction,
    Limit,
    LimitContext,
    LocalTier,
    TierTraffic,
)
from kvtier.bench.tiers import raw_disk_depths
from kvtier.cli import main
from kvtier.region import PrimaryView
from kvtier.tiers.example import ExampleTier
from kvtier.tiers.fs import FileSystemTier
from kvtier.tiers.p2p import PeerTier
from kvtier.tiers.s3 import S3Tier
from kvtier.tiers.s3 import bench as s3_bench

SMALL = [
    "--chunk-mib", "0.25", "--primary-mib", "16", "--working-set-mib", "48",
    "--max-prompt-chunks", "16", "--concurrency", "2", "--quiet",
]  # fmt: skip


@contextlib.asynccontextmanager
async def example_start(settings: BenchSettings, workspace: Path) -> AsyncIterator[LocalTier]:
    yield LocalTier({"type": "example"})


async def fixed_limit(tier: SecondaryTier, run: LimitContext) -> dict[Direction, float]:
    return {Direction.READ: 1.0}


def entry(
    name: str = "example",
    tier_class: type[SecondaryTier] = ExampleTier,
    key: str = "example_gbps",
    ratio: str = "example_read",
) -> BenchTier:
    return BenchTier(
        name, tier_class, example_start, fixed_limit, (Limit(Direction.READ, name, key, ratio),)
    )


class LabelledExampleTier(ExampleTier):
    """A tier type derived from one that is benchmarked already."""


# ---------------------------------------------------------------- built-in


def test_fs_s3_and_p2p_are_the_built_in_bench_tiers_in_that_order():
    assert BENCH_TIERS.names() == ["fs", "s3", "p2p"]


def test_each_built_in_tier_class_is_measured_by_its_own_entry():
    assert BENCH_TIERS.for_class(FileSystemTier) is BENCH_TIERS.get("fs")
    assert BENCH_TIERS.for_class(S3Tier) is BENCH_TIERS.get("s3")
    assert BENCH_TIERS.for_class(PeerTier) is BENCH_TIERS.get("p2p")
    assert BENCH_TIERS.for_class(ExampleTier) is None


def test_the_s3_entry_lives_with_the_s3_tier_and_joins_by_its_module():
    assert BENCH_TIERS.get("s3") is s3_bench.BENCH_TIER
    assert s3_bench.BENCH_TIER.tier_class is S3Tier


def test_the_built_in_tiers_report_the_documented_ratios_in_table_order():
    assert [limit.ratio for limit in BENCH_TIERS.limits()] == [
        "fs_write", "fs_read", "s3_write", "s3_read", "p2p_read",
    ]  # fmt: skip
    assert [limit.key for limit in BENCH_TIERS.limits()] == [
        "disk_write_gbps", "disk_read_gbps", "s3_put_gbps", "s3_get_gbps", "tcp_loopback_gbps",
    ]  # fmt: skip


# ---------------------------------------------------------------- registry


def test_a_tier_class_is_measured_by_the_entry_of_its_nearest_registered_base():
    registry = BenchTierRegistry([entry()])
    assert registry.for_class(LabelledExampleTier) is registry.get("example")
    labelled = entry("labelled", LabelledExampleTier, "labelled_gbps", "labelled_read")
    registry.register(labelled)
    assert registry.for_class(LabelledExampleTier) is labelled
    assert registry.for_class(FileSystemTier) is None


def test_an_unknown_name_is_an_error_that_lists_the_registered_ones():
    registry = BenchTierRegistry([entry("one", ExampleTier, "one_gbps", "one_read")])
    registry.register(entry("two", LabelledExampleTier, "two_gbps", "two_read"))
    with pytest.raises(
        ValueError, match=r"unknown tier 'tape' for --tiers; expected some of one, two"
    ):
        registry.get("tape")


@pytest.mark.parametrize(
    ("second", "problem"),
    [
        pytest.param(
            entry(tier_class=LabelledExampleTier, key="other_gbps", ratio="other_read"),
            "'example' is registered already",
            id="name",
        ),
        pytest.param(
            entry("other", key="other_gbps", ratio="other_read"),
            "ExampleTier is benchmarked as 'example' already",
            id="tier-class",
        ),
        pytest.param(
            entry("other", LabelledExampleTier, ratio="other_read"),
            "'example_gbps' is taken",
            id="physical-key",
        ),
        pytest.param(
            entry("other", LabelledExampleTier, key="other_gbps"),
            "'example_read' is taken",
            id="ratio-key",
        ),
        pytest.param(
            entry("other", LabelledExampleTier, key="memcpy_gbps", ratio="other_read"),
            "'memcpy_gbps' is taken",
            id="memcpy-key",
        ),
    ],
)
def test_a_second_entry_may_not_take_a_name_tier_class_or_report_key(second, problem):
    registry = BenchTierRegistry([entry()])
    with pytest.raises(ValueError, match=problem):
        registry.register(second)
    assert registry.names() == ["example"]


def test_an_unregistered_entry_is_gone_and_its_name_free_again():
    registry = BenchTierRegistry([entry()])
    registry.unregister("example")
    assert registry.names() == [] and registry.limits() == []
    registry.register(entry())
    assert registry.names() == ["example"]


def test_an_entry_registered_by_module_is_named_at_once_and_imported_when_needed():
    registry = BenchTierRegistry([entry()])
    registry.register_module("later", "kvtier.no_such_module")
    registry.register_module("s3", "kvtier.tiers.s3.bench")
    # Naming them imports nothing (the first module does not exist).
    assert registry.names() == ["example", "later", "s3"]
    registry.unregister("later")
    assert registry.get("s3") is s3_bench.BENCH_TIER
    assert registry.limits()[1:] == list(s3_bench.BENCH_TIER.limits)


def test_an_entry_registered_by_module_is_checked_once_imported():
    registry = BenchTierRegistry()
    registry.register_module("s4", "kvtier.tiers.s3.bench")
    with pytest.raises(ValueError, match=r"BENCH_TIER is not a bench tier called 's4'"):
        registry.get("s4")
    registry.unregister("s4")
    registry.register(BenchTier("objects", S3Tier, example_start))
    registry.register_module("s3", "kvtier.tiers.s3.bench")
    with pytest.raises(ValueError, match="S3Tier is benchmarked as 'objects' already"):
        registry.limits()
    with pytest.raises(ValueError, match="'s3' is registered already"):
        registry.register(s3_bench.BENCH_TIER)


@pytest.mark.parametrize(
    ("fields", "problem"),
    [
        pytest.param({"name": "a,b"}, "usable in --tiers", id="comma-in-name"),
        pytest.param({"name": ""}, "usable in --tiers", id="empty-name"),
        pytest.param({"limits": ()}, "go together", id="measure-without-limits"),
        pytest.param({"measure": None}, "go together", id="limits-without-measure"),
        pytest.param(
            {
                "limits": (
                    Limit(Direction.READ, "a", "a", "a"),
                    Limit(Direction.READ, "b", "b", "b"),
                )
            },
            "one limit per direction",
            id="two-read-limits",
        ),
    ],
)
def test_an_inconsistent_entry_is_refused(fields, problem):
    with pytest.raises(ValueError, match=problem):
        dataclasses.replace(entry(), **fields)


def test_a_tier_without_a_limit_can_still_be_registered():
    registry = BenchTierRegistry([BenchTier("plain", ExampleTier, example_start)])
    assert registry.names() == ["plain"] and registry.limits() == []


def test_limits_are_measured_with_as_many_chunks_as_moved_within_bounds():
    run = LimitContext(1 << 20, Path("."), TierTraffic(0, 0, None, None))
    assert run.chunks(100 << 20, 1 << 30) == 100
    assert run.chunks(4 << 20, 1 << 30) == 16  # too few to time
    assert run.chunks(8 << 30, 1 << 30) == 1024  # a big run measures no longer than 1 GiB


# ------------------------------------------------------- a plugin tier, end to end


@pytest.fixture
def example_bench_tier() -> Iterator[list[tuple[object, ...]]]:
    """The example tier registered as ``--tiers example``; what the bench did with it."""
    seen: list[tuple[object, ...]] = []

    def ready(tier: SecondaryTier) -> bool:
        assert isinstance(tier, ExampleTier)
        seen.append(("ready", tier.settings.custom_param))
        return True

    @contextlib.asynccontextmanager
    async def start(settings: BenchSettings, workspace: Path) -> AsyncIterator[LocalTier]:
        seen.append(("started", settings.tiers, workspace))
        try:
            yield LocalTier({"type": "example", "custom_param": 7}, ready)
        finally:
            seen.append(("stopped",))

    async def measure(tier: SecondaryTier, run: LimitContext) -> dict[Direction, float]:
        seen.append(("measured", run.chunk_bytes, run.traffic))
        return {Direction.READ: 2.5}

    BENCH_TIERS.register(
        BenchTier(
            "example",
            ExampleTier,
            start,
            measure,
            (Limit(Direction.READ, "dict copy (example)", "example_copy_gbps", "example_read"),),
        )
    )
    try:
        yield seen
    finally:
        BENCH_TIERS.unregister("example")


def test_a_registered_tier_type_is_offered_by_the_tiers_help(example_bench_tier, capsys):
    with pytest.raises(SystemExit) as info:
        main(["bench", "--help"])
    assert info.value.code == 0
    assert "from fs, s3, p2p and example (default: fs)" in " ".join(capsys.readouterr().out.split())


def test_a_registered_tier_type_joins_the_run_the_report_and_the_limits_table(
    tmp_path, capsys, example_bench_tier
):
    out = tmp_path / "report.json"
    root = tmp_path / "workspace"
    args = [
        "bench",
        *SMALL,
        "--workload",
        "cold-warm",
        "--tiers",
        "example,fs",
        "--root",
        str(root),
    ]
    assert main([*args, "--json", str(out)]) == 0
    report = json.loads(out.read_text())

    assert [tier["name"] for tier in report["tiers"]] == ["0:primary", "1:example", "2:fs"]
    example = report["tiers"][1]
    # First in lookup order, the example tier serves the warm pass.
    assert example["hits"] > 0 and example["read_gbps"] > 0
    assert report["requests"]["wrong_chunks"] == 0
    assert report["physical"]["example_copy_gbps"] == 2.5
    assert report["ratios"]["example_read"] == round(example["read_gbps"] / 2.5, 3)
    assert {"fs_write", "fs_read"} <= set(report["ratios"])  # the built-ins still measured

    traffic = TierTraffic(
        example["bytes_written"], example["bytes_read"], example["write_gbps"], example["read_gbps"]
    )
    assert example_bench_tier == [
        ("started", ("example", "fs"), root),
        ("ready", 7),  # the tier built from the entry's configuration
        ("measured", 1 << 18, traffic),
        ("stopped",),
    ]
    row = next(line for line in capsys.readouterr().out.splitlines() if "dict copy" in line)
    assert "2.50" in row and f"{report['ratios']['example_read']:.2f}" in row


def test_a_tier_faster_than_its_limit_is_marked_and_the_reason_printed_beside_it(tmp_path, capsys):
    @contextlib.asynccontextmanager
    async def start(settings: BenchSettings, workspace: Path) -> AsyncIterator[LocalTier]:
        yield LocalTier({"type": "example"})

    async def measure(tier: SecondaryTier, run: LimitContext) -> dict[Direction, float]:
        return {Direction.READ: 1e-6}  # a limit any tier that reads at all beats

    def above_limit(tier: SecondaryTier, direction: Direction) -> str:
        assert isinstance(tier, ExampleTier) and direction is Direction.READ
        return "the example tier keeps its chunks in a dict"

    limit = Limit(Direction.READ, "slow copy (example)", "slow_copy_gbps", "example_read")
    BENCH_TIERS.register(BenchTier("example", ExampleTier, start, measure, (limit,), above_limit))
    out = tmp_path / "report.json"
    try:
        argv = ["bench", *SMALL, "--workload", "cold-warm", "--tiers", "example"]
        assert main([*argv, "--json", str(out)]) == 0
    finally:
        BENCH_TIERS.unregister("example")
    report = json.loads(out.read_text())
    assert report["ratios"]["example_read"] > 1
    assert report["ratio_notes"] == {"example_read": "the example tier keeps its chunks in a dict"}
    printed = " ".join(capsys.readouterr().out.split())
    ratio = f"{report['ratios']['example_read']:.2f}"
    assert f"slow copy (example) │ 0.00 │ {ratio} *" in printed
    assert (
        f"* slow copy (example): kvtier / limit {ratio}, above 1 because the example tier "
        "keeps its chunks in a dict"
    ) in printed


def fs_tier(tmp_path: Path, **params: object) -> FileSystemTier:
    row = memoryview(bytearray(4096))
    ctx = TierContext(PrimaryView(row, 1, 4096), 4096, "namespace", "1:fs")
    return FileSystemTier(ctx, root_dir=str(tmp_path), **params)


def test_the_raw_disk_limit_is_measured_at_the_depths_the_fs_tier_uses(tmp_path):
    # At its defaults the tier reads at up to 16 and writes at up to 32.
    assert raw_disk_depths(fs_tier(tmp_path)) == (1, 16, 32)
    assert raw_disk_depths(fs_tier(tmp_path, max_read_depth=8, max_write_depth=4)) == (1, 4, 8)
    assert raw_disk_depths(fs_tier(tmp_path, io_concurrency=8)) == (1, 8)
    assert raw_disk_depths(fs_tier(tmp_path, read_depth=16, write_depth=2)) == (1, 2, 16)


def test_an_fs_tier_beats_the_raw_limit_only_through_the_page_cache(tmp_path):
    fs = BENCH_TIERS.get("fs")
    assert fs.above_limit is not None
    tier = fs_tier(tmp_path)
    tier.o_direct = False  # as start() finds it on a filesystem without O_DIRECT
    assert "reads through the page cache" in (fs.above_limit(tier, Direction.READ) or "")
    assert "writes through the page cache" in (fs.above_limit(tier, Direction.WRITE) or "")
    tier.o_direct = True  # the raw figure's own I/O: no route around it
    assert fs.above_limit(tier, Direction.READ) is None
