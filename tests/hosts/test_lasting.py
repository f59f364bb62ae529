"""PageStore with lasting acknowledgements: a page counts as stored only once a tier
that keeps copies of its own has it (the host drops its own copy at the answer, as
SGLang's ``buffer_only`` host memory does)."""

from __future__ import annotations

import hashlib
import uuid
from pathlib import Path
from typing import Any

import pytest
from helpers import make_config
from page_buffers import PAGE_BYTES, Pages
from scripted_tier import ScriptedTier

from kvtier import ConfigError, OffloadingConfig, OffloadKey, make_offload_key
from kvtier.hosts import PageStore
from kvtier.hosts.lasting import LastingCopies

ROW = -(-PAGE_BYTES // 4096) * 4096


def config(
    engine_id: str, *, rows: int = 64, tiers: list[dict[str, Any]] | None = None, **extra: Any
) -> OffloadingConfig:
    extra["cpu_bytes_to_use"] = rows * ROW
    if tiers is not None:
        extra |= {"spec_name": "TieringOffloadingSpec", "secondary_tiers": tiers}
    return make_config(engine_id, kv_bytes_per_block=PAGE_BYTES, **extra)


def scripted(tag: str, kind: str = "ScriptedTier") -> list[dict[str, Any]]:
    return [{"type": kind, "module_path": "scripted_tier", "tag": tag}]


def chain(count: int) -> tuple[list[str], list[OffloadKey]]:
    base = uuid.uuid4().hex
    names = [f"{base}/{i}" for i in range(count)]
    return names, [make_offload_key(hashlib.sha256(n.encode()).digest()) for n in names]


def test_a_store_is_acknowledged_once_the_tier_has_the_pages(engine_id, tmp_path: Path):
    names, keys = chain(6)
    tiers = [{"type": "fs", "root_dir": str(tmp_path)}]
    with PageStore(config(engine_id, tiers=tiers), lasting_acks=True) as store:
        source = Pages(6)
        source.fill(names)
        assert store.store(keys, source.segments(), 30.0) == [True] * 6
        fs = store.manager.tiers[0]
        assert all(fs.contains(key) for key in keys)  # on disk before the answer
        assert store.lasting_wait_s == fs.ctx.job_timeout_s


def test_a_page_whose_cascade_has_not_ended_is_not_acknowledged(engine_id):
    tag = f"held-{uuid.uuid4().hex[:8]}"
    names, keys = chain(4)
    with PageStore(config(engine_id, tiers=scripted(tag)), lasting_acks=True) as store:
        tier = ScriptedTier.instances[tag]
        manager = store.manager
        manager.loop.call(tier.gate.clear)  # the cascade never ends while the store waits
        source = Pages(4)
        source.fill(names)
        assert store.store(keys, source.segments(), 0.3) == [False] * 4
        assert store.stats()["store_failures"] == 4
        manager.loop.call(tier.gate.set)
        # Stored again once the cascade is through: the tier's copy is known.
        assert store.store(keys, source.segments(), 30.0) == [True] * 4
        assert set(tier.chunks) == set(keys)
        assert store.stats()["already_stored"] == 4


def test_a_failed_cascade_leaves_the_pages_unacknowledged(engine_id):
    tag = f"failing-{uuid.uuid4().hex[:8]}"
    names, keys = chain(4)
    with PageStore(config(engine_id, tiers=scripted(tag)), lasting_acks=True) as store:
        ScriptedTier.instances[tag].fail_stores = True
        source = Pages(4)
        source.fill(names)
        assert store.store(keys, source.segments(), 30.0) == [False] * 4
        # Without lasting acknowledgements the same store counts (the primary has them).
    with PageStore(config(f"{engine_id}-b", tiers=scripted(f"{tag}-b"))) as store:
        ScriptedTier.instances[f"{tag}-b"].fail_stores = True
        assert store.store(keys, source.segments(), 30.0) == [True] * 4


def test_a_tier_that_keeps_no_copies_is_not_waited_for(engine_id):
    """Like p2p: the primary tier is the only copy, acknowledged once it is there."""
    tag = f"sharing-{uuid.uuid4().hex[:8]}"
    names, keys = chain(3)
    tiers = scripted(tag, "ScriptedSharingTier")
    with PageStore(config(engine_id, tiers=tiers), lasting_acks=True) as store:
        tier = ScriptedTier.instances[tag]
        store.manager.loop.call(tier.gate.clear)
        assert store.lasting_wait_s == 0
        source = Pages(3)
        source.fill(names)
        assert store.store(keys, source.segments(), 30.0) == [True] * 3
        store.manager.loop.call(tier.gate.set)


def test_a_store_gate_is_refused_with_lasting_acks(engine_id):
    with pytest.raises(ConfigError, match="store_threshold"):
        PageStore(config(engine_id, store_threshold=2), lasting_acks=True)


def test_lasting_copies_count_only_the_tiers_that_keep_copies():
    key_a, key_b = b"a" * 36, b"b" * 36
    lasting = LastingCopies([1], remember=1)
    lasting.cascade_started(0, [key_a])
    assert not lasting.undecided([key_a])  # tier 0 keeps no copies: not waited for
    lasting.cascade_started(1, [key_a, key_b])
    assert lasting.undecided([key_a])
    lasting.cascade_ended(1, [key_a, key_b], True)
    assert not lasting.undecided([key_a, key_b])
    # Only the most recently stored key is remembered (remember=1): the other is
    # answered as having no known copy, which never acknowledges too much.
    assert [lasting.has_copy(key_a), lasting.has_copy(key_b)] == [False, True]
    lasting.cascade_started(1, [key_a])
    lasting.cascade_ended(1, [key_a], False)
    assert not lasting.undecided([key_a]) and not lasting.has_copy(key_a)
