"""Eviction policies: behaviour of lru and arc, and the contract every policy keeps."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvtier import CachePolicy, CachePolicyFactory, ConfigError
from kvtier.policies import ARCCachePolicy, LRUCachePolicy

POLICIES = ["lru", "arc"]


def k(i: int) -> bytes:
    return i.to_bytes(4, "big") + b"\0\0\0\0"


def ready_policy(name: str, capacity: int, count: int) -> CachePolicy:
    policy = CachePolicyFactory.create(name, capacity)
    for i in range(count):
        policy.insert(k(i), f"rec{i}")
        policy.mark_evictable(k(i))
    return policy


# ------------------------------------------------------------------------- lru


def test_lru_evicts_least_recently_inserted_first():
    policy = ready_policy("lru", 8, 4)
    assert [key for key, _ in policy.evict(2, set())] == [k(0), k(1)]


def test_lru_touch_makes_the_prefix_head_outlive_its_tail():
    policy = ready_policy("lru", 8, 4)
    policy.touch([k(0), k(1), k(2)])
    # k(3) was not touched; of the prefix, the tail k(2) goes before the head k(0).
    assert [key for key, _ in policy.evict(4, set())] == [k(3), k(2), k(1), k(0)]


def test_lru_pin_keeps_recency():
    policy = ready_policy("lru", 8, 3)
    policy.mark_non_evictable(k(0))
    assert [key for key, _ in policy.evict(1, set())] == [k(1)]
    policy.mark_evictable(k(0))
    assert [key for key, _ in policy.evict(1, set())] == [k(0)]


# ------------------------------------------------------------------------- arc


def test_arc_moves_a_key_to_t2_on_a_use_after_it_became_readable():
    policy = ARCCachePolicy(8)
    policy.insert(k(0), "r")
    policy.touch([k(0)])  # still being written: the same use, stays in T1
    assert policy.sizes[:2] == (1, 0)
    policy.mark_evictable(k(0))
    policy.touch([k(0)])
    assert policy.sizes[:2] == (0, 1)


def test_arc_prefers_evicting_t1_and_remembers_ghosts():
    policy = ready_policy("arc", 8, 3)
    assert isinstance(policy, ARCCachePolicy)
    policy.touch([k(2)])  # k2 -> T2
    victims = policy.evict(2, set())
    assert [key for key, _ in victims] == [k(0), k(1)]
    assert policy.sizes == (0, 1, 2, 0)


def test_arc_ghost_hit_in_b1_grows_the_t1_target():
    policy = ready_policy("arc", 4, 2)
    assert isinstance(policy, ARCCachePolicy)
    policy.evict(1, set())  # k0 -> B1
    before = policy.target_t1
    policy.insert(k(0), "again")
    assert policy.target_t1 > before
    assert policy.sizes[2] == 0  # the ghost taught once and is gone


def test_arc_ghost_hit_in_b2_shrinks_the_t1_target():
    policy = ready_policy("arc", 4, 2)
    assert isinstance(policy, ARCCachePolicy)
    policy.touch([k(0)])  # k0 -> T2
    policy.target_t1 = 3.0
    victims = policy.evict(2, set())
    assert {key for key, _ in victims} == {k(0), k(1)}
    policy.touch([k(0)])  # k0 is a B2 ghost now
    assert policy.target_t1 < 3.0


def test_arc_falls_back_to_the_other_list_when_one_has_no_candidate():
    policy = ready_policy("arc", 4, 2)
    assert isinstance(policy, ARCCachePolicy)
    policy.touch([k(0), k(1)])  # both in T2
    policy.target_t1 = 4.0  # T2 preferred
    policy.insert(k(2), "t1")
    policy.mark_evictable(k(2))
    policy.mark_non_evictable(k(0))
    policy.mark_non_evictable(k(1))
    assert [key for key, _ in policy.evict(1, set())] == [k(2)]


def test_arc_ghost_lists_are_bounded_by_capacity():
    policy = ARCCachePolicy(3)
    for i in range(20):
        policy.insert(k(i), i)
        policy.mark_evictable(k(i))
        if len(policy) > 3:
            policy.evict(1, set())
    _, _, b1, b2 = policy.sizes
    assert b1 <= 3 and b2 <= 3


# -------------------------------------------------------------------- factory


class _Custom(LRUCachePolicy):
    pass


def test_registered_policy_is_found_by_name():
    CachePolicyFactory.register_policy("custom-test", _Custom)
    assert CachePolicyFactory.get_policy_class("custom-test") is _Custom


def test_out_of_tree_policy_is_imported_by_module_path():
    assert (
        CachePolicyFactory.get_policy_class("ARCCachePolicy", "kvtier.policies.arc")
        is ARCCachePolicy
    )


def test_out_of_tree_class_must_subclass_cache_policy():
    with pytest.raises(
        ConfigError, match=r"^eviction_policy: .*not a subclass of kvtier.CachePolicy"
    ):
        CachePolicyFactory.get_policy_class("OrderedDict", "collections")


def test_out_of_tree_module_must_import():
    with pytest.raises(ConfigError, match=r"^cache_policy_module_path: cannot import"):
        CachePolicyFactory.get_policy_class("X", "no_such_module_kvtier")


def test_a_name_cannot_be_registered_twice():
    with pytest.raises(ValueError, match="already registered"):
        CachePolicyFactory.register_policy("lru", _Custom)


# ------------------------------------------------------- the contract, by model


@pytest.mark.parametrize("name", POLICIES)
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_evict_is_all_or_nothing_and_skips_blocked_and_protected(name, data):
    policy = CachePolicyFactory.create(name, 16)
    evictable: set[bytes] = set()
    held: set[bytes] = set()
    for step in range(data.draw(st.integers(1, 60))):
        op = data.draw(
            st.sampled_from(["insert", "ready", "pin", "unpin", "touch", "evict", "remove"])
        )
        key = k(data.draw(st.integers(0, 20)))
        if op == "insert" and key not in held:
            policy.insert(key, step)
            held.add(key)
        elif op == "ready" and key in held:
            policy.mark_evictable(key)
            evictable.add(key)
        elif op == "pin" and key in evictable:
            policy.mark_non_evictable(key)
            evictable.discard(key)
        elif op == "touch":
            policy.touch(
                data.draw(st.lists(st.sampled_from([k(i) for i in range(21)]), max_size=4))
            )
        elif op == "remove" and key in held:
            policy.remove(key)
            held.discard(key)
            evictable.discard(key)
        elif op == "evict":
            protected = {k(i) for i in data.draw(st.sets(st.integers(0, 20), max_size=5))}
            n = data.draw(st.integers(0, 6))
            before = set(held)
            victims = policy.evict(n, protected)
            candidates = evictable - protected
            if n > len(candidates):
                assert victims is None
                assert len(policy) == len(before)
                assert all(policy.get(key) is not None for key in before)
            else:
                assert victims is not None and len(victims) == n
                taken = {key for key, _ in victims}
                assert len(taken) == n and taken <= candidates
                held -= taken
                evictable -= taken
        assert len(policy) == len(held)


class PrimaryMachine(RuleBasedStateMachine):
    """The primary tier against a plain model: capacity, pins and the call's keys."""

    def __init__(self) -> None:
        super().__init__()
        from kvtier.primary import PrimaryTier

        self.capacity = 6
        self.primary = PrimaryTier(
            self.capacity, CachePolicyFactory.create(self.policy_name, self.capacity)
        )
        self.writing: set[bytes] = set()
        self.readable: dict[bytes, int] = {}  # key -> pins

    policy_name = "lru"

    @rule(ids=st.lists(st.integers(0, 12), min_size=1, max_size=4))
    def prepare_store(self, ids):
        call = [k(i) for i in ids]
        slots_before = self.primary.slots()
        out = self.primary.prepare_store(call)
        if out is None:
            assert self.primary.slots() == slots_before
            return
        assert not set(out.evicted_keys) & set(call)
        for key in out.evicted_keys:
            assert key in self.readable and self.readable[key] == 0
            del self.readable[key]
        self.writing.update(out.keys_to_store)

    @precondition(lambda self: self.writing)
    @rule(data=st.data(), success=st.booleans())
    def complete_store(self, data, success):
        key = data.draw(st.sampled_from(sorted(self.writing)))
        self.primary.complete_store([key], success)
        self.writing.discard(key)
        if success:
            self.readable[key] = 0

    @precondition(lambda self: self.readable)
    @rule(data=st.data())
    def pin(self, data):
        key = data.draw(st.sampled_from(sorted(self.readable)))
        self.primary.prepare_load([key])
        self.readable[key] += 1

    @precondition(lambda self: any(self.readable.values()))
    @rule(data=st.data())
    def unpin(self, data):
        key = data.draw(st.sampled_from(sorted(k for k, pins in self.readable.items() if pins)))
        self.primary.complete_load([key])
        self.readable[key] -= 1

    @rule(ids=st.lists(st.integers(0, 12), max_size=4))
    def touch(self, ids):
        self.primary.touch([k(i) for i in ids])

    @invariant()
    def capacity_is_never_exceeded_and_slots_are_unique(self):
        slots = list(self.primary.slots().values())
        assert len(slots) <= self.capacity
        assert len(set(slots)) == len(slots)
        assert self.primary.num_free + len(slots) == self.capacity

    @invariant()
    def model_and_tier_agree(self):
        assert set(self.primary.slots()) == self.writing | set(self.readable)
        for key, pins in self.readable.items():
            assert self.primary.ref_count(key) == pins
        for key in self.writing:
            assert self.primary.ref_count(key) == -1


class ArcPrimaryMachine(PrimaryMachine):
    policy_name = "arc"


TestPrimaryWithLru = PrimaryMachine.TestCase
TestPrimaryWithArc = ArcPrimaryMachine.TestCase
for case in (TestPrimaryWithLru, TestPrimaryWithArc):
    case.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)


class FifoPolicy(CachePolicy):
    """An out-of-tree policy written to the documented methods only."""

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.records: dict[bytes, object] = {}
        self.blocked: set[bytes] = set()

    def get(self, key):
        return self.records.get(key)

    def insert(self, key, record):
        self.records[key] = record
        self.blocked.add(key)

    def remove(self, key):
        self.records.pop(key, None)
        self.blocked.discard(key)

    def touch(self, keys):
        pass

    def evict(self, n, protected):
        victims = [k for k in self.records if k not in self.blocked and k not in protected][:n]
        if len(victims) < n:
            return None
        return [(key, self.records.pop(key)) for key in victims]

    def clear(self):
        self.records.clear()
        self.blocked.clear()

    def mark_evictable(self, key):
        self.blocked.discard(key)

    def mark_non_evictable(self, key):
        self.blocked.add(key)


def test_a_policy_with_only_the_documented_methods_runs_the_primary_tier():
    from kvtier.primary import PrimaryTier

    primary = PrimaryTier(2, FifoPolicy(2))
    for i in range(3):
        out = primary.prepare_store([k(i)])
        assert out is not None
        primary.complete_store([k(i)])
    assert set(primary.slots()) == {k(1), k(2)}  # the oldest went first
