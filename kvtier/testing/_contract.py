"""The tests every secondary tier must pass: :class:`TierContract`, its hooks and tests.

See :mod:`kvtier.testing` for how a tier author uses it.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import hashlib
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Any, ClassVar

import anyio
import pytest
import torch

from kvtier.config import OffloadingConfig
from kvtier.facade import KVTier
from kvtier.keys import OffloadKey, make_offload_key
from kvtier.metrics import Names
from kvtier.region import DEFAULT_SHM_DIR
from kvtier.testing._metrics import LATE_COMPLETIONS, QUARANTINED_SLOTS, has_metric, metric_value
from kvtier.testing._nodes import ROOM_WAIT_S, WAIT_S, Node, Nodes, until
from kvtier.testing._stall import Stall

__all__ = ["TierContract"]


class TierContract:
    """The tests every secondary tier must pass; subclass it and provide the hooks.

    Each test opens one node (a :class:`~kvtier.KVTier` over CPU tensors, with the tier
    under test as its only secondary tier), or two when :meth:`reader_tier_config`
    gives a reader, and closes them at its end. Class attributes size the nodes; a
    subclass may change them.
    """

    #: Bytes per GPU block and per chunk (one block per chunk): a page multiple.
    block_bytes: ClassVar[int] = 16 * 1024
    #: Primary slots of each node: small, so that a test soon needs every slot.
    primary_chunks: ClassVar[int] = 8
    #: Primary slots of the writing node. A tier that serves only what is in the
    #: writer's primary tier (p2p) needs room there for the round trip.
    writer_primary_chunks: ClassVar[int | None] = None
    #: Blocks of each node's stand-in GPU tensor.
    gpu_blocks: ClassVar[int] = 128
    #: Chunks of the round-trip test: three primary tiers' worth by default.
    round_trip_chunks: ClassVar[int] = 24
    #: The storage namespace's model name.
    model_name: ClassVar[str] = "kvtier-contract"
    #: ``job_timeout_s`` of the node whose I/O the stall tests hold up.
    stall_job_timeout_s: ClassVar[float] = 0.3
    #: How long after its time-out a stalled job may still be reported failed: the
    #: loop runs other work and the scheduler steps between (generous for a loaded CI
    #: machine, far below any stall, which lasts until the test ends it).
    lateness_s: ClassVar[float] = 3.0
    #: Seconds a lookup waits for the tier's promotions.
    lookup_timeout_s: ClassVar[float] = 30.0
    #: True for a tier that stops its own I/O when its job is cancelled (a network
    #: tier closing its connection): nothing it does is late, and a stall hook that
    #: holds the far end (a proxy) may still say "holding" for a moment after the tier
    #: let go, so the stalled tests only require the quarantine metrics to exist.
    stops_io_when_cancelled: ClassVar[bool] = False
    #: False for a tier without :meth:`~kvtier.SecondaryTier.clear`: asked to clear,
    #: it must keep every chunk and say so.
    clears: ClassVar[bool] = True

    #: What hooks open for one test (servers, proxies): closed after its nodes.
    resources: contextlib.AsyncExitStack

    # ------------------------------------------------------------------ hooks

    async def tier_config(self) -> Mapping[str, Any]:
        """The tier's mapping in ``secondary_tiers`` (``type``, parameters) for the
        writing node. The contract adds framework keys (``job_timeout_s``) itself."""
        raise NotImplementedError(f"{type(self).__name__} must define tier_config()")

    async def reader_tier_config(self, writer: KVTier) -> Mapping[str, Any] | None:
        """The mapping of a second node that reads what ``writer`` stored, or None
        (the default) to read back through ``writer``, its primary tier emptied."""
        return None

    async def corrupt(self, writer: KVTier, key: OffloadKey) -> None:
        """Damage ``key``'s stored chunk (flip a payload byte) where ``writer`` stored it."""
        pytest.skip(f"{type(self).__name__} defines no corrupt()")

    async def truncate(self, writer: KVTier, key: OffloadKey) -> None:
        """Cut the end off ``key``'s stored chunk where ``writer`` stored it."""
        pytest.skip(f"{type(self).__name__} defines no truncate()")

    def stall_loads(self, node: KVTier, key: OffloadKey) -> AbstractAsyncContextManager[Stall]:
        """Hold ``node``'s next load of ``key`` in its real I/O until the context exits.

        The held I/O reports through the :class:`Stall` yielded. On exit it is let go
        and completes late (a thread writes into the slot it was given, an answer
        reaches a connection), or finds its client gone.
        """
        pytest.skip(f"{type(self).__name__} defines no stall_loads()")

    def stall_stores(self, node: KVTier) -> AbstractAsyncContextManager[Stall]:
        """Hold ``node``'s next store (cascade) in its real I/O until the context
        exits, before it has read its slot to the end; as :meth:`stall_loads`."""
        pytest.skip(f"{type(self).__name__} defines no stall_stores()")

    async def stored_chunk(self, writer: KVTier, key: OffloadKey) -> bytes | None:
        """The chunk's bytes as the tier holds them under ``key``, read past its own
        verification (the payload, a whole primary row), or None when it holds none.

        Optional: without it a stalled store is checked by reading the chunk back through
        a node only, where the tier's checksums may turn bytes written from a reused slot
        into a miss.
        """
        raise NotImplementedError

    def capacity_config(self, chunks: int, chunk_bytes: int) -> Mapping[str, Any] | None:
        """Parameters (added to :meth:`tier_config`'s) that let the tier keep at most
        ``chunks`` chunks of ``chunk_bytes``; None (the default): no such parameter."""
        return None

    # --------------------------------------------------------------- fixtures

    @pytest.fixture
    def anyio_backend(self) -> str:
        # kvtier's tiers run on asyncio.
        return "asyncio"

    @pytest.fixture(autouse=True)
    def _contract_engines(self) -> Iterator[None]:
        """Names this test's engines; fails it if one leaves its region behind."""
        self._engine_prefix = f"contract-{uuid.uuid4().hex[:12]}"
        self._engines = 0
        self._token = uuid.uuid4().hex
        self._generator = torch.Generator().manual_seed(int(self._token[:8], 16))
        yield
        shm = Path(DEFAULT_SHM_DIR)
        leftovers = sorted(path.name for path in shm.glob(f"kvtier_{self._engine_prefix}*"))
        for name in leftovers:
            (shm / name).unlink(missing_ok=True)
        assert not leftovers, f"the test left {leftovers} in {shm}"

    # ---------------------------------------------------------------- helpers

    def keys(self, name: str, count: int) -> list[OffloadKey]:
        """``count`` keys no other test (or run) uses."""
        return [
            make_offload_key(hashlib.sha256(f"{self._token}/{name}/{i}".encode()).digest())
            for i in range(count)
        ]

    def _config(
        self,
        tier: Mapping[str, Any],
        *,
        chunks: int,
        events: bool,
        job_timeout_s: float | None,
    ) -> OffloadingConfig:
        self._engines += 1
        params = dict(tier)
        if job_timeout_s is not None:
            params["job_timeout_s"] = job_timeout_s
        return OffloadingConfig(
            engine_id=f"{self._engine_prefix}-{self._engines}",
            kv_bytes_per_block=self.block_bytes,
            model_name=self.model_name,
            kv_dtype="uint8",
            enable_kv_events=events,
            extra_config={
                "spec_name": "TieringOffloadingSpec",
                "cpu_bytes_to_use": chunks * self.block_bytes,
                "secondary_tiers": [params],
            },
        )

    async def _open_node(self, config: OffloadingConfig) -> Node:
        cache = torch.zeros((self.gpu_blocks, self.block_bytes), dtype=torch.uint8)
        kv = await self.resources.enter_async_context(KVTier(config, [cache]))
        return Node(kv, cache)

    @contextlib.asynccontextmanager
    async def _nodes(
        self,
        *,
        events: bool = False,
        writer_timeout_s: float | None = None,
        reader_timeout_s: float | None = None,
        extra: Mapping[str, Any] | None = None,
    ) -> AsyncIterator[Nodes]:
        """The writer and reader nodes (one node when the tier has no reader).

        ``writer_timeout_s`` / ``reader_timeout_s`` set ``job_timeout_s`` of the node
        whose I/O a test holds up (the framework's default for the other).
        """
        async with contextlib.AsyncExitStack() as stack:
            self.resources = stack
            tier = {**await self.tier_config(), **(extra or {})}
            writer_chunks = self.writer_primary_chunks or self.primary_chunks

            async def open_writer(timeout_s: float | None) -> Node:
                config = self._config(
                    tier, chunks=writer_chunks, events=events, job_timeout_s=timeout_s
                )
                return await self._open_node(config)

            writer = await open_writer(writer_timeout_s)
            reader_tier = await self.reader_tier_config(writer.kv)
            if reader_tier is None:
                if reader_timeout_s is not None:
                    # The writer reads too, so it is the node whose loads are held up.
                    await writer.kv.aclose()
                    writer = await open_writer(reader_timeout_s)
                reader = writer
            else:
                config = self._config(
                    reader_tier,
                    chunks=self.primary_chunks,
                    events=events,
                    job_timeout_s=reader_timeout_s,
                )
                reader = await self._open_node(config)
            yield Nodes(writer, reader, self._generator, self.lookup_timeout_s)

    # ------------------------------------------------------------------ tests

    @pytest.mark.anyio
    async def test_chunks_come_back_byte_exact(self) -> None:
        """Chunks stored through the writer load back on the reader, every byte as stored."""
        async with self._nodes() as nodes:
            keys = self.keys("round-trip", self.round_trip_chunks)
            await nodes.put(nodes.writer, keys)
            await nodes.empty_primary()
            await nodes.reader.visible(keys)
            await nodes.load_all(nodes.reader, keys)

    @pytest.mark.anyio
    async def test_keys_never_stored_are_misses(self) -> None:
        """Keys the tier never stored are misses, and a lookup stops at the first one."""
        async with self._nodes() as nodes:
            present = self.keys("present", 2)
            absent = self.keys("absent", 3)
            await nodes.put(nodes.writer, present)
            await nodes.empty_primary()
            await nodes.reader.visible(present)
            reader = nodes.reader.kv
            with anyio.fail_after(WAIT_S):
                assert list(await nodes.reader.tier.lookup(absent)) == [False] * 3
                assert await reader.lookup(absent, "absent", timeout=self.lookup_timeout_s) == 0
                mixed = [present[0], absent[0], present[1]]
                assert await reader.lookup(mixed, "mixed", timeout=self.lookup_timeout_s) == 1
            reader.finish("absent")
            reader.finish("mixed")

    @pytest.mark.anyio
    async def test_clear_drops_every_chunk(self) -> None:
        """Asked to clear, the tier drops every chunk it stored and no node finds them
        any more; it stores as before after. A tier that cannot clear keeps them all
        and says so."""
        async with self._nodes() as nodes:
            keys = self.keys("cleared", 3)
            await nodes.put(nodes.writer, keys)
            await nodes.reader.visible(keys)
            writer = nodes.writer.kv
            kept = await writer.clear()
            assert writer.manager.primary.num_stored == 0
            if not self.clears:
                assert kept == [nodes.writer.tier.ctx.tier_name]
                assert all(await nodes.reader.tier.lookup(keys))
                return
            assert kept == []
            await nodes.reader.invisible(keys)
            reader = nodes.reader.kv
            with anyio.fail_after(WAIT_S):
                assert await reader.lookup(keys, "cleared", timeout=self.lookup_timeout_s) == 0
            reader.finish("cleared")
            # What is stored after a clear is kept as ever.
            again = self.keys("after-clear", 2)
            await nodes.put(nodes.writer, again)
            await nodes.empty_primary()
            await nodes.reader.visible(again)
            await nodes.load_all(nodes.reader, again)

    @pytest.mark.anyio
    async def test_a_corrupt_chunk_is_a_counted_miss_and_removed(self) -> None:
        """A chunk damaged where it is stored is never served: a miss, counted once in
        ``kvtier_tiering_integrity_failures``, and gone (asked again, a plain miss)."""
        await self._damaged_chunk_is_a_counted_miss(self.corrupt)

    @pytest.mark.anyio
    async def test_a_truncated_chunk_is_a_counted_miss_and_removed(self) -> None:
        """A chunk cut short where it is stored: as a corrupt one."""
        await self._damaged_chunk_is_a_counted_miss(self.truncate)

    async def _damaged_chunk_is_a_counted_miss(
        self, damage: Callable[[KVTier, OffloadKey], Any]
    ) -> None:
        async with self._nodes() as nodes:
            key, intact = self.keys("damaged", 2)
            await nodes.put(nodes.writer, [key, intact])
            await damage(nodes.writer.kv, key)
            await nodes.empty_primary()
            reader = nodes.reader
            await reader.visible([intact])
            assert reader.metric(f"{Names.INTEGRITY_FAILURES}_total") == 0
            [block] = reader.blocks(1)
            reader.cache[block] = 7
            hits = await reader.kv.lookup([key], "damaged", timeout=self.lookup_timeout_s)
            assert hits == 0, "a damaged chunk was found"
            assert await reader.kv.load([key], [block], "damaged") == 0
            reader.kv.finish("damaged")
            assert bool((reader.cache[block] == 7).all()), "a damaged chunk reached the GPU"
            assert reader.metric(f"{Names.INTEGRITY_FAILURES}_total") == 1
            # Removed: asking again finds nothing and verifies nothing more.
            assert await reader.kv.lookup([key], "again", timeout=self.lookup_timeout_s) == 0
            reader.kv.finish("again")
            assert reader.metric(f"{Names.INTEGRITY_FAILURES}_total") == 1
            assert await nodes.read_back(reader, [intact]) == [intact]

    @pytest.mark.anyio
    async def test_a_lookup_cancelled_mid_promotion_leaves_the_node_usable(self) -> None:
        """Cancelling a task whose lookup waits for a promotion leaks no slot and no
        task, and the chunks still load byte-exact."""
        tasks_before = asyncio.all_tasks()
        async with self._nodes() as nodes:
            keys = self.keys("cancelled", 4)
            await nodes.put(nodes.writer, keys)
            await nodes.empty_primary()
            reader = nodes.reader
            await reader.visible(keys)
            lookup = asyncio.ensure_future(
                reader.kv.lookup(keys, "cancelled", timeout=self.lookup_timeout_s)
            )
            await asyncio.sleep(0)  # the lookup runs until it waits for its promotion
            assert reader.kv.manager.has_pending_work() and not lookup.done(), (
                "the lookup did not wait for a promotion"
            )
            lookup.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await lookup
            reader.kv.finish("cancelled")
            await reader.kv.drain()
            assert not reader.kv.manager.has_pending_work()
            assert metric_value(reader.registry, Names.CPU_CACHE_USAGE_PERC) == 0, (
                "a slot stayed held"
            )
            # Every slot can be filled, and the chunks are still there, byte-exact.
            fresh = self.keys("after-cancel", reader.primary_chunks)
            assert await nodes.put(reader, fresh) == fresh
            await reader.kv.reset()
            await nodes.load_all(reader, keys)
        gc.collect()
        assert asyncio.all_tasks() - tasks_before == set(), "a task outlived its node"

    @pytest.mark.anyio
    async def test_closing_twice_is_harmless(self) -> None:
        """A node and its tier close twice without error, leaving no task behind."""
        tasks_before = asyncio.all_tasks()
        async with self._nodes() as nodes:
            await nodes.put(nodes.writer, self.keys("closing", 2))
            for node in [nodes.writer] if nodes.shared else [nodes.writer, nodes.reader]:
                tier = node.tier
                await node.kv.aclose()
                await node.kv.aclose()
                await tier.aclose()  # the manager closed it already
        gc.collect()
        assert asyncio.all_tasks() - tasks_before == set(), "a task outlived its node"

    @pytest.mark.anyio
    async def test_stores_are_reported_as_events_of_the_tier(self) -> None:
        """With ``enable_kv_events``, every key stored is in a store event of the tier's
        label and medium."""
        async with self._nodes(events=True) as nodes:
            writer = nodes.writer
            keys = self.keys("events", 3)
            writer.kv.manager.take_events()
            await nodes.put(writer, keys)
            events = [e for e in writer.kv.manager.take_events() if e.tier == writer.label]
            stored = {key for event in events if not event.removed for key in event.keys}
            assert stored == set(keys)
            assert {event.medium for event in events} == {type(writer.tier).medium}

    @pytest.mark.anyio
    async def test_capacity_is_never_exceeded(self) -> None:
        """A tier bounded to N chunks keeps at most N, the newest among them."""
        limit = 4
        params = self.capacity_config(limit, self.block_bytes)
        if params is None:
            pytest.skip(f"{type(self).__name__} defines no capacity_config()")
        async with self._nodes(extra=params) as nodes:
            keys = self.keys("capacity", 3 * limit)
            await nodes.put(nodes.writer, keys)
            await nodes.empty_primary()
            answers = await nodes.reader.tier.lookup(keys)
            kept = [key for key, present in zip(keys, answers, strict=True) if present]
            assert 0 < len(kept) <= limit, f"the tier kept {len(kept)} chunks, capacity {limit}"
            assert keys[-1] in kept, "the newest chunk was evicted"
            assert await nodes.read_back(nodes.reader, kept) == kept

    @pytest.mark.anyio
    async def test_a_stalled_load_fails_in_time_and_never_lands_in_a_reused_slot(self) -> None:
        """A load held in the tier's I/O past ``job_timeout_s`` is reported failed in
        time; its slot is not reused while the I/O may still write it, so chunks stored
        meanwhile come back byte-exact, from the primary tier and from the tier, and the
        stalled chunk is a miss or byte-exact. While the I/O outlives its job the
        framework counts the slot in ``kvtier_tiering_quarantined_slots``, and its end
        in ``kvtier_tiering_late_completions``."""
        timeout_s = self.stall_job_timeout_s
        async with self._nodes(reader_timeout_s=timeout_s) as nodes:
            reader = nodes.reader
            [stalled] = self.keys("stalled-load", 1)
            await nodes.put(nodes.writer, [stalled])
            await nodes.empty_primary()
            await reader.visible([stalled])
            async with self.stall_loads(reader.kv, stalled) as stall:
                started = time.monotonic()
                lookup = asyncio.ensure_future(
                    reader.kv.lookup([stalled], "stalled", timeout=self.lookup_timeout_s)
                )
                try:
                    await until(lambda: stall.reached() or lookup.done(), "the load to stall")
                    assert stall.reached(), "the promotion ended without reaching the stall"
                    with anyio.fail_after(timeout_s + self.lateness_s + WAIT_S):
                        hits = await lookup
                finally:
                    lookup.cancel()
                elapsed = time.monotonic() - started
                reader.kv.finish("stalled")
                assert hits == 0, "a load stalled past its time-out was reported loaded"
                held = stall.holding()
                quarantined = metric_value(reader.registry, QUARANTINED_SLOTS)
                # Fresh chunks that need every slot of the primary tier, the stalled
                # load's included unless the framework holds it back.
                fresh = self.keys("fresh", reader.primary_chunks)
                stored = await nodes.put(reader, fresh, drain=False, room_wait_s=ROOM_WAIT_S)
            await until(stall.finished, "the stalled load's I/O to end once let go")
            late = await reader.settle(held)
            await nodes.check_fresh(reader, stored)
            # Asked again, the stalled chunk is a miss or exactly its bytes.
            await nodes.read_back(reader, [stalled])
            assert elapsed < timeout_s + self.lateness_s, (
                f"a load stalled in the tier was reported after {elapsed:.2f} s, its "
                f"job_timeout_s being {timeout_s:g} s"
            )
            self._check_quarantine_metrics(
                reader, held and not self.stops_io_when_cancelled, quarantined, late
            )

    @pytest.mark.anyio
    async def test_a_stalled_store_fails_in_time_and_never_reads_a_reused_slot(self) -> None:
        """A cascade held in the tier's I/O past ``job_timeout_s`` is reported failed in
        time; its slot is not reused while the I/O may still read it, so the tier holds
        nothing or exactly the chunk's bytes under its key, and chunks stored meanwhile
        come back byte-exact; metrics as for a stalled load."""
        timeout_s = self.stall_job_timeout_s
        async with self._nodes(writer_timeout_s=timeout_s) as nodes:
            writer = nodes.writer
            [stalled] = self.keys("stalled-store", 1)
            failures = f"{Names.CASCADE_JOB_FAILURES}_total"

            def failed() -> bool:
                writer.kv.manager.on_schedule_end()  # applies what the tier reported
                return writer.metric(failures) > 0

            async with self.stall_stores(writer.kv) as stall:
                await nodes.put(writer, [stalled], drain=False)
                started = time.monotonic()
                await until(lambda: stall.reached() or failed(), "the cascade to stall")
                assert stall.reached(), "the cascade ended without reaching the stall"
                await until(failed, "the stalled cascade to be reported failed")
                elapsed = time.monotonic() - started
                held = stall.holding()
                quarantined = metric_value(writer.registry, QUARANTINED_SLOTS)
                # Fresh chunks that need every slot, the stalled chunk's included
                # unless the framework holds it back.
                fresh = self.keys("fresh", writer.primary_chunks)
                stored = await nodes.put(writer, fresh, drain=False, room_wait_s=ROOM_WAIT_S)
            await until(stall.finished, "the stalled store's I/O to end once let go")
            late = await writer.settle(held)
            await nodes.check_fresh(writer, stored)
            await self._check_stored(nodes, writer, stalled)
            # What the tier holds under the stalled key: nothing, or exactly its bytes.
            await nodes.empty_primary()
            await nodes.read_back(nodes.reader, [stalled])
            assert elapsed < timeout_s + self.lateness_s, (
                f"a store stalled in the tier was reported after {elapsed:.2f} s, its "
                f"job_timeout_s being {timeout_s:g} s"
            )
            self._check_quarantine_metrics(
                writer, held and not self.stops_io_when_cancelled, quarantined, late
            )

    async def _check_stored(self, nodes: Nodes, writer: Node, key: OffloadKey) -> None:
        """What the tier wrote under ``key`` is nothing, or exactly the chunk's bytes."""
        try:
            data = await self.stored_chunk(writer.kv, key)
        except NotImplementedError:
            return
        if data is None:
            return
        got = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        if torch.equal(got, nodes.stored[key]):
            return
        others = [other for other, chunk in nodes.stored.items() if torch.equal(got, chunk)]
        whose = f"the bytes of chunk {others[0].hex()[:16]}" if others else "other bytes"
        raise AssertionError(
            f"the tier stored {whose} under chunk {key.hex()[:16]}: its cascade read the "
            "slot after another chunk took it"
        )

    @staticmethod
    def _check_quarantine_metrics(
        node: Node, held: bool, quarantined: float | None, late: float
    ) -> None:
        registry = node.registry
        assert has_metric(registry, QUARANTINED_SLOTS), (
            f"the registry has no {QUARANTINED_SLOTS} gauge"
        )
        if not held:
            return  # the tier stopped its I/O when its job was cancelled: nothing was late
        assert quarantined is not None and quarantined >= 1, (
            f"{QUARANTINED_SLOTS} was {quarantined} while a timed-out job's I/O still held its slot"
        )
        assert late >= 1, f"{LATE_COMPLETIONS}_total{{tier={node.label!r}}} was {late}"
        assert not metric_value(registry, QUARANTINED_SLOTS), (
            f"{QUARANTINED_SLOTS} stayed up after the late I/O ended"
        )
