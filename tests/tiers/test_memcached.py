"""The memcached tier: its settings, what it derives from the engine, and the real
memcached on loopback (tests/memcached_server.py): authentication, items it holds
already, a server killed and started again under a running engine."""

from __future__ import annotations

import pytest
from anyio.abc import SocketAttribute
from helpers import keys
from memcached_server import MemcachedServer
from server_outages import server_killed_mid_run, server_restarted_while_idle

from kvtier import ConfigError
from kvtier.bench.servers import free_port
from kvtier.format import HEADER_BYTES
from kvtier.metrics import MetricsRecorder
from kvtier.records import HitSource, Medium
from kvtier.region import PrimaryView
from kvtier.tiers.base import TierContext, TransferJob
from kvtier.tiers.memcached import STORES_SKIPPED, MemcachedSettings, MemcachedTier

pytestmark = pytest.mark.anyio

PATH = "secondary_tiers[0]"
CHUNK = 4096
PASSWORD = "a-password-that-must-never-show"


@pytest.fixture
def anyio_backend():
    return "asyncio"


def context(chunks: int = 4, *, job_timeout_s: float = 30.0) -> TierContext:
    view = PrimaryView(memoryview(bytearray(chunks * CHUNK)), chunks, CHUNK)
    settings = MemcachedSettings()
    metrics = MetricsRecorder(MemcachedTier.build_metric_definitions(settings))
    return TierContext(
        view,
        CHUNK,
        "kvtier/memcached-test",
        "1:memcached",
        metrics=metrics,
        job_timeout_s=job_timeout_s,
    )


def tier(ctx: TierContext, **params: object) -> MemcachedTier:
    return MemcachedTier(ctx, MemcachedTier.settings_for(ctx, params))


def job(job_id: int, ks: list[bytes], slots: list[int], *, promotion: bool) -> TransferJob:
    return TransferJob(job_id, tuple(ks), tuple(slots), promotion, f"r{job_id}")


def test_the_tier_is_remote_memory_and_its_hits_come_from_an_external_store():
    assert MemcachedTier.medium is Medium.REMOTE_MEMORY
    assert MemcachedTier.hit_source is HitSource.EXTERNAL
    assert MemcachedTier.locality == "remote"


def test_the_password_needs_a_username_and_never_shows():
    with pytest.raises(ConfigError, match=r"^secondary_tiers\[0\]\.username: is required"):
        MemcachedSettings.from_params({"password": PASSWORD}, PATH)
    settings = MemcachedSettings.from_params({"username": "kv", "password": PASSWORD}, PATH)
    assert PASSWORD not in repr(settings) and settings.password is not None
    assert settings.password.value == PASSWORD


@pytest.mark.parametrize("server", ["localhost", "host:port", "host:0", "host:70000"])
def test_a_bad_server_is_named_by_its_path(server):
    with pytest.raises(ConfigError, match=r"^secondary_tiers\[0\]\.server: expected"):
        MemcachedSettings.from_params({"server": server}, PATH)


def test_the_item_size_and_the_deadline_are_derived_once_from_the_engine():
    ctx = context(job_timeout_s=12.0)
    settings = MemcachedTier.settings_for(ctx, {})
    assert settings.item_bytes == HEADER_BYTES + CHUNK
    assert settings.job_deadline_s == pytest.approx(8.0)  # two thirds of job_timeout_s


def test_a_chunk_bigger_than_the_servers_items_says_how_to_start_the_server():
    ctx = TierContext(None, 4 << 20, "ns", "1:memcached")  # type: ignore[arg-type]
    with pytest.raises(
        ConfigError, match=r"^secondary_tiers\[0\]\.max_item_bytes: .* start memcached with -I 5m"
    ):
        MemcachedTier.settings_for(ctx, {})


def test_a_deadline_at_or_beyond_the_job_timeout_is_refused():
    with pytest.raises(ConfigError, match=r"^secondary_tiers\[0\]\.job_deadline_s: must be below"):
        MemcachedTier.settings_for(context(job_timeout_s=5.0), {"job_deadline_s": 5})


async def test_start_names_the_server_when_nothing_answers():
    memcached = tier(context(), server=f"127.0.0.1:{free_port()}")
    with pytest.raises(ConfigError, match=r"^secondary_tiers\[0\]\.server: cannot reach memcached"):
        await memcached.start()
    await memcached.aclose()


async def test_start_names_the_username_when_the_server_refuses_it():
    async with MemcachedServer(credentials=("kv", PASSWORD)) as server:
        memcached = tier(context(), server=server.address, username="kv", password="wrong")
        with pytest.raises(ConfigError, match=r"^secondary_tiers\[0\]\.username: ") as info:
            await memcached.start()
        assert "wrong" not in str(info.value)
        await memcached.aclose()


async def test_an_authenticated_tier_stores_and_loads_byte_exact():
    async with MemcachedServer(credentials=("kv", PASSWORD)) as server:
        ctx = context()
        memcached = tier(ctx, server=server.address, username="kv", password=PASSWORD)
        await memcached.start()
        try:
            ks = keys("auth", 2)
            ctx.primary_view[0][:] = bytes([7]) * CHUNK
            ctx.primary_view[1][:] = bytes([9]) * CHUNK
            assert (await memcached.store(job(1, ks, [0, 1], promotion=False))).success
            assert list(await memcached.lookup([*ks, *keys("never", 1)])) == [True, True, False]
            result = await memcached.load(job(2, ks, [3, 2], promotion=True))
            assert result.success and list(result.successful_keys or ()) == ks
            assert bytes(ctx.primary_view[3]) == bytes([7]) * CHUNK
            assert bytes(ctx.primary_view[2]) == bytes([9]) * CHUNK
        finally:
            await memcached.aclose()


async def test_an_item_the_server_already_holds_is_kept_and_counted_as_skipped():
    async with MemcachedServer() as server:
        ctx = context()
        memcached = tier(ctx, server=server.address)
        await memcached.start()
        try:
            ks = keys("twice", 1)
            ctx.primary_view[0][:] = bytes([1]) * CHUNK
            await memcached.store(job(1, ks, [0], promotion=False))
            ctx.primary_view[0][:] = bytes([2]) * CHUNK
            result = await memcached.store(job(2, ks, [0], promotion=False))
            assert result.success and result.transfer_bytes == 0
            assert ctx.metrics.total(STORES_SKIPPED, (ctx.tier_name,)) == 1
            item = await server.read_item(memcached.item_name(ks[0]))
            assert item is not None and item[HEADER_BYTES:] == bytes([1]) * CHUNK
        finally:
            await memcached.aclose()


async def test_a_connection_in_use_when_the_tier_closes_is_closed_with_its_exchange():
    async with MemcachedServer() as server:
        memcached = tier(context(), server=server.address)
        await memcached.start()
        async with memcached._pool.connection() as connection:
            await memcached.aclose()
            await connection.command(b"version\r\n", (b"VERSION",))
        sock = connection.stream.extra(SocketAttribute.raw_socket)
        assert sock.fileno() == -1


async def test_a_server_killed_mid_run_is_a_counted_miss_and_serves_again_once_restarted(
    engine_id,
):
    async with MemcachedServer() as server:
        await server_killed_mid_run(
            engine_id, server, {"type": "memcached", "server": server.address}, CHUNK
        )


async def test_a_server_restarted_while_the_tier_is_idle_loses_no_store_after_it(engine_id):
    async with MemcachedServer() as server:
        await server_restarted_while_idle(
            engine_id, server, {"type": "memcached", "server": server.address}, CHUNK
        )
