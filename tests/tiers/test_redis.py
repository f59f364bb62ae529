"""The redis tier: its settings, what it derives from the engine, and real redis-servers
on loopback (tests/redis_server.py): passwords and password files, values it holds
already, ttl_s, damaged values, a server killed and started again under a running
engine, a Redis Cluster of three masters, TLS, and two engine processes sharing one
server."""

from __future__ import annotations

import json
import multiprocessing
import os
import time
from pathlib import Path

import anyio
import pytest
import redis_procs
import torch
from helpers import damaged, keys, store_all, tiering_config
from redis.exceptions import ConnectionError as RedisConnectionError
from redis_server import RedisClusterServers, RedisServer, tls_files
from server_outages import server_killed_mid_run, server_restarted_while_idle

from kvtier import ConfigError, KVTier
from kvtier.bench.servers import free_port
from kvtier.cli import main
from kvtier.format import HEADER_BYTES
from kvtier.metrics import MetricsRecorder
from kvtier.records import HitSource, Medium
from kvtier.region import PrimaryView
from kvtier.tiers.base import TierContext, TransferJob
from kvtier.tiers.redis import STORES_SKIPPED, RedisSettings, RedisTier

pytestmark = pytest.mark.anyio

PATH = "secondary_tiers[0]"
CHUNK = 4096
PASSWORD = "a-password-that-must-never-show"


@pytest.fixture
def anyio_backend():
    return "asyncio"


def context(
    chunks: int = 4, *, job_timeout_s: float = 30.0, namespace: str = "kvtier/redis-test"
) -> TierContext:
    view = PrimaryView(memoryview(bytearray(chunks * CHUNK)), chunks, CHUNK)
    metrics = MetricsRecorder(RedisTier.build_metric_definitions(None))
    return TierContext(
        view, CHUNK, namespace, "1:redis", metrics=metrics, job_timeout_s=job_timeout_s
    )


def tier(ctx: TierContext, **params: object) -> RedisTier:
    return RedisTier(ctx, RedisTier.settings_for(ctx, params))


def job(job_id: int, ks: list[bytes], slots: list[int], *, promotion: bool) -> TransferJob:
    return TransferJob(job_id, tuple(ks), tuple(slots), promotion, f"r{job_id}")


def secret_file(tmp_path: Path, text: str, mode: int = 0o600, name: str = "redis.pass") -> Path:
    path = tmp_path / name
    path.write_text(text + "\n")
    path.chmod(mode)
    return path


async def round_trip(ctx: TierContext, redis: RedisTier, name: str) -> None:
    """Two chunks stored, looked up and loaded back into other slots, byte-exact."""
    ks = keys(name, 2)
    ctx.primary_view[0][:] = bytes([7]) * CHUNK
    ctx.primary_view[1][:] = bytes([9]) * CHUNK
    assert (await redis.store(job(1, ks, [0, 1], promotion=False))).success
    assert list(await redis.lookup([*ks, *keys("never", 1)])) == [True, True, False]
    result = await redis.load(job(2, ks, [3, 2], promotion=True))
    assert result.success and list(result.successful_keys or ()) == ks
    assert bytes(ctx.primary_view[3]) == bytes([7]) * CHUNK
    assert bytes(ctx.primary_view[2]) == bytes([9]) * CHUNK


# ------------------------------------------------------------------ settings


def test_the_tier_is_remote_memory_and_its_hits_come_from_an_external_store():
    assert RedisTier.medium is Medium.REMOTE_MEMORY
    assert RedisTier.hit_source is HitSource.EXTERNAL
    assert RedisTier.locality == "remote"


def test_a_password_in_the_url_is_moved_out_of_it_and_never_shows():
    settings = RedisSettings.from_params({"url": f"redis://kv:{PASSWORD}@cache:6380/2"}, PATH)
    assert settings.url == "redis://kv@cache:6380/2"
    assert settings.password is not None and settings.password.value == PASSWORD
    assert PASSWORD not in repr(settings)


def test_the_url_defaults_to_a_local_server_and_is_shown_whole():
    assert RedisSettings.from_params({}, PATH).url == "redis://127.0.0.1:6379/0"
    settings = RedisSettings.from_params({"url": "rediss://[::1]"}, PATH)
    assert settings.url == "rediss://[::1]:6379/0"


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        (f"http://:{PASSWORD}@cache:6379", "got http://cache:6379/0"),
        (f"redis://:{PASSWORD}@:6379", "names no host"),
        (f"redis://:{PASSWORD}@cache:port", "the port is not a number"),
        (f"redis://:{PASSWORD}@cache:70000", "the port is not a number"),
        (f"redis://:{PASSWORD}@cache/zero", "the database of redis://cache:6379/zero"),
        (f"redis://:{PASSWORD}@cache/0?ssl_cert_reqs=none", "has a query"),
    ],
)
def test_a_bad_url_is_named_by_its_path_without_its_password(url, problem):
    with pytest.raises(ConfigError, match=r"^secondary_tiers\[0\]\.url: expected redis://") as info:
        RedisSettings.from_params({"url": url}, PATH)
    assert problem in str(info.value) and PASSWORD not in str(info.value)


def test_a_url_that_is_not_a_string_is_refused_without_showing_it():
    with pytest.raises(ConfigError, match=r"^secondary_tiers\[0\]\.url: expected a string") as info:
        RedisSettings.from_params({"url": 6379}, PATH)
    assert "6379" not in str(info.value)


def test_a_password_file_next_to_a_password_in_the_url_is_refused():
    params = {"url": f"redis://:{PASSWORD}@cache", "password_file": "/etc/redis.pass"}
    with pytest.raises(ConfigError, match=r"^secondary_tiers\[0\]\.password_file: the url holds"):
        RedisSettings.from_params(params, PATH)


def test_a_cluster_has_database_zero_only():
    with pytest.raises(ConfigError, match=r"^secondary_tiers\[0\]\.url: a Redis Cluster has"):
        RedisSettings.from_params({"url": "redis://cache/3", "cluster": True}, PATH)


def test_tls_files_need_a_rediss_url_and_a_certificate_needs_its_key():
    with pytest.raises(ConfigError, match=r"^secondary_tiers\[0\]\.tls_ca_file: needs a rediss"):
        RedisSettings.from_params({"url": "redis://cache", "tls_ca_file": "/ca.pem"}, PATH)
    with pytest.raises(ConfigError, match=r"^secondary_tiers\[0\]\.tls_key_file: is required"):
        RedisSettings.from_params({"url": "rediss://cache", "tls_cert_file": "/c.pem"}, PATH)


@pytest.mark.parametrize(
    ("params", "key"),
    [
        ({"ttl_s": 0}, "ttl_s"),
        ({"ttl_s": 1.5}, "ttl_s"),
        ({"max_connections": 0}, "max_connections"),
        ({"connect_timeout_s": 0}, "connect_timeout_s"),
        ({"cluster": "yes"}, "cluster"),
        ({"servers": "cache:6379"}, "servers"),
    ],
)
def test_a_bad_or_unknown_setting_is_named_by_its_path(params, key):
    with pytest.raises(ConfigError, match=rf"^secondary_tiers\[0\]\.{key}: "):
        RedisSettings.from_params(params, PATH)


def test_the_value_size_and_the_deadline_are_derived_once_from_the_engine():
    settings = RedisTier.settings_for(context(job_timeout_s=12.0), {})
    assert settings.value_bytes == HEADER_BYTES + CHUNK
    assert settings.job_deadline_s == pytest.approx(8.0)  # two thirds of job_timeout_s


def test_a_pipeline_carries_at_least_one_chunk():
    ctx = context()
    assert (
        RedisTier.settings_for(ctx, {"pipeline_bytes": 3 * (HEADER_BYTES + CHUNK)}).pipeline_chunks
        == 3
    )
    assert RedisTier.settings_for(ctx, {"pipeline_bytes": HEADER_BYTES + 1}).pipeline_chunks == 1


def test_a_chunk_bigger_than_the_servers_values_says_what_to_raise():
    ctx = TierContext(None, 4 << 20, "ns", "1:redis")  # type: ignore[arg-type]
    with pytest.raises(
        ConfigError, match=r"^secondary_tiers\[0\]\.max_value_bytes: .* proto-max-bulk-len"
    ):
        RedisTier.settings_for(ctx, {"max_value_bytes": 1 << 20})


def test_a_deadline_at_or_beyond_the_job_timeout_is_refused():
    with pytest.raises(ConfigError, match=r"^secondary_tiers\[0\]\.job_deadline_s: must be below"):
        RedisTier.settings_for(context(job_timeout_s=5.0), {"job_deadline_s": 5})


def test_plan_shows_every_effective_value_and_no_password(tmp_path, capsys):
    extra = {
        "spec_name": "TieringOffloadingSpec",
        "cpu_bytes_to_use": 1 << 20,
        "secondary_tiers": [
            {"type": "redis", "url": f"redis://kv:{PASSWORD}@cache:6380/1", "ttl_s": 600}
        ],
    }
    config = tmp_path / "extra.json"
    config.write_text(json.dumps(extra))
    assert main(["plan", "--kv-bytes-per-block", "131072", "--config", str(config), "--json"]) == 0
    out = capsys.readouterr().out
    assert PASSWORD not in out
    [listed] = json.loads(out)["tiers"]
    assert listed["class"] == "kvtier.tiers.redis.RedisTier"
    assert listed["settings"] == {
        "url": "redis://kv@cache:6380/1",
        "password": "<hidden>",
        "password_file": None,
        "cluster": False,
        "ttl_s": 600,
        "max_connections": 8,
        "connect_timeout_s": 2.0,
        "max_value_bytes": 512 << 20,
        "tls_ca_file": None,
        "tls_cert_file": None,
        "tls_key_file": None,
        "pipeline_bytes": 4 << 20,
        "job_deadline_s": pytest.approx(20.0),
        "value_bytes": HEADER_BYTES + 131072,
        "pipeline_chunks": (4 << 20) // (HEADER_BYTES + 131072),
    }


# ------------------------------------------------------------- start, passwords


async def test_start_names_the_url_when_nothing_answers():
    redis = tier(context(), url=f"redis://127.0.0.1:{free_port()}")
    with pytest.raises(ConfigError, match=r"^secondary_tiers\[0\]\.url: cannot reach Redis"):
        await redis.start()
    await redis.aclose()


async def test_a_wrong_password_in_the_url_fails_the_start_without_showing_it():
    async with RedisServer(password=PASSWORD) as server:
        redis = tier(context(), url=f"redis://:wrong-one@127.0.0.1:{server.port}")
        with pytest.raises(ConfigError, match=r"^secondary_tiers\[0\]\.url: .* refused") as info:
            await redis.start()
        assert "wrong-one" not in str(info.value)
        await redis.aclose()


async def test_a_server_that_asks_for_a_password_fails_a_start_without_one():
    async with RedisServer(password=PASSWORD) as server:
        redis = tier(context(), url=server.url)
        with pytest.raises(
            ConfigError, match=r"^secondary_tiers\[0\]\.url: .* asks for a password"
        ):
            await redis.start()
        await redis.aclose()


async def test_a_wrong_password_file_is_named_at_start(tmp_path):
    async with RedisServer(password=PASSWORD) as server:
        redis = tier(context(), url=server.url, password_file=str(secret_file(tmp_path, "nope")))
        with pytest.raises(ConfigError, match=r"^secondary_tiers\[0\]\.password_file: .* refused"):
            await redis.start()
        await redis.aclose()


@pytest.mark.parametrize(("mode", "problem"), [(0o640, "chmod 600"), (0o604, "chmod 600")])
async def test_a_password_file_others_may_read_fails_the_start(tmp_path, mode, problem):
    path = secret_file(tmp_path, PASSWORD, mode)
    redis = tier(context(), url=f"redis://127.0.0.1:{free_port()}", password_file=str(path))
    with pytest.raises(ConfigError, match=r"^secondary_tiers\[0\]\.password_file: ") as info:
        await redis.start()
    assert problem in str(info.value) and PASSWORD not in str(info.value)
    await redis.aclose()


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any file")
async def test_an_unreadable_password_file_fails_the_start(tmp_path):
    path = secret_file(tmp_path, PASSWORD, 0o000)
    redis = tier(context(), url=f"redis://127.0.0.1:{free_port()}", password_file=str(path))
    with pytest.raises(ConfigError, match=r"^secondary_tiers\[0\]\.password_file: cannot open"):
        await redis.start()
    await redis.aclose()


async def test_a_missing_password_file_fails_the_start(tmp_path):
    path = tmp_path / "absent.pass"
    redis = tier(context(), url=f"redis://127.0.0.1:{free_port()}", password_file=str(path))
    with pytest.raises(ConfigError, match=r"^secondary_tiers\[0\]\.password_file: cannot open"):
        await redis.start()
    await redis.aclose()


async def test_a_tier_with_the_password_from_its_file_stores_and_loads_byte_exact(tmp_path):
    async with RedisServer(password=PASSWORD) as server:
        ctx = context()
        path = secret_file(tmp_path, PASSWORD)
        redis = tier(ctx, url=server.url, password_file=str(path))
        await redis.start()
        try:
            await round_trip(ctx, redis, "password-file")
        finally:
            await redis.aclose()


async def test_a_user_in_the_url_signs_in_with_the_password_from_the_file(tmp_path):
    async with RedisServer(password=PASSWORD) as server:
        async with server.client() as admin:
            await admin.acl_setuser(
                "kv", enabled=True, passwords=["+kv-password"], keys=["*"], commands=["+@all"]
            )
        path = secret_file(tmp_path, "kv-password")
        url = f"redis://kv@127.0.0.1:{server.port}/0"
        wrong = tier(
            context(),
            url=url,
            password_file=str(secret_file(tmp_path, PASSWORD, name="other.pass")),
        )
        with pytest.raises(ConfigError, match=r"^secondary_tiers\[0\]\.password_file: .* refused"):
            await wrong.start()
        await wrong.aclose()
        ctx = context()
        redis = tier(ctx, url=url, password_file=str(path))
        await redis.start()
        try:
            await round_trip(ctx, redis, "acl-user")
        finally:
            await redis.aclose()


# ------------------------------------------------------------------ values


async def test_a_job_bigger_than_a_pipeline_goes_in_parts_and_comes_back_byte_exact():
    async with RedisServer() as server:
        ctx = context(chunks=10)
        redis = tier(ctx, url=server.url, pipeline_bytes=2 * (HEADER_BYTES + CHUNK))
        await redis.start()
        try:
            ks = keys("parts", 5)
            for slot in range(5):
                ctx.primary_view[slot][:] = bytes([slot + 1]) * CHUNK
            assert (await redis.store(job(1, ks, [0, 1, 2, 3, 4], promotion=False))).success
            result = await redis.load(job(2, ks, [9, 8, 7, 6, 5], promotion=True))
            assert result.success and list(result.successful_keys or ()) == ks
            for slot in range(5):
                assert bytes(ctx.primary_view[9 - slot]) == bytes([slot + 1]) * CHUNK
        finally:
            await redis.aclose()


async def test_a_value_the_server_already_holds_is_kept_and_counted_as_skipped():
    async with RedisServer() as server:
        ctx = context()
        redis = tier(ctx, url=server.url)
        await redis.start()
        try:
            ks = keys("twice", 1)
            ctx.primary_view[0][:] = bytes([1]) * CHUNK
            await redis.store(job(1, ks, [0], promotion=False))
            ctx.primary_view[0][:] = bytes([2]) * CHUNK
            result = await redis.store(job(2, ks, [0], promotion=False))
            assert result.success and result.transfer_bytes == 0
            assert ctx.metrics.total(STORES_SKIPPED, (ctx.tier_name,)) == 1
            value = await server.read_value(redis.value_name(ks[0]))
            assert value is not None and value[HEADER_BYTES:] == bytes([1]) * CHUNK
        finally:
            await redis.aclose()


async def test_values_live_ttl_s_and_a_lookup_that_finds_one_renews_it():
    async with RedisServer() as server:
        ctx = context()
        redis = tier(ctx, url=server.url, ttl_s=100)
        await redis.start()
        try:
            [key] = keys("ttl", 1)
            name = redis.value_name(key)
            await redis.store(job(1, [key], [0], promotion=False))
            assert 0 < await server.ttl_ms(name) <= 100_000
            async with server.client() as client:
                await client.pexpire(name, 5_000)
            assert list(await redis.lookup([key])) == [True]
            assert await server.ttl_ms(name) > 5_000
        finally:
            await redis.aclose()


async def test_without_ttl_s_values_never_expire():
    async with RedisServer() as server:
        ctx = context()
        redis = tier(ctx, url=server.url)
        await redis.start()
        try:
            [key] = keys("forever", 1)
            await redis.store(job(1, [key], [0], promotion=False))
            assert await server.ttl_ms(redis.value_name(key)) == -1
        finally:
            await redis.aclose()


@pytest.mark.parametrize(
    ("how", "problem"),
    [
        ("flip_payload", "payload checksum mismatch"),
        ("flip_header", "header"),
        ("truncate", "truncated value"),
        ("append", "oversize value"),
        ("foreign", "foreign namespace"),
    ],
)
async def test_a_damaged_value_is_counted_deleted_and_never_served(how, problem, caplog):
    async with RedisServer() as server:
        ctx = context()
        redis = tier(ctx, url=server.url)
        other = context(namespace="kvtier/another-namespace")
        foreign = tier(other, url=server.url)
        await redis.start()
        await foreign.start()
        try:
            [key] = keys(f"damaged-{how}", 1)
            name = redis.value_name(key)
            ctx.primary_view[0][:] = bytes([5]) * CHUNK
            await redis.store(job(1, [key], [0], promotion=False))
            if how == "foreign":
                # Another namespace's chunk under this key, written where this tier looks.
                other.primary_view[0][:] = bytes([5]) * CHUNK
                await foreign.store(job(1, [key], [0], promotion=False))
                value = await server.read_value(foreign.value_name(key))
            else:
                value = await server.read_value(name)
            assert value is not None
            await server.write_value(name, value if how == "foreign" else damaged(value, how))
            ctx.primary_view[1][:] = bytes([0]) * CHUNK
            result = await redis.load(job(2, [key], [1], promotion=True))
            assert not result.success and list(result.successful_keys or ()) == []
            assert ctx.counters.integrity_failures == 1
            assert problem in caplog.text
            assert await server.read_value(name) is None
            assert list(await redis.lookup([key])) == [False]
        finally:
            await redis.aclose()
            await foreign.aclose()


async def test_a_tier_used_before_start_or_after_close_fails_its_job():
    redis = tier(context(), url=f"redis://127.0.0.1:{free_port()}")
    with pytest.raises(Exception, match="not started, or closed"):
        await redis.lookup(keys("early", 1))
    await redis.aclose()
    await redis.aclose()


# ------------------------------------------------------- a server that dies


async def test_a_server_that_stops_answering_fails_the_request_at_the_deadline_and_none_after():
    async with RedisServer() as server:
        ctx = context(job_timeout_s=1.5)
        redis = tier(ctx, url=server.url)
        deadline_s = redis.settings.job_deadline_s
        await redis.start()
        try:
            [key] = keys("paused", 1)
            ctx.primary_view[0][:] = bytes([3]) * CHUNK
            await redis.store(job(1, [key], [0], promotion=False))
            server.pause()
            try:
                started = time.monotonic()
                with pytest.raises(TimeoutError):
                    await redis.lookup([key])
                # Far above the deadline (1 s) for a loaded machine, far below a hang.
                assert time.monotonic() - started < deadline_s + 5
            finally:
                server.resume()
            # The connection of the request cut short is gone: the answers that reach
            # the tier now are those of its own requests.
            assert list(await redis.lookup([key, *keys("absent", 1)])) == [True, False]
            assert (await redis.load(job(2, [key], [1], promotion=True))).success
            assert bytes(ctx.primary_view[1]) == bytes([3]) * CHUNK
        finally:
            await redis.aclose()


async def test_a_server_killed_mid_run_is_a_counted_miss_and_serves_again_once_restarted(
    engine_id,
):
    async with RedisServer() as server:
        await server_killed_mid_run(engine_id, server, {"type": "redis", "url": server.url}, CHUNK)


async def test_a_server_restarted_while_the_tier_is_idle_loses_no_store_after_it(engine_id):
    async with RedisServer() as server:
        await server_restarted_while_idle(
            engine_id, server, {"type": "redis", "url": server.url}, CHUNK
        )


# ------------------------------------------------------------- cluster, TLS


@pytest.mark.slow
async def test_a_cluster_spreads_the_chunks_over_its_masters_and_serves_them_byte_exact(
    engine_id,
):
    async with RedisClusterServers() as cluster:
        # A tier told the cluster is a plain server is stopped at start.
        plain = tier(context(), url=cluster.url)
        with pytest.raises(ConfigError, match=r"^secondary_tiers\[0\]\.cluster: .* set cluster"):
            await plain.start()
        await plain.aclose()

        tier_params = {"type": "redis", "url": cluster.url, "cluster": True}
        config = tiering_config(engine_id, [tier_params], chunks=8, kv_bytes_per_block=CHUNK)
        generator = torch.Generator().manual_seed(5)
        cache = torch.randint(0, 256, (64, CHUNK), dtype=torch.uint8, generator=generator)
        async with KVTier(config, [cache]) as kv:
            ks = keys("cluster", 16)
            await store_all(kv, ks)
            await kv.reset()
            for server in cluster.servers:
                async with server.client() as client:
                    assert await client.dbsize() > 0, f"master {server.port} holds no chunk"
            assert await kv.lookup(ks[:8], "read", timeout=30) == 8
            assert await kv.load(ks[:8], list(range(32, 40)), "read") == 8
            kv.finish("read")
            assert torch.equal(cache[32:40], cache[0:8])
            # A clear reaches every master.
            assert await kv.clear() == []
            for server in cluster.servers:
                async with server.client() as client:
                    assert await client.dbsize() == 0


@pytest.mark.slow
async def test_a_cluster_master_killed_fails_jobs_quickly_and_the_rest_serve_once_it_is_back():
    async with RedisClusterServers() as cluster:
        ctx = context(chunks=16, job_timeout_s=3.0)
        redis = tier(ctx, url=cluster.url, cluster=True)
        deadline_s = redis.settings.job_deadline_s
        await redis.start()
        try:
            ks = keys("master-down", 8)
            for slot in range(8):
                ctx.primary_view[slot][:] = bytes([slot + 1]) * CHUNK
            assert (await redis.store(job(1, ks, list(range(8)), promotion=False))).success
            victim = cluster.servers[1]
            async with victim.client() as client:
                lost = {name.decode() for name in await client.keys("*")}
            assert 0 < len(lost) < len(ks), "the keys do not spread over the masters"
            await victim.kill()
            started = time.monotonic()
            with pytest.raises(RedisConnectionError):
                await redis.lookup(ks)
            assert time.monotonic() - started < deadline_s + 5
            # Back, empty, in its place in the cluster: its chunks are misses, the
            # others' are served byte-exact.
            await victim.start()
            answers = await answered(redis, ks, CLUSTER_BACK_S)
            assert answers == [redis.value_name(key) not in lost for key in ks]
            kept = [i for i, present in enumerate(answers) if present]
            result = await redis.load(
                job(2, [ks[i] for i in kept], [8 + i for i in kept], promotion=True)
            )
            assert result.success
            for i in kept:
                assert bytes(ctx.primary_view[8 + i]) == bytes([i + 1]) * CHUNK
        finally:
            await redis.aclose()


# A restarted master rejoins its cluster, which serves again, within seconds here.
CLUSTER_BACK_S = 60.0


async def answered(redis: RedisTier, ks: list[bytes], within_s: float) -> list[bool]:
    """The tier's answers to a lookup of ``ks``, asked again until one comes."""
    give_up = time.monotonic() + within_s
    while (answers := await lookup_or_none(redis, ks)) is None:
        assert time.monotonic() < give_up, f"no answer from the cluster in {within_s:g} s"
        await anyio.sleep(0.2)
    return answers


async def lookup_or_none(redis: RedisTier, ks: list[bytes]) -> list[bool] | None:
    try:
        return list(await redis.lookup(ks))
    except Exception:
        return None


async def test_a_rediss_url_stores_and_loads_over_tls_and_checks_the_certificate(tmp_path):
    files = tls_files(tmp_path)
    async with RedisServer(tls=files) as server:
        # Without the authority that signed it, the server's certificate is refused.
        untrusted = tier(context(), url=server.url)
        with pytest.raises(ConfigError, match=r"^secondary_tiers\[0\]\.url: cannot reach") as info:
            await untrusted.start()
        assert "certificate verify failed" in str(info.value)
        await untrusted.aclose()

        ctx = context()
        redis = tier(ctx, url=server.url, tls_ca_file=str(files.ca))
        await redis.start()
        try:
            await round_trip(ctx, redis, "tls")
        finally:
            await redis.aclose()


# ------------------------------------------------------- two engine processes


@pytest.mark.slow
async def test_two_engine_processes_share_chunks_through_one_server_and_no_other_model_sees_them(
    engine_id,
):
    async with RedisServer() as server:
        spawn = multiprocessing.get_context("spawn")
        children = [
            spawn.Process(
                target=redis_procs.engine, args=(f"{engine_id}-{mine}", server.url, mine, theirs)
            )
            for mine, theirs in ((1, 2), (2, 1))
        ]
        for child in children:
            child.start()
        for child in children:
            child.join(120)
            if child.exitcode is None:
                child.kill()
                child.join()
        assert [child.exitcode for child in children] == [0, 0]

        both = keys("engine-1", redis_procs.CHUNKS) + keys("engine-2", redis_procs.CHUNKS)
        for model, seen in ((redis_procs.MODEL, 8), ("another-model", 0)):
            config = tiering_config(
                f"{engine_id}-{model}",
                [{"type": "redis", "url": server.url}],
                chunks=2 * redis_procs.CHUNKS,
                kv_bytes_per_block=redis_procs.BLOCK,
                model_name=model,
            )
            cache = torch.zeros((redis_procs.GPU_BLOCKS, redis_procs.BLOCK), dtype=torch.uint8)
            async with KVTier(config, [cache]) as kv:
                assert await kv.lookup(both[:8], "one", timeout=30) == seen
                kv.finish("one")
                assert await kv.lookup(both[8:], "two", timeout=30) == seen
                kv.finish("two")
