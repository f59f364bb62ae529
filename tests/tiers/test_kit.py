"""The tier kit and the tier interface's declarations: what every real tier uses."""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import pytest

from kvtier import ConfigError, SecondaryTier
from kvtier.records import HitSource, Medium
from kvtier.tiers import kit
from kvtier.tiers.example import ExampleTier
from kvtier.tiers.factory import SecondaryTierFactory, takes_settings
from kvtier.tiers.fs import FileSystemTier
from kvtier.tiers.p2p import PeerTier
from kvtier.tiers.s3 import S3Tier

PATH = "secondary_tiers[0].job_deadline_s"


def test_a_job_deadline_defaults_to_two_thirds_of_the_job_timeout():
    assert kit.job_deadline_s(30.0, None, PATH) == pytest.approx(20.0)
    assert kit.job_deadline_s(30.0, 12.5, PATH) == 12.5


def test_a_job_deadline_must_end_before_the_framework_gives_up():
    with pytest.raises(ConfigError, match=r"^secondary_tiers\[0\]\.job_deadline_s: must be below"):
        kit.job_deadline_s(10.0, 10.0, PATH)


def test_a_derived_field_is_marked_and_keeps_its_default():
    @dataclasses.dataclass(frozen=True)
    class Settings:
        url: str = "x"
        item_bytes: int | None = kit.derived_field()

    url, item_bytes = dataclasses.fields(Settings)
    assert not kit.is_derived(url) and kit.is_derived(item_bytes)
    assert Settings().item_bytes is None


def test_every_name_of_the_kit_is_public_and_documented():
    for name in kit.__all__:
        value = getattr(kit, name)
        assert not name.startswith("_")
        if callable(value):
            assert value.__doc__, f"kvtier.tiers.kit.{name} has no docstring"


@pytest.mark.parametrize(
    ("medium", "source"),
    [
        (Medium.CPU, HitSource.HOST),
        (Medium.STORAGE, HitSource.DISK),
        (Medium.NETWORK, HitSource.P2P),
        (Medium.REMOTE_MEMORY, HitSource.EXTERNAL),
    ],
)
def test_a_tier_that_declares_no_hit_source_reports_its_mediums(medium, source):
    tier_class = type("Tier", (SecondaryTier,), {"medium": medium})
    assert tier_class.hit_source is source


def test_a_declared_hit_source_wins_over_the_medium():
    class RemoteDisk(SecondaryTier):
        medium: ClassVar[Medium] = Medium.STORAGE
        hit_source: ClassVar[HitSource] = HitSource.EXTERNAL

    assert RemoteDisk.hit_source is HitSource.EXTERNAL
    assert type("Sub", (RemoteDisk,), {}).hit_source is HitSource.EXTERNAL


@pytest.mark.parametrize("tier_class", [ExampleTier, FileSystemTier, S3Tier, PeerTier])
def test_every_built_in_tier_is_built_from_its_settings_record(tier_class):
    assert takes_settings(tier_class)


def test_a_tier_reading_keywords_is_built_with_them():
    class Keywords(ExampleTier):
        settings_class = None

        def __init__(self, ctx: Any, tag: str) -> None:
            SecondaryTier.__init__(self, ctx)
            self.tag = tag

    assert not takes_settings(Keywords)
    built = SecondaryTierFactory.build_tier(Keywords, None, None, {"tag": "t"})  # type: ignore[arg-type]
    assert isinstance(built, Keywords) and built.tag == "t"
